// The derive pass: gradients it builds from a forward graph, checked in
// float64 against central differences of the loss (docs/architecture.md §9), its errors,
// and a derived training step generated and run in emulation.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <random>
#include <set>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "builder.h"
#include "derive.h"
#include "diagnostics.h"
#include "pipeline.h"
#include "reference.h"
#include "runner.h"
#include "test_backend.h"

using namespace cudagen;
using cudagen::testing::run_checked;
using cudagen::testing::test_seed;
using cudagen::testing::test_source_dir;

namespace {

constexpr DType f64 = DType::f64;
constexpr Storage ext = Storage::external;
constexpr Storage weight = Storage::persistent;

int buffer_of(const Program& p, const SlotRef& r) {
  for (const auto& t : p.tasks)
    if (t.task->id == r.task) return t.find_tensor(r.slot)->buffer;
  throw std::logic_error("no task " + r.task);
}

bool produced(const Program& p, int buffer) {
  for (const auto& t : p.tasks)
    for (const auto& b : t.tensors)
      if (b.buffer == buffer && b.sig->written()) return true;
  return false;
}

// Random values for every buffer no task writes: integers index the class
// axis of the loss (labels), floats in [-1, 1).
std::vector<std::vector<double>> random_inputs(const Program& p, std::mt19937_64& rng, int64_t classes) {
  std::vector<std::vector<double>> inputs(p.buffers.size());
  std::uniform_real_distribution<double> real(-1.0, 1.0);
  for (size_t b = 0; b < p.buffers.size(); ++b) {
    if (produced(p, int(b))) continue;
    int64_t n = 1;
    for (int64_t d : p.buffers[b].shape) n *= d;
    const bool integer = p.buffers[b].dtype == DType::i32 || p.buffers[b].dtype == DType::i64;
    for (int64_t i = 0; i < n; ++i) inputs[b].push_back(integer ? double(rng() % uint64_t(classes)) : real(rng));
  }
  return inputs;
}

// A forward graph that exercises every gradient rule: matmuls with each
// transpose flag and a broadcast batch, broadcast add and sub, mul, a tensor
// used twice (its gradients summed), views, norms, attention-style softmax,
// unary ops, and the cross-entropy loss.
TaskGraph forward_graph() {
  GraphBuilder b("grad_check");
  auto fc1 = b.task("fc1", "matmul")
                 .tensor("a", f64, {2, 3, 4}, ext)
                 .tensor("b", f64, {4, 6}, weight)
                 .tensor("out", f64, {2, 3, 6});
  auto bias = b.task("bias", "add").tensor("a", fc1["out"]).tensor("b", f64, {6}, weight).tensor("out", f64, {2, 3, 6});
  auto norm = b.task("norm", "rmsnorm")
                  .tensor("x", bias["out"])
                  .tensor("weight", f64, {6}, weight)
                  .tensor("out", f64, {2, 3, 6})
                  .tensor("rstd", DType::f32, {2, 3});
  auto act = b.task("act", "gelu").tensor("x", norm["out"]).tensor("out", f64, {2, 3, 6}).arg("approximate", "tanh");
  auto gate = b.task("gate", "mul").tensor("a", act["out"]).tensor("b", bias["out"]).tensor("out", f64, {2, 3, 6});
  auto heads = b.task("heads", "split_heads").tensor("x", gate["out"]).tensor("out", f64, {2, 2, 3, 3}).arg("heads", 2);
  auto scores = b.task("scores", "matmul")
                    .tensor("a", heads["out"])
                    .tensor("b", heads["out"])
                    .tensor("out", f64, {2, 2, 3, 3})
                    .arg("trans_b", true)
                    .arg("alpha", 0.5);
  auto probs = b.task("probs", "softmax").tensor("x", scores["out"]).tensor("out", f64, {2, 2, 3, 3}).arg("causal", true);
  auto mixed = b.task("mixed", "matmul").tensor("a", probs["out"]).tensor("b", heads["out"]).tensor("out", f64, {2, 2, 3, 3});
  auto merged = b.task("merged", "merge_heads").tensor("x", mixed["out"]).tensor("out", f64, {2, 3, 6}).arg("heads", 2);
  auto resid = b.task("resid", "sub").tensor("a", merged["out"]).tensor("b", bias["out"]).tensor("out", f64, {2, 3, 6});
  auto ln = b.task("ln", "layernorm")
                .tensor("x", resid["out"])
                .tensor("weight", f64, {6}, weight)
                .tensor("bias", f64, {6}, weight)
                .tensor("out", f64, {2, 3, 6})
                .tensor("mean", DType::f32, {2, 3})
                .tensor("rstd", DType::f32, {2, 3});
  auto squash = b.task("squash", "tanh").tensor("x", ln["out"]).tensor("out", f64, {2, 3, 6});
  // A weight [1, 5, 6] shared by both batches, transposed: its gradient is
  // one matmul over the six rows (as fc1's is), reshaped back.
  auto logits = b.task("logits", "matmul")
                    .tensor("a", squash["out"])
                    .tensor("b", f64, {1, 5, 6}, weight)
                    .tensor("out", f64, {2, 3, 5})
                    .arg("trans_b", true);
  auto flat = b.task("flat", "reshape").tensor("x", logits["out"]).tensor("out", f64, {6, 5});
  auto scaled = b.task("scaled", "affine").tensor("x", flat["out"]).tensor("out", f64, {6, 5}).arg("scale", 1.5).arg("shift", 0.1);
  b.task("loss", "cross_entropy")
      .tensor("logits", scaled["out"])
      .tensor("labels", DType::i32, {6}, ext)
      .tensor("loss", DType::f32, {}, ext);  // the reference computes in float64 whatever the dtype
  return std::move(b).graph();
}

// Derives the gradients of `loss`, evaluates them with the float64
// reference, and compares each weight element's with a central difference of
// the loss. Returns the number of elements checked.
int check_gradients(TaskGraph graph, const SlotRef& loss_ref, int64_t classes, size_t weights) {
  Program forward = load_program(std::move(graph), {});
  DerivedGraph derived = derive_training(forward, TrainingSpec{loss_ref, "", {}, {}});
  EXPECT_EQ(derived.gradients.size(), weights);
  Program training = load_program(derived.graph, {});
  const Schedule order = schedule(training);

  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<std::vector<double>> inputs = random_inputs(training, rng, classes);
  const ReferenceBuffers result = evaluate_reference(training, order, inputs);

  // The forward program's buffers are the first of the training program's.
  const Schedule forward_order = schedule(forward);
  const int loss = buffer_of(forward, loss_ref);
  auto loss_at = [&](std::vector<std::vector<double>> in) {
    in.resize(forward.buffers.size());
    return evaluate_reference(forward, forward_order, in).value[size_t(loss)][0];
  };
  int checked = 0;
  for (const auto& [weight_ref, grad_ref] : derived.gradients) {
    const int w = buffer_of(training, weight_ref), g = buffer_of(training, grad_ref);
    EXPECT_EQ(result.value[size_t(g)].size(), inputs[size_t(w)].size()) << grad_ref.str();
    for (size_t i = 0; i < inputs[size_t(w)].size() && i < result.value[size_t(g)].size(); ++i) {
      const double h = 1e-6;
      auto plus = inputs, minus = inputs;
      plus[size_t(w)][i] += h;
      minus[size_t(w)][i] -= h;
      const double numeric = (loss_at(plus) - loss_at(minus)) / (2 * h);
      EXPECT_NEAR(result.value[size_t(g)][i], numeric, 1e-6 * std::max(1.0, std::abs(numeric)))
          << weight_ref.str() << "[" << i << "], gradient in " << grad_ref.str();
      ++checked;
    }
  }
  return checked;
}

// The unary ops (gelu's erf form here, its tanh form above), log_softmax, the
// embedding gather, transpose, cast and mse.
TaskGraph unary_graph() {
  GraphBuilder b("grad_check_unary");
  auto e = b.task("embed", "embedding")
               .tensor("table", f64, {5, 4}, weight)
               .tensor("ids", DType::i32, {3}, ext)
               .tensor("out", f64, {3, 4});
  auto shifted = b.task("shifted", "add").tensor("a", f64, {3, 4}, ext).tensor("b", f64, {3, 4}, weight).tensor("out", f64, {3, 4});
  auto prod = b.task("prod", "mul").tensor("a", e["out"]).tensor("b", shifted["out"]).tensor("out", f64, {3, 4});
  auto r = b.task("r", "relu").tensor("x", prod["out"]).tensor("out", f64, {3, 4});
  auto sg = b.task("sg", "sigmoid").tensor("x", r["out"]).tensor("out", f64, {3, 4});
  auto sl = b.task("sl", "silu").tensor("x", sg["out"]).tensor("out", f64, {3, 4});
  auto ex = b.task("ex", "exp").tensor("x", sl["out"]).tensor("out", f64, {3, 4});
  auto lg = b.task("lg", "log").tensor("x", ex["out"]).tensor("out", f64, {3, 4});
  auto ng = b.task("ng", "neg").tensor("x", lg["out"]).tensor("out", f64, {3, 4});
  auto ge = b.task("ge", "gelu").tensor("x", ng["out"]).tensor("out", f64, {3, 4}).arg("approximate", "erf");
  auto tr = b.task("tr", "transpose").tensor("x", ge["out"]).tensor("out", f64, {4, 3});
  auto ls = b.task("ls", "log_softmax").tensor("x", tr["out"]).tensor("out", f64, {4, 3});
  auto narrow = b.task("narrow", "cast").tensor("x", ls["out"]).tensor("out", DType::f32, {4, 3});
  b.task("loss", "mse")
      .tensor("pred", narrow["out"])
      .tensor("target", DType::f32, {4, 3}, ext)
      .tensor("loss", DType::f32, {}, ext);
  return std::move(b).graph();
}

// div with a broadcast divisor, concat, and split with one half unused (its
// gradient zeros).
TaskGraph rearranging_graph() {
  GraphBuilder b("grad_check_div_concat_split");
  auto num = b.task("num", "add").tensor("a", f64, {3, 4}, ext).tensor("b", f64, {3, 4}, weight).tensor("out", f64, {3, 4});
  auto den = b.task("den", "exp").tensor("x", f64, {4}, weight).tensor("out", f64, {4});  // positive, away from 0
  auto q = b.task("q", "div").tensor("a", num["out"]).tensor("b", den["out"]).tensor("out", f64, {3, 4});
  auto cat = b.task("cat", "concat").tensor("a", q["out"]).tensor("b", f64, {3, 2}, weight).tensor("out", f64, {3, 6});
  auto halves = b.task("halves", "split").tensor("x", cat["out"]).tensor("a", f64, {3, 1}).tensor("b", f64, {3, 5});
  b.task("loss", "cross_entropy")
      .tensor("logits", halves["b"])
      .tensor("labels", DType::i32, {3}, ext)
      .tensor("loss", DType::f32, {}, ext);
  return std::move(b).graph();
}

// The reductions' gradients: maximum against a broadcast weight, then the
// row sum, mean and max and the sum over leading axes, all reaching the loss.
TaskGraph reductions_graph() {
  GraphBuilder b("grad_check_reductions");
  auto x = b.task("x", "matmul").tensor("a", f64, {3, 4}, ext).tensor("b", f64, {4, 5}, weight).tensor("out", f64, {3, 5});
  auto m = b.task("m", "maximum").tensor("a", x["out"]).tensor("b", f64, {5}, weight).tensor("out", f64, {3, 5});
  auto s = b.task("s", "sum").tensor("x", m["out"]).tensor("out", f64, {3});
  auto mn = b.task("mn", "mean").tensor("x", m["out"]).tensor("out", f64, {3});
  auto mx = b.task("mx", "max").tensor("x", m["out"]).tensor("out", f64, {3});
  auto sl = b.task("sl", "sum_leading").tensor("x", m["out"]).tensor("out", f64, {5});
  auto both = b.task("both", "mul").tensor("a", s["out"]).tensor("b", mn["out"]).tensor("out", f64, {3});
  auto rows = b.task("rows", "add").tensor("a", both["out"]).tensor("b", mx["out"]).tensor("out", f64, {3});
  auto cat = b.task("cat", "concat").tensor("a", rows["out"]).tensor("b", sl["out"]).tensor("out", f64, {8});
  b.task("loss", "mse").tensor("pred", cat["out"]).tensor("target", f64, {8}, ext).tensor("loss", DType::f32, {}, ext);
  return std::move(b).graph();
}

// Operands broadcast along inner axes: grouped-query attention (a head of
// keys and values for a group of 3 query heads: k [1, 2, 1, 4, 5] and v of a
// lower rank, [2, 1, 4, 5], read as [1, 2, 3, 4, 5]), and a per-row scale [3, 1].
TaskGraph inner_broadcast_graph() {
  GraphBuilder b("grad_check_inner_broadcast");
  auto s = b.task("scores", "matmul").tensor("a", f64, {1, 2, 3, 4, 5}, weight).tensor("b", f64, {1, 2, 1, 4, 5}, weight)
               .tensor("out", f64, {1, 2, 3, 4, 4}).arg("trans_b", true);
  auto p = b.task("probs", "softmax").tensor("x", s["out"]).tensor("out", f64, {1, 2, 3, 4, 4}).arg("scale", 0.5).arg("causal", true);
  auto c = b.task("context", "matmul").tensor("a", p["out"]).tensor("b", f64, {2, 1, 4, 5}, weight).tensor("out", f64, {1, 2, 3, 4, 5});
  auto rows = b.task("rows", "reshape").tensor("x", c["out"]).tensor("out", f64, {6, 20});
  auto scaled = b.task("scaled", "mul").tensor("a", rows["out"]).tensor("b", f64, {6, 1}, weight).tensor("out", f64, {6, 20});
  b.task("loss", "mse").tensor("pred", scaled["out"]).tensor("target", f64, {6, 20}, ext).tensor("loss", DType::f32, {}, ext);
  return std::move(b).graph();
}

}  // namespace

