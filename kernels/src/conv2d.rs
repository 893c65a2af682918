//! gemm-based 2D convolution with a bounded im2col buffer and a gemm backward: the public
//! functions and the Candle op that dispatches each pass to its kernels.
//!
//! Candle 0.11's CPU conv2d backward runs naive direct loops (the input gradient through
//! `conv_transpose2d`, the weight gradient through a conv2d whose "kernel" is the whole output map),
//! which makes a training step about 5x the forward; it also rejects bf16 (`unsupported dtype BF16
//! for op matmul`) and its full im2col variant materializes the whole batch's column matrix. This op
//! keeps every direction on gemm, with the column buffer bounded by [`IM2COL_CHUNK_BYTES`].
//!
//! The op's halves, each depending only on the shared geometry ([`super::geom::Geom`]) and the
//! shared helpers ([`super::util`]), never on this dispatcher:
//!
//! - [`super::conv2d_cpu`]: the CPU passes for every float dtype (im2col + gemm per image,
//!   half types widened to f32 one image at a time), bit-for-bit reproducible;
//! - [`super::conv2d_bf16`]: on an x86-64 CPU with AVX-512, bf16 inputs stay bf16 (packed
//!   straight from im2col rows) and all three passes run on our own bf16 kernels with f32 sums
//!   ([`super::gemm_bf16`]); the widening path is their fallback;
//! - [`super::conv2d_cuda`]: im2col + cuBLAS + col2im in chunks of the batch on CUDA;
//! - [`super::conv2d_cudnn`]: cuDNN on CUDA, in a build with the `cudnn` feature.
//!
//! On other devices (Metal) this is Candle's `conv2d`.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};
use half::bf16;

use super::conv2d_bf16;
use super::conv2d_cpu;
use super::gemm_bf16::{bf16_kernel, Bf16Kernel};
use super::geom::{conv_backward, shape_error, ConvPass, Geom};
use super::util::{cpu_slice, dispatch_float};

pub use super::conv2d_cpu::{im2col_chunk_bytes, PassScratch, IM2COL_CHUNK_BYTES, MIN_GEMM_DEPTH};

/// 2D convolution `x [N, Cin, H, W] * w [Cout, Cin, K, K]` (no bias, groups 1) with a square
/// `stride` and zero `padding`, differentiable with respect to `x` and `w`.
///
/// On the CPU this is im2col + gemm per image, with a column buffer bounded by
/// [`IM2COL_CHUNK_BYTES`]; the backward computes the input gradient as gemm (`Wᵀ · grad`) + col2im
/// and the weight gradient as im2col + gemm over chunks of the batch. A 1×1 convolution with stride 1
/// and no padding skips im2col (it multiplies the image itself, or a row-padded copy of it when its
/// rows are a multiple of 2 KiB). f32, f64, f16 and bf16 are supported (f16/bf16 multiply in
/// f32; the output has the input's dtype). Inputs of any layout are accepted (they are made
/// contiguous first). The weight gradient is always computed; the input gradient only when `x`
/// tracks ops (a `Var` or a tensor computed from one, such as a checkpoint's recomputation root),
/// since no other tensor leads back to a variable: a plain data batch gets none. On the CPU
/// the output and both gradients are bit-for-bit the same on every run with the same inputs and
/// thread count.
///
/// On CUDA the same three passes run as im2col + cuBLAS gemm + col2im in chunks of the batch
/// ([`crate::conv2d_cuda`]), or through cuDNN in a build with the `cudnn` feature
/// ([`crate::conv2d_cudnn`]); on other devices (Metal) this is Candle's `conv2d`.
///
/// # Errors
/// When `x` or `w` is not 4D, the channel counts differ, the kernel is not square or is larger than
/// the padded input, `stride` is 0, the dtypes or devices differ, or the dtype is not a float type.
pub fn conv2d(x: &Tensor, w: &Tensor, stride: usize, padding: usize) -> Result<Tensor> {
    conv2d_impl(x, w, stride, padding, None)
}

/// The input gradient of [`conv2d`]: `grad` [N, Cout, Ho, Wo] and `w` [Cout, Cin, K, K] give
/// dL/dx for an input of shape `x_dims`; no autograd. Used by the lean step, which calls the
/// backward passes itself instead of through Candle's graph.
///
/// # Errors
/// As [`conv2d`], and when `grad` does not have the output shape of `x_dims` and `w`.
pub fn conv2d_backward_input(
    grad: &Tensor,
    w: &Tensor,
    x_dims: &[usize],
    stride: usize,
    padding: usize,
) -> Result<Tensor> {
    let geom = Geom::new(x_dims, w.dims(), stride, padding, None)?;
    check_backward_args(grad, w, &geom)?;
    let grad = grad.contiguous()?;
    grad.apply_op2_no_bwd(&w.contiguous()?, &Conv2dOp::new(geom, ConvPass::InputGrad))
}

