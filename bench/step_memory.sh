#!/usr/bin/env bash
# The heap memory one training step adds, memtrain against PyTorch on the CPU: same network, batch,
# precision, data and threads, for a plain step and for checkpointed steps, in one invocation.
#
#   bench/step_memory.sh [--configs plain,stages,blocks] [--batch-size B] [--width W]
#                        [--precision f32|f16|bf16] [--steps S] [--threads T]
#                        [--data-dir DIR | --synthetic] [--out FILE] [--cross-check]
#                        [--timeout SECS] [--no-taskset] [--keep]
#
# What is measured: the step-added peak, i.e. the highest heap bytes in use during one optimizer
# step minus the heap bytes in use when that step began. It is what a step needs on top of what the
# process already holds (parameters, optimizer state, the data set), so it is comparable between
# two processes whose fixed parts (a Python interpreter and libtorch against a Rust binary) differ.
# Beside it, the peak above the pre-training heap: the step's peak minus the heap before the first
# step (data, model and optimizer built; no gradient, momentum or batch buffer yet: memtrain's
# summary.json baseline_bytes, torch_reference.py's pretrain_bytes). It also counts what sits
# between steps (gradients, momentum, batches prepared ahead). The "counted ratio" takes the larger
# of the two figures on each side (issue 23's measure).
#
# memtrain: its counting global allocator (core/src/memory/cpu.rs) counts the bytes every allocation
# asks for, exactly; batches.csv has start_bytes (at the step's start, just before the input
# tensor is built from the batch) and peak_bytes (the step's high-water mark through the optimizer
# update) per step. PyTorch: bench/malloc_count.c, an LD_PRELOAD shim around glibc's malloc family,
# counts requested bytes the same way (realloc as alloc-new-then-free-old, as memtrain does), and
# bench/torch_reference.py --step-memory reads it at the same points: the step starts when the
# batch exists as a slice of the data set and the previous gradients are freed
# (zero_grad(set_to_none=True)), the input tensors are copied from it inside the step (as
# memtrain's Tensor::from_slice copies), and the step ends after optimizer.step(). Each side runs
# S steps in one process; the figure is the median step-added peak of the steps after the first 2
# (warm-up: lazily created momentum buffers, first-call caches); the maximum is reported too, and
# every step's values go into the JSON. Both sides train on the same images without augmentation.
# memtrain's data loader reuses its batch buffers (data::BufferPool), so no batch is allocated
# while a step runs and the figure repeats step to step.
# Checkpointing: memtrain's stages/blocks recompute every segment (three stages / six blocks), the
# head outside; torch_reference.py wraps each segment in torch.utils.checkpoint.checkpoint
# (use_reentrant=False) the same way.
#
# --cross-check runs memtrain once more (plain) under the shim and compares the shim's whole-process
# peak with memtrain's own summary.json peak_bytes: memtrain's allocator sits on top of malloc, so
# the two must agree closely if the shim counts what memtrain's allocator counts.
#
# PyTorch runs from the virtual environment ${TORCH_VENV:-$HOME/.cache/memtrain/torch-venv} (created
# with torch and numpy from PyPI when `import torch` fails there, as bench/compare_torch.sh does);
# memtrain is built with `cargo build --release --example train_cifar10`; the shim with gcc into
# the target directory (target/bench/). Runs go one at a time, pinned to the same T CPUs.
#
# Exit status: 0 on success, 2 for a bad flag, 1 when a setup step or a run fails.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
  echo
  cat <<'EOF'
