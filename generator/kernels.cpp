#include "kernels.h"

#include <algorithm>
#include <array>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "arch.h"
#include "json.h"
#include "perf_model.h"

namespace cudagen {

const char* to_string(FusionRule rule) {
  switch (rule) {
    case FusionRule::none: return "";
    case FusionRule::elementwise_chain: return "elementwise_chain";
    case FusionRule::matmul_epilogue: return "matmul_epilogue";
    case FusionRule::reduction_epilogue: return "reduction_epilogue";
    case FusionRule::norm_prologue: return "norm_prologue";
    case FusionRule::elementwise_prologue: return "elementwise_prologue";
    case FusionRule::matmul_sum: return "matmul_sum";
    case FusionRule::matmul_chain: return "matmul_chain";
    case FusionRule::row_reduction: return "row_reduction";
    case FusionRule::attention: return "attention";
    case FusionRule::attention_projection: return "attention_projection";
    case FusionRule::attention_backward: return "attention_backward";
    case FusionRule::permuted_store: return "permuted_store";
    case FusionRule::horizontal: return "horizontal";
  }
  return "";
}

bool is_op(const OpSignature& op, BundledOp which) {
  switch (which) {
    case BundledOp::matmul: return op.name == "matmul";
    case BundledOp::add: return op.name == "add";
    case BundledOp::softmax: return op.name == "softmax";
    case BundledOp::softmax_backward: return op.name == "softmax_backward";
    case BundledOp::sum_leading: return op.name == "sum_leading";
    case BundledOp::split_heads: return op.name == "split_heads";
    case BundledOp::log_softmax_backward: return op.name == "log_softmax_backward";
    case BundledOp::layernorm_backward: return op.name == "layernorm_backward";
    case BundledOp::concat: return op.name == "concat";
    case BundledOp::max_pool2d: return op.name == "max_pool2d";
    case BundledOp::max_pool2d_backward: return op.name == "max_pool2d_backward";
    case BundledOp::max_pool2d_nhwc: return op.name == "max_pool2d_nhwc";
    case BundledOp::max_pool2d_nhwc_backward: return op.name == "max_pool2d_nhwc_backward";
    case BundledOp::slice_backward: return op.name == "slice_backward";
    case BundledOp::conv2d_nhwc: return op.name == "conv2d_nhwc";
    case BundledOp::conv2d_nhwc_backward_data: return op.name == "conv2d_nhwc_backward_data";
    case BundledOp::conv2d_nhwc_backward_weight: return op.name == "conv2d_nhwc_backward_weight";
    case BundledOp::batchnorm2d_nhwc: return op.name == "batchnorm2d_nhwc";
    case BundledOp::batchnorm2d_nhwc_backward: return op.name == "batchnorm2d_nhwc_backward";
  }
  return false;
}

bool is_convolution_gemm(const OpSignature& op) {
  return is_op(op, BundledOp::conv2d_nhwc) || is_op(op, BundledOp::conv2d_nhwc_backward_data) ||
         is_op(op, BundledOp::conv2d_nhwc_backward_weight);
}

std::vector<KernelGroup> one_kernel_per_task(const Program& program, const Schedule& schedule) {
  std::vector<KernelGroup> kernels;
  for (int t : schedule.order) {
    if (!program.tasks[size_t(t)].op->view.first.empty()) continue;  // a view: storage only, no kernel
    const Task& task = *program.tasks[size_t(t)].task;
    const int index = int(kernels.size());
    kernels.push_back(KernelGroup{"k" + std::to_string(index) + "_" + task.id, task.phase, {t}, FusionRule::none, {}, index});
    kernels.back().ir = kir::build(program, kernels.back());
  }
  return kernels;
}

std::vector<int> kernel_tasks(const KernelGroup& kernel) {
  std::vector<int> tasks = kernel.prologue;
  tasks.insert(tasks.end(), kernel.tasks.begin(), kernel.tasks.end());
  return tasks;
}

bool norm_prologue(const Program& program, const KernelGroup& k) {
  if (k.prologue.empty()) return false;
  return !program.tasks[size_t(k.prologue.front())].op->norm.empty();
}

bool stores_prologue(const Program& program, const KernelGroup& k) {
  return norm_prologue(program, k) && stores_norm(program, k, k.prologue.front());
}

bool stores_norm(const Program& program, const KernelGroup& k, int norm) {
  return !contains(k.internal_buffers, program.tasks[size_t(norm)].find_tensor("out")->buffer);
}

std::vector<std::string> kernel_rules(const Program& program, const KernelGroup& k) {
  std::vector<std::string> rules;
  if (!k.prologue.empty()) rules.push_back(norm_prologue(program, k) ? "norm_prologue" : "elementwise_prologue");
  if (attention_scores(program, k) > 0) rules.push_back("attention_projection");
  if (first_row_reduction(program, k) > 1) rules.push_back("matmul_epilogue");
  if (const MatmulSum sum = matmul_sum_terms(program, k); !sum.terms.empty() && sum.epilogue < k.tasks.size())
    rules.push_back("matmul_epilogue");
  if (const AttentionGradient g = attention_gradient(program, k); g.ds != AttentionGradient::none)
    for (size_t i : {g.dq, g.dk, g.dv})
      if (i != AttentionGradient::none && g.epilogue_end(i, k.tasks.size()) > i + 1) {
        rules.push_back("matmul_epilogue");  // (its head merge alone too, as for a matmul's own kernel)
        break;
      }
  if (k.rule != FusionRule::none) rules.push_back(to_string(k.rule));
  return rules;
}

bool matmul_flattens_rows(const Shape& a, const Shape& b, const Shape& out, bool trans_a) {
  return !trans_a && numel(Shape(b.begin(), b.end() - 2)) == 1 &&
         std::equal(a.begin(), a.end() - 2, out.begin(), out.end() - 2);
}

size_t first_row_reduction(const Program& program, const KernelGroup& k) {
  if (k.rule != FusionRule::row_reduction) return 0;
  for (size_t i = 1; i < k.tasks.size(); ++i) {
    const PatternKind pattern = program.tasks[size_t(k.tasks[i])].op->pattern;
    if (pattern != PatternKind::elementwise && pattern != PatternKind::broadcast) return i;
  }
  return 0;
}

size_t attention_scores(const Program& program, const KernelGroup& k) {
  if (k.rule != FusionRule::attention) return 0;
  for (size_t i = 1; i < k.tasks.size(); ++i)
    if (is_op(program.tasks[size_t(k.tasks[i])], BundledOp::softmax))
      return i >= 2 && is_op(program.tasks[size_t(k.tasks[i - 1])], BundledOp::add) ? i - 2 : i - 1;  // (a bias's add between)
  return 0;
}

MatmulSum matmul_sum_terms(const Program& program, const KernelGroup& k) {
  MatmulSum sum;
  if (k.rule != FusionRule::matmul_sum) return sum;
  // fuse.cpp: each further term's kernel starts with it, then its add; the
  // epilogue (elementwise tasks) follows the last add.
  for (size_t i = 0; i < k.tasks.size(); ++i) {
    if (!is_op(program.tasks[size_t(k.tasks[i])], BundledOp::matmul)) continue;
    sum.terms.push_back(i);
    if (i == 0) continue;
    if (i + 1 >= k.tasks.size() || !is_op(program.tasks[size_t(k.tasks[i + 1])], BundledOp::add))
      throw std::logic_error("matmul_sum kernel " + k.name + ": a term not followed by its add");
    sum.adds.push_back(i + 1);
  }
  sum.epilogue = sum.adds.empty() ? 1 : sum.adds.back() + 1;
  return sum;
}

MatmulChainShared matmul_chain_shared(DType a, DType value, int64_t H, const std::string& value_name) {
  const int64_t tile = matmul_tile_rows(a);
  MatmulChainShared s;
  s.layout.add("the operand tiles", matmul_operand_tile_bytes(a));
  s.value = s.layout.add(fmt::format("the block's {} rows of {} ({})", tile, value_name, to_string(value)),
                         tile * H * dtype_bytes(value));
  return s;
}

RowReductionShared row_reduction_shared(DType a, DType value, const std::vector<int64_t>& x_widths,
                                        const std::string& value_name, const std::vector<std::string>& x_names) {
  const int64_t tile = matmul_tile_rows(a);
  RowReductionShared s;
  s.layout.add("the operand tiles", matmul_operand_tile_bytes(a));
  s.value = s.layout.add(fmt::format("a {} x {} tile of {} ({})", tile, tile, value_name, to_string(value)),
                         tile * tile * dtype_bytes(value));
  for (size_t i = 0; i < x_widths.size(); ++i)
    s.x_rows.push_back(s.layout.add(fmt::format("{} rows of {} ({} x {} floats)", tile,
                                                i < x_names.size() ? x_names[i] : "x", tile, x_widths[i]),
                                    tile * x_widths[i] * 4));
  return s;
}

AttentionGradient attention_gradient(const Program& program, const KernelGroup& k) {
  AttentionGradient g;
  if (k.rule != FusionRule::attention_backward) return g;
  auto task = [&](size_t i) -> const BoundTask& { return program.tasks[size_t(k.tasks[i])]; };
  auto buffer = [&](size_t i, const char* slot) { return task(i).find_tensor(slot)->buffer; };
  auto flag = [&](size_t i, const char* arg) { return flag_value(root_arg(program, k.tasks[i], arg).second); };
  for (size_t i = 0; i < k.tasks.size() && g.ds == AttentionGradient::none; ++i)
    if (is_op(task(i), BundledOp::softmax_backward)) g.ds = i;
  if (g.ds == AttentionGradient::none) return g;
  const int probs = buffer(g.ds, "out"), dp = buffer(g.ds, "dout"), ds = buffer(g.ds, "dx");
  for (size_t i = 0; i < k.tasks.size(); ++i) {
    if (!is_op(task(i), BundledOp::matmul)) continue;
    if (buffer(i, "out") == dp) g.dp = i;
    else if (buffer(i, "a") == ds) (flag(i, "trans_a") ? g.dk : g.dq) = i;
    else if (buffer(i, "a") == probs && flag(i, "trans_a")) g.dv = i;
  }
  return g;
}

size_t AttentionGradient::epilogue_end(size_t i, size_t tasks) const {
  size_t end = tasks;
  for (size_t anchor : {dp, ds, dq, dk, dv})
    if (anchor != none && anchor > i) end = std::min(end, anchor);
  return end;
}

AttentionBackwardShared attention_backward_shared(int64_t Tk, int64_t D, int64_t Dv, bool dq, bool dk,
                                                  const std::string& dout_name, const std::string& probs_name) {
  const int64_t R = kAttentionBackwardRows;
  AttentionBackwardShared s;
  SharedLayout& l = s.layout;
  if (dq) s.keys = l.add(fmt::format("the head's keys ({} x {} floats)", Tk, D), Tk * D * 4);
  s.values = l.add(fmt::format("the head's values ({} x {} floats)", Tk, Dv), Tk * Dv * 4);
  if (dk) s.q = l.add(fmt::format("q's tile of {} query rows ({} x {} floats)", R, R, D), R * D * 4);
  s.dout = l.add(fmt::format("{}'s tile of query rows ({} x {} floats)", dout_name, R, Dv), R * Dv * 4);
  s.probs = l.add(fmt::format("{}'s tile of query rows ({} x {} floats)", probs_name, R, Tk), R * Tk * 4);
  s.ds = l.add(fmt::format("ds of the tile's rows ({} x {} floats)", R, Tk), R * Tk * 4);
  return s;
}

int64_t attention_rows_per_block(int64_t Tq, int64_t D, int64_t Tk) {
  int64_t per_block = 8;
  while (per_block > 1 && (Tq % per_block != 0 || per_block * (D + Tk) * 4 > kSharedBytesWithoutOptIn)) per_block /= 2;
  return per_block;
}

std::string FlashAttentionTile::arguments() const {
  if (hopper)  // cg_flash_sm90_config, cg_flash_backward_sm90_config
    return dv == d && head_dv == head_d ? fmt::format("{}, {}, {}", d, stages, head_d)
                                        : fmt::format("{}, {}, {}, {}, {}", d, stages, head_d, dv, head_dv);
  std::string text = fmt::format("{}, {}, {}, {}, {}", d, dv, block_m, block_n, stages);
  if (head_d != d || head_dv != dv) text += fmt::format(", {}, {}", head_d, head_dv);
  return text;
}

std::string FlashAttentionTile::heads() const {
  auto head = [](int size, int tile) {
    return size == tile ? std::to_string(size) : fmt::format("{} (padded to {})", size, tile);
  };
  return head(head_d, d) +
         (head_dv == head_d && dv == d ? std::string() : fmt::format(" (values {})", head(head_dv, dv)));
}

std::string FlashAttentionTile::describe() const {
  const std::string split =
      splits > 1 ? fmt::format(", split-KV {} ways ({} key tiles each)", splits, tiles_per_split) : std::string();
  if (hopper)
    return fmt::format("sm_90a: TMA and wgmma, {} query rows a block (a producer warpgroup, two consumers), {} keys a "
                       "step, {} stages, heads of {}{}",
                       block_m, block_n, stages, heads(), split);
  return fmt::format("{} query rows a block ({} warps), {} keys a step, {} stages, heads of {}{}{}", block_m,
                     block_m / 16, block_n, stages, heads(), f32_note(), split);
}

// Whether the forward on `tile` (part 1's choice) runs on the Hopper kernel
// instead (templates/softmax_flash_sm90.cuh): sm_90a, 16-bit, heads of up to
// 256 (q's and k's, v's), sizes a TMA coordinate holds. `why` says why not.
// Where it applies, the caller pads heads to whole tiles of 64
// (hopper_head_tiles) and takes its own split-KV decision for its tiles.
// The backward pass (`backward`: task `op_task` is the softmax_backward)
// the same, on cg_flash_attention_backward_sm90.
static bool hopper_flash_applies(const Program& program, int op_task, const FlashAttentionTile& tile,
                                 const Target& target, int64_t Tq, int64_t Tk, int64_t heads, std::string& why,
                                 bool backward = false) {
  const std::optional<Arch> arch = parse_arch(target.arch);
  if (!arch || !arch->has_wgmma()) return why = target.arch + " has no wgmma (sm_90a has)", false;
  const OpSignature& op = *program.tasks[size_t(op_task)].op;
  const std::vector<const char*> forward_variants = {"cg_flash_attention_sm90", "cg_flash_attention_split_sm90",
                                                     "cg_flash_sm90_config"},
                                 backward_variants = {"cg_flash_attention_backward_sm90", "cg_flash_backward_sm90_config"};
  for (const char* variant : backward ? backward_variants : forward_variants)
    if (op.closure_of(variant) == nullptr)
      return why = fmt::format("op '{}' has no Hopper kernel (variant {})", op.name, variant), false;
  if (tile.element_bytes() != 2) return why = "f32 q, k and v (the Hopper kernel takes 16-bit ones)", false;
  if (std::max(tile.head_d, tile.head_dv) > 256) return why = "heads of up to 256 values", false;
  if (Tq >= (int64_t(1) << 31) || Tk >= (int64_t(1) << 31) || heads >= (int64_t(1) << 31))
    return why = "a length or head count over 2^31 (a TMA coordinate)", false;
  return true;
}

// The narrowest tile of 16, 32, 64, 128 or 256 values that holds a head of `size`.
static int head_tile(int64_t size) {
  return size <= 16 ? 16 : size <= 32 ? 32 : size <= 64 ? 64 : size <= 128 ? 128 : 256;
}

// Split-KV where the blocks of `tile` (its row tiles of `heads` heads) are
// fewer than `target_blocks`: as many splits as bring them closest to that,
// each of at least kMinKeyTilesPerSplit key tiles; none where that is one.
static void split_keys(FlashAttentionTile& tile, int64_t heads, int64_t Tq, int64_t Tk, int64_t target_blocks) {
  const int64_t blocks = heads * ((Tq + tile.block_m - 1) / tile.block_m);
  const int64_t key_tiles = (Tk + tile.block_n - 1) / tile.block_n;
  const int64_t most = std::min<int64_t>(
      {kMaxKeySplits, target_blocks / std::max<int64_t>(blocks, 1), key_tiles / kMinKeyTilesPerSplit});
  tile.splits = 1;
  tile.tiles_per_split = 0;
  if (most >= 2) {
    tile.tiles_per_split = (key_tiles + most - 1) / most;
    tile.splits = int((key_tiles + tile.tiles_per_split - 1) / tile.tiles_per_split);  // none empty
  }
}

// The Hopper kernels' tiles are 128-byte swizzle rows of 64 values, 64 or
// 128 of them (the heads' up to 128, as part 1's tiles) or, over 128, the
// forward's the head's own rounded up to 64 (192 or 256), the backward's 256
// and the other tile at least 128 (a key block sums half of each: whole
// boxes of 64); the columns past a head arrive as zeros (TMA fills them),
// their products wasted (half of q k^T's and p v's at heads of 32) but the
// copies, the softmax and the stores the head's own. Over heads of 128 a
// step is 64 keys (the forward) or 32 rows (the backward).
static void hopper_head_tiles(FlashAttentionTile& tile, bool backward) {
  const bool wide = std::max(tile.head_d, tile.head_dv) > 128;
  auto width = [&](int head, int part1) {
    if (!wide) return std::max(part1, 64);
    if (backward) return head > 128 ? 256 : 128;
    return head > 128 ? (head + 63) / 64 * 64 : std::max(part1, 64);
  };
  tile.d = width(tile.head_d, tile.d);
  tile.dv = width(tile.head_dv, tile.dv);
  tile.block_m = 128;
  tile.block_n = backward ? (wide ? 32 : 64) : (wide ? 64 : 128);
}

std::optional<FlashAttentionTile> flash_attention_tile_of(const Program& program, int scores, int softmax, bool megakernel,
                                                          std::string* why_not, const Target& target, bool trained,
                                                          bool allow_tf32) {
  auto refuse = [&](std::string why) -> std::optional<FlashAttentionTile> {
    if (why_not != nullptr) *why_not = std::move(why);
    return std::nullopt;
  };
  if (megakernel) return refuse("a megakernel's tiles share one block size");
  const BoundTask& st = program.tasks[size_t(scores)];
  // (fuse.cpp's rule attention: an add of a bias between the scores and the softmax.)
  const bool biased = program.tasks[size_t(softmax)].find_tensor("x")->buffer != st.find_tensor("out")->buffer;
  if (biased && trained)
    return refuse("a bias (an attention mask) is added to the scores, which the flash backward kernel does not take "
                  "yet");
  const BufferInfo& q = program.buffers[size_t(st.find_tensor("a")->buffer)];
  const BufferInfo& k = program.buffers[size_t(st.find_tensor("b")->buffer)];
  const int probs = program.tasks[size_t(softmax)].find_tensor("out")->buffer;
  // The probabilities' readers: the matmul by the values alone (and,
  // trained, their gradients' tasks in a later phase).
  const Phase phase = program.tasks[size_t(softmax)].task->phase;
  auto gradient_reader = [&](size_t t, const BoundTensor& b) {
    const BoundTask& r = program.tasks[t];
    return trained && r.task->phase != phase &&
           ((is_op(r, BundledOp::softmax_backward) && b.name == "out") ||
            (is_op(r, BundledOp::matmul) && b.name == "a" && flag_value(root_arg(program, int(t), "trans_a").second)));
  };
  int values = -1;
  for (size_t t = 0; t < program.tasks.size(); ++t)
    for (const auto& b : program.tasks[t].tensors)
      if (b.buffer == probs && int(t) != softmax && !gradient_reader(t, b)) {
        if (values >= 0 && values != int(t))
          return refuse(fmt::format("the probabilities '{}' are read by '{}' too: the flash kernel never "
                                    "stores them",
                                    buffer_name(program, probs), program.tasks[t].task->id));
        values = int(t);
      }
  if (values < 0 || !is_op(program.tasks[size_t(values)], BundledOp::matmul) ||
      program.tasks[size_t(values)].find_tensor("a")->buffer != probs)
    return refuse("the probabilities are not multiplied by the values");
  if (program.buffers[size_t(probs)].storage != Storage::transient &&
      !(trained && program.buffers[size_t(probs)].storage == Storage::saved))
    return refuse(fmt::format("the probabilities '{}' are stored (an output of the graph)", buffer_name(program, probs)));
  const BufferInfo& v = program.buffers[size_t(program.tasks[size_t(values)].find_tensor("b")->buffer)];
  // f32: as TF32 where allowed; otherwise, trained, exact on CUDA cores (the
  // pair of flash kernels keeps the training step's memory linear in T,
  // where the row kernels store the probabilities); untrained, the row kernel.
  const bool tf32 = allow_tf32 && q.dtype == DType::f32, simt_f32 = !tf32 && trained && q.dtype == DType::f32;
  if ((q.dtype != DType::f16 && q.dtype != DType::bf16 && !tf32 && !simt_f32) || k.dtype != q.dtype ||
      v.dtype != q.dtype)
    return refuse(fmt::format("q, k and v are {}, {} and {}: the tensor-core kernel takes one 16-bit type (f32 keeps its "
                              "f32 arithmetic in the row kernel{})",
                              to_string(q.dtype), to_string(k.dtype), to_string(v.dtype),
                              q.dtype != DType::f32 ? "" : "; --allow-tf32 runs it as TF32"));
  // Grouped-query attention: k's and v's leading axes those of q, or 1 where
  // a group of q's heads shares one head of keys and values.
  const Shape lead_q(q.shape.begin(), q.shape.end() - 2), lead_k(k.shape.begin(), k.shape.end() - 2),
      lead_v(v.shape.begin(), v.shape.end() - 2);
  if (lead_k.size() != lead_q.size() || lead_v != lead_k)
    return refuse(fmt::format("k's and v's leading axes ({} and {}) are not one shape of q's rank ({})",
                              shape_to_string(lead_k), shape_to_string(lead_v), shape_to_string(lead_q)));
  if (!shared_by_groups(q.shape, k.shape))
    return refuse(fmt::format("k's leading axes {} do not broadcast to q's {}", shape_to_string(lead_k),
                              shape_to_string(lead_q)));
  FlashAttentionTile tile;
  for (int64_t size : {q.shape.back(), v.shape.back()})
    if (size % 8 != 0 || size > 256)
      return refuse(fmt::format("a head of {} values: the flash kernel takes heads of a multiple of 8 values up to 256",
                                size));
  tile.head_d = int(q.shape.back());
  tile.head_dv = int(v.shape.back());
  tile.d = head_tile(tile.head_d);
  tile.dv = head_tile(tile.head_dv);
  // Heads over 128: o's accumulators take DV / 2 registers a thread, and q's
  // fragments stay in shared memory (cg_flash_config::Q_IN_SHARED); 32 keys a
  // step keep the scores at 16 registers and the stages at 64 KiB (96 KiB
  // with q's tile: under the 99 KiB of sm_86 and sm_89).
  if (std::max(tile.d, tile.dv) > 128) {
    // (A step of 32 rows of a head of 16 is 64 16-byte chunks, fewer than
    // the block's 128 copying threads.)
    if (std::min(tile.d, tile.dv) < 32)
      return refuse(fmt::format("heads of {} with values of {}: over 128 the flash kernel streams 32 keys a step, "
                                "which takes heads of at least 32 beside it",
                                tile.head_d, tile.head_dv));
    tile.block_n = 32;
  }
  // TF32 and f32 on CUDA cores: 4-byte elements. Tiles of 32 to 128 (the
  // tiles read by 32-bit loads are swizzled for rows of 8 chunks or more);
  // over 64, 32 keys a step keep the stages at 64 KiB (96 KiB with q's tile).
  // Narrower heads stay on the row kernels, whose training keeps the
  // probabilities of up to 128 query rows, a head's [128, Tk]; trained past
  // those, they are padded to 32 here, so that no [Tq, Tk] is stored.
  tile.tf32 = tf32;
  tile.simt_f32 = simt_f32;
  const bool four_bytes = tile.element_bytes() == 4;
  const int64_t Tq = q.shape[q.shape.size() - 2], Tk = k.shape[k.shape.size() - 2];
  if (four_bytes && std::min(tile.d, tile.dv) < 32 && trained && Tq > kRowKernelTrainedQueryRows) {
    tile.d = std::max(tile.d, 32);
    tile.dv = std::max(tile.dv, 32);
  }
  if (four_bytes && (std::min(tile.d, tile.dv) < 32 || std::max(tile.d, tile.dv) > 128))
    return refuse(fmt::format("heads of {} (values {}) in f32: the {} kernel takes heads of 32 to 128{}", tile.head_d,
                              tile.head_dv, tf32 ? "TF32" : "f32 flash",
                              std::max(tile.d, tile.dv) > 128 ? ""
                                                              : fmt::format(" (narrower ones padded to 32 where trained "
                                                                            "past {} query rows)",
                                                                            kRowKernelTrainedQueryRows)));
  if (four_bytes && std::max(tile.d, tile.dv) > 64) tile.block_n = 32;
  split_keys(tile, numel(lead_q), Tq, Tk, kFlashBlocksPerSm * device_model(target).sms);
  if (std::string why_not_hopper;
      biased || !hopper_flash_applies(program, softmax, tile, target, Tq, Tk, numel(lead_q), why_not_hopper)) {
    if (biased) why_not_hopper = "a bias (an attention mask) is added to the scores, which it does not take yet";
    const std::optional<Arch> arch = parse_arch(target.arch);
    if (arch && arch->has_wgmma()) tile.why_not_hopper = why_not_hopper;
  } else {
    tile.hopper = true;
    hopper_head_tiles(tile, false);
    tile.stages = 2;
    tile.min_blocks_per_sm = 1;
    split_keys(tile, numel(lead_q), Tq, Tk, kHopperFlashBlocksPerSm * device_model(target).sms);
  }
  return tile;
}

std::optional<FlashAttentionTile> flash_backward_tile_of(const Program& program, FlashTraining& roles, bool megakernel,
                                                         std::string* why_not, const Target& target, bool atomic_dq,
                                                         bool allow_tf32) {
  auto refuse = [&](std::string why) -> std::optional<FlashAttentionTile> {
    if (why_not != nullptr) *why_not = std::move(why);
    return std::nullopt;
  };
  auto buffer = [&](int t, const char* slot) { return program.tasks[size_t(t)].find_tensor(slot)->buffer; };
  auto owner = [&](int b) { return program.buffers[size_t(b)].owner_task; };
  const int probs = buffer(roles.ds, "out");
  const int softmax = owner(probs);
  if (softmax < 0 || !is_op(program.tasks[size_t(softmax)], BundledOp::softmax))
    return refuse(fmt::format("'{}' is not a softmax's output", buffer_name(program, probs)));
  const int scores = owner(buffer(softmax, "x"));
  if (scores < 0 || !is_op(program.tasks[size_t(scores)], BundledOp::matmul) ||
      !flag_value(root_arg(program, scores, "trans_b").second) || flag_value(root_arg(program, scores, "trans_a").second))
    return refuse(fmt::format("the softmax '{}' is not over a product q k^T", program.tasks[size_t(softmax)].task->id));
  std::string why;
  std::optional<FlashAttentionTile> forward =
      flash_attention_tile_of(program, scores, softmax, megakernel, &why, target, true, allow_tf32);
  if (!forward) return refuse("its forward does not take the flash kernel: " + why);
  int values = -1;
  for (size_t t = 0; t < program.tasks.size(); ++t)
    if (int(t) != softmax && program.tasks[t].task->phase == program.tasks[size_t(softmax)].task->phase)
      for (const auto& b : program.tasks[t].tensors)
        if (b.buffer == probs && b.name == "a") values = int(t);
  const int q = buffer(scores, "a"), k = buffer(scores, "b");
  // Both kinds of block recompute s = q k^T: the backward pass must read q
  // and k itself (dk and dq), or nothing would keep them alive until it runs.
  if (roles.dq < 0 || roles.dk < 0)
    return refuse(fmt::format("it recomputes the scores from q and k, but the backward pass has no {} to read {}",
                              roles.dq < 0 ? "dq" : "dk", roles.dq < 0 ? "k" : "q"));
  // The probabilities are stored nowhere: every reader must be in one of the two kernels.
  for (size_t t = 0; t < program.tasks.size(); ++t)
    for (const auto& b : program.tasks[t].tensors)
      if (b.buffer == probs && int(t) != softmax && int(t) != values && int(t) != roles.ds && int(t) != roles.dv)
        return refuse(fmt::format("'{}' reads the probabilities too, which the flash kernels never store",
                                  program.tasks[t].task->id));
  if (values < 0 || buffer(roles.dp, "b") != buffer(values, "b"))
    return refuse(fmt::format("'{}' does not multiply by the attention's values", program.tasks[size_t(roles.dp)].task->id));
  if (roles.dq >= 0 && buffer(roles.dq, "b") != k)
    return refuse(fmt::format("'{}' does not multiply by the attention's keys", program.tasks[size_t(roles.dq)].task->id));
  if (roles.dk >= 0 && buffer(roles.dk, "b") != q)
    return refuse(fmt::format("'{}' does not multiply by the attention's queries", program.tasks[size_t(roles.dk)].task->id));
  const BufferInfo& dcontext = program.buffers[size_t(buffer(roles.dp, "a"))];
  if (dcontext.dtype != program.buffers[size_t(q)].dtype)
    return refuse(fmt::format("'{}' is {}, not q's {}", buffer_name(program, buffer(roles.dp, "a")), to_string(dcontext.dtype),
                              to_string(program.buffers[size_t(q)].dtype)));
  // (Grouped-query attention, k and v shared by a group of q's heads, as the
  // forward's tile took it: each query head's blocks read its group's keys
  // and values, and dk and dv are each query head's, [..., G, Tk, D], which
  // the derive pass sums over the group after the kernel.)
  roles.scores = scores;
  roles.softmax = softmax;
  roles.values = values;
  FlashAttentionTile tile = *forward;
  // (The forward's Hopper tile pads heads under 64; part 1's backward takes
  // the narrowest again, and the Hopper check below pads them anew.)
  if (tile.hopper) {
    tile.d = head_tile(tile.head_d);
    tile.dv = head_tile(tile.head_dv);
  }
  tile.hopper = false;
  tile.why_not_hopper.clear();
  tile.splits = 1;
  tile.tiles_per_split = 0;
  tile.block_m = kFlashBackwardBlockRows;
  tile.stages = 2;
  // 32 rows a step: at heads of 64 the kernel fits 160 registers, 3 blocks a SM
  // (12 warps; 64 rows a step took 220, 2 blocks, and ran 5% slower on an H200:
  // bench/RESULTS.md); at heads over 64, dk and dv of 16 rows of 128 each leave no
  // room for more. The atomic mode's ds^T tile is square: 64 rows a step at heads
  // of up to 64, 16-bit.
  const bool wide = std::max(tile.d, tile.dv) > 64;
  tile.atomic_dq = atomic_dq && !wide && tile.element_bytes() == 2;
  // (Heads of 16: a step of 32 rows is 64 16-byte chunks, fewer than the
  // block's 128 threads, which copy a tile in equal shares: 64 rows.)
  tile.block_n = tile.atomic_dq || std::min(tile.d, tile.dv) < 32 ? 64 : 32;
  tile.min_blocks_per_sm = wide || tile.atomic_dq ? 1 : 3;
  // Over heads of 128 (16-bit: the forward's tile takes 4-byte ones up to
  // 128), each tile of keys takes two blocks, each with half of dk's and dv's
  // columns (cg_flash_config::KEY_SPLIT), and 16 rows a step keep the kernel
  // at 96 KiB of shared memory (the block's own rows take 64 KiB). Beside a
  // head of 32 (the other of q k and v), 16 of its rows are 64 16-byte chunks,
  // fewer than the block's 128 copying threads: 32 rows (72 KiB in all).
  if (std::max(tile.d, tile.dv) > 128) tile.block_n = std::min(tile.d, tile.dv) >= 64 ? 16 : 32;
  // TF32 and exact f32 (4-byte elements): the block's own rows take twice the
  // bytes; over heads of 64, 16 rows a step keep the kernel at 96 KiB of shared
  // memory (under sm_86's and sm_89's 99 KiB), and 2 blocks a SM at 64.
  if (tile.element_bytes() == 4) {
    if (wide) tile.block_n = 16;
    tile.min_blocks_per_sm = wide ? 1 : 2;
  }
  // sm_90a: the Hopper kernel (templates/softmax_flash_sm90.cuh) where it
  // takes the heads, 128 own rows a block and 64 streamed a step (32 over
  // heads of 128, where each tile of keys takes two key blocks:
  // hopper_head_tiles). It has no atomic mode: deterministic, its query
  // blocks sum dq.
  const BufferInfo& qb = program.buffers[size_t(q)];
  const Shape& kb = program.buffers[size_t(k)].shape;
  const int64_t Tq = qb.shape[qb.shape.size() - 2], Tk = kb[kb.size() - 2];
  const int64_t heads = numel(qb.shape) / (Tq * qb.shape.back());
  if (std::string why_not_hopper;
      !hopper_flash_applies(program, roles.ds, tile, target, Tq, Tk, heads, why_not_hopper, true)) {
    const std::optional<Arch> arch = parse_arch(target.arch);
    if (arch && arch->has_wgmma()) tile.why_not_hopper = why_not_hopper;
  } else {
    tile.hopper = true;
    hopper_head_tiles(tile, true);
    tile.atomic_dq = false;
    tile.stages = 2;
    tile.min_blocks_per_sm = 1;
  }
  return tile;
}

AttentionShared attention_shared(int64_t per_block, int64_t Tk, int64_t D, int64_t Dv, bool kv_computed,
                                 const std::vector<AttentionProjectionShared>& projections, int64_t weight_floats) {
  AttentionShared s;
  const int64_t scratch = D + Tk, staged = Tk * (D + Dv);
  s.rows = s.layout.add(fmt::format("each warp's query row and scores ({} x {} floats)", per_block, scratch),
                        per_block * scratch * 4);
  if (kv_computed || ((per_block * scratch + staged) * 4 <= kSharedBytesWithoutOptIn && per_block > 1))
    s.keys = s.layout.add(fmt::format("the head's keys and values ({} x {} floats)", Tk, D + Dv), staged * 4);
  for (const AttentionProjectionShared& p : projections) {
    if (p.source >= 0 && !s.sources.count(p.source)) s.sources[p.source] = s.layout.add(p.source_what, 4 * p.source_floats);
    if (p.q_floats > 0) s.queries = s.layout.add(p.q_what, 4 * p.q_floats);
    if (s.weights < 0)
      s.weights = s.layout.add(fmt::format("a projection's weight columns of one head ({} floats)", weight_floats),
                               4 * weight_floats);
  }
  return s;
}

int launch_count(const std::vector<KernelGroup>& kernels) {
  int n = 0;
  for (const auto& k : kernels) n = std::max(n, k.launch + 1);
  return n;
}

std::vector<std::vector<int>> kernel_buffers(const Program& program, const std::vector<KernelGroup>& kernels) {
  std::vector<std::vector<int>> out;
  for (const auto& k : kernels) {
    std::vector<int> buffers;
    for (int t : kernel_tasks(k))
      for (const auto& bound : program.tasks[size_t(t)].tensors)
        if (bound.buffer >= 0 && !contains(k.internal_buffers, bound.buffer)) buffers.push_back(bound.buffer);
    std::sort(buffers.begin(), buffers.end());
    buffers.erase(std::unique(buffers.begin(), buffers.end()), buffers.end());
    out.push_back(std::move(buffers));
  }
  return out;
}

std::string GemmTile::arguments() const {
  return fmt::format("{}, {}, {}, {}, {}, {}", bm, bn, bk, warps_m, warps_n, stages);
}

std::string GemmTile::describe() const {
  std::string text = fmt::format("{} x {} x {} tiles{}, {} x {} warps, {} stages", bm, bn, bk, tf32() ? " (TF32)" : "",
                                 warps_m, warps_n, stages);
  if (split_k > 1)
    text += fmt::format(", split-K {} ways ({} k-tiles each)", split_k, k_tiles_per_split);
  return text;
}

std::vector<GemmTuningRule> parse_gemm_tuning(std::string_view text, const std::string& origin) {
  auto bad = [&](const std::string& where, const std::string& why) {
    return std::runtime_error(fmt::format("{}: {}: {}", origin, where, why));
  };
  JsonValue root;
  try {
    root = parse_json(text);
  } catch (const JsonSyntaxError& e) {
    throw bad(fmt::format("line {}, column {}", e.loc.line, e.loc.column), e.message);
  }
  const JsonValue* format = root.find("format");
  if (format == nullptr || format->as_string() != "cudagen.gemm-tuning/1")
    throw bad("/format", "not \"cudagen.gemm-tuning/1\"");
  const JsonValue* rules = root.find("rules");
  if (rules == nullptr || !rules->is_array() || rules->items().empty()) throw bad("/rules", "a non-empty list of rules");
  // The tiles the mainloop is known to compile without spills, and that fit
  // the shared memory a kernel may opt in to: 16-bit ones, and TF32 ones
  // (half the k for the same bytes; the large tile on 8 warps, whose
  // accumulators leave room for the fragments' rounding).
  const std::vector<std::array<int, 6>> known_16bit = {{64, 64, 32, 2, 2, 4}, {128, 128, 64, 2, 2, 3}};
  const std::vector<std::array<int, 6>> known_tf32 = {{64, 64, 16, 2, 2, 4}, {128, 128, 32, 2, 4, 3}};
  std::vector<GemmTuningRule> out;
  for (size_t i = 0; i < rules->items().size(); ++i) {
    const JsonValue& r = rules->items()[i];
    const std::string at = fmt::format("/rules/{}", i);
    GemmTuningRule rule;
    const JsonValue* arch = r.find("arch");
    rule.arch = arch != nullptr ? arch->as_string() : "";
    if (rule.arch != "any" && (!parse_arch(rule.arch) || parse_arch(rule.arch)->specific))
      throw bad(at + "/arch", "\"any\" or an architecture family such as \"sm_90\" (a rule for sm_90 holds for sm_90a)");
    if (const JsonValue* operands = r.find("operands")) {
      const std::string kind = operands->as_string();
      if (kind != "16-bit" && kind != "tf32") throw bad(at + "/operands", "\"16-bit\" (f16, bf16) or \"tf32\"");
      rule.tf32 = kind == "tf32";
    }
    if (const JsonValue* w = r.find("min_waves")) rule.min_waves = w->as_int();
    if (rule.min_waves < 0) throw bad(at + "/min_waves", "at least 0");
    const JsonValue* tile = r.find("tile");
    std::array<int, 6> t{};
    if (tile == nullptr || !tile->is_array() || tile->items().size() != 6)
      throw bad(at + "/tile", "[BM, BN, BK, WARPS_M, WARPS_N, STAGES]");
    for (size_t k = 0; k < 6; ++k) t[k] = int(tile->items()[k].as_int());
    const std::vector<std::array<int, 6>>& known = rule.tf32 ? known_tf32 : known_16bit;
    if (std::find(known.begin(), known.end(), t) == known.end())
      throw bad(at + "/tile", fmt::format("[{}] is not a tile the mainloop is checked for with {} operands ([{}] or [{}])",
                                          fmt::join(t, ", "), rule.tf32 ? "TF32" : "16-bit", fmt::join(known[0], ", "),
                                          fmt::join(known[1], ", ")));
    rule.tile = GemmTile{t[0], t[1], t[2], t[3], t[4], t[5], rule.tf32 ? 4 : 2, int(i)};
    if (const JsonValue* split = r.find("max_split_k")) {
      const int64_t most = split->as_int();
      if (most < 1 || most > kMaxSplitK)
        throw bad(at + "/max_split_k", fmt::format("{} is not between 1 and {}", most, kMaxSplitK));
      rule.max_split_k = int(most);
    }
    if (const JsonValue* why = r.find("why")) rule.why = why->as_string();
    out.push_back(std::move(rule));
  }
  for (bool tf32 : {false, true}) {
    // The last rule of each kind of operands matches every product.
    const auto last = std::find_if(out.rbegin(), out.rend(), [&](const GemmTuningRule& r) { return r.tf32 == tf32; });
    const char* kind = tf32 ? "tf32" : "16-bit";
    if (last == out.rend())
      throw bad("/rules", fmt::format("no rule for {} operands: end them with one that matches every product", kind));
    if (last->arch != "any" || last->min_waves != 0)
      throw bad(fmt::format("/rules/{}", last->tile.rule),
                fmt::format("the last rule for {} operands matches every product: arch \"any\", no min_waves", kind));
  }
  return out;
}

std::optional<GemmTile> pipelined_gemm_tile(DType a, DType b, int64_t M, int64_t N, int64_t K, bool trans_a,
                                            bool trans_b, int64_t batches, const Target& target,
                                            std::string* why_not, bool allow_tf32) {
  auto refuse = [&](std::string why) -> std::optional<GemmTile> {
    if (why_not != nullptr) *why_not = std::move(why);
    return std::nullopt;
  };
  const bool tf32 = a == DType::f32 && b == DType::f32 && allow_tf32;
  if (a == DType::f32 && b == DType::f32 && !allow_tf32)
    return refuse("its operands are f32, which stays off tensor cores unless TF32 is allowed (--allow-tf32)");
  if (!tf32 && ((a != DType::f16 && a != DType::bf16) || b != a))
    return refuse("its operands are not both f16, both bf16, or both f32 with TF32 allowed");
  // 16-byte copies: every row of each operand starts on a 16-byte boundary (the arena aligns each buffer to 256).
  const int64_t a_contiguous = trans_a ? M : K, b_contiguous = trans_b ? K : N, chunk = tf32 ? 4 : 8;
  if (a_contiguous % chunk != 0 || b_contiguous % chunk != 0)
    return refuse(fmt::format("its operands' contiguous axes ({} of a, {} of b) are not multiples of {} elements (16 bytes)",
                              a_contiguous, b_contiguous, chunk));
  // Parsed once; a bundled table that does not parse is a build error, which the tests catch.
  static const std::vector<GemmTuningRule> table = parse_gemm_tuning(gemm_tuning_json(), "templates/gemm_tuning.json");
  const int64_t sms = device_model(target).sms;
  const std::string family = arch_or_throw(target.arch, "the target architecture").family();  // sm_90 rules hold for sm_90a
  // Full waves of 128 x 128 tiles: as many blocks as the SMs hold, at one block an SM.
  const int64_t large_tiles = (M + 127) / 128 * ((N + 127) / 128) * batches, waves = large_tiles / sms;
  for (const GemmTuningRule& rule : table)
    if (rule.tf32 == tf32 && (rule.arch == "any" || rule.arch == family) && waves >= rule.min_waves)
      return with_split_k(rule.tile, rule.max_split_k, M, N, K, batches, sms);
  return refuse("no rule of the tuning table matches");  // unreachable: the last rule matches everything
}

GemmTile with_split_k(GemmTile tile, int max_split_k, int64_t M, int64_t N, int64_t K, int64_t batches, int64_t sms) {
  const int64_t blocks = (M + tile.bm - 1) / tile.bm * ((N + tile.bn - 1) / tile.bn) * batches;
  const int64_t k_tiles = (K + tile.bk - 1) / tile.bk;
  // As many parts as fit one wave beside the tiles, each of enough k-tiles to fill its pipeline.
  const int64_t most = std::min({int64_t(max_split_k), sms / std::max<int64_t>(blocks, 1), k_tiles / kMinKTilesPerSplit});
  if (most < 2) return tile;
  // Equal parts: the fewest k-tiles per part that `most` parts cover, then the parts that takes.
  tile.k_tiles_per_split = (k_tiles + most - 1) / most;
  tile.split_k = int((k_tiles + tile.k_tiles_per_split - 1) / tile.k_tiles_per_split);
  return tile;
}

BatchNormNhwcSplit batchnorm_nhwc_split(const Program& program, int task, const Target& target, bool megakernel) {
  const BoundTask& bt = program.tasks[size_t(task)];
  const BoundTensor* x = bt.find_tensor("x");
  const BufferInfo& b = program.buffers[size_t(x->buffer)];
  BatchNormNhwcSplit s;
  s.channels = b.shape.back();
  s.pixels = numel(b.shape) / s.channels;
  // The widest access of at most 16 bytes that C channels divide into.
  s.vector = int(16 / dtype_bytes(b.dtype));
  while (s.channels % s.vector != 0) s.vector /= 2;
  const int64_t vectors = s.channels / s.vector;
  while (s.lanes < 32 && s.lanes < vectors) s.lanes *= 2;
  s.chunks = (vectors + s.lanes - 1) / s.lanes;
  s.per_split = s.pixels;
  if (megakernel) return s;  // (no workspace there)
  // Two blocks an SM, each row of threads walking at least 8 pixels.
  const int64_t blocks = 2 * device_model(target).sms;
  const int64_t most = std::max<int64_t>(1, s.pixels / (8 * s.rows()));
  s.splits = std::clamp<int64_t>((blocks + s.chunks - 1) / s.chunks, 1, most);
  s.per_split = (s.pixels + s.splits - 1) / s.splits;
  s.splits = (s.pixels + s.per_split - 1) / s.per_split;  // none empty
  return s;
}

DgradClasses dgrad_classes(int64_t images, int64_t H, int64_t W, int64_t KH, int64_t KW, int64_t stride_h,
                           int64_t stride_w, int64_t padding_h, int64_t padding_w, int64_t dilation_h,
                           int64_t dilation_w) {
  DgradClasses c;
  if ((stride_h == 1 && stride_w == 1) || dilation_h != 1 || dilation_w != 1) {
    c.pixels = images * H * W, c.taps = KH * KW;
    return c;
  }
  c.count = stride_h * stride_w;
  // Along one axis, class r: its first pixel, its pixels, its taps.
  auto axis = [](int64_t r, int64_t size, int64_t kernel, int64_t stride, int64_t padding) {
    const int64_t first = ((r - padding) % stride + stride) % stride;
    return std::pair{first < size ? (size - first + stride - 1) / stride : 0,
                     r < kernel ? (kernel - r + stride - 1) / stride : 0};
  };
  for (int64_t rh = 0; rh < stride_h; ++rh)
    for (int64_t rw = 0; rw < stride_w; ++rw) {
      const auto [rows, tap_rows] = axis(rh, H, KH, stride_h, padding_h);
      const auto [cols, tap_cols] = axis(rw, W, KW, stride_w, padding_w);
      c.pixels = std::max(c.pixels, images * rows * cols);
      c.taps = std::max(c.taps, tap_rows * tap_cols);
    }
  return c;
}

MatmulDims matmul_dims(const Program& program, int t) {
  const BoundTask& task = program.tasks[size_t(t)];
  if (is_convolution_gemm(task)) {  // one group's implicit GEMM (templates/vision.cuh)
    const Shape& sx = program.buffers[size_t(task.find_tensor("x")->buffer)].shape;  // [B, H, W, C]
    const Shape& sw = program.buffers[size_t(task.find_tensor("weight")->buffer)].shape;  // [O, KH, KW, CG]
    const int64_t groups = std::max<int64_t>(1, int64_t(number_value(root_arg(program, t, "groups").second, 1)));
    const int64_t OG = sw[0] / groups, taps = sw[1] * sw[2], CG = sw[3];
    MatmulDims d;
    d.batches = groups;
    if (is_op(task, BundledOp::conv2d_nhwc)) {
      const Shape& so = program.buffers[size_t(task.find_tensor("out")->buffer)].shape;
      d.M = so[0] * so[1] * so[2], d.N = OG, d.K = taps * CG;
      d.trans_b = true;  // the weight: N x K, K contiguous
    } else if (is_op(task, BundledOp::conv2d_nhwc_backward_data)) {
      // dx's pixels (a class of them where the stride splits it); the weight K x N.
      auto arg = [&](const char* name, int64_t fallback) {
        return int64_t(number_value(root_arg(program, t, name).second, double(fallback)));
      };
      const DgradClasses classes =
          dgrad_classes(sx[0], sx[1], sx[2], sw[1], sw[2], arg("stride_h", 1), arg("stride_w", 1), arg("padding_h", 0),
                        arg("padding_w", 0), arg("dilation_h", 1), arg("dilation_w", 1));
      d.M = classes.pixels, d.N = CG, d.K = classes.taps * OG;
      d.batches = groups * classes.count;
    } else {
      const Shape& sd = program.buffers[size_t(task.find_tensor("dout")->buffer)].shape;
      d.M = OG, d.N = taps * CG, d.K = sd[0] * sd[1] * sd[2];  // over dout's pixels
      d.trans_a = true;  // dout: K x M, output channels contiguous
    }
    return d;
  }
  const Shape& sa = program.buffers[size_t(task.find_tensor("a")->buffer)].shape;
  const Shape& sb = program.buffers[size_t(task.find_tensor("b")->buffer)].shape;
  const Shape& so = program.buffers[size_t(task.find_tensor("out")->buffer)].shape;
  MatmulDims d;
  d.trans_a = flag_value(root_arg(program, t, "trans_a").second);
  d.trans_b = flag_value(root_arg(program, t, "trans_b").second);
  d.M = so[so.size() - 2];
  d.batches = numel(Shape(so.begin(), so.end() - 2));
  if (matmul_flattens_rows(sa, sb, so, d.trans_a)) {
    d.M *= d.batches;
    d.batches = 1;
  }
  d.N = so.back();
  d.K = d.trans_a ? sa[sa.size() - 2] : sa.back();
  return d;
}

std::optional<GemmTile> pipelined_gemm_tile_of(const Program& program, int t, const Target& target,
                                               std::string* why_not, bool allow_tf32) {
  const BoundTask& task = program.tasks[size_t(t)];
  // A user's matmul op runs its own function unless it provides the mainloop.
  for (const char* variant : {"cg_gemm_mainloop", "cg_gemm_each_coalesced", "cg_gemm_config"})
    if (task.op->closure_of(variant) == nullptr) {
      if (why_not != nullptr)
        *why_not = fmt::format("op '{}' has no pipelined mainloop (variant {})",
                               task.op->name, variant);
      return std::nullopt;
    }
  const MatmulDims d = matmul_dims(program, t);
  std::optional<GemmTile> tile =
      pipelined_gemm_tile(program.buffers[size_t(task.find_tensor("a")->buffer)].dtype,
                          program.buffers[size_t(task.find_tensor("b")->buffer)].dtype, d.M, d.N, d.K, d.trans_a,
                          d.trans_b, d.batches, target, why_not, allow_tf32);
  if (tile && tile->split_k > 1 && task.op->closure_of("cg_gemm_split_k") == nullptr) {
    tile->split_k = 1;  // an op without the split-K epilogue runs its tiles whole
    tile->k_tiles_per_split = 0;
  }
  return tile;
}

int64_t shared_bytes_with_opt_in(const std::string& arch) {
  const std::optional<Arch> a = parse_arch(arch);
  if (a && (a->major == 9 || a->major == 10)) return 227 * 1024;
  if (a && a->major == 8 && (a->minor == 0 || a->minor == 7)) return 163 * 1024;
  return kSharedBytesWithOptIn;
}

int64_t HopperGemm::fixup_k_tiles(int64_t sk_k_tiles, int64_t grid) const {
  const int64_t run = std::max<int64_t>(1, sk_k_tiles / grid), contributors = (k_tiles() + run - 1) / run + 1;
  return (fixup_k_tiles() * (1 + contributors) + 2) / 3;
}

// templates/gemm_sm90.cuh's cg_sm90_schedule, for the generator (GemmSm90.
// StreamKComputesEveryKTileOnceAndAddsEachPartialTile checks the two agree).
int64_t HopperGemm::stream_k_tiles(int64_t grid) const {
  const int64_t all = tiles(), k = k_tiles();
  if (grid < 1 || k < 2 || all % grid == 0) return 0;
  const int64_t sms = std::max<int64_t>(1, grid / blocks_per_sm()), waves = all / grid;
  const int64_t sk_tiles = waves >= 2 ? all - (waves - 1) * grid : all;
  const int64_t whole = (sk_tiles + sms - 1) / sms * k,
                shared = (sk_tiles * k + sms - 1) / sms + fixup_k_tiles(sk_tiles * k, grid);
  return shared < whole ? sk_tiles : 0;
}

int64_t HopperGemm::stream_k_partial_tiles(int64_t grid) const {
  const int64_t k = k_tiles(), iterations = stream_k_tiles(grid) * k;
  int64_t partial = 0;
  for (int64_t b = 0; b < grid && iterations > 0; ++b) {
    const int64_t begin = b * iterations / grid, end = (b + 1) * iterations / grid;
    for (int64_t i = begin; i < end;) {  // the run's pieces, a tile at a time
      const int64_t piece_end = std::min(end, (i / k + 1) * k);
      partial += piece_end - i < k;
      i = piece_end;
    }
  }
  return partial;
}

std::string HopperGemm::describe() const {
  return fmt::format("{} x {} tiles ({}) on persistent blocks{}, {} consumer warpgroup{}, {} stages of 64 k, TMA and "
                     "wgmma, B {}",
                     rows(), columns, tiles(), stream_k ? ", the last by stream-K" : "", consumers, consumers == 1 ? "" : "s",
                     stages(), b_k_major ? "stored N x K" : "stored K x N (wgmma's transposed B)");
}

std::optional<HopperGemm> hopper_gemm_of(const Program& program, int t, const Target& target, bool allow_stream_k,
                                         std::string* why_not) {
  auto refuse = [&](std::string why) -> std::optional<HopperGemm> {
    if (why_not != nullptr) *why_not = std::move(why);
    return std::nullopt;
  };
  const std::optional<Arch> arch = parse_arch(target.arch);
  if (!arch || !arch->has_wgmma()) return refuse(fmt::format("{} has no wgmma (sm_90a has)", target.arch));
  const BoundTask& task = program.tasks[size_t(t)];
  for (const char* variant : {"cg_gemm_sm90", "cg_sm90_gemm_config"})
    if (task.op->closure_of(variant) == nullptr)
      return refuse(fmt::format("op '{}' has no Hopper mainloop (variant {})", task.op->name, variant));
  const DType a = program.buffers[size_t(task.find_tensor("a")->buffer)].dtype,
              b = program.buffers[size_t(task.find_tensor("b")->buffer)].dtype;
  if (a != b || (a != DType::f16 && a != DType::bf16)) return refuse("its operands are not both f16 or both bf16");
  const MatmulDims d = matmul_dims(program, t);
  if (d.trans_a) return refuse("its a is stored transposed (wgmma's transposed A is not used yet)");
  if (d.batches > 1) return refuse("b is batched (one tensor map a product)");
  if (d.M == 0 || d.N == 0 || d.K == 0) return refuse("a dimension is 0 (a tensor map has none)");
  // TMA reads rows whose strides are whole 16 bytes (8 elements).
  if (d.K % 8 != 0 || (!d.trans_b && d.N % 8 != 0))
    return refuse(fmt::format("a row of an operand is not whole 16 bytes (K {}{}), which TMA needs", d.K,
                              d.trans_b ? "" : fmt::format(", N {}", d.N)));
  if (d.M >= (int64_t(1) << 31) || d.N >= (int64_t(1) << 31) || d.K >= (int64_t(1) << 31))
    return refuse("a dimension over 2^31");
  // The tile whose busiest SM computes the least, the wider on a tie (fewer
  // operand bytes a product, fewer epilogues): 128 x 192 for a 1024 x 3072
  // product (128 tiles, one wave of 132 SMs, where 128 x 128 takes two),
  // 64 x 128 for 1024 x 768 (96 tiles where 128-row ones make 48). Not
  // 128 x 256: its 128 accumulators a thread spill under the 168 registers
  // ptxas allocates to 384 threads (setmaxnreg raises them only at run time).
  const int64_t sms = device_model(target).sms;
  HopperGemm g{d.M, d.N, d.K, d.trans_b};
  g.columns = 192;
  for (const auto& [consumers, columns] : {std::pair{2, 128}, {1, 128}}) {
    HopperGemm candidate = g;
    candidate.consumers = consumers;
    candidate.columns = columns;
    if (candidate.busiest_sm_area(sms) < g.busiest_sm_area(sms)) g = candidate;
  }
  // Stream-K where asked, on tiles of 128 columns (its fix-up's).
  g.stream_k = allow_stream_k && g.columns == 128 && g.stream_k_tiles(g.stream_k_grid(sms)) > 0;
  // Tiles for fewer than half the SMs (a decoder at a few tokens: 24 tiles
  // of 64 x 128 at 64 rows): the pipelined mainloop splits K there. From
  // half a wave on, whole Hopper tiles (the decoder's down projection at 1024
  // rows, 96 tiles: 0.029 ms on an H100, bench/RESULTS.md 2026-11-27).
  const std::optional<GemmTile> pipelined = pipelined_gemm_tile_of(program, t, target);
  if (pipelined && pipelined->split_k > 1 && 2 * g.tiles() < sms && !g.stream_k)
    return refuse(fmt::format("its {} tiles of {} x {} fill less than half a wave; the pipelined mainloop splits K {} "
                              "ways",
                              g.tiles(), g.rows(), g.columns, pipelined->split_k));
  return g;
}

std::string GemmMainloop::name() const {
  return hopper ? "Hopper" : pipelined ? "pipelined" : simt ? "SIMT" : "";
}

std::string GemmMainloop::describe() const {
  if (hopper) return "the Hopper mainloop, " + hopper->describe();
  if (pipelined) return "the pipelined mainloop, " + pipelined->describe();
  if (simt) return "the SIMT mainloop, " + simt->describe();
  return "no mainloop of its own (the 64 x 64 tile, the portable one or the op's own function): " + why_not_pipelined;
}

GemmMainloop gemm_mainloop_of(const Program& program, int t, const GemmOptions& options, const std::string& refused) {
  GemmMainloop m;
  if (!refused.empty()) {
    m.why_not_pipelined = m.why_not_hopper = refused;
    return m;
  }
  // 16-bit operands (and f32 ones with --allow-tf32) whose rows are whole
  // 16-byte chunks run the pipelined mainloop (docs/gemm.md); other f32
  // products of 2^24 FLOPs and more the SIMT mainloop.
  const BoundTask& task = program.tasks[size_t(t)];
  const DType a = program.buffers[size_t(task.find_tensor("a")->buffer)].dtype;
  if (a != DType::f32 || options.allow_tf32)
    m.pipelined = pipelined_gemm_tile_of(program, t, options.target, &m.why_not_pipelined, options.allow_tf32);
  if (!m.pipelined && a == DType::f32) m.simt = simt_gemm_tile_of(program, t, options.target, &m.why_not_pipelined);
  if (m.pipelined || m.simt) m.why_not_pipelined.clear();
  // On sm_90a, the Hopper mainloop where TMA reads the operands as stored.
  m.hopper = hopper_gemm_of(program, t, options.target, options.allow_stream_k, &m.why_not_hopper);
  if (m.hopper) m.why_not_hopper.clear();
  return m;
}

GemmMainloop conv_gemm_mainloop_of(const Program& program, int t, const GemmOptions& options, const std::string& refused) {
  GemmMainloop m;
  m.why_not_hopper = "a convolution has no Hopper mainloop yet: the pipelined one runs it";
  auto refuse = [&](std::string why) {
    m.why_not_pipelined = std::move(why);
    return m;
  };
  if (!refused.empty()) return refuse(refused);
  const BoundTask& task = program.tasks[size_t(t)];
  const bool forward = is_op(task, BundledOp::conv2d_nhwc);
  const char* mainloop = forward ? "cg_conv2d_nhwc_mainloop"
                         : is_op(task, BundledOp::conv2d_nhwc_backward_data) ? "cg_conv2d_nhwc_backward_data_mainloop"
                                                                             : "cg_conv2d_nhwc_backward_weight_mainloop";
  if (task.op->closure_of(mainloop) == nullptr)
    return refuse(fmt::format("op '{}' has no pipelined mainloop (variant {})", task.op->name, mainloop));
  const MatmulDims d = matmul_dims(program, t);  // a product a group (and a class of a strided dx's pixels)
  const DType dtype = program.buffers[size_t(task.find_tensor("x")->buffer)].dtype;
  const Shape& sw = program.buffers[size_t(task.find_tensor("weight")->buffer)].shape;
  const int64_t chunk = dtype == DType::f32 ? 4 : 8;
  const int64_t groups = std::max<int64_t>(1, int64_t(number_value(root_arg(program, t, "groups").second, 1)));
  // The chunks run along the input channels (the forward's patches, both gradients' B) and the
  // output channels (the gradients' reads of dout).
  const int64_t input_channels = sw.back(), output_channels = sw[0] / groups;
  const bool tensor_cores = dtype != DType::f32 || options.allow_tf32;
  const char* group = groups > 1 ? " a group" : "";
  if (input_channels % chunk != 0 && tensor_cores)
    return refuse(fmt::format("its {} input channels{} are not a multiple of {} (16 bytes), which the {} copies need",
                              input_channels, group, chunk, forward ? "patches'" : "operands'"));
  if (!forward && output_channels % chunk != 0 && tensor_cores)
    return refuse(fmt::format("its {} output channels{} are not a multiple of {} (16 bytes), which the copies of "
                              "dout need",
                              output_channels, group, chunk));
  // The gathers index pixels and k in 32 bits (templates/vision.cuh).
  if (std::max({d.M, d.N, d.K}) >= (int64_t(1) << 31))
    return refuse(fmt::format("its implicit GEMM ({} x {} x {}) has a side of 2^31 or more, past the 32-bit index "
                              "arithmetic of the gathered copies",
                              d.M, d.N, d.K));
  m.pipelined = pipelined_gemm_tile(dtype, program.buffers[size_t(task.find_tensor("weight")->buffer)].dtype, d.M, d.N,
                                    d.K, d.trans_a, d.trans_b, d.batches, options.target, &m.why_not_pipelined,
                                    options.allow_tf32);
  if (m.pipelined) m.why_not_pipelined.clear();
  return m;
}

std::string SgemmTile::arguments() const { return fmt::format("{}, {}, {}", bm, bn, bk); }

std::string SgemmTile::describe() const {
  return fmt::format("{} x {} x {} tiles, {} threads of 8 x 8 outputs", bm, bn, bk, threads());
}

std::optional<SgemmTile> simt_gemm_tile(DType a, DType b, int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b,
                                        int64_t batches, const Target& target, std::string* why_not) {
  (void)K;
  auto refuse = [&](std::string why) -> std::optional<SgemmTile> {
    if (why_not != nullptr) *why_not = std::move(why);
    return std::nullopt;
  };
  if (a != DType::f32 || b != DType::f32) return refuse("its operands are not both f32");
  if (2 * M * N * K * batches < kSimtMainloopMinFlops)
    return refuse(fmt::format("at {} FLOPs (under 2^24) the kernel gains more from sharing a launch than from the SIMT "
                              "mainloop, which takes one of its own",
                              2 * M * N * K * batches));
  // 16-byte loads: every row of each operand starts on a 16-byte boundary (the arena aligns each buffer to 256).
  const int64_t a_contiguous = trans_a ? M : K, b_contiguous = trans_b ? K : N;
  if (a_contiguous % 4 != 0 || b_contiguous % 4 != 0)
    return refuse(fmt::format("its operands' contiguous axes ({} of a, {} of b) are not multiples of 4 floats",
                              a_contiguous, b_contiguous));
  const int64_t large_tiles = (M + 127) / 128 * ((N + 127) / 128) * batches;
  if (large_tiles >= device_model(target).sms) return SgemmTile{128, 128, 8};
  return SgemmTile{64, 64, 8};
}

std::optional<SgemmTile> simt_gemm_tile_of(const Program& program, int t, const Target& target, std::string* why_not) {
  const BoundTask& task = program.tasks[size_t(t)];
  for (const char* variant : {"cg_sgemm_mainloop", "cg_sgemm_each_coalesced", "cg_sgemm_config"})
    if (task.op->closure_of(variant) == nullptr) {
      if (why_not != nullptr) *why_not = fmt::format("op '{}' has no SIMT mainloop (variant {})", task.op->name, variant);
      return std::nullopt;
    }
  const MatmulDims d = matmul_dims(program, t);
  return simt_gemm_tile(program.buffers[size_t(task.find_tensor("a")->buffer)].dtype,
                        program.buffers[size_t(task.find_tensor("b")->buffer)].dtype, d.M, d.N, d.K, d.trans_a, d.trans_b,
                        d.batches, target, why_not);
}

}  // namespace cudagen
