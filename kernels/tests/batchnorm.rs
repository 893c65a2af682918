//! The fused BatchNorm op against a reference built from plain Candle f32 tensor ops differentiated by
//! Candle's autograd: forward, batch statistics and all three gradients over many shapes (1×1 and odd
//! maps, one to eight images, 1/3/16 channels), ReLU on and off, a non-trivial upstream gradient;
//! f16/bf16 against the f32 op; the eval op against its formula; and the argument errors.

use candle_core::{DType, Device, Tensor, Var};
use memtrain_kernels::batchnorm::{batch_norm_eval, batch_norm_train};

mod common;
use common::rel_err;

const EPS: f64 = 1e-5;

/// Deterministic pseudo-random numbers (no dependence on Candle's RNG, so failures reproduce).
struct Lcg(u64);

impl Lcg {
    /// Uniform in [lo, hi).
    fn uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                lo + (hi - lo) * ((self.0 >> 40) as f32 / (1u64 << 24) as f32)
            })
            .collect()
    }
}

/// Inputs for one case: x with a different offset and spread per channel (so the mean is not ~0
/// and the statistics matter), gamma, beta, and the upstream-gradient weights r.
///
/// x takes values on a grid (129 levels per channel) rather than a continuum: two correct
/// implementations round differently, and an element whose pre-ReLU value lies within rounding of
/// zero would pass the gradient in one and mask it in the other. On a grid at most one level per
/// channel can be that close to the ReLU threshold, so such a tie is improbable, not expected.
struct Case {
    x: Tensor,
    gamma: Tensor,
    beta: Tensor,
    r: Tensor,
}

fn case(n: usize, c: usize, h: usize, w: usize, seed: u64) -> Case {
    let dev = Device::Cpu;
    let mut rng = Lcg(seed);
    let offs = rng.uniform(c, -2.0, 2.0);
    let spread = rng.uniform(c, 0.5, 3.0);
    let raw: Vec<f32> = rng
        .uniform(n * c * h * w, -1.0, 1.0)
        .iter()
        .map(|v| (v * 64.0).round() / 64.0)
        .collect();
    let x: Vec<f32> = raw
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let ch = (i / (h * w)) % c;
            offs[ch] + spread[ch] * v
        })
        .collect();
    Case {
        x: Tensor::from_vec(x, (n, c, h, w), &dev).unwrap(),
        gamma: Tensor::from_vec(rng.uniform(c, 0.5, 1.5), c, &dev).unwrap(),
        beta: Tensor::from_vec(rng.uniform(c, -0.5, 0.5), c, &dev).unwrap(),
        r: Tensor::from_vec(rng.uniform(n * c * h * w, -1.0, 1.0), (n, c, h, w), &dev).unwrap(),
    }
}

/// Training-mode BatchNorm from plain Candle ops: (y, mean [C], biased var [C]).
fn reference(x: &Tensor, gamma: &Tensor, beta: &Tensor, relu: bool) -> (Tensor, Tensor, Tensor) {
    let (n, c, h, w) = x.dims4().unwrap();
    let m = (n * h * w) as f64;
    let mean = (x.sum_keepdim((0, 2, 3)).unwrap() / m).unwrap();
    let xc = x.broadcast_sub(&mean).unwrap();
    let var = (xc.sqr().unwrap().sum_keepdim((0, 2, 3)).unwrap() / m).unwrap();
    let xhat = xc
        .broadcast_div(&(var.clone() + EPS).unwrap().sqrt().unwrap())
        .unwrap();
    let y = xhat
        .broadcast_mul(&gamma.reshape((1, c, 1, 1)).unwrap())
        .unwrap()
        .broadcast_add(&beta.reshape((1, c, 1, 1)).unwrap())
        .unwrap();
    let y = if relu { y.relu().unwrap() } else { y };
    (y, mean.flatten_all().unwrap(), var.flatten_all().unwrap())
}

/// Forward outputs and gradients (x, gamma, beta) of `loss = Σ y·r`.
struct Run {
    y: Tensor,
    mean: Tensor,
    var: Tensor,
    gx: Tensor,
    ggamma: Tensor,
    gbeta: Tensor,
}

/// Runs ours (`ours = true`) or the reference on the case, with x cast to `dtype`.
fn run(cs: &Case, dtype: DType, relu: bool, ours: bool) -> Run {
    run_on(cs, dtype, relu, ours, &Device::Cpu)
}

