#include "registry.h"

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "diagnostics.h"
#include "json.h"

namespace cudagen {

const char* to_string(PatternKind p) {
  switch (p) {
    case PatternKind::elementwise: return "elementwise";
    case PatternKind::broadcast: return "broadcast";
    case PatternKind::reduction: return "reduction";
    case PatternKind::matmul: return "matmul";
    case PatternKind::gather: return "gather";
    case PatternKind::opaque: return "opaque";
  }
  return "?";
}

const char* to_string(SlotRole r) {
  switch (r) {
    case SlotRole::input: return "input";
    case SlotRole::weight: return "weight";
    case SlotRole::output: return "output";
    case SlotRole::scratch: return "scratch";
  }
  return "?";
}

const char* to_string(ArgType t) {
  switch (t) {
    case ArgType::float_: return "float";
    case ArgType::int_: return "int";
    case ArgType::bool_: return "bool";
    case ArgType::string_: return "string";
    case ArgType::ints: return "int[]";
    case ArgType::floats: return "float[]";
  }
  return "?";
}

const SlotSignature* OpSignature::find_tensor(std::string_view n) const {
  for (const auto& s : tensors)
    if (s.name == n) return &s;
  return nullptr;
}

const std::vector<std::string>* OpSignature::closure_of(std::string_view function) const {
  if (function == source_function) return &closure;
  for (const auto& v : variants)
    if (v.function == function) return &v.closure;
  return nullptr;
}

const ArgSignature* OpSignature::find_arg(std::string_view n) const {
  for (const auto& a : args)
    if (a.name == n) return &a;
  return nullptr;
}

const OpSignature* OpRegistry::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &ops_[it->second];
}

std::vector<std::string> split_op_names(std::string_view text) {
  std::vector<std::string> names;
  size_t at = 0;
  while (at < text.size()) {
    const size_t begin = text.find_first_not_of(' ', at);
    if (begin == std::string_view::npos) break;
    const size_t end = std::min(text.find(' ', begin), text.size());
    names.emplace_back(text.substr(begin, end - begin));
    at = end;
  }
  return names;
}

std::vector<std::string> OpRegistry::names() const {
  std::vector<std::string> out;
  out.reserve(ops_.size());
  for (const auto& op : ops_) out.push_back(op.name);
  return out;
}

namespace {

template <typename Enum, size_t N>
std::optional<Enum> parse_enum(std::string_view s, const Enum (&values)[N]) {
  for (Enum v : values)
    if (s == to_string(v)) return v;
  return std::nullopt;
}

constexpr PatternKind kPatterns[] = {PatternKind::elementwise, PatternKind::broadcast, PatternKind::reduction,
                                     PatternKind::matmul,      PatternKind::gather,    PatternKind::opaque};
constexpr SlotRole kRoles[] = {SlotRole::input, SlotRole::weight, SlotRole::output, SlotRole::scratch};
constexpr ArgType kArgTypes[] = {ArgType::float_, ArgType::int_, ArgType::bool_,
                                 ArgType::string_, ArgType::ints, ArgType::floats};

// Reads the registry format; a registry is written by developers and by the
// indexer, so errors name the file, line and op, and reading stops at none.
class RegistryReader {
 public:
  RegistryReader(Diagnostics& diags) : diags_(diags) {}

  std::vector<OpSignature> read(const JsonValue& root) {
    std::vector<OpSignature> ops;
    if (!root.is_object()) {
      fail(root, "", "a registry is a JSON object");
      return ops;
    }
    const JsonValue* format = root.find("format");
    if (format == nullptr || !format->is_string() || format->as_string() != "cudagen.registry/1")
      fail(root, "/format", "expected \"format\": \"cudagen.registry/1\"");
    const JsonValue* list = root.find("ops");
    if (list == nullptr || !list->is_array()) {
      fail(root, "/ops", "expected \"ops\": [...]");
      return ops;
    }
    for (size_t i = 0; i < list->items().size(); ++i) ops.push_back(read_op(list->items()[i], fmt::format("/ops/{}", i)));
    return ops;
  }

  std::vector<TemplateDefinition> read_definitions(const JsonValue& root) {
    std::vector<TemplateDefinition> out;
    const JsonValue* list = root.find("definitions");
    if (list == nullptr) return out;
    for (size_t i = 0; i < list->items().size(); ++i) {
      const JsonValue& v = list->items()[i];
      const std::string path = fmt::format("/definitions/{}", i);
      if (!v.is_object()) {
        fail(v, path, "a definition is a JSON object");
        continue;
      }
      TemplateDefinition d;
      d.id = string_field(v, "id", path, "", true);
      d.file = string_field(v, "file", path, "", true);
      d.text = string_field(v, "text", path, "", true);
      if (const JsonValue* line = v.find("line")) d.line = int(line->as_int());
      out.push_back(std::move(d));
    }
    return out;
  }

