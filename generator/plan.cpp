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

bool overlap_in_time(const LiveInterval& a, const LiveInterval& b) { return a.first <= b.last && b.first <= a.last; }

}  // namespace

std::vector<int64_t> place_greedy_by_size(const std::vector<LiveInterval>& intervals, const PlacementOptions& options) {
  const size_t n = intervals.size();
  std::vector<int64_t> offsets(n, 0);
  if (!options.reuse) {
    int64_t end = 0;
    for (size_t i = 0; i < n; ++i) {
      offsets[i] = end;
      end += align_up(intervals[i].bytes, options.alignment);
    }
    return offsets;
  }
  // Largest first; ties by first use, then by index, so the result is deterministic.
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (intervals[a].bytes != intervals[b].bytes) return intervals[a].bytes > intervals[b].bytes;
    return intervals[a].first < intervals[b].first;
  });
  std::vector<size_t> placed;
  std::vector<std::pair<int64_t, int64_t>> busy;  // [offset, end) of placed buffers live at the same time
  for (size_t i : order) {
    const int64_t size = align_up(intervals[i].bytes, options.alignment);
    busy.clear();
    for (size_t p : placed)
      if (overlap_in_time(intervals[i], intervals[p]))
        busy.emplace_back(offsets[p], offsets[p] + align_up(intervals[p].bytes, options.alignment));
    std::sort(busy.begin(), busy.end());
    // Best fit: the smallest gap between busy ranges that holds the buffer; else after the last one.
    int64_t best = -1, best_gap = INT64_MAX, cursor = 0;
    for (const auto& [start, end] : busy) {
      if (start > cursor && start - cursor >= size && start - cursor < best_gap) {
        best = cursor;
        best_gap = start - cursor;
      }
      cursor = std::max(cursor, end);
    }
    offsets[i] = best >= 0 ? best : cursor;
    placed.push_back(i);
  }
  return offsets;
}

int64_t lower_bound_bytes(const std::vector<LiveInterval>& intervals, int64_t alignment) {
  // Sweep: +bytes at first, -bytes after last.
  std::vector<std::pair<int, int64_t>> events;
  events.reserve(intervals.size() * 2);
  for (const auto& iv : intervals) {
    int64_t bytes = align_up(iv.bytes, alignment);
    events.emplace_back(iv.first, bytes);
    events.emplace_back(iv.last + 1, -bytes);
  }
  std::sort(events.begin(), events.end());  // at equal steps, frees (negative) come first
  int64_t live = 0, peak = 0;
  for (const auto& [step, delta] : events) {
    live += delta;
    peak = std::max(peak, live);
  }
  return peak;
}

std::string verify_placement(const std::vector<LiveInterval>& intervals, const std::vector<int64_t>& offsets,
                             int64_t arena_bytes, int64_t alignment) {
  if (offsets.size() != intervals.size()) return "one offset per buffer is required";
  std::vector<size_t> by_offset(intervals.size());
  std::iota(by_offset.begin(), by_offset.end(), 0);
  for (size_t i = 0; i < intervals.size(); ++i) {
    if (offsets[i] < 0 || offsets[i] % alignment != 0)
      return fmt::format("buffer {} at offset {} is not aligned to {}", i, offsets[i], alignment);
    if (offsets[i] + intervals[i].bytes > arena_bytes)
      return fmt::format("buffer {} [{}, {}) ends past the arena ({} bytes)", i, offsets[i], offsets[i] + intervals[i].bytes,
                         arena_bytes);
  }
  // Sort by offset; each buffer is compared with the later-starting ones it reaches in memory.
  std::sort(by_offset.begin(), by_offset.end(), [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
  for (size_t x = 0; x < by_offset.size(); ++x) {
    size_t a = by_offset[x];
    int64_t a_end = offsets[a] + intervals[a].bytes;
    for (size_t y = x + 1; y < by_offset.size() && offsets[by_offset[y]] < a_end; ++y) {
      size_t b = by_offset[y];
      if (intervals[b].bytes > 0 && intervals[a].bytes > 0 && overlap_in_time(intervals[a], intervals[b]))
        return fmt::format("buffers {} [{}, {}) and {} [{}, {}) overlap in memory while both live (steps {}-{} and {}-{})",
                           a, offsets[a], a_end, b, offsets[b], offsets[b] + intervals[b].bytes, intervals[a].first,
                           intervals[a].last, intervals[b].first, intervals[b].last);
    }
  }
  return "";
}

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
  std::vector<int64_t> offsets = place_greedy_by_size(intervals, options.placement);
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
