// Elementwise and broadcast ops: one scalar function each. The emitter owns
// the loop (a grid-stride loop over the output, with broadcast index maps)
// and calls the function with the inputs in slot order, then the op's
// arguments in order; a string argument arrives as the index of its choice
// (gelu's approximate: 0 for "tanh", 1 for "erf"), a constant the compiler
// folds. The indexer checks the parameters against the annotation.
//
// Math runs in the element type; f32 uses the single-precision functions.

template <typename T>
CG_OP("relu",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: relu_backward",
      "doc: max(x, 0)")
CG_DEVICE T cg_relu(T x) {
  return x > T(0) ? x : T(0);
}

// sigmoid(v) = 1 / (1 + exp(-v)), and 1 - sigmoid(v), each without
// cancelling and without overflow: exp is only taken of -|v|. (exp(-v)
// overflows f32 from v < -88.7, where x * sigmoid(x) is still a normal
// float; 1 - sigmoid(v) computed as a difference is 0 from v > 17.)
template <typename T>
CG_DEVICE T cg_sigmoid_parts(T v, T* one_minus) {
  const T e = exp(v < T(0) ? v : -v), inverse = T(1) / (T(1) + e);
  *one_minus = v < T(0) ? inverse : e * inverse;
  return v < T(0) ? e * inverse : inverse;
}

template <typename T>
CG_OP("sigmoid",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: sigmoid_backward",
      "doc: 1 / (1 + exp(-x))")
CG_DEVICE T cg_sigmoid(T x) {
  T unused;
  return cg_sigmoid_parts(x, &unused);
}

template <typename T>
CG_OP("silu",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: silu_backward",
      "doc: x * sigmoid(x)")
CG_DEVICE T cg_silu(T x) {
  T unused;
  return x * cg_sigmoid_parts(x, &unused);
}

template <typename T>
CG_OP("tanh",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: tanh_backward",
      "doc: tanh(x)")
CG_DEVICE T cg_tanh(T x) {
  return tanh(x);
}

template <typename T>
CG_OP("exp",
      "pattern: elementwise",
      "autocast: f32",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: exp_backward",
      "doc: exp(x)")
CG_DEVICE T cg_exp(T x) {
  return exp(x);
}

template <typename T>
CG_OP("log",
      "pattern: elementwise",
      "autocast: f32",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: log_backward",
      "doc: natural logarithm")
CG_DEVICE T cg_log(T x) {
  return log(x);
}

template <typename T>
CG_OP("sqrt",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: sqrt_backward",
      "doc: square root")
CG_DEVICE T cg_sqrt(T x) {
  return sqrt(x);
}

template <typename T>
CG_OP("rsqrt",
      "pattern: elementwise",
      "autocast: f32",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: rsqrt_backward",
      "doc: 1 / sqrt(x) (torch.rsqrt)")
CG_DEVICE T cg_rsqrt(T x) {
  return T(1) / sqrt(x);  // both correctly rounded: within an ulp of the quotient, where rsqrtf is 2
}

// x^2 is the common case (a hand-written RMSNorm's x.pow(2)): exactly x * x,
// where powf may differ from it by an ulp.
template <typename T>
CG_OP("pow",
      "pattern: elementwise",
      "autocast: f32",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "arg: exponent float = 2.0",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: pow_backward",
      "doc: x ** exponent, the exponent a number (torch.pow(x, 2.0), x.pow(0.5), x ** 3)")
CG_DEVICE T cg_pow(T x, T exponent) {
  return exponent == T(2) ? x * x : exponent == T(1) ? x : pow(x, exponent);
}

template <typename T>
CG_OP("neg",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: neg_backward",
      "doc: -x")
CG_DEVICE T cg_neg(T x) {
  return -x;
}

// gelu(x) = x * Phi(x); the tanh form approximates Phi as PyTorch's approximate="tanh" does.
// Both forms avoid 1 + tanh(u) and 1 + erf(z), which cancel where x is
// negative: gelu(-4) is -7.8e-5, and the sum would keep only 3 of f32's
// digits. 0.5 * (1 + tanh(u)) = 1 / (1 + exp(-2u)), and 1 + erf(z) = erfc(-z).
// The sigmoid takes exp of -|2u| only (cg_sigmoid_parts): exp(-2u)
// overflows f32 from x < -10.06, where gelu is still a normal float
// (-1.9e-38 at x = -10.08), and x / inf would give -0.
template <typename T>
CG_DEVICE T cg_gelu_tanh(T x) {
  const T k = T(0.7978845608028654);  // sqrt(2 / pi)
  T unused;
  return x * cg_sigmoid_parts(T(2) * k * (x + T(0.044715) * x * x * x), &unused);
}

