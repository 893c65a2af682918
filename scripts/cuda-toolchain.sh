#!/usr/bin/env bash
# Install a pip-based CUDA 13.0 toolchain so `cargo build/check --features cuda`
# (and `--features cuda,cudnn`) works on a machine WITHOUT a GPU or a system CUDA
# install (e.g. the 2-core build box). The resulting binaries are run on the H100
# box (driver 580).
#
# Usage:
#   scripts/cuda-toolchain.sh              # install (if needed), verify, print env
#   scripts/cuda-toolchain.sh --print-env  # same, but only the env lines go to stdout
#   eval "$(scripts/cuda-toolchain.sh --print-env)"   # or: source "$VENV/env.sh"
#   scripts/cuda-toolchain.sh --find-libcuda  # print the driver's libcuda it would link (exit 1: none)
#
# Knobs (environment):
#   MEMTRAIN_CUDA_VENV    venv location (default ~/.cache/memtrain/cuda-venv, outside
#                         any clone so CI and several clones share it)
#   MEMTRAIN_CUDA_TARGET  suggested CARGO_TARGET_DIR for CUDA builds
#                         (default ~/.cache/memtrain/target-cuda)
#   MEMTRAIN_CUDA_PYTHON  python used to create the venv (default python3)
#   MEMTRAIN_LIBCUDA_SO   use this libcuda.so(.1) for linking instead of the system
#                         one / the Debian `libcuda1` download
#   CUDA_COMPUTE_CAP      GPU arch for candle-kernels (default 90 = H100, sm_90a)
#
# Idempotent: a second run only re-checks links and nvcc (well under a second).
set -euo pipefail

log() { printf '[cuda-toolchain] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

PRINT_ENV_ONLY=0
case "${1:-}" in
  --print-env) PRINT_ENV_ONLY=1 ;;
  --find-libcuda) PRINT_ENV_ONLY=2 ;;
  -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
  "") ;;
  *) die "unknown argument: $1 (try --help)" ;;
esac

VENV="${MEMTRAIN_CUDA_VENV:-$HOME/.cache/memtrain/cuda-venv}"
TARGET_SUGGESTION="${MEMTRAIN_CUDA_TARGET:-$HOME/.cache/memtrain/target-cuda}"
# Canonical path: build-script outputs (candle-kernels' nvcc cache keys) embed the
# absolute OUT_DIR, so every user of the cache must spell the directory the same way.
TARGET_SUGGESTION=$(realpath -m "$TARGET_SUGGESTION")
PYTHON="${MEMTRAIN_CUDA_PYTHON:-python3}"

# 13.0 on purpose: the target driver (580) is CUDA 13.0; a newer nvcc emits PTX
# (ISA version) that driver rejects at module-load time.
PIP_PKGS=(
  'nvidia-cuda-nvcc==13.0.88'
  'nvidia-cuda-runtime==13.0.*'
  'nvidia-cuda-crt==13.0.*'
  'nvidia-cuda-cccl==13.0.*'
  'nvidia-nvvm==13.0.*'
  'nvidia-cublas==13.0.*'
  'nvidia-curand==10.4.0.*'
  'nvidia-cuda-nvrtc==13.0.*'
  # cuDNN for `--features cudnn` (kernels/src/conv2d_cudnn.rs): 9.13 is the first cuDNN release
  # built for CUDA 13.0. ~350 MB; its libcudnn.so.9 also goes on LD_LIBRARY_PATH at run time.
  'nvidia-cudnn-cu13==9.13.*'
)
# Bump when the recipe changes so existing venvs are refreshed.
STAMP_CONTENT="recipe-v2 ${PIP_PKGS[*]}"
STAMP="$VENV/.memtrain-cuda-toolchain"

mkdir -p "$(dirname "$VENV")"
# Serialize concurrent runs (CI + a colleague) on the same venv.
exec 9>"$VENV.lock"
if command -v flock >/dev/null 2>&1; then flock 9; fi

# ---------------------------------------------------------------- 1. pip venv
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_CONTENT" && -x "$VENV/bin/python" ]]; then
  :
else
  log "installing CUDA 13.0 pip packages into $VENV (one-off, ~1.5 GB)"
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "${PIP_PKGS[@]}" >&2
  rm -f "$VENV/env.sh"
fi

