//! One optimizer step of a run: the core's step ([`crate::step::train::train_step`]) with the
//! trainer's concerns as its observer ([`StepWatch`]). At every layer's end the memory timeline
//! records a reading and the CPU budget is checked against its peak; at every phase's end the
//! [`MemoryRecorder`] folds the phase's peak and the callbacks' hook runs with the records; an
//! error is named with the phase it happened in. After the update come pruning and the
//! optimizer's event.

use super::history::StepResult;
use super::Trainer;
use crate::callbacks::{BatchInfo, Callback, CallbackList, LayerEnd};
use crate::config::ClipDuring;
use crate::data::Batch;
use crate::error::{CoreError, Error, Result};
use crate::memory::timeline::{CategoryBytes, StepTimeline, TimelineEvent, TimelineProbe};
use crate::memory::{format_bytes, is_device_oom, MemoryLog, MemoryProbe, MemoryRecorder};
use crate::phase::Phase;
use crate::step::micro::MicroResult;
use crate::step::ops::CandleOps;
use crate::step::optim::one_cycle_lr;
use crate::step::tape::{LeanStep, StepEvent, StepObserver};
use crate::step::train::{self, StepSettings, Update};
use crate::step::BatchInput;
use std::time::Instant;

/// The CPU budget of `--memory-limit`: the counting allocator's peak since the last reading
/// must stay within the limit.
fn check_budget(probe: &dyn MemoryProbe, epoch: usize, batch: usize, phase: Phase) -> Result<()> {
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
fn split_categories(fixed: CategoryBytes, grads: u64, saved: u64, current: u64) -> CategoryBytes {
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
struct StepInfo {
    epoch: usize,
    batch: usize,
    global_step: usize,
    accum_steps: usize,
    images: usize,
    lr: f64,
    loss_scale: Option<f64>,
    /// When the step began (the timeline's events are timed from here).
    started: Instant,
}

impl StepInfo {
    /// The callbacks' context at micro-batch `micro`, before the step's results are known.
    fn context<'a>(
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
    fn name_oom<E: Into<Error>>(&self, limit: Option<u64>, phase: Phase) -> impl Fn(E) -> Error {
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
struct StepWatch<'a> {
    probe: &'a TimelineProbe,
    step: &'a StepInfo,
    memory: &'a mut MemoryRecorder,
    callbacks: &'a mut CallbackList,
    /// Categories constant over the step (params, optimizer state, the rest at the start).
    fixed: CategoryBytes,
    events: &'a mut Vec<TimelineEvent>,
    /// Where the step is: the micro-batch and the phase running now.
    micro: usize,
    phase: Phase,
    /// A callback's error that stopped the step, to report instead of the step's.
    failed: Option<Error>,
}

impl StepWatch<'_> {
    /// Record an event with the probe's reading; the budget is checked against its peak.
    fn record(
        &mut self,
        phase: Phase,
        layer: &str,
        saved: u64,
        grads: u64,
    ) -> Result<(), CoreError> {
        crate::memory::trace::mark();
        let peak = self.probe.take_event_peak();
        let current = self.probe.current();
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
        });
        over_budget(
            self.probe,
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
        layer_end(self.callbacks, &ctx, &mut self.failed)
    }
}

impl StepObserver for StepWatch<'_> {
    fn event(&mut self, e: StepEvent<'_>) -> Result<(), CoreError> {
        self.record(e.phase, e.layer, e.saved_bytes, e.grad_bytes)
    }

    fn phase_end(&mut self, micro: usize, phase: Phase) -> Result<(), CoreError> {
        let step = self.step;
        over_budget(
            self.probe,
            self.probe.peak(),
            step.epoch,
            step.batch,
            phase.to_string(),
        )?;
        self.memory.phase_end(phase);
        let ctx = step.context(micro, self.probe, self.memory.log());
        let hook = match phase {
            Phase::Forward => self.callbacks.on_after_forward(&ctx),
            _ => self.callbacks.on_after_backward(&ctx),
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
        stopped(e, format!("on_layer_end at {} {}", ctx.phase, ctx.layer), failed)
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

impl Trainer {
    /// The step's constant memory categories for a step that starts with `start_bytes` in use:
    /// parameters and BatchNorm statistics, optimizer state, and the rest of what is in use.
    fn fixed_categories(&self, start_bytes: u64) -> CategoryBytes {
        let params = self.model.num_params() as u64 * 4
            + self
                .model
                .named_buffers()
                .iter()
                .map(|(_, t)| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
                .sum::<u64>();
        let optimizer = self.optimizer.state_bytes();
        CategoryBytes {
            params,
            optimizer,
            other: start_bytes.saturating_sub(params + optimizer),
            ..CategoryBytes::default()
        }
    }

    /// One optimizer step on a batch: for each of the K micro-batches the forward phase and the
    /// backward phase, then the optimizer phase, each followed by its memory reading and hook.
    pub fn train_step(
        &mut self,
        batch: &Batch,
        epoch: usize,
        batch_idx: usize,
    ) -> Result<StepResult> {
        let t0 = Instant::now();
        let step = StepInfo {
            started: t0,
            epoch,
            batch: batch_idx,
            global_step: self.position.global_step,
            accum_steps: self.config.steps.accum_steps,
            images: batch.len,
            lr: one_cycle_lr(
                self.position.global_step,
                self.position.total_steps,
                self.config.optimizer.lr,
                self.config.optimizer.warmup_frac,
            ),
            loss_scale: self.scaler.as_ref().map(|s| s.scale),
        };
        // The step's memory timeline; kept outside the step so a failing step leaves the
        // events up to the failure for the OOM report.
        // Reserved for as many events as the step before had: a steady step grows no vector.
        let mut events = Vec::with_capacity(self.watch.timeline.events.len());
        let mut start_bytes = self.watch.probe.current();
        let result = self.step_phases(&step, batch, &mut events, &mut start_bytes, t0);
        // A failed step's trace ends here (a step that ended well stopped it before its end).
        self.watch.tracer.end();
        let mut timeline = StepTimeline {
            label: self.config.label(),
            probe: self.watch.probe.name().to_string(),
            // Numbered from 1, as in batches.csv and memory.json.
            global_step: self.position.global_step + 1,
            start_bytes,
            events,
        };
        timeline.events.shrink_to_fit();
        match result {
            Ok(r) => {
                self.watch.timeline = timeline;
                self.position.global_step += 1;
                self.history
                    .note_storage(self.position.global_step, self.plan.storage);
                self.history
                    .step_times
                    .push(r.images, t0.elapsed().as_secs_f64());
                self.files.snapshots.note_step(&r);
                self.keep_step_trace(step.global_step);
                Ok(r)
            }
            Err(e) if e.is_oom() => {
                let e = self.advise_oom(e);
                if self.files.oom_report {
                    // After the JSON snapshot, which makes the run directory if need be.
                    let e = self.write_oom_report(e, timeline.clone());
                    self.write_oom_pickle(&timeline);
                    Err(e)
                } else {
                    Err(e)
                }
            }
            Err(e) => Err(e),
        }
    }

    /// The error a failed step reports: a non-finite loss or gradient with the run's advice, or
    /// an out-of-memory named with the `phase` it happened in.
    fn step_error(&self, e: CoreError, phase: Phase, step: &StepInfo, limit: Option<u64>) -> Error {
        match e {
            CoreError::NonFinite { what, phase } => Error::NonFinite {
                what: what.into(),
                epoch: step.epoch,
                batch: step.batch,
                phase: phase.to_string(),
                advice: self.divergence_advice(),
            },
            e => step.name_oom(limit, phase)(e),
        }
    }

    /// The step of [`Trainer::train_step`] with its hooks, then pruning and the optimizer's
    /// event; `events` and `start_bytes` receive the timeline as it is made.
    fn step_phases(
        &mut self,
        step: &StepInfo,
        batch: &Batch,
        events: &mut Vec<TimelineEvent>,
        start_bytes: &mut u64,
        t0: Instant,
    ) -> Result<StepResult> {
        let limit = self.config.memory.memory_limit;
        let probe = self.watch.probe.clone();
        self.watch.memory.step_begin();
        // Traced from the moment the step's peak starts (the trace resets the watermark).
        self.watch.tracer.begin(step.global_step);
        self.callbacks
            .on_batch_begin(&step.context(0, &*probe, self.watch.memory.log()))?;
        *start_bytes = probe.current();
        let fixed = self.fixed_categories(*start_bytes);
        let clipping = match self.config.optimizer.clip_during {
            ClipDuring::All => true,
            ClipDuring::FirstEpoch => step.epoch == 0,
        };
        let settings = StepSettings {
            accum_steps: step.accum_steps,
            lr: step.lr,
            clip_grad_norm: self.config.optimizer.clip_grad_norm.filter(|_| clipping),
        };
        let k = step.accum_steps;
        // A captured CUDA graph runs both phases of every micro-batch in one launch.
        let captured = self.cuda_graph.grads(
            self,
            &batch.images,
            &batch.labels,
            step.loss_scale.unwrap_or(1.0),
        );
        let captured = captured
            .transpose()
            .map_err(step.name_oom(limit, Phase::Forward))?;
        let Trainer {
            model,
            config,
            plan,
            callbacks,
            watch,
            device,
            optimizer,
            scaler,
            ..
        } = self;
        let mut obs = StepWatch {
            probe: &watch.timeline_probe,
            step,
            memory: &mut watch.memory,
            callbacks,
            fixed,
            events: &mut *events,
            micro: 0,
            phase: Phase::Forward,
            failed: None,
        };
        let ops = CandleOps::new(model, config.memory.precision.compute_dtype());
        let stepped = match captured {
            // The captured phases' hooks follow the launch.
            Some((loss, correct, grads)) => (0..k)
                .try_for_each(|micro| {
                    obs.phase_end(micro, Phase::Forward)?;
                    obs.phase_end(micro, Phase::Backward)
                })
                .and_then(|()| match loss.is_finite() || scaler.is_some() {
                    true => train::update(&ops, grads, optimizer, scaler.as_mut(), settings),
                    false => Err(CoreError::NonFinite {
                        what: "loss",
                        phase: Phase::Forward,
                    }),
                })
                .map(|update| (MicroResult { loss, correct }, update)),
            None => {
                let batch = BatchInput::Host {
                    images: &batch.images,
                    labels: &batch.labels,
                    device,
                };
                let segments = model.segments(plan.segmentation);
                train::train_step(
                    &mut LeanStep::on(ops, segments, plan.storage),
                    optimizer,
                    scaler.as_mut(),
                    settings,
                    |i| batch.micro_batch(i, k),
                    &mut obs,
                )
            }
        };
        let (failed, phase) = (obs.failed.take(), obs.phase);
        let stepped = match stepped {
            Ok(r) => Ok(r),
            Err(e) => {
                // A failure before the update has no optimizer event.
                let before_update = phase != Phase::Optimizer
                    || matches!(e, CoreError::NonFinite { phase: Phase::Forward, .. });
                let e = failed.unwrap_or_else(|| self.step_error(e, phase, step, limit));
                match before_update {
                    true => return Err(e),
                    false => Err(e),
                }
            }
        };
        // Counted like the schedule's steps: a step the loss scaler skipped is still a step.
        let stepped = stepped.and_then(|r| {
            if let Some(p) = self.pruner.as_mut() {
                p.after_step(self.position.global_step + 1, &self.vars, &mut self.optimizer)?;
            }
            Ok(r)
        });
        if stepped.is_ok() {
            self.device.synchronize()?;
        }
        // The update's event goes on the timeline before its budget is judged, so that an
        // out-of-memory report of this phase shows the failing event.
        crate::memory::trace::mark();
        let peak_bytes = self.watch.timeline_probe.take_event_peak();
        let current = probe.current();
        events.push(TimelineEvent {
            index: events.len(),
            phase: Phase::Optimizer,
            // A step the loss scaler skipped has no update (and no prediction).
            layer: match &stepped {
                Ok((_, Update { skipped: true, .. })) => SKIPPED_UPDATE.into(),
                _ => "optimizer".into(),
            },
            micro_batch: step.accum_steps - 1,
            current_bytes: current,
            peak_bytes,
            categories: split_categories(fixed, 0, 0, current),
            predicted_peak_bytes: None,
            predicted_current_bytes: None,
            end_us: Some(step.started.elapsed().as_micros() as u64),
        });
        let (r, update) = stepped?;
        check_budget(&*probe, step.epoch, step.batch, Phase::Optimizer)?;
        let event = events.last().expect("the update's event");
        self.callbacks.on_layer_end(&LayerEnd {
            epoch: step.epoch,
            batch: step.batch,
            micro_batch: event.micro_batch,
            phase: Phase::Optimizer,
            layer: &event.layer,
            saved_bytes: 0,
            grad_bytes: 0,
            current_bytes: current,
            peak_bytes,
        })?;
        // The trace ends where the step's peak does (the next reading folds it).
        self.watch.tracer.end();
        self.watch
            .memory
            .step_end(step.epoch, step.batch, step.global_step);
        let end = BatchInfo {
            loss: Some(r.loss),
            correct: Some(r.correct),
            skipped: update.skipped,
            step_secs: Some(t0.elapsed().as_secs_f64()),
            grad_norm: Some(update.grad_norm),
            ..step.context(step.accum_steps - 1, &*probe, self.watch.memory.log())
        };
        self.callbacks.on_batch_end(&end)?;
        Ok(StepResult {
            loss: r.loss,
            correct: r.correct,
            images: batch.len,
            skipped: update.skipped,
            lr: step.lr,
        })
    }
}
