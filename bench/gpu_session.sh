#!/usr/bin/env bash
# memtrain's GPU checks and memtrain-vs-PyTorch comparison, in one bounded run on a CUDA machine.
#
#   bench/gpu_session.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds CUDA builds (see README, Build for CUDA): train_cifar10, batch_sweep and the test
# binaries gpu_train, gpu_memory, pool, batchnorm, depthwise, conv2d (named without cargo's hash suffix).
# Results land in OUT_DIR: tests.log, memtrain.jsonl, torch.jsonl, pool-cache.jsonl, sweep/, gpu.txt.
# Each step has its own time limit so the whole run fits a short GPU lease. Environment:
# TESTS (test binaries to run), STEPS (steps per config, 25), SKIP_TORCH=1, SWEEP_LIMIT (s).
set -uo pipefail
BIN=$(realpath "$1"); OUT=$(realpath -m "$2"); mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
if [ -z "${LD_LIBRARY_PATH_SET:-}" ]; then
  lib=$(dirname "$(find / -name 'libcublas.so.13*' -path '*cu13*' 2>/dev/null | head -1)")
  export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
echo "libs: $LD_LIBRARY_PATH" >> "$OUT/gpu.txt"
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/session.log"; }

log "tests"
for t in ${TESTS:-gpu_memory pool batchnorm depthwise conv2d gpu_train}; do
  timeout "$( [ $t = gpu_train ] && echo 90 || echo ${TEST_LIMIT:-40})" "$BIN/$t" --include-ignored --test-threads=1 >> "$OUT/tests.log" 2>&1
  log "test $t rc=$?"
done

# name|flags shared by both frameworks
CONFIGS=(
  "bs128-f32|--batch-size 128"
  "bs128-bf16|--batch-size 128 --precision bf16"
  "bs512-f32|--batch-size 512"
  "bs512-bf16|--batch-size 512 --precision bf16"
  "bs512-f16|--batch-size 512 --precision f16"
  "bs512-accum4|--batch-size 512 --accum-steps 4"
  "bs512-ckpt-stages|--batch-size 512 --checkpoint stages"
  "bs512-separable|--batch-size 512 --conv separable"
  "bs512-bf16-all|--batch-size 512 --precision bf16 --accum-steps 4 --checkpoint stages --conv separable"
)
STEPS=${STEPS:-25}
run_memtrain() { # name flags... ; appends {"name":..., summary...} to $OUT/$file
  local file=$1 name=$2; shift 2
  local dir="/tmp/mt-$file-$name"; rm -rf "$dir"
  timeout 90 "$BIN/train_cifar10" --device cuda --max-steps "$STEPS" --synthetic-train 13000 --synthetic-test 100 \
    --no-eval --quiet --summary-only --out "$dir" "$@" > "$dir.log" 2>&1
  local rc=$?
  python3 - "$dir/summary.json" "$name" "$rc" "$*" >> "$OUT/$file" <<'PY'
import json, sys
path, name, rc, flags = sys.argv[1:5]
try:
    s = json.load(open(path))
except Exception as e:
    s = {"error": str(e)}
s.update({"name": name, "rc": int(rc), "flags": flags})
print(json.dumps(s))
PY
  log "memtrain $name rc=$rc"
}
log "memtrain runs"
for c in "${CONFIGS[@]}"; do run_memtrain memtrain.jsonl "${c%%|*}" ${c#*|}; done
log "pool cache off"
run_memtrain pool-cache.jsonl bs512-f32-cache "--batch-size" 512
run_memtrain pool-cache.jsonl bs512-f32-nocache --batch-size 512 --no-pool-cache

log "pytorch runs"
[ -n "${SKIP_TORCH:-}" ] || for c in "${CONFIGS[@]}"; do
  name=${c%%|*}
  timeout 90 python3 "$here/torch_reference.py" --device cuda --steps "$STEPS" --warmup 5 ${c#*|} \
    > "/tmp/pt-$name.json" 2> "/tmp/pt-$name.log"
  rc=$?
  python3 -c "import json,sys; d=json.load(open('/tmp/pt-$name.json')) if $rc==0 else {'error': open('/tmp/pt-$name.log').read()[-400:]}; d['name']='$name'; d['rc']=$rc; print(json.dumps(d))" >> "$OUT/torch.jsonl"
  log "pytorch $name rc=$rc"
done

log "find-max under 2GiB"
timeout "${SWEEP_LIMIT:-150}" "$BIN/batch_sweep" --find-max --memory-limit 2GiB --precision f32,bf16 --steps 2 \
  --granularity 64 --max-batch 16384 --device cuda --trainer "$BIN/train_cifar10" --quiet --out "$OUT/sweep" \
  > "$OUT/sweep.log" 2>&1
log "sweep rc=$?"
log "done"