TEST(Derive, GradientsMatchCentralDifferencesInFloat64) {
  // fc1.b, bias.b, norm.weight, ln.weight, ln.bias, logits.b
  EXPECT_EQ(check_gradients(forward_graph(), {"loss", "loss"}, 5, 6), 24 + 6 + 6 + 6 + 6 + 30);
  // embed.table, shifted.b
  EXPECT_EQ(check_gradients(unary_graph(), {"loss", "loss"}, 5, 2), 20 + 12);
  // num.b, den.x, cat.b
  EXPECT_EQ(check_gradients(rearranging_graph(), {"loss", "loss"}, 5, 3), 12 + 4 + 6);
  // x.b, m.b
  EXPECT_EQ(check_gradients(reductions_graph(), {"loss", "loss"}, 5, 2), 20 + 5);
  // scores.a, scores.b, context.b, scaled.b
  EXPECT_EQ(check_gradients(inner_broadcast_graph(), {"loss", "loss"}, 5, 4), 120 + 40 + 40 + 6);
}

// A weight shared by every batch of its input gets its gradient from one
// matmul over all the batches' rows: no per-batch product summed afterwards.
TEST(Derive, ASharedWeightsGradientIsOneMatmulOverAllRows) {
  Program forward = load_program(forward_graph(), {});
  DerivedGraph derived = derive_training(forward, TrainingSpec{{"loss", "loss"}, "", {}, {}});
  auto task = [&](const std::string& id) -> const Task* {
    for (const auto& t : derived.graph.tasks)
      if (t.id == id) return &t;
    return nullptr;
  };
  for (const char* id : {"fc1_grad_b", "logits_grad_b"}) {
    const Task* t = task(id);
    ASSERT_NE(t, nullptr) << id;
    EXPECT_EQ(t->op, "matmul") << id;
    const Shape expected = std::string(id) == "fc1_grad_b" ? Shape{4, 6} : Shape{5, 6};
    EXPECT_EQ(t->tensors.back().shape, std::optional<Shape>(expected)) << id;
    EXPECT_EQ(task(std::string(id) + "_sum"), nullptr) << id << " is summed over batches";
  }
  // [5, 6] back to the weight's [1, 5, 6], a view.
  ASSERT_NE(task("logits_grad_b_shape"), nullptr);
  EXPECT_EQ(task("logits_grad_b_shape")->op, "reshape");
  // Both operands batched: per-batch products, as before.
  ASSERT_NE(task("scores_grad_b"), nullptr);
  EXPECT_EQ(task("scores_grad_b")->tensors.back().shape, std::optional<Shape>(Shape{2, 2, 3, 3}));
}

