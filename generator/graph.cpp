#include "graph.h"

#include <fmt/format.h>

namespace cudagen {

const char* to_string(DType d) {
  switch (d) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
  }
  return "?";
}

const char* to_string(Phase p) {
  switch (p) {
    case Phase::init: return "init";
    case Phase::forward: return "forward";
    case Phase::backward: return "backward";
    case Phase::update: return "update";
  }
  return "?";
}

const char* to_string(Storage s) {
  switch (s) {
    case Storage::external: return "external";
    case Storage::persistent: return "persistent";
    case Storage::saved: return "saved";
    case Storage::transient: return "transient";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view s) {
  for (DType d : {DType::f32, DType::f16, DType::bf16, DType::f64, DType::i32, DType::i64})
    if (s == to_string(d)) return d;
  return std::nullopt;
}

std::optional<Phase> parse_phase(std::string_view s) {
  for (Phase p : {Phase::init, Phase::forward, Phase::backward, Phase::update})
    if (s == to_string(p)) return p;
  return std::nullopt;
}

std::optional<Storage> parse_storage(std::string_view s) {
  for (Storage st : {Storage::external, Storage::persistent, Storage::saved, Storage::transient})
    if (s == to_string(st)) return st;
  return std::nullopt;
}

int64_t dtype_bytes(DType d) {
  switch (d) {
    case DType::f16:
    case DType::bf16: return 2;
    case DType::f32:
    case DType::i32: return 4;
    case DType::f64:
    case DType::i64: return 8;
  }
  return 0;
}

int64_t numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_to_string(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::optional<SlotRef> parse_slot_ref(std::string_view text) {
  size_t dot = text.find('.');
  if (dot == std::string_view::npos || text.find('.', dot + 1) != std::string_view::npos) return std::nullopt;
  SlotRef ref{std::string(text.substr(0, dot)), std::string(text.substr(dot + 1))};
  if (!is_identifier(ref.task) || !is_identifier(ref.slot)) return std::nullopt;
  return ref;
}

std::string arg_value_to_string(const ArgValue& v) {
  struct Visitor {
    std::string operator()(bool b) const { return b ? "true" : "false"; }
    std::string operator()(int64_t i) const { return std::to_string(i); }
    std::string operator()(double d) const { return json_format_double(d); }
    std::string operator()(const std::string& s) const { return json_quote(s); }
    std::string operator()(const std::vector<int64_t>& a) const { return fmt::format("[{}]", fmt::join(a, ", ")); }
    std::string operator()(const std::vector<double>& a) const {
      std::string out = "[";
      for (size_t i = 0; i < a.size(); ++i) out += (i ? ", " : "") + json_format_double(a[i]);
      return out + "]";
    }
  };
  return std::visit(Visitor{}, v);
}

const TensorSlot* Task::find_tensor(std::string_view name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

const ArgSlot* Task::find_arg(std::string_view name) const {
  for (const auto& a : args)
    if (a.name == name) return &a;
  return nullptr;
}

const Task* TaskGraph::find_task(std::string_view id) const {
  for (const auto& t : tasks)
    if (t.id == id) return &t;
  return nullptr;
}

double arg_number(const ArgValue& v) {
  if (auto* d = std::get_if<double>(&v)) return *d;
  if (auto* i = std::get_if<int64_t>(&v)) return double(*i);
  if (auto* b = std::get_if<bool>(&v)) return *b ? 1 : 0;
  return 0;
}

bool is_identifier(std::string_view s) {
  if (s.empty() || s.size() > 128) return false;
  auto alpha = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; };
  if (!alpha(s[0])) return false;
  for (char c : s)
    if (!alpha(c) && !(c >= '0' && c <= '9')) return false;
  return true;
}

bool is_tensor_name(std::string_view s) {
  if (s.empty() || s.size() > 200 || s[0] == '.' || s[0] == '-') return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
          c == '-'))
      return false;
  return true;
}

}  // namespace cudagen
