// The profiler in the emulation: the bytes it reports for a few kernels equal
// the counts worked out by hand from their templates, the unfused program is
// measured the same way, the trace is trace-event JSON with one slice per
// kernel, and profiling leaves every tensor as it found it.
#include <unistd.h>

#include <filesystem>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "builder.h"
#include "json.h"
#include "pipeline.h"
#include "profile.h"
#include "runner.h"
#include "test_backend.h"

using namespace cudagen;

namespace {

constexpr Storage ext = Storage::external;
constexpr int64_t f32 = 4;

std::string work_dir(const std::string& name) {
  return cudagen::testing::work_dir("profile_test", name);
}

CompileOptions fusion(bool on) {
  CompileOptions o;
  o.fuse.enabled = on;
  return o;
}

// Compiles `graph` and profiles it after a checked run on random inputs.
Profile profile_graph(TaskGraph graph, bool fuse) {
  const std::string name = graph.name + (fuse ? "_fused" : "_unfused");
  return profile_emulated(compile(load_program(std::move(graph), {}), fusion(fuse)), RunOptions{7, work_dir(name)});
}

}  // namespace

// relu then neg over 1000 floats: fused, one kernel reads x once and writes
// out once; unfused, the intermediate goes to memory and back.
TEST(Profile, AnElementwiseChainReadsAndWritesEachElementOnce) {
  auto chain = [] {
    GraphBuilder b("chain");
    auto r = b.task("r", "relu").tensor("x", DType::f32, {1000}, ext).tensor("out", DType::f32, {1000});
    b.task("n", "neg").tensor("x", r["out"]).tensor("out", DType::f32, {1000}, ext);
    return std::move(b).graph();
  };
  Profile fused = profile_graph(chain(), true);
  ASSERT_EQ(fused.kernels.size(), 1u);
  const KernelProfile& k = fused.kernels[0];
  EXPECT_EQ(k.bytes_read, 1000 * f32);
  EXPECT_EQ(k.bytes_written, 1000 * f32);
  EXPECT_EQ(k.bytes(), k.modelled_bytes);  // the model is exact for an elementwise chain
  EXPECT_EQ(k.tasks, (std::vector<std::string>{"r", "n"}));

  Profile unfused = profile_graph(chain(), false);
  ASSERT_EQ(unfused.kernels.size(), 2u);
  for (const KernelProfile& u : unfused.kernels) {
    EXPECT_EQ(u.bytes_read, 1000 * f32) << u.name();
    EXPECT_EQ(u.bytes_written, 1000 * f32) << u.name();
  }
  add_unfused_baseline(fused, unfused);
  const PhaseProfile* forward = fused.find_phase(Phase::forward);
  ASSERT_NE(forward, nullptr);
  EXPECT_EQ(forward->bytes, 2000 * f32);
  EXPECT_EQ(forward->unfused_kernels, 2);
  EXPECT_EQ(forward->unfused_bytes, 4000 * f32);
  EXPECT_NE(format_profile(fused, ProfileSort::bytes).find("50.0%"), std::string::npos)
      << format_profile(fused, ProfileSort::bytes);
}

// out[33, 70] = a[33, 20] @ b[20, 70] in f32: 32 x 32 output tiles (2 x 3 of
// them), each loading its rows of a and its columns of b once, guarded at the
// edges. So a is read once per column of tiles, b once per row of tiles.
TEST(Profile, AMatmulReadsEachOperandOncePerTileAcross) {
  GraphBuilder b("matmul");
  b.task("mm", "matmul")
      .tensor("a", DType::f32, {33, 20}, ext)
      .tensor("b", DType::f32, {20, 70}, ext)
      .tensor("out", DType::f32, {33, 70}, ext);
  Profile p = profile_graph(std::move(b).graph(), true);
  ASSERT_EQ(p.kernels.size(), 1u);
  const KernelProfile& k = p.kernels[0];
  const int64_t tile_rows = 2, tile_cols = 3;
  EXPECT_EQ(k.grid[0] * k.grid[1], tile_rows * tile_cols);
  EXPECT_EQ(k.bytes_read, (33 * 20 * tile_cols + 20 * 70 * tile_rows) * f32);
  EXPECT_EQ(k.bytes_written, 33 * 70 * f32);
  EXPECT_EQ(k.modelled_bytes, (33 * 20 + 20 * 70 + 33 * 70) * f32);
  EXPECT_EQ(k.flops, 2 * 33 * 70 * 20);  // matmul's declared 2 * numel(out) * K
}

