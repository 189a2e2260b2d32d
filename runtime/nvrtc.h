// In-process compilation with NVRTC, loaded lazily with dlopen so that
// nothing links libnvrtc and everything else works without it (docs/architecture.md §7).
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace cudagen {

class NvrtcError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct NvrtcOutput {
  std::vector<char> binary;  // CUBIN, or PTX text when asked for PTX
  std::string log;
  double seconds = 0;
  int version_major = 0, version_minor = 0;
};

// Compiles the device part of `source` for `arch` ("sm_90"). Throws
// NvrtcError with NVRTC's log when compilation fails, or when NVRTC cannot
// be loaded (naming the library it looked for).
NvrtcOutput nvrtc_compile(const std::string& source, const std::string& name, const std::string& arch, bool ptx = false);

// NVRTC's version, "13.0" (a part of the disk cache's key). Throws NvrtcError
// when NVRTC cannot be loaded.
std::string nvrtc_version();

// The options nvrtc_compile passes for `arch`, as one line (a part of the
// disk cache's key).
std::string nvrtc_options_text(const std::string& arch, bool ptx);

// NVRTC's log with each "file(LINE): ..." line followed by where LINE is in a
// generated file: the kernel and its tasks (from the "// Kernel" comment
// above it), or the template part every kernel shares.
std::string annotate_nvrtc_log(const std::string& log, const std::string& source);

}  // namespace cudagen
