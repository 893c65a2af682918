//! A run that stops on out-of-memory leaves a snapshot (issue: a snapshot on OOM): the step's
//! memory timeline up to the failing event, the configuration and its estimate, and the
//! one-line error says where the snapshot is.

mod common;

use common::run_trainer as train;
use memtrain::predict::bounds::RUN_PAST_PREDICTION_ENV;
use memtrain_core::memory::timeline::OOM_REPORT_FILE;

const BASE: &[&str] = &[
    "--device",
    "cpu",
    "--width",
    "8",
    "--synthetic-train",
    "256",
    "--synthetic-test",
    "32",
    "--batch-size",
    "64",
    "--max-steps",
    "2",
    "--quiet",
    "--no-eval",
];

/// The keys docs/outputs.md lists in its `oom_report.json` section, sorted.
fn documented_keys() -> Vec<String> {
    let page = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/outputs.md"),
    )
    .unwrap();
    let section = page
        .split(&format!("\n## `{OOM_REPORT_FILE}`\n"))
        .nth(1)
        .expect("docs/outputs.md has a section for the OOM report");
    let section = section.split("\n## ").next().unwrap();
    let mut keys: Vec<String> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .map(|l| l.split('`').next().unwrap().to_string())
        .collect();
    keys.sort();
    keys
}

/// `train_cifar10 flags` under a `--memory-limit` its step is predicted not to fit, started
/// anyway ([`RUN_PAST_PREDICTION_ENV`]) so that the per-layer check finds where it runs out.
fn train_past_prediction(flags: &[&str]) -> std::process::Output {
    common::trainer_command(flags)
        .env(RUN_PAST_PREDICTION_ENV, "1")
        .output()
        .unwrap()
}

/// The `--memory-limit` under which `flags`' heap budget is `heap`.
fn limit_for(flags: &[&str], heap: u64) -> u64 {
    common::limit_for_heap(|| common::trainer_command(flags), heap)
}

