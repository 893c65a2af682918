//! Training checkpoints: everything that influences the rest of a run, saved so that a resumed
//! run continues bit for bit where the saved one was.
//!
//! Layout inside the run directory:
//!
//! ```text
//! checkpoints/
//!   latest                      "step-000024": the newest checkpoint's directory name
//!   step-000016/                the previous checkpoint (the last two are kept)
//!   step-000024/
//!     model.safetensors         parameters by name (Cnn::named_vars) + BatchNorm running statistics
//!     optimizer.safetensors     momentum buffers / Adam moments (Optimizer::state: s1.<i>, s2.<i>)
//!     masks.safetensors         --prune only: the u8 pruning masks by parameter name
//!     config.json               the TrainConfig the state was trained with
//!     checkpoint.json           counters, data position, loss scaler, data fingerprint, and the
//!                               size and hash of the files above (written last)
//! ```
//!
//! A checkpoint is written into `checkpoints/.tmp-step-N-PID/`, every file fsynced, then the
//! directory is renamed to `step-N`; only after that does `latest` change (atomically) and the
//! older checkpoints get pruned. A crash at any moment leaves the previous checkpoint complete.
//! On `--resume`, the newest `step-N` whose files all match the sizes and hashes in its
//! `checkpoint.json` is used; damaged or incomplete ones are skipped with a warning when an
//! older complete one exists.
//!
//! The data position is (epoch, next batch): the batcher's order depends only on
//! (seed, epoch) and its augmentation on (seed, epoch, batch), so starting the epoch at the
//! next batch gives exactly the batches an uninterrupted run would have seen. The learning-rate
//! schedule is a function of (global step, total steps), both restored or recomputed.

use super::optim::Optimizer;
use super::precision::LossScaler;
use super::trainer::Trainer;
use crate::config::TrainConfig;
use crate::data::Dataset;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Folder of the checkpoints inside a run directory.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
/// File in [`CHECKPOINTS_DIR`] naming the newest checkpoint's directory.
pub const LATEST_FILE: &str = "latest";
/// The manifest of one checkpoint (written last).
pub const MANIFEST_FILE: &str = "checkpoint.json";
/// Parameters and BatchNorm running statistics.
pub const MODEL_FILE: &str = "model.safetensors";
/// Optimizer state tensors.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Pruning masks (`--prune` runs only): with the global step, which is the schedule's position,
/// they make a resumed pruned run continue exactly.
pub const MASKS_FILE: &str = "masks.safetensors";
/// The training configuration of the checkpoint.
pub const CONFIG_FILE: &str = "config.json";
/// How many complete checkpoints are kept.
pub const KEEP: usize = 2;

/// `format` field of every manifest.
const FORMAT: &str = "memtrain-checkpoint";
/// Manifest version this build writes and reads.
const VERSION: u32 = 1;
/// Prefix of a complete checkpoint directory.
const STEP_PREFIX: &str = "step-";
/// Prefix of a checkpoint directory being written.
const TMP_PREFIX: &str = ".tmp-step-";
/// Prefix of a checkpoint directory being replaced by a newer write of the same step.
const OLD_PREFIX: &str = ".old-step-";

/// Fields that decide what the training computes; a resumed run must match the checkpoint in all.
/// (The training data itself is compared by fingerprint, so a moved data directory still resumes.)
const MUST_MATCH: &[&str] = &[
    "width",
    "conv",
    "optimizer",
    "batch_size",
    "accum_steps",
    "precision",
    "checkpoint",
    "seed",
    "augment",
    "prune",
    "prune_begin",
    "prune_end",
    "prune_every",
    "prune_initial",
];

/// Fields that may change on resume but change the rest of the run; they are reported.
const NOTED: &[&str] = &[
    "epochs",
    "max_steps",
    "lr",
    "momentum",
    "weight_decay",
    "warmup_frac",
    "clip_grad_norm",
];

/// Size and hash of one file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Size in bytes.
    pub bytes: u64,
    /// [`hash_bytes`] of the content, 16 hex digits.
    pub hash: String,
}

