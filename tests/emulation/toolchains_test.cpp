// One generated file, three compilers: NVRTC in-process (sm_80, sm_90),
// nvcc -c ahead of time, and the host compiler (the emulation tests). No GPU.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "builder.h"
#include "cost.h"
#include "file_util.h"
#include "graph_json.h"
#include "nvrtc.h"
#include "ptxas_report.h"
#include "pipeline.h"
#include "templates_embedded.h"

using namespace cudagen;

namespace {
std::string example(const char* name) { return std::string(CUDAGEN_SOURCE_DIR) + "/examples/" + name; }
}  // namespace

TEST(Toolchains, NvrtcCompilesTheMlpForSm80AndSm90) {
  CompileOptions unfused;  // relu on its own: the vectorised loop (fused with the broadcast add, it is scalar)
  unfused.fuse.enabled = false;
  Compiled c = compile(load_program(example("mlp_forward.json"), {}), unfused);
  for (const char* arch : {"sm_80", "sm_90"}) {
    NvrtcOutput out = nvrtc_compile(c.emitted.cuda_source, "mlp_forward.cu", arch);
    EXPECT_GT(out.binary.size(), 1000u) << arch;
    EXPECT_EQ(std::string(out.binary.data(), 4), "\x7f" "ELF") << "a CUBIN is an ELF file";
  }
  NvrtcOutput ptx = nvrtc_compile(c.emitted.cuda_source, "mlp_forward.cu", "sm_90", /*ptx=*/true);
  std::string text(ptx.binary.begin(), ptx.binary.end());
  EXPECT_NE(text.find(".entry k0_fc1"), std::string::npos) << "extern \"C\" kernels keep their names";
  EXPECT_NE(text.find(".v4.f32"), std::string::npos) << "the vectorised relu moves 16 bytes per access";
}

// 16-bit tensors: the prelude's PTX conversions (cvt.f32.f16, cvt.rn.f16.f32)
// assemble for both architectures, and nvcc builds the host side too.
TEST(Toolchains, SixteenBitKernelsCompileWithNvrtcAndNvcc) {
  GraphBuilder b("sixteen");
  for (DType d : {DType::f16, DType::bf16}) {
    const std::string t = to_string(d);
    b.task("gelu_" + t, "gelu").tensor("x", d, {100}, Storage::external).tensor("out", d, {100}, Storage::external);
    b.task("to_f32_" + t, "cast").tensor("x", d, {100}, Storage::external).tensor("out", DType::f32, {100}, Storage::external);
    b.task("softmax_" + t, "softmax").tensor("x", d, {4, 100}, Storage::external).tensor("out", d, {4, 100}, Storage::external);
    b.task("matmul_" + t, "matmul")
        .tensor("a", d, {64, 32}, Storage::external)
        .tensor("b", d, {32, 48}, Storage::external)
        .tensor("out", d, {64, 48}, Storage::external);
  }
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  for (const char* arch : {"sm_80", "sm_90"}) {
    NvrtcOutput out = nvrtc_compile(c.emitted.cuda_source, "sixteen.cu", arch);
    EXPECT_EQ(std::string(out.binary.data(), 4), "\x7f" "ELF") << arch;
  }
  NvrtcOutput ptx = nvrtc_compile(c.emitted.cuda_source, "sixteen.cu", "sm_90", /*ptx=*/true);
  std::string text(ptx.binary.begin(), ptx.binary.end());
  EXPECT_NE(text.find("cvt.rn.f16.f32"), std::string::npos) << "f16 narrows with the hardware conversion";
  EXPECT_NE(text.find("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"), std::string::npos) << "f16 tensor cores";
  EXPECT_NE(text.find("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"), std::string::npos) << "bf16 tensor cores";
  for (const auto& [name, r] : cudagen::testing::ptxas_resources(c.emitted.cuda_source, "sm_90")) {
    EXPECT_EQ(r.spill_bytes, 0) << name << " spills";
    if (name.find("matmul") != std::string::npos)
      std::printf("  ptxas sm_90: %-24s %3d registers, no spills\n", name.c_str(), r.registers);
  }
  std::string dir = (std::filesystem::temp_directory_path() / ("cudagen_nvcc16_" + std::to_string(::getpid()))).string();
  std::filesystem::create_directories(dir);
  write_file_atomic(dir + "/sixteen.cu", c.emitted.cuda_source);
  std::string cmd = std::string(CUDAGEN_NVCC) + " -c -arch=sm_90 " + dir + "/sixteen.cu -o " + dir + "/sixteen.o > " +
                    dir + "/log.txt 2>&1";
  int status = std::system(cmd.c_str());
  EXPECT_EQ(status, 0) << read_text_file(dir + "/log.txt");
  std::filesystem::remove_all(dir);
}

// Rule matmul_chain: an MLP with a layernorm prologue, bias and GELU between
// and a residual after, in f32 (the portable tile) and f16 and bf16 (tensor
// cores, the hidden rows kept 16-bit): assembled for both architectures by
// NVRTC, and by ptxas without spills.
TEST(Toolchains, MatmulChainsCompileWithNvrtcWithoutSpills) {
  GraphBuilder b("chains");
  const Storage ext = Storage::external;
  for (DType d : {DType::f32, DType::f16, DType::bf16}) {
    const std::string t = to_string(d);
    auto n = b.task("n_" + t, "layernorm")
                 .tensor("x", d, {4, 24, 64}, ext)
                 .tensor("weight", d, {64}, ext)
                 .tensor("bias", d, {64}, ext)
                 .tensor("out", d, {4, 24, 64});
    auto up = b.task("up_" + t, "matmul").tensor("a", n["out"]).tensor("b", d, {64, 192}, ext).tensor("out", d, {4, 24, 192});
    auto bias = b.task("bias_" + t, "add").tensor("a", up["out"]).tensor("b", d, {192}, ext).tensor("out", d, {4, 24, 192});
    auto act = b.task("act_" + t, "gelu").tensor("x", bias["out"]).tensor("out", d, {4, 24, 192});
    auto down = b.task("down_" + t, "matmul").tensor("a", act["out"]).tensor("b", d, {192, 64}, ext).tensor("out", d, {4, 24, 64});
    b.task("res_" + t, "add").tensor("a", down["out"]).tensor("b", d, {4, 24, 64}, ext).tensor("out", d, {4, 24, 64}, ext);
  }
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  ASSERT_EQ(c.kernels.size(), 3u);
  // The 16-bit chains share a launch (rule horizontal), which asks for registers before occupancy too.
  EXPECT_NE(c.emitted.cuda_source.find("CG_KERNEL void __launch_bounds__(128, 1) h"), std::string::npos);
  for (const auto& k : c.kernels) EXPECT_EQ(k.rule, FusionRule::matmul_chain) << k.name;
  for (const char* arch : {"sm_80", "sm_90"}) {
    NvrtcOutput out = nvrtc_compile(c.emitted.cuda_source, "chains.cu", arch);
    EXPECT_EQ(std::string(out.binary.data(), 4), "\x7f" "ELF") << arch;
  }
  for (const auto& [name, r] : cudagen::testing::ptxas_resources(c.emitted.cuda_source, "sm_90")) {
    EXPECT_EQ(r.spill_bytes, 0) << name << " spills";
    std::printf("  ptxas sm_90: %-24s %3d registers, %d bytes spilled\n", name.c_str(), r.registers, r.spill_bytes);
  }
}

// Rule attention_projection: an attention kernel that computes its q, k and
// v (layernorm of its input, a bias after each projection, 16-bit heads
// rounded as stored) assembles for both architectures without spills.
TEST(Toolchains, ProjectedAttentionCompilesWithNvrtcWithoutSpills) {
  GraphBuilder b("projected_attention");
  const Storage ext = Storage::external;
  const int64_t B = 2, T = 16, H = 4, D = 16, C = H * D;
  for (DType d : {DType::f32, DType::f16, DType::bf16}) {
    const std::string t = to_string(d);
    auto ln = b.task("ln_" + t, "layernorm")
                  .tensor("x", d, {B, T, C}, ext)
                  .tensor("weight", d, {C}, ext)
                  .tensor("bias", d, {C}, ext)
                  .tensor("out", d, {B, T, C});
    std::vector<TaskBuilder> heads;
    for (const std::string p : {"q_", "k_", "v_"}) {
      auto mm = b.task(p + t, "matmul").tensor("a", ln["out"]).tensor("b", d, {C, C}, ext).tensor("out", d, {B, T, C});
      auto bias = b.task(p + "bias_" + t, "add").tensor("a", mm["out"]).tensor("b", d, {C}, ext).tensor("out", d, {B, T, C});
      heads.push_back(b.task(p + "heads_" + t, "split_heads").tensor("x", bias["out"]).tensor("out", d, {B, H, T, D}).arg("heads", H));
    }
    auto s = b.task("scores_" + t, "matmul")
                 .tensor("a", heads[0]["out"])
                 .tensor("b", heads[1]["out"])
                 .tensor("out", d, {B, H, T, T})
                 .arg("trans_b", true);
    auto pr = b.task("probs_" + t, "softmax").tensor("x", s["out"]).tensor("out", d, {B, H, T, T}).arg("causal", true);
    auto c = b.task("context_" + t, "matmul").tensor("a", pr["out"]).tensor("b", heads[2]["out"]).tensor("out", d, {B, H, T, D});
    b.task("merged_" + t, "merge_heads").tensor("x", c["out"]).tensor("out", d, {B, T, C}, ext).arg("heads", H);
  }
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  ASSERT_EQ(c.kernels.size(), 3u);
  for (const auto& k : c.kernels) EXPECT_EQ(kernel_rules(c.program, k)[1], "attention_projection") << k.name;
  for (const char* arch : {"sm_80", "sm_90"}) {
    NvrtcOutput out = nvrtc_compile(c.emitted.cuda_source, "projected_attention.cu", arch);
    EXPECT_EQ(std::string(out.binary.data(), 4), "\x7f" "ELF") << arch;
  }
  for (const auto& [name, r] : cudagen::testing::ptxas_resources(c.emitted.cuda_source, "sm_90")) {
    EXPECT_EQ(r.spill_bytes, 0) << name << " spills";
    std::printf("  ptxas sm_90: %-24s %3d registers, %d bytes spilled\n", name.c_str(), r.registers, r.spill_bytes);
  }
}

namespace {
// Every kernel of `c`, assembled for sm_90, without a stack frame or spills:
// its accumulators in registers.
void expect_accumulators_in_registers(const Compiled& c) {
  for (const auto& [name, r] : cudagen::testing::ptxas_resources(c.emitted.cuda_source, "sm_90")) {
    EXPECT_EQ(r.spill_bytes, 0) << name << " spills";
    EXPECT_EQ(r.stack_bytes, 0) << name << " keeps its accumulators in local memory";
    std::printf("  ptxas sm_90: %-24s %3d registers, %d bytes spilled, %d bytes of stack\n", name.c_str(), r.registers,
                r.spill_bytes, r.stack_bytes);
  }
}
}  // namespace

// Rule row_reduction at its bound: each thread accumulates 16 outputs of
// the reductions (a sum and a weight gradient of 120 rows on the f32 tile; of
// 30 on the tensor-core tile), which must stay in registers: no stack frame,
// no spills.
TEST(Toolchains, RowReductionKeepsItsAccumulatorsInRegisters) {
  GraphBuilder b("row_reduction");
  const Storage ext = Storage::external;
  for (DType d : {DType::f32, DType::bf16}) {
    const std::string t = to_string(d);
    const int64_t inputs = d == DType::f32 ? 120 : 30;
    auto dh = b.task("dh_" + t, "matmul").tensor("a", d, {200, 24}, ext).tensor("b", d, {24, 96}, ext).tensor("out", d, {200, 96});
    auto dx = b.task("dx_" + t, "gelu_backward").tensor("x", d, {200, 96}, ext).tensor("dout", dh["out"]).tensor("dx", d, {200, 96});
    b.task("db_" + t, "sum_leading").tensor("x", dx["dx"]).tensor("out", d, {96}, ext);
    b.task("dw_" + t, "matmul").tensor("a", d, {200, inputs}, ext).tensor("b", dx["dx"]).tensor("out", d, {inputs, 96}, ext).arg("trans_a", true);
  }
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  ASSERT_EQ(c.kernels.size(), 2u);
  for (const auto& k : c.kernels) EXPECT_EQ(k.rule, FusionRule::row_reduction) << k.name;
  expect_accumulators_in_registers(c);
}

