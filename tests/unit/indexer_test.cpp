// cudagen-index on small template folders written by each test: a user's own
// op that the registry then holds, and each kind of mistake a template author
// makes, with the error naming the file and line.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>

#include <gtest/gtest.h>

#include "diagnostics.h"
#include "file_util.h"
#include "registry.h"

using namespace cudagen;
namespace fs = std::filesystem;

namespace {

struct IndexRun {
  int status = -1;
  std::string out, err;
};

class Indexer : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("cudagen_index_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "t");
  }
  void TearDown() override { fs::remove_all(dir_); }

  void file(const std::string& name, const std::string& text) { write_file_atomic((dir_ / "t" / name).string(), text); }

  IndexRun index() {
    std::string out = (dir_ / "out.json").string(), err = (dir_ / "err.txt").string();
    std::string cmd = std::string(CUDAGEN_INDEX_EXE) + " -o " + out + " " + (dir_ / "t").string() + " 2>" + err;
    IndexRun r;
    int raw = std::system(cmd.c_str());
    r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
    if (fs::exists(out)) r.out = read_text_file(out);
    r.err = read_text_file(err);
    return r;
  }

  // Runs the indexer on one file and expects it to fail with `message` at `line`.
  void expect_error(const std::string& text, int line, const std::string& message) {
    file("op.cuh", text);
    IndexRun r = index();
    EXPECT_EQ(r.status, 1) << r.err;
    EXPECT_TRUE(r.out.empty()) << "nothing is written on failure";
    std::string where = (dir_ / "t" / "op.cuh").string() + ":" + std::to_string(line) + ":";
    EXPECT_NE(r.err.find(where), std::string::npos) << "expected an error at " << where << "\n" << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
  }

  fs::path dir_;
};

const char* kSquareOp = R"(// A user's op.
template <typename T>
CG_OP("square",
      "pattern: elementwise",
      "types: T = f32 f64",
      "tensor: x input T",
      "tensor: out output T",
      "arg: gain float = 2.0",
      "shape: x:[...S] -> out:[...S]",
      "may_alias: out x",
      "doc: gain * x * x")
CG_DEVICE T cg_square(T x, float gain) {
  return T(gain) * cg_times_self(x);
}
)";

}  // namespace

TEST_F(Indexer, AUsersOpWithItsHelpersAndMacros) {
  // The helper sits in a file read after the op's ("z" > "s"): found by name.
  file("square.cuh", kSquareOp);
  file("zhelpers.cuh", R"(#define CG_TWICE(v) ((v) + (v))

// x * x, spelled through a macro to show the indexer follows macros.
template <typename T>
CG_DEVICE T cg_times_self(T x) {
  return CG_TWICE(x * x) / T(2);
}

// Not used by any op: no op's closure holds it.
CG_DEVICE float cg_unused(float x) { return x; }
)");
  IndexRun r = index();
  ASSERT_EQ(r.status, 0) << r.err;
  OpRegistry reg = OpRegistry::from_json(r.out, "out.json");
  const OpSignature* op = reg.find("square");
  ASSERT_NE(op, nullptr);
  EXPECT_EQ(op->pattern, PatternKind::elementwise);
  EXPECT_EQ(op->source_file, "square.cuh");
  EXPECT_EQ(op->source_function, "cg_square");
  EXPECT_EQ(std::get<double>(*op->find_arg("gain")->default_value), 2.0);
  EXPECT_EQ(op->closure, (std::vector<std::string>{"#CG_TWICE", "cg_times_self", "cg_square"}));
  std::map<std::string, std::string> text;
  for (const auto& d : reg.definitions()) text[d.id] = d.text;
  EXPECT_EQ(text["#CG_TWICE"], "#define CG_TWICE(v) ((v) + (v))\n");
  EXPECT_EQ(text["cg_square"],
            "// A user's op.\ntemplate <typename T>\nCG_DEVICE T cg_square(T x, float gain) {\n  return T(gain) * "
            "cg_times_self(x);\n}\n")
      << "the comment above comes along; the CG_OP annotation does not";
  EXPECT_TRUE(text.count("cg_unused"));
  // Dependencies come first in the registry's order of definitions.
  std::vector<std::string> order;
  for (const auto& d : reg.definitions()) order.push_back(d.id);
  EXPECT_LT(std::find(order.begin(), order.end(), "cg_times_self"), std::find(order.begin(), order.end(), "cg_square"));
}

// CG_OP is found among other annotate attributes, whichever comes first.
TEST_F(Indexer, AnOpBesideAnotherAnnotation) {
  std::string op = kSquareOp;
  op.replace(op.find("CG_OP(\"square\""), 5, "__attribute__((annotate(\"mine\"))) CG_OP");
  file("op.cuh", op + "template <typename T> CG_DEVICE T cg_times_self(T x) { return x * x; }\n");
  IndexRun r = index();
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(OpRegistry::from_json(r.out, "out.json").find("square"), nullptr);
}

TEST_F(Indexer, ATemplateThatDoesNotParseShowsClangsDiagnostics) {
  expect_error("template <typename T>\nCG_DEVICE T cg_broken(T x) {\n  return x + ;\n}\n", 3, "expected expression");
}

TEST_F(Indexer, AnAnnotationOnAVariable) {
  expect_error("CG_OP(\"table\", \"pattern: gather\") __device__ float cg_table[4];\n", 1,
               "CG_OP annotates a variable 'cg_table', not a device function");
}

