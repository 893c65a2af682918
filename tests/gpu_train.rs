//! Training on CUDA (run on a GPU machine: `cargo test --release --features cuda -- --ignored`):
//! every optimization combination trains in f32, f16 and bf16, gradients match the CPU within
//! the dtype's tolerance, and `--memory-limit` turns an oversized step into a clean OOM error.
#![cfg(feature = "cuda")]

mod common;

use memtrain::config::{ConvKind, GradCheckpointing, Precision, Tf32, TrainConfig};

fn on(device: &str, mut cfg: TrainConfig) -> TrainConfig {
    cfg.device = Some(device.into());
    cfg
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_combination_trains_on_cuda_and_matches_the_cpu() {
    let (x, y) = common::batch(16, 11);
    for precision in Precision::ALL {
        for accum in [1, 2] {
            for checkpoint in GradCheckpointing::ALL {
                for conv in ConvKind::ALL {
                    let mut cfg = common::tiny_config();
                    cfg.memory.precision = *precision;
                    cfg.steps.accum_steps = accum;
                    cfg.memory.grad_checkpointing = *checkpoint;
                    cfg.model.conv = *conv;
                    cfg.model.width = 8;
                    // Exact f32 convolutions: the f32 tolerance is the CPU's, not TF32's
                    // (tests/gpu_graph.rs checks --tf32 on against its own tolerance).
                    cfg.cuda.tf32 = Tf32::Off;
                    let label = cfg.label();
                    let cpu = common::trainer(on("cpu", cfg.clone()));
                    let gpu = common::trainer(on("cuda:0", cfg.clone()));
                    let (lc, gc) = cpu.compute_grads(&x, &y).unwrap();
                    let (lg, gg) = gpu
                        .compute_grads(&x, &y)
                        .unwrap_or_else(|e| panic!("{label}: {e}"));
                    let tol = match precision {
                        Precision::F32 => 1e-4,
                        Precision::F16 => 2e-2,
                        Precision::Bf16 => 8e-2,
                    };
                    assert!(
                        (lg - lc).abs() <= tol * lc.abs(),
                        "{label}: loss {lg} on cuda vs {lc} on cpu"
                    );
                    for (i, (a, b)) in gg.iter().zip(&gc).enumerate() {
                        let a = a
                            .as_ref()
                            .unwrap()
                            .to_device(&candle_core::Device::Cpu)
                            .unwrap();
                        let d = common::rel_diff(&a, b.as_ref().unwrap());
                        assert!(
                            d <= 10.0 * tol,
                            "{label}: gradient {i} differs by {d:e} between cuda and cpu"
                        );
                    }
                    let mut t = common::trainer(on("cuda:0", cfg));
                    let s = t.fit().unwrap_or_else(|e| panic!("{label}: {e}"));
                    assert!(s.quality.final_train_loss.unwrap().is_finite(), "{label}");
                    assert_eq!(s.memory.probe, "cuda-pool");
                    assert!(
                        s.memory.peak_bytes > 0,
                        "{label}: the pool probe measured nothing"
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn memory_limit_stops_with_an_oom_error() {
    let mut cfg = common::tiny_config();
    cfg.model.width = 32;
    cfg.steps.batch_size = 512;
    cfg.data.synthetic_train = 512;
    cfg.memory.memory_limit = Some(64 << 20);
    cfg.device = Some("cuda:0".into());
    let mut t = common::trainer(cfg);
    match t.fit() {
        Err(e) if e.is_oom() => {
            let msg = e.to_string();
            assert!(
                msg.contains("64.00 MiB") && msg.contains("batch 1 (epoch 1)"),
                "{msg}"
            );
            assert_eq!(msg.lines().count(), 1);
        }
        other => panic!("expected an out-of-memory error, got {other:?}"),
    }
}

/// On CUDA the layer events reach `on_layer_end` as on the CPU, one per timeline event; with
/// `--cuda-graph` the training steps send none (they run inside one launch) and the evaluation
/// still sends its layers.
#[test]
#[ignore = "needs a CUDA GPU"]
fn layer_events_reach_the_callbacks_on_cuda() {
    use memtrain::callbacks::{Callback, LayerEnd};
    use memtrain::train::TrainerOptions;
    use std::sync::{Arc, Mutex};
    struct Layers(Arc<Mutex<Vec<(usize, String, u64)>>>);
    impl Callback for Layers {
        fn on_layer_end(&mut self, ctx: &LayerEnd<'_>) -> memtrain::Result<()> {
            let seen = (ctx.batch, ctx.phase.to_string(), ctx.peak_bytes);
            self.0.lock().unwrap().push(seen);
            Ok(())
        }
    }
    for graph in [false, true] {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut cfg = on("cuda:0", common::tiny_config());
        cfg.steps.max_steps = Some(3);
        cfg.data.synthetic_test = 16;
        cfg.output.eval = true;
        cfg.cuda.cuda_graph = graph;
        let options = TrainerOptions {
            callbacks: vec![Box::new(Layers(seen.clone()))],
            ..Default::default()
        };
        let mut t = common::trainer_with(cfg, options);
        t.fit().unwrap();
        let seen = seen.lock().unwrap().clone();
        let train: Vec<_> = seen.iter().filter(|s| s.1 != "eval").collect();
        assert!(
            seen.iter().any(|s| s.1 == "eval"),
            "graph {graph}: {seen:?}"
        );
        if graph {
            assert!(train.is_empty(), "{train:?}");
        } else {
            let timeline = t.step_timeline();
            let layers = timeline.events.len() - 1; // the last event is the optimizer's
            assert_eq!(train.len(), 3 * layers);
            let last: Vec<_> = train
                .iter()
                .filter(|s| s.0 == timeline.global_step - 1)
                .collect();
            let peaks: Vec<u64> = last.iter().map(|s| s.2).collect();
            let expected: Vec<u64> = timeline.events[..layers]
                .iter()
                .map(|e| e.peak_bytes)
                .collect();
            assert_eq!(peaks, expected);
        }
    }
}

/// The CUDA estimate is never below the measured peak, where cuDNN runs some passes of the
/// largest layers on the im2col op (batch 512; on an H200 cuDNN had no deterministic algorithm
/// for several of them within its workspace, and the estimate, counting no columns, was 17% low).
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_cuda_estimate_is_never_below_the_measured_peak() {
    for precision in [Precision::F32, Precision::Bf16] {
        let mut cfg = on("cuda:0", common::tiny_config());
        cfg.model.width = 32;
        cfg.steps.batch_size = 512;
        cfg.steps.max_steps = Some(3);
        cfg.data.synthetic_train = 1536;
        cfg.memory.precision = precision;
        let mut t = common::trainer(cfg);
        let s = t.fit().unwrap();
        let predicted = s.estimate.predicted_peak_bytes.unwrap();
        let measured = s.memory.peak_bytes;
        let over = (predicted as f64 / measured as f64 - 1.0) * 100.0;
        eprintln!("{precision:?}: predicted {predicted} measured {measured} ({over:+.2}%)");
        assert!(predicted >= measured, "{precision:?}: {over:+.2}%");
        assert!(over <= 5.0, "{precision:?}: {over:+.2}%");
    }
}
