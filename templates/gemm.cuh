// The pipelined tensor-core GEMM mainloop for 16-bit operands (f16, bf16),
// and for f32 ones as TF32 where the user allows it (--allow-tf32), with f32
// accumulation, for sm_80 and later (docs/gemm.md). A block computes one
// BM x BN tile of D = op(A) op(B):
//   - global -> shared by 16-byte cp.async, STAGES k-tiles in flight, one
//     barrier per k-tile;
//   - shared tiles XOR-swizzled in 16-byte chunks, so that the copies and the
//     ldmatrix reads are free of bank conflicts without padding;
//   - fragments by ldmatrix (.trans where an operand's contiguous axis is M or
//     N rather than K; for TF32, whose 32-bit elements .trans cannot move,
//     such an operand is read by 32-bit shared loads), mma.sync m16n8k16
//     (m16n8k8 for TF32) into registers;
//   - WARPS_M x WARPS_N warps, each owning a (BM / WARPS_M) x (BN / WARPS_N)
//     patch of the accumulators.
// Operand layouts (cg_gemm_mainloop's A_K_CONTIGUOUS, B_K_CONTIGUOUS): A is
// M x K, stored K-contiguous (row-major, lda >= K) or M-contiguous (A^T stored
// row-major, lda >= M); B is K x N, stored K-contiguous (B^T row-major, ldb
// >= K) or N-contiguous (row-major, ldb >= N). Every contiguous extent and
// leading dimension must be whole 16-byte chunks (8 16-bit elements, 4 f32)
// and each operand's first element 16-byte aligned: the caller checks, the emulator's bounds
// checks catch a copy that runs past its tensor.

// ---------------------------------------------------------------------------
// The PTX wrappers. On the device each is one instruction; in the host
// emulation each has the same operands and the same result layout.

// A shared-memory address as the PTX instructions take it: 32 bits in the
// .shared window on the device (computed once per tile: a generic pointer
// costs each access a conversion), and in the host emulation the
// emulator's (cudagen_emu::shared_address), which cg_smem_pointer turns back.
CG_DEVICE unsigned int cg_smem_address(const void* p) {
#ifdef __CUDA_ARCH__
  unsigned int address;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(p));
  return address;
#elif defined(CUDAGEN_EMULATION)
  return cudagen_emu::shared_address(p);
#else
  (void)p;
  return 0;
#endif
}

// The generic pointer of a shared-memory address (the fallbacks below).
CG_DEVICE unsigned char* cg_smem_pointer(unsigned int address) {
#ifdef __CUDA_ARCH__
  unsigned long long p;
  asm("{ .reg .u64 a; cvt.u64.u32 a, %1; cvta.shared.u64 %0, a; }" : "=l"(p) : "r"(address));
  return (unsigned char*)p;
#elif defined(CUDAGEN_EMULATION)
  return cudagen_emu::shared_pointer(address);
#else
  (void)address;
  return (unsigned char*)0;
#endif
}

// cp.async of 16 bytes to a shared address; fewer than 16 valid source bytes
// (src_bytes = 0 at a tile's edge) fill the rest of the destination with zeros.
CG_DEVICE void cg_cp_async_16_at(unsigned int smem_dst, const void* global_src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(global_src), "r"(src_bytes));
#elif defined(CUDAGEN_EMULATION)
  // Asynchronous and checked: the emulator lands it between here and its wait.
  cudagen_emu::cp_async(cg_smem_pointer(smem_dst), global_src, src_bytes);
#else
  unsigned char* d = cg_smem_pointer(smem_dst);
  const unsigned char* s = (const unsigned char*)global_src;
  for (int i = 0; i < 16; ++i) d[i] = i < src_bytes ? s[i] : 0;
#endif
}

// The same to a generic pointer into shared memory.
CG_DEVICE void cg_cp_async_16(void* smem_dst, const void* global_src, int src_bytes) {
  cg_cp_async_16_at(cg_smem_address(smem_dst), global_src, src_bytes);
}

CG_DEVICE void cg_cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::cp_async_commit();
#endif
}

// Wait until at most N committed groups are still in flight.
template <int N>
CG_DEVICE void cg_cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::cp_async_wait(N);
#endif
}

// ldmatrix.x4 at a shared address: four 8 x 8 matrices of 16-bit elements;
// lane l gives the address of row l % 8 of matrix l / 8, and receives in r[i]
// the elements (row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1) of matrix i,
// or with TRANS of its transpose.
template <bool TRANS>
CG_DEVICE void cg_ldmatrix_x4_at(unsigned int r[4], unsigned int row_address) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row_address));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row_address));
#else
  const int lane = threadIdx.x & 31;
#ifdef CUDAGEN_EMULATION
  cudagen_emu::note_shared_request(cg_smem_pointer(row_address), 16);  // its row of the four matrices, for the bank counters
#endif
  for (int i = 0; i < 4; ++i) {
    unsigned short e[2];
    for (int j = 0; j < 2; ++j) {
      // Element (row, col) of matrix i as stored: col = 2 (lane % 4) + j of row lane / 4,
      // or transposed: row 2 (lane % 4) + j, col lane / 4.
      const int row = TRANS ? 2 * (lane & 3) + j : lane >> 2, col = TRANS ? lane >> 2 : 2 * (lane & 3) + j;
      const unsigned short* p =
          (const unsigned short*)cg_smem_pointer(__shfl_sync(0xffffffffu, row_address, 8 * i + row));
#ifdef CUDAGEN_EMULATION
      if (!cudagen_emu::check_shared_read(p + col, 2)) {
        e[j] = 0;
        continue;
      }
#endif
      e[j] = p[col];
    }
    r[i] = (unsigned int)e[0] | ((unsigned int)e[1] << 16);
  }
#endif
}

// The same at a generic pointer into shared memory.
template <bool TRANS>
CG_DEVICE void cg_ldmatrix_x4(unsigned int r[4], const unsigned short* row_address) {
  cg_ldmatrix_x4_at<TRANS>(r, cg_smem_address(row_address));
}

// mma.sync on packed registers, one k-step of the mainloop for the operand
// type the last parameter names. f16 and bf16: m16n8k16, two 16-bit values
// a register (the lower element in the low half), the layout of
// cg_mma_16x8x16 (prelude), whose element arrays these are. Elsewhere than
// sm_80 and later: the packed registers as element arrays, through the
// prelude's shuffle form of the same layout.
template <typename T>
CG_DEVICE void cg_mma_16x8x16_unpacked(float d[4], const unsigned int a[4], const unsigned int b[2]) {
  T ae[8], be[4];
  for (int i = 0; i < 8; ++i) ae[i].bits = (unsigned short)(a[i / 2] >> (16 * (i % 2)));
  for (int i = 0; i < 4; ++i) be[i].bits = (unsigned short)(b[i / 2] >> (16 * (i % 2)));
  cg_mma_16x8x16_shuffle(d, ae, be);
}

CG_DEVICE void cg_mma_packed(float d[4], const unsigned int a[4], const unsigned int b[2], cg_f16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  cg_mma_16x8x16_unpacked<cg_f16>(d, a, b);
#endif
}

