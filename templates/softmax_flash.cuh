// Flash attention, forward (docs/attention.md): softmax(scale q k^T) v for a
// tile of query rows of one head, without the rows of scores ever leaving
// registers, at any number of keys. After FlashAttention-2 (Dao, 2023):
//   - a block of WARPS warps owns BLOCK_M = 16 WARPS query rows, a warp 16;
//     the tile of q is copied to shared memory once and read into mma
//     fragments (ldmatrix) that stay in registers;
//   - keys and values stream through shared memory BLOCK_N rows at a time,
//     STAGES tiles in flight (16-byte cp.async, swizzled tiles: the GEMM
//     mainloop's operands, templates/gemm.cuh);
//   - s = q k^T and o += p v both on tensor cores (mma.sync m16n8k16, f32
//     accumulation); the probabilities p go from s's accumulators to the A
//     fragments of p v in registers (the two layouts line up);
//   - the softmax is online: each row keeps its running maximum m and sum l
//     (in log2 units, the scale folded into one multiply before exp2), and
//     o is rescaled when m grows; o / l at the end;
//   - causal attention (key j <= query row i, both counted from 0: the
//     top-left alignment of PyTorch's scaled_dot_product_attention) visits
//     no key tile past the tile's last row, and masks only the tiles that
//     cross the diagonal or the last keys.
// The output tile goes through shared memory so that the stores coalesce.
// Keys past Tk are zero-filled by the copies and masked. Where few query rows
// meet many keys (decoding), cg_flash_attention_split cuts the keys into
// ranges, a block each, and combines them in a fixed order.

// The kernel's compile-time shape: the tiles' widths for the heads of q and
// k (D) and of v (DV), and the heads' own sizes (HEAD_D, HEAD_DV: at most the
// tiles', multiples of 8, so that rows are whole 16-byte chunks). A head
// narrower than its tile (80 or 96 values in a tile of 128) is padded: the
// copies fill the columns past it with zeros, which add nothing to q . k,
// and the output's are not stored.
template <int D_, int DV_, int BLOCK_M_, int BLOCK_N_, int STAGES_, int HEAD_D_ = D_, int HEAD_DV_ = DV_>
struct cg_flash_config {
  static constexpr int D = D_, DV = DV_, BLOCK_M = BLOCK_M_, BLOCK_N = BLOCK_N_, STAGES = STAGES_;
  static constexpr int HEAD_D = HEAD_D_, HEAD_DV = HEAD_DV_;
  static_assert(HEAD_D <= D && HEAD_DV <= DV && HEAD_D % 8 == 0 && HEAD_DV % 8 == 0,
                "heads of whole 16-byte chunks, no wider than their tiles");
  static constexpr int WARPS = BLOCK_M / 16, THREADS = 32 * WARPS;
  static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0 && D % 16 == 0 && DV % 16 == 0,
                "whole mma tiles: 16 query rows a warp, keys and head sizes in pairs of n8 tiles");
  static_assert(STAGES >= 2, "a key tile is copied while the one before is read");
  // Row stride of the staged output tile, in floats: a warp's 8-byte stores of
  // one accumulator pair (8 rows x 4 lanes a half-warp) fall on 32 distinct banks.
  static constexpr int OUT_STRIDE = DV + 8;
};

// Shared memory of cg_flash_attention, in bytes (elements of T, 2 bytes): the
// q tile and STAGES tiles of keys and values; the staged output tile (floats)
// reuses it after the last key tile.
template <typename Config, typename T>
struct cg_flash_shared {
  static constexpr int q_elements = Config::BLOCK_M * Config::D;
  static constexpr int k_elements = Config::BLOCK_N * Config::D, v_elements = Config::BLOCK_N * Config::DV;
  static constexpr int stages = (int)sizeof(T) * (q_elements + Config::STAGES * (k_elements + v_elements));
  static constexpr int staged = 4 * Config::BLOCK_M * Config::OUT_STRIDE;
  static constexpr int bytes = stages > staged ? stages : staged;
};

// Two floats as the packed 16-bit pair an mma fragment register holds (the
// first in the low half), rounded to nearest even: one cvt on sm_80 and later.
CG_DEVICE unsigned int cg_narrow_pair(float lo, float hi, cg_f16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned int r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (unsigned int)cg_float_to_f16_bits(lo) | ((unsigned int)cg_float_to_f16_bits(hi) << 16);
#endif
}
CG_DEVICE unsigned int cg_narrow_pair(float lo, float hi, cg_bf16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned int r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (unsigned int)cg_float_to_bf16_bits(lo) | ((unsigned int)cg_float_to_bf16_bits(hi) << 16);
#endif
}

