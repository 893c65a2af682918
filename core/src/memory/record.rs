//! The memory record of a run: per step and per epoch, current and peak memory and the phase of
//! each peak ([`MemoryLog`]), taken by the trainer's [`MemoryRecorder`].
//!
//! The probe has one resettable watermark. To attribute peaks to phases the recorder reads and
//! resets it at every phase boundary of the training loop ("folding" the reading into the step,
//! epoch and run maxima), so an epoch or run peak is never lost by a step-level reset: peaks
//! nest. The trainer owns the recorder and hands its log to the callbacks in their contexts, so
//! every callback sees the same readings and nothing is shared behind a lock.

use super::{format_bytes, MemoryProbe, OsMemory, OsView};
use crate::phase::Phase;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Memory of one optimizer step. Epochs and steps are numbered from 1, as the screen shows them
/// (logs of older versions, numbered from 0, are renumbered when read: [`MemoryLog::numbered`]);
/// renamed keys are read under their old names too.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BatchMemory {
    /// Epoch number (the first is 1).
    pub epoch: usize,
    /// The step's batch number within the epoch (the first is 1).
    pub batch: usize,
    /// Step number in the run (the first is 1).
    pub global_step: usize,
    /// Bytes in use when the step began.
    pub start_bytes: u64,
    /// Bytes in use when the step ended.
    pub end_bytes: u64,
    /// Highest bytes in use during the step.
    pub peak_bytes: u64,
    /// Phase of `peak_bytes`.
    #[serde(alias = "phase")]
    pub peak_phase: Phase,
    /// Peak during forward passes.
    #[serde(alias = "forward_peak")]
    pub forward_peak_bytes: u64,
    /// Peak during backward passes.
    #[serde(alias = "backward_peak")]
    pub backward_peak_bytes: u64,
    /// Peak during the optimizer step.
    #[serde(alias = "optimizer_peak")]
    pub optimizer_peak_bytes: u64,
    /// Peak reserved bytes (CUDA pool) during the step; `None` on the CPU.
    #[serde(alias = "reserved_peak")]
    pub reserved_peak_bytes: Option<u64>,
    /// What the OS sees at the end of the step ([`MemoryLog::os_view`]): process RSS on the
    /// CPU, device-wide use on CUDA.
    #[serde(alias = "os_current")]
    pub os_current_bytes: Option<u64>,
    /// Its high-water mark at the end of the step (since process start on the CPU; the highest
    /// reading so far on CUDA).
    #[serde(alias = "os_peak")]
    pub os_peak_bytes: Option<u64>,
}

/// Memory of one epoch.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EpochMemory {
    /// Epoch number (the first is 1).
    pub epoch: usize,
    /// Highest bytes in use during the epoch (steps and evaluation).
    pub peak_bytes: u64,
    /// Phase of `peak_bytes`.
    #[serde(alias = "phase")]
    pub peak_phase: Phase,
    /// Mean over the epoch's steps of the step peak.
    #[serde(alias = "mean_batch_peak")]
    pub mean_step_peak_bytes: u64,
    /// Peak during the evaluation; `None` when the epoch was not evaluated (`--no-eval`, or a
    /// run stopped before it).
    #[serde(alias = "eval_peak")]
    pub eval_peak_bytes: Option<u64>,
    /// Steps recorded.
    #[serde(alias = "batches")]
    pub steps: usize,
    /// What the OS sees at the end of the epoch (after its evaluation).
    #[serde(default, alias = "os_current")]
    pub os_current_bytes: Option<u64>,
    /// Its high-water mark at the end of the epoch.
    #[serde(default, alias = "os_peak")]
    pub os_peak_bytes: Option<u64>,
}

