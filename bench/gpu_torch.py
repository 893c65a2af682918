#!/usr/bin/env python3
"""PyTorch's side of a GPU session: every configuration in one process, cached per GPU.

    bench/gpu_torch.py OUT_DIR CACHE STEPS TF32 'NAME|FLAGS' ...

Each NAME|FLAGS (train_cifar10's flags, which bench/torch_reference.py mirrors) runs like for
like with memtrain: deterministic cuDNN algorithms and NCHW (memtrain's defaults). Names listed
in DEFAULTS (environment, space-separated) also run as NAME-default, PyTorch's own defaults
(cuDNN's heuristics, channels_last); names in PROFILE add torch.profiler's table of where the
step's time goes. One JSON line per run goes to OUT_DIR/torch.jsonl.

Results are cached: CACHE (a JSON-lines file, bench/torch-cache.jsonl in the repo) keeps every
run keyed by the GPU, PyTorch and cuDNN versions, TF32, the timed steps and the flags. A run
found there is not run again, except those named in DRIFT, which run every session: their line
gets "drift", this session's img/s over the cached one. OUT_DIR/torch-cache.jsonl is the cache
after the session, to commit as CACHE. Memory figures are exact run to run; speed is what the
drift check is for.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_reference as ref  # noqa: E402


def load(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_atomically(path, lines):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)
    os.replace(tmp, path)


def main():
    if len(sys.argv) < 6:
        sys.exit("usage: bench/gpu_torch.py OUT_DIR CACHE STEPS TF32 'NAME|FLAGS' ...")
    out_dir, cache_path, steps, tf32 = sys.argv[1:5]
    configs = [c.split("|", 1) for c in sys.argv[5:]]
    env = lambda k: os.environ.get(k, "").split()
    defaults, profiled, drift = env("DEFAULTS"), env("PROFILE"), env("DRIFT")
    device = os.environ.get("TORCH_DEVICE", "cuda")
    cuda = device == "cuda"
    key = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "tf32": tf32,
        "steps": int(steps),
    }
    cache = load(cache_path)
    same = lambda r: all(r.get(k) == v for k, v in key.items())
    cached = {(r["name"], r["flags"]): r for r in cache if same(r)}
    runs = []
    for name, flags in configs:
        runs.append((name, flags, ["--deterministic", "--layout", "nchw"]))
        if name in defaults:
            runs.append((f"{name}-default", flags, ["--layout", "channels_last"]))
    lines, fresh = [], []
    for name, flags, how in runs:
        argv = ["--device", device, "--steps", steps, "--warmup", "5", "--tf32", tf32] + how + flags.split()
        if name in profiled:
            argv.append("--profile")
        before = cached.get((name, " ".join(argv)))
        if before is not None and name not in drift:
            lines.append({**before, "cached": True})
            continue
        try:
            r = ref.run(ref.parser().parse_args(argv))
        except Exception as e:  # one configuration's failure (out of memory, ...) ends only its line
            r = {"error": f"{type(e).__name__}: {e}"[:400]}
        r.update({**key, "name": name, "flags": " ".join(argv), "rc": 0 if "error" not in r else 1})
        if before is not None and "error" not in r and before.get("images_per_sec"):
            r["drift"] = r["images_per_sec"] / before["images_per_sec"]
        lines.append(r)
        if "error" not in r:
            fresh.append(r)
        with open(os.path.join(out_dir, "torch.jsonl"), "a") as f:
            f.write(json.dumps(r) + "\n")
        if cuda:
            torch.cuda.empty_cache()
    # Cached lines go into torch.jsonl too, so that the session's tables see every configuration.
    with open(os.path.join(out_dir, "torch.jsonl"), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines if r.get("cached"))
    # The cache after the session: this session's runs replace their cached lines.
    new = {(r["name"], r["flags"]) for r in fresh}
    kept = [r for r in cache if not (same(r) and (r["name"], r["flags"]) in new)]
    write_atomically(os.path.join(out_dir, "torch-cache.jsonl"), kept + fresh)
    print(f"pytorch: {len(fresh)} run, {sum(1 for r in lines if r.get('cached'))} from the cache, "
          f"{sum(1 for r in lines if r.get('rc'))} failed")


if __name__ == "__main__":
    main()
