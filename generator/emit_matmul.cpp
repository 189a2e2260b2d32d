#include "emitter.h"
#include "perf_model.h"

namespace cudagen::lowering {

// Where load_b(k, n) reads a [K, N] right operand, stored transposed or not.
std::string Emitter::b_index(bool trans_b, int64_t K, int64_t N) {
  return trans_b ? fmt::format("(cg_i64)n * {} + k", K) : fmt::format("(cg_i64)k * {} + n", N);
}

// A matmul's accumulator `acc` times its alpha (once, where it is stored).
std::string Emitter::scaled_accumulator(int t) {
  const std::string alpha = float_arg(t, "alpha", 1.0);
  return alpha == float_literal(1.0) ? std::string("acc") : alpha + " * acc";
}

// Rule matmul_sum (fuse.h): a sum of matmuls of one output shape, each
// [..., M, K_i] @ [K_i, N] (fuse.cpp checked), as one product over the
// concatenated inner dimensions: the skeleton's loads pick the term whose
// range holds k, so each tile's f32 accumulator takes every term in turn,
// and the epilogue runs on the sum. (The unfused kernels rounded each
// product and each partial sum to the output's type; one accumulator is
// the more accurate.)
std::string Emitter::matmul_sum(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
  // The IR's stages (kir.h): the terms, each after the first followed by
  // the add of it to the sum so far; the last add's result is the sum, and
  // its chain the epilogue.
  std::vector<int> terms;
  int sum_task = -1;
  for (const kir::Stage& stage : k.ir.stages) {
    if (stage.role == "term")
      terms.push_back(stage.task);
    else
      sum_task = stage.task;
  }
  const bool epilogue_ops = !k.ir.stages.back().chain.empty();
  const int first = terms.front();
  const std::vector<Param> last = params(sum_task);
  if (!diags_.ok()) return {};
  const Param& out = param(last, "out");  // the sum
  const Shape& so = out.buffer->shape;
  const int64_t N = so.back(), M = numel(so) / N;
  EmittedKernel ek = emitted_kernel(k);
  std::vector<LaunchParam> launch;
  auto add = [&](const std::string& name, const Param& x) {
    launch.push_back(buffer_param(name, x));
  };
  // Each term's loads, after the terms before it: k below its K, else k - K for the next.
  std::string load_a, load_b;
  DType a_type = DType::f32;
  int64_t K_total = 0;
  for (size_t i = 0; i < terms.size(); ++i) {
    const int t = terms[i];
    const std::string& id = p_.tasks[size_t(t)].task->id;
    const std::vector<Param> ps = params(t);
    if (!diags_.ok()) return {};
    const Param& a = param(ps, "a");
    const Param& b = param(ps, "b");
    if (!check_f32_accumulation(t, a)) return {};
    template_files_.insert(p_.tasks[size_t(t)].op->source_file);
    a_type = a.buffer->dtype;
    const int64_t K = a.buffer->shape.back();
    K_total += K;
    add(id + "_a", a);
    add(id + "_b", b);
    const bool last_term = i + 1 == terms.size();
    const std::string a_element = load_as(a, id + "_a", fmt::format("(cg_i64)m * {} + k", K));
    const std::string b_element = load_as(b, id + "_b", b_index(arg_bool(t, "trans_b"), K, N));
    load_a += last_term ? fmt::format("return {};  // {}", a_element, id)
                        : fmt::format("if (k < {0}) return {1};  // {2}\n        k -= {0};\n        ", K, a_element, id);
    load_b += last_term ? fmt::format("return {};", b_element)
                        : fmt::format("if (k < {0}) return {1};\n        k -= {0};\n        ", K, b_element);
  }
  const bool tensor_cores = is_16bit(a_type);
  use_function(*p_.tasks[size_t(first)].op, tensor_cores ? "cg_matmul_tile_mma" : p_.tasks[size_t(first)].op->source_function);
  const int64_t tile = matmul_tile_rows(a_type);
  ek.block = int(matmul_tile_threads(a_type));
  ek.grid[0] = int((N + tile - 1) / tile);
  ek.grid[1] = int((M + tile - 1) / tile);
  reserve_shared(ek, "the operand tiles", matmul_operand_tile_bytes(a_type));
  // The sum, scaled once (fuse.cpp checked the terms share their alpha), through the epilogue.
  const std::string value = scaled_accumulator(first);
  std::string tail_code, sink;
  const std::string name = p_.tasks[size_t(sum_task)].task->id + "_out";
  if (!contains(k.internal_buffers, out.bound->buffer)) add(name, out);
  if (!epilogue_ops && !contains(k.internal_buffers, out.bound->buffer)) {
    sink = store_element(name, out.buffer->dtype, fmt::format("(cg_i64)m * {} + n", N), value);
  } else if (epilogue_ops) {
    Epilogue tail = epilogue(k, out, {.anchor_name = name});
    if (!diags_.ok()) return {};
    launch.insert(launch.end(), tail.params.begin(), tail.params.end());
    tail_code = tail.code;
    sink = fmt::format("cg_epilogue((cg_i64)m * {} + n, {})", N, value);
  } else {
    fail(k.tasks[0], "", fmt::format("kernel {} computes a sum nothing reads", k.name),
         "an internal error of cudagen: please report it with the graph; --no-fuse-rule matmul_sum avoids it");
    return {};
  }
  std::vector<std::string> term_ids;
  for (int t : terms) term_ids.push_back(p_.tasks[size_t(t)].task->id);
  const std::string body = fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "{0}"
      "  // {1}: one product over k in [0, {2}), each term's operands where its k lies.\n"
      "  {3}(\n"
      "      [&](int m, int k) {{\n"
      "        {4}\n"
      "      }},\n"
      "      [&](int k, int n) {{\n"
      "        {5}\n"
      "      }},\n"
      "      [&](int m, int n, float acc) {{ {6}; }},\n"
      "      {7}, {8}, {2}, tile.y, tile.x, ({9}*)cg_smem);\n",
      tail_code, fmt::join(term_ids, " + "), K_total,
      tensor_cores ? "cg_matmul_tile_mma<64, 64, 16>" : "cg_matmul_tile<32, 32, 16>", load_a, load_b, sink, M, N,
      tensor_cores ? c_type(a_type) : "float");
  // A row of output tiles owns whole rows: of every term's `a`, of the sum,
  // of what the epilogue reads or stores at the sum's own element (the
  // megakernel waits for those rows only).
  ek.rows = M;
  ek.rows_per_tile = tile;
  ek.tiles_per_row_block = ek.grid[0];
  std::set<int> by_rows = {out.bound->buffer};
  for (int t : terms) {
    const BoundTask& term = p_.tasks[size_t(t)];
    if (term.find_tensor("a")->buffer != term.find_tensor("b")->buffer) by_rows.insert(term.find_tensor("a")->buffer);
  }
  std::set<int> weights;  // (a term's b is read whole by every tile)
  for (int t : terms) weights.insert(p_.tasks[size_t(t)].find_tensor("b")->buffer);
  for (const LaunchParam& lp : launch)
    if (p_.buffers[size_t(lp.buffer)].shape == so && !weights.count(lp.buffer)) by_rows.insert(lp.buffer);
  std::string code = kernel_functions(comment(k, launch, ek), ek, launch, body);
  record_launch(ek, launch);
  for (size_t i = 0; i < launch.size(); ++i)
    if (by_rows.count(launch[i].buffer) && !weights.count(launch[i].buffer)) ek.ranges[i].by_rows = true;
  emitted.push_back(ek);
  return code;
}

