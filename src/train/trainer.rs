//! The one training loop. Every optimization is a branch of configuration inside it, never a
//! copied loop: precision picks the compute dtype and the loss scaler, `accum_steps` splits each
//! batch into micro-batches, `grad_checkpointing` picks the lean step's segments
//! ([`super::lean`]), and `conv` picks the layer type when the model is built.
//!
//! A step is a plain sequence of phases: per micro-batch [`LeanStep::forward`] then
//! [`LeanStep::backward`], then the optimizer update. After each, the CPU budget is checked, the
//! [`MemoryRecorder`] folds the phase's peak and the callbacks' hook runs with the records; an
//! error in a phase is named with it. The run's state is taken and put back as a
//! [`TrainState`] ([`Trainer::snapshot`], [`Trainer::restore`]); [`super::checkpoint`] only
//! stores it.

use super::accumulate::GradAccumulator;
use super::checkpoint::Checkpoint;
pub use super::history::StepResult;
use super::history::{EpochProgress, RunHistory};
use super::lean::{LeanStep, NoObserver, StepEvent, StepObserver};
use super::optim::{one_cycle_lr, Optimizer};
use super::precision::LossScaler;
use super::reference::loss_and_correct;
use super::state::TrainState;
use super::summary::Summary;
use crate::callbacks::{
    BatchInfo, Callback, CallbackList, EpochBegin, EpochEnd, EpochStats, MetricsLogger,
    ProgressCallback, TrainBegin, TrainEnd,
};
use crate::config::TrainConfig;
use crate::data::{self, Batch, Batcher, BatcherOptions, DataSplits, Dataset, IMAGE_BYTES};
use crate::device::{device_name, select_device};
use crate::error::{Error, Result};
use crate::memory::timeline::{
    CategoryBytes, OomSnapshot, StepTimeline, TimelineEvent, TimelineProbe, OOM_SNAPSHOT_FILE,
};
use crate::memory::{
    format_bytes, is_device_oom, probe_for, MemoryLog, MemoryProbe, MemoryRecorder,
};
use crate::model::{Cnn, Mode, ModelConfig};
use crate::phase::Phase;
use candle_core::{DType, Device, Tensor, Var};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// What the caller adds to a run besides the configuration.
#[derive(Default)]
pub struct TrainerOptions {
    /// Extra callbacks, called after the built-in ones.
    pub callbacks: Vec<Box<dyn Callback>>,
    /// Show progress (bars or plain lines).
    pub progress: bool,
    /// Write config/CSV/summary files into the run directory.
    pub log_files: bool,
    /// On out-of-memory in a step, write [`OOM_SNAPSHOT_FILE`] into the run directory (creating
    /// it if needed, so that summary-only sweep children leave one too).
    pub oom_snapshot: bool,
    /// Set to true (e.g. by a signal handler) to stop after the current step, or between
    /// evaluation batches.
    pub stop: Option<Arc<AtomicBool>>,
    /// How a run that writes files (`log_files`) claims its directory: always under an
    /// exclusive lock; a new run also refuses an earlier run's results unless told to overwrite.
    pub claim: super::run_dir::Claim,
}

/// A training run: model, optimizer, data and callbacks, driven by a [`TrainConfig`].
pub struct Trainer {
    /// The configuration.
    pub config: TrainConfig,
    /// The device.
    pub device: Device,
    /// The model.
    pub model: Cnn,
    pub(crate) vars: Vec<Var>,
    /// The optimizer and its state.
    pub optimizer: Optimizer,
    /// The f16 loss scaler (None for f32/bf16).
    pub scaler: Option<LossScaler>,
    pub(crate) probe: Arc<dyn MemoryProbe>,
    /// The same probe, typed: the step splits its watermark at every layer event.
    pub(crate) timeline_probe: Arc<TimelineProbe>,
    /// The memory timeline of the newest step.
    pub(crate) timeline: StepTimeline,
    /// Whether the run writes files into its directory.
    pub(crate) log_files: bool,
    oom_snapshot: bool,
    /// Training batches' image buffers, reused from step to step and epoch to epoch.
    pub(crate) batch_buffers: crate::data::BufferPool,
    /// The run's memory records, read at every phase boundary and handed to the callbacks.
    pub(crate) memory: MemoryRecorder,
    pub(crate) callbacks: CallbackList,
    pub(crate) train: Arc<Dataset>,
    pub(crate) eval: Arc<Dataset>,
    pub(crate) eval_is_validation: bool,
    /// [`Dataset::fingerprint`] of the training split, computed at the first checkpoint or resume.
    train_fingerprint: OnceLock<String>,
    pub(crate) data_description: String,
    pub(crate) run_dir: PathBuf,
    pub(crate) stop: Option<Arc<AtomicBool>>,
    /// Optimizer steps taken.
    pub global_step: usize,
    /// Epoch to start at (0, or later when resuming).
    pub start_epoch: usize,
    /// Batch within `start_epoch` to start at.
    pub start_batch: usize,
    pub(crate) steps_per_epoch: usize,
    pub(crate) total_steps: usize,
    /// Checkpoint writing (on when `TrainerOptions::log_files`); see [`super::checkpoint`].
    pub checkpoints: super::checkpoint::CheckpointSaver,
    /// The run so far (restored from a checkpoint when resuming): ended epochs, the epoch in
    /// progress, totals and step times.
    pub(crate) history: super::history::RunHistory,
    /// The run directory's lock, held while the trainer lives (runs that write files only).
    _run_lock: Option<super::run_dir::RunDirLock>,
    /// `--prune`: the schedule and masks, applied after every optimizer step.
    pub(crate) pruner: Option<super::prune::Pruner>,
    /// `--cuda-graph`: the captured forward and backward ([`super::graph`]).
    pub(crate) cuda_graph: super::graph::GraphSlot,
}

/// `runs/<UTC timestamp>-<pid>` for a run without `--out` (the pid keeps two runs started in the
/// same second apart).
pub fn default_run_dir() -> PathBuf {
    PathBuf::from("runs").join(format!(
        "{}-{}",
        chrono::Utc::now().format("%Y%m%d-%H%M%S"),
        std::process::id()
    ))
}

/// The CPU budget of `--memory-limit`: the counting allocator's peak since the last reading
/// must stay within the limit.
fn check_budget(probe: &dyn MemoryProbe, epoch: usize, batch: usize, phase: Phase) -> Result<()> {
    match probe.limit() {
        Some(limit) if probe.available() && probe.peak() > limit => Err(Error::OutOfMemory {
            limit: format_bytes(limit),
            epoch,
            batch,
            phase: phase.to_string(),
            snapshot: None,
        }),
        _ => Ok(()),
    }
}

/// Images per second of step time after skipping the warm-up steps (the first 3, or a quarter
/// of the steps when there are fewer than 12). None with fewer than 2 steps.
pub fn steady_throughput(steps: &[(usize, f64)]) -> Option<f64> {
    if steps.len() < 2 {
        return None;
    }
    let skip = 3.min(steps.len() / 4).max(1);
    let (images, secs) = steps[skip..]
        .iter()
        .fold((0usize, 0f64), |(i, s), (n, t)| (i + n, s + t));
    Some(images as f64 / secs.max(1e-9))
}