Flags (defaults in brackets):
  --configs LIST     comma-separated checkpointing configs: plain, stages, blocks [plain,stages]
  --batch-size B     images per optimizer step [128]
  --width W          base width of the CNN [32]
  --precision P      f32, f16 or bf16 [f32]
  --steps S          optimizer steps per run, at least 3; the first 2 are warm-up [6]
  --threads T        threads for both [min(2, nproc)]: RAYON_NUM_THREADS/CANDLE_NUM_THREADS for
                     memtrain, OMP_NUM_THREADS/MKL_NUM_THREADS and torch.set_num_threads for
                     PyTorch; both are also pinned to the same T CPUs with taskset when it exists
  --data-dir DIR     CIFAR-10 binary dir (data_batch_*.bin) for both
                     [../shared/data/cifar10-subset when present, else synthetic data]
  --synthetic        synthetic/random images even when the default data dir exists
  --out FILE         also write the result as JSON to FILE (atomically)
  --cross-check      also run memtrain (plain) under the shim and compare whole-process peaks
  --timeout SECS     limit for each single run [900]
  --no-taskset       do not pin the processes to CPUs
  --keep             keep the temporary run directory (logs, batches.csv, JSON)
  -h, --help         this text
Environment: TORCH_VENV (PyTorch virtual environment), CARGO (cargo command), CC (C compiler, gcc).
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

threads=$((ncpu < 2 ? ncpu : 2)) batch=128 width=32 precision=f32 steps=6 configs=plain,stages
data_dir="" synthetic=0 out="" cross_check=0 timeout_s=900 use_taskset=1 keep=0
warmup=2

while [ $# -gt 0 ]; do
  flag=$1
  val=""
  has_inline=0
  case $flag in
    --*=*) val=${flag#*=}; flag=${flag%%=*}; has_inline=1 ;;
  esac
  case $flag in
    -h|--help) usage; exit 0 ;;
    --synthetic|--no-taskset|--keep|--cross-check)
      [ $has_inline = 0 ] || bad "$flag takes no value"
      case $flag in
        --synthetic) synthetic=1 ;;
        --no-taskset) use_taskset=0 ;;
        --keep) keep=1 ;;
        --cross-check) cross_check=1 ;;
      esac
      shift
      continue
      ;;
    --configs|--threads|--batch-size|--width|--precision|--steps|--data-dir|--out|--timeout)
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
    --configs) configs=$val ;;
    --threads) threads=$val ;;
    --batch-size) batch=$val ;;
    --width) width=$val ;;
    --precision) precision=$val ;;
    --steps) steps=$val ;;
    --data-dir) data_dir=$val; [ -n "$val" ] || bad "--data-dir needs a directory" ;;
    --out) out=$val; [ -n "$val" ] || bad "--out needs a file name" ;;
    --timeout) timeout_s=$val ;;
  esac
done

posint --threads "$threads" 4096
posint --batch-size "$batch" 1048576
posint --width "$width" 4096
posint --steps "$steps" 100000
posint --timeout "$timeout_s" 86400
threads=$((10#$threads)) batch=$((10#$batch)) width=$((10#$width)) steps=$((10#$steps))
timeout_s=$((10#$timeout_s))
[ "$steps" -gt $warmup ] || bad "--steps must be at least $((warmup + 1)) (the first $warmup steps are warm-up), got $steps"
case $precision in f32|f16|bf16) ;; *) bad "--precision must be f32, f16 or bf16, got '$precision'" ;; esac
config_list=()
IFS=',' read -r -a parts <<<"$configs"
for c in "${parts[@]}"; do
  case $c in
    plain|stages|blocks) ;;
    *) bad "--configs takes plain, stages and blocks separated by commas, got '$configs'" ;;
  esac
  for d in "${config_list[@]}"; do [ "$d" != "$c" ] || bad "--configs lists '$c' twice"; done
  config_list+=("$c")
