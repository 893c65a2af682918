//! A training run around the step ([`memtrain_core::step`]): the [`Trainer`] and the loop that drives it,
//! each concern in its own module.
//!
//! - [`trainer`]: a run and how it is built from a [`crate::TrainConfig`];
//! - [`fit`]: the training loop (epochs, evaluation, snapshots, callbacks);
//! - `step`: one optimizer step, the core's with the trainer's concerns as its observer (`watch`);
//! - [`resume`], [`state`], [`snapshot`], [`history`]: save/resume — the run's [`TrainState`],
//!   taken and put back, and its storage in the run directory (`snapshot_load`: reading one back);
//! - [`diagnose`]: out-of-memory snapshots and divergence advice;
//! - [`prune`]: magnitude pruning; [`graph`]: `--cuda-graph`; [`summary`]: `summary.json`;
//!   [`gpu_time`]: where a CUDA step's GPU time goes;
//!   [`run_dir`]: one writer per run directory.

pub mod diagnose;
pub mod fit;
pub mod gpu_time;
pub mod grads;
pub mod graph;
pub mod history;
pub mod prune;
pub mod resume;
pub mod run_dir;
pub mod snapshot;
mod snapshot_load;
pub mod state;
mod step;
pub mod summary;
pub mod trainer;
pub mod viewers;
mod watch;

pub use state::TrainState;
pub use summary::{
    EstimateSummary, MemorySummary, OptimizationSummary, ProgressSummary, QualitySummary,
    RunStatus, Summary,
};
pub use trainer::{Position, Trainer, TrainerOptions};
