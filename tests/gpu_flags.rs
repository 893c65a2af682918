//! The GPU flags `--tf32`, `--cudnn-nondeterministic` and `--cuda-graph` on any machine: their values reach the
//! configuration and the conv ops, and the combinations that cannot work are refused as usage
//! errors (exit 2, one line on stderr, no run directory), as in `tests/bad_input.rs`.

mod common;

use memtrain::config::{Tf32, TrainConfig, DEFAULT_TF32};
use std::sync::{Mutex, MutexGuard};

/// Trainers set the process-wide TF32 flag when built: one test at a time builds them.
fn trainer_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs the binary with `args` on a tiny CPU-sized run and checks the usage error: exit 2, one
/// line on stderr containing every one of `wants`, and no run directory.
fn refused(name: &str, args: &[&str], wants: &[&str]) {
    let out_dir = common::temp_dir(&format!("gpu-flags-{name}")).join("run");
    let out_arg = out_dir.to_string_lossy().into_owned();
    let mut all: Vec<&str> = args.to_vec();
    all.extend([
        "--width",
        "4",
        "--synthetic-train",
        "64",
        "--synthetic-test",
        "16",
        "--batch-size",
        "32",
        "--quiet",
        "--no-eval",
        "--out",
        &out_arg,
    ]);
    let out = common::run_trainer(&all);
    let stderr = common::text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{name}: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{name}: {stderr}");
    for w in wants {
        assert!(stderr.contains(w), "{name}: {stderr:?} lacks {w:?}");
    }
    assert!(!stderr.contains("panicked"), "{name}: {stderr}");
    assert!(!out_dir.exists(), "{name}: left {}", out_dir.display());
}

#[test]
fn tf32_defaults_to_on_and_reaches_the_config() {
    assert_eq!(DEFAULT_TF32, Tf32::On, "README states PyTorch's default");
    assert_eq!(TrainConfig::default().cuda.tf32, Tf32::On);
    assert_eq!(common::config_of(&[]).unwrap().cuda.tf32, Tf32::On);
    assert_eq!(
        common::config_of(&["--tf32", "off"]).unwrap().cuda.tf32,
        Tf32::Off
    );
    assert_eq!(
        common::config_of(&["--tf32", "on"]).unwrap().cuda.tf32,
        Tf32::On
    );
    // config.json spells it as the flag does, and an old config.json without the key gets the
    // default.
    let json = serde_json::to_value(TrainConfig::default()).unwrap();
    assert_eq!(json["tf32"], "on");
    assert_eq!(json["cuda_graph"], false);
    let old: TrainConfig = serde_json::from_str(r#"{"batch_size": 64}"#).unwrap();
    assert_eq!((old.cuda.tf32, old.cuda.cuda_graph), (Tf32::On, false));
}

#[test]
fn the_trainer_sets_the_ops_math_mode_from_the_config() {
    let _lock = trainer_lock();
    for (mode, want) in [(Tf32::Off, false), (Tf32::On, true), (Tf32::Off, false)] {
        let mut cfg = common::tiny_config();
        cfg.cuda.tf32 = mode;
        let _t = common::trainer(cfg);
        assert_eq!(memtrain_kernels::tf32(), want, "--tf32 {mode}");
    }
}

#[test]
fn cudnn_nondeterministic_is_off_unless_asked_and_reaches_the_ops() {
    assert!(!TrainConfig::default().cuda.cudnn_nondeterministic);
    assert!(!common::config_of(&[]).unwrap().cuda.cudnn_nondeterministic);
    assert!(
        common::config_of(&["--cudnn-nondeterministic"])
            .unwrap()
            .cuda
            .cudnn_nondeterministic
    );
    let old: TrainConfig = serde_json::from_str(r#"{"batch_size": 64}"#).unwrap();
    assert!(!old.cuda.cudnn_nondeterministic);
    let _lock = trainer_lock();
    for on in [true, false] {
        let mut cfg = common::tiny_config();
        cfg.cuda.cudnn_nondeterministic = on;
        let _t = common::trainer(cfg);
        assert_eq!(memtrain_kernels::cudnn_nondeterministic(), on);
    }
}

#[test]
fn tf32_takes_only_on_or_off() {
    refused(
        "tf32-maybe",
        &["--tf32", "maybe"],
        &["maybe", "--tf32", "on", "off"],
    );
    let e = common::config_of(&["--tf32", "1"]).unwrap_err();
    assert_eq!(e.exit_code(), 2);
}

#[test]
fn cuda_graph_is_refused_on_the_cpu() {
    refused(
        "graph-cpu",
        &["--cuda-graph", "--device", "cpu"],
        &["--cuda-graph", "--device cpu"],
    );
}

#[test]
fn cuda_graph_is_refused_under_a_memory_limit() {
    refused(
        "graph-limit",
        &["--cuda-graph", "--device", "cuda", "--memory-limit", "1GiB"],
        &["--cuda-graph", "--memory-limit"],
    );
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_graph_needs_a_cuda_build() {
    refused(
        "graph-no-cuda",
        &["--cuda-graph"],
        &["--cuda-graph", "built without CUDA", "--features cuda"],
    );
    // The library refuses it as well, before any device is opened.
    let _lock = trainer_lock();
    let mut cfg = common::tiny_config();
    cfg.cuda.cuda_graph = true;
    cfg.device = None;
    let e = memtrain::train::Trainer::new(cfg, common::splits(64, 32, 0), Default::default())
        .err()
        .expect("refused");
    assert_eq!(e.exit_code(), 2, "{e}");
}

#[test]
fn a_cpu_run_reports_no_graph() {
    let _lock = trainer_lock();
    let mut t = common::trainer(common::tiny_config());
    let s = t.fit().unwrap();
    assert_eq!(s.cuda_graph, None);
    let json = serde_json::to_value(&s).unwrap();
    assert!(json.get("cuda_graph").is_none(), "absent, not null: {json}");
}
