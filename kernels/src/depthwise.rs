//! Depthwise 2D convolution (`groups == channels`, one `K×K` filter per channel) as a Candle
//! custom op with its own CPU and CUDA forward and backward kernels.
//!
//! Why not `Tensor::conv2d(.., groups = C)`: Candle splits a grouped convolution into one
//! convolution per group plus a `cat`, and its backward builds full-size zero-padded tensors per
//! group, so a depthwise layer costs O(C) kernel launches and O(C²) work and memory. Here the
//! forward, the input gradient and the weight gradient are each a single pass over the data.
//!
//! One op type carries all three passes ([`ConvPass`], as `conv2d`'s op does); the kernel checks
//! and the output size are the ones `conv2d` makes ([`super::geom::window`]), and dtype dispatch
//! and operand access go through [`super::util`].
//!
//! Layout of the CPU kernels: every `(n, c)` plane is copied once (converted to `f32`) into a
//! zero-padded scratch plane whose rows are split into `stride` phases (column `x` of a padded row
//! lives in phase `x % stride` at index `x / stride`). With that layout, the input columns one
//! kernel tap reads for a whole output row are a *contiguous* slice for any stride, so every hot
//! loop is a plain `a[i] += w * b[i]` over slices, which the compiler vectorises. The CUDA kernels
//! are in `cu/depthwise.cu`.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Error, Layout, Result, Shape, Tensor, WithDType};

use super::geom::{conv_backward, window, ConvPass};
use super::util::{cpu_slice, dispatch_float};

/// Depthwise 2D convolution: x `[N, C, H, W]`, w `[C, 1, K, K]` (groups = C, no bias), square stride and padding.
/// Differentiable w.r.t. both x and w. Output `[N, C, Ho, Wo]` with Ho = (H + 2p - K)/s + 1.
///
/// Equivalent to `x.conv2d(w, padding, stride, 1, C)` but computed by dedicated kernels (CPU, and
/// CUDA with the `cuda` feature) in one pass, forward and backward. Supported dtypes: `f32`, `f16`
/// and `bf16` (half types accumulate in `f32`). Inputs of any layout are accepted (they are made
/// contiguous first; that copy is part of the autograd graph).
///
/// # Errors
/// An error when the shapes do not describe a depthwise convolution (wrong rank,
/// `w.dim(0) != C`, `w.dim(1) != 1`, non-square kernel, kernel larger than the padded input, a
/// zero-sized dimension, `stride == 0`), when the dtypes differ or are not floating point types
/// listed above, when the tensors live on different devices, or when the device kernel fails.
pub fn depthwise_conv2d(x: &Tensor, w: &Tensor, stride: usize, padding: usize) -> Result<Tensor> {
    if x.dtype() != w.dtype() {
        return Err(op_error(format!(
            "x has dtype {:?} but w has dtype {:?}; both must be the same",
            x.dtype(),
            w.dtype()
        )));
    }
    check_dtype(x.dtype()).map_err(op_error)?;
    if !x.device().same_device(w.device()) {
        return Err(op_error(format!(
            "x is on {:?} but w is on {:?}",
            x.device().location(),
            w.device().location()
        )));
    }
    let g = Geometry::new(x.dims(), w.dims(), stride, padding).map_err(op_error)?;
    // The kernels read plain row-major planes; `contiguous` is a no-op (same tensor) when the
    // input already is, and a differentiable copy otherwise.
    let x = x.contiguous()?;
    let w = w.contiguous()?;
    x.apply_op2(&w, Depthwise::new(g, ConvPass::Forward))
}

/// The input gradient of [`depthwise_conv2d`] from the output gradient `grad` and `w`, for an
/// input of shape `x_dims`; no autograd (the lean step calls the backward passes itself).
///
/// # Errors
/// As [`depthwise_conv2d`], and when `grad` does not have the output's shape.
pub fn depthwise_backward_input(
    grad: &Tensor,
    w: &Tensor,
    x_dims: &[usize],
    stride: usize,
    padding: usize,
) -> Result<Tensor> {
    check_dtype(grad.dtype()).map_err(op_error)?;
    let g = Geometry::new(x_dims, w.dims(), stride, padding).map_err(op_error)?;
    let grad = grad.to_dtype(w.dtype())?.contiguous()?;
    grad.apply_op2_no_bwd(&w.contiguous()?, &Depthwise::new(g, ConvPass::InputGrad))
}

