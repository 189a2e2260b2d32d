// The Hopper mainloop (templates/gemm_sm90.cuh: TMA, mbarriers, wgmma,
// warp-specialised) on an H100 or H200, beside cuBLAS in the same process:
// D = A B in bf16 (A K-contiguous; B as a matmul stores it, K x N, or as
// B^T, N x K), each result checked
// against cuBLAS's on fresh random data (the output poisoned first), then
// timed (CUDA events, median of runs over rotating operand sets so that L2
// does not hold them) at 4096^3 and a GPT-2-small decoder block's shapes,
// with the FLOP-weighted ratio of the block. The tensor maps come from the
// driver's cuTensorMapEncodeTiled, reached through the runtime's entry-point
// query (nothing links libcuda). On a GPU without sm_90a it says so and
// exits 0. Built with nvcc by bench/gemm/build.sh; run by bench/gpu_check.sh.
//
//   hopper_bench [--quick]        every shape (--quick: two small odd ones checked against a float64
//                                 product on the host, for compute-sanitizer: no cuBLAS kernel)
#include <cublas_v2.h>
#include <cuda.h>
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
#include "../../templates/gemm_sm90.cuh"
#include "bench_util.h"


// The generator's configs: tiles of 128 rows (two consumer warpgroups, a
// block an SM) by 192 or 128 columns, and of 64 x 128 (one, two blocks an
// SM); it takes the one whose busiest SM computes the least, the wider on a
// tie (kernels.cpp's hopper_gemm_of, HopperGemm::busiest_sm_area). 128 x
// 256 (which spills) runs under --quick only, for the sanitizers. (Where the
// tiles fill less than half the SMs and the pipelined mainloop would split
// K, the generator takes that instead; no shape here is so small.)
using Wide = cg_sm90_gemm_config<4, 2>;
using Wide192 = cg_sm90_gemm_config<4, 2, 192>;
using Wide256 = cg_sm90_gemm_config<3, 2, 256>;
using Narrow = cg_sm90_gemm_config<3, 1>;
enum class Tile { wide256, wide192, wide, narrow };
static Tile generators_tile(long long M, long long N, long long sms) {
  const struct { Tile tile; long long rows, columns; } candidates[] = {
      {Tile::wide192, 128, 192}, {Tile::wide, 128, 128}, {Tile::narrow, 64, 128}};
  Tile best = Tile::wide192;
  long long least = -1;
  for (const auto& c : candidates) {
    const long long tiles = (M + c.rows - 1) / c.rows * ((N + c.columns - 1) / c.columns),
                    area = (tiles + sms - 1) / sms * c.rows * c.columns;
    if (least < 0 || area < least) best = c.tile, least = area;
  }
  return best;
}
static const char* tile_name(Tile t) {
  return t == Tile::wide256 ? "128x256" : t == Tile::wide192 ? "128x192" : t == Tile::wide ? "128x128" : "64x128";
}

// D (M x N, row-major, bf16) = A (M x K) B (B stored K x N, or N x K where
// B_K_MAJOR), persistent: a block per SM slot, each looping over tiles; with a
// stream-K workspace, the last tiles by stream-K where the kernel's rule
// finds it pays (as the generated kernels with --stream-k; the column
// "stream-K ms", against whole tiles, the generator's default).
template <typename Config, bool B_K_MAJOR>
__global__ void __launch_bounds__(Config::THREADS, Config::MIN_BLOCKS)
    hopper_kernel(const __grid_constant__ cg_tensor_map map_a, const __grid_constant__ cg_tensor_map map_b,
                  cg_bf16* d, cg_i64 M, cg_i64 N, cg_i64 K, cg_sm90_stream_k stream_k) {
  extern __shared__ __align__(128) unsigned char smem[];
  cg_gemm_sm90<Config, cg_bf16, B_K_MAJOR, Config::BN == 128>(&map_a, &map_b, M, N, K, blockIdx.x, gridDim.x, smem, stream_k,
                                           [&](cg_i64 m, cg_i64 n, float v) { d[m * N + n] = cg_narrow<cg_bf16>(v); });
}

