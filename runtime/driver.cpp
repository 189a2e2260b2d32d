#include "driver.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>

#include <cuda.h>  // types and signatures only: nothing here links libcuda
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "arch.h"
#include "nvrtc.h"

namespace cudagen {

namespace {

// The driver entry points cudagen uses. Each is looked up with
// cuGetProcAddress by its base name at kDriverApiVersion, never with a bare
// dlsym: cuda.h maps names to versioned symbols (cuMemAlloc is cuMemAlloc_v2)
// and the member's type, taken from the header, is that version's signature.
// The argument is macro-expanded in the type and the member name alike (so
// `api.cuMemAlloc` is `api.cuMemAlloc_v2` everywhere), but not in #name.
#define CUDAGEN_DRIVER_FUNCTIONS(X)                                                                                  \
  X(cuInit) X(cuDriverGetVersion) X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetAttribute) X(cuDeviceGetName)      \
  X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxSetCurrent) X(cuMemGetInfo) X(cuModuleLoadData)    \
  X(cuModuleUnload) X(cuModuleGetFunction) X(cuFuncSetAttribute) X(cuMemAlloc) X(cuMemFree) X(cuMemcpyHtoDAsync)     \
  X(cuMemcpyDtoHAsync) X(cuMemcpyDtoDAsync) X(cuMemsetD8Async) X(cuLaunchKernel) X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamSynchronize)        \
  X(cuStreamBeginCapture) X(cuStreamEndCapture) X(cuGraphInstantiateWithFlags) X(cuGraphLaunch) X(cuGraphDestroy)    \
  X(cuGraphExecDestroy) X(cuEventCreate) X(cuEventDestroy) X(cuEventRecord) X(cuEventSynchronize)                    \
  X(cuEventElapsedTime) X(cuGetErrorName) X(cuGetErrorString) X(cuLaunchCooperativeKernel)                        \
  X(cuOccupancyMaxActiveBlocksPerMultiprocessor) X(cuTensorMapEncodeTiled)

// The functions above keep their signatures from CUDA 12.0 to this header's
// version, so asking for 12.0's lets a CUDA 12 driver run what this builds.
constexpr int kDriverApiVersion = 12000;
static_assert(CUDA_VERSION >= kDriverApiVersion, "cuda.h is older than the entry points cudagen asks for");

struct DriverApi {
  void* handle = nullptr;
  std::string library;
#define CUDAGEN_DECLARE(name) decltype(&::name) name = nullptr;
  CUDAGEN_DRIVER_FUNCTIONS(CUDAGEN_DECLARE)
#undef CUDAGEN_DECLARE
};

constexpr const char* kNoDriverHint =
    "run it on the CPU instead with --emulate (cudagen run) or Backend::emulation (the C++ API)";

using GetProcAddressV2 = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
using GetProcAddressV1 = CUresult (*)(const char*, void**, int, cuuint64_t);

// The driver library: CUDAGEN_CUDA_DRIVER, else libcuda.so.1.
std::string driver_library() {
  const char* configured = std::getenv("CUDAGEN_CUDA_DRIVER");
  return configured && *configured ? configured : "libcuda.so.1";
}

