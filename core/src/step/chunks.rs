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
//!   rounding differs from the whole-batch pass's (the codes are lossy anyway);
//! - a stage kept as codes whose activation is larger than a chunk, at the start of its segment
//!   (stage 1 without checkpointing), streams its whole backward from its pooled gradient in three
//!   passes ([`stage_backward_from_codes`]), so no activation-sized buffer of it is alive at once.
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

/// `maxpool2x2(relu(bn(h)))` and, `with_argmax`, its windows' argmax (None where the device has
/// no argmax kernel) with h kept as codes `q`: h decoded `chunk` images at a time, each chunk's
/// results written into the whole batch's.
pub(super) fn pool_from_codes<O: StepOps>(
    o: &O,
    q: &O::Codes,
    p: &O::Bn,
    chunk: usize,
    with_argmax: bool,
) -> Result<(O::T, Option<O::T>)> {
    let [n, c, h, w] = <[usize; 4]>::try_from(o.codes_dims(q)).expect("codes of [N, C, H, W]");
    let pooled = o.zeros(&[n, c, h / 2, w / 2], o.dtype())?;
    let mut argmax: Option<O::T> = None;
    for (first, len) in chunks(n, chunk) {
        let hc = o.dequantize_images(q, first, len)?;
        let pc = o.bn_images(p, first, len)?;
        o.write_images(&pooled, first, &o.bn_relu_pool(&hc, &pc)?)?;
        if !with_argmax {
            continue;
        }
        if let Some(a) = o.bn_relu_pool_argmax(&hc, &pc)? {
            if argmax.is_none() {
                argmax = Some(o.zeros(&[n, c, h / 2, w / 2], candle_core::DType::U8)?);
            }
            o.write_images(argmax.as_ref().expect("made above"), first, &a)?;
        }
    }
    Ok((pooled, argmax))
}

/// A stage whose two blocks are kept as codes: `a` (dense conv, BatchNorm, ReLU) and then `b`
/// (dense conv, BatchNorm, ReLU, 2x2 max-pool), each with its codes, its BatchNorm parameters
/// (with the forward's decisions) and its conv weights in the compute dtype.
pub(super) struct CodedStage<'r, O: StepOps> {
    pub a: (&'r O::Codes, &'r O::Bn, O::T),
    pub b: (&'r O::Codes, &'r O::Bn, O::T),
}

/// What [`stage_backward_from_codes`] returns: both convs' weight gradients (f32, summed over
/// the chunks), both BatchNorms' backward sums `[Σg'x̂; Σg']`, and the input gradient if asked.
pub(super) struct StageGrads<T> {
    pub weight_a: T,
    pub weight_b: T,
    pub sums_a: T,
    pub sums_b: T,
    pub dx: Option<T>,
}

/// The backward of a [`CodedStage`] from `gp`, the gradient of its pooled output, streamed over
/// chunks of `chunk` images so that no activation-sized buffer of the stage is ever whole: only
/// `gp`, the stage's input `x` (held by the caller) and, when `want_dx`, the input gradient are.
///
/// BatchNorm's backward needs per-channel sums over the whole batch of the gradient it reads
/// before it can give any image's input gradient, so the stage runs in three passes, each
/// decoding what it needs a chunk at a time: (1) b's sums; (2) b's input gradient, b's conv
/// weight gradient and input gradient, and a's sums from it; (3) b's input gradient and conv input
/// gradient again, a's input gradient, a's conv weight gradient and the input gradient. Pass 3
/// computes b's conv input gradient a second time: the price of never holding it whole.
pub(super) fn stage_backward_from_codes<O: StepOps>(
    o: &O,
    s: &CodedStage<'_, O>,
    gp: &O::T,
    x: &O::T,
    want_dx: bool,
    chunk: usize,
) -> Result<StageGrads<O::T>> {
    let ((qa, pa, wa), (qb, pb, wb)) = (&s.a, &s.b);
    let n = o.codes_dims(qb)[0];
    let f32 = |t: O::T| o.to_dtype(&t, candle_core::DType::F32);
    let sum = |acc: Option<O::T>, part: O::T| -> Result<O::T> {
        match acc {
            None => Ok(part),
            Some(s) => o.add(&s, &part),
        }
    };
    // b's h decoded for images `first..first + len`, its parameters and its windows' argmax.
    let decode_b = |first, len| -> Result<(O::T, O::Bn, O::T)> {
        let h = o.dequantize_images(qb, first, len)?;
        let p = o.bn_images(pb, first, len)?;
        let am = o
            .bn_relu_pool_argmax(&h, &p)?
            .expect("a device that runs in chunks has the argmax kernel");
        Ok((h, p, am))
    };
    // a's conv-output gradient for a chunk: b's input gradient, then b's conv input gradient.
    let dy_a = |first, len, sums_b: &O::T, weight_b: Option<&mut Option<O::T>>| -> Result<O::T> {
        let (h, p, am) = decode_b(first, len)?;
        let dh =
            o.bn_relu_pool_backward_input(h, &o.narrow(gp, first, len)?, &am, &p, sums_b, n)?;
        if let Some(acc) = weight_b {
            let ya = {
                let p = o.bn_images(pa, first, len)?;
                o.bn_relu_in_place(o.dequantize_images(qa, first, len)?, &p)?
            };
            let gw = f32(o.conv2d_backward_weight(&ya, &dh, wb, 1)?)?;
            *acc = Some(sum(acc.take(), gw)?);
        }
        let mut dims = o.codes_dims(qa);
        dims[0] = len;
        o.conv2d_backward_input(&dh, wb, &dims, 1)
    };

    let mut sums_b = None;
    for (first, len) in chunks(n, chunk) {
        let (h, p, am) = decode_b(first, len)?;
        let part = o.bn_relu_pool_backward_sums(&h, &o.narrow(gp, first, len)?, &am, &p)?;
        sums_b = Some(sum(sums_b, part)?);
    }
    let sums_b = sums_b.expect("a batch has at least one image");

    let (mut sums_a, mut weight_b) = (None, None);
    for (first, len) in chunks(n, chunk) {
        let d = dy_a(first, len, &sums_b, Some(&mut weight_b))?;
        let h = o.dequantize_images(qa, first, len)?;
        let part = o.bn_relu_backward_sums(&h, &d, &o.bn_images(pa, first, len)?)?;
        sums_a = Some(sum(sums_a, part)?);
    }
    let sums_a = sums_a.expect("a batch has at least one image");

    let mut weight_a = None;
    let dx = want_dx
        .then(|| o.zeros(&o.dims(x), o.dtype()))
        .transpose()?;
    for (first, len) in chunks(n, chunk) {
        let d = dy_a(first, len, &sums_b, None)?;
        {
            let h = o.dequantize_images(qa, first, len)?;
            o.bn_relu_backward_input(&h, &d, &o.bn_images(pa, first, len)?, &sums_a, n)?;
        }
        let xc = o.narrow(x, first, len)?;
        let gw = f32(o.conv2d_backward_weight(&xc, &d, wa, 1)?)?;
        weight_a = Some(sum(weight_a, gw)?);
        if let Some(dx) = &dx {
            o.write_images(
                dx,
                first,
                &o.conv2d_backward_input(&d, wa, &o.dims(&xc), 1)?,
            )?;
        }
    }
    Ok(StageGrads {
        weight_a: weight_a.expect("a batch has at least one image"),
        weight_b: weight_b.expect("a batch has at least one image"),
        sums_a,
        sums_b,
        dx,
    })
}