/// The contents of `checkpoint.json`: the counters and positions of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Always `memtrain-checkpoint`.
    pub format: String,
    /// Manifest version (1).
    pub version: u32,
    /// Optimizer steps taken (the step the checkpoint is named after).
    pub global_step: usize,
    /// Epoch the run continues in.
    pub epoch: usize,
    /// Batch within `epoch` the run continues with.
    pub next_batch: usize,
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
    /// [`data_fingerprint`] of the training split.
    pub train_fingerprint: String,
    /// The data description line of the run.
    pub data_description: String,
    /// Size and hash of every other file of the checkpoint.
    pub files: BTreeMap<String, FileEntry>,
}

/// A complete checkpoint read from disk (tensors held on the CPU until restored).
pub struct Checkpoint {
    /// The run directory it belongs to.
    pub run_dir: PathBuf,
    /// Its own directory (`<run>/checkpoints/step-N`).
    pub dir: PathBuf,
    /// The manifest.
    pub state: TrainState,
    /// The configuration it was trained with.
    pub config: TrainConfig,
    /// One line per newer checkpoint that was skipped as damaged or incomplete (print as warnings).
    pub skipped: Vec<String>,
    model: HashMap<String, Tensor>,
    optimizer: HashMap<String, Tensor>,
    masks: Option<HashMap<String, Tensor>>,
}

/// Per-trainer checkpoint bookkeeping (a field of [`Trainer`]).
#[derive(Debug, Default)]
pub struct CheckpointSaver {
    /// Write checkpoints into the run directory (set from `TrainerOptions::log_files`).
    pub enabled: bool,
    /// Global step of the newest checkpoint written or restored, so a step is never saved twice.
    last_step: Option<usize>,
    /// Fingerprint of the training split, computed once.
    fingerprint: OnceLock<String>,
}

impl CheckpointSaver {
    /// A saver that writes checkpoints when `enabled`.
    pub fn new(enabled: bool) -> Self {
        CheckpointSaver {
            enabled,
            ..Default::default()
        }
    }

    /// Global step of the newest checkpoint this trainer wrote or restored.
    pub fn last_step(&self) -> Option<usize> {
        self.last_step
    }
}

/// A 64-bit FNV-1a-style hash over little-endian 8-byte words (the tail zero-padded, the length
/// mixed in last). Not cryptographic: it detects damaged or truncated files and changed data.
pub fn hash_bytes(bytes: &[u8]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01B3;
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        h = (h ^ w).wrapping_mul(PRIME);
        // A word-wise FNV mixes high bits poorly; fold them back down.
        h ^= h >> 29;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut tail = [0u8; 8];
        tail[..rest.len()].copy_from_slice(rest);
        h = (h ^ u64::from_le_bytes(tail)).wrapping_mul(PRIME);
        h ^= h >> 29;
    }
    (h ^ bytes.len() as u64).wrapping_mul(PRIME)
}

/// Fingerprint of a dataset: image count and the hashes of its labels and pixels, as one string.
pub fn data_fingerprint(data: &Dataset) -> String {
    format!(
        "{}:{:016x}:{:016x}",
        data.len(),
        hash_bytes(&data.labels),
        hash_bytes(&data.images)
    )
}

