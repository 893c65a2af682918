//! The step's events as the estimate predicts them ([`EventPrediction`], matched to the trainer's
//! timeline), and the host records a CPU step keeps besides its tensors: the trainer's timeline
//! records, the tape's own vectors, and what the first step leaves for the rest of the run.

use super::sim::Shared;
use crate::config::TrainConfig;
use memtrain_core::error::Result;
use memtrain_core::phase::Phase;
use memtrain_core::step::tape::{StepEvent, StepObserver, SAVED_RECORD_BYTES};
use std::ops::Range;

/// Capacity of a `Vec` after `len` single pushes from empty (std's amortized growth: at least
/// 8 elements of a byte, 4 of up to 1 KiB, 1 above; doubling when full).
pub(super) fn pushed_capacity(len: usize, elem_bytes: usize) -> usize {
    let min = match elem_bytes {
        1 => 8,
        2..=1024 => 4,
        _ => 1,
    };
    if len == 0 {
        0
    } else {
        len.next_power_of_two().max(min)
    }
}

/// Bytes of `len` elements of `T` pushed one by one into a `Vec`.
pub(super) fn pushed_bytes<T>(len: usize) -> u64 {
    (pushed_capacity(len, std::mem::size_of::<T>()) * std::mem::size_of::<T>()) as u64
}

/// The training tape's own vectors on the CPU heap (`core/src/step/tape.rs`), which the sizing's
/// tape holds with other element sizes: the segments and the blocks' parameter offsets of
/// `LeanStep::on`, for the step; for each micro-batch, room for every segment's input and every
/// block's saved record, made at the forward's start, and the head's input shape, made at the
/// forward's end; both go with the tape when its backward is done.
pub(super) struct TapeHost {
    pub(super) segments: Vec<Range<usize>>,
    pub(super) blocks: usize,
}

impl TapeHost {
    /// `LeanStep::on`'s segments and offsets, held through the step.
    pub(super) fn step_vectors(&self) -> u64 {
        pushed_bytes::<Range<usize>>(self.segments.len()) + pushed_bytes::<usize>(self.blocks + 1)
    }

    /// The held inputs' and records' room, made at the forward's start.
    pub(super) fn before_forward(&self) -> u64 {
        (self.segments.len() * std::mem::size_of::<candle_core::Tensor>()
            + self.blocks * SAVED_RECORD_BYTES) as u64
    }

    /// What a micro-batch's backward leaves to free: that room and the head's input shape.
    fn after_backward(&self) -> u64 {
        self.before_forward() + FEATURE_DIMS_BYTES
    }
}

/// Bytes of the head's input shape, which the tape keeps from the forward's end to the backward's.
const FEATURE_DIMS_BYTES: u64 = (4 * std::mem::size_of::<usize>()) as u64;

/// Records the predicted bytes at each of the step's events, and on the CPU the heap the trainer's
/// record of each event takes: its layer's name ([`TIMELINE_EVENT_BYTES`] per record are in the
/// timeline's vector, reserved at the step's start), and the tape's own vectors.
/// At each phase's end the simulation enters the next phase.
pub(super) struct Events {
    pub(super) sim: Shared,
    pub(super) events: Vec<EventPrediction>,
    pub(super) host: Option<TapeHost>,
    /// Forward block events so far in this micro-batch.
    pub(super) forward: usize,
    /// Micro-batches per step.
    pub(super) accum_steps: usize,
    /// Host bytes of the step's micro-batch results, freed after the last backward.
    pub(super) results: u64,
    /// The most activation bytes a micro-batch holds at the end of its forward.
    pub(super) activation_bytes: u64,
}

impl Events {
    /// The tape's vectors around the event just recorded: after the last forward block, the
    /// head's input shape.
    fn tape_host(&mut self, e: &StepEvent<'_>) {
        let Some(t) = &self.host else { return };
        if e.phase == Phase::Forward && e.layer != "head" {
            self.forward += 1;
            if self.forward == t.blocks {
                self.sim.borrow_mut().alloc(FEATURE_DIMS_BYTES);
            }
        }
    }
}

impl StepObserver for Events {
    fn event(&mut self, e: StepEvent<'_>) -> Result<()> {
        self.tape_host(&e);
        let mut sim = self.sim.borrow_mut();
        self.events.push(EventPrediction {
            phase: match e.phase {
                Phase::Forward => "forward",
                _ => "backward",
            },
            layer: e.layer.to_string(),
            peak_bytes: sim.event_peak,
            current_bytes: sim.cur,
            saved_bytes: e.saved_bytes,
        });
        sim.event_peak = sim.cur;
        if self.host.is_some() {
            sim.alloc(e.layer.len() as u64);
        }
        Ok(())
    }

    fn phase_end(&mut self, micro: usize, phase: Phase) -> Result<()> {
        let mut sim = self.sim.borrow_mut();
        if phase == Phase::Forward {
            let saved = self.events.last().map_or(0, |e| e.saved_bytes);
            self.activation_bytes = self.activation_bytes.max(saved);
            sim.phase = Phase::Backward;
            return Ok(());
        }
        if let Some(t) = &self.host {
            sim.free(t.after_backward());
        }
        self.forward = 0;
        sim.phase = if micro + 1 < self.accum_steps {
            Phase::Forward
        } else {
            // The micro-batches' results go once the batch's mean is taken.
            sim.free(self.results);
            Phase::Optimizer
        };
        Ok(())
    }
}

/// Heap bytes of one record of the trainer's memory timeline besides its layer's name.
pub const TIMELINE_EVENT_BYTES: u64 =
    std::mem::size_of::<memtrain_core::memory::timeline::TimelineEvent>() as u64;

/// One predicted event of the step, matching the trainer's timeline events.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EventPrediction {
    /// `forward`, `backward` or `optimizer`.
    pub phase: &'static str,
    /// The layer, named as in the timeline (`stage1.block2`, `head`, `optimizer`, …).
    pub layer: String,
    /// Highest bytes in use between the previous event and this one.
    pub peak_bytes: u64,
    /// Bytes in use right after the event.
    pub current_bytes: u64,
    /// Activation bytes held for the backward at the event.
    pub saved_bytes: u64,
}

/// Heap the first training step's end leaves on the CPU for the rest of the run: the batcher's
/// pool of image buffers (`BufferPool`: a vector of up to the batches in flight), and the run
/// history's step times and activation storage spans (`src/train/history.rs`), each pushed once.
pub(super) fn after_first_step_bytes(cfg: &TrainConfig) -> u64 {
    let in_flight = cfg.prefetch_batches(false) + 1;
    pushed_bytes::<Vec<f32>>(in_flight)
        + pushed_bytes::<(usize, f64)>(1)
        + pushed_bytes::<crate::config::StorageSpan>(1)
}
