// What fusion saves, per graph and phase, without a GPU (issues #6, #12):
// launches (a kernel, or kernels that share a launch under rule horizontal), and device-memory bytes unfused, fused, and the minimum
// any schedule needs (every tensor the phase reads from outside it read once,
// every tensor that leaves the phase written once, nothing else). The bytes
// are measured: each program runs in the host emulation on random inputs and
// the profiler counts every load and store of every kernel (a matmul reads its
// operands once per tile, a softmax its row three times). The emitter's model
// (each kernel reads each tensor it takes once: EmittedKernel::bytes_read and
// bytes_written) is printed beside them, with its ratio to the minimum. A
// training graph gets a row `step` too: forward, backward and update
// together. The unfused figures are the baseline of the same run.
//   bench_fusion [--no-fuse-rule NAME]... GRAPH.json...
// (--no-fuse-rule: the fused figures without that rule, to see what it does.)
#include <unistd.h>

#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "pipeline.h"
#include "plan.h"
#include "profile.h"

using namespace cudagen;

namespace {

struct PhaseFigures {
  int tasks = 0;
  int kernels = 0;
  int64_t modelled_bytes = 0;
  int64_t bytes = 0;  // measured
};

// Runs `c` in the emulation (checked against the reference, so the counts
// come from a correct run) and profiles every phase.
std::map<Phase, PhaseFigures> measure(const Compiled& c, const std::string& work_dir) {
  std::map<Phase, PhaseFigures> out;
  for (const auto& t : c.program.tasks)
    if (t.op->view.first.empty()) ++out[t.task->phase].tasks;  // a view runs no kernel, fused or not
  for (const auto& k : c.emitted.kernels) {
    PhaseFigures& f = out[k.phase];
    ++f.kernels;
    f.modelled_bytes += k.bytes_read + k.bytes_written;
  }
  for (const PhaseProfile& p : profile_emulated(c, RunOptions{1, work_dir}).phases) out[p.phase].bytes = p.bytes;
  return out;
}

// The bytes a phase cannot avoid moving: each buffer it reads whose value
// comes from outside it (an input, a weight, a value saved for backward, a
// weight an optimizer updates in place) once, and each buffer it writes that
// is read outside it (a later phase, the caller) once. A view is its source.
std::map<Phase, int64_t> minimum_bytes(const Program& p) {
  std::vector<int> root(p.buffers.size());
  for (size_t b = 0; b < p.buffers.size(); ++b) root[b] = int(b);
  for (auto [view, source] : view_pairs(p)) root[size_t(view)] = source;
  for (size_t b = 0; b < p.buffers.size(); ++b)
    while (root[size_t(root[b])] != root[b]) root[b] = root[size_t(root[b])];
  // Per root buffer: the phases that produce it (an output slot), that write
  // it (output or in place) and that read it, views aside.
  std::vector<std::set<Phase>> produces(p.buffers.size()), writes(p.buffers.size()), reads(p.buffers.size());
  for (const auto& t : p.tasks) {
    if (!t.op->view.first.empty()) continue;
    for (const auto& b : t.tensors) {
      if (b.buffer < 0 || b.sig == nullptr) continue;
      const size_t r = size_t(root[size_t(b.buffer)]);
      if (b.sig->role == SlotRole::output || b.sig->role == SlotRole::scratch) produces[r].insert(t.task->phase);
      if (b.sig->written()) writes[r].insert(t.task->phase);
      if (b.sig->role == SlotRole::input || b.sig->role == SlotRole::weight) reads[r].insert(t.task->phase);
    }
  }
  std::map<Phase, int64_t> out;
  for (size_t r = 0; r < p.buffers.size(); ++r) {
    if (root[r] != int(r)) continue;
    const BufferInfo& info = p.buffers[r];
    for (Phase phase : reads[r])
      if (!produces[r].count(phase)) out[phase] += info.bytes;
    for (Phase phase : writes[r]) {
      bool leaves = info.storage != Storage::transient || info.promoted;
      for (Phase reader : reads[r]) leaves = leaves || reader != phase;
      if (leaves) out[phase] += info.bytes;
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CompileOptions fused_options;
  std::vector<std::string> graphs;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--no-fuse-rule" && i + 1 < argc)
      fused_options.fuse.disabled_rules.push_back(argv[++i]);
    else
      graphs.push_back(arg);
  }
  if (graphs.empty()) {
    std::fprintf(stderr, "usage: %s [--no-fuse-rule NAME]... GRAPH.json...\n", argv[0]);
    return 2;
  }
  const std::string work_dir = fmt::format("/tmp/bench_fusion_{}", ::getpid());
  fmt::print("{:<22} {:<9} {:>6} {:>8} {:>6} {:>11} {:>11} {:>11} {:>9} {:>9} {:>11} {:>9}\n", "graph", "phase", "tasks",
             "unfused", "fused", "bytes unf.", "bytes fused", "minimum", "fused/min", "unf./min", "fused model",
             "model/min");
  auto row = [](const std::string& graph, const std::string& phase, const PhaseFigures& unfused,
                const PhaseFigures& fused, int64_t lower) {
    auto ratio = [&](int64_t bytes) { return lower > 0 ? double(bytes) / double(lower) : 0.0; };
    fmt::print("{:<22} {:<9} {:>6} {:>8} {:>6} {:>11} {:>11} {:>11} {:>9.2f} {:>9.2f} {:>11} {:>9.2f}\n", graph, phase,
               fused.tasks, unfused.kernels, fused.kernels, unfused.bytes, fused.bytes, lower, ratio(fused.bytes),
               ratio(unfused.bytes), fused.modelled_bytes, ratio(fused.modelled_bytes));
  };
  int64_t tasks_all = 0, kernels_all = 0;
  for (const std::string& graph : graphs) {
    CompileOptions unfused_options;
    unfused_options.fuse.enabled = false;
    const Compiled unfused = compile(load_program(graph, {}), unfused_options);
    const Compiled fused = compile(load_program(graph, {}), fused_options);
    const auto u = measure(unfused, work_dir), f = measure(fused, work_dir);
    const auto minimum = minimum_bytes(fused.program);
    // A training step (forward, backward, update) as a whole, besides its
    // phases: the phases still exchange what they save through memory (a
    // phase ends at a launch the caller may read after), so its minimum is
    // the sum of theirs.
    PhaseFigures step_unfused, step_fused;
    int64_t step_lower = 0;
    for (const auto& [phase, figures] : f) {
      const int64_t lower = minimum.count(phase) ? minimum.at(phase) : 0;
      row(fused.program.graph.name, to_string(phase), u.at(phase), figures, lower);
      tasks_all += figures.tasks;
      kernels_all += figures.kernels;
      if (phase == Phase::init) continue;
      for (auto [sum, part] : {std::pair{&step_unfused, &u.at(phase)}, std::pair{&step_fused, &figures}}) {
        sum->tasks += part->tasks;
        sum->kernels += part->kernels;
        sum->bytes += part->bytes;
        sum->modelled_bytes += part->modelled_bytes;
      }
      step_lower += lower;
    }
    if (f.count(Phase::backward)) row(fused.program.graph.name, "step", step_unfused, step_fused, step_lower);
  }
  fmt::print("all graphs: {} tasks in {} launches fused ({:.2f} tasks per launch)\n", tasks_all, kernels_all,
             double(tasks_all) / double(kernels_all));
  return 0;
}
