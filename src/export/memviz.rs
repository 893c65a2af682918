//! PyTorch's memory snapshot (`torch.cuda.memory._snapshot()`, opened at pytorch.org/memory_viz
//! and by `torch.cuda._memory_viz`) from one step's allocation trace ([`memtrain_core::memory::trace`]).
//!
//! The format: a dict with `segments` (the state when the snapshot is taken: the end of the
//! trace) and `device_traces` (one list per device of `alloc` / `free_requested` /
//! `free_completed` / `oom` entries, each with `addr`, `size`, `stream` and `frames`). The viewer
//! walks the trace backwards from the segments, so the two must agree: here every block alive at
//! the end is a segment of its own (the CPU heap has no allocator segments), and what was alive
//! before the step and still is at its end is one block at address 0 (the counting allocator
//! knows its total, not its blocks). Every traced allocation carries a frame naming the layer
//! event it happened in, e.g. `stage2.block1 backward`.

use crate::error::{Error, Result};
use memtrain_core::memory::timeline::{StepTimeline, TimelineEvent};
use memtrain_core::memory::trace::{Action, Trace};
use memtrain_core::phase::Phase;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// File name of the snapshot of the chosen step in a run directory.
pub const MEMORY_SNAPSHOT_FILE: &str = "memory_snapshot.pickle";
/// File name of the snapshot of a step that ran out of memory.
pub const OOM_MEMORY_SNAPSHOT_PICKLE: &str = "oom_memory_snapshot.pickle";

// Integers are i64 in the pickled structs: serde-pickle writes a u64 above i32 as a 9-byte
// LONG1, which memory_viz's unpickler turns into a BigInt that its arithmetic rejects; an i64 is
// 8 bytes, read as a Number. Addresses and sizes are far below 2^63.

/// One frame of a stack, as PyTorch records it (innermost first).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frame {
    /// Where: here the step, micro-batch and the word `event`.
    pub filename: String,
    /// The layer event's index in the step.
    pub line: i64,
    /// What: the layer event, e.g. `stage2.block1 backward`.
    pub name: String,
}

/// One entry of a device trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceEvent {
    /// `alloc`, `free_requested`, `free_completed` or `oom`.
    pub action: String,
    /// Address of the block (0 for `oom`).
    pub addr: i64,
    /// Bytes of the block; for `oom`, the bytes over the limit.
    pub size: i64,
    /// Always 0 (one stream).
    pub stream: i64,
    /// Where it happened.
    pub frames: Vec<Frame>,
    /// For `oom` only: the bytes the limit left free before the failing event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_free: Option<i64>,
}

/// A block of a segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Block {
    /// Address (the segment's: one block a segment).
    pub address: i64,
    /// Bytes.
    pub size: i64,
    /// Bytes asked for (the same: the counting allocator sees requested sizes).
    pub requested_size: i64,
    /// Always `active_allocated`.
    pub state: String,
    /// Where it was allocated.
    pub frames: Vec<Frame>,
}

/// A segment: here one live block of the heap at the end of the trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// Device index (0).
    pub device: i64,
    /// Address.
    pub address: i64,
    /// Bytes.
    pub total_size: i64,
    /// Bytes in allocated blocks.
    pub allocated_size: i64,
    /// Bytes in active blocks.
    pub active_size: i64,
    /// Bytes asked for.
    pub requested_size: i64,
    /// Always 0.
    pub stream: i64,
    /// `large` or `small` (PyTorch's split at 1 MiB).
    pub segment_type: String,
    /// Always false.
    pub is_expandable: bool,
    /// Its blocks (one).
    pub blocks: Vec<Block>,
}

/// The snapshot: what `pickle.load` of a `torch.cuda.memory._snapshot()` file gives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemorySnapshot {
    /// The heap at the end of the trace.
    pub segments: Vec<Segment>,
    /// One trace (device 0).
    pub device_traces: Vec<Vec<TraceEvent>>,
}

