#include "emitter.h"

#include <map>

namespace cudagen::lowering {

// The host launchers' encoders of TMA tensor maps (the Hopper kernels'
// operands, docs/gemm.md, docs/attention.md): a 2-D row-major view of a
// tensor in the arena (`two_d`), a 3-D one (`three_d`: planes of such views,
// a box one plane deep), their box and the 128-byte swizzle, encoded from
// the arena's address before each launch that reads them; the host
// emulation checks the driver's limits and keeps a shadow of the map.
// (Only the forms the file's kernels take: nvcc warns of an unused one.)
std::string Emitter::tensor_map_helper(bool two_d, bool three_d) {
  std::string out =
      "// TMA tensor maps: a row-major tensor in the arena, its box, the 128-byte swizzle.\n"
      "#ifdef CUDAGEN_EMULATION\n";
  if (two_d)
    out +=
        "static int cudagen_tensor_map_2d(cg_tensor_map* map, unsigned char* base, unsigned element_bytes,\n"
        "                                 unsigned long long width, unsigned long long height,\n"
        "                                 unsigned long long row_stride, unsigned box_width, unsigned box_height,\n"
        "                                 const char* kernel) {\n"
        "  return cudagen_emu::tensor_map_2d(map, base, element_bytes, width, height, row_stride, box_width, box_height,\n"
        "                                    kernel);\n"
        "}\n";
  if (three_d)
    out +=
        "static int cudagen_tensor_map_3d(cg_tensor_map* map, unsigned char* base, unsigned element_bytes,\n"
        "                                 unsigned long long width, unsigned long long height, unsigned long long depth,\n"
        "                                 unsigned long long row_stride, unsigned long long plane_stride,\n"
        "                                 unsigned box_width, unsigned box_height, const char* kernel) {\n"
        "  return cudagen_emu::tensor_map_3d(map, base, element_bytes, width, height, depth, row_stride, plane_stride,\n"
        "                                    box_width, box_height, kernel);\n"
        "}\n";
  out +=
      "#else\n"
      "// The driver's cuTensorMapEncodeTiled, found through the runtime (nothing links libcuda), its\n"
      "// enumerations as cuda.h numbers them: 2-byte elements moved as UINT16 (1), no interleave (0),\n"
      "// the 128-byte swizzle (3), L2 promotion of 256 bytes (3), out-of-bounds elements zero (0).\n"
      "typedef int (*cudagen_encode_tiled)(void*, int, unsigned, void*, const unsigned long long*,\n"
      "                                    const unsigned long long*, const unsigned*, const unsigned*, int, int, int,\n"
      "                                    int);\n"
      "static int cudagen_encode_tensor_map(cg_tensor_map* map, unsigned rank, unsigned char* base,\n"
      "                                     unsigned element_bytes, const unsigned long long* dims,\n"
      "                                     const unsigned long long* strides, unsigned box_width, unsigned box_height) {\n"
      "  void* entry = nullptr;\n"
      "  cudaDriverEntryPointQueryResult found;\n"
      "  if (cudaError_t e = cudaGetDriverEntryPointByVersion(\"cuTensorMapEncodeTiled\", &entry, 12000,\n"
      "                                                      cudaEnableDefault, &found))\n"
      "    return (int)e;\n"
      "  if (entry == nullptr || found != cudaDriverEntryPointSuccess) return (int)cudaErrorNotSupported;\n"
      "  const unsigned box[3] = {box_width, box_height, 1u}, element_strides[3] = {1u, 1u, 1u};\n"
      "  const int status = ((cudagen_encode_tiled)entry)(map, element_bytes == 2 ? 1 : 0, rank, base, dims, strides, box,\n"
      "                                                  element_strides, 0, 3, 3, 0);\n"
      "  return status == 0 ? 0 : (int)cudaErrorInvalidValue;\n"
      "}\n";
  if (two_d)
    out +=
        "static int cudagen_tensor_map_2d(cg_tensor_map* map, unsigned char* base, unsigned element_bytes,\n"
        "                                 unsigned long long width, unsigned long long height,\n"
        "                                 unsigned long long row_stride, unsigned box_width, unsigned box_height,\n"
        "                                 const char*) {\n"
        "  const unsigned long long dims[2] = {width, height}, strides[1] = {row_stride};\n"
        "  return cudagen_encode_tensor_map(map, 2u, base, element_bytes, dims, strides, box_width, box_height);\n"
        "}\n";
  if (three_d)
    out +=
        "static int cudagen_tensor_map_3d(cg_tensor_map* map, unsigned char* base, unsigned element_bytes,\n"
        "                                 unsigned long long width, unsigned long long height, unsigned long long depth,\n"
        "                                 unsigned long long row_stride, unsigned long long plane_stride,\n"
        "                                 unsigned box_width, unsigned box_height, const char*) {\n"
        "  const unsigned long long dims[3] = {width, height, depth}, strides[2] = {row_stride, plane_stride};\n"
        "  return cudagen_encode_tensor_map(map, 3u, base, element_bytes, dims, strides, box_width, box_height);\n"
        "}\n";
  return out + "#endif\n";
}

// The host launchers' grid for a persistent kernel (EmittedKernel::
// persistent_tiles): a block for each of the GPU's slots, asked of the
// device at each launch (the target's SM count is not the GPU's: an H100
// PCIe has 114, an SXM 132); the emulation's GPU has few SMs, so that its
// blocks loop over several tiles.
std::string Emitter::persistent_grid_helper() {
  return "// A persistent kernel's grid: the GPU's SMs times the blocks each holds, no more than `most`\n"
         "// (its tiles, or with stream-K the grid its workspace is for).\n"
         "#ifdef CUDAGEN_EMULATION\n"
         "static int cudagen_persistent_grid(unsigned* grid, unsigned long long most, unsigned blocks_per_sm) {\n"
         "  *grid = cudagen_emu::persistent_grid(most, blocks_per_sm);\n"
         "  return 0;\n"
         "}\n"
         "#else\n"
         "static int cudagen_persistent_grid(unsigned* grid, unsigned long long most, unsigned blocks_per_sm) {\n"
         "  int device = 0, sms = 0;\n"
         "  if (cudaError_t e = cudaGetDevice(&device)) return (int)e;\n"
         "  if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) return (int)e;\n"
         "  const unsigned long long slots = (unsigned long long)sms * blocks_per_sm;\n"
         "  *grid = (unsigned)(most < slots ? most : slots);\n"
         "  return 0;\n"
         "}\n"
         "#endif\n";
}

// The header of the ahead-of-time build (EmittedProgram::host_header).
// Tables rather than one constant per tensor: a program can walk them to
// copy every input in, and the enum gives each entry a C++ name.
std::string Emitter::host_header(const EmittedProgram& program) const {
  const std::string& P = options_.symbol_prefix;
  std::string out = fmt::format(
      "// Generated by cudagen {} from graph '{}' (hash {:016x}); do not edit.\n"
      "// The host interface of the graph's .cu file built ahead of time (nvcc, or the host\n"
      "// emulation). C++17. To run it:\n"
      "//   1. allocate one arena of {P}_arena_bytes bytes, 256-byte aligned (cudaMalloc; host\n"
      "//      memory where the .cu is built for the emulation);\n"
      "//   2. copy each input and parameter to arena + its offset ({P}_tensors), and each\n"
      "//      run-time argument to arena + its offset ({P}_scalars);\n"
      "//   3. call the phases: each launches its kernels on `stream` (null: the default stream)\n"
      "//      and returns 0, or the first CUDA error (a cudaError_t);\n"
      "//   4. copy outputs back from arena + their offset.\n"
      "{S}"
      "#pragma once\n\n"
      "struct CUstream_st;  // cudaStream_t is a CUstream_st*\n\n"
      "extern \"C\" {{\n"
      "extern const unsigned long long {P}_arena_bytes;  // {} on this plan\n",
      CUDAGEN_VERSION, comment_text(p_.graph.name), fnv1a64(write_graph(p_.graph) + options_.options_text), arena_bytes_,
      fmt::arg("P", P),
      fmt::arg("S", program.sync_bytes == 0
                        ? std::string()
                        : fmt::format("// Before step 3 the first time: zero the arena's bytes [{}, {}), counters the\n"
                                      "// kernels keep between launches ({}); they stay valid after.\n",
                                      program.sync_offset, program.sync_offset + program.sync_bytes,
                                      options_.megakernel ? "the megakernel's events" : "split-K's, stream-K's and flash attention backward's counters and sums")));
  for (Phase phase : {Phase::init, Phase::forward, Phase::backward, Phase::update}) {
    int count = 0;
    for (const auto& k : program.kernels) count += k.phase == phase;
    if (count > 0)
      out += fmt::format("int {}(unsigned char* arena, CUstream_st* stream);  // {} phase: {} launch{}\n",
                         phase_function(phase, P), to_string(phase), count, count == 1 ? "" : "es");
  }
  if (options_.step_function)
    out += fmt::format("int {}(unsigned char* arena, CUstream_st* stream);  // forward, backward, update\n",
                       step_function());
  out += "}\n\n";

  out +=
      "#ifndef CUDAGEN_HOST_TABLES_DEFINED\n"
      "#define CUDAGEN_HOST_TABLES_DEFINED\n"
      "// A tensor the program sees: an input, output or parameter (storage external), or state\n"
      "// that lives across steps (persistent: weights, optimizer moments).\n"
      "struct cudagen_host_tensor {\n"
      "  const char* name;     // task.slot\n"
      "  const char* dtype;    // f32, f16, bf16, f64, i32, i64\n"
      "  const char* storage;  // external or persistent\n"
      "  int rank;\n"
      "  long long shape[8];\n"
      "  unsigned long long offset;  // bytes from the arena's start\n"
      "  unsigned long long bytes;\n"
      "};\n"
      "// A run-time argument: 8 bytes at `offset`, zero-filled; a float is stored as a 32-bit\n"
      "// float in the first 4, an int as a 64-bit integer, a bool as a 32-bit 0 or 1. An Adam\n"
      "// `step` counts training steps from 1.\n"
      "struct cudagen_host_scalar {\n"
      "  const char* name;  // task.argument\n"
      "  const char* type;  // float, int or bool\n"
      "  unsigned long long offset;\n"
      "  double initial;    // the graph's value\n"
      "};\n"
      "#endif\n\n";

  // Entries are named by their task.slot, made C identifiers; a clash
  // (task `a_b` slot `c` against task `a` slot `b_c`) takes a suffix.
  std::set<std::string> used;
  auto identifier = [&](const std::string& name) {
    std::string id = P + "_";
    for (char c : name) id += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
    std::string unique = id;
    for (int n = 2; used.count(unique); ++n) unique = fmt::format("{}_{}", id, n);
    used.insert(unique);
    return unique;
  };
  std::vector<std::string> names, rows;
  for (size_t b = 0; b < p_.buffers.size(); ++b) {
    const BufferInfo& bi = p_.buffers[b];
    if (bi.storage != Storage::external && bi.storage != Storage::persistent) continue;
    if (bi.shape.size() > 8) continue;  // validate refuses these; the table's shape holds 8
    const PlannedBuffer& pb = plan_.buffers[b];
    names.push_back(identifier(buffer_name(int(b))));
    rows.push_back(fmt::format("    {{\"{}\", \"{}\", \"{}\", {}, {{{}}}, {}ull, {}ull}},", buffer_name(int(b)),
                               to_string(bi.dtype), to_string(bi.storage), bi.shape.size(), fmt::join(bi.shape, ", "),
                               pb.offset, pb.bytes));
  }
  out += fmt::format("enum {P}_tensor_index {{\n", fmt::arg("P", P));
  for (size_t i = 0; i < names.size(); ++i) out += fmt::format("  {},\n", names[i]);
  out += fmt::format("  {P}_tensor_count\n}};\n", fmt::arg("P", P));
  if (!rows.empty())
    out += fmt::format("inline constexpr cudagen_host_tensor {}_tensors[] = {{\n{}\n}};\n", P, fmt::join(rows, "\n"));

  names.clear();
  rows.clear();
  for (const auto& sc : plan_.scalars) {
    names.push_back(identifier(sc.name(p_)));
    rows.push_back(fmt::format("    {{\"{}\", \"{}\", {}ull, {}}},", sc.name(p_), to_string(sc.type), sc.offset,
                               json_format_double(arg_number(sc.initial))));
  }
  out += fmt::format("\nenum {P}_scalar_index {{\n", fmt::arg("P", P));
  for (const auto& n : names) out += fmt::format("  {},\n", n);
  out += fmt::format("  {P}_scalar_count\n}};\n", fmt::arg("P", P));
  if (!rows.empty())
    out += fmt::format("inline constexpr cudagen_host_scalar {}_scalars[] = {{\n{}\n}};\n", P, fmt::join(rows, "\n"));
  return out;
}

bool Emitter::aliased(size_t i, const std::vector<Pointer>& pointers) {
  const Pointer& a = pointers[i];
  for (size_t j = 0; j < pointers.size(); ++j) {
    if (j == i || !(a.written || pointers[j].written)) continue;
    const Pointer& b = pointers[j];
    if (a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes) return true;
  }
  return false;
}

// Where a kernel parameter points in the arena: [offset, offset + bytes).
std::pair<int64_t, int64_t> Emitter::arena_range(const LaunchParam& lp) const {
  if (lp.scalar != nullptr) return {lp.scalar->offset, kScalarBytes};
  if (lp.buffer < 0) return {lp.workspace_offset, lp.workspace_bytes};
  const PlannedBuffer& pb = plan_.buffers[size_t(lp.buffer)];
  return {pb.offset, pb.bytes};
}

// A kernel as two functions: `NAME_tile`, the body over one block of the
// grid (`tile`: which block, and how many there are along x), and the
// __global__ NAME that calls it with blockIdx and gridDim. The megakernel's
// dispatcher calls the same tile functions (docs/architecture.md §10), so it runs
// exactly the code the kernels do. The __global__ takes buffers as
// `T* __restrict__` (without it where two may overlap) and run-time
// arguments as `const T* __restrict__ name_arg`; the tile function's
// pointers carry no __restrict__, so that inside a megakernel, where other
// blocks write what a task reads, no load goes through the read-only cache.
std::string Emitter::kernel_functions(const std::string& comment_text, const EmittedKernel& ek,
                                      const std::vector<LaunchParam>& launch, const std::string& body) const {
  std::vector<std::string> tile_params;
  for (const LaunchParam& lp : launch) tile_params.push_back(fmt::format("{}* {}", lp.pointee, param_name(lp)));
  tile_params.push_back("cg_tile tile");
  std::string code = fmt::format("{}CG_DEVICE void {}_tile({}) {{\n{}}}\n", comment_text, ek.name,
                                 fmt::join(tile_params, ", "), body);
  if (global_wrapper_) code += global_function(ek, launch);
  return code + "\n";
}

// The parameters of a __global__: buffers as `T* __restrict__` (without it
// where two may overlap), run-time arguments as `const T* __restrict__
// name_arg`; and the names to pass on.
std::pair<std::vector<std::string>, std::vector<std::string>> Emitter::global_params(
                                                                                     const std::vector<LaunchParam>& launch) const {
  std::vector<Pointer> pointers;  // the buffers, in launch order
  for (const auto& lp : launch)
    if (lp.scalar == nullptr && !lp.tensor_map) pointers.push_back({arena_range(lp).first, arena_range(lp).second, lp.written});
  std::vector<std::string> params, names;
  for (size_t i = 0, buffer = 0; i < launch.size(); ++i) {
    const LaunchParam& lp = launch[i];
    const std::string name = param_name(lp);
    if (lp.tensor_map) {  // by value, where TMA reads it (the param space); the tile function takes its address
      params.push_back(fmt::format("const __grid_constant__ cg_tensor_map {}", name));
      names.push_back("&" + name);
      continue;
    }
    const bool restrict = lp.scalar != nullptr || !aliased(buffer++, pointers);
    params.push_back(fmt::format("{}*{} {}", lp.pointee, restrict ? " __restrict__" : "", name));
    names.push_back(name);
  }
  return {params, names};
}

// The __global__ of a kernel launched alone: its tile function on blockIdx.
std::string Emitter::global_function(const EmittedKernel& ek, const std::vector<LaunchParam>& launch) const {
  auto [params, names] = global_params(launch);
  // Folded (a grid y or z over 65535): launched as one row of blocks that
  // blockIdx.x numbers, unfolded into the tile here.
  const std::string tile = grid_is_folded(ek) ? fmt::format("cg_tile_of(blockIdx.x, {}u, {}u)", ek.grid[0], ek.grid[1])
                                              : std::string("cg_launch_tile()");
  return fmt::format("CG_KERNEL void __launch_bounds__({}) {}({}) {{\n  {}_tile({}{}{});\n}}\n",
                     launch_bounds(ek), ek.name, fmt::join(params, ", "), ek.name, fmt::join(names, ", "),
                     names.empty() ? "" : ", ", tile);
}

// The kernels of one launch are adjacent (KernelGroup::launch).
bool Emitter::alone_in_launch(const std::vector<KernelGroup>& kernels, size_t k) {
  return (k == 0 || kernels[k - 1].launch != kernels[k].launch) &&
         (k + 1 == kernels.size() || kernels[k + 1].launch != kernels[k].launch);
}

// Rule horizontal (fuse.h): the kernels of one launch as one grid, each on
// its own range of blocks, calling its tile function with the tile it
// would have had alone. Kernels of one block size only: a kernel's tiles
// in a larger block would leave threads idle, so a launch whose kernels
// differ splits by block size. Fills EmittedProgram::kernels, what the
// launchers launch.
std::string Emitter::launches(const std::vector<KernelGroup>& kernels, EmittedProgram& out) {
  std::string code;
  for (size_t first = 0; first < kernels.size();) {
    size_t end = first;
    while (end < kernels.size() && kernels[end].launch == kernels[first].launch) ++end;
    std::vector<std::vector<size_t>> batches;  // by block size, in order of first appearance
    for (size_t k = first; k < end; ++k) {
      if (auto pre = pre_launches_.find(k); pre != pre_launches_.end()) {
        out.kernels.push_back(pre->second.first);
        launched_params_.push_back(pre->second.second);
      }
      auto same_block = [&](const std::vector<size_t>& b) { return out.tile_kernels[b[0]].block == out.tile_kernels[k].block; };
      auto it = std::find_if(batches.begin(), batches.end(), same_block);
      if (it == batches.end()) batches.push_back({k});
      else it->push_back(k);
    }
    for (size_t b = 0; b < batches.size(); ++b) {
      const std::vector<size_t>& members = batches[b];
      const EmittedKernel& alone = out.tile_kernels[members[0]];
      if (members.size() == 1) {
        if (end - first > 1) code += global_function(alone, launch_params_[members[0]]) + "\n";
        out.kernels.push_back(alone);
        launched_params_.push_back(launch_params_[members[0]]);
        continue;
      }
      code += batched_launch(kernels, members, batches.size() > 1 ? fmt::format("_{}", b) : "", out);
    }
    first = end;
  }
  return code;
}

std::string Emitter::batched_launch(const std::vector<KernelGroup>& kernels, const std::vector<size_t>& members,
                                    const std::string& suffix, EmittedProgram& out) {
  const KernelGroup& head = kernels[members[0]];
  std::vector<std::string> ids;
  for (size_t m : members) ids.push_back(p_.tasks[size_t(kernels[m].tasks.front())].task->id);
  EmittedKernel lk;
  lk.name = fmt::format("h{}_{}", head.launch, fmt::join(ids.begin(), ids.begin() + long(std::min<size_t>(ids.size(), 3)), "_"));
  if (ids.size() > 3) lk.name += fmt::format("_and_{}_more", ids.size() - 3);
  for (char& c : lk.name)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  lk.name += suffix;
  lk.phase = head.phase;
  lk.block = out.tile_kernels[members[0]].block;
  std::vector<LaunchParam> params;
  std::string dispatch, ranges;
  int64_t block_begin = 0;
  // A tensor or run-time argument that several members read (a clipping
  // factor every optimizer reads, a learning rate they share) is one
  // parameter of the launch: (arena offset, pointee) -> its name.
  std::map<std::pair<int64_t, std::string>, std::string> shared;
  for (size_t i = 0; i < members.size(); ++i) {
    const EmittedKernel& tk = out.tile_kernels[members[i]];
    const int64_t tiles = int64_t(tk.grid[0]) * tk.grid[1] * tk.grid[2];
    const std::vector<LaunchParam>& own = launch_params_[members[i]];
    const bool located = tk.arg_offsets.size() == own.size();
    std::vector<std::string> args;
    for (size_t j = 0; j < own.size(); ++j) {
      const LaunchParam& lp = own[j];
      LaunchParam renamed = lp;
      renamed.name = tk.name + "_" + lp.name;
      const bool shareable = located && !lp.written && !lp.tensor_map && lp.workspace_offset < 0;
      if (shareable) {
        auto [it, first] = shared.emplace(std::make_pair(tk.arg_offsets[j], lp.pointee), param_name(renamed));
        if (!first) {
          args.push_back(it->second);
          continue;
        }
      }
      args.push_back(param_name(renamed));
      params.push_back(std::move(renamed));
      if (located) lk.arg_offsets.push_back(tk.arg_offsets[j]);
    }
    if (!located) lk.arg_offsets.insert(lk.arg_offsets.end(), tk.arg_offsets.begin(), tk.arg_offsets.end());
    args.push_back(fmt::format("cg_tile_of(block{}, {}, {})", block_begin ? fmt::format(" - {}u", block_begin) : "",
                               tk.grid[0], tk.grid[1]));
    const std::string call = fmt::format("{}_tile({});", tk.name, fmt::join(args, ", "));
    if (i + 1 < members.size())
      dispatch += fmt::format("  {}if (block < {}u)\n    {}\n", i ? "else " : "", block_begin + tiles, call);
    else
      dispatch += fmt::format("  else\n    {}\n", call);
    ranges += fmt::format("//   blocks [{}, {}): {}\n", block_begin, block_begin + tiles, tk.name);
    block_begin += tiles;
    lk.tasks.insert(lk.tasks.end(), tk.tasks.begin(), tk.tasks.end());
    lk.smem_bytes = std::max(lk.smem_bytes, tk.smem_bytes);
    if (tk.min_blocks_per_sm > 0)
      lk.min_blocks_per_sm = lk.min_blocks_per_sm > 0 ? std::min(lk.min_blocks_per_sm, tk.min_blocks_per_sm) : tk.min_blocks_per_sm;
    lk.bytes_read += tk.bytes_read;
    lk.bytes_written += tk.bytes_written;
    if (tk.flops >= 0) lk.flops = std::max<int64_t>(lk.flops, 0) + tk.flops;
    lk.ranges.insert(lk.ranges.end(), tk.ranges.begin(), tk.ranges.end());
  }
  lk.grid[0] = int(block_begin);
  // One mainloop for the model when every member runs the same one.
  lk.mainloop = out.tile_kernels[members[0]].mainloop;
  for (size_t m : members)
    if (out.tile_kernels[m].mainloop != lk.mainloop) lk.mainloop = MatmulMainloop::none;
  auto [kernel_params, unused] = global_params(params);
  std::string code = fmt::format(
      "// Launch {} ({} phase):\n"
      "// {} kernels that are independent of each other (rule horizontal) as one grid of {} blocks\n"
      "// of {} threads, {} bytes of shared memory; each runs its tile function on its own blocks,\n"
      "// with the tile it has when launched alone:\n{}"
      "CG_KERNEL void __launch_bounds__({}) {}(\n    {}) {{\n"
      "  const unsigned int block = blockIdx.x;\n{}}}\n\n",
      lk.name, to_string(lk.phase), members.size(), lk.grid[0], lk.block, lk.smem_bytes, ranges, launch_bounds(lk), lk.name,
      fmt::join(kernel_params, ",\n    "), dispatch);
  out.kernels.push_back(std::move(lk));
  launched_params_.push_back(std::move(params));
  return code;
}

int Emitter::default_megakernel_blocks(const Target& target) {
  if (target.sms > 0) return int(target.sms);
  if (target.arch == "sm_90" || target.arch == "sm_90a") return 132;  // H100 SXM, H200
  if (target.arch == "sm_80") return 108;                              // A100
  return 80;
}

std::string Emitter::megakernels(EmittedProgram& out) {
  MegakernelOptions mo;
  mo.blocks = options_.megakernel_blocks > 0 ? options_.megakernel_blocks : default_megakernel_blocks(options_.target());
  mo.break_schedule = options_.megakernel_break_schedule;
  out.megakernel_watchdog_ms = options_.megakernel_watchdog_ms;
  out.megakernel = schedule_megakernel(out.tile_kernels, mo);
  out.sync_offset = plan_.arena_bytes;
  int64_t cursor = out.sync_offset;
  std::string code;
  for (const MegakernelPhase& mp : out.megakernel) {
    const int64_t state = cursor, events = cursor + kMegakernelStateBytes;
    cursor = align_up(events + 8 * int64_t(mp.events.size()), kMegakernelStateBytes);
    out.megakernel_state_offsets.push_back(state);
    code += megakernel(mp, out.tile_kernels, state, events, out.kernels);
  }
  out.sync_bytes = align_up(cursor - out.sync_offset, plan_.alignment);
  arena_bytes_ = out.arena_bytes = plan_.arena_bytes + out.sync_bytes;
  return code;
}

std::string Emitter::megakernel(const MegakernelPhase& mp, const std::vector<EmittedKernel>& tile_kernels, int64_t state,
                                int64_t events, std::vector<EmittedKernel>& emitted) {
  EmittedKernel mk;
  mk.name = "megakernel_" + std::string(to_string(mp.phase));
  mk.phase = mp.phase;
  mk.grid[0] = mp.blocks;
  mk.block = mp.threads;
  mk.smem_bytes = mp.smem_bytes;
  mk.arg_offsets = {0};
  mk.cooperative = true;
  for (int k : mp.kernels) {
    const EmittedKernel& tk = tile_kernels[size_t(k)];
    mk.tasks.insert(mk.tasks.end(), tk.tasks.begin(), tk.tasks.end());
    mk.bytes_read += tk.bytes_read;
    mk.bytes_written += tk.bytes_written;
    if (tk.flops >= 0) mk.flops = std::max<int64_t>(mk.flops, 0) + tk.flops;
    mk.ranges.insert(mk.ranges.end(), tk.ranges.begin(), tk.ranges.end());
  }
  int joins = 0;
  for (const auto& t : mp.tasks) joins += t.kernel < 0;
  const std::string P = mk.name;
  std::string code = fmt::format(
      "// ---- {} phase as one persistent kernel (docs/architecture.md §10) ----\n"
      "// {} kernels as {} tile tasks and {} join tasks on {} blocks of {} threads; {} events.\n"
      "// Critical path {} tasks; blocks idle an estimated {:.0f}% of the phase. Block b runs tasks\n"
      "// [{P}_queue[b], {P}_queue[b + 1]) in order; `cudagen describe --megakernel` prints them.\n"
      "// Events count in the arena at {}, this phase's watchdog report at {}.\n",
      to_string(mp.phase), mp.kernels.size(), mp.tasks.size() - size_t(joins), joins, mp.blocks, mp.threads,
      mp.events.size(), mp.critical_path_tasks, 100.0 * mp.idle_fraction, events, state, fmt::arg("P", P));
  code += fmt::format("static __device__ const int {}_queue[{}] = {{{}}};\n", P, mp.queue_begin.size(),
                      fmt::join(mp.queue_begin, ", "));
  code += fmt::format("// {{kernel (the switch's case; -1: join), tile, wait event, its triggers per launch, trigger event}}\n"
                      "static __device__ const cg_megakernel_task {}_tasks[{}] = {{\n",
                      P, std::max<size_t>(mp.tasks.size(), 1));
  for (int b = 0; b < mp.blocks; ++b) {
    const int begin = mp.queue_begin[size_t(b)], end = mp.queue_begin[size_t(b) + 1];
    if (begin == end) continue;
    std::vector<std::string> row;
    for (int q = begin; q < end; ++q) {
      const MegakernelTask& t = mp.tasks[size_t(q)];
      row.push_back(fmt::format("{{{}, {}, {}, {}, {}}}", t.kernel, t.tile, t.wait, t.wait_count, t.trigger));
    }
    code += fmt::format("    // block {}\n", b);
    for (size_t i = 0; i < row.size(); i += 6)
      code += fmt::format("    {},\n", fmt::join(row.begin() + long(i), row.begin() + long(std::min(row.size(), i + 6)), ", "));
  }
  if (mp.tasks.empty()) code += "    {-1, 0, -1, 0, -1},\n";
  code += "};\n";
  code += fmt::format(
      "CG_KERNEL void __launch_bounds__({0}) {1}(unsigned char* arena) {{\n"
      "  cg_megakernel_state* state = (cg_megakernel_state*)(arena + {2});\n"
      "  unsigned long long* events = (unsigned long long*)(arena + {3});\n"
      "  const unsigned long long launch = cg_megakernel_launch(state);\n"
      "  for (int q = {1}_queue[blockIdx.x]; q < {1}_queue[blockIdx.x + 1]; ++q) {{\n"
      "    const cg_megakernel_task task = {1}_tasks[q];\n"
      "    if (!cg_megakernel_wait(state, events, task, q, launch, {4}ull)) break;  // the watchdog stopped the phase\n"
      "    switch (task.kernel) {{\n",
      mp.threads, P, state, events, uint64_t(options_.megakernel_watchdog_ms) * 1000000ull);
  for (int k : mp.kernels) {
    const EmittedKernel& tk = tile_kernels[size_t(k)];
    std::vector<std::string> args;
    for (size_t a = 0; a < launch_params_[size_t(k)].size(); ++a)
      args.push_back(fmt::format("({}*)(arena + {})", launch_params_[size_t(k)][a].pointee, tk.arg_offsets[a]));
    const int64_t tiles = megakernel_tiles(tk, mp.blocks);
    args.push_back(fmt::format("cg_tile_of(task.tile, {}, {})", tk.grid_stride ? tiles : tk.grid[0], tk.grid[1]));
    code += fmt::format("      case {}:\n        {}_tile({});\n        break;\n", k, tk.name, fmt::join(args, ", "));
  }
  code += "    }\n    cg_megakernel_trigger(events, task);\n  }\n  cg_megakernel_exit(state);\n}\n\n";
  emitted.push_back(std::move(mk));
  return code;
}

std::string Emitter::header() const {
  return fmt::format(
      "// Generated by cudagen {} from graph '{}' (hash {:016x}); do not edit.\n"
      "// Options: {}\n"
      "// One standalone file: NVRTC compiles the device part; nvcc (ahead of time) and the host\n"
      "// emulation also compile the launchers under #ifndef __CUDACC_RTC__ at the end.\n"
      "// Arena: {} bytes (lower bound {}, without reuse {}){}.\n\n",
      CUDAGEN_VERSION, comment_text(p_.graph.name), fnv1a64(write_graph(p_.graph) + options_.options_text),
      comment_text(options_.options_text),
      arena_bytes_, plan_.lower_bound, plan_.no_reuse_bytes,
      plan_.scalars.empty() ? ""
                            : fmt::format("; the {} bytes at {} hold {} run-time argument(s), the runtime writes them",
                                          plan_.scalars_bytes, plan_.scalars_offset, plan_.scalars.size()));
}

// The prelude, then exactly the template definitions the kernels' ops
// need (their closures, as the indexer found them), in the registry's
// order, where what a definition uses comes first.
std::string Emitter::prelude_and_templates() const {
  std::string out = "// ---- device prelude (templates/prelude.cuh) ----\n";
  out += embedded_template("prelude.cuh");
  if (!p_.registry.definitions().empty()) {
    out += "\n// ---- templates: what the kernels below use ----\n";
    out += template_definitions(p_.registry, needed_);
    return out + "\n// ---- kernels ----\n\n";
  }
  // A hand-written registry (--registry) names files only: copy them whole.
  for (const auto& file : template_files_) {
    out += fmt::format("\n// ---- templates/{} ----\n", file);
    out += embedded_template(file);
  }
  return out + "\n// ---- kernels ----\n\n";
}

// Per megakernel, every tensor its tile functions touch (once), for the
// emulator's bounds checks.
std::string Emitter::megakernel_tensors(const EmittedProgram& program) const {
  std::string out;
  for (size_t m = 0; m < program.megakernel.size(); ++m) {
    out += fmt::format("static const cudagen_tensor_info {}_tensors[] = {{\n", program.kernels[m].name);
    std::set<std::pair<int64_t, int64_t>> seen;  // {offset, bytes}: each once
    for (int k : program.megakernel[m].kernels) {
      const std::vector<LaunchParam>& params = launch_params_[size_t(k)];
      const std::vector<ArenaRange>& ranges = program.tile_kernels[size_t(k)].ranges;  // parallel to params
      // Named by the buffer: the tile functions reach the same one through different slots.
      for (size_t a = 0; a < params.size(); ++a)
        if (seen.insert({ranges[a].offset, ranges[a].bytes}).second) out += tensor_info_row(launch_name(params[a]), params[a]);
    }
    out += "};\n";
  }
  return out;
}

// A launch parameter's name outside its kernel: the buffer's, or the run-time argument's.
std::string Emitter::launch_name(const LaunchParam& lp) const {
  return lp.scalar != nullptr ? lp.scalar->name(p_) : lp.buffer < 0 ? lp.name : buffer_name(lp.buffer);
}

// One entry of a cudagen_tensor_info table (the emulator's bounds checks).
std::string Emitter::tensor_info_row(const std::string& slot, const LaunchParam& lp) const {
  if (lp.scalar != nullptr)
    return fmt::format("    {{\"{}\", \"{}\", {}ull, {}ull}},  // run-time argument\n", slot, launch_name(lp),
                       lp.scalar->offset, kScalarBytes);
  const auto [offset, bytes] = arena_range(lp);
  return fmt::format("    {{\"{}\", \"{}\", {}ull, {}ull}},{}\n", slot, launch_name(lp), offset, bytes,
                     lp.buffer < 0 ? "  // workspace" : "");
}

std::string Emitter::host_side(const EmittedProgram& program) const {
  const std::vector<EmittedKernel>& kernels = program.kernels;  // what the launchers launch
  std::string out =
      "#ifndef __CUDACC_RTC__\n"
      "// ---- host launchers: one per phase; each tensor is arena + OFFSET from the memory plan ----\n"
      "#ifndef CUDAGEN_TENSOR_INFO_DEFINED  // the host emulation defines it too\n"
      "struct cudagen_tensor_info {\n"
      "  const char* slot;\n"
      "  const char* buffer;\n"
      "  unsigned long long offset;\n"
      "  unsigned long long bytes;\n"
      "};\n"
      "#endif\n"
      "#ifndef CUDAGEN_LAUNCH  // nvcc; the host emulation defines its own\n"
      "#define CUDAGEN_LAUNCH(kernel, grid, block, smem, tensors, ...)       \\\n"
      "  do {                                                               \\\n"
      "    (void)tensors; /* for the emulator's bounds checks */            \\\n"
      "    /* above 48 KiB a kernel must opt in to its dynamic shared memory */ \\\n"
      "    if ((smem) > 48 * 1024)                                          \\\n"
      "      if (cudaError_t cudagen_error = cudaFuncSetAttribute(kernel,   \\\n"
      "              cudaFuncAttributeMaxDynamicSharedMemorySize, (smem)))  \\\n"
      "        return (int)cudagen_error;                                   \\\n"
      "    kernel<<<grid, block, smem, stream>>>(__VA_ARGS__);              \\\n"
      "    if (cudaError_t cudagen_error = cudaGetLastError()) return (int)cudagen_error; \\\n"
      "  } while (0)\n"
      "#endif\n";
  if (options_.megakernel)
    out +=
        "#ifndef CUDAGEN_LAUNCH_COOPERATIVE  // nvcc: all blocks resident at once\n"
        "#define CUDAGEN_LAUNCH_COOPERATIVE(kernel, grid, block, smem, tensors, arena_pointer)                 \\\n"
        "  do {                                                                                       \\\n"
        "    (void)tensors;                                                                           \\\n"
        "    unsigned char* cudagen_arena = arena_pointer;                                            \\\n"
        "    void* cudagen_args[] = {&cudagen_arena};                                                 \\\n"
        "    if ((smem) > 48 * 1024)                                                                  \\\n"
        "      cudaFuncSetAttribute((const void*)kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(smem)); \\\n"
        "    if (cudaError_t cudagen_error = cudaLaunchCooperativeKernel((const void*)kernel, grid, block, cudagen_args, \\\n"
        "                                                                (smem), stream))             \\\n"
        "      return (int)cudagen_error;                                                             \\\n"
        "  } while (0)\n"
        "#endif\n";
  auto any_map_of_rank = [&](int rank) {
    return std::any_of(kernels.begin(), kernels.end(), [&](const EmittedKernel& k) {
      return std::any_of(k.tensor_maps.begin(), k.tensor_maps.end(), [&](const auto& m) { return m.second.rank() == rank; });
    });
  };
  if (any_map_of_rank(2) || any_map_of_rank(3)) out += tensor_map_helper(any_map_of_rank(2), any_map_of_rank(3));
  if (std::any_of(kernels.begin(), kernels.end(), [](const EmittedKernel& k) { return k.persistent_tiles > 0; }))
    out += persistent_grid_helper();
  out += "\n";
  out += fmt::format("extern \"C\" const unsigned long long {}_arena_bytes = {}ull;\n\n", options_.symbol_prefix,
                     arena_bytes_);
  for (size_t i = 0; i < kernels.size() && !options_.megakernel; ++i) {
    out += fmt::format("static const cudagen_tensor_info {}_tensors[] = {{\n", kernels[i].name);
    for (const auto& lp : launched_params_[i]) out += tensor_info_row(lp.name, lp);
    out += "};\n";
  }
  if (options_.megakernel) out += megakernel_tensors(program);
  for (Phase phase : {Phase::init, Phase::forward, Phase::backward, Phase::update}) {
    bool any = false;
    for (const auto& k : kernels) any = any || k.phase == phase;
    if (!any) continue;
    out += fmt::format("\nextern \"C\" int {}(unsigned char* arena, cudaStream_t stream) {{\n",
                       phase_function(phase, options_.symbol_prefix));
    if (options_.megakernel) {
      for (const EmittedKernel& mk : program.kernels)
        if (mk.phase == phase)
          out += fmt::format("  CUDAGEN_LAUNCH_COOPERATIVE({0}, dim3({1}), dim3({2}), {3}, {0}_tensors, arena);\n",
                             mk.name, mk.grid[0], mk.block, mk.smem_bytes);
      out += "  return 0;\n}\n";
      continue;
    }
    for (size_t i = 0; i < kernels.size(); ++i) {
      if (kernels[i].phase != phase) continue;
      const EmittedKernel& ek = kernels[i];
      std::vector<std::string> args;
      for (size_t a = 0; a < launched_params_[i].size(); ++a) {
        const LaunchParam& lp = launched_params_[i][a];
        if (!lp.tensor_map) {
          args.push_back(fmt::format("({}*)(arena + {})", lp.pointee, ek.arg_offsets[a]));
          continue;
        }
        // Encoded from the arena's address at every launch: a few microseconds of host time.
        const TensorMapSpec& m = *lp.tensor_map;
        const std::string map = fmt::format("{}_{}", ek.name, lp.name);
        if (m.rank() == 3)
          out += fmt::format(
              "  cg_tensor_map {0};\n"
              "  if (int cudagen_error = cudagen_tensor_map_3d(&{0}, arena + {1}, {2}, {3}ull, {4}ull, {5}ull, {6}ull, "
              "{7}ull, {8}, {9}, \"{10}\"))\n"
              "    return cudagen_error;\n",
              map, m.tensor_offset, m.element_bytes, m.width, m.height, m.depth, m.row_stride_bytes,
              m.plane_stride_bytes, m.box_width, m.box_height, ek.name);
        else
          out += fmt::format(
              "  cg_tensor_map {0};\n"
              "  if (int cudagen_error = cudagen_tensor_map_2d(&{0}, arena + {1}, {2}, {3}ull, {4}ull, {5}ull, {6}, {7}, "
              "\"{8}\"))\n"
              "    return cudagen_error;\n",
              map, m.tensor_offset, m.element_bytes, m.width, m.height, m.row_stride_bytes, m.box_width, m.box_height,
              ek.name);
        args.push_back(map);
      }
      const auto grid = launch_grid(ek);
      std::string grid_x = std::to_string(grid[0]);
      if (ek.persistent_tiles > 0) {
        grid_x = ek.name + "_grid";
        out += fmt::format(
            "  unsigned {0};  // persistent: its blocks loop over its {1} tiles{3}\n"
            "  if (int cudagen_error = cudagen_persistent_grid(&{0}, {2}ull, {4}u)) return cudagen_error;\n",
            grid_x, ek.persistent_tiles, persistent_most_blocks(ek),
            ek.stream_k_grid > 0 ? fmt::format(", the last by stream-K on up to {} blocks", ek.stream_k_grid) : "",
            ek.min_blocks_per_sm);
      }
      out += fmt::format("  CUDAGEN_LAUNCH({}, dim3({}, {}, {}), dim3({}), {}, {}_tensors,\n                 {});\n", ek.name,
                         grid_x, grid[1], grid[2], ek.block, ek.smem_bytes, ek.name, fmt::join(args, ", "));
    }
    out += "  return 0;\n}\n";
  }
  if (options_.step_function) {
    out += fmt::format("\n// One training step: forward, backward, update.\nextern \"C\" int {}(unsigned char* arena, cudaStream_t stream) {{\n",
                       step_function());
    for (Phase phase : {Phase::forward, Phase::backward, Phase::update}) {
      bool any = false;
      for (const auto& k : kernels) any = any || k.phase == phase;
      if (any)
        out += fmt::format("  if (int error = {}(arena, stream)) return error;\n",
                           phase_function(phase, options_.symbol_prefix));
    }
    out += "  return 0;\n}\n";
  }
  return out + "#endif  // __CUDACC_RTC__\n";
}

std::string Emitter::manifest(const EmittedProgram& program) const {
  const std::vector<EmittedKernel>& kernels = program.kernels;
  std::string out = "{\n  \"format\": \"cudagen.manifest/1\",\n";
  out += fmt::format("  \"graph\": {},\n", json_quote(p_.graph.name));
  out += fmt::format("  \"graph_hash\": \"{:016x}\",\n", fnv1a64(write_graph(p_.graph) + options_.options_text));
  out += fmt::format("  \"cudagen_version\": \"{}\",\n", CUDAGEN_VERSION);
  out += fmt::format("  \"arch\": {},\n", json_quote(options_.arch));
  out += fmt::format("  \"sms\": {},\n", device_model(options_.target()).sms);  // what the tiles were chosen for
  out += fmt::format("  \"options\": {},\n", json_quote(options_.options_text));
  out += fmt::format("  \"arena_bytes\": {},\n  \"lower_bound_bytes\": {},\n", arena_bytes_, plan_.lower_bound);
  out += "  \"phases\": [";
  bool first_phase = true;
  for (Phase phase : {Phase::init, Phase::forward, Phase::backward, Phase::update}) {
    std::vector<std::string> names;
    for (const auto& k : kernels)
      if (k.phase == phase) names.push_back(json_quote(k.name));
    if (names.empty()) continue;
    out += fmt::format("{}\n    {{\"phase\": \"{}\", \"function\": \"{}\", \"kernels\": [{}]}}", first_phase ? "" : ",",
                       to_string(phase), phase_function(phase, options_.symbol_prefix), fmt::join(names, ", "));
    first_phase = false;
  }
  if (options_.step_function)
    out += fmt::format(",\n    {{\"phase\": \"step\", \"function\": \"{}\", \"runs\": [\"forward\", \"backward\", \"update\"]}}",
                       step_function());
  out += "\n  ],\n  \"kernels\": [";
  // The performance model's estimate of each (perf_model.h), recorded
  // before any GPU runs it.
  std::vector<KernelEstimate> model;
  for (const EmittedKernel& k : kernels) model.push_back(estimate_kernel(k, device_model(options_.target())));
  for (size_t i = 0; i < kernels.size(); ++i) {
    const EmittedKernel& k = kernels[i];
    std::vector<std::string> tasks;
    for (int t : k.tasks) tasks.push_back(json_quote(p_.tasks[size_t(t)].task->id));
    // The parameters passed as TMA tensor maps (by value, 128 bytes), which
    // a launcher encodes from arena + tensor_offset (docs/gemm.md).
    std::vector<std::string> maps;
    for (const auto& [arg, m] : k.tensor_maps)
      maps.push_back(fmt::format("{{\"arg\": {}, \"tensor_offset\": {}, \"element_bytes\": {}, \"width\": {}, "
                                 "\"height\": {}, \"row_stride_bytes\": {}, {}\"box\": [{}, {}], \"swizzle_bytes\": 128}}",
                                 arg, m.tensor_offset, m.element_bytes, m.width, m.height, m.row_stride_bytes,
                                 m.rank() == 3 ? fmt::format("\"depth\": {}, \"plane_stride_bytes\": {}, ", m.depth,
                                                             m.plane_stride_bytes)
                                               : std::string(),
                                 m.box_width, m.box_height));
    out += fmt::format(
        "{}\n    {{\"name\": \"{}\", \"phase\": \"{}\", \"tasks\": [{}], \"grid\": [{}, {}, {}], \"block\": {}, "
        "\"smem_bytes\": {}, \"bytes_read\": {}, \"bytes_written\": {}, \"flops\": {}, \"arg_offsets\": [{}]{}{}{}, "
        "\"model\": {{\"bound\": \"{}\", \"blocks_per_sm\": {}, \"waves\": {}, \"predicted_us\": {:.3f}}}}}",
        i ? "," : "", k.name, to_string(k.phase), fmt::join(tasks, ", "), launch_grid(k)[0], launch_grid(k)[1],
        launch_grid(k)[2], k.block,
        k.smem_bytes, k.bytes_read, k.bytes_written, k.flops < 0 ? std::string("null") : std::to_string(k.flops),
        fmt::join(k.arg_offsets, ", "),
        maps.empty() ? std::string() : fmt::format(", \"tensor_maps\": [{}]", fmt::join(maps, ", ")),
        // Its blocks loop over its tiles: a launcher sizes the grid to the GPU (persistent_grid).
        k.persistent_tiles > 0
            ? fmt::format(", \"persistent\": {{\"tiles\": {}, \"blocks_per_sm\": {}{}}}", k.persistent_tiles,
                          k.min_blocks_per_sm,
                          k.stream_k_grid > 0 ? fmt::format(", \"stream_k_grid\": {}", k.stream_k_grid) : "")
            : std::string(),
        k.cooperative ? ", \"cooperative\": true" : "", model[i].bound,
        model[i].blocks_per_sm, model[i].waves, model[i].seconds * 1e6);
  }
  if (options_.megakernel) {
    out += fmt::format("\n  ],\n  \"megakernel\": {{\"sync_offset\": {}, \"sync_bytes\": {}, \"phases\": [",
                       program.sync_offset, program.sync_bytes);
    for (size_t m = 0; m < program.megakernel.size(); ++m) {
      const MegakernelPhase& mp = program.megakernel[m];
      std::vector<std::string> names, events;
      for (int k : mp.kernels) names.push_back(json_quote(program.tile_kernels[size_t(k)].name));
      for (const auto& e : mp.events) events.push_back(fmt::format("{{\"what\": {}, \"triggers\": {}}}", json_quote(e.what), e.triggers));
      out += fmt::format(
          "{}\n    {{\"kernel\": \"{}\", \"phase\": \"{}\", \"blocks\": {}, \"tasks\": {}, \"state_offset\": {}, "
          "\"critical_path_tasks\": {}, \"tile_kernels\": [{}], \"events\": [{}]}}",
          m ? "," : "", program.kernels[m].name, to_string(mp.phase), mp.blocks, mp.tasks.size(),
          program.megakernel_state_offsets[m], mp.critical_path_tasks, fmt::join(names, ", "), fmt::join(events, ", "));
    }
    out += "]}";
    out += ",\n  \"scalars\": [";
  } else {
    out += "\n  ],\n  \"scalars\": [";
  }
  for (size_t i = 0; i < plan_.scalars.size(); ++i) {
    const PlannedScalar& sc = plan_.scalars[i];
    out += fmt::format("{}\n    {{\"name\": \"{}\", \"type\": \"{}\", \"offset\": {}, \"bytes\": {}, \"initial\": {}}}",
                       i ? "," : "", sc.name(p_), to_string(sc.type), sc.offset, kScalarBytes,
                       arg_value_to_string(sc.initial));
  }
  out += plan_.scalars.empty() ? "],\n  \"buffers\": [" : "\n  ],\n  \"buffers\": [";
  for (size_t b = 0; b < p_.buffers.size(); ++b) {
    const BufferInfo& bi = p_.buffers[b];
    const PlannedBuffer& pb = plan_.buffers[b];
    out += fmt::format(
        "{}\n    {{\"name\": \"{}\", \"dtype\": \"{}\", \"shape\": [{}], \"storage\": \"{}\", \"offset\": {}, \"bytes\": "
        "{}{}}}",
        b ? "," : "", buffer_name(int(b)), to_string(bi.dtype), fmt::join(bi.shape, ", "), to_string(bi.storage),
        pb.offset, pb.bytes,
        pb.internal ? fmt::format(", \"in_registers_of\": \"{}\"", program.tile_kernels[size_t(pb.first)].name)
                    : "");
  }
  out += "\n  ]\n}\n";
  return out;
}

}  // namespace cudagen::lowering
