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
//     96 values in a tile of 128, 16 or 32 in a tile of 64, 160 in one of
//     192), arrive as zeros; written with the 128-byte swizzle as boxes of
//     64 columns;
//   - q once; keys and values STAGES tiles of 128 (64 over heads of 128)
//     in flight, each on its own "full" mbarrier (a tile's scores start when
//     its keys have landed, its values may still be on their way), a stage
//     released ("empty") by every consumer thread once the wgmma that read
//     its values has completed;
//   - s = q k^T by wgmma m64n128k16 (m64n64k16 over heads of 128), both
//     operands from shared memory; the online softmax in registers (exp2,
//     the scale folded into one multiply); p, rounded to 16 bits, stays in
//     registers as the A operand of o += p v (the register form of wgmma,
//     m64nDk16, v N-major);
//   - within a warpgroup, the next tile's s = q k^T is issued before this
//     tile's o += p v, and its softmax runs while p v does;
//   - causal attention visits no key tile past the block's last row and
//     masks the tiles that cross a warp's diagonal or the last keys;
//   - the output through each warp's own rows of shared memory, a chunk of
//     64 columns (32 over heads of 192) at a time, so that the stores are a
//     warp's consecutive columns;
//   - decoding (few query rows over many keys): the keys split among blocks
//     (cg_flash_attention_split_sm90), each consumer warp's partial rows
//     combined by the last of its splits to arrive.
// sm_90a only (wgmma, setmaxnreg); compiled for any other target it traps,
// and the generator never launches it there (generator/arch.h). Not yet:
// the two consumers' softmax scheduled against each other's products
// (ping-pong).

// The kernel's compile-time shape: a tile of D (64, 128, 192 or 256) head values for
// q and k, DV for v and o, HEAD_D and HEAD_DV of them the heads' own (at
// most their tiles, a multiple of 8: rows of whole 16-byte chunks, as TMA
// needs; narrower heads arrive padded with zeros), STAGES key tiles in flight.
template <int D_, int STAGES_, int HEAD_D_ = D_, int DV_ = D_, int HEAD_DV_ = (DV_ == D_ ? HEAD_D_ : DV_)>
struct cg_flash_sm90_config {
  static constexpr int D = D_, STAGES = STAGES_, HEAD_D = HEAD_D_, DV = DV_, HEAD_DV = HEAD_DV_;
  static_assert((D % 64 == 0 && D >= 64 && D <= 256) && (DV % 64 == 0 && DV >= 64 && DV <= 256),
                "tiles of 64, 128, 192 or 256 head values (the register-A wgmma's widths, whole swizzle rows)");
  static_assert(HEAD_D <= D && HEAD_D % 8 == 0 && HEAD_DV <= DV && HEAD_DV % 8 == 0,
                "heads of whole 16-byte chunks, no wider than their tiles");
  static_assert(STAGES >= 2, "a key tile is copied while the one before is read");
  // Heads over 128: 64 keys a step, so that s (32 floats a thread), p's
  // fragments and o (up to 128) fit the consumers' registers beside each
  // other, and two stages of keys and values of 256 fit shared memory.
  static constexpr bool WIDE = D > 128 || DV > 128;
  static constexpr int BLOCK_M = 128, BLOCK_N = WIDE ? 64 : 128, CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1);
  // A box is 64 columns (one 128-byte swizzle row of 16-bit values) by a
  // tile's rows; a tile of D columns is D / 64 of them, one after another.
  static constexpr int Q_CHUNK_BYTES = BLOCK_M * 128, KV_CHUNK_BYTES = BLOCK_N * 128;
  static constexpr int Q_BYTES = (D / 64) * Q_CHUNK_BYTES, K_BYTES = (D / 64) * KV_CHUNK_BYTES,
                       V_BYTES = (DV / 64) * KV_CHUNK_BYTES;
  static constexpr int STAGE_BYTES = K_BYTES + V_BYTES;  // the keys, then the values
  // Each consumer warp's 16 rows of output, 64 columns at a time (floats;
  // 32 over heads of 192, whose stages leave no room for more); the row
  // stride (8 banks past a multiple of 32) puts a half-warp's 8-byte stores
  // on 32 distinct banks.
  static constexpr int OUT_COLUMNS = D > 192 || DV > 192 ? 32 : 64, OUT_ROW = OUT_COLUMNS + 8;
  static constexpr int OUT_BYTES = CONSUMERS * 4 * 16 * OUT_ROW * 4;
  // q's barrier, then each stage's keys', values' and release barriers.
  static constexpr int BARRIER_BYTES = 8 * (1 + 3 * STAGES);
  // From a 1024-byte boundary (the swizzle follows address bits): 1 KiB of slack.
  static constexpr int SHARED_BYTES = 1024 + Q_BYTES + STAGES * STAGE_BYTES + OUT_BYTES + BARRIER_BYTES;
  // setmaxnreg: 128 x 40 + 256 x 232 registers, within the SM's 65536.
  static constexpr int PRODUCER_REGISTERS = 40, CONSUMER_REGISTERS = 232;
};

// A consumer warp's 16 rows of a warpgroup's accumulators acc (the wgmma
// layout: element (g + 8 (e / 2), 8 j + 2 (lane % 4) + e % 2) of the warp's
// rows in acc[j][e]), each times its row's factor (factor[0] the thread's
// first row's, factor[1] the row 8 on), to store(row, c, value) for rows
// warp_row0 + r < limit and columns c < HEAD_D, acc's columns the head's
// from column0 on (a key block's share of dk and dv over heads of 128). A chunk of OUT_ROW - 8
// (64 or 32) columns at a time goes into the warp's own `rows` of shared
// memory (16 x OUT_ROW floats; no other warp reads them: a warp barrier
// suffices), then out a row at a time, a lane a column, so that the stores
// are a warp's consecutive columns. (OUT_ROW 72 or 40, 8 banks past a
// multiple of 32: a half-warp's 8-byte stores on 32 distinct banks.)
template <int OUT_ROW, int D, int HEAD_D, typename Store>
CG_DEVICE void cg_flash_sm90_store_rows(const float (&acc)[D / 8][4], const float factor[2], float* rows,
                                        cg_i64 warp_row0, cg_i64 limit, Store store, int column0 = 0) {
  constexpr int COLUMNS = OUT_ROW - 8;
  static_assert((COLUMNS == 32 || COLUMNS == 64) && D % COLUMNS == 0, "chunks of 32 or 64 columns");
  const int lane = (int)threadIdx.x % 32, g = lane / 4, quad = lane % 4;
  CG_UNROLL
  for (int chunk = 0; chunk < D / COLUMNS; ++chunk) {
    CG_UNROLL
    for (int j = 0; j < COLUMNS / 8; ++j)
      CG_UNROLL
      for (int r = 0; r < 2; ++r) {
        const float* a = acc[chunk * (COLUMNS / 8) + j];
        cg_aligned_chunk<2, float> pair = {{a[2 * r] * factor[r], a[2 * r + 1] * factor[r]}};
        float* at = rows + (g + 8 * r) * OUT_ROW + 8 * j + 2 * quad;
#ifdef CUDAGEN_EMULATION
        cudagen_emu::note_shared_request(at, 8);
#endif
        *reinterpret_cast<cg_aligned_chunk<2, float>*>(at) = pair;
      }
    __syncwarp();
    for (int r = 0; r < 16; ++r) {
      if (warp_row0 + r >= limit) break;
      CG_UNROLL
      for (int j = 0; j < COLUMNS / 32; ++j) {
        const int c = column0 + chunk * COLUMNS + 32 * j + lane;
        if (c < HEAD_D) store(warp_row0 + r, c, rows[r * OUT_ROW + 32 * j + lane]);
      }
    }
    __syncwarp();  // every lane has read the rows before the next chunk overwrites them
  }
}

