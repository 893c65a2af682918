//! The estimate (the step's own tape run on sizes, `src/predict/sizing.rs`) against the counting
//! allocator over a grid no other test uses: widths 8–96, batches 1–512, every precision, named
//! and listed segmentations, accumulation, both conv kinds, int8/int4/int2 codes, AdamW, prefetch
//! depths.
//!
//! The bound: never below the measured step peak, and never above it by more than 0.05%. The
//! estimate adds [`HOST_BOOKKEEPING_BYTES`] whole for the host records it does not size one by
//! one (at most 44 B at the step peak on this grid).
//!
//! One test function, each case in a child process of its own: the allocator's counters and the
//! gemm crate's per-thread buffers are process-wide.

use memtrain::config::{
    ActivationStorage, ConvKind, GradCheckpointing, OptimizerKind, Precision, TrainConfig,
};
use memtrain::data::{synthetic, DataSplits};
#[cfg(doc)]
use memtrain::predict::HOST_BOOKKEEPING_BYTES;
use memtrain::train::{Trainer, TrainerOptions};
use memtrain_core::memory::CountingAllocator;

#[global_allocator]
static A: CountingAllocator = CountingAllocator;

const TRAIN_IMAGES: usize = 1024;

struct Case {
    width: usize,
    batch: usize,
    precision: Precision,
    checkpoint: &'static str,
    accum: usize,
    conv: ConvKind,
    storage: ActivationStorage,
    adamw: bool,
    prefetch: Option<usize>,
}

const fn case(width: usize, batch: usize, precision: Precision, checkpoint: &'static str) -> Case {
    Case {
        width,
        batch,
        precision,
        checkpoint,
        accum: 1,
        conv: ConvKind::Standard,
        storage: ActivationStorage::None,
        adamw: false,
        prefetch: None,
    }
}

fn grid() -> Vec<Case> {
    use Precision::*;
    vec![
        case(8, 1, F32, "none"),
        Case {
            accum: 2,
            ..case(8, 2, F32, "none")
        },
        case(8, 512, F32, "stages"),
        Case {
            conv: ConvKind::Separable,
            ..case(16, 64, Bf16, "blocks")
        },
        case(32, 128, F32, "none"),
        case(32, 128, F16, "blocks"),
        Case {
            conv: ConvKind::Separable,
            ..case(32, 128, F32, "none")
        },
        Case {
            storage: ActivationStorage::Int8,
            ..case(32, 128, F32, "none")
        },
        Case {
            storage: ActivationStorage::Int8,
            ..case(32, 128, Bf16, "stages")
        },
        Case {
            accum: 3,
            ..case(24, 96, F32, "segments:1,3")
        },
        Case {
            accum: 2,
            conv: ConvKind::Separable,
            ..case(64, 32, F32, "segments:2")
        },
        case(96, 16, F32, "none"),
        Case {
            prefetch: Some(3),
            ..case(32, 256, Bf16, "none")
        },
        Case {
            adamw: true,
            ..case(48, 64, F16, "segments:4")
        },
        Case {
            storage: ActivationStorage::Int8,
            conv: ConvKind::Separable,
            ..case(16, 32, F32, "blocks")
        },
        Case {
            accum: 4,
            storage: ActivationStorage::Int8,
            ..case(32, 64, F16, "stages")
        },
        Case {
            storage: ActivationStorage::Int4,
            ..case(32, 128, F32, "none")
        },
        Case {
            storage: ActivationStorage::Int2,
            ..case(32, 128, Bf16, "stages")
        },
        Case {
            storage: ActivationStorage::Int4,
            conv: ConvKind::Separable,
            accum: 2,
            ..case(16, 32, F16, "blocks")
        },
        Case {
            storage: ActivationStorage::Int2,
            accum: 3,
            ..case(24, 96, F32, "segments:1,3")
        },
        // Chunks of images, the last one shorter (16-image chunks of stage 1).
        Case {
            storage: ActivationStorage::Int4,
            ..case(32, 100, F32, "none")
        },
        Case {
            storage: ActivationStorage::Int2,
            ..case(32, 128, Bf16, "none")
        },
    ]
}

