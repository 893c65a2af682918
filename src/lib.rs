//! memtrain: train a small CIFAR-10 CNN on Candle and make its training memory visible and smaller.
//!
//! The pieces, one concern per module, in layers (each imports only the ones listed after it):
//! - [`app`]: the `train_cifar10` application; [`sweep`]: process-isolated batch-size sweeps and
//!   comparisons (each point the sweep's own executable re-run as the trainer), tables and charts.
//! - [`train`]: the one training loop and its phased step, [`train::TrainState`] and its storage
//!   as save/resume checkpoints, the lean step (a layer tape), mixed precision, accumulation,
//!   gradient checkpointing, optimizers, pruning.
//! - [`callbacks`]: the Keras/Lightning-style hook trait and the built-in callbacks.
//! - [`plan`], [`bounds`]: a configuration for a memory budget; every input sized against the
//!   budgets before anything is loaded or built.
//! - [`memory`]: memory probes (counting allocator, CUDA pool), the trainer's recorder, the
//!   analytic estimate and the memory timeline inside a step.
//! - [`model`]: the CNN as a list of blocks (segments for gradient checkpointing).
//! - [`data`]: CIFAR-10 binary files, synthetic data, the prefetching batcher.
//! - [`config`]: every training flag and default in [`config::TrainConfig`]; [`cli`]: the other
//!   flags of `train_cifar10`; [`phase`]: the step's phases; [`device`], [`io`], [`signal`],
//!   [`error`].
//!
//! The ops the model and the step run on (depthwise and bounded-scratch convolutions, BatchNorm
//! with an in-place backward, the 2x2 max-pool, bf16 gemm) are their own crate,
//! [`memtrain_kernels`] (`kernels/`), which knows nothing of the trainer.
#![warn(missing_docs)]
// Module docs explain the private halves they are built from (`cargo doc --document-private-items`).
#![allow(rustdoc::private_intra_doc_links)]

pub(crate) mod advice;
pub mod app;
pub mod callbacks;
pub mod cli;
pub mod config;
pub mod data;
pub mod device;
pub mod error;
pub mod io;
pub mod memory;
pub mod model;
pub mod phase;
pub mod predict;
pub mod signal;
pub mod step;
pub mod sweep;
pub mod train;

pub use config::TrainConfig;
pub use error::{Error, Result};
