// .npy files in and out of emulated runs.
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <filesystem>

#include <gtest/gtest.h>

#include "builder.h"
#include "file_util.h"
#include "npy.h"
#include "pipeline.h"
#include "runner.h"

using namespace cudagen;
namespace fs = std::filesystem;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("cudagen_npy_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

template <typename T>
HostTensor array_of(DType dtype, Shape shape, const std::vector<T>& values) {
  HostTensor a{dtype, std::move(shape), std::vector<unsigned char>(values.size() * sizeof(T))};
  std::memcpy(a.data.data(), values.data(), a.data.size());
  return a;
}

}  // namespace

TEST(Npy, RoundTripsEveryDtypeAndShape) {
  fs::path dir = temp_dir("roundtrip");
  HostTensor f = array_of<float>(DType::f32, {2, 3}, {1, 2, 3, 4, 5, 6.5f});
  HostTensor d = array_of<double>(DType::f64, {1}, {0.1});
  HostTensor i = array_of<int64_t>(DType::i64, {}, {42});
  // bf16 as its bit patterns, an array of uint16 (numpy has no bfloat16): 1.0, -2.0, 0.1 (rounded).
  HostTensor bf = array_of<uint16_t>(DType::bf16, {3}, {0x3f80, 0xc000, 0x3dcd});
  for (const HostTensor* a : {&f, &d, &i, &bf}) {
    std::string path = (dir / "a.npy").string();
    write_npy(path, *a);
    std::string bytes = read_text_file(path);
    EXPECT_EQ(bytes.compare(0, 8, std::string("\x93NUMPY\x01\x00", 8)), 0);
    EXPECT_EQ((bytes.size() - a->data.size()) % 64, 0u) << "the header is padded to 64 bytes";
    HostTensor back = read_npy(path);
    EXPECT_EQ(back.dtype, a->dtype);
    EXPECT_EQ(back.shape, a->shape);
    EXPECT_EQ(back.data, a->data);
  }
  EXPECT_NE(read_text_file((dir / "a.npy").string()).find("'descr': '<u2'"), std::string::npos) << "bf16 as uint16";
  write_npy((dir / "a.npy").string(), i);
  EXPECT_NE(read_text_file((dir / "a.npy").string()).find("'shape': (), "), std::string::npos);
  write_npy((dir / "v.npy").string(), array_of<float>(DType::f32, {3}, {1, 2, 3}));
  EXPECT_NE(read_text_file((dir / "v.npy").string()).find("'shape': (3,), "), std::string::npos) << "a 1-tuple";
}

TEST(Npy, RejectsWhatItCannotRead) {
  fs::path dir = temp_dir("bad");
  std::string path = (dir / "x.npy").string();
  write_file_atomic(path, "not numpy");
  EXPECT_THROW(read_npy(path), std::runtime_error);
  HostTensor f = array_of<float>(DType::f32, {4}, {1, 2, 3, 4});
  write_npy(path, f);
  std::string bytes = read_text_file(path);
  write_file_atomic(path, bytes.substr(0, bytes.size() - 4));  // one element short
  try {
    read_npy(path);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("12 bytes of data, but shape [4] of f32 needs 16"), std::string::npos) << e.what();
  }
}

