//! [`MetricsLogger`]: the run directory's files.
//!
//! `config.json` at start; `epochs.csv`, `batches.csv` and `memory.json` rewritten atomically
//! at each epoch end (so a crash leaves the last complete version, never a torn file);
//! `summary.json` at the end.

use super::{BatchInfo, Callback, EpochEnd, MemoryLog, TrainBegin, TrainEnd};
use crate::error::Result;
use crate::io::{write_atomic, write_json_atomic};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Writes config, per-epoch and per-batch CSV, memory records and the summary into the run directory.
pub struct MetricsLogger {
    dir: PathBuf,
    memory: Option<Arc<Mutex<MemoryLog>>>,
    batch_rows: String,
    epoch_rows: String,
}

/// Header of `batches.csv`.
pub const BATCH_CSV_HEADER: &str = "epoch,batch,global_step,images,loss,lr,loss_scale,skipped,step_secs,grad_norm,peak_bytes,peak_phase,start_bytes,end_bytes,forward_peak,backward_peak,optimizer_peak,reserved_peak,os_current,os_peak";
/// Header of `epochs.csv`.
pub const EPOCH_CSV_HEADER: &str = "epoch,steps,images,train_loss,train_accuracy,eval_loss,eval_accuracy,images_per_sec,train_secs,lr,loss_scale,skipped_steps,peak_bytes,peak_phase,mean_batch_peak,eval_peak,os_current,os_peak";

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map(|x| x.to_string()).unwrap_or_default()
}

/// The header and the rows of an existing CSV whose column `col` is below `limit`; just the
/// header when the file is missing or has another header.
fn kept_rows(path: &std::path::Path, header: &str, col: usize, limit: usize) -> String {
    let mut out = format!("{header}\n");
    let Ok(text) = std::fs::read_to_string(path) else {
        return out;
    };
    let mut lines = text.lines();
    if lines.next() != Some(header) {
        return out;
    }
    for line in lines {
        if line
            .split(',')
            .nth(col)
            .and_then(|v| v.parse::<usize>().ok())
            .is_some_and(|v| v < limit)
        {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

impl MetricsLogger {
    /// Log into `dir` (which must exist). With `memory`, batch and epoch rows carry its peaks.
    pub fn new(dir: impl Into<PathBuf>, memory: Option<Arc<Mutex<MemoryLog>>>) -> Self {
        MetricsLogger {
            dir: dir.into(),
            memory,
            batch_rows: format!("{BATCH_CSV_HEADER}\n"),
            epoch_rows: format!("{EPOCH_CSV_HEADER}\n"),
        }
    }

    fn memory(&self) -> Option<MemoryLog> {
        self.memory
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    fn flush(&self) -> Result<()> {
        write_atomic(&self.dir.join("batches.csv"), self.batch_rows.as_bytes())?;
        write_atomic(&self.dir.join("epochs.csv"), self.epoch_rows.as_bytes())?;
        if let Some(m) = self.memory() {
            write_json_atomic(&self.dir.join("memory.json"), &m)?;
        }
        Ok(())
    }
}

impl Callback for MetricsLogger {
    fn on_train_begin(&mut self, ctx: &TrainBegin<'_>) -> Result<()> {
        if ctx.global_step > 0 {
            // Resuming: keep the rows of the steps and epochs before the checkpoint, drop any
            // written after it by the interrupted process.
            self.batch_rows = kept_rows(
                &self.dir.join("batches.csv"),
                BATCH_CSV_HEADER,
                2,
                ctx.global_step,
            );
            self.epoch_rows = kept_rows(
                &self.dir.join("epochs.csv"),
                EPOCH_CSV_HEADER,
                0,
                ctx.start_epoch,
            );
        }
        write_json_atomic(&self.dir.join("config.json"), ctx.config)
    }

    fn on_batch_end(&mut self, ctx: &BatchInfo<'_>) -> Result<()> {
        let mem = self.memory.as_ref().and_then(|m| {
            m.lock()
                .unwrap_or_else(|e| e.into_inner())
                .batches
                .last()
                .cloned()
        });
        let _ = write!(
            self.batch_rows,
            "{},{},{},{},{},{},{},{},{},{}",
            ctx.epoch,
            ctx.batch,
            ctx.global_step,
            ctx.images,
            opt(ctx.loss),
            ctx.lr,
            opt(ctx.loss_scale),
            ctx.skipped as u8,
            opt(ctx.step_secs),
            opt(ctx.grad_norm)
        );
        match mem {
            Some(m) => {
                let _ = writeln!(
                    self.batch_rows,
                    ",{},{},{},{},{},{},{},{},{},{}",
                    m.peak_bytes,
                    m.phase,
                    m.start_bytes,
                    m.end_bytes,
                    m.forward_peak,
                    m.backward_peak,
                    m.optimizer_peak,
                    opt(m.reserved_peak),
                    opt(m.os_current),
                    opt(m.os_peak)
                );
            }
            None => self.batch_rows.push_str(",,,,,,,,,,\n"),
        }
        Ok(())
    }

    fn on_epoch_end(&mut self, ctx: &EpochEnd<'_>) -> Result<()> {
        let s = ctx.stats;
        let mem = self.memory().and_then(|m| m.epochs.last().cloned());
        let _ = write!(
            self.epoch_rows,
            "{},{},{},{},{},{},{},{},{},{},{},{}",
            s.epoch,
            s.steps,
            s.images,
            s.train_loss,
            s.train_accuracy,
            opt(s.eval_loss),
            opt(s.eval_accuracy),
            s.images_per_sec,
            s.train_secs,
            s.lr,
            opt(s.loss_scale),
            s.skipped_steps
        );
        match mem {
            Some(m) => {
                let _ = writeln!(
                    self.epoch_rows,
                    ",{},{},{},{},{},{}",
                    m.peak_bytes,
                    m.phase,
                    m.mean_batch_peak,
                    m.eval_peak,
                    opt(m.os_current),
                    opt(m.os_peak)
                );
            }
            None => self.epoch_rows.push_str(",,,,,,\n"),
        }
        self.flush()
    }

    fn on_train_end(&mut self, ctx: &TrainEnd<'_>) -> Result<()> {
        self.flush()?;
        write_json_atomic(&self.dir.join("summary.json"), ctx.summary)
    }
}
