// Time per step in three modes on one device, in one run (issue #13): (a) a
// kernel per fused group, (b) the same captured into a CUDA Graph, (c) one
// megakernel per phase; each against the memory floor, the bytes the step
// must move once (what it reads and does not compute: inputs and weights;
// what it leaves: outputs and updated state) over the device's copy bandwidth.
//
//   bench_megakernel [--runs N] [--blocks N] [--modes LIST] [--emulate] GRAPH... [--step GRAPH...]
//
// GRAPH's forward phase is timed; after --step, a training graph's whole
// step (forward, backward, update). Each mode's time is the mean of N runs
// back to back after a warm-up (Instance::time_runs: CUDA events around the
// batch). bench/gpu_check.sh runs it with bench/decoder_graph.py's decoder
// block and 12-block stack and examples/train_mlp.json; bench/decoder_torch.py
// times PyTorch on the same block. --emulate runs it in the host emulation
// (a smoke test: its times are the CPU's, not a GPU's). --modes: a comma-separated
// subset of kernels,cuda-graph,megakernel (bench/gpu_check.sh times the flash
// attention kernels alone: as a megakernel, attention over 1024 keys is unfused).
// The graph's inputs hold uniform random values in [-1, 1) (never zeros, which
// can run faster than real data); the FLOP rate is the emitter's count (each
// task's `flops` formula: a causal attention counts its masked half too).
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "jit.h"
#include "pipeline.h"

using namespace cudagen;

