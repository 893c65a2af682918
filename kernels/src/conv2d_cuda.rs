//! The conv2d op on CUDA: im2col + cuBLAS gemm + col2im for the forward pass and both gradients.
//!
//! Candle 0.11 (without cuDNN) runs a CUDA conv2d as an im2col of the whole batch plus a matmul,
//! computes the input gradient with a naive `conv_transpose2d` kernel and the weight gradient with a
//! second whole-batch im2col. This op keeps all three on cuBLAS and bounds the column buffer:
//!
//! - forward, per chunk of `b` images: im2col into one `[Cin·K·K, Ho·Wo]` matrix per image, then one
//!   strided-batched gemm `y_i = W · col_i` that writes NCHW output in place;
//! - input gradient, per chunk: one strided-batched gemm `dcol_i = Wᵀ · dy_i`, then col2im (a gather
//!   per input element: no atomics, so the result does not depend on scheduling);
//! - weight gradient, per chunk: im2col into one `[Cin·K·K, b·Ho·Wo]` matrix and the output
//!   gradient gathered into `[Cout, b·Ho·Wo]`, then one gemm `dW += dyᵀ-chunk · colᵀ` whose inner
//!   dimension runs over the chunk's images and pixels together (summed in f32 for half types).
//!
//! A 1×1, stride-1, unpadded convolution skips im2col and col2im in the forward and input-gradient
//! passes (the image is its own column matrix). Chunks hold at most [`CUDA_IM2COL_CHUNK_BYTES`] of
//! columns, against Candle's whole batch (604 MiB for the second layer of the default net at
//! batch 512 in f32).
//!
//! The chunk loop and the gemm shapes live in `run`, written against the `ConvDevice` trait:
//! the CUDA implementation launches kernels and cuBLAS, and the tests run the same loop on the CPU
//! with reference kernels and a column-major reference gemm, so the layouts, strides and transposes
//! handed to cuBLAS are checked against the CPU op on machines without a GPU.

// The chunk driver runs only on CUDA; a CPU build compiles it for the tests below, which check it
// against the CPU op.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use candle_core::DType;

pub use super::geom::ConvPass;
use super::geom::Geom;

/// Upper bound, in bytes, on the column matrix one pass of the CUDA op holds at a time (a chunk is
/// never smaller than one image, so one image's columns larger than this win over the bound). The
/// weight-gradient pass also holds the chunk's gathered output gradient, `Cout/(Cin·K²)` of this.
///
/// 32 MiB is about half of one activation of the default net's first stage at batch 512 in f32
/// (64 MiB) and still gives gemms of ~27 images per call on its largest layer.
pub(crate) const CUDA_IM2COL_CHUNK_BYTES: usize = 32 << 20;

/// Bytes of scratch the CUDA op allocates for `pass` on a batch of `n` images (`cin` input and
/// `cout` output channels, `k`×`k` kernel, `ho`×`wo` output, `pointwise` for a 1×1 unstrided
/// unpadded convolution), in `dtype`: the column matrix of one chunk, plus in the weight-gradient
/// pass the gathered output gradient of one chunk and, for f16/bf16, the f32 accumulator of the
/// weight gradient. memtrain's memory estimate uses this, so it and the op cannot drift.
#[allow(clippy::too_many_arguments)]
pub fn cuda_scratch_bytes(
    pass: ConvPass,
    n: usize,
    cin: usize,
    cout: usize,
    k: usize,
    ho: usize,
    wo: usize,
    pointwise: bool,
    dtype: DType,
) -> u64 {
    let elem = dtype.size_in_bytes();
    let (ckk, hw) = (cin * k * k, ho * wo);
    let chunk = chunk_images(n, ckk * hw * elem, None);
    let bytes = match pass {
        ConvPass::Forward | ConvPass::InputGrad if pointwise => 0,
        ConvPass::Forward | ConvPass::InputGrad => chunk * ckk * hw * elem,
        ConvPass::WeightGrad => {
            let acc = if matches!(dtype, DType::F16 | DType::BF16) {
                cout * ckk * 4
            } else {
                0
            };
            if n == 0 {
                0
            } else {
                chunk * (ckk + cout) * hw * elem + acc
            }
        }
    };
    bytes as u64
}

/// Images per chunk: as many as fit in [`CUDA_IM2COL_CHUNK_BYTES`] (or the count forced through
/// `conv2d_with_chunk`), at least one, at most the batch.
fn chunk_images(n: usize, per_image_bytes: usize, forced: Option<usize>) -> usize {
    forced
        .unwrap_or(CUDA_IM2COL_CHUNK_BYTES / per_image_bytes.max(1))
        .clamp(1, n.max(1))
}

/// Images per chunk of the CUDA op's column matrix for `ckk = Cin·K·K` rows of `hw` output pixels
/// in `dtype`, before the clamp to the batch (the self-check's shape tests use it).
#[cfg(test)]
pub(crate) fn cuda_chunk_images(ckk: usize, hw: usize, dtype: DType) -> usize {
    chunk_images(usize::MAX, ckk * hw * dtype.size_in_bytes(), None)
}

