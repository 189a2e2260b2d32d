// cudagen device prelude: the first part of every generated .cu file.
//
// It compiles under NVRTC (no headers at all), under nvcc, and under a host
// C++ compiler with the emulation header (runtime/emu/cudagen_emu.h, which
// defines CUDAGEN_EMULATION and the CUDA built-ins). Templates use only what
// is defined here; kernels reach global memory only through cg_load/cg_store,
// so that the emulator can check every access against its tensor.

typedef long long cg_i64;

#define CG_DEVICE __device__ __forceinline__

// A generated kernel. Under NVRTC it has C linkage, so that the runtime finds
// it by its plain name in the module; where the file is compiled into a
// program (nvcc ahead of time, the host emulation) it is internal to the file
// and only its launcher is visible, so that several graphs link into one
// program without their kernel names clashing.
#ifdef __CUDACC_RTC__
#define CG_KERNEL extern "C" __global__
#else
#define CG_KERNEL static __global__
#endif

// Op annotations. CG_OP("name", "key: value", ...) sits between a template
// function's template header and its declaration and describes the op to
// the indexer (generator/indexer; the keys are in docs/templates.md), which
// reads it from Clang's AST. Every other compiler sees nothing, and the
// emitter copies the function without it.
#ifdef CUDAGEN_INDEXER
#define CG_OP(...) __attribute__((annotate("cudagen.op", __VA_ARGS__)))
#else
#define CG_OP(...)
#endif
#define CG_FLOAT_TYPES "f32 f16 bf16 f64"

// The kernel's dynamic shared memory, planned by the compiler. Templates
// declare no __shared__ of their own: the skeleton hands them a pointer.
#ifdef CUDAGEN_EMULATION
#define CG_DYNAMIC_SMEM(name) unsigned char* name = cudagen_emu::dynamic_smem()
#else
#define CG_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// A loop over a register array, unrolled on the device so that the array
// stays in registers (indexed at run time, it goes to local memory). The
// host compiler of the emulation does without.
// CG_NO_UNROLL: a loop kept rolled on the device, where unrolling it would
// cost more compile time and registers than its branch costs.
#ifdef CUDAGEN_EMULATION
#define CG_UNROLL
#define CG_NO_UNROLL
#else
#define CG_UNROLL _Pragma("unroll")
#define CG_NO_UNROLL _Pragma("unroll 1")
#endif

// f16 and bf16 as storage types: 16 bits in memory, f32 in arithmetic (the
// emitter widens what it loads and narrows what it stores, as PyTorch's
// opmath does). No cuda_fp16.h: NVRTC, nvcc and the host emulation all
// compile these. Conversions round to nearest even; on the device f16 uses
// the PTX conversions, elsewhere (and for bf16 everywhere) the same rounding
// done on the bits.
struct cg_f16 {
  unsigned short bits;
};
struct cg_bf16 {
  unsigned short bits;
};

CG_DEVICE float cg_f16_bits_to_float(unsigned short h) {
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
  unsigned int exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: shift the leading one up to the hidden bit
    exponent = 113;
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  return __int_as_float((int)bits);
#endif
}

CG_DEVICE unsigned short cg_float_to_f16_bits(float f) {
#ifdef __CUDA_ARCH__
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  const unsigned int u = (unsigned int)__float_as_int(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (unsigned short)(sign | 0x7e00u);   // NaN
  if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // from 65520 up: inf
  if (a < 0x38800000u) {                                           // below 2^-14: subnormal or zero
    const unsigned int e = a >> 23;
    if (e < 102) return (unsigned short)sign;  // below 2^-25: rounds to zero
    const unsigned int m = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
    unsigned int q = m >> shift;
    const unsigned int rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (q & 1u))) ++q;
    return (unsigned short)(sign | q);
  }
  const unsigned int rebiased = a - 0x38000000u;  // exponent bias 127 -> 15
  unsigned int q = rebiased >> 13;
  const unsigned int rest = rebiased & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (q & 1u))) ++q;  // a carry moves into the exponent, as it should
  return (unsigned short)(sign | q);