CG_DEVICE void cg_mma_packed(float d[4], const unsigned int a[4], const unsigned int b[2], cg_bf16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  cg_mma_16x8x16_unpacked<cg_bf16>(d, a, b);
#endif
}

// TF32 (--allow-tf32, docs/gemm.md): f32 operands stored as f32, each
// fragment register rounded to TF32 (8 exponent and 10 mantissa bits)
// before the mma, as PyTorch's allow_tf32 computes; the mainloop's element
// type for them, the bits of an f32.
struct cg_tf32 {
  unsigned int bits;
};

// Rounds a fragment register to TF32, to nearest with ties away from zero,
// in one integer add: half a TF32 ulp added to the magnitude, then the
// tensor core, which reads only the upper 19 bits, truncates (the same as
// cvt.rna.tf32.f32, which takes three instructions in SASS: FSETP and two
// more). Infinities stay infinite, a finite value that rounds past the
// largest overflows to infinity as cvt.rna does; only a NaN whose payload
// lies in the low 13 bits alone (never the canonical 0x7fc00000) is read
// as an infinity, or as zero where its sign bit carries. The same code on
// every target: the emulated mma truncates as the tensor core does.
CG_DEVICE unsigned int cg_round_to_tf32(unsigned int bits) { return bits + 0x1000u; }

// mma.sync m16n8k8 with TF32 operands, one 32-bit value a register (g = lane
// / 4, t = lane % 4):
//   a[i] = A[g + 8 * (i % 2)][t + 4 * (i / 2)]   i < 4
//   b[i] = B[t + 4 * i][g]                        i < 2
//   d[i] = D[g + 8 * (i / 2)][2 * t + i % 2]      i < 4 (as m16n8k16's)
// The tensor core reads only a register's TF32 bits; the emulation does the
// same, so a fragment left unrounded is truncated there as on the GPU.
CG_DEVICE void cg_mma_packed(float d[4], const unsigned int a[4], const unsigned int b[2], cg_tf32) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int k = 0; k < 8; ++k) {
    // A[row][k] of both my rows and B[k][col] of both my columns, from the lanes that hold them.
    const int a_lane = g * 4 + (k & 3), a_reg = k >= 4 ? 2 : 0, b_reg = k >= 4 ? 1 : 0;
    const unsigned int top = __shfl_sync(0xffffffffu, a[a_reg], a_lane);
    const unsigned int bottom = __shfl_sync(0xffffffffu, a[a_reg + 1], a_lane);
    const unsigned int left = __shfl_sync(0xffffffffu, b[b_reg], (2 * t) * 4 + (k & 3));
    const unsigned int right = __shfl_sync(0xffffffffu, b[b_reg], (2 * t + 1) * 4 + (k & 3));
    const float a_top = __int_as_float((int)(top & 0xffffe000u)), a_bottom = __int_as_float((int)(bottom & 0xffffe000u));
    const float b_left = __int_as_float((int)(left & 0xffffe000u)), b_right = __int_as_float((int)(right & 0xffffe000u));
    d[0] += a_top * b_left;
    d[1] += a_top * b_right;
    d[2] += a_bottom * b_left;
    d[3] += a_bottom * b_right;
  }
#endif
}

// f32 operands kept exact on CUDA cores: the flash attention kernels'
// element type for f32 without --allow-tf32 (docs/attention.md). Tiles,
// copies and fragments as TF32's (4-byte values, m16n8k8's layout); the
// "mma" is 32 FMAs a lane, each pair of operands fetched from the lanes that
// hold it (4 shuffles a K step, one a FMA: the shuffles, a warp a clock,
// bound it at a quarter of the FMA rate on sm_86 and later, half on sm_80),
// in f32 throughout. The two halves of K run
// as a loop: unrolled, the flash kernels' hundreds of calls took ptxas over
// a minute and more registers.
struct cg_f32_simt {
  unsigned int bits;
};
CG_DEVICE void cg_mma_packed(float d[4], const unsigned int a[4], const unsigned int b[2], cg_f32_simt) {
  const int lane = threadIdx.x & 31, quad = lane & ~3, t = lane & 3;
  CG_NO_UNROLL
  for (int half = 0; half < 2; ++half) {  // K [0, 4), then [4, 8): a[0], a[1], b[0], then a[2], a[3], b[1]
    const unsigned int top = half ? a[2] : a[0], bottom = half ? a[3] : a[1], column = half ? b[1] : b[0];
    CG_UNROLL
    for (int c = 0; c < 4; ++c) {
      // A[row][k] of both my rows (from my quad's lane c) and B[k][col] of both my
      // columns 2t and 2t + 1 (from lane c of quads 2t and 2t + 1).
      const float a_top = __int_as_float((int)__shfl_sync(0xffffffffu, top, quad + c));
      const float a_bottom = __int_as_float((int)__shfl_sync(0xffffffffu, bottom, quad + c));
      const float b_left = __int_as_float((int)__shfl_sync(0xffffffffu, column, 8 * t + c));
      const float b_right = __int_as_float((int)__shfl_sync(0xffffffffu, column, 8 * t + 4 + c));
      d[0] = fmaf(a_top, b_left, d[0]);
      d[1] = fmaf(a_top, b_right, d[1]);
      d[2] = fmaf(a_bottom, b_left, d[2]);
      d[3] = fmaf(a_bottom, b_right, d[3]);
    }
  }
}

// A fragment as the mma takes it: 16-bit values as loaded; f32 ones rounded
// to TF32, or kept exact on CUDA cores.
CG_DEVICE void cg_gemm_fragment_ready(unsigned int[4], cg_f16) {}
CG_DEVICE void cg_gemm_fragment_ready(unsigned int[4], cg_bf16) {}
CG_DEVICE void cg_gemm_fragment_ready(unsigned int r[4], cg_tf32) {
  CG_UNROLL
  for (int i = 0; i < 4; ++i) r[i] = cg_round_to_tf32(r[i]);
}
CG_DEVICE void cg_gemm_fragment_ready(unsigned int[4], cg_f32_simt) {}

// A 32-bit shared-memory load that reads cp.async's destination (a TF32
// fragment of an operand stored MN-contiguous): checked and counted in
// emulation as ldmatrix's reads are.
// (A plain load of a pointer into the shared tile: the compiler folds its
// offsets into LDS's immediates, which an asm ld.shared would not allow.)
CG_DEVICE unsigned int cg_shared_load_b32(const unsigned int* p) {
#ifdef CUDAGEN_EMULATION
  cudagen_emu::note_shared_request(p, 4);
  if (!cudagen_emu::check_shared_read(p, 4)) return 0u;
#endif
  return *p;
}

// A float another block of this launch wrote (split-K's partial sums): read
// from L2 (ld.global.cg), never from this SM's L1, which is not coherent
// with other SMs' stores. Checked like cg_load in emulation.
CG_DEVICE float cg_load_l2(const float* base, cg_i64 i) {
#if defined(__CUDA_ARCH__)
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(base + i));
  return v;
#else
  return cg_load(base, i);
#endif
}

