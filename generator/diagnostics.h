// Diagnostics: every error about user input says where (file:line:col, JSON
// path, task id, slot) and, where there is one, what to do about it.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "json.h"

namespace cudagen {

struct Diagnostic {
  std::string file;  // the graph or registry file; empty for in-memory graphs
  SourceLoc loc;     // line 0: unknown
  std::string path;  // JSON pointer into the document, e.g. /tasks/3/tensors/b
  std::string task;  // task id, when the error is about a task
  std::string slot;  // tensor or argument slot, when it is about one
  std::string message;
  std::string hint;  // the fix, when there is an obvious one

  // "graph.json:12:7: error: task 'fc1', slot 'b' (/tasks/3/tensors/b): ...\n  hint: ..."
  std::string format() const;
};

// Collects errors up to a limit, counting the ones past it, so that a user
// sees every problem in a file at once rather than one per run.
class Diagnostics {
 public:
  explicit Diagnostics(std::string file = {}, size_t limit = 50) : file_(std::move(file)), limit_(limit) {}

  void add(Diagnostic d);
  bool ok() const { return errors_.empty(); }
  size_t count() const { return errors_.size() + dropped_; }
  const std::vector<Diagnostic>& errors() const { return errors_; }
  const std::string& file() const { return file_; }
  bool full() const { return errors_.size() >= limit_; }
  std::string format() const;  // all errors, then "N more errors not shown"

 private:
  std::string file_;
  size_t limit_;
  size_t dropped_ = 0;
  std::vector<Diagnostic> errors_;
};

// Thrown by a pass that found bad input; carries every error it found.
class CompileError : public std::runtime_error {
 public:
  explicit CompileError(Diagnostics diags) : std::runtime_error(diags.format()), diags_(std::move(diags)) {}
  const Diagnostics& diagnostics() const { return diags_; }

 private:
  Diagnostics diags_;
};

// Parses a JSON document; malformed text throws a CompileError whose one
// diagnostic names the file, line and column.
JsonValue parse_json_document(std::string_view text, const std::string& file);

// The candidate closest to `word` by edit distance, or "" when none is close
// enough to be a plausible typo. Used for "did you mean" hints.
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates);

// ", did you mean 'x'?" or "" -- for appending to a message.
std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace cudagen