#endif
}

CG_DEVICE float cg_bf16_bits_to_float(unsigned short b) { return __int_as_float((int)((unsigned int)b << 16)); }

CG_DEVICE unsigned short cg_float_to_bf16_bits(float f) {
  unsigned int u = (unsigned int)__float_as_int(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}

// What the emitter wraps around loads and stores of 16-bit tensors.
CG_DEVICE float cg_widen(cg_f16 x) { return cg_f16_bits_to_float(x.bits); }
CG_DEVICE float cg_widen(cg_bf16 x) { return cg_bf16_bits_to_float(x.bits); }
CG_DEVICE float cg_widen(float x) { return x; }
CG_DEVICE double cg_widen(double x) { return x; }

template <typename T>
CG_DEVICE T cg_narrow(float x);  // for cg_f16 and cg_bf16 only
template <>
CG_DEVICE cg_f16 cg_narrow<cg_f16>(float x) {
  cg_f16 h;
  h.bits = cg_float_to_f16_bits(x);
  return h;
}
template <>
CG_DEVICE cg_bf16 cg_narrow<cg_bf16>(float x) {
  cg_bf16 b;
  b.bits = cg_float_to_bf16_bits(x);
  return b;
}

// Tensor cores: one warp computes D = A * B + D for a 16 x 8 x 16 tile (A
// 16 x 16 row-major, B 16 x 8 column-major, f16 or bf16, f32 accumulators),
// with the fragment layout of PTX's mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   a[i] = A[g + 8 * (i / 2 % 2)][2 * t + i % 2 + 8 * (i / 4)]   i < 8
//   b[i] = B[2 * t + i % 2 + 8 * (i / 2)][g]                       i < 4
//   d[i] = D[g + 8 * (i / 2)][2 * t + i % 2]                       i < 4
// On sm_80 and later it is the mma.sync instruction; elsewhere (older GPUs,
// the host emulation) the same layout is computed with warp shuffles, so the
// fragment code that feeds the instruction is what CI checks.
template <typename T>
CG_DEVICE void cg_mma_16x8x16_shuffle(float d[4], const T a[8], const T b[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float av[8], bv[4];
  for (int i = 0; i < 8; ++i) av[i] = cg_widen(a[i]);
  for (int i = 0; i < 4; ++i) bv[i] = cg_widen(b[i]);
  for (int k = 0; k < 16; ++k) {
    // A[row][k] of both my rows, and B[k][col] of both my columns, from the lanes that hold them.
    const int a_lane = g * 4 + (k % 8) / 2, a_reg = (k >= 8 ? 4 : 0) + (k & 1), b_reg = (k >= 8 ? 2 : 0) + (k & 1);
    const float a_top = __shfl_sync(0xffffffffu, av[a_reg], a_lane);
    const float a_bottom = __shfl_sync(0xffffffffu, av[a_reg + 2], a_lane);
    const float b_left = __shfl_sync(0xffffffffu, bv[b_reg], (2 * t) * 4 + (k % 8) / 2);
    const float b_right = __shfl_sync(0xffffffffu, bv[b_reg], (2 * t + 1) * 4 + (k % 8) / 2);
    d[0] += a_top * b_left;
    d[1] += a_top * b_right;
    d[2] += a_bottom * b_left;
    d[3] += a_bottom * b_right;
  }
}

CG_DEVICE unsigned int cg_pack_pair(unsigned short low, unsigned short high) {
  return (unsigned int)low | ((unsigned int)high << 16);
}

CG_DEVICE void cg_mma_16x8x16(float d[4], const cg_f16 a[8], const cg_f16 b[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(cg_pack_pair(a[0].bits, a[1].bits)), "r"(cg_pack_pair(a[2].bits, a[3].bits)),
        "r"(cg_pack_pair(a[4].bits, a[5].bits)), "r"(cg_pack_pair(a[6].bits, a[7].bits)),
        "r"(cg_pack_pair(b[0].bits, b[1].bits)), "r"(cg_pack_pair(b[2].bits, b[3].bits)));
#else
  cg_mma_16x8x16_shuffle(d, a, b);
#endif
}

CG_DEVICE void cg_mma_16x8x16(float d[4], const cg_bf16 a[8], const cg_bf16 b[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(cg_pack_pair(a[0].bits, a[1].bits)), "r"(cg_pack_pair(a[2].bits, a[3].bits)),
        "r"(cg_pack_pair(a[4].bits, a[5].bits)), "r"(cg_pack_pair(a[6].bits, a[7].bits)),
        "r"(cg_pack_pair(b[0].bits, b[1].bits)), "r"(cg_pack_pair(b[2].bits, b[3].bits)));
#else
  cg_mma_16x8x16_shuffle(d, a, b);
#endif
}

// Global memory. In emulation each access is checked against the bounds of
// the tensor the pointer belongs to, and counted.
template <typename T>
CG_DEVICE T cg_load(const T* base, cg_i64 i) {
#ifdef CUDAGEN_EMULATION
  return cudagen_emu::load(base, i);
#else
  return base[i];
#endif
}

template <typename T>
CG_DEVICE void cg_store(T* base, cg_i64 i, T value) {
#ifdef CUDAGEN_EMULATION
  cudagen_emu::store(base, i, value);
#else
  base[i] = value;
#endif
}

// Vectorised global access: N consecutive elements from element i, one
// access of N * sizeof(T) bytes (16 at most) on the GPU. i is a multiple of
// N and every arena buffer starts on a 256-byte boundary, so the access is
// aligned. In emulation the access is checked (its alignment too) and
// counted as the GPU issues it: one request of N * sizeof(T) bytes a lane.
template <int N, typename T>
struct cg_vector {
  T v[N];
};

template <int N, typename T>
struct __align__(N * sizeof(T)) cg_aligned_chunk {
  T v[N];
};

template <int N, typename T>
CG_DEVICE cg_vector<N, T> cg_load_vector(const T* base, cg_i64 i) {
  cg_vector<N, T> r;
#ifdef CUDAGEN_EMULATION
  const bool inside = cudagen_emu::check_vector_access(base + i, N * sizeof(T), false);
  for (int k = 0; k < N; ++k) r.v[k] = inside ? base[i + k] : T();
#else
  const cg_aligned_chunk<N, T> chunk = *reinterpret_cast<const cg_aligned_chunk<N, T>*>(base + i);
  for (int k = 0; k < N; ++k) r.v[k] = chunk.v[k];
#endif
  return r;
}

// A store of global memory. 16 bytes go out as one st.global.v4.b32 of the
// value's words: written as an aligned struct, NVVM split them (a bf16 GEMM
// tile's 16-byte row pieces became six st.global.u16 and one .v2.u16, an
// f32 depthwise output four st.global.f32), each a request of the
// load-store unit.
template <int N, typename T>
CG_DEVICE void cg_store_vector(T* base, cg_i64 i, const cg_vector<N, T>& value) {
#ifdef CUDAGEN_EMULATION
  if (cudagen_emu::check_vector_access(base + i, N * sizeof(T), true))
    for (int k = 0; k < N; ++k) base[i + k] = value.v[k];
#else
  union {  // the value's words (the CUDA compilers define this reading of a union)
    cg_aligned_chunk<N, T> chunk;
    unsigned int w[4];
  } bits;
  for (int k = 0; k < N; ++k) bits.chunk.v[k] = value.v[k];
  if constexpr (N * sizeof(T) == 16) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};"
                 :
                 : "l"(base + i), "r"(bits.w[0]), "r"(bits.w[1]), "r"(bits.w[2]), "r"(bits.w[3])
                 : "memory");
  } else {  // (8 bytes, f32 pairs, stay one st.global.v2 this way)
    *reinterpret_cast<cg_aligned_chunk<N, T>*>(base + i) = bits.chunk;
  }