 private:
  void fail(const JsonValue& at, const std::string& path, std::string message, const std::string& op = {}) {
    diags_.add(Diagnostic{{}, at.loc, path, {}, {}, op.empty() ? message : fmt::format("op '{}': {}", op, message), {}});
  }

  std::string string_field(const JsonValue& obj, const char* key, const std::string& path, const std::string& op,
                           bool required) {
    const JsonValue* v = obj.find(key);
    if (v == nullptr) {
      if (required) fail(obj, path, fmt::format("missing \"{}\"", key), op);
      return {};
    }
    if (!v->is_string()) {
      fail(*v, path + "/" + key, fmt::format("\"{}\" must be a string", key), op);
      return {};
    }
    return v->as_string();
  }

  OpSignature read_op(const JsonValue& v, const std::string& path) {
    OpSignature op;
    if (!v.is_object()) {
      fail(v, path, "an op is a JSON object");
      return op;
    }
    op.name = string_field(v, "name", path, "", true);
    if (!op.name.empty() && !is_identifier(op.name)) fail(v, path + "/name", "op names are identifiers", op.name);
    std::string pattern = string_field(v, "pattern", path, op.name, true);
    if (auto p = parse_enum(pattern, kPatterns)) {
      op.pattern = *p;
    } else if (!pattern.empty()) {
      fail(v, path + "/pattern", fmt::format("unknown pattern kind \"{}\"", pattern), op.name);
    }
    op.doc = string_field(v, "doc", path, op.name, false);
    op.backward = split_op_names(string_field(v, "backward", path, op.name, false));
    op.forward = string_field(v, "forward", path, op.name, false);
    op.init = string_field(v, "init", path, op.name, false);
    op.smem = string_field(v, "smem", path, op.name, false);
    op.flops_text = string_field(v, "flops", path, op.name, false);
    op.reference = string_field(v, "reference", path, op.name, false);
    op.epilogue = string_field(v, "epilogue", path, op.name, false);
    op.rows = string_field(v, "rows", path, op.name, false);
    op.inverse = string_field(v, "inverse", path, op.name, false);
    op.norm = string_field(v, "norm", path, op.name, false);
    op.skeleton = string_field(v, "skeleton", path, op.name, false);
    op.autocast = string_field(v, "autocast", path, op.name, false);
    if (!op.autocast.empty() && op.autocast != "low" && op.autocast != "f32")
      fail(v, path + "/autocast", fmt::format("\"autocast\" is \"low\" or \"f32\", not \"{}\"", op.autocast), op.name);
    if (const std::string gradient = string_field(v, "gradient", path, op.name, false); !gradient.empty()) {
      if (gradient != "none")
        fail(v, path + "/gradient", fmt::format("\"gradient\" is \"none\", not \"{}\"", gradient), op.name);
      op.no_gradient = true;
    }
    if (const JsonValue* prologue = v.find("prologue")) {
      if (!prologue->is_array()) fail(*prologue, path + "/prologue", "\"prologue\" lists input slot names", op.name);
      else
        for (const auto& slot : prologue->items()) {
          if (slot.is_string()) op.prologue.push_back(slot.as_string());
          else fail(slot, path + "/prologue", "\"prologue\" lists input slot names (strings)", op.name);
        }
    }
    if (const JsonValue* source = v.find("source")) {
      op.source_file = string_field(*source, "file", path + "/source", op.name, true);
      op.source_function = string_field(*source, "function", path + "/source", op.name, true);
    }
    if (const JsonValue* closure = v.find("closure")) {
      for (const auto& id : closure->items()) {
        if (id.is_string()) op.closure.push_back(id.as_string());
        else fail(id, path + "/closure", "a closure lists definition ids (strings)", op.name);
      }
    }
    if (const JsonValue* variants = v.find("variants")) {
      for (const auto& item : variants->items()) {
        OpSignature::Variant variant;
        variant.function = string_field(item, "function", path + "/variants", op.name, true);
        if (const JsonValue* closure = item.find("closure"))
          for (const auto& id : closure->items()) variant.closure.push_back(id.as_string());
        op.variants.push_back(std::move(variant));
      }
    }
    if (const JsonValue* types = v.find("types")) read_types(*types, path + "/types", op);
    if (const JsonValue* tensors = v.find("tensors"); tensors && tensors->is_array()) {
      for (size_t i = 0; i < tensors->items().size(); ++i)
        read_slot(tensors->items()[i], fmt::format("{}/tensors/{}", path, i), op);
    } else {
      fail(v, path + "/tensors", "missing \"tensors\": [...]", op.name);
    }
    if (const JsonValue* args = v.find("args"); args && args->is_array()) {
      for (size_t i = 0; i < args->items().size(); ++i) read_arg(args->items()[i], fmt::format("{}/args/{}", path, i), op);
    }
    std::string shape = string_field(v, "shape", path, op.name, true);
    if (!shape.empty()) {
      try {
        op.shape = parse_shape_rule(shape);
        check_rule_slots(v, path, op);
      } catch (const ShapeRuleSyntaxError& e) {
        fail(v, path + "/shape", e.what(), op.name);
      }
    }
    if (!op.flops_text.empty()) {  // after the rule and the arguments, whose names it uses
      try {
        op.flops = parse_rule_formula(op.flops_text);
        check_formula_names(v, path + "/flops", op, op.flops);
      } catch (const ShapeRuleSyntaxError& e) {
        fail(v, path + "/flops", fmt::format("flops formula: {}", e.what()), op.name);
      }
    }
    if (const JsonValue* view = v.find("view")) {
      if (!view->is_array() || view->items().size() != 2 || !view->items()[0].is_string() ||
          !view->items()[1].is_string()) {
        fail(*view, path + "/view", "view is an [output, input] pair of slot names", op.name);
      } else {
        op.view = {view->items()[0].as_string(), view->items()[1].as_string()};
        for (const auto& s : {op.view.first, op.view.second})
          if (op.find_tensor(s) == nullptr) fail(*view, path + "/view", fmt::format("no slot '{}'", s), op.name);
      }
    }
    read_fusion_facts(v, path, op);
    if (const JsonValue* alias = v.find("may_alias"); alias && alias->is_array()) {
      for (const auto& pair : alias->items()) {
        if (!pair.is_array() || pair.items().size() != 2 || !pair.items()[0].is_string() || !pair.items()[1].is_string()) {
          fail(pair, path + "/may_alias", "may_alias holds [output, input] pairs of slot names", op.name);
          continue;
        }
        op.may_alias.emplace_back(pair.items()[0].as_string(), pair.items()[1].as_string());
        for (const auto& s : {op.may_alias.back().first, op.may_alias.back().second})
          if (op.find_tensor(s) == nullptr) fail(pair, path + "/may_alias", fmt::format("no slot '{}'", s), op.name);
      }
    }
    return op;
  }

