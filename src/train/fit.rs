//! The training loop: epochs of steps, an evaluation after each epoch, a snapshot at each epoch
//! end (and every `--save-every` steps), and the callbacks' hooks around all of it. The step is
//! [`super::step`]; resuming, failure reports, pruning and the summary are their own modules,
//! which the loop calls.

use super::history::EpochProgress;
use super::summary::Summary;
use super::watch::EvalBudget;
use super::Trainer;
use crate::callbacks::{Callback, EpochBegin, EpochEnd, EpochStats, TrainBegin, TrainEnd};
use crate::data::{Batcher, BatcherOptions, Dataset};
use crate::error::{Error, Result};
use candle_core::Tensor;
use memtrain_core::device::device_name;
use memtrain_core::step::tape::LeanStep;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

impl Trainer {
    /// Mean loss and top-1 accuracy on `data` (running BatchNorm statistics, nothing saved), in
    /// micro-batches, through the step's own tape ([`LeanStep::evaluate`]), which the estimate
    /// sizes as the run's evaluation phase; the CPU budget is checked after every layer, as in a
    /// step. `None` when a stop was requested before or during it (checked between batches).
    pub(crate) fn evaluate(
        &mut self,
        data: &Arc<Dataset>,
        epoch: usize,
    ) -> Result<Option<(f64, f64)>> {
        let bs = self.config.micro_batch().max(1);
        let batcher = Batcher::new(
            data.clone(),
            BatcherOptions {
                batch_size: bs,
                shuffle: false,
                augment: false,
                drop_last: false,
                seed: self.config.seed,
                epoch: 0,
                prefetch: self.config.prefetch_batches(self.model.device().is_cuda()),
                start_batch: 0,
                // The training batches' buffers: evaluation needs no more of its own.
                recycle: Some(self.data.batch_buffers.clone()),
            },
        );
        let dtype = self.config.memory.precision.compute_dtype();
        let storage = self.storage()?;
        let (mut loss_sum, mut correct, mut n) = (0.0, 0usize, 0usize);
        for b in batcher {
            if self.stop_requested() {
                return Ok(None);
            }
            let x = Tensor::from_slice(&b.images, (b.len, 3, 32, 32), self.model.device())?;
            let y = Tensor::from_slice(&b.labels, b.len, self.model.device())?;
            let mut budget = EvalBudget {
                probe: &*self.watch.probe,
                epoch,
                batch: b.index,
                callbacks: &mut self.watch.callbacks,
                failed: None,
            };
            let r = LeanStep::new(
                &self.model,
                dtype,
                self.model.segments(crate::config::Segmentation::NONE),
                storage,
            )
            .evaluate(x, &y, &mut budget);
            let r = match (r, budget.failed.take()) {
                (Ok(r), _) => r,
                (Err(_), Some(callback)) => return Err(callback),
                (Err(e), None) => return Err(self.advise_oom(e)),
            };
            drop(y);
            loss_sum += r.loss * b.len as f64;
            correct += r.correct;
            n += b.len;
            self.data.batch_buffers.put(b.images);
        }
        if n == 0 {
            return Ok(Some((f64::NAN, 0.0)));
        }
        Ok(Some((loss_sum / n as f64, correct as f64 / n as f64)))
    }

