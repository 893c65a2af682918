#!/usr/bin/env python3
"""The tables of a GPU session as CSV, from bench/gpu_session.sh's raw JSON lines.

    bench/gpu_compare.py OUT_DIR

Reads OUT_DIR/memtrain.jsonl, graph.jsonl, torch.jsonl and codes.jsonl (those present) and writes
OUT_DIR/compare.csv (each configuration on both frameworks: memtrain's pool peak, step-added bytes,
steady img/s eager and captured, its estimate's peak, the pool's reserved peak; PyTorch's
max_memory_allocated, step-added bytes, img/s like for like and with its defaults, reserved peak)
and OUT_DIR/codes.csv (memtrain's --compress-activations runs). The docs' tables show these files'
figures (tests/results_tables.rs checks them). Written atomically; a failed run leaves its row
out. Then prints the verdict: per configuration the speed and memory ratios and the estimate's
error, the drift of PyTorch's re-run configurations, and the failed runs and tests.
"""
import csv
import io
import json
import os
import re
import sys


def rows(path):
    """name -> JSON object of each line of a .jsonl file (empty when the file is absent)."""
    if not os.path.exists(path):
        return {}
    out = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out[r["name"]] = r
    return out


def write_atomically(path, header, table):
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(table)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(buf.getvalue())
    os.replace(tmp, path)


def value(r, key):
    v = r.get(key)
    return "" if v is None else v


def main():
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: bench/gpu_compare.py OUT_DIR (a bench/gpu_session.sh results folder)")
    d = sys.argv[1]
    memtrain, graph = rows(f"{d}/memtrain.jsonl"), rows(f"{d}/graph.jsonl")
    torch, codes = rows(f"{d}/torch.jsonl"), rows(f"{d}/codes.jsonl")
    workspace = rows(f"{d}/workspace.jsonl")
    failed = [n for n, r in {**memtrain, **graph, **codes, **torch}.items() if r.get("rc") != 0]
    failed += [f"{n} (workspace)" for n, r in workspace.items() if r.get("rc") != 0]
    ok = lambda rs: {n: r for n, r in rs.items() if r.get("rc") == 0}
    memtrain, graph, torch, codes = ok(memtrain), ok(graph), ok(torch), ok(codes)
    workspace = ok(workspace)
    mem_cols = ["peak_bytes", "step_added_bytes", "steady_images_per_sec",
                "predicted_peak_bytes", "prediction_error_pct"]
    if memtrain:
        table = []
        for name, m in memtrain.items():
            t, g = torch.get(name, {}), graph.get(f"{name}-graph", {})
            table.append([name, m["flags"], "false"]
                         + [value(m, k) for k in mem_cols]
                         + [value(g, "steady_images_per_sec")]
                         + [value(t, k) for k in ("peak_bytes", "step_added_bytes", "images_per_sec")]
                         + [value(torch.get(f"{name}-default", {}), "images_per_sec"),
                            value(m, "reserved_peak_bytes"), value(t, "peak_reserved_bytes")])
        write_atomically(f"{d}/compare.csv",
                         ["configuration", "flags", "lossy", "peak_bytes", "step_added_bytes",
                          "images_per_sec", "predicted_peak_bytes", "prediction_error_pct",
                          "graph_images_per_sec", "torch_peak_bytes", "torch_step_added_bytes",
                          "torch_images_per_sec", "torch_default_images_per_sec",
                          "reserved_peak_bytes", "torch_reserved_peak_bytes"], table)
    if codes:
        table = [[name, c["flags"], "true"] + [value(c, k) for k in mem_cols]
                 for name, c in codes.items()]
        write_atomically(f"{d}/codes.csv",
                         ["configuration", "flags", "lossy", "peak_bytes", "step_added_bytes",
                          "images_per_sec", "predicted_peak_bytes", "prediction_error_pct"], table)
    verdict(d, memtrain, graph, torch, codes, workspace, failed)


def verdict(d, memtrain, graph, torch, codes, workspace, failed):
    """A few lines that say what the session found, for the developer deciding on a rerun."""
    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "-"
    print("== verdict")
    def line(label, name, m, g):
        t, td = torch.get(name, {}), torch.get(f"{name}-default", {})
        ips = m.get("steady_images_per_sec") or m.get("images_per_sec")
        parts = [f"{label}: {ips or 0:.0f} img/s"]
        if t:
            parts.append(f"speed {ratio(ips, t.get('images_per_sec'))} PyTorch like for like"
                         + (f", {ratio(ips, td.get('images_per_sec'))} its defaults" if td else ""))
        if g:
            parts.append(f"captured {ratio(g.get('steady_images_per_sec'), t.get('images_per_sec'))}")
        if t:
            parts.append(f"step adds {ratio(m.get('step_added_bytes'), t.get('step_added_bytes'))}")
            parts.append(f"reserved {ratio(m.get('reserved_peak_bytes'), t.get('peak_reserved_bytes'))}")
        if m.get("reserved_peak_bytes") and m.get("peak_bytes"):
            parts.append(f"reserved/used {ratio(m['reserved_peak_bytes'], m['peak_bytes'])}")
        if m.get("prediction_error_pct") is not None:
            parts.append(f"estimate {m['prediction_error_pct']:+.1f}%")
        print("; ".join(parts))
    for name, m in {**memtrain, **codes}.items():
        line(name, name, m, graph.get(f"{name}-graph"))
    for name, m in workspace.items():
        ws = re.search(r"--cudnn-workspace \S+", m.get("flags", ""))
        line(f"{name} with {ws.group(0) if ws else 'another workspace'}", name, m, None)
    for name in ("bs512-f32", "bs512-bf16"):
        passes = memtrain.get(name, {}).get("gpu_passes") or []
        if passes:
            total = sum(p["us_per_step"] for p in passes)
            print(f"{name} GPU time in convolutions: {total:.0f} us/step; most:")
            for p in passes[:5]:
                ws = f", workspace {p['workspace_bytes'] / 2**20:.1f} MiB" if p["workspace_bytes"] else ""
                print(f"  {p['us_per_step']:8.0f} us  {p['pass']} {p['shape']} {p['dtype']} on {p['route']}{ws}")
        top = (torch.get(name, {}).get("profile") or {}).get("top") or []
        if top:
            print(f"{name} PyTorch's most device time: "
                  + ", ".join(f"{r['op']} {r['self_us']:.0f} us" for r in top[:5]))
    drift = [f"{n} {r['drift']:.2f}" for n, r in torch.items() if r.get("drift")]
    if drift:
        print("PyTorch drift (this session over the cache): " + ", ".join(drift))
    tests = []
    if os.path.exists(f"{d}/session.log"):
        for line in open(f"{d}/session.log"):
            words = line.split()
            if len(words) >= 3 and words[1] == "test" and words[-1].startswith("rc="):
                tests.append(f"{words[2]} {'ok' if words[-1] == 'rc=0' else 'FAILED'}")
    if tests:
        print("tests: " + ", ".join(tests))
    print("failed runs: " + (", ".join(failed) if failed else "none") + " (see logs/)")


if __name__ == "__main__":
    main()
