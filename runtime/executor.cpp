#include "executor.h"

#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

namespace cudagen {

namespace {

// The host emulation: the arena is host memory, a launcher a function of the
// module the host compiler built.
class EmulatedExecutor final : public Executor {
 public:
  EmulatedExecutor(std::shared_ptr<const HostModule> module, int64_t arena_bytes)
      : module_(std::move(module)), arena_(size_t(arena_bytes), 0xFF) {}  // poison: unwritten floats are NaN

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
  void run(const std::string& function) override { module_->run_function(function, arena_.data()); }
  void set_seed(uint64_t seed) override { module_->set_seed(seed); }
  std::vector<KernelBytes> kernel_bytes() const override { return module_->kernel_bytes(); }
  void clear_kernel_bytes() override { module_->clear_kernel_bytes(); }

 private:
  void check_range(int64_t offset, size_t bytes, const char* what) const {
    check_arena_range(offset, bytes, int64_t(arena_.size()), what);
  }

  std::shared_ptr<const HostModule> module_;
  std::vector<unsigned char> arena_;
};

}  // namespace

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
  return std::make_unique<EmulatedExecutor>(std::move(module), compiled.plan.arena_bytes);
}

}  // namespace cudagen