// Loads the driver library and every entry point, or throws DriverError
// naming what is missing.
std::shared_ptr<const DriverApi> load_driver_library(const std::string& library) {
  auto api = std::make_shared<DriverApi>();
  api->library = library;
  api->handle = dlopen(api->library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (api->handle == nullptr)
    throw DriverError(fmt::format("no CUDA driver found: cannot load {} ({}); this machine cannot launch on a GPU: {}",
                                  api->library, dlerror(), kNoDriverHint));
  auto v2 = reinterpret_cast<GetProcAddressV2>(dlsym(api->handle, "cuGetProcAddress_v2"));
  auto v1 = reinterpret_cast<GetProcAddressV1>(dlsym(api->handle, "cuGetProcAddress"));
  if (v2 == nullptr && v1 == nullptr)
    throw DriverError(fmt::format("{} has no cuGetProcAddress: the CUDA driver is older than CUDA 11.3; update it, or {}",
                                  api->library, kNoDriverHint));
  auto lookup = [&](const char* name) -> void* {
    void* fn = nullptr;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
    CUresult rc = v2 ? v2(name, &fn, kDriverApiVersion, CU_GET_PROC_ADDRESS_DEFAULT, &status)
                     : v1(name, &fn, kDriverApiVersion, CU_GET_PROC_ADDRESS_DEFAULT);
    if (rc != CUDA_SUCCESS || fn == nullptr || status != CU_GET_PROC_ADDRESS_SUCCESS)
      throw DriverError(fmt::format("the CUDA driver {} has no entry point {} (for CUDA {}.{}); update the driver, or {}",
                                    api->library, name, kDriverApiVersion / 1000, kDriverApiVersion % 1000 / 10,
                                    kNoDriverHint));
    return fn;
  };
#define CUDAGEN_LOOKUP(name) api->name = reinterpret_cast<decltype(api->name)>(lookup(#name));
  CUDAGEN_DRIVER_FUNCTIONS(CUDAGEN_LOOKUP)
#undef CUDAGEN_LOOKUP
  return api;
}

std::shared_ptr<const DriverApi> load_driver() {
  // One of the runtime's two process-wide caches (the other is NVRTC's handle): a loaded driver per library
  // path (the driver keeps its own state per process, so a second handle
  // would gain nothing). A failed load is not kept: the next call tries again.
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<const DriverApi>> loaded;
  const std::string library = driver_library();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = loaded.find(library);
  if (it == loaded.end()) it = loaded.emplace(library, load_driver_library(library)).first;
  return it->second;
}

std::string error_text(const DriverApi& api, CUresult rc) {
  const char* name = nullptr;
  const char* text = nullptr;
  api.cuGetErrorName(rc, &name);
  api.cuGetErrorString(rc, &text);
  return fmt::format("{} ({})", name ? name : fmt::format("CUresult {}", int(rc)), text ? text : "no description");
}

// Every driver call goes through check(), which names the call and what it
// was doing ("launching k3_fc2 (tasks fc2)").
void check(const DriverApi& api, CUresult rc, const char* call, const std::string& context) {
  if (rc == CUDA_SUCCESS) return;
  std::string hint;
  if (rc == CUDA_ERROR_NO_DEVICE) hint = fmt::format("; {}", kNoDriverHint);
  if (rc == CUDA_ERROR_OUT_OF_MEMORY) hint = "; lower the arena (a smaller batch, or memory reuse on) or free the GPU";
  const std::string_view text(call);  // "cuLaunchKernel(k.function, ...)": the name is enough
  throw DriverError(fmt::format("{} failed while {}: {}{}", text.substr(0, text.find('(')), context,
                                error_text(api, rc), hint));
}
#define CUDAGEN_CHECK(api, call, context) check(api, (api).call, #call, context)

GpuInfo describe_device(const DriverApi& api, int ordinal, CUdevice* device) {
  CUDAGEN_CHECK(api, cuInit(0), "starting the CUDA driver");
  int count = 0;
  CUDAGEN_CHECK(api, cuDeviceGetCount(&count), "counting the GPUs");
  if (count == 0) throw DriverError(fmt::format("the CUDA driver found no GPU; {}", kNoDriverHint));
  if (ordinal < 0 || ordinal >= count)
    throw DriverError(fmt::format("there is no GPU {}: this machine has {} (0 to {})", ordinal, count, count - 1));
  GpuInfo info;
  info.ordinal = ordinal;
  CUDAGEN_CHECK(api, cuDeviceGet(device, ordinal), "opening the GPU");
  char name[256] = {};
  CUDAGEN_CHECK(api, cuDeviceGetName(name, sizeof name, *device), "reading the GPU's name");
  info.name = name;
  int major = 0, minor = 0;
  CUDAGEN_CHECK(api, cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, *device),
                "reading the compute capability");
  CUDAGEN_CHECK(api, cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, *device),
                "reading the compute capability");
  info.arch = arch_for_device(major, minor).name();
  CUDAGEN_CHECK(api, cuDeviceGetAttribute(&info.sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, *device),
                "reading the GPU's SM count");
  CUDAGEN_CHECK(api, cuDriverGetVersion(&info.driver_version), "reading the driver version");
  return info;
}

