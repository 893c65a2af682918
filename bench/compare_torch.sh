#!/usr/bin/env bash
# memtrain's training step against PyTorch's on the CPU: same network, batch, threads and data,
# run alternately in one invocation so background load hits both alike.
#
#   bench/compare_torch.sh [--threads T] [--batch-size B] [--width W] [--precision f32|f16|bf16]
#                          [--accum-steps K] [--checkpoint none|stages|blocks]
#                          [--conv standard|separable] [--steps S] [--repeats R]
#                          [--data-dir DIR | --synthetic] [--out FILE] [--timeout SECS]
#                          [--compile] [--no-taskset] [--keep]
#
# PyTorch runs from the virtual environment ${TORCH_VENV:-$HOME/.cache/memtrain/torch-venv}; when
# `import torch` fails there, the script creates it (python3 -m venv) and installs torch and numpy
# from PyPI. memtrain is built once with `cargo build --release --example train_cifar10`.
#
# What is timed: S optimizer steps after the same number of warm-up steps on both sides. For
# PyTorch, bench/torch_reference.py's wall clock over the timed steps; for memtrain, the run's
# summary.json `steady_images_per_sec` (images / summed step time of the steps after the warm-up
# steps that src/train/summary.rs `steady_throughput` skips). Each side runs R times, alternating
# which goes first; the table shows the median img/s of each and the ratio memtrain/PyTorch.
# With --compile, PyTorch also runs with torch.compile (inductor) as a third side, in turn with
# the other two; its warm-up steps include compiling, so its figure is the compiled step's.
#
# Exit status: 0 on success, 2 for a bad flag, 1 when a setup step or a run fails.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
  echo
  cat <<'EOF'
Flags (defaults in brackets):
  --threads T        threads for both frameworks [nproc]: RAYON_NUM_THREADS/CANDLE_NUM_THREADS
                     for memtrain, OMP_NUM_THREADS/MKL_NUM_THREADS and torch.set_num_threads for
                     PyTorch; both are also pinned to the same T CPUs with taskset when it exists
  --batch-size B     images per optimizer step [128]
  --width W          base width of the CNN [32]
  --precision P      f32, f16 or bf16 [f32]
  --accum-steps K    micro-batches per step; must divide B [1]
  --checkpoint C     none, stages or blocks [none]
  --conv V           standard or separable [standard]
  --steps S          timed optimizer steps per run [20]
  --repeats R        runs of each framework, alternating [3]
  --data-dir DIR     CIFAR-10 binary dir (data_batch_*.bin) for both
                     [../shared/data/cifar10-subset when present, else synthetic data]
  --synthetic        synthetic/random images even when the default data dir exists
  --out FILE         also write the result as JSON to FILE (atomically)
  --timeout SECS     limit for each single run [900]
  --compile          also time PyTorch with torch.compile, as a third side
  --no-taskset       do not pin the processes to CPUs
  --keep             keep the temporary run directory (logs, summary.json files)
  -h, --help         this text
Environment: TORCH_VENV (PyTorch virtual environment), CARGO (cargo command).
EOF
}

bad() { # one-line error for a bad flag, exit 2
  echo "error: $*; run '$0 --help' for the flags" >&2
  exit 2
}
fail() { # setup or run failure, exit 1
  echo "error: $*" >&2
  exit 1
}

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=bench/lib.sh
source "$repo/bench/lib.sh"
ncpu=$(nproc 2>/dev/null || echo 2)

threads=$ncpu batch=128 width=32 precision=f32 accum=1 checkpoint=none conv=standard
steps=20 repeats=3 data_dir="" synthetic=0 out="" timeout_s=900 use_taskset=1 keep=0 compile=0

while [ $# -gt 0 ]; do
  flag=$1
  val=""
  has_inline=0
  case $flag in
    --*=*) val=${flag#*=}; flag=${flag%%=*}; has_inline=1 ;;
  esac
  case $flag in
    -h|--help) usage; exit 0 ;;
    --synthetic|--no-taskset|--keep|--compile)
      [ $has_inline = 0 ] || bad "$flag takes no value"
      case $flag in
        --synthetic) synthetic=1 ;;
        --compile) compile=1 ;;
        --no-taskset) use_taskset=0 ;;
        --keep) keep=1 ;;
      esac
      shift
      continue
      ;;
    --threads|--batch-size|--width|--precision|--accum-steps|--checkpoint|--conv|--steps|\
    --repeats|--data-dir|--out|--timeout)
      if [ $has_inline = 0 ]; then
        need_value "$flag" $#
        val=$2
        shift 2
      else
        shift
      fi
      ;;
    *) bad "unknown flag '$1'" ;;
  esac
  case $flag in
    --threads) threads=$val ;;
    --batch-size) batch=$val ;;
    --width) width=$val ;;
    --precision) precision=$val ;;
    --accum-steps) accum=$val ;;
    --checkpoint) checkpoint=$val ;;
    --conv) conv=$val ;;
    --steps) steps=$val ;;
    --repeats) repeats=$val ;;
    --data-dir) data_dir=$val; [ -n "$val" ] || bad "--data-dir needs a directory" ;;
    --out) out=$val; [ -n "$val" ] || bad "--out needs a file name" ;;
    --timeout) timeout_s=$val ;;
  esac
