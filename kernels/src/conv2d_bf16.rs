//! The three CPU passes of [`super::conv2d`] for bf16 inputs on the AVX512-BF16 kernel
//! ([`super::gemm_bf16`]): operands stay bf16, sums are f32, results are narrowed to bf16 once.
//! The dispatcher in `conv2d.rs` runs these instead of the generic passes of
//! [`super::conv2d_cpu`] when the CPU has the kernel.
//!
//! Same shapes, threading and summation order across threads as the generic passes in
//! `conv2d_cpu.rs` (per-image work shared out by `per_image`, weight-gradient partials added in
//! slot order by `OrderedSum`), so the op stays bit-for-bit reproducible. What differs is where
//! the operands come from, to fit the kernel's layout (`A` read in place with contiguous `k`,
//! `B` packed into pair-interleaved panels):
//!
//! - forward, `out = W · col`: `A` is the weight as it is; `B` is packed straight from
//!   im2col rows, two at a time, so the column matrix is never materialized.
//! - input gradient, `dcol = Wᵀ · grad`: `A` is `Wᵀ`, transposed once per call; `B` is the
//!   image's output gradient, packed.
//! - weight gradient, `dW = grad · colᵀ`: `A` is the chunk's output gradient; `B` is `colᵀ`,
//!   packed column by column from im2col rows (a transpose of 32-bit pairs).

use half::bf16;

use super::bf16_convert::narrow;
use super::conv2d_cpu::{col2im, im2col_row, padded_ld, scratch, PassScratch, WgradPlan};
use super::conv2d_threads::{
    busy_threads, num_threads, par_chunks, per_image, OrderedSum, ThreadSets,
};
use super::gemm_bf16::{
    a_stride, bf16_kernel, gemm_prepared, Bf16Kernel, MatRef, PackedB, PreparedA,
};
use super::geom::{ConvPass, Geom};

/// Runs the bf16 gemm on operands this file built (their shapes hold by construction, so an
/// error is a bug here, not a user error), `A` widened (by the FMA kernel) into `buf`.
fn mul(
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: MatRef<'_>,
    b: &PackedB,
    buf: &mut Vec<f32>,
) {
    let a = prepare(a, std::mem::take(buf));
    if let Err(e) = gemm_prepared(dst, dst_rs, accumulate, &a, b) {
        panic!("conv2d (bf16): inconsistent gemm operands: {e}");
    }
    *buf = a.into_buffer();
}

/// `a` prepared once for a thread's run of gemms (the weight, image after image), widened (by
/// the FMA kernel) into `buf`, one of the thread's preallocated buffers (see [`widened`]).
fn prepare(a: MatRef<'_>, buf: Vec<f32>) -> PreparedA<'_> {
    PreparedA::with_buffer(a, buf)
        .unwrap_or_else(|e| panic!("conv2d (bf16): inconsistent gemm operand: {e}"))
}

/// Elements of the buffer the FMA kernel widens an `m × k` `A` into (0 on the other kernels,
/// which read `A` in place).
fn widened(m: usize, k: usize) -> usize {
    if bf16_kernel() == Bf16Kernel::Avx512Fma {
        m * a_stride(k)
    } else {
        0
    }
}

/// Bytes of a [`PackedB`] for `k × n` matrices of every `k` in `ks`, by rows or `by_columns`.
fn packed_bytes(ks: &[usize], n: usize, by_columns: bool) -> usize {
    let (words, gather) = PackedB::lens(ks, n, by_columns);
    words * 4 + gather * 2
}

/// [`mul`] with a prepared `A`.
fn mul_prepared(dst: &mut [f32], dst_rs: usize, a: &PreparedA<'_>, b: &PackedB) {
    if let Err(e) = gemm_prepared(dst, dst_rs, false, a, b) {
        panic!("conv2d (bf16): inconsistent gemm operands: {e}");
    }
}

/// A `PackedB` with room for `k × n` matrices of every `k` in `ks`, by rows or `by_columns`.
fn packed_b(ks: &[usize], n: usize, by_columns: bool) -> PackedB {
    let mut packed = PackedB::new();
    packed.reserve(ks, n, by_columns);
    packed
}

/// One thread's set in the forward: packed columns, the f32 output image, the widened weight's
/// buffer and the weight prepared from it.
type ForwardSet<'a> = (PackedB, Vec<f32>, Vec<f32>, Option<PreparedA<'a>>);
/// One thread's set in the input gradient: packed output gradient, columns, the f32 input image,
/// the widened weight's buffer and the weight prepared from it.
type InputGradSet<'a> = (PackedB, Vec<f32>, Vec<f32>, Vec<f32>, Option<PreparedA<'a>>);
/// One thread's set in the weight gradient: packed columns, the gathered output gradient and the
/// widened output gradient.
type WeightGradSet = (PackedB, Vec<bf16>, Vec<f32>);