// Rule attention_backward at its bounds: a head of 64 keys of 64, whose key
// and value gradients each thread holds 32 elements of (16 each), and 40
// KiB of shared memory. The accumulators must stay in registers.
TEST(Toolchains, AttentionGradientKeepsItsAccumulatorsInRegisters) {
  GraphBuilder b("attention_gradient");
  const Storage ext = Storage::external;
  for (DType d : {DType::f32, DType::bf16}) {
    const std::string t = to_string(d);
    const int64_t B = 1, H = 2, T = 64, D = 64;
    auto dp = b.task("dp_" + t, "matmul").tensor("a", d, {B, H, T, D}, ext).tensor("b", d, {B, H, T, D}, ext)
                  .tensor("out", d, {B, H, T, T}).arg("trans_b", true);
    auto ds = b.task("ds_" + t, "softmax_backward").tensor("out", d, {B, H, T, T}, ext).tensor("dout", dp["out"])
                  .tensor("dx", d, {B, H, T, T}).arg("scale", 0.125);
    b.task("dv_" + t, "matmul").tensor("a", ds["out"]).tensor("b", dp["a"]).tensor("out", d, {B, H, T, D}, ext).arg("trans_a", true);
    b.task("dq_" + t, "matmul").tensor("a", ds["dx"]).tensor("b", d, {B, H, T, D}, ext).tensor("out", d, {B, H, T, D}, ext);
    b.task("dk_" + t, "matmul").tensor("a", ds["dx"]).tensor("b", d, {B, H, T, D}, ext).tensor("out", d, {B, H, T, D}, ext).arg("trans_a", true);
  }
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  ASSERT_EQ(c.kernels.size(), 2u);
  for (const auto& k : c.kernels) EXPECT_EQ(k.rule, FusionRule::attention_backward) << k.name;
  expect_accumulators_in_registers(c);
}

// Rule elementwise_prologue's loads (a chain computed in a matmul's operand
// loads, on the tensor-core tile, for either operand; in a softmax's and a
// layernorm's row loads) assemble for both architectures without spills.
TEST(Toolchains, ElementwiseProloguesCompileWithNvrtcWithoutSpills) {
  GraphBuilder b("prologues");
  const Storage ext = Storage::external;
  for (DType d : {DType::f16, DType::bf16, DType::f32}) {
    const std::string t = to_string(d);
    // A prologue on f16's b, on the others' a.
    if (d == DType::f16) {
      auto gate = b.task("gate_" + t, "sigmoid").tensor("x", d, {32, 48}, ext).tensor("out", d, {32, 48});
      b.task("mm_" + t, "matmul").tensor("a", d, {64, 32}, ext).tensor("b", gate["out"]).tensor("out", d, {64, 48}, ext);
    } else {
      auto act = b.task("act_" + t, "gelu").tensor("x", d, {64, 32}, ext).tensor("out", d, {64, 32});
      b.task("mm_" + t, "matmul").tensor("a", act["out"]).tensor("b", d, {32, 48}, ext).tensor("out", d, {64, 48}, ext);
    }
    auto shifted = b.task("shifted_" + t, "add").tensor("a", d, {4, 100}, ext).tensor("b", d, {100}, ext).tensor("out", d, {4, 100});
    b.task("softmax_" + t, "softmax").tensor("x", shifted["out"]).tensor("out", d, {4, 100}, ext);
    auto scaled = b.task("scaled_" + t, "mul").tensor("a", d, {4, 100}, ext).tensor("b", d, {100}, ext).tensor("out", d, {4, 100});
    b.task("ln_" + t, "layernorm")
        .tensor("x", scaled["out"])
        .tensor("weight", d, {100}, ext)
        .tensor("bias", d, {100}, ext)
        .tensor("out", d, {4, 100}, ext);
  }
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  size_t prologues = 0;
  for (size_t at = c.emitted.cuda_source.find("auto cg_prologue"); at != std::string::npos;
       at = c.emitted.cuda_source.find("auto cg_prologue", at + 1))
    ++prologues;
  EXPECT_EQ(prologues, 9u) << "each matmul's operand, each softmax's and layernorm's x";
  EXPECT_NE(c.emitted.cuda_source.find("cg_prologue(b_base + "), std::string::npos);
  for (const char* arch : {"sm_80", "sm_90"}) {
    NvrtcOutput out = nvrtc_compile(c.emitted.cuda_source, "prologues.cu", arch);
    EXPECT_EQ(std::string(out.binary.data(), 4), "\x7f" "ELF") << arch;
  }
  for (const auto& [name, r] : cudagen::testing::ptxas_resources(c.emitted.cuda_source, "sm_90"))
    EXPECT_EQ(r.spill_bytes, 0) << name << " spills";
}

TEST(Toolchains, NvrtcLogNamesTheLine) {
  try {
    nvrtc_compile("extern \"C\" __global__ void k() { undefined_thing(); }\n", "bad.cu", "sm_90");
    FAIL();
  } catch (const NvrtcError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.cu(1)"), std::string::npos) << e.what();
  }
}

// An error in a generated file is mapped back to the kernel and its tasks.
TEST(Toolchains, NvrtcLogNamesTheKernelAndTasksOfAnError) {
  Compiled c = compile(load_program(example("mlp_forward.json"), {}), {});
  std::string source = c.emitted.cuda_source;
  const size_t kernel = source.find("k1_probs(");
  ASSERT_NE(kernel, std::string::npos);
  source.insert(source.find("{\n", kernel) + 2, "  undefined_thing();\n");
  try {
    nvrtc_compile(source, "mlp.cu", "sm_90");
    FAIL();
  } catch (const NvrtcError& e) {
    EXPECT_NE(std::string(e.what()).find("... in Kernel k1_probs (forward phase): task probs (softmax, reduction)"), std::string::npos)
        << e.what();
  }
}

TEST(Toolchains, NvccCompilesTheMlpAheadOfTime) {
  const char* nvcc = CUDAGEN_NVCC;
  ASSERT_TRUE(std::filesystem::exists(nvcc)) << "nvcc not found at " << nvcc;
  Compiled c = compile(load_program(example("mlp_forward.json"), {}), {});
  std::string dir = (std::filesystem::temp_directory_path() / ("cudagen_nvcc_" + std::to_string(::getpid()))).string();
  std::filesystem::create_directories(dir);
  write_file_atomic(dir + "/mlp.cu", c.emitted.cuda_source);
  std::string cmd = std::string(nvcc) + " -c -arch=sm_90 -Werror all-warnings " + dir + "/mlp.cu -o " + dir +
                    "/mlp.o > " + dir + "/log 2>&1";
  int status = std::system(cmd.c_str());
  EXPECT_EQ(WEXITSTATUS(status), 0) << read_text_file(dir + "/log");
  EXPECT_TRUE(std::filesystem::exists(dir + "/mlp.o"));
  std::filesystem::remove_all(dir);
}

// A Hopper matmul's file built ahead of time for sm_90a: its host launcher
// (the tensor maps' encoder through cudaGetDriverEntryPointByVersion, the
// persistent grid from cudaDeviceGetAttribute) is nvcc's host code, which
// neither NVRTC nor the emulation compiles.
TEST(Toolchains, NvccCompilesAHopperMatmulAheadOfTime) {
  const char* nvcc = CUDAGEN_NVCC;
  ASSERT_TRUE(std::filesystem::exists(nvcc)) << "nvcc not found at " << nvcc;
  GraphBuilder b("hopper_aot");
  b.task("mm", "matmul")
      .tensor("a", DType::bf16, {300, 192}, Storage::external)
      .tensor("b", DType::bf16, {192, 264}, Storage::external)
      .tensor("out", DType::bf16, {300, 264}, Storage::external);
  CompileOptions options;
  options.emit.arch = "sm_90a";
  Compiled c = compile(load_program(std::move(b).graph(), {}), options);
  ASSERT_EQ(c.emitted.kernels.size(), 1u);
  ASSERT_GT(c.emitted.kernels[0].persistent_tiles, 0) << c.emitted.kernels[0].matmul_path;
  ASSERT_NE(c.emitted.cuda_source.find("cudagen_persistent_grid(&"), std::string::npos);
  std::string dir = (std::filesystem::temp_directory_path() / ("cudagen_nvcc_hopper_" + std::to_string(::getpid()))).string();
  std::filesystem::create_directories(dir);
  write_file_atomic(dir + "/mm.cu", c.emitted.cuda_source);
  std::string cmd = std::string(nvcc) + " -c -gencode=arch=compute_90a,code=sm_90a -Werror all-warnings " + dir +
                    "/mm.cu -o " + dir + "/mm.o > " + dir + "/log 2>&1";
  int status = std::system(cmd.c_str());
  EXPECT_EQ(WEXITSTATUS(status), 0) << read_text_file(dir + "/log");
  EXPECT_TRUE(std::filesystem::exists(dir + "/mm.o"));
  std::filesystem::remove_all(dir);
}

TEST(Toolchains, GeneratedCodeIsDeterministicAndStandalone) {
  Compiled a = compile(load_program(example("mlp_forward.json"), {}), {});
  Compiled b = compile(load_program(example("mlp_forward.json"), {}), {});
  EXPECT_EQ(a.emitted.cuda_source, b.emitted.cuda_source);
  EXPECT_EQ(a.emitted.manifest_json, b.emitted.manifest_json);
  EXPECT_EQ(a.emitted.cuda_source.find("#include"), std::string::npos);
  EXPECT_EQ(a.emitted.host_header, b.emitted.host_header);
  // Each kernel is declared CG_KERNEL: C linkage under NVRTC, internal to the file elsewhere.
  for (const std::string kernel : {"k0_fc1", "k1_probs"}) {
    const size_t at = a.emitted.cuda_source.find(") " + kernel + "(");
    ASSERT_NE(at, std::string::npos) << kernel;
    const size_t line = a.emitted.cuda_source.rfind('\n', at) + 1;
    EXPECT_EQ(a.emitted.cuda_source.compare(line, 33, "CG_KERNEL void __launch_bounds__("), 0) << kernel;
  }
  EXPECT_NE(a.emitted.cuda_source.find("// Kernel k0_fc1 (forward phase): tasks fc1 (matmul), bias1 (add), act1 (relu), fc2 (matmul), bias2 (add), "
                                             "fused (matmul_chain)"),
            std::string::npos);
  EXPECT_NE(a.emitted.manifest_json.find("\"arena_bytes\": " + std::to_string(a.plan.arena_bytes)), std::string::npos);
}

// Every snapshot is a complete translation unit for nvcc (AOT), warnings as
// errors. (NVRTC compiles each one too, for sm_80 and sm_90, in
// EveryGeneratedKernelKeepsToRegistersAndItsPlannedSharedMemory below.)
TEST(Toolchains, EverySnapshotCompilesWithNvcc) {
  std::string dir = (std::filesystem::temp_directory_path() / ("cudagen_snap_" + std::to_string(::getpid()))).string();
  std::filesystem::create_directories(dir);
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(CUDAGEN_SOURCE_DIR) + "/tests/snapshots")) {
    if (entry.path().extension() != ".cu") continue;
    ++count;
    std::string object = dir + "/" + entry.path().stem().string() + ".o";
    std::string cmd = std::string(CUDAGEN_NVCC) + " -c -arch=sm_90 -Werror all-warnings " + entry.path().string() +
                      " -o " + object + " > " + dir + "/log 2>&1";
    EXPECT_EQ(WEXITSTATUS(std::system(cmd.c_str())), 0) << entry.path() << "\n" << read_text_file(dir + "/log");
  }
  EXPECT_GE(count, 2);
  std::filesystem::remove_all(dir);
}

