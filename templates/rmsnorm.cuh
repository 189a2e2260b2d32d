// RMS norm of one row, the emitter running one block per row:
//   out[j] = x[j] * rstd * weight[j],  rstd = 1 / sqrt(mean(x^2) + eps).
// Reads x through load(j) and weight through weight(j), writes through
// store(j, v); returns rstd, which the kernel exports for the backward pass.
// Shared memory: 32 floats of reduction scratch.
template <typename Load, typename Weight, typename Store>
CG_OP("rmsnorm",
      "pattern: reduction",
      "autocast: f32",
      "epilogue: out",
      "prologue: x",
      "rows: x",
      "norm: rms",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: weight weight T",
      "tensor: out output T",
      "tensor: rstd output f32 optional",
      "arg: eps float = 1e-06",
      "shape: x:[...S, N] weight:[N] -> out:[...S, N] rstd:[...S]",
      "backward: rmsnorm_backward",
      "smem: 128",
      "flops: 4 * numel(out)",
      "variant: cg_rmsnorm_stage_rows",
      "variant: cg_rmsnorm_rstd_rows",
      "doc: x * rsqrt(mean(x^2) + eps) * weight; exports rstd for backward")
CG_DEVICE float cg_rmsnorm_row(Load load, Weight weight, Store store, int n, float eps, float* scratch) {
  float sum_sq = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const float v = load(j);
    sum_sq += v * v;
  }
  const float rstd = rsqrtf(cg_block_sum(sum_sq, scratch) / (float)n + eps);
  for (int j = threadIdx.x; j < n; j += blockDim.x) store(j, load(j) * rstd * weight(j));
  return rstd;
}

// Rows [first, first + rows) of the norm's output, x * rstd * weight, in
// shared memory: staged[r * n + j] (zeros past `last`), the weight staged
// too (staged_weight, n floats), and each row's rstd where staged_rstd is not
// null: what a matmul that reads the norm's output as its left operand loads
// its tiles from (fuse.h, rule norm_prologue), so that the norm runs no
// kernel and each row is read once per block. One warp per row; load(row, j)
// reads x, weight(j) the weight. Every thread calls it; it ends with the
// block synchronised.
template <typename Load, typename Weight>
CG_DEVICE void cg_rmsnorm_stage_rows(Load load, Weight weight, cg_i64 first, int rows, cg_i64 last, int n, float eps,
                                     float* staged, float* staged_weight, float* staged_rstd) {
  for (int j = threadIdx.x; j < n; j += blockDim.x) staged_weight[j] = weight(j);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int r = warp; r < rows; r += warps) {
    float* row = staged + (cg_i64)r * n;
    float sum_sq = 0.0f;
    for (int j = lane; j < n; j += 32) {
      const float v = first + r < last ? load(first + r, j) : 0.0f;
      row[j] = v;
      sum_sq += v * v;
    }
    const float rstd = rsqrtf(cg_warp_sum(sum_sq) / (float)n + eps);
    for (int j = lane; j < n; j += 32) row[j] = row[j] * rstd * staged_weight[j];
    if (staged_rstd != nullptr && lane == 0) staged_rstd[r] = rstd;
  }
  __syncthreads();
}

// The rstd of `rows` consecutive rows of x, from `first` (fewer where the
// tensor ends at `last`), into rstd[0, rows): where the rows would not fit
// in shared memory, what such a matmul computes before its tile loop, its
// operand load then normalising each element itself. One warp per row, the block's
// warps taking rows in turn; load(row, j) reads x. Every thread calls it; it
// ends with the block synchronised, rstd visible to all.
template <typename Load>
CG_DEVICE void cg_rmsnorm_rstd_rows(Load load, cg_i64 first, int rows, cg_i64 last, int n, float eps, float* rstd) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int r = warp; r < rows; r += warps) {
    float sum_sq = 0.0f;
    if (first + r < last)
      for (int j = lane; j < n; j += 32) {
        const float v = load(first + r, j);
        sum_sq += v * v;
      }
    sum_sq = cg_warp_sum(sum_sq);
    if (lane == 0) rstd[r] = rsqrtf(sum_sq / (float)n + eps);
  }
  __syncthreads();
}

// The gradient of one row of rmsnorm with respect to x, given the rstd that
// forward exported:
//   dx[j] = rstd * (weight[j] * dout[j] - x[j] * rstd^2 * mean(weight * dout * x)).
// The emitter runs one block per row. The weight's gradient is a sum over
// rows, which the variant below computes in the same kernel's other blocks,
// 32 columns each, in a fixed order: without atomics, zeroing or run-to-run
// variation.
template <typename LoadX, typename Weight, typename LoadDout, typename StoreDx>
CG_OP("rmsnorm_backward",
      "pattern: reduction",
      "epilogue: dx",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: weight weight T",
      "tensor: rstd input f32",
      "tensor: dout input T",
      "tensor: dx output T",
      "tensor: dweight output f32",
      "shape: x:[...S, N] weight:[N] rstd:[...S] dout:[...S, N] -> dx:[...S, N] dweight:[N]",
      "forward: rmsnorm",
      "variant: cg_rmsnorm_backward_weight_column",
      "smem: 128",
      "doc: gradients of rmsnorm with respect to x and weight")
CG_DEVICE void cg_rmsnorm_backward_row(LoadX x, Weight weight, LoadDout dout, StoreDx store_dx, int n, float rstd,
                                       float* scratch) {
  float dot = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) dot += weight(j) * dout(j) * x(j);
  const float c = cg_block_sum(dot, scratch) / (float)n * rstd * rstd;
  for (int j = threadIdx.x; j < n; j += blockDim.x) store_dx(j, rstd * (weight(j) * dout(j) - x(j) * c));
}

// dweight[j] = sum over rows r of dout[r, j] * x[r, j] * rstd[r]; x(r) and
// dout(r) read the lane's column j, a column of 32 adjacent ones per block
// (false `active` past the last). The block's warps split the rows and
// cg_sum_over_warps adds their partials in a fixed order; every thread calls
// it, and the sum is valid in warp 0. Shared memory: blockDim.x floats.
template <typename LoadX, typename LoadDout, typename Rstd>
CG_DEVICE float cg_rmsnorm_backward_weight_column(LoadX x, LoadDout dout, Rstd rstd, bool active, cg_i64 rows,
                                                  float* scratch) {
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  float sum = 0.0f;
  if (active)
    for (cg_i64 r = warp; r < rows; r += warps) sum += dout(r) * x(r) * rstd(r);
  return cg_sum_over_warps(sum, scratch);
}
