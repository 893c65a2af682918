//! The trainer's concerns as observers of the step ([`memtrain_core::step::tape::StepObserver`]): at every
//! layer's end a reading of the memory timeline, split into categories, the CPU budget checked
//! against its peak and the callbacks' `on_layer_end`; at every phase's end the budget checked
//! against the phase's peak, the [`MemoryRecorder`] folding it and the callbacks' hook; the
//! update's event and the step's end ([`StepWatch`]). The evaluation has its own, the budget and
//! `on_layer_end` only ([`EvalBudget`]).

use crate::callbacks::{BatchInfo, Callback, CallbackList, LayerEnd};
use crate::error::{CoreError, Error, Result};
use memtrain_core::memory::timeline::{CategoryBytes, StepTimeline, TimelineEvent, TimelineProbe};
use memtrain_core::memory::{format_bytes, is_device_oom, MemoryLog, MemoryProbe, MemoryRecorder};
use memtrain_core::model::Cnn;
use memtrain_core::phase::Phase;
use memtrain_core::step::micro::MicroResult;
use memtrain_core::step::optim::Optimizer;
use memtrain_core::step::tape::{StepEvent, StepObserver};
use memtrain_core::step::train::Update;
use std::sync::Arc;
use std::time::Instant;

/// What watches a run: what it reads and records of memory, and the callbacks shown it.
pub(crate) struct RunWatch {
    pub(crate) probe: Arc<dyn MemoryProbe>,
    /// The same probe, typed: the step splits its watermark at every layer event.
    pub(crate) timeline_probe: Arc<TimelineProbe>,
    /// The memory timeline of the newest step.
    pub(crate) timeline: StepTimeline,
    /// The run's memory records, read at every phase boundary and handed to the callbacks.
    pub(crate) memory: MemoryRecorder,
    /// Which steps' allocations are traced for the memory snapshot ([`super::viewers`]).
    pub(crate) tracer: super::viewers::StepTracer,
    /// The built-in callbacks, then the caller's.
    pub(crate) callbacks: CallbackList,
    /// The device the step runs on, whose stream the GPU-time marks go on.
    pub(crate) device: candle_core::Device,
    /// The convolution passes' GPU time over the steady steps (CUDA).
    pub(crate) gpu_passes: super::gpu_time::PassTotals,
}

/// The CPU budget of `--memory-limit`: the counting allocator's peak since the last reading
/// must stay within the limit.
pub(super) fn check_budget(
    probe: &dyn MemoryProbe,
    epoch: usize,
    batch: usize,
    phase: Phase,
) -> Result<()> {
    Ok(over_budget(
        probe,
        probe.peak(),
        epoch,
        batch,
        phase.to_string(),
    )?)
}

/// The out-of-memory error when `peak` (the probe's count over a phase or a layer event) is over
/// the probe's budget, or the OS view over its limit: on the CPU the limit is the resident
/// memory as the kernel counts it, and the heap budget under it is what normally runs out first;
/// the OS view catches what the reserve under the budget missed.
fn over_budget(
    probe: &dyn MemoryProbe,
    peak: u64,
    epoch: usize,
    batch: usize,
    phase: String,
) -> Result<(), CoreError> {
    let over_os = |limit: u64| probe.os_memory().is_some_and(|m| m.current > limit);
    let limit = match (probe.os_limit(), probe.limit()) {
        (Some(os), _) if over_os(os) => format!("{} resident-memory", format_bytes(os)),
        (os, Some(budget)) if probe.available() && peak > budget => match os {
            Some(os) => format!(
                "{} heap budget of the {}",
                format_bytes(budget),
                format_bytes(os)
            ),
            None => format_bytes(budget),
        },
        _ => return Ok(()),
    };
    Err(CoreError::OutOfMemory {
        limit,
        epoch,
        batch,
        phase,
        // Filled in by the trainer, which knows the configuration (`Trainer::advise_oom`).
        advice: String::new(),
        report: None,
    })
}

