#include "shape_rule.h"

#include <map>

#include <fmt/format.h>

namespace cudagen {

std::string DimExpr::str() const {
  // Parentheses where the grammar's precedence needs them: a sum under '-', '*'
  // or '/', and a product on the right of '/' (a / (b*c)).
  auto sum = [](const DimExpr& e) { return e.kind == Kind::Add || e.kind == Kind::Sub; };
  auto wrapped = [](const DimExpr& e, bool wrap) { return wrap ? "(" + e.str() + ")" : e.str(); };
  switch (kind) {
    case Kind::Const: return std::to_string(value);
    case Kind::Symbol: return name;
    case Kind::Add: return fmt::format("{} + {}", parts[0].str(), parts[1].str());
    case Kind::Sub: return fmt::format("{} - {}", parts[0].str(), wrapped(parts[1], sum(parts[1])));
    case Kind::Mul: return fmt::format("{}*{}", wrapped(parts[0], sum(parts[0])), wrapped(parts[1], sum(parts[1])));
    case Kind::Div:
      return fmt::format("{} / {}", wrapped(parts[0], sum(parts[0])),
                         wrapped(parts[1], sum(parts[1]) || parts[1].kind == Kind::Mul || parts[1].kind == Kind::Div));
    case Kind::Choose: return fmt::format("{} ? {} : {}", name, parts[0].str(), parts[1].str());
    case Kind::Numel: return fmt::format("numel({})", name);
  }
  return "?";
}

namespace {

class RuleParser {
 public:
  explicit RuleParser(std::string_view text) : text_(text) {}

  DimExpr parse_formula() {
    DimExpr e = parse_expr();
    skip_ws();
    if (!at_end()) fail("unexpected text after the formula");
    return e;
  }

  ShapeRule parse() {
    ShapeRule rule;
    rule.text = std::string(text_);
    skip_ws();
    while (!at_end() && !looking_at("->")) rule.inputs.push_back(parse_pattern());
    if (!consume("->")) fail("expected '->' between the input and output slots");
    skip_ws();
    while (!at_end() && peek() != ';') rule.outputs.push_back(parse_pattern());
    if (rule.outputs.empty()) fail("expected at least one output slot after '->'");
    if (consume(";")) {
      do {
        skip_ws();
        std::string a = parse_numel();
        skip_ws();
        if (!consume("==")) fail("expected '==' between numel(...) terms");
        std::string b = parse_numel();
        rule.same_numel.emplace_back(a, b);
        skip_ws();
      } while (consume(","));
    }
    skip_ws();
    if (!at_end()) fail("unexpected text");
    return rule;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    throw ShapeRuleSyntaxError(fmt::format("shape rule \"{}\", column {}: {}", text_, pos_ + 1, what));
  }
  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return at_end() ? '\0' : text_[pos_]; }
  bool looking_at(std::string_view s) const { return text_.substr(pos_, s.size()) == s; }
  void skip_ws() {
    while (!at_end() && (peek() == ' ' || peek() == '\t')) ++pos_;
  }
  bool consume(std::string_view s) {
    skip_ws();
    if (!looking_at(s)) return false;
    pos_ += s.size();
    return true;
  }
  static bool name_char(char c, bool first) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (!first && c >= '0' && c <= '9');
  }
  std::string parse_name() {
    skip_ws();
    size_t start = pos_;
    if (!name_char(peek(), true)) fail("expected a name");
    while (!at_end() && name_char(peek(), false)) ++pos_;
    return std::string(text_.substr(start, pos_ - start));
  }

  std::string parse_numel() {
    if (!consume("numel")) fail("expected numel(slot)");
    if (!consume("(")) fail("expected '(' after numel");
    std::string slot = parse_name();
    if (!consume(")")) fail("expected ')'");
    return slot;
  }

  SlotPattern parse_pattern() {
    SlotPattern p;
    size_t start = pos_;
    p.slot = parse_name();
    if (!consume(":")) fail("expected ':' after the slot name");
    if (!consume("[")) fail("expected '['");
    skip_ws();
    int packs = 0;
    if (!consume("]")) {
      do {
        DimItem item = parse_item();
        if (item.kind != DimItem::Kind::Expr && ++packs > 1) fail("at most one '...' run per slot");
        p.dims.push_back(std::move(item));
      } while (consume(","));
      if (!consume("]")) fail("expected ',' or ']'");
    }
    p.text = std::string(text_.substr(start, pos_ - start));
    skip_ws();
    return p;
  }

  DimItem parse_item() {
    DimItem item;
    if (consume("...")) {
      std::string name = parse_name();
      if (name == "broadcast" && consume("(")) {
        item.kind = DimItem::Kind::BroadcastPack;
        item.pack = parse_name();
        if (!consume(",")) fail("expected ',' in broadcast(A, B)");
        item.pack_b = parse_name();
        if (!consume(")")) fail("expected ')' after broadcast(A, B");
      } else {
        item.kind = DimItem::Kind::Pack;
        item.pack = name;
      }
      return item;
    }
    item.expr = parse_expr();
    return item;
  }

