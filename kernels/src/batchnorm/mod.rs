//! Fused training-mode BatchNorm (+ optional ReLU) over `[N, C, H, W]` that reads and writes the
//! activation dtype (f32, f16 or bf16) and accumulates in f32/f64.
//!
//! Why an op of our own: mixed precision wants the batch statistics in f32 while the activations are
//! f16/bf16. Built from Candle tensor ops (`x.to_dtype(F32)`, mean, var, normalize) that keeps an f32
//! copy of every activation alive for backward — more memory than the f16 activation it normalizes —
//! and Candle's broadcast-op backward is slow on the CPU.
//!
//! How it is put together (all ops are Candle custom ops with a CPU and, behind the `cuda` feature,
//! a CUDA forward):
//! - `BnStats` (`CustomOp1`, applied without backward): per-channel mean and *biased* variance in one
//!   f32 `[2, C]` tensor (row 0 mean, row 1 variance). Two passes over x (mean, then the sum of squared
//!   deviations), so there is no `E[x²] - E[x]²` cancellation; the CPU sums 256-element blocks in f32
//!   lanes and the blocks in f64; the GPU sums in f32 per thread, in a shared-memory tree per block,
//!   each channel split over several blocks whose partials a last small kernel adds. These rows are
//!   also what the caller gets back for the running statistics: detached by construction.
//! - `BnNorm` (`CustomOp3` on x, gamma, beta): `y = (x - mean) * gamma / sqrt(var + eps) + beta`
//!   (then ReLU), reading the statistics tensor it holds.
//! - Backward (`BnNorm::bwd`): `BnBwdReduce` computes per channel `Σg'` (= grad_beta) and
//!   `Σg'·x̂` (= grad_gamma), where `g'` is the upstream gradient masked to zero where `y <= 0` when the
//!   ReLU is fused; `BnBwdInput` then writes
//!   `grad_x = gamma·invstd·(g' - Σg'/M - x̂·Σg'x̂/M)` in x's dtype (the bracket is summed at the scale of
//!   the gradient before the multiplication by `gamma·invstd`, so that degenerate batches — one element
//!   per channel — give exactly zero, not rounding noise amplified by `1/sqrt(eps)`).
//!
//! What backward keeps alive: x (the op's argument, in the activation dtype), y (the op's result, only
//! read for the ReLU mask; the next layer keeps it alive anyway) and the `[2, C]` f32 statistics held by
//! the op. Nothing activation-sized is kept in f32. The statistics are stored rather than recomputed
//! in backward because they are only 2·C floats, and recomputing them would cost two more full passes
//! over x.
//!
//! CPU: every pass runs over the `[H, W]` planes in parallel on Candle's persistent thread pool
//! (per-plane partial sums, added per channel in a fixed order, so results do not depend on the
//! thread count). CUDA: the kernels of `cu/batchnorm.cu`, compiled once per process with
//! NVRTC. Dtype dispatch, operand access and launches go through [`super::util`].

use std::ops::Range;

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor, WithDType,
};

use super::util::{self, dispatch_float, Float};

/// Training-mode batch norm over `[N, C, H, W]` (statistics over N, H, W per channel), optionally
/// followed by ReLU.
///
/// `x`: f32, f16 or bf16; `gamma`, `beta`: f32 `[C]` (master weights; their gradients come back f32).
/// Returns `(y, batch_mean, batch_var)`: `y` has x's dtype and shape; `batch_mean` and `batch_var` are
/// detached f32 `[C]` tensors, `batch_var` being the *biased* variance used for normalization (the
/// caller converts it to the unbiased one for its running statistics if it wants that).
///
/// `y` is differentiable with respect to `x`, `gamma` and `beta` (the full BatchNorm backward,
/// including the batch-statistics terms; with `relu` the upstream gradient is masked where `y <= 0`).
pub fn batch_norm_train(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f64,
    relu: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    check_inputs("batch_norm_train", x, gamma, beta, eps, &[])?;
    let x = x.contiguous()?;
    let gamma = gamma.contiguous()?;
    let beta = beta.contiguous()?;
    // Statistics first, without autograd: they are needed by the normalization and returned detached.
    let stats = x.apply_op1_no_bwd(&BnStats)?;
    let y = x.apply_op3(
        &gamma,
        &beta,
        BnNorm {
            stats: stats.clone(),
            eps: eps as f32,
            relu,
        },
    )?;
    Ok((y, stats.get(0)?, stats.get(1)?))
}

