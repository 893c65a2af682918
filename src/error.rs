//! The application's one error type: the core's errors ([`CoreError`]: configuration, I/O, memory,
//! devices, Candle) and what only the application raises (data files, snapshots on disk,
//! divergence, interruption, child processes).
//!
//! Every variant renders as a single line that says what went wrong and, where there is one,
//! what to do about it; the examples print it and exit non-zero, never panic.

use std::path::PathBuf;

pub use memtrain_core::error::Error as CoreError;

/// Everything that can go wrong in memtrain.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error of the model, the step or the memory probes.
    #[error(transparent)]
    Core(#[from] CoreError),

    /// A dataset file or directory is missing or malformed.
    #[error("{path}: {msg}")]
    Data {
        /// The offending file or directory.
        path: PathBuf,
        /// What is wrong and how to fix it (names the byte offset where relevant).
        msg: String,
    },

    /// The loss or a gradient became NaN/inf where no loss scaler can recover.
    #[error("non-finite {what} at epoch {}, batch {} ({phase}); {advice}", .epoch + 1, .batch + 1)]
    NonFinite {
        /// What was non-finite ("loss", "gradient").
        what: String,
        /// Epoch index (0-based).
        epoch: usize,
        /// Batch index within the epoch (0-based).
        batch: usize,
        /// Phase of the step.
        phase: String,
        /// What to do, true for the run at hand.
        advice: String,
    },

    /// Saving or loading a snapshot of the training state (save/resume) failed.
    #[error("snapshot: {0}")]
    Snapshot(String),

    /// Training was interrupted by a signal (SIGINT/SIGTERM) after a snapshot was written.
    #[error("interrupted: {0}")]
    Interrupted(String),

    /// A child process of a sweep or comparison could not be run or reported nonsense.
    #[error("{0}")]
    Child(String),

    /// An I/O error without a file to name (a callback's own output, a pipe): `?` in a callback.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Core(e.into())
    }
}

impl Error {
    /// A flag or config value is invalid ([`CoreError::Config`]).
    pub fn config(msg: impl Into<String>) -> Self {
        Error::Core(CoreError::config(msg))
    }

    /// Reading or writing `path` failed ([`CoreError::Io`]).
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Core(CoreError::io(path, source))
    }

    /// The process exit code this error maps to: 2 for usage errors, 1 for runtime errors,
    /// 130 for an interruption.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Core(e) => e.exit_code(),
            Error::Interrupted(_) => 130,
            _ => 1,
        }
    }

    /// True when the error is an out-of-memory condition (a recorded sweep result, not a failure).
    pub fn is_oom(&self) -> bool {
        matches!(self, Error::Core(e) if e.is_oom())
    }
}

/// Result alias used across the application.
pub type Result<T, E = Error> = std::result::Result<T, E>;