done

posint --threads "$threads" 4096
posint --batch-size "$batch" 1048576
posint --width "$width" 4096
posint --accum-steps "$accum" 1048576
posint --steps "$steps" 100000
posint --repeats "$repeats" 1000
posint --timeout "$timeout_s" 86400
threads=$((10#$threads)) batch=$((10#$batch)) width=$((10#$width)) accum=$((10#$accum))
steps=$((10#$steps)) repeats=$((10#$repeats)) timeout_s=$((10#$timeout_s))
case $precision in f32|f16|bf16) ;; *) bad "--precision must be f32, f16 or bf16, got '$precision'" ;; esac
case $checkpoint in none|stages|blocks) ;; *) bad "--checkpoint must be none, stages or blocks, got '$checkpoint'" ;; esac
case $conv in standard|separable) ;; *) bad "--conv must be standard or separable, got '$conv'" ;; esac
[ $((batch % accum)) = 0 ] ||
  bad "--batch-size $batch is not divisible by --accum-steps $accum; pick a multiple of $accum"
[ "$threads" -le "$ncpu" ] ||
  echo "warning: --threads $threads is more than the $ncpu CPUs here; the figures will be oversubscribed" >&2

has_cifar() { # dir: true when it holds CIFAR-10 binary training files
  local f
  for f in "$1"/data_batch_*.bin; do [ -f "$f" ] && return 0; done
  return 1
}
if [ -n "$data_dir" ]; then
  [ $synthetic = 0 ] || bad "--data-dir and --synthetic exclude each other; give one"
  [ -d "$data_dir" ] || bad "--data-dir '$data_dir' is not a directory"
  has_cifar "$data_dir" ||
    bad "--data-dir '$data_dir' has no data_batch_*.bin (CIFAR-10 binary version); point it at one or use --synthetic"
  data_dir=$(cd "$data_dir" && pwd)
elif [ $synthetic = 0 ] && [ -d "$repo/../shared/data/cifar10-subset" ] &&
  has_cifar "$repo/../shared/data/cifar10-subset"; then
  data_dir=$(cd "$repo/../shared/data/cifar10-subset" && pwd)
fi
if [ -n "$out" ]; then
  [ ! -d "$out" ] || bad "--out '$out' is a directory; give a file name"
  out_dir=$(dirname -- "$out")
  [ -d "$out_dir" ] && [ -w "$out_dir" ] || bad "--out: directory '$out_dir' does not exist or is not writable"
fi

# ---- step counts -------------------------------------------------------------------------------
# memtrain's steady_throughput (src/train/summary.rs) skips max(1, min(3, n/4)) of n steps. Pick
# the smallest run length n whose steady part is exactly --steps, and give PyTorch the same number
# of warm-up steps, so both time the same steps after the same warm-up.
skip_of() {
  local s=$(($1 / 4))
  [ $s -le 3 ] || s=3
  [ $s -ge 1 ] || s=1
  echo $s
}
total=$((steps + 1))
while [ $((total - $(skip_of $total))) -ne "$steps" ]; do total=$((total + 1)); done
warmup=$(skip_of $total)
if ! grep -q 'let skip = 3.min(steps.len() / 4).max(1);' "$repo/src/train/summary.rs" 2>/dev/null; then
  echo "warning: src/train/summary.rs steady_throughput no longer has the warm-up rule this script mirrors (skip max(1, min(3, n/4))); the two sides may time different steps" >&2
fi

# ---- PyTorch and memtrain (bench/lib.sh) ------------------------------------------------------
setup_torch
build_memtrain