/// A step that ran out of memory: the limit and the peak at the failing event.
#[derive(Debug, Clone, Copy)]
pub struct OomMark {
    /// The `--memory-limit` in bytes.
    pub limit: u64,
    /// The highest bytes in use up to the failure.
    pub peak: u64,
}

/// What a frame calls a layer event: `stage2.block1 backward`, `stage2.block1 recompute`,
/// `optimizer`.
fn event_name(e: &TimelineEvent) -> String {
    if e.phase == Phase::Optimizer || e.layer.contains("recompute") {
        e.layer.clone()
    } else {
        format!("{} {}", e.layer, e.phase)
    }
}

/// The frames of the interval that ends with event `k` of `timeline` (after the last event:
/// the end of the step).
fn frames_for(timeline: &StepTimeline, k: usize) -> Vec<Frame> {
    let (name, micro) = match timeline.events.get(k) {
        Some(e) => (event_name(e), e.micro_batch),
        None => (
            "end of the step".to_string(),
            timeline.events.last().map_or(0, |e| e.micro_batch),
        ),
    };
    vec![Frame {
        filename: format!(
            "memtrain step {} micro-batch {micro} event",
            timeline.global_step
        ),
        line: int(k as u64),
        name,
    }]
}

/// `v` as the pickle's integer (addresses and sizes are far below `i64::MAX`).
fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn segment(address: u64, size: u64, frames: Vec<Frame>) -> Segment {
    let (address, size) = (int(address), int(size));
    Segment {
        device: 0,
        address,
        total_size: size,
        allocated_size: size,
        active_size: size,
        requested_size: size,
        stream: 0,
        segment_type: if size >= 1 << 20 { "large" } else { "small" }.into(),
        is_expandable: false,
        blocks: vec![Block {
            address,
            size,
            requested_size: size,
            state: "active_allocated".into(),
            frames,
        }],
    }
}

fn trace_event(action: &str, addr: u64, size: u64, frames: Vec<Frame>) -> TraceEvent {
    TraceEvent {
        action: action.into(),
        addr: int(addr),
        size: int(size),
        stream: 0,
        frames,
        device_free: None,
    }
}

/// The snapshot of `trace`, its layer events named by `timeline` (the same step), with an `oom`
/// entry at the end for a step that ran out of memory. An incomplete trace (dropped entries)
/// is refused: its replay would not be the step. Built whole in memory: [`write_trace`] writes
/// the same pickle without holding its events.
pub fn snapshot(
    trace: &Trace,
    timeline: &StepTimeline,
    oom: Option<OomMark>,
) -> Result<MemorySnapshot> {
    let parts = Parts::of(trace, timeline, oom)?;
    let segments = parts.segments();
    Ok(MemorySnapshot {
        segments,
        device_traces: vec![parts.events().collect()],
    })
}

/// What a snapshot is made of, found in one pass over the trace: the blocks alive at its end
/// (their address, size and the layer event that made them) and the bytes from before the trace
/// that it frees. The events are read off the trace again as they are written.
struct Parts<'a> {
    trace: &'a Trace,
    timeline: &'a StepTimeline,
    oom: Option<OomMark>,
    /// Blocks allocated in the trace and alive at its end: address -> (size, event index).
    alive: BTreeMap<u64, (u64, usize)>,
    freed_earlier: u64,
    /// Entries of the device trace: one per allocation, two per free, and the oom mark.
    count: usize,
}

impl<'a> Parts<'a> {
    fn of(trace: &'a Trace, timeline: &'a StepTimeline, oom: Option<OomMark>) -> Result<Self> {
        if trace.dropped > 0 {
            return Err(Error::config(format!(
                "the step made more than {} allocations and {} were not traced",
                trace.entries().len(),
                trace.dropped
            )));
        }
        let mut alive = BTreeMap::new();
        let (mut freed_earlier, mut k, mut count) = (0u64, 0usize, usize::from(oom.is_some()));
        for e in trace.entries() {
            match e.action {
                Action::Mark => k += 1,
                Action::Alloc => {
                    alive.insert(e.addr, (e.size, k));
                    count += 1;
                }
                Action::Free => {
                    if alive.remove(&e.addr).is_none() {
                        freed_earlier += e.size;
                    }
                    count += 2;
                }
            }
        }
        Ok(Parts {
            trace,
            timeline,
            oom,
            alive,
            freed_earlier,
            count,
        })
    }

