// Fused kernels run in the emulation: the same graphs fused and unfused, each
// output checked against the float64 reference, in f32 and in the 16-bit
// types, on the scalar and the vectorised loop.
#include <unistd.h>

#include <filesystem>
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "builder.h"
#include "derive.h"
#include "file_util.h"
#include "graph_json.h"
#include "pipeline.h"
#include "executor.h"
#include "host_tensor.h"
#include "runner.h"
#include "test_backend.h"

using namespace cudagen;
using cudagen::testing::run_checked;
using cudagen::testing::test_seed;
using cudagen::testing::test_source_dir;

namespace {

constexpr Storage ext = Storage::external;

std::string work_dir(const std::string& name) {
  return cudagen::testing::work_dir("fusion_test", name);
}

// x + bias (broadcast) -> gelu -> * y -> affine -> sigmoid -> - t1 -> exp; t3 read by the caller too.
TaskGraph broadcast_chain(DType d) {
  GraphBuilder b(std::string("broadcast_chain_") + to_string(d));
  auto t1 = b.task("t1", "add").tensor("a", d, {33, 40}, ext).tensor("b", d, {40}, ext).tensor("out", d, {33, 40});
  auto t2 = b.task("t2", "gelu").tensor("x", t1["out"]).tensor("out", d, {33, 40});
  auto t3 = b.task("t3", "mul").tensor("a", t2["out"]).tensor("b", d, {33, 40}, ext).tensor("out", d, {33, 40}, ext);
  auto t4 = b.task("t4", "affine").tensor("x", t3["out"]).tensor("out", d, {33, 40}).arg("scale", 0.5).arg("shift", 0.25);
  auto t5 = b.task("t5", "sigmoid").tensor("x", t4["out"]).tensor("out", d, {33, 40});
  auto t6 = b.task("t6", "sub").tensor("a", t5["out"]).tensor("b", t1["out"]).tensor("out", d, {33, 40});
  b.task("t7", "exp").tensor("x", t6["out"]).tensor("out", d, {33, 40}, ext);
  return std::move(b).graph();
}

// Every tensor read at the element's own index: the vectorised loop.
TaskGraph flat_chain(DType d) {
  GraphBuilder b(std::string("flat_chain_") + to_string(d));
  auto r = b.task("r", "silu").tensor("x", d, {4096}, ext).tensor("out", d, {4096});
  auto m = b.task("m", "maximum").tensor("a", r["out"]).tensor("b", d, {4096}, ext).tensor("out", d, {4096});
  auto t = b.task("t", "tanh").tensor("x", m["out"]).tensor("out", d, {4096});
  b.task("n", "neg").tensor("x", t["out"]).tensor("out", d, {4096}, ext);
  return std::move(b).graph();
}

// GPT-2's GELU written out, as torch.fx traces it: 0.5 * x first, then
// x^3 from x again (a sibling: it reads x, not 0.5 * x), a diamond back into
// the last mul. One loop that loads x once.
TaskGraph gelu_written_out(DType d) {
  GraphBuilder b(std::string("gelu_written_out_") + to_string(d));
  auto half = b.task("half", "affine").tensor("x", d, {33, 40}, ext).tensor("out", d, {33, 40}).arg("scale", 0.5).arg("shift", 0.0);
  auto square = b.task("square", "mul").tensor("a", half["x"]).tensor("b", half["x"]).tensor("out", d, {33, 40});
  auto cube = b.task("cube", "mul").tensor("a", square["out"]).tensor("b", half["x"]).tensor("out", d, {33, 40});
  auto inner = b.task("inner", "affine").tensor("x", cube["out"]).tensor("out", d, {33, 40}).arg("scale", 0.044715).arg("shift", 0.0);
  auto sum = b.task("sum", "add").tensor("a", half["x"]).tensor("b", inner["out"]).tensor("out", d, {33, 40});
  auto scaled = b.task("scaled", "affine").tensor("x", sum["out"]).tensor("out", d, {33, 40}).arg("scale", 0.7978845608028654).arg("shift", 0.0);
  auto t = b.task("t", "tanh").tensor("x", scaled["out"]).tensor("out", d, {33, 40});
  auto one_plus = b.task("one_plus", "affine").tensor("x", t["out"]).tensor("out", d, {33, 40}).arg("scale", 1.0).arg("shift", 1.0);
  b.task("gelu", "mul").tensor("a", half["out"]).tensor("b", one_plus["out"]).tensor("out", d, {33, 40}, ext);
  return std::move(b).graph();
}

// Tasks that read one graph input through two of their own slots, as the
// frontend writes `x * x` and `x @ x.T`: no dependency on themselves.
TaskGraph one_input_twice(DType d) {
  GraphBuilder b(std::string("one_input_twice_") + to_string(d));
  auto square = b.task("square", "mul").tensor("a", d, {33, 40}, ext);
  square.tensor("b", square["a"]).tensor("out", d, {33, 40});
  b.task("sum", "add").tensor("a", square["out"]).tensor("b", square["a"]).tensor("out", d, {33, 40}, ext);
  auto gram = b.task("gram", "matmul").tensor("a", d, {12, 16}, ext);
  gram.tensor("b", gram["a"]).tensor("out", d, {12, 12}, ext).arg("trans_b", true);
  return std::move(b).graph();
}

// A matmul (batched, b broadcast) with the epilogue of a transformer's MLP:
// bias, gelu, a residual add of the matmul's own input (its storage must not
// be reused under the matmul's feet), a cast; the pre-activation is read later
// too, so it is stored from the epilogue as well.
TaskGraph matmul_epilogue(DType d) {
  GraphBuilder b(std::string("matmul_epilogue_") + to_string(d));
  auto x = b.task("x", "relu").tensor("x", d, {2, 33, 40}, ext).tensor("out", d, {2, 33, 40});
  auto mm = b.task("mm", "matmul").tensor("a", x["out"]).tensor("b", d, {40, 40}, ext).tensor("out", d, {2, 33, 40});
  auto bias = b.task("bias", "add").tensor("a", mm["out"]).tensor("b", d, {40}, ext).tensor("out", d, {2, 33, 40});
  auto act = b.task("act", "gelu").tensor("x", bias["out"]).tensor("out", d, {2, 33, 40});
  auto res = b.task("res", "add").tensor("a", x["out"]).tensor("b", act["out"]).tensor("out", d, {2, 33, 40});
  // To bf16, whose bound covers every input type's rounding (the reference
  // does not round the unfused kernels' 16-bit intermediates).
  b.task("narrow", "cast").tensor("x", res["out"]).tensor("out", DType::bf16, {2, 33, 40}, ext);
  b.task("later", "sum").tensor("x", bias["out"]).tensor("out", d, {2, 33}, ext);
  return std::move(b).graph();
}

// rmsnorm, then a gate and silu on each element as the row's block stores it;
// softmax, then a scale. rstd is exported and not fused over.
TaskGraph reduction_epilogue(DType d) {
  GraphBuilder b(std::string("reduction_epilogue_") + to_string(d));
  auto norm = b.task("norm", "rmsnorm")
                  .tensor("x", d, {7, 300}, ext)
                  .tensor("weight", d, {300}, Storage::persistent)
                  .tensor("out", d, {7, 300})
                  .tensor("rstd", DType::f32, {7}, ext);
  auto gate = b.task("gate", "mul").tensor("a", norm["out"]).tensor("b", d, {7, 300}, ext).tensor("out", d, {7, 300});
  auto act = b.task("act", "silu").tensor("x", gate["out"]).tensor("out", d, {7, 300});
  auto probs = b.task("probs", "softmax").tensor("x", act["out"]).tensor("out", d, {7, 300});
  b.task("scaled", "affine").tensor("x", probs["out"]).tensor("out", d, {7, 300}, ext).arg("scale", 300.0);
  return std::move(b).graph();
}

// The row gradients take epilogues on dx: rmsnorm_backward + the residual
// stream's other gradient; softmax_backward + a scale; layernorm_backward +
// a broadcast mul. dweight and dbias, stored by the column blocks, are read
// by the caller.
TaskGraph gradient_epilogue(DType d) {
  GraphBuilder b(std::string("gradient_epilogue_") + to_string(d));
  const Storage weight = Storage::persistent;
  auto nb = b.task("nb", "rmsnorm_backward")
                .tensor("x", d, {7, 300}, ext)
                .tensor("weight", d, {300}, weight)
                .tensor("rstd", DType::f32, {7}, ext)
                .tensor("dout", d, {7, 300}, ext)
                .tensor("dx", d, {7, 300})
                .tensor("dweight", DType::f32, {300}, ext);
  auto res = b.task("res", "add").tensor("a", nb["dx"]).tensor("b", d, {7, 300}, ext).tensor("out", d, {7, 300});
  auto sb = b.task("sb", "softmax_backward")
                .tensor("out", d, {7, 300}, ext)
                .tensor("dout", res["out"])
                .tensor("dx", d, {7, 300})
                .arg("scale", 0.5);
  b.task("scaled", "affine").tensor("x", sb["dx"]).tensor("out", d, {7, 300}, ext).arg("scale", 2.0).arg("shift", 0.0);
  // dout from the caller: the reference does not round a 16-bit intermediate,
  // and dweight's sums over rows would carry that rounding past their bound.
  auto lb = b.task("lb", "layernorm_backward")
                .tensor("x", d, {7, 300}, ext)
                .tensor("weight", d, {300}, weight)
                .tensor("mean", DType::f32, {7}, ext)
                .tensor("rstd", DType::f32, {7}, ext)
                .tensor("dout", d, {7, 300}, ext)
                .tensor("dx", d, {7, 300})
                .tensor("dweight", DType::f32, {300}, ext)
                .tensor("dbias", DType::f32, {300}, ext);
  b.task("gated", "mul").tensor("a", lb["dx"]).tensor("b", d, {300}, ext).tensor("out", d, {7, 300}, ext);
  return std::move(b).graph();
}

// Rule horizontal: independent kernels of several skeletons and grids (two
// matmuls, an elementwise loop, a row op, a gather) in one phase, then a
// consumer of the matmuls.
TaskGraph independent_kernels(DType d) {
  GraphBuilder b(std::string("independent_kernels_") + to_string(d));
  auto x = b.task("x", "relu").tensor("x", d, {33, 40}, ext).tensor("out", d, {33, 40});
  auto p = b.task("p", "matmul").tensor("a", x["out"]).tensor("b", d, {40, 24}, ext).tensor("out", d, {33, 24});
  auto q = b.task("q", "matmul").tensor("a", x["out"]).tensor("b", d, {40, 40}, ext).tensor("out", d, {33, 40}, ext);
  b.task("r", "exp").tensor("x", d, {1000}, ext).tensor("out", d, {1000}, ext);
  b.task("sm", "softmax").tensor("x", d, {7, 300}, ext).tensor("out", d, {7, 300}, ext);
  b.task("heads", "split_heads").tensor("x", d, {5, 12}, ext).tensor("out", d, {3, 5, 4}, ext).arg("heads", int64_t(3));
  b.task("both", "concat").tensor("a", p["out"]).tensor("b", q["out"]).tensor("out", d, {33, 64}, ext);
  return std::move(b).graph();
}

// Rule elementwise_prologue: a chain (relu, then a broadcast scale) as the
// left operand of a batched matmul whose weight every batch shares; a
// sigmoid as the transposed right operand of another, whose left operand is
// the first one's result; the inputs of row ops: a softmax (its loads run
// three passes over the row), a layernorm of rows longer than its block, a sum.
TaskGraph elementwise_prologue(DType d) {
  GraphBuilder b(std::string("elementwise_prologue_") + to_string(d));
  auto act = b.task("act", "relu").tensor("x", d, {2, 33, 40}, ext).tensor("out", d, {2, 33, 40});
  auto scaled = b.task("scaled", "mul").tensor("a", act["out"]).tensor("b", d, {40}, ext).tensor("out", d, {2, 33, 40});
  auto mm = b.task("mm", "matmul").tensor("a", scaled["out"]).tensor("b", d, {40, 24}, ext).tensor("out", d, {2, 33, 24}, ext);
  auto gate = b.task("gate", "sigmoid").tensor("x", d, {2, 20, 24}, ext).tensor("out", d, {2, 20, 24});
  b.task("mm2", "matmul")
      .tensor("a", mm["out"])
      .tensor("b", gate["out"])
      .tensor("out", d, {2, 33, 20}, ext)
      .arg("trans_b", true);
  auto squashed = b.task("squashed", "tanh").tensor("x", d, {2, 33, 24}, ext).tensor("out", d, {2, 33, 24});
  b.task("sm", "softmax").tensor("x", squashed["out"]).tensor("out", d, {2, 33, 24}, ext).arg("causal", true);
  auto shifted = b.task("shifted", "add").tensor("a", d, {7, 300}, ext).tensor("b", d, {300}, ext).tensor("out", d, {7, 300});
  b.task("ln", "layernorm")
      .tensor("x", shifted["out"])
      .tensor("weight", d, {300}, ext)
      .tensor("bias", d, {300}, ext)
      .tensor("out", d, {7, 300}, ext);
  auto positive = b.task("positive", "relu").tensor("x", d, {5, 40}, ext).tensor("out", d, {5, 40});
  b.task("total", "sum").tensor("x", positive["out"]).tensor("out", d, {5}, ext);
  return std::move(b).graph();
}

// Rule attention: q k^T scaled twice (the matmul's alpha, the softmax's
// scale), causal or not, by values of another width; the heads merged as the
// context is stored; the probabilities read later (stored from the kernel) or
// not. T = 40 keys: more than a warp's 32 lanes, 8 query rows per block, the
// keys and values staged in shared memory; T = 9: a row per block, read
// from the arena.
TaskGraph attention(DType d, bool causal, bool probabilities_read_later) {
  GraphBuilder b(fmt::format("attention_{}_{}{}", to_string(d), causal ? "causal" : "full",
                             probabilities_read_later ? "_probs" : ""));
  const int64_t B = 2, H = 3, T = causal ? 40 : 9, D = 8, Dv = 12;
  auto q = b.task("q", "relu").tensor("x", d, {B, H, T, D}, ext).tensor("out", d, {B, H, T, D});
  auto s = b.task("scores", "matmul")
               .tensor("a", q["out"])
               .tensor("b", d, {B, H, T, D}, ext)
               .tensor("out", d, {B, H, T, T})
               .arg("trans_b", true)
               .arg("alpha", 0.5);
  auto p = b.task("probs", "softmax")
               .tensor("x", s["out"])
               .tensor("out", d, {B, H, T, T}, probabilities_read_later ? ext : Storage::transient)
               .arg("scale", 0.7)
               .arg("causal", causal);
  auto c = b.task("context", "matmul").tensor("a", p["out"]).tensor("b", d, {B, H, T, Dv}, ext).tensor("out", d, {B, H, T, Dv});
  b.task("merged", "merge_heads").tensor("x", c["out"]).tensor("out", d, {B, T, H * Dv}, ext).arg("heads", H);
  return std::move(b).graph();
}

// Attention with a bias added to its scores before the softmax (an
// attention mask: a padding mask [B, 1, 1, Tk], a [Tq, Tk] window or
// position bias; scaled_dot_product_attention's float attn_mask), as
// `mask + scores` where mask_first: softmax(scale (alpha q k^T + mask)) v.
TaskGraph biased_attention(DType d, int64_t Tq, int64_t Tk, const Shape& mask, bool causal, bool mask_first) {
  GraphBuilder b(fmt::format("biased_attention_{}_q{}_k{}_mask{}{}{}", to_string(d), Tq, Tk, fmt::join(mask, "x"),
                             causal ? "_causal" : "", mask_first ? "_first" : ""));
  const int64_t B = 2, H = 2, D = 16, Dv = 8;
  auto s = b.task("scores", "matmul")
               .tensor("a", d, {B, H, Tq, D}, ext)
               .tensor("b", d, {B, H, Tk, D}, ext)
               .tensor("out", d, {B, H, Tq, Tk})
               .arg("trans_b", true)
               .arg("alpha", 0.5);
  auto m = b.task("masked", "add");
  if (mask_first)
    m.tensor("a", d, mask, ext).tensor("b", s["out"]);
  else
    m.tensor("a", s["out"]).tensor("b", d, mask, ext);
  m.tensor("out", d, {B, H, Tq, Tk});
  auto p = b.task("probs", "softmax").tensor("x", m["out"]).tensor("out", d, {B, H, Tq, Tk}).arg("scale", 0.7).arg("causal", causal);
  b.task("context", "matmul").tensor("a", p["out"]).tensor("b", d, {B, H, Tk, Dv}, ext).tensor("out", d, {B, H, Tq, Dv}, ext);
  return std::move(b).graph();
}

// Rule attention on tensor cores (the flash kernel, templates/softmax_flash.cuh):
// softmax(scale alpha q k^T) v over H heads of B batches, the heads merged as
// the context is stored; nothing but the context read later. With G > 1,
// grouped-query attention: q [B, H, G, Tq, D] over k and v [B, H, 1, Tk, D]
// (G query heads share each head of keys and values), the context stored as it is.
TaskGraph flash_attention(DType d, int64_t B, int64_t H, int64_t Tq, int64_t Tk, int64_t D, int64_t Dv, bool causal,
                          int64_t G = 1, double scale = 0.25, bool probs_read_later = false) {
  GraphBuilder b(fmt::format("flash_attention_{}_{}x{}x{}_q{}_k{}_d{}_dv{}{}{}", to_string(d), B, H, G, Tq, Tk, D, Dv,
                             causal ? "_causal" : "", probs_read_later ? "_probs" : ""));
  auto heads = [&](int64_t groups, int64_t rows, int64_t width) {
    return G > 1 ? Shape{B, H, groups, rows, width} : Shape{B, H, rows, width};
  };
  auto s = b.task("scores", "matmul")
               .tensor("a", d, heads(G, Tq, D), ext)
               .tensor("b", d, heads(1, Tk, D), ext)
               .tensor("out", d, heads(G, Tq, Tk))
               .arg("trans_b", true)
               .arg("alpha", 0.5);
  auto p = b.task("probs", "softmax")
               .tensor("x", s["out"])
               .tensor("out", d, heads(G, Tq, Tk), probs_read_later ? ext : Storage::transient)
               .arg("scale", scale)
               .arg("causal", causal);
  auto c = b.task("context", "matmul")
               .tensor("a", p["out"])
               .tensor("b", d, heads(1, Tk, Dv), ext)
               .tensor("out", d, heads(G, Tq, Dv), G > 1 ? ext : Storage::transient);
  if (G == 1) b.task("merged", "merge_heads").tensor("x", c["out"]).tensor("out", d, {B, Tq, H * Dv}, ext).arg("heads", H);
  return std::move(b).graph();
}

// An attention trained on the flash kernels: its forward and the gradient
// tasks the derive pass writes for it, by hand: q, k, v and dcontext given;
// the context, dq (merged from its heads), dk and dv the outputs.
TaskGraph flash_attention_training(DType d, int64_t B, int64_t H, int64_t Tq, int64_t Tk, int64_t D, bool causal,
                                   int64_t Dv = 0) {
  if (Dv == 0) Dv = D;
  GraphBuilder b(fmt::format("flash_training_{}_{}x{}_q{}_k{}_d{}{}{}", to_string(d), B, H, Tq, Tk, D,
                             Dv == D ? std::string() : fmt::format("_v{}", Dv), causal ? "_causal" : ""));
  auto s = b.task("scores", "matmul")
               .tensor("a", d, {B, H, Tq, D}, ext)
               .tensor("b", d, {B, H, Tk, D}, ext)
               .tensor("out", d, {B, H, Tq, Tk})
               .arg("trans_b", true)
               .arg("alpha", 0.5);
  auto p = b.task("probs", "softmax").tensor("x", s["out"]).tensor("out", d, {B, H, Tq, Tk}).arg("scale", 0.25).arg("causal", causal);
  auto c = b.task("context", "matmul").tensor("a", p["out"]).tensor("b", d, {B, H, Tk, Dv}, ext).tensor("out", d, {B, H, Tq, Dv}, ext);
  auto dp = b.task("dp", "matmul", Phase::backward)
                .tensor("a", d, {B, H, Tq, Dv}, ext)
                .tensor("b", c["b"])
                .tensor("out", d, {B, H, Tq, Tk})
                .arg("trans_b", true);
  b.task("dv", "matmul", Phase::backward).tensor("a", p["out"]).tensor("b", dp["a"]).tensor("out", d, {B, H, Tk, Dv}, ext).arg("trans_a", true);
  auto ds = b.task("ds", "softmax_backward", Phase::backward)
                .tensor("out", p["out"])
                .tensor("dout", dp["out"])
                .tensor("dx", d, {B, H, Tq, Tk})
                .arg("scale", 0.25);
  auto dq = b.task("dq", "matmul", Phase::backward).tensor("a", ds["dx"]).tensor("b", s["b"]).tensor("out", d, {B, H, Tq, D}).arg("alpha", 0.5);
  b.task("dq_merged", "merge_heads", Phase::backward).tensor("x", dq["out"]).tensor("out", d, {B, Tq, H * D}, ext).arg("heads", H);
  b.task("dk", "matmul", Phase::backward)
      .tensor("a", ds["dx"])
      .tensor("b", s["a"])
      .tensor("out", d, {B, H, Tk, D}, ext)
      .arg("trans_a", true)
      .arg("alpha", 0.5);
  return std::move(b).graph();
}

// Grouped-query attention trained: 8 query heads over 2 heads of keys and
// values (q [1, 2, 4, Tq, D], k and v [1, 2, 1, Tk, D], made by init tasks),
// its loss mse(256 context, target), and the gradients the derive pass
// writes (no optimizer), made outputs so that each is checked. (The loss is
// scaled, as 16-bit training scales it: mse's gradient, 2 / N (pred -
// target), would be subnormal in f16, where the check would measure the
// rounding of the gradients' inputs.)
TaskGraph grouped_query_training(DType d, int64_t Tq, int64_t Tk, int64_t D, bool causal) {
  GraphBuilder b(fmt::format("gqa_training_{}_q{}_k{}_d{}{}", to_string(d), Tq, Tk, D, causal ? "_causal" : ""));
  auto init = [&](const char* id, Shape shape, int seed) {
    return b.task(id, "uniform", Phase::init).tensor("out", d, std::move(shape)).arg("low", -1.0).arg("high", 1.0).arg("seed", seed);
  };
  auto q = init("q", {1, 2, 4, Tq, D}, 1);
  auto k = init("k", {1, 2, 1, Tk, D}, 2);
  auto v = init("v", {1, 2, 1, Tk, D}, 3);
  auto s = b.task("scores", "matmul").tensor("a", q["out"]).tensor("b", k["out"]).tensor("out", d, {1, 2, 4, Tq, Tk}).arg("trans_b", true);
  auto p = b.task("probs", "softmax").tensor("x", s["out"]).tensor("out", d, {1, 2, 4, Tq, Tk}).arg("scale", 0.125).arg("causal", causal);
  auto c = b.task("context", "matmul").tensor("a", p["out"]).tensor("b", v["out"]).tensor("out", d, {1, 2, 4, Tq, D});
  auto scaled = b.task("scaled", "affine").tensor("x", c["out"]).tensor("out", d, {1, 2, 4, Tq, D}).arg("scale", 256.0);
  b.task("loss", "mse").tensor("pred", scaled["out"]).tensor("target", d, {1, 2, 4, Tq, D}, ext).tensor("loss", DType::f32, {}, ext);
  DerivedGraph derived = derive_training(load_program(std::move(b).graph(), {}), TrainingSpec{{"loss", "loss"}, "", {}, {}});
  for (const auto& [weight, gradient] : derived.gradients)
    for (Task& t : derived.graph.tasks)
      for (TensorSlot& slot : t.tensors)
        if (t.id == gradient.task && slot.name == gradient.slot) slot.storage = ext;
  return std::move(derived.graph);
}

// Rule norm_prologue: a norm read only by matmuls, as their `a`: one
// flattened ([2 * 33, K] @ [K, 24], a partial last tile of rows) with a bias
// epilogue, one batched ([2, 33, K] @ [2, K, 40]: the rows of the second
// batch start at a_base). K = 40, more than a warp's lanes: the tile's rows
// staged in shared memory; K = 400: too long to stage, each element
// normalised as it is loaded. `stored`: the caller reads the norm's output
// and statistics too, which p's kernel stores. `op`: rmsnorm or layernorm.
TaskGraph norm_prologue(DType d, int64_t K, bool stored, const std::string& op = "rmsnorm") {
  GraphBuilder b(fmt::format("{}_prologue_{}_{}{}", op, to_string(d), K, stored ? "_stored" : ""));
  auto x = b.task("x", "relu").tensor("x", d, {2, 33, K}, ext).tensor("out", d, {2, 33, K});
  auto n = b.task("n", op)
               .tensor("x", x["out"])
               .tensor("weight", d, {K}, Storage::persistent)
               .tensor("out", d, {2, 33, K}, stored ? ext : Storage::transient)
               .arg("eps", 1e-5);
  if (op == "layernorm") n.tensor("bias", d, {K}, Storage::persistent);
  if (stored && op == "layernorm") n.tensor("mean", DType::f32, {2, 33}, ext);
  if (stored) n.tensor("rstd", DType::f32, {2, 33}, ext);
  auto p = b.task("p", "matmul").tensor("a", n["out"]).tensor("b", d, {K, 24}, ext).tensor("out", d, {2, 33, 24});
  b.task("bias", "add").tensor("a", p["out"]).tensor("b", d, {24}, ext).tensor("out", d, {2, 33, 24}, ext);
  b.task("q", "matmul").tensor("a", n["out"]).tensor("b", d, {2, K, 40}, ext).tensor("out", d, {2, 33, 40}, ext);
  return std::move(b).graph();
}

// Rule matmul_chain: two matmuls whose value passes through shared memory.
// With an rmsnorm prologue, alpha, bias and GELU between, a residual add
// after (66 rows: a partial last tile of rows; 72 hidden columns: a partial
// last column tile; bias.out stored too, for the caller); or with nothing
// between, an elementwise prologue on the first's `a`, the second's weight
// transposed, and the value stored as well as kept (the caller reads it).
TaskGraph matmul_chain(DType d, bool epilogues) {
  GraphBuilder b(fmt::format("matmul_chain_{}_{}", to_string(d), epilogues ? "epilogues" : "plain"));
  if (epilogues) {
    auto n = b.task("n", "rmsnorm")
                 .tensor("x", d, {2, 33, 40}, ext)
                 .tensor("weight", d, {40}, Storage::persistent)
                 .tensor("out", d, {2, 33, 40});
    auto up = b.task("up", "matmul").tensor("a", n["out"]).tensor("b", d, {40, 72}, ext).tensor("out", d, {2, 33, 72}).arg("alpha", 0.5);
    auto bias = b.task("bias", "add").tensor("a", up["out"]).tensor("b", d, {72}, ext).tensor("out", d, {2, 33, 72}, ext);
    auto act = b.task("act", "gelu").tensor("x", bias["out"]).tensor("out", d, {2, 33, 72});
    auto down = b.task("down", "matmul").tensor("a", act["out"]).tensor("b", d, {72, 24}, ext).tensor("out", d, {2, 33, 24});
    b.task("res", "add").tensor("a", down["out"]).tensor("b", d, {2, 33, 24}, ext).tensor("out", d, {2, 33, 24}, ext);
  } else {
    auto x = b.task("x", "relu").tensor("x", d, {66, 40}, ext).tensor("out", d, {66, 40});
    auto up = b.task("up", "matmul").tensor("a", x["out"]).tensor("b", d, {40, 50}, ext).tensor("out", d, {66, 50}, ext);
    b.task("down", "matmul")
        .tensor("a", up["out"])
        .tensor("b", d, {24, 50}, ext)
        .tensor("out", d, {66, 24}, ext)
        .arg("trans_b", true)
        .arg("alpha", 2.0);
  }
  return std::move(b).graph();
}

// Rule row_reduction: a gradient dh = dy @ w^T over 70 rows (3 tiles of
// 32, 2 of 64: the last partial), with relu's gradient as its epilogue
// (`epilogue`; the caller reads dx too, so it is stored as well) or none
// (dh itself reduced, never stored), then its reductions over the rows: the
// bias gradient (a sum) and the weight gradient 0.5 * x^T @ dx, 40 columns
// (a partial column tile).
TaskGraph row_reduction(DType d, bool epilogue) {
  GraphBuilder b(fmt::format("row_reduction_{}_{}", to_string(d), epilogue ? "epilogue" : "plain"));
  auto dh = b.task("dh", "matmul").tensor("a", d, {70, 12}, ext).tensor("b", d, {40, 12}, ext).tensor("out", d, {70, 40}).arg("trans_b", true);
  SlotRef value = dh["out"];
  if (epilogue) value = b.task("dx", "relu_backward").tensor("x", d, {70, 40}, ext).tensor("dout", dh["out"]).tensor("dx", d, {70, 40}, ext)["dx"];
  b.task("db", "sum_leading").tensor("x", value).tensor("out", d, {40}, ext);
  b.task("dw", "matmul").tensor("a", d, {70, 6}, ext).tensor("b", value).tensor("out", d, {6, 40}, ext).arg("trans_a", true).arg("alpha", 0.5);
  return std::move(b).graph();
}

// Rule attention_projection: the attention kernel computes q, k and v from
// their projections. `gpt`: a layernorm of x feeds all three, each with a
// bias epilogue before its split; causal, 12 tokens (4 warps, 3 query rows
// each); the norm's output, mean and rstd, the probabilities and q's heads
// read by the caller too, v's heads added to the context in the epilogue
// (each stored from the kernel). Otherwise cross-attention without a norm: q from x (8 tokens,
// alpha 0.5), k and v from a memory of 6 rows, k's weight transposed, values
// wider than the keys.
TaskGraph projected_attention(DType d, bool gpt) {
  GraphBuilder b(fmt::format("projected_attention_{}_{}", to_string(d), gpt ? "gpt" : "cross"));
  auto split = [&](const std::string& id, TaskBuilder& from, const Shape& shape, int64_t heads, Storage storage) {
    return b.task(id, "split_heads").tensor("x", from["out"]).tensor("out", d, shape, storage).arg("heads", heads);
  };
  if (gpt) {
    const int64_t B = 2, T = 12, H = 3, D = 8, C = H * D;
    auto ln = b.task("ln", "layernorm")
                  .tensor("x", d, {B, T, C}, ext)
                  .tensor("weight", d, {C}, Storage::persistent)
                  .tensor("bias", d, {C}, Storage::persistent)
                  .tensor("out", d, {B, T, C}, ext)
                  .tensor("mean", DType::f32, {B, T}, ext)
                  .tensor("rstd", DType::f32, {B, T}, ext);
    std::vector<TaskBuilder> heads;
    for (const std::string id : {"q", "k", "v"}) {
      auto p = b.task(id, "matmul").tensor("a", ln["out"]).tensor("b", d, {C, C}, ext).tensor("out", d, {B, T, C});
      auto bias = b.task(id + "_bias", "add").tensor("a", p["out"]).tensor("b", d, {C}, ext).tensor("out", d, {B, T, C});
      heads.push_back(split(id + "_heads", bias, {B, H, T, D}, H, id == "q" ? ext : Storage::transient));
    }
    auto s = b.task("scores", "matmul")
                 .tensor("a", heads[0]["out"])
                 .tensor("b", heads[1]["out"])
                 .tensor("out", d, {B, H, T, T})
                 .arg("trans_b", true)
                 .arg("alpha", 0.5);
    auto pr = b.task("probs", "softmax").tensor("x", s["out"]).tensor("out", d, {B, H, T, T}, ext).arg("scale", 0.7).arg("causal", true);
    auto c = b.task("context", "matmul").tensor("a", pr["out"]).tensor("b", heads[2]["out"]).tensor("out", d, {B, H, T, D});
    auto plus = b.task("plus", "add").tensor("a", c["out"]).tensor("b", heads[2]["out"]).tensor("out", d, {B, H, T, D});
    b.task("merged", "merge_heads").tensor("x", plus["out"]).tensor("out", d, {B, T, C}, ext).arg("heads", H);
  } else {
    const int64_t B = 2, Tq = 8, Tk = 6, H = 2, D = 8, Dv = 12;
    auto q = b.task("q", "matmul").tensor("a", d, {B, Tq, 16}, ext).tensor("b", d, {16, H * D}, ext).tensor("out", d, {B, Tq, H * D}).arg("alpha", 0.5);
    auto k = b.task("k", "matmul").tensor("a", d, {B, Tk, 20}, ext).tensor("b", d, {H * D, 20}, ext).tensor("out", d, {B, Tk, H * D}).arg("trans_b", true);
    auto v = b.task("v", "matmul").tensor("a", k["a"]).tensor("b", d, {20, H * Dv}, ext).tensor("out", d, {B, Tk, H * Dv});
    auto qh = split("q_heads", q, {B, H, Tq, D}, H, Storage::transient);
    auto kh = split("k_heads", k, {B, H, Tk, D}, H, Storage::transient);
    auto vh = split("v_heads", v, {B, H, Tk, Dv}, H, Storage::transient);
    auto s = b.task("scores", "matmul").tensor("a", qh["out"]).tensor("b", kh["out"]).tensor("out", d, {B, H, Tq, Tk}).arg("trans_b", true);
    auto pr = b.task("probs", "softmax").tensor("x", s["out"]).tensor("out", d, {B, H, Tq, Tk}).arg("scale", 0.35);
    auto c = b.task("context", "matmul").tensor("a", pr["out"]).tensor("b", vh["out"]).tensor("out", d, {B, H, Tq, Dv});
    b.task("merged", "merge_heads").tensor("x", c["out"]).tensor("out", d, {B, Tq, H * Dv}, ext).arg("heads", H);
  }
  return std::move(b).graph();
}

// Rule matmul_sum: three products of one shape added, x1 @ w1 + x2 @ w2^T +
// x3 @ w3 (inner dimensions 12, 7 and 40: the terms meet inside the
// skeleton's k tiles), rows over a batch of 2 x 35; then a GELU, or nothing.
TaskGraph matmul_sum(DType d, bool epilogue) {
  GraphBuilder b(fmt::format("matmul_sum_{}_{}", to_string(d), epilogue ? "epilogue" : "plain"));
  auto m1 = b.task("m1", "matmul").tensor("a", d, {2, 35, 12}, ext).tensor("b", d, {12, 40}, ext).tensor("out", d, {2, 35, 40}).arg("alpha", 0.5);
  auto m2 = b.task("m2", "matmul").tensor("a", d, {2, 35, 7}, ext).tensor("b", d, {40, 7}, ext).tensor("out", d, {2, 35, 40}).arg("trans_b", true).arg("alpha", 0.5);
  auto s1 = b.task("s1", "add").tensor("a", m2["out"]).tensor("b", m1["out"]).tensor("out", d, {2, 35, 40});
  auto m3 = b.task("m3", "matmul").tensor("a", d, {2, 35, 40}, ext).tensor("b", d, {40, 40}, ext).tensor("out", d, {2, 35, 40}).arg("alpha", 0.5);
  auto s2 = b.task("s2", "add").tensor("a", m3["out"]).tensor("b", s1["out"]).tensor("out", d, {2, 35, 40}, epilogue ? Storage::transient : ext);
  if (epilogue) b.task("g", "gelu").tensor("x", s2["out"]).tensor("out", d, {2, 35, 40}, ext);
  return std::move(b).graph();
}

// Rule attention_backward: the gradient tasks of softmax(scale * alpha q
// k^T) alpha' v as the derive pass writes them, by hand, from the caller's
// dcontext and probabilities. `which`: "all" (self-attention of 12 tokens: a
// tile of 8 query rows, then one of 4; dq merged from its heads, dk stored
// as it is, dv with a bias epilogue, then merged), "keys" (cross-attention,
// 5 queries and 11 keys, values wider than the keys; no dq), "queries" (dq
// alone: no key or value gradients).
TaskGraph attention_gradient(DType d, const std::string& which) {
  GraphBuilder b(fmt::format("attention_gradient_{}_{}", to_string(d), which));
  const bool cross = which == "keys", keys = which != "queries";
  const int64_t B = 2, H = cross ? 2 : 3, Tq = cross ? 5 : 12, Tk = cross ? 11 : 12, D = 8, Dv = cross ? 12 : 8;
  auto dp = b.task("dp", "matmul")
                .tensor("a", d, {B, H, Tq, Dv}, ext)
                .tensor("b", d, {B, H, Tk, Dv}, ext)
                .tensor("out", d, {B, H, Tq, Tk})
                .arg("trans_b", true)
                .arg("alpha", 0.75);
  auto ds = b.task("ds", "softmax_backward")
                .tensor("out", d, {B, H, Tq, Tk}, ext)
                .tensor("dout", dp["out"])
                .tensor("dx", d, {B, H, Tq, Tk})
                .arg("scale", 0.35);
  if (keys) {
    auto dv = b.task("dv", "matmul").tensor("a", ds["out"]).tensor("b", dp["a"]).tensor("out", d, {B, H, Tk, Dv}).arg("trans_a", true).arg("alpha", 0.75);
    auto bias = b.task("dv_bias", "add").tensor("a", dv["out"]).tensor("b", d, {Dv}, ext).tensor("out", d, {B, H, Tk, Dv});
    b.task("dv_merged", "merge_heads").tensor("x", bias["out"]).tensor("out", d, {B, Tk, H * Dv}, ext).arg("heads", H);
    b.task("dk", "matmul").tensor("a", ds["dx"]).tensor("b", d, {B, H, Tq, D}, ext).tensor("out", d, {B, H, Tk, D}, ext).arg("trans_a", true).arg("alpha", 0.5);
  }
  if (!cross) {
    auto dq = b.task("dq", "matmul").tensor("a", ds["dx"]).tensor("b", d, {B, H, Tk, D}, ext).tensor("out", d, {B, H, Tq, D}).arg("alpha", 0.5);
    b.task("dq_merged", "merge_heads").tensor("x", dq["out"]).tensor("out", d, {B, Tq, H * D}, ext).arg("heads", H);
  }
  return std::move(b).graph();
}

CompileOptions fusion(bool on) {
  CompileOptions options;
  options.fuse.enabled = on;
  return options;
}

// Returns the fused program, for the caller's own checks.
Compiled expect_fused_and_unfused_right(const TaskGraph& g, size_t fused_kernels, const std::string& expect_in_source) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(fmt::format("graph {}, seed {}", g.name, seed));
  Compiled fused = compile(load_program(g, {}), fusion(true));
  Compiled unfused = compile(load_program(g, {}), fusion(false));
  EXPECT_EQ(fused.kernels.size(), fused_kernels);
  EXPECT_EQ(unfused.kernels.size(), g.tasks.size());
  EXPECT_NE(fused.emitted.cuda_source.find(expect_in_source), std::string::npos) << fused.emitted.cuda_source;
  for (const Compiled* c : {&fused, &unfused}) {
    CheckedRun run = run_checked(*c, RunOptions{seed, work_dir(g.name)});
    EXPECT_TRUE(run.ok()) << (c == &fused ? "fused: " : "unfused: ") << format_run(run);
  }
  return fused;
}

