// Transpose of the last two axes, an opaque block-level op: the block moves
// one 32 x 32 tile of x[batch][M][N] to out[batch][N][M] through shared memory,
// so that both the read and the write are coalesced. 256 threads; shared
// memory: 32 * 33 elements (the extra column avoids bank conflicts).
template <typename T>
CG_OP("transpose",
      "pattern: opaque",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S, M, N] -> out:[...S, N, M]",
      "smem: 32 * 33 * sizeof(T)",
      "doc: swap the last two axes (a block-level tiled transpose through shared memory)")
CG_DEVICE void cg_transpose_tile(const T* x, T* out, int M, int N, int tile_m, int tile_n, cg_i64 batch_offset,
                                 T* tile) {
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  for (int r = ty; r < 32; r += 8) {
    const int m = tile_m * 32 + r, n = tile_n * 32 + tx;
    if (m < M && n < N) tile[r * 33 + tx] = cg_load(x, batch_offset + (cg_i64)m * N + n);
  }
  __syncthreads();
  for (int r = ty; r < 32; r += 8) {
    const int n = tile_n * 32 + r, m = tile_m * 32 + tx;
    if (m < M && n < N) cg_store(out, batch_offset + (cg_i64)n * M + m, tile[tx * 33 + r]);
  }
}
