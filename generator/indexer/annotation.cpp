#include "annotation.h"

#include <charconv>
#include <cstdlib>
#include <sstream>

#include <fmt/format.h>

#include "graph.h"

namespace cudagen {

namespace {

std::vector<std::string> words(std::string_view s) {
  std::vector<std::string> out;
  std::istringstream in{std::string(s)};
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

std::string trim(std::string_view s) {
  size_t b = s.find_first_not_of(" \t\n"), e = s.find_last_not_of(" \t\n");
  return b == std::string_view::npos ? std::string() : std::string(s.substr(b, e - b + 1));
}

class AnnotationParser {
 public:
  explicit AnnotationParser(const std::vector<std::string>& strings) : strings_(strings) {}

  JsonValue parse() {
    if (strings_.empty() || !is_identifier(strings_[0]))
      throw AnnotationError(0, "the first string of CG_OP is the op's name, an identifier: CG_OP(\"relu\", ...)");
    JsonValue types = JsonValue::object(), tensors = JsonValue::array(), args = JsonValue::array(),
              may_alias = JsonValue::array(), variants = JsonValue::array(), view;
    std::string pattern, shape, doc, smem, flops, reference, epilogue, rows, norm, skeleton, autocast, gradient;
    JsonValue prologue = JsonValue::array();
    std::string links[4];  // backward, forward, init, inverse
    for (index_ = 1; index_ < strings_.size(); ++index_) {
      const std::string& s = strings_[index_];
      size_t colon = s.find(':');
      if (colon == std::string::npos)
        fail(fmt::format("\"{}\" is not \"key: value\" (keys: pattern, types, tensor, arg, shape, may_alias, "
                         "backward, forward, init, smem, flops, doc, variant, view, reference, epilogue, prologue, rows, "
                         "inverse, norm, skeleton, autocast, gradient)",
                         s));
      const std::string key = trim(s.substr(0, colon)), value = trim(s.substr(colon + 1));
      if (key == "pattern") set_once(pattern, value, key);
      else if (key == "types") type_var(types, value);
      else if (key == "tensor") tensors.push_back(tensor(value));
      else if (key == "arg") args.push_back(arg(value));
      else if (key == "shape") set_once(shape, value, key);
      else if (key == "may_alias") may_alias.push_back(alias(value));
      else if (key == "view") {
        if (!view.is_null()) fail("'view' is given twice");
        view = alias(value);
      }
      else if (key == "backward") set_once(links[0], link_list(value), key);
      else if (key == "forward") set_once(links[1], link(value), key);
      else if (key == "init") set_once(links[2], link(value), key);
      else if (key == "inverse") set_once(links[3], link(value), key);
      else if (key == "epilogue") set_once(epilogue, value, key);
      else if (key == "rows") set_once(rows, value, key);
      else if (key == "norm") set_once(norm, value, key);
      else if (key == "skeleton") set_once(skeleton, link(value), key);
      else if (key == "autocast") {
        set_once(autocast, value, key);
        if (autocast != "low" && autocast != "f32")
          fail(fmt::format("'autocast' is \"low\" or \"f32\", not \"{}\"", autocast));
      }
      else if (key == "gradient") {
        set_once(gradient, value, key);
        if (gradient != "none") fail(fmt::format("'gradient' is \"none\" (no gradient flows through the op), not \"{}\"", gradient));
      }
      else if (key == "prologue") {
        if (!prologue.items().empty()) fail("'prologue' is given twice");
        for (const auto& slot : words(value)) prologue.push_back(JsonValue::string(slot));
        if (prologue.items().empty()) fail("'prologue' has no value (the input slots, e.g. \"prologue: a b\")");
      }
      else if (key == "smem") set_once(smem, value, key);
      else if (key == "flops") set_once(flops, value, key);
      else if (key == "doc") set_once(doc, value, key);
      else if (key == "variant") variants.push_back(JsonValue::string(link(value)));
      else if (key == "reference") {
        // `none`, or a host function of the templates: the indexer records
        // its closure as a variant's, so `cudagen run` can build it.
        set_once(reference, value == "none" ? value : link(value), key);
        if (reference != "none") variants.push_back(JsonValue::string(reference));
      }
      else fail(fmt::format("unknown key '{}' (keys: pattern, types, tensor, arg, shape, may_alias, backward, forward, "
                            "init, smem, flops, doc, variant, view, reference, epilogue, prologue, rows, inverse, norm, "
                            "skeleton, autocast, gradient)",
                            key));
    }
    index_ = 0;
    if (pattern.empty()) fail("no \"pattern: ...\" (elementwise, broadcast, reduction, matmul, gather or opaque)");
    if (shape.empty()) fail("no \"shape: ...\" (the shape rule, e.g. \"x:[...S] -> out:[...S]\")");
    if (tensors.items().empty()) fail("no \"tensor: NAME ROLE DTYPE\" entries");

    // The field order of the hand-written registry, so the two diff cleanly.
    JsonValue op = JsonValue::object();
    op.set("name", JsonValue::string(strings_[0]));
    op.set("pattern", JsonValue::string(pattern));
    if (!types.members().empty()) op.set("types", std::move(types));
    op.set("tensors", std::move(tensors));
    if (!args.items().empty()) op.set("args", std::move(args));
    op.set("shape", JsonValue::string(shape));
    if (!may_alias.items().empty()) op.set("may_alias", std::move(may_alias));
    if (!view.is_null()) op.set("view", std::move(view));
    const char* link_keys[3] = {"backward", "forward", "init"};
    for (int i = 0; i < 3; ++i)
      if (!links[i].empty()) op.set(link_keys[i], JsonValue::string(links[i]));
    // The fusion facts (docs/registry-format.md).
    if (!epilogue.empty()) op.set("epilogue", JsonValue::string(epilogue));
    if (!prologue.items().empty()) op.set("prologue", std::move(prologue));
    if (!rows.empty()) op.set("rows", JsonValue::string(rows));
    if (!links[3].empty()) op.set("inverse", JsonValue::string(links[3]));
    if (!norm.empty()) op.set("norm", JsonValue::string(norm));
    if (!skeleton.empty()) op.set("skeleton", JsonValue::string(skeleton));
    if (!autocast.empty()) op.set("autocast", JsonValue::string(autocast));
    if (!gradient.empty()) op.set("gradient", JsonValue::string(gradient));
    if (!doc.empty()) op.set("doc", JsonValue::string(doc));
    if (!smem.empty()) op.set("smem", JsonValue::string(smem));
    if (!flops.empty()) op.set("flops", JsonValue::string(flops));
    if (!variants.items().empty()) op.set("variants", std::move(variants));
    if (!reference.empty()) op.set("reference", JsonValue::string(reference));
    return op;
  }

 private:
  [[noreturn]] void fail(const std::string& message) const { throw AnnotationError(index_, message); }

  void set_once(std::string& field, const std::string& value, const std::string& key) {
    if (!field.empty()) fail(fmt::format("'{}' is given twice", key));
    if (value.empty()) fail(fmt::format("'{}' has no value", key));
    field = value;
  }

  // "T = f32 f16 bf16 f64"
  void type_var(JsonValue& types, const std::string& value) {
    size_t eq = value.find('=');
    if (eq == std::string::npos) fail("types are \"types: T = f32 f64 ...\"");
    std::string name = trim(value.substr(0, eq));
    if (!is_identifier(name)) fail(fmt::format("type variable '{}' is not an identifier", name));
    if (types.find(name) != nullptr) fail(fmt::format("type variable '{}' is declared twice", name));
    JsonValue list = JsonValue::array();
    for (const auto& d : words(value.substr(eq + 1))) {
      if (!parse_dtype(d)) fail(fmt::format("'{}' is not a dtype (f32, f16, bf16, f64, i32, i64)", d));
      list.push_back(JsonValue::string(d));
    }
    if (list.items().empty()) fail(fmt::format("type variable '{}' has no dtypes", name));
    types.set(name, std::move(list));
  }

  // "x input T", "param weight T writes", "rstd output f32 optional",
  // "grad_scale input f32 optional=1" (an input the op reads as 1 where the task leaves it out)
  JsonValue tensor(const std::string& value) {
    std::vector<std::string> w = words(value);
    if (w.size() < 3)
      fail(fmt::format("a tensor is \"tensor: NAME ROLE DTYPE [optional[=VALUE]] [writes]\", not \"{}\"", value));
    JsonValue t = JsonValue::object();
    t.set("name", JsonValue::string(w[0]));
    t.set("role", JsonValue::string(w[1]));
    t.set("dtype", JsonValue::string(w[2]));
    for (size_t i = 3; i < w.size(); ++i) {
      if (w[i].rfind("optional=", 0) == 0) {
        const std::string text = w[i].substr(9);
        char* end = nullptr;
        const double absent = std::strtod(text.c_str(), &end);
        if (text.empty() || *end != '\0' || w[1] != "input")
          fail(fmt::format("tensor '{}': \"{}\" gives an input's value where a task leaves it out: \"optional=1\"",
                           w[0], w[i]));
        t.set("optional", JsonValue::boolean(true));
        t.set("absent", JsonValue::number(absent));
        continue;
      }
      if (w[i] != "optional" && w[i] != "writes")
        fail(fmt::format("tensor '{}': unknown flag '{}' (optional, optional=VALUE, writes)", w[0], w[i]));
      t.set(w[i], JsonValue::boolean(true));
    }
    return t;
  }

  // "scale float = 1.0", "step int", "approximate string = tanh in tanh|erf"
  JsonValue arg(const std::string& value) {
    std::string spec = value, choices;
    if (size_t in = spec.find(" in "); in != std::string::npos) {
      choices = trim(spec.substr(in + 4));
      spec = spec.substr(0, in);
    }
    std::string default_text;
    if (size_t eq = spec.find('='); eq != std::string::npos) {
      default_text = trim(spec.substr(eq + 1));
      spec = spec.substr(0, eq);
    }
    std::vector<std::string> w = words(spec);
    if (w.size() != 2) fail(fmt::format("an argument is \"arg: NAME TYPE [= DEFAULT] [in A|B]\", not \"{}\"", value));
    JsonValue a = JsonValue::object();
    a.set("name", JsonValue::string(w[0]));
    a.set("type", JsonValue::string(w[1]));
    if (!default_text.empty()) a.set("default", default_value(w[0], w[1], default_text));
    if (!choices.empty()) {
      if (w[1] != "string") fail(fmt::format("argument '{}': only string arguments have choices", w[0]));
      JsonValue list = JsonValue::array();
      std::string rest = choices;
      for (size_t bar; !rest.empty(); rest = bar == std::string::npos ? "" : rest.substr(bar + 1)) {
        bar = rest.find('|');
        list.push_back(JsonValue::string(trim(rest.substr(0, bar))));
      }
      a.set("choices", std::move(list));
    }
    return a;
  }

  JsonValue default_value(const std::string& name, const std::string& type, const std::string& text) {
    if (type == "bool") {
      if (text != "true" && text != "false") fail(fmt::format("argument '{}': a bool default is true or false", name));
      return JsonValue::boolean(text == "true");
    }
    if (type == "string") return JsonValue::string(text);
    if (type == "int") {
      int64_t v = 0;
      auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (ec != std::errc() || end != text.data() + text.size())
        fail(fmt::format("argument '{}': default '{}' is not an integer", name, text));
      return JsonValue::integer(v);
    }
    if (type == "float") {
      double v = 0;
      auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (ec != std::errc() || end != text.data() + text.size())
        fail(fmt::format("argument '{}': default '{}' is not a number", name, text));
      return JsonValue::number(v);
    }
    fail(fmt::format("argument '{}': type '{}' takes no default here (float, int, bool, string do)", name, type));
  }

  // "out x": out may reuse x's storage.
  JsonValue alias(const std::string& value) {
    std::vector<std::string> w = words(value);
    if (w.size() != 2) fail(fmt::format("may_alias is \"may_alias: OUTPUT INPUT\", not \"{}\"", value));
    JsonValue pair = JsonValue::array();
    pair.push_back(JsonValue::string(w[0]));
    pair.push_back(JsonValue::string(w[1]));
    return pair;
  }

  std::string link(const std::string& value) {
    if (!is_identifier(value)) fail(fmt::format("'{}' is not an identifier", value));
    return value;
  }
  // One or more op names, separated by spaces: a backward may be several ops
  // (a convolution's data and weight gradients, each its own GEMM).
  std::string link_list(const std::string& value) {
    const std::vector<std::string> names = words(value);
    if (names.empty()) fail("'backward' names no op");
    for (const auto& name : names) link(name);
    return fmt::format("{}", fmt::join(names, " "));
  }

  const std::vector<std::string>& strings_;
  size_t index_ = 0;
};

}  // namespace

JsonValue parse_op_annotation(const std::vector<std::string>& strings) { return AnnotationParser(strings).parse(); }

}  // namespace cudagen
