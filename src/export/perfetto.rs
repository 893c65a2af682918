//! The step timeline in the Trace Event Format (`step_trace.json`), which Perfetto
//! (ui.perfetto.dev) and chrome://tracing open: one complete slice per layer event (forward,
//! backward, recompute, optimizer) lasting from the previous event to it, and counter tracks of
//! the memory by category at every event, the same bytes as `step_timeline.json`.

use memtrain_core::memory::timeline::{StepTimeline, TimelineEvent};
use memtrain_core::phase::Phase;
use serde_json::{json, Value};

/// File name of the trace in a run directory.
pub const STEP_TRACE_FILE: &str = "step_trace.json";

/// Name of the counter track of memory by category.
pub const MEMORY_COUNTER: &str = "memory by category (bytes)";
/// Name of the counter track of the highest bytes in use since the previous event.
pub const PEAK_COUNTER: &str = "peak since the previous event (bytes)";

/// The slice's category: `forward`, `backward`, `recompute` or `optimizer`.
fn category(e: &TimelineEvent) -> &'static str {
    match e.phase {
        _ if e.layer.contains("recompute") => "recompute",
        Phase::Forward => "forward",
        Phase::Backward => "backward",
        Phase::Optimizer => "optimizer",
        Phase::Eval | Phase::Other => "other",
    }
}

/// The trace of `timeline`: metadata naming the process and thread, then per event a complete
/// slice (`ph: X`, µs) and two counter samples (`ph: C`) at its end.
pub fn step_trace(timeline: &StepTimeline) -> Value {
    let (pid, tid) = (1, 1);
    let mut events = vec![
        json!({"name": "process_name", "ph": "M", "pid": pid,
               "args": {"name": format!("memtrain {}", timeline.label)}}),
        json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
               "args": {"name": format!("step {} ({})", timeline.global_step, timeline.probe)}}),
    ];
    let mut start = 0u64;
    for e in &timeline.events {
        let end = e.end_us.unwrap_or(start).max(start);
        let c = &e.categories;
        events.push(json!({
            "name": e.layer, "cat": category(e), "ph": "X", "ts": start, "dur": end - start,
            "pid": pid, "tid": tid,
            "args": {"index": e.index, "phase": e.phase.to_string(), "micro_batch": e.micro_batch,
                     "current_bytes": e.current_bytes, "peak_bytes": e.peak_bytes},
        }));
        events.push(json!({
            "name": MEMORY_COUNTER, "ph": "C", "ts": end, "pid": pid,
            "args": {"parameters": c.params, "gradients": c.grads,
                     "optimizer state": c.optimizer, "saved activations": c.saved,
                     "transient": c.transient, "other": c.other},
        }));
        events.push(json!({
            "name": PEAK_COUNTER, "ph": "C", "ts": end, "pid": pid,
            "args": {"peak": e.peak_bytes},
        }));
        start = end;
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"label": timeline.label, "global_step": timeline.global_step,
                         "start_bytes": timeline.start_bytes}})
}