/// The timeline's name of the optimizer event of a step the loss scaler skipped.
pub(super) const SKIPPED_UPDATE: &str = "optimizer (skipped)";

/// `current` bytes split into categories: the step's constant ones (`fixed`), its gradient
/// buffers and saved activations, and the rest as transient. When less is in use than the
/// categories account for (something that was in use at the step's start was freed during it),
/// `other` shrinks, so the categories always add up to `current`.
pub(super) fn split_categories(
    fixed: CategoryBytes,
    grads: u64,
    saved: u64,
    current: u64,
) -> CategoryBytes {
    let step = fixed.params + fixed.optimizer + grads + saved;
    let other = fixed.other.min(current.saturating_sub(step));
    CategoryBytes {
        grads,
        saved,
        other,
        transient: current.saturating_sub(step + other),
        ..fixed
    }
}

/// The step being trained, for the callbacks' contexts and error messages.
#[derive(Debug, Clone, Copy)]
pub(super) struct StepInfo {
    pub(super) epoch: usize,
    pub(super) batch: usize,
    pub(super) global_step: usize,
    pub(super) accum_steps: usize,
    pub(super) images: usize,
    pub(super) lr: f64,
    pub(super) loss_scale: Option<f64>,
    /// When the step began (the timeline's events are timed from here).
    pub(super) started: Instant,
}

impl StepInfo {
    /// The callbacks' context at micro-batch `micro`, before the step's results are known.
    pub(super) fn context<'a>(
        &self,
        micro: usize,
        probe: &'a dyn MemoryProbe,
        memory: &'a MemoryLog,
    ) -> BatchInfo<'a> {
        BatchInfo {
            epoch: self.epoch,
            batch: self.batch,
            global_step: self.global_step,
            micro_batch: micro,
            accum_steps: self.accum_steps,
            images: self.images,
            loss: None,
            correct: None,
            lr: self.lr,
            loss_scale: self.loss_scale,
            skipped: false,
            step_secs: None,
            grad_norm: None,
            probe,
            memory,
        }
    }

    /// Turn a Candle out-of-memory error in `phase` of this step into [`CoreError::OutOfMemory`].
    pub(super) fn name_oom<E: Into<Error>>(
        &self,
        limit: Option<u64>,
        phase: Phase,
    ) -> impl Fn(E) -> Error {
        let (epoch, batch) = (self.epoch, self.batch);
        move |e| match e.into() {
            Error::Core(CoreError::Candle(ce)) if is_device_oom(&ce) => {
                Error::Core(CoreError::OutOfMemory {
                    limit: limit
                        .map(format_bytes)
                        .unwrap_or_else(|| "device memory".into()),
                    epoch,
                    batch,
                    phase: phase.to_string(),
                    advice: String::new(),
                    report: None,
                })
            }
            other => other,
        }
    }
}

/// The trainer's concerns as the observer of one step: at every layer's end a reading of the
/// memory timeline (split into categories), the CPU budget checked against its peak, and the
/// callbacks' `on_layer_end`; at every phase's end the budget checked against the phase's peak,
/// the memory recorder's fold and the callbacks' `on_after_forward` / `on_after_backward`.
pub(super) struct StepWatch<'a> {
    watch: &'a mut RunWatch,
    step: &'a StepInfo,
    /// Categories constant over the step (params, optimizer state, the rest at the start).
    fixed: CategoryBytes,
    events: &'a mut Vec<TimelineEvent>,
    /// Where the step is: the micro-batch and the phase running now.
    pub(super) micro: usize,
    pub(super) phase: Phase,
    /// A callback's error that stopped the step, to report instead of the step's.
    pub(super) failed: Option<Error>,
}

impl<'a> StepWatch<'a> {
    /// The observer of `step`, its events into `events`.
    pub(super) fn new(
        watch: &'a mut RunWatch,
        step: &'a StepInfo,
        fixed: CategoryBytes,
        events: &'a mut Vec<TimelineEvent>,
    ) -> Self {
        StepWatch {
            watch,
            step,
            fixed,
            events,
            micro: 0,
            phase: Phase::Forward,
            failed: None,
        }
    }