// acc (the warpgroup's 64 rows by N columns, N / 2 floats a thread) = A
// B^T over a tile of D head values: A's 64 rows and B's N rows both
// K-major in shared memory as TMA wrote them (the 128-byte swizzle), from
// shared addresses a and b, their column chunks of 64 values a_chunk and
// b_chunk bytes apart; a k step of 16 is 32 bytes along a 128-byte row.
// (Issued only: the caller commits and waits.)
template <int N, int D, typename T>
CG_DEVICE void cg_flash_sm90_product(float* acc, unsigned int a, unsigned int a_chunk, unsigned int b,
                                     unsigned int b_chunk) {
  CG_UNROLL
  for (int kk = 0; kk < D / 16; ++kk) {
    const unsigned int at = (unsigned int)(32 * (kk % 4));
    cg_wgmma_m64k16<N, 0, T>(acc, cg_wgmma_descriptor_128b(a + (kk / 4) * a_chunk + at),
                             cg_wgmma_descriptor_128b(b + (kk / 4) * b_chunk + at), kk > 0);
  }
}

// acc (64 x N) += A B over K rows, or = where not `accumulate`: A in the
// warpgroup's registers (K / 16 fragments: probabilities or ds, rounded to
// T), B's K rows N-major from shared address b (the next 8 rows 1024 bytes
// on, the next 64 columns b_chunk bytes on). (Issued only.)
template <int N, int K, typename T>
CG_DEVICE void cg_flash_sm90_product_rs(float* acc, const unsigned int (&a)[K / 16][4], unsigned int b,
                                        unsigned int b_chunk, bool accumulate = true) {
  CG_UNROLL
  for (int kk = 0; kk < K / 16; ++kk)
    cg_wgmma_rs_m64k16<N, 1, T>(acc, a[kk], cg_wgmma_descriptor_128b(b + 2048u * (unsigned int)kk, b_chunk, 1024),
                                accumulate || kk > 0);
}

// Where the forward kernel's pieces lie in shared memory (from a 1024-byte
// boundary of the .shared window, as the swizzle needs), and its barriers:
// q's, then each stage's keys', values' and release barriers.
template <typename Config>
struct cg_flash_sm90_layout {
  unsigned int base;  // shared address of q's tile; the stages, the staged rows and the barriers follow
  CG_DEVICE unsigned int keys(int stage) const {
    return base + (unsigned int)(Config::Q_BYTES + stage * Config::STAGE_BYTES);
  }
  CG_DEVICE unsigned int values(int stage) const { return keys(stage) + Config::K_BYTES; }
  CG_DEVICE float* staged() const { return (float*)cg_smem_pointer(keys(Config::STAGES)); }
  CG_DEVICE unsigned long long* q_full() const {
    return (unsigned long long*)cg_smem_pointer(keys(Config::STAGES) + Config::OUT_BYTES);
  }
  CG_DEVICE unsigned long long* k_full(int stage) const { return q_full() + 1 + stage; }
  CG_DEVICE unsigned long long* v_full(int stage) const { return q_full() + 1 + Config::STAGES + stage; }
  CG_DEVICE unsigned long long* empty(int stage) const { return q_full() + 1 + 2 * Config::STAGES + stage; }
};

template <typename Config>
CG_DEVICE cg_flash_sm90_layout<Config> cg_flash_sm90_setup(unsigned char* smem) {
  cg_flash_sm90_layout<Config> l;
  l.base = (cg_smem_address(smem) + 1023u) & ~1023u;
  if (threadIdx.x == 0) {
    cg_mbarrier_init(l.q_full(), 1);
    for (int s = 0; s < Config::STAGES; ++s) {
      cg_mbarrier_init(l.k_full(s), 1);  // the producer's arrival, with the tile's bytes
      cg_mbarrier_init(l.v_full(s), 1);
      cg_mbarrier_init(l.empty(s), 128 * Config::CONSUMERS);  // every consumer thread, once its p v has completed
    }
    cg_fence_barrier_init();
  }
  __syncthreads();
  return l;
}

// The producer's first thread: q's rows [m0, m0 + 128) of plane `head`
// once, then key tiles [first, end) of plane kv_head, keys and values each
// on its stage's own barrier.
template <typename Config>
CG_DEVICE void cg_flash_sm90_produce(const cg_flash_sm90_layout<Config>& l, const cg_tensor_map* map_q,
                                     const cg_tensor_map* map_k, const cg_tensor_map* map_v, cg_i64 m0, int head,
                                     int kv_head, int first, int end) {
  constexpr int S = Config::STAGES, D = Config::D, DV = Config::DV, BN = Config::BLOCK_N;
  cg_mbarrier_arrive_expect_tx(l.q_full(), Config::Q_BYTES);
  CG_UNROLL
  for (int c = 0; c < D / 64; ++c)
    cg_tma_load_3d(cg_smem_pointer(l.base + (unsigned int)(c * Config::Q_CHUNK_BYTES)), map_q, 64 * c, (int)m0, head,
                   l.q_full());
  cg_sm90_pipeline_state load = {0, 0u};
  for (int n = first; n < end; ++n, load.advance(S)) {
    // Round r of a stage waits for the consumers' release of round r - 1
    // (the first round's wait returns at once: parity 1 of phase 0).
    cg_mbarrier_wait(l.empty(load.stage), load.phase ^ 1u);
    cg_mbarrier_arrive_expect_tx(l.k_full(load.stage), Config::K_BYTES);
    CG_UNROLL
    for (int c = 0; c < D / 64; ++c)
      cg_tma_load_3d(cg_smem_pointer(l.keys(load.stage) + (unsigned int)(c * Config::KV_CHUNK_BYTES)), map_k, 64 * c,
                     n * BN, kv_head, l.k_full(load.stage));
    cg_mbarrier_arrive_expect_tx(l.v_full(load.stage), Config::V_BYTES);
    CG_UNROLL
    for (int c = 0; c < DV / 64; ++c)
      cg_tma_load_3d(cg_smem_pointer(l.values(load.stage) + (unsigned int)(c * Config::KV_CHUNK_BYTES)), map_v, 64 * c,
                     n * BN, kv_head, l.v_full(load.stage));
  }
}

// A consumer thread's rows after its key tiles, in the wgmma layout:
// element (row0 + 8 (e / 2), 8 j + 2 quad + e % 2) of o in o[j][e], as
// mma.sync's m16n8 tiles lie, so that p's A fragments are the scores'
// registers (cg_flash_p_fragment); o unnormalised, each row's running
// maximum (log2 units) and the thread's part of its sum.
template <typename Config>
struct cg_flash_sm90_rows {
  float o[Config::DV / 8][4];
  float row_max[2], row_sum[2];
};

