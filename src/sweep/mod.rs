//! Process-isolated measurements: batch-size sweeps ([`batch`]), configuration comparisons
//! ([`compare`]), their tables and charts ([`report`]), the memory–speed frontier
//! ([`frontier`]), the budget sweep's chart ([`budget_chart`]) and the chart machinery they share
//! (`chart`).
//!
//! Every measured point runs the `train_cifar10` example binary in its own child process, so an
//! out-of-memory error or a crash in one point cannot affect the next, and each point starts from
//! a clean allocator. A child that reports `error: out of memory` is a recorded result
//! ([`Status::Oom`]); one that dies otherwise is recorded as [`Status::Failed`] with its exit
//! status or signal. Neither stops the sweep.

pub mod batch;
pub mod budget_chart;
pub(crate) mod chart;
pub mod compare;
pub mod frontier;
pub mod report;
mod report_charts;
pub mod results;
pub mod step_chart;
pub mod step_overlay;

use crate::error::{Error, Result};
use crate::train::Summary;
use serde::{Deserialize, Serialize};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How a child run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// The run finished and wrote its summary.
    Ok,
    /// The run needed more memory than the limit (or the device) allows.
    Oom,
    /// The run died otherwise: a signal, a non-memory error, a timeout or a missing summary.
    Failed,
}

