#include "emitter.h"

namespace cudagen::lowering {

// The launch of the block-per-row kernels: one block per row of the last
// axis, whole warps up to 256 threads, 32 floats of reduction scratch.
// Returns the row length.
int64_t Emitter::one_block_per_row(const Shape& shape, EmittedKernel& ek) {
  const int64_t n = shape.back();
  ek.block = int(std::clamp<int64_t>((n + 31) / 32 * 32, 32, 256));
  ek.grid[0] = int(numel(shape) / n);
  reserve_shared(ek, "block reduction scratch (32 floats)", 32 * 4);
  return n;
}

std::string Emitter::softmax(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  if (!check_f32_accumulation(t, x)) return {};
  const Shape& shape = x.buffer->shape;
  const int64_t n = one_block_per_row(shape, ek);
  const bool causal = arg_bool(t, "causal");
  const int64_t rows_per_matrix = shape.size() >= 2 ? shape[shape.size() - 2] : 1;
  std::string valid = causal ? fmt::format("(int)(row % {} + 1 < {} ? row % {} + 1 : {})", rows_per_matrix, n,
                                           rows_per_matrix, n)
                             : std::to_string(n);
  const std::string at = fmt::format("row * {} + j", n);
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  const cg_i64 row = tile.x;\n"
      "  cg_softmax_row([&](int j) {{ return {}; }},\n"
      "                 [&](int j, float v) {{ {}; }},\n"
      "                 {}, {}, {}, (float*)cg_smem);\n",
      load(x, at), store(param(ps, "out"), at, "v"), n, float_arg(t, "scale", 1.0), valid);
}

// One block per row; the reduced value is stored by thread 0.
std::string Emitter::row_reduce(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  if (!check_f32_accumulation(t, x)) return {};
  const int64_t n = one_block_per_row(x.buffer->shape, ek);
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  const cg_i64 row = tile.x;\n"
      "  const float value = {}([&](int j) {{ return {}; }}, {}, (float*)cg_smem);\n"
      "  if (threadIdx.x == 0) {};\n",
      p_.tasks[size_t(t)].op->source_function, load(x, fmt::format("row * {} + j", n)), n,
      store(param(ps, "out"), "row", "value"));
}

// sum_backward and mean_backward: a grid-stride loop over dx, each element
// from its row's gradient. No accumulation, so f64 works too.
std::string Emitter::row_gradient(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& dout = param(ps, "dout");
  const Param& dx = param(ps, "dx");
  const int64_t n = dx.buffer->shape.back(), total = numel(dx.buffer->shape);
  return grid_stride_loop(
      total,
      store(dx, "i",
            fmt::format("{}<{}>({}, {})", p_.tasks[size_t(t)].op->source_function, compute_type(dx.buffer->dtype),
                        load(dout, fmt::format("i / {}", n)), n)),
      ek);
}

// One block per row: the row's max and gradient are read once, by every thread.
std::string Emitter::max_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  if (!check_f32_accumulation(t, x)) return {};
  const int64_t n = one_block_per_row(x.buffer->shape, ek);
  const std::string at = fmt::format("row * {} + j", n);
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  const cg_i64 row = tile.x;\n"
      "  cg_max_backward_row([&](int j) {{ return {}; }},\n"
      "                      [&](int j, float v) {{ {}; }},\n"
      "                      {}, {}, {}, (float*)cg_smem);\n",
      load(x, at), store(param(ps, "dx"), at, "v"), n, load(param(ps, "out"), "row"),
      load(param(ps, "dout"), "row"));
}

