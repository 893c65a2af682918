//! [`Phase`]: where in a training step something happens. Core vocabulary of the step (the tape
//! reports its events with it), the memory timeline and the callbacks, so it depends on nothing.

use serde::{Deserialize, Serialize};

/// Where in the training step a peak happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Forward pass (activations being saved for backward).
    Forward,
    /// Backward pass (including checkpoint recomputation).
    Backward,
    /// Optimizer step (gradient unscale/check, parameter update).
    Optimizer,
    /// Evaluation after the epoch.
    Eval,
    /// Outside a step (setup, data loading between steps).
    Other,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
            Phase::Eval => "eval",
            Phase::Other => "other",
        })
    }
}