impl Status {
    /// The spelling used in tables and CSV files (`ok`, `OOM`, `failed`).
    pub fn as_str(&self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Oom => "OOM",
            Status::Failed => "failed",
        }
    }

    /// Parse the table/CSV spelling (case-insensitive).
    pub fn parse(s: &str) -> Option<Status> {
        match s.trim().to_ascii_lowercase().as_str() {
            "ok" => Some(Status::Ok),
            "oom" => Some(Status::Oom),
            "failed" => Some(Status::Failed),
            _ => None,
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The outcome of one child run of the trainer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChildRun {
    /// Arguments given to the trainer (without the program name).
    pub args: Vec<String>,
    /// The child's run directory (`--out`); holds `stdout.log` and `stderr.log` too.
    pub run_dir: PathBuf,
    /// How it ended.
    pub status: Status,
    /// The out-of-memory message, the failure reason, or empty.
    pub note: String,
    /// Exit code, when the child exited normally.
    pub exit_code: Option<i32>,
    /// Signal number, when the child was killed by a signal.
    pub signal: Option<i32>,
    /// Wall-clock seconds of the child process.
    pub wall_secs: f64,
    /// The child's `summary.json`, when it finished.
    pub summary: Option<Summary>,
    /// True when the child's flags ask for a lossy step (`--compress-activations int8|int4|int2`: its
    /// gradients are not the exact step's), read from `args` whether or not it finished
    /// ([`lossy_flags`]). Results written before it existed read as false.
    #[serde(default)]
    pub lossy: bool,
}

impl ChildRun {
    /// The configuration's training peak: the highest step peak the probe measured (absolute:
    /// includes the baseline), when the run finished. A run's peak outside its steps (phase
    /// "other": loading the data; or the evaluation) is [`ChildRun::run_peak`], not this.
    pub fn peak_bytes(&self) -> Option<u64> {
        self.summary.as_ref().map(|s| s.memory.step_peak_bytes)
    }

    /// The run's peak over the whole process (data loading and evaluation included) and its
    /// phase, when the run finished.
    pub(crate) fn run_peak(&self) -> Option<(u64, Option<&str>)> {
        self.summary
            .as_ref()
            .map(|s| (s.memory.peak_bytes, s.memory.peak_phase.as_deref()))
    }

    /// Bytes in use when training began (data, model, probe baseline), when the run finished.
    pub fn baseline_bytes(&self) -> Option<u64> {
        self.summary.as_ref().map(|s| s.memory.baseline_bytes)
    }

    /// The training peak above the baseline (what training itself added), when the run finished.
    pub(crate) fn peak_above_baseline(&self) -> Option<u64> {
        self.summary.as_ref().map(|s| {
            s.memory
                .step_peak_bytes
                .saturating_sub(s.memory.baseline_bytes)
        })
    }

    /// Highest reserved bytes of the CUDA pool (absent on the CPU).
    pub(crate) fn reserved_peak_bytes(&self) -> Option<u64> {
        self.summary
            .as_ref()
            .and_then(|s| s.memory.reserved_peak_bytes)
    }

    /// Training throughput in images per second, when the run finished.
    pub fn images_per_sec(&self) -> Option<f64> {
        self.summary.as_ref().map(|s| s.progress.images_per_sec)
    }

    /// The segmentation the run trained with (`--checkpoint auto` resolved), when it finished
    /// and its summary records the segments.
    pub(crate) fn segmentation(&self) -> Option<crate::config::GradCheckpointing> {
        let segments = &self.summary.as_ref()?.optimizations.checkpoint_segments;
        let (_, cut) = segments.split_last()?;
        // A segment ending after block b is a cut there: bit b - 1.
        let mask = cut.iter().fold(0u8, |m, s| m | 1 << (s[1] - 1));
        Some(crate::config::GradCheckpointing::from_cuts(mask))
    }
}

/// Whether trainer flags ask for a lossy step: the configuration they make, a `--config` file
/// merged in as the trainer merges it, stores its saved activations lossily
/// ([`crate::config::ActivationStorage::is_lossy`]). Flags the trainer would refuse are not lossy
/// (such a point never runs).
pub fn lossy_flags(args: &[String]) -> bool {
    trainer_config(args).is_some_and(|c| c.memory.compress_activations.may_be_lossy())
}

/// The configuration trainer flags make, a `--config` file merged in as the trainer merges it;
/// `None` for flags the trainer would refuse.
pub(crate) fn trainer_config(args: &[String]) -> Option<crate::config::TrainConfig> {
    let argv = std::iter::once("train_cifar10").chain(args.iter().map(String::as_str));
    match crate::cli::parse_train_args(argv) {
        Ok(Ok(parsed)) => crate::cli::TrainCommand::try_from(parsed)
            .ok()
            .map(|c| c.config),
        _ => None,
    }
}

/// Where an out-of-memory run's report is, for the results tables: `None` unless `run` ran out
/// of memory and its run directory holds [`memtrain_core::memory::timeline::OOM_REPORT_FILE`] (a trainer
/// that stops on out-of-memory writes it; older ones do not, so the file is looked for, not
/// assumed). The path is relative to `results_dir`, where the tables are written, so that the
/// links keep working when the directory moves; absolute when the run directory lies elsewhere.
pub fn oom_report_link(run: &ChildRun, results_dir: &Path) -> Option<PathBuf> {
    if run.status != Status::Oom {
        return None;
    }
    let file = run
        .run_dir
        .join(memtrain_core::memory::timeline::OOM_REPORT_FILE);
    if !file.is_file() {
        return None;
    }
    Some(match file.strip_prefix(results_dir) {
        Ok(rel) => rel.to_path_buf(),
        Err(_) => std::path::absolute(&file).unwrap_or(file),
    })
}

/// The environment variable with which a sweep or comparison binary runs as `train_cifar10`:
/// each point re-runs the sweep's own executable with it set to the sweep's process id
/// ([`TrainerCommand`]; the binary's `main` answers it through
/// [`crate::app::serve_as_trainer`]), so a sweep needs no other binary. An environment variable
/// rather than a flag: no user-facing command accepts it. The id is the sweep's marker: the
/// variable left in a shell (`MEMTRAIN_AS_TRAINER=1`) names no parent, so it is ignored with a
/// note rather than turning `batch_sweep` into a trainer that refuses the sweep's flags.
pub const TRAINER_ROLE_ENV: &str = "MEMTRAIN_AS_TRAINER";

/// What [`TRAINER_ROLE_ENV`] makes of this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrainerRole {
    /// Not set: the program runs as itself.
    None,
    /// Set to the parent's process id: a point of the sweep that started this process.
    Point,
    /// Set to anything else (left in a shell): ignored; the value, for the note.
    Stray(String),
}

/// This process's [`TrainerRole`], from its environment and its parent's process id.
pub fn trainer_role() -> TrainerRole {
    #[cfg(unix)]
    let parent = std::os::unix::process::parent_id();
    #[cfg(not(unix))]
    let parent = 0;
    role_of(std::env::var_os(TRAINER_ROLE_ENV), parent)
}

/// [`trainer_role`] for a value of [`TRAINER_ROLE_ENV`] and a parent process id.
fn role_of(value: Option<std::ffi::OsString>, parent: u32) -> TrainerRole {
    match value {
        None => TrainerRole::None,
        Some(v) if v.to_str() == Some(parent.to_string().as_str()) => TrainerRole::Point,
        Some(v) => TrainerRole::Stray(v.to_string_lossy().into_owned()),
    }
}

/// What Linux calls the running executable. Spawning it rather than the path the executable was
/// started from keeps every point on the build the sweep started with, even when `cargo build`
/// replaces the file at that path meanwhile (the old file lives on while it runs).
const RUNNING_EXE: &str = "/proc/self/exe";

/// How a sweep or comparison starts a trainer child: by default its own executable again, in the
/// trainer's role ([`TRAINER_ROLE_ENV`]; the child is exactly this build, and nothing has to be
/// found under `target/`); with `--trainer PATH`, that `train_cifar10` binary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainerCommand {
    /// The program as the user knows it (shown in messages).
    program: PathBuf,
    /// True when the program is this executable, re-run in the trainer's role.
    own: bool,
    /// Children write `summary.json` only ([`crate::cli::SUMMARY_ONLY_ENV`]).
    summary_only: bool,
}

