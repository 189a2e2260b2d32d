// The runtime's GPU path, run against a fake driver (tests/fake_driver): the
// code is real NVRTC output, the launches are recorded instead of run. What
// this proves without a GPU: the driver is loaded through cuGetProcAddress,
// each kernel is found in the CUBIN, launched in phase order with the plan's
// grid, block, shared memory and arena offsets, a CUDA Graph is captured once
// and replayed, and every failure names the call, the kernel and its tasks.
// bench/gpu_check.sh runs the same programs on a real GPU.
#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <sstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "builder.h"
#include "driver.h"
#include "jit.h"
#include "pipeline.h"
#include "profile.h"
#include "runtime_test_util.h"

using namespace cudagen;
using namespace cudagen::testing;
namespace fs = std::filesystem;

namespace {

std::string fake_log() {
  void* handle = dlopen(CUDAGEN_FAKE_DRIVER, RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) return "(fake driver not loaded)";
  auto log = reinterpret_cast<const char* (*)()>(dlsym(handle, "fake_cuda_log"));
  std::string out = log();
  reinterpret_cast<void (*)()>(dlsym(handle, "fake_cuda_clear_log"))();
  dlclose(handle);
  return out;
}

std::vector<std::string> lines_starting(const std::string& log, const std::string& prefix) {
  std::vector<std::string> out;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(prefix, 0) == 0) out.push_back(line);
  return out;
}

class GpuPath : public ::testing::Test {
 protected:
  void SetUp() override {
    ::setenv("CUDAGEN_CUDA_DRIVER", CUDAGEN_FAKE_DRIVER, 1);
    ::unsetenv("FAKE_CUDA_FAIL");
    ::unsetenv("FAKE_CUDA_MISSING");
    ::unsetenv("FAKE_CUDA_DEVICES");
    ::unsetenv("FAKE_CUDA_FREE_BYTES");
    ::unsetenv("FAKE_CUDA_CC");
    ::unsetenv("FAKE_CUDA_SMS");
    cache_ = fs::temp_directory_path() / ("cudagen_gpu_path_test_" + std::to_string(::getpid()));
    options_.cache_dir = cache_.string();
    fake_log();
  }
  void TearDown() override {
    ::unsetenv("FAKE_CUDA_FAIL");
    ::unsetenv("FAKE_CUDA_CC");
    ::unsetenv("FAKE_CUDA_SMS");
    fs::remove_all(cache_);
  }

  static Compiled compiled(const std::string& example, bool step_function = false) {
    CompileOptions options;
    options.emit.step_function = step_function;
    return compile(load_program(source_path(example), {}), options);
  }

  // What the fake recorded for one launch of kernel `k`.
  static std::string expected_launch(const EmittedKernel& k) {
    std::vector<std::string> args;
    for (int64_t offset : k.arg_offsets) args.push_back(fmt::format("+{}", offset));
    return fmt::format("{} grid={},{},{} block={},1,1 smem={} args={}", k.name, k.grid[0], k.grid[1], k.grid[2], k.block,
                       k.smem_bytes, fmt::join(args, ","));
  }

  fs::path cache_;
  GpuOptions options_;
};

}  // namespace

TEST_F(GpuPath, FindsTheDeviceThroughTheDriver) {
  GpuInfo gpu = find_gpu(0);
  EXPECT_EQ(gpu.name, "Fake GPU");
  EXPECT_EQ(gpu.arch, "sm_90a");
  EXPECT_EQ(gpu.driver_version, 13000);
  ::setenv("FAKE_CUDA_DEVICES", "0", 1);
  {
    const std::string what = message_of<DriverError>([&] { find_gpu(0); });
    EXPECT_NE(what.find("found no GPU"), std::string::npos) << what;
    EXPECT_NE(what.find("--emulate"), std::string::npos) << what;
  }
  ::setenv("FAKE_CUDA_DEVICES", "1", 1);
  EXPECT_THROW(find_gpu(3), DriverError);
}

