// The init ops' counter-based generator on the host, written again from its
// definition in templates/init.cuh (the reference checks the two agree): the
// i-th number of a seed depends on nothing else, so every device, the
// emulation and the host draw the same values.
#pragma once

#include <cstdint>

namespace cudagen {

inline uint64_t counter_hash64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// In [0, 1), 24 random bits: exact in f32. `stream` 0 or 1 (normal uses both).
inline float counter_unit_float(int64_t seed, int64_t i, int stream) {
  return float(counter_hash64(counter_hash64(uint64_t(seed)) ^ uint64_t(2 * i + stream)) >> 40) * 0x1p-24f;
}

// The seed of dropout_mask's draw for one step and micro-batch.
inline int64_t dropout_draw_seed(int64_t seed, int64_t step, int64_t micro_batch) {
  return int64_t(counter_hash64(counter_hash64(counter_hash64(uint64_t(seed)) ^ uint64_t(step)) ^ uint64_t(micro_batch)));
}

}  // namespace cudagen
