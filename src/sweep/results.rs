//! What sweeps and comparisons measured: the result types that `batch` and `compare` fill and
//! `report` renders, kept apart from both so neither imports the other's half.

use super::ChildRun;
use memtrain_core::memory::format_bytes;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// One configuration of a sweep: a label and the trainer flags that make it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Variant {
    /// Short label, e.g. `f16 ckpt=stages`.
    pub label: String,
    /// Trainer flags, e.g. `["--precision", "f16", "--checkpoint", "stages"]`.
    pub flags: Vec<String>,
}

impl Variant {
    /// Gradient accumulation steps this variant asks for (the trainer's default when not given),
    /// read from its flags as the trainer parses them.
    pub fn accum_steps(&self) -> crate::Result<usize> {
        Ok(crate::cli::flags_config(&self.flags)?.steps.accum_steps)
    }
}

/// Default `--margin` of `--find-max`: the recommended batch is 5% below the largest that fits,
/// headroom for what a few measured steps do not show (fragmentation, a longer run's peaks, other
/// processes on the device).
pub const DEFAULT_MARGIN: f64 = 0.05;

fn default_margin() -> f64 {
    DEFAULT_MARGIN
}

/// Which batch sizes to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchPlan {
    /// Exactly these batch sizes, in order.
    List(Vec<usize>),
    /// Find the largest batch that fits: double from `start` until a point runs out of memory or
    /// `max_batch` is reached, then binary-search between the last fit and the first OOM down to
    /// `granularity` images.
    FindMax {
        /// First batch size tried.
        start: usize,
        /// Upper bound of the search: the largest batch size tried.
        max_batch: usize,
        /// Resolution of the binary search, in images.
        granularity: usize,
        /// Safety margin, in [0, 1): the recommended batch is the largest that fits × (1 −
        /// margin), see [`super::batch::recommended_batch`]. Results written before it existed read as the
        /// default.
        #[serde(default = "default_margin")]
        margin: f64,
    },
}

/// One measured point of a sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepPoint {
    /// Configuration label.
    pub configuration: String,
    /// Batch size (images per optimizer step).
    pub batch_size: usize,
    /// What the child reported.
    pub run: ChildRun,
    /// The point's out-of-memory report, relative to the sweep's directory, when it ran out of
    /// memory and wrote one (see [`super::oom_report_link`]); `oom_snapshot` in older results.
    #[serde(
        default,
        alias = "oom_snapshot",
        skip_serializing_if = "Option::is_none"
    )]
    pub oom_report: Option<PathBuf>,
}

/// The result of a `--find-max` search for one configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MaxBatch {
    /// Configuration label.
    pub configuration: String,
    /// Largest batch size that ran without running out of memory (`None`: not even the smallest).
    pub max_batch: Option<usize>,
    /// Smallest batch size that ran out of memory (`None`: none did up to the cap).
    pub first_oom: Option<usize>,
    /// The batch to train with: `max_batch` less the safety margin, see [`super::batch::recommended_batch`]
    /// (`None` when no batch fits).
    #[serde(default)]
    pub recommended: Option<usize>,
    /// The safety margin `recommended` was computed with.
    #[serde(default)]
    pub margin: f64,
    /// True when the search stopped at `max_batch` of the plan without an OOM.
    pub capped: bool,
    /// Why the search ended early (a failed point), or empty.
    pub note: String,
}

/// Everything a sweep measured; written as `sweep.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepResult {
    /// The command line that ran the sweep.
    pub command: String,
    /// Training steps per point.
    pub steps: usize,
    /// The memory limit given to the children (`--memory-limit`), in bytes.
    #[serde(alias = "memory_limit")]
    pub memory_limit_bytes: Option<u64>,
    /// The plan.
    pub plan: BatchPlan,
    /// Configurations, in order.
    pub configurations: Vec<Variant>,
    /// Every point, in the order it ran.
    pub points: Vec<SweepPoint>,
    /// Search results (only with [`BatchPlan::FindMax`]), one per configuration.
    pub max_batches: Vec<MaxBatch>,
    /// True when the sweep was stopped (Ctrl-C/SIGTERM) before all points ran.
    #[serde(default)]
    pub interrupted: bool,
}

