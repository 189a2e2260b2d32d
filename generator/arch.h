// The GPU architectures cudagen compiles for (docs/architecture.md §7): a
// name such as sm_80 or sm_90a, parsed once, and the one the runtime picks
// for a device. Hopper's wgmma and setmaxnreg exist only in the
// architecture-specific target sm_90a (its PTX is compute_90a), which runs
// on compute capability 9.0 alone; everything else is built for the plain
// sm_XY of its device and takes the sm_80 paths.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace cudagen {

struct Arch {
  int major = 9;
  int minor = 0;
  bool specific = false;  // the "a" of sm_90a: features of this one chip, no forward compatibility

  // "sm_90a".
  std::string name() const;
  // The family a tuning rule or a device model names: sm_90 for sm_90a.
  std::string family() const;
  // wgmma, setmaxnreg and the sm_90a instruction set: compute capability
  // 9.0 compiled for sm_90a.
  bool has_wgmma() const { return major == 9 && minor == 0 && specific; }
  bool operator==(const Arch&) const = default;
};

// Parses "sm_XY" or "sm_XYa" (XY from 75 up); nullopt, with the reason in
// `why`, for anything else.
std::optional<Arch> parse_arch(std::string_view name, std::string* why = nullptr);

// parse_arch or an std::invalid_argument that names `where` (an option, a
// field) and the fix.
Arch arch_or_throw(std::string_view name, std::string_view where);

// The target the runtime compiles for on a device of compute capability
// major.minor: sm_90a on 9.0 (Hopper's wgmma path), sm_XY elsewhere.
Arch arch_for_device(int major, int minor);

// What generated code is tuned for: an architecture (`arch`, as
// parse_arch takes it) and, where it is not the model's for that
// architecture (perf_model.h), the GPU's SM count: an H100 PCIe has 114, an
// H20 78 (EmitOptions::sms, --sms). The tile choices that fill waves of
// SMs (split-K, the Hopper tile's width, split-KV, the SIMT tile) read it.
struct Target {
  std::string arch = "sm_90";
  int64_t sms = 0;  // 0: the model's for `arch`
  Target() = default;
  // Explicit from a string: a call that passes an arch where a target is
  // asked for would silently drop the SM count.
  explicit Target(std::string arch_, int64_t sms_ = 0) : arch(std::move(arch_)), sms(sms_) {}
  Target(const char* arch_) : arch(arch_) {}  // a literal, as tests name architectures
};

}  // namespace cudagen