// Each device gets its own target (issue #38): sm_90a, Hopper's wgmma
// instruction set, on compute capability 9.0 alone; the plain sm_XY
// elsewhere (sm_80, sm_89, and sm_100 and later, which have no wgmma). The
// JIT generates code for that target and NVRTC compiles it for it.
TEST_F(GpuPath, EachComputeCapabilityGetsItsOwnTarget) {
  struct Case {
    const char* cc;
    const char* arch;
  };
  for (const Case& c : {Case{"8.0", "sm_80"}, Case{"8.9", "sm_89"}, Case{"9.0", "sm_90a"}, Case{"10.0", "sm_100"},
                        Case{"12.0", "sm_120"}}) {
    ::setenv("FAKE_CUDA_CC", c.cc, 1);
    EXPECT_EQ(find_gpu(0).arch, c.arch) << c.cc;
    JitOptions options;
    options.backend = Backend::gpu;
    options.gpu.cache_dir = cache_.string();
    const JitProgram program = JitProgram::from_file(source_path("examples/mlp_forward.json"), options);
    EXPECT_EQ(program.compiled().options.emit.arch, c.arch) << c.cc;
    EXPECT_NE(program.build_report().find(fmt::format("NVRTC for {}:", c.arch)), std::string::npos)
        << c.cc << ": " << program.build_report();
    EXPECT_NE(program.cuda_source().find(fmt::format("// Options: arch={} ", c.arch)), std::string::npos)
        << c.cc << ": the file records its target";
  }
}

// On compute capability 9.0 a bf16 attention runs the Hopper flash kernel:
// q, k and v each through a 3-D tensor map (a plane a head), encoded by the
// runtime from the arena's address, a block of 384 threads a tile of 128
// query rows of a head.
TEST_F(GpuPath, AHopperAttentionGetsThreeDimensionalTensorMaps) {
  auto graph = [] {
    GraphBuilder b("hopper_attention");
    auto s = b.task("scores", "matmul")
                 .tensor("a", DType::bf16, {1, 2, 65, 64}, Storage::external)
                 .tensor("b", DType::bf16, {1, 2, 65, 64}, Storage::external)
                 .tensor("out", DType::bf16, {1, 2, 65, 65})
                 .arg("trans_b", true);
    auto p = b.task("probs", "softmax").tensor("x", s["out"]).tensor("out", DType::bf16, {1, 2, 65, 65}).arg("causal", true);
    b.task("context", "matmul")
        .tensor("a", p["out"])
        .tensor("b", DType::bf16, {1, 2, 65, 64}, Storage::external)
        .tensor("out", DType::bf16, {1, 2, 65, 64}, Storage::external);
    return std::move(b).graph();
  };
  JitOptions options;
  options.backend = Backend::gpu;
  options.gpu.cache_dir = cache_.string();
  fake_log();
  {
    Instance attention = JitProgram::from_graph(graph(), options).instantiate();
    attention.run(Phase::forward);
  }
  const std::string log = fake_log();
  CompileOptions o;
  o.emit.arch = "sm_90a";
  const Compiled c = compile(load_program(graph(), {}), o);
  ASSERT_EQ(c.emitted.kernels.size(), 1u);
  const EmittedKernel& k = c.emitted.kernels[0];
  ASSERT_EQ(k.tensor_maps.size(), 3u) << k.matmul_path;
  for (const auto& [arg, m] : k.tensor_maps) {
    EXPECT_EQ(m, (TensorMapSpec{m.tensor_offset, 2, 64, 65, 128, 64, 128, 2, 65 * 128}));
    EXPECT_NE(log.find(fmt::format("tensor map +{} 64x65x2 stride 128,8320 box 64x128x1 swizzle 128", m.tensor_offset)),
              std::string::npos)
        << log;
  }
  const std::vector<std::string> launches = lines_starting(log, "launch ");
  ASSERT_EQ(launches.size(), 1u) << log;
  EXPECT_EQ(launches[0], "launch " + expected_launch(k));
  EXPECT_NE(launches[0].find(" grid=1,2,1 block=384,1,1 "), std::string::npos) << launches[0];
}

