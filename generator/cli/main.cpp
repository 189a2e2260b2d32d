// The `cudagen` command line.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "arch.h"
#include "describe.h"
#include "emit.h"
#include "diagnostics.h"
#include "file_util.h"
#include "graph_json.h"
#include "pipeline.h"
#include "placement.h"
#include "jit.h"
#include "nvrtc.h"
#include "profile.h"
#include "runner.h"
#include "user_templates.h"
#include "version.h"

namespace cudagen {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitBadInput = 1;
constexpr int kExitUsage = 2;

struct Cli {
  FrontendOptions frontend;
  std::string graph_path;
  std::string output_path;
  std::string manifest_path;
  std::string header_path;
  CompileOptions compile;
  bool no_reuse = false;
  bool no_fuse = false;
  bool emulate = false;
  bool gpu = false;
  GpuOptions gpu_options;
  uint64_t seed = 1;
  std::string work_dir;
  std::string cu_path;
  bool ptx = false;
  bool check_each_task = false;
  bool arch_given = false;  // --arch on the command line
  bool markdown = false;
  bool json = false;
  std::string inputs_dir;
  std::string outputs_dir;
  std::string expected_dir;
  std::string buffers_csv;
  std::string svg_path;
  std::string method = "search";
  std::vector<std::string> template_dirs;
  std::vector<std::string> run_time_args;  // TASK.ARG=VALUE
  int steps = 0;
  int micro_batches = 1;
  std::vector<std::string> phases;
  std::string profile_path;
  std::string profile_sort;  // empty: time on a GPU, bytes in emulation
  ProfileOptions profile;
};

// "task.arg=value": true/false a bool, an integer an int, else a float.
std::pair<std::string, ArgValue> parse_run_time_arg(const std::string& text) {
  const size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == text.size())
    throw std::runtime_error(fmt::format("--arg {}: write TASK.ARG=VALUE, for example --arg opt.lr=0.01", text));
  std::string name = text.substr(0, eq), value = text.substr(eq + 1);
  if (value == "true" || value == "false") return {name, ArgValue(value == "true")};
  size_t used = 0;
  try {
    long long i = std::stoll(value, &used);
    if (used == value.size()) return {name, ArgValue(int64_t(i))};
    double d = std::stod(value, &used);
    if (used == value.size()) return {name, ArgValue(d)};
  } catch (const std::exception&) {
  }
  throw std::runtime_error(fmt::format("--arg {}: '{}' is not a number, true or false", text, value));
}

void add_templates_option(CLI::App* cmd, Cli& cli) {
  cmd->add_option("--templates", cli.template_dirs,
                  "a folder of your own op templates (*.cuh with CG_OP annotations; see docs/templates.md), indexed "
                  "with the bundled ones; may be given more than once")
      ->check(CLI::ExistingDirectory);
}

void add_frontend_options(CLI::App* cmd, Cli& cli) {
  cmd->add_option("GRAPH", cli.graph_path, "task graph file (JSON, format cudagen.taskgraph/1)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--registry", cli.frontend.registry_file,
                  "op registry file to use instead of the bundled one (format cudagen.registry/1)")
      ->check(CLI::ExistingFile);
  add_templates_option(cmd, cli);
  cmd->add_option("--max-tensor-bytes", cli.frontend.validate.max_tensor_bytes,
                  "largest tensor allowed, in bytes (larger is taken for a typo)")
      ->capture_default_str();
  cmd->add_option("--error-limit", cli.frontend.validate.error_limit, "stop listing errors after this many")
      ->capture_default_str();
}

int run_validate(const Cli& cli) {
  Program p = load_program(cli.graph_path, cli.frontend);
  fmt::print("{}: ok: {} tasks, {} buffers\n", cli.graph_path, p.tasks.size(), p.buffers.size());
  return kExitOk;
}

