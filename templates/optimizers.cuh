// Optimizer updates: elementwise functions that update the parameter and
// their state in place (reference parameters); they return nothing.
// Optimizer state is f32 whatever the parameter's dtype, as mixed-precision
// training keeps it. `step` counts from 1. `grad_scale`, a scalar the
// gradient is multiplied by before anything else (gradient_scale's factor:
// clipping, the mean over micro-batches, loss scaling's unscaling), reads 1
// where the task leaves it out; a negative one skips the step (the scaled
// gradients overflowed), leaving the parameter and the state as they were.
// Adam's `step_count`, where given, is the step from the device's count
// (loss_scale_update's, which skipped steps do not advance), over `step`.

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
  if (grad_scale < 0.0f) return;  // gradient_scale found an overflow: the step is skipped
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
      "tensor: step_count input f32 optional=0",
      "arg: lr float",
      "arg: beta1 float = 0.9",
      "arg: beta2 float = 0.999",
      "arg: eps float = 1e-08",
      "arg: weight_decay float = 0.0",
      "arg: step int",
      "shape: param:[...S] grad:[...S] m:[...S] v:[...S] grad_scale:[] step_count:[] -> param:[...S]",
      "flops: 12 * numel(param)",
      "doc: Adam update of param, m and v in place; step counts from 1 and is usually a runtime argument")
CG_DEVICE void cg_adam(T& param, T grad, float& m, float& v, float grad_scale, float step_count, float lr, float beta1,
                       float beta2, float eps, float weight_decay, long long step) {
  if (grad_scale < 0.0f) return;  // gradient_scale found an overflow: the step is skipped
  if (step_count > 0.0f) step = (long long)step_count;
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
      "tensor: step_count input f32 optional=0",
      "arg: lr float",
      "arg: beta1 float = 0.9",
      "arg: beta2 float = 0.999",
      "arg: eps float = 1e-08",
      "arg: weight_decay float = 0.0",
      "arg: step int",
      "shape: param:[...S] grad:[...S] m:[...S] v:[...S] grad_scale:[] step_count:[] -> param:[...S]",
      "flops: 14 * numel(param)",
      "doc: AdamW (decoupled weight decay) update of param, m and v in place; step counts from 1 and is usually a runtime argument")
CG_DEVICE void cg_adamw(T& param, T grad, float& m, float& v, float grad_scale, float step_count, float lr,
                        float beta1, float beta2, float eps, float weight_decay, long long step) {
  if (grad_scale < 0.0f) return;  // gradient_scale found an overflow: the step is skipped
  if (step_count > 0.0f) step = (long long)step_count;
  const float decayed = float(param) * (1.0f - lr * weight_decay);
  param = T(decayed - lr * cg_adam_direction(float(grad) * grad_scale, m, v, beta1, beta2, eps, step));
}

// Gradient accumulation over micro-batches: the gradient of each
// micro-batch added into a persistent buffer (of the gradient's dtype: f32
// for f32 master weights) that the optimizer reads once a step. The first micro-batch (micro_batch 0) overwrites what the last
// step left, so no pass zeroes the buffer between steps.
template <typename T>
CG_OP("accumulate",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: acc weight T writes",
      "tensor: grad input T",
      "arg: micro_batch int = 0",
      "shape: acc:[...S] grad:[...S] -> acc:[...S]",
      "flops: numel(acc)",
      "doc: acc = grad for micro-batch 0, else acc + grad: a gradient summed over a step's micro-batches in place; "
      "micro_batch is a runtime argument the caller sets before each")
CG_DEVICE void cg_accumulate(T& acc, T grad, long long micro_batch) {
  acc = micro_batch == 0 ? grad : T(float(acc) + float(grad));
}

// The factor every gradient is multiplied by before the optimizer reads it
// (its `grad_scale`), from the sum of the squares of all of them:
//  - 1 / micro_batches, so that gradients summed over a step's micro-batches
//    update by their mean, as a loss divided by the micro-batch count does in
//    PyTorch;
//  - 1 / loss_scale where the loss was scaled (loss_scale > 0), and -1, a
//    skipped step, where the scaled gradients overflowed: their squares' sum
//    carries any inf or NaN (or is itself beyond f32, with a scale far too
//    large; the step is skipped and the scale backs off then too);
//  - where max_norm > 0, clipping by global norm as
//    torch.nn.utils.clip_grad_norm_ does, of the unscaled mean: min(1,
//    max_norm / (norm + 1e-6)); 1e-6 keeps a zero norm finite, as PyTorch's does.
template <typename T>
CG_OP("gradient_scale",
      "pattern: elementwise",
      "types: T = f32",
      "tensor: sq_norm input T optional=0",
      "tensor: loss_scale input T optional=0",
      "tensor: out output T",
      "arg: max_norm float = 0.0",
      "arg: micro_batches int = 1",
      "shape: sq_norm:[] loss_scale:[] -> out:[]",
      "flops: 6",
      "doc: 1 / (micro_batches * loss_scale), times min(1, max_norm / (norm + 1e-6)) of the unscaled mean where max_norm "
      "> 0; -1 (skip the step) where loss_scale > 0 and sq_norm is not finite: the factor that averages accumulated "
      "gradients, unscales them and clips them to a global norm of max_norm")
CG_DEVICE T cg_gradient_scale(T sq_norm, T loss_scale, float max_norm, long long micro_batches) {
  if (loss_scale > 0.0f && !(sq_norm <= 3.402823466e38f)) return -1.0f;
  const float mean = 1.0f / (float(micro_batches) * (loss_scale > 0.0f ? loss_scale : 1.0f));
  if (max_norm <= 0.0f) return mean;
  return mean * fminf(1.0f, max_norm / (sqrtf(sq_norm) * mean + 1e-6f));
}

// Dynamic loss scaling's update after each step, as
// torch.cuda.amp.GradScaler.update does: where the step overflowed (a
// negative factor from gradient_scale), the scale times backoff_factor and
// the count of good steps restarted; else one more good step and one more
// optimizer step taken, and after growth_interval good steps the scale times
// growth_factor. Counts are f32: exact to 2^24 steps.
template <typename T>
CG_OP("loss_scale_update",
      "pattern: elementwise",
      "types: T = f32",
      "tensor: factor input T",
      "tensor: scale weight T writes",
      "tensor: good_steps weight T writes",
      "tensor: steps weight T writes",
      "arg: growth_factor float = 2.0",
      "arg: backoff_factor float = 0.5",
      "arg: growth_interval int = 2000",
      "shape: factor:[] scale:[] good_steps:[] steps:[] -> scale:[]",
      "flops: 4",
      "doc: GradScaler's update: after an overflow (factor < 0) scale *= backoff_factor; else good_steps and steps "
      "count it, and every growth_interval good steps scale *= growth_factor")
CG_DEVICE void cg_loss_scale_update(T factor, T& scale, T& good_steps, T& steps, float growth_factor,
                                    float backoff_factor, long long growth_interval) {
  if (factor < 0.0f) {
    scale *= backoff_factor;
    good_steps = 0.0f;
    return;
  }
  steps += 1.0f;
  good_steps += 1.0f;
  if (good_steps >= float(growth_interval)) {
    scale *= growth_factor;
    good_steps = 0.0f;
  }
}
