//! One optimizer step as a plain sequence of phases: for each micro-batch the forward phase and
//! the backward phase ([`crate::step::tape`], through the one micro-batch loop
//! [`crate::step::for_each_micro_batch`]), then the optimizer phase. After each phase the CPU
//! budget is checked, the [`MemoryRecorder`] folds the phase's peak and the callbacks' hook runs
//! with the records; an error in a phase is named with it. Inside the phases, every layer event
//! is a reading of the step's memory timeline.

use super::history::StepResult;
use super::Trainer;
use crate::callbacks::{BatchInfo, Callback, CallbackList, LayerEnd};
use crate::config::ClipDuring;
use crate::data::Batch;
use crate::error::{CoreError, Error, Result};
use crate::memory::timeline::{CategoryBytes, StepTimeline, TimelineEvent, TimelineProbe};
use crate::memory::{format_bytes, is_device_oom, MemoryLog, MemoryProbe, MemoryRecorder};
use crate::phase::Phase;
use crate::step::accumulate::GradAccumulator;
use crate::step::optim::one_cycle_lr;
use crate::step::tape::{LeanStep, StepEvent, StepObserver};
use crate::step::{for_each_micro_batch, BatchInput, MicroResult};
use candle_core::{DType, Tensor};
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

/// The squared global L2 norm of the gradients; not finite when any gradient is not.
fn squared_norm(grads: &[Option<Tensor>]) -> Result<f64> {
    let mut sum = 0f64;
    for g in grads.iter().flatten() {
        sum += g
            .sqr()?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
    }
    Ok(sum)
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

/// The end of a forward or backward phase of micro-batch `micro`: the CPU budget is checked
/// against the peak since the last boundary, the memory recorder folds that peak into the phase,
/// and the callbacks' hook runs with the record.
fn phase_end(
    callbacks: &mut CallbackList,
    memory: &mut MemoryRecorder,
    probe: &dyn MemoryProbe,
    step: &StepInfo,
    micro: usize,
    phase: Phase,
) -> Result<()> {
    check_budget(probe, step.epoch, step.batch, phase)?;
    memory.phase_end(phase);
    let ctx = step.context(micro, probe, memory.log());
    match phase {
        Phase::Forward => callbacks.on_after_forward(&ctx),
        Phase::Backward => callbacks.on_after_backward(&ctx),
        Phase::Optimizer | Phase::Eval | Phase::Other => Ok(()),
    }
}

/// The memory timeline of a step as its layer events come in: each event's reading, split into
/// categories, the CPU budget checked against the event's peak, and the callbacks'
/// `on_layer_end`.
struct TimelineRecorder<'a> {
    probe: &'a TimelineProbe,
    step: &'a StepInfo,
    micro: usize,
    /// Categories constant over the step (params, optimizer state, the rest at the start).
    fixed: CategoryBytes,
    events: &'a mut Vec<TimelineEvent>,
    callbacks: &'a mut CallbackList,
    /// A callback's error that stopped the step, to report instead of the tape's.
    failed: Option<Error>,
}

impl TimelineRecorder<'_> {
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

impl StepObserver for TimelineRecorder<'_> {
    fn event(&mut self, e: StepEvent<'_>) -> Result<(), CoreError> {
        self.record(e.phase, e.layer, e.saved_bytes, e.grad_bytes)
    }
}

