// The host emulator's speed, which sizes every emulated test suite:
//  - fiber switches per second: 256 threads meeting 2 000 barriers, against
//    the same schedule on swapcontext (the baseline, measured in this run);
//  - emulated matmul throughput (multiply-adds per second) of the generated
//    kernel, against a plain triple loop on the host (the baseline).
#include <ucontext.h>

#include <filesystem>
#include <vector>

#include <benchmark/benchmark.h>

#include "builder.h"
#include "cudagen_emu.h"
#include "host_module.h"
#include "pipeline.h"

using namespace cudagen;

namespace {

constexpr int kThreads = 256;
constexpr int kBarriers = 2000;

void barrier_kernel() {
  for (int i = 0; i < kBarriers; ++i) __syncthreads();
}

// A switch is one jump: into a fiber or back to the scheduler.
void BM_FiberBarriers(benchmark::State& state) {
  const cudagen_tensor_info none[1] = {{"", "", 0, 0}};
  unsigned char arena[1];
  for (auto _ : state) {
    int rc = cudagen_emu::launch("barriers", none, 0, arena, dim3(1), dim3(kThreads), 0,
                                 [](void*) { barrier_kernel(); }, nullptr);
    if (rc != 0) state.SkipWithError("launch failed");
  }
  state.counters["switches/s"] = benchmark::Counter(double(state.iterations()) * kThreads * (kBarriers + 1) * 2,
                                                    benchmark::Counter::kIsRate);
}
BENCHMARK(BM_FiberBarriers)->Unit(benchmark::kMillisecond)->UseRealTime();

// Baseline: the same round-robin schedule with ucontext (a system call per switch).
struct UcontextRun {
  ucontext_t scheduler;
  std::vector<ucontext_t> threads = std::vector<ucontext_t>(kThreads);
  std::vector<std::vector<char>> stacks = std::vector<std::vector<char>>(kThreads, std::vector<char>(64 * 1024));
  int current = 0;
};
UcontextRun* g_run = nullptr;  // the baseline's entry point takes no argument

void ucontext_body() {
  for (int i = 0; i < kBarriers; ++i) swapcontext(&g_run->threads[size_t(g_run->current)], &g_run->scheduler);
}

void BM_Baseline_Swapcontext(benchmark::State& state) {
  UcontextRun run;
  g_run = &run;
  for (auto _ : state) {
    for (int t = 0; t < kThreads; ++t) {
      getcontext(&run.threads[size_t(t)]);
      run.threads[size_t(t)].uc_stack.ss_sp = run.stacks[size_t(t)].data();
      run.threads[size_t(t)].uc_stack.ss_size = run.stacks[size_t(t)].size();
      run.threads[size_t(t)].uc_link = &run.scheduler;
      makecontext(&run.threads[size_t(t)], ucontext_body, 0);
    }
    for (int round = 0; round <= kBarriers; ++round)
      for (int t = 0; t < kThreads; ++t) {
        run.current = t;
        swapcontext(&run.scheduler, &run.threads[size_t(t)]);
      }
  }
  state.counters["switches/s"] = benchmark::Counter(double(state.iterations()) * kThreads * (kBarriers + 1) * 2,
                                                    benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Baseline_Swapcontext)->Unit(benchmark::kMillisecond)->UseRealTime();

constexpr int64_t kM = 256, kN = 256, kK = 256;

void BM_EmulatedMatmul(benchmark::State& state) {
  GraphBuilder b("bench_matmul");
  b.task("mm", "matmul")
      .tensor("a", DType::f32, {kM, kK}, Storage::external)
      .tensor("b", DType::f32, {kK, kN}, Storage::external)
      .tensor("out", DType::f32, {kM, kN}, Storage::external);
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  HostModule module = HostModule::build(c.emitted.cuda_source, std::filesystem::temp_directory_path() / "cudagen_bench_mm");
  std::vector<unsigned char> arena(size_t(c.plan.arena_bytes), 0);
  for (auto _ : state) module.run_phase(Phase::forward, arena.data());
  state.counters["MAC/s"] = benchmark::Counter(double(state.iterations()) * kM * kN * kK, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_EmulatedMatmul)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Baseline_HostMatmul(benchmark::State& state) {
  std::vector<float> a(size_t(kM * kK), 1.0f), bm(size_t(kK * kN), 0.5f), out(size_t(kM * kN));
  for (auto _ : state) {
    for (int64_t m = 0; m < kM; ++m)
      for (int64_t n = 0; n < kN; ++n) {
        float s = 0;
        for (int64_t k = 0; k < kK; ++k) s += a[size_t(m * kK + k)] * bm[size_t(k * kN + n)];
        out[size_t(m * kN + n)] = s;
      }
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["MAC/s"] = benchmark::Counter(double(state.iterations()) * kM * kN * kK, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Baseline_HostMatmul)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