/// `(first image, images)` of each chunk of a batch of `n`.
fn chunks(n: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n).step_by(chunk).map(move |n0| (n0, chunk.min(n - n0)))
}

/// Where the column matrix keeps element (image `i` of the chunk, row `r = (c·K + ky)·K + kx`,
/// output pixel `p`): at `i·img_stride + r·row_stride + p`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ColLayout {
    pub row_stride: usize,
    pub img_stride: usize,
}

impl ColLayout {
    /// One `[Cin·K·K, Ho·Wo]` matrix per image (forward and input gradient).
    fn per_image(g: &Geom) -> Self {
        ColLayout {
            row_stride: g.hw_out(),
            img_stride: g.ckk() * g.hw_out(),
        }
    }

    /// One `[Cin·K·K, b·Ho·Wo]` matrix for a chunk of `b` images (weight gradient).
    fn merged(g: &Geom, b: usize) -> Self {
        ColLayout {
            row_stride: b * g.hw_out(),
            img_stride: g.hw_out(),
        }
    }
}

/// One (strided-batched) gemm in cuBLAS's column-major terms:
/// `C_i = op(A_i) · op(B_i) (+ C_i when accumulate)` for `i < batch`, `op(A)` being `m × k`,
/// `op(B)` `k × n` and `C` `m × n`. A row-major `[R, S]` matrix is a column-major `S × R` one, which
/// is why the plans below list the row-major products in swapped order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct GemmPlan {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
    pub batch: usize,
    /// `beta = 1` (add to C) instead of `beta = 0` (C is write-only).
    pub accumulate: bool,
}

impl GemmPlan {
    /// Forward on `b` images: `y_i[Cout, HW] = W[Cout, CKK] · col_i[CKK, HW]`, i.e. column-major
    /// `y_iᵀ (HW × Cout) = col_iᵀ (HW × CKK) · Wᵀ (CKK × Cout)`; `W` is shared (stride 0).
    fn forward(g: &Geom, b: usize) -> Self {
        let (hw, ckk) = (g.hw_out(), g.ckk());
        GemmPlan {
            trans_a: false,
            trans_b: false,
            m: hw,
            n: g.cout,
            k: ckk,
            lda: hw,
            ldb: ckk,
            ldc: hw,
            stride_a: ckk * hw,
            stride_b: 0,
            stride_c: g.out_image(),
            batch: b,
            accumulate: false,
        }
    }

    /// Input gradient on `b` images: `dcol_i[CKK, HW] = Wᵀ[CKK, Cout] · dy_i[Cout, HW]`, i.e.
    /// column-major `dcol_iᵀ (HW × CKK) = dy_iᵀ (HW × Cout) · W (Cout × CKK)`, where `W` as stored is
    /// the column-major `CKK × Cout` matrix `Wᵀ`, hence `trans_b`.
    fn input_grad(g: &Geom, b: usize) -> Self {
        let (hw, ckk) = (g.hw_out(), g.ckk());
        GemmPlan {
            trans_a: false,
            trans_b: true,
            m: hw,
            n: ckk,
            k: g.cout,
            lda: hw,
            ldb: ckk,
            ldc: hw,
            stride_a: g.out_image(),
            stride_b: 0,
            stride_c: ckk * hw,
            batch: b,
            accumulate: false,
        }
    }

    /// Weight gradient of a chunk of `b` images: `dW[Cout, CKK] (+)= dyT[Cout, P] · colᵀ[P, CKK]`
    /// with `P = b·HW`, i.e. column-major `dWᵀ (CKK × Cout) = col (CKK × P) · dyT (P × Cout)`, where
    /// `col` as stored is the column-major `P × CKK` matrix, hence `trans_a`.
    fn weight_grad(g: &Geom, b: usize, accumulate: bool) -> Self {
        let (p, ckk) = (b * g.hw_out(), g.ckk());
        GemmPlan {
            trans_a: true,
            trans_b: false,
            m: ckk,
            n: g.cout,
            k: p,
            lda: p,
            ldb: p,
            ldc: ckk,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            batch: 1,
            accumulate,
        }
    }
}

/// The buffers a pass works on. `In0`/`In1` are the op's two inputs (`x, w`; `dy, w`; `x, dy`),
/// `Out` its result, `Col` the chunk's column matrix and `Gathered` the chunk's gathered output
/// gradient (weight-gradient pass only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Buf {
    In0,
    In1,
    Out,
    Col,
    Gathered,
}

