//! A resumed run says what it does and describes the whole run (issue 34): a
//! `--memory-snapshot-step` inherited from the run's config that is already trained falls back
//! to the run's last step (given explicitly it is refused: `tests/bad_input.rs`), and `lossy`
//! and the label count the steps of every process, with each span of steps' setting recorded.

mod common;

use common::{flags, run_trainer, text};
use std::path::Path;

const BASE: &str =
    "--synthetic-train 256 --synthetic-test 32 --width 8 --batch-size 32 --device cpu --quiet";

fn run(dir: &Path, extra: &str) {
    let mut args = flags(BASE);
    args.extend(flags(extra));
    args.extend(["--out".to_string(), dir.display().to_string()]);
    let o = run_trainer(&args);
    assert!(o.status.success(), "{extra}: {}", text(&o.stderr));
}

fn resume(dir: &Path, extra: &str) -> String {
    let mut args = vec!["--resume".to_string(), dir.display().to_string()];
    args.extend(flags(extra));
    let o = run_trainer(&args);
    assert!(o.status.success(), "--resume {extra}: {}", text(&o.stderr));
    text(&o.stdout)
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn a_run_lossy_before_a_resume_stays_lossy() {
    let dir = common::scratch("resume-settings", "lossy");
    let out = dir.join("run");
    run(&out, "--max-steps 4 --compress-activations int8");
    resume(&out, "--max-steps 6 --compress-activations none");
    let s = summary(&out);
    assert_eq!(s["steps"], 6);
    assert_eq!(s["lossy"], true, "4 of its 6 steps kept int8 codes");
    let label = s["label"].as_str().unwrap();
    assert!(
        label.contains("(lossy: int8-activations in steps 1–4)"),
        "{label}"
    );
    assert_eq!(
        s["activation_storage"],
        serde_json::json!([
            {"first_step": 1, "last_step": 4, "compress_activations": "int8"},
            {"first_step": 5, "last_step": 6, "compress_activations": "none"}
        ])
    );
    // The label names the codes each span kept (issue 52: it always said int8).
    let int2 = dir.join("int2");
    run(&int2, "--max-steps 2 --compress-activations int2");
    resume(&int2, "--max-steps 3 --compress-activations none");
    let label = summary(&int2)["label"].as_str().unwrap().to_string();
    assert!(
        label.ends_with("(lossy: int2-activations in steps 1–2)"),
        "{label}"
    );
    // An exact run resumed exact stays exact, one span.
    let exact = dir.join("exact");
    run(&exact, "--max-steps 2");
    resume(&exact, "--max-steps 3");
    let s = summary(&exact);
    assert_eq!(s["lossy"], false);
    assert!(!s["label"].as_str().unwrap().contains("lossy"));
    assert_eq!(s["activation_storage"].as_array().unwrap().len(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_inherited_snapshot_step_already_trained_traces_the_last_step() {
    let dir = common::scratch("resume-settings", "snapshot-step");
    let out = dir.join("run");
    run(&out, "--max-steps 4 --memory-snapshot-step 2");
    let stdout = resume(&out, "--max-steps 6");
    assert!(
        stdout.contains("--memory-snapshot-step 2 of the run's config is already trained"),
        "{stdout}"
    );
    // The pickle now holds the step step_trace.json describes: the run's last, 6.
    let pickle = std::fs::read(out.join(memtrain::export::memviz::MEMORY_SNAPSHOT_FILE)).unwrap();
    let needle = b"memtrain step 6 ";
    assert!(
        pickle.windows(needle.len()).any(|w| w == needle),
        "memory_snapshot.pickle is not step 6's"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The command a `--checkpoint auto` run started with, plus `--resume`, continues it with the
/// segmentation `auto` chose (config.json keeps the choice; issue 52).
#[test]
fn the_command_an_auto_run_started_with_resumes_it() {
    let dir = common::scratch("resume-settings", "auto");
    let out = dir.join("run");
    run(&out, "--max-steps 2 --checkpoint auto");
    let chosen = serde_json::from_slice::<serde_json::Value>(
        &std::fs::read(out.join("config.json")).unwrap(),
    )
    .unwrap()["checkpoint"]
        .clone();
    assert_ne!(chosen, "auto");
    let mut args = flags(BASE);
    args.extend(flags("--max-steps 3 --checkpoint auto --resume"));
    args.extend([
        out.display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ]);
    let o = run_trainer(&args);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(summary(&out)["steps"], 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A resume with another number of compute threads warns that the weights will not be
/// bit-identical, naming the run's number; with the same number it says nothing (issue 52).
#[test]
fn a_resume_with_another_thread_count_warns() {
    let dir = common::scratch("resume-settings", "threads");
    let out = dir.join("run");
    run(&out, "--max-steps 1");
    let resume_with = |threads: &str, steps: &str| {
        let mut args = vec!["--resume".to_string(), out.display().to_string()];
        args.extend(flags(&format!("--max-steps {steps}")));
        let o = common::trainer_command(&args)
            .env("RAYON_NUM_THREADS", threads)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o.stderr));
        text(&o.stderr)
    };
    let stderr = resume_with("2", "2");
    assert!(
        stderr.contains("the run trained with 1 compute thread, this process has 2")
            && stderr.contains("RAYON_NUM_THREADS=1"),
        "{stderr}"
    );
    // Saved by the 2-thread process now: one thread warns the other way, two say nothing.
    assert!(!resume_with("2", "3").contains("compute threads"));
    let _ = std::fs::remove_dir_all(&dir);
}
