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
  EXPECT_EQ(reg.find("relu")->backward, "relu_backward");
  EXPECT_EQ(reg.find("relu_backward")->forward, "relu");
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

TEST(Registry, DocsOpsIsGeneratedFromTheRegistry) {
  std::string doc = read_text_file(std::string(CUDAGEN_SOURCE_DIR) + "/docs/ops.md");
  EXPECT_EQ(doc, ops_markdown(builtin_registry())) << "regenerate it: cudagen ops --markdown > docs/ops.md";
  EXPECT_NE(doc.find("| matmul | matmul | T: f32, f16, bf16, f64 | matmul.cuh | - |"), std::string::npos);
}