namespace {

struct Case {
  std::string path;
  bool step = false;
};

// The bytes the timed phases must move at least once.
// The graph inputs the caller sets: external buffers no task writes.
std::set<int> graph_inputs(const Program& p) {
  std::set<int> read, written;
  for (const BoundTask& t : p.tasks)
    for (const BoundTensor& s : t.tensors)
      if (s.buffer >= 0) (s.sig->written() ? written : read).insert(s.buffer);
  std::set<int> inputs;
  for (int b : read)
    if (!written.count(b) && p.buffers[size_t(b)].storage == Storage::external) inputs.insert(b);
  return inputs;
}

int64_t floor_bytes(const Program& p, const std::set<Phase>& phases) {
  std::set<int> read, written;
  for (const BoundTask& t : p.tasks) {
    if (!phases.count(t.task->phase)) continue;
    for (const BoundTensor& s : t.tensors) (s.sig->written() ? written : read).insert(s.buffer);
  }
  int64_t bytes = 0;
  for (int b : read)
    if (!written.count(b)) bytes += p.buffers[size_t(b)].bytes;
  for (int b : written) {
    const Storage s = p.buffers[size_t(b)].storage;
    if (s == Storage::external || s == Storage::persistent) bytes += p.buffers[size_t(b)].bytes;
  }
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 200, blocks = 0;
  bool emulate = false, step = false, atomic_attention_backward = false, allow_tf32 = false;
  std::string arch;  // the GPU's own target where empty (sm_90a on an H100); sm_90 there runs the portable kernels
  std::vector<std::string> modes = {"kernels", "cuda-graph", "megakernel"};
  const char* usage =
      "usage: bench_megakernel [--runs N] [--blocks N] [--modes kernels,cuda-graph,megakernel] [--emulate] "
      "[--atomic-attention-backward] [--allow-tf32] [--arch sm_XY] GRAPH... [--step GRAPH...]\n";
  std::vector<Case> cases;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--runs" && i + 1 < argc) runs = std::atoi(argv[++i]);
    else if (a == "--blocks" && i + 1 < argc) blocks = std::atoi(argv[++i]);
    else if (a == "--emulate") emulate = true;
    else if (a == "--atomic-attention-backward") atomic_attention_backward = true;
    else if (a == "--allow-tf32") allow_tf32 = true;
    else if (a == "--arch" && i + 1 < argc) arch = argv[++i];
    else if (a == "--modes" && i + 1 < argc) {
      modes.clear();
      for (std::string list = argv[++i]; !list.empty();) {
        const size_t comma = list.find(',');
        modes.push_back(list.substr(0, comma));
        list = comma == std::string::npos ? "" : list.substr(comma + 1);
        if (modes.back() != "kernels" && modes.back() != "cuda-graph" && modes.back() != "megakernel") {
          std::fprintf(stderr, "bench_megakernel: unknown mode '%s'\n%s", modes.back().c_str(), usage);
          return 2;
        }
      }
    }
    else if (a == "--step") step = true;
    else if (!a.empty() && a[0] == '-') {
      std::fprintf(stderr, "%s", usage);
      return 2;
    } else cases.push_back({a, step});
  }
  if (cases.empty() || runs < 1 || modes.empty()) {
    std::fprintf(stderr, "%s", usage);
    return 2;
  }
  std::string device;
  fmt::print("{:<22} {:<6} {:<12} {:>11} {:>11} {:>13} {:>9}\n", "graph", "timed", "mode", "ms/step", "vs kernels",
             "floor / time", "TFLOP/s");
  for (const Case& c : cases) {
    double kernels_ms = 0;
    for (const std::string& mode : modes) {
      JitOptions options;
      options.backend = emulate ? Backend::emulation : Backend::gpu;
      options.compile.emit.step_function = c.step;
      options.compile.emit.atomic_attention_backward = atomic_attention_backward;
      options.compile.emit.allow_tf32 = allow_tf32;
      options.compile.emit.megakernel = mode == "megakernel";
      options.compile.emit.megakernel_blocks = blocks;
      options.gpu.cuda_graph = mode == "cuda-graph";
      options.gpu.arch = arch;
      if (emulate && options.gpu.cuda_graph) continue;  // the emulation has no graphs
      try {
        JitProgram program = JitProgram::from_file(c.path, options);
        Instance instance = program.instantiate();
        device = instance.where();
        if (program.compiled().program.tasks.empty()) continue;
        bool has_init = false;
        for (const BoundTask& t : program.compiled().program.tasks) has_init = has_init || t.task->phase == Phase::init;
        if (has_init) instance.run(Phase::init);
        // Random inputs (what init left alone keeps its values).
        int64_t seed = 1;
        for (int b : graph_inputs(program.compiled().program))
          instance.randomize(buffer_name(program.compiled().program, b), seed++);
        const double ms = c.step ? instance.time_step_runs(runs) : instance.time_runs(Phase::forward, runs);
        if (mode == "kernels") kernels_ms = ms;
        const std::set<Phase> timed = c.step ? std::set<Phase>{Phase::forward, Phase::backward, Phase::update}
                                             : std::set<Phase>{Phase::forward};
        const double bandwidth = instance.copy_bandwidth();
        const double floor_ms =
            bandwidth > 0 ? double(floor_bytes(program.compiled().program, timed)) / bandwidth * 1e3 : 0;
        int64_t flops = 0;
        for (const EmittedKernel& k : program.compiled().emitted.kernels)
          if (timed.count(k.phase) && k.flops > 0) flops += k.flops;
        fmt::print("{:<22} {:<6} {:<12} {:>11.4f} {:>10.2f}x {:>13} {:>9.1f}\n", program.compiled().program.graph.name,
                   c.step ? "step" : "fwd", mode, ms, kernels_ms > 0 ? kernels_ms / ms : 1.0,
                   floor_ms > 0 ? fmt::format("{:.1f}%", 100 * floor_ms / ms) : "-", double(flops) / ms / 1e9);
      } catch (const std::exception& e) {
        fmt::print("{:<22} {:<6} {:<12} failed: {}\n", c.path, c.step ? "step" : "fwd", mode, e.what());
      }
      std::fflush(stdout);
    }
  }
  fmt::print("device: {}; mean of {} runs back to back after a warm-up; 'vs kernels': the kernel-per-group "
             "time over this mode's\n",
             device, runs);
  return 0;
}
