#include "arch.h"

#include <stdexcept>

#include <fmt/format.h>

namespace cudagen {

std::string Arch::name() const { return fmt::format("sm_{}{}{}", major, minor, specific ? "a" : ""); }

std::string Arch::family() const { return fmt::format("sm_{}{}", major, minor); }

std::optional<Arch> parse_arch(std::string_view name, std::string* why) {
  auto refuse = [&](const std::string& reason) -> std::optional<Arch> {
    if (why != nullptr) *why = reason;
    return std::nullopt;
  };
  if (!name.starts_with("sm_"))
    return refuse(fmt::format("'{}' is not an architecture: write sm_ and the compute capability's digits, as in "
                              "sm_80, sm_89, sm_90a",
                              name));
  std::string_view digits = name.substr(3);
  Arch arch;
  if (digits.ends_with('a')) {
    arch.specific = true;
    digits.remove_suffix(1);
  }
  if (digits.size() < 2 || digits.size() > 3 || digits.find_first_not_of("0123456789") != std::string_view::npos)
    return refuse(fmt::format("'{}' is not an architecture: sm_ takes two or three digits (major, minor), then "
                              "an optional 'a' (sm_80, sm_90a, sm_100)",
                              name));
  if (digits.front() == '0') return refuse(fmt::format("'{}' is not an architecture: its digits start with 0", name));
  arch.minor = digits.back() - '0';
  arch.major = std::stoi(std::string(digits.substr(0, digits.size() - 1)));
  if (arch.major * 10 + arch.minor < 75)
    return refuse(fmt::format("{}: cudagen compiles for sm_75 and later (CUDA 13 dropped the older ones)", name));
  if (arch.specific && arch.major < 9)
    return refuse(fmt::format("'{}' is not an architecture: the 'a' targets start with sm_90a", name));
  return arch;
}

Arch arch_or_throw(std::string_view name, std::string_view where) {
  std::string why;
  std::optional<Arch> arch = parse_arch(name, &why);
  if (!arch) throw std::invalid_argument(fmt::format("{}: {}", where, why));
  return *arch;
}

Arch arch_for_device(int major, int minor) { return Arch{major, minor, major == 9 && minor == 0}; }

}  // namespace cudagen
