#!/usr/bin/env python3
"""PyTorch reference for memtrain: the same network, data and recipe, timed and measured.

Prints one JSON object: images/s of the training step and peak memory
(torch.cuda.max_memory_allocated, plus torch.cuda.mem_get_info for the device-wide view on CUDA;
the process's max RSS on the CPU). Flags mirror train_cifar10's.

    python3 bench/torch_reference.py --device cpu --threads 2 --batch-size 128 --steps 20
    python3 bench/torch_reference.py --device cuda --batch-size 512 --precision bf16

--step-memory (CPU only; needs bench/malloc_count.c's shim in LD_PRELOAD, see
bench/step_memory.sh) adds the heap bytes of every step, warm-up steps included, counted the way
memtrain's batches.csv counts them: start_bytes when the step begins (the batch already exists as
a slice of the data set, the previous step's gradients are gone, gc.collect() has run),
peak_bytes the highest live heap bytes until optimizer.step() has returned, end_bytes after it. The step begins just before the
input tensors are made from the batch, and in this mode they are copies (memtrain's
Tensor::from_slice copies the batch too; a plain slice would be a free view).

On CUDA the JSON also has step_added_bytes: the most any timed step allocated above what was in
use at its start (torch.cuda.memory_allocated after the previous step's gradients are freed, the
step's peak from max_memory_allocated with the peak reset at the step's start), memtrain's
step-added peak. --tf32 on|off sets torch.backends.cudnn.allow_tf32 (on, PyTorch's default:
f32 convolutions in TF32); matmuls keep PyTorch's default (torch.backends.cuda.matmul.allow_tf32
off), as memtrain's --tf32 leaves its head's matmul in f32.

--deterministic asks cuDNN for deterministic algorithms only (torch.backends.cudnn.deterministic;
memtrain's default); without it PyTorch's default heuristics choose. --layout channels_last (the
default on CUDA) or nchw sets the model's and batches' memory format (memtrain is NCHW).
--profile adds "profile": the 20 ops with the most device time (CPU time on the CPU) over 5 more
steps, from torch.profiler, as PyTorch's own table of where its step's time goes.

--variants FILE runs several configurations in this one process, one JSON line each: FILE is a
JSON list of objects, each a configuration's "name" and its flags as keys (dashes as
underscores, e.g. {"name": "bs512-f32", "batch_size": 512, "deterministic": true}); flags not
named keep the command line's values. The model, optimizer and data are made anew per line;
CUDA's peak statistics are reset between them.

--checkpoint stages wraps each of the three stages (two blocks) in
torch.utils.checkpoint.checkpoint(use_reentrant=False) and runs the head outside, as memtrain does
(it recomputes every segment, the last one too: checkpoint_sequential would leave the last
segment un-checkpointed); blocks does the same per block.
"""
import argparse
import gc
import json
import os
import resource
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as ckpt

MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


class Block(nn.Module):
    """3x3 conv (dense or depthwise+pointwise, no bias) -> BatchNorm -> ReLU [-> 2x2 max-pool]."""

    def __init__(self, cin, cout, separable, pool):
        super().__init__()
        if separable:
            self.conv = nn.Sequential(
                nn.Conv2d(cin, cin, 3, padding=1, groups=cin, bias=False),
                nn.Conv2d(cin, cout, 1, bias=False),
            )
        else:
            self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.pool = pool

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return F.max_pool2d(x, 2) if self.pool else x


class Net(nn.Module):
    def __init__(self, width, separable, checkpointing):
        super().__init__()
        w = width
        chans = [(3, w), (w, w), (w, 2 * w), (2 * w, 2 * w), (2 * w, 4 * w), (4 * w, 4 * w)]
        self.blocks = nn.ModuleList(Block(i, o, separable, k % 2 == 1) for k, (i, o) in enumerate(chans))
        self.head = nn.Linear(4 * w * 16, 10)
        self.checkpointing = checkpointing

    def forward(self, x):
        if self.checkpointing == "none":
            for b in self.blocks:
                x = b(x)
        else:
            step = 2 if self.checkpointing == "stages" else 1
            for i in range(0, len(self.blocks), step):
                seg = nn.Sequential(*self.blocks[i : i + step])
                x = ckpt(seg, x, use_reentrant=False)
        return self.head(x.flatten(1))