/// The primitive operations a pass is made of. All offsets and lengths are in elements.
pub(super) trait ConvDevice {
    /// Allocate the scratch buffers: `col` elements of columns and `gathered` of gathered gradient.
    fn prepare(&mut self, col: usize, gathered: usize) -> candle_core::Result<()>;
    /// Columns of images `n0 .. n0 + b` of `In0` (an NCHW input) into `Col`, laid out as `layout`.
    fn im2col(&mut self, n0: usize, b: usize, layout: ColLayout) -> candle_core::Result<()>;
    /// Output gradient `In1` (`[N, Cout, HW]`) of images `n0 .. n0 + b` into `Gathered` as
    /// `[Cout, b·HW]`.
    fn gather(&mut self, n0: usize, b: usize) -> candle_core::Result<()>;
    /// Column gradients in `Col` (laid out as `layout`) summed into images `n0 .. n0 + b` of `Out`.
    fn col2im(&mut self, n0: usize, b: usize, layout: ColLayout) -> candle_core::Result<()>;
    /// `plan` with its matrices starting at the given buffers and element offsets.
    fn gemm(
        &mut self,
        plan: &GemmPlan,
        a: (Buf, usize),
        b: (Buf, usize),
        c: (Buf, usize),
    ) -> candle_core::Result<()>;
    /// Set `Out` to zeros (a weight gradient over an empty batch).
    fn zero_out(&mut self) -> candle_core::Result<()>;
}

/// Runs `pass` of the convolution `g` on `dev` with elements of `elem` bytes, in chunks.
pub(super) fn run<D: ConvDevice>(
    dev: &mut D,
    pass: ConvPass,
    g: &Geom,
    elem: usize,
) -> candle_core::Result<()> {
    let (ckk, hw) = (g.ckk(), g.hw_out());
    let chunk = chunk_images(g.n, ckk * hw * elem, g.chunk);
    match pass {
        // The image is its own column matrix: one gemm over the whole batch, from the op's
        // first input straight into its result.
        ConvPass::Forward | ConvPass::InputGrad if g.pointwise() => {
            dev.prepare(0, 0)?;
            if g.n > 0 {
                let plan = if pass == ConvPass::Forward {
                    GemmPlan::forward(g, g.n)
                } else {
                    GemmPlan::input_grad(g, g.n)
                };
                dev.gemm(&plan, (Buf::In0, 0), (Buf::In1, 0), (Buf::Out, 0))?;
            }
        }
        ConvPass::Forward => {
            dev.prepare(chunk * ckk * hw, 0)?;
            let layout = ColLayout::per_image(g);
            for (n0, b) in chunks(g.n, chunk) {
                dev.im2col(n0, b, layout)?;
                let plan = GemmPlan::forward(g, b);
                dev.gemm(
                    &plan,
                    (Buf::Col, 0),
                    (Buf::In1, 0),
                    (Buf::Out, n0 * g.out_image()),
                )?;
            }
        }
        ConvPass::InputGrad => {
            dev.prepare(chunk * ckk * hw, 0)?;
            let layout = ColLayout::per_image(g);
            for (n0, b) in chunks(g.n, chunk) {
                let plan = GemmPlan::input_grad(g, b);
                dev.gemm(
                    &plan,
                    (Buf::In0, n0 * g.out_image()),
                    (Buf::In1, 0),
                    (Buf::Col, 0),
                )?;
                dev.col2im(n0, b, layout)?;
            }
        }
        ConvPass::WeightGrad => {
            if g.n == 0 {
                dev.prepare(0, 0)?;
                return dev.zero_out();
            }
            dev.prepare(chunk * ckk * hw, chunk * g.cout * hw)?;
            for (i, (n0, b)) in chunks(g.n, chunk).enumerate() {
                dev.im2col(n0, b, ColLayout::merged(g, b))?;
                dev.gather(n0, b)?;
                let plan = GemmPlan::weight_grad(g, b, i > 0);
                dev.gemm(&plan, (Buf::Col, 0), (Buf::Gathered, 0), (Buf::Out, 0))?;
            }
        }
    }
    Ok(())
}

#[cfg(feature = "cuda")]
pub(super) use cuda::launch;

#[cfg(feature = "cuda")]
mod cuda {
    //! The [`ConvDevice`] of a `CudaDevice`: NVRTC kernels for im2col/gather/col2im and cuBLAS
    //! `GemmStridedBatchedEx` for the products, all on Candle's stream.

    use std::ffi::c_void;

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::cublas::{result as blas, sys as blas_sys};
    use candle_core::cuda_backend::cudarc::driver::{
        CudaFunction, CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, PushKernelArg,
        ValidAsZeroBits,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaDevice, CudaStorage, Layout, WithDType};

    use super::{run, Buf, ColLayout, ConvDevice, ConvPass, GemmPlan, Geom};
    use crate::util::{
        alloc_len, cuda_view, dispatch_float, grid_stride, int32, kernel_source, tf32, Kernels,
    };

    static KERNELS: Kernels =
        Kernels::new("conv2d", "memtrain_conv2d", kernel_source!("conv2d.cu"));

