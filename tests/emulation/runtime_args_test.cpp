// Run-time arguments (docs/architecture.md §2): scalars in the arena that kernels read,
// so that a learning rate or Adam's step changes between calls with no
// recompilation. Checked in the host emulation: one module, several values.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>

#include <gtest/gtest.h>

#include "builder.h"
#include "derive.h"
#include "diagnostics.h"
#include "host_module.h"
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
  return cudagen::testing::work_dir("runtime_args", name);
}

// y1 = scale * x + 0.25 with a run-time scale; y2 = scale * y1 - 1 with the
// scale following y1's: one scalar, read by two kernels.
Compiled two_affines() {
  GraphBuilder b("affines");
  auto a1 = b.task("a1", "affine").tensor("x", f32, {37}, ext).tensor("out", f32, {37}, ext);
  a1.runtime_arg("scale", ArgValue(2.0)).arg("shift", 0.25);
  b.task("a2", "affine").tensor("x", a1["out"]).tensor("out", f32, {37}, ext).arg("scale", a1["scale"]).arg("shift", -1.0);
  return compile(load_program(std::move(b).graph(), {}), {});
}

}  // namespace

TEST(RunTimeArgs, OneScalarForAnArgumentAndThoseThatFollowIt) {
  Compiled c = two_affines();
  ASSERT_EQ(c.plan.scalars.size(), 1u);
  const PlannedScalar& s = c.plan.scalars[0];
  EXPECT_EQ(s.name(c.program), "a1.scale");
  EXPECT_EQ(c.plan.scalar_of(c.program, 1, "scale"), &s);  // a2 follows a1
  EXPECT_EQ(c.plan.scalar_of(c.program, 1, "shift"), nullptr);
  // After every buffer, inside the arena.
  for (const auto& pb : c.plan.buffers) EXPECT_LE(pb.offset + pb.bytes, s.offset);
  EXPECT_LE(s.offset + kScalarBytes, c.plan.arena_bytes);
  // The kernels read it through a pointer; the constant shift stays a literal.
  EXPECT_NE(c.emitted.cuda_source.find("const float* __restrict__ scale_arg"), std::string::npos);
  EXPECT_NE(c.emitted.cuda_source.find("const float scale = cg_load(scale_arg, 0);"), std::string::npos);
  EXPECT_NE(c.emitted.cuda_source.find("-1.0f"), std::string::npos);
  EXPECT_NE(c.emitted.manifest_json.find("\"name\": \"a1.scale\", \"type\": \"float\""), std::string::npos)
      << c.emitted.manifest_json;
}

TEST(RunTimeArgs, ChangeBetweenCallsWithoutRecompiling) {
  Compiled c = two_affines();
  HostModule module = HostModule::build(c.emitted.cuda_source, work_dir("calls"));
  std::vector<unsigned char> arena(size_t(c.plan.arena_bytes), 0xFF);
  const auto x_at = c.plan.lookup(c.program, "a1", "x").offset;
  const auto y1_at = c.plan.lookup(c.program, "a1", "out").offset;
  const auto y2_at = c.plan.lookup(c.program, "a2", "out").offset;
  std::vector<float> x(37);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(i) * 0.125f - 2.0f;
  std::memcpy(arena.data() + x_at, x.data(), x.size() * 4);
  for (double scale : {2.0, -0.5, 3.0}) {
    SCOPED_TRACE("scale " + std::to_string(scale));
    write_scalars(c, {{"a1.scale", ArgValue(scale)}}, arena.data());
    module.run_phase(Phase::forward, arena.data());
    std::vector<float> y1(37), y2(37);
    std::memcpy(y1.data(), arena.data() + y1_at, 37 * 4);
    std::memcpy(y2.data(), arena.data() + y2_at, 37 * 4);
    for (size_t i = 0; i < x.size(); ++i) {
      const double want1 = scale * x[i] + 0.25, want2 = scale * want1 - 1.0;
      EXPECT_NEAR(y1[i], want1, 1e-5 * (std::abs(scale * x[i]) + 0.25)) << i;
      EXPECT_NEAR(y2[i], want2, 1e-5 * (std::abs(scale * want1) + 1.0) * 2) << i;
    }
  }
}

