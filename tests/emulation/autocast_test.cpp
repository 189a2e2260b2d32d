// The precision policy (generator/autocast.h, issue #41): a training graph
// written in f32 with "precision": "bf16" computes its matmuls in bf16 and its
// norms and loss in f32, keeps f32 master weights with f32 gradients, and
// trains in emulation with every task checked against the float64 reference.
#include <algorithm>

#include <gtest/gtest.h>

#include "builder.h"
#include "diagnostics.h"
#include "graph_json.h"
#include "pipeline.h"
#include "runner.h"
#include "test_backend.h"

using namespace cudagen;
using cudagen::testing::run_checked;
using cudagen::testing::test_seed;

namespace {

constexpr DType f32 = DType::f32;
constexpr DType bf16 = DType::bf16;
constexpr Storage ext = Storage::external;

// A pre-norm decoder block in f32, as a PyTorch model is written before
// autocast: rmsnorm, q/k/v projections, causal attention over two heads, the
// output projection and a residual add, then rmsnorm, an MLP with gelu and a
// second residual add; the loss an mse against a target.
TaskGraph decoder_block(DType precision, DType f32 = DType::f32) {
  GraphBuilder b("autocast_block");
  const int64_t B = 2, T = 8, D = 32, H = 2, F = 64;
  auto init = [&](const char* id, Shape shape, int seed) {
    return b.task(id, "uniform", Phase::init).tensor("out", f32, shape).arg("low", -0.3).arg("high", 0.3).arg("seed", seed);
  };
  auto ln1_w = b.task("ln1_w", "fill", Phase::init).tensor("out", f32, {D}).arg("value", 1.0);
  auto ln2_w = b.task("ln2_w", "fill", Phase::init).tensor("out", f32, {D}).arg("value", 1.0);
  auto wq = init("wq", {D, D}, 1), wk = init("wk", {D, D}, 2), wv = init("wv", {D, D}, 3), wo = init("wo", {D, D}, 4);
  auto w_up = init("w_up", {D, F}, 5), w_down = init("w_down", {F, D}, 6);
  auto ln1 = b.task("ln1", "rmsnorm")
                 .tensor("x", f32, {B, T, D}, ext)
                 .tensor("weight", ln1_w["out"])
                 .tensor("out", f32, {B, T, D})
                 .tensor("rstd", DType::f32, {B, T});
  auto project = [&](const char* id, const char* heads_id, const TaskBuilder& w) {
    auto p = b.task(id, "matmul").tensor("a", ln1["out"]).tensor("b", w["out"]).tensor("out", f32, {B, T, D});
    return b.task(heads_id, "split_heads").tensor("x", p["out"]).tensor("out", f32, {B, H, T, D / H}).arg("heads", H);
  };
  auto q = project("q", "q_heads", wq), k = project("k", "k_heads", wk), v = project("v", "v_heads", wv);
  auto scores = b.task("scores", "matmul")
                    .tensor("a", q["out"])
                    .tensor("b", k["out"])
                    .tensor("out", f32, {B, H, T, T})
                    .arg("trans_b", true)
                    .arg("alpha", 0.25);
  auto probs = b.task("probs", "softmax").tensor("x", scores["out"]).tensor("out", f32, {B, H, T, T}).arg("causal", true);
  auto context = b.task("context", "matmul").tensor("a", probs["out"]).tensor("b", v["out"]).tensor("out", f32, {B, H, T, D / H});
  auto merged = b.task("merged", "merge_heads").tensor("x", context["out"]).tensor("out", f32, {B, T, D}).arg("heads", H);
  auto o = b.task("o", "matmul").tensor("a", merged["out"]).tensor("b", wo["out"]).tensor("out", f32, {B, T, D});
  auto res1 = b.task("res1", "add").tensor("a", ln1["x"]).tensor("b", o["out"]).tensor("out", f32, {B, T, D});
  auto ln2 = b.task("ln2", "rmsnorm")
                 .tensor("x", res1["out"])
                 .tensor("weight", ln2_w["out"])
                 .tensor("out", f32, {B, T, D})
                 .tensor("rstd", DType::f32, {B, T});
  auto up = b.task("up", "matmul").tensor("a", ln2["out"]).tensor("b", w_up["out"]).tensor("out", f32, {B, T, F});
  auto act = b.task("act", "gelu").tensor("x", up["out"]).tensor("out", f32, {B, T, F}).arg("approximate", "tanh");
  auto down = b.task("down", "matmul").tensor("a", act["out"]).tensor("b", w_down["out"]).tensor("out", f32, {B, T, D});
  auto res2 = b.task("res2", "add").tensor("a", res1["out"]).tensor("b", down["out"]).tensor("out", f32, {B, T, D});
  b.task("loss", "mse").tensor("pred", res2["out"]).tensor("target", f32, {B, T, D}, ext).tensor("loss", DType::f32, {}, ext);
  b.training(TrainingSpec{{"loss", "loss"}, "adamw", {ArgSlot{"lr", ArgValue(0.01), {}, false, {}}}, precision, {}});
  return std::move(b).graph();
}

const BufferInfo& buffer(const Program& p, const std::string& name) {
  for (size_t b = 0; b < p.buffers.size(); ++b)
    if (buffer_name(p, int(b)) == name) return p.buffers[b];
  throw std::logic_error("no buffer " + name);
}

const BoundTask& task(const Program& p, const std::string& id) {
  for (const auto& t : p.tasks)
    if (t.task->id == id) return t;
  throw std::logic_error("no task " + id);
}

std::string errors_of(TaskGraph graph) {
  try {
    load_program(std::move(graph), {});
    return "";
  } catch (const CompileError& e) {
    return e.diagnostics().format();
  }
}

}  // namespace

