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

struct Dependences {
  std::vector<std::vector<int>> direct;           // every earlier kernel each conflicts with
  std::vector<std::vector<int>> reduced;          // without those implied by another
  std::vector<std::vector<int>> consumers;        // the kernels whose `reduced` names each
  std::vector<std::vector<bool>> reaches;         // reaches[j][i]: i is done once j is
};

// Per kernel, the earlier kernels it must wait for, without those implied by
// another: if B waits for A and C waits for B, C need not wait for A.
Dependences reduced_dependences(const std::vector<const EmittedKernel*>& ks) {
  const size_t n = ks.size();
  Dependences d;
  d.direct.resize(n);
  d.reduced.resize(n);
  d.reaches.assign(n, std::vector<bool>(n, false));
  for (size_t j = 0; j < n; ++j) {
    for (size_t i = 0; i < j; ++i)
      if (conflict(*ks[i], *ks[j])) d.direct[j].push_back(int(i));
    // Latest first: a later dependence that already reaches an earlier one makes it redundant.
    for (auto it = d.direct[j].rbegin(); it != d.direct[j].rend(); ++it) {
      if (d.reaches[j][size_t(*it)]) continue;
      d.reduced[j].push_back(*it);
      d.reaches[j][size_t(*it)] = true;
      for (size_t i = 0; i < j; ++i)
        if (d.reaches[size_t(*it)][i]) d.reaches[j][i] = true;
    }
    std::sort(d.reduced[j].begin(), d.reduced[j].end());
  }
  d.consumers.resize(n);
  for (size_t j = 0; j < n; ++j)
    for (int p : d.reduced[j]) d.consumers[size_t(p)].push_back(int(j));
  return d;
}

// Whether consumer c may wait for producer p row by row: every conflict
// between them is c reading rows that p writes, both splitting them by tiles.
bool by_rows_compatible(const EmittedKernel& p, const EmittedKernel& c) {
  if (p.rows_per_tile <= 0 || c.rows_per_tile <= 0 || p.rows != c.rows) return false;
  const int64_t big = std::max(p.rows_per_tile, c.rows_per_tile), small = std::min(p.rows_per_tile, c.rows_per_tile);
  if (big % small != 0) return false;
  for (const ArenaRange& x : p.ranges)
    for (const ArenaRange& y : c.ranges) {
      if (!(x.written || y.written) || x.offset >= y.offset + y.bytes || y.offset >= x.offset + x.bytes) continue;
      if (!x.written || y.written || !x.by_rows || !y.by_rows || x.offset != y.offset || x.bytes != y.bytes) return false;
    }
  return true;
}

// Which kernels wait by rows, and the rows per event of each producer whose
// consumers all do (0: whole kernels). A consumer waits by rows for its one
// dependence p when they are compatible and every other kernel it conflicts
// with is certainly finished before any tile of p starts (`started`).
std::vector<int64_t> choose_by_rows(const std::vector<const EmittedKernel*>& ks, const Dependences& d,
                                    std::vector<int64_t>& producer_chunk) {
  const size_t n = ks.size();
  std::vector<std::vector<bool>> started(n);  // started[j][i]: i is finished before any tile of j starts
  std::vector<bool> candidate(n, false);
  for (size_t j = 0; j < n; ++j) {
    started[j] = d.reaches[j];  // waiting for whole kernels: all they wait for, transitively
    if (d.reduced[j].size() != 1) continue;
    const size_t p = size_t(d.reduced[j][0]);
    if (!by_rows_compatible(*ks[p], *ks[j])) continue;
    bool others_done = true;
    for (int q : d.direct[j]) others_done = others_done && (size_t(q) == p || started[p][size_t(q)]);
    if (!others_done) continue;
    candidate[j] = true;
    started[j] = started[p];  // a tile of j starts once some tiles of p are done, no sooner
  }
  // A producer's tiles trigger one event each: by rows for all its consumers, or for none.
  producer_chunk.assign(n, 0);
  for (size_t p = 0; p < n; ++p) {
    const std::vector<int>& consumers = d.consumers[p];
    if (consumers.empty()) continue;
    int64_t chunk = ks[p]->rows_per_tile;
    bool all = true;
    for (int j : consumers) {
      all = all && candidate[size_t(j)];
      chunk = std::max(chunk, ks[size_t(j)]->rows_per_tile);
    }
    for (int j : consumers) all = all && chunk % ks[size_t(j)]->rows_per_tile == 0;
    if (all && chunk % ks[p]->rows_per_tile == 0) producer_chunk[p] = chunk;
  }
  // Falling back to whole kernels only makes `started` larger, so what was
  // decided from it stays sound.
  std::vector<int64_t> chunk_rows(n, 0);
  for (size_t j = 0; j < n; ++j)
    if (candidate[j] && producer_chunk[size_t(d.reduced[j][0])] > 0)
      chunk_rows[j] = producer_chunk[size_t(d.reduced[j][0])];
  return chunk_rows;
}

