#!/usr/bin/env python3
"""What these cores' multiply-add units deliver: the GFLOP/s of one large matrix product,
f32 and bf16, on T threads, through PyTorch's CPU kernels (oneDNN/MKL), the best-tuned gemm on
the machine. memtrain's per-phase GFLOP/s are read against it in docs/speed.md.

    bench/roofline.py [--threads T] [--size N] [--repeats R]   (PyTorch from bench/lib.sh's venv)

Prints one JSON object: per dtype the best of R timed products of N×N by N×N (2·N³ FLOP each).
"""
import argparse
import json
import time

import torch


def gflops(n: int, dtype: torch.dtype, repeats: int) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up: packing buffers, thread pool
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args()
    if a.size <= 0 or a.repeats <= 0:
        raise SystemExit("error: --size and --repeats must be positive")
    if a.threads:
        torch.set_num_threads(a.threads)
    out = {
        "framework": f"pytorch {torch.__version__}",
        "threads": torch.get_num_threads(),
        "size": a.size,
        "gflops": {name: gflops(a.size, dt, a.repeats) for name, dt in
                   [("f32", torch.float32), ("bf16", torch.bfloat16)]},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
