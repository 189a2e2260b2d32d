// What the GEMM benchmarks (gemm_bench.cu, hopper_bench.cu) share: checked
// CUDA and cuBLAS calls, bf16 conversions, operand sets of random values
// that rotate so that L2 does not hold them between runs, and a median of
// timed runs.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CHECK_CUDA(call)                                                                          \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)
#define CHECK_CUBLAS(call)                                                                        \
  do {                                                                                            \
    cublasStatus_t s_ = (call);                                                                   \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                            \
      std::fprintf(stderr, "%s:%d: %s: cuBLAS status %d\n", __FILE__, __LINE__, #call, int(s_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

inline unsigned short float_to_bf16(float f) {  // round to nearest even; finite inputs
  unsigned int bits;
  std::memcpy(&bits, &f, 4);
  return (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float bf16_to_float(unsigned short h) {
  unsigned int bits = (unsigned int)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// `sets` device buffers of `elements` bf16 values each, normal(0, 1).
inline std::vector<void*> random_bf16_sets(int sets, size_t elements, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<unsigned short> host(elements);
  std::vector<void*> out(static_cast<size_t>(sets));
  for (void*& p : out) {
    CHECK_CUDA(cudaMalloc(&p, elements * 2));
    for (auto& h : host) h = float_to_bf16(normal(rng));
    CHECK_CUDA(cudaMemcpy(p, host.data(), elements * 2, cudaMemcpyHostToDevice));
  }
  return out;
}

// The median milliseconds of `runs` timed calls of one(i % sets), after
// `warm` untimed ones (CUDA events around each call).
template <typename F>
float median_ms(int warm, int runs, int sets, F&& one) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < warm; ++i) one(i % sets);
  std::vector<float> ms;
  for (int i = 0; i < runs; ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    one(i % sets);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    CHECK_CUDA(cudaGetLastError());
    float t;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}
