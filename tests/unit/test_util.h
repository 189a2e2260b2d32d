// Helpers shared by the unit tests.
#pragma once

#include <string>

#include <gtest/gtest.h>

#include "diagnostics.h"
#include "file_util.h"
#include "graph_json.h"
#include "validate.h"

namespace cudagen::testing {

inline std::string source_path(const std::string& relative) { return std::string(CUDAGEN_SOURCE_DIR) + "/" + relative; }

// Reads and validates `text`; returns "" when it is valid, else every error
// formatted as the CLI prints them.
inline std::string errors_of(const std::string& text, ValidateOptions options = {}) {
  if (options.file.empty()) options.file = "t.json";
  try {
    validate(read_graph(text, "t.json"), builtin_registry(), options);
    return "";
  } catch (const CompileError& e) {
    EXPECT_GT(e.diagnostics().count(), 0u);
    return e.diagnostics().format();
  }
}

// Wraps task objects into a graph document.
inline std::string graph_of(const std::string& tasks) {
  return R"({"format": "cudagen.taskgraph/1", "name": "t", "tasks": [)" + tasks + "]}";
}

}  // namespace cudagen::testing