// Every generated kernel, per kernel (issue #35): the snapshots (every op's
// template, the examples, training steps, a megakernel) and a GPT-2-small
// decoder block, its forward in bf16 and its training step in f32 with
// --allow-tf32 (bf16 training is issue #41's),
// through ptxas for sm_80 and sm_90: no spills, no stack frame, and no
// shared memory but the dynamic memory its plan gives it (the launcher
// passes EmittedKernel::smem_bytes).
TEST(Toolchains, EveryGeneratedKernelKeepsToRegistersAndItsPlannedSharedMemory) {
  std::vector<std::pair<std::string, std::string>> sources;  // name, .cu
  for (const auto& entry : std::filesystem::directory_iterator(std::string(CUDAGEN_SOURCE_DIR) + "/tests/snapshots"))
    if (entry.path().extension() == ".cu") sources.emplace_back(entry.path().filename().string(), read_text_file(entry.path().string()));
  const std::string dir = (std::filesystem::temp_directory_path() / fmt::format("cudagen_every_{}", getpid())).string();
  std::filesystem::create_directories(dir);
  for (const char* dtype : {"bf16", "f32"}) {
    const std::string graph = fmt::format("{}/decoder_{}.json", dir, dtype);
    const std::string command = fmt::format(
        "/usr/bin/python3 {}/bench/decoder_graph.py --layers 1 --batch 2 --tokens 64 --dtype {} {} -o {}",
        CUDAGEN_SOURCE_DIR, dtype, std::string(dtype) == "f32" ? "--train" : "", graph);
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    CompileOptions options;
    options.emit.allow_tf32 = std::string(dtype) == "f32";
    sources.emplace_back(graph, compile(load_program(read_graph(read_text_file(graph)), {}), options).emitted.cuda_source);
  }
  std::filesystem::remove_all(dir);
  int kernels = 0;
  for (const auto& [name, source] : sources)
    for (const char* arch : {"sm_80", "sm_90"})
      for (const auto& [kernel, r] : cudagen::testing::ptxas_resources(source, arch)) {
        ++kernels;
        EXPECT_EQ(r.spill_bytes, 0) << kernel << " of " << name << " on " << arch;
        EXPECT_EQ(r.stack_bytes, 0) << kernel << " of " << name << " on " << arch;
        EXPECT_EQ(r.static_shared_bytes, 0) << kernel << " of " << name << " on " << arch;
      }
  EXPECT_GE(kernels, 150) << "the snapshots and the decoder blocks, each for two architectures";
}

// The pipelined mainloop (templates/gemm.cuh) in every tile shape the
// tuning uses, each operand layout, bf16 and TF32 (the same tiles at half the
// k): NVRTC and ptxas for sm_80 and sm_90 keep the accumulators and
// fragments in registers (no spills, no stack frame).
TEST(Toolchains, GemmMainloopKeepsEverythingInRegisters) {
  std::string source = std::string(embedded_template("prelude.cuh")) + std::string(embedded_template("gemm.cuh"));
  struct Config {
    const char* type;
    const char* tile;
  };
  const Config configs[] = {{"cg_bf16", "64, 64, 32, 2, 2, 4"},  {"cg_bf16", "128, 128, 64, 2, 2, 3"},
                            {"cg_bf16", "128, 256, 64, 2, 4, 3"}, {"cg_bf16", "256, 128, 64, 4, 2, 3"},
                            {"cg_tf32", "64, 64, 16, 2, 2, 4"},   {"cg_tf32", "128, 128, 32, 2, 4, 3"}};
  int kernels = 0;
  for (const Config& config : configs)
    for (int layout = 0; layout < 4; ++layout) {
      const std::string name = "gemm_" + std::to_string(kernels++), type = config.type;
      source += "typedef cg_gemm_config<" + std::string(config.tile) + "> " + name + "_config;\n" +
                "CG_KERNEL void __launch_bounds__(" + name + "_config::THREADS, 1) " + name + "(const " + type +
                "* a, const " + type + "* b, " + (type == "cg_tf32" ? "float" : "unsigned int") +
                "* d, cg_i64 M, cg_i64 N, cg_i64 K) {\n"
                "  CG_DYNAMIC_SMEM(smem);\n"
                "  cg_gemm_accumulators<" + name + "_config> acc;\n"
                "  cg_gemm_mainloop<" + name + "_config, " + type + ", " + (layout & 1 ? "true" : "false") + ", " +
                (layout & 2 ? "true" : "false") + ">(acc, a, K, b, N, M, N, 0, K, blockIdx.y, blockIdx.x, (" + type +
                "*)smem);\n"
                "  cg_gemm_each_pair<" + name + "_config>(acc, M, N, blockIdx.y, blockIdx.x,"
                " [&](cg_i64 m, cg_i64 n, float d0, float d1) {\n" +
                (type == "cg_tf32" ? "    cg_aligned_chunk<2, float> pair = {{d0, d1}};\n"
                                     "    *(cg_aligned_chunk<2, float>*)(d + m * N + n) = pair;\n"
                                   : "    d[(m * N + n) / 2] = cg_pack_pair(cg_narrow<cg_bf16>(d0).bits, "
                                     "cg_narrow<cg_bf16>(d1).bits);\n") +
                "  });\n"
                "}\n";
    }
  for (const char* arch : {"sm_80", "sm_90"}) {
    const auto resources = cudagen::testing::ptxas_resources(source, arch);
    ASSERT_EQ(int(resources.size()), kernels) << arch;
    for (const auto& [kernel, r] : resources) {
      EXPECT_EQ(r.spill_bytes, 0) << kernel << " on " << arch;
      EXPECT_EQ(r.stack_bytes, 0) << kernel << " on " << arch;
      EXPECT_GT(r.registers, 0) << kernel << " on " << arch;
    }
  }
}

// The Hopper mainloop (templates/gemm_sm90.cuh, issue #38) for sm_90a: its
// SASS has HGMMA (wgmma), UTMALDG (TMA loads) and SYNCS (the mbarriers), no
// HMMA (mma.sync) and no local memory; ptxas keeps everything in registers
// and says nothing of wgmma serialised (C7511, C7515) or setmaxnreg ignored
// (C7508). For sm_90 and sm_80 the same source compiles (the kernel traps
// there: no wgmma), so one file serves every target.
TEST(Toolchains, HopperMainloopSassHasWgmmaTmaAndMbarriers) {
  if (std::string(CUDAGEN_CUOBJDUMP).empty())
    GTEST_SKIP() << "no cuobjdump: configure with the SASS part (scripts/dev.sh installs nvidia-cuda-cuobjdump)";
  std::string source = std::string(embedded_template("prelude.cuh")) + std::string(embedded_template("gemm.cuh")) +
                       std::string(embedded_template("gemm_sm90.cuh"));
  struct Variant {
    const char* name;
    const char* type;
    const char* b_k_major;
    const char* config;     // stages, consumer warpgroups
    const char* workspace;  // stream-K's, or none
  };
  const Variant variants[] = {{"hopper_bf16", "cg_bf16", "false", "4, 2", "{nullptr, nullptr, 0}"},
                              {"hopper_bf16_bt", "cg_bf16", "true", "4, 2", "{nullptr, nullptr, 0}"},
                              {"hopper_f16", "cg_f16", "false", "4, 2", "{nullptr, nullptr, 0}"},
                              {"hopper_bf16_64", "cg_bf16", "false", "3, 1", "{nullptr, nullptr, 0}"},
                              {"hopper_bf16_sk", "cg_bf16", "false", "4, 2", "{partials, arrivals, 264}"},
                              {"hopper_bf16_64_sk", "cg_bf16", "false", "3, 1", "{partials, arrivals, 264}"},
                              {"hopper_bf16_192", "cg_bf16", "false", "4, 2, 192", "{nullptr, nullptr, 0}"},
                              {"hopper_f16_192_bt", "cg_f16", "true", "4, 2, 192", "{nullptr, nullptr, 0}"}};
  const size_t kernels = sizeof variants / sizeof variants[0];
  for (const Variant& v : variants)
    source += std::string("CG_KERNEL void __launch_bounds__(cg_sm90_gemm_config<") + v.config + ">::THREADS, " +
              "cg_sm90_gemm_config<" + v.config + ">::MIN_BLOCKS) " + v.name +
              "(const __grid_constant__ cg_tensor_map map_a, const __grid_constant__ cg_tensor_map map_b, "
              "unsigned short* d, cg_i64 M, cg_i64 N, cg_i64 K, float* partials, unsigned int* arrivals) {\n"
              "  CG_DYNAMIC_SMEM(smem);\n"
              "  cg_gemm_sm90<cg_sm90_gemm_config<" + v.config + ">, " + v.type + ", " + v.b_k_major + ", " +
              (std::string(v.workspace) == "{nullptr, nullptr, 0}" ? "false" : "true") +
              ">(&map_a, &map_b, M, N, K, blockIdx.x, gridDim.x, smem, " + v.workspace + ",\n"
              "      [&](cg_i64 m, cg_i64 n, float v) { d[m * N + n] = cg_narrow<" + v.type + ">(v).bits; });\n"
              "}\n";
  const cudagen::testing::KernelReport report = cudagen::testing::compile_and_report(source, "sm_90a");
  const std::string& log = report.ptxas_log;
  const auto& resources = report.resources;
  ASSERT_EQ(resources.size(), kernels) << log;
  for (const auto& [kernel, r] : resources) {
    EXPECT_EQ(r.spill_bytes, 0) << kernel;
    EXPECT_EQ(r.stack_bytes, 0) << kernel;
  }
  // C7508: setmaxnreg ignored; C7509 to C7520: wgmma serialised ("Potential
  // Performance Loss"), each HGMMA then waits for the one before.
  EXPECT_EQ(log.find("Potential Performance Loss"), std::string::npos) << log;
  for (const char* warning : {"C7508", "C7511", "C7514", "C7515"})
    EXPECT_EQ(log.find(warning), std::string::npos) << warning << " in ptxas's report:\n" << log;
  const auto sass = report.opcodes();
  for (const Variant& v : variants) {
    const char* kernel = v.name;
    ASSERT_TRUE(sass.count(kernel)) << kernel;
    const std::map<std::string, int>& ops = sass.at(kernel);
    auto count = [&](const char* op) { return ops.count(op) ? ops.at(op) : 0; };
    EXPECT_GE(count("HGMMA"), 4) << kernel << ": a k-tile's four m64nNk16";
    // WARPGROUP.ARRIVE (wgmma.fence) once a k-tile, WARPGROUP.DEPBAR for the
    // group in flight and before the epilogue; serialised, one of each an HGMMA.
    EXPECT_LE(count("WARPGROUP"), 3) << kernel << ": wgmma serialised";
    EXPECT_GE(count("UTMALDG"), 2) << kernel << ": both operands by TMA (an N-major B in boxes of 64 columns)";
    EXPECT_GT(count("SYNCS"), 0) << kernel << ": the mbarriers";
    EXPECT_EQ(count("HMMA"), 0) << kernel << ": mma.sync, the sm_80 path";
    EXPECT_EQ(count("LDL") + count("STL"), 0) << kernel << ": local memory";
  }
  // The wide tiles' wgmma, by its shape in the disassembly (HGMMA.64x192x16.F32.BF16). (128 x 256,
  // which the generator does not take, spills its accumulators: docs/gemm.md.)
  for (const auto& [kernel, shape] : {std::pair<const char*, const char*>{"hopper_bf16_192", "HGMMA.64x192x16"},
                                      {"hopper_f16_192_bt", "HGMMA.64x192x16"}}) {
    int wide = 0;
    for (const cudagen::testing::SassInstruction& i : report.sass.at(kernel)) wide += i.mnemonic.starts_with(shape);
    EXPECT_GE(wide, 4) << kernel << ": a k-tile's four " << shape;
  }
  for (const char* arch : {"sm_90", "sm_80"}) EXPECT_EQ(cudagen::testing::ptxas_resources(source, arch).size(), kernels) << arch;
}

// Generated matmul kernels on the pipelined mainloop, both tile configs the
// emitter picks (a decoder's MLP up projection at 4096 rows: 128 x 128 x 64;
// at 64 rows: 64 x 64 x 32), with a bias and GELU epilogue: no spills, no
// stack, for sm_80 and sm_90.
TEST(Toolchains, PipelinedMatmulKernelsKeepEverythingInRegisters) {
  GraphBuilder b("pipelined");
  const Storage ext = Storage::external;
  for (int64_t rows : {4096, 64}) {
    const std::string r = std::to_string(rows);
    auto mm = b.task("up_" + r, "matmul").tensor("a", DType::bf16, {rows, 768}, ext).tensor("b", DType::bf16, {768, 3072}, ext).tensor("out", DType::bf16, {rows, 3072});
    auto bias = b.task("bias_" + r, "add").tensor("a", mm["out"]).tensor("b", DType::bf16, {3072}, ext).tensor("out", DType::bf16, {rows, 3072});
    b.task("act_" + r, "gelu").tensor("x", bias["out"]).tensor("out", DType::bf16, {rows, 3072}, ext);
  }
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  std::vector<std::string> paths;
  for (const EmittedKernel& k : c.emitted.kernels) paths.push_back(k.matmul_path);
  ASSERT_EQ(paths.size(), 2u);
  EXPECT_NE(paths[0].find("128 x 128 x 64 tiles"), std::string::npos) << paths[0];
  EXPECT_NE(paths[1].find("64 x 64 x 32 tiles"), std::string::npos) << paths[1];
  for (const char* arch : {"sm_80", "sm_90"})
    for (const auto& [kernel, r] : cudagen::testing::ptxas_resources(c.emitted.cuda_source, arch)) {
      EXPECT_EQ(r.spill_bytes, 0) << kernel << " on " << arch;
      EXPECT_EQ(r.stack_bytes, 0) << kernel << " on " << arch;
    }
}

