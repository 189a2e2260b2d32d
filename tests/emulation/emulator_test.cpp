// The emulation header and scheduler on hand-written kernels: warp shuffles,
// static shared memory, atomics, barriers and block indices behave as on a GPU.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "cudagen_emu.h"
#include "emu_launch.h"

using Launch = cudagen::testing::EmuLaunch;

TEST(Emulator, ShufflesFollowCudaSemantics) {
  Launch l;
  int* down = l.tensor<int>("down", 0, 64);
  int* up = l.tensor<int>("up", 1024, 64);
  int* xor_ = l.tensor<int>("xor", 2048, 64);
  int* bcast = l.tensor<int>("bcast", 3072, 64);
  ASSERT_EQ(l.run("shuffles", dim3(1), dim3(64), 0, [&] {
    int t = int(threadIdx.x);
    cudagen_emu::store(down, t, __shfl_down_sync(0xffffffffu, t, 3));
    cudagen_emu::store(up, t, __shfl_up_sync(0xffffffffu, t, 1, 16));
    cudagen_emu::store(xor_, t, __shfl_xor_sync(0xffffffffu, t, 5));
    cudagen_emu::store(bcast, t, __shfl_sync(0xffffffffu, t, 7));
  }), 0) << cudagen_emu_last_error();
  for (int t = 0; t < 64; ++t) {
    int lane = t % 32, warp = t - lane;
    EXPECT_EQ(down[t], lane + 3 < 32 ? t + 3 : t) << t;
    EXPECT_EQ(up[t], lane % 16 >= 1 ? t - 1 : t) << t;
    EXPECT_EQ(xor_[t], warp + (lane ^ 5)) << t;
    EXPECT_EQ(bcast[t], warp + 7) << t;
  }
}

TEST(Emulator, StaticSharedMemoryBarriersAndAtomics) {
  Launch l;
  float* sums = l.tensor<float>("sums", 0, 6);
  int* counter = l.tensor<int>("counter", 256, 1);
  ASSERT_EQ(l.run("reverse_sum", dim3(3, 2), dim3(128), 0, [&] {
    __shared__ float values[128];
    int t = int(threadIdx.x);
    values[t] = float(t + 1);
    __syncthreads();
    float mine = values[127 - t];  // another thread's value: needs the barrier
    __syncthreads();
    values[t] = mine;
    __syncthreads();
    if (t == 0) {
      float s = 0;
      for (int i = 0; i < 128; ++i) s += values[i];
      cudagen_emu::store(sums, blockIdx.y * gridDim.x + blockIdx.x, s);
    }
    atomicAdd(counter, 1);
  }), 0) << cudagen_emu_last_error();
  for (int b = 0; b < 6; ++b) EXPECT_EQ(sums[b], 128.0f * 129.0f / 2) << b;
  EXPECT_EQ(*counter, 6 * 128);
}

TEST(Emulator, DynamicSharedMemoryIsPoisonedForEachBlock) {
  Launch l;
  unsigned* seen = l.tensor<unsigned>("seen", 0, 4);
  ASSERT_EQ(l.run("poison", dim3(4), dim3(32), 64, [&] {
    unsigned* smem = reinterpret_cast<unsigned*>(cudagen_emu::dynamic_smem());
    if (threadIdx.x == 0) {
      cudagen_emu::store(seen, blockIdx.x, smem[3]);  // before anyone writes: poison, not the last block's value
      smem[3] = 12345;
    }
  }), 0) << cudagen_emu_last_error();
  for (int b = 0; b < 4; ++b) EXPECT_EQ(seen[b], 0xFFFFFFFFu) << b;
}

TEST(Emulator, BlockOrderIsShuffledButDeterministicPerSeed) {
  auto order = [](unsigned long long seed) {
    cudagen_emu_configure(seed);
    Launch l;
    int* next = l.tensor<int>("next", 0, 1);
    int* when = l.tensor<int>("when", 64, 16);
    l.run("order", dim3(16), dim3(1), 0, [&] { cudagen_emu::store(when, blockIdx.x, (*next)++); });
    return std::vector<int>(when, when + 16);
  };
  std::vector<int> identity(16);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(order(1), order(1));
  EXPECT_NE(order(1), identity) << "blocks must not run in index order";
  EXPECT_NE(order(1), order(2));
}

TEST(Emulator, RejectsBlocksLargerThanTheHardware) {
  Launch l;
  EXPECT_EQ(l.run("too_big", dim3(1), dim3(2048), 0, [] {}), 1);
  EXPECT_NE(std::string(cudagen_emu_last_error()).find("block of 2048 threads"), std::string::npos);
}

// A launch a GPU refuses is refused here too (issue #34): the emulator had
// run grids with y of 65536 and more.
TEST(Emulator, RejectsGridsAndSharedMemoryTheHardwareRefuses) {
  Launch l;
  EXPECT_EQ(l.run("tall", dim3(1, 65536), dim3(32), 0, [] {}), 1);
  EXPECT_NE(std::string(cudagen_emu_last_error()).find("grid of 1 x 65536 x 1 blocks"), std::string::npos)
      << cudagen_emu_last_error();
  EXPECT_EQ(l.run("deep", dim3(1, 1, 70000), dim3(32), 0, [] {}), 1);
  EXPECT_EQ(l.run("empty", dim3(0), dim3(32), 0, [] {}), 1);
  EXPECT_EQ(l.run("big_smem", dim3(1), dim3(32), 227 * 1024 + 16, [] {}), 1);
  EXPECT_NE(std::string(cudagen_emu_last_error()).find("bytes of dynamic shared memory"), std::string::npos)
      << cudagen_emu_last_error();
  EXPECT_EQ(l.run("at_the_limits", dim3(1, 65535), dim3(1), 227 * 1024, [] {}), 0) << cudagen_emu_last_error();
}
