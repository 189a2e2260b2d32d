// NumPy .npy files (format versions 1 and 2, little-endian, C order): how
// tensors go in and out of `cudagen run`, readable by numpy and PyTorch.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "graph.h"

namespace cudagen {

struct NpyArray {
  DType dtype = DType::f32;
  Shape shape;
  std::vector<unsigned char> data;  // numel * dtype_bytes, little-endian
};

// Throws std::runtime_error naming the file and what is wrong with it.
NpyArray read_npy(const std::string& path);

// Writes atomically (temporary file, then rename).
void write_npy(const std::string& path, const NpyArray& array);

}  // namespace cudagen
