// The kernel IR (generator/kir.h): what the fusion pass hands on, as a
// mainloop with stages, their operand trees and their epilogues.
#include <set>

#include <gtest/gtest.h>

#include "builder.h"
#include "pipeline.h"
#include "test_util.h"

using namespace cudagen;
using cudagen::testing::source_path;

namespace {

Compiled planned(const std::string& example) {
  return plan_program(load_program(source_path("examples/" + example), {}), CompileOptions{});
}

const KernelGroup* kernel_with(const Compiled& c, kir::Mainloop mainloop) {
  for (const auto& k : c.kernels)
    if (k.ir.mainloop == mainloop) return &k;
  return nullptr;
}

std::vector<std::string> roles(const kir::Kernel& ir) {
  std::vector<std::string> out;
  for (const auto& s : ir.stages) out.push_back(s.role);
  return out;
}

std::string task_id(const Compiled& c, int t) { return c.program.tasks[size_t(t)].task->id; }

}  // namespace

// The transformer block's attention kernel computes its projections: three
// stages whose `a` is the norm computed as it is loaded (one node, read three
// times), whose heads go to shared memory where the scores read them; the
// context's heads are merged into memory.
TEST(KernelIr, AnAttentionKernelIsItsProjectionsScoresSoftmaxAndContext) {
  const Compiled c = planned("transformer_block.json");
  const KernelGroup* k = kernel_with(c, kir::Mainloop::attention);
  ASSERT_NE(k, nullptr);
  const kir::Kernel& ir = k->ir;
  EXPECT_EQ(roles(ir), (std::vector<std::string>{"projection", "projection", "projection", "scores", "softmax", "context"}));
  const kir::Node& norm = ir.nodes[size_t(ir.stages[0].operands[0].node)];
  EXPECT_EQ(norm.kind, kir::Node::Kind::norm);
  EXPECT_EQ(task_id(c, norm.task), "ln1");
  for (size_t s = 1; s < 3; ++s) EXPECT_EQ(ir.stages[s].operands[0].node, ir.stages[0].operands[0].node) << s;
  for (size_t s = 0; s < 3; ++s) {
    ASSERT_EQ(ir.stages[s].epilogue.size(), 1u);
    const kir::Node& heads = ir.nodes[size_t(ir.stages[s].epilogue[0])];
    EXPECT_EQ(heads.kind, kir::Node::Kind::store_permuted);
    EXPECT_TRUE(heads.in_kernel);
    EXPECT_FALSE(heads.to_memory);  // nothing outside the kernel reads the heads
    EXPECT_EQ(ir.stages[s].chain, ir.stages[s].epilogue);  // the split alone
  }
  // The scores read q's and k's heads where the projections put them.
  EXPECT_EQ(ir.stages[3].operands[0].node, ir.stages[0].epilogue[0]);
  EXPECT_EQ(ir.stages[3].operands[1].node, ir.stages[1].epilogue[0]);
  const kir::Node& merged = ir.nodes[size_t(ir.stages[5].epilogue.back())];
  EXPECT_EQ(merged.kind, kir::Node::Kind::store_permuted);
  EXPECT_FALSE(merged.in_kernel);
  EXPECT_TRUE(merged.to_memory);
}

TEST(KernelIr, AnAttentionBackwardKernelNamesEachGradient) {
  const Compiled c = planned("train_transformer.json");
  const KernelGroup* k = kernel_with(c, kir::Mainloop::attention_backward);
  ASSERT_NE(k, nullptr);
  const std::vector<std::string> r = roles(k->ir);
  for (const char* gradient : {"dp", "ds", "dq", "dk", "dv"})
    EXPECT_EQ(std::count(r.begin(), r.end(), gradient), 1) << gradient;
  // ds reads dp where it was computed, not from memory.
  const auto ds = std::find(r.begin(), r.end(), "ds") - r.begin();
  const auto dp = std::find(r.begin(), r.end(), "dp") - r.begin();
  const kir::Stage& stage = k->ir.stages[size_t(ds)];
  const auto dout = std::find_if(stage.operands.begin(), stage.operands.end(), [](const kir::Operand& o) { return o.slot == "dout"; });
  ASSERT_NE(dout, stage.operands.end());
  EXPECT_EQ(dout->node, k->ir.stages[size_t(dp)].results.front());
}

// Every task of every kernel of the examples is in its IR exactly once: a
// stage, or a node of an operand tree or an epilogue; every store is of a
// buffer read outside the kernel.
TEST(KernelIr, EveryTaskOfEveryExampleKernelIsInItsIrOnce) {
  for (const char* example : {"mlp_forward.json", "mlp_train.json", "mlp_derived.json", "train_mlp.json",
                              "transformer_block.json", "train_transformer.json"}) {
    const Compiled c = planned(example);
    for (const auto& k : c.kernels) {
      SCOPED_TRACE(std::string(example) + " " + k.name);
      std::multiset<int> seen;
      for (const auto& s : k.ir.stages)
        if (s.task >= 0) seen.insert(s.task);
      for (const auto& n : k.ir.nodes) {
        if (n.kind == kir::Node::Kind::op || n.kind == kir::Node::Kind::norm ||
            n.kind == kir::Node::Kind::store_permuted)
          seen.insert(n.task);
        if (n.kind == kir::Node::Kind::store) EXPECT_FALSE(contains(k.internal_buffers, n.buffer)) << n.buffer;
      }
      std::vector<int> expected = kernel_tasks(k);
      std::sort(expected.begin(), expected.end());
      EXPECT_EQ(std::vector<int>(seen.begin(), seen.end()), expected);
    }
  }
}

