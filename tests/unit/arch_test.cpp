// Target architectures (generator/arch.h): the names cudagen accepts, the
// target it picks for each compute capability, and the errors that name the
// fix. The runtime's side (a fake device of each compute capability) is in
// tests/runtime/gpu_path_test.cpp.
#include <gtest/gtest.h>

#include "arch.h"
#include "builder.h"
#include "diagnostics.h"
#include "pipeline.h"

using namespace cudagen;

TEST(Arch, ParsesEveryTargetNameAndItsFamily) {
  struct Case {
    const char* name;
    int major, minor;
    bool specific, wgmma;
  };
  for (const Case& c : {Case{"sm_75", 7, 5, false, false}, Case{"sm_80", 8, 0, false, false},
                        Case{"sm_89", 8, 9, false, false}, Case{"sm_90", 9, 0, false, false},
                        Case{"sm_90a", 9, 0, true, true}, Case{"sm_100", 10, 0, false, false},
                        Case{"sm_100a", 10, 0, true, false}, Case{"sm_120", 12, 0, false, false}}) {
    const std::optional<Arch> a = parse_arch(c.name);
    ASSERT_TRUE(a) << c.name;
    EXPECT_EQ(a->major, c.major) << c.name;
    EXPECT_EQ(a->minor, c.minor) << c.name;
    EXPECT_EQ(a->specific, c.specific) << c.name;
    EXPECT_EQ(a->has_wgmma(), c.wgmma) << c.name << ": wgmma is sm_90a's alone";
    EXPECT_EQ(a->name(), c.name);
    EXPECT_EQ(a->family(), std::string(c.name).substr(0, std::string(c.name).size() - (c.specific ? 1 : 0)));
  }
}

TEST(Arch, RefusesWhatIsNoArchitectureAndSaysHowToWriteOne) {
  for (const char* bad : {"sm90", "compute_90", "sm_9", "sm_90b", "sm_", "", "SM_90", "sm_1000", "90a", "sm_80a", "sm_075"}) {
    std::string why;
    EXPECT_FALSE(parse_arch(bad, &why)) << bad;
    EXPECT_NE(why.find("sm_"), std::string::npos) << bad << ": " << why;
  }
  std::string why;
  EXPECT_FALSE(parse_arch("sm_70", &why));
  EXPECT_NE(why.find("sm_75 and later"), std::string::npos) << why;
  try {
    arch_or_throw("sm90", "--arch");
    FAIL() << "sm90 parsed";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--arch: 'sm90' is not an architecture"), std::string::npos) << e.what();
  }
}

// Hopper's wgmma path needs the architecture-specific target, which runs on
// compute capability 9.0 alone: every other device gets its plain sm_XY.
TEST(Arch, EachComputeCapabilityGetsItsOwnTarget) {
  EXPECT_EQ(arch_for_device(7, 5).name(), "sm_75");
  EXPECT_EQ(arch_for_device(8, 0).name(), "sm_80");
  EXPECT_EQ(arch_for_device(8, 6).name(), "sm_86");
  EXPECT_EQ(arch_for_device(8, 9).name(), "sm_89");
  EXPECT_EQ(arch_for_device(9, 0).name(), "sm_90a");
  EXPECT_TRUE(arch_for_device(9, 0).has_wgmma());
  EXPECT_EQ(arch_for_device(10, 0).name(), "sm_100");
  EXPECT_FALSE(arch_for_device(10, 0).has_wgmma()) << "Blackwell has no wgmma: the sm_80 path";
  EXPECT_EQ(arch_for_device(12, 0).name(), "sm_120");
}

