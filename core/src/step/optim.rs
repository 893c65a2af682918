//! Optimizers on f32 master weights, and the one-cycle learning-rate schedule.
//!
//! Written here rather than taken from candle-nn because candle-nn's SGD has no momentum, and a
//! resumable run needs the optimizer state (momentum buffers, Adam moments) as named tensors.

use super::ops::StepOps;
use crate::error::{Error, Result};
use crate::options::OptimizerKind;
use candle_core::Tensor;

/// An optimizer with its per-parameter state: tensors for training, sizes for the estimate,
/// which runs [`Optimizer::step`] on the same ops.
pub struct Optimizer<T = Tensor> {
    kind: OptimizerKind,
    momentum: f64,
    weight_decay: f64,
    beta2: f64,
    eps: f64,
    /// Steps applied so far (Adam bias correction).
    pub steps: usize,
    /// First state slot per parameter: SGD momentum buffer or Adam first moment.
    state1: Vec<Option<T>>,
    /// Second state slot per parameter: Adam second moment.
    state2: Vec<Option<T>>,
}

impl<T: Clone> Optimizer<T> {
    /// SGD with Nesterov momentum and coupled weight decay (PyTorch's `SGD(nesterov=True)`), or
    /// AdamW with beta1 = `momentum`, beta2 = 0.999 and decoupled weight decay.
    pub fn new(kind: OptimizerKind, n_params: usize, momentum: f64, weight_decay: f64) -> Self {
        Optimizer {
            kind,
            momentum,
            weight_decay,
            beta2: 0.999,
            eps: 1e-8,
            steps: 0,
            state1: vec![None; n_params],
            state2: vec![None; n_params],
        }
    }

    /// Apply one update with learning rate `lr` to the parameters of `o`; `grads` are f32, one
    /// per parameter. Parameters without a gradient are left unchanged. One parameter at a
    /// time: its temporaries are freed before the next one's are made.
    pub fn step<O: StepOps<T = T>>(&mut self, o: &O, grads: &[Option<T>], lr: f64) -> Result<()> {
        if grads.len() != self.state1.len() {
            return Err(Error::State(format!(
                "optimizer has state for {} parameters but got {} gradients",
                self.state1.len(),
                grads.len()
            )));
        }
        self.steps += 1;
        let (m, wd) = (self.momentum, self.weight_decay);
        for (i, g) in grads.iter().enumerate() {
            let Some(g) = g else { continue };
            let w = &o.param(i);
            // Each temporary is dropped where Candle's operators would consume it, so that no
            // more parameter-sized buffers are alive at once than the update needs.
            let new = match self.kind {
                OptimizerKind::Sgd => {
                    let g = if wd > 0.0 {
                        o.add(g, &o.affine(w, wd, 0.0)?)?
                    } else {
                        g.clone()
                    };
                    let buf = match self.state1[i].take() {
                        Some(b) => {
                            let bm = o.affine(&b, m, 0.0)?;
                            drop(b);
                            o.add(&bm, &g)?
                        }
                        None => g.clone(),
                    };
                    let d = o.add(&g, &o.affine(&buf, m, 0.0)?)?;
                    drop(g);
                    self.state1[i] = Some(buf);
                    let step = o.affine(&d, lr, 0.0)?;
                    drop(d);
                    o.sub(w, &step)?
                }
                OptimizerKind::Adamw => {
                    let b2 = self.beta2;
                    let m1 = match self.state1[i].take() {
                        Some(s) => {
                            let sm = o.affine(&s, m, 0.0)?;
                            drop(s);
                            o.add(&sm, &o.affine(g, 1.0 - m, 0.0)?)?
                        }
                        None => o.affine(g, 1.0 - m, 0.0)?,
                    };
                    let g2 = || -> Result<T> { o.affine(&o.sqr(g)?, 1.0 - b2, 0.0) };
                    let v = match self.state2[i].take() {
                        Some(s) => {
                            let sb = o.affine(&s, b2, 0.0)?;
                            drop(s);
                            o.add(&sb, &g2()?)?
                        }
                        None => g2()?,
                    };
                    let t = self.steps as i32;
                    let mhat = o.affine(&m1, 1.0 / (1.0 - m.powi(t)), 0.0)?;
                    let vhat = o.affine(&v, 1.0 / (1.0 - b2.powi(t)), 0.0)?;
                    let upd = {
                        let den = o.affine(&o.sqrt(&vhat)?, 1.0, self.eps)?;
                        let u = o.div(&mhat, &den)?;
                        drop(mhat);
                        u
                    };
                    self.state1[i] = Some(m1);
                    self.state2[i] = Some(v);
                    let decayed = o.affine(w, 1.0 - lr * wd, 0.0)?;
                    let step = o.affine(&upd, lr, 0.0)?;
                    drop(upd);
                    o.sub(&decayed, &step)?
                }
            };
            o.set_param(i, &new)?;
        }
        Ok(())
    }
}

