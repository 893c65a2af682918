//! Checkpoints and resume: a run killed with SIGKILL or stopped with SIGINT and then resumed ends
//! with bit-identical weights to an uninterrupted run; a diverging run leaves the last snapshot
//! intact; a damaged newest snapshot is skipped for an older one.
//!
//! Most tests run the `train_cifar10` example as a child process (built on first use; a no-op
//! after `cargo test`, which builds the examples anyway).

mod common;

use common::{
    assert_ok, bits, copy_dir, flags, run_trainer as run, snapshot, text,
    trainer_command as command,
};

use candle_core::{Device, Tensor};
use memtrain::callbacks::{BatchInfo, Callback};
use memtrain::config::{Precision, TrainConfig};
use memtrain::data::{synthetic, DataSplits};
use memtrain::train::snapshot::{
    Snapshot, LATEST_FILE, MANIFEST_FILE, MODEL_FILE, OPTIMIZER_FILE, SNAPSHOTS_DIR,
};
use memtrain::train::{Trainer, TrainerOptions};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// Helpers

/// Flags of every child run: 8 steps per epoch, 20 epochs (160 steps), a snapshot every 2 steps.
fn run_args(out: &Path) -> Vec<String> {
    let mut a: Vec<String> =
        "--synthetic-train 256 --synthetic-test 32 --width 4 --batch-size 32 --epochs 20 \
                              --save-every 2 --quiet --no-eval --device cpu --seed 7"
            .split_whitespace()
            .map(String::from)
            .collect();
    a.push("--out".into());
    a.push(out.display().to_string());
    a
}

const TOTAL_STEPS: usize = 160;

/// A child `train_cifar10` with `args`. One compute thread: Candle's CPU convolution sums the
/// weight gradient over threads in completion order, so multi-threaded runs can differ in the
/// last bit from run to run, which would hide what this file tests (resume exactness).
fn spawn(args: &[String]) -> Child {
    command(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("train_cifar10 starts")
}

/// Steps of the complete snapshots in `run_dir`, ascending.
fn checkpoint_steps(run_dir: &Path) -> Vec<usize> {
    let Ok(entries) = std::fs::read_dir(run_dir.join(SNAPSHOTS_DIR)) else {
        return Vec::new();
    };
    let mut steps: Vec<usize> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("step-"))
                .and_then(|n| n.parse().ok())
        })
        .collect();
    steps.sort_unstable();
    steps
}

fn step_dir(run_dir: &Path, step: usize) -> PathBuf {
    run_dir.join(SNAPSHOTS_DIR).join(format!("step-{step:06}"))
}

