// Pass `plan`: every buffer gets a fixed byte offset in one arena (DESIGN.md §6).
//
// Lifetimes are intervals over the kernel order, inclusive: a buffer lives
// from the first kernel that touches it to the last. Persistent and external
// buffers live for the whole program (the caller binds and reads them between
// phases). Offsets come from placement.h; the verifier checks the result
// independently of the placement.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels.h"
#include "placement.h"
#include "program.h"

namespace cudagen {

struct PlannedBuffer {
  int buffer = -1;  // index into Program::buffers
  int64_t offset = 0;
  int64_t bytes = 0;
  int first = 0;    // kernel indices, inclusive
  int last = 0;
  int in_place_of = -1;  // the buffer whose storage it reuses in place (may_alias), or -1
};

struct Plan {
  std::vector<PlannedBuffer> buffers;  // same order as Program::buffers
  int64_t arena_bytes = 0;
  int64_t persistent_bytes = 0;  // the persistent region, at the start of the arena
  int64_t lower_bound = 0;
  int64_t no_reuse_bytes = 0;
  int64_t alignment = 256;
  int64_t budget = 0;  // 0: none
  std::string method;  // the placement method that produced the offsets

  struct Location {
    int buffer;
    int64_t offset;
    int64_t bytes;
  };
  // Where a task's slot lives (the design notes' "retriever"), answered at
  // generation time. Throws std::out_of_range for an unknown task or slot.
  Location lookup(const Program& program, const std::string& task, const std::string& slot) const;
};

struct PlanOptions {
  PlacementOptions placement;
  int64_t budget_bytes = 0;  // 0: no budget
};

// Plans the buffers of `kernels` (in launch order). Where an elementwise op
// declares that an output may alias an input (may_alias) and the input dies
// in that kernel, the output reuses the input's storage in place. Throws
// CompileError when the plan exceeds the budget.
Plan plan_memory(const Program& program, const std::vector<KernelGroup>& kernels, const PlanOptions& options);

}  // namespace cudagen
