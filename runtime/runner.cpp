#include "runner.h"

#include "half.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include <fmt/format.h>

#include "npy.h"
#include "reference.h"

namespace cudagen {

bool EmulatedRun::ok() const {
  for (const auto& c : checks)
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
  // f16's subnormals are 2^-24 apart: below 2^-14 its rounding error is
  // absolute, up to 2^-25, not relative. (bf16 and f32 subnormals start
  // below 1e-38, where no test's values go.)
  return dtype == DType::f16 ? 0x1p-24 : 0.0;
}

namespace {

std::string buffer_name(const Program& p, int buffer) {
  const BufferInfo& b = p.buffers[size_t(buffer)];
  return p.tasks[size_t(b.owner_task)].task->id + "." + b.owner_slot;
}

bool written_by_a_task(const Program& p, int buffer) {
  for (const auto& t : p.tasks)
    for (const auto& b : t.tensors)
      if (b.buffer == buffer && b.sig && b.sig->written())
        return true;
  return false;
}

// Whether a task computes the buffer from nothing (an output), as opposed to
// updating it in place (an optimizer's parameter, which needs a value first).
bool produced_by_a_task(const Program& p, int buffer) {
  for (const auto& t : p.tasks)
    for (const auto& b : t.tensors)
      if (b.buffer == buffer && b.sig && (b.sig->role == SlotRole::output || b.sig->role == SlotRole::scratch))
        return true;
  return false;
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

void store_element(unsigned char* at, DType dtype, double v) {
  switch (dtype) {
    case DType::f32: { float f = float(v); std::memcpy(at, &f, 4); break; }
    case DType::f64: std::memcpy(at, &v, 8); break;
    case DType::i32: { int32_t i = int32_t(v); std::memcpy(at, &i, 4); break; }
    case DType::i64: { int64_t i = int64_t(v); std::memcpy(at, &i, 8); break; }
    case DType::f16: { uint16_t h = float_to_f16(float(v)); std::memcpy(at, &h, 2); break; }
    case DType::bf16: { uint16_t b = float_to_bf16(float(v)); std::memcpy(at, &b, 2); break; }
    default: throw std::runtime_error(fmt::format("emulated runs do not support {} tensors yet", to_string(dtype)));
  }
}

double load_element(const unsigned char* at, DType dtype) {
  switch (dtype) {
    case DType::f32: { float f; std::memcpy(&f, at, 4); return f; }
    case DType::f64: { double d; std::memcpy(&d, at, 8); return d; }
    case DType::i32: { int32_t i; std::memcpy(&i, at, 4); return i; }
    case DType::i64: { int64_t i; std::memcpy(&i, at, 8); return double(i); }
    case DType::f16: { uint16_t h; std::memcpy(&h, at, 2); return f16_to_float(h); }
    case DType::bf16: { uint16_t b; std::memcpy(&b, at, 2); return bf16_to_float(b); }
    default: return NAN;
  }
}

}  // namespace

void write_scalars(const Compiled& c, const RunTimeArgs& args, unsigned char* arena) {
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
  for (const auto& s : c.plan.scalars) {
    auto it = args.find(s.name(c.program));
    encode_scalar(s.type, it != args.end() ? it->second : s.initial, arena + s.offset);
  }
}

EmulatedRun run_emulated_and_check(const Compiled& c, const RunOptions& options) {
  const Program& p = c.program;
  EmulatedRun run;
  run.seed = options.seed;
  HostModule module = HostModule::build(c.emitted.cuda_source, options.work_dir, &run.compile_seconds);
  module.set_seed(options.seed);

  // Inputs from .npy files, or fresh random ones rounded to their dtype so that
  // the reference sees what the kernels see.
  std::mt19937_64 rng(options.seed);
  std::vector<std::vector<double>> inputs(p.buffers.size());
  std::vector<unsigned char> arena(size_t(c.plan.arena_bytes), 0xFF);  // poison: unwritten floats are NaN
  std::vector<std::string> problems;
  for (size_t b = 0; b < p.buffers.size(); ++b) {
    if (produced_by_a_task(p, int(b))) continue;
    const BufferInfo& info = p.buffers[b];
    const std::string name = buffer_name(p, int(b));
    int64_t n = info.bytes / dtype_bytes(info.dtype);
    unsigned char* at = arena.data() + c.plan.buffers[b].offset;
    inputs[b].resize(size_t(n));
    if (!options.inputs_dir.empty()) {
      std::string path = options.inputs_dir + "/" + name + ".npy";
      if (!std::filesystem::exists(path)) {
        problems.push_back(fmt::format("{}: missing; the graph input {} is {} {}", path, name, to_string(info.dtype),
                                       shape_to_string(info.shape)));
        continue;
      }
      NpyArray array = read_npy(path);
      if (array.dtype != info.dtype || array.shape != info.shape) {
        problems.push_back(fmt::format("{}: {} {}, but the graph input {} is {} {}", path, to_string(array.dtype),
                                       shape_to_string(array.shape), name, to_string(info.dtype),
                                       shape_to_string(info.shape)));
        continue;
      }
      std::memcpy(at, array.data.data(), array.data.size());
      for (int64_t i = 0; i < n; ++i) inputs[b][size_t(i)] = load_element(at + i * dtype_bytes(info.dtype), info.dtype);
      continue;
    }
    bool integer = info.dtype == DType::i32 || info.dtype == DType::i64;
    std::uniform_real_distribution<double> real(-1.0, 1.0);
    std::uniform_int_distribution<int64_t> ints(0, integer ? integer_input_range(p, int(b)) - 1 : 0);
    for (int64_t i = 0; i < n; ++i) {
      double v = integer ? double(ints(rng)) : real(rng);
      // The reference reads what the kernels read: the value rounded to the dtype.
      store_element(at + i * dtype_bytes(info.dtype), info.dtype, v);
      inputs[b][size_t(i)] = load_element(at + i * dtype_bytes(info.dtype), info.dtype);
    }
  }
  if (!problems.empty())
    throw std::runtime_error(fmt::format("bad inputs in {}:\n  {}", options.inputs_dir, fmt::join(problems, "\n  ")));
  write_scalars(c, options.args, arena.data());

  auto start = std::chrono::steady_clock::now();
  for (Phase phase : {Phase::init, Phase::forward, Phase::backward, Phase::update})
    if (module.has_phase(phase)) module.run_phase(phase, arena.data());
  run.run_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  run.kernels = module.kernel_bytes();

  if (!options.outputs_dir.empty()) {
    std::filesystem::create_directories(options.outputs_dir);
    for (size_t b = 0; b < p.buffers.size(); ++b) {
      const BufferInfo& info = p.buffers[b];
      if (info.storage != Storage::external || !written_by_a_task(p, int(b))) continue;
      const unsigned char* at = arena.data() + c.plan.buffers[b].offset;
      NpyArray array{info.dtype, info.shape, std::vector<unsigned char>(at, at + info.bytes)};
      write_npy(options.outputs_dir + "/" + buffer_name(p, int(b)) + ".npy", array);
    }
  }

  // Every buffer as the kernels left it.
  std::vector<std::vector<double>> actual(p.buffers.size());
  for (size_t b = 0; b < p.buffers.size(); ++b) {
    const BufferInfo& info = p.buffers[b];
    int64_t n = info.bytes / dtype_bytes(info.dtype);
    for (int64_t i = 0; i < n; ++i)
      actual[b].push_back(load_element(arena.data() + c.plan.buffers[b].offset + i * dtype_bytes(info.dtype), info.dtype));
  }
  auto compare = [&](const std::string& name, size_t b, const std::vector<double>& want, const std::vector<double>& scale) {
    const BufferInfo& info = p.buffers[b];
    OutputCheck check;
    check.buffer = name;
    check.elements = int64_t(actual[b].size());
    const double rtol = relative_tolerance(info.dtype), atol = absolute_tolerance(info.dtype);
    for (int64_t i = 0; i < check.elements; ++i) {
      double y = actual[b][size_t(i)], err = std::abs(y - want[size_t(i)]), bound = rtol * scale[size_t(i)] + atol;
      bool ok = !std::isnan(y) && err <= bound;
      if (!std::isnan(err)) check.max_abs_error = std::max(check.max_abs_error, err);
      check.worst_ratio =
          std::max(check.worst_ratio, std::isnan(err) ? INFINITY : bound > 0 ? err / bound : (err > 0 ? INFINITY : 0));
      if (!ok && check.failures++ == 0) {
        check.first_failure = i;
        check.got = y;
        check.want = want[size_t(i)];
      }
    }
    run.checks.push_back(check);
  };
  if (options.check_each_task) {
    if (c.plan.arena_bytes - c.plan.scalars_bytes < c.plan.no_reuse_bytes)
      throw std::runtime_error("checking each task needs a plan without reuse (compile with reuse off)");
    // Each task is recomputed from the buffers as the run left them, which
    // an in-place update (an optimizer step) has overwritten by then.
    for (const auto& t : p.tasks)
      for (const auto& bound : t.tensors)
        if (bound.sig != nullptr && bound.sig->writes && bound.sig->role != SlotRole::output)
          throw std::runtime_error(fmt::format(
              "checking each task is not possible here: task '{}' updates '{}' in place, which overwrites what the "
              "tasks before it read; run without --check-each-task (the outputs and the updated weights are still "
              "checked against the reference)",
              t.task->id, bound.name));
    for (int t : c.schedule.order) {
      ReferenceBuffers one = evaluate_task(p, t, actual, options.args);
      for (const auto& bound : p.tasks[size_t(t)].tensors) {
        if (bound.sig == nullptr || bound.sig->role != SlotRole::output) continue;
        size_t b = size_t(bound.buffer);
        compare("task " + p.tasks[size_t(t)].task->id + "." + bound.name, b, one.value[b], one.abs[b]);
      }
    }
  }

  // Graph outputs, and the persistent tensors tasks write (a training step's
  // updated weights and optimizer state).
  ReferenceBuffers ref = evaluate_reference(p, c.schedule, inputs, options.args);
  for (size_t b = 0; b < p.buffers.size(); ++b) {
    const BufferInfo& info = p.buffers[b];
    const bool checked = info.storage == Storage::external || info.storage == Storage::persistent;
    if (!checked || !written_by_a_task(p, int(b))) continue;
    compare(buffer_name(p, int(b)), b, ref.value[b], ref.abs[b]);
  }
  return run;
}

std::string format_run(const EmulatedRun& run) {
  std::string out = fmt::format("{:<24} {:>9} {:>12} {:>14}  {}\n", "output", "elements", "max |err|", "err / bound", "result");
  for (const auto& c : run.checks) {
    std::string result = c.ok() ? "ok"
                                : fmt::format("FAIL: {} elements out of bounds; first at {}: got {}, want {}", c.failures,
                                              c.first_failure, c.got, c.want);
    out += fmt::format("{:<24} {:>9} {:>12.3g} {:>14.3g}  {}\n", c.buffer, c.elements, c.max_abs_error, c.worst_ratio, result);
  }
  if (!run.ok()) out += fmt::format("(seed {}; rerun with --seed {} to reproduce)\n", run.seed, run.seed);
  return out;
}

}  // namespace cudagen