  // The fusion facts name slots of the op in the roles they need.
  void read_fusion_facts(const JsonValue& v, const std::string& path, OpSignature& op) {
    auto check_slot = [&](const std::string& key, const std::string& slot, bool output) {
      const SlotSignature* sig = op.find_tensor(slot);
      if (sig == nullptr)
        fail(v, path + "/" + key, fmt::format("\"{}\" names slot '{}', which the op does not have", key, slot), op.name);
      else if (output ? sig->role != SlotRole::output : sig->written())
        fail(v, path + "/" + key,
             fmt::format("\"{}\" names slot '{}', a{} {}; it takes {} slot", key, slot,
                         sig->role == SlotRole::input || sig->role == SlotRole::output ? "n" : "",
                         to_string(sig->role), output ? "an output" : "a slot the op only reads"),
             op.name);
    };
    if (!op.epilogue.empty()) check_slot("epilogue", op.epilogue, true);
    for (const auto& slot : op.prologue) check_slot("prologue", slot, false);
    if (!op.rows.empty() && op.find_tensor(op.rows) == nullptr)
      fail(v, path + "/rows", fmt::format("\"rows\" names slot '{}', which the op does not have", op.rows), op.name);
    if (!op.norm.empty() && op.norm != "rms" && op.norm != "layer")
      fail(v, path + "/norm", fmt::format("\"norm\" is \"rms\" or \"layer\", not \"{}\"", op.norm), op.name);
  }

