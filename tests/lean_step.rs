//! The lean step (an explicit layer tape, `core/src/step/tape.rs`) against Candle's autograd
//! (`Trainer::reference_grads`) as the oracle: same loss and gradients for every precision,
//! checkpointing, conv kind and accumulation; BatchNorm γ = 0 and tiny γ; running statistics
//! updated once; and the lean ops against their autograd counterparts.

mod common;

use candle_core::{DType, Device, Tensor};
use memtrain::config::{ConvKind, GradCheckpointing, Precision, TrainConfig};
use memtrain_kernels::batchnorm::{self as bn, BnParams};

/// Relative tolerance of the gradients: f32 computes the same sums in another order; half types
/// round every stored activation, so two orders of work differ by more.
fn tolerance(p: Precision) -> f64 {
    match p {
        Precision::F32 => 1e-5,
        Precision::F16 => 2e-2,
        Precision::Bf16 => 6e-2,
    }
}

fn compare(cfg: TrainConfig, n: usize, seed: u64) {
    let label = format!(
        "{} {} {} accum {} width {}",
        cfg.memory.precision,
        cfg.memory.grad_checkpointing,
        cfg.model.conv,
        cfg.steps.accum_steps,
        cfg.model.width
    );
    let tol = tolerance(cfg.memory.precision);
    let t = common::trainer(cfg);
    let (x, y) = common::batch(n, seed);
    let (loss, grads) = t.compute_grads(&x, &y).unwrap();
    let (loss_ref, grads_ref) = t.reference_grads(&x, &y).unwrap();
    assert!(
        (loss - loss_ref).abs() <= tol * loss_ref.abs(),
        "{label}: loss {loss} vs autograd {loss_ref}"
    );
    assert_eq!(grads.len(), grads_ref.len());
    for (i, (g, r)) in grads.iter().zip(&grads_ref).enumerate() {
        let (g, r) = (g.as_ref().unwrap(), r.as_ref().unwrap());
        assert_eq!(g.dims(), r.dims(), "{label}: parameter {i} shape");
        assert_eq!(g.dtype(), DType::F32, "{label}: gradients are f32");
        let d = common::rel_diff(g, r);
        assert!(
            d <= tol,
            "{label}: gradient of parameter {i} differs from autograd by {d:e} (tolerance {tol:e})"
        );
    }
}

#[test]
fn every_configuration_matches_autograd() {
    for precision in [Precision::F32, Precision::F16, Precision::Bf16] {
        for checkpoint in [
            GradCheckpointing::None,
            GradCheckpointing::Stages,
            GradCheckpointing::Blocks,
            // segments:2 (stage 1 recomputed, stages 2 and 3 saved) and segments:1,3,4.
            GradCheckpointing::from_cuts(0b00010),
            GradCheckpointing::from_cuts(0b01101),
        ] {
            for conv in [ConvKind::Standard, ConvKind::Separable] {
                for accum_steps in [1, 2] {
                    let mut cfg = common::tiny_config();
                    cfg.memory.precision = precision;
                    cfg.memory.grad_checkpointing = checkpoint;
                    cfg.model.conv = conv;
                    cfg.steps.accum_steps = accum_steps;
                    compare(cfg, 16, 7);
                }
            }
        }
    }
}

#[test]
fn a_wider_net_matches_autograd_in_f32() {
    for checkpoint in [GradCheckpointing::None, GradCheckpointing::Stages] {
        let mut cfg = common::tiny_config();
        cfg.model.width = 12;
        cfg.memory.grad_checkpointing = checkpoint;
        compare(cfg, 16, 11);
    }
}

#[test]
fn frozen_batch_norm_matches_autograd() {
    for conv in [ConvKind::Standard, ConvKind::Separable] {
        let mut cfg = common::tiny_config();
        cfg.model.conv = conv;
        let mut t = common::trainer(cfg);
        t.model.freeze_batch_norm();
        let (x, y) = common::batch(16, 5);
        let (_, grads) = t.compute_grads(&x, &y).unwrap();
        let (_, grads_ref) = t.reference_grads(&x, &y).unwrap();
        for (i, (g, r)) in grads.iter().zip(&grads_ref).enumerate() {
            let d = common::rel_diff(g.as_ref().unwrap(), r.as_ref().unwrap());
            assert!(d <= 1e-5, "{conv}: parameter {i} differs by {d:e}");
        }
    }
}

