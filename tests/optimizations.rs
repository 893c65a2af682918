//! The four memory optimizations are exact where they can be: accumulation equals a big batch
//! when BatchNorm is frozen (in training BatchNorm normalizes each micro-batch, so it does not:
//! docs/results/accum-batchnorm.md), checkpointing gives the same gradients and statistics, the
//! loss scaler skips overflowing steps; and every flag combination trains.

mod common;

use memtrain::config::{ConvKind, GradCheckpointing, Precision};
use memtrain::data::Batch;
use memtrain_core::step::precision::LossScaler;

fn batch(n: usize, seed: u64) -> Batch {
    let (images, labels) = common::batch(n, seed);
    Batch {
        images,
        labels,
        len: n,
        index: 0,
    }
}

/// Holds only with BatchNorm frozen (normalizing with its running statistics): in training mode
/// each micro-batch is normalized with its own statistics and the gradients differ.
#[test]
fn accumulation_equals_one_big_batch_when_batch_norm_is_frozen() {
    for conv in [ConvKind::Standard, ConvKind::Separable] {
        let b = batch(32, 7);
        let mut params = Vec::new();
        for k in [1, 4] {
            let mut cfg = common::tiny_config();
            cfg.steps.batch_size = 32;
            cfg.steps.accum_steps = k;
            cfg.model.conv = conv;
            cfg.optimizer.weight_decay = 5e-4;
            let mut t = common::trainer(cfg);
            // Batch statistics couple the images of a micro-batch; with running statistics each
            // image's gradient is its own and the sums must agree.
            t.model.freeze_batch_norm();
            t.train_step(&b, 0, 0).unwrap();
            t.train_step(&b, 0, 1).unwrap();
            params.push(common::params(&t));
        }
        for (i, (a, b)) in params[0].iter().zip(&params[1]).enumerate() {
            let d = common::rel_diff(b, a);
            assert!(
                d < 1e-5,
                "{conv}, BatchNorm frozen: parameter {i} differs by {d:e} relative between accum 1 and 4"
            );
        }
    }
}

#[test]
fn checkpointing_gives_identical_gradients_and_statistics() {
    for conv in [ConvKind::Standard, ConvKind::Separable] {
        let (x, y) = common::batch(16, 3);
        let mut results = Vec::new();
        for ckpt in [
            GradCheckpointing::None,
            GradCheckpointing::Stages,
            GradCheckpointing::Blocks,
        ] {
            let mut cfg = common::tiny_config();
            cfg.memory.grad_checkpointing = ckpt;
            cfg.model.conv = conv;
            let t = common::trainer(cfg);
            let (loss, grads) = t.compute_grads(&x, &y).unwrap();
            let stats: Vec<_> = t
                .model
                .named_buffers()
                .into_iter()
                .map(|(_, b)| b)
                .collect();
            results.push((ckpt, loss, grads, stats));
        }
        let (_, loss0, grads0, stats0) = &results[0];
        for (ckpt, loss, grads, stats) in &results[1..] {
            assert!(
                (loss - loss0).abs() <= 1e-6 * loss0.abs(),
                "{ckpt}: loss {loss} vs {loss0}"
            );
            for (i, (g, g0)) in grads.iter().zip(grads0).enumerate() {
                let (g, g0) = (g.as_ref().unwrap(), g0.as_ref().unwrap());
                let d = common::rel_diff(g, g0);
                assert!(
                    d <= 1e-6,
                    "{conv} {ckpt}: gradient of parameter {i} differs by {d:e}"
                );
            }
            for (s, s0) in stats.iter().zip(stats0) {
                assert_eq!(
                    s.to_vec1::<f32>().unwrap(),
                    s0.to_vec1::<f32>().unwrap(),
                    "{ckpt}: running statistics must be updated exactly once"
                );
            }
        }
    }
}

