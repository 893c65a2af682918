//! The core's one error type.
//!
//! Every variant renders as a single line that says what went wrong and, where there is one,
//! what to do about it; the examples print it and exit non-zero, never panic.

use std::path::PathBuf;

/// Everything that can go wrong in the model, the step and the memory probes.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A flag or config value is invalid (usage error, exit code 2).
    #[error("{0}")]
    Config(String),

    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file that could not be read or written.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A training step needed more memory than the configured limit allows.
    // Batches and epochs are numbered from 1 in messages, as on the screen and in the files.
    #[error(
        "out of memory: {phase} of batch {} (epoch {}) needed more than the {limit} limit; \
         {advice}{}",
        .batch + 1,
        .epoch + 1,
        .report.as_ref().map(|p| format!(" (report: {})", p.display())).unwrap_or_default()
    )]
    OutOfMemory {
        /// The limit, human readable (e.g. "2.00 GiB").
        limit: String,
        /// Epoch index (0-based).
        epoch: usize,
        /// Batch index within the epoch (0-based).
        batch: usize,
        /// Phase of the step: forward, backward or optimizer (with the layer, when known).
        phase: String,
        /// What to do, true for the run at hand.
        advice: String,
        /// The [`crate::memory::timeline::OOM_REPORT_FILE`] written for this failure.
        report: Option<PathBuf>,
    },

    /// A training step predicted to need more memory than `--memory-limit`, refused before
    /// anything ran (usage error, exit code 2; sweeps record it as an out-of-memory point).
    #[error("out of memory (predicted; nothing was run): {0}")]
    WontFit(String),

    /// The requested device cannot be used.
    #[error("{0}")]
    Device(String),

    /// Named tensors handed to the model or the optimizer do not match it (a training state
    /// that was saved by another configuration).
    #[error("training state: {0}")]
    State(String),

    /// An observer of the step's layer events ([`crate::step::tape::StepObserver`]) stopped the
    /// step; the observer keeps its own error to report.
    #[error("stopped by an observer of the step: {0}")]
    Stopped(String),

    /// The loss or a gradient became NaN/inf where no loss scaler can recover; the trainer
    /// names the step and what to do.
    #[error("non-finite {what} ({phase})")]
    NonFinite {
        /// What was non-finite: "loss" or "gradient".
        what: &'static str,
        /// Phase of the step.
        phase: crate::phase::Phase,
    },

    /// An error inside Candle.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

impl Error {
    /// Shorthand for a [`Error::Config`].
    pub fn config(msg: impl Into<String>) -> Self {
        Error::Config(msg.into())
    }

    /// Shorthand for a [`Error::Io`].
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// The process exit code this error maps to: 2 for usage errors, 1 for runtime errors.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Config(_) | Error::WontFit(_) => 2,
            _ => 1,
        }
    }

    /// True when the error is an out-of-memory condition (a recorded sweep result, not a failure).
    pub fn is_oom(&self) -> bool {
        matches!(self, Error::OutOfMemory { .. })
    }
}

/// Result alias used across the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;
