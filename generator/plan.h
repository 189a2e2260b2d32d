// Pass `plan`: every buffer gets a fixed byte offset in one arena (docs/architecture.md §6).
//
// Lifetimes are intervals over the launches, inclusive: a buffer lives from
// the first launch that touches it to the last (KernelGroup::launch: one per
// kernel, unless fuse's rule `horizontal` gave several kernels one). Persistent and external
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
  int first = 0;    // launch indices (KernelGroup::launch), inclusive
  int last = 0;
  int in_place_of = -1;  // the buffer whose storage it reuses in place (may_alias), or -1
  // Lives only in the registers of one fused kernel (KernelGroup::internal_buffers):
  // no storage, `bytes` 0; `first` and `last` are that kernel.
  bool internal = false;
};

// A run-time argument (docs/architecture.md §2): 8 bytes of the scalars region, after
// the buffers at the end of the arena. A float is stored as f32, an int as
// i64, a bool as i32 (0 or 1). Kernels read it where a constant argument
// would be a literal; the runtime writes `initial` before the first phase and
// any new value between calls, with no recompilation.
struct PlannedScalar {
  int task = -1;       // index into Program::tasks: the task whose argument owns the slot
  std::string arg;
  ArgType type = ArgType::float_;
  int64_t offset = 0;  // from the arena's start
  ArgValue initial;
  std::string name(const Program& program) const;  // "task.arg"
};
constexpr int64_t kScalarBytes = 8;

// The bytes a scalar's value takes in the arena (kScalarBytes; the unused tail zero).
void encode_scalar(ArgType type, const ArgValue& value, unsigned char* out);

struct Plan {
  std::vector<PlannedBuffer> buffers;  // same order as Program::buffers
  std::vector<PlannedScalar> scalars;  // in task order, one per run-time argument that no other follows
  // Every byte the runtime allocates: buffers, then the scalars region, then
  // (added by the pipeline after emit) the emitter's workspaces: the
  // megakernel's event counters, split-K's sums, flash attention's statistics.
  int64_t arena_bytes = 0;
  int64_t planned_bytes = 0;  // arena_bytes as the planner left it, before those workspaces
  int64_t persistent_bytes = 0;  // the persistent region, at the start of the arena
  int64_t scalars_offset = 0;    // the scalars region, after every buffer
  int64_t scalars_bytes = 0;
  int64_t lower_bound = 0;
  int64_t no_reuse_bytes = 0;
  int64_t alignment = 256;
  int64_t budget = 0;  // 0: none
  bool reuse = true;   // buffers share storage when their lifetimes do not overlap (views always do)
  std::string method;  // the placement method that produced the offsets

  struct Location {
    int buffer;
    int64_t offset;
    int64_t bytes;
  };
  // Where a task's slot lives (the design notes' "retriever"), answered at
  // generation time. Throws std::out_of_range for an unknown task or slot.
  Location lookup(const Program& program, const std::string& task, const std::string& slot) const;

  // The scalar that argument `arg` of task `task` reads at run time (an
  // argument that follows another's reads that one's), or nullptr where it is
  // a constant.
  const PlannedScalar* scalar_of(const Program& program, int task, const std::string& arg) const;
  // By name ("task.arg"); nullptr where there is none.
  const PlannedScalar* find_scalar(const Program& program, const std::string& name) const;
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

// {view buffer, source buffer} of every view task (reshape): two names for
// one storage and one value.
std::vector<std::pair<int, int>> view_pairs(const Program& program);

}  // namespace cudagen