impl TrainerCommand {
    /// `explicit` when given (it must be a file), else this executable in the trainer's role.
    pub fn new(explicit: Option<&Path>) -> Result<Self> {
        match explicit {
            Some(p) if p.is_file() => Ok(TrainerCommand {
                program: p.to_path_buf(),
                own: false,
                summary_only: false,
            }),
            Some(p) => Err(Error::config(format!(
                "--trainer {}: no such file; pass the path of a train_cifar10 binary, or leave --trainer out to re-run this program as the trainer",
                p.display()
            ))),
            None => Ok(TrainerCommand {
                program: std::env::current_exe().map_err(|e| {
                    Error::Child(format!("cannot find the current executable: {e}"))
                })?,
                own: true,
                summary_only: false,
            }),
        }
    }

    /// The same trainer, its children writing `summary.json` only (batch-sweep points).
    pub(crate) fn summary_only(&self) -> Self {
        TrainerCommand {
            summary_only: true,
            ..self.clone()
        }
    }

    /// The command for trainer flags `args`, not yet started.
    fn command(&self, args: &[String]) -> Command {
        let own_image = Path::new(RUNNING_EXE);
        let mut cmd = if self.own && own_image.exists() {
            Command::new(own_image)
        } else {
            Command::new(&self.program)
        };
        if self.own {
            cmd.env(TRAINER_ROLE_ENV, std::process::id().to_string());
        }
        if self.summary_only {
            cmd.env(crate::cli::SUMMARY_ONLY_ENV, "1");
        }
        cmd.args(args);
        cmd
    }

    /// The program started.
    pub fn program(&self) -> &Path {
        &self.program
    }
}

