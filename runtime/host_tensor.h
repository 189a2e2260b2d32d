// A tensor in host memory: what goes into and comes out of a program
// instance, and what .npy files hold.
#pragma once

#include <cstdint>
#include <vector>

#include "graph.h"

namespace cudagen {

struct HostTensor {
  DType dtype = DType::f32;
  Shape shape;
  std::vector<unsigned char> data;  // numel * dtype_bytes, little-endian, C order

  int64_t numel() const { return cudagen::numel(shape); }
  // Every element as a double (f16 and bf16 widened exactly).
  std::vector<double> values() const;
  // `values` rounded to `dtype` (to nearest even; integers truncated).
  static HostTensor from_values(DType dtype, Shape shape, const std::vector<double>& values);
};

// One element at `at`, of `dtype`, as a double; and a double stored as one.
double load_element(const unsigned char* at, DType dtype);
void store_element(unsigned char* at, DType dtype, double value);

}  // namespace cudagen