// Rule matmul_chain (fuse.h): value = op1(a @ b1) (its prologue, its
// epilogue), then out = op2(value @ b2). A block owns a tile of rows: it
// computes every column tile of the first product into shared memory (the
// rows of the value as its epilogue leaves them, in the value's type),
// then every column tile of the second from there. The value reaches
// memory only where read later too (the first epilogue then stores it as
// well); each weight is read once per tile of rows. Both products flatten
// their rows ([..., M, K] @ [K, N], fuse.cpp checked).
std::string Emitter::matmul_chain(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
  // The IR's two stages (kir.h), each a product and its epilogue's chain.
  const kir::Stage& first_stage = k.ir.stages.front();
  const kir::Stage& second_stage = k.ir.stages.back();
  const int t1 = first_stage.task, t2 = second_stage.task;
  const std::vector<Param> ps1 = params(t1), ps2 = params(t2);
  if (!diags_.ok()) return {};
  const Param& a = param(ps1, "a");
  const Param& b1 = param(ps1, "b");
  const Param& out1 = param(ps1, "out");
  const Param& value = param(ps2, "a");
  const Param& b2 = param(ps2, "b");
  const Param& out2 = param(ps2, "out");
  if (!check_f32_accumulation(t1, a) || !check_f32_accumulation(t2, value)) return {};
  const std::string id1 = p_.tasks[size_t(t1)].task->id, id2 = p_.tasks[size_t(t2)].task->id;
  EmittedKernel ek = emitted_kernel(k);
  const Shape& so1 = out1.buffer->shape;
  const int64_t H = so1.back(), M = numel(so1) / H, K = a.buffer->shape.back(), N = out2.buffer->shape.back();
  const DType vt = value.buffer->dtype;
  const bool tensor_cores = is_16bit(a.buffer->dtype);
  const int64_t tile = matmul_tile_rows(a.buffer->dtype);
  const std::string tile_function = tensor_cores ? "cg_matmul_tile_mma<64, 64, 16>" : "cg_matmul_tile<32, 32, 16>";
  for (int t : {t1, t2}) {
    const OpSignature& op = *p_.tasks[size_t(t)].op;
    template_files_.insert(op.source_file);
    use_function(op, tensor_cores ? "cg_matmul_tile_mma" : op.source_function);
  }
  ek.block = int(matmul_tile_threads(a.buffer->dtype));
  ek.min_blocks_per_sm = 1;  // few blocks, each two matmuls' tiles: registers before occupancy
  ek.grid[1] = int((M + tile - 1) / tile);
  // Shared memory, as the fusion pass bounded it.
  const MatmulChainShared smem = matmul_chain_shared(a.buffer->dtype, vt, H, buffer_name(value.bound->buffer));
  use_shared(ek, smem.layout);
  const int64_t value_at = smem.value;
  // The value's element (m, column) in the block's rows, kept as it would have been stored.
  auto kept = [&](const std::string& column) {
    return fmt::format("cg_value[(cg_i64)(m - tile.y * {}) * {} + {}]", tile, H, column);
  };

  std::vector<LaunchParam> prologue_params;
  if (!k.prologue.empty()) prologue_params = prologue(k);
  const int computed = k.prologue.empty() ? -1 : p_.tasks[size_t(t1)].find_tensor(k.prologue_operand)->buffer;
  if (!operand_prologue_.empty()) prologue_buffer_ = computed;
  const std::string a_index = fmt::format("a_base + (cg_i64)m * {} + k", K);
  std::string element_a = load_as(a, id1 + "_a", a_index), norm_code;
  if (prologue_task_ >= 0) {
    const NormLoad norm = norm_load(M, K, int(tile), a_index, ek);
    element_a = norm.element;
    norm_code = norm.code;
  }
  const std::string element_b1 = load_as(b1, id1 + "_b", b_index(arg_bool(t1, "trans_b"), K, H)),
                    element_b2 = load_as(b2, id2 + "_b", b_index(arg_bool(t2, "trans_b"), H, N));
  // The first product's epilogue ends in shared memory; the second's
  // stores what is read outside the kernel.
  Epilogue first_tail, second_tail;
  std::string keep = fmt::format("{} = {}", kept("n"), narrow_to(vt, scaled_accumulator(t1)));
  // (Read later too, the value is stored as well: the epilogue does both.)
  const bool first_epilogue = !first_stage.chain.empty() || !contains(k.internal_buffers, value.bound->buffer);
  if (first_epilogue) {
    first_tail = epilogue(k, out1, {.lambda = "cg_value_epilogue",
                                    .anchor_name = id1 + "_out",
                                    .keep = fmt::format("cg_value[i - value_base] = {}", narrow_to(vt, "{}")),
                                    .kept_buffer = value.bound->buffer});
    keep = fmt::format("cg_value_epilogue((cg_i64)m * {} + n, {})", H, scaled_accumulator(t1));
  }
  std::string store_out = store_element(id2 + "_out", out2.buffer->dtype, fmt::format("(cg_i64)m * {} + n", N), scaled_accumulator(t2));
  if (!second_stage.chain.empty()) {
    second_tail = epilogue(k, out2, {.anchor_name = id2 + "_out"});
    store_out = fmt::format("cg_epilogue((cg_i64)m * {} + n, {})", N, scaled_accumulator(t2));
  }
  if (!diags_.ok()) return {};
  const std::string t1_type = tensor_cores ? c_type(a.buffer->dtype) : "float";
  const std::string t2_type = tensor_cores ? c_type(vt) : "float";
  std::string body = fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  const cg_i64 a_base = 0;  // every row of every batch, flattened\n"
      "  {0}* cg_value = ({0}*)(cg_smem + {1});  // the block's rows of {2}\n"
      "{22}"
      "{5}"
      "  // {6}: the block's rows, every column tile, into shared memory.\n"
      "  for (int cg_column = 0; cg_column < {7}; ++cg_column)\n"
      "    {8}(\n"
      "        [&](int m, int k) {{ return {9}; }},\n"
      "        [&](int k, int n) {{ return {10}; }},\n"
      "        [&](int m, int n, float acc) {{ {11}; }},\n"
      "        {12}, {4}, {13}, tile.y, cg_column, ({14}*)cg_smem);\n"
      "  __syncthreads();  // every column of the rows is in shared memory before {15} reads them\n"
      "  // {15}: the block's rows, from shared memory.\n"
      "  for (int cg_column = 0; cg_column < {16}; ++cg_column)\n"
      "    {8}(\n"
      "        [&](int m, int k) {{ return {17}; }},\n"
      "        [&](int k, int n) {{ return {18}; }},\n"
      "        [&](int m, int n, float acc) {{ {19}; }},\n"
      "        {12}, {20}, {4}, tile.y, cg_column, ({21}*)cg_smem);\n",
      c_type(vt), value_at, buffer_name(value.bound->buffer), tile, H, norm_code, id1, (H + tile - 1) / tile,
      tile_function, element_a, element_b1, keep, M, K, t1_type, id2, (N + tile - 1) / tile,
      widen_from(vt, kept("k")), element_b2, store_out, N, t2_type,
      (first_epilogue ? fmt::format("  const cg_i64 value_base = (cg_i64)tile.y * {} * {};\n", tile, H) : std::string()) +
          first_tail.code + second_tail.code);
  prologue_task_ = -1;
  prologue_stores_ = false;
  prologue_buffer_ = -1;
  const std::string operand_prologue = std::exchange(operand_prologue_, {});

  std::vector<LaunchParam> launch;
  auto add = [&](const std::string& name, const Param& x) {
    if (contains(k.internal_buffers, x.bound->buffer) || x.bound->buffer == computed) return;
    launch.push_back(buffer_param(name, x));
  };
  add(id1 + "_a", a);
  add(id1 + "_b", b1);
  add(id1 + "_out", out1);  // where read later (saved for the backward pass)
  add(id2 + "_b", b2);
  add(id2 + "_out", out2);
  launch.insert(launch.end(), prologue_params.begin(), prologue_params.end());
  for (const Epilogue* tail : {&first_tail, &second_tail})
    launch.insert(launch.end(), tail->params.begin(), tail->params.end());
  std::string code = kernel_functions(comment(k, launch, ek), ek, launch,
                                      operand_prologue + body);
  record_launch(ek, std::move(launch));
  // Tiles own whole rows of the first product's input and the second's
  // output, and of what either epilogue reads at their elements.
  mark_rows(t1, ps1, k.prologue_operand == "a" ? prologue_params : std::vector<LaunchParam>{}, first_tail.params,
            launch_params_.back(), ek);
  mark_rows(t2, ps2, {}, second_tail.params, launch_params_.back(), ek);
  emitted.push_back(ek);
  return code;
}