/// Inference-mode batch norm with running statistics (`running_mean`, `running_var`: f32 `[C]`),
/// optionally followed by ReLU; the output has x's dtype.
///
/// Not differentiable: meant for evaluation only (the result does not track gradients).
pub fn batch_norm_eval(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    running_mean: &Tensor,
    running_var: &Tensor,
    eps: f64,
    relu: bool,
) -> Result<Tensor> {
    check_inputs(
        "batch_norm_eval",
        x,
        gamma,
        beta,
        eps,
        &[("running_mean", running_mean), ("running_var", running_var)],
    )?;
    let x = x.contiguous()?;
    let gamma = gamma.detach().contiguous()?;
    let beta = beta.detach().contiguous()?;
    // The normalization kernel reads a [2, C] (mean; var) tensor, the layout `BnStats` produces.
    let stats = Tensor::stack(&[running_mean.detach(), running_var.detach()], 0)?;
    x.apply_op3_no_bwd(
        &gamma,
        &beta,
        &BnNorm {
            stats,
            eps: eps as f32,
            relu,
        },
    )
}

/// Validates shapes, dtypes and devices up front so that misuse is an error, not a panic or an
/// out-of-bounds read inside a kernel.
fn check_inputs(
    op: &str,
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f64,
    extra: &[(&str, &Tensor)],
) -> Result<()> {
    let fail = |msg: String| -> Result<()> { Err(candle_core::Error::Msg(format!("{op}: {msg}"))) };
    let dims = x.dims();
    if dims.len() != 4 {
        return fail(format!("x must be [N, C, H, W], got shape {:?}", dims));
    }
    if dims.contains(&0) {
        return fail(format!("x must not be empty, got shape {:?}", dims));
    }
    // The CUDA kernels index with 32-bit integers.
    if x.elem_count() > i32::MAX as usize {
        return fail(format!(
            "x has {} elements, more than the supported {}",
            x.elem_count(),
            i32::MAX
        ));
    }
    if !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return fail(format!("x must be f32, f16 or bf16, got {:?}", x.dtype()));
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return fail(format!("eps must be finite and non-negative, got {eps}"));
    }
    let c = dims[1];
    for (name, t) in [("gamma", gamma), ("beta", beta)]
        .iter()
        .chain(extra.iter())
    {
        if t.dims() != [c] {
            return fail(format!(
                "{name} must have shape [{c}] (the channels of x), got {:?}",
                t.dims()
            ));
        }
        if t.dtype() != DType::F32 {
            return fail(format!("{name} must be f32, got {:?}", t.dtype()));
        }
        if !t.device().same_device(x.device()) {
            return fail(format!(
                "{name} is on {:?} but x is on {:?}",
                t.device().location(),
                x.device().location()
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The custom ops.
// ---------------------------------------------------------------------------------------------

/// Per-channel mean and biased variance of x, as an f32 `[2, C]` tensor.
struct BnStats;

/// Normalization (+ ReLU) of x with the `[2, C]` statistics it holds; its backward is the full
/// training-mode BatchNorm backward.
struct BnNorm {
    stats: Tensor,
    eps: f32,
    relu: bool,
}

/// Backward, part 1: f32 `[2, C]` with row 0 = grad_gamma (`Σg'·x̂`), row 1 = grad_beta (`Σg'`).
/// Arguments: (x, grad_y, y).
struct BnBwdReduce {
    stats: Tensor,
    eps: f32,
    relu: bool,
}

/// Backward, part 2: grad_x in x's dtype from x, grad_y, y and the per-channel sums of part 1.
/// Arguments: (x, grad_y, y).
struct BnBwdInput {
    stats: Tensor,
    gamma: Tensor,
    sums: Tensor,
    eps: f32,
    relu: bool,
}

/// `dispatch_float!` over the activation dtypes every BatchNorm op takes (f32, f16, bf16), any
/// other dtype an error of op `$name`: the one dispatch of all the ops below.
macro_rules! bn_dispatch {
    ($dtype:expr, $name:expr, |$t:ident| $body:expr $(,)?) => {
        dispatch_float!($dtype, [F32, F16, BF16], |$t| $body, |dt| return Err(
            unsupported($name, dt)
        ))
    };
}

/// The `cuda_fwd` of a `CustomOp3` on `(x, a, b)`: `cuda::$kernel::<T>(op, operands.., dims)` on x's
/// dtype, the result shaped by `$shape(dims, x's layout)`. The three such ops differ only in
/// their kernel and result shape, so their CUDA halves are this one body.
macro_rules! cuda_fwd3 {
    ($kernel:ident, $shape:path) => {
        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            s1: &candle_core::CudaStorage,
            l1: &Layout,
            s2: &candle_core::CudaStorage,
            l2: &Layout,
            s3: &candle_core::CudaStorage,
            l3: &Layout,
        ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
            let d = dims_of(l1)?;
            let out = bn_dispatch!(s1.dtype(), self.name(), |T| cuda::$kernel::<T>(
                self, s1, l1, s2, l2, s3, l3, d
            )?);
            Ok((out, $shape(d, l1)))
        }
    };
}

impl CustomOp1 for BnStats {
    fn name(&self) -> &'static str {
        "batch-norm-stats"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = dims_of(l)?;
        let out = bn_dispatch!(s.dtype(), self.name(), |T| cpu::stats::<T>(
            cpu_slice(s, l, "x")?,
            d
        ));
        Ok((CpuStorage::F32(out), per_channel_pair(d, l)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let d = dims_of(l)?;
        let out = bn_dispatch!(s.dtype(), self.name(), |T| cuda::stats::<T>(s, l, d)?);
        Ok((out, per_channel_pair(d, l)))
    }
}

impl CustomOp3 for BnNorm {
    fn name(&self) -> &'static str {
        "batch-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = dims_of(l1)?;
        let gamma = cpu_slice::<f32>(s2, l2, "gamma")?;
        let beta = cpu_slice::<f32>(s3, l3, "beta")?;
        let stats = &held_vec(&self.stats, "batch statistics")?;
        let ch = cpu::NormChannels::new(gamma, beta, stats, d.c, self.eps);
        let out = bn_dispatch!(s1.dtype(), self.name(), |T| {
            T::to_cpu_storage_owned(cpu::norm::<T>(cpu_slice(s1, l1, "x")?, &ch, d, self.relu))
        });
        Ok((out, like_x(d, l1)))
    }

    cuda_fwd3!(norm, like_x);

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        _beta: &Tensor,
        y: &Tensor,
        grad_y: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The kernels read the upstream gradient as a dense array of x's dtype.
        let grad_y = grad_y.to_dtype(x.dtype())?.contiguous()?;
        let sums = x.apply_op3_no_bwd(
            &grad_y,
            y,
            &BnBwdReduce {
                stats: self.stats.clone(),
                eps: self.eps,
                relu: self.relu,
            },
        )?;
        // x is the input of a layer whose gradient nobody needs (e.g. raw data): skip the largest
        // output of the backward.
        let grad_x = if x.track_op() {
            Some(x.apply_op3_no_bwd(
                &grad_y,
                y,
                &BnBwdInput {
                    stats: self.stats.clone(),
                    gamma: gamma.detach(),
                    sums: sums.clone(),
                    eps: self.eps,
                    relu: self.relu,
                },
            )?)
        } else {
            None
        };
        Ok((grad_x, Some(sums.get(0)?), Some(sums.get(1)?)))
    }
}

impl CustomOp3 for BnBwdReduce {
    fn name(&self) -> &'static str {
        "batch-norm-bwd-reduce"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = dims_of(l1)?;
        let stats = &held_vec(&self.stats, "batch statistics")?;
        let out = bn_dispatch!(s1.dtype(), self.name(), |T| {
            cpu::bwd_reduce::<T>(
                cpu_slice(s1, l1, "x")?,
                cpu_slice(s2, l2, "grad_y")?,
                cpu_slice(s3, l3, "y")?,
                stats,
                d,
                self.eps,
                self.relu,
            )
        });
        Ok((CpuStorage::F32(out), per_channel_pair(d, l1)))
    }

    cuda_fwd3!(bwd_reduce, per_channel_pair);
}

impl CustomOp3 for BnBwdInput {
    fn name(&self) -> &'static str {
        "batch-norm-bwd-input"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = dims_of(l1)?;
        let coef = cpu::InputGradChannels::new(
            &held_vec(&self.gamma, "gamma")?,
            &held_vec(&self.stats, "batch statistics")?,
            &held_vec(&self.sums, "gradient sums")?,
            d,
            self.eps,
        );
        let out = bn_dispatch!(s1.dtype(), self.name(), |T| {
            T::to_cpu_storage_owned(cpu::bwd_input::<T>(
                cpu_slice(s1, l1, "x")?,
                cpu_slice(s2, l2, "grad_y")?,
                cpu_slice(s3, l3, "y")?,
                &coef,
                d,
                self.relu,
            ))
        });
        Ok((out, like_x(d, l1)))
    }

    cuda_fwd3!(bwd_input, like_x);
}

