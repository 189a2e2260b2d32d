// Pass `emit`: one standalone .cu file and its JSON manifest (docs/architecture.md §4).
//
// The file has no #include. It holds a provenance header, the device prelude,
// the template files its kernels use, one extern "C" __global__ per kernel
// taking one __restrict__ pointer per tensor, and, under
// #ifndef __CUDACC_RTC__, a host launcher per phase that computes each pointer
// as arena + OFFSET from the plan. NVRTC compiles the device part; nvcc and
// the host emulation compile the whole file.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "kernels.h"
#include "megakernel.h"
#include "plan.h"
#include "program.h"

namespace cudagen {

struct EmitOptions {
  std::string arch = "sm_90";
  // The GPU's SM count where it is not the model's for `arch` (perf_model.h:
  // 132 for sm_90, 108 for sm_80): an H100 PCIe's 114, an H20's 78. The tile
  // choices that fill waves read it (--sms; the JIT sets it from the GPU).
  int64_t sms = 0;
  // f32 matmuls on tensor cores as TF32 (PyTorch's allow_tf32): operands
  // rounded to 10 mantissa bits, products accumulated in f32; off, f32 stays
  // on the CUDA cores and within f32's bound (docs/architecture.md §9).
  bool allow_tf32 = false;
  // Flash attention's backward kernel sums dq with f32 atomics in its key
  // blocks (faster: no second pass over the scores) instead of in blocks of
  // its own: the sums' order then varies, so dq is not bit-identical from
  // run to run (docs/attention.md). Off: deterministic, the default.
  bool atomic_attention_backward = false;
  // Stream-K on the Hopper mainloop where whole tiles leave the last wave
  // partly empty (docs/gemm.md "Stream-K"). Off by default: on an H100 it
  // ran slower than whole tiles at every shape measured (bench/RESULTS.md,
  // 2026-11-27); kept, tested, for the work that makes its fix-up pay.
  bool stream_k = false;
  // Also a `cudagen_step` launcher that runs forward, backward and update:
  // one training step in one call.
  bool step_function = false;
  std::string options_text;  // the compile options, recorded in the provenance header and manifest
  // The host symbols' prefix: `<prefix>_forward`, `<prefix>_arena_bytes`.
  // Ahead of time, each graph linked into one program needs its own.
  std::string symbol_prefix = "cudagen";
  // One persistent kernel per phase instead of a kernel per fusion group
  // (docs/architecture.md §10, megakernel.h).
  bool megakernel = false;
  int megakernel_blocks = 0;  // 0: one per SM of the target (`sms`, or sm_90: 132, sm_80: 108)
  // A block that waits longer than this for an event stops the megakernel
  // and reports what it waited for.
  int64_t megakernel_watchdog_ms = 2000;
  bool megakernel_break_schedule = false;  // test only: see MegakernelOptions
  Target target() const { return Target{arch, sms}; }
};

// A TMA tensor map a kernel takes by value (the Hopper mainloop, docs/gemm.md;
// the Hopper flash attention, docs/attention.md): a row-major 2-D view of
// the tensor at arena offset `tensor_offset`, or where `depth` is set a 3-D
// one of `depth` such planes `plane_stride_bytes` apart (a head each: a box
// never crosses into the next), encoded by whoever launches (the host
// launcher, the runtime's driver path) from the arena's address, with the
// 128-byte swizzle.
struct TensorMapSpec {
  int64_t tensor_offset = 0;
  int element_bytes = 2;
  int64_t width = 0, height = 0;  // elements of a row; rows
  int64_t row_stride_bytes = 0;
  int box_width = 64, box_height = 128;
  int64_t depth = 0;  // planes of a 3-D map; 0: a 2-D map
  int64_t plane_stride_bytes = 0;
  int rank() const { return depth > 0 ? 3 : 2; }
  bool operator==(const TensorMapSpec&) const = default;
};

// A byte range of the arena that a kernel reads or writes.
struct ArenaRange {
  int64_t offset = 0;
  int64_t bytes = 0;
  bool written = false;
  // Seen as EmittedKernel::rows equal rows, each tile touches only its own
  // (see rows_per_tile).
  bool by_rows = false;
};

// A part of a kernel's shared memory: what it holds, where (bytes from the
// start of the kernel's dynamic shared memory), how much.
// The mainloop a matmul kernel runs (emit_matmul.cpp, matmul()): the pipelined one
// (templates/gemm.cuh) on 16-bit operands or on f32 ones as TF32
// (--allow-tf32), the f32 SIMT one (same file), the 64 x 64
// tensor-core tile, or the portable tile
// (the f32 tile, or a user op's own function); none for other kernels and
// for the fused matmul skeletons.
enum class MatmulMainloop {
  none,
  pipelined,
  pipelined_tf32,
  hopper,  // templates/gemm_sm90.cuh: TMA and wgmma (sm_90a)
  simt,
  tensor_core_tile,
  portable_tile,
  flash_attention,
  flash_attention_tf32,  // f32 q, k and v as TF32 (--allow-tf32)
  flash_attention_simt,  // f32 q, k and v exact, each mma's products as FMAs (trained without --allow-tf32)
  flash_attention_hopper  // templates/softmax_flash_sm90.cuh: TMA and wgmma (sm_90a)
};

struct EmittedKernel {
  std::string name;
  Phase phase;
  std::vector<int> tasks;
  // Its tiles, as blockIdx would count them (x fastest). It is launched on
  // launch_grid(), which differs where y or z is over CUDA's 65535.
  int64_t grid[3] = {1, 1, 1};
  // A matmul kernel's rows per output tile (0 where not chosen by matmul()),
  // which mainloop it runs, and that in words with why (its comment, describe).
  int64_t tile_rows = 0;
  // A persistent kernel's tiles (0 for a kernel of a block a tile): its
  // blocks loop over them, so any grid computes them all; launched on
  // persistent_grid(persistent_most_blocks(k), min_blocks_per_sm, the GPU's SMs)
  // blocks, `grid` those of the target's SMs (device_model).
  int64_t persistent_tiles = 0;
  // With stream-K (HopperGemm::stream_k): the grid its workspace is sized
  // for (the target's SM slots), every block of which takes part however few
  // the tiles; launched on no more blocks than it. 0 otherwise.
  int64_t stream_k_grid = 0;
  std::optional<HopperGemm> hopper;  // the Hopper mainloop's choice, where it runs it
  MatmulMainloop mainloop = MatmulMainloop::none;
  std::string matmul_path;
  int block = 256;
  // Its __launch_bounds__' minimum of resident blocks per SM, or 0 for none.
  // With the block size alone, ptxas may aim its register budget at several
  // blocks per SM and spill for it; a kernel of few heavy blocks (rule
  // matmul_chain) asks for 1: its registers matter more than occupancy.
  int min_blocks_per_sm = 0;
  // Its shared memory, planned per kernel: each region its skeleton and its
  // prologue use (a matmul's operand tiles, a norm prologue's staged rows, an
  // attention kernel's rows of scores and staged keys), one after another
  // from offset 0, each 16-byte aligned; smem_bytes is where the last ends.
  // All live for the whole tile, so none shares another's bytes.
  std::vector<SharedRegion> smem_regions;
  int64_t smem_bytes = 0;
  int64_t bytes_read = 0;     // modelled: each tensor read once
  int64_t bytes_written = 0;
  // The floating-point operations its tasks declare (the registry's `flops`);
  // -1 when none of them declares any.
  int64_t flops = -1;
  // Each parameter's byte offset in the arena, in the kernel's parameter
  // order (tensors, then run-time arguments): the JIT runtime launches with
  // arena + offset, as the host launcher does.
  std::vector<int64_t> arg_offsets;
  // The parameters that are TMA tensor maps (arg_offsets holds their
  // tensor's offset): their index among the parameters, and the map.
  std::vector<std::pair<int, TensorMapSpec>> tensor_maps;
  // What it touches in the arena (the megakernel's dependences come from these).
  std::vector<ArenaRange> ranges;
  // Shared memory that grows with the block (a float per thread of scratch):
  // a megakernel's larger block needs this much more per extra thread.
  int64_t smem_bytes_per_thread = 0;
  // Where the skeleton makes it plain (a matmul's output tiles, a row per
  // block), which rows each tile touches: tile t (x fastest) reads and writes
  // rows [(t / tiles_per_row_block) * rows_per_tile, + rows_per_tile) of every
  // range marked by_rows, each seen as `rows` rows. The megakernel then lets a
  // consumer's tile wait for the producer's tiles of its rows only.
  // rows_per_tile 0: unknown.
  int64_t rows = 0;
  int64_t rows_per_tile = 0;
  int64_t tiles_per_row_block = 1;
  // Its body is a grid-stride loop, correct for any grid size.
  bool grid_stride = false;
  // A megakernel: launched cooperatively, all its blocks resident at once.
  bool cooperative = false;
};

struct EmittedProgram {
  std::string cuda_source;
  std::string manifest_json;
  // A C++ header declaring the host launchers, the arena size and where each
  // input, output, parameter and run-time argument lies in the arena: what a
  // program that compiles the .cu ahead of time includes.
  std::string host_header;
  std::vector<EmittedKernel> kernels;
  // With EmitOptions::megakernel: `kernels` holds one megakernel per phase,
  // `tile_kernels` the fused kernels its tasks run, `megakernel` the schedule.
  std::vector<EmittedKernel> tile_kernels;
  std::vector<MegakernelPhase> megakernel;
  // The megakernel's event counters and watchdog reports, after the plan's
  // arena (zero before the first launch; never reset between launches).
  int64_t sync_offset = 0;
  int64_t sync_bytes = 0;
  std::vector<int64_t> megakernel_state_offsets;  // per entry of `megakernel`
  int64_t megakernel_watchdog_ms = 0;
  int64_t arena_bytes = 0;  // the plan's, plus sync_bytes
};

// The watchdog's report in the arena, one per megakernel phase (the layout
// of cg_megakernel_state in templates/prelude.cuh).
struct MegakernelState {
  uint64_t exits = 0;  // blocks that finished, over all launches
  uint32_t stopped = 0, block = 0, task = 0, event = 0;
  uint64_t value = 0, target = 0;
};
inline constexpr int64_t kMegakernelStateBytes = 64;

// Throws CompileError naming the task when an op has no template or a dtype
// is not supported yet.
EmittedProgram emit(const Program& program, const std::vector<KernelGroup>& kernels, const Plan& plan,
                    const EmitOptions& options);

// CUDA's limits on a launch's grid: x up to 2^31 - 1, y and z up to 65535.
inline constexpr int64_t kMaxGridX = 2147483647, kMaxGridYZ = 65535;

// Whether the kernel's tiles are launched folded into one x dimension (their
// grid has a y or z over kMaxGridYZ): its __global__ then unfolds blockIdx.x
// into the tile with cg_tile_of.
inline bool grid_is_folded(const EmittedKernel& k) { return k.grid[1] > kMaxGridYZ || k.grid[2] > kMaxGridYZ; }

// The grid the kernel is launched with: its tiles' grid, or all of them in x
// where folded (the emitter refuses more than kMaxGridX tiles).
inline std::array<int64_t, 3> launch_grid(const EmittedKernel& k) {
  if (grid_is_folded(k)) return {k.grid[0] * k.grid[1] * k.grid[2], 1, 1};
  return {k.grid[0], k.grid[1], k.grid[2]};
}

// A persistent kernel's grid (EmittedKernel::persistent_tiles): a block for
// each of the GPU's `sms` x `blocks_per_sm` slots, no more than `most`, the
// blocks that have work (persistent_most_blocks).
inline int64_t persistent_grid(int64_t most, int blocks_per_sm, int64_t sms) {
  return std::max<int64_t>(1, std::min<int64_t>(most, std::max<int64_t>(1, blocks_per_sm) * std::max<int64_t>(1, sms)));
}
// The most blocks a persistent kernel's launch takes: a block a tile, or with
// stream-K its workspace's grid.
inline int64_t persistent_most_blocks(const EmittedKernel& k) {
  return k.stream_k_grid > 0 ? k.stream_k_grid : k.persistent_tiles;
}

// The name of a phase's host launcher: `cudagen_forward`, ... (the runtime,
// which compiles with the default prefix, names phases by it too).
std::string phase_function(Phase phase, const std::string& prefix = "cudagen");
// The launcher of EmitOptions::step_function.
inline constexpr const char* kStepFunction = "cudagen_step";

// Why `prefix` cannot prefix C symbols (empty when it can).
std::string symbol_prefix_problem(const std::string& prefix);

// `text` made safe inside a `//` comment of generated code: every byte that
// is not printable ASCII, and the backslash, as \xNN (a newline there would
// end the comment and compile the rest; a trailing backslash would splice).
std::string comment_text(std::string_view text);

// Why the emitter cannot generate a kernel for `op` yet (no skeleton for
// its pattern, or in-place updates), or empty when it can.
std::string emitter_gap(const OpSignature& op);

// The registry's template definitions among `ids`, in registry order (a
// definition before what uses it), each under a comment naming its file and
// line: the template code of a generated file, and of the host library of
// user ops' float64 references (runtime/user_reference.h).
std::string template_definitions(const OpRegistry& registry, const std::set<std::string>& ids);

}  // namespace cudagen
