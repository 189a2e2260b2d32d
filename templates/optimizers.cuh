// Optimizer updates: elementwise functions that update the parameter and
// their state in place (reference parameters); they return nothing.
// Optimizer state is f32 whatever the parameter's dtype, as mixed-precision
// training keeps it. `step` counts from 1. `grad_scale`, a scalar the
// gradient is multiplied by before anything else (gradient clipping's
// factor), reads 1 where the task leaves it out.

// SGD as PyTorch defines it: g = grad + weight_decay * param;
// buf = momentum * buf + g (buf = g at the first step is the caller's zero
// init); param -= lr * (momentum ? buf : g).
template <typename T>
CG_OP("sgd",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: param weight T writes",
      "tensor: grad input T",
      "tensor: momentum_buf weight T optional writes",
      "tensor: grad_scale input f32 optional=1",
      "arg: lr float",
      "arg: momentum float = 0.0",
      "arg: weight_decay float = 0.0",
      "shape: param:[...S] grad:[...S] momentum_buf:[...S] grad_scale:[] -> param:[...S]",
      "flops: 3 * numel(param)",
      "doc: SGD with optional momentum, updating param (and momentum_buf) in place")
CG_DEVICE void cg_sgd(T& param, T grad, T& momentum_buf, float grad_scale, float lr, float momentum,
                      float weight_decay) {
  float g = float(grad) * grad_scale + weight_decay * float(param);
  if (momentum != 0.0f) {
    const float buf = momentum * float(momentum_buf) + g;
    momentum_buf = T(buf);
    g = buf;
  }
  param = T(float(param) - lr * g);
}

// Adam's moment update for gradient g, and the bias-corrected step
// m_hat / (sqrt(v_hat) + eps) that adam and adamw scale by lr.
CG_DEVICE float cg_adam_direction(float g, float& m, float& v, float beta1, float beta2, float eps, long long step) {
  m = beta1 * m + (1.0f - beta1) * g;
  v = beta2 * v + (1.0f - beta2) * g * g;
  const float m_hat = m / (1.0f - pow(beta1, (float)step));
  const float v_hat = v / (1.0f - pow(beta2, (float)step));
  return m_hat / (sqrt(v_hat) + eps);
}

// One Adam step, L2 weight decay added to the gradient (torch.optim.Adam).
template <typename T>
CG_OP("adam",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: param weight T writes",
      "tensor: grad input T",
      "tensor: m weight f32 writes",
      "tensor: v weight f32 writes",
      "tensor: grad_scale input f32 optional=1",
      "arg: lr float",
      "arg: beta1 float = 0.9",
      "arg: beta2 float = 0.999",
      "arg: eps float = 1e-08",
      "arg: weight_decay float = 0.0",
      "arg: step int",
      "shape: param:[...S] grad:[...S] m:[...S] v:[...S] grad_scale:[] -> param:[...S]",
      "flops: 12 * numel(param)",
      "doc: Adam update of param, m and v in place; step counts from 1 and is usually a runtime argument")
CG_DEVICE void cg_adam(T& param, T grad, float& m, float& v, float grad_scale, float lr, float beta1, float beta2,
                       float eps, float weight_decay, long long step) {
  const float g = float(grad) * grad_scale + weight_decay * float(param);
  param = T(float(param) - lr * cg_adam_direction(g, m, v, beta1, beta2, eps, step));
}

// AdamW: the weight decay is decoupled, applied to the parameter directly
// (torch.optim.AdamW).
template <typename T>
CG_OP("adamw",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: param weight T writes",
      "tensor: grad input T",
      "tensor: m weight f32 writes",
      "tensor: v weight f32 writes",
      "tensor: grad_scale input f32 optional=1",
      "arg: lr float",
      "arg: beta1 float = 0.9",
      "arg: beta2 float = 0.999",
      "arg: eps float = 1e-08",
      "arg: weight_decay float = 0.0",
      "arg: step int",
      "shape: param:[...S] grad:[...S] m:[...S] v:[...S] grad_scale:[] -> param:[...S]",
      "flops: 14 * numel(param)",
      "doc: AdamW (decoupled weight decay) update of param, m and v in place; step counts from 1 and is usually a runtime argument")
CG_DEVICE void cg_adamw(T& param, T grad, float& m, float& v, float grad_scale, float lr, float beta1, float beta2,
                        float eps, float weight_decay, long long step) {
  const float decayed = float(param) * (1.0f - lr * weight_decay);
  param = T(decayed - lr * cg_adam_direction(float(grad) * grad_scale, m, v, beta1, beta2, eps, step));
}

// Gradient clipping by global norm (torch.nn.utils.clip_grad_norm_): the
// factor every gradient is multiplied by before the optimizer reads it, from
// the sum of the squares of all of them. It is 1 while the norm is within
// max_norm; 1e-6 keeps a zero norm finite, as PyTorch's does.
template <typename T>
CG_OP("clip_coefficient",
      "pattern: elementwise",
      "types: T = f32",
      "tensor: sq_norm input T",
      "tensor: out output T",
      "arg: max_norm float",
      "shape: sq_norm:[] -> out:[]",
      "flops: 3",
      "doc: min(1, max_norm / (sqrt(sq_norm) + 1e-6)): the factor that clips gradients to a global norm of max_norm")
CG_DEVICE T cg_clip_coefficient(T sq_norm, float max_norm) {
  return fminf(1.0f, max_norm / (sqrtf(sq_norm) + 1e-6f));
}
