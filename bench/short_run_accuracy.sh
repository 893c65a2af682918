#!/usr/bin/env bash
# Accuracy of short runs over several seeds: does the recipe learn in one epoch?
#
#   bench/short_run_accuracy.sh [--data-dir DIR] [--epochs E] [--seeds 0,1,2] [--out DIR] [-- TRAIN FLAGS...]
#
# Trains `train_cifar10 --epochs E --seed S` once per seed (plus any flags after `--`), then
# prints one row per seed (test/validation accuracy, first-epoch max loss) and the mean, and
# writes them as JSON to OUT/short_run_accuracy.json. The README's "first run" figures come from
#   bench/short_run_accuracy.sh --data-dir ../shared/data/cifar10-subset --epochs 1
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bad() { echo "short_run_accuracy.sh: $1 (see the header of bench/short_run_accuracy.sh)" >&2; exit 2; }
fail() { echo "short_run_accuracy.sh: $1" >&2; exit 1; }
source "$repo/bench/lib.sh"

data_dir="" epochs=1 seeds=0,1,2 out="$repo/runs/short-run-accuracy"
while [ $# -gt 0 ]; do
  case $1 in
    --data-dir|--epochs|--seeds|--out) need_value "$1" $# ;;
  esac
  case $1 in
    --data-dir) data_dir=$2; shift 2 ;;
    --epochs) posint --epochs "$2" 1000; epochs=$2; shift 2 ;;
    --seeds) [[ $2 =~ ^[0-9]+(,[0-9]+)*$ ]] || bad "--seeds must be a comma-separated list of seeds, got '$2'"
      seeds=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --) shift; break ;;
    *) bad "unknown argument '$1'" ;;
  esac
done
extra=("$@")
check_data_dir_and_python "$data_dir"
py=python3
build_memtrain
mkdir -p "$out"

runs=()
for s in ${seeds//,/ }; do
  dir="$out/seed-$s"
  rm -rf "$dir"
  args=(--epochs "$epochs" --seed "$s" --quiet --out "$dir")
  [ -z "$data_dir" ] || args+=(--data-dir "$data_dir")
  echo "== seed $s: train_cifar10 ${args[*]} ${extra[*]:-}"
  "$bin" "${args[@]}" "${extra[@]}" >"$out/seed-$s.log" 2>&1 ||
    fail "seed $s failed (log: $out/seed-$s.log): $(tail -n 1 "$out/seed-$s.log")"
  runs+=("$dir")
done

"$py" - "$out" "$epochs" "${extra[*]:-}" "${runs[@]}" <<'EOF'
import csv, json, os, sys, tempfile
out, epochs, extra, dirs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
rows = []
for d in dirs:
    s = json.load(open(os.path.join(d, "summary.json")))
    losses = [float(r["loss"]) for r in csv.DictReader(open(os.path.join(d, "batches.csv")))
              if r["epoch"] == "1"]
    rows.append({"run": os.path.basename(d), "accuracy": s["final_test_accuracy"],
                 "eval_is_validation": s["eval_is_validation"],
                 "max_first_epoch_loss": max(losses), "final_train_loss": s["final_train_loss"]})
mean = sum(r["accuracy"] for r in rows) / len(rows)
print(f"\n| run | accuracy | max loss in epoch 1 | final train loss |\n|---|---:|---:|---:|")
for r in rows:
    print(f"| {r['run']} | {100*r['accuracy']:.2f}% | {r['max_first_epoch_loss']:.2f} | {r['final_train_loss']:.3f} |")
print(f"| mean | {100*mean:.2f}% | | |")
print(f"(epochs {epochs}; extra flags: {extra or 'none'}; "
      f"{'validation split' if rows[0]['eval_is_validation'] else 'test set'})")
res = {"epochs": epochs, "extra_flags": extra, "mean_accuracy": mean, "runs": rows}
fd, tmp = tempfile.mkstemp(dir=out)
with os.fdopen(fd, "w") as f:
    json.dump(res, f, indent=2)
os.replace(tmp, os.path.join(out, "short_run_accuracy.json"))
EOF
