#include "half.h"

#include <cfenv>
#include <cmath>
#include <cstring>

namespace cudagen {

namespace {

// |value| as sign, and a binary float format of `mantissa_bits` stored bits,
// exponent bias `bias` and largest exponent field `max_exponent` (all ones is
// inf/NaN): the nearest representable value, ties to even.
uint16_t round_to_format(float value, int mantissa_bits, int bias, int max_exponent, uint16_t quiet_nan) {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  if (std::isnan(value)) return sign | quiet_nan;
  const uint16_t inf = uint16_t(max_exponent << mantissa_bits);
  const double a = std::fabs(double(value));
  if (std::isinf(value)) return sign | inf;
  const double smallest_normal = std::ldexp(1.0, 1 - bias);
  // nearbyint rounds ties to even in the default rounding mode.
  if (a < smallest_normal) return sign | uint16_t(std::nearbyint(std::ldexp(a, bias - 1 + mantissa_bits)));
  int e = 0;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1): its exponent is e - 1
  double q = std::nearbyint(std::ldexp(a, mantissa_bits + 1 - e));
  int exponent = e - 1;
  if (q == std::ldexp(1.0, mantissa_bits + 1)) {
    q /= 2;
    ++exponent;
  }
  if (exponent + bias >= max_exponent) return sign | inf;
  return sign | uint16_t((exponent + bias) << mantissa_bits) | uint16_t(q - std::ldexp(1.0, mantissa_bits));
}

float from_format(uint16_t bits, int mantissa_bits, int bias, int max_exponent) {
  const int exponent = (bits & 0x7fff) >> mantissa_bits, mantissa = bits & ((1 << mantissa_bits) - 1);
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  if (exponent == max_exponent) return float(mantissa ? NAN : sign * INFINITY);
  if (exponent == 0) return float(sign * std::ldexp(double(mantissa), 1 - bias - mantissa_bits));
  return float(sign * std::ldexp(double(mantissa + (1 << mantissa_bits)), exponent - bias - mantissa_bits));
}

}  // namespace

float f16_to_float(uint16_t bits) { return from_format(bits, 10, 15, 31); }
uint16_t float_to_f16(float value) { return round_to_format(value, 10, 15, 31, 0x7e00); }
float bf16_to_float(uint16_t bits) { return from_format(bits, 7, 127, 255); }
uint16_t float_to_bf16(float value) { return round_to_format(value, 7, 127, 255, 0x7fc0); }

}  // namespace cudagen
