// Running phases one at a time and training for several steps in the host
// emulation (issue #7 item 2): each step checked against the float64
// reference run from the state it started from, the loss tracked per step.
#include <unistd.h>

#include <filesystem>
#include <random>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "builder.h"
#include "derive.h"
#include "host_tensor.h"
#include "npy.h"
#include "pipeline.h"
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
  return cudagen::testing::work_dir("training_run", name);
}

// A two-layer classifier with its SGD training step derived.
Program classifier() {
  GraphBuilder b("classifier");
  auto w1 = b.task("w1", "uniform", Phase::init).tensor("out", f32, {6, 16}).arg("low", -0.4).arg("high", 0.4).arg("seed", 5);
  auto w2 = b.task("w2", "uniform", Phase::init).tensor("out", f32, {16, 3}).arg("low", -0.4).arg("high", 0.4).arg("seed", 6);
  auto fc1 = b.task("fc1", "matmul").tensor("a", f32, {20, 6}, ext).tensor("b", w1["out"]).tensor("out", f32, {20, 16});
  auto act = b.task("act", "silu").tensor("x", fc1["out"]).tensor("out", f32, {20, 16});
  auto fc2 = b.task("fc2", "matmul").tensor("a", act["out"]).tensor("b", w2["out"]).tensor("out", f32, {20, 3});
  b.task("loss", "cross_entropy").tensor("logits", fc2["out"]).tensor("labels", DType::i32, {20}, ext).tensor("loss", f32, {}, ext);
  Program forward = load_program(std::move(b).graph(), {});
  std::vector<ArgSlot> args = {ArgSlot{"lr", ArgValue(0.2), {}, false, {}}, ArgSlot{"momentum", ArgValue(0.5), {}, false, {}}};
  return load_program(derive_training(forward, TrainingSpec{{"loss", "loss"}, "sgd", args, {}}).graph, {});
}

// The classifier with dropout (p) after its activation, as the torch
// frontend writes it: a mask drawn per step and micro-batch, times the input.
Program classifier_with_dropout(double p) {
  GraphBuilder b("classifier_dropout");
  auto w1 = b.task("w1", "uniform", Phase::init).tensor("out", f32, {6, 16}).arg("low", -0.4).arg("high", 0.4).arg("seed", 5);
  auto w2 = b.task("w2", "uniform", Phase::init).tensor("out", f32, {16, 3}).arg("low", -0.4).arg("high", 0.4).arg("seed", 6);
  auto fc1 = b.task("fc1", "matmul").tensor("a", f32, {20, 6}, ext).tensor("b", w1["out"]).tensor("out", f32, {20, 16});
  auto act = b.task("act", "silu").tensor("x", fc1["out"]).tensor("out", f32, {20, 16});
  auto mask = b.task("drop_mask", "dropout_mask").tensor("out", f32, {20, 16}).arg("p", p).arg("seed", 11)
                  .runtime_arg("step", ArgValue(int64_t(1))).runtime_arg("micro_batch", ArgValue(int64_t(0)));
  auto drop = b.task("drop", "mul").tensor("a", act["out"]).tensor("b", mask["out"]).tensor("out", f32, {20, 16});
  auto fc2 = b.task("fc2", "matmul").tensor("a", drop["out"]).tensor("b", w2["out"]).tensor("out", f32, {20, 3});
  b.task("loss", "cross_entropy").tensor("logits", fc2["out"]).tensor("labels", DType::i32, {20}, ext).tensor("loss", f32, {}, ext);
  Program forward = load_program(std::move(b).graph(), {});
  std::vector<ArgSlot> args = {ArgSlot{"lr", ArgValue(0.2), {}, false, {}}};
  return load_program(derive_training(forward, TrainingSpec{{"loss", "loss"}, "sgd", args, {}}).graph, {});
}

