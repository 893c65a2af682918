//! memtrain-core: one training step of a small CIFAR-10 CNN on Candle, its four memory
//! optimizations, and the probes that measure what it holds.
//!
//! Start with [`step`]: the lean step (a layer tape) and its optimizations — mixed precision,
//! gradient accumulation, gradient checkpointing, depthwise-separable convolutions — plus the
//! one lossy option, compressed saved activations.
//!
//! The pieces, one concern per module, in layers (each imports only the ones listed after it):
//! - [`step`]: the tape, the one micro-batch loop, accumulation, precision, the optimizers,
//!   compression, and Candle's autograd as the tests' oracle.
//! - [`memory`]: memory probes (counting allocator, CUDA pool, the process's resident memory),
//!   the recorder of per-batch and per-epoch peaks, and the memory timeline inside a step.
//! - [`model`]: the CNN as a list of blocks (segments for gradient checkpointing).
//! - [`options`]: the option types the step runs with (precision, checkpointing, …).
//! - [`phase`]: where in a step something happens; [`device`]; [`error`].
//!
//! The ops underneath (depthwise and bounded-scratch convolutions, BatchNorm with an in-place
//! backward, the 2x2 max-pool, bf16 gemm) are [`memtrain_kernels`]. The application around the
//! step — data, the trainer, sweeps, charts, the memory estimate — is the `memtrain` crate,
//! which this crate knows nothing of.
#![warn(missing_docs)]
#![allow(rustdoc::private_intra_doc_links)]

pub mod device;
pub mod error;
pub mod memory;
pub mod model;
pub mod options;
pub mod phase;
pub mod step;

pub use error::{Error, Result};
