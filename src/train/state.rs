//! [`TrainState`]: everything that decides the rest of a run, as plain values.
//!
//! [`Trainer::snapshot`](super::Trainer::snapshot) takes it and
//! [`Trainer::restore`](super::Trainer::restore) puts it back; saving and loading it is
//! [`super::snapshot`]'s business alone (files, hashes, atomic directories), so storage never
//! reaches into the trainer and the trainer knows nothing of files. Tensors are held on the CPU,
//! where a snapshot reads and writes them.

use super::history::RunHistory;
use candle_core::Tensor;
use memtrain_core::memory::MemoryLog;
use memtrain_core::step::precision::LossScaler;
use std::collections::HashMap;

/// A training run's state at one position: parameters, BatchNorm statistics, optimizer and loss
/// scaler, pruning masks, the data position and counters, and the run's history so far.
#[derive(Debug, Clone)]
pub struct TrainState {
    /// Optimizer steps taken.
    pub global_step: usize,
    /// Epoch the run continues in.
    pub epoch: usize,
    /// Batch within `epoch` the run continues with; equal to `steps_per_epoch` when the epoch's
    /// steps are all trained and its evaluation is still to do.
    pub next_batch: usize,
    /// Optimizer steps per epoch of the run (the data position means nothing under another).
    pub steps_per_epoch: usize,
    /// Optimizer steps of the whole run (informational: it follows --epochs/--max-steps).
    pub total_steps: usize,
    /// Parameters by name ([`memtrain_core::model::Cnn::named_vars`]) and BatchNorm running statistics
    /// ([`memtrain_core::model::Cnn::named_buffers`]), f32 on the CPU.
    pub model: HashMap<String, Tensor>,
    /// Optimizer state tensors by name ([`memtrain_core::step::optim::Optimizer::state`]: `s1.<i>`, `s2.<i>`).
    pub optimizer: HashMap<String, Tensor>,
    /// The optimizer's own step count (Adam bias correction; differs from `global_step` when the
    /// f16 loss scaler skipped steps).
    pub optimizer_steps: usize,
    /// The dynamic loss scaler (f16 only).
    pub scaler: Option<LossScaler>,
    /// `--prune`: the u8 pruning masks by parameter name. With the global step, which is the
    /// schedule's position, they make a resumed pruned run continue exactly.
    pub masks: Option<HashMap<String, Tensor>>,
    /// Training images.
    pub train_images: usize,
    /// [`crate::data::Dataset::fingerprint`] of the training split: the run continues only on
    /// the same data.
    pub train_fingerprint: String,
    /// The data description line of the run (for messages).
    pub data_description: String,
    /// The run so far: ended epochs, the epoch in progress, totals and step times.
    pub history: RunHistory,
    /// The memory log of the steps and ended epochs so far.
    pub memory: MemoryLog,
}

impl TrainState {
    /// Bytes of its tensors (model, optimizer state, masks): loaded for a resume, they become
    /// the run's own, which its predicted peak already counts.
    pub fn tensor_bytes(&self) -> u64 {
        let masks = self.masks.iter().flat_map(|m| m.values());
        (self
            .model
            .values()
            .chain(self.optimizer.values())
            .chain(masks))
        .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
        .sum()
    }
}
