#include "emitter.h"

namespace cudagen::lowering {

// Grouped-query attention in the row kernels: the generated expression of
// the head of keys and values that query head `head` reads (parenthesised
// where it is not `head` itself), and the comment that says so.
struct RowKernelKeyHead {
  std::string index, note;
};
static RowKernelKeyHead row_kernel_key_head(const Shape& q, const Shape& k) {
  const std::string kv_head = kv_head_of(q, k, "head");
  if (kv_head == "head") return {"head", ""};
  return {"(" + kv_head + ")", " (of its group's: grouped-query attention)"};
}

// An operand of a flash kernel on element type `type` (FlashAttentionTile::
// element_type): f32 pointers cast to cg_tf32 or cg_f32_simt, 16-bit ones as they are.
static std::string flash_operand(const std::string& type, DType q_type, const std::string& pointer) {
  return q_type == DType::f32 ? fmt::format("(const {}*)({})", type, pointer) : pointer;
}

// The mainloop a flash kernel on `tile` runs, for the performance model and
// the checker's tolerances (TF32's are f16's).
static MatmulMainloop flash_mainloop(const FlashAttentionTile& tile) {
  return tile.hopper ? MatmulMainloop::flash_attention_hopper
         : tile.tf32 ? MatmulMainloop::flash_attention_tf32
         : tile.simt_f32 ? MatmulMainloop::flash_attention_simt
                         : MatmulMainloop::flash_attention;
}

// Rule attention (fuse.h): scores = alpha * q k^T, probs = softmax(scale *
// scores), out = alpha' * probs v, and any epilogue on out. One warp per
// query row (cg_attention_row), up to 8 rows per block; each warp's row of
// scores in shared memory. Probabilities read elsewhere (saved for the
// backward pass) are stored as they are computed. The operands the kernel
// computes itself (rule attention_projection) come from shared memory.
std::string Emitter::attention(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
  const AttentionTasks at = attention_tasks(k);
  const int ts = at.scores, tp = at.softmax, tc = at.context;
  if (ts < 0 || tp < 0 || tc < 0) {
    fail(k.tasks.front(), "", fmt::format("kernel {} is an attention without its scores, softmax and context", k.name),
         "an internal error of cudagen: please report it with the graph; --no-fuse-rule attention avoids it");
    return {};
  }
  const std::vector<Param> scores = params(ts), softmax = params(tp), context = params(tc);
  if (!diags_.ok()) return {};
  const Param& q = param(scores, "a");
  const Param& kk = param(scores, "b");
  const Param& probs = param(softmax, "out");
  const Param& v = param(context, "b");
  const Param& out = param(context, "out");
  for (int t : {ts, tp, tc}) template_files_.insert(p_.tasks[size_t(t)].op->source_file);
  if (!check_f32_accumulation(ts, q)) return {};
  use_function(*p_.tasks[size_t(tp)].op, "cg_attention_row");
  use_function(*p_.tasks[size_t(tp)].op, "cg_stage_rows");
  EmittedKernel ek = emitted_kernel(k);
  Epilogue tail;
  if (!k.ir.stages[size_t(kir::stage_of_result(k.ir, out.bound->buffer))].chain.empty()) {  // the context's epilogue
    tail = epilogue(k, out);
    if (!diags_.ok()) return {};
    epilogue_buffer_ = out.bound->buffer;
  }
  const Shape& sq = q.buffer->shape;
  const int64_t Tq = sq[sq.size() - 2], D = sq.back(), Tk = kk.buffer->shape[sq.size() - 2];
  const int64_t Dv = v.buffer->shape.back(), rows = numel(sq) / D;
  const std::vector<Projection> projections = attention_projections(k);
  auto computed = [&](const Param& x) {
    return std::any_of(projections.begin(), projections.end(), [&](const Projection& pr) { return pr.heads == x.bound->buffer; });
  };
  const bool q_computed = computed(q), k_computed = computed(kk), v_computed = computed(v);
  const bool store_probs = !contains(k.internal_buffers, probs.bound->buffer);
  // Tensor cores where the fusion pass gave the kernel a flash tile (and a
  // launch of its own); otherwise the row kernel, as far as the fusion pass
  // allowed it (1024 keys), and why not flash for describe.
  if (k.flash && global_wrapper_)
    return flash_attention(k, at, *k.flash, std::move(ek), tail.code, tail.params, emitted);
  const std::string why_not_flash = k.flash ? "it shares its launch with other kernels" : k.why_not_flash;
  if (k.flash_trained) {
    fail(ts, "", fmt::format("internal error: kernel {} trains on the flash kernels, which do not apply: {}", k.name,
                             why_not_flash),
         "--no-fuse-rule attention_backward avoids it; please report it with the graph");
    return {};
  }
  // Grouped-query attention: the head of keys and values a head of q reads
  // (`head` q's head; the rule refuses projections computed in the kernel).
  const RowKernelKeyHead key_head = row_kernel_key_head(sq, kk.buffer->shape);
  if (Tk > kMaxAttentionKeys || D > kMaxAttentionKeys)
    return streamed_attention(k, at, std::move(ek), tail.code, tail.params, why_not_flash, emitted);
  ek.matmul_path = "CUDA cores: the row kernel (a warp per query row; templates/softmax.cuh), not flash attention: " + why_not_flash;
  // Up to 8 query rows per block, all of one head (a divisor of Tq), so
  // that the block can share its head's keys and values.
  const int64_t scratch = D + Tk;  // per warp: the query row, the scores
  // A block that computes operands works on a whole head, its warps
  // taking the query rows in turn: each key and value computed once.
  const int64_t per_block = attention_rows_per_block(Tq, D, Tk);
  const bool projecting = !projections.empty();
  ek.block = int(32 * per_block);
  ek.grid[0] = int(rows / (projecting ? Tq : per_block));
  // Shared memory, as the fusion pass bounded it: the head's keys and
  // values where they fit beside the scratch, always where the block
  // computes them; then what the projections stage.
  int64_t weight_floats = 0;
  const std::vector<AttentionProjectionShared> staging =
      projection_shared(k, projections, q.bound->buffer, weight_floats);
  const AttentionShared smem = attention_shared(per_block, Tk, D, Dv, k_computed || v_computed, staging, weight_floats);
  use_shared(ek, smem.layout);
  const bool stage = smem.keys >= 0;
  const int64_t rows_at = smem.rows, keys_at = stage ? smem.keys : 0;
  const std::string valid = visible_keys(arg_bool(tp, "causal"), Tq, Tk);
  const std::string alpha_out = float_arg(tc, "alpha", 1.0);
  std::string body =
      projecting ? fmt::format(
                       "  CG_DYNAMIC_SMEM(cg_smem);\n"
                       "  const unsigned int warp = threadIdx.x / 32;  // one warp per query row, {} rows at a time\n"
                       "{}",
                       per_block,
                       k_computed && v_computed
                           ? std::string()
                           : fmt::format("  const cg_i64 keys = (cg_i64)tile.x * {};  // the first key (and value) row of "
                                         "the block's head\n",
                                         Tk))
                 : fmt::format(
                       "  CG_DYNAMIC_SMEM(cg_smem);\n"
                       "  const unsigned int warp = threadIdx.x / 32;  // one warp per query row\n"
                       "  const cg_i64 row = (cg_i64)tile.x * {0} + warp, head = (cg_i64)tile.x * {0} / {1};\n"
                       "  const cg_i64 keys = {3} * {2};  // the first key (and value) row of the block's head{4}\n",
                       per_block, Tq, Tk, key_head.index, key_head.note);
  std::string load_q = load_element("q", q.buffer->dtype, fmt::format("row * {} + c", D));
  std::string load_k = load_element("k", kk.buffer->dtype, fmt::format("(keys + j) * {} + c", D));
  std::string load_v = load_element("v", v.buffer->dtype, fmt::format("(keys + j) * {} + c", Dv));
  if (stage) {
    body += fmt::format("  float* staged_k = {};\n  float* staged_v = staged_k + {};\n", shared_floats(keys_at), Tk * D);
    if (!k_computed)
      body += fmt::format("  cg_stage_rows([&](int j, int c) {{ return {}; }}, staged_k, {}, {});\n", load_k, Tk, D);
    if (!v_computed)
      body += fmt::format("  cg_stage_rows([&](int j, int c) {{ return {}; }}, staged_v, {}, {});\n", load_v, Tk, Dv);
    load_k = fmt::format("staged_k[j * {} + c]", D);
    load_v = fmt::format("staged_v[j * {} + c]", Dv);
  }
  ProjectionCode projected;
  if (!projections.empty()) {
    projected = projection_code(k, projections, {q.bound->buffer, kk.bound->buffer, v.bound->buffer}, smem);
    if (!diags_.ok()) return {};
    body += projected.code;
    if (q_computed) load_q = fmt::format("cg_q_rows[row % {} * {} + c]", Tq, D);
  }
  std::vector<LaunchParam> bias_param;
  const std::string add_bias = attention_bias(at, Tk, bias_param);
  // A larger block (the megakernel's) has spare warps: they only help stage.
  body += fmt::format(
      "{14}\n"
      "    cg_attention_row([&](int c) {{ return {1}; }},\n"
      "                     [&](int j, int c) {{ return {2}; }},\n"
      "                     [&](int j, int c) {{ return {3}; }},\n"
      "                     {15},\n"
      "                     [&](int j, float p) {{ {4}; }},\n"
      "                     [&](int c, float o) {{ {5}; }},\n"
      "                     {6}, {7}, {8}, {9}, {10}, {11}, {13} + warp * {12});\n",
      per_block, load_q, load_k, load_v,
      store_probs ? store_element("probs", probs.buffer->dtype, fmt::format("row * {} + j", Tk), "p")
                  : std::string("(void)j, (void)p"),
      store(out, fmt::format("row * {} + c", Dv), alpha_out == float_literal(1.0) ? "o" : alpha_out + " * o"), Tk, D,
      Dv, float_arg(ts, "alpha", 1.0), float_arg(tp, "scale", 1.0), valid, scratch, shared_floats(rows_at),
      projecting ? fmt::format("  for (cg_i64 row = (cg_i64)tile.x * {1} + warp; warp < {0} && row < ((cg_i64)tile.x + 1) * {1}; "
                               "row += {0})",
                               per_block, Tq)
                 : fmt::format("  if (warp < {})", per_block),
      add_bias);
  if (stage) body += "  __syncthreads();  // the staged rows are read before the block's next tile overwrites them\n";
  epilogue_buffer_ = -1;
  std::vector<LaunchParam> launch;
  auto add = [&](const std::string& name, const Param& x, bool written) {
    launch.push_back(buffer_param(name, x, written));
  };
  if (!q_computed) add("q", q, false);
  if (!k_computed) add("k", kk, false);
  if (!v_computed) add("v", v, false);
  launch.insert(launch.end(), bias_param.begin(), bias_param.end());
  if (store_probs) add("probs", probs, true);
  if (!contains(k.internal_buffers, out.bound->buffer)) add("out", out, true);
  launch.insert(launch.end(), projected.params.begin(), projected.params.end());
  launch.insert(launch.end(), tail.params.begin(), tail.params.end());
  return finish_kernel(k, ek, std::move(launch), tail.code + body, emitted);
}

// Rule attention on tensor cores (templates/softmax_flash.cuh,
// docs/attention.md): a block per tile of query rows of one head (tile.x,
// the last rows first where causal: their tiles visit the most keys), the
// head tile.y; the output's elements through the store, where an epilogue
// chain (a head merge) follows.
// (`tail_code` and `tail_params`: the epilogue's, an Epilogue declared below.)
std::string Emitter::flash_attention(const KernelGroup& k, const AttentionTasks& at, const FlashAttentionTile& tile, EmittedKernel ek,
                                     const std::string& tail_code, const std::vector<LaunchParam>& tail_params,
                                     std::vector<EmittedKernel>& emitted) {
  const int ts = at.scores, tp = at.softmax, tc = at.context;
  const std::vector<Param> scores = params(ts), context = params(tc);
  const Param& q = param(scores, "a");
  const Param& kk = param(scores, "b");
  const Param& v = param(context, "b");
  const Param& out = param(context, "out");
  const OpSignature& softmax = *p_.tasks[size_t(tp)].op;
  if (!tile.hopper) use_function(softmax, "cg_flash_config");
  const Shape& sq = q.buffer->shape;
  const int64_t Tq = sq[sq.size() - 2], D = sq.back(), Tk = kk.buffer->shape[sq.size() - 2];
  const int64_t Dv = v.buffer->shape.back(), heads = numel(sq) / (Tq * D);
  // Grouped-query attention: the head of keys and values a head of q reads.
  const std::string kv_head = kv_head_of(sq, kk.buffer->shape, "head");
  const int64_t m_tiles = (Tq + tile.block_m - 1) / tile.block_m;
  const bool causal = arg_bool(tp, "causal");
  // Both kernels copy q, k and v 16 bytes at a time (cp.async; TMA on the
  // Hopper path): each must start on a 16-byte boundary of the arena, which
  // only an --alignment under 16 breaks.
  for (const Param* operand : {&q, &kk, &v})
    if (const int64_t offset = plan_.buffers[size_t(operand->bound->buffer)].offset; offset % 16 != 0) {
      fail(ts, "", fmt::format("flash attention copies q, k and v 16 bytes at a time, but '{}' lies at arena offset {}, "
                               "no multiple of 16",
                               ::cudagen::buffer_name(p_, operand->bound->buffer), offset),
           fmt::format("place buffers on 16-byte boundaries or more (--alignment is {} here; its default is 256)",
                       plan_.alignment));
      return "";
    }
  ek.block = tile.threads();
  // Without a minimum of blocks, ptxas for sm_90 caps the kernel at 128
  // registers and spills (heads of 64); it needs about 140.
  ek.min_blocks_per_sm = 1;
  ek.grid[0] = m_tiles;
  ek.grid[1] = heads;
  ek.grid[2] = tile.splits;
  ek.matmul_path = tile.hopper ? "tensor cores: flash attention on the Hopper path (templates/softmax_flash_sm90.cuh), " +
                                      tile.describe()
                                : std::string(tile.cores()) + ": flash attention (templates/softmax_flash.cuh), " +
                                      tile.describe() +
                                      (tile.why_not_hopper.empty() ? "" : "; not on the Hopper path: " + tile.why_not_hopper);
  ek.mainloop = flash_mainloop(tile);
  reserve_shared(ek,
                 tile.hopper ? fmt::format("the q tile and {} stages of keys and values from a 1024-byte boundary, each "
                                           "consumer warp's output rows, the barriers",
                                           tile.stages)
                             : fmt::format("the q tile and {} stages of keys and values, then the output tile", tile.stages),
                 tile.shared_bytes());
  // s = scale (alpha q . k) in log2 units: exp(x) is exp2(x log2 e).
  const double scale_log2 = arg_double(ts, "alpha", 1.0) * arg_double(tp, "scale", 1.0) * 1.4426950408889634;
  const std::string alpha_out = float_arg(tc, "alpha", 1.0);
  // f32 operands are read as cg_tf32 (--allow-tf32), the bits each fragment
  // rounds to TF32, or as cg_f32_simt (trained, exact on CUDA cores).
  const std::string type = tile.element_type(c_type(q.buffer->dtype));
  auto operand = [&](const char* name, const std::string& offset) {
    return flash_operand(type, q.buffer->dtype, fmt::format("{} + {}", name, offset));
  };
  // Split-KV: each block (tile.z) its range of key tiles, then the last of
  // a row tile combines, in split order, from the workspace.
  // (The Hopper kernel counts each consumer warp's rows apart: 8 counters a row tile.)
  std::string split, call = tile.hopper ? "cg_flash_attention_sm90" : "cg_flash_attention";
  std::vector<LaunchParam> workspace;
  if (tile.splits > 1) {
    call = tile.hopper ? "cg_flash_attention_split_sm90" : "cg_flash_attention_split";
    const int64_t counters = tile.arrival_counters(1, 1);
    split = fmt::format("\n      (int)tile.z, {}, {}, cg_partials + (head * {} + tile_m) * {}, cg_arrivals + (head * {} + "
                        "tile_m){},",
                        tile.splits, tile.tiles_per_split, m_tiles, tile.partial_floats(1, 1), m_tiles,
                        counters == 1 ? std::string() : fmt::format(" * {}", counters));
    workspace = {LaunchParam{"cg_partials", "float", -1, nullptr, true, split_k_.partials_offset,
                             tile.partial_floats(heads, m_tiles) * 4},
                 LaunchParam{"cg_arrivals", "unsigned int", -1, nullptr, true, split_k_.arrivals_offset,
                             tile.arrival_counters(heads, m_tiles) * 4}};
  }
  use_function(softmax, call);
  // Trained: each row's log-sum-exp and o (before the matmul's alpha) saved for the gradient kernel.
  std::string lse_store = "[&](cg_i64, float) {} /* no backward pass reads the log-sum-exp */", saved_o;
  if (k.flash_trained) {
    const FlashStatistics& f = flash_statistics_.at(tp);
    lse_store = fmt::format("[&](cg_i64 row, float lse) {{ cg_lse[head * {} + row] = lse; }}", Tq);
    // (In q's type: f32 for 4-byte elements, which the rows' launch reads as floats.)
    const std::string saved_type = c_type(q.buffer->dtype);
    saved_o = fmt::format(" cg_saved_o[(head * {} + row) * {} + c] = {};", Tq, Dv,
                          q.buffer->dtype == DType::f32 ? std::string("o") : fmt::format("cg_narrow<{}>(o)", saved_type));
    workspace.push_back(LaunchParam{"cg_lse", "float", -1, nullptr, true, f.lse_offset, f.lse_bytes});
    workspace.push_back(LaunchParam{"cg_saved_o", saved_type, -1, nullptr, true, f.o_offset, f.o_bytes});
  }
  // A bias on the scores (an attention mask): its element at (head, row, key), broadcast as numpy would.
  std::string bias_args;
  std::vector<LaunchParam> bias_param;
  if (at.bias >= 0) {
    if (tile.hopper) {
      fail(ts, "", "internal error: the Hopper flash kernel was chosen for an attention with a bias, which it does not take",
           "an internal error of cudagen: please report it with the graph");
      return "";
    }
    use_function(softmax, "cg_flash_bias_of");
    const Param bias = attention_bias_operand(at);
    const Shape& sb = bias.buffer->shape;
    const Shape& ss = param(scores, "out").buffer->shape;
    const int64_t bias_keys = sb.empty() ? 1 : sb.back(), bias_rows = sb.size() >= 2 ? sb[sb.size() - 2] : 1;
    const Shape lead_b = sb.size() > 2 ? Shape(sb.begin(), sb.end() - 2) : Shape{};
    std::vector<std::string> terms;
    if (numel(lead_b) > 1)
      terms.push_back(fmt::format("{} * {}", broadcast_index(Shape(ss.begin(), ss.end() - 2), lead_b, "head"),
                                  bias_rows * bias_keys));
    if (bias_rows > 1) terms.push_back(fmt::format("row * {}", bias_keys));
    if (bias_keys > 1) terms.push_back("key");
    bias_args = fmt::format(",\n      cg_flash_bias_of([&](cg_i64 row, cg_i64 key) {{ return {}; }}), {}",
                            load_element("bias", bias.buffer->dtype,
                                         terms.empty() ? std::string("0") : fmt::format("{}", fmt::join(terms, " + "))),
                            float_literal(arg_double(tp, "scale", 1.0) * 1.4426950408889634));
    bias_param.push_back(buffer_param("bias", bias, false));
  }
  const std::string store_out = fmt::format(
      "[&](cg_i64 row, int c, float o) {{ {};{} }}",
      store(out, fmt::format("(head * {} + row) * {} + c", Tq, Dv), alpha_out == float_literal(1.0) ? "o" : alpha_out + " * o"),
      saved_o);
  std::vector<LaunchParam> launch;
  std::string body;
  if (tile.hopper) {
    // q, k and v by TMA: 3-D maps (a plane a head, so that a tile's rows
    // past its head's length arrive as zeros), in place of their pointers.
    const int64_t kv_heads = numel(kk.buffer->shape) / (Tk * D);
    // Boxes of 64 columns by a tile's rows: q's block_m, k's and v's block_n.
    auto map = [&](const char* name, const Param& operand, int head_size, int64_t rows, int64_t planes, int box_rows) {
      const int64_t row_bytes = int64_t(head_size) * 2;
      return LaunchParam{name, "const cg_tensor_map", operand.bound->buffer, nullptr, false, -1,
                         0, TensorMapSpec{arena_range(buffer_param("x", operand, false)).first, 2, head_size, rows,
                                          row_bytes, 64, box_rows, planes, rows * row_bytes}};
    };
    launch = {map("q_map", q, tile.head_d, Tq, heads, tile.block_m),
              map("k_map", kk, tile.head_d, Tk, kv_heads, tile.block_n),
              map("v_map", v, tile.head_dv, Tk, kv_heads, tile.block_n)};
    use_function(softmax, "cg_flash_sm90_config");
    body = fmt::format(
        "  CG_DYNAMIC_SMEM(cg_smem);\n"
        "  // Flash attention on the Hopper path: {0}.\n"
        "  typedef cg_flash_sm90_config<{1}> cg_config;\n"
        "{14}"
        "  const cg_i64 head = tile.y, kv_head = {2}, tile_m = {3};\n"
        "  {15}<cg_config, {4}>({5}, {6}, {7}, {8}, {9}, tile_m, (int)head, (int)kv_head,{16}\n"
        "      {10}, {11},\n"
        "      {12},\n"
        "      {13},\n"
        "      cg_smem);\n",
        tile.describe(), tile.arguments(), kv_head, causal ? fmt::format("{} - tile.x", m_tiles - 1) : "tile.x", type,
        param_name(launch[0]), param_name(launch[1]), param_name(launch[2]), Tq, Tk, float_literal(scale_log2),
        causal ? "true" : "false", store_out, lse_store, shared_bytes_agree("cg_config", tile.shared_bytes()), call,
        split);
  } else {
    body = fmt::format(
        "  CG_DYNAMIC_SMEM(cg_smem);\n"
        "  // Flash attention: {0}.\n"
        "  typedef cg_flash_config<{1}> cg_config;\n"
        "  const cg_i64 head = tile.y, kv_head = {12}, tile_m = {2};\n"
        "  {13}<cg_config, {3}>({4}, {5}, {6}, {7}, {8}, tile_m,{14}\n"
        "      {9}, {10},\n"
        "      {11},\n"
        "      {15},\n"
        "      ({3}*)cg_smem{16});\n",
        tile.describe(), tile.arguments(), causal ? fmt::format("{} - tile.x", m_tiles - 1) : "tile.x", type,
        operand("q", fmt::format("head * {}", Tq * D)), operand("k", fmt::format("kv_head * {}", Tk * D)),
        operand("v", fmt::format("kv_head * {}", Tk * Dv)), Tq, Tk, float_literal(scale_log2), causal ? "true" : "false",
        store_out, kv_head, call, split, lse_store, bias_args);
    launch = {buffer_param("q", q, false), buffer_param("k", kk, false), buffer_param("v", v, false)};
    launch.insert(launch.end(), bias_param.begin(), bias_param.end());
  }
  // q, k and v (pointers, or the Hopper kernel's maps), the workspace, the output, the tail's.
  epilogue_buffer_ = -1;
  launch.insert(launch.end(), workspace.begin(), workspace.end());
  if (!contains(k.internal_buffers, out.bound->buffer)) launch.push_back(buffer_param("out", out, true));
  launch.insert(launch.end(), tail_params.begin(), tail_params.end());
  return finish_kernel(k, ek, std::move(launch), tail_code + body, emitted);
}

// Rule attention over more keys than the row kernel holds, where the flash
// kernel does not apply (f32; heads it does not take): the streamed row
// kernel (cg_attention_row_streamed), a warp per query row, 8 a block, two
// passes over the row's keys and no scores kept; the probabilities stored
// where read later, the output's elements through the store.
std::string Emitter::streamed_attention(const KernelGroup& k, const AttentionTasks& at, EmittedKernel ek, const std::string& tail_code,
                                        const std::vector<LaunchParam>& tail_params, const std::string& why_not_flash,
                                        std::vector<EmittedKernel>& emitted) {
  const int ts = at.scores, tp = at.softmax, tc = at.context;
  const std::vector<Param> scores = params(ts), softmax = params(tp), context = params(tc);
  const Param& q = param(scores, "a");
  const Param& kk = param(scores, "b");
  const Param& probs = param(softmax, "out");
  const Param& v = param(context, "b");
  const Param& out = param(context, "out");
  use_function(*p_.tasks[size_t(tp)].op, "cg_attention_row_streamed");
  const Shape& sq = q.buffer->shape;
  const int64_t Tq = sq[sq.size() - 2], D = sq.back(), Tk = kk.buffer->shape[sq.size() - 2];
  const int64_t Dv = v.buffer->shape.back(), rows = numel(sq) / D;
  const RowKernelKeyHead key_head = row_kernel_key_head(sq, kk.buffer->shape);
  constexpr int64_t per_block = 8;
  ek.block = int(32 * per_block);
  ek.grid[0] = (rows + per_block - 1) / per_block;
  ek.matmul_path = fmt::format(
      "CUDA cores: the streamed row kernel (a warp per query row, two passes over its {} keys; templates/softmax.cuh), "
      "not flash attention: {}",
      Tk, why_not_flash);
  reserve_shared(ek, fmt::format("each warp's query row ({} x {} floats)", per_block, D), per_block * D * 4);
  const bool store_probs = !contains(k.internal_buffers, probs.bound->buffer);
  const std::string alpha_out = float_arg(tc, "alpha", 1.0);
  const std::string valid = visible_keys(arg_bool(tp, "causal"), Tq, Tk);
  std::vector<LaunchParam> launch = {buffer_param("q", q, false), buffer_param("k", kk, false),
                                     buffer_param("v", v, false)};
  const std::string add_bias = attention_bias(at, Tk, launch);
  std::string body = fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  const unsigned int warp = threadIdx.x / 32;  // one warp per query row\n"
      "  const cg_i64 row = (cg_i64)tile.x * {0} + warp, head = row / {1};\n"
      "  const cg_i64 keys = {15} * {2};  // the first key (and value) row of the row's head{16}\n"
      "  if (warp < {0} && row < {3})\n"
      "    cg_attention_row_streamed<{4}>([&](int c) {{ return {5}; }},\n"
      "                                  [&](int j, int c) {{ return {6}; }},\n"
      "                                  [&](int j, int c) {{ return {7}; }},\n"
      "                                  {17},\n"
      "                                  [&](int j, float p) {{ {8}; }},\n"
      "                                  [&](int c, float o) {{ {9}; }},\n"
      "                                  {2}, {10}, {11}, {12}, {13}, {14}, (float*)cg_smem + warp * {10});\n",
      per_block, Tq, Tk, rows, (Dv + 31) / 32, load_element("q", q.buffer->dtype, fmt::format("row * {} + c", D)),
      load_element("k", kk.buffer->dtype, fmt::format("(keys + j) * {} + c", D)),
      load_element("v", v.buffer->dtype, fmt::format("(keys + j) * {} + c", Dv)),
      store_probs ? store_element("probs", probs.buffer->dtype, fmt::format("row * {} + j", Tk), "p")
                  : std::string("(void)j, (void)p"),
      store(out, fmt::format("row * {} + c", Dv), alpha_out == float_literal(1.0) ? "o" : alpha_out + " * o"), D, Dv,
      float_arg(ts, "alpha", 1.0), float_arg(tp, "scale", 1.0), valid, key_head.index, key_head.note, add_bias);
  epilogue_buffer_ = -1;
  if (store_probs) launch.push_back(buffer_param("probs", probs, true));
  if (!contains(k.internal_buffers, out.bound->buffer)) launch.push_back(buffer_param("out", out, true));
  launch.insert(launch.end(), tail_params.begin(), tail_params.end());
  return finish_kernel(k, ek, std::move(launch), tail_code + body, emitted);
}

