#include "nvrtc.h"

#include <dlfcn.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <mutex>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace cudagen {

namespace {

// The few NVRTC entry points cudagen uses (their C signatures from nvrtc.h).
using nvrtcProgram = struct _nvrtcProgram*;
struct NvrtcApi {
  void* handle = nullptr;
  int (*version)(int*, int*);
  int (*create)(nvrtcProgram*, const char*, const char*, int, const char* const*, const char* const*);
  int (*compile)(nvrtcProgram, int, const char* const*);
  int (*log_size)(nvrtcProgram, size_t*);
  int (*log)(nvrtcProgram, char*);
  int (*cubin_size)(nvrtcProgram, size_t*);
  int (*cubin)(nvrtcProgram, char*);
  int (*ptx_size)(nvrtcProgram, size_t*);
  int (*ptx)(nvrtcProgram, char*);
  int (*destroy)(nvrtcProgram*);
  const char* (*error_string)(int);
};

template <typename Fn>
void bind(NvrtcApi& api, Fn& fn, const char* name) {
  fn = reinterpret_cast<Fn>(dlsym(api.handle, name));
  if (fn == nullptr) throw NvrtcError(fmt::format("the NVRTC library has no symbol {}", name));
}

NvrtcApi load_nvrtc_library() {
  std::vector<std::string> candidates = {"libnvrtc.so.13", "libnvrtc.so.12"};
  std::string configured = CUDAGEN_NVRTC_LIBRARY;
  if (!configured.empty()) {
    std::string dir = std::filesystem::path(configured).parent_path().string();
    candidates.push_back(dir + "/libnvrtc.so.13");
    candidates.push_back(configured);
  }
  NvrtcApi api;
  std::string tried;
  for (const auto& c : candidates) {
    api.handle = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (api.handle != nullptr) break;
    tried += "\n  " + c + ": " + dlerror();
  }
  if (api.handle == nullptr)
    throw NvrtcError("cannot load NVRTC; install the CUDA toolkit (its lib64 on the library path). Tried:" + tried);
  bind(api, api.version, "nvrtcVersion");
  bind(api, api.create, "nvrtcCreateProgram");
  bind(api, api.compile, "nvrtcCompileProgram");
  bind(api, api.log_size, "nvrtcGetProgramLogSize");
  bind(api, api.log, "nvrtcGetProgramLog");
  bind(api, api.cubin_size, "nvrtcGetCUBINSize");
  bind(api, api.cubin, "nvrtcGetCUBIN");
  bind(api, api.ptx_size, "nvrtcGetPTXSize");
  bind(api, api.ptx, "nvrtcGetPTX");
  bind(api, api.destroy, "nvrtcDestroyProgram");
  bind(api, api.error_string, "nvrtcGetErrorString");
  return api;
}

// The library, loaded once per process (as the driver is): NVRTC keeps no
// state between programs, so one handle serves every compile. A failed load
// is not kept: the next call tries again.
const NvrtcApi& load_nvrtc() {
  static std::mutex mutex;
  static std::unique_ptr<const NvrtcApi> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  if (!loaded) loaded = std::make_unique<const NvrtcApi>(load_nvrtc_library());
  return *loaded;
}

std::vector<std::string> compile_options(const std::string& arch, bool ptx) {
  // compute_XX emits PTX, sm_XX a CUBIN for that architecture.
  return {"--gpu-architecture=" + (ptx ? "compute_" + arch.substr(arch.find('_') + 1) : arch), "-std=c++17",
          "--device-as-default-execution-space"};
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return lines;
}

}  // namespace

std::string nvrtc_version() {
  const NvrtcApi& api = load_nvrtc();
  int major = 0, minor = 0;
  api.version(&major, &minor);
  return fmt::format("{}.{}", major, minor);
}

std::string nvrtc_options_text(const std::string& arch, bool ptx) { return fmt::format("{}", fmt::join(compile_options(arch, ptx), " ")); }

std::string annotate_nvrtc_log(const std::string& log, const std::string& source) {
  const std::vector<std::string> source_lines = split_lines(source);
  // For each line of the source, the "// Kernel ..." comment it falls under,
  // or the section header before the kernels.
  std::vector<std::string> place(source_lines.size() + 1);
  std::string current;
  for (size_t i = 0; i < source_lines.size(); ++i) {
    const std::string& l = source_lines[i];
    if (l.rfind("// Kernel ", 0) == 0) current = l.substr(3);
    else if (l.rfind("// ---- device prelude", 0) == 0) current = "the device prelude (templates/prelude.cuh)";
    else if (l.rfind("// ---- templates", 0) == 0) current = "the op templates the kernels use (templates/)";
    else if (l.rfind("// ---- host launchers", 0) == 0) current = "the host launchers";
    place[i + 1] = current;  // log lines count from 1
  }
  std::string out;
  for (const std::string& line : split_lines(log)) {
    out += line + "\n";
    const size_t open = line.find('('), close = line.find("): ");
    if (open == std::string::npos || close == std::string::npos || close < open) continue;
    size_t number = 0;
    try {
      number = std::stoul(line.substr(open + 1, close - open - 1));
    } catch (const std::exception&) {
      continue;
    }
    if (number < place.size() && !place[number].empty()) out += "  ... in " + place[number] + "\n";
  }
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

NvrtcOutput nvrtc_compile(const std::string& source, const std::string& name, const std::string& arch, bool ptx) {
  const NvrtcApi& api = load_nvrtc();
  NvrtcOutput out;
  api.version(&out.version_major, &out.version_minor);
  nvrtcProgram prog = nullptr;
  if (int rc = api.create(&prog, source.c_str(), name.c_str(), 0, nullptr, nullptr))
    throw NvrtcError(fmt::format("nvrtcCreateProgram: {}", api.error_string(rc)));
  const std::vector<std::string> options = compile_options(arch, ptx);
  std::vector<const char*> opts;
  for (const auto& o : options) opts.push_back(o.c_str());
  auto start = std::chrono::steady_clock::now();
  int rc = api.compile(prog, int(opts.size()), opts.data());
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  size_t log_size = 0;
  api.log_size(prog, &log_size);
  out.log.resize(log_size);
  if (log_size > 0) api.log(prog, out.log.data());
  while (!out.log.empty() && (out.log.back() == '\0' || out.log.back() == '\n')) out.log.pop_back();
  out.log = annotate_nvrtc_log(out.log, source);
  if (rc != 0) {
    api.destroy(&prog);
    throw NvrtcError(fmt::format("NVRTC failed to compile {} for {}: {}\n{}", name, arch, api.error_string(rc),
                                 out.log));
  }
  size_t size = 0;
  (ptx ? api.ptx_size : api.cubin_size)(prog, &size);
  out.binary.resize(size);
  (ptx ? api.ptx : api.cubin)(prog, out.binary.data());
  api.destroy(&prog);
  return out;
}

}  // namespace cudagen