std::string Emitter::sum_leading(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  if (!check_f32_accumulation(t, x)) return {};
  const int64_t n = x.buffer->shape.back(), rows = numel(x.buffer->shape) / n;
  // 32 columns per block; 8 warps split the rows (fewer where there are few).
  ek.block = int(32 * std::clamp<int64_t>(rows, 1, 8));
  ek.grid[0] = int((n + 31) / 32);
  reserve_shared(ek, "reduction scratch, a float per thread", 4 * ek.block);
  ek.smem_bytes_per_thread = 4;
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  const cg_i64 j = cg_i64(tile.x) * 32 + threadIdx.x % 32;\n"
      "  const float total = cg_sum_leading_column([&](cg_i64 r, cg_i64 c) {{ return {}; }}, j, {}, {}, (float*)cg_smem);\n"
      "  if (threadIdx.x < 32 && j < {}) {};\n",
      load(x, fmt::format("r * {} + c", n)), n, rows, n, store(param(ps, "out"), "j", "total"));
}

std::string Emitter::log_softmax(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  if (!check_f32_accumulation(t, x)) return {};
  const int64_t n = one_block_per_row(x.buffer->shape, ek);
  const std::string at = fmt::format("row * {} + j", n);
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  const cg_i64 row = tile.x;\n"
      "  cg_log_softmax_row([&](int j) {{ return {}; }},\n"
      "                     [&](int j, float v) {{ {}; }}, {}, (float*)cg_smem);\n",
      load(x, at), store(param(ps, "out"), at, "v"), n);
}

std::string Emitter::rmsnorm(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  if (!check_f32_accumulation(t, x)) return {};
  const int64_t n = one_block_per_row(x.buffer->shape, ek);
  const bool exports_rstd = p_.tasks[size_t(t)].find_tensor("rstd") != nullptr;
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  const cg_i64 row = tile.x;\n"
      "  const float row_rstd = {6}([&](int j) {{ return {3}; }},\n"
      "                                        [&](int j) {{ return {4}; }},\n"
      "                                        [&](int j, float v) {{ {5}; }},\n"
      "                                        {0}, {1}, (float*)cg_smem);\n"
      "{2}",
      n, float_arg(t, "eps", 1e-6),
      exports_rstd ? "  if (threadIdx.x == 0) cg_store(rstd, row, row_rstd);\n" : "  (void)row_rstd;\n",
      load(x, fmt::format("row * {} + j", n)), load(param(ps, "weight"), "j"),
      store(param(ps, "out"), fmt::format("row * {} + j", n), "v"), entry_function_);
}

// One block per row; mean and rstd, where the task binds them, for backward.
std::string Emitter::layernorm(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  if (!check_f32_accumulation(t, x)) return {};
  const int64_t n = one_block_per_row(x.buffer->shape, ek);
  const BoundTask& bt = p_.tasks[size_t(t)];
  std::string exports;
  for (const char* stat : {"mean", "rstd"})
    if (bt.find_tensor(stat) != nullptr) exports += fmt::format(" cg_store({0}, row, stats.{0});", stat);
  const std::string at = fmt::format("row * {} + j", n);
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  const cg_i64 row = tile.x;\n"
      "  const cg_row_stats stats = cg_layernorm_row([&](int j) {{ return {}; }},\n"
      "                                              [&](int j) {{ return {}; }},\n"
      "                                              [&](int j) {{ return {}; }},\n"
      "                                              [&](int j, float v) {{ {}; }},\n"
      "                                              {}, {}, (float*)cg_smem);\n"
      "{}",
      load(x, at), load(param(ps, "weight"), "j"), load(param(ps, "bias"), "j"), store(param(ps, "out"), at, "v"), n,
      float_arg(t, "eps", 1e-5),
      exports.empty() ? "  (void)stats;\n" : "  if (threadIdx.x == 0) {" + exports + " }\n");
}