// 2^x, the special-function unit's approximation on the device (MUFU.EX2,
// relative error about 2^-22, far under a 16-bit probability's rounding);
// exp2f in the host emulation. exp2(-inf) is 0 in both.
CG_DEVICE float cg_exp2_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// A warp's rows after the key tiles it has seen: its rows' output
// accumulators (o, not yet divided by the sums; the mma layout: element
// (g + 8 (e / 2), 8 j + 2 t + e % 2) of the warp's 16 rows in o[j][e]), their
// running maxima (log2 units) and their sums (each lane its part during the
// mainloop, the whole row's after it).
template <typename Config>
struct cg_flash_rows {
  float o[Config::DV / 8][4];
  float row_max[2], row_sum[2];
};

// The mainloop: query rows [tile_m BLOCK_M, (tile_m + 1) BLOCK_M) of one head
// over key tiles [first_tile, end_tile) (of BLOCK_N keys; clipped to the keys
// and, causal, to the tile's last row), into `rows`. q is Tq x HEAD_D, k is
// Tk x HEAD_D, v is Tk x HEAD_DV, each row-major and 16-byte aligned (the
// caller checks; the first element of the head's rows).
// For each row i and key j < Tk (and j <= i where causal): s_ij = q_i . k_j,
// and in log2 units scale s_ij log2(e) = s_ij scale_log2. All THREADS threads
// call it; `smem` has cg_flash_shared<Config, T>::bytes, free again on return.
template <typename Config, typename T>
CG_DEVICE void cg_flash_mainloop(cg_flash_rows<Config>& rows, const T* q, const T* k, const T* v, cg_i64 Tq, cg_i64 Tk,
                                 cg_i64 tile_m, cg_i64 first_tile, cg_i64 end_tile, float scale_log2, bool causal,
                                 T* smem) {
  constexpr int D = Config::D, DV = Config::DV, BM = Config::BLOCK_M, BN = Config::BLOCK_N, S = Config::STAGES;
  constexpr int NT = BN / 8, OT = DV / 8;  // n8 tiles of a warp's scores, and of its output rows
  // q as the A operand (rows x D); keys as k^T's columns: the tile [BN][D] is
  // copied as an operand whose K axis is the keys (so that the copier steps
  // from key tile to key tile) and read as the B operand of q k^T, whose K
  // axis is D (the same swizzled tile); values as the B operand of p v.
  typedef cg_gemm_operand<BM, D, true, T> OperandQ;
  typedef cg_gemm_operand<D, BN, false, T> KeysCopied;
  typedef cg_gemm_operand<BN, D, true, T> OperandK;
  typedef cg_gemm_operand<DV, BN, false, T> OperandV;
  static_assert(KeysCopied::elements == OperandK::elements, "one tile of keys, two views");
  typedef cg_flash_shared<Config, T> Shared;
  const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const cg_i64 m0 = tile_m * BM;
  const cg_i64 row0 = m0 + 16 * warp + g;  // this thread's rows: row0 and row0 + 8
  // Causal: no key past the tile's last row.
  const cg_i64 keys = causal && m0 + BM < Tk ? m0 + BM : Tk;
  const cg_i64 n_tiles = (keys + BN - 1) / BN < end_tile ? (keys + BN - 1) / BN : end_tile;
  float (&o)[OT][4] = rows.o;
  float* row_max = rows.row_max;
  float* row_sum = rows.row_sum;
  row_max[0] = row_max[1] = cg_neg_inf();
  row_sum[0] = row_sum[1] = 0.0f;
  CG_UNROLL
  for (int j = 0; j < OT; ++j)
    CG_UNROLL
    for (int e = 0; e < 4; ++e) o[j][e] = 0.0f;

  const unsigned int smem_address = cg_smem_address(smem);
  constexpr unsigned int k_offset = Shared::q_elements * (int)sizeof(T);
  constexpr unsigned int stage_bytes = (Shared::k_elements + Shared::v_elements) * (int)sizeof(T);
  constexpr unsigned int v_offset = Shared::k_elements * (int)sizeof(T);
  {  // q in a group of its own, read into registers before the first key tile lands
    const typename OperandQ::template copier<Config::THREADS> copy_q(q, Config::HEAD_D, m0, Tq, 0, Config::HEAD_D);
    copy_q.copy(smem_address, 0);
    cg_cp_async_commit();
  }
  const typename KeysCopied::template copier<Config::THREADS> copy_k(k, Config::HEAD_D, 0, Config::HEAD_D, 0, Tk);
  const typename OperandV::template copier<Config::THREADS> copy_v(v, Config::HEAD_DV, 0, Config::HEAD_DV, 0, Tk);
  auto load_stage = [&](cg_i64 n) {
    const unsigned int stage = smem_address + k_offset + (unsigned int)(n % S) * stage_bytes;
    copy_k.copy(stage, n);
    copy_v.copy(stage + v_offset, n);
  };
  // A group is committed for every key tile, empty past the last, so that
  // wait<S - 2> means "tile n landed".
  for (int s = 0; s < S - 1; ++s) {
    if (first_tile + s < n_tiles) load_stage(first_tile + s);
    cg_cp_async_commit();
  }

  unsigned int qa[D / 16][4];  // this warp's 16 rows of q, as A fragments
  cg_cp_async_wait<S - 1>();
  __syncthreads();
  CG_UNROLL
  for (int kk = 0; kk < D / 16; ++kk) OperandQ::template fragment<true>(qa[kk], smem_address, smem, 16 * warp, 16 * kk);

  for (cg_i64 n = first_tile; n < n_tiles; ++n) {
    cg_cp_async_wait<S - 2>();
    // Tile n is visible to every warp, and every warp is done with tile n - 1,
    // whose stage the next copy overwrites.
    __syncthreads();
    if (n + S - 1 < n_tiles) load_stage(n + S - 1);
    cg_cp_async_commit();
    const unsigned int tile_k = smem_address + k_offset + (unsigned int)(n % S) * stage_bytes, tile_v = tile_k + v_offset;
    const T* tile_k_ptr = smem + Shared::q_elements + (int)(n % S) * (Shared::k_elements + Shared::v_elements);
    const T* tile_v_ptr = tile_k_ptr + Shared::k_elements;

    // s = q k^T for the warp's 16 rows and the tile's BN keys.
    float s[NT][4];
    CG_UNROLL
    for (int j = 0; j < NT; ++j)
      CG_UNROLL
      for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
    CG_UNROLL
    for (int kk = 0; kk < D / 16; ++kk)
      CG_UNROLL
      for (int j = 0; j < NT / 2; ++j) {
        unsigned int kb[4];
        OperandK::template fragment<false>(kb, tile_k, tile_k_ptr, 16 * j, 16 * kk);
        cg_mma_packed(s[2 * j], qa[kk], &kb[0], T());
        cg_mma_packed(s[2 * j + 1], qa[kk], &kb[2], T());
      }

    // Scaled to log2 units; masked only where the tile crosses the last key
    // or, causal, the warp's diagonal (a branch the whole warp takes alike).
    CG_UNROLL
    for (int j = 0; j < NT; ++j)
      CG_UNROLL
      for (int e = 0; e < 4; ++e) s[j][e] *= scale_log2;
    const cg_i64 key0 = n * BN;
    if (key0 + BN > Tk || (causal && key0 + BN - 1 > m0 + 16 * warp)) {
      const int keys_left = (int)(Tk - key0 < BN ? Tk - key0 : BN);
      // Per row, the keys it may see in this tile: below `limit`.
      const int limit[2] = {causal ? (int)(row0 - key0 + 1 < keys_left ? row0 - key0 + 1 : keys_left) : keys_left,
                            causal ? (int)(row0 + 8 - key0 + 1 < keys_left ? row0 + 8 - key0 + 1 : keys_left) : keys_left};
      CG_UNROLL
      for (int j = 0; j < NT; ++j)
        CG_UNROLL
        for (int e = 0; e < 4; ++e)
          if (8 * j + 2 * t + (e & 1) >= limit[e >> 1]) s[j][e] = cg_neg_inf();
    }

    // The online softmax, a row at a time (r = 0: row0, r = 1: row0 + 8).
    // A row's 16 values of this tile lie with the 4 lanes of a quad.
    CG_UNROLL
    for (int r = 0; r < 2; ++r) {
      float tile_max = cg_neg_inf();
      CG_UNROLL
      for (int j = 0; j < NT; ++j) tile_max = fmaxf(tile_max, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float new_max = fmaxf(row_max[r], tile_max);
      // A row with no key yet (every key so far masked) subtracts 0, not -inf.
      const float base = new_max == cg_neg_inf() ? 0.0f : new_max;
      const float rescale = cg_exp2_approx(row_max[r] - base);
      row_max[r] = new_max;
      float tile_sum = 0.0f;
      CG_UNROLL
      for (int j = 0; j < NT; ++j)
        CG_UNROLL
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          s[j][e] = cg_exp2_approx(s[j][e] - base);
          tile_sum += s[j][e];
        }
      // (Each lane's partial sum: the quad's add up once, at the end.)
      row_sum[r] = row_sum[r] * rescale + tile_sum;
      CG_UNROLL
      for (int j = 0; j < OT; ++j) {
        o[j][2 * r] *= rescale;
        o[j][2 * r + 1] *= rescale;
      }
    }

    // o += p v: the accumulators of s tiles 2 kk and 2 kk + 1 are, rounded to
    // T, the A fragment of keys [16 kk, 16 kk + 16).
    CG_UNROLL
    for (int kk = 0; kk < BN / 16; ++kk) {
      const unsigned int pa[4] = {cg_narrow_pair(s[2 * kk][0], s[2 * kk][1], T()),
                                  cg_narrow_pair(s[2 * kk][2], s[2 * kk][3], T()),
                                  cg_narrow_pair(s[2 * kk + 1][0], s[2 * kk + 1][1], T()),
                                  cg_narrow_pair(s[2 * kk + 1][2], s[2 * kk + 1][3], T())};
      CG_UNROLL
      for (int j = 0; j < OT / 2; ++j) {
        unsigned int vb[4];
        OperandV::template fragment<false>(vb, tile_v, tile_v_ptr, 16 * j, 16 * kk);
        cg_mma_packed(o[2 * j], pa, &vb[0], T());
        cg_mma_packed(o[2 * j + 1], pa, &vb[2], T());
      }
    }
  }
  cg_cp_async_wait<0>();
  __syncthreads();  // every warp is done with the tiles: the caller may reuse their memory
  // The quad's parts of each row's sum, added.
  CG_UNROLL
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
  }
}

