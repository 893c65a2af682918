//! Gradient accumulation: one gradient slot per parameter, summed over micro-batches.
//!
//! Each micro-batch's loss is scaled by 1/K before backward, so the sum of K micro-batch
//! gradients is the gradient of the mean loss over the whole batch.

use crate::error::Result;
use candle_core::{Tensor, Var};

/// Summed gradients, aligned with the model's parameter list.
pub struct GradAccumulator {
    grads: Vec<Option<Tensor>>,
}

impl GradAccumulator {
    /// Empty slots for `n` parameters.
    pub fn new(n: usize) -> Self {
        GradAccumulator {
            grads: vec![None; n],
        }
    }

    /// Add the gradient of parameter `i`.
    pub fn add(&mut self, i: usize, g: Tensor) -> Result<()> {
        // Gradients are computed by tensor ops on graph nodes and so carry a graph of their
        // own; detach so a stored gradient never keeps the step's activations alive.
        let g = g.detach();
        self.grads[i] = Some(match self.grads[i].take() {
            None => g,
            Some(acc) => (acc + g)?,
        });
        Ok(())
    }

    /// Take every gradient found in `store` for `vars`.
    pub fn add_from_store(
        &mut self,
        vars: &[Var],
        store: &mut candle_core::backprop::GradStore,
    ) -> Result<()> {
        for (i, v) in vars.iter().enumerate() {
            if let Some(g) = store.remove(v.as_tensor()) {
                self.add(i, g)?;
            }
        }
        Ok(())
    }

    /// The accumulated gradients (None for a parameter that got none).
    pub fn into_grads(self) -> Vec<Option<Tensor>> {
        self.grads
    }
}