/// The sizes every kernel works with: `hw` is the length of one `[H, W]` plane, planes are laid out
/// `n * c + channel`.
#[derive(Clone, Copy, Debug)]
struct Dims {
    n: usize,
    c: usize,
    hw: usize,
}

impl Dims {
    /// Elements per channel (the count the statistics are taken over).
    fn m(&self) -> usize {
        self.n * self.hw
    }

    fn planes(&self) -> usize {
        self.n * self.c
    }
}

/// Blocks per channel of the CUDA kernels' split reductions over `n` images of `hw`-element planes:
/// about 4K elements per block (several blocks per SM at CIFAR shapes, so that enough loads are in
/// flight), at most 64, and at least one image per block. Host arithmetic, here so that the
/// self-check's shape tests can use it on the CPU.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn cuda_split(n: usize, hw: usize) -> usize {
    (n * hw / 4096).clamp(1, 64).min(n)
}

fn unsupported(op: &str, dtype: DType) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "{op}: unsupported dtype {dtype:?} (f32, f16 or bf16 only)"
    ))
}

/// The name of the op in errors.
const OP: &str = "batch norm";

/// The contiguous data of a CPU storage argument.
fn cpu_slice<'a, T: WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<&'a [T]> {
    util::cpu_slice(s, l, OP, what)
}

