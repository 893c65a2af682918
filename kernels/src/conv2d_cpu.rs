//! The CPU passes of [`super::conv2d`]: im2col + gemm per image for the forward pass, gemm +
//! col2im for the input gradient, chunked im2col + gemm for the weight gradient, all sharing out
//! images (or weight-gradient slots) to candle's CPU thread pool. The dispatcher in `conv2d.rs`
//! picks these for every dtype, or the AVX512-BF16 passes of [`super::conv2d_bf16`] for bf16,
//! which reuse this file's im2col rows, threading and ordered sum.
//!
//! - forward, per image: `out[Cout, Ho·Wo] = W[Cout, Cin·K·K] · col[Cin·K·K, Ho·Wo]`;
//! - input gradient, per image: `dcol = Wᵀ · grad`, then col2im adds `dcol` back onto the image;
//! - weight gradient, per chunk of `b` images: `dWᵀ += col[Cin·K·K, b·Ho·Wo] · gradᵀ[b·Ho·Wo, Cout]`.
//!
//! The column matrix stores row `(c, kh, kw)` in the weight's own memory order, so `W` is used as a
//! plain `[Cout, Cin·K·K]` matrix and the forward writes NCHW output without a permute. Each thread
//! runs single-threaded gemms on its own images, which avoids a fork/join inside every small gemm
//! and lets im2col/col2im run in parallel too. Each thread owns one column buffer, so the transient
//! memory is bounded by [`IM2COL_CHUNK_BYTES`] (or one image per thread) instead of Candle's
//! full-batch im2col.
//!
//! Results do not depend on how the threads are scheduled: the forward and input gradient write
//! each image's result to its own slice, and the weight gradient adds its per-chunk partial sums
//! in a fixed order (see `grad_weight`), so a training run is bit-for-bit reproducible.
//!
//! Half-precision inputs (f16, bf16) are widened to f32 one image at a time, multiplied in f32 and
//! narrowed on the way out: gemm has no bf16 kernel, and its f16 kernel widens to f32 internally
//! anyway (without AVX512-FP16) while rounding partial sums to f16 between K blocks.

use candle_core::DType;

use std::ops::Range;

use super::conv2d_threads::{
    busy_threads, num_threads, par_chunks, partial_buffers, per_image, OrderedSum, ThreadSets,
};
use super::geom::{ConvPass, Geom};
use super::util::{gemm_packing_bytes, Acc, Float};

/// Upper bound, in bytes, on the column buffers the weight-gradient pass holds at once (all threads
/// together). A chunk is never smaller than one image per thread, so one image's column matrix
/// larger than this share wins over the bound.
///
/// The weight gradient gathers several images per gemm only on small maps (see
/// [`MIN_GEMM_DEPTH`]); this budget caps that, and 4 MiB split over the threads keeps each thread's
/// columns near its L2 cache, so the gemm reads them while they are still warm.
pub const IM2COL_CHUNK_BYTES: usize = 4 << 20;

/// Output pixels the weight-gradient gemm should sum over per call (its inner dimension): images
/// are gathered into one chunk until their maps have this many pixels. Below a few hundred the
/// gemm spends its time packing and writing the accumulator instead of multiplying; at 16×16 and
/// larger one image is already enough.
pub const MIN_GEMM_DEPTH: usize = 256;

/// Bytes of the transient column (im2col) buffers this op allocates at most for a batch of `n`
/// images with `cin` input channels, a `k`×`k` kernel and a `ho`×`wo` output, in `dtype`.
///
/// This is the weight-gradient pass (the largest of the three): one chunk of images per busy
/// thread, rows padded as the op pads them. The columns are f32 for f32/f16/bf16 inputs (half types
/// are widened before the gemm) and f64 for f64. (With the AVX-512 bf16 kernels,
/// [`super::gemm_bf16`], a bf16 convolution packs its columns as bf16 and holds half of this.)
/// A 1×1, stride-1, unpadded f32 convolution may read its input in place and allocate less than
/// this. Not included: the per-thread scratch that is smaller by a factor of about K²
/// (one widened image, the gathered output gradient `Cout × chunk × Ho·Wo`, one `Cin·K·K × Cout`
/// weight-gradient partial sum per thread plus their running total).
pub fn im2col_chunk_bytes(
    n: usize,
    cin: usize,
    k: usize,
    ho: usize,
    wo: usize,
    dtype: DType,
) -> usize {
    let acc = acc_size(dtype);
    let threads = num_threads();
    let chunk = images_per_chunk(n, ho * wo, cin * k * k * ho * wo * acc, threads, None);
    let busy = threads.min(n.div_ceil(chunk));
    busy * cin * k * k * padded_ld(chunk.min(n) * ho * wo, acc) * acc
}

