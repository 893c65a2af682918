//! memtrain: train a small CIFAR-10 CNN on Candle and make its training memory visible and smaller.
//!
//! The pieces, one concern per module:
//! - [`config`]: the validated [`config::TrainConfig`]; [`cli`]: the flags that build it.
//! - [`data`]: CIFAR-10 binary files, synthetic data, the prefetching batcher; [`bounds`]: every
//!   input sized against the memory budgets before anything is loaded or built.
//! - [`model`]: the CNN as a list of segments (so checkpointing can recompute them).
//! - [`ops`]: our own Candle ops (depthwise and gemm-based convolutions).
//! - [`memory`]: memory probes (counting allocator, CUDA pool), the analytic estimate and the
//!   memory timeline inside a step; [`phase`]: the step's phases.
//! - [`train`]: the one training loop, the lean step (a layer tape), mixed precision,
//!   accumulation, checkpointing, optimizers.
//! - [`callbacks`]: the Keras/Lightning-style hook trait and the built-in callbacks.
//! - [`sweep`]: process-isolated batch-size sweeps and comparisons, tables and charts.
#![warn(missing_docs)]

pub mod app;
pub mod bounds;
pub mod callbacks;
pub mod cli;
pub mod config;
pub mod data;
pub mod device;
pub mod error;
pub mod io;
pub mod memory;
pub mod model;
pub mod ops;
pub mod phase;
pub mod plan;
pub mod signal;
pub mod sweep;
pub mod train;

pub use config::TrainConfig;
pub use error::{Error, Result};