/// The weight gradient of [`depthwise_conv2d`] from its input `x` and the output gradient
/// `grad`, for a weight of shape `w_dims`, in x's dtype; no autograd.
///
/// # Errors
/// As [`depthwise_backward_input`].
pub fn depthwise_backward_weight(
    x: &Tensor,
    grad: &Tensor,
    w_dims: &[usize],
    stride: usize,
    padding: usize,
) -> Result<Tensor> {
    check_dtype(x.dtype()).map_err(op_error)?;
    let g = Geometry::new(x.dims(), w_dims, stride, padding).map_err(op_error)?;
    let grad = grad.to_dtype(x.dtype())?.contiguous()?;
    x.contiguous()?
        .apply_op2_no_bwd(&grad, &Depthwise::new(g, ConvPass::WeightGrad))
}

/// The name of the op in errors.
const OP: &str = "depthwise_conv2d";

fn op_error(msg: String) -> Error {
    Error::Msg(format!("{OP}: {msg}"))
}

fn check_dtype(dtype: DType) -> std::result::Result<(), String> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => Ok(()),
        other => Err(format!(
            "unsupported dtype {other:?} (expected F32, F16 or BF16)"
        )),
    }
}

/// Sizes of one depthwise convolution, validated once and shared by all three kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    n: usize,
    c: usize,
    height: usize,
    width: usize,
    k: usize,
    stride: usize,
    pad: usize,
    out_h: usize,
    out_w: usize,
}

impl Geometry {
    /// Validates `x: [N,C,H,W]` and `w: [C,1,K,K]` and derives the output size.
    fn new(
        x: &[usize],
        w: &[usize],
        stride: usize,
        pad: usize,
    ) -> std::result::Result<Self, String> {
        let &[n, c, height, width] = x else {
            return Err(format!("x must have shape [N, C, H, W], got {x:?}"));
        };
        let &[wc, one, kh, kw] = w else {
            return Err(format!("w must have shape [C, 1, K, K], got {w:?}"));
        };
        if n == 0 || c == 0 || height == 0 || width == 0 {
            return Err(format!("x has a zero-sized dimension: {x:?}"));
        }
        if wc != c {
            return Err(format!(
                "w has {wc} filters but x has {c} channels (w must be [C, 1, K, K] = [{c}, 1, K, K], got {w:?})"
            ));
        }
        if one != 1 {
            return Err(format!(
                "w must have one input channel per filter (depthwise, [C, 1, K, K]), got {w:?}"
            ));
        }
        let (k, out_h, out_w) = window(height, width, kh, kw, stride, pad)?;
        Ok(Self {
            n,
            c,
            height,
            width,
            k,
            stride,
            pad,
            out_h,
            out_w,
        })
    }

    fn x_dims(&self) -> [usize; 4] {
        [self.n, self.c, self.height, self.width]
    }

    fn w_dims(&self) -> [usize; 4] {
        [self.c, 1, self.k, self.k]
    }

    fn y_dims(&self) -> [usize; 4] {
        [self.n, self.c, self.out_h, self.out_w]
    }

    /// The shapes of `pass`'s two operands, each with its name for error messages.
    fn operands(&self, pass: ConvPass) -> [([usize; 4], &'static str); 2] {
        pass.operands(
            (self.x_dims(), "x"),
            (self.w_dims(), "w"),
            (self.y_dims(), "the output gradient"),
        )
    }

    /// The shape of `pass`'s result.
    fn result_dims(&self, pass: ConvPass) -> [usize; 4] {
        pass.result(self.x_dims(), self.w_dims(), self.y_dims())
    }

    fn planes(&self) -> usize {
        self.n * self.c
    }

    fn in_plane(&self) -> usize {
        self.height * self.width
    }

    fn out_plane(&self) -> usize {
        self.out_h * self.out_w
    }

    fn taps(&self) -> usize {
        self.k * self.k
    }

    /// Multiply-adds per `(n, c)` plane, the unit of work handed to threads.
    fn macs_per_plane(&self) -> usize {
        self.out_plane() * self.taps()
    }
}

/// One pass of the depthwise convolution `g` as a Candle op: the forward `(x [N,C,H,W],
/// w [C,1,K,K]) -> y [N,C,Ho,Wo]` (whose `bwd` applies the other two), the input gradient
/// `(dy, w) -> dx` or the weight gradient `(x, dy) -> dw`, reduced over N, Ho, Wo.
struct Depthwise {
    g: Geometry,
    pass: ConvPass,
}

impl Depthwise {
    fn new(g: Geometry, pass: ConvPass) -> Self {
        Depthwise { g, pass }
    }

