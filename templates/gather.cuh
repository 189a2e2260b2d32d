// Embedding lookup: element i of out[S, D] is table[ids[i / D], i % D]. The
// emitter owns the grid-stride loop over the output.
template <typename T, typename I>
CG_OP("embedding",
      "pattern: gather",
      "types: T = " CG_FLOAT_TYPES,
      "types: I = i32 i64",
      "tensor: table weight T",
      "tensor: ids input I",
      "tensor: out output T",
      "shape: table:[V, D] ids:[...S] -> out:[...S, D]",
      "backward: embedding_backward",
      "doc: out[s, :] = table[ids[s], :]")
CG_DEVICE T cg_embedding(const T* table, const I* ids, cg_i64 i, cg_i64 dim) {
  const cg_i64 row = (cg_i64)cg_load(ids, i / dim);
  return cg_load(table, row * dim + i % dim);
}

// Its gradient: dtable[v, d] = sum of dout[s, d] over the positions s whose
// id is v. The emitter gives each table row a block, whose threads walk the
// ids in order: deterministic, and no atomics or zeroing (a scatter-add with
// atomics would be faster for large vocabularies, but its sums would vary
// from run to run).
template <typename T, typename I>
CG_OP("embedding_backward",
      "pattern: gather",
      "types: T = " CG_FLOAT_TYPES,
      "types: I = i32 i64",
      "tensor: ids input I",
      "tensor: dout input T",
      "tensor: dtable output T",
      "shape: ids:[...S] dout:[...S, D] -> dtable:[V, D]",
      "forward: embedding",
      "doc: dtable[v, :] = sum of the dout rows whose id is v")
CG_DEVICE float cg_embedding_backward(const I* ids, const T* dout, cg_i64 v, cg_i64 d, cg_i64 count, cg_i64 dim) {
  float sum = 0.0f;
  for (cg_i64 s = 0; s < count; ++s)
    if ((cg_i64)cg_load(ids, s) == v) sum += cg_widen(cg_load(dout, s * dim + d));
  return sum;
}

// Concatenation along the last axis, as the value of element i of
// out[..., A + B] (the emitter's grid-stride loop over the output).
template <typename T>
CG_OP("concat",
      "pattern: gather",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: a input T",
      "tensor: b input T",
      "tensor: out output T",
      "shape: a:[...S, A] b:[...S, B] -> out:[...S, A + B]",
      "doc: a and b side by side along the last axis")
CG_DEVICE T cg_concat(const T* a, const T* b, cg_i64 i, cg_i64 A, cg_i64 B) {
  const cg_i64 row = i / (A + B), j = i % (A + B);
  return j < A ? cg_load(a, row * A + j) : cg_load(b, row * B + j - A);
}

// Its inverse: element i of x[..., A + B] goes to a or b; the outputs'
// declared shapes say where x is cut.
template <typename T>
CG_OP("split",
      "pattern: gather",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: a output T",
      "tensor: b output T",
      "shape: x:[...S, A + B] -> a:[...S, A] b:[...S, B]",
      "doc: x cut in two along the last axis, at the size of a")
CG_DEVICE void cg_split(const T* x, T* a, T* b, cg_i64 i, cg_i64 A, cg_i64 B) {
  const cg_i64 row = i / (A + B), j = i % (A + B);
  const T v = cg_load(x, i);
  if (j < A) cg_store(a, row * A + j, v);
  else cg_store(b, row * B + j - A, v);
}

// A strided slice along one axis, x[..., start : start + step * L : step, ...]
// with L out's size along it: element i of out, seen as (outer, a, inner)
// around the axis, is x's (outer, start + a * step, inner). `select`
// (x[:, -1]) is a slice of one then a reshape; several axes, a chain.
template <typename T>
CG_OP("slice",
      "pattern: gather",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "arg: axis int",
      "arg: start int = 0",
      "arg: step int = 1",
      "shape: x:[...S] -> out:[...R]",
      "backward: slice_backward",
      "doc: x sliced along one axis, from start by step, as many as out's size along it (torch's x[:, a:b:c], narrow)")
CG_DEVICE T cg_slice(const T* x, cg_i64 i, cg_i64 length, cg_i64 inner, cg_i64 size, cg_i64 start, cg_i64 step) {
  const cg_i64 outer = i / (length * inner), a = i / inner % length, r = i % inner;
  return cg_load(x, (outer * size + start + a * step) * inner + r);
}

// Its gradient: dx is dout where the slice took the element, 0 elsewhere.
template <typename T>
CG_OP("slice_backward",
      "pattern: gather",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: dout input T",
      "tensor: dx output T",
      "arg: axis int",
      "arg: start int = 0",
      "arg: step int = 1",
      "shape: dout:[...R] -> dx:[...S]",
      "forward: slice",
      "doc: gradient of slice: dout placed where the slice read, zeros elsewhere")
CG_DEVICE auto cg_slice_backward(const T* dout, cg_i64 i, cg_i64 length, cg_i64 inner, cg_i64 size, cg_i64 start,
                                 cg_i64 step) {
  typedef decltype(cg_widen(T())) Wide;  // float, or double for f64
  const cg_i64 outer = i / (size * inner), b = i / inner % size, r = i % inner;
  const cg_i64 offset = b - start, a = offset / step;
  if (offset < 0 || offset % step != 0 || a >= length) return Wide(0);
  return cg_widen(cg_load(dout, (outer * length + a) * inner + r));
}
