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
