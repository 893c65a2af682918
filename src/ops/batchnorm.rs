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
//! thread count). CUDA: the kernels of `kernels/batchnorm.cu`, compiled once per process with
//! NVRTC. Dtype dispatch, operand access and launches go through [`super::util`].

use std::ops::Range;

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Storage, Tensor, WithDType,
};

use super::util::{self, dispatch_float, Float};
use crate::error::Result;

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
    Ok(x.apply_op3_no_bwd(
        &gamma,
        &beta,
        &BnNorm {
            stats,
            eps: eps as f32,
            relu,
        },
    )?)
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
    let fail =
        |msg: String| -> Result<()> { Err(candle_core::Error::Msg(format!("{op}: {msg}")).into()) };
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

// ---------------------------------------------------------------------------------------------
// The lean training step (src/train/lean.rs): BatchNorm + ReLU recomputed from the saved
// pre-normalization tensor h instead of autograd keeping x and y.
//
// Why h and not the ReLU output y (in-place activated BatchNorm keeps y): with a plain ReLU, y
// does not determine the normalized value where the ReLU clipped, and the BatchNorm input gradient
// needs it there too (`grad_h = γ·invstd·(g' − Σg'/M − x̂·Σg'x̂/M)` is non-zero at clipped
// positions through the x̂ term). Keeping h loses nothing, has no division by γ (so γ = 0 is an
// ordinary value), and y is recomputed bit-identically from h with the statistics of the forward.
// On the CPU every pass below is one fused kernel, and the backward overwrites a buffer it owns
// instead of allocating; on other devices the same results come from the ops above (y
// materialized, the max-pool op of `ops::pool`), at the cost of transient buffers.
// ---------------------------------------------------------------------------------------------

/// Per-channel batch mean and biased variance of `h` `[N, C, H, W]` as an f32 `[2, C]` tensor (row 0
/// mean, row 1 variance); no autograd.
pub fn batch_stats(h: &Tensor) -> Result<Tensor> {
    let h = h.contiguous()?;
    Ok(h.apply_op1_no_bwd(&BnStats)?)
}

/// Running statistics of PyTorch's convention from batch `stats` ([2, C], biased variance over
/// `count` elements per channel): `(1-m)·old + m·batch`, the variance made unbiased.
pub fn update_running(
    running_mean: &Tensor,
    running_var: &Tensor,
    stats: &Tensor,
    count: usize,
    momentum: f64,
) -> Result<(Tensor, Tensor)> {
    let mean = stats.get(0)?;
    let var = stats.get(1)?;
    let unbiased = if count > 1 {
        (var * (count as f64 / (count as f64 - 1.0)))?
    } else {
        var
    };
    let m = momentum;
    let rm = ((running_mean * (1.0 - m))? + (mean * m)?)?;
    let rv = ((running_var * (1.0 - m))? + (unbiased * m)?)?;
    Ok((rm, rv))
}

/// The per-channel parameters every lean BatchNorm pass reads.
#[derive(Clone)]
pub struct BnParams {
    /// Scale γ, f32 `[C]` (detached).
    pub gamma: Tensor,
    /// Shift β, f32 `[C]` (detached).
    pub beta: Tensor,
    /// Batch statistics of the forward, f32 `[2, C]` (see [`batch_stats`]).
    pub stats: Tensor,
    /// Numerical epsilon.
    pub eps: f64,
    /// True when `stats` are the batch's own statistics (training); false when they are fixed
    /// running statistics (a frozen BatchNorm), whose backward has no batch-statistics terms.
    pub batch_stats: bool,
}

impl BnParams {
    fn norm_op(&self) -> BnNorm {
        BnNorm {
            stats: self.stats.clone(),
            eps: self.eps as f32,
            relu: true,
        }
    }

    fn lean(&self) -> LeanBn {
        LeanBn {
            p: self.clone(),
            pool_w: None,
        }
    }
}

/// `relu(bn(h))` into a new tensor of h's dtype, with the statistics in `p`; no autograd.
pub fn bn_relu(h: &Tensor, p: &BnParams) -> Result<Tensor> {
    check_inputs("bn_relu", h, &p.gamma, &p.beta, p.eps, &[])?;
    let h = h.contiguous()?;
    Ok(h.apply_op3_no_bwd(&p.gamma, &p.beta, &p.norm_op())?)
}

/// `relu(bn(h))`, written over `h` on the CPU (the caller gives up `h`); a new tensor elsewhere.
pub fn bn_relu_in_place(h: Tensor, p: &BnParams) -> Result<Tensor> {
    if !h.device().is_cpu() || !h.is_contiguous() {
        return bn_relu(&h, p);
    }
    check_inputs("bn_relu_in_place", &h, &p.gamma, &p.beta, p.eps, &[])?;
    h.inplace_op1(&p.lean())?;
    Ok(h)
}

fn pool_width(op: &str, h: &Tensor) -> Result<usize> {
    let (_, _, hh, w) = h.dims4()?;
    if hh % 2 != 0 || w % 2 != 0 {
        return Err(
            candle_core::Error::Msg(format!("{op}: needs even H and W, got {hh}x{w}")).into(),
        );
    }
    Ok(w)
}

/// `maxpool2x2(relu(bn(h)))`; on the CPU without materializing `relu(bn(h))`.
pub fn bn_relu_pool(h: &Tensor, p: &BnParams) -> Result<Tensor> {
    check_inputs("bn_relu_pool", h, &p.gamma, &p.beta, p.eps, &[])?;
    let w = pool_width("bn_relu_pool", h)?;
    if !h.device().is_cpu() {
        return crate::ops::pool::max_pool2x2(&bn_relu(h, p)?);
    }
    let h = h.contiguous()?;
    Ok(h.apply_op1_no_bwd(&LeanBn {
        p: p.clone(),
        pool_w: Some(w),
    })?)
}

/// The argmax of every 2x2 window of `relu(bn(h))` as one u8 per pooled element (0..4, row-major,
/// first maximum on ties), or `None` on devices without the kernel (their pool backward
/// recomputes the ReLU output instead).
pub fn bn_relu_pool_argmax(h: &Tensor, p: &BnParams) -> Result<Option<Tensor>> {
    check_inputs("bn_relu_pool_argmax", h, &p.gamma, &p.beta, p.eps, &[])?;
    let w = pool_width("bn_relu_pool_argmax", h)?;
    if !h.device().is_cpu() {
        return Ok(None);
    }
    let h = h.contiguous()?;
    Ok(Some(h.apply_op1_no_bwd(&PoolArgmax {
        lean: LeanBn {
            p: p.clone(),
            pool_w: Some(w),
        },
    })?))
}

