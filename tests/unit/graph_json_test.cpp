#include <fmt/format.h>
#include <gtest/gtest.h>

#include "builder.h"
#include "test_util.h"

using namespace cudagen;
using namespace cudagen::testing;

namespace {

const char* kAllFeatures = R"({
  "format": "cudagen.taskgraph/1",
  "name": "features",
  "tasks": [
    {
      "id": "w",
      "op": "uniform",
      "phase": "init",
      "tensors": {
        "out": {"dtype": "bf16", "shape": [4, 8], "storage": "persistent"}
      },
      "args": {
        "low": -0.5,
        "high": 0.5,
        "seed": 7
      }
    },
    {
      "id": "opt",
      "op": "adam",
      "phase": "update",
      "tensors": {
        "param": {"from": "w.out"},
        "grad": {"from": "w.out", "dtype": "bf16", "shape": [4, 8]}
      },
      "args": {
        "lr": {"value": 0.001, "runtime": true},
        "step": {"from": "other.step"},
        "sizes": [1, 2, 3],
        "ratios": [0.5, 1.0],
        "name": "x\"y",
        "flag": false
      }
    }
  ],
  "training": {"loss": "w.out", "optimizer": "adam", "precision": "bf16"}
}
)";

}  // namespace

TEST(GraphJson, ReadsEveryField) {
  TaskGraph g = read_graph(kAllFeatures);
  EXPECT_EQ(g.name, "features");
  ASSERT_EQ(g.tasks.size(), 2u);
  const Task& w = g.tasks[0];
  EXPECT_EQ(w.phase, Phase::init);
  ASSERT_EQ(w.tensors.size(), 1u);
  EXPECT_EQ(w.tensors[0].dtype, DType::bf16);
  EXPECT_EQ(*w.tensors[0].shape, (Shape{4, 8}));
  EXPECT_EQ(w.tensors[0].storage, Storage::persistent);
  EXPECT_EQ(std::get<int64_t>(*w.find_arg("seed")->value), 7);
  EXPECT_EQ(std::get<double>(*w.find_arg("low")->value), -0.5);
  const Task& opt = g.tasks[1];
  EXPECT_EQ(opt.find_tensor("param")->from, (SlotRef{"w", "out"}));
  EXPECT_EQ(opt.find_tensor("grad")->dtype, DType::bf16);
  EXPECT_TRUE(opt.find_arg("lr")->runtime);
  EXPECT_EQ(opt.find_arg("step")->from, (SlotRef{"other", "step"}));
  EXPECT_EQ(std::get<std::vector<int64_t>>(*opt.find_arg("sizes")->value), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(std::get<std::vector<double>>(*opt.find_arg("ratios")->value), (std::vector<double>{0.5, 1.0}));
  EXPECT_EQ(std::get<std::string>(*opt.find_arg("name")->value), "x\"y");
  EXPECT_EQ(std::get<bool>(*opt.find_arg("flag")->value), false);
  EXPECT_EQ(opt.tensors[0].loc.line, 23);
  ASSERT_TRUE(g.training.has_value());
  EXPECT_EQ(g.training->optimizer, "adam");
  EXPECT_EQ(g.training->precision, DType::bf16);
}

TEST(GraphJson, CanonicalTextRoundTripsByteForByte) {
  EXPECT_EQ(write_graph(read_graph(kAllFeatures)), kAllFeatures);
}

TEST(GraphJson, ExamplesAreInCanonicalForm) {
  for (const char* name : {"examples/mlp_train.json", "examples/transformer_block.json", "examples/mlp_derived.json"}) {
    std::string text = read_text_file(source_path(name));
    EXPECT_EQ(write_graph(read_graph(text, name)), text) << name << " is not canonical: run `cudagen format`";
  }
}

TEST(GraphJson, NonCanonicalInputBecomesCanonicalAndStaysSo) {
  std::string messy = R"({"tasks":[{"args":{"value":1},"phase":"init","op":"fill","id":"z",
      "tensors":{"out":{"storage":"persistent","shape":[3],"dtype":"f32"}}}],"format":"cudagen.taskgraph/1"})";
  std::string once = write_graph(read_graph(messy));
  EXPECT_EQ(write_graph(read_graph(once)), once);
  EXPECT_NE(once.find(R"("out": {"dtype": "f32", "shape": [3], "storage": "persistent"})"), std::string::npos) << once;
  EXPECT_NE(once.find(R"("value": 1)"), std::string::npos) << "an integer stays an integer";
}

