#include "placement.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>

namespace cudagen {

namespace {

int64_t align_up(int64_t x, int64_t alignment) { return (x + alignment - 1) / alignment * alignment; }

bool overlap_in_time(const LiveInterval& a, const LiveInterval& b) { return a.first <= b.last && b.first <= a.last; }

int64_t arena_of(const std::vector<LiveInterval>& intervals, const std::vector<int64_t>& offsets, int64_t alignment) {
  int64_t arena = 0;
  for (size_t i = 0; i < intervals.size(); ++i) arena = std::max(arena, align_up(offsets[i] + intervals[i].bytes, alignment));
  return arena;
}

// Best fit in the given order: each buffer goes into the smallest gap between
// the buffers already placed that live at the same time, else on top. Placed
// buffers are indexed by time buckets, so that finding the ones that overlap
// costs what they are, not what the whole program is.
std::vector<int64_t> best_fit(const std::vector<LiveInterval>& intervals, const std::vector<size_t>& order,
                              int64_t alignment) {
  std::vector<int64_t> offsets(intervals.size(), 0);
  int last_step = 0;
  for (const auto& iv : intervals) last_step = std::max(last_step, iv.last);
  const int bucket_width = std::max(1, (last_step + 1) / 1024 + 1);
  std::vector<std::vector<size_t>> buckets(size_t(last_step / bucket_width + 1));
  std::vector<size_t> seen_at(intervals.size(), SIZE_MAX);
  std::vector<std::pair<int64_t, int64_t>> busy;
  for (size_t i : order) {
    const LiveInterval& iv = intervals[i];
    const int64_t size = align_up(iv.bytes, alignment);
    busy.clear();
    for (int b = iv.first / bucket_width; b <= iv.last / bucket_width; ++b) {
      for (size_t p : buckets[size_t(b)]) {
        if (seen_at[p] == i || !overlap_in_time(iv, intervals[p])) continue;
        seen_at[p] = i;
        busy.emplace_back(offsets[p], offsets[p] + align_up(intervals[p].bytes, alignment));
      }
    }
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
    for (int b = iv.first / bucket_width; b <= iv.last / bucket_width; ++b) buckets[size_t(b)].push_back(i);
  }
  return offsets;
}

// Branch-and-bound over canonical placements. A placement can be pushed
// down until every buffer rests on one below it (or on 0); listing those
// buffers by (offset, first section) gives each such placement exactly once,
// and each buffer's offset is then the highest end of the buffers placed
// before it in the sections it spans. The search places buffers in that order,
// bottom-left first, and prunes a node when some section cannot hold the
// buffers still to come above max(its floor, the last offset).
class CanonicalSearch {
 public:
  CanonicalSearch(const std::vector<LiveInterval>& intervals, int64_t alignment) : n_(intervals.size()) {
    std::vector<int> points;
    for (const auto& iv : intervals) {
      points.push_back(iv.first);
      points.push_back(iv.last + 1);
    }
    std::sort(points.begin(), points.end());
    points.erase(std::unique(points.begin(), points.end()), points.end());
    sections_ = points.empty() ? 0 : points.size() - 1;
    for (const auto& iv : intervals) {
      Item item;
      item.size = align_up(iv.bytes, alignment);
      item.lo = int(std::lower_bound(points.begin(), points.end(), iv.first) - points.begin());
      item.hi = int(std::lower_bound(points.begin(), points.end(), iv.last + 1) - points.begin());
      items_.push_back(item);
    }
    // Interchangeable buffers (same size and sections) are tried once per node.
    order_.resize(n_);
    std::iota(order_.begin(), order_.end(), 0);
    std::sort(order_.begin(), order_.end(), [&](size_t a, size_t b) {
      const Item &x = items_[a], &y = items_[b];
      return std::tie(x.lo, x.hi, x.size, a) < std::tie(y.lo, y.hi, y.size, b);
    });
    for (size_t k = 1; k < n_; ++k) {
      const Item &x = items_[order_[k - 1]], &y = items_[order_[k]];
      if (x.lo == y.lo && x.hi == y.hi && x.size == y.size) items_[order_[k]].twin = int(order_[k - 1]);
    }
  }

