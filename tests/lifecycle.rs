//! A run's life across kills, signals, resumes and second processes: the logs keep every finished
//! step, a resumed run's files describe the whole run (equal to an uninterrupted run's in
//! everything but timings and memory readings), an interrupted evaluation is redone, snapshot
//! metadata is covered by the integrity check, one process writes a run directory at a time,
//! finished results are never replaced unasked, and a divergence keeps the last healthy
//! snapshot.

mod common;

use common::{
    assert_ok, copy_dir, flags, run_trainer as run, snapshot, spawn_trainer as spawn, text,
};
use memtrain::train::snapshot::{Snapshot, DIVERGED_DIR, MANIFEST_FILE, SNAPSHOTS_DIR};
use memtrain::train::{RunStatus, Trainer, TrainerOptions};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Output};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// Helpers

/// 16 steps per epoch, 3 epochs, evaluation on, a snapshot every 3 steps.
const FAST: &str =
    "--synthetic-train 512 --synthetic-test 64 --width 8 --batch-size 32 --epochs 3 \
                    --save-every 3 --quiet --device cpu --seed 3";
const FAST_STEPS: usize = 48;
/// 8 steps per epoch, 2 epochs, an evaluation long enough (20,000 images) to be signalled in.
const SLOW_EVAL: &str = "--synthetic-train 256 --synthetic-test 20000 --width 4 --batch-size 32 \
                         --epochs 2 --quiet --device cpu --seed 5";

fn with_out(base: &str, out: &Path) -> Vec<String> {
    let mut a = flags(base);
    a.push("--out".into());
    a.push(out.display().to_string());
    a
}

fn resume_args(out: &Path) -> Vec<String> {
    vec!["--resume".into(), out.display().to_string()]
}

/// Complete rows (with their newline) of `batches.csv`.
fn batch_rows(run_dir: &Path) -> usize {
    std::fs::read_to_string(run_dir.join("batches.csv"))
        .map(|t| t.matches('\n').count().saturating_sub(1))
        .unwrap_or(0)
}

/// Wait until `run_dir/batches.csv` has at least `rows` rows; fails if the child exits first.
fn wait_for_rows(child: &mut Child, run_dir: &Path, rows: usize) {
    let start = Instant::now();
    while batch_rows(run_dir) < rows {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the child exited ({status}) before writing {rows} batch rows");
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no {rows} rows after 2 minutes"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

fn finish(child: Child) -> Output {
    child.wait_with_output().expect("wait for the child")
}

fn json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// The columns of a CSV that do not depend on timing or memory readings.
fn csv_columns(path: &Path, keep: &[&str]) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let idx: Vec<usize> = keep
        .iter()
        .map(|k| header.iter().position(|h| h == k).unwrap())
        .collect();
    lines
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            idx.iter().map(|&i| f[i]).collect::<Vec<_>>().join(",")
        })
        .collect()
}

const BATCH_COLUMNS: &[&str] = &[
    "epoch",
    "batch",
    "global_step",
    "images",
    "loss",
    "lr",
    "loss_scale",
    "skipped",
    "grad_norm",
];
const EPOCH_COLUMNS: &[&str] = &[
    "epoch",
    "steps",
    "images",
    "train_loss",
    "train_accuracy",
    "eval_loss",
    "eval_accuracy",
    "lr",
    "loss_scale",
    "skipped_steps",
];
const SUMMARY_FIELDS: &[&str] = &[
    "status",
    "steps",
    "epochs_completed",
    "images",
    "final_train_loss",
    "final_test_accuracy",
    "final_test_loss",
    "num_params",
];

