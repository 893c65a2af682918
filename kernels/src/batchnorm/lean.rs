//! The passes of a lean training step (a layer tape, such as memtrain's): BatchNorm + ReLU
//! recomputed from the saved pre-normalization tensor h instead of autograd keeping x and y.
//!
//! Why h and not the ReLU output y (in-place activated BatchNorm keeps y): with a plain ReLU, y
//! does not determine the normalized value where the ReLU clipped, and the BatchNorm input gradient
//! needs it there too (`grad_h = γ·invstd·(g' − Σg'/M − x̂·Σg'x̂/M)` is non-zero at clipped
//! positions through the x̂ term). Keeping h loses nothing, has no division by γ (so γ = 0 is an
//! ordinary value), and y is recomputed bit-identically from h with the statistics of the forward.
//! On the CPU every pass below is one fused kernel, and the backward overwrites a buffer it owns
//! instead of allocating; on other devices the same results come from the ops of [`super`] (y
//! materialized, the max-pool op of [`crate::pool`]), at the cost of transient buffers.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, WithDType,
};

use super::{
    check_inputs, cpu, cpu_slice, cpu_slice_mut, dims_of, held_vec, per_channel_pair, unsupported,
    BnBwdInput, BnBwdReduce, BnNorm, BnStats, Dims,
};
use crate::util::dispatch_float;

/// Per-channel batch mean and biased variance of `h` `[N, C, H, W]` as an f32 `[2, C]` tensor (row 0
/// mean, row 1 variance); no autograd.
pub fn batch_stats(h: &Tensor) -> Result<Tensor> {
    let h = h.contiguous()?;
    h.apply_op1_no_bwd(&BnStats)
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
    /// The forward's decisions, where the h the passes read is lossy ([`bn_relu_decisions`]):
    /// u8 `[N, C, ⌈H·W/8⌉]`, a bit per value of h. Every pass then reads the decided output
    /// `y' = y` (at least 2⁻¹⁴) where the bit is set and 0 where it is clear, so the ReLU mask and
    /// the pool's argmax are the forward's, and h's values feed only the gradients' values.
    pub decisions: Option<Tensor>,
}

impl BnParams {
    /// These parameters with `decisions` ([`bn_relu_decisions`]).
    pub fn decided(self, decisions: Tensor) -> Self {
        BnParams {
            decisions: Some(decisions),
            ..self
        }
    }

    /// The parameters for images `first..first + len` of the batch (the decisions narrowed to
    /// them), for a pass over a chunk of its images.
    pub fn images(&self, first: usize, len: usize) -> Result<Self> {
        let decisions = match &self.decisions {
            Some(d) => Some(d.narrow(0, first, len)?),
            None => None,
        };
        Ok(BnParams {
            decisions,
            ..self.clone()
        })
    }

    /// Bytes of the decisions (0 without).
    pub fn decision_bytes(&self) -> usize {
        self.decisions.as_ref().map_or(0, |d| d.elem_count())
    }

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

/// A CPU pass of the lean BatchNorm functions, for [`cpu_host_bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuPass {
    /// [`batch_stats`].
    Stats,
    /// [`bn_relu`].
    Norm,
    /// [`bn_relu_in_place`].
    NormInPlace,
    /// [`bn_relu_pool`].
    NormPool,
    /// [`bn_relu_pool_argmax`].
    PoolArgmax,
    /// The per-channel sums of [`bn_relu_backward`] and [`bn_relu_pool_backward`].
    BackwardSums,
    /// The input gradient of [`bn_relu_backward`] and [`bn_relu_pool_backward`], in place.
    BackwardInput,
    /// [`bn_relu_decisions`].
    Decisions,
}

/// Heap bytes `pass` holds on the CPU at its peak besides its input and output tensors, for an
/// activation of shape `dims` (`[N, C, H, W]`) in `dtype` on `threads` threads: the host copies of
/// its per-channel values, its per-plane partial sums and its threads' plane scratch (each thread
/// that can get planes counted, whatever their timing). The memory estimate's source for the
/// BatchNorm passes.
pub fn cpu_host_bytes(
    pass: CpuPass,
    dims: [usize; 4],
    dtype: candle_core::DType,
    threads: usize,
) -> u64 {
    let [n, c, h, w] = dims;
    let d = Dims { n, c, hw: h * w };
    let channel_floats = match pass {
        CpuPass::Stats => 0,
        // The statistics' copy and the normalization's constants.
        CpuPass::Norm => 2 + cpu::NormChannels::FLOATS,
        CpuPass::NormInPlace
        | CpuPass::NormPool
        | CpuPass::PoolArgmax
        | CpuPass::BackwardSums
        | CpuPass::Decisions => LeanCtx::FLOATS + cpu::NormChannels::FLOATS,
        // And the gradient sums' copy and the input gradient's constants.
        CpuPass::BackwardInput => {
            LeanCtx::FLOATS + cpu::NormChannels::FLOATS + 2 + cpu::InputGradChannels::FLOATS
        }
    };
    cpu::host_bytes(pass, d, dtype.size_in_bytes(), threads, channel_floats) as u64
}

