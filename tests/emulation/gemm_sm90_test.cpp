// The Hopper mainloop (templates/gemm_sm90.cuh) in the host emulation, which
// runs the mbarrier, TMA and wgmma wrappers' emulation (transaction counts
// and phases exactly, copies landing at seeded points, accumulators poisoned
// until wgmma.wait_group): tiles at every edge, K shorter than a k-tile and
// longer than the stages, f16 and bf16, against a float64 product of the
// same 16-bit values; then a small pipeline on the same wrappers, correct
// wherever its copies land, and each of a set of broken versions of it
// caught by the emulator's report or by a wrong result.
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels.h"  // (before the emulation's macros)
#include "cudagen_emu.h"
#include "emu_launch.h"
#include "prelude.cuh"
#include "gemm.cuh"
#include "gemm_sm90.cuh"

namespace {

using cudagen::testing::EmuLaunch;
using Config = cg_sm90_gemm_config<4>;

struct Problem {
  long long M, N, K;
};

// Arena offsets, each 256-byte aligned as the runtime places buffers.
struct Placer {
  unsigned long long at = 0;
  unsigned long long operator()(unsigned long long bytes) {
    const unsigned long long offset = at;
    at += (bytes + 255) / 256 * 256;
    return offset;
  }
};

// Stream-K's workspace for a run, and what the run leaves in it.
struct StreamK {
  bool enabled = false;
  unsigned order_seed = 0;               // the blocks' order and landing points, where not the data's seed
  std::vector<unsigned> arrivals_after;  // the counters after the run: all zero
  std::vector<float> result;             // D as computed
};

// Runs D = A B on `blocks` persistent blocks (0: one a tile) and returns
// the largest |got - want| / (sum over k of |a b|): f32 accumulation of
// exact products. A is M x K; B is stored N x K (B_K_MAJOR) or K x N. With
// `stream_k` enabled, the kernel has a workspace for its grid.
template <typename T, bool B_K_MAJOR, typename Config = Config>
double run_problem(const Problem& p, unsigned seed, unsigned blocks = 0, StreamK* stream_k = nullptr) {
  if (blocks == 0) blocks = unsigned((p.N + Config::BN - 1) / Config::BN * ((p.M + Config::BM - 1) / Config::BM));
  const long long partial_floats = 2LL * blocks * Config::BM * Config::BN, arrivals = 2LL * blocks * 4 * Config::CONSUMERS;
  Placer place;
  EmuLaunch l(size_t(p.M * p.K + p.N * p.K) * 2 + size_t(p.M * p.N) * 4 + size_t(partial_floats + arrivals) * 4 + 4096);
  T* a = l.tensor<T>("a", place(p.M * p.K * 2), p.M * p.K);
  T* b = l.tensor<T>("b", place(p.N * p.K * 2), p.N * p.K);
  float* d = l.tensor<float>("d", place(p.M * p.N * 4), p.M * p.N);
  cg_sm90_stream_k workspace{nullptr, nullptr, 0};
  if (stream_k != nullptr && stream_k->enabled) {
    workspace.partials = l.tensor<float>("partials", place(partial_floats * 4), partial_floats);
    workspace.arrivals = l.tensor<unsigned>("arrivals", place(arrivals * 4), arrivals);
    workspace.max_grid = blocks;
    for (long long i = 0; i < partial_floats; ++i) workspace.partials[i] = NAN;  // a slot read unwritten shows
    for (long long i = 0; i < arrivals; ++i) workspace.arrivals[i] = 0;
  }
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (long long i = 0; i < p.M * p.K; ++i) a[i] = cg_narrow<T>(uniform(rng));
  for (long long i = 0; i < p.N * p.K; ++i) b[i] = cg_narrow<T>(uniform(rng));
  cg_tensor_map map_a, map_b;
  EXPECT_STREQ(cudagen_emu::encode_tensor_map_2d(&map_a, a, 2, p.K, p.M, p.K * 2, 64, Config::BM,
                                                 cudagen_emu::TensorSwizzle::span128), "");
  if (B_K_MAJOR)
    EXPECT_STREQ(cudagen_emu::encode_tensor_map_2d(&map_b, b, 2, p.K, p.N, p.K * 2, 64, Config::BN,
                                                   cudagen_emu::TensorSwizzle::span128), "");
  else
    EXPECT_STREQ(cudagen_emu::encode_tensor_map_2d(&map_b, b, 2, p.N, p.K, p.N * 2, 64, 64,
                                                   cudagen_emu::TensorSwizzle::span128), "");
  cudagen_emu_configure(stream_k != nullptr && stream_k->order_seed != 0 ? stream_k->order_seed : seed);
  // The output poisoned: a tile no block computes shows.
  for (long long i = 0; i < p.M * p.N; ++i) d[i] = NAN;
  const int rc = l.run("gemm_sm90", dim3(blocks), dim3(Config::THREADS), Config::SHARED_BYTES, [&] {
    CG_DYNAMIC_SMEM(smem);
    cg_gemm_sm90<Config, T, B_K_MAJOR, Config::BN == 128>(&map_a, &map_b, p.M, p.N, p.K, blockIdx.x, gridDim.x, smem, workspace,
                                       [&](cg_i64 m, cg_i64 n, float v) { cudagen_emu::store(d, m * p.N + n, v); });
  });
  EXPECT_EQ(rc, 0) << cudagen_emu_last_error();
  if (stream_k != nullptr) {
    stream_k->result.assign(d, d + p.M * p.N);
    if (stream_k->enabled) stream_k->arrivals_after.assign(workspace.arrivals, workspace.arrivals + arrivals);
  }
  double worst = 0;
  for (long long m = 0; m < p.M; ++m)
    for (long long n = 0; n < p.N; ++n) {
      double want = 0, scale = 0;
      for (long long k = 0; k < p.K; ++k) {
        const T b_kn = B_K_MAJOR ? b[n * p.K + k] : b[k * p.N + n];
        const double x = double(cg_widen(a[m * p.K + k])) * double(cg_widen(b_kn));
        want += x;
        scale += std::fabs(x);
      }
      const double got = d[m * p.N + n];
      const double error = std::isfinite(got) ? std::fabs(got - want) / (scale + 1e-30) : INFINITY;
      worst = std::max(worst, error);
    }
  return worst;
}

std::string describe(const Problem& p, bool b_k_major) {
  return "M=" + std::to_string(p.M) + " N=" + std::to_string(p.N) + " K=" + std::to_string(p.K) +
         (b_k_major ? ", B stored N x K" : ", B stored K x N");
}

}  // namespace