// One compiled program on one GPU: its module, one arena, one stream, and a
// CUDA Graph per launcher once captured.
class GpuExecutor final : public Executor {
 public:
  GpuExecutor(const Compiled& compiled, const GpuCode& code, const GpuOptions& options)
      : api_(load_driver()), options_(options), watch_(compiled) {
    try {
      open(compiled, code);
      watch_.reset(*this);
    } catch (...) {
      release();  // the destructor does not run when the constructor throws
      throw;
    }
  }

  ~GpuExecutor() override { release(); }

  std::string where() const override { return where_; }
  bool on_gpu() const override { return true; }

 private:
  void open(const Compiled& compiled, const GpuCode& code) {
    const DriverApi& api = *api_;
    CUdevice device = 0;
    GpuInfo gpu = describe_device(api, options_.device, &device);
    device_ = device;
    CUDAGEN_CHECK(api, cuDevicePrimaryCtxRetain(&context_, device), "retaining the GPU's primary context");
    CUDAGEN_CHECK(api, cuCtxSetCurrent(context_), "making the GPU's context current");
    size_t free_bytes = 0, total_bytes = 0;
    CUDAGEN_CHECK(api, cuMemGetInfo(&free_bytes, &total_bytes), "reading the GPU's free memory");
    where_ = fmt::format("GPU {}: {} ({})", gpu.ordinal, gpu.name, gpu.arch);
    load_module(compiled, code, gpu);

    const int64_t arena_bytes = compiled.plan.arena_bytes;
    const int64_t budget = options_.budget_bytes > 0 ? options_.budget_bytes : int64_t(free_bytes);
    if (arena_bytes > budget)
      throw DriverError(fmt::format("the arena needs {} bytes but {} {} allow {}; lower the batch, keep memory reuse on, "
                                    "or raise the budget",
                                    arena_bytes, options_.budget_bytes > 0 ? "the budget" : "the GPU's free memory",
                                    options_.budget_bytes > 0 ? "does" : "would", budget));
    arena_bytes_ = arena_bytes;
    CUDAGEN_CHECK(api, cuMemAlloc(&arena_, size_t(std::max<int64_t>(arena_bytes, 1))),
                  fmt::format("allocating the arena ({} bytes)", arena_bytes));
    encode_tensor_maps();
    CUDAGEN_CHECK(api, cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), "creating a stream");
  }

  void release() noexcept {
    // Best effort: a destructor cannot report, and the context may be gone.
    const DriverApi& api = *api_;
    for (auto& [name, graph] : graphs_) {
      if (graph.exec) api.cuGraphExecDestroy(graph.exec);
      if (graph.graph) api.cuGraphDestroy(graph.graph);
    }
    for (auto& [index, pair] : events_) {
      api.cuEventDestroy(pair.first);
      api.cuEventDestroy(pair.second);
    }
    if (stream_) api.cuStreamDestroy(stream_);
    if (arena_) api.cuMemFree(arena_);
    if (module_) api.cuModuleUnload(module_);
    if (context_) api.cuDevicePrimaryCtxRelease(device_);
    graphs_.clear();
    events_.clear();
    stream_ = nullptr;
    arena_ = 0;
    module_ = nullptr;
    context_ = nullptr;
  }


 public:
  // Copies and fills go on the executor's stream and are waited for. The
  // stream is non-blocking, so it does not wait for the legacy default stream
  // that cuMemcpyHtoD and cuMemsetD8 use: a poisoning fill or a counter reset
  // issued there could land after a later launch's stores, and a pageable
  // upload may return before its last bytes arrive (seen on an H200 shared by
  // eight test processes: outputs read back NaN, megakernels waiting on
  // counters zeroed under them).
  void write(int64_t offset, const void* data, size_t bytes) override {
    check_range(offset, bytes, "write");
    const std::string what = fmt::format("copying {} bytes to the arena at {}", bytes, offset);
    CUDAGEN_CHECK(*api_, cuMemcpyHtoDAsync(arena_ + CUdeviceptr(offset), data, bytes, stream_), what);
    CUDAGEN_CHECK(*api_, cuStreamSynchronize(stream_), what);
  }
  void read(int64_t offset, void* data, size_t bytes) const override {
    check_range(offset, bytes, "read");
    const std::string what = fmt::format("copying {} bytes from the arena at {}", bytes, offset);
    CUDAGEN_CHECK(*api_, cuMemcpyDtoHAsync(data, arena_ + CUdeviceptr(offset), bytes, stream_), what);
    CUDAGEN_CHECK(*api_, cuStreamSynchronize(stream_), what);
  }
  void fill(int64_t offset, unsigned char byte, size_t bytes) override {
    check_range(offset, bytes, "fill");
    const std::string what = fmt::format("filling {} bytes of the arena at {}", bytes, offset);
    CUDAGEN_CHECK(*api_, cuMemsetD8Async(arena_ + CUdeviceptr(offset), byte, bytes, stream_), what);
    CUDAGEN_CHECK(*api_, cuStreamSynchronize(stream_), what);
  }

  bool has_function(const std::string& name) const override { return launchers_.count(name) != 0; }

  void run(const std::string& function) override {
    auto it = launchers_.find(function);
    if (it == launchers_.end()) throw DriverError(fmt::format("the program has no launcher {}", function));
    const DriverApi& api = *api_;
    CUDAGEN_CHECK(api, cuCtxSetCurrent(context_), "making the GPU's context current");
    run_ms_ = -1;
    enqueue(function, it->second);
    CUDAGEN_CHECK(api, cuStreamSynchronize(stream_), fmt::format("running {} ({})", function, describe_kernels(it->second)));
    if (options_.profile) collect_times(it->second);
    watch_.check(*this, function);
  }

  double time_runs(const std::string& function, int runs) override {
    const bool profiling = options_.profile;
    options_.profile = false;  // no per-kernel events: the batch is timed as a whole
    run(function);             // warm-up: module loaded, CUDA Graph captured
    const std::vector<int>& kernels = launchers_.at(function);
    const DriverApi& api = *api_;
    auto& [start, end] = event_pair(kBatchEvents);
    CUDAGEN_CHECK(api, cuEventRecord(start, stream_), "timing a batch of runs");
    for (int r = 0; r < runs; ++r) enqueue(function, kernels);
    CUDAGEN_CHECK(api, cuEventRecord(end, stream_), "timing a batch of runs");
    options_.profile = profiling;
    CUDAGEN_CHECK(api, cuEventSynchronize(end), fmt::format("running {} {} times ({})", function, runs,
                                                             describe_kernels(kernels)));
    watch_.check(*this, function);
    float ms = 0;
    CUDAGEN_CHECK(api, cuEventElapsedTime(&ms, start, end), "reading a batch's time");
    return double(ms) / runs;
  }

  std::vector<KernelTime> kernel_times() const override { return times_; }
  void set_profiling(bool on) override { options_.profile = on; }
  double last_run_milliseconds() const override { return run_ms_; }

  double copy_bandwidth() override {
    const DriverApi& api = *api_;
    CUDAGEN_CHECK(api, cuCtxSetCurrent(context_), "making the GPU's context current");
    size_t free_bytes = 0, total_bytes = 0;
    CUDAGEN_CHECK(api, cuMemGetInfo(&free_bytes, &total_bytes), "reading the GPU's free memory");
    // Large enough that the copy runs at the memory's rate, not the launch's
    // (256 MiB each way), but never more than a quarter of what is free.
    const size_t bytes = std::min<size_t>(size_t(256) << 20, free_bytes / 4) & ~size_t(255);
    if (bytes == 0) throw DriverError("measuring the copy bandwidth: the GPU has no free memory");
    CUdeviceptr from = 0, to = 0;
    CUDAGEN_CHECK(api, cuMemAlloc(&from, bytes), fmt::format("allocating {} bytes to measure the copy bandwidth", bytes));
    double best_ms = 0;
    try {
      CUDAGEN_CHECK(api, cuMemAlloc(&to, bytes), fmt::format("allocating {} bytes to measure the copy bandwidth", bytes));
      auto& [start, end] = event_pair(kCopyEvents);
      for (int i = 0; i < 6; ++i) {  // the first is a warm-up; the best of the rest
        CUDAGEN_CHECK(api, cuEventRecord(start, stream_), "timing a copy");
        CUDAGEN_CHECK(api, cuMemcpyDtoDAsync(to, from, bytes, stream_), "copying to measure the bandwidth");
        CUDAGEN_CHECK(api, cuEventRecord(end, stream_), "timing a copy");
        CUDAGEN_CHECK(api, cuEventSynchronize(end), "timing a copy");
        float ms = 0;
        CUDAGEN_CHECK(api, cuEventElapsedTime(&ms, start, end), "reading a copy's time");
        if (i > 0 && (best_ms == 0 || ms < best_ms)) best_ms = ms;
      }
    } catch (...) {
      if (to) api.cuMemFree(to);
      api.cuMemFree(from);
      throw;
    }
    api.cuMemFree(to);
    api.cuMemFree(from);
    return best_ms > 0 ? 2.0 * double(bytes) / (best_ms * 1e-3) : 0;
  }

 private:
  struct Kernel {
    std::string name, tasks;
    CUfunction function = nullptr;
    unsigned grid[3] = {1, 1, 1};
    unsigned block = 1;
    unsigned smem = 0;
    std::vector<int64_t> arg_offsets;
    std::vector<std::pair<int, TensorMapSpec>> map_specs;  // the TMA tensor maps among the parameters
    std::vector<std::pair<int, CUtensorMap>> maps;         // encoded once the arena is allocated
    bool cooperative = false;  // a megakernel: every block resident at once
  };
  struct Graph {
    CUgraph graph = nullptr;
    CUgraphExec exec = nullptr;
  };

  void load_module(const Compiled& compiled, const GpuCode& code, const GpuInfo& gpu) {
    const DriverApi& api = *api_;
    std::vector<char> binary = code.binary;
    if (code.ptx && (binary.empty() || binary.back() != '\0')) binary.push_back('\0');  // the driver reads PTX as text
    CUDAGEN_CHECK(api, cuModuleLoadData(&module_, binary.data()),
                  fmt::format("loading the {} compiled for {} (the GPU is {})", code.ptx ? "PTX" : "CUBIN",
                              code.report.arch, gpu.arch));

    const Program& p = compiled.program;
    for (const EmittedKernel& ek : compiled.emitted.kernels) {
      Kernel k;
      k.name = ek.name;
      std::vector<std::string> tasks;
      for (int t : ek.tasks) tasks.push_back(p.tasks[size_t(t)].task->id);
      k.tasks = fmt::format("task{} {}", tasks.size() == 1 ? "" : "s", fmt::join(tasks, ", "));
      CUDAGEN_CHECK(api, cuModuleGetFunction(&k.function, module_, ek.name.c_str()),
                    fmt::format("finding kernel {} ({}) in the module", k.name, k.tasks));
      const auto grid = launch_grid(ek);  // folded where the tiles' y or z is over 65535
      for (int d = 0; d < 3; ++d) k.grid[d] = unsigned(grid[d]);
      // A persistent kernel: a block for each of this GPU's slots (the
      // generator's grid is the target's SM count, which differs between an
      // H100 SXM and PCIe, say: more blocks than slots would run a second wave).
      if (ek.persistent_tiles > 0)
        k.grid[0] = unsigned(persistent_grid(persistent_most_blocks(ek), ek.min_blocks_per_sm, multiprocessors()));
      k.block = unsigned(ek.block);
      k.smem = unsigned(ek.smem_bytes);
      if (ek.smem_bytes > 48 * 1024)  // above 48 KiB a kernel must opt in to its dynamic shared memory
        CUDAGEN_CHECK(api, cuFuncSetAttribute(k.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(k.smem)),
                      fmt::format("giving kernel {} ({}) {} bytes of shared memory", k.name, k.tasks, k.smem));
      k.arg_offsets = ek.arg_offsets;
      k.map_specs = ek.tensor_maps;
      k.cooperative = ek.cooperative;
      if (k.cooperative) check_residency(k, gpu);
      launchers_[phase_function(ek.phase)].push_back(int(kernels_.size()));
      kernels_.push_back(std::move(k));
    }
    // One training step, as the file's cudagen_step does: a graph with a
    // backward phase has one, with or without an update (attention's
    // gradients alone, as bench/attention_graph.py --train writes them).
    std::vector<int> step;
    for (Phase phase : {Phase::forward, Phase::backward, Phase::update}) {
      auto it = launchers_.find(phase_function(phase));
      if (it != launchers_.end()) step.insert(step.end(), it->second.begin(), it->second.end());
    }
    if (launchers_.count(phase_function(Phase::backward)) || launchers_.count(phase_function(Phase::update)))
      launchers_[kStepFunction] = step;
  }

  // The Hopper kernels' TMA tensor maps (EmittedKernel::tensor_maps), from
  // the arena's address: encoded once, as the arena never moves, and passed
  // by value at each launch.
  void encode_tensor_maps() {
    const DriverApi& api = *api_;
    for (Kernel& k : kernels_)
      for (const auto& [arg, spec] : k.map_specs) {
        CUtensorMap map;
        // (3-D: a box one plane deep.)
        const cuuint64_t dims[3] = {cuuint64_t(spec.width), cuuint64_t(spec.height), cuuint64_t(spec.depth)},
                         strides[2] = {cuuint64_t(spec.row_stride_bytes), cuuint64_t(spec.plane_stride_bytes)};
        const cuuint32_t box[3] = {cuuint32_t(spec.box_width), cuuint32_t(spec.box_height), 1},
                         element_strides[3] = {1, 1, 1};
        CUDAGEN_CHECK(api,
                      cuTensorMapEncodeTiled(&map, spec.element_bytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16
                                                                           : CU_TENSOR_MAP_DATA_TYPE_UINT8,
                                             cuuint32_t(spec.rank()),
                                             reinterpret_cast<void*>(arena_ + CUdeviceptr(spec.tensor_offset)), dims,
                                             strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                      fmt::format("encoding kernel {}'s TMA tensor map of arena + {} ({} x {}{} elements, a {} x {} box)",
                                  k.name, spec.tensor_offset, spec.width, spec.height,
                                  spec.depth > 0 ? fmt::format(" x {}", spec.depth) : std::string(), spec.box_width,
                                  spec.box_height));
        k.maps.emplace_back(arg, map);
      }
  }

  void launch(int index) {
    const Kernel& k = kernels_[size_t(index)];
    std::vector<CUdeviceptr> pointers;
    for (int64_t offset : k.arg_offsets) pointers.push_back(arena_ + CUdeviceptr(offset));
    std::vector<void*> params;
    for (auto& pointer : pointers) params.push_back(&pointer);
    for (const auto& [arg, map] : k.maps) params[size_t(arg)] = const_cast<CUtensorMap*>(&map);  // by value
    params.push_back(nullptr);  // not read by the driver, which knows the count; lets a test driver find the end
    const DriverApi& api = *api_;
    if (options_.profile) {
      auto& [start, end] = event_pair(index);
      CUDAGEN_CHECK(api, cuEventRecord(start, stream_), "timing a kernel");
      launch_checked(k, params);
      CUDAGEN_CHECK(api, cuEventRecord(end, stream_), "timing a kernel");
    } else {
      launch_checked(k, params);
    }
  }

  // The launcher's kernels on the stream, without waiting: replayed from its
  // CUDA Graph where one is asked for and no profiling needs per-kernel
  // events. A megakernel is one launch already (and a cooperative one, which
  // stream capture need not take).
  void enqueue(const std::string& function, const std::vector<int>& kernels) {
    const bool cooperative =
        std::any_of(kernels.begin(), kernels.end(), [&](int k) { return kernels_[size_t(k)].cooperative; });
    if (options_.cuda_graph && !options_.profile && !cooperative) {
      run_graph(function, kernels);
    } else {
      for (int k : kernels) launch(k);
    }
  }

  int multiprocessors() const {
    int sms = 0;
    CUDAGEN_CHECK(*api_, cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device_),
                  "reading the GPU's multiprocessor count");
    return sms;
  }

  // A megakernel's blocks wait for one another, so all of them must be on
  // the GPU at once: check before the first launch rather than hang.
  void check_residency(const Kernel& k, const GpuInfo& gpu) {
    const DriverApi& api = *api_;
    int per_sm = 0;
    CUDAGEN_CHECK(api, cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k.function, int(k.block), k.smem),
                  fmt::format("reading the occupancy of megakernel {}", k.name));
    const int sms = multiprocessors();
    if (int64_t(per_sm) * sms < int64_t(k.grid[0]))
      throw DriverError(fmt::format(
          "megakernel {} needs {} blocks of {} threads ({} bytes of shared memory) resident at once, but {} holds {} "
          "({} per SM x {} SMs); compile with --megakernel-blocks {} or fewer",
          k.name, k.grid[0], k.block, k.smem, gpu.name, per_sm * sms, per_sm, sms, per_sm * sms));
  }

  void launch_checked(const Kernel& k, std::vector<void*>& params) {
    if (k.cooperative) {
      CUDAGEN_CHECK(*api_,
                    cuLaunchCooperativeKernel(k.function, k.grid[0], k.grid[1], k.grid[2], k.block, 1, 1, k.smem,
                                              stream_, params.data()),
                    fmt::format("launching megakernel {} cooperatively on {} blocks x {} threads, {} bytes of shared "
                                "memory",
                                k.name, k.grid[0], k.block, k.smem));
      return;
    }
    CUDAGEN_CHECK(*api_,
                  cuLaunchKernel(k.function, k.grid[0], k.grid[1], k.grid[2], k.block, 1, 1, k.smem, stream_,
                                 params.data(), nullptr),
                  fmt::format("launching kernel {} ({}) on grid ({}, {}, {}) x {} threads, {} bytes of shared memory",
                              k.name, k.tasks, k.grid[0], k.grid[1], k.grid[2], k.block, k.smem));
  }

  // The launcher's kernels captured once into a CUDA Graph, then replayed
  // with one launch: the pointers are fixed (one arena, allocated once) and
  // run-time arguments live in the arena, so the graph never goes stale.
  void run_graph(const std::string& function, const std::vector<int>& kernels) {
    const DriverApi& api = *api_;
    Graph& g = graphs_[function];
    if (g.exec == nullptr) {
      CUDAGEN_CHECK(api, cuStreamBeginCapture(stream_, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                    fmt::format("capturing {} into a CUDA Graph", function));
      try {
        for (int k : kernels) launch(k);
      } catch (...) {
        CUgraph abandoned = nullptr;
        api.cuStreamEndCapture(stream_, &abandoned);
        if (abandoned) api.cuGraphDestroy(abandoned);
        throw;
      }
      CUDAGEN_CHECK(api, cuStreamEndCapture(stream_, &g.graph), fmt::format("capturing {} into a CUDA Graph", function));
      CUDAGEN_CHECK(api, cuGraphInstantiateWithFlags(&g.exec, g.graph, 0),
                    fmt::format("instantiating the CUDA Graph of {} ({})", function, describe_kernels(kernels)));
    }
    CUDAGEN_CHECK(api, cuGraphLaunch(g.exec, stream_),
                  fmt::format("launching the CUDA Graph of {} ({})", function, describe_kernels(kernels)));
  }

  std::pair<CUevent, CUevent>& event_pair(int index) {
    auto it = events_.find(index);
    if (it != events_.end()) return it->second;
    std::pair<CUevent, CUevent> pair{};
    CUDAGEN_CHECK(*api_, cuEventCreate(&pair.first, CU_EVENT_DEFAULT), "creating a timing event");
    CUDAGEN_CHECK(*api_, cuEventCreate(&pair.second, CU_EVENT_DEFAULT), "creating a timing event");
    return events_[index] = pair;
  }

  // Each kernel's time, and its start from the launcher's first kernel's.
  void collect_times(const std::vector<int>& kernels) {
    times_.clear();
    run_ms_ = -1;
    if (kernels.empty()) return;
    const CUevent first = event_pair(kernels.front()).first;
    for (int index : kernels) {
      auto& [start, end] = event_pair(index);
      float ms = 0, start_ms = 0;
      CUDAGEN_CHECK(*api_, cuEventElapsedTime(&ms, start, end), "reading a kernel's time");
      CUDAGEN_CHECK(*api_, cuEventElapsedTime(&start_ms, first, start), "reading a kernel's start");
      const auto& k = kernels_[size_t(index)];
      times_.push_back(KernelTime{k.name, ms, start_ms, {k.grid[0], k.grid[1], k.grid[2]}});
    }
    float total = 0;
    CUDAGEN_CHECK(*api_, cuEventElapsedTime(&total, first, event_pair(kernels.back()).second), "reading a run's time");
    run_ms_ = total;
  }

  std::string describe_kernels(const std::vector<int>& kernels) const {
    std::vector<std::string> parts;
    for (int k : kernels) parts.push_back(fmt::format("{}: {}", kernels_[size_t(k)].name, kernels_[size_t(k)].tasks));
    return fmt::format("kernels {}", fmt::join(parts, "; "));
  }

  void check_range(int64_t offset, size_t bytes, const char* what) const {
    check_arena_range(offset, bytes, arena_bytes_, what);
  }

  std::shared_ptr<const DriverApi> api_;
  GpuOptions options_;
  std::string where_;
  CUdevice device_ = 0;
  MegakernelWatch watch_;
  CUcontext context_ = nullptr;
  CUmodule module_ = nullptr;
  CUdeviceptr arena_ = 0;
  int64_t arena_bytes_ = 0;
  CUstream stream_ = nullptr;
  std::vector<Kernel> kernels_;
  std::map<std::string, std::vector<int>> launchers_;  // function -> kernels, in launch order
  std::map<std::string, Graph> graphs_;
  std::map<int, std::pair<CUevent, CUevent>> events_;  // per kernel index, and kCopyEvents
  std::vector<KernelTime> times_;
  double run_ms_ = -1;
  static constexpr int kCopyEvents = -1;
  static constexpr int kBatchEvents = -2;
};

}  // namespace

