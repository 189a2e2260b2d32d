// Host emulation of the CUDA execution model (docs/architecture.md §8).
//
// A generated .cu is compiled by the host C++ compiler with this header
// force-included (-include cudagen_emu.h): it defines what nvcc and NVRTC
// provide (the qualifiers, dim3, threadIdx, __syncthreads, shuffles,
// atomics) and the CUDAGEN_LAUNCH macro the host launchers use. Blocks run
// one after another in a seeded shuffled order; the threads of a block run as
// fibers in one OS thread and switch only at barriers, so shared memory,
// __syncthreads and warp shuffles behave as on a GPU. Every global access goes
// through cg_load/cg_store and is checked against its tensor's bounds.
#pragma once

#define CUDAGEN_EMULATION 1

#include <cmath>
#include <cstdint>
#include <cstring>

// Unqualified math calls resolve as in CUDA: exp(float) is the float overload.
using std::cos;
using std::erf;
using std::fma;
using std::exp;
using std::fabs;
using std::fmax;
using std::fmin;
using std::pow;
using std::log;
using std::sqrt;
using std::tanh;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) alignas(n)
#define __grid_constant__

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};
typedef struct CUstream_st* cudaStream_t;

// What a kernel's launch knows of each pointer argument, for bounds checks.
struct cudagen_tensor_info {
  const char* slot;
  const char* buffer;
  unsigned long long offset;
  unsigned long long bytes;
};
#define CUDAGEN_TENSOR_INFO_DEFINED 1

