// Row softmax: the emitter runs one block per row and passes hooks that read
// x[row, j] and write out[row, j], where fusion can put a prologue or an
// epilogue. Columns j >= valid are masked (causal attention) and written as 0.
// Shared memory: 32 floats of reduction scratch.
template <typename Load, typename Store>
CG_OP("softmax",
      "pattern: reduction",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "arg: scale float = 1.0",
      "arg: causal bool = false",
      "shape: x:[...S, N] -> out:[...S, N]",
      "backward: softmax_backward",
      "smem: 128",
      "flops: 5 * numel(out)",
      "doc: softmax(scale * x) over the last axis; causal masks column j > row i of the last two axes")
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

// The gradient of a row of softmax(scale * x), from its output:
//   dx[j] = scale * out[j] * (dout[j] - sum_k dout[k] * out[k]).
template <typename LoadOut, typename LoadDout, typename Store>
CG_OP("softmax_backward",
      "pattern: reduction",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: out input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "arg: scale float = 1.0",
      "shape: out:[...S, N] dout:[...S, N] -> dx:[...S, N]",
      "forward: softmax",
      "smem: 128",
      "doc: dx = scale * out * (dout - sum(dout * out))")
CG_DEVICE void cg_softmax_backward_row(LoadOut out, LoadDout dout, Store store, int n, float scale, float* scratch) {
  float dot = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) dot += out(j) * dout(j);
  dot = cg_block_sum(dot, scratch);
  for (int j = threadIdx.x; j < n; j += blockDim.x) store(j, scale * out(j) * (dout(j) - dot));
}