// One tile; edges in M and N; K below one k-tile, and K over more k-tiles
// than stages (each stage reused, the barriers' parities flipping), not a
// multiple of 64 (the box past K reads as zeros); B in either layout
// (wgmma's K-major B, and its transposed, N-major one: a matmul's b as
// stored). A row stride is whole 16 bytes: K, and N for an N-major B, are
// multiples of 8.
TEST(GemmSm90, EveryEdgeAgainstAFloat64Product) {
  for (const Problem& p : {Problem{128, 128, 64}, Problem{200, 296, 520}, Problem{64, 40, 8}, Problem{130, 136, 136}}) {
    EXPECT_LT((run_problem<cg_bf16, true>(p, 3)), 1e-5) << describe(p, true) << ", bf16";
    EXPECT_LT((run_problem<cg_f16, true>(p, 4)), 1e-5) << describe(p, true) << ", f16";
    EXPECT_LT((run_problem<cg_bf16, false>(p, 5)), 1e-5) << describe(p, false) << ", bf16";
    EXPECT_LT((run_problem<cg_f16, false>(p, 6)), 1e-5) << describe(p, false) << ", f16";
  }
}

// Tiles of 64 rows: one consumer warpgroup (the config for products of few
// tiles), three stages.
TEST(GemmSm90, OneConsumerWarpgroupAgainstAFloat64Product) {
  using Narrow = cg_sm90_gemm_config<3, 1>;
  for (const Problem& p : {Problem{64, 128, 64}, Problem{200, 296, 520}, Problem{130, 136, 8}}) {
    EXPECT_LT((run_problem<cg_bf16, false, Narrow>(p, 7)), 1e-5) << describe(p, false) << ", bf16";
    EXPECT_LT((run_problem<cg_f16, true, Narrow>(p, 8)), 1e-5) << describe(p, true) << ", f16";
  }
}

// Tiles of 192 and 256 columns (wgmma m64n192k16 and m64n256k16, B in 3
// or 4 boxes of 64 columns where N-major, results leaving 64 columns at a
// time): edges in N inside a tile's last chunk of columns and past it, K
// over more k-tiles than stages, several tiles a block.
TEST(GemmSm90, WideTilesAgainstAFloat64Product) {
  using Wide192 = cg_sm90_gemm_config<4, 2, 192>;
  using Wide256 = cg_sm90_gemm_config<3, 2, 256>;
  for (const Problem& p : {Problem{128, 192, 64}, Problem{200, 440, 328}, Problem{72, 72, 8}}) {
    EXPECT_LT((run_problem<cg_bf16, false, Wide192>(p, 31)), 1e-5) << describe(p, false) << ", bf16, 192 columns";
    EXPECT_LT((run_problem<cg_f16, true, Wide192>(p, 32)), 1e-5) << describe(p, true) << ", f16, 192 columns";
    EXPECT_LT((run_problem<cg_bf16, true, Wide256>(p, 33)), 1e-5) << describe(p, true) << ", bf16, 256 columns";
    EXPECT_LT((run_problem<cg_f16, false, Wide256>(p, 34)), 1e-5) << describe(p, false) << ", f16, 256 columns";
  }
  const Problem tiles{264, 520, 200};  // 3 x 3 tiles of 128 x 192, 3 x 3 of 128 x 256 (ragged)
  EXPECT_LT((run_problem<cg_bf16, false, Wide192>(tiles, 35, 2)), 1e-5) << describe(tiles, false) << ", 2 blocks";
  EXPECT_LT((run_problem<cg_bf16, false, Wide256>(tiles, 36, 4)), 1e-5) << describe(tiles, false) << ", 4 blocks";
}

