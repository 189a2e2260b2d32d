// The float64 references of user ops (docs/templates.md, `reference:`): the
// host functions their templates give, compiled by the host compiler with the
// emulation header (as the emulation build is) and loaded, for the reference
// evaluator (reference.h) that `cudagen run` checks results against.
#pragma once

#include <optional>
#include <string>

#include "host_module.h"
#include "program.h"
#include "reference.h"

namespace cudagen {

struct UserReferences {
  std::optional<HostModule> module;  // holds the functions; empty when no op needs one
  UserOpReferences ops;
};

// The source of the host library: the prelude, the closures of the ops'
// reference functions, and per op an extern "C" entry that takes its inputs
// then its arguments as one array. Empty when no op of the program has a
// reference function. Deterministic.
std::string user_reference_source(const Program& program);

// Builds and loads them in `work_dir`; an op whose function does not compile
// is named in the BuildError, with the host compiler's output.
UserReferences build_user_references(const Program& program, const std::string& work_dir);

}  // namespace cudagen
