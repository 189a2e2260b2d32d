// Kernel groups: which tasks each kernel runs. Until the fusion pass exists
// (issue #6) every task is its own kernel, in schedule order.
#pragma once

#include <string>
#include <vector>

#include "program.h"
#include "schedule.h"

namespace cudagen {

struct KernelGroup {
  std::string name;        // k<index>_<first task id>: a C identifier
  Phase phase = Phase::forward;
  std::vector<int> tasks;  // task indices, in execution order
};

std::vector<KernelGroup> one_kernel_per_task(const Program& program, const Schedule& schedule);

// The buffers each kernel touches (input for the memory planner).
std::vector<std::vector<int>> kernel_buffers(const Program& program, const std::vector<KernelGroup>& kernels);

}  // namespace cudagen
