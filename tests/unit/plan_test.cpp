#include <random>

#include <gtest/gtest.h>

#include "builder.h"
#include "plan.h"
#include "test_util.h"

using namespace cudagen;

TEST(Plan, ReusesMemoryOfBuffersThatDoNotOverlapInTime) {
  // a: steps 0-1, b: 1-2, c: 2-3 (all 256 bytes): a and c can share.
  std::vector<LiveInterval> iv = {{256, 0, 1}, {256, 1, 2}, {256, 2, 3}};
  auto offsets = place_greedy_by_size(iv, {});
  EXPECT_EQ(lower_bound_bytes(iv, 256), 512);
  EXPECT_EQ(offsets[0], offsets[2]);
  EXPECT_NE(offsets[0], offsets[1]);
  EXPECT_EQ(verify_placement(iv, offsets, 512, 256), "");
}

TEST(Plan, BestFitFillsTheSmallestGap) {
  // Big buffers at [0,1024) and [1536,2560) live throughout... a 512-byte gap between
  // them is only made when the middle one dies: the known optimum is the lower bound.
  std::vector<LiveInterval> iv = {{1024, 0, 9}, {512, 0, 4}, {1024, 0, 9}, {512, 5, 9}, {256, 5, 9}, {256, 0, 4}};
  auto offsets = place_greedy_by_size(iv, {});
  int64_t arena = 0;
  for (size_t i = 0; i < iv.size(); ++i) arena = std::max(arena, offsets[i] + iv[i].bytes);
  EXPECT_EQ(lower_bound_bytes(iv, 256), 2816);
  EXPECT_EQ(arena, 2816);
  EXPECT_EQ(verify_placement(iv, offsets, arena, 256), "");
}

TEST(Plan, AlignmentAndNoReuse) {
  std::vector<LiveInterval> iv = {{100, 0, 0}, {10, 1, 1}, {300, 2, 2}};
  auto reused = place_greedy_by_size(iv, {});
  for (int64_t o : reused) EXPECT_EQ(o, 0) << "disjoint lifetimes share the same storage";
  PlacementOptions no_reuse;
  no_reuse.reuse = false;
  auto separate = place_greedy_by_size(iv, no_reuse);
  EXPECT_EQ(separate, (std::vector<int64_t>{0, 256, 512}));
  PlacementOptions small;
  small.alignment = 16;
  auto tight = place_greedy_by_size({{100, 0, 1}, {10, 1, 1}}, small);
  EXPECT_EQ(tight[1] % 16, 0);
  EXPECT_EQ(lower_bound_bytes({{100, 0, 1}, {10, 1, 1}}, 16), 128);
}

TEST(Plan, VerifierCatchesEveryKindOfBrokenPlan) {
  std::vector<LiveInterval> iv = {{256, 0, 2}, {256, 1, 3}};
  EXPECT_NE(verify_placement(iv, {0, 0}, 512, 256).find("overlap in memory while both live"), std::string::npos);
  EXPECT_NE(verify_placement(iv, {0, 128}, 512, 256).find("not aligned"), std::string::npos);
  EXPECT_NE(verify_placement(iv, {0, 512}, 512, 256).find("ends past the arena"), std::string::npos);
  EXPECT_EQ(verify_placement(iv, {0, 256}, 512, 256), "");
  EXPECT_EQ(verify_placement({{256, 0, 0}, {256, 1, 1}}, {0, 0}, 256, 256), "") << "disjoint lifetimes may share";
}

// Property: on thousands of random lifetimes the placement verifies, never
// beats the lower bound, and corrupting it is always detected.
TEST(Plan, RandomLifetimesAlwaysVerify) {
  std::mt19937 rng(12345);
  for (int round = 0; round < 2000; ++round) {
    int n = 1 + int(rng() % 40), steps = 1 + int(rng() % 30);
    std::vector<LiveInterval> iv;
    for (int i = 0; i < n; ++i) {
      int a = int(rng() % steps), b = int(rng() % steps);
      iv.push_back({1 + int64_t(rng() % 5000), std::min(a, b), std::max(a, b)});
    }
    PlacementOptions options;
    options.alignment = 1 << (rng() % 9);
    options.reuse = rng() % 8 != 0;
    auto offsets = place_greedy_by_size(iv, options);
    int64_t arena = 0;
    for (size_t i = 0; i < iv.size(); ++i) arena = std::max(arena, offsets[i] + iv[i].bytes);
    ASSERT_EQ(verify_placement(iv, offsets, arena, options.alignment), "") << "round " << round;
    ASSERT_GE(arena + options.alignment, lower_bound_bytes(iv, options.alignment)) << "round " << round;
    // Move a buffer onto another that lives at the same time: the verifier must notice.
    for (size_t i = 1; i < iv.size(); ++i) {
      if (iv[i].first <= iv[0].last && iv[0].first <= iv[i].last) {
        auto broken = offsets;
        broken[i] = broken[0];
        ASSERT_NE(verify_placement(iv, broken, arena + iv[i].bytes, options.alignment), "") << "round " << round;
        break;
      }
    }
  }
}

