#include "json.h"

#include <charconv>
#include <cmath>
#include <cstring>
#include <unordered_set>

#include <fmt/format.h>

namespace cudagen {

JsonValue JsonValue::boolean(bool b) {
  JsonValue v;
  v.data_ = b;
  return v;
}
JsonValue JsonValue::integer(int64_t i) {
  JsonValue v;
  v.data_ = i;
  return v;
}
JsonValue JsonValue::number(double d) {
  JsonValue v;
  v.data_ = d;
  return v;
}
JsonValue JsonValue::string(std::string s) {
  JsonValue v;
  v.data_ = std::move(s);
  return v;
}
JsonValue JsonValue::array() {
  JsonValue v;
  v.data_ = std::vector<JsonValue>();
  return v;
}
JsonValue JsonValue::object() {
  JsonValue v;
  v.data_ = std::vector<Member>();
  return v;
}

double JsonValue::as_double() const {
  if (is_int()) return double(std::get<int64_t>(data_));
  return kind() == Kind::Float ? std::get<double>(data_) : 0.0;
}

const std::string& JsonValue::as_string() const {
  static const std::string empty;
  return is_string() ? std::get<std::string>(data_) : empty;
}

const std::vector<JsonValue>& JsonValue::items() const {
  static const std::vector<JsonValue> empty;
  return is_array() ? std::get<std::vector<JsonValue>>(data_) : empty;
}

const std::vector<JsonValue::Member>& JsonValue::members() const {
  static const std::vector<Member> empty;
  return is_object() ? std::get<std::vector<Member>>(data_) : empty;
}

const JsonValue* JsonValue::find(std::string_view key) const {
  for (const auto& [k, v] : members())
    if (k == key) return &v;
  return nullptr;
}

void JsonValue::push_back(JsonValue v) {
  if (!is_array()) data_ = std::vector<JsonValue>();
  std::get<std::vector<JsonValue>>(data_).push_back(std::move(v));
}

void JsonValue::set(std::string key, JsonValue v) {
  if (!is_object()) data_ = std::vector<Member>();
  auto& members = std::get<std::vector<Member>>(data_);
  for (auto& [k, old] : members) {
    if (k == key) {
      old = std::move(v);
      return;
    }
  }
  members.emplace_back(std::move(key), std::move(v));
}

void JsonValue::append_member(std::string key, JsonValue v) {
  if (!is_object()) data_ = std::vector<Member>();
  std::get<std::vector<Member>>(data_).emplace_back(std::move(key), std::move(v));
}

const char* json_kind_name(JsonValue::Kind kind) {
  switch (kind) {
    case JsonValue::Kind::Null: return "null";
    case JsonValue::Kind::Bool: return "a boolean";
    case JsonValue::Kind::Int: return "an integer";
    case JsonValue::Kind::Float: return "a number";
    case JsonValue::Kind::String: return "a string";
    case JsonValue::Kind::Array: return "an array";
    case JsonValue::Kind::Object: return "an object";
  }
  return "?";
}

namespace {

class Parser {
 public:
  Parser(std::string_view text, JsonParseLimits limits) : text_(text), limits_(limits) {}

  JsonValue parse_document() {
    skip_ws();
    JsonValue v = parse_value(0);
    skip_ws();
    if (pos_ != text_.size()) fail("unexpected text after the end of the document");
    return v;
  }

 private:
  [[noreturn]] void fail(std::string message) { throw JsonSyntaxError{here(), std::move(message)}; }

  SourceLoc here() const { return SourceLoc{line_, int(pos_ - line_start_) + 1}; }

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return at_end() ? '\0' : text_[pos_]; }

  void skip_ws() {
    while (!at_end()) {
      char c = text_[pos_];
      if (c == '\n') {
        ++pos_;
        ++line_;
        line_start_ = pos_;
      } else if (c == ' ' || c == '\t' || c == '\r') {
        ++pos_;
      } else {
        break;
      }
    }
  }

