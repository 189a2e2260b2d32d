// Ahead of time: two graphs compiled into this program at build time by
// cudagen_add_graph (CMakeLists.txt), called through the headers it writes.
//
//   mlp   (examples/mlp_forward.json): one forward pass, checked against the
//         same MLP written out below in plain C++;
//   train (examples/train_mlp.json):   init, then training steps with Adam;
//         the loss must fall.
//
// Built with nvcc the arena is device memory; built with EMULATE (the CMake
// option CUDAGEN_AOT_EMULATE) it is host memory and the kernels run on the
// CPU under cudagen's emulation. The code differs only in the four functions
// of `Arena` below. Exit status: 0 ok, 1 wrong numbers or a failed launch,
// 3 no usable GPU (the nvcc build on a machine without one).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifndef CUDAGEN_AOT_EMULATED
#include <cuda_runtime.h>
#endif

#include "mlp.h"
#include "train.h"

namespace {

#ifdef CUDAGEN_AOT_EMULATED
extern "C" const char* cudagen_emu_last_error();  // the emulator's message after a failed launch

struct Arena {
  unsigned char* base = nullptr;
  explicit Arena(unsigned long long bytes) {
    base = static_cast<unsigned char*>(std::aligned_alloc(256, (bytes + 255) / 256 * 256));
  }
  ~Arena() { std::free(base); }
  void write(unsigned long long offset, const void* data, size_t bytes) { std::memcpy(base + offset, data, bytes); }
  void read(unsigned long long offset, void* data, size_t bytes) const { std::memcpy(data, base + offset, bytes); }
  static void check_launch(int status, const char* what) {
    if (status == 0) return;
    std::fprintf(stderr, "%s failed in emulation: %s\n", what, cudagen_emu_last_error());
    std::exit(1);
  }
  static const char* where() { return "the host emulation"; }
};
#else
void check_cuda(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  const bool no_gpu = status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver;
  std::fprintf(stderr, "%s: %s (%s)%s\n", what, cudaGetErrorString(status), cudaGetErrorName(status),
               no_gpu ? "; no usable GPU here: configure with -DCUDAGEN_AOT_EMULATE=ON to run on the CPU" : "");
  std::exit(no_gpu ? 3 : 1);
}

struct Arena {
  unsigned char* base = nullptr;
  explicit Arena(unsigned long long bytes) { check_cuda(cudaMalloc(&base, bytes), "cudaMalloc of the arena"); }
  ~Arena() { cudaFree(base); }
  void write(unsigned long long offset, const void* data, size_t bytes) {
    check_cuda(cudaMemcpy(base + offset, data, bytes, cudaMemcpyHostToDevice), "copy to the arena");
  }
  void read(unsigned long long offset, void* data, size_t bytes) const {
    check_cuda(cudaMemcpy(data, base + offset, bytes, cudaMemcpyDeviceToHost), "copy from the arena");
  }
  static void check_launch(int status, const char* what) {
    check_cuda(static_cast<cudaError_t>(status), what);
    check_cuda(cudaDeviceSynchronize(), what);
  }
  static const char* where() { return "the GPU"; }
};
#endif

// Deterministic inputs in [low, high).
std::vector<float> pseudo_random(size_t n, unsigned seed, float low, float high) {
  std::vector<float> v(n);
  unsigned long long state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& x : v) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    x = low + (high - low) * float((state >> 40) & 0xFFFFFF) / float(1 << 24);
  }
  return v;
}

size_t numel(const cudagen_host_tensor& t) {
  size_t n = 1;
  for (int d = 0; d < t.rank; ++d) n *= size_t(t.shape[d]);
  return n;
}