/// Bytes of one element of the type the gemm runs in for inputs of `dtype`.
fn acc_size(dtype: DType) -> usize {
    match dtype {
        DType::F64 => 8,
        _ => 4,
    }
}

/// Row stride (in elements) for a column matrix with `cols` columns of `elem`-byte values.
///
/// A row stride that is a multiple of 2 KiB (e.g. a 32×32 map in f32) makes the gemm's loads of
/// consecutive rows fall into the same few L1 cache sets; measured on this project's CPU, the
/// forward gemm of a 32→32 layer at 32×32 runs at 68 GFLOP/s with 4 KiB rows and 110 with 64 bytes
/// of padding per row.
pub(super) fn padded_ld(cols: usize, elem: usize) -> usize {
    if cols > 0 && (cols * elem).is_multiple_of(2048) {
        cols + 64 / elem
    } else {
        cols
    }
}

/// Images per weight-gradient chunk: enough for [`MIN_GEMM_DEPTH`] output pixels, but no more than
/// fit in this thread's share of [`IM2COL_CHUNK_BYTES`] or than an even split of the batch (so that
/// every thread gets work); at least one.
pub(super) fn images_per_chunk(
    n: usize,
    hw_out: usize,
    per_image_bytes: usize,
    threads: usize,
    forced: Option<usize>,
) -> usize {
    let n = n.max(1);
    if let Some(c) = forced {
        return c.clamp(1, n);
    }
    let threads = threads.max(1);
    let wanted = MIN_GEMM_DEPTH.div_ceil(hw_out.max(1));
    let by_budget = IM2COL_CHUNK_BYTES / threads / per_image_bytes.max(1);
    wanted.min(by_budget).min(n.div_ceil(threads)).max(1)
}

// ---------------------------------------------------------------------------------------------
// Scratch

/// The first `len` elements of a reusable scratch buffer, grown on first use. Contents are stale:
/// every caller overwrites all of them.
pub(super) fn scratch<A: Copy + Default>(buf: &mut Vec<A>, len: usize) -> &mut [A] {
    if buf.len() < len {
        buf.resize(len, A::default());
    }
    &mut buf[..len]
}

/// `src` as the gemm type: borrowed when it already is, otherwise widened into `buf`.
fn widen<'a, T: Float>(src: &'a [T], buf: &'a mut Vec<T::Acc>) -> &'a [T::Acc] {
    match T::as_acc(src) {
        Some(a) => a,
        None => {
            let dst = scratch(buf, src.len());
            T::widen(src, dst);
            dst
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Kernels

/// A strided matrix view: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
struct Mat<'a, A> {
    data: &'a [A],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

/// Elements a `rows × cols` strided matrix spans from its first element.
fn span(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// `dst = lhs · rhs` (or `dst += lhs · rhs` with `accumulate`) on the calling thread; `dst` is
/// row-major with row stride `dst_rs`.
fn matmul<A: Acc>(
    dst: &mut [A],
    dst_rs: usize,
    accumulate: bool,
    lhs: Mat<'_, A>,
    rhs: Mat<'_, A>,
) {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    // These bounds make the raw-pointer gemm call below sound; they hold by construction, so a
    // failure is a bug in this file, not a user error.
    assert_eq!(rhs.rows, k, "conv2d: gemm inner dimensions differ");
    assert!(
        lhs.data.len() >= span(m, k, lhs.rs, lhs.cs),
        "conv2d: lhs out of bounds"
    );
    assert!(
        rhs.data.len() >= span(k, n, rhs.rs, rhs.cs),
        "conv2d: rhs out of bounds"
    );
    assert!(
        dst.len() >= span(m, n, dst_rs, 1),
        "conv2d: dst out of bounds"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                dst[i * dst_rs..i * dst_rs + n].fill(A::ZERO);
            }
        }
        return;
    }
    // SAFETY: all three views are in bounds (checked above), `dst` does not alias the inputs (it is
    // a distinct `&mut`), and `A` is f32 or f64, which gemm supports.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            if accumulate { A::ONE } else { A::ZERO },
            A::ONE,
            false,
            false,
            false,
            // Parallelism comes from giving each thread its own images: a fork/join inside every
            // per-image gemm costs more than it gains at these sizes.
            gemm::Parallelism::None,
        )
    }
}

/// Writes the column matrix of one image `src [Cin, H, W]` into `dst`: row `(c, kh, kw)` starts
/// at `row * row_stride` and holds the `Ho·Wo` input values that tap sees (zero for padding).
pub(super) fn im2col<A: Copy + Default>(g: &Geom, src: &[A], dst: &mut [A], row_stride: usize) {
    let hwo = g.hw_out();
    for r in 0..g.ckk() {
        im2col_row(g, src, r, &mut dst[r * row_stride..r * row_stride + hwo]);
    }
}

