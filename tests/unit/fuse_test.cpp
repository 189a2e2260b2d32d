// The fusion pass: for each rule, graphs that must fuse and graphs that must
// not, with the reason checked; what a fused value costs the memory plan.
#include <map>
#include <stdexcept>

#include <gtest/gtest.h>

#include "builder.h"
#include "pipeline.h"
#include "test_util.h"

using namespace cudagen;
using cudagen::testing::source_path;

namespace {

constexpr DType f32 = DType::f32;
constexpr Storage ext = Storage::external;

Compiled plan_graph(TaskGraph g, FuseOptions fuse = {}) {
  CompileOptions options;
  options.fuse = fuse;
  return plan_program(load_program(std::move(g), {}), options);
}

std::vector<std::string> task_ids(const Compiled& c, const KernelGroup& k) {
  std::vector<std::string> ids;
  for (int t : k.tasks) ids.push_back(c.program.tasks[size_t(t)].task->id);
  return ids;
}

std::vector<std::string> internal_names(const Compiled& c, const KernelGroup& k) {
  std::vector<std::string> names;
  for (int b : k.internal_buffers) names.push_back(buffer_name(c.program, b));
  return names;
}

// The reason recorded for `task` not joining the kernel before it ("" when none).
std::string reason_for(const Compiled& c, const std::string& task) {
  for (const auto& n : c.fusion_notes)
    if (c.program.tasks[size_t(n.task)].task->id == task) return n.reason;
  return "";
}

// x -> add(bias) -> gelu -> mul(y) -> affine -> sigmoid -> sub(t1) -> exp; t3 also read by the caller.
TaskGraph long_chain() {
  GraphBuilder b("chain");
  auto t1 = b.task("t1", "add").tensor("a", f32, {64, 48}, ext).tensor("b", f32, {48}, ext).tensor("out", f32, {64, 48});
  auto t2 = b.task("t2", "gelu").tensor("x", t1["out"]).tensor("out", f32, {64, 48});
  auto t3 = b.task("t3", "mul").tensor("a", t2["out"]).tensor("b", f32, {64, 48}, ext).tensor("out", f32, {64, 48}, ext);
  auto t4 = b.task("t4", "affine").tensor("x", t3["out"]).tensor("out", f32, {64, 48}).arg("scale", 0.5).arg("shift", 0.25);
  auto t5 = b.task("t5", "sigmoid").tensor("x", t4["out"]).tensor("out", f32, {64, 48});
  auto t6 = b.task("t6", "sub").tensor("a", t5["out"]).tensor("b", t1["out"]).tensor("out", f32, {64, 48});
  b.task("t7", "exp").tensor("x", t6["out"]).tensor("out", f32, {64, 48}, ext);
  return std::move(b).graph();
}

}  // namespace

TEST(Fusion, ALongChainWithSeveralInputsIsOneKernel) {
  Compiled c = plan_graph(long_chain());
  ASSERT_EQ(c.kernels.size(), 1u);
  EXPECT_EQ(task_ids(c, c.kernels[0]), (std::vector<std::string>{"t1", "t2", "t3", "t4", "t5", "t6", "t7"}));
  EXPECT_EQ(c.kernels[0].rule, FusionRule::elementwise_chain);
  // t3.out is external (the caller reads it): stored once; the rest stay in registers.
  EXPECT_EQ(internal_names(c, c.kernels[0]),
            (std::vector<std::string>{"t1.out", "t2.out", "t4.out", "t5.out", "t6.out"}));
  EXPECT_TRUE(c.fusion_notes.empty());
}

TEST(Fusion, AFusedValueGetsNoStorage) {
  Compiled fused = plan_graph(long_chain());
  Compiled unfused = plan_graph(long_chain(), FuseOptions{false, {}});
  EXPECT_EQ(unfused.kernels.size(), 7u);
  for (const auto& pb : fused.plan.buffers) {
    const std::string name = buffer_name(fused.program, pb.buffer);
    const bool in_registers = name != "t1.a" && name != "t1.b" && name != "t3.b" && name != "t3.out" && name != "t7.out";
    EXPECT_EQ(pb.internal, in_registers) << name;
    if (pb.internal) EXPECT_EQ(pb.bytes, 0) << name;
  }
  EXPECT_LT(fused.plan.arena_bytes, unfused.plan.arena_bytes);
  // Inputs and outputs only: 5 tensors of at most 64x48 floats.
  EXPECT_LE(fused.plan.arena_bytes, 5 * 64 * 48 * 4);
}

TEST(Fusion, MlpBiasAndActivationFollowTheMatmulButNoMatmulFollowsAChain) {
  CompileOptions options;
  options.fuse.disabled_rules = {"matmul_chain"};
  Compiled c = plan_program(load_program(source_path("examples/mlp_forward.json"), {}), options);
  std::vector<std::vector<std::string>> groups;
  for (const auto& k : c.kernels) groups.push_back(task_ids(c, k));
  EXPECT_EQ(groups, (std::vector<std::vector<std::string>>{{"fc1", "bias1", "act1"}, {"fc2", "bias2"}, {"probs"}}));
  EXPECT_EQ(c.kernels[0].rule, FusionRule::matmul_epilogue);
  EXPECT_EQ(internal_names(c, c.kernels[0]), (std::vector<std::string>{"fc1.out", "bias1.out"}));
  EXPECT_EQ(reason_for(c, "fc2"), "'fc2' is a matmul op; 'act1' is not chained to it: rule matmul_chain is off (--no-fuse-rule)");
  // (A softmax after a matmul and an add is weighed as an attention's, the add a bias of its scores.)
  EXPECT_EQ(reason_for(c, "probs"), "'probs' is a reduction op; attention fuses a softmax after a * b^T only");
}

// Rule matmul_chain: the MLP's two layers are one kernel, the hidden
// activation kept in shared memory; its arena buffer is gone.
TEST(Fusion, TwoMatmulsChainThroughSharedMemory) {
  Compiled c = compile(load_program(source_path("examples/mlp_forward.json"), {}), {});
  std::vector<std::vector<std::string>> groups;
  for (const auto& k : c.kernels) groups.push_back(task_ids(c, k));
  EXPECT_EQ(groups, (std::vector<std::vector<std::string>>{{"fc1", "bias1", "act1", "fc2", "bias2"}, {"probs"}}));
  EXPECT_EQ(c.kernels[0].rule, FusionRule::matmul_chain);
  EXPECT_EQ(kir::role_task(c.kernels[0].ir, "second product"), c.kernels[0].tasks[3]);  // fc2
  EXPECT_EQ(internal_names(c, c.kernels[0]), (std::vector<std::string>{"fc1.out", "bias1.out", "fc2.out", "act1.out"}));
  EXPECT_EQ(reason_for(c, "fc2"), "") << "it joined";
  for (const auto& pb : c.plan.buffers)
    if (buffer_name(c.program, pb.buffer) == "act1.out") EXPECT_TRUE(pb.internal);
  // The kernel's comment plans the rows in shared memory.
  const std::string& src = c.emitted.cuda_source;
  EXPECT_NE(src.find("the block's 32 rows of act1.out (f32)"), std::string::npos);
  EXPECT_NE(src.find("cg_value[i - value_base] = v2;"), std::string::npos);
}

// The rule's refusals, each named on the second matmul's note: the value
// read before the second matmul; rows too wide for shared memory; too many
// tiles for one block; a batch of matrices; the rule off. A value read after
// it (by the caller here, by the backward pass in training) is stored as
// well as chained.
TEST(Fusion, NotAChainWhereTheValueIsNeededFirstTooWideOrBatched) {
  auto mlp = [](const std::string& name, int64_t hidden, int64_t out, Storage value, bool batched_weight,
                bool read_before = false) {
    GraphBuilder b(name);
    auto up = b.task("up", "matmul").tensor("a", f32, {2, 16, 32}, ext).tensor("b", f32, {32, hidden}, ext).tensor("out", f32, {2, 16, hidden});
    auto act = b.task("act", "relu").tensor("x", up["out"]).tensor("out", f32, {2, 16, hidden}, value);
    if (read_before) b.task("sm", "softmax").tensor("x", act["out"]).tensor("out", f32, {2, 16, hidden}, ext);
    if (batched_weight)
      b.task("down", "matmul").tensor("a", act["out"]).tensor("b", f32, {2, hidden, out}, ext).tensor("out", f32, {2, 16, out}, ext);
    else
      b.task("down", "matmul").tensor("a", act["out"]).tensor("b", f32, {hidden, out}, ext).tensor("out", f32, {2, 16, out}, ext);
    return std::move(b).graph();
  };
  const std::string prefix = "'down' is a matmul op; 'act' is not chained to it: ";
  struct Case {
    TaskGraph graph;
    std::string reason;
  };
  for (const auto& [g, reason] : {
           Case{mlp("read_before", 64, 32, Storage::transient, false, true), "'sm' reads 'act.out' before 'down' would run"},
           Case{mlp("wide", 400, 32, Storage::transient, false),
                "a block's 32 rows of 'act.out' (32 x 400 f32) and the operand tiles take 55488 bytes of shared memory, "
                "more than 49152"},
           Case{mlp("many_tiles", 320, 256, Storage::transient, false),
                "each block would compute 18 tiles one after another (at most 16): the two matmuls' parallel tiles are "
                "worth more than the traffic saved"},
           Case{mlp("batched", 64, 32, Storage::transient, true),
                "'down' multiplies by a batch of matrices; a chain takes [..., M, K] @ [K, N]"},
       }) {
    Compiled c = plan_graph(g);
    EXPECT_EQ(c.kernels.size(), g.name == "read_before" ? 3u : 2u) << g.name;
    EXPECT_EQ(reason_for(c, "down"), prefix + reason) << g.name;
  }
  Compiled chained = plan_graph(mlp("chained", 64, 32, Storage::transient, false));
  EXPECT_EQ(chained.kernels.size(), 1u);
  EXPECT_EQ(internal_names(chained, chained.kernels[0]), (std::vector<std::string>{"up.out", "act.out"}));
  Compiled read_later = plan_graph(mlp("read_later", 64, 32, ext, false));
  ASSERT_EQ(read_later.kernels.size(), 1u);
  EXPECT_EQ(read_later.kernels[0].rule, FusionRule::matmul_chain);
  EXPECT_EQ(internal_names(read_later, read_later.kernels[0]), (std::vector<std::string>{"up.out"})) << "act.out is stored";
  Compiled off = plan_graph(mlp("off", 64, 32, Storage::transient, false), FuseOptions{true, {"matmul_chain"}});
  EXPECT_EQ(reason_for(off, "down"), prefix + "rule matmul_chain is off (--no-fuse-rule)");
}

// Rule row_reduction: the training MLP's backward pass computes the hidden
// activation's gradient (fc2_grad_a, then relu's gradient) and reduces it
// over the rows in the same kernel, for the bias (a sum over rows) and the
// weight (x^T @ dx): the gradient never reaches memory.
TEST(Fusion, RowReductionsRunInTheKernelThatComputesTheirValue) {
  Compiled c = plan_program(load_program(source_path("examples/train_mlp.json"), {}), {});
  const KernelGroup* k = nullptr;
  for (const auto& kernel : c.kernels)
    if (kernel.rule == FusionRule::row_reduction) k = &kernel;
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(task_ids(c, *k), (std::vector<std::string>{"fc2_grad_a", "act1_backward", "bias1_grad_b_sum", "fc1_grad_b"}));
  EXPECT_EQ(first_row_reduction(c.program, *k), 2u);
  EXPECT_EQ(kernel_rules(c.program, *k), (std::vector<std::string>{"matmul_epilogue", "row_reduction"}));
  EXPECT_EQ(internal_names(c, *k), (std::vector<std::string>{"fc2_grad_a.out", "act1_backward.dx"}));
  for (const auto& pb : c.plan.buffers)
    if (buffer_name(c.program, pb.buffer) == "act1_backward.dx") EXPECT_TRUE(pb.internal);
  EXPECT_EQ(reason_for(c, "fc1_grad_b"), "") << "it joined";
  int backward_launches = 0;
  for (const auto& kernel : c.kernels)
    if (kernel.phase == Phase::backward && (&kernel == &c.kernels.front() || (&kernel - 1)->launch != kernel.launch))
      ++backward_launches;
  EXPECT_EQ(backward_launches, 2) << "the loss gradient | everything that reads it";
  Compiled off = plan_program(load_program(source_path("examples/train_mlp.json"), {}),
                              CompileOptions{.fuse = FuseOptions{true, {"row_reduction"}}});
  EXPECT_EQ(reason_for(off, "fc1_grad_b"),
            "'fc1_grad_b' is a matmul op; 'act1_backward' is not reduced in its kernel: rule row_reduction is off "
            "(--no-fuse-rule)");
}

