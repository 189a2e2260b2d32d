#include "diagnostics.h"

#include <algorithm>

#include <fmt/format.h>

namespace cudagen {

namespace {

// User text (a JSON key in a path, a value in a message) as printable text:
// a NUL had cut every later diagnostic off, and other control bytes would
// drive the terminal. Newlines and tabs of cudagen's own messages stay.
std::string visible(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7f)
      out += fmt::format("\\x{:02x}", c);
    else
      out += char(c);
  }
  return out;
}

}  // namespace

std::string Diagnostic::format() const {
  std::string out;
  if (!file.empty()) out += file;
  if (loc.line > 0) out += fmt::format("{}{}:{}", file.empty() ? "line " : ":", loc.line, loc.column);
  if (!out.empty()) out += ": ";
  out += "error: ";
  std::string where;
  if (!task.empty()) where += fmt::format("task '{}'", task);
  if (!slot.empty()) where += fmt::format("{}slot '{}'", where.empty() ? "" : ", ", slot);
  if (!path.empty()) where += where.empty() ? path : fmt::format(" ({})", path);
  if (!where.empty()) out += visible(where) + ": ";
  out += visible(message);
  if (!hint.empty()) out += "\n  hint: " + visible(hint);
  return out;
}

void Diagnostics::add(Diagnostic d) {
  if (errors_.size() >= limit_) {
    ++dropped_;
    return;
  }
  if (d.file.empty()) d.file = file_;
  errors_.push_back(std::move(d));
}

std::string Diagnostics::format() const {
  std::string out;
  for (const auto& d : errors_) out += d.format() + "\n";
  if (dropped_ > 0) out += fmt::format("... and {} more error{} not shown\n", dropped_, dropped_ == 1 ? "" : "s");
  if (count() > 1) out += fmt::format("{} errors\n", count());
  return out;
}

JsonValue parse_json_document(std::string_view text, const std::string& file) {
  try {
    return parse_json(text);
  } catch (const JsonSyntaxError& e) {
    Diagnostics diags(file);
    diags.add(Diagnostic{{}, e.loc, {}, {}, {}, "malformed JSON: " + e.message, {}});
    throw CompileError(std::move(diags));
  }
}

namespace {
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t subst = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, subst});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}
}  // namespace

std::string closest_match(std::string_view word, const std::vector<std::string>& candidates) {
  if (word.size() > 64) return {};
  std::string best;
  size_t best_distance = std::max<size_t>(2, word.size() / 3) + 1;
  for (const auto& c : candidates) {
    bool prefix = word.size() >= 3 && c.size() >= 3 && (word.rfind(c, 0) == 0 || c.rfind(word, 0) == 0);
    size_t d = prefix ? 1 : edit_distance(word, c);
    if (d < best_distance) {
      best_distance = d;
      best = c;
    }
  }
  return best;
}

std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates) {
  std::string best = closest_match(word, candidates);
  return best.empty() ? std::string() : fmt::format("; did you mean '{}'?", best);
}

}  // namespace cudagen
