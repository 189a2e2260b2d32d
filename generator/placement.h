// Offset assignment for buffers with known lifetimes: the dynamic storage
// allocation problem, on its own so that it can be tested and benchmarked
// without a graph (cudagen plan --buffers FILE.csv).
//
// Methods: greedy-by-size best-fit (TFLite's GPU delegate, XLA's heap
// simulator) over several orderings, keeping the best; and a branch-and-bound
// search over canonical placements (after MiniMalloc, ASPLOS 2023) when greedy
// leaves a gap to the lower bound. Everything is deterministic: the search is
// bounded by a count of steps, never by the clock.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cudagen {

// A buffer to place: its size and the inclusive range of steps it lives in.
struct LiveInterval {
  int64_t bytes = 0;
  int first = 0;
  int last = 0;
};

enum class PlacementMethod {
  greedy,  // greedy-by-size best-fit, several orderings
  search,  // greedy, then branch-and-bound when greedy is above the lower bound
};

struct PlacementOptions {
  int64_t alignment = 256;
  bool reuse = true;  // false: every buffer its own storage (for debugging numerics)
  PlacementMethod method = PlacementMethod::search;
  int64_t search_steps = 500000;  // the search's budget, in placements tried (about 1-20 us each)
  // Where greedy is already within 2% of the lower bound, little is left to
  // win: the search then spends at most this many buffer-steps (steps times
  // buffers, what a step costs: about a second on one core), not its whole
  // budget. 0: no such cap (an explicit --search-steps sets that).
  int64_t near_bound_work = 50'000'000;
  // A size the placement must fit in (a memory budget), 0 if none: where
  // greedy is over it, the search aims there before bisecting further down.
  int64_t capacity = 0;
};

struct Placement {
  std::vector<int64_t> offsets;
  int64_t arena_bytes = 0;
  std::string method;      // which method gave these offsets
  int64_t search_steps = 0;
  bool proven_optimal = false;  // arena == lower bound, or the search proved one alignment less cannot fit
};

// The best placement the options allow. Deterministic.
Placement place_buffers(const std::vector<LiveInterval>& intervals, const PlacementOptions& options);

// Offsets for `intervals`, in the same order. Deterministic.
std::vector<int64_t> place_greedy_by_size(const std::vector<LiveInterval>& intervals, const PlacementOptions& options);

// Largest sum of (aligned) live bytes at any step: no placement can do better.
int64_t lower_bound_bytes(const std::vector<LiveInterval>& intervals, int64_t alignment);

// Why a placement is wrong, or "" when it is right: alignment, inside the
// arena, and no two buffers that live at the same step overlap in memory.
std::string verify_placement(const std::vector<LiveInterval>& intervals, const std::vector<int64_t>& offsets,
                             int64_t arena_bytes, int64_t alignment);


// Buffer lists in MiniMalloc's CSV format: `id,lower,upper,size`, lifetimes
// as half-open step intervals [lower, upper). Throws std::runtime_error
// naming the file and line.
struct BufferList {
  std::vector<std::string> ids;
  std::vector<LiveInterval> intervals;
};
BufferList read_buffer_csv(const std::string& text, const std::string& file);
std::string write_offsets_csv(const BufferList& buffers, const std::vector<int64_t>& offsets);

// An SVG picture of a placement: time across, address up, a rectangle per
// buffer (its name in the tooltip), the lower bound as a line.
std::string placement_svg(const std::vector<std::string>& names, const std::vector<LiveInterval>& intervals,
                          const std::vector<int64_t>& offsets, int64_t lower_bound);

}  // namespace cudagen
