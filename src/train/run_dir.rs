//! One writer per run directory, and the results of a finished run never replaced by accident.
//!
//! A run that writes files holds an exclusive advisory lock (`flock`) on `<run>/.lock` from
//! before its first write until the process ends; the kernel drops it when the process dies, even
//! by SIGKILL, so a crashed run never leaves the directory locked. A second process on the same
//! directory (a second run with the same `--out`, or two `--resume` of one run) is refused with
//! a one-line error before it writes anything.
//!
//! A new run refuses a directory that holds an earlier run's results or snapshots, unless
//! `--overwrite` asks for them to be removed first; a resumed run continues its own files.

use super::summary::RunStatus;
use crate::error::{Error, Result};
use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

/// Folder of the snapshots inside a run directory (see [`snapshots_root`]).
pub const SNAPSHOTS_DIR: &str = "snapshots";
/// The folder that run directories written before save/resume was named "snapshot" use; such a
/// run still resumes, and goes on saving there ([`snapshots_root`]).
pub const LEGACY_SNAPSHOTS_DIR: &str = "checkpoints";
/// The snapshots' folder of `run_dir`: [`SNAPSHOTS_DIR`], or [`LEGACY_SNAPSHOTS_DIR`] in a run
/// directory written before the rename (so such a run resumes and keeps one folder).
pub(crate) fn snapshots_root(run_dir: &Path) -> PathBuf {
    let root = run_dir.join(SNAPSHOTS_DIR);
    let legacy = run_dir.join(LEGACY_SNAPSHOTS_DIR);
    if !root.exists() && legacy.is_dir() {
        legacy
    } else {
        root
    }
}

/// The lock file inside a run directory.
pub(crate) const LOCK_FILE: &str = ".lock";

/// Files a run writes into its directory (besides [`SNAPSHOTS_DIR`]): what `--overwrite`
/// removes and what makes a directory "hold results".
pub(crate) const RESULT_FILES: &[&str] = &[
    super::summary::SUMMARY_FILE,
    "config.json",
    crate::callbacks::log::BATCHES_CSV,
    crate::callbacks::log::EPOCHS_CSV,
    crate::callbacks::log::MEMORY_JSON,
    memtrain_core::memory::timeline::STEP_TIMELINE_FILE,
    memtrain_core::memory::timeline::OOM_REPORT_FILE,
    // The same file as older runs named it.
    "oom_snapshot.json",
    super::prune::DENSE_MODEL_FILE,
    super::prune::SPARSE_MODEL_FILE,
    "memory.png",
    "memory.svg",
    "step_timeline.png",
    "step_timeline.svg",
];

/// How a run uses its directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Claim {
    /// A new run: the directory must not hold another run's results or snapshots, unless
    /// `overwrite` (then they are removed once the lock is held).
    New {
        /// `--overwrite`.
        overwrite: bool,
    },
    /// `--resume`: the directory's own snapshot and logs are continued.
    Resume,
    /// Lock only (library callers that manage the directory themselves).
    #[default]
    LockOnly,
}

/// The held lock of a run directory; released when dropped or when the process ends.
#[derive(Debug)]
pub(crate) struct RunDirLock {
    _file: File,
}

/// What in `dir` belongs to an earlier run: its result files present and whether it has
/// snapshots.
fn earlier_run(dir: &Path) -> (Vec<&'static str>, bool) {
    let files = RESULT_FILES
        .iter()
        .copied()
        .filter(|f| dir.join(f).exists())
        .collect();
    let snapshots = std::fs::read_dir(snapshots_root(dir))
        .map(|mut d| d.next().is_some())
        .unwrap_or(false);
    (files, snapshots)
}

