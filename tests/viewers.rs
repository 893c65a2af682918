//! The files other viewers open (issue 24): a short CPU run leaves TensorBoard's event file,
//! PyTorch's memory snapshot and Perfetto's trace in its run directory, each read back here
//! without the viewers (the pickle with serde-pickle, the event file record by record), and the
//! snapshot's replayed peak is the step's measured peak, exactly.

mod common;

use common::run_trainer as train;
use memtrain::export::memviz::{self, MEMORY_SNAPSHOT_FILE, OOM_MEMORY_SNAPSHOT_PICKLE};
use memtrain::export::perfetto::{MEMORY_COUNTER, STEP_TRACE_FILE};
use memtrain::export::tensorboard::{self as tb, What};
use memtrain_core::memory::timeline::STEP_TIMELINE_FILE;
use memtrain_core::memory::trace::{Action, Trace, TraceEntry};
use serde_json::Value as Json;
use serde_pickle::{HashableValue, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// 4 steps an epoch (256 images, batch 64), a few MiB a step.
const BASE: &[&str] = &[
    "--device",
    "cpu",
    "--width",
    "8",
    "--synthetic-train",
    "256",
    "--synthetic-test",
    "64",
    "--batch-size",
    "64",
    "--quiet",
];

fn run_ok(dir: &Path, extra: &[&str]) {
    let o = train(&[BASE, &["--out", dir.to_str().unwrap()], extra].concat());
    common::assert_ok(&o, "the run");
}

fn json(path: &Path) -> Json {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The run's measured peak of step `step` (its row of batches.csv).
fn measured_step_peak(dir: &Path, step: u64) -> u64 {
    let csv = std::fs::read_to_string(dir.join("batches.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let at = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let row: Vec<&str> = lines
        .map(|l| l.split(',').collect::<Vec<_>>())
        .find(|r| r[at("global_step")] == step.to_string())
        .unwrap();
    row[at("peak_bytes")].parse().unwrap()
}

fn event_file(dir: &Path) -> PathBuf {
    memtrain::callbacks::tensorboard::event_file(dir).expect("an events.out.tfevents.* file")
}

fn events(dir: &Path) -> Vec<tb::Event> {
    let bytes = std::fs::read(event_file(dir)).unwrap();
    let (events, good) = tb::read_records(&bytes);
    assert_eq!(
        good,
        bytes.len(),
        "every record is whole and its checksums hold"
    );
    events
}

/// `(step, value)` of every scalar `tag` in the event file, in file order.
fn scalars(events: &[tb::Event], tag: &str) -> Vec<(i64, f32)> {
    let mut out = Vec::new();
    for e in events {
        if let Some(What::Summary(s)) = &e.what {
            for v in s.value.iter().filter(|v| v.tag == tag) {
                if let Some(tb::Value::SimpleValue(x)) = v.value {
                    out.push((e.step, x));
                }
            }
        }
    }
    out
}

// --- the pickle, read as plain pickle values (not through memtrain's own structs) ---

fn key(k: &str) -> HashableValue {
    HashableValue::String(k.into())
}

fn dict(v: &Value) -> &BTreeMap<HashableValue, Value> {
    match v {
        Value::Dict(d) => d,
        other => panic!("expected a dict, got {other:?}"),
    }
}

fn field<'a>(v: &'a Value, k: &str) -> &'a Value {
    dict(v)
        .get(&key(k))
        .unwrap_or_else(|| panic!("no key {k:?} in {v:?}"))
}

fn list(v: &Value) -> &[Value] {
    match v {
        Value::List(l) => l,
        other => panic!("expected a list, got {other:?}"),
    }
}

/// An integer of at most 8 bytes: memory_viz's unpickler reads a wider one as a BigInt, which
/// its arithmetic rejects (serde-pickle reads it back as `Value::Int`).
fn int(v: &Value) -> i128 {
    match v {
        Value::I64(i) => *i as i128,
        other => panic!("expected an int of at most 8 bytes, got {other:?}"),
    }
}

fn string(v: &Value) -> &str {
    match v {
        Value::String(s) => s,
        other => panic!("expected a str, got {other:?}"),
    }
}

fn read_pickle(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap();
    serde_pickle::value_from_slice(&bytes, serde_pickle::DeOptions::new()).unwrap()
}

/// The most bytes alive at once, replayed as memory_viz does: the segments' active blocks are
/// the end; walking the trace back gives the start; then forward.
fn replayed_peak(snapshot: &Value) -> i128 {
    let end: i128 = list(field(snapshot, "segments"))
        .iter()
        .flat_map(|s| list(field(s, "blocks")))
        .filter(|b| string(field(b, "state")) == "active_allocated")
        .map(|b| int(field(b, "size")))
        .sum();
    let trace = &list(field(snapshot, "device_traces"))[0];
    let delta = |e: &Value| match string(field(e, "action")) {
        "alloc" => int(field(e, "size")),
        "free_completed" => -int(field(e, "size")),
        _ => 0,
    };
    let mut now = end - list(trace).iter().map(delta).sum::<i128>();
    let mut peak = now;
    for e in list(trace) {
        now += delta(e);
        peak = peak.max(now);
    }
    peak
}

/// Checks the snapshot's structure against `torch.cuda.memory._snapshot()`'s and returns the
/// frame names of its trace.
fn check_snapshot_structure(snapshot: &Value) -> BTreeSet<String> {
    let traces = list(field(snapshot, "device_traces"));
    assert_eq!(traces.len(), 1, "one device");
    let mut names = BTreeSet::new();
    let mut alive = BTreeSet::new();
    for e in list(&traces[0]) {
        let action = string(field(e, "action"));
        assert!(
            ["alloc", "free_requested", "free_completed", "oom"].contains(&action),
            "{action}"
        );
        let (addr, size) = (int(field(e, "addr")), int(field(e, "size")));
        assert_eq!(int(field(e, "stream")), 0);
        let frames = list(field(e, "frames"));
        assert!(!frames.is_empty(), "every entry has a frame");
        for f in frames {
            assert!(!string(field(f, "filename")).is_empty());
            int(field(f, "line"));
            names.insert(string(field(f, "name")).to_string());
        }
        match action {
            "alloc" => {
                assert!(size > 0 && addr > 0);
                assert!(alive.insert(addr), "an address is allocated twice");
            }
            "free_completed" => {
                alive.remove(&addr);
            }
            _ => {}
        }
    }
    let mut seen = BTreeSet::new();
    for s in list(field(snapshot, "segments")) {
        assert_eq!(int(field(s, "device")), 0);
        let blocks = list(field(s, "blocks"));
        let total: i128 = blocks.iter().map(|b| int(field(b, "size"))).sum();
        assert_eq!(
            int(field(s, "total_size")),
            total,
            "blocks fill their segment"
        );
        for k in ["allocated_size", "active_size", "requested_size", "stream"] {
            int(field(s, k));
        }
        string(field(s, "segment_type"));
        for b in blocks {
            seen.insert(int(field(b, "address")));
            assert_eq!(int(field(b, "address")), int(field(s, "address")));
            assert_eq!(string(field(b, "state")), "active_allocated");
            list(field(b, "frames"));
        }
    }
    // Every block allocated in the trace and not freed is a segment at the end.
    assert!(
        alive.is_subset(&seen),
        "live blocks missing from the segments"
    );
    names
}

/// The names a frame gives the step's layer events (`stage1.block1 forward`, ...).
fn timeline_names(timeline: &Json) -> BTreeSet<String> {
    timeline["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let layer = e["layer"].as_str().unwrap();
            let phase = e["phase"].as_str().unwrap();
            if phase == "optimizer" || layer.contains("recompute") {
                layer.to_string()
            } else {
                format!("{layer} {phase}")
            }
        })
        .chain(["end of the step".to_string()])
        .collect()
}

#[test]
fn a_three_step_cpu_run_leaves_the_three_viewer_files() {
    let dir = common::temp_dir("viewers-run").join("run");
    run_ok(&dir, &["--max-steps", "3"]);

    // TensorBoard: the version first, the configuration as text, every step's scalars once.
    let ev = events(&dir);
    assert_eq!(
        ev[0].what,
        Some(What::FileVersion("brain.Event:2".into())),
        "first record"
    );
    let text = ev.iter().find_map(|e| match &e.what {
        Some(What::Summary(s)) if s.value[0].tag == "config" => Some(s.value[0].clone()),
        _ => None,
    });
    let text = text.expect("the configuration as text");
    let plugin = text.metadata.unwrap().plugin_data.unwrap().plugin_name;
    assert_eq!(plugin, "text");
    let Some(tb::Value::Tensor(t)) = text.value else {
        panic!("a string tensor")
    };
    assert!(String::from_utf8_lossy(&t.string_val[0]).contains("\"batch_size\": 64"));
    let losses = scalars(&ev, "train/loss");
    assert_eq!(
        losses.iter().map(|s| s.0).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    let csv = std::fs::read_to_string(dir.join("batches.csv")).unwrap();
    let first_loss: f64 = csv
        .lines()
        .nth(1)
        .unwrap()
        .split(',')
        .nth(4)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(losses[0].1, first_loss as f32, "the loss of batches.csv");
    for tag in [
        "train/lr",
        "train/images_per_sec",
        "train/grad_norm",
        "memory/step_added_MiB",
        "memory/rss_MiB",
    ] {
        assert_eq!(scalars(&ev, tag).len(), 3, "{tag} at every step");
    }
    let peaks = scalars(&ev, "memory/step_peak_MiB");
    let mib = |b: u64| (b as f64 / (1024.0 * 1024.0)) as f32;
    assert_eq!(peaks[2], (3, mib(measured_step_peak(&dir, 3))));
    for tag in [
        "epoch/train_loss",
        "epoch/train_accuracy",
        "epoch/eval_loss",
        "epoch/eval_accuracy",
        "epoch/eval_peak_MiB",
    ] {
        assert_eq!(
            scalars(&ev, tag).iter().map(|s| s.0).collect::<Vec<_>>(),
            vec![1],
            "{tag}"
        );
    }

    // memory_viz: the last step, its structure, frames naming its layer events, the peak.
    let timeline = json(&dir.join(STEP_TIMELINE_FILE));
    let snapshot = read_pickle(&dir.join(MEMORY_SNAPSHOT_FILE));
    let names = check_snapshot_structure(&snapshot);
    assert!(names.contains("stage2.block1 backward"), "{names:?}");
    let known = timeline_names(&timeline);
    let strangers: Vec<_> = names
        .iter()
        .filter(|n| !known.contains(*n) && !n.starts_with("in use before"))
        .collect();
    assert!(
        strangers.is_empty(),
        "frames naming no layer event: {strangers:?}"
    );
    assert_eq!(
        replayed_peak(&snapshot),
        measured_step_peak(&dir, 3) as i128,
        "the replayed trace's peak is the step's measured peak"
    );

    // Perfetto: a slice per event, in order and back to back; counters that add up to the
    // timeline's bytes.
    let trace = json(&dir.join(STEP_TRACE_FILE));
    let tl_events = timeline["events"].as_array().unwrap();
    let te = trace["traceEvents"].as_array().unwrap();
    let slices: Vec<&Json> = te.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(slices.len(), tl_events.len());
    let mut end = 0;
    for (s, e) in slices.iter().zip(tl_events) {
        assert_eq!(s["name"], e["layer"]);
        assert_eq!(s["ts"].as_u64().unwrap(), end, "slices follow each other");
        end += s["dur"].as_u64().unwrap();
        assert_eq!(
            Some(end),
            e["end_us"].as_u64(),
            "the slice ends at the event"
        );
        assert!(
            ["forward", "backward", "recompute", "optimizer"].contains(&s["cat"].as_str().unwrap())
        );
    }
    let counters: Vec<&Json> = te.iter().filter(|e| e["name"] == MEMORY_COUNTER).collect();
    assert_eq!(counters.len(), tl_events.len());
    for (c, e) in counters.iter().zip(tl_events) {
        let args = c["args"].as_object().unwrap();
        for k in [
            "saved activations",
            "gradients",
            "optimizer state",
            "transient",
            "other",
        ] {
            assert!(args.contains_key(k), "{k}");
        }
        let total: u64 = args.values().map(|v| v.as_u64().unwrap()).sum();
        assert_eq!(
            total,
            e["current_bytes"].as_u64().unwrap(),
            "totals match the timeline"
        );
        assert_eq!(args["saved activations"], e["categories"]["saved"]);
        assert_eq!(c["ts"], e["end_us"]);
    }
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn the_chosen_step_is_snapshot_and_a_step_past_the_run_is_refused() {
    let dir = common::temp_dir("viewers-step").join("run");
    run_ok(
        &dir,
        &[
            "--max-steps",
            "3",
            "--no-eval",
            "--memory-snapshot-step",
            "2",
        ],
    );
    let snapshot = read_pickle(&dir.join(MEMORY_SNAPSHOT_FILE));
    let trace = &list(field(&snapshot, "device_traces"))[0];
    let frame = &list(field(&list(trace)[0], "frames"))[0];
    assert!(string(field(frame, "filename")).starts_with("memtrain step 2 "));
    assert_eq!(
        replayed_peak(&snapshot),
        measured_step_peak(&dir, 2) as i128
    );

    let o = train(
        &[
            BASE,
            &[
                "--max-steps",
                "3",
                "--no-eval",
                "--memory-snapshot-step",
                "4",
            ],
            &["--out", dir.join("past").to_str().unwrap()],
        ]
        .concat(),
    );
    assert_eq!(o.status.code(), Some(2), "a usage error");
    let err = common::text(&o.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("--memory-snapshot-step 4") && err.contains("from 1 to 3"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn a_resumed_run_continues_the_event_file_without_duplicate_steps() {
    let dir = common::temp_dir("viewers-resume").join("run");
    // Snapshots after steps 2 and 3; then the newest is lost, as if the run was killed after
    // logging step 2 but before saving it.
    run_ok(
        &dir,
        &[
            "--epochs",
            "2",
            "--max-steps",
            "3",
            "--no-eval",
            "--save-every",
            "2",
        ],
    );
    let snaps = dir.join("snapshots");
    std::fs::remove_dir_all(snaps.join("step-000003")).unwrap();
    let _ = std::fs::remove_file(snaps.join("latest"));
    assert_eq!(scalars(&events(&dir), "train/loss").len(), 3);
    let o = train(&[
        "--resume",
        dir.to_str().unwrap(),
        "--max-steps",
        "6",
        "--quiet",
    ]);
    common::assert_ok(&o, "the resumed run");
    assert!(
        common::text(&o.stdout).contains("step 2"),
        "{}",
        common::text(&o.stdout)
    );
    let ev = events(&dir);
    let steps: Vec<i64> = scalars(&ev, "train/loss").iter().map(|s| s.0).collect();
    assert_eq!(
        steps,
        (1..=6).collect::<Vec<_>>(),
        "every step once, in order"
    );
    let epochs: Vec<i64> = scalars(&ev, "epoch/train_loss")
        .iter()
        .map(|s| s.0)
        .collect();
    assert_eq!(epochs, vec![1, 2], "each epoch once");
    let versions = ev
        .iter()
        .filter(|e| matches!(e.what, Some(What::FileVersion(_))));
    assert_eq!(versions.count(), 1);
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn an_out_of_memory_step_leaves_its_snapshot_with_an_oom_entry() {
    let dir = common::temp_dir("viewers-oom");
    let free = dir.join("free");
    run_ok(&free, &["--max-steps", "1", "--no-eval"]);
    let s = json(&free.join("summary.json"));
    let (base, peak) = (
        s["baseline_bytes"].as_u64().unwrap(),
        s["step_peak_bytes"].as_u64().unwrap(),
    );
    // A heap budget between the forward's needs and the step's peak, started past the
    // prediction (which refuses it) so that the step runs out part-way. 10% short of the peak
    // (about 2 MiB here): each process measures its own reserve outside the heap, and on a busy
    // machine two measurements differ by more than the 3% this test once left.
    let budget = base + (peak - base) * 9 / 10;
    let flags = [BASE, &["--max-steps", "1", "--no-eval"]].concat();
    let limit = common::limit_for_heap(|| common::trainer_command(&flags), budget);
    let out = dir.join("limited");
    let o = common::trainer_command(
        &[
            &flags[..],
            &["--out", out.to_str().unwrap()],
            &["--memory-limit", &limit.to_string()],
        ]
        .concat(),
    )
    .env(memtrain::predict::bounds::RUN_PAST_PREDICTION_ENV, "1")
    .output()
    .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", common::text(&o.stderr));
    let snapshot = read_pickle(&out.join(OOM_MEMORY_SNAPSHOT_PICKLE));
    check_snapshot_structure(&snapshot);
    let trace = list(&list(field(&snapshot, "device_traces"))[0]);
    let last = trace.last().unwrap();
    assert_eq!(string(field(last, "action")), "oom");
    let name = string(field(&list(field(last, "frames"))[0], "name"));
    assert!(name.starts_with("out of memory at stage"), "{name}");
    assert!(
        !out.join(MEMORY_SNAPSHOT_FILE).exists(),
        "no step ended well"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn entry(action: Action, addr: u64, size: u64) -> TraceEntry {
    TraceEntry { addr, size, action }
}

#[test]
fn a_trace_becomes_a_snapshot_whose_replay_is_the_trace() {
    use Action::*;
    // 1000 bytes before the step, 100 of them (at 0x50) freed by it; a block grown in place
    // (free, then alloc at the same address); two blocks alive at the end.
    let trace = Trace::new(
        1000,
        vec![
            entry(Alloc, 0x10, 300),
            entry(Mark, 0, 0),
            entry(Alloc, 0x20, 500),
            entry(Free, 0x50, 100),
            entry(Free, 0x10, 300),
            entry(Alloc, 0x10, 400),
            entry(Mark, 0, 0),
            entry(Free, 0x20, 500),
        ],
    );
    assert_eq!(trace.peak_bytes(), 1800);
    assert_eq!(trace.end_bytes, 1300);
    let timeline = memtrain_core::memory::timeline::StepTimeline::default();
    let s = memviz::snapshot(&trace, &timeline, None).unwrap();
    assert_eq!(memviz::replay_peak(&s), 1800);
    let alive: i64 = s.segments.iter().map(|s| s.total_size).sum();
    assert_eq!(alive, 1300, "the segments are the end");
    assert_eq!(
        s.segments[0].address, 0,
        "what was there before: one block at 0"
    );
    assert_eq!(s.segments[0].total_size, 900);
    assert_eq!(s.device_traces[0].len(), 3 + 2 * 3);
    // Written and read back, the same.
    let dir = common::temp_dir("viewers-unit");
    let path = dir.join("s.pickle");
    memviz::write(&path, &s).unwrap();
    assert_eq!(replayed_peak(&read_pickle(&path)), 1800);
    // Streamed from the trace (what a run writes), the same bytes, with and without an oom mark.
    for oom in [
        None,
        Some(memviz::OomMark {
            limit: 1500,
            peak: 1800,
        }),
    ] {
        let whole = dir.join("whole.pickle");
        let streamed = dir.join("streamed.pickle");
        memviz::write(&whole, &memviz::snapshot(&trace, &timeline, oom).unwrap()).unwrap();
        memviz::write_trace(&streamed, &trace, &timeline, oom).unwrap();
        assert_eq!(
            std::fs::read(&whole).unwrap(),
            std::fs::read(&streamed).unwrap()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_torn_or_corrupt_record_ends_the_event_file() {
    let a = tb::record(&tb::file_version());
    let b = tb::record(&tb::scalars(3, &[("train/loss", 1.5)]));
    let whole = [a.clone(), b.clone()].concat();
    assert_eq!(tb::read_records(&whole).0.len(), 2);
    let torn = &whole[..whole.len() - 1];
    assert_eq!(tb::read_records(torn), (tb::read_records(&a).0, a.len()));
    let mut bad = whole.clone();
    let at = a.len() + 14;
    bad[at] ^= 1;
    assert_eq!(
        tb::read_records(&bad).0.len(),
        1,
        "a bad checksum stops the reading"
    );
}