TEST(Plan, ProgramPlanLooksUpSlotsAndHonoursTheBudget) {
  using cudagen::testing::source_path;
  Program p = validate(read_graph(read_text_file(source_path("examples/mlp_forward.json"))), builtin_registry());
  std::vector<KernelGroup> kernels = one_kernel_per_task(p, schedule(p));
  Plan plan = plan_memory(p, kernels, {});
  auto where = plan.lookup(p, "bias1", "a");
  EXPECT_EQ(where.buffer, p.tasks[0].find_tensor("out")->buffer) << "a dependent slot lives in its producer's buffer";
  EXPECT_EQ(where.bytes, 33 * 100 * 4);
  EXPECT_THROW(plan.lookup(p, "bias1", "nope"), std::out_of_range);
  EXPECT_LE(plan.lower_bound, plan.arena_bytes);
  EXPECT_LT(plan.arena_bytes, plan.no_reuse_bytes) << "transients reuse memory";

  PlanOptions tight;
  tight.budget_bytes = 4096;
  try {
    plan_memory(p, kernels, tight);
    FAIL();
  } catch (const CompileError& e) {
    std::string msg = e.diagnostics().format();
    EXPECT_NE(msg.find("over the budget of 4096 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("fc1.b (25.0 KiB, external)"), std::string::npos) << "largest live tensor first:\n" << msg;
  }
}

TEST(Plan, ElementwiseOutputTakesOverADyingInputInPlace) {
  GraphBuilder b("chain");
  auto r1 = b.task("r1", "relu").tensor("x", DType::f32, {8, 32}, Storage::external).tensor("out", DType::f32, {8, 32});
  auto r2 = b.task("r2", "relu").tensor("x", r1["out"]).tensor("out", DType::f32, {8, 32});
  auto r3 = b.task("r3", "relu").tensor("x", r2["out"]).tensor("out", DType::f32, {8, 32}, Storage::external);
  b.task("s", "softmax").tensor("x", r2["out"]).tensor("out", DType::f32, {8, 32}, Storage::external);
  Program p = validate(std::move(b).graph(), builtin_registry());
  Plan plan = plan_memory(p, one_kernel_per_task(p, schedule(p)), {});
  auto t1 = plan.lookup(p, "r1", "out"), t2 = plan.lookup(p, "r2", "out");
  EXPECT_EQ(plan.buffers[size_t(t2.buffer)].in_place_of, t1.buffer);
  EXPECT_EQ(t1.offset, t2.offset) << "r2 writes its output over its input, which dies there";
  EXPECT_EQ(plan.buffers[size_t(plan.lookup(p, "r3", "out").buffer)].in_place_of, -1)
      << "r2.out is still read by the softmax after r3, and r3.out is external";
  PlanOptions no_reuse;
  no_reuse.placement.reuse = false;
  Plan separate = plan_memory(p, one_kernel_per_task(p, schedule(p)), no_reuse);
  EXPECT_NE(separate.lookup(p, "r1", "out").offset, separate.lookup(p, "r2", "out").offset);
}

TEST(Plan, PersistentBuffersHaveTheirOwnRegionFirst) {
  Program p = validate(read_graph(read_text_file(cudagen::testing::source_path("examples/mlp_train.json"))),
                       builtin_registry());
  Plan plan = plan_memory(p, one_kernel_per_task(p, schedule(p)), {});
  EXPECT_EQ(plan.persistent_bytes, 32768 + 512 + 5120 + 256) << "four weights, each aligned to 256";
  for (const auto& pb : plan.buffers) {
    bool persistent = p.buffers[size_t(pb.buffer)].storage == Storage::persistent;
    EXPECT_EQ(pb.offset < plan.persistent_bytes, persistent) << p.buffers[size_t(pb.buffer)].owner_slot;
  }
}
