//! The lean training step: forward and backward of one micro-batch as an explicit layer tape,
//! without Candle's autograd.
//!
//! Why a tape: `Tensor::backward` borrows the whole graph, so every forward tensor (and every op
//! input) lives until backward returns, and it accumulates each gradient as `zeros_like` + `add`.
//! Here each block's forward returns its output and a saved record; the backward consumes the
//! records last block first, so a saved tensor is freed as soon as the backward that needs it has
//! run, activation gradients are freed as soon as the next one is computed, and parameter
//! gradients go straight into one buffer per parameter ([`GradAccumulator`]). Candle's autograd
//! (`super::oracle`) stays as the test oracle.
//!
//! What a [conv → BatchNorm → ReLU (→ 2x2 max-pool)] block saves: its conv output `h` and the
//! per-channel batch statistics ([`memtrain_kernels::batchnorm`] explains why `h` rather than the ReLU
//! output). Everything else is recomputed from `h` where it is needed: the block's output (the
//! next conv's input, needed for that conv's weight gradient) is recomputed from `h` when that
//! gradient is taken; a pool's output and its argmax (a byte per
//! pooled element) come from `h` in one pass; a separable block's depthwise output is recomputed
//! from the block input. The BatchNorm backward writes its input gradient over a buffer it owns
//! (the upstream gradient, or `h` after a pool).
//!
//! Gradient checkpointing (`segments`): the first forward keeps only each segment's input, except
//! in the last segment, which saves as it goes (its backward comes right after the head's, so
//! re-running it would only cost time); the backward re-runs every other segment with saving
//! (same batch statistics, running statistics untouched) and then runs its tape backward, last
//! segment first. With one segment the step is the plain one.
//!
//! The order of work in the backward is chosen for the peak: for block j with dh_j (the gradient
//! of its conv output), block j's input is recomputed from h_{j-1} into a buffer of its own for
//! the weight gradient and freed, then the input gradient dx_j is computed and dh_j freed, then
//! block j-1's BatchNorm backward turns dx_j into dh_{j-1} in place. Alive at the worst moment:
//! h_{j-1}, dh_j and one of the two; with compressed activations ([`super::compress`]) h_{j-1} is
//! decoded only for that last BatchNorm backward, so two large buffers at most.

use super::accumulate::GradAccumulator;
use super::compress::Kept;
use super::micro::MicroResult;
use crate::config::ActivationStorage;
use crate::error::Result;
use crate::model::layers::{BatchNorm, ConvLayer};
use crate::model::Cnn;
use crate::phase::Phase;
use candle_core::{DType, Tensor, D};
use memtrain_kernels::batchnorm::{self as bn, BnParams};
use memtrain_kernels::{conv2d, depthwise, linear};
use std::ops::Range;

/// One layer event of the step, as the tape sees it.
#[derive(Debug, Clone, Copy)]
pub struct StepEvent<'a> {
    /// Forward or backward.
    pub phase: Phase,
    /// The layer that finished (a block name, `head`, or `recompute <segment>`, see
    /// [`crate::model::cnn::recompute_label`]).
    pub layer: &'a str,
    /// Activation bytes the tape holds for the backward at this moment.
    pub saved_bytes: u64,
    /// Bytes of the parameter-gradient buffers at this moment.
    pub grad_bytes: u64,
}

/// Receives the step's layer events (after each layer's forward and backward): the trainer reads
/// the memory probe there, records the timeline and checks the memory budget. The phase
/// boundaries are not events: the step's caller sees them, since [`LeanStep::forward`] and
/// [`LeanStep::backward`] are separate calls.
pub trait StepObserver {
    /// A layer finished.
    fn event(&mut self, _e: StepEvent<'_>) -> Result<()> {
        Ok(())
    }
}

/// An observer that ignores everything.
pub struct NoObserver;

impl StepObserver for NoObserver {}

/// What a block keeps for its backward: the conv output (exact, or compressed: see
/// [`super::compress`]) and the normalization's parameters.
struct Saved {
    h: Kept,
    bn: BnParams,
}