/// The first step's memory record of `flags` run without a limit into `out`.
fn first_step(flags: &[&str], out: &std::path::Path) -> memtrain_core::memory::BatchMemory {
    let o = train(&[flags, &["--out", out.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    memtrain::callbacks::log::read_batch_log(out)
        .unwrap()
        .remove(0)
}

/// The step-added peak of this configuration, from a run without a limit.
fn unlimited_step_peak(dir: &std::path::Path) -> (u64, u64) {
    let out = dir.join("unlimited");
    let o = train(&[BASE, &["--out", out.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        !out.join(OOM_REPORT_FILE).exists(),
        "no snapshot without an OOM"
    );
    let s: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    (
        s["baseline_bytes"].as_u64().unwrap(),
        s["step_peak_bytes"].as_u64().unwrap(),
    )
}

#[test]
fn an_oom_in_the_backward_leaves_the_timeline_up_to_the_failing_event() {
    let dir = common::temp_dir("oom-snapshot");
    // Checkpointing every block: the backward's recomputation needs well more than the forward
    // (1.4 MiB here), so a heap budget halfway between them stays above the forward's needs
    // whatever a process measures for its reserve (which differs by a few hundred KiB).
    let flags = [BASE, &["--checkpoint", "blocks"]].concat();
    let first = first_step(&flags, &dir.join("free"));
    let (forward, peak) = (first.forward_peak_bytes, first.peak_bytes);
    assert!(peak > forward + (1 << 20), "forward {forward}, step {peak}");
    let budget = forward + (peak - forward) / 2;
    let limit = limit_for(&flags, budget);
    let out = dir.join("limited");
    let o = train_past_prediction(
        &[
            &flags[..],
            &[
                "--out",
                out.to_str().unwrap(),
                "--memory-limit",
                &limit.to_string(),
            ],
        ]
        .concat(),
    );
    assert_eq!(o.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&o.stderr);
    let path = out.join(OOM_REPORT_FILE);
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(stderr.contains("out of memory"), "{stderr}");
    assert!(
        stderr.contains(&format!("report: {}", path.display())),
        "the error names the snapshot: {stderr}"
    );

    let s: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let written: Vec<String> = s.as_object().unwrap().keys().cloned().collect();
    assert_eq!(
        written,
        documented_keys(),
        "the keys of {OOM_REPORT_FILE} and of its section in docs/outputs.md differ"
    );
    assert_eq!(s["config"]["memory_limit"].as_u64(), Some(limit));
    assert_eq!(s["config"]["width"].as_u64(), Some(8));
    // The heap budget the process had under that limit (it measures what it holds outside the
    // heap itself, so it can differ from the one asked for by a few pages).
    let budget = s["heap_budget_bytes"].as_u64().unwrap();
    assert!(s["error"].as_str().unwrap().contains("out of memory"));
    let events = s["timeline"]["events"].as_array().unwrap();
    assert!(!events.is_empty());
    let last = events.last().unwrap();
    // The failing event is the last one recorded, and the only one over the heap budget.
    assert!(last["peak_bytes"].as_u64().unwrap() > budget, "{last}");
    for e in &events[..events.len() - 1] {
        assert!(e["peak_bytes"].as_u64().unwrap() <= budget, "{e}");
    }
    assert!(
        events.iter().any(|e| e["phase"] == "backward"),
        "the limit is above the forward's peak, so the step got into the backward"
    );
    assert!(s["failed_at"]
        .as_str()
        .unwrap()
        .contains(last["layer"].as_str().unwrap()));
    // The estimate: the whole configuration, and a prediction for each event recorded.
    let est = &s["estimate"];
    assert!(est["peak"].as_u64().unwrap() > budget);
    assert!(est["events"].as_array().unwrap().len() > events.len());
    assert!(events.iter().all(|e| e["predicted_peak_bytes"].is_u64()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_summary_only_child_leaves_a_snapshot_too() {
    // Sweep children write only summary.json; their OOM points still get a snapshot to link.
    let dir = common::temp_dir("oom-snapshot-child");
    // Above what the data set and model need (a limit below that is refused before loading,
    // src/predict/bounds.rs), below the step's peak.
    let (baseline, peak) = unlimited_step_peak(&dir);
    let limit = limit_for(BASE, baseline + (peak - baseline) / 2).to_string();
    let out = dir.join("point");
    let o = common::trainer_command(
        &[
            BASE,
            &["--out", out.to_str().unwrap(), "--memory-limit", &limit],
        ]
        .concat(),
    )
    .env(memtrain::cli::SUMMARY_ONLY_ENV, "1")
    .env(RUN_PAST_PREDICTION_ENV, "1")
    .output()
    .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(out.join(OOM_REPORT_FILE).is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The out-of-memory advice is true for the run: a run that already checkpoints every block in
/// bf16 is not told to use `--checkpoint stages` or a half precision.
#[test]
fn the_advice_names_only_what_the_run_does_not_use_yet() {
    let dir = std::env::temp_dir().join(format!("memtrain-oom-advice-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = dir.join("run");
    let flags = [BASE, &["--precision", "bf16", "--checkpoint", "blocks"]].concat();
    // Room for the data set and the model, not for the step.
    let (model, step) = common::needed_limits(|| common::trainer_command(&flags));
    let limit = (model + (step - model) / 2).to_string();
    let o = train_past_prediction(
        &[
            &flags[..],
            &["--memory-limit", &limit, "--out", out.to_str().unwrap()],
        ]
        .concat(),
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    let line = stderr.lines().find(|l| l.starts_with("error:")).unwrap();
    assert!(line.contains("out of memory"), "{line}");
    assert!(
        line.contains("lower --batch-size") && line.contains("raise --memory-limit"),
        "{line}"
    );
    assert!(
        !line.contains("--checkpoint") && !line.contains("--precision"),
        "advice the run already follows: {line}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_out_of_memory_in_the_optimizer_shows_its_event_and_advice_that_helps() {
    // AdamW at batch 2: the first step's peak is the update, which makes the two state tensors.
    let dir = common::temp_dir("oom-snapshot-optimizer");
    let flags = [
        "--device",
        "cpu",
        "--optimizer",
        "adamw",
        "--batch-size",
        "2",
        "--synthetic-train",
        "64",
        "--synthetic-test",
        "10",
        "--max-steps",
        "1",
        "--no-eval",
        "--quiet",
    ];
    let first = first_step(&flags, &dir.join("free"));
    let (backward, optimizer) = (first.backward_peak_bytes, first.optimizer_peak_bytes);
    assert!(optimizer > backward, "the update is the step's peak here");
    let budget = backward + (optimizer - backward) / 2;
    let limit = limit_for(&flags, budget).to_string();
    let out = dir.join("limited");
    let o = train_past_prediction(
        &[
            &flags[..],
            &["--out", out.to_str().unwrap(), "--memory-limit", &limit],
        ]
        .concat(),
    );
    assert_eq!(o.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("out of memory: optimizer"), "{stderr}");
    assert!(
        stderr.contains("--optimizer sgd"),
        "advice that helps: {stderr}"
    );
    let snap: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join(OOM_REPORT_FILE)).unwrap()).unwrap();
    let last = snap["timeline"]["events"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(
        (last["phase"].as_str(), last["layer"].as_str()),
        (Some("optimizer"), Some("optimizer")),
        "{last}"
    );
    assert!(last["peak_bytes"].as_u64().unwrap() > snap["heap_budget_bytes"].as_u64().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}
