// Losses. cross_entropy runs one block per row of logits[rows, C] (labels
// give the class of each row); the kernel adds each row's loss, divided by
// the number of rows, into the scalar loss. mse's kernel adds the squared
// errors of a grid-stride loop into the loss the same way. Shared memory:
// 32 floats of reduction scratch.

// -log softmax(x)[label] of one row: log(sum(exp(x))) - x[label].
template <typename Load>
CG_OP("cross_entropy",
      "pattern: reduction",
      "autocast: f32",
      "types: T = " CG_FLOAT_TYPES,
      "types: I = i32 i64",
      "tensor: logits input T",
      "tensor: labels input I",
      "tensor: loss output f32",
      "shape: logits:[...S, C] labels:[...S] -> loss:[]",
      "backward: cross_entropy_backward",
      "smem: 128",
      "flops: 5 * numel(logits)",
      "doc: mean over rows of -log softmax(logits)[label]")
CG_DEVICE float cg_cross_entropy_row(Load load, int n, cg_i64 label, float* scratch) {
  return cg_log_sum_exp_row(load, n, scratch) - load((int)label);
}

// Its gradient for one row: (softmax(x) - onehot(label)) * scale, where the
// caller folds 1 / rows and the upstream gradient into scale.
template <typename Load, typename Store>
CG_OP("cross_entropy_backward",
      "pattern: reduction",
      "types: T = " CG_FLOAT_TYPES,
      "types: I = i32 i64",
      "tensor: logits input T",
      "tensor: labels input I",
      "tensor: dlogits output T",
      "arg: scale float = 1.0",
      "shape: logits:[...S, C] labels:[...S] -> dlogits:[...S, C]",
      "forward: cross_entropy",
      "smem: 128",
      "doc: (softmax(logits) - onehot(labels)) * scale; the caller folds 1 / rows into scale")
CG_DEVICE void cg_cross_entropy_backward_row(Load load, Store store, int n, cg_i64 label, float scale,
                                             float* scratch) {
  const float lse = cg_log_sum_exp_row(load, n, scratch);
  for (int j = threadIdx.x; j < n; j += blockDim.x)
    store(j, (expf(load(j) - lse) - (j == label ? 1.0f : 0.0f)) * scale);
}

// One element's squared error, accumulated in f32.
template <typename T>
CG_OP("mse",
      "pattern: reduction",
      "autocast: f32",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: pred input T",
      "tensor: target input T",
      "tensor: loss output f32",
      "shape: pred:[...S] target:[...S] -> loss:[]",
      "backward: mse_backward",
      "smem: 128",
      "doc: mean of (pred - target)^2")
CG_DEVICE float cg_squared_error(T pred, T target) {
  const float d = float(pred) - float(target);
  return d * d;
}