/// The callbacks' `on_layer_end`; an error of theirs is kept in `failed` (the step reports it)
/// and stops the step.
fn layer_end(
    callbacks: &mut CallbackList,
    ctx: &LayerEnd<'_>,
    failed: &mut Option<Error>,
) -> Result<(), CoreError> {
    match callbacks.on_layer_end(ctx) {
        Ok(()) => Ok(()),
        Err(Error::Core(e)) => Err(e),
        Err(e) => {
            let what = format!("on_layer_end at {} {}", ctx.phase, ctx.layer);
            *failed = Some(e);
            Err(CoreError::Stopped(what))
        }
    }
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

    /// The phases of [`Trainer::train_step`] in order, with their hooks; `events` and
    /// `start_bytes` receive the timeline as it is made.
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
        let (loss, correct, grads) = self.forward_backward(step, batch, fixed, events)?;
        if !loss.is_finite() && self.scaler.is_none() {
            return Err(Error::NonFinite {
                what: "loss".into(),
                epoch: step.epoch,
                batch: step.batch,
                phase: "forward".into(),
                advice: self.divergence_advice(),
            });
        }
        let update = self
            .apply_update(grads, step)
            .map_err(step.name_oom(limit, Phase::Optimizer));
        if update.is_ok() {
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
            layer: if matches!(update, Ok((true, _))) {
                SKIPPED_UPDATE.into()
            } else {
                "optimizer".into()
            },
            micro_batch: step.accum_steps - 1,
            current_bytes: current,
            peak_bytes,
            categories: split_categories(fixed, 0, 0, current),
            predicted_peak_bytes: None,
            predicted_current_bytes: None,
            end_us: Some(step.started.elapsed().as_micros() as u64),
        });
        let (skipped, grad_norm) = update?;
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
            loss: Some(loss),
            correct: Some(correct),
            skipped,
            step_secs: Some(t0.elapsed().as_secs_f64()),
            grad_norm: Some(grad_norm),
            ..step.context(step.accum_steps - 1, &*probe, self.watch.memory.log())
        };
        self.callbacks.on_batch_end(&end)?;
        Ok(StepResult {
            loss,
            correct,
            images: batch.len,
            skipped,
            lr: step.lr,
        })
    }

    /// The forward and backward phases of every micro-batch of a batch (the loss multiplied by
    /// the loss scale, the gradients still scaled): `(mean loss, correct, f32 gradients)`.
    fn forward_backward(
        &mut self,
        step: &StepInfo,
        batch: &Batch,
        fixed: CategoryBytes,
        events: &mut Vec<TimelineEvent>,
    ) -> Result<(f64, usize, Vec<Option<Tensor>>)> {
        let limit = self.config.memory.memory_limit;
        let k = step.accum_steps;
        if let Some(r) = self.cuda_graph.grads(
            self,
            &batch.images,
            &batch.labels,
            step.loss_scale.unwrap_or(1.0),
        ) {
            // One launch ran both phases of every micro-batch; their hooks follow it.
            let r = r.map_err(step.name_oom(limit, Phase::Forward))?;
            let probe = self.watch.probe.clone();
            for micro in 0..k {
                for phase in [Phase::Forward, Phase::Backward] {
                    phase_end(
                        &mut self.callbacks,
                        &mut self.watch.memory,
                        &*probe,
                        step,
                        micro,
                        phase,
                    )?;
                }
            }
            return Ok(r);
        }
        let mut acc = GradAccumulator::new(self.vars.len());
        // The lean step borrows the model while the hooks borrow the callbacks and the recorder:
        // disjoint fields.
        let Trainer {
            model,
            config,
            plan,
            callbacks,
            watch,
            device,
            ..
        } = self;
        let (memory, probe, timeline_probe) =
            (&mut watch.memory, &watch.probe, &watch.timeline_probe);
        let batch = BatchInput::Host {
            images: &batch.images,
            labels: &batch.labels,
            device,
        };
        let results = for_each_micro_batch(batch, k, step.loss_scale.unwrap_or(1.0), |mb| {
            let mut lean = LeanStep::new(
                model,
                config.memory.precision.compute_dtype(),
                model.segments(plan.segmentation),
                plan.storage,
            );
            let mut timeline = TimelineRecorder {
                probe: timeline_probe,
                step,
                micro: mb.index,
                fixed,
                events: &mut *events,
                callbacks: &mut *callbacks,
                failed: None,
            };
            let forward = lean.forward(&mb.x, &mb.y, mb.loss_mult, &acc, &mut timeline);
            let (r, tape) = forward.map_err(|e| {
                (timeline.failed.take()).unwrap_or_else(|| step.name_oom(limit, Phase::Forward)(e))
            })?;
            let cbs = &mut *timeline.callbacks;
            phase_end(cbs, memory, &**probe, step, mb.index, Phase::Forward)?;
            let backward = lean.backward(tape, &mut acc, &mut timeline);
            backward.map_err(|e| {
                (timeline.failed.take()).unwrap_or_else(|| step.name_oom(limit, Phase::Backward)(e))
            })?;
            let cbs = &mut *timeline.callbacks;
            phase_end(cbs, memory, &**probe, step, mb.index, Phase::Backward)?;
            Ok::<_, Error>(r)
        })?;
        let r = MicroResult::mean(&results);
        Ok((r.loss, r.correct, acc.into_grads()))
    }

    /// The optimizer phase: unscale (f16), check finiteness, clip, step. Returns whether the loss
    /// scaler skipped the step, and the gradients' global norm before clipping.
    fn apply_update(&mut self, grads: Vec<Option<Tensor>>, step: &StepInfo) -> Result<(bool, f64)> {
        let grads = match step.loss_scale {
            Some(s) => crate::step::precision::unscale(grads, s)?,
            None => grads,
        };
        let squared = squared_norm(&grads)?;
        let finite = squared.is_finite();
        // Clipping by the global norm (PyTorch's `clip_grad_norm_`): the whole step shrinks, its
        // direction is kept. A non-finite step is left to the scaler or the error below.
        let clipping = match self.config.optimizer.clip_during {
            ClipDuring::All => true,
            ClipDuring::FirstEpoch => step.epoch == 0,
        };
        let grads = match self.config.optimizer.clip_grad_norm {
            Some(max) if clipping && finite && squared.sqrt() > max => {
                let factor = max / squared.sqrt();
                grads
                    .into_iter()
                    .map(|g| g.map(|g| g * factor).transpose())
                    .collect::<candle_core::Result<Vec<_>>>()?
            }
            _ => grads,
        };
        let apply = match self.scaler.as_mut() {
            Some(s) => s.update(finite),
            None if !finite => {
                return Err(Error::NonFinite {
                    what: "gradient".into(),
                    epoch: step.epoch,
                    batch: step.batch,
                    phase: "backward".into(),
                    advice: self.divergence_advice(),
                })
            }
            None => true,
        };
        if apply {
            self.optimizer.step(&self.vars, &grads, step.lr)?;
        }
        drop(grads);
        // Counted like the schedule's steps: a step the loss scaler skipped is still a step.
        if let Some(p) = self.pruner.as_mut() {
            p.after_step(
                self.position.global_step + 1,
                &self.vars,
                &mut self.optimizer,
            )?;
        }
        Ok((!apply, squared.sqrt()))
    }
}