// The SASS of each generated matmul kernel on the pipelined mainloop has the
// instructions the design asks for (issue #35): LDGSTS (cp.async), LDSM
// (ldmatrix), HMMA (mma.sync), and no local memory (LDL, STL), for sm_80
// and sm_90; a kernel left on the old tile has no LDGSTS.
TEST(Toolchains, PipelinedMatmulSassHasAsyncCopiesLdmatrixAndMma) {
  if (std::string(CUDAGEN_CUOBJDUMP).empty())
    GTEST_SKIP() << "no cuobjdump: configure with the SASS part (scripts/dev.sh installs nvidia-cuda-cuobjdump)";
  GraphBuilder b("sass");
  const Storage ext = Storage::external;
  auto mm = b.task("up", "matmul").tensor("a", DType::bf16, {4096, 768}, ext).tensor("b", DType::bf16, {768, 3072}, ext).tensor("out", DType::bf16, {4096, 3072});
  b.task("act", "gelu").tensor("x", mm["out"]).tensor("out", DType::bf16, {4096, 3072}, ext);
  b.task("dw", "matmul").tensor("a", DType::f16, {512, 96}, ext).tensor("b", DType::f16, {512, 64}, ext).tensor("out", DType::f16, {96, 64}, ext).arg("trans_a", true);
  b.task("odd", "matmul").tensor("a", DType::bf16, {64, 30}, ext).tensor("b", DType::bf16, {30, 64}, ext).tensor("out", DType::bf16, {64, 64}, ext);
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  int pipelined = 0;
  for (const char* arch : {"sm_80", "sm_90"}) {
    const auto sass = cudagen::testing::sass_opcodes(c.emitted.cuda_source, arch);
    for (const EmittedKernel& k : c.emitted.kernels) {
      ASSERT_TRUE(sass.count(k.name)) << k.name << " on " << arch;
      const std::map<std::string, int>& ops = sass.at(k.name);
      auto count = [&](const char* op) { return ops.count(op) ? ops.at(op) : 0; };
      if (k.matmul_path.find("pipelined") == std::string::npos) {
        EXPECT_EQ(count("LDGSTS"), 0) << k.name << " (" << k.matmul_path << ") on " << arch;
        continue;
      }
      ++pipelined;
      EXPECT_GT(count("LDGSTS"), 0) << k.name << " on " << arch;
      EXPECT_GT(count("LDSM"), 0) << k.name << " on " << arch;
      EXPECT_GT(count("HMMA"), 0) << k.name << " on " << arch;
      EXPECT_EQ(count("LDL") + count("STL"), 0) << k.name << " on " << arch << ": local memory";
    }
  }
  EXPECT_EQ(pipelined, 4) << "up and dw, for each of two architectures";
}

// conv2d_nhwc's implicit GEMM in generated code (issue #40): a ResNet 3x3
// convolution with its bias and ReLU in the epilogue, a 1x1 one in f16, one
// at 7 x 7 pixels split over K, and an f32 one as TF32 (--allow-tf32). On
// sm_80 and sm_90: the patches and weights copied by cp.async (LDGSTS),
// fragments by ldmatrix (LDSM), products on tensor cores (HMMA); no local
// memory, no spills, no stack.
TEST(Toolchains, ChannelsLastConvolutionSassHasAsyncCopiesLdmatrixAndMma) {
  if (std::string(CUDAGEN_CUOBJDUMP).empty())
    GTEST_SKIP() << "no cuobjdump: configure with the SASS part (scripts/dev.sh installs nvidia-cuda-cuobjdump)";
  GraphBuilder b("conv_sass");
  const Storage ext = Storage::external;
  auto conv = [&](const std::string& id, DType d, Shape x, int64_t out_channels, int64_t kernel, int64_t stride) {
    const int64_t padding = kernel / 2, size = (x[1] + 2 * padding - kernel) / stride + 1;
    return b.task(id, "conv2d_nhwc")
        .tensor("x", d, x, ext)
        .tensor("weight", d, {out_channels, kernel, kernel, x[3]}, ext)
        .tensor("out", d, {x[0], size, size, out_channels}, id == "c3x3" ? Storage::transient : ext)
        .arg("stride_h", stride)
        .arg("stride_w", stride)
        .arg("padding_h", padding)
        .arg("padding_w", padding);
  };
  auto c3x3 = conv("c3x3", DType::bf16, {8, 56, 56, 64}, 64, 3, 1);
  auto bias = b.task("bias", "add").tensor("a", c3x3["out"]).tensor("b", DType::bf16, {64}, ext).tensor("out", DType::bf16, {8, 56, 56, 64});
  b.task("act", "relu").tensor("x", bias["out"]).tensor("out", DType::bf16, {8, 56, 56, 64}, ext);
  conv("pointwise", DType::f16, {8, 28, 28, 128}, 512, 1, 1);
  conv("deep", DType::bf16, {1, 7, 7, 512}, 512, 3, 1);
  conv("strided_tf32", DType::f32, {8, 28, 28, 128}, 256, 3, 2);
  CompileOptions tf32;
  tf32.emit.allow_tf32 = true;
  Compiled c = compile(load_program(std::move(b).graph(), {}), tf32);
  ASSERT_EQ(c.emitted.kernels.size(), 4u);
  for (const EmittedKernel& k : c.emitted.kernels)
    EXPECT_NE(k.matmul_path.find(k.name.ends_with("pointwise") ? "plain GEMM" : "implicit GEMM"), std::string::npos)
        << k.name << ": " << k.matmul_path;
  EXPECT_NE(c.emitted.kernels[2].matmul_path.find("split-K"), std::string::npos) << c.emitted.kernels[2].matmul_path;
  for (const char* arch : {"sm_80", "sm_90"}) {
    const cudagen::testing::KernelReport report = cudagen::testing::compile_and_report(c.emitted.cuda_source, arch);
    const auto sass = report.opcodes();
    for (const EmittedKernel& k : c.emitted.kernels) {
      ASSERT_TRUE(sass.count(k.name)) << k.name << " on " << arch;
      const std::map<std::string, int>& ops = sass.at(k.name);
      auto count = [&](const char* op) { return ops.count(op) ? ops.at(op) : 0; };
      for (const char* op : {"LDGSTS", "LDSM", "HMMA"}) EXPECT_GT(count(op), 0) << k.name << " on " << arch << ": " << op;
      EXPECT_EQ(count("LDL") + count("STL"), 0) << k.name << " on " << arch << ": local memory";
      ASSERT_TRUE(report.resources.count(k.name)) << k.name << " on " << arch;
      EXPECT_EQ(report.resources.at(k.name).spill_bytes, 0) << k.name << " on " << arch;
      EXPECT_EQ(report.resources.at(k.name).stack_bytes, 0) << k.name << " on " << arch;
    }
  }
}

// conv2d_nhwc's depthwise form at MobileNet's sizes: bf16 3 x 3 with a bias
// and relu6 after it (the epilogue's vector form), f16 5 x 5 of stride 2, f32
// 3 x 3. On sm_80 and sm_90: x read and out written 16 bytes an access
// (LDG.E.128, STG.E.128), the weights read from shared memory in 16-byte
// vectors (LDS.128), the taps' sums in FFMAs; no local memory, no spills,
// no stack.
TEST(Toolchains, DepthwiseSassMovesSixteenBytesAnAccess) {
  if (std::string(CUDAGEN_CUOBJDUMP).empty())
    GTEST_SKIP() << "no cuobjdump: configure with the SASS part (scripts/dev.sh installs nvidia-cuda-cuobjdump)";
  const Storage ext = Storage::external;
  // One graph a convolution, so that each is a launch of its own.
  auto depthwise = [&](const std::string& id, DType d, Shape x, int64_t kernel, int64_t stride, bool epilogue) {
    GraphBuilder b("depthwise_sass_" + id);
    const int64_t padding = kernel / 2, size = (x[1] + 2 * padding - kernel) / stride + 1;
    const Shape out{x[0], size, size, x[3]};
    auto dw = b.task(id, "conv2d_nhwc")
                  .tensor("x", d, x, ext)
                  .tensor("weight", d, {x[3], kernel, kernel, 1}, ext)
                  .tensor("out", d, out, epilogue ? Storage::transient : ext)
                  .arg("stride_h", stride)
                  .arg("stride_w", stride)
                  .arg("padding_h", padding)
                  .arg("padding_w", padding)
                  .arg("groups", x[3]);
    if (epilogue) {
      auto bias = b.task("bias", "add").tensor("a", dw["out"]).tensor("b", d, {x[3]}, ext).tensor("out", d, out);
      b.task("act", "relu6").tensor("x", bias["out"]).tensor("out", d, out, ext);
    }
    Compiled c = compile(load_program(std::move(b).graph(), {}), {});
    EXPECT_EQ(c.emitted.kernels.size(), 1u) << id;
    EXPECT_EQ(c.emitted.kernels.front().tasks.size(), epilogue ? 3u : 1u) << "the bias and relu6 in its kernel";
    EXPECT_NE(c.emitted.kernels.front().matmul_path.find("the depthwise form"), std::string::npos)
        << id << ": " << c.emitted.kernels.front().matmul_path;
    return c;
  };
  std::vector<Compiled> compiled;
  compiled.push_back(depthwise("dw3x3", DType::bf16, {8, 56, 56, 144}, 3, 1, true));
  compiled.push_back(depthwise("dw5x5", DType::f16, {8, 28, 28, 240}, 5, 2, false));
  compiled.push_back(depthwise("dw_f32", DType::f32, {8, 28, 28, 96}, 3, 1, false));
  for (const Compiled& c : compiled)
    for (const char* arch : {"sm_80", "sm_90"}) {
      const cudagen::testing::KernelReport report = cudagen::testing::compile_and_report(c.emitted.cuda_source, arch);
      for (const EmittedKernel& k : c.emitted.kernels) {
        ASSERT_TRUE(report.sass.count(k.name)) << k.name << " on " << arch;
        std::map<std::string, int> global;  // the global loads' and stores' mnemonics
        int wide_shared = 0;
        for (const auto& i : report.sass.at(k.name)) {
          if (i.opcode == "LDG" || i.opcode == "STG") ++global[i.mnemonic];
          if (i.opcode == "LDS" && i.mnemonic.find(".128") != std::string::npos) ++wide_shared;
        }
        std::string seen;
        auto wide = [&](const char* op) {
          int n = 0;
          for (const auto& [mnemonic, count] : global)
            if (mnemonic.starts_with(op) && mnemonic.find(".128") != std::string::npos) n += count;
          return n;
        };
        for (const auto& [mnemonic, count] : global) seen += fmt::format(" {} x{}", mnemonic, count);
        EXPECT_GT(wide("LDG"), 0) << k.name << " on " << arch << ":" << seen;
        EXPECT_GT(wide("STG"), 0) << k.name << " on " << arch << ":" << seen;
        EXPECT_GT(wide_shared, 0) << k.name << " on " << arch << ": the weights as 16-byte vectors";
        const auto ops = report.opcodes().at(k.name);
        EXPECT_GT(ops.count("FFMA") ? ops.at("FFMA") : 0, 0) << k.name << " on " << arch << ": the taps' sums";
        ASSERT_TRUE(report.resources.count(k.name)) << k.name << " on " << arch;
        EXPECT_EQ(report.resources.at(k.name).spill_bytes, 0) << k.name << " on " << arch;
        EXPECT_EQ(report.resources.at(k.name).stack_bytes, 0) << k.name << " on " << arch;
        EXPECT_EQ((ops.count("LDL") ? ops.at("LDL") : 0) + (ops.count("STL") ? ops.at("STL") : 0), 0)
            << k.name << " on " << arch << ": local memory";
      }
    }
}

