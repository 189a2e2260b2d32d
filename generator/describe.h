// `cudagen describe`: a human summary of a validated program -- tasks per
// phase, buffers with their storage class, and bytes per storage class.
#pragma once

#include <string>

#include "program.h"

namespace cudagen {

std::string describe(const Program& program);

// docs/ops.md: a table of every op of the registry (pattern kind, dtypes,
// template, backward), so the document is generated, never edited by hand.
std::string ops_markdown(const OpRegistry& registry);

// 1536 -> "1.5 KiB"
std::string human_bytes(int64_t bytes);

}  // namespace cudagen