namespace cudagen_emu {

struct ThreadContext {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

// The running fiber's indices.
const ThreadContext& context();

void syncthreads();
// __syncthreads_or: every thread of the block gets whether any passed non-zero.
int syncthreads_or(int predicate);

// A megakernel's spin-wait (cg_megakernel_wait): suspends the thread until
// *counter >= target (true) or *stopped is set (false). When no thread of the
// launch can go on, the first waiting one gets false at once: the watchdog's
// time bound, reached deterministically.
bool wait_at_least(const unsigned long long* counter, unsigned long long target, const unsigned int* stopped);

// All lanes of the warp call it; each gets the value deposited by `src_lane`
// (its own when src_lane is outside the warp or segment).
uint64_t warp_exchange(uint64_t value, int src_lane);

unsigned char* dynamic_smem();

// cp.async as the GPU runs it, adversarially: the destination reads as
// poison until the copy lands, at a seeded random point no later than the
// cp.async.wait_group that covers it. The emulator reports a cp.async whose
// source or destination is not 16-byte aligned, lies outside its tensor or
// the block's shared memory, or overwrites bytes another thread read with no
// barrier between; and a copy never waited for.
void cp_async(void* smem_dst, const void* global_src, int src_bytes);
void cp_async_commit();
void cp_async_wait(int most_in_flight);
// Before a read of shared memory by a warp-collective load (ldmatrix): false
// (and the error recorded) where a byte is the destination of a cp.async
// that the reader's thread has not waited for, or that another thread waited
// for with no barrier since, or lies outside the block's shared memory.
bool check_shared_read(const void* smem, unsigned long long bytes);
// This lane's part of a warp-wide shared-memory request (an ldmatrix row),
// for the bank counters; cp.async notes its own.
void note_shared_request(const void* smem, unsigned bytes);

// The shared-memory window as PTX addresses it (32-bit .shared addresses):
// the block's dynamic shared memory starts at address 16, the alignment
// CUDA guarantees and no more, so a kernel that needs a 1024-byte boundary
// (the 128-byte swizzle of TMA and wgmma) must round up itself, as on a GPU.
unsigned shared_address(const void* smem);
unsigned char* shared_pointer(unsigned address);

// ---- Hopper (sm_90a): transaction barriers, TMA, wgmma ----
//
// mbarrier, exactly: init sets the arrivals a phase expects; each arrival
// counts one down, expect_tx adds bytes a phase must also receive, a TMA
// copy's landing (complete_tx) takes its bytes off; the phase completes
// when both reach zero. A wait on parity p returns once the phase of that
// parity has completed (the barrier's current phase parity differs from p).
// Reported: use before init, more arrivals or bytes than a phase expects, a
// wait that nothing will ever complete (with the barrier's state).
void mbarrier_init(void* bar, unsigned arrivals);
void mbarrier_expect_tx(void* bar, unsigned bytes);
void mbarrier_arrive(void* bar);
void mbarrier_wait(void* bar, unsigned parity);

// A TMA tensor map as the emulator reads it: what cuTensorMapEncodeTiled
// takes for a 2-D tiled map, checked against the driver's documented limits
// (a 16-byte aligned base, row strides in whole 16 bytes, boxes of 1 to 256
// elements a side whose rows are whole 16 bytes, the inner box no wider
// than the swizzle span). Returns "" or why the driver would refuse it.
enum class TensorSwizzle { none = 0, span32 = 32, span64 = 64, span128 = 128 };
const char* encode_tensor_map_2d(void* map, const void* base, unsigned element_bytes, unsigned long long width,
                                 unsigned long long height, unsigned long long row_stride_bytes, unsigned box_width,
                                 unsigned box_height, TensorSwizzle swizzle);
// The same for a 3-D map: `depth` planes of height x width elements,
// `plane_stride_bytes` apart; its boxes are one plane deep (tma_load_3d).
const char* encode_tensor_map_3d(void* map, const void* base, unsigned element_bytes, unsigned long long width,
                                 unsigned long long height, unsigned long long depth,
                                 unsigned long long row_stride_bytes, unsigned long long plane_stride_bytes,
                                 unsigned box_width, unsigned box_height, TensorSwizzle swizzle);
// A host launcher's map (the generated cudagen_tensor_map_2d): 0, or 1 with
// the launch's error set to why the driver would refuse it.
int tensor_map_2d(void* map, const void* base, unsigned element_bytes, unsigned long long width,
                  unsigned long long height, unsigned long long row_stride_bytes, unsigned box_width,
                  unsigned box_height, const char* kernel);
int tensor_map_3d(void* map, const void* base, unsigned element_bytes, unsigned long long width,
                  unsigned long long height, unsigned long long depth, unsigned long long row_stride_bytes,
                  unsigned long long plane_stride_bytes, unsigned box_width, unsigned box_height, const char* kernel);
// The emulated GPU's multiprocessors, where a launcher asks (a persistent
// kernel's grid, the generated cudagen_persistent_grid): few, so that each
// block of a persistent kernel loops over several tiles in the tests.
constexpr unsigned kMultiprocessors = 3;
// `most`: the blocks that have work (its tiles, or stream-K's grid).
inline unsigned persistent_grid(unsigned long long most, unsigned blocks_per_sm) {
  const unsigned long long slots = (unsigned long long)kMultiprocessors * (blocks_per_sm > 0 ? blocks_per_sm : 1);
  return (unsigned)(most < slots ? most : slots);
}
// cp.async.bulk.tensor.2d: the box at element (x, y) of the map into shared
// memory at `dst` (its rows of box_width elements, swizzled), elements
// outside the tensor as zeros; lands at a seeded later point, then takes
// the box's bytes (out-of-bounds ones included) off `bar`'s transactions.
// Until it lands its bytes read as poison; a wgmma or a TMA copy that
// touches them, or a copy into a stage an in-flight wgmma still reads, is
// reported.
void tma_load_2d(void* dst, const void* map, int x, int y, void* bar);
// cp.async.bulk.tensor.3d: the box at (x, y) of plane z of a 3-D map (a
// plane outside the tensor reads as zeros).
void tma_load_3d(void* dst, const void* map, int x, int y, int z, void* bar);

// wgmma.mma_async m64nNk16 with f32 accumulators, both operands in shared
// memory through their descriptors (A K-major, B K-major or with trans_b
// N-major; no swizzle or a 32, 64 or 128-byte one), f16 (bf16 = false) or
// bf16. The calling thread's n / 2
// accumulators `d` (the wgmma fragment layout: thread t of the warpgroup
// holds rows 16 (t / 32) + (t % 32) / 4 (+ 8), columns 8 j + 2 (t % 4) (+ 1))
// read as NaN until a wgmma.wait_group covers the group it is committed
// in; a later wgmma on the same accumulators chains on the pending values,
// as the tensor core does.
void wgmma(float* d, int n, unsigned long long desc_a, unsigned long long desc_b, bool scale_d, bool bf16,
           bool trans_b);
// The same with A (64 x 16) in the warpgroup's registers: each thread's 4
// registers of 16-bit pairs in mma.sync's A-fragment layout for its warp's
// 16 rows (rows g, g + 8 of lane 4 g + c at k 2c, 2c + 1 and 2c + 8, 2c + 9).
void wgmma_rs(float* d, int n, const unsigned a[4], unsigned long long desc_b, bool scale_d, bool bf16, bool trans_b);
// wgmma.fence: each batch of wgmmas (a commit group) starts with one.
void wgmma_fence();
void wgmma_commit();
void wgmma_wait(int most_in_flight);

// False (and the first error recorded) when element `index` of the tensor
// that `base` points into is out of bounds; counts the bytes otherwise.
bool check_access(const void* base, long long index, unsigned long long elem_bytes, bool write);

// A vector access (one LDG.128 / STG.128, or narrower) of `bytes` bytes at
// p: false (and the error recorded) where p is not aligned to its size, as
// the GPU requires, or lies outside its tensor; counted as one request of
// each lane otherwise, as the GPU issues it.
bool check_vector_access(const void* p, unsigned bytes, bool write);

template <typename T>
T load(const T* base, long long index) {
  return check_access(base, index, sizeof(T), false) ? base[index] : T();
}

template <typename T>
void store(T* base, long long index, T value) {
  if (check_access(base, index, sizeof(T), true)) base[index] = value;
}

// Runs `body(closure)` for every thread of the grid. Returns 0, or 1 after
// an error (see cudagen_emu_last_error).
int launch(const char* kernel, const cudagen_tensor_info* tensors, int tensor_count, unsigned char* arena, dim3 grid,
           dim3 block, unsigned long long smem_bytes, void (*body)(void*), void* closure);
// A persistent (cooperative) launch: every block runs at once, as fibers
// that also switch where a thread waits for an event.
int launch_persistent(const char* kernel, const cudagen_tensor_info* tensors, int tensor_count, unsigned char* arena,
                      dim3 grid, dim3 block, unsigned long long smem_bytes, void (*body)(void*), void* closure);

template <typename T>
T shuffle(T value, int src_lane) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = warp_exchange(bits, src_lane);
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

inline int lane_id() {
  const ThreadContext& c = context();
  unsigned linear = c.thread_idx.x + c.block_dim.x * (c.thread_idx.y + c.block_dim.y * c.thread_idx.z);
  return int(linear % 32);
}

}  // namespace cudagen_emu

// The C interface of an emulated module (what the runtime finds with dlsym).
extern "C" {
void cudagen_emu_configure(unsigned long long seed);  // the block-order seed
const char* cudagen_emu_last_error();                // "" after a launch that succeeded
int cudagen_emu_kernel_count();                       // launches recorded since the last clear
const char* cudagen_emu_kernel_stats(int i, unsigned long long* bytes_read, unsigned long long* bytes_written);
double cudagen_emu_kernel_seconds(int i);  // host CPU time of the emulated launch
// Of launch i, warp-wide requests (the k-th access of each lane): global
// loads, their 32-byte sectors, the fewest sectors their bytes need; the
// same for global stores; checked shared requests, their bank wavefronts,
// the fewest wavefronts their words need.
void cudagen_emu_kernel_counters(int i, unsigned long long counters[9]);
void cudagen_emu_kernel_grid(int i, unsigned grid[3]);  // launch i's grid, as launched
void cudagen_emu_clear_stats();
// Frees what this thread's emulator keeps between launches (fiber stacks,
// shared memory). The module's emulator is thread_local, so glibc never
// unloads the module on dlclose: without this each module ever loaded would
// keep its stacks, two memory maps each, until the process runs out of maps.
void cudagen_emu_release();
}

#define threadIdx (cudagen_emu::context().thread_idx)
#define blockIdx (cudagen_emu::context().block_idx)
#define blockDim (cudagen_emu::context().block_dim)
#define gridDim (cudagen_emu::context().grid_dim)

inline void __syncthreads() { cudagen_emu::syncthreads(); }
inline int __syncthreads_or(int predicate) { return cudagen_emu::syncthreads_or(predicate); }
// Fibers of one OS thread see each other's writes in program order.
inline void __threadfence() {}
// A warp barrier: no lane goes on before every lane of its warp has come (an
// exchange is one).
inline void __syncwarp(unsigned = 0xffffffffu) { (void)cudagen_emu::shuffle(0, cudagen_emu::lane_id()); }

// Shuffles within segments of `width` lanes, as on the GPU.
template <typename T>
T __shfl_sync(unsigned, T value, int src, int width = 32) {
  int lane = cudagen_emu::lane_id(), base = lane - lane % width;
  return cudagen_emu::shuffle(value, base + ((src % width) + width) % width);
}
template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask, int width = 32) {
  int lane = cudagen_emu::lane_id(), src = lane ^ lane_mask;
  return cudagen_emu::shuffle(value, src / width == lane / width ? src : lane);
}
template <typename T>
T __shfl_down_sync(unsigned, T value, unsigned delta, int width = 32) {
  int lane = cudagen_emu::lane_id(), src = lane + int(delta);
  return cudagen_emu::shuffle(value, src / width == lane / width ? src : lane);
}
template <typename T>
T __shfl_up_sync(unsigned, T value, unsigned delta, int width = 32) {
  int lane = cudagen_emu::lane_id(), src = lane - int(delta);
  return cudagen_emu::shuffle(value, src >= 0 && src / width == lane / width ? src : lane);
}

