//! Analytic, per-layer prediction of training memory.
//!
//! [`estimate`] predicts, for a [`TrainConfig`], what the memory probe will measure: the bytes of
//! the parameters, gradients and optimizer state, the activations saved for backward (in the
//! compute dtype, with checkpointing and gradient accumulation taken into account), the transient
//! buffers (im2col columns of each convolution, casts of the f32 master weights, activation
//! gradients), and on the CPU the process baseline (the data set held in memory, the batch
//! buffers, the model). Besides the peak per phase it predicts every layer event of the step's
//! memory timeline ([`Estimate::events`], matched to `step_timeline.json` by the trainer).
//!
//! It is derived from the model's layer list ([`ModelConfig::layer_specs`](memtrain_core::model::ModelConfig::layer_specs), the
//! architecture's one list) and from the step itself: the core's
//! whole step ([`memtrain_core::step::train::train_step`]: the micro-batches on the tape, then the update
//! and the optimizer) runs on sizes (`sizing.rs`), each op allocating its result and spiking its
//! scratch as the kernel sizes it, each buffer freed when the step drops its last handle. What the
//! step keeps, recomputes and frees, and in which order, is therefore the step's own, not a copy
//! of it. Around the step the estimate adds what the trainer holds besides it:
//!
//! - **Pruning** (`--prune`, `src/train/prune.rs`): one u8 mask per pruned weight (conv and head
//!   weights), allocated with the model, so part of the baseline; after the update, with the
//!   gradients freed, one layer at a time: recomputing a mask copies the weights to the host
//!   with an 8-byte sort key each (CPU), applying it allocates a zero tensor and the result.
//! - **Baseline (CPU)**: the counting allocator measures the whole process heap, so the training
//!   split and the evaluation split (bytes as loaded), the f32 master weights and BatchNorm
//!   statistics, the batcher's index permutation, the batches in flight and the gemm crate's
//!   per-thread packing buffers are part of every measurement.
//!
//! On the CPU it is checked against the counting allocator (`tests/estimate_grid.rs`); on CUDA the
//! sizing follows each op's device path (a new tensor where the CPU works in place, the conv op's
//! chunked columns from `memtrain_kernels::conv2d_cuda::cuda_scratch_bytes`, or in a `cudnn` build
//! the one cuDNN workspace of `--cudnn-workspace`); cuBLAS
//! workspaces and the pool's rounding are not modelled. On an H200 (2026-11-27) it was 2.6–17%
//! low, where cuDNN refused shapes and the im2col op's columns, which a `cudnn` build does not
//! count, were held (`docs/results/gpu-2026-11-27.md`).

use super::baseline::RUNTIME_OVERHEAD_BYTES;
pub use super::baseline::{Baseline, DataSize};
use super::checkpointing::{pick, recompute_flops, Candidate};
pub use super::events::EventPrediction;
use super::events::Events;
use super::margin::{heap_limit, SAFETY_MARGIN};
pub use super::sim::DeviceKind;
use super::sim::*;
use super::sizing::{Sizing, Sz};
use crate::config::{
    ActivationStorage, CompressActivations, ConvKind, GradCheckpointing, OptimizerKind, Precision,
    TrainConfig,
};
use crate::data::IMAGE_BYTES;
use crate::error::Result;
use memtrain_core::model::cnn::segments;
use memtrain_core::phase::Phase;
use memtrain_core::step::optim::Optimizer;
use memtrain_core::step::precision::LossScaler;
use memtrain_core::step::tape::LeanStep;
use memtrain_core::step::train::{train_step, StepSettings, Updater};

/// Transient bytes per weight of the largest pruned layer while its mask is recomputed and applied
/// (`src/train/prune.rs`): on the CPU the f32 host copy (4), the sort key (8) and the new mask (1);
/// on CUDA the zero tensor and the masked result (4 + 4), the host work not being device memory.
pub(super) const PRUNE_TRANSIENT_PER_WEIGHT_CPU: u64 = 13;
pub(super) const PRUNE_TRANSIENT_PER_WEIGHT_CUDA: u64 = 8;

