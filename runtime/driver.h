// The GPU side of the runtime: the CUDA driver API loaded lazily with dlopen
// (docs/architecture.md §7), NVRTC compiles through the disk cache, one arena per
// program, launches per phase, optionally captured once into a CUDA Graph.
//
// Nothing links libcuda: on a machine without a driver everything else works,
// and asking for the GPU fails with DriverError saying so and offering the
// host emulation. CUDAGEN_CUDA_DRIVER names another driver library (a path);
// the tests use it to load a fake one.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cache.h"
#include "executor.h"

namespace cudagen {

class DriverError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct GpuInfo {
  int ordinal = 0;
  std::string name;
  std::string arch;  // "sm_90", from the device's compute capability
  int sms = 0;       // its multiprocessors (132 on an H100 SXM, 114 on a PCIe one)
  int driver_version = 0;  // 13000 for CUDA 13.0
};

// The device, or DriverError when there is no driver or no device (the
// message says which and offers --emulate).
GpuInfo find_gpu(int ordinal = 0);

struct GpuOptions {
  int device = 0;
  std::string arch;        // empty: the device's own
  bool ptx = false;        // load PTX (JIT-compiled by the driver) instead of a CUBIN
  bool use_cache = true;
  std::string cache_dir;   // empty: default_cache_dir()
  bool cuda_graph = false; // capture each launcher into a CUDA Graph on its first run
  bool profile = false;    // time each kernel with events (kernel_times)
  int64_t budget_bytes = 0;  // refuse an arena larger than this (0: what the device has free)
};

// What compiling for the GPU did, for the user's progress lines.
struct GpuCompileReport {
  std::string arch;
  CacheOutcome cache = CacheOutcome::miss;
  bool cached = false;         // whether the cache was used at all
  std::string cache_path;
  std::string cache_problem;   // why an entry was rebuilt
  double compile_seconds = 0;  // NVRTC (0 on a cache hit)
  std::string log;             // NVRTC's warnings, with kernels and tasks named
};

// One line for the user: "NVRTC for sm_90: 1.20 s (cache miss; stored in
// PATH)", "NVRTC for sm_90: cache hit (PATH)".
std::string describe(const GpuCompileReport& report);

// The device code of a program, compiled by NVRTC (through the disk cache).
struct GpuCode {
  std::vector<char> binary;  // CUBIN, or NUL-terminated PTX
  bool ptx = false;
  GpuCompileReport report;
};

// Compiles for options.arch, or for the device's own architecture when that
// is empty (which needs a driver; with --arch nothing here does).
GpuCode compile_for_gpu(const Compiled& compiled, const GpuOptions& options);

// Loads `code` on the device and allocates the arena (under the budget).
std::unique_ptr<Executor> make_gpu_executor(const Compiled& compiled, const GpuCode& code, const GpuOptions& options);

}  // namespace cudagen
