// The GEMM mainloop (templates/gemm.cuh) on a GPU, beside cuBLAS in the same
// process: correctness against an f32-accumulating reference on fresh random
// bf16 data (poisoned output first), then time per shape and config (CUDA
// events, median of runs over rotating operand sets, so that L2 does not
// hold the operands between runs). Then the f32 SIMT mainloop against
// cuBLAS's SGEMM (FP32 math, no TF32) the same way, and the pipelined
// mainloop on f32 as TF32 (--allow-tf32) against cuBLAS in TF32 tensor-op
// math, on fresh f32 values (whose low mantissa bits the rounding must
// handle). Built with nvcc by bench/gemm/build.sh; run by bench/gpu_check.sh.
//
//   gemm_bench [--quick]          every shape and config of the table below (--quick: two small ones,
//                                 no cuBLAS kernel: for the sanitizers)
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../../templates/prelude.cuh"
#include "../../templates/gemm.cuh"
#include "bench_util.h"


// D (M x N, row-major, bf16) = A B; A is M x K stored K-contiguous (lda = K),
// or with A_T stored as K x M (lda = M); B is K x N stored N-contiguous (ldb
// = N), or with B_T stored as N x K (ldb = K).
template <typename Config, bool A_T, bool B_T>
__global__ void __launch_bounds__(Config::THREADS, 1)
    gemm_kernel(const cg_bf16* a, const cg_bf16* b, cg_bf16* d, cg_i64 M, cg_i64 N, cg_i64 K) {
  extern __shared__ __align__(128) unsigned char smem[];
  const cg_i64 tiles_m = (M + Config::BM - 1) / Config::BM, tiles_n = (N + Config::BN - 1) / Config::BN;
  cg_i64 tile_m, tile_n;
  cg_gemm_tile_of(blockIdx.x, tiles_m, tiles_n, 8, &tile_m, &tile_n);
  cg_gemm_accumulators<Config> acc;
  cg_gemm_mainloop<Config, cg_bf16, !A_T, B_T>(acc, a, A_T ? M : K, b, B_T ? K : N, M, N, 0, K, tile_m, tile_n,
                                               (cg_bf16*)smem);
  // The results as generated kernels store them: through shared memory, coalesced.
  cg_gemm_each_coalesced<Config>(acc, M, N, tile_m, tile_n, (float*)smem,
                                 [&](cg_i64 m, cg_i64 n, float v) { d[m * N + n] = cg_narrow<cg_bf16>(v); });
}

// The f32 SIMT mainloop as generated kernels run it (emit.cpp, simt_matmul),
// the same layouts.
template <typename Config, bool A_T, bool B_T>
__global__ void __launch_bounds__(Config::THREADS, 1)
    sgemm_kernel(const float* a, const float* b, float* d, cg_i64 M, cg_i64 N, cg_i64 K) {
  extern __shared__ __align__(128) unsigned char smem[];
  cg_sgemm_accumulators<Config> acc;
  cg_sgemm_mainloop<Config, !A_T, B_T>(acc, a, A_T ? M : K, b, B_T ? K : N, M, N, K, blockIdx.y, blockIdx.x,
                                       (float*)smem);
  cg_sgemm_each_coalesced<Config>(acc, M, N, blockIdx.y, blockIdx.x, (float*)smem,
                                  [&](cg_i64 m, cg_i64 n, float v) { d[m * N + n] = v; });
}

// f32 accumulation, one output per thread: slow and obviously right.
__global__ void reference_kernel(const cg_bf16* a, const cg_bf16* b, float* d, int M, int N, int K, bool a_t,
                                 bool b_t) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
  if (n >= N) return;
  float sum = 0.0f;
  for (int k = 0; k < K; ++k)
    sum += cg_widen(a[a_t ? (size_t)k * M + m : (size_t)m * K + k]) *
           cg_widen(b[b_t ? (size_t)n * K + k : (size_t)k * N + n]);
  d[(size_t)m * N + n] = sum;
}

struct Shape {
  const char* name;
  int M, N, K;
  bool a_t, b_t;
};

