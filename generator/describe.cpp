#include "describe.h"

#include <map>

#include <fmt/format.h>

namespace cudagen {

std::string human_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.1f} {}", v, units[u]);
}

std::string describe(const Program& p) {
  std::string out;
  out += fmt::format("graph {}: {} tasks, {} buffers\n\n", p.graph.name.empty() ? "(unnamed)" : p.graph.name,
                     p.tasks.size(), p.buffers.size());

  out += fmt::format("{:<10} {:>6}  {}\n", "phase", "tasks", "ops");
  for (Phase phase : {Phase::init, Phase::forward, Phase::backward, Phase::update}) {
    std::map<std::string, int> ops;
    int n = 0;
    for (const auto& t : p.tasks) {
      if (t.task->phase != phase) continue;
      ++n;
      ++ops[t.task->op];
    }
    if (n == 0) continue;
    std::vector<std::string> parts;
    for (const auto& [op, count] : ops) parts.push_back(count == 1 ? op : fmt::format("{} x{}", op, count));
    out += fmt::format("{:<10} {:>6}  {}\n", to_string(phase), n, fmt::join(parts, ", "));
  }

  out += fmt::format("\n{:<12} {:>8} {:>14} {:>10}\n", "storage", "buffers", "bytes", "");
  int64_t total = 0;
  for (Storage s : {Storage::external, Storage::persistent, Storage::saved, Storage::transient}) {
    int n = 0;
    int64_t bytes = 0;
    for (const auto& b : p.buffers) {
      if (b.storage != s) continue;
      ++n;
      bytes += b.bytes;
    }
    total += bytes;
    out += fmt::format("{:<12} {:>8} {:>14} {:>10}\n", to_string(s), n, bytes, human_bytes(bytes));
  }
  out += fmt::format("{:<12} {:>8} {:>14} {:>10}\n", "total", p.buffers.size(), total, human_bytes(total));

  out += "\nbuffers (owning slot, dtype, shape, storage, bytes, tasks that use it)\n";
  std::vector<std::vector<std::string>> users(p.buffers.size());
  for (const auto& t : p.tasks)
    for (const auto& bound : t.tensors)
      if (bound.buffer >= 0) users[size_t(bound.buffer)].push_back(t.task->id);
  for (size_t i = 0; i < p.buffers.size(); ++i) {
    const BufferInfo& b = p.buffers[i];
    std::string name = p.tasks[size_t(b.owner_task)].task->id + "." + b.owner_slot;
    std::string storage = std::string(to_string(b.storage)) + (b.promoted ? "*" : "");
    std::string used_by = fmt::format("{}", fmt::join(users[i], ", "));
    out += fmt::format("  {:<28} {:<5} {:<18} {:<11} {:>12}  {}\n", name, to_string(b.dtype), shape_to_string(b.shape),
                       storage, b.bytes, used_by);
  }
  bool any_promoted = false;
  for (const auto& b : p.buffers) any_promoted = any_promoted || b.promoted;
  if (any_promoted) out += "  * transient, kept as saved: read in a later phase than the one that wrote it\n";
  return out;
}

}  // namespace cudagen