TEST(RunTimeArgs, ADerivedAdamStepReadsItsStepAndLearningRate) {
  GraphBuilder b("adam");
  auto w1 = b.task("w1", "uniform", Phase::init).tensor("out", f32, {12, 16}).arg("low", -0.3).arg("high", 0.3).arg("seed", 3);
  auto w2 = b.task("w2", "uniform", Phase::init).tensor("out", f32, {16, 5}).arg("low", -0.3).arg("high", 0.3).arg("seed", 4);
  auto fc1 = b.task("fc1", "matmul").tensor("a", f32, {6, 12}, ext).tensor("b", w1["out"]).tensor("out", f32, {6, 16});
  auto act = b.task("act", "tanh").tensor("x", fc1["out"]).tensor("out", f32, {6, 16});
  auto fc2 = b.task("fc2", "matmul").tensor("a", act["out"]).tensor("b", w2["out"]).tensor("out", f32, {6, 5}, ext);
  b.task("loss", "cross_entropy").tensor("logits", fc2["out"]).tensor("labels", DType::i32, {6}, ext).tensor("loss", f32, {}, ext);
  Program forward = load_program(std::move(b).graph(), {});
  std::vector<ArgSlot> args = {ArgSlot{"lr", ArgValue(0.01), {}, true, {}}};
  DerivedGraph derived = derive_training(forward, TrainingSpec{{"loss", "loss"}, "adam", args, {}});
  Compiled c = compile(load_program(derived.graph, {}), {});
  // One lr and one step for both weights, held by the first update task.
  ASSERT_EQ(c.plan.scalars.size(), 2u);
  EXPECT_NE(c.plan.find_scalar(c.program, "w1_adam.lr"), nullptr);
  EXPECT_NE(c.plan.find_scalar(c.program, "w1_adam.step"), nullptr);

  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // Step 7's bias correction differs from step 1's: the reference computes
  // with these values, so a kernel that ignored them would fail the check.
  RunOptions options{seed, work_dir("adam")};
  options.args = {{"w1_adam.step", ArgValue(int64_t(7))}, {"w1_adam.lr", ArgValue(0.05)}};
  CheckedRun run = run_checked(c, options);
  EXPECT_TRUE(run.ok()) << format_run(run);
  int updated = 0;
  for (const auto& check : run.checks) updated += check.buffer == "w1.out" || check.buffer == "w2.out";
  EXPECT_EQ(updated, 2) << format_run(run);
}

TEST(RunTimeArgs, BadValuesAndKernelShapingArgumentsAreClearErrors) {
  Compiled c = two_affines();
  std::vector<unsigned char> arena(size_t(c.plan.arena_bytes));
  try {
    write_scalars(c, {{"a2.scale", ArgValue(1.0)}}, arena.data());
    FAIL() << "expected an error for an argument that follows another";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no run-time argument 'a2.scale'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("it has: a1.scale"), std::string::npos) << e.what();
  }
  try {
    write_scalars(c, {{"a1.scale", ArgValue(true)}}, arena.data());
    FAIL() << "expected an error for a bool given to a float";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("'a1.scale' is float"), std::string::npos) << e.what();
  }

  // The causal mask changes the kernel's loops, not a value in them (a
  // shape-deciding flag such as matmul's trans_a fails validation already).
  GraphBuilder b("flag");
  b.task("attn", "softmax")
      .tensor("x", f32, {4, 4}, ext)
      .tensor("out", f32, {4, 4}, ext)
      .runtime_arg("causal", ArgValue(true))
      .runtime_arg("scale", ArgValue(0.5));
  try {
    compile(load_program(std::move(b).graph(), {}), {});
    FAIL() << "expected an error for a run-time causal flag";
  } catch (const CompileError& e) {
    std::string text = e.diagnostics().format();
    EXPECT_NE(text.find("task 'attn', slot 'causal'"), std::string::npos) << text;
    EXPECT_NE(text.find("argument 'causal' of op 'softmax' decides the kernel's code"), std::string::npos) << text;
    EXPECT_EQ(text.find("'scale'"), std::string::npos) << "a run-time scale is fine: " << text;
  }
}

TEST(RunTimeArgs, ReductionAndMatmulKernelsReadThemToo) {
  GraphBuilder b("skeletons");
  auto mm = b.task("mm", "matmul").tensor("a", f32, {5, 7}, ext).tensor("b", f32, {7, 9}, ext).tensor("out", f32, {5, 9});
  mm.runtime_arg("alpha", ArgValue(1.0));
  auto sm = b.task("sm", "softmax").tensor("x", mm["out"]).tensor("out", f32, {5, 9});
  sm.runtime_arg("scale", ArgValue(1.0));
  auto norm = b.task("norm", "rmsnorm").tensor("x", sm["out"]).tensor("weight", f32, {9}, ext).tensor("out", f32, {5, 9}, ext);
  norm.runtime_arg("eps", ArgValue(1e-6));
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  ASSERT_EQ(c.plan.scalars.size(), 3u);
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  RunOptions options{seed, work_dir("skeletons")};
  // Values far from the initial ones, so that a kernel reading a literal fails.
  options.args = {{"mm.alpha", ArgValue(-2.5)}, {"sm.scale", ArgValue(0.3)}, {"norm.eps", ArgValue(0.5)}};
  CheckedRun run = run_checked(c, options);
  EXPECT_TRUE(run.ok()) << format_run(run);
}
