#include "host_module.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>

#include "emit.h"
#include "file_util.h"
#include "hash.h"

namespace cudagen {

namespace {

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs a command, returning its exit status and its output (stdout and stderr).
int run_command(const std::string& command, std::string* output) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) output->append(buf, n);
  return pclose(pipe);
}

template <typename Fn>
Fn symbol(void* handle, const char* name) {
  void* p = dlsym(handle, name);
  if (p == nullptr) throw BuildError(fmt::format("emulated module has no symbol {}", name));
  return reinterpret_cast<Fn>(p);
}

// What the emulated build compiles and links with.
struct EmulationToolchain {
  std::string include_dir;  // holds cudagen_emu.h
  std::string emu_library;
};

// Where to look, in order: $CUDAGEN_ROOT (an install prefix, for a program
// that links the installed runtime and lives elsewhere); beside the running
// executable (PREFIX/bin -> PREFIX/include/cudagen, PREFIX/lib), so an
// installed cudagen works wherever the prefix was moved; the build tree this
// library was built in; the prefix it was configured to install to. A build
// tree's programs thus never pick up an older install.
EmulationToolchain emulation_toolchain() {
  namespace fs = std::filesystem;
  auto in_prefix = [](const fs::path& prefix) {
    return EmulationToolchain{(prefix / CUDAGEN_EMU_INSTALLED_INCLUDE_DIR).lexically_normal().string(),
                              (prefix / CUDAGEN_EMU_INSTALLED_LIBRARY).lexically_normal().string()};
  };
  std::vector<EmulationToolchain> candidates;
  if (const char* root = std::getenv("CUDAGEN_ROOT"); root && *root) candidates.push_back(in_prefix(root));
  std::error_code ec;
  const fs::path exe_dir = fs::read_symlink("/proc/self/exe", ec).parent_path();
  if (!ec) candidates.push_back(in_prefix(exe_dir / CUDAGEN_BIN_TO_PREFIX));
  candidates.push_back({CUDAGEN_EMU_INCLUDE_DIR, CUDAGEN_EMU_LIBRARY});
  candidates.push_back(in_prefix(CUDAGEN_INSTALL_PREFIX));
  for (const EmulationToolchain& c : candidates)
    if (fs::exists(fs::path(c.include_dir) / "cudagen_emu.h") && fs::exists(c.emu_library)) return c;
  throw BuildError(fmt::format(
      "cannot find the emulator (cudagen_emu.h and {}) beside this program, in the build tree {} or under the "
      "install prefix {}; set CUDAGEN_ROOT to the prefix cudagen is installed in",
      fs::path(CUDAGEN_EMU_INSTALLED_LIBRARY).filename().string(), CUDAGEN_EMU_INCLUDE_DIR, CUDAGEN_INSTALL_PREFIX));
}

}  // namespace

HostModule HostModule::build(const std::string& cuda_source, const std::string& work_dir, double* seconds) {
  if (std::string(CUDAGEN_EMU_LIBRARY).empty())
    throw BuildError("this cudagen was built without the emulator (install libboost-context-dev and reconfigure)");
  std::filesystem::create_directories(work_dir);
  // Named by a hash of the source: the loader identifies a library by its path,
  // and a module is never unloaded (its thread_local emulator pins it), so a
  // new source must never reuse an old path.
  const std::string stem = fmt::format("{}/module-{:016x}", work_dir, fnv1a64(cuda_source));
  const std::string cu = stem + ".cu", so = stem + ".so";
  write_file_atomic(cu, cuda_source);
  const EmulationToolchain toolchain = emulation_toolchain();
  // -x c++: the .cu is plain C++ once the emulation header defines the CUDA built-ins.
  std::string command = fmt::format(
      "{} -std=c++17 -O1 -g0 -fPIC -shared -fno-strict-aliasing -Wno-unused-parameter -I{} -include cudagen_emu.h "
      "-x c++ {} -x none {} {} -o {}",
      CUDAGEN_HOST_CXX, shell_quote(toolchain.include_dir), shell_quote(cu), shell_quote(toolchain.emu_library),
      shell_quote(CUDAGEN_BOOST_CONTEXT_LIBRARY), shell_quote(so + ".tmp"));
  auto start = std::chrono::steady_clock::now();
  std::string output;
  int status = run_command(command, &output);
  if (seconds) *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (status != 0) throw BuildError(fmt::format("the host compiler failed on {}:\n{}\ncommand: {}", cu, output, command));
  std::filesystem::rename(so + ".tmp", so);
  HostModule m;
  m.handle_ = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (m.handle_ == nullptr) throw BuildError(fmt::format("cannot load {}: {}", so, dlerror()));
  return m;
}