// The rule's refusals, each on the reduction's note: too many tiles of rows
// for one block to walk, too many outputs for a thread's registers, a batch
// of weight gradients. A value read elsewhere too is stored as well as reduced.
TEST(Fusion, NoRowReductionWhereRowsOrOutputsAreManyOrTheProductIsBatched) {
  auto gradient = [](const std::string& name, int64_t rows, int64_t inputs, bool batched, Storage value, DType d = f32) {
    GraphBuilder b(name);
    const Shape lead = batched ? Shape{2, rows} : Shape{rows};
    auto with = [&](Shape s, int64_t last) { s.push_back(last); return s; };
    auto dh = b.task("dh", "matmul").tensor("a", d, with(lead, 8), ext).tensor("b", d, {8, 32}, ext).tensor("out", d, with(lead, 32));
    auto dx = b.task("dx", "relu_backward").tensor("x", d, with(lead, 32), ext).tensor("dout", dh["out"]).tensor("dx", d, with(lead, 32), value);
    b.task("db", "sum_leading").tensor("x", dx["dx"]).tensor("out", d, {32}, ext);
    Shape wg = batched ? Shape{2, inputs, 32} : Shape{inputs, 32};
    b.task("dw", "matmul").tensor("a", d, with(lead, inputs), ext).tensor("b", dx["dx"]).tensor("out", d, wg, ext).arg("trans_a", true);
    return std::move(b).graph();
  };
  Compiled fused = plan_graph(gradient("fused", 96, 16, false, Storage::transient));
  ASSERT_EQ(fused.kernels.size(), 1u);
  EXPECT_EQ(internal_names(fused, fused.kernels[0]), (std::vector<std::string>{"dh.out", "dx.dx"}));
  Compiled stored = plan_graph(gradient("stored", 96, 16, false, ext));
  ASSERT_EQ(stored.kernels.size(), 1u);
  EXPECT_EQ(internal_names(stored, stored.kernels[0]), (std::vector<std::string>{"dh.out"})) << "dx.dx is stored";
  const std::string prefix = "'dw' is a matmul op; 'dx' is not reduced in its kernel: ";
  Compiled many_rows = plan_graph(gradient("many_rows", 600, 16, false, Storage::transient));
  EXPECT_EQ(many_rows.kernels.size(), 3u);
  EXPECT_EQ(reason_for(many_rows, "dw"),
            prefix + "each block would walk 19 tiles of rows of 'dx.dx' one after another (at most 16): the value's "
                     "parallel tiles are worth more than its traffic");
  Compiled wide = plan_graph(gradient("wide", 96, 160, false, Storage::transient));
  EXPECT_EQ(wide.kernels.size(), 2u) << "the sum joins, the weight gradient does not";
  EXPECT_EQ(reason_for(wide, "dw"), prefix + "each thread would accumulate 21 outputs of the reductions (at most 16)");
  // Each reduction's accumulators are rounded up to whole rounds of the block's
  // threads, as the emitter declares them: on the tensor-core tile (64
  // columns, 128 threads) a sum takes 1, a 30-row weight gradient 15, one of 31 rows 16.
  EXPECT_EQ(plan_graph(gradient("bf16_at_bound", 96, 30, false, Storage::transient, DType::bf16)).kernels.size(), 1u);
  Compiled past_bound = plan_graph(gradient("bf16_past_bound", 96, 31, false, Storage::transient, DType::bf16));
  EXPECT_EQ(reason_for(past_bound, "dw"), prefix + "each thread would accumulate 17 outputs of the reductions (at most 16)");
  // The reduction runs where the value is computed: its x must be ready there.
  GraphBuilder late("late_x");
  auto dh = late.task("dh", "matmul").tensor("a", f32, {64, 8}, ext).tensor("b", f32, {8, 32}, ext).tensor("out", f32, {64, 32});
  auto xk = late.task("xk", "relu").tensor("x", f32, {64, 16}, ext).tensor("out", f32, {64, 16}, ext);
  late.task("dw", "matmul").tensor("a", xk["out"]).tensor("b", dh["out"]).tensor("out", f32, {16, 32}, ext).arg("trans_a", true);
  Compiled late_x = plan_graph(std::move(late).graph());
  EXPECT_EQ(late_x.kernels.size(), 3u);
  std::vector<std::string> late_reasons;  // dw's note after xk (not its prologue), and the one after dh
  for (const auto& n : late_x.fusion_notes)
    if (late_x.program.tasks[size_t(n.task)].task->id == "dw") late_reasons.push_back(n.reason);
  ASSERT_EQ(late_reasons.size(), 2u);
  EXPECT_EQ(late_reasons[1], "'dh' is not reduced in its kernel: 'dw' reads 'xk.out', which 'xk' writes before it");
  Compiled batched = plan_graph(gradient("batched", 48, 16, true, Storage::transient));
  EXPECT_EQ(reason_for(batched, "dw"),
            prefix + "'dw' multiplies batches of matrices; a weight gradient here is [R, K]^T @ [R, N]");
}

// transformer_block: the residual adds follow their matmuls, gelu its up
// projection, the head splits the projections; scores, softmax and context
// are one attention kernel, with the head merge, which computes q, k and v
// itself; nothing follows a reduction that stores per row.
TEST(Fusion, TransformerChainsFollowTheirMatmuls) {
  Compiled c = plan_program(load_program(source_path("examples/transformer_block.json"), {}), {});
  std::vector<std::vector<std::string>> fused;
  for (const auto& k : c.kernels)
    if (k.tasks.size() > 1) fused.push_back(task_ids(c, k));
  EXPECT_EQ(fused, (std::vector<std::vector<std::string>>{
                       {"q", "q_heads", "k", "k_heads", "v", "v_heads", "scores", "probs", "context", "merged"},
                       {"attn_out", "res1"},
                       {"up", "act", "down", "res2"}}));
  // Without rule attention_projection, each projection ends with its split.
  CompileOptions options;
  options.fuse.disabled_rules = {"attention_projection"};
  Compiled apart = plan_program(load_program(source_path("examples/transformer_block.json"), {}), options);
  fused.clear();
  for (const auto& k : apart.kernels)
    if (k.tasks.size() > 1) fused.push_back(task_ids(apart, k));
  EXPECT_EQ(fused, (std::vector<std::vector<std::string>>{{"q", "q_heads"},
                                                          {"k", "k_heads"},
                                                          {"v", "v_heads"},
                                                          {"scores", "probs", "context", "merged"},
                                                          {"attn_out", "res1"},
                                                          {"up", "act", "down", "res2"}}));
}

TEST(Fusion, ARowOpTakesAnEpilogueButNotOnItsOtherOutputs) {
  GraphBuilder b("row_epilogue");
  auto norm = b.task("norm", "rmsnorm")
                  .tensor("x", f32, {64, 64}, ext)
                  .tensor("weight", f32, {64}, Storage::persistent)
                  .tensor("out", f32, {64, 64})
                  .tensor("rstd", f32, {64});
  auto act = b.task("act", "silu").tensor("x", norm["out"]).tensor("out", f32, {64, 64});
  b.task("scaled", "mul").tensor("a", act["out"]).tensor("b", norm["rstd"]).tensor("out", f32, {64, 64}, ext);
  Compiled c = plan_graph(std::move(b).graph());
  ASSERT_EQ(c.kernels.size(), 2u);
  EXPECT_EQ(task_ids(c, c.kernels[0]), (std::vector<std::string>{"norm", "act"}));
  EXPECT_EQ(c.kernels[0].rule, FusionRule::reduction_epilogue);
  EXPECT_EQ(reason_for(c, "scaled"), "it reads 'norm.rstd', which the kernel stores from another thread");
}

// A row gradient stores dx a row per block, an element per thread: the
// gradient from the residual path is added there. dweight comes from other
// blocks (the column sums).
TEST(Fusion, ARowGradientTakesAnEpilogueOnDx) {
  GraphBuilder b("gradient_epilogue");
  auto nb = b.task("nb", "rmsnorm_backward")
                .tensor("x", f32, {64, 64}, ext)
                .tensor("weight", f32, {64}, Storage::persistent)
                .tensor("rstd", f32, {64}, ext)
                .tensor("dout", f32, {64, 64}, ext)
                .tensor("dx", f32, {64, 64})
                .tensor("dweight", f32, {64}, ext);
  auto res = b.task("res", "add").tensor("a", nb["dx"]).tensor("b", f32, {64, 64}, ext).tensor("out", f32, {64, 64});
  b.task("scaled", "mul").tensor("a", res["out"]).tensor("b", nb["dweight"]).tensor("out", f32, {64, 64}, ext);
  Compiled c = plan_graph(std::move(b).graph());
  ASSERT_EQ(c.kernels.size(), 2u);
  EXPECT_EQ(task_ids(c, c.kernels[0]), (std::vector<std::string>{"nb", "res"}));
  EXPECT_EQ(c.kernels[0].rule, FusionRule::reduction_epilogue);
  EXPECT_EQ(reason_for(c, "scaled"), "it reads 'nb.dweight', which the kernel stores from another thread");
}

TEST(Fusion, NoEpilogueAfterAWholeRowReduction) {
  GraphBuilder b("sum_then");
  auto s = b.task("s", "sum").tensor("x", f32, {4, 64}, ext).tensor("out", f32, {4});
  b.task("act", "relu").tensor("x", s["out"]).tensor("out", f32, {4}, ext);
  Compiled c = plan_graph(std::move(b).graph());
  EXPECT_EQ(c.kernels.size(), 2u);
  EXPECT_EQ(reason_for(c, "act"), "the kernel before takes no more tasks: 's' is a reduction op");
}

// The epilogue runs while the matmul still reads x at other elements: its
// output must not take x's storage, though add may alias out to a.
TEST(Fusion, AnEpilogueNeverStoresOverTheMatmulsInputs) {
  GraphBuilder b("residual");
  auto x = b.task("x", "relu").tensor("x", f32, {32, 32}, ext).tensor("out", f32, {32, 32});
  auto mm = b.task("mm", "matmul").tensor("a", x["out"]).tensor("b", f32, {32, 32}, ext).tensor("out", f32, {32, 32});
  auto res = b.task("res", "add").tensor("a", x["out"]).tensor("b", mm["out"]).tensor("out", f32, {32, 32});
  b.task("later", "sum").tensor("x", res["out"]).tensor("out", f32, {32}, ext);
  Compiled c = plan_graph(std::move(b).graph());
  ASSERT_EQ(task_ids(c, c.kernels[1]), (std::vector<std::string>{"mm", "res"}));
  EXPECT_NE(c.plan.lookup(c.program, "res", "out").offset, c.plan.lookup(c.program, "x", "out").offset);
}

TEST(Fusion, NotAcrossAPhase) {
  GraphBuilder b("phases");
  auto fill = b.task("zeros", "fill", Phase::init).tensor("out", f32, {8}, Storage::persistent).arg("value", 1.0);
  b.task("act", "relu").tensor("x", fill["out"]).tensor("out", f32, {8}, ext);
  Compiled c = plan_graph(std::move(b).graph());
  EXPECT_EQ(c.kernels.size(), 2u);
  EXPECT_EQ(reason_for(c, "act"), "") << "tasks of two phases are never compared";
}