impl Optimizer {
    /// Zero the state of parameter `index` where `mask` (u8, the parameter's shape) is 0, so a
    /// pruned weight carries no momentum (or Adam moments) into later steps (magnitude pruning).
    pub fn mask_state(&mut self, index: usize, mask: &Tensor) -> Result<()> {
        for slot in [&mut self.state1, &mut self.state2] {
            if let Some(s) = slot.get_mut(index).and_then(Option::as_mut) {
                *s = mask.where_cond(s, &s.zeros_like()?)?;
            }
        }
        Ok(())
    }

    /// Bytes of the state tensors held now.
    pub fn state_bytes(&self) -> u64 {
        self.state1
            .iter()
            .chain(&self.state2)
            .flatten()
            .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            .sum()
    }

    /// The state as named tensors (for checkpoints): `s1.<i>`, `s2.<i>`.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (slot, v) in [("s1", &self.state1), ("s2", &self.state2)] {
            for (i, t) in v.iter().enumerate() {
                if let Some(t) = t {
                    out.push((format!("{slot}.{i}"), t.clone()));
                }
            }
        }
        out
    }

    /// Restore state saved by [`Optimizer::state`] (`steps` is restored separately).
    pub fn load_state(&mut self, named: Vec<(String, Tensor)>) -> Result<()> {
        for (name, t) in named {
            let bad = || Error::State(format!("unknown optimizer state '{name}'"));
            let (slot, idx) = name.split_once('.').ok_or_else(bad)?;
            let idx: usize = idx.parse().map_err(|_| bad())?;
            let vec = match slot {
                "s1" => &mut self.state1,
                "s2" => &mut self.state2,
                _ => return Err(bad()),
            };
            *vec.get_mut(idx).ok_or_else(bad)? = Some(t);
        }
        Ok(())
    }
}

/// The fewest steps the warm-up takes from peak/25 to the peak: a freshly initialized network
/// (its head reads 2,048 features) blows up under a faster rise (measured in
/// docs/results/first-run.md).
pub const MIN_WARMUP_STEPS: f64 = 25.0;

/// One-cycle learning rate at optimizer step `step` of `total`: linear warm-up from peak/25 over
/// the first `warmup_frac` of the steps, then linear decay towards 0. The warm-up rises at most as
/// fast as over [`MIN_WARMUP_STEPS`], so a run of fewer than `MIN_WARMUP_STEPS / warmup_frac`
/// steps tops out below `peak`; longer runs reach it.
pub fn one_cycle_lr(step: usize, total: usize, peak: f64, warmup_frac: f64) -> f64 {
    let total = total.max(1) as f64;
    let warm = (total * warmup_frac).max(1.0);
    let s = step as f64;
    let start = peak / 25.0;
    let ramp = |s: f64| start + (peak - start) * s / warm.max(MIN_WARMUP_STEPS);
    if s < warm {
        ramp(s)
    } else {
        let top = if warm >= MIN_WARMUP_STEPS {
            peak
        } else {
            ramp(warm)
        };
        let rest = (total - warm).max(1.0);
        (top * (1.0 - (s - warm) / rest)).max(peak * 1e-4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The schedule before the warm-up had a least length, for the runs it still gives.
    fn one_cycle_without_floor(step: usize, total: usize, peak: f64, warmup_frac: f64) -> f64 {
        let total = total.max(1) as f64;
        let warm = (total * warmup_frac).max(1.0);
        let (s, start) = (step as f64, peak / 25.0);
        if s < warm {
            start + (peak - start) * s / warm
        } else {
            (peak * (1.0 - (s - warm) / (total - warm).max(1.0))).max(peak * 1e-4)
        }
    }

    #[test]
    fn long_runs_keep_their_schedule_bit_for_bit() {
        for total in [100, 131, 640, 10_000] {
            for step in 0..total {
                assert_eq!(
                    one_cycle_lr(step, total, 0.2, 0.25).to_bits(),
                    one_cycle_without_floor(step, total, 0.2, 0.25).to_bits(),
                    "step {step} of {total}"
                );
            }
        }
    }

    #[test]
    fn short_runs_warm_up_no_faster_than_the_floor_and_still_anneal() {
        for total in [1, 2, 8, 32, 99] {
            let lr: Vec<f64> = (0..total)
                .map(|s| one_cycle_lr(s, total, 0.2, 0.25))
                .collect();
            let top = lr.iter().cloned().fold(0.0, f64::max);
            let warm = (total as f64 * 0.25).max(1.0);
            assert!(
                top <= 0.008 + 0.192 * warm / MIN_WARMUP_STEPS + 1e-12,
                "{total}: {lr:?}"
            );
            for w in lr.windows(2) {
                assert!(
                    w[1] - w[0] <= 0.192 / MIN_WARMUP_STEPS + 1e-12,
                    "{total}: {lr:?}"
                );
            }
            if total > 2 {
                assert!(lr[total - 1] < top, "{total} anneals: {lr:?}");
            }
        }
    }
}
