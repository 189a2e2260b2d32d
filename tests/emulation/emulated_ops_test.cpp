// The ops with templates, generated, compiled by the host compiler with the
// emulation header, run on the emulated GPU, and compared with the float64
// reference, at sizes that are not multiples of a block.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "builder.h"
#include "derive.h"
#include "file_util.h"
#include "graph_json.h"
#include "host_module.h"
#include "pipeline.h"
#include "reference.h"
#include "runner.h"
#include "test_backend.h"

using namespace cudagen;
using cudagen::testing::run_checked;
using cudagen::testing::test_seed;
using cudagen::testing::test_source_dir;

namespace {

constexpr DType f32 = DType::f32;
constexpr Storage ext = Storage::external;

std::string work_dir(const std::string& name) {
  return cudagen::testing::work_dir("emu_test", name);
}

// Every op that has a template, each task with its own inputs, at size n.
TaskGraph all_ops(int64_t n) {
  GraphBuilder b("ops_" + std::to_string(n));
  b.task("relu", "relu").tensor("x", f32, {n}, ext).tensor("out", f32, {n}, ext);
  b.task("add", "add").tensor("a", f32, {n, 3}, ext).tensor("b", f32, {3}, ext).tensor("out", f32, {n, 3}, ext);
  b.task("add_bcast", "add").tensor("a", f32, {2, 1, n}, ext).tensor("b", f32, {3, 1}, ext).tensor("out", f32, {2, 3, n}, ext);
  b.task("softmax", "softmax").tensor("x", f32, {3, n}, ext).tensor("out", f32, {3, n}, ext).arg("scale", 0.7);
  b.task("softmax_causal", "softmax")
      .tensor("x", f32, {2, n, n}, ext)
      .tensor("out", f32, {2, n, n}, ext)
      .arg("causal", true);
  b.task("matmul", "matmul").tensor("a", f32, {n, n + 1}, ext).tensor("b", f32, {n + 1, 7}, ext).tensor("out", f32, {n, 7}, ext);
  b.task("matmul_t", "matmul")
      .tensor("a", f32, {2, 5, n}, ext)
      .tensor("b", f32, {33, 5}, ext)
      .tensor("out", f32, {2, n, 33}, ext)
      .arg("trans_a", true)
      .arg("trans_b", true)
      .arg("alpha", 0.5);
  b.task("embedding", "embedding")
      .tensor("table", f32, {n, 5}, Storage::persistent)
      .tensor("ids", DType::i32, {n + 2}, ext)
      .tensor("out", f32, {n + 2, 5}, ext);
  b.task("transpose", "transpose").tensor("x", f32, {2, n, 33}, ext).tensor("out", f32, {2, 33, n}, ext);
  for (const char* op : {"sigmoid", "silu", "tanh", "neg"})
    b.task(op, op).tensor("x", f32, {n, 2}, ext).tensor("out", f32, {n, 2}, ext);
  for (const char* form : {"tanh", "erf"})
    b.task(std::string("gelu_") + form, "gelu").tensor("x", f32, {n}, ext).tensor("out", f32, {n}, ext).arg("approximate", form);
  b.task("affine", "affine").tensor("x", f32, {n}, ext).tensor("out", f32, {n}, ext).arg("scale", 2.0).arg("shift", 0.5);
  for (const char* op : {"sub", "mul", "div", "maximum"})
    b.task(op, op).tensor("a", f32, {3, n}, ext).tensor("b", f32, {n}, ext).tensor("out", f32, {3, n}, ext);
  auto e = b.task("exp", "exp").tensor("x", f32, {n}, ext).tensor("out", f32, {n}, ext);
  b.task("log", "log").tensor("x", e["out"]).tensor("out", f32, {n}, ext);  // positive inputs
  for (const char* op : {"sqrt", "rsqrt"})
    b.task(op, op).tensor("x", e["out"]).tensor("out", f32, {n}, ext);
  // Slices: every second row from 1, the last column (a select), and the gradient of the first.
  const int64_t rows = (n + 3) / 2;
  b.task("slice", "slice").tensor("x", f32, {2, n + 3, 5}, ext).tensor("out", f32, {2, rows, 5}, ext).arg("axis", 1).arg("start", 1).arg("step", 2);
  b.task("slice_last", "slice").tensor("x", f32, {n, 6}, ext).tensor("out", f32, {n, 1}, ext).arg("axis", -1).arg("start", -1);
  b.task("slice_backward", "slice_backward")
      .tensor("dout", f32, {2, rows, 5}, ext)
      .tensor("dx", f32, {2, n + 3, 5}, ext)
      .arg("axis", 1)
      .arg("start", 1)
      .arg("step", 2);
  b.task("square", "pow").tensor("x", f32, {n}, ext).tensor("out", f32, {n}, ext);  // exponent 2, negative x too
  b.task("cube_root", "pow").tensor("x", e["out"]).tensor("out", f32, {n}, ext).arg("exponent", 1.0 / 3);
  for (const char* op : {"sqrt_backward", "rsqrt_backward"})
    b.task(op, op).tensor("x", e["out"]).tensor("dout", f32, {n}, ext).tensor("dx", f32, {n}, ext);
  b.task("pow_backward", "pow_backward")
      .tensor("x", e["out"])
      .tensor("dout", f32, {n}, ext)
      .tensor("dx", f32, {n}, ext)
      .arg("exponent", 2.5);
  for (const char* op : {"relu_backward", "sigmoid_backward", "silu_backward", "tanh_backward"})
    b.task(op, op).tensor("x", f32, {n}, ext).tensor("dout", f32, {n}, ext).tensor("dx", f32, {n}, ext);
  b.task("rmsnorm", "rmsnorm")
      .tensor("x", f32, {3, n}, ext)
      .tensor("weight", f32, {n}, Storage::persistent)
      .tensor("out", f32, {3, n}, ext)
      .tensor("rstd", f32, {3}, ext)
      .arg("eps", 1e-5);
  b.task("fill", "fill").tensor("out", f32, {n}, ext).arg("value", 0.25);
  b.task("uniform", "uniform").tensor("out", f32, {n, 3}, ext).arg("low", -0.5).arg("high", 2.0).arg("seed", 42);
  b.task("uniform64", "uniform").tensor("out", DType::f64, {n}, ext).arg("seed", 7);
  b.task("normal", "normal").tensor("out", f32, {n, 3}, ext).arg("mean", 1.0).arg("std", 0.5).arg("seed", 3);
  for (const char* op : {"sum", "mean", "max"})
    b.task(op, op).tensor("x", f32, {3, n}, ext).tensor("out", f32, {3}, ext);
  b.task("sum_leading", "sum_leading").tensor("x", f32, {2, n, 5}, ext).tensor("out", f32, {5}, ext);
  b.task("log_softmax", "log_softmax").tensor("x", f32, {2, n}, ext).tensor("out", f32, {2, n}, ext);
  b.task("split_heads", "split_heads").tensor("x", f32, {2, n, 12}, ext).tensor("out", f32, {2, 3, n, 4}, ext).arg("heads", 3);
  b.task("merge_heads", "merge_heads").tensor("x", f32, {2, 3, n, 4}, ext).tensor("out", f32, {2, n, 12}, ext).arg("heads", 3);
  for (const char* form : {"tanh", "erf"})
    b.task(std::string("gelu_backward_") + form, "gelu_backward")
        .tensor("x", f32, {n}, ext)
        .tensor("dout", f32, {n}, ext)
        .tensor("dx", f32, {n}, ext)
        .arg("approximate", form);
  b.task("mse_backward", "mse_backward")
      .tensor("pred", f32, {n, 2}, ext)
      .tensor("target", f32, {n, 2}, ext)
      .tensor("dpred", f32, {n, 2}, ext)
      .arg("scale", 0.5);
  b.task("cast_f64", "cast").tensor("x", f32, {n}, ext).tensor("out", DType::f64, {n}, ext);
  b.task("reshape", "reshape").tensor("x", f32, {n, 2}, ext).tensor("out", f32, {2, n}, ext);
  b.task("layernorm", "layernorm")
      .tensor("x", f32, {3, n}, ext)
      .tensor("weight", f32, {n}, Storage::persistent)
      .tensor("bias", f32, {n}, Storage::persistent)
      .tensor("out", f32, {3, n}, ext)
      .tensor("mean", f32, {3}, ext)
      .tensor("rstd", f32, {3}, ext)
      .arg("eps", 1e-5);
  b.task("cross_entropy", "cross_entropy")
      .tensor("logits", f32, {n, 7}, ext)
      .tensor("labels", DType::i32, {n}, ext)
      .tensor("loss", f32, {}, ext);
  b.task("cross_entropy_backward", "cross_entropy_backward")
      .tensor("logits", f32, {3, n}, ext)
      .tensor("labels", DType::i64, {3}, ext)
      .tensor("dlogits", f32, {3, n}, ext)
      .arg("scale", 1.0 / 3);
  // Optimizers update param (and their state) in place: external here, so the run checks them.
  b.task("sgd", "sgd").tensor("param", f32, {n, 3}, ext).tensor("grad", f32, {n, 3}, ext).arg("lr", 0.1);
  b.task("sgd_momentum", "sgd")
      .tensor("param", f32, {n}, ext)
      .tensor("grad", f32, {n}, ext)
      .tensor("momentum_buf", f32, {n}, ext)
      .arg("lr", 0.05)
      .arg("momentum", 0.9)
      .arg("weight_decay", 0.01);
  for (const char* op : {"adam", "adamw"}) {
    // A second moment is positive: v comes from exp, and the optimizer updates that buffer.
    auto v = b.task(std::string(op) + "_v", "exp").tensor("x", f32, {n, 2}, ext).tensor("out", f32, {n, 2}, ext);
    b.task(op, op)
        .tensor("param", f32, {n, 2}, ext)
        .tensor("grad", f32, {n, 2}, ext)
        .tensor("m", f32, {n, 2}, ext)
        .tensor("v", v["out"])
        .arg("lr", 0.01)
        .arg("weight_decay", 0.1)
        .arg("step", int64_t(3));
  }
  b.task("exp_backward", "exp_backward").tensor("out", f32, {n}, ext).tensor("dout", f32, {n}, ext).tensor("dx", f32, {n}, ext);
  auto positive = b.task("log_backward_x", "exp").tensor("x", f32, {n}, ext).tensor("out", f32, {n}, ext);
  b.task("log_backward", "log_backward").tensor("x", positive["out"]).tensor("dout", f32, {n}, ext).tensor("dx", f32, {n}, ext);
  b.task("neg_backward", "neg_backward").tensor("dout", f32, {n, 2}, ext).tensor("dx", f32, {n, 2}, ext);
  b.task("affine_backward", "affine_backward")
      .tensor("dout", f32, {n}, ext)
      .tensor("dx", f32, {n}, ext)
      .arg("scale", -1.5);
  b.task("cast_backward", "cast_backward").tensor("dout", DType::f64, {n}, ext).tensor("dx", f32, {n}, ext);
  // The gradients of the reductions and the gather.
  b.task("softmax_backward", "softmax_backward")
      .tensor("out", f32, {3, n}, ext)
      .tensor("dout", f32, {3, n}, ext)
      .tensor("dx", f32, {3, n}, ext)
      .arg("scale", 0.7);
  b.task("log_softmax_backward", "log_softmax_backward")
      .tensor("out", f32, {2, n}, ext)
      .tensor("dout", f32, {2, n}, ext)
      .tensor("dx", f32, {2, n}, ext);
  b.task("rmsnorm_backward", "rmsnorm_backward")
      .tensor("x", f32, {3, n}, ext)
      .tensor("weight", f32, {n}, Storage::persistent)
      .tensor("rstd", f32, {3}, ext)
      .tensor("dout", f32, {3, n}, ext)
      .tensor("dx", f32, {3, n}, ext)
      .tensor("dweight", f32, {n}, ext);
  b.task("layernorm_backward", "layernorm_backward")
      .tensor("x", f32, {5, n}, ext)
      .tensor("weight", f32, {n}, Storage::persistent)
      .tensor("mean", f32, {5}, ext)
      .tensor("rstd", f32, {5}, ext)
      .tensor("dout", f32, {5, n}, ext)
      .tensor("dx", f32, {5, n}, ext)
      .tensor("dweight", f32, {n}, ext)
      .tensor("dbias", f32, {n}, ext);
  b.task("embedding_backward", "embedding_backward")
      .tensor("ids", DType::i64, {n + 2}, ext)
      .tensor("dout", f32, {n + 2, 5}, ext)
      .tensor("dtable", f32, {4, 5}, ext);
  b.task("sum_backward", "sum_backward").tensor("dout", f32, {3}, ext).tensor("dx", f32, {3, n}, ext);
  b.task("mean_backward", "mean_backward").tensor("dout", f32, {2, 3}, ext).tensor("dx", f32, {2, 3, n}, ext);
  b.task("sum_leading_backward", "sum_leading_backward").tensor("dout", f32, {5}, ext).tensor("dx", f32, {2, n, 5}, ext);
  // max_backward from the max of its own x; then rows of equal values, where
  // every element ties and takes an equal share.
  auto row_max = b.task("max_of_x", "max").tensor("x", f32, {3, n}, ext).tensor("out", f32, {3}, ext);
  b.task("max_backward", "max_backward")
      .tensor("x", row_max["x"])
      .tensor("out", row_max["out"])
      .tensor("dout", f32, {3}, ext)
      .tensor("dx", f32, {3, n}, ext);
  auto flat = b.task("flat_rows", "fill").tensor("out", f32, {2, n}, ext).arg("value", 0.5);
  auto flat_max = b.task("flat_max", "max").tensor("x", flat["out"]).tensor("out", f32, {2}, ext);
  b.task("max_backward_ties", "max_backward")
      .tensor("x", flat["out"])
      .tensor("out", flat_max["out"])
      .tensor("dout", f32, {2}, ext)
      .tensor("dx", f32, {2, n}, ext);
  for (const char* wrt : {"a", "b"})
    b.task(std::string("maximum_backward_") + wrt, "maximum_backward")
        .tensor("a", f32, {3, n}, ext)
        .tensor("b", f32, {n}, ext)
        .tensor("dout", f32, {3, n}, ext)
        .tensor("dx", f32, {3, n}, ext)
        .arg("wrt", wrt);
  b.task("maximum_backward_ties", "maximum_backward")
      .tensor("a", flat["out"])
      .tensor("b", flat["out"])
      .tensor("dout", f32, {2, n}, ext)
      .tensor("dx", f32, {2, n}, ext)
      .arg("wrt", "b");
  b.task("mse", "mse").tensor("pred", f32, {n, 3}, ext).tensor("target", f32, {n, 3}, ext).tensor("loss", f32, {}, ext);
  b.task("concat", "concat").tensor("a", f32, {3, n}, ext).tensor("b", f32, {3, 5}, ext).tensor("out", f32, {3, n + 5}, ext);
  b.task("split", "split")
      .tensor("x", f32, {2, n + 3}, ext)
      .tensor("a", f32, {2, n}, ext)
      .tensor("b", f32, {2, 3}, ext);
  return std::move(b).graph();
}

Compiled compile_graph(TaskGraph g) { return compile(load_program(std::move(g), {}), {}); }

}  // namespace

