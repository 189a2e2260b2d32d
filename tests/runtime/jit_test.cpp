// The C++ API (runtime/jit.h) in the host emulation: a graph in, values in,
// a phase run, values out; the errors a user meets on the way.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include <gtest/gtest.h>

#include "graph_json.h"
#include "jit.h"
#include "reference.h"
#include "runtime_test_util.h"

using namespace cudagen;
using namespace cudagen::testing;
namespace fs = std::filesystem;

namespace {

class Jit : public ::testing::Test {
 protected:
  void SetUp() override {
    options_.backend = Backend::emulation;
    options_.work_dir = (fs::temp_directory_path() / ("cudagen_jit_test_" + std::to_string(::getpid()))).string();
    options_.progress = [this](const std::string& line) { progress_ += line + "\n"; };
  }
  void TearDown() override { fs::remove_all(options_.work_dir); }

  JitOptions options_;
  std::string progress_;
};

std::vector<double> ramp(size_t n, double scale) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * std::sin(double(i) * 0.37 + 0.1);
  return v;
}

}  // namespace

TEST_F(Jit, RunsAGraphOnHostValuesAndMatchesTheReference) {
  JitProgram program = JitProgram::from_file(source_path("examples/mlp_forward.json"), options_);
  EXPECT_EQ(program.backend(), Backend::emulation);
  EXPECT_NE(progress_.find("running in the host emulation (asked for)"), std::string::npos) << progress_;
  EXPECT_NE(progress_.find("host compiler"), std::string::npos) << progress_;
  Instance mlp = program.instantiate();
  EXPECT_EQ(mlp.where(), "host emulation");
  const std::vector<std::string> inputs = {"fc1.a", "fc1.b", "bias1.b", "fc2.b", "bias2.b"};
  const Program& p = program.compiled().program;
  std::vector<std::vector<double>> buffers(p.buffers.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    HostTensor shape_of = mlp.read(inputs[i]);  // zeros: an instance starts cleared
    for (double v : shape_of.values()) ASSERT_EQ(v, 0.0);
    std::vector<double> values = ramp(size_t(shape_of.numel()), 0.5 + double(i) * 0.1);
    mlp.set(inputs[i], values);
    HostTensor rounded = mlp.read(inputs[i]);
    for (size_t b = 0; b < p.buffers.size(); ++b)
      if (buffer_name(p, int(b)) == inputs[i])
        buffers[b] = rounded.values();
  }
  mlp.run(Phase::forward);
  HostTensor probs = mlp.read("probs.out");
  EXPECT_EQ(probs.shape, (Shape{33, 10}));
  ReferenceBuffers ref = evaluate_reference(p, program.compiled().schedule, buffers);
  size_t probs_buffer = 0;
  for (size_t b = 0; b < p.buffers.size(); ++b)
    if (buffer_name(p, int(b)) == "probs.out") probs_buffer = b;
  std::vector<double> got = probs.values();
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LE(std::abs(got[i] - ref.value[probs_buffer][i]), 1e-5 * ref.abs[probs_buffer][i]) << i;
  EXPECT_EQ(mlp.get_tensor("probs", "out").data, probs.data);
}

// Instance::profile measures the phases from the values set so far, and the
// instance's tensors are as before afterwards.
TEST_F(Jit, ProfileMeasuresEachKernelAndLeavesTheTensorsAlone) {
  JitProgram program = JitProgram::from_file(source_path("examples/mlp_forward.json"), options_);
  Instance mlp = program.instantiate();
  for (const char* input : {"fc1.a", "fc1.b", "bias1.b", "fc2.b", "bias2.b"}) mlp.randomize(input, 5);
  mlp.run(Phase::forward);
  const HostTensor before = mlp.read("probs.out");
  Profile profile = mlp.profile();
  ASSERT_EQ(profile.kernels.size(), program.compiled().emitted.kernels.size());
  ASSERT_EQ(profile.phases.size(), 1u);
  EXPECT_EQ(profile.phases[0].phase, Phase::forward);
  int64_t bytes = 0;
  for (const KernelProfile& k : profile.kernels) {
    EXPECT_GT(k.bytes_read, 0) << k.name();
    EXPECT_GT(k.bytes_written, 0) << k.name();
    bytes += k.bytes();
  }
  EXPECT_EQ(profile.phases[0].bytes, bytes);
  EXPECT_EQ(mlp.read("probs.out").data, before.data);
  EXPECT_NE(format_profile(profile, ProfileSort::bytes).find("k0_fc1 (fc1, bias1, act1, fc2, bias2)"), std::string::npos);
}