done
[ ${#config_list[@]} -ge 1 ] || bad "--configs needs at least one of plain, stages, blocks"
[ "$threads" -le "$ncpu" ] ||
  echo "warning: --threads $threads is more than the $ncpu CPUs here; runs will be oversubscribed" >&2

has_cifar() { # dir: true when it holds CIFAR-10 binary training files
  local f
  for f in "$1"/data_batch_*.bin; do [ -f "$f" ] && return 0; done
  return 1
}
default_data="$repo/../shared/data/cifar10-subset"
data_note=""
if [ -n "$data_dir" ]; then
  [ $synthetic = 0 ] || bad "--data-dir and --synthetic exclude each other; give one"
  [ -d "$data_dir" ] || bad "--data-dir '$data_dir' is not a directory"
  has_cifar "$data_dir" ||
    bad "--data-dir '$data_dir' has no data_batch_*.bin (CIFAR-10 binary version); point it at one or use --synthetic"
  data_dir=$(cd "$data_dir" && pwd)
elif [ $synthetic = 0 ]; then
  if [ -d "$default_data" ] && has_cifar "$default_data"; then
    data_dir=$(cd "$default_data" && pwd)
  else
    echo "note: no CIFAR-10 files in $default_data; using synthetic images (give --data-dir DIR for real ones)"
  fi
fi
if [ -n "$out" ]; then
  [ ! -d "$out" ] || bad "--out '$out' is a directory; give a file name"
  out_dir=$(dirname -- "$out")
  [ -d "$out_dir" ] && [ -w "$out_dir" ] || bad "--out: directory '$out_dir' does not exist or is not writable"
fi

# ---- PyTorch and memtrain (bench/lib.sh) ------------------------------------------------------
setup_torch
build_memtrain

cc=${CC:-gcc}
command -v "$cc" >/dev/null || fail "C compiler '$cc' not found (needed for bench/malloc_count.c); install gcc or set CC"
mkdir -p "$target_dir/bench"
shim="$target_dir/bench/libmalloc_count.so"
if [ ! -f "$shim" ] || [ "$repo/bench/malloc_count.c" -nt "$shim" ]; then
  shim_tmp=$(mktemp "$target_dir/bench/.libmalloc_count.XXXXXX")
  "$cc" -O2 -Wall -shared -fPIC -o "$shim_tmp" "$repo/bench/malloc_count.c" ||
    { rm -f "$shim_tmp"; fail "$cc could not build bench/malloc_count.c (glibc on Linux is required)"; }
  mv -f "$shim_tmp" "$shim"
fi
LD_PRELOAD="$shim" MC_REPORT=/dev/null true ||
  fail "$shim does not preload (the shim needs glibc)"

# ---- environment shared by both ----------------------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/tmp}/memtrain-step-memory.XXXXXX")
cleanup() {
  if [ $keep = 1 ]; then echo "run files kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'keep=1; exit 130' INT TERM

pin_cpus

if [ -n "$data_dir" ]; then
  data_note="CIFAR-10 files in $data_dir (no augmentation on either side)"
  mt_data=(--data-dir "$data_dir" --no-augment)
  torch_data=(--data-dir "$data_dir")
else
  data_note="synthetic images (memtrain: its built-in synthetic set; PyTorch: torch.randn), no augmentation"
  # Runs start in the empty work dir so memtrain's default data/cifar-10-batches-bin is never used.
  n_synth=$((batch * 4))
  [ $n_synth -ge 10 ] || n_synth=10
  mt_data=(--synthetic-train $n_synth --synthetic-test 10 --no-augment)
  torch_data=()
fi

echo "== step-added heap peak, memtrain vs PyTorch $torch_version on the CPU: batch $batch, width $width, $precision, $threads threads ($pin_note)"
echo "   data: $data_note"
echo "   each run: $steps steps; figure: median (and max) of peak - start over steps $((warmup + 1))..$steps"

quote() { printf '%q ' "$@" | sed 's/ $//'; }
run_failed() { # what, exit status, log: keep the run dir, show the log, exit 1
  keep=1
  tail -n 20 "$3" >&2
  [ "$2" != 124 ] || fail "$1 took longer than --timeout $timeout_s s"
  fail "$1 failed (exit $2; log above, in $3)"
}

run_memtrain() { # name checkpoint [preload report file]
  local name=$1 ckpt=$2 report=${3:-} dir="$work/memtrain-$1" log="$work/memtrain-$1.log" rc=0
  local pre=()
  [ -z "$report" ] || pre=(LD_PRELOAD="$shim" MC_REPORT="$report")
  local cmd=("${limit[@]}" "${pin[@]}" env "${thread_env[@]}" "${pre[@]}" "$bin"
    --device cpu --max-steps "$steps" --epochs "$steps" --no-eval --quiet --out "$dir"
    --batch-size "$batch" --width "$width" --precision "$precision" --checkpoint "$ckpt"
    "${mt_data[@]}")
  quote "${cmd[@]}" >"$work/memtrain-$name.cmd"
  (cd "$work" && "${cmd[@]}") >"$log" 2>&1 || rc=$?
  [ $rc = 0 ] || run_failed "memtrain ($name)" "$rc" "$log"
  [ -f "$dir/batches.csv" ] && [ -f "$dir/summary.json" ] ||
    { keep=1; fail "memtrain ($name) wrote no batches.csv/summary.json in $dir (see $log)"; }
}

run_torch() { # name checkpoint
  local name=$1 ckpt=$2 log="$work/torch-$1.log" rc=0
  local cmd=("${limit[@]}" "${pin[@]}" env "${thread_env[@]}" LD_PRELOAD="$shim" "$py"
    "$repo/bench/torch_reference.py" --device cpu --threads "$threads" --batch-size "$batch"
    --width "$width" --precision "$precision" --checkpoint "$ckpt" --steps $((steps - warmup))
    --warmup $warmup --step-memory "${torch_data[@]}")
  quote "${cmd[@]}" >"$work/torch-$name.cmd"
  (cd "$work" && "${cmd[@]}") >"$work/torch-$name.json" 2>"$log" || rc=$?
  [ $rc = 0 ] || run_failed "PyTorch ($name)" "$rc" "$log"
}

for c in "${config_list[@]}"; do
  case $c in plain) ckpt=none ;; *) ckpt=$c ;; esac
  echo "   $c: memtrain ..."
  run_memtrain "$c" "$ckpt"
  echo "   $c: PyTorch ..."
  run_torch "$c" "$ckpt"
done
if [ $cross_check = 1 ]; then
  echo "   cross-check: memtrain (plain) under the shim ..."
  run_memtrain crosscheck none "$work/crosscheck.report"
  [ -s "$work/crosscheck.report" ] || { keep=1; fail "the shim wrote no report for the cross-check run"; }
fi

# ---- result ------------------------------------------------------------------------------------
mt_version=$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$repo/Cargo.toml" | head -n 1)
candle_version=$(grep -A1 '^name = "candle-core"' "$repo/Cargo.lock" 2>/dev/null |
  sed -n 's/^version *= *"\(.*\)"/\1/p' | head -n 1) || candle_version=""
commit=$(git -C "$repo" rev-parse HEAD 2>/dev/null) || commit=unknown
dirty=$(git -C "$repo" status --porcelain -- src examples Cargo.toml Cargo.lock 2>/dev/null | wc -l) || dirty=0
rustc_version=$(rustc --version 2>/dev/null) || rustc_version=""
cc_version=$("$cc" --version 2>/dev/null | head -n 1) || cc_version=""
glibc_version=$(ldd --version 2>/dev/null | head -n 1) || glibc_version=""
tmp_result="$work/result.json"
WORK=$work CONFIGS="${config_list[*]}" WARMUP=$warmup STEPS=$steps THREADS=$threads PIN="$pin_note" \
  BATCH=$batch WIDTH=$width PRECISION=$precision DATA="$data_note" MT_VERSION="$mt_version" \
  CANDLE_VERSION="$candle_version" PT_VERSION="$torch_version" COMMIT="$commit" DIRTY="$dirty" \
  RUSTC="$rustc_version" CC_VERSION="$cc_version" GLIBC="$glibc_version" SHIM="$shim" \
  CROSS=$cross_check "$py" - "$tmp_result" <<'PY'
import csv, json, os, statistics, sys

e = os.environ
work, warmup = e["WORK"], int(e["WARMUP"])
MIB = 1 << 20


TRACE_BYTES = (1 << 20) * 24


def memtrain_steps(name):
    with open(os.path.join(work, f"memtrain-{name}", "batches.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    need = {"global_step", "start_bytes", "peak_bytes", "end_bytes"}
    if not rows or not need <= set(rows[0]):
        sys.exit(f"error: memtrain-{name}/batches.csv lacks the columns {sorted(need)}")
    return [{"step": int(r["global_step"]), "timed": int(r["global_step"]) >= warmup,
             "start_bytes": int(r["start_bytes"]), "peak_bytes": int(r["peak_bytes"]),
             "end_bytes": int(r["end_bytes"])} for r in rows]


def torch_result(name):
    lines = [l for l in open(os.path.join(work, f"torch-{name}.json")) if l.strip().startswith("{")]
    if not lines:
        sys.exit(f"error: torch_reference.py printed no JSON for {name} (see {work}/torch-{name}.log)")
    return json.loads(lines[-1])


def figures(steps, pretrain):
    added = [s["peak_bytes"] - s["start_bytes"] for s in steps if s["timed"]]
    if not added:
        sys.exit("error: a run recorded no step after the warm-up steps")
    above = [s["peak_bytes"] - pretrain for s in steps if s["timed"]]
    counted = max(int(statistics.median(added)), int(statistics.median(above)))
    return {"step_added_median_bytes": int(statistics.median(added)),
            "pretrain_bytes": pretrain,
            "above_pretrain_median_bytes": int(statistics.median(above)),
            "counted_bytes": counted,
            "step_added_min_bytes": min(added),
            "step_added_max_bytes": max(added),
            "step_added_bytes": [s["peak_bytes"] - s["start_bytes"] for s in steps],
            "steps": steps}


def cmd(name):
    return open(os.path.join(work, name)).read().strip()


res = {
    "what": "step-added heap peak: max live heap bytes during one optimizer step minus live heap "
            "bytes when it began; median over the steps after the warm-up steps",
    "device": "cpu", "threads": int(e["THREADS"]), "pinning": e["PIN"],
    "batch_size": int(e["BATCH"]), "width": int(e["WIDTH"]), "precision": e["PRECISION"],
    "data": e["DATA"], "steps_per_run": int(e["STEPS"]), "warmup_steps": warmup,
    "git_commit": e["COMMIT"], "git_dirty_paths": int(e["DIRTY"] or 0),
    "versions": {"memtrain": e["MT_VERSION"], "candle_core": e["CANDLE_VERSION"],
                 "pytorch": e["PT_VERSION"], "rustc": e["RUSTC"], "cc": e["CC_VERSION"],
                 "glibc": e["GLIBC"]},
    "memtrain_counter": "memtrain's counting global allocator (batches.csv start_bytes, peak_bytes)",
    "pytorch_counter": f"bench/malloc_count.c LD_PRELOAD shim ({e['SHIM']}): requested bytes",
    "configs": {},
}
rows = []
for name in e["CONFIGS"].split():
    summary = json.load(open(os.path.join(work, f"memtrain-{name}", "summary.json")))
    mt = figures(memtrain_steps(name), summary["baseline_bytes"])
    tr = torch_result(name)
    sm = tr.get("step_memory")
    if not sm or "pretrain_bytes" not in sm:
        sys.exit(f"error: torch_reference.py's output for {name} has no step_memory with pretrain_bytes")
    pt = figures(sm["steps"], sm["pretrain_bytes"])
    pt["process_peak_bytes"] = sm.get("process_peak_bytes")
    pt["unknown_frees"] = sm.get("unknown_frees")
    pt["threads"] = tr.get("threads")
    mt["command"] = cmd(f"memtrain-{name}.cmd")
    pt["command"] = cmd(f"torch-{name}.cmd")
    ratio = mt["step_added_median_bytes"] / pt["step_added_median_bytes"]
    counted_ratio = mt["counted_bytes"] / pt["counted_bytes"]
    res["configs"][name] = {"checkpoint": "none" if name == "plain" else name,
                            "memtrain": mt, "pytorch": pt, "ratio_memtrain_over_pytorch": ratio,
                            "counted_ratio_memtrain_over_pytorch": counted_ratio}
    rows.append((name, mt, pt, ratio, counted_ratio))
if e["CROSS"] == "1":
    peak, cur, allocs, unknown = (int(v) for v in open(os.path.join(work, "crosscheck.report")).read().split())
    s = json.load(open(os.path.join(work, "memtrain-crosscheck", "summary.json")))
    own = s["peak_bytes"]
    res["cross_check"] = {
        "what": "memtrain (plain) under the shim: the shim's whole-process peak vs memtrain's own "
                "summary.json peak_bytes",
        "command": cmd("memtrain-crosscheck.cmd"),
        "shim_peak_bytes": peak, "memtrain_peak_bytes": own,
        "difference_pct": 100.0 * (peak - own) / own,
        # memtrain's allocation trace (memory_snapshot.pickle, core/src/memory/trace.rs: CAPACITY = 2^20
        # entries of 24 bytes) comes from the System allocator, which the shim sees and memtrain's
        # counter by design does not.
        "trace_buffer_bytes": TRACE_BYTES,
        "difference_without_trace_pct": 100.0 * (peak - TRACE_BYTES - own) / own,
        "shim_allocations": allocs, "shim_unknown_frees": unknown,
    }
with open(sys.argv[1], "w") as f:
    json.dump(res, f, indent=2)
    f.write("\n")

mib = lambda b: f"{b / MIB:.1f}"
print()
span = lambda r: f"{mib(r['step_added_min_bytes'])}-{mib(r['step_added_max_bytes'])}"
print("| config | memtrain MiB | PyTorch MiB | ratio memtrain/PyTorch | memtrain min-max MiB | PyTorch min-max MiB "
      "| memtrain above pre-training MiB | PyTorch above pre-training MiB | counted ratio |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for name, mt, pt, ratio, counted in rows:
    print(f"| {name} | {mib(mt['step_added_median_bytes'])} | {mib(pt['step_added_median_bytes'])} "
          f"| {ratio:.2f} | {span(mt)} | {span(pt)} | {mib(mt['above_pretrain_median_bytes'])} "
          f"| {mib(pt['above_pretrain_median_bytes'])} | {counted:.2f} |")
print()
print("above pre-training: the step's peak minus the heap before training began (data, model and "
      "optimizer built; memtrain's baseline_bytes); counted ratio: the larger of the two figures "
      "on each side, memtrain over PyTorch")
n = int(e["STEPS"]) - warmup
print(f"MiB: step-added heap peak (peak - start of the step), median of {n} step(s) after {warmup} "
      f"warm-up steps; memtrain {e['MT_VERSION']} (Candle {e['CANDLE_VERSION']}, commit "
      f"{e['COMMIT'][:10]}{', src modified' if int(e['DIRTY'] or 0) else ''}), PyTorch {e['PT_VERSION']}")
if e["CROSS"] == "1":
    c = res["cross_check"]
    print(f"cross-check (memtrain plain under the shim): shim whole-process peak {mib(c['shim_peak_bytes'])} MiB, "
          f"memtrain's own peak_bytes {mib(c['memtrain_peak_bytes'])} MiB ({c['difference_pct']:+.2f}%; "
          f"{c['difference_without_trace_pct']:+.2f}% without the {mib(TRACE_BYTES)} MiB allocation-trace "
          f"buffer memtrain takes from the System allocator)")
PY

if [ -n "$out" ]; then
  tmp=$(mktemp "$(dirname -- "$out")/.$(basename -- "$out").XXXXXX")
  cp "$tmp_result" "$tmp"
  chmod "$(printf '%o' $((0666 & ~0$(umask))))" "$tmp"
  mv -f "$tmp" "$out"
  echo "result written to $out"
fi
