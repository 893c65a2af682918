//! Training snapshots: the storage of a [`TrainState`], everything that influences the rest of
//! a run, so that a resumed run continues bit for bit where the saved one was. The trainer takes
//! the state ([`crate::train::Trainer::snapshot`]) and puts it back
//! ([`crate::train::Trainer::restore`]); this module only writes, finds, checks and prunes the
//! files, and keeps the [`SnapshotSaver`]'s bookkeeping (which states are saved, which are
//! healthy); reading one back for `--resume` is `snapshot_load.rs`.
//!
//! Layout inside the run directory:
//!
//! ```text
//! snapshots/
//!   latest                      "step-000024": the newest snapshot's directory name
//!   step-000016/                the previous snapshot (the last two are kept)
//!   step-000024/
//!     model.safetensors         parameters by name (Cnn::named_vars) + BatchNorm running statistics
//!     optimizer.safetensors     momentum buffers / Adam moments (Optimizer::state: s1.<i>, s2.<i>)
//!     masks.safetensors         --prune only: the u8 pruning masks by parameter name
//!     config.json               the TrainConfig the state was trained with
//!     history.json              the run so far: ended epochs, the epoch in progress, totals
//!                               (src/train/history.rs), so a resumed run reports the whole run
//!     memory.json               the memory log of the steps and ended epochs so far
//!     snapshot.json             counters, data position, loss scaler, data fingerprint, and the
//!                               size and hash of the files above (written last), itself signed:
//!                               {"state": {...}, "hash": hash of the state's exact bytes}
//!   diverged/                   snapshots set aside after a divergence (see below)
//! ```
//!
//! Run directories written before save/resume was called "snapshot" hold the same files under
//! `checkpoints/` with the manifest named `checkpoint.json`; they resume unchanged and go on
//! saving into their `checkpoints/` folder ([`snapshots_root`]).
//!
//! A snapshot is written into `snapshots/.tmp-step-N-PID/`, every file fsynced, then the
//! directory is renamed to `step-N`; only after that does `latest` change (atomically) and the
//! older snapshots get pruned (each renamed to `.old-step-…` before it is deleted, so a kill
//! mid-deletion leaves a leftover the next save or resume removes, never a half-deleted
//! `step-N`). A crash at any moment leaves the previous snapshot complete. On `--resume`, the
//! newest `step-N` whose manifest signature holds and whose files all match the sizes and hashes
//! in it is used; damaged or incomplete ones are skipped with a warning when an older complete one
//! exists, and removed once the resumed run holds the run directory's lock.
//!
//! The data position is (epoch, next batch): the batcher's order depends only on
//! (seed, epoch) and its augmentation on (seed, epoch, batch), so starting the epoch at the
//! next batch gives exactly the batches an uninterrupted run would have seen. The learning-rate
//! schedule is a function of (global step, total steps), both restored or recomputed. A next
//! batch equal to the steps per epoch means the epoch's steps are all trained but its end (the
//! evaluation) is not done: the resumed run evaluates before it goes on.
//!
//! **Divergence.** A snapshot is *healthy* when every step since the previous snapshot had a
//! finite loss of at most [`DIVERGED_LOSS`] (four times the loss of guessing uniformly among the
//! ten classes: a network that far off has blown up) or was skipped by the loss scaler. Pruning
//! always keeps the newest healthy snapshot besides the newest [`KEEP`]. When training stops on
//! a non-finite loss or state, the snapshots newer than the newest healthy one are moved into
//! `snapshots/diverged/`, so `--resume` (with a lower `--lr`) continues from before the loss
//! blew up rather than from weights already wrecked.

use super::history::StepResult;
use super::state::TrainState;
use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::io::hash_bytes;
use candle_core::Tensor;
use memtrain_core::step::precision::LossScaler;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