  void read_types(const JsonValue& v, const std::string& path, OpSignature& op) {
    if (!v.is_object()) {
      fail(v, path, "\"types\" maps a type variable to its dtypes", op.name);
      return;
    }
    for (const auto& [var, list] : v.members()) {
      std::vector<DType> dtypes;
      for (const auto& item : list.items()) {
        auto d = item.is_string() ? parse_dtype(item.as_string()) : std::nullopt;
        if (!d) {
          fail(item, path + "/" + var, "not a dtype", op.name);
          continue;
        }
        dtypes.push_back(*d);
      }
      if (dtypes.empty()) fail(list, path + "/" + var, "a type variable needs at least one dtype", op.name);
      op.type_vars[var] = std::move(dtypes);
    }
  }

  void read_slot(const JsonValue& v, const std::string& path, OpSignature& op) {
    SlotSignature slot;
    slot.name = string_field(v, "name", path, op.name, true);
    std::string role = string_field(v, "role", path, op.name, true);
    if (auto r = parse_enum(role, kRoles)) {
      slot.role = *r;
    } else {
      fail(v, path + "/role", fmt::format("unknown slot role \"{}\"", role), op.name);
    }
    slot.dtype = string_field(v, "dtype", path, op.name, true);
    if (!slot.dtype.empty() && !parse_dtype(slot.dtype) && !op.type_vars.count(slot.dtype))
      fail(v, path + "/dtype", fmt::format("\"{}\" is neither a dtype nor a type variable of the op", slot.dtype), op.name);
    if (const JsonValue* o = v.find("optional")) slot.optional = o->is_bool() && o->as_bool();
    if (const JsonValue* w = v.find("writes")) slot.writes = w->is_bool() && w->as_bool();
    if (const JsonValue* a = v.find("absent")) slot.absent = a->as_double();
    if (op.find_tensor(slot.name) != nullptr) fail(v, path, fmt::format("duplicate slot '{}'", slot.name), op.name);
    op.tensors.push_back(std::move(slot));
  }

  void read_arg(const JsonValue& v, const std::string& path, OpSignature& op) {
    ArgSignature arg;
    arg.name = string_field(v, "name", path, op.name, true);
    std::string type = string_field(v, "type", path, op.name, true);
    if (auto t = parse_enum(type, kArgTypes)) {
      arg.type = *t;
    } else {
      fail(v, path + "/type", fmt::format("unknown argument type \"{}\"", type), op.name);
    }
    if (const JsonValue* choices = v.find("choices")) {
      for (const auto& c : choices->items())
        if (c.is_string()) arg.choices.push_back(c.as_string());
    }
    if (const JsonValue* d = v.find("default")) {
      switch (d->kind()) {
        case JsonValue::Kind::Bool: arg.default_value = d->as_bool(); break;
        case JsonValue::Kind::Int:
          arg.default_value = arg.type == ArgType::float_ ? ArgValue(d->as_double()) : ArgValue(d->as_int());
          break;
        case JsonValue::Kind::Float: arg.default_value = d->as_double(); break;
        case JsonValue::Kind::String: arg.default_value = d->as_string(); break;
        default: fail(*d, path + "/default", "unsupported default value", op.name);
      }
    }
    // Generated kernels name tensors and arguments alike by their slot name.
    if (op.find_tensor(arg.name) != nullptr || op.find_arg(arg.name) != nullptr)
      fail(v, path, fmt::format("duplicate slot '{}' (tensor slots and arguments share one namespace)", arg.name), op.name);
    op.args.push_back(std::move(arg));
  }

  void check_rule_slots(const JsonValue& v, const std::string& path, const OpSignature& op) {
    for (const auto* list : {&op.shape.inputs, &op.shape.outputs})
      for (const auto& p : *list)
        if (op.find_tensor(p.slot) == nullptr)
          fail(v, path + "/shape", fmt::format("the shape rule names slot '{}', which the op does not have", p.slot),
               op.name);
    for (const auto& s : op.tensors) {
      bool named = false;
      for (const auto* list : {&op.shape.inputs, &op.shape.outputs})
        for (const auto& p : *list) named = named || p.slot == s.name;
      if (!named) fail(v, path + "/shape", fmt::format("the shape rule says nothing of slot '{}'", s.name), op.name);
    }
  }