/// The prediction for one layer of the model.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LayerEstimate {
    /// Layer name, e.g. `stage1.block2.conv`.
    pub name: String,
    /// What the layer computes ([`memtrain_core::model::LayerSpec::kind`]).
    pub kind: memtrain_core::model::LayerKind,
    /// Output shape per image (C, H, W).
    pub output_shape: (usize, usize, usize),
    /// Trainable parameters.
    pub params: usize,
    /// Bytes of one micro-batch of this layer's output in the compute dtype (f32 for the head).
    pub output_bytes: u64,
    /// Activation bytes this layer keeps from the forward to the backward pass of a micro-batch,
    /// as the tape keeps them: without checkpointing a block's conv output h (on the conv that
    /// makes it: the pointwise conv of a separable block); with checkpointing only each
    /// segment's input, on the layer that made it (the previous block's last layer). The column
    /// adds up to [`KeptBytes::activation_bytes`] with [`KeptBytes::input_saved_bytes`].
    pub saved_bytes: u64,
    /// Activation bytes this layer makes again in the backward pass and keeps for its own
    /// backward: the h of every block of a checkpointed segment, as the storage keeps it (its
    /// codes with `--compress-activations`; 0 without checkpointing). The column adds up to
    /// [`KeptBytes::recomputed_bytes`].
    pub recompute_bytes: u64,
    /// Largest transient allocation of the layer's forward or backward beyond its inputs and
    /// outputs: im2col columns, widened f32 copies, weight casts, gradient buffers. Not a column
    /// to add up: the transients of different layers are never alive together.
    pub transient_bytes: u64,
}

/// The predicted memory of a training configuration, per layer and per phase.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Estimate {
    /// One row per layer of the model, in forward order.
    pub layers: Vec<LayerEstimate>,
    /// What the estimate is of.
    #[serde(flatten)]
    pub setup: EstimateSetup,
    /// Bytes held through the step apart from its activations.
    #[serde(flatten)]
    pub held: HeldBytes,
    /// The activations a micro-batch keeps for its backward.
    #[serde(flatten)]
    pub kept: KeptBytes,
    /// The highest bytes in use in each phase.
    #[serde(flatten)]
    pub phases: PhasePeaks,
    /// The predicted peak: the highest of the three phases.
    pub peak: u64,
    /// The phase of the peak: `forward`, `backward` or `optimizer`.
    pub peak_phase: &'static str,
    /// Highest bytes in use during the evaluation after an epoch (`src/train/fit.rs`: the tape's
    /// forward in eval mode, [`memtrain_core::step::tape::LeanStep::evaluate`], run on sizes); `None`
    /// without evaluation. Not part of [`Estimate::peak`], the step's; the run needs
    /// [`Estimate::run_peak`].
    pub eval_peak: Option<u64>,
    /// The steady-state step's events (every micro-batch's layer events, then the optimizer), as
    /// the trainer's memory timeline records them.
    pub events: Vec<EventPrediction>,
}

/// What an [`Estimate`] is of: the step's shape and options.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EstimateSetup {
    /// Images per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step.
    pub accum_steps: usize,
    /// Compute precision.
    pub precision: Precision,
    /// Gradient checkpointing granularity.
    pub grad_checkpointing: GradCheckpointing,
    /// Convolution kind.
    pub conv: ConvKind,
    /// Device the estimate is for.
    pub device: DeviceKind,
    /// Shape of one input image (C, H, W).
    pub input_shape: (usize, usize, usize),
    /// `--prefetch`: batches prepared ahead of the one being trained (with it, the batches in
    /// flight on the CPU).
    pub prefetch: usize,
    /// Images per evaluation batch (the micro-batch, or fewer when the evaluation split is
    /// smaller); 0 without evaluation (`--no-eval`, or no evaluation images).
    pub eval_batch: usize,
}

/// Bytes an [`Estimate`] holds through the step, apart from the activations.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HeldBytes {
    /// f32 master weights.
    pub param_bytes: u64,
    /// f32 gradients (accumulated over micro-batches).
    pub grad_bytes: u64,
    /// Optimizer state (momentum; AdamW's two moments).
    pub optimizer_bytes: u64,
    /// Pruning masks (`--prune`): one byte per pruned weight; part of the baseline.
    pub mask_bytes: u64,
    /// Bytes in use when training begins (CPU: data set, model, runtime; CUDA: model).
    pub baseline_bytes: u64,
    /// Host batches in flight during a step (0 on CUDA).
    pub batch_bytes: u64,
    /// Buffers the runtime allocates at the first step and keeps (the gemm crate's per-thread
    /// packing buffers on the CPU; the cuDNN workspace on CUDA in a `cudnn` build).
    pub runtime_bytes: u64,
    /// Host records the estimate does not size one by one, counted whole so that it is never
    /// below the measured peak ([`super::HOST_BOOKKEEPING_BYTES`] on the CPU; 0 on CUDA, whose
    /// pool holds no host records).
    pub unsized_bytes: u64,
}

