// Closure completeness (DESIGN.md §5): what the indexer recorded for each op
// is enough to compile it. Each op's closure alone, after the prelude,
// compiles with NVRTC for sm_80 and sm_90; the generated kernels of every op
// the emitter supports (the every_template_op snapshot instantiates each)
// compile there too, and ptxas reports no spills. No GPU needed.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <filesystem>
#include <map>
#include <regex>

#include <gtest/gtest.h>

#include "emit.h"
#include "file_util.h"
#include "nvrtc.h"
#include "pipeline.h"
#include "registry.h"
#include "templates_embedded.h"

using namespace cudagen;

TEST(Closure, EachOpsClosureAloneCompilesWithNvrtc) {
  OpRegistry reg = builtin_registry();
  std::map<std::string, const TemplateDefinition*> by_id;
  for (const auto& d : reg.definitions()) by_id[d.id] = &d;
  ASSERT_GE(reg.ops().size(), 40u);
  for (const auto& op : reg.ops()) {
    std::string source(embedded_template("prelude.cuh"));
    for (const auto& id : op.closure) source += by_id.at(id)->text;
    for (const char* arch : {"sm_80", "sm_90"}) {
      try {
        nvrtc_compile(source, op.name + ".cu", arch, /*ptx=*/true);
      } catch (const NvrtcError& e) {
        ADD_FAILURE() << "op " << op.name << " (" << arch << "): its closure does not compile alone:\n" << e.what();
      }
    }
  }
}

// The instantiated kernels: registers and spills from ptxas -v, per kernel.
TEST(Closure, GeneratedKernelsOfEveryOpHaveNoSpills) {
  const std::string ptxas = CUDAGEN_PTXAS;
  ASSERT_TRUE(std::filesystem::exists(ptxas)) << "ptxas not found at " << ptxas;
  Compiled c =
      compile(load_program(std::string(CUDAGEN_SOURCE_DIR) + "/tests/snapshots/every_template_op.json", {}), {});
  NvrtcOutput ptx = nvrtc_compile(c.emitted.cuda_source, "every_template_op.cu", "sm_90", /*ptx=*/true);
  std::string dir =
      (std::filesystem::temp_directory_path() / ("cudagen_ptxas_" + std::to_string(::getpid()))).string();
  std::filesystem::create_directories(dir);
  std::string ptx_text(ptx.binary.begin(), ptx.binary.end());
  ptx_text.resize(std::strlen(ptx_text.c_str()));  // NVRTC's PTX ends in a NUL, which ptxas refuses
  write_file_atomic(dir + "/ops.ptx", ptx_text);
  std::string cmd = ptxas + " -arch=sm_90 -v " + dir + "/ops.ptx -o " + dir + "/ops.cubin > " + dir + "/ptxas.txt 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << read_text_file(dir + "/ptxas.txt");
  std::string report = read_text_file(dir + "/ptxas.txt");
  std::filesystem::remove_all(dir);

  // ptxas -v: "Compiling entry function 'k0_fill' for 'sm_90'", then
  // "N bytes stack frame, N bytes spill stores, N bytes spill loads", then "Used N registers".
  std::regex entry(R"(Compiling entry function '(\w+)')"), spill(R"((\d+) bytes spill stores, (\d+) bytes spill loads)"),
      used(R"(Used (\d+) registers)");
  std::map<std::string, int> registers;
  std::string kernel;
  std::istringstream lines(report);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_search(line, m, entry)) kernel = m[1];
    if (std::regex_search(line, m, spill))
      EXPECT_TRUE(m[1] == "0" && m[2] == "0") << kernel << " spills: " << line;
    if (std::regex_search(line, m, used)) registers[kernel] = std::stoi(m[1]);
  }
  EXPECT_EQ(registers.size(), c.emitted.kernels.size()) << report;
  for (const auto& [name, regs] : registers) {
    EXPECT_LE(regs, 255) << name;
    if (name.find("matmul") != std::string::npos || name.find("softmax") != std::string::npos)
      std::printf("  ptxas sm_90: %-24s %3d registers, no spills\n", name.c_str(), regs);
  }
}