// A block per row: the row's maximum, the sum of exponentials, then the
// output, each pass reading the row again.
TEST(Profile, ASoftmaxReadsItsRowThreeTimes) {
  GraphBuilder b("softmax");
  b.task("sm", "softmax").tensor("x", DType::f32, {7, 1000}, ext).tensor("out", DType::f32, {7, 1000}, ext);
  Profile p = profile_graph(std::move(b).graph(), true);
  ASSERT_EQ(p.kernels.size(), 1u);
  const KernelProfile& k = p.kernels[0];
  EXPECT_EQ(k.grid[0], 7);
  EXPECT_EQ(k.bytes_read, 3 * 7 * 1000 * f32);
  EXPECT_EQ(k.bytes_written, 7 * 1000 * f32);
  EXPECT_EQ(k.flops, 5 * 7 * 1000);
}

// A training step repeats update (which changes the weights) while profiling;
// afterwards the arena is exactly as before, and runs compute as before.
TEST(Profile, ProfilingChangesNoResult) {
  Compiled c = compile(load_program(std::string(CUDAGEN_SOURCE_DIR) + "/examples/train_mlp.json", {}), fusion(true));
  std::unique_ptr<Executor> executor = make_emulated_executor(c, work_dir("train_mlp"));
  RunOptions options{3, work_dir("train_mlp")};
  options.steps = 1;
  CheckedRun run = run_and_check(c, *executor, options);
  ASSERT_TRUE(run.ok()) << format_run(run);

  const size_t bytes = size_t(c.plan.arena_bytes);
  std::vector<unsigned char> before(bytes), after(bytes), plain(bytes), profiled(bytes);
  executor->read(0, before.data(), bytes);
  Profile profile = profile_program(c, *executor);
  executor->read(0, after.data(), bytes);
  EXPECT_TRUE(before == after) << "profiling left the arena changed";
  EXPECT_EQ(profile.phases.size(), 4u);  // init, forward, backward, update

  // The same forward and backward, from the same state, with and without a
  // profile in between.
  executor->run("cudagen_forward");
  executor->run("cudagen_backward");
  executor->read(0, plain.data(), bytes);
  executor->write(0, before.data(), bytes);
  profile_program(c, *executor, ProfileOptions{{Phase::forward}});
  executor->run("cudagen_forward");
  executor->run("cudagen_backward");
  executor->read(0, profiled.data(), bytes);
  EXPECT_TRUE(plain == profiled) << "a run after profiling computed something else";
}

TEST(Profile, TheTraceHasATrackPerPhaseAndASlicePerKernel) {
  Compiled c = compile(load_program(std::string(CUDAGEN_SOURCE_DIR) + "/examples/transformer_block.json", {}), fusion(true));
  Profile profile = profile_emulated(c, RunOptions{1, work_dir("transformer_block")});
  ASSERT_EQ(profile.kernels.size(), c.emitted.kernels.size());

  const JsonValue trace = parse_json(profile_trace(profile));
  const JsonValue* events = trace.find("traceEvents");
  ASSERT_NE(events, nullptr);
  std::map<int64_t, std::string> tracks;  // tid -> phase
  std::vector<const JsonValue*> slices;
  for (const JsonValue& e : events->items()) {
    const std::string ph = e.find("ph")->as_string();
    if (ph == "M" && e.find("name")->as_string() == "thread_name")
      tracks[e.find("tid")->as_int()] = e.find("args")->find("name")->as_string();
    if (ph == "X") slices.push_back(&e);
  }
  EXPECT_EQ(tracks.size(), profile.phases.size());
  ASSERT_EQ(slices.size(), c.emitted.kernels.size());
  double previous_end = -1;
  for (size_t i = 0; i < slices.size(); ++i) {
    const JsonValue& s = *slices[i];
    const KernelProfile& k = profile.kernels[i];
    EXPECT_EQ(s.find("name")->as_string(), k.name());
    EXPECT_EQ(tracks.at(s.find("tid")->as_int()), to_string(k.phase));
    const double ts = s.find("ts")->as_double(), dur = s.find("dur")->as_double();
    EXPECT_GE(dur, 0);
    EXPECT_GE(ts, previous_end - 1e-6) << "slices overlap on the timeline at " << k.name();
    previous_end = ts + dur;
    EXPECT_EQ(s.find("args")->find("bytes_read")->as_int(), k.bytes_read);
  }

  const JsonValue json = parse_json(profile_json(profile));
  EXPECT_EQ(json.find("format")->as_string(), "cudagen.profile/1");
  EXPECT_EQ(json.find("kernels")->items().size(), c.emitted.kernels.size());
}

