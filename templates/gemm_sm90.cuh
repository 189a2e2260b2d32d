// The Hopper GEMM mainloop (sm_90a; docs/gemm.md "The Hopper path"):
// persistent blocks compute the BM x BN tiles of D = A B with f32
// accumulation, a block its share of them one after another, A
// (M x K) K-contiguous, B (K x N) N-contiguous or, stored as B^T (N x K),
// K-contiguous; 16-bit (f16, bf16):
//   - warp specialised: warpgroup 0 is the producer (one thread issues the
//     copies; the warpgroup gives most of its registers back with
//     setmaxnreg), the others (one or two) are the consumers, 64 rows of the
//     tile each, their accumulators in registers;
//   - operands by TMA (cp.async.bulk.tensor), 64 k x BM rows of A and
//     x BN of B per k-tile into STAGES shared stages written with the
//     128-byte swizzle (an N-contiguous B as boxes of 64 k x 64 columns),
//     completing on the stage's "full" mbarrier with the box's bytes
//     (out-of-bounds elements are zeros, and count);
//   - products by wgmma m64nBNk16 (BN 128, 192 or 256), both operands read from shared memory
//     through descriptors, one group in flight: a consumer releases a stage
//     (its "empty" mbarrier) once the wgmma that read it has completed;
//   - results through shared memory, each warp its own 16 rows, a chunk of
//     columns at a time, so that the epilogue's loads and stores are a
//     warp's consecutive columns;
//   - persistent: a block per SM slot, each looping over tiles (every
//     gridDim-th, in cg_gemm_tile_of's bands of 8 tile rows), the pipeline's stages and parities
//     running on from one tile to the next, so the producer loads the next
//     tile's first k-tiles while the consumers store the last one's results;
//     where asked (tiles of 128 columns) and the tiles leave the last wave
//     partly empty, stream-K: the last tiles' k-tiles dealt out evenly,
//     partial tiles added in k order (cg_sm90_schedule).
// The swizzle's pattern follows address bits, so every stage starts on a
// 1024-byte boundary of the .shared window: the kernel rounds its dynamic
// shared memory up to one (1 KiB of slack in cg_sm90_gemm_config).
//
// sm_90a only: wgmma and setmaxnreg are in no other target's instruction
// set (__CUDA_ARCH_FEAT_SM90_ALL; __CUDA_ARCH__ is 900 for sm_90 too). The
// mbarrier and TMA wrappers need sm_90. Compiled for any other target the
// kernel traps; the generator never launches it there (generator/arch.h).

// A CUtensorMap: 128 opaque bytes, made on the host (cuTensorMapEncodeTiled;
// in the emulation cudagen_emu::encode_tensor_map_2d) and passed by value as
// a __grid_constant__ kernel parameter, which the copy reads in place.
struct __align__(64) cg_tensor_map {
  unsigned long long opaque[16];
};

// ---------------------------------------------------------------------------
// mbarrier: a phase completes when its arrivals and its transaction bytes
// have all come; a wait names the parity of the phase it waits for.

CG_DEVICE void cg_mbarrier_init(unsigned long long* bar, unsigned int arrivals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(cg_smem_address(bar)), "r"(arrivals));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::mbarrier_init(bar, arrivals);
#else
  (void)bar, (void)arrivals;
#endif
}

// Makes this thread's mbarrier.init visible to the async proxy (the TMA
// copies that complete on the barriers) before the block's barrier.
CG_DEVICE void cg_fence_barrier_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// One arrival, after adding `bytes` to the transactions the phase waits for.
CG_DEVICE void cg_mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(cg_smem_address(bar)), "r"(bytes));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::mbarrier_expect_tx(bar, bytes);
  cudagen_emu::mbarrier_arrive(bar);
#else
  (void)bar, (void)bytes;
#endif
}

CG_DEVICE void cg_mbarrier_arrive(unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(cg_smem_address(bar)));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::mbarrier_arrive(bar);
#else
  (void)bar;
#endif
}

// Until the phase of parity `parity` has completed (try_wait suspends the
// thread for a while in hardware; the loop covers its time-outs).
CG_DEVICE void cg_mbarrier_wait(unsigned long long* bar, unsigned int parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned int address = cg_smem_address(bar);
  unsigned int done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (!done);
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::mbarrier_wait(bar, parity);
#else
  (void)bar, (void)parity;
#endif
}

// ---------------------------------------------------------------------------
// TMA: the box at element (x, y) (x the contiguous axis) of `map`'s tensor
// into shared memory at `dst`, completing on `bar` with the box's bytes.
CG_DEVICE void cg_tma_load_2d(void* dst, const cg_tensor_map* map, int x, int y, unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          cg_smem_address(dst)),
      "l"((unsigned long long)map), "r"(x), "r"(y), "r"(cg_smem_address(bar))
      : "memory");
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::tma_load_2d(dst, map, x, y, bar);
#else
  (void)dst, (void)map, (void)x, (void)y, (void)bar;
