#include "emitter.h"

namespace cudagen {

std::string phase_function(Phase phase, const std::string& prefix) { return prefix + "_" + to_string(phase); }

std::string symbol_prefix_problem(const std::string& prefix) {
  auto ident_char = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (c >= '0' && c <= '9'); };
  if (prefix.empty()) return "it is empty";
  if (prefix[0] >= '0' && prefix[0] <= '9') return "it starts with a digit";
  for (char c : prefix)
    if (!ident_char(c)) return fmt::format("'{}' cannot be part of a C identifier", c);
  return {};
}

std::string comment_text(std::string_view text) {
  // Inside a `//` comment a newline (or a carriage return, or a backslash
  // before either) would end the comment and let the rest of the text be
  // compiled: a graph's name must never become code. Everything but
  // printable ASCII, and the backslash itself, is written as \xNN.
  std::string out;
  for (unsigned char c : text) {
    if (c >= 0x20 && c < 0x7f && c != '\\')
      out += char(c);
    else
      out += fmt::format("\\x{:02x}", c);
  }
  return out;
}

namespace lowering {

// The skeletons of reduction, gather and opaque ops, by op name (nullptr:
// none yet). Elementwise, broadcast and matmul ops share their pattern's.
Emitter::Skeleton Emitter::named_skeleton(std::string_view op) {
  static const std::map<std::string_view, Skeleton> skeletons = {
      {"softmax", &Emitter::softmax},
      {"log_softmax", &Emitter::log_softmax},
      {"sum", &Emitter::row_reduce},
      {"mean", &Emitter::row_reduce},
      {"max", &Emitter::row_reduce},
      {"sum_leading", &Emitter::sum_leading},
      {"sum_backward", &Emitter::row_gradient},
      {"mean_backward", &Emitter::row_gradient},
      {"max_backward", &Emitter::max_backward},
      {"rmsnorm", &Emitter::rmsnorm},
      {"layernorm", &Emitter::layernorm},
      {"cross_entropy", &Emitter::cross_entropy},
      {"cross_entropy_backward", &Emitter::cross_entropy_backward},
      {"softmax_backward", &Emitter::softmax_backward},
      {"log_softmax_backward", &Emitter::softmax_backward},
      {"rmsnorm_backward", &Emitter::norm_backward},
      {"layernorm_backward", &Emitter::norm_backward},
      {"embedding_backward", &Emitter::embedding_backward},
      {"mse", &Emitter::mse},
      {"embedding", &Emitter::embedding},
      {"split_heads", &Emitter::heads},
      {"merge_heads", &Emitter::heads},
      {"concat", &Emitter::concat_split},
      {"split", &Emitter::concat_split},
      {"transpose", &Emitter::transpose},
      {"conv2d", &Emitter::conv2d},
      {"max_pool2d", &Emitter::pool2d},
      {"avg_pool2d", &Emitter::pool2d},
      {"adaptive_avg_pool2d", &Emitter::adaptive_avg_pool2d},
      {"max_pool2d_nhwc", &Emitter::pool2d_nhwc},
      {"avg_pool2d_nhwc", &Emitter::pool2d_nhwc},
      {"adaptive_avg_pool2d_nhwc", &Emitter::pool2d_nhwc},
      {"conv2d_backward", &Emitter::conv2d_backward},
      {"max_pool2d_backward", &Emitter::pool2d_backward},
      {"avg_pool2d_backward", &Emitter::pool2d_backward},
      {"adaptive_avg_pool2d_backward", &Emitter::adaptive_avg_pool2d_backward},
      {"max_pool2d_nhwc_backward", &Emitter::pool2d_nhwc_backward},
      {"avg_pool2d_nhwc_backward", &Emitter::pool2d_nhwc_backward},
      {"adaptive_avg_pool2d_nhwc_backward", &Emitter::pool2d_nhwc_backward},
      {"batchnorm2d", &Emitter::batchnorm2d},
      {"batchnorm2d_backward", &Emitter::batchnorm2d_backward},
      {"permute", &Emitter::permute},
      {"slice", &Emitter::slice},
      {"slice_backward", &Emitter::slice},
  };
  auto it = skeletons.find(op);
  return it == skeletons.end() ? nullptr : it->second;
}

EmittedProgram Emitter::run(const std::vector<KernelGroup>& kernels) {
  EmittedProgram out;
  std::string kernel_code;
  plan_flash_statistics(kernels);
  if (!options_.megakernel) plan_split_k_workspace(kernels);
  for (const auto& k : kernels) {
    // A kernel launched alone gets its __global__ right after its tile
    // function; one that shares a launch is called from the launch's.
    global_wrapper_ = !options_.megakernel && alone_in_launch(kernels, size_t(&k - kernels.data()));
    kernel_code += kernel(k, out.tile_kernels);
  }
  if (!diags_.ok()) throw CompileError(std::move(diags_));
  for (EmittedKernel& ek : out.tile_kernels)
    for (int t : ek.tasks)
      if (std::optional<int64_t> flops = task_flops(p_, t)) ek.flops = std::max<int64_t>(ek.flops, 0) + *flops;
  arena_bytes_ = out.arena_bytes = std::max(plan_.arena_bytes, flash_statistics_end_);
  if (split_k_.arrivals_bytes > 0 || split_k_.dq_arrivals_bytes > 0) {  // zeroed as the megakernel's counters are (never both)
    out.sync_offset = split_k_.arrivals_offset;
    out.sync_bytes = align_up(split_k_.end() - split_k_.arrivals_offset, plan_.alignment);
    arena_bytes_ = out.arena_bytes = out.sync_offset + out.sync_bytes;
  }
  kernel_code += options_.megakernel ? megakernels(out) : launches(kernels, out);
  out.cuda_source = header() + prelude_and_templates() + kernel_code + host_side(out);
  out.manifest_json = manifest(out);
  out.host_header = host_header(out);
  return out;
}

// The end of every skeleton: the kernel's functions under its comment, its
// launch parameters recorded, and its EmittedKernel added.
std::string Emitter::finish_kernel(const KernelGroup& k, EmittedKernel& ek, std::vector<LaunchParam> launch,
                                   const std::string& body, std::vector<EmittedKernel>& emitted) {
  std::string code = kernel_functions(comment(k, launch, ek), ek, launch, body);
  record_launch(ek, std::move(launch));
  emitted.push_back(ek);
  return code;
}

// A kernel, by the mainloop its IR is built on (kir.h): the fused
// mainloops have skeletons of their own; one task's, with its prologue
// and epilogue, is its op's.
std::string Emitter::kernel(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
  switch (k.ir.mainloop) {
    case kir::Mainloop::elements: return k.tasks.size() > 1 ? fused_elementwise(k, emitted) : emit_kernel(k, emitted);
    case kir::Mainloop::attention: return attention(k, emitted);
    case kir::Mainloop::attention_backward: return attention_backward(k, emitted);
    case kir::Mainloop::gemm_sum: return matmul_sum(k, emitted);
    case kir::Mainloop::gemm_chain: return matmul_chain(k, emitted);
    case kir::Mainloop::gemm_row_reduction: return row_reduction(k, emitted);
    case kir::Mainloop::gemm:
    case kir::Mainloop::reduction:
    case kir::Mainloop::gather:
    case kir::Mainloop::opaque: return emit_kernel(k, emitted);
  }
  return emit_kernel(k, emitted);
}

void Emitter::fail(int task, const std::string& slot, const std::string& message, const std::string& hint) {
  diags_.add(Diagnostic{{}, {}, fmt::format("/tasks/{}", task), p_.tasks[size_t(task)].task->id, slot, message, hint});
}

// A fused kernel's shared memory, laid out by kernels.h as the fusion
// pass bounded it: the kernel's first regions.
void Emitter::use_shared(EmittedKernel& ek, const SharedLayout& layout) {
  ek.smem_regions = layout.regions;
  ek.smem_bytes = layout.end();
}

std::string Emitter::c_type(DType d) {
  switch (d) {
    case DType::f32: return "float";
    case DType::f64: return "double";
    case DType::i32: return "int";
    case DType::i64: return "long long";
    case DType::f16: return "cg_f16";
    case DType::bf16: return "cg_bf16";
  }
  return "";
}

// A kernel's parameter for slot `x`'s buffer, named `name`: `T*` where the
// kernel writes it, `const T*` where it only reads it.
LaunchParam Emitter::buffer_param(const std::string& name, const Param& x, bool written) {
  return LaunchParam{name, std::string(written ? "" : "const ") + c_type(x.buffer->dtype), x.bound->buffer, nullptr,
                     written};
}

// The task's tensors in signature order, each a kernel parameter.
std::vector<Param> Emitter::params(int t) {
  std::vector<Param> out;
  const BoundTask& bt = p_.tasks[size_t(t)];
  for (const auto& sig : bt.op->tensors) {
    const BoundTensor* b = bt.find_tensor(sig.name);
    if (b == nullptr) continue;
    const BufferInfo& buf = p_.buffers[size_t(b->buffer)];
    if (c_type(buf.dtype).empty())
      fail(t, sig.name, fmt::format("dtype {} is not supported by the emitter yet (f32, f64, i32, i64 are)", to_string(buf.dtype)));
    bool written = sig.written();
    out.push_back(Param{b, &buf, written});
  }
  return out;
}

// A slot's parameter; nullptr for an optional slot the task leaves out.
const Param* Emitter::find_param(const std::vector<Param>& ps, const std::string& name) {
  for (const auto& x : ps)
    if (x.bound->name == name) return &x;
  return nullptr;
}

const Param& Emitter::param(const std::vector<Param>& ps, const std::string& name) {
  if (const Param* x = find_param(ps, name)) return *x;
  throw std::logic_error("emitter: no slot " + name);
}

// A constant argument's value. One that lives in the scalars region would
// change the kernel's code, not a value in it (a transpose flag, causal).
const BoundArg* Emitter::constant_arg(int t, const std::string& name) {
  if (plan_.scalar_of(p_, t, name) != nullptr)
    fail(t, name, fmt::format("argument '{}' of op '{}' decides the kernel's code, so it cannot change at run time",
                              name, p_.tasks[size_t(t)].op->name),
         "give it a constant value (drop \"runtime\" and any \"from\")");
  return arg(t, name);
}

int64_t Emitter::arg_int(int t, const std::string& name, int64_t fallback) {
  const BoundArg* a = constant_arg(t, name);
  if (a == nullptr) return fallback;
  if (auto* i = std::get_if<int64_t>(&a->value)) return *i;
  return fallback;
}

// A float argument as an expression: a literal, or the kernel's local copy
// of the scalar it reads at run time.
std::string Emitter::float_arg(int t, const std::string& name, double fallback) {
  if (plan_.scalar_of(p_, t, name) != nullptr) return name;
  return float_literal(arg_double(t, name, fallback));
}

std::vector<Emitter::ScalarParam> Emitter::scalar_params(int t) const {
  std::vector<ScalarParam> out;
  for (const auto& sig : p_.tasks[size_t(t)].op->args)
    if (const PlannedScalar* s = plan_.scalar_of(p_, t, sig.name)) out.push_back({sig.name, s});
  return out;
}

std::string Emitter::scalar_locals(int t) const {
  std::string out;
  for (const auto& sp : scalar_params(t)) {
    const std::string value = fmt::format("cg_load({}_arg, 0)", sp.name);
    out += fmt::format("  const {} {} = {};  // run-time argument {}\n",
                       sp.scalar->type == ArgType::bool_ ? "bool" : scalar_type(sp.scalar->type), sp.name,
                       sp.scalar->type == ArgType::bool_ ? value + " != 0" : value, sp.scalar->name(p_));
  }
  return out;
}

// A parameter's name in the kernel's code: a run-time argument's pointer
// is NAME_arg, NAME being the local it is read into.
std::string Emitter::param_name(const LaunchParam& lp) { return lp.scalar != nullptr ? lp.name + "_arg" : lp.name; }

// The comment above a kernel: its tasks (and the rule that fused them),
// each buffer it reads and writes with its bytes, its launch shape.
std::string Emitter::comment(const KernelGroup& k, const std::vector<LaunchParam>& launch, EmittedKernel& ek) {
  const BoundTask& bt = p_.tasks[size_t(k.tasks[0])];
  // The skeletons pick their variants (staged or not, rows per block) to
  // fit; a plan over the limit is the emitter's bug, not the graph's.
  // Above 48 KiB the launchers opt in (the mainloops and flash attention ask so much).
  if (ek.smem_bytes > shared_bytes_with_opt_in(options_.arch))
    fail(k.tasks[0], "",
         fmt::format("kernel {} would need {} bytes of shared memory, more than the {} {} lets a kernel opt in to",
                     k.name, ek.smem_bytes, shared_bytes_with_opt_in(options_.arch), options_.arch),
         "an internal error of cudagen's emitter: please report it with the graph; --no-fuse avoids the fused kernel");
  const bool fused = k.tasks.size() > 1 || !k.prologue.empty();
  std::vector<std::string> reads, writes, in_registers, workspaces;
  std::set<std::pair<int, bool>> counted;  // a buffer two parameters read (or write) moves once, as the model has it
  for (const auto& lp : launch) {
    if (lp.scalar != nullptr) continue;
    if (lp.buffer < 0) {  // a workspace: written once, read once
      workspaces.push_back(fmt::format("{} ({} bytes at arena + {})", lp.name, lp.workspace_bytes, lp.workspace_offset));
      const int64_t moved = lp.workspace_traffic >= 0 ? lp.workspace_traffic : lp.workspace_bytes;
      ek.bytes_read += moved;
      ek.bytes_written += moved;
      continue;
    }
    if (fused && !counted.insert({lp.buffer, lp.written}).second) continue;
    const BufferInfo& b = p_.buffers[size_t(lp.buffer)];
    // One task's kernel: its slot, then the buffer behind it when another task's. A fused one: the buffer.
    std::string desc = fused ? buffer_name(lp.buffer) : bt.task->id + "." + lp.name;
    desc += fmt::format(" {} {}", to_string(b.dtype), shape_to_string(b.shape));
    if (!fused && b.owner_task != k.tasks[0]) desc += " <- " + buffer_name(lp.buffer);
    if (lp.tensor_map) desc += " (by TMA)";
    (lp.written ? writes : reads).push_back(desc);
    (lp.written ? ek.bytes_written : ek.bytes_read) += b.bytes;
    // A slot updated in place (an optimizer's weight and state) is read first.
    const BoundTensor* slot = fused ? nullptr : bt.find_tensor(lp.name);
    if (lp.written && slot != nullptr && slot->sig->writes && slot->sig->role != SlotRole::output) {
      reads.push_back(desc);
      ek.bytes_read += b.bytes;
    }
  }
  for (int b : k.internal_buffers) in_registers.push_back(buffer_name(b));
  std::string tasks = fmt::format("task {} ({}, {})", bt.task->id, bt.op->name, to_string(bt.op->pattern));
  if (fused) {
    std::vector<std::string> all;
    for (int t : k.prologue)
      all.push_back(fmt::format("{} ({}, prologue{})", p_.tasks[size_t(t)].task->id, p_.tasks[size_t(t)].op->name,
                                norm_prologue(p_, k) && stores_norm(p_, k, t) ? ", stored here" : ""));
    for (int t : k.tasks) all.push_back(fmt::format("{} ({})", p_.tasks[size_t(t)].task->id, p_.tasks[size_t(t)].op->name));
    tasks = fmt::format("tasks {}, fused ({})", fmt::join(all, ", "), fmt::join(kernel_rules(p_, k), ", "));
  }
  std::vector<std::string> regions;
  for (const SharedRegion& r : ek.smem_regions)
    regions.push_back(fmt::format("[{}, {}) {}", r.offset, r.offset + r.bytes, r.what));
  return fmt::format(
      "// Kernel {} ({} phase): {}.\n//   reads  {}\n//   writes {}\n{}//   {} bytes read, {} bytes "
      "written; {}, block {}, {} bytes of shared memory{}\n",
      k.name, to_string(k.phase), tasks, reads.empty() ? "-" : fmt::format("{}", fmt::join(reads, ", ")),
      writes.empty() ? "-" : fmt::format("{}", fmt::join(writes, ", ")),
      (in_registers.empty() ? "" : fmt::format("//   in registers {}\n", fmt::join(in_registers, ", "))) +
          (workspaces.empty() ? "" : fmt::format("//   workspace {}\n", fmt::join(workspaces, ", "))),
      ek.bytes_read, ek.bytes_written,
      ek.persistent_tiles > 0
          ? fmt::format("persistent: {} blocks on {} at {} SMs ({} an SM) loop over {} tiles", ek.grid[0],
                        options_.arch, device_model(options_.target()).sms, ek.min_blocks_per_sm, ek.persistent_tiles)
          : fmt::format("grid [{}, {}, {}]", ek.grid[0], ek.grid[1], ek.grid[2]),
      ek.block, ek.smem_bytes,
      regions.empty() ? "." : fmt::format(":\n//     {}", fmt::join(regions, "\n//     "))) +
         (ek.matmul_path.empty() ? "" : fmt::format("//   matmul on {}.\n", ek.matmul_path));
}

// The skeleton of the ops that compute each element on its own: a
// grid-stride loop of 256-thread blocks over n elements, `statement` on
// element i.
std::string Emitter::grid_stride_loop(int64_t n, const std::string& statement, EmittedKernel& ek) {
  ek.block = 256;
  ek.grid[0] = grid_stride_blocks(n, ek.block);
  ek.grid_stride = true;
  return fmt::format(
      "  for (cg_i64 i = cg_global_thread(tile); i < {}; i += cg_grid_threads(tile))\n"
      "    {};\n",
      n, statement);
}

// Fails naming the first of `args` below 1 (a stride, a kernel size).
bool Emitter::args_at_least_one(int t, std::initializer_list<const char*> args) {
  for (const char* a : args)
    if (const int64_t v = arg_int(t, a, 1); v < 1) {
      fail(t, a, fmt::format("{} is {}; it must be at least 1", a, v));
      return false;
    }
  return true;
}

// A kernel group's entry, before its skeleton sets the launch shape.
EmittedKernel Emitter::emitted_kernel(const KernelGroup& k) {
  EmittedKernel ek;
  ek.name = k.name;
  ek.phase = k.phase;
  ek.tasks = kernel_tasks(k);
  return ek;
}

std::string Emitter::emit_kernel(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
  const int t = k.tasks[0];
  const BoundTask& bt = p_.tasks[size_t(t)];
  const OpSignature& op = *bt.op;
  if (op.source_file.empty()) {
    fail(t, "", fmt::format("op '{}' has no template yet, so no kernel can be generated for it", op.name),
         "`cudagen ops` marks the ops that have templates");
    return {};
  }
  if (std::string gap = emitter_gap(op); !gap.empty()) {
    fail(t, "", gap, "`cudagen ops` lists the ops the emitter generates today");
    return {};
  }
  std::vector<Param> ps = params(t);
  if (!diags_.ok()) return {};
  template_files_.insert(op.source_file);
  entry_function_ = op.source_function;  // a skeleton may pick one of the op's variants instead
  EmittedKernel ek = emitted_kernel(k);
  Epilogue tail;
  if (k.tasks.size() > 1) {
    const Param& anchor = param(ps, op.epilogue);
    tail = epilogue(k, anchor);
    if (!diags_.ok()) return {};
    epilogue_buffer_ = anchor.bound->buffer;
    epilogue_vector_width_ = tail.vector_width;
  }
  std::vector<LaunchParam> prologue_params;
  if (!k.prologue.empty()) prologue_params = prologue(k);
  // The operand a prologue computes: never read from memory (a kernel that
  // stores a norm's output takes it as the prologue's output). For an
  // elementwise prologue, load() calls cg_prologue instead.
  const int computed = k.prologue.empty() ? -1 : bt.find_tensor(k.prologue_operand)->buffer;
  if (!operand_prologue_.empty()) prologue_buffer_ = computed;
  // emitter_gap() has checked that a reduction, gather or opaque op has its named skeleton.
  std::string pre_code;
  std::string body = op.pattern == PatternKind::elementwise || op.pattern == PatternKind::broadcast
                         ? elementwise(t, ps, ek)
                     : op.pattern == PatternKind::matmul ? matmul(t, k.gemm, ps, ek)
                     // (an implicit GEMM: like a matmul, on the mainloop the fusion pass gave its kernel)
                     : is_op(op, BundledOp::conv2d_nhwc) ? conv2d_nhwc(t, k.gemm, ps, ek)
                     : is_op(op, BundledOp::conv2d_nhwc_backward_data) ? conv2d_nhwc_backward_data(t, k.gemm, ps, ek)
                     : is_op(op, BundledOp::conv2d_nhwc_backward_weight) ? conv2d_nhwc_backward_weight(t, k.gemm, ps, ek)
                     // (a channels-last BatchNorm may launch a statistics kernel first: pre_code)
                     : is_op(op, BundledOp::batchnorm2d_nhwc) ? batchnorm2d_nhwc(k, t, ps, ek, emitted.size(), pre_code)
                     : is_op(op, BundledOp::batchnorm2d_nhwc_backward)
                         ? batchnorm2d_nhwc_backward(k, t, ps, ek, emitted.size(), pre_code)
                                                         : (this->*named_skeleton(op.skeleton_name()))(t, ps, ek);
  epilogue_buffer_ = -1;
  epilogue_vector_width_ = 0;
  if (std::exchange(vector_epilogue_used_, false))
    tail.code.clear();  // the skeleton calls the vector form only
  else
    tail.vector_code.clear();
  prologue_task_ = -1;
  prologue_stores_ = false;
  prologue_buffer_ = -1;
  const std::string operand_prologue = std::exchange(operand_prologue_, {});
  if (!diags_.ok()) return {};
  use_function(op, entry_function_);
  std::vector<LaunchParam> launch;
  // (Operands read by TMA come as tensor maps, among extra_params_.)
  for (const auto& x : ps)
    if (!contains(k.internal_buffers, x.bound->buffer) && x.bound->buffer != computed &&  // kept in registers
        std::none_of(extra_params_.begin(), extra_params_.end(),
                     [&](const LaunchParam& lp) { return lp.tensor_map && lp.name == x.bound->name + "_map"; }))
      launch.push_back(buffer_param(x.bound->name, x));
  launch.insert(launch.end(), prologue_params.begin(), prologue_params.end());
  launch.insert(launch.end(), tail.params.begin(), tail.params.end());
  for (const auto& sp : scalar_params(t))
    launch.push_back(LaunchParam{sp.name, "const " + scalar_type(sp.scalar->type), -1, sp.scalar});
  for (LaunchParam& w : std::exchange(extra_params_, {})) launch.push_back(std::move(w));
  std::string code =
      pre_code + kernel_functions(comment(k, launch, ek), ek, launch,
                                  scalar_locals(t) + operand_prologue + tail.code + tail.vector_code + body);
  record_launch(ek, std::move(launch));
  // (Only what an `a` prologue reads follows a's rows.)
  mark_rows(t, ps, k.prologue_operand == "a" ? prologue_params : std::vector<LaunchParam>{}, tail.params,
            launch_params_.back(), ek);
  emitted.push_back(ek);
  return code;
}

void Emitter::record_launch(EmittedKernel& ek, std::vector<LaunchParam> launch) {
  locate_params(ek, launch);
  launch_params_.push_back(std::move(launch));
}

// A kernel's parameters' places in the arena (EmittedKernel::arg_offsets, ranges).
void Emitter::locate_params(EmittedKernel& ek, const std::vector<LaunchParam>& launch) {
  if (launch_grid(ek)[0] > kMaxGridX)
    fail(ek.tasks[0], "",
         fmt::format("kernel {} has {} x {} x {} tiles, more than the {} blocks a launch can have", ek.name,
                     ek.grid[0], ek.grid[1], ek.grid[2], kMaxGridX),
         "split the task into several (fewer batches or rows each)");
  for (const auto& lp : launch) {
    const auto [offset, bytes] = arena_range(lp);
    if (lp.tensor_map) ek.tensor_maps.emplace_back(int(ek.arg_offsets.size()), *lp.tensor_map);
    ek.arg_offsets.push_back(offset);
    ek.ranges.push_back(ArenaRange{offset, bytes, lp.written});
  }
}

// Puts a function of the op (its entry function or a variant) and what it
// calls into the generated file.
void Emitter::use_function(const OpSignature& op, const std::string& function) {
  if (const auto* closure = op.closure_of(function)) needed_.insert(closure->begin(), closure->end());
}

std::vector<std::string> Emitter::input_operands(int t, const std::map<std::string, std::string>& present,
                                                 const std::string& index) const {
  std::vector<std::string> operands;
  bool any_input = false;
  for (const auto& sig : p_.tasks[size_t(t)].op->tensors) {
    if (sig.written() || sig.role == SlotRole::scratch) continue;
    any_input = true;
    if (auto it = present.find(sig.name); it != present.end())
      operands.push_back(it->second);
    else
      operands.push_back(sig.absent == 0 ? "0.0f" : float_literal(sig.absent));
  }
  if (!any_input) operands.push_back(index);
  return operands;
}

// The op's arguments after its operands; a string argument as the index of its choice.
void Emitter::append_arguments(int t, std::vector<std::string>& operands) {
  const OpSignature& op = *p_.tasks[size_t(t)].op;
  for (const auto& sig : op.args) {
    if (plan_.scalar_of(p_, t, sig.name) != nullptr) {  // read at run time (validation allows scalars only)
      operands.push_back(sig.name);
      continue;
    }
    const BoundArg* a = arg(t, sig.name);
    if (sig.type == ArgType::string_) {
      std::string value = a != nullptr ? std::get<std::string>(a->value)
                          : sig.default_value ? std::get<std::string>(*sig.default_value)
                                              : std::string();
      auto choice = std::find(sig.choices.begin(), sig.choices.end(), value);
      operands.push_back(fmt::format("/*{}={}*/ {}", sig.name, value, choice - sig.choices.begin()));
    } else if (sig.type == ArgType::int_) {
      operands.push_back(fmt::format("{}ll", a ? std::get<int64_t>(a->value) : 0));
    } else if (sig.type == ArgType::bool_) {
      operands.push_back(arg_bool(t, sig.name) ? "true" : "false");
    } else {
      operands.push_back(float_literal(arg_double(t, sig.name, 0.0)));
    }
  }
}

// The reduction and matmul templates accumulate in f32: f32, f16 and bf16
// tensors (f64 would silently lose precision).
bool Emitter::check_f32_accumulation(int t, const Param& x) {
  if (x.buffer->dtype == DType::f32 || is_16bit(x.buffer->dtype)) return true;
  fail(t, x.bound->name,
       fmt::format("the {} template accumulates in f32, so a {} tensor would lose precision (f32, f16 and bf16 are "
                   "supported)",
                   p_.tasks[size_t(t)].op->name, to_string(x.buffer->dtype)));
  return false;
}

// What a hook reads (16-bit widened to f32) and how it stores an f32 value.
// A load of the operand an elementwise prologue computes calls it instead.
std::string Emitter::load(const Param& x, const std::string& index) const { return load_as(x, x.bound->name, index); }

// The same, through a parameter named `name`.
std::string Emitter::load_as(const Param& x, const std::string& name, const std::string& index) const {
  if (x.bound->buffer == prologue_buffer_) return fmt::format("cg_prologue({})", index);
  return load_element(name, x.buffer->dtype, index);
}

// A store of the buffer an epilogue follows becomes a call of the epilogue.
std::string Emitter::store(const Param& x, const std::string& index, const std::string& value) const {
  if (x.bound->buffer == epilogue_buffer_) return fmt::format("cg_epilogue({}, {})", index, value);
  return store_element(x.bound->name, x.buffer->dtype, index, value);
}

std::string Emitter::store_vector_code(const Param& x, int width, const std::string& index, const std::string& values) {
  const DType dtype = x.buffer->dtype;
  return fmt::format(
      "cg_vector<{0}, {1}> cg_out;\n"
      "        CG_UNROLL\n"
      "        for (int w = 0; w < {0}; ++w) cg_out.v[w] = {2};\n"
      "        cg_store_vector<{0}>({3}, {4}, cg_out);",
      width, c_type(dtype), narrow_to(dtype, values + "[w]"), x.bound->name, index);
}

std::string Emitter::store_element(const std::string& name, DType dtype, const std::string& index,
                                   const std::string& value) {
  return fmt::format("cg_store({}, {}, {})", name, index, narrow_to(dtype, value));
}

}  // namespace lowering

