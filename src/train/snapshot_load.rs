//! Reading a snapshot back for `--resume`: the newest complete one of a run directory
//! ([`Snapshot::find_latest`]: its signed manifest, every file it lists checked against its size
//! and hash, the data position), and whether the flags given now may continue it
//! ([`Snapshot::resume_config`], [`Snapshot::noted_changes`]). The layout and the writing are
//! in [`super::snapshot`].

use super::history::RunHistory;
use super::snapshot::{
    list_leftovers, list_steps, manifest_path, snapshots_root, verify, Manifest, Reason, Snapshot,
    CONFIG_FILE, FORMAT, HISTORY_FILE, LEGACY_FORMAT, MANIFEST_FILE, MASKS_FILE,
    MAX_MANIFEST_BYTES, MEMORY_FILE, MODEL_FILE, OPTIMIZER_FILE, VERSION,
};
use super::state::TrainState;
use crate::config::{CompressActivations, GradCheckpointing, TrainConfig};
use crate::error::{Error, Result};
use crate::io::hash_bytes;
use candle_core::Device;
use memtrain_core::memory::MemoryLog;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Fields that decide what the training computes; a resumed run must match the snapshot in all.
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
    "clip_during",
    "compress_activations",
    "memory_limit",
];

/// Read and verify one snapshot directory: its signed manifest, every file it lists (sizes and
/// hashes), their contents and the data position they describe.
fn load_dir(run_dir: &Path, dir: &Path, step: usize) -> std::result::Result<Snapshot, Reason> {
    let state = read_manifest(dir, step)?;
    let contents = read_listed_files(dir, &state)?;
    let config: TrainConfig = serde_json::from_slice(&contents[CONFIG_FILE])
        .map_err(|e| format!("damaged {CONFIG_FILE} ({e})"))?;
    let history: RunHistory = serde_json::from_slice(&contents[HISTORY_FILE])
        .map_err(|e| format!("damaged {HISTORY_FILE} ({e})"))?;
    let memory: MemoryLog = serde_json::from_slice(&contents[MEMORY_FILE])
        .map_err(|e| format!("damaged {MEMORY_FILE} ({e})"))?;
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
    if masks.is_some() != config.pruning.prune.is_some() {
        return Err(format!(
            "{MASKS_FILE} is {} but the config {} --prune",
            if masks.is_some() {
                "present"
            } else {
                "missing"
            },
            if config.pruning.prune.is_some() {
                "has"
            } else {
                "has no"
            }
        ));
    }
    check_position(&state, &history)?;
    Ok(Snapshot {
        run_dir: run_dir.to_path_buf(),
        dir: dir.to_path_buf(),
        healthy: state.healthy,
        state: TrainState {
            global_step: state.global_step,
            epoch: state.epoch,
            next_batch: state.next_batch,
            steps_per_epoch: state.steps_per_epoch,
            total_steps: state.total_steps,
            model,
            optimizer,
            optimizer_steps: state.optimizer_steps,
            scaler: state.scaler,
            masks,
            train_images: state.train_images,
            train_fingerprint: state.train_fingerprint,
            data_description: state.data_description,
            history,
            memory,
        },
        config,
        skipped: Vec::new(),
    })
}

/// The verified manifest of the snapshot directory `dir` of step `step`.
fn read_manifest(dir: &Path, step: usize) -> std::result::Result<Manifest, Reason> {
    let manifest_path = manifest_path(dir);
    let text = match crate::io::read_capped(&manifest_path, MAX_MANIFEST_BYTES) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!("incomplete (no {MANIFEST_FILE})"));
        }
        Err(e) => return Err(format!("cannot read {MANIFEST_FILE} ({e})")),
    };
    let state = verify(&text)?;
    if state.format != FORMAT && state.format != LEGACY_FORMAT {
        return Err(format!(
            "{MANIFEST_FILE} is not a memtrain snapshot manifest"
        ));
    }
    if state.version != VERSION {
        return Err(format!(
            "snapshot format version {} (this build reads version {VERSION})",
            state.version
        ));
    }
    if state.global_step != step {
        return Err(format!(
            "{MANIFEST_FILE} says step {}, the directory step {step}",
            state.global_step
        ));
    }
    Ok(state)
}