/// [`run`] on a given device.
fn run_on(cs: &Case, dtype: DType, relu: bool, ours: bool, dev: &Device) -> Run {
    let x = Var::from_tensor(&cs.x.to_dtype(dtype).unwrap().to_device(dev).unwrap()).unwrap();
    let gamma = Var::from_tensor(&cs.gamma.to_device(dev).unwrap()).unwrap();
    let beta = Var::from_tensor(&cs.beta.to_device(dev).unwrap()).unwrap();
    let (y, mean, var) = if ours {
        batch_norm_train(
            x.as_tensor(),
            gamma.as_tensor(),
            beta.as_tensor(),
            EPS,
            relu,
        )
        .unwrap()
    } else {
        reference(x.as_tensor(), gamma.as_tensor(), beta.as_tensor(), relu)
    };
    let loss = y
        .mul(&cs.r.to_dtype(dtype).unwrap().to_device(dev).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    Run {
        gx: grads.get(x.as_tensor()).expect("grad x").clone(),
        ggamma: grads.get(gamma.as_tensor()).expect("grad gamma").clone(),
        gbeta: grads.get(beta.as_tensor()).expect("grad beta").clone(),
        y,
        mean,
        var,
    }
}

/// N 1..8, C 1/3/16, H, W 1..9 (1×1, odd, non-square, one element per channel).
const SHAPES: [(usize, usize, usize, usize); 12] = [
    (1, 1, 1, 1),
    (1, 3, 1, 1),
    (8, 3, 1, 1),
    (2, 1, 3, 3),
    (1, 16, 5, 7),
    (4, 3, 9, 9),
    (8, 16, 2, 3),
    (3, 16, 9, 1),
    (5, 3, 7, 5),
    (6, 1, 1, 9),
    (2, 16, 8, 8),
    (7, 3, 4, 6),
];

#[test]
fn train_matches_candle_reference_f32() {
    for (i, &(n, c, h, w)) in SHAPES.iter().enumerate() {
        for relu in [false, true] {
            let cs = case(n, c, h, w, 17 + i as u64);
            let ours = run(&cs, DType::F32, relu, true);
            let refr = run(&cs, DType::F32, relu, false);
            let what = format!("shape {:?} relu {relu}", (n, c, h, w));
            assert_eq!(ours.y.dtype(), DType::F32);
            assert_eq!(ours.y.dims(), &[n, c, h, w]);
            for (name, a, b, tol) in [
                ("y", &ours.y, &refr.y, 1e-5),
                ("grad x", &ours.gx, &refr.gx, 1e-5),
                ("grad gamma", &ours.ggamma, &refr.ggamma, 1e-5),
                ("grad beta", &ours.gbeta, &refr.gbeta, 1e-5),
                ("mean", &ours.mean, &refr.mean, 1e-6),
                ("var", &ours.var, &refr.var, 1e-6),
            ] {
                let e = rel_err(a, b);
                assert!(e <= tol, "{what}: {name} rel err {e:e} > {tol:e}");
            }
        }
    }
}

/// Enough elements that the passes run on Candle's thread pool, and planes longer than one
/// conversion block (256), so the block and f64 accumulation paths are covered too.
#[test]
fn train_matches_reference_large() {
    for &(n, c, h, w) in &[(8, 16, 16, 16), (4, 3, 33, 31)] {
        for relu in [false, true] {
            let cs = case(n, c, h, w, 5);
            let ours = run(&cs, DType::F32, relu, true);
            let refr = run(&cs, DType::F32, relu, false);
            // Over thousands of elements per channel the f32 reference's own sums drift by ~1e-6,
            // so the statistics are checked against f64.
            let x64 = cs.x.to_dtype(DType::F64).unwrap();
            let m64 = x64.mean_keepdim((0, 2, 3)).unwrap();
            let v64 = x64
                .broadcast_sub(&m64)
                .unwrap()
                .sqr()
                .unwrap()
                .mean_keepdim((0, 2, 3))
                .unwrap();
            let (m64, v64) = (m64.flatten_all().unwrap(), v64.flatten_all().unwrap());
            for (name, a, b, tol) in [
                ("y", &ours.y, &refr.y, 1e-5),
                ("grad x", &ours.gx, &refr.gx, 1e-5),
                ("grad gamma", &ours.ggamma, &refr.ggamma, 1e-5),
                ("grad beta", &ours.gbeta, &refr.gbeta, 1e-5),
                ("mean", &ours.mean, &m64, 1e-6),
                ("var", &ours.var, &v64, 1e-6),
            ] {
                let e = rel_err(a, b);
                assert!(
                    e <= tol,
                    "{:?} relu {relu}: {name} rel err {e:e} > {tol:e}",
                    (n, c, h, w)
                );
            }
        }
    }
}

#[test]
fn batch_stats_are_detached_and_f32() {
    let cs = case(4, 3, 5, 5, 3);
    let x = Var::from_tensor(&cs.x.to_dtype(DType::F16).unwrap()).unwrap();
    let gamma = Var::from_tensor(&cs.gamma).unwrap();
    let beta = Var::from_tensor(&cs.beta).unwrap();
    let (y, mean, var) = batch_norm_train(
        x.as_tensor(),
        gamma.as_tensor(),
        beta.as_tensor(),
        EPS,
        true,
    )
    .unwrap();
    assert!(y.track_op(), "y must be differentiable");
    assert!(
        !mean.track_op() && !var.track_op(),
        "batch statistics must be detached"
    );
    assert_eq!((mean.dtype(), var.dtype()), (DType::F32, DType::F32));
    assert_eq!((mean.dims(), var.dims()), (&[3][..], &[3][..]));
    // Using them in the loss contributes nothing to any gradient.
    let loss =
        (y.to_dtype(DType::F32).unwrap().sum_all().unwrap() + mean.sum_all().unwrap()).unwrap();
    let grads = loss.backward().unwrap();
    assert!(grads.get(&mean).is_none() && grads.get(&var).is_none());
}

/// Numerically hard statistics: a large common offset with a small spread, where E[x²] − E[x]² in
/// f32 would cancel to garbage.
#[test]
fn variance_is_stable_with_large_mean() {
    let cs = case(4, 3, 8, 8, 9);
    let x = ((&cs.x * 1e-2).unwrap() + 1000.0).unwrap();
    let (_, mean, var) = batch_norm_train(&x, &cs.gamma, &cs.beta, EPS, false).unwrap();
    let x64 = x.to_dtype(DType::F64).unwrap();
    let m64 = x64.mean_keepdim((0, 2, 3)).unwrap();
    let v64 = x64
        .broadcast_sub(&m64)
        .unwrap()
        .sqr()
        .unwrap()
        .mean_keepdim((0, 2, 3))
        .unwrap();
    assert!(rel_err(&mean, &m64.flatten_all().unwrap()) < 1e-6);
    let e = rel_err(&var, &v64.flatten_all().unwrap());
    assert!(e < 1e-3, "variance rel err {e:e}");
}

#[test]
fn half_precision_matches_f32_op() {
    for (dtype, tol) in [(DType::F16, 3e-3f32), (DType::BF16, 2e-2)] {
        for (i, &(n, c, h, w)) in [(4, 3, 9, 9), (8, 16, 4, 4), (2, 16, 1, 1), (5, 3, 16, 17)]
            .iter()
            .enumerate()
        {
            for relu in [false, true] {
                // Round the inputs to the half dtype first so both runs see the same values.
                let mut cs = case(n, c, h, w, 40 + i as u64);
                cs.x = cs.x.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
                cs.r = cs.r.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
                let half = run(&cs, dtype, relu, true);
                let full = run(&cs, DType::F32, relu, true);
                let what = format!("{dtype:?} {:?} relu {relu}", (n, c, h, w));
                assert_eq!(half.y.dtype(), dtype, "{what}");
                assert_eq!(half.gx.dtype(), dtype, "{what}");
                assert_eq!(
                    (half.ggamma.dtype(), half.gbeta.dtype()),
                    (DType::F32, DType::F32),
                    "{what}"
                );
                assert_eq!(
                    (half.mean.dtype(), half.var.dtype()),
                    (DType::F32, DType::F32),
                    "{what}"
                );
                for (name, a, b, t) in [
                    ("y", &half.y, &full.y, tol),
                    ("grad x", &half.gx, &full.gx, tol),
                    // Same inputs, f32 accumulation: only the rounding of y (ReLU mask) can differ.
                    ("grad gamma", &half.ggamma, &full.ggamma, 1e-4),
                    ("grad beta", &half.gbeta, &full.gbeta, 1e-4),
                    ("mean", &half.mean, &full.mean, 1e-6),
                    ("var", &half.var, &full.var, 1e-6),
                ] {
                    let e = rel_err(a, b);
                    assert!(e <= t, "{what}: {name} rel err {e:e} > {t:e}");
                }
            }
        }
    }
}

#[test]
fn non_contiguous_input_and_untracked_x() {
    // x produced as an NHWC tensor and permuted: the op makes it contiguous, gradients flow back.
    let cs = case(3, 16, 5, 6, 77);
    let nhwc =
        Var::from_tensor(&cs.x.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap()).unwrap();
    let x = nhwc.as_tensor().permute((0, 3, 1, 2)).unwrap();
    assert!(!x.is_contiguous());
    let gamma = Var::from_tensor(&cs.gamma).unwrap();
    let beta = Var::from_tensor(&cs.beta).unwrap();
    let (y, _, _) = batch_norm_train(&x, gamma.as_tensor(), beta.as_tensor(), EPS, true).unwrap();
    let grads = y.mul(&cs.r).unwrap().sum_all().unwrap().backward().unwrap();
    let refr = run(&cs, DType::F32, true, false);
    let gx = grads
        .get(nhwc.as_tensor())
        .unwrap()
        .permute((0, 3, 1, 2))
        .unwrap();
    assert!(rel_err(&gx, &refr.gx) < 1e-5);
    assert!(rel_err(grads.get(gamma.as_tensor()).unwrap(), &refr.ggamma) < 1e-5);

    // x that needs no gradient (raw data): gamma and beta still get theirs.
    let (y, _, _) =
        batch_norm_train(&cs.x, gamma.as_tensor(), beta.as_tensor(), EPS, true).unwrap();
    let grads = y.mul(&cs.r).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(grads.get(&cs.x).is_none());
    assert!(rel_err(grads.get(gamma.as_tensor()).unwrap(), &refr.ggamma) < 1e-5);
    assert!(rel_err(grads.get(beta.as_tensor()).unwrap(), &refr.gbeta) < 1e-5);
}

#[test]
fn eval_matches_formula() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for relu in [false, true] {
            let cs = case(3, 16, 7, 5, 11);
            let c = 16;
            let mut rng = Lcg(99);
            let rm = Tensor::from_vec(rng.uniform(c, -1.0, 1.0), c, &Device::Cpu).unwrap();
            let rv = Tensor::from_vec(rng.uniform(c, 0.2, 4.0), c, &Device::Cpu).unwrap();
            let gamma = Var::from_tensor(&cs.gamma).unwrap();
            let x = cs.x.to_dtype(dtype).unwrap();
            let y = batch_norm_eval(&x, gamma.as_tensor(), &cs.beta, &rm, &rv, EPS, relu).unwrap();
            assert_eq!(y.dtype(), dtype);
            assert!(!y.track_op(), "eval output must not track gradients");
            let shape = (1, c, 1, 1);
            let x32 = x.to_dtype(DType::F32).unwrap();
            let expect = x32
                .broadcast_sub(&rm.reshape(shape).unwrap())
                .unwrap()
                .broadcast_div(&(rv.reshape(shape).unwrap() + EPS).unwrap().sqrt().unwrap())
                .unwrap()
                .broadcast_mul(&cs.gamma.reshape(shape).unwrap())
                .unwrap()
                .broadcast_add(&cs.beta.reshape(shape).unwrap())
                .unwrap();
            let expect = if relu { expect.relu().unwrap() } else { expect };
            let tol = match dtype {
                DType::F32 => 1e-6,
                DType::F16 => 1e-3,
                _ => 8e-3,
            };
            let e = rel_err(&y, &expect);
            assert!(e <= tol, "{dtype:?} relu {relu}: rel err {e:e}");
        }
    }
}