/// What a micro-batch's forward leaves for its backward: the segment inputs, the blocks' saved
/// records (all of them without checkpointing), the head's features and the logits' gradient.
pub struct Tape {
    inputs: Vec<Tensor>,
    saved: Vec<Saved>,
    feat: Tensor,
    feat_dims: Vec<usize>,
    dlogits: Tensor,
}

fn bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// The loss and correct count of a micro-batch as device scalars (f32 and u32), for a step that
/// must not wait for the device (a captured CUDA graph, see [`LeanStep::run_deferred`]).
#[derive(Debug, Clone)]
pub struct DeferredResult {
    /// Mean cross-entropy (unscaled), f32 scalar.
    pub loss: Tensor,
    /// Correct top-1 predictions, u32 scalar.
    pub correct: Tensor,
}

/// What the head hands back: read on the host, or left on the device.
enum HeadResult {
    Read(MicroResult),
    Deferred(DeferredResult),
}

/// One micro-batch through the model on the tape. Indices of gradients follow [`Cnn::vars`].
pub struct LeanStep<'a> {
    model: &'a Cnn,
    dtype: DType,
    segments: Vec<Range<usize>>,
    /// Index in `Cnn::vars` of each block's first parameter.
    var_base: Vec<usize>,
    saved_bytes: u64,
    /// How the blocks' conv outputs are kept.
    storage: ActivationStorage,
    /// Write the BatchNorm running statistics into their tensors instead of replacing them.
    stats_in_place: bool,
}

impl<'a> LeanStep<'a> {
    /// A step computing in `dtype` with checkpoint `segments` (ranges of blocks covering them all),
    /// keeping the blocks' conv outputs as `storage` says.
    pub fn new(
        model: &'a Cnn,
        dtype: DType,
        segments: Vec<Range<usize>>,
        storage: ActivationStorage,
    ) -> Self {
        let mut var_base = Vec::new();
        let mut i = 0;
        for b in &model.blocks {
            var_base.push(i);
            i += b.conv.vars().len() + 2;
        }
        var_base.push(i);
        LeanStep {
            model,
            dtype,
            segments,
            var_base,
            saved_bytes: 0,
            storage,
            stats_in_place: false,
        }
    }

    /// Update the BatchNorm running statistics by writing into the existing tensors rather than
    /// replacing them. A captured CUDA graph needs this: it reads and writes the buffers whose
    /// addresses it saw during capture, so the model must keep using those buffers. (The default,
    /// replacing, never changes a tensor someone else may hold a clone of.)
    pub fn with_stats_in_place(mut self) -> Self {
        self.stats_in_place = true;
        self
    }

    fn name(&self, j: usize) -> &str {
        &self.model.blocks[j].name
    }

    fn emit(
        &self,
        obs: &mut dyn StepObserver,
        phase: Phase,
        j: usize,
        acc: &GradAccumulator,
    ) -> Result<()> {
        self.emit_named(obs, phase, self.name(j), acc)
    }

    fn emit_named(
        &self,
        obs: &mut dyn StepObserver,
        phase: Phase,
        layer: &str,
        acc: &GradAccumulator,
    ) -> Result<()> {
        obs.event(StepEvent {
            phase,
            layer,
            saved_bytes: self.saved_bytes,
            grad_bytes: acc.bytes(),
        })
    }

    /// Forward and backward of images `x` (f32 `[N, 3, 32, 32]`) with labels `y` (u32 `[N]`); the loss is
    /// multiplied by `loss_mult` (1/K for accumulation, times the loss scale for f16) before the
    /// backward, and the parameter gradients (f32) are added to `acc`.
    pub fn run(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        loss_mult: f64,
        acc: &mut GradAccumulator,
        obs: &mut dyn StepObserver,
    ) -> Result<MicroResult> {
        let (r, tape) = self.forward(x, y, loss_mult, acc, obs)?;
        self.backward(tape, acc, obs)?;
        Ok(r)
    }

