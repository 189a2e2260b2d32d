// Shared-memory tiled matmul (f32, portable): the block computes one BM x BN
// tile of the output with 256 threads, each accumulating a 2 x 2 patch.
// Operands are read through load_a(m, k) and load_b(k, n) (where fusion puts
// a prologue, and where transposes are expressed), results leave through
// epilogue(m, n, acc). Shared memory: 4 * (BM * (BK + 1) + BK * (BN + 1))
// bytes; the +1 columns keep the inner loop free of bank conflicts.
template <int BM, int BN, int BK, typename LoadA, typename LoadB, typename Epilogue>
CG_OP("matmul",
      "pattern: matmul",
      "autocast: low",
      "epilogue: out",
      "prologue: a b",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: a input T",
      "tensor: b input T",
      "tensor: out output T",
      "arg: trans_a bool = false",
      "arg: trans_b bool = false",
      "arg: alpha float = 1.0",
      "shape: a:[...A, trans_a ? K : M, trans_a ? M : K] b:[...C, trans_b ? N : K, trans_b ? K : N] -> out:[...broadcast(A, C), M, N]",
      "smem: 4 * (BM * (BK + 1) + BK * (BN + 1))",
      "variant: cg_matmul_tile_mma",
      "variant: cg_gemm_mainloop",
      "variant: cg_gemm_each_pair",
      "variant: cg_gemm_each_coalesced",
      "variant: cg_gemm_each_coalesced_vector",
      "variant: cg_gemm_config",
      "variant: cg_gemm_split_k",
      "variant: cg_sgemm_mainloop",
      "variant: cg_sgemm_each_coalesced",
      "variant: cg_sgemm_each_coalesced_vector",
      "variant: cg_sgemm_config",
      "variant: cg_gemm_sm90",
      "variant: cg_sm90_gemm_config",
      "flops: 2 * numel(out) * K",
      "doc: alpha * op(a) @ op(b), batched over leading axes with numpy broadcasting (as torch.matmul); f16/bf16 accumulate in f32. Its gradients are matmuls with transposed operands")
CG_DEVICE void cg_matmul_tile(LoadA load_a, LoadB load_b, Epilogue epilogue, int M, int N, int K, int tile_m,
                              int tile_n, float* smem) {
  static_assert(BM == 32 && BN == 32, "the thread layout below assumes 32 x 32 tiles and 256 threads");
  float* a_tile = smem;                   // [BM][BK + 1]
  float* b_tile = smem + BM * (BK + 1);   // [BK][BN + 1]
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int m0 = tile_m * BM, n0 = tile_n * BN;
  float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
  for (int k0 = 0; k0 < K; k0 += BK) {
    for (int e = threadIdx.x; e < BM * BK; e += blockDim.x) {
      const int r = e / BK, c = e % BK;
      a_tile[r * (BK + 1) + c] = (m0 + r < M && k0 + c < K) ? load_a(m0 + r, k0 + c) : 0.0f;
    }
    for (int e = threadIdx.x; e < BK * BN; e += blockDim.x) {
      const int r = e / BN, c = e % BN;
      b_tile[r * (BN + 1) + c] = (k0 + r < K && n0 + c < N) ? load_b(k0 + r, n0 + c) : 0.0f;
    }
    __syncthreads();
    for (int kk = 0; kk < BK; ++kk) {
      const float a0 = a_tile[ty * (BK + 1) + kk], a1 = a_tile[(ty + 16) * (BK + 1) + kk];
      const float b0 = b_tile[kk * (BN + 1) + tx], b1 = b_tile[kk * (BN + 1) + tx + 16];
      acc[0][0] += a0 * b0;
      acc[0][1] += a0 * b1;
      acc[1][0] += a1 * b0;
      acc[1][1] += a1 * b1;
    }
    __syncthreads();  // the next iteration overwrites the tiles
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      const int m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
      if (m < M && n < N) epilogue(m, n, acc[i][j]);
    }
}