// The launch before flash attention's backward kernel (kernel k): each
// query row's log-sum-exp in log2 units and delta = dp_scale dO . o, into
// the rows' statistics (FlashStatistics::rows_offset), which the gradient
// kernel's blocks read a tile at a time. (In the loop, delta cost each key
// block a dependent read of o and dO per row and tile: more than the tile's
// products; bench/RESULTS.md.)
std::string Emitter::flash_backward_rows_kernel(const KernelGroup& k, const FlashAttentionTile& tile, const FlashTraining& roles,
                                                const Param& dout, const FlashStatistics& f, int64_t heads, int64_t Tq,
                                                int64_t Dv, std::vector<EmittedKernel>& emitted) {
  const int64_t rows = flash_backward_statistics_rows(Tq);
  const std::string type = c_type(dout.buffer->dtype);
  use_function(*p_.tasks[size_t(roles.ds)].op, "cg_flash_backward_rows");
  use_function(*p_.tasks[size_t(roles.ds)].op, "cg_flash_config");  // (the forward may run the Hopper kernel's)
  EmittedKernel ek = emitted_kernel(k);
  ek.name = k.name + "_rows";
  ek.block = 256;  // 32 rows, 8 lanes a row
  ek.grid[0] = rows / 32;
  ek.grid[1] = heads;
  ek.bytes_read = f.lse_bytes + 2 * f.o_bytes;  // lse, o and dO
  ek.bytes_written = f.rows_bytes;
  std::vector<LaunchParam> launch = {
      LaunchParam{"cg_row_stats", "float", -1, nullptr, true, f.rows_offset, f.rows_bytes},
      LaunchParam{"cg_lse", "const float", -1, nullptr, false, f.lse_offset, f.lse_bytes},
      LaunchParam{"cg_saved_o", "const " + type, -1, nullptr, false, f.o_offset, f.o_bytes},
      buffer_param("dcontext", dout, false)};
  const std::string comment_text = fmt::format(
      "// Kernel {} ({} phase): the rows' statistics of flash attention's backward kernel {} (tasks {}, {}):\n"
      "//   each query row's log-sum-exp (log2 units) and delta = dO . o (times dp's alpha), from the forward's\n"
      "//   saved log-sum-exp and output and {}; {} rows a head ({} rounded up to whole tiles), 32 a block.\n",
      ek.name, to_string(k.phase), k.name, p_.tasks[size_t(roles.dp)].task->id, p_.tasks[size_t(roles.ds)].task->id,
      buffer_name(dout.bound->buffer), rows, Tq);
  const std::string body = fmt::format(
      "  typedef cg_flash_config<{0}> cg_config;\n"
      "  const cg_i64 head = tile.y;\n"
      "  cg_flash_backward_rows<cg_config, {1}>(cg_row_stats + head * {2}, cg_lse + head * {3}, cg_saved_o + head * {4},\n"
      "      dcontext + head * {4}, {3}, {5}, tile.x, {6});\n",
      tile.arguments(), type, 2 * rows, Tq, Tq * Dv, rows, float_arg(roles.dp, "alpha", 1.0));
  std::string code = kernel_functions(comment_text, ek, launch, body);
  locate_params(ek, launch);
  // Launched right before the group's own kernel (launches()), which is the
  // next of `emitted`: tile kernels stay one a group.
  pre_launches_[emitted.size()] = {ek, std::move(launch)};
  return code;
}

