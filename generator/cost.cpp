#include "cost.h"

namespace cudagen {

std::optional<int64_t> task_flops(const Program& program, int task) {
  const BoundTask& bt = program.tasks[size_t(task)];
  if (bt.op == nullptr || bt.op->flops_text.empty()) return std::nullopt;
  return evaluate_rule_formula(bt.op->flops, bt.op->shape, task_shape_env(program, task));
}

}  // namespace cudagen
