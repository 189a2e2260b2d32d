// Shape rules: the registry's one-line statement of how an op's slot shapes
// relate, e.g. "a:[...B, M, K] b:[...B, K, N] -> out:[...B, M, N]".
//
// Grammar (docs/registry-format.md):
//   rule     := pattern+ '->' pattern+ [';' numel(slot) '==' numel(slot) {',' ...}]
//   pattern  := slot ':' '[' [item {',' item}] ']'
//   item     := '...' NAME              a run of dimensions (at most one per pattern)
//             | '...broadcast(' NAME ',' NAME ')'   numpy broadcast of two runs
//             | expr
//   expr     := term {('+' | '-') term};  term := atom {('*' | '/') atom}
// ('/' divides rounding down, as a convolution's output size does)
//   atom     := INT | NAME | '(' expr ')' | NAME '?' expr ':' expr
// A NAME that is an argument of the op takes the argument's (constant) value;
// `arg ? x : y` chooses by a boolean argument. Other NAMEs are dimension
// symbols: bound by the first slot that has them, checked on every other.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "graph.h"

namespace cudagen {

struct DimExpr {
  enum class Kind { Const, Symbol, Add, Sub, Mul, Div, Choose, Numel };
  Kind kind = Kind::Const;
  int64_t value = 0;
  std::string name;            // Symbol; Choose: the boolean argument; Numel: the slot
  std::vector<DimExpr> parts;  // Add/Sub/Mul/Div operands; Choose: {then, else}
  std::string str() const;
};

struct DimItem {
  enum class Kind { Expr, Pack, BroadcastPack };
  Kind kind = Kind::Expr;
  DimExpr expr;
  std::string pack;            // Pack: its name; BroadcastPack: the first run
  std::string pack_b;          // BroadcastPack: the second run
};

struct SlotPattern {
  std::string slot;
  std::vector<DimItem> dims;
  std::string text;  // "a:[...B, M, K]", for messages
};

struct ShapeRule {
  std::string text;
  std::vector<SlotPattern> inputs;
  std::vector<SlotPattern> outputs;
  std::vector<std::pair<std::string, std::string>> same_numel;  // slot pairs
};

class ShapeRuleSyntaxError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws ShapeRuleSyntaxError naming the column of the problem.
ShapeRule parse_shape_rule(std::string_view text);

struct ShapeMismatch {
  std::string slot;
  std::string message;
};

// How the checker sees a task: the shape of each slot present (nullptr for an
// absent optional slot), and the constant value of each argument that a rule
// may name (bool as 0/1; nullopt when it has none or is not constant).
struct ShapeEnv {
  std::function<const Shape*(std::string_view slot)> shape_of;
  std::function<std::optional<int64_t>(std::string_view arg)> arg_of;
  std::function<bool(std::string_view arg)> is_arg;
};

// Every way the shapes break the rule; empty when they satisfy it.
std::vector<ShapeMismatch> check_shape_rule(const ShapeRule& rule, const ShapeEnv& env);

// A formula over a rule's names (an op's declared FLOPs): the expression
// grammar above, where a NAME is a dimension symbol of the rule, a run of
// dimensions (`...B`: the product of its dimensions) or a constant argument,
// and `numel(slot)` is a slot's element count. Throws ShapeRuleSyntaxError.
DimExpr parse_rule_formula(std::string_view text);

// Its value for one task whose shapes satisfy `rule`; nullopt when a name is
// unbound or an argument is not constant.
std::optional<int64_t> evaluate_rule_formula(const DimExpr& formula, const ShapeRule& rule, const ShapeEnv& env);

}  // namespace cudagen