    /// [`LeanStep::run`] without reading anything back to the host: the loss and correct count
    /// stay on the device. Nothing in it waits for the device, so it can be captured as a CUDA
    /// graph (small host-to-device uploads, such as the class indices of the loss, still happen:
    /// under Candle's graph upload cache they are served from the eager warm-up's copies).
    pub fn run_deferred(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        loss_mult: f64,
        acc: &mut GradAccumulator,
        obs: &mut dyn StepObserver,
    ) -> Result<DeferredResult> {
        let (head, tape) = self.forward_tape(x, y, loss_mult, acc, obs, true)?;
        self.backward(tape, acc, obs)?;
        match head {
            HeadResult::Deferred(r) => Ok(r),
            HeadResult::Read(_) => unreachable!("forward_tape defers the loss when asked to"),
        }
    }

    /// The forward phase: the blocks, the head and the loss (multiplied by `loss_mult`), up to
    /// the gradient of the logits. Returns the micro-batch's loss and accuracy and the [`Tape`]
    /// its [`LeanStep::backward`] consumes. `acc` is only read (for the events' gradient bytes).
    pub fn forward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        loss_mult: f64,
        acc: &GradAccumulator,
        obs: &mut dyn StepObserver,
    ) -> Result<(MicroResult, Tape)> {
        match self.forward_tape(x, y, loss_mult, acc, obs, false)? {
            (HeadResult::Read(r), tape) => Ok((r, tape)),
            (HeadResult::Deferred(_), _) => {
                unreachable!("forward_tape reads the loss unless deferred")
            }
        }
    }

    fn forward_tape(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        loss_mult: f64,
        acc: &GradAccumulator,
        obs: &mut dyn StepObserver,
        defer: bool,
    ) -> Result<(HeadResult, Tape)> {
        let xin = x.to_dtype(self.dtype)?;
        // Forward: the last segment's blocks save as they go (all of them without
        // checkpointing); every other segment keeps only its input.
        let last = self.segments.len() - 1;
        let mut inputs: Vec<Tensor> = Vec::new();
        let mut saved: Vec<Saved> = Vec::new();
        let mut h = xin;
        for (si, seg) in self.segments.clone().into_iter().enumerate() {
            inputs.push(h.clone());
            self.saved_bytes += bytes(&h);
            for j in seg {
                let (out, s) = self.block_forward(j, h, si == last, true)?;
                if let Some(s) = s {
                    self.saved_bytes += s.h.bytes();
                    saved.push(s);
                }
                h = out;
                self.emit(obs, Phase::Forward, j, acc)?;
            }
        }
        // The head in f32: features, logits, loss and the gradient of the logits.
        let feat_dims = h.dims().to_vec();
        let feat = h.to_dtype(DType::F32)?.flatten_from(1)?;
        drop(h);
        let hw = self.model.head_w.as_detached_tensor();
        let hb = self.model.head_b.as_detached_tensor();
        let logits = linear::matmul(&feat, &hw.t()?)?.broadcast_add(&hb)?;
        let (head, dlogits) = if defer {
            let (loss, correct, grad) = loss_and_grad_deferred(&logits, y, loss_mult)?;
            (HeadResult::Deferred(DeferredResult { loss, correct }), grad)
        } else {
            let (loss, correct, grad) = loss_and_grad(&logits, y, loss_mult)?;
            (HeadResult::Read(MicroResult { loss, correct }), grad)
        };
        drop(logits);
        self.emit_named(obs, Phase::Forward, "head", acc)?;
        let tape = Tape {
            inputs,
            saved,
            feat,
            feat_dims,
            dlogits,
        };
        Ok((head, tape))
    }

    /// The backward phase of a [`LeanStep::forward`]: the head, then the blocks last first
    /// (re-running each checkpointed segment's forward first), adding the parameter gradients to
    /// `acc`. Every saved tensor is freed as soon as its backward has run.
    pub fn backward(
        &mut self,
        tape: Tape,
        acc: &mut GradAccumulator,
        obs: &mut dyn StepObserver,
    ) -> Result<()> {
        let Tape {
            mut inputs,
            mut saved,
            feat,
            feat_dims,
            dlogits,
        } = tape;
        let last = self.segments.len() - 1;
        let hw = self.model.head_w.as_detached_tensor();
        let nvars = self.var_base[self.model.blocks.len()];
        acc.add(nvars, linear::matmul(&dlogits.t()?, &feat)?)?;
        acc.add(nvars + 1, dlogits.sum(0)?)?;
        drop(feat);
        let mut g = linear::matmul(&dlogits, &hw)?
            .reshape(feat_dims)?
            .to_dtype(self.dtype)?;
        drop(dlogits);
        self.emit_named(obs, Phase::Backward, "head", acc)?;

        // Backward, segment by segment from the last.
        let segments = self.segments.clone();
        for (si, seg) in segments.iter().enumerate().rev() {
            let input = inputs.pop().expect("one input per segment");
            // The last segment saved in the forward; the others are re-run with saving.
            let seg_saved = if si == last {
                std::mem::take(&mut saved)
            } else {
                let mut s = Vec::new();
                let mut h = input.clone();
                for j in seg.start..seg.end - 1 {
                    let (out, sv) = self.block_forward(j, h, true, false)?;
                    h = out;
                    let sv = sv.expect("saving forward");
                    self.saved_bytes += sv.h.bytes();
                    s.push(sv);
                }
                // The segment's output was already used by the first forward: its last block
                // only makes h.
                let sv = self.block_save(seg.end - 1, h)?;
                self.saved_bytes += sv.h.bytes();
                s.push(sv);
                let label = crate::model::cnn::recompute_label(
                    self.name(seg.start),
                    self.name(seg.end - 1),
                );
                self.emit_named(obs, Phase::Backward, &label, acc)?;
                s
            };
            let want_dx = si > 0;
            let dx = self.segment_backward(seg.clone(), &input, seg_saved, g, want_dx, acc, obs)?;
            self.saved_bytes -= bytes(&input);
            drop(input);
            match dx {
                Some(d) => g = d,
                None => break,
            }
        }
        Ok(())
    }

    /// Block j's forward on `x`: conv, batch statistics (running statistics updated when
    /// `update_stats`), then BatchNorm + ReLU (+ pool) into a new tensor. With `save`, h and the
    /// normalization's parameters are returned for the backward; without, h is normalized in place.
    /// `x` is given up after the conv: unless a segment input holds it, it is freed before the
    /// block's output exists.
    fn block_forward(
        &self,
        j: usize,
        x: Tensor,
        save: bool,
        update_stats: bool,
    ) -> Result<(Tensor, Option<Saved>)> {
        let b = &self.model.blocks[j];
        let h = conv_forward(&b.conv, &x)?;
        drop(x);
        let params = bn_params(&b.bn, &h, update_stats, self.stats_in_place)?;
        if save {
            let kept = Kept::store(&h, self.storage)?;
            let out = match (&kept, b.pool) {
                (_, true) => bn::bn_relu_pool(&h, &params)?,
                // The exact record is h itself: the output needs a buffer of its own.
                (Kept::Exact(_), false) => bn::bn_relu(&h, &params)?,
                (Kept::Int8(_), false) => bn::bn_relu_in_place(h, &params)?,
            };
            Ok((
                out,
                Some(Saved {
                    h: kept,
                    bn: params,
                }),
            ))
        } else if b.pool {
            Ok((bn::bn_relu_pool(&h, &params)?, None))
        } else {
            Ok((bn::bn_relu_in_place(h, &params)?, None))
        }
    }

    /// Block j's conv and batch statistics on `x` (running statistics untouched): the saved
    /// record alone, for the last block of a recomputed segment. `x` is given up after the conv.
    fn block_save(&self, j: usize, x: Tensor) -> Result<Saved> {
        let b = &self.model.blocks[j];
        let h = conv_forward(&b.conv, &x)?;
        drop(x);
        let bn = bn_params(&b.bn, &h, false, self.stats_in_place)?;
        Ok(Saved {
            h: Kept::store(&h, self.storage)?,
            bn,
        })
    }

    /// The backward of blocks `seg` from `g_out` (gradient of the segment's output) with the
    /// segment `input` and the blocks' saved records; returns the input gradient when `want_dx`.
    #[allow(clippy::too_many_arguments)]
    fn segment_backward(
        &mut self,
        seg: Range<usize>,
        input: &Tensor,
        mut saved: Vec<Saved>,
        g_out: Tensor,
        want_dx: bool,
        acc: &mut GradAccumulator,
        obs: &mut dyn StepObserver,
    ) -> Result<Option<Tensor>> {
        let last = saved.pop().expect("a saved record per block");
        let j = seg.end - 1;
        let mut dh = self.bn_backward(j, last, g_out, acc)?;
        let mut j = j;
        while j > seg.start {
            let prev = saved.pop().expect("a saved record per block");
            self.saved_bytes -= prev.h.bytes();
            dh = self.inner_backward(j, prev, dh, acc)?;
            self.emit(obs, Phase::Backward, j, acc)?;
            j -= 1;
        }
        let dx = self.conv_backward(j, input, dh, want_dx, acc)?;
        self.emit(obs, Phase::Backward, j, acc)?;
        Ok(dx)
    }

    /// BatchNorm + ReLU (+ pool) backward of block j from the gradient of its output: dh_j.
    fn bn_backward(
        &mut self,
        j: usize,
        s: Saved,
        g: Tensor,
        acc: &mut GradAccumulator,
    ) -> Result<Tensor> {
        self.saved_bytes -= s.h.bytes();
        let h = s.h.restore()?;
        let (dh, dgamma, dbeta) = if self.model.blocks[j].pool {
            let am = bn::bn_relu_pool_argmax(&h, &s.bn)?;
            bn::bn_relu_pool_backward(h, &g, am.as_ref(), &s.bn)?
        } else {
            bn::bn_relu_backward(&h, g, &s.bn)?
        };
        self.add_bn_grads(j, dgamma, dbeta, acc)?;
        Ok(dh)
    }

    fn add_bn_grads(
        &self,
        j: usize,
        dgamma: Tensor,
        dbeta: Tensor,
        acc: &mut GradAccumulator,
    ) -> Result<()> {
        let base = self.var_base[j] + self.model.blocks[j].conv.vars().len();
        acc.add(base, dgamma)?;
        acc.add(base + 1, dbeta)
    }

    /// Block j's conv backward (j > segment start) together with block j-1's BatchNorm backward,
    /// in the order that keeps the fewest large buffers alive; returns dh_{j-1}.
    fn inner_backward(
        &mut self,
        j: usize,
        prev: Saved,
        dh: Tensor,
        acc: &mut GradAccumulator,
    ) -> Result<Tensor> {
        let blocks = &self.model.blocks;
        let base = self.var_base[j];
        if blocks[j - 1].pool {
            // Block j's input is the pool output: small, so recompute it (and the argmax) first,
            // finish block j, then run block j-1's backward over h_{j-1} in place.
            let h = prev.h.restore()?;
            let p = bn::bn_relu_pool(&h, &prev.bn)?;
            let am = bn::bn_relu_pool_argmax(&h, &prev.bn)?;
            let dx = self
                .conv_backward(j, &p, dh, true, acc)?
                .expect("input gradient requested");
            drop(p);
            let (dh_prev, dg, db) = bn::bn_relu_pool_backward(h, &dx, am.as_ref(), &prev.bn)?;
            self.add_bn_grads(j - 1, dg, db, acc)?;
            return Ok(dh_prev);
        }
        let dt = self.dtype;
        match &blocks[j].conv {
            ConvLayer::Standard { w } => {
                let w = w.as_detached_tensor().to_dtype(dt)?;
                // The weight gradient first, from block j's input recomputed into a buffer of its
                // own; then dx_j; only then is h_{j-1} needed, for its BatchNorm backward. Three
                // large buffers at most (h_{j-1}, dh_j, and y or dx_j); two when h_{j-1} is
                // compressed, as it is decoded only at the end.
                let gw = {
                    let y = prev.h.output(&prev.bn)?;
                    conv2d::conv2d_backward_weight(&y, &dh, w.dims(), 1, 1)?
                };
                acc.add(base, gw.to_dtype(DType::F32)?)?;
                let dx = conv2d::conv2d_backward_input(&dh, &w, &prev.h.dims(), 1, 1)?;
                drop(dh);
                let h = prev.h.restore()?;
                let (dh_prev, dg, db) = bn::bn_relu_backward(&h, dx, &prev.bn)?;
                self.add_bn_grads(j - 1, dg, db, acc)?;
                Ok(dh_prev)
            }
            ConvLayer::Separable { dw, pw } => {
                let h = prev.h.restore()?;
                let dw_t = dw.as_detached_tensor().to_dtype(dt)?;
                let pw_t = pw.as_detached_tensor().to_dtype(dt)?;
                // The depthwise output is recomputed from a fresh block input that is freed right
                // away; the input is rewritten over h_{j-1} again for the depthwise gradient.
                let d = {
                    let y = bn::bn_relu(&h, &prev.bn)?;
                    depthwise::depthwise_conv2d(&y, &dw_t, 1, 1)?
                };
                let d_dims = d.dims().to_vec();
                let dd = pointwise_backward(base, d, dh, &pw_t, acc)?;
                let dx = depthwise::depthwise_backward_input(&dd, &dw_t, &d_dims, 1, 1)?;
                let (dh_prev, dg, db) = bn::bn_relu_backward(&h, dx, &prev.bn)?;
                self.add_bn_grads(j - 1, dg, db, acc)?;
                let y = bn::bn_relu_in_place(h, &prev.bn)?;
                let gdw = depthwise::depthwise_backward_weight(&y, &dd, dw_t.dims(), 1, 1)?;
                acc.add(base, gdw.to_dtype(DType::F32)?)?;
                Ok(dh_prev)
            }
        }
    }

    /// Block j's conv backward with its input `x` at hand: weight gradients into `acc`, and the
    /// input gradient when `want_dx`.
    fn conv_backward(
        &self,
        j: usize,
        x: &Tensor,
        dh: Tensor,
        want_dx: bool,
        acc: &mut GradAccumulator,
    ) -> Result<Option<Tensor>> {
        let base = self.var_base[j];
        let dt = self.dtype;
        match &self.model.blocks[j].conv {
            ConvLayer::Standard { w } => {
                let w = w.as_detached_tensor().to_dtype(dt)?;
                let gw = conv2d::conv2d_backward_weight(x, &dh, w.dims(), 1, 1)?;
                acc.add(base, gw.to_dtype(DType::F32)?)?;
                Ok(want_dx
                    .then(|| conv2d::conv2d_backward_input(&dh, &w, x.dims(), 1, 1))
                    .transpose()?)
            }
            ConvLayer::Separable { dw, pw } => {
                let dw_t = dw.as_detached_tensor().to_dtype(dt)?;
                let pw_t = pw.as_detached_tensor().to_dtype(dt)?;
                let d = depthwise::depthwise_conv2d(x, &dw_t, 1, 1)?;
                let dd = pointwise_backward(base, d, dh, &pw_t, acc)?;
                let gdw = depthwise::depthwise_backward_weight(x, &dd, dw_t.dims(), 1, 1)?;
                acc.add(base, gdw.to_dtype(DType::F32)?)?;
                Ok(want_dx
                    .then(|| depthwise::depthwise_backward_input(&dd, &dw_t, x.dims(), 1, 1))
                    .transpose()?)
            }
        }
    }
}