    /// An element type of the op: its cuBLAS data type and the suffix of its bit-moving kernels
    /// (the arithmetic kernels take the dtype's name, `WithDType::DTYPE.as_str()`).
    trait Elem: CudaDType + WithDType + DeviceRepr + ValidAsZeroBits {
        const DATA: blas_sys::cudaDataType;
        /// Suffix of the bit-moving kernels (by size).
        const BITS: &'static str;
        /// Half types: the weight gradient is summed in an f32 buffer and cast at the end.
        const HALF: bool;
    }

    macro_rules! elem {
        ($t:ty, $data:ident, $bits:literal, $half:literal) => {
            impl Elem for $t {
                const DATA: blas_sys::cudaDataType = blas_sys::cudaDataType::$data;
                const BITS: &'static str = $bits;
                const HALF: bool = $half;
            }
        };
    }
    elem!(f32, CUDA_R_32F, "u32", false);
    elem!(f64, CUDA_R_64F, "u64", false);
    elem!(half::f16, CUDA_R_16F, "u16", true);
    elem!(half::bf16, CUDA_R_16BF, "u16", true);

    /// cuBLAS takes 32-bit sizes.
    fn int(what: &str, v: usize) -> candle_core::Result<i32> {
        int32("conv2d", what, v)
    }

    /// Kernel `{kernel}_{suffix}` on `dev`.
    fn func(dev: &CudaDevice, kernel: &str, suffix: &str) -> candle_core::Result<CudaFunction> {
        KERNELS.func(dev, &format!("{kernel}_{suffix}"))
    }

