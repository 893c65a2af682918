//! The one training loop and its mechanisms: mixed precision with a dynamic loss scaler,
//! gradient accumulation, gradient checkpointing (recomputation), the optimizers and magnitude
//! pruning; the run's [`TrainState`] and its storage as save/resume checkpoints
//! ([`checkpoint`]).

pub mod accumulate;
pub mod checkpoint;
pub mod graph;
pub mod history;
pub mod lean;
pub mod optim;
pub mod precision;
pub mod prune;
pub mod reference;
pub mod run_dir;
pub mod state;
pub mod summary;
pub mod trainer;

pub use state::TrainState;
pub use summary::{RunStatus, Summary};
pub use trainer::{Trainer, TrainerOptions};