TEST(Autocast, ProductsComputeInBf16NormsAndLossInF32WeightsStayF32) {
  Program p = load_program(decoder_block(bf16), {});
  for (const char* product : {"q.out", "k.out", "v.out", "scores.out", "context.out", "o.out", "up.out", "down.out"})
    EXPECT_EQ(buffer(p, product).dtype, bf16) << product;
  // softmax and gelu follow their input; heads are moved in their value's dtype.
  for (const char* follower : {"probs.out", "act.out", "q_heads.out", "merged.out"})
    EXPECT_EQ(buffer(p, follower).dtype, bf16) << follower;
  // Norms and the loss in f32; a residual add of f32 and bf16 is f32.
  for (const char* wide : {"ln1.out", "ln2.out", "res1.out", "res2.out", "loss.loss", "ln1.x", "loss.target"})
    EXPECT_EQ(buffer(p, wide).dtype, f32) << wide;
  // One cast a value and dtype: each weight a matmul reads, each norm's output
  // (ln1's shared by q, k and v), and each product a residual add reads.
  std::vector<std::string> casts;
  for (const auto& t : p.tasks)
    if (t.task->op == "cast") casts.push_back(t.task->id);
  std::sort(casts.begin(), casts.end());
  EXPECT_EQ(casts, (std::vector<std::string>{"down_to_f32", "ln1_to_bf16", "ln2_to_bf16", "o_to_f32", "w_down_to_bf16",
                                             "w_up_to_bf16", "wk_to_bf16", "wo_to_bf16", "wq_to_bf16", "wv_to_bf16"}));
  // The optimizer updates f32 master weights with f32 gradients (the norms' too,
  // which a bf16 graph could not train: rmsnorm's weight gradient is f32).
  int updates = 0;
  for (const auto& t : p.tasks) {
    if (t.task->op != "adamw") continue;
    ++updates;
    EXPECT_EQ(p.buffers[size_t(t.find_tensor("param")->buffer)].dtype, f32) << t.task->id;
    EXPECT_EQ(p.buffers[size_t(t.find_tensor("grad")->buffer)].dtype, f32) << t.task->id;
  }
  EXPECT_EQ(updates, 8);
  // A weight's gradient is its bf16 product's, cast back to f32.
  EXPECT_EQ(task(p, "wq_to_bf16_backward").op->name, "cast_backward");
}