impl SweepResult {
    /// On the CPU, the heap budget the points' trainers derived from `memory_limit_bytes` (the
    /// limit is resident memory, the points' peaks are heap): the smallest any point reported.
    pub(crate) fn heap_budget_bytes(&self) -> Option<u64> {
        self.points
            .iter()
            .filter_map(|p| p.run.summary.as_ref()?.memory.heap_budget_bytes)
            .min()
    }

    /// The points of one configuration, sorted by batch size.
    pub(crate) fn points_of(&self, configuration: &str) -> Vec<&SweepPoint> {
        let mut v: Vec<&SweepPoint> = self
            .points
            .iter()
            .filter(|p| p.configuration == configuration)
            .collect();
        v.sort_by_key(|p| p.batch_size);
        v
    }
}

/// One compared configuration and what its run reported.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompareEntry {
    /// Label.
    pub label: String,
    /// The configuration's own flags.
    pub flags: Vec<String>,
    /// What the child reported.
    pub run: ChildRun,
    /// Peak memory change versus the first run, in percent; `None` when either did not finish.
    pub peak_change_pct: Option<f64>,
    /// Throughput change versus the first run, in percent.
    pub speed_change_pct: Option<f64>,
    /// The run's out-of-memory report, relative to the comparison's directory, when it ran out
    /// of memory and wrote one (see [`super::oom_report_link`]); `oom_snapshot` in older results.
    #[serde(
        default,
        alias = "oom_snapshot",
        skip_serializing_if = "Option::is_none"
    )]
    pub oom_report: Option<PathBuf>,
}

/// Everything a comparison measured; written as `compare.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompareResult {
    /// The command line that ran the comparison.
    pub command: String,
    /// Flags common to all runs.
    pub common: Vec<String>,
    /// One entry per configuration, the one the others are compared with first.
    pub entries: Vec<CompareEntry>,
    /// True when the comparison was stopped (Ctrl-C/SIGTERM) before all runs ran.
    #[serde(default)]
    pub interrupted: bool,
}

/// `(x - base) / base` in percent.
fn change_pct(x: Option<f64>, base: Option<f64>) -> Option<f64> {
    match (x, base) {
        (Some(x), Some(b)) if b > 0.0 => Some((x - b) / b * 100.0),
        _ => None,
    }
}

impl CompareResult {
    /// Recompute the changes versus the first entry.
    pub fn update_changes(&mut self) {
        let (base_peak, base_speed) = match self.entries.first() {
            Some(e) => (e.run.peak_bytes().map(|b| b as f64), e.run.images_per_sec()),
            None => return,
        };
        for e in &mut self.entries {
            e.peak_change_pct = change_pct(e.run.peak_bytes().map(|b| b as f64), base_peak);
            e.speed_change_pct = change_pct(e.run.images_per_sec(), base_speed);
        }
    }
}

/// One line per configuration describing a `--find-max` result.
pub fn describe_max(mb: &MaxBatch, limit: Option<u64>) -> String {
    let within = limit
        .map(|l| format!(" within {}", format_bytes(l)))
        .unwrap_or_default();
    let mut s = match (mb.max_batch, mb.first_oom) {
        (Some(m), _) if mb.capped => format!(
            "{}: batch {m} fits{within} (the search's upper bound, {}; larger not tried)",
            mb.configuration,
            if mb.note.is_empty() {
                "--max-batch"
            } else {
                &mb.note
            }
        ),
        (Some(m), Some(o)) => format!(
            "{}: largest batch that fits{within}: {m} (batch {o} runs out of memory)",
            mb.configuration
        ),
        (Some(m), None) => format!("{}: largest batch that fits{within}: {m}", mb.configuration),
        (None, Some(o)) => format!(
            "{}: no batch size fits{within} (batch {o} runs out of memory)",
            mb.configuration
        ),
        (None, None) => format!("{}: no result", mb.configuration),
    };
    if let Some(r) = mb.recommended {
        s.push_str(&format!(
            "; recommended batch {r} ({}% margin)",
            fmt_pct(mb.margin * 100.0)
        ));
    }
    // "even batch N ran out of memory" repeats what the line already says.
    // A cap's reason is already in the line.
    let redundant = (mb.max_batch.is_none() && mb.note.starts_with("even batch")) || mb.capped;
    if !mb.note.is_empty() && !redundant {
        s.push_str(&format!(" [{}]", mb.note));
    }
    s
}

/// A percentage without trailing zeros: 5, 2.5, 12.35.
fn fmt_pct(p: f64) -> String {
    let s = format!("{p:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}
