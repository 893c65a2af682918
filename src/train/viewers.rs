//! The run's files for other viewers that the trainer writes itself (TensorBoard's is a
//! callback): the allocation trace of one step as PyTorch's memory snapshot, and the step
//! timeline as a Perfetto trace.
//!
//! Which step is traced: the snapshot step (`--memory-snapshot-step`, the run's last by
//! default). When that step runs out of memory, its trace becomes `oom_memory_snapshot.pickle`. Only one
//! step: the trace's buffer is resident memory, which `--memory-limit` counts. Only CPU runs with the counting allocator installed trace: on CUDA the heap
//! is not the memory the step is limited by.

use super::Trainer;
use crate::error::Result;
use crate::export::memviz::{self, OomMark, MEMORY_SNAPSHOT_FILE, OOM_MEMORY_SNAPSHOT_PICKLE};
use crate::export::perfetto::{step_trace, STEP_TRACE_FILE};
use memtrain_core::memory::timeline::StepTimeline;
use memtrain_core::memory::trace::Trace;
use memtrain_core::memory::CountingAllocator;
use std::path::PathBuf;

/// Which steps to trace, and the trace of the step that just ended.
#[derive(Debug, Default)]
pub(crate) struct StepTracer {
    /// The step whose snapshot is written (None: tracing is off for this run).
    snapshot_step: Option<usize>,
    /// The finished trace of the newest traced step.
    taken: Option<Trace>,
    /// The chosen step's trace, kept for the end of the run, with its timeline when that is not
    /// the run's newest (the trace's entries are the system allocator's, in no reading).
    kept: Option<(Trace, Option<StepTimeline>)>,
}

impl StepTracer {
    /// The tracer of a run of `total_steps` steps with `options` on a device read by `probe`;
    /// a `--memory-snapshot-step` past the run is refused.
    pub(crate) fn for_run(
        config: &crate::config::TrainConfig,
        total_steps: usize,
        options: &super::TrainerOptions,
        probe: &dyn memtrain_core::memory::MemoryProbe,
    ) -> Result<Self> {
        if let Some(n) = config
            .output
            .memory_snapshot_step
            .filter(|n| *n == 0 || *n > total_steps)
        {
            return Err(crate::error::Error::config(format!(
                "--memory-snapshot-step {n} is not a step of this run: steps count from 1, as in batches.csv; pick one from 1 to {total_steps} or drop the flag (default: the last step)"
            )));
        }
        let heap = probe.name() == memtrain_core::memory::CPU_HEAP_PROBE && total_steps > 0;
        if config.output.memory_snapshot_step.is_some() && !heap {
            eprintln!("note: --memory-snapshot-step traces the CPU heap; this run's memory is the device's, so no memory_snapshot.pickle is written");
        }
        Ok(StepTracer {
            snapshot_step: (heap && options.log_files).then(|| {
                config
                    .output
                    .memory_snapshot_step
                    .map_or(total_steps - 1, |n| n - 1)
            }),
            taken: None,
            kept: None,
        })
    }

    /// A step begins: trace it when it is chosen (and the counting allocator is installed).
    pub(crate) fn begin(&mut self, global_step: usize) {
        self.taken = None;
        let chosen = self.snapshot_step == Some(global_step);
        if chosen && CountingAllocator::is_installed() && !CountingAllocator::start_trace() {
            eprintln!("warning: the memory snapshot's trace could not start; no snapshot");
        }
    }

    /// The step's measured part ended (or the step failed): stop the trace, keep it.
    pub(crate) fn end(&mut self) {
        if memtrain_core::memory::trace::ON.load(std::sync::atomic::Ordering::Relaxed) {
            self.taken = CountingAllocator::stop_trace();
        }
    }
}

impl Trainer {
    /// After a step that ended well: keep its trace when it is the chosen step. The snapshot is
    /// written at the end of the run ([`Trainer::write_memory_snapshot`]), after the last memory
    /// reading: building it allocates megabytes that no phase of the run should count.
    pub(super) fn keep_step_trace(&mut self, global_step: usize) {
        let Some(trace) = self.watch.tracer.taken.take() else {
            return;
        };
        if self.watch.tracer.snapshot_step != Some(global_step) {
            return;
        }
        // The run's last step's timeline stays the trainer's; an earlier one's is kept here.
        let timeline =
            (global_step + 1 < self.position.total_steps).then(|| self.watch.timeline.clone());
        self.watch.tracer.kept = Some((trace, timeline));
    }

    /// `memory_snapshot.pickle` of the chosen step, when it was trained.
    pub(super) fn write_memory_snapshot(&mut self) {
        let Some((trace, timeline)) = self.watch.tracer.kept.take() else {
            return;
        };
        let path = self.files.run_dir.join(MEMORY_SNAPSHOT_FILE);
        let timeline = timeline.as_ref().unwrap_or(&self.watch.timeline);
        if let Err(e) = write_snapshot(&path, &trace, timeline, None) {
            eprintln!("warning: {MEMORY_SNAPSHOT_FILE} not written: {e}");
        }
    }

    /// After a step that ran out of memory: stop its trace and write its memory snapshot next
    /// to the JSON one; the path when written.
    pub(super) fn write_oom_pickle(&mut self, timeline: &StepTimeline) -> Option<PathBuf> {
        self.watch.tracer.end();
        let trace = self.watch.tracer.taken.take()?;
        let limit = self.config.memory.memory_limit?;
        let path = self.files.run_dir.join(OOM_MEMORY_SNAPSHOT_PICKLE);
        let oom = OomMark {
            limit,
            peak: trace.peak_bytes(),
        };
        match write_snapshot(&path, &trace, timeline, Some(oom)) {
            Ok(()) => Some(path),
            Err(e) => {
                eprintln!("warning: {OOM_MEMORY_SNAPSHOT_PICKLE} not written: {e}");
                None
            }
        }
    }

    /// `step_trace.json` of the newest step's timeline.
    pub(super) fn write_step_trace(&self) -> Result<()> {
        crate::io::write_json_atomic(
            &self.files.run_dir.join(STEP_TRACE_FILE),
            &step_trace(&self.watch.timeline),
        )
    }
}

fn write_snapshot(
    path: &std::path::Path,
    trace: &Trace,
    timeline: &StepTimeline,
    oom: Option<OomMark>,
) -> Result<()> {
    memviz::write_trace(path, trace, timeline, oom)
}