// A compile for a name that is no architecture stops before any pass with
// the reason; sm_90a takes the Hopper mainloop where sm_90 (no wgmma) takes
// the pipelined one, with sm_90's tuning.
TEST(Arch, CompileRefusesABadArchitectureAndTakesSm90a) {
  GraphBuilder b("arch");
  auto mm = b.task("mm", "matmul")
                .tensor("a", DType::bf16, {4096, 768}, Storage::external)
                .tensor("b", DType::bf16, {768, 768}, Storage::external)
                .tensor("out", DType::bf16, {4096, 768}, Storage::external);
  TaskGraph graph = std::move(b).graph();
  CompileOptions options;
  options.emit.arch = "sm90";
  try {
    compile(load_program(graph, {}), options);
    FAIL() << "compiled for sm90";
  } catch (const CompileError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("the target architecture (--arch): 'sm90' is not an architecture"), std::string::npos) << what;
    EXPECT_NE(what.find("sm_90a (H100, H200)"), std::string::npos) << what;
  }
  options.emit.arch = "sm_90";
  const Compiled sm90 = compile(load_program(graph, {}), options);
  options.emit.arch = "sm_90a";
  const Compiled sm90a = compile(load_program(graph, {}), options);
  ASSERT_EQ(sm90.emitted.kernels.size(), 1u);
  ASSERT_EQ(sm90a.emitted.kernels.size(), 1u);
  EXPECT_NE(sm90.emitted.kernels[0].matmul_path.find("the pipelined mainloop"), std::string::npos)
      << sm90.emitted.kernels[0].matmul_path;
  EXPECT_NE(sm90a.emitted.kernels[0].matmul_path.find("the Hopper mainloop"), std::string::npos)
      << sm90a.emitted.kernels[0].matmul_path;
}

// TMA reads a tensor from a 16-byte boundary: with buffers 8 bytes apart
// (--alignment 8) a matmul whose operand lands off one stays off the Hopper
// mainloop and says why; every tensor map a kernel takes starts on one.
TEST(Arch, TensorMapsStartOnSixteenBytes) {
  // Outputs of 4 x 9 bf16 (72 bytes) put what follows them 8 bytes off.
  GraphBuilder b("aligned");
  for (int i = 0; i < 3; ++i)
    b.task("mm" + std::to_string(i), "matmul")
        .tensor("a", DType::bf16, {4, 8}, Storage::external)
        .tensor("b", DType::bf16, {9, 8}, Storage::external)
        .tensor("out", DType::bf16, {4, 9}, Storage::external)
        .arg("trans_b", true);
  CompileOptions options;
  options.emit.arch = "sm_90a";
  options.plan.placement.alignment = 8;
  const Compiled c = compile(load_program(std::move(b).graph(), {}), options);
  int refused = 0, hopper = 0;
  for (const EmittedKernel& k : c.emitted.kernels) {
    for (const auto& [arg, map] : k.tensor_maps) EXPECT_EQ(map.tensor_offset % 16, 0) << k.name;
    hopper += !k.tensor_maps.empty();
    refused += k.matmul_path.find("arena offset is no multiple of 16 bytes") != std::string::npos;
  }
  EXPECT_GT(refused, 0) << "no operand landed off a 16-byte boundary: the test needs another layout";
  EXPECT_EQ(hopper + refused, 3);
}

// Flash attention copies q, k and v 16 bytes at a time (cp.async; TMA on
// sm_90a): where --alignment puts one off a 16-byte boundary, compiling
// says so and names the option, on every target, rather than emitting a
// kernel that faults.
TEST(Arch, FlashAttentionOperandsOffSixteenBytesAreRefused) {
  GraphBuilder b("misaligned_attention");
  b.task("odd", "fill", Phase::init).tensor("out", DType::f32, {3}, Storage::persistent).arg("value", 1.0);
  auto s = b.task("scores", "matmul")
               .tensor("a", DType::bf16, {1, 2, 65, 64}, Storage::external)
               .tensor("b", DType::bf16, {1, 2, 65, 64}, Storage::external)
               .tensor("out", DType::bf16, {1, 2, 65, 65})
               .arg("trans_b", true);
  auto p = b.task("probs", "softmax").tensor("x", s["out"]).tensor("out", DType::bf16, {1, 2, 65, 65});
  b.task("context", "matmul")
      .tensor("a", p["out"])
      .tensor("b", DType::bf16, {1, 2, 65, 64}, Storage::external)
      .tensor("out", DType::bf16, {1, 2, 65, 64}, Storage::external);
  const TaskGraph g = std::move(b).graph();
  for (const char* arch : {"sm_90a", "sm_80"}) {
    CompileOptions options;
    options.emit.arch = arch;
    options.plan.placement.alignment = 4;
    std::string error;
    try {
      compile(load_program(g, {}), options);
    } catch (const std::exception& e) {
      error = e.what();
    }
    EXPECT_NE(error.find("no multiple of 16"), std::string::npos) << arch << ": " << error;
    EXPECT_NE(error.find("--alignment is 4 here"), std::string::npos) << arch << ": " << error;
    options.plan.placement.alignment = 16;
    EXPECT_NO_THROW(compile(load_program(g, {}), options)) << arch;
  }
}
