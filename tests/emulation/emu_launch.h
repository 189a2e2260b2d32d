// Hand-written kernels under the emulator: an arena with named tensors, and
// a launch of a lambda as the kernel body.
#pragma once

#include <vector>

#include "cudagen_emu.h"

namespace cudagen::testing {

struct EmuLaunch {
  explicit EmuLaunch(size_t arena_bytes = 1 << 16) : arena(arena_bytes, 0) {}
  std::vector<unsigned char> arena;
  std::vector<cudagen_tensor_info> tensors;
  template <typename T>
  T* tensor(const char* name, unsigned long long offset, unsigned long long count) {
    tensors.push_back({name, name, offset, count * sizeof(T)});
    return reinterpret_cast<T*>(arena.data() + offset);
  }
  template <typename F>
  int run(const char* kernel, dim3 grid, dim3 block, unsigned long long smem, F body) {
    return cudagen_emu::launch(kernel, tensors.data(), int(tensors.size()), arena.data(), grid, block, smem,
                               [](void* c) { (*static_cast<F*>(c))(); }, &body);
  }
};

}  // namespace cudagen::testing