pub(crate) use super::run_dir::snapshots_root;
pub use super::run_dir::{LEGACY_SNAPSHOTS_DIR, SNAPSHOTS_DIR};
/// File in [`SNAPSHOTS_DIR`] naming the newest snapshot's directory.
pub const LATEST_FILE: &str = "latest";
/// The manifest of one snapshot (written last).
pub const MANIFEST_FILE: &str = "snapshot.json";
/// The manifest's name in snapshots written before the rename (same content).
pub(crate) const LEGACY_MANIFEST_FILE: &str = "checkpoint.json";
/// Parameters and BatchNorm running statistics.
pub const MODEL_FILE: &str = "model.safetensors";
/// Optimizer state tensors.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Pruning masks (`--prune` runs only): with the global step, which is the schedule's position,
/// they make a resumed pruned run continue exactly.
pub const MASKS_FILE: &str = "masks.safetensors";
/// The training configuration of the snapshot.
pub(crate) const CONFIG_FILE: &str = "config.json";
/// The run's history up to the snapshot ([`RunHistory`](super::history::RunHistory)).
pub(crate) const HISTORY_FILE: &str = "history.json";
/// The memory log up to the snapshot ([`MemoryLog`](memtrain_core::memory::MemoryLog)).
pub(crate) const MEMORY_FILE: &str = "memory.json";
/// Folder in [`SNAPSHOTS_DIR`] where snapshots written after the loss blew up are moved.
pub const DIVERGED_DIR: &str = "diverged";
/// How many complete snapshots are kept (the newest healthy one is kept besides).
pub(crate) const KEEP: usize = 2;
/// A step loss above this, or a non-finite one, makes the next snapshot unhealthy: four times
/// ln(10), the cross-entropy of a uniform guess among the ten classes.
pub const DIVERGED_LOSS: f64 = 4.0 * std::f64::consts::LN_10;

/// `format` field of every manifest.
pub(super) const FORMAT: &str = "memtrain-snapshot";
/// `format` of the manifests written before the rename (same content), still read.
pub(super) const LEGACY_FORMAT: &str = "memtrain-checkpoint";
/// Manifest version this build writes and reads (2: signed manifest, history, memory log).
pub(super) const VERSION: u32 = 2;
/// Prefix of a complete snapshot directory.
const STEP_PREFIX: &str = "step-";
/// Prefix of a snapshot directory being written.
const TMP_PREFIX: &str = ".tmp-step-";
/// Prefix of a snapshot directory being replaced by a newer write of the same step.
pub(super) const OLD_PREFIX: &str = ".old-step-";

/// Size and hash of one file of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct FileEntry {
    /// Size in bytes.
    pub bytes: u64,
    /// [`hash_bytes`] of the content, 16 hex digits.
    pub hash: String,
}

/// The contents of `snapshot.json`: the counters and positions of a snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Manifest {
    /// `memtrain-snapshot` (`memtrain-checkpoint` in snapshots written before the rename).
    pub format: String,
    /// Manifest version ([`VERSION`]).
    pub version: u32,
    /// Optimizer steps taken (the step the snapshot is named after).
    pub global_step: usize,
    /// Epoch the run continues in.
    pub epoch: usize,
    /// Batch within `epoch` the run continues with; equal to `steps_per_epoch` when the epoch's
    /// steps are all trained and its evaluation is still to do.
    pub next_batch: usize,
    /// Whether every step since the previous snapshot had a sane loss (see the module docs).
    pub healthy: bool,
    /// The optimizer's own step count (Adam bias correction; differs from `global_step` when
    /// the f16 loss scaler skipped steps).
    pub optimizer_steps: usize,
    /// The dynamic loss scaler (f16 only).
    pub scaler: Option<LossScaler>,
    /// Optimizer steps per epoch when saved.
    pub steps_per_epoch: usize,
    /// Optimizer steps of the whole run when saved (informational: it follows --epochs/--max-steps).
    pub total_steps: usize,
    /// Training images.
    pub train_images: usize,
    /// [`crate::data::Dataset::fingerprint`] of the training split.
    pub train_fingerprint: String,
    /// The data description line of the run.
    pub data_description: String,
    /// Size and hash of every other file of the snapshot.
    pub files: BTreeMap<String, FileEntry>,
}