// Shared-memory accesses of 16 bytes (LDS.128, STS.128) or one float (the
// SIMT mainloop's tiles, the staged results), noted in emulation for the
// bank counters (`--profile`).
CG_DEVICE cg_aligned_chunk<4, float> cg_shared_load_chunk(const float* p) {
#ifdef CUDAGEN_EMULATION
  cudagen_emu::note_shared_request(p, 16);
#endif
  return *reinterpret_cast<const cg_aligned_chunk<4, float>*>(p);
}
CG_DEVICE void cg_shared_store_chunk(float* p, const cg_aligned_chunk<4, float>& chunk) {
#ifdef CUDAGEN_EMULATION
  cudagen_emu::note_shared_request(p, 16);
#endif
  *reinterpret_cast<cg_aligned_chunk<4, float>*>(p) = chunk;
}
CG_DEVICE void cg_shared_store_float(float* p, float v) {
#ifdef CUDAGEN_EMULATION
  cudagen_emu::note_shared_request(p, 4);
#endif
  *p = v;
}

// ---------------------------------------------------------------------------
// A swizzled shared tile: ROWS rows of COLS elements, COLS contiguous, in
// 16-byte chunks of CHUNK elements (8 of 16 bits, 4 of 32). Chunk c of row r
// is stored at chunk c ^ key(r), where key spreads the 8 rows an ldmatrix (or
// a warp's copies) touches over the 8 distinct 16-byte slots of a 128-byte
// bank line. PAIRED_READS: the tile is also read by 32-bit loads of 8
// consecutive columns (two chunks, the first even) in each of 4 consecutive
// rows (a TF32 fragment of an MN-contiguous operand), so the keys of those
// rows differ in their upper bits: rows 0-7 take 0, 2, 4, 6, 1, 3, 5, 7,
// still a permutation of the slots for every 8 rows.
template <int ROWS, int COLS, int CHUNK = 8, bool PAIRED_READS = false>
struct cg_swizzled_tile {
  static_assert(COLS % CHUNK == 0 && COLS >= 2 * CHUNK, "rows of whole 16-byte chunks, at least two");
  static constexpr int chunks = COLS / CHUNK;                         // per row
  static constexpr int rows_per_line = chunks >= 8 ? 1 : 8 / chunks;  // rows sharing a 128-byte line
  static constexpr int key_mask = chunks >= 8 ? 7 : chunks - 1;
  static constexpr int key_period = rows_per_line * (key_mask + 1);  // rows after which the keys repeat
  static constexpr int elements = ROWS * COLS;
  static_assert(!PAIRED_READS || chunks >= 8, "paired reads need rows of a whole bank line");
  CG_DEVICE static int key(int row) {
    const int r = row / rows_per_line;
    return (PAIRED_READS ? ((r & 3) << 1) | ((r >> 2) & 1) : r) & key_mask;
  }
  // (Rows and columns are never negative: unsigned, the divisions by powers
  // of two are shifts.)
  CG_DEVICE static int offset(int row, int col) {
    const int chunk = (int)((unsigned)col / CHUNK) ^ key(row);
    return row * COLS + chunk * CHUNK + (int)((unsigned)col % CHUNK);
  }
};

// One operand's tile in shared memory: MN x BK values of type T (cg_f16,
// cg_bf16 or cg_tf32), stored K-contiguous ([MN][BK]) or MN-contiguous
// ([BK][MN]) as the operand is in global memory, so that every copy is 16
// bytes of consecutive global addresses.
// (A TF32 operand stored MN-contiguous is read by 32-bit loads (fragment),
// whose tile takes the paired swizzle (PAIRED_SWIZZLE) that spreads them
// over the banks; ldmatrix reads the 8 rows of any aligned group of a
// paired tile conflict-free too. Two views of one tile must agree on it: flash
// attention's keys, copied MN-contiguous and read K-contiguous, pass false
// to the first; the backward's streamed 4-byte tiles (cg_tf32, cg_f32_simt),
// read both ways, true to the second.)
template <int MN, int BK, bool K_CONTIGUOUS, typename T, bool PAIRED_SWIZZLE = !K_CONTIGUOUS && sizeof(T) == 4>
struct cg_gemm_operand {
  static constexpr int CHUNK = 16 / (int)sizeof(T);  // elements a 16-byte copy moves
  static constexpr bool scalar_reads = !K_CONTIGUOUS && sizeof(T) == 4;
  typedef cg_swizzled_tile<K_CONTIGUOUS ? MN : BK, K_CONTIGUOUS ? BK : MN, CHUNK, PAIRED_SWIZZLE> tile;
  static constexpr int elements = tile::elements;

  // Which chunks of the stored tile a thread copies, for every copier of it
  // (the matrix copier below, an implicit GEMM's gathers): thread t copies
  // chunks t, t + THREADS, ... (row-major over the tile's rows of `chunks`
  // chunks); with THREADS a multiple of `chunks`, its column is the same for
  // all of them and its rows are `row_stride` apart. Where those rows share
  // their swizzle key (row_stride a multiple of the key's period: every GEMM
  // tile), the chunks' offsets are row_stride rows apart; otherwise (rows of
  // 32 chunks for 128 threads: flash attention's heads of 256) each chunk's
  // offset is swizzled on its own.
  template <int THREADS>
  struct copy_layout {
    static constexpr int rows = K_CONTIGUOUS ? MN : BK, chunks = tile::chunks;
    static constexpr int per_thread = rows * chunks / THREADS, row_stride = THREADS / chunks;
    static_assert((rows * chunks) % THREADS == 0 && THREADS % chunks == 0,
                  "every thread copies the same number of chunks, in one column");
    static constexpr bool one_key = per_thread == 1 || row_stride % tile::key_period == 0;
    CG_DEVICE static int row() { return (int)threadIdx.x / chunks; }
    CG_DEVICE static int col() { return ((int)threadIdx.x % chunks) * CHUNK; }
    // The offset in a stage's tile of this thread's chunk i, `first` that of its chunk 0.
    CG_DEVICE static int offset(int first, int i) {
      return one_key ? first + i * row_stride * chunks * CHUNK : tile::offset(row() + i * row_stride, col());
    }
  };

  // The copies of one thread, global -> shared, k-tile after k-tile: set up
  // once per output tile, so that a k-tile costs each chunk an address add,
  // one compare and the cp.async.
  template <int THREADS>
  struct copier {
    typedef copy_layout<THREADS> layout;
    static constexpr int chunks = layout::chunks, per_thread = layout::per_thread, row_stride = layout::row_stride;
    static_assert(per_thread <= 32, "the row predicates fit one word");
    const T* src;               // this thread's first chunk at the first k-tile
    const T* base;              // the operand's first element: a valid address to copy nothing from
    cg_i64 row_step, k_step;    // elements between its chunks; between k-tiles
    cg_i64 k_left;              // k values left from the first k-tile's first, past its first chunk's
    int smem_offset;            // of its first chunk in a stage's tile
    unsigned int rows_inside;   // bit i: chunk i's MN row or column lies inside the operand

