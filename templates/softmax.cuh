// Row softmax: the emitter runs one block per row and passes hooks that read
// x[row, j] and write out[row, j], where fusion can put a prologue or an
// epilogue. Columns j >= valid are masked (causal attention) and written as 0.
// Shared memory: 32 floats of reduction scratch.
template <typename Load, typename Store>
CG_DEVICE void cg_softmax_row(Load load, Store store, int n, float scale, int valid, float* scratch) {
  float row_max = cg_neg_inf();
  for (int j = threadIdx.x; j < valid; j += blockDim.x) row_max = fmaxf(row_max, scale * load(j));
  row_max = cg_block_max(row_max, scratch);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < valid; j += blockDim.x) sum += expf(scale * load(j) - row_max);
  const float inv_sum = 1.0f / cg_block_sum(sum, scratch);
  for (int j = threadIdx.x; j < n; j += blockDim.x)
    store(j, j < valid ? expf(scale * load(j) - row_max) * inv_sum : 0.0f);
}
