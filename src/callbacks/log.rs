//! [`MetricsLogger`]: the run directory's files.
//!
//! `config.json` at start. Every step's row is appended to `batches.csv` and flushed as the step
//! ends, so a kill loses no finished step; every epoch's row likewise to `epochs.csv`, and
//! `memory.json` is rewritten atomically at each epoch end and at the end (`summary.json` is
//! written by the trainer once the run's last memory reading is in).
//!
//! A resumed run first repairs the files to its snapshot: `batches.csv` keeps the rows of the
//! steps before the snapshot (rows of later steps, and a row torn by the kill, are dropped)
//! and `epochs.csv` is rewritten from the ended epochs the snapshot carries, so both describe
//! the whole run, as an uninterrupted run's would.

use super::{BatchInfo, Callback, EpochEnd, EpochStats, TrainBegin, TrainEnd};
use crate::error::{Error, Result};
use crate::io::{write_atomic, write_json_atomic};
use memtrain_core::memory::{BatchMemory, EpochMemory, MemoryLog};
use std::fmt::Write as _;
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// Writes config, per-epoch and per-batch CSV, memory records and the summary into the run directory.
pub struct MetricsLogger {
    dir: PathBuf,
    batches: Option<File>,
    epochs: Option<File>,
}

/// Header of `batches.csv` (every column in docs/outputs.md). Epochs and steps are numbered from
/// 1, as on the screen; byte columns end in `_bytes`.
pub const BATCH_CSV_HEADER: &str = "epoch,batch,global_step,images,loss,lr,loss_scale,skipped,step_secs,grad_norm,peak_bytes,peak_phase,start_bytes,end_bytes,forward_peak_bytes,backward_peak_bytes,optimizer_peak_bytes,reserved_peak_bytes,os_current_bytes,os_peak_bytes";
/// Header of `epochs.csv` (every column in docs/outputs.md).
pub const EPOCH_CSV_HEADER: &str = "epoch,steps,images,train_loss,train_accuracy,eval_loss,eval_accuracy,images_per_sec,train_secs,lr,loss_scale,skipped_steps,peak_bytes,peak_phase,mean_step_peak_bytes,eval_peak_bytes,os_current_bytes,os_peak_bytes";
/// The header `batches.csv` had before the columns were renamed and numbered from 1: a resumed
/// run of an older version keeps its rows, renumbered.
const OLD_BATCH_CSV_HEADER: &str = "epoch,batch,global_step,images,loss,lr,loss_scale,skipped,step_secs,grad_norm,peak_bytes,peak_phase,start_bytes,end_bytes,forward_peak,backward_peak,optimizer_peak,reserved_peak,os_current,os_peak";
/// Largest `batches.csv` a resume reads back (about three million steps' rows).
const MAX_LOG_BYTES: u64 = 1 << 30;
/// The memory log ([`MemoryLog`]): the run's maxima and one record per epoch.
pub(crate) const MEMORY_JSON: &str = "memory.json";
/// Per-step rows.
pub(crate) const BATCHES_CSV: &str = "batches.csv";
/// Per-epoch rows.
pub(crate) const EPOCHS_CSV: &str = "epochs.csv";

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map(|x| x.to_string()).unwrap_or_default()
}

/// The header and the complete rows of an existing `batches.csv` for the `global_step` steps
/// before the snapshot (a file of an older version renumbered from 1); just the header when the
/// file is missing or has another header.
fn kept_batch_rows(path: &Path, global_step: usize) -> String {
    let mut out = format!("{BATCH_CSV_HEADER}\n");
    // Read capped and only if regular: a FIFO put in its place must not block the resume.
    let Ok(bytes) = crate::io::read_capped(path, MAX_LOG_BYTES) else {
        return out;
    };
    // The kept rows are at most the file (older files renumbered may need a few bytes more).
    out.reserve(bytes.len().saturating_sub(out.len()));
    let text = String::from_utf8_lossy(&bytes);
    let mut lines = text.split_inclusive('\n');
    let old = match lines.next().map(str::trim_end) {
        Some(BATCH_CSV_HEADER) => false,
        Some(OLD_BATCH_CSV_HEADER) => true,
        _ => return out,
    };
    let columns = BATCH_CSV_HEADER.split(',').count();
    for line in lines {
        // A row torn by a kill has no newline or too few columns.
        let complete = line.ends_with('\n') && line.split(',').count() == columns;
        if !complete {
            continue;
        }
        let mut fields: Vec<String> = line.trim_end().split(',').map(String::from).collect();
        if old {
            // epoch, batch and global_step counted from 0.
            for f in &mut fields[..3] {
                match f.parse::<usize>() {
                    Ok(v) => *f = (v + 1).to_string(),
                    Err(_) => continue,
                }
            }
        }
        let step = fields[2].parse::<usize>().ok();
        if step.is_some_and(|s| (1..=global_step).contains(&s)) {
            out.push_str(&fields.join(","));
            out.push('\n');
        }
    }
    out
}

