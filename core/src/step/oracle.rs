//! Forward and backward of one micro-batch through Candle's autograd, with gradient
//! checkpointing by recomputation and a surrogate loss: the reference implementation that the
//! lean step ([`super::tape`]) is tested against (the trainer's `reference_grads`). Training uses the
//! lean step; this one keeps every forward tensor until its `backward` returns.
//!
//! Without checkpointing the whole network is one autograd graph: every activation saved for
//! backward stays alive until `backward`. With checkpointing the blocks are split into
//! segments. The forward pass runs each segment without a graph (parameters detached) and keeps
//! only the segment's input. The backward pass then goes last segment first: recompute the
//! segment from its saved input with a graph, and push the upstream gradient through it with
//! the surrogate `(out · grad_out.detach()).sum()`, whose gradient with respect to the segment's
//! input and parameters is exactly the chain rule's. Only one segment's activations are alive
//! at a time. BatchNorm running statistics are updated in the first (graph-less) forward only;
//! the recomputation uses the same batch statistics (same input) without updating them.

use super::accumulate::GradAccumulator;
use super::micro::MicroResult;
use crate::error::Result;
use crate::model::{Cnn, Mode};
use crate::options::Segmentation;
use candle_core::{DType, Tensor, Var};

/// Mean cross-entropy (f32) and correct count for f32 logits and u32 labels.
pub fn loss_and_correct(logits: &Tensor, labels: &Tensor) -> Result<(Tensor, usize)> {
    let loss = candle_nn::loss::cross_entropy(logits, labels)?;
    let pred = logits.detach().argmax(1)?;
    let correct = pred
        .eq(labels)?
        .to_dtype(DType::U32)?
        .sum_all()?
        .to_scalar::<u32>()? as usize;
    Ok((loss, correct))
}

/// Forward and backward of one micro-batch: images `x` (f32 `[N, 3, 32, 32]` on the model's device),
/// labels `y` (u32 `[N]`). The loss is multiplied by `loss_mult` (1/K for accumulation, times the
/// loss scale for f16) before backward; gradients are added to `acc` (aligned with `vars`).
#[allow(clippy::too_many_arguments)]
pub fn forward_backward(
    model: &Cnn,
    vars: &[Var],
    x: &Tensor,
    y: &Tensor,
    dtype: DType,
    ckpt: Segmentation,
    loss_mult: f64,
    acc: &mut GradAccumulator,
) -> Result<MicroResult> {
    let xin = x.to_dtype(dtype)?;
    let n = model.blocks.len();
    if ckpt == Segmentation::NONE {
        let track = Mode::Train {
            track: true,
            update_stats: true,
        };
        let h = model.forward_blocks(&xin, 0..n, track)?;
        let logits = model.forward_head(&h, track)?;
        drop(h);
        let (loss, correct) = loss_and_correct(&logits, y)?;
        let loss_value = loss.to_scalar::<f32>()? as f64;
        let mut store = (loss * loss_mult)?.backward()?;
        acc.add_from_store(vars, &mut store)?;
        return Ok(MicroResult {
            loss: loss_value,
            correct,
        });
    }

    // Forward without a graph, keeping each segment's input.
    let segments = model.segments(ckpt);
    let no_graph = Mode::Train {
        track: false,
        update_stats: true,
    };
    let mut inputs: Vec<Tensor> = Vec::with_capacity(segments.len());
    let mut h = xin;
    for seg in &segments {
        let out = model.forward_blocks(&h, seg.clone(), no_graph)?;
        inputs.push(h);
        h = out;
    }
    // The head (and loss) with a graph, from a variable copy of the last output so its
    // gradient is the upstream gradient of the last segment.
    let hv = Var::from_tensor(&h)?;
    drop(h);
    let track = Mode::Train {
        track: true,
        update_stats: false,
    };
    let logits = model.forward_head(hv.as_tensor(), track)?;
    let (loss, correct) = loss_and_correct(&logits, y)?;
    let loss_value = loss.to_scalar::<f32>()? as f64;

    let mut store = (loss * loss_mult)?.backward()?;
    drop(logits);
    acc.add_from_store(vars, &mut store)?;
    let mut grad = store
        .remove(hv.as_tensor())
        .ok_or_else(|| candle_core::Error::Msg("no gradient reached the head's input".into()))?;
    drop(store);
    drop(hv);

    for (i, seg) in segments.iter().enumerate().rev() {
        let saved = inputs.pop().expect("one saved input per segment");
        // The first segment's input is the data: no gradient needed, no variable copy.
        let (input_var, seg_in) = if i > 0 {
            // A variable needs its own storage: copy, then free the saved tensor right away.
            let v = Var::from_tensor(&saved)?;
            drop(saved);
            let t = v.as_tensor().clone();
            (Some(v), t)
        } else {
            (None, saved)
        };
        let out = model.forward_blocks(&seg_in, seg.clone(), track)?;
        let surrogate = (out * grad.detach())?.sum_all()?;
        let mut store = surrogate.backward()?;
        drop(seg_in);
        acc.add_from_store(vars, &mut store)?;
        if let Some(v) = &input_var {
            grad = store.remove(v.as_tensor()).ok_or_else(|| {
                candle_core::Error::Msg("no gradient reached a segment input".into())
            })?;
        }
    }
    Ok(MicroResult {
        loss: loss_value,
        correct,
    })
}
