//! The gemm conv2d op against Candle's conv2d: forward and both gradients, over strides, paddings,
//! kernel sizes, odd channel counts, batch sizes that are not multiples of the chunk, non-contiguous
//! inputs and half precision; bit-for-bit reproducibility of the gradients, the input gradient
//! being skipped for untracked inputs; and the argument errors.

use candle_core::{DType, Device, Tensor, Var};
use memtrain_kernels::conv2d::{conv2d, conv2d_with_chunk, im2col_chunk_bytes, IM2COL_CHUNK_BYTES};

mod common;
use common::{bits, rel_err};

/// One convolution to check.
#[derive(Clone, Copy, Debug)]
struct Shape {
    n: usize,
    cin: usize,
    cout: usize,
    h: usize,
    w: usize,
    k: usize,
    stride: usize,
    pad: usize,
}

// One positional argument per field keeps the SHAPES table one readable line per case.
#[allow(clippy::too_many_arguments)]
const fn s(
    n: usize,
    cin: usize,
    cout: usize,
    h: usize,
    w: usize,
    k: usize,
    stride: usize,
    pad: usize,
) -> Shape {
    Shape {
        n,
        cin,
        cout,
        h,
        w,
        k,
        stride,
        pad,
    }
}

/// Stride 1 and 2, padding 0 and 1, kernels 1 and 3, channels that are not multiples of 8, non-square
/// maps, N from 1 to 9; the last three have maps of 512 and 1024 pixels (and 64 pixels, 8 of which
/// are chunked to 512), whose column rows the op pads against cache-set aliasing.
const SHAPES: [Shape; 13] = [
    s(1, 3, 5, 7, 7, 3, 1, 1),
    s(2, 5, 13, 9, 8, 3, 2, 1),
    s(3, 13, 5, 6, 6, 1, 1, 0),
    s(4, 5, 7, 8, 8, 3, 1, 0),
    s(5, 3, 13, 10, 9, 1, 2, 0),
    s(5, 13, 13, 5, 7, 3, 2, 0),
    s(2, 4, 6, 5, 5, 1, 1, 1),
    s(3, 7, 3, 9, 9, 3, 1, 1),
    s(1, 1, 1, 3, 3, 3, 1, 0),
    s(5, 6, 9, 4, 4, 3, 2, 1),
    s(2, 3, 4, 32, 32, 3, 1, 1),
    s(3, 5, 6, 16, 32, 1, 1, 0),
    s(9, 3, 4, 8, 8, 3, 1, 1),
];

/// Output, input gradient and weight gradient of `conv` for the loss `Σ conv(x, w) · g`.
fn run(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    conv: impl Fn(&Tensor, &Tensor) -> anyhow::Result<Tensor>,
) -> anyhow::Result<(Tensor, Tensor, Tensor)> {
    let xv = Var::from_tensor(x)?;
    let wv = Var::from_tensor(w)?;
    let y = conv(xv.as_tensor(), wv.as_tensor())?;
    let grads = (&y * g)?.sum_all()?.backward()?;
    let gx = grads.get(xv.as_tensor()).expect("input gradient").clone();
    let gw = grads.get(wv.as_tensor()).expect("weight gradient").clone();
    Ok((y, gx, gw))
}

fn random_case(sh: Shape, dev: &Device) -> anyhow::Result<(Tensor, Tensor, Tensor)> {
    let x = Tensor::randn(0f32, 1.0, (sh.n, sh.cin, sh.h, sh.w), dev)?;
    let w = Tensor::randn(0f32, 1.0, (sh.cout, sh.cin, sh.k, sh.k), dev)?;
    let ho = (sh.h + 2 * sh.pad - sh.k) / sh.stride + 1;
    let wo = (sh.w + 2 * sh.pad - sh.k) / sh.stride + 1;
    let g = Tensor::randn(0f32, 1.0, (sh.n, sh.cout, ho, wo), dev)?;
    Ok((x, w, g))
}

