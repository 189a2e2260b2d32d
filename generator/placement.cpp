#include "placement.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <functional>
#include <map>
#include <numeric>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>

namespace cudagen {

namespace {

int64_t align_up(int64_t x, int64_t alignment) { return (x + alignment - 1) / alignment * alignment; }

int64_t arena_of(const std::vector<LiveInterval>& intervals, const std::vector<int64_t>& offsets, int64_t alignment) {
  int64_t arena = 0;
  for (size_t i = 0; i < intervals.size(); ++i) arena = std::max(arena, align_up(offsets[i] + intervals[i].bytes, alignment));
  return arena;
}

// The buffers placed so far, found by time: a hierarchy of grids over the
// steps, level j of buckets 2^j times as wide as level 0, each buffer filed at
// the level where it spans at most two buckets. The buffers alive in a range
// of steps are in the buckets that range touches at each level, with few
// others beside them (each level's buffers are at least half its width long),
// so finding them costs about what they are: placing 10^6 short-lived buffers
// stays n log n, and a buffer alive throughout is filed once, not per bucket.
class TimeGrid {
 public:
  TimeGrid(int last_step, size_t buffers) {
    // Level 0 about one buffer wide on average: ~2n buckets in all.
    width0_ = std::max<int64_t>(1, (int64_t(last_step) + 1) / int64_t(std::max<size_t>(buffers, 1)));
    for (int64_t width = width0_;; width *= 2) {
      levels_.emplace_back(size_t(last_step / width + 1));
      if (width > last_step) break;
    }
    filed_.assign(levels_.size(), 0);
  }
  void add(size_t i, const LiveInterval& iv) {
    const int j = level_of(iv);
    const int64_t width = width0_ << j;
    for (int64_t b = iv.first / width; b <= iv.last / width; ++b)
      levels_[size_t(j)][size_t(b)].push_back(Filed{iv.first, iv.last, i});
    ++filed_[size_t(j)];
  }
  // Calls `visit(p)` for every buffer alive in [iv.first, iv.last], some
  // more than once (a buffer filed in two buckets).
  template <class Visit>
  void alive(const LiveInterval& iv, Visit visit) const {
    for (size_t j = 0; j < levels_.size(); ++j) {
      if (filed_[j] == 0) continue;
      const int64_t width = width0_ << j;
      for (int64_t b = iv.first / width; b <= iv.last / width; ++b)
        for (const Filed& f : levels_[j][size_t(b)])
          if (f.first <= iv.last && iv.first <= f.last) visit(f.index);
    }
  }