// The generator lays out the kernel's shared memory from its own formula
// (HopperGemm::shared_bytes, kernels.h): the template's, for every config.
TEST(GemmSm90, TheGeneratorsSharedBytesAreTheTemplates) {
  cudagen::HopperGemm two, one, wide192, wide256;
  two.consumers = 2;
  one.consumers = 1;
  wide192.columns = 192;
  wide256.columns = 256;
  EXPECT_EQ(wide192.shared_bytes(), (cg_sm90_gemm_config<4, 2, 192>::SHARED_BYTES));
  EXPECT_EQ(wide256.shared_bytes(), (cg_sm90_gemm_config<3, 2, 256>::SHARED_BYTES));
  EXPECT_EQ(wide192.stages(), 4);
  EXPECT_EQ(wide256.stages(), 3);
  EXPECT_LE(wide256.shared_bytes(), 227 * 1024) << "an SM's shared memory for one block";
  EXPECT_EQ(two.shared_bytes(), (cg_sm90_gemm_config<4, 2>::SHARED_BYTES));
  EXPECT_EQ(two.threads(), (cg_sm90_gemm_config<4, 2>::THREADS));
  EXPECT_EQ(two.rows(), (cg_sm90_gemm_config<4, 2>::BM));
  EXPECT_EQ(one.shared_bytes(), (cg_sm90_gemm_config<3, 1>::SHARED_BYTES));
  EXPECT_EQ(one.threads(), (cg_sm90_gemm_config<3, 1>::THREADS));
  EXPECT_EQ(one.rows(), (cg_sm90_gemm_config<3, 1>::BM));
  EXPECT_EQ(two.stages(), 4);
  EXPECT_EQ(one.stages(), 3);
}

// Persistent blocks, each over several tiles: one block over all of them,
// and grids that divide the tiles unevenly. The stages and their parities
// run on across tiles (K of five k-tiles over four stages and three: a
// stage's round changes inside a tile and between tiles), and tile rows
// past a band of 8 (cg_gemm_tile_of's order) end in a shorter band.
TEST(GemmSm90, PersistentBlocksComputeEveryTile) {
  const Problem wide{200, 296, 320};  // 2 x 3 tiles of 128 rows
  for (unsigned blocks : {1u, 2u, 4u, 7u}) {
    EXPECT_LT((run_problem<cg_bf16, false>(wide, 21, blocks)), 1e-5) << describe(wide, false) << ", " << blocks << " blocks";
    EXPECT_LT((run_problem<cg_f16, true>(wide, 22, blocks)), 1e-5) << describe(wide, true) << ", " << blocks << " blocks";
  }
  using Narrow = cg_sm90_gemm_config<3, 1>;
  const Problem tall{600, 136, 72};  // 10 x 2 tiles of 64 rows: a band of 8 tile rows, then one of 2
  for (unsigned blocks : {1u, 3u})
    EXPECT_LT((run_problem<cg_bf16, true, Narrow>(tall, 23, blocks)), 1e-5) << describe(tall, true) << ", " << blocks
                                                                             << " blocks";
}

// The persistent blocks' order of tiles (cg_gemm_tile_of in bands of 8
// tile rows) is a permutation: every tile once, a band walked column by
// column.
TEST(GemmSm90, TheTileOrderVisitsEachTileOnce) {
  for (const auto& [tiles_m, tiles_n] : {std::pair<int, int>{1, 1}, {8, 3}, {10, 2}, {17, 5}, {3, 9}}) {
    std::vector<int> seen(size_t(tiles_m * tiles_n), 0);
    for (long long i = 0; i < (long long)tiles_m * tiles_n; ++i) {
      cg_i64 m = -1, n = -1;
      cg_gemm_tile_of(i, tiles_m, tiles_n, 8, &m, &n);
      ASSERT_TRUE(m >= 0 && m < tiles_m && n >= 0 && n < tiles_n) << i;
      ++seen[size_t(m * tiles_n + n)];
    }
    for (int v : seen) EXPECT_EQ(v, 1) << tiles_m << " x " << tiles_n;
    cg_i64 m = -1, n = -1;
    cg_gemm_tile_of(1, tiles_m, tiles_n, 8, &m, &n);
    if (tiles_m > 1) EXPECT_EQ(std::make_pair(m, n), std::make_pair(cg_i64(1), cg_i64(0))) << "down the band's first column first";
  }
}