// Rule attention_backward (fuse.h): an attention's gradient tasks (its IR's
// stages dp, ds, dq, dk, dv) in one kernel, a block per head. The
// block stages its head's keys and values, then takes its query rows 8 at
// a time: their q, dcontext and probabilities in shared memory, one warp
// per row computes dp, ds (rounded as the unfused kernels would store
// them, and kept in shared memory) and the row of dq
// (cg_attention_backward_row); then each thread adds the tile's rows, in
// order, into its elements of dk and dv, held in registers and stored at
// the end. Each gradient's epilogue (its head merge) runs where it is
// stored.
std::string Emitter::attention_backward(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
  // The IR's stages (kir.h): dp and ds, and the gradients present (task -1 where not).
  const int tdp = kir::role_task(k.ir, "dp"), tds = kir::role_task(k.ir, "ds");
  const int tdq = kir::role_task(k.ir, "dq"), tdk = kir::role_task(k.ir, "dk"), tdv = kir::role_task(k.ir, "dv");
  const std::vector<Param> dp_ps = params(tdp), ds_ps = params(tds);
  if (!diags_.ok()) return {};
  const Param& dout = param(dp_ps, "a");
  const Param& v = param(dp_ps, "b");
  const Param& probs = param(ds_ps, "out");
  const DType dp_type = param(dp_ps, "out").buffer->dtype, ds_type = param(ds_ps, "dx").buffer->dtype;
  const Shape& sp = probs.buffer->shape;
  const int64_t Tq = sp[sp.size() - 2], Tk = sp.back(), heads = numel(sp) / (Tq * Tk), Dv = v.buffer->shape.back();
  const int64_t R = kAttentionBackwardRows;
  for (const Param* x : {&dout, &v, &probs})
    if (!check_f32_accumulation(x == &probs ? tds : tdp, *x)) return {};
  for (int t : kernel_tasks(k)) template_files_.insert(p_.tasks[size_t(t)].op->source_file);
  use_function(*p_.tasks[size_t(tds)].op, "cg_attention_backward_row");
  EmittedKernel ek = emitted_kernel(k);
  ek.block = int(kAttentionBackwardThreads);
  ek.grid[0] = int(heads);
  ek.min_blocks_per_sm = 1;  // a block per head, every query row of it: registers before occupancy

  std::vector<LaunchParam> launch;
  auto add = [&](const std::string& name, const Param& x) {
    launch.push_back(buffer_param(name, x));
  };
  // A gradient dq, dk or dv: its matmul's operand (k, q; none for dv) and
  // how its element `index` is stored (through its epilogue, or not at
  // all where only the kernel reads it).
  struct Gradient {
    bool present = false;
    int64_t width = 0;     // D or Dv: its rows' length
    std::string operand;   // k's or q's parameter
    DType operand_type = DType::f32;
    std::string alpha;     // its matmul's, as a literal
    std::string lambda;    // its epilogue's lambda, or empty
    std::string param;     // its output's parameter where stored directly, or empty
    DType type = DType::f32;
  };
  std::string epilogues;
  auto gradient = [&](int t, const std::string& role) {
    Gradient gr;
    if (t < 0) return gr;
    const std::string& id = p_.tasks[size_t(t)].task->id;
    const std::vector<Param> ps = params(t);
    if (!diags_.ok()) return gr;
    const Param& out = param(ps, "out");
    gr.present = true;
    gr.width = out.buffer->shape.back();
    gr.type = out.buffer->dtype;
    gr.alpha = float_arg(t, "alpha", 1.0);
    if (role != "dv") {
      const Param& b = param(ps, "b");
      if (!check_f32_accumulation(t, b)) return gr;
      gr.operand = role == "dq" ? "k" : "q";
      gr.operand_type = b.buffer->dtype;
      add(gr.operand, b);
    }
    const bool stored = !contains(k.internal_buffers, out.bound->buffer);
    if (stored) add(id + "_out", out);
    if (const int stage = kir::stage_of_result(k.ir, out.bound->buffer);
        stage >= 0 && !k.ir.stages[size_t(stage)].chain.empty()) {
      gr.lambda = "cg_epilogue_" + role;
      Epilogue e = epilogue(k, out, {.lambda = gr.lambda, .anchor_name = id + "_out"});
      epilogues += e.code;
      launch.insert(launch.end(), e.params.begin(), e.params.end());
    } else if (stored) {
      gr.param = id + "_out";
    }
    return gr;
  };
  add("dcontext", dout);
  add("v", v);
  if (!k.flash_trained) add("probs", probs);
  const Gradient dq = gradient(tdq, "dq"), dk = gradient(tdk, "dk"), dv = gradient(tdv, "dv");
  if (!diags_.ok()) return {};
  const int64_t D = dq.present ? dq.width : dk.width;
  auto store = [&](const Gradient& gr, const std::string& index, const std::string& acc) {
    const std::string value = gr.alpha == float_literal(1.0) ? acc : gr.alpha + " * " + acc;
    if (!gr.lambda.empty()) return fmt::format("{}({}, {})", gr.lambda, index, value);
    if (!gr.param.empty()) return store_element(gr.param, gr.type, index, value);
    // Internal without an epilogue: no reader at all (fuse.cpp merges only gradients something reads).
    fail(k.tasks[0], "", fmt::format("kernel {} computes a gradient nothing reads", k.name),
         "an internal error of cudagen: please report it with the graph; --no-fuse-rule attention_backward avoids it");
    return std::string();
  };
  auto rounded = [](DType d) {
    return is_16bit(d) ? fmt::format("cg_widen(cg_narrow<{}>(x))", c_type(d)) : std::string("x");
  };
  if (k.flash_trained) {
    // The flash backward kernel (templates/softmax_flash.cuh): the probabilities recomputed from the
    // forward's saved statistics; dp and ds in registers, unrounded. (Launched alone: rule
    // horizontal leaves flash kernels out.)
    if (!global_wrapper_) {
      fail(tds, "", fmt::format("internal error: kernel {} (flash attention backward) shares its launch", k.name),
           "--no-fuse-rule horizontal avoids it; please report it with the graph");
      return {};
    }
    if (options_.megakernel) {  // (flash_attention_tile_of refuses megakernels)
      fail(tds, "", fmt::format("internal error: kernel {} (flash attention backward) in a megakernel", k.name),
           "--no-fuse-rule attention_backward avoids it; please report it with the graph");
      return {};
    }
    FlashTraining roles = k.flash_roles;  // (the forward's tasks too, as the fusion pass found them)
    // The tile the fusion pass chose (KernelGroup::flash); in the atomic mode
    // (--atomic-attention-backward) the key blocks sum dq too, with atomics.
    const std::optional<FlashAttentionTile>& tile = k.flash;
    if (!tile || roles.scores < 0) {
      fail(tds, "", fmt::format("internal error: kernel {} trains on the flash kernels, but the fusion pass chose no "
                                "flash backward tile for it", k.name),
           "--no-fuse-rule attention_backward avoids it; please report it with the graph");
      return {};
    }
    const bool atomic = tile->atomic_dq;
    const std::vector<Param> scores = params(roles.scores);
    for (const auto& [name, slot] : {std::pair{"q", "a"}, std::pair{"k", "b"}})
      if (std::none_of(launch.begin(), launch.end(), [&](const LaunchParam& lp) { return lp.name == name; }))
        add(name, param(scores, slot));
    const Param& q = param(scores, "a");
    const FlashStatistics& f = flash_statistics_.at(roles.softmax);
    // f32 operands are read as the forward reads them: cg_tf32 or cg_f32_simt.
    const std::string type = tile->element_type(c_type(q.buffer->dtype));
    auto operand = [&](const char* name) { return flash_operand(type, q.buffer->dtype, name); };
    const int64_t stats_rows = flash_backward_statistics_rows(Tq);
    // (The Hopper kernel's key blocks read the statistics 64 rows a step, 32
    // over heads of 128, its query blocks a row at a time.)
    if (!tile->hopper && tile->block_m != kFlashBackwardBlockRows) {
      fail(tds, "", fmt::format("internal error: kernel {}'s flash backward tile has blocks of {} rows, its rows' "
                                "statistics cover multiples of {}", k.name, tile->block_m, kFlashBackwardBlockRows),
           "--no-fuse-rule attention_backward avoids it; please report it with the graph");
      return {};
    }
    // Both kernels copy q, k, v and dO 16 bytes at a time (cp.async, or TMA):
    // as the forward's, each on a 16-byte boundary of the arena.
    for (const auto& [slot, operand] : {std::pair<const char*, const Param*>{"q", &q}, {"k", &param(scores, "b")},
                                        {"v", &v}, {"dO", &dout}})
      if (const int64_t offset = plan_.buffers[size_t(operand->bound->buffer)].offset; offset % 16 != 0) {
        fail(tds, "", fmt::format("flash attention's backward copies {} 16 bytes at a time, but '{}' lies at arena "
                                  "offset {}, no multiple of 16",
                                  slot, ::cudagen::buffer_name(p_, operand->bound->buffer), offset),
             fmt::format("place buffers on 16-byte boundaries or more (--alignment is {} here; its default is 256)",
                         plan_.alignment));
        return {};
      }
    launch.push_back(LaunchParam{"cg_row_stats", "const float", -1, nullptr, false, f.rows_offset, f.rows_bytes});
    // Over heads of 128, two key blocks a tile of keys, each with half of dk's and dv's columns.
    const int64_t key_blocks =
        dk.present || dv.present ? (Tk + tile->block_m - 1) / tile->block_m * tile->key_splits() : 0;
    const int64_t query_tiles = dq.present && !atomic ? (Tq + tile->block_m - 1) / tile->block_m : 0;
    std::string dq_sums = "nullptr, nullptr";
    if (atomic) {
      const int64_t tiles_of_dq = (Tq + tile->block_n - 1) / tile->block_n;
      launch.push_back(LaunchParam{"cg_dq_accum", "float", -1, nullptr, true, split_k_.dq_offset, heads * Tq * tile->head_d * 4});
      launch.push_back(LaunchParam{"cg_dq_arrivals", "unsigned int", -1, nullptr, true, split_k_.dq_arrivals_offset,
                                   heads * tiles_of_dq * 4});
      dq_sums = fmt::format("cg_dq_accum + head * {}, cg_dq_arrivals + head * {}", Tq * tile->head_d, tiles_of_dq);
    }
    const double scale_log2 = arg_double(roles.scores, "alpha", 1.0) * arg_double(roles.softmax, "scale", 1.0) * 1.4426950408889634;
    const std::string ds_scale = float_arg(tds, "scale", 1.0);
    auto gradient_store = [&](const Gradient& gr, const std::string& rows, int64_t width) {
      if (!gr.present) return std::string("[&](cg_i64, int, float) {}");
      const std::string value = &gr == &dv || ds_scale == float_literal(1.0) ? "x" : ds_scale + " * x";
      return fmt::format("[&](cg_i64 row, int c, float x) {{ {}; }}",
                         store(gr, fmt::format("(head * {} + row) * {} + c", rows, width), value));
    };
    const int64_t D_heads = dq.present ? dq.width : dk.present ? dk.width : q.buffer->shape.back();
    ek.block = tile->threads();
    ek.grid[0] = key_blocks + query_tiles;
    ek.grid[1] = heads;
    ek.min_blocks_per_sm = tile->min_blocks_per_sm;
    const bool hopper = tile->hopper;
    const std::string key_split_note =
        tile->key_splits() > 1 ? fmt::format("; {} a tile of keys, each summing a share of their columns", tile->key_splits())
                               : "";
    ek.matmul_path = hopper ? fmt::format(
        "tensor cores: flash attention backward on the Hopper path (templates/softmax_flash_sm90.cuh), sm_90a: TMA and "
        "wgmma, {} key rows or query rows a block (a producer warpgroup, two consumers), {} rows a step, {} stages, "
        "heads of {}; {} blocks of keys (dk, dv{}) and {} of query rows (dq) a head{}",
        tile->block_m, tile->block_n, tile->stages, tile->heads(), key_blocks, key_split_note, query_tiles,
        options_.atomic_attention_backward && dq.present
            ? " (the Hopper kernel has no atomic mode: dq in blocks of its own, bit-identical from run to run)"
            : "") : fmt::format(
        "{}: flash attention backward (templates/softmax_flash.cuh), {} key rows or query rows a block ({} "
        "warps{}), {} rows a step, {} stages, heads of {}{}; {} blocks of keys (dk, dv{}{}) and {} of query rows (dq) a head{}",
        tile->cores(), tile->block_m, tile->block_m / 16,
        tile->min_blocks_per_sm > 1 ? fmt::format("; registers for {} blocks a SM", tile->min_blocks_per_sm) : "",
        tile->block_n, tile->stages, tile->head_d, tile->f32_note(), key_blocks, atomic ? ", dq" : "", key_split_note,
        query_tiles,
        atomic ? ", dq summed with atomics (--atomic-attention-backward: not bit-identical from run to run)"
        : options_.atomic_attention_backward && dq.present
            ? ", dq in blocks of its own (the atomic mode takes 16-bit heads of up to 64 with dk or dv)"
            : "") + (tile->why_not_hopper.empty() ? "" : "; not on the Hopper path: " + tile->why_not_hopper);
    // Grouped-query attention: the head of keys and values a head of q reads
    // (dk and dv are still the query head's: the tasks after sum the group;
    // describe says so).
    const Shape& keys = param(scores, "b").buffer->shape;
    const std::string kv_head = kv_head_of(q.buffer->shape, keys, "head");
    if (kv_head != "head")
      ek.matmul_path += fmt::format("; grouped-query: {} query heads a head of keys and values, dk and dv per query head "
                                    "(the tasks after the kernel sum each group)",
                                    heads / numel(Shape(keys.begin(), keys.end() - 2)));
    ek.mainloop = flash_mainloop(*tile);
    reserve_shared(ek,
                   hopper ? fmt::format("the block's own rows of two tensors and {} stages of two streamed tiles and "
                                        "their rows' statistics, from a 1024-byte boundary, each consumer warp's output "
                                        "rows, the barriers",
                                        tile->stages)
                          : fmt::format("the block's rows, {} stages of streamed rows and their statistics, then the "
                                        "output tile",
                                        tile->stages),
                   tile->backward_shared_bytes(atomic));
    const OpSignature& ds_op = *p_.tasks[size_t(tds)].op;
    for (const char* function : hopper ? std::vector<const char*>{"cg_flash_attention_backward_sm90",
                                                                  "cg_flash_backward_sm90_config"}
                                       : std::vector<const char*>{"cg_flash_attention_backward", "cg_flash_config"})
      use_function(ds_op, function);
    if (hopper) {
      // q, k, v and dO by TMA: 3-D maps (a plane a head; rows past a head's
      // length arrive as zeros), boxes of 64 columns by a step's rows (an own
      // tile several boxes high), in place of their pointers.
      std::erase_if(launch, [](const LaunchParam& lp) {
        return lp.name == "q" || lp.name == "k" || lp.name == "v" || lp.name == "dcontext";
      });
      const Param& kp = param(scores, "b");
      const int64_t kv_heads = numel(kp.buffer->shape) / (Tk * tile->head_d);
      auto map = [&](const char* name, const Param& operand, int head_size, int64_t rows, int64_t planes) {
        const int64_t row_bytes = int64_t(head_size) * 2;
        return LaunchParam{name, "const cg_tensor_map", operand.bound->buffer, nullptr, false, -1,
                           0, TensorMapSpec{arena_range(buffer_param("x", operand, false)).first, 2, head_size, rows,
                                            row_bytes, 64, tile->block_n, planes, rows * row_bytes}};
      };
      const std::vector<LaunchParam> maps = {
          map("q_map", q, tile->head_d, Tq, heads), map("k_map", kp, tile->head_d, Tk, kv_heads),
          map("v_map", v, tile->head_dv, Tk, kv_heads), map("dout_map", dout, tile->head_dv, Tq, heads)};
      launch.insert(launch.begin(), maps.begin(), maps.end());
      std::string body = fmt::format(
          "  CG_DYNAMIC_SMEM(cg_smem);\n"
          "  // Flash attention backward on the Hopper path: {0} blocks of keys, then {1} of query rows, a head{2}.\n"
          "  typedef cg_flash_backward_sm90_config<{3}> cg_config;\n"
          "{5}"
          "  const cg_i64 head = tile.y, kv_head = {4};\n",
          key_blocks, query_tiles, kv_head == "head" ? "" : " (of q: a group of them shares a head of keys and values)",
          tile->arguments(), kv_head, shared_bytes_agree("cg_config", tile->backward_shared_bytes()));
      body += epilogues;
      body += fmt::format(
          "  cg_flash_attention_backward_sm90<cg_config, {0}>({1}, {2}, {3}, {4}, cg_row_stats + head * {5},\n"
          "      {6}, {7}, tile.x, {8}, (int)head, (int)kv_head, {9}, {10}, {11},\n"
          "      {12},  // dq\n"
          "      {13},  // dk\n"
          "      {14},  // dv\n"
          "      cg_smem);\n",
          type, param_name(maps[0]), param_name(maps[1]), param_name(maps[2]), param_name(maps[3]), 2 * stats_rows, Tq,
          Tk, key_blocks, float_literal(scale_log2), float_arg(tdp, "alpha", 1.0),
          arg_bool(roles.softmax, "causal") ? "true" : "false", gradient_store(dq, std::to_string(Tq), D_heads),
          gradient_store(dk, std::to_string(Tk), D_heads), gradient_store(dv, std::to_string(Tk), Dv));
      // (The rows' launch takes part 1's configuration: it reads the head sizes alone.)
      FlashAttentionTile rows_tile = *tile;
      rows_tile.hopper = false;
      rows_tile.block_m = rows_tile.block_n = kFlashBackwardBlockRows;
      std::string code = flash_backward_rows_kernel(k, rows_tile, roles, dout, f, heads, Tq, Dv, emitted);
      return code + finish_kernel(k, ek, std::move(launch), body, emitted);
    }
    std::string body = fmt::format(
        "  CG_DYNAMIC_SMEM(cg_smem);\n"
        "  // Flash attention backward: {0} blocks of keys, then {1} of query rows, a head{3}.\n"
        "  typedef cg_flash_config<{2}> cg_config;\n"
        "  const cg_i64 head = tile.y, kv_head = {4};\n",
        key_blocks, query_tiles, tile->arguments(), kv_head == "head" ? "" : " (of q: a group of them shares a head of keys and values)",
        kv_head);
    body += epilogues;
    body += fmt::format(
        "  cg_flash_attention_backward<cg_config, {0}, {14}>({17} + head * {1}, {18} + kv_head * {2}, {19} + kv_head * {3},\n"
        "      {20} + head * {4}, cg_row_stats + head * {16}, {5}, {6}, tile.x, {7}, {8}, {9}, {10},\n"
        "      {15},\n"
        "      {11},  // dq\n"
        "      {12},  // dk\n"
        "      {13},  // dv\n"
        "      ({0}*)cg_smem);\n",
        type, Tq * D_heads, Tk * D_heads, Tk * Dv, Tq * Dv, Tq, Tk, key_blocks, float_literal(scale_log2),
        float_arg(tdp, "alpha", 1.0), arg_bool(roles.softmax, "causal") ? "true" : "false",
        gradient_store(dq, std::to_string(Tq), D_heads), gradient_store(dk, std::to_string(Tk), D_heads),
        gradient_store(dv, std::to_string(Tk), Dv), atomic ? "true" : "false", dq_sums, 2 * stats_rows, operand("q"),
        operand("k"), operand("v"), operand("dcontext"));
    std::string code = flash_backward_rows_kernel(k, *tile, roles, dout, f, heads, Tq, Dv, emitted);
    return code + finish_kernel(k, ek, std::move(launch), body, emitted);
  }

  // Shared memory, as the fusion pass bounded it.
  const AttentionBackwardShared smem = attention_backward_shared(
      Tk, D, Dv, dq.present, dk.present, buffer_name(dout.bound->buffer), buffer_name(probs.bound->buffer));
  use_shared(ek, smem.layout);
  const int64_t keys_at = smem.keys, values_at = smem.values, q_at = smem.q, dout_at = smem.dout,
                probs_at = smem.probs, ds_at = smem.ds;

  const std::string dp_id = p_.tasks[size_t(tdp)].task->id, ds_id = p_.tasks[size_t(tds)].task->id;
  std::string body = fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  const cg_i64 cg_head = tile.x;  // the block's head: its index over the leading axes of {0}\n"
      "  const unsigned int warp = threadIdx.x / 32;  // one warp per query row of a tile\n",
      buffer_name(probs.bound->buffer));
  if (dq.present) body += fmt::format("  float* cg_keys = {};\n", shared_floats(keys_at));
  body += fmt::format("  float* cg_values = {};\n", shared_floats(values_at));
  if (dk.present) body += fmt::format("  float* cg_q = {};\n", shared_floats(q_at));
  body += fmt::format("  float* cg_dout = {};\n  float* cg_probs = {};\n  float* cg_ds = {};\n", shared_floats(dout_at),
                      shared_floats(probs_at), shared_floats(ds_at));
  // Each thread's elements o of a [Tk, width] gradient: row j = o / width, column c = o % width.
  auto each_element = [&](const std::string& indent, int64_t width, const std::string& statement) {
    const int64_t per_thread = (Tk * width + kAttentionBackwardThreads - 1) / kAttentionBackwardThreads;
    return fmt::format(
        "{0}for (int cg_k = 0; cg_k < {1}; ++cg_k) {{\n"
        "{0}  const int o = threadIdx.x + cg_k * blockDim.x, j = o / {2}, c = o % {2};\n"
        "{0}  if (o < {3}) {4}\n"
        "{0}}}\n",
        indent, per_thread, width, Tk * width, statement);
  };
  for (const auto& [gr, name] : {std::pair{&dk, "dk"}, std::pair{&dv, "dv"}})
    if (gr->present)
      body += fmt::format("  float cg_acc_{}[{}] = {{}};  // {} of the head's [{}, {}], this thread's elements\n", name,
                          (Tk * gr->width + kAttentionBackwardThreads - 1) / kAttentionBackwardThreads,
                          buffer_name(p_.tasks[size_t(name == std::string("dk") ? tdk : tdv)].find_tensor("out")->buffer),
                          Tk, gr->width);
  body += epilogues;
  auto stage = [&](const std::string& to, const std::string& name, DType type, const std::string& count,
                   const std::string& first, const std::string& indent = "  ") {
    return fmt::format("{}for (int e = threadIdx.x; e < {}; e += blockDim.x) {}[e] = {};\n", indent, count, to,
                       load_element(name, type, first + " + e"));
  };
  // Grouped-query attention: the head of keys and values the block's head of
  // q reads (dk and dv are still the query head's: the tasks after sum the group).
  const std::string kv_head = kv_head_of(sp, v.buffer->shape, "cg_head");
  body += kv_head == "cg_head" ? "  // The head's keys and values.\n"
                               : fmt::format("  // The keys and values of the head's group (grouped-query attention).\n"
                                             "  const cg_i64 cg_kv_head = {};\n",
                                             kv_head);
  const std::string kv = kv_head == "cg_head" ? "cg_head" : "cg_kv_head";
  if (dq.present) body += stage("cg_keys", dq.operand, dq.operand_type, std::to_string(Tk * D), fmt::format("{} * {}", kv, Tk * D));
  body += stage("cg_values", "v", v.buffer->dtype, std::to_string(Tk * Dv), fmt::format("{} * {}", kv, Tk * Dv));
  body += fmt::format(
      "  for (int cg_row0 = 0; cg_row0 < {0}; cg_row0 += {1}) {{\n"
      "    const int cg_rows = {0} - cg_row0 < {1} ? {0} - cg_row0 : {1};\n"
      "    const cg_i64 cg_first = cg_head * {0} + cg_row0;  // the tile's first query row over all heads\n",
      Tq, R);
  if (dk.present)
    body += stage("cg_q", dk.operand, dk.operand_type, fmt::format("cg_rows * {}", D), fmt::format("cg_first * {}", D), "    ");
  body += stage("cg_dout", "dcontext", dout.buffer->dtype, fmt::format("cg_rows * {}", Dv), fmt::format("cg_first * {}", Dv),
                "    ");
  body += stage("cg_probs", "probs", probs.buffer->dtype, fmt::format("cg_rows * {}", Tk),
                fmt::format("cg_first * {}", Tk), "    ");
  body += fmt::format(
      "    __syncthreads();  // the tile's rows (the first time, the head's keys and values)\n"
      "    if (warp < cg_rows)\n"
      "      cg_attention_backward_row([&](int c) {{ return cg_dout[warp * {0} + c]; }},\n"
      "                                [&](int j) {{ return cg_probs[warp * {1} + j]; }},\n"
      "                                [&](int j, int c) {{ return cg_values[j * {0} + c]; }},\n"
      "                                [&](int j, int c) {{ return {2}; }},\n"
      "                                [&](float x) {{ return {3}; }},  // dp, as {4} stores it\n"
      "                                [&](float x) {{ return {5}; }},  // ds, as {6} stores it\n"
      "                                [&](int c, float acc) {{ {7}; }},\n"
      "                                {1}, {8}, {0}, {9}, {10}, cg_ds + warp * {1});\n"
      "    __syncthreads();  // every row's ds\n",
      Dv, Tk, dq.present ? fmt::format("cg_keys[j * {} + c]", D) : "0.0f", rounded(dp_type), dp_id, rounded(ds_type),
      ds_id, dq.present ? store(dq, fmt::format("(cg_first + warp) * {} + c", D), "acc") : "(void)c, (void)acc",
      dq.present ? D : 0, float_arg(tdp, "alpha", 1.0), float_arg(tds, "scale", 1.0));
  if (dk.present)
    body += each_element("    ", D, fmt::format("for (int r = 0; r < cg_rows; ++r) cg_acc_dk[cg_k] += cg_ds[r * {} + j] * cg_q[r * {} + c];", Tk, D));
  if (dv.present)
    body += each_element("    ", Dv, fmt::format("for (int r = 0; r < cg_rows; ++r) cg_acc_dv[cg_k] += cg_probs[r * {} + j] * cg_dout[r * {} + c];", Tk, Dv));
  body += "    __syncthreads();  // the next tile overwrites the rows\n  }\n";
  if (dk.present || dv.present) body += "  // The head's key and value gradients, summed over its query rows.\n";
  if (dk.present) body += each_element("  ", D, store(dk, fmt::format("(cg_head * {} + j) * {} + c", Tk, D), "cg_acc_dk[cg_k]") + ";");
  if (dv.present) body += each_element("  ", Dv, store(dv, fmt::format("(cg_head * {} + j) * {} + c", Tk, Dv), "cg_acc_dv[cg_k]") + ";");
  return finish_kernel(k, ek, std::move(launch), body, emitted);
}

