//! bf16 convolution (forward, input gradient, weight gradient) on the AVX-512 bf16 kernels against
//! the widen-to-f32 fallback.
//!
//! The fallback computes a bf16 convolution as the f32 convolution of the widened inputs, rounded
//! to bf16 once. So the reference here is the f32 op on the same (bf16-valued) inputs, and:
//! - on a CPU without the kernel, the bf16 op must equal it rounded to bf16, bit for bit;
//! - with the kernel, the two f32 sums differ only in summation order: at most `2·K·u·S` apart
//!   (`u = 2⁻²⁴`, `K` the terms per output, `S = Σ|a||b|`, computed as the same convolution of
//!   |x| and |w|; see tests/gemm_bf16.rs), and rounding to bf16 adds at most half a bf16 ulp,
//!   `2⁻⁸·|y|`, on each side.

use candle_core::{DType, Device, Tensor};
use memtrain_kernels::conv2d::{conv2d, conv2d_backward_input, conv2d_backward_weight};
use memtrain_kernels::gemm_bf16::{bf16_kernel, Bf16Kernel};

const U: f32 = 1.0 / (1u32 << 24) as f32;
const BF16_HALF_ULP: f32 = 1.0 / 256.0;

/// Deterministic values in [-2, 2) as a bf16 tensor of `dims`.
fn tensor(dims: &[usize], seed: u64) -> Tensor {
    let len: usize = dims.iter().product();
    let mut s = seed;
    let v: Vec<f32> = (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u32 << 24) as f32) * 4.0 - 2.0
        })
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `got` (bf16 op) against `reference` (f32 op on the same inputs) with `abs_sum` (the op on
/// |inputs|) and `terms` products per output.
fn compare(what: &str, got: &Tensor, reference: &Tensor, abs_sum: &Tensor, terms: usize) {
    assert_eq!(got.dtype(), DType::BF16, "{what}");
    assert_eq!(got.dims(), reference.dims(), "{what}");
    let (g, r, s) = (f32s(got), f32s(reference), f32s(abs_sum));
    if bf16_kernel() == Bf16Kernel::Widen {
        let rounded = f32s(&reference.to_dtype(DType::BF16).unwrap());
        assert_eq!(
            g, rounded,
            "{what}: the fallback is the f32 op rounded to bf16"
        );
        return;
    }
    for (i, ((&g, &r), &s)) in g.iter().zip(&r).zip(&s).enumerate() {
        let tol = 2.0 * terms as f32 * U * s * (1.0 + BF16_HALF_ULP) + BF16_HALF_ULP * r.abs();
        assert!(
            (g - r).abs() <= tol,
            "{what}[{i}]: bf16 kernel {g}, f32 reference {r}, tolerance {tol}"
        );
    }
}

/// Forward and both gradients of one convolution case.
fn check(
    n: usize,
    cin: usize,
    hw: (usize, usize),
    cout: usize,
    k: usize,
    stride: usize,
    pad: usize,
) {
    let what = format!("n{n} cin{cin} {hw:?} cout{cout} k{k} s{stride} p{pad}");
    let seed = (n * 131 + cin * 17 + cout * 7 + k) as u64;
    let x = tensor(&[n, cin, hw.0, hw.1], seed);
    let w = tensor(&[cout, cin, k, k], seed + 1);
    let (xf, wf) = (
        x.to_dtype(DType::F32).unwrap(),
        w.to_dtype(DType::F32).unwrap(),
    );
    let (xa, wa) = (xf.abs().unwrap(), wf.abs().unwrap());

    let y = conv2d(&x, &w, stride, pad).unwrap();
    let yf = conv2d(&xf, &wf, stride, pad).unwrap();
    let ya = conv2d(&xa, &wa, stride, pad).unwrap();
    compare(&format!("{what} forward"), &y, &yf, &ya, cin * k * k);

    let (ho, wo) = (y.dims()[2], y.dims()[3]);
    let g = tensor(&[n, cout, ho, wo], seed + 2);
    let gf = g.to_dtype(DType::F32).unwrap();
    let ga = gf.abs().unwrap();

    let dx = conv2d_backward_input(&g, &w, x.dims(), stride, pad).unwrap();
    let dxf = conv2d_backward_input(&gf, &wf, x.dims(), stride, pad).unwrap();
    let dxa = conv2d_backward_input(&ga, &wa, x.dims(), stride, pad).unwrap();
    compare(
        &format!("{what} input gradient"),
        &dx,
        &dxf,
        &dxa,
        cout * k * k,
    );

    let dw = conv2d_backward_weight(&x, &g, w.dims(), stride, pad).unwrap();
    let dwf = conv2d_backward_weight(&xf, &gf, w.dims(), stride, pad).unwrap();
    let dwa = conv2d_backward_weight(&xa, &ga, w.dims(), stride, pad).unwrap();
    compare(
        &format!("{what} weight gradient"),
        &dw,
        &dwf,
        &dwa,
        n * ho * wo,
    );
}

#[test]
fn bf16_conv_matches_the_widening_fallback() {
    if bf16_kernel() != Bf16Kernel::Widen {
        eprintln!(
            "conv2d_bf16: testing the {:?} kernel against the f32 op",
            bf16_kernel()
        );
    } else {
        eprintln!(
            "conv2d_bf16: widening fallback (no AVX-512 kernel here); checking it bit for bit"
        );
    }
    // Odd channels and sizes, padding on both sides.
    check(3, 5, (7, 9), 6, 3, 1, 1);
    // Strided, Cout past one 32-column panel.
    check(2, 3, (8, 8), 33, 3, 2, 1);
    // No padding, 5×5 kernel, odd K = 2·25.
    check(2, 2, (9, 7), 4, 5, 1, 0);
    // Pointwise: the image is the column matrix.
    check(4, 17, (5, 5), 9, 1, 1, 0);
    // Pointwise on 32×32 maps: rows of 2 KiB get padded in the weight gradient.
    check(2, 4, (32, 32), 8, 1, 1, 0);
    // 8×8 outputs: the weight gradient gathers 3 images per gemm (6 images, 2 threads).
    check(6, 8, (8, 8), 16, 3, 1, 1);
    // A layer of the default net (32 → 64 at 16×16).
    check(2, 32, (16, 16), 64, 3, 1, 1);
}