/// The weight gradient of [`conv2d`]: input `x` [N, Cin, H, W] and `grad` [N, Cout, Ho, Wo]
/// give dL/dw for a weight of shape `w_dims`, in x's dtype; no autograd.
///
/// # Errors
/// As [`conv2d_backward_input`].
pub fn conv2d_backward_weight(
    x: &Tensor,
    grad: &Tensor,
    w_dims: &[usize],
    stride: usize,
    padding: usize,
) -> Result<Tensor> {
    let geom = Geom::new(x.dims(), w_dims, stride, padding, None)?;
    check_backward_args(grad, x, &geom)?;
    let x = x.contiguous()?;
    x.apply_op2_no_bwd(
        &grad.contiguous()?,
        &Conv2dOp::new(geom, ConvPass::WeightGrad),
    )
}

/// The checks [`conv2d`] makes, for the backward entry points: same dtype and device, the
/// kernels' dtypes and devices, and an output gradient of the output's shape.
fn check_backward_args(grad: &Tensor, other: &Tensor, geom: &Geom) -> Result<()> {
    if grad.dtype() != other.dtype() || !grad.device().same_device(other.device()) {
        return Err(shape_error(format!(
            "gradient ({:?} on {:?}) and operand ({:?} on {:?}) differ in dtype or device",
            grad.dtype(),
            grad.device().location(),
            other.dtype(),
            other.device().location()
        )));
    }
    if !(grad.device().is_cpu() || grad.device().is_cuda())
        || !matches!(
            grad.dtype(),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        )
    {
        return Err(shape_error(format!(
            "backward passes run on the CPU or CUDA in f32, f64, f16 or bf16, not {:?} on {:?}",
            grad.dtype(),
            grad.device().location()
        )));
    }
    if grad.dims() != geom.out_shape().dims() {
        return Err(shape_error(format!(
            "output gradient has shape {:?}, expected {:?}",
            grad.dims(),
            geom.out_shape().dims()
        )));
    }
    Ok(())
}

/// [`conv2d`] with the weight-gradient pass forced to gather `chunk_images` images per gemm instead
/// of the number chosen from [`MIN_GEMM_DEPTH`] and [`IM2COL_CHUNK_BYTES`]. Meant for tests (batch sizes that are not a multiple
/// of the chunk) and for tuning; on the CPU the forward and input-gradient passes always work one
/// image at a time per thread, so the value only changes how the weight gradient is summed. On
/// CUDA it is the chunk of every pass (instead of [`super::conv2d_cuda::CUDA_IM2COL_CHUNK_BYTES`]),
/// and it selects the im2col op even in a `cudnn` build (so that op stays testable there).
///
/// # Errors
/// As [`conv2d`], and when `chunk_images` is 0.
pub fn conv2d_with_chunk(
    x: &Tensor,
    w: &Tensor,
    stride: usize,
    padding: usize,
    chunk_images: usize,
) -> Result<Tensor> {
    if chunk_images == 0 {
        return Err(shape_error("chunk_images must be at least 1".to_string()));
    }
    conv2d_impl(x, w, stride, padding, Some(chunk_images))
}

fn conv2d_impl(
    x: &Tensor,
    w: &Tensor,
    stride: usize,
    padding: usize,
    chunk: Option<usize>,
) -> Result<Tensor> {
    let geom = Geom::new(x.dims(), w.dims(), stride, padding, chunk)?;
    if x.dtype() != w.dtype() {
        return Err(shape_error(format!(
            "input dtype {:?} differs from weight dtype {:?}",
            x.dtype(),
            w.dtype()
        )));
    }
    if !x.device().same_device(w.device()) {
        return Err(shape_error(format!(
            "input on {:?} but weight on {:?}",
            x.device().location(),
            w.device().location()
        )));
    }
    if !(x.device().is_cpu() || x.device().is_cuda()) {
        // No kernels of ours on other devices (Metal): Candle's conv2d and its backward.
        return x.conv2d(w, padding, stride, 1, 1);
    }
    if !matches!(
        x.dtype(),
        DType::F32 | DType::F64 | DType::F16 | DType::BF16
    ) {
        return Err(shape_error(format!(
            "unsupported dtype {:?} (f32, f64, f16 and bf16 are supported)",
            x.dtype()
        )));
    }
    // The kernels index plain row-major images; a copy here is cheaper than strided gathers in
    // every im2col row, and `contiguous` is free for tensors that already are.
    let x = x.contiguous()?;
    let w = w.contiguous()?;
    x.apply_op2(&w, Conv2dOp::new(geom, ConvPass::Forward))
}

