//! Resuming: the run's [`TrainState`] taken from a trainer ([`Trainer::snapshot`]) and put back
//! ([`Trainer::restore`]), and written to the run directory as a snapshot
//! ([`super::snapshot`] stores it).

use super::history::{EpochProgress, RunHistory};
use super::snapshot::Snapshot;
use super::state::TrainState;
use super::Trainer;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use memtrain_core::step::optim::Optimizer;
use std::collections::HashMap;
use std::path::PathBuf;

impl Trainer {
    /// The run's state, continuing at batch `next_batch` of `epoch` (equal to the steps per
    /// epoch: the epoch's steps are done, its end is not), with `progress` as the epoch in
    /// progress. Tensors are copied to the CPU; the memory log keeps the ended epochs only (an
    /// interrupted epoch's record is redone when it ends).
    pub fn snapshot(
        &self,
        epoch: usize,
        next_batch: usize,
        progress: Option<&EpochProgress>,
    ) -> Result<TrainState> {
        let on_cpu = |named: Vec<(String, Tensor)>| -> Result<HashMap<String, Tensor>> {
            named
                .into_iter()
                .map(|(n, t)| Ok((n, t.to_device(&Device::Cpu)?)))
                .collect()
        };
        let vars = self
            .model
            .named_vars()
            .into_iter()
            .map(|(n, v)| (n, v.as_detached_tensor()));
        let mut memory = self.watch.memory.log().clone();
        memory.epochs.truncate(self.position.history.epochs.len());
        Ok(TrainState {
            global_step: self.position.global_step,
            epoch,
            next_batch: next_batch.min(self.position.steps_per_epoch),
            steps_per_epoch: self.position.steps_per_epoch,
            total_steps: self.position.total_steps,
            model: on_cpu(vars.chain(self.model.named_buffers()).collect())?,
            optimizer: on_cpu(self.updater.optimizer.state())?,
            optimizer_steps: self.updater.optimizer.steps,
            scaler: self.updater.scaler.clone(),
            masks: self
                .pruner
                .as_ref()
                .map(|p| on_cpu(p.masks()))
                .transpose()?,
            train_images: self.data.train.len(),
            train_fingerprint: self.train_fingerprint().to_string(),
            data_description: self.data.description.clone(),
            history: RunHistory {
                progress: progress.cloned(),
                compute_threads: Some(candle_core::utils::get_num_threads()),
                ..self.position.history.clone()
            },
            memory,
        })
    }

    /// Put a [`TrainState`] back: parameters, BatchNorm running statistics, optimizer state and
    /// step count, loss scaler, pruning masks, counters, data position, history and memory log.
    /// Everything is checked before anything is changed: the training data must be the state's
    /// (same fingerprint), and every tensor must fit the model. Errors name what does not match.
    pub fn restore(&mut self, state: TrainState) -> Result<()> {
        if self.train_fingerprint() != state.train_fingerprint {
            return Err(Error::config(format!(
                "--resume {}: the training data differs from the snapshot's (training data: snapshot {} images, {}; now {} images, {}); pass the --data-dir the run was trained on",
                self.files.run_dir.display(),
                state.train_images,
                state.data_description,
                self.data.train.len(),
                self.data.description
            )));
        }
        if state.steps_per_epoch != self.position.steps_per_epoch {
            return Err(Error::config(format!(
                "--resume {}: steps per epoch: snapshot {}, now {}; use the snapshot's --batch-size",
                self.files.run_dir.display(),
                state.steps_per_epoch,
                self.position.steps_per_epoch
            )));
        }

        let vars = self.model.named_vars();
        let buffers = self.model.named_buffers();
        check_model_state(&state, &vars, &buffers)?;
        // A diverged state is never saved, so a non-finite value is one put there since.
        if let Some(what) = non_finite(&state, &buffers)? {
            return Err(Error::Snapshot(format!(
                "the saved {what} hold NaN or infinite values, which a run never saves (the \
                 snapshot was altered); resume an older snapshot or start again"
            )));
        }
        let opt_state = self.checked_optimizer_state(&state, &vars)?;
        if state.scaler.is_some() != self.updater.scaler.is_some() {
            return Err(Error::Snapshot(
                "the loss-scaler state does not match --precision".into(),
            ));
        }
        if state.masks.is_some() != self.pruner.is_some() {
            return Err(Error::Snapshot(
                "the pruning masks do not match --prune".into(),
            ));
        }
        // Checked (and built) before anything is changed; applied below.
        let pruner = match (state.masks, &self.pruner) {
            (Some(masks), Some(p)) => {
                let mut fresh = super::prune::Pruner::new(*p.schedule(), &vars)?;
                fresh.load_masks(masks)?;
                fresh.check_masks(state.global_step, &state.model)?;
                Some(fresh)
            }
            _ => None,
        };

        // Apply.
        for (name, var) in &vars {
            var.set(&state.model[name].to_device(self.model.device())?)?;
        }
        for (name, _) in &buffers {
            self.model
                .set_buffer(name, state.model[name].to_device(self.model.device())?)?;
        }
        let cfg = &self.config;
        let mut optimizer = Optimizer::new(
            cfg.optimizer.kind,
            vars.len(),
            cfg.optimizer.momentum,
            cfg.optimizer.weight_decay,
        );
        optimizer.load_state(opt_state)?;
        optimizer.steps = state.optimizer_steps;
        self.updater.optimizer = optimizer;
        if pruner.is_some() {
            self.pruner = pruner;
        }
        self.updater.scaler = state.scaler;
        self.position.global_step = state.global_step;
        self.position.start_epoch = state.epoch;
        self.position.start_batch = state.next_batch;
        self.position.history = state.history;
        self.watch.memory.continue_log(state.memory);
        Ok(())
    }

