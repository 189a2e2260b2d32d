// The emulator strict enough to trust a pipelined kernel without a GPU
// (issue #35): a small two-stage kernel on the same PTX wrappers as the GEMM
// mainloop (templates/gemm.cuh: cp.async, commit and wait groups, ldmatrix),
// correct under several seeds of when copies land, and each of a set of
// deliberately broken versions of it caught, by the emulator's report or by
// a wrong result.
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

// What is broken in a run of the kernel.
enum class Fault {
  none,
  no_wait,                    // reads a stage without cp.async.wait_group
  wait_one_too_many,          // waits for all but 2 groups where 1 is in flight
  wrong_stage,                // reads the stage being filled
  no_barrier_after_wait,      // warp 1 reads warp 0's copies with no barrier after its wait
  no_barrier_before_reissue,  // the next copy overwrites a stage still being read
  no_commit,                  // waits without committing the group
  misaligned_shared,          // a copy 8 bytes off into shared memory
  misaligned_global,          // a copy 8 bytes off in global memory
  source_out_of_bounds,       // the last tile read past its tensor
  never_waited,               // a copy issued at the end and never waited for
  read_outside_shared,        // ldmatrix past the end of the block's shared memory
  wrong_layout,               // ldmatrix .trans where the tile is stored untransposed
  wrong_swizzle,              // chunks stored XOR-swizzled, read as if not
  reissue_in_flight,          // two copies into one stage, the first not waited for
};

constexpr int kTiles = 5;          // k-tiles of 16 x 16 bf16 elements: 32 chunks of 16 bytes each
constexpr int kTileElements = 256;
constexpr int kStages = 2;

struct Outcome {
  int rc = 0;
  std::string error;
  std::vector<float> sums;  // per thread of 2 warps: the sum of the fragments it loaded
};

// Two warps: warp 0 copies each k-tile into a stage (chunk t by lane t),
// both warps load it with ldmatrix.x4 (four 8 x 8 matrices, the tile's
// quarters) and sum their fragment, weighted by matrix and column.
Outcome run(Fault fault, unsigned seed) {
  EmuLaunch l(size_t(1) << 16);
  cg_bf16* a = l.tensor<cg_bf16>("a", 0, kTiles * kTileElements);
  float* sums = l.tensor<float>("sums", 16384, 64);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (int i = 0; i < kTiles * kTileElements; ++i) a[i] = cg_narrow<cg_bf16>(uniform(rng));
  cudagen_emu_configure(seed);
  Outcome out;
  out.rc = l.run("staged", dim3(1), dim3(64), kStages * 512, [&] {
    unsigned short* smem = (unsigned short*)cudagen_emu::dynamic_smem();
    const int t = threadIdx.x, lane = t & 31;
    auto issue = [&](int kt, int stage) {
      if (t < 32) {
        int chunk = fault == Fault::wrong_swizzle ? (t ^ 1) : t;
        unsigned short* dst = smem + stage * kTileElements + chunk * 8 + (fault == Fault::misaligned_shared ? 4 : 0);
        const long long tile = fault == Fault::source_out_of_bounds && kt == kTiles - 1 ? kt + 1 : kt;
        const cg_bf16* src = a + tile * kTileElements + t * 8 + (fault == Fault::misaligned_global ? 4 : 0);
        cg_cp_async_16(dst, src, 16);
      }
      if (fault != Fault::no_commit) cg_cp_async_commit();
    };
    float sum = 0;
    issue(0, 0);
    for (int kt = 0; kt < kTiles; ++kt) {
      if (kt + 1 < kTiles) issue(kt + 1, fault == Fault::reissue_in_flight ? kt % kStages : (kt + 1) % kStages);
      else if (fault != Fault::no_commit) cg_cp_async_commit();  // an empty group keeps the count
      if (fault == Fault::wait_one_too_many) cg_cp_async_wait<2>();
      else if (fault != Fault::no_wait) cg_cp_async_wait<1>();
      if (fault != Fault::no_barrier_after_wait) __syncthreads();
      const int stage = fault == Fault::wrong_stage ? (kt + 1) % kStages
                        : fault == Fault::read_outside_shared && kt == kTiles - 1 ? kStages
                                                                                   : kt % kStages;
      // Lane l gives row l % 8 of matrix l / 8: matrix m is the quarter at
      // rows 8 (m % 2), columns 8 (m / 2).
      const int m = lane / 8;
      const unsigned short* row = smem + stage * kTileElements + ((m % 2) * 8 + lane % 8) * 16 + (m / 2) * 8;
      unsigned int r[4];
      if (fault == Fault::wrong_layout) cg_ldmatrix_x4<true>(r, row);
      else cg_ldmatrix_x4<false>(r, row);
      for (int i = 0; i < 4; ++i) {  // weighted by matrix and column, so that moved elements show
        cg_bf16 lo, hi;
        lo.bits = (unsigned short)(r[i] & 0xffff);
        hi.bits = (unsigned short)(r[i] >> 16);
        sum += float(i + 1) * (cg_widen(lo) + 2.0f * cg_widen(hi));
      }
      if (fault != Fault::no_barrier_before_reissue) __syncthreads();
    }
    if (fault == Fault::never_waited) {
      if (t < 32) cg_cp_async_16(smem + t * 8, a + t * 8, 16);
      cg_cp_async_commit();
    } else if (fault != Fault::no_commit) {
      cg_cp_async_wait<0>();
    }
    cudagen_emu::store(sums, t, sum);
  });
  out.error = cudagen_emu_last_error();
  out.sums.assign(sums, sums + 64);
  return out;
}