// The stream-K schedule (cg_sm90_schedule) over grids and shapes: every
// k-tile of every tile computed once, by one block; a block's run holds at
// most two partial tiles, each in a slot of its own; a tile's contributors
// (the blocks the last-to-arrive count waits for, and whose slots it adds)
// are the blocks that computed part of it, in k order; and the choice of
// stream-K is the generator's (HopperGemm::stream_k_tiles), for both configs.
template <typename C>
void check_schedules(int consumers) {
  cudagen::HopperGemm g;
  g.consumers = consumers;
  ASSERT_EQ(g.fixup_k_tiles(), C::FIXUP_K_TILES);
  ASSERT_EQ(g.blocks_per_sm(), C::MIN_BLOCKS);
  int stream_k_cases = 0, idle_blocks = 0;
  for (int tiles : {1, 3, 6, 20, 96, 144, 301})
    for (int k_tiles : {0, 1, 2, 7, 12, 48})
      for (int grid : {1, 2, 3, 5, 8, 132, 264}) {
        g.M = (long long)tiles * C::BM;
        g.N = 128;
        g.K = (long long)k_tiles * 64;
        const std::string where = std::to_string(tiles) + " tiles of " + std::to_string(k_tiles) + " k-tiles on " +
                                  std::to_string(grid) + " blocks";
        std::vector<int> done(size_t(tiles) * std::max(k_tiles, 1), 0);
        std::map<long long, std::vector<long long>> pieces;  // tile -> its partial pieces' blocks, in k order
        std::set<long long> slots;
        long long sk_tiles = 0;
        for (long long block = 0; block < grid; ++block) {
          cg_sm90_schedule s(tiles, k_tiles, block, grid, C::MIN_BLOCKS, C::FIXUP_K_TILES, grid);
          sk_tiles = s.tiles - s.dp_tiles;
          cg_sm90_work w;
          int partial = 0, units = 0;
          while (s.next(&w)) {
            ++units;
            ASSERT_TRUE(w.tile >= 0 && w.tile < tiles && w.k_begin <= w.k_end && w.k_end <= k_tiles) << where;
            if (k_tiles == 0) ++done[size_t(w.tile)];
            for (int k = w.k_begin; k < w.k_end; ++k) ++done[size_t(w.tile * k_tiles + k)];
            if (s.whole(w)) continue;
            ASSERT_GE(w.tile, s.dp_tiles) << where << ": a partial tile outside stream-K's";
            ++partial;
            pieces[w.tile].push_back(block);
            EXPECT_TRUE(slots.insert(s.slot(block, w.tile)).second) << where << ": a slot taken twice";
            EXPECT_LT(s.slot(block, w.tile), 2 * grid) << where;
          }
          EXPECT_LE(partial, 2) << where << ", block " << block;
          idle_blocks += units == 0 && s.sk_k_tiles > 0;  // a stream-K block with no run: the fix-up never pays
        }
        for (int v : done) ASSERT_EQ(v, 1) << where << ": a k-tile computed " << v << " times";
        EXPECT_EQ(sk_tiles, g.stream_k_tiles(grid)) << where << ": the generator's rule differs";
        if (grid > 1)  // a grid over the workspace's: whole tiles only
          EXPECT_EQ(cg_sm90_schedule(tiles, k_tiles, 0, grid, C::MIN_BLOCKS, C::FIXUP_K_TILES, grid - 1).dp_tiles, tiles)
              << where;
        stream_k_cases += sk_tiles > 0;
        cg_sm90_schedule s(tiles, k_tiles, 0, grid, C::MIN_BLOCKS, C::FIXUP_K_TILES, grid);
        if (sk_tiles > 0) {
          EXPECT_LT(sk_tiles, 2 * grid) << where << ": more tiles than counters";
          long long partial_tiles = 0;
          for (const auto& [tile, blocks] : pieces) partial_tiles += (long long)blocks.size();
          EXPECT_EQ(partial_tiles, g.stream_k_partial_tiles(grid)) << where;
        }
        for (const auto& [tile, blocks] : pieces) {
          const long long first_k = (tile - s.dp_tiles) * k_tiles;
          std::vector<long long> contributors;
          for (long long b = s.owner(first_k); b <= s.owner(first_k + k_tiles - 1); ++b)
            if (s.has_run(b)) contributors.push_back(b);
          EXPECT_EQ(contributors, blocks) << where << ", tile " << tile;
        }
      }
  EXPECT_GT(stream_k_cases, 20) << "the sweep reaches stream-K";
  EXPECT_EQ(idle_blocks, 0) << "stream-K on more blocks than k-tiles: a tile's partial sums would cost more";
}

TEST(GemmSm90, StreamKComputesEveryKTileOnceAndAddsEachPartialTile) {
  check_schedules<cg_sm90_gemm_config<4, 2>>(2);
  check_schedules<cg_sm90_gemm_config<3, 1>>(1);
}

