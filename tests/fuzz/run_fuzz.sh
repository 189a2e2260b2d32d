#!/usr/bin/env bash
# Runs a libFuzzer target for a bounded time. New inputs go to a scratch
# corpus, so the seed corpus in the repository is never modified. Fails on any
# crash, leak, timeout or sanitizer report (libFuzzer exits non-zero then).
set -euo pipefail
fuzzer=$1; seconds=$2; shift 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus" "$work/artifacts"
echo "fuzzing $(basename "$fuzzer") for ${seconds}s from seeds: $*"
if ! "$fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -max_len=65536 \
     -artifact_prefix="$work/artifacts/" -print_final_stats=1 "$work/corpus" "$@" 2>"$work/log"; then
  tail -n 60 "$work/log"
  for f in "$work"/artifacts/*; do
    [ -f "$f" ] && { echo "--- crashing input ($f):"; head -c 2000 "$f" | od -c | head -40; }
  done
  echo "FAIL: the fuzzer found a crash or a sanitizer report"
  exit 1
fi
grep -E '^stat::number_of_executed_units|^Done' "$work/log" || true
echo "PASS: no crash in ${seconds}s"