/// Everything the memory recorder recorded. Its size does not grow with the number of steps:
/// the per-step records go to `batches.csv` as each step ends (and reach callbacks as
/// [`MemoryLog::last_batch`]); the log keeps the newest, the run's maxima and one record per
/// epoch. Snapshots store it whole, so they do not grow with the steps either.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MemoryLog {
    /// Probe name.
    pub probe: String,
    /// Whether the probe gave real readings.
    pub available: bool,
    /// Bytes in use when training began (data set, model).
    pub baseline_bytes: u64,
    /// Highest bytes in use over the run.
    pub peak_bytes: u64,
    /// Phase of `peak_bytes`.
    pub peak_phase: Option<Phase>,
    /// Highest reserved bytes (CUDA pool) over the run.
    #[serde(alias = "reserved_peak")]
    pub reserved_peak_bytes: Option<u64>,
    /// Which OS view the `os_*` fields hold (process RSS or device-wide), when it can be read.
    #[serde(default)]
    pub os_view: Option<OsView>,
    /// The OS view's high-water mark at the last reading.
    #[serde(default, alias = "os_peak")]
    pub os_peak_bytes: Option<u64>,
    /// The number of the first epoch and step: 1 in logs written from this version on; absent
    /// (0) in older logs, numbered from 0, which [`MemoryLog::numbered`] renumbers.
    #[serde(default)]
    pub first_number: usize,
    /// Steps recorded over the run (the rows of `batches.csv`).
    #[serde(default)]
    pub steps: usize,
    /// Highest step peak over the run (training steps only: loading and evaluation excluded).
    #[serde(default)]
    pub step_peak_bytes: u64,
    /// The newest step's record.
    #[serde(default)]
    pub last_batch: Option<BatchMemory>,
    /// The epoch in progress so far.
    #[serde(default)]
    pub epoch_steps: EpochSteps,
    /// Per-epoch records.
    pub epochs: Vec<EpochMemory>,
    /// Every step's record, as logs written before the log stopped growing with the steps held
    /// them (read only, by [`MemoryLog::upgrade`]).
    #[serde(default, rename = "batches", skip_serializing)]
    legacy_batches: Vec<BatchMemory>,
}

/// Running sums of the steps of the epoch in progress: what its [`EpochMemory`] row needs, kept
/// in the log (and so in snapshots) so that a resumed epoch's row covers its earlier steps too.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct EpochSteps {
    /// Epoch number (the first is 1; 0: none yet).
    pub epoch: usize,
    /// Steps recorded in it so far.
    pub steps: usize,
    /// Sum of their step peaks (for the mean).
    pub peak_sum_bytes: u64,
    /// The highest of them.
    pub peak_bytes: u64,
    /// Phase of `peak_bytes`.
    pub peak_phase: Option<Phase>,
}

impl EpochSteps {
    /// Sums for epoch number `epoch`, no step yet.
    fn new(epoch: usize) -> Self {
        EpochSteps {
            epoch,
            ..Default::default()
        }
    }

    /// Count one step's record.
    fn add(&mut self, b: &BatchMemory) {
        self.steps += 1;
        self.peak_sum_bytes = self.peak_sum_bytes.saturating_add(b.peak_bytes);
        if b.peak_bytes > self.peak_bytes || self.peak_phase.is_none() {
            self.peak_bytes = b.peak_bytes;
            self.peak_phase = Some(b.peak_phase);
        }
    }
}

impl MemoryLog {
    /// The log with epochs and steps numbered from 1 (a log of an older version, numbered from
    /// 0, renumbered).
    pub fn numbered(mut self) -> Self {
        if self.first_number == 0 {
            for b in &mut self.legacy_batches {
                b.epoch += 1;
                b.batch += 1;
                b.global_step += 1;
            }
            for e in &mut self.epochs {
                e.epoch += 1;
            }
            self.first_number = 1;
        }
        self
    }

    /// A log read from a snapshot written before the per-step records left it: its running
    /// figures are computed from those records, which are then dropped.
    pub fn upgrade(mut self) -> Self {
        let batches = std::mem::take(&mut self.legacy_batches);
        let Some(last) = batches.last() else {
            return self;
        };
        self.steps = batches.len();
        self.step_peak_bytes = batches.iter().map(|b| b.peak_bytes).max().unwrap_or(0);
        let mut sums = EpochSteps::new(last.epoch);
        for b in batches.iter().filter(|b| b.epoch == last.epoch) {
            sums.add(b);
        }
        self.epoch_steps = sums;
        self.last_batch = Some(last.clone());
        self
    }

    /// The memory report: one row per epoch.
    pub fn report(&self) -> String {
        if !self.available {
            return format!(
                "memory report: probe '{}' unavailable (no readings)\n",
                self.probe
            );
        }
        let os = self.os_view.map(|v| v.heading()).unwrap_or("OS view");
        let mut s = format!(
            "memory report ({}; baseline {} before training)\n| epoch | peak | mean step peak | phase of peak | eval peak | {os} at end | {os} peak |\n|---:|---:|---:|---|---:|---:|---:|\n",
            self.probe,
            format_bytes(self.baseline_bytes)
        );
        let or_dash = |v: Option<u64>| v.map(format_bytes).unwrap_or_else(|| "-".into());
        for e in &self.epochs {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                e.epoch,
                format_bytes(e.peak_bytes),
                format_bytes(e.mean_step_peak_bytes),
                e.peak_phase,
                or_dash(e.eval_peak_bytes),
                or_dash(e.os_current_bytes),
                or_dash(e.os_peak_bytes),
            ));
        }
        s.push_str(&format!(
            "run peak: {} ({}); {os} peak at the run's end: {} (the table's: at each epoch's end)\n",
            format_bytes(self.peak_bytes),
            self.peak_phase
                .map(|p| p.to_string())
                .unwrap_or_else(|| "-".into()),
            or_dash(self.os_peak_bytes),
        ));
        if self.peak_phase == Some(Phase::Other) {
            s.push_str(PHASE_OTHER_NOTE);
            s.push('\n');
        }
        if let Some(v) = self.os_view {
            s.push_str(&v.explain());
        }
        if let (Some(OsView::ProcessRss), Some(rss)) = (self.os_view, self.os_peak_bytes) {
            if self.peak_bytes > rss {
                s.push_str(&heap_above_rss(self.peak_bytes, rss));
            }
        }
        s
    }
}

