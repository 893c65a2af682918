//! Keras/Lightning-style training hooks.
//!
//! The trainer calls, in this order:
//! `on_train_begin`, then per epoch `on_epoch_begin`, per optimizer step `on_batch_begin`,
//! per micro-batch `on_after_forward` and `on_after_backward`, then `on_batch_end`; after the
//! epoch's evaluation `on_epoch_end`; finally `on_train_end`. After every layer of a forward, a
//! backward and an evaluation batch, and after the update, `on_layer_end` (the step's own events,
//! the ones `step_timeline.json` records). Every method is a no-op by default.
//!
//! Memory is read by the trainer, not by a callback: its [`memtrain_core::memory::MemoryRecorder`]
//! records each step and epoch just before the matching hook, and every context but
//! [`LayerEnd`] carries the probe and the records so far ([`MemoryLog`]: the step or epoch that
//! just ended is the last entry); [`LayerEnd`] carries the event's own readings.
//!
//! Contexts count epochs and steps from 0, as Keras does; the memory records, the screen and the
//! CSV files count them from 1 (`ctx.epoch + 1` is `memory.last_batch.epoch`).

pub mod log;
pub mod progress;
pub mod tensorboard;

pub use log::MetricsLogger;
pub use progress::ProgressCallback;
pub use tensorboard::TensorBoardLogger;

use crate::config::TrainConfig;
use crate::error::Result;
use memtrain_core::memory::{MemoryLog, MemoryProbe};
use memtrain_core::phase::Phase;
use std::path::Path;

/// Context for [`Callback::on_train_begin`].
pub struct TrainBegin<'a> {
    /// The run's configuration.
    pub config: &'a TrainConfig,
    /// The run directory.
    pub run_dir: &'a Path,
    /// Device name, e.g. `cpu` or `cuda:0`.
    pub device: &'a str,
    /// Trainable parameter count.
    pub num_params: usize,
    /// Optimizer steps per epoch.
    pub steps_per_epoch: usize,
    /// Optimizer steps in the whole run (after `--max-steps`).
    pub total_steps: usize,
    /// Optimizer steps already taken (non-zero when resuming from a snapshot).
    pub global_step: usize,
    /// Epoch training starts in (non-zero when resuming).
    pub start_epoch: usize,
    /// Epochs ended before this process started (resuming): their rows are the run's first.
    pub ended_epochs: &'a [EpochStats],
    /// Number of training images.
    pub train_images: usize,
    /// Number of evaluation images.
    pub eval_images: usize,
    /// The memory probe.
    pub probe: &'a dyn MemoryProbe,
    /// The memory records so far.
    pub memory: &'a MemoryLog,
}

/// Context for [`Callback::on_epoch_begin`].
pub struct EpochBegin<'a> {
    /// Epoch index, 0-based.
    pub epoch: usize,
    /// Number of epochs in the run.
    pub num_epochs: usize,
    /// Optimizer steps in this epoch (may be cut short by `--max-steps`).
    pub steps: usize,
    /// Optimizer steps taken before this epoch.
    pub global_step: usize,
    /// Whether the peak watermark should be reset now.
    pub reset_peak: bool,
    /// The memory probe.
    pub probe: &'a dyn MemoryProbe,
    /// The memory records so far.
    pub memory: &'a MemoryLog,
}

/// Context for the batch-level hooks. `loss` and friends are filled in for `on_batch_end`.
#[derive(Clone)]
pub struct BatchInfo<'a> {
    /// Epoch index, 0-based.
    pub epoch: usize,
    /// Optimizer-step index within the epoch, 0-based.
    pub batch: usize,
    /// Optimizer steps taken before this one in the whole run.
    pub global_step: usize,
    /// Micro-batch index within the step (accumulation), 0-based.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step.
    pub accum_steps: usize,
    /// Images in this optimizer step.
    pub images: usize,
    /// Mean training loss of the step (on `on_batch_end`).
    pub loss: Option<f64>,
    /// Correct predictions in the step (on `on_batch_end`).
    pub correct: Option<usize>,
    /// Learning rate used for this step.
    pub lr: f64,
    /// Loss scale (f16 only).
    pub loss_scale: Option<f64>,
    /// True when the loss scaler skipped this step (non-finite gradients).
    pub skipped: bool,
    /// Seconds the step took (on `on_batch_end`; after synchronizing the device).
    pub step_secs: Option<f64>,
    /// Global L2 norm of the step's (unscaled) gradients before clipping (on `on_batch_end`;
    /// infinite or NaN when the loss scaler skipped the step).
    pub grad_norm: Option<f64>,
    /// The memory probe.
    pub probe: &'a dyn MemoryProbe,
    /// The memory records so far.
    pub memory: &'a MemoryLog,
}

