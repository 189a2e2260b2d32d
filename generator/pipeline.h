// The compiler's driver (docs/architecture.md §1): each entry point is a visible
// sequence of passes, one call per pass, and the state after any pass can be
// printed (`cudagen compile --dump-after=PASS`).
#pragma once

#include <string>
#include <vector>

#include "emit.h"
#include "fuse.h"
#include "kernels.h"
#include "plan.h"
#include "program.h"
#include "schedule.h"
#include "validate.h"

namespace cudagen {

struct FrontendOptions {
  std::string registry_file;  // empty: the bundled registry
  ValidateOptions validate;
};

struct CompileOptions {
  FrontendOptions frontend;
  FuseOptions fuse;
  PlanOptions plan;
  EmitOptions emit;
  std::string dump_after;  // a pass name from kPassNames, or empty
};

inline const std::vector<std::string> kPassNames = {"validate", "schedule", "fuse", "plan", "emit"};

OpRegistry load_registry(const FrontendOptions& options);

// read (JSON) -> validate, and where the graph asks for training: derive -> validate
Program load_program(const std::string& graph_path, const FrontendOptions& options);

// validate, for a graph made in code (the builder API)
Program load_program(TaskGraph graph, const FrontendOptions& options);

struct Compiled {
  CompileOptions options;  // what it was compiled with
  Program program;
  Schedule schedule;
  std::vector<KernelGroup> kernels;
  std::vector<FusionNote> fusion_notes;  // why adjacent tasks were left in separate kernels
  std::vector<FusionNote> launch_notes;  // why adjacent kernels were left in separate launches
  Plan plan;
  EmittedProgram emitted;
  std::string dump;  // the state after options.dump_after, as text
};

// schedule -> kernels -> plan -> emit, on a validated program.
Compiled compile(Program program, const CompileOptions& options);

// schedule -> kernels -> plan: every pass but emit (`cudagen plan` works for
// graphs whose ops have no template yet).
Compiled plan_program(Program program, const CompileOptions& options);

// The plan as a table: buffer, offset, bytes, first and last kernel, storage.
std::string plan_table(const Program& program, const Plan& plan);

// The kernels (fusion groups) with their launches, and why adjacent tasks and
// kernels were left apart: what `--dump-after fuse` and `cudagen describe` print.
std::string fusion_table(const Compiled& compiled);

// The options as one line, for the provenance header and the manifest.
std::string describe_options(const CompileOptions& options);

// The arena a compiled graph runs in, against its plan, and what fusion kept
// out of it (`cudagen describe`: its storage table lists the graph's buffers
// as declared).
std::string describe_arena(const Compiled& compiled);

// Which mainloop each matmul kernel runs, and why (`cudagen describe`).
std::string describe_matmul_paths(const Compiled& compiled);

}  // namespace cudagen
