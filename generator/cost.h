// What a task costs in arithmetic: the floating-point operations its op
// declares (the registry's `flops` formula, docs/templates.md), which the
// profiler divides by a kernel's time for its FLOP rate.
#pragma once

#include <cstdint>
#include <optional>

#include "program.h"

namespace cudagen {

// nullopt when the op declares no formula, or an argument it names is only
// known at run time.
std::optional<int64_t> task_flops(const Program& program, int task);

}  // namespace cudagen
