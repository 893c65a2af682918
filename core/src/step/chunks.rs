//! Passes over chunks of images: a block's passes that hold one activation-sized buffer
//! instead of two or three.
//!
//! Every pass of a block but BatchNorm's sums treats each image on its own, so a pass can run over
//! a few images at a time ([`chunk_images`]) and either write its output over its input or read
//! its input straight from the codes:
//!
//! - a dense conv with as many output channels as input ones (the second block of each stage)
//!   writes its output over its input ([`conv_over_input`]), and its input gradient over its
//!   output gradient ([`input_grad_over`]): each image's result needs only that image's operand,
//!   so the images not yet done are still intact. Per image the arithmetic is the whole-batch
//!   pass's, so the exact step's losses and gradients stay bit-identical;
//! - with codes ([`super::compress`]), the weight gradient reads the conv's input (the previous
//!   block's output) decoded and normalized chunk by chunk ([`weight_grad_from_codes`]), and
//!   BatchNorm's backward decodes its h chunk by chunk, once for the per-channel sums and once for
//!   the input gradient, which it writes over the output gradient
//!   ([`bn_relu_backward_from_codes`]); after a pool, the pooled output and its argmax (the next
//!   conv's input, for its backward) are made chunk by chunk into their own buffers
//!   ([`pool_from_codes`]). The weight gradient and the sums are added chunk by chunk, so their
//!   rounding differs from the whole-batch pass's (the codes are lossy anyway).
//!
//! The tape ([`super::tape`]) runs them where [`super::ops::StepOps::in_chunks`]: on the CPU. A
//! CUDA device runs every pass on the whole batch (chunks there have not run on a GPU yet). The
//! estimate runs these same functions on sizes.

use super::ops::StepOps;
use crate::error::Result;

/// Bytes of one chunk of an activation: what a chunked pass holds of its operand or its result
/// at a time (and so the size of the decoded or convolved piece beside the whole activation).
pub const CHUNK_BYTES: usize = 2 << 20;

/// Images per chunk of an activation of `dims` (`[N, …]`) with `elem_bytes`-byte elements: as
/// many as fit in [`CHUNK_BYTES`], at least one, at most the batch. It does not depend on
/// the thread count, so a chunked step rounds alike on every machine.
pub fn chunk_images(dims: &[usize], elem_bytes: usize) -> usize {
    let image = dims[1..].iter().product::<usize>() * elem_bytes;
    (CHUNK_BYTES / image.max(1)).clamp(1, dims[0].max(1))
}

/// How a step chunks its batch for the chunked passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Chunking {
    /// [`chunk_images`]'s choice (where the device runs in chunks at all).
    #[default]
    Chosen,
    /// Never: every pass on the whole batch, as a CUDA device runs it (the tests' reference).
    Whole,
    /// This many images (at least one; a batch's last chunk may be shorter).
    Images(usize),
}

impl Chunking {
    /// Images per chunk over an activation of `dims` in `elem_bytes`-byte elements, or None
    /// for the whole batch at once.
    pub(super) fn images(self, dims: &[usize], elem_bytes: usize) -> Option<usize> {
        match self {
            Chunking::Chosen => Some(chunk_images(dims, elem_bytes)),
            Chunking::Whole => None,
            Chunking::Images(k) => Some(k.clamp(1, dims[0].max(1))),
        }
    }
}

/// `(first image, images)` of each chunk of a batch of `n`.
fn chunks(n: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n)
        .step_by(chunk.max(1))
        .map(move |first| (first, chunk.min(n - first)))
}

/// A dense 3x3 conv (stride 1, padding 1) of `x`, given up by the caller, whose output has x's
/// shape: written over x, `chunk` images at a time.
pub(super) fn conv_over_input<O: StepOps>(o: &O, x: O::T, w: &O::T, chunk: usize) -> Result<O::T> {
    let n = o.dims(&x)[0];
    for (first, len) in chunks(n, chunk) {
        let out = o.conv2d(&o.narrow(&x, first, len)?, w, 1)?;
        o.write_images(&x, first, &out)?;
    }
    Ok(x)
}