/// Gradients of one BatchNorm + ReLU: `(grad_h, grad_gamma, grad_beta)`, the last two f32 `[C]`.
pub type BnGrads = (Tensor, Tensor, Tensor);

/// Backward of `y = relu(bn(h))` from the saved `h` and the upstream gradient `g` (h's dtype and
/// shape). `g` is consumed: on the CPU the input gradient is written over it.
pub fn bn_relu_backward(h: &Tensor, g: Tensor, p: &BnParams) -> Result<BnGrads> {
    check_inputs("bn_relu_backward", h, &p.gamma, &p.beta, p.eps, &[])?;
    let h = h.contiguous()?;
    let g = g.to_dtype(h.dtype())?.contiguous()?;
    if !h.device().is_cpu() {
        let y = bn_relu(&h, p)?;
        return backward_via_y(&h, &g, &y, p);
    }
    let sums = h.apply_op2_no_bwd(&g, &p.lean())?;
    g.inplace_op2(
        &h,
        &LeanBwdInput {
            lean: p.lean(),
            sums: sums.clone(),
        },
    )?;
    Ok((g, sums.get(0)?, sums.get(1)?))
}

/// Backward of `p = maxpool2x2(relu(bn(h)))` from the saved `h`, the gradient `gp` of the pooled
/// output and the window argmax of [`bn_relu_pool_argmax`] (`None`: recomputed through the ReLU
/// output). `h` is consumed: on the CPU the input gradient is written over it.
pub fn bn_relu_pool_backward(
    h: Tensor,
    gp: &Tensor,
    argmax: Option<&Tensor>,
    p: &BnParams,
) -> Result<BnGrads> {
    check_inputs("bn_relu_pool_backward", &h, &p.gamma, &p.beta, p.eps, &[])?;
    let w = pool_width("bn_relu_pool_backward", &h)?;
    let h = h.contiguous()?;
    let gp = gp.to_dtype(h.dtype())?.contiguous()?;
    match argmax {
        Some(am) if h.device().is_cpu() => {
            let am = am.contiguous()?;
            let lean = LeanBn {
                p: p.clone(),
                pool_w: Some(w),
            };
            let sums = h.apply_op3_no_bwd(&gp, &am, &PoolBwdReduce { lean: lean.clone() })?;
            h.inplace_op3(
                &gp,
                &am,
                &LeanBwdInput {
                    lean,
                    sums: sums.clone(),
                },
            )?;
            Ok((h, sums.get(0)?, sums.get(1)?))
        }
        _ => {
            let y = bn_relu(&h, p)?;
            let g = crate::ops::pool::max_pool2x2_backward(&y, &gp)?;
            backward_via_y(&h, &g, &y, p)
        }
    }
}

/// The BatchNorm + ReLU backward through the ops autograd uses (devices without the lean kernels).
fn backward_via_y(h: &Tensor, g: &Tensor, y: &Tensor, p: &BnParams) -> Result<BnGrads> {
    let sums = h.apply_op3_no_bwd(
        g,
        y,
        &BnBwdReduce {
            stats: p.stats.clone(),
            eps: p.eps as f32,
            relu: true,
        },
    )?;
    let input_sums = if p.batch_stats {
        sums.clone()
    } else {
        sums.zeros_like()?
    };
    let gh = h.apply_op3_no_bwd(
        g,
        y,
        &BnBwdInput {
            stats: p.stats.clone(),
            gamma: p.gamma.clone(),
            sums: input_sums,
            eps: p.eps as f32,
            relu: true,
        },
    )?;
    Ok((gh, sums.get(0)?, sums.get(1)?))
}

/// The lean kernels' shared state: parameters, and the plane width when a 2x2 pool follows.
#[derive(Clone)]
struct LeanBn {
    p: BnParams,
    pool_w: Option<usize>,
}

/// Argmax of the pooled windows (a separate type: `LeanBn`'s `CustomOp1` is the pooled values).
struct PoolArgmax {
    lean: LeanBn,
}

/// Per-channel sums of the backward after a pool: (h, gp, argmax) → `[Σg'x̂; Σg']`.
struct PoolBwdReduce {
    lean: LeanBn,
}

/// The input gradient written in place (over g without a pool, over h after one).
struct LeanBwdInput {
    lean: LeanBn,
    sums: Tensor,
}

/// The host copies of the per-channel tensors a lean kernel reads (C floats each).
struct LeanCtx {
    gamma: Vec<f32>,
    beta: Vec<f32>,
    stats: Vec<f32>,
}

/// The contiguous f32 data of a small tensor held by an op (statistics, gamma, sums: C or 2·C
/// floats, so the copy is negligible), copied out of its storage.
fn held_vec(t: &Tensor, what: &str) -> candle_core::Result<Vec<f32>> {
    let (guard, l) = t.storage_and_layout();
    Ok(cpu_tensor_slice(&guard, l, what)?.to_vec())
}

impl LeanBn {
    fn ctx(&self) -> candle_core::Result<LeanCtx> {
        Ok(LeanCtx {
            gamma: held_vec(&self.p.gamma, "gamma")?,
            beta: held_vec(&self.p.beta, "beta")?,
            stats: held_vec(&self.p.stats, "batch statistics")?,
        })
    }
}

impl LeanCtx {
    fn norm(&self, c: usize, eps: f64) -> cpu::NormChannels {
        cpu::NormChannels::new(&self.gamma, &self.beta, &self.stats, c, eps as f32)
    }
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

fn pooled_shape(l: &Layout) -> candle_core::Result<Shape> {
    let (n, c, h, w) = l.shape().dims4()?;
    Ok(Shape::from((n, c, h / 2, w / 2)))
}

impl candle_core::InplaceOp1 for LeanBn {
    fn name(&self) -> &'static str {
        "bn-relu-in-place"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let d = dims_of(l)?;
        let ctx = self.ctx()?;
        let ch = ctx.norm(d.c, self.p.eps);
        bn_dispatch!(s.dtype(), "bn-relu-in-place", |T| cpu::relu_in_place::<T>(
            cpu_slice_mut(s, l, "h")?,
            &ch,
            d
        ));
        Ok(())
    }
}

impl CustomOp1 for LeanBn {
    fn name(&self) -> &'static str {
        "bn-relu-pool"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = dims_of(l)?;
        let w = self
            .pool_w
            .ok_or_else(|| candle_core::Error::Msg("bn-relu-pool: no pool".into()))?;
        let ctx = self.ctx()?;
        let ch = ctx.norm(d.c, self.p.eps);
        let out = bn_dispatch!(s.dtype(), "bn-relu-pool", |T| T::to_cpu_storage_owned(
            cpu::relu_pool::<T>(cpu_slice(s, l, "h")?, &ch, d, w)
        ));
        Ok((out, pooled_shape(l)?))
    }
}

