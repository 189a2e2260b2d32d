#include "profile.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "emit.h"
#include "json.h"

namespace cudagen {

namespace {

constexpr Phase kPhases[] = {Phase::init, Phase::forward, Phase::backward, Phase::update};

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

// The kernels of the program's launcher for `phase`, in launch order.
std::vector<KernelProfile> phase_kernels(const Compiled& c, Phase phase) {
  std::vector<KernelProfile> out;
  for (const EmittedKernel& ek : c.emitted.kernels) {
    if (ek.phase != phase) continue;
    KernelProfile k;
    k.phase = phase;
    k.kernel = ek.name;
    for (int t : ek.tasks) k.tasks.push_back(c.program.tasks[size_t(t)].task->id);
    std::copy(ek.grid, ek.grid + 3, k.grid);
    k.block = ek.block;
    k.smem_bytes = ek.smem_bytes;
    k.modelled_bytes = ek.bytes_read + ek.bytes_written;
    k.flops = ek.flops;
    out.push_back(std::move(k));
  }
  return out;
}

// The emulator's counts for one run of `function`.
void measure_emulated(Executor& executor, const std::string& function, std::vector<KernelProfile>& kernels) {
  executor.clear_kernel_bytes();
  executor.run(function);
  const std::vector<KernelBytes> counted = executor.kernel_bytes();
  if (counted.size() != kernels.size())
    throw std::logic_error(fmt::format("profiling {}: the emulator counted {} launches, the program has {} kernels",
                                       function, counted.size(), kernels.size()));
  double start = 0;
  for (size_t i = 0; i < kernels.size(); ++i) {
    if (counted[i].kernel != kernels[i].kernel)
      throw std::logic_error(fmt::format("profiling {}: launch {} was {}, the program says {}", function, i,
                                         counted[i].kernel, kernels[i].kernel));
    // As launched: a persistent kernel's grid is the emulated GPU's, not the target's.
    for (int d = 0; d < 3; ++d) kernels[i].grid[d] = int(counted[i].grid[d]);
    kernels[i].bytes_read = int64_t(counted[i].bytes_read);
    kernels[i].bytes_written = int64_t(counted[i].bytes_written);
    kernels[i].load_sectors = int64_t(counted[i].load_sectors);
    kernels[i].ideal_load_sectors = int64_t(counted[i].load_ideal_sectors);
    kernels[i].store_sectors = int64_t(counted[i].store_sectors);
    kernels[i].ideal_store_sectors = int64_t(counted[i].store_ideal_sectors);
    kernels[i].wavefronts = int64_t(counted[i].shared_wavefronts);
    kernels[i].ideal_wavefronts = int64_t(counted[i].shared_ideal_wavefronts);
    kernels[i].milliseconds = counted[i].host_seconds * 1e3;
    kernels[i].start_ms = start;
    start += kernels[i].milliseconds;
  }
}

// Warm-up runs, then `runs` timed ones; each kernel's median time and start,
// and the phase's median time.
double measure_gpu(Executor& executor, const std::string& function, const ProfileOptions& options,
                   std::vector<KernelProfile>& kernels) {
  for (int i = 0; i < options.warmup; ++i) executor.run(function);
  std::vector<std::vector<double>> times(kernels.size()), starts(kernels.size());
  std::vector<double> phase_times;
  for (int r = 0; r < options.runs; ++r) {
    executor.run(function);
    const std::vector<KernelTime> measured = executor.kernel_times();
    if (measured.size() != kernels.size())
      throw std::logic_error(fmt::format("profiling {}: {} kernel times for {} kernels", function, measured.size(),
                                         kernels.size()));
    for (size_t i = 0; i < kernels.size(); ++i) {
      for (int d = 0; d < 3; ++d) kernels[i].grid[d] = int(measured[i].grid[d]);  // as launched on this GPU
      times[i].push_back(measured[i].milliseconds);
      starts[i].push_back(measured[i].start_ms);
    }
    phase_times.push_back(executor.last_run_milliseconds());
  }
  for (size_t i = 0; i < kernels.size(); ++i) {
    kernels[i].milliseconds = median(times[i]);
    kernels[i].start_ms = median(starts[i]);
  }
  return median(phase_times);
}

std::string percent(double part, double whole) { return whole > 0 ? fmt::format("{:.1f}%", 100 * part / whole) : "-"; }

std::string bytes_text(int64_t bytes) {
  if (bytes < 0) return "-";
  if (bytes >= (int64_t(1) << 30)) return fmt::format("{:.2f} GiB", double(bytes) / double(int64_t(1) << 30));
  if (bytes >= (int64_t(1) << 20)) return fmt::format("{:.2f} MiB", double(bytes) / double(1 << 20));
  if (bytes >= (int64_t(1) << 10)) return fmt::format("{:.1f} KiB", double(bytes) / 1024);
  return fmt::format("{} B", bytes);
}

// Bytes per second of a kernel's bytes over its time (GPU).
double bandwidth(const KernelProfile& k) { return k.milliseconds > 0 ? double(k.bytes()) / (k.milliseconds * 1e-3) : 0; }

}  // namespace

std::string KernelProfile::name() const { return fmt::format("{} ({})", kernel, fmt::join(tasks, ", ")); }

const PhaseProfile* Profile::find_phase(Phase phase) const {
  for (const PhaseProfile& p : phases)
    if (p.phase == phase) return &p;
  return nullptr;
}

Profile profile_program(const Compiled& compiled, Executor& executor, const ProfileOptions& options) {
  if (options.runs < 1) throw std::invalid_argument("profiling needs at least one timed run");
  Profile profile;
  profile.graph = compiled.program.graph.name;
  profile.where = executor.where();
  profile.on_gpu = executor.on_gpu();
  profile.runs = profile.on_gpu ? options.runs : 1;  // the emulator's counts are the same every run

  // Profiling repeats phases (an update changes the weights each time): keep
  // the arena to put it back afterwards.
  std::vector<unsigned char> saved(size_t(compiled.plan.arena_bytes));
  if (!saved.empty()) executor.read(0, saved.data(), saved.size());

  if (profile.on_gpu) {
    profile.copy_bandwidth = executor.copy_bandwidth();
    executor.set_profiling(true);
  }
  try {
    for (Phase phase : kPhases) {
      const std::string function = phase_function(phase);
      if (!executor.has_function(function)) continue;
      if (!options.phases.empty() && std::find(options.phases.begin(), options.phases.end(), phase) == options.phases.end())
        continue;
      std::vector<KernelProfile> kernels = phase_kernels(compiled, phase);
      PhaseProfile p;
      p.phase = phase;
      p.kernels = int(kernels.size());
      if (profile.on_gpu) {
        p.milliseconds = measure_gpu(executor, function, options, kernels);
      } else {
        measure_emulated(executor, function, kernels);
      }
      for (const KernelProfile& k : kernels) {
        p.kernel_milliseconds += k.milliseconds;
        p.bytes += k.bytes();
      }
      if (!profile.on_gpu) p.milliseconds = p.kernel_milliseconds;
      profile.phases.push_back(p);
      for (KernelProfile& k : kernels) profile.kernels.push_back(std::move(k));
    }
  } catch (...) {
    if (profile.on_gpu) executor.set_profiling(false);
    throw;
  }
  if (profile.on_gpu) executor.set_profiling(false);
  if (!saved.empty()) executor.write(0, saved.data(), saved.size());
  return profile;
}

Profile profile_emulated(const Compiled& compiled, const RunOptions& run, const ProfileOptions& options) {
  std::unique_ptr<Executor> executor = make_emulated_executor(compiled, run.work_dir);
  CheckedRun checked = run_and_check(compiled, *executor, run);
  if (!checked.ok())
    throw std::runtime_error(fmt::format("{} failed its check against the reference, so its profile would mean "
                                         "nothing:\n{}",
                                         compiled.program.graph.name, format_run(checked)));
  return profile_program(compiled, *executor, options);
}

void add_unfused_baseline(Profile& fused, const Profile& unfused) {
  for (PhaseProfile& p : fused.phases) {
    if (const PhaseProfile* u = unfused.find_phase(p.phase)) {
      p.unfused_kernels = u->kernels;
      p.unfused_bytes = u->bytes;
    }
  }
}

std::string format_profile(const Profile& profile, ProfileSort sort, int top) {
  std::string out;
  const bool gpu = profile.on_gpu;
  out += fmt::format("profile of {} on {}: ", profile.graph, profile.where);
  out += gpu ? fmt::format("median of {} timed runs after warm-up; device copy bandwidth {:.0f} GB/s\n", profile.runs,
                           profile.copy_bandwidth / 1e9)
             : "bytes counted by the emulator's loads and stores (times are the emulator's, on the host CPU)\n";

  // Phases: kernels, time, bytes, and against the unfused program.
  const bool baseline = std::any_of(profile.phases.begin(), profile.phases.end(),
                                    [](const PhaseProfile& p) { return p.unfused_bytes >= 0; });
  out += fmt::format("{:<9} {:>7} {:>11}", "phase", "kernels", gpu ? "time us" : "host ms");
  if (gpu) out += fmt::format(" {:>11}", "kernels us");
  out += fmt::format(" {:>11}", gpu ? "bytes*" : "bytes");
  if (baseline) out += fmt::format("  {:<8} {:>7} {:>11} {:>7}", "unfused:", "kernels", "bytes", "saved");
  out += "\n";
  for (const PhaseProfile& p : profile.phases) {
    out += fmt::format("{:<9} {:>7} {:>11.3f}", to_string(p.phase), p.kernels, gpu ? p.milliseconds * 1e3 : p.milliseconds);
    if (gpu) out += fmt::format(" {:>11.3f}", p.kernel_milliseconds * 1e3);
    out += fmt::format(" {:>11}", bytes_text(p.bytes));
    if (p.unfused_bytes >= 0)
      out += fmt::format("  {:<8} {:>7} {:>11} {:>7}", "", p.unfused_kernels, bytes_text(p.unfused_bytes),
                         percent(double(p.unfused_bytes - p.bytes), double(p.unfused_bytes)));
    out += "\n";
  }

  // Kernels, heaviest first.
  std::vector<const KernelProfile*> order;
  for (const KernelProfile& k : profile.kernels) order.push_back(&k);
  auto weight = [&](const KernelProfile* k) { return sort == ProfileSort::time ? k->milliseconds : double(k->bytes()); };
  std::stable_sort(order.begin(), order.end(), [&](auto* a, auto* b) { return weight(a) > weight(b); });
  double total_time = 0, total_bytes = 0;
  for (const KernelProfile& k : profile.kernels) {
    total_time += k.milliseconds;
    total_bytes += double(k.bytes());
  }
  const size_t shown = std::min(order.size(), size_t(std::max(top, 0)));
  out += fmt::format("\nkernels by {} ({} of {}):\n", sort == ProfileSort::time ? "time" : "bytes", shown, order.size());
  out += fmt::format("{:<40} {:<8} {:>20}", "kernel (tasks)", "phase", "grid x block");
  out += gpu ? fmt::format(" {:>10} {:>6} {:>10} {:>9} {:>7} {:>9}\n", "time us", "time", "bytes*", "GB/s", "of copy",
                           "GFLOP/s")
             : fmt::format(" {:>10} {:>10} {:>10} {:>6} {:>6} {:>6} {:>6} {:>9}\n", "read", "written", "modelled",
                           "bytes", "ld sec", "st sec", "banks", "host ms");
  for (size_t i = 0; i < shown; ++i) {
    const KernelProfile& k = *order[i];
    std::string name = k.name();
    if (name.size() > 40) name = name.substr(0, 37) + "...";
    const std::string launch =
        k.grid[1] * k.grid[2] > 1 ? fmt::format("{}x{}x{} x {}", k.grid[0], k.grid[1], k.grid[2], k.block)
                                  : fmt::format("{} x {}", k.grid[0], k.block);
    out += fmt::format("{:<40} {:<8} {:>20}", name, to_string(k.phase), launch);
    if (gpu) {
      const double bw = bandwidth(k);
      out += fmt::format(" {:>10.3f} {:>6} {:>10} {:>9.1f} {:>7} {:>9}\n", k.milliseconds * 1e3,
                         percent(k.milliseconds, total_time), bytes_text(k.bytes()), bw / 1e9,
                         percent(bw, profile.copy_bandwidth),
                         k.flops > 0 && k.milliseconds > 0 ? fmt::format("{:.1f}", double(k.flops) / (k.milliseconds * 1e6))
                                                           : "-");
    } else {
      auto ratio = [](int64_t got, int64_t ideal) { return ideal > 0 ? fmt::format("{:.2f}", double(got) / double(ideal)) : std::string("-"); };
      out += fmt::format(" {:>10} {:>10} {:>10} {:>6} {:>6} {:>6} {:>6} {:>9.2f}\n", bytes_text(k.bytes_read),
                         bytes_text(k.bytes_written), bytes_text(k.modelled_bytes), percent(double(k.bytes()), total_bytes),
                         ratio(k.load_sectors, k.ideal_load_sectors), ratio(k.store_sectors, k.ideal_store_sectors),
                         ratio(k.wavefronts, k.ideal_wavefronts), k.milliseconds);
    }
  }
  if (gpu)
    out += "* bytes as the emitter models them (each tensor once); `cudagen run --emulate --profile` counts them\n";
  return out;
}

std::string profile_json(const Profile& profile) {
  JsonValue root = JsonValue::object();
  root.set("format", JsonValue::string("cudagen.profile/1"));
  root.set("graph", JsonValue::string(profile.graph));
  root.set("where", JsonValue::string(profile.where));
  root.set("backend", JsonValue::string(profile.on_gpu ? "gpu" : "emulation"));
  root.set("runs", JsonValue::integer(profile.runs));
  if (profile.on_gpu) root.set("copy_bandwidth_bytes_per_s", JsonValue::number(profile.copy_bandwidth));
  JsonValue phases = JsonValue::array();
  for (const PhaseProfile& p : profile.phases) {
    JsonValue v = JsonValue::object();
    v.set("phase", JsonValue::string(to_string(p.phase)));
    v.set("kernels", JsonValue::integer(p.kernels));
    v.set(profile.on_gpu ? "milliseconds" : "host_milliseconds", JsonValue::number(p.milliseconds));
    if (profile.on_gpu) v.set("kernel_milliseconds", JsonValue::number(p.kernel_milliseconds));
    v.set("bytes", JsonValue::integer(p.bytes));
    if (p.unfused_bytes >= 0) {
      v.set("unfused_kernels", JsonValue::integer(p.unfused_kernels));
      v.set("unfused_bytes", JsonValue::integer(p.unfused_bytes));
    }
    phases.push_back(std::move(v));
  }
  root.set("phases", std::move(phases));
  JsonValue kernels = JsonValue::array();
  for (const KernelProfile& k : profile.kernels) {
    JsonValue v = JsonValue::object();
    v.set("kernel", JsonValue::string(k.kernel));
    v.set("phase", JsonValue::string(to_string(k.phase)));
    JsonValue tasks = JsonValue::array();
    for (const auto& t : k.tasks) tasks.push_back(JsonValue::string(t));
    v.set("tasks", std::move(tasks));
    JsonValue grid = JsonValue::array();
    for (int d : k.grid) grid.push_back(JsonValue::integer(d));
    v.set("grid", std::move(grid));
    v.set("block", JsonValue::integer(k.block));
    v.set("smem_bytes", JsonValue::integer(k.smem_bytes));
    v.set("modelled_bytes", JsonValue::integer(k.modelled_bytes));
    if (k.bytes_read >= 0) {
      v.set("bytes_read", JsonValue::integer(k.bytes_read));
      v.set("load_sectors", JsonValue::integer(k.load_sectors));
      v.set("ideal_load_sectors", JsonValue::integer(k.ideal_load_sectors));
      v.set("store_sectors", JsonValue::integer(k.store_sectors));
      v.set("ideal_store_sectors", JsonValue::integer(k.ideal_store_sectors));
      v.set("bank_wavefronts", JsonValue::integer(k.wavefronts));
      v.set("ideal_bank_wavefronts", JsonValue::integer(k.ideal_wavefronts));
      v.set("bytes_written", JsonValue::integer(k.bytes_written));
    }
    v.set("flops", k.flops >= 0 ? JsonValue::integer(k.flops) : JsonValue::null());
    v.set(profile.on_gpu ? "milliseconds" : "host_milliseconds", JsonValue::number(k.milliseconds));
    v.set("start_ms", JsonValue::number(k.start_ms));
    if (profile.on_gpu) {
      v.set("bytes_per_s", JsonValue::number(bandwidth(k)));
      if (k.flops > 0 && k.milliseconds > 0) v.set("flops_per_s", JsonValue::number(double(k.flops) / (k.milliseconds * 1e-3)));
    }
    kernels.push_back(std::move(v));
  }
  root.set("kernels", std::move(kernels));
  return write_json(root);
}

std::string profile_trace(const Profile& profile) {
  // Trace-event format: times in microseconds; one process, one thread
  // (track) per phase, named by metadata events.
  JsonValue events = JsonValue::array();
  auto metadata = [&](const char* what, int tid, const std::string& name) {
    JsonValue m = JsonValue::object();
    m.set("name", JsonValue::string(what));
    m.set("ph", JsonValue::string("M"));
    m.set("pid", JsonValue::integer(1));
    m.set("tid", JsonValue::integer(tid));
    JsonValue args = JsonValue::object();
    args.set("name", JsonValue::string(name));
    m.set("args", std::move(args));
    events.push_back(std::move(m));
  };
  metadata("process_name", 0,
           fmt::format("{} on {}{}", profile.graph, profile.where,
                       profile.on_gpu ? fmt::format(" (median of {} runs)", profile.runs)
                                      : " (the emulator's host CPU time, not a GPU's)"));
  double phase_start_us = 0;
  for (size_t i = 0; i < profile.phases.size(); ++i) {
    const PhaseProfile& p = profile.phases[i];
    const int tid = int(i) + 1;
    metadata("thread_name", tid, to_string(p.phase));
    for (const KernelProfile& k : profile.kernels) {
      if (k.phase != p.phase) continue;
      JsonValue e = JsonValue::object();
      e.set("name", JsonValue::string(k.name()));
      e.set("cat", JsonValue::string("kernel"));
      e.set("ph", JsonValue::string("X"));
      e.set("pid", JsonValue::integer(1));
      e.set("tid", JsonValue::integer(tid));
      e.set("ts", JsonValue::number(phase_start_us + k.start_ms * 1e3));
      e.set("dur", JsonValue::number(k.milliseconds * 1e3));
      JsonValue args = JsonValue::object();
      args.set("grid", JsonValue::string(fmt::format("{}x{}x{}", k.grid[0], k.grid[1], k.grid[2])));
      args.set("block", JsonValue::integer(k.block));
      args.set("bytes", JsonValue::integer(k.bytes()));
      if (k.bytes_read >= 0) {
        args.set("bytes_read", JsonValue::integer(k.bytes_read));
        args.set("bytes_written", JsonValue::integer(k.bytes_written));
      }
      args.set("modelled_bytes", JsonValue::integer(k.modelled_bytes));
      if (k.flops >= 0) args.set("flops", JsonValue::integer(k.flops));
      e.set("args", std::move(args));
      events.push_back(std::move(e));
    }
    phase_start_us += std::max(p.milliseconds, p.kernel_milliseconds) * 1e3;
  }
  JsonValue root = JsonValue::object();
  root.set("traceEvents", std::move(events));
  root.set("displayTimeUnit", JsonValue::string("ns"));
  return write_json(root);
}

}  // namespace cudagen
