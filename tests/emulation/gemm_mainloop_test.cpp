// The pipelined tensor-core mainloop (templates/gemm.cuh) in the host
// emulation, which runs each PTX wrapper's emulation (cp.async landing
// asynchronously and checked, ldmatrix, mma.sync in their fragment layouts): every operand layout, f16 and bf16,
// sizes that are no multiple of any tile, K shorter than one stage, and a
// k range that starts past zero (a split of K), against a float64 product of
// the same 16-bit values. Contiguous extents are multiples of 8 elements, as
// the mainloop requires (16-byte copies); the emulator's bounds checks catch
// a chunk that would run past its tensor.
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cudagen_emu.h"
#include "emu_launch.h"
#include "half.h"
#include "prelude.cuh"
#include "gemm.cuh"

namespace {

using cudagen::testing::EmuLaunch;

struct Pair {
  float first, second;
};

struct Problem {
  long long M, N, K, k_begin;
  bool a_k_contiguous, b_k_contiguous;
};

std::string describe(const Problem& p) {
  return "M=" + std::to_string(p.M) + " N=" + std::to_string(p.N) + " K=" + std::to_string(p.K) + " k from " +
         std::to_string(p.k_begin) + (p.a_k_contiguous ? " A K-contiguous" : " A M-contiguous") +
         (p.b_k_contiguous ? ", B K-contiguous" : ", B N-contiguous");
}

// Runs the mainloop for every output tile of `p` and returns the largest
// |got - want| / (sum over k of |a b|): f32 accumulation of exact products.
template <typename Config, typename T, bool A_K, bool B_K>
double run_problem(const Problem& p, unsigned seed) {
  const long long lda = A_K ? p.K : p.M, ldb = B_K ? p.K : p.N;
  EmuLaunch l(size_t(8) << 20);
  unsigned long long at = 0;
  auto place = [&](unsigned long long bytes) {
    const unsigned long long offset = at;
    at += (bytes + 255) / 256 * 256;
    return offset;
  };
  T* a = l.tensor<T>("a", place(p.M * p.K * 2), p.M * p.K);
  T* b = l.tensor<T>("b", place(p.K * p.N * 2), p.K * p.N);
  float* d = l.tensor<float>("d", place(p.M * p.N * 4), p.M * p.N);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  for (long long i = 0; i < p.M * p.K; ++i) a[i] = cg_narrow<T>(uniform(rng));
  for (long long i = 0; i < p.K * p.N; ++i) b[i] = cg_narrow<T>(uniform(rng));
  for (long long i = 0; i < p.M * p.N; ++i) d[i] = std::nanf("");  // poison: every element must be written
  cudagen_emu_configure(seed);  // also when each cp.async lands, between its issue and its wait
  const long long tiles_m = (p.M + Config::BM - 1) / Config::BM, tiles_n = (p.N + Config::BN - 1) / Config::BN;
  const int rc = l.run("gemm", dim3(unsigned(tiles_n), unsigned(tiles_m)), dim3(Config::THREADS),
                       cg_gemm_shared<Config>::bytes, [&] {
                         cg_gemm_accumulators<Config> acc;
                         cg_gemm_mainloop<Config, T, A_K, B_K>(
                             acc, (const unsigned short*)a, lda, (const unsigned short*)b, ldb, p.M, p.N, p.k_begin,
                             p.K, blockIdx.y, blockIdx.x, (unsigned short*)cudagen_emu::dynamic_smem());
                         cg_gemm_each_pair<Config>(acc, p.M, p.N, blockIdx.y, blockIdx.x,
                                                   [&](cg_i64 m, cg_i64 n, float d0, float d1) {
                                                     if (n + 1 < p.N && (m * p.N + n) % 2 == 0) {
                                                       // one 8-byte store: whole sectors per warp
                                                       cudagen_emu::store((Pair*)d, (m * p.N + n) / 2, Pair{d0, d1});
                                                       return;
                                                     }
                                                     cudagen_emu::store(d, m * p.N + n, d0);
                                                     if (n + 1 < p.N) cudagen_emu::store(d, m * p.N + n + 1, d1);
                                                   });
                       });
  EXPECT_EQ(rc, 0) << cudagen_emu_last_error();
  double worst = 0;
  for (long long m = 0; m < p.M; ++m)
    for (long long n = 0; n < p.N; ++n) {
      double want = 0, scale = 0;
      for (long long k = p.k_begin; k < p.K; ++k) {
        const double x = cg_widen(a[A_K ? m * lda + k : k * lda + m]), y = cg_widen(b[B_K ? n * ldb + k : k * ldb + n]);
        want += x * y;
        scale += std::fabs(x * y);
      }
      const double got = d[m * p.N + n];
      if (!std::isfinite(got)) return INFINITY;  // unwritten (poison) or wrong
      worst = std::max(worst, std::fabs(got - want) / std::max(scale, 1e-30));
    }
  return worst;
}

template <typename Config, typename T>
void check_every_layout(const Problem& shape, unsigned seed) {
  for (int layout = 0; layout < 4; ++layout) {
    Problem p = shape;
    p.a_k_contiguous = layout & 1;
    p.b_k_contiguous = layout & 2;
    double err = 0;
    switch (layout) {
      case 0: err = run_problem<Config, T, false, false>(p, seed); break;
      case 1: err = run_problem<Config, T, true, false>(p, seed); break;
      case 2: err = run_problem<Config, T, false, true>(p, seed); break;
      default: err = run_problem<Config, T, true, true>(p, seed); break;
    }
    // f32 accumulation of exact products: a few ulp of f32 relative to the sum of magnitudes.
    EXPECT_LT(err, 1e-6) << describe(p) << " (seed " << seed << ")";
  }
}

typedef cg_gemm_config<64, 64, 32, 2, 2, 4> Small;  // 4 warps of 32 x 32, four stages
typedef cg_gemm_config<64, 32, 32, 2, 1, 3> Tall;   // 2 warps of 32 x 32, three stages

}  // namespace

