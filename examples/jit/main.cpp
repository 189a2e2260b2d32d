// JIT compilation inside a C++ program: examples/mlp_forward.json compiled
// when the program starts (NVRTC through the disk cache on a GPU, the host
// emulation elsewhere), run on random inputs; each row of the softmax output
// must sum to one.
//
//   jit_mlp [GRAPH]     (default: the bundled examples/mlp_forward.json)
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>

#include "jit.h"

int main(int argc, char** argv) {
  const std::string graph = argc > 1 ? argv[1] : CUDAGEN_EXAMPLE_GRAPH;
  try {
    cudagen::JitOptions options;  // Backend::automatic: the GPU where there is one
    options.progress = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
    cudagen::JitProgram program = cudagen::JitProgram::from_file(graph, options);
    cudagen::Instance mlp = program.instantiate();

    int64_t seed = 1;
    for (const char* input : {"fc1.a", "fc1.b", "bias1.b", "fc2.b", "bias2.b"}) mlp.randomize(input, seed++, -0.5, 0.5);
    mlp.run(cudagen::Phase::forward);

    cudagen::HostTensor probs = mlp.read("probs.out");
    const std::vector<double> p = probs.values();
    const int64_t rows = probs.shape[0], cols = probs.shape[1];
    double worst = 0;
    for (int64_t r = 0; r < rows; ++r) {
      double sum = 0;
      for (int64_t c = 0; c < cols; ++c) sum += p[size_t(r * cols + c)];
      worst = std::fmax(worst, std::fabs(sum - 1));
    }
    std::printf("%s: ran on %s; probs.out is %lldx%lld, first row %.4f %.4f %.4f ...; worst |row sum - 1| = %.2e\n",
                graph.c_str(), mlp.where().c_str(), (long long)rows, (long long)cols, p[0], p[1], p[2], worst);
    return worst < 1e-5 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
