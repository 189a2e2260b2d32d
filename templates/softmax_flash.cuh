// Flash attention, forward (docs/attention.md): softmax(scale q k^T) v for a
// tile of query rows of one head, without the rows of scores ever leaving
// registers, at any number of keys. After FlashAttention-2 (Dao, 2023):
//   - a block of WARPS warps owns BLOCK_M = 16 WARPS query rows, a warp 16;
//     the tile of q is copied to shared memory once and read into mma
//     fragments (ldmatrix) that stay in registers (heads over 128: read
//     again at every key tile, Q_IN_SHARED);
//   - keys and values stream through shared memory BLOCK_N rows at a time,
//     STAGES tiles in flight (16-byte cp.async, swizzled tiles: the GEMM
//     mainloop's operands, templates/gemm.cuh);
//   - s = q k^T and o += p v both on tensor cores (mma.sync m16n8k16, f32
//     accumulation; m16n8k8 for f32 as TF32); the probabilities p go from
//     s's accumulators to the A fragments of p v in registers (the two
//     layouts line up; in TF32 a quad's shuffles line them up:
//     cg_flash_p_fragment);
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
  // Heads over 128: a warp's 16 rows of q as A fragments would hold D / 4
  // registers a thread beside o's DV / 2, more than the 255 there are; the
  // forward reads q's fragments from its shared tile at every key tile
  // instead, as it reads the keys'.
  static constexpr bool Q_IN_SHARED = D > 128;
  // The backward kernel's key blocks hold dk and dv of their 16 keys a warp
  // in registers: D / 2 + DV / 2 a thread, too many over heads of 128. There
  // each tile of keys takes KEY_SPLIT blocks, each summing its share of dk's
  // and dv's columns (s and dp, over whole heads, computed by both).
  static constexpr int KEY_SPLIT = D > 128 || DV > 128 ? 2 : 1;
};

// Shared memory of cg_flash_attention, in bytes (elements of T: 2 bytes, 4 for TF32): the
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

// x clamped to [lo, hi]: a 64-bit distance made small enough for 32-bit
// comparisons in a tile's masks.
CG_DEVICE cg_i64 cg_clamp_i64(cg_i64 x, cg_i64 lo, cg_i64 hi) { return x < lo ? lo : x > hi ? hi : x; }

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

// p's A fragment for keys [KSTEP kk, KSTEP (kk + 1)) of o += p v, from the
// score accumulators s (the m16n8 layout: lane (g, t) holds columns 2t and
// 2t + 1 of rows g and g + 8). 16-bit (m16n8k16): tiles 2kk and 2kk + 1,
// rounded to T, are the fragment as they lie. 4-byte values (m16n8k8: a[i] =
// p[g + 8 (i % 2)][t + 4 (i / 2)]; TF32 or exact f32): tile kk's columns t and
// t + 4 come from the quad's lanes that hold them, then are made ready as
// T's fragments are (rounded to TF32, or kept).
template <int NT, typename T>
CG_DEVICE void cg_flash_p_fragment(unsigned int pa[4], const float (&s)[NT][4], int kk, T) {
  if constexpr (sizeof(T) == 2) {
    pa[0] = cg_narrow_pair(s[2 * kk][0], s[2 * kk][1], T());
    pa[1] = cg_narrow_pair(s[2 * kk][2], s[2 * kk][3], T());
    pa[2] = cg_narrow_pair(s[2 * kk + 1][0], s[2 * kk + 1][1], T());
    pa[3] = cg_narrow_pair(s[2 * kk + 1][2], s[2 * kk + 1][3], T());
  } else {
    const int lane = (int)threadIdx.x & 31, t = lane & 3;
    CG_UNROLL
    for (int half = 0; half < 2; ++half) {  // column t, then t + 4: held as column 2 t' + (t & 1)
      const int from = (lane & ~3) + 2 * half + (t >> 1);
      const float top0 = __shfl_sync(0xffffffffu, s[kk][0], from), top1 = __shfl_sync(0xffffffffu, s[kk][1], from);
      const float bottom0 = __shfl_sync(0xffffffffu, s[kk][2], from), bottom1 = __shfl_sync(0xffffffffu, s[kk][3], from);
      pa[2 * half] = (unsigned int)__float_as_int(t & 1 ? top1 : top0);
      pa[2 * half + 1] = (unsigned int)__float_as_int(t & 1 ? bottom1 : bottom0);
    }
    cg_gemm_fragment_ready(pa, T());
  }
}

// No bias on the scores (the flash kernels' `bias`): nothing is loaded.
struct cg_flash_no_bias {
  static constexpr bool PRESENT = false;
  CG_DEVICE float operator()(cg_i64, cg_i64) const { return 0.0f; }
};

// A bias added to the scores before the softmax (an attention mask, a
// position bias): load(row, key) is its element at a query row and a key of
// the head, in the scores' units (before the softmax's scale).
template <typename Load>
struct cg_flash_bias {
  static constexpr bool PRESENT = true;
  Load load;
  CG_DEVICE float operator()(cg_i64 row, cg_i64 key) const { return load(row, key); }
};
template <typename Load>
CG_DEVICE cg_flash_bias<Load> cg_flash_bias_of(Load load) {
  return cg_flash_bias<Load>{load};
}

// A warp's scores for a tile of 8 NT keys from key0 (the m16n8 layout: lane
// (g, t) holds columns 2t and 2t + 1 of rows g and g + 8 of each n8 tile;
// row0 the thread's first row, warp_row0 the warp's first) scaled to log2
// units, s scale_log2, plus bias(row, key) bias_log2 where the attention has
// a bias (rows below Tq, keys below Tk: the others are never read), and
// masked to -inf past the last key (Tk) and, causal, past each row's own;
// only tiles that cross the last key or the warp's diagonal are masked (a
// branch the whole warp takes alike).
template <int NT, typename Bias = cg_flash_no_bias>
CG_DEVICE void cg_flash_scores_to_log2(float (&s)[NT][4], float scale_log2, cg_i64 key0, cg_i64 Tk, cg_i64 warp_row0,
                                       cg_i64 row0, bool causal, const Bias& bias = Bias(), float bias_log2 = 0.0f,
                                       cg_i64 Tq = 0) {
  constexpr int BN = 8 * NT;
  const int t = (int)threadIdx.x & 3;
  CG_UNROLL
  for (int j = 0; j < NT; ++j)
    CG_UNROLL
    for (int e = 0; e < 4; ++e) s[j][e] *= scale_log2;
  if (Bias::PRESENT) {
    CG_UNROLL
    for (int j = 0; j < NT; ++j)
      CG_UNROLL
      for (int e = 0; e < 4; ++e) {
        const cg_i64 row = row0 + 8 * (e >> 1), key = key0 + 8 * j + 2 * t + (e & 1);
        if (row < Tq && key < Tk) s[j][e] += bias_log2 * bias(row, key);
      }
  }
  if (key0 + BN > Tk || (causal && key0 + BN - 1 > warp_row0)) {
    const int keys_left = (int)(Tk - key0 < BN ? Tk - key0 : BN);
    // Per row, the keys it may see in this tile: below `limit`.
    const int limit[2] = {causal ? (int)cg_clamp_i64(row0 - key0 + 1, 0, keys_left) : keys_left,
                          causal ? (int)cg_clamp_i64(row0 + 8 - key0 + 1, 0, keys_left) : keys_left};
    CG_UNROLL
    for (int j = 0; j < NT; ++j)
      CG_UNROLL
      for (int e = 0; e < 4; ++e)
        if (8 * j + 2 * t + (e & 1) >= limit[e >> 1]) s[j][e] = cg_neg_inf();
  }
}

