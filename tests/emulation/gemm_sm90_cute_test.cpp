// The Hopper mainloop (templates/gemm_sm90.cuh) and its emulation checked
// against CuTe's own layouts (tests/cute_oracle: CUTLASS's headers, computed
// on the host), not against formulas written here or in the emulator: where
// a TMA box lands in shared memory, the wgmma descriptors the mainloop
// builds for each k step of A, of a K-major B and of an N-major B, where the
// emulated wgmma reads its operands from and where it puts each
// accumulator.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "cudagen_emu.h"
#include "emu_launch.h"
#include "prelude.cuh"
#include "gemm.cuh"
#include "gemm_sm90.cuh"

#ifdef CUDAGEN_HAVE_CUTE
#include "cute_oracle.h"
#endif

namespace {

#ifdef CUDAGEN_HAVE_CUTE
namespace cute = cudagen::cute_oracle;
#define REQUIRE_CUTE()
#else
#define REQUIRE_CUTE() \
  GTEST_SKIP() << "no CuTe headers: pip install nvidia-cutlass into .cache/tools-venv (scripts/dev.sh does), then reconfigure"
#endif

using cudagen::testing::EmuLaunch;

}  // namespace

// The descriptors the mainloop builds (cg_wgmma_descriptor_128b) are CuTe's
// make_gmma_desc of the same tiles, every k step of a 64-element k-tile:
// each consumer's 64 rows of a 128-row A, a K-major B of 128 rows (B stored
// N x K), and an N-major B of 128 columns in two 64-column boxes (B stored
// K x N, wgmma's transposed B), at stages of a 1024-byte aligned window.
TEST(GemmSm90Cute, TheMainloopsDescriptorsAreCutes) {
  REQUIRE_CUTE();
#ifdef CUDAGEN_HAVE_CUTE
  using Config = cg_sm90_gemm_config<4, 2>;
  for (unsigned base : {1024u, 1024u + 3 * Config::STAGE_BYTES}) {
    const unsigned b = base + Config::A_BYTES;
    for (int kk = 0; kk < Config::BK / 16; ++kk) {
      for (int consumer = 0; consumer < Config::CONSUMERS; ++consumer) {
        // The mainloop's A of consumer c: 64 * 128 bytes on from the tile's start.
        const unsigned a = base + unsigned(consumer * 64 * 128);
        EXPECT_EQ(cg_wgmma_descriptor_128b(a + 32 * kk),
                  cute::k_major_descriptor(64, base + 2u * unsigned(cute::k_major_offset(128, 64 * consumer, 0)), kk))
            << "A, consumer " << consumer << ", k step " << kk;
      }
      EXPECT_EQ(cg_wgmma_descriptor_128b(b + 32 * kk), cute::k_major_descriptor(128, b, kk)) << "K-major B, k step " << kk;
      EXPECT_EQ(cg_wgmma_descriptor_128b(b + 2048 * kk, Config::B_BYTES / 2, 1024), cute::mn_major_descriptor(b, kk))
          << "N-major B, k step " << kk;
    }
  }
#endif
}

// A TMA box with the 128-byte swizzle lands where CuTe's K-major layout puts
// each element (Layout_K_SW128_Atom: what wgmma reads through the
// descriptors above); elements past the tensor's edges are zeros, and the
// barrier still waits for the whole box's bytes. The N-major B's box: 64
// columns of 64 k rows, CuTe's MN-major layout.
TEST(GemmSm90Cute, ATmaBoxLandsWhereCutesLayoutPutsEachElement) {
  REQUIRE_CUTE();
#ifdef CUDAGEN_HAVE_CUTE
  // 100 of each row's 104 elements (a row stride must be whole 16 bytes).
  constexpr int W = 100, kStride = 104, H = 140, X = 64, Y = 66;
  for (const bool n_major : {false, true}) {
    const int box_rows = n_major ? 64 : 8;
    EmuLaunch l(size_t(1) << 17);
    cg_bf16* t = l.tensor<cg_bf16>("t", 0, kStride * H);
    float* out = l.tensor<float>("out", 32768, 64 * 64);
    for (int i = 0; i < kStride * H; ++i) t[i] = cg_narrow<cg_bf16>(float(i % 251) - 125.0f);
    cg_tensor_map map;
    EXPECT_STRNE(cudagen_emu::encode_tensor_map_2d(&map, t, 2, W, H, W * 2, 64, box_rows,
                                                   cudagen_emu::TensorSwizzle::span128), "")
        << "a 200-byte row stride";
    ASSERT_STREQ(cudagen_emu::encode_tensor_map_2d(&map, t, 2, W, H, kStride * 2, 64, box_rows,
                                                   cudagen_emu::TensorSwizzle::span128), "");
    const int rc = l.run("tma_box", dim3(1), dim3(32), 1024 + 64 * 2 * 64 + 64, [&] {
      CG_DYNAMIC_SMEM(smem);
      const unsigned int base = (cg_smem_address(smem) + 1023u) & ~1023u;
      unsigned char* box = cg_smem_pointer(base);
      unsigned long long* bar = (unsigned long long*)(box + 64 * 2 * box_rows);
      if (threadIdx.x == 0) {
        cg_mbarrier_init(bar, 1);
        cg_mbarrier_arrive_expect_tx(bar, 64 * 2 * box_rows);
        cg_tma_load_2d(box, &map, X, Y, bar);
      }
      __syncthreads();
      cg_mbarrier_wait(bar, 0);
      // Row r of the box is k row r of an N-major B (its 64 columns are n),
      // or row r of a K-major tile (its 64 elements are k).
      for (int i = (int)threadIdx.x; i < 64 * box_rows; i += 32) {
        const int r = i / 64, c = i % 64;
        const int offset = n_major ? cute::mn_major_offset(c, r) : cute::k_major_offset(8, r, c);
        cudagen_emu::store(out, i, cg_widen(((const cg_bf16*)box)[offset]));
      }
    });
    ASSERT_EQ(rc, 0) << cudagen_emu_last_error();
    for (int r = 0; r < box_rows; ++r)
      for (int c = 0; c < 64; ++c) {
        const bool inside = X + c < W && Y + r < H;
        const float want = inside ? cg_widen(t[(Y + r) * kStride + X + c]) : 0.0f;
        ASSERT_EQ(out[r * 64 + c], want) << (n_major ? "N-major" : "K-major") << " box row " << r << ", element " << c;
      }
  }
#endif
}