/// Name of the directory of the checkpoint at `step`.
pub fn step_dir_name(step: usize) -> String {
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
fn list_steps(root: &Path) -> Result<Vec<(usize, PathBuf)>> {
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

/// Leftovers of interrupted writes under `root`: checkpoint directories (`.tmp-step-*`,
/// `.old-step-*`) and temporary files of the `latest` pointer (`.latest.*.tmp`, see
/// [`crate::io::write_atomic`]).
fn list_leftovers(root: &Path) -> Vec<PathBuf> {
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
        .map_err(|e| Error::Checkpoint(format!("{}: cannot write ({e})", path.display())))?;
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

/// Copy a tensor to the CPU, refusing NaN/inf: a checkpoint must never hold a diverged state.
fn finite_on_cpu(t: &Tensor) -> Result<Option<Tensor>> {
    let cpu = t.to_device(&Device::Cpu)?;
    let values = cpu.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(values.iter().all(|v| v.is_finite()).then_some(cpu))
}

impl Trainer {
    /// Write a checkpoint of the current state into `<run_dir>/checkpoints`, continuing at batch
    /// `next_batch` of `epoch` (a `next_batch` at or past the end of the epoch means the start of
    /// the next one). Returns its directory, or `None` when checkpoints are off or this global
    /// step is already saved.
    ///
    /// Nothing is written when a parameter, running statistic or optimizer state is NaN/inf: the
    /// error is [`Error::NonFinite`] and the previous checkpoint stays the newest.
    pub fn save_checkpoint(&mut self, epoch: usize, next_batch: usize) -> Result<Option<PathBuf>> {
        if !self.checkpoints.enabled || self.checkpoints.last_step == Some(self.global_step) {
            return Ok(None);
        }
        // The batch just trained, for the error message; then the position to continue at.
        let (last_epoch, last_batch) = (epoch, next_batch.saturating_sub(1));
        let (epoch, next_batch) = if next_batch >= self.steps_per_epoch {
            (epoch + 1, 0)
        } else {
            (epoch, next_batch)
        };
        let advice = self.divergence_advice();
        let diverged = |what: &str| Error::NonFinite {
            what: what.into(),
            epoch: last_epoch,
            batch: last_batch,
            phase: "optimizer".into(),
            advice: advice.clone(),
        };

        let mut model = HashMap::new();
        for (name, var) in self.model.named_vars() {
            let t = finite_on_cpu(var.as_tensor())?.ok_or_else(|| diverged("weights"))?;
            model.insert(name, t);
        }
        for (name, buf) in self.model.named_buffers() {
            let t = finite_on_cpu(&buf)?.ok_or_else(|| diverged("BatchNorm running statistics"))?;
            model.insert(name, t);
        }
        let mut optimizer = HashMap::new();
        for (name, t) in self.optimizer.state() {
            let t = finite_on_cpu(&t)?.ok_or_else(|| diverged("optimizer state"))?;
            optimizer.insert(name, t);
        }
        let masks: Option<HashMap<String, Tensor>> = self
            .pruner
            .as_ref()
            .map(|p| {
                p.masks()
                    .into_iter()
                    .map(|(n, m)| Ok((n, m.to_device(&Device::Cpu)?)))
                    .collect::<Result<_>>()
            })
            .transpose()?;
        let fingerprint = self
            .checkpoints
            .fingerprint
            .get_or_init(|| data_fingerprint(&self.train))
            .clone();
        let config_json = serde_json::to_vec_pretty(&self.config)
            .map_err(|e| Error::Checkpoint(format!("cannot serialize the config: {e}")))?;

        let root = self.run_dir.join(CHECKPOINTS_DIR);
        std::fs::create_dir_all(&root).map_err(|e| Error::io(&root, e))?;
        let name = step_dir_name(self.global_step);
        let tmp = root.join(format!(
            "{TMP_PREFIX}{:06}-{}",
            self.global_step,
            std::process::id()
        ));
        let write = || -> Result<()> {
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
            }
            std::fs::create_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;
            let mut files = BTreeMap::new();
            files.insert(
                MODEL_FILE.to_string(),
                write_tensors(&tmp.join(MODEL_FILE), &model)?,
            );
            files.insert(
                OPTIMIZER_FILE.to_string(),
                write_tensors(&tmp.join(OPTIMIZER_FILE), &optimizer)?,
            );
            if let Some(masks) = &masks {
                files.insert(
                    MASKS_FILE.to_string(),
                    write_tensors(&tmp.join(MASKS_FILE), masks)?,
                );
            }
            files.insert(
                CONFIG_FILE.to_string(),
                write_synced(&tmp.join(CONFIG_FILE), &config_json)?,
            );
            let state = TrainState {
                format: FORMAT.into(),
                version: VERSION,
                global_step: self.global_step,
                epoch,
                next_batch,
                optimizer_steps: self.optimizer.steps,
                scaler: self.scaler.clone(),
                steps_per_epoch: self.steps_per_epoch,
                total_steps: self.total_steps,
                train_images: self.train.len(),
                train_fingerprint: fingerprint.clone(),
                data_description: self.data_description.clone(),
                files,
            };
            let manifest = serde_json::to_vec_pretty(&state)
                .map_err(|e| Error::Checkpoint(format!("cannot serialize the manifest: {e}")))?;
            // The manifest goes last: a directory with a valid manifest has all its files.
            write_synced(&tmp.join(MANIFEST_FILE), &manifest)?;
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
            // move it aside rather than delete it first, so some checkpoint always exists.
            let old = root.join(format!(
                "{OLD_PREFIX}{:06}-{}",
                self.global_step,
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&old);
            std::fs::rename(&dest, &old).map_err(|e| Error::io(&dest, e))?;
        }
        std::fs::rename(&tmp, &dest).map_err(|e| {
            let _ = std::fs::remove_dir_all(&tmp);
            Error::io(&dest, e)
        })?;
        sync_dir(&root);
        crate::io::write_atomic(&root.join(LATEST_FILE), format!("{name}\n").as_bytes())?;
        self.checkpoints.last_step = Some(self.global_step);
        prune(&root, self.global_step);
        Ok(Some(dest))
    }
}

/// Keep the checkpoint at `current` and the newest one before it; remove the rest and any
/// leftovers of interrupted writes. Checkpoints past `current` can only be damaged ones a resume
/// skipped (it always continues from the newest complete one), so they go too. Best effort:
/// a checkpoint that cannot be removed costs disk space, not correctness.
fn prune(root: &Path, current: usize) {
    for path in list_leftovers(root) {
        remove_leftover(&path);
    }
    let Ok(steps) = list_steps(root) else { return };
    let mut kept = 0;
    for (step, dir) in steps {
        if step <= current && kept < KEEP {
            kept += 1;
        } else {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Refuse to start a new run in a directory that already holds checkpoints: the new run's
/// checkpoints would replace the old run's. `run_dir` is the `--out` of a run without `--resume`.
pub fn ensure_no_checkpoints(run_dir: &Path) -> Result<()> {
    if list_steps(&run_dir.join(CHECKPOINTS_DIR))
        .map(|s| !s.is_empty())
        .unwrap_or(false)
    {
        return Err(Error::config(format!(
            "--out {0} already holds checkpoints of an earlier run; continue it with --resume {0}, or pass a new --out",
            run_dir.display()
        )));
    }
    Ok(())
}

/// Why a checkpoint directory cannot be used (one phrase, for warnings and errors).
type Reason = String;

/// Read and verify one checkpoint directory.
fn load_dir(run_dir: &Path, dir: &Path, step: usize) -> std::result::Result<Checkpoint, Reason> {
    let manifest_path = dir.join(MANIFEST_FILE);
    let text = match std::fs::read(&manifest_path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!("incomplete (no {MANIFEST_FILE})"));
        }
        Err(e) => return Err(format!("cannot read {MANIFEST_FILE} ({e})")),
    };
    let state: TrainState =
        serde_json::from_slice(&text).map_err(|e| format!("damaged {MANIFEST_FILE} ({e})"))?;
    if state.format != FORMAT {
        return Err(format!(
            "{MANIFEST_FILE} is not a memtrain checkpoint manifest"
        ));
    }
    if state.version != VERSION {
        return Err(format!(
            "checkpoint format version {} (this build reads version {VERSION})",
            state.version
        ));
    }
    if state.global_step != step {
        return Err(format!(
            "{MANIFEST_FILE} says step {}, the directory step {step}",
            state.global_step
        ));
    }
    let mut contents = HashMap::new();
    // The masks file is listed (so size and hash are checked) exactly when the run prunes.
    let masks_listed = state.files.contains_key(MASKS_FILE);
    let listed = [MODEL_FILE, OPTIMIZER_FILE, CONFIG_FILE, MASKS_FILE];
    for name in listed
        .into_iter()
        .filter(|n| *n != MASKS_FILE || masks_listed)
    {
        let entry = state
            .files
            .get(name)
            .ok_or_else(|| format!("{MANIFEST_FILE} does not list {name}"))?;
        let bytes =
            std::fs::read(dir.join(name)).map_err(|e| format!("cannot read {name} ({e})"))?;
        if bytes.len() as u64 != entry.bytes {
            return Err(format!(
                "{name} has {} bytes, {} expected (truncated or damaged)",
                bytes.len(),
                entry.bytes
            ));
        }
        if format!("{:016x}", hash_bytes(&bytes)) != entry.hash {
            return Err(format!("{name} is damaged (hash mismatch)"));
        }
        contents.insert(name, bytes);
    }
    let config: TrainConfig = serde_json::from_slice(&contents[CONFIG_FILE])
        .map_err(|e| format!("damaged {CONFIG_FILE} ({e})"))?;
    config
        .validate()
        .map_err(|e| format!("invalid {CONFIG_FILE} ({e})"))?;
    let model = candle_core::safetensors::load_buffer(&contents[MODEL_FILE], &Device::Cpu)
        .map_err(|e| format!("damaged {MODEL_FILE} ({})", first_line(&e.to_string())))?;
    let optimizer = candle_core::safetensors::load_buffer(&contents[OPTIMIZER_FILE], &Device::Cpu)
        .map_err(|e| format!("damaged {OPTIMIZER_FILE} ({})", first_line(&e.to_string())))?;
    let masks = contents
        .get(MASKS_FILE)
        .map(|bytes| {
            candle_core::safetensors::load_buffer(bytes, &Device::Cpu)
                .map_err(|e| format!("damaged {MASKS_FILE} ({})", first_line(&e.to_string())))
        })
        .transpose()?;
    if masks.is_some() != config.prune.is_some() {
        return Err(format!(
            "{MASKS_FILE} is {} but the config {} --prune",
            if masks.is_some() {
                "present"
            } else {
                "missing"
            },
            if config.prune.is_some() {
                "has"
            } else {
                "has no"
            }
        ));
    }
    if state.steps_per_epoch == 0 || state.next_batch >= state.steps_per_epoch {
        return Err(format!(
            "{MANIFEST_FILE} has batch {} of an epoch of {} steps",
            state.next_batch, state.steps_per_epoch
        ));
    }
    Ok(Checkpoint {
        run_dir: run_dir.to_path_buf(),
        dir: dir.to_path_buf(),
        state,
        config,
        skipped: Vec::new(),
        model,
        optimizer,
        masks,
    })
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").to_string()
}

/// A config value as the user would type it (`none` for an absent option).
fn show(v: Option<&serde_json::Value>) -> String {
    match v {
        None | Some(serde_json::Value::Null) => "none".into(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// `field: checkpoint A, now B` for each field in `keys` that differs.
fn differences(then: &TrainConfig, now: &TrainConfig, keys: &[&str]) -> Vec<String> {
    let (Ok(a), Ok(b)) = (serde_json::to_value(then), serde_json::to_value(now)) else {
        return vec!["the configuration cannot be compared".into()];
    };
    keys.iter()
        .filter(|k| a.get(**k) != b.get(**k))
        .map(|k| {
            format!(
                "{k}: checkpoint {}, now {}",
                show(a.get(*k)),
                show(b.get(*k))
            )
        })
        .collect()
}

impl Checkpoint {
    /// The newest complete checkpoint of the run in `run_dir`.
    ///
    /// Damaged or incomplete newer ones are skipped and listed in [`Checkpoint::skipped`]. Errors
    /// (one line each): `run_dir` missing or not a directory, or no checkpoint in it
    /// ([`Error::Config`]); no complete checkpoint ([`Error::Checkpoint`], naming the newest
    /// one's problem).
    pub fn find_latest(run_dir: &Path) -> Result<Checkpoint> {
        let shown = run_dir.display();
        match std::fs::metadata(run_dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::config(format!(
                    "--resume {shown}: no such directory; pass the run directory (the --out) of an earlier run"
                )));
            }
            Err(e) => return Err(Error::io(run_dir, e)),
            Ok(m) if !m.is_dir() => {
                return Err(Error::config(format!(
                    "--resume {shown}: is a file; pass the run directory (the --out) of an earlier run, not a file in it"
                )));
            }
            Ok(_) => {}
        }
        let root = run_dir.join(CHECKPOINTS_DIR);
        let steps = list_steps(&root)?;
        if steps.is_empty() {
            return Err(Error::config(format!(
                "--resume {shown}: no checkpoint in {} (the run stopped before its first checkpoint, or this is not a run directory); start a new run without --resume",
                root.display()
            )));
        }
        let mut skipped: Vec<String> = list_leftovers(&root)
            .into_iter()
            .map(|p| {
                format!(
                    "{}: incomplete (the process stopped while writing it); ignoring it",
                    p.display()
                )
            })
            .collect();
        let mut first_failure = None;
        for (step, dir) in &steps {
            match load_dir(run_dir, dir, *step) {
                Ok(mut ck) => {
                    ck.skipped = skipped;
                    return Ok(ck);
                }
                Err(reason) => {
                    skipped.push(format!(
                        "{}: {reason}; using an older checkpoint",
                        dir.display()
                    ));
                    first_failure.get_or_insert(format!("{}: {reason}", dir.display()));
                }
            }
        }
        Err(Error::Checkpoint(format!(
            "{}; no older complete checkpoint to fall back to; start a new run without --resume",
            first_failure.unwrap_or_default()
        )))
    }

    /// The path of the checkpoint's `config.json` (usable as `--config`).
    pub fn config_path(&self) -> PathBuf {
        self.dir.join(CONFIG_FILE)
    }

    /// Check that `now` may continue this checkpoint and return the run's configuration: `now`
    /// with `out` set to the run directory.
    ///
    /// Settings that decide the computation (width, conv, optimizer, batch size, accumulation,
    /// precision, gradient checkpointing, seed, augmentation) must match, or the error lists every
    /// difference as `width: checkpoint 32, now 16; ...`. `--out`, when given, must name the run
    /// directory. Other changes are allowed; see [`Checkpoint::noted_changes`].
    pub fn resume_config(&self, now: &TrainConfig, out_given: bool) -> Result<TrainConfig> {
        let mut diffs = differences(&self.config, now, MUST_MATCH);
        if out_given {
            if let Some(out) = &now.out {
                let same = match (out.canonicalize(), self.run_dir.canonicalize()) {
                    (Ok(a), Ok(b)) => a == b,
                    _ => out == &self.run_dir,
                };
                if !same {
                    diffs.push(format!(
                        "out: run directory {}, now {}",
                        self.run_dir.display(),
                        out.display()
                    ));
                }
            }
        }
        if !diffs.is_empty() {
            return Err(Error::config(format!(
                "--resume {}: the configuration conflicts with the checkpoint ({}); drop those flags to continue with the checkpoint's settings, or start a new run with another --out",
                self.run_dir.display(),
                diffs.join("; ")
            )));
        }
        Ok(TrainConfig {
            out: Some(self.run_dir.clone()),
            ..now.clone()
        })
    }

    /// Allowed changes that alter the rest of the run (epochs, max steps, learning-rate
    /// schedule and optimizer hyperparameters), as `field: checkpoint A, now B`.
    pub fn noted_changes(&self, now: &TrainConfig) -> Vec<String> {
        differences(&self.config, now, NOTED)
    }

    /// Load the checkpoint into `trainer`: parameters, BatchNorm running statistics, optimizer
    /// state and step count, loss scaler, global step and data position. Everything is checked
    /// before anything is changed; the training data must be the checkpoint's (same fingerprint).
    pub fn restore(&self, trainer: &mut Trainer) -> Result<()> {
        let s = &self.state;
        let fingerprint = trainer
            .checkpoints
            .fingerprint
            .get_or_init(|| data_fingerprint(&trainer.train))
            .clone();
        if fingerprint != s.train_fingerprint {
            return Err(Error::config(format!(
                "--resume {}: the training data differs from the checkpoint's (training data: checkpoint {} images, {}; now {} images, {}); pass the --data-dir the run was trained on",
                self.run_dir.display(),
                s.train_images,
                s.data_description,
                trainer.train.len(),
                trainer.data_description
            )));
        }
        if s.steps_per_epoch != trainer.steps_per_epoch {
            return Err(Error::config(format!(
                "--resume {}: steps per epoch: checkpoint {}, now {}; use the checkpoint's --batch-size",
                self.run_dir.display(),
                s.steps_per_epoch,
                trainer.steps_per_epoch
            )));
        }
        let bad = |m: String| Error::Checkpoint(format!("{}: {m}", self.dir.display()));

        // Check: every parameter and buffer present with its shape, nothing unknown.
        let vars = trainer.model.named_vars();
        let buffers = trainer.model.named_buffers();
        let expected: Vec<(&str, &candle_core::Shape)> = vars
            .iter()
            .map(|(n, v)| (n.as_str(), v.shape()))
            .chain(buffers.iter().map(|(n, b)| (n.as_str(), b.shape())))
            .collect();
        for (name, shape) in &expected {
            let t = self
                .model
                .get(*name)
                .ok_or_else(|| bad(format!("{MODEL_FILE} lacks '{name}'")))?;
            if t.shape() != *shape || t.dtype() != DType::F32 {
                return Err(bad(format!(
                    "'{name}' is {:?} {:?} in the checkpoint, the model needs {:?} F32",
                    t.dtype(),
                    t.shape(),
                    shape
                )));
            }
        }
        if self.model.len() != expected.len() {
            let unknown = self
                .model
                .keys()
                .find(|k| !expected.iter().any(|(n, _)| n == k));
            return Err(bad(format!(
                "{MODEL_FILE} holds an unknown tensor '{}'",
                unknown.map_or("?", |s| s)
            )));
        }
        let mut opt_state = Vec::with_capacity(self.optimizer.len());
        for (name, t) in &self.optimizer {
            let idx = name
                .split_once('.')
                .filter(|(slot, _)| *slot == "s1" || *slot == "s2")
                .and_then(|(_, i)| i.parse::<usize>().ok())
                .ok_or_else(|| bad(format!("{OPTIMIZER_FILE} holds an unknown tensor '{name}'")))?;
            let (pname, var) = vars
                .get(idx)
                .ok_or_else(|| bad(format!("{OPTIMIZER_FILE}: '{name}' has no parameter")))?;
            if t.shape() != var.shape() || t.dtype() != DType::F32 {
                return Err(bad(format!(
                    "{OPTIMIZER_FILE}: '{name}' does not match the shape of '{pname}'"
                )));
            }
            opt_state.push((name.clone(), t.to_device(&trainer.device)?));
        }
        if s.scaler.is_some() != trainer.scaler.is_some() {
            return Err(bad(
                "the loss-scaler state does not match --precision".into()
            ));
        }
        if self.masks.is_some() != trainer.pruner.is_some() {
            return Err(bad("the pruning masks do not match --prune".into()));
        }
        // Checked (and built) before anything is changed; applied below.
        let pruner = match (&self.masks, &trainer.pruner) {
            (Some(masks), Some(p)) => {
                let mut fresh = super::prune::Pruner::new(*p.schedule(), &vars)?;
                fresh.load_masks(masks.clone()).map_err(|e| {
                    let e = e.to_string();
                    bad(format!(
                        "{MASKS_FILE}: {}",
                        e.trim_start_matches("checkpoint: ")
                    ))
                })?;
                Some(fresh)
            }
            _ => None,
        };

        // Apply.
        for (name, var) in &vars {
            var.set(&self.model[name].to_device(&trainer.device)?)?;
        }
        for (name, _) in &buffers {
            trainer
                .model
                .set_buffer(name, self.model[name].to_device(&trainer.device)?)?;
        }
        let cfg = &trainer.config;
        let mut optimizer =
            Optimizer::new(cfg.optimizer, vars.len(), cfg.momentum, cfg.weight_decay);
        optimizer.load_state(opt_state)?;
        optimizer.steps = s.optimizer_steps;
        trainer.optimizer = optimizer;
        if pruner.is_some() {
            trainer.pruner = pruner;
        }
        trainer.scaler = s.scaler.clone();
        trainer.global_step = s.global_step;
        trainer.start_epoch = s.epoch;
        trainer.start_batch = s.next_batch;
        trainer.checkpoints.last_step = Some(s.global_step);
        Ok(())
    }
}
