#!/usr/bin/env bash
# How many batches to prepare ahead: img/s and batch memory for each --prefetch N.
#
#   bench/prefetch.sh [--data-dir DIR] [--values 0,1,2,3] [--reps 3] [--steps 40] [--out DIR] [-- TRAIN FLAGS...]
#
# Runs `train_cifar10 --max-steps STEPS --no-eval --prefetch N` REPS times per value, the values
# interleaved (so a change in machine load spreads over all of them), and prints per N the best
# and median steady img/s (summary.json's steady_images_per_sec) and the bytes of the batches in
# flight (the estimate's), then the smallest N whose best img/s is within 2% of the best of all:
# the default DEFAULT_PREFETCH in src/data/batcher.rs. Writes OUT/prefetch.json. Needs a quiet
# machine: anything else running moves img/s by more than 2%.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bad() { echo "prefetch.sh: $1 (see the header of bench/prefetch.sh)" >&2; exit 2; }
fail() { echo "prefetch.sh: $1" >&2; exit 1; }
source "$repo/bench/lib.sh"

data_dir="" values=0,1,2,3 reps=3 steps=40 out="$repo/runs/prefetch"
while [ $# -gt 0 ]; do
  case $1 in
    --data-dir|--values|--reps|--steps|--out) need_value "$1" $# ;;
  esac
  case $1 in
    --data-dir) data_dir=$2; shift 2 ;;
    --values) [[ $2 =~ ^[0-9]+(,[0-9]+)*$ ]] || bad "--values must be a comma-separated list of whole numbers, got '$2'"
      values=$2; shift 2 ;;
    --reps) posint --reps "$2" 100; reps=$2; shift 2 ;;
    --steps) posint --steps "$2" 100000; [ "$2" -ge 10 ] || bad "--steps must be at least 10 (the first steps are warm-up)"
      steps=$2; shift 2 ;;
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

dirs=()
for r in $(seq 1 "$reps"); do
  for n in ${values//,/ }; do
    dir="$out/prefetch-$n-rep-$r"
    rm -rf "$dir"
    args=(--max-steps "$steps" --no-eval --quiet --prefetch "$n" --out "$dir")
    [ -z "$data_dir" ] || args+=(--data-dir "$data_dir")
    echo "== rep $r, --prefetch $n"
    "$bin" "${args[@]}" "${extra[@]}" >"$dir.log" 2>&1 ||
      fail "--prefetch $n failed (log: $dir.log): $(tail -n 1 "$dir.log")"
    dirs+=("$dir")
  done
done

"$py" - "$out" "${extra[*]:-}" "${dirs[@]}" <<'EOF'
import json, os, re, statistics, sys, tempfile
out, extra, dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
by_n = {}
for d in dirs:
    n = int(re.search(r"prefetch-(\d+)-rep", d).group(1))
    s = json.load(open(os.path.join(d, "summary.json")))
    log = open(d + ".log").read()
    m = re.search(r"batches in flight ([0-9.]+ \w+)", log)
    e = by_n.setdefault(n, {"img_s": [], "batch_memory": m.group(1) if m else "?",
                            "step_peak_bytes": s["step_peak_bytes"]})
    e["img_s"].append(s["steady_images_per_sec"])
best = max(max(e["img_s"]) for e in by_n.values())
print(f"\n| --prefetch | batches in flight | step peak MiB | best img/s | median img/s | best vs best of all |")
print("|---:|---:|---:|---:|---:|---:|")
for n in sorted(by_n):
    e = by_n[n]
    e["best"], e["median"] = max(e["img_s"]), statistics.median(e["img_s"])
    print(f"| {n} | {e['batch_memory']} | {e['step_peak_bytes'] / 2**20:.2f} | {e['best']:.1f} | "
          f"{e['median']:.1f} | {100 * (e['best'] / best - 1):+.1f}% |")
chosen = min(n for n, e in by_n.items() if e["best"] >= 0.98 * best)
print(f"\nsmallest --prefetch within 2% of the best img/s: {chosen} (extra flags: {extra or 'none'})")
res = {"extra_flags": extra, "chosen": chosen,
       "values": {str(n): by_n[n] for n in sorted(by_n)}}
fd, tmp = tempfile.mkstemp(dir=out)
with os.fdopen(fd, "w") as f:
    json.dump(res, f, indent=2)
os.replace(tmp, os.path.join(out, "prefetch.json"))
EOF