// The kernel's IR stages that compute the attention.
Emitter::AttentionTasks Emitter::attention_tasks(const KernelGroup& k) const {
  AttentionTasks at{kir::role_task(k.ir, "scores"), kir::role_task(k.ir, "softmax"), kir::role_task(k.ir, "context")};
  // (fuse.cpp: the bias's add is an epilogue of the scores, which the softmax reads.)
  if (at.softmax >= 0)
    for (int t : k.tasks)
      if (is_op(p_.tasks[size_t(t)], BundledOp::add) &&
          p_.tasks[size_t(t)].find_tensor("out")->buffer == p_.tasks[size_t(at.softmax)].find_tensor("x")->buffer)
        at.bias = t;
  return at;
}

Param Emitter::attention_bias_operand(const AttentionTasks& at) {
  const std::vector<Param> add = params(at.bias);
  const int scores = p_.tasks[size_t(at.scores)].find_tensor("out")->buffer;
  return param(add, "a").bound->buffer == scores ? param(add, "b") : param(add, "a");
}

std::string Emitter::attention_bias(const AttentionTasks& at, int64_t Tk, std::vector<LaunchParam>& launch) {
  if (at.bias < 0) return "[&](int, float x) { return x; }";
  const Param bias = attention_bias_operand(at);
  const Shape& shape = p_.buffers[size_t(p_.tasks[size_t(at.scores)].find_tensor("out")->buffer)].shape;
  launch.push_back(buffer_param("bias", bias, false));
  // (Where the bias's element (row, key) lies: numpy broadcasting against the scores.)
  return fmt::format("[&](int j, float x) {{ return x + {}; }}",
                     load_element("bias", bias.buffer->dtype,
                                  broadcast_index(shape, bias.buffer->shape, fmt::format("(row * {} + j)", Tk))));
}

