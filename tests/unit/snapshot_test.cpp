// Snapshot tests: the generated .cu and manifest of each snapshot graph,
// compared whole with tests/snapshots/, plus FileCheck-style checks naming the
// lines that matter (a regenerated snapshot alone proves nothing).
//   UPDATE_SNAPSHOTS=1 rewrites the files (never under CI, where a missing
//   or different snapshot fails).
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "cost.h"
#include "pipeline.h"
#include "test_util.h"

using namespace cudagen;
using cudagen::testing::source_path;
namespace fs = std::filesystem;

namespace {

struct SnapshotCase {
  const char* name;
  const char* graph;  // relative to the source tree
  int megakernel_blocks = 0;  // > 0: compiled --megakernel on this many blocks
};

void PrintTo(const SnapshotCase& s, std::ostream* os) { *os << s.name; }

const SnapshotCase kSnapshots[] = {
    {"mlp_forward", "examples/mlp_forward.json"},
    {"mlp_train", "examples/mlp_train.json"},
    {"mlp_derived", "examples/mlp_derived.json"},
    {"train_mlp", "examples/train_mlp.json"},
    {"transformer_block", "examples/transformer_block.json"},
    {"train_transformer", "examples/train_transformer.json"},
    {"every_template_op", "tests/snapshots/every_template_op.json"},
    {"mlp_forward_megakernel", "examples/mlp_forward.json", 4},
};

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

std::string unified_diff(const std::string& expected_path, const std::string& actual) {
  fs::path actual_path = fs::temp_directory_path() / ("cudagen_snapshot_" + std::to_string(::getpid()));
  std::ofstream(actual_path) << actual;
  std::string cmd = "diff -u '" + expected_path + "' '" + actual_path.string() + "' 2>&1 | head -80";
  std::string out;
  if (FILE* pipe = popen(cmd.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
    pclose(pipe);
  }
  fs::remove(actual_path);
  return out;
}

void compare_with_snapshot(const std::string& file, const std::string& actual) {
  std::string path = source_path("tests/snapshots/" + file);
  bool update = env_set("UPDATE_SNAPSHOTS") && !env_set("CI");
  if (update) {
    write_file_atomic(path, actual);
    return;
  }
  if (!fs::exists(path)) {
    ADD_FAILURE() << "missing snapshot " << path << ": run the tests with UPDATE_SNAPSHOTS=1 to create it";
    return;
  }
  std::string expected = read_text_file(path);
  if (expected != actual)
    ADD_FAILURE() << "generated code differs from " << path << " (UPDATE_SNAPSHOTS=1 rewrites it):\n"
                  << unified_diff(path, actual);
}

// CHECK: lines must appear in order; CHECK-NOT: text must appear nowhere.
void run_checks(const std::string& checks_file, const std::string& text) {
  std::istringstream in(read_text_file(source_path("tests/snapshots/" + checks_file)));
  std::string line;
  size_t position = 0;
  int line_no = 0, checks = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.rfind("CHECK-NOT: ", 0) == 0) {
      std::string needle = line.substr(11);
      EXPECT_EQ(text.find(needle), std::string::npos) << checks_file << ":" << line_no << ": found '" << needle << "'";
      ++checks;
    } else if (line.rfind("CHECK: ", 0) == 0) {
      std::string needle = line.substr(7);
      size_t at = text.find(needle, position);
      EXPECT_NE(at, std::string::npos) << checks_file << ":" << line_no << ": '" << needle
                                       << "' not found after the previous check";
      if (at != std::string::npos) position = at + needle.size();
      ++checks;
    }
  }
  EXPECT_GT(checks, 3) << checks_file << " checks too little to mean anything";
}

}  // namespace

class Snapshot : public ::testing::TestWithParam<SnapshotCase> {};

TEST_P(Snapshot, GeneratedCodeMatches) {
  const SnapshotCase& s = GetParam();
  CompileOptions options;
  options.emit.megakernel = s.megakernel_blocks > 0;
  options.emit.megakernel_blocks = s.megakernel_blocks;
  Compiled c = compile(load_program(source_path(s.graph), {}), options);
  compare_with_snapshot(std::string(s.name) + ".cu", c.emitted.cuda_source);
  compare_with_snapshot(std::string(s.name) + ".manifest.json", c.emitted.manifest_json);
  compare_with_snapshot(std::string(s.name) + ".h", c.emitted.host_header);
  run_checks(std::string(s.name) + ".checks", c.emitted.cuda_source);
}