/// Candle 0.11's conv2d backward derives the input gradient's output padding from the height
/// alone and applies it to the width too, so it fails ("shape mismatch in add") on non-square
/// inputs whose two paddings differ. Those shapes are checked against [`naive`] only.
fn candle_can_backprop(sh: Shape) -> bool {
    let pad_of = |len: usize| {
        let out = (len + 2 * sh.pad - sh.k) / sh.stride + 1;
        len + 2 * sh.pad - ((out - 1) * sh.stride + sh.k)
    };
    pad_of(sh.h) == pad_of(sh.w)
}

/// Direct-loop reference in f64: output, input gradient and weight gradient of `Σ conv(x, w) · g`.
fn naive(
    sh: Shape,
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
) -> anyhow::Result<(Tensor, Tensor, Tensor)> {
    let v = |t: &Tensor| -> anyhow::Result<Vec<f64>> {
        Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
    };
    let (xv, wv, gv) = (v(x)?, v(w)?, v(g)?);
    let ho = (sh.h + 2 * sh.pad - sh.k) / sh.stride + 1;
    let wo = (sh.w + 2 * sh.pad - sh.k) / sh.stride + 1;
    let mut y = vec![0f64; sh.n * sh.cout * ho * wo];
    let mut gx = vec![0f64; xv.len()];
    let mut gw = vec![0f64; wv.len()];
    for n in 0..sh.n {
        for co in 0..sh.cout {
            for oh in 0..ho {
                for ow in 0..wo {
                    let yi = ((n * sh.cout + co) * ho + oh) * wo + ow;
                    for ci in 0..sh.cin {
                        for kh in 0..sh.k {
                            for kw in 0..sh.k {
                                let ih = (oh * sh.stride + kh) as isize - sh.pad as isize;
                                let iw = (ow * sh.stride + kw) as isize - sh.pad as isize;
                                if ih < 0 || iw < 0 || ih >= sh.h as isize || iw >= sh.w as isize {
                                    continue;
                                }
                                let xi =
                                    ((n * sh.cin + ci) * sh.h + ih as usize) * sh.w + iw as usize;
                                let wi = ((co * sh.cin + ci) * sh.k + kh) * sh.k + kw;
                                y[yi] += xv[xi] * wv[wi];
                                gx[xi] += gv[yi] * wv[wi];
                                gw[wi] += gv[yi] * xv[xi];
                            }
                        }
                    }
                }
            }
        }
    }
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(y, (sh.n, sh.cout, ho, wo), &dev)?,
        Tensor::from_vec(gx, x.dims(), &dev)?,
        Tensor::from_vec(gw, w.dims(), &dev)?,
    ))
}

fn candle_conv(sh: Shape) -> impl Fn(&Tensor, &Tensor) -> anyhow::Result<Tensor> {
    move |x, w| Ok(x.conv2d(w, sh.pad, sh.stride, 1, 1)?)
}

fn assert_close(what: &str, sh: Shape, ours: &Tensor, reference: &Tensor, tol: f32) {
    assert_eq!(ours.dims(), reference.dims(), "{what} shape for {sh:?}");
    let e = rel_err(ours, reference);
    assert!(
        e <= tol,
        "{what} for {sh:?}: relative error {e:e} > {tol:e}"
    );
}

/// Candle's conv2d and gradients where Candle can differentiate the shape, the naive reference
/// where it cannot.
fn reference(
    sh: Shape,
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
) -> anyhow::Result<(Tensor, Tensor, Tensor)> {
    if candle_can_backprop(sh) {
        run(x, w, g, candle_conv(sh))
    } else {
        naive(sh, x, w, g)
    }
}

#[test]
fn matches_candle_forward_and_gradients() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for sh in SHAPES.into_iter().filter(|&sh| candle_can_backprop(sh)) {
        let (x, w, g) = random_case(sh, &dev)?;
        let (ry, rgx, rgw) = run(&x, &w, &g, candle_conv(sh))?;
        let (y, gx, gw) = run(&x, &w, &g, |x, w| Ok(conv2d(x, w, sh.stride, sh.pad)?))?;
        assert_close("output", sh, &y, &ry, 1e-5);
        assert_close("input gradient", sh, &gx, &rgx, 1e-5);
        assert_close("weight gradient", sh, &gw, &rgw, 1e-5);
    }
    Ok(())
}

