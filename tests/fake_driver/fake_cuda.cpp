// A stand-in for libcuda.so.1, for testing the runtime's GPU path on machines
// without a GPU (CI): loaded through CUDAGEN_CUDA_DRIVER, it answers
// cuGetProcAddress like the real driver, keeps "device memory" in host memory,
// and records every launch (kernel, grid, block, shared memory, and each
// pointer argument as an offset into the allocation it points into) instead of
// running it. It checks what it can: that each kernel exists in the CUBIN it
// was given, and that each pointer lies inside an allocation.
//
// Environment, read at each call:
//   FAKE_CUDA_MISSING=NAME      cuGetProcAddress does not find NAME
//   FAKE_CUDA_FAIL=CALL[:KERNEL] CALL fails (for cuLaunchKernel, only on KERNEL)
//   FAKE_CUDA_DEVICES=N         the number of GPUs (default 1)
//   FAKE_CUDA_FREE_BYTES=N      what cuMemGetInfo reports free (default 1 GiB)
//   FAKE_CUDA_SMS=N             multiprocessors (default 132); each holds 2 blocks of any kernel
//   FAKE_CUDA_CC=M.N            the compute capability (default 9.0)
//
// cuTensorMapEncodeTiled checks every limit the driver documents for the
// maps cudagen makes, logs the map, and writes the tensor's address in its
// first 8 bytes, so that a launch logs a map as the offset it points to.
#include <cuda.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace {

struct Launch {
  std::string kernel;
  std::string text;
};

struct State {
  std::string log;
  std::map<CUdeviceptr, size_t> allocations;
  std::vector<std::string> module_images;  // the bytes each loaded module was given
  std::vector<std::string> function_names;
  bool capturing = false;
  std::vector<std::string> captured;  // launches recorded into the graph being captured
  std::vector<std::vector<std::string>> graphs;
  int events = 0;
  // A pretend device clock: each launch takes 0.5 ms, each copy 1 ms; an
  // event holds the clock when it was recorded.
  double clock_ms = 0;
  std::map<CUevent, double> event_times;
};

State& state() {
  static State s;  // test scaffolding: one fake device per process
  return s;
}

bool env_is(const char* name, const std::string& value) {
  const char* v = std::getenv(name);
  return v != nullptr && value == v;
}

bool fails(const std::string& call, const std::string& kernel = "") {
  const char* v = std::getenv("FAKE_CUDA_FAIL");
  if (v == nullptr) return false;
  std::string spec = v;
  if (spec == call) return true;
  return !kernel.empty() && spec == call + ":" + kernel;
}

std::string offset_text(CUdeviceptr p) {
  for (const auto& [base, size] : state().allocations)
    if (p >= base && p < base + size) return "+" + std::to_string(p - base);
  return "OUTSIDE";
}

// The size of an ELF image: its section headers come last.
size_t elf_size(const unsigned char* image) {
  uint64_t shoff = 0;
  uint16_t shentsize = 0, shnum = 0;
  std::memcpy(&shoff, image + 0x28, 8);
  std::memcpy(&shentsize, image + 0x3A, 2);
  std::memcpy(&shnum, image + 0x3C, 2);
  return size_t(shoff) + size_t(shentsize) * shnum;
}

