#!/usr/bin/env bash
# A screenshot of a run's memory_snapshot.pickle in PyTorch's memory viewer (the page of
# pytorch.org/memory_viz), offline, with Debian's headless Chromium.
#
#   bench/viewer_screenshot.sh --memory-viz FILE --run-dir DIR [--out PNG] [--size WxH]
#
# The viewer is PyTorch's torch/utils/viz/MemoryViz.js (FILE: from a PyTorch source checkout;
# the wheel does not ship it, and the page loads it and d3 from CDNs). The script takes d3 5 from
# the npm registry (`npm pack d3@5`), points the viewer's d3 imports at it, and opens a page that
# hands the viewer the snapshot file's own bytes, as dropping the file onto pytorch.org/memory_viz
# does (so the viewer's own unpickler reads memtrain's pickle), and points at the second-largest
# allocation so that the viewer shows its frame. Chromium: `apt-get install -y
# chromium`. Look at the PNG afterwards.
#
# Exit status: 0 when the PNG is written, 2 for a bad flag, 1 when a step fails.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
  echo
  cat <<'EOF'
Flags (defaults in brackets):
  --memory-viz FILE  PyTorch's torch/utils/viz/MemoryViz.js
  --run-dir DIR      a run directory with memory_snapshot.pickle
  --out PNG          where the screenshot goes [docs/images/memory_viz.png]
  --size WxH         the window [1400x900]
  -h, --help         this text
EOF
}
bad() {
  echo "error: $*; run '$0 --help' for the flags" >&2
  exit 2
}
fail() {
  echo "error: $*" >&2
  exit 1
}

repo=$(cd "$(dirname "$0")/.." && pwd)
viz="" run_dir="" out="$repo/docs/images/memory_viz.png" size="1400x900"
while [ $# -gt 0 ]; do
  case $1 in
    --memory-viz | --run-dir | --out | --size) [ $# -ge 2 ] || bad "$1 needs a value" ;;&
    --memory-viz) viz=$2; shift 2 ;;
    --run-dir) run_dir=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --size) [[ $2 =~ ^[0-9]{3,4}x[0-9]{3,4}$ ]] || bad "--size must be WIDTHxHEIGHT, got '$2'"; size=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) bad "unknown flag '$1'" ;;
  esac
done
[ -f "$viz" ] || bad "--memory-viz must name PyTorch's MemoryViz.js (torch/utils/viz/ in a PyTorch source checkout)"
[ -f "$run_dir/memory_snapshot.pickle" ] || bad "--run-dir must be a run directory with memory_snapshot.pickle"
command -v chromium >/dev/null || fail "chromium not found; install it with apt-get install -y chromium"
command -v npm >/dev/null || fail "npm not found; install it with apt-get install -y npm"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/memtrain-shot.XXXXXX")
trap '[ -n "${KEEP_SHOT:-}" ] || rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack d3@5 --silent >/dev/null && tar xzf d3-5*.tgz) || fail "npm pack d3@5 failed"
cp "$tmp/package/dist/d3.min.js" "$tmp/d3.min.js"
python3 - "$viz" "$run_dir/memory_snapshot.pickle" "$tmp/page.html" <<'EOF'
import base64, sys
viz, snapshot, page = sys.argv[1:4]
lines = open(viz).read().splitlines()
# The CDN imports become the d3 bundle loaded by the page (its d3.event is live, as d3 5's is).
js = [l for l in lines if not l.startswith("import ")]
js.insert(1, "const d3 = window.d3; const {axisLeft, scaleLinear, zoom, zoomIdentity, brushX} = d3;")
raw = open(snapshot, "rb").read()
raw += b"\0" * (-len(raw) % 3)  # the viewer's base64 decoder wants whole 3-byte groups
files = '[{"name": "memory_snapshot.pickle", "base64": "%s"}]' % base64.b64encode(raw).decode()
js.append(f"add_local_files({files}, 'Active Memory Timeline');")
# Point at the second-largest allocation (the largest is what was in use before the step), as a
# mouse over it would: the viewer prints its address, size and frame below the plot.
js.append("""setTimeout(() => {
  const shapes = d3.selectAll('polygon').filter(d => d && typeof d.size === 'number').nodes();
  shapes.sort((a, b) => d3.select(b).datum().size - d3.select(a).datum().size);
  if (shapes.length > 1) shapes[1].dispatchEvent(new MouseEvent('mouseover'));
}, 500);""")
with open(page, "w") as f:
    f.write('<!DOCTYPE html><html><head><script src="d3.min.js"></script></head><body>\n')
    f.write('<script type="module">\n' + "\n".join(js) + "\n</script></body></html>\n")
EOF
chromium --headless --no-sandbox --disable-gpu --disable-background-networking \
  --disable-component-update --disable-sync --no-first-run --hide-scrollbars \
  --user-data-dir="$tmp/profile" --virtual-time-budget=20000 \
  --window-size="${size/x/,}" --screenshot="$tmp/shot.png" "file://$tmp/page.html" \
  >"$tmp/chromium.log" 2>&1 || { tail -n 5 "$tmp/chromium.log" >&2; fail "chromium failed"; }
[ -s "$tmp/shot.png" ] || fail "chromium wrote no screenshot"
mkdir -p "$(dirname "$out")"
cp "$tmp/shot.png" "$out"
echo "wrote $out"
