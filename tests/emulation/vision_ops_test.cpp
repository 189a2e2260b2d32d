// The ops a convolutional network needs (templates/vision.cuh, relu6 and
// hardswish) and their gradients: generated, run on the emulated GPU (or the GPU, with
// CUDAGEN_TEST_BACKEND=gpu), compared with the float64 reference, fused and
// unfused, at sizes that are not multiples of a tile; and the errors of a
// convolution or permutation that cannot be.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <cmath>
#include <random>
#include <set>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "builder.h"
#include "derive.h"
#include "diagnostics.h"
#include "pipeline.h"
#include "runner.h"
#include "test_backend.h"

using namespace cudagen;
using cudagen::testing::run_checked;
using cudagen::testing::test_seed;

namespace {

constexpr Storage ext = Storage::external;
constexpr Storage persistent = Storage::persistent;

std::string work_dir(const std::string& name) {
  return cudagen::testing::work_dir("vision_test", name);
}

// Output size of a convolution or pooling along one axis (PyTorch's formula).
int64_t out_size(int64_t in, int64_t kernel, int64_t stride, int64_t padding, int64_t dilation = 1) {
  return (in + 2 * padding - dilation * (kernel - 1) - 1) / stride + 1;
}

struct Conv {
  std::string id;
  int64_t batch, channels, size, out_channels, kernel, stride, padding, dilation, groups;
  bool bias;
};

void add_conv(GraphBuilder& b, DType d, const Conv& c) {
  const int64_t o = out_size(c.size, c.kernel, c.stride, c.padding, c.dilation);
  TaskBuilder t = b.task(c.id, "conv2d");
  t.tensor("x", d, {c.batch, c.channels, c.size, c.size + 1}, ext)
      .tensor("weight", d, {c.out_channels, c.channels / c.groups, c.kernel, c.kernel}, persistent);
  if (c.bias) t.tensor("bias", d, {c.out_channels}, persistent);
  t.tensor("out", d, {c.batch, c.out_channels, o, out_size(c.size + 1, c.kernel, c.stride, c.padding, c.dilation)}, ext)
      .arg("stride_h", c.stride)
      .arg("stride_w", c.stride)
      .arg("padding_h", c.padding)
      .arg("padding_w", c.padding)
      .arg("dilation_h", c.dilation)
      .arg("dilation_w", c.dilation)
      .arg("groups", c.groups);
}

// Spatial size n (the width is n + 1): every convolution form, the pools,
// permute and the two activations with their gradients.
TaskGraph vision_ops(int64_t n, DType d) {
  const std::string t = to_string(d);
  GraphBuilder b(fmt::format("vision_{}_{}", t, n));
  add_conv(b, d, {"conv3x3", 2, 5, n, 33, 3, 1, 1, 1, 1, false});          // tile form, padding
  add_conv(b, d, {"stem7x7", 1, 3, n + 6, 40, 7, 2, 3, 1, 1, true});       // ResNet's stem: stride 2, bias
  add_conv(b, d, {"dilated", 1, 8, n + 4, 18, 3, 1, 2, 2, 2, true});       // dilation, two groups (tile)
  add_conv(b, d, {"depthwise", 2, 12, n, 12, 3, 2, 1, 1, 12, false});      // depthwise: the direct form
  add_conv(b, d, {"pointwise", 1, 20, n, 24, 1, 1, 0, 1, 1, true});        // 1x1
  add_conv(b, d, {"grouped_thin", 1, 6, n, 6, 3, 1, 1, 1, 3, true});       // 2 channels per group: direct
  const int64_t pooled = out_size(n + 2, 3, 2, 1);
  b.task("max_pool", "max_pool2d")
      .tensor("x", d, {2, 3, n + 2, n + 3}, ext)
      .tensor("out", d, {2, 3, pooled, out_size(n + 3, 3, 2, 1)}, ext)
      .arg("kernel_h", 3)
      .arg("kernel_w", 3)
      .arg("stride_h", 2)
      .arg("stride_w", 2)
      .arg("padding_h", 1)
      .arg("padding_w", 1);
  // ceil_mode (SqueezeNet, GoogLeNet): the last window overhangs the input and takes what it covers.
  b.task("max_pool_ceil", "max_pool2d")
      .tensor("x", d, {2, n + 2, n + 3}, ext)
      .tensor("out", d, {2, (n + 2 - 3 + 1) / 2 + 1, (n + 3 - 3 + 1) / 2 + 1}, ext)
      .arg("kernel_h", 3)
      .arg("kernel_w", 3)
      .arg("stride_h", 2)
      .arg("stride_w", 2)
      .arg("ceil_mode", true);
  b.task("avg_pool", "avg_pool2d")
      .tensor("x", d, {3, n + 1, n + 2}, ext)
      .tensor("out", d, {3, (n + 1 - 2) / 2 + 1, (n + 2 - 2) / 2 + 1}, ext)
      .arg("kernel_h", 2)
      .arg("kernel_w", 2)
      .arg("stride_h", 2)
      .arg("stride_w", 2);
  for (bool include : {true, false})
    b.task(include ? "avg_pool_pad" : "avg_pool_pad_excluded", "avg_pool2d")
        .tensor("x", d, {2, 2, n, n + 1}, ext)
        .tensor("out", d, {2, 2, n, n + 1}, ext)
        .arg("kernel_h", 3)
        .arg("kernel_w", 3)
        .arg("stride_h", 1)
        .arg("stride_w", 1)
        .arg("padding_h", 1)
        .arg("padding_w", 1)
        .arg("count_include_pad", include);
  b.task("global_pool", "adaptive_avg_pool2d").tensor("x", d, {2, 7, n, n + 2}, ext).tensor("out", d, {2, 7, 1, 1}, ext);
  b.task("adaptive_pool", "adaptive_avg_pool2d")
      .tensor("x", d, {3, n + 4, n + 2}, ext)
      .tensor("out", d, {3, 3, 2}, ext);
  b.task("permute", "permute")
      .tensor("x", d, {2, n, 3, 5}, ext)
      .tensor("out", d, {5, 2, 3, n}, ext)
      .arg("dims", ArgValue(std::vector<int64_t>{3, 0, 2, 1}));
  // Inputs in [-1, 1] would never reach relu6's and hardswish's upper kinks: scale them first.
  auto wide = b.task("wide", "affine").tensor("x", d, {n, 5}, ext).tensor("out", d, {n, 5}, ext).arg("scale", 8.0);
  for (const char* op : {"relu6", "hardswish", "hardsigmoid"}) b.task(op, op).tensor("x", wide["out"]).tensor("out", d, {n, 5}, ext);
  for (const char* op : {"relu6_backward", "hardswish_backward", "hardsigmoid_backward"})
    b.task(op, op).tensor("x", wide["out"]).tensor("dout", d, {n, 5}, ext).tensor("dx", d, {n, 5}, ext);
  return std::move(b).graph();
}

struct Case {
  int64_t n;
  DType dtype;
};

class VisionOps : public ::testing::TestWithParam<Case> {};

TEST_P(VisionOps, MatchTheFloat64ReferenceFusedAndUnfused) {
  const auto [n, dtype] = GetParam();
  for (bool fuse : {true, false}) {
    CompileOptions options;
    options.fuse.enabled = fuse;
    Compiled c = compile(load_program(vision_ops(n, dtype), {}), options);
    const uint64_t seed = test_seed();
    SCOPED_TRACE(fmt::format("seed {}, {}", seed, fuse ? "fused" : "unfused"));
    CheckedRun run =
        run_checked(c, RunOptions{seed, work_dir(fmt::format("{}_{}_{}", to_string(dtype), n, fuse ? "f" : "u"))});
    EXPECT_EQ(run.checks.size(), 21u);
    for (const auto& check : run.checks) EXPECT_TRUE(check.ok()) << format_run(run);
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, VisionOps,
                         ::testing::Values(Case{1, DType::f32}, Case{7, DType::f32}, Case{13, DType::f32},
                                           Case{7, DType::f16}, Case{9, DType::bf16}),
                         [](const auto& info) {
                           return fmt::format("{}_{}", to_string(info.param.dtype), info.param.n);
                         });

// The convolution forms the emitter picks: the tile (an implicit GEMM on the
// matmul tile) where the GEMM is wide, the direct loop for depthwise.
TEST(VisionOps, ConvolutionPicksTheTileOrTheDirectForm) {
  Compiled c = compile(load_program(vision_ops(7, DType::f32), {}), {});
  const std::string& cu = c.emitted.cuda_source;
  // A kernel's text, from its comment ("// Kernel k3_depthwise (forward phase): ...") to its end.
  auto kernel_text = [&](const std::string& task) {
    for (size_t k = cu.find("// Kernel k"); k != std::string::npos; k = cu.find("// Kernel k", k + 1))
      if (cu.substr(k, cu.find(' ', k + 10) - k).ends_with("_" + task)) return cu.substr(k, cu.find("\n}\n", k) - k);
    return std::string();
  };
  ASSERT_FALSE(kernel_text("depthwise").empty()) << cu;
  EXPECT_NE(kernel_text("conv3x3").find("cg_conv2d_tile<32, 32, 16>"), std::string::npos) << cu;
  EXPECT_NE(kernel_text("depthwise").find("cg_conv2d_direct("), std::string::npos);
  EXPECT_NE(kernel_text("grouped_thin").find("cg_conv2d_direct("), std::string::npos);
}

// Bias, activation and residual add after a convolution run in its epilogue:
// one kernel, and the intermediate tensors get no memory.
TEST(VisionOps, ConvolutionTakesAnEpilogue) {
  GraphBuilder b("conv_epilogue");
  auto conv = b.task("conv", "conv2d")
                  .tensor("x", DType::f32, {2, 16, 9, 9}, ext)
                  .tensor("weight", DType::f32, {32, 16, 3, 3}, persistent)
                  .tensor("out", DType::f32, {2, 32, 9, 9})
                  .arg("padding_h", 1)
                  .arg("padding_w", 1);
  auto bias = b.task("bias", "add")
                  .tensor("a", conv["out"])
                  .tensor("b", DType::f32, {32, 1, 1}, persistent)
                  .tensor("out", DType::f32, {2, 32, 9, 9});
  auto act = b.task("act", "relu").tensor("x", bias["out"]).tensor("out", DType::f32, {2, 32, 9, 9});
  b.task("residual", "add")
      .tensor("a", act["out"])
      .tensor("b", DType::f32, {2, 32, 9, 9}, ext)
      .tensor("out", DType::f32, {2, 32, 9, 9}, ext);
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  ASSERT_EQ(c.emitted.kernels.size(), 1u);
  EXPECT_EQ(c.emitted.kernels[0].tasks.size(), 4u);
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(c, RunOptions{seed, work_dir("epilogue")});
  ASSERT_EQ(run.checks.size(), 1u);
  EXPECT_TRUE(run.checks[0].ok()) << format_run(run);
}

// conv2d_backward in each of its forms and with each subset of gradients,
// and the pooling gradients, on external inputs at spatial size n (width
// n + 1).
TaskGraph vision_gradients(int64_t n, DType d) {
  GraphBuilder b(fmt::format("vision_gradients_{}_{}", to_string(d), n));
  struct ConvGradient {
    Conv conv;
    bool dx, dweight, dbias;
  };
  for (const ConvGradient& c : {
           ConvGradient{{"conv3x3", 2, 9, n, 33, 3, 1, 1, 1, 1, false}, true, true, true},    // tiles for dx and dweight
           ConvGradient{{"strided", 2, 16, n + 2, 12, 3, 2, 1, 1, 2, false}, true, true, false},  // stride 2, two groups
           ConvGradient{{"dilated", 1, 8, n + 4, 18, 3, 1, 2, 2, 1, false}, false, true, true},   // dilation; no dx
           ConvGradient{{"depthwise", 2, 6, n, 6, 3, 2, 1, 1, 6, false}, true, true, true},      // the direct forms
           ConvGradient{{"pointwise", 1, 20, n, 24, 1, 1, 0, 1, 1, false}, true, false, false},  // 1x1, dx alone
       }) {
    const Conv& k = c.conv;
    const int64_t oh = out_size(k.size, k.kernel, k.stride, k.padding, k.dilation),
                  ow = out_size(k.size + 1, k.kernel, k.stride, k.padding, k.dilation);
    const Shape x = {k.batch, k.channels, k.size, k.size + 1}, w = {k.out_channels, k.channels / k.groups, k.kernel, k.kernel};
    TaskBuilder t = b.task(k.id, "conv2d_backward");
    t.tensor("x", d, x, ext).tensor("weight", d, w, persistent).tensor("dout", d, {k.batch, k.out_channels, oh, ow}, ext);
    if (c.dx) t.tensor("dx", d, x, ext);
    if (c.dweight) t.tensor("dweight", d, w, ext);
    if (c.dbias) t.tensor("dbias", d, {k.out_channels}, ext);
    t.arg("stride_h", k.stride)
        .arg("stride_w", k.stride)
        .arg("padding_h", k.padding)
        .arg("padding_w", k.padding)
        .arg("dilation_h", k.dilation)
        .arg("dilation_w", k.dilation)
        .arg("groups", k.groups);
  }
  // Windows that overlap (stride under the kernel), padding, dilation, ceil_mode.
  b.task("max_pool", "max_pool2d_backward")
      .tensor("x", d, {2, 3, n + 2, n + 3}, ext)
      .tensor("dout", d, {2, 3, out_size(n + 2, 3, 2, 1), out_size(n + 3, 3, 2, 1)}, ext)
      .tensor("dx", d, {2, 3, n + 2, n + 3}, ext)
      .arg("kernel_h", 3)
      .arg("kernel_w", 3)
      .arg("stride_h", 2)
      .arg("stride_w", 2)
      .arg("padding_h", 1)
      .arg("padding_w", 1);
  b.task("max_pool_dilated", "max_pool2d_backward")
      .tensor("x", d, {3, n + 4, n + 4}, ext)
      .tensor("dout", d, {3, out_size(n + 4, 2, 1, 0, 2), out_size(n + 4, 2, 1, 0, 2)}, ext)
      .tensor("dx", d, {3, n + 4, n + 4}, ext)
      .arg("kernel_h", 2)
      .arg("kernel_w", 2)
      .arg("stride_h", 1)
      .arg("stride_w", 1)
      .arg("dilation_h", 2)
      .arg("dilation_w", 2);
  b.task("max_pool_ceil", "max_pool2d_backward")
      .tensor("x", d, {2, n + 2, n + 3}, ext)
      .tensor("dout", d, {2, (n + 2 - 3 + 1) / 2 + 1, (n + 3 - 3 + 1) / 2 + 1}, ext)
      .tensor("dx", d, {2, n + 2, n + 3}, ext)
      .arg("kernel_h", 3)
      .arg("kernel_w", 3)
      .arg("stride_h", 2)
      .arg("stride_w", 2)
      .arg("ceil_mode", true);
  for (bool include : {true, false})
    b.task(include ? "avg_pool_pad" : "avg_pool_pad_excluded", "avg_pool2d_backward")
        .tensor("dout", d, {2, 2, out_size(n, 3, 2, 1), out_size(n + 1, 3, 2, 1)}, ext)
        .tensor("dx", d, {2, 2, n, n + 1}, ext)
        .arg("kernel_h", 3)
        .arg("kernel_w", 3)
        .arg("stride_h", 2)
        .arg("stride_w", 2)
        .arg("padding_h", 1)
        .arg("padding_w", 1)
        .arg("count_include_pad", include);
  // BatchNorm in training mode and its gradient, every optional slot bound.
  const Shape bn = {2, 5, n, n + 1};
  b.task("batchnorm", "batchnorm2d")
      .tensor("x", d, bn, ext)
      .tensor("weight", d, {5}, persistent)
      .tensor("bias", d, {5}, persistent)
      .tensor("running_mean", DType::f32, {5}, persistent)
      .tensor("running_var", DType::f32, {5}, persistent)
      .tensor("out", d, bn, ext)
      .tensor("mean", DType::f32, {5}, ext)
      .tensor("rstd", DType::f32, {5}, ext)
      .arg("momentum", 0.25);
  b.task("batchnorm_backward", "batchnorm2d_backward")
      .tensor("x", d, bn, ext)
      .tensor("weight", d, {5}, persistent)
      .tensor("mean", DType::f32, {5}, ext)
      .tensor("rstd", DType::f32, {5}, ext)
      .tensor("dout", d, bn, ext)
      .tensor("dx", d, bn, ext)
      .tensor("dweight", d, {5}, ext)
      .tensor("dbias", d, {5}, ext);
  b.task("global_pool", "adaptive_avg_pool2d_backward").tensor("dout", d, {2, 7, 1, 1}, ext).tensor("dx", d, {2, 7, n, n + 2}, ext);
  b.task("adaptive_pool", "adaptive_avg_pool2d_backward")
      .tensor("dout", d, {3, 3, 2}, ext)
      .tensor("dx", d, {3, n + 4, n + 2}, ext);
  return std::move(b).graph();
}

class VisionGradients : public ::testing::TestWithParam<Case> {};

TEST_P(VisionGradients, MatchTheFloat64Reference) {
  const auto [n, dtype] = GetParam();
  Compiled c = compile(load_program(vision_gradients(n, dtype), {}), {});
  const std::string& cu = c.emitted.cuda_source;
  // Each form of conv2d_backward is taken where this graph expects it.
  EXPECT_NE(cu.find("cg_conv2d_backward_data_tile<32, 32, 16>("), std::string::npos);
  EXPECT_NE(cu.find("cg_conv2d_backward_weight_tile<32, 32, 16>("), std::string::npos);
  EXPECT_NE(cu.find("cg_conv2d_backward_data_direct("), std::string::npos);
  EXPECT_NE(cu.find("cg_conv2d_backward_weight_direct("), std::string::npos);
  const uint64_t seed = test_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  CheckedRun run = run_checked(c, RunOptions{seed, work_dir(fmt::format("gradients_{}_{}", to_string(dtype), n))});
  EXPECT_EQ(run.checks.size(), 26u);
  for (const auto& check : run.checks) EXPECT_TRUE(check.ok()) << format_run(run);
}

INSTANTIATE_TEST_SUITE_P(Sizes, VisionGradients, ::testing::Values(Case{5, DType::f32}, Case{9, DType::bf16}),
                         [](const auto& info) {
                           return fmt::format("{}_{}", to_string(info.param.dtype), info.param.n);
                         });

// A small convolutional network (a strided, grouped, depthwise and pointwise
// convolution with a bias and a residual, BatchNorm in training mode, max,
// average and global pooling, a linear head) with its SGD step derived: every gradient the derive pass
// writes runs on the kernels above; each task of two steps is checked from
// its actual inputs (so a max pooling's choice is the device's own), and the
// loss falls.
TEST(VisionGradients, AConvolutionalNetworkTrains) {
  constexpr DType d = DType::f32;
  GraphBuilder b("convnet");
  const int64_t B = 2;
  // Weights drawn at init, uniform in +-1/sqrt(fan-in) (PyTorch's scale), so
  // that the activations stay near 1 and plain SGD steps lower the loss.
  int64_t seeds = 0;
  auto weight = [&](const std::string& id, const Shape& shape, int64_t fan_in) {
    const double bound = 1.0 / std::sqrt(double(fan_in));
    return b.task(id, "uniform", Phase::init)
        .tensor("out", d, shape)
        .arg("low", -bound)
        .arg("high", bound)
        .arg("seed", ++seeds)["out"];
  };
  auto conv = [&](const std::string& id, SlotRef x, int64_t c, int64_t size, int64_t o, int64_t kernel, int64_t stride,
                  int64_t padding, int64_t groups, bool bias) {
    const int64_t s = out_size(size, kernel, stride, padding), fan_in = c / groups * kernel * kernel;
    TaskBuilder t = b.task(id, "conv2d");
    t.tensor("x", x).tensor("weight", weight(id + "_weight", {o, c / groups, kernel, kernel}, fan_in));
    if (bias) t.tensor("bias", weight(id + "_bias", {o}, fan_in));
    t.tensor("out", d, {B, o, s, s}).arg("stride_h", stride).arg("stride_w", stride).arg("padding_h", padding)
        .arg("padding_w", padding).arg("groups", groups);
    return t["out"];
  };
  auto image = b.task("image", "affine").tensor("x", d, {B, 3, 12, 12}, ext).tensor("out", d, {B, 3, 12, 12}).arg("scale", 1.0);
  SlotRef x = conv("stem", image["out"], 3, 12, 16, 3, 1, 1, 1, true);
  x = b.task("stem_bn", "batchnorm2d")  // training mode: the batch's statistics
          .tensor("x", x)
          .tensor("weight", weight("stem_bn_weight", {16}, 1))
          .tensor("bias", weight("stem_bn_bias", {16}, 100))
          .tensor("running_mean", d, {16}, persistent)
          .tensor("running_var", d, {16}, persistent)
          .tensor("out", d, {B, 16, 12, 12})
          .tensor("mean", d, {16})
          .tensor("rstd", d, {16})["out"];
  x = b.task("stem_act", "relu").tensor("x", x).tensor("out", d, {B, 16, 12, 12})["out"];
  x = b.task("pool", "max_pool2d")
          .tensor("x", x)
          .tensor("out", d, {B, 16, 6, 6})
          .arg("kernel_h", 2)
          .arg("kernel_w", 2)
          .arg("stride_h", 2)
          .arg("stride_w", 2)["out"];
  SlotRef y = conv("grouped", x, 16, 6, 16, 3, 1, 1, 2, false);
  y = b.task("grouped_act", "relu").tensor("x", y).tensor("out", d, {B, 16, 6, 6})["out"];
  y = conv("depthwise", y, 16, 6, 16, 3, 1, 1, 16, true);
  x = b.task("residual", "add").tensor("a", x).tensor("b", y).tensor("out", d, {B, 16, 6, 6})["out"];
  x = conv("down", x, 16, 6, 24, 3, 2, 1, 1, false);  // 3 x 3
  x = b.task("down_act", "relu").tensor("x", x).tensor("out", d, {B, 24, 3, 3})["out"];
  x = b.task("smooth", "avg_pool2d")
          .tensor("x", x)
          .tensor("out", d, {B, 24, 2, 2})
          .arg("kernel_h", 2)
          .arg("kernel_w", 2)
          .arg("stride_h", 1)
          .arg("stride_w", 1)["out"];
  x = b.task("global", "adaptive_avg_pool2d").tensor("x", x).tensor("out", d, {B, 24, 1, 1})["out"];
  x = b.task("flat", "reshape").tensor("x", x).tensor("out", d, {B, 24})["out"];
  x = b.task("head", "matmul").tensor("a", x).tensor("b", weight("head_weight", {24, 5}, 24)).tensor("out", d, {B, 5})["out"];
  b.task("loss", "cross_entropy").tensor("logits", x).tensor("labels", DType::i32, {B}, ext).tensor("loss", d, {}, ext);
  Program forward = load_program(std::move(b).graph(), {});
  std::vector<ArgSlot> args = {ArgSlot{"lr", ArgValue(0.2), {}, false, {}}};
  const TaskGraph trained = derive_training(forward, TrainingSpec{{"loss", "loss"}, "sgd", args, {}}).graph;
  std::set<std::string> ops;
  for (const auto& t : trained.tasks) ops.insert(t.op);
  for (const char* op : {"conv2d_backward", "max_pool2d_backward", "avg_pool2d_backward", "adaptive_avg_pool2d_backward",
                          "batchnorm2d_backward"})
    EXPECT_TRUE(ops.count(op)) << op;

  CompileOptions each;  // every buffer kept, so each task's inputs can be read back
  each.plan.placement.reuse = false;
  each.fuse.enabled = false;
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  RunOptions run_options{seed, work_dir("convnet_each")};
  run_options.steps = 2;
  run_options.check_each_task = true;
  CheckedRun run = run_checked(compile(load_program(trained, {}), each), run_options);
  EXPECT_TRUE(run.ok()) << format_run(run);

  // Fused, as a user compiles it: the loss over four steps, checked end to end.
  RunOptions fused_options{seed, work_dir("convnet_fused")};
  fused_options.steps = 4;
  CheckedRun fused = run_checked(compile(load_program(trained, {}), {}), fused_options);
  EXPECT_TRUE(fused.ok()) << format_run(fused);
  ASSERT_EQ(fused.step_scalars.size(), 1u);
  const std::vector<double>& loss = fused.step_scalars[0].second;
  ASSERT_EQ(loss.size(), 4u);
  EXPECT_LT(loss.back(), loss.front()) << format_run(fused);
}

std::string compile_error(TaskGraph g) {
  try {
    compile(load_program(std::move(g), {}), {});
  } catch (const CompileError& e) {
    return e.what();
  }
  return "(no error)";
}

// conv2d_nhwc, channels-last: each form at sizes that are not multiples of
// a tile (rows, columns, k-tiles), with stride, padding and dilation, and a
// bias, activation and residual in the first one's epilogue; and the
// channels-last pools.
struct NhwcConv {
  std::string id;
  int64_t batch, height, width, channels, out_channels, kernel, stride, padding, dilation, groups;
  std::string form;  // what its kernel's matmul_path says
};

const std::vector<NhwcConv>& nhwc_convs() {
  static const std::vector<NhwcConv> convs = {
      {"c3x3", 2, 7, 8, 16, 40, 3, 1, 1, 1, 1, "implicit GEMM"},         // 112 x 40 over 4.5 k-tiles
      {"strided", 1, 11, 10, 8, 24, 3, 2, 2, 2, 1, "implicit GEMM"},     // stride 2, dilation 2
      {"pointwise", 2, 5, 6, 32, 16, 1, 1, 0, 1, 1, "plain GEMM"},       // 1x1: x read as a matrix
      {"pointwise_strided", 1, 7, 8, 16, 24, 1, 2, 0, 1, 1, "implicit GEMM"},  // 1x1 of stride 2
      {"deep", 1, 3, 4, 256, 64, 3, 1, 1, 1, 1, "split-K"},              // 12 rows over 72 k-tiles
      {"stem", 1, 9, 9, 3, 16, 7, 2, 3, 1, 1, "3 input channels are not a multiple of"},  // 3 channels
      {"grouped", 1, 6, 7, 16, 8, 3, 1, 1, 1, 2, "implicit GEMM"},        // a product a group, 4 columns each
      {"grouped_wide", 2, 5, 6, 32, 32, 3, 1, 1, 1, 2, "implicit GEMM"},  // 16 columns a group: 16-byte stores
      {"deep_grouped", 1, 3, 4, 512, 64, 3, 1, 1, 1, 4, "split-K"},       // 4 groups, each split over K
      {"depthwise", 2, 6, 5, 12, 12, 3, 2, 1, 1, 12, "1 input channels a group are not a multiple of"},
      // Depthwise on whole 16-byte vectors of channels: its own form. 12 (bf16) or 24 (f32)
      // vectors a block (not a divisor of its 256 threads), with a bias, relu6 and residual after it;
      {"depthwise_wide", 2, 7, 6, 96, 96, 3, 1, 1, 1, 96, "the depthwise form"},
      // 34 or 68 vectors: blocks of 32 and the rest; 5 x 5 of stride 2;
      {"depthwise_5x5", 1, 9, 8, 272, 272, 5, 2, 2, 1, 272, "the depthwise form"},
      // dilation 2;
      {"depthwise_dilated", 1, 8, 9, 16, 16, 3, 1, 2, 2, 16, "the depthwise form"},
      // 7 x 7 over 256 channels: 16 vectors a block, so that its weights stay within 32 KiB.
      {"depthwise_7x7", 1, 6, 5, 256, 256, 7, 1, 3, 1, 256, "the depthwise form"},
  };
  return convs;
}

TaskGraph nhwc_graph(DType d) {
  GraphBuilder b(fmt::format("nhwc_{}", to_string(d)));
  for (const NhwcConv& c : nhwc_convs()) {
    const Shape out{c.batch, out_size(c.height, c.kernel, c.stride, c.padding, c.dilation),
                    out_size(c.width, c.kernel, c.stride, c.padding, c.dilation), c.out_channels};
    const bool epilogue = c.id == "c3x3" || c.id == "depthwise_wide";
    auto conv = b.task(c.id, "conv2d_nhwc")
                    .tensor("x", d, {c.batch, c.height, c.width, c.channels}, ext)
                    .tensor("weight", d, {c.out_channels, c.kernel, c.kernel, c.channels / c.groups}, persistent)
                    .tensor("out", d, out, epilogue ? Storage::transient : ext)
                    .arg("stride_h", c.stride)
                    .arg("stride_w", c.stride)
                    .arg("padding_h", c.padding)
                    .arg("padding_w", c.padding)
                    .arg("dilation_h", c.dilation)
                    .arg("dilation_w", c.dilation)
                    .arg("groups", c.groups);
    if (c.id == "c3x3") {  // the pools of channels-last networks, on its input's layout
      const Shape x{c.batch, c.height + 2, c.width + 1, c.channels};
      b.task("max_pool", "max_pool2d_nhwc")
          .tensor("x", d, x, ext)
          .tensor("out", d, {x[0], (x[1] + 2 - 3 + 1) / 2 + 1, (x[2] + 2 - 3 + 1) / 2 + 1, x[3]}, ext)
          .arg("kernel_h", 3)
          .arg("kernel_w", 3)
          .arg("stride_h", 2)
          .arg("stride_w", 2)
          .arg("padding_h", 1)
          .arg("padding_w", 1)
          .arg("ceil_mode", true);
      // Average pooling: padding left out of the divisor, and counted in it (PyTorch's default).
      for (const bool include_pad : {false, true})
        b.task(include_pad ? "avg_pool_padded" : "avg_pool", "avg_pool2d_nhwc")
            .tensor("x", d, x, ext)
            .tensor("out", d, {x[0], (x[1] + 2 - 3) / 2 + 1, (x[2] + 2 - 2) / 2 + 1, x[3]}, ext)
            .arg("kernel_h", 3)
            .arg("kernel_w", 2)
            .arg("stride_h", 2)
            .arg("stride_w", 2)
            .arg("padding_h", 1)
            .arg("padding_w", 1)
            .arg("count_include_pad", include_pad);
      b.task("global_pool", "adaptive_avg_pool2d_nhwc").tensor("x", d, x, ext).tensor("out", d, {x[0], 1, 1, x[3]}, ext);
      b.task("adaptive_pool", "adaptive_avg_pool2d_nhwc").tensor("x", d, x, ext).tensor("out", d, {x[0], 3, 2, x[3]}, ext);
    }
    if (!epilogue) continue;
    const std::string prefix = c.id == "c3x3" ? "" : c.id + "_";  // (the first one's names as they were)
    auto bias = b.task(prefix + "bias", "add").tensor("a", conv["out"]).tensor("b", d, {c.out_channels}, persistent).tensor("out", d, out);
    auto act = b.task(prefix + "act", c.id == "c3x3" ? "relu" : "relu6").tensor("x", bias["out"]).tensor("out", d, out);
    b.task(prefix + "residual", "add").tensor("a", act["out"]).tensor("b", d, out, ext).tensor("out", d, out, ext);
  }
  return std::move(b).graph();
}

struct NhwcCase {
  DType dtype;
  bool tf32, megakernel;
};

class ChannelsLast : public ::testing::TestWithParam<NhwcCase> {};

// Each convolution matches the float64 reference in the form the emitter
// picked for it: the implicit GEMM on the pipelined tensor-core mainloop
// (split-K where its tiles are few), for 16-bit operands and for f32 as TF32;
// the direct form for f32 (exact), for channels that are not whole 16-byte
// chunks, for groups, and in a megakernel.
TEST_P(ChannelsLast, ConvolutionsMatchTheFloat64ReferenceInEachForm) {
  const auto [dtype, tf32, megakernel] = GetParam();
  CompileOptions options;
  options.emit.allow_tf32 = tf32;
  options.emit.megakernel = megakernel;
  options.emit.megakernel_blocks = 8;  // (the emulator runs a persistent launch's blocks at once)
  Compiled c = compile(load_program(nhwc_graph(dtype), {}), options);
  const bool tensor_cores = dtype != DType::f32 || tf32;
  for (const NhwcConv& conv : nhwc_convs()) {
    // (Kernels, not launches: the direct forms share one.)
    const auto k = std::find_if(c.emitted.tile_kernels.begin(), c.emitted.tile_kernels.end(),
                                [&](const EmittedKernel& e) { return e.name.ends_with("_" + conv.id); });
    ASSERT_NE(k, c.emitted.tile_kernels.end()) << conv.id;
    const bool gemm = conv.form == "implicit GEMM" || conv.form == "split-K" || conv.form == "plain GEMM";
    // (f32 without TF32: no tensor cores, whatever the channels; a megakernel: no mainloop.)
    const std::string expected = megakernel      ? "a megakernel's tiles share one block size"
                                 : !tensor_cores ? "stays off tensor cores"
                                                 : conv.form;
    EXPECT_NE(k->matmul_path.find(expected), std::string::npos) << conv.id << ": " << k->matmul_path;
    EXPECT_EQ(k->matmul_path.find(" GEMM") != std::string::npos, tensor_cores && gemm && !megakernel)
        << k->matmul_path;
    // Depthwise on whole 16-byte vectors of channels takes its own form in
    // every type (but in a megakernel): 12 channels are 3 vectors of f32.
    const bool whole_vectors = conv.groups == conv.channels && conv.out_channels == conv.channels &&
                               conv.channels % (16 / dtype_bytes(dtype)) == 0;
    EXPECT_EQ(k->matmul_path.find("the depthwise form") != std::string::npos, whole_vectors && !megakernel)
        << conv.id << ": " << k->matmul_path;
    if (conv.id == "depthwise_wide" && !megakernel)  // the epilogue in the kernel, 16 bytes at a time
      EXPECT_EQ(k->tasks.size(), 4u) << k->name;
  }
  if (!megakernel)
    EXPECT_NE(c.emitted.cuda_source.find("cg_epilogue_vector(i, acc);"), std::string::npos)
        << "depthwise_wide's epilogue has a vector form";
  if (megakernel) EXPECT_EQ(c.emitted.cuda_source.find("cg_conv2d_nhwc_mainloop<"), std::string::npos);
  // The epilogue: bias, relu and residual in the convolution's kernel.
  EXPECT_EQ(c.emitted.tile_kernels.front().tasks.size(), 4u) << c.emitted.tile_kernels.front().name;
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(
      c, RunOptions{seed, work_dir(fmt::format("nhwc_{}{}{}", to_string(dtype), tf32 ? "_tf32" : "",
                                               megakernel ? "_mk" : ""))});
  EXPECT_EQ(run.checks.size(), nhwc_convs().size() + 5);  // and the five pools
  for (const auto& check : run.checks) EXPECT_TRUE(check.ok()) << format_run(run);
}

INSTANTIATE_TEST_SUITE_P(Types, ChannelsLast,
                         ::testing::Values(NhwcCase{DType::f32, false, false}, NhwcCase{DType::f32, true, false},
                                           NhwcCase{DType::f16, false, false}, NhwcCase{DType::bf16, false, false},
                                           NhwcCase{DType::bf16, false, true}),
                         [](const auto& info) {
                           return fmt::format("{}{}{}", to_string(info.param.dtype), info.param.tf32 ? "_tf32" : "",
                                              info.param.megakernel ? "_megakernel" : "");
                         });

// The depthwise form's blocks walk several tiles of pixels, staging their
// weights once, where the target's multiprocessors are few enough that the
// grid stays 4 blocks each (here 1 SM: 3 tiles of 32 pixels a block, the last
// block's partly past the output); with a bias and relu6 after it.
TEST(ChannelsLast, DepthwiseBlocksWalkSeveralTilesOnAFewMultiprocessors) {
  GraphBuilder b("depthwise_tiles");
  const Shape x{2, 14, 14, 64}, out{2, 14, 14, 64};
  auto dw = b.task("dw", "conv2d_nhwc")
                .tensor("x", DType::bf16, x, ext)
                .tensor("weight", DType::bf16, {64, 3, 3, 1}, persistent)
                .tensor("out", DType::bf16, out)
                .arg("padding_h", 1)
                .arg("padding_w", 1)
                .arg("groups", 64);
  auto bias = b.task("bias", "add").tensor("a", dw["out"]).tensor("b", DType::bf16, {64}, persistent).tensor("out", DType::bf16, out);
  b.task("act", "relu6").tensor("x", bias["out"]).tensor("out", DType::bf16, out, ext);
  CompileOptions options;
  options.emit.sms = 1;
  Compiled c = compile(load_program(std::move(b).graph(), {}), options);
  ASSERT_EQ(c.emitted.kernels.size(), 1u);
  const EmittedKernel& k = c.emitted.kernels.front();
  EXPECT_NE(k.matmul_path.find("32 pixels x 64 channels a block, 3 times"), std::string::npos) << k.matmul_path;
  EXPECT_EQ(k.grid[0], 5);  // 13 tiles of 32 pixels (392), 3 a block
  EXPECT_EQ(k.tasks.size(), 3u);
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(c, RunOptions{seed, work_dir("depthwise_tiles")});
  ASSERT_EQ(run.checks.size(), 1u);
  EXPECT_TRUE(run.ok()) << format_run(run);
}

// An epilogue without a vector form of the depthwise form's width (a cast
// of its 8-wide bf16 sums to f32: 4 wide) takes the sums an element at a
// time, in the same kernel.
TEST(ChannelsLast, DepthwiseEpilogueOfAnotherWidthTakesElements) {
  GraphBuilder b("depthwise_cast");
  const Shape x{2, 9, 7, 32};
  auto dw = b.task("dw", "conv2d_nhwc")
                .tensor("x", DType::bf16, x, ext)
                .tensor("weight", DType::bf16, {32, 3, 3, 1}, persistent)
                .tensor("out", DType::bf16, x)
                .arg("padding_h", 1)
                .arg("padding_w", 1)
                .arg("groups", 32);
  b.task("widen", "cast").tensor("x", dw["out"]).tensor("out", DType::f32, x, ext);
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  ASSERT_EQ(c.emitted.kernels.size(), 1u);
  EXPECT_NE(c.emitted.kernels.front().matmul_path.find("the depthwise form"), std::string::npos);
  EXPECT_NE(c.emitted.cuda_source.find("for (int w = 0; w < 8; ++w) cg_epilogue(i + w, acc[w]);"), std::string::npos);
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(c, RunOptions{seed, work_dir("depthwise_cast")});
  ASSERT_EQ(run.checks.size(), 1u);
  EXPECT_TRUE(run.ok()) << format_run(run);
}

// conv2d_nhwc's gradients, each its own op and kernel: the data gradient (a
// transposed convolution) and the weight gradient (over every image's
// pixels), at sizes that are not multiples of a tile, with stride, padding,
// dilation and groups, in each form: on the pipelined mainloop where both
// channel counts a group are whole 16-byte chunks (split-K where the weight
// gradient's tiles are few), else the direct form.
struct NhwcGradientCase {
  std::string id;
  int64_t batch, height, width, channels, out_channels, kernel, stride, padding, dilation, groups;
  std::string data_form, weight_form;  // what each kernel's matmul_path says on tensor cores
};

const std::vector<NhwcGradientCase>& nhwc_gradient_cases() {
  static const std::vector<NhwcGradientCase> cases = {
      // dx: 112 x 16 over 360; dweight: 40 x 144 over 112
      {"c3x3", 2, 7, 8, 16, 40, 3, 1, 1, 1, 1, "implicit GEMM (the data gradient)", "implicit GEMM (the weight gradient)"},
      // stride 2 and dilation 2: dx's one GEMM (its taps that do not divide are zeros)
      {"strided", 1, 11, 10, 8, 24, 3, 2, 2, 2, 1, "implicit GEMM", "implicit GEMM"},
      // stride 2, dilation 1: dx split by the stride, 4 classes of pixels (odd sizes: classes of
      // 5 x 5, 5 x 4, 4 x 5 and 4 x 4 pixels, 2 x 2, 2 x 1, 1 x 2 and 1 x 1 taps)
      {"stride2", 2, 9, 9, 16, 24, 3, 2, 1, 1, 1, "split by the stride into 4 dense GEMMs", "implicit GEMM"},
      // a 1 x 1 downsampling: three classes no tap reaches (their dx zeros)
      {"downsample", 2, 7, 8, 16, 32, 1, 2, 0, 1, 2, "split by the stride into 4 dense GEMMs", "implicit GEMM"},
      // stride 3 over a 2 x 2 kernel: 9 classes, the third of each axis reached by no tap
      {"stride3", 1, 8, 7, 8, 16, 2, 3, 1, 1, 1, "split by the stride into 9 dense GEMMs", "implicit GEMM"},
      // few tiles (a class a tile): dx split by the stride and over k
      {"stride2_split_k", 1, 8, 8, 16, 256, 3, 2, 1, 1, 1, "split-K", "implicit GEMM"},
      {"pointwise", 2, 5, 6, 32, 16, 1, 1, 0, 1, 1, "implicit GEMM", "implicit GEMM"},
      // dweight 32 x 144 over 1024 pixels: 3 tiles, k split 4 ways
      {"many_pixels", 4, 16, 16, 16, 32, 3, 1, 1, 1, 1, "implicit GEMM", "split-K"},
      {"grouped", 1, 6, 7, 16, 16, 3, 1, 1, 1, 2, "implicit GEMM", "implicit GEMM"},  // 8 channels a group
      {"stem", 1, 9, 9, 3, 16, 7, 2, 3, 1, 1, "3 input channels are not a multiple of",
       "3 input channels are not a multiple of"},
      {"odd_outputs", 1, 5, 5, 8, 10, 3, 1, 1, 1, 1, "10 output channels are not a multiple of",
       "10 output channels are not a multiple of"},
      {"depthwise", 2, 6, 5, 12, 12, 3, 2, 1, 1, 12, "1 input channels a group are not a multiple of",
       "1 input channels a group are not a multiple of"},
  };
  return cases;
}

// The channels-last BatchNorm in training mode and its gradient, in each
// form (batchnorm_nhwc_split): a block a chunk of channels over every pixel
// ("small"; 24 channels: a chunk's last lane idle in 16-bit types); pixels
// split over blocks, the statistics and the sums merged in order by the last
// block, then an elementwise kernel ("split": 2048 pixels, 2 splits in
// 16-bit types, 4 in f32); 5 channels, one a thread, split, with no affine
// weights or running statistics, the gradient's sums alone ("odd"). 21
// outputs in all. A megakernel takes the first form for each.
struct NhwcBatchNormCase {
  std::string id;
  Shape x;
  bool affine;
};
const std::vector<NhwcBatchNormCase>& nhwc_batchnorm_cases() {
  static const std::vector<NhwcBatchNormCase> cases = {
      {"bn_small", {2, 5, 6, 24}, true}, {"bn_split", {2, 32, 32, 16}, true}, {"bn_odd", {2, 16, 17, 5}, false}};
  return cases;
}
void add_nhwc_batchnorms(GraphBuilder& b, DType d) {
  for (const NhwcBatchNormCase& bn : nhwc_batchnorm_cases()) {
    const Shape channels{bn.x.back()};
    TaskBuilder forward = b.task(bn.id, "batchnorm2d_nhwc");
    forward.tensor("x", d, bn.x, ext);
    if (bn.affine)
      forward.tensor("weight", d, channels, persistent)
          .tensor("bias", d, channels, persistent)
          .tensor("running_mean", DType::f32, channels, persistent)
          .tensor("running_var", DType::f32, channels, persistent);
    forward.tensor("out", d, bn.x, ext)
        .tensor("mean", DType::f32, channels, ext)
        .tensor("rstd", DType::f32, channels, ext)
        .arg("momentum", 0.25);
    TaskBuilder backward = b.task(bn.id + "_backward", "batchnorm2d_nhwc_backward");
    backward.tensor("x", d, bn.x, ext);
    if (bn.affine) backward.tensor("weight", d, channels, persistent);
    backward.tensor("mean", DType::f32, channels, ext)
        .tensor("rstd", DType::f32, channels, ext)
        .tensor("dout", d, bn.x, ext);
    if (bn.affine) backward.tensor("dx", d, bn.x, ext);
    backward.tensor("dweight", d, channels, ext).tensor("dbias", d, channels, ext);
  }
}

TaskGraph nhwc_gradient_graph(DType d) {
  GraphBuilder b(fmt::format("nhwc_gradients_{}", to_string(d)));
  for (const NhwcGradientCase& c : nhwc_gradient_cases()) {
    const Shape x{c.batch, c.height, c.width, c.channels},
        weight{c.out_channels, c.kernel, c.kernel, c.channels / c.groups},
        dout{c.batch, out_size(c.height, c.kernel, c.stride, c.padding, c.dilation),
             out_size(c.width, c.kernel, c.stride, c.padding, c.dilation), c.out_channels};
    for (const char* which : {"data", "weight"}) {
      const bool data = std::string(which) == "data";
      b.task(fmt::format("{}_{}", c.id, which), fmt::format("conv2d_nhwc_backward_{}", which))
          .tensor("x", d, x, ext)
          .tensor("weight", d, weight, persistent)
          .tensor("dout", d, dout, ext)
          .tensor(data ? "dx" : "dweight", d, data ? x : weight, ext)
          .arg("stride_h", c.stride)
          .arg("stride_w", c.stride)
          .arg("padding_h", c.padding)
          .arg("padding_w", c.padding)
          .arg("dilation_h", c.dilation)
          .arg("dilation_w", c.dilation)
          .arg("groups", c.groups);
    }
  }
  // The channels-last pools' gradients: max pooling with padding and
  // ceil_mode (its last windows overhang), average pooling with padding in
  // its divisor and windows that overlap, adaptive pooling to windows that
  // overlap (9 rows to 3, 8 columns to 2).
  const Shape pooled{2, 9, 8, 16};
  b.task("max_pool_backward", "max_pool2d_nhwc_backward")
      .tensor("x", d, pooled, ext)
      .tensor("dout", d, {2, 5, 5, 16}, ext)
      .tensor("dx", d, pooled, ext)
      .arg("kernel_h", 3)
      .arg("kernel_w", 3)
      .arg("stride_h", 2)
      .arg("stride_w", 2)
      .arg("padding_h", 1)
      .arg("padding_w", 1)
      .arg("ceil_mode", true);
  b.task("avg_pool_backward", "avg_pool2d_nhwc_backward")
      .tensor("dout", d, {2, 5, 3, 16}, ext)
      .tensor("dx", d, pooled, ext)
      .arg("kernel_h", 3)
      .arg("kernel_w", 3)
      .arg("stride_h", 2)
      .arg("stride_w", 2)
      .arg("padding_h", 1)
      .arg("padding_w", 0);
  b.task("adaptive_pool_backward", "adaptive_avg_pool2d_nhwc_backward")
      .tensor("dout", d, {2, 3, 2, 16}, ext)
      .tensor("dx", d, pooled, ext);
  add_nhwc_batchnorms(b, d);
  return std::move(b).graph();
}

class ChannelsLastGradients : public ::testing::TestWithParam<NhwcCase> {};

TEST_P(ChannelsLastGradients, MatchTheFloat64ReferenceInEachForm) {
  const auto [dtype, tf32, megakernel] = GetParam();
  CompileOptions options;
  options.emit.allow_tf32 = tf32;
  options.emit.megakernel = megakernel;
  options.emit.megakernel_blocks = 8;
  Compiled c = compile(load_program(nhwc_gradient_graph(dtype), {}), options);
  const bool tensor_cores = dtype != DType::f32 || tf32;
  for (const NhwcGradientCase& conv : nhwc_gradient_cases())
    for (const auto& [which, form] : {std::pair{"data", conv.data_form}, std::pair{"weight", conv.weight_form}}) {
      const std::string name = fmt::format("_{}_{}", conv.id, which);
      const auto k = std::find_if(c.emitted.tile_kernels.begin(), c.emitted.tile_kernels.end(),
                                  [&](const EmittedKernel& e) { return e.name.ends_with(name); });
      ASSERT_NE(k, c.emitted.tile_kernels.end()) << name;
      const bool gemm = form.find("GEMM") != std::string::npos || form == "split-K";
      const std::string expected = megakernel      ? "a megakernel's tiles share one block size"
                                   : !tensor_cores ? "stays off tensor cores"
                                                   : form;
      EXPECT_NE(k->matmul_path.find(expected), std::string::npos) << name << ": " << k->matmul_path;
      const bool classes = which == std::string("data") && conv.stride > 1 && conv.dilation == 1 && gemm &&
                           tensor_cores && !megakernel;
      EXPECT_EQ(k->matmul_path.find("split by the stride") != std::string::npos, classes) << name << ": " << k->matmul_path;
      EXPECT_EQ(k->matmul_path.find("pipelined mainloop") != std::string::npos, tensor_cores && gemm && !megakernel)
          << name << ": " << k->matmul_path;
    }
  // The BatchNorms' pixels split (a statistics or sums kernel launched first) except where small, and
  // never in a megakernel; the gradient with no dx asked for is its sums kernel alone.
  std::set<std::string> launched;
  for (const EmittedKernel& k : c.emitted.kernels) launched.insert(k.name.substr(k.name.find('_') + 1));
  for (const NhwcBatchNormCase& bn : nhwc_batchnorm_cases()) {
    const bool split = bn.id != "bn_small" && !megakernel;
    EXPECT_EQ(launched.count(bn.id + "_statistics"), split ? 1u : 0u) << bn.id;
    EXPECT_EQ(launched.count(bn.id + "_backward_sums"), split && bn.affine ? 1u : 0u) << bn.id;
  }
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(
      c, RunOptions{seed, work_dir(fmt::format("nhwc_gradients_{}{}{}", to_string(dtype), tf32 ? "_tf32" : "",
                                               megakernel ? "_mk" : ""))});
  EXPECT_EQ(run.checks.size(), 2 * nhwc_gradient_cases().size() + 3 + 21);  // and the three pools, the BatchNorms
  for (const auto& check : run.checks) EXPECT_TRUE(check.ok()) << format_run(run);
}

INSTANTIATE_TEST_SUITE_P(Types, ChannelsLastGradients,
                         ::testing::Values(NhwcCase{DType::f32, false, false}, NhwcCase{DType::f32, true, false},
                                           NhwcCase{DType::f16, false, false}, NhwcCase{DType::bf16, false, false},
                                           NhwcCase{DType::bf16, false, true}),
                         [](const auto& info) {
                           return fmt::format("{}{}{}", to_string(info.param.dtype), info.param.tf32 ? "_tf32" : "",
                                              info.param.megakernel ? "_megakernel" : "");
                         });

// A channels-last network's training step derived (convolutions, a
// BatchNorm in training mode, relu, the channels-last pools): conv2d_nhwc links its two gradient ops, and the derive pass writes a task of each only where its
// gradient is needed (none of dx for the stem, whose input is the image).
// Each task of two SGD steps checked from its actual inputs, in f32 (the
// direct forms) and as TF32 (the mainloop); the loss falls.
TEST(ChannelsLastGradients, AChannelsLastNetworkTrains) {
  constexpr DType d = DType::f32;
  GraphBuilder b("nhwc_net");
  const int64_t B = 2;
  int64_t seeds = 0;
  auto weight = [&](const std::string& id, const Shape& shape, int64_t fan_in) {
    const double bound = 1.0 / std::sqrt(double(fan_in));
    return b.task(id, "uniform", Phase::init).tensor("out", d, shape).arg("low", -bound).arg("high", bound).arg("seed", ++seeds)["out"];
  };
  auto conv = [&](const std::string& id, SlotRef x, int64_t c, int64_t size, int64_t o, int64_t stride) {
    const int64_t s = out_size(size, 3, stride, 1);
    return b.task(id, "conv2d_nhwc")
        .tensor("x", x)
        .tensor("weight", weight(id + "_weight", {o, 3, 3, c}, c * 9))
        .tensor("out", d, {B, s, s, o})
        .arg("stride_h", stride)
        .arg("stride_w", stride)
        .arg("padding_h", 1)
        .arg("padding_w", 1)["out"];
  };
  auto image = b.task("image", "affine").tensor("x", d, {B, 10, 10, 8}, ext).tensor("out", d, {B, 10, 10, 8}).arg("scale", 1.0);
  SlotRef x = conv("stem", image["out"], 8, 10, 16, 1);
  x = b.task("stem_bn", "batchnorm2d_nhwc")  // training mode: the batch's statistics
          .tensor("x", x)
          .tensor("weight", weight("stem_bn_weight", {16}, 1))
          .tensor("bias", weight("stem_bn_bias", {16}, 100))
          .tensor("running_mean", d, {16}, persistent)
          .tensor("running_var", d, {16}, persistent)
          .tensor("out", d, {B, 10, 10, 16})
          .tensor("mean", d, {16})
          .tensor("rstd", d, {16})["out"];
  x = b.task("stem_act", "relu").tensor("x", x).tensor("out", d, {B, 10, 10, 16})["out"];
  x = b.task("stem_pool", "max_pool2d_nhwc")
          .tensor("x", x)
          .tensor("out", d, {B, 5, 5, 16})
          .arg("kernel_h", 3)
          .arg("kernel_w", 3)
          .arg("stride_h", 2)
          .arg("stride_w", 2)
          .arg("padding_h", 1)
          .arg("padding_w", 1)["out"];
  x = conv("down", x, 16, 5, 24, 2);
  x = b.task("down_act", "relu").tensor("x", x).tensor("out", d, {B, 3, 3, 24})["out"];
  x = b.task("smooth", "avg_pool2d_nhwc")
          .tensor("x", x)
          .tensor("out", d, {B, 3, 3, 24})
          .arg("kernel_h", 3)
          .arg("kernel_w", 3)
          .arg("stride_h", 1)
          .arg("stride_w", 1)
          .arg("padding_h", 1)
          .arg("padding_w", 1)
          .arg("count_include_pad", false)["out"];
  x = b.task("pool", "adaptive_avg_pool2d_nhwc").tensor("x", x).tensor("out", d, {B, 2, 2, 24})["out"];
  x = b.task("flat", "reshape").tensor("x", x).tensor("out", d, {B, 96})["out"];
  x = b.task("head", "matmul").tensor("a", x).tensor("b", weight("head_weight", {96, 5}, 96)).tensor("out", d, {B, 5})["out"];
  b.task("loss", "cross_entropy").tensor("logits", x).tensor("labels", DType::i32, {B}, ext).tensor("loss", d, {}, ext);
  Program forward = load_program(std::move(b).graph(), {});
  std::vector<ArgSlot> args = {ArgSlot{"lr", ArgValue(0.2), {}, false, {}}};
  const TaskGraph trained = derive_training(forward, TrainingSpec{{"loss", "loss"}, "sgd", args, {}}).graph;
  std::set<std::string> ids, ops;
  for (const auto& t : trained.tasks) ids.insert(t.id), ops.insert(t.op);
  for (const char* id : {"stem_backward_weight", "down_backward_data", "down_backward_weight"}) EXPECT_TRUE(ids.count(id)) << id;
  for (const char* op : {"max_pool2d_nhwc_backward", "avg_pool2d_nhwc_backward", "adaptive_avg_pool2d_nhwc_backward",
                         "batchnorm2d_nhwc_backward"})
    EXPECT_TRUE(ops.count(op)) << op;
  EXPECT_FALSE(ids.count("stem_backward_data")) << "the image needs no gradient";

  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const bool tf32 : {false, true}) {
    CompileOptions each;  // every buffer kept, so each task's inputs can be read back
    each.plan.placement.reuse = false;
    each.fuse.enabled = false;
    each.emit.allow_tf32 = tf32;
    Compiled c = compile(load_program(trained, {}), each);
    int pipelined = 0;
    for (const EmittedKernel& k : c.emitted.tile_kernels)
      if (k.matmul_path.find("implicit GEMM (the") != std::string::npos) ++pipelined;
    EXPECT_EQ(pipelined, tf32 ? 3 : 0);
    RunOptions run_options{seed, work_dir(tf32 ? "nhwc_net_tf32" : "nhwc_net")};
    run_options.steps = 2;
    run_options.check_each_task = true;
    CheckedRun run = run_checked(c, run_options);
    EXPECT_TRUE(run.ok()) << format_run(run);
    ASSERT_EQ(run.step_scalars.size(), 1u);
    EXPECT_LT(run.step_scalars[0].second.back(), run.step_scalars[0].second.front()) << format_run(run);
  }
}

// Output channels that do not split into the groups are an error of the
// convolution's task, as for conv2d.
TEST(ChannelsLast, OutputChannelsThatDoNotSplitIntoGroupsAreAnError) {
  GraphBuilder b("nhwc_bad_groups");
  b.task("conv", "conv2d_nhwc")
      .tensor("x", DType::bf16, {1, 6, 6, 16}, ext)
      .tensor("weight", DType::bf16, {6, 3, 3, 4}, persistent)
      .tensor("out", DType::bf16, {1, 4, 4, 6}, ext)
      .arg("groups", 4);
  const std::string error = compile_error(std::move(b).graph());
  EXPECT_NE(error.find("6 output channels do not split into 4 groups"), std::string::npos) << error;
  EXPECT_NE(error.find("task 'conv'"), std::string::npos) << error;
}

TEST(VisionOps, ShapeRuleChecksTheConvolutionsOutputSize) {
  GraphBuilder b("conv_bad_out");
  b.task("conv", "conv2d")
      .tensor("x", DType::f32, {1, 4, 10, 10}, ext)
      .tensor("weight", DType::f32, {8, 4, 3, 3}, persistent)
      .tensor("out", DType::f32, {1, 8, 10, 10}, ext)
      .arg("stride_h", 2)
      .arg("stride_w", 2);
  const std::string error = compile_error(std::move(b).graph());
  EXPECT_NE(error.find("out[2] is 10, but it must equal (H + 2*padding_h - dilation_h*(KH - 1) - 1) / stride_h + 1 = 4"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("task 'conv'"), std::string::npos) << error;
}

TEST(VisionOps, ChannelsThatDoNotSplitIntoGroupsAreAnError) {
  GraphBuilder b("conv_bad_groups");
  b.task("conv", "conv2d")
      .tensor("x", DType::f32, {1, 4, 6, 6}, ext)
      .tensor("weight", DType::f32, {6, 1, 3, 3}, persistent)
      .tensor("out", DType::f32, {1, 6, 4, 4}, ext)
      .arg("groups", 4);
  const std::string error = compile_error(std::move(b).graph());
  EXPECT_NE(error.find("6 output channels do not split into 4 groups"), std::string::npos) << error;
}

TEST(VisionOps, PermuteChecksItsAxes) {
  for (auto [dims, out, message] :
       {std::tuple{std::vector<int64_t>{0, 0, 1}, Shape{3, 2, 4}, "dims [0, 0, 1] is not a permutation of x's 3 axes"},
        std::tuple{std::vector<int64_t>{2, 0, 1}, Shape{4, 3, 2},
                   "out is [4, 3, 2], but x [2, 3, 4] permuted by [2, 0, 1] is [4, 2, 3]"}}) {
    GraphBuilder b("permute_bad");
    b.task("p", "permute").tensor("x", DType::f32, {2, 3, 4}, ext).tensor("out", DType::f32, out, ext).arg("dims", ArgValue(dims));
    const std::string error = compile_error(std::move(b).graph());
    EXPECT_NE(error.find(message), std::string::npos) << error;
  }
}

}  // namespace