/// The pointwise half of a separable block's backward from its (recomputed) depthwise output `d`
/// and dh: the pointwise weight gradient into `acc` (index `base + 1`), then the gradient of `d`.
/// `d` and `dh` are freed as soon as they are no longer needed.
fn pointwise_backward(
    base: usize,
    d: Tensor,
    dh: Tensor,
    pw: &Tensor,
    acc: &mut GradAccumulator,
) -> Result<Tensor> {
    let gpw = conv2d::conv2d_backward_weight(&d, &dh, pw.dims(), 1, 0)?;
    acc.add(base + 1, gpw.to_dtype(DType::F32)?)?;
    let d_dims = d.dims().to_vec();
    drop(d);
    Ok(conv2d::conv2d_backward_input(&dh, pw, &d_dims, 1, 0)?)
}

/// The conv of a block on `x` (compute dtype), without autograd.
fn conv_forward(conv: &ConvLayer, x: &Tensor) -> Result<Tensor> {
    let dt = x.dtype();
    let h = match conv {
        ConvLayer::Standard { w } => conv2d::conv2d(x, &w.as_detached_tensor().to_dtype(dt)?, 1, 1),
        ConvLayer::Separable { dw, pw } => {
            let d = depthwise::depthwise_conv2d(x, &dw.as_detached_tensor().to_dtype(dt)?, 1, 1)?;
            conv2d::conv2d(&d, &pw.as_detached_tensor().to_dtype(dt)?, 1, 0)
        }
    };
    Ok(h?)
}