// A value two tasks of an elementwise chain read is one node, printed once and
// named by its buffer where read again.
TEST(KernelIr, AValueReadTwiceIsOneNodePrintedOnce) {
  GraphBuilder b("residual");
  auto t1 = b.task("t1", "add")
                .tensor("a", DType::f32, {64, 48}, Storage::external)
                .tensor("b", DType::f32, {48}, Storage::external)
                .tensor("out", DType::f32, {64, 48});
  auto t2 = b.task("t2", "gelu").tensor("x", t1["out"]).tensor("out", DType::f32, {64, 48});
  b.task("t3", "sub").tensor("a", t2["out"]).tensor("b", t1["out"]).tensor("out", DType::f32, {64, 48}, Storage::external);
  const Compiled c = plan_program(load_program(std::move(b).graph(), {}), CompileOptions{});
  ASSERT_EQ(c.kernels.size(), 1u);
  const kir::Kernel& ir = c.kernels[0].ir;
  EXPECT_EQ(ir.mainloop, kir::Mainloop::elements);
  ASSERT_EQ(ir.stages.size(), 1u);
  ASSERT_EQ(ir.stages[0].epilogue.size(), 1u);  // t3's output; t1's and t2's stay in registers
  const kir::Node& sub = ir.nodes[size_t(ir.nodes[size_t(ir.stages[0].epilogue[0])].inputs[0])];
  const kir::Node& gelu = ir.nodes[size_t(sub.inputs[0])];
  EXPECT_EQ(gelu.inputs[0], sub.inputs[1]);  // t1's value, once
  EXPECT_EQ(kir::print(c.program, ir), "  elements\n    store t3.out <- t3:sub(t2:gelu(t1:add(load t1.a, load t1.b)), t1.out)\n");
}

// Rule matmul_sum: the adds of the terms are stages of the mainloop (its one
// accumulator sums them), not epilogue ops; the last add's result is the sum,
// whose stage holds the epilogue's chain (none here: the sum is stored).
TEST(KernelIr, ASumOfMatmulsIsItsTermsAndTheAddsThatSumThem) {
  const Compiled c = planned("train_transformer.json");
  const KernelGroup* k = kernel_with(c, kir::Mainloop::gemm_sum);
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(roles(k->ir), (std::vector<std::string>{"term", "term", "sum", "term", "sum"}));
  for (const kir::Stage& s : k->ir.stages) EXPECT_TRUE(s.chain.empty()) << s.role;
  const int sum = k->ir.stages.back().results.front();
  EXPECT_EQ(kir::stage_of_result(k->ir, k->ir.nodes[size_t(sum)].buffer), 4);
  EXPECT_EQ(task_id(c, kir::role_task(k->ir, "sum")), "grad_ln1_out_sum");  // the first of its role
  EXPECT_NE(kir::print(c.program, k->ir).find("sum grad_ln1_out_sum_2 (add)"), std::string::npos);
}

// A stage's chain is what its epilogue computes, in task order: the ops (a
// value a later stage reads in the kernel included) and the permuted stores;
// an elementwise prologue's ops are the tree under the operand it computes.
TEST(KernelIr, AStagesChainIsItsEpiloguesOpsInOrder) {
  GraphBuilder b("chain");
  auto pre = b.task("pre", "relu").tensor("x", DType::f32, {64, 32}, Storage::external).tensor("out", DType::f32, {64, 32});
  auto mm = b.task("mm", "matmul")
                .tensor("a", pre["out"])
                .tensor("b", DType::f32, {32, 48}, Storage::external)
                .tensor("out", DType::f32, {64, 48});
  auto bias = b.task("bias", "add")
                  .tensor("a", mm["out"])
                  .tensor("b", DType::f32, {48}, Storage::external)
                  .tensor("out", DType::f32, {64, 48});
  b.task("act", "gelu").tensor("x", bias["out"]).tensor("out", DType::f32, {64, 48}, Storage::external);
  const Compiled c = plan_program(load_program(std::move(b).graph(), {}), CompileOptions{});
  ASSERT_EQ(c.kernels.size(), 1u);
  const kir::Kernel& ir = c.kernels[0].ir;
  ASSERT_EQ(ir.stages.size(), 1u);
  const kir::Stage& s = ir.stages[0];
  ASSERT_EQ(s.chain.size(), 2u);
  EXPECT_EQ(task_id(c, ir.nodes[size_t(s.chain[0])].task), "bias");
  EXPECT_EQ(task_id(c, ir.nodes[size_t(s.chain[1])].task), "act");
  EXPECT_EQ(ir.nodes[size_t(s.chain[0])].inputs.front(), s.results.front());  // the product, in registers
  // The prologue: relu under `a`.
  const std::vector<int> prologue = kir::tree_ops(ir, s.operands.front().node);
  ASSERT_EQ(prologue.size(), 1u);
  EXPECT_EQ(task_id(c, ir.nodes[size_t(prologue[0])].task), "pre");
}