TEST(Autocast, AnInputAMatmulReadsMovesToItsCastUnderTheSameName) {
  GraphBuilder b("autocast_mlp");
  auto w = b.task("w", "uniform", Phase::init).tensor("out", f32, {16, 8}).arg("low", -0.3).arg("high", 0.3).arg("seed", 7);
  auto fc = b.task("fc", "matmul").tensor("a", f32, {4, 16}, ext).tensor("b", w["out"]).tensor("out", f32, {4, 8});
  auto act = b.task("act", "relu").tensor("x", fc["out"]).tensor("out", f32, {4, 8});
  auto w2 = b.task("w2", "uniform", Phase::init).tensor("out", f32, {8, 16}).arg("low", -0.3).arg("high", 0.3).arg("seed", 8);
  auto fc2 = b.task("fc2", "matmul").tensor("a", act["out"]).tensor("b", w2["out"]).tensor("out", f32, {4, 16});
  // A skip connection that reads the input as fc.a: in f32, the widest of its operands.
  auto both = b.task("both", "add").tensor("a", fc2["out"]).tensor("b", fc["a"]).tensor("out", f32, {4, 16});
  b.task("loss", "mse").tensor("pred", both["out"]).tensor("target", f32, {4, 16}, ext).tensor("loss", f32, {}, ext);
  b.training(TrainingSpec{{"loss", "loss"}, "sgd", {ArgSlot{"lr", ArgValue(0.1), {}, false, {}}}, bf16, {}});
  Program p = load_program(std::move(b).graph(), {});
  // The caller still binds "fc.a", in f32; the cast that now declares it
  // feeds fc in bf16, and the skip connection still reads the f32 input itself.
  const BufferInfo& input = buffer(p, "fc.a");
  EXPECT_EQ(input.dtype, f32);
  EXPECT_EQ(input.storage, ext);
  EXPECT_EQ(p.tasks[size_t(input.owner_task)].task->id, "fc_a_to_bf16");
  EXPECT_EQ(task(p, "both").find_tensor("b")->buffer, task(p, "fc_a_to_bf16").find_tensor("x")->buffer);
  EXPECT_EQ(p.buffers[size_t(task(p, "fc").find_tensor("a")->buffer)].dtype, bf16);
  EXPECT_EQ(buffer(p, "both.out").dtype, f32);
  Compiled c = compile(std::move(p), {});
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(c, RunOptions{seed, cudagen::testing::work_dir("autocast", "input")});
  EXPECT_TRUE(run.ok()) << format_run(run);
}

TEST(Autocast, AnInputReadThroughTwoSlotsMovesToOneCast) {
  // gram = x @ x^T, its `a` reading the tensor its `b` declares: one cast
  // declares the input and feeds both operands in bf16.
  GraphBuilder b("autocast_gram");
  auto w = b.task("w", "uniform", Phase::init).tensor("out", f32, {6, 8}).arg("low", -0.3).arg("high", 0.3).arg("seed", 7);
  auto gram = b.task("gram", "matmul").tensor("b", f32, {6, 16}, ext);
  gram.tensor("a", gram["b"]).tensor("out", f32, {6, 6}).arg("trans_b", true);
  auto fc = b.task("fc", "matmul").tensor("a", gram["out"]).tensor("b", w["out"]).tensor("out", f32, {6, 8});
  b.task("loss", "mse").tensor("pred", fc["out"]).tensor("target", f32, {6, 8}, ext).tensor("loss", f32, {}, ext);
  b.training(TrainingSpec{{"loss", "loss"}, "sgd", {ArgSlot{"lr", ArgValue(0.1), {}, false, {}}}, bf16, {}});
  Program p = load_program(std::move(b).graph(), {});
  const BufferInfo& input = buffer(p, "gram.b");
  EXPECT_EQ(p.tasks[size_t(input.owner_task)].task->id, "gram_b_to_bf16");
  EXPECT_EQ(task(p, "gram").find_tensor("a")->buffer, task(p, "gram").find_tensor("b")->buffer);
  EXPECT_EQ(p.buffers[size_t(task(p, "gram").find_tensor("a")->buffer)].dtype, bf16);
  Compiled c = compile(std::move(p), {});
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(c, RunOptions{seed, cudagen::testing::work_dir("autocast", "gram")});
  EXPECT_TRUE(run.ok()) << format_run(run);
}

