#include "schedule.h"

#include <queue>

namespace cudagen {

Schedule schedule(const Program& program) {
  const size_t n = program.tasks.size();
  std::vector<int> pending(n, 0);
  std::vector<std::vector<int>> consumers(n);
  for (size_t t = 0; t < n; ++t) {
    for (int dep : program.tasks[t].deps) {
      ++pending[t];
      consumers[size_t(dep)].push_back(int(t));
    }
  }
  // One min-queue per phase: a task becomes ready when its producers ran; a
  // phase starts when every earlier phase is done (validation guarantees
  // dependencies never point to a later phase).
  Schedule s;
  s.order.reserve(n);
  for (Phase phase : {Phase::init, Phase::forward, Phase::backward, Phase::update}) {
    std::priority_queue<int, std::vector<int>, std::greater<int>> ready;
    for (size_t t = 0; t < n; ++t)
      if (program.tasks[t].task->phase == phase && pending[t] == 0) ready.push(int(t));
    while (!ready.empty()) {
      int t = ready.top();
      ready.pop();
      s.order.push_back(t);
      for (int c : consumers[size_t(t)])
        if (--pending[size_t(c)] == 0 && program.tasks[size_t(c)].task->phase == phase) ready.push(c);
    }
  }
  return s;
}

}  // namespace cudagen