/// The status an earlier run's `summary.json` records, for the error message.
fn earlier_status(dir: &Path) -> Option<RunStatus> {
    /// Only the status: the rest of an earlier build's summary need not parse.
    #[derive(serde::Deserialize)]
    struct StatusOnly {
        status: RunStatus,
    }
    let text = crate::io::read_capped(&dir.join(super::summary::SUMMARY_FILE), 1 << 20).ok()?;
    serde_json::from_slice::<StatusOnly>(&text)
        .ok()
        .map(|s| s.status)
}

/// Refuse `dir` for a new run when another process holds it, or it holds an earlier run's
/// results or snapshots and `overwrite` is not given (no lock kept: for failing early, before
/// data is loaded).
pub(crate) fn check_new(dir: &Path, overwrite: bool) -> Result<()> {
    // In use first: --overwrite cannot help there.
    if in_use(dir) {
        return Err(in_use_error(dir));
    }
    refuse_earlier(dir, overwrite)
}

/// [`check_new`] under the lock: an earlier run's files without `overwrite`.
fn refuse_earlier(dir: &Path, overwrite: bool) -> Result<()> {
    if overwrite || !dir.is_dir() {
        return Ok(());
    }
    let shown = dir.display();
    let (files, snapshots) = earlier_run(dir);
    if snapshots {
        return Err(Error::config(format!(
            "--out {shown} already holds snapshots of an earlier run; continue it with --resume {shown}, replace it with --overwrite, or pass a new --out"
        )));
    }
    if !files.is_empty() {
        let what = match earlier_status(dir) {
            Some(status) => format!("its summary.json says status {status}"),
            None => files.join(", "),
        };
        return Err(Error::config(format!(
            "--out {shown} already holds the results of an earlier run ({what}); pass a new --out, or --overwrite to replace them"
        )));
    }
    Ok(())
}

/// The error for `dir` whose lock another process holds.
fn in_use_error(dir: &Path) -> Error {
    Error::config(format!(
        "{} is in use by another memtrain process (it holds {LOCK_FILE}); wait for it to finish, or pass another --out",
        dir.display()
    ))
}

/// Whether a live process holds `dir`'s lock (a run writing into it right now). Takes the lock
/// for a moment when it is free, and never creates the lock file.
pub(crate) fn in_use(dir: &Path) -> bool {
    let Ok(file) = OpenOptions::new().write(true).open(dir.join(LOCK_FILE)) else {
        return false;
    };
    matches!(file.try_lock(), Err(TryLockError::WouldBlock))
}

/// Whether `dir` holds an earlier run's result files (see [`RESULT_FILES`]).
pub(crate) fn holds_results(dir: &Path) -> bool {
    !earlier_run(dir).0.is_empty()
}

/// Create `dir` if needed, take its lock, and prepare it for `claim`.
///
/// Errors: another process holds the lock ([`CoreError::Config`](crate::error::CoreError::Config)); `claim` is
/// [`Claim::New`] without `overwrite` and the directory holds an earlier run (see
/// [`check_new`]).
pub(crate) fn claim(dir: &Path, claim: Claim) -> Result<RunDirLock> {
    crate::io::create_dir(dir)?;
    let path = dir.join(LOCK_FILE);
    // Never written to: a refused resume leaves the run directory exactly as it was.
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| Error::io(&path, e))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => return Err(in_use_error(dir)),
        Err(TryLockError::Error(e)) => return Err(Error::io(&path, e)),
    }
    if let Claim::New { overwrite } = claim {
        refuse_earlier(dir, overwrite)?;
        if overwrite {
            remove_earlier_run(dir)?;
        }
    }
    Ok(RunDirLock { _file: file })
}

/// Remove an earlier run's result files and snapshots (`--overwrite`); other files stay.
fn remove_earlier_run(dir: &Path) -> Result<()> {
    for name in RESULT_FILES {
        let path = dir.join(name);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&path, e)),
        }
    }
    for folder in [SNAPSHOTS_DIR, LEGACY_SNAPSHOTS_DIR] {
        let path = dir.join(folder);
        match std::fs::remove_dir_all(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&path, e)),
        }
    }
    Ok(())
}