/// `relu(bn(h))` into a new tensor of h's dtype, with the statistics in `p` (decided by its
/// decisions where it has them); no autograd.
pub fn bn_relu(h: &Tensor, p: &BnParams) -> Result<Tensor> {
    check_inputs("bn_relu", h, &p.gamma, &p.beta, p.eps, &[])?;
    let h = h.contiguous()?;
    match &p.decisions {
        None => h.apply_op3_no_bwd(&p.gamma, &p.beta, &p.norm_op()),
        Some(_) if h.device().is_cpu() => bn_relu_in_place(h.copy()?, p),
        // Elsewhere the decisions are applied on a host copy, as int4 and int2 codes are made.
        Some(_) => {
            let plain = BnParams {
                decisions: None,
                ..p.clone()
            };
            let y = h.apply_op3_no_bwd(&p.gamma, &p.beta, &plain.norm_op())?;
            let host = y.to_device(&candle_core::Device::Cpu)?;
            drop(y);
            let decided = decide_host(host, p)?;
            decided.to_device(h.device())
        }
    }
}

/// `y` (a host copy of `relu(bn(h))`) decided by `p`'s decisions (see [`BnParams::decisions`]).
fn decide_host(y: Tensor, p: &BnParams) -> Result<Tensor> {
    let cpu = candle_core::Device::Cpu;
    let d = dims_of(y.layout())?;
    let bits = match &p.decisions {
        Some(b) => b.to_device(&cpu)?.flatten_all()?.to_vec1::<u8>()?,
        None => return Ok(y),
    };
    let per = cpu::decision_bytes(d.hw);
    if bits.len() != d.planes() * per {
        candle_core::bail!(
            "bn_relu: decisions of {} bytes for {:?}",
            bits.len(),
            y.dims()
        )
    }
    let dtype = y.dtype();
    // y's values are T's: widened to f32 and back exactly, as is 2⁻¹⁴.
    let mut v = y
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    for (plane, b) in v.chunks_mut(d.hw).zip(bits.chunks(per)) {
        cpu::decide_y(plane, b, 0);
    }
    Tensor::from_vec(v, y.dims(), &cpu)?.to_dtype(dtype)
}

/// The decisions' shape for an activation `[N, C, H, W]`: `[N, C, ⌈H·W/8⌉]` (u8), a bit per
/// value, each plane starting on a byte.
pub fn decisions_dims([n, c, h, w]: [usize; 4]) -> [usize; 3] {
    [n, c, cpu::decision_bytes(h * w)]
}

/// The block's decisions from its exact `h` (see [`BnParams::decisions`]): u8 `[N, C, ⌈H·W/8⌉]`,
/// a bit per value of h set where the gradient of the block's output reaches it — where
/// `relu(bn(h)) > 0`, and with a 2x2 max-pool after (`pool`) only at each window's first maximum.
/// Off the CPU, computed on a host copy and uploaded.
pub fn bn_relu_decisions(h: &Tensor, p: &BnParams, pool: bool) -> Result<Tensor> {
    check_inputs("bn_relu_decisions", h, &p.gamma, &p.beta, p.eps, &[])?;
    let pool_w = if pool {
        Some(pool_width("bn_relu_decisions", h)?)
    } else {
        None
    };
    if !h.device().is_cpu() {
        let cpu = candle_core::Device::Cpu;
        let host = BnParams {
            gamma: p.gamma.to_device(&cpu)?,
            beta: p.beta.to_device(&cpu)?,
            stats: p.stats.to_device(&cpu)?,
            decisions: None,
            ..p.clone()
        };
        return bn_relu_decisions(&h.to_device(&cpu)?, &host, pool)?.to_device(h.device());
    }
    let h = h.contiguous()?;
    h.apply_op1_no_bwd(&Decide {
        lean: LeanBn {
            p: p.clone(),
            pool_w,
        },
    })
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
        return Err(candle_core::Error::Msg(format!(
            "{op}: needs even H and W, got {hh}x{w}"
        )));
    }
    Ok(w)
}