// The mean over rows of each row's loss, by one block that walks the rows in
// order: deterministic, and the scalar needs no zeroing before an atomic sum.
// (A grid of blocks with a second reduction pass is the faster form for
// large batches.)
std::string Emitter::cross_entropy(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& logits = param(ps, "logits");
  if (!check_f32_accumulation(t, logits)) return {};
  const Shape& s = logits.buffer->shape;
  const int64_t classes = one_block_per_row(s, ek), rows = numel(s) / classes;
  ek.grid[0] = 1;
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  float total = 0.0f;\n"
      "  for (cg_i64 row = 0; row < {0}; ++row)\n"
      "    total += cg_cross_entropy_row([&](int j) {{ return {1}; }}, {2}, (cg_i64)cg_load(labels, row),\n"
      "                                  (float*)cg_smem);\n"
      "  if (threadIdx.x == 0) cg_store(loss, 0, total / {3});\n",
      rows, load(logits, fmt::format("row * {} + j", classes)), classes, float_literal(double(rows)));
}

// One block per row: dlogits = (softmax(logits) - onehot(label)) * scale.
std::string Emitter::cross_entropy_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& logits = param(ps, "logits");
  if (!check_f32_accumulation(t, logits)) return {};
  const int64_t classes = one_block_per_row(logits.buffer->shape, ek);
  const std::string at = fmt::format("row * {} + j", classes);
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  const cg_i64 row = tile.x;\n"
      "  cg_cross_entropy_backward_row([&](int j) {{ return {}; }},\n"
      "                                [&](int j, float v) {{ {}; }},\n"
      "                                {}, (cg_i64)cg_load(labels, row), {}, (float*)cg_smem);\n",
      load(logits, at), store(param(ps, "dlogits"), at, "v"), classes, float_arg(t, "scale", 1.0));
}

// softmax_backward and log_softmax_backward: one block per row, from the
// forward output and the output's gradient.
std::string Emitter::softmax_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& out = param(ps, "out");
  if (!check_f32_accumulation(t, out)) return {};
  const bool log = is_op(p_.tasks[size_t(t)], BundledOp::log_softmax_backward);
  const int64_t n = one_block_per_row(out.buffer->shape, ek);
  const std::string at = fmt::format("row * {} + j", n);
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  const cg_i64 row = tile.x;\n"
      "  {}([&](int j) {{ return {}; }},\n"
      "      [&](int j) {{ return {}; }},\n"
      "      [&](int j, float v) {{ {}; }},\n"
      "      {}{}, (float*)cg_smem);\n",
      log ? "cg_log_softmax_backward_row" : "cg_softmax_backward_row", load(out, at), load(param(ps, "dout"), at),
      store(param(ps, "dx"), at, "v"), n, log ? "" : ", " + float_arg(t, "scale", 1.0));
}