CUresult fake_cuInit(unsigned int) { return fails("cuInit") ? CUDA_ERROR_NO_DEVICE : CUDA_SUCCESS; }
CUresult fake_cuDriverGetVersion(int* v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
CUresult fake_cuDeviceGetCount(int* n) {
  const char* v = std::getenv("FAKE_CUDA_DEVICES");
  *n = v ? std::atoi(v) : 1;
  return CUDA_SUCCESS;
}
CUresult fake_cuDeviceGet(CUdevice* d, int ordinal) {
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult fake_cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice) {
  // FAKE_CUDA_CC ("8.9"): the compute capability; an H100's 9.0 by default.
  const char* cc = std::getenv("FAKE_CUDA_CC");
  const int major = cc != nullptr ? std::atoi(cc) : 9;
  const int minor = cc != nullptr && std::strchr(cc, '.') != nullptr ? std::atoi(std::strchr(cc, '.') + 1) : 0;
  if (attribute == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) *value = major;
  else if (attribute == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) *value = minor;
  else if (attribute == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
    *value = std::getenv("FAKE_CUDA_SMS") ? std::atoi(std::getenv("FAKE_CUDA_SMS")) : 132;
  else return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}
CUresult fake_cuDeviceGetName(char* name, int len, CUdevice) {
  std::strncpy(name, "Fake GPU", size_t(len));
  return CUDA_SUCCESS;
}
CUresult fake_cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice) {
  *c = reinterpret_cast<CUcontext>(0x1);
  state().log += "context retained\n";
  return CUDA_SUCCESS;
}
CUresult fake_cuDevicePrimaryCtxRelease(CUdevice) {
  state().log += "context released\n";
  return CUDA_SUCCESS;
}
CUresult fake_cuCtxSetCurrent(CUcontext) { return CUDA_SUCCESS; }
CUresult fake_cuMemGetInfo(size_t* free_bytes, size_t* total) {
  const char* v = std::getenv("FAKE_CUDA_FREE_BYTES");
  *free_bytes = v ? size_t(std::atoll(v)) : (size_t(1) << 30);
  *total = size_t(2) << 30;
  return CUDA_SUCCESS;
}
CUresult fake_cuModuleLoadData(CUmodule* m, const void* image) {
  const auto* bytes = static_cast<const unsigned char*>(image);
  std::string copy;
  if (std::memcmp(bytes, "\x7f" "ELF", 4) == 0) copy.assign(reinterpret_cast<const char*>(bytes), elf_size(bytes));
  else copy = reinterpret_cast<const char*>(bytes);  // PTX: NUL-terminated text
  if (fails("cuModuleLoadData")) return CUDA_ERROR_NO_BINARY_FOR_GPU;
  state().module_images.push_back(copy);
  *m = reinterpret_cast<CUmodule>(state().module_images.size());
  state().log += "module loaded (" + std::string(copy.rfind("\x7f" "ELF", 0) == 0 ? "CUBIN" : "PTX") + ")\n";
  return CUDA_SUCCESS;
}
CUresult fake_cuModuleUnload(CUmodule) {
  state().log += "module unloaded\n";
  return CUDA_SUCCESS;
}
CUresult fake_cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
  const std::string& image = state().module_images.at(size_t(reinterpret_cast<uintptr_t>(m)) - 1);
  // In a CUBIN the name is a NUL-terminated symbol; in PTX an .entry.
  const bool found = image.find(std::string("\0", 1) + name + std::string("\0", 1)) != std::string::npos ||
                     image.find(std::string(".entry ") + name + "(") != std::string::npos;
  if (!found) return CUDA_ERROR_NOT_FOUND;
  state().function_names.push_back(name);
  *f = reinterpret_cast<CUfunction>(state().function_names.size());
  return CUDA_SUCCESS;
}
CUresult fake_cuFuncSetAttribute(CUfunction, CUfunction_attribute, int) { return CUDA_SUCCESS; }
CUresult fake_cuMemAlloc(CUdeviceptr* p, size_t bytes) {
  if (fails("cuMemAlloc")) return CUDA_ERROR_OUT_OF_MEMORY;
  *p = CUdeviceptr(reinterpret_cast<uintptr_t>(std::malloc(bytes)));
  state().allocations[*p] = bytes;
  state().log += "alloc " + std::to_string(bytes) + "\n";
  return CUDA_SUCCESS;
}
CUresult fake_cuMemFree(CUdeviceptr p) {
  state().allocations.erase(p);
  std::free(reinterpret_cast<void*>(uintptr_t(p)));
  state().log += "free\n";
  return CUDA_SUCCESS;
}
// The one stream fake_cuStreamCreate hands out. Copies and fills of the arena
// must go on it: the runtime's stream is non-blocking, so work on the legacy
// default stream (cuMemcpyHtoD, cuMemsetD8) would not be ordered with its
// launches; this fake offers only the stream-ordered forms, and refuses others.
const CUstream kFakeStream = reinterpret_cast<CUstream>(0x2);