/// The activations a micro-batch keeps for its backward, in an [`Estimate`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct KeptBytes {
    /// Activations alive at the end of a micro-batch's forward pass (saved for backward, or the
    /// checkpoints), in the compute dtype: the sum of the layers' `saved_bytes` and
    /// `input_saved_bytes`.
    pub activation_bytes: u64,
    /// Of `activation_bytes`, the micro-batch's input in the compute dtype (the first segment's
    /// input), which no layer makes.
    pub input_saved_bytes: u64,
    /// Activation bytes the backward pass recomputes and keeps for a segment's backward, per
    /// micro-batch (the sum of the layers' `recompute_bytes`; 0 without checkpointing).
    pub recomputed_bytes: u64,
}

/// The highest bytes in use in each phase of an [`Estimate`]'s step.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PhasePeaks {
    /// During the forward passes.
    pub forward_peak: u64,
    /// During the backward passes (recomputation included).
    pub backward_peak: u64,
    /// During the optimizer step.
    pub optimizer_peak: u64,
}

impl Estimate {
    /// The same estimate with `bytes` more in use throughout (e.g. what a host process holds
    /// before it loads the data): baseline and peaks shift, the layers do not.
    pub fn offset(mut self, bytes: u64) -> Self {
        self.held.baseline_bytes += bytes;
        self.phases.forward_peak += bytes;
        self.phases.backward_peak += bytes;
        self.phases.optimizer_peak += bytes;
        self.peak += bytes;
        if let Some(e) = &mut self.eval_peak {
            *e += bytes;
        }
        for e in &mut self.events {
            e.peak_bytes += bytes;
            e.current_bytes += bytes;
        }
        self
    }

    /// The highest bytes the run needs: the step's peak, or the evaluation's when it is higher.
    /// What a memory limit must hold (admission, `--checkpoint auto`, `--fit-memory`).
    pub fn run_peak(&self) -> u64 {
        self.peak.max(self.eval_peak.unwrap_or(0))
    }

    /// The phase of [`Estimate::run_peak`]: the step's peak phase, or `evaluation`.
    pub fn run_peak_phase(&self) -> &'static str {
        match self.eval_peak {
            Some(e) if e > self.peak => "evaluation",
            _ => self.peak_phase,
        }
    }
}

/// Predict the memory of training `cfg` on `device`, with the data set sized from the config
/// ([`DataSize::for_config`]).
///
/// # Errors
/// When the config is invalid or its data directory cannot be sized.
pub fn estimate(cfg: &TrainConfig, device: DeviceKind) -> Result<Estimate> {
    let data = DataSize::for_config(cfg)?;
    estimate_with(cfg, device, Baseline::Modeled(data))
}

