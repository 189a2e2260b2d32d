#!/usr/bin/env bash
# Every GPU test and benchmark the project has, in one command, for a session
# that is lent a GPU (the device tool): under 10 minutes, a short table at the end.
#
# Today the project has no code that launches on a GPU: the runtime that loads
# a CUBIN with the driver API and launches a phase is issue #5. What this
# script checks on the GPU machine so far: the device, and that the generated
# example compiles there with that machine's nvcc for its own architecture.
# Carry the build folder (`run` with carry: ["build"]).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rows=()
device=$(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -1)
rows+=("device|${device:-no GPU visible}")
arch=sm_$(echo "${device##*, }" | tr -d '.')
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [ -x "$build/generator/cudagen" ] && [ -x "$nvcc" ]; then
  tmp=$(mktemp -d)
  "$build/generator/cudagen" compile examples/mlp_forward.json -o "$tmp/mlp.cu" 2>/dev/null
  if "$nvcc" -c -arch="$arch" "$tmp/mlp.cu" -o "$tmp/mlp.o" 2>"$tmp/log"; then
    rows+=("nvcc -c examples/mlp_forward.json for $arch|ok")
  else
    rows+=("nvcc -c examples/mlp_forward.json for $arch|FAILED: $(head -c 300 "$tmp/log")")
  fi
else
  rows+=("nvcc -c of the example|skipped: no $build/generator/cudagen or nvcc")
fi
rows+=("GPU tests and benchmarks|none yet: launching on a GPU comes with issue #5")
printf '%-45s %s\n' "check" "result"
for r in "${rows[@]}"; do printf '%-45s %s\n' "${r%%|*}" "${r#*|}"; done