// Rule row_reduction (fuse.h): value = op(a @ b) (its epilogue), then
// reductions of the value over its rows: sums over the rows (a bias
// gradient), x^T @ value (a weight gradient). A block owns a column tile
// of the value: it computes the tiles of rows one after another, keeps
// each in shared memory as the epilogue leaves it (in the value's type),
// and adds its rows, in order, into its columns of every reduction, which
// its threads hold in registers (f32) and store at the end. The value
// reaches memory only where read elsewhere (the epilogue then stores it
// as well); a weight gradient's x is read once per column tile.
std::string Emitter::row_reduction(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
  // The IR's stages (kir.h): the product (and its epilogue's chain), then the reductions.
  const int t = k.ir.stages.front().task;
  std::vector<int> reductions;
  for (size_t s = 1; s < k.ir.stages.size(); ++s) reductions.push_back(k.ir.stages[s].task);
  const std::vector<Param> ps = params(t);
  if (!diags_.ok()) return {};
  const Param& a = param(ps, "a");
  const Param& b = param(ps, "b");
  const Param& out = param(ps, "out");
  if (!check_f32_accumulation(t, a)) return {};
  const BoundTask& bt = p_.tasks[size_t(t)];
  const std::string id = bt.task->id;
  EmittedKernel ek = emitted_kernel(k);
  const Shape& so = out.buffer->shape;
  const int64_t N = so.back(), M = numel(so) / N, K = a.buffer->shape.back();
  const BoundTask& first_reduction = p_.tasks[size_t(reductions.front())];
  const int value = first_reduction.find_tensor(is_op(first_reduction, BundledOp::matmul) ? "b" : "x")->buffer;
  const DType vt = p_.buffers[size_t(value)].dtype;
  const bool tensor_cores = is_16bit(a.buffer->dtype);
  const int64_t tile = matmul_tile_rows(a.buffer->dtype), row_tiles = (M + tile - 1) / tile;
  template_files_.insert(bt.op->source_file);
  use_function(*bt.op, tensor_cores ? "cg_matmul_tile_mma" : bt.op->source_function);
  ek.block = int(matmul_tile_threads(a.buffer->dtype));
  ek.min_blocks_per_sm = 1;  // a block per column tile, each every tile of rows: registers before occupancy
  ek.grid[0] = int((N + tile - 1) / tile);
  // Shared memory, as the fusion pass bounded it: each weight gradient's x rows after the value's tile.
  std::vector<int64_t> x_widths;
  std::vector<std::string> x_names;
  for (int r : reductions)
    if (const BoundTask& rt = p_.tasks[size_t(r)]; rt.op->pattern == PatternKind::matmul) {
      x_widths.push_back(p_.buffers[size_t(rt.find_tensor("out")->buffer)].shape.front());
      x_names.push_back(buffer_name(rt.find_tensor("a")->buffer));
    }
  const RowReductionShared smem = row_reduction_shared(a.buffer->dtype, vt, x_widths, buffer_name(value), x_names);
  use_shared(ek, smem.layout);
  const int64_t value_at = smem.value;

  // The epilogue ends in shared memory (and stores what is read elsewhere).
  Epilogue tail;
  std::string keep = fmt::format("cg_value[(m - cg_row0) * {} + n - cg_col0] = {}", tile, narrow_to(vt, scaled_accumulator(t)));
  if (!k.ir.stages.front().chain.empty() || !contains(k.internal_buffers, out.bound->buffer)) {
    tail = epilogue(k, out,
                    {.anchor_name = id + "_out",
                     .keep = fmt::format("cg_value[(i / {0} - cg_row0) * {1} + i % {0} - cg_col0] = {2}", N, tile,
                                         narrow_to(vt, "{}")),
                     .kept_buffer = value});
    keep = fmt::format("cg_epilogue((cg_i64)m * {} + n, {})", N, scaled_accumulator(t));
  }

  std::vector<LaunchParam> launch;
  auto add = [&](const std::string& name, const Param& x) {
    if (contains(k.internal_buffers, x.bound->buffer)) return;
    launch.push_back(buffer_param(name, x));
  };
  add(id + "_a", a);
  add(id + "_b", b);
  add(id + "_out", out);
  launch.insert(launch.end(), tail.params.begin(), tail.params.end());

  // Each reduction: `outputs` rows of N columns (1 for a sum, a weight
  // gradient's K), of which a block holds its tile's columns, `per_thread`
  // to a thread: output o of the block is row o / tile, column o % tile.
  std::string accumulators, stage, accumulate, stores;
  size_t weight_gradients = 0;
  for (int r : reductions) {
    const std::vector<Param> rps = params(r);
    if (!diags_.ok()) return {};
    const BoundTask& rt = p_.tasks[size_t(r)];
    const std::string rid = rt.task->id, acc = "cg_acc_" + rid;
    const bool weight_gradient = rt.op->pattern == PatternKind::matmul;  // a^T @ value; else a sum over the rows
    const Param& rout = param(rps, "out");
    const int64_t outputs = weight_gradient ? rout.buffer->shape.front() : 1;
    const int64_t per_thread = row_reduction_registers(outputs, a.buffer->dtype);
    std::string term = widen_from(vt, fmt::format("cg_value[r * {} + c]", tile));
    if (weight_gradient) {
      // x's rows of the tile, staged: a warp's threads read one of them at once.
      const Param& x = param(rps, "a");
      if (!check_f32_accumulation(r, x)) return {};
      add(rid + "_a", x);
      const int64_t x_at = smem.x_rows.at(weight_gradients++);
      accumulators += fmt::format("  float* cg_rows_{} = (float*)(cg_smem + {});  // {}'s rows of the tile\n", rid, x_at,
                                  buffer_name(x.bound->buffer));
      stage += fmt::format("    for (int e = threadIdx.x; e < cg_rows * {0}; e += blockDim.x) cg_rows_{1}[e] = {2};\n",
                           outputs, rid, load_as(x, rid + "_a", fmt::format("(cg_i64)cg_row0 * {} + e", outputs)));
      term = fmt::format("cg_rows_{}[r * {} + j] * {}", rid, outputs, term);
    }
    add(rid + "_out", rout);
    const std::string alpha = weight_gradient ? float_arg(r, "alpha", 1.0) : float_literal(1.0);
    accumulators += fmt::format("  float {}[{}] = {{}};  // {} ({}): {} x {} columns\n", acc, per_thread, rid,
                                rt.op->name, outputs, tile);
    // `statement` on each of the thread's outputs: row j (of a weight
    // gradient), column c of the tile.
    auto each_output = [&](const std::string& indent, const std::string& statement) {
      return fmt::format(
          "{0}for (int cg_k = 0; cg_k < {1}; ++cg_k) {{\n"
          "{0}  const int o = threadIdx.x + cg_k * blockDim.x, {2}c = o % {3};\n"
          "{0}  if (o < {4} && cg_col0 + c < {5}) {6}\n"
          "{0}}}\n",
          indent, per_thread, weight_gradient ? fmt::format("j = o / {}, ", tile) : "", tile, outputs * tile, N,
          statement);
    };
    accumulate += each_output("    ", fmt::format("for (int r = 0; r < cg_rows; ++r) {}[cg_k] += {};", acc, term));
    const std::string total = alpha == float_literal(1.0) ? acc + "[cg_k]" : fmt::format("{} * {}[cg_k]", alpha, acc);
    stores += each_output(
        "  ", store_element(rid + "_out", rout.buffer->dtype,
                            weight_gradient ? fmt::format("(cg_i64)j * {} + cg_col0 + c", N) : "cg_col0 + c", total) +
                  ";");
  }
  const std::string matmul_tile = fmt::format(
      "    {}(\n"
      "        [&](int m, int k) {{ return {}; }},\n"
      "        [&](int k, int n) {{ return {}; }},\n"
      "        [&](int m, int n, float acc) {{ {}; }},\n"
      "        {}, {}, {}, cg_tile_m, tile.x, ({}*)cg_smem);\n",
      tensor_cores ? "cg_matmul_tile_mma<64, 64, 16>" : "cg_matmul_tile<32, 32, 16>",
      load_as(a, id + "_a", fmt::format("(cg_i64)m * {} + k", K)),
      load_as(b, id + "_b", b_index(arg_bool(t, "trans_b"), K, N)), keep, M, N, K,
      tensor_cores ? c_type(a.buffer->dtype) : "float");
  const std::string value_name = buffer_name(value);
  std::string body = fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  {0}* cg_value = ({0}*)(cg_smem + {1});  // a tile of {2}\n"
      "  const int cg_col0 = tile.x * {3};  // the block's columns of {2}\n"
      "  int cg_row0 = 0;\n",
      c_type(vt), value_at, value_name, tile);
  body += accumulators + tail.code;
  body += fmt::format("  for (int cg_tile_m = 0; cg_tile_m < {}; ++cg_tile_m) {{\n", row_tiles);
  body += fmt::format("    cg_row0 = cg_tile_m * {};\n", tile) + matmul_tile;
  body += fmt::format("    const int cg_rows = {0} - cg_row0 < {1} ? {0} - cg_row0 : {1};\n", M, tile) + stage;
  body += fmt::format("    __syncthreads();  // the tile of {} is in shared memory\n", value_name) + accumulate;
  body += "    __syncthreads();  // the next tile of rows overwrites it\n  }\n";
  body += "  // Each reduction's columns, summed over every row.\n" + stores;
  return finish_kernel(k, ek, std::move(launch), body, emitted);
}

