// Elementwise and broadcast ops: one scalar function each. The emitter owns
// the loop (a grid-stride loop over the output, with broadcast index maps).

template <typename T>
CG_DEVICE T cg_relu(T x) {
  return x > T(0) ? x : T(0);
}

template <typename T>
CG_DEVICE T cg_add(T a, T b) {
  return a + b;
}