// The tensor-core tile for f16 and bf16 operands (T), f32 accumulation: the
// block computes a 64 x 64 tile of the output with 4 warps in 2 x 2, each
// warp a 32 x 32 patch of 2 x 4 mma tiles of 16 x 8. Operands are read
// through load_a(m, k) and load_b(k, n) as floats (exactly representable in
// T: they came from T) and kept in shared memory as T; results leave through
// epilogue(m, n, acc). Shared memory: 2 * (BM * (BK + 8) + BK * (BN + 8))
// bytes; the padding staggers the rows across banks.
template <int BM, int BN, int BK, typename T, typename LoadA, typename LoadB, typename Epilogue>
CG_DEVICE void cg_matmul_tile_mma(LoadA load_a, LoadB load_b, Epilogue epilogue, int M, int N, int K, int tile_m,
                                  int tile_n, T* smem) {
  static_assert(BM == 64 && BN == 64 && BK == 16, "the warp layout below assumes 64 x 64 x 16 tiles and 4 warps");
  T* a_tile = smem;                  // [BM][BK + 8]
  T* b_tile = smem + BM * (BK + 8);  // [BK][BN + 8]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int warp_m = (warp >> 1) * 32, warp_n = (warp & 1) * 32;
  const int m0 = tile_m * BM, n0 = tile_n * BN;
  float acc[2][4][4];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j)
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
  // Operands go through registers a k-tile ahead: each thread issues its
  // loads of the next k-tile (independent of each other) before this one's
  // mma, so that their latencies overlap each other and the math. A loop that
  // stored each loaded element to shared memory before loading the next one
  // waited out a load's latency per element: about 4 us a k-tile, 200 us for
  // a GPT-2 block's q/k/v at 64 rows on an H200 (bench/RESULTS.md, 2026-11-27).
  // Blocks have at least the 4 computing warps, so 128 threads' slots cover a tile.
  constexpr int kASlots = (BM * BK + 127) / 128, kBSlots = (BK * BN + 127) / 128;
  float a_next[kASlots], b_next[kBSlots];
  auto fetch = [&](int k0) {
    CG_UNROLL
    for (int s = 0; s < kASlots; ++s) {
      const int e = threadIdx.x + s * blockDim.x, r = e / BK, c = e % BK;
      a_next[s] = (e < BM * BK && m0 + r < M && k0 + c < K) ? load_a(m0 + r, k0 + c) : 0.0f;
    }
    CG_UNROLL
    for (int s = 0; s < kBSlots; ++s) {
      const int e = threadIdx.x + s * blockDim.x, r = e / BN, c = e % BN;
      b_next[s] = (e < BK * BN && k0 + r < K && n0 + c < N) ? load_b(k0 + r, n0 + c) : 0.0f;
    }
  };
  if (K > 0) fetch(0);
  for (int k0 = 0; k0 < K; k0 += BK) {
    CG_UNROLL
    for (int s = 0; s < kASlots; ++s)
      if (const int e = threadIdx.x + s * blockDim.x; e < BM * BK)
        a_tile[e / BK * (BK + 8) + e % BK] = cg_narrow<T>(a_next[s]);
    CG_UNROLL
    for (int s = 0; s < kBSlots; ++s)
      if (const int e = threadIdx.x + s * blockDim.x; e < BK * BN)
        b_tile[e / BN * (BN + 8) + e % BN] = cg_narrow<T>(b_next[s]);
    __syncthreads();
    if (k0 + BK < K) fetch(k0 + BK);  // in flight during the mma below
    // Four warps compute; a larger block (a megakernel's) only helps load.
    for (int i = 0; i < 2 && warp < 4; ++i) {
      T a[8];
      for (int e = 0; e < 8; ++e)
        a[e] = a_tile[(warp_m + 16 * i + g + 8 * (e / 2 % 2)) * (BK + 8) + 2 * t + e % 2 + 8 * (e / 4)];
      for (int j = 0; j < 4; ++j) {
        T b[4];
        for (int e = 0; e < 4; ++e) b[e] = b_tile[(2 * t + e % 2 + 8 * (e / 2)) * (BN + 8) + warp_n + 8 * j + g];
        cg_mma_16x8x16(acc[i][j], a, b);
      }
    }
    __syncthreads();  // the next iteration overwrites the tiles
  }
  // Unrolled, so that acc stays in registers: with a large epilogue in the
  // body ptxas kept this loop rolled and acc in local memory.
  CG_UNROLL
  for (int i = 0; i < 2; ++i)
    CG_UNROLL
    for (int j = 0; j < 4; ++j)
      CG_UNROLL
      for (int e = 0; e < 4; ++e) {
        if (warp >= 4) continue;
        const int m = m0 + warp_m + 16 * i + g + 8 * (e / 2), n = n0 + warp_n + 8 * j + 2 * t + e % 2;
        if (m < M && n < N) epilogue(m, n, acc[i][j][e]);
      }
}
