// Flash attention, forward, on the Hopper path (sm_90a; docs/attention.md
// "The Hopper path"): the same attention as cg_flash_attention (its scale,
// causal mask, log-sum-exp and stores), after FlashAttention-3 (Shah et al.,
// 2024), from the paper, in this project's own code:
//   - warp specialised: warpgroup 0 is the producer (one thread issues the
//     copies, the warpgroup gives most of its registers back), warpgroups 1
//     and 2 the consumers, 64 query rows each of the block's 128;
//   - q, k and v by TMA through 3-D tensor maps (head size x length x
//     heads), so that a tile never reads another head's rows: rows past the
//     head's length, and the columns of a head narrower than its tile (80 or
//     96 values in a tile of 128), arrive as zeros; written with the 128-byte
//     swizzle as boxes of 64 columns;
//   - q once; keys and values STAGES tiles of 128 in flight, each on its own
//     "full" mbarrier (a tile's scores start when its keys have landed, its
//     values may still be on their way), a stage released ("empty") by every
//     consumer thread once the wgmma that read its values has completed;
//   - s = q k^T by wgmma m64n128k16, both operands from shared memory; the
//     online softmax in registers (exp2, the scale folded into one
//     multiply); p, rounded to 16 bits, stays in registers as the A operand
//     of o += p v (the register form of wgmma, m64nDk16, v N-major);
//   - causal attention visits no key tile past the block's last row and
//     masks the tiles that cross a warp's diagonal or the last keys;
//   - the output through each warp's own rows of shared memory, a chunk of
//     64 columns at a time, so that the stores are a warp's consecutive
//     columns.
// sm_90a only (wgmma, setmaxnreg); compiled for any other target it traps,
// and the generator never launches it there (generator/arch.h). Not yet:
// two consumers' softmax overlapped with the other's products (ping-pong),
// a tile's softmax with its own next products, split-KV, the backward pass
// (the flash backward kernel of templates/softmax_flash.cuh reads what this
// one stores), heads over 128.

// The kernel's compile-time shape: a tile of D (64 or 128) head values for
// q, k and v alike, HEAD_D of them the head's own (at most D, a multiple of
// 8: rows of whole 16-byte chunks, as TMA needs), STAGES key tiles in flight.
template <int D_, int STAGES_, int HEAD_D_ = D_>
struct cg_flash_sm90_config {
  static constexpr int D = D_, STAGES = STAGES_, HEAD_D = HEAD_D_;
  static_assert(D == 64 || D == 128, "tiles of 64 or 128 head values (the register-A wgmma's widths)");
  static_assert(HEAD_D <= D && HEAD_D % 8 == 0, "heads of whole 16-byte chunks, no wider than their tiles");
  static_assert(STAGES >= 2, "a key tile is copied while the one before is read");
  static constexpr int BLOCK_M = 128, BLOCK_N = 128, CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1);
  // A box is 64 columns (one 128-byte swizzle row of 16-bit values) by a
  // tile's rows; a tile of D columns is D / 64 of them, one after another.
  static constexpr int Q_CHUNK_BYTES = BLOCK_M * 128, KV_CHUNK_BYTES = BLOCK_N * 128;
  static constexpr int Q_BYTES = (D / 64) * Q_CHUNK_BYTES, KV_BYTES = (D / 64) * KV_CHUNK_BYTES;
  static constexpr int STAGE_BYTES = 2 * KV_BYTES;  // the keys, then the values
  // Each consumer warp's 16 rows of output, 64 columns at a time (floats);
  // the row stride puts a half-warp's 8-byte stores on 32 distinct banks.
  static constexpr int OUT_COLUMNS = 64, OUT_ROW = OUT_COLUMNS + 8;
  static constexpr int OUT_BYTES = CONSUMERS * 4 * 16 * OUT_ROW * 4;
  // q's barrier, then each stage's keys', values' and release barriers.
  static constexpr int BARRIER_BYTES = 8 * (1 + 3 * STAGES);
  // From a 1024-byte boundary (the swizzle follows address bits): 1 KiB of slack.
  static constexpr int SHARED_BYTES = 1024 + Q_BYTES + STAGES * STAGE_BYTES + OUT_BYTES + BARRIER_BYTES;
  // setmaxnreg: 128 x 40 + 256 x 232 registers, within the SM's 65536.
  static constexpr int PRODUCER_REGISTERS = 40, CONSUMER_REGISTERS = 232;
};