std::string Emitter::matmul(int t, const GemmMainloop& gemm, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& a = param(ps, "a");
  const Param& b = param(ps, "b");
  const Param& out = param(ps, "out");
  if (!check_f32_accumulation(t, a)) return {};
  const bool ta = arg_bool(t, "trans_a"), tb = arg_bool(t, "trans_b");
  const Shape& so = out.buffer->shape;
  int64_t M = so[so.size() - 2];
  const int64_t N = so.back();
  const Shape& sa = a.buffer->shape;
  const int64_t K = ta ? sa[sa.size() - 2] : sa.back();
  Shape batch_out(so.begin(), so.end() - 2), batch_a(sa.begin(), sa.end() - 2),
      batch_b(b.buffer->shape.begin(), b.buffer->shape.end() - 2);
  // [B, T, K] @ [K, N] (a projection of every token) is one [B * T, K] @ [K, N]:
  // fewer, fuller tiles, and a row of output tiles owns whole rows.
  if (matmul_flattens_rows(sa, b.buffer->shape, so, ta)) {
    M *= numel(batch_out);
    batch_out.clear();
    batch_a.clear();
    batch_b.clear();
  }
  const int64_t batches = numel(batch_out);
  // The batch is tile.z, or with split-K tile.z / splits (pipelined_matmul).
  auto batch_bases_of = [&](const std::string& z) {
    return fmt::format(
        "  const cg_i64 z = {5};\n"
        "  const cg_i64 a_base = {0} * {1}, b_base = {2} * {3}, out_base = z * {4};\n",
        broadcast_index(batch_out, batch_a, "z"), M * K, broadcast_index(batch_out, batch_b, "z"), K * N, M * N, z);
  };
  const std::string batch_bases = batch_bases_of("tile.z");
  // The mainloop the fusion pass chose (KernelGroup::gemm): Hopper,
  // pipelined or SIMT in a launch of its own; none in a shared launch, a
  // megakernel, or under a prologue.
  std::string why_not_pipelined = !gemm.why_not_pipelined.empty() || gemm.launched_alone() ? gemm.why_not_pipelined
                                  : !global_wrapper_ ? "it shares its launch with other kernels"
                                                     : "no fusion pass decided a mainloop for it";
  if (gemm.launched_alone() && (!global_wrapper_ || prologue_task_ >= 0 || prologue_buffer_ >= 0)) {
    fail(t, "", fmt::format("internal error: the fusion pass chose the {} mainloop for a kernel that does not read its "
                            "operands as stored in a launch of its own",
                            gemm.name()),
         "an internal error of cudagen: please report it with the graph");
    return {};
  }
  const std::optional<GemmTile>& pipelined = gemm.pipelined;
  const std::optional<SgemmTile>& simt = gemm.simt;
  std::string why_not_hopper = gemm.why_not_hopper.empty() ? why_not_pipelined : gemm.why_not_hopper;
  const HopperGemm* hopper = hopper_taken(gemm, t);
  if (gemm.hopper && hopper == nullptr)
    why_not_hopper = "an operand's arena offset is no multiple of 16 bytes, which TMA needs (--alignment)";
  if (hopper) return hopper_matmul(t, a, b, out, *hopper, ek);
  const std::optional<Arch> target = parse_arch(options_.arch);
  const std::string not_hopper =
      target && target->has_wgmma() ? fmt::format("; not on the Hopper mainloop: {}", why_not_hopper) : std::string();
  if (simt) {
    std::string body = simt_matmul(t, a, b, out, *simt, M, N, K, ta, tb, batches, batch_bases, ek);
    ek.matmul_path += not_hopper;
    return body;
  }
  if (pipelined) {
    std::string body = pipelined_matmul(t, a, b, out, *pipelined, M, N, K, ta, tb, batches,
                                        pipelined->split_k > 1
                                            ? batch_bases_of(fmt::format("tile.z / {}", pipelined->split_k))
                                            : batch_bases,
                                        ek);
    ek.matmul_path += not_hopper;
    return body;
  }
  // 16-bit operands go to the tensor-core tile (64 x 64, 4 warps), f32 ones
  // to the portable tile (32 x 32, 256 threads): f32 stays off tensor cores,
  // whose TF32 would break the f32 bound (docs/architecture.md §9).
  const OpSignature& op = *p_.tasks[size_t(t)].op;
  const DType tile_type = matmul_tile_dtype(op, a.buffer->dtype);
  const bool tensor_cores = is_16bit(tile_type);
  ek.mainloop = tensor_cores ? MatmulMainloop::tensor_core_tile : MatmulMainloop::portable_tile;
  ek.matmul_path = (tensor_cores          ? "the 64 x 64 tile (templates/matmul.cuh): " + why_not_pipelined
                    : !is_op(op, BundledOp::matmul) ? fmt::format("the op's own function, {}: {}", op.source_function, why_not_pipelined)
                                          : "the portable f32 tile (templates/matmul.cuh): " + why_not_pipelined) +
                   not_hopper;
  const int tile = int(matmul_tile_rows(tile_type));
  ek.block = int(matmul_tile_threads(tile_type));
  ek.tile_rows = tile;
  ek.grid[0] = int((N + tile - 1) / tile);
  ek.grid[1] = int((M + tile - 1) / tile);
  ek.grid[2] = int(batches);
  reserve_shared(ek, "the operand tiles", matmul_operand_tile_bytes(tile_type));
  if (tensor_cores) entry_function_ = "cg_matmul_tile_mma";
  std::string load_a = ta ? fmt::format("(cg_i64)k * {} + m", M) : fmt::format("(cg_i64)m * {} + k", K);
  std::string load_b = b_index(tb, K, N);
  std::string scaled = scaled_accumulator(t);
  std::string element_a = load(a, "a_base + " + load_a), prologue;
  if (prologue_task_ >= 0) {
    const NormLoad norm = norm_load(M, K, tile, "a_base + " + load_a, ek);
    element_a = norm.element;
    prologue = norm.code;
  }
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "{0}"
      "{1}"
      "  {2}(\n"
      "      [&](int m, int k) {{ return {3}; }},\n"
      "      [&](int k, int n) {{ return {4}; }},\n"
      "      [&](int m, int n, float acc) {{ {5}; }},\n"
      "      {6}, {7}, {8}, tile.y, tile.x, ({9}*)cg_smem);\n",
      batch_bases, prologue, tensor_cores ? "cg_matmul_tile_mma<64, 64, 16>" : op.source_function + "<32, 32, 16>",
      element_a, load(b, "b_base + " + load_b), store(out, fmt::format("out_base + (cg_i64)m * {} + n", N), scaled),
      M, N, K, tensor_cores ? c_type(a.buffer->dtype) : "float");
}