  void expect_literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) fail("invalid literal; expected a value");
    pos_ += word.size();
  }

  JsonValue parse_value(int depth) {
    if (depth > limits_.max_depth)
      fail(fmt::format("nesting deeper than {} levels", limits_.max_depth));
    SourceLoc loc = here();
    JsonValue v;
    switch (peek()) {
      case '{': v = parse_object(depth); break;
      case '[': v = parse_array(depth); break;
      case '"': v = JsonValue::string(parse_string()); break;
      case 't': expect_literal("true"); v = JsonValue::boolean(true); break;
      case 'f': expect_literal("false"); v = JsonValue::boolean(false); break;
      case 'n': expect_literal("null"); v = JsonValue::null(); break;
      case '\0':
        if (at_end()) fail("unexpected end of input; expected a value");
        [[fallthrough]];
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) {
          v = parse_number();
        } else {
          fail(fmt::format("unexpected character '{}'; expected a value", printable(peek())));
        }
    }
    v.loc = loc;
    return v;
  }

  static std::string printable(char c) {
    if (c >= 0x20 && c < 0x7f) return std::string(1, c);
    return fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
  }

  JsonValue parse_object(int depth) {
    ++pos_;  // '{'
    JsonValue obj = JsonValue::object();
    // Duplicate keys: a scan while the object is small (most are), a hash
    // set once it is not, so that an object of 10^5 keys stays linear.
    constexpr size_t kScannedKeys = 16;
    std::unordered_set<std::string> keys;
    skip_ws();
    if (peek() == '}') {
      ++pos_;
      return obj;
    }
    for (;;) {
      skip_ws();
      if (peek() != '"') fail("expected a quoted key");
      SourceLoc key_loc = here();
      std::string key = parse_string();
      const size_t count = obj.members().size();
      if (count == kScannedKeys)
        for (const auto& member : obj.members()) keys.insert(member.first);
      if (count < kScannedKeys ? obj.find(key) != nullptr : !keys.insert(key).second)
        throw JsonSyntaxError{key_loc, fmt::format("duplicate key \"{}\" in object", key)};
      skip_ws();
      if (peek() != ':') fail("expected ':' after object key");
      ++pos_;
      skip_ws();
      JsonValue member = parse_value(depth + 1);
      obj.append_member(std::move(key), std::move(member));
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        return obj;
      }
      fail("expected ',' or '}' in object");
    }
  }

  JsonValue parse_array(int depth) {
    ++pos_;  // '['
    JsonValue arr = JsonValue::array();
    skip_ws();
    if (peek() == ']') {
      ++pos_;
      return arr;
    }
    for (;;) {
      skip_ws();
      arr.push_back(parse_value(depth + 1));
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == ']') {
        ++pos_;
        return arr;
      }
      fail("expected ',' or ']' in array");
    }
  }

  unsigned parse_hex4() {
    if (pos_ + 4 > text_.size()) fail("truncated \\u escape");
    unsigned value = 0;
    for (int i = 0; i < 4; ++i) {
      char c = text_[pos_++];
      value <<= 4;
      if (c >= '0' && c <= '9') value |= unsigned(c - '0');
      else if (c >= 'a' && c <= 'f') value |= unsigned(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') value |= unsigned(c - 'A' + 10);
      else fail("invalid hex digit in \\u escape");
    }
    return value;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += char(0xE0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xF0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3F));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    }
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    for (;;) {
      if (at_end()) fail("unterminated string");
      char c = text_[pos_];
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string; escape it");
      if (c != '\\') {
        size_t run = pos_ + 1;  // append a run of plain characters at once
        while (run < text_.size() && text_[run] != '"' && text_[run] != '\\' &&
               static_cast<unsigned char>(text_[run]) >= 0x20)
          ++run;
        out.append(text_.data() + pos_, run - pos_);
        pos_ = run;
        continue;
      }
      ++pos_;
      if (at_end()) fail("unterminated escape in string");
      char e = text_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = parse_hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (text_.substr(pos_, 2) != "\\u") fail("unpaired UTF-16 surrogate in \\u escape");
            pos_ += 2;
            unsigned low = parse_hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail("invalid UTF-16 low surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired UTF-16 surrogate in \\u escape");
          }
          append_utf8(out, cp);
          break;
        }
        default: fail(fmt::format("invalid escape '\\{}' in string", printable(e)));
      }
    }
  }

  JsonValue parse_number() {
    size_t start = pos_;
    bool is_float = false;
    if (peek() == '-') ++pos_;
    if (peek() == '0') {
      ++pos_;
    } else if (peek() >= '1' && peek() <= '9') {
      while (peek() >= '0' && peek() <= '9') ++pos_;
    } else {
      fail("invalid number");
    }
    if (peek() == '.') {
      is_float = true;
      ++pos_;
      if (!(peek() >= '0' && peek() <= '9')) fail("invalid number: digits expected after '.'");
      while (peek() >= '0' && peek() <= '9') ++pos_;
    }
    if (peek() == 'e' || peek() == 'E') {
      is_float = true;
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (!(peek() >= '0' && peek() <= '9')) fail("invalid number: digits expected in exponent");
      while (peek() >= '0' && peek() <= '9') ++pos_;
    }
    const char* first = text_.data() + start;
    const char* last = text_.data() + pos_;
    if (!is_float) {
      int64_t i = 0;
      auto [ptr, ec] = std::from_chars(first, last, i);
      if (ec == std::errc() && ptr == last) return JsonValue::integer(i);
      // Integers beyond 64 bits are kept as doubles; validation rejects them where
      // an integer is required.
    }
    double d = 0;
    auto [ptr, ec] = std::from_chars(first, last, d);
    if (ec == std::errc::result_out_of_range || !std::isfinite(d))
      throw JsonSyntaxError{SourceLoc{line_, int(start - line_start_) + 1}, "number out of range"};
    if (ec != std::errc() || ptr != last) fail("invalid number");
    return JsonValue::number(d);
  }

  std::string_view text_;
  JsonParseLimits limits_;
  size_t pos_ = 0;
  int line_ = 1;
  size_t line_start_ = 0;
};

}  // namespace