// Stream-K run: partial tiles stored, counted in per warp, added in k order
// by the last to arrive: the product against float64, the counters left zero
// for the next launch, and the result bit for bit the same whatever order
// the blocks run in and the copies land (the emulator's seed). Both configs,
// both B layouts.
TEST(GemmSm90, StreamKAgainstAFloat64ProductAndDeterministic) {
  struct Case {
    Problem p;
    unsigned blocks;
    bool narrow;
    bool b_k_major;
  };
  const Case cases[] = {{{192, 256, 1536}, 3, false, false},  // 4 tiles of 24 k-tiles on 3 blocks
                        {{200, 296, 520}, 5, false, true},    // 6 tiles of 9 on 5
                        {{130, 128, 1024}, 4, true, false},   // 3 tiles of 16 on 4 blocks, 2 an SM
                        {{130, 128, 1024}, 4, true, true}};
  for (const Case& c : cases) {
    const std::string where = describe(c.p, c.b_k_major) + " on " + std::to_string(c.blocks) + " blocks";
    cudagen::HopperGemm g;
    g.M = c.p.M;
    g.N = c.p.N;
    g.K = c.p.K;
    g.consumers = c.narrow ? 1 : 2;
    ASSERT_GT(g.stream_k_tiles(c.blocks), 0) << where << ": no stream-K";
    std::vector<float> first;
    for (unsigned order : {31u, 32u, 33u}) {
      const unsigned seed = 30;  // the same operands, the blocks in another order
      StreamK sk;
      sk.enabled = true;
      sk.order_seed = order;
      using Narrow = cg_sm90_gemm_config<3, 1>;
      const double worst = c.narrow ? (c.b_k_major ? run_problem<cg_bf16, true, Narrow>(c.p, seed, c.blocks, &sk)
                                                   : run_problem<cg_f16, false, Narrow>(c.p, seed, c.blocks, &sk))
                                    : (c.b_k_major ? run_problem<cg_bf16, true>(c.p, seed, c.blocks, &sk)
                                                   : run_problem<cg_f16, false>(c.p, seed, c.blocks, &sk));
      EXPECT_LT(worst, 1e-5) << where << ", order " << order;
      for (unsigned v : sk.arrivals_after) ASSERT_EQ(v, 0u) << where << ": a counter left set";
      if (first.empty()) {
        first = sk.result;
      } else {
        ASSERT_EQ(sk.result.size(), first.size());
        EXPECT_EQ(std::memcmp(sk.result.data(), first.data(), first.size() * 4), 0) << where << ", order " << order;
      }
    }
  }
}

// Wherever the copies land (the emulator's seeded landing points), the same
// result.
TEST(GemmSm90, RightWhereverTheCopiesLand) {
  for (unsigned seed : {11u, 12u, 13u, 14u, 15u})
    EXPECT_LT((run_problem<cg_bf16, false>(Problem{256, 128, 576}, seed)), 1e-5) << "seed " << seed;
}