TEST(Fusion, NotWhenTheOutputShapeDiffers) {
  GraphBuilder b("shapes");
  auto row = b.task("row", "relu").tensor("x", f32, {8}, ext).tensor("out", f32, {8});
  b.task("grid", "add").tensor("a", row["out"]).tensor("b", f32, {4, 8}, ext).tensor("out", f32, {4, 8}, ext);
  Compiled c = plan_graph(std::move(b).graph());
  EXPECT_EQ(c.kernels.size(), 2u);
  EXPECT_EQ(reason_for(c, "grid"), "its output is [4, 8], the kernel's elements are [8]");
}

TEST(Fusion, NotIndependentTasksIntoOneKernel) {
  GraphBuilder b("independent");
  b.task("one", "relu").tensor("x", f32, {8}, ext).tensor("out", f32, {8}, ext);
  b.task("two", "neg").tensor("x", f32, {8}, ext).tensor("out", f32, {8}, ext);
  Compiled c = plan_graph(std::move(b).graph());
  EXPECT_EQ(c.kernels.size(), 2u);
  EXPECT_EQ(reason_for(c, "two"), "it reads nothing the kernel computes or reads");
}

// Siblings: `two` reads only x, as `one` does; the loop loads x once and
// stores both (a diamond: `both` reads the two). Not at another index: a
// broadcast input is not the element's own.
TEST(Fusion, SiblingsThatReadOneInputShareALoop) {
  GraphBuilder b("siblings");
  auto one = b.task("one", "relu").tensor("x", f32, {8, 4}, ext).tensor("out", f32, {8, 4}, ext);
  auto two = b.task("two", "neg").tensor("x", one["x"]).tensor("out", f32, {8, 4});
  b.task("both", "add").tensor("a", one["out"]).tensor("b", two["out"]).tensor("out", f32, {8, 4}, ext);
  Compiled c = plan_graph(std::move(b).graph());
  ASSERT_EQ(c.kernels.size(), 1u);
  EXPECT_EQ(task_ids(c, c.kernels[0]), (std::vector<std::string>{"one", "two", "both"}));
  EXPECT_EQ(internal_names(c, c.kernels[0]), (std::vector<std::string>{"two.out"}));

  GraphBuilder d("not_siblings");
  auto row = d.task("row", "relu").tensor("x", f32, {4}, ext).tensor("out", f32, {4}, ext);
  d.task("grid", "add").tensor("a", f32, {8, 4}, ext).tensor("b", row["x"]).tensor("out", f32, {8, 4}, ext);
  Compiled e = plan_graph(std::move(d).graph());
  EXPECT_EQ(e.kernels.size(), 2u);
}

// Rule permuted_store: a projection split into heads, then attention-like
// use of the heads; the other way round, heads merged after a batched matmul.
TEST(Fusion, AHeadsSplitIsStoredByItsMatmul) {
  GraphBuilder b("heads");
  auto q = b.task("q", "matmul").tensor("a", f32, {8, 16}, ext).tensor("b", f32, {16, 16}, ext).tensor("out", f32, {8, 16});
  auto h = b.task("h", "split_heads").tensor("x", q["out"]).tensor("out", f32, {4, 8, 4}).arg("heads", int64_t(4));
  auto c = b.task("c", "matmul").tensor("a", h["out"]).tensor("b", f32, {4, 4, 4}, ext).tensor("out", f32, {4, 8, 4});
  b.task("m", "merge_heads").tensor("x", c["out"]).tensor("out", f32, {8, 16}, ext).arg("heads", int64_t(4));
  Compiled fused = plan_graph(std::move(b).graph());
  ASSERT_EQ(fused.kernels.size(), 2u);
  EXPECT_EQ(task_ids(fused, fused.kernels[0]), (std::vector<std::string>{"q", "h"}));
  EXPECT_EQ(task_ids(fused, fused.kernels[1]), (std::vector<std::string>{"c", "m"}));
  EXPECT_EQ(internal_names(fused, fused.kernels[0]), std::vector<std::string>{"q.out"}) << "q.out never reaches memory";
  EXPECT_EQ(internal_names(fused, fused.kernels[1]), std::vector<std::string>{"c.out"});
}

// Rule attention: scores, softmax and the matmul by the values in one
// kernel, the head merge stored from its epilogue (the projections apart:
// the rule of their own is off).
TEST(Fusion, AttentionIsOneKernel) {
  CompileOptions options;
  options.fuse.disabled_rules = {"attention_projection"};
  Compiled c = plan_program(load_program(source_path("examples/transformer_block.json"), {}), options);
  const KernelGroup* attention = nullptr;
  for (const auto& k : c.kernels)
    if (k.rule == FusionRule::attention) attention = &k;
  ASSERT_NE(attention, nullptr);
  EXPECT_EQ(task_ids(c, *attention), (std::vector<std::string>{"scores", "probs", "context", "merged"}));
  EXPECT_EQ(internal_names(c, *attention), (std::vector<std::string>{"scores.out", "probs.out", "context.out"}));
}

// In training the probabilities are saved for the backward pass: stored from
// the kernel, once; the scores still never reach memory.
TEST(Fusion, AttentionStoresProbabilitiesTheBackwardPassReads) {
  Compiled c = plan_program(load_program(source_path("examples/train_transformer.json"), {}), {});
  int attention = 0;
  for (const auto& k : c.kernels) {
    if (k.rule != FusionRule::attention) continue;
    ++attention;
    const std::vector<std::string> internal = internal_names(c, k);
    EXPECT_NE(std::find(internal.begin(), internal.end(), "scores.out"), internal.end());
    EXPECT_EQ(std::find(internal.begin(), internal.end(), "probs.out"), internal.end());
  }
  EXPECT_EQ(attention, 1);
}

// Rule matmul_sum: in training, the gradients of ln1's output through q, k
// and v, summed by two adds, are one product over the concatenated inner
// dimensions; the products and the partial sum never reach memory.
TEST(Fusion, SummedMatmulsRunAsOneProduct) {
  Compiled c = plan_program(load_program(source_path("examples/train_transformer.json"), {}), {});
  const KernelGroup* sum = nullptr;
  for (const auto& k : c.kernels)
    if (k.rule == FusionRule::matmul_sum) sum = &k;
  ASSERT_NE(sum, nullptr);
  EXPECT_EQ(task_ids(c, *sum), (std::vector<std::string>{"v_grad_a", "k_grad_a", "grad_ln1_out_sum", "q_grad_a",
                                                         "grad_ln1_out_sum_2"}));
  EXPECT_EQ(internal_names(c, *sum),
            (std::vector<std::string>{"v_grad_a.out", "k_grad_a.out", "grad_ln1_out_sum.out", "q_grad_a.out"}));
  const MatmulSum terms = matmul_sum_terms(c.program, *sum);
  EXPECT_EQ(terms.terms, (std::vector<size_t>{0, 1, 3}));
  EXPECT_EQ(terms.adds, (std::vector<size_t>{2, 4}));
  EXPECT_EQ(terms.epilogue, 5u);
}

// Its refusals, on the second term's note: a term read elsewhere, a
// transposed left operand, another alpha, the rule off.
TEST(Fusion, NoMatmulSumWhereATermIsReadOrTransposedOrScaledOtherwise) {
  auto sum = [](const std::string& name, Storage first, bool trans_a, double alpha, bool read_twice = false) {
    GraphBuilder b(name);
    auto m1 = b.task("m1", "matmul").tensor("a", f32, trans_a ? Shape{8, 16} : Shape{16, 8}, ext).tensor("b", f32, {8, 24}, ext)
                  .tensor("out", f32, {16, 24}, first).arg("trans_a", trans_a).arg("alpha", alpha);
    auto m2 = b.task("m2", "matmul").tensor("a", f32, {16, 4}, ext).tensor("b", f32, {4, 24}, ext).tensor("out", f32, {16, 24});
    b.task("s", "add").tensor("a", m2["out"]).tensor("b", m1["out"]).tensor("out", f32, {16, 24}, ext);
    if (read_twice) b.task("r", "sum").tensor("x", m1["out"]).tensor("out", f32, {16}, ext);
    return std::move(b).graph();
  };
  EXPECT_EQ(plan_graph(sum("fused", Storage::transient, false, 1.0)).kernels.size(), 1u);
  const std::string prefix = "'m2' is a matmul op; 'm1' is not summed in its kernel: ";
  EXPECT_EQ(reason_for(plan_graph(sum("read", ext, false, 1.0)), "m2"),
            prefix + "'m1.out' is read after its phase or by the caller, so it is stored");
  EXPECT_EQ(reason_for(plan_graph(sum("read_twice", Storage::transient, false, 1.0, true)), "m2"),
            prefix + "'m1.out' is read by more than 's', so it is stored");
  EXPECT_EQ(reason_for(plan_graph(sum("transposed", Storage::transient, true, 1.0)), "m2"),
            prefix + "'m1' transposes its left operand");
  EXPECT_EQ(reason_for(plan_graph(sum("scaled", Storage::transient, false, 0.5)), "m2"),
            prefix + "'m1' and 'm2' scale their products differently (alpha)");
  FuseOptions off;
  off.disabled_rules = {"matmul_sum"};
  Compiled rule_off = plan_graph(sum("rule_off", Storage::transient, false, 1.0), off);
  EXPECT_EQ(rule_off.kernels.size(), 2u);
  EXPECT_EQ(reason_for(rule_off, "m2"), prefix + "rule matmul_sum is off (--no-fuse-rule)");
}

// Rule attention_backward: in training, the attention's five gradient
// tasks (with the head merges of dq, dk and dv) are one kernel, in which
// dp, ds and the gradients before their merges live.
TEST(Fusion, AttentionGradientsRunInOneKernel) {
  Compiled c = plan_program(load_program(source_path("examples/train_transformer.json"), {}), {});
  const KernelGroup* gradient = nullptr;
  for (const auto& k : c.kernels)
    if (k.rule == FusionRule::attention_backward) gradient = &k;
  ASSERT_NE(gradient, nullptr);
  EXPECT_EQ(task_ids(c, *gradient),
            (std::vector<std::string>{"context_grad_a", "context_grad_b", "v_heads_grad_x", "probs_backward",
                                      "scores_grad_a", "q_heads_grad_x", "scores_grad_b", "k_heads_grad_x"}));
  EXPECT_EQ(internal_names(c, *gradient),
            (std::vector<std::string>{"context_grad_a.out", "context_grad_b.out", "probs_backward.dx", "scores_grad_a.out",
                                      "scores_grad_b.out"}));
  EXPECT_EQ(kernel_rules(c.program, *gradient), (std::vector<std::string>{"matmul_epilogue", "attention_backward"}));
  const AttentionGradient roles = attention_gradient(c.program, *gradient);
  EXPECT_EQ(std::vector<size_t>({roles.dp, roles.dv, roles.ds, roles.dq, roles.dk}), (std::vector<size_t>{0, 1, 3, 4, 6}));
  EXPECT_EQ(roles.epilogue_end(roles.dv, gradient->tasks.size()), 3u);
  EXPECT_EQ(roles.epilogue_end(roles.dk, gradient->tasks.size()), 8u);
  EXPECT_EQ(reason_for(c, "context_grad_b"), "") << "it joined";
}