shopt -s nullglob
cands=("$VENV"/lib/python3*/site-packages/nvidia/cu13)
shopt -u nullglob
(( ${#cands[@]} == 1 )) || die "expected exactly one site-packages/nvidia/cu13 under $VENV, found ${#cands[@]}"
CUDA_ROOT_DIR="${cands[0]}"
LIB="$CUDA_ROOT_DIR/lib"
[[ -x "$CUDA_ROOT_DIR/bin/nvcc" ]] || die "nvcc missing in $CUDA_ROOT_DIR/bin (broken install? rm -rf $VENV and re-run)"

# ------------------------------------------ 2a. unversioned .so links for -lX
# cudarc (dynamic-linking) links -lcuda -lnvrtc -lcurand -lcublas -lcublasLt;
# candle-kernels links -lcudart (+ its own static libmoe.a). The wheels only
# ship versioned sonames (libcublas.so.13, ...), so `ld -lcublas` needs these.
link_unversioned() { # name
  local name=$1 f
  [[ -e "$LIB/lib$name.so" ]] && return 0
  shopt -s nullglob
  local matches=("$LIB"/lib"$name".so.[0-9]*)
  shopt -u nullglob
  (( ${#matches[@]} >= 1 )) || die "no $LIB/lib$name.so.* (missing pip package?)"
  f=$(basename "${matches[0]}")
  ln -sfn "$f" "$LIB/lib$name.so"
  log "linked lib$name.so -> $f"
}
for n in cudart cublas cublasLt nvrtc curand nvrtc-builtins; do link_unversioned "$n"; done

# cuDNN's wheel keeps its libraries in its own folder (libcudnn.so.9 loads its sub-libraries,
# libcudnn_cnn.so.9 and friends, from the same place); cudarc's `cudnn` feature links -lcudnn.
# Named MEMTRAIN_CUDNN_LIB, not CUDNN_LIB: cudarc's build script re-runs when CUDNN_LIB changes.
shopt -s nullglob
cudnn_cands=("$VENV"/lib/python3*/site-packages/nvidia/cudnn/lib/libcudnn.so.9)
shopt -u nullglob
(( ${#cudnn_cands[@]} >= 1 )) || die "no libcudnn.so.9 under $VENV (nvidia-cudnn-cu13 missing? rm $STAMP and re-run)"
CUDNN_LIB_DIR=$(dirname "${cudnn_cands[0]}")
if [[ ! -e "$CUDNN_LIB_DIR/libcudnn.so" ]]; then
  ln -sfn libcudnn.so.9 "$CUDNN_LIB_DIR/libcudnn.so"
  log "linked libcudnn.so -> libcudnn.so.9 in $CUDNN_LIB_DIR"
fi

# -------------------------------------- 2b. libcuda.so (driver API) for linking
# Only needed at link time here; at run time the GPU box's driver libcuda.so.1
# is used (the binary records DT_NEEDED libcuda.so.1, nothing else).
LIBCUDA_DIR="$VENV/libcuda-link-only"
have_libcuda() { [[ -e "$LIB/libcuda.so" && -e "$LIB/libcuda.so.1" ]]; }
install_libcuda_link() { # path-to-real-libcuda
  local real
  real=$(readlink -f "$1")
  ln -sfn "$real" "$LIB/libcuda.so.1"
  ln -sfn "$real" "$LIB/libcuda.so"
  log "linked libcuda.so{,.1} -> $real"
}
# The driver's libcuda: in the linker cache, else where drivers are mounted without one
# (containers: /usr/local/nvidia/lib64, the GPU operator's /run/nvidia/driver; WSL: /usr/lib/wsl/lib)
# or on LD_LIBRARY_PATH. Never the toolkit's stubs: those are what the Debian fallback replaces.
find_libcuda() {
  local found d
  found=$(PATH="$PATH:/sbin:/usr/sbin" ldconfig -p 2>/dev/null \
    | awk '/libcuda\.so(\.1)? .*x86-64/ && !f {print $NF; f=1}')
  if [[ -n "$found" ]]; then printf '%s\n' "$found"; return 0; fi
  local dirs=()
  IFS=: read -r -a dirs <<< "${LD_LIBRARY_PATH:-}"
  dirs+=(/usr/local/nvidia/lib64 /usr/local/nvidia/lib /run/nvidia/driver/usr/lib/x86_64-linux-gnu
         /run/nvidia/driver/usr/lib64 /usr/lib/wsl/lib /usr/lib/x86_64-linux-gnu /usr/lib64
         /usr/lib/x86_64-linux-gnu/nvidia/current /usr/local/cuda/compat)
  for d in "${dirs[@]}"; do
    [[ -n "$d" && "$d" != "$LIB" && "$d" != */stubs ]] || continue
    for f in "$d/libcuda.so.1" "$d/libcuda.so"; do
      if [[ -e "$f" ]]; then printf '%s\n' "$f"; return 0; fi
    done
  done
  return 1
}
if (( PRINT_ENV_ONLY == 2 )); then find_libcuda; exit; fi
if [[ -n "${MEMTRAIN_LIBCUDA_SO:-}" ]]; then
  [[ -e "$MEMTRAIN_LIBCUDA_SO" ]] || die "MEMTRAIN_LIBCUDA_SO=$MEMTRAIN_LIBCUDA_SO does not exist"
  [[ "$(readlink -f "$LIB/libcuda.so" 2>/dev/null)" == "$(readlink -f "$MEMTRAIN_LIBCUDA_SO")" ]] \
    || install_libcuda_link "$(readlink -f "$MEMTRAIN_LIBCUDA_SO")"
elif have_libcuda; then
  :
elif sys_libcuda=$(find_libcuda) && [[ -n "$sys_libcuda" ]]; then
  # A machine with an NVIDIA driver: link against the real thing.
  log "found the driver's $sys_libcuda"
  install_libcuda_link "$(readlink -f "$sys_libcuda")"
else
  # No driver here: take libcuda.so.<ver> out of Debian's non-free `libcuda1`
  # (extract only, never installed). Any recent version exports the driver-API
  # symbols cudarc references.
  existing=("$LIBCUDA_DIR"/usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.[0-9]*)
  if [[ ! -e "${existing[0]}" ]]; then
    command -v apt-get >/dev/null 2>&1 || die "no libcuda.so and no apt-get: point MEMTRAIN_LIBCUDA_SO at a libcuda.so (any driver >= 580 install, or a CUDA toolkit's lib64/stubs/libcuda.so)"
    SRC=/etc/apt/sources.list.d/debian.sources
    need_components=0
    if [[ -f "$SRC" ]] && ! grep -qE '^Components:.*non-free( |$)' "$SRC"; then need_components=1; fi
    if [[ "$(id -u)" != 0 ]]; then
      if ! apt-cache madison libcuda1 2>/dev/null | grep -q libcuda1; then
        log "no libcuda.so on this machine and not root. As root, run:"
        (( need_components )) && log "  sed -i 's/^Components: main\$/Components: main contrib non-free non-free-firmware/' $SRC"
        log "  apt-get update"
        log "then re-run $0 (or set MEMTRAIN_LIBCUDA_SO=/path/to/libcuda.so)."
        exit 1
      fi
    else
      if (( need_components )); then
        cp -n "$SRC" "$SRC.memtrain-bak" || true
        sed -i 's/^Components: main$/Components: main contrib non-free non-free-firmware/' "$SRC"
        log "enabled contrib non-free non-free-firmware in $SRC (backup: $SRC.memtrain-bak)"
      fi
      if ! apt-cache madison libcuda1 2>/dev/null | grep -q libcuda1; then
        log "apt-get update"
        apt-get update -qq >&2
      fi
    fi
    tmp=$(mktemp -d)
    sandbox=()
    [[ "$(id -u)" == 0 ]] && sandbox=(-o APT::Sandbox::User=root) # /tmp dir is root-only
    ( cd "$tmp" && apt-get download -qq "${sandbox[@]}" libcuda1 >&2 ) || die "apt-get download libcuda1 failed"
    rm -rf "$LIBCUDA_DIR"
    mkdir -p "$LIBCUDA_DIR"
    dpkg -x "$tmp"/libcuda1_*.deb "$LIBCUDA_DIR"
    cp "$tmp"/libcuda1_*.deb "$LIBCUDA_DIR"/
    rm -rf "$tmp"
    existing=("$LIBCUDA_DIR"/usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.[0-9]*)
    [[ -e "${existing[0]}" ]] || die "libcuda1 .deb did not contain usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.<ver>"
  fi
  install_libcuda_link "${existing[0]}"
fi

# ------------------------------------------------------------ 3. env + checks
printf '%s\n' "$STAMP_CONTENT" > "$STAMP"
ENV_FILE="$VENV/env.sh"
ENV_TEXT=$(cat <<EOF
# memtrain CUDA build environment (generated by scripts/cuda-toolchain.sh).
# Link-time only: do NOT put \$CUDA_ROOT/lib on LD_LIBRARY_PATH on a GPU box
# (its libcuda.so.1 here is a link-only copy, not the machine's driver).
export CUDA_ROOT="$CUDA_ROOT_DIR"
export CUDA_PATH="\$CUDA_ROOT"
export CUDA_HOME="\$CUDA_ROOT"
case ":\$PATH:" in *":\$CUDA_ROOT/bin:"*) ;; *) export PATH="\$CUDA_ROOT/bin:\$PATH" ;; esac
case ":\${LIBRARY_PATH:-}:" in *":\$CUDA_ROOT/lib:"*) ;; *) export LIBRARY_PATH="\$CUDA_ROOT/lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}" ;; esac
# cuDNN (--features cudnn). Unlike \$CUDA_ROOT/lib this folder holds no link-only libcuda, so on
# a GPU machine it may go on LD_LIBRARY_PATH to provide libcudnn.so.9 at run time.
export MEMTRAIN_CUDNN_LIB="$CUDNN_LIB_DIR"
case ":\${LIBRARY_PATH:-}:" in *":\$MEMTRAIN_CUDNN_LIB:"*) ;; *) export LIBRARY_PATH="\$MEMTRAIN_CUDNN_LIB:\$LIBRARY_PATH" ;; esac
# 90 -> sm_90a (H100). Changing it (or NVCC/NVCC_CCBIN, CUDA_HOME/CUDA_PATH/CUDA_ROOT)
# re-runs the candle-kernels/cudarc build scripts: keep it identical everywhere.
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-90}"
# Keep CUDA builds out of ./target (CPU builds) and share one cache:
export CARGO_TARGET_DIR="\${CARGO_TARGET_DIR:-$TARGET_SUGGESTION}"
# No extra rustflags for CUDA builds (this overrides .cargo/config.toml's +f16c, which only
# speeds up Candle's CPU f16 kernels): one set of flags for every CUDA build and check, so they
# share the candle-kernels build (nvcc, ~25 min cold) instead of redoing it.
export CARGO_ENCODED_RUSTFLAGS=""
EOF
)
if [[ ! -f "$ENV_FILE" || "$(cat "$ENV_FILE")" != "$ENV_TEXT" ]]; then
  printf '%s\n' "$ENV_TEXT" > "$ENV_FILE"
fi

# Verify nvcc runs and finds the runtime/fp16/bf16/crt/cccl headers.
NVCC_VER=$("$CUDA_ROOT_DIR/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
[[ "$NVCC_VER" == 13.0 ]] || die "nvcc reports release '$NVCC_VER', expected 13.0"
HDR_OK="$VENV/.headers-ok"
if [[ ! -f "$HDR_OK" ]]; then
  t=$(mktemp -d)
  cat > "$t/t.cu" <<'EOF'
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda/std/cstdint>
extern "C" __global__ void k(__half* a, __nv_bfloat16* b) { a[0] = __hadd(a[0], a[1]); b[0] = __hadd(b[0], b[1]); }
EOF
  "$CUDA_ROOT_DIR/bin/nvcc" -gencode=arch=compute_90a,code=sm_90a --ptx -std=c++17 \
      -o "$t/t.ptx" "$t/t.cu" >&2 || { rm -rf "$t"; die "nvcc failed to compile a header smoke test"; }
  rm -rf "$t"
  touch "$HDR_OK"
fi
for so in cuda cudart cublas cublasLt nvrtc curand; do
  [[ -e "$LIB/lib$so.so" ]] || die "$LIB/lib$so.so missing or dangling"
done
[[ -e "$CUDNN_LIB_DIR/libcudnn.so" ]] || die "$CUDNN_LIB_DIR/libcudnn.so missing or dangling"

if (( PRINT_ENV_ONLY )); then
  printf '%s\n' "$ENV_TEXT"
else
  log "nvcc $NVCC_VER OK; CUDA_ROOT=$CUDA_ROOT_DIR"
  log "libcuda.so -> $(readlink -f "$LIB/libcuda.so")"
  log "environment written to $ENV_FILE; source it, or export:"
  printf '%s\n' "$ENV_TEXT"
fi
