// Embedding lookup: element i of out[S, D] is table[ids[i / D], i % D]. The
// emitter owns the grid-stride loop over the output.
template <typename T, typename I>
CG_DEVICE T cg_embedding(const T* table, const I* ids, cg_i64 i, cg_i64 dim) {
  const cg_i64 row = (cg_i64)cg_load(ids, i / dim);
  return cg_load(table, row * dim + i % dim);
}