/// Wait until `child` has written a snapshot of at least `step`; fails if it exits first.
fn wait_for_checkpoint(child: &mut Child, run_dir: &Path, step: usize) {
    let start = Instant::now();
    while checkpoint_steps(run_dir).last().is_none_or(|&s| s < step) {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the child exited ({status}) before writing snapshot {step}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no snapshot {step} after 2 minutes"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Tensors of a safetensors file.
fn tensors(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Two safetensors files hold the same tensors, bit for bit.
fn assert_same_tensors(a: &Path, b: &Path) {
    let (ta, tb) = (tensors(a), tensors(b));
    let mut names: Vec<_> = ta.keys().collect();
    names.sort();
    let mut names_b: Vec<_> = tb.keys().collect();
    names_b.sort();
    assert_eq!(
        names,
        names_b,
        "{} and {} hold different tensors",
        a.display(),
        b.display()
    );
    for name in names {
        assert_eq!(ta[name].shape(), tb[name].shape(), "shape of {name}");
        assert!(
            bits(&ta[name]) == bits(&tb[name]),
            "{name} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

/// Model and optimizer of two snapshots are bit-identical, and so are their counters.
fn assert_same_checkpoint(a: &Path, b: &Path) {
    assert_same_tensors(&a.join(MODEL_FILE), &b.join(MODEL_FILE));
    assert_same_tensors(&a.join(OPTIMIZER_FILE), &b.join(OPTIMIZER_FILE));
    let manifest = |d: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join(MANIFEST_FILE)).unwrap()).unwrap()
    };
    let (ma, mb) = (manifest(a), manifest(b));
    for key in [
        "global_step",
        "epoch",
        "next_batch",
        "optimizer_steps",
        "scaler",
        "train_fingerprint",
    ] {
        assert_eq!(
            ma[key],
            mb[key],
            "{key} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

/// The uninterrupted run every resumed run is compared with (run once per test process).
fn reference() -> &'static Path {
    static REF: OnceLock<PathBuf> = OnceLock::new();
    REF.get_or_init(|| {
        let dir = common::scratch("resume", "reference").join("run");
        let out = run(&run_args(&dir));
        assert_ok(&out, "the uninterrupted run");
        assert_eq!(
            checkpoint_steps(&dir).last(),
            Some(&TOTAL_STEPS),
            "final snapshot of the uninterrupted run"
        );
        dir
    })
}

/// The final snapshot of the reference run.
fn reference_final() -> PathBuf {
    step_dir(reference(), TOTAL_STEPS)
}

/// No temporary or half-replaced snapshot directories are left.
fn assert_no_leftovers(run_dir: &Path) {
    let left: Vec<String> = std::fs::read_dir(run_dir.join(SNAPSHOTS_DIR))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(
        left.is_empty(),
        "leftover directories in {}: {left:?}",
        run_dir.display()
    );
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn kill_9_mid_run_then_resume_gives_bit_identical_weights() {
    let dir = common::scratch("resume", "kill9").join("run");
    let args = run_args(&dir);
    let mut child = spawn(&args);
    wait_for_checkpoint(&mut child, &dir, 3);
    // Child::kill sends SIGKILL on Unix: no handler runs, whatever was being written stays half done.
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "the run finished before it could be killed; give it more --epochs"
    );
    let killed_at = *checkpoint_steps(&dir).last().unwrap();
    assert!(killed_at < TOTAL_STEPS, "killed after the last snapshot");

    let mut resume = args.clone();
    resume.extend(["--resume".to_string(), dir.display().to_string()]);
    let out = run(&resume);
    assert_ok(&out, "the resumed run");
    assert!(
        text(&out.stdout).contains("resuming from"),
        "stdout: {}",
        text(&out.stdout)
    );

    assert_eq!(checkpoint_steps(&dir).last(), Some(&TOTAL_STEPS));
    assert_same_checkpoint(&step_dir(&dir, TOTAL_STEPS), &reference_final());
    assert_eq!(
        checkpoint_steps(&dir).len(),
        2,
        "only the last two snapshots are kept"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join(SNAPSHOTS_DIR).join(LATEST_FILE))
            .unwrap()
            .trim(),
        format!("step-{TOTAL_STEPS:06}")
    );
    assert_no_leftovers(&dir);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "ok");
    assert_eq!(summary["steps"], TOTAL_STEPS);
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[cfg(unix)]
#[test]
fn sigint_saves_checkpoint_and_summary_then_exits_130_and_resumes() {
    let dir = common::scratch("resume", "sigint").join("run");
    let args = run_args(&dir);
    let mut child = spawn(&args);
    wait_for_checkpoint(&mut child, &dir, 6);
    let sent = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    assert!(
        sent.is_ok_and(|s| s.success()),
        "could not send SIGINT with kill(1)"
    );
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(130),
        "exit code after SIGINT; stderr:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    let last = stderr.lines().last().unwrap_or("");
    assert!(
        last.starts_with("error: interrupted:") && last.contains("--resume"),
        "last stderr line: {last}"
    );

    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "interrupted");
    let steps = summary["steps"].as_u64().unwrap() as usize;
    assert!((6..TOTAL_STEPS).contains(&steps), "stopped at step {steps}");
    // The step in flight was finished and saved: the newest snapshot is the summary's step.
    assert_eq!(checkpoint_steps(&dir).last(), Some(&steps));
    assert_no_leftovers(&dir);

    let mut resume = args.clone();
    resume.extend(["--resume".to_string(), dir.display().to_string()]);
    let out = run(&resume);
    assert_ok(&out, "the resumed run");
    assert_same_checkpoint(&step_dir(&dir, TOTAL_STEPS), &reference_final());
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn damaged_newest_checkpoint_is_skipped_with_a_warning() {
    let dir = common::scratch("resume", "damaged").join("run");
    copy_dir(reference(), &dir);
    let newest = step_dir(&dir, TOTAL_STEPS);
    let model = newest.join(MODEL_FILE);
    let mut bytes = std::fs::read(&model).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&model, bytes).unwrap();

    let mut resume = run_args(&dir);
    resume.extend(["--resume".to_string(), dir.display().to_string()]);
    let out = run(&resume);
    assert_ok(&out, "resuming past a damaged snapshot");
    let stderr = text(&out.stderr);
    assert!(
        stderr.lines().any(|l| l.starts_with("warning:")
            && l.contains("damaged")
            && l.contains(&format!("step-{TOTAL_STEPS:06}"))),
        "stderr:\n{stderr}"
    );
    assert!(
        text(&out.stdout).contains(&format!("step {}", TOTAL_STEPS - 2)),
        "resumed from the older snapshot"
    );
    // The two steps from the older snapshot were trained again and the damaged one replaced.
    assert_same_checkpoint(&newest, &reference_final());
    assert_no_leftovers(&dir);
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn finished_run_says_nothing_to_do_and_extends_with_more_epochs() {
    let dir = common::scratch("resume", "extend").join("run");
    copy_dir(reference(), &dir);
    let mut resume = run_args(&dir);
    resume.extend(["--resume".to_string(), dir.display().to_string()]);
    let out = run(&resume);
    assert_ok(&out, "resuming a finished run");
    assert!(
        text(&out.stdout).contains("no steps left to train"),
        "stdout:\n{}",
        text(&out.stdout)
    );

    // Flags left out come from the snapshot; --epochs may grow.
    let out = run(&[
        "--resume".to_string(),
        dir.display().to_string(),
        "--epochs".into(),
        "21".into(),
    ]);
    assert_ok(&out, "extending a finished run");
    assert!(
        text(&out.stdout).contains("epochs: snapshot 20, now 21"),
        "stdout:\n{}",
        text(&out.stdout)
    );
    assert_eq!(checkpoint_steps(&dir).last(), Some(&(TOTAL_STEPS + 8)));
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

/// `column` of `batches.csv` in `run_dir`, by global step.
fn batch_column(run_dir: &Path, column: &str) -> HashMap<usize, u64> {
    let text = std::fs::read_to_string(run_dir.join("batches.csv")).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let at = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let (step, col) = (at("global_step"), at(column));
    lines
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f[step].parse().unwrap(), f[col].parse().unwrap())
        })
        .collect()
}

/// A resumed run is the same run in memory too: what it loaded from the snapshot is freed once
/// it is in the model, so its steps start from (and peak at) what the uninterrupted run's do. A
/// snapshot kept alive beside the model holds at least one copy of the parameters.
#[test]
fn a_resumed_run_holds_no_more_memory_than_the_uninterrupted_one() {
    let root = common::scratch("resume", "memory");
    let args = |dir: &Path, epochs: &str| {
        let mut a = run_args(dir);
        let i = a.iter().position(|f| f == "--epochs").unwrap();
        a[i + 1] = epochs.into();
        a
    };
    let whole = root.join("whole");
    assert_ok(&run(&args(&whole, "2")), "the uninterrupted run");
    let part = root.join("part");
    assert_ok(&run(&args(&part, "1")), "the first epoch");
    let mut resume = args(&part, "2");
    resume.extend(["--resume".to_string(), part.display().to_string()]);
    assert_ok(&run(&resume), "resuming for the second epoch");

    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(whole.join("summary.json")).unwrap())
            .unwrap();
    let params = summary["param_bytes"].as_u64().unwrap();
    for column in ["start_bytes", "peak_bytes"] {
        let (a, b) = (batch_column(&whole, column), batch_column(&part, column));
        // The second epoch's steps after the resumed run's first (which reads the data again).
        for step in 10..16 {
            let extra = b[&step].saturating_sub(a[&step]);
            assert!(
                extra < params / 2,
                "step {step}: the resumed run's {column} is {extra} bytes above the uninterrupted \
                 run's ({} parameter bytes)",
                params
            );
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// A run stopped by `--max-steps` inside an epoch and resumed with a larger `--max-steps` ends
/// that epoch once: one row per epoch in `epochs.csv` (the first with all its steps), and as many
/// completed epochs in `summary.json` as the run that never stopped.
#[test]
fn a_longer_max_steps_continues_the_epoch_it_cut_and_ends_it_once() {
    let root = common::scratch("resume", "max-steps");
    let args = |dir: &Path, max_steps: &str| {
        let mut a = run_args(dir);
        a.extend(["--max-steps".to_string(), max_steps.into()]);
        a
    };
    let whole = root.join("whole");
    assert_ok(&run(&args(&whole, "12")), "the uninterrupted run");
    let part = root.join("part");
    assert_ok(&run(&args(&part, "4")), "the first 4 steps");
    let mut resume = args(&part, "12");
    resume.extend(["--resume".to_string(), part.display().to_string()]);
    assert_ok(&run(&resume), "resuming with --max-steps 12");

    let rows = |dir: &Path| -> Vec<(String, String)> {
        let text = std::fs::read_to_string(dir.join("epochs.csv")).unwrap();
        text.lines()
            .skip(1)
            .map(|l| {
                let f: Vec<&str> = l.split(',').collect();
                (f[0].to_string(), f[1].to_string())
            })
            .collect()
    };
    let expected = vec![("1".to_string(), "8".to_string()), ("2".into(), "4".into())];
    assert_eq!(
        rows(&whole),
        expected,
        "epoch, steps of the uninterrupted run"
    );
    assert_eq!(rows(&part), expected, "epoch, steps of the resumed run");
    let completed = |dir: &Path| {
        let s: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap())
                .unwrap();
        (s["epochs_completed"].as_u64(), s["steps"].as_u64())
    };
    assert_eq!(completed(&part), completed(&whole));
    assert_eq!(completed(&whole), (Some(1), Some(12)));
    let _ = std::fs::remove_dir_all(&root);
}

/// A run killed during its last evaluation, after its last step's snapshot, is resumed with no
/// step left to train: it evaluates, finishes with status ok, and still leaves the step timeline
/// (JSON, PNG, SVG) of its last step.
#[test]
fn a_resume_with_no_step_left_still_writes_the_step_timeline() {
    let dir = common::scratch("resume", "no-step-left").join("run");
    // A long evaluation (20,000 images) after the last step's snapshot: the kill lands in it.
    let args: Vec<String> = flags(
        "--synthetic-train 64 --synthetic-test 20000 --width 4 --batch-size 32 --epochs 1 \
         --save-every 1 --quiet --device cpu --seed 7",
    )
    .into_iter()
    .chain(["--out".to_string(), dir.display().to_string()])
    .collect();
    let mut child = spawn(&args);
    wait_for_checkpoint(&mut child, &dir, 2);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        !dir.join("summary.json").exists(),
        "the kill landed after the run ended; the test needs a longer evaluation"
    );
    let out = run(&["--resume".to_string(), dir.display().to_string()]);
    assert_ok(&out, "resuming with no step left");
    assert!(text(&out.stdout).contains("no steps left to train"));
    for file in [
        "step_timeline.json",
        "step_timeline.png",
        "step_timeline.svg",
    ] {
        assert!(dir.join(file).is_file(), "{file} missing");
    }
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

/// `--resume` of a run directory that a live run holds, before that run's first snapshot, says
/// so (and what to do), rather than "no snapshot".
#[test]
fn resuming_a_directory_held_by_a_live_run_says_so() {
    let dir = common::scratch("resume", "live").join("run");
    // Slow steps and no snapshot before the epoch's end: a long window with the lock held.
    let args: Vec<String> = flags(
        "--synthetic-train 2560 --synthetic-test 16 --width 64 --batch-size 256 --epochs 1 \
         --quiet --no-eval --device cpu",
    )
    .into_iter()
    .chain(["--out".to_string(), dir.display().to_string()])
    .collect();
    let mut child = spawn(&args);
    let start = Instant::now();
    while !std::fs::read_to_string(dir.join("batches.csv")).is_ok_and(|t| t.lines().count() > 1) {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no step after 2 minutes"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = run(&["--resume".to_string(), dir.display().to_string()]);
    let still_running = child.try_wait().unwrap().is_none();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(still_running, "the run ended before the resume was tried");
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("a running memtrain process holds this run directory"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

/// A run directory written before save/resume was named "snapshot" — `checkpoints/` with
/// `checkpoint.json` manifests, made by `train_cifar10` of commit fcb54e6 (2 of 8 steps, width 2;
/// tests/data/legacy-run) — resumes, and goes on saving into its own `checkpoints/` folder.
#[test]
fn a_run_directory_from_before_the_rename_resumes() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/legacy-run");
    let dir = common::scratch("resume", "legacy").join("run");
    copy_dir(&fixture, &dir);
    let out = run(&[
        "--resume".to_string(),
        dir.display().to_string(),
        "--max-steps".into(),
        "4".into(),
    ]);
    assert_ok(&out, "resuming a run directory from before the rename");
    assert!(
        text(&out.stdout).contains("resuming from") && text(&out.stdout).contains("(after step 2:"),
        "stdout:\n{}",
        text(&out.stdout)
    );
    let legacy = dir.join(memtrain::train::snapshot::LEGACY_SNAPSHOTS_DIR);
    let newest = std::fs::read_to_string(legacy.join(LATEST_FILE)).unwrap();
    assert_eq!(
        newest.trim(),
        "step-000004",
        "saved next to the old snapshots"
    );
    assert!(legacy.join("step-000004").join(MANIFEST_FILE).is_file());
    assert!(
        !dir.join(SNAPSHOTS_DIR).exists(),
        "one snapshot folder per run"
    );
    let ck = Snapshot::find_latest(&dir).expect("the newest snapshot loads");
    assert_eq!(ck.state.global_step, 4);
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

/// A huge learning rate after one good epoch makes the run fail with a one-line non-finite
/// error. Nothing is written after the failure: with snapshots only at epoch ends the
/// snapshot directory is byte for byte what it was; with one after every step the newest is
/// the last step that succeeded, and it loads with finite weights.
fn diverging_run_leaves_checkpoint_intact(precision: &str) {
    let root = common::scratch("resume", &format!("diverge-{precision}"));
    let base: Vec<String> = format!(
        "--synthetic-train 256 --synthetic-test 32 --width 4 --batch-size 32 --quiet --no-eval --device cpu --precision {precision}"
    )
    .split_whitespace()
    .map(String::from)
    .collect();
    for save_every in ["0", "1"] {
        let dir = root.join(format!("save-every-{save_every}"));
        let mut first = base.clone();
        first.extend(["--epochs", "1", "--out"].map(String::from));
        first.push(dir.display().to_string());
        assert_ok(&run(&first), "the first epoch");
        let before = snapshot(&dir.join(SNAPSHOTS_DIR));
        assert_eq!(checkpoint_steps(&dir), vec![8]);

        let mut diverge = base.clone();
        diverge.extend(
            [
                "--epochs",
                "2",
                "--lr",
                "1e30",
                "--save-every",
                save_every,
                "--resume",
            ]
            .map(String::from),
        );
        diverge.push(dir.display().to_string());
        let out = run(&diverge);
        let stderr = text(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(1),
            "exit code of a diverged run; stderr:\n{stderr}"
        );
        assert_eq!(stderr.lines().count(), 1, "one line on stderr:\n{stderr}");
        assert!(
            stderr.starts_with("error: non-finite") && stderr.contains("--lr"),
            "{stderr}"
        );
        assert_no_leftovers(&dir);
        if save_every == "0" {
            assert!(
                before == snapshot(&dir.join(SNAPSHOTS_DIR)),
                "the snapshots changed after the failure"
            );
            continue;
        }
        // "... at epoch E, batch B ..." (from 1): the failing step is global step (E-1)*8 + B-1
        // (0-based).
        let num_after = |key: &str| -> usize {
            let rest = &stderr[stderr
                .find(key)
                .unwrap_or_else(|| panic!("no '{key}' in {stderr}"))
                + key.len()..];
            rest.chars()
                .take_while(|c| c.is_ascii_digit())
                .collect::<String>()
                .parse()
                .unwrap()
        };
        let failed = (num_after("epoch ") - 1) * 8 + num_after("batch ") - 1;
        let ck = Snapshot::find_latest(&dir).expect("the newest snapshot loads");
        assert!(ck.skipped.is_empty());
        assert_eq!(
            ck.state.global_step, failed,
            "the newest snapshot is the last step that succeeded"
        );
        for (name, t) in tensors(&ck.dir.join(MODEL_FILE)) {
            assert!(
                bits(&t).iter().all(|b| f32::from_bits(*b).is_finite()),
                "{name} is not finite"
            );
        }
    }
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn non_finite_loss_in_f32_leaves_the_last_checkpoint_intact() {
    diverging_run_leaves_checkpoint_intact("f32");
}

#[test]
fn non_finite_loss_in_bf16_leaves_the_last_checkpoint_intact() {
    diverging_run_leaves_checkpoint_intact("bf16");
}

// ---------------------------------------------------------------------------------------------
// In-process: the library API

/// Sets the stop flag once `at` optimizer steps are done.
struct StopAt {
    at: usize,
    flag: Arc<AtomicBool>,
}

impl Callback for StopAt {
    fn on_batch_end(&mut self, ctx: &BatchInfo<'_>) -> memtrain::Result<()> {
        if ctx.global_step + 1 >= self.at {
            self.flag.store(true, Ordering::SeqCst);
        }
        Ok(())
    }
}

fn tiny(out: &Path, precision: Precision) -> TrainConfig {
    let mut cfg = TrainConfig::default();
    cfg.model.width = 4;
    cfg.steps.batch_size = 16;
    cfg.steps.epochs = 2;
    cfg.data.synthetic_train = 64;
    cfg.data.synthetic_test = 16;
    cfg.output.eval = false;
    cfg.output.quiet = true;
    cfg.device = Some("cpu".into());
    cfg.memory.precision = precision;
    cfg.optimizer.kind = memtrain::config::OptimizerKind::Adamw;
    cfg.output.out = Some(out.to_path_buf());
    cfg
}

/// Trains `cfg` in this process with its files written, and returns the newest snapshot in `dir`.
fn trained_snapshot(cfg: &TrainConfig, dir: &Path) -> Snapshot {
    let options = TrainerOptions {
        log_files: true,
        ..Default::default()
    };
    let mut t = Trainer::new(cfg.clone(), splits(cfg), options).unwrap();
    t.fit().unwrap();
    Snapshot::find_latest(dir).unwrap()
}

fn splits(cfg: &TrainConfig) -> DataSplits {
    let (train, test) =
        synthetic::splits(cfg.data.synthetic_train, cfg.data.synthetic_test, cfg.seed);
    DataSplits {
        train,
        test,
        description: "synthetic (test)".into(),
        test_is_validation: false,
    }
}

#[test]
fn restore_brings_back_every_piece_of_state() {
    for precision in [Precision::F32, Precision::F16] {
        let dir = common::scratch("resume", &format!("inproc-{precision}")).join("run");
        let cfg = tiny(&dir, precision);
        let flag = Arc::new(AtomicBool::new(false));
        let options = TrainerOptions {
            log_files: true,
            stop: Some(flag.clone()),
            callbacks: vec![Box::new(StopAt { at: 3, flag })],
            ..Default::default()
        };
        let mut a = Trainer::new(cfg.clone(), splits(&cfg), options).unwrap();
        let summary = a.fit().unwrap();
        assert_eq!(summary.status, memtrain::train::RunStatus::Interrupted);
        assert_eq!(a.position.global_step, 3);

        let ck = Snapshot::find_latest(&dir).unwrap();
        assert!(ck.skipped.is_empty());
        assert_eq!(
            (ck.state.global_step, ck.state.epoch, ck.state.next_batch),
            (3, 0, 3)
        );
        let cfg_b = ck.resume_config(&cfg, false).unwrap();
        let mut b = Trainer::new(cfg_b, splits(&cfg), TrainerOptions::default()).unwrap();
        b.resume(ck).unwrap();

        assert_eq!(
            (
                b.position.global_step,
                b.position.start_epoch,
                b.position.start_batch
            ),
            (3, 0, 3)
        );
        assert_eq!(b.updater.optimizer.steps, a.updater.optimizer.steps);
        assert_eq!(b.updater.scaler, a.updater.scaler);
        assert_eq!(b.updater.scaler.is_some(), precision == Precision::F16);
        for ((na, va), (nb, vb)) in a.model.named_vars().iter().zip(b.model.named_vars().iter()) {
            assert_eq!(na, nb);
            assert!(
                bits(va.as_tensor()) == bits(vb.as_tensor()),
                "parameter {na}"
            );
        }
        for ((na, ta), (_, tb)) in a
            .model
            .named_buffers()
            .iter()
            .zip(b.model.named_buffers().iter())
        {
            assert!(bits(ta) == bits(tb), "buffer {na}");
        }
        let (sa, sb) = (a.updater.optimizer.state(), b.updater.optimizer.state());
        assert_eq!(sa.len(), sb.len());
        assert!(!sa.is_empty(), "AdamW has state after 3 steps");
        for ((na, ta), (nb, tb)) in sa.iter().zip(sb.iter()) {
            assert_eq!(na, nb);
            assert!(bits(ta) == bits(tb), "optimizer state {na}");
        }
        let _ = std::fs::remove_dir_all(dir.parent().unwrap());
    }
}

/// A snapshot taken in memory and restored into a fresh trainer continues bit for bit: both
/// train the same next steps to the same weights. No file is involved (snapshots only store
/// the state); a state of other data or another model is refused before anything changes.
#[test]
fn snapshot_and_restore_continue_in_memory() {
    let mut cfg = tiny(Path::new("unused"), Precision::F16);
    cfg.output.out = None;
    let batches: Vec<_> = memtrain::data::Batcher::new(
        Arc::new(splits(&cfg).train),
        memtrain::data::BatcherOptions {
            batch_size: cfg.steps.batch_size,
            shuffle: true,
            augment: false,
            drop_last: true,
            seed: 1,
            epoch: 0,
            prefetch: 1,
            start_batch: 0,
            recycle: None,
        },
    )
    .collect();
    let mut a = Trainer::new(cfg.clone(), splits(&cfg), TrainerOptions::default()).unwrap();
    for (i, b) in batches[..2].iter().enumerate() {
        a.train_step(b, 0, i).unwrap();
    }
    let state = a.snapshot(0, 2, None).unwrap();
    assert_eq!(
        (state.global_step, state.epoch, state.next_batch),
        (2, 0, 2)
    );

    let mut b = Trainer::new(cfg.clone(), splits(&cfg), TrainerOptions::default()).unwrap();
    b.restore(state.clone()).unwrap();
    assert_eq!(
        (
            b.position.global_step,
            b.position.start_epoch,
            b.position.start_batch
        ),
        (2, 0, 2)
    );
    for (i, batch) in batches[2..].iter().enumerate() {
        let (ra, rb) = (
            a.train_step(batch, 0, i + 2).unwrap(),
            b.train_step(batch, 0, i + 2).unwrap(),
        );
        assert_eq!(ra.loss.to_bits(), rb.loss.to_bits(), "step {}", i + 2);
    }
    for ((n, va), (_, vb)) in a.model.named_vars().iter().zip(b.model.named_vars().iter()) {
        assert!(
            bits(va.as_tensor()) == bits(vb.as_tensor()),
            "parameter {n}"
        );
    }

    // Another data set, or a wider model: refused, and the trainer is left as it was.
    let mut other = cfg.clone();
    other.seed = cfg.seed + 1;
    let mut c = Trainer::new(cfg.clone(), splits(&other), TrainerOptions::default()).unwrap();
    let e = c.restore(state.clone()).unwrap_err().to_string();
    assert!(e.contains("training data differs"), "{e}");
    assert_eq!(c.position.global_step, 0);
    let mut wide = cfg.clone();
    wide.model.width = 8;
    let mut d = Trainer::new(wide, splits(&cfg), TrainerOptions::default()).unwrap();
    let e = d.restore(state.clone()).unwrap_err().to_string();
    assert!(e.contains("the model needs"), "{e}");
    assert_eq!(d.position.global_step, 0);

    // A NaN weight, or an optimizer state emptied, is refused: a run never saves either.
    let mut nan = state.clone();
    let (name, w) = nan
        .model
        .iter()
        .next()
        .map(|(n, t)| (n.clone(), t.clone()))
        .unwrap();
    let mut values = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    values[0] = f32::NAN;
    nan.model.insert(
        name,
        Tensor::from_vec(values, w.shape(), &Device::Cpu).unwrap(),
    );
    let mut e_nan = Trainer::new(cfg.clone(), splits(&cfg), TrainerOptions::default()).unwrap();
    let e = e_nan.restore(nan).unwrap_err().to_string();
    assert!(e.contains("NaN or infinite"), "{e}");
    assert_eq!(e_nan.position.global_step, 0);
    let mut empty = state;
    empty.optimizer.clear();
    let mut e_opt = Trainer::new(cfg.clone(), splits(&cfg), TrainerOptions::default()).unwrap();
    let e = e_opt.restore(empty).unwrap_err().to_string();
    assert!(e.contains("optimizer state holds 0 tensors"), "{e}");
    assert_eq!(e_opt.position.global_step, 0);
}

#[test]
fn conflicting_config_lists_every_difference() {
    let dir = common::scratch("resume", "conflict").join("run");
    let mut cfg = tiny(&dir, Precision::F32);
    cfg.steps.max_steps = Some(2);
    let ck = trained_snapshot(&cfg, &dir);
    let mut now = cfg.clone();
    now.model.width = 8;
    now.memory.precision = Precision::Bf16;
    now.steps.epochs = 5;
    let err = ck
        .resume_config(&now, false)
        .expect_err("a conflict")
        .to_string();
    assert!(
        err.contains("width: snapshot 4, now 8; precision: snapshot f32, now bf16"),
        "{err}"
    );
    assert!(!err.contains("epochs"), "epochs may change: {err}");
    assert!(!err.contains('\n'));
    assert_eq!(
        ck.noted_changes(&now),
        vec!["epochs: snapshot 2, now 5".to_string()]
    );
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

/// `--compress-activations auto` at a resume keeps the codes the run chose, never switching a
/// lossy run to exact mid-run; a changed `--memory-limit` is listed (issue 52).
#[test]
fn auto_codes_at_resume_keep_the_runs_codes_and_a_new_limit_is_listed() {
    use memtrain::config::{ActivationStorage, CompressActivations};
    let dir = common::scratch("resume", "auto-codes").join("run");
    let mut cfg = tiny(&dir, Precision::F32);
    cfg.steps.max_steps = Some(2);
    cfg.memory.compress_activations = ActivationStorage::Int8.into();
    let ck = trained_snapshot(&cfg, &dir);
    let mut now = cfg.clone();
    now.memory.compress_activations = CompressActivations::Auto;
    now.memory.memory_limit = Some(1 << 30);
    let got = ck.resume_config(&now, false).unwrap();
    assert_eq!(
        got.memory.compress_activations,
        cfg.memory.compress_activations
    );
    assert_eq!(
        ck.noted_changes(&got),
        vec!["memory_limit: snapshot none, now 1073741824".to_string()]
    );
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}