 private:
  int level_of(const LiveInterval& iv) const {
    const int64_t length = int64_t(iv.last) - iv.first + 1;
    int j = 0;
    while ((width0_ << j) < length && size_t(j + 1) < levels_.size()) ++j;
    return j;
  }
  // A buffer's lifetime beside its index: the test for overlap reads the
  // bucket alone (looking each buffer up was a cache miss apiece).
  struct Filed {
    int first, last;
    size_t index;
  };
  int64_t width0_ = 1;
  std::vector<std::vector<std::vector<Filed>>> levels_;  // level -> bucket -> buffers
  std::vector<size_t> filed_;                             // level -> buffers filed there
};

// Best fit in the given order: each buffer goes into the smallest gap between
// the buffers already placed that live at the same time, else on top.
std::vector<int64_t> best_fit(const std::vector<LiveInterval>& intervals, const std::vector<size_t>& order,
                              int64_t alignment) {
  std::vector<int64_t> offsets(intervals.size(), 0);
  int last_step = 0;
  for (const auto& iv : intervals) last_step = std::max(last_step, iv.last);
  TimeGrid placed(last_step, intervals.size());
  std::vector<size_t> seen_at(intervals.size(), SIZE_MAX);
  std::vector<std::pair<int64_t, int64_t>> busy;
  for (size_t i : order) {
    const LiveInterval& iv = intervals[i];
    const int64_t size = align_up(iv.bytes, alignment);
    busy.clear();
    placed.alive(iv, [&](size_t p) {
      if (seen_at[p] == i) return;
      seen_at[p] = i;
      busy.emplace_back(offsets[p], offsets[p] + align_up(intervals[p].bytes, alignment));
    });
    std::sort(busy.begin(), busy.end());
    int64_t best = -1, best_gap = INT64_MAX, cursor = 0;
    for (const auto& [start, end] : busy) {
      if (start > cursor && start - cursor >= size && start - cursor < best_gap) {
        best = cursor;
        best_gap = start - cursor;
      }
      cursor = std::max(cursor, end);
    }
    offsets[i] = best >= 0 ? best : cursor;
    placed.add(i, iv);
  }
  return offsets;
}

// Branch-and-bound over canonical placements, after MiniMalloc (Moffitt,
// ASPLOS 2023). A placement can be pushed down until every buffer rests on
// one below it (or on 0); each buffer's offset is then the highest top of the
// buffers placed before it that it overlaps in time (its "min offset"), and
// listing the buffers by (offset, rank) gives each such placement exactly
// once. The search builds that list: at every node, any unplaced buffer whose
// (min offset, rank) does not come before the last one placed may go next.
//
// What prunes (each argued where it is applied):
//  - dominance: no buffer goes at or above the top another unplaced buffer
//    would have at its own min offset (that one could always go below);
//  - sections: between two consecutive lifetime ends, the unplaced buffers
//    must stack above max(the highest placed top, the last offset) within
//    the capacity, and so must they above the lowest of their min offsets;
//  - interchangeable buffers (same size and lifetime) go in index order;
//  - decomposition: where no unplaced buffer spans a step boundary the two
//    sides are independent problems, solved one after the other.
// Static orderings (the ranks) matter a great deal and no one ordering wins
// everywhere: the search runs them round-robin with a step limit that doubles
// until one finishes. Deterministic: bounded by steps, never by the clock.
class CanonicalSearch {
 public:
  enum class Outcome { found, infeasible, out_of_steps };

  CanonicalSearch(const std::vector<LiveInterval>& intervals, int64_t alignment) : n_(intervals.size()) {
    std::vector<int> points;
    for (const auto& iv : intervals) {
      points.push_back(iv.first);
      points.push_back(iv.last + 1);
    }
    std::sort(points.begin(), points.end());
    points.erase(std::unique(points.begin(), points.end()), points.end());
    sections_ = points.empty() ? 0 : points.size() - 1;
    items_.resize(n_);
    members_.resize(sections_);
    for (size_t i = 0; i < n_; ++i) {
      Item& item = items_[i];
      item.size = align_up(intervals[i].bytes, alignment);
      item.lo = int(std::lower_bound(points.begin(), points.end(), intervals[i].first) - points.begin());
      item.hi = int(std::lower_bound(points.begin(), points.end(), intervals[i].last + 1) - points.begin());
      item.width = intervals[i].last - intervals[i].first + 1;
      if (item.size == 0) continue;  // takes no memory: offset 0, outside the search
      searched_.push_back(i);
      for (int s = item.lo; s < item.hi; ++s) members_[size_t(s)].push_back(i);
    }
    overlaps_.resize(n_);
    for (size_t a : searched_)
      for (size_t b : searched_)
        if (a != b && items_[a].lo < items_[b].hi && items_[b].lo < items_[a].hi) overlaps_[a].push_back(b);
    // An identical buffer (size and lifetime) of lower index: it goes first.
    std::vector<size_t> by_shape = searched_;
    std::sort(by_shape.begin(), by_shape.end(), [&](size_t a, size_t b) {
      const Item &x = items_[a], &y = items_[b];
      return std::tie(x.lo, x.hi, x.size, a) < std::tie(y.lo, y.hi, y.size, b);
    });
    for (size_t k = 1; k < by_shape.size(); ++k) {
      const Item &x = items_[by_shape[k - 1]], &y = items_[by_shape[k]];
      if (x.lo == y.lo && x.hi == y.hi && x.size == y.size) items_[by_shape[k]].twin = int(by_shape[k - 1]);
    }
  }