#[test]
fn matches_direct_loops_on_every_shape() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for sh in SHAPES {
        let (x, w, g) = random_case(sh, &dev)?;
        let (ry, rgx, rgw) = naive(sh, &x, &w, &g)?;
        let (y, gx, gw) = run(&x, &w, &g, |x, w| Ok(conv2d(x, w, sh.stride, sh.pad)?))?;
        assert_close("output", sh, &y, &ry, 1e-5);
        assert_close("input gradient", sh, &gx, &rgx, 1e-5);
        assert_close("weight gradient", sh, &gw, &rgw, 1e-5);
    }
    Ok(())
}

#[test]
fn chunk_sizes_that_do_not_divide_the_batch() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for sh in SHAPES.into_iter().filter(|sh| sh.n >= 3) {
        let (x, w, g) = random_case(sh, &dev)?;
        let (ry, rgx, rgw) = reference(sh, &x, &w, &g)?;
        for chunk in [1, 2, 4, 8, 64] {
            let (y, gx, gw) = run(&x, &w, &g, |x, w| {
                Ok(conv2d_with_chunk(x, w, sh.stride, sh.pad, chunk)?)
            })?;
            assert_close(&format!("output (chunk {chunk})"), sh, &y, &ry, 1e-5);
            assert_close(
                &format!("input gradient (chunk {chunk})"),
                sh,
                &gx,
                &rgx,
                1e-5,
            );
            assert_close(
                &format!("weight gradient (chunk {chunk})"),
                sh,
                &gw,
                &rgw,
                1e-5,
            );
        }
    }
    Ok(())
}

#[test]
fn non_contiguous_inputs() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let sh = s(3, 5, 7, 7, 9, 3, 2, 1);
    // Stored as [N, Cin, W, H] and [Cout, Cin, K, K]ᵀ, viewed as [N, Cin, H, W] through transposes,
    // and the batch narrowed so that the data does not start at offset 0.
    let xt = Tensor::randn(0f32, 1.0, (sh.n + 1, sh.cin, sh.w, sh.h), &dev)?;
    let x = xt.transpose(2, 3)?.narrow(0, 1, sh.n)?;
    let wt = Tensor::randn(0f32, 1.0, (sh.cout, sh.cin, sh.k, sh.k), &dev)?;
    let w = wt.transpose(2, 3)?;
    assert!(!x.is_contiguous() && !w.is_contiguous());
    let g = Tensor::randn(0f32, 1.0, (sh.n, sh.cout, 4, 5), &dev)?;
    let (ry, rgx, rgw) = reference(sh, &x, &w, &g)?;
    let y = conv2d(&x, &w, sh.stride, sh.pad)?;
    assert_close("output", sh, &y, &ry, 1e-5);
    // Contiguous, but starting past the first image of its storage.
    let x_offset = Tensor::cat(&[&x.narrow(0, 0, 1)?, &x], 0)?.narrow(0, 1, sh.n)?;
    assert!(x_offset.is_contiguous());
    let y = conv2d(&x_offset, &w, sh.stride, sh.pad)?;
    assert_close("output (offset input)", sh, &y, &ry, 1e-5);
    // Through `Var`s (which copy), the gradients are checked on the same values.
    let (_, gx, gw) = run(&x, &w, &g, |x, w| Ok(conv2d(x, w, sh.stride, sh.pad)?))?;
    assert_close("input gradient", sh, &gx, &rgx, 1e-5);
    assert_close("weight gradient", sh, &gw, &rgw, 1e-5);
    Ok(())
}

