#include "jit.h"

#include <unistd.h>

#include <cmath>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "counter_rng.h"
#include "runner.h"

namespace cudagen {

const char* to_string(Backend backend) {
  switch (backend) {
    case Backend::automatic: return "automatic";
    case Backend::gpu: return "gpu";
    case Backend::emulation: return "emulation";
  }
  return "?";
}

Backend choose_backend(Backend requested, int device, std::string* why, GpuInfo* gpu_found) {
  if (requested == Backend::emulation) {
    *why = "running in the host emulation (asked for)";
    return requested;
  }
  try {
    GpuInfo gpu = find_gpu(device);
    *why = fmt::format("running on GPU {}: {} ({}, driver {}.{})", gpu.ordinal, gpu.name, gpu.arch,
                       gpu.driver_version / 1000, gpu.driver_version % 1000 / 10);
    if (gpu_found != nullptr) *gpu_found = gpu;
    return Backend::gpu;
  } catch (const DriverError& e) {
    if (requested == Backend::gpu) throw;
    *why = fmt::format("running in the host emulation: {}", e.what());
    return Backend::emulation;
  }
}

struct JitProgram::State {
  JitOptions options;
  Backend backend = Backend::emulation;
  Compiled compiled;
  std::string build_report;
  GpuCode gpu_code;                            // Backend::gpu
  std::shared_ptr<const HostModule> host_module;  // Backend::emulation
};

namespace {

void say(const JitOptions& options, const std::string& line) {
  if (options.progress) options.progress(line);
}

JitProgram::State build(Program program, JitOptions options) {
  JitProgram::State s;
  std::string why;
  GpuInfo gpu;
  s.backend = choose_backend(options.backend, options.gpu.device, &why, &gpu);
  say(options, why);
  // On a GPU the generated code targets it (its tuning, its Hopper path),
  // unless options.gpu.arch names another: one architecture for both.
  if (s.backend == Backend::gpu) {
    options.compile.emit.arch = options.gpu.arch.empty() ? gpu.arch : options.gpu.arch;
    if (options.compile.emit.sms == 0) options.compile.emit.sms = gpu.sms;  // its tiles fill this GPU's waves
  }
  if (s.backend == Backend::emulation && options.compile.emit.megakernel && options.compile.emit.megakernel_blocks == 0) {
    options.compile.emit.megakernel_blocks = kEmulatedMegakernelBlocks;
    say(options, fmt::format("megakernel: {} blocks in the host emulation (megakernel_blocks sets it)",
                             kEmulatedMegakernelBlocks));
  }
  s.compiled = compile(std::move(program), options.compile);
  if (s.backend == Backend::gpu) {
    s.gpu_code = compile_for_gpu(s.compiled, options.gpu);
    s.build_report = describe(s.gpu_code.report);
    if (!s.gpu_code.report.log.empty()) s.build_report += "\n" + s.gpu_code.report.log;
  } else {
    const std::string work_dir =
        options.work_dir.empty() ? fmt::format("/tmp/cudagen-jit-{}", ::getpid()) : options.work_dir;
    double seconds = 0;
    s.host_module = std::make_shared<const HostModule>(HostModule::build(s.compiled.emitted.cuda_source, work_dir, &seconds));
    s.build_report = fmt::format("host compiler (emulation build in {}): {:.2f} s", work_dir, seconds);
  }
  say(options, s.build_report);
  s.options = std::move(options);
  return s;
}

}  // namespace

JitProgram JitProgram::from_file(const std::string& graph_path, JitOptions options) {
  Program program = load_program(graph_path, options.compile.frontend);
  return JitProgram(std::make_shared<const State>(build(std::move(program), std::move(options))));
}

JitProgram JitProgram::from_graph(TaskGraph graph, JitOptions options) {
  Program program = load_program(std::move(graph), options.compile.frontend);
  return JitProgram(std::make_shared<const State>(build(std::move(program), std::move(options))));
}

Backend JitProgram::backend() const { return state_->backend; }
const Compiled& JitProgram::compiled() const { return state_->compiled; }
const std::string& JitProgram::cuda_source() const { return state_->compiled.emitted.cuda_source; }
const std::string& JitProgram::manifest() const { return state_->compiled.emitted.manifest_json; }
const std::string& JitProgram::build_report() const { return state_->build_report; }

Instance JitProgram::instantiate() const {
  const State& s = *state_;
  std::unique_ptr<Executor> executor = s.backend == Backend::gpu ? make_gpu_executor(s.compiled, s.gpu_code, s.options.gpu)
                                                                 : make_emulated_executor(s.compiled, s.host_module);
  Instance instance(state_, std::move(executor));
  return instance;
}

Instance::Instance(std::shared_ptr<const JitProgram::State> program, std::unique_ptr<Executor> executor)
    : program_(std::move(program)), executor_(std::move(executor)) {
  // Zero rather than the emulator's poison: what a user never sets reads as 0
  // on either backend; the scalars region starts at the graph's values.
  executor_->fill(0, 0, size_t(program_->compiled.plan.arena_bytes));
  write_scalars_region(args_);
  load_data();
}

void Instance::load_data() {
  const Program& p = program_->compiled.program;
  for (size_t b = 0; b < p.buffers.size(); ++b) {
    const BufferInfo& info = p.buffers[b];
    if (info.data.empty()) continue;
    set(buffer_name(p, int(b)), read_tensor_file(p, int(b), info.data));
  }
}

Instance::Instance(Instance&&) noexcept = default;
Instance& Instance::operator=(Instance&&) noexcept = default;
Instance::~Instance() = default;

std::string Instance::where() const { return executor_->where(); }

std::vector<std::string> Instance::tensor_names() const {
  const Program& p = program_->compiled.program;
  std::vector<std::string> names;
  for (size_t b = 0; b < p.buffers.size(); ++b) names.push_back(buffer_name(p, int(b)));
  return names;
}

int Instance::buffer_index(const std::string& tensor) const {
  const Program& p = program_->compiled.program;
  for (size_t b = 0; b < p.buffers.size(); ++b)
    if (buffer_name(p, int(b)) == tensor) return int(b);
  // A slot bound to another task's slot names that one's buffer.
  const size_t dot = tensor.find('.');
  if (dot != std::string::npos)
    for (const auto& t : p.tasks)
      if (t.task->id == tensor.substr(0, dot))
        if (const BoundTensor* bound = t.find_tensor(tensor.substr(dot + 1))) return bound->buffer;
  throw std::runtime_error(fmt::format("no tensor '{}' in graph '{}'; it has: {}", tensor, p.graph.name,
                                       fmt::join(tensor_names(), ", ")));
}

void Instance::set(const std::string& tensor, const HostTensor& value) {
  const int b = buffer_index(tensor);
  const BufferInfo& info = program_->compiled.program.buffers[size_t(b)];
  if (value.dtype != info.dtype || value.shape != info.shape)
    throw std::runtime_error(fmt::format("{} is {} {}, but the value given is {} {}", tensor, to_string(info.dtype),
                                         shape_to_string(info.shape), to_string(value.dtype),
                                         shape_to_string(value.shape)));
  executor_->write(program_->compiled.plan.buffers[size_t(b)].offset, value.data.data(), value.data.size());
}

void Instance::set(const std::string& tensor, const std::vector<double>& values) {
  const BufferInfo& info = program_->compiled.program.buffers[size_t(buffer_index(tensor))];
  if (int64_t(values.size()) != numel(info.shape))
    throw std::runtime_error(fmt::format("{} is {} {} ({} elements), but {} values were given", tensor,
                                         to_string(info.dtype), shape_to_string(info.shape), numel(info.shape),
                                         values.size()));
  set(tensor, HostTensor::from_values(info.dtype, info.shape, values));
}

void Instance::fill(const std::string& tensor, double value) {
  const BufferInfo& info = program_->compiled.program.buffers[size_t(buffer_index(tensor))];
  set(tensor, std::vector<double>(size_t(numel(info.shape)), value));
}

void Instance::randomize(const std::string& tensor, int64_t seed, double low, double high) {
  const BufferInfo& info = program_->compiled.program.buffers[size_t(buffer_index(tensor))];
  std::vector<double> values(size_t(numel(info.shape)));
  for (size_t i = 0; i < values.size(); ++i)
    values[i] = double(std::fma(float(high) - float(low), counter_unit_float(seed, int64_t(i), 0), float(low)));
  set(tensor, values);
}

void Instance::set_arg(const std::string& name, ArgValue value) {
  RunTimeArgs args = args_;
  args[name] = value;
  write_scalars_region(args);  // checks the name and the value's kind before keeping them
  args_ = std::move(args);
}

void Instance::write_scalars_region(const RunTimeArgs& args, int micro_batch, int micro_batches) {
  const Plan& plan = program_->compiled.plan;
  const std::vector<unsigned char> region = scalars_region(
      program_->compiled, with_step_position(program_->compiled, args, StepPosition{steps_, micro_batch, micro_batches}));
  if (!region.empty()) executor_->write(plan.scalars_offset, region.data(), region.size());
}

void Instance::run(Phase phase) {
  const std::string function = phase_function(phase);
  if (!executor_->has_function(function))
    throw std::runtime_error(fmt::format("graph '{}' has no {} phase", program_->compiled.program.graph.name, to_string(phase)));
  executor_->run(function);
}

double Instance::time_runs(Phase phase, int runs) {
  const std::string function = phase_function(phase);
  if (!executor_->has_function(function))
    throw std::runtime_error(fmt::format("graph '{}' has no {} phase", program_->compiled.program.graph.name, to_string(phase)));
  return executor_->time_runs(function, runs);
}

double Instance::time_step_runs(int runs) {
  if (!executor_->has_function(kStepFunction))
    throw std::runtime_error("timing training steps needs a step function: compile with emit.step_function");
  return executor_->time_runs(kStepFunction, runs);
}

double Instance::copy_bandwidth() { return executor_->copy_bandwidth(); }

void Instance::run_if_present(Phase phase, bool& any) {
  if (!executor_->has_function(phase_function(phase))) return;
  executor_->run(phase_function(phase));
  any = true;
}

void Instance::step() { step(1, {}); }

void Instance::step(int micro_batches, const std::function<void(int)>& feed) {
  if (micro_batches < 1)
    throw std::runtime_error(fmt::format("step({}): a step needs at least one micro-batch", micro_batches));
  if (micro_batches > 1 && !accumulates_gradients(program_->compiled))
    throw std::runtime_error(fmt::format(
        "step({}) sums the gradients of {} micro-batches, but graph '{}' does not accumulate them: add "
        "\"accumulate_gradients\": true to its \"training\" section",
        micro_batches, micro_batches, program_->compiled.program.graph.name));
  ++steps_;
  bool any = false;
  for (int m = 0; m < micro_batches; ++m) {
    if (feed) feed(m);
    write_scalars_region(args_, m, micro_batches);  // Adam's `step` counts the steps; which micro-batch
    run_if_present(Phase::forward, any);
    run_if_present(Phase::backward, any);
  }
  run_if_present(Phase::update, any);
  if (!any) throw std::runtime_error("this graph has no forward, backward or update phase to step");
}

HostTensor Instance::read(const std::string& tensor) const {
  const Compiled& c = program_->compiled;
  const int b = buffer_index(tensor);
  const PlannedBuffer& pb = c.plan.buffers[size_t(b)];
  if (pb.internal)
    throw std::runtime_error(fmt::format(
        "{} never reaches memory: kernel {} computes it in registers and uses it there; compile with fusion off "
        "(JitOptions::compile.fuse.enabled = false, or --no-fuse) to keep every tensor readable",
        buffer_name(c.program, b), c.kernels[size_t(pb.first)].name));
  // Another buffer in the same bytes, produced after this one (or written in
  // place over it), has replaced its value.
  // A view (reshape) shares its source's bytes and value: not a replacement.
  std::set<int> same_value = {b};
  for (auto [view, source] : view_pairs(c.program)) {
    if (view == b) same_value.insert(source);
    if (source == b) same_value.insert(view);
  }
  for (const PlannedBuffer& other : c.plan.buffers) {
    if (same_value.count(other.buffer) || other.bytes == 0 || pb.bytes == 0) continue;
    const bool overlap = other.offset < pb.offset + pb.bytes && pb.offset < other.offset + other.bytes;
    if (overlap && (other.first > pb.first || other.in_place_of == b))
      throw std::runtime_error(fmt::format(
          "{} no longer exists: the memory plan gave its bytes to {}{} once it was last read; compile with reuse off "
          "(JitOptions::compile.plan.placement.reuse = false, or --no-reuse) to keep every tensor readable",
          buffer_name(c.program, b), buffer_name(c.program, other.buffer), other.in_place_of == b ? " (in place)" : ""));
  }
  const BufferInfo& info = c.program.buffers[size_t(b)];
  HostTensor out{info.dtype, info.shape, std::vector<unsigned char>(size_t(pb.bytes))};
  executor_->read(pb.offset, out.data.data(), out.data.size());
  out.data.resize(size_t(info.bytes));
  return out;
}

std::vector<KernelTime> Instance::kernel_times() const { return executor_->kernel_times(); }

Profile Instance::profile(const ProfileOptions& options) {
  write_scalars_region(args_);
  return profile_program(program_->compiled, *executor_, options);
}

}  // namespace cudagen