  // Offsets within `capacity`, or empty when none was found within
  // `max_steps`. A depth-first search that goes wrong early rarely recovers,
  // so the budget is spent in restarts of growing length (1, 1, 2, 1, 1, 2, 4,
  // ... in units of `max_steps` / 64: the Luby sequence), each ordering
  // candidates with other seeded weights. Deterministic.
  std::vector<int64_t> solve(int64_t capacity, int64_t max_steps, int64_t* steps_used) {
    const int64_t unit = std::max<int64_t>(1000, max_steps / 64);
    int64_t spent = 0;
    std::mt19937_64 rng(capacity);
    for (int restart = 1; spent < max_steps; ++restart) {
      weight_.assign(n_, 1.0);
      prefer_snug_ = restart % 2 == 1;  // two value orderings, alternating: a small portfolio
      if (restart > 2)
        for (double& w : weight_) w = 1.0 + std::uniform_real_distribution<double>(0.0, 1.0)(rng);
      int64_t budget = std::min(max_steps - spent, unit * luby(restart));
      int64_t used = 0;
      std::vector<int64_t> found = solve_once(capacity, budget, &used);
      spent += used;
      if (!found.empty()) {
        *steps_used += spent;
        return found;
      }
    }
    *steps_used += spent;
    return {};
  }

 private:
  static int64_t luby(int64_t i) {
    for (int64_t k = 1;; ++k) {
      if (i == (int64_t(1) << k) - 1) return int64_t(1) << (k - 1);
      if (i < (int64_t(1) << k) - 1) return luby(i - (int64_t(1) << (k - 1)) + 1);
    }
  }

  std::vector<int64_t> solve_once(int64_t capacity, int64_t max_steps, int64_t* steps_used) {
    capacity_ = capacity;
    steps_left_ = max_steps;
    floor_.assign(sections_, 0);
    remaining_.assign(sections_, 0);
    for (const auto& item : items_)
      for (int s = item.lo; s < item.hi; ++s) remaining_[size_t(s)] += item.size;
    placed_.assign(n_, false);
    offsets_.assign(n_, 0);
    bool found = n_ == 0 || dfs(0, 0, -1);
    *steps_used += std::min(max_steps, max_steps - steps_left_);
    return found ? offsets_ : std::vector<int64_t>{};
  }

  struct Item {
    int64_t size = 0;
    int lo = 0, hi = 0;  // sections [lo, hi)
    int twin = -1;       // an identical buffer earlier in order_
  };
  struct Candidate {
    int64_t offset;
    int lo;
    size_t item;
  };

  int64_t offset_of(const Item& item) const {
    int64_t off = 0;
    for (int s = item.lo; s < item.hi; ++s) off = std::max(off, floor_[size_t(s)]);
    return off;
  }

  // Lowest-gap branching: the lowest section that still has buffers to hold
  // is filled next -- by one of the buffers that can rest exactly at its
  // floor, or by none, which lifts the section to the next level at which
  // anything could rest there.
  bool dfs(size_t depth, int64_t, int) {
    if (depth == n_) return true;
    if (--steps_left_ < 0) return false;
    if (!bound_holds()) return false;
    size_t gap = sections_;
    for (size_t s = 0; s < sections_; ++s)
      if (remaining_[s] > 0 && (gap == sections_ || floor_[s] < floor_[gap])) gap = s;
    const int64_t level = floor_[gap];
    std::vector<size_t> fits;
    int64_t next_level = INT64_MAX;
    for (size_t i : order_) {
      if (placed_[i]) continue;
      const Item& item = items_[i];
      if (item.lo > int(gap) || item.hi <= int(gap)) continue;
      int64_t off = offset_of(item);
      if (off > level) {
        next_level = std::min(next_level, off);
        continue;
      }
      if (item.twin >= 0 && !placed_[size_t(item.twin)]) continue;  // its twin goes first
      fits.push_back(i);
    }
    // Larger and longer-lived buffers first: they are the hard ones to fit later.
    // Restarts after the first perturb that preference by a seeded weight.
    // A buffer whose top meets a neighbouring floor leaves a flat skyline: prefer it.
    auto snug = [&](const Item& x) {
      if (!prefer_snug_) return 1.0;
      int64_t top = level + x.size;
      bool left = x.lo > 0 && floor_[size_t(x.lo - 1)] == top;
      bool right = x.hi < int(sections_) && floor_[size_t(x.hi)] == top;
      return 1.0 + double(left) + double(right);
    };
    std::sort(fits.begin(), fits.end(), [&](size_t a, size_t b) {
      const Item &x = items_[a], &y = items_[b];
      double wx = double(x.size) * (x.hi - x.lo) * weight_[a] * snug(x);
      double wy = double(y.size) * (y.hi - y.lo) * weight_[b] * snug(y);
      return std::make_tuple(wx, x.size, b) > std::make_tuple(wy, y.size, a);
    });
    std::vector<int64_t> saved;
    for (size_t i : fits) {
      const Item& item = items_[i];
      saved.assign(floor_.begin() + item.lo, floor_.begin() + item.hi);
      for (int s = item.lo; s < item.hi; ++s) {
        floor_[size_t(s)] = level + item.size;
        remaining_[size_t(s)] -= item.size;
      }
      placed_[i] = true;
      offsets_[i] = level;
      if (dfs(depth + 1, 0, 0)) return true;
      placed_[i] = false;
      std::copy(saved.begin(), saved.end(), floor_.begin() + item.lo);
      for (int s = item.lo; s < item.hi; ++s) remaining_[size_t(s)] += item.size;
      if (steps_left_ < 0) return false;
    }
    // Nothing rests at `level` in this section: lift it to the next level where something could.
    if (gap > 0 && floor_[gap - 1] > level) next_level = std::min(next_level, floor_[gap - 1]);
    if (gap + 1 < sections_ && floor_[gap + 1] > level) next_level = std::min(next_level, floor_[gap + 1]);
    if (next_level == INT64_MAX) return false;
    floor_[gap] = next_level;
    bool found = dfs(depth, 0, 0);
    floor_[gap] = level;
    return found;
  }

