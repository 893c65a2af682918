//! Gradients of a batch without a training step: the lean step and its autograd oracle on the
//! same micro-batches, precision and checkpointing, for the tests that compare them and for tools
//! such as `examples/codes_error.rs`. Nothing here updates a weight.

use super::Trainer;
use crate::error::Result;
use candle_core::Tensor;
use memtrain_core::step::accumulate::GradAccumulator;
use memtrain_core::step::ops::CandleOps;
use memtrain_core::step::tape::{LeanStep, NoObserver};
use memtrain_core::step::train;
use memtrain_core::step::{BatchInput, MicroResult};

impl Trainer {
    /// The batch `images`/`labels` on the host, for the micro-batch loop.
    fn host_batch<'a>(&'a self, images: &'a [f32], labels: &'a [u32]) -> BatchInput<'a> {
        BatchInput::Host {
            images,
            labels,
            device: self.model.device(),
        }
    }

    /// Gradients of the mean loss over a batch (f32, aligned with [`Trainer::vars`]), computed
    /// exactly as a training step would (micro-batches, precision, checkpointing) but without
    /// an optimizer step and without hooks. BatchNorm running statistics are updated as in a step.
    pub fn compute_grads(
        &self,
        images: &[f32],
        labels: &[u32],
    ) -> Result<(f64, Vec<Option<Tensor>>)> {
        if let Some(r) = self.cuda_graph.grads(self, images, labels, 1.0) {
            return r.map(|(loss, _, grads)| (loss, grads));
        }
        let batch = self.host_batch(images, labels);
        let k = self.config.steps.accum_steps;
        let micro_batch = |i| batch.micro_batch(i, k);
        let (r, grads) =
            train::gradients(&mut self.lean_step()?, k, 1.0, micro_batch, &mut NoObserver)?;
        Ok((r.loss, grads))
    }

    /// [`Trainer::compute_grads`] through Candle's autograd instead of the lean step: the oracle
    /// the lean step is tested against (same micro-batches, precision and checkpointing).
    pub fn reference_grads(
        &self,
        images: &[f32],
        labels: &[u32],
    ) -> Result<(f64, Vec<Option<Tensor>>)> {
        let mut acc = GradAccumulator::new(self.model.param_count());
        let batch = self.host_batch(images, labels);
        let k = self.config.steps.accum_steps;
        let mut results = Vec::with_capacity(k);
        for i in 0..k {
            let (x, y) = batch.micro_batch(i, k)?;
            results.push(memtrain_core::step::oracle::forward_backward(
                &self.model,
                &self.model.vars(),
                &x,
                &y,
                self.config.memory.precision.compute_dtype(),
                self.segmentation()?,
                1.0 / k as f64,
                &mut acc,
            )?);
        }
        Ok((MicroResult::mean(&results).loss, acc.into_grads()))
    }

    /// The lean step of one micro-batch, in the run's precision and gradient-checkpointing segments.
    fn lean_step(&self) -> Result<LeanStep<CandleOps<'_>>> {
        Ok(LeanStep::new(
            &self.model,
            self.config.memory.precision.compute_dtype(),
            self.model.segments(self.segmentation()?),
            self.storage()?,
        ))
    }
}