/// The files the manifest `state` lists, read from `dir` and checked against its sizes and
/// hashes, by name.
fn read_listed_files(
    dir: &Path,
    state: &Manifest,
) -> std::result::Result<HashMap<&'static str, Vec<u8>>, Reason> {
    let mut contents = HashMap::new();
    // The masks file is listed (so size and hash are checked) exactly when the run prunes.
    let masks_listed = state.files.contains_key(MASKS_FILE);
    let listed = [
        MODEL_FILE,
        OPTIMIZER_FILE,
        CONFIG_FILE,
        HISTORY_FILE,
        MEMORY_FILE,
        MASKS_FILE,
    ];
    if let Some(extra) = state.files.keys().find(|k| !listed.contains(&k.as_str())) {
        return Err(format!("{MANIFEST_FILE} lists an unknown file {extra}"));
    }
    for name in listed
        .into_iter()
        .filter(|n| *n != MASKS_FILE || masks_listed)
    {
        let entry = state
            .files
            .get(name)
            .ok_or_else(|| format!("{MANIFEST_FILE} does not list {name}"))?;
        // Capped at the listed size: a file that grew (or a FIFO put in its place) is refused
        // without reading it all.
        let bytes = crate::io::read_capped(&dir.join(name), entry.bytes)
            .map_err(|e| format!("cannot read {name} ({e})"))?;
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
    Ok(contents)
}