/// A resumed run's files equal an uninterrupted run's in everything but timings and memory.
fn assert_same_run(got: &Path, want: &Path) {
    assert_eq!(
        csv_columns(&got.join("batches.csv"), BATCH_COLUMNS),
        csv_columns(&want.join("batches.csv"), BATCH_COLUMNS),
        "batches.csv"
    );
    assert_eq!(
        csv_columns(&got.join("epochs.csv"), EPOCH_COLUMNS),
        csv_columns(&want.join("epochs.csv"), EPOCH_COLUMNS),
        "epochs.csv"
    );
    let (g, w) = (
        json(&got.join("summary.json")),
        json(&want.join("summary.json")),
    );
    for f in SUMMARY_FIELDS {
        assert_eq!(g[f], w[f], "summary.json {f}");
    }
    let (g, w) = (
        json(&got.join("memory.json")),
        json(&want.join("memory.json")),
    );
    let steps = |m: &Value| -> (u64, u64, u64, u64) {
        let b = &m["last_batch"];
        (
            m["steps"].as_u64().unwrap(),
            b["epoch"].as_u64().unwrap(),
            b["batch"].as_u64().unwrap(),
            b["global_step"].as_u64().unwrap(),
        )
    };
    assert_eq!(steps(&g), steps(&w), "memory.json steps");
    let epochs = |m: &Value| -> Vec<(u64, u64)> {
        m["epochs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["epoch"].as_u64().unwrap(), e["steps"].as_u64().unwrap()))
            .collect()
    };
    assert_eq!(epochs(&g), epochs(&w), "memory.json epochs");
}

/// An uninterrupted run of `base`, made once per test process.
fn reference(base: &'static str, cell: &'static OnceLock<PathBuf>, name: &str) -> &'static Path {
    cell.get_or_init(|| {
        let dir = common::scratch("lifecycle", &format!("reference-{name}")).join("run");
        assert_ok(&run(&with_out(base, &dir)), "the reference run");
        dir
    })
}

fn fast_reference() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    reference(FAST, &CELL, "fast")
}

fn slow_eval_reference() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    reference(SLOW_EVAL, &CELL, "slow-eval")
}

fn step_dirs(run_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(run_dir.join(SNAPSHOTS_DIR))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-") || n.starts_with('.'))
        .collect();
    names.sort();
    names
}

fn newest_step_dir(run_dir: &Path) -> PathBuf {
    let name = step_dirs(run_dir)
        .into_iter()
        .rfind(|n| n.starts_with("step-"))
        .expect("a snapshot");
    run_dir.join(SNAPSHOTS_DIR).join(name)
}

fn one_line_error(out: &Output, code: i32, needle: &str) {
    let stderr = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(code),
        "exit code; stderr:\n{stderr}"
    );
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "one error line:\n{stderr}");
    assert!(errors[0].contains(needle), "'{needle}' in: {}", errors[0]);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

// ---------------------------------------------------------------------------------------------
// Logs survive kills; a resumed run describes the whole run