  // Every name of a formula is a dimension or a run of the shape rule, or an
  // argument; every numel() names a slot.
  void check_formula_names(const JsonValue& v, const std::string& path, const OpSignature& op, const DimExpr& e) {
    for (const DimExpr& part : e.parts) check_formula_names(v, path, op, part);
    if (e.kind == DimExpr::Kind::Numel && op.find_tensor(e.name) == nullptr)
      fail(v, path, fmt::format("numel({}): the op has no slot '{}'", e.name, e.name), op.name);
    if (e.kind == DimExpr::Kind::Choose && op.find_arg(e.name) == nullptr)
      fail(v, path, fmt::format("'{} ? ...' chooses by '{}', which is not an argument of the op", e.name, e.name),
           op.name);
    if (e.kind != DimExpr::Kind::Symbol || op.find_arg(e.name) != nullptr) return;
    for (const auto* list : {&op.shape.inputs, &op.shape.outputs})
      for (const auto& pattern : *list)
        for (const auto& item : pattern.dims)
          if (item.pack == e.name || item.pack_b == e.name || rule_names(item.expr, e.name)) return;
    fail(v, path,
         fmt::format("'{}' is neither a dimension of the shape rule ({}) nor an argument of the op", e.name,
                     op.shape.text),
         op.name);
  }

  static bool rule_names(const DimExpr& e, const std::string& name) {
    if (e.kind == DimExpr::Kind::Symbol && e.name == name) return true;
    for (const DimExpr& part : e.parts)
      if (rule_names(part, name)) return true;
    return false;
  }

  Diagnostics& diags_;
};

}  // namespace

OpRegistry OpRegistry::from_json(std::string_view text, const std::string& origin) {
  JsonValue root = parse_json_document(text, origin);
  Diagnostics diags(origin);
  OpRegistry reg;
  RegistryReader reader(diags);
  reg.ops_ = reader.read(root);
  reg.definitions_ = reader.read_definitions(root);
  std::set<std::string> ids;
  for (const auto& d : reg.definitions_)
    if (!ids.insert(d.id).second)
      diags.add(Diagnostic{{}, {}, "/definitions", {}, {}, fmt::format("duplicate definition id '{}'", d.id), {}});
  auto check_closure = [&](const OpSignature& op, const std::vector<std::string>& closure) {
    for (const auto& id : closure)
      if (!ids.count(id))
        diags.add(Diagnostic{{}, {}, {}, {}, {},
                             fmt::format("op '{}': its closure names definition '{}', which the registry does not hold",
                                         op.name, id),
                             {}});
  };
  for (const auto& op : reg.ops_) {
    check_closure(op, op.closure);
    for (const auto& variant : op.variants) check_closure(op, variant.closure);
    // A reference function computes one element from the op's inputs: what
    // an elementwise or broadcast op with one output and no in-place update is.
    if (!op.reference.empty() && op.reference != "none") {
      int outputs = 0;
      bool in_place = false;
      for (const auto& slot : op.tensors) {
        outputs += slot.role == SlotRole::output;
        in_place = in_place || slot.writes || slot.role == SlotRole::scratch;
      }
      std::string why;
      if (op.pattern != PatternKind::elementwise && op.pattern != PatternKind::broadcast)
        why = fmt::format("a reference function computes one element, and '{}' is a {} op", op.name, to_string(op.pattern));
      else if (outputs != 1 || in_place)
        why = fmt::format("a reference function returns the one output, and '{}' has {} outputs{}", op.name, outputs,
                          in_place ? " and updates a slot in place" : "");
      else if (op.closure_of(op.reference) == nullptr)
        why = fmt::format("reference function '{}' is none of the op's functions", op.reference);
      if (!why.empty())
        diags.add(Diagnostic{{}, {}, {}, {}, {}, fmt::format("op '{}': {}", op.name, why),
                             "give `reference: none` to run it unchecked"});
    }
  }
  for (size_t i = 0; i < reg.ops_.size(); ++i) {
    if (!reg.index_.emplace(reg.ops_[i].name, i).second)
      diags.add(Diagnostic{{}, {}, fmt::format("/ops/{}", i), {}, {}, fmt::format("duplicate op '{}'", reg.ops_[i].name), {}});
  }
  for (const auto& op : reg.ops_) {
    std::vector<std::pair<const char*, std::string>> links = {{"forward", op.forward}, {"init", op.init}, {"inverse", op.inverse}};
    for (const auto& name : op.backward) links.emplace_back("backward", name);
    for (const auto& [kind, link] : links) {
      if (!link.empty() && reg.find(link) == nullptr)
        diags.add(Diagnostic{{}, {}, {}, {}, {},
                             fmt::format("op '{}': {} op '{}' is not in the registry", op.name, kind, link), {}});
    }
  }
  if (!diags.ok()) throw CompileError(std::move(diags));
  return reg;
}



}  // namespace cudagen