// rmsnorm_backward and layernorm_backward in one kernel: blocks [0, rows)
// compute dx a row each; the blocks after them sum the parameters'
// gradients over rows, a column per thread, in row order.
std::string Emitter::norm_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const OpSignature& op = *p_.tasks[size_t(t)].op;
  const bool layer = is_op(op, BundledOp::layernorm_backward);
  const Param& x = param(ps, "x");
  const Param& dout = param(ps, "dout");
  if (!check_f32_accumulation(t, x)) return {};
  const int64_t n = one_block_per_row(x.buffer->shape, ek), rows = numel(x.buffer->shape) / n;
  // The column blocks split the rows across their warps: give them at
  // least four, and shared memory for a float per thread.
  ek.block = std::max(ek.block, 128);
  ek.smem_regions.clear();  // its scratch is a float per thread, not a row op's 32
  ek.smem_bytes = 0;
  reserve_shared(ek, "reduction scratch, a float per thread", 4 * ek.block);
  ek.smem_bytes_per_thread = 4;
  const int64_t column_blocks = (n + 31) / 32;
  ek.grid[0] = int(rows + column_blocks);
  const std::string at = fmt::format("row * {} + j", n), column = fmt::format("r * {} + j", n);
  const std::string stats = layer ? "cg_load(mean, row), cg_load(rstd, row)" : "cg_load(rstd, row)";
  std::string columns;
  if (layer) {
    use_function(op, "cg_layernorm_backward_params_column");
    columns = fmt::format(
        "    float dw, db;\n"
        "    cg_layernorm_backward_params_column([&](cg_i64 r) {{ return {}; }}, [&](cg_i64 r) {{ return {}; }},\n"
        "                                        [&](cg_i64 r) {{ return cg_load(mean, r); }},\n"
        "                                        [&](cg_i64 r) {{ return cg_load(rstd, r); }}, j < {}, {},\n"
        "                                        (float*)cg_smem, dw, db);\n"
        "    if (threadIdx.x < 32 && j < {}) {{\n"
        "      {};\n"
        "      {};\n"
        "    }}\n",
        load(x, column), load(dout, column), n, rows, n, store(param(ps, "dweight"), "j", "dw"),
        store(param(ps, "dbias"), "j", "db"));
  } else {
    use_function(op, "cg_rmsnorm_backward_weight_column");
    columns = fmt::format(
        "    const float dw = cg_rmsnorm_backward_weight_column([&](cg_i64 r) {{ return {}; }},\n"
        "                                                       [&](cg_i64 r) {{ return {}; }},\n"
        "                                                       [&](cg_i64 r) {{ return cg_load(rstd, r); }}, j < {}, {},\n"
        "                                                       (float*)cg_smem);\n"
        "    if (threadIdx.x < 32 && j < {}) {};\n",
        load(x, column), load(dout, column), n, rows, n, store(param(ps, "dweight"), "j", "dw"));
  }
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  if (tile.x < {0}) {{  // dx, a row per block\n"
      "    const cg_i64 row = tile.x;\n"
      "    {1}([&](int j) {{ return {2}; }},\n"
      "        [&](int j) {{ return {3}; }},\n"
      "        [&](int j) {{ return {4}; }},\n"
      "        [&](int j, float v) {{ {5}; }},\n"
      "        {6}, {7}, (float*)cg_smem);\n"
      "  }} else {{  // the parameters' gradients, 32 columns per block, its warps splitting the rows\n"
      "    const cg_i64 j = (cg_i64)(tile.x - {0}) * 32 + threadIdx.x % 32;\n"
      "{8}"
      "  }}\n",
      rows, op.source_function, load(x, at), load(param(ps, "weight"), "j"), load(dout, at),
      store(param(ps, "dx"), at, "v"), n, stats, columns);
}

// A block per table row, its threads over the row's columns.
std::string Emitter::embedding_backward(int, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& ids = param(ps, "ids");
  const Param& dout = param(ps, "dout");
  const Param& dtable = param(ps, "dtable");
  const int64_t dim = dtable.buffer->shape.back(), rows = dtable.buffer->shape.front();
  ek.block = int(std::clamp<int64_t>((dim + 31) / 32 * 32, 32, 256));
  ek.grid[0] = int(rows);
  return fmt::format(
      "  const cg_i64 v = tile.x;\n"
      "  for (cg_i64 d = threadIdx.x; d < {}; d += blockDim.x)\n"
      "    {};\n",
      dim,
      store(dtable, fmt::format("v * {} + d", dim),
            fmt::format("cg_embedding_backward<{}, {}>(ids, dout, v, d, {}, {})", c_type(dout.buffer->dtype),
                        c_type(ids.buffer->dtype), numel(ids.buffer->shape), dim)));
}

// The mean squared error by one block: deterministic, and the scalar needs
// no zeroing before an atomic sum.
std::string Emitter::mse(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& pred = param(ps, "pred");
  if (!check_f32_accumulation(t, pred)) return {};
  const int64_t n = numel(pred.buffer->shape);
  ek.block = 256;
  ek.grid[0] = 1;
  reserve_shared(ek, "block reduction scratch (32 floats)", 32 * 4);
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  float partial = 0.0f;\n"
      "  for (cg_i64 i = threadIdx.x; i < {0}; i += blockDim.x)\n"
      "    partial += cg_squared_error<float>({1}, {2});\n"
      "  const float total = cg_block_sum(partial, (float*)cg_smem);\n"
      "  if (threadIdx.x == 0) cg_store(loss, 0, total / {3});\n",
      n, load(pred, "i"), load(param(ps, "target"), "i"), float_literal(double(n)));
}

