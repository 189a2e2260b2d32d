// The `cudagen` executable: exit codes, where messages go, and that nothing
// is written on failure.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "json.h"
#include "test_util.h"

using namespace cudagen::testing;
namespace fs = std::filesystem;

namespace {

struct CliResult {
  int status;
  std::string out;
  std::string err;
};

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("cudagen_cli_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // `env`: assignments for the command's environment ("A=1 B=2").
  CliResult run(const std::string& args, const std::string& env = "") {
    std::string out = (dir_ / "stdout").string(), err = (dir_ / "stderr").string();
    std::string cmd = (env.empty() ? "" : "env " + env + " ") + std::string(CUDAGEN_EXE) + " " + args + " >" + out + " 2>" + err;
    int raw = std::system(cmd.c_str());
    return CliResult{WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, cudagen::read_text_file(out), cudagen::read_text_file(err)};
  }

  std::string write(const std::string& name, const std::string& text) {
    std::string path = (dir_ / name).string();
    std::ofstream(path) << text;
    return path;
  }

  fs::path dir_;
};

}  // namespace

TEST_F(Cli, ValidateOk) {
  CliResult r = run("validate " + source_path("examples/mlp_train.json"));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("ok: 21 tasks"), std::string::npos) << r.out;
  EXPECT_EQ(r.err, "");
}

TEST_F(Cli, BadInputExitsOneWithErrorsOnStderr) {
  std::string path = write("bad.json", graph_of(R"({"id": "a", "op": "matmull"})"));
  CliResult r = run("validate " + path);
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find(path + ":1:58: error: task 'a' (/tasks/0/op): unknown op 'matmull'"), std::string::npos) << r.err;
}

TEST_F(Cli, UsageErrorsExitTwo) {
  EXPECT_EQ(run("").status, 2);
  EXPECT_EQ(run("frobnicate").status, 2);
  EXPECT_EQ(run("validate").status, 2);
  EXPECT_EQ(run("validate /no/such/file.json").status, 2);
  EXPECT_EQ(run("describe --error-limit notanumber x.json").status, 2);
  // --arch names the form it takes.
  const CliResult arch = run("compile " + source_path("examples/mlp_forward.json") + " --arch sm90");
  EXPECT_EQ(arch.status, 2);
  EXPECT_NE(arch.err.find("'sm90' is not an architecture: write sm_ and the compute capability's digits"),
            std::string::npos)
      << arch.err;
}

TEST_F(Cli, HelpAndVersion) {
  CliResult r = run("--help");
  EXPECT_EQ(r.status, 0);
  for (const char* word : {"validate", "describe", "format", "ops", "Exit status"})
    EXPECT_NE(r.out.find(word), std::string::npos) << word;
  r = run("describe --help");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("--max-tensor-bytes"), std::string::npos);
  r = run("--version");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("cudagen 0."), std::string::npos) << r.out;
}

TEST_F(Cli, DescribeShowsPhasesAndStorage) {
  CliResult r = run("describe " + source_path("examples/mlp_train.json"));
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* want : {"graph mlp_train: 21 tasks, 19 buffers", "backward        7", "update          4  sgd x4",
                           "persistent          4          38440", "act1.out"})
    EXPECT_NE(r.out.find(want), std::string::npos) << "missing: " << want << "\n" << r.out;
}