int run_describe(Cli& cli) {
  Program p = load_program(cli.graph_path, cli.frontend);
  fmt::print("{}", describe(p));
  cli.compile.frontend = cli.frontend;
  cli.compile.plan.placement.reuse = !cli.no_reuse;
  cli.compile.fuse.enabled = !cli.no_fuse;
  if (!cli.compile.emit.megakernel) {
    // The fusion pass needs no templates: a graph of ops without one still shows its kernels.
    fmt::print("\nkernels: {}", fusion_table(plan_program(std::move(p), cli.compile)));
    try {  // the emitter chooses the mainloops: compile again, to the end
      const Compiled c = compile(load_program(cli.graph_path, cli.frontend), cli.compile);
      fmt::print("{}{}", describe_matmul_paths(c), describe_arena(c));
    } catch (const CompileError&) {
      fmt::print("\nmatmul mainloops: not shown, the graph does not compile yet (`cudagen compile` says why)\n");
    }
    return kExitOk;
  }
  Compiled c = compile(std::move(p), cli.compile);
  fmt::print("\nkernels: {}", fusion_table(c));
  fmt::print("{}{}", describe_matmul_paths(c), describe_arena(c));
  fmt::print("\nmegakernel schedule:\n{}", describe_megakernel(c.emitted.megakernel, c.emitted.tile_kernels));
  return kExitOk;
}

int run_format(const Cli& cli) {
  std::string text = write_graph(read_graph_file(cli.graph_path));
  if (cli.output_path.empty() || cli.output_path == "-") {
    fmt::print("{}", text);
  } else {
    write_file_atomic(cli.output_path, text);
  }
  return kExitOk;
}

// --arch's check: the parser's reason, which names the fix.
const CLI::Validator kArchitecture(
    [](std::string& name) {
      std::string why;
      return parse_arch(name, &why) ? std::string() : why;
    },
    "sm_XY[a]");

void add_compile_options(CLI::App* cmd, Cli& cli) {
  cmd->add_option("--arch", cli.compile.emit.arch,
                  "target architecture: tuning, device model and megakernel size (sm_80, sm_89, sm_90a, ...; the "
                  "JIT uses its GPU's)")
      ->check(kArchitecture)
      ->capture_default_str();
  cmd->add_option("--sms", cli.compile.emit.sms,
                  "the GPU's SM count where it is not the architecture's usual one (132 for sm_90, 108 for sm_80): "
                  "an H100 PCIe has 114, an H20 78. Split-K, the Hopper tile's width, flash attention's split of the "
                  "keys and the performance model fill waves of these SMs (0: the architecture's; a run on a GPU "
                  "takes the GPU's)")
      ->check(CLI::Range(0, 4096))
      ->capture_default_str();
  cmd->add_flag("--allow-tf32", cli.compile.emit.allow_tf32,
                "run f32 matmuls and f32 attention on tensor cores as TF32 (PyTorch's allow_tf32): operands rounded "
                "to 10 mantissa bits, f32 accumulation; results are checked to f16's bound (docs/gemm.md, "
                "docs/attention.md)");
  cmd->add_flag("--atomic-attention-backward", cli.compile.emit.atomic_attention_backward,
                "flash attention's backward kernel sums dq with atomics: faster, but dq is no longer bit-identical "
                "from run to run (docs/attention.md)");
  cmd->add_flag("--stream-k", cli.compile.emit.stream_k,
                "Hopper matmuls whose tiles leave the last wave partly empty share that wave's k-tiles among all "
                "SMs (stream-K). Off by default: measured slower than whole tiles on an H100 (docs/gemm.md)");
  cmd->add_flag("--no-reuse", cli.no_reuse, "give every buffer its own storage (for debugging numerics)");
  cmd->add_flag("--no-fuse", cli.no_fuse, "one kernel per task, every intermediate in memory (docs/fusion.md)");
  cmd->add_option("--no-fuse-rule", cli.compile.fuse.disabled_rules, "turn one fusion rule off (repeatable)")
      ->check(CLI::IsMember(fusion_rule_names()));
  cmd->add_option("--alignment", cli.compile.plan.placement.alignment, "byte alignment of every buffer in the arena")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--budget", cli.compile.plan.budget_bytes, "fail when the arena needs more bytes than this; the placement search aims at it (0: none)")
      ->capture_default_str();
  cmd->add_flag("--step-function", cli.compile.emit.step_function,
                "also generate cudagen_step, one launcher that runs forward, backward and update (a training step)");
  cmd->add_flag("--megakernel", cli.compile.emit.megakernel,
                "one persistent kernel per phase, running the fused kernels as tile tasks in a fixed schedule "
                "synchronised by event counters (docs/megakernel.md)");
  cmd->add_option("--megakernel-blocks", cli.compile.emit.megakernel_blocks,
                  "blocks of the megakernel, all resident at once (0: one per SM of the target: --sms, or --arch's usual count; sm_90: 132)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--megakernel-watchdog-ms", cli.compile.emit.megakernel_watchdog_ms,
                  "a block that waits longer than this for an event stops the megakernel and reports it")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(1), int64_t(3600000)));
}

