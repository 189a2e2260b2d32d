#!/usr/bin/env bash
# Builds bench/gemm/gemm_bench with nvcc for sm_90 (and sm_80 machine code,
# so that ptxas checks both), and prints its kernels' ptxas resources; and
# bench/gemm/hopper_bench (the wgmma mainloop) for sm_90a.
#   bench/gemm/build.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-build/gemm-bench}
mkdir -p "$out"
"${NVCC:-/usr/local/cuda/bin/nvcc}" -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_80,code=sm_80 \
  -Xptxas -v -o "$out/gemm_bench" bench/gemm/gemm_bench.cu -lcublas 2> "$out/ptxas.log"
grep -E "Compiling entry|registers|spill|stack" "$out/ptxas.log" | grep -B1 -A1 gemm_kernel | head -80 || true
"${NVCC:-/usr/local/cuda/bin/nvcc}" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
  -Xptxas -v -o "$out/hopper_bench" bench/gemm/hopper_bench.cu -lcublas 2> "$out/hopper_ptxas.log"
grep -E "Compiling entry|registers|spill|stack|Performance Loss" "$out/hopper_ptxas.log" | head -20 || true