/// Predict the memory of training `cfg` on `device` with the given baseline.
///
/// # Errors
/// When the config is invalid.
pub fn estimate_with(
    cfg: &TrainConfig,
    device: DeviceKind,
    baseline: Baseline,
) -> Result<Estimate> {
    cfg.validate()?;
    if cfg.memory.grad_checkpointing == GradCheckpointing::Auto
        || cfg.memory.compress_activations == CompressActivations::Auto
    {
        let (ck, storage) = resolve_checkpointing(cfg, device, baseline)?;
        let mut c = cfg.clone();
        c.memory.grad_checkpointing = ck;
        c.memory.compress_activations = storage;
        return estimate_with(&c, device, baseline);
    }
    let nodes = nodes_of(cfg.model);
    let n_blocks = nodes
        .iter()
        .filter(|n| n.kind != LayerKind::Linear)
        .map(|n| n.block + 1)
        .max()
        .unwrap_or(0);
    let segments = segments(n_blocks, cfg.memory.grad_checkpointing.resolved()?);
    let ctx = Ctx {
        n: cfg.micro_batch() as u64,
        s: elem_bytes(cfg.memory.precision.compute_dtype()),
        dtype: cfg.memory.precision.compute_dtype(),
        device,
        storage: cfg.memory.compress_activations.resolved()?,
    };
    let sizes = Sizes::of(cfg, &nodes, device);
    let (baseline_bytes, batch_bytes) = baseline_and_batches(cfg, baseline, device, &sizes);
    let gemm_slabs = runtime_bytes(cfg, device);
    let unsized_bytes = if device.is_cpu() {
        super::HOST_BOOKKEEPING_BYTES
    } else {
        0
    };
    let sim: Shared = std::rc::Rc::new(std::cell::RefCell::new(Sim::new(nodes.len())));
    sim.borrow_mut().cur = baseline_bytes + batch_bytes + gemm_slabs + unsized_bytes;
    let (activation_bytes, events, updater) =
        run_steps(&sim, cfg, &ctx, &nodes, &segments, &sizes)?;
    let (eval_batch, eval_peak) = eval_phase(&sim, cfg, &ctx, &nodes, baseline)?;
    drop(updater);
    let sim = sim.borrow();
    let peaks = sim.peaks;
    let (peak, peak_phase) = [
        (peaks[0], "forward"),
        (peaks[1], "backward"),
        (peaks[2], "optimizer"),
    ]
    .into_iter()
    .fold((0, "forward"), |a, b| if b.0 > a.0 { b } else { a });

    let kept = kept_activations(&nodes, &segments, &ctx);
    let layers = nodes
        .iter()
        .zip(&sim.layers)
        .zip(&kept.layers)
        .map(|((n, r), &(saved, recompute))| LayerEstimate {
            name: n.name.clone(),
            kind: n.kind,
            output_shape: n.out,
            params: n.params,
            output_bytes: n.out_bytes(&ctx),
            saved_bytes: saved,
            recompute_bytes: recompute,
            transient_bytes: r.transient,
        })
        .collect();
    Ok(Estimate {
        layers,
        setup: EstimateSetup {
            micro_batch: cfg.micro_batch(),
            accum_steps: cfg.steps.accum_steps,
            precision: cfg.memory.precision,
            grad_checkpointing: cfg.memory.grad_checkpointing,
            conv: cfg.model.conv,
            device,
            input_shape: nodes[0].inp,
            prefetch: cfg.prefetch_batches(!device.is_cpu()),
            eval_batch,
        },
        held: HeldBytes {
            param_bytes: sizes.param_bytes,
            grad_bytes: sizes.param_bytes,
            optimizer_bytes: sizes.optimizer_bytes,
            mask_bytes: sizes.mask_bytes,
            baseline_bytes,
            batch_bytes,
            runtime_bytes: gemm_slabs,
            unsized_bytes,
        },
        kept: KeptBytes {
            activation_bytes,
            input_saved_bytes: kept.input,
            recomputed_bytes: kept.layers.iter().map(|l| l.1).sum(),
        },
        phases: PhasePeaks {
            forward_peak: peaks[0],
            backward_peak: peaks[1],
            optimizer_peak: peaks[2],
        },
        peak,
        peak_phase,
        eval_peak,
        events,
    })
}

/// Every plan `--checkpoint auto` and `--compress-activations auto` may run for `cfg`, with its
/// predicted peak and recomputed FLOPs: the segmentations (under `--memory-limit` all 32, else
/// the named ones: none, stages, blocks) times the storages (every one for `auto`, else the
/// named one). [`auto_candidates`] keeps those `cfg`'s flags leave to choose.
///
/// # Errors
/// As [`estimate_with`].
pub fn segmentation_candidates(
    cfg: &TrainConfig,
    device: DeviceKind,
    baseline: Baseline,
) -> Result<Vec<Candidate>> {
    let segmentations = match cfg.memory.memory_limit {
        Some(_) => GradCheckpointing::all_segmentations(),
        None => GradCheckpointing::CONCRETE.to_vec(),
    };
    plans_over(cfg, &segmentations, device, baseline)
}