/// Split a flag string the way a POSIX shell would split words: whitespace separates, single
/// quotes keep text literally, double quotes keep whitespace, a backslash escapes one character.
pub fn split_flags(s: &str) -> Result<Vec<String>> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(ch) => cur.push(ch),
                        None => {
                            return Err(Error::config(format!("unbalanced ' in flags \"{s}\"")))
                        }
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(ch) => cur.push(ch),
                            None => {
                                return Err(Error::config(format!("trailing \\ in flags \"{s}\"")))
                            }
                        },
                        Some(ch) => cur.push(ch),
                        None => {
                            return Err(Error::config(format!("unbalanced \" in flags \"{s}\"")))
                        }
                    }
                }
            }
            '\\' => {
                in_word = true;
                match chars.next() {
                    Some(ch) => cur.push(ch),
                    None => return Err(Error::config(format!("trailing \\ in flags \"{s}\""))),
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

/// The long-flag name of a token (`--width 4` → `width`, `--width=4` → `width`), or `None` for a value.
fn flag_name(token: &str) -> Option<&str> {
    let rest = token.strip_prefix("--")?;
    if rest.is_empty() {
        return None;
    }
    Some(rest.split('=').next().unwrap_or(rest))
}

/// Group tokens into flags with their values: `--a 1 --b --c=2` → `[[--a, 1], [--b], [--c=2]]`.
/// Tokens before the first flag form a group of their own.
fn flag_groups(tokens: &[String]) -> Vec<Vec<String>> {
    let mut groups: Vec<Vec<String>> = Vec::new();
    for t in tokens {
        if flag_name(t).is_some() || groups.is_empty() {
            groups.push(vec![t.clone()]);
        } else if let Some(g) = groups.last_mut() {
            g.push(t.clone());
        }
    }
    groups
}

/// The flag names present in `tokens`.
pub(crate) fn flag_names(tokens: &[String]) -> Vec<String> {
    tokens
        .iter()
        .filter_map(|t| flag_name(t))
        .map(str::to_string)
        .collect()
}

/// Concatenate flag lists, later lists overriding earlier ones: a flag (with its values) is
/// dropped from an earlier list when a later list gives it again (the trainer rejects a flag given
/// twice).
pub fn merge_flags(lists: &[&[String]]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, list) in lists.iter().enumerate() {
        let later: Vec<String> = lists[i + 1..].iter().flat_map(|l| flag_names(l)).collect();
        for g in flag_groups(list) {
            let overridden = g
                .first()
                .and_then(|t| flag_name(t))
                .is_some_and(|n| later.iter().any(|l| l == n));
            if !overridden {
                out.extend(g);
            }
        }
    }
    out
}

/// A file- and directory-name-safe slug of `s` (lowercase ASCII letters, digits, `-`, `.`).
pub(crate) fn slug(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if c.is_ascii_alphanumeric() || c == '.' {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('-') && !out.is_empty() {
            out.push('-');
        }
    }
    while out.ends_with('-') {
        out.pop();
    }
    out.truncate(60);
    if out.is_empty() {
        "run".into()
    } else {
        out
    }
}

/// Quote `s` for a shell command line when it needs quoting.
pub(crate) fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The command line that started this process, shell-quoted (recorded in results).
pub fn current_command_line() -> String {
    std::env::args()
        .map(|a| shell_quote(&a))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `runs/<prefix>-<UTC timestamp>`, the default output directory of sweeps and comparisons.
pub fn default_out_dir(prefix: &str) -> PathBuf {
    let base = crate::train::trainer::default_run_dir();
    let stamp = base
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    PathBuf::from("runs").join(format!("{prefix}-{stamp}"))
}

/// Refuse to write into `dir` when it already holds entries (results of an earlier sweep or
/// comparison), so that old runs are never mixed with, or mistaken for, new ones.
pub(crate) fn ensure_fresh(dir: &Path) -> Result<()> {
    let non_empty = std::fs::read_dir(dir)
        .map(|mut d| d.next().is_some())
        .unwrap_or(false);
    if non_empty {
        return Err(Error::config(format!(
            "{} already holds results of an earlier run; pass a new --out directory or remove it",
            dir.display()
        )));
    }
    Ok(())
}

/// Human name of a signal number.
fn signal_name(sig: i32) -> String {
    let name = match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        15 => "SIGTERM",
        _ => return format!("signal {sig}"),
    };
    format!("signal {sig} ({name})")
}

/// The out-of-memory message in a child's stderr, if any: the trainer's
/// `error: out of memory: …` line, Rust's `memory allocation of N bytes failed` abort, or a
/// CUDA out-of-memory error.
pub fn oom_message(stderr: &str) -> Option<String> {
    for line in stderr.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("error: ") {
            if rest.starts_with("out of memory") {
                // Keep the what-happened part, not the advice after the first ';' outside
                // parentheses (a refusal reads "out of memory (predicted; nothing was run): …").
                return Some(before_advice(rest).trim().to_string());
            }
        }
        if line.starts_with("memory allocation of") && line.contains("failed") {
            return Some(format!("out of memory: {line}"));
        }
        if line.contains("CUDA_ERROR_OUT_OF_MEMORY") {
            return Some("out of memory: CUDA_ERROR_OUT_OF_MEMORY".to_string());
        }
    }
    None
}

