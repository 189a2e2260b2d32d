// The emitter (emit.h's emit()): one class, Emitter, whose member functions
// are split by the kernels they lower (docs/architecture.md §1, "emit"):
//   emit.cpp             the driver (run), the parameters, one task's kernel, loads and stores;
//   emit_elementwise.cpp elementwise chains, prologues and epilogues;
//   emit_rows.cpp        the row skeletons (softmax, the norms, their gradients) and data movement;
//   emit_vision.cpp      convolution, pooling and BatchNorm, and their gradients;
//   emit_matmul.cpp      the matmul mainloops and the fused products (sum, chain, row reduction);
//   emit_attention.cpp   attention: the row kernel, flash attention and their gradients;
//   emit_host.cpp        launches, the megakernel, the host launchers, header and manifest.
// Internal to the generator library: nothing outside generator/ includes it.
#pragma once

#include "emit.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "arch.h"
#include "cost.h"
#include "diagnostics.h"
#include "graph_json.h"
#include "hash.h"
#include "perf_model.h"
#include "templates_embedded.h"
#include "version.h"

namespace cudagen::lowering {

inline std::string float_literal(double v) { return json_format_double(double(float(v))) + "f"; }

// The flat index into `in` (right-aligned, numpy broadcasting) of element
// `var` of a tensor shaped `out`, as a C expression.
inline std::string broadcast_index(const Shape& out, const Shape& in, const std::string& var) {
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

// Grouped-query attention: the index of the head of keys (shaped `k`) that
// head `var` of q (shaped `q`) reads, over the leading axes of both: `var`
// itself where they are one shape.
inline std::string kv_head_of(const Shape& q, const Shape& k, const std::string& var) {
  return broadcast_index(Shape(q.begin(), q.end() - 2), Shape(k.begin(), k.end() - 2), var);
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
  // A TMA tensor map of `buffer`, passed by value (pointee "const cg_tensor_map").
  std::optional<TensorMapSpec> tensor_map;
  // The bytes a launch moves each way through a workspace, where fewer than
  // its size (stream-K's partial tiles take a few of its slots); -1: all.
  int64_t workspace_traffic = -1;
};

// The number of keys query row `row` (over all heads, Tq rows a head) sees,
// as kernel code: all Tk, or causal (top-left aligned) those up to its own.
inline std::string visible_keys(bool causal, int64_t Tq, int64_t Tk) {
  return causal ? fmt::format("(int)(row % {0} + 1 < {1} ? row % {0} + 1 : {1})", Tq, Tk) : std::to_string(Tk);
}

// The floats of a shared-memory region at byte `offset`, as kernel code.
inline std::string shared_floats(int64_t offset) {
  return offset == 0 ? "(float*)cg_smem" : fmt::format("(float*)(cg_smem + {})", offset);
}

inline int64_t next_shared_offset(const EmittedKernel& ek) { return shared_region_bytes(ek.smem_bytes); }

// Reserves `bytes` of kernel `ek`'s shared memory for `what`, after every
// region reserved before (16-byte aligned, as vector loads and the
// tensor-core tiles need): returns its offset.
inline int64_t reserve_shared(EmittedKernel& ek, std::string what, int64_t bytes) {
  const int64_t offset = next_shared_offset(ek);
  ek.smem_regions.push_back(SharedRegion{std::move(what), offset, bytes});
  ek.smem_bytes = offset + bytes;
  return offset;
}

// A line of generated code that stops the kernel's compilation where the
// shared memory the generator reserved for a template's kernel (`bytes`,
// from kernels.h, which the fuser and the launch use) is not what the
// template's configuration type `config` lays out (its SHARED_BYTES): the
// two formulas are written twice, in C++ and in CUDA, and must agree.
inline std::string shared_bytes_agree(const std::string& config, int64_t bytes) {
  return fmt::format("  static_assert({}::SHARED_BYTES == {}, \"the shared memory cudagen reserved (generator/kernels.h) "
                     "is not the template's\");\n",
                     config, bytes);
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

 private:
  std::string step_function() const { return options_.symbol_prefix + "_step"; }

  std::string buffer_name(int buffer) const { return cudagen::buffer_name(p_, buffer); }
  static LaunchParam buffer_param(const std::string& name, const Param& x) { return buffer_param(name, x, x.written); }


  static bool is_16bit(DType d) { return d == DType::f16 || d == DType::bf16; }

  // The type arithmetic runs in: f32 for the 16-bit storage types.
  static std::string compute_type(DType d) { return is_16bit(d) ? "float" : c_type(d); }

  // The argument as bound, following `from` links to the argument that holds the value.
  const BoundArg* arg(int t, const std::string& name) { return root_arg(p_, t, name).second; }
  double arg_double(int t, const std::string& name, double fallback) { return number_value(constant_arg(t, name), fallback); }
  bool arg_bool(int t, const std::string& name) { return flag_value(constant_arg(t, name)); }

  // The run-time arguments of task `t`: one pointer parameter each (NAME_arg,
  // into the scalars region), read once into a local named like the argument.
  struct ScalarParam {
    std::string name;
    const PlannedScalar* scalar;
  };
  static std::string scalar_type(ArgType type) {
    return type == ArgType::float_ ? "float" : type == ArgType::int_ ? "long long" : "int";
  }

  // __restrict__ promises that no other pointer of the kernel reaches this
  // memory while it is written; an output planned in place of its input
  // breaks that promise, so neither of the pair gets the qualifier.
  struct Pointer {
    int64_t offset, bytes;
    bool written;
  };
  static std::string launch_bounds(const EmittedKernel& ek) {
    return ek.min_blocks_per_sm > 0 ? fmt::format("{}, {}", ek.block, ek.min_blocks_per_sm) : std::to_string(ek.block);
  }

  static int grid_stride_blocks(int64_t n, int block) { return int(std::clamp<int64_t>((n + block - 1) / block, 1, 4096)); }

  // Rule attention: the tasks of its stages (kir.h).
  struct AttentionTasks {
    int scores = -1, softmax = -1, context = -1;
    int bias = -1;  // an add of a bias (an attention mask) to the scores, before the softmax; -1: none
  };
  // The row kernels' add_bias(j, x) for query row `row` (templates/softmax.cuh):
  // x plus the bias at (row, key j) where the attention has one, launched
  // as parameter "bias" (appended to `launch`); x itself where none.
  std::string attention_bias(const AttentionTasks& at, int64_t Tk, std::vector<LaunchParam>& launch);
  // The operand an attention's bias add adds to the scores (at.bias >= 0).
  Param attention_bias_operand(const AttentionTasks& at);

  // Rule attention_projection (fuse.h): an operand the attention kernel
  // computes itself (a projection stage of its IR): matmul task `matmul`,
  // its epilogue where `epilogue`, and split_heads task `split`, whose
  // output (`heads`) the attention reads.
  struct Projection {
    int matmul = -1, split = -1;
    int heads = -1;
    bool epilogue = false;
  };

  struct ProjectionCode {
    std::string code;
    std::vector<LaunchParam> params;
  };

  // An operand's element as a chain reads it: from the parameter `name` at
  // `index` (of element i of the domain); by default one load.
  using OperandLoad = std::function<std::string(const std::string& name, const Param& x, const std::string& index)>;

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

  // How an epilogue is printed: its lambda's and its anchor's names, and
  // where its value stays in the kernel. (What it runs is the chain of the
  // IR stage whose result it starts from.)
  struct EpilogueSpan {
    std::string lambda = "cg_epilogue";
    std::string anchor_name;           // the anchor's parameter, where stored; empty: its slot's name
    // Where the chain's value stays in the kernel rather than in memory
    // (rules matmul_chain, row_reduction, attention_projection: a statement
    // storing `{}` into shared memory), and the buffer it stands for;
    // empty: nowhere.
    std::string keep;
    int kept_buffer = -1;
  };

  Epilogue epilogue(const KernelGroup& k, const Param& out) { return epilogue(k, out, EpilogueSpan{}); }
  static std::string load_element(const std::string& name, DType dtype, const std::string& index) {
    return widen_from(dtype, fmt::format("cg_load({}, {})", name, index));
  }
  // A value of type `dtype` as the float the hooks compute in (16-bit
  // widened), and a float as a value of type `dtype` (16-bit narrowed).
  static std::string widen_from(DType dtype, const std::string& v) { return is_16bit(dtype) ? "cg_widen(" + v + ")" : v; }
  static std::string narrow_to(DType dtype, const std::string& v) {
    return is_16bit(dtype) ? fmt::format("cg_narrow<{}>({})", c_type(dtype), v) : v;
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

  // Rule norm_prologue: the code before a matmul's tile loop and its
  // operand load, for an `a` that rmsnorm or layernorm task prologue_task_
  // computes, in the unfused kernel's order of operations (a 16-bit `a` is
  // rounded as the norm would store it: the tensor-core tile narrows what
  // load_a returns). `a_index`: where load_a(m, k) would read `a`.
  struct NormLoad {
    std::string code, element;
  };

  static int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

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
  std::vector<LaunchParam> extra_params_;  // the workspace and tensor-map parameters of the kernel being emitted
  // Kernels launched right before a kernel group's own, by the group's index
  // (flash attention backward's rows' statistics), with their parameters.
  std::map<size_t, std::pair<EmittedKernel, std::vector<LaunchParam>>> pre_launches_;

 public:
  // (emit.cpp)
  static Skeleton named_skeleton(std::string_view op);
  EmittedProgram run(const std::vector<KernelGroup>& kernels);

 private:
  // emit.cpp: the driver, the parameters, one task's kernel, loads and stores
  std::string finish_kernel(const KernelGroup& k, EmittedKernel& ek, std::vector<LaunchParam> launch,
                            const std::string& body, std::vector<EmittedKernel>& emitted);
  std::string kernel(const KernelGroup& k, std::vector<EmittedKernel>& emitted);
  void fail(int task, const std::string& slot, const std::string& message, const std::string& hint = {});
  static void use_shared(EmittedKernel& ek, const SharedLayout& layout);
  static std::string c_type(DType d);
  static LaunchParam buffer_param(const std::string& name, const Param& x, bool written);
  std::vector<Param> params(int t);
  static const Param* find_param(const std::vector<Param>& ps, const std::string& name);
  const Param& param(const std::vector<Param>& ps, const std::string& name);
  const BoundArg* constant_arg(int t, const std::string& name);
  int64_t arg_int(int t, const std::string& name, int64_t fallback);
  std::string float_arg(int t, const std::string& name, double fallback);
  std::vector<ScalarParam> scalar_params(int t) const;
  std::string scalar_locals(int t) const;
  static std::string param_name(const LaunchParam& lp);
  std::string comment(const KernelGroup& k, const std::vector<LaunchParam>& launch, EmittedKernel& ek);
  static std::string grid_stride_loop(int64_t n, const std::string& statement, EmittedKernel& ek);
  bool args_at_least_one(int t, std::initializer_list<const char*> args);
  static EmittedKernel emitted_kernel(const KernelGroup& k);
  std::string emit_kernel(const KernelGroup& k, std::vector<EmittedKernel>& emitted);
  void record_launch(EmittedKernel& ek, std::vector<LaunchParam> launch);
  void locate_params(EmittedKernel& ek, const std::vector<LaunchParam>& launch);
  void use_function(const OpSignature& op, const std::string& function);
  void append_arguments(int t, std::vector<std::string>& operands);
  // An out-of-place op's input operands in its signature's order: `present`
  // by slot name; an optional input the task leaves out reads its `absent`
  // value. An op with no input slot at all (fill, uniform) takes `index`.
  std::vector<std::string> input_operands(int t, const std::map<std::string, std::string>& present,
                                          const std::string& index) const;
  bool check_f32_accumulation(int t, const Param& x);
  std::string load(const Param& x, const std::string& index) const;
  std::string load_as(const Param& x, const std::string& name, const std::string& index) const;
  std::string store(const Param& x, const std::string& index, const std::string& value) const;
  // `width` f32 values (`values`, an array) narrowed to x's type and stored
  // from x[index] as one vector (cg_store_vector), as statements of a lambda
  // body indented by 8.
  static std::string store_vector_code(const Param& x, int width, const std::string& index, const std::string& values);
  static std::string store_element(const std::string& name, DType dtype, const std::string& index,
                                   const std::string& value);

  // emit_attention.cpp: attention (the row kernel, flash attention) and its gradients
  std::string attention(const KernelGroup& k, std::vector<EmittedKernel>& emitted);
  std::string flash_attention(const KernelGroup& k, const AttentionTasks& at, const FlashAttentionTile& tile, EmittedKernel ek,
                              const std::string& tail_code, const std::vector<LaunchParam>& tail_params,
                              std::vector<EmittedKernel>& emitted);
  std::string streamed_attention(const KernelGroup& k, const AttentionTasks& at, EmittedKernel ek, const std::string& tail_code,
                                 const std::vector<LaunchParam>& tail_params, const std::string& why_not_flash,
                                 std::vector<EmittedKernel>& emitted);
  std::string flash_backward_rows_kernel(const KernelGroup& k, const FlashAttentionTile& tile, const FlashTraining& roles,
                                         const Param& dout, const FlashStatistics& f, int64_t heads, int64_t Tq,
                                         int64_t Dv, std::vector<EmittedKernel>& emitted);
  std::string attention_backward(const KernelGroup& k, std::vector<EmittedKernel>& emitted);
  AttentionTasks attention_tasks(const KernelGroup& k) const;
  static std::vector<Projection> attention_projections(const KernelGroup& k);
  int source_norm(const KernelGroup& k, int source) const;
  std::vector<AttentionProjectionShared> projection_shared(const KernelGroup& k, const std::vector<Projection>& projections,
                                                           int q_heads, int64_t& weight_floats) const;
  ProjectionCode projection_code(const KernelGroup& k, const std::vector<Projection>& projections,
                                 const std::array<int, 3>& operands, const AttentionShared& smem);
  bool flash_backward_atomic(const KernelGroup& k, int64_t* dq_floats = nullptr, int64_t* query_tiles = nullptr) const;
  void plan_flash_statistics(const std::vector<KernelGroup>& kernels);

  // emit_matmul.cpp: the matmul mainloops and the fused products
  static std::string b_index(bool trans_b, int64_t K, int64_t N);
  std::string scaled_accumulator(int t);
  std::string matmul_sum(const KernelGroup& k, std::vector<EmittedKernel>& emitted);
  std::string matmul_chain(const KernelGroup& k, std::vector<EmittedKernel>& emitted);
  std::string row_reduction(const KernelGroup& k, std::vector<EmittedKernel>& emitted);
  std::string matmul(int t, const GemmMainloop& gemm, const std::vector<Param>& ps, EmittedKernel& ek);
  static std::string tensor_map_helper(bool two_d, bool three_d);
  static std::string persistent_grid_helper();
  std::string hopper_matmul(int t, const Param& a, const Param& b, const Param& out, const HopperGemm& g,
                            EmittedKernel& ek);
  std::string pipelined_matmul(int t, const Param& a, const Param& /*b*/, const Param& out, const GemmTile& g, int64_t M,
                               int64_t N, int64_t K, bool ta, bool tb, int64_t batches, const std::string& batch_bases,
                               EmittedKernel& ek);
  // A pipelined GEMM's output rows where they are not its product's first M
  // rows in order (a class of a strided data gradient's pixels): `count`, the
  // rows of this block's product, and `row`, the output row of its row m (code).
  struct GemmRows {
    std::string count, row;
  };
  std::string pipelined_gemm(int t, const Param& out, const GemmTile& g, int64_t M, int64_t N, int64_t K, int64_t batches,
                             const std::string& batch_bases,
                             const std::function<std::string(const std::string&, const std::string&)>& mainloop,
                             EmittedKernel& ek, int64_t ldd = -1, const GemmRows* rows = nullptr);
  std::string simt_matmul(int t, const Param& /*a*/, const Param& /*b*/, const Param& out, const SgemmTile& g, int64_t M,
                          int64_t N, int64_t K, bool ta, bool tb, int64_t batches, const std::string& batch_bases,
                          EmittedKernel& ek);
  std::string staged_results(const std::string& mainloop, int t, const Param& out, int64_t M, int64_t N,
                             int64_t ldd = -1, const GemmRows* rows = nullptr);
  std::string stored_norm_rows(const StoredNorm& n) const;
  NormLoad norm_load(int64_t M, int64_t K, int tile, const std::string& a_index, EmittedKernel& ek);
  const HopperGemm* hopper_taken(const GemmMainloop& gemm, int t) const;
  void plan_split_k_workspace(const std::vector<KernelGroup>& kernels);

  // emit_host.cpp: launches, the megakernel, the host launchers, header and manifest
  std::string host_header(const EmittedProgram& program) const;
  static bool aliased(size_t i, const std::vector<Pointer>& pointers);
  std::pair<int64_t, int64_t> arena_range(const LaunchParam& lp) const;
  std::string kernel_functions(const std::string& comment_text, const EmittedKernel& ek,
                               const std::vector<LaunchParam>& launch, const std::string& body) const;
  std::pair<std::vector<std::string>, std::vector<std::string>> global_params(
      const std::vector<LaunchParam>& launch) const;
  std::string global_function(const EmittedKernel& ek, const std::vector<LaunchParam>& launch) const;
  static bool alone_in_launch(const std::vector<KernelGroup>& kernels, size_t k);
  std::string launches(const std::vector<KernelGroup>& kernels, EmittedProgram& out);
  std::string batched_launch(const std::vector<KernelGroup>& kernels, const std::vector<size_t>& members,
                             const std::string& suffix, EmittedProgram& out);
  static int default_megakernel_blocks(const Target& target);
  std::string megakernels(EmittedProgram& out);
  std::string megakernel(const MegakernelPhase& mp, const std::vector<EmittedKernel>& tile_kernels, int64_t state,
                         int64_t events, std::vector<EmittedKernel>& emitted);
  std::string header() const;
  std::string prelude_and_templates() const;
  std::string megakernel_tensors(const EmittedProgram& program) const;
  std::string launch_name(const LaunchParam& lp) const;
  std::string tensor_info_row(const std::string& slot, const LaunchParam& lp) const;
  std::string host_side(const EmittedProgram& program) const;
  std::string manifest(const EmittedProgram& program) const;

  // emit_rows.cpp: the row skeletons (softmax, the norms, their gradients) and data movement
  static int64_t one_block_per_row(const Shape& shape, EmittedKernel& ek);
  std::string softmax(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string row_reduce(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string row_gradient(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string max_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string sum_leading(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string log_softmax(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string rmsnorm(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string layernorm(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string cross_entropy(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string cross_entropy_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string softmax_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string norm_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string embedding_backward(int, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string mse(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string heads(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string concat_split(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string embedding(int, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string transpose(int, const std::vector<Param>& ps, EmittedKernel& ek);
  // emit_vision.cpp: convolution and pooling, forward and backward.
  struct ConvGeometry {
    int64_t B = 0, C = 0, H = 0, W = 0, O = 0, KH = 0, KW = 0, OH = 0, OW = 0, groups = 1, OG = 0, CG = 0;
    std::string code;  // `const cg_conv2d_geometry g = {...};`
  };
  std::optional<ConvGeometry> conv_geometry(int t, const Shape& sx, const Shape& sw, const Shape& so, bool nhwc = false);
  static std::string group_bases(const GemmTile& tile, bool grouped, int64_t per_group);
  std::string conv2d(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string conv2d_nhwc(int t, const GemmMainloop& gemm, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string conv2d_nhwc_depthwise(const ConvGeometry& g, int vector, const GemmMainloop& gemm, const Param& x,
                                    const Param& weight, const Param& out, EmittedKernel& ek);
  std::string conv2d_nhwc_backward_data(int t, const GemmMainloop& gemm, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string conv2d_nhwc_backward_data_classes(int t, const GemmTile& tile, const ConvGeometry& g,
                                                const DgradClasses& classes, const std::string& type, const Param& dx,
                                                EmittedKernel& ek);
  std::string conv2d_nhwc_backward_weight(int t, const GemmMainloop& gemm, const std::vector<Param>& ps,
                                          EmittedKernel& ek);
  std::string conv2d_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string pool_window(int t, const Shape& sx, const Shape& so);
  std::string pool2d(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string pool2d_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string adaptive_avg_pool2d(int, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string pool2d_nhwc(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string adaptive_avg_pool2d_backward(int, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string pool2d_nhwc_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string batchnorm2d(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string batchnorm2d_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string batchnorm_statistics_stores(int t, const std::vector<Param>& ps, int64_t count);
  std::string batchnorm2d_nhwc(const KernelGroup& k, int t, const std::vector<Param>& ps, EmittedKernel& ek,
                               size_t index, std::string& pre_code);
  std::string batchnorm2d_nhwc_backward(const KernelGroup& k, int t, const std::vector<Param>& ps, EmittedKernel& ek,
                                        size_t index, std::string& pre_code);
  std::vector<LaunchParam> batchnorm_nhwc_blocks(const BatchNormNhwcSplit& s, EmittedKernel& ek);
  std::string batchnorm_nhwc_pre_launch(const KernelGroup& k, const BatchNormNhwcSplit& s, const std::string& what,
                                        std::vector<LaunchParam> launch, const std::string& body, size_t index);
  std::string permute(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string slice(int t, const std::vector<Param>& ps, EmittedKernel& ek);

  // emit_elementwise.cpp: elementwise chains, prologues and epilogues
  void mark_rows(int t, const std::vector<Param>& ps, const std::vector<LaunchParam>& prologue,
                 const std::vector<LaunchParam>& tail, const std::vector<LaunchParam>& launch, EmittedKernel& ek);
  std::vector<LaunchParam> prologue(const KernelGroup& k);
  std::string chain_task(const KernelGroup& k, int node, const std::vector<Param>& ps, const Shape& domain,
                         const std::string& value, std::map<int, std::string>& value_of,
                         std::map<int, std::string>& param_of, std::vector<LaunchParam>& params,
                         const OperandLoad& load_operand = {}, const std::string& indent = "    ");
  static std::string chain_local(const std::vector<int>& tasks, int t);
  static int input_node(const kir::Kernel& ir, int node, const Param& x);
  static std::map<int, std::string> anchor_value(const kir::Kernel& ir, const kir::Stage& stage, int buffer);
  std::vector<LaunchParam> elementwise_prologue(const KernelGroup& k);
  Epilogue epilogue(const KernelGroup& k, const Param& out, const EpilogueSpan& span);
  void vector_epilogue(const KernelGroup& k, const Param& out, Epilogue& e);
  std::string permuted_index(int t, const Param& x, const Param& out);
  std::string fused_elementwise(const KernelGroup& k, std::vector<EmittedKernel>& emitted);
  std::string elementwise_in_place(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  std::string elementwise(int t, const std::vector<Param>& ps, EmittedKernel& ek);
  static std::string apply(const OpSignature& op, const Param& out, const std::vector<std::string>& operands);
  static bool reads_own_element(const OpSignature& op, const Param& x, const Shape& domain);
  std::string chain_statement(int t, const Param& out, std::vector<std::string> operands, const std::string& value,
                              const std::string& indent);
  static int vector_width(const OpSignature& op, const std::vector<Param>& ps, const Param& out, int64_t n);
  std::string elementwise_vectorised(int t, const std::vector<Param>& ps, const Param& out, int64_t n, int width,
                                     EmittedKernel& ek);
};

}  // namespace cudagen::lowering
