// Snapshot tests: the generated .cu and manifest of each snapshot graph,
// compared whole with tests/snapshots/, plus FileCheck-style checks naming the
// lines that matter (a regenerated snapshot alone proves nothing).
//   UPDATE_SNAPSHOTS=1 rewrites the files (never under CI, where a missing
//   or different snapshot fails).
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "pipeline.h"
#include "test_util.h"

using namespace cudagen;
using cudagen::testing::source_path;
namespace fs = std::filesystem;

namespace {

struct SnapshotCase {
  const char* name;
  const char* graph;  // relative to the source tree
};

void PrintTo(const SnapshotCase& s, std::ostream* os) { *os << s.name; }

const SnapshotCase kSnapshots[] = {
    {"mlp_forward", "examples/mlp_forward.json"},
    {"every_template_op", "tests/snapshots/every_template_op.json"},
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
  Compiled c = compile(load_program(source_path(s.graph), {}), {});
  compare_with_snapshot(std::string(s.name) + ".cu", c.emitted.cuda_source);
  compare_with_snapshot(std::string(s.name) + ".manifest.json", c.emitted.manifest_json);
  run_checks(std::string(s.name) + ".checks", c.emitted.cuda_source);
}

INSTANTIATE_TEST_SUITE_P(Graphs, Snapshot, ::testing::ValuesIn(kSnapshots),
                         [](const auto& info) { return std::string(info.param.name); });
