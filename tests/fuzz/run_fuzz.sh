#!/usr/bin/env bash
# Runs one target of the libFuzzer binary for a bounded time:
#   run_fuzz.sh FUZZER TARGET SECONDS [--keep DIR] SEED_DIR...
# New inputs go to a scratch corpus (or DIR, emptied first, with --keep), so
# the seed corpus in the repository is never modified. Fails on any crash,
# leak, timeout, broken property or sanitizer report (libFuzzer exits non-zero
# then), printing the input that did it.
set -euo pipefail
fuzzer=$1; target=$2; seconds=$3; shift 3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
corpus=$work/corpus
if [[ ${1:-} == --keep ]]; then
  corpus=$2; shift 2
  rm -rf "$corpus"
fi
mkdir -p "$corpus" "$work/artifacts"
echo "fuzzing $target for ${seconds}s from seeds: $*"
if ! CUDAGEN_FUZZ_TARGET=$target "$fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
     -max_len=65536 -artifact_prefix="$work/artifacts/" -print_final_stats=1 "$corpus" "$@" 2>"$work/log"; then
  tail -n 60 "$work/log"
  for f in "$work"/artifacts/*; do
    [ -f "$f" ] && { echo "--- the input ($f):"; head -c 2000 "$f" | od -c | head -40; }
  done
  echo "FAIL: the fuzzer found a crash, a broken property or a sanitizer report in target $target"
  exit 1
fi
grep -E '^stat::number_of_executed_units|^Done' "$work/log" || true
echo "PASS: $target, no crash in ${seconds}s"
