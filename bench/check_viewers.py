"""Check a memtrain run directory's viewer files with the viewers' own readers (run by
bench/check_viewers.sh, which documents it).

    python check_viewers.py RUN_DIR [OOM_RUN_DIR]

- events.out.tfevents.*: tensorboard's EventAccumulator (the reader behind TensorBoard's
  dashboards) loads it; every step's scalars once, equal to batches.csv.
- memory_snapshot.pickle: pickle.load, then PyTorch's torch.cuda._memory_viz helpers
  (trace_plot, segment_plot, segsum, trace, memory, segments) run on it; replayed as memory_viz
  does, its peak equals the step's measured peak in batches.csv, exactly.
- step_trace.json: a Trace Event Format object whose slices and counters match
  step_timeline.json.
- OOM_RUN_DIR/oom_memory_snapshot.pickle (optional): the same helpers, and its last entry is `oom`.

Prints one line per check and `N passed, M failed`; exits 1 when a check fails.
"""

import contextlib
import copy
import io
import json
import os
import pickle
import pickletools
import sys

results = []


def check(name, ok, detail=""):
    results.append(bool(ok))
    print(f"{'ok' if ok else 'FAILED'}: {name}{': ' + detail if detail else ''}")


# The opcodes the unpickler of pytorch.org/memory_viz (torch/utils/viz/MemoryViz.js) reads: a
# snapshot dropped into the page must use no other.
MEMORY_VIZ_OPCODES = {
    "PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET",
    "BININT", "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET",
    "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT", "SHORT_BINUNICODE",
    "BINUNICODE", "STOP", "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BINFLOAT",
}


def load_snapshot(label, path):
    with open(path, "rb") as f:
        data = f.read()
    ops = list(pickletools.genops(data))
    names = {op.name for op, _, _ in ops}
    check(f"{label}: only opcodes memory_viz's unpickler reads", names <= MEMORY_VIZ_OPCODES, ", ".join(sorted(names)))
    # A LONG1 wider than 8 bytes becomes a BigInt there, which its arithmetic rejects.
    wide = [pos for op, _, pos in ops if op.name == "LONG1" and data[pos + 1] > 8]
    check(f"{label}: every integer fits memory_viz's Number", not wide, f"{len(wide)} wider than 8 bytes")
    return pickle.loads(data)