// Rule attention_backward on the flash kernels: a 16-bit attention and its
// gradients, whose forward runs the flash kernel, pair up (flash_trained):
// the probabilities internal to both kernels (no storage), at a length the
// row kernel refuses; not without dk (q would die in the forward); f32 on
// CUDA cores, or as TF32 under --allow-tf32 (heads of 16 padded to 32 past
// the 128 query rows the row kernels train).
TEST(Fusion, TrainedFlashAttentionPairsItsTwoKernels) {
  auto training = [](DType d, int64_t T, bool with_dk = true, int64_t D = 64) {
    GraphBuilder b("trained");
    const Shape rows{1, 2, T, D}, square{1, 2, T, T};
    auto s = b.task("scores", "matmul").tensor("a", d, rows, ext).tensor("b", d, rows, ext).tensor("out", d, square).arg("trans_b", true);
    auto p = b.task("probs", "softmax").tensor("x", s["out"]).tensor("out", d, square).arg("scale", 0.125);
    auto c = b.task("context", "matmul").tensor("a", p["out"]).tensor("b", d, rows, ext).tensor("out", d, rows, ext);
    auto dp = b.task("dp", "matmul", Phase::backward).tensor("a", d, rows, ext).tensor("b", c["b"]).tensor("out", d, square).arg("trans_b", true);
    b.task("dv", "matmul", Phase::backward).tensor("a", p["out"]).tensor("b", dp["a"]).tensor("out", d, rows, ext).arg("trans_a", true);
    auto ds = b.task("ds", "softmax_backward", Phase::backward).tensor("out", p["out"]).tensor("dout", dp["out"]).tensor("dx", d, square);
    b.task("dq", "matmul", Phase::backward).tensor("a", ds["dx"]).tensor("b", s["b"]).tensor("out", d, rows, ext);
    if (with_dk)
      b.task("dk", "matmul", Phase::backward).tensor("a", ds["dx"]).tensor("b", s["a"]).tensor("out", d, rows, ext).arg("trans_a", true);
    return std::move(b).graph();
  };
  Compiled flash = plan_graph(training(DType::bf16, 300));
  ASSERT_EQ(flash.kernels.size(), 2u);
  for (const KernelGroup& k : flash.kernels) {
    EXPECT_TRUE(k.flash_trained) << k.name;
    const std::vector<std::string> internal = internal_names(flash, k);
    EXPECT_NE(std::find(internal.begin(), internal.end(), "probs.out"), internal.end()) << k.name;
  }
  EXPECT_EQ(flash.kernels[1].rule, FusionRule::attention_backward);
  // Without dk nothing in the backward pass reads q, which both kinds of block need.
  Compiled no_dk = plan_graph(training(DType::bf16, 300, false));
  EXPECT_FALSE(no_dk.kernels[0].flash_trained);
  EXPECT_NE(reason_for(no_dk, "ds").find("not the flash backward kernel: it recomputes the scores from q and k, but the "
                                         "backward pass has no dk to read q"),
            std::string::npos)
      << reason_for(no_dk, "ds");
  // f32 heads of 16: the row kernels train up to 128 query rows (their
  // probabilities a bounded [128, Tk] a head); past those the flash kernels,
  // the heads padded to 32.
  Compiled narrow = plan_graph(training(DType::f32, 300, true, 16));
  ASSERT_EQ(narrow.kernels.size(), 2u);
  for (const KernelGroup& k : narrow.kernels) {
    EXPECT_TRUE(k.flash_trained) << k.name;
    ASSERT_TRUE(k.flash.has_value()) << k.name;
    EXPECT_EQ(k.flash->d, 32) << k.name;
    EXPECT_EQ(k.flash->head_d, 16) << k.name;
  }
  Compiled short_narrow = plan_graph(training(DType::f32, 100, true, 16));
  EXPECT_FALSE(short_narrow.kernels[0].flash_trained);
  ASSERT_EQ(short_narrow.kernels.size(), 2u);
  EXPECT_EQ(short_narrow.kernels[1].rule, FusionRule::attention_backward);  // the row kernel
  EXPECT_FALSE(short_narrow.kernels[1].flash.has_value());
  // f32 pairs them on CUDA cores (exact f32), or under --allow-tf32 as TF32.
  for (const bool allow_tf32 : {false, true}) {
    CompileOptions options;
    options.emit.allow_tf32 = allow_tf32;
    Compiled f32 = plan_program(load_program(training(DType::f32, 300), {}), options);
    ASSERT_EQ(f32.kernels.size(), 2u);
    for (const KernelGroup& k : f32.kernels) {
      EXPECT_TRUE(k.flash_trained) << k.name;
      ASSERT_TRUE(k.flash.has_value()) << k.name;
      EXPECT_EQ(k.flash->tf32, allow_tf32) << k.name;
      EXPECT_EQ(k.flash->simt_f32, !allow_tf32) << k.name;
    }
  }
}

// Heads over 128 stream 32 keys a step: beside them, heads of 16 (a step of
// 64 chunks for 128 copying threads) are refused, and the refusal says why.
TEST(Fusion, FlashAttentionRefusesNarrowHeadsBesideWideOnes) {
  GraphBuilder b("wide_values");
  constexpr DType d = DType::bf16;
  auto s = b.task("scores", "matmul").tensor("a", d, {1, 1, 64, 16}, ext).tensor("b", d, {1, 1, 64, 16}, ext)
               .tensor("out", d, {1, 1, 64, 64}).arg("trans_b", true);
  auto p = b.task("probs", "softmax").tensor("x", s["out"]).tensor("out", d, {1, 1, 64, 64});
  b.task("context", "matmul").tensor("a", p["out"]).tensor("b", d, {1, 1, 64, 256}, ext).tensor("out", d, {1, 1, 64, 256}, ext);
  const Program program = load_program(std::move(b).graph(), {});
  std::string why;
  EXPECT_FALSE(flash_attention_tile_of(program, 0, 1, false, &why).has_value());
  EXPECT_EQ(why, "heads of 16 with values of 256: over 128 the flash kernel streams 32 keys a step, which takes heads of "
                 "at least 32 beside it");
}

// Grouped-query attention's gradients: keys and values shared by a group of
// query heads fuse (the kernels read a query head's keys and values at one
// head of both); keys shared where the values are not, the row kernel would
// read the keys at the values' head, and the rule refuses, saying why.
TEST(Fusion, AttentionGradientsTakeGroupedQueryHeadsOfOneShape) {
  auto training = [](const Shape& keys, const Shape& values) {
    GraphBuilder b("grouped");
    constexpr DType d = DType::f32;
    const Shape rows{1, 2, 4, 40, 16}, square{1, 2, 4, 40, 40};
    auto s = b.task("scores", "matmul").tensor("a", d, rows, ext).tensor("b", d, keys, ext).tensor("out", d, square).arg("trans_b", true);
    auto p = b.task("probs", "softmax").tensor("x", s["out"]).tensor("out", d, square).arg("scale", 0.25);
    auto c = b.task("context", "matmul").tensor("a", p["out"]).tensor("b", d, values, ext).tensor("out", d, rows, ext);
    auto dp = b.task("dp", "matmul", Phase::backward).tensor("a", d, rows, ext).tensor("b", c["b"]).tensor("out", d, square).arg("trans_b", true);
    auto ds = b.task("ds", "softmax_backward", Phase::backward).tensor("out", p["out"]).tensor("dout", dp["out"]).tensor("dx", d, square);
    b.task("dq", "matmul", Phase::backward).tensor("a", ds["dx"]).tensor("b", s["b"]).tensor("out", d, rows, ext);
    return std::move(b).graph();
  };
  const Shape shared{1, 2, 1, 40, 16}, own{1, 2, 4, 40, 16};
  const Compiled grouped = plan_graph(training(shared, shared));
  ASSERT_EQ(grouped.kernels.size(), 2u);
  EXPECT_EQ(grouped.kernels[0].rule, FusionRule::attention);
  EXPECT_EQ(grouped.kernels[1].rule, FusionRule::attention_backward);
  EXPECT_NE(reason_for(plan_graph(training(shared, own)), "ds").find("'dq' multiplies 'ds.dx' by keys 'scores.b' of other "
                                                                     "heads than the values 'context.b'"),
            std::string::npos)
      << reason_for(plan_graph(training(shared, own)), "ds");
}

// The rule's refusals, on the softmax gradient's note: the rule off, ds read
// by the caller, a head whose key and value gradients a block's registers
// cannot hold, or whose rows its shared memory cannot.
TEST(Fusion, NoAttentionGradientKernelWhereDsIsStoredOrTheHeadIsLarge) {
  auto gradient = [](const std::string& name, int64_t Tk, int64_t D, Storage ds_storage, int64_t Tq = 16,
                     bool q_is_k = false) {
    GraphBuilder b(name);
    const int64_t B = 2, H = 2;
    auto dp = b.task("dp", "matmul").tensor("a", f32, {B, H, Tq, D}, ext).tensor("b", f32, {B, H, Tk, D}, ext)
                  .tensor("out", f32, {B, H, Tq, Tk}).arg("trans_b", true);
    auto ds = b.task("ds", "softmax_backward").tensor("out", f32, {B, H, Tq, Tk}, ext).tensor("dout", dp["out"])
                  .tensor("dx", f32, {B, H, Tq, Tk}, ds_storage);
    b.task("dv", "matmul").tensor("a", ds["out"]).tensor("b", dp["a"]).tensor("out", f32, {B, H, Tk, D}, ext).arg("trans_a", true);
    auto dq = b.task("dq", "matmul").tensor("a", ds["dx"]).tensor("b", f32, {B, H, Tk, D}, ext)
                  .tensor("out", f32, {B, H, Tq, D}, q_is_k ? Storage::transient : ext);
    auto dk = b.task("dk", "matmul").tensor("a", ds["dx"]);
    if (q_is_k)
      dk.tensor("b", dq["b"]);
    else
      dk.tensor("b", f32, {B, H, Tq, D}, ext);
    dk.tensor("out", f32, {B, H, Tk, D}, q_is_k ? Storage::transient : ext).arg("trans_a", true);
    // scores = q q^T: the derive pass sums the two gradients of q.
    if (q_is_k) b.task("dqk", "add").tensor("a", dk["out"]).tensor("b", dq["out"]).tensor("out", f32, {B, H, Tq, D}, ext);
    return std::move(b).graph();
  };
  EXPECT_EQ(plan_graph(gradient("fused", 64, 64, Storage::transient)).kernels.size(), 1u) << "at both bounds";
  const std::string prefix = "'ds' is a reduction op; 'ds' runs in no attention_backward kernel: ";
  // (The probabilities are given: no forward to recompute them from.)
  const std::string not_flash = "; not the flash backward kernel: 'ds.out' is not a softmax's output";
  FuseOptions off;
  off.disabled_rules = {"attention_backward"};
  Compiled rule_off = plan_graph(gradient("rule_off", 16, 8, Storage::transient), off);
  EXPECT_EQ(rule_off.kernels.size(), 5u);
  EXPECT_EQ(reason_for(rule_off, "ds"), prefix + "rule attention_backward is off (--no-fuse-rule)");
  EXPECT_EQ(reason_for(plan_graph(gradient("stored", 16, 8, ext)), "ds"),
            prefix + "'ds.dx' is read after its phase or by the caller, so it is stored");
  EXPECT_EQ(reason_for(plan_graph(gradient("wide", 64, 96, Storage::transient)), "ds"),
            prefix + "each thread would accumulate 48 elements of the key and value gradients (at most 32)" + not_flash);
  // 512 keys of 4: the probabilities and ds of 8 query rows take 16 KiB each.
  EXPECT_EQ(reason_for(plan_graph(gradient("long", 512, 4, Storage::transient)), "ds"),
            prefix + "the head's keys and values and a tile of 8 query rows take 49408 bytes of shared memory, more "
                     "than 49152" + not_flash);
  EXPECT_EQ(reason_for(plan_graph(gradient("many_queries", 16, 8, Storage::transient, 136)), "ds"),
            prefix + "each block would walk 17 tiles of 8 query rows one after another (at most 16)" + not_flash);
  // dq + dk in dk's epilogue would read dq before the kernel computed it.
  Compiled shared = plan_graph(gradient("q_is_k", 16, 8, Storage::transient, 16, true));
  EXPECT_EQ(reason_for(shared, "ds"), prefix + "'dqk' reads 'dq.out', which the kernel would compute for another gradient");
}