/// The squared global L2 norm of the gradients; not finite when any gradient is not.
fn squared_norm(grads: &[Option<Tensor>]) -> Result<f64> {
    let mut sum = 0f64;
    for g in grads.iter().flatten() {
        sum += g
            .sqr()?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
    }
    Ok(sum)
}

/// The micro-batches of a batch: `(index, images, labels)` of each of `k` equal slices.
fn micro_batches<'a>(
    k: usize,
    images: &'a [f32],
    labels: &'a [u32],
) -> Result<impl Iterator<Item = (usize, &'a [f32], &'a [u32])>> {
    let n = labels.len();
    if k == 0 || !n.is_multiple_of(k) || images.len() != n * IMAGE_BYTES {
        return Err(Error::config(format!(
            "a batch of {n} images cannot be split into {k} micro-batches"
        )));
    }
    let mb = n / k;
    Ok(images
        .chunks(mb * IMAGE_BYTES)
        .zip(labels.chunks(mb))
        .enumerate()
        .map(|(i, (x, y))| (i, x, y)))
}

/// The timeline's name of the optimizer event of a step the loss scaler skipped.
const SKIPPED_UPDATE: &str = "optimizer (skipped)";

/// `current` bytes split into categories: the step's constant ones (`fixed`), its gradient
/// buffers and saved activations, and the rest as transient. When less is in use than the
/// categories account for (something that was in use at the step's start was freed during it),
/// `other` shrinks, so the categories always add up to `current`.
fn split_categories(fixed: CategoryBytes, grads: u64, saved: u64, current: u64) -> CategoryBytes {
    let step = fixed.params + fixed.optimizer + grads + saved;
    let other = fixed.other.min(current.saturating_sub(step));
    CategoryBytes {
        grads,
        saved,
        other,
        transient: current.saturating_sub(step + other),
        ..fixed
    }
}

/// The step being trained, for the callbacks' contexts and error messages.
#[derive(Debug, Clone, Copy)]
struct StepInfo {
    epoch: usize,
    batch: usize,
    global_step: usize,
    accum_steps: usize,
    images: usize,
    lr: f64,
    loss_scale: Option<f64>,
}

impl StepInfo {
    /// The callbacks' context at micro-batch `micro`, before the step's results are known.
    fn context<'a>(
        &self,
        micro: usize,
        probe: &'a dyn MemoryProbe,
        memory: &'a MemoryLog,
    ) -> BatchInfo<'a> {
        BatchInfo {
            epoch: self.epoch,
            batch: self.batch,
            global_step: self.global_step,
            micro_batch: micro,
            accum_steps: self.accum_steps,
            images: self.images,
            loss: None,
            correct: None,
            lr: self.lr,
            loss_scale: self.loss_scale,
            skipped: false,
            step_secs: None,
            grad_norm: None,
            probe,
            memory,
        }
    }

    /// Turn a Candle out-of-memory error in `phase` of this step into [`Error::OutOfMemory`].
    fn name_oom(&self, limit: Option<u64>, phase: Phase) -> impl Fn(Error) -> Error {
        let (epoch, batch) = (self.epoch, self.batch);
        move |e| match e {
            Error::Candle(ce) if is_device_oom(&ce) => Error::OutOfMemory {
                limit: limit
                    .map(format_bytes)
                    .unwrap_or_else(|| "device memory".into()),
                epoch,
                batch,
                phase: phase.to_string(),
                snapshot: None,
            },
            other => other,
        }
    }
}

/// The end of a forward or backward phase of micro-batch `micro`: the CPU budget is checked
/// against the peak since the last boundary, the memory recorder folds that peak into the phase,
/// and the callbacks' hook runs with the record.
fn phase_end(
    callbacks: &mut CallbackList,
    memory: &mut MemoryRecorder,
    probe: &dyn MemoryProbe,
    step: &StepInfo,
    micro: usize,
    phase: Phase,
) -> Result<()> {
    check_budget(probe, step.epoch, step.batch, phase)?;
    memory.phase_end(phase);
    let ctx = step.context(micro, probe, memory.log());
    match phase {
        Phase::Forward => callbacks.on_after_forward(&ctx),
        Phase::Backward => callbacks.on_after_backward(&ctx),
        Phase::Optimizer | Phase::Eval | Phase::Other => Ok(()),
    }
}

/// The memory timeline of a step as its layer events come in: each event's reading, split into
/// categories, and the CPU budget checked against the event's peak.
struct TimelineRecorder<'a> {
    probe: &'a TimelineProbe,
    step: &'a StepInfo,
    micro: usize,
    /// Categories constant over the step (params, optimizer state, the rest at the start).
    fixed: CategoryBytes,
    events: &'a mut Vec<TimelineEvent>,
}

impl TimelineRecorder<'_> {
    /// Record an event with the probe's reading; the budget is checked against its peak.
    fn record(&mut self, phase: Phase, layer: &str, saved: u64, grads: u64) -> Result<()> {
        let peak = self.probe.take_event_peak();
        let current = self.probe.current();
        self.events.push(TimelineEvent {
            index: self.events.len(),
            phase,
            layer: layer.to_string(),
            micro_batch: self.micro,
            current_bytes: current,
            peak_bytes: peak,
            categories: split_categories(self.fixed, grads, saved, current),
            predicted_peak_bytes: None,
            predicted_current_bytes: None,
        });
        match self.probe.limit() {
            Some(limit) if self.probe.available() && peak > limit => Err(Error::OutOfMemory {
                limit: format_bytes(limit),
                epoch: self.step.epoch,
                batch: self.step.batch,
                phase: format!("{phase} at {layer}"),
                snapshot: None,
            }),
            _ => Ok(()),
        }
    }
}

impl StepObserver for TimelineRecorder<'_> {
    fn event(&mut self, e: StepEvent<'_>) -> Result<()> {
        self.record(e.phase, e.layer, e.saved_bytes, e.grad_bytes)
    }
}

impl Trainer {
    /// Load the data named by the config and build a trainer. A set `options.stop` also stops
    /// the loading ([`crate::data::DataOptions::stop`]).
    pub fn from_config(config: TrainConfig, options: TrainerOptions) -> Result<Self> {
        config.validate()?;
        let data = data::load(&data::DataOptions::for_config(
            &config,
            options.stop.clone(),
        ))?;
        Trainer::new(config, data, options)
    }