#[test]
fn broadcast_upstream_gradient() -> anyhow::Result<()> {
    // `sum_all` hands the op a stride-0 broadcast of ones as its output gradient.
    let dev = Device::Cpu;
    let sh = s(2, 3, 4, 5, 5, 3, 1, 1);
    let (x, w, _) = random_case(sh, &dev)?;
    let grads_of =
        |conv: &dyn Fn(&Tensor, &Tensor) -> anyhow::Result<Tensor>| -> anyhow::Result<_> {
            let xv = Var::from_tensor(&x)?;
            let wv = Var::from_tensor(&w)?;
            let grads = conv(xv.as_tensor(), wv.as_tensor())?
                .sum_all()?
                .backward()?;
            Ok((
                grads.get(xv.as_tensor()).unwrap().clone(),
                grads.get(wv.as_tensor()).unwrap().clone(),
            ))
        };
    let (rgx, rgw) = grads_of(&candle_conv(sh))?;
    let (gx, gw) = grads_of(&|x, w| Ok(conv2d(x, w, sh.stride, sh.pad)?))?;
    assert_close("input gradient", sh, &gx, &rgx, 1e-5);
    assert_close("weight gradient", sh, &gw, &rgw, 1e-5);
    Ok(())
}

#[test]
fn half_precision_matches_f32_on_the_same_values() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    // The op multiplies half inputs in f32, so on inputs already rounded to the half type the only
    // difference from the f32 op is the final rounding of each output element: about 2⁻¹¹ (f16) and
    // 2⁻⁸ (bf16) of an element, less relative to the largest.
    for (dtype, tol) in [(DType::F16, 1e-3), (DType::BF16, 8e-3)] {
        for sh in SHAPES {
            let (x, w, g) = random_case(sh, &dev)?;
            let (xh, wh, gh) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?, g.to_dtype(dtype)?);
            let up = |t: &Tensor| t.to_dtype(DType::F32);
            let conv = |x: &Tensor, w: &Tensor| Ok(conv2d_with_chunk(x, w, sh.stride, sh.pad, 2)?);
            let (ry, rgx, rgw) = run(&up(&xh)?, &up(&wh)?, &up(&gh)?, conv)?;
            let (y, gx, gw) = run(&xh, &wh, &gh, conv)?;
            assert_eq!(y.dtype(), dtype);
            assert_eq!(gx.dtype(), dtype);
            assert_eq!(gw.dtype(), dtype);
            assert_close(&format!("{dtype:?} output"), sh, &y, &ry, tol);
            assert_close(&format!("{dtype:?} input gradient"), sh, &gx, &rgx, tol);
            assert_close(&format!("{dtype:?} weight gradient"), sh, &gw, &rgw, tol);
        }
    }
    Ok(())
}

#[test]
fn f64_matches_candle() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let sh = s(3, 5, 6, 7, 7, 3, 2, 1);
    let (x, w, g) = random_case(sh, &dev)?;
    let (x, w, g) = (
        x.to_dtype(DType::F64)?,
        w.to_dtype(DType::F64)?,
        g.to_dtype(DType::F64)?,
    );
    let (ry, rgx, rgw) = run(&x, &w, &g, candle_conv(sh))?;
    let (y, gx, gw) = run(&x, &w, &g, |x, w| Ok(conv2d(x, w, sh.stride, sh.pad)?))?;
    assert_eq!(y.dtype(), DType::F64);
    assert_close("output", sh, &y, &ry, 1e-10);
    assert_close("input gradient", sh, &gx, &rgx, 1e-10);
    assert_close("weight gradient", sh, &gw, &rgw, 1e-10);
    Ok(())
}

