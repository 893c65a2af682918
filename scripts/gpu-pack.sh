#!/usr/bin/env bash
# Build the CUDA binaries here and pack them for a GPU machine that has no Rust toolchain.
#
#   scripts/gpu-pack.sh [PACK_DIR]        (default target-cuda/gpu, ignored by git)
#
# Builds, with `--features cuda,cudnn` and the toolchain of scripts/cuda-toolchain.sh, the
# examples train_cifar10 and batch_sweep and the GPU test binaries that bench/gpu_session.sh runs,
# strips them and writes into PACK_DIR:
#   bins.tar.zst   the binaries, named without cargo's hash (zstd's long window finds what they
#                  share: about 16 MB for ten binaries of about 50 MB each)
#   zstd, lib/     this machine's zstd and the libraries it loads, to unpack them there
#   run.sh         run there from the checkout's root: `PACK_DIR/run.sh OUT_DIR` unpacks the binaries
#                  into /tmp/memtrain-gpu and runs bench/gpu_session.sh on them (its environment,
#                  BUDGET, PHASES, TESTS, ..., passes through).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
pack=$(realpath -m "${1:-$repo/target-cuda/gpu}")
cd "$repo"
command -v zstd >/dev/null || { echo "gpu-pack.sh: needs zstd (apt-get install zstd)" >&2; exit 2; }
scripts/cuda-toolchain.sh >/dev/null
# shellcheck disable=SC1090
source "$HOME/.cache/memtrain/cuda-venv/env.sh"
export CARGO_TARGET_DIR=${MEMTRAIN_CUDA_TARGET:-$(realpath -m "$HOME/.cache/memtrain/target-cuda")}
tests=(gpu_graph gpu_train gpu_memory conv2d pool batchnorm depthwise quantize)
targets=(--example train_cifar10 --example batch_sweep)
for t in "${tests[@]}"; do targets+=(--test "$t"); done
json=$(mktemp)
trap 'rm -f "$json"' EXIT
# Both packages in one build, so that candle-kernels is built once with one feature set.
cargo build --release -p memtrain -p memtrain-kernels --features cuda,cudnn,memtrain-kernels/cudnn \
  "${targets[@]}" --message-format=json-render-diagnostics > "$json"
stage=$(mktemp -d)
trap 'rm -rf "$stage" "$json"' EXIT
mkdir -p "$stage/bin" "$pack/lib"
python3 - "$json" "$stage/bin" <<'EOF'
import json, shutil, sys
seen = set()
for line in open(sys.argv[1]):
    try:
        d = json.loads(line)
    except ValueError:
        continue
    if d.get("reason") == "compiler-artifact" and d.get("executable"):
        name = d["target"]["name"]
        shutil.copy(d["executable"], f"{sys.argv[2]}/{name}")
        seen.add(name)
print(f"packed: {' '.join(sorted(seen))}", file=sys.stderr)
EOF
strip "$stage"/bin/*
tar cf - -C "$stage" bin | zstd -19 --long=30 -T0 -q -f -o "$pack/bins.tar.zst"
cp "$(command -v zstd)" "$pack/zstd"
ldd "$(command -v zstd)" | awk '/=> \//{print $3}' | grep -v -E '/libc\.so|/ld-linux' |
  while read -r l; do cp -L "$l" "$pack/lib/"; done
cat > "$pack/run.sh" <<'EOF'
#!/usr/bin/env bash
# Unpack the binaries of scripts/gpu-pack.sh and run bench/gpu_session.sh on them.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: run.sh OUT_DIR}
bin=/tmp/memtrain-gpu
mkdir -p "$bin"
LD_LIBRARY_PATH="$here/lib" "$here/zstd" -d --long=30 -c "$here/bins.tar.zst" | tar x -C "$bin"
[ -x bench/gpu_session.sh ] || { echo "run.sh: run it from the root of the memtrain checkout" >&2; exit 2; }
exec bench/gpu_session.sh "$bin/bin" "$out"
EOF
chmod +x "$pack/run.sh"
du -sh "$pack" >&2