template <typename T>
CG_DEVICE T cg_gelu_erf(T x) {
  return T(0.5) * x * erfc(x * T(-0.7071067811865476));
}

template <typename T>
CG_OP("gelu",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "arg: approximate string = tanh in tanh|erf",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: gelu_backward",
      "doc: x * Phi(x), tanh or erf form")
CG_DEVICE T cg_gelu(T x, int approximate) {
  return approximate == 0 ? cg_gelu_tanh(x) : cg_gelu_erf(x);
}

template <typename T>
CG_OP("affine",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "arg: scale float = 1.0",
      "arg: shift float = 0.0",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: affine_backward",
      "doc: scale * x + shift")
CG_DEVICE T cg_affine(T x, T scale, T shift) {
  return scale * x + shift;
}

template <typename T>
CG_OP("add",
      "pattern: broadcast",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: a input T",
      "tensor: b input T",
      "tensor: out output T",
      "shape: a:[...A] b:[...B] -> out:[...broadcast(A, B)]",
      "may_alias: out a",
      "flops: numel(out)",
      "doc: a + b, numpy broadcasting")
CG_DEVICE T cg_add(T a, T b) {
  return a + b;
}

template <typename T>
CG_OP("sub",
      "pattern: broadcast",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: a input T",
      "tensor: b input T",
      "tensor: out output T",
      "shape: a:[...A] b:[...B] -> out:[...broadcast(A, B)]",
      "may_alias: out a",
      "flops: numel(out)",
      "doc: a - b, numpy broadcasting")
CG_DEVICE T cg_sub(T a, T b) {
  return a - b;
}

template <typename T>
CG_OP("mul",
      "pattern: broadcast",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: a input T",
      "tensor: b input T",
      "tensor: out output T",
      "shape: a:[...A] b:[...B] -> out:[...broadcast(A, B)]",
      "may_alias: out a",
      "flops: numel(out)",
      "doc: a * b, numpy broadcasting")
CG_DEVICE T cg_mul(T a, T b) {
  return a * b;
}

template <typename T>
CG_OP("div",
      "pattern: broadcast",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: a input T",
      "tensor: b input T",
      "tensor: out output T",
      "shape: a:[...A] b:[...B] -> out:[...broadcast(A, B)]",
      "may_alias: out a",
      "flops: numel(out)",
      "doc: a / b, numpy broadcasting")
CG_DEVICE T cg_div(T a, T b) {
  return a / b;
}

template <typename T>
CG_OP("maximum",
      "pattern: broadcast",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: a input T",
      "tensor: b input T",
      "tensor: out output T",
      "shape: a:[...A] b:[...B] -> out:[...broadcast(A, B)]",
      "may_alias: out a",
      "flops: numel(out)",
      "doc: max(a, b), numpy broadcasting")
CG_DEVICE T cg_maximum(T a, T b) {
  return a > b ? a : b;
}

// Comparisons: 1 where they hold, else 0, in the operands' type (PyTorch's
// bool tensor as a mask a product or a sum reads). No gradient flows
// through them.
template <typename T>
CG_OP("eq",
      "pattern: broadcast",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: a input T",
      "tensor: b input T",
      "tensor: out output T",
      "shape: a:[...A] b:[...B] -> out:[...broadcast(A, B)]",
      "may_alias: out a",
      "gradient: none",
      "flops: numel(out)",
      "doc: 1 where a == b, else 0, numpy broadcasting")
CG_DEVICE T cg_eq(T a, T b) {
  return a == b ? T(1) : T(0);
}

template <typename T>
CG_OP("ne",
      "pattern: broadcast",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: a input T",
      "tensor: b input T",
      "tensor: out output T",
      "shape: a:[...A] b:[...B] -> out:[...broadcast(A, B)]",
      "may_alias: out a",
      "gradient: none",
      "flops: numel(out)",
      "doc: 1 where a != b, else 0, numpy broadcasting")
CG_DEVICE T cg_ne(T a, T b) {
  return a != b ? T(1) : T(0);
}

// The gradient of maximum for one operand, at the output's shape (the
// compiler sums it over broadcast axes): the larger operand takes dout, and
// ties split it in half, as PyTorch's rule does.
template <typename T>
CG_OP("maximum_backward",
      "pattern: broadcast",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: a input T",
      "tensor: b input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "arg: wrt string = a in a|b",
      "shape: a:[...A] b:[...B] dout:[...broadcast(A, B)] -> dx:[...broadcast(A, B)]",
      "forward: maximum",
      "doc: dout where the operand `wrt` is the larger, dout / 2 on ties, else 0")