/// Context for [`Callback::on_layer_end`]: a layer of a step's forward or backward or of an
/// evaluation batch has run, or the step's update (phase `optimizer`).
pub struct LayerEnd<'a> {
    /// Epoch (0-based).
    pub epoch: usize,
    /// Batch of the epoch, or of the evaluation (0-based).
    pub batch: usize,
    /// Micro-batch of the step (gradient accumulation); 0 in an evaluation.
    pub micro_batch: usize,
    /// Forward, backward or eval.
    pub phase: Phase,
    /// The layer, named as in `step_timeline.json` (`stage1.block2`, `head`,
    /// `recompute stage1.block1–block2`).
    pub layer: &'a str,
    /// Activation bytes held for the backward now.
    pub saved_bytes: u64,
    /// Bytes of the parameter gradients now.
    pub grad_bytes: u64,
    /// Bytes in use right after the layer.
    pub current_bytes: u64,
    /// Highest bytes in use since the previous layer event (since the batch began, in an
    /// evaluation).
    pub peak_bytes: u64,
}

/// Results of one epoch, for [`Callback::on_epoch_end`].
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct EpochStats {
    /// Epoch index, 0-based.
    pub epoch: usize,
    /// Optimizer steps taken in this epoch.
    pub steps: usize,
    /// Training images processed.
    pub images: usize,
    /// Mean training loss.
    pub train_loss: f64,
    /// Training top-1 accuracy (on augmented data, as seen during training).
    pub train_accuracy: f64,
    /// Evaluation loss (None when evaluation is off).
    pub eval_loss: Option<f64>,
    /// Evaluation top-1 accuracy.
    pub eval_accuracy: Option<f64>,
    /// Training throughput over the epoch's steps (images per second, evaluation excluded).
    pub images_per_sec: f64,
    /// Wall-clock seconds of the training steps.
    pub train_secs: f64,
    /// Loss scale at the end of the epoch (f16 only).
    pub loss_scale: Option<f64>,
    /// Steps skipped by the loss scaler in this epoch.
    pub skipped_steps: usize,
    /// Learning rate at the end of the epoch.
    pub lr: f64,
}

/// Context for [`Callback::on_epoch_end`].
pub struct EpochEnd<'a> {
    /// The epoch's results.
    pub stats: &'a EpochStats,
    /// Number of epochs in the run.
    pub num_epochs: usize,
    /// The memory probe.
    pub probe: &'a dyn MemoryProbe,
    /// The memory records so far.
    pub memory: &'a MemoryLog,
}

/// Context for [`Callback::on_train_end`].
pub struct TrainEnd<'a> {
    /// Per-epoch results.
    pub epochs: &'a [EpochStats],
    /// Optimizer steps taken.
    pub global_step: usize,
    /// Mean training throughput over all steps (images per second).
    pub images_per_sec: f64,
    /// True when the run stopped early because of an interruption.
    pub interrupted: bool,
    /// The memory probe.
    pub probe: &'a dyn MemoryProbe,
    /// The memory records so far.
    pub memory: &'a MemoryLog,
}