#endif
}

// The box at (x, y) of plane z of a 3-D map (a plane of the tensor a head:
// flash attention's q, k and v), rows past the plane's height zeros.
CG_DEVICE void cg_tma_load_3d(void* dst, const cg_tensor_map* map, int x, int y, int z, unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          cg_smem_address(dst)),
      "l"((unsigned long long)map), "r"(x), "r"(y), "r"(z), "r"(cg_smem_address(bar))
      : "memory");
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::tma_load_3d(dst, map, x, y, z, bar);
#else
  (void)dst, (void)map, (void)x, (void)y, (void)z, (void)bar;
#endif
}

// ---------------------------------------------------------------------------
// wgmma. A shared-memory operand's descriptor: a tile of 16-bit elements
// written with the 128-byte swizzle (rows of 128 bytes in 1024-byte groups
// of 8), from shared address `address`. K-major (rows along M or N, k
// contiguous): the next 8 rows are `stride` bytes on, `leading` is unused,
// and a k step within the 128 bytes moves the start (the swizzle follows
// the address). N-major (rows along k, 64 columns each): the next 8 k are
// `stride` bytes on, the next 64 columns `leading` bytes.
CG_DEVICE unsigned long long cg_wgmma_descriptor_128b(unsigned int address, unsigned int leading = 16,
                                                      unsigned int stride = 1024) {
  return (unsigned long long)((address & 0x3ffffu) >> 4)         // start address, in 16-byte units
         | ((unsigned long long)((leading >> 4) & 0x3fffu) << 16)  // leading byte offset
         | ((unsigned long long)((stride >> 4) & 0x3fffu) << 32)   // stride byte offset
         | (1ull << 62);                                            // the 128-byte swizzle
}

// Orders this thread's accumulator and A registers before the wgmmas that
// read or write them: each batch (commit group) starts with one.
CG_DEVICE void cg_wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma_fence();
#endif
}

CG_DEVICE void cg_wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma_commit();
#endif
}

// Until at most N committed groups are still in flight.
template <int N>
CG_DEVICE void cg_wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma_wait(N);
#endif
}

// Keeps the compiler from moving a read of the accumulators (N of them)
// across the wgmma.wait_group before it: their registers are no memory, so
// the wait's memory clobber does not order them (CUTLASS's
// warpgroup_fence_operand).
template <int N>
CG_DEVICE void cg_wgmma_fence_operands(float* d) {
#if defined(__CUDA_ARCH__)
  CG_UNROLL
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
#else
  (void)d;
#endif
}

// d (N / 2 floats a thread) += A (64 x 16) B (16 x N), or = where scale_d
// is 0: the warpgroup's m64nNk16 for N of 32 (the Hopper flash backward's
// steps over heads of 128), 64, 128, 192 or 256, A K-major, B K-major or
// (TRANS_B) N-major. Thread t of the warpgroup holds rows
// 16 (t / 32) + (t % 32) / 4 and 8 more, columns 8 j + 2 (t % 4) + {0, 1}:
// d[4 j + 2 h + e] is (row + 8 h, column 8 j + 2 (t % 4) + e). The asm
// lists the N / 2 accumulators, then the descriptors, scale-d (as a
// predicate) and TRANS_B. (Written out, not through a macro: the indexer
// copies a macro only where the host's parse sees it expanded, and these
// expand for sm_90a alone.)