#endif
}

// base[i] += value, atomically (a scatter-add); checked like a store.
template <typename T>
CG_DEVICE void cg_atomic_add(T* base, cg_i64 i, T value) {
#ifdef CUDAGEN_EMULATION
  if (cudagen_emu::check_access(base, i, sizeof(T), true)) atomicAdd(base + i, value);
#else
  atomicAdd(base + i, value);
#endif
}

// Which block of its kernel's grid a kernel body computes, and how many
// blocks the grid has along x. Every kernel is a device function over one
// tile that its __global__ wrapper calls with blockIdx and gridDim, and that
// the megakernel's dispatcher calls for each of its tile tasks (docs/architecture.md §10).
struct cg_tile {
  unsigned int x, y, z;
  unsigned int count_x;
};
CG_DEVICE cg_tile cg_launch_tile() {
  cg_tile t;
  t.x = blockIdx.x;
  t.y = blockIdx.y;
  t.z = blockIdx.z;
  t.count_x = gridDim.x;
  return t;
}
// Tile `index` of a grid of count_x x count_y x any, x fastest.
CG_DEVICE cg_tile cg_tile_of(unsigned int index, unsigned int count_x, unsigned int count_y) {
  cg_tile t;
  t.x = index % count_x;
  t.y = (index / count_x) % count_y;
  t.z = index / (count_x * count_y);
  t.count_x = count_x;
  return t;
}