// Each kernel's comment lists its shared-memory plan: regions from offset
// 0, 16-byte aligned, none overlapping the one before, the last ending at
// the kernel's shared-memory size, within the 48 KiB of every device.
TEST_P(Snapshot, SharedMemoryIsPlannedPerKernel) {
  const SnapshotCase& s = GetParam();
  CompileOptions options;
  options.emit.megakernel = s.megakernel_blocks > 0;
  options.emit.megakernel_blocks = s.megakernel_blocks;
  const std::string source = compile(load_program(source_path(s.graph), {}), options).emitted.cuda_source;
  std::istringstream in(source);
  std::string line;
  int planned = 0, multi = 0;
  while (std::getline(in, line)) {
    const size_t at = line.find(" bytes of shared memory:");
    if (line.rfind("//   ", 0) != 0 || at == std::string::npos) continue;
    const int64_t total = std::stoll(line.substr(line.rfind(' ', at - 1) + 1));
    int64_t end = 0, regions = 0;
    while (in.peek() == '/' && std::getline(in, line) && line.rfind("//     [", 0) == 0) {
      int64_t from = 0, to = 0;
      ASSERT_EQ(std::sscanf(line.c_str(), "//     [%ld, %ld)", &from, &to), 2) << line;
      EXPECT_EQ(from % 16, 0) << line;
      EXPECT_GE(from, end) << line;
      EXPECT_GT(to, from) << line;
      EXPECT_NE(line.find(") ") + 2, line.size()) << "a region says what it holds: " << line;
      end = to;
      ++regions;
    }
    EXPECT_GT(regions, 0);
    EXPECT_EQ(end, total) << line;
    EXPECT_LE(total, 48 * 1024);
    ++planned;
    multi += regions > 1;
  }
  EXPECT_GT(planned, 0);
  // The transformer block's attention stages ln1's rows, the projections' weights, the head's
  // queries, keys and values beside its warps' scratch; its MLP chain ln2's rows and the hidden rows.
  if (std::string(s.name) == "transformer_block") EXPECT_GE(multi, 2);
}

INSTANTIATE_TEST_SUITE_P(Graphs, Snapshot, ::testing::ValuesIn(kSnapshots),
                         [](const auto& info) { return std::string(info.param.name); });

// every_template_op is what the closure test, NVRTC and nvcc compile to
// prove each op's generated kernel builds: it must hold every op.
TEST(Snapshot, EveryTemplateOpHoldsEveryOpOfTheRegistry) {
  Program p = load_program(source_path("tests/snapshots/every_template_op.json"), {});
  std::set<std::string> used;
  for (const auto& t : p.tasks) used.insert(t.op->name);
  for (const auto& name : p.registry.names())
    EXPECT_TRUE(used.count(name)) << "add a task of op '" << name << "' to tests/snapshots/every_template_op.json";
}

// Every op that declares FLOPs gets a count for each of its tasks there; a
// matmul's is 2 * M * N * K whichever operand is transposed.
TEST(Snapshot, EveryDeclaredFlopsFormulaEvaluates) {
  Program p = load_program(source_path("tests/snapshots/every_template_op.json"), {});
  int declared = 0, matmuls = 0;
  for (size_t t = 0; t < p.tasks.size(); ++t) {
    const BoundTask& bt = p.tasks[t];
    if (bt.op->flops_text.empty()) continue;
    ++declared;
    std::optional<int64_t> flops = task_flops(p, int(t));
    ASSERT_TRUE(flops.has_value()) << bt.task->id << ": " << bt.op->flops_text;
    EXPECT_GT(*flops, 0) << bt.task->id;
    if (bt.op->name != "matmul") continue;
    ++matmuls;
    const Shape& a = p.buffers[size_t(bt.find_tensor("a")->buffer)].shape;
    const Shape& out = p.buffers[size_t(bt.find_tensor("out")->buffer)].shape;
    bool trans_a = false;
    for (const auto& arg : bt.args)
      if (arg.name == "trans_a") trans_a = std::get<bool>(arg.value);
    int64_t numel = 1;
    for (int64_t d : out) numel *= d;
    EXPECT_EQ(*flops, 2 * numel * (trans_a ? a[a.size() - 2] : a.back())) << bt.task->id;
  }
  EXPECT_GE(declared, 16);
  EXPECT_GE(matmuls, 1);
}

