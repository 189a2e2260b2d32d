#include "megakernel.h"

#include <algorithm>
#include <fmt/format.h>

#include "emit.h"

namespace cudagen {

int64_t megakernel_tiles(const EmittedKernel& kernel, int blocks) {
  const int64_t grid = int64_t(kernel.grid[0]) * kernel.grid[1] * kernel.grid[2];
  return kernel.grid_stride ? std::min<int64_t>(grid, blocks) : grid;
}

int64_t megakernel_tile_cost(const EmittedKernel& kernel, int64_t tiles) {
  const int64_t bytes = kernel.bytes_read + kernel.bytes_written;
  const int64_t flops = std::max<int64_t>(kernel.flops, 0);
  return 1 + bytes / tiles / 1024 + flops / tiles / 16384;
}

namespace {

bool conflict(const EmittedKernel& a, const EmittedKernel& b) {
  for (const ArenaRange& x : a.ranges)
    for (const ArenaRange& y : b.ranges)
      if ((x.written || y.written) && x.offset < y.offset + y.bytes && y.offset < x.offset + x.bytes) return true;
  return false;
}

// Per kernel, the earlier kernels it must wait for, without those implied by
// another: if B waits for A and C waits for B, C need not wait for A.
std::vector<std::vector<int>> reduced_dependences(const std::vector<const EmittedKernel*>& ks) {
  const size_t n = ks.size();
  std::vector<std::vector<bool>> reaches(n, std::vector<bool>(n, false));  // reaches[j][i]: j waits (transitively) for i
  std::vector<std::vector<int>> deps(n);
  for (size_t j = 0; j < n; ++j) {
    std::vector<int> direct;
    for (size_t i = 0; i < j; ++i)
      if (conflict(*ks[i], *ks[j])) direct.push_back(int(i));
    // Latest first: a later dependence that already reaches an earlier one makes it redundant.
    for (auto it = direct.rbegin(); it != direct.rend(); ++it) {
      if (reaches[j][size_t(*it)]) continue;
      deps[j].push_back(*it);
      reaches[j][size_t(*it)] = true;
      for (size_t i = 0; i < j; ++i)
        if (reaches[size_t(*it)][i]) reaches[j][i] = true;
    }
    std::sort(deps[j].begin(), deps[j].end());
  }
  return deps;
}

MegakernelPhase schedule_phase(Phase phase, const std::vector<EmittedKernel>& all, const std::vector<int>& indices,
                               const MegakernelOptions& options) {
  MegakernelPhase mp;
  mp.phase = phase;
  mp.kernels = indices;
  mp.blocks = options.blocks;
  std::vector<const EmittedKernel*> ks;
  for (int i : indices) ks.push_back(&all[size_t(i)]);
  const size_t n = ks.size();
  for (const EmittedKernel* k : ks) {
    mp.tiles.push_back(megakernel_tiles(*k, options.blocks));
    mp.threads = std::max(mp.threads, k->block);
  }
  for (const EmittedKernel* k : ks)
    mp.smem_bytes = std::max(mp.smem_bytes, k->smem_bytes + k->smem_bytes_per_thread * (mp.threads - k->block));
  mp.dependences = reduced_dependences(ks);

  // Events: a kernel's "done" where another waits for it, a join event where
  // a kernel waits for several.
  std::vector<int> done_event(n, -1), join_event(n, -1);
  for (size_t j = 0; j < n; ++j)
    for (int d : mp.dependences[j])
      if (done_event[size_t(d)] < 0) {
        done_event[size_t(d)] = int(mp.events.size());
        mp.events.push_back({ks[size_t(d)]->name + " done", mp.tiles[size_t(d)]});
      }
  for (size_t j = 0; j < n; ++j)
    if (mp.dependences[j].size() > 1) {
      join_event[j] = int(mp.events.size());
      mp.events.push_back({ks[j]->name + " inputs", int64_t(mp.dependences[j].size())});
    }

  std::vector<int64_t> cost(n);
  for (size_t j = 0; j < n; ++j) cost[j] = megakernel_tile_cost(*ks[j], mp.tiles[j]);
  // Bottom levels: the estimated time from a kernel's start to the phase's end
  // (a join costs 1), and the critical path in tasks.
  std::vector<std::vector<int>> consumers(n);
  for (size_t j = 0; j < n; ++j)
    for (int d : mp.dependences[j]) consumers[size_t(d)].push_back(int(j));
  std::vector<int64_t> bottom(n, 0);
  std::vector<int> chain(n, 0);
  for (size_t j = n; j-- > 0;) {
    int64_t below = 0;
    int tasks_below = 0;
    for (int c : consumers[j]) {
      const int join = mp.dependences[size_t(c)].size() > 1 ? 1 : 0;
      below = std::max(below, bottom[size_t(c)] + join);
      tasks_below = std::max(tasks_below, chain[size_t(c)] + join);
    }
    bottom[j] = cost[j] + below;
    chain[j] = 1 + tasks_below;
    mp.critical_path_tasks = std::max(mp.critical_path_tasks, chain[j]);
  }

  // List scheduling, a kernel at a time.
  std::vector<std::vector<MegakernelTask>> queues(size_t(mp.blocks));
  std::vector<int64_t> free_at(size_t(mp.blocks), 0), finish(n, 0);
  std::vector<bool> placed(n, false);
  int64_t busy = 0;
  auto place = [&](MegakernelTask task, int64_t ready) {
    int best = 0;
    for (int b = 1; b < mp.blocks; ++b)
      if (std::max(free_at[size_t(b)], ready) < std::max(free_at[size_t(best)], ready)) best = b;
    task.start = std::max(free_at[size_t(best)], ready);
    free_at[size_t(best)] = task.start + task.cost;
    busy += task.cost;
    queues[size_t(best)].push_back(task);
    return task.start + task.cost;
  };
  for (size_t round = 0; round < n; ++round) {
    int next = -1;
    for (size_t j = 0; j < n; ++j) {
      if (placed[j]) continue;
      bool ready = true;
      for (int d : mp.dependences[j]) ready = ready && placed[size_t(d)];
      if (ready && (next < 0 || bottom[j] > bottom[size_t(next)])) next = int(j);
    }
    const size_t j = size_t(next);
    placed[j] = true;
    int64_t ready = 0;
    int wait = -1;
    int64_t wait_count = 0;
    if (mp.dependences[j].size() == 1) {
      const int d = mp.dependences[j][0];
      ready = finish[size_t(d)];
      wait = done_event[size_t(d)];
      wait_count = mp.tiles[size_t(d)];
    } else if (mp.dependences[j].size() > 1) {
      for (int d : mp.dependences[j]) {
        MegakernelTask join;
        join.wait = done_event[size_t(d)];
        join.wait_count = mp.tiles[size_t(d)];
        join.trigger = join_event[j];
        ready = std::max(ready, place(join, finish[size_t(d)]));
      }
      wait = join_event[j];
      wait_count = int64_t(mp.dependences[j].size());
    }
    for (int64_t t = 0; t < mp.tiles[j]; ++t) {
      MegakernelTask task;
      task.kernel = indices[j];
      task.tile = t;
      task.wait = wait;
      task.wait_count = wait_count;
      task.trigger = done_event[j];
      task.cost = cost[j];
      finish[j] = std::max(finish[j], place(task, ready));
    }
  }
  for (const auto& q : queues) {
    mp.queue_begin.push_back(int(mp.tasks.size()));
    mp.tasks.insert(mp.tasks.end(), q.begin(), q.end());
  }
  mp.queue_begin.push_back(int(mp.tasks.size()));
  mp.makespan = *std::max_element(free_at.begin(), free_at.end());
  mp.idle_fraction = mp.makespan > 0 ? 1.0 - double(busy) / double(mp.makespan * mp.blocks) : 0.0;

  if (options.break_schedule)
    for (MegakernelTask& t : mp.tasks)
      if (t.trigger >= 0) {
        t.trigger = -1;  // its event never reaches its count: whoever waits on it waits forever
        break;
      }
  return mp;
}

}  // namespace

std::vector<MegakernelPhase> schedule_megakernel(const std::vector<EmittedKernel>& kernels,
                                                 const MegakernelOptions& options) {
  std::vector<MegakernelPhase> phases;
  for (Phase phase : {Phase::init, Phase::forward, Phase::backward, Phase::update}) {
    std::vector<int> indices;
    for (size_t i = 0; i < kernels.size(); ++i)
      if (kernels[i].phase == phase) indices.push_back(int(i));
    if (!indices.empty()) phases.push_back(schedule_phase(phase, kernels, indices, options));
  }
  return phases;
}

std::string describe_megakernel(const std::vector<MegakernelPhase>& phases, const std::vector<EmittedKernel>& kernels) {
  std::string out;
  for (const MegakernelPhase& mp : phases) {
    int joins = 0;
    for (const auto& t : mp.tasks) joins += t.kernel < 0;
    out += fmt::format(
        "{} phase: one megakernel of {} blocks x {} threads, {} bytes of shared memory\n"
        "  {} kernels as {} tile tasks and {} join tasks; {} events\n"
        "  critical path {} tasks; estimated makespan {} units, blocks idle {:.1f}% of it\n",
        to_string(mp.phase), mp.blocks, mp.threads, mp.smem_bytes, mp.kernels.size(), mp.tasks.size() - size_t(joins),
        joins, mp.events.size(), mp.critical_path_tasks, mp.makespan, 100.0 * mp.idle_fraction);
    out += "  kernels (tiles, waits for):\n";
    for (size_t j = 0; j < mp.kernels.size(); ++j) {
      std::vector<std::string> deps;
      for (int d : mp.dependences[j]) deps.push_back(kernels[size_t(mp.kernels[size_t(d)])].name);
      out += fmt::format("    {:<32} {:>6}  {}\n", kernels[size_t(mp.kernels[j])].name, mp.tiles[j],
                         deps.empty() ? "-" : fmt::format("{}", fmt::join(deps, ", ")));
    }
    out += "  events (triggers per launch):\n";
    for (size_t e = 0; e < mp.events.size(); ++e)
      out += fmt::format("    e{:<4} {:>6}  {}\n", e, mp.events[e].triggers, mp.events[e].what);
    out += "  tasks per block (kernel:tile, j = join):\n";
    for (int b = 0; b < mp.blocks; ++b) {
      std::vector<std::string> items;
      for (int q = mp.queue_begin[size_t(b)]; q < mp.queue_begin[size_t(b) + 1]; ++q) {
        const MegakernelTask& t = mp.tasks[size_t(q)];
        items.push_back(t.kernel < 0 ? fmt::format("j(e{}->e{})", t.wait, t.trigger)
                                     : fmt::format("{}:{}", kernels[size_t(t.kernel)].name, t.tile));
      }
      out += fmt::format("    block {:>3} ({:>3} tasks): {}\n", b, items.size(),
                         items.empty() ? "-" : fmt::format("{}", fmt::join(items, " ")));
    }
  }
  return out;
}

}  // namespace cudagen