// 1-D grid-stride loop bounds.
CG_DEVICE cg_i64 cg_global_thread(cg_tile tile) { return (cg_i64)tile.x * blockDim.x + threadIdx.x; }
CG_DEVICE cg_i64 cg_grid_threads(cg_tile tile) { return (cg_i64)tile.count_x * blockDim.x; }

// ---- the megakernel (docs/architecture.md §10; generator/megakernel.h) ----
// One tile task of a megakernel's constant schedule: the kernel body it runs
// (the case of the dispatcher's switch; -1: a join task, which only waits and
// triggers), the tile, the event it waits for and the one it triggers.
struct cg_megakernel_task {
  int kernel;
  unsigned int tile;
  int wait;                 // an event, or -1
  unsigned int wait_count;  // the triggers of `wait` per launch
  int trigger;              // an event, or -1
};
// Per phase, in the arena beside its event counters; zero before the first
// launch and never reset. The host reads the watchdog's report from it.
struct cg_megakernel_state {
  unsigned long long exits;  // blocks that finished, over all launches
  unsigned int stopped;      // 1 once a wait ran out of time: every block leaves
  unsigned int block, task, event;
  unsigned long long value, target;
};

CG_DEVICE unsigned long long cg_load_acquire(const unsigned long long* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  const unsigned long long v = *(const volatile unsigned long long*)p;
  __threadfence();
  return v;
#endif
}
CG_DEVICE void cg_add_release(unsigned long long* p, unsigned long long v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
#else
  __threadfence();
  atomicAdd(p, v);
#endif
}
// Counts this thread in at `*p` (adding 1) and returns the count before it,
// as one acquire-release atomic at GPU scope: it releases what this thread,
// and every thread a barrier ordered before it, stored (cumulativity), and
// acquires what the earlier arrivals released. One round trip to L2 where
// __threadfence before and after an atomicAdd (fence.sc, twice, in every
// thread that calls it) costs three.
CG_DEVICE unsigned int cg_arrive_acq_rel(unsigned int* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  unsigned int before;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(p) : "memory");
  return before;
#else
  __threadfence();
  const unsigned int before = atomicAdd(p, 1u);
  __threadfence();
  return before;
#endif
}
CG_DEVICE unsigned long long cg_nanoseconds() {
#ifdef __CUDA_ARCH__
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  return 0;
#endif
}

// Which launch of its megakernel this is, from 1. Every block of the earlier
// launches has added itself to `exits`, and at most gridDim.x - 1 blocks of
// this one can have, so the quotient is exact without any reset.
CG_DEVICE unsigned long long cg_megakernel_launch(cg_megakernel_state* state) {
  return cg_load_acquire(&state->exits) / gridDim.x + 1;
}