// The ahead-of-time header: the launchers under the chosen prefix, and every
// tensor a program reads or writes (and no transient one) at its planned offset.
TEST(HostHeader, DeclaresTheLaunchersAndWhereEachTensorLies) {
  CompileOptions options;
  options.emit.symbol_prefix = "train";
  options.emit.step_function = true;
  Compiled c = compile(load_program(source_path("examples/train_mlp.json"), {}), options);
  const std::string& h = c.emitted.host_header;
  for (const char* phase : {"init", "forward", "backward", "update", "step"})
    EXPECT_NE(h.find(std::string("int train_") + phase + "(unsigned char* arena, CUstream_st* stream);"),
              std::string::npos)
        << phase;
  EXPECT_NE(h.find("extern const unsigned long long train_arena_bytes;"), std::string::npos);
  // The .cu defines what the header declares.
  EXPECT_NE(c.emitted.cuda_source.find("extern \"C\" int train_forward(unsigned char* arena, cudaStream_t stream)"),
            std::string::npos);
  EXPECT_NE(c.emitted.cuda_source.find("extern \"C\" const unsigned long long train_arena_bytes = " +
                                       std::to_string(c.plan.arena_bytes) + "ull;"),
            std::string::npos);
  EXPECT_EQ(c.emitted.cuda_source.find("cudagen_forward"), std::string::npos);
  for (size_t b = 0; b < c.program.buffers.size(); ++b) {
    const std::string name = buffer_name(c.program, int(b));
    const Storage storage = c.program.buffers[b].storage;
    const std::string row = "{\"" + name + "\", ";
    if (storage == Storage::external || storage == Storage::persistent) {
      const size_t at = h.find(row);
      ASSERT_NE(at, std::string::npos) << name;
      const std::string offset = std::to_string(c.plan.buffers[b].offset) + "ull, " +
                                 std::to_string(c.plan.buffers[b].bytes) + "ull}";
      EXPECT_NE(h.substr(at, h.find('\n', at) - at).find(offset), std::string::npos) << name << " not at " << offset;
    } else {
      EXPECT_EQ(h.find(row), std::string::npos) << name << " is " << to_string(storage);
    }
  }
  EXPECT_NE(h.find("train_w1_adam_step,"), std::string::npos);
  EXPECT_NE(h.find("{\"w1_adam.lr\", \"float\", "), std::string::npos);
}

TEST(HostHeader, SymbolPrefixMustBeACIdentifier) {
  EXPECT_EQ(symbol_prefix_problem("mlp_2"), "");
  EXPECT_EQ(symbol_prefix_problem(""), "it is empty");
  EXPECT_EQ(symbol_prefix_problem("2mlp"), "it starts with a digit");
  EXPECT_EQ(symbol_prefix_problem("m-lp"), "'-' cannot be part of a C identifier");
}

// The emitter writes user text into comments through comment_text, whatever
// reader made the graph (the C++ builder does not check names): a newline or
// a line-splicing backslash in the name stays inside its comment (issue #34).
TEST(HostHeader, GraphNameCannotEndItsComment) {
  TaskGraph graph = read_graph(read_text_file(source_path("examples/mlp_forward.json")));
  graph.name = "evil\n#error injected\r\nint x = 1; \\";
  CompileOptions options;
  Compiled c = compile(load_program(std::move(graph), {}), options);
  for (const std::string* text : {&c.emitted.cuda_source, &c.emitted.host_header}) {
    EXPECT_EQ(text->find("\n#error injected"), std::string::npos);
    EXPECT_EQ(text->find("\nint x = 1;"), std::string::npos);
    EXPECT_NE(text->find("from graph 'evil\\x0a#error injected\\x0d\\x0aint x = 1; \\x5c' (hash"), std::string::npos)
        << text->substr(0, 300);
  }
  EXPECT_EQ(comment_text("plain name-1.0"), "plain name-1.0");
  EXPECT_EQ(comment_text("tab\there"), "tab\\x09here");
}
