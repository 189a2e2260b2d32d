// Attention head layout changes, as index maps: the emitter's gather loop
// writes out[i] = x[source(i)].

// out[..., h, t, d] = x[..., t, h * D + d]   (x: [..., T, H * D])
CG_OP("split_heads",
      "pattern: gather",
      "inverse: merge_heads",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "arg: heads int",
      "shape: x:[...S, T, heads*D] -> out:[...S, heads, T, D]",
      "doc: [.., T, heads*D] -> [.., heads, T, D]")
CG_DEVICE cg_i64 cg_split_heads_source(cg_i64 i, cg_i64 T, cg_i64 H, cg_i64 D) {
  const cg_i64 d = i % D, t = (i / D) % T, h = (i / (D * T)) % H, s = i / (D * T * H);
  return ((s * T + t) * H + h) * D + d;
}

// out[..., t, h * D + d] = x[..., h, t, d]   (x: [..., H, T, D])
CG_OP("merge_heads",
      "pattern: gather",
      "inverse: split_heads",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "arg: heads int",
      "shape: x:[...S, heads, T, D] -> out:[...S, T, heads*D]",
      "doc: [.., heads, T, D] -> [.., T, heads*D]")
CG_DEVICE cg_i64 cg_merge_heads_source(cg_i64 i, cg_i64 T, cg_i64 H, cg_i64 D) {
  const cg_i64 d = i % D, h = (i / D) % H, t = (i / (D * H)) % T, s = i / (D * H * T);
  return ((s * H + h) * T + t) * D + d;
}
