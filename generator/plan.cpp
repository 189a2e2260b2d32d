#include "plan.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

#include <fmt/format.h>

#include "describe.h"
#include "diagnostics.h"

namespace cudagen {

namespace {

int64_t align_up(int64_t x, int64_t alignment) { return (x + alignment - 1) / alignment * alignment; }

}  // namespace

Plan::Location Plan::lookup(const Program& program, const std::string& task, const std::string& slot) const {
  for (const auto& t : program.tasks) {
    if (t.task->id != task) continue;
    const BoundTensor* b = t.find_tensor(slot);
    if (b == nullptr || b->buffer < 0) break;
    const PlannedBuffer& pb = buffers[size_t(b->buffer)];
    return Location{b->buffer, pb.offset, pb.bytes};
  }
  throw std::out_of_range(fmt::format("no tensor slot {}.{} in the plan", task, slot));
}

Plan plan_memory(const Program& program, const std::vector<std::vector<int>>& kernel_buffers,
                 const PlanOptions& options) {
  const int last_kernel = std::max(0, int(kernel_buffers.size()) - 1);
  std::vector<LiveInterval> intervals(program.buffers.size(), LiveInterval{0, -1, -1});
  for (int k = 0; k < int(kernel_buffers.size()); ++k) {
    for (int b : kernel_buffers[size_t(k)]) {
      LiveInterval& iv = intervals[size_t(b)];
      if (iv.first < 0) iv.first = k;
      iv.last = std::max(iv.last, k);
    }
  }
  for (size_t b = 0; b < program.buffers.size(); ++b) {
    LiveInterval& iv = intervals[b];
    iv.bytes = program.buffers[b].bytes;
    Storage s = program.buffers[b].storage;
    // Bound or read by the caller between phases, or kept across calls: alive throughout.
    if (s == Storage::persistent || s == Storage::external || iv.first < 0) {
      iv.first = 0;
      iv.last = last_kernel;
    }
  }
  Plan plan;
  plan.alignment = options.placement.alignment;
  plan.budget = options.budget_bytes;
  Placement placement = place_buffers(intervals, options.placement);
  const std::vector<int64_t>& offsets = placement.offsets;
  plan.method = placement.method;
  for (size_t b = 0; b < intervals.size(); ++b) {
    plan.buffers.push_back(PlannedBuffer{int(b), offsets[b], intervals[b].bytes, intervals[b].first, intervals[b].last});
    plan.arena_bytes = std::max(plan.arena_bytes, align_up(offsets[b] + intervals[b].bytes, plan.alignment));
    plan.no_reuse_bytes += align_up(intervals[b].bytes, plan.alignment);
  }
  plan.lower_bound = lower_bound_bytes(intervals, plan.alignment);
  std::string problem = verify_placement(intervals, offsets, plan.arena_bytes, plan.alignment);
  if (!problem.empty()) throw std::logic_error("memory planner produced an invalid plan: " + problem);

  if (options.budget_bytes > 0 && plan.arena_bytes > options.budget_bytes) {
    // Name the busiest step and what lives there, largest first.
    int peak_step = 0;
    int64_t peak = -1;
    for (int k = 0; k <= last_kernel; ++k) {
      int64_t live = 0;
      for (const auto& iv : intervals)
        if (iv.first <= k && k <= iv.last) live += iv.bytes;
      if (live > peak) {
        peak = live;
        peak_step = k;
      }
    }
    std::vector<size_t> live;
    for (size_t b = 0; b < intervals.size(); ++b)
      if (intervals[b].first <= peak_step && peak_step <= intervals[b].last) live.push_back(b);
    std::sort(live.begin(), live.end(), [&](size_t a, size_t b) { return intervals[a].bytes > intervals[b].bytes; });
    std::string list;
    for (size_t i = 0; i < live.size() && i < 8; ++i) {
      const BufferInfo& bi = program.buffers[live[i]];
      list += fmt::format("\n    {}.{} ({}, {})", program.tasks[size_t(bi.owner_task)].task->id, bi.owner_slot,
                          human_bytes(bi.bytes), to_string(bi.storage));
    }
    Diagnostics diags;
    diags.add(Diagnostic{{}, {}, {}, {}, {},
                         fmt::format("the memory plan needs {} bytes ({}), {} over the budget of {} bytes; the peak is at "
                                     "kernel {}, where these buffers live, largest first:{}",
                                     plan.arena_bytes, human_bytes(plan.arena_bytes), plan.arena_bytes - options.budget_bytes,
                                     options.budget_bytes, peak_step, list),
                         "raise the budget, or shrink the largest live tensors (smaller batch)"});
    throw CompileError(std::move(diags));
  }
  return plan;
}

}  // namespace cudagen