  // Offsets within `capacity` into `offsets`; `infeasible` is a proof that
  // there are none. Spends at most `max_steps` nodes, adding them to `steps_used`.
  Outcome solve(int64_t capacity, int64_t max_steps, int64_t* steps_used, std::vector<int64_t>* offsets) {
    capacity_ = capacity;
    offset_.assign(n_, kUnplaced);
    solution_.assign(n_, 0);
    min_offset_.assign(n_, 0);
    floor_.assign(sections_, 0);
    total_.assign(sections_, 0);
    cuts_.assign(sections_ > 0 ? sections_ - 1 : 0, 0);
    witness_.assign(sections_, SIZE_MAX);
    for (size_t i : searched_) {
      const Item& item = items_[i];
      for (int s = item.lo; s < item.hi; ++s) total_[size_t(s)] += item.size;
      for (int s = item.lo; s + 1 < item.hi; ++s) ++cuts_[size_t(s)];
      if (item.size > capacity) return Outcome::infeasible;
    }
    for (size_t s = 0; s < sections_; ++s)
      if (total_[s] > capacity) return Outcome::infeasible;
    // Independent from the start: split wherever no buffer spans a boundary.
    std::vector<Partition> parts = split(Partition{0, int(sections_), searched_});
    int64_t limit = std::max<int64_t>(2, int64_t(n_));
    int64_t left = max_steps;
    Outcome outcome = Outcome::out_of_steps;
    while (left > 0 && outcome == Outcome::out_of_steps) {
      limit *= 2;
      for (Heuristic h : {Heuristic::width_area_total, Heuristic::total_area_width, Heuristic::total_width_area}) {
        heuristic_ = h;
        steps_left_ = std::min(limit, left);
        outcome = Outcome::found;
        for (const Partition& p : parts) {
          outcome = solve_partition(p);
          if (outcome != Outcome::found) break;
        }
        left -= std::min(limit, left) - std::max<int64_t>(steps_left_, 0);
        if (outcome != Outcome::out_of_steps || left <= 0) break;
      }
    }
    *steps_used += max_steps - left;
    if (outcome == Outcome::found) *offsets = solution_;
    return outcome;
  }

 private:
  static constexpr int64_t kUnplaced = -1;
  enum class Heuristic { width_area_total, total_area_width, total_width_area };

  struct Item {
    int64_t size = 0;
    int lo = 0, hi = 0;  // sections [lo, hi)
    int width = 0;       // steps
    int twin = -1;       // an identical buffer of lower index
  };
  struct Partition {
    int lo = 0, hi = 0;  // sections [lo, hi); every item lies inside
    std::vector<size_t> items;
  };
  struct Candidate {
    int64_t offset;
    size_t rank;
    bool operator<(const Candidate& o) const { return std::tie(offset, rank) < std::tie(o.offset, o.rank); }
  };
  // Undo records: a min offset or a floor before a change.
  struct Change {
    bool is_floor;
    size_t index;
    int64_t old_value;
  };

  bool placed(size_t i) const { return offset_[i] != kUnplaced; }

  // `p` cut at every inner boundary (between sections b and b+1) that no
  // unplaced item spans, each part holding the unplaced items inside it;
  // empty parts dropped.
  std::vector<Partition> split(const Partition& p) const {
    std::vector<int> points = {p.lo};
    for (int b = p.lo; b + 1 < p.hi; ++b)
      if (cuts_[size_t(b)] == 0) points.push_back(b + 1);
    points.push_back(p.hi);
    std::vector<Partition> parts;
    for (size_t k = 0; k + 1 < points.size(); ++k) {
      Partition part{points[k], points[k + 1], {}};
      for (size_t i : p.items)
        if (!placed(i) && items_[i].lo >= part.lo && items_[i].hi <= part.hi) part.items.push_back(i);
      if (!part.items.empty()) parts.push_back(std::move(part));
    }
    return parts;
  }

