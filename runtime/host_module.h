// A generated .cu built for the host emulation: compiled by the host C++
// compiler with the emulation header, linked with the emulator into a shared
// library, and loaded with dlopen.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "graph.h"

namespace cudagen {

class BuildError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct KernelBytes {
  std::string kernel;
  unsigned long long bytes_read = 0;
  unsigned long long bytes_written = 0;
  double host_seconds = 0;  // how long the emulator took (the host CPU's time, nothing like a GPU's)
  unsigned grid[3] = {1, 1, 1};  // as launched (a persistent kernel's: the emulated GPU's)
  // Warp-wide requests (the k-th access of each lane of a warp): global loads
  // and stores, the 32-byte sectors they touched and the fewest their bytes
  // need; checked shared ones (ldmatrix, cp.async), their bank wavefronts and
  // the fewest.
  unsigned long long load_requests = 0, load_sectors = 0, load_ideal_sectors = 0;
  unsigned long long store_requests = 0, store_sectors = 0, store_ideal_sectors = 0;
  unsigned long long shared_requests = 0, shared_wavefronts = 0, shared_ideal_wavefronts = 0;
};

class HostModule {
 public:
  // Compiles `cuda_source` in `work_dir` (created if needed). Throws BuildError
  // with the compiler's output on failure. `seconds` receives the compile time.
  static HostModule build(const std::string& cuda_source, const std::string& work_dir, double* seconds = nullptr);

  HostModule(HostModule&&) noexcept;
  HostModule& operator=(HostModule&&) noexcept;
  ~HostModule();

  bool has_phase(Phase phase) const;
  // Runs a phase on `arena`; throws std::runtime_error with the emulator's
  // message (kernel, tensor, thread) when a kernel fails.
  void run_phase(Phase phase, unsigned char* arena) const;
  // The same for any host launcher of the file (`cudagen_step`).
  bool has_function(const std::string& name) const;
  // The address of an extern "C" symbol of the module, nullptr if it has none.
  void* address_of(const std::string& name) const;
  void run_function(const std::string& name, unsigned char* arena) const;
  void set_seed(unsigned long long seed) const;
  std::vector<KernelBytes> kernel_bytes() const;  // since the last clear
  void clear_kernel_bytes() const;

 private:
  HostModule() = default;
  void* handle_ = nullptr;
};

}  // namespace cudagen
