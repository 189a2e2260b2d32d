// Pass `schedule`: a deterministic topological order of the tasks of each
// phase, phases in the order init, forward, backward, update.
#pragma once

#include <vector>

#include "program.h"

namespace cudagen {

struct Schedule {
  std::vector<int> order;  // task indices; phases contiguous, in phase order
};

// Among ready tasks, the one written first in the graph runs first, so the
// order is stable under edits elsewhere in the file.
Schedule schedule(const Program& program);

}  // namespace cudagen