  // Ranks the partition's items by the current heuristic, then searches it.
  Outcome solve_partition(const Partition& p) {
    auto key = [&](size_t i) {
      const Item& item = items_[i];
      int64_t total = 0;
      for (int s = item.lo; s < item.hi; ++s) total = std::max(total, total_[size_t(s)]);
      // In 128 bits: a size reaches 2^62 and a width 2^31.
      const __int128 area = __int128(item.size) * item.width, width = item.width, highest = total;
      switch (heuristic_) {
        case Heuristic::width_area_total: return std::make_tuple(width, area, highest);
        case Heuristic::total_area_width: return std::make_tuple(highest, area, width);
        case Heuristic::total_width_area: return std::make_tuple(highest, width, area);
      }
      return std::make_tuple(__int128(0), __int128(0), __int128(0));
    };
    std::vector<std::pair<std::tuple<__int128, __int128, __int128>, size_t>> keyed;
    for (size_t i : p.items) keyed.emplace_back(key(i), i);
    std::sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;  // larger first, then index
    });
    std::vector<size_t> ranked;
    for (const auto& [k, i] : keyed) ranked.push_back(i);
    return dfs(p, ranked, Candidate{0, 0});
  }

  Outcome dfs(const Partition& p, const std::vector<size_t>& ranked, Candidate last) {
    if (steps_left_ <= 0) return Outcome::out_of_steps;
    --steps_left_;
    std::vector<Candidate> candidates;
    int64_t min_height = INT64_MAX;
    for (size_t r = 0; r < ranked.size(); ++r) {
      size_t i = ranked[r];
      if (placed(i)) continue;
      candidates.push_back({min_offset_[i], r});
      min_height = std::min(min_height, min_offset_[i] + items_[i].size);
    }
    if (candidates.empty()) return Outcome::found;
    std::sort(candidates.begin(), candidates.end());
    for (const Candidate& c : candidates) {
      const size_t i = ranked[c.rank];
      // Canonical order: a placement listed by (offset, rank) is found once.
      if (c < last) continue;
      // Dominance: some unplaced buffer fits wholly below c.offset; placing
      // this one first would leave that space to nobody (offsets only rise).
      if (c.offset >= min_height) continue;
      const int twin = items_[i].twin;
      if (twin >= 0 && !placed(size_t(twin))) continue;
      const size_t mark = changes_.size();
      const std::pair<int, int> changed = place(i, c.offset);
      Outcome outcome = Outcome::infeasible;
      if (sections_hold(p, c.offset, changed)) outcome = descend(p, ranked, c, i);
      unplace(i, mark);
      if (outcome != Outcome::infeasible) return outcome;
    }
    return Outcome::infeasible;
  }

  // After placing `i`: the same partition, or its independent parts where `i`
  // was the last buffer across a boundary.
  Outcome descend(const Partition& p, const std::vector<size_t>& ranked, Candidate c, size_t i) {
    const Item& item = items_[i];
    // The last write on the path that succeeds is that path's: later failed
    // branches below it place other buffers.
    solution_[i] = c.offset;
    bool separates = false;
    for (int b = item.lo; b + 1 < item.hi; ++b) separates |= --cuts_[size_t(b)] == 0;
    Outcome outcome;
    if (!separates) {
      outcome = dfs(p, ranked, c);
    } else {
      outcome = Outcome::found;
      for (const Partition& part : split(p)) {
        outcome = solve_partition(part);
        if (outcome != Outcome::found) break;
      }
    }
    for (int b = item.lo; b + 1 < item.hi; ++b) ++cuts_[size_t(b)];
    return outcome;
  }

  void set(bool is_floor, size_t index, int64_t value) {
    int64_t& slot = is_floor ? floor_[index] : min_offset_[index];
    changes_.push_back({is_floor, index, slot});
    slot = value;
  }

  // Places `i`; returns the sections where the buffers still to come changed.
  std::pair<int, int> place(size_t i, int64_t offset) {
    const Item& item = items_[i];
    const int64_t top = offset + item.size;
    offset_[i] = offset;
    // The buffers whose min offset rises all overlap `i`: their sections and
    // its own make one range.
    int affected_lo = item.lo, affected_hi = item.hi;
    for (size_t j : overlaps_[i]) {
      if (placed(j) || min_offset_[j] >= top) continue;
      set(false, j, top);
      affected_lo = std::min(affected_lo, items_[j].lo);
      affected_hi = std::max(affected_hi, items_[j].hi);
    }
    // Every buffer still to come in these sections overlaps `i`, so rests on or above its top.
    for (int s = item.lo; s < item.hi; ++s) {
      set(true, size_t(s), top);
      total_[size_t(s)] -= item.size;
    }
    return {affected_lo, affected_hi};
  }

