// cudagen device prelude: the first part of every generated .cu file.
//
// It compiles under NVRTC (no headers at all), under nvcc, and under a host
// C++ compiler with the emulation header (runtime/emu/cudagen_emu.h, which
// defines CUDAGEN_EMULATION and the CUDA built-ins). Templates use only what
// is defined here; kernels reach global memory only through cg_load/cg_store,
// so that the emulator can check every access against its tensor.

typedef long long cg_i64;

#define CG_DEVICE __device__ __forceinline__

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

// base[i] += value, atomically (a scatter-add); checked like a store.
template <typename T>
CG_DEVICE void cg_atomic_add(T* base, cg_i64 i, T value) {
#ifdef CUDAGEN_EMULATION
  if (cudagen_emu::check_access(base, i, sizeof(T), true)) atomicAdd(base + i, value);
#else
  atomicAdd(base + i, value);
#endif
}

// 1-D grid-stride loop bounds.
CG_DEVICE cg_i64 cg_global_thread() { return (cg_i64)blockIdx.x * blockDim.x + threadIdx.x; }
CG_DEVICE cg_i64 cg_grid_threads() { return (cg_i64)gridDim.x * blockDim.x; }

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

CG_DEVICE float cg_block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = cg_warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return cg_warp_max(lane < warps ? scratch[lane] : cg_neg_inf());
}