/// A training hook. Every method does nothing by default; override what you need.
/// An error returned from a hook stops training and is reported to the user.
///
/// Pass yours in [`TrainerOptions::callbacks`](crate::train::TrainerOptions); it is called after
/// the built-in ones. Each context carries the memory records so far, the step or epoch that just
/// ended last (`examples/memory_callback.rs` is a whole program):
///
/// ```
/// use memtrain::callbacks::{BatchInfo, Callback, EpochEnd};
/// use memtrain::error::Result;
/// use memtrain_core::memory::format_bytes;
///
/// struct PeakPrinter;
///
/// impl Callback for PeakPrinter {
///     fn on_batch_end(&mut self, ctx: &BatchInfo<'_>) -> Result<()> {
///         if let Some(step) = &ctx.memory.last_batch {
///             println!("step peak {} ({})", format_bytes(step.peak_bytes), step.peak_phase);
///         }
///         Ok(())
///     }
///     fn on_epoch_end(&mut self, ctx: &EpochEnd<'_>) -> Result<()> {
///         if let Some(epoch) = ctx.memory.epochs.last() {
///             println!("epoch peak {}", format_bytes(epoch.peak_bytes));
///         }
///         Ok(())
///     }
/// }
/// ```
#[allow(unused_variables)]
pub trait Callback {
    /// Before the first epoch.
    fn on_train_begin(&mut self, ctx: &TrainBegin<'_>) -> Result<()> {
        Ok(())
    }
    /// At the start of each epoch.
    fn on_epoch_begin(&mut self, ctx: &EpochBegin<'_>) -> Result<()> {
        Ok(())
    }
    /// Before the first micro-batch of an optimizer step.
    fn on_batch_begin(&mut self, ctx: &BatchInfo<'_>) -> Result<()> {
        Ok(())
    }
    /// After the forward pass of each micro-batch (activations for backward are live).
    fn on_after_forward(&mut self, ctx: &BatchInfo<'_>) -> Result<()> {
        Ok(())
    }
    /// After the backward pass of each micro-batch (gradients are live).
    fn on_after_backward(&mut self, ctx: &BatchInfo<'_>) -> Result<()> {
        Ok(())
    }
    /// After each layer of a forward, a backward or an evaluation batch, and after the update.
    /// Not for the forward and backward of a `--cuda-graph` run's training steps, which run
    /// inside one launch (its updates and evaluation batches still call it).
    fn on_layer_end(&mut self, ctx: &LayerEnd<'_>) -> Result<()> {
        Ok(())
    }
    /// After the optimizer step.
    fn on_batch_end(&mut self, ctx: &BatchInfo<'_>) -> Result<()> {
        Ok(())
    }
    /// After the epoch's evaluation.
    fn on_epoch_end(&mut self, ctx: &EpochEnd<'_>) -> Result<()> {
        Ok(())
    }
    /// After the last epoch (also after an interruption).
    fn on_train_end(&mut self, ctx: &TrainEnd<'_>) -> Result<()> {
        Ok(())
    }
}

/// Dispatches every hook to a list of callbacks, in order.
#[derive(Default)]
pub(crate) struct CallbackList {
    callbacks: Vec<Box<dyn Callback>>,
}

macro_rules! dispatch {
    ($($name:ident($ty:ident)),+ $(,)?) => {
        $(
            fn $name(&mut self, ctx: &$ty<'_>) -> Result<()> {
                for cb in self.callbacks.iter_mut() {
                    cb.$name(ctx)?;
                }
                Ok(())
            }
        )+
    };
}

impl CallbackList {
    /// A list of callbacks, called in the given order.
    pub fn new(callbacks: Vec<Box<dyn Callback>>) -> Self {
        CallbackList { callbacks }
    }
}

/// A `CallbackList` is itself a callback: each hook goes to every member, in order, and the
/// first error stops the dispatch.
impl Callback for CallbackList {
    dispatch!(
        on_train_begin(TrainBegin),
        on_epoch_begin(EpochBegin),
        on_batch_begin(BatchInfo),
        on_after_forward(BatchInfo),
        on_after_backward(BatchInfo),
        on_layer_end(LayerEnd),
        on_batch_end(BatchInfo),
        on_epoch_end(EpochEnd),
        on_train_end(TrainEnd),
    );
}