  void unplace(size_t i, size_t mark) {
    const Item& item = items_[i];
    for (int s = item.lo; s < item.hi; ++s) total_[size_t(s)] += item.size;
    while (changes_.size() > mark) {
      const Change& c = changes_.back();
      (c.is_floor ? floor_[c.index] : min_offset_[c.index]) = c.old_value;
      changes_.pop_back();
    }
    offset_[i] = kUnplaced;
  }

  // Later buffers go at or above `offset`, at or above each section's floor,
  // and each at or above its own min offset: stacked, the ones left in a
  // section must fit under the capacity. The last holds where some buffer
  // still to come has a min offset that leaves room for the section's total;
  // it can only have changed in the sections `place` reported, and the buffer
  // found last time (a hint, right or wrong) is checked first.
  bool sections_hold(const Partition& p, int64_t offset, std::pair<int, int> changed) {
    for (int s = p.lo; s < p.hi; ++s) {
      const int64_t total = total_[size_t(s)];
      if (total > 0 && std::max(offset, floor_[size_t(s)]) + total > capacity_) return false;
    }
    for (size_t s = size_t(changed.first); s < size_t(changed.second); ++s) {
      const int64_t total = total_[s];
      if (total == 0) continue;
      const int64_t room = capacity_ - total;
      const size_t hint = witness_[s];
      if (hint != SIZE_MAX && !placed(hint) && min_offset_[hint] <= room) continue;
      auto low = std::find_if(members_[s].begin(), members_[s].end(),
                              [&](size_t j) { return !placed(j) && min_offset_[j] <= room; });
      if (low == members_[s].end()) return false;
      witness_[s] = *low;
    }
    return true;
  }

  size_t n_;
  size_t sections_ = 0;
  std::vector<Item> items_;
  std::vector<size_t> searched_;               // the items that take memory
  std::vector<std::vector<size_t>> overlaps_;  // items alive in a common section
  std::vector<std::vector<size_t>> members_;   // items alive in each section
  Heuristic heuristic_ = Heuristic::width_area_total;
  int64_t capacity_ = 0;
  int64_t steps_left_ = 0;
  std::vector<int64_t> offset_, solution_, min_offset_, floor_, total_;
  std::vector<int> cuts_;  // per boundary between sections s and s+1: unplaced items across it
  std::vector<Change> changes_;
  std::vector<size_t> witness_;  // per section: a buffer still to come that left room, last time looked
};

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
  return best_fit(intervals, order, options.alignment);
}

