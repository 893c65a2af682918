#!/usr/bin/env bash
# The memory-budget sweep of docs/memory.md: `--checkpoint auto --memory-limit L` for 8 limits
# from the smallest the trainer's dry run accepts (some segmentation's predicted peak plus the
# estimate's error margin fits) to the smallest at which it chooses the plain step, each run for a
# few steps, plus the fixed segmentations (none, stages, blocks) without a limit; then the chart
# of measured peak against img/s with the predicted peak beside each point.
#
#   bench/budget_sweep.sh [OUT_STEM] [RUN_DIR]
#       (defaults docs/results/budget-sweep and runs/budget-sweep)
#
# Batch 128, width 32, 20 optimizer steps, no evaluation, each run 3 times in turn; the real
# subset at ../shared/data/cifar10-subset when present, else the built-in synthetic data
# (DATA_DIR overrides, POINTS the number of limits, STEPS the steps per run, ROUNDS the runs per
# point). Writes OUT_STEM.csv, .png and .svg and prints a markdown table: per point the highest
# measured peak of its runs, and img/s of the fastest step after the first of them all (a step can
# only be slowed by other work on the machine); exits 1 if a run fails or an auto run's measured
# peak exceeds its limit.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
stem=${1:-$repo/docs/results/budget-sweep}
out=${2:-$repo/runs/budget-sweep}
points=${POINTS:-8}
steps=${STEPS:-20}
rounds=${ROUNDS:-3}
for v in "POINTS=$points" "STEPS=$steps" "ROUNDS=$rounds"; do
  [[ ${v#*=} =~ ^[1-9][0-9]{0,5}$ ]] || {
    echo "error: ${v%%=*} must be a positive whole number, got '${v#*=}'" >&2
    exit 2
  }
done
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

mapfile -t limits < <("$bin/budget_sweep" limits --points "$points" --trainer "$bin/train_cifar10" -- "${flags[@]}")
names=()
for l in "${limits[@]}"; do names+=("limit-$l"); done
names+=(none stages blocks)
# Rounds in turn, so that a burst of other work on the machine slows one run of a point, not all.
for r in $(seq 1 "$rounds"); do
  for n in "${names[@]}"; do
    case $n in
      limit-*) run "$n-r$r" --checkpoint auto --memory-limit "${n#limit-}" ;;
      *) run "$n-r$r" --checkpoint "$n" ;;
    esac
  done
done
chart=()
for n in "${names[@]}"; do
  dirs=$(for r in $(seq 1 "$rounds"); do printf '%s,' "$out/$n-r$r"; done)
  case $n in
    limit-*) chart+=(--point "${dirs%,}") ;;
    *) chart+=(--named "${dirs%,}") ;;
  esac
done
"$bin/budget_sweep" chart --out "$stem" \
  --title="--checkpoint auto --memory-limit sweep (batch 128, width 32, $what, CPU)" \
  "${chart[@]}"