// Attention for query rows [tile_m BLOCK_M, (tile_m + 1) BLOCK_M) of one
// head over all its keys (cg_flash_mainloop's q, k, v and scale): p_ij =
// exp(scale s_ij) / sum_j exp(scale s_ij), o_i = sum_j p_ij v_j. Each o_i[c]
// goes to store_out(i, c, value), each row's log-sum-exp of scale s (natural
// log, what a backward pass recomputes p from) to store_lse(i, value); rows
// i >= Tq are neither stored nor read past the head. The output tile goes
// through shared memory so that the stores coalesce.
template <typename Config, typename T, typename StoreOut, typename StoreLse>
CG_DEVICE void cg_flash_attention(const T* q, const T* k, const T* v, cg_i64 Tq, cg_i64 Tk, cg_i64 tile_m,
                                  float scale_log2, bool causal, StoreOut store_out, StoreLse store_lse, T* smem) {
  constexpr int BM = Config::BLOCK_M, DV = Config::DV, OT = DV / 8;
  cg_flash_rows<Config> rows;
  cg_flash_mainloop<Config, T>(rows, q, k, v, Tq, Tk, tile_m, 0, (Tk + Config::BLOCK_N - 1) / Config::BLOCK_N,
                               scale_log2, causal, smem);
  const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const cg_i64 m0 = tile_m * BM;
  // o / l into the staged tile, the log-sum-exp to its store.
  float* staged = (float*)smem;
  CG_UNROLL
  for (int r = 0; r < 2; ++r) {
    const float sum = rows.row_sum[r], inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int local = 16 * warp + g + 8 * r;
    CG_UNROLL
    for (int j = 0; j < OT; ++j) {
      cg_aligned_chunk<2, float> pair;
      pair.v[0] = rows.o[j][2 * r] * inverse;
      pair.v[1] = rows.o[j][2 * r + 1] * inverse;
      float* at = staged + local * Config::OUT_STRIDE + 8 * j + 2 * t;
#ifdef CUDAGEN_EMULATION
      cudagen_emu::note_shared_request(at, 8);
#endif
      *reinterpret_cast<cg_aligned_chunk<2, float>*>(at) = pair;
    }
    const cg_i64 row = m0 + local;
    if (t == 0 && row < Tq) store_lse(row, (rows.row_max[r] + log2f(sum)) * 0.6931471805599453f);
  }
  __syncthreads();
  // Coalesced: consecutive threads take consecutive values of a row.
  constexpr int HDV = Config::HEAD_DV;
  for (int i = (int)threadIdx.x; i < BM * HDV; i += Config::THREADS) {
    const int local = i / HDV, c = i % HDV;
    if (m0 + local < Tq) store_out(m0 + local, c, staged[local * Config::OUT_STRIDE + c]);
  }
}