TEST(Autocast, WhatThePolicyCannotServeIsAnErrorThatSaysWhy) {
  // A graph written in bf16, weights included: there is no f32 master copy to keep.
  const std::string weight_error = errors_of(decoder_block(bf16, bf16));
  EXPECT_NE(weight_error.find("weight 'ln1_w.out' is bf16, but under \"precision\" the weights are the optimizer's f32 "
                              "master weights"),
            std::string::npos)
      << weight_error;
  EXPECT_NE(weight_error.find("declare it f32"), std::string::npos) << weight_error;

  try {
    read_graph(R"({"format": "cudagen.taskgraph/1", "tasks": [], "training": {"loss": "a.b", "precision": "fp8"}})", "t.json");
    ADD_FAILURE() << "an unknown precision was read";
  } catch (const CompileError& e) {
    EXPECT_NE(e.diagnostics().format().find("/training/precision: unknown precision \"fp8\""), std::string::npos)
        << e.diagnostics().format();
  }
}

// f16 needs loss scaling (its range loses small gradients): without a
// "loss_scale" the derive pass scales dynamically with GradScaler's defaults.
// Two steps at a scale of 1024 (the scaled gradients well inside f16's range,
// where the float64 reference, which has no f16 overflow, agrees), each output
// checked: the weights, the f32 state, the scale grown after each good step.
TEST(Autocast, AnF16TrainingStepScalesItsLossAndRunsInEmulation) {
  const Program defaults = load_program(decoder_block(DType::f16), {});
  const BoundTask& scale = task(defaults, "loss_scale");
  ASSERT_EQ(scale.op->name, "fill");
  ASSERT_EQ(scale.args.size(), 1u);
  EXPECT_EQ(std::get<double>(scale.args[0].value), 65536.0);
  EXPECT_EQ(task(defaults, "loss_scale_update").op->name, "loss_scale_update");
  EXPECT_EQ(buffer(defaults, "q.out").dtype, DType::f16);
  EXPECT_EQ(buffer(defaults, "wq.out").dtype, f32);

  TaskGraph graph = decoder_block(DType::f16);
  graph.training->loss_scale = LossScaling{1024.0, 2.0, 0.5, 1};
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  RunOptions options{seed, cudagen::testing::work_dir("autocast", "f16_step")};
  options.steps = 2;
  CheckedRun run = run_checked(compile(load_program(graph, {}), {}), options);
  EXPECT_TRUE(run.ok()) << format_run(run);
  int checked = 0;
  for (const auto& check : run.checks)
    checked += check.buffer == "wq.out" || check.buffer == "loss_scale.out" || check.buffer == "optimizer_steps.out";
  EXPECT_EQ(checked, 3) << format_run(run);
}

TEST(Autocast, ABf16TrainingStepRunsInEmulationEachTaskChecked) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // Fused, as compiled by default: two steps, the trained weights checked.
  Compiled fused = compile(load_program(decoder_block(bf16), {}), {});
  RunOptions options{seed, cudagen::testing::work_dir("autocast", "step")};
  options.steps = 2;
  CheckedRun run = run_checked(fused, options);
  EXPECT_TRUE(run.ok()) << format_run(run);
  int weights_checked = 0;
  for (const auto& check : run.checks) weights_checked += check.buffer == "wq.out" || check.buffer == "ln1_w.out";
  EXPECT_GE(weights_checked, 2) << format_run(run);
  // One kernel a task, every buffer kept: each task of both steps (the casts, the
  // bf16 products, their gradients, the f32 updates) checked from its actual inputs.
  CompileOptions unfused;
  unfused.fuse.enabled = false;
  unfused.plan.placement.reuse = false;
  Compiled each = compile(load_program(decoder_block(bf16), {}), unfused);
  options.work_dir = cudagen::testing::work_dir("autocast", "each_task");
  options.check_each_task = true;
  CheckedRun checked = run_checked(each, options);
  EXPECT_TRUE(checked.ok()) << format_run(checked);
  int tasks_checked = 0;
  for (const auto& check : checked.checks)
    for (const char* name : {"task wq_to_bf16.out", "task q.out", "task o_to_f32.out", "task wq_to_bf16_backward.dx",
                             "task wq_adamw.param"})
      if (check.buffer == name) {
        ++tasks_checked;
        EXPECT_FALSE(check.loose()) << name << ": a per-task bound must be tight\n" << format_run(checked);
      }
  EXPECT_EQ(tasks_checked, 5) << format_run(checked);
}