#[test]
fn kill_resume_cycles_keep_every_row_and_the_whole_run_in_the_summary() {
    let dir = common::scratch("lifecycle", "cycles").join("run");
    // Three SIGKILLs at different points, each followed by a torn row as a kill mid-write
    // leaves it, then a resume to the end.
    let mut args = with_out(FAST, &dir);
    for (cycle, rows) in [10usize, 22, 37].into_iter().enumerate() {
        let mut child = spawn(&args);
        wait_for_rows(&mut child, &dir, rows);
        signal(&child, libc::SIGKILL);
        let _ = finish(child);
        // Every finished step's row reached the file before the kill.
        assert!(batch_rows(&dir) >= rows, "cycle {cycle}: rows lost");
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.join("batches.csv"))
            .unwrap();
        write!(f, "1,2,99,32,2.3").unwrap();
        args = resume_args(&dir);
    }
    assert_ok(&run(&args), "the final resume");
    assert_eq!(batch_rows(&dir), FAST_STEPS);
    assert_same_run(&dir, fast_reference());
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn sigterm_mid_epoch_then_resume_equals_an_uninterrupted_run() {
    let dir = common::scratch("lifecycle", "term-mid").join("run");
    let mut child = spawn(&with_out(FAST, &dir));
    wait_for_rows(&mut child, &dir, 20);
    signal(&child, libc::SIGTERM);
    let out = finish(child);
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    let s = json(&dir.join("summary.json"));
    assert_eq!(s["status"], "interrupted");
    // The summary of the interrupted run counts what it trained.
    assert_eq!(
        s["images"].as_u64(),
        Some(32 * s["steps"].as_u64().unwrap())
    );
    assert_ok(&run(&resume_args(&dir)), "the resume");
    assert_same_run(&dir, fast_reference());
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

// ---------------------------------------------------------------------------------------------
// Interrupted evaluations are redone

/// SIGTERM once `rows` steps are logged (the run is then in that epoch's evaluation, or just
/// before it); the run stops with 130 and a resume finishes it equal to the reference.
fn sigterm_in_evaluation(rows: usize, name: &str) {
    let reference = slow_eval_reference();
    let dir = common::scratch("lifecycle", name).join("run");
    let mut child = spawn(&with_out(SLOW_EVAL, &dir));
    wait_for_rows(&mut child, &dir, rows);
    signal(&child, libc::SIGTERM);
    let out = finish(child);
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    let stopped = json(&dir.join("summary.json"));
    assert_eq!(stopped["status"], "interrupted");
    assert_eq!(
        stopped["epochs_completed"].as_u64(),
        Some(rows as u64 / 8 - 1)
    );
    assert!(text(&out.stderr).contains("--resume"));

    let out = run(&resume_args(&dir));
    assert_ok(&out, "the resume");
    let done = json(&dir.join("summary.json"));
    assert_eq!(done["status"], "ok");
    assert!(done["final_test_accuracy"].is_number());
    assert_same_run(&dir, reference);
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn sigterm_during_the_final_evaluation_is_finished_by_resume() {
    sigterm_in_evaluation(16, "term-final-eval");
}

#[test]
fn sigterm_during_an_epoch_evaluation_is_redone_on_resume() {
    sigterm_in_evaluation(8, "term-epoch-eval");
}

#[test]
fn stop_before_the_first_step_leaves_a_checkpoint_that_resume_finishes() {
    let dir = common::scratch("lifecycle", "stop-at-start").join("run");
    let mut cfg = common::tiny_config();
    cfg.output.out = Some(dir.clone());
    cfg.steps.max_steps = Some(4);
    let data = || common::splits(cfg.data.synthetic_train, cfg.data.synthetic_test, cfg.seed);
    let options = TrainerOptions {
        log_files: true,
        stop: Some(Arc::new(AtomicBool::new(true))),
        ..Default::default()
    };
    let mut t = Trainer::new(cfg.clone(), data(), options).unwrap();
    let summary = t.fit().unwrap();
    assert_eq!(summary.status, RunStatus::Interrupted);
    assert_eq!(summary.progress.steps, 0);
    drop(t);
    let ck = Snapshot::find_latest(&dir).expect("a snapshot of the start");
    assert_eq!(ck.state.global_step, 0);
    let options = TrainerOptions {
        log_files: true,
        ..Default::default()
    };
    let mut t = Trainer::new(ck.resume_config(&cfg, false).unwrap(), data(), options).unwrap();
    t.resume(ck).unwrap();
    let summary = t.fit().unwrap();
    assert_eq!((summary.status, summary.progress.steps), (RunStatus::Ok, 4));
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

// ---------------------------------------------------------------------------------------------
// Integrity of every snapshot file, metadata included

/// A finished FAST run copied to a fresh directory.
fn finished_copy(name: &str) -> PathBuf {
    let dir = common::scratch("lifecycle", name).join("run");
    copy_dir(fast_reference(), &dir);
    dir
}

#[test]
fn a_changed_byte_in_checkpoint_metadata_is_detected() {
    // The flip the issue reported: an epoch counter in snapshot.json; then a file's hash in
    // it, and a byte of history.json (covered by the manifest like the tensors).
    let edits: [(&str, &str, &str); 3] = [
        (MANIFEST_FILE, "\"epoch\": 3", "\"epoch\": 4"),
        (MANIFEST_FILE, "\"next_batch\": 0", "\"next_batch\": 1"),
        ("history.json", "\"epoch\":0", "\"epoch\":1"),
    ];
    for (i, (file, from, to)) in edits.into_iter().enumerate() {
        let dir = finished_copy(&format!("flip-{i}"));
        let newest = newest_step_dir(&dir);
        let path = newest.join(file);
        let text_before = std::fs::read_to_string(&path).unwrap();
        assert!(text_before.contains(from), "{file} holds {from}");
        std::fs::write(&path, text_before.replacen(from, to, 1)).unwrap();
        let out = run(&resume_args(&dir));
        assert_ok(&out, "resuming past a damaged newest snapshot");
        let stderr = text(&out.stderr);
        assert!(
            stderr
                .lines()
                .any(|l| l.starts_with("warning:") && l.contains(&newest.display().to_string())),
            "{file}: the damaged snapshot is named:\n{stderr}"
        );
        // The older snapshot's steps were trained again, to the same end.
        assert_same_run(&dir, fast_reference());
        let _ = std::fs::remove_dir_all(dir.parent().unwrap());
    }
}

#[test]
fn a_fifo_in_place_of_a_checkpoint_file_does_not_block() {
    let dir = finished_copy("fifo-file");
    let newest = newest_step_dir(&dir);
    let model = newest.join("model.safetensors");
    std::fs::remove_file(&model).unwrap();
    let c = std::ffi::CString::new(model.display().to_string()).unwrap();
    // SAFETY: mkfifo(3) on a path we own.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let mut child = spawn(&resume_args(&dir));
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the resume blocks on a FIFO"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = finish(child);
    assert_ok(&out, "resuming with a FIFO as a snapshot file");
    assert!(text(&out.stderr).contains("not a regular file"));
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn an_older_format_checkpoint_is_named_as_such() {
    let dir = finished_copy("old-format");
    // Version 1 wrote the state unsigned; make every snapshot look like that.
    for name in step_dirs(&dir)
        .into_iter()
        .filter(|n| n.starts_with("step-"))
    {
        let path = dir.join(SNAPSHOTS_DIR).join(name).join(MANIFEST_FILE);
        let mut state = json(&path)["state"].clone();
        state["version"] = 1.into();
        std::fs::write(&path, serde_json::to_vec(&state).unwrap()).unwrap();
    }
    one_line_error(
        &run(&resume_args(&dir)),
        1,
        "snapshot format version 1 (this build reads version 2)",
    );
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

// ---------------------------------------------------------------------------------------------
// Kills during snapshot pruning

#[test]
fn leftovers_of_a_kill_during_pruning_are_removed_by_the_resume() {
    let dir = finished_copy("prune-kill");
    let root = dir.join(SNAPSHOTS_DIR);
    let newest = newest_step_dir(&dir);
    // What a kill in the middle of pruning leaves: an old snapshot not yet removed, one
    // half-removed (its manifest gone), and one renamed for removal.
    copy_dir(&newest, &root.join("step-000003"));
    copy_dir(&newest, &root.join("step-000006"));
    std::fs::remove_file(root.join("step-000006").join(MANIFEST_FILE)).unwrap();
    copy_dir(&newest, &root.join(".old-step-000009-12345"));
    let out = run(&resume_args(&dir));
    assert_ok(&out, "resuming a finished run with leftovers");
    assert!(text(&out.stdout).contains("no steps left to train"));
    // The one renamed for removal is named as such, not as half-written (issue 52).
    let warning = text(&out.stderr)
        .lines()
        .find(|l| l.contains(".old-step-000009"))
        .map(str::to_string);
    let warning = warning.unwrap_or_else(|| panic!("{}", text(&out.stderr)));
    assert!(
        warning.contains("an older snapshot the process was deleting")
            && !warning.contains("incomplete"),
        "{warning}"
    );
    let names = step_dirs(&dir);
    assert_eq!(
        names,
        vec!["step-000045".to_string(), "step-000048".to_string()],
        "only the newest two snapshots stay"
    );
    // A second resume has nothing to warn about.
    let out = run(&resume_args(&dir));
    assert_ok(&out, "a second resume");
    assert!(
        !text(&out.stderr).contains("warning"),
        "{}",
        text(&out.stderr)
    );
    assert_same_run(&dir, fast_reference());
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

// ---------------------------------------------------------------------------------------------
// One writer per run directory; finished results are not replaced unasked

/// A run long enough to be alive while a second process starts.
fn long_run(dir: &Path) -> Child {
    let mut child = spawn(&with_out(&FAST.replace("--epochs 3", "--epochs 200"), dir));
    wait_for_rows(&mut child, dir, 5);
    child
}

#[test]
fn a_second_process_on_the_same_run_directory_is_refused() {
    let dir = common::scratch("lifecycle", "two-writers").join("run");
    let mut first = long_run(&dir);
    let config_before = std::fs::read(dir.join("config.json")).unwrap();

    // A second new run with the same --out (told it is in use, not to pass --overwrite, which
    // could not help: issue 52), with --overwrite, and a second --resume.
    let mut second = with_out(&FAST.replace("--seed 3", "--seed 11"), &dir);
    one_line_error(&run(&second), 2, "in use by another memtrain process");
    second.push("--overwrite".into());
    one_line_error(&run(&second), 2, "in use by another memtrain process");
    assert_eq!(
        std::fs::read(dir.join("config.json")).unwrap(),
        config_before
    );
    signal(&first, libc::SIGKILL);
    let _ = finish(first);

    first = spawn(&resume_args(&dir));
    let rows = batch_rows(&dir);
    wait_for_rows(&mut first, &dir, rows + 1);
    one_line_error(
        &run(&resume_args(&dir)),
        2,
        "in use by another memtrain process",
    );
    assert_eq!(
        std::fs::read(dir.join("config.json")).unwrap(),
        config_before
    );
    signal(&first, libc::SIGKILL);
    let _ = finish(first);
    // The run goes on from its snapshot (the SIGKILL above may have left a half-written one,
    // which the resume skips; the refused processes wrote nothing).
    Snapshot::find_latest(&dir).expect("the run is still resumable");
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn finished_results_are_refused_unless_overwrite() {
    let dir = finished_copy("overwrite");
    one_line_error(
        &run(&[resume_args(&dir), flags("--overwrite")].concat()),
        2,
        "--overwrite starts a new run",
    );
    let before = snapshot(&dir);
    one_line_error(
        &run(&with_out(FAST, &dir)),
        2,
        "already holds snapshots of an earlier run",
    );
    assert!(
        before == snapshot(&dir),
        "the refused run changed the directory"
    );

    // Without snapshots (a sweep child's or a run with snapshots removed) the results alone
    // are enough to refuse.
    std::fs::remove_dir_all(dir.join(SNAPSHOTS_DIR)).unwrap();
    one_line_error(
        &run(&with_out(FAST, &dir)),
        2,
        "summary.json says status ok",
    );

    // --overwrite: the earlier run's files go, a stale OOM report included; other files stay.
    std::fs::write(dir.join("oom_report.json"), "{}").unwrap();
    std::fs::write(dir.join("notes.txt"), "mine").unwrap();
    let mut args = with_out(&FAST.replace("--epochs 3", "--epochs 1"), &dir);
    args.push("--overwrite".into());
    assert_ok(&run(&args), "--overwrite");
    assert!(!dir.join("oom_report.json").exists());
    assert_eq!(
        std::fs::read_to_string(dir.join("notes.txt")).unwrap(),
        "mine"
    );
    assert_eq!(json(&dir.join("summary.json"))["epochs_completed"], 1);
    assert_eq!(json(&dir.join("config.json"))["epochs"], 1);
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

// ---------------------------------------------------------------------------------------------
// Divergence keeps the snapshot from before the loss blew up

#[test]
fn divergence_sets_aside_checkpoints_written_while_the_loss_blew_up() {
    let dir = common::scratch("lifecycle", "diverge").join("run");
    // lr 60 without clipping (a 24-step run warms up to 16 of it): the loss climbs over several
    // steps (53, 481, 7e3, ...) before the state turns non-finite, so a snapshot after every step
    // holds wrecked weights.
    let args = flags(
        "--synthetic-train 256 --synthetic-test 32 --width 4 --batch-size 32 --no-eval --epochs 3 \
         --lr 60 --clip-grad-norm 0 --save-every 1 --quiet --device cpu --seed 0",
    );
    let mut first = args.clone();
    first.extend(["--out".into(), dir.display().to_string()]);
    let out = run(&first);
    one_line_error(&out, 1, "the snapshot from before the loss blew up (step ");
    let ck = Snapshot::find_latest(&dir).expect("the healthy snapshot stays");
    assert!(ck.healthy, "the newest snapshot left is healthy");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(&format!("(step {})", ck.state.global_step)),
        "the message names it: {stderr}"
    );
    let aside = dir.join(SNAPSHOTS_DIR).join(DIVERGED_DIR);
    assert!(
        std::fs::read_dir(&aside).unwrap().count() > 0,
        "the unhealthy snapshots are kept aside"
    );
    // Every loss the healthy snapshot was trained through was sane.
    let losses = csv_columns(&dir.join("batches.csv"), &["global_step", "loss"]);
    for row in &losses[..ck.state.global_step] {
        let loss: f64 = row.split(',').nth(1).unwrap().parse().unwrap();
        assert!(loss <= memtrain::train::snapshot::DIVERGED_LOSS, "{row}");
    }
    let mut again = resume_args(&dir);
    again.extend(flags("--lr 0.05"));
    assert_ok(
        &run(&again),
        "resuming the healthy snapshot with a lower --lr",
    );
    assert_eq!(json(&dir.join("summary.json"))["status"], "ok");
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn a_max_steps_cut_epoch_keeps_its_evaluation_whatever_the_save_interval() {
    // A run cut by --max-steps inside an epoch evaluates there; extended by a resume with a
    // larger --max-steps, it continues the epoch and ends it once. With a snapshot after every step the epoch
    // end is a second snapshot of the same step, not a skipped one.
    let root = common::scratch("lifecycle", "max-steps-cut");
    let mut tables = Vec::new();
    for save_every in ["0", "1"] {
        let dir = root.join(format!("save-every-{save_every}"));
        let mut first = flags(
            "--synthetic-train 64 --synthetic-test 16 --width 4 --batch-size 32 --epochs 2 \
             --max-steps 1 --quiet --device cpu",
        );
        first.extend(["--save-every".into(), save_every.into(), "--out".into()]);
        first.push(dir.display().to_string());
        assert_ok(&run(&first), "the cut run");
        // The cut run reports the part of the epoch it trained, evaluated.
        let cut = std::fs::read_to_string(dir.join("epochs.csv")).unwrap();
        let rows: Vec<&str> = cut.lines().skip(1).collect();
        assert_eq!(rows.len(), 1, "{cut}");
        assert!(rows[0].starts_with("1,1,"), "{cut}");
        let mut more = resume_args(&dir);
        more.extend(flags("--max-steps 3"));
        assert_ok(&run(&more), "the extended run");
        tables.push(csv_columns(&dir.join("epochs.csv"), EPOCH_COLUMNS));
    }
    assert_eq!(tables[0], tables[1]);
    let epochs: Vec<&str> = tables[0].iter().map(|r| &r[..1]).collect();
    // The extension ends the cut epoch once: its row replaces the cut run's.
    assert_eq!(epochs, ["1", "2"], "{:?}", tables[0]);
    let _ = std::fs::remove_dir_all(&root);
}