// Thread 0 waits until the task's event has counted wait_count x launch
// triggers; then the block goes on together. False when the megakernel has
// stopped: this wait outlasted `timeout_ns` (and is reported in `state`), or
// another block's did. In the host emulation a wait that can never end (every
// block waiting) runs out at once, so a broken schedule fails the same way
// every time instead of hanging.
CG_DEVICE bool cg_megakernel_wait(cg_megakernel_state* state, unsigned long long* events, cg_megakernel_task task,
                                  int task_index, unsigned long long launch, unsigned long long timeout_ns) {
  if (task.wait >= 0 && threadIdx.x == 0) {
    const unsigned long long target = (unsigned long long)task.wait_count * launch;
    unsigned long long* counter = events + task.wait;
    unsigned long long value = cg_load_acquire(counter);
#ifdef CUDAGEN_EMULATION
    const bool arrived = value >= target || cudagen_emu::wait_at_least(counter, target, &state->stopped);
    value = *counter;
#else
    const unsigned long long start = cg_nanoseconds();
    bool arrived = true;
    for (unsigned int sleep = 32; value < target; value = cg_load_acquire(counter)) {
      if (*(volatile unsigned int*)&state->stopped || cg_nanoseconds() - start > timeout_ns) {
        arrived = false;
        break;
      }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
      __nanosleep(sleep);
      if (sleep < 256) sleep *= 2;  // back off, but not past a quarter of a microsecond of latency
#endif
    }
#endif
    if (!arrived && atomicCAS(&state->stopped, 0u, 1u) == 0u) {  // the first to give up reports
      state->block = blockIdx.x;
      state->task = (unsigned int)task_index;
      state->event = (unsigned int)task.wait;
      state->value = value;
      state->target = target;
      __threadfence();
    }
  }
  // A barrier after thread 0's acquire, before the block reads the task's
  // inputs; thread 0's view of `stopped` decides for the whole block.
  return !__syncthreads_or(threadIdx.x == 0 && *(volatile unsigned int*)&state->stopped != 0u);
}

// After a task: once every thread of the block has written its part, one
// release-add publishes them all.
CG_DEVICE void cg_megakernel_trigger(unsigned long long* events, cg_megakernel_task task) {
  __syncthreads();
  if (task.trigger >= 0 && threadIdx.x == 0) cg_add_release(events + task.trigger, 1ull);
}

CG_DEVICE void cg_megakernel_exit(cg_megakernel_state* state) {
  __syncthreads();
  if (threadIdx.x == 0) cg_add_release(&state->exits, 1ull);
}

CG_DEVICE float cg_neg_inf() { return -__int_as_float(0x7f800000); }

// Warp reductions: every lane gets the result. Blocks are whole warps.
CG_DEVICE float cg_warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

CG_DEVICE float cg_warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Block reductions: every thread of the block calls them, and every thread
// gets the result. `scratch` holds 32 floats of shared memory.
CG_DEVICE float cg_block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = cg_warp_sum(v);
  __syncthreads();  // the previous reduction may still be reading scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return cg_warp_sum(lane < warps ? scratch[lane] : 0.0f);
}

// Column sums split across warps: a block covers 32 adjacent columns, lane l
// of every warp holding its partial sum of column l over the rows that warp
// took. Lane l of warp 0 gets the column's total, the warps' partials added
// in warp order: a fixed order, so the same bits every run. Every thread of
// the block calls it (blockDim.x a multiple of 32); `scratch` holds
// blockDim.x floats of shared memory.
CG_DEVICE float cg_sum_over_warps(float partial, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();  // the previous reduction may still be reading scratch
  scratch[warp * 32 + lane] = partial;
  __syncthreads();
  if (warp == 0)
    for (int w = 1; w < warps; ++w) partial += scratch[w * 32 + lane];
  return partial;
}

CG_DEVICE float cg_block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = cg_warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return cg_warp_max(lane < warps ? scratch[lane] : cg_neg_inf());
}
