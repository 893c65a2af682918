//! Gradient accumulation: one gradient slot per parameter, summed over micro-batches.
//!
//! Each micro-batch's loss is scaled by 1/K before backward, so the sum of K micro-batch
//! gradients is the gradient of the mean loss over the whole batch.

use crate::error::Result;
use candle_core::{CpuStorage, InplaceOp2, Layout, Tensor, Var};

/// `acc += g`, in place where the buffer is an f32 CPU tensor owned by the accumulator (the
/// common case); a new tensor otherwise.
fn add_into(acc: Tensor, g: &Tensor) -> Result<Tensor> {
    if acc.device().is_cpu() && acc.dtype() == candle_core::DType::F32 && acc.is_contiguous() {
        let g = g.to_dtype(candle_core::DType::F32)?.contiguous()?;
        if g.dims() == acc.dims() {
            acc.inplace_op2(&g, &AddAssign)?;
            return Ok(acc);
        }
    }
    Ok((acc + g)?)
}

/// `dst += src` for f32 CPU storages of the same shape.
struct AddAssign;

impl InplaceOp2 for AddAssign {
    fn name(&self) -> &'static str {
        "grad-add-assign"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        src: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<()> {
        let (Some((d0, d1)), Some((s0, s1))) = (dl.contiguous_offsets(), sl.contiguous_offsets())
        else {
            candle_core::bail!("grad-add-assign: operands must be contiguous")
        };
        match (dst, src) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) => {
                for (a, b) in d[d0..d1].iter_mut().zip(&s[s0..s1]) {
                    *a += b;
                }
                Ok(())
            }
            _ => candle_core::bail!("grad-add-assign: f32 only"),
        }
    }
}

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

    /// Add the gradient of parameter `i`: the first one is stored as it is (no zeros + add);
    /// later ones (micro-batches) are added into that buffer in place on the CPU.
    pub fn add(&mut self, i: usize, g: Tensor) -> Result<()> {
        // Gradients computed by autograd carry a graph of their own; detach so a stored
        // gradient never keeps the step's activations alive.
        let g = g.detach();
        self.grads[i] = Some(match self.grads[i].take() {
            None => g.contiguous()?,
            Some(acc) => add_into(acc, &g)?,
        });
        Ok(())
    }

    /// Bytes of the gradient buffers held now.
    pub fn bytes(&self) -> u64 {
        self.grads
            .iter()
            .flatten()
            .map(|g| (g.elem_count() * g.dtype().size_in_bytes()) as u64)
            .sum()
    }

    /// Take every gradient found in `store` for `vars`.
    pub(crate) fn add_from_store(
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
