//! The lean training step: forward and backward of one micro-batch as an explicit layer tape,
//! without Candle's autograd.
//!
//! Why a tape: `Tensor::backward` borrows the whole graph, so every forward tensor (and every op
//! input) lives until backward returns, and it accumulates each gradient as `zeros_like` + `add`.
//! Here each block's forward returns its output and a saved record; the backward consumes the
//! records last block first, so a saved tensor is freed as soon as the backward that needs it has
//! run, activation gradients are freed as soon as the next one is computed, and parameter
//! gradients go straight into one buffer per parameter ([`super::accumulate::GradAccumulator`]). Candle's autograd
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
//! h_{j-1}, dh_j and one of the two. On the CPU the passes that treat each image alone run over
//! chunks of images ([`super::chunks`]): a conv that keeps the activation's shape writes its
//! output over its input and its input gradient over dh_j, and with compressed activations
//! ([`super::compress`]) the recomputed input and h_{j-1} are decoded chunk by chunk, so one large
//! buffer (dh_j becoming dx_j, then dh_{j-1}) is all a block's backward holds; a stage that starts
//! its segment holds none: its backward streams from its pooled gradient
//! ([`chunks::stage_backward_from_codes`]).

use super::chunks;
use super::compress::Kept;
use super::micro::MicroResult;
use super::ops::{CandleOps, ConvWeights, Head, StepOps};
use crate::error::Result;
use crate::model::Cnn;
use crate::options::ActivationStorage;
use crate::phase::Phase;
use candle_core::DType;
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

/// Sees the step as it runs ([`super::train`]): each layer's end (after its forward and its
/// backward) and each micro-batch's phase end. The trainer reads the memory probe there, records
/// the timeline, checks the memory budget and calls the user's callbacks; the estimate records
/// its predicted bytes. An error stops the step.
pub trait StepObserver {
    /// A layer finished.
    fn event(&mut self, _e: StepEvent<'_>) -> Result<()> {
        Ok(())
    }

    /// The forward or the backward phase of micro-batch `micro` finished.
    fn phase_end(&mut self, _micro: usize, _phase: Phase) -> Result<()> {
        Ok(())
    }
}

/// An observer that ignores everything.
pub struct NoObserver;

impl StepObserver for NoObserver {}

/// What a block keeps for its backward: the conv output (exact, or compressed: see
/// [`super::compress`]) and the normalization's parameters.
struct Saved<O: StepOps> {
    h: Kept<O>,
    bn: O::Bn,
}

/// Bytes of one block's record in the tape's vector of saved records when the step runs on Candle
/// tensors: the estimate sizes that vector's growth with it.
pub const SAVED_RECORD_BYTES: usize = std::mem::size_of::<Saved<super::ops::CandleOps<'static>>>();

/// The activations the step holds for its backward: the inputs of the segments not yet
/// backpropagated, and the saved records of the blocks whose backward is still to run. The
/// events' `saved_bytes` are its bytes, so the count is what is held, never a tally kept beside it.
struct Held<O: StepOps> {
    inputs: Vec<O::T>,
    saved: Vec<Saved<O>>,
}

impl<O: StepOps> Held<O> {
    fn bytes(&self, o: &O) -> u64 {
        let inputs: u64 = self.inputs.iter().map(|t| o.bytes(t)).sum();
        let saved = self.saved.iter();
        inputs
            + saved
                .map(|s| s.h.bytes(o) + o.decision_bytes(&s.bn))
                .sum::<u64>()
    }
}

/// What a micro-batch's forward leaves for its backward: the held activations (all blocks'
/// records without checkpointing), the head's features and the logits' gradient.
pub struct Tape<O: StepOps> {
    held: Held<O>,
    feat: O::T,
    feat_dims: Vec<usize>,
    dlogits: O::T,
}

/// One micro-batch through the model on the tape, computing with `O` ([`CandleOps`] for
/// training). Indices of gradients follow [`Cnn::vars`].
pub struct LeanStep<O: StepOps> {
    o: O,
    segments: Vec<Range<usize>>,
    /// Index in `Cnn::vars` of each block's first parameter.
    var_base: Vec<usize>,
    /// How the blocks' conv outputs are kept.
    storage: ActivationStorage,
    /// How the chunked passes chunk the batch ([`LeanStep::with_chunking`]).
    chunk: chunks::Chunking,
}