// On compute capability 9.0 a bf16 matmul runs the Hopper mainloop: the
// runtime encodes its two TMA tensor maps once, from the arena's address
// (the driver checks each against its limits), and passes them by value;
// on 8.9 the same graph takes the pipelined mainloop and needs none.
TEST_F(GpuPath, AHopperMatmulGetsItsTensorMapsFromTheArena) {
  auto graph = [] {
    GraphBuilder b("hopper");
    b.task("mm", "matmul")
        .tensor("a", DType::bf16, {300, 192}, Storage::external)
        .tensor("b", DType::bf16, {192, 264}, Storage::external)
        .tensor("out", DType::bf16, {300, 264}, Storage::external);
    return std::move(b).graph();
  };
  JitOptions options;
  options.backend = Backend::gpu;
  options.gpu.cache_dir = cache_.string();
  // Tiles for 132 SMs (as ahead of time), so that a smaller GPU below is
  // the runtime's to fill: the grid sized where the kernel is launched.
  options.compile.emit.sms = 132;
  fake_log();
  {
    Instance mm = JitProgram::from_graph(graph(), options).instantiate();
    mm.run(Phase::forward);
  }
  const std::string log = fake_log();
  const Compiled c = compile(load_program(graph(), {}), [] {
    CompileOptions o;
    o.emit.arch = "sm_90a";
    return o;
  }());
  ASSERT_EQ(c.emitted.kernels.size(), 1u);
  const EmittedKernel& k = c.emitted.kernels[0];
  ASSERT_EQ(k.tensor_maps.size(), 2u) << k.matmul_path;
  // a: 192 wide, 300 high, a box of 64 rows (nine tiles of 128 rows would leave
  // SMs idle: one consumer warpgroup); b as stored: 264 wide, 192 high, 64 x 64.
  const TensorMapSpec& a = k.tensor_maps[0].second;
  const TensorMapSpec& b = k.tensor_maps[1].second;
  EXPECT_EQ(a, (TensorMapSpec{a.tensor_offset, 2, 192, 300, 384, 64, 64}));
  EXPECT_EQ(b, (TensorMapSpec{b.tensor_offset, 2, 264, 192, 528, 64, 64}));
  EXPECT_NE(log.find(fmt::format("tensor map +{} 192x300 stride 384 box 64x64 swizzle 128", a.tensor_offset)),
            std::string::npos)
      << log;
  EXPECT_NE(log.find(fmt::format("tensor map +{} 264x192 stride 528 box 64x64 swizzle 128", b.tensor_offset)),
            std::string::npos)
      << log;
  const std::vector<std::string> launches = lines_starting(log, "launch ");
  ASSERT_EQ(launches.size(), 1u) << log;
  EXPECT_EQ(launches[0], "launch " + expected_launch(k)) << "the maps are logged as the tensors they point to";
  EXPECT_NE(launches[0].find("block=256,1,1 smem=109616"), std::string::npos) << launches[0];
  // Persistent: 5 x 3 tiles of 64 x 128, a block for each (132 SMs hold 264).
  EXPECT_EQ(k.persistent_tiles, 15);
  EXPECT_NE(launches[0].find(" grid=15,1,1 "), std::string::npos) << launches[0];

  // On a GPU of 4 SMs, two blocks each: 8 blocks, looping over the 15 tiles.
  ::setenv("FAKE_CUDA_SMS", "4", 1);
  fake_log();
  {
    Instance mm = JitProgram::from_graph(graph(), options).instantiate();
    mm.run(Phase::forward);
  }
  const std::vector<std::string> small = lines_starting(fake_log(), "launch ");
  ASSERT_EQ(small.size(), 1u);
  EXPECT_NE(small[0].find(" grid=8,1,1 "), std::string::npos) << small[0];
  ::unsetenv("FAKE_CUDA_SMS");

  ::setenv("FAKE_CUDA_CC", "8.9", 1);
  fake_log();
  {
    Instance mm = JitProgram::from_graph(graph(), options).instantiate();
    mm.run(Phase::forward);
  }
  EXPECT_EQ(fake_log().find("tensor map"), std::string::npos) << "sm_89 has no TMA path";
}