// The fused graph as megakernels (8 blocks: what the emulator runs at
// once), its tile functions each after the tiles they read.
void expect_megakernel_right(const TaskGraph& g) {
  CompileOptions options = fusion(true);
  options.emit.megakernel = true;
  options.emit.megakernel_blocks = 8;
  const uint64_t seed = test_seed();
  CheckedRun run = run_checked(compile(load_program(g, {}), options), RunOptions{seed, work_dir(g.name + "_mk")});
  EXPECT_TRUE(run.ok()) << "megakernel, graph " << g.name << ", seed " << seed << "\n" << format_run(run);
}

}  // namespace

class FusedChains : public ::testing::TestWithParam<DType> {};

TEST_P(FusedChains, MatchTheReferenceFusedAndUnfused) {
  expect_fused_and_unfused_right(broadcast_chain(GetParam()), 1, "const float v6 = cg_exp<float>(v5);");
  expect_fused_and_unfused_right(flat_chain(GetParam()), 1,
                                 GetParam() == DType::f32 ? "// 4 elements at a time" : "// 8 elements at a time");
  // x loaded once, for `half` and its sibling `square`.
  const Compiled c = expect_fused_and_unfused_right(gelu_written_out(GetParam()), 1, "const float v1 = cg_mul<float>(");
  const std::string& src = c.emitted.cuda_source;
  const size_t body = src.find("CG_DEVICE void k0_half_tile(");
  ASSERT_NE(body, std::string::npos);
  const std::string kernel = src.substr(body, src.find("CG_KERNEL", body) - body);
  size_t loads = 0;
  for (size_t at = kernel.find("(half_x, i)"); at != std::string::npos; at = kernel.find("(half_x, i)", at + 1)) ++loads;
  EXPECT_EQ(loads, 1u) << kernel;
}