impl<'a> LeanStep<CandleOps<'a>> {
    /// A step on `model` computing in `dtype` with checkpoint `segments` (ranges of blocks
    /// covering them all), keeping the blocks' conv outputs as `storage` says.
    pub fn new(
        model: &'a Cnn,
        dtype: DType,
        segments: Vec<Range<usize>>,
        storage: ActivationStorage,
    ) -> Self {
        LeanStep::on(CandleOps::new(model, dtype), segments, storage)
    }

    /// Update the BatchNorm running statistics by writing into the existing tensors (see
    /// [`CandleOps::with_stats_in_place`]).
    pub fn with_stats_in_place(mut self) -> Self {
        self.o = self.o.with_stats_in_place();
        self
    }

    /// Chunk the chunked passes ([`chunks`]) as `chunk` says instead of as
    /// [`chunks::chunk_images`] chooses. For tests: the whole batch is the reference the chunked
    /// passes are checked against, and small chunks exercise a batch's last, shorter chunk.
    pub fn with_chunking(mut self, chunk: chunks::Chunking) -> Self {
        self.chunk = chunk;
        self
    }
}

impl<O: StepOps> LeanStep<O> {
    /// A step computing with `o`, with checkpoint `segments` and the conv outputs kept as
    /// `storage` says.
    pub fn on(o: O, segments: Vec<Range<usize>>, storage: ActivationStorage) -> Self {
        let mut var_base = Vec::new();
        let mut i = 0;
        for j in 0..o.blocks() {
            var_base.push(i);
            i += o.conv_params(j) + 2;
        }
        var_base.push(i);
        LeanStep {
            o,
            segments,
            var_base,
            storage,
            chunk: chunks::Chunking::default(),
        }
    }

    /// The ops the step computes with.
    pub fn ops(&self) -> &O {
        &self.o
    }

    fn emit(
        &self,
        obs: &mut dyn StepObserver,
        phase: Phase,
        j: usize,
        held: &Held<O>,
        acc: &O::Grads,
    ) -> Result<()> {
        self.emit_named(obs, phase, self.o.block_name(j), held, acc)
    }

    fn emit_named(
        &self,
        obs: &mut dyn StepObserver,
        phase: Phase,
        layer: &str,
        held: &Held<O>,
        acc: &O::Grads,
    ) -> Result<()> {
        obs.event(StepEvent {
            phase,
            layer,
            saved_bytes: held.bytes(&self.o),
            grad_bytes: self.o.grad_bytes(acc),
        })
    }

    /// Forward and backward of images `x` (f32 `[N, 3, 32, 32]`) with labels `y` (u32 `[N]`); the loss is
    /// multiplied by `loss_mult` (1/K for accumulation, times the loss scale for f16) before the
    /// backward, and the parameter gradients (f32) are added to `acc`.
    pub fn run(
        &mut self,
        x: O::T,
        y: &O::T,
        loss_mult: f64,
        acc: &mut O::Grads,
        obs: &mut dyn StepObserver,
    ) -> Result<MicroResult> {
        let (head, tape) = self.forward(x, y, loss_mult, acc, obs)?;
        self.backward(tape, acc, obs)?;
        self.o.read_head(&head)
    }