class EmulatedOps : public ::testing::TestWithParam<int64_t> {};

TEST_P(EmulatedOps, MatchTheFloat64Reference) {
  Compiled c = compile_graph(all_ops(GetParam()));
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(c, RunOptions{seed, work_dir("ops" + std::to_string(GetParam()))});
  ASSERT_EQ(run.checks.size(), 97u);
  for (const auto& check : run.checks) {
    EXPECT_TRUE(check.ok()) << format_run(run);
    // The counter-based generator is defined to the bit: the emulation must match the reference exactly.
    if (check.buffer == "uniform.out" || check.buffer == "uniform64.out")
      EXPECT_EQ(check.max_abs_error, 0.0) << check.buffer;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, EmulatedOps, ::testing::Values(1, 7, 33, 257, 1000));

// The ops the emitter generates for f16 and bf16 tensors (computed in f32,
// stored rounded), at sizes that are not multiples of a block; bounds: f16
// 5e-3, bf16 1e-2 relative (docs/architecture.md §9).
TaskGraph half_ops(int64_t n, DType h) {
  const std::string t = to_string(h);
  GraphBuilder b("ops16_" + t + "_" + std::to_string(n));
  for (const char* op : {"relu", "sigmoid", "silu", "tanh", "exp", "neg"})
    b.task(std::string(op) + "_" + t, op).tensor("x", h, {n}, ext).tensor("out", h, {n}, ext);
  b.task("gelu_" + t, "gelu").tensor("x", h, {n, 3}, ext).tensor("out", h, {n, 3}, ext).arg("approximate", "erf");
  b.task("affine_" + t, "affine").tensor("x", h, {n}, ext).tensor("out", h, {n}, ext).arg("scale", 1.5).arg("shift", -0.25);
  for (const char* op : {"add", "mul", "maximum"})
    b.task(std::string(op) + "_" + t, op).tensor("a", h, {3, n}, ext).tensor("b", h, {n}, ext).tensor("out", h, {3, n}, ext);
  b.task("slice_" + t, "slice").tensor("x", h, {3, n + 1}, ext).tensor("out", h, {3, (n + 1) / 2}, ext).arg("axis", 1).arg("step", 2);
  b.task("slice_backward_" + t, "slice_backward")
      .tensor("dout", h, {3, (n + 1) / 2}, ext)
      .tensor("dx", h, {3, n + 1}, ext)
      .arg("axis", -1)
      .arg("step", 2);
  b.task("relu_backward_" + t, "relu_backward")
      .tensor("x", h, {n}, ext)
      .tensor("dout", h, {n}, ext)
      .tensor("dx", h, {n}, ext);
  b.task("narrow_" + t, "cast").tensor("x", f32, {n, 2}, ext).tensor("out", h, {n, 2}, ext);
  b.task("widen_" + t, "cast").tensor("x", h, {n, 2}, ext).tensor("out", f32, {n, 2}, ext);
  b.task("from_f64_" + t, "cast").tensor("x", DType::f64, {n}, ext).tensor("out", h, {n}, ext);
  b.task("uniform_" + t, "uniform").tensor("out", h, {n}, ext).arg("low", -2.0).arg("high", 3.0).arg("seed", 5);
  b.task("fill_" + t, "fill").tensor("out", h, {n}, ext).arg("value", 0.1);
  b.task("embedding_" + t, "embedding")
      .tensor("table", h, {n, 5}, Storage::persistent)
      .tensor("ids", DType::i64, {n + 2}, ext)
      .tensor("out", h, {n + 2, 5}, ext);
  b.task("transpose_" + t, "transpose").tensor("x", h, {2, n, 33}, ext).tensor("out", h, {2, 33, n}, ext);
  b.task("concat_" + t, "concat").tensor("a", h, {2, n}, ext).tensor("b", h, {2, 4}, ext).tensor("out", h, {2, n + 4}, ext);
  // Reductions and matmul read 16-bit, accumulate in f32, store 16-bit.
  b.task("softmax_" + t, "softmax").tensor("x", h, {3, n}, ext).tensor("out", h, {3, n}, ext).arg("scale", 0.5);
  b.task("log_softmax_" + t, "log_softmax").tensor("x", h, {2, n}, ext).tensor("out", h, {2, n}, ext);
  for (const char* op : {"sum", "mean"}) b.task(std::string(op) + "_" + t, op).tensor("x", h, {3, n}, ext).tensor("out", h, {3}, ext);
  auto row_max = b.task("max_" + t, "max").tensor("x", h, {3, n}, ext).tensor("out", h, {3}, ext);
  b.task("max_backward_" + t, "max_backward")
      .tensor("x", row_max["x"])
      .tensor("out", row_max["out"])
      .tensor("dout", h, {3}, ext)
      .tensor("dx", h, {3, n}, ext);
  for (const char* op : {"sum_backward", "mean_backward"})
    b.task(std::string(op) + "_" + t, op).tensor("dout", h, {2}, ext).tensor("dx", h, {2, n}, ext);
  b.task("sum_leading_backward_" + t, "sum_leading_backward").tensor("dout", h, {5}, ext).tensor("dx", h, {n, 5}, ext);
  b.task("maximum_backward_" + t, "maximum_backward")
      .tensor("a", h, {3, n}, ext)
      .tensor("b", h, {n}, ext)
      .tensor("dout", h, {3, n}, ext)
      .tensor("dx", h, {3, n}, ext)
      .arg("wrt", "b");
  b.task("sum_leading_" + t, "sum_leading").tensor("x", h, {2, n, 5}, ext).tensor("out", h, {5}, ext);
  b.task("rmsnorm_" + t, "rmsnorm")
      .tensor("x", h, {3, n}, ext)
      .tensor("weight", h, {n}, Storage::persistent)
      .tensor("out", h, {3, n}, ext)
      .tensor("rstd", f32, {3}, ext);
  b.task("layernorm_" + t, "layernorm")
      .tensor("x", h, {3, n}, ext)
      .tensor("weight", h, {n}, Storage::persistent)
      .tensor("bias", h, {n}, Storage::persistent)
      .tensor("out", h, {3, n}, ext);
  b.task("cross_entropy_" + t, "cross_entropy")
      .tensor("logits", h, {n, 10}, ext)
      .tensor("labels", DType::i64, {n}, ext)
      .tensor("loss", f32, {}, ext);
  b.task("cross_entropy_backward_" + t, "cross_entropy_backward")
      .tensor("logits", h, {2, n}, ext)
      .tensor("labels", DType::i32, {2}, ext)
      .tensor("dlogits", h, {2, n}, ext)
      .arg("scale", 0.5);
  b.task("cast_backward_" + t, "cast_backward").tensor("dout", f32, {n}, ext).tensor("dx", h, {n}, ext);
  b.task("exp_backward_" + t, "exp_backward").tensor("out", h, {n}, ext).tensor("dout", h, {n}, ext).tensor("dx", h, {n}, ext);
  b.task("softmax_backward_" + t, "softmax_backward")
      .tensor("out", h, {2, n}, ext)
      .tensor("dout", h, {2, n}, ext)
      .tensor("dx", h, {2, n}, ext);
  b.task("rmsnorm_backward_" + t, "rmsnorm_backward")
      .tensor("x", h, {3, n}, ext)
      .tensor("weight", h, {n}, Storage::persistent)
      .tensor("rstd", f32, {3}, ext)
      .tensor("dout", h, {3, n}, ext)
      .tensor("dx", h, {3, n}, ext)
      .tensor("dweight", f32, {n}, ext);
  b.task("embedding_backward_" + t, "embedding_backward")
      .tensor("ids", DType::i32, {n}, ext)
      .tensor("dout", h, {n, 3}, ext)
      .tensor("dtable", h, {6, 3}, ext);
  b.task("mse_" + t, "mse").tensor("pred", h, {n}, ext).tensor("target", h, {n}, ext).tensor("loss", f32, {}, ext);
  b.task("matmul_" + t, "matmul").tensor("a", h, {n, 9}, ext).tensor("b", h, {9, 7}, ext).tensor("out", h, {n, 7}, ext);
  b.task("matmul_t_" + t, "matmul")
      .tensor("a", h, {2, 9, n}, ext)
      .tensor("b", h, {33, 9}, ext)
      .tensor("out", h, {2, n, 33}, ext)
      .arg("trans_a", true)
      .arg("trans_b", true);
  return std::move(b).graph();
}

class EmulatedHalfOps : public ::testing::TestWithParam<std::tuple<DType, int64_t>> {};

TEST_P(EmulatedHalfOps, MatchTheFloat64Reference) {
  auto [dtype, n] = GetParam();
  Compiled c = compile_graph(half_ops(n, dtype));
  // Scalar, or 8 elements at a time when the size allows (n = 1000).
  const std::string element = n % 8 == 0 ? "x_v.v[k]" : "cg_load(x, i)";
  EXPECT_NE(c.emitted.cuda_source.find(
                fmt::format("cg_narrow<cg_{}>(cg_relu<float>(cg_widen({})))", to_string(dtype), element)),
            std::string::npos)
      << "16-bit tensors are computed in f32";
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run =
      run_checked(c, RunOptions{seed, work_dir(fmt::format("ops16_{}_{}", to_string(dtype), n))});
  ASSERT_EQ(run.checks.size(), 47u);
  for (const auto& check : run.checks) EXPECT_TRUE(check.ok()) << format_run(run);
}

// The tensor-core tile across several 64 x 64 output tiles and K steps with
// tails, batched with broadcasting: the fragment layout of mma.m16n8k16,
// computed with warp shuffles in emulation, against the float64 reference.
TEST(Emulation, TensorCoreMatmulMatchesTheReference) {
  for (DType d : {DType::f16, DType::bf16}) {
    GraphBuilder b(std::string("mma_") + to_string(d));
    b.task("mm", "matmul").tensor("a", d, {130, 70}, ext).tensor("b", d, {70, 100}, ext).tensor("out", d, {130, 100}, ext);
    b.task("mm_batched", "matmul")
        .tensor("a", d, {2, 40, 33}, ext)
        .tensor("b", d, {33, 65}, ext)
        .tensor("out", d, {2, 40, 65}, ext)
        .arg("alpha", 0.5);
    b.task("mm_t", "matmul")
        .tensor("a", d, {17, 65}, ext)
        .tensor("b", d, {9, 17}, ext)
        .tensor("out", d, {65, 9}, ext)
        .arg("trans_a", true)
        .arg("trans_b", true);
    Compiled c = compile_graph(std::move(b).graph());
    EXPECT_NE(c.emitted.cuda_source.find(fmt::format("cg_matmul_tile_mma<64, 64, 16>(")), std::string::npos);
    EXPECT_EQ(c.emitted.cuda_source.find("CG_DEVICE void cg_matmul_tile("), std::string::npos)
        << "the f32 tile is not in a file whose matmuls are all 16-bit";
    uint64_t seed = test_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    CheckedRun run = run_checked(c, RunOptions{seed, work_dir(std::string("mma_") + to_string(d))});
    ASSERT_EQ(run.checks.size(), 3u);
    for (const auto& check : run.checks) EXPECT_TRUE(check.ok()) << format_run(run);
  }
}

// 16-bit matmuls whose rows are whole 16-byte chunks run the pipelined
// mainloop (templates/gemm.cuh) in the generated kernel: every transpose,
// a batch broadcast over b, alpha, an epilogue (bias, GELU) on the pairs,
// partial tiles everywhere. Others keep the 64 x 64 tile.
TEST(Emulation, PipelinedMatmulMatchesTheReference) {
  for (DType d : {DType::f16, DType::bf16}) {
    GraphBuilder b(std::string("pipelined_") + to_string(d));
    auto mm = b.task("mm", "matmul").tensor("a", d, {3, 72, 40}, ext).tensor("b", d, {40, 136}, ext).tensor("out", d, {3, 72, 136});
    auto bias = b.task("bias", "add").tensor("a", mm["out"]).tensor("b", d, {136}, ext).tensor("out", d, {3, 72, 136});
    b.task("act", "gelu").tensor("x", bias["out"]).tensor("out", d, {3, 72, 136}, ext);
    b.task("mm_tn", "matmul")
        .tensor("a", d, {48, 104}, ext)
        .tensor("b", d, {48, 24}, ext)
        .tensor("out", d, {104, 24}, ext)
        .arg("trans_a", true)
        .arg("alpha", 0.5);
    b.task("mm_nt", "matmul").tensor("a", d, {2, 33, 16}, ext).tensor("b", d, {2, 80, 16}, ext).tensor("out", d, {2, 33, 80}, ext).arg("trans_b", true);
    b.task("mm_tt", "matmul")
        .tensor("a", d, {24, 64}, ext)
        .tensor("b", d, {8, 24}, ext)
        .tensor("out", d, {64, 8}, ext)
        .arg("trans_a", true)
        .arg("trans_b", true);
    b.task("mm_odd", "matmul").tensor("a", d, {20, 12}, ext).tensor("b", d, {12, 20}, ext).tensor("out", d, {20, 20}, ext);
    Compiled c = compile_graph(std::move(b).graph());
    int pipelined = 0, tiled = 0;
    for (const EmittedKernel& k : c.emitted.kernels) {
      pipelined += k.matmul_path.find("pipelined mainloop") != std::string::npos;
      tiled += k.matmul_path.find("64 x 64 tile") != std::string::npos;
    }
    EXPECT_EQ(pipelined, 4) << "mm (with its epilogue), mm_tn, mm_nt, mm_tt";
    EXPECT_EQ(tiled, 1) << "mm_odd: K = 12 is no whole number of 16-byte chunks";
    EXPECT_NE(c.emitted.cuda_source.find("typedef cg_gemm_config<64, 64, 32, 2, 2, 4> cg_config;"), std::string::npos);
    uint64_t seed = test_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    CheckedRun run = run_checked(c, RunOptions{seed, work_dir(std::string("pipelined_") + to_string(d))});
    ASSERT_EQ(run.checks.size(), 5u);
    for (const auto& check : run.checks) EXPECT_TRUE(check.ok()) << format_run(run);
  }
}

// Compiled for sm_90a (issue #38), 16-bit products run the Hopper mainloop
// (templates/gemm_sm90.cuh: TMA, mbarriers, wgmma, all emulated): b as
// stored and transposed, a batch of rows folded into M, a bias and GELU
// epilogue, partial tiles in M and N, K under one k-tile and over the
// stages (a tile of 6 k-tiles whole: dealt out to 264 blocks, the partial
// sums would cost more than the k-tiles); what TMA cannot read (a transposed a, a batched b, a row of a
// whole 16 bytes short) stays on the pipelined mainloop and says why.
TEST(Emulation, HopperMatmulMatchesTheReference) {
  for (DType d : {DType::f16, DType::bf16}) {
    GraphBuilder b(std::string("hopper_") + to_string(d));
    auto mm = b.task("mm", "matmul").tensor("a", d, {2, 150, 200}, ext).tensor("b", d, {200, 264}, ext).tensor("out", d, {2, 150, 264});
    auto bias = b.task("bias", "add").tensor("a", mm["out"]).tensor("b", d, {264}, ext).tensor("out", d, {2, 150, 264});
    b.task("act", "gelu").tensor("x", bias["out"]).tensor("out", d, {2, 150, 264}, ext);
    b.task("mm_nt", "matmul").tensor("a", d, {130, 40}, ext).tensor("b", d, {72, 40}, ext).tensor("out", d, {130, 72}, ext).arg("trans_b", true);
    b.task("mm_long", "matmul").tensor("a", d, {64, 328}, ext).tensor("b", d, {328, 128}, ext).tensor("out", d, {64, 128}, ext).arg("alpha", 0.5);
    b.task("mm_tn", "matmul").tensor("a", d, {48, 104}, ext).tensor("b", d, {48, 24}, ext).tensor("out", d, {104, 24}, ext).arg("trans_a", true);
    b.task("mm_batched", "matmul").tensor("a", d, {2, 33, 16}, ext).tensor("b", d, {2, 16, 80}, ext).tensor("out", d, {2, 33, 80}, ext);
    CompileOptions options;
    options.emit.arch = "sm_90a";
    Compiled c = compile(load_program(std::move(b).graph(), {}), options);
    std::map<std::string, std::string> paths;
    for (const EmittedKernel& k : c.emitted.kernels) paths[c.program.tasks[size_t(k.tasks[0])].task->id] = k.matmul_path;
    for (const char* task : {"mm", "mm_nt", "mm_long"}) {
      EXPECT_NE(paths[task].find("the Hopper mainloop"), std::string::npos) << task << ": " << paths[task];
      EXPECT_EQ(paths[task].find("stream-K"), std::string::npos) << task << ": " << paths[task];
    }
    EXPECT_NE(paths["mm_tn"].find("not on the Hopper mainloop: its a is stored transposed"), std::string::npos)
        << paths["mm_tn"];
    EXPECT_NE(paths["mm_batched"].find("not on the Hopper mainloop: b is batched"), std::string::npos)
        << paths["mm_batched"];
    uint64_t seed = test_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    CheckedRun run = run_checked(c, RunOptions{seed, work_dir(std::string("hopper_") + to_string(d))});
    ASSERT_EQ(run.checks.size(), 5u);
    for (const auto& check : run.checks) EXPECT_TRUE(check.ok()) << format_run(run);
  }
}

// A target of a few SMs (--sms) makes a test-sized product take what only
// products of about a hundred tiles take at 132 SMs: at 2 SMs a 130 x 384
// product over 768 deals its last tiles by stream-K (--stream-k: partial
// sums in the workspace, fixed up by the last block to arrive); at 4 SMs it
// runs 128 x 192 tiles (results staged 64 columns at a time). Both through
// a bias epilogue, in emulation, against the float64 reference.
TEST(Emulation, HopperTilesForAFewSmsMatchTheReference) {
  for (const auto& [sms, path] : {std::pair<int64_t, const char*>{2, "the last by stream-K"}, {4, "128 x 192 tiles"}}) {
    GraphBuilder b("hopper_sms_" + std::to_string(sms));
    const DType d = DType::bf16;
    auto mm = b.task("mm", "matmul").tensor("a", d, {130, 768}, ext).tensor("b", d, {768, 384}, ext).tensor("out", d, {130, 384});
    b.task("bias", "add").tensor("a", mm["out"]).tensor("b", d, {384}, ext).tensor("out", d, {130, 384}, ext);
    CompileOptions options;
    options.emit.arch = "sm_90a";
    options.emit.sms = sms;
    options.emit.stream_k = true;
    Compiled c = compile(load_program(std::move(b).graph(), {}), options);
    ASSERT_EQ(c.emitted.kernels.size(), 1u);
    const EmittedKernel& k = c.emitted.kernels[0];
    EXPECT_EQ(k.mainloop, MatmulMainloop::hopper);
    EXPECT_NE(k.matmul_path.find(path), std::string::npos) << sms << " SMs: " << k.matmul_path;
    if (sms == 2) EXPECT_EQ(k.stream_k_grid, 4) << "two blocks of one consumer an SM";
    uint64_t seed = test_seed();
    SCOPED_TRACE("seed " + std::to_string(seed) + ", " + std::to_string(sms) + " SMs");
    CheckedRun run = run_checked(c, RunOptions{seed, work_dir("hopper_sms_" + std::to_string(sms))});
    ASSERT_EQ(run.checks.size(), 1u);
    for (const auto& check : run.checks) EXPECT_TRUE(check.ok()) << format_run(run);
  }
}

// f32 products whose rows are whole 16-byte chunks: every transpose, a batch
// broadcast, an epilogue (bias, GELU), K ending inside a k-tile, partial
// tiles everywhere.
static void add_f32_products(GraphBuilder& b) {
  const DType d = DType::f32;
  auto mm = b.task("mm", "matmul").tensor("a", d, {136, 324}, ext).tensor("b", d, {324, 196}, ext).tensor("out", d, {136, 196});
  auto bias = b.task("bias", "add").tensor("a", mm["out"]).tensor("b", d, {196}, ext).tensor("out", d, {136, 196});
  b.task("act", "gelu").tensor("x", bias["out"]).tensor("out", d, {136, 196}, ext);
  b.task("mm_tn", "matmul").tensor("a", d, {516, 72}, ext).tensor("b", d, {516, 232}, ext).tensor("out", d, {72, 232}, ext).arg("trans_a", true);
  b.task("mm_tt", "matmul")
      .tensor("a", d, {324, 132}, ext)
      .tensor("b", d, {200, 324}, ext)
      .tensor("out", d, {132, 200}, ext)
      .arg("trans_a", true)
      .arg("trans_b", true)
      .arg("alpha", 0.5);
  b.task("mm_b", "matmul").tensor("a", d, {2, 3, 68, 324}, ext).tensor("b", d, {3, 324, 72}, ext).tensor("out", d, {2, 3, 68, 72}, ext);
}

// f32 matmuls of at least 2^24 FLOPs whose rows are whole 16-byte chunks
// run the SIMT mainloop (templates/gemm.cuh, 8 x 8 outputs a thread) in the
// generated kernel: every transpose, a batch broadcast, an epilogue (bias,
// GELU), K ending inside a k-tile, partial tiles everywhere; a smaller one
// keeps the portable tile and shares a launch.
TEST(Emulation, SimtMatmulMatchesTheReference) {
  GraphBuilder b("simt");
  add_f32_products(b);
  const DType d = DType::f32;
  b.task("small", "matmul").tensor("a", d, {20, 16}, ext).tensor("b", d, {16, 20}, ext).tensor("out", d, {20, 20}, ext);
  Compiled c = compile_graph(std::move(b).graph());
  std::vector<std::string> paths;
  int simt = 0;
  for (const EmittedKernel& k : c.emitted.tile_kernels) {
    if (k.matmul_path.empty()) continue;
    paths.push_back(k.name + ": " + k.matmul_path);
    simt += k.mainloop == MatmulMainloop::simt;
  }
  EXPECT_EQ(simt, 4) << "mm (with its epilogue), mm_tn, mm_tt, mm_b; not small:\n" << fmt::format("{}", fmt::join(paths, "\n"));
  EXPECT_NE(c.emitted.cuda_source.find("typedef cg_sgemm_config<64, 64, 8> cg_config;"), std::string::npos);
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(c, RunOptions{seed, work_dir("simt")});
  ASSERT_EQ(run.checks.size(), 5u);
  for (const auto& check : run.checks) EXPECT_TRUE(check.ok()) << format_run(run);
}

// --allow-tf32: every f32 matmul whose rows are whole 16-byte chunks runs the
// pipelined mainloop as TF32 (the SIMT graph above: every transpose, a batch
// broadcast, a bias and GELU epilogue, partial tiles; the small product too,
// and a split-K one), checked to TF32's bound (f16's 5e-3). Its errors lie
// beyond f32's bound (1e-5), so TF32 did run: the f32 kernels meet that.
TEST(Emulation, Tf32MatmulMatchesTheReferenceToItsBound) {
  GraphBuilder b("tf32");
  add_f32_products(b);
  const DType d = DType::f32;
  b.task("mm_split", "matmul").tensor("a", d, {40, 1000}, ext).tensor("b", d, {1000, 72}, ext).tensor("out", d, {40, 72}, ext);
  b.task("small", "matmul").tensor("a", d, {20, 16}, ext).tensor("b", d, {16, 20}, ext).tensor("out", d, {20, 20}, ext);
  CompileOptions options;
  options.emit.allow_tf32 = true;
  Compiled c = compile(load_program(std::move(b).graph(), {}), options);
  std::vector<std::string> paths;
  int tf32 = 0;
  for (const EmittedKernel& k : c.emitted.kernels) {
    if (k.matmul_path.empty()) continue;
    paths.push_back(k.name + ": " + k.matmul_path);
    tf32 += k.mainloop == MatmulMainloop::pipelined_tf32;
  }
  const std::string listed = fmt::format("{}", fmt::join(paths, "\n"));
  EXPECT_EQ(tf32, 6) << listed;
  EXPECT_NE(listed.find("64 x 64 x 16 tiles (TF32), 2 x 2 warps, 4 stages, split-K"), std::string::npos) << listed;
  EXPECT_NE(c.emitted.cuda_source.find("cg_gemm_mainloop<cg_config, cg_tf32, false, false>"), std::string::npos);
  EXPECT_NE(c.emitted.cuda_source.find("arch=sm_90 tf32"), std::string::npos) << "the options in the provenance header";
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(c, RunOptions{seed, work_dir("tf32")});
  ASSERT_EQ(run.checks.size(), 6u);
  for (const auto& check : run.checks) {
    EXPECT_TRUE(check.ok()) << format_run(run);
    // err / bound at 5e-3 above 1e-5 / 5e-3 is an error f32's bound refuses.
    EXPECT_GT(check.worst_ratio, 2e-3) << check.buffer << ": as exact as f32, so not TF32\n" << format_run(run);
  }
}

// The gradients of an f32 training step run TF32 too where allowed (the
// backward matmuls take transposed operands: the 32-bit shared loads), each
// task checked from its actual inputs to TF32's bound, the step's loss and
// updated weights end to end.
TEST(Emulation, Tf32TrainingStepMatchesTheReference) {
  GraphBuilder b("tf32_train");
  const DType d = DType::f32;
  auto w1 = b.task("w1", "uniform", Phase::init).tensor("out", d, {68, 132}).arg("low", -0.2).arg("high", 0.2).arg("seed", 5);
  auto w2 = b.task("w2", "uniform", Phase::init).tensor("out", d, {132, 12}).arg("low", -0.2).arg("high", 0.2).arg("seed", 6);
  auto fc1 = b.task("fc1", "matmul").tensor("a", d, {200, 68}, ext).tensor("b", w1["out"]).tensor("out", d, {200, 132});
  auto act = b.task("act", "relu").tensor("x", fc1["out"]).tensor("out", d, {200, 132});
  auto fc2 = b.task("fc2", "matmul").tensor("a", act["out"]).tensor("b", w2["out"]).tensor("out", d, {200, 12});
  b.task("loss", "cross_entropy").tensor("logits", fc2["out"]).tensor("labels", DType::i32, {200}, ext).tensor("loss", d, {}, ext);
  Program forward = load_program(std::move(b).graph(), {});
  std::vector<ArgSlot> args = {ArgSlot{"lr", ArgValue(0.1), {}, false, {}}};
  Program training = load_program(derive_training(forward, TrainingSpec{{"loss", "loss"}, "sgd", args, {}}).graph, {});
  CompileOptions options;
  options.emit.allow_tf32 = true;
  options.plan.placement.reuse = false;  // checking each task reads every buffer,
  options.fuse.enabled = false;          // so none stays in registers
  Compiled c = compile(std::move(training), options);
  int backward_tf32 = 0;
  std::string paths;
  for (const EmittedKernel& k : c.emitted.kernels) {
    backward_tf32 += k.phase == Phase::backward && k.mainloop == MatmulMainloop::pipelined_tf32;
    if (!k.matmul_path.empty()) paths += k.name + ": " + k.matmul_path + "\n";
  }
  EXPECT_EQ(backward_tf32, 3) << "the weight gradients (a^T dy) and fc2's input gradient (dy w^T)\n" << paths;
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  RunOptions run_options{seed, work_dir("tf32_train")};
  run_options.check_each_task = true;
  CheckedRun run = run_checked(c, run_options);
  EXPECT_TRUE(run.ok()) << format_run(run);
}

// Split-K (docs/gemm.md): 16-bit matmuls of few output tiles over a long K
// cut their k range into parts, each a block, and the block of a tile that
// ends last adds the parts in split order. Right against the float64
// reference (a K that ends inside a k-tile, both transposes with alpha, a
// batch broadcast, a bias epilogue on the sums), and the same bits under
// three block orders, whichever block ends last.
TEST(Emulation, SplitKMatmulMatchesTheReferenceAndIsDeterministic) {
  for (DType d : {DType::f16, DType::bf16}) {
    GraphBuilder b(std::string("split_k_") + to_string(d));
    auto mm = b.task("mm", "matmul").tensor("a", d, {40, 1000}, ext).tensor("b", d, {1000, 72}, ext).tensor("out", d, {40, 72});
    b.task("bias", "add").tensor("a", mm["out"]).tensor("b", d, {72}, ext).tensor("out", d, {40, 72}, ext);
    b.task("mm_tt", "matmul")
        .tensor("a", d, {520, 24}, ext)
        .tensor("b", d, {136, 520}, ext)
        .tensor("out", d, {24, 136}, ext)
        .arg("trans_a", true)
        .arg("trans_b", true)
        .arg("alpha", 0.5);
    b.task("mm_b", "matmul").tensor("a", d, {2, 3, 16, 520}, ext).tensor("b", d, {3, 520, 24}, ext).tensor("out", d, {2, 3, 16, 24}, ext);
    Compiled c = compile_graph(std::move(b).graph());
    std::vector<std::string> splits;
    for (const EmittedKernel& k : c.emitted.kernels)
      if (k.matmul_path.find("split-K") != std::string::npos) splits.push_back(k.name + ": " + k.matmul_path);
    ASSERT_EQ(splits.size(), 3u) << fmt::format("{}", fmt::join(splits, "\n"));
    EXPECT_NE(splits[0].find("split-K 4 ways (8 k-tiles each)"), std::string::npos) << splits[0];
    EXPECT_GT(c.emitted.sync_bytes, 0) << "the arrival counters, zero before the first launch";
    const uint64_t seed = test_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    CheckedRun run = run_checked(c, RunOptions{seed, work_dir(std::string("split_k_") + to_string(d))});
    ASSERT_EQ(run.checks.size(), 3u);
    for (const auto& check : run.checks) EXPECT_TRUE(check.ok()) << format_run(run);

    // Fixed inputs: 16-bit values in [1/8, 1) of either sign, except mm's,
    // whose first two parts of k cancel (b's rows are +2048 for k < 256,
    // -2048 for k in [256, 512), a is 1): added in split order, the sum is
    // the last two parts' exactly; in another order their small values are
    // lost beside 2^19 and the 16-bit result shows it. Three block orders.
    HostModule module = HostModule::build(c.emitted.cuda_source, work_dir(std::string("split_k_bits_") + to_string(d)));
    std::vector<unsigned char> inputs(size_t(c.plan.arena_bytes), 0);
    const bool half = d == DType::f16;
    auto put = [&](int64_t byte, unsigned value) {
      inputs[size_t(byte)] = static_cast<unsigned char>(value & 0xffu);
      inputs[size_t(byte) + 1] = static_cast<unsigned char>(value >> 8);
    };
    std::mt19937 bits(5);
    for (int64_t i = 0; i + 1 < c.emitted.sync_offset; i += 2) {
      const unsigned mantissa = bits() & (half ? 0x3ffu : 0x7fu), sign = bits() & 1u;
      const unsigned exponent = half ? 12u + bits() % 3u : 124u + bits() % 3u;
      put(i, (sign << 15) | (exponent << (half ? 10 : 7)) | mantissa);
    }
    const Plan::Location a = c.plan.lookup(c.program, "mm", "a"), mm_b = c.plan.lookup(c.program, "mm", "b");
    for (int64_t i = 0; i < 40 * 1000; ++i) put(a.offset + 2 * i, half ? 0x3c00u : 0x3f80u);  // 1
    for (int64_t k = 0; k < 512; ++k)
      for (int64_t n = 0; n < 72; ++n) put(mm_b.offset + 2 * (k * 72 + n), (k < 256 ? 0u : 0x8000u) | (half ? 0x6800u : 0x4500u));
    std::vector<unsigned char> first;
    for (unsigned long long order : {11ull, 12ull, 13ull}) {
      std::vector<unsigned char> arena = inputs;
      module.set_seed(order);
      module.run_phase(Phase::forward, arena.data());
      if (first.empty()) first = arena;
      EXPECT_TRUE(arena == first) << "block order " << order << " changed the bits of the result";
      EXPECT_TRUE(std::all_of(arena.begin() + c.emitted.sync_offset, arena.end(), [](unsigned char x) { return x == 0; }))
          << "every launch leaves the arrival counters at zero";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, EmulatedHalfOps,
                         ::testing::Combine(::testing::Values(DType::f16, DType::bf16),
                                            ::testing::Values(1, 7, 33, 1000, 4097)));

TEST(Emulation, UnfusedAndUnreusedPlansGiveTheSameResults) {
  CompileOptions no_reuse;
  no_reuse.plan.placement.reuse = false;
  TaskGraph g = read_graph(read_text_file(test_source_dir() + "/examples/mlp_forward.json"));
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const CompileOptions& options : {CompileOptions{}, no_reuse}) {
    Compiled c = compile(load_program(g, {}), options);
    CheckedRun run = run_checked(c, RunOptions{seed, work_dir("mlp")});
    EXPECT_TRUE(run.ok()) << format_run(run);
  }
}

// Each emulated module keeps fiber stacks for its next launch (two memory
// maps each: the guard page splits them), and glibc never unloads a module
// with thread_local state: a test process that runs hundreds of graphs ran out
// of memory maps until a module gave its stacks back when its runner let go.
TEST(Emulation, AModuleGivesBackItsFiberStacksWhenReleased) {
  auto maps = [] {
    std::ifstream in("/proc/self/maps");
    return std::count(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>(), '\n');
  };
  const auto before = maps();
  const uint64_t seed = test_seed();
  for (int64_t i = 0; i < 6; ++i) {  // six modules, each 256-thread blocks
    GraphBuilder b("stacks_" + std::to_string(i));
    b.task("sm", "softmax").tensor("x", DType::f32, {2, 256 + i}, Storage::external).tensor("out", DType::f32, {2, 256 + i}, Storage::external);
    CheckedRun run = run_checked(compile(load_program(std::move(b).graph(), {}), {}), RunOptions{seed, work_dir("stacks")});
    EXPECT_TRUE(run.ok()) << format_run(run);
  }
  // Kept, they would be 6 x 256 stacks x 2 maps; what stays is the modules' own.
  EXPECT_LT(maps() - before, 300) << "memory maps before: " << before;
}

TEST(Emulation, CatchesAnOutOfBoundsStoreNamingKernelAndTensor) {
  GraphBuilder b("oob");
  b.task("act", "relu").tensor("x", f32, {7}, ext).tensor("out", f32, {7}, ext);
  Compiled c = compile_graph(std::move(b).graph());
  std::string source = c.emitted.cuda_source;
  size_t loop = source.find("i < 7;");
  ASSERT_NE(loop, std::string::npos);
  source.replace(loop, 6, "i < 8;");  // the planted bug: one element too many
  HostModule module = HostModule::build(source, work_dir("oob"));
  std::vector<unsigned char> arena(size_t(c.plan.arena_bytes), 0);
  try {
    module.run_phase(Phase::forward, arena.data());
    FAIL() << "the out-of-bounds access went unnoticed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("kernel k0_act: out-of-bounds load of tensor 'x' (buffer act.x): element 7 of 7"),
              std::string::npos)
        << e.what();
  }
}

// The end-to-end check's tolerance follows the dtypes a value was computed
// in: an f32 product widened to f64 is held to f32's 1e-5 (f64's 1e-12
// failed it), while an exact bf16 input widened to f32 passes nothing on:
// a relu after it, off by 1e-4, still fails at f32's tolerance.
TEST(Emulation, ToleranceFollowsTheDtypesAValueWasComputedIn) {
  GraphBuilder b("tolerance");
  auto widen = b.task("widen", "cast").tensor("x", DType::bf16, {64}, ext).tensor("out", f32, {64});
  b.task("act", "relu").tensor("x", widen["out"]).tensor("out", f32, {64}, ext);
  auto product = b.task("product", "mul").tensor("a", f32, {64}, ext).tensor("b", f32, {64}, ext).tensor("out", f32, {64});
  b.task("to64", "cast").tensor("x", product["out"]).tensor("out", DType::f64, {64}, ext);
  Compiled c = compile_graph(std::move(b).graph());
  CheckedRun good = run_emulated_and_check(c, RunOptions{3, work_dir("tolerance_ok")});
  EXPECT_TRUE(good.ok()) << format_run(good);
  std::string& source = c.emitted.cuda_source;
  const size_t relu = source.find("cg_relu<float>(");
  ASSERT_NE(relu, std::string::npos);
  source.insert(relu, "1.0001f * ");  // the planted error: 1e-4 relative
  CheckedRun bad = run_emulated_and_check(c, RunOptions{3, work_dir("tolerance_bad")});
  bool act_failed = false;
  for (const auto& check : bad.checks) act_failed = act_failed || (check.buffer == "act.out" && !check.ok());
  EXPECT_TRUE(act_failed) << format_run(bad);
}

// A computed value just below 0 may come out of its kernel just above it
// (a TF32 convolution's sum, within its tolerance), and relu then passes it
// on where the reference gives 0: the scale after relu must cover that, not
// only relu's slope at the reference's value (0). Likewise relu's gradient,
// which jumps from 0 to dout at 0. A seed of the TF32 channels-last test
// failed on the first (a residual added after the relu).
TEST(Emulation, AnErrorThatMayCrossAKinkIsInTheScaleAfterIt) {
  GraphBuilder b("kink");
  auto sum = b.task("sum", "add").tensor("a", f32, {1}, ext).tensor("b", f32, {1}, ext).tensor("out", f32, {1});
  auto act = b.task("act", "relu").tensor("x", sum["out"]).tensor("out", f32, {1});
  b.task("residual", "add").tensor("a", act["out"]).tensor("b", f32, {1}, ext).tensor("out", f32, {1}, ext);
  b.task("grad", "relu_backward")
      .tensor("x", sum["out"])
      .tensor("dout", f32, {1}, ext)
      .tensor("dx", f32, {1}, ext);
  Program p = load_program(std::move(b).graph(), {});
  auto buffer = [&](const std::string& task, const char* slot) {
    for (const BoundTask& t : p.tasks)
      if (t.task->id == task) return t.find_tensor(slot)->buffer;
    throw std::logic_error("no task " + task);
  };
  std::vector<std::vector<double>> inputs(p.buffers.size());
  inputs[size_t(buffer("sum", "a"))] = {1.0};
  inputs[size_t(buffer("sum", "b"))] = {-1.0001};  // the sum: -1e-4, of scale 2
  inputs[size_t(buffer("residual", "b"))] = {-0.34};
  inputs[size_t(buffer("grad", "dout"))] = {0.5};
  const Schedule order = schedule(p);
  const double rtol = 5e-3;  // f16's, as TF32's sums are checked to
  std::vector<double> carried(p.buffers.size(), 0.0);
  carried[size_t(buffer("sum", "out"))] = rtol;

  const int out = buffer("residual", "out"), dx = buffer("grad", "dx");
  const ReferenceBuffers first_order = evaluate_reference(p, order, inputs);
  EXPECT_DOUBLE_EQ(first_order.value[size_t(out)][0], -0.34);
  EXPECT_NEAR(first_order.abs[size_t(out)][0], 0.34, 1e-12) << "relu's slope at -1e-4 is 0";
  EXPECT_LT(first_order.abs[size_t(dx)][0], 1e-30) << "relu's gradient at -1e-4 does not depend on dout";

  const ReferenceBuffers carried_across = evaluate_reference(p, order, inputs, {}, {}, carried);
  EXPECT_DOUBLE_EQ(carried_across.value[size_t(out)][0], -0.34) << "the values do not change, only their scales";
  // The sum may come out as high as -1e-4 + rtol * 2.0001, and relu passes that on.
  EXPECT_GE(rtol * carried_across.abs[size_t(out)][0], -1e-4 + rtol * 2.0001);
  EXPECT_LT(carried_across.abs[size_t(out)][0], 0.34 + 2.0001 + 1e-9);
  // The gradient may come out as dout (0.5) where the reference gives 0.
  EXPECT_GE(rtol * carried_across.abs[size_t(dx)][0], 0.5 * (1 - 1e-9));
}

TEST(Emulation, ExposesAMissingSyncthreads) {
  GraphBuilder b("race");
  b.task("t", "transpose").tensor("x", f32, {3, 40, 70}, ext).tensor("out", f32, {3, 70, 40}, ext);
  Compiled c = compile_graph(std::move(b).graph());
  CheckedRun good = run_emulated_and_check(c, RunOptions{7, work_dir("race_ok")});
  ASSERT_TRUE(good.ok()) << format_run(good);
  // The planted bug: the transpose tile is read back before every thread wrote its part.
  std::string& source = c.emitted.cuda_source;
  size_t sync = source.find("__syncthreads();", source.find("cg_transpose_tile"));
  ASSERT_NE(sync, std::string::npos);
  source.erase(sync, std::string("__syncthreads();").size());
  CheckedRun bad = run_emulated_and_check(c, RunOptions{7, work_dir("race_bad")});
  ASSERT_EQ(bad.checks.size(), 1u);
  EXPECT_FALSE(bad.checks[0].ok()) << "a missing barrier must give a wrong result in emulation";
  EXPECT_GT(bad.checks[0].failures, 40 * 70) << format_run(bad);
}

TEST(Emulation, ReportsADivergentBarrier) {
  GraphBuilder b("divergent");
  b.task("s", "softmax").tensor("x", f32, {2, 64}, ext).tensor("out", f32, {2, 64}, ext);
  Compiled c = compile_graph(std::move(b).graph());
  std::string source = c.emitted.cuda_source;
  size_t body = source.find("  const cg_i64 row = tile.x;");
  ASSERT_NE(body, std::string::npos);
  source.insert(body, "  if (threadIdx.x == 5) return;\n");  // one thread skips the block reductions
  HostModule module = HostModule::build(source, work_dir("divergent"));
  std::vector<unsigned char> arena(size_t(c.plan.arena_bytes), 0);
  try {
    module.run_phase(Phase::forward, arena.data());
    FAIL() << "a barrier that one thread never reaches went unnoticed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("is stuck: 1 of 64 threads finished"), std::string::npos) << e.what();
  }
}

// reshape is a view: no kernel, its output at its input's offset (with or
// without reuse), and what reads it sees the producer's values.
TEST(Emulation, ReshapeIsAViewWithoutAKernel) {
  for (bool reuse : {true, false}) {
    GraphBuilder b("view");
    auto r = b.task("act", "relu").tensor("x", f32, {6, 10}, ext).tensor("out", f32, {6, 10});
    auto v = b.task("flat", "reshape").tensor("x", r["out"]).tensor("out", f32, {60});
    b.task("shift", "add").tensor("a", v["out"]).tensor("b", f32, {60}, ext).tensor("out", f32, {60}, ext);
    CompileOptions options;
    options.plan.placement.reuse = reuse;
    Compiled c = compile(load_program(std::move(b).graph(), {}), options);
    ASSERT_EQ(c.kernels.size(), 2u) << "relu and add; the reshape runs no kernel";
    EXPECT_EQ(c.plan.lookup(c.program, "flat", "out").offset, c.plan.lookup(c.program, "act", "out").offset);
    EXPECT_EQ(c.emitted.cuda_source.find("flat"), c.emitted.cuda_source.find("flat.out")) << "named only as a buffer";
    uint64_t seed = test_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    CheckedRun run = run_checked(c, RunOptions{seed, work_dir(reuse ? "view" : "view_no_reuse")});
    EXPECT_TRUE(run.ok()) << format_run(run);
  }
}

TEST(Emulation, InPlaceOutputsComputeTheSameResults) {
  GraphBuilder b("in_place");
  auto r1 = b.task("r1", "relu").tensor("x", f32, {33, 7}, ext).tensor("out", f32, {33, 7});
  auto r2 = b.task("r2", "add").tensor("a", r1["out"]).tensor("b", f32, {7}, ext).tensor("out", f32, {33, 7});
  b.task("r3", "relu").tensor("x", r2["out"]).tensor("out", f32, {33, 7}, ext);
  CompileOptions unfused;  // fused, r1.out and r2.out would stay in registers: nothing to place in place
  unfused.fuse.enabled = false;
  Compiled c = compile(load_program(std::move(b).graph(), {}), unfused);
  EXPECT_EQ(c.plan.lookup(c.program, "r1", "out").offset, c.plan.lookup(c.program, "r2", "out").offset);
  EXPECT_NE(c.emitted.cuda_source.find("k1_r2(const float* a, const float* __restrict__ b, float* out)"), std::string::npos)
      << "the aliased pair loses __restrict__, the other pointer keeps it";
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(c, RunOptions{seed, work_dir("in_place")});
  EXPECT_TRUE(run.ok()) << format_run(run);
}

// The bundled training step (init, forward, cross-entropy, backward, SGD) end
// to end: the loss, the logits and the four weights after one update, against
// the float64 reference of the whole graph.
TEST(Emulation, MlpTrainingStepMatchesTheReference) {
  TaskGraph g = read_graph(read_text_file(test_source_dir() + "/examples/mlp_train.json"));
  Compiled c = compile(load_program(std::move(g), {}), {});
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(c, RunOptions{seed, work_dir("mlp_train")});
  std::vector<std::string> checked;
  for (const auto& check : run.checks) checked.push_back(check.buffer);
  EXPECT_EQ(checked, (std::vector<std::string>{"w1_init.out", "b1_init.out", "w2_init.out", "b2_init.out", "bias2.out",
                                               "loss.loss"}));
  EXPECT_TRUE(run.ok()) << format_run(run);
  // Per-task checks: the update reads the weights init wrote, which are read
  // back before the update overwrites them, so it is checked too.
  CompileOptions keep_all;  // every task's output in memory: no reuse, no fusion
  keep_all.plan.placement.reuse = false;
  keep_all.fuse.enabled = false;
  Compiled unreused = compile(load_program(read_graph(read_text_file(test_source_dir() +
                                                                     "/examples/mlp_train.json")),
                                           {}),
                              keep_all);
  RunOptions each{seed, work_dir("mlp_train_each")};
  each.check_each_task = true;
  CheckedRun per_task = run_checked(unreused, each);
  EXPECT_TRUE(per_task.ok()) << format_run(per_task);
  bool update_checked = false;
  for (const auto& check : per_task.checks) update_checked = update_checked || check.buffer == "task sgd_w1.param";
  EXPECT_TRUE(update_checked) << format_run(per_task);
}

// End to end, and each of its 26 tasks on the inputs the previous kernels
// produced: the end-to-end bound compounds through two norms and a softmax,
// the per-task bounds do not.
TEST(Emulation, TransformerBlockForwardMatchesTheReference) {
  TaskGraph g = read_graph(read_text_file(test_source_dir() + "/examples/transformer_block.json"));
  CompileOptions keep_all;  // every task's output in memory: no reuse, no fusion
  keep_all.plan.placement.reuse = false;
  keep_all.fuse.enabled = false;
  Compiled c = compile(load_program(std::move(g), {}), keep_all);
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  RunOptions options{seed, work_dir("transformer")};
  options.check_each_task = true;
  CheckedRun run = run_checked(c, options);
  ASSERT_EQ(run.checks.size(), 35u);  // 26 tasks, the output, and the 8 weights the init tasks write
  EXPECT_TRUE(run.ok()) << format_run(run);
  for (const auto& check : run.checks)
    if (check.buffer.rfind("task ", 0) == 0) EXPECT_LT(check.worst_ratio, 0.5) << format_run(run);
}

// A grid whose y or z is over CUDA's 65535 (the emulator refuses it, as a GPU
// would) is launched folded into x and unfolded in the kernel (issue #34):
// 65537 batches of a transpose, each tile where it belongs.
TEST(Emulation, GridsOverTheYAndZLimitRunFolded) {
  GraphBuilder b("folded");
  b.task("t", "transpose").tensor("x", f32, {65537, 2, 3}, ext).tensor("out", f32, {65537, 3, 2}, ext);
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  ASSERT_EQ(c.emitted.kernels.size(), 1u);
  EXPECT_EQ(c.emitted.kernels[0].grid[2], 65537);
  EXPECT_TRUE(grid_is_folded(c.emitted.kernels[0]));
  EXPECT_NE(c.emitted.cuda_source.find("cg_tile_of(blockIdx.x, 1u, 1u)"), std::string::npos);
  EXPECT_NE(c.emitted.cuda_source.find("dim3(65537, 1, 1)"), std::string::npos);
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(c, RunOptions{seed, work_dir("folded_grid")});
  EXPECT_TRUE(run.ok()) << format_run(run);
}