TEST_F(Cli, DescribeShowsKernelsAndLaunches) {
  CliResult r = run("describe " + source_path("examples/transformer_block.json"));
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* want : {"kernels: 11 kernels in 4 launches", "L0    k7_w_down", "[matmul_epilogue]",
                           "L1    k8_q                         forward   ln1 (prologue), q, q_heads, k, k_heads, v, v_heads, "
                           "scores, probs, context, merged  [norm_prologue, attention_projection, attention]",
                           "not in the launch before (rule horizontal)", "it reads 'merged.out', which k8_q writes",
                           "bytes (declared)", "kept in kernels' registers or shared memory take none"})
    EXPECT_NE(r.out.find(want), std::string::npos) << "missing: " << want << "\n" << r.out;
  r = run("describe --no-fuse-rule horizontal --no-fuse-rule attention_projection " +
          source_path("examples/transformer_block.json"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("kernels: 14 kernels in 14 launches"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("L8    k8_q                         forward   ln1 (prologue), q, q_heads  "
                       "[norm_prologue, matmul_epilogue]"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("rule horizontal is off (--no-fuse-rule)"), std::string::npos) << r.out;
}

TEST_F(Cli, DescribeMegakernelPrintsTheScheduleAndCompileTakesItsOptions) {
  CliResult r = run("describe --megakernel --megakernel-blocks 3 " + source_path("examples/mlp_train.json"));
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* want : {"megakernel schedule:", "forward phase: one megakernel of 3 blocks x 256 threads",
                           "critical path", "blocks idle", "events (triggers per launch):", "block   2 (",
                           "after it (the megakernel's event counters)"})
    EXPECT_NE(r.out.find(want), std::string::npos) << "missing: " << want << "\n" << r.out;

  std::string cu = (dir_ / "mk.cu").string(), manifest = (dir_ / "mk.json").string();
  r = run("compile --megakernel --megakernel-blocks 7 --megakernel-watchdog-ms 500 " +
          source_path("examples/mlp_forward.json") + " -o " + cu + " --manifest " + manifest);
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string source = cudagen::read_text_file(cu);
  EXPECT_NE(source.find("CG_KERNEL void __launch_bounds__(256) megakernel_forward(unsigned char* arena) {"),
            std::string::npos);
  EXPECT_NE(source.find("if (!cg_megakernel_wait(state, events, task, q, launch, 500000000ull)) break;"),
            std::string::npos);
  EXPECT_NE(cudagen::read_text_file(manifest).find("\"cooperative\": true"), std::string::npos);
  r = run("compile --megakernel --megakernel-blocks 70000 " + source_path("examples/mlp_forward.json"));
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_NE(r.err.find("--megakernel-blocks"), std::string::npos) << r.err;

  // In the host emulation a device-sized count (132 blocks of fibers) gives way to a few blocks.
  r = run("run --emulate --megakernel --work-dir " + (dir_ / "work").string() + " " +
          source_path("examples/mlp_forward.json"));
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("megakernel: 8 blocks in the host emulation (--megakernel-blocks sets it)"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("probs.out"), std::string::npos) << r.out;
}

TEST_F(Cli, FormatWritesAtomicallyAndNothingOnFailure) {
  std::string out = (dir_ / "out.json").string();
  CliResult r = run("format " + source_path("examples/transformer_block.json") + " -o " + out);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(cudagen::read_text_file(out), cudagen::read_text_file(source_path("examples/transformer_block.json")));

  std::string missing = (dir_ / "never.json").string();
  r = run("format " + write("broken.json", "{\"format\": ") + " -o " + missing);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("malformed JSON"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(missing));
  for (const auto& entry : fs::directory_iterator(dir_))
    EXPECT_EQ(entry.path().string().find(".tmp."), std::string::npos) << "temporary file left: " << entry.path();
}

TEST_F(Cli, CompileWritesTheCudaFileAndManifest) {
  std::string cu = (dir_ / "mlp.cu").string(), manifest = (dir_ / "mlp.json").string();
  CliResult r = run("compile " + source_path("examples/mlp_forward.json") + " -o " + cu + " --manifest " + manifest);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(cudagen::read_text_file(cu).find("extern \"C\" int cudagen_forward(unsigned char* arena"), std::string::npos);
  EXPECT_NE(cudagen::read_text_file(manifest).find("\"format\": \"cudagen.manifest/1\""), std::string::npos);
}

TEST_F(Cli, CompileWritesTheAheadOfTimeHeaderUnderAPrefix) {
  std::string cu = (dir_ / "mlp.cu").string(), header = (dir_ / "mlp.h").string();
  CliResult r = run("compile " + source_path("examples/mlp_forward.json") + " -o " + cu + " --header " + header +
                    " --prefix mlp");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(cudagen::read_text_file(header).find("int mlp_forward(unsigned char* arena, CUstream_st* stream);"),
            std::string::npos);
  EXPECT_NE(cudagen::read_text_file(cu).find("extern \"C\" int mlp_forward(unsigned char* arena"), std::string::npos);

  CliResult bad = run("compile " + source_path("examples/mlp_forward.json") + " -o " + (dir_ / "x.cu").string() +
                      " --prefix my-mlp");
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.err.find("--prefix: not a C identifier: '-' cannot be part of a C identifier"), std::string::npos)
      << bad.err;
  EXPECT_FALSE(fs::exists(dir_ / "x.cu"));
}

