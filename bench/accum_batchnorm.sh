#!/usr/bin/env bash
# Gradient accumulation against one big batch, with BatchNorm in training mode: one optimizer
# step of batch 128 from the same initial weights (seed 0) for --accum-steps 1, 2, 4 and 8.
# BatchNorm normalizes each micro-batch with that micro-batch's statistics, so the loss and the
# gradients differ from the big batch's, and the running statistics are updated once per
# micro-batch. Prints the markdown table of docs/results/accum-batchnorm.md.
#
#   bench/accum_batchnorm.sh [DATA_DIR] [OUT_DIR]
#       DATA_DIR default ../shared/data/cifar10-subset; OUT_DIR default runs/accum-batchnorm
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
data=${1:-../shared/data/cifar10-subset}
out=${2:-$repo/runs/accum-batchnorm}
cargo build --release --example train_cifar10 >&2
bin=$repo/target/release/examples/train_cifar10
mkdir -p "$out"
for k in 1 2 4 8; do
  rm -rf "$out/k$k"
  if ! "$bin" --data-dir "$data" --accum-steps "$k" --max-steps 1 --no-eval --quiet \
    --out "$out/k$k" > "$out/k$k.log" 2>&1; then
    echo "error: --accum-steps $k failed; see $out/k$k.log" >&2
    exit 1
  fi
done
python3 - "$out" <<'EOF'
import array, csv, glob, json, struct, sys
out = sys.argv[1]

def step1(k):
    with open(f"{out}/k{k}/batches.csv") as f:
        row = next(csv.DictReader(f))
    return float(row["loss"]), float(row["grad_norm"])

def running_stats(k):
    # The snapshot's model.safetensors: an 8-byte header length, a JSON header, f32 data.
    (path,) = glob.glob(f"{out}/k{k}/snapshots/step-*/model.safetensors")
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    head, data = json.loads(b[8:8 + n]), b[8 + n:]
    stats = {}
    for name, t in head.items():
        if "running" in name:
            s, e = t["data_offsets"]
            stats[name] = array.array("f", data[s:e])
    return stats

loss1, norm1 = step1(1)
stats1 = running_stats(1)
print("| `--accum-steps` | micro-batch | step-1 loss | vs K = 1 | gradient norm | vs K = 1 | running statistics vs K = 1 (worst layer) |")
print("|---:|---:|---:|---:|---:|---:|---:|")
for k in (1, 2, 4, 8):
    loss, norm = step1(k)
    stats = running_stats(k)
    worst = max(
        sum((x - y) ** 2 for x, y in zip(stats[n], stats1[n])) ** 0.5
        / sum(y * y for y in stats1[n]) ** 0.5
        for n in stats1
    )
    print(f"| {k} | {128 // k} | {loss:.5f} | {(loss - loss1) / loss1 * 100:+.3f}% "
          f"| {norm:.3f} | {(norm - norm1) / norm1 * 100:+.2f}% | {worst * 100:.0f}% |")
EOF