// A header's shape that is not a tuple of integers: "error: stoll" before,
// (4.0,) read as 4, and a shape without its ')' looped forever (issue #34).
TEST(Npy, ShapesThatAreNotTuplesOfIntegersAreNamed) {
  fs::path dir = temp_dir("shapes");
  const std::string path = (dir / "x.npy").string();
  write_npy(path, array_of<float>(DType::f32, {4}, {1, 2, 3, 4}));
  const std::string good = read_text_file(path);
  auto error_of = [&](const std::string& shape) {
    std::string bytes = good;
    const size_t at = bytes.find("(4,)");
    bytes.replace(at, 4, shape + std::string(4 - std::min<size_t>(4, shape.size()), ' '));
    if (shape.size() > 4) bytes.erase(bytes.find('\n') - (shape.size() - 4), shape.size() - 4);  // keep the header's length
    write_file_atomic(path, bytes);
    try {
      read_npy(path);
      return std::string("read");
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
  };
  EXPECT_EQ(error_of("(4,)"), "read");
  EXPECT_NE(error_of("(x,)").find("is not a tuple of non-negative integers: element 'x'"), std::string::npos);
  EXPECT_NE(error_of("(4.0,)").find("element '4.0'"), std::string::npos);
  EXPECT_NE(error_of("(-4,)").find("element '-4'"), std::string::npos);
  EXPECT_NE(error_of("(4, "), std::string("read")) << "no closing parenthesis";
  EXPECT_NE(error_of("(,)").find("an element is empty"), std::string::npos);
}

// Headers whose entries are cut short: each a clear error, never a read
// past the header (the fuzz target found a ':' missing after 'shape').
TEST(Npy, MalformedHeaderEntriesAreNamed) {
  auto npy_with_header = [](const std::string& header) {
    std::string h = header + std::string(63 - (10 + header.size()) % 64, ' ') + "\n";
    std::string bytes = std::string("\x93NUMPY\x01\x00", 8);
    bytes += char(h.size() & 0xff);
    bytes += char(h.size() >> 8);
    return bytes + h;
  };
  auto error_of = [&](const std::string& header) {
    try {
      parse_npy(npy_with_header(header), "x.npy");
      return std::string("read");
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
  };
  EXPECT_EQ(error_of("{'descr': '<f4', 'fortran_order': False, 'shape': (0,), }"), "read");
  EXPECT_NE(error_of("{'descr': '<f4', 'fortran_order': False, 'shape'").find("malformed 'shape' entry"), std::string::npos);
  EXPECT_NE(error_of("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2").find("malformed 'shape' entry"),
            std::string::npos);
  EXPECT_NE(error_of("{'descr': '<f4, 'fortran_order': False, 'shape': ()}").find("x.npy"), std::string::npos);
  EXPECT_NE(error_of("{'descr': '<f4', 'fortran_order': False").find("malformed 'fortran_order' entry"), std::string::npos);
}

TEST(Npy, RunReadsInputsAndWritesOutputs) {
  GraphBuilder b("io");
  b.task("act", "relu").tensor("x", DType::f32, {4}, Storage::external).tensor("out", DType::f32, {4}, Storage::external);
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  fs::path in = temp_dir("in"), out = temp_dir("out");
  write_npy((in / "act.x.npy").string(), array_of<float>(DType::f32, {4}, {-1, 2, -3, 4}));
  RunOptions options{1, (temp_dir("work")).string()};
  options.inputs_dir = in.string();
  options.outputs_dir = out.string();
  CheckedRun run = run_emulated_and_check(c, options);
  ASSERT_TRUE(run.ok()) << format_run(run);
  HostTensor result = read_npy((out / "act.out.npy").string());
  std::vector<float> values(4);
  std::memcpy(values.data(), result.data.data(), 16);
  EXPECT_EQ(values, (std::vector<float>{0, 2, 0, 4}));

  write_npy((in / "act.x.npy").string(), array_of<double>(DType::f64, {4}, {1, 2, 3, 4}));
  try {
    run_emulated_and_check(c, options);
    FAIL() << "a wrong dtype went unnoticed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("act.x.npy: f64 [4], but the graph input act.x is f32 [4]"), std::string::npos)
        << e.what();
  }
  fs::remove(in / "act.x.npy");
  try {
    run_emulated_and_check(c, options);
    FAIL() << "a missing input went unnoticed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("act.x.npy: missing; the graph input act.x is f32 [4]"), std::string::npos)
        << e.what();
  }
}

// --expected DIR (issue #43): each graph output also against another
// framework's result from the same inputs, within twice the end-to-end bound
// (both within the float64 reference's bound of the exact value). A matmul's
// expected output off by one f32 ulp passes; off by 1e-3 it fails, naming
// the element; a missing or mis-shaped file is an error naming it, and
// --steps refuses it.
TEST(Npy, RunComparesOutputsWithExpectedOnes) {
  GraphBuilder b("expected");
  b.task("mm", "matmul")
      .tensor("a", DType::f32, {3, 4}, Storage::external)
      .tensor("b", DType::f32, {4, 2}, Storage::external)
      .tensor("out", DType::f32, {3, 2}, Storage::external);
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  fs::path in = temp_dir("expected_in"), expected = temp_dir("expected_want");
  const std::vector<float> a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, bm = {1, -1, 2, -2, 3, -3, 4, -4};
  write_npy((in / "mm.a.npy").string(), array_of<float>(DType::f32, {3, 4}, a));
  write_npy((in / "mm.b.npy").string(), array_of<float>(DType::f32, {4, 2}, bm));
  std::vector<float> want(6);
  for (int m = 0; m < 3; ++m)
    for (int n = 0; n < 2; ++n)
      for (int k = 0; k < 4; ++k) want[size_t(m * 2 + n)] += a[size_t(m * 4 + k)] * bm[size_t(k * 2 + n)];
  want[3] = std::nextafter(want[3], 0.0f);  // another framework's rounding
  write_npy((expected / "mm.out.npy").string(), array_of<float>(DType::f32, {3, 2}, want));
  RunOptions options{1, (temp_dir("expected_work")).string()};
  options.inputs_dir = in.string();
  options.expected_dir = expected.string();
  CheckedRun run = run_emulated_and_check(c, options);
  ASSERT_EQ(run.expected_checks.size(), 1u);
  EXPECT_TRUE(run.ok()) << format_run(run);
  EXPECT_NE(format_run(run).find("against the expected outputs in " + expected.string()), std::string::npos)
      << format_run(run);

  want[4] *= 1.001f;
  write_npy((expected / "mm.out.npy").string(), array_of<float>(DType::f32, {3, 2}, want));
  run = run_emulated_and_check(c, options);
  EXPECT_FALSE(run.ok());
  EXPECT_TRUE(run.checks[0].ok()) << "the float64 reference check is unaffected";
  EXPECT_NE(format_run(run).find("FAIL: 1 elements out of bounds; first at 4"), std::string::npos) << format_run(run);

  write_npy((expected / "mm.out.npy").string(), array_of<float>(DType::f32, {2, 3}, want));
  try {
    run_emulated_and_check(c, options);
    FAIL() << "a mis-shaped expected output went unnoticed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("mm.out.npy: f32 [2, 3], but the graph output mm.out is f32 [3, 2]"),
              std::string::npos)
        << e.what();
  }
  fs::remove(expected / "mm.out.npy");
  try {
    run_emulated_and_check(c, options);
    FAIL() << "a missing expected output went unnoticed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("mm.out.npy: missing; --expected needs a file for every graph output"),
              std::string::npos)
        << e.what();
  }
  options.steps = 2;
  EXPECT_THROW(run_emulated_and_check(c, options), std::runtime_error);
}

