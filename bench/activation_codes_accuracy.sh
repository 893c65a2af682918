#!/usr/bin/env bash
# Held-out accuracy of the exact step and of each width of saved-activation codes, over seeds.
#
#   bench/activation_codes_accuracy.sh [--data-dir DIR] [--epochs E] [--seeds 0,1,2,3,4,5]
#       [--codes none,int8,int4,int2,reordered[:N]] [--json FILE] [--work DIR] [-- TRAIN FLAGS...]
#
# `reordered` is the null twin: the exact step (`--compress-activations none`) in one compute
# thread (RAYON_NUM_THREADS=1; `reordered:N`, N threads), the same arithmetic with its sums in
# another order. Its distance from `none` on the same seed is what float rounding alone does to a
# 20-epoch run, the noise floor every code's distance is read against.
#
# Builds train_cifar10 once and copies it into WORK, so that later builds do not change the binary
# mid-way; then, seed by seed, trains `train_cifar10 --epochs E --seed S --compress-activations C`
# for every C in --codes (plus any flags after `--`), and after each run rewrites FILE with every
# run so far (so an interrupted sweep keeps what it finished) and the mean per code. Runs are
# nice'd. docs/results/activation-codes-accuracy.json comes from
#   bench/activation_codes_accuracy.sh --data-dir ../shared/data/cifar10-subset --epochs 20 \
#       --json docs/results/activation-codes-accuracy.json
# run as two invocations at once (--codes none, and --codes int8,int4,int2, each into a file of
# its own), whose runs were then put in one file: a file is written by one invocation at a time.
# Seeds 6 to 11 came the same way (--seeds 6,7,8,9,10,11 with --codes none,int2, then int8,int4),
# their runs added to that file and its mean_accuracy and against_exact recomputed as below; the
# null twin's twelve the same way (--seeds 0,2,4,6,8,10 --codes reordered, and the odd seeds).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bad() { echo "activation_codes_accuracy.sh: $1 (see the header of bench/activation_codes_accuracy.sh)" >&2; exit 2; }
fail() { echo "activation_codes_accuracy.sh: $1" >&2; exit 1; }
source "$repo/bench/lib.sh"

data_dir="" epochs=20 seeds=0,1,2,3,4,5 codes=none,int8,int4,int2
json="$repo/runs/activation-codes-accuracy.json" work="$repo/runs/activation-codes-accuracy"
while [ $# -gt 0 ]; do
  case $1 in
    --data-dir|--epochs|--seeds|--codes|--json|--work) need_value "$1" $# ;;
  esac
  case $1 in
    --data-dir) data_dir=$2; shift 2 ;;
    --epochs) posint --epochs "$2" 1000; epochs=$2; shift 2 ;;
    --seeds) [[ $2 =~ ^[0-9]+(,[0-9]+)*$ ]] || bad "--seeds must be a comma-separated list of seeds, got '$2'"
      seeds=$2; shift 2 ;;
    --codes) [[ $2 =~ ^(none|int8|int4|int2|reordered(:[1-9][0-9]?)?)(,(none|int8|int4|int2|reordered(:[1-9][0-9]?)?))*$ ]] ||
      bad "--codes must be a comma-separated list of none, int8, int4, int2, reordered[:N], got '$2'"
      codes=$2; shift 2 ;;
    --json) json=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --) shift; break ;;
    *) bad "unknown argument '$1'" ;;
  esac
done
extra=("$@")
check_data_dir_and_python "$data_dir"
py=python3
build_memtrain
mkdir -p "$work" "$(dirname "$json")"
cp "$bin" "$work/train_cifar10"
built_from=$(cd "$repo" && git rev-parse --short HEAD)$(cd "$repo" && git diff --quiet HEAD -- . ':!docs' || echo "+changes")

for s in ${seeds//,/ }; do
  for c in ${codes//,/ }; do
    dir="$work/$c-seed-$s"
    rm -rf "$dir"
    threads=() how=$c
    case $c in reordered*) threads=(RAYON_NUM_THREADS=$([ "$c" = reordered ] && echo 1 || echo "${c#reordered:}")); how=none ;; esac
    args=(--epochs "$epochs" --seed "$s" --compress-activations "$how" --quiet --out "$dir")
    [ -z "$data_dir" ] || args+=(--data-dir "$data_dir")
    echo "== $c, seed $s: ${threads[*]:+${threads[*]} }train_cifar10 ${args[*]} ${extra[*]:-}"
    env "${threads[@]}" nice "$work/train_cifar10" "${args[@]}" "${extra[@]}" >"$dir.log" 2>&1 ||
      fail "$c seed $s failed (log: $dir.log): $(tail -n 1 "$dir.log")"
    "$py" - "$json" "$dir" "$c" "$s" "$epochs" "$built_from" "${extra[*]:-}" <<'EOF'
import json, os, sys, tempfile
path, d, code, seed, epochs, built, extra = sys.argv[1:8]
s = json.load(open(os.path.join(d, "summary.json")))
try:
    res = json.load(open(path))
except (FileNotFoundError, json.JSONDecodeError):
    res = {"runs": []}
res["what"] = (f"{epochs}-epoch accuracy on the held-out images (final_test_accuracy of "
               "summary.json), per width of saved-activation codes (reordered: the exact step in one "
               "thread, the null twin) and seed")
res["command"] = (f"train_cifar10 --epochs {epochs} --seed S --compress-activations C --quiet "
                  f"[--data-dir DIR] {extra}").strip()
res["runs"] = [r for r in res["runs"]
               if not (r["compress_activations"] == code and r["seed"] == int(seed))]
res["runs"].append({"compress_activations": code, "seed": int(seed),
                    "accuracy": s["final_test_accuracy"], "eval_images": s["eval_images"],
                    "eval_is_validation": s["eval_is_validation"], "lossy": s["lossy"],
                    "final_train_loss": s["final_train_loss"], "built_from": built,
                    "wall_secs": s["wall_secs"]})
means = {}
for r in res["runs"]:
    means.setdefault(r["compress_activations"], []).append(r["accuracy"])
res["mean_accuracy"] = {k: {"seeds": len(v), "mean": sum(v) / len(v)} for k, v in means.items()}
# Each code against the exact step on the same seeds (its twin: same weights at the start, same
# batches), in points.
acc = {(r["compress_activations"], r["seed"]): r["accuracy"] for r in res["runs"]}
twins = {}
for (c, sd), a in acc.items():
    if c != "none" and ("none", sd) in acc:
        twins.setdefault(c, []).append(100 * (a - acc[("none", sd)]))
res["against_exact"] = {c: {"seeds": len(d), "mean_points": sum(d) / len(d),
                            "worst_seed_points": min(d), "best_seed_points": max(d)}
                        for c, d in twins.items()}
fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)))
with os.fdopen(fd, "w") as f:
    json.dump(res, f, indent=2)
    f.write("\n")
os.replace(tmp, path)
r = res["runs"][-1]
print(f"   accuracy {100 * r['accuracy']:.2f}% ({r['eval_images']} images), {r['wall_secs']:.0f} s")
EOF
  done
done
echo "== wrote $json"