// The IR's projection stages: each a matmul, an epilogue perhaps, and the
// split into heads kept in shared memory that ends its chain.
std::vector<Emitter::Projection> Emitter::attention_projections(const KernelGroup& k) {
  std::vector<Projection> out;
  for (const kir::Stage& stage : k.ir.stages) {
    if (stage.role != "projection") continue;
    Projection pr{.matmul = stage.task};
    for (int node : stage.chain) {
      const kir::Node& n = k.ir.nodes[size_t(node)];
      if (n.kind == kir::Node::Kind::store_permuted) {
        pr.split = n.task;
        pr.heads = n.buffer;
      } else {
        pr.epilogue = true;
      }
    }
    out.push_back(pr);
  }
  return out;
}

// The code that computes the projections before the attention's rows
// (fuse.cpp checked their form: [..., T, K] @ [K, H * Dh], split into
// [..., H, T, Dh]). Each block works on one (batch, head): it stages its
// batch's rows of every projection input in shared memory (normalised by
// the norm prologue that computes it), then computes the head's columns of
// each projection there (its weight's columns staged in turn), element by
// element in the unfused kernel's order of operations (f32 accumulation,
// then alpha, then the epilogue, rounded to the head tensor's type; the
// sums in k order, where the unfused 16-bit kernel's tensor-core tile
// adds its partial products in another): the
// keys and values (staged_k, staged_v), the queries (cg_q_rows). A head
// tensor read later is stored as well. `operands`: the q, k and v buffers.
// The norm of kernel k's prologue that computes projection input
// `source`, or -1 where none does.
int Emitter::source_norm(const KernelGroup& k, int source) const {
  for (int t : k.prologue)
    if (p_.tasks[size_t(t)].find_tensor("out")->buffer == source) return t;
  return -1;
}