// A consumer warpgroup's 64 rows of q (from shared address q_rows) over
// key tiles [first, end), end > first: s = q k^T by wgmma from shared
// memory, the online softmax in registers, o += p v with p in registers.
// Within the warpgroup, tile n + 1's scores overlap tile n's p v
// (FlashAttention-3's intra-warpgroup pipelining): s = q k^T of the next
// tile is issued before o += p v of this one, and turned into
// probabilities while p v runs; o's rescale for the next tile's maximum
// waits until p v has completed. s, p's fragments and o are live at once:
// 168 registers at heads of 128 (ptxas; the consumers have 232).
template <typename Config, typename T>
CG_DEVICE void cg_flash_sm90_consume(const cg_flash_sm90_layout<Config>& l, cg_flash_sm90_rows<Config>& rows,
                                     unsigned int q_rows, cg_i64 Tk, cg_i64 warp_row0, cg_i64 row0, int first,
                                     int end, float scale_log2, bool causal) {
  constexpr int S = Config::STAGES, D = Config::D, DV = Config::DV, BN = Config::BLOCK_N;
  constexpr int NT = BN / 8;  // n8 column groups of a thread's scores
  rows.row_max[0] = rows.row_max[1] = cg_neg_inf();
  rows.row_sum[0] = rows.row_sum[1] = 0.0f;
  float s[NT][4];
  unsigned int pa[BN / 16][4];
  auto issue_scores = [&](const cg_sm90_pipeline_state& at) {
    // s = q k^T: a k step of 16 is 32 bytes along a 128-byte row, the next
    // 64 head values the next box.
    cg_mbarrier_wait(l.k_full(at.stage), at.phase);
    cg_wgmma_fence();
    cg_flash_sm90_product<BN, D, T>(&s[0][0], q_rows, Config::Q_CHUNK_BYTES, l.keys(at.stage), Config::KV_CHUNK_BYTES);
    cg_wgmma_commit();
  };
  // s of tile n, landed: scaled, masked, into probabilities (row_max and
  // row_sum move on), o's rescale factors for them in `rescale`.
  auto softmax = [&](int n, float rescale[2]) {
    cg_wgmma_fence_operands<BN / 2>(&s[0][0]);
    cg_flash_scores_to_log2(s, scale_log2, (cg_i64)n * BN, Tk, warp_row0, row0, causal);
    cg_flash_softmax_step(s, rows.row_max, rows.row_sum, rescale);
  };
  // p's registers, rounded to T: the A operand of o += p v, 16 keys at a time.
  auto make_p = [&] {
    CG_UNROLL
    for (int kk = 0; kk < BN / 16; ++kk) cg_flash_p_fragment(pa[kk], s, kk, T());
  };
  cg_mbarrier_wait(l.q_full(), 0);
  cg_sm90_pipeline_state read = {0, 0u};
  float rescale[2];
  issue_scores(read);
  cg_wgmma_wait<0>();
  softmax(first, rescale);  // (before the first tile's products o holds nothing: they set it)
  make_p();
  // o += p v of tile n (v's tile N-major: the next 8 keys 1024 bytes on,
  // the next 64 head values a box on), issued.
  auto issue_pv = [&](int n) {
    cg_mbarrier_wait(l.v_full(read.stage), read.phase);
    cg_wgmma_fence();
    cg_flash_sm90_product_rs<DV, BN, T>(&rows.o[0][0], pa, l.values(read.stage), Config::KV_CHUNK_BYTES, n > first);
    cg_wgmma_commit();
  };
  // Every tile but the last: the next one's scores in flight beside p v.
  for (int n = first; n + 1 < end; ++n) {
    cg_sm90_pipeline_state next = read;
    next.advance(S);
    issue_scores(next);
    issue_pv(n);
    cg_wgmma_wait<1>();  // the next tile's scores; p v may still run
    softmax(n + 1, rescale);
    cg_wgmma_wait<0>();
    cg_wgmma_fence_operands<DV / 2>(&rows.o[0][0]);
    cg_mbarrier_arrive(l.empty(read.stage));  // both of the stage's tiles are read
    cg_flash_rescale(rows.o, rescale);
    make_p();
    read = next;
  }
  issue_pv(end - 1);
  cg_wgmma_wait<0>();
  cg_wgmma_fence_operands<DV / 2>(&rows.o[0][0]);
  cg_mbarrier_arrive(l.empty(read.stage));
  // The quad's parts of each row's sum, added.
  CG_UNROLL
  for (int r = 0; r < 2; ++r) {
    rows.row_sum[r] += __shfl_xor_sync(0xffffffffu, rows.row_sum[r], 1);
    rows.row_sum[r] += __shfl_xor_sync(0xffffffffu, rows.row_sum[r], 2);
  }
}

// Attention for query rows [tile_m 128, tile_m 128 + 128) of head `head`
// (keys and values of head `kv_head`: grouped-query attention) over all its
// keys: p_ij = exp(scale s_ij) / sum_j exp(scale s_ij), s_ij = q_i . k_j (in
// log2 units s_ij scale_log2), o_i = sum_j p_ij v_j; key j <= i where causal
// (PyTorch's top-left alignment). The maps (cg_tensor_map, 3-D, 16-bit T,
// the 128-byte swizzle): q's HEAD_D wide, Tq high, a plane a head, its box
// 64 x 128; k's the same with Tk (boxes of 64 x BLOCK_N), v's HEAD_DV wide. Each o_i[c] (c <
// HEAD_DV) goes to store_out(i, c, value), each row's log-sum-exp (natural
// log) to store_lse(i, value); rows i >= Tq are not stored. `smem`:
// SHARED_BYTES.
template <typename Config, typename T, typename StoreOut, typename StoreLse>
CG_DEVICE void cg_flash_attention_sm90(const cg_tensor_map* map_q, const cg_tensor_map* map_k,
                                       const cg_tensor_map* map_v, cg_i64 Tq, cg_i64 Tk, cg_i64 tile_m, int head,
                                       int kv_head, float scale_log2, bool causal, StoreOut store_out,
                                       StoreLse store_lse, unsigned char* smem) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("trap;");  // no wgmma on this target: the generator never launches this kernel here
#else
  constexpr int BM = Config::BLOCK_M, BN = Config::BLOCK_N;
  const cg_flash_sm90_layout<Config> l = cg_flash_sm90_setup<Config>(smem);
  const cg_i64 m0 = tile_m * BM;
  // Causal: no key past the block's last row. (Tk > 0: at least one tile.)
  const cg_i64 keys = causal && m0 + BM < Tk ? m0 + BM : Tk;
  const int n_tiles = (int)((keys + BN - 1) / BN);
  const int thread = threadIdx.x;
  if (thread < 128) {
    cg_setmaxnreg_dec<Config::PRODUCER_REGISTERS>();
    if (thread == 0) cg_flash_sm90_produce(l, map_q, map_k, map_v, m0, head, kv_head, 0, n_tiles);
    return;
  }
  cg_setmaxnreg_inc<Config::CONSUMER_REGISTERS>();
  const int consumer = thread / 128 - 1;  // rows [64 consumer, 64 consumer + 64) of the block's
  const int warp = thread % 128 / 32, lane = thread % 32, quad = lane % 4;
  const cg_i64 warp_row0 = m0 + 64 * consumer + 16 * warp;
  const cg_i64 row0 = warp_row0 + lane / 4;  // this thread's rows: row0 and row0 + 8
  cg_flash_sm90_rows<Config> rows;
  cg_flash_sm90_consume<Config, T>(l, rows, l.base + (unsigned int)(consumer * 64 * 128), Tk, warp_row0, row0, 0,
                                   n_tiles, scale_log2, causal);
  // o / l; the log-sum-exp.
  float inverse[2];
  CG_UNROLL
  for (int r = 0; r < 2; ++r) {
    inverse[r] = rows.row_sum[r] > 0.0f ? 1.0f / rows.row_sum[r] : 0.0f;
    const cg_i64 row = row0 + 8 * r;
    if (quad == 0 && row < Tq) store_lse(row, (rows.row_max[r] + log2f(rows.row_sum[r])) * 0.6931471805599453f);
  }
  cg_flash_sm90_store_rows<Config::OUT_ROW, Config::DV, Config::HEAD_DV>(
      rows.o, inverse, l.staged() + (consumer * 4 + warp) * 16 * Config::OUT_ROW, warp_row0, Tq, store_out);