  // In each section the unplaced buffers stack above its floor, none below
  // the highest floor of its own sections (floors only rise); stacked in that
  // order they reach the lowest possible top (one machine with release dates).
  bool bound_holds() {
    releases_.clear();
    for (size_t i = 0; i < n_; ++i)
      if (!placed_[i]) releases_.emplace_back(offset_of(items_[i]), i);
    std::sort(releases_.begin(), releases_.end());
    top_.assign(floor_.begin(), floor_.end());
    for (const auto& [release, i] : releases_) {
      const Item& item = items_[i];
      for (int s = item.lo; s < item.hi; ++s) {
        int64_t& top = top_[size_t(s)];
        top = std::max(top, release) + item.size;
        if (top > capacity_) return false;
      }
    }
    return true;
  }

  size_t n_;
  size_t sections_ = 0;
  std::vector<Item> items_;
  std::vector<size_t> order_;
  int64_t capacity_ = 0;
  int64_t steps_left_ = 0;
  std::vector<int64_t> floor_, remaining_, offsets_, top_;
  std::vector<std::pair<int64_t, size_t>> releases_;
  std::vector<double> weight_;
  bool prefer_snug_ = true;
  std::vector<bool> placed_;
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

Placement place_buffers(const std::vector<LiveInterval>& intervals, const PlacementOptions& options) {
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
      {"greedy-by-area", [&](size_t a, size_t b) { return intervals[a].bytes * length(a) > intervals[b].bytes * length(b); }},
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
  // The search: first at the lower bound itself (most instances are tight),
  // then bisecting between the bound and the best so far.
  CanonicalSearch search(intervals, options.alignment);
  int64_t low = bound, high = best.arena_bytes, steps_used = 0;
  int64_t capacity = bound;
  for (int attempt = 0; attempt < 6 && low < high; ++attempt) {
    int64_t budget = attempt == 0 ? options.search_steps / 2 : options.search_steps / 10;
    std::vector<int64_t> offsets = search.solve(capacity, budget, &steps_used);
    if (!offsets.empty()) {
      best.offsets = std::move(offsets);
      best.arena_bytes = arena_of(intervals, best.offsets, options.alignment);
      best.method = "search";
      high = best.arena_bytes;
    } else {
      low = capacity + options.alignment;
    }
    capacity = align_up(low + (high - low) / 2, options.alignment);
    if (capacity >= high) break;
  }
  best.search_steps = steps_used;
  best.proven_optimal = best.arena_bytes <= bound;
  return best;
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

BufferList read_buffer_csv(const std::string& text, const std::string& file) {
  BufferList list;
  std::istringstream in(text);
  std::string line;
  int line_no = 0;
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
        x, y, w, h, hue, i < names.size() ? names[i] : std::to_string(i), iv.first, iv.last, offsets[i], iv.bytes);
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