// A user's reduction template indexes, but the emitter's reduction skeletons
// are per op (the generic one comes with fusion, issue #6): compile says so
// and writes nothing.
TEST_F(Cli, CompileWritesNothingWhenTheEmitterLacksAnOpsSkeleton) {
  fs::create_directories(dir_ / "mine");
  write("mine/l1.cuh", R"(template <typename Load>
CG_OP("row_l1", "pattern: reduction", "types: T = f32", "tensor: x input T", "tensor: out output T",
      "shape: x:[...S, N] -> out:[...S]", "smem: 128", "doc: sum of |x| over the last axis")
CG_DEVICE float cg_row_l1(Load load, int n, float* scratch) {
  float s = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) s += fabsf(load(j));
  return cg_block_sum(s, scratch);
}
)");
  std::string cu = (dir_ / "t.cu").string(), manifest = (dir_ / "t.json").string();
  std::string graph = write("l1.json", graph_of(R"({"id": "l", "op": "row_l1",
      "tensors": {"x": {"dtype": "f32", "shape": [4, 8], "storage": "external"},
                  "out": {"dtype": "f32", "shape": [4], "storage": "external"}}})"));
  CliResult r = run("compile " + graph + " --templates " + (dir_ / "mine").string() + " -o " + cu + " --manifest " + manifest);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("task 'l' (/tasks/0): the emitter has no reduction skeleton for op 'row_l1' yet (its template is "
                       "cg_row_l1)"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(cu));
  EXPECT_FALSE(fs::exists(manifest));
}

TEST_F(Cli, DumpAfterEachPass) {
  std::string graph = source_path("examples/mlp_forward.json");
  EXPECT_NE(run("compile " + graph + " --dump-after validate").out.find("graph mlp_forward: 6 tasks"), std::string::npos);
  EXPECT_NE(run("compile " + graph + " --dump-after schedule").out.find("forward   act1"), std::string::npos);
  EXPECT_NE(run("compile " + graph + " --dump-after fuse").out.find("fc1, bias1, act1, fc2, bias2  [matmul_chain]"), std::string::npos);
  // Then each kernel's IR, as a tree: the chain's second product reads the first's activation in the kernel.
  EXPECT_NE(run("compile " + graph + " --dump-after fuse").out.find("    second product fc2 (matmul)\n      a <- act1:"),
            std::string::npos);
  EXPECT_NE(run("compile " + graph + " --dump-after plan").out.find("lower bound"), std::string::npos);
  EXPECT_NE(run("compile " + graph + " --dump-after emit").out.find("// ---- kernels ----"), std::string::npos);
  EXPECT_EQ(run("compile " + graph + " --dump-after nonsense").status, 2);
}

// Without a driver (here made certain by pointing the loader at a library
// that does not exist), `run` says so and runs in the emulation; `run --gpu`
// fails with a message that offers --emulate.
TEST_F(Cli, RunWithoutADriverFallsBackToTheEmulationAndSaysSo) {
  const std::string no_driver = "CUDAGEN_CUDA_DRIVER=" + (dir_ / "no-libcuda.so.1").string();
  const std::string graph = source_path("examples/mlp_forward.json");
  CliResult r = run("run " + graph + " --work-dir " + (dir_ / "work").string(), no_driver);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("running in the host emulation: no CUDA driver found: cannot load"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("probs.out"), std::string::npos) << r.out;
  CliResult gpu = run("run --gpu " + graph, no_driver);
  EXPECT_EQ(gpu.status, 1);
  EXPECT_NE(gpu.err.find("no CUDA driver found"), std::string::npos) << gpu.err;
  EXPECT_NE(gpu.err.find("--emulate"), std::string::npos) << gpu.err;
  EXPECT_EQ(run("run --gpu --emulate " + graph).status, 1);
}