// dropout_mask alone, its mask an output: 64 x 64 elements.
Compiled dropout_mask_alone(DType d, double p) {
  GraphBuilder b("dropout_mask");
  b.task("m", "dropout_mask").tensor("out", d, {64, 64}, ext).arg("p", p).arg("seed", 3)
      .runtime_arg("step", ArgValue(int64_t(1))).runtime_arg("micro_batch", ArgValue(int64_t(0)));
  return compile(load_program(std::move(b).graph(), {}), {});
}

}  // namespace

TEST(TrainingRun, EveryStepIsCheckedAndTheLossIsTracked) {
  CompileOptions options;
  options.emit.step_function = true;
  Compiled c = compile(classifier(), options);
  EXPECT_NE(c.emitted.cuda_source.find("extern \"C\" int cudagen_step(unsigned char* arena, cudaStream_t stream) {"),
            std::string::npos);
  EXPECT_NE(c.emitted.manifest_json.find("\"phase\": \"step\", \"function\": \"cudagen_step\""), std::string::npos);
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  RunOptions run_options{seed, work_dir("steps")};
  run_options.steps = 6;
  run_options.outputs_dir = work_dir("steps_out");
  CheckedRun run = run_checked(c, run_options);
  EXPECT_TRUE(run.ok()) << format_run(run);
  ASSERT_EQ(run.step_scalars.size(), 1u);
  EXPECT_EQ(run.step_scalars[0].first, "loss.loss");
  const std::vector<double>& loss = run.step_scalars[0].second;
  ASSERT_EQ(loss.size(), 6u);
  // Small steps of gradient descent on a fixed batch: the loss falls.
  EXPECT_LT(loss.back(), loss.front()) << format_run(run);
  HostTensor per_step = read_npy(run_options.outputs_dir + "/loss.loss.per_step.npy");
  EXPECT_EQ(per_step.shape, Shape{6});
  HostTensor weight = read_npy(run_options.outputs_dir + "/w2.out.npy");  // the trained weights are written too
  EXPECT_EQ(weight.shape, (Shape{16, 3}));
  std::filesystem::remove_all(run_options.outputs_dir);
}

TEST(TrainingRun, EachTaskOfEveryStepIsCheckedFromItsActualInputs) {
  CompileOptions options;  // every buffer kept, so each task's inputs can be read back
  options.plan.placement.reuse = false;
  options.fuse.enabled = false;
  Compiled c = compile(classifier(), options);
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  RunOptions run_options{seed, work_dir("each")};
  run_options.steps = 2;
  run_options.check_each_task = true;
  CheckedRun run = run_checked(c, run_options);
  EXPECT_TRUE(run.ok()) << format_run(run);
  // Backward kernels and the in-place update too, not only the outputs.
  int checked = 0;
  for (const auto& check : run.checks)
    for (const char* name : {"task fc1_grad_b.out", "task act_backward.dx", "task w1_sgd.param", "task w1_sgd.momentum_buf"})
      if (check.buffer == name) {
        ++checked;
        EXPECT_FALSE(check.loose()) << name << ": a per-task bound must be tight\n" << format_run(run);
      }
  EXPECT_EQ(checked, 4) << format_run(run);
  RunOptions reused{seed, work_dir("each")};
  reused.check_each_task = true;
  EXPECT_THROW(run_checked(compile(classifier(), {}), reused), std::runtime_error);
}

TEST(TrainingRun, OnePhaseTakesWhatOtherPhasesWouldWriteAsInputs) {
  Compiled c = compile(classifier(), {});
  RunOptions options{7, work_dir("phases")};
  options.phases = {Phase::forward};
  CheckedRun run = run_checked(c, options);
  EXPECT_TRUE(run.ok()) << format_run(run);
  // Forward only: the loss and nothing the update writes.
  bool loss_checked = false;
  for (const auto& check : run.checks) {
    loss_checked = loss_checked || check.buffer == "loss.loss";
    EXPECT_NE(check.buffer, "w1.out") << "the update phase did not run";
  }
  EXPECT_TRUE(loss_checked) << format_run(run);
}