// The row block of a tile, and the chunk of `chunk` rows it lies in.
int64_t chunk_of_tile(const EmittedKernel& k, int64_t tile, int64_t chunk) {
  return tile / k.tiles_per_row_block * k.rows_per_tile / chunk;
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
  const Dependences deps = reduced_dependences(ks);
  mp.dependences = deps.reduced;
  std::vector<int64_t> producer_chunk;
  mp.chunk_rows = choose_by_rows(ks, deps, producer_chunk);

  // Events: a kernel's "done" where another waits for it (or one per chunk of
  // its rows), a join event where a kernel waits for several.
  std::vector<int> done_event(n, -1), join_event(n, -1);
  std::vector<std::vector<int64_t>> chunk_triggers(n);  // per chunk of a producer by rows
  for (size_t j = 0; j < n; ++j)
    for (int d : mp.dependences[j]) {
      const size_t p = size_t(d);
      if (done_event[p] >= 0) continue;
      done_event[p] = int(mp.events.size());
      if (producer_chunk[p] == 0) {
        mp.events.push_back({ks[p]->name + " done", mp.tiles[p]});
        continue;
      }
      const int64_t chunk = producer_chunk[p], chunks = (ks[p]->rows + chunk - 1) / chunk;
      chunk_triggers[p].assign(size_t(chunks), 0);
      for (int64_t t = 0; t < mp.tiles[p]; ++t) ++chunk_triggers[p][size_t(chunk_of_tile(*ks[p], t, chunk))];
      for (int64_t c = 0; c < chunks; ++c)
        mp.events.push_back({fmt::format("{} rows {}-{}", ks[p]->name, c * chunk,
                                         std::min(ks[p]->rows, (c + 1) * chunk) - 1),
                             chunk_triggers[p][size_t(c)]});
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
  const std::vector<std::vector<int>>& consumers = deps.consumers;
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
  std::vector<std::vector<int64_t>> chunk_finish(n);  // per chunk of a producer by rows
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
    if (producer_chunk[j] > 0) chunk_finish[j].assign(chunk_triggers[j].size(), 0);
    for (int64_t t = 0; t < mp.tiles[j]; ++t) {
      MegakernelTask task;
      task.kernel = indices[j];
      task.tile = t;
      task.wait = wait;
      task.wait_count = wait_count;
      task.trigger = done_event[j];
      task.cost = cost[j];
      int64_t tile_ready = ready;
      if (mp.chunk_rows[j] > 0) {  // the chunk of its rows only
        const size_t p = size_t(mp.dependences[j][0]);
        const int64_t c = chunk_of_tile(*ks[j], t, mp.chunk_rows[j]);
        task.wait = done_event[p] + int(c);
        task.wait_count = chunk_triggers[p][size_t(c)];
        tile_ready = chunk_finish[p][size_t(c)];
      }
      if (producer_chunk[j] > 0) task.trigger = done_event[j] + int(chunk_of_tile(*ks[j], t, producer_chunk[j]));
      const int64_t end = place(task, tile_ready);
      finish[j] = std::max(finish[j], end);
      if (producer_chunk[j] > 0) {
        int64_t& f = chunk_finish[j][size_t(task.trigger - done_event[j])];
        f = std::max(f, end);
      }
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
      out += fmt::format("    {:<32} {:>6}  {}{}\n", kernels[size_t(mp.kernels[j])].name, mp.tiles[j],
                         deps.empty() ? "-" : fmt::format("{}", fmt::join(deps, ", ")),
                         mp.chunk_rows[j] > 0 ? fmt::format(" (by rows: {} per event)", mp.chunk_rows[j]) : "");
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
