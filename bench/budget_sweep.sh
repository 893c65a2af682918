#!/usr/bin/env bash
# The memory-budget sweep of docs/memory.md: `--checkpoint auto --memory-limit L` for 8 limits
# from the smallest the trainer's dry run accepts (some segmentation's predicted peak plus the
# estimate's error margin fits) to the smallest at which it chooses the plain step, each run for a
# few steps, plus the fixed segmentations (none, stages, blocks) without a limit; then the chart
# of measured peak against img/s with the predicted peak beside each point.
#
#   bench/budget_sweep.sh [OUT_STEM] [RUN_DIR]
#       (defaults docs/results/budget-sweep and runs/budget-sweep)
#   CODES=1 bench/budget_sweep.sh [OUT_STEM] [RUN_DIR]
#       (defaults docs/results/budget-sweep-codes and runs/budget-sweep-codes)
#
# With CODES=1 the runs choose the codes too (`--compress-activations auto`): the limits start at
# the lossy floor, the fixed plans are the plain step and each code without checkpointing, every
# auto run trains inside a memory cgroup of its limit (cgroup v1, memory.limit_in_bytes and, where
# the kernel has it, memory.memsw.limit_in_bytes; needs root), its readings written to the run's
# cgroup.json, and the table gives each code's accuracy cost from
# docs/results/activation-codes-accuracy.json.
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
codes=${CODES:-0}
[[ $codes =~ ^[01]$ ]] || { echo "error: CODES must be 0 or 1, got '$codes'" >&2; exit 2; }
suffix=$([ "$codes" = 1 ] && echo -codes || true)
stem=${1:-$repo/docs/results/budget-sweep$suffix}
out=${2:-$repo/runs/budget-sweep$suffix}
cgroot=/sys/fs/cgroup/memory
if [ "$codes" = 1 ] && ! [ -w "$cgroot" ]; then
  echo "error: CODES=1 runs each point in a memory cgroup: $cgroot must be writable (cgroup v1, root)" >&2
  exit 2
fi
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

# Runs "$@" inside a new memory cgroup of LIMIT bytes and writes what it charged to JSON_OUT.
in_cgroup() { # LIMIT JSON_OUT command...
  local limit=$1 json=$2 cg
  shift 2
  cg=$cgroot/memtrain-budget-$$-$RANDOM
  mkdir "$cg"
  echo "$limit" > "$cg/memory.limit_in_bytes"
  [ -e "$cg/memory.memsw.limit_in_bytes" ] && echo "$limit" > "$cg/memory.memsw.limit_in_bytes"
  local rc=0
  sh -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' sh "$cg" "$@" || rc=$?
  local kills
  kills=$(awk '/^oom_kill /{print $2}' "$cg/memory.oom_control")
  printf '{"limit_bytes": %s, "max_usage_bytes": %s, "oom_kills": %s}\n' \
    "$(cat "$cg/memory.limit_in_bytes")" "$(cat "$cg/memory.max_usage_in_bytes")" "${kills:-0}" > "$json"
  rmdir "$cg"
  return $rc
}

run() { # name, extra flags...
  local name=$1 dir=$out/$1
  shift
  rm -rf "$dir"
  echo "== $name: ${flags[*]} $*" >&2
  local cmd=("$bin/train_cifar10" "${flags[@]}" "$@" --max-steps "$steps" --no-eval --quiet --out "$dir")
  local ok=0
  if [ "$codes" = 1 ] && [[ $name == limit-* ]]; then
    local limit=${name#limit-}
    in_cgroup "${limit%-r*}" "$out/$name.cgroup.json" "${cmd[@]}" > "$dir.log" 2>&1 || ok=$?
    # The run directory exists only once the trainer has started it.
    [ -d "$dir" ] && mv "$out/$name.cgroup.json" "$dir/cgroup.json"
  else
    "${cmd[@]}" > "$dir.log" 2>&1 || ok=$?
  fi
  if [ "$ok" != 0 ]; then
    echo "error: $name failed; see $dir.log" >&2
    exit 1
  fi
  grep -- '--checkpoint auto' "$dir.log" >&2 || true
}

codes_flag=()
auto=(--checkpoint auto)
named=(none stages blocks)
if [ "$codes" = 1 ]; then
  codes_flag=(--codes)
  auto+=(--compress-activations auto)
  named=(none int8 int4 int2)
fi
mapfile -t limits < <("$bin/budget_sweep" limits "${codes_flag[@]}" --points "$points" --trainer "$bin/train_cifar10" -- "${flags[@]}")
names=()
for l in "${limits[@]}"; do names+=("limit-$l"); done
names+=("${named[@]}")
# Rounds in turn, so that a burst of other work on the machine slows one run of a point, not all.
for r in $(seq 1 "$rounds"); do
  for n in "${names[@]}"; do
    case $n in
      limit-*) run "$n-r$r" "${auto[@]}" --memory-limit "${n#limit-}" ;;
      none | stages | blocks) run "$n-r$r" --checkpoint "$n" ;;
      *) run "$n-r$r" --compress-activations "$n" ;;
    esac
  done
done
title="--checkpoint auto --memory-limit sweep (batch 128, width 32, $what, CPU)"
[ "$codes" = 1 ] && title="${auto[*]} (batch 128, width 32, ${what#real }, CPU)"
chart=()
for n in "${names[@]}"; do
  dirs=$(for r in $(seq 1 "$rounds"); do printf '%s,' "$out/$n-r$r"; done)
  case $n in
    limit-*) chart+=(--point "${dirs%,}") ;;
    *) chart+=(--named "${dirs%,}") ;;
  esac
done
"$bin/budget_sweep" chart --out "$stem" \
  --title="$title" \
  ${codes_flag:+--accuracy "$repo/docs/results/activation-codes-accuracy.json"} \
  "${chart[@]}"