// What each projection stages in shared memory, in the order
// projection_code stages it (attention_shared lays it out), and the
// largest projection's weight columns for one head.
std::vector<AttentionProjectionShared> Emitter::projection_shared(const KernelGroup& k, const std::vector<Projection>& projections,
                                                                  int q_heads, int64_t& weight_floats) const {
  std::vector<AttentionProjectionShared> out;
  if (projections.empty()) return out;
  const Shape& sq = p_.buffers[size_t(q_heads)].shape;
  const int64_t H = sq.size() >= 3 ? sq[sq.size() - 3] : 1;
  for (const Projection& pr : projections) {
    const BoundTask& mm = p_.tasks[size_t(pr.matmul)];
    const int source = mm.find_tensor("a")->buffer;
    const Shape& sa = p_.buffers[size_t(source)].shape;
    const int64_t T = sa[sa.size() - 2], K = sa.back(), Dh = p_.buffers[size_t(mm.find_tensor("out")->buffer)].shape.back() / H;
    weight_floats = std::max(weight_floats, K * Dh);
    AttentionProjectionShared s{.source = source, .source_floats = projection_source_floats(T, K, false, false, false)};
    s.source_what = fmt::format("{}'s {} rows of a batch", buffer_name(source), T);
    if (const int t = source_norm(k, source); t >= 0) {
      const BoundTask& norm = p_.tasks[size_t(t)];
      const bool layer = norm.op->norm == "layer", stored = !contains(k.internal_buffers, source);
      s.source_floats = projection_source_floats(T, K, true, layer, stored);
      s.source_what = fmt::format("{}'s {} rows of a batch normalised, its weight{}{}", norm.task->id, T,
                                  layer ? " and bias" : "", stored ? ", the rows' statistics" : "");
    }
    if (pr.heads == q_heads) {
      s.q_floats = T * Dh;
      s.q_what = fmt::format("the head's {} query rows ({} floats each)", T, Dh);
    }
    out.push_back(std::move(s));
  }
  return out;
}