// Non-finite inputs (issue #34): an infinity that the graph computes exactly
// failed its check as "got inf, want inf" (or 0 against 0, under a NaN
// bound); equal results pass now, and a failure under a non-finite bound
// says so.
TEST(Npy, NonFiniteInputsAreCheckedAsTheyAre) {
  GraphBuilder b("nonfinite");
  b.task("act", "relu").tensor("x", DType::f32, {4}, Storage::external).tensor("out", DType::f32, {4}, Storage::external);
  b.task("sum", "add")
      .tensor("a", DType::f32, {4}, Storage::external)
      .tensor("b", DType::f32, {4}, Storage::external)
      .tensor("out", DType::f32, {4}, Storage::external);
  Compiled c = compile(load_program(std::move(b).graph(), {}), {});
  fs::path in = temp_dir("nonfinite_in");
  RunOptions options{1, (temp_dir("nonfinite_work")).string()};
  options.inputs_dir = in.string();
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  write_npy((in / "act.x.npy").string(), array_of<float>(DType::f32, {4}, {-inf, 2, inf, 4}));
  write_npy((in / "sum.a.npy").string(), array_of<float>(DType::f32, {4}, {inf, 1, 2, 3}));
  write_npy((in / "sum.b.npy").string(), array_of<float>(DType::f32, {4}, {1, 1, 1, 1}));
  CheckedRun run = run_emulated_and_check(c, options);
  EXPECT_TRUE(run.ok()) << format_run(run);
  write_npy((in / "sum.a.npy").string(), array_of<float>(DType::f32, {4}, {1, nan, 3, 4}));
  run = run_emulated_and_check(c, options);
  EXPECT_FALSE(run.ok()) << "NaN never passes";
  EXPECT_NE(format_run(run).find("first at 1: got nan, want nan (the reference value is not finite"), std::string::npos)
      << format_run(run);
}