namespace {

// What is broken in a run of the small pipeline.
enum class Fault {
  none,
  expect_tx_too_large,  // the producer expects 16 bytes more than its copies bring
  expect_tx_too_small,  // 16 bytes fewer
  parity_off_by_one,    // the consumer waits for the wrong phase of a full barrier
  release_before_wait,  // a stage goes back before the wgmma that reads it completes
  read_before_wait,     // the accumulators stored before wgmma.wait_group
  never_waited,         // the last group never waited for
  no_init,              // the barriers used uninitialised
  extra_arrival,        // the producer arrives twice on a full barrier
  skipped_wgmma,        // one warp of the warpgroup skips the last wgmma (divergence)
  diverging_descriptor, // one warp of the warpgroup reads another A than the others
  no_fence,             // the second k-tile's wgmmas issued with no wgmma.fence before them
  misaligned_box,       // the stages start 128 bytes past a 1024-byte boundary (the swizzle's)
};

struct Outcome {
  int rc = 0;
  std::string error;
  double worst = 0;  // as run_problem's
};

// Two warpgroups: thread 0 copies a 64 x 64 box of A and a 128 x 64 box of B
// per k-tile into two stages; warpgroup 1 multiplies them into a 64 x 128
// tile, one wgmma group in flight, and stores it.
Outcome run_pipeline(Fault fault, unsigned seed) {
  constexpr int M = 64, N = 128, K = 256, kStages = 2, kABytes = 64 * 128, kStageBytes = kABytes + 128 * 128;
  Placer place;
  EmuLaunch l(size_t(1) << 20);
  cg_bf16* a = l.tensor<cg_bf16>("a", place(M * K * 2), M * K);
  cg_bf16* b = l.tensor<cg_bf16>("b", place(N * K * 2), N * K);
  float* d = l.tensor<float>("d", place(M * N * 4), M * N);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (int i = 0; i < M * K; ++i) a[i] = cg_narrow<cg_bf16>(uniform(rng));
  for (int i = 0; i < N * K; ++i) b[i] = cg_narrow<cg_bf16>(uniform(rng));
  cg_tensor_map map_a, map_b;
  cudagen_emu::encode_tensor_map_2d(&map_a, a, 2, K, M, K * 2, 64, 64, cudagen_emu::TensorSwizzle::span128);
  cudagen_emu::encode_tensor_map_2d(&map_b, b, 2, K, N, K * 2, 64, 128, cudagen_emu::TensorSwizzle::span128);
  cudagen_emu_configure(seed);
  Outcome out;
  out.rc = l.run("pipeline", dim3(1), dim3(256), 1024 + 128 + kStages * kStageBytes + 64, [&] {
    CG_DYNAMIC_SMEM(smem);
    const unsigned int base = ((cg_smem_address(smem) + 1023u) & ~1023u) + (fault == Fault::misaligned_box ? 128u : 0u);
    unsigned char* stages = cg_smem_pointer(base);
    unsigned long long* full = (unsigned long long*)(stages + kStages * kStageBytes);
    unsigned long long* empty = full + kStages;
    const int t = threadIdx.x;
    if (t == 0 && fault != Fault::no_init)
      for (int s = 0; s < kStages; ++s) {
        cg_mbarrier_init(&full[s], 1);
        cg_mbarrier_init(&empty[s], 128);
      }
    __syncthreads();
    constexpr int k_tiles = K / 64;
    if (t < 128) {
      if (t == 0)
        for (int kt = 0; kt < k_tiles; ++kt) {
          const int s = kt % kStages;
          cg_mbarrier_wait(&empty[s], (unsigned int)(((kt / kStages) & 1) ^ 1));
          cg_mbarrier_arrive_expect_tx(&full[s], kStageBytes + (fault == Fault::expect_tx_too_large   ? 16
                                                                : fault == Fault::expect_tx_too_small ? -16
                                                                                                      : 0));
          if (fault == Fault::extra_arrival) cg_mbarrier_arrive(&full[s]);
          cg_tma_load_2d(stages + s * kStageBytes, &map_a, kt * 64, 0, &full[s]);
          cg_tma_load_2d(stages + s * kStageBytes + kABytes, &map_b, kt * 64, 0, &full[s]);
        }
      return;
    }
    float acc[64];
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    for (int kt = 0; kt < k_tiles; ++kt) {
      const int s = kt % kStages;
      cg_mbarrier_wait(&full[s], (unsigned int)((kt / kStages) & 1) ^ (fault == Fault::parity_off_by_one ? 1u : 0u));
      const unsigned int stage = base + (unsigned int)(s * kStageBytes);
      if (fault != Fault::no_fence || kt != 1) cg_wgmma_fence();
      const int warp = (t - 128) / 32;
      for (int kk = 0; kk < 4; ++kk) {
        if (fault == Fault::skipped_wgmma && warp == 2 && kt == k_tiles - 1 && kk == 3) continue;
        const unsigned int a_step = fault == Fault::diverging_descriptor && warp == 1 && kt == 1 ? 32 * ((kk + 1) % 4)
                                                                                              : 32 * kk;
        cg_wgmma_m64n128k16<0>(acc, cg_wgmma_descriptor_128b(stage + a_step),
                               cg_wgmma_descriptor_128b(stage + kABytes + 32 * kk), kt > 0 || kk > 0, cg_bf16());
      }
      cg_wgmma_commit();
      if (fault == Fault::release_before_wait) {
        cg_mbarrier_arrive(&empty[s]);
        cg_wgmma_wait<1>();
        continue;
      }
      cg_wgmma_wait<1>();
      if (kt > 0) cg_mbarrier_arrive(&empty[(kt - 1) % kStages]);
    }
    if (fault != Fault::read_before_wait && fault != Fault::never_waited) cg_wgmma_wait<0>();
    const int u = t - 128, row = 16 * (u / 32) + (u % 32) / 4, column = 2 * (u % 4);
    for (int j = 0; j < 16; ++j)
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 2; ++e) cudagen_emu::store(d, (row + 8 * h) * N + column + 8 * j + e, acc[4 * j + 2 * h + e]);
    if (fault == Fault::read_before_wait) cg_wgmma_wait<0>();
  });
  out.error = cudagen_emu_last_error();
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double want = 0, scale = 0;
      for (int k = 0; k < K; ++k) {
        const double x = double(cg_widen(a[m * K + k])) * double(cg_widen(b[n * K + k]));
        want += x;
        scale += std::fabs(x);
      }
      const double got = d[m * N + n];
      out.worst = std::max(out.worst, std::isfinite(got) ? std::fabs(got - want) / scale : INFINITY);
    }
  return out;
}

}  // namespace

TEST(HopperEmulatorFaults, TheCorrectPipelinePassesWhereverCopiesLand) {
  for (unsigned seed : {1u, 2u, 3u, 4u, 5u, 6u}) {
    const Outcome o = run_pipeline(Fault::none, seed);
    EXPECT_EQ(o.rc, 0) << o.error;
    EXPECT_LT(o.worst, 1e-5) << "seed " << seed;
  }
}

// Each broken version is caught: by the emulator's report naming what went
// wrong, or (an accumulator read before its wait) by the poison it reads.
TEST(HopperEmulatorFaults, EachBrokenPipelineIsCaught) {
  struct Case {
    Fault fault;
    const char* report;  // "" where the result is what shows it
  };
  for (const Case& c : {
           Case{Fault::expect_tx_too_large, "16 transaction bytes still to come"},
           Case{Fault::expect_tx_too_small, "received 16 transaction bytes more than its phase expected"},
           Case{Fault::parity_off_by_one, "a TMA copy has not landed in yet"},
           Case{Fault::release_before_wait, "the stage is reused before a wgmma.wait_group covers that wgmma"},
           Case{Fault::read_before_wait, ""},
           Case{Fault::never_waited, "wgmma never waited for"},
           Case{Fault::no_init, "before its mbarrier.init"},
           Case{Fault::extra_arrival, "beyond the 1 its phase expects"},
           Case{Fault::skipped_wgmma, "issued 15 wgmma, its warpgroup's thread 128 16"},
           Case{Fault::diverging_descriptor, "wgmma 4 of warpgroup 1 diverges: thread 128 issued it"},
           Case{Fault::no_fence, "with no wgmma.fence before it since the thread's last wgmma.commit_group"},
           Case{Fault::misaligned_box, "not 1024-byte aligned"},
       }) {
    const Outcome o = run_pipeline(c.fault, 7);
    if (*c.report != 0) {
      EXPECT_NE(o.rc, 0) << "fault " << int(c.fault) << " went unreported";
      EXPECT_NE(o.error.find(c.report), std::string::npos) << "fault " << int(c.fault) << ": " << o.error;
    } else {
      EXPECT_FALSE(o.worst < 1e-5) << "fault " << int(c.fault) << " gave the right result";
    }
  }
}

