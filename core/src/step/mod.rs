//! The training step and its memory optimizations: the part of memtrain a learner reads first.
//!
//! Reading order:
//! 1. [`train`]: the whole step in one short function, [`train::train_step`]: every micro-batch's
//!    forward and backward into one set of gradients (**gradient accumulation**), then the update
//!    (unscale, the global norm, clipping, the loss scaler, the optimizer).
//! 2. [`tape`]: forward and backward of one micro-batch as an explicit layer tape. What each
//!    block saves for its backward, when it is freed, and **gradient checkpointing** (a segment's
//!    forward keeps only its input; its backward recomputes it) — the segments come from
//!    [`crate::model::Cnn::segments`].
//! 3. [`ops`]: every op the tape and the optimizer call, behind one trait: on Candle tensors for
//!    training, on sizes for the memory estimate (the application's `predict` module), which so
//!    runs this very step.
//! 4. [`micro`]: a batch and its micro-batches; [`accumulate`]: one f32 gradient buffer per
//!    parameter, summed over them.
//! 5. [`precision`]: **mixed precision** — the compute dtype and f16's dynamic loss scaler.
//! 6. [`optim`]: the optimizers on f32 master weights and the learning-rate schedule.
//! 7. [`compress`]: compressed saved activations (`--compress-activations int8|int4|int2`), the
//!    one lossy optimization: what the tape keeps of each block's conv output.
//! 8. [`chunks`]: passes over chunks of images, so that a block holds one activation-sized buffer
//!    where it would hold two (a conv written over its input, a backward reading the codes).
//!
//! The fourth optimization, **depthwise-separable convolutions**, is a choice of layer when the
//! model is built ([`crate::model::layers::ConvLayer`]); the tape runs whichever conv the block
//! has. [`oracle`] is the same micro-batch through Candle's autograd: the tests' reference, never
//! used for training.

pub mod accumulate;
pub mod chunks;
pub mod compress;
pub mod micro;
pub mod ops;
pub mod optim;
pub mod oracle;
pub mod precision;
pub mod tape;
pub mod train;

pub use micro::{BatchInput, MicroResult};