/// The manifest's data position (epoch, next batch) is one the history can continue from.
fn check_position(state: &Manifest, history: &RunHistory) -> std::result::Result<(), Reason> {
    if state.steps_per_epoch == 0 || state.next_batch > state.steps_per_epoch {
        return Err(format!(
            "{MANIFEST_FILE} has batch {} of an epoch of {} steps",
            state.next_batch, state.steps_per_epoch
        ));
    }
    let pending = history.progress.as_ref().map(|p| p.epoch);
    if (state.next_batch == state.steps_per_epoch && pending.is_none())
        || pending.is_some_and(|e| e != state.epoch)
    {
        return Err(format!(
            "{HISTORY_FILE} does not match the position in {MANIFEST_FILE} (epoch {}, batch {})",
            state.epoch, state.next_batch
        ));
    }
    Ok(())
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

/// `field: snapshot A, now B` for each field in `keys` that differs.
fn differences(then: &TrainConfig, now: &TrainConfig, keys: &[&str]) -> Vec<String> {
    let (Ok(a), Ok(b)) = (serde_json::to_value(then), serde_json::to_value(now)) else {
        return vec!["the configuration cannot be compared".into()];
    };
    keys.iter()
        .filter(|k| a.get(**k) != b.get(**k))
        .map(|k| format!("{k}: snapshot {}, now {}", show(a.get(*k)), show(b.get(*k))))
        .collect()
}

/// The error for `--resume` of `run_dir` whose snapshot folder `root` holds none: what the
/// directory is, and the way forward that works for it.
fn no_snapshot(run_dir: &Path, root: &Path) -> Error {
    let shown = run_dir.display();
    if super::run_dir::in_use(run_dir) {
        return Error::config(format!(
            "--resume {shown}: a running memtrain process holds this run directory and has not \
             saved its first snapshot yet; wait for it to end (Ctrl-C stops it with a snapshot), \
             then resume"
        ));
    }
    let way_forward = if super::run_dir::holds_results(run_dir) {
        format!(
            "its results have no snapshot to continue from; start a new run with another --out, \
             or with --out {shown} --overwrite to replace them"
        )
    } else {
        "start a new run without --resume".to_string()
    };
    Error::config(format!(
        "--resume {shown}: no snapshot in {} (the run stopped before its first snapshot, or this \
         is not a run directory); {way_forward}",
        root.display()
    ))
}

impl Snapshot {
    /// The newest complete snapshot of the run in `run_dir`.
    ///
    /// Damaged or incomplete newer ones are skipped and listed in [`Snapshot::skipped`]. Errors
    /// (one line each): `run_dir` missing or not a directory, or no snapshot in it
    /// ([`CoreError::Config`](crate::error::CoreError::Config)); no complete snapshot ([`Error::Snapshot`], naming the newest
    /// one's problem).
    pub fn find_latest(run_dir: &Path) -> Result<Snapshot> {
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
        let root = snapshots_root(run_dir);
        let steps = list_steps(&root)?;
        if steps.is_empty() {
            return Err(no_snapshot(run_dir, &root));
        }
        let mut skipped: Vec<String> = list_leftovers(&root)
            .into_iter()
            .map(|p| {
                let old = p.file_name().is_some_and(|n| {
                    n.to_string_lossy().starts_with(super::snapshot::OLD_PREFIX)
                });
                match old {
                    true => format!(
                        "{}: an older snapshot the process was deleting when it stopped; ignoring it",
                        p.display()
                    ),
                    false => format!(
                        "{}: incomplete (the process stopped while writing it); ignoring it",
                        p.display()
                    ),
                }
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
                        "{}: {reason}; using an older snapshot",
                        dir.display()
                    ));
                    first_failure.get_or_insert(format!("{}: {reason}", dir.display()));
                }
            }
        }
        // A new run would refuse this directory (it holds snapshots): name an --out that works.
        Err(Error::Snapshot(format!(
            "{}; no older complete snapshot to fall back to; start a new run with another --out, \
             or with --out {} --overwrite to replace this one",
            first_failure.unwrap_or_default(),
            run_dir.display()
        )))
    }

    /// The path of the snapshot's `config.json` (usable as `--config`).
    pub(crate) fn config_path(&self) -> PathBuf {
        self.dir.join(CONFIG_FILE)
    }

    /// Check that `now` may continue this snapshot and return the run's configuration: `now`
    /// with `out` set to the run directory.
    ///
    /// Settings that decide the computation (width, conv, optimizer, batch size, accumulation,
    /// precision, gradient checkpointing, seed, augmentation) must match, or the error lists every
    /// difference as `width: snapshot 32, now 16; ...`. `--out`, when given, must name the run
    /// directory. `auto` (`--checkpoint`, `--compress-activations`) keeps the plan the run chose.
    /// Other changes are allowed; see [`Snapshot::noted_changes`].
    pub fn resume_config(&self, now: &TrainConfig, out_given: bool) -> Result<TrainConfig> {
        // `auto` chose the run's plan when it started (config.json keeps the choice): keep it.
        let mut now = now.clone();
        let (then, plan) = (&self.config.memory, &mut now.memory);
        if plan.grad_checkpointing == GradCheckpointing::Auto {
            plan.grad_checkpointing = then.grad_checkpointing;
        }
        if plan.compress_activations == CompressActivations::Auto {
            plan.compress_activations = then.compress_activations;
        }
        let mut diffs = differences(&self.config, &now, MUST_MATCH);
        if out_given {
            if let Some(out) = &now.output.out {
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
                "--resume {}: the configuration conflicts with the snapshot ({}); drop those flags to continue with the snapshot's settings, or start a new run with another --out",
                self.run_dir.display(),
                diffs.join("; ")
            )));
        }
        now.output.out = Some(self.run_dir.clone());
        Ok(now)
    }

    /// Allowed changes that alter the rest of the run (epochs, max steps, learning-rate
    /// schedule, optimizer hyperparameters, codes, memory limit), as `field: snapshot A, now B`.
    pub fn noted_changes(&self, now: &TrainConfig) -> Vec<String> {
        differences(&self.config, now, NOTED)
    }
}