// Split-KV (decoding: few query rows over many keys, too few blocks to fill
// the GPU): the same attention with the keys cut into `splits` ranges of
// `tiles_per_split` key tiles, one block each (`split`). Each block writes its
// rows' partial state to `partials` (this row tile's: splits x BLOCK_M x (DV
// + 2) floats: o, then the maximum and the sum), counts itself in
// `*arrivals` (zero before the launch; left zero), and the last block of the
// row tile combines the splits in split order (deterministic):
//   m = max_s m_s, l = sum_s l_s 2^(m_s - m), o = sum_s o_s 2^(m_s - m) / l,
// and stores as cg_flash_attention does. splits <= 32.
template <typename Config, typename T, typename StoreOut, typename StoreLse>
CG_DEVICE void cg_flash_attention_split(const T* q, const T* k, const T* v, cg_i64 Tq, cg_i64 Tk, cg_i64 tile_m,
                                        int split, int splits, cg_i64 tiles_per_split, float* partials,
                                        unsigned int* arrivals, float scale_log2, bool causal, StoreOut store_out,
                                        StoreLse store_lse, T* smem) {
  constexpr int BM = Config::BLOCK_M, DV = Config::DV, OT = DV / 8, STATE = DV + 2;
  cg_flash_rows<Config> rows;
  cg_flash_mainloop<Config, T>(rows, q, k, v, Tq, Tk, tile_m, split * tiles_per_split,
                               (split + 1) * tiles_per_split, scale_log2, causal, smem);
  const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const cg_i64 m0 = tile_m * BM;
  // This split's state, row after row: o's pairs, then (t = 0) the maximum and the sum.
  float* mine = partials + (cg_i64)split * BM * STATE;
  CG_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int local = 16 * warp + g + 8 * r;
    CG_UNROLL
    for (int j = 0; j < OT; ++j) {
      cg_vector<2, float> pair;
      pair.v[0] = rows.o[j][2 * r];
      pair.v[1] = rows.o[j][2 * r + 1];
      cg_store_vector<2, float>(mine, (cg_i64)local * STATE + 8 * j + 2 * t, pair);
    }
    if (t == 0) {
      cg_vector<2, float> state;
      state.v[0] = rows.row_max[r];
      state.v[1] = rows.row_sum[r];
      cg_store_vector<2, float>(mine, (cg_i64)local * STATE + DV, state);
    }
  }
  if (!cg_last_to_arrive(arrivals, splits, (unsigned int*)smem)) return;
  // Each row's weight of each split, 2^(m_s - m) / l, into shared memory (after the flag).
  float* weight = (float*)smem + 32;
  for (int local = (int)threadIdx.x; local < BM; local += Config::THREADS) {
    float m = cg_neg_inf();
    for (int s = 0; s < splits; ++s) m = fmaxf(m, cg_load_l2(partials, ((cg_i64)s * BM + local) * STATE + DV));
    const float base = m == cg_neg_inf() ? 0.0f : m;
    float l = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const cg_i64 at = ((cg_i64)s * BM + local) * STATE + DV;
      weight[local * 32 + s] = exp2f(cg_load_l2(partials, at) - base);
      l += cg_load_l2(partials, at + 1) * weight[local * 32 + s];
    }
    const float inverse = l > 0.0f ? 1.0f / l : 0.0f;
    for (int s = 0; s < splits; ++s) weight[local * 32 + s] *= inverse;
    if (m0 + local < Tq) store_lse(m0 + local, (base + log2f(l)) * 0.6931471805599453f);
  }
  __syncthreads();
  // Coalesced: consecutive threads take consecutive values of a row.
  constexpr int HDV = Config::HEAD_DV;
  for (int i = (int)threadIdx.x; i < BM * HDV; i += Config::THREADS) {
    const int local = i / HDV, c = i % HDV;
    if (m0 + local >= Tq) continue;
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s)
      sum += weight[local * 32 + s] * cg_load_l2(partials, ((cg_i64)s * BM + local) * STATE + c);
    store_out(m0 + local, c, sum);
  }
}
