// The compiler's driver: one function per entry point, each a visible
// sequence of passes (DESIGN.md §1). Today the pipeline ends at validation;
// each later pass is added here as one call.
#pragma once

#include <string>

#include "program.h"
#include "validate.h"

namespace cudagen {

struct FrontendOptions {
  std::string registry_file;  // empty: the bundled registry
  ValidateOptions validate;
};

OpRegistry load_registry(const FrontendOptions& options);

// read (JSON) -> validate
Program load_program(const std::string& graph_path, const FrontendOptions& options);

// validate, for a graph made in code (the builder API)
Program load_program(TaskGraph graph, const FrontendOptions& options);

}  // namespace cudagen