// Over 1024 keys the flash kernel (16-bit q, k and v, heads up to 256,
// probabilities read by nothing else, its own launch) or the streamed row
// kernel (the rest, with query and output rows of up to 1024) fuses an
// attention (docs/attention.md); `describe` says which. Refusals name the
// reason; the three tasks then run alone.
TEST(Fusion, OverAThousandKeysTheFlashOrTheStreamedKernelFusesAttention) {
  auto long_attention = [](DType d, int64_t D, Storage probs, bool trans_v = false) {
    GraphBuilder b("long_attention");
    auto s = b.task("s", "matmul")
                 .tensor("a", d, {2, 3, 8, D}, ext)
                 .tensor("b", d, {2, 3, 1100, D}, ext)
                 .tensor("out", d, {2, 3, 8, 1100})
                 .arg("trans_b", true);
    auto p = b.task("p", "softmax").tensor("x", s["out"]).tensor("out", d, {2, 3, 8, 1100}, probs).arg("scale", 0.125);
    b.task("c", "matmul")
        .tensor("a", p["out"])
        .tensor("b", d, trans_v ? Shape{2, 3, D, 1100} : Shape{2, 3, 1100, D}, ext)
        .tensor("out", d, {2, 3, 8, D}, ext)
        .arg("trans_b", trans_v);
    return std::move(b).graph();
  };
  const Compiled flash = plan_graph(long_attention(DType::bf16, 64, Storage::transient));
  ASSERT_EQ(flash.kernels.size(), 1u);
  EXPECT_EQ(flash.kernels[0].rule, FusionRule::attention);
  EXPECT_EQ(internal_names(flash, flash.kernels[0]), (std::vector<std::string>{"s.out", "p.out"}));
  // The streamed row kernel: f32, a head the flash kernel does not take, stored probabilities, a megakernel.
  EXPECT_EQ(plan_graph(long_attention(DType::f32, 64, Storage::transient)).kernels.size(), 1u);
  EXPECT_EQ(plan_graph(long_attention(DType::f16, 68, Storage::transient)).kernels.size(), 1u);
  EXPECT_EQ(plan_graph(long_attention(DType::bf16, 64, ext)).kernels.size(), 1u);
  CompileOptions megakernel;  // (the pipeline tells the fusion pass)
  megakernel.emit.megakernel = true;
  megakernel.dump_after = "fuse";
  const Compiled mega = plan_program(load_program(long_attention(DType::bf16, 64, Storage::transient), {}), megakernel);
  EXPECT_EQ(mega.kernels.size(), 1u);
  // The tile, or why none, decided with the IR and shown in its dump.
  EXPECT_TRUE(flash.kernels[0].flash.has_value());
  EXPECT_FALSE(mega.kernels[0].flash.has_value());
  EXPECT_EQ(mega.kernels[0].why_not_flash, "a megakernel's tiles share one block size");
  EXPECT_NE(mega.dump.find("  not on the flash kernel: " + mega.kernels[0].why_not_flash), std::string::npos) << mega.dump;
  EXPECT_EQ(plan_graph(long_attention(DType::f16, 80, Storage::transient)).kernels.size(), 1u) << "80: padded to 128";
  // Refused: a query row too long for the row kernels (where the flash kernel does not apply either), values transposed.
  EXPECT_EQ(reason_for(plan_graph(long_attention(DType::f32, 1100, Storage::transient)), "p"),
            "'p' is a reduction op; the row kernels hold a query row of at most 1024 values per warp, and the flash "
            "kernel does not apply: q, k and v are f32, f32 and f32: the tensor-core kernel takes one 16-bit type (f32 "
            "keeps its f32 arithmetic in the row kernel; --allow-tf32 runs it as TF32)");
  EXPECT_EQ(reason_for(plan_graph(long_attention(DType::f16, 1100, Storage::transient)), "p"),
            "'p' is a reduction op; the row kernels hold a query row of at most 1024 values per warp, and the flash "
            "kernel does not apply: a head of 1100 values: the flash kernel takes heads of a multiple of 8 values up to "
            "256");
  const Compiled transposed = plan_graph(long_attention(DType::bf16, 64, Storage::transient, true));
  EXPECT_EQ(transposed.kernels.size(), 3u);
  EXPECT_EQ(reason_for(transposed, "p"),
            "'p' is a reduction op; over 1024 keys an attention kernel must take the values' matmul, and 'c' transposes "
            "an operand; attention multiplies the probabilities by the values as they are");
}

TaskGraph attention_like(bool trans_b, bool scores_read_later) {
  GraphBuilder b("attention_like");
  auto s = b.task("s", "matmul")
               .tensor("a", f32, {2, 8, 4}, ext)
               .tensor("b", f32, {2, trans_b ? 8 : 4, trans_b ? 4 : 8}, ext)
               .tensor("out", f32, {2, 8, 8}, scores_read_later ? ext : Storage::transient)
               .arg("trans_b", trans_b);
  auto p = b.task("p", "softmax").tensor("x", s["out"]).tensor("out", f32, {2, 8, 8});
  auto c = b.task("c", "matmul").tensor("a", p["out"]).tensor("b", f32, {2, 8, 8}, ext).tensor("out", f32, {2, 8, 8});
  b.task("e", "add").tensor("a", c["out"]).tensor("b", p["out"]).tensor("out", f32, {2, 8, 8}, ext);
  return std::move(b).graph();
}

TEST(Fusion, NotAttentionWithoutItsShape) {
  Compiled plain = plan_graph(attention_like(false, false));
  EXPECT_EQ(reason_for(plain, "p"), "'p' is a reduction op; attention fuses a softmax after a * b^T only");
  Compiled read_later = plan_graph(attention_like(true, true));
  EXPECT_EQ(reason_for(read_later, "p"), "'p' is a reduction op; attention keeps the scores, which are read elsewhere");
  Compiled fused = plan_graph(attention_like(true, false));
  EXPECT_EQ(reason_for(fused, "p"), "");
  EXPECT_EQ(reason_for(fused, "c"), "");
  // c.out has p.out's shape only by chance: a row's probabilities are not at c's elements.
  EXPECT_EQ(reason_for(fused, "e"), "it reads 'p.out', which the attention kernel keeps per row");
  GraphBuilder b("long");
  auto s = b.task("s", "matmul")
               .tensor("a", f32, {8, 4}, ext)
               .tensor("b", f32, {1025, 4}, ext)
               .tensor("out", f32, {8, 1025})
               .arg("trans_b", true);
  b.task("p", "softmax").tensor("x", s["out"]).tensor("out", f32, {8, 1025}, ext);
  EXPECT_EQ(reason_for(plan_graph(std::move(b).graph()), "p"),
            "'p' is a reduction op; over 1024 keys an attention kernel must take the values' matmul, and nothing reads "
            "the probabilities");
  FuseOptions off;
  off.disabled_rules = {"attention"};
  EXPECT_EQ(reason_for(plan_graph(attention_like(true, false), off), "p"), "rule attention is off (--no-fuse-rule)");
}

// Rule attention_projection: q, k and v projections of q.a [2, T, C] (no
// norm, no prologue), each split into H heads, then attention. `k_read_later`: the
// caller reads k's heads too; `plus_values`: the context's epilogue adds v's heads.
TaskGraph projections(int64_t T, int64_t C, int64_t H, bool k_read_later = false, bool plus_values = false) {
  GraphBuilder b("projections");
  std::vector<TaskBuilder> heads;
  for (const std::string id : {"q", "k", "v"}) {
    auto p = b.task(id, "matmul");
    if (id == "q")
      p.tensor("a", f32, {2, T, C}, ext);
    else
      p.tensor("a", SlotRef{"q", "a"});
    p.tensor("b", f32, {C, C}, ext).tensor("out", f32, {2, T, C});
    heads.push_back(b.task(id + "_heads", "split_heads")
                        .tensor("x", p["out"])
                        .tensor("out", f32, {2, H, T, C / H}, id == "k" && k_read_later ? ext : Storage::transient)
                        .arg("heads", H));
  }
  auto s = b.task("scores", "matmul")
               .tensor("a", heads[0]["out"])
               .tensor("b", heads[1]["out"])
               .tensor("out", f32, {2, H, T, T})
               .arg("trans_b", true);
  auto p = b.task("probs", "softmax").tensor("x", s["out"]).tensor("out", f32, {2, H, T, T});
  auto c = b.task("context", "matmul")
               .tensor("a", p["out"])
               .tensor("b", heads[2]["out"])
               .tensor("out", f32, {2, H, T, C / H}, plus_values ? Storage::transient : ext);
  if (plus_values)
    b.task("plus", "add").tensor("a", c["out"]).tensor("b", heads[2]["out"]).tensor("out", f32, {2, H, T, C / H}, ext);
  return std::move(b).graph();
}

// Every reason recorded for `task` not joining a kernel, joined.
std::string reasons_for(const Compiled& c, const std::string& task) {
  std::string all;
  for (const auto& n : c.fusion_notes)
    if (c.program.tasks[size_t(n.task)].task->id == task) all += n.reason + "\n";
  return all;
}

const KernelGroup* attention_kernel(const Compiled& c) {
  for (const auto& k : c.kernels)
    if (k.rule == FusionRule::attention) return &k;
  return nullptr;
}

TEST(Fusion, AttentionComputesItsProjections) {
  // The transformer block: q, k and v with their norm, in the attention kernel.
  Compiled c = plan_program(load_program(source_path("examples/transformer_block.json"), {}), {});
  const KernelGroup* attention = attention_kernel(c);
  ASSERT_NE(attention, nullptr);
  EXPECT_EQ(task_ids(c, *attention), (std::vector<std::string>{"q", "q_heads", "k", "k_heads", "v", "v_heads", "scores",
                                                               "probs", "context", "merged"}));
  EXPECT_EQ(kernel_rules(c.program, *attention),
            (std::vector<std::string>{"norm_prologue", "attention_projection", "attention"}));
  EXPECT_EQ(attention->prologue.size(), 1u);
  const std::vector<std::string> internal = internal_names(c, *attention);
  for (const char* heads : {"q_heads.out", "k_heads.out", "v_heads.out", "ln1.out"})
    EXPECT_NE(std::find(internal.begin(), internal.end(), heads), internal.end()) << heads;
  EXPECT_EQ(reasons_for(c, "scores"), "") << "nothing left apart";
  for (const auto& pb : c.plan.buffers)
    if (buffer_name(c.program, pb.buffer) == "q_heads.out") EXPECT_TRUE(pb.internal);

  // Heads the attention's epilogue loads are stored as well.
  Compiled plus = plan_graph(projections(16, 32, 2, false, true));
  ASSERT_NE(attention_kernel(plus), nullptr);
  EXPECT_EQ(task_ids(plus, *attention_kernel(plus)).back(), "plus");
  const std::vector<std::string> loaded = internal_names(plus, *attention_kernel(plus));
  EXPECT_EQ(std::find(loaded.begin(), loaded.end(), "v_heads.out"), loaded.end());
  EXPECT_NE(std::find(loaded.begin(), loaded.end(), "q_heads.out"), loaded.end());
  // Heads the caller reads are stored as well.
  Compiled read_later = plan_graph(projections(16, 32, 2, true));
  ASSERT_NE(attention_kernel(read_later), nullptr);
  EXPECT_EQ(attention_kernel(read_later)->tasks.size(), 9u);
  const std::vector<std::string> kept = internal_names(read_later, *attention_kernel(read_later));
  EXPECT_EQ(std::find(kept.begin(), kept.end(), "k_heads.out"), kept.end());
  EXPECT_NE(std::find(kept.begin(), kept.end(), "v_heads.out"), kept.end());
  // Training: q's kernel stored the norm's output for the backward pass
  // (rule norm_prologue); the attention kernel stores it now, and the heads,
  // which the backward pass reads too.
  Compiled train = plan_program(load_program(source_path("examples/train_transformer.json"), {}), {});
  const KernelGroup* trained = attention_kernel(train);
  ASSERT_NE(trained, nullptr);
  EXPECT_EQ(task_ids(train, *trained).front(), "q");
  EXPECT_TRUE(stores_prologue(train.program, *trained));
  const std::vector<std::string> stored_too = internal_names(train, *trained);
  for (const char* stored : {"q_heads.out", "k_heads.out", "v_heads.out", "ln1.out", "ln1.rstd"})
    EXPECT_EQ(std::find(stored_too.begin(), stored_too.end(), stored), stored_too.end()) << stored;
  EXPECT_EQ(reasons_for(train, "scores"), "");
}

