// The derive pass (docs/architecture.md §1, issue #7): from a validated forward graph
// and a scalar loss, the backward tasks that compute the loss's gradient with
// respect to every weight, and the optimizer's update tasks.
//
// A weight is a persistent floating tensor that forward tasks read. Tasks are
// visited in reverse schedule order; each forward task on a path from a
// weight to the loss contributes the gradients of its inputs, either through
// the backward op its template links (`backward: relu_backward`, slots bound
// by name: a forward slot's name, or `d` + a forward slot's name for its
// gradient; several ops where the template links several, a task of each
// whose gradients are needed: conv2d_nhwc's data and weight gradients) or, for ops whose gradient is made of other ops (matmul,
// broadcasting arithmetic, views), through the rules in derive.cpp.
// Gradients of a tensor used several times are summed; a gradient of a
// broadcast operand is summed over the broadcast axes. The training
// section's clip_grad_norm, accumulate_gradients and loss_scale (implied by
// an f16 precision) shape what reaches the optimizers: a persistent sum over
// micro-batches, one factor (gradient_scale) that averages, unscales and
// clips, and GradScaler's state on the device, which skips a step whose
// scaled gradients overflowed (docs/taskgraph-format.md).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "graph.h"
#include "program.h"

namespace cudagen {

struct DerivedGraph {
  TaskGraph graph;  // the input's tasks, then the derived ones
  // Each weight (its owning slot) and the slot holding its gradient.
  std::vector<std::pair<SlotRef, SlotRef>> gradients;
};

// Throws CompileError naming the task for: a loss that is not a scalar, an
// op without a backward on the path to a weight, a weight that receives no
// gradient. A graph that already has backward tasks comes back unchanged.
// The result's `training` is cleared: it is what the derived tasks hold.
DerivedGraph derive_training(const Program& forward, const TrainingSpec& spec);

}  // namespace cudagen
