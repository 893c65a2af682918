#!/usr/bin/env bash
# The memory-budget sweep of docs/memory.md: `--checkpoint auto --memory-limit L` for 8 limits
# from the smallest that any segmentation fits (its predicted peak plus the estimate's 5% error
# margin) to the one the plain step fits, each run for a few steps, plus the named schedules
# (none, stages, blocks) without a limit; then the chart of measured peak against img/s with the
# predicted peak beside each point.
#
#   bench/budget_sweep.sh [OUT_STEM] [RUN_DIR]
#       (defaults docs/results/budget-sweep and runs/budget-sweep)
#
# Batch 128, width 32, 30 optimizer steps, no evaluation; the real subset at
# ../shared/data/cifar10-subset when present, else the built-in synthetic data (DATA_DIR
# overrides, POINTS the number of limits, STEPS the steps per run). Writes OUT_STEM.csv, .png and
# .svg and prints a markdown table (img/s: each run's fastest step after the first, the reading
# least disturbed by other work on the machine); exits 1 if a run fails or an auto run's measured
# peak exceeds its limit.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
stem=${1:-$repo/docs/results/budget-sweep}
out=${2:-$repo/runs/budget-sweep}
points=${POINTS:-8}
steps=${STEPS:-30}
cd "$repo"
data=${DATA_DIR-}
if [ -z "$data" ] && [ -d "$repo/../shared/data/cifar10-subset" ]; then
  data=$repo/../shared/data/cifar10-subset
fi
flags=(--batch-size 128 --width 32 --device cpu)
what="synthetic data"
if [ -n "$data" ]; then
  flags+=(--data-dir "$data")
  what="real CIFAR-10 subset"
fi
cargo build --release --example train_cifar10 --example budget_sweep >&2
bin=$repo/target/release/examples
mkdir -p "$out" "$(dirname "$stem")"

run() { # name, extra flags...
  local name=$1 dir=$out/$1
  shift
  rm -rf "$dir"
  echo "== $name: ${flags[*]} $*" >&2
  if ! "$bin/train_cifar10" "${flags[@]}" "$@" --max-steps "$steps" --no-eval --quiet \
    --out "$dir" > "$dir.log" 2>&1; then
    echo "error: $name failed; see $dir.log" >&2
    exit 1
  fi
  grep -- '--checkpoint auto:' "$dir.log" >&2 || true
}

mapfile -t limits < <("$bin/budget_sweep" limits --points "$points" -- "${flags[@]}")
chart=()
for l in "${limits[@]}"; do
  run "limit-$l" --checkpoint auto --memory-limit "$l"
  chart+=(--point "$out/limit-$l")
done
for c in none stages blocks; do
  run "$c" --checkpoint "$c"
  chart+=(--named "$out/$c")
done
"$bin/budget_sweep" chart --out "$stem" \
  --title="--checkpoint auto --memory-limit sweep (batch 128, width 32, $what, CPU)" \
  "${chart[@]}"
