//! Mixed precision, in one place: the dtype the forward and backward compute in
//! ([`Precision::compute_dtype`]; the tape casts the f32 master weights to it, and the head runs
//! in f32), and for f16 the dynamic loss scaler (the step unscales the gradients:
//! [`super::train::update`]).
//!
//! f16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Scaling the loss by S scales
//! every gradient by S, keeping small gradients representable; the optimizer sees the
//! gradients divided by S again (in f32). When a gradient overflows to inf/NaN the step is
//! skipped and S halved; after `growth_interval` finite steps in a row S doubles.
//! bf16 has f32's exponent range and needs no scaler.

use crate::options::Precision;
use candle_core::DType;
use serde::{Deserialize, Serialize};

impl Precision {
    /// The Candle dtype the forward and backward compute in (master weights stay f32).
    pub fn compute_dtype(&self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::F16 => DType::F16,
            Precision::Bf16 => DType::BF16,
        }
    }
}

/// Dynamic loss scaler (the scheme of PyTorch's `GradScaler` and NVIDIA Apex).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// Current scale S.
    pub scale: f64,
    /// Factor applied on growth (2).
    pub growth_factor: f64,
    /// Factor applied on overflow (0.5).
    pub backoff_factor: f64,
    /// Finite steps in a row needed before growing.
    pub growth_interval: usize,
    /// Finite steps since the last growth or overflow.
    pub good_steps: usize,
    /// Steps skipped so far.
    pub skipped_steps: usize,
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            good_steps: 0,
            skipped_steps: 0,
        }
    }
}

impl LossScaler {
    /// A scaler for `precision`: Some for f16, None otherwise.
    pub fn for_precision(precision: Precision) -> Option<Self> {
        (precision == Precision::F16).then(LossScaler::default)
    }

    /// Record the outcome of a step. Returns true when the optimizer step should be applied
    /// (gradients finite), false when it must be skipped.
    pub fn update(&mut self, grads_finite: bool) -> bool {
        if grads_finite {
            self.good_steps += 1;
            if self.good_steps >= self.growth_interval {
                self.scale *= self.growth_factor;
                self.good_steps = 0;
            }
            true
        } else {
            self.scale = (self.scale * self.backoff_factor).max(f64::MIN_POSITIVE);
            self.good_steps = 0;
            self.skipped_steps += 1;
            false
        }
    }
}
