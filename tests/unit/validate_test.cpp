// Every validation error: its message, where it points, and its hint.
#include <gtest/gtest.h>

#include "builder.h"
#include "test_util.h"

using namespace cudagen;
using namespace cudagen::testing;

namespace {

// A small valid forward graph: x -> matmul(w) -> relu -> out.
std::string layer(const std::string& matmul_b = R"({"from": "w.out"})", const std::string& relu_x = R"({"from": "mm.out"})",
                  const std::string& extra_task = "") {
  return graph_of(R"(
    {"id": "w", "op": "uniform", "phase": "init", "tensors": {"out": {"dtype": "f32", "shape": [64, 32]}}},
    {"id": "mm", "op": "matmul", "tensors": {"a": {"dtype": "f32", "shape": [8, 64], "storage": "external"},
                                             "b": )" + matmul_b + R"(, "out": {"dtype": "f32", "shape": [8, 32]}}},
    {"id": "act", "op": "relu", "tensors": {"x": )" + relu_x + R"(, "out": {"dtype": "f32", "shape": [8, 32]}}})" +
                  extra_task);
}

void expect_contains(const std::string& haystack, const std::string& needle) {
  EXPECT_NE(haystack.find(needle), std::string::npos) << "missing: " << needle << "\nin:\n" << haystack;
}

}  // namespace

TEST(Validate, AcceptsTheExamples) {
  for (const char* name : {"examples/mlp_train.json", "examples/transformer_block.json"})
    EXPECT_EQ(errors_of(read_text_file(source_path(name))), "") << name;
  EXPECT_EQ(errors_of(layer()), "");
}

TEST(Validate, UnknownOpSuggestsTheNearest) {
  std::string msg = errors_of(graph_of(R"({"id": "a", "op": "matmull"})"));
  expect_contains(msg, "t.json:1:58: error: task 'a' (/tasks/0/op): unknown op 'matmull'; did you mean 'matmul'?");
  expect_contains(msg, "hint: `cudagen ops` lists the ops of the registry");
}