    struct CudaConv<'a, T: Elem> {
        dev: CudaDevice,
        g: Geom,
        in0: CudaView<'a, T>,
        in1: CudaView<'a, T>,
        out: CudaSlice<T>,
        /// The f32 weight-gradient accumulator of half types.
        acc: Option<CudaSlice<f32>>,
        col: Option<CudaSlice<T>>,
        gathered: Option<CudaSlice<T>>,
    }

    impl<T: Elem> CudaConv<'_, T> {
        /// `[n0, b, C, H, W, K, S, P, Ho, Wo, row_stride, img_stride]` as the column kernels take it.
        fn col_args(&self, n0: usize, b: usize, layout: ColLayout) -> [u64; 12] {
            let g = &self.g;
            [
                n0,
                b,
                g.cin,
                g.h,
                g.w,
                g.k,
                g.stride,
                g.pad,
                g.ho,
                g.wo,
                layout.row_stride,
                layout.img_stride,
            ]
            .map(|v| v as u64)
        }
    }

    fn missing(what: &str) -> candle_core::Error {
        candle_core::Error::Msg(format!("conv2d: internal error, no {what} buffer"))
    }

    /// A gemm input: one of the op's inputs or a scratch buffer.
    fn operand<'a, T>(
        buf: Buf,
        in0: &'a CudaView<'_, T>,
        in1: &'a CudaView<'_, T>,
        col: Option<&'a CudaSlice<T>>,
        gathered: Option<&'a CudaSlice<T>>,
    ) -> candle_core::Result<&'a dyn DevicePtr<T>> {
        Ok(match buf {
            Buf::In0 => in0,
            Buf::In1 => in1,
            Buf::Col => col.ok_or_else(|| missing("column"))?,
            Buf::Gathered => gathered.ok_or_else(|| missing("gather"))?,
            Buf::Out => {
                candle_core::bail!("conv2d: internal error, the result is not a gemm input")
            }
        })
    }

    /// One `cublasGemmStridedBatchedEx` on Candle's stream (the handle is bound to it): `a` and `b`
    /// of type `T` at element offsets, `c` of type `C` (T, or f32 for a half-type accumulator).
    #[allow(clippy::too_many_arguments)]
    fn gemm_ex<T: Elem, C>(
        dev: &CudaDevice,
        plan: &GemmPlan,
        a: (&dyn DevicePtr<T>, usize),
        b: (&dyn DevicePtr<T>, usize),
        c: (&mut dyn DevicePtrMut<C>, usize),
        c_type: blas_sys::cudaDataType,
    ) -> candle_core::Result<()> {
        let stream = dev.cuda_stream();
        let handle = dev.cublas_handle();
        let elem = std::mem::size_of::<T>() as u64;
        let (pa, _ga) = a.0.device_ptr(&stream);
        let (pb, _gb) = b.0.device_ptr(&stream);
        let (pc, _gc) = c.0.device_ptr_mut(&stream);
        let (pa, pb) = (pa + a.1 as u64 * elem, pb + b.1 as u64 * elem);
        let pc = pc + (c.1 * std::mem::size_of::<C>()) as u64;
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // f64 multiplies in f64; f32 in f32, or on TF32 tensor cores when `--tf32 on`
        // (`crate::set_tf32`); half types in f32 from half inputs, into half or f32 results.
        let beta = if plan.accumulate { 1.0 } else { 0.0 };
        let f64_scalars = [1.0f64, beta];
        let f32_scalars = [1.0f32, beta as f32];
        let (alpha, beta, compute): (*const c_void, *const c_void, _) =
            if T::DATA == blas_sys::cudaDataType::CUDA_R_64F {
                (
                    (&f64_scalars[0] as *const f64).cast(),
                    (&f64_scalars[1] as *const f64).cast(),
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
                )
            } else {
                let compute = if T::DATA == blas_sys::cudaDataType::CUDA_R_32F && tf32() {
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
                } else {
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
                };
                (
                    (&f32_scalars[0] as *const f32).cast(),
                    (&f32_scalars[1] as *const f32).cast(),
                    compute,
                )
            };
        // SAFETY: the plan's shapes, leading dimensions and strides keep every matrix of the
        // batch inside its buffer (`run` derives them from the geometry and the chunk; the CPU
        // tests of this module check them against the CPU op); the scalars outlive the call.
        unsafe {
            blas::gemm_strided_batched_ex(
                *handle.handle(),
                op(plan.trans_a),
                op(plan.trans_b),
                int("m", plan.m)?,
                int("n", plan.n)?,
                int("k", plan.k)?,
                alpha,
                pa as *const c_void,
                T::DATA,
                int("lda", plan.lda)?,
                plan.stride_a as i64,
                pb as *const c_void,
                T::DATA,
                int("ldb", plan.ldb)?,
                plan.stride_b as i64,
                beta,
                pc as *mut c_void,
                c_type,
                int("ldc", plan.ldc)?,
                plan.stride_c as i64,
                int("batch", plan.batch)?,
                compute,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .w()
    }

    impl<T: Elem> ConvDevice for CudaConv<'_, T> {
        fn prepare(&mut self, col: usize, gathered: usize) -> candle_core::Result<()> {
            // SAFETY (all three): every element is written before it is read: columns by
            // im2col or the input-gradient gemm of the same chunk, the gathered gradient by
            // gather, the accumulator by the first chunk's gemm (beta = 0).
            if col > 0 {
                self.col = Some(unsafe { self.dev.alloc::<T>(col)? });
            }
            if gathered > 0 {
                self.gathered = Some(unsafe { self.dev.alloc::<T>(gathered)? });
                if T::HALF {
                    self.acc = Some(unsafe { self.dev.alloc::<f32>(self.out.len())? });
                }
            }
            Ok(())
        }

        fn im2col(&mut self, n0: usize, b: usize, layout: ColLayout) -> candle_core::Result<()> {
            let args = self.col_args(n0, b, layout);
            let total = b * self.g.ckk() * self.g.hw_out();
            let func = func(&self.dev, "conv_im2col", T::BITS)?;
            let col = self.col.as_mut().ok_or_else(|| missing("column"))?;
            let stream = self.dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&self.in0);
            builder.arg(col);
            for a in &args {
                builder.arg(a);
            }
            // SAFETY: the signature is (const T*, T*, 12 × u64); the column buffer holds a chunk
            // of `b` images in either layout and the reads stay inside images n0 .. n0 + b.
            unsafe { builder.launch(grid_stride(total)) }.w()?;
            Ok(())
        }

        fn gather(&mut self, n0: usize, b: usize) -> candle_core::Result<()> {
            let (cout, hw) = (self.g.cout as u64, self.g.hw_out() as u64);
            let args = [n0 as u64, b as u64, cout, hw];
            let func = func(&self.dev, "conv_gather", T::BITS)?;
            let out = self.gathered.as_mut().ok_or_else(|| missing("gather"))?;
            let stream = self.dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&self.in1);
            builder.arg(out);
            for a in &args {
                builder.arg(a);
            }
            // SAFETY: (const T*, T*, 4 × u64); `b · Cout · HW` elements written, all inside the
            // gather buffer, reads inside images n0 .. n0 + b of the output gradient.
            unsafe { builder.launch(grid_stride(b * self.g.cout * self.g.hw_out())) }.w()?;
            Ok(())
        }

        fn col2im(&mut self, n0: usize, b: usize, layout: ColLayout) -> candle_core::Result<()> {
            let args = self.col_args(n0, b, layout);
            let total = b * self.g.in_image();
            let func = func(&self.dev, "conv_col2im", T::DTYPE.as_str())?;
            let col = self.col.as_ref().ok_or_else(|| missing("column"))?;
            let stream = self.dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(col);
            builder.arg(&mut self.out);
            for a in &args {
                builder.arg(a);
            }
            // SAFETY: (const T*, T*, 12 × u64); writes images n0 .. n0 + b of the input gradient,
            // reads the chunk's columns.
            unsafe { builder.launch(grid_stride(total)) }.w()?;
            Ok(())
        }

        fn gemm(
            &mut self,
            plan: &GemmPlan,
            a: (Buf, usize),
            b: (Buf, usize),
            c: (Buf, usize),
        ) -> candle_core::Result<()> {
            let CudaConv {
                dev,
                in0,
                in1,
                out,
                acc,
                col,
                gathered,
                ..
            } = self;
            match c.0 {
                // The input-gradient gemm writes the columns; its inputs are the op's inputs.
                Buf::Col => {
                    let pa = operand(a.0, in0, in1, None, gathered.as_ref())?;
                    let pb = operand(b.0, in0, in1, None, gathered.as_ref())?;
                    let pc = col.as_mut().ok_or_else(|| missing("column"))?;
                    gemm_ex::<T, T>(dev, plan, (pa, a.1), (pb, b.1), (pc, c.1), T::DATA)
                }
                Buf::Out => {
                    let pa = operand(a.0, in0, in1, col.as_ref(), gathered.as_ref())?;
                    let pb = operand(b.0, in0, in1, col.as_ref(), gathered.as_ref())?;
                    match acc.as_mut() {
                        Some(acc) => gemm_ex::<T, f32>(
                            dev,
                            plan,
                            (pa, a.1),
                            (pb, b.1),
                            (acc, c.1),
                            blas_sys::cudaDataType::CUDA_R_32F,
                        ),
                        None => {
                            gemm_ex::<T, T>(dev, plan, (pa, a.1), (pb, b.1), (out, c.1), T::DATA)
                        }
                    }
                }
                other => {
                    candle_core::bail!("conv2d: internal error, {other:?} is not a gemm result")
                }
            }
        }

        fn zero_out(&mut self) -> candle_core::Result<()> {
            self.out = self.dev.alloc_zeros::<T>(self.out.len())?;
            self.acc = None;
            Ok(())
        }
    }

    fn pass_on<T: Elem>(
        pass: ConvPass,
        g: &Geom,
        a: &CudaStorage,
        la: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        let dev = a.device().clone();
        let out_len = g.result_len(pass);
        if out_len == 0 {
            return Ok(CudaStorage::wrap_cuda_slice(
                dev.alloc_zeros::<T>(alloc_len(0))?,
                dev,
            ));
        }
        let mut conv = CudaConv {
            in0: cuda_view(a, la, "conv2d", "first operand")?,
            in1: cuda_view(b, lb, "conv2d", "second operand")?,
            // SAFETY: `run` writes every element: each pass covers the whole result, and an empty
            // batch zeroes the weight gradient.
            out: unsafe { dev.alloc::<T>(out_len)? },
            dev: dev.clone(),
            g: *g,
            acc: None,
            col: None,
            gathered: None,
        };
        run(&mut conv, pass, g, std::mem::size_of::<T>())?;
        if let Some(acc) = conv.acc.take() {
            let func = func(&dev, "conv_cast", T::DTYPE.as_str())?;
            let len = conv.out.len();
            let len64 = len as u64;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&acc);
            builder.arg(&mut conv.out);
            builder.arg(&len64);
            // SAFETY: (const float*, T*, u64) over two buffers of `len` elements.
            unsafe { builder.launch(grid_stride(len)) }.w()?;
        }
        let out = conv.out;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }

    /// Runs `pass` on two same-dtype operands and returns its result storage.
    pub(crate) fn launch(
        pass: ConvPass,
        g: &Geom,
        a: &CudaStorage,
        la: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        dispatch_float!(
            a.dtype(),
            [F32, F64, F16, BF16],
            |T| pass_on::<T>(pass, g, a, la, b, lb),
            |dt| candle_core::bail!("conv2d: unsupported dtype {dt:?} (f32, f64, f16, bf16)"),
        )
    }
}