impl CustomOp1 for PoolArgmax {
    fn name(&self) -> &'static str {
        "bn-relu-pool-argmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = dims_of(l)?;
        let w = self.lean.pool_w.unwrap_or(1);
        let ctx = self.lean.ctx()?;
        let ch = ctx.norm(d.c, self.lean.p.eps);
        let out = bn_dispatch!(s.dtype(), self.name(), |T| cpu::relu_pool_argmax::<T>(
            cpu_slice(s, l, "h")?,
            &ch,
            d,
            w
        ));
        Ok((CpuStorage::U8(out), pooled_shape(l)?))
    }
}

/// Sums of the BatchNorm + ReLU backward without a pool: (h, g) → `[Σg'x̂; Σg']`.
impl CustomOp2 for LeanBn {
    fn name(&self) -> &'static str {
        "bn-relu-bwd-reduce"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = dims_of(l1)?;
        let ctx = self.ctx()?;
        let ch = ctx.norm(d.c, self.p.eps);
        let var = &ctx.stats[d.c..];
        let out = bn_dispatch!(s1.dtype(), "bn-relu-bwd-reduce", |T| {
            cpu::bwd_reduce_from_h::<T>(
                cpu_slice(s1, l1, "h")?,
                cpu_slice(s2, l2, "grad_y")?,
                None,
                &ch,
                var,
                d,
                self.p.eps as f32,
            )
        });
        Ok((CpuStorage::F32(out), per_channel_pair(d, l1)))
    }
}

impl CustomOp3 for PoolBwdReduce {
    fn name(&self) -> &'static str {
        "bn-relu-pool-bwd-reduce"
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
        let w = self.lean.pool_w.unwrap_or(1);
        let ctx = self.lean.ctx()?;
        let ch = ctx.norm(d.c, self.lean.p.eps);
        let var = &ctx.stats[d.c..];
        let am = cpu_slice::<u8>(s3, l3, "argmax")?;
        let out = bn_dispatch!(s1.dtype(), self.name(), |T| {
            cpu::bwd_reduce_from_h::<T>(
                cpu_slice(s1, l1, "h")?,
                cpu_slice(s2, l2, "grad_p")?,
                Some((am, w)),
                &ch,
                var,
                d,
                self.lean.p.eps as f32,
            )
        });
        Ok((CpuStorage::F32(out), per_channel_pair(d, l1)))
    }
}

impl LeanBwdInput {
    fn coef(&self, ctx: &LeanCtx, d: Dims) -> candle_core::Result<cpu::InputGradChannels> {
        // Fixed statistics: grad_h = γ·invstd·g', i.e. the batch-statistics terms with zero sums.
        let sums = if self.lean.p.batch_stats {
            held_vec(&self.sums, "gradient sums")?
        } else {
            vec![0.0; 2 * d.c]
        };
        Ok(cpu::InputGradChannels::new(
            &ctx.gamma,
            &ctx.stats,
            &sums,
            d,
            self.lean.p.eps as f32,
        ))
    }
}

/// Without a pool: dst = g (overwritten with grad_h), src = h.
impl candle_core::InplaceOp2 for LeanBwdInput {
    fn name(&self) -> &'static str {
        "bn-relu-bwd-input-in-place"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        h: &CpuStorage,
        hl: &Layout,
    ) -> candle_core::Result<()> {
        let d = dims_of(dst_l)?;
        let ctx = self.lean.ctx()?;
        let ch = ctx.norm(d.c, self.lean.p.eps);
        let co = self.coef(&ctx, d)?;
        bn_dispatch!(h.dtype(), self.name(), |T| {
            cpu::bwd_input_from_h::<T>(
                cpu_slice_mut(dst, dst_l, "grad_y")?,
                Some(cpu_slice(h, hl, "h")?),
                None,
                &ch,
                &co,
                d,
            )
        });
        Ok(())
    }
}

