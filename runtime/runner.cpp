#include "runner.h"

#include "half.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <cstring>
#include <filesystem>
#include <random>

#include <fmt/format.h>

#include "npy.h"
#include "reference.h"
#include "user_reference.h"

namespace cudagen {

bool CheckedRun::ok() const {
  for (const auto& c : checks)
    if (!c.ok()) return false;
  for (const auto& c : expected_checks)
    if (!c.ok()) return false;
  return !checks.empty();
}

double relative_tolerance(DType dtype) {
  switch (dtype) {
    case DType::f64: return 1e-12;
    case DType::f32: return 1e-5;
    case DType::f16: return 5e-3;
    case DType::bf16: return 1e-2;
    case DType::i32:
    case DType::i64: return 0;
  }
  return 0;
}

double absolute_tolerance(DType dtype) {
  // Below the smallest normal number a format's rounding error is absolute,
  // not relative: f16's subnormals are 2^-24 apart. f32 and bf16 reach that
  // range too (a softmax entry of exp(-110) is 7.5e-49, which f32 stores as
  // 0), and a device may flush it to zero (FTZ), so a result within their
  // smallest normal, 2^-126, of the reference passes.
  switch (dtype) {
    case DType::f16: return 0x1p-24;
    case DType::f32:
    case DType::bf16: return 0x1p-126;
    case DType::f64: return 0x1p-1022;
    default: return 0.0;
  }
}

namespace {

// Each buffer's own tolerances: its dtype's, or for what a kernel on the
// TF32 mainloop or the TF32 flash kernel computes (--allow-tf32), at least f16's relative bound: TF32
// keeps f16's 10 mantissa bits, so each product is off by up to 2^-10 of
// |a b| before the f32 sums.
struct Tolerance {
  double relative = 0, absolute = 0;
};
std::vector<Tolerance> own_tolerances(const Compiled& c) {
  const Program& p = c.program;
  std::vector<Tolerance> own(p.buffers.size());
  for (size_t b = 0; b < p.buffers.size(); ++b)
    own[b] = {relative_tolerance(p.buffers[b].dtype), absolute_tolerance(p.buffers[b].dtype)};
  for (const EmittedKernel& k : c.emitted.kernels) {
    if (k.mainloop != MatmulMainloop::pipelined_tf32 && k.mainloop != MatmulMainloop::flash_attention_tf32) continue;
    for (int t : k.tasks)
      for (const BoundTensor& x : p.tasks[size_t(t)].tensors)
        if (x.buffer >= 0 && (x.sig->role == SlotRole::output || x.sig->writes) && own[size_t(x.buffer)].relative > 0)
          own[size_t(x.buffer)].relative = std::max(own[size_t(x.buffer)].relative, relative_tolerance(DType::f16));
  }
  return own;
}

// Each computed buffer's end-to-end tolerances, relative and absolute: its
// own, or the coarsest of the computed buffers it is computed from, where coarser. A
// value computed in f32 and widened to f64 carries f32's rounding (the cast
// is exact, the sums before it were not: checked at f64's 1e-12 it failed
// correct runs), and f32's flush of tiny values (a softmax entry of
// exp(-110) is 0 in f32) is within f32's absolute tolerance, not f64's. The
// graph's inputs are exact (rounded to their dtype before the reference
// reads them), so they pass on nothing. Walked in schedule order, producers
// before readers (a graph file may list tasks in any order). For the outputs'
// end-to-end check; checking each task from its actual inputs uses the
// buffer's own tolerances.
std::vector<Tolerance> computed_tolerances(const Compiled& c) {
  const Program& p = c.program;
  std::vector<Tolerance> own = own_tolerances(c), spread(p.buffers.size());
  std::vector<bool> computed(p.buffers.size(), false);
  for (int t : c.schedule.order) {
    const BoundTask& task = p.tasks[size_t(t)];
    Tolerance inputs;
    for (const BoundTensor& x : task.tensors)
      if (x.buffer >= 0 && x.sig->role != SlotRole::output && computed[size_t(x.buffer)]) {
        const size_t b = size_t(x.buffer);
        inputs.relative = std::max({inputs.relative, own[b].relative, spread[b].relative});
        inputs.absolute = std::max({inputs.absolute, own[b].absolute, spread[b].absolute});
      }
    for (const BoundTensor& x : task.tensors)
      if (x.buffer >= 0 && (x.sig->role == SlotRole::output || x.sig->writes) && own[size_t(x.buffer)].relative > 0) {
        const size_t b = size_t(x.buffer);
        computed[b] = true;
        spread[b].relative = std::max(spread[b].relative, inputs.relative);
        spread[b].absolute = std::max(spread[b].absolute, inputs.absolute);
      }
  }
  for (size_t b = 0; b < p.buffers.size(); ++b)
    own[b] = {std::max(own[b].relative, spread[b].relative), std::max(own[b].absolute, spread[b].absolute)};
  return own;
}

// Random integer inputs index something: embedding ids a table's rows (of
// the table, or of its gradient), labels a loss's classes (the last axis of
// its logits).
int64_t integer_input_range(const Program& p, int buffer) {
  for (const auto& t : p.tasks) {
    const BoundTensor* ids = t.find_tensor("ids");
    const BoundTensor* table = t.find_tensor(t.op->name == "embedding_backward" ? "dtable" : "table");
    if (ids && table && ids->buffer == buffer) return p.buffers[size_t(table->buffer)].shape[0];
    const BoundTensor* labels = t.find_tensor("labels");
    if (labels && labels->buffer == buffer && t.find_tensor("logits"))
      return p.buffers[size_t(t.find_tensor("logits")->buffer)].shape.back();
  }
  return 8;
}

}  // namespace

namespace {

// One call of the launchers between checks: the phases of a single run, init
// before training, or one training step (forward, backward, update).
struct Round {
  std::vector<Phase> phases;
  // Training: the step (1, 2, ...; 0 otherwise) and, where a step runs
  // several micro-batches, which one (forward and backward) and how many.
  StepPosition at;
  bool whole_step = false;  // forward, backward and update: the step function runs it where there is one
};

// Init on its own, then the other phases: what init writes is then read back
// before an update overwrites it in place, so each task can be checked from
// what it read.
std::vector<Round> split_init(const std::vector<Phase>& phases) {
  if (phases.size() < 2 || phases.front() != Phase::init) return {Round{phases}};
  return {Round{{Phase::init}}, Round{std::vector<Phase>(phases.begin() + 1, phases.end())}};
}

std::vector<Round> plan_rounds(const Compiled& c, const RunOptions& options) {
  std::vector<Phase> present;
  for (Phase phase : {Phase::init, Phase::forward, Phase::backward, Phase::update})
    for (const auto& k : c.kernels)
      if (k.phase == phase) {
        present.push_back(phase);
        break;
      }
  auto has = [&](Phase phase) { return std::find(present.begin(), present.end(), phase) != present.end(); };
  if (options.steps < 0) throw std::runtime_error("--steps must be 0 or more");
  if (options.check_each_task && c.plan.reuse)
    throw std::runtime_error("checking each task needs a plan without reuse (compile with reuse off)");
  if (options.check_each_task)
    for (const auto& k : c.kernels)
      if (!k.internal_buffers.empty())
        throw std::runtime_error(fmt::format(
            "checking each task needs every task's output in memory, and kernel {} keeps {} in registers (compile "
            "with fusion off)",
            k.name, buffer_name(c.program, k.internal_buffers.front())));
  if (options.steps > 0) {
    if (!options.phases.empty())
      throw std::runtime_error("give --steps or --phases, not both: a training step runs forward, backward and update");
    if (!has(Phase::update))
      throw std::runtime_error(
          "--steps trains, but this graph has no update phase (add a \"training\" section, or update tasks)");
    const int k = options.micro_batches;
    if (k < 1) throw std::runtime_error(fmt::format("--micro-batches {}: a step needs at least one micro-batch", k));
    if (k > 1 && !accumulates_gradients(c))
      throw std::runtime_error(fmt::format(
          "--micro-batches {} sums each step's gradients over micro-batches, but this graph does not accumulate them: "
          "add \"accumulate_gradients\": true to its \"training\" section",
          k));
    std::vector<Round> rounds;
    if (has(Phase::init)) rounds.push_back(Round{{Phase::init}});
    std::vector<Phase> step, gradients;
    for (Phase phase : {Phase::forward, Phase::backward, Phase::update})
      if (has(phase)) step.push_back(phase);
    for (Phase phase : {Phase::forward, Phase::backward})
      if (has(phase)) gradients.push_back(phase);
    for (int i = 1; i <= options.steps; ++i) {
      if (k == 1) {
        rounds.push_back(Round{step, StepPosition{i, 0, 1}, true});
        continue;
      }
      for (int m = 0; m < k; ++m) rounds.push_back(Round{gradients, StepPosition{i, m, k}});
      rounds.push_back(Round{{Phase::update}, StepPosition{i, 0, k}});
    }
    return rounds;
  }
  if (options.micro_batches != 1)
    throw std::runtime_error("--micro-batches splits training steps: give it with --steps");
  if (options.phases.empty()) return split_init(present);
  for (Phase phase : options.phases)
    if (!has(phase)) throw std::runtime_error(fmt::format("this graph has no {} phase", to_string(phase)));
  std::vector<Phase> chosen;  // in phase order, whatever the order asked
  for (Phase phase : present)
    if (std::find(options.phases.begin(), options.phases.end(), phase) != options.phases.end()) chosen.push_back(phase);
  return split_init(chosen);
}

bool in(const std::vector<Phase>& phases, Phase phase) {
  return std::find(phases.begin(), phases.end(), phase) != phases.end();
}

// Whether a task of `phases` writes the buffer; `computed` only counts
// outputs (an optimizer's in-place update needs a value first).
bool written_in(const Program& p, int buffer, const std::vector<Phase>& phases, bool computed) {
  for (const auto& t : p.tasks) {
    if (!in(phases, t.task->phase)) continue;
    for (const auto& b : t.tensors) {
      if (b.buffer != buffer || b.sig == nullptr) continue;
      if (computed ? (b.sig->role == SlotRole::output || b.sig->role == SlotRole::scratch) : b.sig->written()) return true;
    }
  }
  return false;
}

// Each task of a round against the reference computed from the inputs the
// kernels actually gave it, so that errors do not compound through the chain
// (an end-to-end bound grows with depth). A task reads what the round left,
// except a buffer some task of the round updates in place (a weight, an
// optimizer's state), which the tasks up to that one read as it was before.
template <typename Compare>
void check_each_task(const Compiled& c, const Schedule& round, const std::vector<std::vector<double>>& before,
                     const std::vector<std::vector<double>>& after, const RunTimeArgs& args, const UserOpReferences& user,
                     const std::vector<bool>& unchecked, int step, Compare compare) {
  const Program& p = c.program;
  std::vector<int> updaters(p.buffers.size(), 0);
  for (int t : round.order)
    for (const auto& b : p.tasks[size_t(t)].tensors)
      if (b.sig != nullptr && b.sig->writes && b.sig->role != SlotRole::output) ++updaters[size_t(b.buffer)];
  std::vector<std::vector<double>> seen = after;
  for (size_t b = 0; b < p.buffers.size(); ++b) {
    if (updaters[b] > 1)
      throw std::runtime_error(fmt::format(
          "checking each task is not possible here: {} tasks update '{}' in place in one phase, so what each read "
          "is gone; run without --check-each-task (the outputs and the updated weights are still checked)",
          updaters[b], buffer_name(p, int(b))));
    if (updaters[b] == 1) seen[b] = before[b];
  }
  for (int t : round.order) {
    ReferenceBuffers one = evaluate_task(p, t, seen, args, user);
    for (const auto& bound : p.tasks[size_t(t)].tensors) {
      if (bound.sig == nullptr || !bound.sig->written() || unchecked[size_t(bound.buffer)]) continue;
      size_t b = size_t(bound.buffer);
      compare("task " + p.tasks[size_t(t)].task->id + "." + bound.name, b, after[b], one.value[b], one.abs[b], step,
              /*end_to_end=*/false);
    }
    // The tasks after an update in place read its result (Adam reads the
    // step count loss scaling's update has just advanced).
    for (const auto& bound : p.tasks[size_t(t)].tensors)
      if (bound.sig != nullptr && bound.sig->writes && bound.sig->role != SlotRole::output)
        seen[size_t(bound.buffer)] = after[size_t(bound.buffer)];
  }
}

}  // namespace

std::vector<unsigned char> scalars_region(const Compiled& c, const RunTimeArgs& args) {
  std::vector<std::string> names;
  for (const auto& s : c.plan.scalars) names.push_back(s.name(c.program));
  for (const auto& [name, value] : args) {
    const PlannedScalar* s = c.plan.find_scalar(c.program, name);
    if (s == nullptr)
      throw std::runtime_error(fmt::format("no run-time argument '{}' in this graph; {}", name,
                                           names.empty() ? std::string("it has none (an argument is one when its JSON says "
                                                                       "\"runtime\": true)")
                                                         : fmt::format("it has: {}", fmt::join(names, ", "))));
    const bool number = std::holds_alternative<double>(value) || std::holds_alternative<int64_t>(value);
    const bool fits = s->type == ArgType::float_ ? number
                      : s->type == ArgType::int_ ? std::holds_alternative<int64_t>(value)
                                                 : std::holds_alternative<bool>(value);
    if (!fits)
      throw std::runtime_error(fmt::format("run-time argument '{}' is {}, so {} does not fit it", name,
                                           to_string(s->type), arg_value_to_string(value)));
  }
  const int64_t start = c.plan.scalars_offset;
  std::vector<unsigned char> region(size_t(c.plan.scalars_bytes), 0);
  for (const auto& s : c.plan.scalars) {
    auto it = args.find(s.name(c.program));
    encode_scalar(s.type, it != args.end() ? it->second : s.initial, region.data() + (s.offset - start));
  }
  return region;
}

void write_scalars(const Compiled& c, const RunTimeArgs& args, unsigned char* arena) {
  const std::vector<unsigned char> region = scalars_region(c, args);
  if (!region.empty()) std::memcpy(arena + c.plan.scalars_offset, region.data(), region.size());
}

RunTimeArgs with_step_position(const Compiled& c, RunTimeArgs args, const StepPosition& at) {
  for (const auto& sc : c.plan.scalars) {
    if (sc.type != ArgType::int_ || at.step == 0) continue;
    if (sc.arg == "step") args.emplace(sc.name(c.program), ArgValue(at.step));
    if (sc.arg == "micro_batch") args.insert_or_assign(sc.name(c.program), ArgValue(int64_t(at.micro_batch)));
    if (sc.arg == "micro_batches") args.insert_or_assign(sc.name(c.program), ArgValue(int64_t(at.micro_batches)));
  }
  return args;
}

bool accumulates_gradients(const Compiled& c) {
  for (const auto& sc : c.plan.scalars)
    if (sc.arg == "micro_batch" && c.program.tasks[size_t(sc.task)].op->name == "accumulate") return true;
  return false;
}

HostTensor read_tensor_file(const Program& p, int buffer, const std::string& path) {
  const BufferInfo& info = p.buffers[size_t(buffer)];
  const std::string name = buffer_name(p, buffer);
  if (!std::filesystem::exists(path))
    throw TensorFileProblem(fmt::format("{}: missing; the graph input {} is {} {}{}", path, name, to_string(info.dtype),
                                        shape_to_string(info.shape), path == info.data ? " (its \"data\")" : ""));
  HostTensor array = read_npy(path);
  if (array.dtype != info.dtype || array.shape != info.shape)
    throw TensorFileProblem(fmt::format("{}: {} {}, but the graph input {} is {} {}", path, to_string(array.dtype),
                                        shape_to_string(array.shape), name, to_string(info.dtype),
                                        shape_to_string(info.shape)));
  return array;
}

std::vector<HostTensor> read_micro_batch_files(const Program& p, int buffer, const std::string& path, int micro_batches) {
  if (micro_batches <= 1 || !std::filesystem::exists(path)) return {read_tensor_file(p, buffer, path)};
  const BufferInfo& info = p.buffers[size_t(buffer)];
  HostTensor array = read_npy(path);
  Shape stacked = {micro_batches};
  stacked.insert(stacked.end(), info.shape.begin(), info.shape.end());
  if (array.dtype == info.dtype && array.shape == info.shape) return {std::move(array)};
  if (array.dtype != info.dtype || array.shape != stacked)
    throw TensorFileProblem(fmt::format("{}: {} {}, but the graph input {} is {} {}, or {} stacking one per micro-batch",
                                        path, to_string(array.dtype), shape_to_string(array.shape),
                                        buffer_name(p, buffer), to_string(info.dtype), shape_to_string(info.shape),
                                        shape_to_string(stacked)));
  std::vector<HostTensor> out;
  const size_t bytes = size_t(info.bytes);
  for (int m = 0; m < micro_batches; ++m)
    out.push_back(HostTensor{info.dtype, info.shape,
                             std::vector<unsigned char>(array.data.begin() + long(m * bytes),
                                                        array.data.begin() + long((m + 1) * bytes))});
  return out;
}

// The expected value of graph output `buffer` from the .npy file at `path`
// (RunOptions::expected_dir), as doubles.
std::vector<double> read_expected(const Program& p, int buffer, const std::string& path) {
  const BufferInfo& info = p.buffers[size_t(buffer)];
  const std::string name = buffer_name(p, buffer);
  if (!std::filesystem::exists(path))
    throw TensorFileProblem(fmt::format("{}: missing; --expected needs a file for every graph output, and {} is one ({} "
                                        "{}; the torch exporter writes them to OUT/expected)",
                                        path, name, to_string(info.dtype), shape_to_string(info.shape)));
  const HostTensor array = read_npy(path);
  if (array.dtype != info.dtype || array.shape != info.shape)
    throw TensorFileProblem(fmt::format("{}: {} {}, but the graph output {} is {} {}", path, to_string(array.dtype),
                                        shape_to_string(array.shape), name, to_string(info.dtype),
                                        shape_to_string(info.shape)));
  return array.values();
}

CheckedRun run_and_check(const Compiled& c, Executor& executor, const RunOptions& options) {
  const Program& p = c.program;
  CheckedRun run;
  run.where = executor.where();
  if (!options.expected_dir.empty() && options.steps > 0)
    throw TensorFileProblem(fmt::format("--expected {} compares one run with another framework's outputs; it cannot be "
                                        "combined with --steps {} (run the steps without it)",
                                        options.expected_dir, options.steps));
  run.expected_dir = options.expected_dir;
  run.seed = options.seed;
  run.steps = options.steps;
  const std::vector<Round> rounds = plan_rounds(c, options);
  std::vector<Phase> all_phases;
  for (const auto& r : rounds)
    for (Phase phase : r.phases)
      if (!in(all_phases, phase)) all_phases.push_back(phase);
  executor.set_seed(options.seed);
  // User ops: their templates' reference functions, built on the host; and
  // the outputs of those that give none, unchecked (said in the table).
  UserReferences user =
      build_user_references(p, options.work_dir.empty() ? std::string() : options.work_dir + "/references");
  std::vector<bool> unchecked(p.buffers.size(), false);
  for (const auto& t : p.tasks)
    if (t.op->reference == "none")
      for (const auto& b : t.tensors)
        if (b.sig != nullptr && b.sig->written() && !unchecked[size_t(b.buffer)]) {
          unchecked[size_t(b.buffer)] = true;
          run.unchecked.push_back(fmt::format("{}.{} (op '{}' has `reference: none`)", t.task->id, b.name, t.op->name));
          // The tasks after it are checked on the value it left in memory:
          // that storage must be its own, not reused by a later buffer.
          const PlannedBuffer& mine = c.plan.buffers[size_t(b.buffer)];
          for (const PlannedBuffer& other : c.plan.buffers)
            if (other.buffer != b.buffer && !mine.internal && !other.internal && other.bytes > 0 &&
                other.offset < mine.offset + mine.bytes && mine.offset < other.offset + other.bytes)
              throw std::runtime_error(fmt::format(
                  "op '{}' (task '{}') has no float64 reference (`reference: none`), so what reads its output '{}' "
                  "is checked on the value it leaves in memory; but the memory plan reuses that storage for '{}'. "
                  "Compile with reuse off (cudagen run does so for such graphs; --no-reuse)",
                  t.op->name, t.task->id, b.name, buffer_name(p, other.buffer)));
        }

  // Inputs (what no task of the phases run computes) from .npy files, or fresh
  // random ones rounded to their dtype so that the reference sees what the
  // kernels see.
  std::mt19937_64 rng(options.seed);
  std::vector<std::vector<double>> inputs(p.buffers.size());
  std::vector<unsigned char> arena(size_t(c.plan.arena_bytes), 0xFF);  // poison: unwritten floats are NaN
  // A megakernel's event counters start from zero (each round is a fresh start).
  std::memset(arena.data() + c.emitted.sync_offset, 0, size_t(c.emitted.sync_bytes));
  // Per input, the value each micro-batch reads: one entry where all read the same.
  const int micro_batches = options.steps > 0 ? options.micro_batches : 1;
  std::vector<std::vector<HostTensor>> input_values(p.buffers.size());
  std::vector<std::string> problems;
  for (size_t b = 0; b < p.buffers.size(); ++b) {
    if (written_in(p, int(b), all_phases, /*computed=*/true)) continue;
    // A value in one kernel's registers (of a phase not run) has no storage to fill.
    if (c.plan.buffers[b].internal) continue;
    const BufferInfo& info = p.buffers[b];
    const std::string name = buffer_name(p, int(b));
    const int64_t n = info.bytes / dtype_bytes(info.dtype);
    // A graph input differs from micro-batch to micro-batch; weights and their "data" do not.
    const int versions = info.storage == Storage::external ? micro_batches : 1;
    // A file in inputs_dir, else the tensor's own "data" (imported weights).
    std::string path = options.inputs_dir.empty() ? "" : options.inputs_dir + "/" + name + ".npy";
    if (!info.data.empty() && (path.empty() || !std::filesystem::exists(path))) path = info.data;
    if (!path.empty()) {
      try {
        input_values[b] = read_micro_batch_files(p, int(b), path, versions);
      } catch (const TensorFileProblem& e) {
        problems.push_back(e.what());
        continue;
      }
    } else {
      const bool integer = info.dtype == DType::i32 || info.dtype == DType::i64;
      std::uniform_real_distribution<double> real(-1.0, 1.0);
      std::uniform_int_distribution<int64_t> ints(0, integer ? integer_input_range(p, int(b)) - 1 : 0);
      for (int m = 0; m < versions; ++m) {
        // Stored in the dtype: the reference reads what the kernels read, the value rounded.
        std::vector<unsigned char> bytes(size_t(info.bytes));
        for (int64_t i = 0; i < n; ++i)
          store_element(bytes.data() + i * dtype_bytes(info.dtype), info.dtype, integer ? double(ints(rng)) : real(rng));
        input_values[b].push_back(HostTensor{info.dtype, info.shape, std::move(bytes)});
      }
    }
    std::memcpy(arena.data() + c.plan.buffers[b].offset, input_values[b][0].data.data(), size_t(info.bytes));
    inputs[b] = input_values[b][0].values();
  }
  if (!problems.empty())
    throw std::runtime_error(fmt::format("bad inputs{}:\n  {}", options.inputs_dir.empty() ? "" : " in " + options.inputs_dir,
                                         fmt::join(problems, "\n  ")));

  // Every buffer as the kernels left it.
  auto read_back = [&] {
    std::vector<std::vector<double>> out(p.buffers.size());
    for (size_t b = 0; b < p.buffers.size(); ++b) {
      const BufferInfo& info = p.buffers[b];
      if (c.plan.buffers[b].internal) continue;  // in a fused kernel's registers only
      int64_t n = info.bytes / dtype_bytes(info.dtype);
      for (int64_t i = 0; i < n; ++i)
        out[b].push_back(load_element(arena.data() + c.plan.buffers[b].offset + i * dtype_bytes(info.dtype), info.dtype));
    }
    return out;
  };
  // One check per buffer, the worst over the rounds.
  std::map<std::string, size_t> check_of;
  const std::vector<Tolerance> tolerances = computed_tolerances(c), own_tolerance = own_tolerances(c);
  auto compare = [&](const std::string& name, size_t b, const std::vector<double>& got, const std::vector<double>& want,
                     const std::vector<double>& scale, int step, bool end_to_end) {
    auto [it, added] = check_of.emplace(name, run.checks.size());
    if (added) {
      run.checks.emplace_back();
      run.checks.back().buffer = name;
      run.checks.back().elements = int64_t(got.size());
    }
    OutputCheck& check = run.checks[it->second];
    // End to end, a value keeps the coarsest tolerance it was computed in; one task from its
    // actual inputs, its own (its dtype's, or TF32's).
    const double rtol = end_to_end ? tolerances[b].relative : own_tolerance[b].relative;
    const double atol = end_to_end ? tolerances[b].absolute : own_tolerance[b].absolute;
    const double overflow = overflow_threshold(p.buffers[b].dtype);
    for (int64_t i = 0; i < int64_t(got.size()); ++i) {
      double y = got[size_t(i)], err = std::abs(y - want[size_t(i)]), bound = rtol * scale[size_t(i)] + atol;
      // Beyond the dtype's range the value rounds to an infinity (loss scaling's overflow test relies on it).
      const double stored = std::abs(want[size_t(i)]) >= overflow ? std::copysign(INFINITY, want[size_t(i)]) : want[size_t(i)];
      const ElementVerdict verdict = check_element(y, stored, bound);
      if (!std::isnan(err)) check.max_abs_error = std::max(check.max_abs_error, err);
      if (!std::isnan(want[size_t(i)])) check.max_reference = std::max(check.max_reference, std::abs(want[size_t(i)]));
      if (verdict == ElementVerdict::unbounded) {
        ++check.unbounded;
        continue;
      }
      if (!std::isnan(bound)) check.max_bound = std::max(check.max_bound, bound);
      check.worst_ratio =
          std::max(check.worst_ratio, std::isnan(err) ? INFINITY : bound > 0 ? err / bound : (err > 0 ? INFINITY : 0));
      if (verdict == ElementVerdict::outside && check.failures++ == 0) {
        check.first_failure = i;
        check.failure_step = step;
        check.got = y;
        check.want = want[size_t(i)];
        check.bound = bound;
      }
    }
  };

  // Against another framework's result (RunOptions::expected_dir): each
  // within the end-to-end bound of the exact value, so within twice it of
  // each other.
  auto compare_expected = [&](const std::string& name, size_t b, const std::vector<double>& got,
                              const std::vector<double>& want, const std::vector<double>& scale) {
    OutputCheck check;
    check.buffer = name;
    check.elements = int64_t(got.size());
    const double rtol = 2 * tolerances[b].relative, atol = 2 * tolerances[b].absolute;
    for (int64_t i = 0; i < int64_t(got.size()); ++i) {
      const double y = got[size_t(i)], err = std::abs(y - want[size_t(i)]), bound = rtol * scale[size_t(i)] + atol;
      const ElementVerdict verdict = check_element(y, want[size_t(i)], bound);
      if (!std::isnan(err)) check.max_abs_error = std::max(check.max_abs_error, err);
      if (verdict == ElementVerdict::unbounded) {
        ++check.unbounded;
        continue;
      }
      check.worst_ratio =
          std::max(check.worst_ratio, std::isnan(err) ? INFINITY : bound > 0 ? err / bound : (err > 0 ? INFINITY : 0));
      if (verdict == ElementVerdict::outside && check.failures++ == 0) {
        check.first_failure = i;
        check.got = y;
        check.want = want[size_t(i)];
        check.bound = bound;
      }
    }
    run.expected_checks.push_back(check);
  };

  // The floating scalars forward tasks write to external slots: the loss.
  std::vector<size_t> tracked;
  for (size_t b = 0; b < p.buffers.size(); ++b) {
    const BufferInfo& info = p.buffers[b];
    if (options.steps > 0 && info.storage == Storage::external && info.bytes == dtype_bytes(info.dtype) &&
        info.dtype != DType::i32 && info.dtype != DType::i64 && written_in(p, int(b), {Phase::forward}, true)) {
      tracked.push_back(b);
      run.step_scalars.emplace_back(buffer_name(p, int(b)), std::vector<double>());
    }
  }

  std::vector<double> step_sums(tracked.size(), 0.0);
  std::vector<std::vector<double>> actual;
  for (size_t r = 0; r < rounds.size(); ++r) {
    const Round& round = rounds[r];
    // The reference starts from what this round's kernels start from: the
    // inputs first, then the state the previous rounds left.
    std::vector<std::vector<double>> before = r == 0 ? inputs : actual;
    if (r > 0) {
      // Re-poison what a step computes afresh, so that an element it fails
      // to write shows up in every step, not only the first.
      // (Not where a value shares the storage of an input, a weight or an
      // output: a view of the external input that a weight's gradient reads
      // as rows of a matrix is the input itself.)
      for (size_t b = 0; b < p.buffers.size(); ++b) {
        int root = int(b);
        while (c.plan.buffers[size_t(root)].in_place_of >= 0) root = c.plan.buffers[size_t(root)].in_place_of;
        auto afresh = [](Storage s) { return s == Storage::transient || s == Storage::saved; };
        if (afresh(p.buffers[b].storage) && afresh(p.buffers[size_t(root)].storage))
          std::memset(arena.data() + c.plan.buffers[b].offset, 0xFF, size_t(c.plan.buffers[b].bytes));
      }
    }
    // A micro-batch's own inputs.
    if (in(round.phases, Phase::forward))
      for (size_t b = 0; b < p.buffers.size(); ++b) {
        if (input_values[b].size() < 2) continue;
        const HostTensor& value = input_values[b][size_t(round.at.micro_batch)];
        std::memcpy(arena.data() + c.plan.buffers[b].offset, value.data.data(), value.data.size());
        before[b] = value.values();
      }
    const RunTimeArgs args = with_step_position(c, options.args, round.at);
    write_scalars(c, args, arena.data());

    executor.write(0, arena.data(), arena.size());
    auto start = std::chrono::steady_clock::now();
    if (round.whole_step && executor.has_function(kStepFunction)) {
      executor.run(kStepFunction);
    } else {
      for (Phase phase : round.phases) executor.run(phase_function(phase));
    }
    run.run_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    executor.read(0, arena.data(), arena.size());
    actual = read_back();

    // Graph outputs, and the persistent tensors tasks write (a training step's
    // updated weights and optimizer state).
    Schedule part;
    for (int t : c.schedule.order)
      if (in(round.phases, p.tasks[size_t(t)].task->phase)) part.order.push_back(t);
    user.ops.device = &actual;
    // What this round computes may carry its own tolerance into the tasks
    // after it; what it starts from is taken as exact.
    std::vector<double> carried_error(p.buffers.size(), 0.0);
    for (int t : part.order)
      for (const BoundTensor& x : p.tasks[size_t(t)].tensors)
        if (x.buffer >= 0 && (x.sig->role == SlotRole::output || x.sig->writes))
          carried_error[size_t(x.buffer)] = tolerances[size_t(x.buffer)].relative;
    ReferenceBuffers ref = evaluate_reference(p, part, before, args, user.ops, carried_error);
    for (size_t b = 0; b < p.buffers.size(); ++b) {
      const Storage s = p.buffers[b].storage;
      if ((s != Storage::external && s != Storage::persistent) || !written_in(p, int(b), round.phases, false)) continue;
      if (unchecked[b]) continue;
      compare(buffer_name(p, int(b)), b, actual[b], ref.value[b], ref.abs[b], int(round.at.step), /*end_to_end=*/true);
      if (!options.expected_dir.empty() && s == Storage::external)
        compare_expected(buffer_name(p, int(b)), b, actual[b],
                         read_expected(p, int(b), options.expected_dir + "/" + buffer_name(p, int(b)) + ".npy"),
                         ref.abs[b]);
    }
    // The loss of a step: the mean over its micro-batches.
    if (round.at.step > 0 && in(round.phases, Phase::forward))
      for (size_t i = 0; i < tracked.size(); ++i) step_sums[i] += actual[tracked[i]][0];
    if (round.at.step > 0 && in(round.phases, Phase::update))
      for (size_t i = 0; i < tracked.size(); ++i) {
        run.step_scalars[i].second.push_back(step_sums[i] / round.at.micro_batches);
        step_sums[i] = 0;
      }
    if (options.check_each_task)
      check_each_task(c, part, before, actual, args, user.ops, unchecked, int(round.at.step), compare);
  }
  run.kernels = executor.kernel_bytes();

  if (!options.outputs_dir.empty()) {
    std::filesystem::create_directories(options.outputs_dir);
    for (size_t b = 0; b < p.buffers.size(); ++b) {
      const BufferInfo& info = p.buffers[b];
      // External outputs; after training, the weights and optimizer state too.
      const bool wanted = info.storage == Storage::external || (options.steps > 0 && info.storage == Storage::persistent);
      if (!wanted || !written_in(p, int(b), all_phases, false)) continue;
      const unsigned char* at = arena.data() + c.plan.buffers[b].offset;
      HostTensor array{info.dtype, info.shape, std::vector<unsigned char>(at, at + info.bytes)};
      write_npy(options.outputs_dir + "/" + buffer_name(p, int(b)) + ".npy", array);
    }
    for (const auto& [name, values] : run.step_scalars) {
      HostTensor array{DType::f64, {int64_t(values.size())}, std::vector<unsigned char>(values.size() * 8)};
      std::memcpy(array.data.data(), values.data(), array.data.size());
      write_npy(options.outputs_dir + "/" + name + ".per_step.npy", array);
    }
  }

  return run;
}

CheckedRun run_emulated_and_check(const Compiled& c, const RunOptions& options) {
  double compile_seconds = 0;
  std::unique_ptr<Executor> executor = make_emulated_executor(c, options.work_dir, &compile_seconds);
  CheckedRun run = run_and_check(c, *executor, options);
  run.compile_seconds = compile_seconds;
  return run;
}

double overflow_threshold(DType dtype) {
  switch (dtype) {
    case DType::f16: return 65520.0;                    // 65504 + half its ulp of 32
    case DType::bf16: return std::ldexp(2.0 - 1.0 / 256, 127);  // 2^128 - 2^119
    case DType::f32: return std::ldexp(2.0 - 1.0 / 16777216, 127);  // 2^128 - 2^103
    default: return INFINITY;
  }
}

ElementVerdict check_element(double got, double want, double bound) {
  if (std::isnan(got)) return ElementVerdict::outside;
  if (got == want) return ElementVerdict::within;  // infinities included (inf - inf is no error)
  if (std::isfinite(want) && !std::isfinite(bound))
    return std::isfinite(got) ? ElementVerdict::unbounded : ElementVerdict::outside;
  return std::abs(got - want) <= bound ? ElementVerdict::within : ElementVerdict::outside;
}

std::string format_run(const CheckedRun& run) {
  std::string out;
  if (!run.step_scalars.empty()) {
    out += fmt::format("{:>5}", "step");
    for (const auto& [name, values] : run.step_scalars) out += fmt::format(" {:>16}", name);
    out += "\n";
    for (size_t i = 0; i < run.step_scalars[0].second.size(); ++i) {
      out += fmt::format("{:>5}", i + 1);
      for (const auto& [name, values] : run.step_scalars) out += fmt::format(" {:>16.8g}", values[i]);
      out += "\n";
    }
  }
  out += fmt::format("{:<24} {:>9} {:>12} {:>14}  {}\n", "output", "elements", "max |err|", "err / bound", "result");
  bool any_loose = false, any_unbounded = false;
  // "ok", with what it could not check; or the first failure.
  auto result_of = [&](const OutputCheck& c, const char* want_name) {
    if (c.ok()) {
      any_loose = any_loose || c.loose();
      any_unbounded = any_unbounded || c.unbounded > 0;
      std::string result = c.loose() ? "ok, loose bound*" : "ok";
      if (c.unbounded > 0)
        result += c.unbounded == c.elements ? ", no bound: finite**" : fmt::format(", {} with no bound: finite**", c.unbounded);
      return result;
    }
    return fmt::format("FAIL: {} elements out of bounds; first at {}{}: got {}, {} {}{}", c.failures, c.first_failure,
                       c.failure_step > 0 ? fmt::format(" after step {}", c.failure_step) : "", c.got, want_name, c.want,
                       std::isfinite(c.want) ? fmt::format(" (bound {:.3g})", c.bound)
                                             : std::string(" (the reference value is not finite: are the inputs finite?)"));
  };
  for (const auto& c : run.checks)
    out += fmt::format("{:<24} {:>9} {:>12.3g} {:>14.3g}  {}\n", c.buffer, c.elements, c.max_abs_error, c.worst_ratio,
                       result_of(c, "want"));
  for (const auto& what : run.unchecked) out += fmt::format("{:<24} not checked: {}\n", "", what);
  if (!run.expected_checks.empty()) {
    out += fmt::format("against the expected outputs in {} (|err| <= 2 (rtol * ref_abs + atol): both results within "
                       "the float64 reference's bound):\n",
                       run.expected_dir);
    out += fmt::format("{:<24} {:>9} {:>12} {:>14}  {}\n", "output", "elements", "max |err|", "err / bound", "result");
    for (const auto& c : run.expected_checks)
      out += fmt::format("{:<24} {:>9} {:>12.3g} {:>14.3g}  {}\n", c.buffer, c.elements, c.max_abs_error, c.worst_ratio,
                         result_of(c, "expected"));
  }
  if (run.steps > 0) out += fmt::format("(every step checked against the float64 reference run from the state before it)\n");
  if (any_loose)
    out += "* the bound exceeds every reference value: first-order error bounds compound along a deep chain, so this\n"
           "  end-to-end check only catches gross errors; --check-each-task checks every kernel from its actual inputs\n";
  if (any_unbounded)
    out += "** the float64 reference's first-order error bound overflowed along the chain (ill-conditioned steps, such as\n"
           "  a BatchNorm over a few values a channel, compound it), so those elements are only checked to be finite;\n"
           "  --check-each-task checks every kernel from its actual inputs\n";
  if (!run.ok()) out += fmt::format("(seed {}; rerun with --seed {} to reproduce)\n", run.seed, run.seed);
  return out;
}

}  // namespace cudagen
