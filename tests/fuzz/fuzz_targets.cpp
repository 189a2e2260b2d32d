// The fuzz targets: one libFuzzer binary, the target chosen by the
// environment variable CUDAGEN_FUZZ_TARGET (so that the generator's sources
// are rebuilt with the sanitizers once, not once per target). Properties
// beyond "no crash, no sanitizer report, no hang" are checked per target;
// a broken one aborts with a message, which libFuzzer reports as a crash.
//
//   graph_reader  bytes -> read_graph -> write_graph -> read_graph (canonical
//                 form is a fixed point) -> validate
//   shape_rule    line 1 a shape rule, line 2 a formula, the rest bytes that
//                 give each slot a shape and each name a value -> parse,
//                 check, evaluate
//   registry      bytes -> OpRegistry::from_json
//   npy           bytes -> parse_npy (shape and data size agree)
//   buffer_csv    bytes -> read_buffer_csv -> place (verified, never under
//                 the lower bound)
//   compile       bytes -> read, validate, derive -> fuse, plan, emit twice
//                 (byte-identical output)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <string_view>

#include "derive.h"
#include "diagnostics.h"
#include "graph_json.h"
#include "npy.h"
#include "pipeline.h"
#include "placement.h"
#include "registry.h"
#include "shape_rule.h"
#include "validate.h"

using namespace cudagen;

namespace {

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "fuzz property broken: %s\n", what);
  std::abort();
}

const OpRegistry& registry() {
  static const OpRegistry parsed = builtin_registry();  // parsed once: the harness's only state
  return parsed;
}

void graph_reader(std::string_view text) {
  TaskGraph graph;
  try {
    graph = read_graph(text, "fuzz.json");
  } catch (const CompileError& e) {
    if (e.diagnostics().count() == 0) broken("a rejected graph without a diagnostic");
    return;
  }
  const std::string canonical = write_graph(graph);
  try {
    if (write_graph(read_graph(canonical, "canonical.json")) != canonical) broken("canonical form is no fixed point");
  } catch (const CompileError&) {
    broken("the writer produced text its own reader rejects");
  }
  try {
    validate(std::move(graph), registry());
  } catch (const CompileError& e) {
    if (e.diagnostics().count() == 0) broken("an invalid graph without a diagnostic");
  }
}

// A little-endian reader of the bytes after the text lines: each slot of the
// rule gets a shape of up to 5 dimensions below 64 (0 included), each name a
// value in [-4, 60); when the bytes run out, everything is 1.
struct ByteSource {
  std::string_view bytes;
  size_t at = 0;
  unsigned next() { return at < bytes.size() ? static_cast<unsigned char>(bytes[at++]) : 1u; }
};

void shape_rule(std::string_view input) {
  const size_t line1 = std::min(input.find('\n'), input.size());
  const std::string_view rule_text = input.substr(0, line1);
  std::string_view rest = line1 < input.size() ? input.substr(line1 + 1) : std::string_view();
  const size_t line2 = std::min(rest.find('\n'), rest.size());
  const std::string_view formula_text = rest.substr(0, line2);
  ByteSource source{line2 < rest.size() ? rest.substr(line2 + 1) : std::string_view()};
  ShapeRule rule;
  try {
    rule = parse_shape_rule(rule_text);
  } catch (const ShapeRuleSyntaxError& e) {
    if (std::strlen(e.what()) == 0) broken("a syntax error without a message");
    return;
  }
  std::map<std::string, Shape, std::less<>> shapes;
  for (const auto* patterns : {&rule.inputs, &rule.outputs})
    for (const SlotPattern& p : *patterns) {
      if (shapes.count(p.slot)) continue;
      Shape shape(source.next() % 6);
      for (int64_t& d : shape) d = source.next() % 64;
      shapes.emplace(p.slot, std::move(shape));
    }
  std::map<std::string, int64_t, std::less<>> values;
  ShapeEnv env;
  env.shape_of = [&](std::string_view slot) -> const Shape* {
    const auto it = shapes.find(slot);
    return it == shapes.end() ? nullptr : &it->second;
  };
  env.is_arg = [&](std::string_view arg) { return !arg.empty() && arg[0] >= 'a' && arg[0] <= 'z'; };
  env.arg_of = [&](std::string_view arg) -> std::optional<int64_t> {
    auto it = values.find(arg);
    if (it == values.end()) it = values.emplace(std::string(arg), int64_t(source.next() % 64) - 4).first;
    return it->second;
  };
  for (const ShapeMismatch& m : check_shape_rule(rule, env))
    if (m.message.empty()) broken("a mismatch without a message");
  try {
    const DimExpr formula = parse_rule_formula(formula_text);
    (void)evaluate_rule_formula(formula, rule, env);
  } catch (const ShapeRuleSyntaxError&) {
  }
}