// Issue #43: a train-mode ResNet-18 at 2 x 32 x 32 failed `cudagen run`
// with a NaN bound: its last stage's BatchNorms normalise two values a
// channel, each multiplying the first-order magnitudes by about rstd^3, which
// overflowed to infinity, and a ReLU's masked gradient made inf * 0 = NaN.
// A bound that is not finite where the reference value is bounds nothing:
// such an element passes where it is finite, is counted, and the table says so.
TEST(Npy, AnOverflowedBoundChecksOnlyThatTheValueIsFinite) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(check_element(1.0, 1.5, 1.0), ElementVerdict::within);
  EXPECT_EQ(check_element(1.0, 3.0, 1.0), ElementVerdict::outside);
  EXPECT_EQ(check_element(1.0, 3.0, inf), ElementVerdict::unbounded);
  EXPECT_EQ(check_element(1.0, 3.0, nan), ElementVerdict::unbounded);
  EXPECT_EQ(check_element(inf, 3.0, nan), ElementVerdict::outside) << "an infinity where the reference is finite";
  EXPECT_EQ(check_element(nan, 3.0, inf), ElementVerdict::outside) << "NaN never passes";
  EXPECT_EQ(check_element(nan, nan, nan), ElementVerdict::outside);
  EXPECT_EQ(check_element(inf, inf, nan), ElementVerdict::within);
  EXPECT_EQ(check_element(2.0, nan, inf), ElementVerdict::outside) << "a NaN reference is no overflowed bound";

  CheckedRun run;
  OutputCheck check;
  check.buffer = "layer4.0.bn1.weight";
  check.elements = 512;
  check.unbounded = 394;
  run.checks.push_back(check);
  const std::string table = format_run(run);
  EXPECT_NE(table.find("ok, 394 with no bound: finite**"), std::string::npos) << table;
  EXPECT_NE(table.find("** the float64 reference's first-order error bound overflowed"), std::string::npos) << table;
  EXPECT_TRUE(run.ok());
}

// The logistic ops at the ends of f32's range: exp(-x) overflowed for x <
// -88.7 (silu(-89) came out -0 where it is -2e-37), exp(-2u) in gelu's tanh
// form from x < -9.9 (gelu(-10.08) -0 for -1.9e-38), and 1 - sigmoid(x) was 0
// from x > 17 (sigmoid's gradient at 20 is 2e-9). Each against the float64
// reference, forward and backward.
TEST(Npy, LogisticOpsKeepTheirTails) {
  const std::vector<float> x = {-120, -100, -89, -88, -20, -10.3f, -10.08f, -10, -9.9f, -1, 0, 1, 17, 20, 40, 89, 120};
  const int64_t n = int64_t(x.size());
  GraphBuilder b("tails");
  for (const char* op : {"sigmoid", "silu", "gelu"})
    b.task(op, op).tensor("x", DType::f32, {n}, Storage::external).tensor("out", DType::f32, {n}, Storage::external);
  for (const char* op : {"sigmoid_backward", "silu_backward", "gelu_backward"})
    b.task(op, op)
        .tensor("x", DType::f32, {n}, Storage::external)
        .tensor("dout", DType::f32, {n}, Storage::external)
        .tensor("dx", DType::f32, {n}, Storage::external);
  CompileOptions unfused;
  unfused.fuse.enabled = false;
  Compiled c = compile(load_program(std::move(b).graph(), {}), unfused);
  fs::path in = temp_dir("tails_in");
  RunOptions options{1, (temp_dir("tails_work")).string()};
  options.inputs_dir = in.string();
  for (const char* op : {"sigmoid", "silu", "gelu", "sigmoid_backward", "silu_backward", "gelu_backward"})
    write_npy((in / (std::string(op) + ".x.npy")).string(), array_of<float>(DType::f32, {n}, x));
  for (const char* op : {"sigmoid_backward", "silu_backward", "gelu_backward"})
    write_npy((in / (std::string(op) + ".dout.npy")).string(), array_of<float>(DType::f32, {n}, std::vector<float>(x.size(), 1.0f)));
  CheckedRun run = run_emulated_and_check(c, options);
  ASSERT_EQ(run.checks.size(), 6u);
  EXPECT_TRUE(run.ok()) << format_run(run);
}