/// The input gradient of a dense 3x3 conv whose input has the output's shape, written over its
/// output gradient `dh`, `chunk` images at a time.
pub(super) fn input_grad_over<O: StepOps>(o: &O, dh: O::T, w: &O::T, chunk: usize) -> Result<O::T> {
    let n = o.dims(&dh)[0];
    for (first, len) in chunks(n, chunk) {
        let dx = {
            let d = o.narrow(&dh, first, len)?;
            o.conv2d_backward_input(&d, w, &o.dims(&d), 1)?
        };
        o.write_images(&dh, first, &dx)?;
    }
    Ok(dh)
}

/// The weight gradient of a dense 3x3 conv whose input is `relu(bn(h))` with h kept as codes `q`
/// (the previous block's output): h decoded and normalized `chunk` images at a time, each chunk's
/// gradient handed to `add` (in the compute dtype).
pub(super) fn weight_grad_from_codes<O: StepOps>(
    o: &O,
    q: &O::Codes,
    p: &O::Bn,
    dh: &O::T,
    w: &O::T,
    chunk: usize,
    mut add: impl FnMut(O::T) -> Result<()>,
) -> Result<()> {
    let n = o.codes_dims(q)[0];
    for (first, len) in chunks(n, chunk) {
        let gw = {
            let pc = o.bn_images(p, first, len)?;
            let y = o.bn_relu_in_place(o.dequantize_images(q, first, len)?, &pc)?;
            o.conv2d_backward_weight(&y, &o.narrow(dh, first, len)?, w, 1)?
        };
        add(gw)?;
    }
    Ok(())
}

/// `(dh, dγ, dβ)` of `relu(bn(h))` with h kept as codes `q`, from the output gradient `g`
/// (consumed; dh is written over it): h decoded `chunk` images at a time, twice (the per-channel
/// sums over the batch first, then the input gradient, which needs them).
pub(super) fn bn_relu_backward_from_codes<O: StepOps>(
    o: &O,
    q: &O::Codes,
    g: O::T,
    p: &O::Bn,
    chunk: usize,
) -> Result<(O::T, O::T, O::T)> {
    let n = o.codes_dims(q)[0];
    let mut sums: Option<O::T> = None;
    for (first, len) in chunks(n, chunk) {
        let part = {
            let h = o.dequantize_images(q, first, len)?;
            let pc = o.bn_images(p, first, len)?;
            o.bn_relu_backward_sums(&h, &o.narrow(&g, first, len)?, &pc)?
        };
        sums = Some(match sums {
            None => part,
            Some(s) => o.add(&s, &part)?,
        });
    }
    let sums = sums.expect("a batch has at least one image");
    for (first, len) in chunks(n, chunk) {
        let h = o.dequantize_images(q, first, len)?;
        let pc = o.bn_images(p, first, len)?;
        o.bn_relu_backward_input(&h, &o.narrow(&g, first, len)?, &pc, &sums, n)?;
    }
    let (dgamma, dbeta) = o.bn_grads(&sums)?;
    Ok((g, dgamma, dbeta))
}

/// `maxpool2x2(relu(bn(h)))` and its windows' argmax (None where the device has no argmax kernel)
/// with h kept as codes `q`: h decoded `chunk` images at a time, each chunk's results written
/// into the whole batch's.
pub(super) fn pool_from_codes<O: StepOps>(
    o: &O,
    q: &O::Codes,
    p: &O::Bn,
    chunk: usize,
) -> Result<(O::T, Option<O::T>)> {
    let [n, c, h, w] = <[usize; 4]>::try_from(o.codes_dims(q)).expect("codes of [N, C, H, W]");
    let pooled = o.zeros(&[n, c, h / 2, w / 2], o.dtype())?;
    let mut argmax: Option<O::T> = None;
    for (first, len) in chunks(n, chunk) {
        let hc = o.dequantize_images(q, first, len)?;
        let pc = o.bn_images(p, first, len)?;
        o.write_images(&pooled, first, &o.bn_relu_pool(&hc, &pc)?)?;
        if let Some(a) = o.bn_relu_pool_argmax(&hc, &pc)? {
            if argmax.is_none() {
                argmax = Some(o.zeros(&[n, c, h / 2, w / 2], candle_core::DType::U8)?);
            }
            o.write_images(argmax.as_ref().expect("made above"), first, &a)?;
        }
    }
    Ok((pooled, argmax))
}
