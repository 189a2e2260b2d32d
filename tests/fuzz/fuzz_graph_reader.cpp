// Fuzz target: any bytes into the graph reader and validator. Properties
// beyond "no crash, no sanitizer report": bad input is reported as a
// CompileError with at least one diagnostic, and a graph that reads is written
// in canonical form that reads back to the same text.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "diagnostics.h"
#include "graph_json.h"
#include "validate.h"

using namespace cudagen;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const OpRegistry registry = builtin_registry();  // parsed once: the harness's only state
  std::string_view text(reinterpret_cast<const char*>(data), size);
  TaskGraph graph;
  try {
    graph = read_graph(text, "fuzz.json");
  } catch (const CompileError& e) {
    if (e.diagnostics().count() == 0) std::abort();
    return 0;
  }
  std::string canonical = write_graph(graph);
  try {
    if (write_graph(read_graph(canonical, "canonical.json")) != canonical) std::abort();
  } catch (const CompileError&) {
    std::abort();  // the writer produced text its own reader rejects
  }
  try {
    validate(std::move(graph), registry);
  } catch (const CompileError& e) {
    if (e.diagnostics().count() == 0) std::abort();
  }
  return 0;
}