    /// The heap at the end of the trace: what was in use before it and still is, as one block at
    /// address 0, then every block the trace allocated and did not free.
    fn segments(&self) -> Vec<Segment> {
        let before = self.trace.start_bytes.saturating_sub(self.freed_earlier);
        let mut segments = Vec::with_capacity(self.alive.len() + 1);
        if before > 0 {
            let frames = vec![Frame {
                filename: format!("memtrain step {} start", self.timeline.global_step),
                line: 0,
                name: "in use before the step (data set, parameters, optimizer state, buffers)"
                    .into(),
            }];
            segments.push(segment(0, before, frames));
        }
        segments.extend(
            self.alive
                .iter()
                .map(|(&addr, &(size, k))| segment(addr, size, frames_for(self.timeline, k))),
        );
        segments
    }

    /// The device trace's entries in order, made one at a time.
    fn events(&self) -> impl ExactSizeIterator<Item = TraceEvent> + 'a {
        Events {
            entries: self.trace.entries().iter(),
            timeline: self.timeline,
            k: 0,
            frames: frames_for(self.timeline, 0),
            pending: None,
            oom: self
                .oom
                .map(|o| oom_event(o, self.trace.start_bytes, self.timeline)),
            left: self.count,
        }
    }
}

/// The `oom` entry: the failing event is the last one recorded (the budget is checked at each
/// event).
fn oom_event(o: OomMark, start_bytes: u64, timeline: &StepTimeline) -> TraceEvent {
    let mut frames = frames_for(timeline, timeline.events.len().saturating_sub(1));
    for f in &mut frames {
        f.name = format!("out of memory at {}", f.name);
    }
    let mut oom = trace_event("oom", 0, o.peak.saturating_sub(o.limit), frames);
    oom.device_free = Some(int(o.limit.saturating_sub(start_bytes)));
    oom
}

/// The device trace as an iterator over the trace's entries (see [`Parts::events`]).
struct Events<'a> {
    entries: std::slice::Iter<'a, memtrain_core::memory::trace::TraceEntry>,
    timeline: &'a StepTimeline,
    /// The layer event the entries belong to now, and its frames.
    k: usize,
    frames: Vec<Frame>,
    /// A free's second entry (PyTorch records a free as requested, then completed).
    pending: Option<TraceEvent>,
    oom: Option<TraceEvent>,
    left: usize,
}