TEST_P(FusedChains, ATaskReadsOneInputThroughTwoSlots) {
  // square and sum in one loop; the Gram matrix in its own kernel.
  expect_fused_and_unfused_right(one_input_twice(GetParam()), 2, "cg_mul<float>(");
}

TEST_P(FusedChains, EpiloguesMatchTheReferenceFusedAndUnfused) {
  // relu | matmul + bias, gelu, res, cast | sum
  expect_fused_and_unfused_right(matmul_epilogue(GetParam()), 3, "const float v2 = cg_gelu<float>(v1, /*approximate=tanh*/ 0);");
  // rmsnorm + gate, silu | softmax + affine
  expect_fused_and_unfused_right(reduction_epilogue(GetParam()), 2, "[&](int j, float v) { cg_epilogue(row * 300 + j, v); }");
  // rmsnorm_backward + res | softmax_backward + scaled | layernorm_backward + gated
  const Compiled c = expect_fused_and_unfused_right(gradient_epilogue(GetParam()), 3,
                                                    "// Epilogue (reduction_epilogue): res (add), on element i of nb.dx");
  EXPECT_NE(c.emitted.cuda_source.find("// Epilogue (reduction_epilogue): gated (mul), on element i of lb.dx"),
            std::string::npos);
}

TEST_P(FusedChains, IndependentKernelsShareLaunchesAndMatchTheReference) {
  const TaskGraph g = independent_kernels(GetParam());
  // p, q (each with x as its elementwise prologue), r, sm, heads | both
  const Compiled c = expect_fused_and_unfused_right(g, g.tasks.size() - 1, "(rule horizontal)");
  EXPECT_EQ(launch_count(c.kernels), 2);
  // A launch runs kernels of one block size: fewer launches than kernels, at
  // least the fusion pass's two, more where the kernels' blocks differ (16-bit
  // matmuls run 128 threads, the row op 256).
  EXPECT_LT(c.emitted.kernels.size(), c.kernels.size());
  EXPECT_GE(c.emitted.kernels.size(), 2u);
  EXPECT_EQ(c.emitted.kernels.size() > 2u, GetParam() != DType::f32);
}

TEST_P(FusedChains, ElementwisePrologueMatchesTheReferenceFusedAndUnfused) {
  // mm with act and scaled in its loads of a | mm2 with gate in its loads of b | sm with squashed
  // | ln with shifted | total with positive
  const Compiled c = expect_fused_and_unfused_right(elementwise_prologue(GetParam()), 5,
                                                    "// Prologue (elementwise_prologue): act (relu), scaled (mul)");
  const std::string& src = c.emitted.cuda_source;
  EXPECT_NE(src.find("cg_prologue(a_base + "), std::string::npos);
  EXPECT_NE(src.find("cg_prologue(b_base + "), std::string::npos);
  EXPECT_NE(src.find("cg_softmax_row([&](int j) { return cg_prologue(row * 24 + j); }"), std::string::npos);
  EXPECT_NE(src.find("cg_layernorm_row([&](int j) { return cg_prologue(row * 300 + j); }"), std::string::npos);
  // A 16-bit operand is rounded as the chain would have stored it.
  EXPECT_EQ(src.find("return cg_widen(cg_narrow<") != std::string::npos, GetParam() != DType::f32);
  for (const std::string name : {"act.out", "scaled.out", "gate.out", "squashed.out", "shifted.out", "positive.out"})
    for (const auto& pb : c.plan.buffers)
      if (buffer_name(c.program, pb.buffer) == name) EXPECT_TRUE(pb.internal) << name;
}