#endif
}

// Split-KV on the Hopper path (decoding: few query rows over many keys, too
// few blocks to fill the GPU): cg_flash_attention_sm90 over key tiles
// [split tiles_per_split, + tiles_per_split) of the row tile's (none where
// causal ends them sooner). Each consumer warp writes its 16 rows' partial
// state to `partials` (this row tile's, per split: o's BLOCK_M x DV floats,
// then each row's maximum and sum, BLOCK_M x 2, as cg_flash_attention_split
// lays them out; rows past Tq neither stored nor combined) and counts itself
// in at `arrivals[w]` (w its index among the block's 8 consumer warps; zero
// before the launch, left zero). The warp that arrives last for those rows
// combines the splits, each row's in split order (deterministic):
//   m = max_s m_s, l = sum_s l_s 2^(m_s - m), o = sum_s o_s 2^(m_s - m) / l,
// and stores as cg_flash_attention_sm90 does. Warps count in apart: no
// block barrier (the producer has returned). splits <= 32.
template <typename Config, typename T, typename StoreOut, typename StoreLse>
CG_DEVICE void cg_flash_attention_split_sm90(const cg_tensor_map* map_q, const cg_tensor_map* map_k,
                                             const cg_tensor_map* map_v, cg_i64 Tq, cg_i64 Tk, cg_i64 tile_m,
                                             int head, int kv_head, int split, int splits, cg_i64 tiles_per_split,
                                             float* partials, unsigned int* arrivals, float scale_log2, bool causal,
                                             StoreOut store_out, StoreLse store_lse, unsigned char* smem) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("trap;");  // no wgmma on this target: the generator never launches this kernel here
#else
  constexpr int BM = Config::BLOCK_M, BN = Config::BLOCK_N, DV = Config::DV, SPLIT = BM * (DV + 2);
  const cg_flash_sm90_layout<Config> l = cg_flash_sm90_setup<Config>(smem);
  const cg_i64 m0 = tile_m * BM;
  const cg_i64 keys = causal && m0 + BM < Tk ? m0 + BM : Tk;
  const cg_i64 n_tiles = (keys + BN - 1) / BN;
  const cg_i64 begin_tile = (cg_i64)split * tiles_per_split, end_tile = begin_tile + tiles_per_split;
  const int first = (int)(begin_tile < n_tiles ? begin_tile : n_tiles), end = (int)(end_tile < n_tiles ? end_tile : n_tiles);
  const int thread = threadIdx.x;
  if (thread < 128) {
    cg_setmaxnreg_dec<Config::PRODUCER_REGISTERS>();
    if (thread == 0 && first < end) cg_flash_sm90_produce(l, map_q, map_k, map_v, m0, head, kv_head, first, end);
    return;
  }
  cg_setmaxnreg_inc<Config::CONSUMER_REGISTERS>();
  const int consumer = thread / 128 - 1, warp = thread % 128 / 32, lane = thread % 32, g = lane / 4;
  const int local0 = 64 * consumer + 16 * warp;  // the warp's first row of the block's
  const cg_i64 warp_row0 = m0 + local0;
  cg_flash_sm90_rows<Config> rows;
  if (first < end) {
    cg_flash_sm90_consume<Config, T>(l, rows, l.base + (unsigned int)(consumer * 64 * 128), Tk, warp_row0,
                                     warp_row0 + g, first, end, scale_log2, causal);
  } else {  // no key of this split's: an empty state (its weight is 0)
    cg_zero_accumulators(rows.o);
    rows.row_max[0] = rows.row_max[1] = cg_neg_inf();
    rows.row_sum[0] = rows.row_sum[1] = 0.0f;
  }
  // A warp whose rows all lie past Tq has nothing to combine (its counter
  // is its rows' alone): decoding's one query row stores one row a split.
  if (warp_row0 >= Tq) return;
  // This split's state of the warp's rows before Tq (part 1's workspace layout).
  cg_flash_store_partial_rows<BM, DV>(partials + (cg_i64)split * SPLIT, rows.o, rows.row_max, rows.row_sum, local0,
                                      Tq - warp_row0);
  if (!cg_warp_last_to_arrive(arrivals + consumer * 4 + warp, (unsigned int)splits)) return;
  // Each row: lane s weighs split s (2^(m_s - m) / l), the lanes' columns sum the splits in order.
  for (int r = 0; r < 16; ++r) {
    const cg_i64 row = warp_row0 + r;
    if (row >= Tq) break;
    const cg_i64 state = (cg_i64)BM * DV + 2 * (local0 + r);
    const float m_s = lane < splits ? cg_load_l2(partials, (cg_i64)lane * SPLIT + state) : cg_neg_inf();
    float m = m_s;
    CG_UNROLL
    for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    const float base = m == cg_neg_inf() ? 0.0f : m;
    float weight = lane < splits ? exp2f(m_s - base) : 0.0f;
    float l_sum = lane < splits ? cg_load_l2(partials, (cg_i64)lane * SPLIT + state + 1) * weight : 0.0f;
    CG_UNROLL
    for (int offset = 16; offset > 0; offset /= 2) l_sum += __shfl_xor_sync(0xffffffffu, l_sum, offset);
    weight *= l_sum > 0.0f ? 1.0f / l_sum : 0.0f;
    if (lane == 0) store_lse(row, (base + log2f(l_sum)) * 0.6931471805599453f);
    CG_UNROLL
    for (int j = 0; j < DV / 32; ++j) {
      const int c = 32 * j + lane;
      float sum = 0.0f;
      for (int s = 0; s < splits; ++s) {
        const float w = __shfl_sync(0xffffffffu, weight, s);
        if (c < Config::HEAD_DV) sum += w * cg_load_l2(partials, (cg_i64)s * SPLIT + (cg_i64)(local0 + r) * DV + c);
      }
      if (c < Config::HEAD_DV) store_out(row, c, sum);
    }
  }
#endif
}

