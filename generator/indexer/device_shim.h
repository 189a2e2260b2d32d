// What the CUDA headers would declare, for the indexer's device parse of
// templates/ (clang -x cuda --cuda-device-only -nocudainc). It is also the
// list of CUDA built-ins a template may use: each has a counterpart in the
// host emulation (runtime/emu/cudagen_emu.h), so a template that compiles
// against this file also runs in CI. Using anything else is an error here.
#pragma once

#define __host__ __attribute__((host))
#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __shared__ __attribute__((shared))
#define __constant__ __attribute__((constant))
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __launch_bounds__(...) __attribute__((launch_bounds(__VA_ARGS__)))
#define __align__(n) __attribute__((aligned(n)))

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
};
extern const __device__ uint3 threadIdx;
extern const __device__ uint3 blockIdx;
extern const __device__ dim3 blockDim;
extern const __device__ dim3 gridDim;

__device__ void __syncthreads();
__device__ int __syncthreads_or(int predicate);
__device__ void __syncwarp(unsigned mask = 0xffffffffu);
__device__ void __threadfence();
__device__ void __nanosleep(unsigned ns);

template <typename T> __device__ T __shfl_sync(unsigned mask, T value, int src, int width = 32);
template <typename T> __device__ T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32);
template <typename T> __device__ T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32);
template <typename T> __device__ T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = 32);

template <typename T> __device__ T atomicAdd(T* address, T value);
template <typename T> __device__ T atomicMax(T* address, T value);
template <typename T> __device__ T atomicCAS(T* address, T compare, T value);

__device__ float __int_as_float(int i);
__device__ int __float_as_int(float f);
__device__ float rsqrtf(float x);
__device__ float cospif(float x);

// <cmath> as CUDA has it on the device: float and double overloads.
#define CG_SHIM_MATH1(name)          \
  __device__ float name##f(float x); \
  __device__ float name(float x);    \
  __device__ double name(double x);
CG_SHIM_MATH1(exp)
CG_SHIM_MATH1(log)
CG_SHIM_MATH1(sqrt)
CG_SHIM_MATH1(tanh)
CG_SHIM_MATH1(erf)
CG_SHIM_MATH1(cos)
CG_SHIM_MATH1(fabs)
CG_SHIM_MATH1(exp2)
CG_SHIM_MATH1(log2)
#undef CG_SHIM_MATH1
#define CG_SHIM_MATH2(name)                   \
  __device__ float name##f(float x, float y); \
  __device__ float name(float x, float y);    \
  __device__ double name(double x, double y);
CG_SHIM_MATH2(fmax)
CG_SHIM_MATH2(fmin)
CG_SHIM_MATH2(pow)
#undef CG_SHIM_MATH2
__device__ float fmaf(float x, float y, float z);
__device__ float fma(float x, float y, float z);
__device__ double fma(double x, double y, double z);