TEST(Validate, MissingAndExtraSlots) {
  std::string msg = errors_of(graph_of(R"(
    {"id": "a", "op": "relu", "tensors": {"x": {"dtype": "f32", "shape": [4], "storage": "external"},
                                          "y": {"dtype": "f32", "shape": [4]}}})"));
  expect_contains(msg, "task 'a', slot 'y' (/tasks/0/tensors/y): op 'relu' has no tensor slot 'y'");
  expect_contains(msg, "hint: the tensor slots of relu are: x, out");
  expect_contains(msg, "task 'a', slot 'out' (/tasks/0/tensors): missing tensor slot 'out' (output of op 'relu')");
}

TEST(Validate, MissingAndExtraArguments) {
  std::string msg = errors_of(graph_of(R"(
    {"id": "w", "op": "uniform", "phase": "init", "tensors": {"out": {"dtype": "f32", "shape": [4]}}},
    {"id": "s", "op": "sgd", "phase": "update", "tensors": {"param": {"from": "w.out"}, "grad": {"from": "w.out"}},
     "args": {"learning_rate": 0.1, "grad": 1}})"));
  expect_contains(msg, "task 's', slot 'lr' (/tasks/1/args): missing argument 'lr' (float) of op 'sgd'; it has no default");
  expect_contains(msg, "op 'sgd' has no argument 'learning_rate'");
  expect_contains(msg, "hint: 'grad' is a tensor slot of sgd: move it to \"tensors\"");
}

TEST(Validate, AFloatArgumentBeyondF32sRangeIsRefused) {
  // Found by fuzz.compile_sample_builds: eps 1e106 became `inff` in the generated code.
  std::string msg = errors_of(graph_of(R"(
    {"id": "w", "op": "fill", "phase": "init", "tensors": {"out": {"dtype": "f32", "shape": [4]}}, "args": {"value": 1.0}},
    {"id": "n", "op": "rmsnorm", "tensors": {"x": {"dtype": "f32", "shape": [2, 4], "storage": "external"},
     "weight": {"from": "w.out"}, "out": {"dtype": "f32", "shape": [2, 4], "storage": "external"}}, "args": {"eps": 1e106}})"));
  expect_contains(msg, "task 'n', slot 'eps'");
  expect_contains(msg, "argument 'eps' is 1e+106, beyond f32's range (about 3.4e38): kernels take it as an f32");
  EXPECT_EQ(errors_of(graph_of(R"(
    {"id": "w", "op": "fill", "phase": "init", "tensors": {"out": {"dtype": "f32", "shape": [4]}}, "args": {"value": 3e38}})")),
            "");
}

TEST(Validate, DependencyOnAMissingTaskOrSlot) {
  std::string msg = errors_of(layer(R"({"from": "ww.out"})", R"({"from": "mm.output"})"));
  expect_contains(msg, "task 'mm', slot 'b' (/tasks/1/tensors/b/from): depends on 'ww.out', but there is no task 'ww'; did you mean 'w'?");
  expect_contains(msg, "task 'act', slot 'x' (/tasks/2/tensors/x/from): depends on 'mm.output', but task 'mm' has no tensor slot 'output'; did you mean 'out'?");
  expect_contains(msg, "hint: the tensor slots of 'mm' are: a, b, out");
}

TEST(Validate, ProducerConsumerDtypeAndShapeMismatch) {
  std::string msg = errors_of(layer(R"({"from": "w.out", "dtype": "f16"})", R"({"from": "mm.out", "shape": [8, 33]})"));
  expect_contains(msg, "task 'mm', slot 'b' (/tasks/1/tensors/b/dtype): dtype mismatch: this slot says f16, but its producer w.out is f32");
  expect_contains(msg, "task 'act', slot 'x' (/tasks/2/tensors/x/shape): shape mismatch: this slot says [8, 33], but its producer mm.out is [8, 32]");
}

TEST(Validate, ShapeRuleViolation) {
  std::string msg = errors_of(graph_of(R"(
    {"id": "mm", "op": "matmul", "tensors": {"a": {"dtype": "f32", "shape": [8, 64], "storage": "external"},
       "b": {"dtype": "f32", "shape": [65, 32], "storage": "external"}, "out": {"dtype": "f32", "shape": [8, 32]}}})"));
  expect_contains(msg, "task 'mm', slot 'b' (/tasks/0/tensors/b): shape mismatch: b[0] is 65, but it must equal K = 64 (from a[1])");
}

TEST(Validate, ShapeRuleFollowsTransposeArguments) {
  std::string ok = graph_of(R"(
    {"id": "mm", "op": "matmul", "args": {"trans_a": true},
     "tensors": {"a": {"dtype": "f32", "shape": [64, 8], "storage": "external"},
       "b": {"dtype": "f32", "shape": [64, 32], "storage": "external"}, "out": {"dtype": "f32", "shape": [8, 32]}}})");
  EXPECT_EQ(errors_of(ok), "");
  std::string bad = ok;
  bad.replace(bad.find("true"), 4, "false");
  expect_contains(errors_of(bad), "b[0] is 64, but it must equal K = 8 (from a[1])");
}

TEST(Validate, BroadcastRule) {
  auto add = [](const std::string& b_shape, const std::string& out_shape) {
    return graph_of(R"({"id": "s", "op": "add", "tensors": {"a": {"dtype": "f32", "shape": [4, 3], "storage": "external"},
       "b": {"dtype": "f32", "shape": )" + b_shape + R"(, "storage": "external"}, "out": {"dtype": "f32", "shape": )" +
                    out_shape + "}}}");
  };
  EXPECT_EQ(errors_of(add("[3]", "[4, 3]")), "");
  EXPECT_EQ(errors_of(add("[2, 1, 3]", "[2, 4, 3]")), "");
  expect_contains(errors_of(add("[2]", "[4, 3]")), "a[0:2] ([4, 3]) and b[0:1] ([2]) do not broadcast");
  expect_contains(errors_of(add("[3]", "[4, 4]")), "out is [4, 4], but broadcasting [4, 3] with [3] gives [4, 3]");
}

TEST(Validate, CycleIsPrinted) {
  std::string msg = errors_of(graph_of(R"(
    {"id": "a", "op": "relu", "tensors": {"x": {"from": "c.out"}, "out": {"dtype": "f32", "shape": [4]}}},
    {"id": "b", "op": "relu", "tensors": {"x": {"from": "a.out"}, "out": {"dtype": "f32", "shape": [4]}}},
    {"id": "c", "op": "relu", "tensors": {"x": {"from": "b.out"}, "out": {"dtype": "f32", "shape": [4]}}})"));
  expect_contains(msg, "tasks depend on each other in a cycle: a -> b -> c -> a");
}

TEST(Validate, SelfDependencyIsACycle) {
  std::string msg = errors_of(graph_of(R"(
    {"id": "a", "op": "add", "tensors": {"a": {"dtype": "f32", "shape": [4], "storage": "external"},
      "b": {"from": "a.out"}, "out": {"dtype": "f32", "shape": [4]}}})"));
  expect_contains(msg, "tasks depend on each other in a cycle: a -> a");
}

TEST(Validate, ATaskMayReadOneInputThroughTwoSlots) {
  // x * x on a graph input: b reads the tensor a declares.
  EXPECT_EQ(errors_of(graph_of(R"(
    {"id": "sq", "op": "mul", "tensors": {"a": {"dtype": "f32", "shape": [4], "storage": "external"},
      "b": {"from": "sq.a"}, "out": {"dtype": "f32", "shape": [4]}}})")), "");
  // Reading a slot the op writes is still a cycle: an optimizer's parameter.
  std::string msg = errors_of(graph_of(R"(
    {"id": "w", "op": "uniform", "phase": "init", "tensors": {"out": {"dtype": "f32", "shape": [4]}}},
    {"id": "s", "op": "sgd", "phase": "update", "tensors": {"param": {"from": "w.out"}, "grad": {"from": "s.param"}},
     "args": {"lr": 0.1}})"));
  expect_contains(msg, "tasks depend on each other in a cycle: s -> s");
}

TEST(Validate, SlotDependencyCycleWithNoProducer) {
  std::string msg = errors_of(graph_of(R"(
    {"id": "a", "op": "relu", "tensors": {"x": {"from": "b.x"}, "out": {"dtype": "f32", "shape": [4]}}},
    {"id": "b", "op": "relu", "tensors": {"x": {"from": "a.x"}, "out": {"dtype": "f32", "shape": [4]}}})"));
  expect_contains(msg, "slot dependencies form a cycle with no producer: a.x <- b.x <- a.x");
  EXPECT_EQ(msg.find("cycle with no producer", msg.find("cycle with no producer") + 1), std::string::npos)
      << "reported once, not once per slot:\n" << msg;
}

TEST(Validate, DuplicateTaskIds) {
  std::string msg = errors_of(layer(R"({"from": "w.out"})", R"({"from": "mm.out"})",
                                    R"(, {"id": "mm", "op": "fill", "tensors": {"out": {"dtype": "f32", "shape": [1]}}})"));
  expect_contains(msg, "task 'mm' (/tasks/3/id): duplicate task id 'mm'; it is first used at /tasks/1");
}

TEST(Validate, ElementCountOverflowAndSizeLimit) {
  std::string msg = errors_of(graph_of(R"(
    {"id": "big", "op": "fill", "tensors": {"out": {"dtype": "f32", "shape": [4294967296, 4294967296]}}},
    {"id": "huge", "op": "fill", "tensors": {"out": {"dtype": "f64", "shape": [1099511627776, 2]}}})"));
  expect_contains(msg, "task 'big', slot 'out' (/tasks/0/tensors/out/shape): shape [4294967296, 4294967296] has more elements than a 64-bit count can hold");
  expect_contains(msg, "task 'huge', slot 'out' (/tasks/1/tensors/out/shape): f64 [1099511627776, 2] takes 17592186044416 bytes, over the limit of 1099511627776 bytes for one tensor");
  ValidateOptions tight;
  tight.max_tensor_bytes = 1000;
  expect_contains(errors_of(layer(), tight), "f32 [64, 32] takes 8192 bytes, over the limit of 1000 bytes");
}

TEST(Validate, ForwardTaskCannotDependOnBackward) {
  std::string msg = errors_of(graph_of(R"(
    {"id": "g", "op": "fill", "phase": "backward", "tensors": {"out": {"dtype": "f32", "shape": [4]}}},
    {"id": "f", "op": "relu", "phase": "forward", "tensors": {"x": {"from": "g.out"}, "out": {"dtype": "f32", "shape": [4]}}})"));
  expect_contains(msg, "task 'f', slot 'x' (/tasks/1/tensors/x/from): a forward task cannot depend on backward task 'g': phases run in the order init, forward, backward, update");
}

TEST(Validate, DtypeRules) {
  std::string msg = errors_of(graph_of(R"(
    {"id": "s", "op": "add", "tensors": {"a": {"dtype": "f32", "shape": [4], "storage": "external"},
      "b": {"dtype": "f16", "shape": [4], "storage": "external"}, "out": {"dtype": "f32", "shape": [4]}}},
    {"id": "r", "op": "relu", "tensors": {"x": {"dtype": "i32", "shape": [4], "storage": "external"},
      "out": {"dtype": "i32", "shape": [4]}}},
    {"id": "e", "op": "embedding", "tensors": {"table": {"dtype": "f32", "shape": [10, 4], "storage": "persistent"},
      "ids": {"dtype": "f32", "shape": [3], "storage": "external"}, "out": {"dtype": "f32", "shape": [3, 4]}}})"));
  expect_contains(msg, "'b' is f16, but 'a' is f32; op 'add' needs them to have the same dtype");
  expect_contains(msg, "op 'relu' does not support dtype i32 for 'x'; it takes f32, f16, bf16, f64");
  expect_contains(msg, "op 'embedding' does not support dtype f32 for 'ids'; it takes i32, i64");
}

TEST(Validate, ArgumentTypesAndChoices) {
  std::string msg = errors_of(graph_of(R"(
    {"id": "g", "op": "gelu", "tensors": {"x": {"dtype": "f32", "shape": [4], "storage": "external"},
      "out": {"dtype": "f32", "shape": [4]}}, "args": {"approximate": "tan"}},
    {"id": "m", "op": "matmul", "args": {"trans_a": 1},
     "tensors": {"a": {"dtype": "f32", "shape": [2, 2], "storage": "external"},
       "b": {"dtype": "f32", "shape": [2, 2], "storage": "external"}, "out": {"dtype": "f32", "shape": [2, 2]}}})"));
  expect_contains(msg, "argument 'approximate' cannot be \"tan\"; did you mean 'tanh'?");
  expect_contains(msg, "hint: it is one of: tanh, erf");
  expect_contains(msg, "argument 'trans_a' must be bool, not 1");
}

TEST(Validate, StorageRules) {
  std::string msg = errors_of(graph_of(R"(
    {"id": "a", "op": "relu", "tensors": {"x": {"dtype": "f32", "shape": [4]}, "out": {"dtype": "f32", "shape": [4]}}},
    {"id": "b", "op": "relu", "tensors": {"x": {"from": "a.out", "storage": "saved"}, "out": {"from": "a.out"}}},
    {"id": "c", "op": "relu", "tensors": {"x": {"dtype": "f32", "shape": [4], "storage": "transient"}, "out": {"dtype": "f32"}}})"));
  expect_contains(msg, "task 'b', slot 'x' (/tasks/1/tensors/x/storage): a slot with \"from\" shares its producer's storage, so it cannot set \"storage\"");
  expect_contains(msg, "task 'b', slot 'out' (/tasks/1/tensors/out/from): 'out' is an output of op 'relu'; an output owns its storage");
  expect_contains(msg, "task 'c', slot 'x' (/tasks/2/tensors/x/storage): 'x' is read by the op but owns transient storage that no task writes");
  expect_contains(msg, "task 'c', slot 'out' (/tasks/2/tensors/out): slot owns storage but has no shape");
  EXPECT_EQ(errors_of(layer()), "") << "an input slot with no storage class defaults to external";
}

TEST(Validate, OnlyScalarArgumentsChangeAtRunTime) {
  std::string msg = errors_of(graph_of(R"(
    {"id": "g", "op": "gelu", "tensors": {"x": {"dtype": "f32", "shape": [4], "storage": "external"},
      "out": {"dtype": "f32", "shape": [4]}}, "args": {"approximate": {"value": "erf", "runtime": true}}})"));
  expect_contains(msg, "argument 'approximate' is string; only scalar (float, int, bool) arguments can change at run time");
}

TEST(Validate, ShapeDecidingArgumentsMustBeConstant) {
  std::string msg = errors_of(graph_of(R"(
    {"id": "m", "op": "matmul", "args": {"trans_a": {"value": false, "runtime": true}},
     "tensors": {"a": {"dtype": "f32", "shape": [2, 2], "storage": "external"},
       "b": {"dtype": "f32", "shape": [2, 2], "storage": "external"}, "out": {"dtype": "f32", "shape": [2, 2]}}})"));
  expect_contains(msg, "argument 'trans_a' decides shapes, so it must be a constant");
}

TEST(Validate, TransientReadInALaterPhaseBecomesSaved) {
  Program p = validate(read_graph(read_text_file(source_path("examples/mlp_train.json"))), builtin_registry());
  for (const auto& b : p.buffers) {
    std::string name = p.tasks[size_t(b.owner_task)].task->id + "." + b.owner_slot;
    if (name == "act1.out" || name == "dw1.out") {
      EXPECT_EQ(b.storage, Storage::saved) << name;
      EXPECT_TRUE(b.promoted) << name;
    }
    if (name == "fc1.out") EXPECT_EQ(b.storage, Storage::transient) << name;
    if (name == "w1_init.out") EXPECT_EQ(b.storage, Storage::persistent) << "init outputs persist";
  }
}

TEST(Validate, ReportsAllErrorsUpToTheLimit) {
  std::string tasks;
  for (int i = 0; i < 60; ++i) tasks += (i ? "," : "") + std::string(R"({"id": "t)") + std::to_string(i) + R"(", "op": "nope"})";
  ValidateOptions options;
  options.error_limit = 10;
  std::string msg = errors_of(graph_of(tasks), options);
  EXPECT_NE(msg.find("t9"), std::string::npos);
  EXPECT_EQ(msg.find("'t10'"), std::string::npos);
  expect_contains(msg, "... and 50 more errors not shown");
  expect_contains(msg, "60 errors");
}

TEST(Validate, EmptyGraph) { expect_contains(errors_of(graph_of("")), "the graph has no tasks"); }

TEST(Validate, ResolvesBuffersThroughChains) {
  // act.x -> mm.out; a consumer of act.x shares mm.out's buffer.
  Program p = validate(read_graph(layer(R"({"from": "w.out"})", R"({"from": "mm.out"})",
                                        R"(, {"id": "z", "op": "relu", "tensors": {"x": {"from": "act.x"}, "out": {"dtype": "f32", "shape": [8, 32]}}})")),
                       builtin_registry());
  EXPECT_EQ(p.tasks[3].find_tensor("x")->buffer, p.tasks[1].find_tensor("out")->buffer);
  EXPECT_EQ(p.tasks[3].deps, (std::vector<int>{2}));
}

TEST(Validate, SplitTakesItsCutFromTheOutputs) {
  std::string msg = errors_of(graph_of(R"({"id": "s", "op": "split",
      "tensors": {"x": {"dtype": "f32", "shape": [2, 10], "storage": "external"},
                  "a": {"dtype": "f32", "shape": [2, 4], "storage": "external"},
                  "b": {"dtype": "f32", "shape": [2, 5], "storage": "external"}}})"));
  EXPECT_NE(msg.find("task 's', slot 'x' (/tasks/0/tensors/x): shape mismatch: x[1] is 10, but it must equal A + B = 9"),
            std::string::npos)
      << msg;
}

// A slot's own tensor name ("name") and value file ("data"): where they may
// stand, and that names are unique.
TEST(Validate, TensorNamesAndDataFiles) {
  const std::string named = R"({"dtype": "f32", "shape": [64, 32], "storage": "persistent", "name": "fc.weight", "data": "fc.weight.npy"})";
  EXPECT_EQ(errors_of(layer(named)), "");
  std::string msg = errors_of(layer(R"({"from": "w.out", "name": "fc.weight"})"));
  expect_contains(msg, "a slot with \"from\" shares w.out's tensor, so it cannot give it a name");
  expect_contains(msg, "/tasks/1/tensors/b/name");
  msg = errors_of(layer(R"({"from": "w.out"})", R"({"from": "mm.out"})",
                        R"(, {"id": "act2", "op": "relu", "tensors": {"x": {"dtype": "f32", "shape": [4], "storage": "external", "name": "in"}, "out": {"dtype": "f32", "shape": [4], "name": "in"}}})"));
  expect_contains(msg, "tensor name 'in' is already the name of act2.x");
  msg = errors_of(layer(R"({"from": "w.out"})", R"({"from": "mm.out"})",
                        R"(, {"id": "act2", "op": "relu", "tensors": {"x": {"dtype": "f32", "shape": [4], "storage": "external", "name": "mm.out"}, "out": {"dtype": "f32", "shape": [4], "data": "o.npy"}}})"));
  expect_contains(msg, "tensor name 'mm.out' is another slot's task.slot");
  expect_contains(msg, "'out' is an output of op 'relu': the task computes it, so it cannot load \"data\"");
  msg = errors_of(layer(R"({"dtype": "f32", "shape": [64, 32], "storage": "persistent", "name": "bad name"})"));
  expect_contains(msg, "tensor name \"bad name\" is not a file name");
}

// A named tensor is called by its name in reports and the manifest, and its
// data path resolves against the graph file's folder.
TEST(Validate, NamedTensorsKeepTheirNamesAndResolveDataAgainstTheGraphsFolder) {
  TaskGraph g = read_graph(layer(R"({"dtype": "f32", "shape": [64, 32], "storage": "persistent", "name": "fc.weight", "data": "w/fc.weight.npy"})"));
  g.base_dir = "/models/mlp";
  Program p = validate(std::move(g), builtin_registry(), {});
  bool found = false;
  for (size_t b = 0; b < p.buffers.size(); ++b)
    if (buffer_name(p, int(b)) == "fc.weight") {
      found = true;
      EXPECT_EQ(p.buffers[b].data, "/models/mlp/w/fc.weight.npy");
    }
  EXPECT_TRUE(found);
  EXPECT_EQ(write_graph(read_graph(write_graph(p.graph))), write_graph(p.graph));  // name and data round-trip
  EXPECT_NE(write_graph(p.graph).find(R"("name": "fc.weight", "data": "w/fc.weight.npy")"), std::string::npos);
}

// Kernels take a row's length and a tensor's row count as 32-bit ints: a
// dimension of 2^31 compiled to a loop that never ran (issue #34). Refused,
// at the dimension.
TEST(Validate, DimensionsAKernelCannotIndexAreRefused) {
  const std::string too_long = errors_of(graph_of(
      R"({"id": "s", "op": "softmax", "tensors": {"x": {"dtype": "f32", "shape": [2, 2147483648]}, )"
      R"("out": {"dtype": "f32", "shape": [2, 2147483648]}}})"));
  EXPECT_NE(too_long.find("task 's', slot 'x' (/tasks/0/tensors/x/shape/1): dimension 2147483648 of shape [2, 2147483648] "
                          "is over 2147483647, the most a kernel indexes along one axis"),
            std::string::npos)
      << too_long;
  EXPECT_NE(too_long.find("hint: split the tensor along that axis into several tasks"), std::string::npos) << too_long;
  const std::string many_rows = errors_of(graph_of(
      R"({"id": "s", "op": "softmax", "tensors": {"x": {"dtype": "f32", "shape": [65536, 65536, 2]}, )"
      R"("out": {"dtype": "f32", "shape": [65536, 65536, 2]}}})"));
  EXPECT_NE(many_rows.find("shape [65536, 65536, 2] has 4294967296 rows (all axes but the last), over 2147483647"),
            std::string::npos)
      << many_rows;
  // At the limit itself: accepted.
  EXPECT_EQ(errors_of(graph_of(R"({"id": "s", "op": "softmax", "tensors": {"x": {"dtype": "f32", "shape": [1, 2147483647]}, )"
                               R"("out": {"dtype": "f32", "shape": [1, 2147483647]}}})")),
            "");
}