Emitter::ProjectionCode Emitter::projection_code(const KernelGroup& k, const std::vector<Projection>& projections,
                                                 const std::array<int, 3>& operands, const AttentionShared& smem) {
  ProjectionCode out;
  const Shape& sq = p_.buffers[size_t(operands[0])].shape;
  const int64_t H = sq.size() >= 3 ? sq[sq.size() - 3] : 1;
  out.code = fmt::format(
      "  // Projections (attention_projection): the block's (batch, head) picks the rows\n"
      "  // (the batch's tokens) and the columns (the head's) it computes of each.\n"
      "  const cg_i64 cg_head = tile.x;  // batch * {0} + head\n"
      "  const cg_i64 cg_batch = cg_head / {0};\n"
      "  const int cg_h = (int)(cg_head % {0});\n",
      H);
  auto add = [&](const std::string& name, const Param& x) {
    out.params.push_back(buffer_param(name, x));
  };
  std::map<int, std::string> staged_rows;  // a projection input -> its rows in shared memory
  bool weights_staged = false;
  for (const Projection& pr : projections) {
    const int mm = pr.matmul;
    const std::string& id = p_.tasks[size_t(mm)].task->id;
    const std::vector<Param> ps = params(mm);
    if (!diags_.ok()) return out;
    const Param& a = param(ps, "a");
    const Param& b = param(ps, "b");
    const Param& mm_out = param(ps, "out");
    if (!check_f32_accumulation(mm, a)) return out;
    const Shape& sa = a.buffer->shape;
    const int64_t T = sa[sa.size() - 2], K = sa.back(), N = mm_out.buffer->shape.back(), Dh = N / H;
    const int source = a.bound->buffer;
    // The norm that computes the input, where one does (its output is then
    // rounded as the norm would have stored it).
    const int norm = source_norm(k, source);
    if (!staged_rows.count(source)) {
      const std::string rows_name = "cg_rows_" + (norm >= 0 ? p_.tasks[size_t(norm)].task->id : id);
      staged_rows[source] = rows_name;
      if (norm >= 0) {
        const BoundTask& nt = p_.tasks[size_t(norm)];
        const bool layer = nt.op->norm == "layer";
        const std::vector<Param> nps = params(norm);
        if (!diags_.ok()) return out;
        const std::string nid = nt.task->id;
        // Read later (the backward pass), the norm's output and statistics
        // are stored from here: by the blocks of each batch's first head.
        const bool store_norm = !contains(k.internal_buffers, nt.find_tensor("out")->buffer);
        const int64_t per_row = layer ? 2 : 1;
        const int64_t at = smem.sources.at(source);
        template_files_.insert(nt.op->source_file);
        use_function(*nt.op, "cg_" + nt.op->name + "_stage_rows");
        const Param& nx = param(nps, "x");
        std::string weights = fmt::format("[&](int j) {{ return {}; }}",
                                          load_element(nid + "_weight", param(nps, "weight").buffer->dtype, "j"));
        add(nid + "_x", nx);
        add(nid + "_weight", param(nps, "weight"));
        if (layer) {
          weights += fmt::format(", [&](int j) {{ return {}; }}", load_element(nid + "_bias", param(nps, "bias").buffer->dtype, "j"));
          add(nid + "_bias", param(nps, "bias"));
        }
        const int64_t stats_at = T * K + per_row * K;
        out.code += fmt::format(
            "  // {0} ({1}) of {2}: the batch's {3} rows normalised into shared memory.\n"
            "  float* {4} = (float*)(cg_smem + {5});\n"
            "  cg_{1}_stage_rows([&](cg_i64 r, int j) {{ return {6}; }}, {7},\n"
            "                        cg_batch * {3}, {3}, cg_batch * {3} + {3}, {8}, {9}, {4}, {4} + {10}, {11});\n",
            nid, nt.op->name, buffer_name(nx.bound->buffer), T, rows_name, at,
            load_element(nid + "_x", nx.buffer->dtype, fmt::format("r * {} + j", K)), weights, K,
            float_arg(norm, "eps", layer ? 1e-5 : 1e-6), T * K,
            store_norm ? fmt::format("{} + {}", rows_name, stats_at) : "nullptr");
        if (store_norm) {
          std::vector<std::string> stats;
          for (const char* stat : {"mean", "rstd"})
            if (const BoundTensor* st = nt.find_tensor(stat); st != nullptr && st->buffer >= 0) {
              stats.push_back(stat);
              add(nid + "_" + stat, param(nps, stat));
            }
          add(nid + "_out", param(nps, "out"));
          out.code += stored_norm_rows(
              {.norm = norm,
               .owner = "cg_h == 0",
               .who = ", by each batch's first head",
               .row0 = fmt::format("cg_batch * {}", T),
               .rows = T,
               .K = K,
               .element = rows_name + "[i]",
               .stats = stats,
               .stat_at = [&](const std::string& stat) {
                 // The staging function keeps a layernorm's means first, then its rstds.
                 return fmt::format("{}[{} + r]", rows_name, stats_at + (layer && stat == "rstd" ? T : 0));
               }});
        }
      } else {
        const int64_t at = smem.sources.at(source);
        add(id + "_a", a);
        out.code += fmt::format(
            "  // {0}: the batch's {1} rows in shared memory.\n"
            "  float* {2} = (float*)(cg_smem + {3});\n"
            "  cg_stage_rows([&](int j, int c) {{ return {4}; }}, {2}, {1}, {5});\n",
            buffer_name(source), T, rows_name, at,
            load_element(id + "_a", a.buffer->dtype, fmt::format("(cg_batch * {} + j) * {} + c", T, K)), K);
      }
    }
    const bool is_q = pr.heads == operands[0];
    const std::string role = is_q ? "q" : pr.heads == operands[1] ? "k" : "v";
    const std::string dest = is_q ? "cg_q_rows" : role == "k" ? "staged_k" : "staged_v";
    if (is_q)
      out.code += fmt::format("  float* cg_q_rows = {};\n", shared_floats(smem.queries));
    const BufferInfo& heads = p_.buffers[size_t(pr.heads)];
    const bool narrowed = is_16bit(heads.dtype);
    const std::string kept = narrowed ? fmt::format("cg_widen(cg_narrow<{}>(value))", c_type(heads.dtype)) : "value";
    std::string store_heads;
    if (!contains(k.internal_buffers, pr.heads)) {
      const int split = pr.split;
      const std::string name = p_.tasks[size_t(split)].task->id + "_out";
      const std::vector<Param> split_ps = params(split);
      add(name, param(split_ps, "out"));
      store_heads = fmt::format("\n    {};  // {}, read later",
                                store_element(name, heads.dtype, fmt::format("(cg_head * {} + r) * {} + c", T, Dh), "value"),
                                buffer_name(pr.heads));
    }
    // Element i of the projection's output (before the split), where it lands.
    out.code += fmt::format(
        "  // {0} (matmul){1}, split into {2}: the block's head, into shared memory.\n"
        "  auto cg_keep_{3} = [&](cg_i64 i, float value) {{\n"
        "    const int r = (int)(i / {4} - cg_batch * {5}), c = (int)(i % {4}) - cg_h * {6};\n"
        "    {7}[r * {6} + c] = {8};{9}\n"
        "  }};\n",
        id, pr.epilogue ? " and its epilogue" : "", buffer_name(pr.heads), role, N, T, Dh, dest, kept,
        store_heads);
    std::string sink = "cg_keep_" + role;
    if (pr.epilogue) {
      const std::string lambda = "cg_epilogue_" + role;
      Epilogue e = epilogue(k, mm_out, {.lambda = lambda,
                                        .anchor_name = id + "_out",
                                        .keep = "cg_keep_" + role + "(i, {})",
                                        .kept_buffer = param(params(pr.split), "x").bound->buffer});
      if (!diags_.ok()) return out;
      out.code += e.code;
      out.params.insert(out.params.end(), e.params.begin(), e.params.end());
      sink = lambda;
    }
    std::string element_a = fmt::format("{}[r * {} + k]", staged_rows[source], K);
    if (norm >= 0 && is_16bit(a.buffer->dtype))
      element_a = fmt::format("cg_widen(cg_narrow<{}>({}))", c_type(a.buffer->dtype), element_a);
    add(id + "_b", b);
    // The head's columns of the weight in shared memory (one region, each
    // projection's in turn), then one output element per thread.
    if (!std::exchange(weights_staged, true))
      out.code += fmt::format("  float* cg_weights = {};\n", shared_floats(smem.weights));
    out.code += fmt::format(
        "  cg_stage_rows([&](int k, int c) {{ const int n = cg_h * {1} + c; return {2}; }}, cg_weights, {0}, {1});\n"
        "  for (int e = threadIdx.x; e < {3} * {1}; e += blockDim.x) {{\n"
        "    const int r = e / {1}, c = e % {1};\n"
        "    const cg_i64 m = cg_batch * {3} + r;  // the row of {4}: a token\n"
        "    const int n = cg_h * {1} + c;\n"
        "    float acc = 0.0f;\n"
        "    for (int k = 0; k < {0}; ++k) acc += {5} * cg_weights[k * {1} + c];\n"
        "    {6}(m * {7} + n, {8});\n"
        "  }}\n"
        "  __syncthreads();  // the rows computed, the weights read: before the next projection or the warps' rows\n",
        K, Dh, load_element(id + "_b", b.buffer->dtype, b_index(arg_bool(mm, "trans_b"), K, N)), T,
        buffer_name(mm_out.bound->buffer), element_a, sink, N, scaled_accumulator(mm));
  }
  return out;
}