#[test]
fn stacked_layers_backpropagate_through_each_other() -> anyhow::Result<()> {
    // Two convolutions with a ReLU between them, as in the net: the first one's input gradient
    // comes from the second one's backward.
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (3, 3, 8, 8), &dev)?;
    let w1 = Tensor::randn(0f32, 0.3, (6, 3, 3, 3), &dev)?;
    let w2 = Tensor::randn(0f32, 0.3, (5, 6, 3, 3), &dev)?;
    let grads_of = |ours: bool| -> anyhow::Result<Vec<Tensor>> {
        let (xv, w1v, w2v) = (
            Var::from_tensor(&x)?,
            Var::from_tensor(&w1)?,
            Var::from_tensor(&w2)?,
        );
        let conv = |x: &Tensor, w: &Tensor, stride| -> anyhow::Result<Tensor> {
            Ok(if ours {
                conv2d(x, w, stride, 1)?
            } else {
                x.conv2d(w, 1, stride, 1, 1)?
            })
        };
        let h = conv(xv.as_tensor(), w1v.as_tensor(), 1)?.relu()?;
        let y = conv(&h, w2v.as_tensor(), 2)?;
        let grads = y.sqr()?.sum_all()?.backward()?;
        Ok([xv, w1v, w2v]
            .iter()
            .map(|v| grads.get(v.as_tensor()).unwrap().clone())
            .collect())
    };
    let (ours, reference) = (grads_of(true)?, grads_of(false)?);
    for (name, (a, b)) in ["x", "w1", "w2"].iter().zip(ours.iter().zip(&reference)) {
        let e = rel_err(a, b);
        assert!(e <= 1e-5, "gradient of {name}: relative error {e:e}");
    }
    Ok(())
}

/// Set in the child process that [`gradients_are_bit_reproducible`] runs with a bigger pool.
const REPRO_CHILD: &str = "MEMTRAIN_CONV2D_REPRO_CHILD";

/// Runs forward and backward `runs` times per case and requires the same bits every time: the weight
/// gradient's partial sums must be added in an order that does not depend on which thread
/// finished first. The cases give several weight-gradient chunks (forced sizes 1, 2 and 3, and the
/// default sizing on 8×8 and 32×32 maps), f32 and bf16, and are big enough (up to about 10 ms per
/// run) that the threads share the work. (Before the fixed-order sum, 2 threads gave up to 9
/// different weight gradients in 20 runs of one case.)
fn check_reproducible(runs: usize) -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for (sh, chunk, dtype) in [
        (s(24, 8, 16, 8, 8, 3, 1, 1), Some(1), DType::F32),
        (s(24, 8, 16, 8, 8, 3, 1, 1), Some(2), DType::F32),
        (s(23, 8, 16, 8, 8, 3, 1, 1), Some(3), DType::F32),
        (s(64, 16, 16, 8, 8, 3, 1, 1), None, DType::F32),
        (s(64, 32, 32, 8, 8, 3, 1, 1), None, DType::F32),
        (s(16, 4, 8, 32, 32, 3, 1, 1), None, DType::F32),
        (s(32, 8, 16, 16, 16, 3, 1, 1), Some(1), DType::F32),
        (s(24, 8, 16, 8, 8, 1, 1, 0), Some(2), DType::F32),
        (s(24, 8, 16, 8, 8, 3, 2, 1), Some(2), DType::BF16),
        // A 576 KiB weight: several chunks per slot (up to 8 threads).
        (s(40, 128, 128, 4, 4, 3, 1, 1), Some(1), DType::F32),
    ] {
        let (x, w, g) = random_case(sh, &dev)?;
        let (x, w, g) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?, g.to_dtype(dtype)?);
        let conv = |x: &Tensor, w: &Tensor| -> anyhow::Result<Tensor> {
            Ok(match chunk {
                Some(c) => conv2d_with_chunk(x, w, sh.stride, sh.pad, c)?,
                None => conv2d(x, w, sh.stride, sh.pad)?,
            })
        };
        let all_bits = |(y, gx, gw): (Tensor, Tensor, Tensor)| -> anyhow::Result<_> {
            let f = |t: Tensor| t.to_dtype(DType::F32);
            Ok((bits(&f(y)?), bits(&f(gx)?), bits(&f(gw)?)))
        };
        let first = all_bits(run(&x, &w, &g, conv)?)?;
        for i in 1..runs {
            let again = all_bits(run(&x, &w, &g, conv)?)?;
            assert!(
                first.0 == again.0,
                "{sh:?} chunk {chunk:?} {dtype:?}: output differs on run {i}"
            );
            assert!(
                first.1 == again.1,
                "{sh:?} chunk {chunk:?} {dtype:?}: input gradient differs on run {i}"
            );
            assert!(
                first.2 == again.2,
                "{sh:?} chunk {chunk:?} {dtype:?}: weight gradient differs on run {i}"
            );
        }
    }
    Ok(())
}