def replay_peak(snapshot):
    """The most bytes alive at once: the segments are the end; walk back, then forward."""
    end = sum(
        b["size"]
        for s in snapshot["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    )
    trace = snapshot["device_traces"][0]

    def delta(e):
        return {"alloc": e["size"], "free_completed": -e["size"]}.get(e["action"], 0)

    now = end - sum(delta(e) for e in trace)
    peak = now
    for e in trace:
        now += delta(e)
        peak = max(peak, now)
    return peak


def memory_viz_helpers(label, snapshot):
    from torch.cuda import _memory_viz as mv

    html = mv.trace_plot(snapshot)
    check(f"{label}: _memory_viz.trace_plot", "Active Memory Timeline" in html, f"{len(html)} bytes of HTML")
    html = mv.segment_plot(snapshot)
    check(f"{label}: _memory_viz.segment_plot", len(html) > 1000, f"{len(html)} bytes of HTML")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        mv.trace_plot(copy.deepcopy(snapshot), filter_freed=True)
    check(
        f"{label}: every free_completed follows its free_requested (trace_plot filter_freed)",
        "without free_requested" not in out.getvalue(),
    )
    text = mv.segsum(snapshot)
    check(f"{label}: _memory_viz.segsum", f"segments: {len(snapshot['segments'])}" in text)
    text = mv.trace(snapshot)
    check(f"{label}: _memory_viz.trace", "entries" in text, text.splitlines()[1] if len(text.splitlines()) > 1 else "")
    raw = lambda lines: lines  # noqa: E731 (the flamegraph lines, not an SVG: that needs a download)
    lines = mv.memory(snapshot, format_flamegraph=raw).splitlines()
    total = sum(int(line.rsplit(" ", 1)[1]) for line in lines if line)
    alive = sum(b["size"] for s in snapshot["segments"] for b in s["blocks"])
    check(f"{label}: _memory_viz.memory (flamegraph lines)", total == alive, f"{total} bytes alive at the end")
    check(f"{label}: _memory_viz.segments", len(mv.segments(snapshot, format_flamegraph=raw)) > 0)


def tensorboard(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    want = [
        "train/loss", "train/lr", "train/images_per_sec", "train/grad_norm",
        "memory/step_peak_MiB", "memory/step_added_MiB", "memory/rss_MiB",
    ]
    missing = [t for t in want if t not in tags["scalars"]]
    check("tensorboard EventAccumulator: per-step scalars", not missing, f"missing {missing}" if missing else ", ".join(want))
    with open(os.path.join(run, "batches.csv")) as f:
        header = f.readline().strip().split(",")
        rows = [dict(zip(header, line.strip().split(","))) for line in f if line.strip()]
    steps = [e.step for e in acc.Scalars("train/loss")]
    check("tensorboard: every step once", steps == [int(r["global_step"]) for r in rows], f"steps {steps}")
    import numpy as np

    losses = [e.value for e in acc.Scalars("train/loss")]
    same = all(np.float32(float(r["loss"])) == np.float32(v) for r, v in zip(rows, losses))
    check("tensorboard: train/loss equals batches.csv", same)
    peaks = [e.value for e in acc.Scalars("memory/step_peak_MiB")]
    want_peaks = [np.float32(int(r["peak_bytes"]) / 2**20) for r in rows]
    check("tensorboard: memory/step_peak_MiB equals batches.csv", peaks == want_peaks)
    epoch_tags = ["epoch/train_loss", "epoch/train_accuracy", "epoch/peak_MiB", "epoch/eval_peak_MiB"]
    missing = [t for t in epoch_tags if t not in tags["scalars"]]
    check("tensorboard: per-epoch scalars", not missing, ", ".join(epoch_tags))
    config = acc.Tensors("config")
    text = config[0].tensor_proto.string_val[0].decode() if config else ""
    check("tensorboard: the configuration as text", '"batch_size"' in text)
    return rows


def snapshot_step(run, rows):
    with open(os.path.join(run, "config.json")) as f:
        step = json.load(f).get("memory_snapshot_step")
    return int(rows[-1]["global_step"]) if step is None else step


def main():
    run = sys.argv[1]
    rows = tensorboard(run)
    snapshot = load_snapshot("memory_snapshot.pickle", os.path.join(run, "memory_snapshot.pickle"))
    check("memory_snapshot.pickle: pickle.load", set(snapshot) >= {"segments", "device_traces"})
    trace = snapshot["device_traces"][0]
    names = {fr["name"] for e in trace for fr in e["frames"]}
    check("memory_snapshot.pickle: frames name layer events", "stage2.block1 backward" in names, f"{len(names)} names")
    memory_viz_helpers("memory_snapshot.pickle", snapshot)
    step = snapshot_step(run, rows)
    measured = next(int(r["peak_bytes"]) for r in rows if int(r["global_step"]) == step)
    replayed = replay_peak(snapshot)
    check(
        "memory_snapshot.pickle: replayed peak == measured step peak",
        replayed == measured,
        f"step {step}: replayed {replayed} B, measured {measured} B, {len(trace)} trace entries",
    )

    with open(os.path.join(run, "step_trace.json")) as f:
        perfetto = json.load(f)
    with open(os.path.join(run, "step_timeline.json")) as f:
        timeline = json.load(f)
    slices = [e for e in perfetto["traceEvents"] if e["ph"] == "X"]
    counters = [e for e in perfetto["traceEvents"] if e["name"] == "memory by category (bytes)"]
    events = timeline["events"]
    check("step_trace.json: one slice per layer event", len(slices) == len(events), f"{len(slices)} slices")
    totals = [sum(c["args"].values()) for c in counters] == [e["current_bytes"] for e in events]
    check("step_trace.json: counter totals equal step_timeline.json", totals)

    if len(sys.argv) > 2:
        oom = load_snapshot("oom_memory_snapshot.pickle", os.path.join(sys.argv[2], "oom_memory_snapshot.pickle"))
        last = oom["device_traces"][0][-1]
        check("oom_memory_snapshot.pickle: ends with an oom entry", last["action"] == "oom", last["frames"][0]["name"])
        memory_viz_helpers("oom_memory_snapshot.pickle", oom)

    failed = results.count(False)
    print(f"{len(results) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