// Attention for query rows [tile_m 128, tile_m 128 + 128) of head `head`
// (keys and values of head `kv_head`: grouped-query attention) over all its
// keys: p_ij = exp(scale s_ij) / sum_j exp(scale s_ij), s_ij = q_i . k_j (in
// log2 units s_ij scale_log2), o_i = sum_j p_ij v_j; key j <= i where causal
// (PyTorch's top-left alignment). The maps (cg_tensor_map, 3-D, 16-bit T,
// the 128-byte swizzle): q's HEAD_D wide, Tq high, a plane a head, its box
// 64 x 128; k's and v's the same with Tk. Each o_i[c] (c < HEAD_D) goes to
// store_out(i, c, value), each row's log-sum-exp (natural log) to
// store_lse(i, value); rows i >= Tq are not stored. `smem`: SHARED_BYTES.
template <typename Config, typename T, typename StoreOut, typename StoreLse>
CG_DEVICE void cg_flash_attention_sm90(const cg_tensor_map* map_q, const cg_tensor_map* map_k,
                                       const cg_tensor_map* map_v, cg_i64 Tq, cg_i64 Tk, cg_i64 tile_m, int head,
                                       int kv_head, float scale_log2, bool causal, StoreOut store_out,
                                       StoreLse store_lse, unsigned char* smem) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("trap;");  // no wgmma on this target: the generator never launches this kernel here
