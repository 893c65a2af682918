#!/usr/bin/env python3
"""The tables of a GPU session as CSV, from bench/gpu_session.sh's raw JSON lines.

    bench/gpu_compare.py OUT_DIR

Reads OUT_DIR/memtrain.jsonl, graph.jsonl, torch.jsonl and codes.jsonl (those present) and writes
OUT_DIR/compare.csv (each configuration on both frameworks: memtrain's pool peak, step-added bytes,
steady img/s eager and captured, its estimate's peak; PyTorch's max_memory_allocated, step-added
bytes and img/s) and OUT_DIR/codes.csv (memtrain's --compress-activations runs). The docs'
tables show these files' figures (tests/results_tables.rs checks them). Written atomically.
"""
import csv
import io
import json
import os
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
    failed = [n for n, r in {**memtrain, **graph, **codes}.items() if r.get("rc") != 0]
    if failed:
        sys.exit(f"bench/gpu_compare.py: runs failed in {d}: {', '.join(failed)}; see logs/")
    mem_cols = ["peak_bytes", "step_added_bytes", "steady_images_per_sec",
                "predicted_peak_bytes", "prediction_error_pct"]
    if memtrain:
        table = []
        for name, m in memtrain.items():
            t, g = torch.get(name, {}), graph.get(f"{name}-graph", {})
            table.append([name, m["flags"], "false"]
                         + [value(m, k) for k in mem_cols]
                         + [value(g, "steady_images_per_sec")]
                         + [value(t, k) for k in ("peak_bytes", "step_added_bytes", "images_per_sec")])
        write_atomically(f"{d}/compare.csv",
                         ["configuration", "flags", "lossy", "peak_bytes", "step_added_bytes",
                          "images_per_sec", "predicted_peak_bytes", "prediction_error_pct",
                          "graph_images_per_sec", "torch_peak_bytes", "torch_step_added_bytes",
                          "torch_images_per_sec"], table)
    if codes:
        table = [[name, c["flags"], "true"] + [value(c, k) for k in mem_cols]
                 for name, c in codes.items()]
        write_atomically(f"{d}/codes.csv",
                         ["configuration", "flags", "lossy", "peak_bytes", "step_added_bytes",
                          "images_per_sec", "predicted_peak_bytes", "prediction_error_pct"], table)


if __name__ == "__main__":
    main()