/// Row `r = (c, kh, kw)` of one image's column matrix (`Ho·Wo` values) into `row`: what
/// [`im2col`] writes at `r * row_stride`, on its own so that the bf16 path can pack rows two at a
/// time without materializing the matrix.
pub(super) fn im2col_row<A: Copy + Default>(g: &Geom, src: &[A], r: usize, row: &mut [A]) {
    let (k, s, p, w, ho, wo) = (g.k, g.stride, g.pad, g.w, g.ho, g.wo);
    let zero = A::default();
    let plane_len = g.h * g.w;
    let (c, kh, kw) = (r / (k * k), (r / k) % k, r % k);
    let plane = &src[c * plane_len..(c + 1) * plane_len];
    let (oh_lo, oh_hi) = g.valid(kh, g.h, ho);
    let (ow_lo, ow_hi) = g.valid(kw, w, wo);
    let row = &mut row[..ho * wo];
    row[..oh_lo * wo].fill(zero);
    row[oh_hi * wo..].fill(zero);
    if s == 1 && wo == w && oh_lo < oh_hi && ow_lo < ow_hi {
        // Stride 1 and rows as wide as the input's: output index o reads input index o + off
        // for a constant off, so the valid rows are one contiguous copy (instead of one short
        // copy and two fills per row: at 32 bf16 a row, the calls cost more than the bytes);
        // the few entries it wraps into, left and right of each row's valid range, are then
        // set to zero.
        let first = oh_lo * wo + ow_lo;
        let last = (oh_hi - 1) * wo + ow_hi;
        let src_first = (oh_lo + kh - p) * w + ow_lo + kw - p;
        row[first..last].copy_from_slice(&plane[src_first..src_first + (last - first)]);
        for oh in oh_lo..oh_hi {
            let out = &mut row[oh * wo..(oh + 1) * wo];
            for v in &mut out[..ow_lo] {
                *v = zero;
            }
            for v in &mut out[ow_hi..] {
                *v = zero;
            }
        }
        return;
    }
    for oh in oh_lo..oh_hi {
        let ih = oh * s + kh - p;
        let out = &mut row[oh * wo..(oh + 1) * wo];
        out[..ow_lo].fill(zero);
        out[ow_hi..].fill(zero);
        if ow_lo == ow_hi {
            continue;
        }
        let iw0 = ow_lo * s + kw - p;
        let src_row = &plane[ih * w..(ih + 1) * w];
        let out = &mut out[ow_lo..ow_hi];
        if s == 1 {
            out.copy_from_slice(&src_row[iw0..iw0 + out.len()]);
        } else {
            for (o, v) in out.iter_mut().zip(src_row[iw0..].iter().step_by(s)) {
                *o = *v;
            }
        }
    }
}