    /// The operands have the shapes the geometry was validated with.
    fn check(&self, l1: &Layout, l2: &Layout) -> candle_core::Result<()> {
        let [(d1, what1), (d2, what2)] = self.g.operands(self.pass);
        ConvPass::check(OP, [(&d1, what1), (&d2, what2)], l1, l2)
    }

    fn result_shape(&self) -> Shape {
        Shape::from(self.g.result_dims(self.pass).to_vec())
    }
}

impl CustomOp2 for Depthwise {
    fn name(&self) -> &'static str {
        self.pass.name([
            "depthwise-conv2d",
            "depthwise-conv2d-input-grad",
            "depthwise-conv2d-weight-grad",
        ])
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.check(l1, l2)?;
        let [(_, what1), (_, what2)] = self.g.operands(self.pass);
        let out = dispatch_float!(
            s1.dtype(),
            [F32, F16, BF16],
            |T| {
                let a = cpu_slice::<T>(s1, l1, OP, what1)?;
                let b = cpu_slice::<T>(s2, l2, OP, what2)?;
                T::to_cpu_storage_owned(cpu::run(self.pass, &self.g, a, b))
            },
            |dt| candle_core::bail!("{OP}: unsupported dtype {dt:?} (expected F32, F16 or BF16)")
        );
        Ok((out, self.result_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.check(l1, l2)?;
        let out = cuda::launch(self.pass, &self.g, s1, l1, s2, l2)?;
        Ok((out, self.result_shape()))
    }

    /// Only the forward has a backward; a gradient nobody asked for (of an untracked `x` or
    /// `w`) is skipped: it would cost a full buffer and a kernel for nothing.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        conv_backward(self.pass, self.name(), x, w, grad_res, true, |pass| {
            Depthwise::new(self.g, pass)
        })
    }
}

mod cpu {
    //! The CPU kernels. Each works on whole `(n, c)` planes, in `f32`, and threads split the
    //! planes into contiguous chunks.

    use std::mem::MaybeUninit;
    use std::sync::Mutex;

    use super::{ConvPass, Geometry};
    use crate::util::Float;

    /// Below this many multiply-adds, handing work to another thread costs more than it saves.
    const MIN_MACS_PER_CHUNK: usize = 1 << 15;

    /// Chunks per worker: enough for the shared cursor to even out uneven progress.
    const CHUNKS_PER_THREAD: usize = 4;

    /// The three kernels' entry point: `pass` on its two operands (`x, w`; `dy, w`; `x, dy`).
    pub(super) fn run<T: Float>(pass: ConvPass, g: &Geometry, a: &[T], b: &[T]) -> Vec<T> {
        match pass {
            ConvPass::Forward => forward(g, a, b),
            ConvPass::InputGrad => input_grad(g, a, b),
            ConvPass::WeightGrad => weight_grad(g, a, b),
        }
    }