// conv2d_nhwc's gradients at a ResNet's sizes: the data gradient (bf16 3 x 3,
// f16 of stride 2, f32 as TF32) and the weight gradient (bf16 3 x 3 over 8
// images of 56 x 56, split over k; f16 1 x 1). On sm_80 and sm_90: cp.async
// copies (LDGSTS), ldmatrix (LDSM; the 16-bit N-contiguous tiles transposed
// by it) and mma (HMMA); no local memory, no spills, no stack.
TEST(Toolchains, ChannelsLastGradientSassHasAsyncCopiesLdmatrixAndMma) {
  if (std::string(CUDAGEN_CUOBJDUMP).empty())
    GTEST_SKIP() << "no cuobjdump: configure with the SASS part (scripts/dev.sh installs nvidia-cuda-cuobjdump)";
  GraphBuilder b("conv_gradient_sass");
  const Storage ext = Storage::external;
  auto gradient = [&](const std::string& id, const char* which, DType d, Shape x, int64_t out_channels, int64_t kernel,
                      int64_t stride) {
    const int64_t padding = kernel / 2, size = (x[1] + 2 * padding - kernel) / stride + 1;
    const bool data = std::string(which) == "data";
    const Shape weight{out_channels, kernel, kernel, x[3]};
    b.task(id, std::string("conv2d_nhwc_backward_") + which)
        .tensor("x", d, x, ext)
        .tensor("weight", d, weight, ext)
        .tensor("dout", d, {x[0], size, size, out_channels}, ext)
        .tensor(data ? "dx" : "dweight", d, data ? x : weight, ext)
        .arg("stride_h", stride)
        .arg("stride_w", stride)
        .arg("padding_h", padding)
        .arg("padding_w", padding);
  };
  gradient("dx_3x3", "data", DType::bf16, {8, 56, 56, 64}, 64, 3, 1);
  gradient("dx_strided", "data", DType::f16, {8, 28, 28, 128}, 256, 3, 2);
  gradient("dx_tf32", "data", DType::f32, {8, 14, 14, 256}, 256, 3, 1);
  gradient("dw_3x3", "weight", DType::bf16, {8, 56, 56, 64}, 64, 3, 1);
  gradient("dw_pointwise", "weight", DType::f16, {8, 28, 28, 128}, 512, 1, 1);
  CompileOptions tf32;
  tf32.emit.allow_tf32 = true;
  Compiled c = compile(load_program(std::move(b).graph(), {}), tf32);
  ASSERT_EQ(c.emitted.kernels.size(), 5u);
  for (const EmittedKernel& k : c.emitted.kernels)
    EXPECT_NE(k.matmul_path.find(k.name.find("_dx_") != std::string::npos ? "(the data gradient)" : "(the weight gradient)"),
              std::string::npos)
        << k.name << ": " << k.matmul_path;
  EXPECT_NE(c.emitted.kernels[3].matmul_path.find("split-K"), std::string::npos) << c.emitted.kernels[3].matmul_path;
  for (const char* arch : {"sm_80", "sm_90"}) {
    const cudagen::testing::KernelReport report = cudagen::testing::compile_and_report(c.emitted.cuda_source, arch);
    const auto sass = report.opcodes();
    for (const EmittedKernel& k : c.emitted.kernels) {
      ASSERT_TRUE(sass.count(k.name)) << k.name << " on " << arch;
      const std::map<std::string, int>& ops = sass.at(k.name);
      auto count = [&](const char* op) { return ops.count(op) ? ops.at(op) : 0; };
      for (const char* op : {"LDGSTS", "LDSM", "HMMA"}) EXPECT_GT(count(op), 0) << k.name << " on " << arch << ": " << op;
      EXPECT_EQ(count("LDL") + count("STL"), 0) << k.name << " on " << arch << ": local memory";
      ASSERT_TRUE(report.resources.count(k.name)) << k.name << " on " << arch;
      EXPECT_EQ(report.resources.at(k.name).spill_bytes, 0) << k.name << " on " << arch;
      EXPECT_EQ(report.resources.at(k.name).stack_bytes, 0) << k.name << " on " << arch;
    }
  }
}

// The flash attention kernel (templates/softmax_flash.cuh) in generated code:
// bf16 heads of 64, causal, f16 heads of 128 (80 KiB of shared memory) over
// 2048 keys, a decoding step split over its keys, bf16 heads of 256 (q's
// fragments read from shared memory), and f32 heads of 64 and 128 as TF32
// (--allow-tf32), and bf16 heads of 64 with a padding mask added to the
// scores. On sm_80 and sm_90: both products on tensor cores (HMMA),
// fed by ldmatrix (LDSM) from tiles that cp.async (LDGSTS) filled; the
// exponentials on the special-function unit (MUFU); no local memory,
// no spills, no stack.
TEST(Toolchains, FlashAttentionSassHasAsyncCopiesLdmatrixAndMma) {
  if (std::string(CUDAGEN_CUOBJDUMP).empty())
    GTEST_SKIP() << "no cuobjdump: configure with the SASS part (scripts/dev.sh installs nvidia-cuda-cuobjdump)";
  GraphBuilder b("flash");
  const Storage ext = Storage::external;
  struct Head {
    DType d;
    int64_t Tq, Tk, D;
    bool causal;
  };
  // (The third decodes: one query row a head over 4096 keys, split-KV; the
  // fourth has heads of 256, q read from shared memory: about 250 registers.)
  for (const Head& h : {Head{DType::bf16, 512, 512, 64, true}, Head{DType::f16, 2048, 2048, 128, false},
                        Head{DType::bf16, 1, 4096, 64, false}, Head{DType::bf16, 1024, 1024, 256, true}}) {
    const std::string n = std::to_string(h.D) + "_" + std::to_string(h.Tq);
    auto s = b.task("scores" + n, "matmul").tensor("a", h.d, {8, 12, h.Tq, h.D}, ext).tensor("b", h.d, {8, 12, h.Tk, h.D}, ext).tensor("out", h.d, {8, 12, h.Tq, h.Tk}).arg("trans_b", true);
    auto p = b.task("probs" + n, "softmax").tensor("x", s["out"]).tensor("out", h.d, {8, 12, h.Tq, h.Tk}).arg("scale", 0.125).arg("causal", h.causal);
    b.task("context" + n, "matmul").tensor("a", p["out"]).tensor("b", h.d, {8, 12, h.Tk, h.D}, ext).tensor("out", h.d, {8, 12, h.Tq, h.D}, ext);
  }
  // And f32 heads of 64 and 128 under --allow-tf32 (HMMA.1688.F32.TF32; the values' fragments by LDS).
  for (const int64_t D : {64, 128}) {
    const std::string n = "tf32_" + std::to_string(D);
    auto s = b.task("scores" + n, "matmul").tensor("a", DType::f32, {8, 12, 2048, D}, ext).tensor("b", DType::f32, {8, 12, 2048, D}, ext).tensor("out", DType::f32, {8, 12, 2048, 2048}).arg("trans_b", true);
    auto p = b.task("probs" + n, "softmax").tensor("x", s["out"]).tensor("out", DType::f32, {8, 12, 2048, 2048}).arg("scale", 0.125).arg("causal", true);
    b.task("context" + n, "matmul").tensor("a", p["out"]).tensor("b", DType::f32, {8, 12, 2048, D}, ext).tensor("out", DType::f32, {8, 12, 2048, D}, ext);
  }
  {  // And bf16 heads of 64 with a padding mask added to the scores (cg_flash_bias_of).
    auto s = b.task("scores_masked", "matmul").tensor("a", DType::bf16, {8, 12, 512, 64}, ext).tensor("b", DType::bf16, {8, 12, 512, 64}, ext).tensor("out", DType::bf16, {8, 12, 512, 512}).arg("trans_b", true);
    auto m = b.task("masked", "add").tensor("a", s["out"]).tensor("b", DType::bf16, {8, 1, 1, 512}, ext).tensor("out", DType::bf16, {8, 12, 512, 512});
    auto p = b.task("probs_masked", "softmax").tensor("x", m["out"]).tensor("out", DType::bf16, {8, 12, 512, 512}).arg("scale", 0.125);
    b.task("context_masked", "matmul").tensor("a", p["out"]).tensor("b", DType::bf16, {8, 12, 512, 64}, ext).tensor("out", DType::bf16, {8, 12, 512, 64}, ext);
  }
  CompileOptions tf32;
  tf32.emit.allow_tf32 = true;
  Compiled c = compile(load_program(std::move(b).graph(), {}), tf32);
  ASSERT_EQ(c.emitted.kernels.size(), 7u);
  EXPECT_NE(c.emitted.cuda_source.find("cg_flash_bias_of([&](cg_i64 row, cg_i64 key)"), std::string::npos);
  for (const EmittedKernel& k : c.emitted.kernels)
    EXPECT_NE(k.matmul_path.find("flash attention"), std::string::npos) << k.name << ": " << k.matmul_path;
  EXPECT_NE(c.emitted.kernels[2].matmul_path.find("split-KV"), std::string::npos) << c.emitted.kernels[2].matmul_path;
  for (size_t i : {4, 5})
    EXPECT_NE(c.emitted.kernels[i].matmul_path.find("f32 as TF32"), std::string::npos) << c.emitted.kernels[i].matmul_path;
  for (const char* arch : {"sm_80", "sm_90"}) {
    const cudagen::testing::KernelReport report = cudagen::testing::compile_and_report(c.emitted.cuda_source, arch);
    const auto sass = report.opcodes();
    const auto& resources = report.resources;
    for (const EmittedKernel& k : c.emitted.kernels) {
      ASSERT_TRUE(sass.count(k.name)) << k.name << " on " << arch;
      const std::map<std::string, int>& ops = sass.at(k.name);
      auto count = [&](const char* op) { return ops.count(op) ? ops.at(op) : 0; };
      EXPECT_GT(count("LDGSTS"), 0) << k.name << " on " << arch;
      EXPECT_GT(count("LDSM"), 0) << k.name << " on " << arch;
      EXPECT_GT(count("HMMA"), 0) << k.name << " on " << arch;
      EXPECT_GT(count("MUFU"), 0) << k.name << " on " << arch;
      EXPECT_EQ(count("LDL") + count("STL"), 0) << k.name << " on " << arch << ": local memory";
      ASSERT_TRUE(resources.count(k.name)) << k.name << " on " << arch;
      EXPECT_EQ(resources.at(k.name).spill_bytes, 0) << k.name << " on " << arch;
      EXPECT_EQ(resources.at(k.name).stack_bytes, 0) << k.name << " on " << arch;
    }
  }
}

