//! The memory timeline inside one training step: the probe read at every layer event of the
//! step (forward of layer i, backward of layer i, optimizer), split into the categories the step
//! itself knows, with the estimate's prediction at the same events.
//!
//! The step records one [`StepTimeline`] per optimizer step (a few dozen events, no allocation
//! beyond the event list); the trainer keeps the newest and writes it as `step_timeline.json` into
//! the run directory, which `sweep::step_chart` draws as `step_timeline.{png,svg}` and `compare`
//! overlays across configurations.

use crate::phase::Phase;
use serde::{Deserialize, Serialize};

/// File name of the step timeline in a run directory.
pub const STEP_TIMELINE_FILE: &str = "step_timeline.json";

/// File name of the report a run writes into its run directory when it stops on out-of-memory:
/// the step's timeline up to the failing event, the configuration and its memory estimate.
pub const OOM_REPORT_FILE: &str = "oom_report.json";

/// Bytes per category at one event. `other` is what was in use at the start of the step and is
/// none of the step's own categories (data set, batcher, callbacks); `transient` is the measured
/// remainder: op outputs not (yet) saved, workspaces, gradients of activations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CategoryBytes {
    /// Parameters (f32 master weights) and BatchNorm running statistics.
    pub params: u64,
    /// Parameter gradient buffers.
    pub grads: u64,
    /// Optimizer state (momentum buffers, Adam moments).
    pub optimizer: u64,
    /// Activations saved for the backward pass (including checkpoint segment inputs).
    pub saved: u64,
    /// Everything else the step allocated that is live at the event.
    pub transient: u64,
    /// In use at the step's start outside the categories above.
    pub other: u64,
}

impl CategoryBytes {
    /// Sum of all categories (= the probe's current bytes at the event).
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer + self.saved + self.transient + self.other
    }
}

/// One event of the step: after the named layer's forward or backward, or after the optimizer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimelineEvent {
    /// Position in the step (0-based).
    pub index: usize,
    /// Forward, backward or optimizer.
    pub phase: Phase,
    /// The layer (e.g. `stage1.block2`, `head`, `optimizer`), or for a checkpoint segment's
    /// recomputation `recompute` and the segment (`recompute stage1.block1–block2`).
    pub layer: String,
    /// Micro-batch index (gradient accumulation).
    pub micro_batch: usize,
    /// Probe reading right after the event (bytes in use).
    pub current_bytes: u64,
    /// Highest bytes in use between the previous event and this one.
    pub peak_bytes: u64,
    /// `current_bytes` split into categories.
    pub categories: CategoryBytes,
    /// The estimate's prediction of `peak_bytes` at this event, when it has one.
    pub predicted_peak_bytes: Option<u64>,
    /// The estimate's prediction of `current_bytes` at this event, when it has one.
    #[serde(default)]
    pub predicted_current_bytes: Option<u64>,
    /// Microseconds from the step's start to this event (`step_trace.json`'s time axis).
    #[serde(default)]
    pub end_us: Option<u64>,
    /// GPU microseconds since the previous event (the step's start for the first), from CUDA
    /// events (eager CUDA steps; `None` elsewhere).
    #[serde(default)]
    pub gpu_us: Option<f64>,
}

/// The events of one optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct StepTimeline {
    /// Configuration label (as in summary.json).
    pub label: String,
    /// Probe name (`cpu-heap`, `cuda-pool`).
    pub probe: String,
    /// The step's number in the run (the first is 1), as in `batches.csv`.
    pub global_step: usize,
    /// Bytes in use when the step began.
    pub start_bytes: u64,
    /// The events, in order.
    pub events: Vec<TimelineEvent>,
}

impl StepTimeline {
    /// Highest `peak_bytes` over the events (0 without events).
    pub fn peak_bytes(&self) -> u64 {
        self.events.iter().map(|e| e.peak_bytes).max().unwrap_or(0)
    }

    /// Highest predicted peak over the events, when every event has a prediction.
    pub fn predicted_peak_bytes(&self) -> Option<u64> {
        self.events
            .iter()
            .map(|e| e.predicted_peak_bytes)
            .collect::<Option<Vec<_>>>()
            .and_then(|v| v.into_iter().max())
    }
}

/// A probe wrapper with two watermarks over the device's one: the step's events split it at every
/// layer event, the memory callback at its hooks, and neither loses the other's peak.
/// [`TimelineProbe::take_event_peak`] reads and resets the device watermark but carries the value
/// for [`MemoryProbe::peak`](crate::memory::MemoryProbe::peak) (what the callback folds), and a
/// callback's `reset_peak` carries the value for the next event.
pub struct TimelineProbe {
    inner: std::sync::Arc<dyn crate::memory::MemoryProbe>,
    /// Highest reading taken by events since the callback's last reset.
    carried: std::sync::atomic::AtomicU64,
    /// Highest reading taken by callback resets since the last event.
    event_carried: std::sync::atomic::AtomicU64,
}

impl TimelineProbe {
    /// Wrap `inner`.
    pub fn new(inner: std::sync::Arc<dyn crate::memory::MemoryProbe>) -> Self {
        TimelineProbe {
            inner,
            carried: std::sync::atomic::AtomicU64::new(0),
            event_carried: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The highest bytes in use since the previous event, and start a new event interval.
    pub fn take_event_peak(&self) -> u64 {
        use std::sync::atomic::Ordering::SeqCst;
        let p = self.inner.take_peak();
        self.carried.fetch_max(p, SeqCst);
        self.event_carried.swap(0, SeqCst).max(p)
    }
}

impl crate::memory::MemoryProbe for TimelineProbe {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn available(&self) -> bool {
        self.inner.available()
    }
    fn current(&self) -> u64 {
        self.inner.current()
    }
    fn peak(&self) -> u64 {
        self.inner
            .peak()
            .max(self.carried.load(std::sync::atomic::Ordering::SeqCst))
    }
    fn reset_peak(&self) {
        self.take_peak();
    }
    fn take_peak(&self) -> u64 {
        use std::sync::atomic::Ordering::SeqCst;
        let p = self.inner.take_peak();
        self.event_carried.fetch_max(p, SeqCst);
        p.max(self.carried.swap(0, SeqCst))
    }
    fn limit(&self) -> Option<u64> {
        self.inner.limit()
    }
    fn os_limit(&self) -> Option<u64> {
        self.inner.os_limit()
    }
    fn reserved(&self) -> Option<u64> {
        self.inner.reserved()
    }
    fn reserved_peak(&self) -> Option<u64> {
        self.inner.reserved_peak()
    }
    fn device_used(&self) -> Option<u64> {
        self.inner.device_used()
    }
    fn os_view(&self) -> Option<crate::memory::OsView> {
        self.inner.os_view()
    }
    fn os_memory(&self) -> Option<crate::memory::OsMemory> {
        self.inner.os_memory()
    }
    fn sync(&self) {
        self.inner.sync()
    }
}
