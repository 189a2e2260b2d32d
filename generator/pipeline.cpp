#include "pipeline.h"

#include "file_util.h"
#include "graph_json.h"

namespace cudagen {

OpRegistry load_registry(const FrontendOptions& options) {
  if (options.registry_file.empty()) return builtin_registry();
  return OpRegistry::from_json(read_text_file(options.registry_file), options.registry_file);
}

Program load_program(const std::string& graph_path, const FrontendOptions& options) {
  TaskGraph graph = read_graph_file(graph_path);
  ValidateOptions validate_options = options.validate;
  validate_options.file = graph_path;
  return validate(std::move(graph), load_registry(options), validate_options);
}

Program load_program(TaskGraph graph, const FrontendOptions& options) {
  return validate(std::move(graph), load_registry(options), options.validate);
}

}  // namespace cudagen