/// One `epochs.csv` row (with its newline).
fn epoch_row(s: &EpochStats, mem: Option<&EpochMemory>) -> String {
    let mut row = format!(
        "{},{},{},{},{},{},{},{},{},{},{},{}",
        s.epoch + 1,
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
                row,
                ",{},{},{},{},{},{}",
                m.peak_bytes,
                m.peak_phase,
                m.mean_step_peak_bytes,
                opt(m.eval_peak_bytes),
                opt(m.os_current_bytes),
                opt(m.os_peak_bytes)
            );
        }
        None => row.push_str(",,,,,,\n"),
    }
    row
}

/// The memory record of every step of the run in `run_dir`, read back from its `batches.csv`
/// (the memory log keeps only the newest step's; charts read them all from here).
pub fn read_batch_log(run_dir: &Path) -> Result<Vec<BatchMemory>> {
    let path = run_dir.join(BATCHES_CSV);
    let bytes = crate::io::read_capped(&path, MAX_LOG_BYTES).map_err(|e| Error::io(&path, e))?;
    let bad = |msg: String| Error::Data {
        path: path.clone(),
        msg: format!("not a memtrain batches.csv ({msg})"),
    };
    let mut reader = csv::Reader::from_reader(bytes.as_slice());
    let header = reader.headers().map_err(|e| bad(e.to_string()))?.clone();
    let col = |name: &str| {
        header
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| bad(format!("no column {name}")))
    };
    let cols: Vec<usize> = BATCH_MEMORY_COLUMNS
        .iter()
        .map(|c| col(c))
        .collect::<Result<_>>()?;
    // At most one record per line after the header.
    let lines = bytes.iter().filter(|&&b| b == b'\n').count()
        + usize::from(bytes.last().is_some_and(|&b| b != b'\n'));
    let mut out = Vec::with_capacity(lines.saturating_sub(1));
    for row in reader.records() {
        let row = row.map_err(|e| bad(e.to_string()))?;
        let field = |i: usize| row.get(cols[i]).unwrap_or("");
        let num = |i: usize| -> Result<u64> {
            field(i)
                .parse()
                .map_err(|_| bad(format!("{} = '{}'", BATCH_MEMORY_COLUMNS[i], field(i))))
        };
        let opt_num = |i: usize| -> Result<Option<u64>> {
            if field(i).is_empty() {
                Ok(None)
            } else {
                num(i).map(Some)
            }
        };
        if field(3).is_empty() {
            // A step without memory readings (no probe).
            continue;
        }
        out.push(BatchMemory {
            epoch: num(0)? as usize,
            batch: num(1)? as usize,
            global_step: num(2)? as usize,
            peak_bytes: num(3)?,
            peak_phase: field(4)
                .parse()
                .map_err(|_| bad(format!("peak_phase = '{}'", field(4))))?,
            start_bytes: num(5)?,
            end_bytes: num(6)?,
            forward_peak_bytes: num(7)?,
            backward_peak_bytes: num(8)?,
            optimizer_peak_bytes: num(9)?,
            reserved_peak_bytes: opt_num(10)?,
            os_current_bytes: opt_num(11)?,
            os_peak_bytes: opt_num(12)?,
        });
    }
    Ok(out)
}

/// The columns of `batches.csv` that make up a [`BatchMemory`], in its fields' order.
const BATCH_MEMORY_COLUMNS: [&str; 13] = [
    "epoch",
    "batch",
    "global_step",
    "peak_bytes",
    "peak_phase",
    "start_bytes",
    "end_bytes",
    "forward_peak_bytes",
    "backward_peak_bytes",
    "optimizer_peak_bytes",
    "reserved_peak_bytes",
    "os_current_bytes",
    "os_peak_bytes",
];

/// Open `path` for appending.
fn append_to(path: &Path) -> Result<File> {
    File::options()
        .append(true)
        .open(path)
        .map_err(|e| Error::io(path, e))
}

/// Append `row` and hand it to the kernel at once: it survives a kill of the process.
fn append_row(file: &mut Option<File>, path: &Path, row: &str) -> Result<()> {
    if let Some(f) = file.as_mut() {
        f.write_all(row.as_bytes())
            .and_then(|()| f.flush())
            .map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}

impl MetricsLogger {
    /// Log into `dir` (which must exist).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        MetricsLogger {
            dir: dir.into(),
            batches: None,
            epochs: None,
        }
    }

    fn write_memory(&self, memory: &MemoryLog) -> Result<()> {
        write_json_atomic(&self.dir.join(MEMORY_JSON), memory)
    }
}

