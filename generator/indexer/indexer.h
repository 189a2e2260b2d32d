// cudagen-index: reads op templates with Clang LibTooling and writes the op
// registry (docs/registry-format.md). Only this part of cudagen links Clang.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace cudagen {

struct IndexOptions {
  // Folders of templates: every *.cuh in them, in name order, one folder
  // after another, parsed as one translation unit after the prelude.
  std::vector<std::string> template_dirs;
  std::string prelude;      // templates/prelude.cuh: always in a generated file, so never in a closure
  std::string emu_header;   // runtime/emu/cudagen_emu.h: the emulation configuration's stand-in for CUDA
  std::string resource_dir; // Clang's resource directory (its own headers)
};

struct IndexResult {
  bool ok = false;
  std::string registry_json;  // valid when ok
  int ops = 0;
  int definitions = 0;
};

// Parses the templates twice (device code for sm_90, and the host emulation
// build), merges what each function uses, and returns the registry. Clang's
// diagnostics and the indexer's own errors go to `diagnostics`, each as
// file:line:col: error: ...
IndexResult index_templates(const IndexOptions& options, std::ostream& diagnostics);

}  // namespace cudagen
