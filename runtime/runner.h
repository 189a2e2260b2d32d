// Runs a compiled program, on a GPU or in the host emulation (an Executor),
// on seeded random inputs (or given ones), once or for several training steps, and checks every graph
// output and updated weight against the float64 reference (docs/architecture.md §9):
// |y - ref| <= rtol * ref_abs + atol, NaN never passes, the arena poisoned first so
// an element no kernel wrote fails.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "executor.h"
#include "host_tensor.h"
#include "pipeline.h"
#include "reference.h"

namespace cudagen {

struct RunOptions {
  uint64_t seed = 1;
  std::string work_dir;  // where the emulated module is built
  // Also check every task on its own: its outputs against the reference
  // computed from the inputs the kernels actually produced, so errors do not
  // compound through the chain. Needs a plan without reuse (every buffer kept).
  bool check_each_task = false;
  // Graph inputs from <inputs_dir>/<task>.<slot>.npy instead of random values
  // (every input must be there, with its dtype and shape); graph outputs
  // written to <outputs_dir>/<task>.<slot>.npy.
  std::string inputs_dir;
  std::string outputs_dir;
  // Graph outputs also compared with <expected_dir>/<task>.<slot>.npy, what
  // another framework computed from the same inputs (the torch exporter
  // writes PyTorch's to OUT/expected): |got - expected| <= 2 (rtol ref_abs +
  // atol), both results within the float64 reference's bound of the exact
  // value. One run only (not with `steps`); every external output must have
  // its file, of its dtype and shape.
  std::string expected_dir;
  // Values for run-time arguments ("task.arg" -> value), written to the
  // arena's scalars region before the first phase; the others start at the
  // value the graph gives them.
  RunTimeArgs args;
  // The phases to run (empty: every phase the file has). A buffer that only
  // tasks of other phases write is an input then, random or from inputs_dir.
  std::vector<Phase> phases;
  // Training: init once, then `steps` training steps (forward, backward,
  // update; through `cudagen_step` when the file has it), each checked against
  // the reference run from the state the step started from. An int run-time
  // argument named `step` (Adam's) counts them, 1, 2, ..., unless `args` sets
  // it. outputs_dir then also receives the weights and optimizer state, and
  // each tracked scalar's values per step (<task>.<slot>.per_step.npy, f64).
  int steps = 0;
  // Gradient accumulation (a graph whose "training" says
  // "accumulate_gradients"): each step runs forward and backward once per
  // micro-batch, then one update with the mean of their gradients. Each
  // micro-batch reads its own graph inputs: random, or from inputs_dir where
  // <task>.<slot>.npy stacks them, [micro_batches, ...shape] (a file of the
  // input's own shape serves every micro-batch). Each micro-batch is checked
  // on its own, the accumulated gradients with it; the loss per step is the
  // mean of the micro-batches' losses.
  int micro_batches = 1;
};

struct OutputCheck {
  std::string buffer;  // task.slot
  int64_t elements = 0;
  double max_abs_error = 0;
  double worst_ratio = 0;   // max over elements of |y - ref| / (rtol * ref_abs + atol); <= 1 passes
  int64_t failures = 0;
  int64_t first_failure = -1;
  double got = 0, want = 0, bound = 0;  // at the first failure
  int failure_step = 0;      // the training step of the first failure (0: init, or a single run)
  // The largest bound and reference value: a bound above every value could
  // not catch a 100% error, as happens at the end of a deep chain, where
  // first-order bounds compound (check each task then).
  double max_bound = 0, max_reference = 0;
  // Elements whose bound is not finite though their reference value is
  // (ElementVerdict::unbounded): checked to be finite only.
  int64_t unbounded = 0;
  bool loose() const { return max_bound > max_reference && max_reference > 0; }
  bool ok() const { return failures == 0; }
};

// One element against the float64 reference's value `want` and error bound
// (rtol * magnitude + atol). First-order magnitudes compound along a chain,
// and through ill-conditioned steps (a BatchNorm over two values a channel
// multiplies them by about rstd^3 each) they overflow to infinity, and inf * 0
// (a gradient a ReLU masked) to NaN; such a bound bounds nothing. The element
// is then `unbounded`, right where it is finite. NaN never passes.
enum class ElementVerdict { within, outside, unbounded };
ElementVerdict check_element(double got, double want, double bound);
// The magnitude from which a value rounds to an infinity in `dtype` (round
// to nearest): its largest finite value plus half a unit in the last place;
// infinite for f64 and the integers.
double overflow_threshold(DType dtype);

struct CheckedRun {
  std::string where;  // the executor's: "host emulation", "GPU 0: ..."
  double compile_seconds = 0;
  double run_seconds = 0;
  uint64_t seed = 0;
  std::vector<OutputCheck> checks;
  // Against RunOptions::expected_dir's outputs, where given ("want" is the
  // expected value there).
  std::vector<OutputCheck> expected_checks;
  std::string expected_dir;
  std::vector<KernelBytes> kernels;
  int steps = 0;
  // Per training step, each floating scalar a forward task writes to an
  // external slot (the loss): {task.slot, value after step 1, 2, ...}.
  std::vector<std::pair<std::string, std::vector<double>>> step_scalars;
  // Outputs of user ops whose templates give no reference (`reference: none`):
  // not compared, said in the table; the tasks after them are checked on the
  // values the device computed.
  std::vector<std::string> unchecked;
  bool ok() const;
};

// A tensor's value that an .npy file cannot give: the file is missing, or
// its dtype or shape is not the tensor's. The message names both.
struct TensorFileProblem : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The value of `buffer` from the .npy file at `path` (an input from
// --inputs, or the tensor's "data"). Throws TensorFileProblem as above, and
// read_npy's errors (naming the file) for a malformed one.
HostTensor read_tensor_file(const Program& program, int buffer, const std::string& path);
// The values of graph input `buffer` for each of `micro_batches`
// micro-batches from the .npy file at `path`: the slices of one that stacks
// them ([micro_batches, ...shape]), or one value that serves them all (a file
// of the input's own shape). Throws TensorFileProblem as above.
std::vector<HostTensor> read_micro_batch_files(const Program& program, int buffer, const std::string& path,
                                               int micro_batches);

// The relative bound of docs/architecture.md §9 for a dtype.
double relative_tolerance(DType dtype);
// The atol of |y - ref| <= rtol * ref_abs + atol (docs/architecture.md §9): nonzero for f16 only.
double absolute_tolerance(DType dtype);

// Runs and checks on `executor`, which holds the program's arena: the whole
// arena is written before each round and read back after it.
CheckedRun run_and_check(const Compiled& compiled, Executor& executor, const RunOptions& options);

// The same in the host emulation, built in options.work_dir.
CheckedRun run_emulated_and_check(const Compiled& compiled, const RunOptions& options);

// Writes every run-time argument into `arena`'s scalars region: its value in
// `args`, or its initial one. Throws std::runtime_error naming the scalars
// that exist when `args` names one that does not, or gives a value of the
// wrong kind (a float for an int).
void write_scalars(const Compiled& compiled, const RunTimeArgs& args, unsigned char* arena);
// The same bytes on their own: the arena's scalars region, plan.scalars_bytes
// bytes at plan.scalars_offset.
std::vector<unsigned char> scalars_region(const Compiled& compiled, const RunTimeArgs& args);

// Where a call of the phases stands in training: the step's number (from 1;
// 0 for a call outside training), and of a step over several micro-batches,
// which one forward and backward compute and how many the update averages.
struct StepPosition {
  int64_t step = 0;
  int micro_batch = 0;
  int micro_batches = 1;
};

// `args` with the run-time arguments a training step sets: each int one
// named `step` (Adam's bias correction) set to the step's number, unless
// `args` already sets it; gradient accumulation's `micro_batch` and
// `micro_batches`, always. `args` unchanged for step 0 (not a training step).
RunTimeArgs with_step_position(const Compiled& compiled, RunTimeArgs args, const StepPosition& at);

// Whether the program sums its gradients over micro-batches (derived with
// "accumulate_gradients"): it has the run-time `micro_batch` argument.
bool accumulates_gradients(const Compiled& compiled);

// A table for the terminal.
std::string format_run(const CheckedRun& run);

}  // namespace cudagen
