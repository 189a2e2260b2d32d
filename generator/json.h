// A small JSON document model that remembers where each value was written.
//
// Why not nlohmann::json for graph files: every diagnostic about a graph names
// the line and column of the offending value, duplicate object keys must be an
// error rather than a silent overwrite, and nesting depth must be bounded so a
// hostile file cannot exhaust the stack. Object members keep their file order.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace cudagen {

struct SourceLoc {
  int line = 0;    // 1-based; 0 when the value did not come from text
  int column = 0;  // 1-based, in bytes
};

class JsonValue {
 public:
  enum class Kind { Null, Bool, Int, Float, String, Array, Object };
  using Member = std::pair<std::string, JsonValue>;

  JsonValue() = default;
  static JsonValue null() { return JsonValue(); }
  static JsonValue boolean(bool b);
  static JsonValue integer(int64_t i);
  static JsonValue number(double d);
  static JsonValue string(std::string s);
  static JsonValue array();
  static JsonValue object();

  Kind kind() const { return static_cast<Kind>(data_.index()); }
  bool is_null() const { return kind() == Kind::Null; }
  bool is_bool() const { return kind() == Kind::Bool; }
  bool is_int() const { return kind() == Kind::Int; }
  bool is_number() const { return kind() == Kind::Int || kind() == Kind::Float; }
  bool is_string() const { return kind() == Kind::String; }
  bool is_array() const { return kind() == Kind::Array; }
  bool is_object() const { return kind() == Kind::Object; }

  // Accessors of the wrong kind return false, 0, "" or an empty list.
  bool as_bool() const { return is_bool() && std::get<bool>(data_); }
  int64_t as_int() const { return is_int() ? std::get<int64_t>(data_) : 0; }
  // Ints convert to double: a float-typed field accepts `1` as well as `1.0`.
  double as_double() const;
  const std::string& as_string() const;
  const std::vector<JsonValue>& items() const;
  const std::vector<Member>& members() const;

  // Object lookup; nullptr when absent.
  const JsonValue* find(std::string_view key) const;

  void push_back(JsonValue v);            // arrays
  void set(std::string key, JsonValue v);  // objects: appends; replaces an existing key
  // Objects: appends without looking for the key (the caller knows it is
  // new), so that building an object of n members costs n, not n^2.
  void append_member(std::string key, JsonValue v);

  SourceLoc loc;

 private:
  // One alternative per Kind, in the same order: a compact node (48 bytes)
  // keeps parsing a 20 MB graph cheap.
  std::variant<std::monostate, bool, int64_t, double, std::string, std::vector<JsonValue>, std::vector<Member>> data_;
};

const char* json_kind_name(JsonValue::Kind kind);

// Thrown for malformed text: the message names line and column.
struct JsonSyntaxError {
  SourceLoc loc;
  std::string message;
};

struct JsonParseLimits {
  int max_depth = 128;
};

// Parses one JSON document (RFC 8259). Throws JsonSyntaxError.
JsonValue parse_json(std::string_view text, JsonParseLimits limits = {});

// Escapes `s` as a JSON string literal, quotes included.
std::string json_quote(std::string_view s);

// Shortest text that reads back as the same double, always with a '.' or an
// exponent so that a float stays a float when it is read again.
std::string json_format_double(double d);

// A value as indented JSON text (objects keep their member order), ending
// in a newline: the writer of generated JSON files such as the registry.
std::string write_json(const JsonValue& value, int indent = 2);

}  // namespace cudagen