# ---- environment shared by both ----------------------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/tmp}/memtrain-vs-torch.XXXXXX")
cleanup() {
  if [ $keep = 1 ]; then echo "run files kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'keep=1; exit 130' INT TERM

pin_cpus

config="w$width $precision accum$accum ckpt=$checkpoint $conv"
if [ -n "$data_dir" ]; then
  data_note="CIFAR-10 files in $data_dir (no augmentation on either side)"
  mt_data=(--data-dir "$data_dir" --no-augment)
  torch_data=(--data-dir "$data_dir")
else
  data_note="synthetic images (memtrain: its built-in synthetic set; PyTorch: torch.randn), no augmentation"
  # Run in the empty work dir so memtrain's default data/cifar-10-batches-bin is never picked up.
  n_synth=$((batch * 4))
  [ $n_synth -ge 10 ] || n_synth=10
  mt_data=(--synthetic-train $n_synth --synthetic-test 10 --no-augment)
  torch_data=()
fi

echo "== memtrain vs PyTorch $torch_version on the CPU: batch $batch, $config, $threads threads ($pin_note)"
echo "   data: $data_note"
echo "   each run: $warmup warm-up + $steps timed steps; $repeats runs each, alternating"
echo "   memtrain figure: summary.json steady_images_per_sec (step time after the warm-up steps)"
echo "   PyTorch figure: torch_reference.py images_per_sec (wall clock of the timed steps)"

run_failed() { # framework, repeat index, exit status, log: keep the run dir, show the log, exit 1
  keep=1
  tail -n 20 "$4" >&2
  [ "$3" != 124 ] || fail "$1 run $2 took longer than --timeout $timeout_s s"
  fail "$1 run $2 failed (exit $3; log above, in $4)"
}

run_torch() { # repeat index [--compile]; sets val to the run's img/s
  local r=$1 name=torch rc=0
  shift
  [ $# = 0 ] || name=torch-compiled
  local log="$work/$name-$r.log"
  (cd "$work" && "${limit[@]}" "${pin[@]}" env "${thread_env[@]}" "$py" "$repo/bench/torch_reference.py" \
    --device cpu --threads "$threads" --batch-size "$batch" --width "$width" \
    --precision "$precision" --accum-steps "$accum" --checkpoint "$checkpoint" --conv "$conv" \
    --steps "$steps" --warmup "$warmup" "${torch_data[@]}" "$@") >"$work/$name-$r.json" 2>"$log" || rc=$?
  [ $rc = 0 ] || run_failed "PyTorch ($name)" "$r" "$rc" "$log"
  val=$("$py" - "$work/$name-$r.json" "$threads" <<'PY'
import json, sys
lines = [l for l in open(sys.argv[1]) if l.strip().startswith("{")]
res = json.loads(lines[-1])
if res.get("threads") != int(sys.argv[2]):
    print(f"warning: PyTorch ran with {res.get('threads')} threads, not {sys.argv[2]}", file=sys.stderr)
print(f'{res["images_per_sec"]:.3f}')
PY
  ) || { keep=1; fail "PyTorch run $r printed no result (see $work/$name-$r.json and $log)"; }
}

run_memtrain() { # repeat index; sets val to the run's img/s
  local r=$1 dir="$work/memtrain-$1" log="$work/memtrain-$1.log" rc=0
  (cd "$work" && "${limit[@]}" "${pin[@]}" env "${thread_env[@]}" MEMTRAIN_SUMMARY_ONLY=1 "$bin" \
    --device cpu --max-steps "$total" --epochs "$total" --no-eval --quiet \
    --out "$dir" --batch-size "$batch" --width "$width" --precision "$precision" \
    --accum-steps "$accum" --checkpoint "$checkpoint" --conv "$conv" "${mt_data[@]}") \
    >"$log" 2>&1 || rc=$?
  [ $rc = 0 ] || run_failed memtrain "$r" "$rc" "$log"
  val=$("$py" - "$dir/summary.json" "$total" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
if s.get("steps") != int(sys.argv[2]):
    sys.exit(f"memtrain ran {s.get('steps')} steps, expected {sys.argv[2]}")
v = s.get("steady_images_per_sec")
if v is None:
    sys.exit("summary.json has no steady_images_per_sec")
print(f"{v:.3f}")
PY
  ) || { keep=1; fail "memtrain run $r wrote no usable $dir/summary.json (see $log)"; }
}

torch_ips=()
compiled_ips=()
mt_ips=()
sides=(torch memtrain)
[ $compile = 0 ] || sides+=(compiled)
for ((r = 1; r <= repeats; r++)); do
  # Each side goes first in turn.
  n=${#sides[@]}
  order=()
  for ((k = 0; k < n; k++)); do order+=("${sides[$(((r - 1 + k) % n))]}"); done
  for who in "${order[@]}"; do
    case $who in
      torch)
        run_torch "$r"
        torch_ips+=("$val")
        echo "   run $r/$repeats  pytorch           $val img/s"
        ;;
      compiled)
        run_torch "$r" --compile
        compiled_ips+=("$val")
        echo "   run $r/$repeats  pytorch compiled  $val img/s"
        ;;
      memtrain)
        run_memtrain "$r"
        mt_ips+=("$val")
        echo "   run $r/$repeats  memtrain          $val img/s"
        ;;
    esac
  done
