// An independent float64 CPU implementation of the ops that have templates,
// used to check generated code (docs/architecture.md §9). It shares nothing with the
// templates but the op semantics. Alongside each value it computes the same
// operation on absolute values (`abs`), the scale against which an error is
// judged: |y - ref| <= rtol * ref_abs + atol. For sums and products that is
// the op on absolute values; for softmax, whose output is not a sum of its
// inputs, it is the first-order propagation of its inputs' bounds.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "program.h"
#include "schedule.h"

namespace cudagen {

struct ReferenceBuffers {
  std::vector<std::vector<double>> value;  // per buffer of the program; empty when never computed
  std::vector<std::vector<double>> abs;
};

// Values of run-time arguments for one run, by "task.arg" of the argument
// that holds the value; an argument not here keeps its initial value.
using RunTimeArgs = std::map<std::string, ArgValue>;

// What the reference knows of ops outside it (a user's templates, whose op
// names it reads in OpSignature::reference): the float64 functions their
// templates give (`reference: FUNCTION`, compiled by user_reference.h), and
// for ops that give none (`reference: none`) the values the device computed,
// taken as they are, so that the tasks after them are still checked.
using ElementReference = double (*)(const double* inputs_then_args);
struct UserOpReferences {
  std::map<std::string, ElementReference> functions;        // by op name
  const std::vector<std::vector<double>>* device = nullptr;  // per buffer, for `reference: none`
};

// Runs every task of `schedule` on `inputs` (per buffer; the graph inputs set).
// Throws std::runtime_error for an op it has no reference for.
// `carried_error` (per buffer, relative to its scale; empty: none) is the
// error each computed buffer may carry into the tasks that read it, the
// tolerance it is itself checked to: where that error may carry a value
// across a kink or a jump of an elementwise op (relu at 0), the op's scale
// covers the other side.
ReferenceBuffers evaluate_reference(const Program& program, const Schedule& schedule,
                                    const std::vector<std::vector<double>>& inputs, const RunTimeArgs& args = {},
                                    const UserOpReferences& user = {}, const std::vector<double>& carried_error = {});

// Runs one task on `buffers` (every buffer's current values; its inputs taken
// as exact), returning the buffers with that task's outputs recomputed.
ReferenceBuffers evaluate_task(const Program& program, int task, const std::vector<std::vector<double>>& buffers,
                               const RunTimeArgs& args = {}, const UserOpReferences& user = {});

}  // namespace cudagen
