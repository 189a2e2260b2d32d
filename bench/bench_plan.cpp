// The planner on folders of buffer lists (MiniMalloc's CSV format): the
// eleven public MiniMalloc instances (../shared/bench-data/minimalloc, not
// copied into the project; the capacity is in each file name) or the network
// profiles that bench/trace_profiles.py writes. Prints a table: instance,
// buffers, lower bound, greedy-by-size ratio (the baseline, same run), the
// best placement's ratio, its method and time. Every placement is verified.
// Then the time to plan a synthetic 10 000-buffer program.
//   bench_plan DIR [SEARCH_STEPS] [ALIGNMENT]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "file_util.h"
#include "placement.h"

using namespace cudagen;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [SEARCH_STEPS]\n", argv[0]);
    return 2;
  }
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(argv[1]))
    if (e.path().extension() == ".csv") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  PlacementOptions options;
  options.alignment = 1;
  if (argc > 2) options.search_steps = std::stoll(argv[2]);
  if (argc > 3) options.alignment = std::stoll(argv[3]);
  fmt::print("{:<10} {:>8} {:>10} {:>10} {:>8} {:>8} {:>8} {:<20} {:>9}\n", "instance", "buffers", "capacity",
             "bound", "greedy", "best", "fits", "method", "seconds");
  int failures = 0;
  for (const auto& path : files) {
    BufferList list = read_buffer_csv(read_text_file(path.string()), path.string());
    std::string capacity_text = path.stem().extension().string();  // "A.1048576.csv" -> ".1048576"
    int64_t capacity = capacity_text.size() > 1 ? std::stoll(capacity_text.substr(1)) : 0;
    int64_t bound = lower_bound_bytes(list.intervals, options.alignment);
    auto greedy = place_greedy_by_size(list.intervals, options);
    int64_t greedy_arena = 0;
    for (size_t i = 0; i < greedy.size(); ++i) greedy_arena = std::max(greedy_arena, greedy[i] + list.intervals[i].bytes);
    greedy_arena = (greedy_arena + options.alignment - 1) / options.alignment * options.alignment;
    PlacementOptions with_capacity = options;
    with_capacity.capacity = capacity;
    auto start = std::chrono::steady_clock::now();
    Placement best = place_buffers(list.intervals, with_capacity);
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::string problem = verify_placement(list.intervals, best.offsets, best.arena_bytes, options.alignment);
    if (!problem.empty()) {
      fmt::print("{}: INVALID placement: {}\n", path.filename().string(), problem);
      ++failures;
    }
    fmt::print("{:<10} {:>8} {:>10} {:>10} {:>8.3f} {:>8.3f} {:>8} {:<20} {:>9.2f}\n", path.stem().stem().string(),
               list.ids.size(), capacity, bound, double(greedy_arena) / bound, double(best.arena_bytes) / bound,
               capacity == 0 ? "-" : best.arena_bytes <= capacity ? "yes" : "no", best.method, seconds);
  }
  // Planning time at scale: 10 000 buffers of a long chain with skip connections.
  std::vector<LiveInterval> many;
  for (int i = 0; i < 10000; ++i) many.push_back({int64_t(4096) << (i % 7), i, i + 1 + (i % 13 == 0 ? 40 : 2)});
  auto start = std::chrono::steady_clock::now();
  Placement p = place_buffers(many, options);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fmt::print("{:<10} {:>8} {:>10} {:>10} {:>8} {:>8.3f} {:>8} {:<20} {:>9.3f}\n", "synthetic", many.size(), "-",
             lower_bound_bytes(many, options.alignment), "-", double(p.arena_bytes) / lower_bound_bytes(many, options.alignment),
             "-", p.method, seconds);
  return failures == 0 ? 0 : 1;
}
