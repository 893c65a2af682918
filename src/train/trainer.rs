//! A training run and how it is built: the model, the optimizer, the data, the memory probe, the
//! callbacks and the run directory, from a [`TrainConfig`].
//!
//! Where the rest of the run lives: the epoch loop in [`super::fit`], the phased step in
//! `super::step` (the step itself is [`memtrain_core::step::train`]; its observer `super::watch`), taking and putting back the run's
//! [`super::TrainState`] in [`super::resume`], failure reports in [`super::diagnose`], the summary
//! in [`super::summary`] and pruning's end of run in [`super::prune`].

use super::watch::{RunWatch, SKIPPED_UPDATE};
use crate::callbacks::{
    Callback, CallbackList, MetricsLogger, ProgressCallback, TensorBoardLogger,
};
use crate::config::{ActivationStorage, Segmentation, TrainConfig};
use crate::data::{self, DataSplits, Dataset};
use crate::error::{Error, Result};
use candle_core::{Device, Var};
use memtrain_core::device::select_device;
use memtrain_core::memory::timeline::{StepTimeline, TimelineProbe};
use memtrain_core::memory::{probe_for, MemoryLog, MemoryProbe, MemoryRecorder};
use memtrain_core::model::Cnn;
use memtrain_core::step::optim::Optimizer;
use memtrain_core::step::precision::LossScaler;
use memtrain_core::step::train::Updater;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};

/// What the caller adds to a run besides the configuration.
#[derive(Default)]
pub struct TrainerOptions {
    /// Extra callbacks, called after the built-in ones.
    pub callbacks: Vec<Box<dyn Callback>>,
    /// Show progress (bars or plain lines).
    pub progress: bool,
    /// Write config/CSV/summary files into the run directory.
    pub log_files: bool,
    /// On out-of-memory in a step, write [`memtrain_core::memory::timeline::OOM_REPORT_FILE`] into the
    /// run directory (creating it if needed, so that summary-only sweep children leave one too).
    pub oom_report: bool,
    /// Set to true (e.g. by a signal handler) to stop after the current step, or between
    /// evaluation batches.
    pub stop: Option<Arc<AtomicBool>>,
    /// How a run that writes files (`log_files`) claims its directory: always under an
    /// exclusive lock; a new run also refuses an earlier run's results unless told to overwrite.
    pub claim: super::run_dir::Claim,
}

/// A training run: model, optimizer, data and callbacks, driven by a [`TrainConfig`].
pub struct Trainer {
    /// The configuration, `--checkpoint auto` and `--compress-activations auto` replaced by
    /// their choice (so the step, `config.json` and a resume read what the run trains with:
    /// [`Trainer::segmentation`], [`Trainer::storage`]).
    pub config: TrainConfig,
    /// The model.
    pub model: Cnn,
    /// The optimizer with its state, and the f16 loss scaler (None for f32/bf16).
    pub updater: Updater,
    /// What watches the run: its memory readings and records, and the callbacks.
    pub(crate) watch: RunWatch,
    /// The data the run trains and evaluates on.
    pub(crate) data: RunData,
    /// What the run writes into its directory.
    pub(crate) files: RunFiles,
    pub(crate) stop: Option<Arc<AtomicBool>>,
    /// Where the run is in its steps, and the run so far.
    pub position: Position,
    /// `--prune`: the schedule and masks, applied after every optimizer step.
    pub(crate) pruner: Option<super::prune::Pruner>,
    /// `--cuda-graph`: the captured forward and backward ([`super::graph`]).
    pub(crate) cuda_graph: super::graph::GraphSlot,
}

/// Where a run is: its length, the steps taken and how the run got there.
#[derive(Debug, Clone)]
pub struct Position {
    /// Optimizer steps taken.
    pub global_step: usize,
    /// Epoch to start at (0, or later when resuming).
    pub start_epoch: usize,
    /// Batch within `start_epoch` to start at.
    pub start_batch: usize,
    /// Optimizer steps per epoch.
    pub steps_per_epoch: usize,
    /// Optimizer steps of the whole run.
    pub total_steps: usize,
    /// The run so far (restored from a snapshot when resuming): ended epochs, the epoch in
    /// progress, totals and step times.
    pub(crate) history: super::history::RunHistory,
}