    /// The optimizer state of `state`, checked against the parameters `vars` (names `s1.<i>`,
    /// `s2.<i>`, each the shape of parameter i) and moved to the device.
    fn checked_optimizer_state(
        &self,
        state: &TrainState,
        vars: &[(String, candle_core::Var)],
    ) -> Result<Vec<(String, Tensor)>> {
        let mut opt_state = Vec::with_capacity(state.optimizer.len());
        for (name, t) in &state.optimizer {
            let idx = name
                .split_once('.')
                .filter(|(slot, _)| *slot == "s1" || *slot == "s2")
                .and_then(|(_, i)| i.parse::<usize>().ok())
                .ok_or_else(|| {
                    Error::Snapshot(format!(
                        "the optimizer state holds an unknown tensor '{name}'"
                    ))
                })?;
            let (pname, var) = vars.get(idx).ok_or_else(|| {
                Error::Snapshot(format!("optimizer state '{name}' has no parameter"))
            })?;
            if t.shape() != var.shape() || t.dtype() != DType::F32 {
                return Err(Error::Snapshot(format!(
                    "optimizer state '{name}' does not match the shape of '{pname}'"
                )));
            }
            opt_state.push((name.clone(), t.to_device(self.model.device())?));
        }
        // Every applied update leaves one state tensor per parameter (SGD's momentum), or two
        // (AdamW's moments); before the first, none.
        let per_param = match self.config.optimizer.kind {
            crate::config::OptimizerKind::Sgd => 1,
            crate::config::OptimizerKind::Adamw => 2,
        };
        let expected = if state.optimizer_steps > 0 {
            per_param * vars.len()
        } else {
            0
        };
        if opt_state.len() != expected {
            return Err(Error::Snapshot(format!(
                "the optimizer state holds {} tensors where {} optimizer steps of --optimizer {} \
                 leave {expected} (the snapshot was altered); resume an older snapshot or start again",
                opt_state.len(),
                state.optimizer_steps,
                self.config.optimizer.kind
            )));
        }
        Ok(opt_state)
    }

    /// Continue the run saved in `ck`: [`Trainer::restore`] of its state (a mismatch is named
    /// with the snapshot's directory), and the snapshot counts as this run's newest. `ck` is
    /// consumed: its tensors are copied into the model and freed, never kept beside it.
    pub fn resume(&mut self, ck: Snapshot) -> Result<()> {
        let point = super::snapshot::save_point(&ck.state);
        let Snapshot {
            run_dir,
            dir,
            state,
            healthy,
            config,
            ..
        } = ck;
        self.restore(state).map_err(|e| match e {
            Error::Snapshot(m) => Error::Snapshot(format!("{}: {m}", dir.display())),
            other => other,
        })?;
        if self.position.history.activation_storage.is_empty() && self.position.global_step > 0 {
            // A snapshot from before the record: its steps ran with its own setting.
            self.position
                .history
                .activation_storage
                .push(crate::config::StorageSpan {
                    first_step: 1,
                    last_step: self.position.global_step,
                    compress_activations: config.memory.compress_activations.resolved()?,
                });
        }
        self.files.snapshots.resumed(&run_dir, point, healthy);
        Ok(())
    }