// Fibers switch only at barriers, so a read-modify-write is atomic here.
template <typename T>
T atomicAdd(T* address, T value) {
  T old = *address;
  *address = old + value;
  return old;
}
template <typename T>
T atomicMax(T* address, T value) {
  T old = *address;
  *address = old < value ? value : old;
  return old;
}
template <typename T>
T atomicCAS(T* address, T compare, T value) {
  T old = *address;
  if (old == compare) *address = value;
  return old;
}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, sizeof i);
  return i;
}

// The host launchers' launch: the kernel's arguments are captured by a
// lambda that every emulated thread calls.
#define CUDAGEN_LAUNCH(kernel, grid, block, smem, tensors, ...)                                                  \
  do {                                                                                                           \
    (void)stream;                                                                                                \
    auto cudagen_body = [&]() { kernel(__VA_ARGS__); };                                                          \
    if (cudagen_emu::launch(#kernel, tensors, int(sizeof(tensors) / sizeof(tensors[0])), arena, grid, block, smem, \
                            [](void* c) { (*static_cast<decltype(cudagen_body)*>(c))(); }, &cudagen_body))        \
      return 1;                                                                                                  \
  } while (0)
#define CUDAGEN_LAUNCH_COOPERATIVE(kernel, grid, block, smem, tensors, ...)                                       \
  do {                                                                                                           \
    (void)stream;                                                                                                \
    auto cudagen_body = [&]() { kernel(__VA_ARGS__); };                                                          \
    if (cudagen_emu::launch_persistent(#kernel, tensors, int(sizeof(tensors) / sizeof(tensors[0])), arena, grid,  \
                                       block, smem, [](void* c) { (*static_cast<decltype(cudagen_body)*>(c))(); }, \
                                       &cudagen_body))                                                           \
      return 1;                                                                                                  \
  } while (0)
