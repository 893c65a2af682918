#!/usr/bin/env bash
# The README's comparison: each memory optimization alone and all together (width 32, batch 128,
# the real CIFAR-10 subset, 8 steps, CPU). Runs the README's `compare` command as printed there
# (tests/results_tables.rs checks that the two are the same), then keeps its results:
#
#   docs/results/cpu-compare.md    the machine and commit, then compare.md as printed
#   docs/results/cpu-compare.csv   compare.csv: the source of the README's table and of
#                                  docs/memory.md's (tests/results_tables.rs checks both)
#   docs/images/compare-{peak-memory,frontier,step-timeline,step-peaks}.{png,svg}
#
#   bench/cpu_compare.sh
#
# Needs ../shared/data/cifar10-subset (exit 1 without it). Removes runs/cpu-compare first (the
# command's --out). After it: `UPDATE_README=1 cargo test --release --test results_tables`
# rewrites the numbers of both tables from the CSV.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
source bench/lib.sh
need_subset "the comparison"
cargo build --release --example compare
rm -rf runs/cpu-compare
load=$(cut -d' ' -f1-3 /proc/loadavg)

# The README's command, as printed there.
cargo run --release --example compare -- --out runs/cpu-compare \
  --common "--data-dir ../shared/data/cifar10-subset --max-steps 8 --no-eval --device cpu" \
  --run "none:" --run "f16: --precision f16" --run "bf16: --precision bf16" \
  --run "accum4: --accum-steps 4" --run "ckpt-stages: --checkpoint stages" \
  --run "ckpt-blocks: --checkpoint blocks" --run "ckpt-auto: --checkpoint auto" \
  --run "separable: --conv separable" \
  --run "all: --precision f16 --accum-steps 4 --checkpoint stages --conv separable" \
  --run "int8: --compress-activations int8" \
  --run "bf16-int8: --precision bf16 --compress-activations int8"

load_after=$(cut -d' ' -f1-3 /proc/loadavg)
commit=$(git rev-parse --short HEAD)
git diff --quiet HEAD -- src core kernels examples Cargo.toml Cargo.lock || commit="$commit (with uncommitted changes)"
cpu=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
l2=$(cat /sys/devices/system/cpu/cpu0/cache/index2/size 2>/dev/null || echo '?')
if [[ $l2 =~ ^([0-9]+)K$ ]]; then
  kib=${BASH_REMATCH[1]}
  if ((kib % 1024 == 0)); then l2="$((kib / 1024)) MiB"; else l2="$kib KiB"; fi
fi
flags=$(grep -m1 '^flags' /proc/cpuinfo)
family=$(grep -m1 '^cpu family' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')
isa="no AVX-512"
[[ $flags == *avx512f* ]] && isa="AVX-512"
[[ $flags == *avx512_bf16* ]] && isa="$isa and AVX512-BF16"
{
  echo "# The README's comparison (\`bench/cpu_compare.sh\`)"
  echo
  echo "Commit \`$commit\`, $(date -u +%Y-%m-%d), on $(nproc) cores of an $cpu (family $family, $isa,"
  echo "$l2 of L2 per core); load average $load before the runs, $load_after after. Memory is exact"
  echo "and repeats run to run; img/s is from 8-step runs on a machine shared with other work, so"
  echo "read it as a trend."
  echo "[CSV](cpu-compare.csv)."
  echo
  cat runs/cpu-compare/compare.md
} >docs/results/cpu-compare.md
cp runs/cpu-compare/compare.csv docs/results/cpu-compare.csv
for chart in peak_memory frontier step_timeline step_peaks; do
  for ext in png svg; do
    cp "runs/cpu-compare/$chart.$ext" "docs/images/compare-${chart//_/-}.$ext"
  done
done
echo "== wrote docs/results/cpu-compare.md, docs/results/cpu-compare.csv and docs/images/compare-*"