/// The plans `auto` chooses among for `cfg`: [`segmentation_candidates`], only `--checkpoint`'s
/// own segmentation when it names one.
///
/// # Errors
/// As [`estimate_with`].
pub fn auto_candidates(
    cfg: &TrainConfig,
    device: DeviceKind,
    baseline: Baseline,
) -> Result<Vec<Candidate>> {
    match cfg.memory.grad_checkpointing {
        GradCheckpointing::Auto => segmentation_candidates(cfg, device, baseline),
        named => plans_over(cfg, &[named], device, baseline),
    }
}

/// `segmentations` times the storages of `cfg` (every one for `auto`), each with its estimate.
fn plans_over(
    cfg: &TrainConfig,
    segmentations: &[GradCheckpointing],
    device: DeviceKind,
    baseline: Baseline,
) -> Result<Vec<Candidate>> {
    let storages = match cfg.memory.compress_activations.fixed() {
        Some(s) => vec![s],
        None => ActivationStorage::ALL.to_vec(),
    };
    let mut out = Vec::with_capacity(segmentations.len() * storages.len());
    for &storage in &storages {
        for &ck in segmentations {
            let mut c = cfg.clone();
            c.memory.grad_checkpointing = ck;
            c.memory.compress_activations = storage.into();
            out.push(Candidate {
                checkpointing: ck.resolved()?,
                storage,
                predicted_peak: estimate_with(&c, device, baseline)?.run_peak(),
                recompute_flops: recompute_flops(cfg.model, ck.resolved()?, cfg.steps.batch_size),
            });
        }
    }
    Ok(out)
}

/// The plan the estimate of an `auto` config (`--checkpoint auto`, `--compress-activations
/// auto`) describes: the choice of [`choose_checkpointing`](super::choose::choose_checkpointing),
/// or where nothing fits the limit the smallest predicted peak (the trainer refuses such a run;
/// an estimate still shows what it would need).
///
/// # Errors
/// As [`estimate_with`].
pub fn resolve_checkpointing(
    cfg: &TrainConfig,
    device: DeviceKind,
    baseline: Baseline,
) -> Result<(GradCheckpointing, CompressActivations)> {
    let candidates = auto_candidates(cfg, device, baseline)?;
    let i = pick(
        &candidates,
        heap_limit(cfg.memory.memory_limit, device),
        SAFETY_MARGIN,
    )
    .or_else(|| pick(&candidates, None, SAFETY_MARGIN))
    .unwrap_or(0);
    Ok(candidates
        .get(i)
        .map_or((GradCheckpointing::None, CompressActivations::None), |c| {
            (c.checkpointing.into(), c.storage.into())
        }))
}

/// Which layer keeps which activations for the backward of one micro-batch, by the tape's
/// rules (`core/src/step/tape.rs`): the table's columns, by layer.
struct KeptByLayer {
    /// The micro-batch's input, saved as the first segment's input.
    input: u64,
    /// Per node: (saved from the forward, recomputed in the backward).
    layers: Vec<(u64, u64)>,
}

/// Each segment's input is saved: the micro-batch's input for the first, else the output of the
/// previous block's last layer. Inside one segment spanning the model every block's h is saved
/// on the conv that makes it; inside checkpointed segments it is recomputed there instead. Either
/// way it is kept as the storage keeps it (codes with `--compress-activations`).
fn kept_activations(nodes: &[Node], segments: &[std::ops::Range<usize>], c: &Ctx) -> KeptByLayer {
    let blocks = blocks_of(nodes);
    let mut layers = vec![(0u64, 0u64); nodes.len()];
    let mut input = 0;
    for (i, seg) in segments.iter().enumerate() {
        // The last segment (the only one without checkpointing) keeps its conv outputs in the
        // forward and is not recomputed; the others keep their input and recompute the rest.
        let last = i + 1 == segments.len();
        if seg.start == 0 {
            input = c.n * IMAGE_BYTES as u64 * c.s;
        } else {
            let prev = &blocks[seg.start - 1];
            layers[prev.pool.unwrap_or(prev.bn)].0 += prev.out_bytes(c, nodes);
        }
        for b in &blocks[seg.clone()] {
            let conv = *b.convs.last().unwrap_or(&b.bn);
            // h as the storage keeps it, whether saved in the forward or recomputed.
            let kept = c.kept(b.h_bytes(c, nodes), b.channels(nodes));
            if last {
                layers[conv].0 += kept;
            } else {
                layers[conv].1 += kept;
            }
        }
    }
    KeptByLayer { input, layers }
}