CG_DEVICE T cg_maximum_backward(T a, T b, T dout, int wrt) {
  const T mine = wrt == 0 ? a : b, other = wrt == 0 ? b : a;
  return mine > other ? dout : mine == other ? dout * T(0.5) : T(0);
}

// Gradients of the activations: dx = dout * f'(x).
template <typename T>
CG_OP("relu_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: x:[...S] dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: relu",
      "doc: gradient of relu: dx = dout * relu'(x)")
CG_DEVICE T cg_relu_backward(T x, T dout) {
  return x > T(0) ? dout : T(0);
}

template <typename T>
CG_OP("sigmoid_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: x:[...S] dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: sigmoid",
      "doc: gradient of sigmoid: dx = dout * sigmoid'(x)")
CG_DEVICE T cg_sigmoid_backward(T x, T dout) {
  T one_minus_s;
  const T s = cg_sigmoid_parts(x, &one_minus_s);
  return dout * s * one_minus_s;
}

template <typename T>
CG_OP("silu_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: x:[...S] dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: silu",
      "doc: gradient of silu: dx = dout * silu'(x)")
CG_DEVICE T cg_silu_backward(T x, T dout) {
  T one_minus_s;
  const T s = cg_sigmoid_parts(x, &one_minus_s);
  return dout * s * (T(1) + x * one_minus_s);
}

template <typename T>
CG_OP("tanh_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: x:[...S] dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: tanh",
      "doc: gradient of tanh: dx = dout * tanh'(x)")
CG_DEVICE T cg_tanh_backward(T x, T dout) {
  const T t = tanh(x);
  return dout * (T(1) - t * t);
}

// d/dx of x * Phi(x) = Phi(x) + x * phi(x), with Phi in the chosen form.
template <typename T>
CG_OP("gelu_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "arg: approximate string = tanh in tanh|erf",
      "shape: x:[...S] dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: gelu",
      "doc: gradient of gelu: dx = dout * gelu'(x)")
CG_DEVICE T cg_gelu_backward(T x, T dout, int approximate) {
  if (approximate == 0) {
    // gelu = x * s with s = sigmoid(2u): gelu' = s + 2 x s (1 - s) u', each
    // factor from its own exp so that neither s nor 1 - s cancels.
    const T k = T(0.7978845608028654), c = T(0.044715);
    const T u = k * (x + c * x * x * x);
    T one_minus_s;
    const T s = cg_sigmoid_parts(T(2) * u, &one_minus_s);
    return dout * (s + T(2) * x * s * one_minus_s * k * (T(1) + T(3) * c * x * x));
  }
  const T cdf = T(0.5) * erfc(x * T(-0.7071067811865476));
  const T pdf = T(0.3989422804014327) * exp(T(-0.5) * x * x);
  return dout * (cdf + x * pdf);
}

// Conversion between floating dtypes; the emitter names the output type.
template <typename U, typename T>
CG_OP("cast",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "types: U = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output U",
      "shape: x:[...S] -> out:[...S]",
      "backward: cast_backward",
      "doc: convert between floating dtypes")
CG_DEVICE U cg_cast(T x) {
  return U(x);
}

// A view with another shape: the planner gives out x's storage and no kernel
// runs (the function is the copy a fused loop would inline).
template <typename T>
CG_OP("reshape",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S] -> out:[...R]; numel(x) == numel(out)",
      "may_alias: out x",
      "view: out x",
      "doc: a view with another shape; no copy")
CG_DEVICE T cg_reshape(T x) {
  return x;
}

// Gradients of exp, log, neg, affine and cast.
template <typename T>
CG_OP("exp_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: out input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: out:[...S] dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: exp",
      "doc: gradient of exp from its output: dx = dout * out")
CG_DEVICE T cg_exp_backward(T out, T dout) {
  return dout * out;
}

template <typename T>
CG_OP("log_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: x:[...S] dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: log",
      "doc: gradient of log: dx = dout / x")
CG_DEVICE T cg_log_backward(T x, T dout) {
  return dout / x;
}

template <typename T>
CG_OP("sqrt_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: x:[...S] dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: sqrt",
      "doc: gradient of sqrt: dx = dout / (2 sqrt(x))")
CG_DEVICE T cg_sqrt_backward(T x, T dout) {
  return dout / (T(2) * sqrt(x));
}

template <typename T>
CG_OP("rsqrt_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: x:[...S] dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: rsqrt",
      "doc: gradient of rsqrt: dx = -dout / (2 x sqrt(x))")
CG_DEVICE T cg_rsqrt_backward(T x, T dout) {
  return -dout / (T(2) * x * sqrt(x));
}

