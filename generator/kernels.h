// Kernel groups: which tasks each kernel runs (the fusion pass, fuse.h,
// makes them; without it every task is its own kernel, in schedule order).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "arch.h"
#include "kir.h"
#include "program.h"
#include "schedule.h"

namespace cudagen {

struct KernelGroup;  // below: a fused kernel

// The fusion rules (fuse.h, docs/fusion.md), each a kind of fused kernel;
// `none` for a kernel of one task.
enum class FusionRule {
  none,
  elementwise_chain,
  matmul_epilogue,
  reduction_epilogue,
  norm_prologue,
  elementwise_prologue,
  matmul_sum,
  matmul_chain,
  row_reduction,
  attention,
  attention_projection,
  attention_backward,
  permuted_store,
  horizontal,
};
inline constexpr FusionRule kAllFusionRules[] = {
    FusionRule::elementwise_chain, FusionRule::matmul_epilogue, FusionRule::reduction_epilogue,
    FusionRule::norm_prologue,     FusionRule::elementwise_prologue, FusionRule::matmul_sum,
    FusionRule::matmul_chain,      FusionRule::row_reduction,   FusionRule::attention,
    FusionRule::attention_projection, FusionRule::attention_backward, FusionRule::permuted_store,
    FusionRule::horizontal};
// Its name in docs/fusion.md, describe and --no-fuse-rule; "" for none.
const char* to_string(FusionRule rule);

// The Hopper flash kernels' consumer warps a block: two warpgroups.
inline constexpr int64_t kHopperFlashConsumerWarps = 8;

// Rule attention on tensor cores (templates/softmax_flash.cuh,
// docs/attention.md): flash attention's tile, cg_flash_config's parameters.
// A block of block_m / 16 warps owns block_m query rows of one head; keys and
// values stream through shared memory block_n rows at a time, `stages` tiles
// in flight.
struct FlashAttentionTile {
  int d = 0, dv = 0, block_m = 64, block_n = 64, stages = 2;
  // The heads' own sizes, where narrower than the tiles' d and dv (padded: 80
  // or 96 values in tiles of 128; on the Hopper kernels, 16 or 32 in tiles of
  // 64); equal otherwise.
  int head_d = 0, head_dv = 0;
  // Split-KV (decoding): where the blocks of row tiles and heads are fewer
  // than kFlashBlocksPerSm a SM of the target (kHopperFlashBlocksPerSm for
  // the Hopper kernel), the key tiles are cut into `splits` ranges of
  // `tiles_per_split` tiles (at least kMinKeyTilesPerSplit, at most
  // kMaxKeySplits ranges), a block each, combined in split order by the last
  // block of each row tile (cg_flash_attention_split), or on the Hopper
  // kernel by each consumer warp's last split to arrive
  // (cg_flash_attention_split_sm90); 1: no split.
  int splits = 1;
  int64_t tiles_per_split = 0;
  // The blocks a SM that its registers are budgeted for (__launch_bounds__).
  int min_blocks_per_sm = 1;
  // The backward kernel's atomic mode (--atomic-attention-backward): its key
  // blocks sum dq with atomics (square tiles; no query blocks).
  bool atomic_dq = false;
  // f32 q, k and v on tensor cores as TF32 (--allow-tf32): 4-byte elements,
  // m16n8k8 (cg_tf32 in templates/gemm.cuh).
  bool tf32 = false;
  // f32 q, k and v kept exact, trained without --allow-tf32: the same tiles
  // and fragments as TF32's, each mma's products as FMAs on CUDA cores
  // (cg_f32_simt in templates/gemm.cuh).
  bool simt_f32 = false;
  // The Hopper kernels (templates/softmax_flash_sm90.cuh, sm_90a): TMA and
  // wgmma, a producer warpgroup and two consumers of 64 rows each, heads in
  // tiles of 64 or 128 (narrower heads padded to 64) or, over 128, of 192
  // or 256 (the backward's 256, beside 128 or 256). The forward: 128 query
  // rows a block and 128 keys a step (64 over heads of 128); the backward:
  // 128 own rows (keys or query rows) a block and 64 streamed rows a step
  // (32 over heads of 128, key_splits() blocks a tile of keys).
  bool hopper = false;
  std::string why_not_hopper;  // on sm_90a, where a pass keeps part 1's kernel: why (describe)
  int threads() const { return hopper ? 384 : 32 * (block_m / 16); }
  int64_t element_bytes() const { return tf32 || simt_f32 ? 4 : 2; }
  // The backward kernel's blocks a tile of keys (cg_flash_config::KEY_SPLIT):
  // over heads of 128 two, each summing half of dk's and dv's columns.
  int key_splits() const { return std::max(d, dv) > 128 ? 2 : 1; }
  // The kernels' element type: "cg_tf32", "cg_f32_simt", or q's own (`q_type`).
  std::string element_type(const std::string& q_type) const {
    return tf32 ? "cg_tf32" : simt_f32 ? "cg_f32_simt" : q_type;
  }
  // Where the kernels' products run, for describe: "tensor cores" or "CUDA cores".
  const char* cores() const { return simt_f32 ? "CUDA cores" : "tensor cores"; }
  // How f32 is multiplied, for describe: ", f32 as TF32 ...", ", f32 on CUDA cores ...", or empty.
  const char* f32_note() const {
    return tf32       ? ", f32 as TF32 (--allow-tf32)"
           : simt_f32 ? ", f32 on CUDA cores (each mma's products as FMAs; --allow-tf32 would take tensor cores)"
                      : "";
  }
  // The workspace of a split attention over `heads` heads and `m_tiles` row
  // tiles: each split's partial rows (its block_m rows of o, dv floats each,
  // then their maxima and sums, 2 floats a row); its counters: arrival_counters.
  int64_t partial_floats(int64_t heads, int64_t m_tiles) const {
    return splits > 1 ? heads * m_tiles * splits * block_m * (dv + 2) : 0;
  }
  // Split-KV's counters: one a row tile (part 1: its last block combines),
  // or one a consumer warp's 16 rows of it (the Hopper kernel: each warp's
  // last to arrive combines its rows).
  int64_t arrival_counters(int64_t heads, int64_t m_tiles) const {
    return splits > 1 ? heads * m_tiles * (hopper ? kHopperFlashConsumerWarps : 1) : 0;
  }
  // cg_flash_shared<Config, T>::bytes: the q tile and the stages of keys and
  // values, or the staged output tile where more.
  // The Hopper forward's (cg_flash_sm90_config::SHARED_BYTES): 1 KiB of
  // alignment slack, the q tile, the stages, each consumer warp's staged
  // output rows (16 x 72 floats, 16 x 40 over heads of 192), the barriers.
  // (The emitted kernel static_asserts that the two agree:
  // shared_bytes_agree in emitter.h.)
  int64_t shared_bytes() const {
    if (hopper)
      return 1024 + 2 * (int64_t(block_m) * d + int64_t(stages) * block_n * (d + dv)) +
             8 * 16 * (std::max(d, dv) > 192 ? 40 : 72) * 4 + 8 * (1 + 3 * int64_t(stages));
    return std::max<int64_t>(element_bytes() * (int64_t(block_m) * d + int64_t(stages) * block_n * (d + dv)),
                             int64_t(4) * block_m * (dv + 8));
  }
  // "64, 64, 64, 64, 2" (and the heads' sizes where padded); Hopper: "128, 2, 96" (D, STAGES,
  // HEAD_D), and DV, HEAD_DV after them where the values differ: "64, 2, 64, 128, 128".
  std::string arguments() const;
  std::string describe() const;   // "64 query rows a block (4 warps), 64 keys a step, 2 stages, heads of 64"
  std::string heads() const;      // "64", "80 (padded to 128)", "64 (values 128)"
  // The backward kernel's (cg_flash_backward_shared): a block's own rows of
  // both kinds, the stages of streamed rows and their rows' statistics, or the
  // staged output tile where more.
  // With `atomic_dq`, the key block's tile of ds^T too.
  // The Hopper backward's (cg_flash_backward_sm90_config::SHARED_BYTES): 1
  // KiB of alignment slack, the own tiles of two tensors, the stages of two
  // streamed tiles and their rows' statistics, each consumer warp's staged
  // output rows (16 x 72 floats, 16 x 40 over heads of 128), the barriers.
  int64_t backward_shared_bytes(bool atomic_dq = false) const {
    if (hopper)
      return 1024 + 2 * int64_t(block_m) * (d + dv) + int64_t(stages) * (2 * int64_t(block_n) * (d + dv) + 8 * block_n) +
             8 * 16 * (std::max(d, dv) > 128 ? 40 : 72) * 4 + 8 * (1 + 4 * int64_t(stages));
    const int64_t main = element_bytes() * (int64_t(block_m) * (d + dv) + int64_t(stages) * block_n * (d + dv)) +
                         8 * int64_t(stages) * block_n +
                         (atomic_dq ? 2 * int64_t(block_m) * block_n : 0);
    return std::max<int64_t>(main, int64_t(4) * block_m * (std::max(d, dv) + 8));
  }
};

// The tasks of an attention trained on flash kernels: the forward's scores
// matmul, softmax and matmul by the values; the gradient kernel's roles
// (AttentionGradient, task indices, -1 where absent).
struct FlashTraining {
  int scores = -1, softmax = -1, values = -1;
  int dp = -1, ds = -1, dq = -1, dk = -1, dv = -1;
};

// The bundled ops whose algebra a skeleton is written around, where a
// template's facts (registry.h) cannot say it: attention is softmax(scale q
// k^T) v over matmuls, its gradient turns on softmax_backward; a row
// reduction's reductions are sum_leading and a^T @ value; a sum of matmuls
// joins them with add; the projections an attention computes end in
// split_heads; and skeletons shared by two ops tell them apart
// (log_softmax_backward, layernorm_backward, concat, max_pool2d and its
// gradient from avg_pool2d's, in either layout, slice_backward). The one table of op names the fusion pass and the emitter
// compare against (kernels.cpp); derive.cpp's gradient rules have their own.
enum class BundledOp {
  matmul,
  add,
  softmax,
  softmax_backward,
  sum_leading,
  split_heads,
  log_softmax_backward,
  layernorm_backward,
  concat,
  max_pool2d,
  max_pool2d_backward,
  max_pool2d_nhwc,
  max_pool2d_nhwc_backward,
  slice_backward,
  conv2d_nhwc,
  conv2d_nhwc_backward_data,
  conv2d_nhwc_backward_weight,
  batchnorm2d_nhwc,
  batchnorm2d_nhwc_backward,
};
bool is_op(const OpSignature& op, BundledOp which);
inline bool is_op(const BoundTask& task, BundledOp which) { return is_op(*task.op, which); }
// conv2d_nhwc or one of its gradients: an implicit GEMM that the fusion pass
// gives a matmul mainloop (conv_gemm_mainloop_of), with at most an epilogue.
bool is_convolution_gemm(const OpSignature& op);
inline bool is_convolution_gemm(const BoundTask& task) { return is_convolution_gemm(*task.op); }

// Whether kernel `k`'s prologue is a norm (rule norm_prologue), rather than
// an elementwise chain (rule elementwise_prologue) or nothing.
bool norm_prologue(const Program& program, const KernelGroup& k);

// Whether kernel `k` is the one that stores its prologue's output (and
// statistics) for readers in later phases or the caller.
bool stores_prologue(const Program& program, const KernelGroup& k);
// The same for one norm of its prologue (an attention kernel that computes
// its projections may hold two: q's, and k's and v's in cross-attention).
bool stores_norm(const Program& program, const KernelGroup& k, int norm);

// The rules that made kernel `k`, as describe and the kernel's comment name
// them: norm_prologue or elementwise_prologue where it has a prologue, then
// its grouping rule.
std::vector<std::string> kernel_rules(const Program& program, const KernelGroup& k);

// The number of launches: one past the largest KernelGroup::launch.
int launch_count(const std::vector<KernelGroup>& kernels);

// The matmul skeleton's tile (emit_matmul.cpp): 16-bit operands run on tensor
// cores in 64 x 64 tiles, f32 ones in 32 x 32 tiles (no TF32: docs/architecture.md §9).
// Its rows per block, and the shared memory its operand tiles take.
inline int64_t matmul_tile_rows(DType a) { return a == DType::f16 || a == DType::bf16 ? 64 : 32; }
// Its threads per block: 4 warps on tensor cores, 256 threads in 16 x 16 for f32.
inline int64_t matmul_tile_threads(DType a) { return matmul_tile_rows(a) == 64 ? 128 : 256; }
// Rule row_reduction: the accumulators each thread of such a block holds for
// one reduction of `outputs` rows (1 for a sum over the rows, K for a weight
// gradient) over a column tile (emit_matmul.cpp declares them; fuse.cpp bounds
// their sum over a kernel's reductions).
inline int64_t row_reduction_registers(int64_t outputs, DType a) {
  return (outputs * matmul_tile_rows(a) + matmul_tile_threads(a) - 1) / matmul_tile_threads(a);
}
inline int64_t matmul_operand_tile_bytes(DType a) {
  return matmul_tile_rows(a) == 64 ? 2 * (64 * (16 + 8) + 16 * (64 + 8)) : 4 * (32 * (16 + 1) + 16 * (32 + 1));
}
// Which of those tiles an op's matmul runs on: the tensor-core tile only
// where the op provides it (variant cg_matmul_tile_mma, as the built-in
// matmul does); otherwise its own function, with the portable tile's calling
// convention (docs/templates.md), whatever its dtype. The dtype to size the
// tile by (matmul_tile_rows and the rest): `a` on tensor cores, else f32.
inline DType matmul_tile_dtype(const OpSignature& op, DType a) {
  const bool tensor_cores = (a == DType::f16 || a == DType::bf16) && op.closure_of("cg_matmul_tile_mma") != nullptr;
  return tensor_cores ? a : DType::f32;
}

// The pipelined tensor-core mainloop (templates/gemm.cuh, docs/gemm.md): a
// tile configuration, as cg_gemm_config's parameters. bk counts operand
// elements: 16-bit ones, or f32 ones multiplied as TF32 (element_bytes 4),
// whose tiles take half the k of the tuning table's for the same bytes.
struct GemmTile {
  int bm = 0, bn = 0, bk = 0, warps_m = 0, warps_n = 0, stages = 0;
  int element_bytes = 2;
  int rule = -1;  // which rule of the tuning table chose it (0-based), -1 for none
  // Split-K (docs/gemm.md): the k range cut into `split_k` parts of
  // `k_tiles_per_split` k-tiles each (the last may have fewer), each part a
  // block of its own; 1: no split.
  int split_k = 1;
  int64_t k_tiles_per_split = 0;
  int threads() const { return 32 * warps_m * warps_n; }
  bool tf32() const { return element_bytes == 4; }
  // cg_gemm_shared<Config, T>::bytes: the stages, or the staged results where more.
  int64_t shared_bytes() const {
    return std::max(int64_t(element_bytes) * stages * (bm + bn) * bk, int64_t(4) * bm * (bn + 4));
  }
  // "128, 128, 64, 2, 2, 3": cg_gemm_config's template arguments.
  std::string arguments() const;
  // "128 x 128 x 64 tiles, 2 x 2 warps, 3 stages", and the split where any.
  std::string describe() const;
};

// The GEMM tuning table (templates/gemm_tuning.json, docs/gemm.md): rules in
// order, the first whose operands match ("16-bit", the default, or "tf32":
// f32 as TF32), whose arch matches ("any" or "sm_90") and whose product has
// at least `min_waves` full waves of 128 x 128 tiles on the target's SMs
// (--sms, or perf_model.h's count for the arch) picks the tile. Checked when read: each tile one
// the mainloop compiles without spills for its operands
// (Toolchains.GemmMainloopKeepsEverythingInRegisters) within the shared
// memory a kernel may opt in to, and for each kind of operands a last rule
// that matches every product.
//
// A rule's max_split_k (default 1) allows split-K: where the product's tiles
// of the rule's size (over its batches) fill less than one wave of the
// target's SMs, its k range is cut into as many parts as bring the blocks
// closest to one wave, at most max_split_k and each at least
// kMinKTilesPerSplit k-tiles (so each part's pipeline fills); the partial
// sums are added in a fixed order (deterministic, no floating-point atomics).
struct GemmTuningRule {
  bool tf32 = false;  // operands "tf32" (f32 multiplied as TF32); otherwise 16-bit
  std::string arch;
  int64_t min_waves = 0;
  GemmTile tile;
  int max_split_k = 1;
  std::string why;
};
constexpr int64_t kMinKTilesPerSplit = 8;
constexpr int kMaxSplitK = 32;
// The tile with its split (above) for an M x N x K product over `batches` on `sms` SMs.
GemmTile with_split_k(GemmTile tile, int max_split_k, int64_t M, int64_t N, int64_t K, int64_t batches, int64_t sms);
std::string_view gemm_tuning_json();  // the bundled table's text (embedded at build time)
// Throws std::runtime_error naming `origin` and the rule at fault.
std::vector<GemmTuningRule> parse_gemm_tuning(std::string_view text, const std::string& origin);

// The mainloop a matmul of M x N outputs over K (per batch; `batches` of
// them) runs on for `arch`, or nullopt with the reason in `why_not`: 16-bit
// operands of one type, or with `allow_tf32` f32 ones (as TF32), whose
// contiguous axes are whole 16-byte chunks (A's K, or M with trans_a; B's N,
// or K with trans_b). The tile: the bundled tuning table's.
std::optional<GemmTile> pipelined_gemm_tile(DType a, DType b, int64_t M, int64_t N, int64_t K, bool trans_a,
                                            bool trans_b, int64_t batches, const Target& target,
                                            std::string* why_not = nullptr, bool allow_tf32 = false);

// A strided data gradient on the pipelined mainloop (conv2d_nhwc_backward_data
// with a stride over 1 and dilation 1) splits by its stride into `count`
// dense GEMMs, one a class of dx's pixels (templates/vision.cuh,
// cg_conv2d_dgrad_class, whose arithmetic this repeats): the largest class's
// pixels and taps size the launch. count 1: not split (every pixel, every tap).
struct DgradClasses {
  int64_t count = 1, pixels = 0, taps = 0;
};
DgradClasses dgrad_classes(int64_t images, int64_t H, int64_t W, int64_t KH, int64_t KW, int64_t stride_h,
                           int64_t stride_w, int64_t padding_h, int64_t padding_w, int64_t dilation_h,
                           int64_t dilation_w);

// How a channels-last BatchNorm task (batchnorm2d_nhwc or its gradient)
// spreads over blocks (templates/vision.cuh, cg_batchnorm2d_nhwc_layout): a
// chunk of lanes x vector channels a block, its pixels split `splits` ways
// where one block a chunk would leave the GPU's SMs idle. More than one
// split: a statistics (or sums) kernel with its partial results in the
// split-K workspace, merged in order by the last block, then an elementwise
// kernel. One: a block a chunk does both (small tensors, the megakernel).
struct BatchNormNhwcSplit {
  int vector = 1, lanes = 1;  // channels a thread (one access of at most 16 bytes), threads along a pixel
  int64_t channels = 0, pixels = 0, chunks = 0, splits = 1, per_split = 0;
  int rows() const { return 256 / lanes; }
  // Shared memory: each row of threads' two values a channel (the layout's
  // SHARED_FLOATS), and after them a word where splits are merged.
  int64_t shared_bytes() const { return (2 * rows() * lanes * vector + (splits > 1 ? 1 : 0)) * 4; }
  // The workspace's floats: each split's two values a channel, and the merged sums dx reads.
  int64_t workspace_floats() const { return splits > 1 ? 2 * (splits + 1) * channels : 0; }
};
BatchNormNhwcSplit batchnorm_nhwc_split(const Program& program, int task, const Target& target, bool megakernel);
// batchnorm2d_nhwc or its gradient.
inline bool is_batchnorm_nhwc(const BoundTask& task) {
  return is_op(task, BundledOp::batchnorm2d_nhwc) || is_op(task, BundledOp::batchnorm2d_nhwc_backward);
}

// Matmul task `t`'s product as the emitter's matmul skeleton takes it: M x N
// outputs over K per batch, rows flattened where matmul_flattens_rows says so.
struct MatmulDims {
  int64_t M = 0, N = 0, K = 0, batches = 1;
  bool trans_a = false, trans_b = false;
  int64_t flops() const { return 2 * M * N * K * batches; }
};
MatmulDims matmul_dims(const Program& program, int t);

// The same for matmul task `t` of `program`, with M, N, K and the batches as
// the emitter's matmul skeleton takes them (rows flattened where
// matmul_flattens_rows says so). The fusion pass asks it too: a kernel on
// the pipelined mainloop is launched alone (rule horizontal).
std::optional<GemmTile> pipelined_gemm_tile_of(const Program& program, int t, const Target& target = "sm_90",
                                               std::string* why_not = nullptr, bool allow_tf32 = false);

// The Hopper mainloop (templates/gemm_sm90.cuh, docs/gemm.md "The Hopper
// path") for matmul task `t`: tiles of D = A B on wgmma, operands by TMA.
// Taken on a target with wgmma (sm_90a) for f16 and bf16 operands that TMA
// can read as stored: A K-contiguous and B either way, unbatched (rows of a
// batched A folded into M), every row stride whole 16 bytes; a product whose
// tiles would fill less than half the GPU where the pipelined mainloop
// splits K stays there, unless stream-K (`allow_stream_k`) pays. A kernel on
// it is launched alone, with no operand prologue (the caller checks both).
// Its tiles are 64 rows a consumer warpgroup: two (128 rows) by 192 or 128
// columns, or one (64 rows by 128, three stages, two blocks an SM),
// whichever leaves the busiest SM the least to compute (busiest_sm_area).
// (The template also has 256 columns, which spill: not taken.)
struct HopperGemm {
  int64_t M = 0, N = 0, K = 0;
  bool b_k_major = false;  // b stored N x K (trans_b)
  int consumers = 2;
  int columns = 128;  // 128 or 192 (with two consumers); the template's 256 for its tests
  int rows() const { return 64 * consumers; }
  // What fits 227 KiB: four stages but of 128 x 256 tiles' (48 KiB each).
  int stages() const { return consumers == 1 || columns == 256 ? 3 : 4; }
  // cg_sm90_gemm_config::RESULT_COLUMNS: the results leave in chunks this wide.
  int result_columns() const { return columns == 128 ? 128 : 64; }
  int threads() const { return 128 * (1 + consumers); }
  // cg_sm90_gemm_config::MIN_BLOCKS: what the registers setmaxnreg hands out
  // and the shared memory allow.
  int blocks_per_sm() const { return consumers == 1 ? 2 : 1; }
  int64_t tiles() const { return (M + rows() - 1) / rows() * ((N + columns - 1) / columns); }
  // The outputs (rows x columns a k step) the busiest of `sms` SMs computes
  // with persistent blocks sharing each SM: the last wave's quantisation.
  int64_t busiest_sm_area(int64_t sms) const { return (tiles() + sms - 1) / sms * rows() * columns; }
  int64_t k_tiles() const { return (K + 63) / 64; }
  // Stream-K (cg_sm90_schedule, docs/gemm.md "Stream-K"): where the tiles
  // leave the last wave partly empty, the last tiles' k-tiles dealt out to
  // every block, partial tiles added in k order. Chosen by the kernel at run
  // time from its grid, by the same rule as stream_k_tiles: the tiles it takes
  // on `grid` blocks, 0 for none. `stream_k` where it takes some on the
  // target's grid (stream_k_grid): the kernel is then given a workspace for
  // that grid, and launched on no more blocks than it.
  bool stream_k = false;
  // cg_sm90_gemm_config::FIXUP_K_TILES: a partial tile's cost in k-tiles.
  int fixup_k_tiles() const {
    const int64_t stage = int64_t(rows() + columns) * 64 * 2;
    return int((3 * int64_t(rows()) * columns * 4 + stage - 1) / stage);
  }
  // The fix-up's cost in k-tiles where `sk_k_tiles` k-tiles are dealt to
  // `grid` blocks (cg_sm90_fixup_k_tiles: more contributors a tile, more reads).
  int64_t fixup_k_tiles(int64_t sk_k_tiles, int64_t grid) const;
  int64_t stream_k_tiles(int64_t grid) const;
  // The partial tiles (a block's share of a tile shared with others) stream-K
  // computes on `grid` blocks: each is stored once and read once.
  int64_t stream_k_partial_tiles(int64_t grid) const;
  int64_t stream_k_grid(int64_t sms) const { return sms * blocks_per_sm(); }
  // The workspace on `grid` blocks: two slots of a tile's f32 sums a block;
  // a counter per stream-K tile (fewer than two grids of them) and consumer warp.
  int64_t stream_k_partial_bytes(int64_t grid) const { return 2 * grid * rows() * columns * 4; }
  int64_t stream_k_arrival_bytes(int64_t grid) const { return 2 * grid * 4 * consumers * 4; }
  // cg_sm90_gemm_config's SHARED_BYTES: the round-up to 1024 bytes, the
  // stages, their barriers, the consumer warps' rows of results.
  int64_t shared_bytes() const {
    return 1024 + int64_t(stages()) * (rows() + columns) * 64 * 2 + 2 * stages() * 8 +
           int64_t(consumers) * 4 * 16 * (result_columns() + 8) * 4;
  }
  std::string describe() const;
};
std::optional<HopperGemm> hopper_gemm_of(const Program& program, int t, const Target& target, bool allow_stream_k,
                                         std::string* why_not = nullptr);

// The f32 SIMT mainloop (templates/gemm.cuh, cg_sgemm_mainloop; docs/gemm.md):
// BM x BN tiles over BK, (BM / 8) x (BN / 8) threads of 8 x 8 outputs each.
struct SgemmTile {
  int bm = 0, bn = 0, bk = 0;
  int threads() const { return (bm / 8) * (bn / 8); }
  // cg_sgemm_config<...>::SHARED_BYTES: two stages, or the staged results where more.
  int64_t shared_bytes() const { return 4 * std::max<int64_t>(2 * bk * (bm + 4 + bn + 4), int64_t(bm) * (bn + 4)); }
  std::string arguments() const;  // "128, 128, 8"
  std::string describe() const;   // "128 x 128 x 8 tiles, 8 x 8 outputs a thread"
};

// The SIMT tile an f32 matmul of M x N outputs over K (per batch) runs on for
// `arch`, or nullopt with the reason: both operands f32 with contiguous axes
// of whole 16-byte chunks (A's K, or M with trans_a; B's N, or K with
// trans_b), and at least kSimtMainloopMinFlops (a smaller product's kernel
// shares a launch on the portable tile: launches cost more than its FMAs).
// 128 x 128 where those tiles fill a wave of the target's SMs, else 64 x 64.
constexpr int64_t kSimtMainloopMinFlops = int64_t(1) << 24;
std::optional<SgemmTile> simt_gemm_tile(DType a, DType b, int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b,
                                        int64_t batches, const Target& target, std::string* why_not = nullptr);
// The same for matmul task `t` (its op must have the SIMT mainloop's variants).
std::optional<SgemmTile> simt_gemm_tile_of(const Program& program, int t, const Target& target = "sm_90",
                                           std::string* why_not = nullptr);

// The mainloop a matmul kernel runs (emit_matmul.cpp, matmul()), decided
// once, by the fusion pass, for a kernel whose first task is a matmul with
// at most an epilogue (kir::Mainloop::gemm, no prologue), launched alone:
// the Hopper mainloop on sm_90a where it applies, else the pipelined one
// (16-bit operands, or f32 as TF32), else the f32 SIMT one. The fusion pass
// keeps such a kernel in a launch of its own (rule horizontal), the emitter
// prints it, the split-K workspace is sized from it; a kernel with none of
// the three runs the 64 x 64 or the portable tile, and `why_not_pipelined`
// says why (describe). The Hopper choice is kept beside the other: the
// emitter falls back to it where an operand's arena offset defeats TMA.
struct GemmMainloop {
  std::optional<HopperGemm> hopper;
  std::optional<GemmTile> pipelined;
  std::optional<SgemmTile> simt;
  std::string why_not_pipelined;  // where neither pipelined nor simt
  std::string why_not_hopper;     // where no hopper
  // Whether it runs a mainloop of its own launch (any of the three).
  bool launched_alone() const { return hopper || pipelined || simt; }
  // "Hopper", "pipelined" or "SIMT": the one it runs; empty for none.
  std::string name() const;
  // The one it runs and its tile, or why none (--dump-after fuse).
  std::string describe() const;
};
struct GemmOptions {
  Target target;
  bool allow_tf32 = false;      // f32 operands on the pipelined mainloop as TF32
  bool allow_stream_k = false;  // EmitOptions::stream_k
};
// Matmul task `t`'s mainloop, in a kernel launched alone that reads its
// operands as stored; with `refused` not empty, none, for that reason (a
// megakernel, a prologue computing an operand).
GemmMainloop gemm_mainloop_of(const Program& program, int t, const GemmOptions& options, const std::string& refused = {});
// The same for conv2d_nhwc task `t` or one of its gradients
// (templates/vision.cuh), whose implicit GEMM (matmul_dims: a product a
// group) runs the pipelined mainloop with its gathered operands copied as
// stored ones: 16-bit operands (f32 ones with TF32 allowed), each group's
// channels whole 16-byte chunks (the input channels of the forward; input
// and output channels of the gradients); otherwise the direct form, and
// `why_not_pipelined` says why.
GemmMainloop conv_gemm_mainloop_of(const Program& program, int t, const GemmOptions& options,
                                   const std::string& refused = {});

struct KernelGroup {
  std::string name;        // k<index>_<first task id>: a C identifier
  Phase phase = Phase::forward;
  std::vector<int> tasks;  // task indices, in execution order
  FusionRule rule = FusionRule::none;  // the fusion rule that grouped them (docs/fusion.md)
  // Buffers written and read only inside this kernel: they stay in registers
  // and get no storage in the arena.
  std::vector<int> internal_buffers;
  // The launch it runs in: kernels of one launch are adjacent, of one phase
  // and independent of each other (fuse.h, rule `horizontal`), so one grid
  // runs them all, each on its own blocks. Without that rule, its own index.
  int launch = 0;
  // Tasks this kernel recomputes on the operand loads of its first task:
  // rule norm_prologue, an rmsnorm or layernorm whose rows a matmul
  // normalises as it loads them; rule elementwise_prologue, an elementwise
  // chain whose result a matmul or a row op computes element by element as it
  // loads operand `prologue_operand`. They run no kernel of their own, and several
  // kernels may hold the same ones. Their outputs (a norm's statistics too)
  // are among internal_buffers, but in the one kernel that stores a norm's
  // output where it is read later (the backward pass saves it): there they
  // are not, and written once. (An elementwise prologue's result is read by
  // its matmuls alone, or it would not be one.)
  std::vector<int> prologue;
  std::string prologue_operand = "a";  // the operand slot the prologue computes: a matmul's "a" or "b", a row op's "x"
  // Training on flash attention (docs/attention.md): set on an attention
  // kernel (rule attention) and on its gradients' kernel (rule
  // attention_backward) where the fusion pass paired them
  // (flash_backward_tile_of). The probabilities are stored nowhere (among
  // both kernels' internal_buffers): the forward kernel saves each row's
  // log-sum-exp and its output o, and the gradient kernel recomputes them.
  bool flash_trained = false;
  // The flash tile the kernel runs, decided once by the fusion pass when it
  // has settled the kernels: an attention kernel's on the flash kernel (its
  // forward), or a flash_trained gradient kernel's (the backward kernel's,
  // atomic_dq in the atomic mode); empty for every other kernel.
  std::optional<FlashAttentionTile> flash;
  FlashTraining flash_roles;  // the gradient kernel's: its tasks' roles, the forward's too
  std::string why_not_flash;  // an attention kernel's without a flash tile: why (describe)
  // The matmul mainloop the kernel runs (GemmMainloop), decided once by the
  // fusion pass with the flash tile, before launches are batched: set for a
  // kernel whose IR is a kir::Mainloop::gemm on a matmul task; none for
  // every other kernel.
  GemmMainloop gemm;
  // What the kernel computes, as a mainloop with its stages' operand and
  // epilogue trees (kir.h): made from the fields above once the fusion pass
  // has settled them (fuse(); one_kernel_per_task() makes it too, but
  // decides no tiles: its kernels are for the planner's tests).
  kir::Kernel ir;
};

// Rule attention without projections computed in the kernel: its IR's
// stages the scores, softmax and context alone, the form the flash kernel
// takes.
inline bool attention_alone(const KernelGroup& k) {
  return k.rule == FusionRule::attention && !k.ir.stages.empty() && k.ir.stages.front().role == "scores" &&
         kir::role_task(k.ir, "context") >= 0;
}

// The shared memory every device gives a kernel without opting in: the
// emitter's variants are chosen to fit it.
inline constexpr int64_t kSharedBytesWithoutOptIn = 48 * 1024;
// The most a kernel may opt in to (its launcher sets the attribute) and
// still run on every GPU from sm_80 on: 99 KiB on sm_86 and sm_89 (sm_80 has
// 163 KiB, sm_90 227 KiB). The pipelined mainloop's largest tile takes 96.
inline constexpr int64_t kSharedBytesWithOptIn = 99 * 1024;
// The most a kernel for `arch` alone may opt in to: 227 KiB on sm_90 and
// sm_100 (the Hopper mainloop takes up to 197), 163 on sm_80 and sm_87, else 99.
int64_t shared_bytes_with_opt_in(const std::string& arch);

// Rule matmul_chain: the shared memory of a kernel of two chained matmuls,
// laid out once for the fusion pass and the emitter: the operand tiles, then
// the block's rows of the first product's value (`H` wide, in its type).
struct MatmulChainShared {
  SharedLayout layout;
  int64_t value = 0;
};
MatmulChainShared matmul_chain_shared(DType a, DType value, int64_t H, const std::string& value_name = "the value");

// Rule row_reduction: the shared memory of a matmul kernel that reduces its
// value over the rows, laid out once for the fusion pass (its bytes) and the
// emitter (its offsets): the operand tiles, a tile of the value (in its
// type), and for each weight gradient the tile's rows of its x (`x_widths`:
// their K, f32). The names only describe the regions.
struct RowReductionShared {
  SharedLayout layout;
  int64_t value = 0;            // the value's tile
  std::vector<int64_t> x_rows;  // each weight gradient's rows of its x
};
RowReductionShared row_reduction_shared(DType a, DType value, const std::vector<int64_t>& x_widths,
                                        const std::string& value_name = "the value",
                                        const std::vector<std::string>& x_names = {});

// Whether matmul a @ b -> out multiplies every row of `a` by one matrix,
// [..., M, K] @ [K, N] (`a` not transposed, `b`'s leading axes all 1): the
// matmul skeleton then runs it as one [rows, K] @ [K, N] (emit_matmul.cpp), and a
// matmul chain takes only such products (fuse.cpp).
bool matmul_flattens_rows(const Shape& a, const Shape& b, const Shape& out, bool trans_a);

// Rule row_reduction: the index in k.tasks of the kernel's first reduction
// over the rows of its matmul's value (a sum_leading, or a matmul a^T @
// value); the tasks between are the matmul's epilogue. 0 for a kernel of
// another rule.
size_t first_row_reduction(const Program& program, const KernelGroup& k);

// Rule attention_projection: the index in k.tasks of an attention kernel's
// scores matmul. The tasks before it are the projections whose heads the
// kernel computes itself (each a matmul, its epilogue, the split_heads that
// ends it); 0 where there are none, or for a kernel of another rule.
size_t attention_scores(const Program& program, const KernelGroup& k);

// The attention skeleton's query rows per block, one warp each (emit_attention.cpp):
// up to 8, a divisor of Tq, all of one head, whose per-warp scratch (the
// query row and its scores, D + Tk floats) fits in shared memory.
int64_t attention_rows_per_block(int64_t Tq, int64_t D, int64_t Tk);

// Rule attention's row kernel (cg_attention_row) holds a row of scores and
// the query row in one warp's shared memory: at most this many keys and values
// in a query row. Over it, the streamed row kernel (query and output rows of
// at most this many values) or the flash kernel (any number of keys).
inline constexpr int64_t kMaxAttentionKeys = 1024;


// Whether a batch of keys or values (`kv`) serves the heads of q: each
// leading axis q's or 1 (a group of query heads shares it: grouped-query
// attention). Both of one rank; the last two axes are the matrices'.
inline bool shared_by_groups(const Shape& q, const Shape& kv) {
  for (size_t i = 0; i + 2 < q.size(); ++i)
    if (kv[i] != q[i] && kv[i] != 1) return false;
  return true;
}

// The flash tile for the attention whose scores matmul is task `scores` and
// whose softmax is `softmax` (the probabilities' one reader its matmul by the
// values), or nullopt with the reason in `why_not`: q, k and v of one 16-bit
// type, head sizes of multiples of 8 up to 256 (each padded to a tile of 16,
// 32, 64, 128 or 256; heads over 128 read q from shared memory, 32 keys a step), k's and v's leading axes q's or 1
// where q's are not (grouped-query attention), probabilities read by nothing else
// (a backward pass that reads them keeps the row kernel), and kernels
// launched alone (not a megakernel). The fusion pass asks it (at any number
// of keys, only this kernel fuses the attention) as the emitter does.
// `arch`'s SM count decides the split (perf_model.h).
// `trained`: the probabilities may also be read by their gradients' tasks
// (a softmax_backward and dv = p^T dcontext, in a later phase) where the
// fusion pass paired the two kernels (KernelGroup::flash_trained).
// `allow_tf32` (--allow-tf32): f32 q, k and v too, on tensor cores as TF32
// (tiles of 32 to 128; and trained, exact on CUDA cores without it; heads under
// 32 padded to 32 where trained past kRowKernelTrainedQueryRows query rows).
std::optional<FlashAttentionTile> flash_attention_tile_of(const Program& program, int scores, int softmax, bool megakernel,
                                                          std::string* why_not = nullptr,
                                                          const Target& target = "sm_90", bool trained = false,
                                                          bool allow_tf32 = false);


// The backward kernel's blocks own this many keys or query rows; its rows'
// statistics (cg_flash_backward_rows) cover each head's Tq rows rounded up to
// a multiple of it, so that every tile reads whole 16-byte chunks.
inline constexpr int kFlashBackwardBlockRows = 64;
inline int64_t flash_backward_statistics_rows(int64_t Tq) {
  return (Tq + kFlashBackwardBlockRows - 1) / kFlashBackwardBlockRows * kFlashBackwardBlockRows;
}

// The backward kernel's tile for the attention whose gradients are tasks
// `roles` (dp, ds, dq, dk, dv filled in), or nullopt with the reason: the
// probabilities ds reads are a softmax's over a scores matmul q k^T, read in
// the forward by its matmul by the values, whose attention takes the flash
// kernel (flash_attention_tile_of, trained), and read by nothing else but
// ds and dv; dp = dcontext v^T of those values, dq = ds k and dk = ds^T q
// of its keys and queries, both present (the kernel reads q and k, which
// only they keep alive until the backward pass); dcontext of
// q's type; k and v shared by a group of q's heads where the forward's are
// (grouped-query attention: dk and dv per query head, summed over the group
// by the tasks after them). On success `roles` gets the forward's tasks too. Blocks
// of 64 rows (4 warps) own keys or query rows; the other rows stream 32 at a
// time, two stages (64 at heads of 16, and in the atomic mode, `atomic_dq`,
// at heads of up to 64; 16 in 4-byte types over heads of 64, and over
// heads of 128, where each tile of keys takes two blocks, each half of dk's
// and dv's columns: FlashAttentionTile::key_splits). f32 q, k and v as the
// forward takes them: as TF32 with `allow_tf32` (--allow-tf32), otherwise
// exact on CUDA cores, tiles of 32 to 128 (as the forward's). On sm_90a,
// where the Hopper kernels take the heads (16-bit, heads of up to 256, q's
// and k's and v's each in a tile of 64, 128 or 256), the Hopper backward
// instead (`hopper`): 384 threads, 128 own rows a block, 64 streamed a step
// (32 over heads of 128, two key blocks a tile of keys), two stages, no
// atomic mode.
std::optional<FlashAttentionTile> flash_backward_tile_of(const Program& program, FlashTraining& roles, bool megakernel,
                                                         std::string* why_not = nullptr,
                                                         const Target& target = "sm_90", bool atomic_dq = false,
                                                         bool allow_tf32 = false);
inline constexpr int64_t kMinKeyTilesPerSplit = 4;
// Decoding streams the keys and values once: memory-bound. One block keeps
// two 16 KiB stages in flight, too few to cover an SM's share of the
// bandwidth; a split aims at this many blocks a SM (5 fit, by shared memory).
inline constexpr int64_t kFlashBlocksPerSm = 4;
// The Hopper forward's blocks fit one a SM (117 to 197 KiB of shared
// memory); each keeps two stages of 32 to 64 KiB in flight, enough for its
// share of the bandwidth: a split aims at one block a SM.
inline constexpr int64_t kHopperFlashBlocksPerSm = 1;
inline constexpr int kMaxKeySplits = 32;

// The floats of a projection input's rows of a batch, T x K: where a norm
// computes them, with its weight (and a layernorm's bias), and where the
// kernel stores the norm's output, the rows' statistics (rstd; a
// layernorm's mean too).
inline int64_t projection_source_floats(int64_t T, int64_t K, bool norm, bool layernorm, bool stores_statistics) {
  const int64_t per_row = layernorm ? 2 : 1;
  return T * K + (norm ? per_row * K + (stores_statistics ? per_row * T : 0) : 0);
}

// Rules attention and attention_projection: an attention kernel's shared
// memory, laid out once for the fusion pass (its bytes) and the emitter (its
// offsets), in the emitter's order: each warp's query row and scores
// (`per_block` warps of D + Tk floats); the head's keys and values where
// staged (always where the block computes k or v, otherwise where they fit
// in 48 KiB beside the scratch and a block has several warps); then for each
// projection the kernel computes, in turn: its input's rows of a batch (once
// per input: normalised, with the norm's weight and bias and the rows'
// statistics where stored, where a norm computes them), the head's query rows
// where it computes q, and at the first one projection's weight columns for a
// head (`weight_floats`, the largest).
struct AttentionProjectionShared {
  int source = -1;  // its input's buffer, staged once; -1: none to stage here
  int64_t source_floats = 0;
  std::string source_what = "a projection input's rows of a batch";
  int64_t q_floats = 0;  // where it computes q: the head's query rows
  std::string q_what = "the head's query rows";
};
struct AttentionShared {
  SharedLayout layout;
  int64_t rows = 0;                 // each warp's query row and scores
  int64_t keys = -1;                // the head's keys, then its values; -1: not staged
  std::map<int, int64_t> sources;   // a projection input -> its rows
  int64_t queries = -1, weights = -1;
};
AttentionShared attention_shared(int64_t per_block, int64_t Tk, int64_t D, int64_t Dv, bool kv_computed,
                                 const std::vector<AttentionProjectionShared>& projections, int64_t weight_floats);

// Rule attention_backward: where the gradient tasks of an attention
// (scores = alpha q k^T, probs = softmax(scale * scores), context =
// alpha' probs v) are in k.tasks: dp = alpha' dcontext v^T, ds =
// softmax_backward(probs, dp), and those of them the graph derives of
// dq = alpha ds k, dk = alpha ds^T q and dv = alpha' probs^T dcontext, each
// matmul followed by its epilogue up to the next of them. `none` for a
// gradient the kernel does not compute, and for a kernel of another rule.
struct AttentionGradient {
  static constexpr size_t none = SIZE_MAX;
  size_t dp = none, ds = none, dq = none, dk = none, dv = none;
  // One past the last task of the epilogue of the gradient at index `i`.
  size_t epilogue_end(size_t i, size_t tasks) const;
};
AttentionGradient attention_gradient(const Program& program, const KernelGroup& k);

// Rule matmul_sum: where the terms of a sum of matmuls (each [..., M, K_i] @
// [K_i, N], one output shape) are in k.tasks, and the adds that sum them
// (`adds`):
// k.tasks is the first term, then each further term followed by the add of
// it to the sum so far, then the epilogue on the sum (from `epilogue`).
// Empty for a kernel of another rule.
struct MatmulSum {
  std::vector<size_t> terms, adds;
  size_t epilogue = 0;
};
MatmulSum matmul_sum_terms(const Program& program, const KernelGroup& k);

// The attention_backward skeleton (emit_attention.cpp): a block of 256 threads per
// head, its 8 warps taking a tile of 8 query rows at a time, one each.
inline constexpr int64_t kAttentionBackwardThreads = 256;
inline constexpr int64_t kAttentionBackwardRows = 8;
// At most this many tiles of query rows a block walks one after another (as
// the row tiles of the unfused matmuls ran in parallel): the row kernels
// train attention of up to kRowKernelTrainedQueryRows query rows.
inline constexpr int64_t kMaxAttentionBackwardRowTiles = 16;
inline constexpr int64_t kRowKernelTrainedQueryRows = kAttentionBackwardRows * kMaxAttentionBackwardRowTiles;
// The accumulators each thread holds: its elements of the head's key and
// value gradients ([Tk, D] and [Tk, Dv], where computed).
inline int64_t attention_backward_registers(int64_t Tk, int64_t D, int64_t Dv, bool dk, bool dv) {
  auto rounds = [](int64_t outputs) { return (outputs + kAttentionBackwardThreads - 1) / kAttentionBackwardThreads; };
  return (dk ? rounds(Tk * D) : 0) + (dv ? rounds(Tk * Dv) : 0);
}
// Its shared memory, laid out once for the fusion pass and the emitter
// (floats): the head's keys (where dq is computed) and values, then for the
// tile of query rows their q (where dk is computed), dcontext, probabilities
// and ds. Offsets, -1 where not reserved; the names only describe regions.
struct AttentionBackwardShared {
  SharedLayout layout;
  int64_t keys = -1, values = -1, q = -1, dout = -1, probs = -1, ds = -1;
};
AttentionBackwardShared attention_backward_shared(int64_t Tk, int64_t D, int64_t Dv, bool dq, bool dk,
                                                  const std::string& dout_name = "dcontext",
                                                  const std::string& probs_name = "probs");

// Whether a list of task or buffer indices holds `x`.
inline bool contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

// What a kernel runs: its prologue tasks, then its tasks.
std::vector<int> kernel_tasks(const KernelGroup& kernel);

std::vector<KernelGroup> one_kernel_per_task(const Program& program, const Schedule& schedule);

// The buffers each kernel touches in the arena (input for the memory planner;
// a kernel's internal buffers are not among them).
std::vector<std::vector<int>> kernel_buffers(const Program& program, const std::vector<KernelGroup>& kernels);

}  // namespace cudagen
