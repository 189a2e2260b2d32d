// RMS norm of one row, the emitter running one block per row:
//   out[j] = x[j] * rstd * weight[j],  rstd = 1 / sqrt(mean(x^2) + eps).
// Reads x through load(j) and weight through weight(j), writes through
// store(j, v); returns rstd, which the kernel exports for the backward pass.
// Shared memory: 32 floats of reduction scratch.
template <typename Load, typename Weight, typename Store>
CG_OP("rmsnorm",
      "pattern: reduction",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: weight weight T",
      "tensor: out output T",
      "tensor: rstd output f32 optional",
      "arg: eps float = 1e-06",
      "shape: x:[...S, N] weight:[N] -> out:[...S, N] rstd:[...S]",
      "backward: rmsnorm_backward",
      "smem: 128",
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

// The gradients of one row of rmsnorm, given the rstd that forward exported:
//   dx[j] = rstd * (weight[j] * dout[j] - x[j] * rstd^2 * mean(weight * dout * x)),
//   dweight[j] += dout[j] * x[j] * rstd   (summed over rows through add_dweight).
template <typename LoadX, typename Weight, typename LoadDout, typename StoreDx, typename AddDweight>
CG_OP("rmsnorm_backward",
      "pattern: reduction",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: weight weight T",
      "tensor: rstd input f32",
      "tensor: dout input T",
      "tensor: dx output T",
      "tensor: dweight output f32",
      "shape: x:[...S, N] weight:[N] rstd:[...S] dout:[...S, N] -> dx:[...S, N] dweight:[N]",
      "forward: rmsnorm",
      "smem: 128",
      "doc: gradients of rmsnorm with respect to x and weight")
CG_DEVICE void cg_rmsnorm_backward_row(LoadX x, Weight weight, LoadDout dout, StoreDx store_dx, AddDweight add_dweight,
                                       int n, float rstd, float* scratch) {
  float dot = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) dot += weight(j) * dout(j) * x(j);
  const float c = cg_block_sum(dot, scratch) / (float)n * rstd * rstd;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    store_dx(j, rstd * (weight(j) * dout(j) - x(j) * c));
    add_dweight(j, dout(j) * x(j) * rstd);
  }
}