    // The operand's first element `src0`, its leading dimension `ld`, its
    // extent along MN; the tile starts at mn0 and its k-tiles at k_begin,
    // running to k_end.
    CG_DEVICE copier(const T* src0, cg_i64 ld, cg_i64 mn0, cg_i64 mn_extent, cg_i64 k_begin, cg_i64 k_end) {
      const int row = layout::row(), col = layout::col();
      const cg_i64 outer = (K_CONTIGUOUS ? mn0 : k_begin) + row, inner = (K_CONTIGUOUS ? k_begin : mn0) + col;
      base = src0;
      src = src0 + outer * ld + inner;
      row_step = (cg_i64)row_stride * ld;
      k_step = K_CONTIGUOUS ? (cg_i64)BK : (cg_i64)BK * ld;
      k_left = k_end - (K_CONTIGUOUS ? inner : outer);
      smem_offset = tile::offset(row, col);
      rows_inside = 0;
      CG_UNROLL
      for (int i = 0; i < per_thread; ++i) {
        const cg_i64 mn = K_CONTIGUOUS ? outer + (cg_i64)i * row_stride : inner;
        if (mn < mn_extent) rows_inside |= 1u << i;
      }
    }

    // Issues the cp.async of k-tile kt into the stage's tile at shared
    // address `dst`, zero-filling past the operand's MN extent and past k_end.
    CG_DEVICE void copy(unsigned int dst, cg_i64 kt) const {
      const T* from = src + kt * k_step;
      const cg_i64 k_first = kt * BK;  // of this thread's first chunk, relative to k_left's origin
      CG_UNROLL
      for (int i = 0; i < per_thread; ++i) {
        const cg_i64 k_of_chunk = K_CONTIGUOUS ? k_first : k_first + (cg_i64)i * row_stride;
        const bool inside = ((rows_inside >> i) & 1u) && k_of_chunk < k_left;
        cg_cp_async_16_at(dst + (unsigned int)(layout::offset(smem_offset, i) * (int)sizeof(T)),
                          inside ? from + i * row_step : base, inside ? 16 : 0);
      }
    }
  };

  // The x4 fragment of a 16 x (2 CHUNK) block at (mn, k) of the tile (16 x
  // 16 of 16-bit values, 16 x 8 of TF32). A_ORDER: the four 8-row matrices in
  // mma's A order (mn 0-7 k first half, mn 8-15 k first half, mn 0-7 k second
  // half, mn 8-15 k second half); otherwise B's order for two n8 tiles (mn
  // 0-7 k first half, mn 0-7 k second half, mn 8-15 k first half, mn 8-15 k
  // second half). A half of k is one 16-byte chunk. The tile at shared
  // address `tile_address` (ldmatrix), which `tile_pointer` points at (32-bit loads).
  template <bool A_ORDER>
  CG_DEVICE static void fragment(unsigned int r[4], unsigned int tile_address, const T* tile_pointer, int mn, int k) {
    static_assert(!scalar_reads || PAIRED_SWIZZLE, "32-bit reads of an MN-contiguous tile take the paired swizzle");
    const int lane = threadIdx.x & 31;
    if (!scalar_reads) {
      const int matrix = lane >> 3, row = lane & 7;
      const int mn_off = A_ORDER ? 8 * (matrix & 1) : 8 * (matrix >> 1);
      const int k_off = CHUNK * (A_ORDER ? matrix >> 1 : matrix & 1);
      // Each lane points at a row of one 16-byte chunk: along K where the
      // tile is K-contiguous (the plain ldmatrix; for TF32 lane l then gets
      // the 32-bit value (l / 4, l % 4) of each 8 x 4 matrix, mma's layout),
      // along MN otherwise (.trans, 16-bit values only).
      const int offset = K_CONTIGUOUS ? tile::offset(mn + mn_off + row, k + k_off)
                                      : tile::offset(k + k_off + row, mn + mn_off);
      cg_ldmatrix_x4_at<!K_CONTIGUOUS>(r, tile_address + (unsigned int)(offset * (int)sizeof(T)));
    } else {
      // Lane (g, t) reads value (mn + g, k + t) of each 8 x 4 matrix: rows k
      // + t of the [BK][MN] tile, whose paired swizzle keys put a warp's 32
      // reads on 32 distinct banks.
      const int g = lane >> 2, t = lane & 3;
      CG_UNROLL
      for (int i = 0; i < 4; ++i) {
        const int mn_off = A_ORDER ? 8 * (i & 1) : 8 * (i >> 1);
        const int k_off = CHUNK * (A_ORDER ? i >> 1 : i & 1);
        r[i] = cg_shared_load_b32((const unsigned int*)(tile_pointer + tile::offset(k + k_off + t, mn + mn_off + g)));
      }
    }
    cg_gemm_fragment_ready(r, T());
  }
};

// The mainloop's compile-time shape.
template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_>
struct cg_gemm_config {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, STAGES = STAGES_;
  static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;  // one warp's patch
  static constexpr int MI = WM / 16, NI = WN / 8;             // its mma tiles
  static_assert(WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0, "whole mma tiles, B fragments in pairs");
};

// A warp's accumulators: MI x NI mma tiles of 16 x 8, four floats each.
template <typename Config>
struct cg_gemm_accumulators {
  float v[Config::MI][Config::NI][4];
};

// A copier of cg_gemm_mainloop_with for an operand that no matrix holds and
// whose addresses no per-tile set-up makes cheap (a convolution's gradients,
// templates/vision.cuh): chunk (mn, k) of the tile, 16 bytes along k
// (K_CONTIGUOUS) or along mn, comes from source.at(mn, k), a pointer to its
// first element, or nullptr where it is zeros; past mn_extent and past k_end
// it is zeros without asking (each extent a whole number of chunks along its
// contiguous axis). The chunks lie as cg_gemm_operand's copier lays them:
// the same tile, read by the same fragments.
template <int MN, int BK, bool K_CONTIGUOUS, typename T, int THREADS, typename Source>
struct cg_gemm_gather {
  typedef cg_gemm_operand<MN, BK, K_CONTIGUOUS, T> operand;
  typedef typename operand::template copy_layout<THREADS> layout;
  static constexpr int per_thread = layout::per_thread, row_stride = layout::row_stride;
  Source source;
  const T* base;                  // a valid address to copy nothing from
  cg_i64 mn_first, k_first;       // this thread's first chunk at k-tile 0
  cg_i64 mn_extent, k_end;
  int smem_offset;                // of its first chunk in a stage's tile

  CG_DEVICE cg_gemm_gather(const Source& source_, const T* base_, cg_i64 mn0, cg_i64 mn_extent_, cg_i64 k_begin,
                           cg_i64 k_end_)
      : source(source_), base(base_), mn_extent(mn_extent_), k_end(k_end_) {
    const int row = layout::row(), col = layout::col();
    mn_first = mn0 + (K_CONTIGUOUS ? row : col);
    k_first = k_begin + (K_CONTIGUOUS ? col : row);
    smem_offset = operand::tile::offset(row, col);
  }

  // Issues the cp.async of k-tile kt into the stage's tile at shared address `dst`.
  CG_DEVICE void copy(unsigned int dst, cg_i64 kt) const {
    CG_UNROLL
    for (int i = 0; i < per_thread; ++i) {
      const cg_i64 mn = mn_first + (K_CONTIGUOUS ? (cg_i64)i * row_stride : 0);
      const cg_i64 k = k_first + kt * BK + (K_CONTIGUOUS ? 0 : (cg_i64)i * row_stride);
      const T* from = mn < mn_extent && k < k_end ? source.at(mn, k) : nullptr;
      cg_cp_async_16_at(dst + (unsigned int)(layout::offset(smem_offset, i) * (int)sizeof(T)),
                        from != nullptr ? from : base, from != nullptr ? 16 : 0);
    }
  }
};