// The f32 reference: double accumulation, one output per thread.
__global__ void reference_kernel_f32(const float* a, const float* b, float* d, int M, int N, int K, bool a_t, bool b_t) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
  if (n >= N) return;
  double sum = 0.0;
  for (int k = 0; k < K; ++k)
    sum += (double)a[a_t ? (size_t)k * M + m : (size_t)m * K + k] * (double)b[b_t ? (size_t)n * K + k : (size_t)k * N + n];
  d[(size_t)m * N + n] = (float)sum;
}

// The pipelined mainloop on f32 operands as TF32, as generated kernels run it
// with --allow-tf32 (emit.cpp, pipelined_matmul).
template <typename Config, bool A_T, bool B_T>
__global__ void __launch_bounds__(Config::THREADS, 1)
    tf32_kernel(const float* a, const float* b, float* d, cg_i64 M, cg_i64 N, cg_i64 K) {
  extern __shared__ __align__(128) unsigned char smem[];
  const cg_i64 tiles_m = (M + Config::BM - 1) / Config::BM, tiles_n = (N + Config::BN - 1) / Config::BN;
  cg_i64 tile_m, tile_n;
  cg_gemm_tile_of(blockIdx.x, tiles_m, tiles_n, 8, &tile_m, &tile_n);
  cg_gemm_accumulators<Config> acc;
  cg_gemm_mainloop<Config, cg_tf32, !A_T, B_T>(acc, (const cg_tf32*)a, A_T ? M : K, (const cg_tf32*)b, B_T ? K : N, M, N,
                                               0, K, tile_m, tile_n, (cg_tf32*)smem);
  cg_gemm_each_coalesced<Config>(acc, M, N, tile_m, tile_n, (float*)smem,
                                 [&](cg_i64 m, cg_i64 n, float v) { d[m * N + n] = v; });
}