namespace {

// place_buffers without the reduction below.
Placement place_reduced(const std::vector<LiveInterval>& intervals, const PlacementOptions& options) {
  Placement best;
  best.offsets = place_greedy_by_size(intervals, options);
  best.arena_bytes = arena_of(intervals, best.offsets, options.alignment);
  best.method = options.reuse ? "greedy-by-size" : "no-reuse";
  const int64_t bound = lower_bound_bytes(intervals, options.alignment);
  if (!options.reuse || best.arena_bytes <= bound) {
    best.proven_optimal = best.arena_bytes <= bound;
    return best;
  }
  // Other orderings for best fit: longest-lived first, largest area first, earliest first.
  const size_t n = intervals.size();
  auto length = [&](size_t i) { return int64_t(intervals[i].last - intervals[i].first + 1); };
  std::vector<std::pair<const char*, std::function<bool(size_t, size_t)>>> orderings = {
      {"greedy-by-area", [&](size_t a, size_t b) {  // in 128 bits: bytes reach 2^62
         return __int128(intervals[a].bytes) * length(a) > __int128(intervals[b].bytes) * length(b);
       }},
      {"greedy-by-lifetime", [&](size_t a, size_t b) { return length(a) > length(b); }},
  };
  for (const auto& [name, less] : orderings) {
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), less);
    std::vector<int64_t> offsets = best_fit(intervals, order, options.alignment);
    int64_t arena = arena_of(intervals, offsets, options.alignment);
    if (arena < best.arena_bytes) {
      best.offsets = std::move(offsets);
      best.arena_bytes = arena;
      best.method = name;
    }
  }
  // The search's nodes cost time in proportion to the buffers; past a few
  // thousand buffers it would not finish in its budget's worth of seconds.
  constexpr size_t kMaxSearchBuffers = 2000;
  if (options.method == PlacementMethod::greedy || best.arena_bytes <= bound || n > kMaxSearchBuffers) {
    best.proven_optimal = best.arena_bytes <= bound;
    return best;
  }
  // The search. With a capacity to meet (over the bound, under greedy), it
  // takes a short look at the bound, then aims at the capacity and stops once
  // it fits: a budget met is the answer.
  // Otherwise (or when that fails) first at the lower bound itself (most
  // instances are tight), then bisecting between the largest size known not
  // to fit (proven, or given up on) and the best so far, each attempt with
  // half the steps left.
  CanonicalSearch search(intervals, options.alignment);
  int64_t low = bound, steps_used = 0, proven_infeasible = 0;
  int64_t budget = options.search_steps;
  // Greedy within 2% of the bound (arena - bound <= bound / 50: arenas reach 2^62, where
  // arena * 50 would overflow).
  if (options.near_bound_work > 0 && best.arena_bytes - bound <= bound / 50)
    budget = std::min(budget, std::max<int64_t>(1000, options.near_bound_work / int64_t(n)));
  auto attempt = [&](int64_t capacity, int64_t steps) {
    std::vector<int64_t> offsets;
    auto outcome = search.solve(capacity, steps, &steps_used, &offsets);
    if (outcome == CanonicalSearch::Outcome::found) {
      best.offsets = std::move(offsets);
      best.arena_bytes = arena_of(intervals, best.offsets, options.alignment);
      best.method = "search";
      return true;
    }
    if (outcome == CanonicalSearch::Outcome::infeasible) proven_infeasible = std::max(proven_infeasible, capacity);
    return false;
  };
  auto steps_left = [&] { return budget - steps_used; };
  const int64_t target = options.capacity / options.alignment * options.alignment;
  bool done = false;
  if (target >= bound && target < best.arena_bytes) {
    // A short look at the bound first: when it is reachable it is often found quickly.
    if (target > bound) {
      done = attempt(bound, budget / 32);
      if (!done) low = bound + options.alignment;
    }
    if (!done) done = attempt(target, steps_left() - steps_left() / 4);
    if (!done && proven_infeasible == target) low = target + options.alignment;
  }
  for (int tries = 0; !done && tries < 8 && low < best.arena_bytes && steps_left() > 1; ++tries) {
    // The bound first, then halfway.
    int64_t capacity = tries == 0 ? low : align_up(low + (best.arena_bytes - low) / 2, options.alignment);
    if (capacity >= best.arena_bytes) break;
    if (!attempt(capacity, steps_left() / 2)) low = capacity + options.alignment;
  }
  best.search_steps = steps_used;
  best.proven_optimal = best.arena_bytes <= bound || best.arena_bytes == proven_infeasible + options.alignment;
  return best;
}

}  // namespace

// Buffers that live from the first step to the last (a graph's inputs and
// outputs, say) overlap every other buffer in time, so no other buffer shares
// their addresses in any placement: deleting their address ranges from a
// placement and stacking them at the bottom gives a placement no larger.
// So they go at the bottom, in order, and the rest is placed above them as a
// smaller problem. Besides the size of that problem, this is what keeps best
// fit linear in a graph of 10^5 independent tasks, where every buffer used to
// be compared with every input placed before it.
Placement place_buffers(const std::vector<LiveInterval>& intervals, const PlacementOptions& options) {
  if (!options.reuse || intervals.empty()) return place_reduced(intervals, options);
  int first = INT_MAX, last = INT_MIN;
  for (const auto& iv : intervals) {
    first = std::min(first, iv.first);
    last = std::max(last, iv.last);
  }
  std::vector<size_t> rest_of;
  std::vector<LiveInterval> rest;
  std::vector<int64_t> offsets(intervals.size(), 0);
  int64_t base = 0;
  for (size_t i = 0; i < intervals.size(); ++i) {
    if (intervals[i].first == first && intervals[i].last == last) {
      offsets[i] = base;
      base += align_up(intervals[i].bytes, options.alignment);
    } else {
      rest_of.push_back(i);
      rest.push_back(intervals[i]);
    }
  }
  if (base == 0) return place_reduced(intervals, options);
  PlacementOptions rest_options = options;
  if (options.capacity > 0) rest_options.capacity = std::max<int64_t>(options.alignment, options.capacity - base);
  Placement placement = place_reduced(rest, rest_options);
  for (size_t k = 0; k < rest.size(); ++k) offsets[rest_of[k]] = base + placement.offsets[k];
  placement.offsets = std::move(offsets);
  placement.arena_bytes += base;
  return placement;
}