template <typename Config>
void allow_shared_memory() {
  CHECK_CUDA(cudaFuncSetAttribute(hopper_kernel<Config, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  Config::SHARED_BYTES));
  CHECK_CUDA(cudaFuncSetAttribute(hopper_kernel<Config, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  Config::SHARED_BYTES));
}

typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// A rows x cols bf16 tensor (row-major), its box 64 columns x box_rows, the 128-byte swizzle.
static cg_tensor_map tensor_map(EncodeTiled encode, const void* base, long long rows, long long cols, unsigned box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)cols * 2};
  const cuuint32_t box[2] = {64, box_rows}, element_strides[2] = {1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled refused a %lld x %lld map: error %d\n", rows, cols, int(r));
    std::exit(1);
  }
  cg_tensor_map out;
  static_assert(sizeof(out) == sizeof(map), "a tensor map is 128 bytes");
  std::memcpy(&out, &map, sizeof map);
  return out;
}

struct Shape {
  const char* name;
  long long M, N, K;
  bool b_k_major;  // B stored N x K (B^T); else K x N, as a matmul's b
  bool block;      // one of the decoder block's, for the FLOP-weighted ratio
};

// D = A B in float64 on the host, rounded to bf16 (the --quick check).
static void host_reference(const void* a_device, const void* b_device, const Shape& s,
                           std::vector<unsigned short>& out) {
  std::vector<unsigned short> a(size_t(s.M) * s.K), b(size_t(s.K) * s.N);
  CHECK_CUDA(cudaMemcpy(a.data(), a_device, a.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(b.data(), b_device, b.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<double> row(size_t(s.N));
  for (long long m = 0; m < s.M; ++m) {
    std::fill(row.begin(), row.end(), 0.0);
    for (long long k = 0; k < s.K; ++k) {
      const double x = bf16_to_float(a[size_t(m * s.K + k)]);
      for (long long j = 0; j < s.N; ++j)
        row[size_t(j)] += x * bf16_to_float(b[size_t(s.b_k_major ? j * s.K + k : k * s.N + j)]);
    }
    for (long long j = 0; j < s.N; ++j) out[size_t(m * s.N + j)] = float_to_bf16(float(row[size_t(j)]));
  }
}

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, sm_%d%d\n", prop.name, prop.multiProcessorCount, prop.major, prop.minor);
  if (prop.major != 9 || prop.minor != 0) {
    std::printf("skipped: the Hopper mainloop needs sm_90a (compute capability 9.0)\n");
    return 0;
  }
  std::vector<Shape> shapes = {
      {"square 4096^3 (NN)", 4096, 4096, 4096, false, false},
      {"square 4096^3 (NT)", 4096, 4096, 4096, true, false},
      // A GPT-2-small decoder block at B8 x T128 (1024 rows) and at B8 x T512 (4096).
      {"block qkv 1024x2304x768", 1024, 2304, 768, false, true},
      {"block proj 1024x768x768", 1024, 768, 768, false, true},
      {"block up 1024x3072x768", 1024, 3072, 768, false, true},
      {"block down 1024x768x3072", 1024, 768, 3072, false, true},
      {"block up 4096x3072x768", 4096, 3072, 768, false, false},
      {"odd 1000x1000x1000", 1000, 1000, 1000, false, false},
  };
  if (quick)
    shapes = {{"odd 1000x1000x1000 (NN)", 1000, 1000, 1000, false, false},
              {"odd 200x136x72 (NT)", 200, 136, 72, true, false}};
  EncodeTiled encode = nullptr;
  cudaDriverEntryPointQueryResult found;
  CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void**)&encode, 12000, cudaEnableDefault,
                                              &found));
  if (encode == nullptr) {
    std::fprintf(stderr, "the driver has no cuTensorMapEncodeTiled\n");
    return 1;
  }
  allow_shared_memory<Wide>();
  allow_shared_memory<Wide192>();
  allow_shared_memory<Wide256>();
  allow_shared_memory<Narrow>();
  cublasHandle_t handle;
  CHECK_CUBLAS(cublasCreate(&handle));
  const size_t max_elems = size_t(4096) * 4096;
  const int sets = 3;  // 3 x 64 MiB of operands rotate: more than the 50 MB L2
  void *d, *ref;
  CHECK_CUDA(cudaMalloc(&d, max_elems * 2));
  CHECK_CUDA(cudaMalloc(&ref, max_elems * 2));
  // Stream-K's workspace, for either config's grid (SMs x blocks an SM): two
  // slots of a tile's f32 sums a block, two counters a block and consumer
  // warp (a stream-K tile's, under two grids of them), zeroed once.
  const size_t most_blocks = 2 * size_t(prop.multiProcessorCount);
  cg_sm90_stream_k workspace{nullptr, nullptr, (cg_i64)most_blocks};
  CHECK_CUDA(cudaMalloc(&workspace.partials, 2 * most_blocks * Narrow::BM * Narrow::BN * 4));
  CHECK_CUDA(cudaMalloc(&workspace.arrivals, 2 * most_blocks * 4 * 4));
  CHECK_CUDA(cudaMemset(workspace.arrivals, 0, 2 * most_blocks * 4 * 4));
  std::mt19937 rng(std::random_device{}());
  const std::vector<void*> as = random_bf16_sets(sets, max_elems, rng), bs = random_bf16_sets(sets, max_elems, rng);
  auto timed = [&](auto&& one) { return median_ms(quick ? 1 : 3, quick ? 1 : 15, sets, one); };
  // ms: the generator's tile; 128-col ms: tiles of 128 columns (its choice before wider ones,
  // 64 rows where 128 would not fill the GPU); SK ms: those with stream-K (--stream-k).
  std::printf("%-28s %7s %9s %9s %9s %9s %9s %11s %9s\n", "shape (bf16; NT: B^T stored)", "tile", "ms", "TFLOP/s",
              "cuBLAS ms", "vs cuBLAS", "rel.err", "128-col ms", "SK ms");
  std::vector<unsigned short> got(max_elems), want(max_elems);
  int failures = 0;
  double block_ours = 0, block_cublas = 0;
  for (const Shape& s : shapes) {
    const bool narrow = (s.N + 127) / 128 * ((s.M + 127) / 128) < prop.multiProcessorCount;
    const Tile tile = generators_tile(s.M, s.N, prop.multiProcessorCount);
    auto launch = [&](auto config, int set, bool stream_k) {
      using Config = decltype(config);
      const cg_tensor_map map_a = tensor_map(encode, as[set], s.M, s.K, Config::BM);
      const long long tiles = (s.N + Config::BN - 1) / Config::BN * ((s.M + Config::BM - 1) / Config::BM),
                      slots = (long long)prop.multiProcessorCount * Config::MIN_BLOCKS;
      // The workspace holds partial tiles of 64 rows for 2 SMs' blocks: of 128 for one each.
      const cg_sm90_stream_k ws = stream_k ? cg_sm90_stream_k{workspace.partials, workspace.arrivals, slots}
                                           : cg_sm90_stream_k{nullptr, nullptr, 0};
      // --quick (under compute-sanitizer): 3 blocks, so that each loops over tiles and the
      // sanitizers see the stages' rounds run on from one tile to the next.
      // With stream-K every slot takes part, however few the tiles.
      const dim3 grid(unsigned(quick ? 3 : stream_k ? slots : std::min(tiles, slots)));
      if (s.b_k_major)
        hopper_kernel<Config, true><<<grid, Config::THREADS, Config::SHARED_BYTES>>>(
            map_a, tensor_map(encode, bs[set], s.N, s.K, Config::BN), (cg_bf16*)d, s.M, s.N, s.K, ws);
      else
        hopper_kernel<Config, false><<<grid, Config::THREADS, Config::SHARED_BYTES>>>(
            map_a, tensor_map(encode, bs[set], s.K, s.N, 64), (cg_bf16*)d, s.M, s.N, s.K, ws);
    };
    // 0: the generator's tile; 1: 128 columns; 2: 128 columns with stream-K; 3 and 4: 128 x 256
    // and 128 x 192 whatever the generator's tile (--quick: every config under the sanitizers).
    auto ours = [&](int set, int variant = 0) {
      if ((variant == 0 && tile == Tile::wide256) || variant == 3)
        launch(Wide256(), set, false);
      else if ((variant == 0 && tile == Tile::wide192) || variant == 4)
        launch(Wide192(), set, false);
      else if (variant == 0 ? tile == Tile::narrow : narrow)
        launch(Narrow(), set, variant == 2);
      else
        launch(Wide(), set, variant == 2);
    };
    // cuBLAS, column-major: D^T (N x M) = op(B) A^T, where a row-major K x N b is B^T's column-major
    // N x K (no transpose) and a row-major N x K one needs op T.
    auto cublas = [&](int set, void* out) {
      const float one = 1.0f, zero = 0.0f;
      CHECK_CUBLAS(cublasGemmEx(handle, s.b_k_major ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, (int)s.N, (int)s.M,
                                (int)s.K, &one, bs[set], CUDA_R_16BF, s.b_k_major ? (int)s.K : (int)s.N, as[set],
                                CUDA_R_16BF, (int)s.K, &zero, out, CUDA_R_16BF, (int)s.N, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
    };
    // Each variant against cuBLAS (--quick: a float64
    // product on the host, so that the sanitizers see no cuBLAS kernel, whose own
    // asynchronous copies racecheck reports): the larger error.
    const size_t n = size_t(s.M) * s.N;
    if (quick) {
      host_reference(as[0], bs[0], s, want);
    } else {
      cublas(0, ref);
      CHECK_CUDA(cudaDeviceSynchronize());
      CHECK_CUDA(cudaMemcpy(want.data(), ref, n * 2, cudaMemcpyDeviceToHost));
    }
    double rel = 0;
    for (const int variant : {0, 1, 2, 3, 4}) {
      if (variant >= 3 && !quick) continue;
      CHECK_CUDA(cudaMemset(d, 0xff, max_elems * 2));  // poison: an unwritten element reads as NaN
      ours(0, variant);
      CHECK_CUDA(cudaDeviceSynchronize());
      CHECK_CUDA(cudaGetLastError());
      CHECK_CUDA(cudaMemcpy(got.data(), d, n * 2, cudaMemcpyDeviceToHost));
      double err = 0, norm = 0;
      bool finite = true;
      for (size_t i = 0; i < n; ++i) {
        const double g = bf16_to_float(got[i]), w = bf16_to_float(want[i]);
        finite = finite && std::isfinite(g);
        err += (g - w) * (g - w);
        norm += w * w;
      }
      rel = std::max(rel, finite ? std::sqrt(err / norm) : INFINITY);
    }
    // Both round an f32 sum to bf16: they differ by about an ulp of bf16 (2^-8) where their orders differ.
    const bool ok = rel < 8e-3;
    failures += !ok;
    const float ms = timed([&](int set) { ours(set); }),
                cublas_ms = quick ? NAN : timed([&](int set) { cublas(set, ref); }),
                columns_128_ms = timed([&](int set) { ours(set, 1); }),
                stream_k_ms = timed([&](int set) { ours(set, 2); });
    if (s.block) {
      block_ours += ms;
      block_cublas += cublas_ms;
    }
    std::printf("%-28s %7s %9.3f %9.1f %9.3f %8.2fx %9.2e %11.3f %9.3f%s\n", s.name, tile_name(tile), ms,
                2.0 * s.M * s.N * s.K / (ms * 1e-3) / 1e12, cublas_ms, cublas_ms / ms, rel, columns_128_ms, stream_k_ms,
                ok ? "" : "  WRONG");
  }
  if (block_ours > 0)
    std::printf("decoder block B8 x T128 (FLOP-weighted: its four products' time): %.3f ms, cuBLAS %.3f ms, %.2fx\n",
                block_ours, block_cublas, block_cublas / block_ours);
  if (failures > 0) std::printf("%d shapes WRONG\n", failures);
  return failures > 0 ? 1 : 0;
}