/// γ = 0 makes the block's output constant (relu(β)); γ tiny makes the normalized value
/// huge relative to the output. The lean step never divides by γ, so both are ordinary values.
#[test]
fn zero_and_tiny_gamma_match_autograd() {
    for gamma in [0.0f32, 1e-8, -1e-6] {
        let t = common::trainer(common::tiny_config());
        for (k, b) in t.model.blocks.iter().enumerate() {
            let c = b.cout;
            // Mix the special value with ordinary ones, and a β that keeps some outputs positive.
            let g: Vec<f32> = (0..c)
                .map(|i| {
                    if i % 2 == 0 {
                        gamma
                    } else {
                        0.5 + i as f32 * 0.1
                    }
                })
                .collect();
            let be: Vec<f32> = (0..c)
                .map(|i| 0.05 * (i as f32 - 1.0) + 0.01 * k as f32)
                .collect();
            b.bn.gamma
                .set(&Tensor::new(g, &Device::Cpu).unwrap())
                .unwrap();
            b.bn.beta
                .set(&Tensor::new(be, &Device::Cpu).unwrap())
                .unwrap();
        }
        let (x, y) = common::batch(16, 9);
        let (_, grads) = t.compute_grads(&x, &y).unwrap();
        let (_, grads_ref) = t.reference_grads(&x, &y).unwrap();
        for (i, (g, r)) in grads.iter().zip(&grads_ref).enumerate() {
            let (g, r) = (g.as_ref().unwrap(), r.as_ref().unwrap());
            let d = common::rel_diff(g, r);
            assert!(d <= 1e-5, "γ={gamma}: parameter {i} differs by {d:e}");
        }
    }
}

#[test]
fn running_statistics_are_updated_once_per_step() {
    let mut stats = Vec::new();
    for checkpoint in [
        GradCheckpointing::None,
        GradCheckpointing::Stages,
        GradCheckpointing::Blocks,
        GradCheckpointing::from_cuts(0b00010),
    ] {
        let mut cfg = common::tiny_config();
        cfg.memory.grad_checkpointing = checkpoint;
        let t = common::trainer(cfg);
        let (x, y) = common::batch(16, 3);
        t.compute_grads(&x, &y).unwrap();
        let s: Vec<Vec<f32>> = t
            .model
            .named_buffers()
            .into_iter()
            .map(|(_, b)| b.to_vec1::<f32>().unwrap())
            .collect();
        stats.push((checkpoint, s));
    }
    // The autograd path updates them once too: compare with it.
    let t = common::trainer(common::tiny_config());
    let (x, y) = common::batch(16, 3);
    t.reference_grads(&x, &y).unwrap();
    let oracle: Vec<Vec<f32>> = t
        .model
        .named_buffers()
        .into_iter()
        .map(|(_, b)| b.to_vec1::<f32>().unwrap())
        .collect();
    for (ckpt, s) in &stats {
        for (a, b) in s.iter().zip(&oracle) {
            for (u, v) in a.iter().zip(b) {
                assert!(
                    (u - v).abs() <= 1e-6 * v.abs().max(1.0),
                    "{ckpt}: {u} vs {v}"
                );
            }
        }
    }
}

fn params_for(h: &Tensor, seed: u64) -> BnParams {
    let c = h.dim(1).unwrap();
    let gamma: Vec<f32> = (0..c)
        .map(|i| 0.5 + ((i as u64 * 7 + seed) % 5) as f32 * 0.3)
        .collect();
    let beta: Vec<f32> = (0..c)
        .map(|i| ((i as u64 * 3 + seed) % 7) as f32 * 0.1 - 0.3)
        .collect();
    BnParams {
        gamma: Tensor::new(gamma, &Device::Cpu).unwrap(),
        beta: Tensor::new(beta, &Device::Cpu).unwrap(),
        stats: bn::batch_stats(h).unwrap(),
        eps: 1e-5,
        batch_stats: true,
        decisions: None,
    }
}