namespace {

std::string derive_error(TaskGraph g, SlotRef loss) {
  try {
    Program p = load_program(std::move(g), {});
    derive_training(p, TrainingSpec{std::move(loss), "sgd", {}, {}});
  } catch (const CompileError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(Derive, BadTrainingInputsNameTheTask) {
  {
    GraphBuilder b("vector_loss");
    b.task("act", "relu").tensor("x", f64, {4}, weight).tensor("out", f64, {4}, ext);
    std::string msg = derive_error(std::move(b).graph(), {"act", "out"});
    EXPECT_NE(msg.find("task 'act', slot 'out'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("the loss must be a floating scalar, but 'act.out' is f64 [4]"), std::string::npos) << msg;
  }
  {
    // A gradient op in a forward graph: there is no second derivative.
    GraphBuilder b("no_backward");
    auto g = b.task("slope", "relu_backward")
                 .tensor("x", f64, {3, 4}, ext)
                 .tensor("dout", f64, {3, 4}, weight)
                 .tensor("dx", f64, {3, 4});
    auto m = b.task("peak", "max").tensor("x", g["dx"]).tensor("out", f64, {3});
    b.task("total", "sum").tensor("x", m["out"]).tensor("out", f64, {}, ext);
    std::string msg = derive_error(std::move(b).graph(), {"total", "out"});
    EXPECT_NE(msg.find("op 'relu_backward' has no backward, and task 'slope' lies on the path from a weight to the loss"),
              std::string::npos)
        << msg;
  }
  {
    GraphBuilder b("unsaved_statistic");
    auto norm = b.task("norm", "rmsnorm")
                    .tensor("x", f64, {2, 4}, ext)
                    .tensor("weight", f64, {4}, weight)
                    .tensor("out", f64, {2, 4});
    b.task("loss", "mse").tensor("pred", norm["out"]).tensor("target", f64, {2, 4}, ext).tensor("loss", DType::f32, {}, ext);
    std::string msg = derive_error(std::move(b).graph(), {"loss", "loss"});
    EXPECT_NE(msg.find("task 'norm', slot 'rstd'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("backward op 'rmsnorm_backward' reads 'rstd', which task 'norm' leaves out"), std::string::npos)
        << msg;
  }
  {
    GraphBuilder b("unused_weight");
    b.task("loss", "mse").tensor("pred", f64, {4}, weight).tensor("target", f64, {4}, ext).tensor("loss", DType::f32, {}, ext);
    b.task("side", "relu").tensor("x", f64, {4}, weight).tensor("out", f64, {4}, ext);
    std::string msg = derive_error(std::move(b).graph(), {"loss", "loss"});
    EXPECT_NE(msg.find("weight 'side.x' receives no gradient"), std::string::npos) << msg;
  }
}

// Grouped-query attention trains: the gradients of the keys and values sum
// over the group of query heads that read each (permuted to the front, then
// sum_leading), checked in the emulation, weights updated, in bf16.
TEST(Derive, GroupedQueryAttentionTrainsInEmulation) {
  GraphBuilder b("gqa_training");
  constexpr DType bf16 = DType::bf16;
  auto init = [&](const char* id, Shape shape, int seed) {
    return b.task(id, "uniform", Phase::init).tensor("out", bf16, std::move(shape)).arg("low", -1.0).arg("high", 1.0).arg("seed", seed);
  };
  auto q = init("q", {1, 2, 4, 24, 16}, 1);
  auto k = init("k", {1, 2, 1, 24, 16}, 2);
  auto v = init("v", {1, 2, 1, 24, 16}, 3);
  auto s = b.task("scores", "matmul").tensor("a", q["out"]).tensor("b", k["out"]).tensor("out", bf16, {1, 2, 4, 24, 24}).arg("trans_b", true);
  auto p = b.task("probs", "softmax").tensor("x", s["out"]).tensor("out", bf16, {1, 2, 4, 24, 24}).arg("scale", 0.25).arg("causal", true);
  auto c = b.task("context", "matmul").tensor("a", p["out"]).tensor("b", v["out"]).tensor("out", bf16, {1, 2, 4, 24, 16});
  b.task("loss", "mse").tensor("pred", c["out"]).tensor("target", bf16, {1, 2, 4, 24, 16}, ext).tensor("loss", DType::f32, {}, ext);
  Program forward = load_program(std::move(b).graph(), {});
  DerivedGraph derived = derive_training(forward, TrainingSpec{{"loss", "loss"}, "sgd", {ArgSlot{"lr", ArgValue(1.0), {}, false, {}}}, {}});
  Compiled c2 = compile(load_program(derived.graph, {}), {});
  EXPECT_NE(c2.emitted.cuda_source.find("scores_grad_b_front"), std::string::npos) << "k's gradient summed over its group";
  const uint64_t seed = test_seed();
  const std::string dir = (std::filesystem::temp_directory_path() / ("cudagen_derive_gqa_" + std::to_string(::getpid()))).string();
  CheckedRun run = run_checked(c2, RunOptions{seed, dir});
  EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
}

// A linear layer on a [2, 4, 8] input the caller gives: the weight's gradient
// reads the input as an [8, 8] matrix, a view that shares its storage. The
// checker re-poisons what each step computes afresh, and once poisoned the
// input itself through that view (every weight NaN after the step).
TEST(Derive, AWeightGradientThatViewsTheInputLeavesItIntact) {
  GraphBuilder b("view_of_input");
  constexpr DType f32 = DType::f32;
  auto w = b.task("w", "uniform", Phase::init).tensor("out", f32, {8, 8}).arg("low", -0.3).arg("high", 0.3).arg("seed", 1);
  auto y = b.task("y", "matmul").tensor("a", f32, {2, 4, 8}, ext).tensor("b", w["out"]).tensor("out", f32, {2, 4, 8});
  b.task("loss", "mse").tensor("pred", y["out"]).tensor("target", f32, {2, 4, 8}, ext).tensor("loss", f32, {}, ext);
  Program forward = load_program(std::move(b).graph(), {});
  DerivedGraph derived = derive_training(forward, TrainingSpec{{"loss", "loss"}, "sgd", {ArgSlot{"lr", ArgValue(0.1), {}, false, {}}}, {}});
  Compiled c = compile(load_program(derived.graph, {}), {});
  bool viewed = false;
  for (const PlannedBuffer& pb : c.plan.buffers)
    viewed = viewed || (pb.in_place_of >= 0 && buffer_name(c.program, pb.in_place_of) == "y.a");
  ASSERT_TRUE(viewed) << "the weight's gradient reads a view of the input";
  const uint64_t seed = test_seed();
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("cudagen_derive_view_" + std::to_string(::getpid()))).string();
  CheckedRun run = run_checked(c, RunOptions{seed, dir});
  EXPECT_TRUE(run.ok()) << "seed " << seed << "\n" << format_run(run);
}

namespace {

// A two-layer MLP's forward graph in f32, its weights initialised in the graph.
TaskGraph small_mlp() {
  GraphBuilder b("small_mlp");
  constexpr DType f32 = DType::f32;
  auto w1 = b.task("w1", "uniform", Phase::init).tensor("out", f32, {16, 32}).arg("low", -0.25).arg("high", 0.25).arg("seed", 1);
  auto b1 = b.task("b1", "fill", Phase::init).tensor("out", f32, {32}).arg("value", 0.0);
  auto w2 = b.task("w2", "uniform", Phase::init).tensor("out", f32, {32, 10}).arg("low", -0.17).arg("high", 0.17).arg("seed", 2);
  auto fc1 = b.task("fc1", "matmul").tensor("a", f32, {8, 16}, ext).tensor("b", w1["out"]).tensor("out", f32, {8, 32});
  auto bias1 = b.task("bias1", "add").tensor("a", fc1["out"]).tensor("b", b1["out"]).tensor("out", f32, {8, 32});
  auto act = b.task("act1", "relu").tensor("x", bias1["out"]).tensor("out", f32, {8, 32});
  auto fc2 = b.task("fc2", "matmul").tensor("a", act["out"]).tensor("b", w2["out"]).tensor("out", f32, {8, 10}, ext);
  b.task("loss", "cross_entropy").tensor("logits", fc2["out"]).tensor("labels", DType::i32, {8}, ext).tensor("loss", f32, {}, ext);
  return std::move(b).graph();
}

int update_launches(const Compiled& c) {
  std::set<int> launches;
  for (const auto& k : c.kernels)
    if (k.phase == Phase::update) launches.insert(k.launch);
  return int(launches.size());
}

// `graph` run one kernel a task with every buffer kept, each task checked
// from the inputs it actually read; `slots` among the checks.
void expect_each_task_checked(const TaskGraph& graph, RunOptions options, const std::string& name,
                              const std::vector<std::string>& slots) {
  CompileOptions unfused;
  unfused.fuse.enabled = false;
  unfused.plan.placement.reuse = false;
  options.work_dir = cudagen::testing::work_dir("derive", name);
  options.check_each_task = true;
  CheckedRun each = run_checked(compile(load_program(graph, {}), unfused), options);
  EXPECT_TRUE(each.ok()) << format_run(each);
  std::set<std::string> checked;
  for (const auto& check : each.checks) checked.insert(check.buffer);
  for (const auto& slot : slots) EXPECT_TRUE(checked.count(slot)) << slot;
}

}  // namespace

// An MLP's training step derived from its forward graph (SGD with momentum),
// generated, run on the emulated GPU, and every output checked against the
// float64 reference: the updated weights and momentum included.
TEST(Derive, ADerivedTrainingStepRunsInEmulation) {
  Program forward = load_program(small_mlp(), {});
  std::vector<ArgSlot> args = {ArgSlot{"lr", ArgValue(0.1), {}, false, {}}, ArgSlot{"momentum", ArgValue(0.9), {}, false, {}}};
  DerivedGraph derived = derive_training(forward, TrainingSpec{{"loss", "loss"}, "sgd", args, {}});
  ASSERT_EQ(derived.gradients.size(), 3u);
  Compiled c = compile(load_program(derived.graph, {}), {});
  for (const char* kernel : {"fc2_grad_a", "fc1_grad_b", "bias1_grad_b_sum", "act1_backward", "loss_backward", "w1_sgd"})
    EXPECT_NE(c.emitted.cuda_source.find(kernel), std::string::npos) << kernel;
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("cudagen_derive_test_" + std::to_string(::getpid()))).string();
  CheckedRun run = run_checked(c, RunOptions{seed, dir});
  EXPECT_TRUE(run.ok()) << format_run(run);
  int weights_checked = 0;
  for (const auto& check : run.checks) weights_checked += check.buffer == "w1.out" || check.buffer == "w2.out" || check.buffer == "b1.out";
  EXPECT_EQ(weights_checked, 3) << format_run(run);
}


// "clip_grad_norm": every optimizer reads the one clipping factor, built from
// each gradient's squares by three more launches whatever the number of
// weights (a level of reductions each, then the total), and the step runs in
// emulation, each task checked against float64 (the factor clips: the
// gradients' norm is far above 1e-3).
TEST(Derive, ClippingByGlobalNormIsOneFactorForEveryOptimizerInThreeLaunches) {
  Program forward = load_program(small_mlp(), {});
  TrainingSpec spec{{"loss", "loss"}, "adamw", {ArgSlot{"lr", ArgValue(0.01), {}, false, {}}}, {}, {}, {}};
  const Compiled plain = compile(load_program(derive_training(forward, spec).graph, {}), {});
  spec.clip_grad_norm = 1e-3;
  DerivedGraph derived = derive_training(forward, spec);
  int optimizers = 0;
  for (const auto& t : derived.graph.tasks) {
    if (t.op != "adamw") continue;
    ++optimizers;
    const TensorSlot* scale = nullptr;
    for (const auto& s : t.tensors)
      if (s.name == "grad_scale") scale = &s;
    ASSERT_NE(scale, nullptr) << t.id;
    ASSERT_TRUE(scale->from.has_value()) << t.id;
    EXPECT_EQ(scale->from->str(), "gradient_scale.out") << t.id;
  }
  EXPECT_EQ(optimizers, 3);
  Compiled c = compile(load_program(derived.graph, {}), {});
  EXPECT_EQ(update_launches(c), update_launches(plain) + 3);
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  RunOptions options{seed, cudagen::testing::work_dir("derive", "clipped")};
  CheckedRun run = run_checked(c, options);
  EXPECT_TRUE(run.ok()) << format_run(run);
  // The squares' sums, the total, the factor and each clipped update checked
  // from their actual inputs.
  expect_each_task_checked(derived.graph, options, "clipped_each_task", {"task gradient_scale.out", "task w1_adamw.param"});
}

// "accumulate_gradients": backward adds each weight's gradient into a
// persistent accumulator (micro-batch 0 overwrites it), and every optimizer
// reads its accumulator times one factor, the mean over the run-time
// micro-batch count and the clipping of that mean. Two steps of three
// micro-batches, each on its own inputs, run in emulation; each micro-batch's
// accumulators and each update are checked against float64, fused and task
// by task.
TEST(Derive, AccumulatedGradientsUpdateWithTheirMeanOverMicroBatches) {
  Program forward = load_program(small_mlp(), {});
  TrainingSpec spec{{"loss", "loss"}, "adamw", {ArgSlot{"lr", ArgValue(0.01), {}, false, {}}}, {}, 1e-3, true};
  DerivedGraph derived = derive_training(forward, spec);
  std::vector<const Task*> accumulates;
  const Task* scale = nullptr;
  for (const auto& t : derived.graph.tasks) {
    if (t.op == "accumulate") accumulates.push_back(&t);
    if (t.op == "gradient_scale") scale = &t;
    if (t.op != "adamw") continue;
    std::map<std::string, std::string> from;
    for (const auto& slot : t.tensors)
      if (slot.from) from[slot.name] = slot.from->str();
    const std::string weight = from["param"].substr(0, from["param"].find('.'));
    EXPECT_EQ(from["grad"], weight + "_grad_acc_init.out") << t.id;
    EXPECT_EQ(from["grad_scale"], "gradient_scale.out") << t.id;
  }
  ASSERT_EQ(accumulates.size(), 3u);
  ASSERT_NE(scale, nullptr);
  auto runtime_arg = [](const Task& t, const std::string& name) {
    for (const auto& a : t.args)
      if (a.name == name) return a.runtime;
    return false;
  };
  EXPECT_TRUE(runtime_arg(*scale, "micro_batches"));
  EXPECT_TRUE(runtime_arg(*accumulates[0], "micro_batch"));
  for (size_t i = 1; i < accumulates.size(); ++i) {
    EXPECT_EQ(accumulates[i]->phase, Phase::backward);
    ASSERT_EQ(accumulates[i]->args.size(), 1u);
    ASSERT_TRUE(accumulates[i]->args[0].from.has_value()) << accumulates[i]->id;
    EXPECT_EQ(accumulates[i]->args[0].from->str(), accumulates[0]->id + ".micro_batch");
  }
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  RunOptions options{seed, cudagen::testing::work_dir("derive", "accumulated")};
  options.steps = 2;
  options.micro_batches = 3;
  CheckedRun run = run_checked(compile(load_program(derived.graph, {}), {}), options);
  EXPECT_TRUE(run.ok()) << format_run(run);
  ASSERT_EQ(run.step_scalars.size(), 1u);
  EXPECT_EQ(run.step_scalars[0].second.size(), 2u);  // the mean over a step's micro-batches, once a step
  expect_each_task_checked(derived.graph, options, "accumulated_each_task",
                           {"task w1_accumulate.acc", "task gradient_scale.out", "task w1_adamw.param"});
  // A graph that does not accumulate refuses micro-batches.
  spec.accumulate_gradients = false;
  options.work_dir = cudagen::testing::work_dir("derive", "not_accumulated");
  std::string msg;
  try {
    run_checked(compile(load_program(derive_training(forward, spec).graph, {}), {}), options);
  } catch (const std::runtime_error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("this graph does not accumulate them: add \"accumulate_gradients\": true"), std::string::npos)
      << msg;
}

// "loss_scale": the loss's own backward is multiplied by the scale, the
// factor every optimizer reads unscales and tests the scaled gradients for
// overflow, loss_scale_update keeps GradScaler's state, and Adam counts the
// steps taken from it. Three steps from a scale of 2^100 (each scaled
// gradient's square beyond f32) with a backoff of 2^-60 and growth after each
// good step: the first is skipped, the next two are taken; each step, the
// skip included, checked against float64, fused and task by task.
TEST(Derive, LossScalingSkipsAnOverflowedStepAndCountsTheStepsTaken) {
  Program forward = load_program(small_mlp(), {});
  TrainingSpec spec{{"loss", "loss"}, "adamw", {ArgSlot{"lr", ArgValue(0.01), {}, false, {}}}, {}, {}, false,
                    LossScaling{std::ldexp(1.0, 100), 2.0, std::ldexp(1.0, -60), 1}};
  DerivedGraph derived = derive_training(forward, spec);
  std::map<std::string, std::map<std::string, std::string>> from;  // task -> slot -> what it reads
  for (const auto& t : derived.graph.tasks)
    for (const auto& slot : t.tensors)
      if (slot.from) from[t.id][slot.name] = slot.from->str();
  EXPECT_EQ(from["loss_backward_scaled"]["a"], "loss_backward.dlogits");
  EXPECT_EQ(from["loss_backward_scaled"]["b"], "loss_scale.out");
  EXPECT_EQ(from["gradient_scale"]["loss_scale"], "loss_scale.out");
  EXPECT_EQ(from["loss_scale_update"]["factor"], "gradient_scale.out");
  for (const char* optimizer : {"w1_adamw", "b1_adamw", "w2_adamw"}) {
    EXPECT_EQ(from[optimizer]["grad_scale"], "gradient_scale.out") << optimizer;
    EXPECT_EQ(from[optimizer]["step_count"], "loss_scale_update.steps") << optimizer;
  }
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  RunOptions options{seed, cudagen::testing::work_dir("derive", "loss_scaled")};
  options.steps = 3;
  CheckedRun run = run_checked(compile(load_program(derived.graph, {}), {}), options);
  EXPECT_TRUE(run.ok()) << format_run(run);
  expect_each_task_checked(derived.graph, options, "loss_scaled_each_task",
                           {"task gradient_scale.out", "task loss_scale_update.scale", "task w1_adamw.param"});
}

TEST(Derive, ClippingOrAccumulatingWithoutAnOptimizerOrOnHandWrittenBackwardIsAnError) {
  Program forward = load_program(small_mlp(), {});
  TrainingSpec spec{{"loss", "loss"}, "", {}, {}, 1.0, {}};
  std::string msg;
  try {
    derive_training(forward, spec);
  } catch (const CompileError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("/training/clip_grad_norm: \"clip_grad_norm\" clips what an optimizer reads, but there is none"),
            std::string::npos)
      << msg;
  msg.clear();
  try {
    derive_training(forward, TrainingSpec{{"loss", "loss"}, "", {}, {}, {}, true});
  } catch (const CompileError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("/training/accumulate_gradients: \"accumulate_gradients\" accumulates what an optimizer reads, "
                     "but there is none"),
            std::string::npos)
      << msg;
  TaskGraph g = small_mlp();
  g.tasks.push_back(Task{});
  g.tasks.back().id = "my_backward";
  g.tasks.back().op = "relu_backward";
  g.tasks.back().phase = Phase::backward;
  for (const char* slot : {"x", "dout"})
    g.tasks.back().tensors.push_back(TensorSlot{slot, {}, {}, {}, SlotRef{"act1", "out"}, {}, {}, {}});
  g.tasks.back().tensors.push_back(TensorSlot{"dx", DType::f32, Shape{8, 32}, {}, {}, {}, {}, {}});
  spec.optimizer = "sgd";
  msg.clear();
  try {
    derive_training(load_program(std::move(g), {}), spec);
  } catch (const CompileError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("task 'my_backward' is a backward task written by hand"), std::string::npos) << msg;
}
