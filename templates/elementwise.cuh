// Elementwise and broadcast ops: one scalar function each. The emitter owns
// the loop (a grid-stride loop over the output, with broadcast index maps)
// and calls the function with the inputs in slot order, then the op's
// numeric arguments. A string argument selects a variant: gelu with
// approximate="tanh" calls cg_gelu_tanh.
//
// Math runs in the element type; f32 uses the single-precision functions.

template <typename T>
CG_DEVICE T cg_relu(T x) {
  return x > T(0) ? x : T(0);
}

template <typename T>
CG_DEVICE T cg_sigmoid(T x) {
  return T(1) / (T(1) + exp(-x));
}

template <typename T>
CG_DEVICE T cg_silu(T x) {
  return x / (T(1) + exp(-x));
}

template <typename T>
CG_DEVICE T cg_tanh(T x) {
  return tanh(x);
}

template <typename T>
CG_DEVICE T cg_exp(T x) {
  return exp(x);
}

template <typename T>
CG_DEVICE T cg_log(T x) {
  return log(x);
}

template <typename T>
CG_DEVICE T cg_neg(T x) {
  return -x;
}

// gelu(x) = x * Phi(x); the tanh form approximates Phi as PyTorch's approximate="tanh" does.
template <typename T>
CG_DEVICE T cg_gelu_tanh(T x) {
  const T k = T(0.7978845608028654);  // sqrt(2 / pi)
  return T(0.5) * x * (T(1) + tanh(k * (x + T(0.044715) * x * x * x)));
}

template <typename T>
CG_DEVICE T cg_gelu_erf(T x) {
  return T(0.5) * x * (T(1) + erf(x * T(0.7071067811865476)));
}

template <typename T>
CG_DEVICE T cg_affine(T x, T scale, T shift) {
  return scale * x + shift;
}

template <typename T>
CG_DEVICE T cg_add(T a, T b) {
  return a + b;
}

template <typename T>
CG_DEVICE T cg_sub(T a, T b) {
  return a - b;
}

template <typename T>
CG_DEVICE T cg_mul(T a, T b) {
  return a * b;
}

template <typename T>
CG_DEVICE T cg_div(T a, T b) {
  return a / b;
}

template <typename T>
CG_DEVICE T cg_maximum(T a, T b) {
  return a > b ? a : b;
}

// Gradients of the activations: dx = dout * f'(x).
template <typename T>
CG_DEVICE T cg_relu_backward(T x, T dout) {
  return x > T(0) ? dout : T(0);
}

template <typename T>
CG_DEVICE T cg_sigmoid_backward(T x, T dout) {
  const T s = T(1) / (T(1) + exp(-x));
  return dout * s * (T(1) - s);
}

template <typename T>
CG_DEVICE T cg_silu_backward(T x, T dout) {
  const T s = T(1) / (T(1) + exp(-x));
  return dout * s * (T(1) + x * (T(1) - s));
}

template <typename T>
CG_DEVICE T cg_tanh_backward(T x, T dout) {
  const T t = tanh(x);
  return dout * (T(1) - t * t);
}
