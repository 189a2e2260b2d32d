// cudagen-index: the op registry from folders of templates.
//
//   cudagen-index [--prelude FILE] [--emu-header FILE] [-o registry.json] DIR...
//
// The build runs it over templates/ and embeds the result in the generator;
// `cudagen --templates DIR` runs it over the bundled templates and a user's
// folder. Exit status: 0 ok, 1 a template is wrong (every error listed, each
// as file:line:col), 2 usage.
#include <iostream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "file_util.h"
#include "indexer.h"
#include "version.h"

#ifndef CUDAGEN_INDEX_DEFAULT_PRELUDE
#define CUDAGEN_INDEX_DEFAULT_PRELUDE ""
#endif

int main(int argc, char** argv) {
  cudagen::IndexOptions options;
  options.prelude = CUDAGEN_INDEX_DEFAULT_PRELUDE;
  options.emu_header = CUDAGEN_INDEX_DEFAULT_EMU_HEADER;
  options.resource_dir = CUDAGEN_INDEX_CLANG_RESOURCE_DIR;
  std::string output;
  bool quiet = false;

  CLI::App app{"cudagen-index: reads op templates (CUDA device code annotated with CG_OP) with Clang and writes the op "
               "registry (JSON, format cudagen.registry/1). See docs/templates.md."};
  app.set_version_flag("--version", std::string("cudagen-index ") + CUDAGEN_VERSION);
  app.add_option("DIR", options.template_dirs, "folders of templates (*.cuh), indexed in the order given")->required();
  app.add_option("--prelude", options.prelude, "the device prelude every generated file starts with")
      ->capture_default_str();
  app.add_option("--emu-header", options.emu_header, "the host emulation header (the second configuration parsed)")
      ->capture_default_str();
  app.add_option("--resource-dir", options.resource_dir, "Clang's resource directory")->capture_default_str();
  app.add_option("-o,--output", output, "write the registry here (atomically) instead of to standard output");
  app.add_flag("-q,--quiet", quiet, "no summary line on standard error");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  cudagen::IndexResult result = cudagen::index_templates(options, std::cerr);
  if (!result.ok) return 1;
  try {
    if (output.empty()) std::cout << result.registry_json;
    else cudagen::write_file_atomic(output, result.registry_json);
  } catch (const cudagen::FileError& e) {
    std::cerr << "cudagen-index: error: " << e.what() << "\n";
    return 1;
  }
  if (!quiet)
    std::cerr << fmt::format("cudagen-index: {} ops, {} definitions{}\n", result.ops, result.definitions,
                             output.empty() ? "" : " -> " + output);
  return 0;
}