// split_heads / merge_heads: out[i] = x[source(i)].
std::string Emitter::heads(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const BoundTask& bt = p_.tasks[size_t(t)];
  const Param& x = param(ps, "x");
  const Param& out = param(ps, "out");
  const bool split = is_op(bt, BundledOp::split_heads);
  const Shape& s = split ? out.buffer->shape : x.buffer->shape;  // [..., H, T, D]
  const int64_t H = s[s.size() - 3], T = s[s.size() - 2], D = s.back(), n = numel(out.buffer->shape);
  return grid_stride_loop(n, fmt::format("cg_store(out, i, cg_load(x, {}(i, {}, {}, {})))", bt.op->source_function, T, H, D),
                          ek);
}

// concat: a grid-stride loop over the output; split: over the input.
std::string Emitter::concat_split(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const bool concat = is_op(p_.tasks[size_t(t)], BundledOp::concat);
  const int64_t A = param(ps, "a").buffer->shape.back(), B = param(ps, "b").buffer->shape.back();
  const int64_t n = numel(param(ps, concat ? "out" : "x").buffer->shape);
  return grid_stride_loop(n,
                          concat ? fmt::format("cg_store(out, i, cg_concat(a, b, i, {}, {}))", A, B)
                                 : fmt::format("cg_split(x, a, b, i, {}, {})", A, B),
                          ek);
}

std::string Emitter::embedding(int, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& table = param(ps, "table");
  const Param& ids = param(ps, "ids");
  const Param& out = param(ps, "out");
  const int64_t n = numel(out.buffer->shape), dim = table.buffer->shape.back();
  return grid_stride_loop(n,
                          fmt::format("cg_store(out, i, cg_embedding<{}, {}>(table, ids, i, {}))",
                                      c_type(table.buffer->dtype), c_type(ids.buffer->dtype), dim),
                          ek);
}

std::string Emitter::transpose(int, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  const Shape& s = x.buffer->shape;
  const int64_t M = s[s.size() - 2], N = s.back();
  const std::string type = c_type(x.buffer->dtype);
  ek.block = 256;
  ek.grid[0] = int((N + 31) / 32);
  ek.grid[1] = int((M + 31) / 32);
  ek.grid[2] = int(numel(s) / (M * N));
  reserve_shared(ek, "a 32 x 33 tile", 32 * 33 * dtype_bytes(x.buffer->dtype));
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  cg_transpose_tile<{0}>(x, out, {1}, {2}, tile.y, tile.x, (cg_i64)tile.z * {3}, ({0}*)cg_smem);\n",
      type, M, N, M * N);
}

