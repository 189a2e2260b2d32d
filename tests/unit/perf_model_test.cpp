// The performance model (perf_model.h): its arithmetic on hand-made kernels,
// and that compile records it.
#include <gtest/gtest.h>

#include "perf_model.h"

using namespace cudagen;

namespace {

EmittedKernel kernel(int64_t blocks, int block, int64_t flops, int64_t bytes, const std::string& path = "") {
  EmittedKernel k;
  k.name = "k";
  k.grid[0] = blocks;
  k.block = block;
  k.flops = flops;
  k.bytes_read = bytes;
  k.matmul_path = path;
  return k;
}

}  // namespace

TEST(PerfModel, AFullMemoryBoundKernelTakesItsBytesOverTheBandwidth) {
  const DeviceModel h100 = device_model("sm_90");
  // 256-thread blocks of 64 registers a thread, 4 resident per SM: 132 x 4
  // blocks fill one wave exactly.
  const KernelEstimate e = estimate_kernel(kernel(132 * 4, 256, 0, int64_t(1) << 30), h100);
  EXPECT_EQ(e.blocks_per_sm, 4);
  EXPECT_EQ(e.waves, 1);
  EXPECT_EQ(e.bound, "memory");
  EXPECT_DOUBLE_EQ(e.seconds, h100.launch_seconds + double(int64_t(1) << 30) / h100.memory_bytes_per_s);
}

TEST(PerfModel, ATailWaveAndFewBlocksCostTheirShare) {
  const DeviceModel h100 = device_model("sm_90");
  const int64_t full = 132 * 4, bytes = int64_t(1) << 30;
  const double one_wave = estimate_kernel(kernel(full, 256, 0, bytes), h100).seconds;
  const KernelEstimate tail = estimate_kernel(kernel(full + 1, 256, 0, bytes), h100);
  EXPECT_EQ(tail.waves, 2);
  EXPECT_GT(tail.seconds, 1.9 * (one_wave - h100.launch_seconds));
  const KernelEstimate one = estimate_kernel(kernel(1, 256, 0, 1024), h100);
  EXPECT_EQ(one.bound, "launch");
}

TEST(PerfModel, EachPathRunsAtItsCeiling) {
  const DeviceModel h100 = device_model("sm_90");
  const int64_t flops = int64_t(1) << 40;
  const KernelEstimate pipelined =
      estimate_kernel(kernel(132, 256, flops, 0, "the pipelined mainloop (templates/gemm.cuh), 128 x 128"), h100);
  const KernelEstimate tile = estimate_kernel(kernel(132 * 8, 128, flops, 0, "the 64 x 64 tile (templates/matmul.cuh)"), h100);
  const KernelEstimate simt = estimate_kernel(kernel(132 * 4, 256, flops, 0, "the f32 tile"), h100);
  EXPECT_EQ(pipelined.blocks_per_sm, 1) << "its registers allow one 256-thread block";
  EXPECT_EQ(pipelined.bound, "compute");
  EXPECT_NEAR(pipelined.seconds, h100.launch_seconds + double(flops) / h100.pipelined_flops, 1e-9);
  EXPECT_DOUBLE_EQ(tile.ceiling_flops, h100.tensor_tile_flops);
  EXPECT_DOUBLE_EQ(simt.ceiling_flops, h100.simt_flops);
  EXPECT_LT(pipelined.seconds, tile.seconds);
  EXPECT_LT(tile.seconds, simt.seconds);
  EXPECT_LT(device_model("sm_80").pipelined_flops, h100.pipelined_flops);
  EXPECT_EQ(device_model("sm_80").sms, 108);
}

TEST(PerfModel, SharedMemoryLimitsResidentBlocks) {
  EmittedKernel k = kernel(1000, 128, 0, 1 << 20);
  k.smem_bytes = 100 * 1024;
  EXPECT_EQ(estimate_kernel(k, device_model("sm_90")).blocks_per_sm, 2);
}
