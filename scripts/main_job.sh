#!/usr/bin/env bash
# The main job on the bundled example: one graph -> one .cu, compiled by all
# three compilers (NVRTC in-process, nvcc ahead of time, the host compiler for
# the emulation), then run in emulation and checked against a float64 reference.
#   scripts/main_job.sh CUDAGEN NVCC [GRAPH] [OUT_DIR]
set -euo pipefail
cudagen=$1
nvcc=$2
graph=${3:-$(dirname "$0")/../examples/mlp_forward.json}
out=${4:-$(mktemp -d)}
mkdir -p "$out"
name=$(basename "$graph" .json)

echo "== cudagen compile $graph"
"$cudagen" compile "$graph" -o "$out/$name.cu" --manifest "$out/$name.manifest.json"
echo "== NVRTC (in-process, sm_90)"
"$cudagen" nvrtc "$out/$name.cu" --arch sm_90 -o "$out/$name.cubin"
echo "== nvcc -c (ahead of time, sm_90)"
start=$(date +%s.%N)
"$nvcc" -c -arch=sm_90 "$out/$name.cu" -o "$out/$name.o"
echo "$out/$name.o: nvcc took $(echo "$(date +%s.%N) - $start" | bc) s"
echo "== cudagen run --emulate"
"$cudagen" run "$graph" --emulate --work-dir "$out/emulated"
echo "== cudagen run --emulate --check-each-task examples/transformer_block.json"
"$cudagen" run "$(dirname "$graph")/transformer_block.json" --emulate --check-each-task --work-dir "$out/emulated"
echo "== cudagen run --emulate examples/mlp_train.json (one training step: init, forward, loss, backward, SGD)"
"$cudagen" run "$(dirname "$graph")/mlp_train.json" --emulate --work-dir "$out/emulated"