// Shared memory of the mainloop and of the staged results after it
// (cg_gemm_each_coalesced), in bytes: STAGES k-tiles of both operands (of
// type T), or a [BM][BN + 4] float tile where that is more.
template <typename Config, typename T>
struct cg_gemm_shared {
  static constexpr int stages = (int)sizeof(T) * Config::STAGES * (Config::BM + Config::BN) * Config::BK;
  static constexpr int staged = 4 * Config::BM * (Config::BN + 4);
  static constexpr int bytes = stages > staged ? stages : staged;
};

// The mainloop on the copiers it is given: k_tiles k-tiles into acc (zeroed
// here), each k-tile's operand tiles issued by copy_a.copy(address, kt) and
// copy_b.copy(address, kt) into a stage at that shared address, as
// cg_gemm_operand's copier lays them out (A's tile first in the stage). A
// copier may gather what no matrix holds: an implicit GEMM's patches
// (templates/vision.cuh, cg_conv2d_nhwc_patches) fill A's tile so.
template <typename Config, typename T, bool A_K_CONTIGUOUS, bool B_K_CONTIGUOUS, typename CopyA, typename CopyB>
CG_DEVICE void cg_gemm_mainloop_with(cg_gemm_accumulators<Config>& acc, const CopyA& copy_a, const CopyB& copy_b,
                                     cg_i64 k_tiles, T* smem) {
  typedef cg_gemm_operand<Config::BM, Config::BK, A_K_CONTIGUOUS, T> OperandA;
  typedef cg_gemm_operand<Config::BN, Config::BK, B_K_CONTIGUOUS, T> OperandB;
  constexpr int K_STEP = 2 * OperandA::CHUNK;  // k of one mma: 16 (16-bit), 8 (TF32)
  constexpr int S = Config::STAGES, stage_elements = OperandA::elements + OperandB::elements;
  const int warp = threadIdx.x >> 5, warp_m = (warp / Config::WARPS_N) * Config::WM,
            warp_n = (warp % Config::WARPS_N) * Config::WN;
  CG_UNROLL
  for (int i = 0; i < Config::MI; ++i)
    CG_UNROLL
    for (int j = 0; j < Config::NI; ++j)
      CG_UNROLL
      for (int e = 0; e < 4; ++e) acc.v[i][j][e] = 0.0f;

  // Shared addresses, computed once: a generic pointer costs every access a conversion.
  const unsigned int smem_address = cg_smem_address(smem);
  constexpr unsigned int stage_bytes = stage_elements * (int)sizeof(T), b_offset = OperandA::elements * (int)sizeof(T);
  auto load_stage = [&](cg_i64 kt) {
    const unsigned int stage = smem_address + (unsigned int)(kt % S) * stage_bytes;
    copy_a.copy(stage, kt);
    copy_b.copy(stage + b_offset, kt);
  };
  // Prologue: S - 1 k-tiles in flight; a group is committed for every tile,
  // empty past the end, so that wait<S - 2> always means "tile kt landed".
  for (int s = 0; s < S - 1; ++s) {
    if (s < k_tiles) load_stage(s);
    cg_cp_async_commit();
  }
  for (cg_i64 kt = 0; kt < k_tiles; ++kt) {
    cg_cp_async_wait<S - 2>();
    // Tile kt is visible to every warp, and every warp is done with tile kt - 1,
    // whose stage the next copy overwrites.
    __syncthreads();
    if (kt + S - 1 < k_tiles) load_stage(kt + S - 1);
    cg_cp_async_commit();
    const unsigned int tile_a = smem_address + (unsigned int)(kt % S) * stage_bytes, tile_b = tile_a + b_offset;
    const T* tile_a_ptr = smem + (int)(kt % S) * stage_elements;  // for TF32's 32-bit loads
    const T* tile_b_ptr = tile_a_ptr + OperandA::elements;
    CG_UNROLL
    for (int kk = 0; kk < Config::BK; kk += K_STEP) {
      unsigned int fa[Config::MI][4], fb[Config::NI / 2][4];
      CG_UNROLL
      for (int i = 0; i < Config::MI; ++i)
        OperandA::template fragment<true>(fa[i], tile_a, tile_a_ptr, warp_m + 16 * i, kk);
      CG_UNROLL
      for (int j = 0; j < Config::NI / 2; ++j)
        OperandB::template fragment<false>(fb[j], tile_b, tile_b_ptr, warp_n + 16 * j, kk);
      CG_UNROLL
      for (int i = 0; i < Config::MI; ++i)
        CG_UNROLL
        for (int j = 0; j < Config::NI; ++j) cg_mma_packed(acc.v[i][j], fa[i], &fb[j / 2][2 * (j % 2)], T());
    }
  }
  cg_cp_async_wait<0>();
  __syncthreads();  // the caller may reuse the shared memory
}

// The mainloop: the tile (tile_m, tile_n) of D = A B over k in [k_begin,
// k_end), into acc (zeroed here). a and b point at the operands' first
// elements, of type T: cg_f16 or cg_bf16 (m16n8k16), or cg_tf32 (f32 values
// multiplied as TF32, m16n8k8). BK counts elements of T.
template <typename Config, typename T, bool A_K_CONTIGUOUS, bool B_K_CONTIGUOUS>
CG_DEVICE void cg_gemm_mainloop(cg_gemm_accumulators<Config>& acc, const T* a, cg_i64 lda, const T* b, cg_i64 ldb,
                                cg_i64 M, cg_i64 N, cg_i64 k_begin, cg_i64 k_end, cg_i64 tile_m, cg_i64 tile_n,
                                T* smem) {
  typedef cg_gemm_operand<Config::BM, Config::BK, A_K_CONTIGUOUS, T> OperandA;
  typedef cg_gemm_operand<Config::BN, Config::BK, B_K_CONTIGUOUS, T> OperandB;
  const typename OperandA::template copier<Config::THREADS> copy_a(a, lda, tile_m * Config::BM, M, k_begin, k_end);
  const typename OperandB::template copier<Config::THREADS> copy_b(b, ldb, tile_n * Config::BN, N, k_begin, k_end);
  cg_gemm_mainloop_with<Config, T, A_K_CONTIGUOUS, B_K_CONTIGUOUS>(
      acc, copy_a, copy_b, (k_end - k_begin + Config::BK - 1) / Config::BK, smem);
}

// Calls f(m, n, d0, d1) for each pair of horizontally adjacent accumulators
// of this thread that lie inside M x N (n even; n + 1 may be past N, then d1
// must be dropped: the caller checks n + 1 < N).
template <typename Config, typename F>
CG_DEVICE void cg_gemm_each_pair(const cg_gemm_accumulators<Config>& acc, cg_i64 M, cg_i64 N, cg_i64 tile_m,
                                 cg_i64 tile_n, F f) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const cg_i64 m0 = tile_m * Config::BM + (warp / Config::WARPS_N) * Config::WM,
               n0 = tile_n * Config::BN + (warp % Config::WARPS_N) * Config::WN;
  CG_UNROLL
  for (int i = 0; i < Config::MI; ++i)
    CG_UNROLL
    for (int j = 0; j < Config::NI; ++j)
      CG_UNROLL
      for (int h = 0; h < 2; ++h) {
        const cg_i64 m = m0 + 16 * i + g + 8 * h, n = n0 + 8 * j + 2 * t;
        if (m < M && n < N) f(m, n, acc.v[i][j][2 * h], acc.v[i][j][2 * h + 1]);
      }
}

