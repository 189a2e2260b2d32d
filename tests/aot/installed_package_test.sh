#!/usr/bin/env bash
# The `cudagen` CMake package, as another project uses it: installed to a
# prefix, consumed from a separate build directory by examples/aot, built for
# the host emulation (run: its numbers must be right) and with nvcc (run: on a
# GPU it must pass; without one it must say so and exit 3), then the prefix
# moved and the moved CLI run in emulation. Last, the mistakes
# cudagen_add_graph must explain.
#
#   installed_package_test.sh BUILD_DIR WORK_DIR NVCC
set -euo pipefail
build_dir=$1 work=$2 nvcc=$3
source_dir=$(cd "$(dirname "$0")/../.." && pwd)
generator=(-G Ninja)
command -v ninja > /dev/null || generator=()

rm -rf "$work" && mkdir -p "$work"
step() { echo "== $*"; }

step "install to a prefix"
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
for f in bin/cudagen bin/cudagen-index lib/libcudagen_emu.a include/cudagen/cudagen_emu.h \
         lib/libcudagen_runtime.a include/cudagen/jit.h \
         lib/cmake/cudagen/cudagenConfig.cmake lib/cmake/cudagen/cudagenFunctions.cmake; do
  [[ -e "$work/prefix/$f" ]] || { echo "FAIL: the install has no $f"; exit 1; }
done

step "examples/aot for the host emulation, from a separate build directory"
cmake "${generator[@]}" -S "$source_dir/examples/aot" -B "$work/aot-emulated" -DCMAKE_PREFIX_PATH="$work/prefix" \
      -DCUDAGEN_AOT_EMULATE=ON > "$work/aot-emulated.log"
cmake --build "$work/aot-emulated" >> "$work/aot-emulated.log"
"$work/aot-emulated/aot_mlp" | tee "$work/aot-emulated.out"
[[ $(grep -c ': ok$' "$work/aot-emulated.out") == 2 ]] || { echo "FAIL: the emulated program did not pass"; exit 1; }

step "examples/aot with nvcc"
cmake "${generator[@]}" -S "$source_dir/examples/aot" -B "$work/aot-nvcc" -DCMAKE_PREFIX_PATH="$work/prefix" \
      -DCMAKE_CUDA_COMPILER="$nvcc" > "$work/aot-nvcc.log"
cmake --build "$work/aot-nvcc" >> "$work/aot-nvcc.log"
set +e
"$work/aot-nvcc/aot_mlp" > "$work/aot-nvcc.out" 2>&1
status=$?
set -e
cat "$work/aot-nvcc.out"
if [[ $status == 3 ]]; then
  grep -q "no usable GPU here" "$work/aot-nvcc.out" || { echo "FAIL: exit 3 without saying why"; exit 1; }
  echo "(no GPU on this machine: the nvcc build was compiled and linked, not run)"
elif [[ $status != 0 || $(grep -c ': ok$' "$work/aot-nvcc.out") != 2 ]]; then
  echo "FAIL: the nvcc build exited $status"; exit 1
fi

step "examples/jit (the JIT API) against the installed runtime, run in the emulation"
cmake "${generator[@]}" -S "$source_dir/examples/jit" -B "$work/jit" -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/jit.log"
cmake --build "$work/jit" >> "$work/jit.log"
CUDAGEN_ROOT="$work/prefix" CUDAGEN_CUDA_DRIVER="$work/no-libcuda.so.1" "$work/jit/jit_mlp" > "$work/jit.out" 2>&1 \
  || { cat "$work/jit.out"; echo "FAIL: the JIT example built against the install did not run"; exit 1; }
cat "$work/jit.out"
grep -q "ran on host emulation" "$work/jit.out" || { echo "FAIL: the JIT example did not run in the emulation"; exit 1; }

step "the prefix moved: the CLI finds its emulator beside itself"
mv "$work/prefix" "$work/moved"
"$work/moved/bin/cudagen" run --emulate --no-cache --work-dir "$work/run" "$source_dir/examples/mlp_forward.json" \
  > "$work/moved.out" 2>&1 || { cat "$work/moved.out"; echo "FAIL: the moved CLI could not run in emulation"; exit 1; }
grep -q "probs.out .* ok" "$work/moved.out" || { cat "$work/moved.out"; echo "FAIL: no checked output"; exit 1; }

step "mistakes are explained at configure time"
expect_configure_error() {  # NAME EXPECTED-TEXT CMAKE-ARGS...
  local name=$1 expected=$2
  shift 2
  if cmake "${generator[@]}" -S "$source_dir/tests/aot/not_cuda_project" -B "$work/$name" \
           -DCMAKE_PREFIX_PATH="$work/moved" -DGRAPH="$source_dir/examples/mlp_forward.json" "$@" \
           > "$work/$name.log" 2>&1; then
    echo "FAIL: $name configured"; exit 1
  fi
  # CMake folds a message's lines: unfold them before looking.
  tr -s ' \n' ' ' < "$work/$name.log" | grep -qF "$expected" \
    || { cat "$work/$name.log"; echo "FAIL: $name: no '$expected'"; exit 1; }
  echo "$name: explained ('$expected')"
}
expect_configure_error no_cuda "CUDA is not enabled in this project"
expect_configure_error unknown_argument "unknown arguments 'SPEED'" -DEXTRA=SPEED
expect_configure_error missing_graph "no graph file" -DGRAPH="$work/nothing.json"
expect_configure_error same_name "already has a graph named 'mlp_forward'" -DTWICE=ON
echo "PASS"