TEST_F(Cli, RunWithProfileWritesTheTableTheJsonAndTheTrace) {
  const std::string no_driver = "CUDAGEN_CUDA_DRIVER=" + (dir_ / "no-libcuda.so.1").string();
  const std::string graph = source_path("examples/mlp_forward.json");
  const std::string profile = (dir_ / "mlp.json").string();
  CliResult r = run("run " + graph + " --emulate --work-dir " + (dir_ / "work").string() + " --profile " + profile, no_driver);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("bytes counted by the emulator"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("unfused:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("k0_fc1 (fc1, bias1, act1, fc2, bias2)"), std::string::npos) << r.out;
  const cudagen::JsonValue json = cudagen::parse_json(cudagen::read_text_file(profile));
  EXPECT_EQ(json.find("format")->as_string(), "cudagen.profile/1");
  EXPECT_EQ(json.find("backend")->as_string(), "emulation");
  EXPECT_GT(json.find("phases")->items().at(0).find("unfused_bytes")->as_int(),
            json.find("phases")->items().at(0).find("bytes")->as_int());
  const cudagen::JsonValue trace = cudagen::parse_json(cudagen::read_text_file((dir_ / "mlp.trace.json").string()));
  EXPECT_NE(trace.find("traceEvents"), nullptr);

  // A folder that does not exist is a usage error before anything runs.
  CliResult bad = run("run " + graph + " --emulate --profile " + (dir_ / "missing" / "p.json").string(), no_driver);
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.err.find("no writable folder"), std::string::npos) << bad.err;
}

TEST_F(Cli, RunTimeArgumentsTakeAValueForTheRun) {
  std::string graph = write("scaled.json", graph_of(R"({"id": "s", "op": "affine",
      "tensors": {"x": {"dtype": "f32", "shape": [8], "storage": "external"},
                  "out": {"dtype": "f32", "shape": [8], "storage": "external"}},
      "args": {"scale": {"value": 2.0, "runtime": true}, "shift": 1.0}})"));
  EXPECT_NE(run("compile " + graph + " --dump-after plan").out.find("s.scale"), std::string::npos);
  CliResult ok = run("run --emulate " + graph + " --arg s.scale=-3.5 --work-dir " + (dir_ / "work").string());
  EXPECT_EQ(ok.status, 0) << ok.out << ok.err;
  CliResult unknown = run("run --emulate " + graph + " --arg s.shift=2 --work-dir " + (dir_ / "work").string());
  EXPECT_EQ(unknown.status, 1);
  EXPECT_NE(unknown.err.find("no run-time argument 's.shift' in this graph; it has: s.scale"), std::string::npos)
      << unknown.err;
  CliResult malformed = run("run --emulate " + graph + " --arg s.scale");
  EXPECT_EQ(malformed.status, 1);
  EXPECT_NE(malformed.err.find("write TASK.ARG=VALUE"), std::string::npos) << malformed.err;
}

TEST_F(Cli, BudgetErrorNamesThePeak) {
  CliResult r = run("compile " + source_path("examples/mlp_forward.json") + " --budget 10000");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("over the budget of 10000 bytes; the peak is at launch"), std::string::npos) << r.err;
}

TEST_F(Cli, PlanABufferListWritesOffsetsAndSvg) {
  std::string csv = write("b.csv", "id,lower,upper,size\na,0,2,300\nb,1,3,200\nc,2,4,300\n");
  std::string offsets = (dir_ / "offsets.csv").string(), svg = (dir_ / "plan.svg").string();
  CliResult r = run("plan --buffers " + csv + " --alignment 1 -o " + offsets + " --svg " + svg);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find(" 500 bytes (1.000x the lower bound, optimal)"), std::string::npos) << r.out;
  std::string text = cudagen::read_text_file(offsets);
  EXPECT_EQ(text.rfind("id,lower,upper,size,offset\n", 0), 0u) << text;
  EXPECT_NE(cudagen::read_text_file(svg).find("<title>b: steps [1, 2]"), std::string::npos);
  EXPECT_EQ(run("plan --buffers " + write("bad.csv", "id,lower,upper,size\nx,5,1,3\n")).status, 1);
  CliResult over = run("plan --buffers " + csv + " --alignment 1 --budget 450");
  EXPECT_EQ(over.status, 1);
  EXPECT_NE(over.err.find("needs 500 bytes, 50 over the budget of 450 bytes (lower bound 500)"), std::string::npos)
      << over.err;
}