    /// Build a trainer on already loaded data.
    pub fn new(mut config: TrainConfig, data: DataSplits, options: TrainerOptions) -> Result<Self> {
        config.validate()?;
        if data.train.len() < config.batch_size {
            return Err(Error::config(format!(
                "the training split has {} images, fewer than --batch-size {}; lower --batch-size",
                data.train.len(),
                config.batch_size
            )));
        }
        let steps_per_epoch = data.train.len() / config.batch_size;
        let by_epochs = steps_per_epoch * config.epochs;
        let total_steps = config.max_steps.map_or(by_epochs, |m| m.min(by_epochs));
        // Checked before anything is created: the schedule's end depends on the run's length.
        let prune_schedule = super::prune::Schedule::for_run(&config, total_steps)?;
        let device = select_device(config.device.as_deref())?;
        // Process-wide, like PyTorch's flag: the conv ops have no configuration at hand.
        memtrain_kernels::set_tf32(config.tf32 == crate::config::Tf32::On);
        let cuda_graph = super::graph::GraphSlot::for_run(&config, &device)?;
        if device.is_cpu() {
            // Every op allocates its output; without this, glibc maps and unmaps the large ones
            // on every step (see `retain_freed_memory`).
            crate::memory::retain_freed_memory();
        }
        let timeline_probe = Arc::new(TimelineProbe::new(probe_for(
            &device,
            config.memory_limit,
            config.pool_cache,
        )?));
        let probe: Arc<dyn MemoryProbe> = timeline_probe.clone();
        if config.grad_checkpointing == crate::config::GradCheckpointing::Auto {
            config.grad_checkpointing = resolve_auto_checkpointing(&config, &data, &device)?;
            if options.progress {
                eprintln!(
                    "--checkpoint auto: {} (the estimate's {})",
                    config.grad_checkpointing,
                    if config.memory_limit.is_some() {
                        "cheapest that fits --memory-limit"
                    } else {
                        "smallest peak"
                    }
                );
            }
        }
        let run_dir = config.out.clone().unwrap_or_else(default_run_dir);
        let run_lock = options
            .log_files
            .then(|| super::run_dir::claim(&run_dir, options.claim))
            .transpose()?;
        let model = Cnn::new(
            ModelConfig {
                width: config.width,
                conv: config.conv,
            },
            &device,
            config.seed,
        )?;
        let vars = model.vars();
        let optimizer = Optimizer::new(
            config.optimizer,
            vars.len(),
            config.momentum,
            config.weight_decay,
        );
        let scaler = LossScaler::for_precision(config.precision);

        let mut list: Vec<Box<dyn Callback>> = Vec::new();
        if options.progress {
            list.push(Box::new(ProgressCallback::new(config.quiet)));
        }
        if options.log_files {
            list.push(Box::new(MetricsLogger::new(&run_dir)));
        }
        list.extend(options.callbacks);

        let pruner = prune_schedule
            .map(|s| super::prune::Pruner::new(s, &model.named_vars()))
            .transpose()?;
        Ok(Trainer {
            memory: MemoryRecorder::new(probe.clone()),
            device,
            model,
            vars,
            optimizer,
            scaler,
            probe,
            timeline_probe,
            timeline: StepTimeline::default(),
            log_files: options.log_files,
            oom_snapshot: options.oom_snapshot,
            batch_buffers: crate::data::BufferPool::new(),
            callbacks: CallbackList::new(list),
            train: Arc::new(data.train),
            eval: Arc::new(data.test),
            eval_is_validation: data.test_is_validation,
            train_fingerprint: OnceLock::new(),
            data_description: data.description,
            run_dir,
            checkpoints: super::checkpoint::CheckpointSaver::new(options.log_files),
            stop: options.stop,
            global_step: 0,
            start_epoch: 0,
            start_batch: 0,
            steps_per_epoch,
            total_steps,
            history: Default::default(),
            _run_lock: run_lock,
            pruner,
            cuda_graph,
            config,
        })
    }

    /// The one line describing the data source and split.
    pub fn data_description(&self) -> &str {
        &self.data_description
    }

    /// The run directory.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// The memory probe.
    pub fn probe(&self) -> &Arc<dyn MemoryProbe> {
        &self.probe
    }

    /// The run's memory records so far.
    pub fn memory_log(&self) -> &MemoryLog {
        self.memory.log()
    }

    /// The memory timeline of the newest training step (empty before the first), with the
    /// estimate's prediction at each event when the estimate has the same events.
    pub fn step_timeline(&self) -> StepTimeline {
        self.with_predictions(self.timeline.clone(), self.memory_estimate().as_ref())
    }

    /// `t` with the prediction of `estimate` at each event, when its events are the estimate's
    /// (all of them, or the first ones for a step that failed part-way).
    fn with_predictions(
        &self,
        mut t: StepTimeline,
        estimate: Option<&crate::memory::estimate::Estimate>,
    ) -> StepTimeline {
        if let Some(e) = estimate.filter(|_| self.probe.available()) {
            // The estimate predicts an applied update; a skipped one gets no prediction.
            let same = |p: &str, m: &str| p == m || (p == "optimizer" && m == SKIPPED_UPDATE);
            if t.events.len() <= e.events.len()
                && e.events
                    .iter()
                    .zip(&t.events)
                    .all(|(p, m)| same(&p.layer, &m.layer))
            {
                for (ev, p) in t.events.iter_mut().zip(&e.events) {
                    if ev.layer != SKIPPED_UPDATE {
                        ev.predicted_peak_bytes = Some(p.peak_bytes);
                        ev.predicted_current_bytes = Some(p.current_bytes);
                    }
                }
            }
        }
        t
    }

    /// The step's constant memory categories for a step that starts with `start_bytes` in use:
    /// parameters and BatchNorm statistics, optimizer state, and the rest of what is in use.
    fn fixed_categories(&self, start_bytes: u64) -> CategoryBytes {
        let params = self.model.num_params() as u64 * 4
            + self
                .model
                .named_buffers()
                .iter()
                .map(|(_, t)| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
                .sum::<u64>();
        let optimizer = self.optimizer.state_bytes();
        CategoryBytes {
            params,
            optimizer,
            other: start_bytes.saturating_sub(params + optimizer),
            ..CategoryBytes::default()
        }
    }

    /// Optimizer steps per epoch.
    pub fn steps_per_epoch(&self) -> usize {
        self.steps_per_epoch
    }

    /// Optimizer steps of the whole run.
    pub fn total_steps(&self) -> usize {
        self.total_steps
    }

    /// The trainable parameters, in the model's order.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The pruning state of a `--prune` run.
    pub fn pruner(&self) -> Option<&super::prune::Pruner> {
        self.pruner.as_ref()
    }

    fn batch_tensors(&self, images: &[f32], labels: &[u32]) -> Result<(Tensor, Tensor)> {
        let n = labels.len();
        let x = Tensor::from_slice(images, (n, 3, 32, 32), &self.device)?;
        let y = Tensor::from_slice(labels, n, &self.device)?;
        Ok((x, y))
    }

    /// Gradients of the mean loss over a batch (f32, aligned with [`Trainer::vars`]), computed
    /// exactly as a training step would (micro-batches, precision, checkpointing) but without
    /// an optimizer step and without hooks. BatchNorm running statistics are updated as in a step.
    pub fn compute_grads(
        &self,
        images: &[f32],
        labels: &[u32],
    ) -> Result<(f64, Vec<Option<Tensor>>)> {
        if let Some(r) = self.cuda_graph.grads(self, images, labels, 1.0) {
            return r.map(|(loss, _, grads)| (loss, grads));
        }
        let k = self.config.accum_steps;
        let mut acc = GradAccumulator::new(self.vars.len());
        let mut loss = 0.0;
        for (_, xs, ys) in micro_batches(k, images, labels)? {
            let (x, y) = self.batch_tensors(xs, ys)?;
            let r = self
                .lean_step()
                .run(&x, &y, 1.0 / k as f64, &mut acc, &mut NoObserver)?;
            loss += r.loss / k as f64;
        }
        Ok((loss, acc.into_grads()))
    }

    /// [`Trainer::compute_grads`] through Candle's autograd instead of the lean step: the oracle
    /// the lean step is tested against (same micro-batches, precision and checkpointing).
    pub fn reference_grads(
        &self,
        images: &[f32],
        labels: &[u32],
    ) -> Result<(f64, Vec<Option<Tensor>>)> {
        let k = self.config.accum_steps;
        let mut acc = GradAccumulator::new(self.vars.len());
        let mut loss = 0.0;
        for (_, xs, ys) in micro_batches(k, images, labels)? {
            let (x, y) = self.batch_tensors(xs, ys)?;
            let r = super::reference::forward_backward(
                &self.model,
                &self.vars,
                &x,
                &y,
                self.config.precision.compute_dtype(),
                self.config.grad_checkpointing,
                1.0 / k as f64,
                &mut acc,
            )?;
            loss += r.loss / k as f64;
        }
        Ok((loss, acc.into_grads()))
    }

    /// The lean step of one micro-batch, in the run's precision and checkpoint segments.
    fn lean_step(&self) -> LeanStep<'_> {
        LeanStep::new(
            &self.model,
            self.config.precision.compute_dtype(),
            self.model.segments(self.config.grad_checkpointing),
        )
    }