#[test]
fn gradients_are_bit_reproducible() -> anyhow::Result<()> {
    let workers = candle_core::utils::barrier_pool().n_workers();
    if std::env::var_os(REPRO_CHILD).is_some() {
        // The child: its pool must be the one asked for, or the check proves nothing.
        assert_eq!(
            workers, 3,
            "CANDLE_NUM_THREADS=4 should give 3 pool workers"
        );
        return check_reproducible(10);
    }
    // With this machine's own pool (one worker and the calling thread on 2 cores)...
    check_reproducible(30)?;
    // ...and again in a child process whose pool has 4 threads whatever the machine has, so that
    // the threads really race (and are descheduled mid-pass on a small machine). Fewer runs there:
    // the pool's spinning workers make an oversubscribed machine slow.
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "gradients_are_bit_reproducible",
            "--test-threads=1",
        ])
        .env(REPRO_CHILD, "1")
        .env("CANDLE_NUM_THREADS", "4")
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child with 4 threads failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[test]
fn weight_gradient_agrees_across_chunk_sizes() -> anyhow::Result<()> {
    // Different chunk sizes sum the batch in different groupings, so they may round differently,
    // but only in the last bits.
    let dev = Device::Cpu;
    for sh in [
        s(24, 8, 16, 8, 8, 3, 1, 1),
        s(13, 5, 7, 9, 9, 3, 2, 1),
        s(24, 16, 8, 6, 6, 1, 1, 0),
    ] {
        let (x, w, g) = random_case(sh, &dev)?;
        let (_, _, reference) = run(&x, &w, &g, |x, w| {
            Ok(conv2d_with_chunk(x, w, sh.stride, sh.pad, 1)?)
        })?;
        let (_, _, default) = run(&x, &w, &g, |x, w| Ok(conv2d(x, w, sh.stride, sh.pad)?))?;
        assert_close(
            "weight gradient (default chunk)",
            sh,
            &default,
            &reference,
            1e-6,
        );
        for chunk in [2, 3, 5, 8, sh.n] {
            let (_, _, gw) = run(&x, &w, &g, |x, w| {
                Ok(conv2d_with_chunk(x, w, sh.stride, sh.pad, chunk)?)
            })?;
            assert_close(
                &format!("weight gradient (chunk {chunk})"),
                sh,
                &gw,
                &reference,
                1e-6,
            );
        }
    }
    Ok(())
}

#[test]
fn large_weights_sum_several_chunks_per_slot() -> anyhow::Result<()> {
    // The weight-gradient pass gives each slot (the unit the threads share out) as many chunks as
    // keep the partial sums within a budget; with a 576 KiB weight and up to 8 threads that is
    // more than one chunk per slot, which the small shapes above never reach. 40 images in chunks
    // of 1, 3 and 7 make slots whose last chunk is short.
    let dev = Device::Cpu;
    let sh = s(40, 128, 128, 4, 4, 3, 1, 1);
    let (x, w, g) = random_case(sh, &dev)?;
    let (_, _, rgw) = naive(sh, &x, &w, &g)?;
    for chunk in [1, 3, 7] {
        let (_, _, gw) = run(&x, &w, &g, |x, w| {
            Ok(conv2d_with_chunk(x, w, sh.stride, sh.pad, chunk)?)
        })?;
        assert_close(
            &format!("weight gradient (chunk {chunk})"),
            sh,
            &gw,
            &rgw,
            1e-5,
        );
    }
    Ok(())
}

