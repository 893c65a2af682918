//! What a run keeps does not grow with its steps (issue 25, class 8): the memory log and the
//! history in memory, and so in every snapshot, hold the run's maxima, sums and one record per
//! epoch; the per-step records are appended to `batches.csv` in the run directory.

mod common;

use common::{assert_ok, run_trainer, scratch};
use std::path::{Path, PathBuf};

/// The newest snapshot folder of a run directory.
fn newest_snapshot(run: &Path) -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(run.join("snapshots"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("snapshot.json").is_file())
        .collect();
    dirs.sort();
    dirs.pop().expect("a snapshot")
}

/// A run of `steps` steps in one epoch that saves at its last step; the sizes of the snapshot's
/// memory log and history.
fn snapshot_log_sizes(dir: &Path, steps: usize) -> (u64, u64) {
    let run = dir.join(format!("run-{steps}"));
    let o = run_trainer(&[
        "--device",
        "cpu",
        "--width",
        "4",
        "--batch-size",
        "8",
        "--synthetic-train",
        &(8 * steps).to_string(),
        "--synthetic-test",
        "10",
        "--max-steps",
        &steps.to_string(),
        "--save-every",
        &steps.to_string(),
        "--no-eval",
        "--quiet",
        "--out",
        run.to_str().unwrap(),
    ]);
    assert_ok(&o, "training run");
    let rows = std::fs::read_to_string(run.join("batches.csv")).unwrap();
    assert_eq!(rows.lines().count(), steps + 1, "every step has its row");
    let snap = newest_snapshot(&run);
    let size = |f: &str| std::fs::metadata(snap.join(f)).unwrap().len();
    (size("memory.json"), size("history.json"))
}

#[test]
fn snapshots_do_not_grow_with_the_steps() {
    let dir = scratch("growth", "snapshot");
    let (mem_short, hist_short) = snapshot_log_sizes(&dir, 15);
    let (mem_long, hist_long) = snapshot_log_sizes(&dir, 60);
    // Four times the steps: only the digits of the numbers may differ (a per-step record is
    // ~260 bytes of memory.json and ~25 of history.json, so 45 more steps would add ~12 KB).
    for (what, short, long) in [
        ("memory.json", mem_short, mem_long),
        ("history.json", hist_short, hist_long),
    ] {
        assert!(
            long.abs_diff(short) < 200,
            "{what}: {short} bytes after 15 steps, {long} after 60"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_snapshot_that_held_every_step_still_resumes_into_the_same_figures() {
    // The legacy fixture (written by fcb54e6) keeps every step in memory.json and history.json:
    // it resumes, and the run's summary counts the steps before the snapshot.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/legacy-run");
    let dir = scratch("growth", "legacy");
    let run = dir.join("run");
    common::copy_dir(&fixture, &run);
    let o = run_trainer(&[
        "--resume",
        run.to_str().unwrap(),
        "--max-steps",
        "4",
        "--quiet",
    ]);
    assert_ok(&o, "resume of the legacy run");
    let s: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(s["steps"], 4);
    assert!(s["step_peak_bytes"].as_u64().unwrap() > 0);
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("memory.json")).unwrap()).unwrap();
    assert_eq!(
        m["steps"], 4,
        "the legacy snapshot's 2 steps and the 2 new ones"
    );
    assert!(
        m.get("batches").is_none(),
        "per-step records are in batches.csv"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