template <typename T>
CG_OP("pow_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "arg: exponent float = 2.0",
      "shape: x:[...S] dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: pow",
      "doc: gradient of pow: dx = dout * exponent * x ** (exponent - 1)")
CG_DEVICE T cg_pow_backward(T x, T dout, T exponent) {
  if (exponent == T(0)) return T(0);  // x^0 is constant, also at x = 0 (where 0 * 0^-1 would be NaN), as PyTorch
  return dout * exponent * (exponent == T(2) ? x : exponent == T(1) ? T(1) : pow(x, exponent - T(1)));
}

template <typename T>
CG_OP("neg_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: neg",
      "doc: gradient of neg: dx = -dout")
CG_DEVICE T cg_neg_backward(T dout) {
  return -dout;
}

template <typename T>
CG_OP("affine_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: dout input T",
      "tensor: dx output T",
      "arg: scale float = 1.0",
      "shape: dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: affine",
      "doc: gradient of affine: dx = scale * dout")
CG_DEVICE T cg_affine_backward(T dout, T scale) {
  return T(scale) * dout;
}

// The gradient of a cast is the cast back, to the input's dtype.
template <typename T, typename U>
CG_OP("cast_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "types: U = " CG_FLOAT_TYPES,
      "tensor: dout input U",
      "tensor: dx output T",
      "shape: dout:[...S] -> dx:[...S]",
      "forward: cast",
      "doc: gradient of cast: dout converted back to the input's dtype")
CG_DEVICE T cg_cast_backward(U dout) {
  return T(dout);
}

// The gradient of (pred - target)^2, times scale; the caller folds the
// mean's 1 / numel and the upstream gradient into scale.
template <typename T>
CG_OP("mse_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: pred input T",
      "tensor: target input T",
      "tensor: dpred output T",
      "arg: scale float = 1.0",
      "shape: pred:[...S] target:[...S] -> dpred:[...S]",
      "forward: mse",
      "doc: 2 * (pred - target) * scale; the caller folds the mean's 1 / numel into scale")
CG_DEVICE T cg_mse_backward(T pred, T target, float scale) {
  return T(2) * (pred - target) * T(scale);
}

template <typename T>
CG_OP("relu6",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: relu6_backward",
      "doc: min(max(x, 0), 6) (torch.nn.ReLU6)")
CG_DEVICE T cg_relu6(T x) {
  return x > T(0) ? (x < T(6) ? x : T(6)) : T(0);
}

template <typename T>
CG_OP("relu6_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: x:[...S] dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: relu6",
      "doc: gradient of relu6: dout where 0 < x < 6, else 0 (as PyTorch)")
CG_DEVICE T cg_relu6_backward(T x, T dout) {
  return x > T(0) && x < T(6) ? dout : T(0);
}

// x * relu6(x + 3) / 6, MobileNetV3's activation.
template <typename T>
CG_OP("hardswish",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: hardswish_backward",
      "doc: x * min(max(x + 3, 0), 6) / 6 (torch.nn.Hardswish)")
CG_DEVICE T cg_hardswish(T x) {
  const T r = x + T(3) > T(0) ? (x + T(3) < T(6) ? x + T(3) : T(6)) : T(0);
  return x * r / T(6);
}

template <typename T>
CG_OP("hardsigmoid",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "backward: hardsigmoid_backward",
      "doc: min(max(x + 3, 0), 6) / 6 (torch.nn.Hardsigmoid; MobileNetV3's squeeze-excitation gate)")
CG_DEVICE T cg_hardsigmoid(T x) {
  return (x + T(3) > T(0) ? (x + T(3) < T(6) ? x + T(3) : T(6)) : T(0)) / T(6);
}

template <typename T>
CG_OP("hardsigmoid_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: x:[...S] dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: hardsigmoid",
      "doc: gradient of hardsigmoid: dout / 6 strictly between -3 and 3, else 0 (as PyTorch)")
CG_DEVICE T cg_hardsigmoid_backward(T x, T dout) {
  return x > T(-3) && x < T(3) ? dout / T(6) : T(0);
}

template <typename T>
CG_OP("hardswish_backward",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: x:[...S] dout:[...S] -> dx:[...S]",
      "may_alias: dx dout",
      "forward: hardswish",
      "doc: gradient of hardswish: 0 below -3, dout above 3, dout * (2x + 3) / 6 between (as PyTorch)")
CG_DEVICE T cg_hardswish_backward(T x, T dout) {
  return x < T(-3) ? T(0) : (x <= T(3) ? dout * (T(2) * x + T(3)) / T(6) : dout);
}
