#include "nvrtc.h"

#include <dlfcn.h>

#include <chrono>
#include <filesystem>

#include <fmt/format.h>

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

NvrtcApi load_nvrtc() {
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

}  // namespace

NvrtcOutput nvrtc_compile(const std::string& source, const std::string& name, const std::string& arch, bool ptx) {
  NvrtcApi api = load_nvrtc();
  NvrtcOutput out;
  api.version(&out.version_major, &out.version_minor);
  nvrtcProgram prog = nullptr;
  if (int rc = api.create(&prog, source.c_str(), name.c_str(), 0, nullptr, nullptr))
    throw NvrtcError(fmt::format("nvrtcCreateProgram: {}", api.error_string(rc)));
  // compute_XX emits PTX, sm_XX a CUBIN for that architecture.
  std::string gpu_arch = "--gpu-architecture=" + (ptx ? "compute_" + arch.substr(arch.find('_') + 1) : arch);
  const char* opts[] = {gpu_arch.c_str(), "-std=c++17", "--device-as-default-execution-space"};
  auto start = std::chrono::steady_clock::now();
  int rc = api.compile(prog, 3, opts);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  size_t log_size = 0;
  api.log_size(prog, &log_size);
  out.log.resize(log_size);
  if (log_size > 0) api.log(prog, out.log.data());
  while (!out.log.empty() && (out.log.back() == '\0' || out.log.back() == '\n')) out.log.pop_back();
  if (rc != 0) {
    api.destroy(&prog);
    throw NvrtcError(fmt::format("NVRTC failed to compile {} for {}: {}\n{}", name, arch, api.error_string(rc), out.log));
  }
  size_t size = 0;
  (ptx ? api.ptx_size : api.cubin_size)(prog, &size);
  out.binary.resize(size);
  (ptx ? api.ptx : api.cubin)(prog, out.binary.data());
  api.destroy(&prog);
  return out;
}

}  // namespace cudagen