// ---------------------------------------------------------------------------
// Flash attention, backward, on the Hopper path (sm_90a; docs/attention.md):
// the gradients of cg_flash_attention_backward (templates/softmax_flash.cuh;
// the same formulas, the same rows' statistics from cg_flash_backward_rows,
// the same unscaled stores and the same two kinds of block, so that no sum
// needs an atomic and every run adds in the same order), on wgmma and TMA:
//   - a block per 128 keys (dk, dv; over heads of 128 two, each half of
//     their columns) or per 128 query rows (dq) of one head: warpgroup 0
//     the producer, warpgroups 1 and 2 the consumers, 64 of the block's own
//     rows each, their gradients summed in registers;
//   - the block's own rows of two tensors (k and v, or q and dO) by TMA
//     once; the streamed ones (q and dO, or k and v) 64 rows a step (32
//     over heads of 128), STAGES
//     steps in flight, each tensor on its own "full" mbarrier and the stage
//     released ("empty") by every consumer thread once the products that
//     read it have completed; all through 3-D maps (head size x length x
//     heads, boxes of 64 x a step's rows, the 128-byte swizzle), so that
//     rows past a head's length arrive as zeros;
//   - a key block's step, for its 64 query rows (32 over heads of 128):
//       s^T = k q^T and dp^T = v dO^T (wgmma m64n64k16 or m64n32k16,
//       operands in shared memory; the second runs while the first's
//       probabilities are made),
//       p^T = exp2(s^T scale_log2 - lse), dv += p^T dO (p^T in registers as
//       the A operand, dO N-major), ds^T = p^T (dp_scale dp^T - delta),
//       dk += ds^T q (the same, q N-major);
//     the step's rows' statistics (lse, delta) come to shared memory from
//     the producer's second warp;
//   - a query block's step, for its 64 keys (32): s = q k^T and dp = dO v^T,
//     p = exp2(s scale_log2 - lse), ds = p (dp_scale dp - delta), dq += ds k.
// 16-bit q, k, v and dO: q and k of one head size (HEAD_D, in a tile D of
// 64, 128 or 256), v and dO of another (HEAD_DV in DV).
// Not yet: dq summed by the key blocks with atomics (the query blocks'
// second pass over s and dp is the price of determinism).

// The backward kernel's compile-time shape: as cg_flash_sm90_config's, 128
// own rows a block and 64 streamed rows a step (32 over heads of 128). Of each block's two own
// tensors and of each step's two streamed ones, the first ("a": k or q) is
// D wide, the second ("b": v or dO) DV wide.
template <int D_, int STAGES_, int HEAD_D_ = D_, int DV_ = D_, int HEAD_DV_ = (DV_ == D_ ? HEAD_D_ : DV_)>
struct cg_flash_backward_sm90_config {
  static constexpr int D = D_, STAGES = STAGES_, HEAD_D = HEAD_D_, DV = DV_, HEAD_DV = HEAD_DV_;
  static_assert((D == 64 || D == 128 || D == 256) && (DV == 64 || DV == 128 || DV == 256),
                "tiles of 64, 128 or 256 head values");
  static_assert(HEAD_D <= D && HEAD_D % 8 == 0 && HEAD_DV <= DV && HEAD_DV % 8 == 0,
                "heads of whole 16-byte chunks, no wider than their tiles");
  static_assert(STAGES >= 2, "a step's rows are copied while the step before is read");
  // Over heads of 128 (WIDE): dk and dv whole would take 256 registers a
  // thread, so each tile of keys takes KEY_SPLIT = 2 blocks, each summing
  // half of dk's and dv's columns (both recompute s^T and dp^T, as part 1's
  // KEY_SPLIT does), and a step streams 32 rows, so that the own tiles (128
  // KiB at heads of 256) and two stages fit shared memory.
  static constexpr bool WIDE = D > 128 || DV > 128;
  static_assert(!WIDE || (D >= 128 && DV >= 128), "over heads of 128 both tiles of at least 128: halves of whole boxes");
  static constexpr int KEY_SPLIT = WIDE ? 2 : 1;
  static constexpr int BLOCK_M = 128, BLOCK_N = WIDE ? 32 : 64, CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1);
  // Boxes of 64 columns (one 128-byte swizzle row) by BLOCK_N rows: an own
  // tile is BLOCK_M / BLOCK_N boxes high, a column chunk of 128 rows after
  // another.
  static constexpr int BOX_BYTES = BLOCK_N * 128;
  static constexpr int OWN_CHUNK_BYTES = BLOCK_M * 128, STREAM_CHUNK_BYTES = BLOCK_N * 128;
  static constexpr int OWN_A_BYTES = (D / 64) * OWN_CHUNK_BYTES, OWN_B_BYTES = (DV / 64) * OWN_CHUNK_BYTES;
  static constexpr int STREAM_A_BYTES = (D / 64) * STREAM_CHUNK_BYTES, STREAM_B_BYTES = (DV / 64) * STREAM_CHUNK_BYTES;
  static constexpr int STAGE_BYTES = STREAM_A_BYTES + STREAM_B_BYTES;  // q then dO, or k then v
  static constexpr int STATS_BYTES = 8 * BLOCK_N;                       // a stage's rows' (lse, delta)
  // Each consumer warp's 16 output rows, 64 columns at a time (32 over
  // heads of 128, whose own tiles leave no room for more; 8 more floats a
  // row: cg_flash_sm90_store_rows).
  static constexpr int OUT_ROW = WIDE ? 40 : 72, OUT_BYTES = CONSUMERS * 4 * 16 * OUT_ROW * 4;
  // The own tiles' barrier, then each stage's two tensors', statistics' and release barriers.
  static constexpr int BARRIER_BYTES = 8 * (1 + 4 * STAGES);
  static constexpr int SHARED_BYTES =
      1024 + OWN_A_BYTES + OWN_B_BYTES + STAGES * (STAGE_BYTES + STATS_BYTES) + OUT_BYTES + BARRIER_BYTES;
  static constexpr int PRODUCER_REGISTERS = 24, CONSUMER_REGISTERS = 240;
};

// Where the backward kernel's pieces lie in shared memory (from a 1024-byte
// boundary of the .shared window, as the swizzle needs), and its barriers.
template <typename Config>
struct cg_flash_backward_sm90_layout {
  unsigned int base;  // shared address of the own tiles; the stages follow
  unsigned char* tiles;
  float* stats;   // STAGES x BLOCK_N (lse, delta) pairs
  float* staged;  // each consumer warp's 16 output rows
  unsigned long long *own_full, *a_full, *b_full, *stats_full, *empty;
  CG_DEVICE unsigned int own_a() const { return base; }
  CG_DEVICE unsigned int own_b() const { return base + Config::OWN_A_BYTES; }
  CG_DEVICE unsigned int stream_a(int stage) const {
    return base + Config::OWN_A_BYTES + Config::OWN_B_BYTES + (unsigned int)(stage * Config::STAGE_BYTES);
  }
  CG_DEVICE unsigned int stream_b(int stage) const { return stream_a(stage) + Config::STREAM_A_BYTES; }
};

