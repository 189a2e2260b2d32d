// Layer norm of one row, the emitter running one block per row:
//   out[j] = (x[j] - mean) * rstd * weight[j] + bias[j],  rstd = 1 / sqrt(var + eps),
// with the variance of the row about its mean (two passes, so no
// cancellation). Returns mean and rstd, which the kernel exports for the
// backward pass. Shared memory: 32 floats of reduction scratch.
struct cg_row_stats {
  float mean;
  float rstd;
};

template <typename Load, typename Weight, typename Bias, typename Store>
CG_OP("layernorm",
      "pattern: reduction",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: weight weight T",
      "tensor: bias weight T",
      "tensor: out output T",
      "tensor: mean output f32 optional",
      "tensor: rstd output f32 optional",
      "arg: eps float = 1e-05",
      "shape: x:[...S, N] weight:[N] bias:[N] -> out:[...S, N] mean:[...S] rstd:[...S]",
      "smem: 128",
      "doc: (x - mean) * rstd * weight + bias; exports mean and rstd for backward")
CG_DEVICE cg_row_stats cg_layernorm_row(Load load, Weight weight, Bias bias, Store store, int n, float eps,
                                        float* scratch) {
  float sum = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) sum += load(j);
  const float mean = cg_block_sum(sum, scratch) / (float)n;
  float sum_sq = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const float d = load(j) - mean;
    sum_sq += d * d;
  }
  const float rstd = rsqrtf(cg_block_sum(sum_sq, scratch) / (float)n + eps);
  for (int j = threadIdx.x; j < n; j += blockDim.x) store(j, (load(j) - mean) * rstd * weight(j) + bias(j));
  cg_row_stats stats;
  stats.mean = mean;
  stats.rstd = rstd;
  return stats;
}