// A block's BM x BN results staged in shared memory (rows LD floats apart),
// walked for 16-byte stores: each lane takes W consecutive columns (W = 4
// or 8), BN / W lanes a row, and calls f(m, n, v) with v its W values, for
// each group inside M x N. N must be a multiple of W (the caller checks), so
// that a group lies wholly inside or wholly outside and m * N + n is a
// multiple of W: f's vector loads and stores are aligned. A lane reads its W
// values as 16-byte chunks; with W = 8 the two in an order that puts the 8
// lanes of a phase on 8 distinct bank slots (lanes 4-7 of every 8 start with
// their second chunk).
template <int BM, int BN, int THREADS, int W, typename F>
CG_DEVICE void cg_staged_walk_vector(const float* smem, int LD, cg_i64 M, cg_i64 N, cg_i64 m0, cg_i64 n0, F f) {
  static_assert(W == 4 || W == 8, "16 bytes of 4- or 2-byte values, or 8 of 2-byte ones");
  constexpr int LANES = BN / W, ROWS = 32 / LANES;  // lanes a row; rows a warp takes at once
  static_assert(BN % W == 0 && 32 % LANES == 0, "a row of whole groups, whole rows to a warp");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, col = (lane % LANES) * W;
  for (int r = warp * ROWS + lane / LANES; r < BM; r += (THREADS / 32) * ROWS) {
    if (m0 + r >= M) break;
    if (n0 + col >= N) continue;
    // (The order by selects: an index computed at run time would put v in
    // local memory.)
    const bool second_first = W == 8 && ((lane >> 2) & 1) != 0;
    const float* at = smem + r * LD + col;
    const cg_aligned_chunk<4, float> first = cg_shared_load_chunk(at + (second_first ? 4 : 0));
    const cg_aligned_chunk<4, float> second = W == 8 ? cg_shared_load_chunk(at + (second_first ? 0 : 4)) : first;
    float v[W];
    CG_UNROLL
    for (int j = 0; j < 4; ++j) {
      v[j] = second_first ? second.v[j] : first.v[j];
      if (W == 8) v[4 + j] = second_first ? first.v[j] : second.v[j];
    }
    f(m0 + r, n0 + col, v);
  }
}

// The block's output tile again, through shared memory, in an order that
// coalesces: the warps write their accumulators into a [BM][BN + 4] float
// tile (over the pipeline's stages, free once the mainloop has ended, in
// cg_gemm_shared<Config>::bytes; the 4 floats of padding keep a fragment
// write on 32 distinct banks), then each warp walks rows, its lanes 32
// consecutive columns at a time, calling f(m, n, acc). The loads and stores
// f makes (an epilogue's bias or residual, the output) then take whole
// sectors, where each_pair's fragment order took a quarter of each. `smem`:
// the mainloop's shared memory.
template <typename Config>
CG_DEVICE void cg_gemm_stage_results(const cg_gemm_accumulators<Config>& acc, float* smem) {
  constexpr int LD = Config::BN + 4;  // cg_gemm_shared's `staged`
  __syncthreads();                    // every warp is done reading the stages
  // Tile (0, 0) of a BM x BN product: each_pair's coordinates are the tile's own.
  cg_gemm_each_pair<Config>(acc, Config::BM, Config::BN, 0, 0, [&](cg_i64 m, cg_i64 n, float d0, float d1) {
    float* at = smem + m * LD + n;
    at[0] = d0;
    at[1] = d1;
  });
  __syncthreads();
}

template <typename Config, typename F>
CG_DEVICE void cg_gemm_each_coalesced(const cg_gemm_accumulators<Config>& acc, cg_i64 M, cg_i64 N, cg_i64 tile_m,
                                      cg_i64 tile_n, float* smem, F f) {
  constexpr int LD = Config::BN + 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  cg_gemm_stage_results<Config>(acc, smem);
  const cg_i64 m0 = tile_m * Config::BM, n0 = tile_n * Config::BN;
  for (int r = warp; r < Config::BM; r += Config::THREADS / 32) {
    if (m0 + r >= M) break;
    CG_UNROLL
    for (int c = lane; c < Config::BN; c += 32)
      if (n0 + c < N) f(m0 + r, n0 + c, smem[r * LD + c]);
  }
}

// cg_gemm_each_coalesced with 16-byte stores: f(m, n, v) for W consecutive
// values from (m, n) (cg_staged_walk_vector; N a multiple of W).
template <typename Config, int W, typename F>
CG_DEVICE void cg_gemm_each_coalesced_vector(const cg_gemm_accumulators<Config>& acc, cg_i64 M, cg_i64 N,
                                             cg_i64 tile_m, cg_i64 tile_n, float* smem, F f) {
  cg_gemm_stage_results<Config>(acc, smem);
  cg_staged_walk_vector<Config::BM, Config::BN, Config::THREADS, W>(smem, Config::BN + 4, M, N, tile_m * Config::BM,
                                                                   tile_n * Config::BN, f);
}

// Whether this block is the last of `splits` blocks to count itself in at
// `*arrivals` (zero before the launch; the last leaves it zero for the next):
// the one that combines the parts. Each block calls it after storing its part;
// the fences make every part visible before its block's count, and the
// others' parts visible to the last after it reads the count: thread 0's
// acquire-release count, after a barrier that orders every thread's stores
// before it, and before one that orders the reads after it. `smem`: a word
// of shared memory. Every thread of the block calls it.
CG_DEVICE bool cg_last_to_arrive(unsigned int* arrivals, int splits, unsigned int* smem) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int before = cg_arrive_acq_rel(arrivals);
    const unsigned int last = before == (unsigned int)splits - 1;
    if (last) *arrivals = 0u;  // every split has arrived: nothing else reads it in this launch
    smem[0] = last;
  }
  __syncthreads();
  return smem[0] != 0u;
}