template <typename Config>
CG_DEVICE cg_flash_backward_sm90_layout<Config> cg_flash_backward_sm90_setup(unsigned char* smem) {
  constexpr int S = Config::STAGES;
  cg_flash_backward_sm90_layout<Config> l;
  l.base = (cg_smem_address(smem) + 1023u) & ~1023u;
  l.tiles = cg_smem_pointer(l.base);
  l.stats = (float*)(l.tiles + Config::OWN_A_BYTES + Config::OWN_B_BYTES + S * Config::STAGE_BYTES);
  l.staged = (float*)((unsigned char*)l.stats + S * Config::STATS_BYTES);
  l.own_full = (unsigned long long*)((unsigned char*)l.staged + Config::OUT_BYTES);
  l.a_full = l.own_full + 1;
  l.b_full = l.a_full + S;
  l.stats_full = l.b_full + S;
  l.empty = l.stats_full + S;
  if (threadIdx.x == 0) {
    cg_mbarrier_init(l.own_full, 1);
    for (int s = 0; s < S; ++s) {
      cg_mbarrier_init(&l.a_full[s], 1);  // the producer's arrival, with the tile's bytes
      cg_mbarrier_init(&l.b_full[s], 1);
      cg_mbarrier_init(&l.stats_full[s], 32);  // the producer's second warp (key blocks)
      cg_mbarrier_init(&l.empty[s], 128 * Config::CONSUMERS);  // every consumer thread, once it has read the stage
    }
    cg_fence_barrier_init();
  }
  __syncthreads();
  return l;
}

// The producer warpgroup of either kind of block: its first thread copies
// the own rows [own0, own0 + 128) of plane own_plane of maps own_a and
// own_b once, then the streamed rows of plane stream_plane of maps stream_a
// and stream_b, steps [first, end) of BLOCK_N rows; where `stats_rows` (a key
// block), the second warp copies each step's rows' statistics.
template <typename Config>
CG_DEVICE void cg_flash_backward_sm90_produce(const cg_flash_backward_sm90_layout<Config>& l, const cg_tensor_map* own_a,
                                              const cg_tensor_map* own_b, int own0, int own_plane,
                                              const cg_tensor_map* stream_a, const cg_tensor_map* stream_b,
                                              int stream_plane, int first, int end, const float* stats_rows) {
  constexpr int S = Config::STAGES, D = Config::D, DV = Config::DV, BN = Config::BLOCK_N;
  const int thread = threadIdx.x;
  if (thread == 0) {
    cg_mbarrier_arrive_expect_tx(l.own_full, Config::OWN_A_BYTES + Config::OWN_B_BYTES);
    constexpr int HIGH = Config::BLOCK_M / BN;  // an own tile's boxes, one above another
    CG_UNROLL
    for (int c = 0; c < D / 64; ++c)
      CG_UNROLL
      for (int h = 0; h < HIGH; ++h)
        cg_tma_load_3d(cg_smem_pointer(l.own_a() + (unsigned int)(c * Config::OWN_CHUNK_BYTES + h * Config::BOX_BYTES)),
                       own_a, 64 * c, own0 + BN * h, own_plane, l.own_full);
    CG_UNROLL
    for (int c = 0; c < DV / 64; ++c)
      CG_UNROLL
      for (int h = 0; h < HIGH; ++h)
        cg_tma_load_3d(cg_smem_pointer(l.own_b() + (unsigned int)(c * Config::OWN_CHUNK_BYTES + h * Config::BOX_BYTES)),
                       own_b, 64 * c, own0 + BN * h, own_plane, l.own_full);
    cg_sm90_pipeline_state load = {0, 0u};
    for (int n = first; n < end; ++n, load.advance(S)) {
      // Round r of a stage waits for the release of round r - 1 (the first
      // round's wait returns at once: parity 1 of phase 0).
      cg_mbarrier_wait(&l.empty[load.stage], load.phase ^ 1u);
      cg_mbarrier_arrive_expect_tx(&l.a_full[load.stage], Config::STREAM_A_BYTES);
      CG_UNROLL
      for (int c = 0; c < D / 64; ++c)
        cg_tma_load_3d(cg_smem_pointer(l.stream_a(load.stage) + c * Config::STREAM_CHUNK_BYTES), stream_a, 64 * c,
                       n * BN, stream_plane, &l.a_full[load.stage]);
      cg_mbarrier_arrive_expect_tx(&l.b_full[load.stage], Config::STREAM_B_BYTES);
      CG_UNROLL
      for (int c = 0; c < DV / 64; ++c)
        cg_tma_load_3d(cg_smem_pointer(l.stream_b(load.stage) + c * Config::STREAM_CHUNK_BYTES), stream_b, 64 * c,
                       n * BN, stream_plane, &l.b_full[load.stage]);
    }
  } else if (stats_rows != nullptr && thread / 32 == 1) {
    // A step's BN pairs of floats, 16 bytes a lane (8 at 32 rows a step;
    // the rows array covers whole steps).
    constexpr int PER_LANE = 2 * BN / 32;
    static_assert(PER_LANE == 2 || PER_LANE == 4, "a step's statistics are a warp's 8- or 16-byte loads");
    const int lane = thread % 32;
    cg_sm90_pipeline_state load = {0, 0u};
    for (int n = first; n < end; ++n, load.advance(S)) {
      cg_mbarrier_wait(&l.empty[load.stage], load.phase ^ 1u);
      const cg_vector<PER_LANE, float> pairs =
          cg_load_vector<PER_LANE>(stats_rows, 2 * (cg_i64)n * BN + PER_LANE * lane);
      float* at = l.stats + load.stage * 2 * BN + PER_LANE * lane;
#ifdef CUDAGEN_EMULATION
      cudagen_emu::note_shared_request(at, 4 * PER_LANE);
#endif
      cg_aligned_chunk<PER_LANE, float> chunk;
      CG_UNROLL
      for (int i = 0; i < PER_LANE; ++i) chunk.v[i] = pairs.v[i];
      *reinterpret_cast<cg_aligned_chunk<PER_LANE, float>*>(at) = chunk;
      cg_mbarrier_arrive(&l.stats_full[load.stage]);  // (release: the stores are seen by the waiting consumers)
    }
  }
}

