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
use super::conv2d_cpu::{
    chunks_per_slot, col2im, im2col_row, images_per_chunk, num_threads, padded_ld, par_chunks,
    per_image, scratch, OrderedSum,
};
use super::gemm_bf16::{gemm, gemm_prepared, MatRef, PackedB, PreparedA};
use super::geom::{ConvPass, Geom};

/// Runs the bf16 gemm on operands this file built: their shapes hold by construction, so an
/// error is a bug here, not a user error.
fn mul(dst: &mut [f32], dst_rs: usize, accumulate: bool, a: MatRef<'_>, b: &PackedB) {
    if let Err(e) = gemm(dst, dst_rs, accumulate, a, b) {
        panic!("conv2d (bf16): inconsistent gemm operands: {e}");
    }
}

/// `a` prepared once for a thread's run of gemms (the weight, image after image).
fn prepare(a: MatRef<'_>) -> PreparedA<'_> {
    PreparedA::new(a).unwrap_or_else(|e| panic!("conv2d (bf16): inconsistent gemm operand: {e}"))
}

/// [`mul`] with a prepared `A`.
fn mul_prepared(dst: &mut [f32], dst_rs: usize, a: &PreparedA<'_>, b: &PackedB) {
    if let Err(e) = gemm_prepared(dst, dst_rs, false, a, b) {
        panic!("conv2d (bf16): inconsistent gemm operands: {e}");
    }
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
        || (PackedB::new(), Vec::new(), prepare(a)),
        |(packed, out_buf, a), i, dst: &mut [bf16]| {
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
    per_image(
        g.n,
        in_len,
        || (PackedB::new(), Vec::new(), Vec::new(), prepare(a)),
        |(packed, col_buf, img_buf, a), i, dst: &mut [bf16]| {
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
    let (ckk, hwo, in_len, out_len) = (g.ckk(), g.hw_out(), g.in_image(), g.out_image());
    let threads = num_threads();
    // The chunk size as the generic path chooses it (its columns are f32), so both paths sum
    // over the same chunks and slots.
    let chunk = images_per_chunk(g.n, hwo, ckk * hwo * 4, threads, g.chunk);
    let n_chunks = g.n.div_ceil(chunk);
    let chunks_per_slot = chunks_per_slot(n_chunks, ckk * g.cout * 4, threads);
    let n_slots = n_chunks.div_ceil(chunks_per_slot);
    let slot_images = chunks_per_slot * chunk;
    let sum = OrderedSum::<f32>::new(n_slots, ckk * g.cout);
    par_chunks(n_slots, 1, |slots| {
        let (mut packed, mut grad_buf) = (PackedB::new(), Vec::new());
        for slot in slots.flatten() {
            let mut acc = sum.buffer();
            let images = slot * slot_images..((slot + 1) * slot_images).min(g.n);
            for (c, first) in images.clone().step_by(chunk).enumerate() {
                let range = first..(first + chunk).min(images.end);
                let b = range.len();
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
                    let gm = scratch(&mut grad_buf, g.cout * kdim);
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
                // The slot's first chunk overwrites the (reused) buffer, the others add to it.
                mul(&mut acc, ckk, c > 0, lhs, &packed);
            }
            sum.add(slot, acc);
        }
    });
    let mut dw = vec![bf16::ZERO; g.cout * ckk];
    if let Some(total) = sum.total() {
        narrow(&total, &mut dw);
    }
    dw
}
