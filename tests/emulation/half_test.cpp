// The prelude's f16/bf16 conversions (the portable path that the emulator and
// any non-CUDA build run) against the runtime's own, written independently:
// every 16-bit pattern, and floats chosen to hit every rounding case.
#include <cmath>
#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include "cudagen_emu.h"
#include "half.h"
#include "prelude.cuh"

namespace {

float float_of(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

void expect_same_rounding(float f) {
  uint16_t host_h = cudagen::float_to_f16(f), prelude_h = cg_float_to_f16_bits(f);
  uint16_t host_b = cudagen::float_to_bf16(f), prelude_b = cg_float_to_bf16_bits(f);
  if (std::isnan(f)) {
    EXPECT_TRUE(std::isnan(cudagen::f16_to_float(prelude_h)) && std::isnan(cudagen::bf16_to_float(prelude_b)));
    return;
  }
  EXPECT_EQ(prelude_h, host_h) << "f16 of " << f;
  EXPECT_EQ(prelude_b, host_b) << "bf16 of " << f;
}

}  // namespace

TEST(Half, EverySixteenBitPatternWidensTheSame) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    float host_h = cudagen::f16_to_float(uint16_t(bits)), prelude_h = cg_f16_bits_to_float(uint16_t(bits));
    float host_b = cudagen::bf16_to_float(uint16_t(bits)), prelude_b = cg_bf16_bits_to_float(uint16_t(bits));
    if (std::isnan(host_h)) EXPECT_TRUE(std::isnan(prelude_h)) << bits;
    else EXPECT_EQ(prelude_h, host_h) << "f16 bits " << bits;
    if (std::isnan(host_b)) EXPECT_TRUE(std::isnan(prelude_b)) << bits;
    else EXPECT_EQ(prelude_b, host_b) << "bf16 bits " << bits;
    // Widening then narrowing gives the pattern back (NaN aside).
    if (!std::isnan(host_h)) EXPECT_EQ(cg_float_to_f16_bits(prelude_h), bits);
    if (!std::isnan(host_b)) EXPECT_EQ(cg_float_to_bf16_bits(prelude_b), bits);
  }
}

TEST(Half, NarrowingRoundsToNearestEvenEverywhere) {
  // Each f16 and bf16 value, the midpoints to its neighbours, and one float either side of them.
  for (uint32_t bits = 0; bits < 0x7c00; ++bits) {
    double lo = cudagen::f16_to_float(uint16_t(bits)), hi = cudagen::f16_to_float(uint16_t(bits + 1));
    float mid = float((lo + hi) / 2);
    for (float f : {float(lo), mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      expect_same_rounding(f);
      expect_same_rounding(-f);
    }
  }
  for (uint32_t bits = 0; bits < 0x7f80; ++bits) {
    uint32_t lo = bits << 16, mid = lo + 0x8000;
    for (uint32_t u : {lo, mid, mid - 1, mid + 1}) expect_same_rounding(float_of(u));
  }
  std::mt19937 rng(12345);
  for (int i = 0; i < 200000; ++i) expect_same_rounding(float_of(rng()));
  for (float f : {65504.0f, 65519.99f, 65520.0f, 1e30f, INFINITY, -INFINITY, NAN, 0x1p-25f, 0x1.8p-25f, 0x1p-26f, 0.0f,
                  -0.0f, 3.0e38f, 0x1p-130f})
    expect_same_rounding(f);
  EXPECT_EQ(cg_float_to_f16_bits(65520.0f), 0x7c00) << "the tie above the largest f16 rounds to infinity";
  EXPECT_EQ(cg_float_to_f16_bits(0x1p-25f), 0x0000) << "the tie below the smallest subnormal rounds to zero (even)";
  EXPECT_EQ(cg_float_to_f16_bits(0x1.8p-25f), 0x0001);
}