TEST_P(FusedChains, AttentionMatchesTheReferenceFusedAndUnfused) {
  // q | scores, probs, context, merged
  for (bool causal : {false, true})
    for (bool read_later : {false, true}) {
      const TaskGraph g = attention(GetParam(), causal, read_later);
      const std::string source = expect_fused_and_unfused_right(g, 2, "cg_attention_row(").emitted.cuda_source;
      EXPECT_EQ(source.find("cg_stage_rows([&]") != std::string::npos, causal) << "staged only with 8 rows of a head";
      EXPECT_EQ(source.find("cg_store(probs, ") != std::string::npos, read_later) << "stored only where read";
    }
}

// An add of a bias to the scores joins the attention kernel (rule
// attention): each kernel adds the bias's element as it computes a score,
// and neither the scores nor the biased scores reach memory. Masks
// broadcast every way (per key of a batch, a [Tq, Tk] plane, a whole
// [B, H, Tq, Tk]), on either side of the add, causal too: in f32 the row
// kernel, and the streamed one over 1100 keys; in 16-bit types the flash
// kernel (a partial tile, partial tiles of 65 x 70, split over 1100 keys). On sm_90a the
// flash kernel's Hopper path, which takes no bias yet, says so.
TEST_P(FusedChains, BiasedAttentionMatchesTheReferenceFusedAndUnfused) {
  struct Case {
    int64_t Tq, Tk;
    Shape mask;
    bool causal, mask_first;
  };
  const bool flash = GetParam() != DType::f32;
  for (const Case& c : {Case{9, 9, {2, 1, 1, 9}, false, false}, Case{9, 9, {9, 9}, true, true},
                        Case{9, 9, {2, 2, 9, 9}, false, true}, Case{65, 70, {2, 1, 1, 70}, false, false},
                        Case{65, 70, {65, 70}, true, true}}) {
    const Compiled fused =
        expect_fused_and_unfused_right(biased_attention(GetParam(), c.Tq, c.Tk, c.mask, c.causal, c.mask_first), 1,
                                       flash ? "cg_flash_bias_of([&](cg_i64 row, cg_i64 key) { return "
                                                : "[&](int j, float x) { return x + ");
    for (const auto& pb : fused.plan.buffers)
      if (const std::string name = buffer_name(fused.program, pb.buffer); name == "scores.out" || name == "masked.out")
        EXPECT_TRUE(pb.internal) << name;
  }
  // Over 1024 keys. (Fused only: unfused, the emulation would take the scores through the 64 x 64 tile.)
  const TaskGraph g = biased_attention(GetParam(), 3, 1100, {1, 1, 3, 1100}, false, false);
  const Compiled fused = compile(load_program(g, {}), fusion(true));
  ASSERT_EQ(fused.kernels.size(), 1u);
  EXPECT_NE(fused.emitted.cuda_source.find(flash ? "cg_flash_attention_split<cg_config, " : "cg_attention_row_streamed<1>("),
            std::string::npos);
  const uint64_t seed = test_seed();
  CheckedRun run = run_checked(fused, RunOptions{seed, work_dir(g.name)});
  EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
  if (flash) {
    CompileOptions hopper = fusion(true);
    hopper.emit.arch = "sm_90a";
    const Compiled on_sm90a = compile(load_program(g, {}), hopper);
    EXPECT_NE(on_sm90a.emitted.kernels[0].matmul_path.find(
                  "not on the Hopper path: a bias (an attention mask) is added to the scores"),
              std::string::npos)
        << on_sm90a.emitted.kernels[0].matmul_path;
  }
}

// The flash kernel, against the float64 reference and the unfused kernels
// (which store the scores): partial query and key tiles, several key tiles,
// the causal diagonal inside and across tiles with the top-left alignment
// where the lengths differ, lengths 1, 63, 1000 and 2049, head sizes 16 to 256 (128: 80 KiB of shared
// memory, opted in; 256: q read from shared memory, 32 keys a step; 192 and 160 padded), values of another width, over 1024 keys, where only this
// kernel fuses attention, grouped-query attention (4 query heads a head of
// keys and values; 2 over 1100 keys), and heads of 96 and 80 padded to tiles
// of 128. f32 keeps the row kernels (the streamed one over 1024 keys), and
// says why; they take grouped-query attention too.
TEST_P(FusedChains, FlashAttentionMatchesTheReferenceFusedAndUnfused) {
  struct Case {
    int64_t B, H, Tq, Tk, D, Dv;
    bool causal;
    int64_t G = 1;
    const char* split = "";  // where the keys split (few row tiles over many key tiles): how, as describe says
  };
  for (const Case& k : {Case{1, 2, 65, 65, 64, 64, false}, Case{2, 1, 130, 130, 32, 64, true},
                        Case{1, 1, 70, 40, 16, 16, true}, Case{1, 1, 20, 100, 128, 128, false},
                        Case{1, 1, 3, 1100, 64, 32, false, 1, "split-KV 4 ways (5 key tiles each)"},
                        Case{1, 2, 33, 33, 32, 32, true, 4},
                        Case{1, 1, 5, 1100, 32, 32, false, 2, "split-KV 4 ways (5 key tiles each)"},
                        Case{1, 2, 40, 70, 96, 80, true},
                        Case{1, 1, 70, 100, 256, 256, true}, Case{1, 1, 40, 40, 192, 160, false},
                        Case{1, 2, 1, 2049, 64, 64, false, 1, "split-KV 7 ways (5 key tiles each)"},
                        Case{1, 1, 63, 63, 64, 64, true},
                        Case{1, 1, 1000, 1000, 32, 32, true, 1, "split-KV 4 ways (4 key tiles each)"}}) {
    // The two long cases (1000 x 1000: 27 s of emulation here; 1 x 2049: 9 s) are over half of
    // this test's time; their paths (many row tiles, the causal skip over many key tiles, a 7-way
    // split combine) are the same code in both 16-bit types, whose own rounding every other case
    // covers: 1 x 2049 in f16 only, 1000 x 1000 in f32's row kernels only (the flash kernel's
    // causal split over 32 row tiles: FlashAttention.TwoThousandTokensEndToEnd, in bf16).
    if (GetParam() != DType::f32 && (k.Tq == 1000 || (GetParam() == DType::bf16 && k.Tk == 2049))) continue;
    // (Over many keys, scores spread wide: each split's maximum differs, which the combine must weigh.)
    const TaskGraph g = flash_attention(GetParam(), k.B, k.H, k.Tq, k.Tk, k.D, k.Dv, k.causal, k.G, k.Tk > 1024 ? 4.0 : 0.25);
    if (GetParam() == DType::f32) {
      // Over 1024 keys, the streamed row kernel (grouped-query attention too: each query head reads its group's keys).
      const Compiled c = expect_fused_and_unfused_right(g, 1, k.Tk > 1024 ? "cg_attention_row_streamed<" : "cg_attention_row(");
      EXPECT_NE(c.emitted.kernels[0].matmul_path.find("not flash attention: q, k and v are f32"), std::string::npos)
          << c.emitted.kernels[0].matmul_path;
      continue;
    }
    // Few row tiles over many key tiles split the keys (decoding; here also one head's 16 row tiles).
    const bool split = *k.split != 0;
    const Compiled c =
        expect_fused_and_unfused_right(g, 1, split ? "cg_flash_attention_split<cg_config, " : "cg_flash_attention<cg_config, ");
    EXPECT_EQ(c.emitted.kernels[0].matmul_path.find(split ? k.split : "split-KV") != std::string::npos, split)
        << c.emitted.kernels[0].matmul_path;
    EXPECT_EQ(c.emitted.kernels[0].smem_bytes > 48 * 1024, k.D > 64) << c.emitted.kernels[0].smem_bytes;
    EXPECT_EQ(c.emitted.kernels[0].matmul_path.find("heads of 96 (padded to 128) (values 80 (padded to 128))") !=
                  std::string::npos,
              k.D == 96)
        << c.emitted.kernels[0].matmul_path;
    EXPECT_EQ(c.emitted.kernels[0].matmul_path.find("32 keys a step") != std::string::npos, k.D > 128)
        << c.emitted.kernels[0].matmul_path;
    for (const auto& pb : c.plan.buffers)  // no T x T buffer in the arena
      if (const std::string name = buffer_name(c.program, pb.buffer); name == "scores.out" || name == "probs.out")
        EXPECT_TRUE(pb.internal) << name;
  }
}

TEST_P(FusedChains, NormPrologueMatchesTheReferenceFusedAndUnfused) {
  struct Case {
    std::string op;
    bool stored;
    int64_t K;
  };
  // Every rmsnorm form; layernorm staged and not stored (inference), per
  // element and stored (training's mean and rstd).
  for (const auto& [op, stored, K] : {Case{"rmsnorm", false, 40}, Case{"rmsnorm", false, 400}, Case{"rmsnorm", true, 40},
                                      Case{"rmsnorm", true, 400}, Case{"layernorm", false, 40},
                                      Case{"layernorm", true, 400}}) {
    // x | p + bias, with n (stored there) | q, with n
    const TaskGraph g = norm_prologue(GetParam(), K, stored, op);
    const std::string per_element = op == "rmsnorm" ? "cg_rmsnorm_rstd_rows([&]" : "cg_layernorm_stats_rows([&]";
    const Compiled c = expect_fused_and_unfused_right(g, 3, K == 40 ? "cg_" + op + "_stage_rows([&]" : per_element);
    EXPECT_EQ(c.kernels[1].prologue.size(), 1u);
    EXPECT_EQ(c.kernels[2].prologue.size(), 1u);
    EXPECT_EQ(stores_prologue(c.program, c.kernels[1]), stored);
    EXPECT_FALSE(stores_prologue(c.program, c.kernels[2]));
    const std::string stats = op == "rmsnorm" ? "rstd" : "mean, rstd";
    EXPECT_EQ(c.emitted.cuda_source.find("// n's output and " + stats + ", read later: stored once") != std::string::npos,
              stored);
    // The megakernel runs the same tile functions, each tile after the rows it reads.
    expect_megakernel_right(g);
  }
}

TEST_P(FusedChains, MatmulChainMatchesTheReferenceFusedAndUnfused) {
  for (bool epilogues : {true, false}) {
    const TaskGraph g = matmul_chain(GetParam(), epilogues);
    const Compiled c = expect_fused_and_unfused_right(g, 1, "__syncthreads();  // every column of the rows is in shared memory before down reads them");
    ASSERT_EQ(c.kernels.size(), 1u);
    EXPECT_EQ(c.kernels[0].rule, FusionRule::matmul_chain);
    EXPECT_EQ(c.kernels[0].prologue.size(), 1u);
    // 16-bit values are kept in shared memory as the type they would have been stored in.
    const std::string kept = GetParam() == DType::f32 ? "float* cg_value" : std::string(GetParam() == DType::f16 ? "cg_f16" : "cg_bf16") + "* cg_value";
    EXPECT_NE(c.emitted.cuda_source.find(kept), std::string::npos);
    // The megakernel runs the chain's tiles too.
    expect_megakernel_right(g);
  }
}

TEST_P(FusedChains, RowReductionMatchesTheReferenceFusedAndUnfused) {
  for (bool epilogue : {true, false}) {
    const TaskGraph g = row_reduction(GetParam(), epilogue);
    const Compiled c = expect_fused_and_unfused_right(g, 1, "__syncthreads();  // the next tile of rows overwrites it");
    ASSERT_EQ(c.kernels.size(), 1u);
    EXPECT_EQ(c.kernels[0].rule, FusionRule::row_reduction);
    const std::string& src = c.emitted.cuda_source;
    // The value is kept in shared memory as the type it would have been stored in; stored only where read.
    const std::string kept = GetParam() == DType::f32 ? "float* cg_value" : std::string(GetParam() == DType::f16 ? "cg_f16" : "cg_bf16") + "* cg_value";
    EXPECT_NE(src.find(kept), std::string::npos);
    EXPECT_EQ(src.find("cg_store(dx_dx, i,") != std::string::npos, epilogue) << src;
    expect_megakernel_right(g);
  }
}

TEST_P(FusedChains, ProjectedAttentionMatchesTheReferenceFusedAndUnfused) {
  for (bool gpt : {true, false}) {
    const TaskGraph g = projected_attention(GetParam(), gpt);
    const Compiled c = expect_fused_and_unfused_right(g, 1, "// Projections (attention_projection)");
    ASSERT_EQ(c.kernels.size(), 1u);
    EXPECT_EQ(kernel_rules(c.program, c.kernels[0]).back(), "attention");
    const std::string& src = c.emitted.cuda_source;
    EXPECT_EQ(src.find("cg_layernorm_stage_rows([&]") != std::string::npos, gpt);
    // q's heads, read by the caller, are stored as they are computed; k's and v's are not.
    EXPECT_EQ(src.find("q_heads.out, read later") != std::string::npos, gpt);
    EXPECT_EQ(src.find("k_heads.out, read later"), std::string::npos);
    EXPECT_EQ(src.find("v_heads.out, read later") != std::string::npos, gpt) << "the epilogue loads it";
    EXPECT_EQ(src.find("// ln's output and mean, rstd, read later: stored once, by each batch's first head") !=
                  std::string::npos,
              gpt);
    // The megakernel runs it too.
    expect_megakernel_right(g);
  }
}

TEST_P(FusedChains, MatmulSumMatchesTheReferenceFusedAndUnfused) {
  for (bool epilogue : {true, false}) {
    const TaskGraph g = matmul_sum(GetParam(), epilogue);
    const Compiled c = expect_fused_and_unfused_right(g, 1, "// m1 + m2 + m3: one product over k in [0, 59)");
    ASSERT_EQ(c.kernels.size(), 1u);
    EXPECT_EQ(c.kernels[0].rule, FusionRule::matmul_sum);
    const std::string& src = c.emitted.cuda_source;
    EXPECT_EQ(src.find("cg_epilogue(") != std::string::npos, epilogue);
    EXPECT_EQ(src.find("m1_out"), std::string::npos) << "the terms never reach memory";
    EXPECT_EQ(src.find("s1_out"), std::string::npos) << "nor the partial sum";
    expect_megakernel_right(g);
  }
}

