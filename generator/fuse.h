// Pass `fuse`: groups the scheduled tasks into kernels, so that a value one
// task computes and the next consumes stays in registers instead of making a
// round trip through device memory (docs/architecture.md §2; the rules, with what each
// fuses and refuses, are in docs/fusion.md).
//
// Rules so far:
//   elementwise_chain  adjacent elementwise and broadcast tasks of one phase
//                      whose outputs have one shape, each after the first
//                      reading an earlier one's output (or, a sibling, an
//                      input an earlier one reads): one loop over the
//                      elements, any length, any number of inputs.
//   matmul_epilogue    such a chain after a matmul, on its output's elements,
//                      run by the thread that holds each accumulator (bias,
//                      activation, residual add, cast).
//   reduction_epilogue such a chain after softmax, log_softmax, rmsnorm or
//                      layernorm, on each element of "out" as the row's
//                      block stores it; after their gradients, on "dx".
//   norm_prologue      an rmsnorm or layernorm whose output only matmuls
//                      read in its phase, each as its left operand: each of their
//                      kernels normalises its tile's rows as it loads them
//                      and the norm runs no kernel (KernelGroup::prologue);
//                      its output reaches memory only where a later phase
//                      or the caller reads it, stored by the first reader.
//   elementwise_prologue  an elementwise kernel (a chain, or one task) that
//                      stores one value, which only matmuls and row ops
//                      (softmax, the norms, row sums) of its phase read: each
//                      computes it element by element where its operand load
//                      reads it, and the chain runs no kernel.
//   matmul_sum         a matmul kernel whose epilogue starts by adding the
//                      product of another matmul (or a sum of them) of the
//                      same output shape: one product over the concatenated
//                      inner dimensions, a @ b + c @ d (the gradient of a
//                      tensor several matmuls read); the terms and partial
//                      sums never reach memory.
//   matmul_chain       a matmul kernel (prologue, epilogue) and the first
//                      matmul that reads its value as its left operand: one
//                      kernel whose blocks keep their rows of the value (an
//                      MLP's hidden activation) in shared memory between the
//                      two products; stored as well where read later.
//   row_reduction      a matmul kernel (its epilogue included) and the
//                      kernels that only reduce its value over the rows: a
//                      sum over rows (a bias gradient), a^T @ value (a
//                      weight gradient). Each block keeps a column tile of
//                      the value in shared memory, walks every tile of rows
//                      and accumulates its columns of the reductions; the
//                      value (an activation's gradient) reaches memory only
//                      where read elsewhere.
//   attention          softmax(scale * alpha * q k^T) then its matmul by the
//                      values: one warp per query row, the scores in shared
//                      memory (never in the arena); an epilogue may follow.
//   attention_projection  a projection (a matmul with its norm prologue and
//                      epilogue, then split_heads) whose heads an attention
//                      kernel reads as q, k or v: computed in that kernel,
//                      each block its head's keys and values and its own
//                      query rows, from its batch's input rows staged in
//                      shared memory; stored as well where read later.
//   attention_backward the gradient tasks of an attention (dp = dcontext
//                      v^T, its softmax_backward ds, and dq = ds k, dk =
//                      ds^T q, dv = probs^T dcontext, each matmul with its
//                      epilogue and head merge): one kernel, a block per
//                      head, one warp per query row for dp, ds and dq, the
//                      block's threads summing dk and dv over the query rows
//                      in registers; dp and ds never reach memory.
//   permuted_store     a gather that only moves elements (split_heads,
//                      merge_heads) after a matmul or a row op, or their
//                      epilogue: each element is stored where the gather
//                      would put it, and the gather runs no kernel. Last in
//                      its kernel.
//   horizontal         adjacent kernels of one phase, none reading what
//                      another writes (nor writing what another reads or
//                      writes), in one launch: one grid, each kernel on its
//                      own blocks (KernelGroup::launch). Fewer launches; small
//                      kernels that leave most of the device idle run side
//                      by side.
// A value produced in a group and read only there is internal: no buffer in
// the arena. One read outside the group (a later kernel, a later phase, the
// caller) is still stored, once.
#pragma once

#include <string>
#include <vector>

#include "kernels.h"
#include "program.h"
#include "schedule.h"

namespace cudagen {

// The rules' names, as --no-fuse-rule takes them.
inline std::vector<std::string> fusion_rule_names() {
  std::vector<std::string> names;
  for (FusionRule rule : kAllFusionRules) names.push_back(to_string(rule));
  return names;
}

struct FuseOptions {
  bool enabled = true;                       // --no-fuse: one kernel per task
  std::vector<std::string> disabled_rules;   // --no-fuse-rule NAME: names from fusion_rule_names()
  // Whether f32 matmuls run the pipelined mainloop as TF32, whose kernels are
  // launched alone: set by the pipeline from EmitOptions::allow_tf32.
  bool allow_tf32 = false;
  // Whether the kernels become a megakernel (EmitOptions::megakernel), whose
  // blocks are one size: no flash attention, so no attention over 1024 keys.
  bool megakernel = false;
  // The target (EmitOptions::target(): its SMs size the flash kernel's
  // split of the keys and the matmul tiles) and whether attention's backward
  // kernel sums dq with atomics (EmitOptions::atomic_attention_backward): the
  // flash tiles and matmul mainloops are decided here.
  Target target;
  bool atomic_attention_backward = false;
  // Whether Hopper matmuls may take stream-K (EmitOptions::stream_k): the
  // matmul mainloops are decided here too (KernelGroup::gemm).
  bool stream_k = false;
};

// Why a task did not join the kernel of the task scheduled before it.
struct FusionNote {
  int task = -1;
  int previous = -1;
  std::string reason;
};

struct Fusion {
  std::vector<KernelGroup> kernels;
  std::vector<FusionNote> notes;  // one per pair of adjacent tasks of one phase left apart
  // One per kernel that starts a launch after a kernel of its phase: its
  // first task, and the first task of the kernel of the launch before that it
  // conflicts with (or of the last kernel there).
  std::vector<FusionNote> launch_notes;
};

Fusion fuse(const Program& program, const Schedule& schedule, const FuseOptions& options);

}  // namespace cudagen
