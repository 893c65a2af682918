//! The whole training step, once: every micro-batch's forward and backward on the tape into one
//! set of f32 gradients, then the update — unscale (f16), the global norm, clipping, the loss
//! scaler's verdict and the optimizer.
//!
//! Generic over the ops ([`StepOps`]): the trainer runs it on Candle tensors, the memory estimate
//! on sizes, so the estimate follows the step's order of work by running it. The trainer's
//! concerns (memory readings, the timeline, the budget, callbacks) see the step through its
//! observer ([`StepObserver`]); what comes after a step (pruning, snapshots) is the caller's.

use super::micro::MicroResult;
use super::ops::StepOps;
use super::optim::Optimizer;
use super::precision::LossScaler;
use super::tape::{LeanStep, StepObserver};
use crate::error::{Error, Result};
use crate::phase::Phase;

/// What the update carries from step to step: the optimizer with its state, and f16's loss scaler.
pub struct Updater<T = candle_core::Tensor> {
    /// The optimizer and its per-parameter state.
    pub optimizer: Optimizer<T>,
    /// The dynamic loss scaler (f16 only).
    pub scaler: Option<LossScaler>,
}

/// What one step runs with besides the model and its state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepSettings {
    /// Micro-batches the batch is split into (gradient accumulation).
    pub accum_steps: usize,
    /// The learning rate of this step.
    pub lr: f64,
    /// Clip the gradients' global L2 norm to this (None: no clipping in this step).
    pub clip_grad_norm: Option<f64>,
}

/// What the update did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Update {
    /// The loss scaler skipped the update (a gradient overflowed in f16).
    pub skipped: bool,
    /// The gradients' global L2 norm before clipping.
    pub grad_norm: f64,
}

/// One optimizer step on a batch of `settings.accum_steps` micro-batches, each made by
/// `micro_batch(index)` (images f32 `[N/K, 3, 32, 32]` and labels u32 `[N/K]`) when its turn
/// comes: the batch's mean loss and correct count, and what the update did.
///
/// # Errors
/// A non-finite loss or gradient without a loss scaler ([`Error::NonFinite`]), a failed op, or
/// an observer's stop.
pub fn train_step<O: StepOps>(
    lean: &mut LeanStep<O>,
    updater: &mut Updater<O::T>,
    settings: StepSettings,
    micro_batch: impl FnMut(usize) -> Result<(O::T, O::T)>,
    obs: &mut dyn StepObserver,
) -> Result<(MicroResult, Update)> {
    let loss_scale = updater.scaler.as_ref().map_or(1.0, |s| s.scale);
    let (r, grads) = gradients(lean, settings.accum_steps, loss_scale, micro_batch, obs)?;
    let update = update(lean.ops(), r.loss, grads, updater, settings)?;
    Ok((r, update))
}

/// Gradient accumulation: the forward and backward of each of the `k` micro-batches, the loss
/// multiplied by `loss_scale / k`, summed into one f32 gradient per parameter (still scaled).
/// A micro-batch's tensors are dropped before the next one is made.
pub fn gradients<O: StepOps>(
    lean: &mut LeanStep<O>,
    k: usize,
    loss_scale: f64,
    mut micro_batch: impl FnMut(usize) -> Result<(O::T, O::T)>,
    obs: &mut dyn StepObserver,
) -> Result<(MicroResult, Vec<Option<O::T>>)> {
    let loss_mult = loss_scale / k as f64;
    let mut grads = lean.ops().new_grads();
    let mut results = Vec::with_capacity(k);
    for index in 0..k {
        let (x, y) = micro_batch(index)?;
        let (head, tape) = lean.forward(x, &y, loss_mult, &grads, obs)?;
        obs.phase_end(index, Phase::Forward)?;
        lean.backward(tape, &mut grads, obs)?;
        obs.phase_end(index, Phase::Backward)?;
        results.push(lean.ops().read_head(&head)?);
    }
    Ok((MicroResult::mean(&results), lean.ops().grad_list(grads)))
}

/// The update from a batch's mean `loss` and gradients (scaled by the loss scale in f16):
/// unscale, the global norm, clipping by it (PyTorch's `clip_grad_norm_`: the whole step shrinks,
/// its direction is kept), the loss scaler's verdict, the optimizer. The gradients are freed
/// when it returns.
///
/// # Errors
/// A non-finite loss or gradient without a loss scaler ([`Error::NonFinite`]), or a failed op.
pub fn update<O: StepOps>(
    o: &O,
    loss: f64,
    grads: Vec<Option<O::T>>,
    updater: &mut Updater<O::T>,
    settings: StepSettings,
) -> Result<Update> {
    if !loss.is_finite() && updater.scaler.is_none() {
        return Err(Error::NonFinite {
            what: "loss",
            phase: Phase::Forward,
        });
    }
    let scale_each = |grads: Vec<Option<O::T>>, f: f64| -> Result<Vec<Option<O::T>>> {
        grads
            .into_iter()
            .map(|g| g.map(|g| o.affine(&g, f, 0.0)).transpose())
            .collect()
    };
    let grads = match &updater.scaler {
        Some(s) => scale_each(grads, 1.0 / s.scale)?,
        None => grads,
    };
    let mut squared = 0f64;
    for g in grads.iter().flatten() {
        squared += o.sum_squares(g)?;
    }
    let finite = squared.is_finite();
    let grads = match settings.clip_grad_norm {
        Some(max) if finite && squared.sqrt() > max => scale_each(grads, max / squared.sqrt())?,
        _ => grads,
    };
    let apply = match &mut updater.scaler {
        Some(s) => s.update(finite),
        None if !finite => {
            return Err(Error::NonFinite {
                what: "gradient",
                phase: Phase::Backward,
            })
        }
        None => true,
    };
    if apply {
        updater.optimizer.step(o, &grads, settings.lr)?;
    }
    Ok(Update {
        skipped: !apply,
        grad_norm: squared.sqrt(),
    })
}
