//! Configuration comparisons: several trainer runs, each in its own child process, with common
//! flags, reported against the first run.
//!
//! Among the charts of [`super::report::write_compare_report`] is `step_timeline.{png,svg}`: the
//! memory inside one training step of every run that recorded a `step_timeline.json`, side by
//! side ([`super::step_overlay::write_step_timeline_overlays`]).

pub use super::results::{CompareEntry, CompareResult};
use super::{describe, merge_flags, oom_report_link, run_child, slug, split_flags, Progress};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// One configuration to compare: a label and the trainer flags that make it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunSpec {
    /// Label in tables and charts.
    pub label: String,
    /// Trainer flags of this configuration.
    pub flags: Vec<String>,
}

impl RunSpec {
    /// A configuration from a flag string such as `--precision f16 --checkpoint stages`.
    /// A leading `NAME:` (text before a colon, not starting with `-`) sets the label; otherwise
    /// the label is the flag string itself (`default` when empty).
    pub fn from_flags(text: &str) -> Result<RunSpec> {
        let t = text.trim();
        let (label, flags) = match t.split_once(':') {
            Some((name, rest))
                if !name.trim().is_empty()
                    && !name.trim_start().starts_with('-')
                    && !name.contains(char::is_whitespace) =>
            {
                (name.trim().to_string(), rest.trim())
            }
            _ => (String::new(), t),
        };
        let words = split_flags(flags)?;
        if let Some(w) = words.first().filter(|w| !w.starts_with('-')) {
            return Err(Error::config(format!(
                "--run \"{text}\": expected trainer flags such as \"--precision f16\", got '{w}' first"
            )));
        }
        let label = if !label.is_empty() {
            label
        } else if words.is_empty() {
            "default".to_string()
        } else {
            words.join(" ")
        };
        Ok(RunSpec {
            label,
            flags: words,
        })
    }

    /// A configuration from a `config.json` file (as written by `train_cifar10` into its run
    /// directory), passed to the child as `--config FILE`; labelled by the file name, or the
    /// run directory name for a `config.json`; a numeric ordering prefix such as `00-` is dropped.
    pub fn from_config_file(path: &Path) -> Result<RunSpec> {
        if !path.is_file() {
            return Err(Error::config(format!(
                "--configs {}: no such file; pass config.json files as written into run directories",
                path.display()
            )));
        }
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        // `00-default.json` → `default` (numeric prefixes only order the files for a glob).
        let digits = stem.len() - stem.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let stem = match stem[digits..].strip_prefix(['-', '_']) {
            Some(rest) if digits > 0 && !rest.is_empty() => rest.to_string(),
            _ => stem,
        };
        let label = if stem == "config" {
            path.parent()
                .and_then(|p| p.file_name())
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or(stem)
        } else {
            stem
        };
        let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        Ok(RunSpec {
            label,
            flags: vec!["--config".into(), abs.to_string_lossy().into_owned()],
        })
    }
}

/// Everything a comparison needs.
#[derive(Debug, Clone)]
pub struct CompareOptions {
    /// How trainer children are started.
    pub trainer: super::TrainerCommand,
    /// Output directory: results files, charts and one run directory per configuration.
    pub out: PathBuf,
    /// Configurations; the others are compared with the first.
    pub runs: Vec<RunSpec>,
    /// Flags given to every run (a run's own flags override them).
    pub common: Vec<String>,
    /// Kill a run that takes longer than this (recorded as failed).
    pub timeout: Option<Duration>,
    /// Show progress on stderr.
    pub progress: bool,
    /// The command line, recorded in the results.
    pub command: String,
    /// When set (e.g. by [`crate::signal::install_stop_handler`]), no further run starts; the
    /// result so far comes back with `interrupted` set.
    pub stop: Option<Arc<AtomicBool>>,
}

/// Run every configuration in its own child process (in order, the first the one the others are
/// compared with), with `--out <out>/<NN-label> --quiet` added. OOM and failed runs are recorded and the
/// comparison goes on; when `opts.stop` is set, no further run starts and the result comes back
/// with `interrupted` set. `compare.json`, `compare.csv` and `compare.md` are rewritten (atomically)
/// after every run. The charts are drawn by [`super::report::write_compare_report`].
pub fn run_compare(opts: &CompareOptions) -> Result<CompareResult> {
    if opts.runs.is_empty() {
        return Err(Error::config(
            "nothing to compare; give --run \"FLAGS\" (repeatable) or --configs FILE…",
        ));
    }
    for (i, spec) in opts.runs.iter().enumerate() {
        if opts.runs[..i].iter().any(|r| r.label == spec.label) {
            return Err(Error::config(format!(
                "two configurations are labelled '{}', so their rows could not be told apart; \
                 name them with --run \"NAME: FLAGS\"",
                spec.label
            )));
        }
    }
    super::check_timeout(opts.timeout)?;
    let points: Vec<(String, PathBuf, Vec<String>)> = opts
        .runs
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            let dir = opts
                .out
                .join("runs")
                .join(format!("{:02}-{}", i + 1, slug(&spec.label)));
            let fixed = vec![
                "--quiet".to_string(),
                "--out".to_string(),
                dir.to_string_lossy().into_owned(),
            ];
            let args = merge_flags(&[&opts.common, &spec.flags, &fixed]);
            (format!("--run '{}'", spec.label), dir, args)
        })
        .collect();
    let dry: Vec<(String, Vec<String>)> = points
        .iter()
        .map(|(w, _, a)| (w.clone(), a.clone()))
        .collect();
    super::preflight(&opts.trainer, &dry)?;
    super::ensure_fresh(&opts.out.join("runs"))?;
    crate::io::create_dir(&opts.out)?;
    let mut result = CompareResult {
        command: opts.command.clone(),
        common: opts.common.clone(),
        entries: Vec::new(),
        interrupted: false,
    };
    let mut progress = Progress::new(opts.runs.len() as u64, opts.progress);
    for (spec, (_, dir, args)) in opts.runs.iter().zip(&points) {
        if opts.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst)) {
            result.interrupted = true;
            super::report::write_compare_files(&opts.out, &result)?;
            break;
        }
        progress.start(&spec.label);
        let run = run_child(&opts.trainer, args, dir, opts.timeout)?;
        progress.finish(&describe(&spec.label, &run));
        result.entries.push(CompareEntry {
            label: spec.label.clone(),
            flags: spec.flags.clone(),
            oom_report: oom_report_link(&run, &opts.out),
            run,
            peak_change_pct: None,
            speed_change_pct: None,
        });
        result.update_changes();
        super::report::write_compare_files(&opts.out, &result)?;
    }
    progress.close();
    Ok(result)
}