// A decoder's down projection (1024 x 768 over 3072: 96 tiles of 64 rows,
// 48 k-tiles each) takes stream-K on the Hopper mainloop where asked
// (--stream-k; whole tiles by default, measured faster on an H100): its
// launch is every block of the target's grid its workspace is for (132 SMs,
// two blocks each), however few the tiles, and on a GPU of fewer SMs the
// blocks that GPU holds at once, never more than the workspace's.
TEST_F(GpuPath, AStreamKMatmulRunsOnEveryBlockItsWorkspaceHolds) {
  auto graph = [] {
    GraphBuilder b("stream_k");
    b.task("mm", "matmul")
        .tensor("a", DType::bf16, {1024, 3072}, Storage::external)
        .tensor("b", DType::bf16, {3072, 768}, Storage::external)
        .tensor("out", DType::bf16, {1024, 768}, Storage::external);
    return std::move(b).graph();
  };
  CompileOptions compile_options;
  compile_options.emit.arch = "sm_90a";
  {
    const Compiled whole = compile(load_program(graph(), {}), compile_options);
    ASSERT_EQ(whole.emitted.kernels.size(), 1u);
    EXPECT_EQ(whole.emitted.kernels[0].matmul_path.find("stream-K"), std::string::npos)
        << "stream-K without --stream-k: " << whole.emitted.kernels[0].matmul_path;
    EXPECT_EQ(whole.emitted.kernels[0].stream_k_grid, 0);
  }
  compile_options.emit.stream_k = true;
  const Compiled c = compile(load_program(graph(), {}), compile_options);
  ASSERT_EQ(c.emitted.kernels.size(), 1u);
  const EmittedKernel& k = c.emitted.kernels[0];
  EXPECT_NE(k.matmul_path.find("the last by stream-K"), std::string::npos) << k.matmul_path;
  EXPECT_EQ(k.persistent_tiles, 96);
  EXPECT_EQ(k.stream_k_grid, 264);
  EXPECT_EQ(k.grid[0], 264);
  JitOptions options;
  options.backend = Backend::gpu;
  options.gpu.cache_dir = cache_.string();
  options.compile.emit.stream_k = true;
  // The JIT tunes for the GPU's own SMs: at 114 (an H100 PCIe) the 96
  // tiles fill one wave with a k-tile's fix-up costing more than the idle
  // SMs' share it would save (at 132 stream-K pays, below): whole tiles.
  ::setenv("FAKE_CUDA_SMS", "114", 1);
  {
    JitProgram pcie = JitProgram::from_graph(graph(), options);
    ::unsetenv("FAKE_CUDA_SMS");
    ASSERT_EQ(pcie.compiled().emitted.kernels.size(), 1u);
    EXPECT_EQ(pcie.compiled().options.emit.sms, 114);
    EXPECT_EQ(pcie.compiled().emitted.kernels[0].stream_k_grid, 0) << pcie.compiled().emitted.kernels[0].matmul_path;
    EXPECT_EQ(pcie.compiled().emitted.kernels[0].persistent_tiles, 96);
  }
  // Code compiled for 132 SMs (as ahead of time) on GPUs of other sizes.
  options.compile.emit.sms = 132;
  for (const auto& [sms, grid] : {std::pair<const char*, const char*>{nullptr, " grid=264,1,1 "}, {"4", " grid=8,1,1 "},
                                  {"200", " grid=264,1,1 "}}) {
    if (sms != nullptr) ::setenv("FAKE_CUDA_SMS", sms, 1);
    fake_log();
    {
      Instance mm = JitProgram::from_graph(graph(), options).instantiate();
      mm.run(Phase::forward);
    }
    const std::vector<std::string> launches = lines_starting(fake_log(), "launch ");
    ::unsetenv("FAKE_CUDA_SMS");
    ASSERT_EQ(launches.size(), 1u);
    EXPECT_NE(launches[0].find(grid), std::string::npos) << (sms ? sms : "132") << " SMs: " << launches[0];
  }
}

