//! [`TensorBoardLogger`]: the run's TensorBoard event file, as Keras' TensorBoard callback and
//! Lightning's default logger write one (`tensorboard --logdir runs/` shows every run).
//!
//! Per step (at the step's number, from 1 as in `batches.csv`): loss, learning rate, img/s,
//! gradient norm, the step's peak, the bytes it added over its start, and RSS. Per epoch (at the
//! epoch's number, from 1): train and eval loss and accuracy, the epoch's and the evaluation's peak. The
//! configuration as text. Memory is in MiB: a summary scalar is an f32.
//!
//! A resumed run continues the same file: it first keeps the records of the steps before its
//! snapshot and of the epochs that ended (those after, and a record torn by the kill, are
//! dropped), as `batches.csv` does, so no step appears twice.

use super::{BatchInfo, Callback, EpochEnd, TrainBegin};
use crate::error::{Error, Result};
use crate::export::tensorboard::{self as tb, Event, What};
use crate::io::write_atomic;
use memtrain_core::memory::{mib, OsView};
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// Start of every event file's name (TensorBoard finds files by it).
pub const EVENT_FILE_PREFIX: &str = "events.out.tfevents.";
/// Tag prefix of the per-epoch scalars (their step is the epoch).
const EPOCH_TAGS: &str = "epoch/";
/// Largest event file a resume reads back.
const MAX_EVENT_BYTES: u64 = 1 << 30;

/// Writes the run's TensorBoard event file into the run directory.
pub struct TensorBoardLogger {
    dir: PathBuf,
    path: PathBuf,
    file: Option<File>,
}

/// The run directory's event file, if it has one (the first by name).
pub fn event_file(dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(EVENT_FILE_PREFIX)
        })
        .map(|e| e.path())
        .collect();
    found.sort();
    found.into_iter().next()
}

/// Whether a resumed run keeps `event`: the file version and text, steps before `global_step`,
/// epochs before `ended` (the epochs the snapshot carries as ended).
fn kept(event: &Event, global_step: usize, ended: usize) -> bool {
    match &event.what {
        Some(What::Summary(s)) => {
            let per_epoch = s.value.iter().any(|v| v.tag.starts_with(EPOCH_TAGS));
            let is_text = s
                .value
                .iter()
                .all(|v| matches!(v.value, Some(tb::Value::Tensor(_))));
            let limit = if per_epoch { ended } else { global_step };
            // Steps and epochs are numbered from 1: the first `limit` are kept.
            is_text || (event.step >= 1 && (event.step as usize) <= limit)
        }
        _ => true,
    }
}

impl TensorBoardLogger {
    /// Log into `dir` (which must exist).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        TensorBoardLogger {
            path: PathBuf::new(),
            dir,
            file: None,
        }
    }

    fn write(&mut self, event: &Event) -> Result<()> {
        if let Some(f) = self.file.as_mut() {
            f.write_all(&tb::record(event))
                .and_then(|()| f.flush())
                .map_err(|e| Error::io(&self.path, e))?;
        }
        Ok(())
    }

    /// The file's records a run starting at `ctx` begins with: a new run's version and
    /// configuration, or what a resumed run keeps of its earlier processes' file.
    fn first_records(&self, ctx: &TrainBegin<'_>) -> Result<Vec<u8>> {
        if ctx.global_step > 0 {
            if let Ok(bytes) = crate::io::read_capped(&self.path, MAX_EVENT_BYTES) {
                let (events, _) = tb::read_records(&bytes);
                let ended = ctx.ended_epochs.len();
                return Ok(events
                    .iter()
                    .filter(|e| kept(e, ctx.global_step, ended))
                    .flat_map(tb::record)
                    .collect());
            }
        }
        let config = serde_json::to_string_pretty(ctx.config)
            .map_err(|e| Error::io(&self.path, std::io::Error::other(e)))?;
        // Indented: a markdown code block in the text dashboard.
        let markdown: String = config.lines().map(|l| format!("    {l}\n")).collect();
        let mut out = tb::record(&tb::file_version());
        out.extend(tb::record(&tb::text(0, "config", &markdown)));
        Ok(out)
    }
}

impl Callback for TensorBoardLogger {
    fn on_train_begin(&mut self, ctx: &TrainBegin<'_>) -> Result<()> {
        self.path = event_file(&self.dir).unwrap_or_else(|| {
            let secs = chrono::Utc::now().timestamp();
            self.dir.join(format!(
                "{EVENT_FILE_PREFIX}{secs}.memtrain.{}",
                std::process::id()
            ))
        });
        write_atomic(&self.path, &self.first_records(ctx)?)?;
        self.file = Some(
            File::options()
                .append(true)
                .open(&self.path)
                .map_err(|e| Error::io(&self.path, e))?,
        );
        Ok(())
    }

    fn on_batch_end(&mut self, ctx: &BatchInfo<'_>) -> Result<()> {
        let mut values = vec![("train/lr", ctx.lr)];
        values.extend(ctx.loss.map(|l| ("train/loss", l)));
        values.extend(ctx.grad_norm.map(|g| ("train/grad_norm", g)));
        if let Some(secs) = ctx.step_secs.filter(|s| *s > 0.0) {
            values.push(("train/images_per_sec", ctx.images as f64 / secs));
        }
        if let Some(m) = ctx.memory.last_batch.as_ref() {
            values.push(("memory/step_peak_MiB", mib(m.peak_bytes)));
            values.push((
                "memory/step_added_MiB",
                mib(m.peak_bytes.saturating_sub(m.start_bytes)),
            ));
            if ctx.memory.os_view == Some(OsView::ProcessRss) {
                values.extend(m.os_current_bytes.map(|b| ("memory/rss_MiB", mib(b))));
            }
        }
        // Numbered from 1, as in batches.csv.
        self.write(&tb::scalars(ctx.global_step as i64 + 1, &values))
    }

    fn on_epoch_end(&mut self, ctx: &EpochEnd<'_>) -> Result<()> {
        let s = ctx.stats;
        let mut values = vec![
            ("epoch/train_loss", s.train_loss),
            ("epoch/train_accuracy", s.train_accuracy),
        ];
        values.extend(s.eval_loss.map(|v| ("epoch/eval_loss", v)));
        values.extend(s.eval_accuracy.map(|v| ("epoch/eval_accuracy", v)));
        if let Some(m) = ctx.memory.epochs.last() {
            values.push(("epoch/peak_MiB", mib(m.peak_bytes)));
            values.extend(m.eval_peak_bytes.map(|b| ("epoch/eval_peak_MiB", mib(b))));
        }
        self.write(&tb::scalars(s.epoch as i64 + 1, &values))
    }
}
