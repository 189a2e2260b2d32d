// CuTe's own layouts, computed on the host from CUTLASS's headers (the
// nvidia-cutlass wheel; tests only): the independent oracle that the Hopper
// mainloop's shared-memory swizzles, wgmma descriptors and accumulator
// fragments, and the emulator's decoding of them, are checked against
// (issue #38; tests/emulation/gemm_sm90_test.cpp). CuTe lives in its own
// translation unit, away from the emulation's CUDA macros.
#pragma once

#include <cstdint>

namespace cudagen::cute_oracle {

// The element offset of (row, k) in a 16-bit K-major tile of `rows` rows (8,
// 64 or 128) by 64 k, as CuTe lays it out for wgmma: its
// GMMA::Layout_K_SW128_Atom (8 rows of 128 bytes under Swizzle<3, 4, 3>)
// tiled to rows x 64. A TMA box with the 128-byte swizzle lands so.
int k_major_offset(int rows, int row, int k);

// The element offset of (n, k) in a 16-bit N-major tile of 128 n by 64 k,
// as CuTe lays it out from GMMA::Layout_MN_SW128_Atom (64 n by 8 k) tiled k
// first: the mainloop's B stored K x N, two TMA boxes of 64 columns.
int mn_major_offset(int n, int k);

// CuTe's wgmma descriptor (make_gmma_desc) for k step `kk` (16 elements) of
// those tiles starting at shared address `base` (1024-byte aligned).
uint64_t k_major_descriptor(int rows, unsigned base, int kk);
uint64_t mn_major_descriptor(unsigned base, int kk);

// CuTe's layout of an m64n128 f32 result (SM90::GMMA::CLayout_64x128): the
// index m + 64 n of the element that thread `thread` (0-127) of the
// warpgroup holds in its accumulator `value` (0-63).
int accumulator_index(int thread, int value);

}  // namespace cudagen::cute_oracle