TEST_F(Cli, PlanAGraphReportsTheBound) {
  CliResult r = run("plan " + source_path("examples/transformer_block.json"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("arena / lower bound: 1.000"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("scores.out"), std::string::npos);
}

TEST_F(Cli, OpsListSaysWhichOpsTheEmitterGenerates) {
  CliResult r = run("ops");
  ASSERT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("matmul                   matmul       matmul.cuh       yes"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cross_entropy            reduction    losses.cuh       yes"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("sgd                      elementwise  optimizers.cuh   yes"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("mse                      reduction    losses.cuh       yes"), std::string::npos) << r.out;
}

TEST_F(Cli, FloatTemplatesRefuseF64InsteadOfLosingPrecision) {
  std::string graph = write("f64.json", graph_of(R"({"id": "s", "op": "softmax",
      "tensors": {"x": {"dtype": "f64", "shape": [2, 8], "storage": "external"},
                  "out": {"dtype": "f64", "shape": [2, 8], "storage": "external"}}})"));
  CliResult r = run("compile " + graph);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("task 's', slot 'x' (/tasks/0): the softmax template accumulates in f32, so a f64 tensor "
                       "would lose precision (f32, f16 and bf16 are supported)"),
            std::string::npos)
      << r.err;
}

// A user adds an op by writing a template: --templates indexes it with the bundled ones.
TEST_F(Cli, UserTemplatesAddAnOpThatCompiles) {
  fs::create_directories(dir_ / "mine");
  write("mine/square.cuh", R"(// out = gain * x * x, a user's op that calls a bundled template's function.
template <typename T>
CG_OP("square", "pattern: elementwise", "types: T = f32 f64", "tensor: x input T", "tensor: out output T",
      "arg: gain float = 1.0", "shape: x:[...S] -> out:[...S]", "doc: gain * x * x")
CG_DEVICE T cg_square(T x, float gain) {
  return cg_mul(T(gain) * x, x);
}
)");
  std::string graph = write("g.json", graph_of(R"({"id": "sq", "op": "square", "args": {"gain": 3.0},
      "tensors": {"x": {"dtype": "f32", "shape": [41], "storage": "external"},
                  "out": {"dtype": "f32", "shape": [41], "storage": "external"}}})"));
  std::string templates = " --templates " + (dir_ / "mine").string();
  EXPECT_EQ(run("validate " + graph).status, 1) << "without --templates there is no op 'square'";
  CliResult ops = run("ops" + templates);
  EXPECT_NE(ops.out.find("square                   elementwise  square.cuh       yes"), std::string::npos) << ops.out;
  std::string cu = (dir_ / "sq.cu").string();
  CliResult r = run("compile " + graph + templates + " -o " + cu);
  ASSERT_EQ(r.status, 0) << r.err;
  std::string text = cudagen::read_text_file(cu);
  EXPECT_NE(text.find("cg_store(out, i, cg_square<float>(cg_load(x, i), 3.0f));"), std::string::npos) << text;
  EXPECT_NE(text.find("// templates/square.cuh:"), std::string::npos);
  EXPECT_NE(text.find("CG_DEVICE T cg_mul(T a, T b) {"), std::string::npos) << "the bundled callee comes along";
  EXPECT_LT(text.find("CG_DEVICE T cg_mul(T a, T b) {"), text.find("CG_DEVICE T cg_square(T x, float gain) {"));
  CliResult nvrtc = run("nvrtc " + cu + " --arch sm_90");
  EXPECT_EQ(nvrtc.status, 0) << nvrtc.err;
}

// User ops run end to end (issue #34): a template's float64 reference
// function checks the kernel (and catches a wrong one); `reference: none`
// runs the op unchecked, says so, and checks what follows on its values.
TEST_F(Cli, UserOpsRunCheckedAgainstTheirTemplatesReference) {
  const std::string op = R"(template <typename T>
CG_OP("square_plus", "pattern: broadcast", "types: T = f32", "tensor: x input T", "tensor: y input T",
      "tensor: out output T", "arg: gain float = 2.0", "shape: x:[...A] y:[...B] -> out:[...broadcast(A, B)]",
      "reference: square_plus_reference", "doc: gain * x * x + y")
CG_DEVICE T cg_square_plus(T x, T y, float gain) {
  return T(gain) * x * x SIGN y;
}

// The float64 reference: host C++.
inline double square_plus_reference(double x, double y, double gain) { return gain * x * x + y; }
)";
  auto op_with = [&](const std::string& sign) { return std::regex_replace(op, std::regex("SIGN"), sign); };
  fs::create_directories(dir_ / "right");
  fs::create_directories(dir_ / "wrong");
  write("right/square_plus.cuh", op_with("+"));
  write("wrong/square_plus.cuh", op_with("-"));
  std::string graph = write("g.json", graph_of(R"({"id": "sq", "op": "square_plus", "args": {"gain": 3.0},
      "tensors": {"x": {"dtype": "f32", "shape": [8, 16], "storage": "external"},
                  "y": {"dtype": "f32", "shape": [16], "storage": "external"},
                  "out": {"dtype": "f32", "shape": [8, 16]}}},
    {"id": "act", "op": "relu", "tensors": {"x": {"from": "sq.out"},
                  "out": {"dtype": "f32", "shape": [8, 16], "storage": "external"}}})"));
  const std::string work = " --emulate --work-dir " + (dir_ / "work").string();
  CliResult right = run("run " + graph + " --templates " + (dir_ / "right").string() + work);
  EXPECT_EQ(right.status, 0) << right.out << right.err;
  EXPECT_NE(right.out.find("act.out                        128"), std::string::npos) << right.out;
  CliResult wrong = run("run " + graph + " --templates " + (dir_ / "wrong").string() + work);
  EXPECT_EQ(wrong.status, 1) << wrong.out << wrong.err;
  EXPECT_NE(wrong.out.find("FAIL"), std::string::npos) << wrong.out;

  // No reference: unchecked, and said; the relu after it is checked.
  fs::create_directories(dir_ / "none");
  write("none/square_plus.cuh", std::regex_replace(op_with("+"), std::regex("reference: square_plus_reference"),
                                                   "reference: none"));
  CliResult none = run("run " + graph + " --templates " + (dir_ / "none").string() + " --no-fuse" + work);
  EXPECT_EQ(none.status, 0) << none.out << none.err;
  EXPECT_NE(none.out.find("not checked: sq.out (op 'square_plus' has `reference: none`)"), std::string::npos) << none.out;
  EXPECT_NE(none.out.find("act.out"), std::string::npos) << none.out;
  // Fused, its output never reaches memory: what reads it cannot be checked.
  CliResult fused = run("run " + graph + " --templates " + (dir_ / "none").string() + work);
  EXPECT_EQ(fused.status, 1);
  EXPECT_NE(fused.err.find("run with --no-fuse"), std::string::npos) << fused.err;

  // Without either, the error says what to add.
  fs::create_directories(dir_ / "silent");
  write("silent/square_plus.cuh", std::regex_replace(op_with("+"), std::regex("\"reference: square_plus_reference\","), ""));
  CliResult silent = run("run " + graph + " --templates " + (dir_ / "silent").string() + work);
  EXPECT_EQ(silent.status, 1);
  EXPECT_NE(silent.err.find("`reference: FUNCTION`, or `reference: none`"), std::string::npos) << silent.err;

  // A reference function is for ops that compute one element.
  fs::create_directories(dir_ / "pattern");
  write("pattern/square_plus.cuh", std::regex_replace(op_with("+"), std::regex("pattern: broadcast"), "pattern: opaque"));
  CliResult pattern = run("ops --templates " + (dir_ / "pattern").string());
  EXPECT_EQ(pattern.status, 1);
  EXPECT_NE(pattern.err.find("a reference function computes one element, and 'square_plus' is a opaque op"),
            std::string::npos)
      << pattern.err;
}

// A user's op on the matmul pattern calls its own function, for every dtype
// (it called the bundled tiles, which were not in the file).
TEST_F(Cli, AUsersMatmulOpCallsItsOwnFunction) {
  fs::create_directories(dir_ / "mine");
  write("mine/mm.cuh", R"(template <int BM, int BN, int BK, typename LoadA, typename LoadB, typename Epilogue>
CG_OP("my_matmul", "pattern: matmul", "types: T = f32 bf16", "tensor: a input T", "tensor: b input T",
      "tensor: out output T", "shape: a:[M, K] b:[K, N] -> out:[M, N]", "reference: none", "doc: a @ b")
CG_DEVICE void my_matmul_tile(LoadA load_a, LoadB load_b, Epilogue epilogue, int M, int N, int K, int tile_m,
                              int tile_n, float* smem) {
  for (int e = threadIdx.x; e < BM * BN; e += blockDim.x) {
    const int m = tile_m * BM + e / BN, n = tile_n * BN + e % BN;
    if (m >= M || n >= N) continue;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += load_a(m, k) * load_b(k, n);
    epilogue(m, n, acc);
  }
}
)");
  for (const std::string dtype : {"f32", "bf16"}) {
    std::string graph = write("mm_" + dtype + ".json", graph_of(fmt::format(R"({{"id": "mm", "op": "my_matmul",
      "tensors": {{"a": {{"dtype": "{0}", "shape": [64, 64], "storage": "external"}},
                  "b": {{"dtype": "{0}", "shape": [64, 64], "storage": "external"}},
                  "out": {{"dtype": "{0}", "shape": [64, 64], "storage": "external"}}}}}})",
                                                                            dtype)));
    std::string cu = (dir_ / ("mm_" + dtype + ".cu")).string();
    CliResult r = run("compile " + graph + " --templates " + (dir_ / "mine").string() + " -o " + cu);
    ASSERT_EQ(r.status, 0) << r.err;
    const std::string text = cudagen::read_text_file(cu);
    EXPECT_NE(text.find("my_matmul_tile<32, 32, 16>("), std::string::npos) << dtype;
    for (const char* bundled : {"cg_matmul_tile<", "cg_matmul_tile_mma<", "cg_gemm_mainloop<"})
      EXPECT_EQ(text.find(bundled), std::string::npos) << dtype << " calls " << bundled;
    CliResult nvrtc = run("nvrtc " + cu + " --arch sm_90");
    EXPECT_EQ(nvrtc.status, 0) << nvrtc.err;
  }
}