#[cfg(test)]
mod tests {
    //! The chunk loop and the cuBLAS plans, run on the CPU: reference im2col/gather/col2im kernels
    //! (index for index what the CUDA kernels compute) and a column-major strided-batched gemm,
    //! compared with the CPU op.

    use super::*;
    use candle_core::{Device, Tensor};

    /// The CPU stand-in for the GPU: f64 buffers.
    struct Reference {
        g: Geom,
        in0: Vec<f64>,
        in1: Vec<f64>,
        out: Vec<f64>,
        col: Vec<f64>,
        gathered: Vec<f64>,
        /// Largest scratch the pass asked for, to check the chunk bound.
        scratch: usize,
    }

    impl Reference {
        fn buf(&self, b: Buf) -> &Vec<f64> {
            match b {
                Buf::In0 => &self.in0,
                Buf::In1 => &self.in1,
                Buf::Out => &self.out,
                Buf::Col => &self.col,
                Buf::Gathered => &self.gathered,
            }
        }
    }

    impl ConvDevice for Reference {
        fn prepare(&mut self, col: usize, gathered: usize) -> candle_core::Result<()> {
            // NaN-filled, like uninitialized device memory: a read before a write shows up.
            self.col = vec![f64::NAN; col];
            self.gathered = vec![f64::NAN; gathered];
            self.scratch = self.scratch.max(col + gathered);
            Ok(())
        }

