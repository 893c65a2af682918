//! `summary.json`: the headline numbers of a run.

use serde::{Deserialize, Serialize};

/// The summary's file in a run directory.
pub const SUMMARY_FILE: &str = "summary.json";

/// How a run ended, as `summary.json` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    /// Every configured step trained and evaluated.
    #[default]
    Ok,
    /// Stopped by a signal or a stop request; `--resume` finishes it.
    Interrupted,
}

impl std::fmt::Display for RunStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RunStatus::Ok => "ok",
            RunStatus::Interrupted => "interrupted",
        })
    }
}

/// What a run measured. Written to `summary.json` and returned by [`crate::train::Trainer::fit`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Short label of the memory-relevant settings.
    pub label: String,
    /// Device name.
    pub device: String,
    /// Memory probe name (`cpu-heap`, `cuda-pool`, `unavailable`).
    pub probe: String,
    /// Whether the probe gave real readings.
    pub probe_available: bool,
    /// Trainable parameters.
    pub num_params: usize,
    /// Bytes of the f32 master parameters.
    pub param_bytes: u64,
    /// Highest bytes in use during the run (what the probe measures).
    pub peak_bytes: u64,
    /// Phase where the peak happened.
    pub peak_phase: Option<String>,
    /// Bytes in use when training began (data set, model, probe baseline).
    pub baseline_bytes: u64,
    /// Highest step peak (training steps only, evaluation excluded).
    pub step_peak_bytes: u64,
    /// Highest reserved bytes of the CUDA pool.
    pub reserved_peak_bytes: Option<u64>,
    /// What the OS sees beside the probe: process RSS (CPU) or device-wide use (CUDA, what
    /// nvidia-smi shows); see [`crate::memory::OsView::explain`].
    pub os_view: Option<crate::memory::OsView>,
    /// The OS view at the end of the run.
    pub os_current_bytes: Option<u64>,
    /// The OS view's high-water mark over the run (CPU: the kernel's VmHWM since start).
    pub os_peak_bytes: Option<u64>,
    /// The configured memory limit.
    pub memory_limit: Option<u64>,
    /// Predicted peak bytes from the analytic estimate.
    pub predicted_peak_bytes: Option<u64>,
    /// (predicted - measured) / measured, in percent.
    pub prediction_error_pct: Option<f64>,
    /// Training throughput over all steps, images per second (data waits included, evaluation excluded).
    pub images_per_sec: f64,
    /// Throughput of the steps after the first few (warm-up: kernel compilation, first
    /// allocations), images per second of step time; the figure to compare across frameworks.
    pub steady_images_per_sec: Option<f64>,
    /// Optimizer steps taken.
    pub steps: usize,
    /// Epochs completed.
    pub epochs_completed: usize,
    /// Training images processed.
    pub images: usize,
    /// Mean training loss of the last epoch.
    pub final_train_loss: Option<f64>,
    /// Top-1 accuracy on the evaluation split after the last epoch.
    pub final_test_accuracy: Option<f64>,
    /// Loss on the evaluation split after the last epoch.
    pub final_test_loss: Option<f64>,
    /// True when the evaluation split is a held-out part of the training files.
    pub eval_is_validation: bool,
    /// Final loss scale (f16).
    pub loss_scale: Option<f64>,
    /// Steps skipped by the loss scaler.
    pub skipped_steps: usize,
    /// How the run ended.
    pub status: RunStatus,
    /// Wall-clock seconds of the whole run.
    pub wall_secs: f64,
    /// Reached sparsity and model file sizes of a `--prune` run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pruning: Option<super::prune::PruneReport>,
    /// What a `--cuda-graph` run captured: kernels per step, replays, graph memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_graph: Option<super::graph::GraphStats>,
}