/// `msg` up to its first `;` outside parentheses: what happened, without the advice after it.
fn before_advice(msg: &str) -> &str {
    let mut depth = 0usize;
    for (i, c) in msg.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ';' if depth == 0 => return &msg[..i],
            _ => {}
        }
    }
    msg
}

/// The last non-empty line of `text`, shortened to 300 characters.
fn last_line(text: &str) -> String {
    let l = text
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .unwrap_or("");
    let l = l.strip_prefix("error: ").unwrap_or(l);
    if l.chars().count() > 300 {
        format!("{}…", l.chars().take(300).collect::<String>())
    } else {
        l.to_string()
    }
}

/// `--timeout 0` would kill every point at once: refused.
pub(crate) fn check_timeout(timeout: Option<Duration>) -> Result<()> {
    if timeout == Some(Duration::ZERO) {
        return Err(Error::config(
            "--timeout must be at least 1 second (leave it out for no limit)",
        ));
    }
    Ok(())
}

/// When every run failed (none ran, none ran out of memory), the error naming the first
/// failure; the sweep or comparison then exits non-zero although its files are written.
pub fn all_failed<'a>(mut runs: impl Iterator<Item = &'a ChildRun>) -> Result<()> {
    let Some(first) = runs.next() else {
        return Ok(());
    };
    if first.status == Status::Failed && runs.all(|r| r.status == Status::Failed) {
        return Err(Error::Child(format!(
            "every point failed; the first: {}",
            first.note
        )));
    }
    Ok(())
}

/// Find usage errors before any work: run the trainer of every point with `--dry-run` added. A
/// dry run reads the flags, the config file and the data set's size exactly as the real run will,
/// prints its estimate and writes nothing, in well under a second. A point the trainer refuses
/// (exit status 2) stops the whole command with the trainer's own message, naming the point, so
/// that a typo in the tenth configuration does not cost nine runs first. A point predicted not to
/// fit is no usage error: it is run and recorded as out of memory.
pub(crate) fn preflight(trainer: &TrainerCommand, points: &[(String, Vec<String>)]) -> Result<()> {
    for (what, args) in points {
        let out = trainer
            .command(args)
            .arg("--dry-run")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| {
                Error::Child(format!(
                    "cannot start {}: {e}; pass the path of a train_cifar10 binary with --trainer",
                    trainer.program.display()
                ))
            })?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.code() == Some(2) && oom_message(&stderr).is_none() {
            return Err(Error::config(format!(
                "{what}: the trainer refuses its flags ({}): {}; nothing was run",
                args.join(" "),
                last_line(&stderr)
            )));
        }
    }
    Ok(())
}

/// Run `trainer args…` as a child process with stdout and stderr going to `stdout.log` and
/// `stderr.log` in `run_dir` (created), wait for it (killing it after `timeout`), and classify the
/// outcome. Fails when the child cannot be started at all, and with [`CoreError::Config`](crate::error::CoreError::Config) when it
/// refused its flags (exit status 2): a usage error would fail every point alike.
pub(crate) fn run_child(
    trainer: &TrainerCommand,
    args: &[String],
    run_dir: &Path,
    timeout: Option<Duration>,
) -> Result<ChildRun> {
    crate::io::create_dir(run_dir)?;
    let stdout_path = run_dir.join("stdout.log");
    let stderr_path = run_dir.join("stderr.log");
    let stdout = std::fs::File::create(&stdout_path).map_err(|e| Error::io(&stdout_path, e))?;
    let stderr = std::fs::File::create(&stderr_path).map_err(|e| Error::io(&stderr_path, e))?;
    // A stale summary from an earlier sweep into the same directory must not be read as this run's.
    let summary_path = run_dir.join(crate::train::summary::SUMMARY_FILE);
    let _ = std::fs::remove_file(&summary_path);
    let start = Instant::now();
    let mut child = trainer
        .command(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr))
        .spawn()
        .map_err(|e| {
            Error::Child(format!(
                "cannot start {}: {e}; pass the path of a train_cifar10 binary with --trainer",
                trainer.program.display()
            ))
        })?;
    let (status, timed_out) = wait_for(&mut child, trainer, start, timeout)?;
    let wall_secs = start.elapsed().as_secs_f64();
    let stderr_text = std::fs::read(&stderr_path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let exit_code = status.code();
    #[cfg(unix)]
    let signal = std::os::unix::process::ExitStatusExt::signal(&status);
    #[cfg(not(unix))]
    let signal: Option<i32> = None;

    let mut run = ChildRun {
        args: args.to_vec(),
        run_dir: run_dir.to_path_buf(),
        status: Status::Failed,
        note: String::new(),
        exit_code,
        signal,
        wall_secs,
        summary: None,
        lossy: lossy_flags(args),
    };
    if timed_out {
        run.note = format!("timed out after {:.0} s and was killed", wall_secs);
    } else {
        judge(&mut run, status, &summary_path, &stderr_text)?;
    }
    Ok(run)
}

