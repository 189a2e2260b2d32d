// Init ops: elementwise functions of the element index, which the emitter
// passes first when an op has no input. Random numbers come from a counter-
// based generator (a hash of seed and index, no state), so every device and
// the host emulation produce the same numbers.

CG_DEVICE unsigned long long cg_hash64(unsigned long long x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A float in [0, 1) with 24 random bits: exact, so bit-identical everywhere.
// cos(pi x): on the device cospif, whose reduction of the argument is exact
// and short (cosf's general one keeps a table in local memory: a stack frame
// in every kernel that draws normal numbers).
CG_DEVICE float cg_cos_pi(float x) {
#ifdef __CUDA_ARCH__
  return cospif(x);
#else
  return (float)cos(3.141592653589793 * (double)x);
#endif
}

CG_DEVICE float cg_unit_float(long long seed, cg_i64 i, int stream) {
  const unsigned long long bits = cg_hash64(cg_hash64((unsigned long long)seed) ^ (unsigned long long)(2 * i + stream));
  return (float)(bits >> 40) * 5.9604644775390625e-8f;  // 2^-24
}

template <typename T>
CG_OP("fill",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: out output T",
      "arg: value float = 0.0",
      "shape: -> out:[...S]",
      "doc: every element = value")
CG_DEVICE T cg_fill(cg_i64, T value) {
  return value;
}

// low + (high - low) * u with one explicit fused multiply-add: the same rounding
// on every device, whatever the compiler would contract.
template <typename T>
CG_OP("uniform",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: out output T",
      "arg: low float = 0.0",
      "arg: high float = 1.0",
      "arg: seed int = 0",
      "shape: -> out:[...S]",
      "doc: uniform in [low, high) from a counter-based generator: the same numbers on every device")
CG_DEVICE T cg_uniform(cg_i64 i, T low, T high, long long seed) {
  return fma(high - low, (T)cg_unit_float(seed, i, 0), low);
}

// Box-Muller on two uniforms; within a few ulps across devices (transcendentals).
template <typename T>
CG_OP("normal",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: out output T",
      "arg: mean float = 0.0",
      "arg: std float = 1.0",
      "arg: seed int = 0",
      "shape: -> out:[...S]",
      "doc: normal(mean, std) from a counter-based generator")
CG_DEVICE T cg_normal(cg_i64 i, T mean, T std, long long seed) {
  const float u1 = 1.0f - cg_unit_float(seed, i, 0);  // (0, 1]
  const float u2 = cg_unit_float(seed, i, 1);
  const float z = sqrt(-2.0f * log(u1)) * cg_cos_pi(2.0f * u2);
  return mean + std * (T)z;
}

// Dropout's mask, scaled: 1 / (1 - p) where an element is kept, 0 where it is
// dropped, with probability p. The frontend multiplies the input by it, so
// the backward is that product's gradient and reads the same saved mask.
// `step` and `micro_batch` are run-time arguments the runtime advances, so
// each step and each micro-batch draws a new mask from one seed; `seed`
// tells a model's dropouts apart. cudagen_torch.dropout_mask draws the same
// masks in PyTorch.
CG_DEVICE long long cg_dropout_draw(long long seed, long long step, long long micro_batch) {
  return (long long)cg_hash64(cg_hash64(cg_hash64((unsigned long long)seed) ^ (unsigned long long)step) ^
                              (unsigned long long)micro_batch);
}

template <typename T>
CG_OP("dropout_mask",
      "pattern: elementwise",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: out output T",
      "arg: p float",
      "arg: seed int = 0",
      "arg: step int = 1",
      "arg: micro_batch int = 0",
      "shape: -> out:[...S]",
      "doc: dropout's mask: 0 with probability p, else 1 / (1 - p); a new mask each step and micro-batch")
CG_DEVICE T cg_dropout_mask(cg_i64 i, float p, long long seed, long long step, long long micro_batch) {
  return cg_unit_float(cg_dropout_draw(seed, step, micro_batch), i, 0) < p ? T(0) : T(1.0f / (1.0f - p));
}