#[test]
fn loss_scaler_backs_off_and_grows() {
    let mut s = LossScaler {
        growth_interval: 3,
        ..LossScaler::default()
    };
    assert_eq!(s.scale, 65536.0);
    assert!(!s.update(false));
    assert_eq!((s.scale, s.skipped_steps), (32768.0, 1));
    assert!(s.update(true) && s.update(true));
    assert_eq!(s.scale, 32768.0);
    assert!(s.update(true));
    assert_eq!(
        s.scale, 65536.0,
        "doubles after growth_interval finite steps"
    );
    assert!(LossScaler::for_precision(Precision::Bf16).is_none());
    assert!(LossScaler::for_precision(Precision::F32).is_none());
    assert_eq!(LossScaler::default().growth_interval, 2000);
}

#[test]
fn planted_overflow_skips_the_step_and_halves_the_scale() {
    let mut cfg = common::tiny_config();
    cfg.memory.precision = Precision::F16;
    let mut t = common::trainer(cfg);
    let before = common::params(&t);
    // A scale this large overflows f16 (max 65504) in the backward pass.
    t.updater.scaler.as_mut().unwrap().scale = 1e30;
    let r = t.train_step(&batch(16, 1), 0, 0).unwrap();
    assert!(r.skipped, "the overflowing step must be skipped");
    let s = t.updater.scaler.as_ref().unwrap();
    assert_eq!(s.scale, 5e29);
    assert_eq!(s.skipped_steps, 1);
    for (a, b) in common::params(&t).iter().zip(&before) {
        assert_eq!(
            common::rel_diff(a, b),
            0.0,
            "weights unchanged by a skipped step"
        );
    }
    // With a sane scale the next step applies.
    t.updater.scaler.as_mut().unwrap().scale = 1024.0;
    let r = t.train_step(&batch(16, 2), 0, 1).unwrap();
    assert!(!r.skipped && r.loss.is_finite());
    assert!(common::params(&t)
        .iter()
        .zip(&before)
        .any(|(a, b)| common::rel_diff(a, b) > 0.0));
}

#[test]
fn f16_gradients_match_f32_within_half_precision() {
    let (x, y) = common::batch(16, 5);
    let grads = |precision| {
        let mut cfg = common::tiny_config();
        cfg.memory.precision = precision;
        let t = common::trainer(cfg);
        t.compute_grads(&x, &y).unwrap()
    };
    let (l32, g32) = grads(Precision::F32);
    for p in [Precision::F16, Precision::Bf16] {
        let (l, g) = grads(p);
        let tol = if p == Precision::F16 { 0.02 } else { 0.08 };
        assert!((l - l32).abs() < tol * l32.abs(), "{p}: loss {l} vs {l32}");
        for (a, b) in g.iter().zip(&g32) {
            let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
            assert_eq!(
                a.dtype(),
                candle_core::DType::F32,
                "gradients reach the optimizer in f32"
            );
            let d = common::rel_diff(a, b);
            assert!(d < 10.0 * tol, "{p}: gradient differs by {d} relative");
        }
    }
}

#[test]
fn every_flag_combination_trains() {
    for precision in Precision::ALL {
        for accum in [1, 2] {
            for checkpoint in GradCheckpointing::ALL {
                for conv in ConvKind::ALL {
                    let mut cfg = common::tiny_config();
                    cfg.memory.precision = *precision;
                    cfg.steps.accum_steps = accum;
                    cfg.memory.grad_checkpointing = *checkpoint;
                    cfg.model.conv = *conv;
                    cfg.steps.max_steps = Some(2);
                    cfg.data.synthetic_train = 32;
                    let label = cfg.label();
                    let mut t = common::trainer(cfg);
                    let s = t.fit().unwrap_or_else(|e| panic!("{label}: {e}"));
                    assert_eq!(s.progress.steps, 2, "{label}");
                    assert!(
                        s.quality.final_train_loss.unwrap().is_finite(),
                        "{label}: loss not finite"
                    );
                }
            }
        }
    }
}