/// The sizes a step of `cfg` holds whatever its batch: parameters (and the largest one), BatchNorm
/// statistics, optimizer state, the gradient slots, pruning masks and the masks' recomputation
/// transient.
pub(super) struct Sizes {
    pub(super) param_bytes: u64,
    /// Parameter tensors.
    pub(super) params: usize,
    pub(super) bn_stats: u64,
    /// The optimizer state's elements, as reported.
    pub(super) optimizer_bytes: u64,
    /// The gradient accumulator's slots, one `Option<Tensor>` per parameter (CPU heap).
    pub(super) grad_slots: u64,
    pub(super) mask_bytes: u64,
    pub(super) prune_transient: u64,
}

impl Sizes {
    fn of(cfg: &TrainConfig, nodes: &[Node], device: DeviceKind) -> Sizes {
        let shapes: Vec<Vec<usize>> = nodes.iter().flat_map(|n| n.param_shapes()).collect();
        let elems = |d: &[usize]| d.iter().product::<usize>() as u64;
        let param_bytes: u64 = shapes.iter().map(|d| elems(d) * 4).sum();
        let bn_stats: u64 = nodes
            .iter()
            .filter(|n| n.kind == LayerKind::BnRelu)
            .map(|n| n.out.0 as u64 * 2 * 4)
            .sum();
        let slots = match cfg.optimizer.kind {
            OptimizerKind::Sgd => 1,
            OptimizerKind::Adamw => 2,
        };
        // The pruned weights: convolutions and the head's weight (its first tensor), not biases.
        let pruned: Vec<u64> = if cfg.pruning.prune.is_some() {
            nodes
                .iter()
                .filter(|n| {
                    matches!(
                        n.kind,
                        LayerKind::Conv { .. } | LayerKind::Depthwise | LayerKind::Linear
                    )
                })
                .filter_map(|n| n.param_shapes().first().map(|d| elems(d)))
                .collect()
        } else {
            Vec::new()
        };
        let prune_transient = pruned.iter().copied().max().unwrap_or(0)
            * if device.is_cpu() {
                PRUNE_TRANSIENT_PER_WEIGHT_CPU
            } else {
                PRUNE_TRANSIENT_PER_WEIGHT_CUDA
            };
        let grad_slots = if device.is_cpu() {
            (shapes.len() * std::mem::size_of::<Option<candle_core::Tensor>>()) as u64
        } else {
            0
        };
        Sizes {
            param_bytes,
            params: shapes.len(),
            bn_stats,
            optimizer_bytes: slots * param_bytes,
            grad_slots,
            mask_bytes: pruned.iter().sum(),
            prune_transient,
        }
    }
}

/// What is in use when training begins, and the batches the batcher adds (CPU).
fn baseline_and_batches(
    cfg: &TrainConfig,
    baseline: Baseline,
    device: DeviceKind,
    sizes: &Sizes,
) -> (u64, u64) {
    let model = sizes.param_bytes + sizes.bn_stats + sizes.mask_bytes;
    let (baseline_bytes, train_images) = match baseline {
        Baseline::Measured {
            bytes,
            train_images,
            ..
        } => (bytes, train_images),
        Baseline::Modeled(data) if device.is_cpu() => (
            data.resident_bytes + model + RUNTIME_OVERHEAD_BYTES,
            data.train_images,
        ),
        Baseline::Modeled(data) => (model, data.train_images),
    };
    let batch_bytes = if device.is_cpu() {
        let per_batch = cfg.steps.batch_size as u64 * (IMAGE_BYTES as u64 * 4 + 4);
        // The batcher's permutation of the training split and its records live for the epoch.
        train_batches_in_flight(cfg, train_images) * per_batch
            + train_images as u64 * 8
            + crate::data::batcher::epoch_record_bytes()
    } else {
        0
    };
    (baseline_bytes, batch_bytes)
}

/// Training batches alive at once on the CPU: the one being trained and `--prefetch` prepared
/// ahead (no more than an epoch has). Their image buffers stay in the trainer's pool after the
/// epoch's steps, for the next epoch and the evaluation.
fn train_batches_in_flight(cfg: &TrainConfig, train_images: usize) -> u64 {
    let batches = (train_images / cfg.steps.batch_size.max(1)).max(1);
    (cfg.prefetch_batches(false) + 1).min(batches) as u64
}

