// The megakernel mode (issue #13): each phase one persistent kernel whose
// blocks run tile tasks from constant tables, synchronised by event counters.
// The host emulation runs all blocks of such a launch at once as fibers, so
// these tests execute the schedules, the waits and the watchdog in CI.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <set>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "builder.h"
#include "graph_json.h"
#include "jit.h"
#include "megakernel.h"
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
  return cudagen::testing::work_dir("megakernel", name);
}

CompileOptions megakernel_options(int blocks) {
  CompileOptions options;
  options.emit.megakernel = true;
  options.emit.megakernel_blocks = blocks;
  return options;
}

std::string failures(const CheckedRun& run) {
  std::string out;
  for (const auto& c : run.checks)
    if (c.failures > 0)
      out += fmt::format("{}: {} of {} elements, first at {}: got {}, want {}\n", c.buffer, c.failures, c.elements,
                         c.first_failure, c.got, c.want);
  return out;
}

// Hundreds of one-element tasks, unfused: a long chain whose every link is a
// diamond (x -> relu, x -> neg -> relu, both into an add), so that most
// kernels wait for two others and need join tasks.
TaskGraph diamonds(int links) {
  GraphBuilder b("diamonds");
  TaskBuilder prev = b.task("x", "relu").tensor("x", f32, {3, 5}, ext).tensor("out", f32, {3, 5});
  for (int i = 0; i < links; ++i) {
    auto left = b.task(fmt::format("l{}", i), "relu").tensor("x", prev["out"]).tensor("out", f32, {3, 5});
    auto neg = b.task(fmt::format("n{}", i), "neg").tensor("x", prev["out"]).tensor("out", f32, {3, 5});
    auto right = b.task(fmt::format("r{}", i), "tanh").tensor("x", neg["out"]).tensor("out", f32, {3, 5});
    prev = b.task(fmt::format("j{}", i), "add")
               .tensor("a", left["out"])
               .tensor("b", right["out"])
               .tensor("out", f32, {3, 5}, i + 1 == links ? std::optional<Storage>(ext) : std::nullopt);
  }
  return std::move(b).graph();
}

}  // namespace

// Every bundled example, as a megakernel on a few blocks, against the float64
// reference; the training graphs for three steps, so that each phase runs
// several times on counters that are never reset.
TEST(Megakernel, EveryExampleMatchesTheReference) {
  for (const char* name : {"mlp_forward", "mlp_train", "train_mlp", "transformer_block", "train_transformer"}) {
    SCOPED_TRACE(name);
    const std::string path = test_source_dir() + "/examples/" + name + ".json";
    Compiled c = compile(load_program(path, {}), megakernel_options(5));
    ASSERT_FALSE(c.emitted.megakernel.empty());
    for (const EmittedKernel& k : c.emitted.kernels) EXPECT_TRUE(k.cooperative) << k.name;
    const uint64_t seed = test_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    RunOptions options{seed, work_dir(name)};
    const bool training = c.emitted.megakernel.size() > 2;
    if (training) options.steps = 3;
    CheckedRun run = run_checked(c, options);
    EXPECT_TRUE(run.ok()) << failures(run);
  }
}

// The megakernel computes what the kernels do: same inputs, same outputs
// within the dtype's bound (bit-identical here: each tile runs the same code).
TEST(Megakernel, MatchesTheMultiKernelMode) {
  const std::string path = test_source_dir() + "/examples/transformer_block.json";
  JitOptions normal, mega;
  normal.backend = mega.backend = Backend::emulation;
  normal.work_dir = work_dir("match_normal");
  mega.work_dir = work_dir("match_mega");
  mega.compile = megakernel_options(7);
  Instance a = JitProgram::from_file(path, normal).instantiate();
  Instance b = JitProgram::from_file(path, mega).instantiate();
  a.run(Phase::init);
  b.run(Phase::init);
  a.randomize("ln1.x", 11);  // the block's input; weights come from init
  b.randomize("ln1.x", 11);
  a.run(Phase::forward);
  b.run(Phase::forward);
  const HostTensor want = a.read("res2.out"), got = b.read("res2.out");
  ASSERT_EQ(want.data.size(), got.data.size());
  const float* w = reinterpret_cast<const float*>(want.data.data());
  const float* g = reinterpret_cast<const float*>(got.data.data());
  for (size_t i = 0; i < want.data.size() / 4; ++i)
    ASSERT_LE(std::fabs(g[i] - w[i]), 1e-5 * std::fabs(w[i]) + 1e-30) << "element " << i;
}

