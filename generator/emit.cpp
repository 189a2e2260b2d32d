#include "emit.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <functional>
#include <map>
#include <set>

#include <fmt/format.h>

#include "cost.h"
#include "diagnostics.h"
#include "graph_json.h"
#include "hash.h"
#include "perf_model.h"
#include "templates_embedded.h"
#include "version.h"

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

namespace {

std::string float_literal(double v) { return json_format_double(double(float(v))) + "f"; }

// The flat index into `in` (right-aligned, numpy broadcasting) of element
// `var` of a tensor shaped `out`, as a C expression.
std::string broadcast_index(const Shape& out, const Shape& in, const std::string& var) {
  if (in == out) return var;
  if (numel(in) == 1) return "0";
  size_t offset = out.size() - in.size();
  bool suffix = true;
  for (size_t d = 0; d < in.size(); ++d) suffix = suffix && in[d] == out[offset + d];
  if (suffix) return fmt::format("({} % {})", var, numel(in));
  std::vector<std::string> terms;
  int64_t out_stride = 1, in_stride = 1;
  for (size_t d = out.size(); d-- > 0;) {
    int64_t in_dim = d >= offset ? in[d - offset] : 1;
    if (in_dim != 1) terms.push_back(fmt::format("({} / {} % {}) * {}", var, out_stride, out[d], in_stride));
    out_stride *= out[d];
    in_stride *= in_dim;
  }
  return terms.empty() ? "0" : "(" + fmt::format("{}", fmt::join(terms, " + ")) + ")";
}

struct Param {
  const BoundTensor* bound;
  const BufferInfo* buffer;
  bool written;
};

// One parameter of a generated kernel, as its host launcher passes it:
// arena + the offset of a buffer or of a run-time argument.
struct LaunchParam {
  std::string name;
  std::string pointee;  // "const float", "float", ...
  int buffer = -1;      // or -1 for a run-time argument or a workspace
  const PlannedScalar* scalar = nullptr;
  bool written = false;
  // A workspace: arena bytes after the plan that the emitter owns (split-K's
  // partial sums and arrival counters), where buffer and scalar are unset.
  int64_t workspace_offset = -1, workspace_bytes = 0;
};

// The number of keys query row `row` (over all heads, Tq rows a head) sees,
// as kernel code: all Tk, or causal (top-left aligned) those up to its own.
std::string visible_keys(bool causal, int64_t Tq, int64_t Tk) {
  return causal ? fmt::format("(int)(row % {0} + 1 < {1} ? row % {0} + 1 : {1})", Tq, Tk) : std::to_string(Tk);
}

// The floats of a shared-memory region at byte `offset`, as kernel code.
std::string shared_floats(int64_t offset) {
  return offset == 0 ? "(float*)cg_smem" : fmt::format("(float*)(cg_smem + {})", offset);
}

int64_t next_shared_offset(const EmittedKernel& ek) { return shared_region_bytes(ek.smem_bytes); }

// Reserves `bytes` of kernel `ek`'s shared memory for `what`, after every
// region reserved before (16-byte aligned, as vector loads and the
// tensor-core tiles need): returns its offset.
int64_t reserve_shared(EmittedKernel& ek, std::string what, int64_t bytes) {
  const int64_t offset = next_shared_offset(ek);
  ek.smem_regions.push_back(SharedRegion{std::move(what), offset, bytes});
  ek.smem_bytes = offset + bytes;
  return offset;
}

// Flash attention trained: where one attention's saved statistics lie in the
// arena, after the plan (Emitter::plan_flash_statistics): each row's
// log-sum-exp and output, saved by the forward kernel; and the backward
// pass's rows' statistics (cg_flash_backward_rows), a pair of floats a row,
// flash_backward_statistics_rows(Tq) rows a head.
struct FlashStatistics {
  int64_t lse_offset = 0, lse_bytes = 0, o_offset = 0, o_bytes = 0;
  int64_t rows_offset = 0, rows_bytes = 0;
};

class Emitter {
 public:
  Emitter(const Program& p, const Plan& plan, const EmitOptions& options) : p_(p), plan_(plan), options_(options) {}

  using Skeleton = std::string (Emitter::*)(int, const std::vector<Param>&, EmittedKernel&);

  // The skeletons of reduction, gather and opaque ops, by op name (nullptr:
  // none yet). Elementwise, broadcast and matmul ops share their pattern's.
  static Skeleton named_skeleton(std::string_view op) {
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
        {"permute", &Emitter::permute},
        {"slice", &Emitter::slice},
        {"slice_backward", &Emitter::slice},
    };
    auto it = skeletons.find(op);
    return it == skeletons.end() ? nullptr : it->second;
  }

