#include "user_reference.h"

#include <optional>
#include <set>

#include <fmt/format.h>

#include "emit.h"  // template_definitions
#include "file_util.h"
#include "templates_embedded.h"

namespace cudagen {

namespace {

// The ops of the program that give a reference function, each once, by name.
std::vector<const OpSignature*> ops_with_functions(const Program& program) {
  std::vector<const OpSignature*> ops;
  std::set<std::string> seen;
  for (const auto& t : program.tasks)
    if (!t.op->reference.empty() && t.op->reference != "none" && seen.insert(t.op->name).second) ops.push_back(t.op);
  return ops;
}

std::string entry_name(const OpSignature& op) { return "cudagen_reference_" + op.name; }

}  // namespace

std::string user_reference_source(const Program& program) {
  const std::vector<const OpSignature*> ops = ops_with_functions(program);
  if (ops.empty()) return {};
  std::set<std::string> needed;
  for (const OpSignature* op : ops)
    if (const auto* closure = op->closure_of(op->reference)) needed.insert(closure->begin(), closure->end());
  std::string out =
      "// The float64 references of user ops, built by cudagen run for its checks (runtime/user_reference.h).\n";
  out += embedded_template("prelude.cuh");
  out += template_definitions(program.registry, needed) + "\n";
  for (const OpSignature* op : ops) {
    int count = 0;
    for (const auto& slot : op->tensors) count += slot.role != SlotRole::output && !slot.written();
    count += int(op->args.size());
    std::string call;
    for (int i = 0; i < count; ++i) call += fmt::format("{}v[{}]", i ? ", " : "", i);
    out += fmt::format("extern \"C\" double {}(const double* v) {{ return {}({}); }}\n", entry_name(*op), op->reference,
                       call);
  }
  return out;
}

UserReferences build_user_references(const Program& program, const std::string& work_dir) {
  UserReferences refs;
  const std::string source = user_reference_source(program);
  if (source.empty()) return refs;
  std::optional<TempDir> private_dir;  // removed on return; the loaded library stays mapped
  if (work_dir.empty()) private_dir.emplace("cudagen-references-");
  try {
    refs.module = HostModule::build(source, work_dir.empty() ? private_dir->path() : work_dir);
  } catch (const BuildError& e) {
    std::string names;
    for (const OpSignature* op : ops_with_functions(program))
      names += fmt::format("{}'{}' ({})", names.empty() ? "" : ", ", op->name, op->reference);
    throw BuildError(fmt::format(
        "the float64 reference functions of {} do not build; each takes the op's inputs, then its arguments, as "
        "double, and returns the output as double (docs/templates.md):\n{}",
        names, e.what()));
  }
  for (const OpSignature* op : ops_with_functions(program))
    refs.ops.functions[op->name] = reinterpret_cast<ElementReference>(refs.module->address_of(entry_name(*op)));
  return refs;
}

}  // namespace cudagen