TEST(TrainingRun, BadRunOptionsSayWhatToDo) {
  Compiled c = compile(classifier(), {});
  RunOptions both{1, work_dir("bad")};
  both.steps = 2;
  both.phases = {Phase::forward};
  EXPECT_THROW(
      {
        try {
          run_checked(c, both);
        } catch (const std::runtime_error& e) {
          EXPECT_NE(std::string(e.what()).find("give --steps or --phases, not both"), std::string::npos) << e.what();
          throw;
        }
      },
      std::runtime_error);

  GraphBuilder b("no_update");
  b.task("r", "relu").tensor("x", f32, {4}, ext).tensor("out", f32, {4}, ext);
  Compiled forward_only = compile(load_program(std::move(b).graph(), {}), {});
  RunOptions steps{1, work_dir("bad")};
  steps.steps = 3;
  try {
    run_checked(forward_only, steps);
    FAIL() << "expected an error: nothing to train";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("has no update phase"), std::string::npos) << e.what();
  }
  RunOptions phase{1, work_dir("bad")};
  phase.phases = {Phase::backward};
  try {
    run_checked(forward_only, phase);
    FAIL() << "expected an error: no backward phase";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("this graph has no backward phase"), std::string::npos) << e.what();
  }
}

TEST(TrainingRun, DropoutDrawsANewMaskEachStepAndMicroBatch) {
  const double p = 0.25;
  for (DType d : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(to_string(d));
    const Compiled c = dropout_mask_alone(d, p);
    auto draw = [&](int64_t step, int64_t micro_batch) {
      RunOptions options{1, work_dir("mask")};
      options.outputs_dir = work_dir(fmt::format("mask_{}_{}", step, micro_batch));
      options.args = {{"m.step", ArgValue(step)}, {"m.micro_batch", ArgValue(micro_batch)}};
      CheckedRun run = run_checked(c, options);
      EXPECT_TRUE(run.ok()) << format_run(run);
      return read_npy(options.outputs_dir + "/m.out.npy").values();
    };
    const std::vector<double> first = draw(1, 0), again = draw(1, 0), second = draw(2, 0), other = draw(1, 1);
    EXPECT_EQ(first, again) << "the same step draws the same mask";
    // Every element 0 or the scale (1 / 0.75, rounded to the dtype); about
    // p of them 0: 4096 draws put the fraction within 0.03 of p (4.4 sigma).
    const double scale = HostTensor::from_values(d, {1}, {double(1.0f / (1.0f - float(p)))}).values()[0];
    for (const auto* mask : {&first, &second, &other}) {
      size_t dropped = 0;
      for (double v : *mask) {
        dropped += v == 0.0;
        if (v != 0.0) ASSERT_EQ(v, scale);
      }
      EXPECT_NEAR(double(dropped) / double(mask->size()), p, 0.03);
    }
    // Another step, or another micro-batch, draws independently: about
    // 2 p (1 - p) = 0.375 of the elements differ.
    for (const auto* mask : {&second, &other}) {
      size_t differ = 0;
      for (size_t i = 0; i < first.size(); ++i) differ += (*mask)[i] != first[i];
      EXPECT_NEAR(double(differ) / double(first.size()), 2 * p * (1 - p), 0.04);
    }
  }
}

TEST(TrainingRun, DropoutTrainsWithItsMaskInBackward) {
  // Each step's forward and backward (the product's gradient reads the
  // saved mask) and update against the float64 reference, which draws the
  // step's mask itself: a backward reading another mask than the forward's
  // would not match it.
  Compiled c = compile(classifier_with_dropout(0.3), {});
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  RunOptions options{seed, work_dir("dropout")};
  options.steps = 3;
  CheckedRun run = run_checked(c, options);
  EXPECT_TRUE(run.ok()) << format_run(run);
  // One launch draws the mask and applies it (no kernel of its own).
  bool fused = false;
  for (const auto& k : c.kernels)
    if (k.tasks.size() >= 2 && c.program.tasks[size_t(k.tasks[0])].op->name == "dropout_mask") fused = true;
  EXPECT_TRUE(fused) << fusion_table(c);
}
