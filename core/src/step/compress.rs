//! Compressed saved activations (`--compress-activations int8|int4|int2`): the one lossy
//! optimization.
//!
//! Every block keeps its conv output h for the backward (see [`super::tape`]); that is the floor
//! of exact storage, 56 MiB of the plain f32 step's 57.5 MiB at batch 128. Stored as codes of
//! [`Width::bits`] bits ([`memtrain_kernels::quantize`]: int8 with a range per channel, rounded
//! to nearest; int4 and int2 with a range per group of 256 values of a plane, rounded
//! stochastically), h takes 8/32, 4/32 or 2/32 of its f32 bytes plus its ranges, and the backward
//! reads a value within a step of the one the forward computed (half a step for int8; for int4
//! and int2 unbiased).
//!
//! Beside the codes the tape keeps the forward's decisions, taken from the exact h: a bit per
//! value, set where the block's output gradient reaches h (where `relu(bn(h)) > 0`, and after a
//! pool only at each window's first maximum; [`memtrain_kernels::batchnorm::bn_relu_decisions`]).
//! They ride with the block's BatchNorm parameters, so every pass reads the forward's ReLU mask
//! and pool argmax whatever h it decodes, and the codes' error reaches only the gradients'
//! values (BatchNorm's x̂ and the next conv's input), never which values get a gradient. Read from
//! the decoded h instead, a value within a step of BatchNorm's zero crossing could land on the
//! other side: a gradient where the forward's ReLU stopped it, an error whose mean is not zero
//! (ActNN keeps the mask exactly for the same reason). The bits cost 1/32 of h's f32 bytes.
//! The segment inputs of gradient checkpointing and the images stay exact: a recomputed segment
//! starts from what the first forward saw.
//!
//! Stochastic rounding's noise is keyed by the block's index and the activation's own ranges (see
//! [`memtrain_kernels::quantize`]): it changes with the run's weights and data, every step,
//! micro-batch and block, repeats bit for bit when they repeat, and draws from no generator that
//! anything else reads.
//!
//! What it costs in memory besides the codes and the bits: the backward decodes h just before it
//! needs it. On the CPU it decodes a chunk of images at a time where the pass allows
//! ([`super::chunks`]: the next conv's weight gradient, BatchNorm's backward, a pool's output and
//! argmax, and a whole stage's backward where its activation is larger than a chunk), so it holds
//! a chunk beside the codes; elsewhere a pooled block's BatchNorm backward decodes h whole, as its
//! input gradient takes h's buffer. On CUDA every decoding is whole: a block's backward holds the
//! decoded h where the exact step held the saved one.

use super::ops::StepOps;
use crate::error::Result;
use crate::options::ActivationStorage;
#[cfg(doc)]
use memtrain_kernels::quantize::Width;

/// A block's conv output as the tape keeps it.
pub(crate) enum Kept<O: StepOps> {
    /// The tensor itself.
    Exact(O::T),
    /// Its codes.
    Codes(O::Codes),
}

impl<O: StepOps> Kept<O> {
    /// Block j's `h` stored as `how` says (`h` is only read: the forward goes on with it).
    pub(crate) fn store(o: &O, j: usize, h: &O::T, how: ActivationStorage) -> Result<Self> {
        Ok(match how.width() {
            None => Kept::Exact(h.clone()),
            Some(width) => Kept::Codes(o.quantize(h, width, j as u64)?),
        })
    }

    /// The tensor for the backward: the saved one, or a fresh decoding. The record is consumed,
    /// so the codes are freed as the decoded tensor takes their place.
    pub(crate) fn restore(self, o: &O) -> Result<O::T> {
        Ok(match self {
            Kept::Exact(h) => h,
            Kept::Codes(q) => o.dequantize(&q)?,
        })
    }

    /// `relu(bn(h))` into a buffer of its own, the record kept (the block's output, which the
    /// next conv's weight gradient reads).
    pub(crate) fn output(&self, o: &O, p: &O::Bn) -> Result<O::T> {
        Ok(match self {
            Kept::Exact(h) => o.bn_relu(h, p)?,
            // The decoding is a fresh tensor: normalize it where it lies.
            Kept::Codes(q) => o.bn_relu_in_place(o.dequantize(q)?, p)?,
        })
    }

    /// The shape of the kept tensor.
    pub(crate) fn dims(&self, o: &O) -> Vec<usize> {
        match self {
            Kept::Exact(h) => o.dims(h),
            Kept::Codes(q) => o.codes_dims(q),
        }
    }

    /// Bytes held for the backward.
    pub(crate) fn bytes(&self, o: &O) -> u64 {
        match self {
            Kept::Exact(h) => o.bytes(h),
            Kept::Codes(q) => o.codes_bytes(q),
        }
    }
}