impl Iterator for Events<'_> {
    type Item = TraceEvent;

    fn next(&mut self) -> Option<TraceEvent> {
        let next = self.pending.take().or_else(|| loop {
            let Some(e) = self.entries.next() else {
                break self.oom.take();
            };
            match e.action {
                Action::Mark => {
                    self.k += 1;
                    self.frames = frames_for(self.timeline, self.k);
                }
                Action::Alloc => {
                    break Some(trace_event("alloc", e.addr, e.size, self.frames.clone()))
                }
                Action::Free => {
                    self.pending = Some(trace_event(
                        "free_completed",
                        e.addr,
                        e.size,
                        self.frames.clone(),
                    ));
                    break Some(trace_event(
                        "free_requested",
                        e.addr,
                        e.size,
                        self.frames.clone(),
                    ));
                }
            }
        });
        self.left = self.left.saturating_sub(usize::from(next.is_some()));
        next
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for Events<'_> {}

/// Write `snapshot` as a pickle at `path`, atomically. It is pickled straight into the file: an
/// out-of-memory snapshot is written where memory is short, and the pickle is as large as the
/// snapshot.
pub fn write(path: &Path, snapshot: &MemorySnapshot) -> Result<()> {
    write_pickle(path, snapshot)
}

/// Write the snapshot of `trace` (as [`snapshot`] builds it) as a pickle at `path`, atomically,
/// streamed: each entry of the device trace is made, pickled into the file and dropped, so the
/// heap holds the blocks alive at the trace's end and a write buffer, not the trace's events
/// (a step of a few thousand allocations made tens of MiB of them). The file's bytes are those
/// of [`write`] of [`snapshot`].
///
/// # Errors
/// An incomplete trace, or the file cannot be written.
pub fn write_trace(
    path: &Path,
    trace: &Trace,
    timeline: &StepTimeline,
    oom: Option<OomMark>,
) -> Result<()> {
    let parts = Parts::of(trace, timeline, oom)?;
    let streamed = Streamed {
        segments: parts.segments(),
        events: std::cell::RefCell::new(Some(parts.events())),
    };
    write_pickle(path, &streamed)
}

fn write_pickle(path: &Path, value: &impl Serialize) -> Result<()> {
    use std::io::Write as _;
    crate::io::write_atomic_with(path, |tmp| {
        let file = std::fs::File::create(tmp).map_err(|e| Error::io(path, e))?;
        let mut out = std::io::BufWriter::new(file);
        serde_pickle::to_writer(&mut out, value, serde_pickle::SerOptions::new())
            .map_err(|e| Error::io(path, std::io::Error::other(e.to_string())))?;
        out.flush().map_err(|e| Error::io(path, e))
    })
}

/// A [`MemorySnapshot`] whose one device trace is serialized from an iterator.
struct Streamed<I> {
    segments: Vec<Segment>,
    events: std::cell::RefCell<Option<I>>,
}

impl<I: ExactSizeIterator<Item = TraceEvent>> Serialize for Streamed<I> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::{SerializeSeq as _, SerializeStruct as _};
        /// The list of device traces: one, streamed.
        struct Traces<'b, I>(&'b std::cell::RefCell<Option<I>>);
        impl<I: ExactSizeIterator<Item = TraceEvent>> Serialize for Traces<'_, I> {
            fn serialize<S: serde::Serializer>(
                &self,
                s: S,
            ) -> std::result::Result<S::Ok, S::Error> {
                let mut seq = s.serialize_seq(Some(1))?;
                seq.serialize_element(&Trace1(self.0))?;
                seq.end()
            }
        }
        struct Trace1<'b, I>(&'b std::cell::RefCell<Option<I>>);
        impl<I: ExactSizeIterator<Item = TraceEvent>> Serialize for Trace1<'_, I> {
            fn serialize<S: serde::Serializer>(
                &self,
                s: S,
            ) -> std::result::Result<S::Ok, S::Error> {
                let events = self.0.borrow_mut().take();
                let mut seq = s.serialize_seq(Some(events.as_ref().map_or(0, |e| e.len())))?;
                for e in events.into_iter().flatten() {
                    seq.serialize_element(&e)?;
                }
                seq.end()
            }
        }
        let mut st = s.serialize_struct("MemorySnapshot", 2)?;
        st.serialize_field("segments", &self.segments)?;
        st.serialize_field("device_traces", &Traces(&self.events))?;
        st.end()
    }
}

/// The most bytes alive at once in `snapshot`, replayed as the viewer does: from the segments
/// (the end) back to the start, then forward through the trace.
pub fn replay_peak(snapshot: &MemorySnapshot) -> u64 {
    let end: i128 = snapshot
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == "active_allocated")
        .map(|b| b.size as i128)
        .sum();
    let trace = snapshot.device_traces.first().map_or(&[][..], |t| &t[..]);
    let delta = |e: &TraceEvent| match e.action.as_str() {
        "alloc" => e.size as i128,
        "free_completed" => -(e.size as i128),
        _ => 0,
    };
    let mut now = end - trace.iter().map(delta).sum::<i128>();
    let mut peak = now;
    for e in trace {
        now += delta(e);
        peak = peak.max(now);
    }
    peak.max(0) as u64
}