int run_compile(Cli& cli) {
  cli.compile.frontend = cli.frontend;
  cli.compile.plan.placement.reuse = !cli.no_reuse;
  cli.compile.fuse.enabled = !cli.no_fuse;
  Compiled c = compile(load_program(cli.graph_path, cli.frontend), cli.compile);
  if (!cli.compile.dump_after.empty()) fmt::print("{}", c.dump);
  // Both files or neither: write to temporaries first, then rename.
  // The .cu, its manifest and its header belong together: all of them are written, or none.
  std::vector<std::pair<std::string, std::string>> files;
  if (!cli.output_path.empty()) files.emplace_back(cli.output_path, c.emitted.cuda_source);
  if (!cli.manifest_path.empty()) files.emplace_back(cli.manifest_path, c.emitted.manifest_json);
  if (!cli.header_path.empty()) files.emplace_back(cli.header_path, c.emitted.host_header);
  write_files_atomic(files);
  if (!cli.output_path.empty())
    fmt::print(stderr, "{}: {} kernels, arena {} bytes (lower bound {}) -> {}\n", cli.graph_path, c.kernels.size(),
               c.plan.arena_bytes, c.plan.lower_bound, cli.output_path);
  return kExitOk;
}

// "prof.json" -> "prof.trace.json"; any other name gets ".trace.json" appended.
std::string trace_path_for(const std::string& profile_path) {
  const std::string suffix = ".json";
  if (profile_path.size() > suffix.size() && profile_path.compare(profile_path.size() - suffix.size(), suffix.size(), suffix) == 0)
    return profile_path.substr(0, profile_path.size() - suffix.size()) + ".trace.json";
  return profile_path + ".trace.json";
}

// After a checked run (so the arena holds real values): profile each phase,
// in emulation also the unfused program for fusion's saving, and write the
// table, the JSON and the trace.
void write_profile(const Cli& cli, const RunOptions& run_options, const Compiled& c, Executor& executor) {
  fmt::print("profiling on {} ...\n", executor.where());
  ProfileOptions options = cli.profile;
  options.phases = run_options.phases;
  Profile profile = profile_program(c, executor, options);
  if (!executor.on_gpu() && cli.compile.fuse.enabled) {
    CompileOptions unfused_options = cli.compile;
    unfused_options.fuse.enabled = false;
    Compiled unfused = compile(load_program(cli.graph_path, cli.frontend), unfused_options);
    fmt::print("measuring the unfused program ({} kernels) for comparison ...\n", unfused.kernels.size());
    RunOptions unfused_run = run_options;
    unfused_run.outputs_dir.clear();
    unfused_run.check_each_task = false;
    add_unfused_baseline(profile, profile_emulated(unfused, unfused_run, options));
  }
  const ProfileSort sort = cli.profile_sort == "time"    ? ProfileSort::time
                           : cli.profile_sort == "bytes" ? ProfileSort::bytes
                           : executor.on_gpu()           ? ProfileSort::time
                                                         : ProfileSort::bytes;
  fmt::print("\n{}", format_profile(profile, sort));
  const std::string trace_path = trace_path_for(cli.profile_path);
  write_file_atomic(cli.profile_path, profile_json(profile));
  write_file_atomic(trace_path, profile_trace(profile));
  fmt::print("profile written to {}; trace to {} (open it in ui.perfetto.dev)\n", cli.profile_path, trace_path);
}