#[test]
fn bad_arguments_are_errors() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 3, 4, 4), DType::F32, &dev).unwrap();
    let g3 = Tensor::ones(3, DType::F32, &dev).unwrap();
    let b3 = Tensor::zeros(3, DType::F32, &dev).unwrap();
    let g4 = Tensor::ones(4, DType::F32, &dev).unwrap();
    // Wrong gamma / beta length.
    assert!(batch_norm_train(&x, &g4, &b3, EPS, false).is_err());
    assert!(batch_norm_train(&x, &g3, &g4, EPS, true).is_err());
    // gamma not 1-D.
    assert!(batch_norm_train(&x, &g3.reshape((1, 3)).unwrap(), &b3, EPS, false).is_err());
    // x not 4-D.
    let x3 = Tensor::zeros((2, 3, 16), DType::F32, &dev).unwrap();
    assert!(batch_norm_train(&x3, &g3, &b3, EPS, false).is_err());
    let x5 = Tensor::zeros((1, 2, 3, 4, 4), DType::F32, &dev).unwrap();
    assert!(batch_norm_train(&x5, &g3, &b3, EPS, false).is_err());
    // Empty x, unsupported dtypes, bad eps.
    let empty = Tensor::zeros((0, 3, 4, 4), DType::F32, &dev).unwrap();
    assert!(batch_norm_train(&empty, &g3, &b3, EPS, false).is_err());
    assert!(batch_norm_train(&x.to_dtype(DType::F64).unwrap(), &g3, &b3, EPS, false).is_err());
    assert!(batch_norm_train(&x.to_dtype(DType::U8).unwrap(), &g3, &b3, EPS, false).is_err());
    assert!(batch_norm_train(&x, &g3.to_dtype(DType::F16).unwrap(), &b3, EPS, false).is_err());
    assert!(batch_norm_train(&x, &g3, &b3, f64::NAN, false).is_err());
    assert!(batch_norm_train(&x, &g3, &b3, -1.0, false).is_err());
    // Eval: wrong running-statistics length, and a non-4-D x.
    assert!(batch_norm_eval(&x, &g3, &b3, &g4, &g3, EPS, false).is_err());
    assert!(batch_norm_eval(&x, &g3, &b3, &b3, &g4, EPS, false).is_err());
    assert!(batch_norm_eval(&x3, &g3, &b3, &b3, &g3, EPS, false).is_err());
    // And the valid call works.
    assert!(batch_norm_train(&x, &g3, &b3, EPS, false).is_ok());
    assert!(batch_norm_eval(&x, &g3, &b3, &b3, &g3, EPS, true).is_ok());
}

