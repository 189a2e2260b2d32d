// Row softmax: the emitter runs one block per row and passes hooks that read
// x[row, j] and write out[row, j], where fusion can put a prologue or an
// epilogue. Columns j >= valid are masked (causal attention) and written as 0.
// Shared memory: 32 floats of reduction scratch.
template <typename Load, typename Store>
CG_OP("softmax",
      "pattern: reduction",
      "epilogue: out",
      "prologue: x",
      "rows: x",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "arg: scale float = 1.0",
      "arg: causal bool = false",
      "shape: x:[...S, N] -> out:[...S, N]",
      "backward: softmax_backward",
      "smem: 128",
      "flops: 5 * numel(out)",
      "variant: cg_attention_row",
      "variant: cg_attention_row_streamed",
      "variant: cg_stage_rows",
      "variant: cg_flash_attention",
      "variant: cg_flash_attention_split",
      "variant: cg_flash_config",
      "variant: cg_flash_bias_of",
      "variant: cg_flash_attention_sm90",
      "variant: cg_flash_attention_split_sm90",
      "variant: cg_flash_sm90_config",
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
      "epilogue: dx",
      "rows: out",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: out input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "arg: scale float = 1.0",
      "shape: out:[...S, N] dout:[...S, N] -> dx:[...S, N]",
      "forward: softmax",
      "smem: 128",
      "variant: cg_attention_backward_row",
      "variant: cg_flash_attention_backward",
      "variant: cg_flash_backward_rows",
      "variant: cg_flash_config",
      "variant: cg_flash_attention_backward_sm90",
      "variant: cg_flash_backward_sm90_config",
      "doc: dx = scale * out * (dout - sum(dout * out))")
CG_DEVICE void cg_softmax_backward_row(LoadOut out, LoadDout dout, Store store, int n, float scale, float* scratch) {
  float dot = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) dot += out(j) * dout(j);
  dot = cg_block_sum(dot, scratch);
  for (int j = threadIdx.x; j < n; j += blockDim.x) store(j, scale * out(j) * (dout(j) - dot));
}

// Attention for one query row, run by one warp (fusion rule attention: the
// scores matmul, this softmax and the matmul by the values in one kernel).
// For each key j < valid: s_j = scale * add_bias(j, alpha * q . k_j), as the
// scores matmul, an add of a bias to them (an attention mask; where there is
// none, add_bias returns its x) and the softmax compute it; p = softmax(s),
// each probability handed to store_p (keys j >= valid get 0); then out[c] =
// sum_j p_j v_j[c], handed to store_out. `scratch` is d + n floats of shared memory that only this warp
// uses: the query row, then the scores, which never leave it. Every lane of
// the warp calls it.
template <typename LoadQ, typename LoadK, typename LoadV, typename AddBias, typename StoreP, typename StoreOut>
CG_DEVICE void cg_attention_row(LoadQ q, LoadK k, LoadV v, AddBias add_bias, StoreP store_p, StoreOut store_out, int n,
                                int d, int dv, float alpha, float scale, int valid, float* scratch) {
  const int lane = threadIdx.x & 31;
  float* q_row = scratch;
  float* p = scratch + d;
  for (int c = lane; c < d; c += 32) q_row[c] = q(c);
  __syncwarp();  // the query row, before every lane reads all of it
  float row_max = cg_neg_inf();
  for (int j = lane; j < valid; j += 32) {
    float dot = 0.0f;
    for (int c = 0; c < d; ++c) dot += q_row[c] * k(j, c);
    p[j] = scale * add_bias(j, alpha * dot);
    row_max = fmaxf(row_max, p[j]);
  }
  row_max = cg_warp_max(row_max);
  float sum = 0.0f;
  for (int j = lane; j < valid; j += 32) {
    p[j] = expf(p[j] - row_max);
    sum += p[j];
  }
  const float inv_sum = 1.0f / cg_warp_sum(sum);
  for (int j = lane; j < n; j += 32) {
    const float pj = j < valid ? p[j] * inv_sum : 0.0f;
    if (j < valid) p[j] = pj;
    store_p(j, pj);
  }
  __syncwarp();  // every lane's probabilities, before any lane reads them all
  for (int c = lane; c < dv; c += 32) {
    float acc = 0.0f;
    for (int j = 0; j < valid; ++j) acc += p[j] * v(j, c);
    store_out(c, acc);
  }
  __syncwarp();  // `scratch` is read before the warp's next row overwrites it
}