TEST_F(GpuPath, LaunchesEveryKernelOfAPhaseWithThePlansGeometryAndOffsets) {
  Compiled c = compiled("examples/mlp_forward.json");
  GpuCode code = compile_for_gpu(c, options_);
  EXPECT_EQ(code.report.arch, "sm_90a");  // the device's: Hopper's wgmma target
  EXPECT_EQ(code.report.cache, CacheOutcome::miss);
  std::unique_ptr<Executor> gpu = make_gpu_executor(c, code, options_);
  EXPECT_EQ(gpu->where(), "GPU 0: Fake GPU (sm_90a)");
  fake_log();
  gpu->run("cudagen_forward");
  const std::string log = fake_log();
  std::vector<std::string> launches = lines_starting(log, "launch ");
  ASSERT_EQ(launches.size(), c.emitted.kernels.size()) << log;
  for (size_t i = 0; i < launches.size(); ++i) EXPECT_EQ(launches[i], "launch " + expected_launch(c.emitted.kernels[i]));
  EXPECT_NE(log.find("synchronize"), std::string::npos);

  // Host data goes in and out at the arena's offsets.
  std::vector<unsigned char> in(64), out(64);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<unsigned char>(i * 3);
  gpu->write(256, in.data(), in.size());
  gpu->read(256, out.data(), out.size());
  EXPECT_EQ(in, out);
  // Outside the arena, on the GPU as in the emulation: refused before any copy.
  EXPECT_THROW(gpu->write(c.plan.arena_bytes - 8, in.data(), in.size()), std::out_of_range);
  EXPECT_THROW(gpu->read(-1, out.data(), out.size()), std::out_of_range);
  EXPECT_THROW(make_emulated_executor(c, std::make_shared<const HostModule>(HostModule::build(
                                             c.emitted.cuda_source, cache_.string() + "/emu")))
                   ->fill(c.plan.arena_bytes, 0, 1),
               std::out_of_range);

  // A second compile of the same program is a cache hit.
  EXPECT_EQ(compile_for_gpu(c, options_).report.cache, CacheOutcome::hit);
  gpu.reset();
  const std::string teardown = fake_log();
  EXPECT_NE(teardown.find("free"), std::string::npos);
  EXPECT_NE(teardown.find("module unloaded"), std::string::npos);
  EXPECT_NE(teardown.find("context released"), std::string::npos);
}

TEST_F(GpuPath, TrainingStepRunsForwardBackwardUpdateAndPassesRunTimeArguments) {
  Compiled c = compiled("examples/train_mlp.json");
  GpuCode code = compile_for_gpu(c, options_);
  std::unique_ptr<Executor> gpu = make_gpu_executor(c, code, options_);
  ASSERT_TRUE(gpu->has_function("cudagen_step"));
  fake_log();
  gpu->run("cudagen_step");
  std::vector<std::string> launches = lines_starting(fake_log(), "launch ");
  std::vector<std::string> expected;
  for (Phase phase : {Phase::forward, Phase::backward, Phase::update})
    for (const auto& k : c.emitted.kernels)
      if (k.phase == phase) expected.push_back("launch " + expected_launch(k));
  EXPECT_EQ(launches, expected);
  // The optimizer reads its learning rate from the scalars region.
  bool reads_scalar = false;
  for (const auto& k : c.emitted.kernels)
    for (int64_t offset : k.arg_offsets) reads_scalar = reads_scalar || offset >= c.plan.scalars.front().offset;
  EXPECT_TRUE(reads_scalar);
}

