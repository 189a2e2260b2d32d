// The TaskGraph JSON format (docs/taskgraph-format.md): reader and canonical
// writer. write_graph(read_graph(text)) == text for text in canonical form.
#pragma once

#include <string>
#include <string_view>

#include "diagnostics.h"
#include "graph.h"

namespace cudagen {

inline constexpr const char* kTaskGraphFormat = "cudagen.taskgraph/1";

// Reads a graph; structural errors (syntax, unknown or mistyped fields, bad
// ids) are collected, and if any were found a CompileError carrying all of
// them is thrown. `file` names the source in diagnostics.
TaskGraph read_graph(std::string_view text, const std::string& file = {});

// Reads a graph file from disk (errors name the file).
TaskGraph read_graph_file(const std::string& path);

// The canonical text: two-space indentation, one slot per line, members in
// the order of the model, a newline at the end.
std::string write_graph(const TaskGraph& graph);

}  // namespace cudagen
