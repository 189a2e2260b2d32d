#!/usr/bin/env bash
# Compile time and planning time at scale, on this machine, in one run. Each
# row times one cudagen command on a large input (bench/scale_inputs.py) and
# the baseline beside it: `cudagen format` of the same graph (read and write
# it, nothing else), or `plan --no-reuse` of the same buffer list (read,
# place one after another, verify). The ratio against the baseline staying
# flat as the size grows is what near-linear means here.
#   bench/scale.sh [BUILD_DIR]
set -euo pipefail
build=${1:-build}
cudagen=$build/generator/cudagen
[[ -x $cudagen ]] || { echo "error: $cudagen not built (cmake --build $build --target cudagen)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "writing the inputs into $work ..." >&2
python3 "$(dirname "$0")/scale_inputs.py" "$work"

seconds() {  # wall seconds of a command, its output discarded; exit 1 (bad input) allowed
  local s e
  s=$(date +%s.%N)
  "$@" >/dev/null 2>&1 || [[ $? == 1 ]]
  e=$(date +%s.%N)
  echo "$e - $s" | bc
}
row() {  # name, size, seconds, baseline seconds
  printf '%-44s %13s %9.2f %9.2f %7.1f\n' "$1" "$2" "$3" "$4" "$(echo "$3 / $4" | bc -l)"
}
printf '%-44s %13s %9s %9s %7s\n' "cudagen command" "size" "seconds" "baseline" "ratio"
for n in 1000 10000 100000; do
  g=$work/matmul_pairs_$n.json
  row "compile, independent matmul pairs" "$n tasks" "$(seconds "$cudagen" compile "$g" -o "$work/out.cu")" \
    "$(seconds "$cudagen" format "$g")"
done
g=$work/relu_pairs_100000.json
row "compile, independent relu pairs (fused)" "100000 tasks" "$(seconds "$cudagen" compile "$g" -o "$work/out.cu")" \
  "$(seconds "$cudagen" format "$g")"
g=$work/wide_object.json
row "validate, a task of 40,000 argument keys" "40000 keys" "$(seconds "$cudagen" validate "$g")" \
  "$(seconds "$cudagen" format "$g")"
for b in disjoint_1m random_1m; do
  f=$work/$b.csv
  row "plan --buffers, $b" "10^6 buffers" "$(seconds "$cudagen" plan --buffers "$f")" \
    "$(seconds "$cudagen" plan --buffers "$f" --no-reuse)"
done
f=$work/near_bound_1000.csv
row "plan --buffers, greedy within 2%: search" "1000 buffers" "$(seconds "$cudagen" plan --buffers "$f")" \
  "$(seconds "$cudagen" plan --buffers "$f" --method greedy)"