    fn stop_requested(&self) -> bool {
        self.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst))
    }

    /// Train for the configured epochs (or `--max-steps`), evaluating after each epoch.
    ///
    /// A stop request is honoured between steps, between evaluation batches and after every
    /// snapshot write; the run then saves a snapshot of exactly where it is (an epoch whose
    /// evaluation was cut short is evaluated again on resume) and returns status `interrupted`.
    /// A resumed trainer (see [`Trainer::resume`]) continues the run's
    /// history, so the summary, epoch table and memory log describe the whole run.
    pub fn fit(&mut self) -> Result<Summary> {
        let result = self.fit_inner();
        if let Err(Error::NonFinite { .. }) = &result {
            // The advice in the error names the healthy snapshot this leaves as the newest.
            self.files.snapshots.set_aside_diverged(&self.files.run_dir);
        }
        result
    }

    fn fit_inner(&mut self) -> Result<Summary> {
        let wall = Instant::now();
        self.train_begin()?;
        // The epoch cut short by an interruption or by --max-steps, for this process's summary
        // and callbacks.
        let mut cut_short: Option<EpochStats> = None;
        let mut interrupted = false;
        let mut epoch = self.position.start_epoch;
        while epoch < self.config.steps.epochs {
            if self.stop_requested() {
                cut_short = Some(EpochStats::default());
                interrupted = true;
                break;
            }
            match self.run_epoch(epoch)? {
                EpochEnded::Nothing => break,
                EpochEnded::Interrupted(stats) => {
                    cut_short = Some(stats);
                    interrupted = true;
                    break;
                }
                EpochEnded::MaxSteps(stats) => {
                    cut_short = Some(stats);
                    break;
                }
                EpochEnded::Done => {}
            }
            epoch += 1;
            self.position.start_batch = 0;
        }
        self.train_end(epoch, cut_short, interrupted, wall)
    }

    /// The run's beginning: the memory recorder's and the callbacks'.
    fn train_begin(&mut self) -> Result<()> {
        let dev_name = device_name(self.model.device());
        self.watch.memory.train_begin();
        self.watch.callbacks.on_train_begin(&TrainBegin {
            config: &self.config,
            run_dir: &self.files.run_dir,
            device: &dev_name,
            num_params: self.model.num_params(),
            steps_per_epoch: self.position.steps_per_epoch,
            total_steps: self.position.total_steps,
            global_step: self.position.global_step,
            start_epoch: self.position.start_epoch,
            ended_epochs: &self.position.history.epochs,
            train_images: self.data.train.len(),
            eval_images: self.data.eval.len(),
            probe: &*self.watch.probe,
            memory: self.watch.memory.log(),
        })
    }

    /// One epoch: its steps (from `start_batch` when it is the epoch the run starts in), its
    /// evaluation, its end hooks and its snapshot.
    fn run_epoch(&mut self, epoch: usize) -> Result<EpochEnded> {
        let cfg = self.config.clone();
        let first = if epoch == self.position.start_epoch {
            self.position.start_batch
        } else {
            0
        };
        // An epoch begun by an earlier process continues its sums (and may only lack its
        // evaluation: then no step is left to train, but the epoch still ends).
        let carried = self
            .position
            .history
            .progress
            .take()
            .filter(|p| p.epoch == epoch);
        let steps = (self.position.steps_per_epoch - first)
            .min(self.position.total_steps - self.position.global_step);
        if steps == 0 && carried.is_none() {
            return Ok(EpochEnded::Nothing);
        }
        self.watch
            .memory
            .epoch_begin(epoch, cfg.output.reset_peak_each_epoch);
        self.watch.callbacks.on_epoch_begin(&EpochBegin {
            epoch,
            num_epochs: cfg.steps.epochs,
            steps,
            global_step: self.position.global_step,
            reset_peak: cfg.output.reset_peak_each_epoch,
            probe: &*self.watch.probe,
            memory: self.watch.memory.log(),
        })?;
        let mut progress = carried.unwrap_or_else(|| EpochProgress::new(epoch, cfg.optimizer.lr));
        let (next, mut interrupted) = self.train_steps(epoch, first, steps, &mut progress)?;
        let eval = if cfg.output.eval && !interrupted {
            let e = self.evaluate(&self.data.eval.clone(), epoch)?;
            interrupted = e.is_none();
            e
        } else {
            None
        };
        let loss_scale = self.updater.scaler.as_ref().map(|s| s.scale);
        let evaluated = eval.is_some();
        let stats = progress.stats(eval, loss_scale);
        self.watch.memory.epoch_end(epoch, evaluated);
        self.watch.callbacks.on_epoch_end(&EpochEnd {
            stats: &stats,
            num_epochs: cfg.steps.epochs,
            probe: &*self.watch.probe,
            memory: self.watch.memory.log(),
        })?;
        if interrupted {
            // A snapshot of exactly here: the resumed run finishes this epoch's steps (if any
            // are left) and evaluates it.
            self.position.start_batch = next;
            self.save_snapshot(epoch, next, Some(&progress))?;
            return Ok(EpochEnded::Interrupted(stats));
        }
        if next < self.position.steps_per_epoch {
            // Cut short by --max-steps: this run reports the part it trained, but the epoch has
            // not ended. The snapshot keeps it in progress, so that a longer --max-steps
            // continues it and ends it once (one row in epochs.csv, one ended epoch).
            self.save_snapshot(epoch, next, Some(&progress))?;
            return Ok(EpochEnded::MaxSteps(stats));
        }
        self.position.history.epochs.push(stats);
        self.save_snapshot(epoch + 1, 0, None)?;
        Ok(EpochEnded::Done)
    }

    /// `steps` steps of `epoch` from batch `first`, added to `progress`, with a snapshot every
    /// `--save-every` steps. Returns the next batch and whether a stop request ended them early.
    fn train_steps(
        &mut self,
        epoch: usize,
        first: usize,
        steps: usize,
        progress: &mut EpochProgress,
    ) -> Result<(usize, bool)> {
        let cfg = &self.config;
        let batcher = Batcher::new(
            self.data.train.clone(),
            BatcherOptions {
                batch_size: cfg.steps.batch_size,
                shuffle: true,
                augment: cfg.data.augment,
                drop_last: true,
                seed: cfg.seed,
                epoch,
                prefetch: cfg.prefetch_batches(self.model.device().is_cuda()),
                start_batch: first,
                recycle: Some(self.data.batch_buffers.clone()),
            },
        );
        let save_every = cfg.output.save_every;
        let mut next = first;
        // Seconds from step to step, waiting for data and writing snapshots included.
        let mut tick = Instant::now();
        for batch in batcher.take(steps) {
            let r = self.train_step(&batch, epoch, batch.index)?;
            next = batch.index + 1;
            self.data.batch_buffers.put(batch.images);
            let secs = tick.elapsed().as_secs_f64();
            tick = Instant::now();
            progress.add(&r);
            progress.train_secs += secs;
            self.position.history.images += r.images;
            self.position.history.train_secs += secs;
            // A snapshot every --save-every steps (a state is never saved twice).
            if save_every > 0 && self.position.global_step.is_multiple_of(save_every) {
                self.save_snapshot(epoch, next, Some(progress))?;
            }
            if self.stop_requested() {
                return Ok((next, true));
            }
        }
        Ok((next, false))
    }

    /// The run's end at `epoch`, with the epoch `cut_short` by a stop request (`interrupted`) or
    /// by `--max-steps`: a snapshot of the start for a run stopped before its first step,
    /// pruning's files, the summary, the end hooks and the run's last files.
    fn train_end(
        &mut self,
        epoch: usize,
        cut_short: Option<EpochStats>,
        interrupted: bool,
        wall: Instant,
    ) -> Result<Summary> {
        if interrupted && self.files.snapshots.last_step().is_none() {
            // Stopped before the first step: a snapshot of the start, so --resume can finish.
            self.save_snapshot(epoch, self.position.start_batch, None)?;
        }
        self.position.start_epoch = epoch;
        let pruning = self.finish_pruning(interrupted)?;
        // The run's epochs; an interrupted run also shows the part of the epoch it trained.
        let mut epochs = self.position.history.epochs.clone();
        epochs.extend(cut_short.filter(|s| s.steps > 0));
        // The last memory reading goes in before the summary, which reports the run's peak.
        self.watch.memory.train_end();
        let summary = self.summary(
            &epochs,
            self.position.history.epochs.len(),
            interrupted,
            wall.elapsed().as_secs_f64(),
            pruning,
        )?;
        // The results first: an export below that fails or is killed loses nothing measured.
        if self.files.log_files {
            crate::io::write_json_atomic(
                &self.files.run_dir.join(super::summary::SUMMARY_FILE),
                &summary,
            )?;
        }
        self.watch.callbacks.on_train_end(&TrainEnd {
            epochs: &epochs,
            global_step: self.position.global_step,
            images_per_sec: summary.progress.images_per_sec,
            interrupted,
            probe: &*self.watch.probe,
            memory: self.watch.memory.log(),
        })?;
        if self.files.log_files && !self.watch.timeline.events.is_empty() {
            crate::io::write_json_atomic(
                &self
                    .files
                    .run_dir
                    .join(memtrain_core::memory::timeline::STEP_TIMELINE_FILE),
                &self.step_timeline(),
            )?;
            self.write_step_trace()?;
            self.write_memory_snapshot();
        }
        Ok(summary)
    }
}

/// How [`Trainer::run_epoch`] ended.
enum EpochEnded {
    /// No step was left to train and no epoch to finish: the run is done.
    Nothing,
    /// A stop request cut the epoch short (its snapshot is written).
    Interrupted(EpochStats),
    /// `--max-steps` ended the run inside the epoch (its snapshot, the epoch in progress, is
    /// written).
    MaxSteps(EpochStats),
    /// The epoch ended (its snapshot is written).
    Done,
}