int64_t lower_bound_bytes(const std::vector<LiveInterval>& intervals, int64_t alignment) {
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
  for (size_t i = 0; i < intervals.size(); ++i) {
    if (offsets[i] < 0 || offsets[i] % alignment != 0)
      return fmt::format("buffer {} at offset {} is not aligned to {}", i, offsets[i], alignment);
    if (offsets[i] + intervals[i].bytes > arena_bytes)
      return fmt::format("buffer {} [{}, {}) ends past the arena ({} bytes)", i, offsets[i], offsets[i] + intervals[i].bytes,
                         arena_bytes);
  }
  // A sweep over time holding the address ranges alive at each step, keyed by
  // offset: where the ranges are disjoint so far, a range that overlaps any
  // overlaps one of its two neighbours there. n log n, so that 10^6 buffers
  // verify in about a second (comparing pairs near in memory was quadratic
  // where many short-lived buffers share one offset).
  std::vector<std::pair<int64_t, size_t>> events;  // (step * 2 + [0 frees, 1 allocates], buffer)
  events.reserve(intervals.size() * 2);
  for (size_t i = 0; i < intervals.size(); ++i) {
    if (intervals[i].bytes <= 0) continue;
    events.emplace_back(int64_t(intervals[i].first) * 2 + 1, i);
    events.emplace_back((int64_t(intervals[i].last) + 1) * 2, i);
  }
  std::sort(events.begin(), events.end());
  std::map<std::pair<int64_t, size_t>, int64_t> live;  // (offset, buffer) -> end
  auto clash = [&](size_t a, size_t b) {
    const LiveInterval &x = intervals[a], &y = intervals[b];
    return fmt::format("buffers {} [{}, {}) and {} [{}, {}) overlap in memory while both live (steps {}-{} and {}-{})",
                       a, offsets[a], offsets[a] + x.bytes, b, offsets[b], offsets[b] + y.bytes, x.first, x.last,
                       y.first, y.last);
  };
  for (const auto& [key, i] : events) {
    const std::pair<int64_t, size_t> at{offsets[i], i};
    if (key % 2 == 0) {
      live.erase(at);
      continue;
    }
    auto next = live.lower_bound(at);
    if (next != live.end() && next->first.first < offsets[i] + intervals[i].bytes) return clash(i, next->first.second);
    if (next != live.begin() && std::prev(next)->second > offsets[i]) return clash(std::prev(next)->first.second, i);
    live.emplace(at, offsets[i] + intervals[i].bytes);
  }
  return "";
}

BufferList read_buffer_csv(const std::string& text, const std::string& file) {
  BufferList list;
  std::istringstream in(text);
  std::string line;
  int line_no = 0;
  int64_t total = 0;
  constexpr int64_t kMaxCsvArenaBytes = int64_t(1) << 62;
  auto fail = [&](const std::string& why) {
    throw std::runtime_error(fmt::format("{}:{}: {}", file, line_no, why));
  };
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    if (line_no == 1) {
      if (line != "id,lower,upper,size") fail("expected the header 'id,lower,upper,size' (MiniMalloc's CSV format)");
      continue;
    }
    std::vector<std::string> cells;
    std::stringstream row(line);
    std::string cell;
    while (std::getline(row, cell, ',')) cells.push_back(cell);
    if (cells.size() != 4) fail(fmt::format("expected 4 comma-separated fields, found {}", cells.size()));
    int64_t v[3];
    for (int k = 0; k < 3; ++k) {
      try {
        size_t used = 0;
        v[k] = std::stoll(cells[size_t(k + 1)], &used);
        if (used != cells[size_t(k + 1)].size()) throw std::invalid_argument("trailing text");
      } catch (const std::exception&) {
        fail(fmt::format("field {} ('{}') is not an integer", k + 2, cells[size_t(k + 1)]));
      }
    }
    if (v[0] < 0 || v[1] <= v[0] || v[1] > INT32_MAX) fail(fmt::format("lifetime [{}, {}) is empty or out of range", v[0], v[1]));
    if (v[2] < 0) fail(fmt::format("negative size {}", v[2]));
    // Offsets are 64-bit sums of sizes: keep every sum of them (and its
    // alignment) representable, or two buffers could wrap onto one offset.
    if (__builtin_add_overflow(total, v[2], &total) || total > kMaxCsvArenaBytes)
      fail(fmt::format("the sizes add up to more than {} bytes (2^62), the most an arena's offsets can hold",
                       kMaxCsvArenaBytes));
    list.ids.push_back(cells[0]);
    list.intervals.push_back(LiveInterval{v[2], int(v[0]), int(v[1] - 1)});
  }
  if (line_no == 0) fail("empty file");
  return list;
}