/// What `pass` of `g` allocates besides its result on these kernels, for `threads` threads (see
/// [`PassScratch`]): the same buffers the passes make, with nothing reserved for packing (the
/// kernels pack into those buffers).
pub(super) fn pass_scratch(pass: ConvPass, g: &Geom, threads: usize) -> PassScratch {
    let (ckk, hwo, busy) = (g.ckk(), g.hw_out(), busy_threads(g.n, threads));
    match pass {
        ConvPass::Forward => {
            let f32s = g.out_image() + widened(g.cout, ckk);
            PassScratch {
                section: busy * (packed_bytes(&[ckk], hwo, false) + f32s * 4)
                    + ThreadSets::<ForwardSet>::record_bytes(busy),
                tail: 0,
            }
        }
        ConvPass::InputGrad => {
            let col = if g.pointwise() {
                0
            } else {
                ckk * padded_ld(hwo, 4)
            };
            let f32s = col + g.in_image() + widened(ckk, g.cout);
            PassScratch {
                section: ckk * g.cout * 2
                    + busy * (packed_bytes(&[g.cout], hwo, false) + f32s * 4)
                    + ThreadSets::<InputGradSet>::record_bytes(busy),
                tail: 0,
            }
        }
        ConvPass::WeightGrad => {
            let plan = WgradPlan::new(g, 4, threads);
            let (ks, gathered, wide) = grad_weight_lens(g, &plan);
            let set = packed_bytes(&ks, ckk, true) + gathered * 2 + wide * 4;
            let partial = ckk * g.cout * 4;
            PassScratch {
                section: plan.buffers * partial
                    + plan.busy * set
                    + ThreadSets::<WeightGradSet>::record_bytes(plan.busy)
                    + OrderedSum::<f32>::record_bytes(plan.n_slots, plan.buffers),
                tail: if plan.n_slots > 0 { partial } else { 0 },
            }
        }
    }
}

/// The weight gradient's gemm depths (`b·Ho·Wo` of each chunk size), and the elements of its
/// gathered output gradient (chunks of more than one image) and of its widened `A`.
fn grad_weight_lens(g: &Geom, plan: &WgradPlan) -> (Vec<usize>, usize, usize) {
    let ks: Vec<usize> = plan.chunk_sizes(g.n).map(|b| b * g.hw_out()).collect();
    let gathered = plan.chunk_sizes(g.n).filter(|&b| b > 1).max().unwrap_or(0);
    let wide = ks.iter().map(|&k| widened(g.cout, k)).max().unwrap_or(0);
    (ks, g.cout * gathered * g.hw_out(), wide)
}

/// `pass` of the convolution `g` on its two bf16 operands (`x, w`; `dy, w`; `x, dy`).
pub(super) fn run(pass: ConvPass, g: &Geom, a: &[bf16], b: &[bf16]) -> Vec<bf16> {
    match pass {
        ConvPass::Forward => forward(g, a, b),
        ConvPass::InputGrad => grad_input(g, a, b),
        ConvPass::WeightGrad => grad_weight(g, a, b),
    }
}