// The sums the kernel must produce: lane l of either warp holds, of matrix
// m, row l / 4 and columns 2 (l % 4), 2 (l % 4) + 1.
std::vector<float> expected() {
  std::vector<float> tiles(kTiles * kTileElements);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (float& x : tiles) x = cg_widen(cg_narrow<cg_bf16>(uniform(rng)));
  std::vector<float> sums(64, 0.0f);
  for (int t = 0; t < 64; ++t) {
    const int lane = t & 31;
    float sum = 0;
    for (int kt = 0; kt < kTiles; ++kt)
      for (int m = 0; m < 4; ++m)
        for (int j = 0; j < 2; ++j)
          sum += float(m + 1) * float(j + 1) *
                 tiles[kt * kTileElements + ((m % 2) * 8 + lane / 4) * 16 + (m / 2) * 8 + 2 * (lane % 4) + j];
    sums[size_t(t)] = sum;
  }
  return sums;
}

bool matches(const std::vector<float>& got) {
  const std::vector<float> want = expected();
  for (size_t i = 0; i < want.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= 1e-4f * (1 + std::fabs(want[i])))) return false;
  return true;
}

}  // namespace

TEST(EmulatorFaults, TheCorrectKernelPassesWhereverCopiesLand) {
  for (unsigned seed : {1u, 2u, 3u, 4u, 5u}) {
    const Outcome o = run(Fault::none, seed);
    ASSERT_EQ(o.rc, 0) << "seed " << seed << ": " << o.error;
    EXPECT_TRUE(matches(o.sums)) << "seed " << seed;
  }
}

struct Caught {
  Fault fault;
  const char* name;
  const char* report;  // a part of the emulator's error, or "" where only the result is wrong
};

class EmulatorFaults : public ::testing::TestWithParam<Caught> {};