/// What `pass` of [`conv2d`] allocates on the CPU besides its result, for an input of shape
/// `x_dims` and a weight of `w_dims` in `dtype` on `threads` threads, on the kernels this CPU
/// runs: computed by the functions the pass sizes its buffers with and the sizes of its threads'
/// records, so it is what the pass allocates (but for gemm's flag per block of rows inside each
/// product, a few bytes, and Candle's tensor descriptors), whatever the threads' scheduling. The
/// memory estimate's source for the op.
///
/// # Errors
/// When the shapes are not a valid convolution (as [`conv2d`]).
pub fn cpu_pass_scratch(
    pass: ConvPass,
    x_dims: &[usize],
    w_dims: &[usize],
    stride: usize,
    padding: usize,
    dtype: DType,
    threads: usize,
) -> Result<PassScratch> {
    let g = Geom::new(x_dims, w_dims, stride, padding, None)?;
    Ok(if !cpu_uses_gemm_crate(dtype) {
        conv2d_bf16::pass_scratch(pass, &g, threads)
    } else {
        let native = matches!(dtype, DType::F32 | DType::F64);
        let acc = if dtype == DType::F64 { 8 } else { 4 };
        conv2d_cpu::pass_scratch(pass, &g, native, acc, threads)
    })
}

/// Whether [`conv2d`] multiplies with the `gemm` crate on the CPU for `dtype` (whose threads
/// then each keep an L2-sized packing buffer): every dtype but bf16 on a CPU with the AVX-512
/// bf16 kernels ([`super::gemm_bf16`]), which pack into buffers of their own.
pub fn cpu_uses_gemm_crate(dtype: DType) -> bool {
    !(dtype == DType::BF16 && bf16_kernel() != Bf16Kernel::Widen)
}

/// One pass of the convolution `geom` as a Candle op: the forward `(x, w) -> y` (with the gemm
/// backward), the input gradient `(dy, w) -> dx` or the weight gradient `(x, dy) -> dw`.
struct Conv2dOp {
    geom: Geom,
    pass: ConvPass,
}

impl Conv2dOp {
    fn new(geom: Geom, pass: ConvPass) -> Self {
        Conv2dOp { geom, pass }
    }

    /// The operands have the shapes the geometry was validated with.
    fn check(&self, l1: &Layout, l2: &Layout) -> candle_core::Result<()> {
        let [(s1, what1), (s2, what2)] = self.geom.operands(self.pass);
        ConvPass::check("conv2d", [(s1.dims(), what1), (s2.dims(), what2)], l1, l2)
    }
}

impl CustomOp2 for Conv2dOp {
    fn name(&self) -> &'static str {
        self.pass.name([
            "memtrain-conv2d",
            "memtrain-conv2d-grad-input",
            "memtrain-conv2d-grad-weight",
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
        let (g, pass) = (&self.geom, self.pass);
        let [(_, what1), (_, what2)] = g.operands(pass);
        let out = if s1.dtype() == DType::BF16 && bf16_kernel() != Bf16Kernel::Widen {
            let a = cpu_slice::<bf16>(s1, l1, "conv2d", what1)?;
            let b = cpu_slice::<bf16>(s2, l2, "conv2d", what2)?;
            CpuStorage::BF16(conv2d_bf16::run(pass, g, a, b))
        } else {
            dispatch_float!(
                s1.dtype(),
                [F32, F64, F16, BF16],
                |T| {
                    let a = cpu_slice::<T>(s1, l1, "conv2d", what1)?;
                    let b = cpu_slice::<T>(s2, l2, "conv2d", what2)?;
                    T::to_cpu_storage_owned(conv2d_cpu::run(pass, g, a, b))
                },
                |dt| candle_core::bail!(
                    "{}: unsupported dtype {dt:?} (f32, f64, f16, bf16)",
                    self.name()
                )
            )
        };
        Ok((out, g.result_shape(pass)))
    }

    /// The op is cuDNN's ([`super::conv2d_cudnn`]) in a build with the `cudnn` feature, else
    /// im2col + cuBLAS ([`super::conv2d_cuda`]); a chunk forced through [`conv2d_with_chunk`] is
    /// an im2col setting, so it selects the im2col op in either build.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.check(l1, l2)?;
        let (g, pass) = (&self.geom, self.pass);
        let out = crate::gpu_time::timed_pass(s1.device(), pass, g, s1.dtype(), || {
            #[cfg(feature = "cudnn")]
            if g.chunk.is_none() {
                return super::conv2d_cudnn::launch(pass, g, s1, l1, s2, l2);
            }
            super::conv2d_cuda::launch(pass, g, s1, l1, s2, l2)
        })?;
        Ok((out, g.result_shape(pass)))
    }

    /// Only the forward has a backward (the gradient passes are applied without one); the
    /// weight gradient is computed whether `w` tracks ops or not.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // A checkpoint's recomputation root is a `Var`, so it still gets its input gradient.
        conv_backward(self.pass, self.name(), x, w, grad, false, |pass| {
            Conv2dOp::new(self.geom, pass)
        })
    }
}