// A phase launched again and again: the counters only grow, and each launch
// waits for its own multiple of every event's triggers.
TEST(Megakernel, RunsManyLaunchesWithoutResettingItsCounters) {
  JitOptions options;
  options.backend = Backend::emulation;
  options.work_dir = work_dir("launches");
  options.compile = megakernel_options(3);
  options.compile.fuse.enabled = false;  // a kernel per task: events and joins between them
  JitProgram program = JitProgram::from_graph(diamonds(6), options);
  Instance instance = program.instantiate();
  const EmittedProgram& e = program.compiled().emitted;
  ASSERT_EQ(e.megakernel.size(), 1u);
  std::vector<double> x(15);
  for (int launch = 1; launch <= 5; ++launch) {
    for (size_t i = 0; i < x.size(); ++i) x[i] = 0.1 * double(launch) - 0.05 * double(i);
    instance.set("x.x", x);
    instance.run(Phase::forward);
    // The reference: six links of relu(v) + tanh(-v), from relu(x).
    const HostTensor out = instance.read("j5.out");
    const float* y = reinterpret_cast<const float*>(out.data.data());
    for (size_t i = 0; i < x.size(); ++i) {
      float v = std::max(float(x[i]), 0.0f);
      for (int l = 0; l < 6; ++l) v = std::max(v, 0.0f) + std::tanh(-v);
      ASSERT_NEAR(y[i], v, 1e-5) << "launch " << launch << ", element " << i;
    }
  }
}

TEST(Megakernel, HundredsOfTinyTasksWithDiamondsAndLongChains) {
  CompileOptions options = megakernel_options(6);
  options.fuse.enabled = false;  // one kernel per task: 1 + 4 x 60
  // Without reuse: a buffer that takes over another's memory must wait for
  // that one's readers, which would chain each diamond's sides.
  options.plan.placement.reuse = false;
  Compiled c = compile(load_program(diamonds(60), {}), options);
  ASSERT_EQ(c.emitted.megakernel.size(), 1u);
  const MegakernelPhase& mp = c.emitted.megakernel[0];
  EXPECT_EQ(mp.kernels.size(), 241u);
  int joins = 0;
  for (const auto& t : mp.tasks) joins += t.kernel < 0;
  EXPECT_EQ(joins, 2 * 60);  // every add waits for two kernels
  // x, then per link relu/neg, tanh, the join task, add: 1 + 60 * 4 tasks.
  EXPECT_EQ(mp.critical_path_tasks, 1 + 60 * 4);
  // Each task waits on at most one event and triggers at most one (by
  // construction of the table); a task only waits for events that tasks
  // placed to start earlier trigger.
  for (const auto& t : mp.tasks) EXPECT_LT(t.wait, int(mp.events.size()));
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(c, RunOptions{seed, work_dir("diamonds")});
  EXPECT_TRUE(run.ok()) << failures(run);
}

// A schedule that cannot finish (test option: one producer never triggers)
// is stopped by the watchdog, which names the block, the task and the event;
// the instance runs again once the schedule is sound.
TEST(Megakernel, TheWatchdogStopsABrokenScheduleAndSaysWhatWaited) {
  CompileOptions options = megakernel_options(4);
  options.emit.megakernel_break_schedule = true;
  // fc1 and fc2 as two kernels (not one matmul_chain): fc2's tiles wait on
  // an event that several of fc1's tiles trigger.
  options.fuse.disabled_rules = {"matmul_chain"};
  JitOptions jit;
  jit.backend = Backend::emulation;
  jit.work_dir = work_dir("watchdog");
  jit.compile = options;
  Instance instance = JitProgram::from_file(test_source_dir() + "/examples/mlp_forward.json", jit).instantiate();
  try {
    instance.run(Phase::forward);
    FAIL() << "a schedule that cannot finish went unnoticed";
  } catch (const std::runtime_error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("megakernel megakernel_forward was stopped by its watchdog: block "), std::string::npos)
        << message;
    EXPECT_NE(message.find("for event e0 (k0_fc1 rows 0-31, 4 triggers per launch), which had counted 3 of the 4"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("k1_fc2 tile"), std::string::npos) << message;
  }
  // The same again: the counters were reset, and the same wait stops it.
  EXPECT_THROW(instance.run(Phase::forward), std::runtime_error);
}