/// `maxpool2x2(relu(bn(h)))`; on the CPU without materializing `relu(bn(h))`.
pub fn bn_relu_pool(h: &Tensor, p: &BnParams) -> Result<Tensor> {
    check_inputs("bn_relu_pool", h, &p.gamma, &p.beta, p.eps, &[])?;
    let w = pool_width("bn_relu_pool", h)?;
    if !h.device().is_cpu() {
        return crate::pool::max_pool2x2(&bn_relu(h, p)?);
    }
    let h = h.contiguous()?;
    h.apply_op1_no_bwd(&LeanBn {
        p: p.clone(),
        pool_w: Some(w),
    })
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
    let sums = bn_relu_backward_sums(&h, &g, p)?;
    bn_relu_backward_input(&h, &g, p, &sums, h.dims()[0])?;
    Ok((g, sums.get(0)?, sums.get(1)?))
}

/// The first pass of [`bn_relu_backward`] on the CPU: the per-channel sums `[Σg'x̂; Σg']` (f32
/// `[2, C]`, grad_gamma and grad_beta) of `h` and `g` (contiguous, h's dtype). Sums over
/// disjoint images add up to the batch's: a backward that streams over chunks of images
/// computes them chunk by chunk.
pub fn bn_relu_backward_sums(h: &Tensor, g: &Tensor, p: &BnParams) -> Result<Tensor> {
    check_lean_cpu("bn_relu_backward_sums", h, g, p)?;
    h.apply_op2_no_bwd(g, &p.lean())
}

/// The second pass of [`bn_relu_backward`] on the CPU: the input gradient written over `g`
/// (contiguous, h's dtype, possibly a view of some images of a larger gradient) from `h` and the
/// `sums` ([`bn_relu_backward_sums`]) over every image of the batch of `batch_images`.
pub fn bn_relu_backward_input(
    h: &Tensor,
    g: &Tensor,
    p: &BnParams,
    sums: &Tensor,
    batch_images: usize,
) -> Result<()> {
    check_lean_cpu("bn_relu_backward_input", h, g, p)?;
    if batch_images < h.dims()[0] {
        candle_core::bail!(
            "bn_relu_backward_input: {} images of a batch of {batch_images}",
            h.dims()[0]
        )
    }
    g.inplace_op2(
        h,
        &LeanBwdInput {
            lean: p.lean(),
            sums: sums.clone(),
            batch_images,
        },
    )
}

/// The operands of a lean CPU pass over `h` and `g`: valid BatchNorm inputs, on the CPU,
/// contiguous, of one shape and dtype.
fn check_lean_cpu(op: &str, h: &Tensor, g: &Tensor, p: &BnParams) -> Result<()> {
    check_inputs(op, h, &p.gamma, &p.beta, p.eps, &[])?;
    if !h.device().is_cpu() || !g.device().is_cpu() {
        candle_core::bail!("{op}: runs on the CPU")
    }
    if !h.is_contiguous() || !g.is_contiguous() || h.dims() != g.dims() || h.dtype() != g.dtype() {
        candle_core::bail!(
            "{op}: h {:?} {:?} and g {:?} {:?} must be contiguous, of one shape and dtype",
            h.dims(),
            h.dtype(),
            g.dims(),
            g.dtype()
        )
    }
    Ok(())
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
    pool_width("bn_relu_pool_backward", &h)?;
    let h = h.contiguous()?;
    let gp = gp.to_dtype(h.dtype())?.contiguous()?;
    match argmax {
        Some(am) if h.device().is_cpu() => {
            let am = am.contiguous()?;
            let sums = bn_relu_pool_backward_sums(&h, &gp, &am, p)?;
            let n = h.dims()[0];
            let h = bn_relu_pool_backward_input(h, &gp, &am, p, &sums, n)?;
            Ok((h, sums.get(0)?, sums.get(1)?))
        }
        _ => {
            let y = bn_relu(&h, p)?;
            let g = crate::pool::max_pool2x2_backward(&y, &gp)?;
            backward_via_y(&h, &g, &y, p)
        }
    }
}