  // Nesting and size bounds: the parser and the evaluator recurse along the
  // expression, and a hostile rule (10,000 parentheses) overflowed the stack.
  static constexpr int kMaxNesting = 64, kMaxNodes = 4096;

  void count_node() {
    if (++nodes_ > kMaxNodes) fail(fmt::format("the formula has more than {} terms", kMaxNodes));
  }

  DimExpr parse_expr() {
    if (++nesting_ > kMaxNesting) fail(fmt::format("the formula nests more than {} levels deep", kMaxNesting));
    DimExpr lhs = parse_expr_at_this_level();
    --nesting_;
    return lhs;
  }

  DimExpr parse_expr_at_this_level() {
    DimExpr lhs = parse_term();
    for (;;) {
      skip_ws();
      DimExpr sum;
      if (consume("+")) {
        sum.kind = DimExpr::Kind::Add;
      } else if (looking_at("-") && !looking_at("->")) {
        ++pos_;
        sum.kind = DimExpr::Kind::Sub;
      } else {
        return lhs;
      }
      count_node();
      sum.parts = {std::move(lhs), parse_term()};
      lhs = std::move(sum);
    }
  }

  DimExpr parse_term() {
    DimExpr lhs = parse_atom();
    for (;;) {
      DimExpr product;
      if (consume("*"))
        product.kind = DimExpr::Kind::Mul;
      else if (consume("/"))
        product.kind = DimExpr::Kind::Div;
      else
        return lhs;
      count_node();
      product.parts = {std::move(lhs), parse_atom()};
      lhs = std::move(product);
    }
  }

  DimExpr parse_atom() {
    skip_ws();
    DimExpr e;
    if (consume("(")) {
      e = parse_expr();
      if (!consume(")")) fail("expected ')'");
      return e;
    }
    if (peek() >= '0' && peek() <= '9') {
      int64_t v = 0;
      while (!at_end() && peek() >= '0' && peek() <= '9') {
        if (v > (INT64_MAX - 9) / 10) fail("number too large");
        v = v * 10 + (peek() - '0');
        ++pos_;
      }
      e.kind = DimExpr::Kind::Const;
      e.value = v;
      return e;
    }
    std::string name = parse_name();
    if (name == "numel" && consume("(")) {
      e.kind = DimExpr::Kind::Numel;
      e.name = parse_name();
      if (!consume(")")) fail("expected ')' after numel(slot");
      return e;
    }
    if (consume("?")) {
      e.kind = DimExpr::Kind::Choose;
      e.name = name;
      DimExpr then_part = parse_expr();
      if (!consume(":")) fail("expected ':' in 'arg ? a : b'");
      e.parts = {std::move(then_part), parse_expr()};
      return e;
    }
    e.kind = DimExpr::Kind::Symbol;
    e.name = std::move(name);
    return e;
  }

  std::string_view text_;
  size_t pos_ = 0;
  int nesting_ = 0, nodes_ = 0;
};

struct Binding {
  int64_t value;
  std::string origin;  // "a[1]"
};
struct PackBinding {
  Shape dims;
  std::string origin;  // "a[0:2]"
};

// Checks one task's shapes against a rule: binds symbols on the first slot
// that has them, compares on the rest, then evaluates what was deferred.
class RuleChecker {
 public:
  RuleChecker(const ShapeRule& rule, const ShapeEnv& env) : rule_(rule), env_(env) {}

  std::vector<ShapeMismatch> run() {
    for (const auto* list : {&rule_.inputs, &rule_.outputs})
      for (const auto& pattern : *list) match(pattern);
    for (const auto& d : deferred_) check_deferred(d);
    for (const auto& [a, b] : rule_.same_numel) check_numel(a, b);
    return std::move(errors_);
  }

  // A formula's value once the rule has bound its symbols.
  std::optional<int64_t> evaluate(const DimExpr& formula) {
    for (const auto* list : {&rule_.inputs, &rule_.outputs})
      for (const auto& pattern : *list) match(pattern);
    if (!errors_.empty()) return std::nullopt;
    std::optional<int64_t> value = eval("", formula);
    return errors_.empty() ? value : std::nullopt;
  }

 private:
  struct Deferred {
    const SlotPattern* pattern;
    const DimItem* item;
    size_t first_dim;  // index into the slot's shape
    size_t count;      // dims covered (1 for an expression)
  };

  void error(const std::string& slot, std::string message) {
    errors_.push_back(ShapeMismatch{slot, fmt::format("{} (op shape rule: {})", message, rule_.text)});
  }