// The forward graph, and the same MLP in plain C++ (double accumulation).
bool run_mlp() {
  const cudagen_host_tensor& x = mlp_tensors[mlp_fc1_a];
  const cudagen_host_tensor& w1 = mlp_tensors[mlp_fc1_b];
  const cudagen_host_tensor& b1 = mlp_tensors[mlp_bias1_b];
  const cudagen_host_tensor& w2 = mlp_tensors[mlp_fc2_b];
  const cudagen_host_tensor& b2 = mlp_tensors[mlp_bias2_b];
  const cudagen_host_tensor& probs = mlp_tensors[mlp_probs_out];
  const size_t rows = size_t(x.shape[0]), in = size_t(x.shape[1]), hidden = size_t(w1.shape[1]),
               out = size_t(w2.shape[1]);

  std::vector<std::vector<float>> values;
  Arena arena(mlp_arena_bytes);
  unsigned seed = 1;
  for (const cudagen_host_tensor* t : {&x, &w1, &b1, &w2, &b2}) {
    values.push_back(pseudo_random(numel(*t), seed++, -0.5f, 0.5f));
    arena.write(t->offset, values.back().data(), t->bytes);
  }
  Arena::check_launch(mlp_forward(arena.base, nullptr), "mlp_forward");
  std::vector<float> got(numel(probs));
  arena.read(probs.offset, got.data(), probs.bytes);

  const auto &X = values[0], &W1 = values[1], &B1 = values[2], &W2 = values[3], &B2 = values[4];
  double worst = 0;
  for (size_t r = 0; r < rows; ++r) {
    std::vector<double> h(hidden), logits(out);
    for (size_t j = 0; j < hidden; ++j) {
      double s = B1[j];
      for (size_t k = 0; k < in; ++k) s += double(X[r * in + k]) * W1[k * hidden + j];
      h[j] = s > 0 ? s : 0;
    }
    double top = -1e300, total = 0;
    for (size_t j = 0; j < out; ++j) {
      logits[j] = B2[j];
      for (size_t k = 0; k < hidden; ++k) logits[j] += h[k] * W2[k * out + j];
      top = std::fmax(top, logits[j]);
    }
    for (size_t j = 0; j < out; ++j) total += std::exp(logits[j] - top);
    for (size_t j = 0; j < out; ++j) worst = std::fmax(worst, std::fabs(got[r * out + j] - std::exp(logits[j] - top) / total));
  }
  const bool ok = worst < 1e-5;
  std::printf("mlp:   forward on %s, probs %zux%zu, largest difference from the C++ reference %.2e (bound 1e-5): %s\n",
              Arena::where(), rows, out, worst, ok ? "ok" : "WRONG");
  return ok;
}

// Writes a run-time argument as the header says: a float in the first 4 of its 8 bytes, an int as 64 bits.
void write_scalar(Arena& arena, const cudagen_host_scalar& s, double value) {
  unsigned char bytes[8] = {};
  if (std::string(s.type) == "float") {
    float f = float(value);
    std::memcpy(bytes, &f, sizeof f);
  } else {
    long long i = (long long)value;
    std::memcpy(bytes, &i, sizeof i);
  }
  arena.write(s.offset, bytes, sizeof bytes);
}

// The training graph: labels a function of the inputs that a small MLP can learn.
bool run_training(int steps) {
  const cudagen_host_tensor& x = train_tensors[train_fc1_a];
  const cudagen_host_tensor& labels = train_tensors[train_loss_labels];
  const cudagen_host_tensor& loss = train_tensors[train_loss_loss];
  const size_t rows = size_t(x.shape[0]), features = size_t(x.shape[1]);

  Arena arena(train_arena_bytes);
  std::vector<float> inputs = pseudo_random(numel(x), 7, -1, 1);
  std::vector<int> classes(rows);
  for (size_t r = 0; r < rows; ++r) classes[r] = (inputs[r * features] > 0) + 2 * (inputs[r * features + 1] > 0);
  arena.write(x.offset, inputs.data(), x.bytes);
  arena.write(labels.offset, classes.data(), labels.bytes);
  for (int i = 0; i < train_scalar_count; ++i) write_scalar(arena, train_scalars[i], train_scalars[i].initial);

  Arena::check_launch(train_init(arena.base, nullptr), "train_init");
  float first = 0, last = 0;
  for (int step = 1; step <= steps; ++step) {
    write_scalar(arena, train_scalars[train_w1_adam_step], step);
    Arena::check_launch(train_step(arena.base, nullptr), "train_step");
    arena.read(loss.offset, &last, sizeof last);
    if (step == 1) first = last;
  }
  const bool ok = std::isfinite(last) && last < 0.5f * first;
  std::printf("train: %d Adam steps on %s, loss %.4f -> %.4f (must at least halve): %s\n", steps, Arena::where(),
              first, last, ok ? "ok" : "WRONG");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 60;
  const bool mlp_ok = run_mlp();
  const bool train_ok = run_training(steps);
  return mlp_ok && train_ok ? 0 : 1;
}