    /// Evaluation of images `x` (f32 `[N, 3, 32, 32]`) with labels `y` (u32 `[N]`): the forward
    /// with BatchNorm's running statistics (untouched), nothing saved, no gradient (`x` goes once
    /// it is in the compute dtype, as in [`LeanStep::forward`]); the mean
    /// loss and the correct count. Each block's conv output is normalized in place (or pooled
    /// straight from it), and its input is freed right after its conv (or, where the conv keeps
    /// the shape and the device runs in chunks, overwritten by its output), so at most a block's input,
    /// its conv output and the conv's scratch are alive at once. The events (phase
    /// [`Phase::Eval`]) follow each block and the head.
    pub fn evaluate(
        &mut self,
        x: O::T,
        y: &O::T,
        obs: &mut dyn StepObserver,
    ) -> Result<MicroResult> {
        let o = &self.o;
        let mut h = o.to_dtype(&x, o.dtype())?;
        drop(x);
        for j in 0..o.blocks() {
            // Every block's input is the evaluation's own (the caller's batch was given up above).
            let z = self.conv_forward_owned(j, h, true)?;
            let p = o.bn_running(j)?;
            h = if o.block_pools(j) {
                o.bn_relu_pool(&z, &p)?
            } else {
                o.bn_relu_in_place(z, &p)?
            };
            obs.event(StepEvent {
                phase: Phase::Eval,
                layer: o.block_name(j),
                saved_bytes: 0,
                grad_bytes: 0,
            })?;
        }
        let feat = o.flatten(&o.to_dtype(&h, DType::F32)?)?;
        drop(h);
        let (hw, hb) = o.head_weights();
        let logits = o.add_bias(&o.matmul(&feat, &o.t(&hw)?)?, &hb)?;
        drop(feat);
        let r = o.loss(&logits, y)?;
        drop(logits);
        obs.event(StepEvent {
            phase: Phase::Eval,
            layer: "head",
            saved_bytes: 0,
            grad_bytes: 0,
        })?;
        Ok(r)
    }