    /// One optimizer step on a batch: for each of the K micro-batches the forward phase and the
    /// backward phase, then the optimizer phase, each followed by its memory reading and hook.
    pub fn train_step(
        &mut self,
        batch: &Batch,
        epoch: usize,
        batch_idx: usize,
    ) -> Result<StepResult> {
        let step = StepInfo {
            epoch,
            batch: batch_idx,
            global_step: self.global_step,
            accum_steps: self.config.accum_steps,
            images: batch.len,
            lr: one_cycle_lr(
                self.global_step,
                self.total_steps,
                self.config.lr,
                self.config.warmup_frac,
            ),
            loss_scale: self.scaler.as_ref().map(|s| s.scale),
        };
        let t0 = Instant::now();
        // The step's memory timeline; kept outside the step so a failing step leaves the
        // events up to the failure for the OOM snapshot.
        let mut events = Vec::new();
        let mut start_bytes = self.probe.current();
        let result = self.step_phases(&step, batch, &mut events, &mut start_bytes, t0);
        let timeline = StepTimeline {
            label: self.config.label(),
            probe: self.probe.name().to_string(),
            global_step: self.global_step,
            start_bytes,
            events,
        };
        match result {
            Ok(r) => {
                self.timeline = timeline;
                self.global_step += 1;
                self.history
                    .step_times
                    .push((r.images, t0.elapsed().as_secs_f64()));
                self.checkpoints.note_step(&r);
                Ok(r)
            }
            Err(e) if e.is_oom() && self.oom_snapshot => Err(self.write_oom_snapshot(e, timeline)),
            Err(e) => Err(e),
        }
    }

    /// The phases of [`Trainer::train_step`] in order, with their hooks; `events` and
    /// `start_bytes` receive the timeline as it is made.
    fn step_phases(
        &mut self,
        step: &StepInfo,
        batch: &Batch,
        events: &mut Vec<TimelineEvent>,
        start_bytes: &mut u64,
        t0: Instant,
    ) -> Result<StepResult> {
        let limit = self.config.memory_limit;
        let probe = self.probe.clone();
        self.memory.step_begin();
        self.callbacks
            .on_batch_begin(&step.context(0, &*probe, self.memory.log()))?;
        *start_bytes = probe.current();
        let fixed = self.fixed_categories(*start_bytes);
        let (loss, correct, grads) = self.forward_backward(step, batch, fixed, events)?;
        if !loss.is_finite() && self.scaler.is_none() {
            return Err(Error::NonFinite {
                what: "loss".into(),
                epoch: step.epoch,
                batch: step.batch,
                phase: "forward".into(),
                advice: self.divergence_advice(),
            });
        }
        let (skipped, grad_norm) = self
            .apply_update(grads, step)
            .map_err(step.name_oom(limit, Phase::Optimizer))?;
        self.device.synchronize()?;
        check_budget(&*probe, step.epoch, step.batch, Phase::Optimizer)?;
        let current = probe.current();
        events.push(TimelineEvent {
            index: events.len(),
            phase: Phase::Optimizer,
            // A step the loss scaler skipped has no update (and no prediction).
            layer: if skipped {
                SKIPPED_UPDATE.into()
            } else {
                "optimizer".into()
            },
            micro_batch: step.accum_steps - 1,
            current_bytes: current,
            peak_bytes: self.timeline_probe.take_event_peak(),
            categories: split_categories(fixed, 0, 0, current),
            predicted_peak_bytes: None,
            predicted_current_bytes: None,
        });
        self.memory
            .step_end(step.epoch, step.batch, step.global_step);
        let end = BatchInfo {
            loss: Some(loss),
            correct: Some(correct),
            skipped,
            step_secs: Some(t0.elapsed().as_secs_f64()),
            grad_norm: Some(grad_norm),
            ..step.context(step.accum_steps - 1, &*probe, self.memory.log())
        };
        self.callbacks.on_batch_end(&end)?;
        Ok(StepResult {
            loss,
            correct,
            images: batch.len,
            skipped,
            lr: step.lr,
        })
    }

    /// The forward and backward phases of every micro-batch of a batch (the loss multiplied by
    /// the loss scale, the gradients still scaled): `(mean loss, correct, f32 gradients)`.
    fn forward_backward(
        &mut self,
        step: &StepInfo,
        batch: &Batch,
        fixed: CategoryBytes,
        events: &mut Vec<TimelineEvent>,
    ) -> Result<(f64, usize, Vec<Option<Tensor>>)> {
        let limit = self.config.memory_limit;
        let k = step.accum_steps;
        let loss_mult = step.loss_scale.unwrap_or(1.0) / k as f64;
        if let Some(r) = self.cuda_graph.grads(
            self,
            &batch.images,
            &batch.labels,
            step.loss_scale.unwrap_or(1.0),
        ) {
            // One launch ran both phases of every micro-batch; their hooks follow it.
            let r = r.map_err(step.name_oom(limit, Phase::Forward))?;
            let probe = self.probe.clone();
            for micro in 0..k {
                for phase in [Phase::Forward, Phase::Backward] {
                    phase_end(
                        &mut self.callbacks,
                        &mut self.memory,
                        &*probe,
                        step,
                        micro,
                        phase,
                    )?;
                }
            }
            return Ok(r);
        }
        let mut acc = GradAccumulator::new(self.vars.len());
        let (mut loss, mut correct) = (0.0, 0);
        for (micro, xs, ys) in micro_batches(k, &batch.images, &batch.labels)? {
            let (x, y) = self.batch_tensors(xs, ys)?;
            // The lean step borrows the model while the hooks borrow the callbacks and the
            // recorder: disjoint fields.
            let Trainer {
                model,
                config,
                callbacks,
                memory,
                probe,
                timeline_probe,
                ..
            } = self;
            let mut lean = LeanStep::new(
                model,
                config.precision.compute_dtype(),
                model.segments(config.grad_checkpointing),
            );
            let mut timeline = TimelineRecorder {
                probe: timeline_probe,
                step,
                micro,
                fixed,
                events: &mut *events,
            };
            let (r, tape) = lean
                .forward(&x, &y, loss_mult, &acc, &mut timeline)
                .map_err(step.name_oom(limit, Phase::Forward))?;
            phase_end(callbacks, memory, &**probe, step, micro, Phase::Forward)?;
            lean.backward(tape, &mut acc, &mut timeline)
                .map_err(step.name_oom(limit, Phase::Backward))?;
            phase_end(callbacks, memory, &**probe, step, micro, Phase::Backward)?;
            loss += r.loss / k as f64;
            correct += r.correct;
        }
        Ok((loss, correct, acc.into_grads()))
    }