/// The normalization parameters of a block for conv output `h`: batch statistics (running
/// statistics updated when `update_stats`, written into their tensors when `in_place`), or the
/// running statistics for a frozen BatchNorm.
fn bn_params(
    layer: &BatchNorm,
    h: &Tensor,
    update_stats: bool,
    in_place: bool,
) -> Result<BnParams> {
    let gamma = layer.gamma.as_detached_tensor();
    let beta = layer.beta.as_detached_tensor();
    if layer.frozen {
        let rm = layer
            .running_mean
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let rv = layer
            .running_var
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        return Ok(BnParams {
            gamma,
            beta,
            stats: Tensor::stack(&[rm, rv], 0)?,
            eps: layer.eps,
            batch_stats: false,
        });
    }
    let stats = bn::batch_stats(h)?;
    if update_stats {
        let (n, _, hh, ww) = h.dims4()?;
        let mut rm = layer.running_mean.lock().unwrap_or_else(|e| e.into_inner());
        let mut rv = layer.running_var.lock().unwrap_or_else(|e| e.into_inner());
        let (m, v) = bn::update_running(&rm, &rv, &stats, n * hh * ww, layer.momentum)?;
        if in_place {
            rm.slice_set(&m, 0, 0)?;
            rv.slice_set(&v, 0, 0)?;
        } else {
            *rm = m;
            *rv = v;
        }
    }
    Ok(BnParams {
        gamma,
        beta,
        stats,
        eps: layer.eps,
        batch_stats: true,
    })
}