// Each broken kernel is caught under every seed: reported by the emulator
// (the report named), or where the emulator has nothing to report, by its
// wrong result.
TEST_P(EmulatorFaults, IsCaught) {
  const Caught& c = GetParam();
  for (unsigned seed : {1u, 2u, 3u}) {
    const Outcome o = run(c.fault, seed);
    if (std::string(c.report).empty()) {
      EXPECT_EQ(o.rc, 0) << o.error;
      EXPECT_FALSE(matches(o.sums)) << c.name << ", seed " << seed << ": a wrong kernel gave the right sums";
    } else {
      EXPECT_EQ(o.rc, 1) << c.name << ", seed " << seed << ": not reported";
      EXPECT_NE(o.error.find(c.report), std::string::npos) << c.name << ", seed " << seed << ": " << o.error;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Broken, EmulatorFaults,
    ::testing::Values(
        Caught{Fault::no_wait, "no_wait", "cp.async.wait_group covers it"},
        Caught{Fault::wait_one_too_many, "wait_one_too_many", "cp.async.wait_group covers it"},
        Caught{Fault::wrong_stage, "wrong_stage", "cp.async.wait_group covers it"},
        Caught{Fault::no_barrier_after_wait, "no_barrier_after_wait", "with no barrier since"},
        Caught{Fault::no_barrier_before_reissue, "no_barrier_before_reissue", "the stage is still being read"},
        Caught{Fault::no_commit, "no_commit", "cp.async.wait_group covers it"},
        Caught{Fault::misaligned_shared, "misaligned_shared", "with a shared address that is not 16-byte aligned"},
        Caught{Fault::misaligned_global, "misaligned_global", "with a global address that is not 16-byte aligned"},
        Caught{Fault::source_out_of_bounds, "source_out_of_bounds", "lies in none of the kernel's tensors"},
        Caught{Fault::never_waited, "never_waited", "cp.async never waited for"},
        Caught{Fault::read_outside_shared, "read_outside_shared", "outside the block's 1024 bytes"},
        Caught{Fault::wrong_layout, "wrong_layout", ""},
        Caught{Fault::wrong_swizzle, "wrong_swizzle", ""},
        Caught{Fault::reissue_in_flight, "reissue_in_flight", "still has in flight"}),
    [](const ::testing::TestParamInfo<Caught>& info) { return std::string(info.param.name); });

// Dynamic shared memory is aligned to 16 bytes and no more, as CUDA
// promises: code that assumes 128 fails here.
TEST(EmulatorFaults, DynamicSharedMemoryIsOnlySixteenByteAligned) {
  EmuLaunch l;
  unsigned long long address = 0;
  ASSERT_EQ(l.run("where", dim3(1), dim3(32), 256, [&] {
    if (threadIdx.x == 0) address = (unsigned long long)(uintptr_t)cudagen_emu::dynamic_smem();
  }),
            0);
  EXPECT_EQ(address % 16, 0u);
  EXPECT_EQ(address % 128, 16u);
}

// A vector access must be aligned to its size, or a GPU faults: a 16-byte
// load from a float one past a 16-byte boundary is refused, naming it.
TEST(EmulatorFaults, AMisalignedVectorAccessIsRefused) {
  EmuLaunch l(size_t(1) << 12);
  float* data = l.tensor<float>("data", 0, 256);
  EXPECT_NE(l.run("misaligned", dim3(1), dim3(32), 0, [&] { cg_store_vector<4, float>(data, 4 * threadIdx.x + 1, {}); }),
            0);
  EXPECT_NE(std::string(cudagen_emu_last_error()).find("a 16-byte vector store at arena offset 4, not a multiple of 16"),
            std::string::npos)
      << cudagen_emu_last_error();
  EXPECT_EQ(l.run("aligned", dim3(1), dim3(32), 0, [&] { cg_store_vector<4, float>(data, 4 * threadIdx.x, {}); }), 0)
      << cudagen_emu_last_error();
}

// The counters behind `--profile`'s sector and bank columns: a warp's
// coalesced stores take the fewest sectors, a strided one eight times as
// many, a 16-byte vector load is one request; an unswizzled tile whose rows
// are 128 bytes apart puts each 8 x 8 matrix of an ldmatrix in one bank
// group (8x the wavefronts), the XOR swizzle in eight.
TEST(EmulatorCounters, SectorsAndBankWavefrontsAgainstTheIdeal) {
  auto counters = [] {
    std::vector<unsigned long long> c(9);
    cudagen_emu_kernel_counters(cudagen_emu_kernel_count() - 1, c.data());
    return c;
  };
  EmuLaunch l(size_t(1) << 16);
  float* out = l.tensor<float>("out", 0, 32 * 32);
  ASSERT_EQ(l.run("coalesced", dim3(1), dim3(64), 0, [&] {
    for (int r = 0; r < 4; ++r) cudagen_emu::store(out, r * 64 + threadIdx.x, 1.0f);
  }),
            0);
  std::vector<unsigned long long> c = counters();
  EXPECT_EQ(c[3], 8u) << "4 store requests per warp";
  EXPECT_EQ(c[4], 32u);
  EXPECT_EQ(c[5], 32u);
  ASSERT_EQ(l.run("strided", dim3(1), dim3(32), 0, [&] { cudagen_emu::store(out, threadIdx.x * 32, 1.0f); }), 0);
  c = counters();
  EXPECT_EQ(c[3], 1u);
  EXPECT_EQ(c[4], 32u) << "one sector per lane";
  EXPECT_EQ(c[5], 4u);

  // A 16-byte vector load is one request a lane, as the GPU issues it: 32
  // lanes on 512 consecutive bytes take 16 sectors, the fewest.
  const float* in = l.tensor<float>("in", 32 * 32 * 4, 32 * 32);
  ASSERT_EQ(l.run("vector", dim3(1), dim3(32), 0, [&] { (void)cg_load_vector<4, float>(in, 4 * threadIdx.x); }), 0);
  c = counters();
  EXPECT_EQ(c[0], 1u) << "one load request";
  EXPECT_EQ(c[1], 16u);
  EXPECT_EQ(c[2], 16u);

  for (bool swizzled : {false, true}) {
    // A 16 x 64 bf16 tile (128-byte rows); one x4 ldmatrix of its first 16 x 16.
    ASSERT_EQ(l.run("tile", dim3(1), dim3(32), 16 * 64 * 2, [&] {
      unsigned short* smem = (unsigned short*)cudagen_emu::dynamic_smem();
      for (int i = threadIdx.x; i < 16 * 64; i += 32) smem[i] = 0;
      __syncthreads();
      const int lane = threadIdx.x & 31, m = lane / 8, row = (m % 2) * 8 + lane % 8, chunk = m / 2;
      unsigned int r[4];
      cg_ldmatrix_x4<false>(r, smem + row * 64 + (swizzled ? (chunk ^ (row % 8)) : chunk) * 8);
    }),
              0);
    c = counters();
    EXPECT_EQ(c[6], 1u) << "one ldmatrix request";
    EXPECT_EQ(c[8], 4u) << "512 bytes: 4 wavefronts at best";
    EXPECT_EQ(c[7], swizzled ? 4u : 32u) << (swizzled ? "swizzled" : "unswizzled: each matrix's 8 rows in one bank group");
  }
}