    /// The forward phase: the blocks, the head and the loss (multiplied by `loss_mult`), up to
    /// the gradient of the logits. Returns the micro-batch's loss and accuracy, left on the
    /// device ([`StepOps::read_head`] reads them), and the [`Tape`] its [`LeanStep::backward`]
    /// consumes. `x` goes once it is in the compute dtype (in f16/bf16 the f32 images are not
    /// held through the step). `acc` is only read (for the events' gradient bytes). Nothing in it waits for
    /// the device, so it can be captured as a CUDA graph (small host-to-device uploads, such as
    /// the class indices of the loss, still happen: under Candle's graph upload cache they are
    /// served from the eager warm-up's copies).
    pub fn forward(
        &mut self,
        x: O::T,
        y: &O::T,
        loss_mult: f64,
        acc: &O::Grads,
        obs: &mut dyn StepObserver,
    ) -> Result<(Head<O::T>, Tape<O>)> {
        let o = &self.o;
        let xin = o.to_dtype(&x, o.dtype())?;
        drop(x);
        // Forward: the last segment's blocks save as they go (all of them without
        // checkpointing); every other segment keeps only its input.
        let last = self.segments.len() - 1;
        // Room for every segment's input and every block's record, made once: the backward
        // never holds more (a recomputed segment's records replace the ones it consumed).
        let mut held = Held {
            inputs: Vec::with_capacity(self.segments.len()),
            saved: Vec::with_capacity(o.blocks()),
        };
        let mut h = xin;
        for si in 0..self.segments.len() {
            let seg = self.segments[si].clone();
            held.inputs.push(h.clone());
            for j in seg.clone() {
                // A segment's first block reads the input the segment holds.
                let owned = j != seg.start;
                let (out, s) = self.block_forward(j, h, si == last, true, owned)?;
                held.saved.extend(s);
                h = out;
                self.emit(obs, Phase::Forward, j, &held, acc)?;
            }
        }
        // The head in f32: features, logits, loss and the gradient of the logits.
        let o = &self.o;
        let feat_dims = o.dims(&h);
        let feat = o.flatten(&o.to_dtype(&h, DType::F32)?)?;
        drop(h);
        let (hw, hb) = o.head_weights();
        let logits = o.add_bias(&o.matmul(&feat, &o.t(&hw)?)?, &hb)?;
        let (head, dlogits) = o.loss_and_grad(&logits, y, loss_mult)?;
        drop(logits);
        self.emit_named(obs, Phase::Forward, "head", &held, acc)?;
        let tape = Tape {
            held,
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
        tape: Tape<O>,
        acc: &mut O::Grads,
        obs: &mut dyn StepObserver,
    ) -> Result<()> {
        let Tape {
            mut held,
            feat,
            feat_dims,
            dlogits,
        } = tape;
        let last = self.segments.len() - 1;
        let o = &self.o;
        let (hw, _) = o.head_weights();
        let nvars = self.var_base[o.blocks()];
        o.add_grad(acc, nvars, o.matmul(&o.t(&dlogits)?, &feat)?)?;
        o.add_grad(acc, nvars + 1, o.sum_rows(&dlogits)?)?;
        drop(feat);
        let mut g = o.to_dtype(
            &o.reshape(&o.matmul(&dlogits, &hw)?, &feat_dims)?,
            o.dtype(),
        )?;
        drop(dlogits);
        self.emit_named(obs, Phase::Backward, "head", &held, acc)?;

        // Backward, segment by segment from the last. The last segment saved in the forward;
        // the others are re-run from their input with saving.
        for si in (0..self.segments.len()).rev() {
            let seg = self.segments[si].clone();
            if si != last {
                let mut h = held.inputs.last().expect("one input per segment").clone();
                for j in seg.start..seg.end - 1 {
                    let (out, sv) = self.block_forward(j, h, true, false, j != seg.start)?;
                    h = out;
                    held.saved.push(sv.expect("saving forward"));
                }
                // The segment's output was already used by the first forward: its last block
                // only makes h.
                let owned = seg.end - 1 != seg.start;
                held.saved.push(self.block_save(seg.end - 1, h, owned)?);
                let label = crate::model::cnn::recompute_label(
                    self.o.block_name(seg.start),
                    self.o.block_name(seg.end - 1),
                );
                self.emit_named(obs, Phase::Backward, &label, &held, acc)?;
            }
            let want_dx = si > 0;
            let dx = self.segment_backward(seg.clone(), &mut held, g, want_dx, acc, obs)?;
            // The segment's input, held through its backward.
            drop(held.inputs.pop());
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
    /// `x` is given up after the conv: unless a segment input holds it (`owned` false), it is
    /// freed before the block's output exists, or holds the conv's output
    /// ([`Self::conv_forward_owned`]).
    fn block_forward(
        &self,
        j: usize,
        x: O::T,
        save: bool,
        update_stats: bool,
        owned: bool,
    ) -> Result<(O::T, Option<Saved<O>>)> {
        let o = &self.o;
        let h = self.conv_forward_owned(j, x, owned)?;
        let params = o.bn_params(j, &h, update_stats)?;
        let pool = o.block_pools(j);
        if save {
            let (kept, bn) = self.keep(j, &h, params.clone())?;
            let out = match (&kept, pool) {
                (_, true) => o.bn_relu_pool(&h, &params)?,
                // The exact record is h itself: the output needs a buffer of its own.
                (Kept::Exact(_), false) => o.bn_relu(&h, &params)?,
                (Kept::Codes(_), false) => o.bn_relu_in_place(h, &params)?,
            };
            Ok((out, Some(Saved { h: kept, bn })))
        } else if pool {
            Ok((o.bn_relu_pool(&h, &params)?, None))
        } else {
            Ok((o.bn_relu_in_place(h, &params)?, None))
        }
    }

    /// Block j's conv and batch statistics on `x` (running statistics untouched): the saved
    /// record alone, for the last block of a recomputed segment. `x` is given up after the conv.
    fn block_save(&self, j: usize, x: O::T, owned: bool) -> Result<Saved<O>> {
        let h = self.conv_forward_owned(j, x, owned)?;
        let params = self.o.bn_params(j, &h, false)?;
        let (h, bn) = self.keep(j, &h, params)?;
        Ok(Saved { h, bn })
    }

    /// Block j's conv output `h` as the tape keeps it, and the parameters its backward reads:
    /// with codes, the forward's decisions ride with them, taken from the exact h
    /// ([`super::compress`]).
    fn keep(&self, j: usize, h: &O::T, params: O::Bn) -> Result<(Kept<O>, O::Bn)> {
        let o = &self.o;
        let kept = Kept::store(o, j, h, self.storage)?;
        let bn = match kept {
            Kept::Exact(_) => params,
            Kept::Codes(_) => {
                let d = o.decisions(h, &params, o.block_pools(j))?;
                o.decided(params, d)
            }
        };
        Ok((kept, bn))
    }

    /// The conv of block j on `x` (compute dtype): the model's one conv forward, on `O`'s ops.
    fn conv_forward(&self, j: usize, x: &O::T) -> Result<O::T> {
        let o = &self.o;
        o.conv_weights(j)?
            .forward(x, |x, w, pad| o.conv2d(x, w, pad), |x, w| o.depthwise(x, w))
    }

    /// [`Self::conv_forward`] on `x` given up by the caller: when nothing else holds x (`owned`),
    /// the device runs in chunks and the conv keeps the activation's shape, its output is written over
    /// x ([`chunks::conv_over_input`]); otherwise x is freed after the conv.
    fn conv_forward_owned(&self, j: usize, x: O::T, owned: bool) -> Result<O::T> {
        let o = &self.o;
        if owned {
            if let ConvWeights::Standard(w) = o.conv_weights(j)? {
                if let Some(chunk) = self.chunk_over(&x, &w) {
                    return chunks::conv_over_input(o, x, &w, chunk);
                }
            }
        }
        self.conv_forward(j, &x)
    }

    /// Images per chunk for the passes chunked over an activation of `dims`, or None where
    /// every pass runs on the whole batch (a device that does not run in chunks).
    fn chunk_of(&self, dims: &[usize]) -> Option<usize> {
        let o = &self.o;
        o.in_chunks()
            .then(|| self.chunk.images(dims, o.dtype().size_in_bytes()))
            .flatten()
    }

    /// The chunk to run a dense conv of weight `w` over `x` (or over its output gradient,
    /// which has the output's shape) with, where the output has x's shape and the device runs in chunks.
    fn chunk_over(&self, x: &O::T, w: &O::T) -> Option<usize> {
        let o = &self.o;
        let (xd, wd) = (o.dims(x), o.dims(w));
        (wd[0] == wd[1]).then(|| self.chunk_of(&xd)).flatten()
    }

    /// The backward of blocks `seg` from `g_out` (gradient of the segment's output): its blocks'
    /// saved records are the last ones `held`, taken off as their backward runs, and its input
    /// is the last held input. Returns the input gradient when `want_dx`.
    fn segment_backward(
        &mut self,
        seg: Range<usize>,
        held: &mut Held<O>,
        g_out: O::T,
        want_dx: bool,
        acc: &mut O::Grads,
        obs: &mut dyn StepObserver,
    ) -> Result<Option<O::T>> {
        // A stage that starts the segment, kept as codes, is streamed from its pooled gradient:
        // the blocks after it run as usual down to the one that reads the stage's output.
        let stage = self.streams_stage(&seg, held);
        let gp = if stage && seg.len() == 2 {
            g_out
        } else {
            let last = held.saved.pop().expect("a saved record per block");
            let j = seg.end - 1;
            let mut dh = self.bn_backward(j, last, g_out, acc)?;
            let mut j = j;
            let stop = if stage { seg.start + 2 } else { seg.start };
            while j > stop {
                let prev = held.saved.pop().expect("a saved record per block");
                dh = self.inner_backward(j, prev, dh, acc)?;
                self.emit(obs, Phase::Backward, j, held, acc)?;
                j -= 1;
            }
            if !stage {
                let input = held.inputs.last().expect("one input per segment");
                let dx = self.conv_backward(j, input, dh, want_dx, acc)?;
                self.emit(obs, Phase::Backward, j, held, acc)?;
                return Ok(dx);
            }
            // Block j reads the stage's pooled output: recomputed from the codes for its conv's
            // backward, whose input gradient is the stage's gp.
            let gp = {
                let prev = held.saved.last().expect("a saved record per block");
                let Kept::Codes(q) = &prev.h else {
                    unreachable!("a streamed stage is kept as codes")
                };
                let chunk = self.chunk_of(&self.o.codes_dims(q));
                let p = chunks::pool_from_codes(&self.o, q, &prev.bn, chunk.unwrap_or(1), false)?.0;
                self.conv_backward(j, &p, dh, true, acc)?
                    .expect("input gradient requested")
            };
            self.emit(obs, Phase::Backward, j, held, acc)?;
            gp
        };
        self.stage_backward(seg.start, gp, held, want_dx, acc, obs)
    }

    /// Whether segment `seg` starts with a stage whose backward streams
    /// ([`chunks::stage_backward_from_codes`]): a block without a pool and a pooled one, both
    /// dense convs kept as codes, on a device that runs in chunks, with h larger than a chunk
    /// (else the stage's buffers are no larger than the chunks and streaming would only cost
    /// time). The segment's records are the last ones `held`.
    fn streams_stage(&self, seg: &Range<usize>, held: &Held<O>) -> bool {
        let o = &self.o;
        let (a, b) = (seg.start, seg.start + 1);
        if b >= seg.end || o.block_pools(a) || !o.block_pools(b) {
            return false;
        }
        if o.conv_params(a) != 1 || o.conv_params(b) != 1 {
            return false;
        }
        let k = held.saved.len() - seg.len();
        let (Kept::Codes(_), Kept::Codes(qb)) = (&held.saved[k].h, &held.saved[k + 1].h) else {
            return false;
        };
        let dims = o.codes_dims(qb);
        self.chunk_of(&dims).is_some_and(|chunk| chunk < dims[0])
    }

    /// The backward of the stage of blocks `a` and `a + 1` ([`Self::streams_stage`]) from the
    /// gradient of its pooled output: its records are the last two `held`, its input the last
    /// held input. Returns the input gradient when `want_dx`.
    fn stage_backward(
        &mut self,
        a: usize,
        gp: O::T,
        held: &mut Held<O>,
        want_dx: bool,
        acc: &mut O::Grads,
        obs: &mut dyn StepObserver,
    ) -> Result<Option<O::T>> {
        let o = &self.o;
        let b = a + 1;
        let k = held.saved.len() - 2;
        let grads = {
            let (ra, rb) = (&held.saved[k], &held.saved[k + 1]);
            let (Kept::Codes(qa), Kept::Codes(qb)) = (&ra.h, &rb.h) else {
                unreachable!("a streamed stage is kept as codes")
            };
            let dense = |j| -> Result<O::T> {
                match o.conv_weights(j)? {
                    ConvWeights::Standard(w) => Ok(w),
                    ConvWeights::Separable { .. } => {
                        unreachable!("a streamed stage has dense convs")
                    }
                }
            };
            let stage = chunks::CodedStage {
                a: (qa, &ra.bn, dense(a)?),
                b: (qb, &rb.bn, dense(b)?),
            };
            let chunk = self.chunk_of(&o.codes_dims(qb)).unwrap_or(1);
            let x = held.inputs.last().expect("one input per segment");
            chunks::stage_backward_from_codes(o, &stage, &gp, x, want_dx, chunk)?
        };
        drop(gp);
        held.saved.truncate(k);
        o.add_grad(acc, self.var_base[b], grads.weight_b)?;
        let (dg, db) = o.bn_grads(&grads.sums_b)?;
        self.add_bn_grads(b, dg, db, acc)?;
        self.emit(obs, Phase::Backward, b, held, acc)?;
        o.add_grad(acc, self.var_base[a], grads.weight_a)?;
        let (dg, db) = o.bn_grads(&grads.sums_a)?;
        self.add_bn_grads(a, dg, db, acc)?;
        self.emit(obs, Phase::Backward, a, held, acc)?;
        Ok(grads.dx)
    }

    /// BatchNorm + ReLU (+ pool) backward of block j from the gradient of its output: dh_j.
    fn bn_backward(&mut self, j: usize, s: Saved<O>, g: O::T, acc: &mut O::Grads) -> Result<O::T> {
        let o = &self.o;
        let (dh, dgamma, dbeta) = if o.block_pools(j) {
            let h = s.h.restore(o)?;
            let am = o.bn_relu_pool_argmax(&h, &s.bn)?;
            o.bn_relu_pool_backward(h, &g, am.as_ref(), &s.bn)?
        } else {
            self.bn_relu_backward_kept(s.h, g, &s.bn)?
        };
        self.add_bn_grads(j, dgamma, dbeta, acc)?;
        Ok(dh)
    }

    /// `(dh, dγ, dβ)` of `relu(bn(h))` with h as the tape kept it, dh written over `g`: with
    /// codes on a chunking device, h is decoded a chunk at a time
    /// ([`chunks::bn_relu_backward_from_codes`]), else whole.
    fn bn_relu_backward_kept(&self, h: Kept<O>, g: O::T, p: &O::Bn) -> Result<(O::T, O::T, O::T)> {
        let o = &self.o;
        if let Kept::Codes(q) = &h {
            if let Some(chunk) = self.chunk_of(&o.codes_dims(q)) {
                return chunks::bn_relu_backward_from_codes(o, q, g, p, chunk);
            }
        }
        let h = h.restore(o)?;
        o.bn_relu_backward(&h, g, p)
    }

    fn add_bn_grads(&self, j: usize, dgamma: O::T, dbeta: O::T, acc: &mut O::Grads) -> Result<()> {
        let base = self.var_base[j] + self.o.conv_params(j);
        self.o.add_grad(acc, base, dgamma)?;
        self.o.add_grad(acc, base + 1, dbeta)
    }

    /// Block j's conv backward (j > segment start) together with block j-1's BatchNorm backward,
    /// in the order that keeps the fewest large buffers alive; returns dh_{j-1}.
    fn inner_backward(
        &mut self,
        j: usize,
        prev: Saved<O>,
        dh: O::T,
        acc: &mut O::Grads,
    ) -> Result<O::T> {
        let o = &self.o;
        let base = self.var_base[j];
        if o.block_pools(j - 1) {
            // Block j's input is the pool output: small, so recompute it (and the argmax) first,
            // finish block j, then run block j-1's backward over h_{j-1} in place. Codes on a
            // chunking device are decoded twice (chunk by chunk for the pool, then whole), so
            // that no decoded h_{j-1} is held through block j's backward.
            let chunk = self.chunk_of(&prev.h.dims(o));
            let mut kept = Some(prev.h);
            let (p, am, h) = match (kept.as_ref().expect("the record"), chunk) {
                (Kept::Codes(q), Some(chunk)) => {
                    let (p, am) = chunks::pool_from_codes(o, q, &prev.bn, chunk, true)?;
                    (p, am, None)
                }
                _ => {
                    let h = kept.take().expect("the record").restore(o)?;
                    let p = o.bn_relu_pool(&h, &prev.bn)?;
                    let am = o.bn_relu_pool_argmax(&h, &prev.bn)?;
                    (p, am, Some(h))
                }
            };
            let dx = self
                .conv_backward(j, &p, dh, true, acc)?
                .expect("input gradient requested");
            drop(p);
            let h = match (h, kept) {
                (Some(h), _) => h,
                (None, kept) => kept.expect("kept for the second decoding").restore(o)?,
            };
            let (dh_prev, dg, db) = self
                .o
                .bn_relu_pool_backward(h, &dx, am.as_ref(), &prev.bn)?;
            self.add_bn_grads(j - 1, dg, db, acc)?;
            return Ok(dh_prev);
        }
        match o.conv_weights(j)? {
            ConvWeights::Standard(w) => {
                // The weight gradient first, from block j's input recomputed (whole into a buffer
                // of its own, or chunk by chunk from codes); then dx_j (over dh_j where the shapes
                // allow); only then is h_{j-1} needed, for its BatchNorm backward (read from codes
                // chunk by chunk). Three large buffers at most (h_{j-1}, dh_j, and y or dx_j); one,
                // dh_j becoming dx_j, with codes on a chunking device.
                let chunk = self.chunk_of(&prev.h.dims(o));
                match (&prev.h, chunk) {
                    (Kept::Codes(q), Some(chunk)) => {
                        chunks::weight_grad_from_codes(o, q, &prev.bn, &dh, &w, chunk, |gw| {
                            o.add_grad(acc, base, o.to_dtype(&gw, DType::F32)?)
                        })?
                    }
                    _ => {
                        let gw = {
                            let y = prev.h.output(o, &prev.bn)?;
                            o.conv2d_backward_weight(&y, &dh, &w, 1)?
                        };
                        o.add_grad(acc, base, o.to_dtype(&gw, DType::F32)?)?;
                    }
                }
                let dx = self.input_grad(dh, &w, &prev.h.dims(o))?;
                let (dh_prev, dg, db) = self.bn_relu_backward_kept(prev.h, dx, &prev.bn)?;
                self.add_bn_grads(j - 1, dg, db, acc)?;
                Ok(dh_prev)
            }
            ConvWeights::Separable { dw, pw } => {
                let h = prev.h.restore(o)?;
                // The depthwise output is recomputed from a fresh block input that is freed right
                // away; the input is rewritten over h_{j-1} again for the depthwise gradient.
                let d = {
                    let y = o.bn_relu(&h, &prev.bn)?;
                    o.depthwise(&y, &dw)?
                };
                let d_dims = o.dims(&d);
                let dd = self.pointwise_backward(base, d, dh, &pw, acc)?;
                let dx = o.depthwise_backward_input(&dd, &dw, &d_dims)?;
                let (dh_prev, dg, db) = o.bn_relu_backward(&h, dx, &prev.bn)?;
                self.add_bn_grads(j - 1, dg, db, acc)?;
                let y = o.bn_relu_in_place(h, &prev.bn)?;
                let gdw = o.depthwise_backward_weight(&y, &dd, &dw)?;
                o.add_grad(acc, base, o.to_dtype(&gdw, DType::F32)?)?;
                Ok(dh_prev)
            }
        }
    }

    /// Block j's conv backward with its input `x` at hand: weight gradients into `acc`, and the
    /// input gradient when `want_dx`.
    fn conv_backward(
        &self,
        j: usize,
        x: &O::T,
        dh: O::T,
        want_dx: bool,
        acc: &mut O::Grads,
    ) -> Result<Option<O::T>> {
        let o = &self.o;
        let base = self.var_base[j];
        match o.conv_weights(j)? {
            ConvWeights::Standard(w) => {
                let gw = o.conv2d_backward_weight(x, &dh, &w, 1)?;
                o.add_grad(acc, base, o.to_dtype(&gw, DType::F32)?)?;
                drop(gw);
                want_dx
                    .then(|| self.input_grad(dh, &w, &o.dims(x)))
                    .transpose()
            }
            ConvWeights::Separable { dw, pw } => {
                let d = o.depthwise(x, &dw)?;
                let dd = self.pointwise_backward(base, d, dh, &pw, acc)?;
                let gdw = o.depthwise_backward_weight(x, &dd, &dw)?;
                o.add_grad(acc, base, o.to_dtype(&gdw, DType::F32)?)?;
                drop(gdw);
                want_dx
                    .then(|| o.depthwise_backward_input(&dd, &dw, &o.dims(x)))
                    .transpose()
            }
        }
    }

    /// The input gradient of a dense conv of weight `w` for an input of `x_dims` from its output
    /// gradient `dh` (given up): written over dh where the shapes allow and the device runs in chunks
    /// ([`chunks::input_grad_over`]), else into a new tensor, dh freed after.
    fn input_grad(&self, dh: O::T, w: &O::T, x_dims: &[usize]) -> Result<O::T> {
        let o = &self.o;
        match self.chunk_over(&dh, w) {
            Some(chunk) => chunks::input_grad_over(o, dh, w, chunk),
            None => o.conv2d_backward_input(&dh, w, x_dims, 1),
        }
    }

    /// The pointwise half of a separable block's backward from its (recomputed) depthwise output
    /// `d` and dh: the pointwise weight gradient into `acc` (index `base + 1`), then the gradient
    /// of `d`. `d` and `dh` are freed as soon as they are no longer needed.
    fn pointwise_backward(
        &self,
        base: usize,
        d: O::T,
        dh: O::T,
        pw: &O::T,
        acc: &mut O::Grads,
    ) -> Result<O::T> {
        let o = &self.o;
        let gpw = o.conv2d_backward_weight(&d, &dh, pw, 0)?;
        o.add_grad(acc, base + 1, o.to_dtype(&gpw, DType::F32)?)?;
        drop(gpw);
        let d_dims = o.dims(&d);
        drop(d);
        o.conv2d_backward_input(&dh, pw, &d_dims, 0)
    }
}