/// The fused pool kernels equal max-pool of the materialized ReLU output, bit for bit, and the
/// argmax is one byte per pooled element.
#[test]
fn fused_pool_equals_pool_of_relu_output() {
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let h = Tensor::randn(0f32, 1.0, (3, 5, 8, 6), &Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let p = params_for(&h, 1);
        let y = bn::bn_relu(&h, &p).unwrap();
        let want = memtrain_kernels::pool::max_pool2x2(&y).unwrap();
        let got = bn::bn_relu_pool(&h, &p).unwrap();
        assert_eq!(
            got.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            want.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            "{dt:?}"
        );
        let am = bn::bn_relu_pool_argmax(&h, &p).unwrap().unwrap();
        assert_eq!(am.dtype(), DType::U8);
        assert_eq!(am.dims(), &[3, 5, 4, 3]);
        // In place: y written over h equals the fresh y.
        let y2 = bn::bn_relu_in_place(h.copy().unwrap(), &p).unwrap();
        assert_eq!(
            y2.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            y.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        );
    }
}

/// The in-place backward passes equal autograd through batch_norm_train (+ max-pool); so does the
/// path without the CPU kernels (no argmax: the ReLU output materialized, the max-pool op's
/// backward), which is what CUDA runs.
#[test]
fn lean_batch_norm_backward_equals_autograd() {
    for (pool, with_argmax) in [(false, true), (true, true), (true, false)] {
        let h0 = Tensor::randn(0.3f32, 1.5, (4, 3, 6, 4), &Device::Cpu).unwrap();
        let p = params_for(&h0, 2);
        let hv = candle_core::Var::from_tensor(&h0).unwrap();
        let gv = candle_core::Var::from_tensor(&p.gamma).unwrap();
        let bv = candle_core::Var::from_tensor(&p.beta).unwrap();
        let (y, _, _) =
            bn::batch_norm_train(hv.as_tensor(), gv.as_tensor(), bv.as_tensor(), 1e-5, true)
                .unwrap();
        let out = if pool {
            memtrain_kernels::pool::max_pool2x2(&y).unwrap()
        } else {
            y
        };
        let up = Tensor::randn(0f32, 1.0, out.dims(), &Device::Cpu).unwrap();
        let store = (out * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let (dh, dg, db) = if pool {
            let am = bn::bn_relu_pool_argmax(&h0, &p)
                .unwrap()
                .filter(|_| with_argmax);
            bn::bn_relu_pool_backward(h0.copy().unwrap(), &up, am.as_ref(), &p).unwrap()
        } else {
            bn::bn_relu_backward(&h0, up.copy().unwrap(), &p).unwrap()
        };
        for (name, got, v) in [
            ("h", &dh, hv.as_tensor()),
            ("gamma", &dg, gv.as_tensor()),
            ("beta", &db, bv.as_tensor()),
        ] {
            let want = store.get(v).unwrap();
            let d = common::rel_diff(got, want);
            assert!(
                d <= 1e-5,
                "pool {pool} argmax {with_argmax}: grad of {name} differs by {d:e}"
            );
        }
    }
}

/// With the forward's decisions (`bn_relu_decisions`, for lossy codes), every pass reads the
/// forward's ReLU mask and pool argmax from any h it is given: an h moved far from the one the
/// decisions came from gives the exact h's mask, argmax and dβ (a sum of the masked gradient),
/// bit for bit, in every dtype, whole or a chunk of images at a time.
#[test]
fn decided_passes_read_the_forwards_decisions_whatever_h_they_are_given() {
    let to_vec = common::values;
    // 6x6 planes: 36 values, so each plane's decisions end in a partly used byte.
    let dims = (3, 5, 6, 6);
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let h = Tensor::randn(0f32, 1.0, dims, &Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        // A lossy h: far more error than any code makes.
        let moved = (&h
            + Tensor::randn(0f32, 0.7, dims, &Device::Cpu)
                .unwrap()
                .to_dtype(dt))
        .unwrap();
        let p = params_for(&h, 2);
        let g = Tensor::randn(0f32, 1.0, dims, &Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        for pool in [false, true] {
            let label = format!("{dt:?} pool {pool}");
            let d = bn::bn_relu_decisions(&h, &p, pool).unwrap();
            assert_eq!(d.dims(), bn::decisions_dims([3, 5, 6, 6]), "{label}");
            let bits = d.flatten_all().unwrap().to_vec1::<u8>().unwrap();
            let bit = |i: usize| bits[i / 36 * 5 + i % 36 / 8] >> (i % 36 % 8) & 1 == 1;
            let decided = p.clone().decided(d.clone());
            if !pool {
                // The bits are the mask of the exact output, and a decided output of the moved
                // h is positive exactly there.
                let y = to_vec(&bn::bn_relu(&h, &p).unwrap());
                let y_moved = bn::bn_relu(&moved, &decided).unwrap();
                let yd = to_vec(&y_moved);
                for (i, (&a, &b)) in y.iter().zip(&yd).enumerate() {
                    assert_eq!(bit(i), a > 0.0, "{label}: bit {i}");
                    assert_eq!(b > 0.0, a > 0.0, "{label}: value {i}: {b} against {a}");
                }
                // The same, a chunk of images at a time.
                let chunk = bn::bn_relu_in_place(
                    moved.narrow(0, 1, 2).unwrap().copy().unwrap(),
                    &decided.images(1, 2).unwrap(),
                )
                .unwrap();
                assert_eq!(to_vec(&chunk), to_vec(&y_moved.narrow(0, 1, 2).unwrap()));
                let (_, _, db) = bn::bn_relu_backward(&h, g.copy().unwrap(), &p).unwrap();
                let (_, _, db_moved) =
                    bn::bn_relu_backward(&moved, g.copy().unwrap(), &decided).unwrap();
                assert_eq!(to_vec(&db_moved), to_vec(&db), "{label}: dβ");
            } else {
                // The bits are each window's argmax where its maximum is positive; the moved h
                // pools to a positive value exactly there, through the same argmax.
                let pooled = to_vec(&bn::bn_relu_pool(&h, &p).unwrap());
                let am = bn::bn_relu_pool_argmax(&h, &p).unwrap().unwrap();
                let am_v = am.flatten_all().unwrap().to_vec1::<u8>().unwrap();
                let pooled_moved = to_vec(&bn::bn_relu_pool(&moved, &decided).unwrap());
                let am_moved = bn::bn_relu_pool_argmax(&moved, &decided).unwrap().unwrap();
                let am_moved_v = am_moved.flatten_all().unwrap().to_vec1::<u8>().unwrap();
                for (o, &v) in pooled.iter().enumerate() {
                    let (plane, win) = (o / 9, o % 9);
                    let (oy, ox) = (win / 3, win % 3);
                    for k in 0..4 {
                        let i = plane * 36 + (2 * oy + k / 2) * 6 + 2 * ox + k % 2;
                        let want = v > 0.0 && am_v[o] as usize == k;
                        assert_eq!(bit(i), want, "{label}: window {o}, position {k}");
                    }
                    assert_eq!(pooled_moved[o] > 0.0, v > 0.0, "{label}: window {o}");
                    if v > 0.0 {
                        assert_eq!(am_moved_v[o], am_v[o], "{label}: window {o}");
                    }
                }
                let gp = g.narrow(2, 0, 3).unwrap().narrow(3, 0, 3).unwrap();
                let (_, _, db) =
                    bn::bn_relu_pool_backward(h.copy().unwrap(), &gp, Some(&am), &p).unwrap();
                let (_, _, db_moved) = bn::bn_relu_pool_backward(
                    moved.copy().unwrap(),
                    &gp,
                    Some(&am_moved),
                    &decided,
                )
                .unwrap();
                assert_eq!(to_vec(&db_moved), to_vec(&db), "{label}: dβ");
            }
        }
    }
}