#else
  constexpr int S = Config::STAGES, D = Config::D, BM = Config::BLOCK_M, BN = Config::BLOCK_N;
  constexpr int NT = BN / 8, OT = D / 8;  // n8 column groups of a thread's scores and of its output
  const unsigned int base = (cg_smem_address(smem) + 1023u) & ~1023u;
  unsigned char* q_tile = cg_smem_pointer(base);
  unsigned char* stages = q_tile + Config::Q_BYTES;
  float* staged = (float*)(stages + S * Config::STAGE_BYTES);
  unsigned long long* q_full = (unsigned long long*)((unsigned char*)staged + Config::OUT_BYTES);
  unsigned long long* k_full = q_full + 1;
  unsigned long long* v_full = k_full + S;
  unsigned long long* empty = v_full + S;
  const int thread = threadIdx.x, warpgroup = thread / 128;
  if (thread == 0) {
    cg_mbarrier_init(q_full, 1);
    for (int s = 0; s < S; ++s) {
      cg_mbarrier_init(&k_full[s], 1);  // the producer's arrival, with the tile's bytes
      cg_mbarrier_init(&v_full[s], 1);
      cg_mbarrier_init(&empty[s], 128 * Config::CONSUMERS);  // every consumer thread, once its p v has completed
    }
    cg_fence_barrier_init();
  }
  __syncthreads();
  const cg_i64 m0 = tile_m * BM;
  // Causal: no key past the block's last row.
  const cg_i64 keys = causal && m0 + BM < Tk ? m0 + BM : Tk;
  const int n_tiles = (int)((keys + BN - 1) / BN);

  if (warpgroup == 0) {
    cg_setmaxnreg_dec<Config::PRODUCER_REGISTERS>();
    if (thread == 0) {
      cg_mbarrier_arrive_expect_tx(q_full, Config::Q_BYTES);
      CG_UNROLL
      for (int c = 0; c < D / 64; ++c)
        cg_tma_load_3d(q_tile + c * Config::Q_CHUNK_BYTES, map_q, 64 * c, (int)m0, head, q_full);
      cg_sm90_pipeline_state load = {0, 0u};
      for (int n = 0; n < n_tiles; ++n, load.advance(S)) {
        // Round r of a stage waits for the consumers' release of round r - 1
        // (the first round's wait returns at once: parity 1 of phase 0).
        cg_mbarrier_wait(&empty[load.stage], load.phase ^ 1u);
        unsigned char* stage = stages + load.stage * Config::STAGE_BYTES;
        cg_mbarrier_arrive_expect_tx(&k_full[load.stage], Config::KV_BYTES);
        CG_UNROLL
        for (int c = 0; c < D / 64; ++c)
          cg_tma_load_3d(stage + c * Config::KV_CHUNK_BYTES, map_k, 64 * c, n * BN, kv_head, &k_full[load.stage]);
        cg_mbarrier_arrive_expect_tx(&v_full[load.stage], Config::KV_BYTES);
        CG_UNROLL
        for (int c = 0; c < D / 64; ++c)
          cg_tma_load_3d(stage + Config::KV_BYTES + c * Config::KV_CHUNK_BYTES, map_v, 64 * c, n * BN, kv_head,
                         &v_full[load.stage]);
      }
    }
    return;
  }

  cg_setmaxnreg_inc<Config::CONSUMER_REGISTERS>();
  const int consumer = warpgroup - 1;  // rows [64 consumer, 64 consumer + 64) of the block's
  const int t = thread % 128, warp = t / 32, lane = t % 32, g = lane / 4, quad = lane % 4;
  const cg_i64 warp_row0 = m0 + 64 * consumer + 16 * warp;
  const cg_i64 row0 = warp_row0 + g;  // this thread's rows: row0 and row0 + 8
  const unsigned int q_rows = base + (unsigned int)(consumer * 64 * 128);
  // The accumulators in the wgmma layout: element (row0 + 8 (e / 2),
  // 8 j + 2 quad + e % 2) in [j][e], as mma.sync's m16n8 tiles lie, so that
  // p's A fragments are the scores' registers (cg_flash_p_fragment).
  float o[OT][4];
  float row_max[2] = {cg_neg_inf(), cg_neg_inf()}, row_sum[2] = {0.0f, 0.0f};
  cg_mbarrier_wait(q_full, 0);
  cg_sm90_pipeline_state read = {0, 0u};
  for (int n = 0; n < n_tiles; ++n, read.advance(S)) {
    const unsigned int k_tile = base + (unsigned int)(Config::Q_BYTES + read.stage * Config::STAGE_BYTES),
                       v_tile = k_tile + Config::KV_BYTES;
    // s = q k^T: a k step of 16 is 32 bytes along a 128-byte row, the next
    // 64 head values the next box.
    float s[NT][4];
    cg_mbarrier_wait(&k_full[read.stage], read.phase);
    cg_wgmma_fence();
    CG_UNROLL
    for (int kk = 0; kk < D / 16; ++kk) {
      const unsigned int at = (unsigned int)(32 * (kk % 4));
      cg_wgmma_m64k16<BN, 0, T>(&s[0][0],
                                cg_wgmma_descriptor_128b(q_rows + (unsigned int)((kk / 4) * Config::Q_CHUNK_BYTES) + at),
                                cg_wgmma_descriptor_128b(k_tile + (unsigned int)((kk / 4) * Config::KV_CHUNK_BYTES) + at),
                                kk > 0);
    }
    cg_wgmma_commit();
    cg_wgmma_wait<0>();
    cg_wgmma_fence_operands<BN / 2>(&s[0][0]);

    cg_flash_scores_to_log2(s, scale_log2, (cg_i64)n * BN, Tk, warp_row0, row0, causal);
    // (Before the first tile's products o holds nothing: they set it.)
    cg_flash_online_softmax(s, o, row_max, row_sum, n > 0);

    // o += p v: p's registers, rounded to T, are the A operand 16 keys at a
    // time; v's tile is N-major (the next 8 keys 1024 bytes on, the next 64
    // head values a box on).
    unsigned int pa[BN / 16][4];
    CG_UNROLL
    for (int kk = 0; kk < BN / 16; ++kk) cg_flash_p_fragment(pa[kk], s, kk, T());
    cg_mbarrier_wait(&v_full[read.stage], read.phase);
    cg_wgmma_fence();
    CG_UNROLL
    for (int kk = 0; kk < BN / 16; ++kk)
      cg_wgmma_rs_m64k16<D, 1, T>(&o[0][0], pa[kk],
                                  cg_wgmma_descriptor_128b(v_tile + 2048u * (unsigned int)kk, Config::KV_CHUNK_BYTES, 1024),
                                  n > 0 || kk > 0);
    cg_wgmma_commit();
    cg_wgmma_wait<0>();
    cg_wgmma_fence_operands<D / 2>(&o[0][0]);
    cg_mbarrier_arrive(&empty[read.stage]);  // both of the stage's tiles are read
  }

  // The quad's parts of each row's sum, added; o / l; the log-sum-exp.
  float inverse[2];
  CG_UNROLL
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    inverse[r] = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
    const cg_i64 row = row0 + 8 * r;
    if (quad == 0 && row < Tq) store_lse(row, (row_max[r] + log2f(row_sum[r])) * 0.6931471805599453f);
  }
  // A chunk of 64 columns at a time: this warp's 16 rows of it into its own
  // part of shared memory (no other warp reads it: a warp barrier
  // suffices), then out a row at a time, a lane a column.
  float* rows = staged + (consumer * 4 + warp) * 16 * Config::OUT_ROW;
  CG_UNROLL
  for (int chunk = 0; chunk < D / Config::OUT_COLUMNS; ++chunk) {
    CG_UNROLL
    for (int j = 0; j < Config::OUT_COLUMNS / 8; ++j)
      CG_UNROLL
      for (int r = 0; r < 2; ++r) {
        const float* acc = o[chunk * (Config::OUT_COLUMNS / 8) + j];
        cg_aligned_chunk<2, float> pair = {{acc[2 * r] * inverse[r], acc[2 * r + 1] * inverse[r]}};
        float* at = rows + (g + 8 * r) * Config::OUT_ROW + 8 * j + 2 * quad;
#ifdef CUDAGEN_EMULATION
        cudagen_emu::note_shared_request(at, 8);
#endif
        *reinterpret_cast<cg_aligned_chunk<2, float>*>(at) = pair;
      }
    __syncwarp();
    for (int r = 0; r < 16; ++r) {
      if (warp_row0 + r >= Tq) break;
      CG_UNROLL
      for (int j = 0; j < Config::OUT_COLUMNS / 32; ++j) {
        const int c = chunk * Config::OUT_COLUMNS + 32 * j + lane;
        if (c < Config::HEAD_D) store_out(warp_row0 + r, c, rows[r * Config::OUT_ROW + 32 * j + lane]);
      }
    }
    __syncwarp();  // every lane has read the rows before the next chunk overwrites them
  }
#endif
}