// Attention for one query row over any number of keys, run by one warp, with
// no row of scores kept (fusion rule attention where neither the row kernel
// above, at most 1024 keys, nor the flash kernel applies: f32, or heads the
// flash kernel does not take). Two passes over the keys, each lane taking
// keys lane, lane + 32, ...: the first finds the row's maximum and sum of
// exp(s_j - max) online; the second computes each p_j again, hands it to
// store_p (keys j >= valid get 0) and adds p_j v_j into the output, whose
// columns c = lane + 32 i (i < COLS, c < dv) each lane holds in registers.
// s_j = scale * add_bias(j, alpha * q . k_j), as cg_attention_row. `scratch` is d
// floats of shared memory that only this warp uses (the query row). Every
// lane of the warp calls it.
template <int COLS, typename LoadQ, typename LoadK, typename LoadV, typename AddBias, typename StoreP, typename StoreOut>
CG_DEVICE void cg_attention_row_streamed(LoadQ q, LoadK k, LoadV v, AddBias add_bias, StoreP store_p, StoreOut store_out,
                                         int n, int d, int dv, float alpha, float scale, int valid, float* scratch) {
  const int lane = threadIdx.x & 31;
  float* q_row = scratch;
  for (int c = lane; c < d; c += 32) q_row[c] = q(c);
  __syncwarp();  // the query row, before every lane reads all of it
  auto score = [&](int j) {
    float dot = 0.0f;
    for (int c = 0; c < d; ++c) dot += q_row[c] * k(j, c);
    return scale * add_bias(j, alpha * dot);
  };
  float row_max = cg_neg_inf(), sum = 0.0f;  // this lane's keys, online
  for (int j = lane; j < valid; j += 32) {
    const float s = score(j), new_max = fmaxf(row_max, s);
    sum = sum * expf(row_max - new_max) + expf(s - new_max);
    row_max = new_max;
  }
  const float warp_max = cg_warp_max(row_max);
  // (A lane with no key has sum 0: it adds nothing.)
  const float total = cg_warp_sum(row_max == cg_neg_inf() ? 0.0f : sum * expf(row_max - warp_max));
  const float inv_sum = total > 0.0f ? 1.0f / total : 0.0f;
  float out[COLS];
  CG_UNROLL
  for (int i = 0; i < COLS; ++i) out[i] = 0.0f;
  for (int j0 = 0; j0 < valid; j0 += 32) {
    const int j = j0 + lane;
    const float p = j < valid ? expf(score(j) - warp_max) * inv_sum : 0.0f;
    if (j < valid) store_p(j, p);
    const int keys = valid - j0 < 32 ? valid - j0 : 32;
    for (int jj = 0; jj < keys; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      CG_UNROLL
      for (int i = 0; i < COLS; ++i)
        if (lane + 32 * i < dv) out[i] += pj * v(j0 + jj, lane + 32 * i);
    }
  }
  for (int j = valid + lane; j < n; j += 32) store_p(j, 0.0f);
  CG_UNROLL
  for (int i = 0; i < COLS; ++i)
    if (lane + 32 * i < dv) store_out(lane + 32 * i, out[i]);
}

// The gradient of attention for one query row, run by one warp (fusion rule
// attention_backward: the gradients of scores = alpha q k^T, probs =
// softmax(scale * scores) and context = alpha_v * probs v in one kernel).
// From the row's gradient of the context, dout (dv floats), its
// probabilities p (n of them) and the head's values and keys:
//   dp_j = alpha_v * (dout . v_j)                    the gradient of probs
//   ds_j = scale * p_j * (dp_j - sum_k p_k dp_k)     softmax_backward
//   dq[c] = sum_j ds_j k_j[c]                        before the scores' alpha
// round_dp and round_ds round dp_j and ds_j as the unfused kernels store
// them; ds (n floats of shared memory, the row's) keeps ds_j for the block's
// key gradients; each dq[c] goes to store_dq (none where d is 0). Every lane
// of the warp calls it.
template <typename LoadDout, typename LoadP, typename LoadV, typename LoadK, typename RoundDp, typename RoundDs,
          typename StoreDq>
CG_DEVICE void cg_attention_backward_row(LoadDout dout, LoadP p, LoadV v, LoadK k, RoundDp round_dp, RoundDs round_ds,
                                         StoreDq store_dq, int n, int d, int dv, float alpha_v, float scale, float* ds) {
  const int lane = threadIdx.x & 31;
  float dot = 0.0f;
  for (int j = lane; j < n; j += 32) {
    float acc = 0.0f;
    for (int c = 0; c < dv; ++c) acc += dout(c) * v(j, c);
    ds[j] = round_dp(alpha_v * acc);
    dot += p(j) * ds[j];
  }
  dot = cg_warp_sum(dot);
  for (int j = lane; j < n; j += 32) ds[j] = round_ds(scale * p(j) * (ds[j] - dot));
  __syncwarp();  // every lane's ds_j, before any lane reads them all
  for (int c = lane; c < d; c += 32) {
    float acc = 0.0f;
    for (int j = 0; j < n; ++j) acc += ds[j] * k(j, c);
    store_dq(c, acc);
  }
}

// A rows x width block of a tensor copied into shared memory by every thread
// of the block (`load(row, column)` reads it): the keys and values that all
// the query rows of a block read. Every thread calls it.
template <typename Load>
CG_DEVICE void cg_stage_rows(Load load, float* staged, int rows, int width) {
  for (int e = threadIdx.x; e < rows * width; e += blockDim.x) staged[e] = load(e / width, e % width);
  __syncthreads();
}
