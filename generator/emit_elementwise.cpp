#include "emitter.h"

namespace cudagen::lowering {

// EmittedKernel::rows for the skeletons whose tiles own whole rows: a
// matmul's row of output tiles (its `a` rows too, unless transposed or
// broadcast over the batch), and a block-per-row op's row. What an epilogue
// reads or stores at the anchor's own element is row by row as well; a
// weight, the matmul's `b`, anything broadcast is not.
void Emitter::mark_rows(int t, const std::vector<Param>& ps, const std::vector<LaunchParam>& prologue,
                        const std::vector<LaunchParam>& tail, const std::vector<LaunchParam>& launch, EmittedKernel& ek) {
  const OpSignature& op = *p_.tasks[size_t(t)].op;
  std::set<int> by_rows;
  Shape row_shape;
  if (op.pattern == PatternKind::matmul) {
    const Param& a = param(ps, "a");
    const Param& b = param(ps, "b");
    const Shape& so = param(ps, "out").buffer->shape;
    const Shape& sa = a.buffer->shape;
    const int64_t M = so[so.size() - 2];
    const int tile = int(ek.tile_rows > 0 ? ek.tile_rows : matmul_tile_rows(a.buffer->dtype));  // as matmul() chose
    const bool a_per_batch = Shape(sa.begin(), sa.end() - 2) == Shape(so.begin(), so.end() - 2);
    if (arg_bool(t, "trans_a") || !a_per_batch || (ek.grid[2] > 1 && M % tile != 0)) return;
    ek.rows = numel(so) / so.back();  // batches x M, flattened or not
    ek.rows_per_tile = tile;
    ek.tiles_per_row_block = ek.grid[0];
    if (a.bound->buffer != b.bound->buffer) by_rows.insert(a.bound->buffer);
    // A norm's input, read in place of `a`, row for row (the weight is not).
    for (const LaunchParam& lp : prologue)
      if (p_.buffers[size_t(lp.buffer)].shape == sa) by_rows.insert(lp.buffer);
    by_rows.insert(param(ps, "out").bound->buffer);
    row_shape = so;
  } else if (!op.rows.empty()) {
    const Shape& sx = param(ps, op.rows).buffer->shape;
    const int64_t rows = numel(sx) / sx.back();
    if (ek.grid[0] != rows || ek.grid[1] != 1 || ek.grid[2] != 1) return;
    ek.rows = rows;
    ek.rows_per_tile = 1;
    ek.tiles_per_row_block = 1;
    const Shape per_row(sx.begin(), sx.end() - 1);
    for (const Param& x : ps)
      if (x.bound->sig->role != SlotRole::weight && (x.buffer->shape == sx || x.buffer->shape == per_row))
        by_rows.insert(x.bound->buffer);
    row_shape = sx;
  } else {
    return;
  }
  for (const LaunchParam& lp : tail)
    if (p_.buffers[size_t(lp.buffer)].shape == row_shape && !(op.pattern == PatternKind::matmul &&
                                                               lp.buffer == param(ps, "b").bound->buffer))
      by_rows.insert(lp.buffer);
  for (size_t i = 0; i < launch.size(); ++i)
    if (launch[i].scalar == nullptr && by_rows.count(launch[i].buffer)) ek.ranges[i].by_rows = true;
}

// Rule norm_prologue (fuse.h): the kernel's matmul reads its `a` as the
// norm k.prologue[0] would have computed it. Its input, weight (and bias)
// become parameters named after the norm; matmul() stages the tile's rows
// normalised in shared memory (or, rows too long for that, computes their
// statistics and normalises each element as it loads it). The kernel that
// stores the norm's output and statistics for later (kernels.h) takes
// them too.
std::vector<LaunchParam> Emitter::prologue(const KernelGroup& k) {
  if (!norm_prologue(p_, k)) return elementwise_prologue(k);
  prologue_task_ = k.prologue.front();
  const BoundTask& norm = p_.tasks[size_t(prologue_task_)];
  template_files_.insert(norm.op->source_file);
  prologue_stores_ = stores_prologue(p_, k);
  std::vector<LaunchParam> params;  // x, weight (bias); where it stores: out, its statistics
  for (const BoundTensor& bound : norm.tensors) {
    const bool written = bound.sig->written();
    if (bound.buffer < 0 || (written && !prologue_stores_)) continue;
    params.push_back(LaunchParam{norm.task->id + "_" + bound.name,
                                 std::string(written ? "" : "const ") + c_type(p_.buffers[size_t(bound.buffer)].dtype),
                                 bound.buffer, nullptr, written});
  }
  return params;
}

// One op node of kernel k's IR in a chain (an epilogue's, an elementwise
// prologue's) run on element i of `domain`: its statement, defining local
// `value`. Each operand is a node of the chain computed before it
// (`value_of`, by node), else its element loaded from memory (at i, or
// through its broadcast) by a parameter named after its first reader, added
// to `params` once (`param_of`, by buffer), or as `load_operand` reads it
// where given. Records `value` as the node's. `ps`: the task's params().
std::string Emitter::chain_task(const KernelGroup& k, int node, const std::vector<Param>& ps, const Shape& domain,
                                const std::string& value, std::map<int, std::string>& value_of,
                                std::map<int, std::string>& param_of, std::vector<LaunchParam>& params,
                                const OperandLoad& load_operand, const std::string& indent) {
  const kir::Node& n = k.ir.nodes[size_t(node)];
  const int t = n.task;
  const OpSignature& op = *p_.tasks[size_t(t)].op;
  const Param* result = nullptr;
  std::map<std::string, std::string> present;
  for (const auto& x : ps) {
    if (x.written) {
      result = &x;
      continue;
    }
    if (auto v = value_of.find(input_node(k.ir, node, x)); v != value_of.end()) {
      present[x.bound->name] = v->second;
      continue;
    }
    auto [it, added] = param_of.emplace(x.bound->buffer, p_.tasks[size_t(t)].task->id + "_" + x.bound->name);
    if (added) params.push_back(LaunchParam{it->second, "const " + c_type(x.buffer->dtype), x.bound->buffer, nullptr, false});
    const std::string index = reads_own_element(op, x, domain) ? "i" : broadcast_index(domain, x.buffer->shape, "i");
    present[x.bound->name] =
        load_operand ? load_operand(it->second, x, index) : load_element(it->second, x.buffer->dtype, index);
  }
  value_of[node] = value;
  return chain_statement(t, *result, input_operands(t, present, "i"), value, indent);
}

// The node that op node `node` reads its input `x` from (kir::Node::inputs), or -1.
int Emitter::input_node(const kir::Kernel& ir, int node, const Param& x) {
  for (int in : ir.nodes[size_t(node)].inputs)
    if (ir.nodes[size_t(in)].buffer == x.bound->buffer) return in;
  return -1;
}

// An epilogue's first value: the result of `stage` that is `buffer`, as v0
// (the lambda's parameter), by node.
std::map<int, std::string> Emitter::anchor_value(const kir::Kernel& ir, const kir::Stage& stage, int buffer) {
  std::map<int, std::string> value_of;
  for (int r : stage.results)
    if (ir.nodes[size_t(r)].buffer == buffer) value_of[r] = "v0";
  return value_of;
}

// The local a chain names task t's value by: v and its place in `tasks`
// (the kernel's, or its prologue's).
std::string Emitter::chain_local(const std::vector<int>& tasks, int t) {
  return fmt::format("v{}", std::find(tasks.begin(), tasks.end(), t) - tasks.begin());
}

// Rule elementwise_prologue (fuse.h): the kernel's first task (a matmul,
// a row op) reads operand k.prologue_operand as the chain k.prologue would
// have stored it. A lambda, cg_prologue, computes its element i from the
// chain's inputs (each at its own index or through its broadcast), rounded
// to the operand's type as the chain's store would have; the skeleton's
// load() of the operand calls it. Returns the chain's inputs, parameters
// named after their tasks.
std::vector<LaunchParam> Emitter::elementwise_prologue(const KernelGroup& k) {
  const kir::Stage& first = k.ir.stages.front();
  const auto operand = std::find_if(first.operands.begin(), first.operands.end(),
                                    [&](const kir::Operand& o) { return o.slot == k.prologue_operand; });
  if (operand == first.operands.end()) {
    fail(k.tasks.front(), k.prologue_operand, "the kernel's IR has no prologue for this operand",
         "an internal error of cudagen: please report it with the graph; --no-fuse-rule elementwise_prologue avoids it");
    return {};
  }
  const int buffer = k.ir.nodes[size_t(operand->node)].buffer;
  const BufferInfo& info = p_.buffers[size_t(buffer)];
  std::map<int, std::string> value_of, param_of;
  std::vector<LaunchParam> launch;
  std::vector<std::string> tasks;
  std::string statements;
  for (int node : kir::tree_ops(k.ir, operand->node)) {
    const int t = k.ir.nodes[size_t(node)].task;
    const OpSignature& op = *p_.tasks[size_t(t)].op;
    template_files_.insert(op.source_file);
    use_function(op, op.source_function);
    tasks.push_back(fmt::format("{} ({})", p_.tasks[size_t(t)].task->id, op.name));
    statements += chain_task(k, node, params(t), info.shape, chain_local(k.prologue, t), value_of, param_of, launch);
  }
  const std::string& value = value_of.at(operand->node);
  operand_prologue_ = fmt::format(
      "  // Prologue (elementwise_prologue): {}, element i of {} as the load of `{}` reads it.\n"
      "  auto cg_prologue = [&](cg_i64 i) {{\n{}    return {};\n  }};\n",
      fmt::join(tasks, ", "), buffer_name(buffer), k.prologue_operand, statements,
      is_16bit(info.dtype) ? fmt::format("cg_widen(cg_narrow<{}>({}))", c_type(info.dtype), value) : value);
  return launch;
}

// The epilogue on `out`, the result of one of the kernel's IR stages: the
// stage's chain (kir::Stage::chain) as a lambda the skeleton calls where it
// would store element i of `out`, with the value in f32.
Emitter::Epilogue Emitter::epilogue(const KernelGroup& k, const Param& out, const EpilogueSpan& span) {
  Epilogue e;
  const int s = kir::stage_of_result(k.ir, out.bound->buffer);
  if (s < 0) {
    fail(k.tasks.front(), "", fmt::format("no stage of kernel {} computes {}", k.name, buffer_name(out.bound->buffer)),
         "an internal error of cudagen: please report it with the graph; --no-fuse reruns it unfused");
    return e;
  }
  const kir::Stage& stage = k.ir.stages[size_t(s)];
  const Shape& domain = out.buffer->shape;
  std::map<int, std::string> value_of = anchor_value(k.ir, stage, out.bound->buffer), param_of;
  std::string statements, stores;
  auto stored = [&](int t, const Param& x, const std::string& value) {
    if (contains(k.internal_buffers, x.bound->buffer)) return;
    const std::string name = p_.tasks[size_t(t)].task->id + "_" + x.bound->name;
    e.params.push_back(LaunchParam{name, c_type(x.buffer->dtype), x.bound->buffer, nullptr, true});
    stores += fmt::format("    {};\n", store_element(name, x.buffer->dtype, "i", value));
  };
  std::vector<std::string> tasks;
  for (int node : stage.chain) {
    const kir::Node& n = k.ir.nodes[size_t(node)];
    // A permuted store into shared memory is the caller's (span.keep).
    if (n.kind == kir::Node::Kind::store_permuted && n.in_kernel) continue;
    const int t = n.task;
    const OpSignature& op = *p_.tasks[size_t(t)].op;
    template_files_.insert(op.source_file);
    use_function(op, op.source_function);
    tasks.push_back(fmt::format("{} ({})", p_.tasks[size_t(t)].task->id, op.name));
    const std::vector<Param> ps = params(t);
    if (n.kind == kir::Node::Kind::store_permuted) {  // rule permuted_store
      const Param& x = param(ps, "x");
      const Param& out_param = param(ps, "out");
      const std::string name = p_.tasks[size_t(t)].task->id + "_out";
      e.params.push_back(LaunchParam{name, c_type(out_param.buffer->dtype), out_param.bound->buffer, nullptr, true});
      stores += fmt::format("    {};  // {} ({}): where it moves element i\n",
                            store_element(name, out_param.buffer->dtype, permuted_index(t, x, out_param),
                                          value_of.at(n.inputs.front())),
                            p_.tasks[size_t(t)].task->id, op.name);
      continue;
    }
    const std::string v = chain_local(k.tasks, t);
    statements += chain_task(k, node, ps, domain, v, value_of, param_of, e.params);
    for (const auto& x : ps)
      if (x.written) stored(t, x, v);
  }
  std::string anchor_store;
  if (!contains(k.internal_buffers, out.bound->buffer))
    anchor_store = fmt::format("    {};\n", store_element(span.anchor_name.empty() ? out.bound->name : span.anchor_name,
                                                          out.buffer->dtype, "i", "v0"));
  if (!span.keep.empty()) {
    std::string value;
    for (const auto& [node, local] : value_of)
      if (k.ir.nodes[size_t(node)].buffer == span.kept_buffer) value = local;
    if (value.empty()) {
      fail(k.tasks.front(), "",
           fmt::format("kernel {} keeps {}, which its epilogue does not compute", k.name, buffer_name(span.kept_buffer)),
           "an internal error of cudagen: please report it with the graph; --no-fuse reruns it unfused");
      return e;
    }
    stores += "    " + fmt::format(fmt::runtime(span.keep), value) + ";\n";
  }
  e.code = fmt::format(
      "  // Epilogue ({}): {}, on element i of {} as it is computed.\n"
      "  auto {} = [&](cg_i64 i, float v0) {{\n{}{}{}  }};\n",
      to_string(k.rule), fmt::join(tasks, ", "), buffer_name(out.bound->buffer), span.lambda, anchor_store, statements, stores);
  // One anchor and its whole chain, stored as it is: also on a vector of elements.
  if (k.ir.stages.size() == 1 && span.keep.empty() && span.anchor_name.empty()) vector_epilogue(k, out, e);
  return e;
}

// Epilogue::vector_code for the chain of kernel k after `out` (a whole
// matmul_epilogue chain): W elements from i, a multiple of W, where W is
// 16 bytes of the widest tensor the chain touches (4 or 8 elements) and
// divides the domain's rows; every input read at the element's own index
// or through a broadcast of whole trailing axes (a bias: one vector at i %
// n), or a single value. Otherwise (a permuted store, another broadcast,
// 8-byte values) none: the skeleton calls the element-wise lambda.
void Emitter::vector_epilogue(const KernelGroup& k, const Param& out, Epilogue& e) {
  const Shape& domain = out.buffer->shape;
  int64_t widest = dtype_bytes(out.buffer->dtype);
  for (const LaunchParam& lp : e.params)
    if (lp.buffer >= 0) widest = std::max<int64_t>(widest, dtype_bytes(p_.buffers[size_t(lp.buffer)].dtype));
  if (widest > 4 || domain.empty()) return;
  const int width = int(16 / widest);
  if (domain.back() % width != 0) return;
  std::vector<LaunchParam> unused;
  std::string loads, statements, locals, stores;
  std::set<std::string> loaded;
  bool vectorizable = true;
  auto vector_load = [&](const std::string& name, const Param& x, const std::string& index) -> std::string {
    const std::string whole_rows = fmt::format("(i % {})", numel(x.buffer->shape));
    if (index == "0") {  // one value for every element
      if (loaded.insert(name).second)
        loads += fmt::format("    const float {}_s = {};\n", name, load_element(name, x.buffer->dtype, "0"));
      return name + "_s";
    }
    if (index != "i" && (index != whole_rows || numel(x.buffer->shape) % width != 0)) {
      vectorizable = false;
      return "0";
    }
    if (loaded.insert(name).second)
      loads += fmt::format("    const cg_vector<{0}, {1}> {2}_v = cg_load_vector<{0}>({2}, {3});\n", width,
                           c_type(x.buffer->dtype), name, index);
    return widen_from(x.buffer->dtype, name + "_v.v[w]");
  };
  auto stored = [&](const std::string& name, const Param& x, const std::string& value) {
    locals += fmt::format("    cg_vector<{}, {}> {}_v;\n", width, c_type(x.buffer->dtype), name);
    statements += fmt::format("      {}_v.v[w] = {};\n", name, narrow_to(x.buffer->dtype, value));
    stores += fmt::format("    cg_store_vector<{}>({}, i, {}_v);\n", width, name, name);
  };
  if (!contains(k.internal_buffers, out.bound->buffer)) stored(out.bound->name, out, "v0");
  const kir::Stage& stage = k.ir.stages.front();
  std::map<int, std::string> value_of = anchor_value(k.ir, stage, out.bound->buffer), param_of;
  for (size_t j = 0; j < stage.chain.size() && vectorizable; ++j) {
    const kir::Node& n = k.ir.nodes[size_t(stage.chain[j])];
    if (n.kind != kir::Node::Kind::op) return;
    const int t = n.task;
    const std::vector<Param> ps = params(t);
    const std::string v = chain_local(k.tasks, t);
    statements += chain_task(k, stage.chain[j], ps, domain, v, value_of, param_of, unused, vector_load, "      ");
    for (const auto& x : ps)
      if (x.written && !contains(k.internal_buffers, x.bound->buffer))
        stored(p_.tasks[size_t(t)].task->id + "_" + x.bound->name, x, v);
  }
  if (!vectorizable) return;
  e.vector_width = width;
  e.vector_code = fmt::format(
      "  // The same on {0} consecutive elements from i (a multiple of {0}): one access per tensor.\n"
      "  auto cg_epilogue_vector = [&](cg_i64 i, const float* cg_values) {{\n"
      "{1}{2}"
      "    CG_UNROLL\n"
      "    for (int w = 0; w < {0}; ++w) {{\n"
      "      const float v0 = cg_values[w];\n"
      "{3}"
      "    }}\n"
      "{4}"
      "  }};\n",
      width, loads, locals, statements, stores);
}

// Rule permuted_store: where element i of gather task `t`'s input lands in
// its output, by the index map of the inverse op (kernels.h).
std::string Emitter::permuted_index(int t, const Param& x, const Param& out) {
  const OpSignature& inverse = *p_.registry.find(p_.tasks[size_t(t)].op->inverse);
  template_files_.insert(inverse.source_file);
  use_function(inverse, inverse.source_function);
  // split_heads and merge_heads: H, T, D from the [..., H, T, D] side, the one with more axes.
  const Shape& s = out.buffer->shape.size() > x.buffer->shape.size() ? out.buffer->shape : x.buffer->shape;
  const int64_t H = s[s.size() - 3], T = s[s.size() - 2], D = s.back();
  return fmt::format("{}(i, {}, {}, {})", inverse.source_function, T, H, D);
}

// Rule elementwise_chain (fuse.h): one grid-stride loop over the elements;
// each task's value is a local that the next tasks read, and only values
// read outside the kernel are stored. Vectorised like a single elementwise
// task where every tensor is read at the element's own index.
std::string Emitter::fused_elementwise(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
  EmittedKernel ek = emitted_kernel(k);
  auto internal = [&](int b) { return contains(k.internal_buffers, b); };
  struct Step {
    int node, task;
    std::vector<Param> ps;
    const Param* out = nullptr;
  };
  // The IR's one stage (kir.h): its chain, an op node per task.
  const std::vector<int>& chain = k.ir.stages.front().chain;
  std::vector<Step> steps;
  steps.reserve(chain.size());  // `out` points into each step's `ps`
  for (int node : chain) {
    const int t = k.ir.nodes[size_t(node)].task;
    const OpSignature& op = *p_.tasks[size_t(t)].op;
    steps.push_back(Step{node, t, params(t)});
    for (const auto& x : steps.back().ps)
      if (x.written) steps.back().out = &x;
    template_files_.insert(op.source_file);
    use_function(op, op.source_function);
  }
  if (!diags_.ok()) return {};
  const Shape& domain = steps.front().out->buffer->shape;
  const int64_t n = numel(domain);

  // Parameters: each buffer read from memory once (its first reader's
  // task_slot name), then each stored value.
  std::vector<LaunchParam> inputs, outputs;
  std::map<int, std::string> param_of, value_of;  // buffer -> parameter; node -> local
  std::vector<std::pair<const Param*, std::string>> loads;  // reads from memory, with their index
  bool flat = true;
  int64_t widest = 1;
  for (const auto& step : steps) {
    const OpSignature& op = *p_.tasks[size_t(step.task)].op;
    for (const auto& x : step.ps) {
      widest = std::max<int64_t>(widest, dtype_bytes(x.buffer->dtype));
      if (x.written || value_of.count(input_node(k.ir, step.node, x)) || param_of.count(x.bound->buffer)) continue;
      const std::string name = p_.tasks[size_t(step.task)].task->id + "_" + x.bound->name;
      param_of[x.bound->buffer] = name;
      inputs.push_back(LaunchParam{name, "const " + c_type(x.buffer->dtype), x.bound->buffer, nullptr});
      const bool same = reads_own_element(op, x, domain);
      flat = flat && same;
      loads.push_back({&x, same ? "i" : broadcast_index(domain, x.buffer->shape, "i")});
    }
    value_of[step.node] = fmt::format("v{}", &step - steps.data());
    if (!internal(step.out->bound->buffer)) {
      const std::string name = p_.tasks[size_t(step.task)].task->id + "_" + step.out->bound->name;
      param_of[step.out->bound->buffer] = name;
      outputs.push_back(LaunchParam{name, c_type(step.out->buffer->dtype), step.out->bound->buffer, nullptr, true});
    }
  }
  const int width = flat && n % (16 / widest) == 0 ? int(16 / widest) : 1;
  const std::string index = width > 1 ? "i + k" : "i";

  // One statement per task: its value, from loaded elements and earlier values.
  std::string statements;
  std::map<int, std::string> loaded;  // buffer -> the expression of its element
  for (const auto& [x, at] : loads) {
    const std::string& name = param_of[x->bound->buffer];
    const std::string element =
        width > 1 ? name + "_v.v[k]" : fmt::format("cg_load({}, {})", name, at);
    loaded[x->bound->buffer] = is_16bit(x->buffer->dtype) ? "cg_widen(" + element + ")" : element;
  }
  const std::string indent = width > 1 ? "      " : "    ";
  for (size_t j = 0; j < steps.size(); ++j) {
    const int t = steps[j].task;
    std::map<std::string, std::string> present;
    for (const auto& x : steps[j].ps)
      if (!x.written) {
        // An earlier task's value (the schedule puts producers first), else the element from memory.
        auto v = value_of.find(input_node(k.ir, steps[j].node, x));
        present[x.bound->name] = v != value_of.end() ? v->second : loaded[x.bound->buffer];
      }
    statements += chain_statement(t, *steps[j].out, input_operands(t, present, index), fmt::format("v{}", j), indent);
  }
  auto narrowed = [&](const Step& step, size_t j) {
    const DType d = step.out->buffer->dtype;
    return is_16bit(d) ? fmt::format("cg_narrow<{}>(v{})", c_type(d), j) : fmt::format("v{}", j);
  };

  std::string body;
  ek.block = 256;
  ek.grid[0] = grid_stride_blocks(n / width, ek.block);
  ek.grid_stride = true;
  if (width == 1) {
    body = fmt::format("  for (cg_i64 i = cg_global_thread(tile); i < {}; i += cg_grid_threads(tile)) {{\n{}", n, statements);
    for (size_t j = 0; j < steps.size(); ++j)
      if (!internal(steps[j].out->bound->buffer))
        body += fmt::format("    cg_store({}, i, {});\n", param_of[steps[j].out->bound->buffer], narrowed(steps[j], j));
    body += "  }\n";
  } else {
    body = fmt::format(
        "  for (cg_i64 i = cg_global_thread(tile) * {0}; i < {1}; i += cg_grid_threads(tile) * {0}) {{  // {0} elements at a "
        "time\n",
        width, n);
    for (const auto& [x, at] : loads)
      body += fmt::format("    const cg_vector<{0}, {1}> {2}_v = cg_load_vector<{0}>({2}, i);\n", width,
                          c_type(x->buffer->dtype), param_of[x->bound->buffer]);
    for (const auto& lp : outputs)
      body += fmt::format("    cg_vector<{}, {}> {}_v;\n", width, lp.pointee, lp.name);
    body += fmt::format("    for (int k = 0; k < {}; ++k) {{\n{}", width, statements);
    for (size_t j = 0; j < steps.size(); ++j)
      if (!internal(steps[j].out->bound->buffer))
        body += fmt::format("      {}_v.v[k] = {};\n", param_of[steps[j].out->bound->buffer], narrowed(steps[j], j));
    body += "    }\n";
    for (const auto& lp : outputs) body += fmt::format("    cg_store_vector<{0}>({1}, i, {1}_v);\n", width, lp.name);
    body += "  }\n";
  }

  std::vector<LaunchParam> launch = inputs;
  launch.insert(launch.end(), outputs.begin(), outputs.end());
  // Run-time arguments (the fusion pass lets only the first task have any:
  // their locals are named as the arguments), read once before the loop.
  std::string locals;
  for (const auto& step : steps) {
    for (const auto& sp : scalar_params(step.task))
      launch.push_back(LaunchParam{sp.name, "const " + scalar_type(sp.scalar->type), -1, sp.scalar});
    locals += scalar_locals(step.task);
  }
  body = locals + body;

  std::vector<std::string> tasks, reads, writes, in_registers;
  for (const auto& step : steps) {
    const BoundTask& bt = p_.tasks[size_t(step.task)];
    tasks.push_back(fmt::format("{} ({})", bt.task->id, bt.op->name));
  }
  for (const auto& lp : inputs) {
    const BufferInfo& b = p_.buffers[size_t(lp.buffer)];
    reads.push_back(fmt::format("{} {} {}", buffer_name(lp.buffer), to_string(b.dtype), shape_to_string(b.shape)));
    ek.bytes_read += b.bytes;
  }
  for (const auto& lp : outputs) {
    const BufferInfo& b = p_.buffers[size_t(lp.buffer)];
    writes.push_back(fmt::format("{} {} {}", buffer_name(lp.buffer), to_string(b.dtype), shape_to_string(b.shape)));
    ek.bytes_written += b.bytes;
  }
  for (int b : k.internal_buffers) in_registers.push_back(buffer_name(b));
  const std::string comment_text = fmt::format(
      "// Kernel {} ({} phase): tasks {}, fused ({}).\n//   reads  {}\n//   writes {}\n//   in registers {}\n"
      "//   {} bytes read, {} bytes written; grid [{}, {}, {}], block {}.\n",
      k.name, to_string(k.phase), fmt::join(tasks, ", "), to_string(k.rule), fmt::join(reads, ", "), fmt::join(writes, ", "),
      in_registers.empty() ? "-" : fmt::format("{}", fmt::join(in_registers, ", ")), ek.bytes_read, ek.bytes_written,
      ek.grid[0], ek.grid[1], ek.grid[2], ek.block);
  std::string code = kernel_functions(comment_text, ek, launch, body);
  record_launch(ek, std::move(launch));
  emitted.push_back(ek);
  return code;
}

// An op that updates slots in place (an optimizer): each element of every
// updated slot is loaded into a local, the function updates the locals
// through its reference parameters, and they are stored back. An optional
// updated slot the task leaves out gets a local that is dropped.
std::string Emitter::elementwise_in_place(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const BoundTask& bt = p_.tasks[size_t(t)];
  const OpSignature& op = *bt.op;
  std::string before, after, element_type;
  std::vector<std::string> operands;
  int64_t n = 0;
  for (const auto& sig : op.tensors) {
    const Param* x = nullptr;
    for (const auto& candidate : ps)
      if (candidate.bound->name == sig.name) x = &candidate;
    if (x == nullptr) {  // an absent optional slot: the parameter's dtype decides the local's
      const Param& param = ps.front();
      before += fmt::format("    {} {}_local = {};\n", compute_type(param.buffer->dtype), sig.name,
                            sig.absent == 0 ? "0" : float_literal(sig.absent));
      operands.push_back(sig.name + "_local");
      continue;
    }
    n = std::max(n, numel(x->buffer->shape));
    if (element_type.empty()) element_type = compute_type(x->buffer->dtype);
    if (!sig.writes) {  // a rank-0 input (a gradient's scale) is one value for every element
      operands.push_back(load(*x, x->buffer->shape.empty() ? "0" : "i"));
      continue;
    }
    before += fmt::format("    {} {}_local = {};\n", compute_type(x->buffer->dtype), sig.name, load(*x, "i"));
    after += fmt::format("    {};\n", store(*x, "i", sig.name + "_local"));
    operands.push_back(sig.name + "_local");
  }
  append_arguments(t, operands);
  ek.block = 256;
  ek.grid[0] = grid_stride_blocks(n, ek.block);
  ek.grid_stride = true;
  return fmt::format(
      "  for (cg_i64 i = cg_global_thread(tile); i < {}; i += cg_grid_threads(tile)) {{\n"
      "{}"
      "    {}<{}>({});\n"
      "{}"
      "  }}\n",
      n, before, op.source_function, element_type, fmt::join(operands, ", "), after);
}

std::string Emitter::elementwise(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const OpSignature& op = *p_.tasks[size_t(t)].op;
  for (const auto& sig : op.tensors)
    if (sig.writes && sig.role != SlotRole::output) return elementwise_in_place(t, ps, ek);
  const Param* out = nullptr;
  std::vector<std::string> operands;
  for (const auto& x : ps)
    if (x.written) out = &x;
  if (out == nullptr) {
    fail(t, "", "an elementwise kernel needs one output");
    return {};
  }
  int64_t n = numel(out->buffer->shape);
  if (int width = vector_width(op, ps, *out, n); width > 1) return elementwise_vectorised(t, ps, *out, n, width, ek);
  // 16-bit tensors are widened to f32 as they are loaded (load()) and narrowed as they are stored (apply()).
  std::map<std::string, std::string> present;
  for (const auto& x : ps)
    if (!x.written) {
      // An elementwise op (not a broadcast one) reads element i of an input of
      // the output's size whatever its shape (reshape).
      const bool flat = op.pattern == PatternKind::elementwise && numel(x.buffer->shape) == numel(out->buffer->shape);
      present[x.bound->name] = load(x, flat ? "i" : broadcast_index(out->buffer->shape, x.buffer->shape, "i"));
    }
  // An op with no input (fill, uniform) takes the element index first.
  operands = input_operands(t, present, "i");
  append_arguments(t, operands);
  return grid_stride_loop(n, fmt::format("cg_store({}, i, {})", out->bound->name, apply(op, *out, operands)), ek);
}

// The op's function on its operands, in the output's compute type, narrowed
// to a 16-bit output's storage type.
std::string Emitter::apply(const OpSignature& op, const Param& out, const std::vector<std::string>& operands) {
  std::string value =
      fmt::format("{}<{}>({})", op.source_function, compute_type(out.buffer->dtype), fmt::join(operands, ", "));
  return is_16bit(out.buffer->dtype) ? fmt::format("cg_narrow<{}>({})", c_type(out.buffer->dtype), value) : value;
}

// Whether a fused task reads input x at the element's own index i of the
// kernel's domain: an elementwise op reads element i of an input of the
// domain's size whatever its shape (reshape); a broadcast op only an input
// of the domain's shape.
bool Emitter::reads_own_element(const OpSignature& op, const Param& x, const Shape& domain) {
  return op.pattern == PatternKind::elementwise ? numel(x.buffer->shape) == numel(domain) : x.buffer->shape == domain;
}

// One fused task as a statement: its value, a local `value` in the compute
// type, from its operands (earlier values, loaded elements) and arguments.
std::string Emitter::chain_statement(int t, const Param& out, std::vector<std::string> operands, const std::string& value,
                                     const std::string& indent) {
  append_arguments(t, operands);
  const std::string type = compute_type(out.buffer->dtype);
  return fmt::format("{}const {} {} = {}<{}>({});  // {}\n", indent, type, value,
                     p_.tasks[size_t(t)].op->source_function, type, fmt::join(operands, ", "),
                     buffer_name(out.bound->buffer));
}

// Elements per vectorised access (16 bytes of the widest tensor), or 1
// when the kernel must stay scalar: an input read through a broadcast
// index map, or an element count the width does not divide.
int Emitter::vector_width(const OpSignature& op, const std::vector<Param>& ps, const Param& out, int64_t n) {
  int64_t widest = 1;
  for (const auto& x : ps) {
    if (!x.written && numel(x.buffer->shape) != n) return 1;
    if (!x.written && op.pattern == PatternKind::broadcast && x.buffer->shape != out.buffer->shape) return 1;
    widest = std::max<int64_t>(widest, dtype_bytes(x.buffer->dtype));
  }
  const int width = int(16 / widest);
  return n % width == 0 ? width : 1;
}

// Each thread loads `width` consecutive elements of every input with one
// access per tensor, applies the op to each, and stores them with one.
std::string Emitter::elementwise_vectorised(int t, const std::vector<Param>& ps, const Param& out, int64_t n, int width,
                                            EmittedKernel& ek) {
  const OpSignature& op = *p_.tasks[size_t(t)].op;
  std::string loads;
  std::map<std::string, std::string> present;
  for (const auto& x : ps)
    if (!x.written) {
      loads += fmt::format("    const cg_vector<{0}, {1}> {2}_v = cg_load_vector<{0}>({2}, i);\n", width,
                           c_type(x.buffer->dtype), x.bound->name);
      const std::string element = x.bound->name + "_v.v[k]";
      present[x.bound->name] = is_16bit(x.buffer->dtype) ? "cg_widen(" + element + ")" : element;
    }
  std::vector<std::string> operands = input_operands(t, present, "i + k");
  append_arguments(t, operands);
  ek.block = 256;
  ek.grid[0] = grid_stride_blocks(n / width, ek.block);
  ek.grid_stride = true;
  return fmt::format(
      "  for (cg_i64 i = cg_global_thread(tile) * {0}; i < {1}; i += cg_grid_threads(tile) * {0}) {{  // {0} elements at a time\n"
      "{2}"
      "    cg_vector<{0}, {3}> {4}_v;\n"
      "    for (int k = 0; k < {0}; ++k) {4}_v.v[k] = {5};\n"
      "    cg_store_vector<{0}>({4}, i, {4}_v);\n"
      "  }}\n",
      width, n, loads, c_type(out.buffer->dtype), out.bound->name, apply(op, out, operands));
}

}  // namespace cudagen::lowering