/// The evaluation after an epoch's steps (`Trainer::evaluate`, `src/train/fit.rs`), on sizes:
/// the tape's forward in eval mode ([`memtrain_core::step::tape::LeanStep::evaluate`]) on a batch of
/// the micro-batch's size (or the whole evaluation split when it is smaller). In use around it:
/// the baseline, the optimizer state, the runtime's buffers, the training batches' image buffers
/// (pooled; the evaluation's batches reuse them), the evaluation batcher's order of the split
/// (8 bytes an image) and the labels of its batches in flight; the gradients and the training
/// permutation are gone. Returns the batch and the peak, `(0, None)` without evaluation.
fn eval_phase(
    sim: &Shared,
    cfg: &TrainConfig,
    ctx: &Ctx,
    nodes: &[Node],
    baseline: Baseline,
) -> Result<(usize, Option<u64>)> {
    let (train_images, eval_images) = match baseline {
        Baseline::Modeled(d) => (d.train_images, d.test_images),
        Baseline::Measured {
            train_images,
            eval_images,
            ..
        } => (train_images, eval_images),
    };
    let n = cfg.micro_batch().min(eval_images);
    if !cfg.output.eval || n == 0 {
        return Ok((0, None));
    }
    let c = Ctx {
        n: n as u64,
        s: ctx.s,
        dtype: ctx.dtype,
        device: ctx.device,
        storage: ctx.storage,
    };
    {
        let mut s = sim.borrow_mut();
        s.phase = Phase::Eval;
        // After the steps (the optimizer state still in use): the permutation and the training
        // batches' labels go, their image buffers stay pooled.
        if ctx.device.is_cpu() {
            let in_flight = train_batches_in_flight(cfg, train_images);
            let eval_batches = eval_images.div_ceil(n);
            let eval_in_flight = (cfg.prefetch_batches(false) + 1).min(eval_batches) as u64;
            let records = crate::data::batcher::epoch_record_bytes();
            let training = in_flight * cfg.steps.batch_size as u64 * 4 + train_images as u64 * 8;
            s.free(training + records);
            s.cur += eval_images as u64 * 8 + eval_in_flight * n as u64 * 4 + records;
        }
        s.peaks[Phase::Eval as usize] = s.cur;
    }
    let blocks = blocks_of(nodes).len();
    let ops = super::sizing::Sizing::new(sim.clone(), &c, nodes);
    super::sizing::eval_batch(ops, n, blocks, ctx.storage)?;
    let peak = sim.borrow().peaks[Phase::Eval as usize];
    Ok((n, Some(peak)))
}

/// The gemm crate's per-thread L2 packing buffers, allocated by the first matrix product on each
/// thread and kept: the convolution threads (the head's products run single-threaded on the
/// calling thread, one of them; see `memtrain_kernels::linear`). On CUDA, the cuDNN workspace of a `cudnn`
/// build, allocated by the first convolution and kept.
fn runtime_bytes(cfg: &TrainConfig, device: DeviceKind) -> u64 {
    let dtype = cfg.memory.precision.compute_dtype();
    match device {
        // Without the gemm crate in the convolutions (the AVX-512 bf16 kernels), only the
        // calling thread's head products make one.
        DeviceKind::Cpu {
            threads,
            l2_cache_bytes,
        } if memtrain_kernels::conv2d::cpu_uses_gemm_crate(dtype) => {
            threads.min(cfg.micro_batch()).max(1) as u64 * l2_cache_bytes
        }
        DeviceKind::Cpu { l2_cache_bytes, .. } => l2_cache_bytes,
        DeviceKind::Cuda => {
            memtrain_kernels::conv2d_cudnn::cuda_runtime_bytes(cfg.cuda.cudnn_workspace)
        }
    }
}

