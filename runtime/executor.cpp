#include "executor.h"

#include <chrono>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

namespace cudagen {

namespace {

// The host emulation: the arena is host memory, a launcher a function of the
// module the host compiler built.
class EmulatedExecutor final : public Executor {
 public:
  EmulatedExecutor(std::shared_ptr<const HostModule> module, const Compiled& compiled)
      : module_(std::move(module)),
        arena_(size_t(compiled.plan.arena_bytes), 0xFF),  // poison: unwritten floats are NaN
        watch_(compiled) {
    watch_.reset(*this);
  }

  std::string where() const override { return "host emulation"; }
  bool on_gpu() const override { return false; }
  void write(int64_t offset, const void* data, size_t bytes) override {
    check_range(offset, bytes, "write");
    if (bytes) std::memcpy(arena_.data() + offset, data, bytes);
  }
  void read(int64_t offset, void* data, size_t bytes) const override {
    check_range(offset, bytes, "read");
    if (bytes) std::memcpy(data, arena_.data() + offset, bytes);
  }
  void fill(int64_t offset, unsigned char byte, size_t bytes) override {
    check_range(offset, bytes, "fill");
    std::memset(arena_.data() + offset, byte, bytes);
  }
  bool has_function(const std::string& name) const override { return module_->has_function(name); }
  void run(const std::string& function) override {
    module_->run_function(function, arena_.data());
    watch_.check(*this, function);
  }
  double time_runs(const std::string& function, int runs) override {
    run(function);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < runs; ++i) run(function);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / runs;
  }
  void set_seed(uint64_t seed) override { module_->set_seed(seed); }
  std::vector<KernelBytes> kernel_bytes() const override { return module_->kernel_bytes(); }
  void clear_kernel_bytes() override { module_->clear_kernel_bytes(); }

 private:
  void check_range(int64_t offset, size_t bytes, const char* what) const {
    check_arena_range(offset, bytes, int64_t(arena_.size()), what);
  }

  std::shared_ptr<const HostModule> module_;
  std::vector<unsigned char> arena_;
  MegakernelWatch watch_;
};

}  // namespace

MegakernelWatch::MegakernelWatch(const Compiled& compiled) {
  const EmittedProgram& e = compiled.emitted;
  const Program& p = compiled.program;
  sync_offset_ = e.sync_offset;
  sync_bytes_ = e.sync_bytes;
  watchdog_ms_ = e.megakernel_watchdog_ms;
  for (size_t m = 0; m < e.megakernel.size(); ++m) {
    const MegakernelPhase& mp = e.megakernel[m];
    PhaseWatch w;
    w.phase = mp.phase;
    w.kernel = e.kernels[m].name;
    w.state_offset = e.megakernel_state_offsets[m];
    for (const MegakernelTask& t : mp.tasks) {
      if (t.kernel < 0) {
        w.tasks.push_back(fmt::format("a join task (it forwards event e{} to e{})", t.wait, t.trigger));
        continue;
      }
      const EmittedKernel& k = e.tile_kernels[size_t(t.kernel)];
      std::vector<std::string> ids;
      for (int task : k.tasks) ids.push_back(p.tasks[size_t(task)].task->id);
      w.tasks.push_back(fmt::format("{} tile {} (task{} {})", k.name, t.tile, ids.size() == 1 ? "" : "s",
                                    fmt::join(ids, ", ")));
    }
    for (size_t ev = 0; ev < mp.events.size(); ++ev)
      w.events.push_back(fmt::format("e{} ({}, {} trigger{} per launch)", ev, mp.events[ev].what,
                                     mp.events[ev].triggers, mp.events[ev].triggers == 1 ? "" : "s"));
    phases_.push_back(std::move(w));
  }
}

void MegakernelWatch::reset(Executor& executor) const {
  if (sync_bytes_ > 0) executor.fill(sync_offset_, 0, size_t(sync_bytes_));
}

void MegakernelWatch::check(Executor& executor, const std::string& function) const {
  for (const PhaseWatch& w : phases_) {
    // Only the phases the launcher ran (a step runs all but init): one read each.
    if (function != phase_function(w.phase) && !(function == kStepFunction && w.phase != Phase::init)) continue;
    MegakernelState state;
    executor.read(w.state_offset, &state, sizeof state);
    if (state.stopped == 0) continue;
    reset(executor);
    const std::string task = state.task < w.tasks.size() ? w.tasks[state.task] : fmt::format("task {}", state.task);
    const std::string event = state.event < w.events.size() ? w.events[state.event] : fmt::format("e{}", state.event);
    throw std::runtime_error(fmt::format(
        "megakernel {} was stopped by its watchdog: block {} waited {} before its task {}, {}, for event {}, which "
        "had counted {} of the {} it needed; the schedule cannot finish (a producer that never triggers, or blocks "
        "that are not all resident). The counters are reset; `cudagen describe --megakernel` prints the schedule",
        w.kernel, state.block,
        executor.on_gpu() ? fmt::format("more than {} ms", watchdog_ms_) : "while every other block waited too",
        state.task, task, event, state.value, state.target));
  }
}

void check_arena_range(int64_t offset, size_t bytes, int64_t arena_bytes, const char* what) {
  if (offset < 0 || offset > arena_bytes || int64_t(bytes) > arena_bytes - offset)
    throw std::out_of_range(
        fmt::format("{} of {} bytes at {} is outside the arena of {} bytes", what, bytes, offset, arena_bytes));
}

std::unique_ptr<Executor> make_emulated_executor(const Compiled& compiled, const std::string& work_dir,
                                                 double* compile_seconds) {
  return make_emulated_executor(
      compiled, std::make_shared<const HostModule>(HostModule::build(compiled.emitted.cuda_source, work_dir, compile_seconds)));
}

std::unique_ptr<Executor> make_emulated_executor(const Compiled& compiled, std::shared_ptr<const HostModule> module) {
  return std::make_unique<EmulatedExecutor>(std::move(module), compiled);
}

}  // namespace cudagen