        fn im2col(&mut self, n0: usize, b: usize, l: ColLayout) -> candle_core::Result<()> {
            let g = self.g;
            let (hw, kk) = (g.hw_out(), g.k * g.k);
            for e in 0..b * g.ckk() * hw {
                let (p, t) = (e % hw, e / hw);
                let (r, i) = (t % g.ckk(), t / g.ckk());
                let (c, tap) = (r / kk, r % kk);
                let (ky, kx) = (tap / g.k, tap % g.k);
                let (oy, ox) = (p / g.wo, p % g.wo);
                let iy = (oy * g.stride + ky) as i64 - g.pad as i64;
                let ix = (ox * g.stride + kx) as i64 - g.pad as i64;
                let v = if iy >= 0 && iy < g.h as i64 && ix >= 0 && ix < g.w as i64 {
                    self.in0[(((n0 + i) * g.cin + c) * g.h + iy as usize) * g.w + ix as usize]
                } else {
                    0.0
                };
                self.col[i * l.img_stride + r * l.row_stride + p] = v;
            }
            Ok(())
        }

        fn gather(&mut self, n0: usize, b: usize) -> candle_core::Result<()> {
            let (cout, hw) = (self.g.cout, self.g.hw_out());
            for e in 0..b * cout * hw {
                let (p, t) = (e % hw, e / hw);
                let (i, o) = (t % b, t / b);
                self.gathered[e] = self.in1[((n0 + i) * cout + o) * hw + p];
            }
            Ok(())
        }

        fn col2im(&mut self, n0: usize, b: usize, l: ColLayout) -> candle_core::Result<()> {
            let g = self.g;
            for e in 0..b * g.in_image() {
                let ix = e % g.w;
                let t = e / g.w;
                let iy = t % g.h;
                let t = t / g.h;
                let (c, i) = (t % g.cin, t / g.cin);
                let mut acc = 0.0;
                for ky in 0..g.k {
                    let ty = (iy + g.pad) as i64 - ky as i64;
                    if ty < 0 {
                        break;
                    }
                    if !(ty as usize).is_multiple_of(g.stride) || ty as usize / g.stride >= g.ho {
                        continue;
                    }
                    let oy = ty as usize / g.stride;
                    for kx in 0..g.k {
                        let tx = (ix + g.pad) as i64 - kx as i64;
                        if tx < 0 {
                            break;
                        }
                        if !(tx as usize).is_multiple_of(g.stride) || tx as usize / g.stride >= g.wo
                        {
                            continue;
                        }
                        let ox = tx as usize / g.stride;
                        acc += self.col[i * l.img_stride
                            + ((c * g.k + ky) * g.k + kx) * l.row_stride
                            + oy * g.wo
                            + ox];
                    }
                }
                self.out[((n0 + i) * g.cin + c) * g.h * g.w + iy * g.w + ix] = acc;
            }
            Ok(())
        }

        fn gemm(
            &mut self,
            p: &GemmPlan,
            a: (Buf, usize),
            b: (Buf, usize),
            c: (Buf, usize),
        ) -> candle_core::Result<()> {
            // Column-major: element (row, col) of a matrix with leading dimension ld sits at
            // col·ld + row; op(A)(i, l) = A(l, i) when transposed.
            let (am, bm) = (self.buf(a.0).clone(), self.buf(b.0).clone());
            let at = |base: usize, i: usize, l: usize| {
                if p.trans_a {
                    am[base + i * p.lda + l]
                } else {
                    am[base + l * p.lda + i]
                }
            };
            let bt = |base: usize, l: usize, j: usize| {
                if p.trans_b {
                    bm[base + l * p.ldb + j]
                } else {
                    bm[base + j * p.ldb + l]
                }
            };
            let mut results = Vec::new();
            for q in 0..p.batch {
                let (ab, bb, cb) = (
                    a.1 + q * p.stride_a,
                    b.1 + q * p.stride_b,
                    c.1 + q * p.stride_c,
                );
                for j in 0..p.n {
                    for i in 0..p.m {
                        let s: f64 = (0..p.k).map(|l| at(ab, i, l) * bt(bb, l, j)).sum();
                        results.push((cb + j * p.ldc + i, s));
                    }
                }
            }
            let cm = match c.0 {
                Buf::Out => &mut self.out,
                Buf::Col => &mut self.col,
                other => candle_core::bail!("{other:?} is not a result"),
            };
            for (idx, s) in results {
                cm[idx] = if p.accumulate { cm[idx] + s } else { s };
            }
            Ok(())
        }

        fn zero_out(&mut self) -> candle_core::Result<()> {
            self.out.iter_mut().for_each(|v| *v = 0.0);
            Ok(())
        }
    }