done

# ---- result ------------------------------------------------------------------------------------
mt_version=$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$repo/Cargo.toml" | head -n 1)
result=$(MT_RUNS="${mt_ips[*]}" PT_RUNS="${torch_ips[*]}" PC_RUNS="${compiled_ips[*]}" \
  THREADS=$threads PIN="$pin_note" \
  BATCH=$batch WIDTH=$width PRECISION=$precision ACCUM=$accum CHECKPOINT=$checkpoint CONV=$conv \
  DATA="$data_note" WARMUP=$warmup STEPS=$steps REPEATS=$repeats MT_VERSION="$mt_version" \
  PT_VERSION="$torch_version" "$py" - "$work/result.json" <<'PY'
import json, os, statistics, sys
e = os.environ
mt = [float(v) for v in e["MT_RUNS"].split()]
pt = [float(v) for v in e["PT_RUNS"].split()]
m, p = statistics.median(mt), statistics.median(pt)
res = {
    "device": "cpu",
    "threads": int(e["THREADS"]),
    "pinning": e["PIN"],
    "batch_size": int(e["BATCH"]),
    "width": int(e["WIDTH"]),
    "precision": e["PRECISION"],
    "accum_steps": int(e["ACCUM"]),
    "checkpoint": e["CHECKPOINT"],
    "conv": e["CONV"],
    "data": e["DATA"],
    "warmup_steps": int(e["WARMUP"]),
    "timed_steps": int(e["STEPS"]),
    "repeats": int(e["REPEATS"]),
    "memtrain": {"version": e["MT_VERSION"], "metric": "summary.json steady_images_per_sec",
                 "images_per_sec_runs": mt, "images_per_sec_median": m},
    "pytorch": {"version": e["PT_VERSION"], "metric": "torch_reference.py images_per_sec",
                "images_per_sec_runs": pt, "images_per_sec_median": p},
    "ratio_memtrain_over_pytorch": m / p,
}
pc = [float(v) for v in e["PC_RUNS"].split()]
c = statistics.median(pc) if pc else 0.0
if pc:
    res["pytorch_compiled"] = {"version": e["PT_VERSION"], "metric": "torch_reference.py --compile images_per_sec",
                               "images_per_sec_runs": pc, "images_per_sec_median": c}
    res["ratio_memtrain_over_pytorch_compiled"] = m / c
    res["ratio_compiled_over_eager"] = c / p
with open(sys.argv[1], "w") as f:
    json.dump(res, f, indent=2)
    f.write("\n")
print(f"{m:.1f} {p:.1f} {m / p:.2f} {c:.1f} {m / c if c else 0:.2f} {c / p:.2f}")
PY
)
read -r mt_med torch_med ratio compiled_med compiled_ratio compiled_gain <<<"$result"

echo
echo "| framework | threads | batch | config | img/s (median of $repeats) | ratio |"
echo "|---|---:|---:|---|---:|---:|"
echo "| memtrain $mt_version (Candle 0.11) | $threads | $batch | $config | $mt_med | $ratio |"
echo "| PyTorch $torch_version | $threads | $batch | $config | $torch_med | 1.00 |"
[ $compile = 0 ] ||
  echo "| PyTorch $torch_version, torch.compile | $threads | $batch | $config | $compiled_med | $compiled_gain |"
echo
echo "ratio = side / eager PyTorch (median img/s); memtrain: steady_images_per_sec, PyTorch: wall clock of the same $steps steps after $warmup warm-up steps"
[ $compile = 0 ] || echo "memtrain / compiled PyTorch: $compiled_ratio"

if [ -n "$out" ]; then
  tmp=$(mktemp "$(dirname -- "$out")/.$(basename -- "$out").XXXXXX")
  cp "$work/result.json" "$tmp"
  chmod "$(printf '%o' $((0666 & ~0$(umask))))" "$tmp"
  mv -f "$tmp" "$out"
  echo "result written to $out"
fi