// The Hopper forward (templates/softmax_flash_sm90.cuh, issue #39) for
// sm_90a at 4096 tokens: bf16 heads of 64 causal, f16 heads of 128, bf16
// heads of 96 (padded to 128), bf16 heads of 256 causal and f16 heads of 192
// (64 keys a step), and decoding (bf16 heads of 64, one query row over 8192
// keys, B1 x H4: the split form, 16 ways). All of attention's
// FLOPs in kernels whose own SASS has HGMMA (wgmma), UTMALDG (TMA, 3-D
// maps) and SYNCS (the mbarriers),
// no HMMA and no local memory, no spills; ptxas serialises no wgmma
// ("Potential Performance Loss", C7509 to C7520) and ignores no setmaxnreg
// (C7508); each key tile's loop issues D / 16 wgmmas for the scores of the
// next tile and 8 for p v of this one (128 keys; 4 for 64), with no wait between them
// (the softmax overlaps p v), one fence and one wait for each product.
TEST(Toolchains, FlashAttentionOnSm90aHasTmaAndWgmma) {
  if (std::string(CUDAGEN_CUOBJDUMP).empty())
    GTEST_SKIP() << "no cuobjdump: configure with the SASS part (scripts/dev.sh installs nvidia-cuda-cuobjdump)";
  GraphBuilder b("flash_sm90a");
  const Storage ext = Storage::external;
  struct Head {
    DType d;
    int64_t D;
    bool causal;
    bool decoding = false;
  };
  const std::vector<Head> heads = {Head{DType::bf16, 64, true},   Head{DType::f16, 128, false},
                                   Head{DType::bf16, 96, true},   Head{DType::bf16, 256, true},
                                   Head{DType::f16, 192, false},  Head{DType::bf16, 64, false, true}};
  for (const Head& h : heads) {
    const std::string n = std::to_string(h.D) + (h.decoding ? "_decoding" : "");
    const int64_t B = h.decoding ? 1 : 8, H = h.decoding ? 4 : 12, Tq = h.decoding ? 1 : 4096, Tk = h.decoding ? 8192 : 4096;
    auto s = b.task("scores" + n, "matmul").tensor("a", h.d, {B, H, Tq, h.D}, ext).tensor("b", h.d, {B, H, Tk, h.D}, ext).tensor("out", h.d, {B, H, Tq, Tk}).arg("trans_b", true);
    auto p = b.task("probs" + n, "softmax").tensor("x", s["out"]).tensor("out", h.d, {B, H, Tq, Tk}).arg("scale", 0.125).arg("causal", h.causal);
    b.task("context" + n, "matmul").tensor("a", p["out"]).tensor("b", h.d, {B, H, Tk, h.D}, ext).tensor("out", h.d, {B, H, Tq, h.D}, ext);
  }
  CompileOptions options;
  options.emit.arch = "sm_90a";
  const Compiled c = compile(load_program(std::move(b).graph(), {}), options);
  ASSERT_EQ(c.emitted.kernels.size(), heads.size());
  const cudagen::testing::KernelReport report = cudagen::testing::compile_and_report(c.emitted.cuda_source, "sm_90a");
  EXPECT_EQ(report.ptxas_log.find("Potential Performance Loss"), std::string::npos) << report.ptxas_log;
  EXPECT_EQ(report.ptxas_log.find("C7508"), std::string::npos) << report.ptxas_log;
  int64_t total = 0, hopper = 0;
  for (size_t i = 0; i < heads.size(); ++i) {
    const EmittedKernel& k = c.emitted.kernels[i];
    ASSERT_TRUE(report.sass.count(k.name)) << k.name;
    std::map<std::string, int> ops;
    for (const cudagen::testing::SassInstruction& instruction : report.sass.at(k.name)) ++ops[instruction.opcode];
    auto count = [](const std::map<std::string, int>& m, const char* op) { return m.count(op) ? m.at(op) : 0; };
    const bool on_hopper = count(ops, "HGMMA") > 0 && count(ops, "UTMALDG") > 0 && count(ops, "SYNCS") > 0 &&
                           count(ops, "HMMA") == 0 && count(ops, "LDL") + count(ops, "STL") == 0;
    EXPECT_TRUE(on_hopper) << k.name << ": " << k.matmul_path;
    EXPECT_EQ(k.matmul_path.find("split-KV 16 ways") != std::string::npos, heads[i].decoding) << k.matmul_path;
    EXPECT_GT(count(ops, "MUFU"), 0) << k.name << ": the exponentials";
    ASSERT_TRUE(report.resources.count(k.name)) << k.name;
    EXPECT_EQ(report.resources.at(k.name).spill_bytes, 0) << k.name;
    EXPECT_EQ(report.resources.at(k.name).stack_bytes, 0) << k.name;
    const std::map<std::string, int> loop = cudagen::testing::sass_loop(report.sass.at(k.name), "HGMMA");
    const int64_t tile_d = heads[i].D == 64 ? 64 : heads[i].D <= 128 ? 128 : heads[i].D, keys = tile_d > 128 ? 64 : 128;
    EXPECT_EQ(count(loop, "HGMMA"), tile_d / 16 + keys / 16) << k.name << ": the scores' and p v's wgmmas of a key tile";
    EXPECT_EQ(count(loop, "WARPGROUP"), 4) << k.name << ": a fence and a wait for each product, none serialised";
    // The overlap: the next tile's scores and this tile's p v are both issued
    // before the first wait (the softmax runs while p v does).
    const std::vector<cudagen::testing::SassInstruction> body = cudagen::testing::sass_loop_body(report.sass.at(k.name), "HGMMA");
    size_t first = body.size(), last = 0;
    for (size_t i = 0; i < body.size(); ++i)
      if (body[i].opcode == "HGMMA") first = std::min(first, i), last = i;
    int waits_between = 0;
    for (size_t i = first; i < last && i < body.size(); ++i) waits_between += body[i].mnemonic == "WARPGROUP.DEPBAR.LE";
    EXPECT_EQ(waits_between, 0) << k.name << ": a wait between the scores' wgmmas and p v's";
    int64_t flops = 0;  // its matmul tasks' (the scores and p v)
    for (int t : k.tasks)
      if (c.program.tasks[size_t(t)].op->pattern == PatternKind::matmul) flops += task_flops(c.program, t).value_or(0);
    total += flops;
    if (on_hopper) hopper += flops;
  }
  ASSERT_GT(total, 0);
  EXPECT_GE(double(hopper), 0.95 * double(total));
}

// An attention trained on the flash kernels, by hand as derive writes it:
// [8, 12, T, D] heads of q and k, of Dv for v (D where 0; external), the
// forward and the gradient tasks dp, dv, ds, dq, dk.
static void add_flash_training(GraphBuilder& b, DType d, int64_t T, int64_t D, bool causal, int64_t Dv = 0) {
  const Storage ext = Storage::external;
  if (Dv == 0) Dv = D;
  const std::string n = std::string(to_string(d)) + "_" + std::to_string(D) + (Dv == D ? "" : "_" + std::to_string(Dv));
  const Shape rows{8, 12, T, D}, values{8, 12, T, Dv}, square{8, 12, T, T};
  auto s = b.task("scores" + n, "matmul").tensor("a", d, rows, ext).tensor("b", d, rows, ext).tensor("out", d, square).arg("trans_b", true);
  auto p = b.task("probs" + n, "softmax").tensor("x", s["out"]).tensor("out", d, square).arg("scale", 0.125).arg("causal", causal);
  auto c = b.task("context" + n, "matmul").tensor("a", p["out"]).tensor("b", d, values, ext).tensor("out", d, values, ext);
  auto dp = b.task("dp" + n, "matmul", Phase::backward).tensor("a", d, values, ext).tensor("b", c["b"]).tensor("out", d, square).arg("trans_b", true);
  b.task("dv" + n, "matmul", Phase::backward).tensor("a", p["out"]).tensor("b", dp["a"]).tensor("out", d, values, ext).arg("trans_a", true);
  auto ds = b.task("ds" + n, "softmax_backward", Phase::backward).tensor("out", p["out"]).tensor("dout", dp["out"]).tensor("dx", d, square).arg("scale", 0.125);
  b.task("dq" + n, "matmul", Phase::backward).tensor("a", ds["dx"]).tensor("b", s["b"]).tensor("out", d, rows, ext);
  b.task("dk" + n, "matmul", Phase::backward).tensor("a", ds["dx"]).tensor("b", s["a"]).tensor("out", d, rows, ext).arg("trans_a", true);
}

// The flash attention backward kernel (training: the forward and the
// gradient tasks by hand, as derive writes them), bf16 heads of 64 causal and
// f16 heads of 128, f32 heads of 64 and 128 as TF32 (--allow-tf32), and bf16
// heads of 256 (two key blocks a tile, each half of dk's and dv's columns): on
// sm_80 and sm_90 its five products on tensor cores (HMMA) fed by ldmatrix
// (LDSM) from cp.async tiles (LDGSTS), the probabilities recomputed on the
// special-function unit (MUFU); no local memory, no spills, no stack. Then in
// the atomic mode, where the 16-bit heads of 64 sum dq with atomics (RED) and
// the others keep dq's own blocks.
TEST(Toolchains, FlashAttentionBackwardSassHasAsyncCopiesLdmatrixAndMma) {
  if (std::string(CUDAGEN_CUOBJDUMP).empty())
    GTEST_SKIP() << "no cuobjdump: configure with the SASS part (scripts/dev.sh installs nvidia-cuda-cuobjdump)";
  GraphBuilder b("flash_backward");
  add_flash_training(b, DType::bf16, 512, 64, true);
  add_flash_training(b, DType::f16, 1024, 128, false);
  add_flash_training(b, DType::f32, 1024, 64, true);
  add_flash_training(b, DType::f32, 1024, 128, true);
  add_flash_training(b, DType::bf16, 1024, 256, true);
  const TaskGraph graph = std::move(b).graph();
  // Deterministic, then the atomic mode (heads of 64: dq summed by the key blocks with RED.ADD.F32),
  // that one on sm_90 alone: its atomics are the same source on both (each of these builds of
  // the five kernels takes about 27 s here).
  for (const bool atomic : {false, true}) {
    CompileOptions options;
    options.emit.atomic_attention_backward = atomic;
    options.emit.allow_tf32 = true;
    Compiled c = compile(load_program(graph, {}), options);
    std::vector<std::string> backward;
    for (const EmittedKernel& k : c.emitted.kernels)
      if (k.matmul_path.find("flash attention backward") != std::string::npos) backward.push_back(k.name);
    ASSERT_EQ(backward.size(), 5u);
    for (const char* arch : {"sm_80", "sm_90"}) {
      if (atomic && std::string(arch) == "sm_80") continue;
      const cudagen::testing::KernelReport report = cudagen::testing::compile_and_report(c.emitted.cuda_source, arch);
      const auto sass = report.opcodes();
      const auto& resources = report.resources;
      for (const std::string& name : backward) {
        ASSERT_TRUE(sass.count(name)) << name << " on " << arch;
        const std::map<std::string, int>& ops = sass.at(name);
        auto count = [&](const char* op) { return ops.count(op) ? ops.at(op) : 0; };
        for (const char* op : {"LDGSTS", "LDSM", "HMMA", "MUFU"}) EXPECT_GT(count(op), 0) << name << " on " << arch << ": " << op;
        // Heads of 64 are budgeted for 3 blocks a SM (168 registers): causal, ptxas
        // spills two 32-bit values, reloaded once a tile of 32 rows from L1 (on an H200
        // the kernel ran faster so than at 2 blocks without spills: bench/RESULTS.md).
        // Nothing more may spill.
        EXPECT_LE(count("LDL") + count("STL"), 4) << name << " on " << arch << ": local memory";
        ASSERT_TRUE(resources.count(name)) << name << " on " << arch;
        EXPECT_LE(resources.at(name).spill_bytes, 16) << name << " on " << arch;
        EXPECT_LE(resources.at(name).stack_bytes, 8) << name << " on " << arch;
        const int atomics = count("RED") + count("ATOM") + count("REDG") + count("ATOMG");
        EXPECT_EQ(atomics > 0, atomic && name == backward[0]) << name << " on " << arch << ": " << atomics << " atomics";
        std::printf("  %s%s on %s: %d registers, %d bytes spilled, %d HMMA, %d LDSM, %d LDGSTS, %d atomics\n",
                    name.c_str(), atomic ? " (atomic)" : "", arch, resources.at(name).registers,
                    resources.at(name).spill_bytes, count("HMMA"), count("LDSM"), count("LDGSTS"), atomics);
      }
    }
  }
  // f32 trained without --allow-tf32, heads of 64: both flash kernels on CUDA
  // cores (cg_f32_simt): the same copies and ldmatrix, no HMMA, the products
  // as FFMA fed by SHFL; no spills.
  GraphBuilder f32("flash_backward_f32");
  add_flash_training(f32, DType::f32, 1024, 64, true);
  Compiled simt = compile(load_program(std::move(f32).graph(), {}), {});
  int simt_kernels = 0;
  for (const char* arch : {"sm_80", "sm_90"}) {
    const cudagen::testing::KernelReport report = cudagen::testing::compile_and_report(simt.emitted.cuda_source, arch);
    const auto sass = report.opcodes();
    const auto& resources = report.resources;
    for (const EmittedKernel& k : simt.emitted.kernels) {
      if (k.mainloop != MatmulMainloop::flash_attention_simt) continue;
      ++simt_kernels;
      ASSERT_TRUE(sass.count(k.name) && resources.count(k.name)) << k.name << " on " << arch;
      const std::map<std::string, int>& ops = sass.at(k.name);
      auto count = [&](const char* op) { return ops.count(op) ? ops.at(op) : 0; };
      for (const char* op : {"LDGSTS", "LDSM", "FFMA", "SHFL", "MUFU"}) EXPECT_GT(count(op), 0) << k.name << " on " << arch << ": " << op;
      EXPECT_EQ(count("HMMA"), 0) << k.name << " on " << arch;
      EXPECT_EQ(resources.at(k.name).spill_bytes, 0) << k.name << " on " << arch;
      std::printf("  %s (f32 on CUDA cores) on %s: %d registers, %d bytes spilled, %d FFMA, %d SHFL\n", k.name.c_str(), arch,
                  resources.at(k.name).registers, resources.at(k.name).spill_bytes, count("FFMA"), count("SHFL"));
    }
  }
  EXPECT_EQ(simt_kernels, 4) << "the forward and the backward kernel of heads of 64, for each of two architectures";
}

