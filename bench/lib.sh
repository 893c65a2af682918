# Shared by the bench scripts (sourced, not run). bench/compare_torch.sh and bench/step_memory.sh
# define `bad MESSAGE` (usage error, exit 2), `fail MESSAGE` (one-line error, exit 1), `repo` (the
# repository root), `data_dir` (empty for synthetic data), `threads`, `use_taskset` and
# `timeout_s` before calling the functions that need them.

# Exit 1 with a one-line error unless ../shared/data/cifar10-subset (from the repository root)
# exists: the results WHAT keeps are measured on the real subset.
need_subset() { # what
  [ -d ../shared/data/cifar10-subset ] || {
    echo "error: ../shared/data/cifar10-subset is missing: $1 runs on the real subset" >&2
    exit 1
  }
}

need_value() { # flag, number of remaining args
  [ "$2" -ge 2 ] || bad "$1 needs a value"
}

posint() { # flag value max
  [[ $2 =~ ^[0-9]+$ ]] && [ "${#2}" -le 9 ] && [ "$2" -ge 1 ] && [ "$2" -le "$3" ] ||
    bad "$1 must be a whole number from 1 to $3, got '$2'"
}

# PyTorch from ${TORCH_VENV:-$HOME/.cache/memtrain/torch-venv}, created with torch and numpy from
# PyPI when `import torch` fails there. Sets `py` (its python) and `torch_version`.
setup_torch() {
  local venv=${TORCH_VENV:-$HOME/.cache/memtrain/torch-venv} err
  py="$venv/bin/python"
  if ! "$py" -c 'import torch' >/dev/null 2>&1; then
    echo "== PyTorch not importable from $venv: setting it up (pip install torch numpy from PyPI; a large download)"
    if [ ! -x "$py" ]; then
      command -v python3 >/dev/null || fail "python3 not found; install Python 3 (with venv) or set TORCH_VENV to a venv with torch"
      python3 -m venv "$venv" ||
        fail "python3 -m venv $venv failed; install the venv module (e.g. apt-get install python3-venv) or set TORCH_VENV"
    fi
    # The Linux wheel needs its nvidia-* dependency wheels even to import on the CPU: no --no-deps.
    "$py" -m pip install --upgrade torch numpy ||
      fail "pip install torch numpy into $venv failed; check network access to PyPI or set TORCH_VENV to a venv with torch"
    err=$("$py" -c 'import torch' 2>&1 | tail -n 1) ||
      fail "torch is installed in $venv but does not import: $err"
  fi
  "$py" -c 'import numpy' >/dev/null 2>&1 || [ -z "$data_dir" ] ||
    fail "numpy is missing in $venv (torch_reference.py needs it to read CIFAR files); run: $py -m pip install numpy"
  torch_version=$("$py" -c 'import torch; print(torch.__version__)')
}

# A run-reading script's checks: --data-dir (when given) is a directory, and python3 is there to
# read the runs' summary.json.
check_data_dir_and_python() { # data_dir
  [ -z "$1" ] || [ -d "$1" ] || fail "--data-dir $1 is not a directory"
  command -v python3 >/dev/null || fail "python3 not found (used to read summary.json)"
}

# `cargo build --release --example train_cifar10` with ${CARGO:-cargo} (CARGO=true runs whatever
# binary is there). Sets `cargo`, `target_dir` and `bin`. Needs `py` (for cargo metadata's JSON).
build_memtrain() {
  local build_log
  cargo=${CARGO:-cargo}
  echo "== building memtrain (cargo build --release --example train_cifar10; waits for a busy cargo lock)"
  build_log=$(mktemp "${TMPDIR:-/tmp}/memtrain-build.XXXXXX")
  if ! (cd "$repo" && $cargo build --release --example train_cifar10) >"$build_log" 2>&1; then
    tail -n 30 "$build_log" >&2
    fail "cargo build --release --example train_cifar10 failed (log above, full log in $build_log)"
  fi
  rm -f "$build_log"
  target_dir=$(cd "$repo" && $cargo metadata --no-deps --format-version 1 2>/dev/null |
    "$py" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null) ||
    target_dir="$repo/target"
  bin="$target_dir/release/examples/train_cifar10"
  [ -x "$bin" ] || fail "$bin was not built"
}

# Pin both frameworks to the same first `threads` CPUs this process may use (when `use_taskset`
# is 1 and taskset exists) and give both the same thread counts. Sets `pin` (a command prefix),
# `pin_note`, `thread_env` (VAR=value words for env) and `limit` (a timeout prefix of
# `timeout_s` seconds when timeout exists).
pin_cpus() {
  local allowed parts p c list
  pin=()
  pin_note="not pinned"
  if [ "$use_taskset" = 1 ] && command -v taskset >/dev/null; then
    # The first T CPUs this process may run on (a container's CPU set need not start at 0).
    allowed=$(taskset -pc $$ 2>/dev/null | sed 's/.*: *//') || allowed=""
    local cpus=()
    IFS=',' read -r -a parts <<<"$allowed"
    for p in "${parts[@]}"; do
      if [[ $p =~ ^([0-9]+)-([0-9]+)$ ]]; then
        for ((c = BASH_REMATCH[1]; c <= BASH_REMATCH[2]; c++)); do cpus+=("$c"); done
      elif [[ $p =~ ^[0-9]+$ ]]; then
        cpus+=("$p")
      fi
    done
    if [ ${#cpus[@]} -ge "$threads" ]; then
      list=$(IFS=,; echo "${cpus[*]:0:$threads}")
      if taskset -c "$list" true 2>/dev/null; then
        pin=(taskset -c "$list")
        pin_note="taskset -c $list"
      fi
    fi
  fi
  thread_env=(RAYON_NUM_THREADS="$threads" CANDLE_NUM_THREADS="$threads"
    OMP_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads")
  limit=()
  if command -v timeout >/dev/null; then limit=(timeout "$timeout_s"); fi
}
