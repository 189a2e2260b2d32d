#include "plan.h"

#include <algorithm>
#include <cstring>
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

std::string PlannedScalar::name(const Program& program) const {
  return program.tasks[size_t(task)].task->id + "." + arg;
}

void encode_scalar(ArgType type, const ArgValue& value, unsigned char* out) {
  std::memset(out, 0, kScalarBytes);
  const double number = arg_number(value);
  if (type == ArgType::float_) {
    float f = float(number);
    std::memcpy(out, &f, sizeof f);
  } else if (type == ArgType::int_) {
    int64_t i = std::holds_alternative<int64_t>(value) ? std::get<int64_t>(value) : int64_t(number);
    std::memcpy(out, &i, sizeof i);
  } else {
    int32_t b = number != 0;
    std::memcpy(out, &b, sizeof b);
  }
}

const PlannedScalar* Plan::scalar_of(const Program& program, int task, const std::string& arg) const {
  auto [root_task, root] = root_arg(program, task, arg);
  if (root == nullptr) return nullptr;
  for (const auto& s : scalars)
    if (s.task == root_task && s.arg == root->name) return &s;
  return nullptr;
}

const PlannedScalar* Plan::find_scalar(const Program& program, const std::string& name) const {
  for (const auto& s : scalars)
    if (s.name(program) == name) return &s;
  return nullptr;
}

std::vector<std::pair<int, int>> view_pairs(const Program& program) {
  std::vector<std::pair<int, int>> out;
  for (const auto& task : program.tasks) {
    if (task.op->view.first.empty()) continue;
    const BoundTensor* view = task.find_tensor(task.op->view.first);
    const BoundTensor* source = task.find_tensor(task.op->view.second);
    if (view != nullptr && source != nullptr && view->buffer != source->buffer)
      out.emplace_back(view->buffer, source->buffer);
  }
  return out;
}

namespace {

bool reusable(Storage s) { return s == Storage::transient || s == Storage::saved; }

// in_place_of[b]: the buffer whose storage b takes over (may_alias), or -1.
// `intervals` over kernel indices: an input may give its storage to an output
// of the kernel where it dies, when no other kernel of that launch reads it.
std::vector<int> find_in_place(const Program& program, const std::vector<KernelGroup>& kernels,
                               const std::vector<std::vector<int>>& kernel_buffers,
                               const std::vector<LiveInterval>& intervals, const std::vector<int>& internal_to) {
  std::vector<int> in_place_of(program.buffers.size(), -1);
  auto dies_in = [&](int b, int k) {
    if (intervals[size_t(b)].last != k) return false;
    for (int j = k - 1; j >= 0 && kernels[size_t(j)].launch == kernels[size_t(k)].launch; --j)
      if (contains(kernel_buffers[size_t(j)], b)) return false;
    return true;
  };
  std::vector<bool> taken(program.buffers.size(), false);
  // A view and its source share storage while both live: neither may hand it
  // to an in-place output.
  for (auto [view, source] : view_pairs(program)) taken[size_t(view)] = taken[size_t(source)] = true;
  // A value in a fused kernel's registers has no storage to give or take.
  auto internal = [&](int b) { return internal_to[size_t(b)] >= 0; };
  for (int k = 0; k < int(kernels.size()); ++k) {
    // What the kernel reads while other blocks (or threads) of it still
    // compute: nothing it stores may take that storage. From its IR
    // (kir.h): every stage's mainloop reads across elements (rows, columns,
    // heads), as a prologue's loads do; a stage's chain runs while later
    // stages of other blocks read, and reads at another element than theirs
    // (an attention's projections, a matmul chain's first product, a
    // gradient's epilogue before the next gradient; a row reduction's
    // product's, conservatively: its reductions read the value from shared
    // memory, not the chain's inputs). Only the last stage's
    // chain reads each element where it stores it. (An elementwise kernel's
    // one stage is its chain: nothing.)
    const KernelGroup& kernel = kernels[size_t(k)];
    if (kernel.ir.stages.empty())
      throw std::logic_error(fmt::format("internal error: kernel {} reaches the memory plan without its IR", kernel.name));
    std::vector<int> readers_elsewhere = kernel.prologue;
    for (size_t s = 0; s < kernel.ir.stages.size(); ++s) {
      const kir::Stage& stage = kernel.ir.stages[s];
      if (stage.task >= 0) readers_elsewhere.push_back(stage.task);
      if (s + 1 < kernel.ir.stages.size())
        for (int node : stage.chain) readers_elsewhere.push_back(kernel.ir.nodes[size_t(node)].task);
    }
    std::vector<int> read_elsewhere;
    for (int t : readers_elsewhere)
      for (const auto& in : program.tasks[size_t(t)].tensors)
        if (in.sig != nullptr && !in.sig->written()) read_elsewhere.push_back(in.buffer);
    for (int t : kernel.tasks) {
      const BoundTask& task = program.tasks[size_t(t)];
      // Only loops where each thread reads an element and then writes the same one.
      if (task.op->pattern != PatternKind::elementwise && task.op->pattern != PatternKind::broadcast) continue;
      for (const auto& [out_slot, in_slot] : task.op->may_alias) {
        const BoundTensor* out = task.find_tensor(out_slot);
        const BoundTensor* in = task.find_tensor(in_slot);
        if (out == nullptr || in == nullptr || out->buffer == in->buffer) continue;
        int bo = out->buffer, bi = in->buffer;
        const BufferInfo &o = program.buffers[size_t(bo)], &i = program.buffers[size_t(bi)];
        if (!reusable(o.storage) || !reusable(i.storage) || o.bytes != i.bytes || taken[size_t(bi)] ||
            internal(bi) || internal(bo) || contains(read_elsewhere, bi))
          continue;
        if (!dies_in(bi, k) || intervals[size_t(bo)].first != k) continue;  // the input must die here
        taken[size_t(bi)] = true;
        in_place_of[size_t(bo)] = bi;
      }
    }
    // A fused elementwise chain reads every input of the kernel's shape at the
    // element's own index, before it stores that element: a stored output may
    // take the storage of any such input of its dtype that dies here.
    const KernelGroup& group = kernels[size_t(k)];
    if (group.rule != FusionRule::elementwise_chain) continue;
    for (int t : group.tasks) {
      const BoundTask& task = program.tasks[size_t(t)];
      for (const auto& out : task.tensors) {
        if (out.sig == nullptr || out.sig->role != SlotRole::output) continue;
        const int bo = out.buffer;
        const BufferInfo& o = program.buffers[size_t(bo)];
        if (internal(bo) || in_place_of[size_t(bo)] >= 0 || !reusable(o.storage) ||
            intervals[size_t(bo)].first != k)
          continue;
        for (int reader : group.tasks)
          for (const auto& in : program.tasks[size_t(reader)].tensors) {
            const int bi = in.buffer;
            if (in_place_of[size_t(bo)] >= 0 || bi < 0 || in.source_task < 0 || bi == bo || taken[size_t(bi)] ||
                internal(bi))
              continue;
            const BufferInfo& i = program.buffers[size_t(bi)];
            if (!reusable(i.storage) || i.shape != o.shape || i.dtype != o.dtype || !dies_in(bi, k))
              continue;
            taken[size_t(bi)] = true;
            in_place_of[size_t(bo)] = bi;
          }
      }
    }
  }
  return in_place_of;
}

}  // namespace

