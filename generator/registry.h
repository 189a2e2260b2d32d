// The op registry: what the compiler knows of each op (docs/architecture.md §3), read
// from the registry JSON format (docs/registry-format.md). The bundled ops
// come from builtin_registry(): cudagen-index (generator/indexer) writes it
// from templates/ at build time.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "graph.h"
#include "shape_rule.h"

namespace cudagen {

enum class PatternKind { elementwise, broadcast, reduction, matmul, gather, opaque };
enum class SlotRole { input, weight, output, scratch };
enum class ArgType { float_, int_, bool_, string_, ints, floats };

const char* to_string(PatternKind p);
const char* to_string(SlotRole r);
const char* to_string(ArgType t);

struct SlotSignature {
  std::string name;
  SlotRole role = SlotRole::input;
  std::string dtype;     // a concrete dtype ("i32") or a type variable of the op ("T")
  bool optional = false;
  double absent = 0;     // what an elementwise op reads for an optional input the task leaves out
  bool writes = false;   // an input or weight the op updates in place (an optimizer's parameter)

  // Whether the op writes this slot's memory (outputs, scratch, updated weights).
  bool written() const { return role == SlotRole::output || role == SlotRole::scratch || writes; }
};

struct ArgSignature {
  std::string name;
  ArgType type = ArgType::float_;
  std::optional<ArgValue> default_value;  // absent: the task must give it
  std::vector<std::string> choices;       // string arguments: the allowed values
};

struct OpSignature {
  std::string name;
  PatternKind pattern = PatternKind::opaque;
  std::map<std::string, std::vector<DType>> type_vars;  // "T" -> {f32, f16, bf16}
  std::vector<SlotSignature> tensors;
  std::vector<ArgSignature> args;
  ShapeRule shape;
  std::vector<std::pair<std::string, std::string>> may_alias;  // {output, input}
  // {output, input}: the output is the input's storage under another shape;
  // the op needs no kernel. Empty for every other op.
  std::pair<std::string, std::string> view;
  // The ops of its backward, if differentiable: one, or several that each
  // compute some of its gradients (conv2d_nhwc's data and weight gradients).
  std::vector<std::string> backward;
  std::string forward;   // for a backward op: the op whose gradients it computes
  std::string init;      // an op that initialises this op's persistent state, if it has any
  // Fusion facts (docs/registry-format.md): what the fusion pass and the
  // emitter may do with the op's skeleton, declared by its template rather
  // than known to the compiler by name.
  //   epilogue  the output slot its skeleton stores element by element, from
  //             the thread that computed the element: an elementwise chain
  //             may run there (rules matmul_epilogue, reduction_epilogue).
  //   prologue  the input slots its skeleton reads only through element
  //             loads: an elementwise chain's value may be computed there
  //             (rule elementwise_prologue).
  //   rows      the slot whose rows its blocks own, one block per row; every
  //             other slot but a weight is that tensor's shape or one value a row.
  //   inverse   for a gather that only moves elements: the op whose index
  //             map is its inverse (rule permuted_store).
  //   norm      "rms" or "layer": a row normalisation a matmul may apply to
  //             its operand rows as it loads them (rule norm_prologue): the
  //             prologue computes the bundled norm's formula, not the op's.
  //   skeleton  the emitter's kernel skeleton of a reduction, gather or opaque
  //             op (emit.cpp, Emitter::named_skeleton), where not the op's own name:
  //             a user's op with a bundled op's calling convention runs its
  //             skeleton, calling the op's own function.
  std::string epilogue;
  std::vector<std::string> prologue;
  std::string rows;
  std::string inverse;
  std::string norm;
  std::string skeleton;
  // The precision policy's fact (generator/autocast.h): "low", the op
  // computes in the policy's 16-bit dtype (matmuls, convolutions); "f32", in
  // f32 (norms, losses, reductions, exp and log); empty, in the widest dtype
  // of its floating inputs. As PyTorch's CUDA autocast lists them.
  std::string autocast;
  // "gradient: none": its outputs carry no gradient (a comparison's 0/1
  // mask): training derives none through it, whatever reads its inputs.
  bool no_gradient = false;
  // The skeleton's name: `skeleton`, else the op's.
  const std::string& skeleton_name() const { return skeleton.empty() ? name : skeleton; }
  std::string doc;
  // Where the template lives: a file of templates/ and its entry function.
  // Empty for ops that have no template yet (the emitter then says so).
  std::string source_file;
  std::string source_function;
  std::string smem;  // shared memory the template needs, as a formula of its tile sizes
  // The floating-point operations one task performs, as a formula of the
  // shape rule's names (`2 * numel(out) * K` for a matmul); empty when the op
  // declares none. The profiler turns it into a FLOP rate.
  std::string flops_text;
  DimExpr flops;
  // The template definitions the op's function needs, itself included, by
  // id, in file order (made by the indexer; empty in a hand-written registry).
  std::vector<std::string> closure;
  // Other entry functions of the op that the emitter calls instead of the
  // main one (a tensor-core tile) or beside it (a norm backward's column
  // sums), each with its own closure.
  struct Variant {
    std::string function;
    std::vector<std::string> closure;
  };
  std::vector<Variant> variants;
  // How `cudagen run` checks the op, for ops outside its built-in float64
  // reference (a user's template): empty (it cannot), "none" (it does not,
  // and says so), or a host function of the templates, `double f(double...)`
  // of the op's inputs then its arguments (elementwise and broadcast ops;
  // one of `variants`, for its closure).
  std::string reference;
  // The closure of `function`: the op's own, or a variant's; nullptr if neither.
  const std::vector<std::string>* closure_of(std::string_view function) const;

  const SlotSignature* find_tensor(std::string_view name) const;
  const ArgSignature* find_arg(std::string_view name) const;
};

// One top-level definition of a template file (a function, a type, a
// constant or a macro), as the indexer copied it: what the emitter writes
// into a generated file when an op's closure names it.
struct TemplateDefinition {
  std::string id;    // its name; "name/2" for a later overload; "#NAME" for a macro
  std::string file;  // "elementwise.cuh"
  int line = 0;
  std::string text;  // the exact source, with the comment above it and without its CG_OP annotation
};

class OpRegistry {
 public:
  // Parses the registry format; throws CompileError naming file, line and op.
  static OpRegistry from_json(std::string_view text, const std::string& origin);

  const OpSignature* find(std::string_view name) const;
  const std::vector<OpSignature>& ops() const { return ops_; }
  std::vector<std::string> names() const;

  // In file order, the prelude excluded (every generated file holds it whole).
  const std::vector<TemplateDefinition>& definitions() const { return definitions_; }

 private:
  std::vector<OpSignature> ops_;
  std::vector<TemplateDefinition> definitions_;
  std::unordered_map<std::string, size_t> index_;
};

// The registry text of the ops bundled with cudagen.
std::string_view builtin_registry_json();

// The op names of a registry entry's `backward` (one or more, separated by spaces).
std::vector<std::string> split_op_names(std::string_view text);

// The bundled ops, parsed.
OpRegistry builtin_registry();

}  // namespace cudagen
