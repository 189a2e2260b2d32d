#!/usr/bin/env bash
# Compile time of one generated file by each of its three compilers, in one
# run: NVRTC in-process (sm_90), nvcc -c (sm_90, the baseline), and the host
# compiler building the emulated module. Prints a table; medians of 3.
#   bench/compile_times.sh [BUILD_DIR] [GRAPH]
set -euo pipefail
build=${1:-build}
graph=${2:-examples/mlp_forward.json}
nvcc=${CUDAToolkit_ROOT:-/usr/local/cuda}/bin/nvcc
cudagen=$build/generator/cudagen
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$cudagen" compile "$graph" -o "$work/g.cu" 2>/dev/null

median() { sort -n | sed -n 2p; }
time_of() { local s e; s=$(date +%s.%N); "$@" >/dev/null 2>&1; e=$(date +%s.%N); echo "$e - $s" | bc; }

nvcc_s=$(for i in 1 2 3; do time_of "$nvcc" -c -arch=sm_90 "$work/g.cu" -o "$work/g.o"; done | median)
nvrtc_s=$(for i in 1 2 3; do "$cudagen" nvrtc "$work/g.cu" --arch sm_90 | sed -E 's/.* in ([0-9.]+) s.*/\1/'; done | median)
host_s=$(for i in 1 2 3; do "$cudagen" run "$graph" --emulate --work-dir "$work/emu$i" | sed -nE 's/host compiler \(emulation build\): ([0-9.]+) s.*/\1/p'; done | median)

printf '%-34s %10s %10s\n' "compiler ($(basename "$graph"))" "seconds" "vs nvcc"
printf '%-34s %10.2f %10.2f\n' "nvcc -c -arch=sm_90 (baseline)" "$nvcc_s" 1
printf '%-34s %10.2f %10.2f\n' "NVRTC in-process, sm_90" "$nvrtc_s" "$(echo "$nvrtc_s / $nvcc_s" | bc -l)"
printf '%-34s %10.2f %10.2f\n' "host compiler, emulation build" "$host_s" "$(echo "$host_s / $nvcc_s" | bc -l)"
