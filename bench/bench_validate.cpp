// Reading and validating a large graph: 100 000 tasks in one JSON file.
// Target (issue #2): under 1 s on the 2-core CI machine. Baseline: nlohmann::json
// parsing the same text (a DOM alone, no checks).
//
// The graph is a long training-like stream: blocks of matmul, bias add and
// activation whose weights come from init tasks, so the validator resolves
// real dependencies, dtype variables and shape rules, not a trivial chain.
#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include "builder.h"
#include "graph_json.h"
#include "validate.h"

using namespace cudagen;

namespace {

TaskGraph make_graph(int tasks) {
  GraphBuilder b("bench");
  const int64_t rows = 64, width = 256;
  auto x = b.task("x0", "fill").tensor("out", DType::f32, {rows, width}).arg("value", 1.0);
  SlotRef current = x["out"];
  int n = 1;
  for (int layer = 0; n < tasks; ++layer) {
    std::string id = std::to_string(layer);
    auto w = b.task("w" + id, "uniform", Phase::init).tensor("out", DType::f32, {width, width}).arg("seed", layer);
    auto bias = b.task("b" + id, "fill", Phase::init).tensor("out", DType::f32, {width});
    auto mm = b.task("mm" + id, "matmul")
                  .tensor("a", current)
                  .tensor("b", w["out"])
                  .tensor("out", DType::f32, {rows, width});
    auto add = b.task("add" + id, "add")
                   .tensor("a", mm["out"])
                   .tensor("b", bias["out"])
                   .tensor("out", DType::f32, {rows, width});
    auto act = b.task("act" + id, layer % 2 ? "relu" : "gelu").tensor("x", add["out"]).tensor("out", DType::f32, {rows, width});
    current = act["out"];
    n += 5;
  }
  return std::move(b).graph();
}

void BM_ReadAndValidate(benchmark::State& state) {
  std::string text = write_graph(make_graph(int(state.range(0))));
  OpRegistry registry = builtin_registry();
  for (auto _ : state) {
    Program p = validate(read_graph(text), registry);
    benchmark::DoNotOptimize(p.buffers.size());
  }
  state.counters["tasks"] = double(state.range(0));
  state.counters["MB"] = double(text.size()) / 1e6;
}
BENCHMARK(BM_ReadAndValidate)->Arg(1000)->Arg(100000)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Read(benchmark::State& state) {
  std::string text = write_graph(make_graph(int(state.range(0))));
  for (auto _ : state) benchmark::DoNotOptimize(read_graph(text).tasks.size());
}
BENCHMARK(BM_Read)->Arg(100000)->Unit(benchmark::kMillisecond)->UseRealTime();

// Baseline for the ratio in bench/RESULTS.md: nlohmann::json parsing the same
// text into its DOM, with no locations, no checks and no model.
void BM_Baseline_NlohmannParse(benchmark::State& state) {
  std::string text = write_graph(make_graph(int(state.range(0))));
  for (auto _ : state) benchmark::DoNotOptimize(nlohmann::json::parse(text).size());
}
BENCHMARK(BM_Baseline_NlohmannParse)->Arg(100000)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