/// The CUDA kernels against the CPU implementation (itself checked against the reference above):
/// every dtype, ReLU on and off, shapes from one element per channel to full CIFAR layers, covering
/// the reduction kernels' three ways of visiting a channel (planes under a warp wide, at least a
/// warp wide, at least a block wide) and channels split over several blocks, evenly or not.
/// Skips, saying so, when no CUDA device is present.
#[cfg(feature = "cuda")]
#[test]
fn cuda_matches_cpu() {
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping cuda_matches_cpu: no CUDA device ({e})");
            return;
        }
    };
    let shapes = [
        (1, 3, 1, 1),
        (8, 3, 1, 1),
        (5, 16, 7, 9),
        (2, 1, 33, 31),
        (2048, 2, 4, 4),
        (301, 2, 16, 16),
        (128, 32, 32, 32),
        (128, 128, 8, 8),
    ];
    for (dtype, tol) in [
        (DType::F32, 1e-5f32),
        (DType::F16, 2e-3),
        (DType::BF16, 1.6e-2),
    ] {
        for (i, &(n, c, h, w)) in shapes.iter().enumerate() {
            for relu in [false, true] {
                let mut cs = case(n, c, h, w, 300 + i as u64);
                cs.x = cs.x.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
                cs.r = cs.r.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
                let cpu = run_on(&cs, dtype, relu, true, &Device::Cpu);
                let gpu = run_on(&cs, dtype, relu, true, &dev);
                let what = format!("{dtype:?} {:?} relu {relu}", (n, c, h, w));
                assert_eq!(gpu.y.dtype(), dtype, "{what}");
                assert_eq!(
                    (gpu.ggamma.dtype(), gpu.mean.dtype()),
                    (DType::F32, DType::F32),
                    "{what}"
                );
                assert!(!gpu.mean.track_op() && !gpu.var.track_op(), "{what}");
                for (name, a, b, t) in [
                    ("y", &gpu.y, &cpu.y, tol),
                    ("grad x", &gpu.gx, &cpu.gx, tol),
                    ("grad gamma", &gpu.ggamma, &cpu.ggamma, 1e-4),
                    ("grad beta", &gpu.gbeta, &cpu.gbeta, 1e-4),
                    ("mean", &gpu.mean, &cpu.mean, 1e-5),
                    ("var", &gpu.var, &cpu.var, 1e-5),
                ] {
                    let e = rel_err(&a.to_device(&Device::Cpu).unwrap(), b);
                    assert!(e <= t, "{what}: {name} rel err {e:e} > {t:e}");
                }
            }
        }
        // Eval on the GPU against the CPU.
        let cs = case(4, 16, 5, 5, 7);
        let x = cs.x.to_dtype(dtype).unwrap();
        let rm = cs.beta.clone();
        let rv = (cs.gamma.clone() + 0.5).unwrap();
        let cpu = batch_norm_eval(&x, &cs.gamma, &cs.beta, &rm, &rv, EPS, true).unwrap();
        let to = |t: &Tensor| t.to_device(&dev).unwrap();
        let gpu = batch_norm_eval(
            &to(&x),
            &to(&cs.gamma),
            &to(&cs.beta),
            &to(&rm),
            &to(&rv),
            EPS,
            true,
        )
        .unwrap();
        let e = rel_err(&gpu.to_device(&Device::Cpu).unwrap(), &cpu);
        assert!(e <= tol, "{dtype:?} eval rel err {e:e}");
    }
}