    /// The run's state, continuing at batch `next_batch` of `epoch` (equal to the steps per
    /// epoch: the epoch's steps are done, its end is not), with `progress` as the epoch in
    /// progress. Tensors are copied to the CPU; the memory log keeps the ended epochs only (an
    /// interrupted epoch's record is redone when it ends).
    pub fn snapshot(
        &self,
        epoch: usize,
        next_batch: usize,
        progress: Option<&EpochProgress>,
    ) -> Result<TrainState> {
        let on_cpu = |named: Vec<(String, Tensor)>| -> Result<HashMap<String, Tensor>> {
            named
                .into_iter()
                .map(|(n, t)| Ok((n, t.to_device(&Device::Cpu)?)))
                .collect()
        };
        let vars = self
            .model
            .named_vars()
            .into_iter()
            .map(|(n, v)| (n, v.as_detached_tensor()));
        let mut memory = self.memory.log().clone();
        memory.epochs.truncate(self.history.epochs.len());
        Ok(TrainState {
            global_step: self.global_step,
            epoch,
            next_batch: next_batch.min(self.steps_per_epoch),
            steps_per_epoch: self.steps_per_epoch,
            total_steps: self.total_steps,
            model: on_cpu(vars.chain(self.model.named_buffers()).collect())?,
            optimizer: on_cpu(self.optimizer.state())?,
            optimizer_steps: self.optimizer.steps,
            scaler: self.scaler.clone(),
            masks: self
                .pruner
                .as_ref()
                .map(|p| on_cpu(p.masks()))
                .transpose()?,
            train_images: self.train.len(),
            train_fingerprint: self.train_fingerprint().to_string(),
            data_description: self.data_description.clone(),
            history: RunHistory {
                progress: progress.cloned(),
                ..self.history.clone()
            },
            memory,
        })
    }

    /// Put a [`TrainState`] back: parameters, BatchNorm running statistics, optimizer state and
    /// step count, loss scaler, pruning masks, counters, data position, history and memory log.
    /// Everything is checked before anything is changed: the training data must be the state's
    /// (same fingerprint), and every tensor must fit the model. Errors name what does not match.
    pub fn restore(&mut self, state: TrainState) -> Result<()> {
        if self.train_fingerprint() != state.train_fingerprint {
            return Err(Error::config(format!(
                "--resume {}: the training data differs from the checkpoint's (training data: checkpoint {} images, {}; now {} images, {}); pass the --data-dir the run was trained on",
                self.run_dir.display(),
                state.train_images,
                state.data_description,
                self.train.len(),
                self.data_description
            )));
        }
        if state.steps_per_epoch != self.steps_per_epoch {
            return Err(Error::config(format!(
                "--resume {}: steps per epoch: checkpoint {}, now {}; use the checkpoint's --batch-size",
                self.run_dir.display(),
                state.steps_per_epoch,
                self.steps_per_epoch
            )));
        }

        // Check: every parameter and buffer present with its shape, nothing unknown.
        let vars = self.model.named_vars();
        let buffers = self.model.named_buffers();
        let expected: Vec<(&str, &candle_core::Shape)> = vars
            .iter()
            .map(|(n, v)| (n.as_str(), v.shape()))
            .chain(buffers.iter().map(|(n, b)| (n.as_str(), b.shape())))
            .collect();
        for (name, shape) in &expected {
            let t = state
                .model
                .get(*name)
                .ok_or_else(|| Error::Checkpoint(format!("the model state lacks '{name}'")))?;
            if t.shape() != *shape || t.dtype() != DType::F32 {
                return Err(Error::Checkpoint(format!(
                    "'{name}' is {:?} {:?} in the saved state, the model needs {:?} F32",
                    t.dtype(),
                    t.shape(),
                    shape
                )));
            }
        }
        if state.model.len() != expected.len() {
            let unknown = state
                .model
                .keys()
                .find(|k| !expected.iter().any(|(n, _)| n == k));
            return Err(Error::Checkpoint(format!(
                "the model state holds an unknown tensor '{}'",
                unknown.map_or("?", |s| s)
            )));
        }
        let mut opt_state = Vec::with_capacity(state.optimizer.len());
        for (name, t) in &state.optimizer {
            let idx = name
                .split_once('.')
                .filter(|(slot, _)| *slot == "s1" || *slot == "s2")
                .and_then(|(_, i)| i.parse::<usize>().ok())
                .ok_or_else(|| {
                    Error::Checkpoint(format!(
                        "the optimizer state holds an unknown tensor '{name}'"
                    ))
                })?;
            let (pname, var) = vars.get(idx).ok_or_else(|| {
                Error::Checkpoint(format!("optimizer state '{name}' has no parameter"))
            })?;
            if t.shape() != var.shape() || t.dtype() != DType::F32 {
                return Err(Error::Checkpoint(format!(
                    "optimizer state '{name}' does not match the shape of '{pname}'"
                )));
            }
            opt_state.push((name.clone(), t.to_device(&self.device)?));
        }
        if state.scaler.is_some() != self.scaler.is_some() {
            return Err(Error::Checkpoint(
                "the loss-scaler state does not match --precision".into(),
            ));
        }
        if state.masks.is_some() != self.pruner.is_some() {
            return Err(Error::Checkpoint(
                "the pruning masks do not match --prune".into(),
            ));
        }
        // Checked (and built) before anything is changed; applied below.
        let pruner = match (state.masks, &self.pruner) {
            (Some(masks), Some(p)) => {
                let mut fresh = super::prune::Pruner::new(*p.schedule(), &vars)?;
                fresh.load_masks(masks)?;
                Some(fresh)
            }
            _ => None,
        };

        // Apply.
        for (name, var) in &vars {
            var.set(&state.model[name].to_device(&self.device)?)?;
        }
        for (name, _) in &buffers {
            self.model
                .set_buffer(name, state.model[name].to_device(&self.device)?)?;
        }
        let cfg = &self.config;
        let mut optimizer =
            Optimizer::new(cfg.optimizer, vars.len(), cfg.momentum, cfg.weight_decay);
        optimizer.load_state(opt_state)?;
        optimizer.steps = state.optimizer_steps;
        self.optimizer = optimizer;
        if pruner.is_some() {
            self.pruner = pruner;
        }
        self.scaler = state.scaler;
        self.global_step = state.global_step;
        self.start_epoch = state.epoch;
        self.start_batch = state.next_batch;
        self.history = state.history;
        self.memory.continue_log(state.memory);
        Ok(())
    }

    /// Continue the run saved in `ck`: [`Trainer::restore`] of its state (a mismatch is named
    /// with the checkpoint's directory), and the checkpoint counts as this run's newest.
    pub fn resume(&mut self, ck: &Checkpoint) -> Result<()> {
        self.restore(ck.state.clone()).map_err(|e| match e {
            Error::Checkpoint(m) => Error::Checkpoint(format!("{}: {m}", ck.dir.display())),
            other => other,
        })?;
        self.checkpoints.resumed(ck);
        Ok(())
    }