/// A complete snapshot read from disk (tensors held on the CPU until restored).
pub struct Snapshot {
    /// The run directory it belongs to.
    pub run_dir: PathBuf,
    /// Its own directory (`<run>/snapshots/step-N`).
    pub dir: PathBuf,
    /// The training state it holds.
    pub state: TrainState,
    /// Whether every step since the snapshot before it had a sane loss (see the module docs).
    pub healthy: bool,
    /// The configuration it was trained with.
    pub config: TrainConfig,
    /// One line per newer snapshot that was skipped as damaged or incomplete (print as warnings).
    pub skipped: Vec<String>,
}

/// What makes a saved state distinct: (global step, epoch, next batch, ended epochs). The same
/// state is never saved twice, but an epoch's end at the same position after a `--max-steps`
/// cut is a new state.
pub(crate) type SavePoint = (usize, usize, usize, usize);

/// The [`SavePoint`] of a state.
pub(crate) fn save_point(state: &TrainState) -> SavePoint {
    (
        state.global_step,
        state.epoch,
        state.next_batch,
        state.history.epochs.len(),
    )
}

/// Per-trainer snapshot bookkeeping (a field of [`crate::train::Trainer`]).
#[derive(Debug, Default)]
pub(crate) struct SnapshotSaver {
    /// Write snapshots into the run directory (set from `TrainerOptions::log_files`).
    pub enabled: bool,
    /// The [`SavePoint`] of the newest snapshot written or restored.
    last: Option<SavePoint>,
    /// Global step of the newest healthy snapshot on disk.
    last_healthy: Option<usize>,
    /// A step since the newest snapshot had a loss past [`DIVERGED_LOSS`] or a non-finite one.
    unhealthy_since_save: bool,
    /// Whether the newest snapshot is healthy (a second save of the same step, at another
    /// position, inherits it).
    last_was_healthy: bool,
}

impl SnapshotSaver {
    /// A saver that writes snapshots when `enabled`.
    pub fn new(enabled: bool) -> Self {
        SnapshotSaver {
            enabled,
            ..Default::default()
        }
    }

    /// Global step of the newest snapshot this trainer wrote or restored.
    pub(crate) fn last_step(&self) -> Option<usize> {
        self.last.map(|l| l.0)
    }

    /// Global step of the newest healthy snapshot: the one a diverged run is resumed from.
    pub(crate) fn last_healthy(&self) -> Option<usize> {
        self.last_healthy
    }

    /// Whether a state at `point` is to be written: saving is on and it is not saved already.
    pub fn wants(&self, point: SavePoint) -> bool {
        self.enabled && self.last != Some(point)
    }

    /// Take a finished step into account for the next snapshot's health.
    pub(crate) fn note_step(&mut self, r: &StepResult) {
        let sane = r.loss.is_finite() && r.loss <= DIVERGED_LOSS;
        if !(r.skipped || sane) {
            self.unhealthy_since_save = true;
        }
    }
}

/// Name of the directory of the snapshot at `step`.
pub(crate) fn step_dir_name(step: usize) -> String {
    format!("{STEP_PREFIX}{step:06}")
}

/// The step of a `step-N` directory name.
fn parse_step(name: &str) -> Option<usize> {
    let digits = name.strip_prefix(STEP_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The `step-N` directories under `root`, newest (highest step) first; none when `root` is absent.
pub(super) fn list_steps(root: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(root, e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(root, e))?;
        let name = entry.file_name();
        if let Some(step) = name.to_str().and_then(parse_step) {
            out.push((step, entry.path()));
        }
    }
    out.sort_by_key(|s| std::cmp::Reverse(s.0));
    Ok(out)
}

/// Leftovers of interrupted writes under `root`: snapshot directories (`.tmp-step-*`,
/// `.old-step-*`) and temporary files of the `latest` pointer (`.latest.*.tmp`, see
/// [`crate::io::write_atomic`]).
pub(super) fn list_leftovers(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let latest_tmp = format!(".{LATEST_FILE}.");
    entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.starts_with(TMP_PREFIX)
                || n.starts_with(OLD_PREFIX)
                || (n.starts_with(&latest_tmp) && n.ends_with(".tmp"))
        })
        .map(|e| e.path())
        .collect()
}