/// The data a run trains and evaluates on.
pub(crate) struct RunData {
    pub(crate) train: Arc<Dataset>,
    pub(crate) eval: Arc<Dataset>,
    pub(crate) eval_is_validation: bool,
    /// [`Dataset::fingerprint`] of the training split, computed at the first snapshot or resume.
    pub(crate) train_fingerprint: OnceLock<String>,
    /// The one line describing the data source and split.
    pub(crate) description: String,
    /// Training batches' image buffers, reused from step to step and epoch to epoch.
    pub(crate) batch_buffers: crate::data::BufferPool,
}

/// What a run writes into its directory.
pub(crate) struct RunFiles {
    /// Whether the run writes files into its directory.
    pub(crate) log_files: bool,
    pub(crate) oom_report: bool,
    pub(crate) run_dir: PathBuf,
    /// Snapshot writing (on when `TrainerOptions::log_files`); see [`super::snapshot`].
    pub(crate) snapshots: super::snapshot::SnapshotSaver,
    /// The run directory's lock, held while the trainer lives (runs that write files only).
    pub(crate) _lock: Option<super::run_dir::RunDirLock>,
}

/// `runs/<UTC timestamp>-<pid>` for a run without `--out` (the pid keeps two runs started in the
/// same second apart).
pub(crate) fn default_run_dir() -> PathBuf {
    PathBuf::from("runs").join(format!(
        "{}-{}",
        chrono::Utc::now().format("%Y%m%d-%H%M%S"),
        std::process::id()
    ))
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
        let (steps_per_epoch, total_steps) = run_length(&config, data.train.len())?;
        // Checked before anything is created: the schedule's end depends on the run's length.
        let prune_schedule = super::prune::Schedule::for_run(&config, total_steps)?;
        let device = prepare_device(&config)?;
        let cuda_graph = super::graph::GraphSlot::for_run(&config, &device)?;
        let timeline_probe = Arc::new(TimelineProbe::new(probe_for(
            &device,
            config.memory.memory_limit,
            config.cuda.pool_cache,
        )?));
        let probe: Arc<dyn MemoryProbe> = timeline_probe.clone();
        let (segmentation, storage) = resolve_plan(&config, &data, &device, options.progress)?;
        config.memory.grad_checkpointing = segmentation.into();
        config.memory.compress_activations = storage.into();
        let run_dir = config.output.out.clone().unwrap_or_else(default_run_dir);
        let run_lock = options
            .log_files
            .then(|| super::run_dir::claim(&run_dir, options.claim))
            .transpose()?;
        let model = Cnn::new(config.model, &device, config.seed)?;
        let optimizer = Optimizer::new(
            config.optimizer.kind,
            model.param_count(),
            config.optimizer.momentum,
            config.optimizer.weight_decay,
        );
        let scaler = LossScaler::for_precision(config.memory.precision);

        let pruner = prune_schedule
            .map(|s| super::prune::Pruner::new(s, &model.named_vars()))
            .transpose()?;
        let tracer = super::viewers::StepTracer::for_run(&config, total_steps, &options, &*probe)?;
        Ok(Trainer {
            watch: RunWatch {
                tracer,
                memory: MemoryRecorder::new(probe.clone()),
                probe,
                timeline_probe,
                timeline: StepTimeline::default(),
                callbacks: callback_list(
                    &config,
                    &run_dir,
                    options.progress,
                    options.log_files,
                    options.callbacks,
                ),
                device: device.clone(),
                gpu_passes: Default::default(),
            },
            model,
            updater: Updater { optimizer, scaler },
            data: RunData {
                train: Arc::new(data.train),
                eval: Arc::new(data.test),
                eval_is_validation: data.test_is_validation,
                train_fingerprint: OnceLock::new(),
                description: data.description,
                batch_buffers: crate::data::BufferPool::new(),
            },
            files: RunFiles {
                log_files: options.log_files,
                oom_report: options.oom_report,
                run_dir,
                snapshots: super::snapshot::SnapshotSaver::new(options.log_files),
                _lock: run_lock,
            },
            stop: options.stop,
            position: Position {
                global_step: 0,
                start_epoch: 0,
                start_batch: 0,
                steps_per_epoch,
                total_steps,
                history: Default::default(),
            },
            pruner,
            cuda_graph,
            config,
        })
    }

    /// The one line describing the data source and split.
    pub(crate) fn data_description(&self) -> &str {
        &self.data.description
    }

    /// The run directory.
    pub fn run_dir(&self) -> &Path {
        &self.files.run_dir
    }

    /// The memory probe.
    pub fn probe(&self) -> &Arc<dyn MemoryProbe> {
        &self.watch.probe
    }

    /// The run's memory records so far.
    pub fn memory_log(&self) -> &MemoryLog {
        self.watch.memory.log()
    }

    /// The memory timeline of the newest training step (empty before the first), with the
    /// estimate's prediction at each event when the estimate has the same events.
    pub fn step_timeline(&self) -> StepTimeline {
        self.with_predictions(self.watch.timeline.clone(), self.memory_estimate().as_ref())
    }

    /// `t` with the prediction of `estimate` at each event, when its events are the estimate's
    /// (all of them, or the first ones for a step that failed part-way).
    pub(super) fn with_predictions(
        &self,
        mut t: StepTimeline,
        estimate: Option<&crate::predict::Estimate>,
    ) -> StepTimeline {
        if let Some(e) = estimate.filter(|_| self.watch.probe.available()) {
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

    /// Optimizer steps per epoch.
    pub(crate) fn steps_per_epoch(&self) -> usize {
        self.position.steps_per_epoch
    }

    /// Optimizer steps of the whole run.
    pub fn total_steps(&self) -> usize {
        self.position.total_steps
    }

    /// The gradient-checkpointing segmentation the step runs with.
    pub fn segmentation(&self) -> Result<Segmentation> {
        Ok(self.config.memory.grad_checkpointing.resolved()?)
    }

    /// How the step keeps the blocks' conv outputs for the backward.
    pub fn storage(&self) -> Result<ActivationStorage> {
        Ok(self.config.memory.compress_activations.resolved()?)
    }

    /// The trainable parameters, in the model's order.
    pub fn vars(&self) -> Vec<Var> {
        self.model.vars()
    }

    /// The device the run trains on (the model's).
    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// The pruning state of a `--prune` run.
    pub fn pruner(&self) -> Option<&super::prune::Pruner> {
        self.pruner.as_ref()
    }

    /// The analytic memory estimate of this run (the loaded data set as the baseline); `None` when the device has no probe or the model cannot be estimated.
    pub fn memory_estimate(&self) -> Option<crate::predict::Estimate> {
        use crate::predict::{estimate_with, Baseline, DataSize, DeviceKind};
        let data = DataSize::loaded(&self.data.train, &self.data.eval, &self.config);
        let device = DeviceKind::of(self.model.device());
        estimate_with(&self.config, device, Baseline::Modeled(data)).ok()
    }
}

/// Steps per epoch and in the whole run of `config` on `train_images` training images.
fn run_length(config: &TrainConfig, train_images: usize) -> Result<(usize, usize)> {
    if train_images < config.steps.batch_size {
        return Err(Error::config(format!(
            "the training split has {train_images} images, fewer than --batch-size {}; lower --batch-size",
            config.steps.batch_size
        )));
    }
    let steps_per_epoch = train_images / config.steps.batch_size;
    let by_epochs = steps_per_epoch.checked_mul(config.steps.epochs).ok_or_else(|| {
        Error::config(format!(
            "--epochs {} × {steps_per_epoch} steps per epoch is more steps than can be counted; lower --epochs",
            config.steps.epochs
        ))
    })?;
    let total_steps = config
        .steps
        .max_steps
        .map_or(by_epochs, |m| m.min(by_epochs));
    Ok((steps_per_epoch, total_steps))
}

/// The run's device, made ready: TF32 and cuDNN's determinism set, the CUDA kernels checked against the CPU's, or the
/// CPU allocator told to keep freed memory.
fn prepare_device(config: &TrainConfig) -> Result<Device> {
    let device = select_device(config.device.as_deref())?;
    // Process-wide, like PyTorch's flag: the conv ops have no configuration at hand.
    memtrain_kernels::set_tf32(config.cuda.tf32 == crate::config::Tf32::On);
    memtrain_kernels::set_cudnn_nondeterministic(config.cuda.cudnn_nondeterministic);
    memtrain_kernels::set_cudnn_workspace_bytes(
        usize::try_from(config.cuda.cudnn_workspace).unwrap_or(usize::MAX),
    );
    if device.is_cpu() {
        match config.memory.memory_limit {
            // The limit is the process's resident memory: freed blocks go back to the kernel,
            // so that it follows the heap (see `return_freed_memory`).
            Some(_) => memtrain_core::memory::return_freed_memory(),
            // Every op allocates its output; without this, glibc maps and unmaps the large ones
            // on every step (see `retain_freed_memory`).
            None => memtrain_core::memory::retain_freed_memory(),
        }
        // Candle's CPU thread pool, made before the baseline is read rather than by the first
        // step's first convolution, so that no step holds its records and threads.
        candle_core::utils::barrier_pool();
    } else {
        // The CUDA kernels rarely meet a GPU in testing: each is compared with the CPU's once
        // per process (1.6-2.8 s on an H200), before anything trains on it and before the
        // probe's baseline. The cuDNN workspace it allocated goes, so that the run's own comes
        // from the run's memory pool, inside --memory-limit.
        memtrain_core::device::self_check_kernels(
            &device,
            config.memory.precision.compute_dtype(),
        )?;
        memtrain_kernels::conv2d_cudnn::release_workspace();
        // The estimate asks this thread's cuDNN which passes it runs (the self-check may have
        // run on another thread of the process).
        memtrain_kernels::conv2d_cudnn::open(&device)?;
    }
    // Where an eager CUDA step's GPU time goes (`MEMTRAIN_GPU_TIME=off` leaves it unmeasured, for
    // the A/B of what the events cost); a captured step has no passes of its own to time.
    memtrain_kernels::gpu_time::set_enabled(
        device.is_cuda()
            && !config.cuda.cuda_graph
            && std::env::var("MEMTRAIN_GPU_TIME").as_deref() != Ok("off"),
    );
    Ok(device)
}

/// What the run trains with: the segmentation `--checkpoint` names and the storage
/// `--compress-activations` names, or for `auto` (either) the choice from the estimate of this
/// run's data, refused (a usage error, before the model is built) when `--memory-limit` leaves no
/// plan room. When `progress`, the run's segments and recomputed FLOPs are announced (with why,
/// for `auto`).
fn resolve_plan(
    config: &TrainConfig,
    data: &DataSplits,
    device: &Device,
    progress: bool,
) -> Result<(Segmentation, ActivationStorage)> {
    use crate::config::{CompressActivations, GradCheckpointing, CNN_BLOCKS};
    use crate::predict::checkpointing::{format_flops, format_segments, recompute_flops};
    use crate::predict::{choose_checkpointing, Baseline, DataSize, DeviceKind};
    if config.memory.grad_checkpointing == GradCheckpointing::Auto
        || config.memory.compress_activations == CompressActivations::Auto
    {
        let size = DataSize::loaded(&data.train, &data.test, config);
        let choice = choose_checkpointing(config, DeviceKind::of(device), Baseline::Modeled(size))?;
        if progress {
            println!("{}", choice.describe(CNN_BLOCKS));
        }
        return Ok((choice.chosen.checkpointing, choice.chosen.storage));
    }
    let ck = config.memory.grad_checkpointing.resolved()?;
    if progress && ck != Segmentation::NONE {
        println!(
            "--checkpoint {ck}: segments {}, recomputes {} per step",
            format_segments(&memtrain_core::model::cnn::segments(CNN_BLOCKS, ck)),
            format_flops(recompute_flops(config.model, ck, config.steps.batch_size))
        );
    }
    Ok((ck, config.memory.compress_activations.resolved()?))
}

/// The run's callbacks: the progress display and the metrics files when asked for, then the
/// caller's own, in that order.
fn callback_list(
    config: &TrainConfig,
    run_dir: &Path,
    progress: bool,
    log_files: bool,
    extra: Vec<Box<dyn Callback>>,
) -> CallbackList {
    let mut list: Vec<Box<dyn Callback>> = Vec::new();
    if progress {
        list.push(Box::new(ProgressCallback::new(config.output.quiet)));
    }
    if log_files {
        list.push(Box::new(MetricsLogger::new(run_dir)));
        list.push(Box::new(TensorBoardLogger::new(run_dir)));
    }
    list.extend(extra);
    CallbackList::new(list)
}