  std::optional<int64_t> arg_value(const std::string& slot, const std::string& name) {
    auto v = env_.arg_of(name);
    if (!v) error(slot, fmt::format("argument '{}' decides shapes, so it must be a constant", name));
    return v;
  }

  // Resolves `arg ? x : y` by the argument's value; other nodes unchanged.
  const DimExpr* select(const std::string& slot, const DimExpr& e) {
    const DimExpr* cur = &e;
    while (cur->kind == DimExpr::Kind::Choose) {
      auto v = arg_value(slot, cur->name);
      if (!v) return nullptr;
      cur = &cur->parts[*v ? 0 : 1];
    }
    return cur;
  }

  void bind_symbol(const std::string& slot, const std::string& name, int64_t value, const std::string& origin) {
    auto it = symbols_.find(name);
    if (it == symbols_.end()) {
      symbols_.emplace(name, Binding{value, origin});
      return;
    }
    if (it->second.value != value)
      error(slot, fmt::format("{} is {}, but it must equal {} = {} (from {})", origin, value, name, it->second.value,
                              it->second.origin));
  }

  void match(const SlotPattern& pattern) {
    const Shape* shape = env_.shape_of(pattern.slot);
    if (shape == nullptr) return;  // an absent optional slot
    size_t fixed = 0;
    bool has_pack = false;
    for (const auto& item : pattern.dims) {
      if (item.kind == DimItem::Kind::Expr) {
        ++fixed;
      } else {
        has_pack = true;
      }
    }
    if (has_pack ? shape->size() < fixed : shape->size() != fixed) {
      error(pattern.slot, fmt::format("{} has shape {} (rank {}), but the op wants {}{}", pattern.slot,
                                      shape_to_string(*shape), shape->size(), has_pack ? "rank at least " : "rank ",
                                      fixed) +
                              fmt::format(" as in {}", pattern.text));
      return;
    }
    size_t pack_len = shape->size() - fixed;
    size_t dim = 0;
    for (const auto& item : pattern.dims) {
      if (item.kind == DimItem::Kind::Pack) {
        Shape run(shape->begin() + long(dim), shape->begin() + long(dim + pack_len));
        std::string origin = fmt::format("{}[{}:{}]", pattern.slot, dim, dim + pack_len);
        auto it = packs_.find(item.pack);
        if (it == packs_.end()) {
          packs_.emplace(item.pack, PackBinding{run, origin});
        } else if (it->second.dims != run) {
          error(pattern.slot, fmt::format("{} is {}, but it must equal {} (from {})", origin, shape_to_string(run),
                                          shape_to_string(it->second.dims), it->second.origin));
        }
        dim += pack_len;
        continue;
      }
      if (item.kind == DimItem::Kind::BroadcastPack) {
        deferred_.push_back({&pattern, &item, dim, pack_len});
        dim += pack_len;
        continue;
      }
      const DimExpr* e = select(pattern.slot, item.expr);
      if (e == nullptr) return;
      if (e->kind == DimExpr::Kind::Symbol && !env_.is_arg(e->name)) {
        bind_symbol(pattern.slot, e->name, (*shape)[dim], fmt::format("{}[{}]", pattern.slot, dim));
      } else {
        deferred_.push_back({&pattern, &item, dim, 1});
      }
      ++dim;
    }
  }

  std::optional<int64_t> eval(const std::string& slot, const DimExpr& e) {
    switch (e.kind) {
      case DimExpr::Kind::Const: return e.value;
      case DimExpr::Kind::Symbol: {
        if (env_.is_arg(e.name)) return arg_value(slot, e.name);
        auto it = symbols_.find(e.name);
        if (auto pack = packs_.find(e.name); it == symbols_.end() && pack != packs_.end()) return product(pack->second.dims);
        if (it == symbols_.end()) {
          error(slot, fmt::format("dimension {} is not bound by any slot (a bug in the op's rule)", e.name));
          return std::nullopt;
        }
        return it->second.value;
      }
      case DimExpr::Kind::Add:
      case DimExpr::Kind::Sub:
      case DimExpr::Kind::Mul:
      case DimExpr::Kind::Div: {
        auto a = eval(slot, e.parts[0]);
        auto b = eval(slot, e.parts[1]);
        if (!a || !b) return std::nullopt;
        if (e.kind == DimExpr::Kind::Div) {
          if (*b == 0) {
            error(slot, fmt::format("{} divides by zero ({} is 0)", e.str(), e.parts[1].str()));
            return std::nullopt;
          }
          if (*a == INT64_MIN && *b == -1) {  // the one quotient that overflows (SIGFPE on x86)
            error(slot, fmt::format("{} overflows 64 bits", e.str()));
            return std::nullopt;
          }
          // Rounds down (a convolution's output size), also for a negative numerator.
          return *a / *b - ((*a % *b != 0) && ((*a < 0) != (*b < 0)) ? 1 : 0);
        }
        int64_t r = 0;
        bool overflow = e.kind == DimExpr::Kind::Add   ? __builtin_add_overflow(*a, *b, &r)
                        : e.kind == DimExpr::Kind::Sub ? __builtin_sub_overflow(*a, *b, &r)
                                                       : __builtin_mul_overflow(*a, *b, &r);
        if (overflow) {
          error(slot, fmt::format("{} overflows 64 bits", e.str()));
          return std::nullopt;
        }
        return r;
      }
      case DimExpr::Kind::Choose: {
        const DimExpr* chosen = select(slot, e);
        return chosen ? eval(slot, *chosen) : std::nullopt;
      }
      case DimExpr::Kind::Numel: {
        const Shape* shape = env_.shape_of(e.name);
        if (shape == nullptr) {
          error(slot, fmt::format("numel({}): the task has no slot {}", e.name, e.name));
          return std::nullopt;
        }
        return product(*shape);
      }
    }
    return std::nullopt;
  }

