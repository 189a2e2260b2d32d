#!/usr/bin/env bash
# The generated code of fuzzed graphs must compile, not only be generated:
#   build_fuzzed_sample.sh CUDAGEN FOUND_DIR COUNT [SEED_DIR...]
# From the inputs the compile fuzz target kept (FOUND_DIR), the COUNT largest
# that cudagen compiles, each to a different .cu, are compiled by the host
# compiler with the emulation header (the emulation build's front end;
# -fsyntax-only, which instantiates the templates the file uses). Where fewer
# than COUNT of them compile (a short run under load may keep only inputs
# that fail validation), the seeds' graphs fill the sample.
set -euo pipefail
cudagen=$1; found=$2; count=$3; shift 3
here=$(cd "$(dirname "$0")" && pwd)
emu=$here/../../runtime/emu
cxx=${CXX:-c++}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[[ -d $found ]] || { echo "FAIL: $found does not exist (run the test fuzz.compile first)"; exit 1; }
built=0; tried=0; fuzzed=0
declare -A seen
while IFS= read -r input && (( built < count )); do
  tried=$((tried + 1))
  "$cudagen" compile "$input" -o "$work/g.cu" >/dev/null 2>&1 || continue
  sum=$(sha256sum "$work/g.cu" | cut -d' ' -f1)
  [[ -n ${seen[$sum]:-} ]] && continue
  seen[$sum]=1
  echo "building the code of $(basename "$input") ($(wc -c <"$input") bytes of graph, $(wc -l <"$work/g.cu") lines of .cu)"
  if ! "$cxx" -std=c++17 -O0 -fsyntax-only -fno-strict-aliasing -Wno-unused-parameter -I"$emu" -include cudagen_emu.h \
       -x c++ "$work/g.cu" 2>"$work/log"; then
    head -n 40 "$work/log"
    echo "--- the graph:"; head -c 3000 "$input"; echo
    echo "FAIL: cudagen compiled $input to a .cu that the host compiler rejects"
    exit 1
  fi
  built=$((built + 1))
  [[ $input == "$found"/* ]] && fuzzed=$((fuzzed + 1))
done < <(ls -S "$found"/* 2>/dev/null || true; for seeds in "$@"; do
  find "$seeds" -maxdepth 1 -type f -printf '%s %p\n' | sort -k1,1nr -k2 | cut -d' ' -f2-; done)
(( built > 0 )) || { echo "FAIL: none of the $tried inputs compiled (the seeds alone should)"; exit 1; }
echo "PASS: $built graphs' generated code compiles, $fuzzed of them fuzzed ($tried inputs looked at)"