using lowering::Emitter;

std::string emitter_gap(const OpSignature& op) {
  if (op.pattern == PatternKind::elementwise || op.pattern == PatternKind::broadcast ||
      op.pattern == PatternKind::matmul || is_convolution_gemm(op) || is_op(op, BundledOp::batchnorm2d_nhwc) ||
      is_op(op, BundledOp::batchnorm2d_nhwc_backward) ||
      Emitter::named_skeleton(op.skeleton_name()) != nullptr) {
    // Another op's skeleton runs this op only where it calls the op's own
    // function; the others call the bundled template's by name.
    static const std::set<std::string> kCallsTheOpsFunction = {"rmsnorm"};
    if (!op.skeleton.empty() && !kCallsTheOpsFunction.count(op.skeleton))
      return fmt::format("op '{}' names skeleton '{}', which calls its own op's function rather than '{}' (skeletons "
                         "that call the op's: {})",
                         op.name, op.skeleton, op.source_function, fmt::join(kCallsTheOpsFunction, ", "));
    return {};
  }
  if (!op.skeleton.empty())
    return fmt::format("op '{}' names skeleton '{}', which the emitter does not have (the bundled reduction, gather and "
                       "opaque ops' names are its skeletons)",
                       op.name, op.skeleton);
  if (op.pattern == PatternKind::opaque) return fmt::format("the emitter has no skeleton for opaque op '{}' yet", op.name);
  return fmt::format("the emitter has no {} skeleton for op '{}' yet (its template is {})", to_string(op.pattern),
                     op.name, op.source_function);
}

std::string template_definitions(const OpRegistry& registry, const std::set<std::string>& ids) {
  std::string out;
  for (const auto& d : registry.definitions())
    if (ids.count(d.id)) out += fmt::format("\n// templates/{}:{}\n{}", d.file, d.line, d.text);
  return out;
}

EmittedProgram emit(const Program& program, const std::vector<KernelGroup>& kernels, const Plan& plan,
                    const EmitOptions& options) {
  return Emitter(program, plan, options).run(kernels);
}

}  // namespace cudagen