def load_cifar(data_dir, n):
    """Images from CIFAR-10 binary files (1 label byte + 3072 pixel bytes, R,G,B planes)."""
    import numpy as np

    files = sorted(f for f in os.listdir(data_dir) if f.startswith("data_batch_") and f.endswith(".bin"))
    raw = np.concatenate([np.fromfile(os.path.join(data_dir, f), dtype=np.uint8) for f in files])
    rec = raw.reshape(-1, 3073)[:n]
    x = torch.from_numpy(rec[:, 1:].reshape(-1, 3, 32, 32).astype("float32") / 255.0)
    y = torch.from_numpy(rec[:, 0].astype("int64"))
    return (x - MEAN) / STD, y


def malloc_counter():
    """The counters of bench/malloc_count.c's shim, which must be in LD_PRELOAD."""
    import ctypes

    lib = ctypes.CDLL(None)
    try:
        for name in ("mc_current", "mc_peak", "mc_peak_total", "mc_allocs", "mc_unknown_frees"):
            getattr(lib, name).restype = ctypes.c_int64
        lib.mc_reset_peak.restype = None
    except AttributeError:
        sys.exit("error: --step-memory needs the malloc_count shim preloaded: "
                 "gcc -O2 -shared -fPIC -o libmalloc_count.so bench/malloc_count.c, "
                 "then LD_PRELOAD=$PWD/libmalloc_count.so (bench/step_memory.sh does this)")
    if lib.mc_allocs() == 0:
        sys.exit("error: the malloc_count shim is loaded but counted no allocation; it must be "
                 "in LD_PRELOAD, not loaded later")
    return lib