CUresult fake_cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
  if (stream != kFakeStream) return CUDA_ERROR_INVALID_HANDLE;
  if (offset_text(dst) == "OUTSIDE" || (bytes && offset_text(dst + bytes - 1) == "OUTSIDE")) return CUDA_ERROR_INVALID_VALUE;
  std::memcpy(reinterpret_cast<void*>(uintptr_t(dst)), src, bytes);
  return CUDA_SUCCESS;
}
CUresult fake_cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  if (stream != kFakeStream) return CUDA_ERROR_INVALID_HANDLE;
  if (offset_text(src) == "OUTSIDE" || (bytes && offset_text(src + bytes - 1) == "OUTSIDE")) return CUDA_ERROR_INVALID_VALUE;
  std::memcpy(dst, reinterpret_cast<const void*>(uintptr_t(src)), bytes);
  return CUDA_SUCCESS;
}
CUresult fake_cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream) {
  if (offset_text(dst) == "OUTSIDE" || offset_text(src) == "OUTSIDE") return CUDA_ERROR_INVALID_VALUE;
  // Not copied: the runtime only times it (the bytes are never touched, so
  // the large buffers it allocates cost nothing).
  state().clock_ms += 1.0;
  state().log += "copy " + std::to_string(bytes) + "\n";
  return CUDA_SUCCESS;
}
CUresult fake_cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t bytes, CUstream stream) {
  if (stream != kFakeStream) return CUDA_ERROR_INVALID_HANDLE;
  if (offset_text(dst) == "OUTSIDE") return CUDA_ERROR_INVALID_VALUE;
  std::memset(reinterpret_cast<void*>(uintptr_t(dst)), value, bytes);
  return CUDA_SUCCESS;
}
CUresult fake_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                             unsigned smem, CUstream stream, void** params, void** extra) {
  const std::string& name = state().function_names.at(size_t(reinterpret_cast<uintptr_t>(f)) - 1);
  if (fails("cuLaunchKernel", name)) return CUDA_ERROR_LAUNCH_FAILED;
  if (stream != kFakeStream) return CUDA_ERROR_INVALID_HANDLE;
  if (extra != nullptr) return CUDA_ERROR_INVALID_VALUE;
  // Every parameter of a cudagen kernel is a pointer into the arena. The
  // driver learns their count from the CUBIN; this fake relies on the
  // runtime's null terminator after the last one.
  std::string text = name + " grid=" + std::to_string(gx) + "," + std::to_string(gy) + "," + std::to_string(gz) +
                     " block=" + std::to_string(bx) + "," + std::to_string(by) + "," + std::to_string(bz) +
                     " smem=" + std::to_string(smem) + " args=";
  for (int i = 0; params[i] != nullptr && i < 64; ++i) {
    CUdeviceptr p = 0;
    std::memcpy(&p, params[i], sizeof p);
    text += (i ? "," : "") + offset_text(p);
  }
  state().clock_ms += 0.5;
  if (state().capturing) {
    state().captured.push_back(text);
    state().log += "capture " + text + "\n";
  } else {
    state().log += "launch " + text + "\n";
  }
  return CUDA_SUCCESS;
}
CUresult fake_cuOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, CUfunction, int, size_t) {
  *blocks = 2;
  return CUDA_SUCCESS;
}
CUresult fake_cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                        unsigned bz, unsigned smem, CUstream stream, void** params) {
  const std::string& name = state().function_names.at(size_t(reinterpret_cast<uintptr_t>(f)) - 1);
  if (fails("cuLaunchCooperativeKernel", name)) return CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
  state().log += "cooperative ";
  return fake_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, nullptr);
}
CUresult fake_cuStreamCreate(CUstream* s, unsigned int) {
  *s = kFakeStream;
  return CUDA_SUCCESS;
}
CUresult fake_cuStreamDestroy(CUstream) { return CUDA_SUCCESS; }
CUresult fake_cuStreamSynchronize(CUstream) {
  if (fails("cuStreamSynchronize")) return CUDA_ERROR_ILLEGAL_ADDRESS;
  state().log += "synchronize\n";
  return CUDA_SUCCESS;
}
CUresult fake_cuStreamBeginCapture(CUstream, CUstreamCaptureMode) {
  state().capturing = true;
  state().captured.clear();
  state().log += "begin capture\n";
  return CUDA_SUCCESS;
}
CUresult fake_cuStreamEndCapture(CUstream, CUgraph* g) {
  state().capturing = false;
  state().graphs.push_back(state().captured);
  *g = reinterpret_cast<CUgraph>(state().graphs.size());
  state().log += "end capture\n";
  return CUDA_SUCCESS;
}
CUresult fake_cuGraphInstantiateWithFlags(CUgraphExec* e, CUgraph g, unsigned long long) {
  *e = reinterpret_cast<CUgraphExec>(g);
  state().log += "instantiate graph\n";
  return CUDA_SUCCESS;
}
CUresult fake_cuGraphLaunch(CUgraphExec e, CUstream) {
  state().log += "graph launch (" + std::to_string(state().graphs.at(size_t(reinterpret_cast<uintptr_t>(e)) - 1).size()) +
                 " kernels)\n";
  return CUDA_SUCCESS;
}
CUresult fake_cuGraphDestroy(CUgraph) { return CUDA_SUCCESS; }
CUresult fake_cuGraphExecDestroy(CUgraphExec) { return CUDA_SUCCESS; }
CUresult fake_cuEventCreate(CUevent* e, unsigned int) {
  *e = reinterpret_cast<CUevent>(uintptr_t(++state().events));
  return CUDA_SUCCESS;
}
CUresult fake_cuEventDestroy(CUevent) { return CUDA_SUCCESS; }
CUresult fake_cuEventRecord(CUevent e, CUstream) {
  state().event_times[e] = state().clock_ms;
  return CUDA_SUCCESS;
}
CUresult fake_cuEventSynchronize(CUevent) { return CUDA_SUCCESS; }
CUresult fake_cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
  auto a = state().event_times.find(start), b = state().event_times.find(end);
  if (a == state().event_times.end() || b == state().event_times.end()) return CUDA_ERROR_INVALID_HANDLE;
  *ms = float(b->second - a->second);
  return CUDA_SUCCESS;
}
CUresult fake_cuGetErrorName(CUresult rc, const char** name) {
  switch (rc) {
    case CUDA_ERROR_LAUNCH_FAILED: *name = "CUDA_ERROR_LAUNCH_FAILED"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *name = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    case CUDA_ERROR_NO_BINARY_FOR_GPU: *name = "CUDA_ERROR_NO_BINARY_FOR_GPU"; break;
    default: *name = "CUDA_ERROR_UNKNOWN"; break;
  }
  return CUDA_SUCCESS;
}
// The limits cuTensorMapEncodeTiled documents (CUDA 13's cuda.h), for tiled maps.
CUresult fake_cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address,
                                     const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                     const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                     CUtensorMapSwizzle swizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill) {
  auto refuse = [&](const std::string& why) {
    state().log += "tensor map refused: " + why + "\n";
    return CUDA_ERROR_INVALID_VALUE;
  };
  if (fails("cuTensorMapEncodeTiled")) return CUDA_ERROR_INVALID_VALUE;
  const unsigned element = type == CU_TENSOR_MAP_DATA_TYPE_UINT8 ? 1 : type == CU_TENSOR_MAP_DATA_TYPE_UINT16 ? 2 : 4;
  if (map == nullptr || reinterpret_cast<uintptr_t>(map) % 64 != 0) return refuse("the map is not 64-byte aligned");
  if (rank < 1 || rank > 5) return refuse("rank " + std::to_string(rank));
  const CUdeviceptr base = reinterpret_cast<CUdeviceptr>(address);
  if (base % 16 != 0) return refuse("the address is not 16-byte aligned");
  if (offset_text(base) == "OUTSIDE") return refuse("the address lies in no allocation");
  for (cuuint32_t i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > (cuuint64_t(1) << 32)) return refuse("dimension " + std::to_string(i));
    if (box[i] == 0 || box[i] > 256) return refuse("box side " + std::to_string(i) + " of " + std::to_string(box[i]));
    if (element_strides[i] == 0 || element_strides[i] > 8) return refuse("element stride " + std::to_string(i));
  }
  for (cuuint32_t i = 0; i + 1 < rank; ++i)
    if (strides[i] % 16 != 0 || strides[i] >= (cuuint64_t(1) << 40))
      return refuse("stride " + std::to_string(i) + " of " + std::to_string(strides[i]) + " bytes");
  const cuuint64_t inner = cuuint64_t(box[0]) * element;
  if (interleave == CU_TENSOR_MAP_INTERLEAVE_NONE && inner % 16 != 0) return refuse("the box's rows are not whole 16 bytes");
  const cuuint64_t span = swizzle == CU_TENSOR_MAP_SWIZZLE_32B ? 32 : swizzle == CU_TENSOR_MAP_SWIZZLE_64B ? 64
                          : swizzle == CU_TENSOR_MAP_SWIZZLE_128B ? 128 : 0;
  if (span != 0 && inner > span) return refuse("the box's rows are wider than the swizzle span");
  std::memset(map, 0, sizeof *map);
  std::memcpy(map, &base, sizeof base);
  // (Rank 3: the planes, their stride and the box's depth after the 2-D figures.)
  const bool planes = rank == 3;
  state().log += "tensor map " + offset_text(base) + " " + std::to_string(dims[0]) + "x" + std::to_string(dims[1]) +
                 (planes ? "x" + std::to_string(dims[2]) : "") + " stride " + std::to_string(strides[0]) +
                 (planes ? "," + std::to_string(strides[1]) : "") + " box " + std::to_string(box[0]) + "x" +
                 std::to_string(box[1]) + (planes ? "x" + std::to_string(box[2]) : "") + " swizzle " +
                 std::to_string(span) + "\n";
  return CUDA_SUCCESS;
}