/// Wait for `child` to end, killing it once `timeout` has passed since `start`. Returns its exit
/// status and whether it was killed for the timeout.
fn wait_for(
    child: &mut std::process::Child,
    trainer: &TrainerCommand,
    start: Instant,
    timeout: Option<Duration>,
) -> Result<(std::process::ExitStatus, bool)> {
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) => {}
            Err(e) => {
                return Err(Error::Child(format!(
                    "waiting for {}: {e}",
                    trainer.program.display()
                )))
            }
        }
        if timeout.is_some_and(|t| start.elapsed() >= t) {
            let _ = child.kill();
            timed_out = true;
            break child.wait().map_err(|e| {
                Error::Child(format!("waiting for {}: {e}", trainer.program.display()))
            })?;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Ok((status, timed_out))
}

/// What a child that ended with `status` measured or why it failed, into `run`: its
/// `summary.json` (`summary_path`) when it exited 0, out of memory or another failure named from
/// the last line of its stderr (`stderr_text`). A usage error (exit 2) fails every point the same
/// way, so it is returned as the sweep's error.
fn judge(
    run: &mut ChildRun,
    status: std::process::ExitStatus,
    summary_path: &Path,
    stderr_text: &str,
) -> Result<()> {
    if status.success() {
        match std::fs::read_to_string(summary_path) {
            Ok(text) => match serde_json::from_str::<Summary>(&text) {
                Ok(s) => {
                    if s.status == crate::train::RunStatus::Ok {
                        run.status = Status::Ok;
                    } else {
                        run.note = format!("run ended with status '{}'", s.status);
                    }
                    run.summary = Some(s);
                }
                Err(e) => run.note = format!("{}: not a summary ({e})", summary_path.display()),
            },
            Err(e) => run.note = format!("exited 0 but wrote no {} ({e})", summary_path.display()),
        }
    } else if let Some(msg) = oom_message(stderr_text) {
        run.status = Status::Oom;
        run.note = msg;
    } else if run.exit_code == Some(2) {
        // A usage error fails every point the same way: stop at the first with the trainer's
        // own message (exit 2), and leave no point directory behind to block a retry.
        let _ = std::fs::remove_dir_all(&run.run_dir);
        return Err(Error::config(format!(
            "the trainer refused the flags of this point ({}): {}",
            run.args.join(" "),
            last_line(stderr_text)
        )));
    } else {
        let how = match (run.exit_code, run.signal) {
            (_, Some(sig)) => format!("killed by {}", signal_name(sig)),
            (Some(code), _) => format!("exit status {code}"),
            _ => "ended abnormally".to_string(),
        };
        let last = last_line(stderr_text);
        run.note = if last.is_empty() {
            how
        } else {
            format!("{how}: {last}")
        };
    }
    Ok(())
}

/// Progress across the points of a sweep or comparison: an indicatif bar on a terminal, plain
/// lines on stderr otherwise, nothing when disabled. With a known total the lines count `[k/n]`;
/// a search, whose points depend on what the earlier ones measured, counts `[point k]` instead
/// of a total that would only ever equal the count.
pub(crate) struct Progress {
    bar: Option<indicatif::ProgressBar>,
    plain: bool,
    /// `None`: not known in advance ([`Progress::open_ended`]).
    total: Option<u64>,
    done: u64,
}

