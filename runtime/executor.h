// Where a compiled program runs (docs/architecture.md §7): on a GPU, its device code
// compiled by NVRTC and launched through the driver API, or on the CPU, the
// whole file built by the host compiler under the emulation header. Both hold
// one arena of the plan's size; the host sees it only through write and read.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "host_module.h"
#include "pipeline.h"

namespace cudagen {

struct KernelTime {
  std::string kernel;
  double milliseconds = 0;
  double start_ms = 0;  // from the start of its launcher's run
  unsigned grid[3] = {1, 1, 1};  // as launched (a persistent kernel's: this GPU's)
};

class Executor {
 public:
  virtual ~Executor() = default;
  // "GPU 0: NVIDIA H100 80GB HBM3 (sm_90)", or "host emulation".
  virtual std::string where() const = 0;
  virtual bool on_gpu() const = 0;
  virtual void write(int64_t offset, const void* data, size_t bytes) = 0;
  virtual void read(int64_t offset, void* data, size_t bytes) const = 0;
  virtual void fill(int64_t offset, unsigned char byte, size_t bytes) = 0;
  // A host launcher of the file: a phase's (`cudagen_forward`) or
  // `cudagen_step`. Returns when its kernels have finished; throws
  // std::runtime_error naming the kernel and its tasks when one fails.
  virtual bool has_function(const std::string& name) const = 0;
  virtual void run(const std::string& function) = 0;
  // The emulator's seed (block order); ignored on a GPU.
  virtual void set_seed(uint64_t) {}
  // Bytes each kernel read and wrote since the last clear (emulation), or
  // its time in the last run (GPU, with profiling on).
  virtual std::vector<KernelBytes> kernel_bytes() const { return {}; }
  virtual void clear_kernel_bytes() {}
  virtual std::vector<KernelTime> kernel_times() const { return {}; }
  // GPU: time every kernel, and each launcher's run as a whole, with events
  // (a little launch overhead; no CUDA Graph replay while on).
  virtual void set_profiling(bool) {}
  // The last launcher run's time from its first kernel's start to its last
  // kernel's end (GPU, profiling on), or a negative value.
  virtual double last_run_milliseconds() const { return -1; }
  // Runs `function` once to warm up (and capture its CUDA Graph), then `runs`
  // times back to back, and returns the mean milliseconds per run: on a GPU
  // from events around the batch (launch costs and gaps included, one
  // synchronisation at the end, no per-kernel events); in emulation the host
  // time. What benchmarks compare modes with.
  virtual double time_runs(const std::string& function, int runs) = 0;
  // GPU: the device-to-device copy bandwidth in bytes per second (bytes read
  // plus bytes written, per second), measured now with a large cuMemcpy; the
  // roof a memory-bound kernel is compared with. 0 in emulation.
  virtual double copy_bandwidth() { return 0; }
};

// The host's side of a megakernel's watchdog (docs/architecture.md §10): each phase's
// report in the arena, and the names to put in the error.
class MegakernelWatch {
 public:
  MegakernelWatch() = default;
  explicit MegakernelWatch(const Compiled& compiled);
  bool empty() const { return phases_.empty(); }
  // Zeroes the event counters and reports: before the first launch, and after
  // a stop, so that the instance can run again.
  void reset(Executor& executor) const;
  // After launcher `function` ran: throws std::runtime_error naming the
  // block, the task and the event when a watchdog stopped one of its
  // megakernels.
  void check(Executor& executor, const std::string& function) const;

 private:
  struct PhaseWatch {
    Phase phase = Phase::forward;
    std::string kernel;
    int64_t state_offset = 0;
    std::vector<std::string> tasks;   // "k4_softmax tile 5 (task sm)", "a join for k5_add"
    std::vector<std::string> events;  // "e2 (k3_matmul done, 8 triggers per launch)"
  };
  int64_t sync_offset_ = 0, sync_bytes_ = 0, watchdog_ms_ = 0;
  std::vector<PhaseWatch> phases_;
};

// Throws std::out_of_range unless bytes [offset, offset + bytes) lie in an
// arena of `arena_bytes`: every executor checks host reads and writes so, the
// GPU's before a copy could corrupt device memory.
void check_arena_range(int64_t offset, size_t bytes, int64_t arena_bytes, const char* what);

// The host emulation: builds the .cu with the host compiler in `work_dir`.
std::unique_ptr<Executor> make_emulated_executor(const Compiled& compiled, const std::string& work_dir,
                                                 double* compile_seconds = nullptr);
// A module already built: instances of one program share it, each with its own arena.
std::unique_ptr<Executor> make_emulated_executor(const Compiled& compiled, std::shared_ptr<const HostModule> module);

}  // namespace cudagen