  EmittedProgram run(const std::vector<KernelGroup>& kernels) {
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

 private:
  std::string step_function() const { return options_.symbol_prefix + "_step"; }

  // The end of every skeleton: the kernel's functions under its comment, its
  // launch parameters recorded, and its EmittedKernel added.
  std::string finish_kernel(const KernelGroup& k, EmittedKernel& ek, std::vector<LaunchParam> launch,
                            const std::string& body, std::vector<EmittedKernel>& emitted) {
    std::string code = kernel_functions(comment(k, launch, ek), ek, launch, body);
    record_launch(ek, std::move(launch));
    emitted.push_back(ek);
    return code;
  }

  // A kernel, by the mainloop its IR is built on (kir.h): the fused
  // mainloops have skeletons of their own; one task's, with its prologue
  // and epilogue, is its op's.
  std::string kernel(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
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

  // The header of the ahead-of-time build (EmittedProgram::host_header).
  // Tables rather than one constant per tensor: a program can walk them to
  // copy every input in, and the enum gives each entry a C++ name.
  std::string host_header(const EmittedProgram& program) const {
    const std::string& P = options_.symbol_prefix;
    std::string out = fmt::format(
        "// Generated by cudagen {} from graph '{}' (hash {:016x}); do not edit.\n"
        "// The host interface of the graph's .cu file built ahead of time (nvcc, or the host\n"
        "// emulation). C++17. To run it:\n"
        "//   1. allocate one arena of {P}_arena_bytes bytes, 256-byte aligned (cudaMalloc; host\n"
        "//      memory where the .cu is built for the emulation);\n"
        "//   2. copy each input and parameter to arena + its offset ({P}_tensors), and each\n"
        "//      run-time argument to arena + its offset ({P}_scalars);\n"
        "//   3. call the phases: each launches its kernels on `stream` (null: the default stream)\n"
        "//      and returns 0, or the first CUDA error (a cudaError_t);\n"
        "//   4. copy outputs back from arena + their offset.\n"
        "{S}"
        "#pragma once\n\n"
        "struct CUstream_st;  // cudaStream_t is a CUstream_st*\n\n"
        "extern \"C\" {{\n"
        "extern const unsigned long long {P}_arena_bytes;  // {} on this plan\n",
        CUDAGEN_VERSION, comment_text(p_.graph.name), fnv1a64(write_graph(p_.graph) + options_.options_text), arena_bytes_,
        fmt::arg("P", P),
        fmt::arg("S", program.sync_bytes == 0
                          ? std::string()
                          : fmt::format("// Before step 3 the first time: zero the arena's bytes [{}, {}), counters the\n"
                                        "// kernels keep between launches ({}); they stay valid after.\n",
                                        program.sync_offset, program.sync_offset + program.sync_bytes,
                                        options_.megakernel ? "the megakernel's events" : "split-K's and flash attention backward's counters and sums")));
    for (Phase phase : {Phase::init, Phase::forward, Phase::backward, Phase::update}) {
      int count = 0;
      for (const auto& k : program.kernels) count += k.phase == phase;
      if (count > 0)
        out += fmt::format("int {}(unsigned char* arena, CUstream_st* stream);  // {} phase: {} launch{}\n",
                           phase_function(phase, P), to_string(phase), count, count == 1 ? "" : "es");
    }
    if (options_.step_function)
      out += fmt::format("int {}(unsigned char* arena, CUstream_st* stream);  // forward, backward, update\n",
                         step_function());
    out += "}\n\n";

    out +=
        "#ifndef CUDAGEN_HOST_TABLES_DEFINED\n"
        "#define CUDAGEN_HOST_TABLES_DEFINED\n"
        "// A tensor the program sees: an input, output or parameter (storage external), or state\n"
        "// that lives across steps (persistent: weights, optimizer moments).\n"
        "struct cudagen_host_tensor {\n"
        "  const char* name;     // task.slot\n"
        "  const char* dtype;    // f32, f16, bf16, f64, i32, i64\n"
        "  const char* storage;  // external or persistent\n"
        "  int rank;\n"
        "  long long shape[8];\n"
        "  unsigned long long offset;  // bytes from the arena's start\n"
        "  unsigned long long bytes;\n"
        "};\n"
        "// A run-time argument: 8 bytes at `offset`, zero-filled; a float is stored as a 32-bit\n"
        "// float in the first 4, an int as a 64-bit integer, a bool as a 32-bit 0 or 1. An Adam\n"
        "// `step` counts training steps from 1.\n"
        "struct cudagen_host_scalar {\n"
        "  const char* name;  // task.argument\n"
        "  const char* type;  // float, int or bool\n"
        "  unsigned long long offset;\n"
        "  double initial;    // the graph's value\n"
        "};\n"
        "#endif\n\n";

    // Entries are named by their task.slot, made C identifiers; a clash
    // (task `a_b` slot `c` against task `a` slot `b_c`) takes a suffix.
    std::set<std::string> used;
    auto identifier = [&](const std::string& name) {
      std::string id = P + "_";
      for (char c : name) id += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
      std::string unique = id;
      for (int n = 2; used.count(unique); ++n) unique = fmt::format("{}_{}", id, n);
      used.insert(unique);
      return unique;
    };
    std::vector<std::string> names, rows;
    for (size_t b = 0; b < p_.buffers.size(); ++b) {
      const BufferInfo& bi = p_.buffers[b];
      if (bi.storage != Storage::external && bi.storage != Storage::persistent) continue;
      if (bi.shape.size() > 8) continue;  // validate refuses these; the table's shape holds 8
      const PlannedBuffer& pb = plan_.buffers[b];
      names.push_back(identifier(buffer_name(int(b))));
      rows.push_back(fmt::format("    {{\"{}\", \"{}\", \"{}\", {}, {{{}}}, {}ull, {}ull}},", buffer_name(int(b)),
                                 to_string(bi.dtype), to_string(bi.storage), bi.shape.size(), fmt::join(bi.shape, ", "),
                                 pb.offset, pb.bytes));
    }
    out += fmt::format("enum {P}_tensor_index {{\n", fmt::arg("P", P));
    for (size_t i = 0; i < names.size(); ++i) out += fmt::format("  {},\n", names[i]);
    out += fmt::format("  {P}_tensor_count\n}};\n", fmt::arg("P", P));
    if (!rows.empty())
      out += fmt::format("inline constexpr cudagen_host_tensor {}_tensors[] = {{\n{}\n}};\n", P, fmt::join(rows, "\n"));

    names.clear();
    rows.clear();
    for (const auto& sc : plan_.scalars) {
      names.push_back(identifier(sc.name(p_)));
      rows.push_back(fmt::format("    {{\"{}\", \"{}\", {}ull, {}}},", sc.name(p_), to_string(sc.type), sc.offset,
                                 json_format_double(arg_number(sc.initial))));
    }
    out += fmt::format("\nenum {P}_scalar_index {{\n", fmt::arg("P", P));
    for (const auto& n : names) out += fmt::format("  {},\n", n);
    out += fmt::format("  {P}_scalar_count\n}};\n", fmt::arg("P", P));
    if (!rows.empty())
      out += fmt::format("inline constexpr cudagen_host_scalar {}_scalars[] = {{\n{}\n}};\n", P, fmt::join(rows, "\n"));
    return out;
  }

  void fail(int task, const std::string& slot, const std::string& message, const std::string& hint = {}) {
    diags_.add(Diagnostic{{}, {}, fmt::format("/tasks/{}", task), p_.tasks[size_t(task)].task->id, slot, message, hint});
  }

  // A fused kernel's shared memory, laid out by kernels.h as the fusion
  // pass bounded it: the kernel's first regions.
  static void use_shared(EmittedKernel& ek, const SharedLayout& layout) {
    ek.smem_regions = layout.regions;
    ek.smem_bytes = layout.end();
  }

  std::string buffer_name(int buffer) const { return cudagen::buffer_name(p_, buffer); }

  static std::string c_type(DType d) {
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
  static LaunchParam buffer_param(const std::string& name, const Param& x, bool written) {
    return LaunchParam{name, std::string(written ? "" : "const ") + c_type(x.buffer->dtype), x.bound->buffer, nullptr,
                       written};
  }
  static LaunchParam buffer_param(const std::string& name, const Param& x) { return buffer_param(name, x, x.written); }


  static bool is_16bit(DType d) { return d == DType::f16 || d == DType::bf16; }

  // The type arithmetic runs in: f32 for the 16-bit storage types.
  static std::string compute_type(DType d) { return is_16bit(d) ? "float" : c_type(d); }

  // The task's tensors in signature order, each a kernel parameter.
  std::vector<Param> params(int t) {
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
  static const Param* find_param(const std::vector<Param>& ps, const std::string& name) {
    for (const auto& x : ps)
      if (x.bound->name == name) return &x;
    return nullptr;
  }
  const Param& param(const std::vector<Param>& ps, const std::string& name) {
    if (const Param* x = find_param(ps, name)) return *x;
    throw std::logic_error("emitter: no slot " + name);
  }

  // The argument as bound, following `from` links to the argument that holds the value.
  const BoundArg* arg(int t, const std::string& name) { return root_arg(p_, t, name).second; }

  // A constant argument's value. One that lives in the scalars region would
  // change the kernel's code, not a value in it (a transpose flag, causal).
  const BoundArg* constant_arg(int t, const std::string& name) {
    if (plan_.scalar_of(p_, t, name) != nullptr)
      fail(t, name, fmt::format("argument '{}' of op '{}' decides the kernel's code, so it cannot change at run time",
                                name, p_.tasks[size_t(t)].op->name),
           "give it a constant value (drop \"runtime\" and any \"from\")");
    return arg(t, name);
  }
  double arg_double(int t, const std::string& name, double fallback) { return number_value(constant_arg(t, name), fallback); }
  int64_t arg_int(int t, const std::string& name, int64_t fallback) {
    const BoundArg* a = constant_arg(t, name);
    if (a == nullptr) return fallback;
    if (auto* i = std::get_if<int64_t>(&a->value)) return *i;
    return fallback;
  }
  bool arg_bool(int t, const std::string& name) { return flag_value(constant_arg(t, name)); }
  // A float argument as an expression: a literal, or the kernel's local copy
  // of the scalar it reads at run time.
  std::string float_arg(int t, const std::string& name, double fallback) {
    if (plan_.scalar_of(p_, t, name) != nullptr) return name;
    return float_literal(arg_double(t, name, fallback));
  }

  // The run-time arguments of task `t`: one pointer parameter each (NAME_arg,
  // into the scalars region), read once into a local named like the argument.
  struct ScalarParam {
    std::string name;
    const PlannedScalar* scalar;
  };
  std::vector<ScalarParam> scalar_params(int t) const {
    std::vector<ScalarParam> out;
    for (const auto& sig : p_.tasks[size_t(t)].op->args)
      if (const PlannedScalar* s = plan_.scalar_of(p_, t, sig.name)) out.push_back({sig.name, s});
    return out;
  }
  static std::string scalar_type(ArgType type) {
    return type == ArgType::float_ ? "float" : type == ArgType::int_ ? "long long" : "int";
  }
  std::string scalar_locals(int t) const {
    std::string out;
    for (const auto& sp : scalar_params(t)) {
      const std::string value = fmt::format("cg_load({}_arg, 0)", sp.name);
      out += fmt::format("  const {} {} = {};  // run-time argument {}\n",
                         sp.scalar->type == ArgType::bool_ ? "bool" : scalar_type(sp.scalar->type), sp.name,
                         sp.scalar->type == ArgType::bool_ ? value + " != 0" : value, sp.scalar->name(p_));
    }
    return out;
  }

  // __restrict__ promises that no other pointer of the kernel reaches this
  // memory while it is written; an output planned in place of its input
  // breaks that promise, so neither of the pair gets the qualifier.
  struct Pointer {
    int64_t offset, bytes;
    bool written;
  };
  static bool aliased(size_t i, const std::vector<Pointer>& pointers) {
    const Pointer& a = pointers[i];
    for (size_t j = 0; j < pointers.size(); ++j) {
      if (j == i || !(a.written || pointers[j].written)) continue;
      const Pointer& b = pointers[j];
      if (a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes) return true;
    }
    return false;
  }
  // Where a kernel parameter points in the arena: [offset, offset + bytes).
  std::pair<int64_t, int64_t> arena_range(const LaunchParam& lp) const {
    if (lp.scalar != nullptr) return {lp.scalar->offset, kScalarBytes};
    if (lp.buffer < 0) return {lp.workspace_offset, lp.workspace_bytes};
    const PlannedBuffer& pb = plan_.buffers[size_t(lp.buffer)];
    return {pb.offset, pb.bytes};
  }

  // A kernel as two functions: `NAME_tile`, the body over one block of the
  // grid (`tile`: which block, and how many there are along x), and the
  // __global__ NAME that calls it with blockIdx and gridDim. The megakernel's
  // dispatcher calls the same tile functions (docs/architecture.md §10), so it runs
  // exactly the code the kernels do. The __global__ takes buffers as
  // `T* __restrict__` (without it where two may overlap) and run-time
  // arguments as `const T* __restrict__ name_arg`; the tile function's
  // pointers carry no __restrict__, so that inside a megakernel, where other
  // blocks write what a task reads, no load goes through the read-only cache.
  std::string kernel_functions(const std::string& comment_text, const EmittedKernel& ek,
                               const std::vector<LaunchParam>& launch, const std::string& body) const {
    std::vector<std::string> tile_params;
    for (const LaunchParam& lp : launch) tile_params.push_back(fmt::format("{}* {}", lp.pointee, param_name(lp)));
    tile_params.push_back("cg_tile tile");
    std::string code = fmt::format("{}CG_DEVICE void {}_tile({}) {{\n{}}}\n", comment_text, ek.name,
                                   fmt::join(tile_params, ", "), body);
    if (global_wrapper_) code += global_function(ek, launch);
    return code + "\n";
  }

  // A parameter's name in the kernel's code: a run-time argument's pointer
  // is NAME_arg, NAME being the local it is read into.
  static std::string param_name(const LaunchParam& lp) { return lp.scalar != nullptr ? lp.name + "_arg" : lp.name; }

  // The parameters of a __global__: buffers as `T* __restrict__` (without it
  // where two may overlap), run-time arguments as `const T* __restrict__
  // name_arg`; and the names to pass on.
  std::pair<std::vector<std::string>, std::vector<std::string>> global_params(
      const std::vector<LaunchParam>& launch) const {
    std::vector<Pointer> pointers;  // the buffers, in launch order
    for (const auto& lp : launch)
      if (lp.scalar == nullptr) pointers.push_back({arena_range(lp).first, arena_range(lp).second, lp.written});
    std::vector<std::string> params, names;
    for (size_t i = 0, buffer = 0; i < launch.size(); ++i) {
      const LaunchParam& lp = launch[i];
      const std::string name = param_name(lp);
      const bool restrict = lp.scalar != nullptr || !aliased(buffer++, pointers);
      params.push_back(fmt::format("{}*{} {}", lp.pointee, restrict ? " __restrict__" : "", name));
      names.push_back(name);
    }
    return {params, names};
  }

  // The __global__ of a kernel launched alone: its tile function on blockIdx.
  std::string global_function(const EmittedKernel& ek, const std::vector<LaunchParam>& launch) const {
    auto [params, names] = global_params(launch);
    // Folded (a grid y or z over 65535): launched as one row of blocks that
    // blockIdx.x numbers, unfolded into the tile here.
    const std::string tile = grid_is_folded(ek) ? fmt::format("cg_tile_of(blockIdx.x, {}u, {}u)", ek.grid[0], ek.grid[1])
                                                : std::string("cg_launch_tile()");
    return fmt::format("CG_KERNEL void __launch_bounds__({}) {}({}) {{\n  {}_tile({}{}{});\n}}\n",
                       launch_bounds(ek), ek.name, fmt::join(params, ", "), ek.name, fmt::join(names, ", "),
                       names.empty() ? "" : ", ", tile);
  }
  static std::string launch_bounds(const EmittedKernel& ek) {
    return ek.min_blocks_per_sm > 0 ? fmt::format("{}, {}", ek.block, ek.min_blocks_per_sm) : std::to_string(ek.block);
  }

  // The kernels of one launch are adjacent (KernelGroup::launch).
  static bool alone_in_launch(const std::vector<KernelGroup>& kernels, size_t k) {
    return (k == 0 || kernels[k - 1].launch != kernels[k].launch) &&
           (k + 1 == kernels.size() || kernels[k + 1].launch != kernels[k].launch);
  }

  // Rule horizontal (fuse.h): the kernels of one launch as one grid, each on
  // its own range of blocks, calling its tile function with the tile it
  // would have had alone. Kernels of one block size only: a kernel's tiles
  // in a larger block would leave threads idle, so a launch whose kernels
  // differ splits by block size. Fills EmittedProgram::kernels, what the
  // launchers launch.
  std::string launches(const std::vector<KernelGroup>& kernels, EmittedProgram& out) {
    std::string code;
    for (size_t first = 0; first < kernels.size();) {
      size_t end = first;
      while (end < kernels.size() && kernels[end].launch == kernels[first].launch) ++end;
      std::vector<std::vector<size_t>> batches;  // by block size, in order of first appearance
      for (size_t k = first; k < end; ++k) {
        if (auto pre = pre_launches_.find(k); pre != pre_launches_.end()) {
          out.kernels.push_back(pre->second.first);
          launched_params_.push_back(pre->second.second);
        }
        auto same_block = [&](const std::vector<size_t>& b) { return out.tile_kernels[b[0]].block == out.tile_kernels[k].block; };
        auto it = std::find_if(batches.begin(), batches.end(), same_block);
        if (it == batches.end()) batches.push_back({k});
        else it->push_back(k);
      }
      for (size_t b = 0; b < batches.size(); ++b) {
        const std::vector<size_t>& members = batches[b];
        const EmittedKernel& alone = out.tile_kernels[members[0]];
        if (members.size() == 1) {
          if (end - first > 1) code += global_function(alone, launch_params_[members[0]]) + "\n";
          out.kernels.push_back(alone);
          launched_params_.push_back(launch_params_[members[0]]);
          continue;
        }
        code += batched_launch(kernels, members, batches.size() > 1 ? fmt::format("_{}", b) : "", out);
      }
      first = end;
    }
    return code;
  }

  std::string batched_launch(const std::vector<KernelGroup>& kernels, const std::vector<size_t>& members,
                             const std::string& suffix, EmittedProgram& out) {
    const KernelGroup& head = kernels[members[0]];
    std::vector<std::string> ids;
    for (size_t m : members) ids.push_back(p_.tasks[size_t(kernels[m].tasks.front())].task->id);
    EmittedKernel lk;
    lk.name = fmt::format("h{}_{}", head.launch, fmt::join(ids.begin(), ids.begin() + long(std::min<size_t>(ids.size(), 3)), "_"));
    if (ids.size() > 3) lk.name += fmt::format("_and_{}_more", ids.size() - 3);
    for (char& c : lk.name)
      if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
    lk.name += suffix;
    lk.phase = head.phase;
    lk.block = out.tile_kernels[members[0]].block;
    std::vector<LaunchParam> params;
    std::string dispatch, ranges;
    int64_t block_begin = 0;
    for (size_t i = 0; i < members.size(); ++i) {
      const EmittedKernel& tk = out.tile_kernels[members[i]];
      const int64_t tiles = int64_t(tk.grid[0]) * tk.grid[1] * tk.grid[2];
      std::vector<std::string> args;
      for (const LaunchParam& lp : launch_params_[members[i]]) {
        LaunchParam renamed = lp;
        renamed.name = tk.name + "_" + lp.name;
        args.push_back(param_name(renamed));
        params.push_back(std::move(renamed));
      }
      args.push_back(fmt::format("cg_tile_of(block{}, {}, {})", block_begin ? fmt::format(" - {}u", block_begin) : "",
                                 tk.grid[0], tk.grid[1]));
      const std::string call = fmt::format("{}_tile({});", tk.name, fmt::join(args, ", "));
      if (i + 1 < members.size())
        dispatch += fmt::format("  {}if (block < {}u)\n    {}\n", i ? "else " : "", block_begin + tiles, call);
      else
        dispatch += fmt::format("  else\n    {}\n", call);
      ranges += fmt::format("//   blocks [{}, {}): {}\n", block_begin, block_begin + tiles, tk.name);
      block_begin += tiles;
      lk.tasks.insert(lk.tasks.end(), tk.tasks.begin(), tk.tasks.end());
      lk.smem_bytes = std::max(lk.smem_bytes, tk.smem_bytes);
      if (tk.min_blocks_per_sm > 0)
        lk.min_blocks_per_sm = lk.min_blocks_per_sm > 0 ? std::min(lk.min_blocks_per_sm, tk.min_blocks_per_sm) : tk.min_blocks_per_sm;
      lk.bytes_read += tk.bytes_read;
      lk.bytes_written += tk.bytes_written;
      if (tk.flops >= 0) lk.flops = std::max<int64_t>(lk.flops, 0) + tk.flops;
      lk.arg_offsets.insert(lk.arg_offsets.end(), tk.arg_offsets.begin(), tk.arg_offsets.end());
      lk.ranges.insert(lk.ranges.end(), tk.ranges.begin(), tk.ranges.end());
    }
    lk.grid[0] = int(block_begin);
    // One mainloop for the model when every member runs the same one.
    lk.mainloop = out.tile_kernels[members[0]].mainloop;
    for (size_t m : members)
      if (out.tile_kernels[m].mainloop != lk.mainloop) lk.mainloop = MatmulMainloop::none;
    auto [kernel_params, unused] = global_params(params);
    std::string code = fmt::format(
        "// Launch {} ({} phase):\n"
        "// {} kernels that are independent of each other (rule horizontal) as one grid of {} blocks\n"
        "// of {} threads, {} bytes of shared memory; each runs its tile function on its own blocks,\n"
        "// with the tile it has when launched alone:\n{}"
        "CG_KERNEL void __launch_bounds__({}) {}(\n    {}) {{\n"
        "  const unsigned int block = blockIdx.x;\n{}}}\n\n",
        lk.name, to_string(lk.phase), members.size(), lk.grid[0], lk.block, lk.smem_bytes, ranges, launch_bounds(lk), lk.name,
        fmt::join(kernel_params, ",\n    "), dispatch);
    out.kernels.push_back(std::move(lk));
    launched_params_.push_back(std::move(params));
    return code;
  }

  // The comment above a kernel: its tasks (and the rule that fused them),
  // each buffer it reads and writes with its bytes, its launch shape.
  std::string comment(const KernelGroup& k, const std::vector<LaunchParam>& launch, EmittedKernel& ek) {
    const BoundTask& bt = p_.tasks[size_t(k.tasks[0])];
    // The skeletons pick their variants (staged or not, rows per block) to
    // fit; a plan over the limit is the emitter's bug, not the graph's.
    // Above 48 KiB the launchers opt in (only the pipelined mainloop asks so much).
    if (ek.smem_bytes > kSharedBytesWithOptIn)
      fail(k.tasks[0], "",
           fmt::format("kernel {} would need {} bytes of shared memory, more than the {} every device from sm_80 on "
                       "lets a kernel opt in to",
                       k.name, ek.smem_bytes, kSharedBytesWithOptIn),
           "an internal error of cudagen's emitter: please report it with the graph; --no-fuse avoids the fused kernel");
    const bool fused = k.tasks.size() > 1 || !k.prologue.empty();
    std::vector<std::string> reads, writes, in_registers, workspaces;
    std::set<std::pair<int, bool>> counted;  // a buffer two parameters read (or write) moves once, as the model has it
    for (const auto& lp : launch) {
      if (lp.scalar != nullptr) continue;
      if (lp.buffer < 0) {  // a workspace: written once, read once
        workspaces.push_back(fmt::format("{} ({} bytes at arena + {})", lp.name, lp.workspace_bytes, lp.workspace_offset));
        ek.bytes_read += lp.workspace_bytes;
        ek.bytes_written += lp.workspace_bytes;
        continue;
      }
      if (fused && !counted.insert({lp.buffer, lp.written}).second) continue;
      const BufferInfo& b = p_.buffers[size_t(lp.buffer)];
      // One task's kernel: its slot, then the buffer behind it when another task's. A fused one: the buffer.
      std::string desc = fused ? buffer_name(lp.buffer) : bt.task->id + "." + lp.name;
      desc += fmt::format(" {} {}", to_string(b.dtype), shape_to_string(b.shape));
      if (!fused && b.owner_task != k.tasks[0]) desc += " <- " + buffer_name(lp.buffer);
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
        "written; grid [{}, {}, {}], block {}, {} bytes of shared memory{}\n",
        k.name, to_string(k.phase), tasks, reads.empty() ? "-" : fmt::format("{}", fmt::join(reads, ", ")),
        writes.empty() ? "-" : fmt::format("{}", fmt::join(writes, ", ")),
        (in_registers.empty() ? "" : fmt::format("//   in registers {}\n", fmt::join(in_registers, ", "))) +
            (workspaces.empty() ? "" : fmt::format("//   workspace {}\n", fmt::join(workspaces, ", "))),
        ek.bytes_read, ek.bytes_written, ek.grid[0], ek.grid[1], ek.grid[2], ek.block, ek.smem_bytes,
        regions.empty() ? "." : fmt::format(":\n//     {}", fmt::join(regions, "\n//     "))) +
           (ek.matmul_path.empty() ? "" : fmt::format("//   matmul on {}.\n", ek.matmul_path));
  }

  static int grid_stride_blocks(int64_t n, int block) { return int(std::clamp<int64_t>((n + block - 1) / block, 1, 4096)); }

  // The skeleton of the ops that compute each element on its own: a
  // grid-stride loop of 256-thread blocks over n elements, `statement` on
  // element i.
  static std::string grid_stride_loop(int64_t n, const std::string& statement, EmittedKernel& ek) {
    ek.block = 256;
    ek.grid[0] = grid_stride_blocks(n, ek.block);
    ek.grid_stride = true;
    return fmt::format(
        "  for (cg_i64 i = cg_global_thread(tile); i < {}; i += cg_grid_threads(tile))\n"
        "    {};\n",
        n, statement);
  }

  // Fails naming the first of `args` below 1 (a stride, a kernel size).
  bool args_at_least_one(int t, std::initializer_list<const char*> args) {
    for (const char* a : args)
      if (const int64_t v = arg_int(t, a, 1); v < 1) {
        fail(t, a, fmt::format("{} is {}; it must be at least 1", a, v));
        return false;
      }
    return true;
  }

  // A kernel group's entry, before its skeleton sets the launch shape.
  static EmittedKernel emitted_kernel(const KernelGroup& k) {
    EmittedKernel ek;
    ek.name = k.name;
    ek.phase = k.phase;
    ek.tasks = kernel_tasks(k);
    return ek;
  }

  std::string emit_kernel(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
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
    std::string body = op.pattern == PatternKind::elementwise || op.pattern == PatternKind::broadcast
                           ? elementwise(t, ps, ek)
                       : op.pattern == PatternKind::matmul ? matmul(t, ps, ek)
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
    for (const auto& x : ps)
      if (!contains(k.internal_buffers, x.bound->buffer) && x.bound->buffer != computed)  // kept in registers
        launch.push_back(buffer_param(x.bound->name, x));
    launch.insert(launch.end(), prologue_params.begin(), prologue_params.end());
    launch.insert(launch.end(), tail.params.begin(), tail.params.end());
    for (const auto& sp : scalar_params(t))
      launch.push_back(LaunchParam{sp.name, "const " + scalar_type(sp.scalar->type), -1, sp.scalar});
    for (LaunchParam& w : std::exchange(split_k_params_, {})) launch.push_back(std::move(w));
    std::string code =
        kernel_functions(comment(k, launch, ek), ek, launch,
                         scalar_locals(t) + operand_prologue + tail.code + tail.vector_code + body);
    record_launch(ek, std::move(launch));
    // (Only what an `a` prologue reads follows a's rows.)
    mark_rows(t, ps, k.prologue_operand == "a" ? prologue_params : std::vector<LaunchParam>{}, tail.params,
              launch_params_.back(), ek);
    emitted.push_back(ek);
    return code;
  }

  // Rule attention (fuse.h): scores = alpha * q k^T, probs = softmax(scale *
  // scores), out = alpha' * probs v, and any epilogue on out. One warp per
  // query row (cg_attention_row), up to 8 rows per block; each warp's row of
  // scores in shared memory. Probabilities read elsewhere (saved for the
  // backward pass) are stored as they are computed. The operands the kernel
  // computes itself (rule attention_projection) come from shared memory.
  std::string attention(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
    const size_t first = attention_scores(p_, k);
    const int ts = k.tasks[first], tp = k.tasks[first + 1], tc = k.tasks[first + 2];
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
    if (k.tasks.size() > first + 3) {
      tail = epilogue(k, out, {.first = first + 3});
      if (!diags_.ok()) return {};
      epilogue_buffer_ = out.bound->buffer;
    }
    const Shape& sq = q.buffer->shape;
    const int64_t Tq = sq[sq.size() - 2], D = sq.back(), Tk = kk.buffer->shape[sq.size() - 2];
    const int64_t Dv = v.buffer->shape.back(), rows = numel(sq) / D;
    const std::vector<Projection> projections = attention_projections(k, first);
    auto computed = [&](const Param& x) {
      return std::any_of(projections.begin(), projections.end(), [&](const Projection& pr) { return pr.heads == x.bound->buffer; });
    };
    const bool q_computed = computed(q), k_computed = computed(kk), v_computed = computed(v);
    const bool store_probs = !contains(k.internal_buffers, probs.bound->buffer);
    // Tensor cores where the flash kernel applies; otherwise the row kernel,
    // as far as the fusion pass allowed it (1024 keys).
    std::string why_not_flash = !projections.empty() ? "the kernel computes its projections' heads itself"
                                : !global_wrapper_  ? "it shares its launch with other kernels"
                                                    : std::string();
    if (why_not_flash.empty())
      if (const std::optional<FlashAttentionTile> tile =
              flash_attention_tile_of(p_, ts, tp, options_.megakernel, &why_not_flash, options_.arch, k.flash_trained))
        return flash_attention(k, first, *tile, std::move(ek), tail.code, tail.params, emitted);
    if (k.flash_trained) {
      fail(ts, "", fmt::format("internal error: kernel {} trains on the flash kernels, which do not apply: {}", k.name,
                               why_not_flash),
           "--no-fuse-rule attention_backward avoids it; please report it with the graph");
      return {};
    }
    if (!std::equal(sq.begin(), sq.end() - 2, kk.buffer->shape.begin()))
      fail(ts, "", fmt::format("internal error: a grouped-query attention (k {} for q {}) was fused, but the flash kernel "
                               "does not apply: {}",
                               shape_to_string(kk.buffer->shape), shape_to_string(sq), why_not_flash));
    if (Tk > kMaxAttentionKeys || D > kMaxAttentionKeys)
      return streamed_attention(k, first, std::move(ek), tail.code, tail.params, why_not_flash, emitted);
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
                         "  const cg_i64 row = (cg_i64)tile.x * {0} + warp;\n"
                         "  const cg_i64 keys = (cg_i64)tile.x * {0} / {1} * {2};  // the first key (and value) row of the block's head\n",
                         per_block, Tq, Tk);
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
    // A larger block (the megakernel's) has spare warps: they only help stage.
    body += fmt::format(
        "{14}\n"
        "    cg_attention_row([&](int c) {{ return {1}; }},\n"
        "                     [&](int j, int c) {{ return {2}; }},\n"
        "                     [&](int j, int c) {{ return {3}; }},\n"
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
                   : fmt::format("  if (warp < {})", per_block));
    if (stage) body += "  __syncthreads();  // the staged rows are read before the block's next tile overwrites them\n";
    epilogue_buffer_ = -1;
    std::vector<LaunchParam> launch;
    auto add = [&](const std::string& name, const Param& x, bool written) {
      launch.push_back(buffer_param(name, x, written));
    };
    if (!q_computed) add("q", q, false);
    if (!k_computed) add("k", kk, false);
    if (!v_computed) add("v", v, false);
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
  std::string flash_attention(const KernelGroup& k, size_t first, const FlashAttentionTile& tile, EmittedKernel ek,
                              const std::string& tail_code, const std::vector<LaunchParam>& tail_params,
                              std::vector<EmittedKernel>& emitted) {
    const int ts = k.tasks[first], tp = k.tasks[first + 1], tc = k.tasks[first + 2];
    const std::vector<Param> scores = params(ts), context = params(tc);
    const Param& q = param(scores, "a");
    const Param& kk = param(scores, "b");
    const Param& v = param(context, "b");
    const Param& out = param(context, "out");
    const OpSignature& softmax = *p_.tasks[size_t(tp)].op;
    use_function(softmax, "cg_flash_config");
    const Shape& sq = q.buffer->shape;
    const int64_t Tq = sq[sq.size() - 2], D = sq.back(), Tk = kk.buffer->shape[sq.size() - 2];
    const int64_t Dv = v.buffer->shape.back(), heads = numel(sq) / (Tq * D);
    // Grouped-query attention: the head of keys and values a head of q reads.
    const std::string kv_head = broadcast_index(Shape(sq.begin(), sq.end() - 2),
                                                Shape(kk.buffer->shape.begin(), kk.buffer->shape.end() - 2), "head");
    const int64_t m_tiles = (Tq + tile.block_m - 1) / tile.block_m;
    const bool causal = arg_bool(tp, "causal");
    ek.block = tile.threads();
    // Without a minimum of blocks, ptxas for sm_90 caps the kernel at 128
    // registers and spills (heads of 64); it needs about 140.
    ek.min_blocks_per_sm = 1;
    ek.grid[0] = m_tiles;
    ek.grid[1] = heads;
    ek.grid[2] = tile.splits;
    ek.matmul_path = "tensor cores: flash attention (templates/softmax_flash.cuh), " + tile.describe();
    ek.mainloop = MatmulMainloop::flash_attention;
    reserve_shared(ek, fmt::format("the q tile and {} stages of keys and values, then the output tile", tile.stages),
                   tile.shared_bytes());
    // s = scale (alpha q . k) in log2 units: exp(x) is exp2(x log2 e).
    const double scale_log2 = arg_double(ts, "alpha", 1.0) * arg_double(tp, "scale", 1.0) * 1.4426950408889634;
    const std::string alpha_out = float_arg(tc, "alpha", 1.0);
    const std::string type = c_type(q.buffer->dtype);
    // Split-KV: each block (tile.z) its range of key tiles, then the last of
    // a row tile combines, in split order, from the workspace.
    std::string split, call = "cg_flash_attention";
    std::vector<LaunchParam> workspace;
    if (tile.splits > 1) {
      call = "cg_flash_attention_split";
      split = fmt::format("\n      (int)tile.z, {}, {}, cg_partials + (head * {} + tile_m) * {}, cg_arrivals + head * {} + tile_m,",
                          tile.splits, tile.tiles_per_split, m_tiles, tile.partial_floats(1, 1), m_tiles);
      workspace = {LaunchParam{"cg_partials", "float", -1, nullptr, true, split_k_.partials_offset,
                               tile.partial_floats(heads, m_tiles) * 4},
                   LaunchParam{"cg_arrivals", "unsigned int", -1, nullptr, true, split_k_.arrivals_offset,
                               heads * m_tiles * 4}};
    }
    use_function(softmax, call);
    // Trained: each row's log-sum-exp and o (before the matmul's alpha) saved for the gradient kernel.
    std::string lse_store = "[&](cg_i64, float) {} /* no backward pass reads the log-sum-exp */", saved_o;
    if (k.flash_trained) {
      const FlashStatistics& f = flash_statistics_.at(tp);
      lse_store = fmt::format("[&](cg_i64 row, float lse) {{ cg_lse[head * {} + row] = lse; }}", Tq);
      saved_o = fmt::format(" cg_saved_o[(head * {} + row) * {} + c] = cg_narrow<{}>(o);", Tq, Dv, type);
      workspace.push_back(LaunchParam{"cg_lse", "float", -1, nullptr, true, f.lse_offset, f.lse_bytes});
      workspace.push_back(LaunchParam{"cg_saved_o", type, -1, nullptr, true, f.o_offset, f.o_bytes});
    }
    std::string body = fmt::format(
        "  CG_DYNAMIC_SMEM(cg_smem);\n"
        "  // Flash attention: {0}.\n"
        "  typedef cg_flash_config<{1}> cg_config;\n"
        "  const cg_i64 head = tile.y, kv_head = {12}, tile_m = {2};\n"
        "  {13}<cg_config, {3}>(q + head * {4}, k + kv_head * {5}, v + kv_head * {6}, {7}, {8}, tile_m,{14}\n"
        "      {9}, {10},\n"
        "      [&](cg_i64 row, int c, float o) {{ {11};{16} }},\n"
        "      {15},\n"
        "      ({3}*)cg_smem);\n",
        tile.describe(), tile.arguments(), causal ? fmt::format("{} - tile.x", m_tiles - 1) : "tile.x", type, Tq * D,
        Tk * D, Tk * Dv, Tq, Tk, float_literal(scale_log2), causal ? "true" : "false",
        store(out, fmt::format("(head * {} + row) * {} + c", Tq, Dv), alpha_out == float_literal(1.0) ? "o" : alpha_out + " * o"),
        kv_head, call, split, lse_store, saved_o);
    epilogue_buffer_ = -1;
    std::vector<LaunchParam> launch = {buffer_param("q", q, false), buffer_param("k", kk, false),
                                       buffer_param("v", v, false)};
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
  std::string streamed_attention(const KernelGroup& k, size_t first, EmittedKernel ek, const std::string& tail_code,
                                 const std::vector<LaunchParam>& tail_params, const std::string& why_not_flash,
                                 std::vector<EmittedKernel>& emitted) {
    const int ts = k.tasks[first], tp = k.tasks[first + 1], tc = k.tasks[first + 2];
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
    std::string body = fmt::format(
        "  CG_DYNAMIC_SMEM(cg_smem);\n"
        "  const unsigned int warp = threadIdx.x / 32;  // one warp per query row\n"
        "  const cg_i64 row = (cg_i64)tile.x * {0} + warp;\n"
        "  const cg_i64 keys = row / {1} * {2};  // the first key (and value) row of the row's head\n"
        "  if (warp < {0} && row < {3})\n"
        "    cg_attention_row_streamed<{4}>([&](int c) {{ return {5}; }},\n"
        "                                  [&](int j, int c) {{ return {6}; }},\n"
        "                                  [&](int j, int c) {{ return {7}; }},\n"
        "                                  [&](int j, float p) {{ {8}; }},\n"
        "                                  [&](int c, float o) {{ {9}; }},\n"
        "                                  {2}, {10}, {11}, {12}, {13}, {14}, (float*)cg_smem + warp * {10});\n",
        per_block, Tq, Tk, rows, (Dv + 31) / 32, load_element("q", q.buffer->dtype, fmt::format("row * {} + c", D)),
        load_element("k", kk.buffer->dtype, fmt::format("(keys + j) * {} + c", D)),
        load_element("v", v.buffer->dtype, fmt::format("(keys + j) * {} + c", Dv)),
        store_probs ? store_element("probs", probs.buffer->dtype, fmt::format("row * {} + j", Tk), "p")
                    : std::string("(void)j, (void)p"),
        store(out, fmt::format("row * {} + c", Dv), alpha_out == float_literal(1.0) ? "o" : alpha_out + " * o"), D, Dv,
        float_arg(ts, "alpha", 1.0), float_arg(tp, "scale", 1.0), valid);
    epilogue_buffer_ = -1;
    std::vector<LaunchParam> launch = {buffer_param("q", q, false), buffer_param("k", kk, false),
                                       buffer_param("v", v, false)};
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
  std::string flash_backward_rows_kernel(const KernelGroup& k, const FlashAttentionTile& tile, const FlashTraining& roles,
                                         const Param& dout, const FlashStatistics& f, int64_t heads, int64_t Tq,
                                         int64_t Dv, std::vector<EmittedKernel>& emitted) {
    const int64_t rows = flash_backward_statistics_rows(Tq);
    const std::string type = c_type(dout.buffer->dtype);
    use_function(*p_.tasks[size_t(roles.ds)].op, "cg_flash_backward_rows");
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

  // Rule attention_backward (fuse.h): an attention's gradient tasks
  // (kernels.h, AttentionGradient) in one kernel, a block per head. The
  // block stages its head's keys and values, then takes its query rows 8 at
  // a time: their q, dcontext and probabilities in shared memory, one warp
  // per row computes dp, ds (rounded as the unfused kernels would store
  // them, and kept in shared memory) and the row of dq
  // (cg_attention_backward_row); then each thread adds the tile's rows, in
  // order, into its elements of dk and dv, held in registers and stored at
  // the end. Each gradient's epilogue (its head merge) runs where it is
  // stored.
  std::string attention_backward(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
    const AttentionGradient g = attention_gradient(p_, k);
    const int tdp = k.tasks[g.dp], tds = k.tasks[g.ds];
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
    auto gradient = [&](size_t at, const std::string& role) {
      Gradient gr;
      if (at == AttentionGradient::none) return gr;
      const int t = k.tasks[at];
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
      if (const size_t end = g.epilogue_end(at, k.tasks.size()); end > at + 1) {
        gr.lambda = "cg_epilogue_" + role;
        Epilogue e = epilogue(k, out, {.first = at + 1, .last = end, .lambda = gr.lambda, .anchor_name = id + "_out"});
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
    const Gradient dq = gradient(g.dq, "dq"), dk = gradient(g.dk, "dk"), dv = gradient(g.dv, "dv");
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
      FlashTraining roles{.dp = tdp, .ds = tds, .dq = g.dq == AttentionGradient::none ? -1 : k.tasks[g.dq],
                          .dk = g.dk == AttentionGradient::none ? -1 : k.tasks[g.dk],
                          .dv = g.dv == AttentionGradient::none ? -1 : k.tasks[g.dv]};
      std::string why_not;
      // The atomic mode (--atomic-attention-backward): the key blocks sum dq too, with atomics.
      const bool atomic = flash_backward_atomic(k);
      const std::optional<FlashAttentionTile> tile =
          flash_backward_tile_of(p_, roles, options_.megakernel, &why_not, options_.arch, atomic);
      if (!tile) {
        fail(tds, "", fmt::format("internal error: kernel {} trains on the flash kernels, which do not apply: {}", k.name, why_not),
             "--no-fuse-rule attention_backward avoids it; please report it with the graph");
        return {};
      }
      const std::vector<Param> scores = params(roles.scores);
      for (const auto& [name, slot] : {std::pair{"q", "a"}, std::pair{"k", "b"}})
        if (std::none_of(launch.begin(), launch.end(), [&](const LaunchParam& lp) { return lp.name == name; }))
          add(name, param(scores, slot));
      const Param& q = param(scores, "a");
      const FlashStatistics& f = flash_statistics_.at(roles.softmax);
      const std::string type = c_type(q.buffer->dtype);
      const int64_t stats_rows = flash_backward_statistics_rows(Tq);
      if (tile->block_m != kFlashBackwardBlockRows) {
        fail(tds, "", fmt::format("internal error: kernel {}'s flash backward tile has blocks of {} rows, its rows' "
                                  "statistics cover multiples of {}", k.name, tile->block_m, kFlashBackwardBlockRows),
             "--no-fuse-rule attention_backward avoids it; please report it with the graph");
        return {};
      }
      launch.push_back(LaunchParam{"cg_row_stats", "const float", -1, nullptr, false, f.rows_offset, f.rows_bytes});
      const int64_t key_tiles = dk.present || dv.present ? (Tk + tile->block_m - 1) / tile->block_m : 0;
      const int64_t query_tiles = dq.present && !atomic ? (Tq + tile->block_m - 1) / tile->block_m : 0;
      std::string dq_sums = "nullptr, nullptr";
      if (atomic) {
        const int64_t tiles_of_dq = (Tq + tile->block_n - 1) / tile->block_n;
        launch.push_back(LaunchParam{"cg_dq_accum", "float", -1, nullptr, true, split_k_.dq_offset, heads * Tq * tile->head_d * 4});
        launch.push_back(LaunchParam{"cg_dq_arrivals", "unsigned int", -1, nullptr, true, split_k_.dq_arrivals_offset,
                                     heads * tiles_of_dq * 4});
        dq_sums = fmt::format("cg_dq_accum + head * {}, cg_dq_arrivals + head * {}", Tq * tile->head_d, tiles_of_dq);
      }
      ek.block = tile->threads();
      ek.grid[0] = key_tiles + query_tiles;
      ek.grid[1] = heads;
      ek.min_blocks_per_sm = tile->min_blocks_per_sm;
      ek.matmul_path = fmt::format(
          "tensor cores: flash attention backward (templates/softmax_flash.cuh), {} key rows or query rows a block ({} "
          "warps{}), {} rows a step, {} stages, heads of {}; {} blocks of keys (dk, dv{}) and {} of query rows (dq) a head{}",
          tile->block_m, tile->block_m / 16,
          tile->min_blocks_per_sm > 1 ? fmt::format("; registers for {} blocks a SM", tile->min_blocks_per_sm) : "",
          tile->block_n, tile->stages, tile->head_d, key_tiles, atomic ? ", dq" : "", query_tiles,
          atomic ? ", dq summed with atomics (--atomic-attention-backward: not bit-identical from run to run)"
                 : options_.atomic_attention_backward && dq.present ? ", dq in blocks of its own (the atomic mode takes heads of up to 64 with dk or dv)" : "");
      ek.mainloop = MatmulMainloop::flash_attention;
      reserve_shared(ek, fmt::format("the block's rows, {} stages of streamed rows and their statistics, then the output tile",
                                     tile->stages),
                     tile->backward_shared_bytes(atomic));
      use_function(*p_.tasks[size_t(tds)].op, "cg_flash_attention_backward");
      const double scale_log2 = arg_double(roles.scores, "alpha", 1.0) * arg_double(roles.softmax, "scale", 1.0) * 1.4426950408889634;
      const std::string ds_scale = float_arg(tds, "scale", 1.0);
      auto gradient_store = [&](const Gradient& gr, const std::string& rows, int64_t width) {
        if (!gr.present) return std::string("[&](cg_i64, int, float) {}");
        const std::string value = &gr == &dv || ds_scale == float_literal(1.0) ? "x" : ds_scale + " * x";
        return fmt::format("[&](cg_i64 row, int c, float x) {{ {}; }}",
                           store(gr, fmt::format("(head * {} + row) * {} + c", rows, width), value));
      };
      const int64_t D_heads = dq.present ? dq.width : dk.present ? dk.width : q.buffer->shape.back();
      std::string body = fmt::format(
          "  CG_DYNAMIC_SMEM(cg_smem);\n"
          "  // Flash attention backward: {0} blocks of keys, then {1} of query rows, a head.\n"
          "  typedef cg_flash_config<{2}> cg_config;\n"
          "  const cg_i64 head = tile.y;\n",
          key_tiles, query_tiles, tile->arguments());
      body += epilogues;
      body += fmt::format(
          "  cg_flash_attention_backward<cg_config, {0}, {14}>(q + head * {1}, k + head * {2}, v + head * {3},\n"
          "      dcontext + head * {4}, cg_row_stats + head * {16}, {5}, {6}, tile.x, {7}, {8}, {9}, {10},\n"
          "      {15},\n"
          "      {11},  // dq\n"
          "      {12},  // dk\n"
          "      {13},  // dv\n"
          "      ({0}*)cg_smem);\n",
          type, Tq * D_heads, Tk * D_heads, Tk * Dv, Tq * Dv, Tq, Tk, key_tiles, float_literal(scale_log2),
          float_arg(tdp, "alpha", 1.0), arg_bool(roles.softmax, "causal") ? "true" : "false",
          gradient_store(dq, std::to_string(Tq), D_heads), gradient_store(dk, std::to_string(Tk), D_heads),
          gradient_store(dv, std::to_string(Tk), Dv), atomic ? "true" : "false", dq_sums, 2 * stats_rows);
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
                            buffer_name(p_.tasks[size_t(k.tasks[name == std::string("dk") ? g.dk : g.dv])].find_tensor("out")->buffer),
                            Tk, gr->width);
    body += epilogues;
    auto stage = [&](const std::string& to, const std::string& name, DType type, const std::string& count,
                     const std::string& first, const std::string& indent = "  ") {
      return fmt::format("{}for (int e = threadIdx.x; e < {}; e += blockDim.x) {}[e] = {};\n", indent, count, to,
                         load_element(name, type, first + " + e"));
    };
    body += "  // The head's keys and values.\n";
    if (dq.present) body += stage("cg_keys", dq.operand, dq.operand_type, std::to_string(Tk * D), fmt::format("cg_head * {}", Tk * D));
    body += stage("cg_values", "v", v.buffer->dtype, std::to_string(Tk * Dv), fmt::format("cg_head * {}", Tk * Dv));
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

  // Rule attention_projection (fuse.h): an operand the attention kernel
  // computes itself: k.tasks[matmul], its epilogue, and the split_heads at
  // k.tasks[split] whose output (`heads`) the attention reads.
  struct Projection {
    size_t matmul = 0, split = 0;
    int heads = -1;
  };
  std::vector<Projection> attention_projections(const KernelGroup& k, size_t scores) const {
    std::vector<Projection> out;
    for (size_t j = 0; j < scores; ++j) {
      const BoundTask& bt = p_.tasks[size_t(k.tasks[j])];
      if (bt.op->pattern == PatternKind::matmul) {
        out.push_back(Projection{j, 0, -1});
      } else if (is_op(bt, BundledOp::split_heads) && !out.empty()) {
        out.back().split = j;
        out.back().heads = bt.find_tensor("out")->buffer;
      }
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
  int source_norm(const KernelGroup& k, int source) const {
    for (int t : k.prologue)
      if (p_.tasks[size_t(t)].find_tensor("out")->buffer == source) return t;
    return -1;
  }

  // What each projection stages in shared memory, in the order
  // projection_code stages it (attention_shared lays it out), and the
  // largest projection's weight columns for one head.
  std::vector<AttentionProjectionShared> projection_shared(const KernelGroup& k, const std::vector<Projection>& projections,
                                                           int q_heads, int64_t& weight_floats) const {
    std::vector<AttentionProjectionShared> out;
    if (projections.empty()) return out;
    const Shape& sq = p_.buffers[size_t(q_heads)].shape;
    const int64_t H = sq.size() >= 3 ? sq[sq.size() - 3] : 1;
    for (const Projection& pr : projections) {
      const BoundTask& mm = p_.tasks[size_t(k.tasks[pr.matmul])];
      const int source = mm.find_tensor("a")->buffer;
      const Shape& sa = p_.buffers[size_t(source)].shape;
      const int64_t T = sa[sa.size() - 2], K = sa.back(), Dh = p_.buffers[size_t(mm.find_tensor("out")->buffer)].shape.back() / H;
      weight_floats = std::max(weight_floats, K * Dh);
      AttentionProjectionShared s{.source = source, .source_floats = T * K};
      s.source_what = fmt::format("{}'s {} rows of a batch", buffer_name(source), T);
      if (const int t = source_norm(k, source); t >= 0) {
        const BoundTask& norm = p_.tasks[size_t(t)];
        const bool layer = norm.op->norm == "layer", stored = !contains(k.internal_buffers, source);
        const int64_t per_row = layer ? 2 : 1;
        s.source_floats = T * K + per_row * K + (stored ? per_row * T : 0);
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

  struct ProjectionCode {
    std::string code;
    std::vector<LaunchParam> params;
  };
  ProjectionCode projection_code(const KernelGroup& k, const std::vector<Projection>& projections,
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
      const int mm = k.tasks[pr.matmul];
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
        const int split = k.tasks[pr.split];
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
          id, pr.split > pr.matmul + 1 ? " and its epilogue" : "", buffer_name(pr.heads), role, N, T, Dh, dest, kept,
          store_heads);
      std::string sink = "cg_keep_" + role;
      if (pr.split > pr.matmul + 1) {
        const std::string lambda = "cg_epilogue_" + role;
        Epilogue e = epilogue(k, mm_out, {.first = pr.matmul + 1,
                                          .last = pr.split,
                                          .lambda = lambda,
                                          .anchor_name = id + "_out",
                                          .keep = "cg_keep_" + role + "(i, {})",
                                          .kept_buffer = param(params(k.tasks[pr.split]), "x").bound->buffer});
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

  // EmittedKernel::rows for the skeletons whose tiles own whole rows: a
  // matmul's row of output tiles (its `a` rows too, unless transposed or
  // broadcast over the batch), and a block-per-row op's row. What an epilogue
  // reads or stores at the anchor's own element is row by row as well; a
  // weight, the matmul's `b`, anything broadcast is not.
  void mark_rows(int t, const std::vector<Param>& ps, const std::vector<LaunchParam>& prologue,
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
  std::vector<LaunchParam> prologue(const KernelGroup& k) {
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

  // An operand's element as a chain reads it: from the parameter `name` at
  // `index` (of element i of the domain); by default one load.
  using OperandLoad = std::function<std::string(const std::string& name, const Param& x, const std::string& index)>;

  // One task of a chain run on element i of `domain` (an epilogue's, an
  // elementwise prologue's): its statement, defining local `value`. Each
  // operand is an earlier task's local (`value_of`), else its element loaded
  // from memory (at i, or through its broadcast) by a parameter named after
  // its first reader, added to `params` once (`param_of`), or as
  // `load_operand` reads it where given. Records the task's output as
  // `value` in value_of.
  std::string chain_task(int t, const std::vector<Param>& ps, const Shape& domain, const std::string& value,
                         std::map<int, std::string>& value_of, std::map<int, std::string>& param_of,
                         std::vector<LaunchParam>& params, const OperandLoad& load_operand = {},
                         const std::string& indent = "    ") {
    const OpSignature& op = *p_.tasks[size_t(t)].op;
    const Param* result = nullptr;
    std::vector<std::string> operands;
    for (const auto& x : ps) {
      if (x.written) {
        result = &x;
      } else if (auto v = value_of.find(x.bound->buffer); v != value_of.end()) {
        operands.push_back(v->second);
      } else {
        auto [it, added] = param_of.emplace(x.bound->buffer, p_.tasks[size_t(t)].task->id + "_" + x.bound->name);
        if (added) params.push_back(LaunchParam{it->second, "const " + c_type(x.buffer->dtype), x.bound->buffer, nullptr, false});
        const std::string index = reads_own_element(op, x, domain) ? "i" : broadcast_index(domain, x.buffer->shape, "i");
        operands.push_back(load_operand ? load_operand(it->second, x, index)
                                        : load_element(it->second, x.buffer->dtype, index));
      }
    }
    value_of[result->bound->buffer] = value;
    return chain_statement(t, *result, std::move(operands), value, indent);
  }

  // Rule elementwise_prologue (fuse.h): the kernel's first task (a matmul,
  // a row op) reads operand k.prologue_operand as the chain k.prologue would
  // have stored it. A lambda, cg_prologue, computes its element i from the
  // chain's inputs (each at its own index or through its broadcast), rounded
  // to the operand's type as the chain's store would have; the skeleton's
  // load() of the operand calls it. Returns the chain's inputs, parameters
  // named after their tasks.
  std::vector<LaunchParam> elementwise_prologue(const KernelGroup& k) {
    const int operand = p_.tasks[size_t(k.tasks.front())].find_tensor(k.prologue_operand)->buffer;
    const BufferInfo& info = p_.buffers[size_t(operand)];
    std::map<int, std::string> value_of, param_of;
    std::vector<LaunchParam> launch;
    std::vector<std::string> tasks;
    std::string statements;
    for (size_t j = 0; j < k.prologue.size(); ++j) {
      const int t = k.prologue[j];
      const OpSignature& op = *p_.tasks[size_t(t)].op;
      template_files_.insert(op.source_file);
      use_function(op, op.source_function);
      tasks.push_back(fmt::format("{} ({})", p_.tasks[size_t(t)].task->id, op.name));
      statements += chain_task(t, params(t), info.shape, fmt::format("v{}", j), value_of, param_of, launch);
    }
    const std::string& value = value_of.at(operand);
    operand_prologue_ = fmt::format(
        "  // Prologue (elementwise_prologue): {}, element i of {} as the load of `{}` reads it.\n"
        "  auto cg_prologue = [&](cg_i64 i) {{\n{}    return {};\n  }};\n",
        fmt::join(tasks, ", "), buffer_name(operand), k.prologue_operand, statements,
        is_16bit(info.dtype) ? fmt::format("cg_widen(cg_narrow<{}>({}))", c_type(info.dtype), value) : value);
    return launch;
  }

  // The chain after a matmul or a row op (fuse.h: matmul_epilogue,
  // reduction_epilogue): a lambda the first task's skeleton calls where it
  // would store element i of "out", with the value in f32. The chain runs on
  // that element in registers and stores what is read outside the kernel.
  struct Epilogue {
    std::string code;                 // the lambda's definition
    std::vector<LaunchParam> params;  // what the chain reads from and stores to memory
    // The same chain on `vector_width` consecutive elements at once, each
    // tensor read and written with one access of at most 16 bytes
    // (cg_epilogue_vector), where every tensor allows it; 0 where not.
    std::string vector_code;
    int vector_width = 0;
  };

  // Which tasks of the kernel an epilogue runs, and what it is called.
  struct EpilogueSpan {
    size_t first = 1;                  // the kernel's first task of the chain (after the anchor)
    size_t last = SIZE_MAX;            // one past its last: the kernel's end
    std::string lambda = "cg_epilogue";
    std::string anchor_name;           // the anchor's parameter, where stored; empty: its slot's name
    // Where the chain's last value stays in the kernel rather than in memory
    // (rule matmul_chain: a statement storing `{}` into shared memory), and
    // the buffer it stands for; empty: nowhere.
    std::string keep;
    int kept_buffer = -1;
  };

  Epilogue epilogue(const KernelGroup& k, const Param& out) { return epilogue(k, out, EpilogueSpan{}); }
  Epilogue epilogue(const KernelGroup& k, const Param& out, const EpilogueSpan& span) {
    Epilogue e;
    const Shape& domain = out.buffer->shape;
    std::map<int, std::string> value_of = {{out.bound->buffer, "v0"}}, param_of;
    std::string statements, stores;
    auto stored = [&](int t, const Param& x, const std::string& value) {
      if (contains(k.internal_buffers, x.bound->buffer)) return;
      const std::string name = p_.tasks[size_t(t)].task->id + "_" + x.bound->name;
      e.params.push_back(LaunchParam{name, c_type(x.buffer->dtype), x.bound->buffer, nullptr, true});
      stores += fmt::format("    {};\n", store_element(name, x.buffer->dtype, "i", value));
    };
    std::vector<std::string> tasks;
    for (size_t j = span.first; j < std::min(span.last, k.tasks.size()); ++j) {
      const int t = k.tasks[j];
      const OpSignature& op = *p_.tasks[size_t(t)].op;
      template_files_.insert(op.source_file);
      use_function(op, op.source_function);
      tasks.push_back(fmt::format("{} ({})", p_.tasks[size_t(t)].task->id, op.name));
      const std::vector<Param> ps = params(t);
      if (!op.inverse.empty()) {  // rule permuted_store: the last task
        const Param& x = param(ps, "x");
        const Param& out_param = param(ps, "out");
        const std::string name = p_.tasks[size_t(t)].task->id + "_out";
        e.params.push_back(LaunchParam{name, c_type(out_param.buffer->dtype), out_param.bound->buffer, nullptr, true});
        stores += fmt::format("    {};  // {} ({}): where it moves element i\n",
                              store_element(name, out_param.buffer->dtype, permuted_index(t, x, out_param),
                                            value_of.at(x.bound->buffer)),
                              p_.tasks[size_t(t)].task->id, op.name);
        continue;
      }
      const std::string v = fmt::format("v{}", j);
      statements += chain_task(t, ps, domain, v, value_of, param_of, e.params);
      for (const auto& x : ps)
        if (x.written) stored(t, x, v);
    }
    std::string anchor_store;
    if (!contains(k.internal_buffers, out.bound->buffer))
      anchor_store = fmt::format("    {};\n", store_element(span.anchor_name.empty() ? out.bound->name : span.anchor_name,
                                                            out.buffer->dtype, "i", "v0"));
    if (!span.keep.empty()) stores += "    " + fmt::format(fmt::runtime(span.keep), value_of.at(span.kept_buffer)) + ";\n";
    e.code = fmt::format(
        "  // Epilogue ({}): {}, on element i of {} as it is computed.\n"
        "  auto {} = [&](cg_i64 i, float v0) {{\n{}{}{}  }};\n",
        to_string(k.rule), fmt::join(tasks, ", "), buffer_name(out.bound->buffer), span.lambda, anchor_store, statements, stores);
    if (span.first == 1 && span.last == SIZE_MAX && span.keep.empty() && span.anchor_name.empty())
      vector_epilogue(k, out, e);
    return e;
  }

  // Epilogue::vector_code for the chain of kernel k after `out` (a whole
  // matmul_epilogue chain): W elements from i, a multiple of W, where W is
  // 16 bytes of the widest tensor the chain touches (4 or 8 elements) and
  // divides the domain's rows; every input read at the element's own index
  // or through a broadcast of whole trailing axes (a bias: one vector at i %
  // n), or a single value. Otherwise (a permuted store, another broadcast,
  // 8-byte values) none: the skeleton calls the element-wise lambda.
  void vector_epilogue(const KernelGroup& k, const Param& out, Epilogue& e) {
    const Shape& domain = out.buffer->shape;
    int64_t widest = dtype_bytes(out.buffer->dtype);
    for (const LaunchParam& lp : e.params)
      if (lp.buffer >= 0) widest = std::max<int64_t>(widest, dtype_bytes(p_.buffers[size_t(lp.buffer)].dtype));
    if (widest > 4 || domain.empty()) return;
    const int width = int(16 / widest);
    if (domain.back() % width != 0) return;
    std::map<int, std::string> value_of = {{out.bound->buffer, "v0"}}, param_of;
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
    for (size_t j = 1; j < k.tasks.size() && vectorizable; ++j) {
      const int t = k.tasks[j];
      if (!p_.tasks[size_t(t)].op->inverse.empty()) return;
      const std::vector<Param> ps = params(t);
      const std::string v = fmt::format("v{}", j);
      statements += chain_task(t, ps, domain, v, value_of, param_of, unused, vector_load, "      ");
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
  std::string permuted_index(int t, const Param& x, const Param& out) {
    const OpSignature& inverse = *p_.registry.find(p_.tasks[size_t(t)].op->inverse);
    template_files_.insert(inverse.source_file);
    use_function(inverse, inverse.source_function);
    // split_heads and merge_heads: H, T, D from the [..., H, T, D] side, the one with more axes.
    const Shape& s = out.buffer->shape.size() > x.buffer->shape.size() ? out.buffer->shape : x.buffer->shape;
    const int64_t H = s[s.size() - 3], T = s[s.size() - 2], D = s.back();
    return fmt::format("{}(i, {}, {}, {})", inverse.source_function, T, H, D);
  }

  void record_launch(EmittedKernel& ek, std::vector<LaunchParam> launch) {
    locate_params(ek, launch);
    launch_params_.push_back(std::move(launch));
  }

  // A kernel's parameters' places in the arena (EmittedKernel::arg_offsets, ranges).
  void locate_params(EmittedKernel& ek, const std::vector<LaunchParam>& launch) {
    if (launch_grid(ek)[0] > kMaxGridX)
      fail(ek.tasks[0], "",
           fmt::format("kernel {} has {} x {} x {} tiles, more than the {} blocks a launch can have", ek.name,
                       ek.grid[0], ek.grid[1], ek.grid[2], kMaxGridX),
           "split the task into several (fewer batches or rows each)");
    for (const auto& lp : launch) {
      const auto [offset, bytes] = arena_range(lp);
      ek.arg_offsets.push_back(offset);
      ek.ranges.push_back(ArenaRange{offset, bytes, lp.written});
    }
  }

  // Rule elementwise_chain (fuse.h): one grid-stride loop over the elements;
  // each task's value is a local that the next tasks read, and only values
  // read outside the kernel are stored. Vectorised like a single elementwise
  // task where every tensor is read at the element's own index.
  std::string fused_elementwise(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
    EmittedKernel ek = emitted_kernel(k);
    auto internal = [&](int b) { return contains(k.internal_buffers, b); };
    struct Step {
      int task;
      std::vector<Param> ps;
      const Param* out = nullptr;
    };
    std::vector<Step> steps;
    steps.reserve(k.tasks.size());  // `out` points into each step's `ps`
    for (int t : k.tasks) {
      const OpSignature& op = *p_.tasks[size_t(t)].op;
      steps.push_back(Step{t, params(t)});
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
    std::map<int, std::string> param_of, value_of;  // buffer -> parameter; buffer -> local
    std::vector<std::pair<const Param*, std::string>> loads;  // reads from memory, with their index
    bool flat = true;
    int64_t widest = 1;
    for (const auto& step : steps) {
      const OpSignature& op = *p_.tasks[size_t(step.task)].op;
      for (const auto& x : step.ps) {
        widest = std::max<int64_t>(widest, dtype_bytes(x.buffer->dtype));
        if (x.written || value_of.count(x.bound->buffer) || param_of.count(x.bound->buffer)) continue;
        const std::string name = p_.tasks[size_t(step.task)].task->id + "_" + x.bound->name;
        param_of[x.bound->buffer] = name;
        inputs.push_back(LaunchParam{name, "const " + c_type(x.buffer->dtype), x.bound->buffer, nullptr});
        const bool same = reads_own_element(op, x, domain);
        flat = flat && same;
        loads.push_back({&x, same ? "i" : broadcast_index(domain, x.buffer->shape, "i")});
      }
      value_of[step.out->bound->buffer] = fmt::format("v{}", &step - steps.data());
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
      std::vector<std::string> operands;
      for (const auto& x : steps[j].ps)
        if (!x.written) {
          // An earlier task's value (the schedule puts producers first), else the element from memory.
          auto v = value_of.find(x.bound->buffer);
          operands.push_back(v != value_of.end() ? v->second : loaded[x.bound->buffer]);
        }
      if (operands.empty()) operands.push_back(index);
      statements += chain_statement(t, *steps[j].out, std::move(operands), fmt::format("v{}", j), indent);
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

  // Puts a function of the op (its entry function or a variant) and what it
  // calls into the generated file.
  void use_function(const OpSignature& op, const std::string& function) {
    if (const auto* closure = op.closure_of(function)) needed_.insert(closure->begin(), closure->end());
  }

  // An op that updates slots in place (an optimizer): each element of every
  // updated slot is loaded into a local, the function updates the locals
  // through its reference parameters, and they are stored back. An optional
  // updated slot the task leaves out gets a local that is dropped.
  std::string elementwise_in_place(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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
        before += fmt::format("    {} {}_local = 0;\n", compute_type(param.buffer->dtype), sig.name);
        operands.push_back(sig.name + "_local");
        continue;
      }
      n = std::max(n, numel(x->buffer->shape));
      if (element_type.empty()) element_type = compute_type(x->buffer->dtype);
      if (!sig.writes) {
        operands.push_back(load(*x, "i"));
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

  std::string elementwise(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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
    for (const auto& x : ps)
      if (!x.written) {
        // An elementwise op (not a broadcast one) reads element i of an input of
        // the output's size whatever its shape (reshape).
        const bool flat = op.pattern == PatternKind::elementwise && numel(x.buffer->shape) == numel(out->buffer->shape);
        operands.push_back(load(x, flat ? "i" : broadcast_index(out->buffer->shape, x.buffer->shape, "i")));
      }
    // An op with no input (fill, uniform) takes the element index first.
    if (operands.empty()) operands.push_back("i");
    append_arguments(t, operands);
    return grid_stride_loop(n, fmt::format("cg_store({}, i, {})", out->bound->name, apply(op, *out, operands)), ek);
  }

  // The op's function on its operands, in the output's compute type, narrowed
  // to a 16-bit output's storage type.
  static std::string apply(const OpSignature& op, const Param& out, const std::vector<std::string>& operands) {
    std::string value =
        fmt::format("{}<{}>({})", op.source_function, compute_type(out.buffer->dtype), fmt::join(operands, ", "));
    return is_16bit(out.buffer->dtype) ? fmt::format("cg_narrow<{}>({})", c_type(out.buffer->dtype), value) : value;
  }

  // Whether a fused task reads input x at the element's own index i of the
  // kernel's domain: an elementwise op reads element i of an input of the
  // domain's size whatever its shape (reshape); a broadcast op only an input
  // of the domain's shape.
  static bool reads_own_element(const OpSignature& op, const Param& x, const Shape& domain) {
    return op.pattern == PatternKind::elementwise ? numel(x.buffer->shape) == numel(domain) : x.buffer->shape == domain;
  }

  // One fused task as a statement: its value, a local `value` in the compute
  // type, from its operands (earlier values, loaded elements) and arguments.
  std::string chain_statement(int t, const Param& out, std::vector<std::string> operands, const std::string& value,
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
  static int vector_width(const OpSignature& op, const std::vector<Param>& ps, const Param& out, int64_t n) {
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
  std::string elementwise_vectorised(int t, const std::vector<Param>& ps, const Param& out, int64_t n, int width,
                                     EmittedKernel& ek) {
    const OpSignature& op = *p_.tasks[size_t(t)].op;
    std::string loads;
    std::vector<std::string> operands;
    for (const auto& x : ps)
      if (!x.written) {
        loads += fmt::format("    const cg_vector<{0}, {1}> {2}_v = cg_load_vector<{0}>({2}, i);\n", width,
                             c_type(x.buffer->dtype), x.bound->name);
        const std::string element = x.bound->name + "_v.v[k]";
        operands.push_back(is_16bit(x.buffer->dtype) ? "cg_widen(" + element + ")" : element);
      }
    if (operands.empty()) operands.push_back("i + k");
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

  // The op's arguments after its operands; a string argument as the index of its choice.
  void append_arguments(int t, std::vector<std::string>& operands) {
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
  bool check_f32_accumulation(int t, const Param& x) {
    if (x.buffer->dtype == DType::f32 || is_16bit(x.buffer->dtype)) return true;
    fail(t, x.bound->name,
         fmt::format("the {} template accumulates in f32, so a {} tensor would lose precision (f32, f16 and bf16 are "
                     "supported)",
                     p_.tasks[size_t(t)].op->name, to_string(x.buffer->dtype)));
    return false;
  }

  // What a hook reads (16-bit widened to f32) and how it stores an f32 value.
  // A load of the operand an elementwise prologue computes calls it instead.
  std::string load(const Param& x, const std::string& index) const { return load_as(x, x.bound->name, index); }
  // The same, through a parameter named `name`.
  std::string load_as(const Param& x, const std::string& name, const std::string& index) const {
    if (x.bound->buffer == prologue_buffer_) return fmt::format("cg_prologue({})", index);
    return load_element(name, x.buffer->dtype, index);
  }
  static std::string load_element(const std::string& name, DType dtype, const std::string& index) {
    return widen_from(dtype, fmt::format("cg_load({}, {})", name, index));
  }
  // A value of type `dtype` as the float the hooks compute in (16-bit
  // widened), and a float as a value of type `dtype` (16-bit narrowed).
  static std::string widen_from(DType dtype, const std::string& v) { return is_16bit(dtype) ? "cg_widen(" + v + ")" : v; }
  static std::string narrow_to(DType dtype, const std::string& v) {
    return is_16bit(dtype) ? fmt::format("cg_narrow<{}>({})", c_type(dtype), v) : v;
  }
  // A store of the buffer an epilogue follows becomes a call of the epilogue.
  std::string store(const Param& x, const std::string& index, const std::string& value) const {
    if (x.bound->buffer == epilogue_buffer_) return fmt::format("cg_epilogue({}, {})", index, value);
    return store_element(x.bound->name, x.buffer->dtype, index, value);
  }
  static std::string store_element(const std::string& name, DType dtype, const std::string& index,
                                   const std::string& value) {
    return fmt::format("cg_store({}, {}, {})", name, index, narrow_to(dtype, value));
  }

  // The launch of the block-per-row kernels: one block per row of the last
  // axis, whole warps up to 256 threads, 32 floats of reduction scratch.
  // Returns the row length.
  static int64_t one_block_per_row(const Shape& shape, EmittedKernel& ek) {
    const int64_t n = shape.back();
    ek.block = int(std::clamp<int64_t>((n + 31) / 32 * 32, 32, 256));
    ek.grid[0] = int(numel(shape) / n);
    reserve_shared(ek, "block reduction scratch (32 floats)", 32 * 4);
    return n;
  }

  std::string softmax(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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
  std::string row_reduce(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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
  std::string row_gradient(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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
  std::string max_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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

  std::string sum_leading(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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

  std::string log_softmax(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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

  std::string rmsnorm(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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
  std::string layernorm(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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
  std::string cross_entropy(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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
  std::string cross_entropy_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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
  std::string softmax_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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
  std::string norm_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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
  std::string embedding_backward(int, const std::vector<Param>& ps, EmittedKernel& ek) {
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
  std::string mse(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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
  std::string heads(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
    const BoundTask& bt = p_.tasks[size_t(t)];
    const Param& x = param(ps, "x");
    const Param& out = param(ps, "out");
    const bool split = is_op(bt, BundledOp::split_heads);
    const Shape& s = split ? out.buffer->shape : x.buffer->shape;  // [..., H, T, D]
    const int64_t H = s[s.size() - 3], T = s[s.size() - 2], D = s.back(), n = numel(out.buffer->shape);
    return grid_stride_loop(n, fmt::format("cg_store(out, i, cg_load(x, {}(i, {}, {}, {})))", bt.op->source_function, T, H, D),
                            ek);
  }

  // Where load_b(k, n) reads a [K, N] right operand, stored transposed or not.
  static std::string b_index(bool trans_b, int64_t K, int64_t N) {
    return trans_b ? fmt::format("(cg_i64)n * {} + k", K) : fmt::format("(cg_i64)k * {} + n", N);
  }
  // A matmul's accumulator `acc` times its alpha (once, where it is stored).
  std::string scaled_accumulator(int t) {
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
  std::string matmul_sum(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
    const MatmulSum sum = matmul_sum_terms(p_, k);
    const int first = k.tasks[sum.terms.front()];
    const std::vector<Param> last = params(k.tasks[sum.epilogue - 1]);
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
    for (size_t i = 0; i < sum.terms.size(); ++i) {
      const int t = k.tasks[sum.terms[i]];
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
      const bool last_term = i + 1 == sum.terms.size();
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
    const std::string name = p_.tasks[size_t(k.tasks[sum.epilogue - 1])].task->id + "_out";
    if (!contains(k.internal_buffers, out.bound->buffer)) add(name, out);
    if (sum.epilogue == k.tasks.size() && !contains(k.internal_buffers, out.bound->buffer)) {
      sink = store_element(name, out.buffer->dtype, fmt::format("(cg_i64)m * {} + n", N), value);
    } else if (sum.epilogue < k.tasks.size()) {
      Epilogue tail = epilogue(k, out, {.first = sum.epilogue, .anchor_name = name});
      if (!diags_.ok()) return {};
      launch.insert(launch.end(), tail.params.begin(), tail.params.end());
      tail_code = tail.code;
      sink = fmt::format("cg_epilogue((cg_i64)m * {} + n, {})", N, value);
    } else {
      fail(k.tasks[0], "", fmt::format("kernel {} computes a sum nothing reads", k.name),
           "an internal error of cudagen: please report it with the graph; --no-fuse-rule matmul_sum avoids it");
      return {};
    }
    std::vector<std::string> terms;
    for (size_t i : sum.terms) terms.push_back(p_.tasks[size_t(k.tasks[i])].task->id);
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
        tail_code, fmt::join(terms, " + "), K_total,
        tensor_cores ? "cg_matmul_tile_mma<64, 64, 16>" : "cg_matmul_tile<32, 32, 16>", load_a, load_b, sink, M, N,
        tensor_cores ? c_type(a_type) : "float");
    // A row of output tiles owns whole rows: of every term's `a`, of the sum,
    // of what the epilogue reads or stores at the sum's own element (the
    // megakernel waits for those rows only).
    ek.rows = M;
    ek.rows_per_tile = tile;
    ek.tiles_per_row_block = ek.grid[0];
    std::set<int> by_rows = {out.bound->buffer};
    for (size_t i : sum.terms) {
      const BoundTask& term = p_.tasks[size_t(k.tasks[i])];
      if (term.find_tensor("a")->buffer != term.find_tensor("b")->buffer) by_rows.insert(term.find_tensor("a")->buffer);
    }
    std::set<int> weights;  // (a term's b is read whole by every tile)
    for (size_t i : sum.terms) weights.insert(p_.tasks[size_t(k.tasks[i])].find_tensor("b")->buffer);
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
  std::string matmul_chain(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
    const size_t second = second_matmul(p_, k);
    const int t1 = k.tasks[0], t2 = k.tasks[second];
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
    const bool first_epilogue = second > 1 || !contains(k.internal_buffers, value.bound->buffer);
    if (first_epilogue) {
      first_tail = epilogue(k, out1, {.first = 1,
                                      .last = second,
                                      .lambda = "cg_value_epilogue",
                                      .anchor_name = id1 + "_out",
                                      .keep = fmt::format("cg_value[i - value_base] = {}", narrow_to(vt, "{}")),
                                      .kept_buffer = value.bound->buffer});
      keep = fmt::format("cg_value_epilogue((cg_i64)m * {} + n, {})", H, scaled_accumulator(t1));
    }
    std::string store_out = store_element(id2 + "_out", out2.buffer->dtype, fmt::format("(cg_i64)m * {} + n", N), scaled_accumulator(t2));
    if (second + 1 < k.tasks.size()) {
      second_tail = epilogue(k, out2, {.first = second + 1, .anchor_name = id2 + "_out"});
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
  std::string row_reduction(const KernelGroup& k, std::vector<EmittedKernel>& emitted) {
    const size_t first = first_row_reduction(p_, k);
    const int t = k.tasks[0];
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
    const BoundTask& first_reduction = p_.tasks[size_t(k.tasks[first])];
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
    for (size_t i = first; i < k.tasks.size(); ++i)
      if (const BoundTask& rt = p_.tasks[size_t(k.tasks[i])]; rt.op->pattern == PatternKind::matmul) {
        x_widths.push_back(p_.buffers[size_t(rt.find_tensor("out")->buffer)].shape.front());
        x_names.push_back(buffer_name(rt.find_tensor("a")->buffer));
      }
    const RowReductionShared smem = row_reduction_shared(a.buffer->dtype, vt, x_widths, buffer_name(value), x_names);
    use_shared(ek, smem.layout);
    const int64_t value_at = smem.value;

    // The epilogue ends in shared memory (and stores what is read elsewhere).
    Epilogue tail;
    std::string keep = fmt::format("cg_value[(m - cg_row0) * {} + n - cg_col0] = {}", tile, narrow_to(vt, scaled_accumulator(t)));
    if (first > 1 || !contains(k.internal_buffers, out.bound->buffer)) {
      tail = epilogue(k, out,
                      {.first = 1,
                       .last = first,
                       .anchor_name = id + "_out",
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
    for (size_t i = first; i < k.tasks.size(); ++i) {
      const int r = k.tasks[i];
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

  std::string matmul(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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
    // 16-bit operands (and f32 ones with --allow-tf32) whose rows are whole
    // 16-byte chunks, read as they are stored, run the pipelined mainloop
    // (docs/gemm.md) where the kernel is launched alone (a megakernel's or a
    // shared launch's block is another size); other f32 products of 2^24
    // FLOPs and more the SIMT mainloop.
    std::string why_not_pipelined =
        options_.megakernel ? "a megakernel's tiles share one block size" : "it shares its launch with other kernels";
    std::optional<GemmTile> pipelined;
    std::optional<SgemmTile> simt;
    const bool reads_as_stored =
        global_wrapper_ && prologue_task_ < 0 && prologue_buffer_ != a.bound->buffer && prologue_buffer_ != b.bound->buffer;
    if (reads_as_stored && (a.buffer->dtype != DType::f32 || options_.allow_tf32))
      pipelined = pipelined_gemm_tile_of(p_, t, options_.arch, &why_not_pipelined, options_.allow_tf32);
    if (reads_as_stored && !pipelined && a.buffer->dtype == DType::f32)
      simt = simt_gemm_tile_of(p_, t, options_.arch, &why_not_pipelined);
    if (!reads_as_stored && global_wrapper_) why_not_pipelined = "a prologue computes its operand";
    if (simt) return simt_matmul(t, a, b, out, *simt, M, N, K, ta, tb, batches, batch_bases, ek);
    if (pipelined)
      return pipelined_matmul(t, a, b, out, *pipelined, M, N, K, ta, tb, batches,
                              pipelined->split_k > 1 ? batch_bases_of(fmt::format("tile.z / {}", pipelined->split_k))
                                                     : batch_bases,
                              ek);
    // 16-bit operands go to the tensor-core tile (64 x 64, 4 warps), f32 ones
    // to the portable tile (32 x 32, 256 threads): f32 stays off tensor cores,
    // whose TF32 would break the f32 bound (docs/architecture.md §9).
    const OpSignature& op = *p_.tasks[size_t(t)].op;
    const DType tile_type = matmul_tile_dtype(op, a.buffer->dtype);
    const bool tensor_cores = is_16bit(tile_type);
    ek.mainloop = tensor_cores ? MatmulMainloop::tensor_core_tile : MatmulMainloop::portable_tile;
    ek.matmul_path = tensor_cores          ? "the 64 x 64 tile (templates/matmul.cuh): " + why_not_pipelined
                     : !is_op(op, BundledOp::matmul) ? fmt::format("the op's own function, {}: {}", op.source_function, why_not_pipelined)
                                           : "the portable f32 tile (templates/matmul.cuh): " + why_not_pipelined;
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

  // A matmul on the pipelined mainloop (templates/gemm.cuh): the block's
  // output tile is computed in registers, then each pair of adjacent
  // accumulators goes through the store (where an epilogue chain follows).
  std::string pipelined_matmul(int t, const Param& a, const Param& /*b*/, const Param& out, const GemmTile& g, int64_t M,
                               int64_t N, int64_t K, bool ta, bool tb, int64_t batches, const std::string& batch_bases,
                               EmittedKernel& ek) {
    entry_function_ = "cg_gemm_mainloop";
    use_function(*p_.tasks[size_t(t)].op, "cg_gemm_config");
    ek.block = g.threads();
    ek.min_blocks_per_sm = 1;  // the accumulators and fragments take most of the registers
    ek.grid[0] = (N + g.bn - 1) / g.bn;
    ek.grid[1] = (M + g.bm - 1) / g.bm;
    ek.grid[2] = batches * g.split_k;
    ek.tile_rows = g.bm;
    ek.mainloop = g.tf32() ? MatmulMainloop::pipelined_tf32 : MatmulMainloop::pipelined;
    ek.matmul_path = fmt::format("the pipelined mainloop (templates/gemm.cuh), {} (rule {} of templates/gemm_tuning.json)",
                                 g.describe(), g.rule + 1);
    reserve_shared(ek, fmt::format("{} stages of both operands' tiles", g.stages), g.shared_bytes());
    // f32 operands are read as cg_tf32, the bits the mainloop rounds to TF32
    // (a type of the mainloop's closure, through cg_mma_packed).
    const std::string type = g.tf32() ? "cg_tf32" : c_type(a.buffer->dtype);
    const std::string store_acc = store(out, fmt::format("out_base + m * {} + n", N), scaled_accumulator(t));
    // Whole, a block runs all of k and hands its tile to the store through
    // shared memory; split, its part of k, and the last block of the tile
    // adds the parts and stores.
    std::string part, k_range, k_begin = "0", k_end = std::to_string(K), results;
    if (g.split_k > 1) {
      use_function(*p_.tasks[size_t(t)].op, "cg_gemm_split_k");
      const int64_t k_per_split = g.k_tiles_per_split * g.bk;
      split_k_params_ = {
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
          M, N, g.split_k, g.split_k * M * N, ek.grid[1], ek.grid[0], store_acc);
    } else {
      results = staged_results("cg_gemm", t, out, M, N);
    }
    return fmt::format(
        "  CG_DYNAMIC_SMEM(cg_smem);\n"
        "{0}"
        "  // The pipelined mainloop: {1}{2}.\n"
        "{3}"
        "  typedef cg_gemm_config<{4}> cg_config;\n"
        "  cg_gemm_accumulators<cg_config> cg_acc;\n"
        "  cg_gemm_mainloop<cg_config, {5}, {6}, {7}>(cg_acc, (const {5}*)(a + a_base), {8}, (const {5}*)(b + b_base), {9},\n"
        "                                             {10}, {11}, {12}, {13}, tile.y, tile.x, ({5}*)cg_smem);\n"
        "{14}",
        batch_bases, g.describe(), part, k_range, g.arguments(), type, ta ? "false" : "true", tb ? "true" : "false",
        ta ? M : K, tb ? K : N, M, N, k_begin, k_end, results);
  }

  // An f32 matmul on the SIMT mainloop (templates/gemm.cuh): 8 x 8 outputs a
  // thread, the results through shared memory into the store (and an
  // epilogue chain) in an order that coalesces.
  std::string simt_matmul(int t, const Param& /*a*/, const Param& /*b*/, const Param& out, const SgemmTile& g, int64_t M,
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
  std::string staged_results(const std::string& mainloop, int t, const Param& out, int64_t M, int64_t N) {
    const OpSignature& op = *p_.tasks[size_t(t)].op;
    const bool chained = out.bound->buffer == epilogue_buffer_;
    const int own_width = int(16 / dtype_bytes(out.buffer->dtype));
    // (A user's matmul op may provide the mainloop without the vector walk.)
    const bool has_walk = op.closure_of(mainloop + "_each_coalesced_vector") != nullptr;
    const int width = !has_walk ? 0
                      : chained ? epilogue_vector_width_
                      : (own_width == 4 || own_width == 8) && N % own_width == 0 ? own_width
                                                                                 : 0;
    if (width == 0) {
      use_function(op, mainloop + "_each_coalesced");
      return fmt::format(
          "  // The output tile through shared memory, so that its stores (and an\n"
          "  // epilogue's loads) coalesce.\n"
          "  {0}_each_coalesced<cg_config>(cg_acc, {1}, {2}, tile.y, tile.x, (float*)cg_smem,\n"
          "      [&](cg_i64 m, cg_i64 n, float acc) {{ {3}; }});\n",
          mainloop, M, N, store(out, fmt::format("out_base + m * {} + n", N), scaled_accumulator(t)));
    }
    use_function(op, mainloop + "_each_coalesced_vector");
    std::string to;
    if (chained) {
      vector_epilogue_used_ = true;
      to = fmt::format("cg_epilogue_vector(out_base + m * {} + n, cg_v);", N);
    } else {
      to = fmt::format(
          "cg_vector<{0}, {1}> cg_out;\n"
          "        CG_UNROLL\n"
          "        for (int w = 0; w < {0}; ++w) cg_out.v[w] = {2};\n"
          "        cg_store_vector<{0}>({3}, out_base + m * {4} + n, cg_out);",
          width, c_type(out.buffer->dtype), narrow_to(out.buffer->dtype, "cg_v[w]"), out.bound->name, N);
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
        width, mainloop, M, N, scaled_accumulator(t), to);
  }

  // A kernel that computes a norm's output for itself (rules norm_prologue
  // and attention_projection) stores it, with its statistics, where it is
  // read later: from the blocks `owner` selects, once. The code storing rows
  // [row0, row0 + rows), K wide: `element` is element (r, j) of them, where
  // r = row0 + i / K, j = i % K; `stat_at(stat)` is local row r's statistic;
  // `end`, where not empty, the norm's row count (a tile may run past it).
  struct StoredNorm {
    int norm = -1;
    std::string owner, who;  // the blocks' condition, and who they are (for the comment)
    std::string row0;
    int64_t rows = 0, K = 0;
    std::string end;
    std::string element;
    std::vector<std::string> stats;  // those stored: "mean" (a layernorm's), "rstd"
    std::function<std::string(const std::string&)> stat_at;
  };
  std::string stored_norm_rows(const StoredNorm& n) const {
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

  // Rule norm_prologue: the code before a matmul's tile loop and its
  // operand load, for an `a` that rmsnorm or layernorm task prologue_task_
  // computes, in the unfused kernel's order of operations (a 16-bit `a` is
  // rounded as the norm would store it: the tensor-core tile narrows what
  // load_a returns). `a_index`: where load_a(m, k) would read `a`.
  struct NormLoad {
    std::string code, element;
  };
  NormLoad norm_load(int64_t M, int64_t K, int tile, const std::string& a_index, EmittedKernel& ek) {
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

  // concat: a grid-stride loop over the output; split: over the input.
  std::string concat_split(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
    const bool concat = is_op(p_.tasks[size_t(t)], BundledOp::concat);
    const int64_t A = param(ps, "a").buffer->shape.back(), B = param(ps, "b").buffer->shape.back();
    const int64_t n = numel(param(ps, concat ? "out" : "x").buffer->shape);
    return grid_stride_loop(n,
                            concat ? fmt::format("cg_store(out, i, cg_concat(a, b, i, {}, {}))", A, B)
                                   : fmt::format("cg_split(x, a, b, i, {}, {})", A, B),
                            ek);
  }

  std::string embedding(int, const std::vector<Param>& ps, EmittedKernel& ek) {
    const Param& table = param(ps, "table");
    const Param& ids = param(ps, "ids");
    const Param& out = param(ps, "out");
    const int64_t n = numel(out.buffer->shape), dim = table.buffer->shape.back();
    return grid_stride_loop(n,
                            fmt::format("cg_store(out, i, cg_embedding<{}, {}>(table, ids, i, {}))",
                                        c_type(table.buffer->dtype), c_type(ids.buffer->dtype), dim),
                            ek);
  }

  std::string transpose(int, const std::vector<Param>& ps, EmittedKernel& ek) {
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

  // conv2d (templates/vision.cuh): tile.z walks images and groups; the
  // tile form runs the implicit GEMM on the matmul tile, the direct form
  // (a GEMM too thin for a tile: depthwise) one output element per thread.
  // Stores go through store(), so an epilogue chain (bias, activation,
  // residual add) fuses as after a matmul.
  std::string conv2d(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
    const Param& x = param(ps, "x");
    const Param& weight = param(ps, "weight");
    const Param& out = param(ps, "out");
    const Param* bias = find_param(ps, "bias");
    const Shape& sx = x.buffer->shape;
    const Shape& sw = weight.buffer->shape;
    const Shape& so = out.buffer->shape;
    const int64_t groups = arg_int(t, "groups", 1);
    const int64_t B = sx[0], C = sx[1], H = sx[2], W = sx[3], O = sw[0], KH = sw[2], KW = sw[3], OH = so[2], OW = so[3];
    if (groups < 1 || O % groups != 0) {
      fail(t, "weight",
           fmt::format("{} output channels do not split into {} groups", O, groups),
           "the output channels (weight's first dimension) must be a multiple of groups, as in PyTorch");
      return {};
    }
    if (!args_at_least_one(t, {"stride_h", "stride_w", "dilation_h", "dilation_w"})) return {};
    const int64_t OG = O / groups, CG = C / groups, K = CG * KH * KW, positions = OH * OW;
    const std::string geometry = fmt::format(
        "  const cg_conv2d_geometry g = {{{}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}}};\n", C, H, W, O,
        OH, OW, KH, KW, arg_int(t, "stride_h", 1), arg_int(t, "stride_w", 1), arg_int(t, "padding_h", 0),
        arg_int(t, "padding_w", 0), arg_int(t, "dilation_h", 1), arg_int(t, "dilation_w", 1), groups);
    const std::string bias_term = bias ? " + " + load(*bias, "group * " + std::to_string(OG) + " + m") : "";
    const std::string hooks = fmt::format(
        "      [&](int m, int k) {{ return {}; }},\n"
        "      [&](int c, int h, int w) {{ return {}; }},\n",
        load(weight, fmt::format("w_base + (cg_i64)m * {} + k", K)),
        load(x, fmt::format("x_base + ((cg_i64)c * {} + h) * {} + w", H, W)));
    const std::string bases = fmt::format(
        "  const cg_i64 x_base = (image * {} + group * {}) * {}, w_base = group * {};\n", C, CG, H * W, OG * K);
    // A GEMM thinner than a tile in M, or shorter in K than one of its steps:
    // the direct form.
    if (OG < 8 || K < 16) {
      entry_function_ = "cg_conv2d_direct";
      const int64_t n = numel(so);
      ek.block = 256;
      ek.grid[0] = grid_stride_blocks(n, ek.block);
      ek.grid_stride = true;
      return geometry + fmt::format(
                            "  for (cg_i64 i = cg_global_thread(tile); i < {0}; i += cg_grid_threads(tile)) {{\n"
                            "    const int ow = (int)(i % {1}), oh = (int)(i / {1} % {2});\n"
                            "    const cg_i64 channel = i / {3} % {4}, image = i / ({3} * {4});\n"
                            "    const cg_i64 group = channel / {5};\n"
                            "    const int m = (int)(channel % {5});\n"
                            "  {6}"
                            "    const float acc = cg_conv2d_direct(\n{7}"
                            "        g, m, oh, ow);\n"
                            "    {8};\n"
                            "  }}\n",
                            n, OW, OH, positions, O, OG, bases, hooks, store(out, "i", "acc" + bias_term));
    }
    ek.block = 256;
    ek.grid[0] = int((positions + 31) / 32);
    ek.grid[1] = int((OG + 31) / 32);
    ek.grid[2] = int(B * groups);
    reserve_shared(ek, "the implicit GEMM's operand tiles", 4 * (32 * (16 + 1) + 16 * (32 + 1)));
    return "  CG_DYNAMIC_SMEM(cg_smem);\n" + geometry +
           fmt::format("  const cg_i64 image = tile.z / {0}, group = tile.z % {0};\n", groups) + bases +
           fmt::format("  const cg_i64 out_base = (image * {} + group * {}) * {};\n", O, OG, positions) +
           fmt::format(
               "  cg_conv2d_tile<32, 32, 16>(\n{}"
               "      [&](int m, int p, float acc) {{ {}; }},\n"
               "      g, tile.y, tile.x, (float*)cg_smem);\n",
               hooks, store(out, fmt::format("out_base + (cg_i64)m * {} + p", positions), "acc" + bias_term));
  }

  // max_pool2d, avg_pool2d: a grid-stride loop over the output; the template
  // gives each element's value.
  std::string pool2d(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
    const Param& x = param(ps, "x");
    const Param& out = param(ps, "out");
    const bool max = is_op(p_.tasks[size_t(t)], BundledOp::max_pool2d);
    const Shape& sx = x.buffer->shape;
    const Shape& so = out.buffer->shape;
    if (!args_at_least_one(t, {"stride_h", "stride_w", "kernel_h", "kernel_w"})) return {};
    const std::string window = fmt::format(
        "  const cg_pool2d_window p = {{{}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}}};\n", sx[sx.size() - 2],
        sx.back(), so[so.size() - 2], so.back(), arg_int(t, "kernel_h", 1), arg_int(t, "kernel_w", 1),
        arg_int(t, "stride_h", 1), arg_int(t, "stride_w", 1), arg_int(t, "padding_h", 0), arg_int(t, "padding_w", 0),
        arg_int(t, "dilation_h", 1), arg_int(t, "dilation_w", 1));
    const std::string value = max ? std::string("cg_max_pool2d(x, i, p)")
                                  : fmt::format("cg_avg_pool2d(x, i, p, {})",
                                                arg_bool(t, "count_include_pad") ? "true" : "false");
    return window + grid_stride_loop(numel(so), store(out, "i", value), ek);
  }

  std::string adaptive_avg_pool2d(int, const std::vector<Param>& ps, EmittedKernel& ek) {
    const Param& x = param(ps, "x");
    const Param& out = param(ps, "out");
    const Shape& sx = x.buffer->shape;
    const Shape& so = out.buffer->shape;
    return grid_stride_loop(numel(so),
                            store(out, "i",
                                  fmt::format("cg_adaptive_avg_pool2d(x, i, {}, {}, {}, {})", sx[sx.size() - 2],
                                              sx.back(), so[so.size() - 2], so.back())),
                            ek);
  }

  // permute: checks `dims` against the shapes (the shape rule cannot say
  // "out is x permuted"), then a grid-stride loop over the output.
  std::string permute(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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
  std::string slice(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
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

  static int default_megakernel_blocks(const std::string& arch) {
    if (arch == "sm_90" || arch == "sm_90a") return 132;  // H100 SXM, H200
    if (arch == "sm_80") return 108;                       // A100
    return 80;
  }

  // With --megakernel (docs/architecture.md §10): the kernels emitted so far become the
  // tile functions of one persistent kernel per phase, which runs the
  // schedule of megakernel.h from constant tables. Their event counters and
  // watchdog reports take a region after the plan's arena.
  // Sizes split-K's workspace (split_k_) for the largest product that may
  // take it: a kernel launched alone whose first task is a matmul on the
  // pipelined mainloop with a split (emit_kernel's matmul decides the same;
  // where it does not take the mainloop, the workspace is only larger than
  // needed).
  void plan_split_k_workspace(const std::vector<KernelGroup>& kernels) {
    for (size_t i = 0; i < kernels.size(); ++i) {
      const int t = kernels[i].tasks[0];
      if (p_.tasks[size_t(t)].op->pattern != PatternKind::matmul || !alone_in_launch(kernels, i)) continue;
      const std::optional<GemmTile> g = pipelined_gemm_tile_of(p_, t, options_.arch, nullptr, options_.allow_tf32);
      if (!g || g->split_k < 2) continue;
      const MatmulDims d = matmul_dims(p_, t);
      const int64_t tiles = (d.M + g->bm - 1) / g->bm * ((d.N + g->bn - 1) / g->bn) * d.batches;
      split_k_.partials_bytes = std::max(split_k_.partials_bytes, d.batches * g->split_k * d.M * d.N * 4);
      split_k_.arrivals_bytes = std::max(split_k_.arrivals_bytes, tiles * 4);
    }
    // Split-KV's (flash_attention) in the same workspace: no two kernels use it at once.
    for (size_t i = 0; i < kernels.size(); ++i) {
      const KernelGroup& k = kernels[i];
      if (k.rule != FusionRule::attention || k.tasks.size() < 3 || attention_scores(p_, k) != 0 ||
          !alone_in_launch(kernels, i))
        continue;
      const std::optional<FlashAttentionTile> tile =
          flash_attention_tile_of(p_, k.tasks[0], k.tasks[1], false, nullptr, options_.arch, k.flash_trained);
      if (!tile || tile->splits < 2) continue;
      const Shape& q = p_.buffers[size_t(p_.tasks[size_t(k.tasks[0])].find_tensor("a")->buffer)].shape;
      const int64_t Tq = q[q.size() - 2], heads = numel(q) / (Tq * q.back()), m_tiles = (Tq + tile->block_m - 1) / tile->block_m;
      split_k_.partials_bytes = std::max(split_k_.partials_bytes, tile->partial_floats(heads, m_tiles) * 4);
      split_k_.arrivals_bytes = std::max(split_k_.arrivals_bytes, heads * m_tiles * 4);
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

  // Whether kernel `k` runs flash attention's backward kernel in the atomic
  // mode: asked for, dq and a key or value gradient present, heads of up to
  // 64 (square tiles); then the f32 sums of dq over all its heads and their
  // query tiles.
  bool flash_backward_atomic(const KernelGroup& k, int64_t* dq_floats = nullptr, int64_t* query_tiles = nullptr) const {
    if (!options_.atomic_attention_backward || !k.flash_trained || k.rule != FusionRule::attention_backward) return false;
    const AttentionGradient g = attention_gradient(p_, k);
    if (g.dq == AttentionGradient::none || (g.dk == AttentionGradient::none && g.dv == AttentionGradient::none))
      return false;
    auto task = [&](size_t at) { return at == AttentionGradient::none ? -1 : k.tasks[at]; };
    FlashTraining roles{.dp = task(g.dp), .ds = task(g.ds), .dq = task(g.dq), .dk = task(g.dk), .dv = task(g.dv)};
    const std::optional<FlashAttentionTile> tile = flash_backward_tile_of(p_, roles, false, nullptr, options_.arch, true);
    if (!tile || tile->block_n != tile->block_m) return false;
    const Shape& dq = p_.buffers[size_t(p_.tasks[size_t(k.tasks[g.dq])].find_tensor("out")->buffer)].shape;
    const int64_t Tq = dq[dq.size() - 2], heads = numel(dq) / (Tq * dq.back());
    if (dq_floats != nullptr) *dq_floats = heads * Tq * tile->head_d;
    if (query_tiles != nullptr) *query_tiles = heads * ((Tq + tile->block_n - 1) / tile->block_n);
    return true;
  }

  // Places flash_statistics_ after the plan: each trained attention's own
  // (the forward and the backward phase are apart: nothing shares them).
  void plan_flash_statistics(const std::vector<KernelGroup>& kernels) {
    int64_t at = align_up(plan_.arena_bytes, plan_.alignment);
    for (const KernelGroup& k : kernels) {
      if (!k.flash_trained || k.rule != FusionRule::attention) continue;
      const BufferInfo& q = p_.buffers[size_t(p_.tasks[size_t(k.tasks[0])].find_tensor("a")->buffer)];
      const BufferInfo& v = p_.buffers[size_t(p_.tasks[size_t(k.tasks[2])].find_tensor("b")->buffer)];
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
      flash_statistics_[k.tasks[1]] = f;
    }
    flash_statistics_end_ = flash_statistics_.empty() ? 0 : at;
  }

  std::string megakernels(EmittedProgram& out) {
    MegakernelOptions mo;
    mo.blocks = options_.megakernel_blocks > 0 ? options_.megakernel_blocks : default_megakernel_blocks(options_.arch);
    mo.break_schedule = options_.megakernel_break_schedule;
    out.megakernel_watchdog_ms = options_.megakernel_watchdog_ms;
    out.megakernel = schedule_megakernel(out.tile_kernels, mo);
    out.sync_offset = plan_.arena_bytes;
    int64_t cursor = out.sync_offset;
    std::string code;
    for (const MegakernelPhase& mp : out.megakernel) {
      const int64_t state = cursor, events = cursor + kMegakernelStateBytes;
      cursor = align_up(events + 8 * int64_t(mp.events.size()), kMegakernelStateBytes);
      out.megakernel_state_offsets.push_back(state);
      code += megakernel(mp, out.tile_kernels, state, events, out.kernels);
    }
    out.sync_bytes = align_up(cursor - out.sync_offset, plan_.alignment);
    arena_bytes_ = out.arena_bytes = plan_.arena_bytes + out.sync_bytes;
    return code;
  }

  static int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

  std::string megakernel(const MegakernelPhase& mp, const std::vector<EmittedKernel>& tile_kernels, int64_t state,
                         int64_t events, std::vector<EmittedKernel>& emitted) {
    EmittedKernel mk;
    mk.name = "megakernel_" + std::string(to_string(mp.phase));
    mk.phase = mp.phase;
    mk.grid[0] = mp.blocks;
    mk.block = mp.threads;
    mk.smem_bytes = mp.smem_bytes;
    mk.arg_offsets = {0};
    mk.cooperative = true;
    for (int k : mp.kernels) {
      const EmittedKernel& tk = tile_kernels[size_t(k)];
      mk.tasks.insert(mk.tasks.end(), tk.tasks.begin(), tk.tasks.end());
      mk.bytes_read += tk.bytes_read;
      mk.bytes_written += tk.bytes_written;
      if (tk.flops >= 0) mk.flops = std::max<int64_t>(mk.flops, 0) + tk.flops;
      mk.ranges.insert(mk.ranges.end(), tk.ranges.begin(), tk.ranges.end());
    }
    int joins = 0;
    for (const auto& t : mp.tasks) joins += t.kernel < 0;
    const std::string P = mk.name;
    std::string code = fmt::format(
        "// ---- {} phase as one persistent kernel (docs/architecture.md §10) ----\n"
        "// {} kernels as {} tile tasks and {} join tasks on {} blocks of {} threads; {} events.\n"
        "// Critical path {} tasks; blocks idle an estimated {:.0f}% of the phase. Block b runs tasks\n"
        "// [{P}_queue[b], {P}_queue[b + 1]) in order; `cudagen describe --megakernel` prints them.\n"
        "// Events count in the arena at {}, this phase's watchdog report at {}.\n",
        to_string(mp.phase), mp.kernels.size(), mp.tasks.size() - size_t(joins), joins, mp.blocks, mp.threads,
        mp.events.size(), mp.critical_path_tasks, 100.0 * mp.idle_fraction, events, state, fmt::arg("P", P));
    code += fmt::format("static __device__ const int {}_queue[{}] = {{{}}};\n", P, mp.queue_begin.size(),
                        fmt::join(mp.queue_begin, ", "));
    code += fmt::format("// {{kernel (the switch's case; -1: join), tile, wait event, its triggers per launch, trigger event}}\n"
                        "static __device__ const cg_megakernel_task {}_tasks[{}] = {{\n",
                        P, std::max<size_t>(mp.tasks.size(), 1));
    for (int b = 0; b < mp.blocks; ++b) {
      const int begin = mp.queue_begin[size_t(b)], end = mp.queue_begin[size_t(b) + 1];
      if (begin == end) continue;
      std::vector<std::string> row;
      for (int q = begin; q < end; ++q) {
        const MegakernelTask& t = mp.tasks[size_t(q)];
        row.push_back(fmt::format("{{{}, {}, {}, {}, {}}}", t.kernel, t.tile, t.wait, t.wait_count, t.trigger));
      }
      code += fmt::format("    // block {}\n", b);
      for (size_t i = 0; i < row.size(); i += 6)
        code += fmt::format("    {},\n", fmt::join(row.begin() + long(i), row.begin() + long(std::min(row.size(), i + 6)), ", "));
    }
    if (mp.tasks.empty()) code += "    {-1, 0, -1, 0, -1},\n";
    code += "};\n";
    code += fmt::format(
        "CG_KERNEL void __launch_bounds__({0}) {1}(unsigned char* arena) {{\n"
        "  cg_megakernel_state* state = (cg_megakernel_state*)(arena + {2});\n"
        "  unsigned long long* events = (unsigned long long*)(arena + {3});\n"
        "  const unsigned long long launch = cg_megakernel_launch(state);\n"
        "  for (int q = {1}_queue[blockIdx.x]; q < {1}_queue[blockIdx.x + 1]; ++q) {{\n"
        "    const cg_megakernel_task task = {1}_tasks[q];\n"
        "    if (!cg_megakernel_wait(state, events, task, q, launch, {4}ull)) break;  // the watchdog stopped the phase\n"
        "    switch (task.kernel) {{\n",
        mp.threads, P, state, events, uint64_t(options_.megakernel_watchdog_ms) * 1000000ull);
    for (int k : mp.kernels) {
      const EmittedKernel& tk = tile_kernels[size_t(k)];
      std::vector<std::string> args;
      for (size_t a = 0; a < launch_params_[size_t(k)].size(); ++a)
        args.push_back(fmt::format("({}*)(arena + {})", launch_params_[size_t(k)][a].pointee, tk.arg_offsets[a]));
      const int64_t tiles = megakernel_tiles(tk, mp.blocks);
      args.push_back(fmt::format("cg_tile_of(task.tile, {}, {})", tk.grid_stride ? tiles : tk.grid[0], tk.grid[1]));
      code += fmt::format("      case {}:\n        {}_tile({});\n        break;\n", k, tk.name, fmt::join(args, ", "));
    }
    code += "    }\n    cg_megakernel_trigger(events, task);\n  }\n  cg_megakernel_exit(state);\n}\n\n";
    emitted.push_back(std::move(mk));
    return code;
  }

  std::string header() const {
    return fmt::format(
        "// Generated by cudagen {} from graph '{}' (hash {:016x}); do not edit.\n"
        "// Options: {}\n"
        "// One standalone file: NVRTC compiles the device part; nvcc (ahead of time) and the host\n"
        "// emulation also compile the launchers under #ifndef __CUDACC_RTC__ at the end.\n"
        "// Arena: {} bytes (lower bound {}, without reuse {}){}.\n\n",
        CUDAGEN_VERSION, comment_text(p_.graph.name), fnv1a64(write_graph(p_.graph) + options_.options_text),
        comment_text(options_.options_text),
        arena_bytes_, plan_.lower_bound, plan_.no_reuse_bytes,
        plan_.scalars.empty() ? ""
                              : fmt::format("; the {} bytes at {} hold {} run-time argument(s), the runtime writes them",
                                            plan_.scalars_bytes, plan_.scalars_offset, plan_.scalars.size()));
  }

  // The prelude, then exactly the template definitions the kernels' ops
  // need (their closures, as the indexer found them), in the registry's
  // order, where what a definition uses comes first.
  std::string prelude_and_templates() const {
    std::string out = "// ---- device prelude (templates/prelude.cuh) ----\n";
    out += embedded_template("prelude.cuh");
    if (!p_.registry.definitions().empty()) {
      out += "\n// ---- templates: what the kernels below use ----\n";
      out += template_definitions(p_.registry, needed_);
      return out + "\n// ---- kernels ----\n\n";
    }
    // A hand-written registry (--registry) names files only: copy them whole.
    for (const auto& file : template_files_) {
      out += fmt::format("\n// ---- templates/{} ----\n", file);
      out += embedded_template(file);
    }
    return out + "\n// ---- kernels ----\n\n";
  }

  // Per megakernel, every tensor its tile functions touch (once), for the
  // emulator's bounds checks.
  std::string megakernel_tensors(const EmittedProgram& program) const {
    std::string out;
    for (size_t m = 0; m < program.megakernel.size(); ++m) {
      out += fmt::format("static const cudagen_tensor_info {}_tensors[] = {{\n", program.kernels[m].name);
      std::set<std::pair<int64_t, int64_t>> seen;  // {offset, bytes}: each once
      for (int k : program.megakernel[m].kernels) {
        const std::vector<LaunchParam>& params = launch_params_[size_t(k)];
        const std::vector<ArenaRange>& ranges = program.tile_kernels[size_t(k)].ranges;  // parallel to params
        // Named by the buffer: the tile functions reach the same one through different slots.
        for (size_t a = 0; a < params.size(); ++a)
          if (seen.insert({ranges[a].offset, ranges[a].bytes}).second) out += tensor_info_row(launch_name(params[a]), params[a]);
      }
      out += "};\n";
    }
    return out;
  }

  // A launch parameter's name outside its kernel: the buffer's, or the run-time argument's.
  std::string launch_name(const LaunchParam& lp) const {
    return lp.scalar != nullptr ? lp.scalar->name(p_) : lp.buffer < 0 ? lp.name : buffer_name(lp.buffer);
  }

  // One entry of a cudagen_tensor_info table (the emulator's bounds checks).
  std::string tensor_info_row(const std::string& slot, const LaunchParam& lp) const {
    if (lp.scalar != nullptr)
      return fmt::format("    {{\"{}\", \"{}\", {}ull, {}ull}},  // run-time argument\n", slot, launch_name(lp),
                         lp.scalar->offset, kScalarBytes);
    const auto [offset, bytes] = arena_range(lp);
    return fmt::format("    {{\"{}\", \"{}\", {}ull, {}ull}},{}\n", slot, launch_name(lp), offset, bytes,
                       lp.buffer < 0 ? "  // workspace" : "");
  }

  std::string host_side(const EmittedProgram& program) const {
    const std::vector<EmittedKernel>& kernels = program.kernels;  // what the launchers launch
    std::string out =
        "#ifndef __CUDACC_RTC__\n"
        "// ---- host launchers: one per phase; each tensor is arena + OFFSET from the memory plan ----\n"
        "#ifndef CUDAGEN_TENSOR_INFO_DEFINED  // the host emulation defines it too\n"
        "struct cudagen_tensor_info {\n"
        "  const char* slot;\n"
        "  const char* buffer;\n"
        "  unsigned long long offset;\n"
        "  unsigned long long bytes;\n"
        "};\n"
        "#endif\n"
        "#ifndef CUDAGEN_LAUNCH  // nvcc; the host emulation defines its own\n"
        "#define CUDAGEN_LAUNCH(kernel, grid, block, smem, tensors, ...)       \\\n"
        "  do {                                                               \\\n"
        "    (void)tensors; /* for the emulator's bounds checks */            \\\n"
        "    /* above 48 KiB a kernel must opt in to its dynamic shared memory */ \\\n"
        "    if ((smem) > 48 * 1024)                                          \\\n"
        "      if (cudaError_t cudagen_error = cudaFuncSetAttribute(kernel,   \\\n"
        "              cudaFuncAttributeMaxDynamicSharedMemorySize, (smem)))  \\\n"
        "        return (int)cudagen_error;                                   \\\n"
        "    kernel<<<grid, block, smem, stream>>>(__VA_ARGS__);              \\\n"
        "    if (cudaError_t cudagen_error = cudaGetLastError()) return (int)cudagen_error; \\\n"
        "  } while (0)\n"
        "#endif\n";
    if (options_.megakernel)
      out +=
          "#ifndef CUDAGEN_LAUNCH_COOPERATIVE  // nvcc: all blocks resident at once\n"
          "#define CUDAGEN_LAUNCH_COOPERATIVE(kernel, grid, block, smem, tensors, arena_pointer)                 \\\n"
          "  do {                                                                                       \\\n"
          "    (void)tensors;                                                                           \\\n"
          "    unsigned char* cudagen_arena = arena_pointer;                                            \\\n"
          "    void* cudagen_args[] = {&cudagen_arena};                                                 \\\n"
          "    if ((smem) > 48 * 1024)                                                                  \\\n"
          "      cudaFuncSetAttribute((const void*)kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(smem)); \\\n"
          "    if (cudaError_t cudagen_error = cudaLaunchCooperativeKernel((const void*)kernel, grid, block, cudagen_args, \\\n"
          "                                                                (smem), stream))             \\\n"
          "      return (int)cudagen_error;                                                             \\\n"
          "  } while (0)\n"
          "#endif\n";
    out += "\n";
    out += fmt::format("extern \"C\" const unsigned long long {}_arena_bytes = {}ull;\n\n", options_.symbol_prefix,
                       arena_bytes_);
    for (size_t i = 0; i < kernels.size() && !options_.megakernel; ++i) {
      out += fmt::format("static const cudagen_tensor_info {}_tensors[] = {{\n", kernels[i].name);
      for (const auto& lp : launched_params_[i]) out += tensor_info_row(lp.name, lp);
      out += "};\n";
    }
    if (options_.megakernel) out += megakernel_tensors(program);
    for (Phase phase : {Phase::init, Phase::forward, Phase::backward, Phase::update}) {
      bool any = false;
      for (const auto& k : kernels) any = any || k.phase == phase;
      if (!any) continue;
      out += fmt::format("\nextern \"C\" int {}(unsigned char* arena, cudaStream_t stream) {{\n",
                         phase_function(phase, options_.symbol_prefix));
      if (options_.megakernel) {
        for (const EmittedKernel& mk : program.kernels)
          if (mk.phase == phase)
            out += fmt::format("  CUDAGEN_LAUNCH_COOPERATIVE({0}, dim3({1}), dim3({2}), {3}, {0}_tensors, arena);\n",
                               mk.name, mk.grid[0], mk.block, mk.smem_bytes);
        out += "  return 0;\n}\n";
        continue;
      }
      for (size_t i = 0; i < kernels.size(); ++i) {
        if (kernels[i].phase != phase) continue;
        const EmittedKernel& ek = kernels[i];
        std::vector<std::string> args;
        for (size_t a = 0; a < launched_params_[i].size(); ++a)
          args.push_back(fmt::format("({}*)(arena + {})", launched_params_[i][a].pointee, ek.arg_offsets[a]));
        const auto grid = launch_grid(ek);
        out += fmt::format("  CUDAGEN_LAUNCH({}, dim3({}, {}, {}), dim3({}), {}, {}_tensors,\n                 {});\n", ek.name,
                           grid[0], grid[1], grid[2], ek.block, ek.smem_bytes, ek.name, fmt::join(args, ", "));
      }
      out += "  return 0;\n}\n";
    }
    if (options_.step_function) {
      out += fmt::format("\n// One training step: forward, backward, update.\nextern \"C\" int {}(unsigned char* arena, cudaStream_t stream) {{\n",
                         step_function());
      for (Phase phase : {Phase::forward, Phase::backward, Phase::update}) {
        bool any = false;
        for (const auto& k : kernels) any = any || k.phase == phase;
        if (any)
          out += fmt::format("  if (int error = {}(arena, stream)) return error;\n",
                             phase_function(phase, options_.symbol_prefix));
      }
      out += "  return 0;\n}\n";
    }
    return out + "#endif  // __CUDACC_RTC__\n";
  }

  std::string manifest(const EmittedProgram& program) const {
    const std::vector<EmittedKernel>& kernels = program.kernels;
    std::string out = "{\n  \"format\": \"cudagen.manifest/1\",\n";
    out += fmt::format("  \"graph\": {},\n", json_quote(p_.graph.name));
    out += fmt::format("  \"graph_hash\": \"{:016x}\",\n", fnv1a64(write_graph(p_.graph) + options_.options_text));
    out += fmt::format("  \"cudagen_version\": \"{}\",\n", CUDAGEN_VERSION);
    out += fmt::format("  \"arch\": {},\n", json_quote(options_.arch));
    out += fmt::format("  \"options\": {},\n", json_quote(options_.options_text));
    out += fmt::format("  \"arena_bytes\": {},\n  \"lower_bound_bytes\": {},\n", arena_bytes_, plan_.lower_bound);
    out += "  \"phases\": [";
    bool first_phase = true;
    for (Phase phase : {Phase::init, Phase::forward, Phase::backward, Phase::update}) {
      std::vector<std::string> names;
      for (const auto& k : kernels)
        if (k.phase == phase) names.push_back(json_quote(k.name));
      if (names.empty()) continue;
      out += fmt::format("{}\n    {{\"phase\": \"{}\", \"function\": \"{}\", \"kernels\": [{}]}}", first_phase ? "" : ",",
                         to_string(phase), phase_function(phase, options_.symbol_prefix), fmt::join(names, ", "));
      first_phase = false;
    }
    if (options_.step_function)
      out += fmt::format(",\n    {{\"phase\": \"step\", \"function\": \"{}\", \"runs\": [\"forward\", \"backward\", \"update\"]}}",
                         step_function());
    out += "\n  ],\n  \"kernels\": [";
    // The performance model's estimate of each (perf_model.h), recorded
    // before any GPU runs it.
    std::vector<KernelEstimate> model;
    for (const EmittedKernel& k : kernels) model.push_back(estimate_kernel(k, device_model(options_.arch)));
    for (size_t i = 0; i < kernels.size(); ++i) {
      const EmittedKernel& k = kernels[i];
      std::vector<std::string> tasks;
      for (int t : k.tasks) tasks.push_back(json_quote(p_.tasks[size_t(t)].task->id));
      out += fmt::format(
          "{}\n    {{\"name\": \"{}\", \"phase\": \"{}\", \"tasks\": [{}], \"grid\": [{}, {}, {}], \"block\": {}, "
          "\"smem_bytes\": {}, \"bytes_read\": {}, \"bytes_written\": {}, \"flops\": {}, \"arg_offsets\": [{}]{}, "
          "\"model\": {{\"bound\": \"{}\", \"blocks_per_sm\": {}, \"waves\": {}, \"predicted_us\": {:.3f}}}}}",
          i ? "," : "", k.name, to_string(k.phase), fmt::join(tasks, ", "), launch_grid(k)[0], launch_grid(k)[1],
          launch_grid(k)[2], k.block,
          k.smem_bytes, k.bytes_read, k.bytes_written, k.flops < 0 ? std::string("null") : std::to_string(k.flops),
          fmt::join(k.arg_offsets, ", "), k.cooperative ? ", \"cooperative\": true" : "", model[i].bound,
          model[i].blocks_per_sm, model[i].waves, model[i].seconds * 1e6);
    }
    if (options_.megakernel) {
      out += fmt::format("\n  ],\n  \"megakernel\": {{\"sync_offset\": {}, \"sync_bytes\": {}, \"phases\": [",
                         program.sync_offset, program.sync_bytes);
      for (size_t m = 0; m < program.megakernel.size(); ++m) {
        const MegakernelPhase& mp = program.megakernel[m];
        std::vector<std::string> names, events;
        for (int k : mp.kernels) names.push_back(json_quote(program.tile_kernels[size_t(k)].name));
        for (const auto& e : mp.events) events.push_back(fmt::format("{{\"what\": {}, \"triggers\": {}}}", json_quote(e.what), e.triggers));
        out += fmt::format(
            "{}\n    {{\"kernel\": \"{}\", \"phase\": \"{}\", \"blocks\": {}, \"tasks\": {}, \"state_offset\": {}, "
            "\"critical_path_tasks\": {}, \"tile_kernels\": [{}], \"events\": [{}]}}",
            m ? "," : "", program.kernels[m].name, to_string(mp.phase), mp.blocks, mp.tasks.size(),
            program.megakernel_state_offsets[m], mp.critical_path_tasks, fmt::join(names, ", "), fmt::join(events, ", "));
      }
      out += "]}";
      out += ",\n  \"scalars\": [";
    } else {
      out += "\n  ],\n  \"scalars\": [";
    }
    for (size_t i = 0; i < plan_.scalars.size(); ++i) {
      const PlannedScalar& sc = plan_.scalars[i];
      out += fmt::format("{}\n    {{\"name\": \"{}\", \"type\": \"{}\", \"offset\": {}, \"bytes\": {}, \"initial\": {}}}",
                         i ? "," : "", sc.name(p_), to_string(sc.type), sc.offset, kScalarBytes,
                         arg_value_to_string(sc.initial));
    }
    out += plan_.scalars.empty() ? "],\n  \"buffers\": [" : "\n  ],\n  \"buffers\": [";
    for (size_t b = 0; b < p_.buffers.size(); ++b) {
      const BufferInfo& bi = p_.buffers[b];
      const PlannedBuffer& pb = plan_.buffers[b];
      out += fmt::format(
          "{}\n    {{\"name\": \"{}\", \"dtype\": \"{}\", \"shape\": [{}], \"storage\": \"{}\", \"offset\": {}, \"bytes\": "
          "{}{}}}",
          b ? "," : "", buffer_name(int(b)), to_string(bi.dtype), fmt::join(bi.shape, ", "), to_string(bi.storage),
          pb.offset, pb.bytes,
          pb.internal ? fmt::format(", \"in_registers_of\": \"{}\"", program.tile_kernels[size_t(pb.first)].name)
                      : "");
    }
    out += "\n  ]\n}\n";
    return out;
  }

  const Program& p_;
  const Plan& plan_;
  int epilogue_buffer_ = -1;  // while a skeleton runs: the buffer whose stores call cg_epilogue
  int epilogue_vector_width_ = 0;     // and the width of its cg_epilogue_vector, 0 for none
  bool vector_epilogue_used_ = false;  // whether the skeleton calls cg_epilogue_vector
  int prologue_task_ = -1;    // while a matmul's runs: the norm it loads its `a` through, or -1
  bool prologue_stores_ = false;  // and whether this kernel stores the norm's output and statistics
  std::string operand_prologue_;  // while a kernel is emitted: its elementwise prologue's lambda, or empty
  int prologue_buffer_ = -1;      // while its skeleton runs: the operand that lambda computes (load() calls it)
  const EmitOptions& options_;
  Diagnostics diags_;
  std::set<std::string> template_files_;
  std::string entry_function_;     // the template function the kernel being emitted calls
  std::set<std::string> needed_;  // definition ids: the closures of every kernel's entry function
  std::vector<std::vector<LaunchParam>> launch_params_;  // per kernel group emitted, in order
  // Per launched kernel (EmittedProgram::kernels without --megakernel): its
  // parameters, a batched launch's named after the kernel that takes them.
  std::vector<std::vector<LaunchParam>> launched_params_;
  bool global_wrapper_ = true;  // while a kernel group is emitted: whether it is launched alone
  int64_t arena_bytes_ = 0;  // the plan's, and the megakernel's event counters after it
  // Split-K's workspace after the plan (plan_split_k_workspace): the partial
  // sums of the largest split-K product, then its arrival counters, which
  // start at zero (EmittedProgram::sync_offset) and every launch leaves so.
  // The split-K kernels run one after another, so they share it.
  // After them, flash attention backward's atomic mode: dq's f32 sums and a
  // counter per query tile (the largest kernel's; each launch leaves them zero).
  struct SplitKWorkspace {
    int64_t partials_offset = 0, partials_bytes = 0, arrivals_offset = 0, arrivals_bytes = 0;
    int64_t dq_offset = 0, dq_bytes = 0, dq_arrivals_offset = 0, dq_arrivals_bytes = 0;
    int64_t end() const { return dq_arrivals_offset + dq_arrivals_bytes; }
  };
  SplitKWorkspace split_k_;
  // Flash attention trained (KernelGroup::flash_trained): per attention (its
  // softmax task), where the forward kernel saves each row's log-sum-exp
  // (floats) and its output o (q's type, [heads, Tq, Dv]) for the gradient
  // kernel, in the arena after the plan (plan_flash_statistics): live from the
  // forward to the backward phase, a few bytes a token.
  std::map<int, FlashStatistics> flash_statistics_;
  int64_t flash_statistics_end_ = 0;
  std::vector<LaunchParam> split_k_params_;  // the workspace parameters of the kernel being emitted
  // Kernels launched right before a kernel group's own, by the group's index
  // (flash attention backward's rows' statistics), with their parameters.
  std::map<size_t, std::pair<EmittedKernel, std::vector<LaunchParam>>> pre_launches_;
};

}  // namespace

std::string emitter_gap(const OpSignature& op) {
  if (op.pattern == PatternKind::elementwise || op.pattern == PatternKind::broadcast ||
      op.pattern == PatternKind::matmul || Emitter::named_skeleton(op.skeleton_name()) != nullptr) {
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