TEST_F(Cli, UserTemplatesWithAnErrorNameTheUsersFileAndLine) {
  fs::create_directories(dir_ / "broken");
  std::string file = write("broken/bad.cuh", "template <typename T>\nCG_DEVICE T cg_bad(T x) { return x +; }\n");
  CliResult r = run("ops --templates " + (dir_ / "broken").string());
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(file + ":2:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("could not be indexed"), std::string::npos) << r.err;
  EXPECT_EQ(run("ops --templates " + (dir_ / "broken").string() + " --registry " + file).status, 2);
}

// Files (issue #34; file_util_test.cpp has the planted symlink): a replaced
// file keeps its mode, a .cu and its manifest are
// written both or neither, and the emulation's work folder is private and
// removed after the run.
TEST_F(Cli, FilesAreWrittenSafelyAndWorkFoldersRemoved) {
  const std::string out = (dir_ / "out.json").string();
  ASSERT_EQ(run("format " + source_path("examples/mlp_forward.json") + " -o " + out).status, 0);

  fs::permissions(out, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  ASSERT_EQ(run("format " + out + " -o " + out).status, 0);
  EXPECT_EQ(fs::status(out).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read)
      << "format -o on its input keeps the file's mode";

  const std::string cu = (dir_ / "never.cu").string();
  CliResult r = run("compile " + source_path("examples/mlp_forward.json") + " -o " + cu + " --manifest " +
                    (dir_ / "no_such_folder" / "m.json").string());
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_FALSE(fs::exists(cu)) << "the .cu without its manifest";

  const fs::path tmp = dir_ / "tmp";
  fs::create_directories(tmp);
  r = run("run --emulate " + source_path("examples/mlp_forward.json"), "TMPDIR=" + tmp.string());
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_TRUE(fs::is_empty(tmp)) << "the run left " << fs::directory_iterator(tmp)->path();
}

namespace {
// An .npy file of zeros (float32, the given shape), as `--expected` reads it.
std::string npy_zeros(const std::vector<int64_t>& shape) {
  std::string dims;
  int64_t n = 1;
  for (int64_t d : shape) {
    dims += std::to_string(d) + ", ";
    n *= d;
  }
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims.substr(0, dims.size() - 2) + "), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string out = std::string("\x93NUMPY\x01\x00", 8);
  out += char(header.size() & 0xff);
  out += char(header.size() >> 8);
  return out + header + std::string(size_t(n) * 4, '\0');
}
}  // namespace

// Issue #36's demonstration: an op fuses by what its template declares, with
// no change to the generator. A clamp, a user's elementwise op, runs as a
// matmul's epilogue; a Gemma-style RMS norm (weight offset by one), a user's
// row op, runs the bundled norm's skeleton (`skeleton: rmsnorm`) calling its
// own row function, with an epilogue after it, and computes what the bundled
// norm computes with weight + 1.
TEST_F(Cli, AnEpilogueOpAndARowOpFuseFromTheirTemplatesAlone) {
  fs::create_directories(dir_ / "mine");
  write("mine/clamp.cuh", R"cuh(template <typename T>
CG_OP("clamp", "pattern: elementwise", "types: T = f32 f16 bf16", "tensor: x input T", "tensor: out output T",
      "arg: lo float = 0.0", "arg: hi float = 1.0", "shape: x:[...S] -> out:[...S]", "may_alias: out x",
      "reference: clamp_reference", "doc: min(max(x, lo), hi)")
CG_DEVICE T cg_clamp(T x, float lo, float hi) {
  return T(fminf(fmaxf(float(x), lo), hi));
}
inline double clamp_reference(double x, double lo, double hi) { return x < lo ? lo : x > hi ? hi : x; }
)cuh");
  write("mine/offset_rmsnorm.cuh", R"cuh(// x * rstd * (1 + weight): Gemma's RMS norm.
template <typename Load, typename Weight, typename Store>
CG_OP("offset_rmsnorm", "pattern: reduction", "skeleton: rmsnorm", "epilogue: out", "rows: x", "types: T = f32",
      "tensor: x input T", "tensor: weight weight T", "tensor: out output T", "tensor: rstd output f32 optional",
      "arg: eps float = 1e-06", "shape: x:[...S, N] weight:[N] -> out:[...S, N] rstd:[...S]", "smem: 128",
      "reference: none", "doc: x * rsqrt(mean(x^2) + eps) * (1 + weight)")
CG_DEVICE float cg_offset_rmsnorm_row(Load load, Weight weight, Store store, int n, float eps, float* scratch) {
  float sum_sq = 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) sum_sq += load(j) * load(j);
  const float rstd = rsqrtf(cg_block_sum(sum_sq, scratch) / (float)n + eps);
  for (int j = threadIdx.x; j < n; j += blockDim.x) store(j, load(j) * rstd * (1.0f + weight(j)));
  return rstd;
}
)cuh");
  const std::string mine = " --templates " + (dir_ / "mine").string();
  const std::string work = " --emulate --work-dir " + (dir_ / "work").string();

  const std::string clamped = write("clamp.json", graph_of(R"({"id": "mm", "op": "matmul",
      "tensors": {"a": {"dtype": "f32", "shape": [8, 16], "storage": "external"},
                  "b": {"dtype": "f32", "shape": [16, 12], "storage": "external"},
                  "out": {"dtype": "f32", "shape": [8, 12]}}},
    {"id": "c", "op": "clamp", "args": {"lo": -0.5, "hi": 0.5}, "tensors": {"x": {"from": "mm.out"},
                  "out": {"dtype": "f32", "shape": [8, 12], "storage": "external"}}})"));
  CliResult described = run("describe " + clamped + mine);
  EXPECT_NE(described.out.find("mm, c  [matmul_epilogue]"), std::string::npos) << described.out;
  CliResult ran = run("run " + clamped + mine + work);
  EXPECT_EQ(ran.status, 0) << ran.out << ran.err;
  EXPECT_NE(ran.out.find("c.out"), std::string::npos) << ran.out;

  // d = 2 offset_rmsnorm(x, w) - 2 rmsnorm(x, w + 1): zero, to the norms' rounding; each norm
  // with its doubling as its epilogue.
  const std::string norms = write("norms.json", graph_of(R"({"id": "g", "op": "offset_rmsnorm",
      "tensors": {"x": {"dtype": "f32", "shape": [4, 64], "storage": "external"},
                  "weight": {"dtype": "f32", "shape": [64], "storage": "external"},
                  "out": {"dtype": "f32", "shape": [4, 64]}}},
    {"id": "e", "op": "affine", "args": {"scale": 2.0}, "tensors": {"x": {"from": "g.out"},
                  "out": {"dtype": "f32", "shape": [4, 64]}}},
    {"id": "one", "op": "affine", "args": {"shift": 1.0}, "tensors": {"x": {"from": "g.weight"},
                  "out": {"dtype": "f32", "shape": [64]}}},
    {"id": "r", "op": "rmsnorm", "tensors": {"x": {"from": "g.x"}, "weight": {"from": "one.out"},
                  "out": {"dtype": "f32", "shape": [4, 64]}}},
    {"id": "r2", "op": "affine", "args": {"scale": 2.0}, "tensors": {"x": {"from": "r.out"},
                  "out": {"dtype": "f32", "shape": [4, 64]}}},
    {"id": "d", "op": "sub", "tensors": {"a": {"from": "e.out"}, "b": {"from": "r2.out"},
                  "out": {"dtype": "f32", "shape": [4, 64], "storage": "external"}}})"));
  described = run("describe " + norms + mine);
  EXPECT_NE(described.out.find("g, e  [reduction_epilogue]"), std::string::npos) << described.out;
  CliResult compiled = run("compile " + norms + mine + " -o " + (dir_ / "norms.cu").string());
  ASSERT_EQ(compiled.status, 0) << compiled.err;
  EXPECT_NE(cudagen::read_text_file((dir_ / "norms.cu").string()).find("const float row_rstd = cg_offset_rmsnorm_row("),
            std::string::npos);
  fs::create_directories(dir_ / "expected");
  std::ofstream((dir_ / "expected" / "d.out.npy").string(), std::ios::binary) << npy_zeros({4, 64});
  // Unfused, so that the op without a reference leaves its output in memory for d's check.
  ran = run("run " + norms + mine + work + " --no-fuse --expected " + (dir_ / "expected").string());
  EXPECT_EQ(ran.status, 0) << ran.out << ran.err;
  EXPECT_NE(ran.out.find("against the expected outputs"), std::string::npos) << ran.out;
  EXPECT_EQ(ran.out.find("FAIL"), std::string::npos) << ran.out;

  // A skeleton the emitter does not have is named.
  write("mine/offset_rmsnorm.cuh", std::regex_replace(cudagen::read_text_file((dir_ / "mine/offset_rmsnorm.cuh").string()),
                                                      std::regex("skeleton: rmsnorm"), "skeleton: rms_norm"));
  compiled = run("compile " + norms + mine + " -o " + (dir_ / "norms.cu").string());
  EXPECT_EQ(compiled.status, 1);
  EXPECT_NE(compiled.err.find("op 'offset_rmsnorm' names skeleton 'rms_norm', which the emitter does not have"),
            std::string::npos)
      << compiled.err;
  // So is one that would call the bundled op's function instead of the user's.
  write("mine/offset_rmsnorm.cuh", std::regex_replace(cudagen::read_text_file((dir_ / "mine/offset_rmsnorm.cuh").string()),
                                                      std::regex("skeleton: rms_norm"), "skeleton: layernorm"));
  compiled = run("compile " + norms + mine + " -o " + (dir_ / "norms.cu").string());
  EXPECT_EQ(compiled.status, 1);
  EXPECT_NE(compiled.err.find("names skeleton 'layernorm', which calls its own op's function rather than "
                              "'cg_offset_rmsnorm_row' (skeletons that call the op's: rmsnorm)"),
            std::string::npos)
      << compiled.err;
}