namespace {

// D (64 x N) = A (64 x 64) B on the register-A wgmma (flash attention's
// p v): A read from memory into each thread's fragments, B through a 3-D
// tensor map (plane 1 of 2, its rows past K zeros where K < 64) into
// shared memory, K-major (stored N x K) or N-major (K x N, boxes of 64
// columns: the flash kernel's values). The largest |got - want| / sum |a b|.
template <int N, bool TRANS_B>
double run_register_a(unsigned seed, int K) {
  constexpr int M = 64, B_BYTES = 64 * N * 2;
  Placer place;
  EmuLaunch l(size_t(1) << 20);
  cg_bf16* a = l.tensor<cg_bf16>("a", place(M * 64 * 2), M * 64);
  cg_bf16* b = l.tensor<cg_bf16>("b", place(2 * N * 64 * 2), 2 * N * 64);  // two planes
  float* d = l.tensor<float>("d", place(M * N * 4), M * N);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (int i = 0; i < M * 64; ++i) a[i] = cg_narrow<cg_bf16>(uniform(rng));
  for (int i = 0; i < 2 * N * 64; ++i) b[i] = cg_narrow<cg_bf16>(uniform(rng));
  // Plane 1's K x N (or N x K) block; its rows (of K) past K read as zeros.
  cg_tensor_map map_b;
  const int plane = N * 64 * 2;
  if (TRANS_B)
    EXPECT_STREQ(cudagen_emu::encode_tensor_map_3d(&map_b, b, 2, N, K, 2, N * 2, plane, 64, 64,
                                                   cudagen_emu::TensorSwizzle::span128), "");
  else
    EXPECT_STREQ(cudagen_emu::encode_tensor_map_3d(&map_b, b, 2, K, N, 2, 64 * 2, plane, 64, N,
                                                   cudagen_emu::TensorSwizzle::span128), "");
  cudagen_emu_configure(seed);
  for (int i = 0; i < M * N; ++i) d[i] = NAN;
  const int rc = l.run("register_a", dim3(1), dim3(128), 1024 + B_BYTES + 64, [&] {
    CG_DYNAMIC_SMEM(smem);
    const unsigned int base = (cg_smem_address(smem) + 1023u) & ~1023u;
    unsigned char* tile = cg_smem_pointer(base);
    unsigned long long* full = (unsigned long long*)(tile + B_BYTES);
    const int t = threadIdx.x, warp = t / 32, g = (t % 32) / 4, c = t % 4;
    if (t == 0) {
      cg_mbarrier_init(full, 1);
      cg_fence_barrier_init();
    }
    __syncthreads();
    if (t == 0) {
      cg_mbarrier_arrive_expect_tx(full, B_BYTES);
      for (int chunk = 0; chunk < (TRANS_B ? N / 64 : 1); ++chunk)
        cg_tma_load_3d(tile + chunk * 64 * 128, &map_b, 64 * chunk, 0, 1, full);
    }
    cg_mbarrier_wait(full, 0);
    float acc[N / 2];
    auto pair = [&](int row, int k) {
      return (unsigned int)cg_float_to_bf16_bits(cg_widen(a[row * 64 + k])) |
             (unsigned int)cg_float_to_bf16_bits(cg_widen(a[row * 64 + k + 1])) << 16;
    };
    cg_wgmma_fence();
    for (int kk = 0; kk < 4; ++kk) {
      const int row = 16 * warp + g, k = 16 * kk + 2 * c;
      const unsigned int fragment[4] = {pair(row, k), pair(row + 8, k), pair(row, k + 8), pair(row + 8, k + 8)};
      const unsigned long long desc = TRANS_B ? cg_wgmma_descriptor_128b(base + 2048u * kk, 64 * 128, 1024)
                                              : cg_wgmma_descriptor_128b(base + 32u * kk);
      cg_wgmma_rs_m64k16<N, TRANS_B ? 1 : 0, cg_bf16>(acc, fragment, desc, kk > 0);
    }
    cg_wgmma_commit();
    cg_wgmma_wait<0>();
    const int row = 16 * warp + g, column = 2 * c;
    for (int j = 0; j < N / 8; ++j)
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 2; ++e) cudagen_emu::store(d, (row + 8 * h) * N + column + 8 * j + e, acc[4 * j + 2 * h + e]);
  });
  EXPECT_EQ(rc, 0) << cudagen_emu_last_error();
  double worst = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double want = 0, scale = 0;
      for (int k = 0; k < K; ++k) {
        const cg_bf16 b_kn = TRANS_B ? b[N * 64 + k * N + n] : b[N * 64 + n * 64 + k];
        const double x = double(cg_widen(a[m * 64 + k])) * double(cg_widen(b_kn));
        want += x;
        scale += std::fabs(x);
      }
      const double got = d[m * N + n];
      worst = std::max(worst, std::isfinite(got) ? std::fabs(got - want) / (scale + 1e-30) : INFINITY);
    }
  return worst;
}

}  // namespace