// Split-K (docs/gemm.md): `splits` blocks compute the same output tile,
// each over its own part of the k range, and the sum is taken in a fixed
// order, so that the result is the same bit for bit whichever block ends
// last. Each block stores its partial sums to partials[split] (an
// [splits][M][N] f32 workspace; pairs in fragment order, four lanes on 32
// consecutive bytes: whole sectors), then counts itself in at `arrivals`
// (one counter per output tile, zero before the first launch); the block
// that arrives last adds partials[0] + partials[1] + ... in that order and
// hands each (m, n, sum) inside M x N to f, walking rows as
// cg_gemm_each_coalesced does, then sets the counter back to zero for the
// next launch. The atomic only elects that block: no value is added
// atomically. `smem`: the mainloop's shared memory (one word of it).
template <typename Config, typename F>
CG_DEVICE void cg_gemm_split_k(const cg_gemm_accumulators<Config>& acc, cg_i64 M, cg_i64 N, cg_i64 tile_m,
                               cg_i64 tile_n, int split, int splits, float* partials, unsigned int* arrivals,
                               unsigned int* smem, F f) {
  float* mine = partials + (cg_i64)split * M * N;
  const bool pairs = (N & 1) == 0;  // then every pair is 8-byte aligned
  cg_gemm_each_pair<Config>(acc, M, N, tile_m, tile_n, [&](cg_i64 m, cg_i64 n, float d0, float d1) {
    if (pairs && n + 1 < N) {
      cg_vector<2, float> pair;
      pair.v[0] = d0;
      pair.v[1] = d1;
      cg_store_vector<2, float>(mine, m * N + n, pair);
      return;
    }
    cg_store(mine, m * N + n, d0);
    if (n + 1 < N) cg_store(mine, m * N + n + 1, d1);
  });
  if (!cg_last_to_arrive(arrivals, splits, smem)) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const cg_i64 m0 = tile_m * Config::BM, n0 = tile_n * Config::BN;
  for (int r = warp; r < Config::BM; r += Config::THREADS / 32) {
    const cg_i64 m = m0 + r;
    if (m >= M) break;
    CG_UNROLL
    for (int c = lane; c < Config::BN; c += 32) {
      const cg_i64 n = n0 + c;
      if (n >= N) continue;
      float sum = 0.0f;
      for (int s = 0; s < splits; ++s) sum += cg_load_l2(partials, ((cg_i64)s * M + m) * N + n);
      f(m, n, sum);
    }
  }
}

// The output tile of block `block` (a linear index) among tiles_m x tiles_n,
// walked in groups of `group` tile rows, column by column inside a group, so
// that blocks running together share rows of A and columns of B in L2.
CG_DEVICE void cg_gemm_tile_of(cg_i64 block, cg_i64 tiles_m, cg_i64 tiles_n, int group, cg_i64* tile_m,
                               cg_i64* tile_n) {
  const cg_i64 per_group = (cg_i64)group * tiles_n, first_m = block / per_group * group;
  const cg_i64 rows = tiles_m - first_m < group ? tiles_m - first_m : group;
  *tile_m = first_m + (block % per_group) % rows;
  *tile_n = (block % per_group) / rows;
}

// ---------------------------------------------------------------------------
// The f32 SIMT mainloop (docs/gemm.md): f32 stays off tensor cores (TF32
// would break the f32 bound, docs/architecture.md §9), so its speed is the
// CUDA cores' FMA rate, which one shared load per FMA (the portable tile)
// cannot feed. Here a block of (BM / 8) x (BN / 8) threads computes a BM x BN
// tile, each thread an 8 x 8 patch: rows ty*4 + [0, 4) and BM/2 + ty*4 +
// [0, 4), columns likewise, so that per k it reads its 8 values of A and 8
// of B as four 16-byte shared loads and does 64 FMAs. Shared tiles are
// k-major ([BK][BM + 4], [BK][BN + 4]: A is transposed on its way in where
// it is K-contiguous; the 4 floats of padding keep those transposing stores
// on distinct banks), two stages: the next k-tile's global loads (16 bytes
// each, into registers) are in flight while this one computes, one barrier
// per k-tile. Each operand's contiguous extent and leading dimension must be
// a multiple of 4 floats (the caller checks), so that a 16-byte chunk lies
// wholly inside or wholly outside it.
template <int BM_, int BN_, int BK_>
struct cg_sgemm_config {
  static constexpr int BM = BM_, BN = BN_, BK = BK_;
  static constexpr int THREADS = (BM / 8) * (BN / 8);
  static constexpr int LDA = BM + 4, LDB = BN + 4;        // shared rows, padded
  static constexpr int STAGE = BK * (LDA + LDB);          // floats per stage
  static constexpr int STAGED = BM * (BN + 4);            // the results, after the mainloop
  static constexpr int SHARED_BYTES = 4 * (2 * STAGE > STAGED ? 2 * STAGE : STAGED);
  static_assert(BM % 16 == 0 && BN % 16 == 0 && BK % 4 == 0, "8 x 8 patches in two halves; 16-byte chunks of k");
};

template <typename Config>
struct cg_sgemm_accumulators {
  float v[8][8];
};


// A thread's rows (or columns) of its patch: i in [0, 8), `t` its index along them.
template <int EXTENT>
CG_DEVICE int cg_sgemm_patch(int t, int i) {
  return (i < 4 ? 0 : EXTENT / 2) + t * 4 + (i & 3);
}

// One operand's k-tile, global -> registers -> shared: MN x BK values, read
// in 16-byte chunks along the operand's contiguous axis (K, or MN) and
// stored k-major in shared memory.
template <int MN, int BK, int THREADS, bool K_CONTIGUOUS>
struct cg_sgemm_operand {
  static constexpr int LD = MN + 4;
  static constexpr int CHUNKS = MN * BK / 4, PER_THREAD = CHUNKS / THREADS;
  static_assert(CHUNKS % THREADS == 0, "every thread copies the same number of chunks");
  float r[PER_THREAD][4];

  // Chunk c of the tile: its row along the stored layout and its first column.
  CG_DEVICE static void chunk_at(int c, int* mn, int* k) {
    if (K_CONTIGUOUS) {
      *mn = c / (BK / 4);
      *k = (c % (BK / 4)) * 4;
    } else {
      *k = c / (MN / 4);
      *mn = (c % (MN / 4)) * 4;
    }
  }

  // Set up once per tile, so that a k-tile costs each chunk a pointer add,
  // a compare and the load: the operand at `src` (leading dimension ld),
  // rows along MN from mn0 to mn_extent, K values up to k_extent.
  const float* from[PER_THREAD];  // this thread's chunks at the next k-tile
  cg_i64 k_step;                  // elements between k-tiles
  cg_i64 k_left[PER_THREAD];      // K values past each chunk's first at k-tile 0
  unsigned int rows_inside;       // bit i: chunk i's MN row or column lies inside

  CG_DEVICE void start(const float* src, cg_i64 ld, cg_i64 mn0, cg_i64 mn_extent, cg_i64 k_extent) {
    k_step = K_CONTIGUOUS ? (cg_i64)BK : (cg_i64)BK * ld;
    rows_inside = 0;
    CG_UNROLL
    for (int i = 0; i < PER_THREAD; ++i) {
      int mn, k;
      chunk_at((int)threadIdx.x + i * THREADS, &mn, &k);
      const cg_i64 gm = mn0 + mn;
      from[i] = src + (K_CONTIGUOUS ? gm * ld + k : (cg_i64)k * ld + gm);
      k_left[i] = k_extent - k;
      if (gm < mn_extent) rows_inside |= 1u << i;
    }
  }

  // The next k-tile (kt counts them from 0) into registers, zeros outside.
  CG_DEVICE void fetch(cg_i64 kt) {
    CG_UNROLL
    for (int i = 0; i < PER_THREAD; ++i) {
      if (((rows_inside >> i) & 1u) && kt * BK < k_left[i]) {
        const cg_vector<4, float> v = cg_load_vector<4, float>(from[i], 0);
        CG_UNROLL
        for (int j = 0; j < 4; ++j) r[i][j] = v.v[j];
      } else {
        CG_UNROLL
        for (int j = 0; j < 4; ++j) r[i][j] = 0.0f;
      }
      from[i] += k_step;
    }
  }

