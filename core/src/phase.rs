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

impl std::str::FromStr for Phase {
    type Err = String;

    /// The spelling of [`Phase`]'s `Display` (as `batches.csv` and the tables write it).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [
            Phase::Forward,
            Phase::Backward,
            Phase::Optimizer,
            Phase::Eval,
            Phase::Other,
        ]
        .into_iter()
        .find(|p| p.to_string() == s)
        .ok_or_else(|| format!("not a phase: '{s}'"))
    }
}