Plan plan_memory(const Program& program, const std::vector<KernelGroup>& kernels, const PlanOptions& options) {
  const std::vector<std::vector<int>> kernel_buffers = cudagen::kernel_buffers(program, kernels);
  const int last_kernel = std::max(0, int(kernel_buffers.size()) - 1);
  std::vector<LiveInterval> intervals(program.buffers.size(), LiveInterval{0, -1, -1});
  for (int k = 0; k < int(kernel_buffers.size()); ++k) {
    for (int b : kernel_buffers[size_t(k)]) {
      LiveInterval& iv = intervals[size_t(b)];
      if (iv.first < 0) iv.first = k;
      iv.last = std::max(iv.last, k);
    }
  }
  // The kernel a buffer lives inside, or -1. A norm prologue's output is
  // internal to the kernels that recompute it, but has storage where one of
  // them stores it (kernels.h): it is in that kernel's buffers.
  std::vector<int> internal_to(program.buffers.size(), -1);
  for (int k = 0; k < int(kernels.size()); ++k)
    for (int b : kernels[size_t(k)].internal_buffers)
      if (intervals[size_t(b)].first < 0) internal_to[size_t(b)] = k;
  for (size_t b = 0; b < program.buffers.size(); ++b) {
    LiveInterval& iv = intervals[b];
    iv.bytes = program.buffers[b].bytes;
    if (internal_to[b] >= 0) {  // in registers: a placeholder interval, placed nowhere
      iv = LiveInterval{0, internal_to[b], internal_to[b]};
      continue;
    }
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
  plan.reuse = options.placement.reuse;

  // Placement units: a buffer and those that take over its storage in place
  // share one unit, live from the first one's birth to the last one's death.
  std::vector<int> in_place_of = options.placement.reuse
                                     ? find_in_place(program, kernels, kernel_buffers, intervals, internal_to)
                                     : std::vector<int>(intervals.size(), -1);
  // From here on, lifetimes count launches: the kernels of one launch
  // (rule horizontal) run at the same time, so what they touch lives at once.
  for (size_t b = 0; b < intervals.size(); ++b)
    if (internal_to[b] < 0 && intervals[b].first >= 0) {
      intervals[b].first = kernels.empty() ? 0 : kernels[size_t(intervals[b].first)].launch;
      intervals[b].last = kernels.empty() ? 0 : kernels[size_t(intervals[b].last)].launch;
    }
  // A view takes its source's storage, reuse or not: no kernel copies it.
  for (auto [view, source] : view_pairs(program)) in_place_of[size_t(view)] = source;
  std::vector<int> unit_of(intervals.size(), -1);
  std::vector<LiveInterval> units;
  for (size_t b = 0; b < intervals.size(); ++b) {  // owners come before the buffers that reuse them
    if (internal_to[b] >= 0) continue;
    int root = int(b);
    while (in_place_of[size_t(root)] >= 0) root = in_place_of[size_t(root)];
    if (unit_of[size_t(root)] < 0) {
      unit_of[size_t(root)] = int(units.size());
      units.push_back(intervals[size_t(root)]);
    }
    LiveInterval& unit = units[size_t(unit_of[size_t(root)])];
    unit_of[b] = unit_of[size_t(root)];
    unit.first = std::min(unit.first, intervals[b].first);
    unit.last = std::max(unit.last, intervals[b].last);
    unit.bytes = std::max(unit.bytes, intervals[b].bytes);
  }
  // Persistent buffers (weights, optimizer state) get their own region at the
  // start of the arena, in graph order: they live throughout anyway, and one
  // contiguous block is what a checkpoint saves and loads.
  std::vector<bool> unit_persistent(units.size(), false);
  for (size_t b = 0; b < intervals.size(); ++b)
    if (program.buffers[b].storage == Storage::persistent && unit_of[b] >= 0) unit_persistent[size_t(unit_of[b])] = true;
  std::vector<int64_t> unit_offset(units.size(), 0);
  std::vector<LiveInterval> others;
  std::vector<size_t> other_units;
  int64_t persistent_end = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    if (unit_persistent[u]) {
      unit_offset[u] = persistent_end;
      persistent_end += align_up(units[u].bytes, plan.alignment);
    } else {
      others.push_back(units[u]);
      other_units.push_back(u);
    }
  }
  PlacementOptions placement_options = options.placement;
  if (options.budget_bytes > 0 && placement_options.capacity == 0)
    placement_options.capacity = std::max<int64_t>(0, options.budget_bytes - persistent_end);
  Placement placement = place_buffers(others, placement_options);
  for (size_t i = 0; i < other_units.size(); ++i) unit_offset[other_units[i]] = persistent_end + placement.offsets[i];
  plan.method = placement.method;
  plan.persistent_bytes = persistent_end;
  for (size_t b = 0; b < intervals.size(); ++b) {
    if (internal_to[b] >= 0) {
      PlannedBuffer pb{int(b), 0, 0, internal_to[b], internal_to[b], -1};
      pb.internal = true;
      plan.buffers.push_back(pb);
      continue;
    }
    int64_t offset = unit_offset[size_t(unit_of[b])];
    plan.buffers.push_back(
        PlannedBuffer{int(b), offset, intervals[b].bytes, intervals[b].first, intervals[b].last, in_place_of[b]});
    plan.arena_bytes = std::max(plan.arena_bytes, align_up(offset + intervals[b].bytes, plan.alignment));
    plan.no_reuse_bytes += align_up(intervals[b].bytes, plan.alignment);
  }
  plan.lower_bound = lower_bound_bytes(units, plan.alignment);
  std::string problem = verify_placement(units, unit_offset, plan.arena_bytes, plan.alignment);
  if (!problem.empty()) throw std::logic_error("memory planner produced an invalid plan: " + problem);

  // The scalars region: after every buffer, so that a graph without run-time
  // arguments keeps the same offsets, and outside every buffer's bounds.
  for (size_t t = 0; t < program.tasks.size(); ++t)
    for (const auto& a : program.tasks[t].args)
      if (a.runtime && a.source_task < 0 && a.sig != nullptr) {
        const int64_t offset = plan.arena_bytes + int64_t(plan.scalars.size()) * kScalarBytes;
        plan.scalars.push_back(PlannedScalar{int(t), a.name, a.sig->type, offset, a.value});
      }
  plan.scalars_offset = plan.arena_bytes;
  plan.scalars_bytes = align_up(int64_t(plan.scalars.size()) * kScalarBytes, plan.alignment);
  plan.arena_bytes += plan.scalars_bytes;

  if (options.budget_bytes > 0 && plan.arena_bytes > options.budget_bytes) {
    // Name the busiest step and what lives there, largest first.
    int peak_step = 0;
    int64_t peak = -1;
    const int launches = launch_count(kernels);
    for (int k = 0; k < launches; ++k) {
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
                                     "launch {}, where these buffers live, largest first:{}",
                                     plan.arena_bytes, human_bytes(plan.arena_bytes), plan.arena_bytes - options.budget_bytes,
                                     options.budget_bytes, peak_step, list),
                         "raise the budget, or shrink the largest live tensors (smaller batch)"});
    throw CompileError(std::move(diags));
  }
  return plan;
}

}  // namespace cudagen