  CG_DEVICE void stash(float* tile) const {
    CG_UNROLL
    for (int i = 0; i < PER_THREAD; ++i) {
      int mn, k;
      chunk_at((int)threadIdx.x + i * THREADS, &mn, &k);
      if (K_CONTIGUOUS) {  // a chunk along k: one value into each of 4 k-rows
        CG_UNROLL
        for (int j = 0; j < 4; ++j) cg_shared_store_float(tile + (k + j) * LD + mn, r[i][j]);
      } else {  // a chunk along MN: 16 bytes of one k-row
        cg_aligned_chunk<4, float> chunk;
        CG_UNROLL
        for (int j = 0; j < 4; ++j) chunk.v[j] = r[i][j];
        cg_shared_store_chunk(tile + k * LD + mn, chunk);
      }
    }
  }
};

// The tile (tile_m, tile_n) of D = A B over all of K into acc (zeroed here).
// Layouts as cg_gemm_mainloop's: A is M x K, K-contiguous (lda >= K) or
// M-contiguous (A^T stored, lda >= M); B is K x N, K-contiguous (B^T stored,
// ldb >= K) or N-contiguous (ldb >= N).
template <typename Config, bool A_K_CONTIGUOUS, bool B_K_CONTIGUOUS>
CG_DEVICE void cg_sgemm_mainloop(cg_sgemm_accumulators<Config>& acc, const float* a, cg_i64 lda, const float* b,
                                 cg_i64 ldb, cg_i64 M, cg_i64 N, cg_i64 K, cg_i64 tile_m, cg_i64 tile_n, float* smem) {
  constexpr int BM = Config::BM, BN = Config::BN, BK = Config::BK;
  const int tx = (int)threadIdx.x % (BN / 8), ty = (int)threadIdx.x / (BN / 8);
  const cg_i64 m0 = tile_m * BM, n0 = tile_n * BN;
  CG_UNROLL
  for (int i = 0; i < 8; ++i)
    CG_UNROLL
    for (int j = 0; j < 8; ++j) acc.v[i][j] = 0.0f;
  cg_sgemm_operand<BM, BK, Config::THREADS, A_K_CONTIGUOUS> copy_a;
  cg_sgemm_operand<BN, BK, Config::THREADS, B_K_CONTIGUOUS> copy_b;
  const cg_i64 k_tiles = (K + BK - 1) / BK;
  if (k_tiles == 0) return;
  copy_a.start(a, lda, m0, M, K);
  copy_b.start(b, ldb, n0, N, K);
  copy_a.fetch(0);
  copy_b.fetch(0);
  copy_a.stash(smem);
  copy_b.stash(smem + BK * Config::LDA);
  __syncthreads();
  for (cg_i64 kt = 0; kt < k_tiles; ++kt) {
    const bool more = kt + 1 < k_tiles;
    if (more) {  // in flight while this k-tile computes
      copy_a.fetch(kt + 1);
      copy_b.fetch(kt + 1);
    }
    const float* tile_a = smem + (int)(kt & 1) * Config::STAGE;
    const float* tile_b = tile_a + BK * Config::LDA;
    CG_UNROLL
    for (int k = 0; k < BK; ++k) {
      float fa[8], fb[8];
      CG_UNROLL
      for (int h = 0; h < 2; ++h) {
        const cg_aligned_chunk<4, float> ca = cg_shared_load_chunk(tile_a + k * Config::LDA + cg_sgemm_patch<BM>(ty, 4 * h));
        const cg_aligned_chunk<4, float> cb = cg_shared_load_chunk(tile_b + k * Config::LDB + cg_sgemm_patch<BN>(tx, 4 * h));
        CG_UNROLL
        for (int j = 0; j < 4; ++j) {
          fa[4 * h + j] = ca.v[j];
          fb[4 * h + j] = cb.v[j];
        }
      }
      CG_UNROLL
      for (int i = 0; i < 8; ++i)
        CG_UNROLL
        for (int j = 0; j < 8; ++j) acc.v[i][j] = fmaf(fa[i], fb[j], acc.v[i][j]);
    }
    if (more) {  // the other stage: every thread finished reading it before the last barrier
      float* next = smem + (int)((kt + 1) & 1) * Config::STAGE;
      copy_a.stash(next);
      copy_b.stash(next + BK * Config::LDA);
    }
    __syncthreads();
  }
}

// The block's results through shared memory (a [BM][BN + 4] tile over the
// stages), then each warp walks rows, its lanes on 32 consecutive columns,
// calling f(m, n, acc) for each inside M x N: the epilogue's loads and the
// output's stores take whole sectors.
// The accumulators into shared memory as a [BM][BN + 4] tile.
template <typename Config>
CG_DEVICE void cg_sgemm_stage_results(const cg_sgemm_accumulators<Config>& acc, float* smem) {
  constexpr int BM = Config::BM, BN = Config::BN, LD = BN + 4;
  const int tx = (int)threadIdx.x % (BN / 8), ty = (int)threadIdx.x / (BN / 8);
  __syncthreads();  // every thread is done reading the stages
  CG_UNROLL
  for (int i = 0; i < 8; ++i)
    CG_UNROLL
    for (int h = 0; h < 2; ++h) {
      cg_aligned_chunk<4, float> chunk;
      CG_UNROLL
      for (int j = 0; j < 4; ++j) chunk.v[j] = acc.v[i][4 * h + j];
      cg_shared_store_chunk(smem + cg_sgemm_patch<BM>(ty, i) * LD + cg_sgemm_patch<BN>(tx, 4 * h), chunk);
    }
  __syncthreads();
}

template <typename Config, typename F>
CG_DEVICE void cg_sgemm_each_coalesced(const cg_sgemm_accumulators<Config>& acc, cg_i64 M, cg_i64 N, cg_i64 tile_m,
                                       cg_i64 tile_n, float* smem, F f) {
  constexpr int BM = Config::BM, BN = Config::BN, LD = BN + 4;
  cg_sgemm_stage_results<Config>(acc, smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const cg_i64 m0 = tile_m * BM, n0 = tile_n * BN;
  for (int r = warp; r < BM; r += Config::THREADS / 32) {
    if (m0 + r >= M) break;
    CG_UNROLL
    for (int c = lane; c < BN; c += 32)
      if (n0 + c < N) f(m0 + r, n0 + c, smem[r * LD + c]);
  }
}

// cg_sgemm_each_coalesced with 16-byte stores: f(m, n, v) for W consecutive
// values from (m, n) (cg_staged_walk_vector; N a multiple of W).
template <typename Config, int W, typename F>
CG_DEVICE void cg_sgemm_each_coalesced_vector(const cg_sgemm_accumulators<Config>& acc, cg_i64 M, cg_i64 N,
                                              cg_i64 tile_m, cg_i64 tile_n, float* smem, F f) {
  cg_sgemm_stage_results<Config>(acc, smem);
  cg_staged_walk_vector<Config::BM, Config::BN, Config::THREADS, W>(smem, Config::BN + 4, M, N, tile_m * Config::BM,
                                                                   tile_n * Config::BN, f);
}