// A matmul on the Hopper mainloop (templates/gemm_sm90.cuh, sm_90a): the
// operands come by TMA through two tensor maps passed by value (the host
// launcher or the runtime encodes them from the arena's address), each
// result element goes through the store (where an epilogue chain follows).
// Rows of a batched a are folded into M. Persistent: as many blocks as the
// GPU holds at once, each looping over tiles (the launcher sizes the grid
// from the GPU's SMs; the grid here is the target's).
std::string Emitter::hopper_matmul(int t, const Param& a, const Param& b, const Param& out, const HopperGemm& g,
                                   EmittedKernel& ek) {
  const OpSignature& op = *p_.tasks[size_t(t)].op;
  entry_function_ = "cg_gemm_sm90";
  use_function(op, "cg_sm90_gemm_config");
  ek.block = g.threads();
  // setmaxnreg needs a register cap (cg_sm90_gemm_config::MIN_BLOCKS): one
  // block an SM of two consumers, two of one.
  ek.min_blocks_per_sm = g.blocks_per_sm();
  ek.persistent_tiles = g.tiles();
  ek.hopper = g;
  const int64_t sms = device_model(options_.target()).sms;
  if (g.stream_k) ek.stream_k_grid = g.stream_k_grid(sms);
  ek.grid[0] = persistent_grid(persistent_most_blocks(ek), ek.min_blocks_per_sm, sms);
  ek.grid[1] = 1;
  ek.grid[2] = 1;
  ek.tile_rows = g.rows();
  ek.mainloop = MatmulMainloop::hopper;
  ek.matmul_path = "the Hopper mainloop (templates/gemm_sm90.cuh), " + g.describe();
  reserve_shared(ek,
                 fmt::format("{} stages of both operands' tiles from a 1024-byte boundary, their barriers, then "
                             "each consumer warp's rows of results",
                             g.stages()),
                 g.shared_bytes());
  const int element = 2;
  const TensorMapSpec map_a{plan_.buffers[size_t(a.bound->buffer)].offset, element, g.K, g.M, g.K * element, 64,
                            g.rows()};
  const int64_t b_offset = plan_.buffers[size_t(b.bound->buffer)].offset;
  const TensorMapSpec map_b = g.b_k_major ? TensorMapSpec{b_offset, element, g.K, g.N, g.K * element, 64, g.columns}
                                          : TensorMapSpec{b_offset, element, g.N, g.K, g.N * element, 64, 64};
  // In place of the operands' pointers (emit_kernel leaves those out).
  extra_params_.push_back(
      LaunchParam{a.bound->name + "_map", "const cg_tensor_map", a.bound->buffer, nullptr, false, -1, 0, map_a});
  extra_params_.push_back(
      LaunchParam{b.bound->name + "_map", "const cg_tensor_map", b.bound->buffer, nullptr, false, -1, 0, map_b});
  const std::string maps = param_name(extra_params_[extra_params_.size() - 2]) + ", " + param_name(extra_params_.back());
  // Stream-K's partial sums and counters, in the workspace split-K shares
  // (plan_split_k_workspace sizes it for the target's grid, which no launch exceeds).
  std::string workspace = "{nullptr, nullptr, 0}";
  if (g.stream_k) {
    extra_params_.push_back(LaunchParam{"cg_partials", "float", -1, nullptr, true, split_k_.partials_offset,
                                        g.stream_k_partial_bytes(ek.stream_k_grid), std::nullopt,
                                        g.stream_k_partial_tiles(ek.stream_k_grid) * g.rows() * g.columns * 4});
    extra_params_.push_back(LaunchParam{"cg_arrivals", "unsigned int", -1, nullptr, true, split_k_.arrivals_offset,
                                        g.stream_k_arrival_bytes(ek.stream_k_grid)});
    workspace = fmt::format("{{cg_partials, cg_arrivals, {}}}", ek.stream_k_grid);
  }
  const std::string store_acc = store(out, fmt::format("m * {} + n", g.N), scaled_accumulator(t));
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  // The Hopper mainloop: {0}.\n"
      "{13}"
      "  cg_gemm_sm90<cg_sm90_gemm_config<{1}, {2}, {12}>, {3}, {4}, {11}>(\n"
      "      {5}, {6}, {7}, {8}, blockIdx.x, gridDim.x, cg_smem, {9},\n"
      "      [&](cg_i64 m, cg_i64 n, float acc) {{ {10}; }});\n",
      g.describe(), g.stages(), g.consumers, c_type(a.buffer->dtype), g.b_k_major ? "true" : "false", maps, g.M, g.N,
      g.K, workspace, store_acc, g.stream_k ? "true" : "false", g.columns,
      shared_bytes_agree(fmt::format("cg_sm90_gemm_config<{}, {}, {}>", g.stages(), g.consumers, g.columns),
                         g.shared_bytes()));
}

// A matmul on the pipelined mainloop (templates/gemm.cuh): the block's
// output tile is computed in registers, then each pair of adjacent
// accumulators goes through the store (where an epilogue chain follows).
std::string Emitter::pipelined_matmul(int t, const Param& a, const Param& /*b*/, const Param& out, const GemmTile& g, int64_t M,
                                      int64_t N, int64_t K, bool ta, bool tb, int64_t batches, const std::string& batch_bases,
                                      EmittedKernel& ek) {
  entry_function_ = "cg_gemm_mainloop";
  ek.matmul_path = fmt::format("the pipelined mainloop (templates/gemm.cuh), {} (rule {} of templates/gemm_tuning.json)",
                               g.describe(), g.rule + 1);
  // f32 operands are read as cg_tf32, the bits the mainloop rounds to TF32
  // (a type of the mainloop's closure, through cg_mma_packed).
  const std::string type = g.tf32() ? "cg_tf32" : c_type(a.buffer->dtype);
  const auto mainloop = [&](const std::string& k_begin, const std::string& k_end) {
    return fmt::format(
        "  cg_gemm_mainloop<cg_config, {0}, {1}, {2}>(cg_acc, (const {0}*)(a + a_base), {3}, (const {0}*)(b + b_base), {4},\n"
        "                                             {5}, {6}, {7}, {8}, tile.y, tile.x, ({0}*)cg_smem);\n",
        type, ta ? "false" : "true", tb ? "true" : "false", ta ? M : K, tb ? K : N, M, N, k_begin, k_end);
  };
  return pipelined_gemm(t, out, g, M, N, K, batches, batch_bases, mainloop, ek);
}