/// What a peak in phase "other" means, for the report and the docs.
pub const PHASE_OTHER_NOTE: &str = "phase \"other\": the peak fell outside the training step and the evaluation (loading the data, building the model, between steps, saving a snapshot); a configuration's training peak is its step peak (summary.json step_peak_bytes), which sweeps and comparisons report.";

/// The report's line for a heap peak above the RSS peak.
fn heap_above_rss(heap: u64, rss: u64) -> String {
    format!(
        "heap peak {} is above the RSS peak {}: the heap counts every byte allocated, RSS only the pages written, and capacity never written is never paged in.\n",
        format_bytes(heap),
        format_bytes(rss)
    )
}

/// Running maxima of the step in progress.
#[derive(Debug, Default, Clone)]
struct StepMax {
    start: u64,
    fwd: u64,
    bwd: u64,
    opt: u64,
    reserved: Option<u64>,
}

/// Records, for every step and epoch, current and peak memory and the phase of the peak. The
/// trainer calls it at each boundary of its loop, in the order of the callbacks' hooks.
pub struct MemoryRecorder {
    probe: Arc<dyn MemoryProbe>,
    log: MemoryLog,
    step: StepMax,
    epoch_peak: (u64, Phase),
    epoch_eval: u64,
}

fn max_phase(cur: &mut (u64, Phase), bytes: u64, phase: Phase) {
    if bytes > cur.0 {
        *cur = (bytes, phase);
    }
}

impl MemoryRecorder {
    /// A recorder reading `probe`.
    pub fn new(probe: Arc<dyn MemoryProbe>) -> Self {
        let log = MemoryLog {
            probe: probe.name().to_string(),
            available: probe.available(),
            first_number: 1,
            ..Default::default()
        };
        MemoryRecorder {
            probe,
            log,
            step: StepMax::default(),
            epoch_peak: (0, Phase::Other),
            epoch_eval: 0,
        }
    }

    /// The records so far.
    pub fn log(&self) -> &MemoryLog {
        &self.log
    }

    /// Continue the records of a run's earlier processes (resuming): their steps and ended
    /// epochs stay, with their baseline and peaks, and this process's readings are added.
    pub fn continue_log(&mut self, earlier: MemoryLog) {
        self.log = MemoryLog {
            probe: self.log.probe.clone(),
            available: self.log.available,
            ..earlier.numbered().upgrade()
        };
    }

    /// Read the OS view; its peak is the highest reading so far, kept in the log (the kernel's
    /// own counters are per-CPU approximations, so a later VmHWM can read a little lower).
    fn read_os(&mut self) -> Option<OsMemory> {
        let os = self.probe.os_memory()?;
        self.log.os_view = self.probe.os_view();
        let peak = self.log.os_peak_bytes.unwrap_or(0).max(os.peak);
        self.log.os_peak_bytes = Some(peak);
        Some(OsMemory { peak, ..os })
    }

    /// Read and reset the watermark, folding the reading into the step, epoch and run maxima.
    fn fold(&mut self, phase: Phase) -> u64 {
        self.probe.sync();
        let reserved = self.probe.reserved_peak();
        let peak = self.probe.take_peak();
        max_phase(&mut self.epoch_peak, peak, phase);
        if peak > self.log.peak_bytes {
            self.log.peak_bytes = peak;
            self.log.peak_phase = Some(phase);
        }
        if let Some(r) = reserved {
            self.log.reserved_peak_bytes = Some(self.log.reserved_peak_bytes.unwrap_or(0).max(r));
            self.step.reserved = Some(self.step.reserved.unwrap_or(0).max(r));
        }
        peak
    }

    /// Training begins: the baseline (a resumed run keeps its first process's).
    pub fn train_begin(&mut self) {
        self.probe.sync();
        let cur = self.probe.current();
        self.log.available = self.probe.available();
        if self.log.steps == 0 {
            self.log.baseline_bytes = cur;
        }
        self.fold(Phase::Other);
    }