/// `out[n] = W · col(x[n])` for every image.
fn forward(g: &Geom, x: &[bf16], w: &[bf16]) -> Vec<bf16> {
    let (ckk, hwo, in_len, out_len) = (g.ckk(), g.hw_out(), g.in_image(), g.out_image());
    let a = MatRef {
        data: w,
        rows: g.cout,
        cols: ckk,
        rs: ckk,
        cs: 1,
    };
    per_image(
        g.n,
        out_len,
        0,
        || -> ForwardSet {
            let a_buf = Vec::with_capacity(widened(g.cout, ckk));
            let packed = packed_b(&[ckk], hwo, false);
            (packed, Vec::with_capacity(out_len), a_buf, None)
        },
        |(packed, out_buf, a_buf, prepared), i, dst: &mut [bf16]| {
            let a = prepared.get_or_insert_with(|| prepare(a, std::mem::take(a_buf)));
            let img = &x[i * in_len..(i + 1) * in_len];
            if g.pointwise() {
                packed.pack_row_pairs(ckk, hwo, |r, dst| {
                    dst.copy_from_slice(&img[r * hwo..(r + 1) * hwo])
                });
            } else {
                packed.pack_row_pairs(ckk, hwo, |r, dst| im2col_row(g, img, r, dst));
            }
            let d = scratch(out_buf, out_len);
            mul_prepared(d, hwo, a, packed);
            narrow(d, dst);
        },
    )
}

/// `dx[n] = col2im(Wᵀ · grad[n])` for every image.
fn grad_input(g: &Geom, grad: &[bf16], w: &[bf16]) -> Vec<bf16> {
    let (ckk, hwo, in_len, out_len) = (g.ckk(), g.hw_out(), g.in_image(), g.out_image());
    let ld = padded_ld(hwo, 4);
    // Wᵀ [Cin·K·K, Cout], once for the whole batch: the kernel broadcasts pairs along k = Cout.
    let mut wt = vec![bf16::ZERO; ckk * g.cout];
    for (co, row) in w.chunks_exact(ckk.max(1)).enumerate().take(g.cout) {
        for (r, &v) in row.iter().enumerate() {
            wt[r * g.cout + co] = v;
        }
    }
    let a = MatRef {
        data: &wt,
        rows: ckk,
        cols: g.cout,
        rs: g.cout,
        cs: 1,
    };
    let col = if g.pointwise() { 0 } else { ckk * ld };
    per_image(
        g.n,
        in_len,
        0,
        || -> InputGradSet {
            let packed = packed_b(&[g.cout], hwo, false);
            let bufs = (Vec::with_capacity(col), Vec::with_capacity(in_len));
            let a_buf = Vec::with_capacity(widened(ckk, g.cout));
            (packed, bufs.0, bufs.1, a_buf, None)
        },
        |(packed, col_buf, img_buf, a_buf, prepared), i, dst: &mut [bf16]| {
            let a = prepared.get_or_insert_with(|| prepare(a, std::mem::take(a_buf)));
            let gi = &grad[i * out_len..(i + 1) * out_len];
            packed.pack_row_pairs(g.cout, hwo, |r, dst| {
                dst.copy_from_slice(&gi[r * hwo..(r + 1) * hwo])
            });
            let d = scratch(img_buf, in_len);
            if g.pointwise() {
                mul_prepared(d, hwo, a, packed);
            } else {
                let col = scratch(col_buf, ckk * ld);
                mul_prepared(col, ld, a, packed);
                col2im(g, col, ld, d);
            }
            narrow(d, dst);
        },
    )
}

