#!/usr/bin/env bash
# Proof that a refactor changed nothing: two builds of train_cifar10 train every memory
# optimization with a fixed seed, and their losses (every step, every digit) and final weights and
# optimizer state (the snapshot's safetensors, byte for byte) must be identical.
#
#   bench/same_results.sh BEFORE AFTER
#
# BEFORE and AFTER are train_cifar10 executables, or git revisions (each built in a worktree with
# its own target dir under ${SAME_RESULTS_WORK:-$HOME/.cache/memtrain/same-results}; a first build
# takes ~10 min on 2 cores). Run both on the same machine: gemm's blocking follows the CPU's
# caches, so bits are only comparable between builds run on one machine.
# Exit 0 when every configuration matches, 1 when one differs, 2 on a usage error.
set -euo pipefail
bad() { echo "same_results.sh: $*" >&2; exit 2; }
fail() { echo "same_results.sh: $*" >&2; exit 1; }
[ $# -eq 2 ] || bad "usage: bench/same_results.sh BEFORE AFTER (executables or git revisions)"
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${SAME_RESULTS_WORK:-$HOME/.cache/memtrain/same-results}

# An executable as it is; a revision built in its own worktree.
resolve() {
  if [ -x "$1" ] && [ -f "$1" ]; then
    realpath "$1"
    return
  fi
  local rev
  rev=$(git -C "$repo" rev-parse --verify --quiet "$1^{commit}") ||
    bad "'$1' is neither an executable nor a git revision of $repo"
  local tree="$work/tree-$rev"
  [ -d "$tree" ] || git -C "$repo" worktree add --detach "$tree" "$rev" >&2 || fail "git worktree add $rev failed"
  (cd "$tree" && CARGO_TARGET_DIR="$work/target-$rev" cargo build --release --example train_cifar10 >&2) ||
    fail "building $rev failed"
  echo "$work/target-$rev/release/examples/train_cifar10"
}
mkdir -p "$work"
before=$(resolve "$1")
after=$(resolve "$2")

# Every optimization alone and all together, plus AdamW, pruning and int8 storage, on synthetic data.
configs=(
  "plain:"
  "f16:--precision f16"
  "bf16:--precision bf16"
  "accum4:--accum-steps 4"
  "ckpt-stages:--checkpoint stages"
  "ckpt-blocks:--checkpoint blocks"
  "separable:--conv separable"
  "all:--precision bf16 --accum-steps 4 --checkpoint blocks --conv separable"
  "adamw:--optimizer adamw --lr 0.003"
  "prune:--prune 0.5 --prune-begin 2 --prune-end 6 --prune-every 2"
  "int8:--compress-activations int8"
  "int8-bf16-segments:--compress-activations int8 --precision bf16 --checkpoint segments:1,3"
  "int2-bf16:--compress-activations int2 --precision bf16"
)
common=(--synthetic-train 256 --synthetic-test 64 --width 8 --batch-size 32 --epochs 1
  --max-steps 8 --seed 7 --quiet)

# The snapshot folder of a run (named "checkpoints" before the rename, "snapshots" after).
newest_step_dir() {
  local root
  for root in "$1/snapshots" "$1/checkpoints"; do
    if [ -f "$root/latest" ]; then
      echo "$root/$(tr -d '\n' <"$root/latest")"
      return
    fi
  done
  fail "$1 holds no snapshot"
}

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
differ=0
printf '%-12s %-10s %s\n' config losses "weights, optimizer state"
for c in "${configs[@]}"; do
  name=${c%%:*}
  read -r -a flags <<<"${c#*:}"
  for side in before after; do
    bin=$before
    [ "$side" = after ] && bin=$after
    "$bin" "${common[@]}" "${flags[@]}" --out "$out/$name-$side" >"$out/$name-$side.log" 2>&1 ||
      fail "$name ($side) failed: $(tail -n 1 "$out/$name-$side.log")"
  done
  # The loss column of batches.csv: every step, printed to the last digit.
  col() { awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == "loss") c = i; next } { print $c }' "$1"; }
  losses=same
  [ "$(col "$out/$name-before/batches.csv")" = "$(col "$out/$name-after/batches.csv")" ] || losses=DIFFERENT
  weights=same
  b=$(newest_step_dir "$out/$name-before")
  a=$(newest_step_dir "$out/$name-after")
  for f in model.safetensors optimizer.safetensors; do
    cmp -s "$b/$f" "$a/$f" || weights=DIFFERENT
  done
  steps=$(($(wc -l <"$out/$name-after/batches.csv") - 1))
  printf '%-12s %-10s %s (%d steps)\n' "$name" "$losses" "$weights" "$steps"
  [ "$losses$weights" = samesame ] || differ=1
done
[ "$differ" = 0 ] || fail "some configuration trains differently"
echo "every configuration: bit-identical losses and final weights"