// The pipelined and SIMT mainloops hand their results to the store and its
// epilogue 16 bytes a lane (docs/gemm.md): a bf16 matmul with a bias, a
// residual and GELU stores 8 values and loads 8 of the bias and of the
// residual with one access each, whole sectors, and bank-conflict free; so
// does an f32 one on the SIMT mainloop, 4 values a lane. A product whose
// rows are no multiple of the width keeps an element a lane (f32 from 2^24
// FLOPs on the SIMT mainloop), and all three
// match the float64 reference (profile_emulated checks the run first).
TEST(Profile, MatmulEpiloguesStoreSixteenBytesALane) {
  GraphBuilder b("vector_epilogue");
  for (DType d : {DType::bf16, DType::f32}) {
    const std::string s = to_string(d);
    auto mm = b.task("mm_" + s, "matmul").tensor("a", d, {256, 384}, ext).tensor("b", d, {384, 192}, ext).tensor("out", d, {256, 192});
    auto bias = b.task("bias_" + s, "add").tensor("a", mm["out"]).tensor("b", d, {192}, ext).tensor("out", d, {256, 192});
    auto res = b.task("res_" + s, "add").tensor("a", bias["out"]).tensor("b", d, {256, 192}, ext).tensor("out", d, {256, 192});
    b.task("act_" + s, "gelu").tensor("x", res["out"]).tensor("out", d, {256, 192}, ext);
  }
  b.task("odd", "matmul")  // B^T stored: 70 columns, read K-contiguous
      .tensor("a", DType::bf16, {64, 64}, ext)
      .tensor("b", DType::bf16, {70, 64}, ext)
      .tensor("out", DType::bf16, {64, 70}, ext)
      .arg("trans_b", true);
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  const std::string& cu = c.emitted.cuda_source;
  EXPECT_NE(cu.find("cg_gemm_each_coalesced_vector<cg_config, 8>"), std::string::npos);
  EXPECT_NE(cu.find("cg_sgemm_each_coalesced_vector<cg_config, 4>"), std::string::npos);
  EXPECT_NE(cu.find("const cg_vector<8, cg_bf16> bias_bf16_b_v = cg_load_vector<8>(bias_bf16_b, (i % 192));"),
            std::string::npos);
  EXPECT_NE(cu.find("cg_gemm_each_coalesced<cg_config>"), std::string::npos) << "odd: 70 columns, an element a lane";
  Profile p = profile_emulated(c, RunOptions{11, work_dir("vector_epilogue")});
  ASSERT_EQ(p.kernels.size(), 3u);
  for (const KernelProfile& k : p.kernels) {
    SCOPED_TRACE(k.name());
    if (k.name().find("odd") != std::string::npos) continue;
    ASSERT_GT(k.ideal_store_sectors, 0);
    EXPECT_LE(double(k.store_sectors), 1.1 * double(k.ideal_store_sectors));
    EXPECT_LE(double(k.load_sectors), 1.1 * double(k.ideal_load_sectors));
    EXPECT_EQ(k.wavefronts, k.ideal_wavefronts);
  }
}

// A persistent kernel (the Hopper mainloop for sm_90a) is profiled on the
// grid it was launched on: the emulated GPU's 3 SMs times its blocks an SM,
// not the target's 132 the generated grid assumes; a kernel of a block a
// tile keeps its grid.
TEST(Profile, APersistentKernelShowsTheGridItRanOn) {
  GraphBuilder b("persistent_grid");
  b.task("mm", "matmul").tensor("a", DType::bf16, {300, 192}, ext).tensor("b", DType::bf16, {192, 264}, ext).tensor("out", DType::bf16, {300, 264}, ext);
  b.task("act", "relu").tensor("x", DType::f32, {4096}, ext).tensor("out", DType::f32, {4096}, ext);
  CompileOptions options;
  options.emit.arch = "sm_90a";
  Compiled c = compile(load_program(std::move(b).graph(), {}), options);
  ASSERT_EQ(c.emitted.kernels.size(), 2u);
  const EmittedKernel& mm = c.emitted.kernels[0];
  ASSERT_GT(mm.persistent_tiles, 0) << mm.matmul_path;
  EXPECT_EQ(mm.grid[0], 15) << "the target's grid: a block for each of its 15 tiles";
  Profile p = profile_emulated(c, RunOptions{3, work_dir("persistent_grid")});
  ASSERT_EQ(p.kernels.size(), 2u);
  EXPECT_EQ(p.kernels[0].grid[0], 3 * mm.min_blocks_per_sm) << p.kernels[0].name();
  EXPECT_EQ(p.kernels[1].grid[0], c.emitted.kernels[1].grid[0]) << p.kernels[1].name();
  EXPECT_NE(format_profile(p, ProfileSort::time).find(fmt::format("{} x {}", 3 * mm.min_blocks_per_sm, mm.block)),
            std::string::npos);
}