// The tile a head of `describe`'s text takes: "heads of 96 (padded to 128)"
// 128, "heads of 64" 64; 0 where `label` is absent.
static int tile_of(const std::string& path, const std::string& label) {
  const size_t at = path.find(label);
  if (at == std::string::npos) return 0;
  const char* size = path.c_str() + at + label.size();
  char* end = nullptr;
  const int own = int(std::strtol(size, &end, 10));
  const std::string padded = " (padded to ";
  return path.compare(size_t(end - path.c_str()), padded.size(), padded) == 0
             ? int(std::strtol(end + padded.size(), nullptr, 10))
             : own;
}

// Attention trained at 4096 tokens for sm_90a (issue #39): bf16 heads of 64
// causal, f16 heads of 128, bf16 heads of 96 (padded to 128), bf16 heads of
// 64 with values of 128, f16 heads of 32 (padded to 64), bf16 heads of 256
// causal, f16 heads of 192 (padded to 256 in the backward). At least 95% of
// the attention's FLOPs (the forward's two products and the four gradient
// ones) in kernels whose own SASS has HGMMA (wgmma), UTMALDG (TMA) and SYNCS
// (the mbarriers), no HMMA and no local memory, no spills; ptxas serialises
// no wgmma (C7509 to C7520, "Potential Performance Loss"), injects no
// wgmma.fence (C7519: each batch writes its own) and ignores no setmaxnreg
// (C7508). The backward kernel's two step loops (a key block's,
// a query block's) issue D / 16 wgmmas of a step's columns (64; 32 over
// heads of 128) for s (s^T) and DV / 16 for dp (dp^T), then a step's / 16
// register-A ones for each of dv and dk, or for dq: 2 (D + DV) / 16 + 12 in
// all (+ 6 over heads of 128), the loops unrolled no further.
TEST(Toolchains, FlashAttentionTrainingOnSm90aHasTmaAndWgmma) {
  if (std::string(CUDAGEN_CUOBJDUMP).empty())
    GTEST_SKIP() << "no cuobjdump: configure with the SASS part (scripts/dev.sh installs nvidia-cuda-cuobjdump)";
  GraphBuilder b("flash_training_sm90a");
  add_flash_training(b, DType::bf16, 4096, 64, true);
  add_flash_training(b, DType::f16, 4096, 128, false);
  add_flash_training(b, DType::bf16, 4096, 96, true);
  add_flash_training(b, DType::bf16, 4096, 64, true, 128);
  add_flash_training(b, DType::f16, 4096, 32, false);
  add_flash_training(b, DType::bf16, 4096, 256, true);
  add_flash_training(b, DType::f16, 4096, 192, false);
  CompileOptions options;
  options.emit.arch = "sm_90a";
  const Compiled c = compile(load_program(std::move(b).graph(), {}), options);
  const cudagen::testing::KernelReport report = cudagen::testing::compile_and_report(c.emitted.cuda_source, "sm_90a");
  EXPECT_EQ(report.ptxas_log.find("Potential Performance Loss"), std::string::npos) << report.ptxas_log;
  EXPECT_EQ(report.ptxas_log.find("C7508"), std::string::npos) << report.ptxas_log;
  EXPECT_EQ(report.ptxas_log.find("C7519"), std::string::npos) << "a wgmma.fence the source left out\n" << report.ptxas_log;
  auto count = [](const std::map<std::string, int>& m, const char* op) { return m.count(op) ? m.at(op) : 0; };
  int64_t total = 0, hopper = 0;
  for (size_t t = 0; t < c.program.tasks.size(); ++t)
    if (c.program.tasks[t].op->pattern == PatternKind::matmul) total += task_flops(c.program, int(t)).value_or(0);
  int backward_kernels = 0;
  for (const EmittedKernel& k : c.emitted.kernels) {
    if (k.matmul_path.find("flash attention") == std::string::npos) continue;
    ASSERT_TRUE(report.sass.count(k.name) && report.resources.count(k.name)) << k.name;
    std::map<std::string, int> ops;
    for (const cudagen::testing::SassInstruction& instruction : report.sass.at(k.name)) ++ops[instruction.opcode];
    const bool on_hopper = count(ops, "HGMMA") > 0 && count(ops, "UTMALDG") > 0 && count(ops, "SYNCS") > 0 &&
                           count(ops, "HMMA") == 0 && count(ops, "LDL") + count(ops, "STL") == 0;
    EXPECT_TRUE(on_hopper) << k.name << ": " << k.matmul_path;
    EXPECT_EQ(report.resources.at(k.name).spill_bytes, 0) << k.name;
    EXPECT_EQ(report.resources.at(k.name).stack_bytes, 0) << k.name;
    if (k.matmul_path.find("flash attention backward") != std::string::npos) {
      ++backward_kernels;
      // Both steps take D / 16 + DV / 16 (s, dp), the key block's 2 x (a
      // step's rows / 16) (dv, dk) and the query block's a step's rows / 16
      // (dq) HGMMA, D and DV the tiles.
      const int tile_d = tile_of(k.matmul_path, "heads of "), tile_dv = tile_of(k.matmul_path, "(values ");
      const int step = std::max(tile_d, tile_dv) > 128 ? 32 : 64;
      EXPECT_NE(k.matmul_path.find(fmt::format("{} rows a step", step)), std::string::npos) << k.matmul_path;
      const std::vector<cudagen::testing::SassInstruction>& sass = report.sass.at(k.name);
      int loop_hgmma = 0;
      for (const cudagen::testing::SassInstruction& instruction : sass) loop_hgmma += instruction.opcode == "HGMMA";
      EXPECT_EQ(loop_hgmma, 2 * ((tile_d + (tile_dv > 0 ? tile_dv : tile_d)) / 16) + 3 * (step / 16))
          << k.name << ": a key block's and a query block's step";
      std::printf("  %s: %d registers, %d HGMMA, %d UTMALDG, %d SYNCS\n", k.name.c_str(),
                  report.resources.at(k.name).registers, count(ops, "HGMMA"), count(ops, "UTMALDG"), count(ops, "SYNCS"));
    }
    int64_t flops = 0;
    for (int t : k.tasks)
      if (c.program.tasks[size_t(t)].op->pattern == PatternKind::matmul) flops += task_flops(c.program, t).value_or(0);
    if (on_hopper) hopper += flops;
  }
  EXPECT_EQ(backward_kernels, 7);
  ASSERT_GT(total, 0);
  std::printf("  attention FLOPs on the Hopper kernels: %.1f%%\n", 100.0 * double(hopper) / double(total));
  EXPECT_GE(double(hopper), 0.95 * double(total));
}

// The f32 SIMT mainloop in generated kernels, both tiles (128 x 128 from a
// wave of them, 64 x 64 below) and every operand layout: no spills and no
// stack on sm_80 and sm_90, and in its k-loop at least 16 FFMA per shared
// load (8 x 8 outputs from four 16-byte loads a k; the portable tile has
// about one).
TEST(Toolchains, SimtMatmulKernelsFeedSixteenFmasPerSharedLoad) {
  GraphBuilder b("simt");
  const Storage ext = Storage::external;
  const DType f32 = DType::f32;
  for (int64_t rows : {4096, 256})
    for (int layout = 0; layout < 4; ++layout) {
      const bool ta = layout & 1, tb = layout & 2;
      const std::string id = fmt::format("mm_{}_{}", rows, layout);
      b.task(id, "matmul")
          .tensor("a", f32, ta ? Shape{768, rows} : Shape{rows, 768}, ext)
          .tensor("b", f32, tb ? Shape{3072, 768} : Shape{768, 3072}, ext)
          .tensor("out", f32, {rows, 3072}, ext)
          .arg("trans_a", ta)
          .arg("trans_b", tb);
    }
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  int large = 0, small = 0;
  for (const EmittedKernel& k : c.emitted.kernels) {
    ASSERT_EQ(k.mainloop, MatmulMainloop::simt) << k.name << ": " << k.matmul_path;
    large += k.matmul_path.find("128 x 128 x 8 tiles") != std::string::npos;
    small += k.matmul_path.find("64 x 64 x 8 tiles") != std::string::npos;
  }
  EXPECT_EQ(large, 4);
  EXPECT_EQ(small, 4);
  const bool disassemble = !std::string(CUDAGEN_CUOBJDUMP).empty();
  std::map<std::string, cudagen::testing::KernelReport> reports;
  for (const char* arch : {"sm_80", "sm_90"}) {
    reports[arch] = cudagen::testing::compile_and_report(c.emitted.cuda_source, arch, disassemble);
    for (const auto& [kernel, r] : reports[arch].resources) {
      EXPECT_EQ(r.spill_bytes, 0) << kernel << " on " << arch;
      EXPECT_EQ(r.stack_bytes, 0) << kernel << " on " << arch;
    }
  }
  if (!disassemble)
    GTEST_SKIP() << "no cuobjdump: configure with the SASS part (scripts/dev.sh installs nvidia-cuda-cuobjdump)";
  for (const auto& [arch, report] : reports)
    for (const auto& [kernel, instructions] : report.sass) {
      const std::map<std::string, int> loop = cudagen::testing::sass_loop(instructions, "FFMA");
      auto count = [&](const char* op) { return loop.count(op) ? loop.at(op) : 0; };
      EXPECT_GE(count("FFMA"), 512) << kernel << " on " << arch << ": a k-tile's 8 x 8 x 8 FMAs in one loop body";
      EXPECT_GE(count("FFMA"), 16 * count("LDS")) << kernel << " on " << arch << ": " << count("LDS") << " LDS";
      EXPECT_EQ(count("LDL") + count("STL"), 0) << kernel << " on " << arch;
    }
}

// Issue #35's measure of the mainloop's reach: in a GPT-2-small decoder
// block (bench/decoder_graph.py: dim 768, 12 heads, MLP 3072) at B8 x T128
// in bf16, at least 95% of the matmul FLOPs run in kernels whose own SASS
// has LDGSTS, LDSM and HMMA and no local memory, for sm_80 and sm_90. (The
// rest is the attention kernel's two products, on its own tile until
// tiled attention lands.)
// A GPT-2-small decoder block (bench/decoder_graph.py: dim 768, 12 heads,
// MLP 3072) at B8 x T128 in bf16, compiled with `options`.
static Compiled decoder_block_b8_t128(const CompileOptions& options) {
  const std::string dir = (std::filesystem::temp_directory_path() / fmt::format("cudagen_decoder_{}", getpid())).string();
  std::filesystem::create_directories(dir);
  const std::string graph = dir + "/decoder.json";
  const std::string command = fmt::format(
      "/usr/bin/python3 {}/bench/decoder_graph.py --layers 1 --batch 8 --tokens 128 --dtype bf16 -o {}",
      CUDAGEN_SOURCE_DIR, graph);
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  Compiled c = compile(load_program(read_graph(read_text_file(graph)), {}), options);
  std::filesystem::remove_all(dir);
  return c;
}

// The FLOPs of kernel k's matmul tasks.
static int64_t matmul_flops(const Compiled& c, const EmittedKernel& k) {
  int64_t flops = 0;
  for (int t : k.tasks)
    if (c.program.tasks[size_t(t)].op->pattern == PatternKind::matmul) flops += task_flops(c.program, t).value_or(0);
  return flops;
}