// Whether kernel `k` runs flash attention's backward kernel in the atomic
// mode (its tile's atomic_dq, as the fusion pass chose it: asked for, dq and
// a key or value gradient present, heads of up to 64); then the f32 sums of
// dq over all its heads and their query tiles.
bool Emitter::flash_backward_atomic(const KernelGroup& k, int64_t* dq_floats, int64_t* query_tiles) const {
  if (!k.flash_trained || k.rule != FusionRule::attention_backward || !k.flash || !k.flash->atomic_dq) return false;
  const FlashAttentionTile* tile = &*k.flash;
  const Shape& dq = p_.buffers[size_t(p_.tasks[size_t(kir::role_task(k.ir, "dq"))].find_tensor("out")->buffer)].shape;
  const int64_t Tq = dq[dq.size() - 2], heads = numel(dq) / (Tq * dq.back());
  if (dq_floats != nullptr) *dq_floats = heads * Tq * tile->head_d;
  if (query_tiles != nullptr) *query_tiles = heads * ((Tq + tile->block_n - 1) / tile->block_n);
  return true;
}

// Places flash_statistics_ after the plan: each trained attention's own
// (the forward and the backward phase are apart: nothing shares them).
void Emitter::plan_flash_statistics(const std::vector<KernelGroup>& kernels) {
  int64_t at = align_up(plan_.arena_bytes, plan_.alignment);
  for (const KernelGroup& k : kernels) {
    if (!k.flash_trained || k.rule != FusionRule::attention) continue;
    const AttentionTasks tasks = attention_tasks(k);
    const BufferInfo& q = p_.buffers[size_t(p_.tasks[size_t(tasks.scores)].find_tensor("a")->buffer)];
    const BufferInfo& v = p_.buffers[size_t(p_.tasks[size_t(tasks.context)].find_tensor("b")->buffer)];
    const int64_t rows = numel(q.shape) / q.shape.back();  // heads x Tq
    const int64_t Tq = q.shape[q.shape.size() - 2];
    FlashStatistics f;
    f.lse_offset = at;
    f.lse_bytes = rows * 4;
    f.o_offset = align_up(at + f.lse_bytes, plan_.alignment);
    f.o_bytes = rows * v.shape.back() * dtype_bytes(q.dtype);
    f.rows_offset = align_up(f.o_offset + f.o_bytes, plan_.alignment);
    f.rows_bytes = rows / Tq * flash_backward_statistics_rows(Tq) * 8;
    at = align_up(f.rows_offset + f.rows_bytes, plan_.alignment);
    flash_statistics_[tasks.softmax] = f;
  }
  flash_statistics_end_ = flash_statistics_.empty() ? 0 : at;
}

}  // namespace cudagen::lowering