    /// Epoch `epoch` (its index: 0 for the first) begins; with `reset_peak` its peak starts from what is in use now rather
    /// than from the run's peak.
    pub fn epoch_begin(&mut self, epoch: usize, reset_peak: bool) {
        self.fold(Phase::Other);
        self.epoch_peak = if reset_peak {
            (self.probe.current(), Phase::Other)
        } else {
            (
                self.log.peak_bytes,
                self.log.peak_phase.unwrap_or(Phase::Other),
            )
        };
        self.epoch_eval = 0;
        // Steps of this epoch recorded by an earlier process (a resumed run) belong to it.
        let sums = &self.log.epoch_steps;
        match sums.peak_phase {
            Some(phase) if sums.epoch == epoch + 1 => {
                max_phase(&mut self.epoch_peak, sums.peak_bytes, phase)
            }
            _ => self.log.epoch_steps = EpochSteps::new(epoch + 1),
        }
    }

    /// An optimizer step begins.
    pub fn step_begin(&mut self) {
        self.fold(Phase::Other);
        self.step = StepMax {
            start: self.probe.current(),
            ..Default::default()
        };
    }

    /// A forward or backward pass of the step ended (once per micro-batch).
    pub fn phase_end(&mut self, phase: Phase) {
        let p = self.fold(phase);
        match phase {
            Phase::Forward => self.step.fwd = self.step.fwd.max(p),
            Phase::Backward => self.step.bwd = self.step.bwd.max(p),
            Phase::Optimizer => self.step.opt = self.step.opt.max(p),
            Phase::Eval | Phase::Other => {}
        }
    }

    /// The step (its optimizer phase included) ended: its record is the log's last batch. The
    /// arguments are indices (0 for the first); the record numbers them from 1.
    pub fn step_end(&mut self, epoch: usize, batch: usize, global_step: usize) {
        self.phase_end(Phase::Optimizer);
        let s = &self.step;
        let mut peak = (s.fwd, Phase::Forward);
        max_phase(&mut peak, s.bwd, Phase::Backward);
        max_phase(&mut peak, s.opt, Phase::Optimizer);
        let rec = BatchMemory {
            epoch: epoch + 1,
            batch: batch + 1,
            global_step: global_step + 1,
            start_bytes: s.start,
            end_bytes: self.probe.current(),
            peak_bytes: peak.0,
            peak_phase: peak.1,
            forward_peak_bytes: s.fwd,
            backward_peak_bytes: s.bwd,
            optimizer_peak_bytes: s.opt,
            reserved_peak_bytes: s.reserved,
            os_current_bytes: None,
            os_peak_bytes: None,
        };
        let os = self.read_os();
        let rec = BatchMemory {
            os_current_bytes: os.map(|o| o.current),
            os_peak_bytes: os.map(|o| o.peak),
            ..rec
        };
        self.log.steps += 1;
        self.log.step_peak_bytes = self.log.step_peak_bytes.max(rec.peak_bytes);
        if self.log.epoch_steps.epoch != rec.epoch {
            self.log.epoch_steps = EpochSteps::new(rec.epoch);
        }
        self.log.epoch_steps.add(&rec);
        self.log.last_batch = Some(rec);
    }

    /// Epoch `epoch` (its index) ended, after its evaluation when `evaluated`: its record is the
    /// log's last epoch.
    pub fn epoch_end(&mut self, epoch: usize, evaluated: bool) {
        // Without an evaluation, what was read since the last step is not the evaluation's.
        self.epoch_eval = self.fold(if evaluated { Phase::Eval } else { Phase::Other });
        // The sums stay until the next epoch begins: a snapshot of an epoch cut short (by a stop
        // or --max-steps) is taken after this, and the resumed run continues them.
        let sums = &self.log.epoch_steps;
        let (steps, sum) = match sums.epoch == epoch + 1 {
            true => (sums.steps, sums.peak_sum_bytes),
            false => (0, 0),
        };
        let rec = EpochMemory {
            epoch: epoch + 1,
            peak_bytes: self.epoch_peak.0,
            peak_phase: self.epoch_peak.1,
            mean_step_peak_bytes: sum / steps.max(1) as u64,
            eval_peak_bytes: evaluated.then_some(self.epoch_eval),
            steps,
            os_current_bytes: None,
            os_peak_bytes: None,
        };
        let os = self.read_os();
        self.log.epochs.push(EpochMemory {
            os_current_bytes: os.map(|o| o.current),
            os_peak_bytes: os.map(|o| o.peak),
            ..rec
        });
    }

    /// Training ended: the last reading.
    pub fn train_end(&mut self) {
        self.fold(Phase::Other);
        self.read_os();
    }
}