/// Two steps of the core's step ([`memtrain_core::step::train::train_step`]) on sizes: step 1 builds
/// the optimizer state, step 2 carries it through forward and backward — the steady state, whose
/// events are the prediction of the timeline. Around each step, what the trainer adds on the CPU
/// heap: the gradient accumulator's slots, the micro-batches' results, the step's timeline, and
/// pruning's transient after the update. Returns the largest activation bytes of a micro-batch,
/// the second step's events and the updater (the optimizer's state in use until it is dropped).
fn run_steps<'a>(
    sim: &Shared,
    cfg: &TrainConfig,
    ctx: &'a Ctx,
    nodes: &'a [Node],
    segments: &[std::ops::Range<usize>],
    sizes: &Sizes,
) -> Result<(u64, Vec<EventPrediction>, Updater<Sz>)> {
    let host = ctx.device.is_cpu();
    let blocks = blocks_of(nodes).len();
    let tape = || super::events::TapeHost {
        segments: segments.to_vec(),
        blocks,
    };
    let o = &cfg.optimizer;
    let mut updater = Updater {
        optimizer: Optimizer::new(o.kind, sizes.params, o.momentum, o.weight_decay),
        scaler: LossScaler::for_precision(cfg.memory.precision),
    };
    let settings = StepSettings {
        accum_steps: cfg.steps.accum_steps,
        lr: o.lr,
        clip_grad_norm: o.clip_grad_norm,
    };
    // On the CPU the trainer's timeline of a step is heap: its records (reserved at the step's
    // start for as many events as the step before had), each event's layer name (allocated as the
    // event is recorded), the run's label and the probe's name. It is kept until the next step
    // ends.
    let timeline_bytes = (cfg.label().len() + memtrain_core::memory::CPU_HEAP_PROBE.len()) as u64;
    let mut held_timeline = 0;
    let mut obs = Events {
        sim: sim.clone(),
        events: Vec::new(),
        host: host.then(tape),
        forward: 0,
        accum_steps: settings.accum_steps,
        // The micro-batches' results.
        results: if host {
            (settings.accum_steps * std::mem::size_of::<memtrain_core::step::MicroResult>()) as u64
        } else {
            0
        },
        activation_bytes: 0,
    };
    for step in 0..2 {
        {
            let mut s = sim.borrow_mut();
            s.event_peak = s.cur;
            s.phase = Phase::Forward;
        }
        if host && step > 0 {
            sim.borrow_mut()
                .alloc(obs.events.len() as u64 * super::events::TIMELINE_EVENT_BYTES);
        }
        if host && step == 1 {
            // What the first step's end leaves for the run: its batch's buffer back in the
            // batcher's pool, and the run history's first records.
            sim.borrow_mut()
                .alloc(super::events::after_first_step_bytes(cfg));
        }
        obs.events.clear();
        // The gradient accumulator's slots, the micro-batches' results and the tape's vectors.
        let step_vectors = obs.host.as_ref().map_or(0, |t| t.step_vectors());
        sim.borrow_mut()
            .alloc(sizes.grad_slots + obs.results + step_vectors);
        let mut lean = LeanStep::on(
            Sizing::new(sim.clone(), ctx, nodes),
            segments.to_vec(),
            ctx.storage,
        );
        let inputs = Sizing::new(sim.clone(), ctx, nodes);
        let per_forward = obs.host.as_ref().map_or(0, |t| t.before_forward());
        let micro_batch = |_| {
            let batch = inputs.batch(ctx.n as usize);
            sim.borrow_mut().alloc(per_forward);
            Ok(batch)
        };
        train_step(&mut lean, &mut updater, settings, micro_batch, &mut obs)?;
        drop(lean);
        let mut s = sim.borrow_mut();
        // The update done, the gradients and the tape's vectors go; pruning recomputes its masks.
        s.free(sizes.grad_slots + step_vectors);
        s.spike(sizes.prune_transient);
        obs.events.push(EventPrediction {
            phase: "optimizer",
            layer: "optimizer".into(),
            peak_bytes: s.event_peak,
            current_bytes: s.cur,
            saved_bytes: 0,
        });
        if host {
            s.alloc("optimizer".len() as u64);
            // The step's timeline replaces the one before.
            let names: u64 = obs.events.iter().map(|e| e.layer.len() as u64).sum();
            let records = obs.events.len() as u64 * super::events::TIMELINE_EVENT_BYTES;
            s.alloc(timeline_bytes + if step == 0 { records } else { 0 });
            s.free(held_timeline);
            held_timeline = records + names + timeline_bytes;
        }
    }
    Ok((obs.activation_bytes, obs.events, updater))
}
