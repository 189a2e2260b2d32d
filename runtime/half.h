// f16 and bf16 on the host: the runtime's own conversions (inputs, outputs,
// .npy files), written independently of the prelude's bit manipulation (by
// scaling and rounding in double) so that a test can compare the two.
// Round to nearest even; NaN stays NaN.
#pragma once

#include <cstdint>

namespace cudagen {

float f16_to_float(uint16_t bits);
uint16_t float_to_f16(float value);
float bf16_to_float(uint16_t bits);
uint16_t float_to_bf16(float value);

}  // namespace cudagen