CUresult fake_cuGetErrorString(CUresult, const char** text) {
  *text = "fake driver error";
  return CUDA_SUCCESS;
}

const std::map<std::string, void*>& table() {
  static const std::map<std::string, void*> t = {
#define FAKE(name) {#name, reinterpret_cast<void*>(&fake_##name)},
      FAKE(cuInit) FAKE(cuDriverGetVersion) FAKE(cuDeviceGetCount) FAKE(cuDeviceGet) FAKE(cuDeviceGetAttribute)
      FAKE(cuDeviceGetName) FAKE(cuDevicePrimaryCtxRetain) FAKE(cuDevicePrimaryCtxRelease) FAKE(cuCtxSetCurrent)
      FAKE(cuMemGetInfo) FAKE(cuModuleLoadData) FAKE(cuModuleUnload) FAKE(cuModuleGetFunction)
      FAKE(cuFuncSetAttribute) FAKE(cuMemAlloc) FAKE(cuMemFree) FAKE(cuMemcpyHtoDAsync) FAKE(cuMemcpyDtoHAsync)
      FAKE(cuMemcpyDtoDAsync) FAKE(cuMemsetD8Async) FAKE(cuLaunchKernel) FAKE(cuStreamCreate) FAKE(cuStreamDestroy) FAKE(cuStreamSynchronize)
      FAKE(cuStreamBeginCapture) FAKE(cuStreamEndCapture) FAKE(cuGraphInstantiateWithFlags) FAKE(cuGraphLaunch)
      FAKE(cuGraphDestroy) FAKE(cuGraphExecDestroy) FAKE(cuEventCreate) FAKE(cuEventDestroy) FAKE(cuEventRecord)
      FAKE(cuEventSynchronize) FAKE(cuEventElapsedTime) FAKE(cuGetErrorName) FAKE(cuGetErrorString)
      FAKE(cuLaunchCooperativeKernel) FAKE(cuOccupancyMaxActiveBlocksPerMultiprocessor) FAKE(cuTensorMapEncodeTiled)
#undef FAKE
  };
  return t;
}

}  // namespace

extern "C" {

// The real driver's entry point (CUDA 12+), by its versioned name.
__attribute__((visibility("default"))) CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int, cuuint64_t,
                                                                    CUdriverProcAddressQueryResult* status) {
  auto it = table().find(symbol);
  if (it == table().end() || env_is("FAKE_CUDA_MISSING", symbol)) {
    *pfn = nullptr;
    if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
  }
  *pfn = it->second;
  if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
  return CUDA_SUCCESS;
}

// For the tests: everything the fake was asked to do, one line per event.
__attribute__((visibility("default"))) const char* fake_cuda_log() { return state().log.c_str(); }
__attribute__((visibility("default"))) void fake_cuda_clear_log() { state().log.clear(); }

}  // extern "C"