JsonValue parse_json(std::string_view text, JsonParseLimits limits) {
  return Parser(text, limits).parse_document();
}

std::string json_quote(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out += '"';
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned char>(c));
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

std::string json_format_double(double d) {
  char buf[64];
  auto [ptr, ec] = std::to_chars(buf, buf + sizeof buf, d);
  std::string s(buf, ptr);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // 'n': nan/inf never reach here
  return s;
}

namespace {

void write_json_to(std::string& out, const JsonValue& v, int indent, int depth) {
  const std::string pad(size_t(indent * (depth + 1)), ' '), close_pad(size_t(indent * depth), ' ');
  switch (v.kind()) {
    case JsonValue::Kind::Null: out += "null"; return;
    case JsonValue::Kind::Bool: out += v.as_bool() ? "true" : "false"; return;
    case JsonValue::Kind::Int: out += std::to_string(v.as_int()); return;
    case JsonValue::Kind::Float: out += json_format_double(v.as_double()); return;
    case JsonValue::Kind::String: out += json_quote(v.as_string()); return;
    case JsonValue::Kind::Array: {
      if (v.items().empty()) {
        out += "[]";
        return;
      }
      // Arrays of scalars stay on one line: ["f32", "f64"], [["out", "x"]].
      bool flat = true;
      for (const auto& item : v.items())
        flat = flat && (item.kind() != JsonValue::Kind::Object) &&
               (item.kind() != JsonValue::Kind::Array || item.items().size() <= 4);
      out += '[';
      for (size_t i = 0; i < v.items().size(); ++i) {
        out += i ? (flat ? ", " : ",\n" + pad) : (flat ? "" : "\n" + pad);
        write_json_to(out, v.items()[i], indent, depth + 1);
      }
      out += flat ? "]" : "\n" + close_pad + "]";
      return;
    }
    case JsonValue::Kind::Object: {
      if (v.members().empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (size_t i = 0; i < v.members().size(); ++i) {
        out += (i ? ",\n" : "\n") + pad + json_quote(v.members()[i].first) + ": ";
        write_json_to(out, v.members()[i].second, indent, depth + 1);
      }
      out += "\n" + close_pad + "}";
      return;
    }
  }
}

}  // namespace

std::string write_json(const JsonValue& value, int indent) {
  std::string out;
  write_json_to(out, value, indent, 0);
  return out + "\n";
}

}  // namespace cudagen