TEST(GraphJson, MalformedJsonNamesLineAndColumn) {
  std::string text = "{\n  \"format\": \"cudagen.taskgraph/1\",\n  \"tasks\": [\n    {\"id\": \"a\",}\n  ]\n}\n";
  try {
    read_graph(text, "bad.json");
    FAIL();
  } catch (const CompileError& e) {
    EXPECT_EQ(e.diagnostics().format(), "bad.json:4:16: error: malformed JSON: expected a quoted key\n");
  }
}

TEST(GraphJson, UnknownFieldSuggestsTheNearestOne) {
  std::string msg = errors_of(graph_of(R"({"id": "a", "op": "relu", "phse": "forward"})"));
  EXPECT_NE(msg.find("t.json:1:92: error: task 'a' (/tasks/0/phse): unknown field \"phse\"; did you mean 'phase'?"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("the fields allowed here are: id, op, phase, tensors, args"), std::string::npos) << msg;
}

TEST(GraphJson, StructuralErrorsAreAllReported) {
  std::string msg = errors_of(graph_of(R"(
    {"id": "1bad", "op": "relu", "phase": "sideways",
     "tensors": {"x": {"dtype": "f33", "shape": [0, 2]}, "out": {"from": "nodot"}},
     "args": {"k": {"value": 1, "from": "a.b"}}})"));
  for (const char* want : {"task id \"1bad\" is not an identifier", "unknown phase \"sideways\"", "unknown dtype \"f33\"",
                           "/tasks/0/tensors/x/shape/0", "a dimension must be a positive integer",
                           "\"nodot\" is not a slot reference", "either \"value\" or \"from\", not both", "6 errors"})
    EXPECT_NE(msg.find(want), std::string::npos) << "missing: " << want << "\nin:\n" << msg;
}

// "training" asks the derive pass for backward and update tasks.
TEST(GraphJson, ReadsTheTrainingSection) {
  TaskGraph g = read_graph(read_text_file(source_path("examples/mlp_derived.json")));
  ASSERT_TRUE(g.training.has_value());
  EXPECT_EQ(g.training->loss.str(), "loss.loss");
  EXPECT_EQ(g.training->optimizer, "sgd");
  ASSERT_EQ(g.training->optimizer_args.size(), 2u);
  EXPECT_EQ(g.training->optimizer_args[1].name, "momentum");
  std::string text = R"({"format": "cudagen.taskgraph/1", "tasks": [], "training": {"optimiser": "sgd", "loss": "nodot"}})";
  std::string msg;
  try {
    read_graph(text, "t.json");
  } catch (const CompileError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("t.json:1:74: error: /training/optimiser: unknown field \"optimiser\"; did you mean 'optimizer'?"), std::string::npos) << msg;
  EXPECT_NE(msg.find("t.json:1:89: error: /training/loss: \"nodot\" is not a slot reference"), std::string::npos) << msg;
}

TEST(GraphJson, ClipGradNormRoundTripsAndMustBeAPositiveNumber) {
  TaskGraph g = read_graph(read_text_file(source_path("examples/mlp_derived.json")));
  g.training->clip_grad_norm = 0.25;
  const std::string text = write_graph(g);
  EXPECT_NE(text.find("\"clip_grad_norm\": 0.25"), std::string::npos) << text;
  EXPECT_EQ(read_graph(text).training->clip_grad_norm, 0.25);
  for (const char* bad : {"0", "-1", "\"1\"", "1e39"}) {
    std::string msg = errors_of(fmt::format(
        R"({{"format": "cudagen.taskgraph/1", "tasks": [], "training": {{"loss": "a.b", "clip_grad_norm": {}}}}})", bad));
    EXPECT_NE(msg.find("/training/clip_grad_norm: \"clip_grad_norm\""), std::string::npos) << bad << ": " << msg;
  }
}

TEST(GraphJson, AccumulateGradientsRoundTripsAndMustBeABoolean) {
  TaskGraph g = read_graph(read_text_file(source_path("examples/mlp_derived.json")));
  EXPECT_EQ(write_graph(g).find("accumulate_gradients"), std::string::npos);
  g.training->accumulate_gradients = true;
  const std::string text = write_graph(g);
  EXPECT_NE(text.find("\"accumulate_gradients\": true"), std::string::npos) << text;
  EXPECT_TRUE(read_graph(text).training->accumulate_gradients);
  for (const char* bad : {"1", "\"yes\"", "null"}) {
    std::string msg = errors_of(fmt::format(
        R"({{"format": "cudagen.taskgraph/1", "tasks": [], "training": {{"loss": "a.b", "accumulate_gradients": {}}}}})",
        bad));
    EXPECT_NE(msg.find("/training/accumulate_gradients: \"accumulate_gradients\" must be true or false"),
              std::string::npos)
        << bad << ": " << msg;
  }
}

TEST(GraphJson, LossScaleIsDynamicOrGradScalersArgumentsAndRoundTrips) {
  const std::string head = R"({"format": "cudagen.taskgraph/1", "tasks": [], "training": {"loss": "a.b", "loss_scale": )";
  TaskGraph g = read_graph(head + R"("dynamic"}})");
  ASSERT_TRUE(g.training->loss_scale.has_value());
  EXPECT_EQ(g.training->loss_scale->initial, 65536.0);
  EXPECT_EQ(g.training->loss_scale->growth_interval, 2000);
  g = read_graph(head + R"({"initial": 1024, "backoff_factor": 0.25, "growth_interval": 3}}})");
  EXPECT_EQ(g.training->loss_scale->initial, 1024.0);
  EXPECT_EQ(g.training->loss_scale->growth_factor, 2.0);
  EXPECT_EQ(g.training->loss_scale->backoff_factor, 0.25);
  EXPECT_EQ(g.training->loss_scale->growth_interval, 3);
  const TaskGraph again = read_graph(write_graph(g));
  EXPECT_EQ(again.training->loss_scale->backoff_factor, 0.25);
  EXPECT_EQ(again.training->loss_scale->growth_interval, 3);
  const std::pair<const char*, const char*> bad[] = {
      {R"("static")", "/training/loss_scale: unknown loss scaling \"static\""},
      {"true", "\"loss_scale\" must be \"dynamic\" or an object"},
      {R"({"initial": 0})", "/training/loss_scale/initial: \"initial\" is 0"},
      {R"({"initial": 1e39})", "/training/loss_scale/initial"},
      {R"({"growth_factor": 1})", "/training/loss_scale/growth_factor"},
      {R"({"backoff_factor": 1.5})", "/training/loss_scale/backoff_factor"},
      {R"({"growth_interval": 0})", "/training/loss_scale/growth_interval"},
      {R"({"growth_interval": 2.5})", "it is a whole number of steps"},
      {R"({"intial": 2})", "unknown field \"intial\""}};
  for (const auto& [value, expected] : bad) {
    const std::string msg = errors_of(head + value + "}}");
    EXPECT_NE(msg.find(expected), std::string::npos) << value << ": " << msg;
  }
}

TEST(GraphJson, MissingFormatAndTasks) {
  std::string msg = errors_of("{}");
  EXPECT_NE(msg.find("missing \"format\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing \"tasks\""), std::string::npos) << msg;
  msg = errors_of(R"({"format": "cudagen.taskgraph/2", "tasks": []})");
  EXPECT_NE(msg.find("unsupported format \"cudagen.taskgraph/2\""), std::string::npos) << msg;
}

TEST(Builder, MakesTheSameGraphAsJson) {
  GraphBuilder b("features");
  auto w = b.task("w", "uniform", Phase::init)
               .tensor("out", DType::bf16, {4, 8}, Storage::persistent)
               .arg("low", -0.5)
               .arg("high", 0.5)
               .arg("seed", 7);
  b.task("opt", "adam", Phase::update)
      .tensor("param", w["out"])
      .tensor("grad", w["out"])
      .runtime_arg("lr", 0.001)
      .arg("step", SlotRef{"other", "step"})
      .arg("sizes", ArgValue(std::vector<int64_t>{1, 2, 3}))
      .arg("ratios", ArgValue(std::vector<double>{0.5, 1.0}))
      .arg("name", "x\"y")
      .arg("flag", false);
  b.training(TrainingSpec{{"w", "out"}, "adam", {}, DType::bf16, {}});
  TaskGraph built = std::move(b).graph();
  // The JSON version states the dependent slot's dtype and shape; drop them to compare.
  TaskGraph read = read_graph(kAllFeatures);
  read.tasks[1].tensors[1].dtype.reset();
  read.tasks[1].tensors[1].shape.reset();
  EXPECT_EQ(write_graph(built), write_graph(read));
}

TEST(Builder, BuildsAValidMlpLayer) {
  GraphBuilder b("layer");
  auto w = b.task("w", "uniform", Phase::init).tensor("out", DType::f32, {64, 32});
  auto mm = b.task("mm", "matmul")
                .tensor("a", DType::f32, {8, 64}, Storage::external)
                .tensor("b", w["out"])
                .tensor("out", DType::f32, {8, 32});
  b.task("act", "relu").tensor("x", mm["out"]).tensor("out", DType::f32, {8, 32}, Storage::external);
  Program p = validate(std::move(b).graph(), builtin_registry());
  ASSERT_EQ(p.tasks.size(), 3u);
  EXPECT_EQ(p.tasks[2].deps, (std::vector<int>{1}));
  EXPECT_EQ(p.buffers[size_t(p.tasks[1].find_tensor("b")->buffer)].storage, Storage::persistent);
}

TEST(GraphJson, DocumentedExampleIsValidAndCanonical) {
  std::string doc = read_text_file(source_path("docs/taskgraph-format.md"));
  size_t begin = doc.find("```json\n");
  ASSERT_NE(begin, std::string::npos);
  begin += 8;
  std::string example = doc.substr(begin, doc.find("```", begin) - begin);
  EXPECT_EQ(errors_of(example), "");
  EXPECT_EQ(write_graph(read_graph(example)), example);
}

// A graph's name is printed into comments of the generated .cu: a newline in
// it ended the comment and compiled the rest (issue #34). The reader refuses
// control characters, at the name's place.
TEST(GraphJson, GraphNameWithAControlCharacterIsRefused) {
  const std::string text =
      R"({"format": "cudagen.taskgraph/1", "name": "x\n#include \"/etc/passwd\"", "tasks": [{"id": "a", "op": "relu", )"
      R"("tensors": {"x": {"dtype": "f32", "shape": [4]}}}]})";
  const std::string msg = errors_of(text);
  EXPECT_NE(msg.find("t.json:1:43: error: /name: the graph's name has a control character (byte 0x0a at offset 1)"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("a graph name is one line of printable text"), std::string::npos) << msg;
  EXPECT_EQ(errors_of(graph_of(R"({"id": "a", "op": "relu", "tensors": {"x": {"dtype": "f32", "shape": [4]}, )"
                               R"("out": {"dtype": "f32", "shape": [4]}}})")),
            "");
}

// A NUL in a JSON key reached the diagnostics raw and cut every later one off
// where they were printed (issue #34): control bytes are shown as \xNN.
TEST(GraphJson, ControlCharactersInKeysAreShownNotPrinted) {
  const std::string msg = errors_of(graph_of(
      R"({"id": "a", "op": "relu", "tensors": {"x": {"dtype": "f32", "shape": [4]}, "out": {"dtype": "f32", "shape": [4]}}, )"
      R"("ba\u0000d": 1, "other": 2})"));
  EXPECT_EQ(msg.find('\0'), std::string::npos);
  EXPECT_NE(msg.find("ba\\x00d"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"other\""), std::string::npos) << "the diagnostic after it is there too:\n" << msg;
}