/// After a pool: dst = h (overwritten with grad_h), srcs = (gp, argmax).
impl candle_core::InplaceOp3 for LeanBwdInput {
    fn name(&self) -> &'static str {
        "bn-relu-pool-bwd-input-in-place"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        gp: &CpuStorage,
        gl: &Layout,
        am: &CpuStorage,
        al: &Layout,
    ) -> candle_core::Result<()> {
        let d = dims_of(dst_l)?;
        let w = self.lean.pool_w.unwrap_or(1);
        let ctx = self.lean.ctx()?;
        let ch = ctx.norm(d.c, self.lean.p.eps);
        let co = self.coef(&ctx, d)?;
        let am = cpu_slice::<u8>(am, al, "argmax")?;
        bn_dispatch!(gp.dtype(), self.name(), |T| {
            cpu::bwd_input_from_h::<T>(
                cpu_slice_mut(dst, dst_l, "h")?,
                None,
                Some((cpu_slice(gp, gl, "grad_p")?, am, w)),
                &ch,
                &co,
                d,
            )
        });
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// CPU kernels.
// ---------------------------------------------------------------------------------------------

mod cpu {
    use super::*;

    /// Elements are converted to f32 in blocks of this many, in a stack buffer (L1-resident); it is
    /// also the unit whose f32 sum is added to an f64 accumulator, so that a plane of any size sums
    /// accurately.
    const BLK: usize = 256;

    /// Below this many elements a pass runs on the calling thread: waking the pool costs more.
    const PAR_MIN_ELEMS: usize = 1 << 15;

    /// An activation dtype (f32, f16, bf16): a [`Float`] whose arithmetic type is f32.
    pub(super) trait Elem: Float<Acc = f32> {}

    impl<T: Float<Acc = f32>> Elem for T {}

    /// One block of `src` as f32: the data itself for f32, else converted into `buf`.
    #[inline(always)]
    fn block<'a, T: Elem>(src: &'a [T], buf: &'a mut [f32; BLK]) -> &'a [f32] {
        match T::as_acc(src) {
            Some(s) => s,
            None => {
                let b = &mut buf[..src.len()];
                T::widen(src, b);
                b
            }
        }
    }

    /// A raw pointer the pool's workers may share; each writes a disjoint range.
    #[derive(Clone, Copy)]
    struct SharedMut<U>(*mut U);
    // SAFETY: only used to hand disjoint sub-slices of one buffer to worker threads.
    unsafe impl<U: Send> Send for SharedMut<U> {}
    unsafe impl<U: Send> Sync for SharedMut<U> {}

    impl<U> SharedMut<U> {
        /// # Safety
        /// `start..start + len` must be in bounds and not accessed by anyone else meanwhile.
        #[allow(clippy::mut_from_ref)]
        unsafe fn range(&self, start: usize, len: usize) -> &mut [U] {
            std::slice::from_raw_parts_mut(self.0.add(start), len)
        }
    }

    /// Runs `f` over ranges of planes covering `0..planes`, on Candle's persistent CPU thread pool
    /// (no thread spawned per call) when there is enough work, else on the calling thread.
    fn for_planes(d: Dims, f: impl Fn(Range<usize>) + Sync) {
        let planes = d.planes();
        let pool = candle_core::utils::barrier_pool();
        if planes * d.hw < PAR_MIN_ELEMS || pool.n_workers() == 0 || planes == 1 {
            f(0..planes)
        } else {
            pool.execute_chunked(planes, f)
        }
    }

    /// Computes one value per plane in parallel (`f(plane index, plane data)`).
    fn per_plane<T: Elem, U: Copy + Default + Send>(
        x: &[T],
        d: Dims,
        f: impl Fn(usize, &[T]) -> U + Sync,
    ) -> Vec<U> {
        per_plane_with(x, d, || (), |_, p, plane| f(p, plane))
    }

    /// [`per_plane`] with a scratch value made once per worker's range of planes (`scratch()`),
    /// not once per plane.
    fn per_plane_with<T: Elem, U: Copy + Default + Send, S>(
        x: &[T],
        d: Dims,
        scratch: impl Fn() -> S + Sync,
        f: impl Fn(&mut S, usize, &[T]) -> U + Sync,
    ) -> Vec<U> {
        let mut out = vec![U::default(); d.planes()];
        let ptr = SharedMut(out.as_mut_ptr());
        for_planes(d, |r| {
            // SAFETY: the pool hands out disjoint plane ranges within 0..planes.
            let o = unsafe { ptr.range(r.start, r.len()) };
            let mut s = scratch();
            for (p, slot) in r.zip(o.iter_mut()) {
                *slot = f(&mut s, p, &x[p * d.hw..(p + 1) * d.hw]);
            }
        });
        out
    }

    /// Sums per-plane partials into per-channel totals (planes are `n * c + channel`).
    fn per_channel<U: Copy>(part: &[U], d: Dims, zero: U, add: impl Fn(U, U) -> U) -> Vec<U> {
        let mut acc = vec![zero; d.c];
        for chunk in part.chunks_exact(d.c) {
            for (a, &v) in acc.iter_mut().zip(chunk) {
                *a = add(*a, v);
            }
        }
        acc
    }

    // The reductions below keep eight independent f32 lanes so that the loops vectorize (a single
    // accumulator would force strictly sequential float adds); chunks_exact lets LLVM drop the
    // bounds checks. They are called once per block and kept out of line: inlined into the plane
    // loops, LLVM turned the ReLU mask into one branch per lane (measured 10-30× slower).

    /// `Σ x`.
    #[inline(never)]
    fn sum(x: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        let xs = x.chunks_exact(8);
        let tail: f32 = xs.remainder().iter().sum();
        for xc in xs {
            for l in 0..8 {
                acc[l] += xc[l];
            }
        }
        acc.iter().sum::<f32>() + tail
    }

    /// `Σ (x - mu)²`.
    #[inline(never)]
    fn sum_sq_dev(x: &[f32], mu: f32) -> f32 {
        let mut acc = [0f32; 8];
        let xs = x.chunks_exact(8);
        let tail: f32 = xs.remainder().iter().map(|&v| (v - mu) * (v - mu)).sum();
        for xc in xs {
            for l in 0..8 {
                let t = xc[l] - mu;
                acc[l] += t * t;
            }
        }
        acc.iter().sum::<f32>() + tail
    }

    /// `g` where `y > 0`, else +0. Done with a bit mask rather than a branch or a select: ReLU
    /// inputs are positive about half the time at random, so a branch mispredicts every other
    /// element (measured 10× slower), and the and-mask vectorizes.
    #[inline(always)]
    fn relu_mask(g: f32, y: f32) -> f32 {
        f32::from_bits(g.to_bits() & ((y > 0.0) as u32).wrapping_neg())
    }

    /// `(Σ g', Σ g'·(x - mu))` with `g' = g` where `y > 0` (or everywhere when `y` is `None`), else 0.
    #[inline(never)]
    fn grad_sums(x: &[f32], g: &[f32], y: Option<&[f32]>, mu: f32) -> (f32, f32) {
        let (mut sg, mut sgx) = ([0f32; 8], [0f32; 8]);
        let n = x.len() / 8 * 8;
        let (mut tg, mut tgx) = (0f32, 0f32);
        match y {
            Some(y) => {
                for ((xc, gc), yc) in x
                    .chunks_exact(8)
                    .zip(g.chunks_exact(8))
                    .zip(y.chunks_exact(8))
                {
                    for l in 0..8 {
                        let gm = relu_mask(gc[l], yc[l]);
                        sg[l] += gm;
                        sgx[l] += gm * (xc[l] - mu);
                    }
                }
                for i in n..x.len() {
                    let gm = relu_mask(g[i], y[i]);
                    tg += gm;
                    tgx += gm * (x[i] - mu);
                }
            }
            None => {
                for (xc, gc) in x.chunks_exact(8).zip(g.chunks_exact(8)) {
                    for l in 0..8 {
                        sg[l] += gc[l];
                        sgx[l] += gc[l] * (xc[l] - mu);
                    }
                }
                for i in n..x.len() {
                    tg += g[i];
                    tgx += g[i] * (x[i] - mu);
                }
            }
        }
        (sg.iter().sum::<f32>() + tg, sgx.iter().sum::<f32>() + tgx)
    }

    /// `out = (x - mu) * s + b`, then ReLU.
    #[inline(never)]
    fn normalize(x: &[f32], mu: f32, s: f32, b: f32, relu: bool, out: &mut [f32]) {
        if relu {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = ((v - mu) * s + b).max(0.0);
            }
        } else {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = (v - mu) * s + b;
            }
        }
    }

    /// `out = a·(g' + b·(x - mu) + k)` with `g'` the ReLU-masked gradient (`[mu, a, b, k]`).
    #[inline(never)]
    fn input_grad(
        x: &[f32],
        g: &[f32],
        y: Option<&[f32]>,
        [mu, a, b, k]: [f32; 4],
        out: &mut [f32],
    ) {
        match y {
            Some(y) => {
                for (((o, &xv), &gv), &yv) in out.iter_mut().zip(x).zip(g).zip(y) {
                    *o = a * (relu_mask(gv, yv) + b * (xv - mu) + k);
                }
            }
            None => {
                for ((o, &xv), &gv) in out.iter_mut().zip(x).zip(g) {
                    *o = a * (gv + b * (xv - mu) + k);
                }
            }
        }
    }

    /// Per-channel mean and biased variance, two-pass, as `[mean; var]` (length 2·C).
    pub(super) fn stats<T: Elem>(x: &[T], d: Dims) -> Vec<f32> {
        let m = d.m() as f64;
        let sums = per_plane(x, d, |_, plane| {
            let mut buf = [0f32; BLK];
            plane
                .chunks(BLK)
                .map(|c| sum(block(c, &mut buf)) as f64)
                .sum::<f64>()
        });
        let mean: Vec<f32> = per_channel(&sums, d, 0.0, |a, b| a + b)
            .iter()
            .map(|s| (s / m) as f32)
            .collect();
        let sq = per_plane(x, d, |p, plane| {
            let mu = mean[p % d.c];
            let mut buf = [0f32; BLK];
            plane
                .chunks(BLK)
                .map(|c| sum_sq_dev(block(c, &mut buf), mu) as f64)
                .sum::<f64>()
        });
        let var = per_channel(&sq, d, 0.0, |a, b| a + b);
        mean.iter()
            .copied()
            .chain(var.iter().map(|s| (s / m) as f32))
            .collect()
    }

    /// Per-channel constants of the normalization: `y = (x - mean) * scale + beta`.
    pub(super) struct NormChannels {
        mean: Vec<f32>,
        scale: Vec<f32>,
        beta: Vec<f32>,
    }

    impl NormChannels {
        pub(super) fn new(gamma: &[f32], beta: &[f32], stats: &[f32], c: usize, eps: f32) -> Self {
            let (mean, var) = stats.split_at(c);
            let scale = gamma
                .iter()
                .zip(var)
                .map(|(&g, &v)| (g as f64 * invstd(v, eps)) as f32)
                .collect();
            Self {
                mean: mean.to_vec(),
                scale,
                beta: beta.to_vec(),
            }
        }
    }

    /// `1 / sqrt(var + eps)` in f64 (computed once per channel, so the precision is free).
    fn invstd(var: f32, eps: f32) -> f64 {
        1.0 / (var as f64 + eps as f64).sqrt()
    }

    /// The normalization (+ ReLU) pass.
    pub(super) fn norm<T: Elem>(x: &[T], ch: &NormChannels, d: Dims, relu: bool) -> Vec<T> {
        let mut y = T::zeros(x.len());
        let ptr = SharedMut(y.as_mut_ptr());
        for_planes(d, |r| {
            let mut buf = [0f32; BLK];
            let mut res = [0f32; BLK];
            for p in r {
                let c = p % d.c;
                let (mu, s, b) = (ch.mean[c], ch.scale[c], ch.beta[c]);
                // SAFETY: planes are disjoint ranges of y; the pool hands each plane to one worker.
                let out = unsafe { ptr.range(p * d.hw, d.hw) };
                for (xc, oc) in x[p * d.hw..(p + 1) * d.hw]
                    .chunks(BLK)
                    .zip(out.chunks_mut(BLK))
                {
                    let xb = block(xc, &mut buf);
                    let rb = &mut res[..xb.len()];
                    normalize(xb, mu, s, b, relu, rb);
                    T::narrow(rb, oc);
                }
            }
        });
        y
    }

    /// `[Σg'·x̂; Σg']` per channel from per-plane `(Σg', Σg'·(x - mean))` partials.
    fn gamma_beta_grads(part: &[(f64, f64)], d: Dims, var: &[f32], eps: f32) -> Vec<f32> {
        let tot = per_channel(part, d, (0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
        let grad_gamma = tot
            .iter()
            .zip(var)
            .map(|(t, &v)| (t.1 * invstd(v, eps)) as f32);
        let grad_beta = tot.iter().map(|t| t.0 as f32);
        grad_gamma.chain(grad_beta).collect()
    }

    /// Per-channel `[Σg'·x̂ (grad_gamma); Σg' (grad_beta)]`, where `g'` is grad_y masked by `y > 0`
    /// when the ReLU is fused.
    pub(super) fn bwd_reduce<T: Elem>(
        x: &[T],
        gy: &[T],
        y: &[T],
        stats: &[f32],
        d: Dims,
        eps: f32,
        relu: bool,
    ) -> Vec<f32> {
        let (mean, var) = stats.split_at(d.c);
        let part = per_plane(x, d, |p, xp| {
            let mu = mean[p % d.c];
            let range = p * d.hw..(p + 1) * d.hw;
            let (gp, yp) = (&gy[range.clone()], &y[range]);
            let (mut bx, mut bg, mut by) = ([0f32; BLK], [0f32; BLK], [0f32; BLK]);
            let mut acc = (0f64, 0f64);
            for start in (0..d.hw).step_by(BLK) {
                let end = (start + BLK).min(d.hw);
                let xb = block(&xp[start..end], &mut bx);
                let gb = block(&gp[start..end], &mut bg);
                let yb = if relu {
                    Some(block(&yp[start..end], &mut by))
                } else {
                    None
                };
                let (sg, sgx) = grad_sums(xb, gb, yb, mu);
                acc.0 += sg as f64;
                acc.1 += sgx as f64;
            }
            acc
        });
        gamma_beta_grads(&part, d, var, eps)
    }

    /// Per-channel constants of the input gradient:
    /// `grad_x = a·(g' + b·(x - mean) + k)` with `a = gamma·invstd`, `b = -invstd·grad_gamma/M`,
    /// `k = -grad_beta/M`. Written with `x - mean` (not `b·x + const`) so that a large mean does not
    /// cancel away the precision.
    pub(super) struct InputGradChannels {
        mean: Vec<f32>,
        a: Vec<f32>,
        b: Vec<f32>,
        k: Vec<f32>,
    }

    impl InputGradChannels {
        pub(super) fn new(gamma: &[f32], stats: &[f32], sums: &[f32], d: Dims, eps: f32) -> Self {
            let (mean, var) = stats.split_at(d.c);
            let (grad_gamma, grad_beta) = sums.split_at(d.c);
            let m = d.m() as f64;
            let (mut a, mut b, mut k) = (Vec::new(), Vec::new(), Vec::new());
            for c in 0..d.c {
                let inv = invstd(var[c], eps);
                let ac = gamma[c] as f64 * inv;
                a.push(ac as f32);
                b.push((-inv * grad_gamma[c] as f64 / m) as f32);
                k.push((-(grad_beta[c] as f64) / m) as f32);
            }
            Self {
                mean: mean.to_vec(),
                a,
                b,
                k,
            }
        }
    }

    /// The input-gradient pass.
    pub(super) fn bwd_input<T: Elem>(
        x: &[T],
        gy: &[T],
        y: &[T],
        co: &InputGradChannels,
        d: Dims,
        relu: bool,
    ) -> Vec<T> {
        let mut out = T::zeros(x.len());
        let ptr = SharedMut(out.as_mut_ptr());
        for_planes(d, |r| {
            let (mut bx, mut bg, mut by, mut res) =
                ([0f32; BLK], [0f32; BLK], [0f32; BLK], [0f32; BLK]);
            for p in r {
                let c = p % d.c;
                let (mu, a, b, k) = (co.mean[c], co.a[c], co.b[c], co.k[c]);
                let base = p * d.hw;
                // SAFETY: planes are disjoint ranges of out; the pool hands each plane to one worker.
                let op = unsafe { ptr.range(base, d.hw) };
                for start in (0..d.hw).step_by(BLK) {
                    let end = (start + BLK).min(d.hw);
                    let xb = block(&x[base + start..base + end], &mut bx);
                    let gb = block(&gy[base + start..base + end], &mut bg);
                    let yb = if relu {
                        Some(block(&y[base + start..base + end], &mut by))
                    } else {
                        None
                    };
                    let rb = &mut res[..xb.len()];
                    input_grad(xb, gb, yb, [mu, a, b, k], rb);
                    T::narrow(rb, &mut op[start..end]);
                }
            }
        });
        out
    }

    // ---- The lean step's kernels: BatchNorm + ReLU (+ 2x2 max-pool) recomputed from the saved
    // ---- pre-normalization tensor h, forward and backward, in place where the data allows.

    /// `y(h) = relu((h - mean)·scale + beta)` of a block, rounded to T and widened back, so that a
    /// recomputed ReLU output (and its mask) is bit-identical to the one the forward stored in T.
    #[inline(always)]
    fn y_of<T: Elem>(hb: &[f32], ch: &NormChannels, c: usize, tmp: &mut [T], out: &mut [f32]) {
        normalize(hb, ch.mean[c], ch.scale[c], ch.beta[c], true, out);
        T::round(out, tmp);
    }

    /// `h := relu(bn(h))`, in place.
    pub(super) fn relu_in_place<T: Elem>(h: &mut [T], ch: &NormChannels, d: Dims) {
        let ptr = SharedMut(h.as_mut_ptr());
        for_planes(d, |r| {
            let (mut buf, mut res) = ([0f32; BLK], [0f32; BLK]);
            for p in r {
                let c = p % d.c;
                // SAFETY: planes are disjoint ranges of h; the pool hands each plane to one worker.
                let plane = unsafe { ptr.range(p * d.hw, d.hw) };
                for hc in plane.chunks_mut(BLK) {
                    let n = hc.len();
                    T::widen(hc, &mut buf[..n]);
                    normalize(
                        &buf[..n],
                        ch.mean[c],
                        ch.scale[c],
                        ch.beta[c],
                        true,
                        &mut res[..n],
                    );
                    T::narrow(&res[..n], hc);
                }
            }
        });
    }

    /// One plane of `y(h)` as f32 (rounded through T) into `y`, and the plane of h widened into `hf`.
    fn plane_y<T: Elem>(
        h: &[T],
        ch: &NormChannels,
        c: usize,
        hf: &mut [f32],
        y: &mut [f32],
        tmp: &mut [T],
    ) {
        T::widen(h, hf);
        for (hc, yc) in hf.chunks(BLK).zip(y.chunks_mut(BLK)) {
            y_of::<T>(hc, ch, c, tmp, yc);
        }
    }

    /// The 2x2 max-pool of `y(h)` per plane (`w` = plane width): `emit(plane, window, argmax, y)`.
    fn pool_planes<T: Elem>(
        h: &[T],
        ch: &NormChannels,
        d: Dims,
        w: usize,
        emit: impl Fn(usize, usize, usize, f32) + Sync,
    ) {
        let (ho, wo) = (d.hw / w / 2, w / 2);
        for_planes(d, |r| {
            let (mut hf, mut y) = (vec![0f32; d.hw], vec![0f32; d.hw]);
            let mut tmp = T::zeros(BLK);
            for p in r {
                plane_y::<T>(
                    &h[p * d.hw..(p + 1) * d.hw],
                    ch,
                    p % d.c,
                    &mut hf,
                    &mut y,
                    &mut tmp,
                );
                for oy in 0..ho {
                    for ox in 0..wo {
                        let i0 = 2 * oy * w + 2 * ox;
                        let v = [y[i0], y[i0 + 1], y[i0 + w], y[i0 + w + 1]];
                        let mut best = 0;
                        for k in 1..4 {
                            // Strictly greater: the first maximum wins ties (as ops::pool).
                            if v[k] > v[best] {
                                best = k;
                            }
                        }
                        emit(p, oy * wo + ox, best, v[best]);
                    }
                }
            }
        });
    }

    /// `maxpool2x2(relu(bn(h)))` without materializing the full-size ReLU output.
    pub(super) fn relu_pool<T: Elem>(h: &[T], ch: &NormChannels, d: Dims, w: usize) -> Vec<T> {
        let per = d.hw / 4;
        let mut out = T::zeros(d.planes() * per);
        let ptr = SharedMut(out.as_mut_ptr());
        pool_planes::<T>(h, ch, d, w, |p, o, _, v| {
            // SAFETY: each (plane, window) is written once, by the worker that owns the plane.
            unsafe { ptr.range(p * per + o, 1)[0] = T::from_f32(v) };
        });
        out
    }

    /// The argmax (0..4, row-major in the window) of every 2x2 window of `relu(bn(h))`.
    pub(super) fn relu_pool_argmax<T: Elem>(
        h: &[T],
        ch: &NormChannels,
        d: Dims,
        w: usize,
    ) -> Vec<u8> {
        let per = d.hw / 4;
        let mut out = vec![0u8; d.planes() * per];
        let ptr = SharedMut(out.as_mut_ptr());
        pool_planes::<T>(h, ch, d, w, |p, o, k, _| {
            // SAFETY: each (plane, window) is written once, by the worker that owns the plane.
            unsafe { ptr.range(p * per + o, 1)[0] = k as u8 };
        });
        out
    }

    /// Where the upstream gradient of a pooled plane lands: `gp` scattered to each window's argmax
    /// (zero elsewhere), as a dense f32 plane.
    fn scatter_plane<T: Elem>(gp: &[T], am: &[u8], w: usize, out: &mut [f32]) {
        out.fill(0.0);
        let wo = w / 2;
        for (o, (&g, &k)) in gp.iter().zip(am).enumerate() {
            let (oy, ox) = (o / wo, o % wo);
            let k = k as usize & 3;
            out[(2 * oy + k / 2) * w + 2 * ox + k % 2] = g.to_f32();
        }
    }

    /// Per-channel `[Σg'·x̂; Σg']` of BatchNorm + ReLU (+ pool) from the saved pre-normalization h:
    /// `g'` is the upstream gradient (`g`, or `gp` scattered through `argmax` when `pool_w` is
    /// given) masked where the recomputed `y(h)` is 0. Summed in blocks of `BLK` (f32) and the
    /// blocks in f64, like [`bwd_reduce`], so both paths agree to rounding.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn bwd_reduce_from_h<T: Elem>(
        h: &[T],
        g: &[T],
        argmax: Option<(&[u8], usize)>,
        ch: &NormChannels,
        var: &[f32],
        d: Dims,
        eps: f32,
    ) -> Vec<f32> {
        let per = d.hw / 4;
        let scratch = || {
            let plane = || vec![0f32; d.hw];
            (plane(), plane(), plane(), T::zeros(BLK))
        };
        let part = per_plane_with(h, d, scratch, |(hf, y, gf, tmp), p, hp| {
            let c = p % d.c;
            plane_y::<T>(hp, ch, c, hf, y, tmp);
            match argmax {
                Some((am, w)) => scatter_plane(
                    &g[p * per..(p + 1) * per],
                    &am[p * per..(p + 1) * per],
                    w,
                    gf,
                ),
                None => T::widen(&g[p * d.hw..(p + 1) * d.hw], gf),
            }
            let mut acc = (0f64, 0f64);
            for start in (0..d.hw).step_by(BLK) {
                let end = (start + BLK).min(d.hw);
                let (sg, sgx) = grad_sums(
                    &hf[start..end],
                    &gf[start..end],
                    Some(&y[start..end]),
                    ch.mean[c],
                );
                acc.0 += sg as f64;
                acc.1 += sgx as f64;
            }
            acc
        });
        gamma_beta_grads(&part, d, var, eps)
    }

    /// The input gradient of BatchNorm + ReLU (+ pool) from h, written over `dst`: over the
    /// upstream gradient when there is no pool (`dst` = g), over h itself after a pool (`dst` = h,
    /// `src` = `gp`). Each element of the result depends only on the same element of h and of
    /// g', so one plane is widened into scratch before it is overwritten.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn bwd_input_from_h<T: Elem>(
        dst: &mut [T],
        h: Option<&[T]>,
        gp_argmax: Option<(&[T], &[u8], usize)>,
        ch: &NormChannels,
        co: &InputGradChannels,
        d: Dims,
    ) {
        let per = d.hw / 4;
        let ptr = SharedMut(dst.as_mut_ptr());
        for_planes(d, |r| {
            let (mut hf, mut y, mut gf, mut res) = (
                vec![0f32; d.hw],
                vec![0f32; d.hw],
                vec![0f32; d.hw],
                vec![0f32; d.hw],
            );
            let mut tmp = T::zeros(BLK);
            for p in r {
                let c = p % d.c;
                // SAFETY: planes are disjoint ranges of dst; the pool hands each plane to one worker.
                let out = unsafe { ptr.range(p * d.hw, d.hw) };
                match (h, gp_argmax) {
                    // No pool: h is a separate tensor, dst holds the upstream gradient.
                    (Some(h), _) => {
                        plane_y::<T>(
                            &h[p * d.hw..(p + 1) * d.hw],
                            ch,
                            c,
                            &mut hf,
                            &mut y,
                            &mut tmp,
                        );
                        T::widen(out, &mut gf);
                    }
                    // After a pool: dst holds h, the gradient comes from the pooled plane.
                    (None, Some((gp, am, w))) => {
                        plane_y::<T>(out, ch, c, &mut hf, &mut y, &mut tmp);
                        scatter_plane(
                            &gp[p * per..(p + 1) * per],
                            &am[p * per..(p + 1) * per],
                            w,
                            &mut gf,
                        );
                    }
                    (None, None) => unreachable!("bwd_input_from_h needs h or the pooled gradient"),
                }
                let k = [co.mean[c], co.a[c], co.b[c], co.k[c]];
                input_grad(&hf, &gf, Some(&y), k, &mut res);
                T::narrow(&res, out);
            }
        });
    }
}

