// RMS norm of one row, the emitter running one block per row:
//   out[j] = x[j] * rstd * weight[j],  rstd = 1 / sqrt(mean(x^2) + eps).
// Reads x through load(j) and weight through weight(j), writes through
// store(j, v); returns rstd, which the kernel exports for the backward pass.
// Shared memory: 32 floats of reduction scratch.
template <typename Load, typename Weight, typename Store>
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
