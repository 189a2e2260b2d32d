// Where a run's time and bytes go, per phase and per kernel (docs/profiling.md).
//
// On a GPU: each kernel and each phase timed with events after warm-up runs,
// the median of N runs, against the device-to-device copy bandwidth the same
// run measures, and the FLOP rate where the kernel's ops declare FLOPs. In the
// host emulation: the bytes each kernel actually read and wrote, counted by
// the emulator's checked loads and stores (not the emitter's model), and the
// same for the unfused program, so fusion's saving is measured.
//
// Three views of one Profile: a table for the terminal, JSON, and a trace in
// the Chrome/Perfetto trace-event format (ui.perfetto.dev opens it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "executor.h"
#include "pipeline.h"
#include "runner.h"

namespace cudagen {

struct ProfileOptions {
  std::vector<Phase> phases;  // empty: every phase the program has
  int warmup = 2;             // GPU: untimed runs of each phase first
  int runs = 10;              // GPU: timed runs; each figure is their median
};

struct KernelProfile {
  Phase phase = Phase::forward;
  std::string kernel;
  std::vector<std::string> tasks;
  int grid[3] = {1, 1, 1};  // as launched: a persistent kernel's is the GPU's (or the emulated one's), not the target's
  int block = 1;
  int64_t smem_bytes = 0;
  // The emitter's model: every tensor the kernel touches, once.
  int64_t modelled_bytes = 0;
  // Counted by the emulator (-1 on a GPU, which counts nothing).
  int64_t bytes_read = -1, bytes_written = -1;
  // Counted by the emulator too: 32-byte sectors of its global load and store
  // requests against the fewest their bytes need, and bank wavefronts of its
  // checked shared requests (ldmatrix, cp.async) against the fewest; 0: none.
  int64_t load_sectors = 0, ideal_load_sectors = 0, store_sectors = 0, ideal_store_sectors = 0;
  int64_t wavefronts = 0, ideal_wavefronts = 0;
  int64_t flops = -1;  // what its tasks declare; -1 when none does
  // GPU: median time, and median start from the phase's first kernel's start.
  // Emulation: the emulator's own time on the host CPU (nothing like a GPU's).
  double milliseconds = 0;
  double start_ms = 0;

  // Measured bytes where counted, else modelled.
  int64_t bytes() const { return bytes_read >= 0 ? bytes_read + bytes_written : modelled_bytes; }
  std::string name() const;  // "k3_fc1 (fc1, relu1)"
};

struct PhaseProfile {
  Phase phase = Phase::forward;
  int kernels = 0;
  // GPU: the phase from its first kernel's start to its last kernel's end
  // (median); emulation: the emulator's host time.
  double milliseconds = 0;
  double kernel_milliseconds = 0;  // the sum of its kernels' times
  int64_t bytes = 0;               // its kernels' bytes (measured in emulation)
  // The same phase of the unfused program, measured the same way (-1: not measured).
  int unfused_kernels = -1;
  int64_t unfused_bytes = -1;
};

struct Profile {
  std::string graph;
  std::string where;  // "GPU 0: NVIDIA H100 ... (sm_90)" or "host emulation"
  bool on_gpu = false;
  int runs = 1;
  double copy_bandwidth = 0;  // GPU: bytes per second (read + written) of a large device copy
  std::vector<PhaseProfile> phases;
  std::vector<KernelProfile> kernels;  // in launch order

  const PhaseProfile* find_phase(Phase phase) const;
};

// Runs each phase of `compiled` on `executor` and measures it. The arena is
// put back as it was before (profiling changes no result); what the phases
// compute starts from whatever the arena holds, so give it real inputs first
// (run_and_check does). Throws std::runtime_error as Executor::run does.
Profile profile_program(const Compiled& compiled, Executor& executor, const ProfileOptions& options = {});

// Builds `compiled` for the host emulation in run.work_dir, runs it on run's
// inputs checked against the reference (so the arena holds real values), and
// profiles it. Throws std::runtime_error with the check's table when the run
// fails: a wrong program's byte counts mean nothing.
Profile profile_emulated(const Compiled& compiled, const RunOptions& run, const ProfileOptions& options = {});

// Records `unfused`'s per-phase kernel counts and bytes in `fused`'s phases:
// both measured in the same way, so the difference is what fusion saved.
void add_unfused_baseline(Profile& fused, const Profile& unfused);

enum class ProfileSort { time, bytes };

// The terminal table: phases, then the `top` heaviest kernels by `sort`
// with their share of the whole.
std::string format_profile(const Profile& profile, ProfileSort sort, int top = 12);

// The profile as JSON (format cudagen.profile/1).
std::string profile_json(const Profile& profile);

// Trace-event JSON: one track per phase, one complete ("X") slice per
// kernel named by its tasks, the phases one after another.
std::string profile_trace(const Profile& profile);

}  // namespace cudagen
