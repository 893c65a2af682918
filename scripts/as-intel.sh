#!/usr/bin/env bash
# Run a command as on the project's Intel machine (2 MiB of L2 per core, the FMA bf16 kernel) on
# any Linux machine where this user may make a mount namespace (root): in a private one, every
# CPU's sysfs L2 size reads 2048K, which both the gemm crate's packing buffers and the estimate
# follow, and MEMTRAIN_BF16_GEMM=fma picks the kernel the vendor rule picks on Intel. AMX and the
# rest of the cache hierarchy are not emulated.
#
#   scripts/as-intel.sh cargo test --release
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: scripts/as-intel.sh COMMAND [ARGS...]" >&2; exit 2; }
size=$(mktemp)
trap 'rm -f "$size"' EXIT
echo 2048K > "$size"
unshare -m bash -c 'for c in /sys/devices/system/cpu/cpu[0-9]*/cache/index2/size; do mount --bind "$0" "$c"; done; exec "$@"' \
  "$size" env MEMTRAIN_BF16_GEMM=fma "$@"
