//! `summary.json`: the headline numbers of a run.

use super::Trainer;
use crate::callbacks::EpochStats;
use crate::error::Result;
use memtrain_core::device::device_name;
use serde::{Deserialize, Serialize};

/// The summary's file in a run directory.
pub(crate) const SUMMARY_FILE: &str = "summary.json";

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
///
/// The fields are grouped by concern in flattened structs ([`MemorySummary`], …): `summary.json`
/// is one flat object all the same, its keys in the order of the fields.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Short label of the memory-relevant settings.
    pub label: String,
    /// Device name.
    pub device: String,
    /// Memory measured.
    #[serde(flatten)]
    pub memory: MemorySummary,
    /// What the memory optimizations did.
    #[serde(flatten)]
    pub optimizations: OptimizationSummary,
    /// The estimate against the measurement.
    #[serde(flatten)]
    pub estimate: EstimateSummary,
    /// Speed and progress.
    #[serde(flatten)]
    pub progress: ProgressSummary,
    /// How well the model learned.
    #[serde(flatten)]
    pub quality: QualitySummary,
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
    /// Where an eager CUDA run's steady steps spent their GPU time, convolution pass by pass,
    /// most first ([`super::gpu_time`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_passes: Option<Vec<super::gpu_time::GpuPass>>,
}

/// What the memory probe measured, with the parameters' size and the limit the run had.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MemorySummary {
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
    /// nvidia-smi shows); see [`memtrain_core::memory::OsView::explain`].
    pub os_view: Option<memtrain_core::memory::OsView>,
    /// The OS view at the end of the run.
    pub os_current_bytes: Option<u64>,
    /// The OS view's high-water mark over the run (CPU: the kernel's VmHWM since start).
    pub os_peak_bytes: Option<u64>,
    /// The configured memory limit (`--memory-limit`), in bytes (on the CPU: the process's
    /// resident memory, as the kernel counts it).
    #[serde(alias = "memory_limit")]
    pub memory_limit_bytes: Option<u64>,
    /// The heap budget under `memory_limit_bytes` on the CPU: the limit less what the process
    /// holds outside its heap ([`memtrain_core::memory::os::RssReserve`]); the trainer checks the heap
    /// against it after every layer, and the resident memory against the limit.
    #[serde(default)]
    pub heap_budget_bytes: Option<u64>,
}

/// What the memory optimizations did in the run: the checkpointed segments, their recomputation
/// and how the conv outputs were kept.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OptimizationSummary {
    /// Gradient checkpointing's segments the run trained with, as `[start, end)` block ranges
    /// (one segment: nothing recomputed; `--checkpoint auto` resolved).
    #[serde(default)]
    pub checkpoint_segments: Vec<[usize; 2]>,
    /// FLOPs the backward recomputes per optimizer step (the convolutions of every segment but
    /// the last; `crate::predict::checkpointing::recompute_flops`).
    #[serde(default)]
    pub recompute_flops: u64,
    /// True when the run's gradients are not the exact step's: `--compress-activations int8`
    /// kept the blocks' conv outputs as 8-bit codes in any of its steps (a resumed run counts
    /// the steps of every process).
    #[serde(default)]
    pub lossy: bool,
    /// How each span of steps kept the conv outputs (`--compress-activations` may change on
    /// `--resume`).
    #[serde(default)]
    pub activation_storage: Vec<crate::config::StorageSpan>,
}

/// The analytic estimate (src/predict/) against the measured peaks.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EstimateSummary {
    /// Predicted peak bytes of a training step, from the analytic estimate.
    pub predicted_peak_bytes: Option<u64>,
    /// Predicted peak bytes of the evaluation after an epoch (the tape's eval-mode forward on
    /// sizes); `None` without evaluation or without an estimate.
    #[serde(default)]
    pub predicted_eval_peak_bytes: Option<u64>,
    /// Measured peak bytes of the evaluations, the highest over the epochs evaluated; `None`
    /// when none was.
    #[serde(default)]
    pub eval_peak_bytes: Option<u64>,
    /// What each memory optimization alone and all together would make of the predicted peak
    /// ([`crate::predict::what_if()`]); `None` where there is no estimate (no memory probe).
    #[serde(default)]
    pub what_if: Option<Vec<crate::predict::WhatIf>>,
    /// (predicted − measured) / measured, in percent, against the measured step peak
    /// (`step_peak_bytes`), which is what the estimate predicts; the run's peak can also fall
    /// while the data loads or during evaluation.
    pub prediction_error_pct: Option<f64>,
}

/// How fast the run trained and how far it got.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProgressSummary {
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
}

/// How well the model learned: the final losses and accuracy, and what they were evaluated on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QualitySummary {
    /// Mean training loss of the last epoch.
    pub final_train_loss: Option<f64>,
    /// Top-1 accuracy on the evaluation split after the last epoch.
    pub final_test_accuracy: Option<f64>,
    /// Loss on the evaluation split after the last epoch.
    pub final_test_loss: Option<f64>,
    /// True when the evaluation split is a held-out part of the training files.
    pub eval_is_validation: bool,
    /// Images the accuracy and loss were evaluated on.
    #[serde(default)]
    pub eval_images: usize,
}