/// The contiguous data of a CPU storage argument an in-place op writes.
fn cpu_slice_mut<'a, T: Float>(
    s: &'a mut CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<&'a mut [T]> {
    util::cpu_slice_mut(s, l, OP, what)
}

/// The contiguous f32 data of a tensor held by an op (statistics, gamma, sums), which must live on the
/// CPU like the op's arguments.
fn cpu_tensor_slice<'a>(s: &'a Storage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    match s {
        Storage::Cpu(cs) => cpu_slice(cs, l, what),
        _ => Err(candle_core::Error::Msg(format!(
            "{OP}: {what} is not on the CPU like x"
        ))),
    }
}

/// The contiguous f32 data of a small tensor held by an op (statistics, gamma, sums: C or 2·C
/// floats, so the copy is negligible), copied out of its storage.
fn held_vec(t: &Tensor, what: &str) -> candle_core::Result<Vec<f32>> {
    let (guard, l) = t.storage_and_layout();
    Ok(cpu_tensor_slice(&guard, l, what)?.to_vec())
}

/// The result shape of the ops whose result is shaped like x (their first operand).
fn like_x(_: Dims, l: &Layout) -> Shape {
    l.shape().clone()
}

/// The result shape of the per-channel sums: `[2, C]`.
fn per_channel_pair(d: Dims, _: &Layout) -> Shape {
    Shape::from((2, d.c))
}

fn dims_of(l: &Layout) -> candle_core::Result<Dims> {
    let (n, c, h, w) = l.shape().dims4()?;
    Ok(Dims { n, c, hw: h * w })
}

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod lean;

pub use lean::{
    batch_stats, bn_relu, bn_relu_backward, bn_relu_backward_input, bn_relu_backward_sums,
    bn_relu_decisions, bn_relu_in_place, bn_relu_pool, bn_relu_pool_argmax, bn_relu_pool_backward,
    bn_relu_pool_backward_input, bn_relu_pool_backward_sums, cpu_host_bytes, decisions_dims,
    update_running, BnGrads, BnParams, CpuPass,
};