// The register-A wgmma (templates/gemm_sm90.cuh, cg_wgmma_rs_m64k16) in
// both widths and both B layouts, B from plane 1 of a 3-D map. With K 40
// the map's plane is 40 of the 64 k the memory holds: the box's k past it
// must arrive as zeros, or a's values there (not zero) would add to D.
TEST(GemmSm90, RegisterAOperandAgainstAFloat64Product) {
  for (int K : {64, 40}) {
    EXPECT_LT((run_register_a<64, false>(11, K)), 1e-5) << "N 64, B K-major, K " << K;
    EXPECT_LT((run_register_a<128, false>(12, K)), 1e-5) << "N 128, B K-major, K " << K;
    EXPECT_LT((run_register_a<64, true>(13, K)), 1e-5) << "N 64, B N-major, K " << K;
    EXPECT_LT((run_register_a<128, true>(14, K)), 1e-5) << "N 128, B N-major, K " << K;
  }
}

// A 3-D map's box holds one plane: rows past the plane's height and planes
// past the depth arrive as zeros, never the next plane's bytes; a copy of
// the other rank than the map's is reported.
TEST(GemmSm90, ThreeDimensionalMapsStopAtThePlane) {
  constexpr int W = 64, H = 5, P = 3, BOX = 8;
  EmuLaunch l(size_t(1) << 16);
  cg_bf16* x = l.tensor<cg_bf16>("x", 0, W * H * P);
  for (int i = 0; i < W * H * P; ++i) x[i] = cg_narrow<cg_bf16>(float(1 + i % 97));
  cg_tensor_map map;
  ASSERT_STREQ(cudagen_emu::encode_tensor_map_3d(&map, x, 2, W, H, P, W * 2, H * W * 2, 64, BOX,
                                                 cudagen_emu::TensorSwizzle::span128), "");
  EXPECT_STRNE(cudagen_emu::encode_tensor_map_3d(&map, x, 2, W, H, P, W * 2, H * W * 2 - 16, 64, BOX,
                                                 cudagen_emu::TensorSwizzle::span128), "")
      << "planes that overlap";
  for (int plane : {1, 2, 3}) {
    std::vector<float> got(BOX * W, -1.0f);
    cudagen_emu_configure(7);
    const int rc = l.run("tma_3d", dim3(1), dim3(32), 1024 + BOX * 128 + 64, [&] {
      CG_DYNAMIC_SMEM(smem);
      const unsigned int base = (cg_smem_address(smem) + 1023u) & ~1023u;
      unsigned char* box = cg_smem_pointer(base);
      unsigned long long* bar = (unsigned long long*)(box + BOX * 128);
      if (threadIdx.x == 0) {
        cg_mbarrier_init(bar, 1);
        cg_fence_barrier_init();
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        cg_mbarrier_arrive_expect_tx(bar, BOX * 128);
        cg_tma_load_3d(box, &map, 0, 0, plane, bar);
      }
      cg_mbarrier_wait(bar, 0);
      for (int i = (int)threadIdx.x; i < BOX * W; i += 32) {
        const int r = i / W, c = i % W;
        // The 128-byte swizzle: 16-byte chunk c / 8 of row r sits at chunk (c / 8) ^ (r % 8).
        const cg_bf16* at = (const cg_bf16*)(box + r * 128 + ((((c / 8) ^ (r % 8)) * 8 + c % 8) * 2));
        got[size_t(i)] = cg_widen(*at);
      }
    });
    ASSERT_EQ(rc, 0) << cudagen_emu_last_error();
    for (int r = 0; r < BOX; ++r)
      for (int c = 0; c < W; ++c) {
        const float want = plane < P && r < H ? cg_widen(x[(plane * H + r) * W + c]) : 0.0f;
        ASSERT_EQ(got[size_t(r * W + c)], want) << "plane " << plane << ", row " << r << ", column " << c;
      }
  }
  // A 2-D copy through a 3-D map.
  cudagen_emu_configure(7);
  const int rc = l.run("tma_rank", dim3(1), dim3(32), 1024 + BOX * 128 + 64, [&] {
    CG_DYNAMIC_SMEM(smem);
    const unsigned int base = (cg_smem_address(smem) + 1023u) & ~1023u;
    unsigned long long* bar = (unsigned long long*)(cg_smem_pointer(base) + BOX * 128);
    if (threadIdx.x == 0) {
      cg_mbarrier_init(bar, 1);
      cg_mbarrier_arrive_expect_tx(bar, BOX * 128);
      cg_tma_load_2d(cg_smem_pointer(base), &map, 0, 0, bar);
    }
  });
  EXPECT_NE(rc, 0);
  EXPECT_NE(std::string(cudagen_emu_last_error()).find("of rank 3"), std::string::npos) << cudagen_emu_last_error();
}
