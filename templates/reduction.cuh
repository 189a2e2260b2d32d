// Row reductions over the last axis: the emitter runs one block per row and
// reads x[row, j] through load(j); every thread gets the result, and the
// kernel stores it once. Shared memory: 32 floats of reduction scratch.

template <typename Load>
CG_OP("sum",
      "pattern: reduction",
      "autocast: f32",
      "prologue: x",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S, N] -> out:[...S]",
      "backward: sum_backward",
      "smem: 128",
      "flops: numel(x)",
      "doc: sum over the last axis")
CG_DEVICE float cg_sum_row(Load load, int n, float* scratch) {
  float s = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) s += load(j);
  return cg_block_sum(s, scratch);
}

template <typename Load>
CG_OP("mean",
      "pattern: reduction",
      "autocast: f32",
      "prologue: x",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S, N] -> out:[...S]",
      "backward: mean_backward",
      "smem: 128",
      "flops: numel(x)",
      "doc: mean over the last axis")
CG_DEVICE float cg_mean_row(Load load, int n, float* scratch) {
  return cg_sum_row(load, n, scratch) / (float)n;
}

template <typename Load>
CG_OP("max",
      "pattern: reduction",
      "prologue: x",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S, N] -> out:[...S]",
      "backward: max_backward",
      "smem: 128",
      "doc: max over the last axis")
CG_DEVICE float cg_max_row(Load load, int n, float* scratch) {
  float m = cg_neg_inf();
  for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, load(j));
  return cg_block_max(m, scratch);
}

// log(sum(exp(x))) of a row, as max + log(sum(exp(x - max))) so that no
// exp overflows; every thread gets it.
template <typename Load>
CG_DEVICE float cg_log_sum_exp_row(Load load, int n, float* scratch) {
  const float row_max = cg_max_row(load, n, scratch);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) sum += expf(load(j) - row_max);
  return row_max + logf(cg_block_sum(sum, scratch));
}

// log softmax of a row, written through store(j, v): x - max - log(sum(exp(x - max))).
template <typename Load, typename Store>
CG_OP("log_softmax",
      "pattern: reduction",
      "autocast: f32",
      "epilogue: out",
      "prologue: x",
      "rows: x",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S, N] -> out:[...S, N]",
      "backward: log_softmax_backward",
      "smem: 128",
      "flops: 5 * numel(out)",
      "doc: log of softmax over the last axis")
CG_DEVICE void cg_log_softmax_row(Load load, Store store, int n, float* scratch) {
  const float lse = cg_log_sum_exp_row(load, n, scratch);
  for (int j = threadIdx.x; j < n; j += blockDim.x) store(j, load(j) - lse);
}

// Sum over every axis but the last (the gradient of a broadcast bias). A
// block takes 32 adjacent columns: lane l of every warp reads column
// (32 * blockIdx.x + l), so each warp's reads are one coalesced row segment,
// and warp w sums rows w, w + W, w + 2W, ... (W warps); cg_sum_over_warps
// adds the partials in a fixed order. A tall input (a bias gradient over
// batch x tokens rows) so keeps W times more threads busy than one thread
// per column would. Every thread calls it; the sum is valid in warp 0.
// Shared memory: blockDim.x floats.
template <typename Load>
CG_OP("sum_leading",
      "pattern: reduction",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S, N] -> out:[N]",
      "backward: sum_leading_backward",
      "smem: 4 * 256",
      "flops: numel(x)",
      "doc: sum over every axis but the last (the gradient of a broadcast bias)")
CG_DEVICE float cg_sum_leading_column(Load load, cg_i64 column, cg_i64 columns, cg_i64 rows, float* scratch) {
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  float s = 0.0f;
  if (column < columns)
    for (cg_i64 r = warp; r < rows; r += warps) s += load(r, column);
  return cg_sum_over_warps(s, scratch);
}

// The gradient of a row of log_softmax, from its output:
//   dx[j] = dout[j] - exp(out[j]) * sum_k dout[k].
template <typename LoadOut, typename LoadDout, typename Store>
CG_OP("log_softmax_backward",
      "pattern: reduction",
      "epilogue: dx",
      "rows: out",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: out input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: out:[...S, N] dout:[...S, N] -> dx:[...S, N]",
      "forward: log_softmax",
      "smem: 128",
      "doc: dx = dout - exp(out) * sum(dout)")
CG_DEVICE void cg_log_softmax_backward_row(LoadOut out, LoadDout dout, Store store, int n, float* scratch) {
  float sum = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) sum += dout(j);
  sum = cg_block_sum(sum, scratch);
  for (int j = threadIdx.x; j < n; j += blockDim.x) store(j, dout(j) - expf(out(j)) * sum);
}

// The gradients of the row reductions. A sum hands each element of the row
// the row's gradient, a mean the same divided by the row's length: the
// emitter runs a grid-stride loop over dx and passes dout[row] and n.
template <typename T>
CG_OP("sum_backward",
      "pattern: reduction",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: dout:[...S] -> dx:[...S, N]",
      "forward: sum",
      "doc: dx[..., j] = dout[...]")
CG_DEVICE T cg_sum_backward(T dout, int n) {
  (void)n;
  return dout;
}

template <typename T>
CG_OP("mean_backward",
      "pattern: reduction",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: dout:[...S] -> dx:[...S, N]",
      "forward: mean",
      "doc: dx[..., j] = dout[...] / N")
CG_DEVICE T cg_mean_backward(T dout, int n) {
  return dout / T(n);
}

// The gradient of a row max goes to the elements equal to the max, split
// evenly between ties (as torch.amax's). One block per row; out is the
// forward's max, which is one of the row's values, so == is exact.
template <typename LoadX, typename Store>
CG_OP("max_backward",
      "pattern: reduction",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: x:[...S, N] out:[...S] dout:[...S] -> dx:[...S, N]",
      "forward: max",
      "smem: 128",
      "doc: dx = dout / ties where x equals the row max, else 0")
CG_DEVICE void cg_max_backward_row(LoadX x, Store store, int n, float row_max, float dout, float* scratch) {
  float ties = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) ties += x(j) == row_max ? 1.0f : 0.0f;
  const float share = dout / cg_block_sum(ties, scratch);
  for (int j = threadIdx.x; j < n; j += blockDim.x) store(j, x(j) == row_max ? share : 0.0f);
}

// The gradient of sum_leading: dout, broadcast back over the leading axes.
template <typename T>
CG_OP("sum_leading_backward",
      "pattern: broadcast",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: dout:[N] -> dx:[...S, N]",
      "forward: sum_leading",
      "doc: dx[..., j] = dout[j]")
CG_DEVICE T cg_sum_leading_backward(T dout) {
  return dout;
}
