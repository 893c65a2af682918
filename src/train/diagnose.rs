//! What went wrong, and what to do: the out-of-memory report of a step that did not fit, and the
//! advice after a loss or gradient became non-finite, both true for the run at hand.

use super::Trainer;
use crate::error::{CoreError, Error};
use memtrain_core::memory::timeline::{StepTimeline, OOM_REPORT_FILE};
use serde::Serialize;

impl Trainer {
    /// An out-of-memory step's error with its advice; when the run writes reports, its report
    /// and memory snapshot are written and named.
    pub(super) fn report_oom(&mut self, e: Error, timeline: StepTimeline) -> Error {
        let e = self.advise_oom(e);
        if !self.files.oom_report {
            return e;
        }
        // After the JSON snapshot, which makes the run directory if need be.
        let e = self.write_oom_report(e, timeline.clone());
        self.write_oom_pickle(&timeline);
        e
    }

    /// Write [`OOM_REPORT_FILE`] for a step that ran out of memory and return the error
    /// naming it; when the report cannot be written, the error says so and stays as it was.
    pub(super) fn write_oom_report(&self, e: Error, timeline: StepTimeline) -> Error {
        let Error::Core(CoreError::OutOfMemory {
            limit,
            epoch,
            batch,
            phase,
            advice,
            report: None,
        }) = e
        else {
            return e;
        };
        let estimate = self.memory_estimate();
        let timeline = self.with_predictions(timeline, estimate.as_ref());
        let failed_at = match timeline.events.last() {
            Some(last) => format!(
                "{phase}; last event recorded: {} of {} (micro-batch {})",
                last.phase, last.layer, last.micro_batch
            ),
            None => format!("{phase}, before the first layer event"),
        };
        let path = self.files.run_dir.join(OOM_REPORT_FILE);
        let mut error = Error::Core(CoreError::OutOfMemory {
            limit,
            epoch,
            batch,
            phase,
            advice,
            report: None,
        });
        let report = OomReport {
            error: error.to_string(),
            failed_at,
            config: &self.config,
            heap_budget_bytes: self.watch.probe.limit(),
            timeline,
            estimate,
        };
        let written = crate::io::create_dir(&self.files.run_dir)
            .and_then(|()| crate::io::write_json_atomic(&path, &report));
        match written {
            Ok(()) => {
                if let Error::Core(CoreError::OutOfMemory { report, .. }) = &mut error {
                    *report = Some(path);
                }
            }
            Err(w) => eprintln!("warning: {} not written: {w}", OOM_REPORT_FILE),
        }
        error
    }

    /// `e` with the advice of an out-of-memory error filled in for this run's configuration
    /// and the phase that ran out (other errors unchanged).
    pub(super) fn advise_oom(&self, e: impl Into<Error>) -> Error {
        let mut e = e.into();
        if let Error::Core(CoreError::OutOfMemory { phase, advice, .. }) = &mut e {
            let in_update = phase.starts_with(&memtrain_core::phase::Phase::Optimizer.to_string());
            *advice = crate::advice::out_of_memory_with(
                &self.config,
                in_update,
                self.smaller_checkpointing(),
            );
        }
        e
    }

    /// A segmentation the estimate predicts to need less than this run's, for the advice.
    fn smaller_checkpointing(&self) -> Option<crate::advice::SmallerCheckpointing> {
        use crate::predict::{smaller_checkpointing, Baseline, DataSize, DeviceKind};
        let data = DataSize::loaded(&self.data.train, &self.data.eval, &self.config);
        smaller_checkpointing(
            &self.config,
            DeviceKind::of(self.model.device()),
            Baseline::Modeled(data),
        )
    }

    /// What to do after the loss or the gradients became non-finite, true for this run: a lower
    /// `--lr` always; f32 only for a half-precision run; clipping only when off; resuming only
    /// when a healthy snapshot (from before the loss blew up) exists: [`Trainer::fit`] moves
    /// the newer ones aside, so `--resume` takes it.
    pub(crate) fn divergence_advice(&self) -> String {
        let mut fixes = vec!["lower --lr".to_string()];
        if self.config.memory.precision != crate::config::Precision::F32 {
            fixes.push("use --precision f32".into());
        }
        if self.config.optimizer.clip_grad_norm.is_none() {
            let default = crate::config::TrainConfig::default()
                .optimizer
                .clip_grad_norm
                .unwrap_or(1.5);
            fixes.push(format!("clip the gradients (--clip-grad-norm {default})"));
        }
        let fixes = fixes.join(", or ");
        let newest = self
            .files
            .snapshots
            .last_step()
            .filter(|_| self.files.snapshots.enabled);
        let healthy = self
            .files
            .snapshots
            .last_healthy()
            .filter(|_| self.files.snapshots.enabled);
        let aside = if newest > healthy {
            format!(
                " (the snapshots after it, written while the loss was blowing up, are moved to {})",
                super::snapshot::snapshots_root(&self.files.run_dir)
                    .join(super::snapshot::DIVERGED_DIR)
                    .display()
            )
        } else {
            String::new()
        };
        match healthy {
            Some(step) => format!(
                "{fixes}; the snapshot from before the loss blew up (step {step}) is kept{aside}: \
                 resume it with --resume {} and such a change, or start again",
                self.files.run_dir.display()
            ),
            None if newest.is_some() => format!(
                "{fixes}, and start again (every snapshot was written while the loss was above \
                 {:.1}; they are moved to {})",
                super::snapshot::DIVERGED_LOSS,
                super::snapshot::snapshots_root(&self.files.run_dir)
                    .join(super::snapshot::DIVERGED_DIR)
                    .display()
            ),
            None => format!("{fixes}, and start again (no snapshot was saved before this)"),
        }
    }
}

/// What a run that stopped on out-of-memory leaves in its run directory
/// ([`OOM_REPORT_FILE`]), in the spirit of PyTorch's OOM observer and memory snapshot: the
/// failing step's events up to the failure, the configuration and its memory estimate.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct OomReport<'a> {
    /// The error, as printed.
    pub error: String,
    /// Where the step failed: the phase and the last layer event recorded.
    pub failed_at: String,
    /// The configuration that ran out of memory.
    pub config: &'a crate::config::TrainConfig,
    /// The heap budget the step ran against: on the CPU, `--memory-limit` less what the process
    /// holds outside its heap; on CUDA, the pool's limit.
    pub heap_budget_bytes: Option<u64>,
    /// The failing step up to the failure, with the estimate's prediction for each event.
    pub timeline: StepTimeline,
    /// The memory estimate of this configuration, when it could be made.
    pub estimate: Option<crate::predict::Estimate>,
}
