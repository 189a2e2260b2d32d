// Pass `plan`: every buffer gets a fixed byte offset in one arena (DESIGN.md §6).
//
// Lifetimes are intervals over the kernel order, inclusive: a buffer lives
// from the first kernel that touches it to the last. Persistent and external
// buffers live for the whole program (the caller binds and reads them between
// phases). Offsets come from greedy-by-size best-fit (TFLite's GPU delegate,
// XLA's heap simulator); the verifier checks the result independently.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "program.h"

namespace cudagen {

// A buffer to place: its size and the inclusive range of steps it lives in.
struct LiveInterval {
  int64_t bytes = 0;
  int first = 0;
  int last = 0;
};

struct PlacementOptions {
  int64_t alignment = 256;
  bool reuse = true;  // false: every buffer its own storage (for debugging numerics)
};

// Offsets for `intervals`, in the same order. Deterministic.
std::vector<int64_t> place_greedy_by_size(const std::vector<LiveInterval>& intervals, const PlacementOptions& options);

// Largest sum of (aligned) live bytes at any step: no placement can do better.
int64_t lower_bound_bytes(const std::vector<LiveInterval>& intervals, int64_t alignment);

// Why a placement is wrong, or "" when it is right: alignment, inside the
// arena, and no two buffers that live at the same step overlap in memory.
std::string verify_placement(const std::vector<LiveInterval>& intervals, const std::vector<int64_t>& offsets,
                             int64_t arena_bytes, int64_t alignment);

struct PlannedBuffer {
  int buffer = -1;  // index into Program::buffers
  int64_t offset = 0;
  int64_t bytes = 0;
  int first = 0;    // kernel indices, inclusive
  int last = 0;
};

struct Plan {
  std::vector<PlannedBuffer> buffers;  // same order as Program::buffers
  int64_t arena_bytes = 0;
  int64_t lower_bound = 0;
  int64_t no_reuse_bytes = 0;
  int64_t alignment = 256;
  int64_t budget = 0;  // 0: none

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

// `kernel_buffers[k]` lists the buffers kernel k touches, kernels in launch order.
// Throws CompileError when the plan exceeds the budget.
Plan plan_memory(const Program& program, const std::vector<std::vector<int>>& kernel_buffers,
                 const PlanOptions& options);

}  // namespace cudagen
