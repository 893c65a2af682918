#!/usr/bin/env bash
# Open a memtrain run's viewer files with the viewers' own readers: TensorBoard's
# EventAccumulator reads events.out.tfevents.*, PyTorch's torch.cuda._memory_viz reads
# memory_snapshot.pickle (and an out-of-memory run's oom_memory_snapshot.pickle), and step_trace.json is
# checked against step_timeline.json (bench/check_viewers.py does the checking).
#
#   bench/check_viewers.sh [--steps N] [--run-dir DIR] [--keep]
#
# Without --run-dir it trains a short CPU run on synthetic data (the default network and batch,
# N steps) and a one-step run whose --memory-limit is 3% under the first's resident peak (it stops
# on out of memory), then checks both. PyTorch and tensorboard run from the
# virtual environment ${TORCH_VENV:-$HOME/.cache/memtrain/torch-venv}; when `import torch` fails
# there, the script creates it and installs torch and numpy from PyPI (bench/lib.sh), and it adds
# tensorboard when that is missing. memtrain is built with `cargo build --release --example
# train_cifar10`.
#
# Exit status: 0 when every check passes, 2 for a bad flag, 1 when a setup step, a run or a check
# fails.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
  echo
  cat <<'EOF'
Flags (defaults in brackets):
  --steps N      optimizer steps of the run [3]
  --run-dir DIR  check this run directory instead of training one (no out-of-memory run)
  --keep         keep the temporary run directories
  -h, --help     this text
Environment: TORCH_VENV (virtual environment with torch), CARGO (cargo command).
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

repo=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$repo/bench/lib.sh"
steps=3
run_dir=""
keep=0
data_dir=""
while [ $# -gt 0 ]; do
  case $1 in
    --steps) need_value "$1" $#; posint "$1" "$2" 1000; steps=$2; shift 2 ;;
    --run-dir) need_value "$1" $#; run_dir=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) bad "unknown flag '$1'" ;;
  esac
done
if [ -n "$run_dir" ] && [ ! -f "$run_dir/memory_snapshot.pickle" ]; then
  bad "--run-dir $run_dir has no memory_snapshot.pickle; give the directory of a finished CPU run"
fi

setup_torch
if ! "$py" -c 'import tensorboard' >/dev/null 2>&1; then
  echo "== tensorboard not importable: pip install tensorboard into the venv"
  "$py" -m pip install tensorboard || fail "pip install tensorboard failed; check network access to PyPI"
fi
tb_version=$("$py" -c 'import tensorboard; print(tensorboard.__version__)')
echo "== readers: torch $torch_version, tensorboard $tb_version"

if [ -n "$run_dir" ]; then
  "$py" "$repo/bench/check_viewers.py" "$run_dir"
  exit $?
fi

build_memtrain
tmp=$(mktemp -d "${TMPDIR:-/tmp}/memtrain-viewers.XXXXXX")
if [ "$keep" = 1 ]; then
  echo "== keeping $tmp"
else
  trap 'rm -rf "$tmp"' EXIT
fi
common=(--device cpu --max-steps "$steps" --quiet)
echo "== $bin ${common[*]} --out $tmp/run"
"$bin" "${common[@]}" --out "$tmp/run" >"$tmp/run.log" 2>&1 || {
  tail -n 20 "$tmp/run.log" >&2
  fail "the run failed (log above)"
}
# A --memory-limit 3% under the run's resident peak, started past the prediction that refuses it
# (MEMTRAIN_RUN_PAST_PREDICTION=1): its one step runs out part-way, and that step is the traced one.
limit=$("$py" -c 'import csv,sys; r=list(csv.DictReader(open(sys.argv[1]))); print(int(r[0]["os_peak_bytes"]) * 97 // 100)' "$tmp/run/batches.csv")
echo "== $bin --device cpu --max-steps 1 --quiet --memory-limit $limit --out $tmp/oom (stops on out of memory)"
if MEMTRAIN_RUN_PAST_PREDICTION=1 "$bin" --device cpu --max-steps 1 --quiet --memory-limit "$limit" --out "$tmp/oom" >"$tmp/oom.log" 2>&1; then
  fail "the run with --memory-limit $limit did not run out of memory"
fi
[ -f "$tmp/oom/oom_memory_snapshot.pickle" ] || { tail -n 5 "$tmp/oom.log" >&2; fail "the limited run left no oom_memory_snapshot.pickle"; }
ls "$tmp/run" | sed 's/^/   run dir: /' | grep -E 'tfevents|pickle|step_trace'
"$py" "$repo/bench/check_viewers.py" "$tmp/run" "$tmp/oom"