int run_run(Cli& cli) {
  if (cli.emulate && cli.gpu) throw std::runtime_error("give --emulate or --gpu, not both");
  std::string why;
  GpuInfo gpu;
  const Backend backend =
      choose_backend(cli.emulate ? Backend::emulation : cli.gpu ? Backend::gpu : Backend::automatic,
                     cli.gpu_options.device, &why, &gpu);
  fmt::print("{}\n", why);
  // On a GPU, --arch (when given) is what NVRTC compiles for too; else the GPU's own.
  if (backend == Backend::gpu) {
    if (cli.arch_given)
      cli.gpu_options.arch = cli.compile.emit.arch;
    else
      cli.compile.emit.arch = gpu.arch;
    if (cli.compile.emit.sms == 0) cli.compile.emit.sms = gpu.sms;  // its tiles fill this GPU's waves
  }
  if (backend == Backend::emulation && cli.compile.emit.megakernel && cli.compile.emit.megakernel_blocks == 0) {
    cli.compile.emit.megakernel_blocks = kEmulatedMegakernelBlocks;
    fmt::print("megakernel: {} blocks in the host emulation (--megakernel-blocks sets it)\n", kEmulatedMegakernelBlocks);
  }
  cli.compile.frontend = cli.frontend;
  cli.compile.plan.placement.reuse = !cli.no_reuse && !cli.check_each_task;
  cli.compile.fuse.enabled = !cli.no_fuse && !cli.check_each_task;
  Program program = load_program(cli.graph_path, cli.frontend);
  // A user's op without a reference is unchecked, and what reads its output
  // is checked on the value it left in memory: no buffer may take that storage.
  for (const auto& t : program.tasks)
    if (t.op->reference == "none" && cli.compile.plan.placement.reuse) {
      cli.compile.plan.placement.reuse = false;
      fmt::print("memory reuse off: op '{}' has no float64 reference, and the tasks after it are checked on its output "
                 "as it stays in memory\n",
                 t.op->name);
    }
  Compiled c = compile(std::move(program), cli.compile);
  fmt::print("compiled {}: {} kernels, arena {} bytes (lower bound {})\n", cli.graph_path, c.kernels.size(),
             c.plan.arena_bytes, c.plan.lower_bound);
  RunOptions options;
  options.seed = cli.seed;
  // The emulation build's folder: the user's (kept), or a private one removed on every exit path.
  std::optional<TempDir> private_work_dir;
  if (cli.work_dir.empty()) private_work_dir.emplace("cudagen-run-");
  options.work_dir = cli.work_dir.empty() ? private_work_dir->path() : cli.work_dir;
  options.check_each_task = cli.check_each_task;
  options.inputs_dir = cli.inputs_dir;
  options.outputs_dir = cli.outputs_dir;
  options.expected_dir = cli.expected_dir;
  for (const auto& text : cli.run_time_args) options.args.insert(parse_run_time_arg(text));
  for (const auto& name : cli.phases) options.phases.push_back(*parse_phase(name));  // checked by CLI11
  options.steps = cli.steps;
  options.micro_batches = cli.micro_batches;
  if (cli.steps > 0)
    fmt::print("training for {} steps{} {}, each checked against the float64 reference\n", cli.steps,
               cli.micro_batches > 1 ? fmt::format(" of {} micro-batches", cli.micro_batches) : "",
               backend == Backend::gpu ? "on the GPU" : "in emulation");
  CheckedRun run;
  std::unique_ptr<Executor> executor;
  if (backend == Backend::gpu) {
    GpuCode code = compile_for_gpu(c, cli.gpu_options);
    fmt::print("{}\n", describe(code.report));
    if (!code.report.log.empty()) fmt::print(stderr, "{}\n", code.report.log);
    executor = make_gpu_executor(c, code, cli.gpu_options);
    run = run_and_check(c, *executor, options);
    fmt::print("GPU run: {:.3f} s with copies (seed {})\n", run.run_seconds, run.seed);
  } else {
    double compile_seconds = 0;
    executor = make_emulated_executor(c, options.work_dir, &compile_seconds);
    run = run_and_check(c, *executor, options);
    run.compile_seconds = compile_seconds;
    fmt::print("host compiler (emulation build): {:.2f} s; emulated run: {:.3f} s (seed {})\n", run.compile_seconds,
               run.run_seconds, run.seed);
  }
  fmt::print("checked against the float64 reference (|err| <= rtol * ref_abs + atol; rtol f64 1e-12, f32 1e-5, "
             "f16 5e-3, bf16 1e-2{}, or a coarser one the value was computed in; atol 2^-24 for f16, the smallest "
             "normal number for the others):\n{}",
             c.options.emit.allow_tf32 ? ", TF32 matmuls 5e-3" : "", format_run(run));
  if (!run.ok()) return kExitBadInput;
  if (!cli.profile_path.empty()) write_profile(cli, options, c, *executor);
  return kExitOk;
}