std::string write_offsets_csv(const BufferList& buffers, const std::vector<int64_t>& offsets) {
  std::string out = "id,lower,upper,size,offset\n";
  for (size_t i = 0; i < buffers.ids.size(); ++i) {
    const LiveInterval& iv = buffers.intervals[i];
    out += fmt::format("{},{},{},{},{}\n", buffers.ids[i], iv.first, iv.last + 1, iv.bytes, offsets[i]);
  }
  return out;
}

namespace {

// Text for an SVG element: a buffer id of a CSV file is anyone's text, and
// `<script>` in it must stay text (issue #34).
std::string xml_text(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += static_cast<unsigned char>(c) < 0x20 ? ' ' : c;
    }
  }
  return out;
}

}  // namespace

std::string placement_svg(const std::vector<std::string>& names, const std::vector<LiveInterval>& intervals,
                          const std::vector<int64_t>& offsets, int64_t lower_bound) {
  int last_step = 0;
  int64_t top = lower_bound;
  for (size_t i = 0; i < intervals.size(); ++i) {
    last_step = std::max(last_step, intervals[i].last + 1);
    top = std::max(top, offsets[i] + intervals[i].bytes);
  }
  const double width = 1000, height = 600;
  const double sx = width / std::max(1, last_step), sy = height / double(std::max<int64_t>(1, top));
  std::string out = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" viewBox=\"-60 -20 {} {}\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n"
      "<text x=\"0\" y=\"-6\">time (steps) across, address (bytes) up; {} buffers; peak {} bytes; lower bound {} "
      "bytes</text>\n",
      width + 80, height + 50, width + 80, height + 50, intervals.size(), top, lower_bound);
  for (size_t i = 0; i < intervals.size(); ++i) {
    const LiveInterval& iv = intervals[i];
    double x = iv.first * sx, w = std::max(0.5, (iv.last + 1 - iv.first) * sx);
    double y = height - double(offsets[i] + iv.bytes) * sy, h = std::max(0.5, double(iv.bytes) * sy);
    unsigned hue = unsigned(i * 137 % 360);
    out += fmt::format(
        "<rect x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" fill=\"hsl({},60%,65%)\" stroke=\"#333\" "
        "stroke-width=\"0.3\"><title>{}: steps [{}, {}], offset {}, {} bytes</title></rect>\n",
        x, y, w, h, hue, xml_text(i < names.size() ? names[i] : std::to_string(i)), iv.first, iv.last, offsets[i],
        iv.bytes);
  }
  double bound_y = height - double(lower_bound) * sy;
  out += fmt::format(
      "<line x1=\"0\" y1=\"{0:.2f}\" x2=\"{1}\" y2=\"{0:.2f}\" stroke=\"red\" stroke-dasharray=\"6 3\"/>\n"
      "<text x=\"-58\" y=\"{0:.2f}\" fill=\"red\">bound</text>\n"
      "<line x1=\"0\" y1=\"{2}\" x2=\"{1}\" y2=\"{2}\" stroke=\"#000\"/>\n</svg>\n",
      bound_y, width, height);
  return out;
}

}  // namespace cudagen