impl Trainer {
    /// The summary of the whole run: `epochs` (the ended ones first, `ended` of them) and the
    /// history's totals.
    pub(super) fn summary(
        &self,
        epochs: &[EpochStats],
        ended: usize,
        interrupted: bool,
        wall: f64,
        pruning: Option<super::prune::PruneReport>,
    ) -> Result<Summary> {
        let (segmentation, storage) = (self.segmentation()?, self.storage()?);
        let mem = self.memory_log();
        let os = self.watch.probe.os_memory();
        let estimate = if self.watch.probe.available() {
            self.memory_estimate()
        } else {
            None
        };
        let predicted = estimate.as_ref().map(|e| e.peak);
        let last = epochs.last();
        let step_peak = mem.step_peak_bytes;
        let lossy_steps = self.position.history.lossy_steps();
        let lossy = storage.is_lossy() || !lossy_steps.is_empty();
        let mut label = self.config.label();
        if lossy && !storage.is_lossy() {
            // Exact now, lossy before a resume: the run is not the exact step's.
            label.push_str(&format!(" (lossy: {lossy_steps})"));
        }
        Ok(Summary {
            label,
            device: device_name(self.model.device()),
            memory: MemorySummary {
                probe: self.watch.probe.name().to_string(),
                probe_available: self.watch.probe.available(),
                num_params: self.model.num_params(),
                param_bytes: self.model.num_params() as u64 * 4,
                peak_bytes: mem.peak_bytes,
                peak_phase: mem.peak_phase.map(|p| p.to_string()),
                baseline_bytes: mem.baseline_bytes,
                step_peak_bytes: step_peak,
                reserved_peak_bytes: mem.reserved_peak_bytes,
                os_view: self.watch.probe.os_view(),
                os_current_bytes: os.map(|o| o.current),
                os_peak_bytes: os.map(|o| o.peak).max(mem.os_peak_bytes),
                memory_limit_bytes: self.config.memory.memory_limit,
                heap_budget_bytes: self.watch.probe.os_limit().and(self.watch.probe.limit()),
            },
            optimizations: OptimizationSummary {
                checkpoint_segments: self
                    .model
                    .segments(segmentation)
                    .iter()
                    .map(|r| [r.start, r.end])
                    .collect(),
                recompute_flops: crate::predict::checkpointing::recompute_flops(
                    self.config.model,
                    segmentation,
                    self.config.steps.batch_size,
                ),
                lossy,
                activation_storage: self.position.history.activation_storage.clone(),
            },
            estimate: EstimateSummary {
                // The analytic estimate (src/predict/) against the measured peak.
                predicted_peak_bytes: predicted,
                predicted_eval_peak_bytes: estimate.as_ref().and_then(|e| e.eval_peak),
                eval_peak_bytes: mem.epochs.iter().filter_map(|e| e.eval_peak_bytes).max(),
                what_if: predicted.and_then(|_| self.what_if()),
                prediction_error_pct: predicted.and_then(|p| prediction_error(p, step_peak)),
            },
            progress: ProgressSummary {
                images_per_sec: self.position.history.images as f64
                    / self.position.history.train_secs.max(1e-9),
                steady_images_per_sec: self.position.history.step_times.steady(),
                steps: self.position.global_step,
                epochs_completed: ended,
                images: self.position.history.images,
            },
            quality: QualitySummary {
                final_train_loss: last.map(|e| e.train_loss),
                final_test_accuracy: last.and_then(|e| e.eval_accuracy),
                final_test_loss: last.and_then(|e| e.eval_loss),
                eval_is_validation: self.data.eval_is_validation,
                eval_images: self.data.eval.len(),
            },
            loss_scale: self.updater.scaler.as_ref().map(|s| s.scale),
            skipped_steps: self.updater.scaler.as_ref().map_or(0, |s| s.skipped_steps),
            status: if interrupted {
                RunStatus::Interrupted
            } else {
                RunStatus::Ok
            },
            wall_secs: wall,
            pruning,
            cuda_graph: self.cuda_graph.stats(),
            gpu_passes: self.watch.gpu_passes.rows(),
        })
    }
}

impl Trainer {
    /// The what-if rows of this run's configuration, data and device
    /// ([`crate::predict::what_if()`]); `None` when they cannot be estimated.
    pub fn what_if(&self) -> Option<Vec<crate::predict::WhatIf>> {
        use crate::predict::{Baseline, DataSize, DeviceKind};
        let data = DataSize::loaded(&self.data.train, &self.data.eval, &self.config);
        crate::predict::what_if(
            &self.config,
            DeviceKind::of(self.model.device()),
            Baseline::Modeled(data),
        )
        .ok()
    }
}

/// `(predicted - measured) / measured` in percent; `None` without a measurement.
fn prediction_error(predicted: u64, measured: u64) -> Option<f64> {
    (measured > 0).then(|| (predicted as f64 - measured as f64) / measured as f64 * 100.0)
}