    /// [`crate::data::Dataset::fingerprint`] of the training split, computed once.
    fn train_fingerprint(&self) -> &str {
        self.data
            .train_fingerprint
            .get_or_init(|| self.data.train.fingerprint())
    }

    /// Write a snapshot of the state continuing at batch `next_batch` of `epoch` (see
    /// [`Trainer::snapshot`]). Returns its directory, or `None` when snapshots are off or this
    /// state is already saved.
    ///
    /// Nothing is written when a parameter, running statistic or optimizer state is NaN/inf: the
    /// error is [`Error::NonFinite`] and the previous snapshot stays the newest.
    pub(super) fn save_snapshot(
        &mut self,
        epoch: usize,
        next_batch: usize,
        progress: Option<&EpochProgress>,
    ) -> Result<Option<PathBuf>> {
        let next_batch = next_batch.min(self.position.steps_per_epoch);
        let point = (
            self.position.global_step,
            epoch,
            next_batch,
            self.position.history.epochs.len(),
        );
        if !self.files.snapshots.wants(point) {
            return Ok(None);
        }
        let state = self.snapshot(epoch, next_batch, progress)?;
        if let Some(what) = non_finite(&state, &self.model.named_buffers())? {
            return Err(Error::NonFinite {
                what: what.into(),
                // The batch just trained.
                epoch,
                batch: next_batch.saturating_sub(1),
                phase: "optimizer".into(),
                advice: self.divergence_advice(),
            });
        }
        let dir = self
            .files
            .snapshots
            .save(&self.files.run_dir, &state, &self.config)?;
        // The newest step's memory timeline goes with the snapshot: a run resumed with no step
        // left to train (killed during its last evaluation) still has it for its charts.
        if !self.watch.timeline.events.is_empty() {
            crate::io::write_json_atomic(
                &self
                    .files
                    .run_dir
                    .join(memtrain_core::memory::timeline::STEP_TIMELINE_FILE),
                &self.step_timeline(),
            )?;
        }
        Ok(Some(dir))
    }
}

/// What in `state` is NaN or infinite, if anything, in the order weights, BatchNorm running
/// statistics (the model's `buffers`), optimizer state: a diverged state must never be saved.
fn non_finite(state: &TrainState, buffers: &[(String, Tensor)]) -> Result<Option<&'static str>> {
    let all_finite = |t: &Tensor| -> Result<bool> {
        let values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(values.iter().all(|v| v.is_finite()))
    };
    let is_buffer = |n: &String| buffers.iter().any(|(b, _)| b == n);
    for (what, buffer) in [("weights", false), ("BatchNorm running statistics", true)] {
        for (name, t) in &state.model {
            if is_buffer(name) == buffer && !all_finite(t)? {
                return Ok(Some(what));
            }
        }
    }
    for t in state.optimizer.values() {
        if !all_finite(t)? {
            return Ok(Some("optimizer state"));
        }
    }
    Ok(None)
}

/// Every parameter and BatchNorm buffer of the model (`vars`, `buffers`) is in `state` as an f32
/// tensor of its shape, and nothing else is.
fn check_model_state(
    state: &TrainState,
    vars: &[(String, candle_core::Var)],
    buffers: &[(String, Tensor)],
) -> Result<()> {
    // Check: every parameter and buffer present with its shape, nothing unknown.
    let expected: Vec<(&str, &candle_core::Shape)> = vars
        .iter()
        .map(|(n, v)| (n.as_str(), v.shape()))
        .chain(buffers.iter().map(|(n, b)| (n.as_str(), b.shape())))
        .collect();
    for (name, shape) in &expected {
        let t = state
            .model
            .get(*name)
            .ok_or_else(|| Error::Snapshot(format!("the model state lacks '{name}'")))?;
        if t.shape() != *shape || t.dtype() != DType::F32 {
            return Err(Error::Snapshot(format!(
                "'{name}' is {:?} {:?} in the saved state, the model needs {:?} F32",
                t.dtype(),
                t.shape(),
                shape
            )));
        }
    }
    if state.model.len() != expected.len() {
        let unknown = state
            .model
            .keys()
            .find(|k| !expected.iter().any(|(n, _)| n == k));
        return Err(Error::Snapshot(format!(
            "the model state holds an unknown tensor '{}'",
            unknown.map_or("?", |s| s)
        )));
    }
    Ok(())
}
