// The planner against MiniMalloc's eleven public instances (../shared/bench-
// data/minimalloc, not copied into the project). Prints a table: instance,
// buffers, lower bound, greedy-by-size ratio (the baseline, same run), the
// best placement's ratio, its method and time. Every placement is verified.
//   bench_plan_minimalloc DIR [SEARCH_STEPS]
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
  fmt::print("{:<10} {:>8} {:>10} {:>10} {:>8} {:>8} {:>8} {:<20} {:>9}\n", "instance", "buffers", "capacity",
             "bound", "greedy", "best", "fits", "method", "seconds");
  int failures = 0;
  for (const auto& path : files) {
    BufferList list = read_buffer_csv(read_text_file(path.string()), path.string());
    int64_t capacity = std::stoll(path.stem().extension().string().substr(1));
    int64_t bound = lower_bound_bytes(list.intervals, 1);
    auto greedy = place_greedy_by_size(list.intervals, options);
    int64_t greedy_arena = 0;
    for (size_t i = 0; i < greedy.size(); ++i) greedy_arena = std::max(greedy_arena, greedy[i] + list.intervals[i].bytes);
    auto start = std::chrono::steady_clock::now();
    Placement best = place_buffers(list.intervals, options);
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::string problem = verify_placement(list.intervals, best.offsets, best.arena_bytes, 1);
    if (!problem.empty()) {
      fmt::print("{}: INVALID placement: {}\n", path.filename().string(), problem);
      ++failures;
    }
    fmt::print("{:<10} {:>8} {:>10} {:>10} {:>8.3f} {:>8.3f} {:>8} {:<20} {:>9.2f}\n", path.stem().stem().string(),
               list.ids.size(), capacity, bound, double(greedy_arena) / bound, double(best.arena_bytes) / bound,
               best.arena_bytes <= capacity ? "yes" : "no", best.method, seconds);
  }
  return failures == 0 ? 0 : 1;
}