TEST_F(GpuPath, CudaGraphIsCapturedOnceAndReplayed) {
  Compiled c = compiled("examples/mlp_forward.json");
  options_.cuda_graph = true;
  std::unique_ptr<Executor> gpu = make_gpu_executor(c, compile_for_gpu(c, options_), options_);
  fake_log();
  gpu->run("cudagen_forward");
  gpu->run("cudagen_forward");
  gpu->run("cudagen_forward");
  const std::string log = fake_log();
  EXPECT_EQ(lines_starting(log, "begin capture").size(), 1u) << log;
  EXPECT_EQ(lines_starting(log, "capture ").size(), c.emitted.kernels.size()) << log;
  EXPECT_EQ(lines_starting(log, "instantiate graph").size(), 1u) << log;
  EXPECT_EQ(lines_starting(log, fmt::format("graph launch ({} kernels)", c.emitted.kernels.size())).size(), 3u) << log;
  EXPECT_EQ(lines_starting(log, "launch ").size(), 0u) << "kernels launched outside the graph:\n" << log;
}

TEST_F(GpuPath, ProfilingTimesEachKernel) {
  Compiled c = compiled("examples/mlp_forward.json");
  options_.profile = true;
  std::unique_ptr<Executor> gpu = make_gpu_executor(c, compile_for_gpu(c, options_), options_);
  gpu->run("cudagen_forward");
  std::vector<KernelTime> times = gpu->kernel_times();
  ASSERT_EQ(times.size(), c.emitted.kernels.size());
  EXPECT_EQ(times[1].kernel, c.emitted.kernels[1].name);
  EXPECT_GT(times[1].milliseconds, 0);
}

// The fake driver's clock advances 0.5 ms per launch and 1 ms per copy, so
// every figure of the profile is known: each kernel 0.5 ms, starting 0.5 ms
// after the one before, the phase 0.5 ms per kernel, the copy 2 x 256 MiB in
// 1 ms.
TEST_F(GpuPath, ProfilingTakesMediansAfterWarmUpAndMeasuresTheCopyBandwidth) {
  Compiled c = compiled("examples/mlp_forward.json");
  std::unique_ptr<Executor> gpu = make_gpu_executor(c, compile_for_gpu(c, options_), options_);
  fake_log();
  ProfileOptions profiling;
  profiling.warmup = 1;
  profiling.runs = 3;
  Profile profile = profile_program(c, *gpu, profiling);
  const std::string log = fake_log();
  const size_t kernels = c.emitted.kernels.size();
  EXPECT_EQ(lines_starting(log, "launch ").size(), (1 + 3) * kernels) << log;
  EXPECT_EQ(lines_starting(log, "copy 268435456").size(), 6u) << log;  // a warm-up and five timed copies

  EXPECT_TRUE(profile.on_gpu);
  EXPECT_EQ(profile.runs, 3);
  EXPECT_DOUBLE_EQ(profile.copy_bandwidth, 2.0 * 268435456 / 1e-3);
  ASSERT_EQ(profile.kernels.size(), kernels);
  for (size_t i = 0; i < kernels; ++i) {
    EXPECT_EQ(profile.kernels[i].kernel, c.emitted.kernels[i].name);
    EXPECT_DOUBLE_EQ(profile.kernels[i].milliseconds, 0.5);
    EXPECT_DOUBLE_EQ(profile.kernels[i].start_ms, 0.5 * double(i));
    EXPECT_EQ(profile.kernels[i].bytes_read, -1);  // a GPU counts nothing; the model stands in
    EXPECT_EQ(profile.kernels[i].bytes(), c.emitted.kernels[i].bytes_read + c.emitted.kernels[i].bytes_written);
  }
  ASSERT_EQ(profile.phases.size(), 1u);
  EXPECT_DOUBLE_EQ(profile.phases[0].milliseconds, 0.5 * double(kernels));
  const std::string table = format_profile(profile, ProfileSort::time);
  EXPECT_NE(table.find("median of 3 timed runs"), std::string::npos) << table;
  EXPECT_NE(table.find("GFLOP/s"), std::string::npos) << table;

  // Profiling is switched off again: the next run times nothing.
  fake_log();
  gpu->run("cudagen_forward");
  EXPECT_EQ(gpu->last_run_milliseconds(), -1);
}

