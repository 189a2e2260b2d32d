// FNV-1a, 64 bits: a stable hash of text (a graph, generated source) for
// provenance headers and content-addressed file names. Not for security.
#pragma once

#include <cstdint>
#include <string_view>

namespace cudagen {

inline uint64_t fnv1a64(std::string_view text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace cudagen
