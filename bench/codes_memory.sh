#!/usr/bin/env bash
# What the step adds with saved-activation codes, against the exact f32 step (issue 33's memory
# targets): the exact step and int8, int4 and int2 codes, in f32 and bf16 (width 32, batch 128,
# the real CIFAR-10 subset, 6 steps, CPU). Runs the `compare` command docs/memory.md shows
# (tests/results_tables.rs checks that the two are the same), then keeps its results:
#
#   docs/results/codes-memory.md    the machine and commit, then compare.md as printed
#   docs/results/codes-memory.csv   compare.csv: the source of docs/memory.md's table
#   docs/results/codes-memory-torch.json  the bytes PyTorch's eager step saves for its backward
#                                   on the same net and batch (bench/torch_reference.py
#                                   --saved-bytes), f32 and bf16 autocast
#
#   bench/codes_memory.sh
#
# Memory is the counting allocator's, exact and the same run to run. Needs
# ../shared/data/cifar10-subset (exit 1 without it). Removes runs/codes-memory first (the
# command's --out). After it: `UPDATE_README=1 cargo test --release --test results_tables`
# rewrites the table's numbers from the CSV.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
source bench/lib.sh
need_subset "the comparison"
data_dir=../shared/data/cifar10-subset
setup_torch
cargo build --release --example compare
rm -rf runs/codes-memory

# docs/memory.md's command, as printed there.
cargo run --release --example compare -- --out runs/codes-memory \
  --common "--data-dir ../shared/data/cifar10-subset --max-steps 6 --no-eval --device cpu" \
  --run "f32:" --run "f32-int8: --compress-activations int8" \
  --run "f32-int4: --compress-activations int4" --run "f32-int2: --compress-activations int2" \
  --run "bf16: --precision bf16" --run "bf16-int8: --precision bf16 --compress-activations int8" \
  --run "bf16-int4: --precision bf16 --compress-activations int4" \
  --run "bf16-int2: --precision bf16 --compress-activations int2"

commit=$(git rev-parse --short HEAD)
git diff --quiet HEAD -- src core kernels examples Cargo.toml Cargo.lock || commit="$commit (with uncommitted changes)"
{
  echo "# What the step adds with saved-activation codes (\`bench/codes_memory.sh\`)"
  echo
  echo "Commit \`$commit\`, $(date -u +%Y-%m-%d), on $(nproc) cores of the"
  echo "$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'). Memory is the counting"
  echo "allocator's, exact and the same run to run; img/s is from 6-step runs on a shared machine."
  echo "[CSV](codes-memory.csv)."
  echo
  cat runs/codes-memory/compare.md
} >docs/results/codes-memory.md
cp runs/codes-memory/compare.csv docs/results/codes-memory.csv

saved() { "$py" bench/torch_reference.py --saved-bytes --batch-size 128 --data-dir "$data_dir" --precision "$1" |
  "$py" -c 'import json, sys; print(json.load(sys.stdin)["saved_bytes"])'; }
f32=$(saved f32) bf16=$(saved bf16)
tmp=$(mktemp docs/results/.codes-memory-torch.XXXXXX)
cat >"$tmp" <<EOF
{
  "what": "bytes autograd saves for the backward in one forward and loss of the same net (width 32) at batch 128, the parameters left out (bench/torch_reference.py --saved-bytes)",
  "torch_version": "$torch_version",
  "f32": $f32,
  "bf16_autocast": $bf16
}
EOF
mv "$tmp" docs/results/codes-memory-torch.json
echo "== wrote docs/results/codes-memory.md, docs/results/codes-memory.csv and docs/results/codes-memory-torch.json"
