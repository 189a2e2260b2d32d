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

// Its gradient, a scatter-add: element i of dout[S, D] goes to
// dtable[ids[i / D], i % D]. Rows repeat, so the add is atomic; the kernel
// zeroes dtable first.
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
      "doc: scatter-add of dout rows into dtable")
CG_DEVICE void cg_embedding_backward(const I* ids, const T* dout, T* dtable, cg_i64 i, cg_i64 dim) {
  const cg_i64 row = (cg_i64)cg_load(ids, i / dim);
  cg_atomic_add(dtable, row * dim + i % dim, cg_load(dout, i));
}