/// Remove a leftover, whether a directory or a file.
fn remove_leftover(path: &Path) {
    let _ = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
}

/// Fsync a directory so that renames inside it are durable (best effort: not every platform
/// lets a directory be opened).
fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Write `bytes` to a new file and fsync it; returns its manifest entry.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<FileEntry> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    f.write_all(bytes).map_err(|e| Error::io(path, e))?;
    f.sync_all().map_err(|e| Error::io(path, e))?;
    Ok(FileEntry {
        bytes: bytes.len() as u64,
        hash: format!("{:016x}", hash_bytes(bytes)),
    })
}

/// Save named tensors as safetensors at `path`, fsync, and return the manifest entry.
fn write_tensors(path: &Path, tensors: &HashMap<String, Tensor>) -> Result<FileEntry> {
    candle_core::safetensors::save(tensors, path)
        .map_err(|e| Error::Snapshot(format!("{}: cannot write ({e})", path.display())))?;
    // Read back what was written: the hash then covers the bytes actually on disk.
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io(path, e))?;
    Ok(FileEntry {
        bytes: bytes.len() as u64,
        hash: format!("{:016x}", hash_bytes(&bytes)),
    })
}

impl SnapshotSaver {
    /// Write `state` (trained with `config`) as a snapshot into `<run_dir>/snapshots`, point
    /// `latest` at it and prune the older ones. Returns its directory. The caller has checked
    /// [`SnapshotSaver::wants`] and that the state is finite.
    pub fn save(
        &mut self,
        run_dir: &Path,
        state: &TrainState,
        config: &TrainConfig,
    ) -> Result<PathBuf> {
        let point = save_point(state);
        let step = state.global_step;
        let config_json = serde_json::to_vec_pretty(config)
            .map_err(|e| Error::Snapshot(format!("cannot serialize the config: {e}")))?;
        let history_json = serde_json::to_vec(&state.history)
            .map_err(|e| Error::Snapshot(format!("cannot serialize the history: {e}")))?;
        let memory_json = serde_json::to_vec(&state.memory)
            .map_err(|e| Error::Snapshot(format!("cannot serialize the memory log: {e}")))?;
        let healthy = match self.last {
            Some((last, ..)) if last == step => self.last_was_healthy,
            _ => !self.unhealthy_since_save,
        };

        let root = snapshots_root(run_dir);
        std::fs::create_dir_all(&root).map_err(|e| Error::io(&root, e))?;
        let name = step_dir_name(step);
        let tmp = root.join(format!("{TMP_PREFIX}{step:06}-{}", std::process::id()));
        let write = || -> Result<()> {
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
            }
            std::fs::create_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;
            let mut files = BTreeMap::new();
            let tensors = [
                (MODEL_FILE, Some(&state.model)),
                (OPTIMIZER_FILE, Some(&state.optimizer)),
                (MASKS_FILE, state.masks.as_ref()),
            ];
            for (name, map) in tensors {
                if let Some(map) = map {
                    files.insert(name.to_string(), write_tensors(&tmp.join(name), map)?);
                }
            }
            for (name, bytes) in [
                (CONFIG_FILE, &config_json),
                (HISTORY_FILE, &history_json),
                (MEMORY_FILE, &memory_json),
            ] {
                files.insert(name.to_string(), write_synced(&tmp.join(name), bytes)?);
            }
            let manifest = Manifest {
                format: FORMAT.into(),
                version: VERSION,
                global_step: step,
                epoch: state.epoch,
                next_batch: state.next_batch,
                healthy,
                optimizer_steps: state.optimizer_steps,
                scaler: state.scaler.clone(),
                steps_per_epoch: state.steps_per_epoch,
                total_steps: state.total_steps,
                train_images: state.train_images,
                train_fingerprint: state.train_fingerprint.clone(),
                data_description: state.data_description.clone(),
                files,
            };
            // The manifest goes last: a directory with a valid manifest has all its files.
            write_synced(&tmp.join(MANIFEST_FILE), &sign(&manifest)?)?;
            sync_dir(&tmp);
            Ok(())
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }

        let dest = root.join(&name);
        if dest.exists() {
            // A same-step directory from an earlier process (e.g. a damaged one that resume skipped):
            // move it aside rather than delete it first, so some snapshot always exists.
            let old = root.join(format!("{OLD_PREFIX}{step:06}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&old);
            std::fs::rename(&dest, &old).map_err(|e| Error::io(&dest, e))?;
        }
        std::fs::rename(&tmp, &dest).map_err(|e| {
            let _ = std::fs::remove_dir_all(&tmp);
            Error::io(&dest, e)
        })?;
        sync_dir(&root);
        crate::io::write_atomic(&root.join(LATEST_FILE), format!("{name}\n").as_bytes())?;
        self.last = Some(point);
        self.last_was_healthy = healthy;
        if healthy {
            self.last_healthy = Some(step);
        }
        self.unhealthy_since_save = false;
        prune(&root, step, self.last_healthy);
        Ok(dest)
    }

    /// A run resumed from `ck`: its state counts as saved, its health as known, and (saving
    /// being on, so the run directory is this process's) what an interrupted save or prune left,
    /// and the damaged snapshots the resume skipped, are removed.
    pub fn resumed(&mut self, run_dir: &Path, point: SavePoint, healthy: bool) {
        let step = point.0;
        let root = snapshots_root(run_dir);
        self.last = Some(point);
        self.unhealthy_since_save = false;
        self.last_was_healthy = healthy;
        self.last_healthy = if healthy {
            Some(step)
        } else {
            newest_healthy(&root, step)
        };
        if self.enabled {
            prune(&root, step, self.last_healthy);
        }
    }

    /// After a divergence: move the snapshots newer than the newest healthy one into
    /// `snapshots/diverged/` (replacing what an earlier divergence left there), so that
    /// `--resume` continues from before the loss blew up. Returns how many were moved.
    pub(crate) fn set_aside_diverged(&mut self, run_dir: &Path) -> usize {
        if !self.enabled {
            return 0;
        }
        let root = snapshots_root(run_dir);
        let keep = self.last_healthy;
        let Ok(steps) = list_steps(&root) else {
            return 0;
        };
        let newer: Vec<_> = steps
            .into_iter()
            .filter(|(step, _)| keep.is_none_or(|h| *step > h))
            .collect();
        if newer.is_empty() {
            return 0;
        }
        let aside = root.join(DIVERGED_DIR);
        let _ = std::fs::remove_dir_all(&aside);
        if std::fs::create_dir(&aside).is_err() {
            return 0;
        }
        let mut moved = 0;
        for (_, dir) in newer {
            if let Some(name) = dir.file_name() {
                moved += std::fs::rename(&dir, aside.join(name)).is_ok() as usize;
            }
        }
        sync_dir(&root);
        let latest = root.join(LATEST_FILE);
        let _ = match keep {
            Some(step) => {
                crate::io::write_atomic(&latest, format!("{}\n", step_dir_name(step)).as_bytes())
            }
            None => std::fs::remove_file(&latest).map_err(|e| Error::io(&latest, e)),
        };
        self.last = None;
        moved
    }
}

/// Keep the snapshot at `current`, the newest one before it and the newest healthy one;
/// remove the rest and any leftovers of interrupted writes. Snapshots past `current` can only
/// be damaged ones a resume skipped (it always continues from the newest complete one), so they
/// go too. Each is renamed to a leftover name first, so a kill mid-deletion leaves a leftover the
/// next call removes. Best effort: a snapshot that cannot be removed costs disk space, not
/// correctness.
fn prune(root: &Path, current: usize, healthy: Option<usize>) {
    let Ok(steps) = list_steps(root) else { return };
    let mut kept = 0;
    for (step, dir) in steps {
        if step <= current && kept < KEEP {
            kept += 1;
        } else if Some(step) != healthy {
            let doomed = root.join(format!("{OLD_PREFIX}{step:06}-{}", std::process::id()));
            if std::fs::rename(&dir, &doomed).is_err() {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
    sync_dir(root);
    for path in list_leftovers(root) {
        remove_leftover(&path);
    }
}

/// The manifest file: `{"state": <the state's JSON>, "hash": <hash of exactly those bytes>}`.
/// A flipped byte anywhere in the state (an epoch, a step, a file hash) breaks the signature.
fn sign(state: &Manifest) -> Result<Vec<u8>> {
    #[derive(Serialize)]
    struct Signed<'a> {
        state: &'a serde_json::value::RawValue,
        hash: String,
    }
    let fail =
        |e: serde_json::Error| Error::Snapshot(format!("cannot serialize the manifest: {e}"));
    let raw = serde_json::value::RawValue::from_string(
        serde_json::to_string_pretty(state).map_err(fail)?,
    )
    .map_err(fail)?;
    let hash = format!("{:016x}", hash_bytes(raw.get().as_bytes()));
    serde_json::to_vec_pretty(&Signed { state: &raw, hash }).map_err(fail)
}

/// The state in a manifest file whose signature holds (see [`sign`]).
pub(super) fn verify(bytes: &[u8]) -> std::result::Result<Manifest, Reason> {
    #[derive(Deserialize)]
    struct Signed<'a> {
        #[serde(borrow)]
        state: &'a serde_json::value::RawValue,
        hash: String,
    }
    let signed: Signed<'_> = match serde_json::from_slice(bytes) {
        Ok(s) => s,
        Err(e) => {
            // An older build's unsigned manifest: say so rather than "damaged".
            let version = serde_json::from_slice::<serde_json::Value>(bytes)
                .ok()
                .and_then(|v| v.get("version")?.as_u64());
            return Err(match version {
                Some(v) => {
                    format!("snapshot format version {v} (this build reads version {VERSION})")
                }
                None => format!("damaged {MANIFEST_FILE} ({e})"),
            });
        }
    };
    if format!("{:016x}", hash_bytes(signed.state.get().as_bytes())) != signed.hash {
        return Err(format!(
            "{MANIFEST_FILE} is damaged (its signature does not match its contents)"
        ));
    }
    serde_json::from_str(signed.state.get()).map_err(|e| format!("damaged {MANIFEST_FILE} ({e})"))
}

/// The manifest of the snapshot directory `dir`: [`MANIFEST_FILE`], or [`LEGACY_MANIFEST_FILE`]
/// in a snapshot written before the rename.
pub(super) fn manifest_path(dir: &Path) -> PathBuf {
    let path = dir.join(MANIFEST_FILE);
    let legacy = dir.join(LEGACY_MANIFEST_FILE);
    if !path.exists() && legacy.exists() {
        legacy
    } else {
        path
    }
}

/// Why a snapshot directory cannot be used (one phrase, for warnings and errors).
pub(super) type Reason = String;

/// A manifest is a few KiB; anything past this is not one.
pub(super) const MAX_MANIFEST_BYTES: u64 = 1 << 20;

/// The newest snapshot at or before `step` whose manifest says healthy (signature checked;
/// files are not read).
fn newest_healthy(root: &Path, step: usize) -> Option<usize> {
    list_steps(root).ok()?.into_iter().find_map(|(s, dir)| {
        let bytes = crate::io::read_capped(&manifest_path(&dir), MAX_MANIFEST_BYTES).ok()?;
        (s <= step && verify(&bytes).ok()?.healthy).then_some(s)
    })
}