TEST(Megakernel, DescribePrintsTheSchedule) {
  CompileOptions options = megakernel_options(4);
  options.fuse.disabled_rules = {"matmul_chain"};  // three kernels, waits by rows between each two
  Compiled c = compile(load_program(test_source_dir() + "/examples/mlp_forward.json", {}), options);
  const std::string text = describe_megakernel(c.emitted.megakernel, c.emitted.tile_kernels);
  EXPECT_NE(text.find("forward phase: one megakernel of 4 blocks x 256 threads, 4288 bytes of shared memory"),
            std::string::npos)
      << text;
  // fc2's tiles wait for fc1's tiles of their 32 rows, the softmax's rows for fc2's: an event per chunk.
  EXPECT_NE(text.find("3 kernels as 43 tile tasks and 0 join tasks; 4 events"), std::string::npos) << text;
  EXPECT_NE(text.find("critical path 3 tasks"), std::string::npos) << text;
  EXPECT_NE(text.find("k1_fc2                                2  k0_fc1 (by rows: 32 per event)"), std::string::npos)
      << text;
  EXPECT_NE(text.find("e1         4  k0_fc1 rows 32-32"), std::string::npos) << text;
  EXPECT_NE(text.find("block   0"), std::string::npos) << text;
}

// The same graph and options give the same file, byte for byte.
TEST(Megakernel, GeneratedCodeIsDeterministic) {
  const std::string path = test_source_dir() + "/examples/train_transformer.json";
  Compiled a = compile(load_program(path, {}), megakernel_options(9));
  Compiled b = compile(load_program(path, {}), megakernel_options(9));
  EXPECT_EQ(a.emitted.cuda_source, b.emitted.cuda_source);
  EXPECT_EQ(a.emitted.manifest_json, b.emitted.manifest_json);
}

// Where a consumer's tiles own the rows they read (a row of matmul output
// tiles, a row per block), they wait for the producer's tiles of those rows
// only: one event per chunk of rows, not one per kernel.
TEST(Megakernel, WaitsByRowsWhereTilesOwnTheirRows) {
  GraphBuilder b("rows");
  auto norm = b.task("norm", "rmsnorm").tensor("x", f32, {3, 32, 64}, ext).tensor("weight", f32, {64}, ext)
                  .tensor("out", f32, {3, 32, 64});
  auto proj = b.task("proj", "matmul").tensor("a", norm["out"]).tensor("b", f32, {64, 64}, ext)
                  .tensor("out", f32, {3, 32, 64});
  auto probs = b.task("probs", "softmax").tensor("x", proj["out"]).tensor("out", f32, {3, 32, 64});
  b.task("mix", "matmul").tensor("a", probs["out"]).tensor("b", f32, {64, 48}, ext).tensor("out", f32, {3, 32, 48}, ext);
  CompileOptions options = megakernel_options(5);
  options.plan.placement.reuse = false;  // no write-after-read between the kernels
  options.fuse.disabled_rules = {"norm_prologue"};  // the norm's own kernel, a row op before a matmul
  Compiled c = compile(load_program(std::move(b).graph(), {}), options);
  ASSERT_EQ(c.emitted.megakernel.size(), 1u);
  const MegakernelPhase& mp = c.emitted.megakernel[0];
  ASSERT_EQ(mp.kernels.size(), 4u);
  // [3, 32, 64] @ [64, 64] is one [96, 64] @ [64, 64]: three rows of 32 x 32 output tiles.
  const EmittedKernel& proj_kernel = c.emitted.tile_kernels[size_t(mp.kernels[1])];
  EXPECT_EQ(proj_kernel.rows, 96);
  EXPECT_EQ(proj_kernel.rows_per_tile, 32);
  EXPECT_EQ(proj_kernel.tiles_per_row_block, 2);
  EXPECT_EQ(mp.chunk_rows, (std::vector<int64_t>{0, 32, 32, 32}));
  // The projection's tiles of rows 32-63 wait for the norm's 32 rows there, and trigger the softmax's.
  std::set<int> waited;
  for (const MegakernelTask& t : mp.tasks)
    if (t.kernel == mp.kernels[1]) {
      EXPECT_EQ(t.wait_count, 32);
      waited.insert(t.wait);
    }
  EXPECT_EQ(waited.size(), 3u);
  EXPECT_NE(describe_megakernel(c.emitted.megakernel, c.emitted.tile_kernels).find("(by rows: 32 per event)"),
            std::string::npos);
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  CheckedRun run = run_checked(c, RunOptions{seed, work_dir("rows")});
  EXPECT_TRUE(run.ok()) << failures(run);

  // A transposed operand is read down its columns: whole kernels again.
  GraphBuilder t("transposed");
  auto first = t.task("first", "matmul").tensor("a", f32, {64, 64}, ext).tensor("b", f32, {64, 64}, ext)
                   .tensor("out", f32, {64, 64});
  t.task("second", "matmul").tensor("a", first["out"]).tensor("b", f32, {64, 64}, ext).arg("trans_a", true)
      .tensor("out", f32, {64, 64}, ext);
  Compiled ct = compile(load_program(std::move(t).graph(), {}), options);
  EXPECT_EQ(ct.emitted.megakernel[0].chunk_rows, (std::vector<int64_t>{0, 0}));
}