impl Callback for MetricsLogger {
    fn on_train_begin(&mut self, ctx: &TrainBegin<'_>) -> Result<()> {
        let (batches_path, epochs_path) = (self.dir.join(BATCHES_CSV), self.dir.join(EPOCHS_CSV));
        // Resuming keeps the rows of the steps before the snapshot and drops the rest; a new
        // run starts both files with their headers.
        let batches = if ctx.global_step > 0 {
            let kept = kept_batch_rows(&batches_path, ctx.global_step);
            let rows = kept.lines().count() - 1;
            if rows < ctx.global_step {
                eprintln!(
                    "warning: {} held the rows of {rows} of the {} steps before the snapshot; the others are lost (the file was removed or replaced)",
                    batches_path.display(),
                    ctx.global_step
                );
            }
            kept
        } else {
            format!("{BATCH_CSV_HEADER}\n")
        };
        let mut epochs = format!("{EPOCH_CSV_HEADER}\n");
        for s in ctx.ended_epochs {
            let mem = ctx.memory.epochs.iter().find(|e| e.epoch == s.epoch + 1);
            epochs.push_str(&epoch_row(s, mem));
        }
        write_atomic(&batches_path, batches.as_bytes())?;
        write_atomic(&epochs_path, epochs.as_bytes())?;
        self.batches = Some(append_to(&batches_path)?);
        self.epochs = Some(append_to(&epochs_path)?);
        write_json_atomic(&self.dir.join("config.json"), ctx.config)
    }

    fn on_batch_end(&mut self, ctx: &BatchInfo<'_>) -> Result<()> {
        // The step's record is the last: the trainer records it before this hook.
        let mem = ctx.memory.last_batch.as_ref();
        let mut row = format!(
            "{},{},{},{},{},{},{},{},{},{}",
            ctx.epoch + 1,
            ctx.batch + 1,
            ctx.global_step + 1,
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
                    row,
                    ",{},{},{},{},{},{},{},{},{},{}",
                    m.peak_bytes,
                    m.peak_phase,
                    m.start_bytes,
                    m.end_bytes,
                    m.forward_peak_bytes,
                    m.backward_peak_bytes,
                    m.optimizer_peak_bytes,
                    opt(m.reserved_peak_bytes),
                    opt(m.os_current_bytes),
                    opt(m.os_peak_bytes)
                );
            }
            None => row.push_str(",,,,,,,,,,\n"),
        }
        append_row(&mut self.batches, &self.dir.join(BATCHES_CSV), &row)
    }

    fn on_epoch_end(&mut self, ctx: &EpochEnd<'_>) -> Result<()> {
        let row = epoch_row(ctx.stats, ctx.memory.epochs.last());
        append_row(&mut self.epochs, &self.dir.join(EPOCHS_CSV), &row)?;
        self.write_memory(ctx.memory)
    }

    fn on_train_end(&mut self, ctx: &TrainEnd<'_>) -> Result<()> {
        // summary.json is the trainer's: it is complete only after the last memory reading.
        self.write_memory(ctx.memory)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `batches.csv` of a version that numbered from 0 and named the columns without `_bytes`
    /// keeps its rows on resume, renumbered from 1 under the new header; rows of steps after the
    /// snapshot and a torn last row go.
    #[test]
    fn an_older_batches_csv_is_kept_renumbered() {
        let dir = std::env::temp_dir().join(format!("memtrain-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(BATCHES_CSV);
        let row = |e: usize, b: usize, g: usize| {
            format!("{e},{b},{g},32,2.3,0.1,,0,0.5,1.0,100,backward,10,20,90,100,30,,50,60\n")
        };
        let text = format!(
            "{OLD_BATCH_CSV_HEADER}\n{}{}{}0,3,3,32",
            row(0, 0, 0),
            row(0, 1, 1),
            row(0, 2, 2)
        );
        std::fs::write(&path, text).unwrap();
        let kept = kept_batch_rows(&path, 2);
        let lines: Vec<&str> = kept.lines().collect();
        assert_eq!(lines[0], BATCH_CSV_HEADER);
        assert_eq!(lines.len(), 3, "{kept}");
        assert!(lines[1].starts_with("1,1,1,32,"), "{kept}");
        assert!(lines[2].starts_with("1,2,2,32,"), "{kept}");
        // The same file in today's numbering keeps the same rows unchanged.
        std::fs::write(&path, &kept).unwrap();
        assert_eq!(kept_batch_rows(&path, 2), kept);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
