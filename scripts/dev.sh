#!/usr/bin/env bash
# cudagen's two set-up commands (see README.md):
#   scripts/dev.sh example   install what is missing, build, run the main job on the bundled example
#   scripts/dev.sh test      install what is missing, build every part, run the whole test suite
# Environment: BUILD_DIR (default: build), CUDAToolkit_ROOT (default: /usr/local/cuda).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
CUDA_ROOT=${CUDAToolkit_ROOT:-/usr/local/cuda}
PACKAGES=(cmake ninja-build g++ python3 python3-venv bc nlohmann-json3-dev python3-numpy python3-torch python3-torchvision
          clang-19 libclang-rt-19-dev libclang-19-dev libclang-cpp19-dev llvm-19-dev
          libfmt-dev libcli11-dev libgtest-dev libbenchmark-dev libboost-context-dev libxxhash-dev)

install_missing() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "== installing: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    # libclang-rt-19-dev is named explicitly: it is only a recommended package of clang-19.
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # cuobjdump and the nvdisasm it runs (the SASS checks): the toolkit here has neither, PyPI's wheels have.
  if ! ls .cache/tools-venv/lib/python3*/site-packages/nvidia/cu*/bin/nvdisasm > /dev/null 2>&1; then
    echo "== installing cuobjdump and nvdisasm (pip: nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm) into .cache/tools-venv"
    python3 -m venv .cache/tools-venv
    .cache/tools-venv/bin/pip install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
  fi
  # CuTe's headers (the nvidia-cutlass wheel): the tests' oracle for the Hopper mainloop's layouts.
  if ! ls .cache/tools-venv/lib/python3*/site-packages/cutlass_library/source/include/cute/tensor.hpp > /dev/null 2>&1; then
    echo "== installing CuTe's headers (pip: nvidia-cutlass) into .cache/tools-venv"
    [ -x .cache/tools-venv/bin/pip ] || python3 -m venv .cache/tools-venv
    .cache/tools-venv/bin/pip install -q --no-deps nvidia-cutlass==4.2.0.0  # the CuTe the oracle is written against
  fi
  # A pinned PyTorch 2.x from PyPI (tests only; cmake/Parts.cmake's TORCH2), with torchvision and transformers:
  # f16 training against torch.autocast and GradScaler, which Debian's 1.13 lacks on the CPU, the frontend on
  # torch.export, and the model list (bench/model_zoo.py). PyPI's Linux wheel brings CUDA's libraries (about
  # 3 GB to fetch); the tests run it on the CPU.
  local torch2=(torch==2.6.0 torchvision==0.21.0 transformers==4.47.1 numpy==2.4.6)
  local have_all=1
  for pin in "${torch2[@]}"; do
    ls .cache/torch2-venv/lib/python3*/site-packages/"${pin%%==*}-${pin##*==}.dist-info" > /dev/null 2>&1 || have_all=0
  done
  if [ $have_all -eq 0 ]; then
    echo "== installing ${torch2[*]} (pip, about 3 GB) into .cache/torch2-venv"
    [ -x .cache/torch2-venv/bin/pip ] || python3 -m venv .cache/torch2-venv
    .cache/torch2-venv/bin/pip install -q --progress-bar off "${torch2[@]}"
  fi
  # transformers beside Debian's PyTorch 1.13 (a virtual environment that sees the system's packages):
  # the model list's GPT-2, BERT, LLaMA and T5 encoder on the torch.fx path.
  if ! ls .cache/torch1-venv/lib/python3*/site-packages/transformers-4.47.1.dist-info > /dev/null 2>&1; then
    echo "== installing transformers 4.47.1 (pip) into .cache/torch1-venv, beside Debian's PyTorch 1.13"
    [ -x .cache/torch1-venv/bin/pip ] || /usr/bin/python3 -m venv --system-site-packages .cache/torch1-venv
    .cache/torch1-venv/bin/pip install -q --progress-bar off transformers==4.47.1
  fi
  if [ ! -x "$CUDA_ROOT/bin/nvcc" ]; then
    echo "error: no CUDA toolkit at $CUDA_ROOT (nvcc, NVRTC); install it there or set CUDAToolkit_ROOT" >&2
    exit 1
  fi
}

configure_and_build() {
  echo "== configuring ($BUILD_DIR)"
  # CUDAGEN_REQUIRE_ALL: a part that cannot be built fails the configure instead of being skipped.
  mkdir -p "$BUILD_DIR"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCUDAGEN_REQUIRE_ALL=ON -DCUDAToolkit_ROOT="$CUDA_ROOT" >"$BUILD_DIR/configure.log" 2>&1 ||
    { cat "$BUILD_DIR/configure.log"; exit 1; }
  grep -A10 "cudagen parts:" "$BUILD_DIR/configure.log" | sed 's/^-- //'
  echo "== building"
  cmake --build "$BUILD_DIR"
}

case "${1:-}" in
  example)
    install_missing
    configure_and_build
    scripts/main_job.sh "$BUILD_DIR/generator/cudagen" "$CUDA_ROOT/bin/nvcc" examples/mlp_forward.json "$BUILD_DIR/example"
    ;;
  test)
    install_missing
    configure_and_build
    echo "== running the test suite"
    ctest --test-dir "$BUILD_DIR" --output-on-failure -j2
    ;;
  *)
    echo "usage: scripts/dev.sh example|test" >&2
    exit 2
    ;;
esac