int run_nvrtc(const Cli& cli) {
  NvrtcOutput out = nvrtc_compile(read_text_file(cli.cu_path), cli.cu_path, cli.compile.emit.arch, cli.ptx);
  if (!out.log.empty()) fmt::print(stderr, "{}\n", out.log);
  fmt::print("{}: NVRTC {}.{} compiled it for {} in {:.2f} s: {} bytes of {}\n", cli.cu_path, out.version_major,
             out.version_minor, cli.compile.emit.arch, out.seconds, out.binary.size(), cli.ptx ? "PTX" : "CUBIN");
  if (!cli.output_path.empty()) write_file_atomic(cli.output_path, std::string(out.binary.begin(), out.binary.end()));
  return kExitOk;
}

std::string ratio(int64_t a, int64_t b) { return b > 0 ? fmt::format("{:.3f}", double(a) / double(b)) : "-"; }

int run_plan(Cli& cli) {
  cli.compile.plan.placement.reuse = !cli.no_reuse;
  cli.compile.fuse.enabled = !cli.no_fuse;
  cli.compile.plan.placement.method = cli.method == "greedy" ? PlacementMethod::greedy : PlacementMethod::search;
  if (!cli.buffers_csv.empty()) {
    if (!cli.graph_path.empty()) throw std::runtime_error("give a graph or --buffers, not both");
    BufferList list = read_buffer_csv(read_text_file(cli.buffers_csv), cli.buffers_csv);
    const int64_t budget = cli.compile.plan.budget_bytes;
    cli.compile.plan.placement.capacity = budget;
    auto start = std::chrono::steady_clock::now();
    Placement p = place_buffers(list.intervals, cli.compile.plan.placement);
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const int64_t alignment = cli.compile.plan.placement.alignment;
    std::string problem = verify_placement(list.intervals, p.offsets, p.arena_bytes, alignment);
    if (!problem.empty()) throw std::logic_error("the planner produced an invalid placement: " + problem);
    int64_t bound = lower_bound_bytes(list.intervals, alignment), no_reuse = 0;
    for (const auto& iv : list.intervals) no_reuse += (iv.bytes + alignment - 1) / alignment * alignment;
    fmt::print("{}: {} buffers\n", cli.buffers_csv, list.ids.size());
    fmt::print("  arena        {:>14} bytes ({}x the lower bound{})\n", p.arena_bytes, ratio(p.arena_bytes, bound),
               p.proven_optimal ? ", optimal" : "");
    fmt::print("  lower bound  {:>14} bytes\n  without reuse{:>14} bytes\n", bound, no_reuse);
    fmt::print("  method       {} ({} search steps), {:.3f} s, alignment {}\n", p.method, p.search_steps, seconds, alignment);
    if (budget > 0 && p.arena_bytes > budget)
      throw std::runtime_error(fmt::format("{}: the placement needs {} bytes, {} over the budget of {} bytes (lower "
                                           "bound {}); raise --budget or --search-steps",
                                           cli.buffers_csv, p.arena_bytes, p.arena_bytes - budget, budget, bound));
    if (!cli.output_path.empty()) write_file_atomic(cli.output_path, write_offsets_csv(list, p.offsets));
    if (!cli.svg_path.empty()) write_file_atomic(cli.svg_path, placement_svg(list.ids, list.intervals, p.offsets, bound));
    return kExitOk;
  }
  if (cli.graph_path.empty()) throw std::runtime_error("give a graph, or --buffers FILE.csv");
  Compiled c = plan_program(load_program(cli.graph_path, cli.frontend), cli.compile);
  fmt::print("{}", plan_table(c.program, c.plan));
  fmt::print("arena / lower bound: {}; arena / without reuse: {}\n", ratio(c.plan.arena_bytes, c.plan.lower_bound),
             ratio(c.plan.arena_bytes, c.plan.no_reuse_bytes));
  if (!cli.svg_path.empty()) {
    std::vector<std::string> names;
    std::vector<LiveInterval> intervals;
    std::vector<int64_t> offsets;
    for (const auto& pb : c.plan.buffers) {
      names.push_back(buffer_name(c.program, pb.buffer));
      intervals.push_back(LiveInterval{pb.bytes, pb.first, pb.last});
      offsets.push_back(pb.offset);
    }
    write_file_atomic(cli.svg_path, placement_svg(names, intervals, offsets, c.plan.lower_bound));
  }
  return kExitOk;
}