  static int64_t product(const Shape& dims) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;  // shapes were checked for overflow before rules run
    return n;
  }

  const PackBinding* find_pack(const std::string& slot, const std::string& name) {
    auto it = packs_.find(name);
    if (it != packs_.end()) return &it->second;
    error(slot, fmt::format("dimension run {} is not bound by any slot (a bug in the op's rule)", name));
    return nullptr;
  }

  void check_deferred(const Deferred& d) {
    const std::string& slot = d.pattern->slot;
    const Shape& shape = *env_.shape_of(slot);
    if (d.item->kind == DimItem::Kind::BroadcastPack) {
      const PackBinding* a = find_pack(slot, d.item->pack);
      const PackBinding* b = find_pack(slot, d.item->pack_b);
      if (a == nullptr || b == nullptr) return;
      size_t rank = std::max(a->dims.size(), b->dims.size());
      Shape want(rank);
      for (size_t i = 0; i < rank; ++i) {
        int64_t x = i < rank - a->dims.size() ? 1 : a->dims[i - (rank - a->dims.size())];
        int64_t y = i < rank - b->dims.size() ? 1 : b->dims[i - (rank - b->dims.size())];
        if (x != y && x != 1 && y != 1) {
          error(slot, fmt::format("{} ({}) and {} ({}) do not broadcast: dimension {} is {} against {}",
                                  a->origin, shape_to_string(a->dims), b->origin, shape_to_string(b->dims), i, x, y));
          return;
        }
        want[i] = x == 1 ? y : x;
      }
      Shape got(shape.begin() + long(d.first_dim), shape.begin() + long(d.first_dim + d.count));
      if (got != want)
        error(slot, fmt::format("{} is {}, but broadcasting {} with {} gives {}", slot, shape_to_string(shape),
                                shape_to_string(a->dims), shape_to_string(b->dims), shape_to_string(want)));
      return;
    }
    auto want = eval(slot, d.item->expr);
    if (!want) return;
    if (shape[d.first_dim] != *want)
      error(slot, fmt::format("{}[{}] is {}, but it must equal {} = {}", slot, d.first_dim, shape[d.first_dim],
                              d.item->expr.str(), *want));
  }

  void check_numel(const std::string& a, const std::string& b) {
    const Shape* sa = env_.shape_of(a);
    const Shape* sb = env_.shape_of(b);
    if (sa == nullptr || sb == nullptr) return;
    auto numel = [](const Shape& s) {
      int64_t n = 1;
      for (int64_t d : s) n *= d;  // shapes were checked for overflow before rules run
      return n;
    };
    if (numel(*sa) != numel(*sb))
      error(b, fmt::format("{} {} has {} elements, but {} {} has {}; they must match", b, shape_to_string(*sb),
                           numel(*sb), a, shape_to_string(*sa), numel(*sa)));
  }

  const ShapeRule& rule_;
  const ShapeEnv& env_;
  std::map<std::string, Binding> symbols_;
  std::map<std::string, PackBinding> packs_;
  std::vector<Deferred> deferred_;
  std::vector<ShapeMismatch> errors_;
};

}  // namespace

ShapeRule parse_shape_rule(std::string_view text) { return RuleParser(text).parse(); }

std::vector<ShapeMismatch> check_shape_rule(const ShapeRule& rule, const ShapeEnv& env) {
  return RuleChecker(rule, env).run();
}

DimExpr parse_rule_formula(std::string_view text) { return RuleParser(text).parse_formula(); }

std::optional<int64_t> evaluate_rule_formula(const DimExpr& formula, const ShapeRule& rule, const ShapeEnv& env) {
  return RuleChecker(rule, env).evaluate(formula);
}

}  // namespace cudagen
