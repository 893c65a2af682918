//! One optimizer step of a run: the core's step ([`memtrain_core::step::train::train_step`]) with the
//! trainer's concerns as its observer ([`StepWatch`]), then pruning, the update's event and the
//! step's end. A failed step is named with the phase it failed in; an out-of-memory one leaves
//! its report ([`super::diagnose`]).

use super::history::StepResult;
use super::watch::{fixed_categories, StepInfo, StepWatch};
use super::Trainer;
use crate::callbacks::Callback;
use crate::config::ClipDuring;
use crate::data::Batch;
use crate::error::{CoreError, Error, Result};
use memtrain_core::memory::timeline::{StepTimeline, TimelineEvent};
use memtrain_core::phase::Phase;
use memtrain_core::step::micro::MicroResult;
use memtrain_core::step::ops::CandleOps;
use memtrain_core::step::optim::one_cycle_lr;
use memtrain_core::step::tape::{LeanStep, StepObserver};
use memtrain_core::step::train::{self, StepSettings, Update};
use memtrain_core::step::BatchInput;
use std::time::Instant;

impl Trainer {
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
            loss_scale: self.updater.scaler.as_ref().map(|s| s.scale),
        };
        // The step's memory timeline; kept outside the step so a failing step leaves the
        // events up to the failure for the OOM report.
        // Reserved for as many events as the step before had: a steady step grows no vector.
        let mut events = Vec::with_capacity(self.watch.timeline.events.len());
        let mut start_bytes = self.watch.probe.current();
        // A failed step's GPU-time readings go; this step's are timed from here.
        memtrain_kernels::gpu_time::take();
        memtrain_kernels::gpu_time::mark(&self.watch.device);
        let result = self.step_phases(&step, batch, &mut events, &mut start_bytes);
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
                super::gpu_time::read_step(
                    memtrain_kernels::gpu_time::take(),
                    &mut timeline,
                    step.global_step >= super::gpu_time::warmup_steps(self.position.total_steps),
                    &mut self.watch.gpu_passes,
                );
                self.watch.timeline = timeline;
                self.position.global_step += 1;
                self.position
                    .history
                    .note_storage(self.position.global_step, self.storage()?);
                self.position
                    .history
                    .step_times
                    .push(r.images, t0.elapsed().as_secs_f64());
                self.files.snapshots.note_step(&r);
                self.keep_step_trace(step.global_step);
                Ok(r)
            }
            Err(e) if e.is_oom() => Err(self.report_oom(e, timeline)),
            Err(e) => Err(e),
        }
    }

    /// The step of [`Trainer::train_step`] with its hooks, then pruning, the update's event and
    /// the step's end; `events` and `start_bytes` receive the timeline as it is made.
    fn step_phases(
        &mut self,
        step: &StepInfo,
        batch: &Batch,
        events: &mut Vec<TimelineEvent>,
        start_bytes: &mut u64,
    ) -> Result<StepResult> {
        let limit = self.config.memory.memory_limit;
        self.watch.memory.step_begin();
        // Traced from the moment the step's peak starts (the trace resets the watermark).
        self.watch.tracer.begin(step.global_step);
        let probe = self.watch.probe.clone();
        (self.watch.callbacks).on_batch_begin(&step.context(
            0,
            &*probe,
            self.watch.memory.log(),
        ))?;
        *start_bytes = probe.current();
        let fixed = fixed_categories(&self.model, &self.updater.optimizer, *start_bytes);
        let clipping = match self.config.optimizer.clip_during {
            ClipDuring::All => true,
            ClipDuring::FirstEpoch => step.epoch == 0,
        };
        let settings = StepSettings {
            accum_steps: step.accum_steps,
            lr: step.lr,
            clip_grad_norm: self.config.optimizer.clip_grad_norm.filter(|_| clipping),
        };
        // A captured CUDA graph runs both phases of every micro-batch in one launch.
        let loss_scale = step.loss_scale.unwrap_or(1.0);
        let captured = (self.cuda_graph)
            .grads(self, &batch.images, &batch.labels, loss_scale)
            .transpose()
            .map_err(step.name_oom(limit, Phase::Forward))?;
        let (segmentation, storage) = (self.segmentation()?, self.storage()?);
        let (stepped, failed, phase) = {
            let Trainer {
                model,
                config,
                watch,
                updater,
                ..
            } = self;
            let mut obs = StepWatch::new(watch, step, fixed, events);
            let ops = CandleOps::new(model, config.memory.precision.compute_dtype());
            let k = step.accum_steps;
            let stepped = match captured {
                // The captured phases' hooks follow the launch.
                Some((loss, correct, grads)) => (0..k)
                    .try_for_each(|micro| {
                        obs.phase_end(micro, Phase::Forward)?;
                        obs.phase_end(micro, Phase::Backward)
                    })
                    .and_then(|()| train::update(&ops, loss, grads, updater, settings))
                    .map(|update| (MicroResult { loss, correct }, update)),
                None => {
                    let batch = BatchInput::Host {
                        images: &batch.images,
                        labels: &batch.labels,
                        device: model.device(),
                    };
                    train::train_step(
                        &mut LeanStep::on(ops, model.segments(segmentation), storage),
                        updater,
                        settings,
                        |i| batch.micro_batch(i, k),
                        &mut obs,
                    )
                }
            };
            (stepped, obs.failed.take(), obs.phase)
        };
        let stepped = stepped.map_err(|e| {
            // A failure before the update (a non-finite loss too) has no update event.
            let before = phase != Phase::Optimizer
                || matches!(
                    e,
                    CoreError::NonFinite {
                        phase: Phase::Forward,
                        ..
                    }
                );
            let e = failed.unwrap_or_else(|| self.step_error(e, phase, step, limit));
            (before, e)
        });
        let stepped = match stepped {
            Err((true, e)) => return Err(e),
            r => r.map_err(|(_, e)| e),
        };
        // Counted like the schedule's steps: a step the loss scaler skipped is still a step.
        let stepped = stepped.and_then(|r| {
            if let Some(p) = self.pruner.as_mut() {
                p.after_step(
                    step.global_step + 1,
                    &self.model,
                    &mut self.updater.optimizer,
                )?;
            }
            Ok(r)
        });
        if stepped.is_ok() {
            self.model.device().synchronize()?;
        }
        let skipped = matches!(stepped, Ok((_, Update { skipped: true, .. })));
        let mut obs = StepWatch::new(&mut self.watch, step, fixed, events);
        obs.update_end(&stepped, skipped)?;
        let (r, update) = stepped?;
        obs.step_end(r, update)?;
        Ok(StepResult {
            loss: r.loss,
            correct: r.correct,
            images: batch.len,
            skipped: update.skipped,
            lr: step.lr,
        })
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
}
