#!/usr/bin/env bash
# The README's test command, N times (default 5), with two CPU hogs (`yes > /dev/null`) running
# beside it: a test must pass on a busy machine, not only on an idle one. Prints one line per run.
#
#   bench/suite_under_load.sh [N]
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
cargo test --release --no-run > /dev/null 2>&1 || { echo "build failed" >&2; exit 1; }
yes > /dev/null & h1=$!
yes > /dev/null & h2=$!
trap 'kill $h1 $h2 2>/dev/null' EXIT
log=$(mktemp)
failed=0
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  cargo test --release --no-fail-fast > "$log" 2>&1
  rc=$?
  [ $rc = 0 ] || failed=1
  echo "run $i: rc=$rc $(( $(date +%s) - start ))s, $(grep -c '^test result: ok' "$log") test binaries ok, $(grep -c 'FAILED' "$log") FAILED lines"
  [ $rc = 0 ] || grep -E 'FAILED|panicked at' "$log" | head -5
done
rm -f "$log"
exit $failed
