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

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::Null; }
  bool is_bool() const { return kind_ == Kind::Bool; }
  bool is_int() const { return kind_ == Kind::Int; }
  bool is_number() const { return kind_ == Kind::Int || kind_ == Kind::Float; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_array() const { return kind_ == Kind::Array; }
  bool is_object() const { return kind_ == Kind::Object; }

  bool as_bool() const { return bool_; }
  int64_t as_int() const { return int_; }
  // Ints convert to double: a float-typed field accepts `1` as well as `1.0`.
  double as_double() const { return kind_ == Kind::Int ? double(int_) : double_; }
  const std::string& as_string() const { return string_; }
  const std::vector<JsonValue>& items() const { return items_; }
  const std::vector<Member>& members() const { return members_; }

  // Object lookup; nullptr when absent.
  const JsonValue* find(std::string_view key) const;

  void push_back(JsonValue v) { items_.push_back(std::move(v)); }
  void set(std::string key, JsonValue v);  // appends; replaces an existing key

  SourceLoc loc;

 private:
  Kind kind_ = Kind::Null;
  bool bool_ = false;
  int64_t int_ = 0;
  double double_ = 0;
  std::string string_;
  std::vector<JsonValue> items_;
  std::vector<Member> members_;
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

}  // namespace cudagen