// ---------------------------------------------------------------------------------------------
// CUDA kernels (NVRTC, compiled once per process at first use).
// ---------------------------------------------------------------------------------------------

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaDevice, CudaStorage};

    use crate::ops::util::{cuda_view, grid_stride, kernel_source, uint32, Kernels};

    /// The kernels of `kernels/batchnorm.cu` (see there for how the reductions are split).
    static KERNELS: Kernels =
        Kernels::new(OP, "memtrain_batchnorm", kernel_source!("batchnorm.cu"));

    /// The kernel `{kernel}_{f32|f16|bf16}` for x's dtype.
    fn func(dev: &CudaDevice, kernel: &str, dtype: DType) -> candle_core::Result<CudaFunction> {
        KERNELS.func(dev, &format!("{kernel}_{}", dtype.as_str()))
    }

    /// The contiguous data of a CUDA storage argument.
    fn view<'a, T: CudaDType>(
        s: &'a CudaStorage,
        l: &Layout,
        what: &str,
    ) -> candle_core::Result<CudaView<'a, T>> {
        cuda_view(s, l, OP, what)
    }

    /// The CUDA storage of a tensor held by an op (statistics, gamma, sums).
    fn held<'a>(s: &'a Storage, what: &str) -> candle_core::Result<&'a CudaStorage> {
        match s {
            Storage::Cuda(cs) => Ok(cs),
            _ => Err(candle_core::Error::Msg(format!(
                "{OP}: {what} is not on the GPU like x"
            ))),
        }
    }

    /// Threads per block of the split reductions.
    const REDUCE_THREADS: u32 = 256;

    /// Blocks per channel of a split reduction: about 4K elements per block (several blocks per SM
    /// at CIFAR shapes, so that enough loads are in flight), at most 64 and at most one image per block.
    fn split(d: Dims) -> usize {
        (d.m() / 4096).clamp(1, 64).min(d.n)
    }

    /// Grid `C × S` of the partial-sum kernels.
    fn split_cfg(d: Dims, s: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (d.c as u32, s as u32, 1),
            block_dim: (REDUCE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// One thread per channel (the finalizers).
    fn per_channel_cfg(c: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (c.div_ceil(128) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// A size as the kernels' `unsigned` (`check_inputs` keeps x under 2^31 elements).
    fn u32_of(v: usize) -> candle_core::Result<u32> {
        uint32(OP, "size", v)
    }

    /// An activation dtype on the GPU.
    pub(super) trait CudaElem: CudaDType + DeviceRepr + WithDType {}

    impl<T: CudaDType + DeviceRepr + WithDType> CudaElem for T {}

    /// `[mean; var]` per channel: partial sums, partial squared deviations, then the finalizer.
    pub(super) fn stats<T: CudaElem>(
        s: &CudaStorage,
        l: &Layout,
        d: Dims,
    ) -> candle_core::Result<CudaStorage> {
        let dev = &s.device;
        let stream = dev.cuda_stream();
        let x = view::<T>(s, l, "x")?;
        let sp = split(d);
        let (c, hw, n, sp32, m) = (
            u32_of(d.c)?,
            u32_of(d.hw)?,
            u32_of(d.n)?,
            u32_of(sp)?,
            u32_of(d.m())?,
        );
        // SAFETY (allocations): every element is written by its kernel before it is read
        // (thread 0 of each block writes its partial; the finalizer writes every channel).
        let mut psum: CudaSlice<f32> = unsafe { dev.alloc::<f32>(d.c * sp)? };
        let mut psq: CudaSlice<f32> = unsafe { dev.alloc::<f32>(d.c * sp)? };
        let mut out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(2 * d.c)? };
        let f = func(dev, "bn_psum", T::DTYPE)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&x).arg(&mut psum).arg(&c).arg(&hw).arg(&n);
        // SAFETY (launches): argument types and count match the kernel signatures; sizes checked.
        unsafe { b.launch(split_cfg(d, sp)) }.w()?;
        let f = func(dev, "bn_psq", T::DTYPE)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&x).arg(&psum).arg(&mut psq).arg(&c).arg(&hw).arg(&n);
        unsafe { b.launch(split_cfg(d, sp)) }.w()?;
        let f = KERNELS.func(dev, "bn_stats_final")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&psum)
            .arg(&psq)
            .arg(&mut out)
            .arg(&c)
            .arg(&sp32)
            .arg(&m);
        unsafe { b.launch(per_channel_cfg(d.c)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    /// The f32 `[2, C]` statistics an op holds, as a view on the GPU.
    fn held_view<'a>(
        guard: &'a Storage,
        l: &Layout,
        what: &str,
    ) -> candle_core::Result<CudaView<'a, f32>> {
        view::<f32>(held(guard, what)?, l, what)
    }

    /// The normalization (+ ReLU) pass, elementwise.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm<T: CudaElem>(
        op: &BnNorm,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
        d: Dims,
    ) -> candle_core::Result<CudaStorage> {
        let dev = &s1.device;
        let x = view::<T>(s1, l1, "x")?;
        let gamma = view::<f32>(s2, l2, "gamma")?;
        let beta = view::<f32>(s3, l3, "beta")?;
        let (guard, sl) = op.stats.storage_and_layout();
        let stats = held_view(&guard, sl, "batch statistics")?;
        let total = d.planes() * d.hw;
        // SAFETY: the grid-stride loop writes every element.
        let mut y: CudaSlice<T> = unsafe { dev.alloc::<T>(total)? };
        let f = func(dev, "bn_norm", T::DTYPE)?;
        let (c, hw, tot, relu) = (u32_of(d.c)?, u32_of(d.hw)?, u32_of(total)?, op.relu as i32);
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&x).arg(&gamma).arg(&beta).arg(&stats).arg(&mut y);
        b.arg(&c).arg(&hw).arg(&tot).arg(&op.eps).arg(&relu);
        // SAFETY: argument types and count match the kernel signature; sizes checked above.
        unsafe { b.launch(grid_stride(total)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    }

    /// Backward, part 1: per-channel partials of `Σg'` and `Σg'·(x - mean)`, then the finalizer.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn bwd_reduce<T: CudaElem>(
        op: &BnBwdReduce,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
        d: Dims,
    ) -> candle_core::Result<CudaStorage> {
        let dev = &s1.device;
        let x = view::<T>(s1, l1, "x")?;
        let gy = view::<T>(s2, l2, "grad_y")?;
        let y = view::<T>(s3, l3, "y")?;
        let (guard, sl) = op.stats.storage_and_layout();
        let stats = held_view(&guard, sl, "batch statistics")?;
        let stream = dev.cuda_stream();
        let sp = split(d);
        let (c, hw, n, sp32, relu) = (
            u32_of(d.c)?,
            u32_of(d.hw)?,
            u32_of(d.n)?,
            u32_of(sp)?,
            op.relu as i32,
        );
        // SAFETY (allocations): every element is written by its kernel before it is read.
        let mut part: CudaSlice<f32> = unsafe { dev.alloc::<f32>(2 * d.c * sp)? };
        let mut out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(2 * d.c)? };
        let f = func(dev, "bn_bwd_partial", T::DTYPE)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&x).arg(&gy).arg(&y).arg(&stats).arg(&mut part);
        b.arg(&c).arg(&hw).arg(&n).arg(&relu);
        // SAFETY (launches): argument types and count match the kernel signatures; sizes checked.
        unsafe { b.launch(split_cfg(d, sp)) }.w()?;
        let f = KERNELS.func(dev, "bn_bwd_final")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&part)
            .arg(&stats)
            .arg(&mut out)
            .arg(&c)
            .arg(&sp32)
            .arg(&op.eps);
        unsafe { b.launch(per_channel_cfg(d.c)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    /// Backward, part 2: the input gradient, elementwise.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn bwd_input<T: CudaElem>(
        op: &BnBwdInput,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
        d: Dims,
    ) -> candle_core::Result<CudaStorage> {
        let dev = &s1.device;
        let x = view::<T>(s1, l1, "x")?;
        let gy = view::<T>(s2, l2, "grad_y")?;
        let y = view::<T>(s3, l3, "y")?;
        let (stats_guard, stats_l) = op.stats.storage_and_layout();
        let stats = held_view(&stats_guard, stats_l, "batch statistics")?;
        let (gamma_guard, gamma_l) = op.gamma.storage_and_layout();
        let gamma = held_view(&gamma_guard, gamma_l, "gamma")?;
        let (sums_guard, sums_l) = op.sums.storage_and_layout();
        let sums = held_view(&sums_guard, sums_l, "gradient sums")?;
        let total = d.planes() * d.hw;
        // SAFETY: the grid-stride loop writes every element.
        let mut gx: CudaSlice<T> = unsafe { dev.alloc::<T>(total)? };
        let f = func(dev, "bn_bwd_input", T::DTYPE)?;
        let (c, hw, tot, relu) = (u32_of(d.c)?, u32_of(d.hw)?, u32_of(total)?, op.relu as i32);
        let inv_m = 1.0f32 / d.m() as f32;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&x)
            .arg(&gy)
            .arg(&y)
            .arg(&stats)
            .arg(&gamma)
            .arg(&sums)
            .arg(&mut gx);
        b.arg(&c)
            .arg(&hw)
            .arg(&tot)
            .arg(&inv_m)
            .arg(&op.eps)
            .arg(&relu);
        // SAFETY: argument types and count match the kernel signature; sizes checked above.
        unsafe { b.launch(grid_stride(total)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(gx, dev.clone()))
    }
}