// The kernel around a pipelined mainloop (a matmul's, or a convolution's
// implicit GEMM): `mainloop(k_begin, k_end)` is its call, into cg_acc, for a
// batch of M x N x K products at out_base (batch_bases defines it, and z,
// the batch), their rows ldd elements apart (N where negative: a group's
// columns of a grouped convolution's output lie in rows of all groups'), or
// where `rows` maps them (M then the most a batch has). Whole, a block runs
// all of k and hands its tile to the store through shared memory; split,
// its part of k, and the last block of the tile adds the parts and stores.
std::string Emitter::pipelined_gemm(int t, const Param& out, const GemmTile& g, int64_t M, int64_t N, int64_t K,
                                    int64_t batches, const std::string& batch_bases,
                                    const std::function<std::string(const std::string&, const std::string&)>& mainloop,
                                    EmittedKernel& ek, int64_t ldd, const GemmRows* rows) {
  if (ldd < 0) ldd = N;
  const std::string row_count = rows != nullptr ? rows->count : std::to_string(M);
  const std::string row = rows != nullptr ? rows->row : "m";
  use_function(*p_.tasks[size_t(t)].op, "cg_gemm_config");
  ek.block = g.threads();
  ek.min_blocks_per_sm = 1;  // the accumulators and fragments take most of the registers
  ek.grid[0] = (N + g.bn - 1) / g.bn;
  ek.grid[1] = (M + g.bm - 1) / g.bm;
  ek.grid[2] = batches * g.split_k;
  ek.tile_rows = g.bm;
  ek.mainloop = g.tf32() ? MatmulMainloop::pipelined_tf32 : MatmulMainloop::pipelined;
  reserve_shared(ek, fmt::format("{} stages of both operands' tiles", g.stages), g.shared_bytes());
  const std::string store_acc = store(out, fmt::format("out_base + {} * {} + n", row, ldd), scaled_accumulator(t));
  std::string part, k_range, k_begin = "0", k_end = std::to_string(K), results;
  if (g.split_k > 1) {
    use_function(*p_.tasks[size_t(t)].op, "cg_gemm_split_k");
    const int64_t k_per_split = g.k_tiles_per_split * g.bk;
    extra_params_ = {
        LaunchParam{"cg_partials", "float", -1, nullptr, true, split_k_.partials_offset,
                    batches * g.split_k * M * N * 4},
        LaunchParam{"cg_arrivals", "unsigned int", -1, nullptr, true, split_k_.arrivals_offset,
                    batches * ek.grid[0] * ek.grid[1] * 4}};
    part = ": this block's part of k";
    k_range = fmt::format(
        "  const int cg_split = (int)(tile.z % {0});\n"
        "  const cg_i64 cg_k_begin = cg_split * (cg_i64){1};\n"
        "  const cg_i64 cg_k_end = cg_k_begin + {1} < {2} ? cg_k_begin + {1} : {2};\n",
        g.split_k, k_per_split, K);
    k_begin = "cg_k_begin";
    k_end = "cg_k_end";
    results = fmt::format(
        "  // The parts' sums, added in split order by the block that finishes last.\n"
        "  cg_gemm_split_k<cg_config>(cg_acc, {0}, {1}, tile.y, tile.x, cg_split, {2},\n"
        "                             cg_partials + z * {3}, cg_arrivals + (z * {4} + tile.y) * {5} + tile.x,\n"
        "                             (unsigned int*)cg_smem, [&](cg_i64 m, cg_i64 n, float acc) {{ {6}; }});\n",
        row_count, N, g.split_k, g.split_k * M * N, ek.grid[1], ek.grid[0], store_acc);
  } else {
    results = staged_results("cg_gemm", t, out, M, N, ldd, rows);
  }
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "{0}"
      "  // The pipelined mainloop: {1}{2}.\n"
      "{3}"
      "  typedef cg_gemm_config<{4}> cg_config;\n"
      "  cg_gemm_accumulators<cg_config> cg_acc;\n"
      "{5}"
      "{6}",
      batch_bases, g.describe(), part, k_range, g.arguments(), mainloop(k_begin, k_end), results);
}

// An f32 matmul on the SIMT mainloop (templates/gemm.cuh): 8 x 8 outputs a
// thread, the results through shared memory into the store (and an
// epilogue chain) in an order that coalesces.
std::string Emitter::simt_matmul(int t, const Param& /*a*/, const Param& /*b*/, const Param& out, const SgemmTile& g, int64_t M,
                                 int64_t N, int64_t K, bool ta, bool tb, int64_t batches, const std::string& batch_bases,
                                 EmittedKernel& ek) {
  entry_function_ = "cg_sgemm_mainloop";
  use_function(*p_.tasks[size_t(t)].op, "cg_sgemm_config");
  ek.block = g.threads();
  // 64 accumulators, 16 operands and 8 prefetched values a thread: capped at
  // 128 registers (2 blocks of 256 an SM), nvcc spills on sm_90; free, it
  // takes 141 (sm_80) to 163 (sm_90).
  ek.min_blocks_per_sm = 1;
  ek.grid[0] = (N + g.bn - 1) / g.bn;
  ek.grid[1] = (M + g.bm - 1) / g.bm;
  ek.grid[2] = batches;
  ek.tile_rows = g.bm;
  ek.mainloop = MatmulMainloop::simt;
  ek.matmul_path = fmt::format("the f32 SIMT mainloop (templates/gemm.cuh), {}", g.describe());
  reserve_shared(ek, "two stages of both operands' tiles, then the results", g.shared_bytes());
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "{0}"
      "  // The f32 SIMT mainloop: {1}.\n"
      "  typedef cg_sgemm_config<{2}> cg_config;\n"
      "  cg_sgemm_accumulators<cg_config> cg_acc;\n"
      "  cg_sgemm_mainloop<cg_config, {3}, {4}>(cg_acc, a + a_base, {5}, b + b_base, {6}, {7}, {8}, {9},\n"
      "                                        tile.y, tile.x, (float*)cg_smem);\n"
      "{10}",
      batch_bases, g.describe(), g.arguments(), ta ? "false" : "true", tb ? "true" : "false", ta ? M : K, tb ? K : N, M,
      N, K, staged_results("cg_sgemm", t, out, M, N));
}

