// Closure completeness (docs/architecture.md §5): what the indexer recorded for each op
// is enough to compile it. Each op's closure alone, after the prelude,
// compiles with NVRTC for sm_80 and sm_90; the generated kernels of every op
// the emitter supports (the every_template_op snapshot instantiates each)
// compile there too, and ptxas reports no spills. No GPU needed.
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <filesystem>
#include <map>

#include <gtest/gtest.h>

#include "emit.h"
#include "file_util.h"
#include "nvrtc.h"
#include "pipeline.h"
#include "registry.h"
#include "ptxas_report.h"
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
  Compiled c =
      compile(load_program(std::string(CUDAGEN_SOURCE_DIR) + "/tests/snapshots/every_template_op.json", {}), {});
  auto resources = cudagen::testing::ptxas_resources(c.emitted.cuda_source, "sm_90");
  EXPECT_EQ(resources.size(), c.emitted.kernels.size());
  for (const auto& [name, r] : resources) {
    EXPECT_EQ(r.spill_bytes, 0) << name << " spills";
    EXPECT_LE(r.registers, 255) << name;
    if (name.find("matmul") != std::string::npos || name.find("softmax") != std::string::npos)
      std::printf("  ptxas sm_90: %-24s %3d registers, no spills\n", name.c_str(), r.registers);
  }
}