TEST(Toolchains, DecoderBlockRunsItsMatmulFlopsOnThePipelinedMainloop) {
  if (std::string(CUDAGEN_CUOBJDUMP).empty())
    GTEST_SKIP() << "no cuobjdump: configure with the SASS part (scripts/dev.sh installs nvidia-cuda-cuobjdump)";
  const Compiled c = decoder_block_b8_t128({});
  for (const char* arch : {"sm_80", "sm_90"}) {
    const auto sass = cudagen::testing::sass_opcodes(c.emitted.cuda_source, arch);
    int64_t total = 0, pipelined = 0;
    std::vector<std::string> kernels;
    for (const EmittedKernel& k : c.emitted.kernels) {
      const int64_t flops = matmul_flops(c, k);
      if (flops == 0) continue;
      ASSERT_TRUE(sass.count(k.name)) << k.name << " on " << arch;
      const std::map<std::string, int>& ops = sass.at(k.name);
      auto count = [&](const char* op) { return ops.count(op) ? ops.at(op) : 0; };
      const bool on_mainloop = count("LDGSTS") > 0 && count("LDSM") > 0 && count("HMMA") > 0 && count("LDL") + count("STL") == 0;
      total += flops;
      if (on_mainloop) pipelined += flops;
      kernels.push_back(fmt::format("{} {:.3f} GFLOP {}", k.name, flops * 1e-9, on_mainloop ? "pipelined" : "other"));
    }
    ASSERT_GT(total, 14'000'000'000) << "the block's six projections and attention";
    EXPECT_GE(double(pipelined), 0.95 * double(total)) << arch << ":\n" << fmt::format("{}", fmt::join(kernels, "\n"));
  }
}

// Issue #38's measure: the same block compiled for sm_90a runs at least 95%
// of its matmul FLOPs in kernels whose own SASS has HGMMA (wgmma), UTMALDG
// (TMA) and SYNCS (the mbarriers), no HMMA and no local memory, whose k-loop
// issues its wgmmas without waiting between them (one WARPGROUP.ARRIVE and
// one DEPBAR a k-tile), and for which ptxas reports no wgmma serialised
// (C7509 to C7520, "Potential Performance Loss") and no setmaxnreg ignored
// (C7508). Flash attention's two products run on its own Hopper kernel,
// its loop checked by FlashAttentionOnSm90aHasTmaAndWgmma.
TEST(Toolchains, DecoderBlockRunsItsMatmulFlopsOnTheHopperMainloop) {
  if (std::string(CUDAGEN_CUOBJDUMP).empty())
    GTEST_SKIP() << "no cuobjdump: configure with the SASS part (scripts/dev.sh installs nvidia-cuda-cuobjdump)";
  CompileOptions options;
  options.emit.arch = "sm_90a";
  const Compiled c = decoder_block_b8_t128(options);
  const cudagen::testing::KernelReport report = cudagen::testing::compile_and_report(c.emitted.cuda_source, "sm_90a");
  const std::string& log = report.ptxas_log;
  EXPECT_EQ(log.find("Potential Performance Loss"), std::string::npos) << log;
  EXPECT_EQ(log.find("C7508"), std::string::npos) << log;
  const auto& listing = report.sass;
  int64_t total = 0, hopper = 0;
  std::vector<std::string> kernels;
  for (const EmittedKernel& k : c.emitted.kernels) {
    const int64_t flops = matmul_flops(c, k);
    if (flops == 0) continue;
    ASSERT_TRUE(listing.count(k.name)) << k.name;
    std::map<std::string, int> ops;
    for (const cudagen::testing::SassInstruction& i : listing.at(k.name)) ++ops[i.opcode];
    auto count = [&](const std::map<std::string, int>& m, const char* op) { return m.count(op) ? m.at(op) : 0; };
    const bool on_hopper = count(ops, "HGMMA") > 0 && count(ops, "UTMALDG") > 0 && count(ops, "SYNCS") > 0 &&
                           count(ops, "HMMA") == 0 && count(ops, "LDL") + count(ops, "STL") == 0;
    if (on_hopper && k.mainloop == MatmulMainloop::hopper) {  // (flash attention's loop: the test above)
      const std::map<std::string, int> loop = cudagen::testing::sass_loop(listing.at(k.name), "HGMMA");
      EXPECT_EQ(count(loop, "HGMMA"), 4) << k.name << ": a k-tile's four m64n128k16";
      EXPECT_EQ(count(loop, "WARPGROUP"), 2) << k.name << ": one fence and one wait a k-tile, no wgmma serialised";
    }
    total += flops;
    if (on_hopper) hopper += flops;
    kernels.push_back(fmt::format("{} {:.3f} GFLOP {}", k.name, flops * 1e-9, on_hopper ? "Hopper" : "other"));
  }
  ASSERT_GT(total, 14'000'000'000) << "the block's six projections and attention";
  EXPECT_GE(double(hopper), 0.95 * double(total)) << fmt::format("{}", fmt::join(kernels, "\n"));
}

// One row per task of `marks` (a kernel each, in order): its tiles, the
// registers ptxas gives it on `arch`, its shared memory, and the SASS of its
// k-loop (the loop with the most `marker` instructions) per k-block, a
// k-block being the mark's count of `marker`s.
static std::string golden_rows(const Compiled& c, const std::vector<std::pair<std::string, int>>& marks,
                               const char* arch, const char* marker, const char* path) {
  const cudagen::testing::KernelReport report = cudagen::testing::compile_and_report(c.emitted.cuda_source, arch);
  const auto& resources = report.resources;
  const auto& listing = report.sass;
  std::string table;
  for (size_t i = 0; i < marks.size(); ++i) {
    const EmittedKernel& k = c.emitted.kernels[i];
    EXPECT_NE(k.matmul_path.find(path), std::string::npos) << k.name << ": " << k.matmul_path;
    if (!listing.count(k.name)) {
      ADD_FAILURE() << k.name << " has no SASS on " << arch;
      continue;
    }
    const std::map<std::string, int> loop = cudagen::testing::sass_loop(listing.at(k.name), marker);
    const int found = loop.count(marker) ? loop.at(marker) : 0;
    if (found == 0 || found % marks[i].second != 0) {
      ADD_FAILURE() << k.name << " on " << arch << ": " << found << " " << marker << " in its k-loop";
      continue;
    }
    const int k_blocks = found / marks[i].second;
    int total = 0;
    std::string ops;
    for (const auto& [op, n] : loop) {
      total += n;
      ops += fmt::format(" {} {:g}", op, double(n) / k_blocks);
    }
    const std::string tiles = k.matmul_path.substr(k.matmul_path.find("), ") + 3);
    table += fmt::format("{} | {} | {} | {} | {} | total {:g}:{}\n", k.name, tiles, arch,
                         resources.count(k.name) ? resources.at(k.name).registers : -1, k.smem_bytes,
                         double(total) / k_blocks, ops);
  }
  return table;
}

// `table` against tests/golden/`name` (UPDATE_GOLDEN=1 rewrites it).
static void expect_golden(const std::string& name, const std::string& table) {
  const std::string golden = std::string(CUDAGEN_SOURCE_DIR) + "/tests/golden/" + name;
  if (std::getenv("UPDATE_GOLDEN") != nullptr) {
    write_file_atomic(golden, table);
    GTEST_SKIP() << "rewrote " << golden;
  }
  ASSERT_TRUE(std::filesystem::exists(golden)) << golden << " is missing: run with UPDATE_GOLDEN=1";
  EXPECT_EQ(read_text_file(golden), table)
      << "the mainloop's registers, shared memory or instructions changed; if that is meant (and the GPU figures in "
         "bench/RESULTS.md agree), rerun with UPDATE_GOLDEN=1 and commit the diff";
}

// A golden table of the pipelined mainloop (issue #35): per tile config the
// emitter picks, operand layout and architecture, the registers ptxas gives
// the generated kernel, its shared memory, and the SASS instructions of its
// k-loop per k-block (the loop's count over the k-blocks it holds, found by
// its HMMA count: BK / 16 x MI x NI per k-block, BK / 8 for TF32), checked
// in at tests/golden/gemm_mainloop.txt, so that a change to the mainloop or
// the toolkit shows as a diff. bf16 in both B layouts, f32 as TF32 in both A
// layouts (M-contiguous: 32-bit shared loads). UPDATE_GOLDEN=1 rewrites the
// file.
TEST(Toolchains, PipelinedMainloopMatchesItsGoldenInstructionTable) {
  if (std::string(CUDAGEN_CUOBJDUMP).empty())
    GTEST_SKIP() << "no cuobjdump: configure with the SASS part (scripts/dev.sh installs nvidia-cuda-cuobjdump)";
  GraphBuilder b("golden");
  const Storage ext = Storage::external;
  struct Row {
    std::string task;
    int hmma_per_k_block;  // per warp: BK / 16 x (WM / 16) x (WN / 8)
  };
  std::vector<Row> rows;
  for (int64_t m : {4096, 64})
    for (bool trans_b : {false, true}) {
      const std::string id = "mm_" + std::to_string(m) + (trans_b ? "_nt" : "_nn");
      const std::vector<int64_t> b_shape = trans_b ? std::vector<int64_t>{3072, 768} : std::vector<int64_t>{768, 3072};
      b.task(id, "matmul")
          .tensor("a", DType::bf16, {m, 768}, ext)
          .tensor("b", DType::bf16, b_shape, ext)
          .tensor("out", DType::bf16, {m, 3072}, ext)
          .arg("trans_b", trans_b);
      rows.push_back({id, m == 4096 ? 64 / 16 * (64 / 16) * (64 / 8) : 32 / 16 * (32 / 16) * (32 / 8)});
    }
  for (int64_t m : {4096, 64})
    for (bool trans_a : {false, true}) {
      const std::string id = "tf32_" + std::to_string(m) + (trans_a ? "_tn" : "_nn");
      const std::vector<int64_t> a_shape = trans_a ? std::vector<int64_t>{768, m} : std::vector<int64_t>{m, 768};
      b.task(id, "matmul")
          .tensor("a", DType::f32, a_shape, ext)
          .tensor("b", DType::f32, {768, 3072}, ext)
          .tensor("out", DType::f32, {m, 3072}, ext)
          .arg("trans_a", trans_a);
      // 128 x 128 x 32 on 2 x 4 warps of 64 x 32; 64 x 64 x 16 on 2 x 2 of 32 x 32.
      rows.push_back({id, m == 4096 ? 32 / 8 * (64 / 16) * (32 / 8) : 16 / 8 * (32 / 16) * (32 / 8)});
    }
  CompileOptions options;
  options.emit.allow_tf32 = true;
  Compiled c = compile(load_program(std::move(b).graph(), {}), options);
  std::string table =
      "# The pipelined mainloop's generated kernels (Toolchains.PipelinedMainloopMatchesItsGoldenInstructionTable):\n"
      "# kernel | tiles | arch | registers | shared bytes | SASS per k-block of the k-loop\n";
  std::vector<std::pair<std::string, int>> marks;
  for (const Row& r : rows) marks.emplace_back(r.task, r.hmma_per_k_block);
  for (const char* arch : {"sm_80", "sm_90"}) table += golden_rows(c, marks, arch, "HMMA", "pipelined");
  expect_golden("gemm_mainloop.txt", table);
}

// The same table for the Hopper mainloop (issue #38), for sm_90a: the tile
// configs the generator picks (128 x 192 and 128 x 128 with two consumer
// warpgroups, 64 x 128 with one) and both B layouts, per k-tile (four
// HGMMA); tests/golden/gemm_sm90_mainloop.txt.
TEST(Toolchains, HopperMainloopMatchesItsGoldenInstructionTable) {
  if (std::string(CUDAGEN_CUOBJDUMP).empty())
    GTEST_SKIP() << "no cuobjdump: configure with the SASS part (scripts/dev.sh installs nvidia-cuda-cuobjdump)";
  GraphBuilder b("golden_sm90");
  std::vector<std::pair<std::string, int>> marks;
  // 4096 x 768 over 3072: 128 x 192 tiles (128 of them, one wave); 1024 x 768 over 768: 64 x 128
  // (a decoder's projection at B8 x T128; over 3072 the pipelined mainloop would split K instead).
  for (const auto& [m, k] : {std::pair<int64_t, int64_t>{4096, 3072}, {1024, 768}})
    for (bool trans_b : {false, true}) {
      const std::string id = "mm_" + std::to_string(m) + (trans_b ? "_nt" : "_nn");
      const std::vector<int64_t> b_shape = trans_b ? std::vector<int64_t>{768, k} : std::vector<int64_t>{k, 768};
      b.task(id, "matmul")
          .tensor("a", DType::bf16, {m, k}, Storage::external)
          .tensor("b", DType::bf16, b_shape, Storage::external)
          .tensor("out", DType::bf16, {m, 768}, Storage::external)
          .arg("trans_b", trans_b);
      marks.emplace_back(id, 4);
    }
  // 4096^3: 128 x 128 tiles (1024, eight waves; 128 x 192's 704 take six, more to compute).
  b.task("mm_square_nn", "matmul")
      .tensor("a", DType::bf16, {4096, 4096}, Storage::external)
      .tensor("b", DType::bf16, {4096, 4096}, Storage::external)
      .tensor("out", DType::bf16, {4096, 4096}, Storage::external);
  marks.emplace_back("mm_square_nn", 4);
  CompileOptions options;
  options.emit.arch = "sm_90a";
  const Compiled c = compile(load_program(std::move(b).graph(), {}), options);
  expect_golden("gemm_sm90_mainloop.txt",
                "# The Hopper mainloop's generated kernels (Toolchains.HopperMainloopMatchesItsGoldenInstructionTable):\n"
                "# kernel | tiles | arch | registers | shared bytes | SASS per k-tile of the k-loop\n" +
                    golden_rows(c, marks, "sm_90a", "HGMMA", "Hopper"));
}
