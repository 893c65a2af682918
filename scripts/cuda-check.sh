#!/usr/bin/env bash
# Type-check memtrain and memtrain-kernels (the whole workspace) with the `cuda` feature, and with
# `cuda,cudnn`, on a machine without a GPU.
# Called by CI (.ci/run); also fine to run by hand.
#
#   scripts/cuda-check.sh [extra cargo args...]
#
# Uses the pip CUDA 13.0 toolchain from scripts/cuda-toolchain.sh and a target
# dir outside the clone (MEMTRAIN_CUDA_TARGET, default ~/.cache/memtrain/target-cuda)
# so repeated runs are incremental. `--release` on purpose: it shares the
# candle-kernels build-script output (nvcc, ~25 min cold on 2 cores) with
# `cargo build --release --features cuda`; a dev-profile check would compile all
# kernels again in target-cuda/debug.
set -euo pipefail

start=$(date +%s)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)

export MEMTRAIN_CUDA_TARGET="${MEMTRAIN_CUDA_TARGET:-$HOME/.cache/memtrain/target-cuda}"
env_file=$(mktemp)
trap 'rm -f "$env_file"' EXIT
"$here/cuda-toolchain.sh" --print-env > "$env_file"
# shellcheck disable=SC1090
source "$env_file"
# Canonical spelling (see cuda-toolchain.sh): the nvcc cache is keyed by absolute OUT_DIR.
export CARGO_TARGET_DIR
CARGO_TARGET_DIR=$(realpath -m "$MEMTRAIN_CUDA_TARGET")
# Cold builds: let candle-kernels' nvcc use every core (cudaforge defaults to 50%).
# Not part of any fingerprint, so it never triggers a rebuild.
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"

echo "[cuda-check] CARGO_TARGET_DIR=$CARGO_TARGET_DIR CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP" >&2
cd "$repo"
rc=0
# Every CUDA kernel of the ops lives in kernels/cu/*.cu and is compiled to PTX here too:
# NVRTC compiles them only at run time, on a GPU machine, so a syntax error would otherwise first
# show there. Each is compiled after kernels/cu/prelude.cuh, as `kernel_source!` in
# kernels/src/util.rs concatenates them for NVRTC.
kernel_tmp=$(mktemp -d)
trap 'rm -f "$env_file"; rm -rf "$kernel_tmp"' EXIT
for cu in kernels/cu/*.cu; do
  cat kernels/cu/prelude.cuh "$cu" > "$kernel_tmp/$(basename "$cu")"
  if nvcc --ptx -arch="sm_$CUDA_COMPUTE_CAP" "$kernel_tmp/$(basename "$cu")" -o /dev/null; then
    echo "[cuda-check] nvcc compiled $cu" >&2
  else
    echo "[cuda-check] nvcc rejected $cu" >&2
    rc=1
  fi
done
# --workspace: the kernels crate's own tests and benches too (`--features` names the feature of
# every package that has it).
cargo check --release --workspace --features cuda --all-targets "$@" || rc=$?
echo "[cuda-check] cargo check --release --workspace --features cuda --all-targets: rc=$rc, elapsed $(( $(date +%s) - start ))s" >&2
# The cuDNN convolutions (kernels/src/conv2d_cudnn.rs) exist only with `cudnn`; a second check with
# it (its own artifacts for cudarc and the crates above it in the same target dir, so both stay
# incremental; candle-kernels' nvcc build is shared).
cargo check --release --workspace --features cuda,cudnn --all-targets "$@" || rc=$?
echo "[cuda-check] cargo check --release --workspace --features cuda,cudnn --all-targets: rc=$rc, elapsed $(( $(date +%s) - start ))s" >&2
exit "$rc"
