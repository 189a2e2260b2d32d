#include <algorithm>
#include <map>
#include <set>

#include <gtest/gtest.h>

#include "diagnostics.h"
#include "describe.h"
#include "file_util.h"
#include "registry.h"

using namespace cudagen;

namespace {
std::string registry_errors(const std::string& ops) {
  try {
    OpRegistry::from_json(R"({"format": "cudagen.registry/1", "ops": [)" + ops + "]}", "reg.json");
    return "";
  } catch (const CompileError& e) {
    return e.diagnostics().format();
  }
}
const char* kRelu = R"({"name": "relu", "pattern": "elementwise", "types": {"T": ["f32"]},
  "tensors": [{"name": "x", "role": "input", "dtype": "T"}, {"name": "out", "role": "output", "dtype": "T"}],
  "shape": "x:[...S] -> out:[...S]"})";
}  // namespace

TEST(Registry, BuiltinLoadsWithTheOpsTheExamplesNeed) {
  OpRegistry reg = builtin_registry();
  for (const char* name : {"matmul", "add", "relu", "relu_backward", "rmsnorm", "softmax", "embedding", "cross_entropy",
                           "cross_entropy_backward", "sum_leading", "sgd", "adam", "adamw", "fill", "uniform", "normal",
                           "split_heads", "merge_heads", "gelu", "reshape"})
    EXPECT_NE(reg.find(name), nullptr) << name;
  const OpSignature* mm = reg.find("matmul");
  EXPECT_EQ(mm->pattern, PatternKind::matmul);
  EXPECT_EQ(mm->find_tensor("out")->role, SlotRole::output);
  EXPECT_EQ(std::get<bool>(*mm->find_arg("trans_a")->default_value), false);
  EXPECT_TRUE(reg.find("sgd")->find_tensor("param")->writes);
  EXPECT_EQ(reg.find("relu")->backward, std::vector<std::string>{"relu_backward"});
  EXPECT_EQ(reg.find("relu_backward")->forward, "relu");
  // Several ops, each some of the gradients.
  EXPECT_EQ(reg.find("conv2d_nhwc")->backward,
            (std::vector<std::string>{"conv2d_nhwc_backward_data", "conv2d_nhwc_backward_weight"}));
}

TEST(Registry, AcceptsAWellFormedOp) { EXPECT_EQ(registry_errors(kRelu), ""); }

TEST(Registry, RejectsDuplicatesAndBrokenLinks) {
  std::string msg = registry_errors(std::string(kRelu) + "," + kRelu);
  EXPECT_NE(msg.find("duplicate op 'relu'"), std::string::npos) << msg;
  std::string with_link = kRelu;
  with_link.insert(with_link.size() - 1, R"(, "backward": "relu_grad")");
  msg = registry_errors(with_link);
  EXPECT_NE(msg.find("op 'relu': backward op 'relu_grad' is not in the registry"), std::string::npos) << msg;
  std::string with_init = kRelu;
  with_init.insert(with_init.size() - 1, R"(, "init": "relu_state")");
  msg = registry_errors(with_init);
  EXPECT_NE(msg.find("op 'relu': init op 'relu_state' is not in the registry"), std::string::npos) << msg;
}