// A mainloop's output tile through shared memory (`mainloop`: cg_gemm or
// cg_sgemm), so that its stores and an epilogue's loads coalesce: 16 bytes
// a lane (each_coalesced_vector) where the epilogue has a vector form
// (Epilogue::vector_code), or where none follows and 16 bytes of the
// output's type divide its rows; otherwise an element a lane.
std::string Emitter::staged_results(const std::string& mainloop, int t, const Param& out, int64_t M, int64_t N,
                                    int64_t ldd, const GemmRows* rows) {
  if (ldd < 0) ldd = N;
  const std::string row_count = rows != nullptr ? rows->count : std::to_string(M);
  const std::string at = fmt::format("out_base + {} * {} + n", rows != nullptr ? rows->row : "m", ldd);
  const OpSignature& op = *p_.tasks[size_t(t)].op;
  const bool chained = out.bound->buffer == epilogue_buffer_;
  const int own_width = int(16 / dtype_bytes(out.buffer->dtype));
  // (A user's matmul op may provide the mainloop without the vector walk.)
  const bool has_walk = op.closure_of(mainloop + "_each_coalesced_vector") != nullptr;
  int width = !has_walk ? 0
              : chained ? epilogue_vector_width_
              : (own_width == 4 || own_width == 8) && N % own_width == 0 ? own_width
                                                                         : 0;
  // Rows ldd apart in a wider tensor (a group's columns of a grouped
  // convolution's output): groups of `width` must lie inside this product's
  // N columns and start aligned.
  if (ldd != N && width != 0 && (N % width != 0 || ldd % width != 0)) width = 0;
  if (width == 0) {
    use_function(op, mainloop + "_each_coalesced");
    return fmt::format(
        "  // The output tile through shared memory, so that its stores (and an\n"
        "  // epilogue's loads) coalesce.\n"
        "  {0}_each_coalesced<cg_config>(cg_acc, {1}, {2}, tile.y, tile.x, (float*)cg_smem,\n"
        "      [&](cg_i64 m, cg_i64 n, float acc) {{ {3}; }});\n",
        mainloop, row_count, N, store(out, at, scaled_accumulator(t)));
  }
  use_function(op, mainloop + "_each_coalesced_vector");
  std::string to;
  if (chained) {
    vector_epilogue_used_ = true;
    to = fmt::format("cg_epilogue_vector({}, cg_v);", at);
  } else {
    to = store_vector_code(out, width, at, "cg_v");
  }
  return fmt::format(
      "  // The output tile through shared memory, so that its stores (and an\n"
      "  // epilogue's loads) coalesce, {0} values (16 bytes or less) a lane.\n"
      "  {1}_each_coalesced_vector<cg_config, {0}>(cg_acc, {2}, {3}, tile.y, tile.x, (float*)cg_smem,\n"
      "      [&](cg_i64 m, cg_i64 n, const float* cg_acc_w) {{\n"
      "        float cg_v[{0}];\n"
      "        CG_UNROLL\n"
      "        for (int w = 0; w < {0}; ++w) {{\n"
      "          const float acc = cg_acc_w[w];\n"
      "          cg_v[w] = {4};\n"
      "        }}\n"
      "        {5}\n"
      "      }});\n",
      width, mainloop, row_count, N, scaled_accumulator(t), to);
}

std::string Emitter::stored_norm_rows(const StoredNorm& n) const {
  const BoundTask& nt = p_.tasks[size_t(n.norm)];
  const std::string& id = nt.task->id;
  auto dtype = [&](const std::string& slot) { return p_.buffers[size_t(nt.find_tensor(slot)->buffer)].dtype; };
  std::string code = fmt::format(
      "  if ({0}) {{  // {1}'s output{2}, read later: stored once{3}\n"
      "    for (int i = threadIdx.x; i < {4} * {5}; i += blockDim.x) {{\n"
      "      const cg_i64 r = {6} + i / {5};\n"
      "      const int j = i % {5};\n"
      "      {7}{8};\n"
      "    }}\n",
      n.owner, id, n.stats.empty() ? "" : fmt::format(" and {}", fmt::join(n.stats, ", ")), n.who, n.rows, n.K,
      n.row0, n.end.empty() ? "" : fmt::format("if (r < {}) ", n.end),
      store_element(id + "_out", dtype("out"), fmt::format("r * {} + j", n.K), n.element));
  if (!n.stats.empty()) {
    code += fmt::format("    for (int r = threadIdx.x; r < {}; r += blockDim.x){}{{", n.rows,
                        n.end.empty() ? " " : fmt::format("\n      if ({} + r < {}) ", n.row0, n.end));
    for (const std::string& stat : n.stats)
      code += " " + store_element(id + "_" + stat, dtype(stat), fmt::format("{} + r", n.row0), n.stat_at(stat)) + ";";
    code += " }\n";
  }
  return code + "  }\n";
}

Emitter::NormLoad Emitter::norm_load(int64_t M, int64_t K, int tile, const std::string& a_index, EmittedKernel& ek) {
  NormLoad out;
  const BoundTask& norm = p_.tasks[size_t(prologue_task_)];
  const bool layer = norm.op->norm == "layer";
  const std::string id = norm.task->id, x = id + "_x";
  auto slot_type = [&](const char* slot) { return p_.buffers[size_t(norm.find_tensor(slot)->buffer)].dtype; };
  auto param_load = [&](const char* slot, const std::string& index) {
    return load_element(id + "_" + slot, slot_type(slot), index);
  };
  const std::string load_x = load_element(x, slot_type("x"), fmt::format("r * {} + j", K));
  const std::string eps = float_arg(prologue_task_, "eps", layer ? 1e-5 : 1e-6);
  const std::string rows = fmt::format(
      "  const cg_i64 cg_row0 = a_base / {0} + (cg_i64)tile.y * {1};  // the tile's first row of the norm's input\n",
      K, tile);
  const std::string last = fmt::format("a_base / {} + {}", K, M);
  const std::string whether_stored = prologue_stores_ ? "stored by the first column of tiles" : "never stored";
  // The statistics it exports (rstd; a layernorm's mean too), in the
  // order the staging functions keep them: mean first.
  std::vector<std::string> stats;
  for (const char* stat : {"mean", "rstd"})
    if (const BoundTensor* b = norm.find_tensor(stat); prologue_stores_ && b != nullptr && b->buffer >= 0)
      stats.push_back(stat);
  // Where the norm's output and statistics are read later: the blocks of
  // the first column of tiles store their rows, each element and
  // statistic as the norm's own kernel would (16-bit narrowed).
  // `stats_array[stats_at + r]`: the row's first statistic (the mean of a
  // layernorm, then its rstd `tile` floats further on; an rmsnorm's rstd).
  auto stores = [&](const std::string& element, const std::string& stats_array, int64_t stats_at) {
    if (!prologue_stores_) return std::string();
    return stored_norm_rows({.norm = prologue_task_,
                             .owner = "tile.x == 0",
                             .row0 = "cg_row0",
                             .rows = tile,
                             .K = K,
                             .end = last,
                             .element = element,
                             .stats = stats,
                             .stat_at = [&](const std::string& stat) {
                               const int64_t at = stats_at + (layer && stat == "rstd" ? tile : 0);
                               return at == 0 ? stats_array + "[r]" : fmt::format("{}[{} + r]", stats_array, at);
                             }});
  };
  // Floats per row the staging or statistics functions keep: rstd; a
  // layernorm's mean and rstd.
  const int64_t per_row = layer ? 2 : 1;
  const int64_t params = layer ? 2 * K : K;  // the weight (and bias), staged
  const bool keep_stats = !stats.empty();
  const int64_t staged_bytes = 4 * (tile * K + params + (keep_stats ? per_row * tile : 0));
  if (next_shared_offset(ek) + staged_bytes <= kSharedBytesWithoutOptIn) {
    const int64_t staged_at =
        reserve_shared(ek, fmt::format("{}'s {} rows normalised{}{}", id, tile, layer ? ", weight and bias" : " and weight",
                                       keep_stats ? ", their statistics" : ""),
                       staged_bytes);
    // The tile's rows, normalised, in shared memory: x read once per block.
    const std::string stats_at = keep_stats ? fmt::format("cg_normed + {}", tile * K + params) : "nullptr";
    const std::string params_code =
        layer ? fmt::format("[&](int j) {{ return {}; }}, [&](int j) {{ return {}; }}", param_load("weight", "j"),
                            param_load("bias", "j"))
              : fmt::format("[&](int j) {{ return {}; }}", param_load("weight", "j"));
    out.code = fmt::format(
        "  // Prologue (norm_prologue): {0} ({1}) of a's rows, {2}: the tile's rows\n"
        "  // normalised into shared memory, which the operand loads read.\n"
        "  float* cg_normed = (float*)(cg_smem + {3});\n"
        "{4}"
        "  cg_{1}_stage_rows([&](cg_i64 r, int j) {{ return {5}; }}, {6}, cg_row0, {7},\n"
        "                        {8}, {9}, {10}, cg_normed, cg_normed + {11}, {12});\n"
        "{13}",
        id, norm.op->name, whether_stored, staged_at, rows, load_x, params_code, tile, last, K, eps, tile * K, stats_at,
        stores("cg_normed[i]", "cg_normed", tile * K + params));
    out.element = fmt::format("cg_normed[(m - tile.y * {}) * {} + k]", tile, K);
    use_function(*norm.op, "cg_" + norm.op->name + "_stage_rows");
  } else {
    const int64_t stats_at =
        reserve_shared(ek, fmt::format("{}'s statistics of {} rows", id, tile), 4 * per_row * tile);
    // Too long a row to stage: the statistics of each row first, then
    // each element normalised as it is loaded (x read twice per block; a
    // third time by the blocks that store the output).
    auto normalised = [&](const std::string& x_at, const std::string& row, const std::string& column) {
      return layer ? fmt::format("({} - cg_stats[{}]) * cg_stats[{} + {}] * {} + {}", x_at, row, tile, row,
                                 param_load("weight", column), param_load("bias", column))
                   : fmt::format("{} * cg_stats[{}] * {}", x_at, row, param_load("weight", column));
    };
    out.code = fmt::format(
        "  // Prologue (norm_prologue): {0} ({1}) of a's rows, {2}: the statistics of the\n"
        "  // tile's rows first, then each element normalised as it is loaded.\n"
        "  float* cg_stats = (float*)(cg_smem + {3});\n"
        "{4}"
        "  cg_{5}([&](cg_i64 r, int j) {{ return {6}; }}, cg_row0, {7}, {8}, {9}, {10},\n"
        "                       cg_stats);\n"
        "{11}",
        id, norm.op->name, whether_stored, stats_at, rows, layer ? "layernorm_stats_rows" : "rmsnorm_rstd_rows", load_x,
        tile, last, K, eps,
        stores(normalised(load_x, fmt::format("i / {}", K), "j"), "cg_stats", 0));
    out.element = normalised(load_element(x, slot_type("x"), a_index), fmt::format("m - tile.y * {}", tile), "k");
    use_function(*norm.op, layer ? "cg_layernorm_stats_rows" : "cg_rmsnorm_rstd_rows");
  }
  return out;
}