// The emulated wgmma reads A and B where CuTe's layouts put them and leaves
// each product where CuTe's result layout (CLayout_64x128) says thread t's
// accumulator v holds it: operands written into shared memory by CuTe's
// layouts (A K-major; B K-major, and N-major through wgmma's transpose), the
// four k steps of a k-tile through the mainloop's descriptors, against a
// float64 product of the same 16-bit values.
TEST(GemmSm90Cute, WgmmaComputesFromCutesLayoutsIntoCutesFragments) {
  REQUIRE_CUTE();
#ifdef CUDAGEN_HAVE_CUTE
  constexpr int M = 64, N = 128, K = 64;
  std::mt19937 rng(41);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<cg_bf16> a(M * K), b(K * N);  // row-major m x k, k x n
  for (cg_bf16& x : a) x = cg_narrow<cg_bf16>(uniform(rng));
  for (cg_bf16& x : b) x = cg_narrow<cg_bf16>(uniform(rng));
  for (const bool n_major : {false, true}) {
    EmuLaunch l(size_t(1) << 20);
    float* out = l.tensor<float>("out", 0, 128 * 64);
    const int rc = l.run("fragments", dim3(1), dim3(128), 1024 + M * K * 2 + N * K * 2, [&] {
      CG_DYNAMIC_SMEM(smem);
      const unsigned int base = (cg_smem_address(smem) + 1023u) & ~1023u, b_base = base + M * K * 2;
      cg_bf16* a_tile = (cg_bf16*)cg_smem_pointer(base);
      cg_bf16* b_tile = (cg_bf16*)cg_smem_pointer(b_base);
      for (int i = (int)threadIdx.x; i < M * K; i += 128) a_tile[cute::k_major_offset(64, i / K, i % K)] = a[size_t(i)];
      for (int i = (int)threadIdx.x; i < K * N; i += 128) {
        const int k = i / N, n = i % N;
        b_tile[n_major ? cute::mn_major_offset(n, k) : cute::k_major_offset(128, n, k)] = b[size_t(i)];
      }
      __syncthreads();
      float d[64];
      cg_wgmma_fence();
      for (int kk = 0; kk < K / 16; ++kk) {
        if (n_major)
          cg_wgmma_m64n128k16<1>(d, cg_wgmma_descriptor_128b(base + 32 * kk),
                                 cg_wgmma_descriptor_128b(b_base + 2048 * kk, N * K * 2 / 2, 1024), kk > 0, cg_bf16());
        else
          cg_wgmma_m64n128k16<0>(d, cg_wgmma_descriptor_128b(base + 32 * kk), cg_wgmma_descriptor_128b(b_base + 32 * kk),
                                 kk > 0, cg_bf16());
      }
      cg_wgmma_commit();
      cg_wgmma_wait<0>();
      for (int i = 0; i < 64; ++i) cudagen_emu::store(out, threadIdx.x * 64 + i, d[i]);
    });
    ASSERT_EQ(rc, 0) << cudagen_emu_last_error();
    double worst = 0;
    for (int t = 0; t < 128; ++t)
      for (int v = 0; v < 64; ++v) {
        const int index = cute::accumulator_index(t, v), m = index % M, n = index / M;
        double want = 0, scale = 0;
        for (int k = 0; k < K; ++k) {
          const double x = double(cg_widen(a[size_t(m * K + k)])) * double(cg_widen(b[size_t(k * N + n)]));
          want += x;
          scale += std::fabs(x);
        }
        const double got = out[t * 64 + v];
        worst = std::max(worst, std::isfinite(got) ? std::fabs(got - want) / scale : INFINITY);
      }
    EXPECT_LT(worst, 1e-5) << (n_major ? "N-major B" : "K-major B");
  }
#endif
}
