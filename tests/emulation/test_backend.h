// Where the numerical tests run: in the host emulation (the default, and in
// CI), or on a GPU when CUDAGEN_TEST_BACKEND=gpu (bench/gpu_check.sh runs this
// binary so on the device machine: the same graphs, inputs, poisoning and
// bounds, launched through NVRTC and the driver API). CUDAGEN_SOURCE_DIR in
// the environment replaces the build's source folder, for a binary carried to
// another machine.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "driver.h"
#include "executor.h"
#include "pipeline.h"
#include "runner.h"
#include "validate.h"

namespace cudagen::testing {

inline bool test_on_gpu() {
  const char* backend = std::getenv("CUDAGEN_TEST_BACKEND");
  if (backend == nullptr || *backend == '\0' || std::string(backend) == "emulation") return false;
  if (std::string(backend) == "gpu") return true;
  throw std::invalid_argument("CUDAGEN_TEST_BACKEND=" + std::string(backend) + ": write emulation or gpu");
}

// A folder of its own for one test's modules and cache, under the system's
// temporary folder; the process id keeps concurrent test binaries apart.
inline std::string work_dir(const std::string& suite, const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("cudagen_" + suite + "_" + name + "_" + std::to_string(::getpid())))
      .string();
}

// The repository's folder: $CUDAGEN_SOURCE_DIR, else the one this was built from.
inline std::string test_source_dir() {
  const char* dir = std::getenv("CUDAGEN_SOURCE_DIR");
  return dir && *dir ? dir : CUDAGEN_SOURCE_DIR;
}

// The seed of a test's random inputs: fresh each run, so that every run checks
// other values; CUDAGEN_TEST_SEED=N replays the one a failure printed (a GPU
// run's, say, on the emulator).
inline uint64_t test_seed() {
  const char* pinned = std::getenv("CUDAGEN_TEST_SEED");
  if (pinned == nullptr || *pinned == '\0') return std::random_device()();
  char* end = nullptr;
  const unsigned long long seed = std::strtoull(pinned, &end, 10);
  if (*end != '\0') throw std::invalid_argument("CUDAGEN_TEST_SEED=" + std::string(pinned) + ": write a decimal number");
  return seed;
}

// CUDAGEN_TEST_MEGAKERNEL=N (ctest's megakernel_numerics): every graph
// run_checked runs is compiled again as a megakernel of N blocks, so that the
// numerical tests check that mode too.
inline int test_megakernel_blocks() {
  const char* blocks = std::getenv("CUDAGEN_TEST_MEGAKERNEL");
  return blocks && *blocks ? std::atoi(blocks) : 0;
}

// An executor of `compiled` on the chosen backend, for tests that drive the
// launchers themselves (the emulation builds in `work_dir`).
inline std::unique_ptr<Executor> make_test_executor(const Compiled& compiled, const std::string& work_dir) {
  if (!test_on_gpu()) return make_emulated_executor(compiled, work_dir);
  GpuOptions gpu;
  GpuCode code = compile_for_gpu(compiled, gpu);
  return make_gpu_executor(compiled, code, gpu);
}

// run_and_check on the chosen backend. On a GPU there is no fallback: a
// machine without a driver fails here, saying so.
inline CheckedRun run_checked(const Compiled& given, const RunOptions& options) {
  Compiled recompiled;
  if (const int blocks = test_megakernel_blocks(); blocks > 0 && !given.options.emit.megakernel) {
    CompileOptions megakernel = given.options;
    megakernel.emit.megakernel = true;
    megakernel.emit.megakernel_blocks = blocks;
    // The same program (tasks, registry) validated again: a Program is move-only.
    recompiled = compile(validate(given.program.graph, given.program.registry), megakernel);
  }
  const Compiled& compiled = recompiled.emitted.megakernel.empty() ? given : recompiled;
  if (!test_on_gpu()) return run_emulated_and_check(compiled, options);
  GpuOptions gpu;
  GpuCode code = compile_for_gpu(compiled, gpu);
  std::unique_ptr<Executor> executor = make_gpu_executor(compiled, code, gpu);
  CheckedRun run = run_and_check(compiled, *executor, options);
  run.compile_seconds = code.report.compile_seconds;
  return run;
}

}  // namespace cudagen::testing
