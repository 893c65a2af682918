#!/usr/bin/env bash
# The memory estimate against the CPU probe, at the step's peak and at every event of the step's
# memory timeline, for the configuration matrix of docs/results/estimate-accuracy.md.
#
#   bench/estimate_accuracy.sh [OUT_DIR]      (default runs/estimate-accuracy)
#
# Each configuration trains 3 optimizer steps on the built-in synthetic data (5000 + 1000
# images), no evaluation, width 32 unless the row says otherwise. The peak error compares
# summary.json's predicted and measured run peak; the event error is the worst
# (predicted − measured) / measured over the events of the last step's step_timeline.json, where
# each event's value is the highest heap use since the previous event. Prints a markdown table
# and exits 1 if a run fails.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$repo/runs/estimate-accuracy}
cd "$repo"
cargo build --release --example train_cifar10 >&2
bin=$repo/target/release/examples/train_cifar10
mkdir -p "$out"

rows=()
for bs in 32 128; do for p in f32 f16; do for c in none stages; do for k in standard separable; do
  rows+=("--batch-size $bs --precision $p --checkpoint $c --conv $k")
done; done; done; done
rows+=("--batch-size 128 --precision f32 --accum-steps 4"
       "--batch-size 128 --precision f32 --checkpoint blocks"
       "--batch-size 128 --precision f32 --checkpoint blocks --conv separable"
       "--batch-size 128 --precision bf16"
       "--batch-size 128 --precision bf16 --checkpoint stages"
       "--batch-size 128 --precision f16 --accum-steps 4 --checkpoint stages --conv separable"
       "--batch-size 128 --width 24"
       "--batch-size 128 --width 48"
       "--batch-size 128 --width 48 --checkpoint stages")

echo "| configuration | predicted peak | measured peak | peak error | events | worst event error (event) |"
echo "|---|---:|---:|---:|---:|---|"
i=0
for flags in "${rows[@]}"; do
  i=$((i + 1))
  dir=$out/run-$i
  rm -rf "$dir"
  # shellcheck disable=SC2086
  if ! "$bin" $flags --max-steps 3 --no-eval --quiet --out "$dir" > "$dir.log" 2>&1; then
    echo "error: '$flags' failed; see $dir.log" >&2
    exit 1
  fi
  python3 - "$dir" "$flags" <<'EOF'
import json, sys
d, flags = sys.argv[1], sys.argv[2]
s = json.load(open(f"{d}/summary.json"))
t = json.load(open(f"{d}/step_timeline.json"))
worst, where, unpredicted = 0.0, "-", 0
for e in t["events"]:
    p = e.get("predicted_peak_bytes")
    if p is None:
        # The optimizer event of a step the f16 loss scaler skipped has no prediction.
        unpredicted += 1
        continue
    err = (p - e["peak_bytes"]) / e["peak_bytes"] * 100
    if abs(err) > abs(worst):
        worst, where = err, f'{e["phase"]} {e["layer"]}'
mib = lambda b: b / 2**20
print(f'| `{flags}` | {mib(s["predicted_peak_bytes"]):.2f} MiB | {mib(s["peak_bytes"]):.2f} MiB '
      f'| {s["prediction_error_pct"]:+.2f}% | {len(t["events"]) - unpredicted}'
      f'{" (+1 skipped update)" if unpredicted else ""} | {worst:+.2f}% ({where}) |')
EOF
done