/// The first pass of [`bn_relu_pool_backward`] on the CPU: the per-channel sums `[Σg'x̂; Σg']`
/// (f32 `[2, C]`) of `h`, the pooled gradient `gp` and the windows' `argmax` (contiguous, gp in
/// h's dtype). Sums over disjoint images add up to the batch's, as [`bn_relu_backward_sums`]'.
pub fn bn_relu_pool_backward_sums(
    h: &Tensor,
    gp: &Tensor,
    argmax: &Tensor,
    p: &BnParams,
) -> Result<Tensor> {
    let lean = check_pool_cpu("bn_relu_pool_backward_sums", h, gp, argmax, p)?;
    h.apply_op3_no_bwd(gp, argmax, &PoolBwdReduce { lean })
}

/// The second pass of [`bn_relu_pool_backward`] on the CPU: the input gradient written over `h`
/// (consumed; it may be some images of a batch) from the pooled gradient `gp`, the `argmax` and
/// the `sums` ([`bn_relu_pool_backward_sums`]) over every image of the batch of `batch_images`.
pub fn bn_relu_pool_backward_input(
    h: Tensor,
    gp: &Tensor,
    argmax: &Tensor,
    p: &BnParams,
    sums: &Tensor,
    batch_images: usize,
) -> Result<Tensor> {
    let lean = check_pool_cpu("bn_relu_pool_backward_input", &h, gp, argmax, p)?;
    if batch_images < h.dims()[0] {
        candle_core::bail!(
            "bn_relu_pool_backward_input: {} images of a batch of {batch_images}",
            h.dims()[0]
        )
    }
    h.inplace_op3(
        gp,
        argmax,
        &LeanBwdInput {
            lean,
            sums: sums.clone(),
            batch_images,
        },
    )?;
    Ok(h)
}

/// The operands of a lean CPU pass after a pool: valid BatchNorm inputs on the CPU, contiguous,
/// `gp` and `argmax` of h's pooled shape, gp in h's dtype; the pass's state.
fn check_pool_cpu(
    op: &str,
    h: &Tensor,
    gp: &Tensor,
    argmax: &Tensor,
    p: &BnParams,
) -> Result<LeanBn> {
    check_inputs(op, h, &p.gamma, &p.beta, p.eps, &[])?;
    let w = pool_width(op, h)?;
    let (n, c, hh, _) = h.dims4()?;
    let pooled = [n, c, hh / 2, w / 2];
    let cpu = [h, gp, argmax].iter().all(|t| t.device().is_cpu());
    let contiguous = [h, gp, argmax].iter().all(|t| t.is_contiguous());
    if !cpu
        || !contiguous
        || gp.dims() != pooled
        || argmax.dims() != pooled
        || gp.dtype() != h.dtype()
    {
        candle_core::bail!(
            "{op}: h {:?} {:?}, gp {:?} {:?} and argmax {:?} must be on the CPU, contiguous, gp and argmax of h's pooled shape, gp in h's dtype",
            h.dims(),
            h.dtype(),
            gp.dims(),
            gp.dtype(),
            argmax.dims()
        )
    }
    Ok(LeanBn {
        p: p.clone(),
        pool_w: Some(w),
    })
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

/// The decisions of [`bn_relu_decisions`].
struct Decide {
    lean: LeanBn,
}

/// Runs `f` with `p`'s decisions as a host slice, checked to cover the activation `d` (None
/// without decisions). The slice is read where it lies: no copy.
fn with_bits<R>(
    p: &BnParams,
    d: Dims,
    f: impl FnOnce(Option<&[u8]>) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let Some(t) = &p.decisions else {
        return f(None);
    };
    let (guard, l) = t.storage_and_layout();
    let bits = match &*guard {
        candle_core::Storage::Cpu(cs) => cpu_slice::<u8>(cs, l, "decisions")?,
        _ => candle_core::bail!("bn: the decisions are not on the CPU like h"),
    };
    let want = d.planes() * cpu::decision_bytes(d.hw);
    if bits.len() != want {
        candle_core::bail!(
            "bn: decisions of {} bytes for {} planes of {} values (want {want})",
            bits.len(),
            d.planes(),
            d.hw
        )
    }
    f(Some(bits))
}

/// Per-channel sums of the backward after a pool: (h, gp, argmax) → `[Σg'x̂; Σg']`.
struct PoolBwdReduce {
    lean: LeanBn,
}

/// The input gradient written in place (over g without a pool, over h after one).
struct LeanBwdInput {
    lean: LeanBn,
    sums: Tensor,
    /// Images the sums were taken over: the batch's, which the operands may be a chunk of.
    batch_images: usize,
}

/// The host copies of the per-channel tensors a lean kernel reads: γ and β (C floats each) and
/// the statistics (2·C), [`LeanCtx::FLOATS`] per channel.
struct LeanCtx {
    gamma: Vec<f32>,
    beta: Vec<f32>,
    stats: Vec<f32>,
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
    /// f32 values per channel.
    const FLOATS: usize = 4;

    fn norm(&self, c: usize, eps: f64) -> cpu::NormChannels {
        cpu::NormChannels::new(&self.gamma, &self.beta, &self.stats, c, eps as f32)
    }
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
        with_bits(&self.p, d, |bits| {
            bn_dispatch!(s.dtype(), "bn-relu-in-place", |T| cpu::relu_in_place::<T>(
                cpu_slice_mut(s, l, "h")?,
                &ch,
                d,
                bits
            ));
            Ok(())
        })
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
        let out = with_bits(&self.p, d, |bits| {
            Ok(bn_dispatch!(s.dtype(), "bn-relu-pool", |T| {
                T::to_cpu_storage_owned(cpu::relu_pool::<T>(cpu_slice(s, l, "h")?, &ch, d, w, bits))
            }))
        })?;
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
        // With decisions the argmax is in them: h is not read.
        let decided = with_bits(&self.lean.p, d, |bits| {
            Ok(bits.map(|b| cpu::argmax_of_decisions(b, d, w)))
        })?;
        let out = match decided {
            Some(out) => out,
            None => {
                let ctx = self.lean.ctx()?;
                let ch = ctx.norm(d.c, self.lean.p.eps);
                bn_dispatch!(s.dtype(), self.name(), |T| {
                    cpu::relu_pool_argmax::<T>(cpu_slice(s, l, "h")?, &ch, d, w)
                })
            }
        };
        Ok((CpuStorage::U8(out), pooled_shape(l)?))
    }
}

