//! The training step and its memory optimizations: the part of memtrain a learner reads first.
//!
//! Reading order:
//! 1. [`tape`]: forward and backward of one micro-batch as an explicit layer tape. What each
//!    block saves for its backward, when it is freed, and gradient checkpointing (a segment's
//!    forward keeps only its input; its backward recomputes it) — the segments come from
//!    [`crate::model::Cnn::segments`].
//! 2. [`micro`]: gradient accumulation — the one loop over a batch's micro-batches.
//! 3. [`accumulate`]: one f32 gradient buffer per parameter, summed over the micro-batches.
//! 4. [`precision`]: mixed precision — the compute dtype and f16's dynamic loss scaler.
//! 5. [`optim`]: the optimizers on f32 master weights and the learning-rate schedule.
//! 6. [`compress`]: compressed saved activations (`--compress-activations int8|int4|int2`), the
//!    one lossy optimization: what the tape keeps of each block's conv output.
//! 7. [`stream`]: passes over chunks of images, so that a block holds one activation-sized buffer
//!    where it would hold two (a conv written over its input, a backward reading the codes).
//!
//! The fourth optimization, depthwise-separable convolutions, is a choice of layer when the model
//! is built ([`crate::model::layers::ConvLayer`]); the tape runs whichever conv the block has.
//! [`oracle`] is the same micro-batch through Candle's autograd: the tests' reference, never used
//! for training. [`ops`] lists every op the tape calls: on Candle tensors for training, on sizes
//! for the memory estimate (the application's `predict` module), which so runs the tape itself.

pub mod accumulate;
pub mod compress;
pub mod micro;
pub mod ops;
pub mod optim;
pub mod oracle;
pub mod precision;
pub mod stream;
pub mod tape;
pub mod train;

pub use micro::{for_each_micro_batch, BatchInput, MicroResult};