void registry_reader(std::string_view text) {
  try {
    const OpRegistry parsed = OpRegistry::from_json(text, "fuzz.registry.json");
    for (const OpSignature& op : parsed.ops())
      if (parsed.find(op.name) == nullptr) broken("an op the registry cannot find by its name");
  } catch (const CompileError& e) {
    if (e.diagnostics().count() == 0) broken("a rejected registry without a diagnostic");
  }
}

void npy(std::string_view bytes) {
  try {
    const HostTensor t = parse_npy(bytes, "fuzz.npy");
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    if (int64_t(t.data.size()) != n * dtype_bytes(t.dtype)) broken("data size and shape disagree");
  } catch (const std::runtime_error& e) {
    if (std::string_view(e.what()).find("fuzz.npy") == std::string_view::npos) broken("an error that names no file");
  }
}

void buffer_csv(std::string_view text) {
  BufferList list;
  try {
    list = read_buffer_csv(std::string(text), "fuzz.csv");
  } catch (const std::runtime_error& e) {
    if (std::string_view(e.what()).find("fuzz.csv") == std::string_view::npos) broken("an error that names no file");
    return;
  }
  PlacementOptions options;
  options.search_steps = 2000;  // the search's logic, not its patience
  const Placement p = place_buffers(list.intervals, options);
  if (!verify_placement(list.intervals, p.offsets, p.arena_bytes, options.alignment).empty()) broken("an invalid placement");
  if (p.arena_bytes < lower_bound_bytes(list.intervals, options.alignment)) broken("a placement under the lower bound");
}

// read, validate, and derive where the graph trains (pipeline.cpp's
// validate_and_derive, with the registry parsed once).
Program load(std::string_view text) {
  Program program = validate(read_graph(text, "fuzz.json"), registry());
  if (!program.graph.training) return program;
  DerivedGraph derived = derive_training(program, *program.graph.training);
  return validate(std::move(derived.graph), registry());
}

void compile_graph(std::string_view text) {
  Program program;
  try {
    program = load(text);
  } catch (const CompileError& e) {
    if (e.diagnostics().count() == 0) broken("a rejected graph without a diagnostic");
    return;
  }
  CompileOptions options;
  options.plan.placement.search_steps = 2000;
  try {
    const Compiled first = compile(std::move(program), options);
    const Compiled second = compile(load(text), options);
    if (first.emitted.cuda_source != second.emitted.cuda_source || first.emitted.manifest_json != second.emitted.manifest_json)
      broken("two compiles of one graph differ");
  } catch (const CompileError& e) {
    // The passes after validation refuse what no kernel can run (a plan over
    // a budget, an op without a template), always with a diagnostic.
    if (e.diagnostics().count() == 0) broken("a refused program without a diagnostic");
  }
}

using FuzzTarget = void (*)(std::string_view);
FuzzTarget target = nullptr;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const std::map<std::string, FuzzTarget> targets = {
      {"graph_reader", graph_reader}, {"shape_rule", shape_rule}, {"registry", registry_reader},
      {"npy", npy},                   {"buffer_csv", buffer_csv}, {"compile", compile_graph}};
  const char* name = std::getenv("CUDAGEN_FUZZ_TARGET");
  const auto it = targets.find(name != nullptr ? name : "");
  if (it == targets.end()) {
    std::fprintf(stderr, "set CUDAGEN_FUZZ_TARGET to one of:");
    for (const auto& [n, t] : targets) std::fprintf(stderr, " %s", n.c_str());
    std::fprintf(stderr, "\n");
    std::exit(2);
  }
  target = it->second;
  (void)registry();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  target(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