// The key block of keys [128 tile_n, +128) of head `head` (its keys and
// values those of kv_head): dk and dv of its keys, unscaled, to
// store_dk(key, c, value) and store_dv(key, c, value); over heads of 128
// share `part` of KEY_SPLIT of their columns. Causal: query rows before the
// block's first key see none of its keys and are not visited.
template <typename Config, typename T, typename StoreDk, typename StoreDv>
CG_DEVICE void cg_flash_backward_keys_sm90(const cg_flash_backward_sm90_layout<Config>& l, const float* stats_rows,
                                           cg_i64 Tq, cg_i64 Tk, cg_i64 tile_n, int part, float scale_log2,
                                           float dp_scale, bool causal, StoreDk store_dk, StoreDv store_dv) {
  constexpr int S = Config::STAGES, D = Config::D, DV = Config::DV, BM = Config::BLOCK_M, BN = Config::BLOCK_N;
  constexpr int PD = D / Config::KEY_SPLIT, PV = DV / Config::KEY_SPLIT;  // the block's columns of dk and dv
  constexpr int NQ = BN / 8;  // n8 column groups of a step's query rows
  const int thread = threadIdx.x, consumer = thread / 128 - 1;
  const int t = thread % 128, warp = t / 32, lane = t % 32, g = lane / 4, quad = lane % 4;
  const cg_i64 key0 = tile_n * BM;
  const cg_i64 warp_key0 = key0 + 64 * consumer + 16 * warp;  // this thread's keys: + g and + g + 8
  const int first = causal ? (int)(key0 / BN) : 0, end = (int)((Tq + BN - 1) / BN);
  const unsigned int k_rows = l.own_a() + (unsigned int)(consumer * 64 * 128);
  const unsigned int v_rows = l.own_b() + (unsigned int)(consumer * 64 * 128);
  float dk[PD / 8][4], dv[PV / 8][4];
  cg_zero_accumulators(dk);
  cg_zero_accumulators(dv);
  cg_mbarrier_wait(l.own_full, 0);
  cg_sm90_pipeline_state read = {0, 0u};
  for (int m = first; m < end; ++m, read.advance(S)) {
    const unsigned int q_tile = l.stream_a(read.stage), dout_tile = l.stream_b(read.stage);
    // s^T = k q^T, then dp^T = v dO^T: a k step of 16 is 32 bytes along a
    // 128-byte row, the next 64 head values the next column chunk.
    float st[NQ][4], dpt[NQ][4];
    cg_mbarrier_wait(&l.a_full[read.stage], read.phase);
    cg_wgmma_fence();
    cg_flash_sm90_product<BN, D, T>(&st[0][0], k_rows, Config::OWN_CHUNK_BYTES, q_tile, Config::STREAM_CHUNK_BYTES);
    cg_wgmma_commit();
    cg_mbarrier_wait(&l.b_full[read.stage], read.phase);
    cg_wgmma_fence();  // (the last step's dp^T registers were read since)
    cg_flash_sm90_product<BN, DV, T>(&dpt[0][0], v_rows, Config::OWN_CHUNK_BYTES, dout_tile, Config::STREAM_CHUNK_BYTES);
    cg_wgmma_commit();
    cg_wgmma_wait<1>();  // s^T; dp^T may still run
    cg_wgmma_fence_operands<BN / 2>(&st[0][0]);

    // p^T: query column 8 j + 2 quad + e of the step, key row g + 8 r of the
    // warp's. Zero past Tq (lse +inf there) and, causal, where the key is
    // past the query row (tiles the warp's diagonal crosses). Keys past Tk
    // are zeros (TMA) and their rows of dk and dv are never stored.
    cg_mbarrier_wait(&l.stats_full[read.stage], read.phase);
    const float* step_stats = l.stats + read.stage * 2 * BN;
    const cg_i64 query0 = (cg_i64)m * BN;
    const bool edge = causal && warp_key0 + 15 > query0;
    const int past = (int)cg_clamp_i64(warp_key0 + g - query0, -2 * BN, 2 * BN);  // (32 bits, clamped to a step)
    CG_UNROLL
    for (int j = 0; j < NQ; ++j) {
      const float* at = step_stats + 2 * (8 * j + 2 * quad);  // (lse, delta) of two query rows
#ifdef CUDAGEN_EMULATION
      cudagen_emu::note_shared_request(at, 16);
#endif
      const cg_aligned_chunk<4, float> pairs = *reinterpret_cast<const cg_aligned_chunk<4, float>*>(at);
      CG_UNROLL
      for (int e = 0; e < 4; ++e) {
        float p = cg_exp2_approx(st[j][e] * scale_log2 - pairs.v[2 * (e & 1)]);
        if (edge && past + 8 * (e >> 1) > 8 * j + 2 * quad + (e & 1)) p = 0.0f;
        st[j][e] = p;
      }
    }
    // ds^T = p^T (dp_scale dp^T - delta), delta read again from shared
    // memory (16 registers fewer held), once dp^T has completed.
    cg_wgmma_wait<0>();
    cg_wgmma_fence_operands<BN / 2>(&dpt[0][0]);
    CG_UNROLL
    for (int j = 0; j < NQ; ++j) {
      const float* at = step_stats + 2 * (8 * j + 2 * quad);
#ifdef CUDAGEN_EMULATION
      cudagen_emu::note_shared_request(at, 16);
#endif
      const cg_aligned_chunk<4, float> pairs = *reinterpret_cast<const cg_aligned_chunk<4, float>*>(at);
      CG_UNROLL
      for (int e = 0; e < 4; ++e) dpt[j][e] = st[j][e] * (dp_scale * dpt[j][e] - pairs.v[2 * (e & 1) + 1]);
    }
    // dv += p^T dO and dk += ds^T q (K: the step's query rows), p^T and
    // ds^T in registers as the A operands, rounded to T; dO's and q's tiles
    // N-major (the next 8 rows 1024 bytes on, the next 64 head values a
    // column chunk on), from the block's share of their columns.
    unsigned int pa[BN / 16][4], dsa[BN / 16][4];
    CG_UNROLL
    for (int kk = 0; kk < BN / 16; ++kk) {
      cg_flash_p_fragment(pa[kk], st, kk, T());
      cg_flash_p_fragment(dsa[kk], dpt, kk, T());
    }
    cg_wgmma_fence();
    cg_flash_sm90_product_rs<PV, BN, T>(&dv[0][0], pa, dout_tile + (unsigned int)(part * (PV / 64) * Config::STREAM_CHUNK_BYTES),
                                        Config::STREAM_CHUNK_BYTES);
    cg_flash_sm90_product_rs<PD, BN, T>(&dk[0][0], dsa, q_tile + (unsigned int)(part * (PD / 64) * Config::STREAM_CHUNK_BYTES),
                                        Config::STREAM_CHUNK_BYTES);
    cg_wgmma_commit();
    cg_wgmma_wait<0>();
    cg_wgmma_fence_operands<PV / 2>(&dv[0][0]);
    cg_wgmma_fence_operands<PD / 2>(&dk[0][0]);
    cg_mbarrier_arrive(&l.empty[read.stage]);  // the step's tiles and statistics are read
  }
  const float one[2] = {1.0f, 1.0f};
  float* rows = l.staged + (consumer * 4 + warp) * 16 * Config::OUT_ROW;
  cg_flash_sm90_store_rows<Config::OUT_ROW, PV, Config::HEAD_DV>(dv, one, rows, warp_key0, Tk, store_dv, part * PV);
  cg_flash_sm90_store_rows<Config::OUT_ROW, PD, Config::HEAD_D>(dk, one, rows, warp_key0, Tk, store_dk, part * PD);
}