TEST_F(Indexer, AnAnnotationOnAHostFunction) {
  expect_error(
      "template <typename T>\nCG_OP(\"host\", \"pattern: elementwise\", \"tensor: x input T\", \"tensor: out output "
      "T\",\n      \"types: T = f32\", \"shape: x:[...S] -> out:[...S]\")\nT cg_host(T x) { return x; }\n",
      2, "CG_OP annotates 'cg_host', which is not a __device__ function");
}

TEST_F(Indexer, ParametersThatDoNotMatchTheAnnotation) {
  std::string op = kSquareOp;
  op.replace(op.find("float gain) {"), 13, "float g) {");
  op.replace(op.find("T(gain)"), 7, "T(g)");
  op += "template <typename T> CG_DEVICE T cg_times_self(T x) { return x * x; }\n";
  file("op.cuh", op);
  IndexRun r = index();
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("op.cuh:12:13: error: op 'square': parameter 2 of cg_square is 'g', but the annotation's "
                       "argument 'gain' comes there"),
            std::string::npos)
      << r.err;
}

TEST_F(Indexer, AParameterTypeThatCannotBeASlot) {
  std::string op = kSquareOp;
  op.replace(op.find("cg_square(T x,"), 14, "cg_square(T* x,");
  op.replace(op.find("cg_times_self(x)"), 16, "cg_times_self(*x)");
  op += "template <typename T> CG_DEVICE T cg_times_self(T x) { return x * x; }\n";
  expect_error(op, 12, "parameter 'x' of cg_square has type 'T *', which cannot carry tensor slot 'x'");
}

TEST_F(Indexer, ADuplicateOpName) {
  std::string op = kSquareOp;
  std::string second = op;
  second.replace(second.find("cg_square"), 9, "cg_square2");
  second.replace(second.find("cg_square"), 9, "cg_square2");
  expect_error(op + second + "template <typename T> CG_DEVICE T cg_times_self(T x) { return x * x; }\n", 26,
               "op 'square' is declared twice");
}

TEST_F(Indexer, ABackwardLinkToAMissingOp) {
  std::string op = kSquareOp;
  op.replace(op.find("\"doc: gain * x * x\""), 19, "\"backward: square_backward\", \"doc: gain * x * x\"");
  expect_error(op + "template <typename T> CG_DEVICE T cg_times_self(T x) { return x * x; }\n", 12,
               "op 'square' names backward op 'square_backward', but no template declares an op of that name");
}

TEST_F(Indexer, AnUnknownAnnotationKey) {
  std::string op = kSquareOp;
  op.replace(op.find("\"pattern: elementwise\""), 22, "\"patern: elementwise\"");
  expect_error(op, 4, "op 'square': unknown key 'patern'");
}

TEST_F(Indexer, AShapeRuleThatDoesNotParse) {
  std::string op = kSquareOp;
  op.replace(op.find("x:[...S] -> out:[...S]"), 22, "x:[...S -> out:[...S]");
  expect_error(op + "template <typename T> CG_DEVICE T cg_times_self(T x) { return x * x; }\n", 3, "shape");
}

// An included file is refused before Clang reads it: none of its lines
// reaches the errors (they were echoed as syntax errors), however the
// directive is spelled.
TEST_F(Indexer, AnIncludedFileIsNeverRead) {
  const std::string secret = (dir_ / "secret.txt").string();
  write_file_atomic(secret, "SECRET_LINE = hunter2\n");
  for (const std::string& directive :
       {"#include \"" + secret + "\"", "  #  include \"" + secret + "\"", "#\\\ninclude \"" + secret + "\"",
        "# /* a comment */ include \"" + secret + "\"", "#include_next \"" + secret + "\"",
        "#embed \"" + secret + "\""}) {
    file("op.cuh", "// an op\n" + directive + "\n" + kSquareOp);
    IndexRun r = index();
    EXPECT_EQ(r.status, 1) << directive;
    EXPECT_NE(r.err.find("op.cuh:2:"), std::string::npos) << directive << "\n" << r.err;
    EXPECT_NE(r.err.find("templates must not include other files"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("hunter2 "), std::string::npos) << "a line of the included file in the errors:\n" << r.err;
    EXPECT_EQ(r.err.find("SECRET_LINE"), std::string::npos) << r.err;
  }
}

// What only looks like a directive is none: in a comment, in a string.
TEST_F(Indexer, IncludesInCommentsAndStringsAreNotDirectives) {
  file("op.cuh", std::string("/* an old note:\n#include <math.h>\n*/\n// #include <math.h>\n") +
                     "CG_DEVICE const char* cg_name() { return \"#include\"; }\n" +
                     "template <typename T>\nCG_DEVICE T cg_times_self(T x) { return x * x; }\n" + kSquareOp);
  IndexRun r = index();
  EXPECT_EQ(r.status, 0) << r.err;
}

TEST_F(Indexer, IncludesAndTopLevelConditionalsAreRefused) {
  expect_error("#include <math.h>\n", 1, "templates must not include other files (#include <math.h>)");
  expect_error("#ifdef FAST\nCG_DEVICE float cg_f(float x) { return x; }\n#endif\n", 1,
               "a preprocessor conditional outside any definition");
}