HostModule::HostModule(HostModule&& other) noexcept : handle_(other.handle_) { other.handle_ = nullptr; }
HostModule& HostModule::operator=(HostModule&& other) noexcept {
  std::swap(handle_, other.handle_);
  return *this;
}
HostModule::~HostModule() {
  if (handle_ == nullptr) return;
  // dlclose does not unload a module with thread_local state (its
  // emulator): free what that state holds first (cudagen_emu.h).
  if (auto release = reinterpret_cast<void (*)()>(dlsym(handle_, "cudagen_emu_release"))) release();
  dlclose(handle_);
}

bool HostModule::has_phase(Phase phase) const { return has_function(phase_function(phase)); }

void HostModule::run_phase(Phase phase, unsigned char* arena) const { run_function(phase_function(phase), arena); }

bool HostModule::has_function(const std::string& name) const { return dlsym(handle_, name.c_str()) != nullptr; }

void* HostModule::address_of(const std::string& name) const { return dlsym(handle_, name.c_str()); }

void HostModule::run_function(const std::string& name, unsigned char* arena) const {
  using LauncherFn = int (*)(unsigned char*, void*);
  auto fn = symbol<LauncherFn>(handle_, name.c_str());
  if (fn(arena, nullptr) != 0) {
    auto last_error = symbol<const char* (*)()>(handle_, "cudagen_emu_last_error");
    throw std::runtime_error(fmt::format("{} failed in emulation: {}", name, last_error()));
  }
}

void HostModule::set_seed(unsigned long long seed) const {
  symbol<void (*)(unsigned long long)>(handle_, "cudagen_emu_configure")(seed);
}

std::vector<KernelBytes> HostModule::kernel_bytes() const {
  auto count = symbol<int (*)()>(handle_, "cudagen_emu_kernel_count");
  auto stats = symbol<const char* (*)(int, unsigned long long*, unsigned long long*)>(handle_, "cudagen_emu_kernel_stats");
  auto seconds = symbol<double (*)(int)>(handle_, "cudagen_emu_kernel_seconds");
  auto counters = symbol<void (*)(int, unsigned long long*)>(handle_, "cudagen_emu_kernel_counters");
  auto grid = symbol<void (*)(int, unsigned*)>(handle_, "cudagen_emu_kernel_grid");
  std::vector<KernelBytes> out;
  for (int i = 0; i < count(); ++i) {
    KernelBytes k;
    k.kernel = stats(i, &k.bytes_read, &k.bytes_written);
    k.host_seconds = seconds(i);
    grid(i, k.grid);
    unsigned long long c[9];
    counters(i, c);
    k.load_requests = c[0];
    k.load_sectors = c[1];
    k.load_ideal_sectors = c[2];
    k.store_requests = c[3];
    k.store_sectors = c[4];
    k.store_ideal_sectors = c[5];
    k.shared_requests = c[6];
    k.shared_wavefronts = c[7];
    k.shared_ideal_wavefronts = c[8];
    out.push_back(k);
  }
  return out;
}

void HostModule::clear_kernel_bytes() const { symbol<void (*)()>(handle_, "cudagen_emu_clear_stats")(); }

}  // namespace cudagen