TEST(Fusion, NoProjectionInAttentionWhereItCostsParallelismOrSharedMemory) {
  // 48 query rows: 6 per warp.
  EXPECT_NE(reasons_for(plan_graph(projections(48, 16, 2)), "scores")
                .find("'q_heads' is not computed in the attention kernel: each warp would run 6 of the head's 48 "
                      "query rows one after another (at most 4)"),
            std::string::npos);
  // 64 rows of 256: too many for shared memory.
  const std::string rows = reasons_for(plan_graph(projections(64, 256, 4)), "scores");
  EXPECT_NE(rows.find("'q_heads' is not computed in the attention kernel: the block's rows of 'q.a' (64 x 256) with "
                      "the attention's own would take"),
            std::string::npos)
      << rows;
  // One head of 48 over 32 rows: q and k fit, v would make 4608 outputs per block.
  Compiled work = plan_graph(projections(32, 48, 1));
  EXPECT_EQ(task_ids(work, *attention_kernel(work)).front(), "q");
  EXPECT_NE(reasons_for(work, "scores")
                .find("'v_heads' is not computed in the attention kernel: each block would compute 4608 projection "
                      "outputs one after another (at most 4096)"),
            std::string::npos)
      << reasons_for(work, "scores");
  // A projection of another phase: the initialiser's keys run once, not every step.
  {
    GraphBuilder b("init_keys");
    auto k = b.task("k", "matmul", Phase::init)
                 .tensor("a", f32, {2, 8, 16}, ext)
                 .tensor("b", f32, {16, 16}, ext)
                 .tensor("out", f32, {2, 8, 16});
    auto kh = b.task("k_heads", "split_heads", Phase::init)
                  .tensor("x", k["out"])
                  .tensor("out", f32, {2, 2, 8, 8}, Storage::persistent)
                  .arg("heads", int64_t(2));
    auto s = b.task("scores", "matmul")
                 .tensor("a", f32, {2, 2, 8, 8}, ext)
                 .tensor("b", kh["out"])
                 .tensor("out", f32, {2, 2, 8, 8})
                 .arg("trans_b", true);
    auto p = b.task("probs", "softmax").tensor("x", s["out"]).tensor("out", f32, {2, 2, 8, 8});
    b.task("context", "matmul").tensor("a", p["out"]).tensor("b", f32, {2, 2, 8, 8}, ext).tensor("out", f32, {2, 2, 8, 8}, ext);
    Compiled c = plan_graph(std::move(b).graph());
    EXPECT_NE(reasons_for(c, "scores").find("'k_heads' is not computed in the attention kernel: 'k' runs in the init "
                                            "phase, the attention in the forward phase"),
              std::string::npos)
        << reasons_for(c, "scores");
  }
  // The rule off.
  FuseOptions off;
  off.disabled_rules = {"attention_projection"};
  EXPECT_NE(reasons_for(plan_graph(projections(16, 32, 2), off), "scores")
                .find("'v_heads' is not computed in the attention kernel: rule attention_projection is off (--no-fuse-rule)"),
            std::string::npos);
}

// The transformer block's norms run in the projections that read them: each
// projection's kernel normalises the rows it loads, and the norms run no
// kernel of their own. (Rule attention_projection off: the projections keep
// kernels of their own.)
TEST(Fusion, ANormIsThePrologueOfTheMatmulsThatReadIt) {
  CompileOptions options;
  options.fuse.disabled_rules = {"attention_projection"};
  Compiled c = plan_program(load_program(source_path("examples/transformer_block.json"), {}), options);
  std::map<std::string, std::string> prologue_of;
  for (const auto& k : c.kernels) {
    for (int t : k.tasks) EXPECT_NE(c.program.tasks[size_t(t)].op->name, "rmsnorm") << k.name;
    for (int t : k.prologue) {
      prologue_of[task_ids(c, k).front()] = c.program.tasks[size_t(t)].task->id;
      const std::vector<std::string> internal = internal_names(c, k);
      EXPECT_NE(std::find(internal.begin(), internal.end(), c.program.tasks[size_t(t)].task->id + ".out"),
                internal.end());
    }
  }
  EXPECT_EQ(prologue_of, (std::map<std::string, std::string>{{"q", "ln1"}, {"k", "ln1"}, {"v", "ln1"}, {"up", "ln2"}}));
  EXPECT_EQ(reason_for(c, "q"), "") << "the note about the norm's kernel is gone with it";
  for (const auto& pb : c.plan.buffers) {
    const std::string name = buffer_name(c.program, pb.buffer);
    if (name == "ln1.out" || name == "ln2.out") EXPECT_TRUE(pb.internal) << name;
  }
  // 18 forward tasks: q, k and v share a launch; attention; the output
  // projection; up and down chained (rule matmul_chain).
  int forward_launches = 0;
  for (size_t k = 0; k < c.kernels.size(); ++k)
    forward_launches += c.kernels[k].phase == Phase::forward && (k == 0 || c.kernels[k - 1].launch != c.kernels[k].launch);
  EXPECT_EQ(forward_launches, 4);
}

// rmsnorm n -> a matmul's `a`, and `other` reading n.out besides.
TaskGraph norm_then(const std::string& other, Storage norm_storage = Storage::transient, bool rstd = false) {
  GraphBuilder b("norm_then_" + other);
  auto n = b.task("n", "rmsnorm")
               .tensor("x", f32, {8, 16}, ext)
               .tensor("weight", f32, {16}, Storage::persistent)
               .tensor("out", f32, {8, 16}, norm_storage);
  if (rstd) n.tensor("rstd", f32, {8}, ext);
  b.task("mm", "matmul").tensor("a", n["out"]).tensor("b", f32, {16, 4}, ext).tensor("out", f32, {8, 4}, ext);
  if (other == "relu") b.task("other", "relu").tensor("x", n["out"]).tensor("out", f32, {8, 16}, ext);
  if (other == "right")
    b.task("other", "matmul").tensor("a", f32, {4, 8}, ext).tensor("b", n["out"]).tensor("out", f32, {4, 16}, ext);
  if (other == "trans_a")
    b.task("other", "matmul")
        .tensor("a", n["out"])
        .tensor("b", f32, {8, 4}, ext)
        .tensor("out", f32, {16, 4}, ext)
        .arg("trans_a", true);
  return std::move(b).graph();
}

TEST(Fusion, NoNormPrologueWhereTheNormIsNeededOtherwise) {
  Compiled alone = plan_graph(norm_then("none"));
  ASSERT_EQ(alone.kernels.size(), 1u);
  EXPECT_EQ(task_ids(alone, alone.kernels[0]), (std::vector<std::string>{"mm"}));
  EXPECT_EQ(alone.kernels[0].prologue.size(), 1u);
  const std::string not_prologue = "'mm' is a matmul op; 'n' is not its prologue: ";
  EXPECT_EQ(reason_for(plan_graph(norm_then("relu")), "mm"),
            not_prologue + "'other' (relu) reads 'n.out' too; only a matmul's operand load normalises");
  EXPECT_EQ(reason_for(plan_graph(norm_then("right")), "mm"), not_prologue + "'other' reads 'n.out' as its right operand");
  EXPECT_EQ(reason_for(plan_graph(norm_then("trans_a")), "mm"), not_prologue + "'other' transposes it (trans_a)");
  EXPECT_EQ(reason_for(plan_graph(norm_then("none"), FuseOptions{true, {"norm_prologue"}}), "mm"),
            not_prologue + "rule norm_prologue is off (--no-fuse-rule)");
  EXPECT_EQ(plan_graph(norm_then("none"), FuseOptions{true, {"norm_prologue"}}).kernels.size(), 2u);
}

// A layernorm (GPT-2's pre-norm) is a prologue as rmsnorm is: its weight
// and bias become the kernel's parameters; training stores mean and rstd.
TEST(Fusion, ALayerNormIsAPrologueToo) {
  for (const bool stored : {false, true}) {
    GraphBuilder b(stored ? "layernorm_stored" : "layernorm");
    auto n = b.task("n", "layernorm")
                 .tensor("x", f32, {8, 16}, ext)
                 .tensor("weight", f32, {16}, Storage::persistent)
                 .tensor("bias", f32, {16}, Storage::persistent)
                 .tensor("out", f32, {8, 16});
    if (stored) n.tensor("mean", f32, {8}, ext).tensor("rstd", f32, {8}, ext);
    b.task("mm", "matmul").tensor("a", n["out"]).tensor("b", f32, {16, 4}, ext).tensor("out", f32, {8, 4}, ext);
    Compiled c = plan_graph(std::move(b).graph());
    ASSERT_EQ(c.kernels.size(), 1u);
    EXPECT_EQ(c.kernels[0].prologue.size(), 1u);
    EXPECT_EQ(stores_prologue(c.program, c.kernels[0]), stored);
  }
}

// A norm whose output or rstd is read later (the caller; the backward pass)
// is still a prologue: the first reader's kernel stores both, once, and the
// others recompute the rows for themselves.
TEST(Fusion, ANormReadLaterIsStoredByItsFirstReader) {
  for (const Compiled& c : {plan_graph(norm_then("none", ext)), plan_graph(norm_then("none", Storage::transient, true))}) {
    ASSERT_EQ(c.kernels.size(), 1u);
    EXPECT_EQ(c.kernels[0].prologue.size(), 1u);
    EXPECT_TRUE(stores_prologue(c.program, c.kernels[0]));
    EXPECT_TRUE(internal_names(c, c.kernels[0]).empty());
    for (const auto& pb : c.plan.buffers)
      if (buffer_name(c.program, pb.buffer) == "n.out") EXPECT_FALSE(pb.internal);
  }
  // Training: ln1 in q, k and v (q stores ln1.out and ln1.rstd, which the
  // backward pass reads), ln2 in up, lnf in head; q, k and v in one launch.
  // (Rule attention_projection off: with it, the attention kernel computes
  // them and stores ln1's output: Fusion.AttentionComputesItsProjections.)
  CompileOptions options;
  options.fuse.disabled_rules = {"attention_projection"};
  Compiled train = plan_program(load_program(source_path("examples/train_transformer.json"), {}), options);
  std::map<std::string, std::string> stored_by;
  std::map<std::string, int> hosts;
  for (const auto& k : train.kernels) {
    for (int t : k.tasks) EXPECT_NE(train.program.tasks[size_t(t)].op->name, "rmsnorm") << k.name;
    for (int t : k.prologue) {
      const std::string norm = train.program.tasks[size_t(t)].task->id;
      ++hosts[norm];
      const std::vector<std::string> internal = internal_names(train, k);
      const bool kept = std::find(internal.begin(), internal.end(), norm + ".out") != internal.end() &&
                        std::find(internal.begin(), internal.end(), norm + ".rstd") != internal.end();
      if (stores_prologue(train.program, k)) stored_by[norm] = task_ids(train, k).front();
      EXPECT_NE(kept, stores_prologue(train.program, k)) << k.name;
    }
  }
  EXPECT_EQ(hosts, (std::map<std::string, int>{{"ln1", 3}, {"ln2", 1}, {"lnf", 1}}));
  EXPECT_EQ(stored_by, (std::map<std::string, std::string>{{"ln1", "q"}, {"ln2", "up"}, {"lnf", "head"}}));
  for (const auto& pb : train.plan.buffers) {
    const std::string name = buffer_name(train.program, pb.buffer);
    if (name == "ln1.out" || name == "ln1.rstd") EXPECT_FALSE(pb.internal) << name;
  }
  int launch_of_q = -1;
  for (const auto& k : train.kernels) {
    const std::string first = task_ids(train, k).front();
    if (first == "q") launch_of_q = k.launch;
    if (first == "k" || first == "v") EXPECT_EQ(k.launch, launch_of_q) << first;
  }
}

TEST(Fusion, NoPermutedStoreAfterAChainNorAnythingAfterIt) {
  GraphBuilder b("heads_not");
  auto r = b.task("r", "relu").tensor("x", f32, {8, 16}, ext).tensor("out", f32, {8, 16});
  b.task("h", "split_heads").tensor("x", r["out"]).tensor("out", f32, {4, 8, 4}, ext).arg("heads", int64_t(4));
  auto q = b.task("q", "matmul").tensor("a", f32, {8, 16}, ext).tensor("b", f32, {16, 16}, ext).tensor("out", f32, {8, 16});
  auto qh = b.task("qh", "split_heads").tensor("x", q["out"]).tensor("out", f32, {4, 8, 4}).arg("heads", int64_t(4));
  b.task("after", "neg").tensor("x", qh["out"]).tensor("out", f32, {4, 8, 4}, ext);
  Compiled c = plan_graph(std::move(b).graph());
  EXPECT_EQ(reason_for(c, "h"), "'h' is a gather op; only a matmul's or a row op's kernel stores permuted");
  EXPECT_EQ(reason_for(c, "qh"), "");
  EXPECT_EQ(reason_for(c, "after"), "the kernel before ends with a permuted store: its elements are no longer the task's");
}

