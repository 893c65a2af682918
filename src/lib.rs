//! memtrain: train a small CIFAR-10 CNN on Candle and make its training memory visible and smaller.
//!
//! The step itself — the model, the tape, its four memory optimizations (mixed precision,
//! gradient accumulation, gradient checkpointing, depthwise-separable convolutions), the memory
//! probes and recorder — is the crate [`memtrain_core`] (`core/`), named by its own paths
//! (`memtrain_core::step`, …), so the boundary shows wherever it is crossed. This crate is the
//! application around it; its [`error::Error`] holds the core's errors and adds its own.
//!
//! The pieces, one concern per module, in layers (each imports only the ones listed after it):
//! - [`app`]: the `train_cifar10` application; [`sweep`]: process-isolated batch-size sweeps and
//!   comparisons (each point the sweep's own executable re-run as the trainer), tables and charts.
//! - [`train`]: a run around the step — the [`train::Trainer`], the loop, save/resume (the run's
//!   [`train::TrainState`] and its snapshots), failure reports, pruning, the summary.
//! - [`callbacks`]: the Keras/Lightning-style hook trait and the built-in callbacks.
//! - [`export`]: the viewers' formats — TensorBoard event files, PyTorch's memory snapshot,
//!   Perfetto's trace.
//! - [`predict`]: the memory estimate (the core's tape run on sizes), the `--fit-memory` planner,
//!   and every input sized against the budgets before anything is loaded or built.
//! - [`data`]: CIFAR-10 binary files, synthetic data, the prefetching batcher.
//! - [`config`]: every training flag and default in [`config::TrainConfig`]; [`cli`]: the other
//!   flags of `train_cifar10`; [`io`], [`signal`], [`error`].
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
pub mod error;
pub mod export;
pub mod io;
pub mod predict;
pub mod signal;
pub mod sweep;
pub mod train;

pub use config::TrainConfig;
pub use error::{Error, Result};