/// `dW = Σₙ grad[n] · col(x[n])ᵀ`, over chunks of images, summed in slot order as the generic
/// `grad_weight` in `conv2d_cpu.rs` does (the same chunking, so the same determinism).
///
/// Here `A` is the chunk's output gradient `[Cout, b·Ho·Wo]` (the small operand, read in place
/// for one image) and `B = colᵀ`, packed column by column straight from im2col rows, so the
/// product is `dW [Cout, Cin·K·K]` itself, without the generic path's transposes.
fn grad_weight(g: &Geom, x: &[bf16], grad: &[bf16]) -> Vec<bf16> {
    let ckk = g.ckk();
    // The chunks and slots as the generic path chooses them (its columns are f32), so both paths
    // sum over the same chunks and slots.
    let plan = WgradPlan::new(g, 4, num_threads());
    let sum = OrderedSum::<f32>::new(plan.n_slots, ckk * g.cout, plan.buffers);
    let (ks, gathered, wide) = grad_weight_lens(g, &plan);
    let sets = ThreadSets::new(plan.busy, 0, || -> WeightGradSet {
        let bufs = (Vec::with_capacity(gathered), Vec::with_capacity(wide));
        (packed_b(&ks, ckk, true), bufs.0, bufs.1)
    });
    par_chunks(plan.n_slots, 1, |slots| {
        let _guard = sum.guard();
        let mut set = None;
        while let Some(mut acc) = sum.buffer() {
            let Some(slot) = slots.next().map(|r| r.start) else {
                sum.give_back(acc);
                break;
            };
            let (packed, grad_buf, a_buf) = set.get_or_insert_with(|| sets.take());
            let images = plan.slot(slot, g.n);
            for (c, first) in images.clone().step_by(plan.chunk).enumerate() {
                let range = first..(first + plan.chunk).min(images.end);
                // The slot's first chunk overwrites the (reused) buffer, the others add to it.
                let bufs = (&mut *grad_buf, &mut *a_buf);
                grad_weight_chunk(g, x, grad, range, c > 0, &mut acc, packed, bufs);
            }
            sum.add(slot, acc);
        }
    });
    drop(sets);
    let total = sum.total();
    let mut dw = vec![bf16::ZERO; g.cout * ckk];
    if let Some(total) = total {
        narrow(&total, &mut dw);
    }
    dw
}

/// One chunk of the weight gradient: the images `range` multiplied into `acc` (`dW`, added to it
/// with `accumulate`), with the thread's packed `B` and its gathered-gradient and widened-`A`
/// buffers.
#[allow(clippy::too_many_arguments)]
fn grad_weight_chunk(
    g: &Geom,
    x: &[bf16],
    grad: &[bf16],
    range: std::ops::Range<usize>,
    accumulate: bool,
    acc: &mut [f32],
    packed: &mut PackedB,
    (grad_buf, a_buf): (&mut Vec<bf16>, &mut Vec<f32>),
) {
    let (ckk, hwo, in_len, out_len) = (g.ckk(), g.hw_out(), g.in_image(), g.out_image());
    let (first, b) = (range.start, range.len());
    // The chunk's pixels side by side: the gemm's inner dimension is b·Ho·Wo.
    let kdim = b * hwo;
    // colᵀ: column r of B is row r of the chunk's column matrix.
    packed.pack_columns(kdim, ckk, |r, dst| {
        for (j, i) in range.clone().enumerate() {
            let img = &x[i * in_len..(i + 1) * in_len];
            let part = &mut dst[j * hwo..(j + 1) * hwo];
            if g.pointwise() {
                part.copy_from_slice(&img[r * hwo..(r + 1) * hwo]);
            } else {
                im2col_row(g, img, r, part);
            }
        }
    });
    let grad_rows: &[bf16] = if b == 1 {
        &grad[first * out_len..(first + 1) * out_len]
    } else {
        // Gather [b, Cout, Ho·Wo] into [Cout, b·Ho·Wo].
        let gm = scratch(grad_buf, g.cout * kdim);
        for (j, i) in range.clone().enumerate() {
            let gi = &grad[i * out_len..(i + 1) * out_len];
            for co in 0..g.cout {
                let start = co * kdim + j * hwo;
                gm[start..start + hwo].copy_from_slice(&gi[co * hwo..(co + 1) * hwo]);
            }
        }
        gm
    };
    let lhs = MatRef {
        data: grad_rows,
        rows: g.cout,
        cols: kdim,
        rs: kdim,
        cs: 1,
    };
    mul(acc, ckk, accumulate, lhs, packed, a_buf);
}
