// The C++ API (docs/architecture.md §7): a graph in, a running program out, in a
// handful of calls, in the shape of NVIDIA's Jitify:
//
//   cudagen::JitProgram program = cudagen::JitProgram::from_file("mlp.json");  // generate + compile (cached)
//   cudagen::Instance mlp = program.instantiate();                             // one arena
//   mlp.set("fc1.a", inputs);                                                  // inputs, weights
//   mlp.run(cudagen::Phase::forward);
//   cudagen::HostTensor probs = mlp.read("probs.out");
//
// The program runs on the GPU where a driver and a device are found (NVRTC
// compiles it for the device's architecture, through the disk cache), else
// in the host emulation (Backend::automatic; JitOptions::backend chooses).
// This library links neither libclang nor LLVM, nor libcuda: the driver and
// NVRTC are loaded when first needed.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "driver.h"
#include "host_tensor.h"
#include "pipeline.h"
#include "profile.h"
#include "reference.h"

namespace cudagen {

enum class Backend { automatic, gpu, emulation };
const char* to_string(Backend backend);

// Resolves Backend::automatic: the GPU when the driver finds device
// `device`, else the emulation; `why` receives a line saying which and why,
// `gpu_found` the GPU where it is one.
Backend choose_backend(Backend requested, int device, std::string* why, GpuInfo* gpu_found = nullptr);

// A megakernel's blocks in the host emulation when the options leave the
// count to the device (megakernel_blocks 0): every block's threads run at once
// as fibers there, and a GPU's 132 would be 33,792 of them.
inline constexpr int kEmulatedMegakernelBlocks = 8;

struct JitOptions {
  Backend backend = Backend::automatic;
  // The generator's options: memory plan (reuse, budget), emit (step function).
  // Reuse off keeps every tensor readable with Instance::read.
  CompileOptions compile;
  // GPU: device, architecture, disk cache, CUDA Graphs, profiling, arena budget.
  GpuOptions gpu;
  // Emulation: where the host compiler builds the module (empty: a folder in /tmp).
  std::string work_dir;
  // Progress lines ("NVRTC: cache hit ..."); none when empty.
  std::function<void(const std::string&)> progress;
};

class Instance;

// A graph compiled for one backend, ready for any number of instances.
// Cheap to copy: copies share the compiled code.
class JitProgram {
 public:
  // Throws CompileError (with diagnostics naming file, task and slot) for a
  // bad graph, NvrtcError, BuildError or DriverError for the rest.
  static JitProgram from_file(const std::string& graph_path, JitOptions options = {});
  static JitProgram from_graph(TaskGraph graph, JitOptions options = {});

  Backend backend() const;  // gpu or emulation, never automatic
  const Compiled& compiled() const;
  const std::string& cuda_source() const;
  const std::string& manifest() const;
  // How the device code was built: "NVRTC for sm_90: 1.20 s (cache miss;
  // stored in PATH)", "host compiler (emulation build in DIR): 2.10 s", and
  // NVRTC's warnings if it had any.
  const std::string& build_report() const;

  // Allocates one arena (under JitOptions::gpu.budget_bytes on a GPU).
  Instance instantiate() const;

  struct State;

 private:
  explicit JitProgram(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  std::shared_ptr<const State> state_;
};

// One arena of a program: its inputs, weights, optimizer state and outputs.
// Tensors are named "task.slot" as in the graph, or by the slot's "name"
// (either works); a name that does not exist gets an error listing the ones
// that do. Tensors whose slot gives "data" (an imported model's weights) are
// loaded from their .npy files when the instance is made.
class Instance {
 public:
  Instance(Instance&&) noexcept;
  Instance& operator=(Instance&&) noexcept;
  ~Instance();

  std::string where() const;  // "GPU 0: ... (sm_90)" or "host emulation"
  std::vector<std::string> tensor_names() const;

  // Host data into a tensor; its dtype and shape must be the tensor's.
  void set(const std::string& tensor, const HostTensor& value);
  // Doubles rounded to the tensor's dtype; as many as it has elements.
  void set(const std::string& tensor, const std::vector<double>& values);
  void fill(const std::string& tensor, double value);
  // Uniform in [low, high) from the init ops' counter-based generator (the
  // numbers an `uniform` init task with this seed draws).
  void randomize(const std::string& tensor, int64_t seed, double low = -1, double high = 1);
  // A run-time argument ("task.arg", one whose JSON says "runtime": true),
  // for the following runs; no recompilation.
  void set_arg(const std::string& name, ArgValue value);

  // (Re)loads every tensor whose slot gives "data" from its .npy file.
  // Throws naming the file and the tensor when one is missing or does not
  // match the tensor's dtype and shape.
  void load_data();

  // Runs a phase (its kernels in order) and waits for it.
  void run(Phase phase);
  // Mean milliseconds per run of a phase (or of a whole training step with
  // `step`), `runs` runs back to back after one warm-up: Executor::time_runs.
  // With `step`, the program must have been compiled with a step function.
  double time_runs(Phase phase, int runs);
  double time_step_runs(int runs);
  // GPU: the device's copy bandwidth in bytes per second, measured now
  // (Executor::copy_bandwidth); 0 in emulation.
  double copy_bandwidth();
  // One training step: forward, backward, update. An int run-time argument
  // named `step` (Adam's) is set to the step's number, 1, 2, ..., unless
  // set_arg gave it a value.
  void step();
  // One training step over `micro_batches` micro-batches, for a graph whose
  // "training" says "accumulate_gradients": for each, `feed(i)` sets its
  // inputs (with `set`), then forward and backward add its gradients to the
  // accumulators; then one update with their mean. As PyTorch does with each
  // micro-batch's loss divided by their count, and clip_grad_norm_ (where
  // the graph clips) on the sum. Nothing is copied back to the host.
  void step(int micro_batches, const std::function<void(int micro_batch)>& feed);

  // A tensor's current value. Graph inputs, outputs and persistent tensors
  // always hold theirs; an intermediate one only while no later buffer has
  // taken its memory: where static reuse gave it away, this throws saying
  // which buffer did and that JitOptions::compile.plan.placement.reuse =
  // false (`--no-reuse`) keeps every tensor.
  HostTensor read(const std::string& tensor) const;
  HostTensor get_tensor(const std::string& task, const std::string& slot) const { return read(task + "." + slot); }

  // Per-kernel times of the last run (GPU, with gpu.profile set).
  std::vector<KernelTime> kernel_times() const;

  // Runs each phase (options.phases, or all) and measures where its time and
  // bytes go (docs/profiling.md): on a GPU each kernel's median time over
  // options.runs runs after warm-up, in emulation the bytes each kernel read
  // and wrote. The phases compute from the tensors set so far; afterwards
  // every tensor holds what it held before. format_profile, profile_json and
  // profile_trace present the result.
  Profile profile(const ProfileOptions& options = {});

 private:
  friend class JitProgram;
  Instance(std::shared_ptr<const JitProgram::State> program, std::unique_ptr<Executor> executor);
  int buffer_index(const std::string& tensor) const;
  // The arguments set so far, and those training sets (`step` counting the
  // steps, the micro-batch), into the arena.
  void write_scalars_region(const RunTimeArgs& args, int micro_batch = 0, int micro_batches = 1);
  void run_if_present(Phase phase, bool& any);

  std::shared_ptr<const JitProgram::State> program_;
  std::unique_ptr<Executor> executor_;
  RunTimeArgs args_;  // what set_arg gave
  int64_t steps_ = 0;
};

}  // namespace cudagen