    /// The update's event, which goes on the timeline before its budget is judged (so that an
    /// out-of-memory report of this phase shows the failing event), then the budget and the
    /// callbacks' `on_layer_end`. A failed update (`update` an error) records the event only.
    pub(super) fn update_end<U>(&mut self, update: &Result<U>, skipped: bool) -> Result<()> {
        memtrain_core::memory::trace::mark();
        memtrain_kernels::gpu_time::mark(&self.watch.device);
        let probe = &*self.watch.timeline_probe;
        let (peak, current) = (probe.take_event_peak(), probe.current());
        let step = self.step;
        self.events.push(TimelineEvent {
            index: self.events.len(),
            phase: Phase::Optimizer,
            // A step the loss scaler skipped has no update (and no prediction).
            layer: if skipped { SKIPPED_UPDATE } else { "optimizer" }.into(),
            micro_batch: step.accum_steps - 1,
            current_bytes: current,
            peak_bytes: peak,
            categories: split_categories(self.fixed, 0, 0, current),
            predicted_peak_bytes: None,
            predicted_current_bytes: None,
            end_us: Some(step.started.elapsed().as_micros() as u64),
            gpu_us: None,
        });
        if update.is_err() {
            return Ok(());
        }
        check_budget(probe, step.epoch, step.batch, Phase::Optimizer)?;
        let event = self.events.last().expect("the update's event");
        self.watch.callbacks.on_layer_end(&LayerEnd {
            epoch: step.epoch,
            batch: step.batch,
            micro_batch: event.micro_batch,
            phase: Phase::Optimizer,
            layer: &event.layer,
            saved_bytes: 0,
            grad_bytes: 0,
            current_bytes: current,
            peak_bytes: peak,
        })
    }

    /// The step's end: the trace stops where the step's peak does (the next reading folds it),
    /// the recorder closes the step, and the callbacks' `on_batch_end` sees its results.
    pub(super) fn step_end(&mut self, r: MicroResult, update: Update) -> Result<()> {
        let step = self.step;
        self.watch.tracer.end();
        (self.watch.memory).step_end(step.epoch, step.batch, step.global_step);
        let end = BatchInfo {
            loss: Some(r.loss),
            correct: Some(r.correct),
            skipped: update.skipped,
            step_secs: Some(step.started.elapsed().as_secs_f64()),
            grad_norm: Some(update.grad_norm),
            ..step.context(
                step.accum_steps - 1,
                &*self.watch.probe,
                self.watch.memory.log(),
            )
        };
        self.watch.callbacks.on_batch_end(&end)
    }

    /// Record an event with the probe's reading; the budget is checked against its peak.
    fn record(
        &mut self,
        phase: Phase,
        layer: &str,
        saved: u64,
        grads: u64,
    ) -> Result<(), CoreError> {
        memtrain_core::memory::trace::mark();
        memtrain_kernels::gpu_time::mark(&self.watch.device);
        let probe = &*self.watch.timeline_probe;
        let (peak, current) = (probe.take_event_peak(), probe.current());
        self.events.push(TimelineEvent {
            index: self.events.len(),
            phase,
            layer: layer.to_string(),
            micro_batch: self.micro,
            current_bytes: current,
            peak_bytes: peak,
            categories: split_categories(self.fixed, grads, saved, current),
            predicted_peak_bytes: None,
            predicted_current_bytes: None,
            end_us: Some(self.step.started.elapsed().as_micros() as u64),
            gpu_us: None,
        });
        over_budget(
            probe,
            peak,
            self.step.epoch,
            self.step.batch,
            format!("{phase} at {layer}"),
        )?;
        let ctx = LayerEnd {
            epoch: self.step.epoch,
            batch: self.step.batch,
            micro_batch: self.micro,
            phase,
            layer,
            saved_bytes: saved,
            grad_bytes: grads,
            current_bytes: current,
            peak_bytes: peak,
        };
        layer_end(&mut self.watch.callbacks, &ctx, &mut self.failed)
    }
}

