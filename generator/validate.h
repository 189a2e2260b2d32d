// Pass `validate`: TaskGraph -> Program. Checks the graph against the op
// registry (ops exist, slots match signatures, dtypes and shape rules hold,
// dependencies resolve, phases are in order, no cycles) and reports every
// error it finds, each naming the JSON path, task and slot.
#pragma once

#include <cstdint>
#include <string>

#include "program.h"

namespace cudagen {

// The largest extent a generated kernel indexes along one axis, and the most
// rows (the product of all axes but the last) of one tensor: kernels take
// sizes as 32-bit ints, and a larger one would wrap around silently.
inline constexpr int64_t kMaxKernelExtent = 2147483647;

struct ValidateOptions {
  int64_t max_tensor_bytes = int64_t(1) << 40;  // 1 TiB: larger is surely a typo
  size_t error_limit = 50;
  std::string file;                             // names the source in diagnostics
};

// Throws CompileError with all errors found.
Program validate(TaskGraph graph, OpRegistry registry, const ValidateOptions& options = {});

}  // namespace cudagen