def saved_bytes(model, xb, yb, dtype, dev):
    """The bytes autograd keeps for the backward of one forward of `xb` and its loss against `yb`
    (the activations: every
    saved tensor's storage counted once, the parameters' storages left out), read through
    torch.autograd.graph.saved_tensors_hooks; memtrain's counterpart is the saved set of the step
    (the estimate's saved for backward, summary.json's saved_bytes)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            F.cross_entropy(model(xb).float(), yb)
    return sum(seen.values())


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--precision", choices=["f32", "f16", "bf16"], default="f32")
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--checkpoint", choices=["none", "stages", "blocks"], default="none")
    p.add_argument("--conv", choices=["standard", "separable"], default="standard")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--data-dir", default=None, help="CIFAR-10 binary dir; random images without it")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--clip-grad-norm", type=float, default=1.0,
                   help="clip_grad_norm_ limit, as memtrain's --clip-grad-norm (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tf32", choices=["on", "off"], default="on",
                   help="TF32 for f32 convolutions on CUDA (torch.backends.cudnn.allow_tf32; on is PyTorch's default)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (inductor; the warm-up steps include compiling)")
    p.add_argument("--step-memory", action="store_true",
                   help="per-step heap bytes from the malloc_count LD_PRELOAD shim (CPU only)")
    p.add_argument("--saved-bytes", action="store_true",
                   help="only the bytes autograd saves for the backward in one micro-batch's forward")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic cuDNN algorithms only (torch.backends.cudnn.deterministic)")
    p.add_argument("--layout", choices=["default", "nchw", "channels_last"], default="default",
                   help="memory format of the model and batches (default: channels_last on CUDA, NCHW on the CPU)")
    p.add_argument("--profile", action="store_true",
                   help="add the 20 ops with the most device time over 5 more steps (torch.profiler)")
    p.add_argument("--variants", metavar="FILE", default=None,
                   help="a JSON list of configurations to run in this process, one JSON line each")
    return p


def main():
    p = parser()
    a = p.parse_args()
    if a.variants is None:
        print(json.dumps(run(a)))
        return
    try:
        variants = json.load(open(a.variants))
        assert isinstance(variants, list) and all(isinstance(v, dict) and "name" in v for v in variants)
    except (OSError, ValueError, AssertionError) as e:
        sys.exit(f"error: --variants {a.variants}: not a JSON list of objects with a \"name\" ({e})")
    known = vars(a)
    for v in variants:
        bad = [k for k in v if k != "name" and (k not in known or k == "variants")]
        if bad:
            sys.exit(f"error: --variants {a.variants}: {v['name']}: unknown keys {bad}; use the flags' names with underscores")
    for v in variants:
        b = argparse.Namespace(**{**known, **{k: x for k, x in v.items() if k != "name"}})
        try:
            out = run(b)
        except Exception as e:  # one configuration's failure (out of memory, ...) ends only its line
            out = {"error": f"{type(e).__name__}: {e}"[:400]}
        out["name"] = v["name"]
        print(json.dumps(out), flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run(a):
    """One configuration's JSON object (argparse namespace `a`)."""
    if a.batch_size <= 0 or a.batch_size % a.accum_steps:
        sys.exit("error: --batch-size must be positive and divisible by --accum-steps")
    if a.step_memory and torch.device(a.device).type != "cpu":
        sys.exit("error: --step-memory counts the host heap; use it with --device cpu")
    mc = malloc_counter() if a.step_memory else None
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    torch.backends.cudnn.allow_tf32 = a.tf32 == "on"
    torch.backends.cudnn.deterministic = a.deterministic
    layout = a.layout if a.layout != "default" else ("channels_last" if cuda else "nchw")
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format

    n = a.batch_size * 4
    if a.data_dir:
        x_all, y_all = load_cifar(a.data_dir, n)
        reps = -(-n // len(x_all))
        x_all, y_all = x_all.repeat(reps, 1, 1, 1)[:n], y_all.repeat(reps)[:n]
    else:
        x_all, y_all = torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))

    model = Net(a.width, a.conv == "separable", a.checkpoint).to(dev).to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    if a.compile:
        # Forward and backward compiled (AOTAutograd); the optimizer stays eager.
        model = torch.compile(model)
    dtype = {"f32": None, "f16": torch.float16, "bf16": torch.bfloat16}[a.precision]
    if a.saved_bytes:
        m = a.batch_size // a.accum_steps
        return {"saved_bytes": saved_bytes(model, x_all[:m].to(dev), y_all[:m].to(dev), dtype, dev)}
    scaler = torch.amp.GradScaler(dev.type, enabled=a.precision == "f16")
    mb = a.batch_size // a.accum_steps

    step_mem = []
    # The heap before training: data, model and optimizer built, no gradient or momentum buffer
    # yet (both are made by the first step), as memtrain's baseline_bytes is read.
    if mc is not None:
        gc.collect()
        pretrain_bytes = mc.mc_current()
    cuda_steps = []  # (start, peak) of each timed step on CUDA

    def step(i):
        track = cuda and i >= a.warmup
        lo = (i * a.batch_size) % n
        if mc is not None:
            # The batch as the data pipeline hands it over (a view of the data set, like memtrain's
            # Batch vectors), the previous step's gradients freed (set_to_none: this step allocates
            # its own, as memtrain's does) and no garbage left for the cycle collector to free
            # mid-step; then the step starts.
            xs_all, ys_all = x_all[lo : lo + a.batch_size], y_all[lo : lo + a.batch_size]
            opt.zero_grad(set_to_none=True)
            gc.collect()
            start = mc.mc_current()
            mc.mc_reset_peak()
            xb = xs_all.to(dev, copy=True)
            yb = ys_all.to(dev, copy=True)
        else:
            if track:
                # As memtrain counts a step: the previous step's gradients freed, then the start.
                opt.zero_grad(set_to_none=True)
                start = torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            xb = x_all[lo : lo + a.batch_size].to(dev, non_blocking=True).contiguous(memory_format=fmt)
            yb = y_all[lo : lo + a.batch_size].to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        for k in range(a.accum_steps):
            xs, ys = xb[k * mb : (k + 1) * mb], yb[k * mb : (k + 1) * mb]
            with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(xs).float(), ys) / a.accum_steps
            scaler.scale(loss).backward()
        if a.clip_grad_norm > 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad_norm)
        scaler.step(opt)
        scaler.update()
        if mc is not None:
            step_mem.append({"step": i, "timed": i >= a.warmup, "start_bytes": start,
                             "peak_bytes": mc.mc_peak(), "end_bytes": mc.mc_current()})
        if track:
            cuda_steps.append((start, torch.cuda.max_memory_allocated(dev)))
        return loss

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for i in range(a.warmup):
        step(i)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(a.steps):
        loss = step(a.warmup + i)
    sync()
    secs = time.perf_counter() - t0
    out = {
        "framework": f"pytorch {torch.__version__}",
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "threads": torch.get_num_threads(),
        "batch_size": a.batch_size,
        "width": a.width,
        "precision": a.precision,
        "accum_steps": a.accum_steps,
        "checkpoint": a.checkpoint,
        "conv": a.conv,
        "steps": a.steps,
        "compiled": a.compile,
        "images_per_sec": a.steps * a.batch_size / secs,
        "final_loss": float(loss.detach().float() * a.accum_steps),
        "params": sum(p.numel() for p in model.parameters()),
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "deterministic": a.deterministic,
        "layout": layout,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
    }
    if cuda:
        free, total = torch.cuda.mem_get_info(dev)
        # The peak is reset at every timed step's start: the run's peak is the steps' highest.
        out["peak_bytes"] = max(p for _, p in cuda_steps)
        out["step_added_bytes"] = max(p - s for s, p in cuda_steps)
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(dev)
        out["device_used_bytes"] = total - free
    else:
        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if mc is not None:
        out["step_memory"] = {
            "counter": "malloc_count LD_PRELOAD shim: requested heap bytes, all threads",
            "step_start": "before the input tensors are copied from the batch; gradients freed",
            "steps": step_mem,
            "step_added_bytes": [s["peak_bytes"] - s["start_bytes"] for s in step_mem],
            "process_peak_bytes": mc.mc_peak_total(),
            "pretrain_bytes": pretrain_bytes,
            "unknown_frees": mc.mc_unknown_frees(),
        }
    if a.profile:
        out["profile"] = profile(step, a.warmup + a.steps, cuda)
    return out


def profile(step, first, cuda):
    """The 20 ops with the most self device time (CPU time on the CPU) over 5 steps from `first`."""
    from torch.profiler import ProfilerActivity, profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with prof(activities=acts) as pr:
        for i in range(5):
            step(first + i)
        if cuda:
            torch.cuda.synchronize()
    def dev_us(e, total):
        for k in (("self_device_time_total", "self_cuda_time_total") if not total
                  else ("device_time_total", "cuda_time_total")):
            if hasattr(e, k):
                return getattr(e, k)
        return 0
    rows = []
    for e in pr.key_averages():
        own = dev_us(e, False) if cuda else e.self_cpu_time_total
        rows.append({"op": e.key, "calls": e.count, "self_us": own / 5,
                     "total_us": (dev_us(e, True) if cuda else e.cpu_time_total) / 5})
    rows.sort(key=lambda r: -r["self_us"])
    return {"per": "step (mean of 5)", "time": "device" if cuda else "cpu", "top": rows[:20]}


if __name__ == "__main__":
    main()