#[test]
fn input_gradient_only_for_inputs_that_track_ops() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let sh = s(3, 4, 5, 6, 6, 3, 1, 1);
    let (x, w, g) = random_case(sh, &dev)?;
    let wv = Var::from_tensor(&w)?;
    let backward = |input: &Tensor| -> anyhow::Result<candle_core::backprop::GradStore> {
        let y = conv2d(input, wv.as_tensor(), sh.stride, sh.pad)?;
        Ok((&y * &g)?.sum_all()?.backward()?)
    };

    // A plain data tensor (and a detached copy of a variable) tracks nothing: no input gradient,
    // but the weight gradient as usual.
    let xv = Var::from_tensor(&x)?;
    for (what, input) in [
        ("plain tensor", x.clone()),
        ("detached variable", xv.as_detached_tensor()),
    ] {
        assert!(!input.track_op());
        let grads = backward(&input)?;
        assert!(
            grads.get(&input).is_none(),
            "{what}: unexpected input gradient"
        );
        assert!(
            grads.get(wv.as_tensor()).is_some(),
            "{what}: no weight gradient"
        );
    }

    // A variable, or a tensor computed from one, gets its gradient (and the weight gradient is the
    // same bits either way).
    let (_, rgx, rgw) = naive(sh, &x, &w, &g)?;
    let gw_untracked = backward(&x)?.get(wv.as_tensor()).unwrap().clone();
    let grads = backward(xv.as_tensor())?;
    let gx = grads
        .get(xv.as_tensor())
        .expect("a Var input gets its gradient");
    assert_close("input gradient (Var)", sh, gx, &rgx, 1e-5);
    let gw = grads.get(wv.as_tensor()).unwrap();
    assert_close("weight gradient (Var input)", sh, gw, &rgw, 1e-5);
    assert!(
        bits(gw) == bits(&gw_untracked),
        "weight gradient depends on the input's tracking"
    );

    // Through an op: Candle consumes the intermediate's gradient on the way, so it is checked
    // where it arrives, at the variable.
    let h = (xv.as_tensor() * 2.0)?;
    assert!(h.track_op());
    let grads = backward(&h)?;
    let gx = grads
        .get(xv.as_tensor())
        .expect("a tensor computed from a Var passes its gradient on");
    assert_close("input gradient through x2", sh, &(gx / 2.0)?, &rgx, 1e-5);
    Ok(())
}

#[test]
fn empty_batch() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::zeros((0, 3, 5, 5), DType::F32, &dev)?)?;
    let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 3, 3, 3), &dev)?)?;
    let y = conv2d(x.as_tensor(), w.as_tensor(), 1, 1)?;
    assert_eq!(y.dims(), &[0, 4, 5, 5]);
    let grads = y.sum_all()?.backward()?;
    let gw = grads.get(w.as_tensor()).unwrap();
    assert_eq!(gw.dims(), &[4, 3, 3, 3]);
    assert_eq!(gw.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    Ok(())
}

#[test]
fn invalid_arguments_are_errors() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 3, 5, 5), DType::F32, &dev)?;
    let w = Tensor::zeros((4, 3, 3, 3), DType::F32, &dev)?;
    let err = |r: candle_core::Result<Tensor>| r.expect_err("expected an error").to_string();

    assert!(err(conv2d(&x.flatten_from(2)?, &w, 1, 1)).contains("4D"));
    assert!(err(conv2d(&x, &w.flatten_from(2)?, 1, 1)).contains("4D"));
    assert!(err(conv2d(
        &x,
        &Tensor::zeros((4, 5, 3, 3), DType::F32, &dev)?,
        1,
        1
    ))
    .contains("channels"));
    assert!(err(conv2d(
        &x,
        &Tensor::zeros((4, 3, 3, 2), DType::F32, &dev)?,
        1,
        1
    ))
    .contains("square"));
    assert!(err(conv2d(
        &x,
        &Tensor::zeros((4, 3, 7, 7), DType::F32, &dev)?,
        1,
        0
    ))
    .contains("larger than the padded input"));
    // 7×7 fits once the 5×5 input is padded by 1.
    assert!(conv2d(&x, &Tensor::zeros((4, 3, 7, 7), DType::F32, &dev)?, 1, 1).is_ok());
    assert!(err(conv2d(&x, &w, 0, 1)).contains("stride"));
    assert!(err(conv2d(&x, &w.to_dtype(DType::F16)?, 1, 1)).contains("dtype"));
    assert!(err(conv2d(
        &x.to_dtype(DType::U32)?,
        &w.to_dtype(DType::U32)?,
        1,
        1
    ))
    .contains("unsupported dtype"));
    assert!(err(conv2d_with_chunk(&x, &w, 1, 1, 0)).contains("chunk"));
    Ok(())
}