// permute: checks `dims` against the shapes (the shape rule cannot say
// "out is x permuted"), then a grid-stride loop over the output.
std::string Emitter::permute(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  const Param& out = param(ps, "out");
  const Shape& sx = x.buffer->shape;
  const Shape& so = out.buffer->shape;
  const BoundArg* a = constant_arg(t, "dims");
  const auto* dims = a ? std::get_if<std::vector<int64_t>>(&a->value) : nullptr;
  std::vector<int64_t> sorted = dims ? *dims : std::vector<int64_t>{};
  std::sort(sorted.begin(), sorted.end());
  bool permutation = dims != nullptr && dims->size() == sx.size();
  for (size_t j = 0; permutation && j < sorted.size(); ++j) permutation = sorted[j] == int64_t(j);
  if (!permutation) {
    fail(t, "dims",
         fmt::format("dims {} is not a permutation of x's {} axes", a ? arg_value_to_string(a->value) : "(none)",
                     sx.size()),
         fmt::format("give each axis 0..{} once, as torch.permute", int64_t(sx.size()) - 1));
    return {};
  }
  Shape want(sx.size());
  for (size_t j = 0; j < sx.size(); ++j) want[j] = sx[size_t((*dims)[j])];
  if (want != so) {
    fail(t, "out",
         fmt::format("out is {}, but x {} permuted by {} is {}", shape_to_string(so), shape_to_string(sx),
                     arg_value_to_string(a->value), shape_to_string(want)),
         "declare out with the permuted shape");
    return {};
  }
  std::vector<int64_t> strides(sx.size(), 1), source_strides;
  for (size_t j = sx.size(); j-- > 1;) strides[j - 1] = strides[j] * sx[j];
  for (int64_t d : *dims) source_strides.push_back(strides[size_t(d)]);
  return fmt::format("  const cg_i64 out_dims[{0}] = {{{1}}}, source_strides[{0}] = {{{2}}};\n", so.size(),
                     fmt::join(so, ", "), fmt::join(source_strides, ", ")) +
         grid_stride_loop(numel(so),
                          store_element("out", out.buffer->dtype, "i",
                                        fmt::format("{}cg_permute(x, i, {}, out_dims, source_strides){}",
                                                    is_16bit(out.buffer->dtype) ? "cg_widen(" : "", so.size(),
                                                    is_16bit(out.buffer->dtype) ? ")" : "")),
                          ek);
}

// Rule-free gathers: slice (x -> out) and its gradient (dout -> dx), one
// axis, checked against the shapes: every other axis the same, the
// slice's last element inside x.
std::string Emitter::slice(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const bool backward = is_op(p_.tasks[size_t(t)], BundledOp::slice_backward);
  const Param& from = param(ps, backward ? "dout" : "x");
  const Param& to = param(ps, backward ? "dx" : "out");
  const Shape& whole = backward ? to.buffer->shape : from.buffer->shape;  // x's
  const Shape& part = backward ? from.buffer->shape : to.buffer->shape;   // out's
  const int64_t rank = int64_t(whole.size());
  const int64_t axis_arg = arg_int(t, "axis", 0), start_arg = arg_int(t, "start", 0), step = arg_int(t, "step", 1);
  const int64_t axis = axis_arg < 0 ? axis_arg + rank : axis_arg;
  if (axis < 0 || axis >= rank) {
    fail(t, "axis", fmt::format("axis {} is not an axis of a rank-{} tensor", axis_arg, rank), "give 0..rank-1 or a negative axis");
    return {};
  }
  const int64_t size = whole[size_t(axis)], length = int64_t(part.size()) == rank ? part[size_t(axis)] : -1;
  const int64_t start = start_arg < 0 ? start_arg + size : start_arg;
  Shape expected = whole;
  expected[size_t(axis)] = length;
  if (length < 1 || expected != part) {
    fail(t, backward ? "dout" : "out",
         fmt::format("{} is {}; a slice of {} along axis {} keeps every other axis and takes at least one element",
                     backward ? "dout" : "out", shape_to_string(part), shape_to_string(whole), axis),
         "declare it with x's shape but for the sliced axis");
    return {};
  }
  if (step < 1 || start < 0 || start + (length - 1) * step >= size) {
    fail(t, "start",
         fmt::format("{} elements from {} by {} run past axis {}'s {}", length, start_arg, step, axis, size),
         "give start and step so that start + (length - 1) * step < the axis's size (step at least 1)");
    return {};
  }
  int64_t inner = 1;
  for (int64_t j = axis + 1; j < rank; ++j) inner *= whole[size_t(j)];
  const std::string value = fmt::format("cg_{}({}, i, {}, {}, {}, {}, {})", backward ? "slice_backward" : "slice",
                                        backward ? "dout" : "x", length, inner, size, start, step);
  const bool widened = backward || !is_16bit(to.buffer->dtype);
  return grid_stride_loop(numel(backward ? whole : part),
                          store_element(backward ? "dx" : "out", to.buffer->dtype, "i",
                                        widened ? value : "cg_widen(" + value + ")"),
                          ek);
}

}  // namespace cudagen::lowering