template <typename Config, bool A_T, bool B_T>
void launch_tf32_config(const float* a, const float* b, float* d, const Shape& s) {
  constexpr int smem = cg_gemm_shared<Config, cg_tf32>::bytes;
  static bool opted_in = false;
  if (!opted_in) {
    CHECK_CUDA(cudaFuncSetAttribute(tf32_kernel<Config, A_T, B_T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    opted_in = true;
  }
  const long long tiles = (long long)((s.M + Config::BM - 1) / Config::BM) * ((s.N + Config::BN - 1) / Config::BN);
  tf32_kernel<Config, A_T, B_T><<<(unsigned)tiles, Config::THREADS, smem>>>(a, b, d, s.M, s.N, s.K);
}

template <typename Config>
void launch_tf32(const float* a, const float* b, float* d, const Shape& s) {
  if (s.a_t && s.b_t) launch_tf32_config<Config, true, true>(a, b, d, s);
  else if (s.a_t) launch_tf32_config<Config, true, false>(a, b, d, s);
  else if (s.b_t) launch_tf32_config<Config, false, true>(a, b, d, s);
  else launch_tf32_config<Config, false, false>(a, b, d, s);
}

template <typename Config, bool A_T, bool B_T>
void launch_sgemm_config(const float* a, const float* b, float* d, const Shape& s) {
  constexpr int smem = Config::SHARED_BYTES;
  static bool opted_in = false;
  if (!opted_in) {
    CHECK_CUDA(cudaFuncSetAttribute(sgemm_kernel<Config, A_T, B_T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    opted_in = true;
  }
  const dim3 grid((s.N + Config::BN - 1) / Config::BN, (s.M + Config::BM - 1) / Config::BM);
  sgemm_kernel<Config, A_T, B_T><<<grid, Config::THREADS, smem>>>(a, b, d, s.M, s.N, s.K);
}

template <typename Config>
void launch_sgemm(const float* a, const float* b, float* d, const Shape& s) {
  if (s.a_t && s.b_t) launch_sgemm_config<Config, true, true>(a, b, d, s);
  else if (s.a_t) launch_sgemm_config<Config, true, false>(a, b, d, s);
  else if (s.b_t) launch_sgemm_config<Config, false, true>(a, b, d, s);
  else launch_sgemm_config<Config, false, false>(a, b, d, s);
}

struct Variant {
  const char* name;
  int threads, smem, bm, bn;
  // Launches one product on set `set`'s operands.
  void (*launch)(const cg_bf16* a, const cg_bf16* b, cg_bf16* d, const Shape& s);
};

template <typename Config, bool A_T, bool B_T>
void launch_config(const cg_bf16* a, const cg_bf16* b, cg_bf16* d, const Shape& s) {
  constexpr int smem = cg_gemm_shared<Config, cg_bf16>::bytes;
  static bool opted_in = false;
  if (!opted_in) {
    CHECK_CUDA(cudaFuncSetAttribute(gemm_kernel<Config, A_T, B_T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    opted_in = true;
  }
  const long long tiles = (long long)((s.M + Config::BM - 1) / Config::BM) * ((s.N + Config::BN - 1) / Config::BN);
  gemm_kernel<Config, A_T, B_T><<<(unsigned)tiles, Config::THREADS, smem>>>(a, b, d, s.M, s.N, s.K);
}

template <typename Config>
void launch_any(const cg_bf16* a, const cg_bf16* b, cg_bf16* d, const Shape& s) {
  if (s.a_t && s.b_t) launch_config<Config, true, true>(a, b, d, s);
  else if (s.a_t) launch_config<Config, true, false>(a, b, d, s);
  else if (s.b_t) launch_config<Config, false, true>(a, b, d, s);
  else launch_config<Config, false, false>(a, b, d, s);
}

template <int BM, int BN, int BK, int WM, int WN, int S>
Variant variant(const char* name) {
  typedef cg_gemm_config<BM, BN, BK, WM, WN, S> C;
  return {name, C::THREADS, cg_gemm_shared<C, cg_bf16>::bytes, BM, BN, &launch_any<C>};
}

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  std::vector<Shape> shapes = {
      {"square 4096^3 (NN)", 4096, 4096, 4096, false, false},
      {"square 4096^3 (NT)", 4096, 4096, 4096, false, true},
      {"square 4096^3 (TN)", 4096, 4096, 4096, true, false},
      // A GPT-2-small decoder block at B8 x T512 (4096 rows): fused QKV, the
      // attention's output projection, the MLP's two matmuls; then the weight
      // gradient of the MLP's up projection (x^T dy: A transposed).
      {"block qkv 4096x2304x768", 4096, 2304, 768, false, false},
      {"block proj 4096x768x768", 4096, 768, 768, false, false},
      {"block up 4096x3072x768", 4096, 3072, 768, false, false},
      {"block down 4096x768x3072", 4096, 768, 3072, false, false},
      {"block dW_up 768x3072x4096 (TN)", 768, 3072, 4096, true, false},
      {"odd 1000x1000x1000", 1000, 1000, 1000, false, false},
      {"skinny 64x3072x768", 64, 3072, 768, false, false},
  };
  // --quick runs under compute-sanitizer, where racecheck makes a 4096^3 product
  // take minutes: small odd products (partial tiles), two layouts, checked, barely timed.
  if (quick)
    shapes = {{"odd 1000x1000x1000", 1000, 1000, 1000, false, false},
              {"odd 1000x1000x1000 (TT)", 1000, 1000, 1000, true, true}};
  std::vector<Variant> variants = {
      variant<128, 128, 64, 2, 2, 3>("128x128x64 w2x2 s3"),
      variant<128, 256, 64, 2, 4, 3>("128x256x64 w2x4 s3"),
      variant<256, 128, 64, 4, 2, 3>("256x128x64 w4x2 s3"),
      variant<128, 128, 64, 2, 4, 4>("128x128x64 w2x4 s4"),
      variant<128, 256, 32, 2, 4, 4>("128x256x32 w2x4 s4"),
      variant<64, 64, 32, 2, 2, 4>("64x64x32 w2x2 s4"),
  };
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, sm_%d%d\n", prop.name, prop.multiProcessorCount, prop.major, prop.minor);
  cublasHandle_t handle;
  CHECK_CUBLAS(cublasCreate(&handle));

  const size_t max_elems = size_t(4096) * 4096;
  const int sets = 3;  // 3 x 64 MiB of operands rotate: more than the 50 MB L2
  cg_bf16* d;
  float* ref;
  CHECK_CUDA(cudaMalloc(&d, max_elems * 2));
  CHECK_CUDA(cudaMalloc(&ref, max_elems * 4));
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<cg_bf16*> as, bs;
  for (void* p : random_bf16_sets(sets, max_elems, rng)) as.push_back((cg_bf16*)p);
  for (void* p : random_bf16_sets(sets, max_elems, rng)) bs.push_back((cg_bf16*)p);
  std::vector<unsigned short> host(max_elems), out(max_elems);
  std::vector<float> want(max_elems);
  auto timed = [&](auto&& one) { return median_ms(quick ? 1 : 3, quick ? 1 : 15, sets, one); };
  // ||got - want|| / ||want||, or -1 when an element is not finite (unwritten: poison).
  auto relative_error = [&](const Shape& s) {
    const size_t n = size_t(s.M) * s.N;
    CHECK_CUDA(cudaMemcpy(out.data(), d, n * 2, cudaMemcpyDeviceToHost));
    double err = 0, norm = 0;
    for (size_t i = 0; i < n; ++i) {
      const double g = bf16_to_float(out[i]), w = want[i];
      if (!std::isfinite(g)) return -1.0;
      err += (g - w) * (g - w);
      norm += w * w;
    }
    return std::sqrt(err / norm);
  };

  std::printf("%-32s %-20s %9s %9s %9s %8s %10s\n", "shape", "config", "ms", "TFLOP/s", "vs cuBLAS", "rel.err",
              "cuBLAS err");
  int failures = 0;
  for (const Shape& s : shapes) {
    const double flops = 2.0 * s.M * s.N * s.K;
    reference_kernel<<<dim3((s.N + 127) / 128, s.M), 128>>>(as[0], bs[0], ref, s.M, s.N, s.K, s.a_t, s.b_t);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaMemcpy(want.data(), ref, size_t(s.M) * s.N * 4, cudaMemcpyDeviceToHost));
    // cuBLAS, row-major: D^T = B^T A^T in its column-major terms.
    const float one_f = 1.0f, zero_f = 0.0f;
    auto cublas = [&](int set) {
      CHECK_CUBLAS(cublasGemmEx(handle, s.b_t ? CUBLAS_OP_T : CUBLAS_OP_N, s.a_t ? CUBLAS_OP_T : CUBLAS_OP_N, s.N, s.M,
                                s.K, &one_f, bs[set], CUDA_R_16BF, s.b_t ? s.K : s.N, as[set], CUDA_R_16BF,
                                s.a_t ? s.M : s.K, &zero_f, d, CUDA_R_16BF, s.N, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
    };
    // --quick runs no cuBLAS kernel: the sanitizers are for ours (racecheck reports
    // cuBLAS's own asynchronous copies as hazards).
    float cublas_ms = NAN;
    if (!quick) {
      CHECK_CUDA(cudaMemset(d, 0xff, size_t(s.M) * s.N * 2));
      cublas(0);
      CHECK_CUDA(cudaDeviceSynchronize());
      const double cublas_err = relative_error(s);
      cublas_ms = timed(cublas);
      std::printf("%-32s %-20s %9.4f %9.1f %9s %8s %10.2e\n", s.name, "cuBLAS", cublas_ms, flops / cublas_ms / 1e9,
                  "1.00x", "", cublas_err);
    }
    for (const Variant& v : variants) {
      CHECK_CUDA(cudaMemset(d, 0xff, size_t(s.M) * s.N * 2));
      v.launch(as[0], bs[0], d, s);
      CHECK_CUDA(cudaGetLastError());
      CHECK_CUDA(cudaDeviceSynchronize());
      const double err = relative_error(s);
      const float ms = timed([&](int set) { v.launch(as[set], bs[set], d, s); });
      // bf16 output: rounding alone gives about 2^-9 / sqrt(3); 1e-2 is the bf16 bound (docs/architecture.md §9).
      const bool ok = err >= 0 && err < 1e-2;
      failures += !ok;
      std::printf("%-32s %-20s %9.4f %9.1f %8.2fx %8.2e %10s%s\n", s.name, v.name, ms, flops / ms / 1e9,
                  cublas_ms / ms, err, "", ok ? "" : "  WRONG");
    }
  }
  std::printf("%s\n", failures ? "FAILED: some bf16 results are wrong" : "all bf16 results within 1e-2 of the reference");

  // f32: the SIMT mainloop's two tiles against cuBLAS's SGEMM in FP32 math
  // (no TF32: the f32 bound, docs/architecture.md §9). The operands are the
  // bf16 sets widened, so the bench needs no more memory.
  std::vector<float*> fa(sets), fb(sets);
  float* fd;
  CHECK_CUDA(cudaMalloc(&fd, max_elems * 4));
  for (int set = 0; set < sets; ++set) {
    CHECK_CUDA(cudaMalloc(&fa[set], max_elems * 4));
    CHECK_CUDA(cudaMalloc(&fb[set], max_elems * 4));
    for (auto [from, to] : {std::pair<cg_bf16*, float*>{as[set], fa[set]}, {bs[set], fb[set]}}) {
      CHECK_CUDA(cudaMemcpy(host.data(), from, max_elems * 2, cudaMemcpyDeviceToHost));
      std::vector<float> widened(max_elems);
      for (size_t i = 0; i < max_elems; ++i) widened[i] = bf16_to_float(host[i]);
      CHECK_CUDA(cudaMemcpy(to, widened.data(), max_elems * 4, cudaMemcpyHostToDevice));
    }
  }
  CHECK_CUBLAS(cublasSetMathMode(handle, CUBLAS_PEDANTIC_MATH));
  struct SgemmVariant {
    const char* name;
    void (*launch)(const float*, const float*, float*, const Shape&);
  };
  const std::vector<SgemmVariant> sgemm_variants = {
      {"simt 128x128x8", &launch_sgemm<cg_sgemm_config<128, 128, 8>>},
      {"simt 64x64x8", &launch_sgemm<cg_sgemm_config<64, 64, 8>>},
  };
  std::vector<float> got(max_elems);

  std::printf("\n%-32s %-24s %9s %9s %9s %8s %10s\n", "f32 shape", "config", "ms", "TFLOP/s", "vs cuBLAS", "rel.err",
              "cuBLAS err");
  auto f32_error = [&](const Shape& s) {
    const size_t n = size_t(s.M) * s.N;
    CHECK_CUDA(cudaMemcpy(got.data(), fd, n * 4, cudaMemcpyDeviceToHost));
    double err = 0, norm = 0;
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(got[i])) return -1.0;
      err += double(got[i] - want[i]) * double(got[i] - want[i]);
      norm += double(want[i]) * double(want[i]);
    }
    return std::sqrt(err / norm);
  };
  // --quick (under compute-sanitizer): two small products, every layout between them.
  const std::vector<Shape> f32_shapes =
      quick ? std::vector<Shape>{{"odd 1000x1000x1000", 1000, 1000, 1000, false, false},
                                 {"odd 1000x1000x1000 (TT)", 1000, 1000, 1000, true, true}}
            : shapes;
  // One table of f32 products: cuBLAS (in the handle's math mode) beside
  // each variant, every result checked to `bound` (relative, Frobenius).
  auto f32_table = [&](const char* cublas_name, const std::vector<SgemmVariant>& variants, double bound) {
    int wrong = 0;
    for (const Shape& s : f32_shapes) {
      const double flops = 2.0 * s.M * s.N * s.K;
      reference_kernel_f32<<<dim3((s.N + 127) / 128, s.M), 128>>>(fa[0], fb[0], ref, s.M, s.N, s.K, s.a_t, s.b_t);
      CHECK_CUDA(cudaGetLastError());
      CHECK_CUDA(cudaMemcpy(want.data(), ref, size_t(s.M) * s.N * 4, cudaMemcpyDeviceToHost));
      const float one_f = 1.0f, zero_f = 0.0f;
      auto cublas = [&](int set) {
        CHECK_CUBLAS(cublasSgemm(handle, s.b_t ? CUBLAS_OP_T : CUBLAS_OP_N, s.a_t ? CUBLAS_OP_T : CUBLAS_OP_N, s.N, s.M,
                                 s.K, &one_f, fb[set], s.b_t ? s.K : s.N, fa[set], s.a_t ? s.M : s.K, &zero_f, fd, s.N));
      };
      float cublas_ms = NAN;  // --quick: none (see the bf16 table)
      if (!quick) {
        CHECK_CUDA(cudaMemset(fd, 0xff, size_t(s.M) * s.N * 4));
        cublas(0);
        CHECK_CUDA(cudaDeviceSynchronize());
        const double cublas_err = f32_error(s);
        cublas_ms = timed(cublas);
        std::printf("%-32s %-24s %9.4f %9.1f %9s %8s %10.2e\n", s.name, cublas_name, cublas_ms,
                    flops / cublas_ms / 1e9, "1.00x", "", cublas_err);
      }
      for (const SgemmVariant& v : variants) {
        CHECK_CUDA(cudaMemset(fd, 0xff, size_t(s.M) * s.N * 4));
        v.launch(fa[0], fb[0], fd, s);
        CHECK_CUDA(cudaGetLastError());
        CHECK_CUDA(cudaDeviceSynchronize());
        const double err = f32_error(s);
        const float ms = timed([&](int set) { v.launch(fa[set], fb[set], fd, s); });
        const bool ok = err >= 0 && err < bound;
        wrong += !ok;
        std::printf("%-32s %-24s %9.4f %9.1f %8.2fx %8.2e %10s%s\n", s.name, v.name, ms, flops / ms / 1e9,
                    cublas_ms / ms, err, "", ok ? "" : "  WRONG");
      }
    }
    return wrong;
  };
  // f32 accumulation over K: the relative error grows as about sqrt(K) 2^-24; 1e-5 is the f32 bound.
  const int f32_failures = f32_table("cuBLAS SGEMM", sgemm_variants, 1e-5);
  std::printf("%s\n", f32_failures ? "FAILED: some f32 results are wrong" : "all f32 results within 1e-5 of the reference");

  // TF32 (--allow-tf32): the tuning table's two TF32 tiles against cuBLAS in
  // TF32 tensor-op math, on fresh f32 values: widened bf16 ones would be
  // exact in TF32 and hide the rounding. Bound: f16's 5e-3 (the same 10
  // mantissa bits, docs/architecture.md §9); cuBLAS's error is printed beside.
  for (int set = 0; set < sets; ++set)
    for (float* p : {fa[set], fb[set]}) {
      for (auto& w : want) w = normal(rng);
      CHECK_CUDA(cudaMemcpy(p, want.data(), max_elems * 4, cudaMemcpyHostToDevice));
    }
  CHECK_CUBLAS(cublasSetMathMode(handle, CUBLAS_TF32_TENSOR_OP_MATH));
  const std::vector<SgemmVariant> tf32_variants = {
      {"tf32 128x128x32 w2x4 s3", &launch_tf32<cg_gemm_config<128, 128, 32, 2, 4, 3>>},
      {"tf32 64x64x16 w2x2 s4", &launch_tf32<cg_gemm_config<64, 64, 16, 2, 2, 4>>},
  };
  std::printf("\n%-32s %-24s %9s %9s %9s %8s %10s\n", "TF32 shape", "config", "ms", "TFLOP/s", "vs cuBLAS", "rel.err",
              "cuBLAS err");
  const int tf32_failures = f32_table("cuBLAS TF32", tf32_variants, 5e-3);
  std::printf("%s\n", tf32_failures ? "FAILED: some TF32 results are wrong" : "all TF32 results within 5e-3 of the reference");
  return failures + f32_failures + tf32_failures ? 1 : 0;
}