// With --megakernel (docs/architecture.md §10): the kernels emitted so far become the
// tile functions of one persistent kernel per phase, which runs the
// schedule of megakernel.h from constant tables. Their event counters and
// watchdog reports take a region after the plan's arena.
// The Hopper mainloop matmul task `t` runs: the fusion pass's choice where
// its operands lie at arena offsets TMA can read (multiples of 16 bytes; the
// plan's alignment, unless --alignment is less), else none (the pipelined
// choice beside it runs). Asked by matmul() and the workspace's sizing alike.
const HopperGemm* Emitter::hopper_taken(const GemmMainloop& gemm, int t) const {
  if (!gemm.hopper) return nullptr;  // (then `t` need not be a matmul)
  const BoundTask& task = p_.tasks[size_t(t)];
  const bool aligned = plan_.buffers[size_t(task.find_tensor("a")->buffer)].offset % 16 == 0 &&
                       plan_.buffers[size_t(task.find_tensor("b")->buffer)].offset % 16 == 0;
  return aligned ? &*gemm.hopper : nullptr;
}

// Sizes split-K's workspace (split_k_) for the largest product that takes
// it: a matmul kernel whose mainloop (KernelGroup::gemm, as the fusion pass
// chose it) splits K on the pipelined mainloop, or deals its last tiles by
// stream-K on the Hopper one.
void Emitter::plan_split_k_workspace(const std::vector<KernelGroup>& kernels) {
  for (const KernelGroup& k : kernels) {
    if (const HopperGemm* hopper = hopper_taken(k.gemm, k.tasks.front())) {
      const HopperGemm& g = *hopper;
      if (g.stream_k) {  // for the target's grid (hopper_matmul)
        const int64_t grid = g.stream_k_grid(device_model(options_.target()).sms);
        split_k_.partials_bytes = std::max(split_k_.partials_bytes, g.stream_k_partial_bytes(grid));
        split_k_.arrivals_bytes = std::max(split_k_.arrivals_bytes, g.stream_k_arrival_bytes(grid));
      }
      continue;
    }
    if (!k.gemm.pipelined || k.gemm.pipelined->split_k < 2) continue;
    const GemmTile& g = *k.gemm.pipelined;
    const MatmulDims d = matmul_dims(p_, k.tasks.front());
    const int64_t tiles = (d.M + g.bm - 1) / g.bm * ((d.N + g.bn - 1) / g.bn) * d.batches;
    split_k_.partials_bytes = std::max(split_k_.partials_bytes, d.batches * g.split_k * d.M * d.N * 4);
    split_k_.arrivals_bytes = std::max(split_k_.arrivals_bytes, tiles * 4);
  }
  // A channels-last BatchNorm's split statistics (batchnorm_nhwc_split), in a launch of its own (fuse.cpp).
  for (const KernelGroup& k : kernels) {
    if (!is_batchnorm_nhwc(p_.tasks[size_t(k.tasks.front())])) continue;
    const BatchNormNhwcSplit s = batchnorm_nhwc_split(p_, k.tasks.front(), options_.target(), options_.megakernel);
    split_k_.partials_bytes = std::max(split_k_.partials_bytes, s.workspace_floats() * 4);
    if (s.splits > 1) split_k_.arrivals_bytes = std::max(split_k_.arrivals_bytes, s.chunks * 4);
  }
  // Split-KV's (flash_attention) in the same workspace: no two kernels use it at once.
  for (size_t i = 0; i < kernels.size(); ++i) {
    const KernelGroup& k = kernels[i];
    if (!attention_alone(k) || !alone_in_launch(kernels, i)) continue;
    const std::optional<FlashAttentionTile>& tile = k.flash;  // as the fusion pass chose it
    if (!tile || tile->splits < 2) continue;
    const Shape& q = p_.buffers[size_t(p_.tasks[size_t(k.ir.stages.front().task)].find_tensor("a")->buffer)].shape;
    const int64_t Tq = q[q.size() - 2], heads = numel(q) / (Tq * q.back()), m_tiles = (Tq + tile->block_m - 1) / tile->block_m;
    split_k_.partials_bytes = std::max(split_k_.partials_bytes, tile->partial_floats(heads, m_tiles) * 4);
    split_k_.arrivals_bytes = std::max(split_k_.arrivals_bytes, tile->arrival_counters(heads, m_tiles) * 4);
  }
  // Flash attention backward in the atomic mode (flash_backward_atomic).
  for (size_t i = 0; i < kernels.size(); ++i) {
    int64_t dq_floats = 0, query_tiles = 0;
    if (!flash_backward_atomic(kernels[i], &dq_floats, &query_tiles)) continue;
    split_k_.dq_bytes = std::max(split_k_.dq_bytes, dq_floats * 4);
    split_k_.dq_arrivals_bytes = std::max(split_k_.dq_arrivals_bytes, query_tiles * 4);
  }
  split_k_.partials_offset = align_up(std::max(plan_.arena_bytes, flash_statistics_end_), plan_.alignment);
  split_k_.arrivals_offset = align_up(split_k_.partials_offset + split_k_.partials_bytes, plan_.alignment);
  split_k_.dq_offset = align_up(split_k_.arrivals_offset + split_k_.arrivals_bytes, plan_.alignment);
  split_k_.dq_arrivals_offset = align_up(split_k_.dq_offset + split_k_.dq_bytes, plan_.alignment);
}

}  // namespace cudagen::lowering