int run_ops(const Cli& cli) {
  OpRegistry reg = load_registry(cli.frontend);
  if (cli.markdown) {
    fmt::print("{}", ops_markdown(reg));
    return kExitOk;
  }
  if (cli.json) {
    fmt::print("{}", cli.frontend.registry_file.empty() ? std::string(builtin_registry_json())
                                                         : read_text_file(cli.frontend.registry_file));
    return kExitOk;
  }
  fmt::print("{:<24} {:<12} {:<16} {:<8} {}\n", "op", "pattern", "template", "emits", "shape rule");
  for (const auto& op : reg.ops())
    fmt::print("{:<24} {:<12} {:<16} {:<8} {}\n", op.name, to_string(op.pattern),
               op.source_file.empty() ? "-" : op.source_file, emitter_gap(op).empty() ? "yes" : "not yet",
               op.shape.text);
  return kExitOk;
}

int main_impl(int argc, char** argv) {
  CLI::App app{"cudagen: compiles a task graph into one fused, standalone CUDA source file.\n"};
  app.set_version_flag("--version", std::string("cudagen ") + CUDAGEN_VERSION);
  app.require_subcommand(1);
  app.footer(
      "Exit status: 0 ok, 1 bad input (errors on stderr), 2 usage.\n"
      "Run `cudagen COMMAND --help` for the options of a command.");

  Cli cli;
  auto* validate_cmd = app.add_subcommand("validate", "check a graph against the op registry; print nothing else");
  add_frontend_options(validate_cmd, cli);
  auto* describe_cmd =
      app.add_subcommand("describe", "validate a graph, then print its tasks per phase, its buffers and its kernels and launches "
                                     "(with --megakernel, also the megakernel's schedule)");
  add_frontend_options(describe_cmd, cli);
  add_compile_options(describe_cmd, cli);  // with --megakernel: the schedule of the compiled graph
  auto* format_cmd = app.add_subcommand("format", "print a graph in canonical form (the writer's output)");
  format_cmd->add_option("GRAPH", cli.graph_path, "task graph file")->required()->check(CLI::ExistingFile);
  format_cmd->add_option("-o,--output", cli.output_path, "write here (atomically) instead of standard output");
  auto* compile_cmd = app.add_subcommand("compile", "compile a graph into one standalone .cu file and its manifest");
  add_frontend_options(compile_cmd, cli);
  add_compile_options(compile_cmd, cli);
  compile_cmd->add_option("-o,--output", cli.output_path, "the .cu file to write");
  compile_cmd->add_option("--manifest", cli.manifest_path, "the JSON manifest to write beside it");
  compile_cmd->add_option("--header", cli.header_path,
                          "a C++ header for building the .cu ahead of time: the launchers, the arena size, and the "
                          "offset of every input, output, parameter and run-time argument");
  compile_cmd
      ->add_option("--prefix", cli.compile.emit.symbol_prefix,
                   "prefix of the host symbols (PREFIX_forward, PREFIX_arena_bytes); give each graph linked into "
                   "one program its own")
      ->capture_default_str()
      ->check([](const std::string& prefix) {
        std::string problem = symbol_prefix_problem(prefix);
        return problem.empty() ? problem : "not a C identifier: " + problem;
      });
  compile_cmd->add_option("--dump-after", cli.compile.dump_after, "print the program after this pass (fuse: the kernels, why tasks stayed apart, and each kernel's IR as a tree)")
      ->check(CLI::IsMember(kPassNames));
  auto* run_cmd = app.add_subcommand(
      "run", "compile a graph, run it on the GPU (or in the host emulation where there is none), and check its outputs "
             "against a float64 reference");
  add_frontend_options(run_cmd, cli);
  add_compile_options(run_cmd, cli);
  run_cmd->add_flag("--emulate", cli.emulate,
                    "run on the CPU in the host emulation of the CUDA execution model (the default where no GPU is "
                    "found)");
  run_cmd->add_flag("--gpu", cli.gpu, "run on the GPU, and fail rather than fall back to the emulation");
  run_cmd->add_option("--device", cli.gpu_options.device, "the GPU to run on")->capture_default_str();
  run_cmd->add_flag("--cuda-graph", cli.gpu_options.cuda_graph,
                    "GPU: capture each phase into a CUDA Graph on its first run and replay it (fewer launch costs)");
  run_cmd->add_option("--profile", cli.profile_path,
                      "after the checked run, profile each phase and write FILE (JSON) and FILE's stem + .trace.json "
                      "(a Perfetto trace); prints a table. GPU: kernel and phase times (median after warm-up), "
                      "bandwidth against a device copy, FLOP rates. Emulation: bytes each kernel read and wrote, "
                      "counted, against the unfused program's")
      ->check([](const std::string& path) {
        const std::string dir = path.find('/') == std::string::npos ? "." : path.substr(0, path.rfind('/') + 1);
        return ::access(dir.c_str(), W_OK) == 0 ? std::string() : "no writable folder " + dir + " for the profile";
      });
  run_cmd->add_option("--profile-runs", cli.profile.runs, "GPU: timed runs per phase for --profile (median)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  run_cmd->add_option("--profile-sort", cli.profile_sort,
                      "order of the kernel table: time or bytes (default: time on a GPU, bytes in emulation)")
      ->check(CLI::IsMember({"time", "bytes"}));
  run_cmd->add_flag("--no-cache", [&cli](int64_t) { cli.gpu_options.use_cache = false; },
                    "GPU: compile with NVRTC even when the disk cache has the binary (and do not store it)");
  run_cmd->add_option("--cache-dir", cli.gpu_options.cache_dir,
                      "GPU: the disk cache of compiled code (default: $CUDAGEN_CACHE_DIR, else $XDG_CACHE_HOME/cudagen, "
                      "else ~/.cache/cudagen)");
  run_cmd->add_option("--seed", cli.seed, "seed of the random inputs and of the emulator's block order")
      ->capture_default_str();
  run_cmd->add_option("--work-dir", cli.work_dir, "where to build the emulated module (default: a folder in /tmp)");
  run_cmd->add_option("--inputs", cli.inputs_dir,
                      "read each graph input from DIR/<task>.<slot>.npy instead of random values")
      ->check(CLI::ExistingDirectory);
  run_cmd->add_option("--outputs", cli.outputs_dir,
                      "write each graph output to DIR/<task>.<slot>.npy (after --steps, also the weights, the optimizer "
                      "state and each scalar output per step, as <task>.<slot>.per_step.npy)");
  run_cmd->add_option("--expected", cli.expected_dir,
                      "also compare each graph output with DIR/<task>.<slot>.npy, another framework's result from the "
                      "same inputs (the torch exporter writes PyTorch's to OUT/expected; use with --inputs OUT/example): "
                      "both within the float64 reference's bound, so within twice it of each other")
      ->check(CLI::ExistingDirectory);
  run_cmd->add_option("--steps", cli.steps,
                      "train: run init once, then N steps of forward, backward and update, each checked against the "
                      "reference from the state it started from; prints the loss per step. An int run-time argument "
                      "named 'step' (Adam's) counts the steps")
      ->check(CLI::NonNegativeNumber);
  run_cmd->add_option("--micro-batches", cli.micro_batches,
                      "with --steps, for a graph whose \"training\" says \"accumulate_gradients\": run forward and "
                      "backward K times a step, each micro-batch on its own inputs (random, or the K slices of a "
                      "--inputs file stacked [K, ...]), then one update with the mean of their gradients")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  run_cmd->add_option("--phases", cli.phases,
                      "run only these phases (init, forward, backward, update; comma-separated); what only the other "
                      "phases would write is then an input")
      ->delimiter(',')
      ->check(CLI::IsMember({"init", "forward", "backward", "update"}));
  run_cmd->add_option("--arg", cli.run_time_args,
                      "TASK.ARG=VALUE: the value of a run-time argument (one whose JSON says \"runtime\": true) for "
                      "this run, with no recompilation; may be given more than once");
  run_cmd->add_flag("--check-each-task", cli.check_each_task,
                    "also check every task against the reference computed from its actual inputs (implies --no-reuse)");
  auto* nvrtc_cmd = app.add_subcommand("nvrtc", "compile a generated .cu in-process with NVRTC (no GPU needed)");
  nvrtc_cmd->add_option("CU", cli.cu_path, "the .cu file")->required()->check(CLI::ExistingFile);
  nvrtc_cmd->add_option("--arch", cli.compile.emit.arch, "GPU architecture (sm_90a for Hopper's wgmma path)")
      ->check(kArchitecture)
      ->capture_default_str();
  nvrtc_cmd->add_flag("--ptx", cli.ptx, "emit PTX instead of a CUBIN");
  nvrtc_cmd->add_option("-o,--output", cli.output_path, "write the CUBIN (or PTX) here");
  auto* plan_cmd = app.add_subcommand(
      "plan", "plan the memory of a graph, or of a buffer list (--buffers), and report it against the lower bound");
  plan_cmd->add_option("GRAPH", cli.graph_path, "task graph file")->check(CLI::ExistingFile);
  plan_cmd->add_option("--buffers", cli.buffers_csv, "a buffer list in MiniMalloc's CSV format: id,lower,upper,size")
      ->check(CLI::ExistingFile);
  plan_cmd->add_option("--registry", cli.frontend.registry_file, "op registry file instead of the bundled one")
      ->check(CLI::ExistingFile);
  add_templates_option(plan_cmd, cli);
  add_compile_options(plan_cmd, cli);
  plan_cmd->add_option("--method", cli.method, "greedy (several best-fit orderings), or search (greedy, then "
                                               "branch-and-bound when greedy leaves a gap to the lower bound)")
      ->check(CLI::IsMember({"greedy", "search"}))
      ->capture_default_str();
  plan_cmd
      ->add_option("--search-steps", cli.compile.plan.placement.search_steps,
                   "the search's budget (deterministic); by default, where greedy is within 2% of the lower bound, "
                   "the search stops after about a second's worth of steps instead")
      ->capture_default_str()
      ->each([&cli](const std::string&) { cli.compile.plan.placement.near_bound_work = 0; });
  plan_cmd->add_option("-o,--output", cli.output_path, "with --buffers: write the offsets as CSV (an offset column)");
  plan_cmd->add_option("--svg", cli.svg_path, "draw the plan: time across, address up, the lower bound as a line");
  auto* ops_cmd = app.add_subcommand("ops", "list the ops of the registry");
  ops_cmd->add_option("--registry", cli.frontend.registry_file, "op registry file instead of the bundled one")
      ->check(CLI::ExistingFile);
  add_templates_option(ops_cmd, cli);
  ops_cmd->add_flag("--markdown", cli.markdown, "print the table of docs/ops.md");
  ops_cmd->add_flag("--json", cli.json, "print the registry itself (format cudagen.registry/1)");

  try {
    app.parse(argc, argv);
    cli.arch_given = run_cmd->count("--arch") > 0;
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitUsage;
  }

  try {
    std::unique_ptr<UserTemplateRegistry> user_templates;
    if (!cli.template_dirs.empty()) {
      if (!cli.frontend.registry_file.empty()) {
        fmt::print(stderr, "error: --templates and --registry exclude each other: --templates makes the registry\n");
        return kExitUsage;
      }
      user_templates = std::make_unique<UserTemplateRegistry>(cli.template_dirs);
      cli.frontend.registry_file = user_templates->registry_file();
    }
    if (*validate_cmd) return run_validate(cli);
    if (*describe_cmd) return run_describe(cli);
    if (*format_cmd) return run_format(cli);
    if (*ops_cmd) return run_ops(cli);
    if (*compile_cmd) return run_compile(cli);
    if (*run_cmd) return run_run(cli);
    if (*nvrtc_cmd) return run_nvrtc(cli);
    if (*plan_cmd) return run_plan(cli);
  } catch (const CompileError& e) {
    std::fputs(e.diagnostics().format().c_str(), stderr);
    return kExitBadInput;
  } catch (const FileError& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return kExitBadInput;
  } catch (const std::exception& e) {  // build, NVRTC and emulation failures carry their own context
    fmt::print(stderr, "error: {}\n", e.what());
    return kExitBadInput;
  }
  return kExitUsage;
}

}  // namespace
}  // namespace cudagen

int main(int argc, char** argv) { return cudagen::main_impl(argc, argv); }