impl CustomOp1 for Decide {
    fn name(&self) -> &'static str {
        "bn-relu-decisions"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = dims_of(l)?;
        let ctx = self.lean.ctx()?;
        let ch = ctx.norm(d.c, self.lean.p.eps);
        let out = bn_dispatch!(s.dtype(), self.name(), |T| cpu::decisions::<T>(
            cpu_slice(s, l, "h")?,
            &ch,
            d,
            self.lean.pool_w
        ));
        let shape = Shape::from((d.n, d.c, cpu::decision_bytes(d.hw)));
        debug_assert_eq!(shape.dims(), decisions_dims(l.shape().dims4()?.into()));
        Ok((CpuStorage::U8(out), shape))
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
        let out = with_bits(&self.p, d, |bits| {
            Ok(bn_dispatch!(s1.dtype(), "bn-relu-bwd-reduce", |T| {
                cpu::bwd_reduce_from_h::<T>(
                    cpu_slice(s1, l1, "h")?,
                    cpu_slice(s2, l2, "grad_y")?,
                    None,
                    bits,
                    &ch,
                    var,
                    d,
                    self.p.eps as f32,
                )
            }))
        })?;
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
        let out = with_bits(&self.lean.p, d, |bits| {
            Ok(bn_dispatch!(s1.dtype(), self.name(), |T| {
                cpu::bwd_reduce_from_h::<T>(
                    cpu_slice(s1, l1, "h")?,
                    cpu_slice(s2, l2, "grad_p")?,
                    Some((am, w)),
                    bits,
                    &ch,
                    var,
                    d,
                    self.lean.p.eps as f32,
                )
            }))
        })?;
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
        // The means over the batch: its images, not the chunk's.
        let batch = Dims {
            n: self.batch_images,
            ..d
        };
        Ok(cpu::InputGradChannels::new(
            &ctx.gamma,
            &ctx.stats,
            &sums,
            batch,
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
        with_bits(&self.lean.p, d, |bits| {
            bn_dispatch!(h.dtype(), self.name(), |T| {
                cpu::bwd_input_from_h::<T>(
                    cpu_slice_mut(dst, dst_l, "grad_y")?,
                    Some(cpu_slice(h, hl, "h")?),
                    None,
                    bits,
                    &ch,
                    &co,
                    d,
                )
            });
            Ok(())
        })
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
        with_bits(&self.lean.p, d, |bits| {
            bn_dispatch!(gp.dtype(), self.name(), |T| {
                cpu::bwd_input_from_h::<T>(
                    cpu_slice_mut(dst, dst_l, "h")?,
                    None,
                    Some((cpu_slice(gp, gl, "grad_p")?, am, w)),
                    bits,
                    &ch,
                    &co,
                    d,
                )
            });
            Ok(())
        })
    }
}