TEST_F(Jit, AnIntermediateFusedOrReusedIsRefusedAndKeptWithFusionAndReuseOff) {
  {
    Instance mlp = JitProgram::from_file(source_path("examples/mlp_forward.json"), options_).instantiate();
    mlp.run(Phase::forward);
    const std::string fused = message_of<std::runtime_error>([&] { mlp.get_tensor("bias1", "out"); });
    EXPECT_NE(fused.find("bias1.out never reaches memory: kernel k0_fc1 computes it in registers"), std::string::npos)
        << fused;
    EXPECT_NE(fused.find("--no-fuse"), std::string::npos) << fused;
  }
  options_.compile.fuse.enabled = false;
  {
    Instance mlp = JitProgram::from_file(source_path("examples/mlp_forward.json"), options_).instantiate();
    mlp.run(Phase::forward);
    const std::string what = message_of<std::runtime_error>([&] { mlp.get_tensor("fc1", "out"); });
    EXPECT_NE(what.find("fc1.out no longer exists: the memory plan gave its bytes to bias1.out (in place)"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("--no-reuse"), std::string::npos) << what;
  }
  options_.compile.plan.placement.reuse = false;
  Instance mlp = JitProgram::from_file(source_path("examples/mlp_forward.json"), options_).instantiate();
  mlp.set("fc1.a", ramp(33 * 64, 1.0));
  mlp.set("fc1.b", ramp(64 * 100, 0.3));
  mlp.set("bias1.b", ramp(100, 0.2));
  mlp.run(Phase::forward);
  std::vector<double> pre = mlp.get_tensor("bias1", "out").values(), post = mlp.get_tensor("act1", "out").values();
  ASSERT_EQ(pre.size(), post.size());
  int negative = 0;
  for (size_t i = 0; i < pre.size(); ++i) {
    EXPECT_EQ(post[i], std::max(pre[i], 0.0)) << i;
    negative += pre[i] < 0;
  }
  EXPECT_GT(negative, 0);  // relu had something to do
}

TEST_F(Jit, BadNamesShapesAndArgumentsAreClearErrors) {
  Instance mlp = JitProgram::from_file(source_path("examples/mlp_forward.json"), options_).instantiate();
  {
    const std::string what = message_of<std::runtime_error>([&] { mlp.set("fc1.x", std::vector<double>(4)); });
    EXPECT_NE(what.find("no tensor 'fc1.x' in graph 'mlp_forward'; it has: fc1.a, fc1.b"), std::string::npos) << what;
  }
  {
    const std::string what = message_of<std::runtime_error>([&] { mlp.set("fc1.a", std::vector<double>(4)); });
    EXPECT_NE(what.find("fc1.a is f32 [33, 64] (2112 elements), but 4 values were given"), std::string::npos) << what;
  }
  {
    const HostTensor transposed = HostTensor::from_values(DType::f32, {64, 33}, std::vector<double>(2112));
    const std::string what = message_of<std::runtime_error>([&] { mlp.set("fc1.a", transposed); });
    EXPECT_NE(what.find("but the value given is f32 [64, 33]"), std::string::npos) << what;
  }
  EXPECT_THROW(mlp.set_arg("fc1.alpha", ArgValue(1.0)), std::runtime_error);
  EXPECT_THROW(mlp.run(Phase::backward), std::runtime_error);
  // A slot bound to another task's names that task's tensor.
  mlp.fill("probs.x", 2.5);
  for (double v : mlp.read("bias2.out").values()) ASSERT_EQ(v, 2.5);
}

TEST_F(Jit, InstancesOfOneProgramHaveTheirOwnArenas) {
  JitProgram program = JitProgram::from_file(source_path("examples/mlp_forward.json"), options_);
  Instance a = program.instantiate(), b = program.instantiate();
  a.fill("bias2.b", 1.0);
  b.fill("bias2.b", -1.0);
  a.run(Phase::forward);
  b.run(Phase::forward);
  EXPECT_EQ(a.read("bias2.b").values()[3], 1.0);
  EXPECT_EQ(b.read("bias2.b").values()[3], -1.0);
}

// examples/train_mlp.json through the API: init on the device's generator,
// data from the host, Adam with its learning rate set at run time; the loss
// falls, and `step` counts the steps for Adam.
TEST_F(Jit, TrainsWithRunTimeLearningRate) {
  JitProgram program = JitProgram::from_file(source_path("examples/train_mlp.json"), options_);
  Instance mlp = program.instantiate();
  mlp.run(Phase::init);
  std::vector<double> x = ramp(256 * 8, 1.0), labels(256);
  for (size_t r = 0; r < 256; ++r) labels[r] = (x[r * 8] + x[r * 8 + 1] > 0 ? 1 : 0) + (x[r * 8 + 2] > 0 ? 2 : 0);
  mlp.set("fc1.a", x);
  mlp.set("loss.labels", labels);
  std::string lr_name;
  for (const auto& sc : program.compiled().plan.scalars)
    if (sc.arg == "lr") lr_name = sc.name(program.compiled().program);
  ASSERT_FALSE(lr_name.empty());
  mlp.set_arg(lr_name, ArgValue(0.05));
  std::vector<double> losses;
  for (int s = 0; s < 25; ++s) {
    mlp.step();
    losses.push_back(mlp.read("loss.loss").values()[0]);
  }
  EXPECT_LT(losses.back(), 0.6 * losses.front()) << losses.front() << " -> " << losses.back();
  // A learning rate of zero freezes the weights.
  HostTensor before = mlp.read("w1.out");
  mlp.set_arg(lr_name, ArgValue(0.0));
  mlp.step();
  EXPECT_EQ(mlp.read("w1.out").data, before.data);
}

// Gradient accumulation through the API: a step over micro-batches, each
// fed its own inputs, is one update with the mean of their gradients. Three
// micro-batches of the same data step as one step on it does, step after
// step (micro-batch 0 starts each step's sums afresh); two of different data
// do not; a graph that does not accumulate refuses more than one.
TEST_F(Jit, AStepOverMicroBatchesUpdatesWithTheMeanOfTheirGradients) {
  TaskGraph graph = read_graph_file(source_path("examples/mlp_derived.json"));
  JitProgram plain = JitProgram::from_graph(graph, options_);
  graph.training->accumulate_gradients = true;
  JitProgram accumulating = JitProgram::from_graph(graph, options_);
  std::vector<double> x = ramp(32 * 64, 1.0), other = ramp(32 * 64, -0.6), labels(32);
  for (size_t r = 0; r < labels.size(); ++r) labels[r] = double((r * 7) % 10);
  Instance one = plain.instantiate(), same = accumulating.instantiate(), mixed = accumulating.instantiate();
  for (Instance* i : {&one, &same, &mixed}) {
    i->run(Phase::init);
    i->set("loss.labels", labels);
  }
  one.set("fc1.a", x);
  for (int s = 0; s < 2; ++s) {
    one.step();
    same.step(3, [&](int) { same.set("fc1.a", x); });
    mixed.step(2, [&](int m) { mixed.set("fc1.a", m == 0 ? x : other); });
  }
  const std::vector<double> w_one = one.read("w1_init.out").values(), w_same = same.read("w1_init.out").values(),
                            w_mixed = mixed.read("w1_init.out").values();
  double scale = 0, same_error = 0, mixed_difference = 0;
  for (size_t i = 0; i < w_one.size(); ++i) {
    scale = std::max(scale, std::abs(w_one[i]));
    same_error = std::max(same_error, std::abs(w_same[i] - w_one[i]));
    mixed_difference = std::max(mixed_difference, std::abs(w_mixed[i] - w_one[i]));
  }
  EXPECT_LE(same_error, 1e-5 * scale);
  EXPECT_GT(mixed_difference, 1e-3 * scale);
  try {
    one.step(2, {});
    ADD_FAILURE() << "a graph without \"accumulate_gradients\" took two micro-batches";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("add \"accumulate_gradients\": true"), std::string::npos) << e.what();
  }
}

