// The `cudagen` command line.
#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "describe.h"
#include "diagnostics.h"
#include "file_util.h"
#include "graph_json.h"
#include "pipeline.h"
#include "version.h"

namespace cudagen {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitBadInput = 1;
constexpr int kExitUsage = 2;

struct Cli {
  FrontendOptions frontend;
  std::string graph_path;
  std::string output_path;
};

void add_frontend_options(CLI::App* cmd, Cli& cli) {
  cmd->add_option("GRAPH", cli.graph_path, "task graph file (JSON, format cudagen.taskgraph/1)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--registry", cli.frontend.registry_file,
                  "op registry file to use instead of the bundled one (format cudagen.registry/1)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--max-tensor-bytes", cli.frontend.validate.max_tensor_bytes,
                  "largest tensor allowed, in bytes (larger is taken for a typo)")
      ->capture_default_str();
  cmd->add_option("--error-limit", cli.frontend.validate.error_limit, "stop listing errors after this many")
      ->capture_default_str();
}

int run_validate(const Cli& cli) {
  Program p = load_program(cli.graph_path, cli.frontend);
  fmt::print("{}: ok: {} tasks, {} buffers\n", cli.graph_path, p.tasks.size(), p.buffers.size());
  return kExitOk;
}

int run_describe(const Cli& cli) {
  Program p = load_program(cli.graph_path, cli.frontend);
  fmt::print("{}", describe(p));
  return kExitOk;
}

int run_format(const Cli& cli) {
  std::string text = write_graph(read_graph_file(cli.graph_path));
  if (cli.output_path.empty() || cli.output_path == "-") {
    fmt::print("{}", text);
  } else {
    write_file_atomic(cli.output_path, text);
  }
  return kExitOk;
}

int run_ops(const Cli& cli) {
  OpRegistry reg = load_registry(cli.frontend);
  fmt::print("{:<24} {:<12} {}\n", "op", "pattern", "shape rule");
  for (const auto& op : reg.ops()) fmt::print("{:<24} {:<12} {}\n", op.name, to_string(op.pattern), op.shape.text);
  return kExitOk;
}

int main_impl(int argc, char** argv) {
  CLI::App app{"cudagen: compiles a task graph into one fused, standalone CUDA source file.\n"};
  app.set_version_flag("--version", std::string("cudagen ") + CUDAGEN_VERSION);
  app.require_subcommand(1);
  app.footer(
      "Exit status: 0 ok, 1 bad input (errors on stderr), 2 usage.\n"
      "Run `cudagen COMMAND --help` for the options of a command.");

  Cli cli;
  auto* validate_cmd = app.add_subcommand("validate", "check a graph against the op registry; print nothing else");
  add_frontend_options(validate_cmd, cli);
  auto* describe_cmd =
      app.add_subcommand("describe", "validate a graph, then print its tasks per phase and its buffers");
  add_frontend_options(describe_cmd, cli);
  auto* format_cmd = app.add_subcommand("format", "print a graph in canonical form (the writer's output)");
  format_cmd->add_option("GRAPH", cli.graph_path, "task graph file")->required()->check(CLI::ExistingFile);
  format_cmd->add_option("-o,--output", cli.output_path, "write here (atomically) instead of standard output");
  auto* ops_cmd = app.add_subcommand("ops", "list the ops of the registry");
  ops_cmd->add_option("--registry", cli.frontend.registry_file, "op registry file instead of the bundled one")
      ->check(CLI::ExistingFile);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitUsage;
  }

  try {
    if (*validate_cmd) return run_validate(cli);
    if (*describe_cmd) return run_describe(cli);
    if (*format_cmd) return run_format(cli);
    if (*ops_cmd) return run_ops(cli);
  } catch (const CompileError& e) {
    std::fputs(e.diagnostics().format().c_str(), stderr);
    return kExitBadInput;
  } catch (const FileError& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return kExitBadInput;
  }
  return kExitUsage;
}

}  // namespace
}  // namespace cudagen

int main(int argc, char** argv) { return cudagen::main_impl(argc, argv); }
