// A roofline estimate of each generated kernel's time on the target, made at
// compile time (before any GPU runs) so that a run on a GPU checks the model
// as well as the kernels: `cudagen describe` prints it, the manifest records
// it. The ceilings and their anchors are in docs/architecture.md §11.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "arch.h"
#include "emit.h"

namespace cudagen {

// What the model knows of a target: one datasheet GPU per architecture, its
// compute ceilings scaled to the target's SM count where one is given (the
// memory bandwidth is the datasheet GPU's).
struct DeviceModel {
  std::string arch;            // "sm_90"
  std::string name;            // "H100 SXM"
  int sms = 132;
  double memory_bytes_per_s;   // achievable device-memory bandwidth
  double pipelined_flops;      // the pipelined tensor-core mainloop, measured (16-bit)
  double hopper_flops;         // the Hopper mainloop (wgmma), measured (16-bit); pipelined_flops without one
  double tensor_tile_flops;    // the 64 x 64 tensor-core tile (16-bit)
  double simt_mainloop_flops;  // CUDA cores, f32 FMA, the SIMT mainloop (8 x 8 outputs a thread)
  double simt_flops;           // CUDA cores, f32 FMA, the portable tile and other kernels
  double launch_seconds;       // a launch's fixed cost, back to back
};

// Resident warps from which an SM issues at its ceilings (two a scheduler):
// the model's assumption until a GPU run measures it.
constexpr int kSaturatingWarps = 8;

// The model of `target`'s arch: an A100 SXM for sm_80 to sm_89 (the nearest
// datasheet the model has), an H100 SXM for sm_90 and later; with the
// target's SM count where it gives one.
DeviceModel device_model(const Target& target);

struct KernelEstimate {
  std::string kernel;
  int64_t flops = 0;   // 0 where no task declares any
  int64_t bytes = 0;   // read + written, each tensor once
  int64_t blocks = 0;
  int blocks_per_sm = 1;
  int64_t waves = 1;
  double ceiling_flops = 0;  // the compute ceiling its path runs at
  std::string bound;         // "compute", "memory" or "launch"
  double seconds = 0;        // predicted
};

// Time = launch cost + max(flops / ceiling, bytes / bandwidth), divided by
// how full its waves are (blocks / (waves x SMs x blocks per SM)).
KernelEstimate estimate_kernel(const EmittedKernel& kernel, const DeviceModel& device);

std::vector<KernelEstimate> estimate_kernels(const EmittedProgram& program, const DeviceModel& device);

// The table `cudagen describe` prints.
std::string estimates_table(const std::vector<KernelEstimate>& estimates, const DeviceModel& device);

}  // namespace cudagen