// Dynamic loss scaling through the API, on the device alone: from a scale of
// 2^100 the first step's scaled gradients overflow, so it is skipped (the
// weights as they were, no step counted) and the scale backs off by 2^-60;
// the next steps are taken, and the scale grows after each (growth_interval 1).
TEST_F(Jit, AnOverflowedStepIsSkippedAndTheScaleBacksOffOnTheDevice) {
  TaskGraph graph = read_graph_file(source_path("examples/mlp_derived.json"));
  graph.training->loss_scale = LossScaling{std::ldexp(1.0, 100), 2.0, std::ldexp(1.0, -60), 1};
  Instance mlp = JitProgram::from_graph(graph, options_).instantiate();
  mlp.run(Phase::init);
  std::vector<double> labels(32);
  for (size_t r = 0; r < labels.size(); ++r) labels[r] = double((r * 3) % 10);
  mlp.set("fc1.a", ramp(32 * 64, 1.0));
  mlp.set("loss.labels", labels);
  auto scalar = [&](const char* name) { return mlp.read(name).values()[0]; };
  EXPECT_EQ(scalar("loss_scale.out"), std::ldexp(1.0, 100));
  const std::vector<unsigned char> initial = mlp.read("w1_init.out").data;
  mlp.step();
  EXPECT_EQ(scalar("loss_scale.out"), std::ldexp(1.0, 40));
  EXPECT_EQ(scalar("optimizer_steps.out"), 0.0);
  EXPECT_EQ(mlp.read("w1_init.out").data, initial);
  mlp.step();
  EXPECT_EQ(scalar("loss_scale.out"), std::ldexp(1.0, 41));
  EXPECT_EQ(scalar("optimizer_steps.out"), 1.0);
  EXPECT_NE(mlp.read("w1_init.out").data, initial);
  mlp.step();
  EXPECT_EQ(scalar("loss_scale.out"), std::ldexp(1.0, 42));
  EXPECT_EQ(scalar("optimizer_steps.out"), 2.0);
  EXPECT_EQ(scalar("loss_scale_good_steps.out"), 0.0);
}

TEST_F(Jit, RandomizeDrawsWhatAUniformInitTaskDraws) {
  JitProgram program = JitProgram::from_file(source_path("examples/train_mlp.json"), options_);
  Instance mlp = program.instantiate();
  mlp.run(Phase::init);
  HostTensor drawn_by_the_kernel = mlp.read("w1.out");
  const Program& p = program.compiled().program;
  const Task* w1 = nullptr;
  for (const auto& t : p.graph.tasks)
    if (t.id == "w1") w1 = &t;
  ASSERT_NE(w1, nullptr);
  ASSERT_EQ(w1->op, "uniform");
  auto number = [&](const char* name) {
    for (const ArgSlot& a : w1->args)
      if (a.name == name && a.value) {
        const ArgValue& v = *a.value;
        return std::holds_alternative<double>(v) ? std::get<double>(v) : double(std::get<int64_t>(v));
      }
    ADD_FAILURE() << "w1 has no argument " << name;
    return 0.0;
  };
  mlp.randomize("w1.out", int64_t(number("seed")), number("low"), number("high"));
  EXPECT_EQ(mlp.read("w1.out").data, drawn_by_the_kernel.data);
}
