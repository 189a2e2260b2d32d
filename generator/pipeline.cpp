#include "pipeline.h"

#include <algorithm>

#include <fmt/format.h>

#include "arch.h"
#include "autocast.h"
#include "derive.h"
#include "describe.h"
#include "file_util.h"
#include "graph_json.h"
#include "perf_model.h"

namespace cudagen {

OpRegistry load_registry(const FrontendOptions& options) {
  if (options.registry_file.empty()) return builtin_registry();
  return OpRegistry::from_json(read_text_file(options.registry_file), options.registry_file);
}

namespace {

// validate, then, for a graph that asks for training: its precision policy
// applied to the forward (validated again), derived, and the result validated.
Program validate_and_derive(TaskGraph graph, const FrontendOptions& options, const ValidateOptions& validate_options) {
  OpRegistry registry = load_registry(options);
  Program program = validate(std::move(graph), registry, validate_options);
  if (!program.graph.training) return program;
  if (const auto& precision = program.graph.training->precision; precision && *precision != DType::f32)
    program = validate(apply_precision(program), registry, validate_options);
  DerivedGraph derived = derive_training(program, *program.graph.training);
  return validate(std::move(derived.graph), std::move(registry), validate_options);
}

}  // namespace

Program load_program(const std::string& graph_path, const FrontendOptions& options) {
  TaskGraph graph = read_graph_file(graph_path);
  ValidateOptions validate_options = options.validate;
  validate_options.file = graph_path;
  return validate_and_derive(std::move(graph), options, validate_options);
}

Program load_program(TaskGraph graph, const FrontendOptions& options) {
  return validate_and_derive(std::move(graph), options, options.validate);
}

std::string describe_options(const CompileOptions& options) {
  std::string fusion = options.fuse.enabled ? "on" : "off";
  for (const auto& rule : options.fuse.disabled_rules) fusion += ",-" + rule;
  std::string megakernel;
  if (options.emit.megakernel)
    megakernel = fmt::format(" megakernel blocks={} watchdog={}ms{}", options.emit.megakernel_blocks,
                             options.emit.megakernel_watchdog_ms,
                             options.emit.megakernel_break_schedule ? " break-schedule" : "");
  return fmt::format("arch={}{}{}{}{} fuse={} reuse={} alignment={} budget={}{}{}", options.emit.arch,
                     options.emit.sms > 0 && options.emit.sms != device_model(Target{options.emit.arch}).sms
                         ? fmt::format(" sms={}", options.emit.sms)
                         : "",
                     options.emit.allow_tf32 ? " tf32" : "",
                     options.emit.atomic_attention_backward ? " atomic-attention-backward" : "",
                     options.emit.stream_k ? " stream-k" : "", fusion, options.plan.placement.reuse ? "on" : "off",
                     options.plan.placement.alignment, options.plan.budget_bytes,
                     options.emit.step_function ? " step" : "", megakernel);
}

namespace {

std::string dump_schedule(const Program& p, const Schedule& s) {
  std::string out;
  for (size_t i = 0; i < s.order.size(); ++i) {
    const Task& t = *p.tasks[size_t(s.order[i])].task;
    out += fmt::format("{:>5}  {:<9} {:<24} {}\n", i, to_string(t.phase), t.id, t.op);
  }
  return out;
}

// The kernels, a line each, and why adjacent tasks stayed apart; with `ir`
// (--dump-after fuse) each kernel's IR after them.
std::string dump_fusion(const Program& p, const Fusion& fusion, bool ir) {
  std::string out = fmt::format("{} kernels in {} launches\n", fusion.kernels.size(), launch_count(fusion.kernels));
  for (const auto& k : fusion.kernels) {
    std::vector<std::string> ids, internal;
    for (int t : k.prologue)
      ids.push_back(p.tasks[size_t(t)].task->id +
                    (norm_prologue(p, k) && stores_norm(p, k, t) ? " (prologue, stored here)" : " (prologue)"));
    for (int t : k.tasks) ids.push_back(p.tasks[size_t(t)].task->id);
    for (int b : k.internal_buffers) internal.push_back(buffer_name(p, b));
    out += fmt::format("L{:<4} {:<28} {:<9} {}", k.launch, k.name, to_string(k.phase), fmt::join(ids, ", "));
    if (const std::vector<std::string> rules = kernel_rules(p, k); !rules.empty()) out += fmt::format("  [{}]", fmt::join(rules, ", "));
    if (!internal.empty()) out += fmt::format("  in registers: {}", fmt::join(internal, ", "));
    out += "\n";
  }

  if (!fusion.notes.empty()) out += "\nnot fused with the task before:\n";
  for (const auto& n : fusion.notes)
    out += fmt::format("  {:<24} after {:<24} {}\n", p.tasks[size_t(n.task)].task->id,
                       p.tasks[size_t(n.previous)].task->id, n.reason);
  if (!fusion.launch_notes.empty()) out += "\nnot in the launch before (rule horizontal), by the kernel's first task:\n";
  for (const auto& n : fusion.launch_notes)
    out += fmt::format("  {:<24} after {:<24} {}\n", p.tasks[size_t(n.task)].task->id,
                       p.tasks[size_t(n.previous)].task->id, n.reason);
  if (ir) {
    out += "\nthe kernels' IR (docs/architecture.md §12): each mainloop, its stages, their operands and epilogues\n";
    for (const auto& k : fusion.kernels) {
      // The tile its mainloop runs, decided with the IR (KernelGroup::gemm, ::flash).
      std::string tile;
      if (k.ir.mainloop == kir::Mainloop::gemm || k.gemm.launched_alone()) tile = "  on " + k.gemm.describe() + "\n";
      if (k.flash) tile = "  on the flash kernel, " + k.flash->describe() + "\n";
      else if (k.rule == FusionRule::attention) tile = "  not on the flash kernel: " + k.why_not_flash + "\n";
      out += fmt::format("\n{}\n{}{}", k.name, tile, kir::print(p, k.ir));
    }
  }
  return out;
}

std::string dump_plan(const Program& p, const Plan& plan) {
  std::string out = fmt::format(
      "arena {} bytes (persistent region {}), lower bound {}, without reuse {}, alignment {}, method {}\n",
      plan.arena_bytes, plan.persistent_bytes, plan.lower_bound, plan.no_reuse_bytes, plan.alignment, plan.method);
  out += fmt::format("{:<28} {:>10} {:>10} {:>6} {:>6}  {}\n", "buffer", "offset", "bytes", "first", "last", "storage");
  auto name = [&](int buffer) { return buffer_name(p, buffer); };
  for (const auto& pb : plan.buffers) {
    const BufferInfo& b = p.buffers[size_t(pb.buffer)];
    std::string note = pb.in_place_of >= 0 ? ", in place of " + name(pb.in_place_of) : "";
    out += fmt::format("{:<28} {:>10} {:>10} {:>6} {:>6}  {}{}\n", name(pb.buffer), pb.offset, pb.bytes, pb.first, pb.last,
                       to_string(b.storage), note);
  }
  for (const auto& sc : plan.scalars)
    out += fmt::format("{:<28} {:>10} {:>10} {:>6} {:>6}  scalar ({}, initially {})\n", sc.name(p), sc.offset, kScalarBytes,
                       "-", "-", to_string(sc.type), arg_value_to_string(sc.initial));
  return out;
}

}  // namespace

Compiled compile(Program program, const CompileOptions& options) {
  Compiled c = plan_program(std::move(program), options);
  EmitOptions emit_options = options.emit;
  emit_options.options_text = describe_options(options);
  c.emitted = emit(c.program, c.kernels, c.plan, emit_options);
  // What the emitter adds after the plan (split-K's workspace, flash
  // attention's saved statistics, counters) counts against the budget too.
  if (options.plan.budget_bytes > 0 && c.emitted.arena_bytes > options.plan.budget_bytes) {
    Diagnostics diags;
    diags.add(Diagnostic{{}, {}, {}, {}, {},
                         fmt::format("the arena needs {} bytes ({}), {} over the budget of {} bytes: the memory plan's "
                                     "{} bytes fit, the kernels' workspaces after it ({} bytes: split-K's partial sums, "
                                     "flash attention's saved row statistics, counters) do not",
                                     c.emitted.arena_bytes, human_bytes(c.emitted.arena_bytes),
                                     c.emitted.arena_bytes - options.plan.budget_bytes, options.plan.budget_bytes,
                                     c.plan.arena_bytes, c.emitted.arena_bytes - c.plan.arena_bytes),
                         "raise the budget, or shrink the largest live tensors (smaller batch or sequence)"});
    throw CompileError(std::move(diags));
  }
  // A megakernel's event counters follow the plan's buffers; the runtime
  // allocates the whole.
  c.plan.arena_bytes = c.emitted.arena_bytes;
  if (options.dump_after == "emit") c.dump = c.emitted.cuda_source;
  return c;
}

Compiled plan_program(Program program, const CompileOptions& options) {
  std::string why_not_arch;
  if (!parse_arch(options.emit.arch, &why_not_arch)) {
    Diagnostics diags;
    diags.add(Diagnostic{{}, {}, {}, {}, {}, "the target architecture (--arch): " + why_not_arch,
                         "name the GPU's architecture, such as sm_80 (A100), sm_89 (L4), sm_90a (H100, H200)"});
    throw CompileError(std::move(diags));
  }
  Compiled c;
  c.options = options;
  c.program = std::move(program);
  auto dump = [&](const char* pass, auto&& text) {
    if (options.dump_after == pass) c.dump = text();
  };
  dump("validate", [&] { return describe(c.program); });

  c.schedule = schedule(c.program);
  dump("schedule", [&] { return dump_schedule(c.program, c.schedule); });

  FuseOptions fuse_options = options.fuse;
  fuse_options.megakernel = options.emit.megakernel;
  fuse_options.allow_tf32 = options.emit.allow_tf32;  // one flag: which kernels launch alone, and what they run
  fuse_options.target = options.emit.target();
  fuse_options.atomic_attention_backward = options.emit.atomic_attention_backward;
  fuse_options.stream_k = options.emit.stream_k;
  Fusion fusion = fuse(c.program, c.schedule, fuse_options);
  dump("fuse", [&] { return dump_fusion(c.program, fusion, true); });
  c.kernels = std::move(fusion.kernels);
  c.fusion_notes = std::move(fusion.notes);
  c.launch_notes = std::move(fusion.launch_notes);

  c.plan = plan_memory(c.program, c.kernels, options.plan);
  c.plan.planned_bytes = c.plan.arena_bytes;
  dump("plan", [&] { return dump_plan(c.program, c.plan); });
  return c;
}

std::string plan_table(const Program& program, const Plan& plan) { return dump_plan(program, plan); }

std::string fusion_table(const Compiled& c) {
  return dump_fusion(c.program, Fusion{c.kernels, c.fusion_notes, c.launch_notes}, false);
}

std::string describe_arena(const Compiled& c) {
  int64_t in_registers = 0;
  int buffers = 0;
  for (size_t b = 0; b < c.plan.buffers.size(); ++b)
    if (c.plan.buffers[b].internal) {
      in_registers += c.program.buffers[b].bytes;
      ++buffers;
    }
  const int64_t after = c.emitted.arena_bytes - c.plan.planned_bytes;
  std::string out = fmt::format("\narena: {} bytes ({}): the plan's {} (its lower bound {})", c.emitted.arena_bytes,
                                human_bytes(c.emitted.arena_bytes), c.plan.planned_bytes, c.plan.lower_bound);
  if (after > 0) {
    std::vector<std::string> what;
    if (std::any_of(c.kernels.begin(), c.kernels.end(), [](const KernelGroup& k) { return k.flash_trained; }))
      what.push_back("flash attention's saved row statistics");
    if (c.options.emit.megakernel) what.push_back("the megakernel's event counters");
    else if (c.emitted.sync_bytes > 0) what.push_back("split-K's partial sums and counters");
    out += fmt::format(" and {} after it ({})", after, fmt::join(what, ", "));
  }
  if (buffers > 0)
    out += fmt::format("; {} buffer{} ({}) kept in kernels' registers or shared memory take none", buffers,
                       buffers == 1 ? "" : "s", human_bytes(in_registers));
  return out + "\n";
}

std::string describe_matmul_paths(const Compiled& c) {
  std::string out;
  for (const EmittedKernel& k : c.emitted.kernels)
    if (!k.matmul_path.empty()) out += fmt::format("  {}: {}\n", k.name, k.matmul_path);
  const DeviceModel device = device_model(c.options.emit.target());
  return (out.empty() ? "" : "\nmatmul mainloops:\n" + out) +
         estimates_table(estimate_kernels(c.emitted, device), device);
}

}  // namespace cudagen
