// NumPy .npy files (format versions 1 and 2, little-endian, C order): how
// tensors go in and out of `cudagen run`, readable by numpy and PyTorch.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "host_tensor.h"

namespace cudagen {

// Throws std::runtime_error naming the file and what is wrong with it.
HostTensor read_npy(const std::string& path);

// The same, from the file's bytes; `path` names it in errors.
HostTensor parse_npy(std::string_view bytes, const std::string& path);

// Writes atomically (temporary file, then rename).
void write_npy(const std::string& path, const HostTensor& array);

}  // namespace cudagen
