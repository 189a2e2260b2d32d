// Pass `autocast` (docs/architecture.md §1, issue #41): a training graph's
// precision policy ("precision": "bf16" in its "training" section) applied to
// its forward tasks before the derive pass, as PyTorch's CUDA autocast applies
// it to a model's forward: the weights stay f32 (the optimizer updates f32
// master weights with f32 gradients), and each forward task computes in the
// dtype its op's `autocast` fact asks for (OpSignature::autocast):
//   low     the policy's 16-bit dtype: matmul and the convolutions, on the
//           tensor cores;
//   f32     f32: the norms, the losses, sums and means, exp, log, pow, rsqrt;
//   (none)  the widest dtype of its floating inputs: bf16 stays bf16 through
//           an activation, a residual add of bf16 and f32 is f32.
// Where an input's dtype is not the task's, a `cast` task converts it (one per
// value and dtype, shared by its readers); the task's outputs take its dtype.
// The derive pass then differentiates the casts like any op (a cast's gradient
// is the cast back), so each gradient has its value's dtype and a weight's
// gradient reaches the optimizer in f32. Fusion folds the casts into the
// loads and stores of their neighbours (an epilogue, a prologue).
//
// softmax keeps its input's dtype although autocast lists it as f32: its
// kernels compute in f32 whatever they store, its input is a 16-bit product
// under autocast too, and the product that reads it rounds it to 16 bits
// there as well; keeping it 16-bit keeps attention one fused kernel.
#pragma once

#include "graph.h"
#include "program.h"

namespace cudagen {

// The forward graph with the policy applied (casts inserted, outputs
// retyped); `training` is kept, so the derive pass follows. A graph whose
// training has no policy, or an f32 one, comes back unchanged. Throws
// CompileError for what the policy cannot serve: hand-written backward or
// update tasks, a 16-bit weight (there are no f32 master weights to keep).
// An f16 policy's loss scaling is the derive pass's (derive.h).
TaskGraph apply_precision(const Program& forward);

}  // namespace cudagen
