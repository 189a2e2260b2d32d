#include "perf_model.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "arch.h"

namespace cudagen {

DeviceModel device_model(const Target& target) {
  const std::string& arch = target.arch;
  // Anchors (docs/architecture.md §11): the pipelined mainloop's bf16 rate is
  // what it measured on an H100 at 4096^3 (bench/RESULTS.md, 366-376
  // TFLOP/s); on an A100 the same kernel is scaled by the two GPUs' dense
  // tensor peaks (312 / 989). The 64 x 64 tile and the SIMT rates are static
  // estimates from their instruction mix (about 565 instructions per 8 mma;
  // one shared load per FMA on the portable tile; 4 16-byte shared loads per
  // 64 FMA on the SIMT mainloop, taken at 60% of the f32 peak: 67 TFLOP/s on
  // an H100 SXM, 19.5 on an A100), not yet measured. Bandwidth: 90% of the
  // HBM peak.
  const std::optional<Arch> a = parse_arch(arch);
  // The Hopper mainloop's: 575-590 TFLOP/s at 4096^3 in 128 x 128 tiles on
  // an H100 (bench/RESULTS.md, 2026-11-27), taken at 580 for every tile shape.
  DeviceModel d = a && a->major == 8 ? DeviceModel{arch, "A100 SXM", 108, 0.9 * 2.04e12, 370e12 * 312 / 989,
                                                    370e12 * 312 / 989, 40e12, 0.6 * 19.5e12, 10e12, 2.5e-6}
                                      : DeviceModel{arch, "H100 SXM", 132, 0.9 * 3.35e12, 370e12, 580e12, 60e12,
                                                    0.6 * 67e12, 14e12, 2.5e-6};
  // Another SM count (--sms): the same SMs, fewer or more of them.
  if (target.sms > 0 && target.sms != d.sms) {
    const double scale = double(target.sms) / d.sms;
    d.name += fmt::format(" at {} SMs", target.sms);
    d.sms = int(target.sms);
    d.pipelined_flops *= scale;
    d.hopper_flops *= scale;
    d.tensor_tile_flops *= scale;
    d.simt_mainloop_flops *= scale;
    d.simt_flops *= scale;
  }
  return d;
}

KernelEstimate estimate_kernel(const EmittedKernel& k, const DeviceModel& d) {
  KernelEstimate e;
  e.kernel = k.name;
  e.flops = std::max<int64_t>(k.flops, 0);
  e.bytes = k.bytes_read + k.bytes_written;
  // A persistent kernel's blocks loop over its tiles: the tiles run in
  // rounds as a block a tile would.
  e.blocks = k.persistent_tiles > 0 ? k.persistent_tiles : k.grid[0] * k.grid[1] * k.grid[2];
  // The Hopper mainloop at its measured rate; 168 registers a thread at one
  // block an SM, capped at 128 where it asks for two.
  const bool pipelined = k.mainloop == MatmulMainloop::pipelined || k.mainloop == MatmulMainloop::pipelined_tf32;
  // TF32's tensor-core peak is half the 16-bit one on the A100 and the H100.
  e.ceiling_flops = k.mainloop == MatmulMainloop::hopper             ? d.hopper_flops
                    : k.mainloop == MatmulMainloop::pipelined_tf32   ? d.pipelined_flops / 2
                    : pipelined                                      ? d.pipelined_flops
                    : k.mainloop == MatmulMainloop::simt             ? d.simt_mainloop_flops
                    : k.mainloop == MatmulMainloop::tensor_core_tile ? d.tensor_tile_flops
                    // Not measured yet: half the pipelined mainloop's rate (its two
                    // products are shorter, and the softmax runs between them).
                    // Not measured yet either: half the Hopper mainloop's (the same reason).
                    : k.mainloop == MatmulMainloop::flash_attention_hopper ? d.hopper_flops / 2
                    : k.mainloop == MatmulMainloop::flash_attention  ? d.pipelined_flops / 2
                    : k.mainloop == MatmulMainloop::flash_attention_tf32 ? d.pipelined_flops / 4
                    // Its mma's operands come by shuffles, one a FMA, at a warp a clock: a quarter of
                    // the FMA rate on sm_86 and later (half on sm_80).
                    : k.mainloop == MatmulMainloop::flash_attention_simt ? d.simt_mainloop_flops / 4
                                                                      : d.simt_flops;
  // Resident blocks per SM: threads, blocks, shared memory (1 KiB reserved
  // per block) and registers, assumed as ptxas reported them for the
  // generated kernels (bench/RESULTS.md): up to 255 per thread on the
  // pipelined mainloop, 141-163 on the SIMT mainloop (168 as allocated in
  // units of 8), 64 elsewhere.
  const int block = std::max(1, k.block);
  const int registers = k.mainloop == MatmulMainloop::hopper ? (k.min_blocks_per_sm >= 2 ? 128 : 168)
                        : pipelined                           ? 255
                        : k.mainloop == MatmulMainloop::simt  ? 168
                                                              : 64;
  int per_sm = std::min({32, 2048 / block, 65536 / (block * registers)});
  if (k.smem_bytes > 0) per_sm = std::min<int64_t>(per_sm, (228 * 1024) / (k.smem_bytes + 1024));
  e.blocks_per_sm = std::max(1, per_sm);
  const int64_t slots = int64_t(d.sms) * e.blocks_per_sm;
  e.waves = std::max<int64_t>(1, (e.blocks + slots - 1) / slots);
  // An SM reaches its ceilings from kSaturatingWarps resident warps: blocks
  // beyond that share its throughput, blocks short of it leave it idle. So
  // the kernel runs in rounds of `lanes` blocks at full speed, and its last
  // round's empty lanes (and SMs with no block at all) are what it loses.
  const int warps = std::max(1, (block + 31) / 32);
  const int64_t lanes = int64_t(d.sms) * std::min(e.blocks_per_sm, (kSaturatingWarps + warps - 1) / warps);
  const int64_t rounds = std::max<int64_t>(1, (e.blocks + lanes - 1) / lanes);
  double fullness = double(std::max<int64_t>(e.blocks, 1)) / double(rounds * lanes);
  if (k.hopper && k.stream_k_grid > 0) {
    // Stream-K (cg_sm90_schedule): the busiest SM's k-tiles are its whole
    // tiles' and an even share of the stream-K tiles', plus the partial
    // tiles' sums, against an even share of all of them.
    const HopperGemm& g = *k.hopper;
    const int64_t grid = std::min<int64_t>(k.stream_k_grid, int64_t(d.sms) * g.blocks_per_sm());
    const int64_t sms = std::max<int64_t>(1, grid / g.blocks_per_sm()), sk_tiles = g.stream_k_tiles(grid);
    if (sk_tiles > 0) {
      const int64_t whole = (g.tiles() - sk_tiles) / sms * g.k_tiles(),
                    shared = (sk_tiles * g.k_tiles() + sms - 1) / sms + g.fixup_k_tiles(sk_tiles * g.k_tiles(), grid);
      fullness = double(g.tiles() * g.k_tiles()) / double(sms) / double(whole + shared);
    }
  }
  const double compute = e.flops / e.ceiling_flops, memory = e.bytes / d.memory_bytes_per_s;
  const double work = std::max(compute, memory) / fullness;
  e.bound = work < d.launch_seconds ? "launch" : compute >= memory ? "compute" : "memory";
  e.seconds = d.launch_seconds + work;
  return e;
}

std::vector<KernelEstimate> estimate_kernels(const EmittedProgram& program, const DeviceModel& device) {
  std::vector<KernelEstimate> out;
  for (const EmittedKernel& k : program.kernels) out.push_back(estimate_kernel(k, device));
  return out;
}

std::string estimates_table(const std::vector<KernelEstimate>& estimates, const DeviceModel& d) {
  std::string out = fmt::format(
      "\nperformance model ({}, {}: {} SMs, {:.0f} GB/s, tensor cores {:.0f} TFLOP/s on the Hopper mainloop / {:.0f} "
      "pipelined (TF32 {:.0f}) / {:.0f} in the 64 x 64 tile, CUDA cores {:.0f} TFLOP/s in the SIMT mainloop / {:.0f} "
      "elsewhere; docs/architecture.md §11):\n",
      d.arch, d.name, d.sms, d.memory_bytes_per_s / 1e9, d.hopper_flops / 1e12, d.pipelined_flops / 1e12,
      d.pipelined_flops / 2e12,
      d.tensor_tile_flops / 1e12, d.simt_mainloop_flops / 1e12, d.simt_flops / 1e12);
  out += fmt::format("  {:<28} {:>10} {:>10} {:>8} {:>6} {:>8}  {:>10}\n", "kernel", "GFLOP", "MB", "blocks", "waves",
                     "bound", "predicted");
  double total = 0;
  for (const KernelEstimate& e : estimates) {
    total += e.seconds;
    out += fmt::format("  {:<28} {:>10.3f} {:>10.3f} {:>8} {:>6} {:>8}  {:>7.1f} us\n", e.kernel, e.flops / 1e9,
                       e.bytes / 1e6, e.blocks, e.waves, e.bound, e.seconds * 1e6);
  }
  out += fmt::format("  {:<28} {:>10} {:>10} {:>8} {:>6} {:>8}  {:>7.1f} us\n", "total (one after another)", "", "", "",
                     "", "", total * 1e6);
  return out;
}

}  // namespace cudagen