    /// One chunk of planes waiting for a worker: its first plane's index and its elements.
    type ChunkSlot<'a, T> = Mutex<Option<(usize, &'a mut [T])>>;

    /// Splits `out` (a whole number of `plane_len`-element planes) into chunks of whole planes
    /// and calls `work(first_plane_index, chunk)` once per chunk, on Candle's persistent CPU
    /// worker pool ([`candle_core::utils::barrier_pool`], sized like Candle's own CPU ops:
    /// `CANDLE_NUM_THREADS` / `RAYON_NUM_THREADS` / the core count). A persistent pool matters:
    /// freshly spawned threads were seen to start late enough that two of them ran one after
    /// the other. Workers take chunks from a shared cursor, so a descheduled worker's share is
    /// picked up by the others; small calls run inline on the calling thread.
    fn parallel_planes<T: Send>(
        out: &mut [T],
        plane_len: usize,
        macs_per_plane: usize,
        work: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let planes = out.len().checked_div(plane_len).unwrap_or(0);
        let max_chunks = (planes * macs_per_plane / MIN_MACS_PER_CHUNK).min(planes);
        let pool = candle_core::utils::barrier_pool();
        let threads = pool.n_workers() + 1;
        if threads == 1 || max_chunks < 2 {
            work(0, out);
            return;
        }
        let per_chunk = planes.div_ceil((threads * CHUNKS_PER_THREAD).min(max_chunks));
        // Each chunk sits in its own slot and is taken exactly once, which hands out the
        // disjoint `&mut` sub-slices without unsafe code.
        let chunks: Vec<ChunkSlot<'_, T>> = out
            .chunks_mut(per_chunk * plane_len)
            .enumerate()
            .map(|(i, chunk)| Mutex::new(Some((i * per_chunk, chunk))))
            .collect();
        pool.execute_chunked(chunks.len(), |range| {
            for slot in &chunks[range] {
                let taken = slot.lock().map(|mut s| s.take()).ok().flatten();
                if let Some((first, chunk)) = taken {
                    work(first, chunk);
                }
            }
        });
    }

    /// A zero-padded `f32` copy of one input plane, each padded row split into `stride` phases.
    ///
    /// Padded column `x` of padded row `y` is at `y * row_len + (x % s) * phase_len + x / s`, so
    /// the columns `kx, kx + s, kx + 2s, ...` that tap `kx` reads along an output row are
    /// contiguous, starting at [`Padded::tap`].
    struct Padded {
        g: Geometry,
        phase_len: usize,
        row_len: usize,
        buf: Vec<f32>,
    }

    impl Padded {
        fn new(g: &Geometry) -> Self {
            let padded_h = g.height + 2 * g.pad;
            let phase_len = (g.width + 2 * g.pad).div_ceil(g.stride);
            let row_len = phase_len * g.stride;
            Self {
                g: *g,
                phase_len,
                row_len,
                buf: vec![0.0; padded_h * row_len],
            }
        }

        /// Index of the first element tap column `kx` reads in padded row `y`; the next
        /// `out_w` elements are what it reads for output columns `0..out_w`.
        #[inline(always)]
        fn tap(&self, y: usize, kx: usize) -> usize {
            y * self.row_len + (kx % self.g.stride) * self.phase_len + kx / self.g.stride
        }

        /// For phase `r`: the first input column that lands in it and its index there.
        #[inline(always)]
        fn phase_start(&self, r: usize) -> (usize, usize) {
            let s = self.g.stride;
            let first_col = (r + s - self.g.pad % s) % s;
            (first_col, (first_col + self.g.pad) / s)
        }

        /// Writes one input plane into the interior; the padding stays as it is (zero, since
        /// loads only ever touch the interior and `input_grad` re-zeroes what it accumulates).
        fn load<T: Float>(&mut self, plane: &[T]) {
            let (w, pad, s) = (self.g.width, self.g.pad, self.g.stride);
            for (iy, src) in plane.chunks_exact(w).enumerate() {
                let base = (iy + pad) * self.row_len;
                if s == 1 {
                    let dst = &mut self.buf[base + pad..base + pad + w];
                    for (d, &v) in dst.iter_mut().zip(src) {
                        *d = v.to_f32();
                    }
                } else {
                    for r in 0..s {
                        let (col0, j0) = self.phase_start(r);
                        let start = base + r * self.phase_len + j0;
                        let dst = &mut self.buf[start..base + (r + 1) * self.phase_len];
                        for (d, &v) in dst.iter_mut().zip(src.iter().skip(col0).step_by(s)) {
                            *d = v.to_f32();
                        }
                    }
                }
            }
        }

        /// Reads the interior back into an input-shaped plane (the inverse of `load`).
        fn store<T: Float>(&self, plane: &mut [MaybeUninit<T>]) {
            let (w, pad, s) = (self.g.width, self.g.pad, self.g.stride);
            for (iy, dst) in plane.chunks_exact_mut(w).enumerate() {
                let base = (iy + pad) * self.row_len;
                if s == 1 {
                    let src = &self.buf[base + pad..base + pad + w];
                    for (d, &v) in dst.iter_mut().zip(src) {
                        d.write(T::from_f32(v));
                    }
                } else {
                    // Phase `r` holds input columns col0, col0 + s, ...; together the phases
                    // cover every column, so the whole plane is written.
                    for r in 0..s {
                        let (col0, j0) = self.phase_start(r);
                        let start = base + r * self.phase_len + j0;
                        let src = &self.buf[start..base + (r + 1) * self.phase_len];
                        for (d, &v) in dst.iter_mut().skip(col0).step_by(s).zip(src) {
                            d.write(T::from_f32(v));
                        }
                    }
                }
            }
        }
    }

    /// A `len`-element vector that `fill` initialises completely, without first zeroing it: the
    /// kernels write every output element anyway, and zeroing a multi-megabyte output is a
    /// full extra pass over memory (plus, once the allocator reuses freed memory, a `memset`).
    fn uninit_vec<T: Float>(len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Vec<T> {
        let mut v: Vec<MaybeUninit<T>> = Vec::with_capacity(len);
        // SAFETY: `MaybeUninit` elements need no initialisation.
        unsafe { v.set_len(len) };
        fill(&mut v);
        let mut v = std::mem::ManuallyDrop::new(v);
        // SAFETY: each caller's `fill` writes every element (its loops cover every plane, row
        // and column of the output), `MaybeUninit<T>` has the layout of `T`, and the pointer,
        // length and capacity come from a live `Vec` that is not dropped.
        unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<T>(), v.len(), v.capacity()) }
    }

    /// `acc[i] += scale * src[i]`, the one inner loop of forward and input gradient.
    #[inline(always)]
    fn axpy(acc: &mut [f32], scale: f32, src: &[f32]) {
        for (a, &v) in acc.iter_mut().zip(src) {
            *a += scale * v;
        }
    }

    fn to_f32_row<T: Float>(dst: &mut [f32], src: &[T]) {
        for (d, &v) in dst.iter_mut().zip(src) {
            *d = v.to_f32();
        }
    }

    fn weights_f32<T: Float>(w: &[T]) -> Vec<f32> {
        w.iter().map(|v| v.to_f32()).collect()
    }

    /// `y = depthwise(x, w)`.
    fn forward<T: Float>(g: &Geometry, x: &[T], w: &[T]) -> Vec<T> {
        let (k, s, out_w) = (g.k, g.stride, g.out_w);
        let (in_plane, out_plane) = (g.in_plane(), g.out_plane());
        let wf = weights_f32(w);
        uninit_vec(g.planes() * out_plane, |y| {
            parallel_planes(y, out_plane, g.macs_per_plane(), |first, chunk| {
                let mut padded = Padded::new(g);
                let mut acc = vec![0f32; out_w];
                for (i, y_plane) in chunk.chunks_exact_mut(out_plane).enumerate() {
                    let p = first + i;
                    padded.load(&x[p * in_plane..(p + 1) * in_plane]);
                    let wk = &wf[(p % g.c) * k * k..][..k * k];
                    for (oy, y_row) in y_plane.chunks_exact_mut(out_w).enumerate() {
                        acc.fill(0.0);
                        for ky in 0..k {
                            for kx in 0..k {
                                let at = padded.tap(oy * s + ky, kx);
                                axpy(&mut acc, wk[ky * k + kx], &padded.buf[at..at + out_w]);
                            }
                        }
                        for (o, &a) in y_row.iter_mut().zip(&acc) {
                            o.write(T::from_f32(a));
                        }
                    }
                }
            })
        })
    }

    /// `dx[n,c,iy,ix] = sum over taps hitting (iy, ix) of w[c,ky,kx] * dy[n,c,oy,ox]`. For
    /// stride 1 a forward convolution with rotated filters; otherwise computed by scattering each
    /// output-gradient row into the padded phase layout (the transpose of the forward gather)
    /// and then dropping the padding.
    fn input_grad<T: Float>(g: &Geometry, dy: &[T], w: &[T]) -> Vec<T> {
        if g.stride == 1 && g.pad < g.k {
            // With stride 1 the input gradient is itself a depthwise convolution: of dy,
            // padded by K-1-p, with each filter rotated 180°. The forward kernel's gather
            // is faster than the scatter below (no accumulation buffer to clear, and each
            // output row is written once from a small accumulator).
            let transposed = Geometry {
                height: g.out_h,
                width: g.out_w,
                pad: g.k - 1 - g.pad,
                out_h: g.height,
                out_w: g.width,
                ..*g
            };
            // Reversing a filter's K*K row-major taps flips both axes.
            let rotated: Vec<T> = w
                .chunks_exact(g.taps())
                .flat_map(|taps| taps.iter().rev().copied())
                .collect();
            return forward(&transposed, dy, &rotated);
        }
        let (k, s, out_w) = (g.k, g.stride, g.out_w);
        let (in_plane, out_plane) = (g.in_plane(), g.out_plane());
        let wf = weights_f32(w);
        uninit_vec(g.planes() * in_plane, |dx| {
            parallel_planes(dx, in_plane, g.macs_per_plane(), |first, chunk| {
                let mut padded = Padded::new(g);
                let mut dy_f32 = vec![0f32; out_plane];
                for (i, dx_plane) in chunk.chunks_exact_mut(in_plane).enumerate() {
                    let p = first + i;
                    padded.buf.fill(0.0);
                    let wk = &wf[(p % g.c) * k * k..][..k * k];
                    to_f32_row(&mut dy_f32, &dy[p * out_plane..(p + 1) * out_plane]);
                    // `kx` outermost: taps `kx` and `kx + 1` update overlapping ranges shifted by
                    // one element, and reading back a just-stored, differently aligned range
                    // stalls store-to-load forwarding (this order was ~3x faster than ky, kx
                    // innermost). Within one `kx` the updates stay aligned.
                    for kx in 0..k {
                        for (oy, row) in dy_f32.chunks_exact(out_w).enumerate() {
                            for ky in 0..k {
                                let at = padded.tap(oy * s + ky, kx);
                                axpy(&mut padded.buf[at..at + out_w], wk[ky * k + kx], row);
                            }
                        }
                    }
                    padded.store(dx_plane);
                }
            })
        })
    }

    /// `dw[c,ky,kx] = sum over n, oy, ox of dy[n,c,oy,ox] * xpad[n,c,oy*s+ky,ox*s+kx]`.
    ///
    /// Each plane keeps one `out_w`-wide accumulator row per tap (elementwise multiply-adds
    /// vectorise; a dot product per row would not, as float sums are not reassociated), sums it
    /// once per plane into a per-plane partial, and the partials are then summed over `n`.
    fn weight_grad<T: Float>(g: &Geometry, x: &[T], dy: &[T]) -> Vec<T> {
        let (k, s, out_w, taps) = (g.k, g.stride, g.out_w, g.taps());
        let (in_plane, out_plane) = (g.in_plane(), g.out_plane());
        let mut partial = vec![0f32; g.planes() * taps];
        parallel_planes(&mut partial, taps, g.macs_per_plane(), |first, chunk| {
            let mut padded = Padded::new(g);
            let mut row = vec![0f32; out_w];
            let mut acc = vec![0f32; taps * out_w];
            for (i, part) in chunk.chunks_exact_mut(taps).enumerate() {
                let p = first + i;
                padded.load(&x[p * in_plane..(p + 1) * in_plane]);
                acc.fill(0.0);
                let dy_plane = &dy[p * out_plane..(p + 1) * out_plane];
                for (oy, dy_row) in dy_plane.chunks_exact(out_w).enumerate() {
                    to_f32_row(&mut row, dy_row);
                    for (ky, acc_ky) in acc.chunks_exact_mut(k * out_w).enumerate() {
                        for (kx, acc_t) in acc_ky.chunks_exact_mut(out_w).enumerate() {
                            let at = padded.tap(oy * s + ky, kx);
                            let src = &padded.buf[at..at + out_w];
                            for ((a, &d), &v) in acc_t.iter_mut().zip(&row).zip(src) {
                                *a += d * v;
                            }
                        }
                    }
                }
                for (pt, acc_t) in part.iter_mut().zip(acc.chunks_exact(out_w)) {
                    *pt = acc_t.iter().sum();
                }
            }
        });
        // Planes are ordered (n, c): sum the N partials of each channel.
        let mut dw = vec![0f32; g.c * taps];
        for per_n in partial.chunks_exact(g.c * taps) {
            for (d, &v) in dw.iter_mut().zip(per_n) {
                *d += v;
            }
        }
        dw.into_iter().map(T::from_f32).collect()
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The CUDA kernels (`cu/depthwise.cu`), compiled once per process with NVRTC and loaded
    //! once per device.

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, Layout, WithDType};

    use super::{ConvPass, Geometry, OP};
    use crate::util::{cuda_view, dispatch_float, kernel_source, uint32, Kernels};

    static KERNELS: Kernels =
        Kernels::new(OP, "memtrain_depthwise", kernel_source!("depthwise.cu"));

    /// Threads per block; a multiple of the warp size, as the reduction assumes.
    const BLOCK: u32 = 256;

    /// The kernel of `pass`; all three take `(a, b, out, N, C, H, W, K, S, P, Ho, Wo)`.
    fn prefix(pass: ConvPass) -> &'static str {
        match pass {
            ConvPass::Forward => "depthwise_forward",
            ConvPass::InputGrad => "depthwise_input_grad",
            ConvPass::WeightGrad => "depthwise_weight_grad",
        }
    }

    fn config(pass: ConvPass, g: &Geometry) -> candle_core::Result<LaunchConfig> {
        let (blocks, per_block_elems) = match pass {
            ConvPass::Forward => (g.planes(), g.out_plane()),
            ConvPass::InputGrad => (g.planes(), g.in_plane()),
            ConvPass::WeightGrad => {
                return Ok(LaunchConfig {
                    grid_dim: (uint32(OP, "C*K*K", g.c * g.taps())?, 1, 1),
                    block_dim: (BLOCK, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
        };
        // Small planes get a smaller block so few threads idle; whole warps either way.
        let block = per_block_elems.next_multiple_of(32).min(BLOCK as usize);
        let tiles = per_block_elems.div_ceil(block);
        if tiles > 65_535 {
            candle_core::bail!(
                "{OP}: a {}x{} plane is too large for the CUDA kernel",
                g.height.max(g.out_h),
                g.width.max(g.out_w)
            );
        }
        Ok(LaunchConfig {
            grid_dim: (uint32(OP, "N*C", blocks)?, tiles as u32, 1),
            block_dim: (block as u32, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    fn run<T: CudaDType + WithDType + DeviceRepr>(
        pass: ConvPass,
        g: &Geometry,
        a: &CudaStorage,
        la: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        let dev = a.device().clone();
        let cfg = config(pass, g)?;
        // Grid x dimensions and per-plane indices are 32-bit (and signed in places) in the kernels.
        let dims = [
            uint32(OP, "N", g.n)?,
            uint32(OP, "C", g.c)?,
            uint32(OP, "H", g.height)?,
            uint32(OP, "W", g.width)?,
            uint32(OP, "K", g.k)?,
            uint32(OP, "stride", g.stride)?,
            uint32(OP, "padding", g.pad)?,
            uint32(OP, "Ho", g.out_h)?,
            uint32(OP, "Wo", g.out_w)?,
        ];
        uint32(OP, "H*W", g.in_plane())?;
        uint32(OP, "Ho*Wo", g.out_plane())?;
        let [(_, what_a), (_, what_b)] = g.operands(pass);
        let a = cuda_view::<T>(a, la, OP, what_a)?;
        let b = cuda_view::<T>(b, lb, OP, what_b)?;
        let name = format!("{}_{}", prefix(pass), T::DTYPE.as_str());
        let func = KERNELS.func(&dev, &name)?;
        // SAFETY: every element is written by the kernel before anything reads it.
        let out = unsafe { dev.alloc::<T>(g.result_dims(pass).iter().product())? };
        let stream = dev.cuda_stream();
        let mut builder = stream.launch_builder(&func);
        builder.arg(&a);
        builder.arg(&b);
        builder.arg(&out);
        for d in &dims {
            builder.arg(d);
        }
        // SAFETY: the argument list matches the kernel signature (three pointers, nine u32s),
        // the buffers hold the element counts the geometry implies, and the grid stays inside them.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }

    /// Launches `pass` on two same-dtype operands and returns its output storage.
    pub(super) fn launch(
        pass: ConvPass,
        g: &Geometry,
        a: &CudaStorage,
        la: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        dispatch_float!(
            a.dtype(),
            [F32, F16, BF16],
            |T| run::<T>(pass, g, a, la, b, lb),
            |dt| candle_core::bail!("{OP}: unsupported dtype {dt:?} (expected F32, F16 or BF16)"),
        )
    }
}