TEST(Fusion, PermutedStoreTurnsOff) {
  FuseOptions off;
  off.disabled_rules = {"permuted_store"};
  Compiled c = plan_program(load_program(source_path("examples/transformer_block.json"), {}), [&] {
    CompileOptions o;
    o.fuse = off;
    return o;
  }());
  EXPECT_EQ(reason_for(c, "q_heads"), "rule permuted_store is off (--no-fuse-rule)");
  for (const auto& k : c.kernels)
    if (k.rule == FusionRule::matmul_epilogue) EXPECT_NE(c.program.tasks[size_t(k.tasks.back())].op->pattern, PatternKind::gather);
}

// The reason recorded for the kernel that starts with `task` not joining the
// launch before it ("" when none).
std::string launch_reason_for(const Compiled& c, const std::string& task) {
  for (const auto& n : c.launch_notes)
    if (c.program.tasks[size_t(n.task)].task->id == task) return n.reason;
  return "";
}

// Rule horizontal: two independent matmuls and an elementwise task of
// another size, then a task that reads the matmuls.
TaskGraph independent_matmuls() {
  GraphBuilder b("horizontal");
  auto x = b.task("x", "relu").tensor("x", f32, {16, 32}, ext).tensor("out", f32, {16, 32});
  auto p = b.task("p", "matmul").tensor("a", x["out"]).tensor("b", f32, {32, 64}, ext).tensor("out", f32, {16, 64});
  auto q = b.task("q", "matmul").tensor("a", x["out"]).tensor("b", f32, {32, 64}, ext).tensor("out", f32, {16, 64});
  b.task("r", "exp").tensor("x", f32, {100}, ext).tensor("out", f32, {100}, ext);
  b.task("s", "concat").tensor("a", p["out"]).tensor("b", q["out"]).tensor("out", f32, {16, 128}, ext);
  return std::move(b).graph();
}

// (x's relu would otherwise be both matmuls' prologue: rule elementwise_prologue.)
const FuseOptions kNoElementwisePrologue{true, {"elementwise_prologue"}};

TEST(Horizontal, IndependentKernelsShareALaunch) {
  Compiled c = plan_graph(independent_matmuls(), kNoElementwisePrologue);
  // x | p, q, r (one launch) | s
  ASSERT_EQ(c.kernels.size(), 5u);
  EXPECT_EQ(launch_count(c.kernels), 3);
  EXPECT_EQ(c.kernels[1].launch, c.kernels[2].launch);
  EXPECT_EQ(c.kernels[2].launch, c.kernels[3].launch);
  EXPECT_EQ(launch_reason_for(c, "p"), "it reads 'x.out', which k0_x writes");
  EXPECT_EQ(launch_reason_for(c, "q"), "") << "q reads what p reads, and writes nothing p touches";
  EXPECT_EQ(launch_reason_for(c, "s"), "it reads 'p.out', which k1_p writes");
  // One launch is one step of the plan: what its kernels touch lives at once.
  const PlannedBuffer& p_out = c.plan.buffers[size_t(c.program.tasks[1].find_tensor("out")->buffer)];
  const PlannedBuffer& q_out = c.plan.buffers[size_t(c.program.tasks[2].find_tensor("out")->buffer)];
  EXPECT_EQ(p_out.first, q_out.first);
  EXPECT_TRUE(p_out.offset + p_out.bytes <= q_out.offset || q_out.offset + q_out.bytes <= p_out.offset);
}

TEST(Horizontal, NotWhatOverwritesWhatAnotherReads) {
  GraphBuilder b("war");
  auto w = b.task("w", "fill", Phase::init).tensor("out", f32, {8}, Storage::persistent).arg("value", 1.0);
  auto m = b.task("m", "fill", Phase::init).tensor("out", f32, {8}, Storage::persistent).arg("value", 0.0);
  b.task("read", "relu", Phase::update).tensor("x", w["out"]).tensor("out", f32, {8}, ext);
  b.task("step", "sgd", Phase::update)
      .tensor("param", w["out"])
      .tensor("grad", f32, {8}, ext)
      .tensor("momentum_buf", m["out"])
      .arg("lr", 0.1);
  Compiled c = plan_graph(std::move(b).graph());
  EXPECT_EQ(launch_count(c.kernels), 3) << "init | read | step";
  EXPECT_EQ(launch_reason_for(c, "step"), "it writes 'w.out', which k2_read reads");
}

TEST(Horizontal, TurnsOff) {
  FuseOptions off;
  off.disabled_rules = {"horizontal", "elementwise_prologue"};
  Compiled c = plan_graph(independent_matmuls(), off);
  EXPECT_EQ(launch_count(c.kernels), 5);
  EXPECT_EQ(launch_reason_for(c, "q"), "rule horizontal is off (--no-fuse-rule)");
  Compiled unfused = plan_graph(independent_matmuls(), FuseOptions{false, {}});
  EXPECT_EQ(launch_count(unfused.kernels), int(unfused.kernels.size()));
  EXPECT_TRUE(unfused.launch_notes.empty()) << "--no-fuse: nothing to explain";
}

// Two independent products: the decoder's up projection in bf16 (1024 x
// 3072 over 768) and a small f32 one (64 x 64 over 768: no mainloop of its own).
TaskGraph two_products() {
  GraphBuilder b("two_products");
  constexpr DType bf16 = DType::bf16;
  auto x = b.task("x", "relu").tensor("x", bf16, {1024, 768}, ext).tensor("out", bf16, {1024, 768});
  b.task("up", "matmul").tensor("a", x["out"]).tensor("b", bf16, {768, 3072}, ext).tensor("out", bf16, {1024, 3072}, ext);
  b.task("small", "matmul").tensor("a", f32, {64, 768}, ext).tensor("b", f32, {768, 64}, ext).tensor("out", f32, {64, 64}, ext);
  return std::move(b).graph();
}

Compiled plan_for(TaskGraph g, const std::string& arch, bool megakernel = false, int64_t sms = 0) {
  CompileOptions options;
  options.fuse = kNoElementwisePrologue;
  options.emit.arch = arch;
  options.emit.sms = sms;
  options.emit.megakernel = megakernel;
  options.dump_after = "fuse";
  return plan_program(load_program(std::move(g), {}), options);
}

const KernelGroup& kernel_of(const Compiled& c, const std::string& task) {
  for (const auto& k : c.kernels)
    if (c.program.tasks[size_t(k.tasks.front())].task->id == task) return k;
  throw std::runtime_error("no kernel starts with " + task);
}

// The matmul mainloop is decided once, by the fusion pass, for the target:
// the launches are batched by it, the emitter prints it, the dump shows it.
TEST(Horizontal, AMatmulsMainloopIsDecidedOnceForTheTarget) {
  const Compiled hopper = plan_for(two_products(), "sm_90a");
  const KernelGroup& up = kernel_of(hopper, "up");
  ASSERT_TRUE(up.gemm.hopper.has_value()) << up.gemm.why_not_hopper;
  EXPECT_EQ(up.gemm.name(), "Hopper");
  EXPECT_EQ(up.gemm.hopper->columns, 192) << "one wave of 132 SMs";
  EXPECT_EQ(launch_reason_for(hopper, "small"), "k1_up runs the Hopper matmul mainloop, in a launch of its own");
  EXPECT_NE(hopper.dump.find("  on the Hopper mainloop, 128 x 192 tiles"), std::string::npos) << hopper.dump;

  // On an H100 PCIe's 114 SMs (--sms) 128 tiles of 128 x 192 take two
  // waves, as do 192 of 128 x 128, which leave the busiest SM less.
  const Compiled pcie = plan_for(two_products(), "sm_90a", false, 114);
  ASSERT_TRUE(kernel_of(pcie, "up").gemm.hopper.has_value());
  EXPECT_EQ(kernel_of(pcie, "up").gemm.hopper->columns, 128);
  EXPECT_EQ(kernel_of(pcie, "up").gemm.hopper->consumers, 2);

  // sm_80 has no wgmma: the pipelined mainloop, and why not Hopper.
  const Compiled ampere = plan_for(two_products(), "sm_80");
  const KernelGroup& up80 = kernel_of(ampere, "up");
  EXPECT_FALSE(up80.gemm.hopper.has_value());
  EXPECT_TRUE(up80.gemm.pipelined.has_value()) << up80.gemm.why_not_pipelined;
  EXPECT_EQ(up80.gemm.why_not_hopper, "sm_80 has no wgmma (sm_90a has)");
  EXPECT_EQ(launch_reason_for(ampere, "small"), "k1_up runs the pipelined matmul mainloop, in a launch of its own");

  // A megakernel's tiles share one block size: no mainloop of their own, and the dump says why.
  const Compiled mega = plan_for(two_products(), "sm_90a", true);
  for (const auto& k : mega.kernels) EXPECT_FALSE(k.gemm.launched_alone()) << k.name;
  EXPECT_EQ(kernel_of(mega, "up").gemm.why_not_pipelined, "a megakernel's tiles share one block size");
  EXPECT_NE(mega.dump.find("on no mainloop of its own (the 64 x 64 tile, the portable one or the op's own function): a "
                           "megakernel's tiles share one block size"),
            std::string::npos)
      << mega.dump;
}

// The split-K workspace follows the mainloop the fusion pass chose: a
// decoder's 64-row projection splits K on the pipelined mainloop, and gets
// a workspace; a product small enough for a prologue (a relu fused into its
// loads, under 2^24 FLOPs) runs the element-by-element tile, and gets none.
// The decoder's own projection (7.5e7 FLOPs) keeps the relu's kernel: the
// prologue's tile took 4x its time on an H200 (bench/RESULTS.md, 2026-11-27).
TEST(Horizontal, TheSplitKWorkspaceIsSizedForTheMainloopTaken) {
  auto projection = [](bool prologue, int64_t N) {
    GraphBuilder b("projection");
    constexpr DType bf16 = DType::bf16;
    auto x = b.task("x", "relu").tensor("x", bf16, {64, 768}, ext).tensor("out", bf16, {64, 768});
    auto mm = b.task("mm", "matmul");
    if (prologue) mm.tensor("a", x["out"]);
    else mm.tensor("a", bf16, {64, 768}, ext);
    mm.tensor("b", bf16, {768, N}, ext).tensor("out", bf16, {64, N}, ext);
    return std::move(b).graph();
  };
  CompileOptions options;
  options.emit.arch = "sm_80";
  const Compiled alone = compile(load_program(projection(false, 768), {}), options);
  const KernelGroup& split = kernel_of(alone, "mm");
  ASSERT_TRUE(split.gemm.pipelined.has_value()) << split.gemm.why_not_pipelined;
  ASSERT_GT(split.gemm.pipelined->split_k, 1) << "12 tiles of 64 x 64 split K";
  EXPECT_GE(alone.emitted.arena_bytes - alone.plan.planned_bytes, split.gemm.pipelined->split_k * 64 * 768 * 4);

  const Compiled refused = compile(load_program(projection(true, 768), {}), options);
  EXPECT_TRUE(kernel_of(refused, "mm").prologue.empty());
  EXPECT_TRUE(kernel_of(refused, "mm").gemm.pipelined.has_value());
  EXPECT_NE(reason_for(refused, "mm").find("'x' is not its prologue: 'mm' (75 MFLOP) runs the pipelined matmul mainloop"),
            std::string::npos)
      << reason_for(refused, "mm");

  const Compiled fused = compile(load_program(projection(true, 128), {}), options);
  const KernelGroup& mm = kernel_of(fused, "mm");
  ASSERT_EQ(mm.prologue.size(), 1u) << "relu computed on the matmul's loads (rule elementwise_prologue)";
  EXPECT_FALSE(mm.gemm.launched_alone());
  EXPECT_EQ(mm.gemm.why_not_pipelined, "a prologue computes its operand");
  EXPECT_EQ(fused.emitted.sync_bytes, 0);
  EXPECT_EQ(fused.emitted.arena_bytes, fused.plan.planned_bytes) << "no split-K workspace for a kernel that does not split K";
}