fn config(c: &Case) -> TrainConfig {
    let mut cfg = TrainConfig::default();
    cfg.model.width = c.width;
    cfg.steps.batch_size = c.batch;
    cfg.memory.precision = c.precision;
    cfg.memory.grad_checkpointing = c
        .checkpoint
        .parse::<GradCheckpointing>()
        .expect("segmentation");
    cfg.steps.accum_steps = c.accum;
    cfg.model.conv = c.conv;
    cfg.memory.compress_activations = c.storage.into();
    cfg.optimizer.kind = if c.adamw {
        OptimizerKind::Adamw
    } else {
        OptimizerKind::Sgd
    };
    cfg.prefetch = c.prefetch;
    cfg.steps.max_steps = Some(2);
    cfg.output.eval = false;
    cfg.output.quiet = true;
    cfg.device = Some("cpu".into());
    cfg.data.synthetic_train = TRAIN_IMAGES;
    cfg.data.synthetic_test = 16;
    cfg
}

/// Selects one case of the grid for a child process ([`measure`]).
const CASE_VAR: &str = "MEMTRAIN_ESTIMATE_GRID_CASE";

/// Trains case `i` in this process and prints its predicted and measured step peaks.
fn measure(i: usize) {
    let c = &grid()[i];
    let cfg = config(c);
    let pre = CountingAllocator::current();
    let (train, test) = synthetic::splits(TRAIN_IMAGES, 16, 7);
    let data = DataSplits {
        train,
        test,
        description: "synthetic".into(),
        test_is_validation: false,
    };
    CountingAllocator::reset_peak();
    let mut trainer = Trainer::new(cfg.clone(), data, TrainerOptions::default()).expect("trainer");
    let summary = trainer.fit().expect("training");
    // The step on the measured baseline: the process before training (this harness holds less
    // than a training binary's runtime, which `tests/estimate.rs` checks the modelled one against).
    let est = trainer.memory_estimate().expect("estimate").offset(pre);
    let predicted = est.peak - est.held.baseline_bytes + trainer.memory_log().baseline_bytes;
    println!(
        "case {i} {} | predicted {predicted} measured {}",
        cfg.label(),
        summary.memory.step_peak_bytes
    );
}

#[test]
fn the_estimate_is_the_measured_step_peak_over_a_grid() {
    if let Ok(i) = std::env::var(CASE_VAR) {
        measure(i.parse().expect("case index"));
        return;
    }
    // Each case in a fresh process, as a run is: what one case leaves behind (the gemm crate's
    // per-thread packing buffers, kept for the life of a thread) must not count in the next.
    let exe = std::env::current_exe().expect("test binary");
    let mut failures = Vec::new();
    for i in 0..grid().len() {
        let out = std::process::Command::new(&exe)
            .args([
                "--exact",
                "the_estimate_is_the_measured_step_peak_over_a_grid",
                "--nocapture",
            ])
            .env(CASE_VAR, i.to_string())
            .output()
            .expect("child test process");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let Some(line) = stdout.lines().find(|l| l.starts_with("case ")) else {
            panic!(
                "case {i} printed no result:\n{stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let num = |key: &str| -> f64 {
            let rest = &line[line.find(key).expect(key) + key.len()..];
            rest.split_whitespace()
                .next()
                .expect("value")
                .parse()
                .expect("number")
        };
        let (predicted, measured) = (num("predicted "), num("measured "));
        let over = predicted - measured;
        let line = format!(
            "{line} ({:+} B, {:+.4}%)",
            over as i64,
            over / measured * 100.0
        );
        eprintln!("{line}");
        if over > measured * 0.0005 || over < 0.0 {
            failures.push(line);
        }
    }
    assert!(
        failures.is_empty(),
        "outside the bound:\n{}",
        failures.join("\n")
    );
}
