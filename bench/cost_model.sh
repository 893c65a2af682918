#!/usr/bin/env bash
# The CPU cost model of `--fit-memory` (`CostModel::cpu` in src/predict/plan.rs), measured: the
# fastest step of each precision × checkpointing × conv kind, relative to f32, no checkpointing,
# standard conv.
#
#   bench/cost_model.sh [OUT_JSON]        (default runs/cost-model.json)
#
# Width 32, micro-batch 64 (the model's reference: between `full_at` and `spill_above`), synthetic
# data without augmentation, 12 steps per run, ROUNDS (3) runs of every configuration in turn; a
# configuration's time is its fastest step after the first of all its runs (other work on the
# machine only slows a step down). Prints the factors as `CostModel::cpu` names them and writes
# them, with every configuration's time, to OUT_JSON. docs/results/cost-model.json comes from
#   bench/cost_model.sh docs/results/cost-model.json
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(realpath -m "${1:-$repo/runs/cost-model.json}")
rounds=${ROUNDS:-3}
[[ $rounds =~ ^[1-9][0-9]?$ ]] || { echo "error: ROUNDS must be 1 to 99, got '$rounds'" >&2; exit 2; }
cd "$repo"
cargo build --release --example train_cifar10 >&2
bin=$repo/target/release/examples/train_cifar10
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for r in $(seq 1 "$rounds"); do
  for conv in standard separable; do
    for p in f32 f16 bf16; do
      for ck in none stages blocks; do
        dir=$work/$conv-$p-$ck-r$r
        "$bin" --width 32 --batch-size 64 --max-steps 12 --synthetic-train 1024 --synthetic-test 16 \
          --no-eval --no-augment --quiet --device cpu --conv "$conv" --precision "$p" \
          --checkpoint "$ck" --out "$dir" > "$dir.log" 2>&1 ||
          { echo "error: $conv $p $ck failed: $(tail -n 1 "$dir.log")" >&2; exit 1; }
      done
    done
  done
  echo "round $r done" >&2
done
mkdir -p "$(dirname "$out")"
python3 - "$work" "$rounds" "$out" "$(git rev-parse --short HEAD)" <<'PY'
import csv, json, os, sys, tempfile
work, rounds, out, commit = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def fastest(name):
    best = None
    for r in range(1, rounds + 1):
        with open(os.path.join(work, f"{name}-r{r}", "batches.csv")) as f:
            for row in csv.DictReader(f):
                if int(row["global_step"]) > 1:
                    t = float(row["step_secs"])
                    best = t if best is None else min(best, t)
    return best
t = {f"{c}-{p}-{k}": fastest(f"{c}-{p}-{k}") for c in ("standard", "separable")
     for p in ("f32", "f16", "bf16") for k in ("none", "stages", "blocks")}
f = {
    "f16_standard": t["standard-f16-none"] / t["standard-f32-none"],
    "bf16_standard": t["standard-bf16-none"] / t["standard-f32-none"],
    "f16_separable": t["separable-f16-none"] / t["separable-f32-none"],
    "bf16_separable": t["separable-bf16-none"] / t["separable-f32-none"],
    "stages_standard": t["standard-f32-stages"] / t["standard-f32-none"] - 1,
    "blocks_standard": t["standard-f32-blocks"] / t["standard-f32-none"] - 1,
    "stages_separable": t["separable-f32-stages"] / t["separable-f32-none"] - 1,
    "blocks_separable": t["separable-f32-blocks"] / t["separable-f32-none"] - 1,
    "separable": t["separable-f32-none"] / t["standard-f32-none"],
}
res = {"what": "fastest step (s) of each conv-precision-checkpoint, width 32, micro-batch 64, "
               f"{rounds} runs of 12 steps each; factors relative to f32, no checkpointing, "
               "standard conv (CostModel::cpu)",
       "commit": commit, "step_secs": t, "factors": {k: round(v, 3) for k, v in f.items()}}
fd, tmp = tempfile.mkstemp(dir=os.path.dirname(out))
with os.fdopen(fd, "w") as fh:
    json.dump(res, fh, indent=2)
    fh.write("\n")
os.replace(tmp, out)
for k, v in f.items():
    print(f"{k}: {v:.2f}")
print(f"written to {out}")
PY