#[test]
fn im2col_bytes_are_bounded() {
    let threads = candle_core::utils::barrier_pool().n_workers() + 1;
    // Default net, first 32→32 layer at 32×32: one image per thread and chunk (a 1024-pixel map is
    // deep enough for the gemm), 288 rows of 1024 f32 padded by 16 against cache-set aliasing.
    let bytes = im2col_chunk_bytes(128, 32, 3, 32, 32, DType::F32);
    assert_eq!(bytes, threads.min(128) * 288 * 1040 * 4);
    // Small images: the budget is the bound, or one image's columns per thread where the
    // threads are so many that their shares of the budget hold less (16 threads here: measured on
    // a 16-core GPU machine), and either is far below a full-batch im2col.
    let one_image = 128 * 9 * 64 * 4;
    let bytes = im2col_chunk_bytes(128, 128, 3, 8, 8, DType::F32);
    assert!(
        bytes <= IM2COL_CHUNK_BYTES.max(threads * one_image),
        "{bytes} with {threads} threads"
    );
    assert!(
        bytes <= 128 * one_image / 4,
        "{bytes} with {threads} threads"
    );
    // Half precision is gathered in f32, f64 in f64.
    assert_eq!(
        im2col_chunk_bytes(1, 3, 3, 4, 4, DType::BF16),
        im2col_chunk_bytes(1, 3, 3, 4, 4, DType::F32)
    );
    assert_eq!(
        im2col_chunk_bytes(1, 3, 3, 4, 4, DType::F64),
        2 * 3 * 9 * 16 * 4
    );
    assert_eq!(im2col_chunk_bytes(0, 3, 3, 4, 4, DType::F32), 0);
}

/// The CUDA op (im2col + cuBLAS + col2im) against the CPU op in every dtype, forward and both
/// gradients, on every shape, with the default chunking and with chunks of 1 and 2 images (so
/// chunks that do not divide the batch run too). Needs a GPU:
/// `cargo test --release --features cuda --test conv2d -- --ignored`.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_matches_cpu() -> anyhow::Result<()> {
    let gpu = Device::new_cuda(0)?;
    let to = |t: &Tensor, d: &Device| t.to_device(d).unwrap();
    for (dtype, tol) in [
        (DType::F32, 1e-5f32),
        (DType::F64, 1e-5),
        (DType::F16, 1e-2),
        (DType::BF16, 3e-2),
    ] {
        for sh in SHAPES {
            let (x, w, g) = random_case(sh, &Device::Cpu)?;
            let (x, w, g) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?, g.to_dtype(dtype)?);
            let (cy, cgx, cgw) = run(&x, &w, &g, |x, w| Ok(conv2d(x, w, sh.stride, sh.pad)?))?;
            for chunk in [None, Some(1), Some(2)] {
                let conv = |x: &Tensor, w: &Tensor| -> anyhow::Result<Tensor> {
                    Ok(match chunk {
                        None => conv2d(x, w, sh.stride, sh.pad)?,
                        Some(c) => conv2d_with_chunk(x, w, sh.stride, sh.pad, c)?,
                    })
                };
                let (y, gx, gw) = run(&to(&x, &gpu), &to(&w, &gpu), &to(&g, &gpu), conv)?;
                assert!(y.device().is_cuda() && gx.device().is_cuda() && gw.device().is_cuda());
                let case = format!("{dtype:?} {sh:?} chunk {chunk:?}");
                for (what, got, want) in [
                    ("output", &y, &cy),
                    ("input gradient", &gx, &cgx),
                    ("weight gradient", &gw, &cgw),
                ] {
                    let e = rel_err(&to(got, &Device::Cpu), want);
                    assert!(e < tol, "{case}: {what} relative error {e}");
                }
            }
        }
    }
    Ok(())
}