    fn rand(len: usize, seed: u64) -> Vec<f64> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 11) as f64 / (1u64 << 53) as f64 - 0.5
            })
            .collect()
    }

    fn run_ref(pass: ConvPass, g: &Geom, in0: Vec<f64>, in1: Vec<f64>) -> (Vec<f64>, usize) {
        let out_len = g.result_len(pass);
        let mut dev = Reference {
            g: *g,
            in0,
            in1,
            out: vec![f64::NAN; out_len],
            col: Vec::new(),
            gathered: Vec::new(),
            scratch: 0,
        };
        run(&mut dev, pass, g, 8).unwrap();
        (dev.out, dev.scratch)
    }

    fn close(what: &str, got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-10 * (1.0 + b.abs()),
                "{what}: element {i}: {a} vs {b}"
            );
        }
    }

    /// Every pass of the CUDA driver equals the CPU op (f64) for the shape, with the given chunk.
    fn check(
        (n, cin, h, w): (usize, usize, usize, usize),
        (cout, k, stride, pad): (usize, usize, usize, usize),
        chunk: Option<usize>,
    ) {
        let cpu = Device::Cpu;
        let g = Geom::new(&[n, cin, h, w], &[cout, cin, k, k], stride, pad, chunk).unwrap();
        let x = rand(g.n * g.in_image(), 1);
        let wt = rand(cout * g.ckk(), 2);
        let dy = rand(g.n * g.out_image(), 3);
        let xt = Tensor::from_vec(x.clone(), (n, cin, h, w), &cpu).unwrap();
        let xv = candle_core::Var::from_tensor(&xt).unwrap();
        let wv = candle_core::Var::from_vec(wt.clone(), (cout, cin, k, k), &cpu).unwrap();
        let y = crate::conv2d::conv2d(xv.as_tensor(), wv.as_tensor(), stride, pad).unwrap();
        let dyt = Tensor::from_vec(dy.clone(), y.shape(), &cpu).unwrap();
        let grads = (y.clone() * dyt)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let tag = format!("{n}x{cin}x{h}x{w} * {cout}x{k} s{stride} p{pad} chunk {chunk:?}");

        let (fwd, fs) = run_ref(ConvPass::Forward, &g, x.clone(), wt.clone());
        close(&format!("forward {tag}"), &fwd, &flat(&y));
        let (dx, ds) = run_ref(ConvPass::InputGrad, &g, dy.clone(), wt.clone());
        close(
            &format!("input grad {tag}"),
            &dx,
            &flat(grads.get(xv.as_tensor()).unwrap()),
        );
        let (dw, ws) = run_ref(ConvPass::WeightGrad, &g, x, dy);
        close(
            &format!("weight grad {tag}"),
            &dw,
            &flat(grads.get(wv.as_tensor()).unwrap()),
        );
        // The scratch the driver asked for is what the estimator is told.
        for (pass, got) in [
            (ConvPass::Forward, fs),
            (ConvPass::InputGrad, ds),
            (ConvPass::WeightGrad, ws),
        ] {
            if chunk.is_none() {
                let want = cuda_scratch_bytes(
                    pass,
                    n,
                    cin,
                    cout,
                    k,
                    g.ho,
                    g.wo,
                    g.pointwise(),
                    DType::F64,
                );
                assert_eq!((got * 8) as u64, want, "{pass:?} scratch {tag}");
            }
        }
    }

    #[test]
    fn driver_matches_the_cpu_op_over_shapes_and_chunks() {
        // Stride 1 and 2, padding 0 and 1, channels that are not multiples of 8, 1x1 (pointwise
        // and strided), chunks that divide the batch, that do not, and one image per chunk.
        for chunk in [None, Some(1), Some(2), Some(3)] {
            check((5, 3, 7, 6), (5, 3, 1, 1), chunk);
            check((5, 3, 7, 6), (4, 3, 2, 1), chunk);
            check((4, 6, 8, 8), (3, 3, 2, 0), chunk);
            check((3, 5, 5, 5), (7, 1, 1, 0), chunk);
            check((3, 5, 6, 6), (2, 1, 2, 0), chunk);
            check((2, 2, 4, 4), (3, 5, 1, 2), chunk);
        }
    }

    #[test]
    fn empty_batch_gives_a_zero_weight_gradient() {
        let g = Geom::new(&[0, 2, 4, 4], &[3, 2, 3, 3], 1, 1, None).unwrap();
        let (dw, _) = run_ref(ConvPass::WeightGrad, &g, Vec::new(), Vec::new());
        assert_eq!(dw, vec![0.0; 3 * 2 * 9]);
        let (y, _) = run_ref(ConvPass::Forward, &g, Vec::new(), rand(54, 1));
        assert!(y.is_empty());
    }

    #[test]
    fn chunks_are_bounded_by_the_budget() {
        // Second layer of the default net at batch 512, f32: 288 rows × 1024 pixels per image.
        let per_image = 288 * 1024 * 4;
        let chunk = chunk_images(512, per_image, None);
        assert!(chunk * per_image <= CUDA_IM2COL_CHUNK_BYTES && chunk >= 1);
        assert!((chunk + 1) * per_image > CUDA_IM2COL_CHUNK_BYTES);
        // One image larger than the budget still runs, one at a time.
        assert_eq!(chunk_images(8, CUDA_IM2COL_CHUNK_BYTES * 2, None), 1);
        let split: Vec<_> = chunks(7, 3).collect();
        assert_eq!(split, vec![(0, 3), (3, 3), (6, 1)]);
    }
}