template <int TRANS_B>
CG_DEVICE void cg_wgmma_m64n32k16(float d[16], unsigned long long desc_a, unsigned long long desc_b, int scale_d,
                                  cg_bf16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, p, 1, 1, 0, %19;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma(d, 32, desc_a, desc_b, scale_d != 0, true, TRANS_B != 0);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_m64n32k16(float d[16], unsigned long long desc_a, unsigned long long desc_b, int scale_d,
                                  cg_f16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, p, 1, 1, 0, %19;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma(d, 32, desc_a, desc_b, scale_d != 0, false, TRANS_B != 0);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_m64n64k16(float d[32], unsigned long long desc_a, unsigned long long desc_b, int scale_d,
                                  cg_bf16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, %35;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma(d, 64, desc_a, desc_b, scale_d != 0, true, TRANS_B != 0);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_m64n64k16(float d[32], unsigned long long desc_a, unsigned long long desc_b, int scale_d,
                                  cg_f16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, %35;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma(d, 64, desc_a, desc_b, scale_d != 0, false, TRANS_B != 0);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_m64n128k16(float d[64], unsigned long long desc_a, unsigned long long desc_b, int scale_d,
                                   cg_bf16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, %67;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma(d, 128, desc_a, desc_b, scale_d != 0, true, TRANS_B != 0);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_m64n128k16(float d[64], unsigned long long desc_a, unsigned long long desc_b, int scale_d,
                                   cg_f16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, %67;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma(d, 128, desc_a, desc_b, scale_d != 0, false, TRANS_B != 0);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_m64n192k16(float d[96], unsigned long long desc_a, unsigned long long desc_b, int scale_d,
                                   cg_bf16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %98, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
      "%96, %97, p, 1, 1, 0, %99;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma(d, 192, desc_a, desc_b, scale_d != 0, true, TRANS_B != 0);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_m64n192k16(float d[96], unsigned long long desc_a, unsigned long long desc_b, int scale_d,
                                   cg_f16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %98, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
      "%96, %97, p, 1, 1, 0, %99;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma(d, 192, desc_a, desc_b, scale_d != 0, false, TRANS_B != 0);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_m64n256k16(float d[128], unsigned long long desc_a, unsigned long long desc_b, int scale_d,
                                   cg_bf16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, 0, %131;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma(d, 256, desc_a, desc_b, scale_d != 0, true, TRANS_B != 0);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_m64n256k16(float d[128], unsigned long long desc_a, unsigned long long desc_b, int scale_d,
                                   cg_f16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, 0, %131;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma(d, 256, desc_a, desc_b, scale_d != 0, false, TRANS_B != 0);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
#endif
}

// The wgmma of a tile N columns wide.
template <int N, int TRANS_B, typename T>
CG_DEVICE void cg_wgmma_m64k16(float* d, unsigned long long desc_a, unsigned long long desc_b, int scale_d) {
  static_assert(N == 32 || N == 64 || N == 128 || N == 192 || N == 256, "wgmma tiles of 32, 64, 128, 192 or 256 columns");
  if constexpr (N == 32) cg_wgmma_m64n32k16<TRANS_B>(d, desc_a, desc_b, scale_d, T());
  else if constexpr (N == 64) cg_wgmma_m64n64k16<TRANS_B>(d, desc_a, desc_b, scale_d, T());
  else if constexpr (N == 128) cg_wgmma_m64n128k16<TRANS_B>(d, desc_a, desc_b, scale_d, T());
  else if constexpr (N == 192) cg_wgmma_m64n192k16<TRANS_B>(d, desc_a, desc_b, scale_d, T());
  else cg_wgmma_m64n256k16<TRANS_B>(d, desc_a, desc_b, scale_d, T());
}

// d (N / 2 floats a thread) += A (64 x 16) B (16 x N), or = where scale_d
// is 0, with A in the warpgroup's registers (flash attention's
// probabilities, never written to shared memory): each warp's 16 rows,
// thread (g, c) = (lane / 4, lane % 4) holding a[0] = rows g at k 2c and
// 2c + 1, a[1] = row g + 8 at those k, a[2] and a[3] the same at k 2c + 8
// and 2c + 9 (mma.sync's A fragment; the first of a pair in the low half).
// B from shared memory as for the other form; N of 64, 128, 192 or 256.

template <int TRANS_B>
CG_DEVICE void cg_wgmma_rs_m64n64k16(float d[32], const unsigned int a[4], unsigned long long desc_b, int scale_d,
                                    cg_bf16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma_rs(d, 64, a, desc_b, scale_d != 0, true, TRANS_B != 0);
#else
  (void)d, (void)a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_rs_m64n64k16(float d[32], const unsigned int a[4], unsigned long long desc_b, int scale_d,
                                    cg_f16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma_rs(d, 64, a, desc_b, scale_d != 0, false, TRANS_B != 0);
#else
  (void)d, (void)a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_rs_m64n128k16(float d[64], const unsigned int a[4], unsigned long long desc_b, int scale_d,
                                     cg_bf16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma_rs(d, 128, a, desc_b, scale_d != 0, true, TRANS_B != 0);
#else
  (void)d, (void)a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_rs_m64n128k16(float d[64], const unsigned int a[4], unsigned long long desc_b, int scale_d,
                                     cg_f16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma_rs(d, 128, a, desc_b, scale_d != 0, false, TRANS_B != 0);
#else
  (void)d, (void)a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_rs_m64n192k16(float d[96], const unsigned int a[4], unsigned long long desc_b, int scale_d,
                                     cg_bf16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %101, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
      "{%96, %97, %98, %99}, %100, p, 1, 1, %102;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma_rs(d, 192, a, desc_b, scale_d != 0, true, TRANS_B != 0);
#else
  (void)d, (void)a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_rs_m64n192k16(float d[96], const unsigned int a[4], unsigned long long desc_b, int scale_d,
                                     cg_f16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %101, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
      "{%96, %97, %98, %99}, %100, p, 1, 1, %102;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma_rs(d, 192, a, desc_b, scale_d != 0, false, TRANS_B != 0);
#else
  (void)d, (void)a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_rs_m64n256k16(float d[128], const unsigned int a[4], unsigned long long desc_b, int scale_d,
                                     cg_bf16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "{%128, %129, %130, %131}, %132, p, 1, 1, %134;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma_rs(d, 256, a, desc_b, scale_d != 0, true, TRANS_B != 0);
#else
  (void)d, (void)a, (void)desc_b, (void)scale_d;
#endif
}

template <int TRANS_B>
CG_DEVICE void cg_wgmma_rs_m64n256k16(float d[128], const unsigned int a[4], unsigned long long desc_b, int scale_d,
                                     cg_f16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "{%128, %129, %130, %131}, %132, p, 1, 1, %134;\n"
      "}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#elif defined(CUDAGEN_EMULATION)
  cudagen_emu::wgmma_rs(d, 256, a, desc_b, scale_d != 0, false, TRANS_B != 0);
#else
  (void)d, (void)a, (void)desc_b, (void)scale_d;
#endif
}

// The register-A wgmma of a tile N columns wide.
template <int N, int TRANS_B, typename T>
CG_DEVICE void cg_wgmma_rs_m64k16(float* d, const unsigned int a[4], unsigned long long desc_b, int scale_d) {
  static_assert(N == 64 || N == 128 || N == 192 || N == 256, "register-A wgmma of 64, 128, 192 or 256 columns");
  if constexpr (N == 64) cg_wgmma_rs_m64n64k16<TRANS_B>(d, a, desc_b, scale_d, T());
  else if constexpr (N == 128) cg_wgmma_rs_m64n128k16<TRANS_B>(d, a, desc_b, scale_d, T());
  else if constexpr (N == 192) cg_wgmma_rs_m64n192k16<TRANS_B>(d, a, desc_b, scale_d, T());
  else cg_wgmma_rs_m64n256k16<TRANS_B>(d, a, desc_b, scale_d, T());
}

// setmaxnreg: a warpgroup's registers per thread, given back (the producer)
// or taken (the consumers); the kernel must be launched with a register cap
// (__launch_bounds__(threads, 1)), or ptxas ignores it (warning C7508).
template <int REGISTERS>
CG_DEVICE void cg_setmaxnreg_dec() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
#endif
}
template <int REGISTERS>
CG_DEVICE void cg_setmaxnreg_inc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
#endif
}

// ---------------------------------------------------------------------------
// The mainloop's shape: tiles of 64 rows a consumer warpgroup by BN (128,
// 192 or 256) columns, 64-element k-tiles (one 128-byte swizzle row of
// 16-bit elements), STAGES of them in flight.
template <int STAGES_, int CONSUMERS_ = 2, int BN_ = 128>
struct cg_sm90_gemm_config {
  static constexpr int CONSUMERS = CONSUMERS_, BM = 64 * CONSUMERS, BN = BN_, BK = 64, STAGES = STAGES_;
  static_assert(BN == 128 || BN == 192 || BN == 256, "wgmma tiles of 128, 192 or 256 columns");
  static constexpr int THREADS = 128 * (1 + CONSUMERS);  // a producer warpgroup, then the consumers
  // Blocks an SM (the kernel's __launch_bounds__(THREADS, MIN_BLOCKS)), and
  // the registers setmaxnreg gives each consumer thread: the producer keeps
  // 40, and the blocks' threads share the SM's 65536.
  static constexpr int MIN_BLOCKS = CONSUMERS == 1 ? 2 : 1, CONSUMER_REGISTERS = CONSUMERS == 1 ? 208 : 232;
  static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
  // An N-major B's stage: 64-column chunks of BK rows of 128 bytes (the
  // swizzle's width), one TMA box each; wgmma's leading byte offset.
  static constexpr int B_CHUNK_BYTES = 64 * BK * 2;
  // The results leave a chunk of RESULT_COLUMNS columns at a time (all 128
  // of a 128-wide tile; 64 of wider ones, whose stages need the room): a
  // consumer warp's 16 rows of it, RESULT_COLUMNS + 8 floats apart, a row's
  // eight more banks keeping the warp's pairs of floats free of conflicts.
  static constexpr int RESULT_COLUMNS = BN == 128 ? 128 : 64, RESULT_ROW = RESULT_COLUMNS + 8,
                       RESULT_BYTES = CONSUMERS * 4 * 16 * RESULT_ROW * 4;
  // The stages from a 1024-byte boundary, a full and an empty barrier per
  // stage, then the results; 1 KiB of slack to round the start up.
  static constexpr int SHARED_BYTES = 1024 + STAGES * STAGE_BYTES + 2 * STAGES * 8 + RESULT_BYTES;
  // Stream-K (cg_sm90_schedule): a partial tile's sums cost about this many
  // k-tiles of an SM's time where two blocks share it (each stores its f32
  // tile, the last reads both back: three times the tile's bytes against a
  // k-tile's operand bytes, through the same L2): 6 for tiles of 128 rows, 4
  // for 64; a third more for each further contributor (cg_sm90_fixup_k_tiles).
  static constexpr int FIXUP_K_TILES = (3 * BM * BN * 4 + STAGE_BYTES - 1) / STAGE_BYTES;
};

// Where a pipeline is in its ring of stages: the stage the next k-tile
// takes, and the parity of that stage's round (its barriers' phase), both
// running on across tiles.
struct cg_sm90_pipeline_state {
  int stage;
  unsigned int phase;
  CG_DEVICE void advance(int stages) {
    if (++stage == stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// One piece of a block's work: k-tiles [k_begin, k_end) of tile `tile` (in
// cg_gemm_tile_of's order); the whole tile where they are all of its k-tiles.
struct cg_sm90_work {
  cg_i64 tile;
  int k_begin, k_end;
};

// Which tiles, and which of their k-tiles, each block of a persistent launch
// computes (docs/gemm.md "Stream-K"). Data-parallel, block b takes tiles b,
// b + grid, ... whole. Where the tiles leave the last wave partly empty (the
// decoder's down projection: 96 tiles of 64 rows for 132 SMs), stream-K
// takes the last tiles, those of the last full wave and the partial one (all
// the tiles, under two waves), and deals their k-tiles out evenly: block b
// computes the run [b I / grid, (b + 1) I / grid) of their I k-tiles, taken
// tile after tile. A tile whose k-tiles fall to several blocks is a partial
// tile of each; their sums are added in k order by whichever arrives last
// (cg_sm90_stream_k_rows), so the result does not depend on timing. Chosen
// where it is shorter for the busiest SM: the stream-K tiles' k-tiles shared
// by all SMs plus the fix-up (cg_sm90_fixup_k_tiles), against whole tiles a
// block each (HopperGemm::stream_k_tiles in kernels.cpp is the same rule, for
// the generator). Never on a grid over `max_grid`, the workspace's.
// A block's run holds at most two partial tiles, its first and its last: each
// has a slot of partial sums, 2 block + (0 for the first, 1 for the last).
// The fix-up's cost in k-tiles where `sk_k_tiles` k-tiles of tiles of
// `k_tiles` are dealt to `grid` blocks: the last block to arrive at a tile
// reads every contributor's sums, about k_tiles / (a block's run) + 1 of them.
CG_DEVICE cg_i64 cg_sm90_fixup_k_tiles(cg_i64 sk_k_tiles, int k_tiles, cg_i64 grid, int fixup_k_tiles) {
  const cg_i64 run = sk_k_tiles / grid > 0 ? sk_k_tiles / grid : 1;
  const cg_i64 contributors = (k_tiles + run - 1) / run + 1;
  return (fixup_k_tiles * (1 + contributors) + 2) / 3;
}

struct cg_sm90_schedule {
  cg_i64 tiles, dp_tiles, sk_k_tiles, block, grid;
  int k_tiles;
  cg_i64 next_tile;    // the next data-parallel tile
  cg_i64 cursor, end;  // this block's stream-K k-tiles left, counted over the stream-K tiles

  CG_DEVICE cg_sm90_schedule(cg_i64 tiles_, int k_tiles_, cg_i64 block_, cg_i64 grid_, int blocks_per_sm,
                             int fixup_k_tiles, cg_i64 max_grid)
      : tiles(tiles_), dp_tiles(tiles_), sk_k_tiles(0), block(block_), grid(grid_), k_tiles(k_tiles_),
        next_tile(block_), cursor(0), end(0) {
    if (grid <= max_grid && k_tiles > 1 && tiles % grid != 0) {
      const cg_i64 sms = grid / blocks_per_sm > 0 ? grid / blocks_per_sm : 1, waves = tiles / grid;
      const cg_i64 sk_tiles = waves >= 2 ? tiles - (waves - 1) * grid : tiles;
      const cg_i64 whole = (sk_tiles + sms - 1) / sms * k_tiles,
                   shared = (sk_tiles * k_tiles + sms - 1) / sms +
                            cg_sm90_fixup_k_tiles(sk_tiles * k_tiles, k_tiles, grid, fixup_k_tiles);
      if (shared < whole) {
        dp_tiles = tiles - sk_tiles;
        sk_k_tiles = sk_tiles * k_tiles;
        cursor = first_k_tile(block);
        end = first_k_tile(block + 1);
      }
    }
  }
  // The first of block b's stream-K k-tiles (grid: the end of the last's).
  CG_DEVICE cg_i64 first_k_tile(cg_i64 b) const { return b * sk_k_tiles / grid; }
  // The block whose run holds stream-K k-tile i: the last b with
  // first_k_tile(b) <= i (blocks before it with empty runs hold none).
  CG_DEVICE cg_i64 owner(cg_i64 i) const { return ((i + 1) * grid + sk_k_tiles - 1) / sk_k_tiles - 1; }
  // Whether block b has a run (with fewer k-tiles than blocks, some have none).
  CG_DEVICE bool has_run(cg_i64 b) const { return first_k_tile(b) < first_k_tile(b + 1); }
  CG_DEVICE bool whole(const cg_sm90_work& w) const { return w.k_begin == 0 && w.k_end == k_tiles; }
  // Block b's slot of partial sums for stream-K tile `tile`.
  CG_DEVICE cg_i64 slot(cg_i64 b, cg_i64 tile) const {
    return 2 * b + (dp_tiles + first_k_tile(b) / k_tiles == tile ? 0 : 1);
  }
  // This block's next piece of work, or false when it has none left.
  CG_DEVICE bool next(cg_sm90_work* w) {
    if (next_tile < dp_tiles) {
      w->tile = next_tile;
      w->k_begin = 0;
      w->k_end = k_tiles;
      next_tile += grid;
      return true;
    }
    if (cursor >= end) return false;
    const cg_i64 t = cursor / k_tiles;
    w->tile = dp_tiles + t;
    w->k_begin = (int)(cursor - t * k_tiles);
    w->k_end = end - cursor < (cg_i64)(k_tiles - w->k_begin) ? w->k_begin + (int)(end - cursor) : k_tiles;
    cursor += w->k_end - w->k_begin;
    return true;
  }
};

// Stream-K's workspace, for grids of up to `max_grid` blocks: `partials`,
// 2 max_grid slots of BM x BN floats (each consumer warp's 16 rows
// together), and `arrivals`, 2 max_grid counters a consumer warp (one per
// stream-K tile, fewer than two grids of them), zero before the first launch
// and left zero by each. {nullptr, nullptr, 0}: no stream-K, every tile whole.
struct cg_sm90_stream_k {
  float* partials;
  unsigned int* arrivals;
  cg_i64 max_grid;
};

// A warp's count-in at `counter`, one of `contributors`: whether it is the
// last to arrive (it then leaves the counter zero for the next launch). The
// lanes' stores before it are released with lane 0's arrival; the others'
// are acquired, visible to every lane through the warp barrier after it.
// Every lane of the warp calls it.
CG_DEVICE bool cg_warp_last_to_arrive(unsigned int* counter, unsigned int contributors) {
  __syncwarp();  // the lanes' stores made before lane 0 counts the warp in
  unsigned int before = 0;
  if ((threadIdx.x & 31) == 0) before = cg_arrive_acq_rel(counter);
  __syncwarp();
  before = __shfl_sync(0xffffffffu, before, 0);
  if (before + 1u != contributors) return false;
  if ((threadIdx.x & 31) == 0) *counter = 0u;  // every contributor has counted in: nothing else reads it in this launch
  return true;
}

// A consumer warp's 16 rows of a partial tile (`rows`, staged in shared
// memory): stored to its block's slot, then counted in at the tile's counter
// for these rows. The warp that arrives last adds every contributing block's
// rows in k order (the blocks' order) and hands each sum inside M x N to the
// epilogue, then leaves the counter zero. Warps count in apart: no block
// barrier, and the producer's loads of the next tile go on meanwhile.
template <typename Config, typename Epilogue>
CG_DEVICE void cg_sm90_stream_k_rows(const cg_sm90_schedule& s, const cg_sm90_work& w, const float* rows, int warp,
                                     cg_sm90_stream_k workspace, cg_i64 m0, cg_i64 n0, cg_i64 M, cg_i64 N,
                                     Epilogue& epilogue) {
  constexpr int WARPS = 4 * Config::CONSUMERS, ROWS = 16 * Config::BN;
  const int lane = threadIdx.x & 31;
  float* mine = workspace.partials + (s.slot(s.block, w.tile) * WARPS + warp) * ROWS;
  for (int r = 0; r < 16; ++r) {
    const cg_aligned_chunk<4, float> four = *reinterpret_cast<const cg_aligned_chunk<4, float>*>(
        rows + r * Config::RESULT_ROW + 4 * lane);
    cg_vector<4, float> v;
    for (int e = 0; e < 4; ++e) v.v[e] = four.v[e];
    cg_store_vector<4, float>(mine, r * Config::BN + 4 * lane, v);
  }
  const cg_i64 first_k = (w.tile - s.dp_tiles) * s.k_tiles;
  const cg_i64 first = s.owner(first_k), last = s.owner(first_k + s.k_tiles - 1);
  cg_i64 contributors = 0;
  for (cg_i64 b = first; b <= last; ++b) contributors += s.has_run(b);
  if (!cg_warp_last_to_arrive(workspace.arrivals + (w.tile - s.dp_tiles) * WARPS + warp, (unsigned int)contributors))
    return;
  // A contributor at a time (its slot found once), its rows' 64 values a
  // lane loaded together; each sum still in k order.
  float sums[16][Config::BN / 32];
  CG_UNROLL
  for (int r = 0; r < 16; ++r)
    CG_UNROLL
    for (int j = 0; j < Config::BN / 32; ++j) sums[r][j] = 0.0f;
  for (cg_i64 b = first; b <= last; ++b) {
    if (!s.has_run(b)) continue;
    const float* part = workspace.partials + (s.slot(b, w.tile) * WARPS + warp) * ROWS;
    CG_UNROLL
    for (int r = 0; r < 16; ++r)
      CG_UNROLL
      for (int j = 0; j < Config::BN / 32; ++j) sums[r][j] += cg_load_l2(part, r * Config::BN + 32 * j + lane);
  }
  for (int r = 0; r < 16; ++r) {
    if (m0 + r >= M) break;
    CG_UNROLL
    for (int j = 0; j < Config::BN / 32; ++j)
      if (n0 + 32 * j + lane < N) epilogue(m0 + r, n0 + 32 * j + lane, sums[r][j]);
  }
}

// Block `block` of `grid`'s tiles of D = A B (a persistent launch passes
// blockIdx.x and gridDim.x; any grid computes every tile): cg_sm90_schedule's
// pieces, tiles in cg_gemm_tile_of's order (bands of 8 tile rows, each column
// by column: the blocks running at once share rows of A and columns of B in
// L2); with STREAM_K and `stream_k`'s workspace (null pointers: none) the
// last tiles by stream-K where that pays and the grid is no larger than the
// workspace's. Without STREAM_K the fix-up is not compiled in: its registers
// (64 sums a lane) would make a heavy epilogue spill (a split-heads store). The maps, all with the
// 128-byte swizzle: A's K wide and M high, its box 64 x BM; B's, where
// B_K_MAJOR (B stored as B^T, N x K), K wide and N high with a 64 x BN
// box, else N wide and K high with a 64 x 64 box (BN / 64 of them a stage). Hands every element
// (m, n) with m < M and n < N to epilogue(m, n, d), a warp's lanes on
// consecutive columns.
template <typename Config, typename T, bool B_K_MAJOR, bool STREAM_K, typename Epilogue>
CG_DEVICE void cg_gemm_sm90(const cg_tensor_map* map_a, const cg_tensor_map* map_b, cg_i64 M, cg_i64 N, cg_i64 K,
                            cg_i64 block, cg_i64 grid, unsigned char* smem, cg_sm90_stream_k stream_k,
                            Epilogue epilogue) {
  // The fix-up reads a partial tile's rows as staged whole (one chunk of 128 columns).
  static_assert(!STREAM_K || Config::BN == 128, "stream-K on tiles of 128 columns");
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("trap;");  // no wgmma on this target: the generator never launches this kernel here
#else
  constexpr int S = Config::STAGES;
  const unsigned int base = (cg_smem_address(smem) + 1023u) & ~1023u;
  unsigned char* stages = cg_smem_pointer(base);
  unsigned long long* full = (unsigned long long*)(stages + S * Config::STAGE_BYTES);
  unsigned long long* empty = full + S;
  const int thread = threadIdx.x, warpgroup = thread / 128;
  if (thread == 0) {
    for (int s = 0; s < S; ++s) {
      cg_mbarrier_init(&full[s], 1);    // the producer's arrival, with the stage's bytes
      cg_mbarrier_init(&empty[s], 128 * Config::CONSUMERS);  // every consumer thread, once its wgmma read the stage
    }
    cg_fence_barrier_init();
  }
  __syncthreads();
  const cg_i64 tiles_m = (M + Config::BM - 1) / Config::BM, tiles_n = (N + Config::BN - 1) / Config::BN;
  const int k_tiles = (int)((K + Config::BK - 1) / Config::BK);
  // The producer and the consumers walk the same schedule.
  cg_sm90_schedule schedule(tiles_m * tiles_n, k_tiles, block, grid, Config::MIN_BLOCKS, Config::FIXUP_K_TILES,
                            STREAM_K && stream_k.partials != nullptr ? stream_k.max_grid : 0);
  cg_sm90_work work;
  if (warpgroup == 0) {
    cg_setmaxnreg_dec<40>();
    if (thread == 0) {
      cg_sm90_pipeline_state load = {0, 0u};
      while (schedule.next(&work)) {
        cg_i64 tile_m, tile_n;
        cg_gemm_tile_of(work.tile, tiles_m, tiles_n, 8, &tile_m, &tile_n);
        for (int kt = work.k_begin; kt < work.k_end; ++kt, load.advance(S)) {
          // Round r of a stage waits for the consumers' release of round r - 1
          // (the first round's wait returns at once: parity 1 of phase 0).
          cg_mbarrier_wait(&empty[load.stage], load.phase ^ 1u);
          cg_mbarrier_arrive_expect_tx(&full[load.stage], Config::STAGE_BYTES);
          unsigned char* stage = stages + load.stage * Config::STAGE_BYTES;
          cg_tma_load_2d(stage, map_a, kt * Config::BK, (int)(tile_m * Config::BM), &full[load.stage]);
          if (B_K_MAJOR) {
            cg_tma_load_2d(stage + Config::A_BYTES, map_b, kt * Config::BK, (int)(tile_n * Config::BN), &full[load.stage]);
          } else {  // 64-column chunks, 64 k rows each
            CG_UNROLL
            for (int c = 0; c < Config::BN / 64; ++c)
              cg_tma_load_2d(stage + Config::A_BYTES + c * Config::B_CHUNK_BYTES, map_b, (int)(tile_n * Config::BN) + 64 * c,
                             kt * Config::BK, &full[load.stage]);
          }
        }
      }
    }
    return;
  }
  cg_setmaxnreg_inc<Config::CONSUMER_REGISTERS>();
  const int consumer = warpgroup - 1;  // rows [64 consumer, 64 consumer + 64) of each tile
  const int t = thread % 128, warp = t / 32, lane = t % 32;
  float* rows = (float*)(stages + S * Config::STAGE_BYTES + 2 * S * 8) + (consumer * 4 + warp) * 16 * Config::RESULT_ROW;
  cg_sm90_pipeline_state read = {0, 0u};
  while (schedule.next(&work)) {
    cg_i64 tile_m, tile_n;
    cg_gemm_tile_of(work.tile, tiles_m, tiles_n, 8, &tile_m, &tile_n);
    // The accumulators start with the first wgmma (scale_d 0), not zeroed
    // before it: ptxas serialises every wgmma of a kernel whose accumulators
    // other instructions touch in a pipelined stage (C7514), and it counts the
    // copies of a zero into them.
    float d[Config::BN / 2];
    int in_flight = -1;  // the stage the group in flight reads
    const int pieces_k_tiles = work.k_end - work.k_begin;
    for (int kt = 0; kt < pieces_k_tiles; ++kt, read.advance(S)) {
      cg_mbarrier_wait(&full[read.stage], read.phase);
      const unsigned int a = base + (unsigned int)(read.stage * Config::STAGE_BYTES + consumer * 64 * 128),
                         b = base + (unsigned int)(read.stage * Config::STAGE_BYTES + Config::A_BYTES);
      cg_wgmma_fence();
      // A k step of 16: 32 bytes along a K-major row; two 8-row groups of an N-major B.
      CG_UNROLL
      for (int kk = 0; kk < Config::BK / 16; ++kk)
        cg_wgmma_m64k16<Config::BN, B_K_MAJOR ? 0 : 1, T>(
            d, cg_wgmma_descriptor_128b(a + 32 * kk),
            B_K_MAJOR ? cg_wgmma_descriptor_128b(b + 32 * kk)
                      : cg_wgmma_descriptor_128b(b + 2048 * kk, Config::B_CHUNK_BYTES, 1024),
            kt > 0 || kk > 0);
      cg_wgmma_commit();
      // The previous k-tile's group has completed: its stage goes back.
      cg_wgmma_wait<1>();
      if (in_flight >= 0) cg_mbarrier_arrive(&empty[in_flight]);
      in_flight = read.stage;
    }
    cg_wgmma_wait<0>();
    cg_wgmma_fence_operands<Config::BN / 2>(d);
    if (in_flight >= 0) {
      cg_mbarrier_arrive(&empty[in_flight]);
    } else {
      CG_UNROLL
      for (int i = 0; i < Config::BN / 2; ++i) d[i] = 0.0f;  // K = 0: a sum of no products
    }
    const cg_i64 m0 = (cg_i64)tile_m * Config::BM + 64 * consumer + 16 * warp, n0 = (cg_i64)tile_n * Config::BN;
    // A chunk of columns at a time: this warp's 16 rows of it into its own
    // part of shared memory (no other warp reads it: a warp barrier
    // suffices), then out a row at a time.
    constexpr int CHUNK = Config::RESULT_COLUMNS;
    CG_UNROLL
    for (int c = 0; c < Config::BN / CHUNK; ++c) {
      CG_UNROLL
      for (int j = 0; j < CHUNK / 8; ++j)
        CG_UNROLL
        for (int h = 0; h < 2; ++h) {
          // One 8-byte store (the layout keeps pairs 8-byte aligned).
          const int i = 4 * (c * CHUNK / 8 + j) + 2 * h;
          cg_aligned_chunk<2, float> pair = {{d[i], d[i + 1]}};
          *reinterpret_cast<cg_aligned_chunk<2, float>*>(rows + (lane / 4 + 8 * h) * Config::RESULT_ROW + 8 * j +
                                                         2 * (lane % 4)) = pair;
        }
      __syncwarp();
      const cg_i64 n_chunk = n0 + c * CHUNK;
      if (schedule.whole(work)) {
        for (int r = 0; r < 16; ++r) {
          if (m0 + r >= M) break;
          CG_UNROLL
          for (int j = 0; j < CHUNK / 32; ++j)
            if (n_chunk + 32 * j + lane < N)
              epilogue(m0 + r, n_chunk + 32 * j + lane, rows[r * Config::RESULT_ROW + 32 * j + lane]);
        }
      } else if constexpr (STREAM_K) {
        cg_sm90_stream_k_rows<Config>(schedule, work, rows, consumer * 4 + warp, stream_k, m0, n0, M, N, epilogue);
      }
      __syncwarp();  // every lane has read the rows before the next chunk's or tile's overwrite them
    }
  }
#endif
}