    /// [`Dataset::fingerprint`] of the training split, computed once.
    fn train_fingerprint(&self) -> &str {
        self.train_fingerprint
            .get_or_init(|| self.train.fingerprint())
    }

    /// Write a checkpoint of the state continuing at batch `next_batch` of `epoch` (see
    /// [`Trainer::snapshot`]). Returns its directory, or `None` when checkpoints are off or this
    /// state is already saved.
    ///
    /// Nothing is written when a parameter, running statistic or optimizer state is NaN/inf: the
    /// error is [`Error::NonFinite`] and the previous checkpoint stays the newest.
    fn save_checkpoint(
        &mut self,
        epoch: usize,
        next_batch: usize,
        progress: Option<&EpochProgress>,
    ) -> Result<Option<PathBuf>> {
        let next_batch = next_batch.min(self.steps_per_epoch);
        let point = (
            self.global_step,
            epoch,
            next_batch,
            self.history.epochs.len(),
        );
        if !self.checkpoints.wants(point) {
            return Ok(None);
        }
        let state = self.snapshot(epoch, next_batch, progress)?;
        if let Some(what) = non_finite(&state, &self.model.named_buffers())? {
            return Err(Error::NonFinite {
                what: what.into(),
                // The batch just trained.
                epoch,
                batch: next_batch.saturating_sub(1),
                phase: "optimizer".into(),
                advice: self.divergence_advice(),
            });
        }
        self.checkpoints
            .save(&self.run_dir, &state, &self.config)
            .map(Some)
    }

    /// Write [`OOM_SNAPSHOT_FILE`] for a step that ran out of memory and return the error
    /// naming it; when the snapshot cannot be written, the error says so and stays as it was.
    fn write_oom_snapshot(&self, e: Error, timeline: StepTimeline) -> Error {
        let Error::OutOfMemory {
            limit,
            epoch,
            batch,
            phase,
            snapshot: None,
        } = e
        else {
            return e;
        };
        let estimate = self.memory_estimate();
        let timeline = self.with_predictions(timeline, estimate.as_ref());
        let failed_at = match timeline.events.last() {
            Some(last) => format!(
                "{phase}; last event recorded: {} of {} (micro-batch {})",
                last.phase, last.layer, last.micro_batch
            ),
            None => format!("{phase}, before the first layer event"),
        };
        let path = self.run_dir.join(OOM_SNAPSHOT_FILE);
        let mut error = Error::OutOfMemory {
            limit,
            epoch,
            batch,
            phase,
            snapshot: None,
        };
        let snapshot = OomSnapshot {
            error: error.to_string(),
            failed_at,
            config: &self.config,
            timeline,
            estimate,
        };
        let written = crate::io::create_dir(&self.run_dir)
            .and_then(|()| crate::io::write_json_atomic(&path, &snapshot));
        match written {
            Ok(()) => {
                if let Error::OutOfMemory { snapshot, .. } = &mut error {
                    *snapshot = Some(path);
                }
            }
            Err(w) => eprintln!("warning: memory snapshot not written: {w}"),
        }
        error
    }

    /// The optimizer phase: unscale (f16), check finiteness, clip, step. Returns whether the loss
    /// scaler skipped the step, and the gradients' global norm before clipping.
    fn apply_update(&mut self, grads: Vec<Option<Tensor>>, step: &StepInfo) -> Result<(bool, f64)> {
        let grads = match step.loss_scale {
            Some(s) => grads
                .into_iter()
                .map(|g| g.map(|g| g * (1.0 / s)).transpose())
                .collect::<candle_core::Result<Vec<_>>>()?,
            None => grads,
        };
        let squared = squared_norm(&grads)?;
        let finite = squared.is_finite();
        // Clipping by the global norm (PyTorch's `clip_grad_norm_`): the whole step shrinks, its
        // direction is kept. A non-finite step is left to the scaler or the error below.
        let grads = match self.config.clip_grad_norm {
            Some(max) if finite && squared.sqrt() > max => {
                let factor = max / squared.sqrt();
                grads
                    .into_iter()
                    .map(|g| g.map(|g| g * factor).transpose())
                    .collect::<candle_core::Result<Vec<_>>>()?
            }
            _ => grads,
        };
        let apply = match self.scaler.as_mut() {
            Some(s) => s.update(finite),
            None if !finite => {
                return Err(Error::NonFinite {
                    what: "gradient".into(),
                    epoch: step.epoch,
                    batch: step.batch,
                    phase: "backward".into(),
                    advice: self.divergence_advice(),
                })
            }
            None => true,
        };
        if apply {
            self.optimizer.step(&self.vars, &grads, step.lr)?;
        }
        drop(grads);
        // Counted like the schedule's steps: a step the loss scaler skipped is still a step.
        if let Some(p) = self.pruner.as_mut() {
            p.after_step(self.global_step + 1, &self.vars, &mut self.optimizer)?;
        }
        Ok((!apply, squared.sqrt()))
    }

    /// What to do after the loss or the gradients became non-finite, true for this run: a lower
    /// `--lr` always; f32 only for a half-precision run; clipping only when off; resuming only
    /// when a healthy checkpoint (from before the loss blew up) exists: [`Trainer::fit`] moves
    /// the newer ones aside, so `--resume` takes it.
    pub(crate) fn divergence_advice(&self) -> String {
        let mut fixes = vec!["lower --lr".to_string()];
        if self.config.precision != crate::config::Precision::F32 {
            fixes.push("use --precision f32".into());
        }
        if self.config.clip_grad_norm.is_none() {
            fixes.push("clip the gradients (--clip-grad-norm 3)".into());
        }
        let fixes = fixes.join(", or ");
        let newest = self
            .checkpoints
            .last_step()
            .filter(|_| self.checkpoints.enabled);
        let healthy = self
            .checkpoints
            .last_healthy()
            .filter(|_| self.checkpoints.enabled);
        let aside = if newest > healthy {
            format!(
                " (the checkpoints after it, written while the loss was blowing up, are moved to {})",
                self.run_dir
                    .join(super::checkpoint::CHECKPOINTS_DIR)
                    .join(super::checkpoint::DIVERGED_DIR)
                    .display()
            )
        } else {
            String::new()
        };
        match healthy {
            Some(step) => format!(
                "{fixes}; the checkpoint from before the loss blew up (step {step}) is kept{aside}: \
                 resume it with --resume {} and such a change, or start again",
                self.run_dir.display()
            ),
            None if newest.is_some() => format!(
                "{fixes}, and start again (every checkpoint was written while the loss was above \
                 {:.1}; they are moved to {})",
                super::checkpoint::DIVERGED_LOSS,
                self.run_dir
                    .join(super::checkpoint::CHECKPOINTS_DIR)
                    .join(super::checkpoint::DIVERGED_DIR)
                    .display()
            ),
            None => format!("{fixes}, and start again (no checkpoint was saved before this)"),
        }
    }

