// The pipelined tensor-core mainloop (templates/gemm.cuh) in the host
// emulation, which runs each PTX wrapper's emulation (cp.async landing
// asynchronously and checked, ldmatrix, mma.sync in their fragment layouts): every operand layout, f16, bf16
// and f32 as TF32,
// sizes that are no multiple of any tile, K shorter than one stage, and a
// k range that starts past zero (a split of K), against a float64 product of
// the same 16-bit values. Contiguous extents are multiples of 8 elements, as
// the mainloop requires (16-byte copies); the emulator's bounds checks catch
// a chunk that would run past its tensor.
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cudagen_emu.h"
#include "emu_launch.h"
#include "half.h"
#include "prelude.cuh"
#include "test_backend.h"
#include "gemm.cuh"

namespace {

using cudagen::testing::EmuLaunch;
using cudagen::testing::test_seed;

struct Pair {
  float first, second;
};

// An operand element from a float, and the value the tensor core multiplies:
// 16-bit values as stored; f32 ones (cg_tf32) rounded to TF32 to nearest,
// ties away from zero, as cvt.rna.tf32.f32 does (finite values).
template <typename T>
T element_of(float x) {
  return cg_narrow<T>(x);
}
template <>
cg_tf32 element_of<cg_tf32>(float x) {
  cg_tf32 e;
  std::memcpy(&e.bits, &x, 4);
  return e;
}
double multiplied(cg_f16 x) { return cg_widen(x); }
double multiplied(cg_bf16 x) { return cg_widen(x); }
double multiplied(cg_tf32 x) {
  const unsigned int magnitude = x.bits & 0x7fffffffu;
  unsigned int bits = magnitude >= 0x7f800000u ? x.bits : ((x.bits + 0x1000u) & 0xffffe000u);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

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
  T* a = l.tensor<T>("a", place(p.M * p.K * sizeof(T)), p.M * p.K);
  T* b = l.tensor<T>("b", place(p.K * p.N * sizeof(T)), p.K * p.N);
  float* d = l.tensor<float>("d", place(p.M * p.N * 4), p.M * p.N);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  for (long long i = 0; i < p.M * p.K; ++i) a[i] = element_of<T>(uniform(rng));
  for (long long i = 0; i < p.K * p.N; ++i) b[i] = element_of<T>(uniform(rng));
  for (long long i = 0; i < p.M * p.N; ++i) d[i] = std::nanf("");  // poison: every element must be written
  cudagen_emu_configure(seed);  // also when each cp.async lands, between its issue and its wait
  const long long tiles_m = (p.M + Config::BM - 1) / Config::BM, tiles_n = (p.N + Config::BN - 1) / Config::BN;
  const int rc = l.run("gemm", dim3(unsigned(tiles_n), unsigned(tiles_m)), dim3(Config::THREADS),
                       cg_gemm_shared<Config, T>::bytes, [&] {
                         cg_gemm_accumulators<Config> acc;
                         cg_gemm_mainloop<Config, T, A_K, B_K>(acc, a, lda, b, ldb, p.M, p.N, p.k_begin, p.K,
                                                               blockIdx.y, blockIdx.x,
                                                               (T*)cudagen_emu::dynamic_smem());
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
        const double x = multiplied(a[A_K ? m * lda + k : k * lda + m]), y = multiplied(b[B_K ? n * ldb + k : k * ldb + n]);
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
// TF32: the same bytes a stage, half the k.
typedef cg_gemm_config<64, 64, 16, 2, 2, 4> SmallTf32;
typedef cg_gemm_config<64, 64, 32, 2, 2, 3> DeepTf32;  // four mma k-steps a k-tile, three stages
typedef cg_gemm_config<128, 128, 32, 2, 4, 3> LargeTf32;  // 8 warps: TF32's rounding takes registers

}  // namespace

TEST(GemmMainloop, EdgesOfEveryTileInEveryLayout) {
  const unsigned seed = static_cast<unsigned>(test_seed());
  // Two tiles by three plus partial ones; K: four k-tiles and a partial one, so the pipeline wraps.
  check_every_layout<Small, cg_bf16>({.M = 104, .N = 136, .K = 152, .k_begin = 0}, seed);
  check_every_layout<Small, cg_f16>({.M = 72, .N = 72, .K = 40, .k_begin = 0}, seed + 1);
  check_every_layout<Tall, cg_bf16>({.M = 72, .N = 40, .K = 264, .k_begin = 0}, seed + 2);
}

TEST(GemmMainloop, KShorterThanAStageAndAKRangeThatStartsLate) {
  const unsigned seed = static_cast<unsigned>(test_seed());
  check_every_layout<Small, cg_bf16>({.M = 40, .N = 24, .K = 8, .k_begin = 0}, seed);
  // k in [40, 200): the part of a split-K product, its first k-tile unaligned to BK.
  check_every_layout<Small, cg_f16>({.M = 64, .N = 64, .K = 200, .k_begin = 40}, seed + 1);
}

// f32 operands as TF32 (--allow-tf32): the K-contiguous ones through
// ldmatrix (a 16-byte row is four f32), the M- and N-contiguous ones through
// 32-bit shared loads (ldmatrix.trans would move 16-bit halves), every
// fragment rounded to TF32 before m16n8k8. Held to f32 accumulation of the
// TF32-rounded values' exact products: a fragment layout off by one value,
// or a fragment left unrounded (the tensor core truncates), is far outside.
TEST(GemmMainloop, Tf32InEveryLayoutAndAtTheEdges) {
  const unsigned seed = static_cast<unsigned>(test_seed());
  check_every_layout<SmallTf32, cg_tf32>({.M = 104, .N = 136, .K = 76, .k_begin = 0}, seed);
  check_every_layout<DeepTf32, cg_tf32>({.M = 72, .N = 40, .K = 132, .k_begin = 0}, seed + 1);
  check_every_layout<SmallTf32, cg_tf32>({.M = 40, .N = 24, .K = 4, .k_begin = 0}, seed + 2);  // K under a stage
  check_every_layout<SmallTf32, cg_tf32>({.M = 64, .N = 64, .K = 100, .k_begin = 20}, seed + 3);  // a split's part
  check_every_layout<LargeTf32, cg_tf32>({.M = 136, .N = 132, .K = 100, .k_begin = 0}, seed + 4);
}

// The strict emulator (emulator_faults_test.cpp) on the real mainloop: each
// cp.async lands at a seeded random point before its wait, reads of a stage
// are checked against the waits and barriers, and the product is right for
// every seed.
TEST(GemmMainloop, RightWhereverTheCopiesLand) {
  for (unsigned seed : {1u, 2u, 3u}) {
    check_every_layout<Small, cg_bf16>({.M = 72, .N = 80, .K = 168, .k_begin = 0}, seed);
    check_every_layout<Tall, cg_f16>({.M = 40, .N = 40, .K = 136, .k_begin = 8}, seed);
    check_every_layout<SmallTf32, cg_tf32>({.M = 72, .N = 80, .K = 84, .k_begin = 0}, seed);
  }
}

// The emulator's counters on the mainloop alone (its stores are 8-byte
// pairs, whole sectors): global loads within 1.1x of the fewest sectors, and
// the swizzled tiles' ldmatrix reads and cp.async writes conflict-free.
template <typename Config, typename T>
void expect_coalesced_and_conflict_free(const char* what) {
  for (int layout = 0; layout < 4; ++layout) {
    const Problem p{128, 192, 256, 0, bool(layout & 1), bool(layout & 2)};
    SCOPED_TRACE(what);
    switch (layout) {
      case 0: run_problem<Config, T, false, false>(p, 1); break;
      case 1: run_problem<Config, T, true, false>(p, 1); break;
      case 2: run_problem<Config, T, false, true>(p, 1); break;
      default: run_problem<Config, T, true, true>(p, 1); break;
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

TEST(GemmMainloop, LoadsAreCoalescedAndSharedAccessesConflictFree) {
  expect_coalesced_and_conflict_free<Small, cg_bf16>("bf16, 64 x 64 x 32");
  // TF32's 32-bit fragment loads of M- and N-contiguous tiles included.
  expect_coalesced_and_conflict_free<SmallTf32, cg_tf32>("TF32, 64 x 64 x 16");
  expect_coalesced_and_conflict_free<LargeTf32, cg_tf32>("TF32, 128 x 128 x 32");
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

// A TF32 tile read by 32-bit loads ([BK][MN], MN 32 to 128 floats): a warp's
// fragment load reads 8 consecutive columns (from a multiple of 8) of 4
// consecutive rows (from a multiple of 4), and must find 32 distinct banks;
// every 8 rows of one chunk still take the 8 slots of a bank line.
template <int COLS>
void expect_paired_reads_conflict_free() {
  typedef cg_swizzled_tile<32, COLS, 4, true> Tile;
  for (int row0 = 0; row0 < 32; row0 += 4)
    for (int col0 = 0; col0 < COLS; col0 += 8) {
      unsigned long long banks = 0;
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < 8; ++c) banks |= 1ull << (Tile::offset(row0 + r, col0 + c) % 32);
      EXPECT_EQ(banks, 0xffffffffull) << "rows " << row0 << "-" << row0 + 3 << ", columns " << col0 << "-" << col0 + 7
                                      << ", " << COLS << " wide";
    }
  for (int row0 = 0; row0 < 32; row0 += 8)
    for (int col = 0; col < COLS; col += 4) {
      unsigned slots = 0;
      for (int r = 0; r < 8; ++r) slots |= 1u << ((Tile::offset(row0 + r, col) * 4 / 16) % 8);
      EXPECT_EQ(slots, 0xffu) << "rows " << row0 << "-" << row0 + 7 << ", column " << col << ", " << COLS << " wide";
    }
}

TEST(GemmMainloop, Tf32TilesReadByWordsHitEveryBank) {
  expect_paired_reads_conflict_free<32>();
  expect_paired_reads_conflict_free<64>();
  expect_paired_reads_conflict_free<128>();
}

// The f32 SIMT mainloop (cg_sgemm_mainloop) under the same counters: its
// 16-byte global loads whole sectors, its shared reads (LDS.128 of one k-row
// of each operand) and its stores into the k-major tiles (transposing
// K-contiguous operands a float at a time) conflict-free, in every layout.
template <bool A_K, bool B_K>
void run_sgemm_counted(long long M, long long N, long long K) {
  typedef cg_sgemm_config<64, 64, 8> Config;
  EmuLaunch l(size_t(4) << 20);
  float* a = l.tensor<float>("a", 0, M * K);
  float* b = l.tensor<float>("b", (M * K * 4 + 255) / 256 * 256, K * N);
  for (long long i = 0; i < M * K; ++i) a[i] = float(i % 7);
  for (long long i = 0; i < K * N; ++i) b[i] = float(i % 5);
  ASSERT_EQ(l.run("sgemm", dim3(unsigned(N / 64), unsigned(M / 64)), dim3(Config::THREADS), Config::SHARED_BYTES, [&] {
    cg_sgemm_accumulators<Config> acc;
    cg_sgemm_mainloop<Config, A_K, B_K>(acc, a, A_K ? K : M, b, B_K ? K : N, M, N, K, blockIdx.y, blockIdx.x,
                                        (float*)cudagen_emu::dynamic_smem());
  }),
            0)
      << cudagen_emu_last_error();
  unsigned long long c[9];
  cudagen_emu_kernel_counters(cudagen_emu_kernel_count() - 1, c);
  const std::string layout = std::string(A_K ? "A K-contiguous" : "A M-contiguous") + (B_K ? ", B K-contiguous" : ", B N-contiguous");
  ASSERT_GT(c[0], 0u);
  EXPECT_LE(double(c[1]), 1.1 * double(c[2])) << layout << ": " << c[1] << " load sectors, ideal " << c[2];
  ASSERT_GT(c[6], 0u) << layout << ": no shared request counted";
  EXPECT_EQ(c[7], c[8]) << layout << ": " << c[7] << " bank wavefronts, ideal " << c[8];
}

TEST(GemmMainloop, SimtLoadsAreCoalescedAndSharedAccessesConflictFree) {
  run_sgemm_counted<false, false>(128, 128, 64);
  run_sgemm_counted<true, false>(128, 128, 64);
  run_sgemm_counted<false, true>(128, 128, 64);
  run_sgemm_counted<true, true>(128, 128, 64);
}