TEST_P(FusedChains, AttentionGradientMatchesTheReferenceFusedAndUnfused) {
  for (const std::string which : {"all", "keys", "queries"}) {
    const TaskGraph g = attention_gradient(GetParam(), which);
    const Compiled c = expect_fused_and_unfused_right(g, 1, "cg_attention_backward_row(");
    ASSERT_EQ(c.kernels.size(), 1u);
    EXPECT_EQ(c.kernels[0].rule, FusionRule::attention_backward);
    const std::string& src = c.emitted.cuda_source;
    // dp and ds stay in the kernel, rounded where the unfused kernels would have stored them.
    EXPECT_EQ(src.find("dp_out"), std::string::npos);
    EXPECT_EQ(src.find("ds_dx"), std::string::npos);
    EXPECT_EQ(src.find("[&](float x) { return cg_widen(cg_narrow<") != std::string::npos, GetParam() != DType::f32);
    EXPECT_EQ(src.find("float cg_acc_dk[") != std::string::npos, which != "queries");
    EXPECT_EQ(src.find("float* cg_keys") != std::string::npos, which != "keys") << "the keys are staged for dq only";
    expect_megakernel_right(g);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedChains, ::testing::Values(DType::f32, DType::f16, DType::bf16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// The examples, training steps among them: fused where the rules allow, the
// same outputs and updated weights as the reference.
TEST(Fusion, ExamplesMatchTheReferenceFused) {
  for (const char* example : {"mlp_forward.json", "train_mlp.json", "transformer_block.json", "train_transformer.json"}) {
    Compiled c = compile(load_program(test_source_dir() + "/examples/" + example, {}), fusion(true));
    size_t fused = 0;
    for (const auto& k : c.kernels) fused += k.tasks.size() > 1;
    EXPECT_GT(fused, 0u) << example << ": no kernel fused";
    const uint64_t seed = test_seed();
    RunOptions options{seed, work_dir(example)};
    options.steps = std::string(example).rfind("train_", 0) == 0 ? 2 : 0;
    CheckedRun run = run_checked(c, options);
    EXPECT_TRUE(run.ok()) << example << " seed " << seed << "\n" << format_run(run);
  }
}

// Flash attention at a real length, end to end in the emulation: 2048 tokens,
// causal, a head of 64 in bf16 (32 row tiles of 64, up to 32 key tiles each,
// the keys split 8 ways), against the float64 reference.
TEST(FlashAttention, TwoThousandTokensEndToEnd) {
  const TaskGraph g = flash_attention(DType::bf16, 1, 1, 2048, 2048, 64, 64, true);
  const uint64_t seed = test_seed();
  const Compiled c = compile(load_program(g, {}), fusion(true));
  ASSERT_EQ(c.kernels.size(), 1u);
  // (32 row tiles fill few SMs: the keys split too, causal ranges past a tile's rows left empty.)
  ASSERT_NE(c.emitted.cuda_source.find("cg_flash_attention_split<cg_config, "), std::string::npos);
  CheckedRun run = run_checked(c, RunOptions{seed, work_dir(g.name)});
  EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
}

std::string normwise_failures(const CheckedRun& run, double u);

// A fault injected into compiled code `c`: the first `from` after `marker`
// in its source becomes `to`; the run must fail its checks (with
// `normwise_u`, the normwise bound of that unit roundoff too: attention's
// gradients, whose elementwise bound can pass a wrong dq).
void expect_fault_caught(Compiled c, const std::string& marker, const std::string& from, const std::string& to,
                         const std::string& name, double normwise_u = 0) {
  std::string& source = c.emitted.cuda_source;
  const size_t after = source.find(marker);
  ASSERT_NE(after, std::string::npos) << name << ": the template changed; update the fault";
  const size_t at = source.find(from, after);
  ASSERT_NE(at, std::string::npos) << name << ": the template changed; update the fault";
  source.replace(at, from.size(), to);
  const uint64_t seed = test_seed();
  // Caught: a wrong result, or the emulator's report (a hang, a race) stopping the run.
  bool caught = false;
  try {
    const CheckedRun run = run_checked(c, RunOptions{seed, work_dir(name)});
    caught = !run.ok() || (normwise_u > 0 && !normwise_failures(run, normwise_u).empty());
  } catch (const std::exception& e) {
    caught = std::string(e.what()).find("in emulation") != std::string::npos;
    EXPECT_TRUE(caught) << name << ": " << e.what();
  }
  EXPECT_TRUE(caught) << name << ": seed " << seed;
}

// f32 attention under --allow-tf32 on the flash kernel as TF32 (m16n8k8; p's
// fragments shuffled from the scores' accumulators): against the float64
// reference at f16's bound (TF32 keeps f16's 10 mantissa bits), causal with
// partial tiles, heads of 128 (32 keys a step) over 1100 keys split,
// grouped-query attention; heads of 16 refused, and said why. A fault taking
// p's values from the wrong lanes of the quad is caught.
TEST(FlashAttention, Tf32MatchesTheReference) {
  CompileOptions tf32 = fusion(true);
  tf32.emit.allow_tf32 = true;
  struct Case {
    int64_t H, Tq, Tk, D;
    bool causal;
    int64_t G = 1;
  };
  for (const Case& k : {Case{2, 70, 100, 64, true}, Case{1, 40, 1100, 128, false}, Case{2, 33, 65, 32, true, 4}}) {
    const TaskGraph g = flash_attention(DType::f32, 1, k.H, k.Tq, k.Tk, k.D, k.D, k.causal, k.G, k.Tk > 1024 ? 4.0 : 0.25);
    SCOPED_TRACE(g.name);
    const Compiled c = compile(load_program(g, {}), tf32);
    ASSERT_EQ(c.kernels.size(), 1u);
    EXPECT_NE(c.emitted.cuda_source.find("<cg_config, cg_tf32>("), std::string::npos);
    EXPECT_NE(c.emitted.kernels[0].matmul_path.find("f32 as TF32 (--allow-tf32)"), std::string::npos)
        << c.emitted.kernels[0].matmul_path;
    EXPECT_EQ(c.emitted.kernels[0].mainloop, MatmulMainloop::flash_attention_tf32);
    const uint64_t seed = test_seed();
    CheckedRun run = run_checked(c, RunOptions{seed, work_dir(g.name)});
    EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
  }
  // Without the flag, or with heads the TF32 kernel does not take: the row kernel, and why.
  const Compiled plain = compile(load_program(flash_attention(DType::f32, 1, 1, 40, 40, 64, 64, true), {}), fusion(true));
  EXPECT_NE(plain.emitted.kernels[0].matmul_path.find("--allow-tf32 runs it as TF32"), std::string::npos)
      << plain.emitted.kernels[0].matmul_path;
  const Compiled narrow = compile(load_program(flash_attention(DType::f32, 1, 1, 40, 40, 16, 16, true), {}), tf32);
  EXPECT_NE(narrow.emitted.kernels[0].matmul_path.find("the TF32 kernel takes heads of 32 to 128"), std::string::npos)
      << narrow.emitted.kernels[0].matmul_path;
  // The fault: p's columns from the wrong lanes.
  expect_fault_caught(compile(load_program(flash_attention(DType::f32, 1, 1, 70, 100, 64, 64, true), {}), tf32),
                      "cg_flash_p_fragment", "(lane & ~3) + 2 * half + (t >> 1);", "(lane & ~3) + 2 * half + (t & 1);",
                      "flash_tf32_fault");
}

// Over 1024 keys where the flash kernel does not apply, the streamed row
// kernel (two passes over a row's keys, no scores kept): probabilities read
// later (a training step's backward pass reads them), so stored; 40 query
// rows over 1100 keys in 2 heads; then a head of 68 values, which the flash
// kernel does not take, causal over 1100 query rows.
TEST_P(FusedChains, StreamedAttentionOverAThousandKeysMatchesTheReference) {
  const TaskGraph stored = flash_attention(GetParam(), 1, 2, 40, 1100, 32, 32, false, 1, 4.0, true);
  const Compiled c = expect_fused_and_unfused_right(stored, 1, "cg_attention_row_streamed<1>(");
  EXPECT_NE(c.emitted.cuda_source.find("cg_store(probs, "), std::string::npos) << "the probabilities are stored";
  if (GetParam() != DType::f32)
    EXPECT_NE(c.emitted.kernels[0].matmul_path.find("not flash attention: the probabilities 'probs.out' are stored"),
              std::string::npos)
        << c.emitted.kernels[0].matmul_path;
  // (Fused only: unfused, the emulation would take 1100 x 1100 scores through the 64 x 64 tile.)
  const TaskGraph causal = flash_attention(GetParam(), 1, 1, 1100, 1100, 68, 40, true, 1, 4.0);
  const Compiled fused = compile(load_program(causal, {}), fusion(true));
  ASSERT_EQ(fused.kernels.size(), 1u);
  EXPECT_NE(fused.emitted.cuda_source.find("cg_attention_row_streamed<2>("), std::string::npos);
  const uint64_t seed = test_seed();
  CheckedRun run = run_checked(fused, RunOptions{seed, work_dir(causal.name)});
  EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
}

// A GPT-2-small block's forward in bf16 (bench/decoder_graph.py) keeps no
// buffer of T x T: from 4096 to 8192 tokens its arena grows with T, at most
// 2.1x, where scores and probabilities would make it 4x.
TEST(FlashAttention, ArenaOfADecoderBlockGrowsLinearlyInTokens) {
  const std::string dir = (std::filesystem::temp_directory_path() / fmt::format("cudagen_arena_{}", getpid())).string();
  std::filesystem::create_directories(dir);
  std::vector<int64_t> arena;
  for (int tokens : {4096, 8192}) {
    const std::string graph = fmt::format("{}/decoder_{}.json", dir, tokens);
    const std::string command = fmt::format(
        "/usr/bin/python3 {}/bench/decoder_graph.py --layers 1 --batch 8 --tokens {} --dtype bf16 -o {}",
        CUDAGEN_SOURCE_DIR, tokens, graph);
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    const Compiled c = compile(load_program(read_graph(read_text_file(graph)), {}), {});
    for (const auto& pb : c.plan.buffers) {
      const Shape& shape = c.program.buffers[size_t(pb.buffer)].shape;
      EXPECT_TRUE(pb.internal || shape.size() < 2 || shape[shape.size() - 1] != tokens || shape[shape.size() - 2] != tokens)
          << buffer_name(c.program, pb.buffer) << " is " << shape_to_string(shape) << " in the arena";
    }
    arena.push_back(c.emitted.arena_bytes);
  }
  std::filesystem::remove_all(dir);
  EXPECT_LE(double(arena[1]), 2.1 * double(arena[0])) << arena[0] << " -> " << arena[1] << " bytes";
  std::printf("  arena of the block: %lld bytes at 4096 tokens, %lld at 8192\n", (long long)arena[0], (long long)arena[1]);
}

// An arena for `c` with its 16-bit inputs (task, slot) of type `d` drawn
// uniformly from [-1, 1] by a generator seeded with `seed`, zeros elsewhere.
std::vector<unsigned char> arena_with_inputs(const Compiled& c, std::initializer_list<std::pair<const char*, const char*>> inputs,
                                             DType d, unsigned seed) {
  std::vector<unsigned char> arena(size_t(c.plan.arena_bytes), 0);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> value(-1.0, 1.0);
  for (const auto& [task, slot] : inputs) {
    const Plan::Location at = c.plan.lookup(c.program, task, slot);
    for (int64_t i = 0; i < at.bytes / 2; ++i) store_element(arena.data() + at.offset + 2 * i, d, value(rng));
  }
  return arena;
}

// The outputs of `run` whose largest error exceeds 4 units of roundoff of
// `d` times their largest reference value, or empty. The gradients of q and
// k go through softmax's, dp - delta, a difference of nearly equal terms, where
// the elementwise first-order bound grows loose enough to pass a wrong
// gradient (a missing delta, measured); the normwise bound does not (the
// kernels land within 1.3 units, measured over the cases below).
std::string normwise_failures(const CheckedRun& run, double u) {
  std::string out;
  for (const OutputCheck& check : run.checks)
    if (check.max_abs_error > 4 * u * check.max_reference)
      out += fmt::format("{}: max |err| {:.3g} over 4u max |ref| = {:.3g}; ", check.buffer, check.max_abs_error,
                         4 * u * check.max_reference);
  return out;
}
std::string normwise_failures(const CheckedRun& run, DType d) {
  return normwise_failures(run, d == DType::bf16 ? 0x1p-8 : d == DType::f16 ? 0x1p-11 : 0x1p-24);
}

// An attention trained on the flash kernels (`c`, of graph `name`, Tq query
// rows over Tk keys): no Tq x Tk buffer in its arena (the probabilities
// recomputed, never stored), and its run within the checker's bounds and the
// normwise one of unit roundoff `u`.
void expect_trained_attention_right(const Compiled& c, const std::string& name, int64_t Tq, int64_t Tk, double u) {
  for (const auto& pb : c.plan.buffers) {
    const Shape& shape = c.program.buffers[size_t(pb.buffer)].shape;
    EXPECT_TRUE(pb.internal || shape.size() < 2 || shape.back() != Tk || shape[shape.size() - 2] != Tq)
        << buffer_name(c.program, pb.buffer) << " " << shape_to_string(shape) << " is in the arena";
  }
  const uint64_t seed = test_seed();
  CheckedRun run = run_checked(c, RunOptions{seed, work_dir(name)});
  EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
  EXPECT_EQ(normwise_failures(run, u), "") << "seed " << seed;
}

// Training on the flash kernels: the forward saves each row's log-sum-exp
// and its output, the gradient kernel recomputes the probabilities tile by
// tile (no T x T buffer), in one kernel of two kinds of block; against the
// float64 reference at lengths that are not multiples of a tile (1 query row
// over 2049 keys, 63, 65), query and key lengths that differ (the causal
// diagonal top-left), heads of 16 (64 streamed rows a step), 32, 64, 80 (padded), 128, 256 (two
// key blocks a tile of keys, each half of dk's and dv's columns) and 200 (padded to 256: the second
// half's last columns not stored), heads of 256 with values of 32 (32 rows a step), f16 and bf16.
// (`arch` "sm_90a": the same cases compiled for Hopper, where those whose
// heads the Hopper kernels take, up to 128 (16 and 32 padded to 64), train on
// them, forward and backward, the one query row over 2049 keys split 4 ways
// on the Hopper forward; heads over 128 stay on part 1's.)
void expect_training_gradients_match(const std::string& arch) {
  CompileOptions options = fusion(true);
  if (!arch.empty()) options.emit.arch = arch;
  struct Case {
    DType d;
    int64_t H, Tq, Tk, D;
    bool causal;
    int64_t Dv = 0;
  };
  for (const Case& k : {Case{DType::bf16, 2, 63, 63, 64, true}, Case{DType::f16, 1, 65, 65, 64, true},
                        Case{DType::bf16, 1, 130, 70, 64, true}, Case{DType::f16, 1, 70, 130, 32, true},
                        Case{DType::bf16, 1, 100, 100, 128, true}, Case{DType::bf16, 1, 90, 90, 80, true},
                        Case{DType::f16, 1, 70, 70, 16, true},
                        Case{DType::bf16, 1, 1, 2049, 64, false}, Case{DType::bf16, 1, 70, 90, 256, true},
                        Case{DType::f16, 1, 65, 65, 200, true}, Case{DType::bf16, 1, 40, 40, 256, false, 32}}) {
    const TaskGraph g = flash_attention_training(k.d, 1, k.H, k.Tq, k.Tk, k.D, k.causal, k.Dv);
    SCOPED_TRACE(g.name + (arch.empty() ? "" : " for " + arch));
    const Compiled c = compile(load_program(g, {}), options);
    ASSERT_EQ(c.kernels.size(), 2u);
    EXPECT_TRUE(c.kernels[0].flash_trained && c.kernels[1].flash_trained);
    EXPECT_EQ(c.kernels[1].rule, FusionRule::attention_backward);
    // sm_90a: the Hopper kernels for every head.
    const bool hopper = arch == "sm_90a";
    if (hopper)
      EXPECT_TRUE(c.emitted.cuda_source.find("cg_flash_attention_sm90<cg_config, ") != std::string::npos ||
                  c.emitted.cuda_source.find("cg_flash_attention_split_sm90<cg_config, ") != std::string::npos)
          << c.emitted.kernels[0].matmul_path;
    EXPECT_NE(c.emitted.cuda_source.find(hopper ? "cg_flash_attention_backward_sm90<cg_config, "
                                                : "cg_flash_attention_backward<cg_config, "),
              std::string::npos);
    if (hopper && k.Tk > 2000)
      EXPECT_NE(c.emitted.cuda_source.find("cg_flash_attention_split_sm90<cg_config, "), std::string::npos);
    if (k.D > 128)
      for (const EmittedKernel& e : c.emitted.kernels)
        if (e.matmul_path.find("flash attention backward") != std::string::npos)
          EXPECT_NE(e.matmul_path.find("2 a tile of keys, each summing a share of their columns"), std::string::npos)
              << e.matmul_path;
    expect_trained_attention_right(c, g.name + (arch.empty() ? "" : "_" + arch), k.Tq, k.Tk,
                                   k.d == DType::bf16 ? 0x1p-8 : 0x1p-11);
  }
}

TEST(FlashAttention, TrainingGradientsMatchTheReference) { expect_training_gradients_match(""); }

// Part 1's training cases compiled for sm_90a (issue #39).
TEST(FlashAttention, TrainingGradientsMatchTheReferenceOnSm90a) { expect_training_gradients_match("sm_90a"); }

// The Hopper forward (templates/softmax_flash_sm90.cuh, issue #39) for
// sm_90a, against the float64 reference in the emulation (which runs its
// TMA copies, mbarriers and wgmmas exactly, the register-A ones included):
// partial row and key tiles, two heads (a tile's rows past its head's
// length come as zeros through the 3-D maps), several key tiles through two
// stages, the causal diagonal inside and across tiles with lengths that
// differ (top-left), grouped-query attention, heads of 64, 128 and 96
// (padded), of 256 and 192 and 160 (padded to 192; 64 keys a step), one
// query row, 1100 keys. Decoding that splits the keys takes the Hopper
// kernel's split form (empty splits included; heads of 256), bit-identical
// from run to run; other targets never take it. Four faults, each caught: o
// not carried from one key tile to the next, the causal mask one key late,
// the values read before they land, the two consumers' warps counting in
// on one counter (the rows combined before every split has arrived).
TEST(FlashAttention, HopperPathMatchesTheReference) {
  CompileOptions hopper = fusion(true);
  hopper.emit.arch = "sm_90a";
  struct Case {
    DType d;
    int64_t B, H, Tq, Tk, D;
    bool causal;
    int64_t G = 1;
  };
  for (const Case& k : {Case{DType::bf16, 1, 2, 65, 65, 64, false}, Case{DType::f16, 2, 1, 130, 130, 64, true},
                        Case{DType::bf16, 1, 1, 70, 300, 128, false}, Case{DType::bf16, 1, 2, 33, 33, 64, true, 4},
                        Case{DType::f16, 1, 1, 40, 200, 96, true}, Case{DType::bf16, 1, 1, 150, 60, 64, true},
                        Case{DType::f16, 1, 1, 1, 300, 128, false}, Case{DType::bf16, 1, 2, 130, 200, 256, true},
                        Case{DType::f16, 1, 1, 70, 300, 192, false}, Case{DType::bf16, 1, 1, 40, 130, 160, true}}) {
    const TaskGraph g = flash_attention(k.d, k.B, k.H, k.Tq, k.Tk, k.D, k.D, k.causal, k.G);
    SCOPED_TRACE(g.name);
    const Compiled c = compile(load_program(g, {}), hopper);
    ASSERT_EQ(c.emitted.kernels.size(), 1u);
    const EmittedKernel& e = c.emitted.kernels[0];
    EXPECT_NE(c.emitted.cuda_source.find("cg_flash_attention_sm90<cg_config, "), std::string::npos);
    EXPECT_EQ(c.emitted.cuda_source.find("cg_flash_attention<"), std::string::npos) << "part 1's kernel left out";
    EXPECT_EQ(e.mainloop, MatmulMainloop::flash_attention_hopper);
    EXPECT_EQ(e.block, 384);
    EXPECT_EQ(e.tensor_maps.size(), 3u);
    for (const auto& [arg, map] : e.tensor_maps) EXPECT_EQ(map.rank(), 3) << "a plane a head";
    const std::string heads = k.D == 96    ? "96 (padded to 128)"
                              : k.D == 160 ? "160 (padded to 192)"
                                           : std::to_string(k.D);
    EXPECT_NE(e.matmul_path.find(fmt::format("{} keys a step, 2 stages, heads of {}", k.D > 128 ? 64 : 128, heads)),
              std::string::npos)
        << e.matmul_path;
    for (size_t i = 0; i < e.tensor_maps.size(); ++i)  // q's (the first) boxes of 128 rows, k's and v's of a key tile's
      EXPECT_EQ(e.tensor_maps[i].second.box_height, i == 0 || k.D <= 128 ? 128 : 64) << "map " << i;
    const uint64_t seed = test_seed();
    CheckedRun run = run_checked(c, RunOptions{seed, work_dir(g.name + "_sm90a")});
    EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
  }
  {  // Many key tiles (9, through 2 stages: each barrier's parity flips 4 times) for 2 row tiles. On a
     // GPU of one SM, so that the keys are not split (132 SMs would split them for these few blocks).
    CompileOptions one_sm = hopper;
    one_sm.emit.sms = 1;
    const TaskGraph g = flash_attention(DType::f16, 1, 1, 130, 1100, 64, 64, false);
    SCOPED_TRACE(g.name);
    const Compiled c = compile(load_program(g, {}), one_sm);
    EXPECT_NE(c.emitted.cuda_source.find("cg_flash_attention_sm90<cg_config, "), std::string::npos);
    const uint64_t seed = test_seed();
    CheckedRun run = run_checked(c, RunOptions{seed, work_dir(g.name + "_sm90a")});
    EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
  }
  // Decoding over many keys: split-KV on the Hopper kernel (each consumer
  // warp's rows combined by the last of their splits to arrive), one query
  // row over 2100 keys (4 splits of 5 key tiles, the last partial), and
  // causal over 1100 keys, where a row tile's keys end before its second
  // split (an empty one) but for its last row tile.
  // Heads of 256: 64 keys a step, 2100 keys 33 tiles in 7 splits of 5.
  for (const auto& [Tq, Tk, causal, ways, D, tiles] :
       {std::tuple{int64_t(1), int64_t(2100), false, 4, int64_t(64), 5},
        std::tuple{int64_t(700), int64_t(1100), true, 2, int64_t(64), 5},
        std::tuple{int64_t(1), int64_t(2100), false, 7, int64_t(256), 5}}) {
    const TaskGraph g = flash_attention(DType::bf16, 1, 1, Tq, Tk, D, D, causal);
    SCOPED_TRACE(g.name);
    const Compiled c = compile(load_program(g, {}), hopper);
    EXPECT_NE(c.emitted.cuda_source.find("cg_flash_attention_split_sm90<cg_config, "), std::string::npos);
    EXPECT_NE(c.emitted.kernels[0].matmul_path.find(fmt::format("split-KV {} ways ({} key tiles each)", ways, tiles)),
              std::string::npos)
        << c.emitted.kernels[0].matmul_path;
    EXPECT_EQ(c.emitted.kernels[0].grid[2], ways);
    const uint64_t seed = test_seed();
    CheckedRun run = run_checked(c, RunOptions{seed, work_dir(g.name + "_sm90a")});
    EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
  }
  {  // Twice on one arena: the same output bit for bit, the counters left zero.
    const Compiled c = compile(load_program(flash_attention(DType::f16, 1, 2, 3, 1100, 128, 128, false), {}), hopper);
    ASSERT_NE(c.emitted.cuda_source.find("cg_flash_attention_split_sm90<cg_config, "), std::string::npos);
    ASSERT_GT(c.emitted.sync_bytes, 0);
    std::unique_ptr<Executor> executor = cudagen::testing::make_test_executor(c, work_dir("hopper_split_twice"));
    const std::vector<unsigned char> arena =
        arena_with_inputs(c, {{"scores", "a"}, {"scores", "b"}, {"context", "b"}}, DType::f16, 11);
    executor->write(0, arena.data(), arena.size());
    const Plan::Location out = c.plan.lookup(c.program, "merged", "out");
    std::vector<unsigned char> first(size_t(out.bytes)), second(size_t(out.bytes));
    executor->run(phase_function(Phase::forward));
    executor->read(out.offset, first.data(), first.size());
    executor->run(phase_function(Phase::forward));
    executor->read(out.offset, second.data(), second.size());
    EXPECT_TRUE(first == second) << "the second run's output differs";
    EXPECT_GT(std::count_if(first.begin(), first.end(), [](unsigned char b) { return b != 0; }), 0);
    std::vector<unsigned char> sync(size_t(c.emitted.sync_bytes));
    executor->read(c.emitted.sync_offset, sync.data(), sync.size());
    EXPECT_EQ(std::count(sync.begin(), sync.end(), 0), std::ptrdiff_t(sync.size())) << "counters left nonzero";
  }
  for (const char* arch : {"sm_90", "sm_80", "sm_100"}) {  // no wgmma there
    CompileOptions other = fusion(true);
    other.emit.arch = arch;
    const Compiled c = compile(load_program(flash_attention(DType::bf16, 1, 2, 65, 65, 64, 64, false), {}), other);
    EXPECT_EQ(c.emitted.cuda_source.find("cg_flash_attention_sm90"), std::string::npos) << arch;
    EXPECT_NE(c.emitted.cuda_source.find("cg_flash_attention<cg_config, "), std::string::npos) << arch;
  }
  const char* kernel = "CG_DEVICE void cg_flash_sm90_consume(";
  expect_fault_caught(compile(load_program(flash_attention(DType::bf16, 1, 1, 70, 300, 128, 128, false), {}), hopper),
                      kernel, "Config::KV_CHUNK_BYTES, n > first);", "Config::KV_CHUNK_BYTES, false);",
                      "hopper_flash_fault_accumulate");
  expect_fault_caught(compile(load_program(flash_attention(DType::bf16, 1, 1, 65, 65, 64, 64, true), {}), hopper), kernel,
                      "warp_row0, row0, causal);", "warp_row0, row0 + 1, causal);", "hopper_flash_fault_mask");
  expect_fault_caught(compile(load_program(flash_attention(DType::f16, 1, 1, 70, 300, 64, 64, false), {}), hopper), kernel,
                      "cg_mbarrier_wait(l.v_full(read.stage), read.phase);",
                      "cg_mbarrier_wait(l.v_full(read.stage), read.phase ^ 1u);", "hopper_flash_fault_values_early");
  expect_fault_caught(compile(load_program(flash_attention(DType::bf16, 1, 1, 70, 2100, 64, 64, false), {}), hopper),
                      "CG_DEVICE void cg_flash_attention_split_sm90(", "arrivals + consumer * 4 + warp,",
                      "arrivals + warp,", "hopper_flash_fault_split_counter");
}

// The Hopper backward (cg_flash_attention_backward_sm90, issue #39) for
// sm_90a, trained with the Hopper forward, against the float64 reference
// and the normwise bound: partial tiles of both kinds, query and key lengths
// that differ both ways (the causal diagonal top-left; key blocks past the
// last query row see none), two heads, heads of 64, 128 and 80 (padded to
// 128), values of another width (64 with 128, 128 with 48: padded to 64),
// heads of 256 and 192 (padded to 256) and values of 256 beside heads of 64
// (padded to 128): two key blocks a tile of keys, 32 rows a step;
// grouped-query attention from the derive pass, 300 tokens (3 key
// blocks and 3 query blocks a head, 5 steps through 2 stages). Asked for the
// atomic mode it stays deterministic and says so; other targets keep part
// 1's kernel. Four faults, each caught: the causal mask one query late in
// the key blocks, a step's statistics read before they land, a key block's
// dv summed from the other block's columns of dO, dq's product
// reading the values in place of the keys.
TEST(FlashAttention, HopperBackwardMatchesTheReference) {
  CompileOptions hopper = fusion(true);
  hopper.emit.arch = "sm_90a";
  auto backward_path = [](const Compiled& c) {
    for (const EmittedKernel& e : c.emitted.kernels)
      if (e.matmul_path.find("flash attention backward") != std::string::npos) return e;
    return EmittedKernel{};
  };
  struct Case {
    DType d;
    int64_t H, Tq, Tk, D;
    bool causal;
    int64_t Dv = 0;
  };
  for (const Case& k : {Case{DType::bf16, 2, 130, 100, 64, true}, Case{DType::f16, 1, 65, 65, 64, true},
                        Case{DType::bf16, 1, 70, 200, 128, false}, Case{DType::f16, 1, 90, 90, 80, true},
                        Case{DType::bf16, 1, 60, 200, 64, true}, Case{DType::bf16, 1, 300, 300, 64, true},
                        Case{DType::bf16, 1, 100, 130, 64, true, 128}, Case{DType::f16, 1, 130, 70, 128, false, 48},
                        Case{DType::bf16, 2, 130, 100, 256, true}, Case{DType::f16, 1, 70, 200, 192, false},
                        Case{DType::bf16, 1, 100, 70, 64, true, 256}}) {
    const TaskGraph g = flash_attention_training(k.d, 1, k.H, k.Tq, k.Tk, k.D, k.causal, k.Dv);
    SCOPED_TRACE(g.name);
    const Compiled c = compile(load_program(g, {}), hopper);
    EXPECT_NE(c.emitted.cuda_source.find("cg_flash_attention_sm90<cg_config, "), std::string::npos);
    EXPECT_NE(c.emitted.cuda_source.find("cg_flash_attention_backward_sm90<cg_config, "), std::string::npos);
    EXPECT_EQ(c.emitted.cuda_source.find("cg_flash_attention_backward<"), std::string::npos) << "part 1's left out";
    const EmittedKernel e = backward_path(c);
    EXPECT_EQ(e.block, 384);
    EXPECT_EQ(e.mainloop, MatmulMainloop::flash_attention_hopper);
    EXPECT_EQ(e.tensor_maps.size(), 4u) << "q, k, v and dO";
    for (const auto& [arg, map] : e.tensor_maps) EXPECT_EQ(map.rank(), 3) << "a plane a head";
    // Over heads of 128: 32 rows a step, two key blocks a tile of keys, tiles of 256 (the other at least 128).
    const bool wide = std::max(k.D, k.Dv) > 128;
    const std::string heads = fmt::format("heads of {}", k.D == 80    ? "80 (padded to 128)"
                                                         : k.D == 192 ? "192 (padded to 256)"
                                                         : k.D == 64 && wide ? "64 (padded to 128)"
                                                                             : std::to_string(k.D)) +
                              (k.Dv == 0 ? "" : k.Dv == 48 ? " (values 48 (padded to 64))" : fmt::format(" (values {})", k.Dv));
    EXPECT_NE(e.matmul_path.find(heads), std::string::npos) << e.matmul_path;
    EXPECT_NE(e.matmul_path.find(wide ? "32 rows a step" : "64 rows a step"), std::string::npos) << e.matmul_path;
    EXPECT_EQ(e.matmul_path.find("2 a tile of keys, each summing a share of their columns") != std::string::npos, wide)
        << e.matmul_path;
    expect_trained_attention_right(c, g.name + "_sm90a", k.Tq, k.Tk, k.d == DType::bf16 ? 0x1p-8 : 0x1p-11);
  }
  {
    const TaskGraph g = grouped_query_training(DType::bf16, 65, 65, 64, true);
    const Compiled c = compile(load_program(g, {}), hopper);
    EXPECT_NE(backward_path(c).matmul_path.find("on the Hopper path"), std::string::npos) << backward_path(c).matmul_path;
    EXPECT_NE(backward_path(c).matmul_path.find("grouped-query: 4 query heads a head of keys and values"),
              std::string::npos)
        << backward_path(c).matmul_path;
    expect_trained_attention_right(c, g.name + "_sm90a", 65, 65, 0x1p-8);
  }
  {  // The atomic mode asked for: the Hopper kernel, deterministic, and why.
    CompileOptions atomic = hopper;
    atomic.emit.atomic_attention_backward = true;
    const Compiled c = compile(load_program(flash_attention_training(DType::bf16, 1, 1, 65, 65, 64, true), {}), atomic);
    EXPECT_NE(backward_path(c).matmul_path.find("the Hopper kernel has no atomic mode"), std::string::npos)
        << backward_path(c).matmul_path;
  }
  for (const char* arch : {"sm_90", "sm_80"}) {  // no wgmma there
    CompileOptions other = fusion(true);
    other.emit.arch = arch;
    const Compiled c = compile(load_program(flash_attention_training(DType::bf16, 1, 1, 65, 65, 64, true), {}), other);
    EXPECT_EQ(c.emitted.cuda_source.find("_sm90"), std::string::npos) << arch;
    EXPECT_NE(c.emitted.cuda_source.find("cg_flash_attention_backward<cg_config, "), std::string::npos) << arch;
  }
  const std::string keys = "CG_DEVICE void cg_flash_backward_keys_sm90(";
  expect_fault_caught(compile(load_program(flash_attention_training(DType::bf16, 1, 1, 130, 130, 64, true), {}), hopper),
                      keys, "if (edge && past + 8 * (e >> 1) > 8 * j", "if (edge && past + 8 * (e >> 1) > 1 + 8 * j",
                      "hopper_flash_backward_fault_mask");
  expect_fault_caught(compile(load_program(flash_attention_training(DType::f16, 1, 1, 200, 70, 64, false), {}), hopper),
                      keys, "cg_mbarrier_wait(&l.stats_full[read.stage], read.phase);",
                      "cg_mbarrier_wait(&l.stats_full[read.stage], read.phase ^ 1u);",
                      "hopper_flash_backward_fault_stats_early");
  expect_fault_caught(compile(load_program(flash_attention_training(DType::bf16, 1, 1, 70, 130, 256, false), {}), hopper),
                      keys, "dout_tile + (unsigned int)(part * (PV / 64)",
                      "dout_tile + (unsigned int)((1 - part) * (PV / 64)", "hopper_flash_backward_fault_wide_share");
  expect_fault_caught(compile(load_program(flash_attention_training(DType::bf16, 1, 1, 70, 130, 64, false), {}), hopper),
                      "CG_DEVICE void cg_flash_backward_queries_sm90(", "(&dq[0][0], dsa, k_tile,",
                      "(&dq[0][0], dsa, v_tile,", "hopper_flash_backward_fault_dq_operand", 0x1p-8);
}

// Part 1's forward cases (FusedChains.FlashAttentionMatchesTheReferenceFusedAndUnfused)
// compiled for sm_90a (issue #39), the 16-bit types alternating case by
// case, against the float64 reference, every one on the Hopper kernel:
// heads of 16 and 32 padded to 64, values of another width (32 with 64, 96
// with 80, 160 with 192: padded to 192), heads of 256 (64 keys a step), the
// keys split for decoding. (Part 1's two long cases, 1000 x 1000 and 1 x
// 2049, are its split path again: left to that test.)
TEST(FlashAttention, ForwardCasesMatchTheReferenceOnSm90a) {
  CompileOptions hopper = fusion(true);
  hopper.emit.arch = "sm_90a";
  struct Case {
    int64_t B, H, Tq, Tk, D, Dv;
    bool causal;
    int64_t G = 1;
  };
  const std::vector<Case> cases = {Case{1, 2, 65, 65, 64, 64, false}, Case{2, 1, 130, 130, 32, 64, true},
                                   Case{1, 1, 70, 40, 16, 16, true},  Case{1, 1, 20, 100, 128, 128, false},
                                   Case{1, 1, 3, 1100, 64, 32, false}, Case{1, 2, 33, 33, 32, 32, true, 4},
                                   Case{1, 1, 5, 1100, 32, 32, false, 2}, Case{1, 2, 40, 70, 96, 80, true},
                                   Case{1, 1, 70, 100, 256, 256, true}, Case{1, 1, 40, 40, 192, 160, false},
                                   Case{1, 1, 63, 63, 64, 64, true}};
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& k = cases[i];
    const DType d = i % 2 == 0 ? DType::bf16 : DType::f16;
    const TaskGraph g = flash_attention(d, k.B, k.H, k.Tq, k.Tk, k.D, k.Dv, k.causal, k.G, k.Tk > 1024 ? 4.0 : 0.25);
    SCOPED_TRACE(g.name);
    const Compiled c = compile(load_program(g, {}), hopper);
    ASSERT_EQ(c.emitted.kernels.size(), 1u);
    const bool hopper_path =
        c.emitted.cuda_source.find("cg_flash_attention_sm90<cg_config, ") != std::string::npos ||
        c.emitted.cuda_source.find("cg_flash_attention_split_sm90<cg_config, ") != std::string::npos;
    EXPECT_TRUE(hopper_path) << c.emitted.kernels[0].matmul_path;
    const uint64_t seed = test_seed();
    CheckedRun run = run_checked(c, RunOptions{seed, work_dir(g.name + "_sm90a")});
    EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
  }
}

// A thousand tokens, causal (16 tiles of keys and 16 of query rows a head).
TEST(FlashAttention, TrainingAThousandTokens) {
  const TaskGraph g = flash_attention_training(DType::bf16, 1, 1, 1000, 1000, 64, true);
  const uint64_t seed = test_seed();
  CheckedRun run = run_checked(compile(load_program(g, {}), fusion(true)), RunOptions{seed, work_dir(g.name)});
  EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
  EXPECT_EQ(normwise_failures(run, DType::bf16), "") << "seed " << seed;
}

// f32 attention trained under --allow-tf32: the forward and the gradient
// kernel both as TF32 (m16n8k8; p and ds from the accumulators through the
// quad's lanes; the streamed tiles read along their rows by ldmatrix and
// across them by 32-bit loads, one swizzle for both), against the float64
// reference at f16's bounds (TF32 keeps f16's 10 mantissa bits), the
// normwise one too: causal with partial tiles, query and key lengths that
// differ, heads of 32, 64 and 128 (16 rows a step, q's and dO's fragments
// read from shared memory), grouped-query attention from the derive pass.
// Heads of 16 are refused, and said why. A fault copying the streamed
// queries with one swizzle and reading them with another is caught.
TEST(FlashAttention, Tf32TrainingMatchesTheReference) {
  CompileOptions tf32 = fusion(true);
  tf32.emit.allow_tf32 = true;
  auto backward_path = [](const Compiled& c) {
    for (const EmittedKernel& e : c.emitted.kernels)
      if (e.matmul_path.find("flash attention backward") != std::string::npos) return e.matmul_path;
    return std::string("(no flash backward kernel)");
  };
  struct Case {
    int64_t H, Tq, Tk, D;
    bool causal;
  };
  // (Heads of 16 past 128 query rows: padded to 32.)
  for (const Case& k : {Case{2, 63, 63, 64, true}, Case{1, 130, 70, 32, true}, Case{1, 70, 100, 128, true},
                        Case{1, 150, 140, 16, false}}) {
    const TaskGraph g = flash_attention_training(DType::f32, 1, k.H, k.Tq, k.Tk, k.D, k.causal);
    SCOPED_TRACE(g.name);
    const Compiled c = compile(load_program(g, {}), tf32);
    ASSERT_EQ(c.kernels.size(), 2u);
    EXPECT_TRUE(c.kernels[0].flash_trained && c.kernels[1].flash_trained);
    EXPECT_NE(c.emitted.cuda_source.find("cg_flash_attention_backward<cg_config, cg_tf32, false>("), std::string::npos);
    EXPECT_NE(backward_path(c).find(", f32 as TF32 (--allow-tf32)"), std::string::npos) << backward_path(c);
    expect_trained_attention_right(c, g.name, k.Tq, k.Tk, 0x1p-11);  // (TF32 keeps f16's 10 mantissa bits)
  }
  {
    const TaskGraph g = grouped_query_training(DType::f32, 65, 65, 64, true);
    const Compiled c = compile(load_program(g, {}), tf32);
    EXPECT_NE(backward_path(c).find("grouped-query: 4 query heads a head of keys and values"), std::string::npos)
        << backward_path(c);
    expect_trained_attention_right(c, g.name, 65, 65, 0x1p-11);
  }
  // Heads of 16: the row kernels, and the forward's path says why not flash.
  const Compiled narrow = compile(load_program(flash_attention_training(DType::f32, 1, 1, 40, 40, 16, true), {}), tf32);
  EXPECT_EQ(narrow.emitted.cuda_source.find("cg_flash_attention_backward<"), std::string::npos);
  EXPECT_NE(narrow.emitted.kernels[0].matmul_path.find("the TF32 kernel takes heads of 32 to 128"), std::string::npos)
      << narrow.emitted.kernels[0].matmul_path;
  // The fault: the streamed queries read along their rows with the swizzle of 16-bit tiles.
  expect_fault_caught(compile(load_program(flash_attention_training(DType::f32, 1, 1, 63, 63, 64, true), {}), tf32),
                      "cg_flash_backward_keys", "typedef cg_gemm_operand<BN, D, true, T, PAIRED> StreamQ;",
                      "typedef cg_gemm_operand<BN, D, true, T> StreamQ;", "flash_tf32_training_fault");
}

// f32 attention trained without --allow-tf32: the flash kernels on exact
// f32 (cg_f32_simt: TF32's tiles and fragments, each mma's products as FMAs
// on CUDA cores), so that the step keeps no T x T buffer, as the 16-bit one;
// against the float64 reference at f32's bounds, and normwise at 2^-20 (the
// GPU's exp2 is the special-function unit's, 2^-22 relative): causal with
// partial tiles, lengths that differ, heads of 32, 64 and 128, over the row
// kernels' reach (300 query rows), grouped-query attention. Without training,
// f32 attention stays on the row kernel. A fault in the FMA mma's operand
// shuffles is caught.
TEST(FlashAttention, F32TrainingOnCudaCoresMatchesTheReference) {
  struct Case {
    int64_t H, Tq, Tk, D;
    bool causal;
  };
  // (Heads of 16 past 128 query rows: padded to 32.)
  for (const Case& k : {Case{2, 63, 63, 64, true}, Case{1, 130, 70, 32, true}, Case{1, 70, 100, 128, true},
                        Case{1, 300, 300, 64, true}, Case{1, 150, 140, 16, true}}) {
    const TaskGraph g = flash_attention_training(DType::f32, 1, k.H, k.Tq, k.Tk, k.D, k.causal);
    SCOPED_TRACE(g.name);
    const Compiled c = compile(load_program(g, {}), fusion(true));
    ASSERT_EQ(c.kernels.size(), 2u);
    EXPECT_TRUE(c.kernels[0].flash_trained && c.kernels[1].flash_trained);
    EXPECT_NE(c.emitted.cuda_source.find("cg_flash_attention<cg_config, cg_f32_simt>("), std::string::npos);
    EXPECT_NE(c.emitted.cuda_source.find("cg_flash_attention_backward<cg_config, cg_f32_simt, false>("), std::string::npos);
    for (const EmittedKernel& e : c.emitted.kernels)
      if (e.matmul_path.find("flash attention") != std::string::npos) {
        EXPECT_NE(e.matmul_path.find("f32 on CUDA cores"), std::string::npos) << e.matmul_path;
        EXPECT_EQ(e.mainloop, MatmulMainloop::flash_attention_simt) << e.name;
      }
    expect_trained_attention_right(c, g.name, k.Tq, k.Tk, 0x1p-20);
  }
  {
    const TaskGraph g = grouped_query_training(DType::f32, 65, 65, 64, true);
    const Compiled c = compile(load_program(g, {}), fusion(true));
    EXPECT_NE(c.emitted.cuda_source.find("cg_flash_attention_backward<cg_config, cg_f32_simt, false>("), std::string::npos);
    expect_trained_attention_right(c, g.name, 65, 65, 0x1p-20);
  }
  const Compiled forward = compile(load_program(flash_attention(DType::f32, 1, 1, 40, 40, 64, 64, true), {}), fusion(true));
  EXPECT_NE(forward.emitted.cuda_source.find("cg_attention_row("), std::string::npos);
  // The fault: the FMA "mma" takes its right column's B from its left column's lane.
  expect_fault_caught(compile(load_program(flash_attention_training(DType::f32, 1, 1, 63, 63, 64, true), {}), fusion(true)),
                      "const unsigned int b[2], cg_f32_simt) {", "8 * t + 4 + c", "8 * t + c", "flash_f32_simt_fault");
}

// Grouped-query attention trained, as the derive pass writes its gradients:
// 8 query heads over 2 heads of keys and values (q [1, 2, 4, T, D], k and v
// [1, 2, 1, T, D]); each query head's blocks read its group's keys and
// values, dk and dv come out per query head and the tasks after the kernel
// sum each group. The gradients (made outputs) against the float64
// reference: causal with a partial tile, query and key lengths that differ,
// heads of 64 and 128 on the flash kernels; f32 heads of 16 on the row kernels.
TEST(FlashAttention, GroupedQueryTrainingMatchesTheReference) {
  struct Case {
    DType d;
    int64_t Tq, Tk, D;
    bool causal;
  };
  for (const Case& k : {Case{DType::bf16, 65, 65, 64, true}, Case{DType::f16, 130, 70, 64, true},
                        Case{DType::bf16, 40, 100, 128, false}, Case{DType::f32, 40, 24, 16, true}}) {
    const TaskGraph g = grouped_query_training(k.d, k.Tq, k.Tk, k.D, k.causal);
    SCOPED_TRACE(g.name);
    const Compiled compiled = compile(load_program(g, {}), fusion(true));
    const std::string& src = compiled.emitted.cuda_source;
    const bool flash = k.d != DType::f32;
    EXPECT_NE(src.find(flash ? "cg_flash_attention<cg_config, " : "cg_attention_row("), std::string::npos);
    EXPECT_NE(src.find(flash ? "cg_flash_attention_backward<cg_config, " : "cg_attention_backward_row("), std::string::npos);
    EXPECT_NE(src.find(flash ? "a group of them shares a head of keys and values"
                             : "// The keys and values of the head's group (grouped-query attention)."),
              std::string::npos);
    if (flash) {  // describe says where each group's sums happen
      const auto backward = std::find_if(compiled.emitted.kernels.begin(), compiled.emitted.kernels.end(), [](const EmittedKernel& e) {
        return e.matmul_path.find("flash attention backward") != std::string::npos;
      });
      ASSERT_NE(backward, compiled.emitted.kernels.end());
      EXPECT_NE(backward->matmul_path.find("grouped-query: 4 query heads a head of keys and values, dk and dv per query head"),
                std::string::npos)
          << backward->matmul_path;
    }
    for (const auto& pb : compiled.plan.buffers) {  // the probabilities have no storage
      const Shape& shape = compiled.program.buffers[size_t(pb.buffer)].shape;
      EXPECT_TRUE(!flash || pb.internal || shape.size() < 2 || shape.back() != k.Tk || shape[shape.size() - 2] != k.Tq)
          << buffer_name(compiled.program, pb.buffer) << " " << shape_to_string(shape) << " is in the arena";
    }
    const uint64_t seed = test_seed();
    CheckedRun run = run_checked(compiled, RunOptions{seed, work_dir(g.name)});
    EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
    if (flash) EXPECT_EQ(normwise_failures(run, k.d), "") << "seed " << seed;
  }
}

// The gradients are deterministic: a second run on the same inputs gives the
// same bits (no atomics: every sum in a fixed order), on the GPU too
// (CUDAGEN_TEST_BACKEND=gpu), where blocks run in any order.
// (Compiled for sm_90a too: the Hopper kernels keep part 1's two kinds of block.)
TEST(FlashAttention, TrainingGradientsAreBitIdenticalAcrossRuns) {
  const TaskGraph g = flash_attention_training(DType::bf16, 1, 2, 200, 130, 64, true);
  for (const std::string arch : {"", "sm_90a"}) {
    SCOPED_TRACE(arch);
    CompileOptions options = fusion(true);
    if (!arch.empty()) options.emit.arch = arch;
    const Compiled c = compile(load_program(g, {}), options);
    EXPECT_EQ(arch == "sm_90a", c.emitted.cuda_source.find("cg_flash_attention_backward_sm90<") != std::string::npos);
    const uint64_t seed = test_seed();
    const std::string dir = g.name + (arch.empty() ? "" : "_" + arch);
    RunOptions first{seed, work_dir(dir)};
    first.outputs_dir = work_dir(dir + "_outputs");
    CheckedRun run = run_checked(c, first);
    EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
    RunOptions again{seed, work_dir(dir)};
    again.expected_dir = first.outputs_dir;
    CheckedRun second = run_checked(c, again);
    ASSERT_EQ(second.expected_checks.size(), 4u) << "context, dq, dk, dv";
    for (const OutputCheck& check : second.expected_checks) EXPECT_EQ(check.max_abs_error, 0.0) << check.buffer;
    std::filesystem::remove_all(first.outputs_dir);
  }
}

// The atomic mode (--atomic-attention-backward): the key blocks sum dq with
// atomics, no query blocks; within the same normwise bound, and each launch
// leaves the sums and counters zero for the next: the backward phase run
// again on the same arena gives the same dq, and the zeroed region is zero.
TEST(FlashAttention, AtomicBackwardMatchesTheReferenceAndLeavesItsSumsZero) {
  CompileOptions atomic = fusion(true);
  atomic.emit.atomic_attention_backward = true;
  for (const auto& [d, H, Tq, Tk, causal] : {std::tuple{DType::bf16, int64_t(2), int64_t(130), int64_t(70), true},
                                             std::tuple{DType::f16, int64_t(1), int64_t(70), int64_t(130), true},
                                             std::tuple{DType::bf16, int64_t(1), int64_t(200), int64_t(200), true}}) {
    const TaskGraph g = flash_attention_training(d, 1, H, Tq, Tk, 64, causal);
    SCOPED_TRACE(g.name);
    const Compiled c = compile(load_program(g, {}), atomic);
    ASSERT_EQ(c.kernels.size(), 2u);
    ASSERT_EQ(c.emitted.kernels.size(), 3u) << "the forward kernel, the rows' statistics, the backward kernel";
    EXPECT_EQ(c.emitted.kernels[1].name, c.kernels[1].name + "_rows");
    const EmittedKernel& backward = c.emitted.kernels[2];
    EXPECT_NE(backward.matmul_path.find("dq summed with atomics"), std::string::npos) << backward.matmul_path;
    EXPECT_EQ(backward.grid[0], (Tk + 63) / 64) << "key blocks only";
    const uint64_t seed = test_seed();
    CheckedRun run = run_checked(c, RunOptions{seed, work_dir(g.name)});
    EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
    EXPECT_EQ(normwise_failures(run, d), "") << "seed " << seed;
  }
  // Twice on one arena (on the GPU with CUDAGEN_TEST_BACKEND=gpu: real atomics, in any order).
  const Compiled c = compile(load_program(flash_attention_training(DType::bf16, 1, 1, 130, 130, 64, true), {}), atomic);
  ASSERT_GT(c.emitted.sync_bytes, 0);
  std::unique_ptr<Executor> executor = cudagen::testing::make_test_executor(c, work_dir("flash_atomic_twice"));
  const std::vector<unsigned char> arena =
      arena_with_inputs(c, {{"scores", "a"}, {"scores", "b"}, {"context", "b"}, {"dp", "a"}}, DType::bf16, 7);
  executor->write(0, arena.data(), arena.size());
  const Plan::Location dq = c.plan.lookup(c.program, "dq_merged", "out");
  std::vector<unsigned char> first(size_t(dq.bytes)), second(size_t(dq.bytes));
  executor->run(phase_function(Phase::forward));
  executor->run(phase_function(Phase::backward));
  executor->read(dq.offset, first.data(), first.size());
  executor->run(phase_function(Phase::backward));
  executor->read(dq.offset, second.data(), second.size());
  double largest = 0, difference = 0;
  for (size_t i = 0; i < first.size(); i += 2) {
    const double a = load_element(first.data() + i, DType::bf16), b = load_element(second.data() + i, DType::bf16);
    largest = std::max(largest, std::abs(a));
    difference = std::max(difference, std::abs(a - b));
  }
  EXPECT_GT(largest, 0.0);
  EXPECT_LE(difference, 0x1p-7 * largest) << "the second run's dq differs: sums left over from the first?";
  std::vector<unsigned char> sync(size_t(c.emitted.sync_bytes));
  executor->read(c.emitted.sync_offset, sync.data(), sync.size());
  EXPECT_EQ(std::count(sync.begin(), sync.end(), 0), std::ptrdiff_t(sync.size())) << "sums or counters left nonzero";
}

// The memory of training on the flash kernels grows linearly in T: a head
// of 64 at B8 x H12 from 4096 to 8192 tokens, no buffer of T x T.
TEST(FlashAttention, TrainingArenaGrowsLinearlyInTokens) {
  std::vector<int64_t> arena;
  for (int64_t tokens : {4096, 8192}) {
    const Compiled c = compile(load_program(flash_attention_training(DType::bf16, 8, 12, tokens, tokens, 64, true), {}), fusion(true));
    for (const auto& pb : c.plan.buffers) {
      const Shape& shape = c.program.buffers[size_t(pb.buffer)].shape;
      EXPECT_TRUE(pb.internal || shape.back() != tokens || shape[shape.size() - 2] != tokens)
          << buffer_name(c.program, pb.buffer) << " is " << shape_to_string(shape) << " in the arena";
    }
    arena.push_back(c.emitted.arena_bytes);
    // `cudagen describe` says what the arena holds past the plan, and what fusion kept out of it.
    const std::string described = describe_arena(c);
    EXPECT_NE(described.find("after it (flash attention's saved row statistics); "), std::string::npos) << described;
    EXPECT_NE(described.find("GiB) kept in kernels' registers"), std::string::npos) << described;
  }
  EXPECT_LE(double(arena[1]), 2.1 * double(arena[0])) << arena[0] << " -> " << arena[1] << " bytes";
  // The saved statistics count against a budget: one the memory plan meets, but not with them, is refused.
  CompileOptions tight = fusion(true);
  tight.plan.budget_bytes = plan_program(load_program(flash_attention_training(DType::bf16, 8, 12, 4096, 4096, 64, true), {}), tight)
                                .plan.arena_bytes;
  try {
    compile(load_program(flash_attention_training(DType::bf16, 8, 12, 4096, 4096, 64, true), {}), tight);
    ADD_FAILURE() << "a budget of " << tight.plan.budget_bytes << " bytes was met";
  } catch (const CompileError& e) {
    EXPECT_NE(std::string(e.what()).find("the kernels' workspaces after it"), std::string::npos) << e.what();
  }
  std::printf("  arena of the attention's training step: %lld bytes at 4096 tokens, %lld at 8192\n", (long long)arena[0],
              (long long)arena[1]);
}

// Faults injected into the flash kernel's code (the generated file, edited
// before it is compiled: by the emulation, or by NVRTC on the GPU with
// CUDAGEN_TEST_BACKEND=gpu), each caught by the check against the
// float64 reference, where the kernel as it is passes: a running sum not
// rescaled when a row's maximum grows (stale), the causal mask one key off,
// the split-KV combine without the ranges' maxima; in the backward kernel,
// ds without the rows' delta, either kind of block's causal mask one key off,
// grouped-query attention's keys and values read from another group, at
// heads of 256 both key blocks of a tile summing the same half of dv; in the
// launch before it, the rows' log-sum-exp left in natural units. (Many rows over many key
// tiles and ranges: each row's maximum grows in some; a far wider spread of
// scores would loosen the reference's bound more than it helps.)
TEST(FlashAttention, InjectedFaultsAreCaught) {
  struct Fault {
    const char* what;
    TaskGraph graph;
    std::string from, to;
  };
  const Fault faults[] = {
      {"a stale running sum", flash_attention(DType::bf16, 1, 1, 256, 512, 64, 64, false, 1, 4.0),
       "row_sum[r] = row_sum[r] * rescale[r] + tile_sum;", "row_sum[r] = row_sum[r] + tile_sum;"},
      {"the causal mask one key off", flash_attention(DType::bf16, 1, 1, 130, 130, 32, 32, true),
       "cg_clamp_i64(row0 - key0 + 1, 0, keys_left)", "cg_clamp_i64(row0 - key0 + 2, 0, keys_left)"},
      {"a split combine without the maxima", flash_attention(DType::bf16, 1, 1, 64, 2048, 64, 32, false, 1, 4.0),
       "weight[local * 32 + s] = exp2f(cg_load_l2(partials, at) - base);", "weight[local * 32 + s] = 1.0f;"},
      {"a backward pass without delta", flash_attention_training(DType::bf16, 1, 1, 96, 96, 64, false),
       "(dp_scale * dst[j][e] - row_stats[2 * (8 * j + 2 * t + (e & 1)) + 1])", "(dp_scale * dst[j][e])"},
      {"the rows' log-sum-exp in natural units", flash_attention_training(DType::bf16, 1, 1, 96, 96, 64, false),
       "l == cg_neg_inf() ? -cg_neg_inf() : l * 1.4426950408889634f", "l == cg_neg_inf() ? -cg_neg_inf() : l"},
      {"dq's causal mask one key off", flash_attention_training(DType::bf16, 1, 1, 130, 130, 32, true),
       "(causal && past_row + key > 8 * (e >> 1))", "(causal && past_row + key > 8 * (e >> 1) + 1)"},
      {"dk and dv's causal mask one key off", flash_attention_training(DType::bf16, 1, 1, 130, 130, 32, true),
       "(causal && past_row + 8 * (e >> 1) > query)", "(causal && past_row + 8 * (e >> 1) + 1 > query)"},
      {"the backward's keys and values of another group", grouped_query_training(DType::bf16, 65, 65, 64, true),
       "kv_head = ((head / 4 % 2) * 1);", "kv_head = ((head / 4 % 2) * 1) ^ 1;"},
      {"heads of 256: both key blocks of a tile summing dv's first half", flash_attention_training(DType::bf16, 1, 1, 70, 70, 256, true),
       "KSTEP * kk, part * PV);", "KSTEP * kk, 0);"},
  };
  for (const Fault& f : faults) {
    Compiled c = compile(load_program(f.graph, {}), fusion(true));
    const uint64_t seed = test_seed();
    const CheckedRun right = run_checked(c, RunOptions{seed, work_dir(f.graph.name)});
    EXPECT_TRUE(right.ok()) << f.what << ": the kernel as it is fails, seed " << seed << "\n" << format_run(right);
    EXPECT_EQ(normwise_failures(right, DType::bf16), "") << f.what << ": the kernel as it is fails, seed " << seed;
    std::string& source = c.emitted.cuda_source;
    const size_t at = source.find(f.from);
    ASSERT_NE(at, std::string::npos) << f.what << ": the template changed; update the fault";
    source.replace(at, f.from.size(), f.to);
    const CheckedRun run = run_checked(c, RunOptions{seed, work_dir(f.graph.name + "_fault")});
    EXPECT_FALSE(run.ok() && normwise_failures(run, DType::bf16).empty())
        << f.what << " was not caught, seed " << seed << "\n" << format_run(run);
  }
}
