// `cudagen describe`: a human summary of a validated program -- tasks per
// phase, buffers with their storage class, and bytes per storage class.
#pragma once

#include <string>

#include "program.h"

namespace cudagen {

std::string describe(const Program& program);

// 1536 -> "1.5 KiB"
std::string human_bytes(int64_t bytes);

}  // namespace cudagen
