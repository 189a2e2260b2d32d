// The kernel IR (docs/architecture.md §12): what a fused kernel computes, as
// the fusion pass made it, in a form the planner, the emitter and
// `--dump-after fuse` read instead of re-discovering it from a list of tasks.
//
// A kernel is a mainloop (the skeleton it is built on: a loop over elements,
// a block per row, a GEMM tile, an attention tile, ...) running one or more
// stages: the tasks that mainloop computes (a matmul; an attention's scores,
// softmax and context; the terms of a sum of matmuls). Each stage reads its
// operands through a tree (a load, or a prologue: a norm or an elementwise
// chain computed as the operand is loaded) and hands its results to an
// epilogue: the elementwise ops that run on each result where it is computed,
// and the stores (in place, or permuted as a gather would move the element)
// of what is read outside the kernel. Nodes form a DAG: a value read twice
// (a residual) is one node.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "program.h"

namespace cudagen {

// A shared-memory region's bytes up to the 16-byte boundary the next one
// starts at (every region starts at one, for vector loads and the
// tensor-core tiles).
inline int64_t shared_region_bytes(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// A kernel's shared memory: named regions, in order, each from a 16-byte
// boundary. Laid out once, by one function per fused skeleton (kernels.h),
// which the fusion pass asks for the bytes and the emitter for the offsets.
struct SharedRegion {
  std::string what;
  int64_t offset = 0;
  int64_t bytes = 0;
};
struct SharedLayout {
  std::vector<SharedRegion> regions;
  // Reserves `bytes` after every region before: returns its offset.
  int64_t add(std::string what, int64_t bytes) {
    const int64_t offset = shared_region_bytes(end());
    regions.push_back(SharedRegion{std::move(what), offset, bytes});
    return offset;
  }
  // One past the last region's last byte.
  int64_t end() const { return regions.empty() ? 0 : regions.back().offset + regions.back().bytes; }
  // What the regions take, the last one's alignment included.
  int64_t bytes() const { return shared_region_bytes(end()); }
};

struct KernelGroup;

namespace kir {

// The skeleton a kernel is built on.
enum class Mainloop {
  elements,            // a grid-stride loop over the elements of one shape
  reduction,           // a reduction's skeleton: a block per row (softmax, the norms, their gradients), column sums
  gemm,                // a matmul tile
  gemm_sum,            // one product over the terms' concatenated inner dimensions
  gemm_chain,          // two products, the first's rows kept in shared memory
  gemm_row_reduction,  // a product whose value is reduced over its rows in the same blocks
  attention,           // softmax(q k^T) v, a warp per query row; projections computed in the block
  attention_backward,  // an attention's gradients, a block per head
  gather,              // one output element at a time, from anywhere in the inputs
  opaque,              // the op's own block-level function (a transpose, a convolution)
};
const char* to_string(Mainloop m);

struct Node {
  enum class Kind {
    result,          // a value a stage computes (`task`'s output `buffer`); or another output of op inputs[0]
    load,            // `buffer` read from memory
    op,              // elementwise task `task` on `inputs`, defining `buffer`
    norm,            // norm task `task` on its row (`inputs`: x, weight, bias), defining `buffer`
    store,           // inputs[0] written to `buffer`
    store_permuted,  // inputs[0] written where gather task `task` would move it, in `buffer`
  };
  Kind kind = Kind::load;
  int task = -1;
  int buffer = -1;
  std::vector<int> inputs;  // indices into Kernel::nodes
  // store_permuted: kept in shared memory, where a later stage reads it;
  // and written to memory (unless its buffer stays in the kernel).
  bool in_kernel = false;
  bool to_memory = true;
};

struct Operand {
  std::string slot;  // the stage's input slot
  int node = -1;     // what it reads: a load, a prologue's root, or an earlier stage's result
  std::vector<int> stores;  // a prologue's values the kernel stores for later readers (a norm's output, statistics)
};

struct Stage {
  std::string role;               // "product", "scores", "softmax", "term", "sum", "dq", ...; the op's name for one task
  int task = -1;                  // -1 for a loop over elements (its chain is all epilogue)
  std::vector<Operand> operands;  // in slot order
  std::vector<int> results;       // result nodes, one per output slot
  std::vector<int> epilogue;      // the nodes the stage's epilogue roots: stores, in task order
  // What the epilogue computes, in task order: a node per task (an
  // elementwise op, or a permuted store), each after those it reads. The
  // emitter prints it (Emitter::epilogue); a value a later stage reads in
  // the kernel is computed here too, though no store roots it.
  std::vector<int> chain;
};

struct Kernel {
  Mainloop mainloop = Mainloop::elements;
  std::vector<Stage> stages;
  std::vector<Node> nodes;
};

// The IR of kernel group `k` (its tasks, prologue, rule and internal buffers).
Kernel build(const Program& program, const KernelGroup& k);

// The task of the (first) stage of role `role`, or -1.
int role_task(const Kernel& kernel, std::string_view role);

// The index of the stage whose result is `buffer`, or -1.
int stage_of_result(const Kernel& kernel, int buffer);

// The op and norm nodes of the tree rooted at `root` (a prologue), each
// after those it reads.
std::vector<int> tree_ops(const Kernel& kernel, int root);

// The kernel as an indented tree: each stage, its operands' trees and its
// epilogue's stores, values named by buffer (a node printed once; later
// reads name it).
std::string print(const Program& program, const Kernel& kernel, const std::string& indent = "  ");

}  // namespace kir
}  // namespace cudagen