TEST(GemmMainloop, EdgesOfEveryTileInEveryLayout) {
  const unsigned seed = std::random_device{}();
  // Two tiles by three plus partial ones; K: four k-tiles and a partial one, so the pipeline wraps.
  check_every_layout<Small, cg_bf16>({.M = 104, .N = 136, .K = 152, .k_begin = 0}, seed);
  check_every_layout<Small, cg_f16>({.M = 72, .N = 72, .K = 40, .k_begin = 0}, seed + 1);
  check_every_layout<Tall, cg_bf16>({.M = 72, .N = 40, .K = 264, .k_begin = 0}, seed + 2);
}

TEST(GemmMainloop, KShorterThanAStageAndAKRangeThatStartsLate) {
  const unsigned seed = std::random_device{}();
  check_every_layout<Small, cg_bf16>({.M = 40, .N = 24, .K = 8, .k_begin = 0}, seed);
  // k in [40, 200): the part of a split-K product, its first k-tile unaligned to BK.
  check_every_layout<Small, cg_f16>({.M = 64, .N = 64, .K = 200, .k_begin = 40}, seed + 1);
}

// The strict emulator (emulator_faults_test.cpp) on the real mainloop: each
// cp.async lands at a seeded random point before its wait, reads of a stage
// are checked against the waits and barriers, and the product is right for
// every seed.
TEST(GemmMainloop, RightWhereverTheCopiesLand) {
  for (unsigned seed : {1u, 2u, 3u}) {
    check_every_layout<Small, cg_bf16>({.M = 72, .N = 80, .K = 168, .k_begin = 0}, seed);
    check_every_layout<Tall, cg_f16>({.M = 40, .N = 40, .K = 136, .k_begin = 8}, seed);
  }
}

// The emulator's counters on the mainloop alone (its stores are 8-byte
// pairs, whole sectors): global loads within 1.1x of the fewest sectors, and
// the swizzled tiles' ldmatrix reads and cp.async writes conflict-free.
TEST(GemmMainloop, LoadsAreCoalescedAndSharedAccessesConflictFree) {
  for (int layout = 0; layout < 4; ++layout) {
    const Problem p{128, 192, 256, 0, bool(layout & 1), bool(layout & 2)};
    switch (layout) {
      case 0: run_problem<Small, cg_bf16, false, false>(p, 1); break;
      case 1: run_problem<Small, cg_bf16, true, false>(p, 1); break;
      case 2: run_problem<Small, cg_bf16, false, true>(p, 1); break;
      default: run_problem<Small, cg_bf16, true, true>(p, 1); break;
    }
    unsigned long long c[9];
    cudagen_emu_kernel_counters(cudagen_emu_kernel_count() - 1, c);
    ASSERT_GT(c[0], 0u);
    EXPECT_LE(double(c[1]), 1.1 * double(c[2])) << describe(p) << ": " << c[1] << " load sectors, ideal " << c[2]
                                                << " over " << c[0] << " requests";
    EXPECT_LE(double(c[4]), 1.1 * double(c[5])) << describe(p) << ": " << c[4] << " store sectors, ideal " << c[5];
    ASSERT_GT(c[6], 0u);
    EXPECT_EQ(c[7], c[8]) << describe(p) << ": " << c[7] << " bank wavefronts, ideal " << c[8];
  }
}

// The swizzle keeps the 8 rows an ldmatrix reads (and a warp's 16-byte
// copies) in 8 distinct 16-byte slots of the 128-byte bank line, for every
// row width the tiles use.
template <int COLS>
void expect_conflict_free() {
  typedef cg_swizzled_tile<64, COLS> Tile;
  for (int row0 = 0; row0 < 64; row0 += 8)
    for (int col = 0; col < COLS; col += 8) {
      unsigned slots = 0;
      for (int r = 0; r < 8; ++r) slots |= 1u << ((Tile::offset(row0 + r, col) * 2 / 16) % 8);
      EXPECT_EQ(slots, 0xffu) << "rows " << row0 << "-" << row0 + 7 << ", column " << col << ", " << COLS << " wide";
    }
}

TEST(GemmMainloop, SwizzledRowsOfAnLdmatrixHitEveryBankSlot) {
  expect_conflict_free<32>();
  expect_conflict_free<64>();
  expect_conflict_free<128>();
  expect_conflict_free<256>();
}
