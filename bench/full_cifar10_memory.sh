#!/usr/bin/env bash
# Memory of a run on full-size CIFAR-10 (issue 37): five training files and a test file of 10,000
# records each, made in a temporary directory from the records of the shared subset (cycled; the
# subset itself is never copied into the repository).
#
#   bench/full_cifar10_memory.sh [--subset DIR] [--trainer BIN] [--max-steps N] [--label TEXT]
#                                [--keep]
#
# Two runs of train_cifar10 on the CPU, each in its own process:
# - the run: `--data-dir DIR --epochs 1` (or `--max-steps N`), default width and batch. From its
#   summary.json: the baseline (heap when training begins), the training peak (highest step
#   peak), the process's heap peak and its phase, and the resident peak (VmHWM);
# - the loading run: `--width 1 --batch-size 2 --max-steps 1 --no-eval`, whose step and model are
#   a few KiB, so its heap peak (phase "other") is the peak of loading the data.
# Prints the memory report's last lines of the run and one markdown row:
#   | label | baseline | loading peak | training peak | process peak (phase) | resident peak |
# in MiB (2^20 bytes), as the trainer prints them.
#
# --subset DIR   CIFAR-10 binary files to take records from [../shared/data/cifar10-subset]
# --trainer BIN  a built train_cifar10 to measure (e.g. one built from an older commit); default:
#                `cargo build --release --example train_cifar10` of this checkout
# --max-steps N  stop after N steps instead of one epoch
# --label TEXT   the row's first cell [git describe of this checkout]
# --keep         keep the temporary directory (data and run directories)
#
# Exit status: 0 on success, 2 for a bad flag, 1 when a setup step or a run fails.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bad() { echo "error: $1" >&2; exit 2; }
fail() { echo "error: $1" >&2; exit 1; }

subset=$repo/../shared/data/cifar10-subset
bin=""
steps=""
label=""
keep=0
while [ $# -gt 0 ]; do
  case $1 in
    --subset | --trainer | --max-steps | --label)
      [ $# -ge 2 ] || bad "$1 needs a value"
      case $1 in
        --subset) subset=$2 ;;
        --trainer) bin=$2 ;;
        --max-steps)
          [[ $2 =~ ^[1-9][0-9]{0,6}$ ]] || bad "--max-steps must be a whole number from 1, got '$2'"
          steps=$2 ;;
        --label) label=$2 ;;
      esac
      shift 2 ;;
    --keep) keep=1; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) bad "unknown flag '$1' (see --help)" ;;
  esac
done
command -v python3 >/dev/null || fail "python3 not found (it writes the data files and reads summary.json)"
ls "$subset"/data_batch_*.bin >/dev/null 2>&1 ||
  fail "no data_batch_N.bin in $subset; pass --subset DIR with CIFAR-10 binary files"
[ -n "$label" ] || label=$(git -C "$repo" describe --always --dirty 2>/dev/null || echo memtrain)

if [ -z "$bin" ]; then
  echo "== building memtrain (cargo build --release --example train_cifar10)" >&2
  (cd "$repo" && cargo build --release --example train_cifar10 >&2) ||
    fail "cargo build --release --example train_cifar10 failed"
  bin=$repo/target/release/examples/train_cifar10
fi
[ -x "$bin" ] || fail "$bin is not an executable train_cifar10"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/memtrain-full-cifar10.XXXXXX")
if [ "$keep" = 1 ]; then
  echo "== keeping $tmp" >&2
else
  trap 'rm -rf "$tmp"' EXIT
fi
data=$tmp/cifar-10-batches-bin
mkdir -p "$data"

echo "== full-size layout in $data from the records of $subset" >&2
python3 - "$subset" "$data" <<'EOF' || fail "could not write the full-size layout"
import glob, os, sys
RECORD, PER_FILE = 3073, 10_000
src, dst = sys.argv[1], sys.argv[2]
records = b"".join(open(p, "rb").read() for p in sorted(glob.glob(os.path.join(src, "data_batch_*.bin"))))
n = len(records) // RECORD
if n == 0 or len(records) % RECORD:
    sys.exit(f"{src}: not whole {RECORD}-byte records")
names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
for f, name in enumerate(names):
    with open(os.path.join(dst, name), "wb") as out:
        for r in range(PER_FILE):
            i = (f * PER_FILE + r) % n
            out.write(records[i * RECORD:(i + 1) * RECORD])
EOF

length=(--epochs 1)
[ -z "$steps" ] || length=(--max-steps "$steps")

echo "== run: $bin --data-dir $data --device cpu ${length[*]}" >&2
"$bin" --data-dir "$data" --device cpu "${length[@]}" --out "$tmp/run" >"$tmp/run.log" 2>&1 ||
  { tail -n 20 "$tmp/run.log" >&2; fail "the run failed (log above)"; }
echo "== loading run: $bin --data-dir $data --device cpu --width 1 --batch-size 2 --max-steps 1 --no-eval" >&2
"$bin" --data-dir "$data" --device cpu --width 1 --batch-size 2 --max-steps 1 --no-eval \
  --out "$tmp/loading" >"$tmp/loading.log" 2>&1 ||
  { tail -n 20 "$tmp/loading.log" >&2; fail "the loading run failed (log above)"; }

echo "== the run's report (last lines)" >&2
grep -E '^(run peak|peak |heap peak)' "$tmp/run.log" >&2 || true

python3 - "$tmp/run/summary.json" "$tmp/loading/summary.json" "$label" <<'EOF'
import json, sys
run, loading = (json.load(open(p)) for p in sys.argv[1:3])
mib = lambda b: f"{b / 2**20:.2f}"
if loading["peak_phase"] != "other":
    sys.exit(f"the loading run's peak is in phase {loading['peak_phase']}, not loading's")
rss = run.get("os_peak_bytes")
print(f"| {sys.argv[3]} | {mib(run['baseline_bytes'])} | {mib(loading['peak_bytes'])} | "
      f"{mib(run['step_peak_bytes'])} | {mib(run['peak_bytes'])} ({run['peak_phase']}) | "
      f"{mib(rss) if rss is not None else '-'} |")
EOF