GpuInfo find_gpu(int ordinal) {
  auto api = load_driver();
  CUdevice device = 0;
  GpuInfo info = describe_device(*api, ordinal, &device);
  return info;
}

std::string describe(const GpuCompileReport& r) {
  if (!r.cached) return fmt::format("NVRTC for {}: {:.2f} s (cache off)", r.arch, r.compile_seconds);
  if (r.cache == CacheOutcome::uncached)  // the warning, with its reason the first time only
    return fmt::format("NVRTC for {}: {:.2f} s ({}{})", r.arch, r.compile_seconds, to_string(r.cache),
                       r.cache_problem.empty() ? "" : ": " + r.cache_problem);
  if (r.cache == CacheOutcome::miss || r.cache == CacheOutcome::rebuilt_corrupt)
    return fmt::format("NVRTC for {}: {:.2f} s (cache {}{}; stored in {})", r.arch, r.compile_seconds, to_string(r.cache),
                       r.cache_problem.empty() ? "" : ": " + r.cache_problem, r.cache_path);
  return fmt::format("NVRTC for {}: cache {} ({})", r.arch, to_string(r.cache), r.cache_path);
}

GpuCode compile_for_gpu(const Compiled& compiled, const GpuOptions& options) {
  GpuCode code;
  code.ptx = options.ptx;
  GpuCompileReport& r = code.report;
  r.arch = options.arch.empty() ? find_gpu(options.device).arch : options.arch;
  const std::string& source = compiled.emitted.cuda_source;
  auto build = [&]() {
    NvrtcOutput out = nvrtc_compile(source, compiled.program.graph.name + ".cu", r.arch, options.ptx);
    r.compile_seconds = out.seconds;
    r.log = out.log;
    return out.binary;
  };
  if (!options.use_cache) {
    code.binary = build();
    return code;
  }
  BinaryCache cache(options.cache_dir.empty() ? default_cache_dir() : options.cache_dir);
  CacheResult entry =
      cache.get_or_build(cache_key(source, nvrtc_options_text(r.arch, options.ptx), nvrtc_version(), r.arch), build);
  code.binary = std::move(entry.binary);
  r.cached = true;
  r.cache = entry.outcome;
  r.cache_path = entry.path;
  r.cache_problem = entry.problem;
  return code;
}

std::unique_ptr<Executor> make_gpu_executor(const Compiled& compiled, const GpuCode& code, const GpuOptions& options) {
  return std::make_unique<GpuExecutor>(compiled, code, options);
}

}  // namespace cudagen