// The query block of rows [128 tile_m, +128) of head `head`: dq of its
// rows, unscaled, to store_dq(row, c, value). Causal: no key past the
// block's last row.
template <typename Config, typename T, typename StoreDq>
CG_DEVICE void cg_flash_backward_queries_sm90(const cg_flash_backward_sm90_layout<Config>& l, const float* stats_rows,
                                              cg_i64 Tq, cg_i64 Tk, cg_i64 tile_m, float scale_log2, float dp_scale,
                                              bool causal, StoreDq store_dq) {
  constexpr int S = Config::STAGES, D = Config::D, DV = Config::DV, BM = Config::BLOCK_M, BN = Config::BLOCK_N;
  constexpr int NK = BN / 8, OT = D / 8;  // n8 column groups: of a step's keys, of dq's
  const int thread = threadIdx.x, consumer = thread / 128 - 1;
  const int t = thread % 128, warp = t / 32, lane = t % 32, g = lane / 4;
  const cg_i64 m0 = tile_m * BM;
  const cg_i64 warp_row0 = m0 + 64 * consumer + 16 * warp, row0 = warp_row0 + g;  // rows row0 and row0 + 8
  const unsigned int q_rows = l.own_a() + (unsigned int)(consumer * 64 * 128);
  const unsigned int dout_rows = l.own_b() + (unsigned int)(consumer * 64 * 128);
  const cg_i64 keys = causal && m0 + BM < Tk ? m0 + BM : Tk;
  const int n_tiles = (int)((keys + BN - 1) / BN);
  // The rows' statistics (lse +inf past Tq: their p are 0).
  float lse[2], delta[2];
  CG_UNROLL
  for (int r = 0; r < 2; ++r) {
    const bool in = row0 + 8 * r < Tq;
    lse[r] = in ? stats_rows[2 * (row0 + 8 * r)] : -cg_neg_inf();
    delta[r] = in ? stats_rows[2 * (row0 + 8 * r) + 1] : 0.0f;
  }
  float dq[OT][4];
  cg_zero_accumulators(dq);
  cg_mbarrier_wait(l.own_full, 0);
  cg_sm90_pipeline_state read = {0, 0u};
  for (int n = 0; n < n_tiles; ++n, read.advance(S)) {
    const unsigned int k_tile = l.stream_a(read.stage), v_tile = l.stream_b(read.stage);
    // s = q k^T, then dp = dO v^T.
    float s[NK][4], dp[NK][4];
    cg_mbarrier_wait(&l.a_full[read.stage], read.phase);
    cg_wgmma_fence();
    cg_flash_sm90_product<BN, D, T>(&s[0][0], q_rows, Config::OWN_CHUNK_BYTES, k_tile, Config::STREAM_CHUNK_BYTES);
    cg_wgmma_commit();
    cg_mbarrier_wait(&l.b_full[read.stage], read.phase);
    cg_wgmma_fence();  // (the last step's dp registers were read since)
    cg_flash_sm90_product<BN, DV, T>(&dp[0][0], dout_rows, Config::OWN_CHUNK_BYTES, v_tile, Config::STREAM_CHUNK_BYTES);
    cg_wgmma_commit();
    cg_wgmma_wait<1>();  // s; dp may still run
    cg_wgmma_fence_operands<BN / 2>(&s[0][0]);
    // p, masked (-inf) past Tk and, causal, past each row's own key.
    cg_flash_scores_to_log2(s, scale_log2, (cg_i64)n * BN, Tk, warp_row0, row0, causal);
    CG_UNROLL
    for (int j = 0; j < NK; ++j)
      CG_UNROLL
      for (int e = 0; e < 4; ++e) s[j][e] = cg_exp2_approx(s[j][e] - lse[e >> 1]);
    cg_wgmma_wait<0>();
    cg_wgmma_fence_operands<BN / 2>(&dp[0][0]);
    // ds = p (dp_scale dp - delta), then dq += ds k (k's tile N-major).
    CG_UNROLL
    for (int j = 0; j < NK; ++j)
      CG_UNROLL
      for (int e = 0; e < 4; ++e) dp[j][e] = s[j][e] * (dp_scale * dp[j][e] - delta[e >> 1]);
    unsigned int dsa[BN / 16][4];
    CG_UNROLL
    for (int kk = 0; kk < BN / 16; ++kk) cg_flash_p_fragment(dsa[kk], dp, kk, T());
    cg_wgmma_fence();
    cg_flash_sm90_product_rs<D, BN, T>(&dq[0][0], dsa, k_tile, Config::STREAM_CHUNK_BYTES);
    cg_wgmma_commit();
    cg_wgmma_wait<0>();
    cg_wgmma_fence_operands<D / 2>(&dq[0][0]);
    cg_mbarrier_arrive(&l.empty[read.stage]);  // the step's tiles are read
  }
  const float one[2] = {1.0f, 1.0f};
  cg_flash_sm90_store_rows<Config::OUT_ROW, D, Config::HEAD_D>(
      dq, one, l.staged + (consumer * 4 + warp) * 16 * Config::OUT_ROW, warp_row0, Tq, store_dq);
}

// The backward pass of one head on the Hopper path: blocks [0, key_blocks)
// take 128 keys each (dk, dv; none where nothing reads them; over heads of
// 128 KEY_SPLIT blocks a tile of keys, each a share of the columns), the next ones
// 128 query rows each (dq; causal, the last rows first: they visit the most
// keys); `tile` is the block's index among them. The maps (cg_tensor_map,
// 3-D, 16-bit T, the 128-byte swizzle, boxes of 64 x BLOCK_N): q's and dO's Tq
// high with a plane a head of q, k's and v's Tk high with a plane a head of
// keys (kv_head: grouped-query attention). stats the head's rows' statistics
// (cg_flash_backward_rows), scale_log2 and causal as the forward took them,
// dp = dp_scale dO v^T; the gradients go unscaled to their stores, as
// cg_flash_attention_backward's. `smem`: SHARED_BYTES.
template <typename Config, typename T, typename StoreDq, typename StoreDk, typename StoreDv>
CG_DEVICE void cg_flash_attention_backward_sm90(const cg_tensor_map* map_q, const cg_tensor_map* map_k,
                                                const cg_tensor_map* map_v, const cg_tensor_map* map_dout,
                                                const float* stats, cg_i64 Tq, cg_i64 Tk, cg_i64 tile,
                                                cg_i64 key_blocks, int head, int kv_head, float scale_log2,
                                                float dp_scale, bool causal, StoreDq store_dq, StoreDk store_dk,
                                                StoreDv store_dv, unsigned char* smem) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("trap;");  // no wgmma on this target: the generator never launches this kernel here
#else
  constexpr int BM = Config::BLOCK_M, BN = Config::BLOCK_N;
  const bool key_block = tile < key_blocks;
  const cg_flash_backward_sm90_layout<Config> l = cg_flash_backward_sm90_setup<Config>(smem);
  const cg_i64 query_tiles = (Tq + BM - 1) / BM;
  // (Over heads of 128 a tile of keys takes KEY_SPLIT blocks, one after another.)
  const cg_i64 own_tile = key_block ? tile / Config::KEY_SPLIT
                          : causal  ? query_tiles - 1 - (tile - key_blocks)
                                    : tile - key_blocks;
  if (threadIdx.x < 128) {
    cg_setmaxnreg_dec<Config::PRODUCER_REGISTERS>();
    if (key_block) {
      const int first = causal ? (int)(own_tile * BM / BN) : 0, end = (int)((Tq + BN - 1) / BN);
      cg_flash_backward_sm90_produce(l, map_k, map_v, (int)(own_tile * BM), kv_head, map_q, map_dout, head, first, end,
                                     stats);
    } else {
      const cg_i64 m0 = own_tile * BM, keys = causal && m0 + BM < Tk ? m0 + BM : Tk;
      cg_flash_backward_sm90_produce(l, map_q, map_dout, (int)m0, head, map_k, map_v, kv_head, 0,
                                     (int)((keys + BN - 1) / BN), (const float*)nullptr);
    }
    return;
  }
  cg_setmaxnreg_inc<Config::CONSUMER_REGISTERS>();
  if (key_block)
    cg_flash_backward_keys_sm90<Config, T>(l, stats, Tq, Tk, own_tile, (int)(tile % Config::KEY_SPLIT), scale_log2,
                                           dp_scale, causal, store_dk, store_dv);
  else
    cg_flash_backward_queries_sm90<Config, T>(l, stats, Tq, Tk, own_tile, scale_log2, dp_scale, causal, store_dq);
#endif
}
