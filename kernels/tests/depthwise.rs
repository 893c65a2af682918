//! The depthwise op against Candle's grouped convolution (forward and both gradients), its half
//! precision variants against its `f32` results, its error cases, and (with `--features cuda`,
//! `--ignored`) its CUDA kernels against its CPU kernels.

use candle_core::{DType, Device, Tensor, Var};
use memtrain_kernels::depthwise::depthwise_conv2d;

mod common;
use common::rel_err;

/// A small deterministic generator (xorshift64*), so failures reproduce exactly.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform in [-1, 1).
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40; // 24 random bits
        bits as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn tensor(&mut self, dims: &[usize]) -> Tensor {
        let n = dims.iter().product();
        let data: Vec<f32> = (0..n).map(|_| self.next()).collect();
        Tensor::from_vec(data, dims, &Device::Cpu).unwrap()
    }
}

/// Forward output and the gradients of `sum(y * r)` w.r.t. x and w.
struct Run {
    y: Tensor,
    dx: Tensor,
    dw: Tensor,
}

/// Runs `conv(x, w)` on fresh variables and backpropagates `sum(y * r)`.
fn run_with(
    x: &Tensor,
    w: &Tensor,
    r: &Tensor,
    conv: impl Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
) -> Run {
    let xv = Var::from_tensor(x).unwrap();
    let wv = Var::from_tensor(w).unwrap();
    let y = conv(xv.as_tensor(), wv.as_tensor()).unwrap();
    let loss = (&y * r.to_dtype(y.dtype()).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    Run {
        dx: grads
            .get(xv.as_tensor())
            .expect("no gradient for x")
            .clone(),
        dw: grads
            .get(wv.as_tensor())
            .expect("no gradient for w")
            .clone(),
        y,
    }
}

fn ours(x: &Tensor, w: &Tensor, r: &Tensor, stride: usize, pad: usize) -> Run {
    run_with(x, w, r, |x, w| depthwise_conv2d(x, w, stride, pad))
}

fn candle_grouped(x: &Tensor, w: &Tensor, r: &Tensor, stride: usize, pad: usize) -> Run {
    let groups = x.dim(1).unwrap();
    run_with(x, w, r, |x, w| x.conv2d(w, pad, stride, 1, groups))
}

fn out_size(i: usize, k: usize, s: usize, p: usize) -> usize {
    (i + 2 * p - k) / s + 1
}

/// (N, C, H, W, K, stride, padding)
const CASES: &[(usize, usize, usize, usize, usize, usize, usize)] = &[
    (1, 1, 5, 5, 3, 1, 0),
    (1, 1, 5, 5, 3, 2, 1),
    (2, 3, 7, 9, 3, 1, 1),
    (2, 3, 9, 7, 3, 2, 0),
    (3, 8, 8, 8, 3, 2, 1),
    (1, 13, 17, 11, 3, 2, 0),
    (2, 13, 6, 17, 3, 1, 1),
    (3, 8, 16, 16, 3, 1, 1),
    (2, 3, 10, 9, 1, 1, 0),
    (1, 8, 11, 13, 5, 2, 1),
    // Large enough that the CPU kernels split the planes over threads.
    (3, 13, 32, 32, 3, 1, 1),
    (2, 8, 33, 31, 3, 2, 1),
];

#[test]
fn matches_candle_grouped_conv_f32() {
    let mut worst = [0f32; 3];
    for (i, &(n, c, h, w, k, s, p)) in CASES.iter().enumerate() {
        let mut rng = Rng::new(i as u64 + 1);
        let x = rng.tensor(&[n, c, h, w]);
        let wt = rng.tensor(&[c, 1, k, k]);
        let r = rng.tensor(&[n, c, out_size(h, k, s, p), out_size(w, k, s, p)]);
        let got = ours(&x, &wt, &r, s, p);
        let want = candle_grouped(&x, &wt, &r, s, p);
        let case = format!("N={n} C={c} H={h} W={w} K={k} stride={s} pad={p}");
        assert_eq!(got.y.dims(), want.y.dims(), "{case}: output shape");
        assert_eq!(got.y.dtype(), DType::F32);
        let (ey, edx, edw) = (
            rel_err(&got.y, &want.y),
            rel_err(&got.dx, &want.dx),
            rel_err(&got.dw, &want.dw),
        );
        assert!(ey < 1e-5, "{case}: forward relative error {ey}");
        assert!(edx < 1e-5, "{case}: input-gradient relative error {edx}");
        assert!(edw < 1e-5, "{case}: weight-gradient relative error {edw}");
        worst = [worst[0].max(ey), worst[1].max(edx), worst[2].max(edw)];
    }
    eprintln!(
        "f32 vs candle grouped conv, worst relative errors: y {:.1e}, dx {:.1e}, dw {:.1e}",
        worst[0], worst[1], worst[2]
    );
}

#[test]
fn non_contiguous_inputs() {
    let mut rng = Rng::new(99);
    let (n, c, h, w) = (2, 5, 9, 12);
    // x is a transposed view of a [N, C, W, H] tensor, w a narrowed view of a wider one.
    let xt = rng.tensor(&[n, c, w, h]);
    let wide = rng.tensor(&[c, 1, 3, 5]);
    let r = rng.tensor(&[n, c, h, w]);
    let xv = Var::from_tensor(&xt).unwrap();
    let wv = Var::from_tensor(&wide).unwrap();
    let x_view = xv.as_tensor().transpose(2, 3).unwrap();
    let w_view = wv.as_tensor().narrow(3, 1, 3).unwrap();
    assert!(!x_view.is_contiguous() && !w_view.is_contiguous());
    let y = depthwise_conv2d(&x_view, &w_view, 1, 1).unwrap();
    let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();

    let want = candle_grouped(
        &x_view.contiguous().unwrap(),
        &w_view.contiguous().unwrap(),
        &r,
        1,
        1,
    );
    assert!(rel_err(&y, &want.y) < 1e-5);
    let dxt = grads.get(xv.as_tensor()).unwrap();
    let dwide = grads.get(wv.as_tensor()).unwrap();
    // Gradients flow back through the views to the original layouts.
    assert_eq!(dxt.dims(), &[n, c, w, h]);
    assert!(rel_err(&dxt.transpose(2, 3).unwrap(), &want.dx) < 1e-5);
    assert!(rel_err(&dwide.narrow(3, 1, 3).unwrap(), &want.dw) < 1e-5);
    let outside = dwide
        .narrow(3, 0, 1)
        .unwrap()
        .abs()
        .unwrap()
        .sum_all()
        .unwrap();
    assert_eq!(outside.to_scalar::<f32>().unwrap(), 0.0);
}

#[test]
fn gradient_only_for_what_is_tracked() {
    let mut rng = Rng::new(7);
    let x = rng.tensor(&[2, 4, 8, 8]); // plain data: no gradient wanted
    let wv = Var::from_tensor(&rng.tensor(&[4, 1, 3, 3])).unwrap();
    let y = depthwise_conv2d(&x, wv.as_tensor(), 1, 1).unwrap();
    let grads = y.sum_all().unwrap().backward().unwrap();
    assert!(grads.get(&x).is_none());
    let ones = Tensor::ones(y.dims(), DType::F32, &Device::Cpu).unwrap();
    let want = candle_grouped(&x, wv.as_tensor(), &ones, 1, 1);
    assert!(rel_err(grads.get(wv.as_tensor()).unwrap(), &want.dw) < 1e-5);
}

/// Half-precision results against the f32 op on the same (rounded) inputs.
fn check_half(dtype: DType, tol: f32) {
    let mut worst = [0f32; 3];
    for (i, &(n, c, h, w, k, s, p)) in CASES.iter().enumerate() {
        let mut rng = Rng::new(1000 + i as u64);
        let x = rng.tensor(&[n, c, h, w]).to_dtype(dtype).unwrap();
        let wt = rng.tensor(&[c, 1, k, k]).to_dtype(dtype).unwrap();
        let r = rng
            .tensor(&[n, c, out_size(h, k, s, p), out_size(w, k, s, p)])
            .to_dtype(dtype)
            .unwrap();
        let got = ours(&x, &wt, &r, s, p);
        assert_eq!(got.y.dtype(), dtype);
        assert_eq!(got.dx.dtype(), dtype);
        assert_eq!(got.dw.dtype(), dtype);
        let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let want = ours(&f(&x), &f(&wt), &f(&r), s, p);
        let case = format!("{dtype:?} N={n} C={c} H={h} W={w} K={k} stride={s} pad={p}");
        let (ey, edx, edw) = (
            rel_err(&got.y, &want.y),
            rel_err(&got.dx, &want.dx),
            rel_err(&got.dw, &want.dw),
        );
        assert!(ey < tol, "{case}: forward relative error {ey}");
        assert!(edx < tol, "{case}: input-gradient relative error {edx}");
        assert!(edw < tol, "{case}: weight-gradient relative error {edw}");
        worst = [worst[0].max(ey), worst[1].max(edx), worst[2].max(edw)];
    }
    eprintln!(
        "{dtype:?} vs f32, worst relative errors: y {:.1e}, dx {:.1e}, dw {:.1e}",
        worst[0], worst[1], worst[2]
    );
}

#[test]
fn f16_matches_f32() {
    check_half(DType::F16, 1e-2);
}

#[test]
fn bf16_matches_f32() {
    check_half(DType::BF16, 3e-2);
}

#[test]
fn invalid_arguments_are_errors() {
    let dev = Device::Cpu;
    let z = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &dev).unwrap();
    let x = z(&[2, 4, 8, 8]);
    let w = z(&[4, 1, 3, 3]);
    let cases: Vec<(&str, Tensor, Tensor, usize, usize, &str)> = vec![
        ("3D input", z(&[4, 8, 8]), w.clone(), 1, 1, "[N, C, H, W]"),
        ("3D weight", x.clone(), z(&[4, 3, 3]), 1, 1, "[C, 1, K, K]"),
        (
            "channel mismatch",
            x.clone(),
            z(&[5, 1, 3, 3]),
            1,
            1,
            "5 filters",
        ),
        (
            "not depthwise",
            x.clone(),
            z(&[4, 2, 3, 3]),
            1,
            1,
            "one input channel",
        ),
        (
            "non-square kernel",
            x.clone(),
            z(&[4, 1, 3, 5]),
            1,
            1,
            "square",
        ),
        (
            "kernel too large",
            z(&[1, 4, 2, 8]),
            w.clone(),
            1,
            0,
            "larger than the padded input",
        ),
        ("zero stride", x.clone(), w.clone(), 0, 1, "stride"),
        (
            "empty batch",
            z(&[0, 4, 8, 8]),
            w.clone(),
            1,
            1,
            "zero-sized",
        ),
        (
            "zero kernel",
            x.clone(),
            z(&[4, 1, 0, 0]),
            1,
            1,
            "at least 1",
        ),
        (
            "dtype mismatch",
            x.clone(),
            w.to_dtype(DType::F16).unwrap(),
            1,
            1,
            "dtype",
        ),
        (
            "unsupported dtype",
            x.to_dtype(DType::F64).unwrap(),
            w.to_dtype(DType::F64).unwrap(),
            1,
            1,
            "unsupported dtype",
        ),
    ];
    for (name, x, w, s, p, needle) in cases {
        match depthwise_conv2d(&x, &w, s, p) {
            Ok(y) => panic!(
                "{name}: expected an error, got a tensor of shape {:?}",
                y.dims()
            ),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(needle),
                    "{name}: message {msg:?} does not mention {needle:?}"
                );
                assert!(
                    msg.contains("depthwise_conv2d"),
                    "{name}: message {msg:?} names no op"
                );
            }
        }
    }
}