impl StepObserver for StepWatch<'_> {
    fn event(&mut self, e: StepEvent<'_>) -> Result<(), CoreError> {
        self.record(e.phase, e.layer, e.saved_bytes, e.grad_bytes)
    }

    fn phase_end(&mut self, micro: usize, phase: Phase) -> Result<(), CoreError> {
        let step = self.step;
        let probe = &*self.watch.timeline_probe;
        over_budget(
            probe,
            probe.peak(),
            step.epoch,
            step.batch,
            phase.to_string(),
        )?;
        self.watch.memory.phase_end(phase);
        let ctx = step.context(micro, probe, self.watch.memory.log());
        let hook = match phase {
            Phase::Forward => self.watch.callbacks.on_after_forward(&ctx),
            _ => self.watch.callbacks.on_after_backward(&ctx),
        };
        (self.micro, self.phase) = match phase {
            Phase::Forward => (micro, Phase::Backward),
            _ if micro + 1 < step.accum_steps => (micro + 1, Phase::Forward),
            _ => (micro, Phase::Optimizer),
        };
        hook.map_err(|e| stopped(e, format!("on_after_{phase}"), &mut self.failed))
    }
}

/// A callback's error `e` kept in `failed` (the step reports it), and the error that stops the
/// step in its place.
fn stopped(e: Error, what: String, failed: &mut Option<Error>) -> CoreError {
    match e {
        Error::Core(e) => e,
        e => {
            *failed = Some(e);
            CoreError::Stopped(what)
        }
    }
}

/// The callbacks' `on_layer_end`; an error of theirs is kept in `failed` (the step reports it)
/// and stops the step.
fn layer_end(
    callbacks: &mut CallbackList,
    ctx: &LayerEnd<'_>,
    failed: &mut Option<Error>,
) -> Result<(), CoreError> {
    callbacks.on_layer_end(ctx).map_err(|e| {
        stopped(
            e,
            format!("on_layer_end at {} {}", ctx.phase, ctx.layer),
            failed,
        )
    })
}

/// The CPU budget checked after every layer of the evaluation, as after every layer of a step,
/// and the callbacks' `on_layer_end`.
pub(super) struct EvalBudget<'a> {
    pub(super) probe: &'a dyn MemoryProbe,
    pub(super) epoch: usize,
    /// The evaluation batch.
    pub(super) batch: usize,
    pub(super) callbacks: &'a mut CallbackList,
    /// A callback's error that stopped the evaluation, to report instead of the tape's.
    pub(super) failed: Option<Error>,
}

impl StepObserver for EvalBudget<'_> {
    fn event(&mut self, e: StepEvent<'_>) -> Result<(), CoreError> {
        let peak = self.probe.peak();
        over_budget(
            self.probe,
            peak,
            self.epoch,
            self.batch,
            format!("{} at {}", e.phase, e.layer),
        )?;
        let ctx = LayerEnd {
            epoch: self.epoch,
            batch: self.batch,
            micro_batch: 0,
            phase: e.phase,
            layer: e.layer,
            saved_bytes: e.saved_bytes,
            grad_bytes: e.grad_bytes,
            current_bytes: self.probe.current(),
            peak_bytes: peak,
        };
        layer_end(self.callbacks, &ctx, &mut self.failed)
    }
}

/// The step's constant memory categories for a step that starts with `start_bytes` in use:
/// parameters and BatchNorm statistics, optimizer state, and the rest of what is in use.
pub(super) fn fixed_categories(
    model: &Cnn,
    optimizer: &Optimizer,
    start_bytes: u64,
) -> CategoryBytes {
    let params = model.state_bytes();
    let optimizer = optimizer.state_bytes();
    CategoryBytes {
        params,
        optimizer,
        other: start_bytes.saturating_sub(params + optimizer),
        ..CategoryBytes::default()
    }
}