TEST_F(GpuPath, AFailedLaunchNamesTheCallTheKernelAndItsTasks) {
  Compiled c = compiled("examples/mlp_forward.json");
  std::unique_ptr<Executor> gpu = make_gpu_executor(c, compile_for_gpu(c, options_), options_);
  ::setenv("FAKE_CUDA_FAIL", "cuLaunchKernel:k0_fc1", 1);
  {
    const std::string what = message_of<DriverError>([&] { gpu->run("cudagen_forward"); });
    EXPECT_NE(what.find("cuLaunchKernel failed while launching kernel k0_fc1 (tasks fc1, bias1, act1, fc2, bias2)"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("CUDA_ERROR_LAUNCH_FAILED"), std::string::npos) << what;
  }
  // An error that surfaces at the synchronisation names the whole launcher.
  ::setenv("FAKE_CUDA_FAIL", "cuStreamSynchronize", 1);
  {
    const std::string what = message_of<DriverError>([&] { gpu->run("cudagen_forward"); });
    EXPECT_NE(what.find("running cudagen_forward (kernels k0_fc1: tasks fc1, bias1, act1, fc2, bias2; k1_probs"), std::string::npos) << what;
    EXPECT_NE(what.find("CUDA_ERROR_ILLEGAL_ADDRESS"), std::string::npos) << what;
  }
}

TEST_F(GpuPath, TheArenaIsRefusedOverTheBudgetAndAFailedAllocationSaysWhatToDo) {
  Compiled c = compiled("examples/mlp_forward.json");
  GpuCode code = compile_for_gpu(c, options_);
  options_.budget_bytes = c.plan.arena_bytes - 1;
  {
    const std::string what = message_of<DriverError>([&] { make_gpu_executor(c, code, options_); });
    EXPECT_NE(what.find(fmt::format("the arena needs {} bytes but the budget", c.plan.arena_bytes)),
              std::string::npos)
        << what;
  }
  EXPECT_NE(fake_log().find("context released"), std::string::npos) << "a failed start leaks the context";
  options_.budget_bytes = 0;
  ::setenv("FAKE_CUDA_FAIL", "cuMemAlloc", 1);
  {
    const std::string what = message_of<DriverError>([&] { make_gpu_executor(c, code, options_); });
    EXPECT_NE(what.find("cuMemAlloc failed while allocating the arena"), std::string::npos) << what;
    EXPECT_NE(what.find("CUDA_ERROR_OUT_OF_MEMORY"), std::string::npos) << what;
  }
}

TEST_F(GpuPath, PtxIsLoadedWhenAskedFor) {
  Compiled c = compiled("examples/mlp_forward.json");
  options_.ptx = true;
  GpuCode code = compile_for_gpu(c, options_);
  EXPECT_TRUE(code.ptx);
  std::unique_ptr<Executor> gpu = make_gpu_executor(c, code, options_);
  EXPECT_NE(fake_log().find("module loaded (PTX)"), std::string::npos);
}

// A driver without an entry point cudagen needs is a clear error. (Loaded
// from a copy: the process keeps the driver it loaded first.)
TEST_F(GpuPath, AMissingEntryPointIsNamed) {
  const std::string copy = (cache_ / "libcuda-old.so").string();
  fs::create_directories(cache_);
  fs::copy_file(CUDAGEN_FAKE_DRIVER, copy);
  ::setenv("CUDAGEN_CUDA_DRIVER", copy.c_str(), 1);
  ::setenv("FAKE_CUDA_MISSING", "cuGraphLaunch", 1);
  {
    const std::string what = message_of<DriverError>([&] { find_gpu(0); });
    EXPECT_NE(what.find("has no entry point cuGraphLaunch"), std::string::npos) << what;
  }
  ::unsetenv("FAKE_CUDA_MISSING");
}

TEST_F(GpuPath, NoDriverSaysSoAndOffersTheEmulation) {
  ::setenv("CUDAGEN_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
  {
    const std::string what = message_of<DriverError>([&] { find_gpu(0); });
    EXPECT_NE(what.find("no CUDA driver found: cannot load /nonexistent/libcuda.so.1"), std::string::npos)
        << what;
    EXPECT_NE(what.find("--emulate"), std::string::npos) << what;
  }
  std::string why;
  EXPECT_EQ(choose_backend(Backend::automatic, 0, &why), Backend::emulation);
  EXPECT_NE(why.find("running in the host emulation: no CUDA driver found"), std::string::npos) << why;
  EXPECT_THROW(choose_backend(Backend::gpu, 0, &why), DriverError);
  // Compiling for a named architecture needs no driver at all.
  Compiled c = compiled("examples/mlp_forward.json");
  options_.arch = "sm_80";
  GpuCode code = compile_for_gpu(c, options_);
  EXPECT_EQ(code.report.arch, "sm_80");
  EXPECT_FALSE(code.binary.empty());
}

// --megakernel: one cooperative launch per phase, of the arena pointer only,
// after a residency check that names the fix when the GPU is too small; the
// NVRTC-compiled module holds the megakernel and no per-fusion-group kernel.
TEST_F(GpuPath, AMegakernelIsOneCooperativeLaunchPerPhaseAfterAResidencyCheck) {
  CompileOptions options;
  options.emit.megakernel = true;
  options.emit.megakernel_blocks = 132;
  options.emit.step_function = true;
  Compiled c = compile(load_program(source_path("examples/train_mlp.json"), {}), options);
  GpuCode code = compile_for_gpu(c, options_);
  std::unique_ptr<Executor> gpu = make_gpu_executor(c, code, options_);
  fake_log();
  gpu->run("cudagen_forward");
  std::string log = fake_log();
  std::vector<std::string> launches = lines_starting(log, "cooperative launch ");
  ASSERT_EQ(launches.size(), 1u) << log;
  EXPECT_EQ(launches[0], fmt::format("cooperative launch megakernel_forward grid=132,1,1 block=256,1,1 smem={} args=+0",
                                     c.emitted.kernels[1].smem_bytes));
  // A timed batch: one warm-up launch, then the runs back to back between two events.
  EXPECT_GT(gpu->time_runs("cudagen_forward", 3), 0.0);
  log = fake_log();
  EXPECT_EQ(lines_starting(log, "cooperative launch ").size(), 4u) << log;
  // The step: forward, backward and update, one launch each, never a CUDA Graph capture.
  GpuOptions graphs = options_;
  graphs.cuda_graph = true;
  std::unique_ptr<Executor> replayed = make_gpu_executor(c, code, graphs);
  fake_log();
  replayed->run("cudagen_step");
  log = fake_log();
  EXPECT_EQ(lines_starting(log, "cooperative launch ").size(), 3u) << log;
  EXPECT_EQ(log.find("capture"), std::string::npos) << log;

  // 40 SMs x 2 blocks cannot hold 132 blocks that wait for one another.
  ::setenv("FAKE_CUDA_SMS", "40", 1);
  const std::string what = message_of<DriverError>([&] { make_gpu_executor(c, code, options_); });
  ::unsetenv("FAKE_CUDA_SMS");
  EXPECT_NE(what.find("megakernel megakernel_init needs 132 blocks of 256 threads"), std::string::npos) << what;
  EXPECT_NE(what.find("holds 80 (2 per SM x 40 SMs); compile with --megakernel-blocks 80 or fewer"), std::string::npos)
      << what;
}