#[test]
fn kernel_exactly_as_large_as_padded_input() {
    // The boundary of the size check: a 3x3 kernel on a 1x1 input with padding 1 is valid.
    let mut rng = Rng::new(5);
    let x = rng.tensor(&[2, 3, 1, 1]);
    let w = rng.tensor(&[3, 1, 3, 3]);
    let r = rng.tensor(&[2, 3, 1, 1]);
    let got = ours(&x, &w, &r, 1, 1);
    let want = candle_grouped(&x, &w, &r, 1, 1);
    assert!(rel_err(&got.y, &want.y) < 1e-5);
    assert!(rel_err(&got.dx, &want.dx) < 1e-5);
    assert!(rel_err(&got.dw, &want.dw) < 1e-5);
}

/// The CUDA kernels against the CPU kernels, every dtype, forward and both gradients.
/// Needs a GPU: `cargo test --release --features cuda --test depthwise -- --ignored`.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_matches_cpu() {
    let gpu = Device::new_cuda(0).expect("no CUDA device 0");
    for (dtype, tol) in [
        (DType::F32, 1e-5f32),
        (DType::F16, 1e-2),
        (DType::BF16, 3e-2),
    ] {
        let mut worst = [0f32; 3];
        for (i, &(n, c, h, w, k, s, p)) in CASES.iter().enumerate() {
            let mut rng = Rng::new(2000 + i as u64);
            let x = rng.tensor(&[n, c, h, w]).to_dtype(dtype).unwrap();
            let wt = rng.tensor(&[c, 1, k, k]).to_dtype(dtype).unwrap();
            let r = rng
                .tensor(&[n, c, out_size(h, k, s, p), out_size(w, k, s, p)])
                .to_dtype(dtype)
                .unwrap();
            let cpu = ours(&x, &wt, &r, s, p);
            let to_gpu = |t: &Tensor| t.to_device(&gpu).unwrap();
            let cuda = ours(&to_gpu(&x), &to_gpu(&wt), &to_gpu(&r), s, p);
            assert!(cuda.y.device().is_cuda());
            let to_cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
            let case = format!("{dtype:?} N={n} C={c} H={h} W={w} K={k} stride={s} pad={p}");
            let ey = rel_err(&to_cpu(&cuda.y), &cpu.y);
            let edx = rel_err(&to_cpu(&cuda.dx), &cpu.dx);
            let edw = rel_err(&to_cpu(&cuda.dw), &cpu.dw);
            assert!(ey < tol, "{case}: forward relative error {ey}");
            assert!(edx < tol, "{case}: input-gradient relative error {edx}");
            assert!(edw < tol, "{case}: weight-gradient relative error {edw}");
            worst = [worst[0].max(ey), worst[1].max(edx), worst[2].max(edw)];
        }
        eprintln!(
            "CUDA vs CPU {dtype:?}, worst relative errors: y {:.1e}, dx {:.1e}, dw {:.1e}",
            worst[0], worst[1], worst[2]
        );
    }
}