impl Progress {
    /// Progress over `total` points.
    pub fn new(total: u64, enabled: bool) -> Self {
        Self::start_with(Some(total), enabled)
    }

    /// Progress over points whose number is not known in advance (a `--find-max` search).
    pub fn open_ended(enabled: bool) -> Self {
        Self::start_with(None, enabled)
    }

    fn start_with(total: Option<u64>, enabled: bool) -> Self {
        let tty = std::io::stderr().is_terminal();
        let bar = (enabled && tty).then(|| {
            let (bar, template) = match total {
                Some(n) => (
                    indicatif::ProgressBar::new(n),
                    "{bar:30.cyan/blue} {pos}/{len} [{elapsed_precise}] {msg}",
                ),
                None => (
                    indicatif::ProgressBar::no_length(),
                    "{spinner:.cyan} point {pos} [{elapsed_precise}] {msg}",
                ),
            };
            let style = indicatif::ProgressStyle::with_template(template)
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
            bar.set_style(style);
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Progress {
            bar,
            plain: enabled && !tty,
            total,
            done: 0,
        }
    }

    /// The count of point `k` in a plain line: `k/n`, or `point k` without a known total.
    fn count(&self, k: u64) -> String {
        match self.total {
            Some(n) => format!("{k}/{}", n.max(k)),
            None => format!("point {k}"),
        }
    }

    /// A point starts.
    pub fn start(&mut self, what: &str) {
        if let Some(b) = &self.bar {
            b.set_message(format!("running {what}"));
        } else if self.plain {
            eprintln!("[{}] {what} ...", self.count(self.done + 1));
        }
    }

    /// A point ended; `line` describes its result.
    pub fn finish(&mut self, line: &str) {
        self.done += 1;
        if let Some(b) = &self.bar {
            b.println(line);
            b.inc(1);
        } else if self.plain {
            eprintln!("[{}] {line}", self.count(self.done));
        }
    }

    /// All points are done.
    pub(crate) fn close(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// One-line description of a finished child run for progress output.
pub fn describe(label: &str, run: &ChildRun) -> String {
    match run.status {
        Status::Ok => format!(
            "{label}: ok, peak {} (baseline {}), {:.1} img/s",
            run.peak_bytes()
                .map(memtrain_core::memory::format_bytes)
                .unwrap_or_default(),
            run.baseline_bytes()
                .map(memtrain_core::memory::format_bytes)
                .unwrap_or_default(),
            run.images_per_sec().unwrap_or(0.0)
        ),
        Status::Oom => format!("{label}: OOM ({})", run.note),
        Status::Failed => format!("{label}: failed ({})", run.note),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_sweeps_own_process_id_makes_a_trainer() {
        let v = |s: &str| Some(std::ffi::OsString::from(s));
        assert_eq!(role_of(None, 42), TrainerRole::None);
        assert_eq!(role_of(v("42"), 42), TrainerRole::Point);
        // Left in a shell: the old spelling, or another process's id.
        assert_eq!(role_of(v("1"), 42), TrainerRole::Stray("1".into()));
        assert_eq!(role_of(v("43"), 42), TrainerRole::Stray("43".into()));
    }

    #[test]
    fn a_search_counts_its_points_without_a_total_it_cannot_know() {
        let list = Progress::new(6, false);
        assert_eq!(list.count(2), "2/6");
        let search = Progress::open_ended(false);
        assert_eq!(search.count(5), "point 5");
    }

    #[test]
    fn the_advice_starts_at_the_first_semicolon_outside_parentheses() {
        assert_eq!(before_advice("a (b; c): d; e"), "a (b; c): d");
        assert_eq!(before_advice("a; b"), "a");
        assert_eq!(before_advice("no advice (at all)"), "no advice (at all)");
        // A stray ')' does not make the depth negative.
        assert_eq!(before_advice("a) b; c"), "a) b");
    }
}