/// The adjoint of [`im2col`]: overwrites `dst [Cin, H, W]` with the sum of every column-matrix
/// entry of `col` (row stride `row_stride`) at the input position it was gathered from.
pub(super) fn col2im<A: Acc>(g: &Geom, col: &[A], row_stride: usize, dst: &mut [A]) {
    let (k, s, p, w, ho, wo) = (g.k, g.stride, g.pad, g.w, g.ho, g.wo);
    let plane_len = g.h * g.w;
    dst.fill(A::ZERO);
    for c in 0..g.cin {
        // One input plane at a time: its K² rows all land in it, and it stays in L1.
        let plane = &mut dst[c * plane_len..(c + 1) * plane_len];
        for kh in 0..k {
            let (oh_lo, oh_hi) = g.valid(kh, g.h, ho);
            for kw in 0..k {
                let (ow_lo, ow_hi) = g.valid(kw, w, wo);
                if ow_lo == ow_hi {
                    continue;
                }
                let r = (c * k + kh) * k + kw;
                let row = &col[r * row_stride..r * row_stride + ho * wo];
                for oh in oh_lo..oh_hi {
                    let ih = oh * s + kh - p;
                    let iw0 = ow_lo * s + kw - p;
                    let vals = &row[oh * wo + ow_lo..oh * wo + ow_hi];
                    let dst_row = &mut plane[ih * w..(ih + 1) * w];
                    if s == 1 {
                        for (d, v) in dst_row[iw0..iw0 + vals.len()].iter_mut().zip(vals) {
                            *d += *v;
                        }
                    } else {
                        for (d, v) in dst_row[iw0..].iter_mut().step_by(s).zip(vals) {
                            *d += *v;
                        }
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// What the passes allocate

/// The heap one pass of the op holds besides its result, as its code allocates it (the sizes
/// below are the ones the passes make their buffers with): what the memory estimate predicts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassScratch {
    /// Bytes held while the threads run: one full set of buffers per thread that gets work,
    /// with its reservation for gemm's packing ([`ThreadSets`]), what the calling thread made for
    /// all of them (a widened or transposed weight) and the weight gradient's partial sums. The
    /// forward and the input gradient allocate their result before this, the weight gradient
    /// after.
    pub section: usize,
    /// The weight gradient's bytes besides its result while that is written (the running total,
    /// and in the generic passes one transposed row); 0 for the other passes.
    pub tail: usize,
}

/// One thread's buffers of a pass: element counts in the gemm type (0 for a buffer the pass
/// does not need) and the bytes of its reservation for gemm's packing.
pub(super) struct Sets<const B: usize> {
    pub(super) lens: [usize; B],
    pub(super) reserve: usize,
}

/// One thread's buffers as the generic passes hold them (three vectors; a vector's record is the
/// same size whatever its element type, so f32 stands for every gemm type).
type SetBufs = [Vec<f32>; 3];

/// Whether `T` is its own gemm type (f32, f64): no widened copies.
fn native<T: Float>() -> bool {
    T::as_acc(&[]).is_some()
}

/// The forward's buffers: the widened image, the column matrix (none when the pointwise
/// convolution multiplies the image in place) and the widened output image.
fn forward_sets(g: &Geom, native: bool, acc: usize) -> Sets<3> {
    let (ckk, hwo) = (g.ckk(), g.hw_out());
    let ld = padded_ld(hwo, acc);
    let in_place = g.pointwise() && ld == hwo;
    let widened = |len| if native { 0 } else { len };
    let (col, rs) = if in_place { (0, hwo) } else { (ckk * ld, ld) };
    Sets {
        lens: [widened(g.in_image()), col, widened(g.out_image())],
        reserve: gemm_packing_bytes([g.cout, hwo, ckk], hwo, (ckk, 1), (rs, 1), acc),
    }
}

/// The input gradient's buffers: the widened output gradient, the column matrix (none for a
/// pointwise convolution) and the widened image.
fn grad_input_sets(g: &Geom, native: bool, acc: usize) -> Sets<3> {
    let (ckk, hwo) = (g.ckk(), g.hw_out());
    let ld = padded_ld(hwo, acc);
    let widened = |len| if native { 0 } else { len };
    let (col, dst_rs) = if g.pointwise() {
        (0, hwo)
    } else {
        (ckk * ld, ld)
    };
    Sets {
        lens: [widened(g.out_image()), col, widened(g.in_image())],
        reserve: gemm_packing_bytes([ckk, hwo, g.cout], dst_rs, (1, ckk), (hwo, 1), acc),
    }
}

/// How the weight gradient shares out its batch (see `grad_weight`), here and in
/// [`super::conv2d_bf16`].
pub(super) struct WgradPlan {
    /// Images per chunk (one gemm).
    pub(super) chunk: usize,
    /// Images per slot (a whole number of chunks; one partial sum).
    pub(super) slot_images: usize,
    pub(super) n_slots: usize,
    /// Threads that get a slot.
    pub(super) busy: usize,
    /// Partial-sum buffers ([`partial_buffers`]).
    pub(super) buffers: usize,
}

impl WgradPlan {
    /// The plan for `g` with `acc`-byte sums on `threads` threads.
    pub(super) fn new(g: &Geom, acc: usize, threads: usize) -> Self {
        let (ckk, hwo) = (g.ckk(), g.hw_out());
        let chunk = images_per_chunk(g.n, hwo, ckk * hwo * acc, threads, g.chunk);
        let n_chunks = g.n.div_ceil(chunk);
        let per_slot = chunks_per_slot(n_chunks, ckk * g.cout * acc, threads);
        let n_slots = n_chunks.div_ceil(per_slot);
        Self {
            chunk,
            slot_images: per_slot * chunk,
            n_slots,
            busy: busy_threads(n_slots, threads),
            buffers: partial_buffers(n_slots, threads),
        }
    }

    /// The images of `slot` of a batch of `n`.
    pub(super) fn slot(&self, slot: usize, n: usize) -> Range<usize> {
        slot * self.slot_images..((slot + 1) * self.slot_images).min(n)
    }

    /// The chunk sizes a batch of `n` has: chunks start at multiples of `chunk` (slots are whole
    /// numbers of chunks), so all are full but the last.
    pub(super) fn chunk_sizes(&self, n: usize) -> impl Iterator<Item = usize> {
        [self.chunk.min(n), n % self.chunk]
            .into_iter()
            .filter(|&b| b > 0)
    }
}

/// The weight gradient's buffers: the widened image, the chunk's column matrix (none for one
/// image of a pointwise f32 convolution, read in place) and the gathered output gradient (none
/// for one image in f32, read in place), each for its largest chunk.
fn grad_weight_sets(g: &Geom, native: bool, acc: usize, plan: &WgradPlan) -> Sets<3> {
    let (ckk, hwo) = (g.ckk(), g.hw_out());
    let mut sets = Sets {
        lens: [if native { 0 } else { g.in_image() }, 0, 0],
        reserve: 0,
    };
    for b in plan.chunk_sizes(g.n) {
        let ld = padded_ld(b * hwo, acc);
        let in_place = native && b == 1 && g.pointwise() && ld == hwo;
        let (col, rs) = if in_place { (0, hwo) } else { (ckk * ld, ld) };
        let (gathered, cs) = if native && b == 1 {
            (0, hwo)
        } else {
            (g.cout * b * hwo, b * hwo)
        };
        let packing = gemm_packing_bytes([ckk, g.cout, b * hwo], g.cout, (rs, 1), (1, cs), acc);
        sets.lens[1] = sets.lens[1].max(col);
        sets.lens[2] = sets.lens[2].max(gathered);
        sets.reserve = sets.reserve.max(packing);
    }
    sets
}

/// What `pass` of `g` allocates besides its result in the generic passes, for `threads` threads
/// and a storage type that is (`native`) or widens to its `acc`-byte gemm type.
pub(super) fn pass_scratch(
    pass: ConvPass,
    g: &Geom,
    native: bool,
    acc: usize,
    threads: usize,
) -> PassScratch {
    let per_set = |s: Sets<3>| s.lens.iter().sum::<usize>() * acc + s.reserve;
    let weight = if native { 0 } else { g.cout * g.ckk() * acc };
    let busy = busy_threads(g.n, threads);
    let records = ThreadSets::<SetBufs>::record_bytes;
    match pass {
        ConvPass::Forward => PassScratch {
            section: weight + busy * per_set(forward_sets(g, native, acc)) + records(busy),
            tail: 0,
        },
        ConvPass::InputGrad => PassScratch {
            section: weight + busy * per_set(grad_input_sets(g, native, acc)) + records(busy),
            tail: 0,
        },
        ConvPass::WeightGrad => {
            let plan = WgradPlan::new(g, acc, threads);
            let partial = g.ckk() * g.cout * acc;
            let sets = per_set(grad_weight_sets(g, native, acc, &plan));
            // A vector's record is the same size whatever its element type.
            let sum = OrderedSum::<f32>::record_bytes(plan.n_slots, plan.buffers);
            PassScratch {
                section: plan.buffers * partial + plan.busy * sets + records(plan.busy) + sum,
                tail: if plan.n_slots > 0 {
                    partial + g.ckk() * acc
                } else {
                    0
                },
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The three passes

/// `pass` of the convolution `g` on its two operands (`x, w`; `dy, w`; `x, dy`), for any float
/// type (half types widened to f32 per image).
pub(super) fn run<T: Float>(pass: ConvPass, g: &Geom, a: &[T], b: &[T]) -> Vec<T> {
    match pass {
        ConvPass::Forward => forward(g, a, b),
        ConvPass::InputGrad => grad_input(g, a, b),
        ConvPass::WeightGrad => grad_weight(g, a, b),
    }
}

/// `out[n] = W · col(x[n])` for every image.
fn forward<T: Float>(g: &Geom, x: &[T], w: &[T]) -> Vec<T> {
    let (ckk, hwo, in_len, out_len) = (g.ckk(), g.hw_out(), g.in_image(), g.out_image());
    let ld = padded_ld(hwo, std::mem::size_of::<T::Acc>());
    // A pointwise convolution multiplies the image itself, unless its rows need padding (then the
    // copy im2col makes is cheap next to the gemm it speeds up).
    let in_place = g.pointwise() && ld == hwo;
    let mut w_buf = Vec::new();
    let wa = widen(w, &mut w_buf);
    let lhs = Mat {
        data: wa,
        rows: g.cout,
        cols: ckk,
        rs: ckk,
        cs: 1,
    };
    let sets = forward_sets(g, native::<T>(), std::mem::size_of::<T::Acc>());
    per_image(
        g.n,
        out_len,
        sets.reserve,
        || sets.lens.map(Vec::with_capacity),
        |[img_buf, col_buf, out_buf], i, dst: &mut [T]| {
            let img = widen(&x[i * in_len..(i + 1) * in_len], img_buf);
            let rhs = if in_place {
                Mat {
                    data: img,
                    rows: ckk,
                    cols: hwo,
                    rs: hwo,
                    cs: 1,
                }
            } else {
                let col = scratch(col_buf, ckk * ld);
                im2col(g, img, col, ld);
                Mat {
                    data: col,
                    rows: ckk,
                    cols: hwo,
                    rs: ld,
                    cs: 1,
                }
            };
            match T::as_acc_mut(dst) {
                Some(d) => matmul(d, hwo, false, lhs, rhs),
                None => {
                    let d = scratch(out_buf, out_len);
                    matmul(d, hwo, false, lhs, rhs);
                    T::narrow(d, dst);
                }
            }
        },
    )
}

/// `dx[n] = col2im(Wᵀ · grad[n])` for every image.
fn grad_input<T: Float>(g: &Geom, grad: &[T], w: &[T]) -> Vec<T> {
    let (ckk, hwo, in_len, out_len) = (g.ckk(), g.hw_out(), g.in_image(), g.out_image());
    let ld = padded_ld(hwo, std::mem::size_of::<T::Acc>());
    let mut w_buf = Vec::new();
    let wa = widen(w, &mut w_buf);
    // Wᵀ as a strided view of W [Cout, Cin·K·K]; gemm packs it, so no transposed copy is needed.
    let lhs = Mat {
        data: wa,
        rows: ckk,
        cols: g.cout,
        rs: 1,
        cs: ckk,
    };
    let sets = grad_input_sets(g, native::<T>(), std::mem::size_of::<T::Acc>());
    per_image(
        g.n,
        in_len,
        sets.reserve,
        || sets.lens.map(Vec::with_capacity),
        |[grad_buf, col_buf, img_buf], i, dst: &mut [T]| {
            let gi = widen(&grad[i * out_len..(i + 1) * out_len], grad_buf);
            let rhs = Mat {
                data: gi,
                rows: g.cout,
                cols: hwo,
                rs: hwo,
                cs: 1,
            };
            let mut to_image = |d: &mut [T::Acc]| {
                if g.pointwise() {
                    matmul(d, hwo, false, lhs, rhs);
                } else {
                    let col = scratch(col_buf, ckk * ld);
                    matmul(col, ld, false, lhs, rhs);
                    col2im(g, col, ld, d);
                }
            };
            match T::as_acc_mut(dst) {
                Some(d) => to_image(d),
                None => {
                    let d = scratch(img_buf, in_len);
                    to_image(d);
                    T::narrow(d, dst);
                }
            }
        },
    )
}

/// Bytes of weight-gradient partial sums the slot count allows (see [`chunks_per_slot`]).
const PARTIAL_SUM_BYTES: usize = 4 << 20;

/// The fewest weight-gradient slots per thread (see [`chunks_per_slot`]).
const MIN_SLOTS_PER_THREAD: usize = 4;

/// Chunks per weight-gradient slot for `n_chunks` chunks and a `partial_bytes` partial sum.
///
/// Slots are the unit the threads share out, so more of them let a thread that falls behind (a
/// shared 2-core machine) be covered by the others; each costs one weight-sized add, which is
/// negligible next to its gemms (measured: no difference on one thread between 4 slots and one per
/// chunk). So there are as many slots as fit in [`PARTIAL_SUM_BYTES`] — one per chunk for small
/// weights — but at least [`MIN_SLOTS_PER_THREAD`] per thread, and at most one per chunk. (That
/// bound dates from when a slot waiting for an earlier one held a buffer of its own; the buffers
/// are now a fixed few, [`partial_buffers`], but the slot count decides how the sum is grouped,
/// so it stays as it was.)
pub(super) fn chunks_per_slot(n_chunks: usize, partial_bytes: usize, threads: usize) -> usize {
    let slots =
        (PARTIAL_SUM_BYTES / partial_bytes.max(1)).max(MIN_SLOTS_PER_THREAD * threads.max(1));
    n_chunks.div_ceil(slots).max(1)
}

/// `dW = Σₙ grad[n] · col(x[n])ᵀ`, over chunks of images per gemm, summed in a fixed order.
///
/// Each gemm adds one chunk's `dWᵀ = col · gradᵀ` (`[Cin·K·K, Cout]`) and the sum is transposed once
/// at the end: with the long `Cin·K·K` side as the gemm's rows this runs at 110-117 GFLOP/s where
/// `grad · colᵀ` manages 73-97 (measured per image on the default net's layers).
///
/// Determinism: the batch is cut into chunks of `chunk` images (boundaries at multiples of
/// `chunk`), and runs of consecutive chunks form slots ([`chunks_per_slot`]). A slot's chunks are
/// accumulated in order into the slot's own buffer, and the slots' sums are added in slot order
/// ([`OrderedSum`]); threads only decide who computes a slot, never the order of any addition.
/// So for a given batch size, chunk size and thread count the result is the same bits on every
/// run. (The chunk size is chosen from the thread count unless forced, and so is the slot
/// count, so a different thread count may round differently.)
///
/// Memory ([`pass_scratch`]): the partial-sum buffers ([`partial_buffers`]) and one full set of
/// buffers per busy thread ([`ThreadSets`]) are made before the threads start, so what the pass
/// holds does not depend on how they are scheduled; the sum is finished (its other buffers
/// freed) before the result is allocated.
fn grad_weight<T: Float>(g: &Geom, x: &[T], grad: &[T]) -> Vec<T> {
    let ckk = g.ckk();
    let acc_bytes = std::mem::size_of::<T::Acc>();
    let plan = WgradPlan::new(g, acc_bytes, num_threads());
    let sum = OrderedSum::<T::Acc>::new(plan.n_slots, ckk * g.cout, plan.buffers);
    let lens = grad_weight_sets(g, native::<T>(), acc_bytes, &plan);
    let sets = ThreadSets::new(plan.busy, lens.reserve, || {
        lens.lens.map(Vec::with_capacity)
    });
    par_chunks(plan.n_slots, 1, |slots| {
        let _guard = sum.guard();
        let mut set = None;
        while let Some(mut acc) = sum.buffer() {
            let Some(slot) = slots.next().map(|r| r.start) else {
                sum.give_back(acc);
                break;
            };
            let [img_buf, col_buf, grad_buf] = set.get_or_insert_with(|| sets.take());
            let images = plan.slot(slot, g.n);
            for (c, first) in images.clone().step_by(plan.chunk).enumerate() {
                let range = first..(first + plan.chunk).min(images.end);
                // The slot's first chunk overwrites the (reused) buffer, the others add to it.
                let bufs = [&mut *img_buf, &mut *col_buf, &mut *grad_buf];
                grad_weight_chunk(g, x, grad, range, c > 0, &mut acc, bufs);
            }
            sum.add(slot, acc);
        }
    });
    drop(sets);
    let total = sum.total();
    let mut dw = vec![T::ZERO; g.cout * ckk];
    if let Some(total) = total {
        // [Cin·K·K, Cout] -> [Cout, Cin·K·K], one output channel (row of dW) at a time.
        let mut row = vec![T::Acc::ZERO; ckk];
        for (co, dst) in dw.chunks_exact_mut(ckk).enumerate() {
            for (r, v) in row.iter_mut().enumerate() {
                *v = total[r * g.cout + co];
            }
            T::narrow(&row, dst);
        }
    }
    dw
}

/// One chunk of the weight gradient: the images `range` multiplied into `acc` (`dWᵀ`, added to
/// it with `accumulate`), with the thread's buffers `[widened image, columns, gathered gradient]`.
fn grad_weight_chunk<T: Float>(
    g: &Geom,
    x: &[T],
    grad: &[T],
    range: Range<usize>,
    accumulate: bool,
    acc: &mut [T::Acc],
    [img_buf, col_buf, grad_buf]: [&mut Vec<T::Acc>; 3],
) {
    let (ckk, hwo, in_len, out_len) = (g.ckk(), g.hw_out(), g.in_image(), g.out_image());
    let acc_bytes = std::mem::size_of::<T::Acc>();
    let first = range.start;
    let b = range.len();
    // The chunk's pixels side by side: the gemm's inner dimension is b·Ho·Wo.
    let kdim = b * hwo;
    let ld = padded_ld(kdim, acc_bytes);
    let x0 = &x[first * in_len..(first + 1) * in_len];
    let lhs = match T::as_acc(x0) {
        Some(img) if b == 1 && g.pointwise() && ld == hwo => Mat {
            data: img,
            rows: ckk,
            cols: kdim,
            rs: hwo,
            cs: 1,
        },
        _ => {
            let col = scratch(col_buf, ckk * ld);
            for (j, i) in range.clone().enumerate() {
                let img = widen(&x[i * in_len..(i + 1) * in_len], img_buf);
                im2col(g, img, &mut col[j * hwo..], ld);
            }
            Mat {
                data: col,
                rows: ckk,
                cols: kdim,
                rs: ld,
                cs: 1,
            }
        }
    };
    let g0 = &grad[first * out_len..(first + 1) * out_len];
    // gradᵀ: pixel-major rows, one column per output channel.
    let rhs = match T::as_acc(g0) {
        Some(gi) if b == 1 => Mat {
            data: gi,
            rows: kdim,
            cols: g.cout,
            rs: 1,
            cs: hwo,
        },
        _ => {
            // Gather [b, Cout, Ho·Wo] into [Cout, b·Ho·Wo] (widening on the way).
            let gm = scratch(grad_buf, g.cout * kdim);
            for (j, i) in range.clone().enumerate() {
                let gi = &grad[i * out_len..(i + 1) * out_len];
                for co in 0..g.cout {
                    let start = co * kdim + j * hwo;
                    T::widen(&gi[co * hwo..(co + 1) * hwo], &mut gm[start..start + hwo]);
                }
            }
            Mat {
                data: gm,
                rows: kdim,
                cols: g.cout,
                rs: 1,
                cs: kdim,
            }
        }
    };
    matmul(acc, g.cout, accumulate, lhs, rhs);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every im2col row against its definition, on the one-copy path (stride 1, output rows as
    /// wide as the input's: same padding, including a pad wider than the kernel's reach and
    /// images narrower than the kernel) and on the row-by-row one.
    #[test]
    fn im2col_rows_match_brute_force() {
        for (h, w, k, s, p) in [
            (5, 7, 3, 1, 1),
            (4, 4, 5, 1, 2),
            (6, 3, 1, 1, 0),
            (2, 2, 3, 1, 1),
            (1, 1, 3, 1, 1),
            (5, 6, 3, 1, 0),
            (6, 5, 3, 2, 1),
            (3, 4, 5, 1, 3),
        ] {
            let cin = 2;
            let g = Geom::new(&[1, cin, h, w], &[1, cin, k, k], s, p, None).unwrap();
            let src: Vec<f32> = (0..cin * h * w).map(|i| i as f32 + 1.0).collect();
            let mut row = vec![f32::NAN; g.ho * g.wo];
            for r in 0..g.ckk() {
                let (c, kh, kw) = (r / (k * k), (r / k) % k, r % k);
                im2col_row(&g, &src, r, &mut row);
                for oh in 0..g.ho {
                    for ow in 0..g.wo {
                        let ih = (oh * s + kh) as isize - p as isize;
                        let iw = (ow * s + kw) as isize - p as isize;
                        let inside = (0..h as isize).contains(&ih) && (0..w as isize).contains(&iw);
                        let want = if inside {
                            src[c * h * w + ih as usize * w + iw as usize]
                        } else {
                            0.0
                        };
                        assert_eq!(
                            row[oh * g.wo + ow].to_bits(),
                            want.to_bits(),
                            "h{h} w{w} k{k} s{s} p{p} r{r} ({oh}, {ow})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn chunk_sizing_is_bounded_and_balanced() {
        // 8×8 maps: four images make the 256-pixel gemm depth.
        assert_eq!(images_per_chunk(128, 64, 64 << 10, 2, None), 4);
        // 32×32 maps: one image is deep enough.
        assert_eq!(images_per_chunk(128, 1024, 1 << 20, 2, None), 1);
        // 2×2 maps want 128 images, but a 10-image batch is still split over both threads...
        assert_eq!(images_per_chunk(10, 4, 1024, 2, None), 5);
        // ...and the budget caps the chunk.
        assert_eq!(images_per_chunk(1000, 4, 1 << 20, 2, None), 2);
        // An image bigger than a thread's share still gets a chunk of its own.
        assert_eq!(images_per_chunk(128, 1, 8 << 20, 2, None), 1);
        assert_eq!(images_per_chunk(3, 1, 1, 2, Some(7)), 3);
    }

    #[test]
    fn slots_are_many_for_small_weights_and_bounded_for_large_ones() {
        // Default net at batch 128 on 2 threads: 32→32 (36 KiB partials, 128 chunks of one
        // image) gets 64 slots of 2 images; 128→128 (576 KiB, 32 chunks of 4) gets 8 slots of 4.
        assert_eq!(chunks_per_slot(128, 288 * 32 * 4, 2), 2);
        assert_eq!(chunks_per_slot(100, 288 * 32 * 4, 2), 1);
        assert_eq!(chunks_per_slot(32, 1152 * 128 * 4, 2), 4);
        // Huge weights still get 4 slots per thread; tiny batches one slot per chunk.
        assert_eq!(chunks_per_slot(64, 64 << 20, 4), 4);
        assert_eq!(chunks_per_slot(3, 64 << 20, 2), 1);
        assert_eq!(chunks_per_slot(0, 1024, 2), 1);
    }

    #[test]
    fn ordered_sum_adds_in_slot_order_whatever_the_arrival_order() {
        // 1e8 + 1 − 1e8 and similar: in f32 the grouping decides the result.
        let values = [1e8f32, 1.0, -1e8, 1.0, 3.0];
        let expected = (((values[0] + values[1]) + values[2]) + values[3]) + values[4];
        for order in [
            [0, 1, 2, 3, 4],
            [4, 3, 2, 1, 0],
            [2, 0, 4, 1, 3],
            [1, 2, 3, 4, 0],
        ] {
            // One buffer per slot: arrivals in any order never wait for one.
            let sum = OrderedSum::<f32>::new(values.len(), 2, values.len());
            for slot in order {
                let mut buf = sum.buffer().expect("a buffer while slots remain");
                buf.fill(values[slot]);
                sum.add(slot, buf);
            }
            let total = sum.total().unwrap();
            assert_eq!(total, vec![expected; 2], "arrival order {order:?}");
        }
        assert!(OrderedSum::<f32>::new(0, 2, 3).total().is_none());
    }

    #[test]
    fn padding_avoids_2kib_strides() {
        assert_eq!(padded_ld(1024, 4), 1040);
        assert_eq!(padded_ld(512, 4), 528);
        assert_eq!(padded_ld(256, 8), 264);
        assert_eq!(padded_ld(256, 4), 256);
        assert_eq!(padded_ld(64, 4), 64);
        assert_eq!(padded_ld(0, 4), 0);
    }
}
