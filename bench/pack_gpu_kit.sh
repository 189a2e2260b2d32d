#!/usr/bin/env bash
# Packs what bench/gpu_check.sh runs on the device machine into gpu-kit/ (a
# few MB; the build tree is far over the device tool's 64 MiB carry limit):
# the installed cudagen, stripped; jit_mlp; bench_megakernel; gemm_bench and hopper_bench (bench/gemm); the numerical tests
# (cudagen_emulation_tests, run there with CUDAGEN_TEST_BACKEND=gpu); examples/aot built with nvcc
# against that install; and libfmt, which the device image lacks.
#
#   bench/pack_gpu_kit.sh [BUILD_DIR]      then: run(carry=["gpu-kit"], "bash bench/gpu_check.sh gpu-kit")
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
kit=gpu-kit
export PATH=/usr/local/cuda/bin:$PATH
generator=(-G Ninja)
command -v ninja > /dev/null || generator=()

cmake --build "$build" --target cudagen cudagen-index jit_mlp cudagen_emulation_tests bench_megakernel > /dev/null
rm -rf "$kit" "$build/gpu-kit-aot"
cmake --install "$build" --prefix "$kit" --strip > /dev/null
strip -o "$kit/bin/jit_mlp" "$build/examples/jit/jit_mlp"
strip -o "$kit/bin/cudagen_emulation_tests" "$build/tests/cudagen_emulation_tests"
strip -o "$kit/bin/bench_megakernel" "$build/bench/bench_megakernel"
cmake "${generator[@]}" -S examples/aot -B "$build/gpu-kit-aot" -DCMAKE_PREFIX_PATH="$PWD/$kit" \
      -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build "$build/gpu-kit-aot" > /dev/null
cp "$build/gpu-kit-aot/aot_mlp" "$kit/bin/aot_mlp"
# The JIT runtime's static libraries (80 MB with debug information) were for
# building aot_mlp against the package here; nothing is built on the device.
rm -f "$kit"/lib/libcudagen_{runtime,generator,model}.a
# The GEMM mainloop's benchmark against cuBLAS (nvcc here; the device has libcublas).
cmake --build "$build" --target gemm_bench > /dev/null
cp "$build/bench/gemm-bench/gemm_bench" "$kit/bin/gemm_bench"
cp "$build/bench/gemm-bench/hopper_bench" "$kit/bin/hopper_bench"
for lib in $(ldd "$kit/bin/cudagen" "$kit/bin/cudagen_emulation_tests" "$kit/bin/bench_megakernel" | awk '/libfmt|libgtest|libboost_context/ {print $3}' | sort -u); do
  cp -L "$lib" "$kit/lib/"
done
echo "gpu-kit/: $(du -sh "$kit" | cut -f1) ($(ls "$kit/bin" | tr '\n' ' '))"