TEST(Fusion, NotAnInPlaceUpdate) {
  Compiled c = plan_program(load_program(source_path("examples/train_mlp.json"), {}), {});
  for (const auto& k : c.kernels)
    if (k.phase == Phase::update) EXPECT_EQ(k.tasks.size(), 1u) << k.name;
  EXPECT_NE(reason_for(c, "b1_adam").find("updates slot"), std::string::npos) << reason_for(c, "b1_adam");
}

TEST(Fusion, EachEpilogueRuleTurnsOff) {
  Compiled c = plan_program(load_program(source_path("examples/mlp_forward.json"), {}),
                            [] {
                              CompileOptions o;
                              o.fuse.disabled_rules = {"matmul_epilogue"};
                              return o;
                            }());
  // bias1 and act1, no epilogue of fc1, are fc2's prologue instead; bias2 the softmax's.
  ASSERT_EQ(c.kernels.size(), 3u);
  EXPECT_EQ(task_ids(c, c.kernels[2]), std::vector<std::string>{"probs"});
  EXPECT_EQ(c.kernels[2].prologue_operand, "x");
  EXPECT_EQ(task_ids(c, c.kernels[1]), std::vector<std::string>{"fc2"});
  EXPECT_EQ(c.kernels[1].prologue.size(), 2u);
  EXPECT_EQ(kernel_rules(c.program, c.kernels[1]), std::vector<std::string>{"elementwise_prologue"});
  EXPECT_EQ(reason_for(c, "bias1"), "rule matmul_epilogue is off (--no-fuse-rule)");
  EXPECT_EQ(reason_for(c, "bias2"), "rule matmul_epilogue is off (--no-fuse-rule)");
}

TEST(Fusion, ARuleOrAllOfFusionTurnsOff) {
  Compiled rule_off = plan_graph(long_chain(), FuseOptions{true, {"elementwise_chain"}});
  EXPECT_EQ(rule_off.kernels.size(), 7u);
  EXPECT_EQ(reason_for(rule_off, "t2"), "rule elementwise_chain is off (--no-fuse-rule)");
  Compiled off = plan_graph(long_chain(), FuseOptions{false, {}});
  EXPECT_EQ(off.kernels.size(), 7u);
  EXPECT_TRUE(off.fusion_notes.empty());
  for (const auto& k : off.kernels) EXPECT_TRUE(k.internal_buffers.empty());
}

TEST(Fusion, AValueReadInALaterKernelIsStored) {
  GraphBuilder b("later");
  auto a = b.task("a", "relu").tensor("x", f32, {2, 8}, ext).tensor("out", f32, {2, 8});
  auto n = b.task("n", "neg").tensor("x", a["out"]).tensor("out", f32, {2, 8});
  auto m = b.task("m", "sigmoid").tensor("x", n["out"]).tensor("out", f32, {2, 8});
  b.task("s", "sum").tensor("x", m["out"]).tensor("out", f32, {2}, ext);
  b.task("late", "relu").tensor("x", a["out"]).tensor("out", f32, {2, 8}, ext);  // scheduled after s
  Compiled c = plan_graph(std::move(b).graph());
  // `late` reads a.out only, so it joins a's kernel, ahead of the sum: a.out stays in registers.
  ASSERT_EQ(task_ids(c, c.kernels[0]), (std::vector<std::string>{"a", "n", "m", "late"}));
  EXPECT_EQ(internal_names(c, c.kernels[0]), (std::vector<std::string>{"a.out", "n.out"}));
}

// A task joins the kernel that computes what it reads even when other kernels
// ran in between (here a matmul's gradients): never past a kernel that writes
// what it reads in place.
TEST(Fusion, ATaskJoinsItsProducersKernelPastIndependentOnes) {
  Compiled c = plan_program(load_program(source_path("examples/train_mlp.json"), {}), {});
  bool joined = false;
  for (const auto& k : c.kernels) {
    const std::vector<std::string> ids = task_ids(c, k);
    joined = joined || (ids.size() >= 2 && ids[0] == "fc2_grad_a" && ids[1] == "act1_backward");
  }
  EXPECT_TRUE(joined);
  GraphBuilder b("in_place_between");
  auto w = b.task("w", "fill", Phase::init).tensor("out", f32, {8}, Storage::persistent).arg("value", 1.0);
  auto g = b.task("g", "relu", Phase::update).tensor("x", f32, {8}, ext).tensor("out", f32, {8});
  b.task("step", "sgd", Phase::update).tensor("param", w["out"]).tensor("grad", g["out"]).arg("lr", 0.1);
  b.task("after", "add", Phase::update).tensor("a", g["out"]).tensor("b", w["out"]).tensor("out", f32, {8}, ext);
  Compiled u = plan_graph(std::move(b).graph());
  ASSERT_EQ(u.kernels.size(), 4u) << "after reads w, which step updates: it stays after step";
  EXPECT_EQ(task_ids(u, u.kernels.back()), (std::vector<std::string>{"after"}));
}

TEST(Fusion, AValueStoredForALaterKernelIsStoredOnce) {
  GraphBuilder b("later_sum");
  auto a = b.task("a", "relu").tensor("x", f32, {2, 8}, ext).tensor("out", f32, {2, 8});
  auto n = b.task("n", "neg").tensor("x", a["out"]).tensor("out", f32, {2, 8});
  auto m = b.task("m", "sigmoid").tensor("x", n["out"]).tensor("out", f32, {2, 8});
  b.task("s", "sum").tensor("x", m["out"]).tensor("out", f32, {2}, ext);
  b.task("late", "max").tensor("x", a["out"]).tensor("out", f32, {2}, ext);
  Compiled c = plan_graph(std::move(b).graph());
  ASSERT_EQ(task_ids(c, c.kernels[0]), (std::vector<std::string>{"a", "n", "m"}));
  // n.out is read only in the kernel; m.out by the sum, a.out by `late`: both stored.
  EXPECT_EQ(internal_names(c, c.kernels[0]), (std::vector<std::string>{"n.out"}));
  EXPECT_FALSE(c.plan.buffers[size_t(c.kernels[0].tasks[0])].internal);
}

// Rule elementwise_prologue: relu then a broadcast scale, read only by a
// matmul as its `a`: no kernel of their own, computed in the matmul's loads.
// `act_storage`, `both`, `dtype` make the cases the rule refuses.
TaskGraph chain_then_matmul(Storage act_storage = Storage::transient, bool both = false, DType dtype = f32) {
  GraphBuilder b("chain_then_matmul");
  auto act = b.task("act", "relu").tensor("x", dtype, {8, 16}, ext).tensor("out", dtype, {8, 16}, act_storage);
  auto scaled = b.task("scaled", "mul").tensor("a", act["out"]).tensor("b", dtype, {16}, ext).tensor("out", dtype, {8, 16});
  auto mm = b.task("mm", "matmul").tensor("a", scaled["out"]);
  if (both)
    mm.tensor("b", scaled["out"]).tensor("out", dtype, {8, 8}, ext).arg("trans_b", true);
  else
    mm.tensor("b", dtype, {16, 4}, ext).tensor("out", dtype, {8, 4}, ext);
  return std::move(b).graph();
}

TEST(Fusion, AnElementwiseChainIsAMatmulsPrologue) {
  Compiled c = plan_graph(chain_then_matmul());
  ASSERT_EQ(c.kernels.size(), 1u);
  EXPECT_EQ(task_ids(c, c.kernels[0]), std::vector<std::string>{"mm"});
  EXPECT_EQ(c.kernels[0].prologue.size(), 2u);
  EXPECT_EQ(c.kernels[0].prologue_operand, "a");
  EXPECT_EQ(kernel_rules(c.program, c.kernels[0]), std::vector<std::string>{"elementwise_prologue"});
  EXPECT_FALSE(stores_prologue(c.program, c.kernels[0]));
  EXPECT_EQ(internal_names(c, c.kernels[0]), (std::vector<std::string>{"act.out", "scaled.out"}));
  EXPECT_EQ(reason_for(c, "mm"), "") << "the note that mm did not join the chain is moot";
}

TEST(Fusion, NotAPrologueWhereTheChainsValueIsNeededOrTheRuleIsOff) {
  const std::string refused = "'mm' is a matmul op; 'scaled' is not its prologue: ";
  // act.out read by the caller: the chain stores it, so its kernel stays (scaled
  // joins it, and mm reads what the kernel stores).
  Compiled read_later = plan_graph(chain_then_matmul(ext));
  EXPECT_EQ(read_later.kernels.size(), 2u);
  EXPECT_TRUE(read_later.kernels[1].prologue.empty());
  // One matmul reading it as both operands.
  Compiled both = plan_graph(chain_then_matmul(Storage::transient, true));
  EXPECT_EQ(both.kernels.size(), 2u);
  EXPECT_EQ(reason_for(both, "mm"), refused + "'mm' reads it as both operands");
  // f64: the matmul's loads compute in f32.
  Compiled f64 = plan_graph(chain_then_matmul(Storage::transient, false, DType::f64));
  EXPECT_EQ(reason_for(f64, "mm"), refused + "'scaled.out' is f64; matmul operand loads compute f32, f16 and bf16 values");
  Compiled off = plan_graph(chain_then_matmul(), FuseOptions{true, {"elementwise_prologue"}});
  EXPECT_EQ(off.kernels.size(), 2u);
  EXPECT_EQ(reason_for(off, "mm"), refused + "rule elementwise_prologue is off (--no-fuse-rule)");
  // A norm folded into its matmuls takes no prologue of its own: prologues do not nest.
  {
    GraphBuilder b("relu_norm_matmul");
    auto x = b.task("x", "relu").tensor("x", f32, {8, 16}, ext).tensor("out", f32, {8, 16});
    auto n = b.task("n", "rmsnorm").tensor("x", x["out"]).tensor("weight", f32, {16}, ext).tensor("out", f32, {8, 16});
    b.task("mm", "matmul").tensor("a", n["out"]).tensor("b", f32, {16, 4}, ext).tensor("out", f32, {8, 4}, ext);
    Compiled nested = plan_graph(std::move(b).graph());
    ASSERT_EQ(nested.kernels.size(), 2u);
    EXPECT_EQ(kernel_rules(nested.program, nested.kernels[1]), std::vector<std::string>{"norm_prologue"});
    EXPECT_NE(reason_for(nested, "n").find("'x' is not its prologue: 'n' is itself the prologue of its readers' kernels"),
              std::string::npos)
        << reason_for(nested, "n");
  }
  // An attention kernel's scores matmul loads q as the attention row does, not through a prologue.
  GraphBuilder b("relu_then_attention");
  auto q = b.task("q", "relu").tensor("x", f32, {2, 8, 4}, ext).tensor("out", f32, {2, 8, 4});
  auto s = b.task("scores", "matmul")
               .tensor("a", q["out"])
               .tensor("b", f32, {2, 8, 4}, ext)
               .tensor("out", f32, {2, 8, 8})
               .arg("trans_b", true);
  auto p = b.task("probs", "softmax").tensor("x", s["out"]).tensor("out", f32, {2, 8, 8});
  b.task("context", "matmul").tensor("a", p["out"]).tensor("b", f32, {2, 8, 4}, ext).tensor("out", f32, {2, 8, 4}, ext);
  Compiled attention = plan_graph(std::move(b).graph());
  ASSERT_EQ(attention.kernels.size(), 2u);
  EXPECT_EQ(attention.kernels[1].rule, FusionRule::attention);
  EXPECT_EQ(reason_for(attention, "scores"),
            "'scores' is a matmul op; 'q' is not its prologue: 'scores' starts an attention kernel, whose warps load "
            "their rows themselves");
}
