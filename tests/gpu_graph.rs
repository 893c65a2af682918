//! `--cuda-graph` and `--tf32` on a GPU (run on a GPU machine:
//! `cargo test --release --features cuda --test gpu_graph -- --ignored --test-threads=1`, and
//! again with `--features cuda,cudnn`): a run whose steps are captured and replayed ends with the
//! same losses, weights and BatchNorm statistics as the same run stepped eagerly, the summary
//! reports the graph's kernels and replays, and TF32 convolutions stay within TF32's tolerance
//! of the CPU.
#![cfg(feature = "cuda")]

mod common;

use std::sync::{Mutex, MutexGuard};

use memtrain::config::{ConvKind, GradCheckpointing, Precision, Tf32, TrainConfig};

/// One test at a time: they share the GPU and the process-wide TF32 flag.
fn gpu_lock() -> MutexGuard<'static, ()> {
    static GPU: Mutex<()> = Mutex::new(());
    GPU.lock().unwrap_or_else(|p| p.into_inner())
}

fn on_gpu(mut cfg: TrainConfig) -> TrainConfig {
    cfg.device = Some("cuda:0".into());
    cfg.data.synthetic_train = 256;
    cfg.steps.max_steps = Some(6);
    cfg
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn captured_steps_equal_eager_steps() {
    let _gpu = gpu_lock();
    let cases = [
        (
            Precision::F32,
            1,
            GradCheckpointing::None,
            ConvKind::Standard,
            1e-5,
        ),
        (
            Precision::F32,
            2,
            GradCheckpointing::Stages,
            ConvKind::Separable,
            1e-5,
        ),
        (
            Precision::Bf16,
            2,
            GradCheckpointing::Blocks,
            ConvKind::Standard,
            2e-2,
        ),
        // f16: the loss scale is a constant of the captured kernels; a change captures again.
        (
            Precision::F16,
            1,
            GradCheckpointing::None,
            ConvKind::Standard,
            2e-2,
        ),
    ];
    for (precision, accum_steps, checkpoint, conv, tol) in cases {
        let mut cfg = common::tiny_config();
        cfg.memory.precision = precision;
        cfg.steps.accum_steps = accum_steps;
        cfg.memory.grad_checkpointing = checkpoint;
        cfg.model.conv = conv;
        cfg.model.width = 8;
        cfg.steps.batch_size = 32;
        // Exact f32 math on both sides, so that only the launch mechanism differs.
        cfg.cuda.tf32 = Tf32::Off;
        let mut cfg = on_gpu(cfg);
        let label = cfg.label();
        let mut eager = common::trainer(cfg.clone());
        let se = eager.fit().unwrap_or_else(|e| panic!("{label} eager: {e}"));
        cfg.cuda.cuda_graph = true;
        let mut graph = common::trainer(cfg);
        let sg = graph.fit().unwrap_or_else(|e| panic!("{label} graph: {e}"));

        assert_eq!(se.progress.steps, sg.progress.steps, "{label}");
        let (le, lg) = (
            se.quality.final_train_loss.unwrap(),
            sg.quality.final_train_loss.unwrap(),
        );
        assert!(
            (le - lg).abs() <= tol * le.abs(),
            "{label}: loss {lg} captured vs {le} eager"
        );
        assert_eq!(se.skipped_steps, sg.skipped_steps, "{label}");
        for (i, (a, b)) in common::params(&graph)
            .iter()
            .zip(&common::params(&eager))
            .enumerate()
        {
            let d = common::rel_diff(a, b);
            assert!(d <= tol, "{label}: parameter {i} differs by {d:e}");
        }
        let (bg, be) = (graph.model.named_buffers(), eager.model.named_buffers());
        for ((name, a), (_, b)) in bg.iter().zip(&be) {
            let d = common::rel_diff(a, b);
            assert!(d <= tol, "{label}: {name} differs by {d:e}");
        }

        assert_eq!(se.cuda_graph, None, "{label}: an eager run has no graph");
        let g = sg
            .cuda_graph
            .unwrap_or_else(|| panic!("{label}: no graph stats"));
        // Step 1 warms up, step 2 is captured and launched, steps 3.. replay.
        assert!(g.captures >= 1, "{label}: {g:?}");
        assert_eq!(
            g.captures + g.replays,
            sg.progress.steps - 1,
            "{label}: {g:?}"
        );
        if precision != Precision::F16 {
            assert_eq!(
                g.captures, 1,
                "{label}: nothing changes between steps: {g:?}"
            );
        }
        assert!(g.kernel_nodes > 0 && g.alloc_nodes > 0, "{label}: {g:?}");
        assert_eq!(
            g.nodes,
            g.kernel_nodes
                + g.memcpy_nodes
                + g.memset_nodes
                + g.alloc_nodes
                + g.free_nodes
                + g.other_nodes,
            "{label}: {g:?}"
        );
        assert!(g.graph_mem_used_high_bytes > 0, "{label}: {g:?}");
        eprintln!("{label}: {g:?}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tf32_convolutions_stay_within_tf32_tolerance_of_the_cpu() {
    let _gpu = gpu_lock();
    let (x, y) = common::batch(16, 5);
    let mut cfg = common::tiny_config();
    cfg.model.width = 8;
    let cpu = common::trainer(cfg.clone());
    let (lc, gc) = cpu.compute_grads(&x, &y).unwrap();
    for (mode, tol) in [(Tf32::Off, 1e-4), (Tf32::On, 1e-2)] {
        let mut on = cfg.clone();
        on.cuda.tf32 = mode;
        let gpu = common::trainer(on_gpu(on));
        assert_eq!(memtrain_kernels::tf32(), mode == Tf32::On);
        let (lg, gg) = gpu.compute_grads(&x, &y).unwrap();
        assert!(
            (lg - lc).abs() <= tol * lc.abs(),
            "--tf32 {mode}: loss {lg} vs {lc}"
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
                "--tf32 {mode}: gradient {i} differs by {d:e}"
            );
        }
    }
}
