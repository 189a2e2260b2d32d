// The performance model (perf_model.h): its arithmetic on hand-made kernels,
// and that compile records it.
#include <gtest/gtest.h>

#include "kernels.h"
#include "perf_model.h"

using namespace cudagen;

namespace {

EmittedKernel kernel(int64_t blocks, int block, int64_t flops, int64_t bytes,
                     MatmulMainloop mainloop = MatmulMainloop::none) {
  EmittedKernel k;
  k.name = "k";
  k.grid[0] = blocks;
  k.block = block;
  k.flops = flops;
  k.bytes_read = bytes;
  k.mainloop = mainloop;
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
  // The last block runs alone at full speed (8 warps saturate its SM): a
  // quarter of the first wave's four blocks an SM more.
  EXPECT_NEAR(tail.seconds - h100.launch_seconds, 1.25 * (one_wave - h100.launch_seconds),
              0.01 * (one_wave - h100.launch_seconds));
  // 66 blocks of 8 warps leave half the SMs idle; 66 of 4 warps, three quarters of the GPU.
  const double half = estimate_kernel(kernel(66, 256, 0, bytes), h100).seconds - h100.launch_seconds;
  EXPECT_NEAR(half, 2 * (one_wave - h100.launch_seconds), 1e-9);
  const double quarter = estimate_kernel(kernel(66, 128, 0, bytes), h100).seconds - h100.launch_seconds;
  EXPECT_NEAR(quarter, 4 * (one_wave - h100.launch_seconds), 1e-9);
  const KernelEstimate one = estimate_kernel(kernel(1, 256, 0, 1024), h100);
  EXPECT_EQ(one.bound, "launch");
}

TEST(PerfModel, EachPathRunsAtItsCeiling) {
  const DeviceModel h100 = device_model("sm_90");
  const int64_t flops = int64_t(1) << 40;
  const KernelEstimate pipelined =
      estimate_kernel(kernel(132, 256, flops, 0, MatmulMainloop::pipelined), h100);
  const KernelEstimate tile = estimate_kernel(kernel(132 * 8, 128, flops, 0, MatmulMainloop::tensor_core_tile), h100);
  const KernelEstimate simt = estimate_kernel(kernel(132 * 4, 256, flops, 0, MatmulMainloop::portable_tile), h100);
  EXPECT_EQ(pipelined.blocks_per_sm, 1) << "its registers allow one 256-thread block";
  EXPECT_EQ(pipelined.bound, "compute");
  EXPECT_NEAR(pipelined.seconds, h100.launch_seconds + double(flops) / h100.pipelined_flops, 1e-9);
  EXPECT_DOUBLE_EQ(tile.ceiling_flops, h100.tensor_tile_flops);
  EXPECT_DOUBLE_EQ(simt.ceiling_flops, h100.simt_flops);
  EXPECT_LT(pipelined.seconds, tile.seconds);
  EXPECT_LT(tile.seconds, simt.seconds);
  // TF32 on the same mainloop: half the 16-bit tensor rate, as the dense peaks are.
  const KernelEstimate tf32 = estimate_kernel(kernel(132, 256, flops, 0, MatmulMainloop::pipelined_tf32), h100);
  EXPECT_DOUBLE_EQ(tf32.ceiling_flops, h100.pipelined_flops / 2);
  EXPECT_EQ(tf32.blocks_per_sm, 1);
  EXPECT_LT(device_model("sm_80").pipelined_flops, h100.pipelined_flops);
  EXPECT_EQ(device_model("sm_80").sms, 108);
}

// A target of another SM count (--sms): the same SMs, so the ceilings
// scale with their number; the name says so.
TEST(PerfModel, AnotherSmCountScalesTheCeilings) {
  const DeviceModel sxm = device_model("sm_90a"), pcie = device_model(Target{"sm_90a", 114});
  EXPECT_EQ(pcie.sms, 114);
  EXPECT_EQ(pcie.name, "H100 SXM at 114 SMs");
  EXPECT_DOUBLE_EQ(pcie.hopper_flops, sxm.hopper_flops * 114 / 132);
  EXPECT_DOUBLE_EQ(pcie.memory_bytes_per_s, sxm.memory_bytes_per_s);
  EXPECT_EQ(device_model(Target{"sm_90a", 132}).name, "H100 SXM") << "the model's own count changes nothing";
}

TEST(PerfModel, SharedMemoryLimitsResidentBlocks) {
  EmittedKernel k = kernel(1000, 128, 0, 1 << 20);
  k.smem_bytes = 100 * 1024;
  EXPECT_EQ(estimate_kernel(k, device_model("sm_90")).blocks_per_sm, 2);
}

// The GEMM tuning table (templates/gemm_tuning.json): the bundled one reads,
// picks the large tile from 4 full waves of 128 x 128 tiles on the arch's SMs
// (so an A100's 108 SMs take it sooner than an H100's 132), and a table that
// names a tile the mainloop is not checked for, or lacks a last rule for
// every product, is refused with the rule named.
TEST(GemmTuning, TheBundledTablePicksByFullWavesOnTheArch) {
  const std::vector<GemmTuningRule> table = parse_gemm_tuning(gemm_tuning_json(), "gemm_tuning.json");
  ASSERT_GE(table.size(), 2u);
  auto pick = [](int64_t M, int64_t N, const char* arch) {
    return pipelined_gemm_tile(DType::bf16, DType::bf16, M, N, 768, false, false, 1, arch);
  };
  EXPECT_EQ(pick(4096, 3072, "sm_90")->bm, 128);
  EXPECT_EQ(pick(4096, 3072, "sm_90")->rule, 0);
  EXPECT_EQ(pick(64, 3072, "sm_90")->bm, 64);
  // 18 x 24 = 432 tiles of 128 x 128: 4 full waves on 108 SMs, 3 on 132.
  EXPECT_EQ(pick(2304, 3072, "sm_80")->bm, 128);
  EXPECT_EQ(pick(2304, 3072, "sm_90")->bm, 64);
  std::string why;
  EXPECT_FALSE(pipelined_gemm_tile(DType::f32, DType::f32, 64, 64, 64, false, false, 1, "sm_90", &why));
  EXPECT_NE(why.find("unless TF32 is allowed (--allow-tf32)"), std::string::npos) << why;
  EXPECT_FALSE(pipelined_gemm_tile(DType::f16, DType::bf16, 64, 64, 64, false, false, 1, "sm_90", &why));
  EXPECT_NE(why.find("not both f16, both bf16"), std::string::npos) << why;
}

// f32 with TF32 allowed: the table's TF32 rules, the same bytes a stage at
// half the k (the large tile on 8 warps); contiguous axes in 16-byte chunks
// of 4 floats.
TEST(GemmTuning, Tf32TakesItsOwnRules) {
  auto pick = [](int64_t M, int64_t N, int64_t K, const char* arch, std::string* why = nullptr) {
    return pipelined_gemm_tile(DType::f32, DType::f32, M, N, K, false, false, 1, arch, why, /*allow_tf32=*/true);
  };
  const GemmTile large = *pick(4096, 3072, 768, "sm_90");
  EXPECT_EQ(large.rule, 2);
  EXPECT_TRUE(large.tf32());
  EXPECT_EQ(large.bk, 32);
  EXPECT_EQ(large.threads(), 256);
  EXPECT_EQ(large.shared_bytes(), 3 * (128 + 128) * 32 * 4);
  EXPECT_NE(large.describe().find("128 x 128 x 32 tiles (TF32)"), std::string::npos) << large.describe();
  const GemmTile small = *pick(64, 768, 3072, "sm_90");
  EXPECT_EQ(small.bk, 16);
  EXPECT_EQ(small.split_k, 11);  // 192 k-tiles of 16: 11 parts of 18
  EXPECT_EQ(small.shared_bytes(), 4 * (64 + 64) * 16 * 4);  // 4 stages of 8 KiB
  std::string why;
  EXPECT_FALSE(pick(64, 66, 64, "sm_90", &why));
  EXPECT_NE(why.find("not multiples of 4 elements (16 bytes)"), std::string::npos) << why;
  EXPECT_TRUE(pick(64, 68, 64, "sm_90"));  // 68 floats: whole 16-byte chunks (a 16-bit operand needs 8)
}

// Split-K (docs/gemm.md): a product whose tiles fill less than a wave cuts
// its k range into the parts that bring its blocks closest to one wave, each
// of at least kMinKTilesPerSplit k-tiles, in equal parts; a product that
// fills the SMs, or whose K is short, is not split.
TEST(GemmTuning, SplitKFillsOneWaveOfSmallProducts) {
  auto pick = [](int64_t M, int64_t N, int64_t K, int64_t batches, const char* arch) {
    return *pipelined_gemm_tile(DType::bf16, DType::bf16, M, N, K, false, false, batches, arch);
  };
  // 64 rows of a 768 x 3072 down projection: 12 tiles of 64 x 64, 96 k-tiles of 32.
  const GemmTile down = pick(64, 768, 3072, 1, "sm_90");
  EXPECT_EQ(down.split_k, 11);  // 132 / 12 = 11 parts of 9 k-tiles (the last 6)
  EXPECT_EQ(down.k_tiles_per_split, 9);
  EXPECT_EQ(pick(64, 768, 3072, 1, "sm_80").split_k, 9);  // 108 / 12 = 9 parts of 11 (the last 8)
  // An H100 PCIe (--sms 114): 114 / 12 = 9 parts.
  EXPECT_EQ(pipelined_gemm_tile(DType::bf16, DType::bf16, 64, 768, 3072, false, false, 1, Target{"sm_90", 114})->split_k, 9);
  EXPECT_EQ(pick(64, 3072, 768, 1, "sm_90").split_k, 2);  // 48 tiles: 2 parts of 12
  EXPECT_EQ(pick(64, 768, 200, 1, "sm_90").split_k, 1);   // 7 k-tiles: too short to split
  EXPECT_EQ(pick(1024, 768, 3072, 1, "sm_90").split_k, 1); // 192 tiles: more than a wave
  EXPECT_EQ(pick(64, 768, 3072, 8, "sm_90").split_k, 1);  // 96 tiles over 8 batches: 132 / 96 = 1
  EXPECT_EQ(pick(4096, 4096, 4096, 1, "sm_90").split_k, 1);  // the large tile's rule allows none
  const GemmTile limited = with_split_k(down, 4, 64, 768, 3072, 1, 132);
  EXPECT_EQ(limited.split_k, 4);
  EXPECT_EQ(limited.k_tiles_per_split, 24);
  EXPECT_NE(down.describe().find("split-K 11 ways (9 k-tiles each)"), std::string::npos) << down.describe();
}

TEST(GemmTuning, ABadTableNamesTheRule) {
  auto error_of = [](const std::string& text) {
    try {
      parse_gemm_tuning(text, "t.json");
      return std::string("read");
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
  };
  const std::string head = R"({"format": "cudagen.gemm-tuning/1", "rules": [)";
  EXPECT_NE(error_of(head + R"({"arch": "any", "tile": [64, 64, 32, 2, 2, 4]}]})").find("no rule for tf32 operands"),
            std::string::npos);
  const std::string tf32 = R"(, {"operands": "tf32", "arch": "any", "tile": [64, 64, 16, 2, 2, 4]}]})";
  EXPECT_NE(error_of(head + R"({"arch": "any", "tile": [64, 64, 64, 2, 2, 4]})" + tf32).find("t.json: /rules/0/tile"),
            std::string::npos);
  EXPECT_NE(error_of(head + R"({"arch": "sm_90", "tile": [64, 64, 32, 2, 2, 4]})" + tf32).find("matches every product"),
            std::string::npos);
  EXPECT_NE(error_of(head + R"({"arch": "any", "tile": [64, 64, 32, 2, 2, 4], "max_split_k": 0})" + tf32)
                .find("t.json: /rules/0/max_split_k: 0 is not between 1 and 32"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"format": "other", "rules": []})").find("/format"), std::string::npos);
  // A TF32 rule takes TF32 tiles (half the k), and each kind of operands ends in a rule for every product.
  const std::string sixteen = R"({"arch": "any", "tile": [64, 64, 32, 2, 2, 4]})";
  EXPECT_EQ(error_of(head + sixteen + R"(, {"operands": "tf32", "arch": "any", "tile": [64, 64, 16, 2, 2, 4]}]})"), "read");
  EXPECT_NE(error_of(head + sixteen + R"(, {"operands": "tf32", "arch": "any", "tile": [64, 64, 32, 2, 2, 4]}]})")
                .find("t.json: /rules/1/tile: [64, 64, 32, 2, 2, 4] is not a tile the mainloop is checked for with TF32"),
            std::string::npos);
  EXPECT_NE(error_of(head + sixteen + R"(, {"operands": "tf32", "arch": "sm_80", "tile": [64, 64, 16, 2, 2, 4]}]})")
                .find("/rules/1: the last rule for tf32 operands matches every product"),
            std::string::npos);
  EXPECT_NE(error_of(head + sixteen + R"(, {"operands": "f32", "arch": "any", "tile": [64, 64, 16, 2, 2, 4]}]})")
                .find("/rules/1/operands"),
            std::string::npos);
  EXPECT_NE(error_of("{").find("t.json: line 1"), std::string::npos);
}