    /// Mean loss and top-1 accuracy on `data` (running BatchNorm statistics, no graph), in
    /// micro-batches so evaluation never needs more memory than a training micro-batch.
    /// `None` when a stop was requested before or during it (checked between batches).
    pub fn evaluate(&self, data: &Arc<Dataset>) -> Result<Option<(f64, f64)>> {
        let bs = self.config.micro_batch().max(1);
        let batcher = Batcher::new(
            data.clone(),
            BatcherOptions {
                batch_size: bs,
                shuffle: false,
                augment: false,
                drop_last: false,
                seed: self.config.seed,
                epoch: 0,
                prefetch: 2,
                start_batch: 0,
                // The training batches' buffers: evaluation needs no more of its own.
                recycle: Some(self.batch_buffers.clone()),
            },
        );
        let dtype = self.config.precision.compute_dtype();
        let (mut loss_sum, mut correct, mut n) = (0.0, 0usize, 0usize);
        for b in batcher {
            if self.stop_requested() {
                return Ok(None);
            }
            let (x, y) = self.batch_tensors(&b.images, &b.labels)?;
            let logits = self.model.forward(&x, dtype, Mode::Eval)?;
            let (loss, c) = loss_and_correct(&logits, &y)?;
            loss_sum += loss.to_scalar::<f32>()? as f64 * b.len as f64;
            correct += c;
            n += b.len;
            self.batch_buffers.put(b.images);
        }
        if n == 0 {
            return Ok(Some((f64::NAN, 0.0)));
        }
        Ok(Some((loss_sum / n as f64, correct as f64 / n as f64)))
    }

    fn stop_requested(&self) -> bool {
        self.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst))
    }

    /// Train for the configured epochs (or `--max-steps`), evaluating after each epoch.
    ///
    /// A stop request is honoured between steps, between evaluation batches and after every
    /// checkpoint write; the run then saves a checkpoint of exactly where it is (an epoch whose
    /// evaluation was cut short is evaluated again on resume) and returns status `interrupted`.
    /// A resumed trainer (see [`Trainer::resume`]) continues the run's
    /// history, so the summary, epoch table and memory log describe the whole run.
    pub fn fit(&mut self) -> Result<Summary> {
        let result = self.fit_inner();
        if let Err(Error::NonFinite { .. }) = &result {
            // The advice in the error names the healthy checkpoint this leaves as the newest.
            self.checkpoints.set_aside_diverged(&self.run_dir);
        }
        result
    }

    fn fit_inner(&mut self) -> Result<Summary> {
        let wall = Instant::now();
        let cfg = self.config.clone();
        let dev_name = device_name(&self.device);
        self.memory.train_begin();
        self.callbacks.on_train_begin(&TrainBegin {
            config: &cfg,
            run_dir: &self.run_dir,
            device: &dev_name,
            num_params: self.model.num_params(),
            steps_per_epoch: self.steps_per_epoch,
            total_steps: self.total_steps,
            global_step: self.global_step,
            start_epoch: self.start_epoch,
            ended_epochs: &self.history.epochs,
            train_images: self.train.len(),
            eval_images: self.eval.len(),
            probe: &*self.probe,
            memory: self.memory.log(),
        })?;
        // The epoch cut short by an interruption, for this process's summary and callbacks.
        let mut cut_short: Option<EpochStats> = None;
        let mut epoch = self.start_epoch;
        while epoch < cfg.epochs {
            if self.stop_requested() {
                cut_short = Some(EpochStats::default());
                break;
            }
            let first = if epoch == self.start_epoch {
                self.start_batch
            } else {
                0
            };
            // An epoch begun by an earlier process continues its sums (and may only lack its
            // evaluation: then no step is left to train, but the epoch still ends).
            let carried = self.history.progress.take().filter(|p| p.epoch == epoch);
            let steps = (self.steps_per_epoch - first).min(self.total_steps - self.global_step);
            if steps == 0 && carried.is_none() {
                break;
            }
            self.memory.epoch_begin(epoch, cfg.reset_peak_each_epoch);
            self.callbacks.on_epoch_begin(&EpochBegin {
                epoch,
                num_epochs: cfg.epochs,
                steps,
                global_step: self.global_step,
                reset_peak: cfg.reset_peak_each_epoch,
                probe: &*self.probe,
                memory: self.memory.log(),
            })?;
            let batcher = Batcher::new(
                self.train.clone(),
                BatcherOptions {
                    batch_size: cfg.batch_size,
                    shuffle: true,
                    augment: cfg.augment,
                    drop_last: true,
                    seed: cfg.seed,
                    epoch,
                    prefetch: 2,
                    start_batch: first,
                    recycle: Some(self.batch_buffers.clone()),
                },
            );
            let mut progress = carried.unwrap_or_else(|| EpochProgress::new(epoch, cfg.lr));
            let mut next = first;
            let mut interrupted = false;
            // Seconds from step to step, waiting for data and writing checkpoints included.
            let mut tick = Instant::now();
            for batch in batcher.take(steps) {
                let r = self.train_step(&batch, epoch, batch.index)?;
                next = batch.index + 1;
                self.batch_buffers.put(batch.images);
                let secs = tick.elapsed().as_secs_f64();
                tick = Instant::now();
                progress.add(&r);
                progress.train_secs += secs;
                self.history.images += r.images;
                self.history.train_secs += secs;
                // A checkpoint every --save-every steps (a state is never saved twice).
                if cfg.save_every > 0 && self.global_step.is_multiple_of(cfg.save_every) {
                    self.save_checkpoint(epoch, next, Some(&progress))?;
                }
                if self.stop_requested() {
                    interrupted = true;
                    break;
                }
            }
            let eval = if cfg.eval && !interrupted {
                let e = self.evaluate(&self.eval.clone())?;
                interrupted = e.is_none();
                e
            } else {
                None
            };
            let loss_scale = self.scaler.as_ref().map(|s| s.scale);
            let stats = progress.stats(eval, loss_scale);
            self.memory.epoch_end(epoch);
            self.callbacks.on_epoch_end(&EpochEnd {
                stats: &stats,
                num_epochs: cfg.epochs,
                probe: &*self.probe,
                memory: self.memory.log(),
            })?;
            if interrupted {
                // A checkpoint of exactly here: the resumed run finishes this epoch's steps (if
                // any are left) and evaluates it.
                self.start_batch = next;
                self.save_checkpoint(epoch, next, Some(&progress))?;
                cut_short = Some(stats);
                break;
            }
            self.history.epochs.push(stats);
            // A checkpoint at each epoch end; an epoch cut short by --max-steps keeps its
            // position so that a longer --max-steps continues it.
            let (epoch_next, batch_next) = if next >= self.steps_per_epoch {
                (epoch + 1, 0)
            } else {
                (epoch, next)
            };
            self.save_checkpoint(epoch_next, batch_next, None)?;
            epoch += 1;
            self.start_batch = 0;
        }
        let interrupted = cut_short.is_some();
        if interrupted && self.checkpoints.last_step().is_none() {
            // Stopped before the first step: a checkpoint of the start, so --resume can finish.
            self.save_checkpoint(epoch, self.start_batch, None)?;
        }
        self.start_epoch = epoch;
        let pruning = self.finish_pruning(interrupted)?;
        // The run's epochs; an interrupted run also shows the part of the epoch it trained.
        let mut epochs = self.history.epochs.clone();
        epochs.extend(cut_short.filter(|s| s.steps > 0));
        // The last memory reading goes in before the summary, which reports the run's peak.
        self.memory.train_end();
        let summary = self.summary(
            &epochs,
            self.history.epochs.len(),
            interrupted,
            wall.elapsed().as_secs_f64(),
            pruning,
        );
        self.callbacks.on_train_end(&TrainEnd {
            epochs: &epochs,
            global_step: self.global_step,
            images_per_sec: summary.images_per_sec,
            interrupted,
            probe: &*self.probe,
            memory: self.memory.log(),
        })?;
        if self.log_files && !self.timeline.events.is_empty() {
            crate::io::write_json_atomic(
                &self
                    .run_dir
                    .join(crate::memory::timeline::STEP_TIMELINE_FILE),
                &self.step_timeline(),
            )?;
        }
        if self.log_files {
            crate::io::write_json_atomic(
                &self.run_dir.join(super::summary::SUMMARY_FILE),
                &summary,
            )?;
        }
        Ok(summary)
    }

    /// The reached sparsity of a `--prune` run; at the end of a completed run that writes files,
    /// also the final model dense and sparse in the run directory, with their sizes.
    fn finish_pruning(&self, interrupted: bool) -> Result<Option<super::prune::PruneReport>> {
        use super::prune::{save_atomic, save_sparse, DENSE_MODEL_FILE, SPARSE_MODEL_FILE};
        let Some(pruner) = &self.pruner else {
            return Ok(None);
        };
        let mut report = pruner.report(&self.vars)?;
        if self.log_files && !interrupted {
            let tensors: Vec<(String, Tensor)> = self
                .model
                .named_vars()
                .into_iter()
                .map(|(n, v)| (n, v.as_detached_tensor()))
                .chain(self.model.named_buffers())
                .collect();
            let dense_path = self.run_dir.join(DENSE_MODEL_FILE);
            let dense = tensors
                .iter()
                .map(|(n, t)| Ok((n.clone(), t.to_device(&Device::Cpu)?)))
                .collect::<Result<std::collections::HashMap<_, _>>>()?;
            save_atomic(&dense_path, &dense)?;
            drop(dense);
            let (sparse_bytes, encodings) =
                save_sparse(&self.run_dir.join(SPARSE_MODEL_FILE), &tensors)?;
            for layer in &mut report.layers {
                layer.encoding = encodings
                    .iter()
                    .find(|(n, _)| *n == layer.name)
                    .map(|(_, e)| *e);
            }
            report.dense_file_bytes = Some(super::prune::file_size(&dense_path)?);
            report.sparse_file_bytes = Some(sparse_bytes);
        }
        Ok(Some(report))
    }

    /// The analytic memory estimate of this run (the model's layer list, the loaded data set as
    /// the baseline); `None` when the device has no probe or the model cannot be estimated.
    pub fn memory_estimate(&self) -> Option<crate::memory::estimate::Estimate> {
        use crate::memory::estimate::{estimate_for_specs, Baseline, DataSize, DeviceKind};
        let data = DataSize::loaded(&self.train, &self.eval, &self.config);
        let device = DeviceKind::of(&self.device);
        estimate_for_specs(
            &self.config,
            &self.model.layer_specs(),
            device,
            Baseline::Modeled(data),
        )
        .ok()
    }

    /// The summary of the whole run: `epochs` (the ended ones first, `ended` of them) and the
    /// history's totals.
    fn summary(
        &self,
        epochs: &[EpochStats],
        ended: usize,
        interrupted: bool,
        wall: f64,
        pruning: Option<super::prune::PruneReport>,
    ) -> Summary {
        let mem = self.memory_log();
        let os = self.probe.os_memory();
        let predicted = if self.probe.available() {
            self.memory_estimate().map(|e| e.peak)
        } else {
            None
        };
        let last = epochs.last();
        Summary {
            label: self.config.label(),
            device: device_name(&self.device),
            probe: self.probe.name().to_string(),
            probe_available: self.probe.available(),
            num_params: self.model.num_params(),
            param_bytes: self.model.num_params() as u64 * 4,
            peak_bytes: mem.peak_bytes,
            peak_phase: mem.peak_phase.map(|p| p.to_string()),
            baseline_bytes: mem.baseline_bytes,
            step_peak_bytes: mem.batches.iter().map(|b| b.peak_bytes).max().unwrap_or(0),
            reserved_peak_bytes: mem.reserved_peak,
            os_view: self.probe.os_view(),
            os_current_bytes: os.map(|o| o.current),
            os_peak_bytes: os.map(|o| o.peak).max(mem.os_peak),
            memory_limit: self.config.memory_limit,
            // The analytic estimate (src/memory/estimate.rs) against the measured peak.
            predicted_peak_bytes: predicted,
            prediction_error_pct: predicted.and_then(|p| prediction_error(p, mem.peak_bytes)),
            images_per_sec: self.history.images as f64 / self.history.train_secs.max(1e-9),
            steady_images_per_sec: steady_throughput(&self.history.step_times),
            steps: self.global_step,
            epochs_completed: ended,
            images: self.history.images,
            final_train_loss: last.map(|e| e.train_loss),
            final_test_accuracy: last.and_then(|e| e.eval_accuracy),
            final_test_loss: last.and_then(|e| e.eval_loss),
            eval_is_validation: self.eval_is_validation,
            loss_scale: self.scaler.as_ref().map(|s| s.scale),
            skipped_steps: self.scaler.as_ref().map_or(0, |s| s.skipped_steps),
            status: if interrupted {
                super::summary::RunStatus::Interrupted
            } else {
                super::summary::RunStatus::Ok
            },
            wall_secs: wall,
            pruning,
            cuda_graph: self.cuda_graph.stats(),
        }
    }
}