TEST(Registry, RejectsRulesThatDoNotMatchTheSlots) {
  std::string bad = kRelu;
  bad.replace(bad.find("x:[...S] -> out:[...S]"), 22, "x:[...S] -> y:[...S]");
  std::string msg = registry_errors(bad);
  EXPECT_NE(msg.find("the shape rule names slot 'y', which the op does not have"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the shape rule says nothing of slot 'out'"), std::string::npos) << msg;
  bad = kRelu;
  bad.replace(bad.find("\"T\"}, {\"name\": \"out\""), 3, "\"U\"");
  msg = registry_errors(bad);
  EXPECT_NE(msg.find("\"U\" is neither a dtype nor a type variable of the op"), std::string::npos) << msg;
}

// The fusion facts (epilogue, prologue, rows, inverse, norm) name slots of
// the op in the roles they need, and ops that exist; the bundled templates
// declare them where the compiler once knew them by op name.
TEST(Registry, FusionFactsNameTheOpsSlotsInTheirRoles) {
  auto with = [](const std::string& facts) {
    std::string op = kRelu;
    op.insert(op.size() - 1, ", " + facts);
    return registry_errors(op);
  };
  EXPECT_EQ(with(R"("epilogue": "out", "prologue": ["x"], "rows": "x")"), "");
  std::string msg = with(R"("epilogue": "x")");
  EXPECT_NE(msg.find("\"epilogue\" names slot 'x', an input; it takes an output slot"), std::string::npos) << msg;
  msg = with(R"("prologue": ["out"])");
  EXPECT_NE(msg.find("\"prologue\" names slot 'out', an output; it takes a slot the op only reads"), std::string::npos) << msg;
  msg = with(R"("rows": "y")");
  EXPECT_NE(msg.find("\"rows\" names slot 'y', which the op does not have"), std::string::npos) << msg;
  msg = with(R"("norm": "batch")");
  EXPECT_NE(msg.find("\"norm\" is \"rms\" or \"layer\", not \"batch\""), std::string::npos) << msg;
  msg = with(R"("inverse": "unrelu")");
  EXPECT_NE(msg.find("op 'relu': inverse op 'unrelu' is not in the registry"), std::string::npos) << msg;

  const OpRegistry reg = builtin_registry();
  EXPECT_EQ(reg.find("matmul")->epilogue, "out");
  EXPECT_EQ(reg.find("matmul")->prologue, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(reg.find("softmax_backward")->epilogue, "dx");
  EXPECT_EQ(reg.find("softmax_backward")->rows, "out");
  EXPECT_EQ(reg.find("layernorm")->norm, "layer");
  EXPECT_EQ(reg.find("split_heads")->inverse, "merge_heads");
  EXPECT_EQ(reg.find("merge_heads")->inverse, "split_heads");
  EXPECT_TRUE(reg.find("relu")->epilogue.empty());
}

TEST(Registry, AFlopsFormulaNamesOnlyTheRulesDimensionsArgumentsAndSlots) {
  auto with_flops = [](const std::string& formula) {
    std::string op = kRelu;
    op.insert(op.size() - 1, R"(, "flops": ")" + formula + "\"");
    return registry_errors(op);
  };
  EXPECT_EQ(with_flops("3 * numel(out)"), "");
  EXPECT_EQ(with_flops("S + 1"), "");  // a run of dimensions: their product
  std::string msg = with_flops("2 * (numel(out)");
  EXPECT_NE(msg.find("reg.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("/flops"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected ')'"), std::string::npos) << msg;
  msg = with_flops("numel(y)");
  EXPECT_NE(msg.find("numel(y): the op has no slot 'y'"), std::string::npos) << msg;
  msg = with_flops("K * numel(out)");
  EXPECT_NE(msg.find("'K' is neither a dimension of the shape rule"), std::string::npos) << msg;
}

TEST(Registry, DocsOpsIsGeneratedFromTheRegistry) {
  std::string doc = read_text_file(std::string(CUDAGEN_SOURCE_DIR) + "/docs/ops.md");
  EXPECT_EQ(doc, ops_markdown(builtin_registry())) << "regenerate it: cudagen ops --markdown > docs/ops.md";
  EXPECT_NE(doc.find("| matmul | matmul | T: f32, f16, bf16, f64 | matmul.cuh `cg_matmul_tile` | yes | - |"),
            std::string::npos);
  EXPECT_NE(doc.find("| layernorm | reduction | T: f32, f16, bf16, f64 | layernorm.cuh `cg_layernorm_row` | yes |"),
            std::string::npos);
  EXPECT_NE(doc.find("| mse | reduction | T: f32, f16, bf16, f64 | losses.cuh `cg_squared_error` | yes |"),
            std::string::npos);
}

// The registry the indexer makes from templates/ against the first, hand-written
// version (tests/registry/first_version.json): every signature carries over, and
// the only differences are the ones listed here, each made on purpose.
TEST(Registry, IndexedTemplatesReproduceTheHandWrittenRegistry) {
  OpRegistry first = OpRegistry::from_json(
      read_text_file(std::string(CUDAGEN_SOURCE_DIR) + "/tests/registry/first_version.json"), "first_version.json");
  OpRegistry indexed = builtin_registry();
  // Ops that had no template in the first version and have one now.
  const std::set<std::string> newly_templated = {
      "adam", "adamw", "cast", "cross_entropy", "cross_entropy_backward", "embedding_backward", "gelu_backward",
      "layernorm", "mse", "mse_backward", "reshape", "rmsnorm_backward", "sgd", "softmax_backward"};
  // Docs that changed with the op's template: the caller now folds the mean into `scale`.
  const std::set<std::string> doc_changed = {"cross_entropy_backward", "embedding_backward", "mse_backward"};
  // Ops added since the first version: the indexed registry holds the first's and these.
  const std::set<std::string> added = {
      "affine_backward", "cast_backward",   "concat",       "exp_backward",  "layernorm_backward",
      "log_backward",    "log_softmax_backward", "max_backward", "maximum_backward", "mean_backward",
      "neg_backward",    "split",           "sum_backward", "sum_leading_backward",
      // The PyTorch frontend's (#11): convolutional networks and MobileNet's activations.
      "conv2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "permute", "relu6", "relu6_backward",
      "hardswish", "hardswish_backward",
      // Hand-written norms in real models (#43): x.pow(2), torch.rsqrt, torch.sqrt.
      "pow", "pow_backward", "rsqrt", "rsqrt_backward", "sqrt", "sqrt_backward",
      // MobileNetV3's gate (#43).
      "hardsigmoid", "hardsigmoid_backward",
      // Slicing and select (#43).
      "slice", "slice_backward",
      // Convolutional networks train (#40, #43).
      "conv2d_backward", "max_pool2d_backward", "avg_pool2d_backward", "adaptive_avg_pool2d_backward",
      "batchnorm2d", "batchnorm2d_backward", "batchnorm2d_nhwc", "batchnorm2d_nhwc_backward",
      // Convolution on tensor cores (#40): channels-last, an implicit GEMM on the pipelined mainloop.
      "conv2d_nhwc", "max_pool2d_nhwc", "avg_pool2d_nhwc", "adaptive_avg_pool2d_nhwc",
      // ...and its gradients, an implicit GEMM each (#40).
      "conv2d_nhwc_backward_data", "conv2d_nhwc_backward_weight",
      // ...and the channels-last pools' (#40).
      "max_pool2d_nhwc_backward", "avg_pool2d_nhwc_backward",
      "adaptive_avg_pool2d_nhwc_backward",
      // Gradient clipping by global norm and accumulation over micro-batches (#41).
      "gradient_scale", "accumulate",
      // Dynamic loss scaling (#41).
      "loss_scale_update",
      // Dropout in training mode, comparisons as masks (#43).
      "dropout_mask", "eq", "ne"};
  // Ops that have gained optional inputs last since, and with each a
  // shape-rule term (#41): the optimizers' grad_scale (gradient_scale's
  // factor), and Adam's step_count (the device's count of steps taken).
  const std::map<std::string, size_t> input_added = {{"sgd", 1}, {"adam", 2}, {"adamw", 2}};
  // Ops whose backward came with its template (maximum's gradient is the
  // compiler's rule: one maximum_backward per operand).
  const std::set<std::string> backward_added = {"affine", "cast", "exp",  "layernorm",  "log",
                                                "log_softmax", "max", "mean", "neg", "sum", "sum_leading"};
  // Ops whose template now plans shared memory: sum_leading's column sums
  // split the rows across a block's warps.
  const std::set<std::string> smem_changed = {"sum_leading"};
  std::vector<std::string> expected = first.names();
  expected.insert(expected.end(), added.begin(), added.end());
  std::sort(expected.begin(), expected.end());
  ASSERT_EQ(indexed.names(), expected);
  for (const auto& name : added) EXPECT_FALSE(indexed.find(name)->closure.empty()) << name;
  for (const auto& a : first.ops()) {
    SCOPED_TRACE("op " + a.name);
    const OpSignature& b = *indexed.find(a.name);
    EXPECT_EQ(to_string(b.pattern), std::string(to_string(a.pattern)));
    EXPECT_EQ(b.type_vars, a.type_vars);
    if (input_added.count(a.name)) {
      ASSERT_EQ(b.tensors.size(), a.tensors.size() + input_added.at(a.name));
      for (size_t i = a.tensors.size(); i < b.tensors.size(); ++i) {
        EXPECT_TRUE(b.tensors[i].optional) << b.tensors[i].name;
        EXPECT_EQ(b.tensors[i].role, SlotRole::input) << b.tensors[i].name;
      }
    } else {
      ASSERT_EQ(b.tensors.size(), a.tensors.size());
    }
    for (size_t i = 0; i < a.tensors.size(); ++i) {
      EXPECT_EQ(b.tensors[i].name, a.tensors[i].name);
      EXPECT_EQ(b.tensors[i].role, a.tensors[i].role);
      EXPECT_EQ(b.tensors[i].dtype, a.tensors[i].dtype);
      EXPECT_EQ(b.tensors[i].optional, a.tensors[i].optional);
      EXPECT_EQ(b.tensors[i].writes, a.tensors[i].writes);
    }
    ASSERT_EQ(b.args.size(), a.args.size());
    for (size_t i = 0; i < a.args.size(); ++i) {
      EXPECT_EQ(b.args[i].name, a.args[i].name);
      EXPECT_EQ(b.args[i].type, a.args[i].type);
      EXPECT_EQ(b.args[i].default_value, a.args[i].default_value);
      EXPECT_EQ(b.args[i].choices, a.args[i].choices);
    }
    if (!input_added.count(a.name)) EXPECT_EQ(b.shape.text, a.shape.text);
    EXPECT_EQ(b.may_alias, a.may_alias);
    if (!backward_added.count(a.name)) EXPECT_EQ(b.backward, a.backward);
    EXPECT_EQ(b.forward, a.forward);
    EXPECT_EQ(b.init, a.init);
    if (!doc_changed.count(a.name)) EXPECT_EQ(b.doc, a.doc);
    if (newly_templated.count(a.name)) {
      EXPECT_TRUE(a.source_file.empty());
    } else {
      EXPECT_EQ(b.source_file, a.source_file);
      EXPECT_EQ(b.source_function, a.source_function);
      if (!smem_changed.count(a.name)) EXPECT_EQ(b.smem, a.smem);
    }
    // Every op of the indexed registry has its template and its closure.
    EXPECT_FALSE(b.source_file.empty());
    ASSERT_FALSE(b.closure.empty());
    EXPECT_EQ(b.closure.back(), b.source_function) << "the op's own function comes last, after what it uses";
  }
}
