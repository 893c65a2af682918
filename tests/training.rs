//! End-to-end training: synthetic data is learned, real CIFAR-10 beats chance, runs are
//! deterministic, and the run directory holds the promised files.

mod common;

use memtrain::config::TrainConfig;
use memtrain::train::{Trainer, TrainerOptions};

#[test]
fn synthetic_data_is_learned_quickly() {
    let mut cfg = common::tiny_config();
    cfg.model.width = 8;
    cfg.steps.batch_size = 64;
    cfg.steps.epochs = 3;
    cfg.steps.max_steps = None;
    cfg.data.synthetic_train = 1024;
    cfg.data.synthetic_test = 256;
    cfg.output.eval = true;
    cfg.optimizer.lr = 0.05;
    let mut t = common::trainer(cfg);
    let s = t.fit().unwrap();
    let acc = s.quality.final_test_accuracy.unwrap();
    assert!(acc >= 0.6, "synthetic test accuracy {acc} < 60%");
}

#[test]
fn same_seed_same_losses() {
    let run = || {
        let mut cfg = common::tiny_config();
        cfg.steps.max_steps = Some(4);
        cfg.data.synthetic_train = 128;
        let mut t = common::trainer(cfg);
        (0..4)
            .map(|i| {
                let (x, y) = common::batch(16, 100 + i);
                let b = memtrain::data::Batch {
                    images: x,
                    labels: y,
                    len: 16,
                    index: i as usize,
                };
                t.train_step(&b, 0, i as usize).unwrap().loss
            })
            .collect::<Vec<f64>>()
    };
    let a = run();
    let b = run();
    assert_eq!(a, b, "bit-identical loss sequences");
    // And through fit() with shuffling and augmentation.
    let fit = || {
        let mut cfg = common::tiny_config();
        cfg.steps.max_steps = Some(3);
        cfg.data.synthetic_train = 128;
        cfg.output.eval = true;
        common::trainer(cfg).fit().unwrap().quality.final_test_loss
    };
    assert_eq!(fit(), fit());
}

#[test]
fn run_directory_has_config_csv_and_summary() {
    let dir = common::temp_dir("rundir");
    let mut cfg = common::tiny_config();
    cfg.output.out = Some(dir.clone());
    cfg.output.eval = true;
    let data = common::splits(cfg.data.synthetic_train, cfg.data.synthetic_test, 0);
    let mut t = Trainer::new(
        cfg.clone(),
        data,
        TrainerOptions {
            log_files: true,
            ..Default::default()
        },
    )
    .unwrap();
    t.fit().unwrap();
    let saved = TrainConfig::from_json_file(&dir.join("config.json")).unwrap();
    assert_eq!(saved, cfg);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    for key in [
        "peak_bytes",
        "images_per_sec",
        "final_test_accuracy",
        "probe",
    ] {
        assert!(summary.get(key).is_some(), "summary.json lacks {key}");
    }
    let batches = std::fs::read_to_string(dir.join("batches.csv")).unwrap();
    assert_eq!(batches.lines().count(), 1 + 2, "header + one row per step");
    let epochs = std::fs::read_to_string(dir.join("epochs.csv")).unwrap();
    assert_eq!(epochs.lines().count(), 2);
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "no temporary files left");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn real_cifar_subset_beats_chance_in_two_epochs() {
    let Some(dir) = common::real_subset() else {
        eprintln!("skipping: ../shared/data/cifar10-subset not found (real CIFAR-10 subset)");
        return;
    };
    let mut cfg = common::tiny_config();
    cfg.data.data_dir = Some(dir);
    cfg.model.width = 16;
    cfg.steps.epochs = 2;
    cfg.steps.max_steps = None;
    cfg.steps.batch_size = 64;
    cfg.output.eval = true;
    let mut t = Trainer::from_config(cfg, TrainerOptions::default()).unwrap();
    let s = t.fit().unwrap();
    let acc = s.quality.final_test_accuracy.unwrap();
    eprintln!(
        "real subset, 2 epochs, width 16: validation accuracy {:.1}%",
        acc * 100.0
    );
    assert!(
        acc > 0.30,
        "validation accuracy {acc} <= 30% after 2 epochs"
    );
}

/// The prediction error is the step's: the estimate predicts a training step's peak, so
/// `prediction_error_pct` compares it with the measured step peak, also when the run's own peak
/// is reached while the data loads (phase "other": width 1 on the real subset, whose loading
/// peak is above its tiny step's).
#[test]
fn the_prediction_error_is_against_the_step_peak() {
    let Some(data) = common::real_subset() else {
        eprintln!("skipped: ../shared/data/cifar10-subset is not present");
        return;
    };
    let dir = common::scratch("training", "prediction-error");
    let out = common::run_trainer(&[
        "--width",
        "1",
        "--data-dir",
        data.to_str().unwrap(),
        "--batch-size",
        "16",
        "--max-steps",
        "3",
        "--no-eval",
        "--quiet",
        "--out",
        dir.join("run").to_str().unwrap(),
    ]);
    common::assert_ok(&out, "a width-1 run on the real subset");
    let s: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("run").join("summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        s["peak_phase"], "other",
        "the run's peak is the loading's: {s}"
    );
    let predicted = s["predicted_peak_bytes"].as_f64().unwrap();
    let step = s["step_peak_bytes"].as_f64().unwrap();
    let error = s["prediction_error_pct"].as_f64().unwrap();
    assert_eq!(error, (predicted - step) / step * 100.0);
    assert!(
        error.abs() < 5.0,
        "the step's prediction is off by {error}%"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
