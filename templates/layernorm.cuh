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
      "autocast: f32",
      "epilogue: out",
      "prologue: x",
      "rows: x",
      "norm: layer",
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
      "backward: layernorm_backward",
      "variant: cg_layernorm_stage_rows",
      "variant: cg_layernorm_stats_rows",
      "flops: 7 * numel(out)",
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

// Rows [first, first + rows) of the norm's output in shared memory,
// staged[r * n + j] (zeros past `last`), with the weight and bias staged too
// (staged_params: n floats each) and, where staged_stats is not null, each
// row's mean and rstd (staged_stats[r], staged_stats[rows + r]): what a
// matmul that reads the norm's output as its left operand loads its tiles
// from (fuse.h, rule norm_prologue). One warp per row, the variance about
// the mean in a second pass as cg_layernorm_row computes it. Every thread
// calls it; it ends with the block synchronised.
template <typename Load, typename Weight, typename Bias>
CG_DEVICE void cg_layernorm_stage_rows(Load load, Weight weight, Bias bias, cg_i64 first, int rows, cg_i64 last,
                                       int n, float eps, float* staged, float* staged_params, float* staged_stats) {
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    staged_params[j] = weight(j);
    staged_params[n + j] = bias(j);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int r = warp; r < rows; r += warps) {
    float* row = staged + (cg_i64)r * n;
    float sum = 0.0f;
    for (int j = lane; j < n; j += 32) {
      const float v = first + r < last ? load(first + r, j) : 0.0f;
      row[j] = v;
      sum += v;
    }
    const float mean = cg_warp_sum(sum) / (float)n;
    float sum_sq = 0.0f;
    for (int j = lane; j < n; j += 32) {
      const float d = row[j] - mean;
      sum_sq += d * d;
    }
    const float rstd = rsqrtf(cg_warp_sum(sum_sq) / (float)n + eps);
    for (int j = lane; j < n; j += 32) row[j] = (row[j] - mean) * rstd * staged_params[j] + staged_params[n + j];
    if (staged_stats != nullptr && lane == 0) {
      staged_stats[r] = mean;
      staged_stats[rows + r] = rstd;
    }
  }
  __syncthreads();
}

// The mean and rstd of `rows` consecutive rows of x from `first` (fewer
// where the tensor ends at `last`), into stats[r] and stats[rows + r]: where
// the rows would not fit in shared memory, what such a matmul computes
// before its tile loop, its operand load then normalising each element. One
// warp per row. Every thread calls it; it ends with the block synchronised.
template <typename Load>
CG_DEVICE void cg_layernorm_stats_rows(Load load, cg_i64 first, int rows, cg_i64 last, int n, float eps,
                                       float* stats) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int r = warp; r < rows; r += warps) {
    float sum = 0.0f, sum_sq = 0.0f;
    if (first + r < last)
      for (int j = lane; j < n; j += 32) sum += load(first + r, j);
    const float mean = cg_warp_sum(sum) / (float)n;
    if (first + r < last)
      for (int j = lane; j < n; j += 32) {
        const float d = load(first + r, j) - mean;
        sum_sq += d * d;
      }
    const float rstd = rsqrtf(cg_warp_sum(sum_sq) / (float)n + eps);
    if (lane == 0) {
      stats[r] = mean;
      stats[rows + r] = rstd;
    }
  }
  __syncthreads();
}

// The gradient of one row of layernorm with respect to x, given the mean and
// rstd forward exported; with xhat = (x - mean) * rstd and g = dout * weight:
//   dx[j] = rstd * (g[j] - mean(g) - xhat[j] * mean(g * xhat)).
// The emitter runs one block per row; the weight's and the bias's gradients
// are sums over rows, computed by the variant below in the same kernel's
// other blocks, 32 columns each, in a fixed order (no atomics, no zeroing,
// the same bits every run).
template <typename LoadX, typename Weight, typename LoadDout, typename StoreDx>
CG_OP("layernorm_backward",
      "pattern: reduction",
      "epilogue: dx",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: weight weight T",
      "tensor: mean input f32",
      "tensor: rstd input f32",
      "tensor: dout input T",
      "tensor: dx output T",
      "tensor: dweight output f32",
      "tensor: dbias output f32",
      "shape: x:[...S, N] weight:[N] mean:[...S] rstd:[...S] dout:[...S, N] -> dx:[...S, N] dweight:[N] dbias:[N]",
      "forward: layernorm",
      "variant: cg_layernorm_backward_params_column",
      "smem: 128",
      "doc: gradients of layernorm with respect to x, weight and bias")
CG_DEVICE void cg_layernorm_backward_row(LoadX x, Weight weight, LoadDout dout, StoreDx store_dx, int n, float mean,
                                         float rstd, float* scratch) {
  float sum_g = 0.0f, sum_g_xhat = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const float g = dout(j) * weight(j), xhat = (x(j) - mean) * rstd;
    sum_g += g;
    sum_g_xhat += g * xhat;
  }
  const float mean_g = cg_block_sum(sum_g, scratch) / (float)n;
  const float mean_g_xhat = cg_block_sum(sum_g_xhat, scratch) / (float)n;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const float xhat = (x(j) - mean) * rstd;
    store_dx(j, rstd * (dout(j) * weight(j) - mean_g - xhat * mean_g_xhat));
  }
}

// For the lane's column j: dweight[j] = sum over rows of dout * xhat and
// dbias[j] = sum over rows of dout, xhat = (x - mean[r]) * rstd[r]; x(r) and
// dout(r) read that column, one of 32 adjacent ones per block (false `active`
// past the last). The block's warps split the rows and cg_sum_over_warps adds
// their partials in a fixed order; every thread calls it, and the sums are
// valid in warp 0. Shared memory: blockDim.x floats.
template <typename LoadX, typename LoadDout, typename Mean, typename Rstd>
CG_DEVICE void cg_layernorm_backward_params_column(LoadX x, LoadDout dout, Mean mean, Rstd rstd, bool active,
                                                   cg_i64 rows, float* scratch, float& dweight, float& dbias) {
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  float sum_dw = 0.0f, sum_db = 0.0f;
  if (active)
    for (cg_i64 r = warp; r < rows; r += warps) {
      sum_dw += dout(r) * (x(r) - mean(r)) * rstd(r);
      sum_db += dout(r);
    }
  dweight = cg_sum_over_warps(sum_dw, scratch);
  dbias = cg_sum_over_warps(sum_db, scratch);
}