/// The segmentation `--checkpoint auto` trains with, from the estimate of this run's data.
fn resolve_auto_checkpointing(
    config: &TrainConfig,
    data: &DataSplits,
    device: &Device,
) -> Result<crate::config::GradCheckpointing> {
    use crate::memory::estimate::{resolve_checkpointing, Baseline, DataSize, DeviceKind};
    let size = DataSize::loaded(&data.train, &data.test, config);
    resolve_checkpointing(
        config,
        &crate::model::cnn::layer_specs_for(config.width, config.conv),
        DeviceKind::of(device),
        Baseline::Modeled(size),
    )
}

/// `(predicted - measured) / measured` in percent; `None` without a measurement.
fn prediction_error(predicted: u64, measured: u64) -> Option<f64> {
    (measured > 0).then(|| (predicted as f64 - measured as f64) / measured as f64 * 100.0)
}

/// What in `state` is NaN or infinite, if anything, in the order weights, BatchNorm running
/// statistics (the model's `buffers`), optimizer state: a diverged state must never be saved.
fn non_finite(state: &TrainState, buffers: &[(String, Tensor)]) -> Result<Option<&'static str>> {
    let all_finite = |t: &Tensor| -> Result<bool> {
        let values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(values.iter().all(|v| v.is_finite()))
    };
    let is_buffer = |n: &String| buffers.iter().any(|(b, _)| b == n);
    for (what, buffer) in [("weights", false), ("BatchNorm running statistics", true)] {
        for (name, t) in &state.model {
            if is_buffer(name) == buffer && !all_finite(t)? {
                return Ok(Some(what));
            }
        }
    }
    for t in state.optimizer.values() {
        if !all_finite(t)? {
            return Ok(Some("optimizer state"));
        }
    }
    Ok(None)
}