/// Mean cross-entropy of f32 `logits` [N, 10] for u32 `labels`, the correct count, and the
/// gradient of `loss_mult · loss` with respect to the logits: `(softmax − onehot) · loss_mult / N`.
pub(crate) fn loss_and_grad(
    logits: &Tensor,
    labels: &Tensor,
    loss_mult: f64,
) -> Result<(f64, usize, Tensor)> {
    // One log-softmax for both the loss and its gradient (softmax = exp of it).
    let log_probs = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let loss = candle_nn::loss::nll(&log_probs, labels)?.to_scalar::<f32>()? as f64;
    let correct = correct_count(logits, labels)?.to_scalar::<u32>()? as usize;
    let grad = logits_grad(&log_probs, labels, loss_mult)?;
    Ok((loss, correct, grad))
}

/// [`loss_and_grad`] with the loss (f32) and the correct count (u32) left on the device as
/// scalars: nothing is read back, so a captured CUDA graph can contain it.
pub(crate) fn loss_and_grad_deferred(
    logits: &Tensor,
    labels: &Tensor,
    loss_mult: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let log_probs = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let loss = candle_nn::loss::nll(&log_probs, labels)?;
    let correct = correct_count(logits, labels)?;
    let grad = logits_grad(&log_probs, labels, loss_mult)?;
    Ok((loss, correct, grad))
}

/// Top-1 predictions of `logits` that equal `labels`, as a u32 scalar.
fn correct_count(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    Ok(logits
        .argmax(D::Minus1)?
        .eq(labels)?
        .to_dtype(DType::U32)?
        .sum_all()?)
}

/// `(softmax − onehot) · loss_mult / N` from the log-softmax of the logits.
fn logits_grad(log_probs: &Tensor, labels: &Tensor, loss_mult: f64) -> Result<Tensor> {
    let (n, classes) = log_probs.dims2()?;
    let probs = log_probs.exp()?;
    let onehot = labels
        .unsqueeze(1)?
        .broadcast_eq(&Tensor::arange(0u32, classes as u32, log_probs.device())?.unsqueeze(0)?)?
        .to_dtype(DType::F32)?;
    Ok(((probs - onehot)? * (loss_mult / n as f64))?)
}