// The online softmax's step over a tile's scores s (log2 units, masked;
// the m16n8 layout), a row at a time (r = 0: the thread's first row, 1: 8
// rows on): each row's running maximum and this lane's part of its sum
// (the quad's parts are added once, after the last tile) move on, s becomes
// the tile's unnormalised probabilities, and rescale[r] is what the row's
// output accumulators must be multiplied by for the new maximum (the
// Hopper kernel applies it later, once the products in flight on them have
// completed).
template <int NT>
CG_DEVICE void cg_flash_softmax_step(float (&s)[NT][4], float row_max[2], float row_sum[2], float rescale[2]) {
  CG_UNROLL
  for (int r = 0; r < 2; ++r) {
    // A row's values of this tile lie with the 4 lanes of a quad.
    float tile_max = cg_neg_inf();
    CG_UNROLL
    for (int j = 0; j < NT; ++j) tile_max = fmaxf(tile_max, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float new_max = fmaxf(row_max[r], tile_max);
    // A row with no key yet (every key so far masked) subtracts 0, not -inf.
    const float base = new_max == cg_neg_inf() ? 0.0f : new_max;
    rescale[r] = cg_exp2_approx(row_max[r] - base);
    row_max[r] = new_max;
    float tile_sum = 0.0f;
    CG_UNROLL
    for (int j = 0; j < NT; ++j)
      CG_UNROLL
      for (int e = 2 * r; e < 2 * r + 2; ++e) {
        s[j][e] = cg_exp2_approx(s[j][e] - base);
        tile_sum += s[j][e];
      }
    row_sum[r] = row_sum[r] * rescale[r] + tile_sum;
  }
}

// o's rows (the m16n8 layout) times their rescale factors.
template <int OT>
CG_DEVICE void cg_flash_rescale(float (&o)[OT][4], const float rescale[2]) {
  CG_UNROLL
  for (int j = 0; j < OT; ++j)
    CG_UNROLL
    for (int e = 0; e < 4; ++e) o[j][e] *= rescale[e >> 1];
}

// The step, and o rescaled at once where `rescale_o` (not before the first
// tile's products, where o holds nothing yet).
template <int NT, int OT>
CG_DEVICE void cg_flash_online_softmax(float (&s)[NT][4], float (&o)[OT][4], float row_max[2], float row_sum[2],
                                       bool rescale_o) {
  float rescale[2];
  cg_flash_softmax_step(s, row_max, row_sum, rescale);
  if (rescale_o) cg_flash_rescale(o, rescale);
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
// and in log2 units scale s_ij log2(e) = s_ij scale_log2, plus bias(i, j)
// bias_log2 where there is a bias (cg_flash_bias). All THREADS threads call
// it; `smem` has cg_flash_shared<Config, T>::bytes, free again on return.
template <typename Config, typename T, typename Bias = cg_flash_no_bias>
CG_DEVICE void cg_flash_mainloop(cg_flash_rows<Config>& rows, const T* q, const T* k, const T* v, cg_i64 Tq, cg_i64 Tk,
                                 cg_i64 tile_m, cg_i64 first_tile, cg_i64 end_tile, float scale_log2, bool causal,
                                 T* smem, const Bias& bias = Bias(), float bias_log2 = 0.0f) {
  constexpr int D = Config::D, DV = Config::DV, BM = Config::BLOCK_M, BN = Config::BLOCK_N, S = Config::STAGES;
  constexpr int NT = BN / 8, OT = DV / 8;  // n8 tiles of a warp's scores, and of its output rows
  // q as the A operand (rows x D); keys as k^T's columns: the tile [BN][D] is
  // copied as an operand whose K axis is the keys (so that the copier steps
  // from key tile to key tile) and read as the B operand of q k^T, whose K
  // axis is D (the same swizzled tile); values as the B operand of p v.
  // T is cg_f16 or cg_bf16 (m16n8k16), or cg_tf32 (f32 inputs under
  // --allow-tf32, m16n8k8): an mma's K step is KSTEP values, two chunks.
  typedef cg_gemm_operand<BM, D, true, T> OperandQ;
  typedef cg_gemm_operand<D, BN, false, T, false> KeysCopied;
  constexpr int KSTEP = 2 * OperandQ::CHUNK;
  typedef cg_gemm_operand<BN, D, true, T> OperandK;
  typedef cg_gemm_operand<DV, BN, false, T> OperandV;
  static_assert(KeysCopied::elements == OperandK::elements, "one tile of keys, two views");
  typedef cg_flash_shared<Config, T> Shared;
  const int warp = (int)threadIdx.x >> 5, g = ((int)threadIdx.x & 31) >> 2;
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

  unsigned int qa[Config::Q_IN_SHARED ? 1 : D / KSTEP][4];  // this warp's 16 rows of q, as A fragments
  cg_cp_async_wait<S - 1>();
  __syncthreads();
  if (!Config::Q_IN_SHARED) {
    CG_UNROLL
    for (int kk = 0; kk < D / KSTEP; ++kk) {
      OperandQ::template fragment<true>(qa[kk], smem_address, smem, 16 * warp, KSTEP * kk);
    }
  }

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
    for (int kk = 0; kk < D / KSTEP; ++kk) {
      unsigned int q_shared[4];
      if (Config::Q_IN_SHARED) {
        OperandQ::template fragment<true>(q_shared, smem_address, smem, 16 * warp, KSTEP * kk);
      }
      const unsigned int(&a)[4] = Config::Q_IN_SHARED ? q_shared : qa[Config::Q_IN_SHARED ? 0 : kk];
      CG_UNROLL
      for (int j = 0; j < NT / 2; ++j) {
        unsigned int kb[4];
        OperandK::template fragment<false>(kb, tile_k, tile_k_ptr, 16 * j, KSTEP * kk);
        cg_mma_packed(s[2 * j], a, &kb[0], T());
        cg_mma_packed(s[2 * j + 1], a, &kb[2], T());
      }
    }

    cg_flash_scores_to_log2(s, scale_log2, n * BN, Tk, m0 + 16 * warp, row0, causal, bias, bias_log2, Tq);
    cg_flash_online_softmax(s, o, row_max, row_sum, true);

    // o += p v: the accumulators of s are, rounded to T, the A fragments of
    // the tile's keys, KSTEP at a time (cg_flash_p_fragment).
    CG_UNROLL
    for (int kk = 0; kk < BN / KSTEP; ++kk) {
      unsigned int pa[4];
      cg_flash_p_fragment(pa, s, kk, T());
      CG_UNROLL
      for (int j = 0; j < OT / 2; ++j) {
        unsigned int vb[4];
        OperandV::template fragment<false>(vb, tile_v, tile_v_ptr, 16 * j, KSTEP * kk);
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
// head over all its keys (cg_flash_mainloop's q, k, v, scale and bias): p_ij =
// exp(scale s_ij) / sum_j exp(scale s_ij), o_i = sum_j p_ij v_j. Each o_i[c]
// goes to store_out(i, c, value), each row's log-sum-exp of scale s (natural
// log, what a backward pass recomputes p from) to store_lse(i, value); rows
// i >= Tq are neither stored nor read past the head. The output tile goes
// through shared memory so that the stores coalesce.
template <typename Config, typename T, typename StoreOut, typename StoreLse, typename Bias = cg_flash_no_bias>
CG_DEVICE void cg_flash_attention(const T* q, const T* k, const T* v, cg_i64 Tq, cg_i64 Tk, cg_i64 tile_m,
                                  float scale_log2, bool causal, StoreOut store_out, StoreLse store_lse, T* smem,
                                  const Bias& bias = Bias(), float bias_log2 = 0.0f) {
  constexpr int BM = Config::BLOCK_M, DV = Config::DV, OT = DV / 8;
  cg_flash_rows<Config> rows;
  cg_flash_mainloop<Config, T>(rows, q, k, v, Tq, Tk, tile_m, 0, (Tk + Config::BLOCK_N - 1) / Config::BLOCK_N,
                               scale_log2, causal, smem, bias, bias_log2);
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

// A warp's 16 rows of a split's partial state (split-KV) into `mine`, its
// split's share of the workspace (the row tile's BM x DV floats of o, then
// BM (maximum, sum) pairs): o's pairs (the thread's columns 8 j + 2 (lane %
// 4)), then lane % 4 == 0 stores each row's maximum and sum, for the warp's
// rows local0 + r, r < rows (the others, past Tq, neither stored nor read).
template <int BM, int DV>
CG_DEVICE void cg_flash_store_partial_rows(float* mine, const float (&o)[DV / 8][4], const float row_max[2],
                                           const float row_sum[2], int local0, cg_i64 rows) {
  const int lane = (int)threadIdx.x & 31, g = lane >> 2, quad = lane & 3;
  CG_UNROLL
  for (int r = 0; r < 2; ++r) {
    if (g + 8 * r >= rows) continue;
    CG_UNROLL
    for (int j = 0; j < DV / 8; ++j) {
      cg_vector<2, float> pair;
      pair.v[0] = o[j][2 * r];
      pair.v[1] = o[j][2 * r + 1];
      cg_store_vector<2, float>(mine, (cg_i64)(local0 + g + 8 * r) * DV + 8 * j + 2 * quad, pair);
    }
  }
  // (After every lane's stores of o: the emulation groups a warp's requests by
  // their order in each lane, as the GPU issues them.)
  if (quad == 0) {
    CG_UNROLL
    for (int r = 0; r < 2; ++r) {
      if (g + 8 * r >= rows) continue;
      cg_vector<2, float> state;
      state.v[0] = row_max[r];
      state.v[1] = row_sum[r];
      cg_store_vector<2, float>(mine, (cg_i64)BM * DV + 2 * (local0 + g + 8 * r), state);
    }
  }
}

// Split-KV (decoding: few query rows over many keys, too few blocks to fill
// the GPU): the same attention with the keys cut into `splits` ranges of
// `tiles_per_split` key tiles, one block each (`split`). Each block writes its
// rows' partial state to `partials` (this row tile's, per split: o's BLOCK_M
// x DV floats, then each row's maximum and sum, BLOCK_M x 2: each part whole
// 32-byte sectors, so that a warp's stores of o's pairs, 8 rows of 32 bytes,
// touch 8, and a row's state lies beside its neighbours'), counts itself in
// `*arrivals` (zero before the launch; left zero), and the last block of the
// row tile combines the splits in split order (deterministic):
//   m = max_s m_s, l = sum_s l_s 2^(m_s - m), o = sum_s o_s 2^(m_s - m) / l,
// and stores as cg_flash_attention does. splits <= 32.
template <typename Config, typename T, typename StoreOut, typename StoreLse, typename Bias = cg_flash_no_bias>
CG_DEVICE void cg_flash_attention_split(const T* q, const T* k, const T* v, cg_i64 Tq, cg_i64 Tk, cg_i64 tile_m,
                                        int split, int splits, cg_i64 tiles_per_split, float* partials,
                                        unsigned int* arrivals, float scale_log2, bool causal, StoreOut store_out,
                                        StoreLse store_lse, T* smem, const Bias& bias = Bias(),
                                        float bias_log2 = 0.0f) {
  constexpr int BM = Config::BLOCK_M, DV = Config::DV, SPLIT = BM * (DV + 2);
  cg_flash_rows<Config> rows;
  cg_flash_mainloop<Config, T>(rows, q, k, v, Tq, Tk, tile_m, split * tiles_per_split,
                               (split + 1) * tiles_per_split, scale_log2, causal, smem, bias, bias_log2);
  const cg_i64 m0 = tile_m * BM;
  // This split's state of the warp's rows (all of them: the combine skips those past Tq).
  cg_flash_store_partial_rows<BM, DV>(partials + (cg_i64)split * SPLIT, rows.o, rows.row_max, rows.row_sum,
                                      16 * ((int)threadIdx.x >> 5), BM);
  if (!cg_last_to_arrive(arrivals, splits, (unsigned int*)smem)) return;
  // Each row's weight of each split, 2^(m_s - m) / l, into shared memory (after the flag).
  float* weight = (float*)smem + 32;
  for (int local = (int)threadIdx.x; local < BM; local += Config::THREADS) {
    float m = cg_neg_inf();
    for (int s = 0; s < splits; ++s) m = fmaxf(m, cg_load_l2(partials, (cg_i64)s * SPLIT + BM * DV + 2 * local));
    const float base = m == cg_neg_inf() ? 0.0f : m;
    float l = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const cg_i64 at = (cg_i64)s * SPLIT + BM * DV + 2 * local;
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
      sum += weight[local * 32 + s] * cg_load_l2(partials, (cg_i64)s * SPLIT + (cg_i64)local * DV + c);
    store_out(m0 + local, c, sum);
  }
}

// ---------------------------------------------------------------------------
// Flash attention, backward (docs/attention.md), after FlashAttention-2: the
// gradients of o = softmax(x) v, x = scale s, from q, k, v, the forward's
// output o and each row's log-sum-exp, without a T x T matrix anywhere. The
// probabilities are recomputed tile by tile, p = exp2(x log2 e - lse log2 e);
// with dp = dp_scale dO v^T and delta_i = sum_j p_ij dp_ij = dp_scale dO_i . o_i,
//   dv = p^T dO,  ds = p (dp - delta),  dq = ds k,  dk = ds^T q
// (the caller scales dq and dk by the softmax's scale and their matmuls'
// alphas, dv by its alpha). One grid, two kinds of block, so that no sum
// needs an atomic and every run adds in the same order (deterministic):
//   - a block per tile of BLOCK_M keys (cg_flash_backward_keys): its keys and
//     values stay in shared memory while the query rows stream past, BLOCK_N at
//     a time (cp.async, STAGES in flight); dk and dv of its keys sum in
//     registers over the query tiles, in order;
//   - a block per tile of BLOCK_M query rows (cg_flash_backward_queries): q
//     and dO in registers, keys and values streaming; dq sums over the key
//     tiles, in order.
// The second recomputes s and dp (two of the five products): the price of
// summing dq without atomics. Each query row's statistics, its log-sum-exp
// and delta_i, come from a launch before (cg_flash_backward_rows): a key
// block reads them with its query tile (cp.async), where computing delta in
// the loop (dO . o, a dependent read of global memory per row) cost more than
// the tile's five products.

// Shared memory of cg_flash_attention_backward, in bytes: the block's own
// rows ([BLOCK_M][D] and [BLOCK_M][DV] of T), STAGES stages of streamed rows
// ([BLOCK_N][D] and [BLOCK_N][DV]), then each stage's rows' statistics
// (BLOCK_N pairs of floats: a key block's query rows'); the staged output
// tile (floats) reuses it.
template <typename Config, typename T>
struct cg_flash_backward_shared {
  static constexpr int BM = Config::BLOCK_M, BN = Config::BLOCK_N, D = Config::D, DV = Config::DV;
  static constexpr int own_k = BM * D, own_v = BM * DV, stream_k = BN * D, stream_v = BN * DV;
  static constexpr int stage_elements = stream_k + stream_v;
  static constexpr int stats_offset = (int)sizeof(T) * (own_k + own_v + Config::STAGES * stage_elements);  // bytes
  static constexpr int stats_floats = 2 * Config::STAGES * BN;
  static constexpr int main = stats_offset + 4 * stats_floats;
  static constexpr int out_stride = (D > DV ? D : DV) + 8;
  static constexpr int staged = 4 * BM * out_stride;
  static constexpr int bytes = main > staged ? main : staged;
  // With dq summed by atomics: the key block's ds^T tile ([BLOCK_M][BLOCK_N] of T) after the rest.
  static constexpr int ds_offset = main;
  static constexpr int atomic_main = main + (int)sizeof(T) * BM * BN;
  static constexpr int atomic_bytes = atomic_main > staged ? atomic_main : staged;
};

// The rows' statistics of the backward pass of one head, a launch before it
// (FlashAttention-2's preprocessing): for each of its `rows` query rows (Tq
// rounded up to a multiple of BLOCK_M: whole tiles, 16-byte aligned),
// stats[2 r] = the row's log-sum-exp in log2 units (+inf past Tq and for a
// row that saw no key: its p are 0) and stats[2 r + 1] = delta_r = dp_scale
// sum_c dout_rc o_rc (0 past Tq). Rows [32 tile, 32 tile + 32) of the head, 8
// lanes a row reading 16 bytes each at a time (a block of 256 threads). T:
// the 16-bit type, or float (f32 training, TF32 or on CUDA cores: o saved as f32).
template <typename Config, typename T>
CG_DEVICE void cg_flash_backward_rows(float* stats, const float* lse, const T* o, const T* dout, cg_i64 Tq,
                                      cg_i64 rows, cg_i64 tile, float dp_scale) {
  constexpr int HDV = Config::HEAD_DV, CHUNK = 16 / (int)sizeof(T);
  static_assert(HDV % CHUNK == 0, "a row is whole 16-byte chunks");
  const int lane = (int)threadIdx.x & 7;
  const cg_i64 row = 32 * tile + ((int)threadIdx.x >> 3);
  float dot = 0.0f;
  if (row < Tq)
    for (int c = CHUNK * lane; c < HDV; c += 8 * CHUNK) {
      const cg_vector<CHUNK, T> a = cg_load_vector<CHUNK>(o, row * HDV + c), b = cg_load_vector<CHUNK>(dout, row * HDV + c);
      CG_UNROLL
      for (int e = 0; e < CHUNK; ++e) dot += cg_widen(a.v[e]) * cg_widen(b.v[e]);
    }
  CG_UNROLL
  for (int offset = 4; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (lane == 0 && row < rows) {
    const float l = row < Tq ? lse[row] : cg_neg_inf();
    cg_vector<2, float> pair;
    pair.v[0] = l == cg_neg_inf() ? -cg_neg_inf() : l * 1.4426950408889634f;
    pair.v[1] = dp_scale * dot;
    cg_store_vector<2>(stats, 2 * row, pair);
  }
}

// A warp's 16 rows of a [BLOCK_M][W] tile of accumulators (the mma layout),
// through shared memory, to store(row, col0 + c, value) for each row < rows
// and column c < HEAD_W and < width (a head's last columns, where a block
// holds a share of them from col0): coalesced, consecutive threads on
// consecutive columns.
template <typename Config, int W, int HEAD_W, typename Store>
CG_DEVICE void cg_flash_store_tile(const float (&acc)[W / 8][4], float* staged, cg_i64 row0, cg_i64 rows, Store store,
                                   int col0 = 0, int width = HEAD_W) {
  constexpr int STRIDE = cg_flash_backward_shared<Config, float>::out_stride;
  const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  CG_UNROLL
  for (int r = 0; r < 2; ++r)
    CG_UNROLL
    for (int j = 0; j < W / 8; ++j) {
      cg_aligned_chunk<2, float> pair;
      pair.v[0] = acc[j][2 * r];
      pair.v[1] = acc[j][2 * r + 1];
      float* at = staged + (16 * warp + g + 8 * r) * STRIDE + 8 * j + 2 * t;
#ifdef CUDAGEN_EMULATION
      cudagen_emu::note_shared_request(at, 8);
#endif
      *reinterpret_cast<cg_aligned_chunk<2, float>*>(at) = pair;
    }
  __syncthreads();
  for (int i = (int)threadIdx.x; i < Config::BLOCK_M * HEAD_W; i += Config::THREADS) {
    const int local = i / HEAD_W, c = i % HEAD_W;
    if (row0 + local < rows && c < width) store(row0 + local, col0 + c, staged[local * STRIDE + c]);
  }
  __syncthreads();  // the staged tile is free again
}

// acc (a warp's 16 rows by N columns, N / 8 mma tiles) += a (16 rows x one
// mma's K step, 16 16-bit values or 8 TF32 ones: an A fragment) times B's
// columns [mn0, mn0 + N) at K offset k: the B fragments read from a shared
// tile (Operand, at `address`, `pointer`).
template <typename Operand, int N, typename T>
CG_DEVICE void cg_mma_across(float (&acc)[N / 8][4], const unsigned int (&a)[4], unsigned int address, const T* pointer,
                             int k, int mn0 = 0) {
  CG_UNROLL
  for (int j = 0; j < N / 16; ++j) {
    unsigned int b[4];
    Operand::template fragment<false>(b, address, pointer, mn0 + 16 * j, k);
    cg_mma_packed(acc[2 * j], a, &b[0], T());
    cg_mma_packed(acc[2 * j + 1], a, &b[2], T());
  }
}

template <int N>
CG_DEVICE void cg_zero_accumulators(float (&acc)[N][4]) {
  CG_UNROLL
  for (int j = 0; j < N; ++j)
    CG_UNROLL
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
}

// The atomic mode's dq part of a key block for query tile m: its ds^T
// (accumulators, 16 keys a warp by the tile's BLOCK_N query rows) through
// shared memory, read back as ds (rows: the query rows, warp w's 16 from
// 16 w), times the block's keys, added into dq_accum's rows with atomics.
template <typename Config, typename T>
CG_DEVICE void cg_flash_backward_dq_part(const float (&dst)[Config::BLOCK_N / 8][4], T* smem, cg_i64 m, cg_i64 Tq,
                                         float* dq_accum) {
  constexpr int BM = Config::BLOCK_M, BN = Config::BLOCK_N, D = Config::D, HD = Config::HEAD_D;
  static_assert(BN == BM && BN == 16 * Config::WARPS, "a warp's 16 keys of ds^T, then its 16 query rows of ds");
  typedef cg_flash_backward_shared<Config, T> Shared;
  typedef cg_gemm_operand<BN, BM, false, T> DsRows;      // ds: rows the queries, K the keys; stored [keys][queries]
  typedef cg_gemm_operand<D, BM, false, T> OwnKAcross;   // the block's keys: N the head, K the keys
  const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  T* ds_ptr = (T*)((char*)smem + Shared::ds_offset);
  const unsigned int smem_address = cg_smem_address(smem), ds_address = smem_address + Shared::ds_offset;
  CG_UNROLL
  for (int j = 0; j < BN / 8; ++j)
    CG_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int key = 16 * warp + g + 8 * r, query = 8 * j + 2 * t;
      *reinterpret_cast<unsigned int*>(ds_ptr + DsRows::tile::offset(key, query)) =
          cg_narrow_pair(dst[j][2 * r], dst[j][2 * r + 1], T());
    }
  __syncthreads();  // every warp's keys of ds
  float dq[D / 8][4];
  cg_zero_accumulators(dq);
  CG_UNROLL
  for (int kk = 0; kk < BM / 16; ++kk) {
    unsigned int a[4];
    DsRows::template fragment<true>(a, ds_address, ds_ptr, 16 * warp, 16 * kk);
    cg_mma_across<OwnKAcross, D>(dq, a, smem_address, smem, 16 * kk);
  }
  CG_UNROLL
  for (int j = 0; j < D / 8; ++j)
    CG_UNROLL
    for (int e = 0; e < 4; ++e) {
      const cg_i64 row = m * BN + 16 * warp + g + 8 * (e >> 1);
      const int c = 8 * j + 2 * t + (e & 1);
      if (row < Tq && c < HD) atomicAdd(dq_accum + row * HD + c, dq[j][e]);
    }
}

// The block of key tile `tile_n` (keys [tile_n BLOCK_M, +BLOCK_M)): dk and dv
// of its keys, handed unscaled to store_dk(key, c, value) and
// store_dv(key, c, value); over heads of 128, share `part` of their columns
// (Config::KEY_SPLIT shares). q, k, v, dout and stats as for
// cg_flash_attention_backward.
//
// ATOMIC_DQ (the atomic mode): the block also adds its keys' part of dq, ds k,
// to the f32 sums `dq_accum` (the head's Tq x HEAD_D, zero before the launch)
// with atomics, and counts itself in at `dq_arrivals` (a counter per query
// tile, zero before the launch) once done; the last key block of a query
// tile hands its rows of dq to store_dq and leaves sums and counter zero.
// Faster than the query blocks' second pass over s and dp, but the sums'
// order varies from run to run: not bit-identical. BLOCK_N == BLOCK_M.
template <typename Config, typename T, bool ATOMIC_DQ, typename StoreDq, typename StoreDk, typename StoreDv>
CG_DEVICE void cg_flash_backward_keys(const T* q, const T* k, const T* v, const T* dout, const float* stats_rows,
                                      cg_i64 Tq, cg_i64 Tk, cg_i64 tile_n, int part, cg_i64 key_tiles,
                                      float scale_log2, float dp_scale, bool causal, float* dq_accum,
                                      unsigned int* dq_arrivals, StoreDq store_dq, StoreDk store_dk, StoreDv store_dv,
                                      T* smem) {
  constexpr int D = Config::D, DV = Config::DV, BM = Config::BLOCK_M, BN = Config::BLOCK_N, S = Config::STAGES;
  // This block's share of dk's and dv's columns: [part PD, +PD), [part PV, +PV).
  constexpr int PD = D / Config::KEY_SPLIT, PV = DV / Config::KEY_SPLIT;
  constexpr int NQ = BN / 8, OD = PD / 8, OV = PV / 8;  // n8 tiles: of the streamed queries, of dk's and dv's rows
  static_assert(PD % 16 == 0 && PV % 16 == 0, "each share of the columns in pairs of n8 tiles");
  static_assert(!ATOMIC_DQ || Config::KEY_SPLIT == 1, "the atomic mode's key blocks hold whole heads");
  typedef cg_flash_backward_shared<Config, T> Shared;
  // The block's keys and values as A operands (rows: keys); the streamed q
  // and dO tiles ([BN][D], [BN][DV]) as B operands two ways: along their
  // rows (K: D or DV; s^T = k q^T, dp^T = v dO^T) and across them (K: the
  // queries; dk += ds^T q, dv += p^T dO), which is how they are copied.
  // T is cg_f16 or cg_bf16 (m16n8k16), or cg_tf32 or cg_f32_simt (4-byte,
  // m16n8k8: an mma's K step is KSTEP values; the streamed tiles, read across
  // by 32-bit loads, take the paired swizzle in both views).
  constexpr bool PAIRED = sizeof(T) == 4;
  typedef cg_gemm_operand<BM, D, true, T> OwnK;
  typedef cg_gemm_operand<BM, DV, true, T> OwnV;
  typedef cg_gemm_operand<BN, D, true, T, PAIRED> StreamQ;
  typedef cg_gemm_operand<D, BN, false, T, PAIRED> StreamQAcross;
  typedef cg_gemm_operand<BN, DV, true, T, PAIRED> StreamDout;
  typedef cg_gemm_operand<DV, BN, false, T, PAIRED> StreamDoutAcross;
  constexpr int KSTEP = 2 * OwnK::CHUNK;
  static_assert(StreamQ::elements == StreamQAcross::elements && StreamDout::elements == StreamDoutAcross::elements,
                "one tile, two views");
  static_assert(!ATOMIC_DQ || sizeof(T) == 2, "the atomic mode's ds^T tile is 16-bit");
  const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const cg_i64 key0 = tile_n * BM;
  const unsigned int smem_address = cg_smem_address(smem);
  constexpr unsigned int own_v_offset = Shared::own_k * (int)sizeof(T);
  constexpr unsigned int stages_offset = (Shared::own_k + Shared::own_v) * (int)sizeof(T);
  constexpr unsigned int stage_bytes = Shared::stage_elements * (int)sizeof(T);
  constexpr unsigned int dout_offset = Shared::stream_k * (int)sizeof(T);
  float* stats = (float*)((char*)smem + Shared::stats_offset);
  {  // the block's keys and values, a group of their own
    const typename OwnK::template copier<Config::THREADS> copy_k(k, Config::HEAD_D, key0, Tk, 0, Config::HEAD_D);
    const typename OwnV::template copier<Config::THREADS> copy_v(v, Config::HEAD_DV, key0, Tk, 0, Config::HEAD_DV);
    copy_k.copy(smem_address, 0);
    copy_v.copy(smem_address + own_v_offset, 0);
    cg_cp_async_commit();
  }
  const typename StreamQAcross::template copier<Config::THREADS> copy_q(q, Config::HEAD_D, 0, Config::HEAD_D, 0, Tq);
  const typename StreamDoutAcross::template copier<Config::THREADS> copy_dout(dout, Config::HEAD_DV, 0,
                                                                              Config::HEAD_DV, 0, Tq);
  // A stage: the query tile's q and dO rows and their statistics (BN pairs
  // of floats, 16 bytes a thread; the rows array covers whole tiles).
  static_assert(BN * 8 / 16 <= Config::THREADS, "a tile's statistics in one copy a thread");
  auto load_stage = [&](cg_i64 m) {
    const unsigned int stage = smem_address + stages_offset + (unsigned int)(m % S) * stage_bytes;
    copy_q.copy(stage, m);
    copy_dout.copy(stage + dout_offset, m);
    if ((int)threadIdx.x < BN * 8 / 16)
      cg_cp_async_16_at(smem_address + Shared::stats_offset + (unsigned int)((m % S) * 2 * BN + 4 * threadIdx.x) * 4,
                        stats_rows + 2 * m * BN + 4 * threadIdx.x, 16);
  };
  // Causal: query rows before the tile's first key see none of its keys.
  // Tile indices in 32 bits (a head's rows are far fewer than 2^31 tiles).
  const int first = causal ? (int)(key0 / BN) : 0, end = (int)((Tq + BN - 1) / BN);
  for (int s = 0; s < S - 1; ++s) {
    if (first + s < end) load_stage(first + s);
    cg_cp_async_commit();
  }
  float dk[OD][4], dv[OV][4];
  cg_zero_accumulators(dk);
  cg_zero_accumulators(dv);
  const T* own_k_ptr = smem;
  const T* own_v_ptr = smem + Shared::own_k;
  for (int m = first; m < end; ++m) {
    const float* row_stats = stats + (int)(m % S) * 2 * BN;  // (lse log2, delta) of the tile's rows
    cg_cp_async_wait<S - 2>();
    __syncthreads();  // tile m and its statistics are visible; tile m - 1's stage is free
    if (m + S - 1 < end) load_stage(m + S - 1);
    cg_cp_async_commit();
    const unsigned int tile_q = smem_address + stages_offset + (unsigned int)(m % S) * stage_bytes;
    const unsigned int tile_dout = tile_q + dout_offset;
    const T* tile_q_ptr = smem + Shared::own_k + Shared::own_v + (int)(m % S) * Shared::stage_elements;
    const T* tile_dout_ptr = tile_q_ptr + Shared::stream_k;

    // s^T = k q^T: the warp's 16 keys by the tile's BN query rows.
    float st[NQ][4];
    cg_zero_accumulators(st);
    CG_UNROLL
    for (int kk = 0; kk < D / KSTEP; ++kk) {
      unsigned int ka[4];
      OwnK::template fragment<true>(ka, smem_address, own_k_ptr, 16 * warp, KSTEP * kk);
      cg_mma_across<StreamQ, BN>(st, ka, tile_q, tile_q_ptr, KSTEP * kk);
    }
    // p^T, zero past the keys, past Tq (lse_log2 +inf) and, causal, above the diagonal.
    // In 32 bits, once a tile: this lane's first key's distance to the
    // last key and to the tile's first query row (both clamped to a tile).
    const cg_i64 query0 = (cg_i64)m * BN;  // the tile's first query row (in 64 bits: the index is 32)
    const bool edge = key0 + BM > Tk || (causal && key0 + 16 * warp + 15 > query0);
    const cg_i64 lane_key = key0 + 16 * warp + g;
    const int keys_left = (int)cg_clamp_i64(Tk - lane_key, -BM, BM);
    const int past_row = (int)cg_clamp_i64(lane_key - query0, -2 * BN, 2 * BN);
    CG_UNROLL
    for (int j = 0; j < NQ; ++j)
      CG_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int query = 8 * j + 2 * t + (e & 1);
        float p = cg_exp2_approx(st[j][e] * scale_log2 - row_stats[2 * query]);
        if (edge && (8 * (e >> 1) >= keys_left || (causal && past_row + 8 * (e >> 1) > query))) p = 0.0f;
        st[j][e] = p;
      }
    // dv += p^T dO (K: the tile's query rows).
    CG_UNROLL
    for (int kk = 0; kk < BN / KSTEP; ++kk) {
      unsigned int pa[4];
      cg_flash_p_fragment(pa, st, kk, T());
      cg_mma_across<StreamDoutAcross, PV>(dv, pa, tile_dout, tile_dout_ptr, KSTEP * kk, part * PV);
    }
    // dp^T = v dO^T, then ds^T = p^T (dp_scale dp^T - delta).
    float dst[NQ][4];
    cg_zero_accumulators(dst);
    CG_UNROLL
    for (int kk = 0; kk < DV / KSTEP; ++kk) {
      unsigned int va[4];
      OwnV::template fragment<true>(va, smem_address + own_v_offset, own_v_ptr, 16 * warp, KSTEP * kk);
      cg_mma_across<StreamDout, BN>(dst, va, tile_dout, tile_dout_ptr, KSTEP * kk);
    }
    CG_UNROLL
    for (int j = 0; j < NQ; ++j)
      CG_UNROLL
      for (int e = 0; e < 4; ++e) dst[j][e] = st[j][e] * (dp_scale * dst[j][e] - row_stats[2 * (8 * j + 2 * t + (e & 1)) + 1]);
    // dk += ds^T q (K: the tile's query rows).
    CG_UNROLL
    for (int kk = 0; kk < BN / KSTEP; ++kk) {
      unsigned int a[4];
      cg_flash_p_fragment(a, dst, kk, T());
      cg_mma_across<StreamQAcross, PD>(dk, a, tile_q, tile_q_ptr, KSTEP * kk, part * PD);
    }
    if constexpr (ATOMIC_DQ) cg_flash_backward_dq_part<Config, T>(dst, smem, m, Tq, dq_accum);
  }
  if constexpr (ATOMIC_DQ) {
    // This block's parts of dq are in: the last key block of each query tile stores its rows.
    for (cg_i64 m = first; m < end; ++m) {
      const cg_i64 blocks = causal ? ((m + 1) * BN - 1) / BM + 1 : key_tiles;  // the key blocks that add to tile m
      if (!cg_last_to_arrive(dq_arrivals + m, (int)(blocks < key_tiles ? blocks : key_tiles), (unsigned int*)stats))
        continue;
      constexpr int HD = Config::HEAD_D;
      for (int i = (int)threadIdx.x; i < BN * HD; i += Config::THREADS) {
        const cg_i64 row = m * BN + i / HD;
        if (row >= Tq) continue;
        float* at = dq_accum + row * HD + i % HD;
        store_dq(row, i % HD, cg_load_l2(at, 0));
        *at = 0.0f;  // zero for the next launch
      }
    }
  }
  cg_cp_async_wait<0>();
  __syncthreads();  // every warp is done with the tiles: the staged output reuses them
  if constexpr (Config::KEY_SPLIT == 1) {
    cg_flash_store_tile<Config, DV, Config::HEAD_DV>(dv, (float*)smem, key0, Tk, store_dv);
    cg_flash_store_tile<Config, D, Config::HEAD_D>(dk, (float*)smem, key0, Tk, store_dk);
  } else {  // (a padded head's last share may be narrower than the tile's)
    cg_flash_store_tile<Config, PV, PV>(dv, (float*)smem, key0, Tk, store_dv, part * PV, Config::HEAD_DV - part * PV);
    cg_flash_store_tile<Config, PD, PD>(dk, (float*)smem, key0, Tk, store_dk, part * PD, Config::HEAD_D - part * PD);
  }
}

// The block of query tile `tile_m` (rows [tile_m BLOCK_M, +BLOCK_M)): dq of
// its rows, unscaled, to store_dq(row, c, value).
template <typename Config, typename T, typename StoreDq>
CG_DEVICE void cg_flash_backward_queries(const T* q, const T* k, const T* v, const T* dout, const float* stats_rows,
                                         cg_i64 Tq, cg_i64 Tk, cg_i64 tile_m, float scale_log2, float dp_scale,
                                         bool causal, StoreDq store_dq, T* smem) {
  constexpr int D = Config::D, DV = Config::DV, BM = Config::BLOCK_M, BN = Config::BLOCK_N, S = Config::STAGES;
  constexpr int NK = BN / 8, OD = D / 8;  // n8 tiles: of the streamed keys, of dq's rows
  typedef cg_flash_backward_shared<Config, T> Shared;
  // q and dO of the block's rows as A operands (into registers); the streamed
  // keys and values as B operands along their rows (K: D or DV; s = q k^T,
  // dp = dO v^T), the keys across them too (K: the keys; dq += ds k).
  // (TF32: KSTEP and the paired swizzle as in the key blocks.)
  constexpr bool PAIRED = sizeof(T) == 4;
  typedef cg_gemm_operand<BM, D, true, T> OwnQ;
  typedef cg_gemm_operand<BM, DV, true, T> OwnDout;
  typedef cg_gemm_operand<BN, D, true, T, PAIRED> StreamK;
  typedef cg_gemm_operand<D, BN, false, T, PAIRED> StreamKAcross;
  typedef cg_gemm_operand<BN, DV, true, T, PAIRED> StreamV;
  typedef cg_gemm_operand<DV, BN, false, T, PAIRED> StreamVAcross;
  constexpr int KSTEP = 2 * OwnQ::CHUNK;
  // q's and dO's fragments take (D + DV) / 4 registers a thread of 16-bit
  // values, twice that of 4-byte ones: beside dq's D / 2, over heads of 128
  // (of 64 in 4-byte types) they stay in the block's shared tiles, read at
  // every key tile.
  constexpr bool OWN_IN_SHARED = (int)sizeof(T) * (D + DV) > 512;
  const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const cg_i64 m0 = tile_m * BM;
  const cg_i64 row0 = m0 + 16 * warp + g;  // this thread's rows: row0 and row0 + 8
  const unsigned int smem_address = cg_smem_address(smem);
  constexpr unsigned int own_dout_offset = Shared::own_k * (int)sizeof(T);
  constexpr unsigned int stages_offset = (Shared::own_k + Shared::own_v) * (int)sizeof(T);
  constexpr unsigned int stage_bytes = Shared::stage_elements * (int)sizeof(T);
  constexpr unsigned int v_offset = Shared::stream_k * (int)sizeof(T);
  {
    const typename OwnQ::template copier<Config::THREADS> copy_q(q, Config::HEAD_D, m0, Tq, 0, Config::HEAD_D);
    const typename OwnDout::template copier<Config::THREADS> copy_dout(dout, Config::HEAD_DV, m0, Tq, 0,
                                                                       Config::HEAD_DV);
    copy_q.copy(smem_address, 0);
    copy_dout.copy(smem_address + own_dout_offset, 0);
    cg_cp_async_commit();
  }
  const typename StreamKAcross::template copier<Config::THREADS> copy_k(k, Config::HEAD_D, 0, Config::HEAD_D, 0, Tk);
  const typename StreamVAcross::template copier<Config::THREADS> copy_v(v, Config::HEAD_DV, 0, Config::HEAD_DV, 0, Tk);
  auto load_stage = [&](cg_i64 n) {
    const unsigned int stage = smem_address + stages_offset + (unsigned int)(n % S) * stage_bytes;
    copy_k.copy(stage, n);
    copy_v.copy(stage + v_offset, n);
  };
  // Causal: no key past the tile's last row.
  const cg_i64 keys = causal && m0 + BM < Tk ? m0 + BM : Tk;
  const int n_tiles = (int)((keys + BN - 1) / BN);  // 32 bits, as the key blocks' tiles
  for (int s = 0; s < S - 1; ++s) {
    if (s < n_tiles) load_stage(s);
    cg_cp_async_commit();
  }
  // The rows' statistics (the rows array covers whole tiles).
  const float lse_row[2] = {stats_rows[2 * row0], stats_rows[2 * (row0 + 8)]};
  const float delta_row[2] = {stats_rows[2 * row0 + 1], stats_rows[2 * (row0 + 8) + 1]};
  unsigned int qa[OWN_IN_SHARED ? 1 : D / KSTEP][4], da[OWN_IN_SHARED ? 1 : DV / KSTEP][4];
  cg_cp_async_wait<S - 1>();
  __syncthreads();
  if (!OWN_IN_SHARED) {
    CG_UNROLL
    for (int kk = 0; kk < D / KSTEP; ++kk) OwnQ::template fragment<true>(qa[kk], smem_address, smem, 16 * warp, KSTEP * kk);
    CG_UNROLL
    for (int kk = 0; kk < DV / KSTEP; ++kk)
      OwnDout::template fragment<true>(da[kk], smem_address + own_dout_offset, smem + Shared::own_k, 16 * warp, KSTEP * kk);
  }
  float dq[OD][4];
  cg_zero_accumulators(dq);

  for (int n = 0; n < n_tiles; ++n) {
    cg_cp_async_wait<S - 2>();
    __syncthreads();
    if (n + S - 1 < n_tiles) load_stage(n + S - 1);
    cg_cp_async_commit();
    const unsigned int tile_k = smem_address + stages_offset + (unsigned int)(n % S) * stage_bytes, tile_v = tile_k + v_offset;
    const T* tile_k_ptr = smem + Shared::own_k + Shared::own_v + (int)(n % S) * Shared::stage_elements;
    const T* tile_v_ptr = tile_k_ptr + Shared::stream_k;
    // s = q k^T, then p (zero past the keys and, causal, past the diagonal).
    float s[NK][4], dp[NK][4];
    cg_zero_accumulators(s);
    cg_zero_accumulators(dp);
    CG_UNROLL
    for (int kk = 0; kk < D / KSTEP; ++kk) {
      unsigned int shared_a[4];
      if (OWN_IN_SHARED) OwnQ::template fragment<true>(shared_a, smem_address, smem, 16 * warp, KSTEP * kk);
      cg_mma_across<StreamK, BN>(s, OWN_IN_SHARED ? shared_a : qa[OWN_IN_SHARED ? 0 : kk], tile_k, tile_k_ptr, KSTEP * kk);
    }
    const cg_i64 key0 = (cg_i64)n * BN;  // (in 64 bits: the index is 32)
    // In 32 bits, once a tile: this lane's first key's distance to the
    // last key and past this thread's first row (both clamped to a tile).
    const bool edge = key0 + BN > Tk || (causal && key0 + BN - 1 > m0 + 16 * warp);
    const int keys_left = (int)cg_clamp_i64(Tk - key0 - 2 * t, -BN, BN);
    const int past_row = (int)cg_clamp_i64(key0 + 2 * t - row0, -2 * BN, 2 * BN);
    CG_UNROLL
    for (int j = 0; j < NK; ++j)
      CG_UNROLL
      for (int e = 0; e < 4; ++e) {
        float p = cg_exp2_approx(s[j][e] * scale_log2 - lse_row[e >> 1]);
        const int key = 8 * j + (e & 1);  // past this lane's first
        if (edge && (key >= keys_left || (causal && past_row + key > 8 * (e >> 1)))) p = 0.0f;
        s[j][e] = p;
      }
    // dp = dO v^T, then ds = p (dp_scale dp - delta).
    CG_UNROLL
    for (int kk = 0; kk < DV / KSTEP; ++kk) {
      unsigned int shared_a[4];
      if (OWN_IN_SHARED)
        OwnDout::template fragment<true>(shared_a, smem_address + own_dout_offset, smem + Shared::own_k, 16 * warp, KSTEP * kk);
      cg_mma_across<StreamV, BN>(dp, OWN_IN_SHARED ? shared_a : da[OWN_IN_SHARED ? 0 : kk], tile_v, tile_v_ptr, KSTEP * kk);
    }
    CG_UNROLL
    for (int j = 0; j < NK; ++j)
      CG_UNROLL
      for (int e = 0; e < 4; ++e) dp[j][e] = s[j][e] * (dp_scale * dp[j][e] - delta_row[e >> 1]);
    // dq += ds k (K: the tile's keys).
    CG_UNROLL
    for (int kk = 0; kk < BN / KSTEP; ++kk) {
      unsigned int a[4];
      cg_flash_p_fragment(a, dp, kk, T());
      cg_mma_across<StreamKAcross, D>(dq, a, tile_k, tile_k_ptr, KSTEP * kk);
    }
  }
  cg_cp_async_wait<0>();
  __syncthreads();
  cg_flash_store_tile<Config, D, Config::HEAD_D>(dq, (float*)smem, m0, Tq, store_dq);
}

// The backward pass of one head: blocks [0, key_blocks) take a tile of keys
// each (dk, dv; causal, the first keys have the most query rows to visit;
// over heads of 128, Config::KEY_SPLIT blocks a tile, each a share of the
// columns), the next ceil(Tq / BLOCK_M) a tile of query rows each (dq; causal, last tile first);
// `tile` is the block's index among them. q is Tq x HEAD_D, k Tk x HEAD_D,
// v Tk x HEAD_DV, dout Tq x HEAD_DV, all of the head's rows; stats the
// head's rows' statistics (cg_flash_backward_rows, launched before); scale_log2
// and causal as the forward took them; dp = dp_scale dout v^T.
// The gradients go unscaled to their stores (see above). Where dq, or dk and
// dv, have no reader, their blocks are not launched (key_blocks 0, or a grid
// of key blocks alone). ATOMIC_DQ: the key blocks sum dq too (see
// cg_flash_backward_keys; dq_accum and dq_arrivals the head's), and no query
// blocks are launched.
template <typename Config, typename T, bool ATOMIC_DQ, typename StoreDq, typename StoreDk, typename StoreDv>
CG_DEVICE void cg_flash_attention_backward(const T* q, const T* k, const T* v, const T* dout, const float* stats,
                                           cg_i64 Tq, cg_i64 Tk, cg_i64 tile, cg_i64 key_blocks, float scale_log2,
                                           float dp_scale, bool causal, float* dq_accum, unsigned int* dq_arrivals,
                                           StoreDq store_dq, StoreDk store_dk, StoreDv store_dv, T* smem) {
  static_assert(Config::BLOCK_M % Config::BLOCK_N == 0, "the statistics cover whole tiles of both kinds");
  constexpr int SPLIT = Config::KEY_SPLIT;
  if (tile < key_blocks)
    cg_flash_backward_keys<Config, T, ATOMIC_DQ>(q, k, v, dout, stats, Tq, Tk, tile / SPLIT, (int)(tile % SPLIT),
                                                 key_blocks / SPLIT, scale_log2, dp_scale, causal, dq_accum,
                                                 dq_arrivals, store_dq, store_dk, store_dv, smem);
  else  // (causal: the query tiles with the most keys first, as the forward runs them)
    cg_flash_backward_queries<Config, T>(q, k, v, dout, stats, Tq, Tk,
                                         causal ? (Tq + Config::BLOCK_M - 1) / Config::BLOCK_M - 1 - (tile - key_blocks)
                                                : tile - key_blocks,
                                         scale_log2, dp_scale, causal, store_dq, smem);
}
