//! Command-line flags of `train_cifar10` (and of the children that sweeps and comparisons
//! start): the training flags are [`TrainConfig`]'s fields, flattened into [`TrainArgs`] beside
//! the flags that say what to do with the configuration; [`TryFrom`] validates them.
//! Doc comments are the `--help` text; the flag table in docs/flags.md is checked against it by a test.

use crate::config::{parse_size, TrainConfig};
use crate::error::{Error, Result};
use clap::{CommandFactory, FromArgMatches, Parser};
use std::path::PathBuf;

/// Train the CIFAR-10 CNN and measure its memory.
#[derive(Debug, Clone, Parser)]
#[command(name = "train_cifar10", version, about, long_about = None)]
pub struct TrainArgs {
    /// The training flags.
    #[command(flatten)]
    pub config: TrainConfig,
    /// Start from a config.json (as written into a run directory); flags given explicitly override it
    #[arg(long = "config", value_name = "FILE")]
    pub config_file: Option<PathBuf>,
    /// Continue the run in RUN_DIR from its newest complete snapshot
    #[arg(long, value_name = "RUN_DIR")]
    pub resume: Option<PathBuf>,
    /// Print the memory estimate and the configuration, then exit without training
    #[arg(long)]
    pub dry_run: bool,
    /// Replace the results and snapshots of an earlier run in --out (without it, such an --out is refused)
    #[arg(long)]
    pub overwrite: bool,
    /// `--fit-memory` and its companions: the memory-budget planner (src/predict/plan.rs).
    #[command(flatten)]
    pub plan: PlanArgs,
    /// Flags given explicitly on the command line, as clap ids: a training flag's id is its
    /// `config.json` key (filled by [`parse_train_args`]).
    #[arg(skip)]
    pub explicit: Vec<String>,
}

/// The planner's flags: a memory budget to fit, and what the plan must keep.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PlanArgs {
    /// Choose micro-batch, accumulation, checkpointing and precision (and with --compress-activations auto the codes, exact plans first) whose predicted peak fits SIZE (e.g. 300MiB; a number without a unit is bytes) minus the estimate's 0.25% safety margin, fastest first by a measured cost model, and train with it (add --memory-limit SIZE to also enforce it); on the CPU SIZE is the process's resident memory, as for --memory-limit; --precision, --checkpoint and --accum-steps given explicitly are kept
    #[arg(long, value_name = "SIZE", value_parser = parse_size, allow_hyphen_values = true)]
    pub fit_memory: Option<u64>,
    /// Images per optimizer step that --fit-memory keeps (default: --batch-size)
    #[arg(long, value_name = "N")]
    pub effective_batch: Option<usize>,
    /// Let --fit-memory also change the convolution kind (standard or separable: a different model)
    #[arg(long)]
    pub allow_model_change: bool,
}

impl PlanArgs {
    /// The companions only apply with `--fit-memory`, and a plan keeps at least one image.
    fn validate(&self) -> Result<()> {
        if self.fit_memory.is_none() && (self.effective_batch.is_some() || self.allow_model_change)
        {
            return Err(Error::config(
                "--effective-batch and --allow-model-change only apply with --fit-memory SIZE",
            ));
        }
        if self.effective_batch == Some(0) {
            return Err(Error::config("--effective-batch must be at least 1"));
        }
        Ok(())
    }
}

/// The environment variable that batch sweeps set to `1` for every point they start: the run
/// writes `summary.json` only, no per-batch files, snapshots or charts. An environment variable
/// rather than a flag, so that no user-facing command accepts a flag meant for a sweep's children;
/// scripts that want the same lean output (bench/compare_torch.sh) set it too.
pub const SUMMARY_ONLY_ENV: &str = "MEMTRAIN_SUMMARY_ONLY";

/// The first line a run prints when [`SUMMARY_ONLY_ENV`] is set: a switch left in a shell must
/// not silently drop what the run's flags ask for.
pub const SUMMARY_ONLY_NOTE: &str = "MEMTRAIN_SUMMARY_ONLY=1 is set: this run writes summary.json only (no batches.csv, memory.json, charts, viewer files or snapshots, --save-every included); unset it for the whole run directory";

/// Whether [`SUMMARY_ONLY_ENV`] is `1` in this process's environment.
fn summary_only_requested() -> bool {
    std::env::var_os(SUMMARY_ONLY_ENV).is_some_and(|v| v == "1")
}

/// What `train_cifar10` should do.
#[derive(Debug, Clone)]
pub struct TrainCommand {
    /// The validated configuration.
    pub config: TrainConfig,
    /// Run directory to resume from.
    pub resume: Option<PathBuf>,
    /// Only print the estimate and configuration.
    pub dry_run: bool,
    /// Replace an earlier run's results in the run directory.
    pub overwrite: bool,
    /// Only write summary.json: set for the points of batch sweeps ([`SUMMARY_ONLY_ENV`]).
    pub summary_only: bool,
    /// `--fit-memory` and its companions.
    pub plan: PlanArgs,
}

impl TryFrom<TrainArgs> for TrainCommand {
    type Error = Error;

    fn try_from(a: TrainArgs) -> Result<Self> {
        // validate() sees non-default values only; a default value given explicitly is caught here.
        let prune_flag = |id: &str| id.starts_with("prune_");
        if a.config.pruning.prune.is_none() && a.config_file.is_none() {
            if let Some(id) = a.explicit.iter().find(|id| prune_flag(id)) {
                return Err(Error::config(format!(
                    "--{} only applies with --prune SPARSITY; add --prune (e.g. --prune 0.5)",
                    id.replace('_', "-")
                )));
            }
        }
        let config = match &a.config_file {
            None => a.config,
            Some(path) => merge_config_file(path, &a.config, &a.explicit)?,
        };
        config.validate_planned(a.plan.fit_memory.is_some())?;
        a.plan.validate()?;
        if a.overwrite && a.resume.is_some() {
            return Err(Error::config(
                "--overwrite starts a new run and --resume continues one; drop one of them",
            ));
        }
        Ok(TrainCommand {
            config,
            resume: a.resume,
            dry_run: a.dry_run,
            overwrite: a.overwrite,
            summary_only: summary_only_requested(),
            plan: a.plan,
        })
    }
}

/// The config in `path`, with the fields of the explicitly given flags taken from `flags`.
fn merge_config_file(
    path: &std::path::Path,
    flags: &TrainConfig,
    explicit: &[String],
) -> Result<TrainConfig> {
    let text = crate::config::read_config_text(path)?;
    let mut base: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::config(format!("--config {}: not valid JSON ({e})", path.display())))?;
    crate::config::check_keys(path, &base)?;
    let over = serde_json::to_value(flags).map_err(|e| Error::config(e.to_string()))?;
    let (Some(b), Some(o)) = (base.as_object_mut(), over.as_object()) else {
        return Err(Error::config(format!(
            "--config {}: expected a JSON object",
            path.display()
        )));
    };
    let file_optimizer = b.get("optimizer").cloned();
    for key in explicit {
        if let Some(v) = o.get(key) {
            b.insert(key.clone(), v.clone());
        }
    }
    let optimizer_changed = b.get("optimizer").cloned() != file_optimizer;
    let mut config: TrainConfig = serde_json::from_value(base).map_err(|e| {
        Error::config(format!(
            "--config {}: not a memtrain config ({e}); pass a config.json from a run directory",
            path.display()
        ))
    })?;
    // The file's learning rate and weight decay were chosen for its optimizer: another one
    // given as a flag brings its own defaults, unless --lr / --weight-decay are given too.
    if optimizer_changed {
        config.apply_optimizer_defaults(explicit);
    }
    Ok(config)
}

/// Parse `args` (including the program name) into [`TrainArgs`], recording which flags were
/// given explicitly. Usage errors become one-line [`CoreError::Config`](crate::error::CoreError::Config)s; `--help`/`--version`
/// come back as `Ok(Err(text))` to be printed with exit code 0.
pub fn parse_train_args<I, T>(args: I) -> Result<std::result::Result<TrainArgs, String>>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches = match TrainArgs::command().try_get_matches_from(args) {
        Ok(m) => m,
        Err(e) => return clap_error(e).map(Err),
    };
    let mut parsed = TrainArgs::from_arg_matches(&matches)
        .map_err(|e| Error::config(one_line(&e.to_string())))?;
    parsed.explicit = matches
        .ids()
        .filter(|id| {
            matches.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine)
        })
        .map(|id| id.as_str().to_string())
        .collect();
    // --lr and --weight-decay left out: the chosen optimizer's defaults.
    parsed.config.apply_optimizer_defaults(&parsed.explicit);
    Ok(Ok(parsed))
}

/// The training configuration that trainer `flags` select, parsed exactly as `train_cifar10`
/// parses them but not yet validated as a whole (a sweep adds each point's batch size later).
/// A flag the trainer would refuse is the same one-line usage error here.
pub fn flags_config(flags: &[String]) -> Result<TrainConfig> {
    let args = std::iter::once("train_cifar10").chain(flags.iter().map(String::as_str));
    match parse_train_args(args)? {
        Ok(parsed) => Ok(parsed.config),
        Err(_help) => Err(Error::config(
            "--help is not a training flag; pass the flags a point trains with",
        )),
    }
}

/// `--help`/`--version` → Ok(text); anything else → a one-line usage error. A value parser's
/// own [`Error`] (`--batch-size 0`, `--memory-limit 12XB`) is passed on as it is: it already
/// names the flag and the fix.
pub fn clap_error(e: clap::Error) -> Result<String> {
    use clap::error::ErrorKind;
    if let Some(own) = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<Error>()) {
        return Err(Error::config(own.to_string()));
    }
    match e.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => Ok(e.render().to_string()),
        _ => Err(Error::config(format!(
            "{} (see --help)",
            one_line(&e.render().to_string())
        ))),
    }
}

/// Fold clap's multi-line message into one line, dropping the usage and "for more information" lines.
fn one_line(msg: &str) -> String {
    msg.lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more information")
        })
        .map(|l| l.trim_start_matches("error: ").to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

/// The markdown table of every visible flag of [`TrainArgs`] with its default and help text:
/// the flag table in docs/flags.md is this string (a test keeps them equal).
pub fn flag_table() -> String {
    let mut cmd = TrainArgs::command();
    // Building resolves each argument's action and value count.
    cmd.build();
    let mut s = String::from("| flag | default | what it does |\n|---|---|---|\n");
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if arg.is_hide_set() || long == "help" || long == "version" {
            continue;
        }
        let takes_value = arg.get_num_args().is_some_and(|n| n.takes_values());
        let flag = match (takes_value, arg.get_value_names()) {
            (true, Some(names)) => format!(
                "`--{long} {}`",
                names
                    .iter()
                    .map(|n| n.as_str())
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
            (true, None) => format!("`--{long} {}`", arg.get_id().as_str().to_ascii_uppercase()),
            (false, _) => format!("`--{long}`"),
        };
        let default = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(",");
        let default = if !takes_value {
            "off".to_string()
        } else if default.is_empty() || arg.is_hide_default_value_set() {
            "—".to_string()
        } else {
            format!("`{default}`")
        };
        let mut help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let values: Vec<String> = arg
            .get_possible_values()
            .iter()
            .map(|v| v.get_name().to_string())
            .collect();
        if takes_value && !values.is_empty() {
            help.push_str(&format!(" (`{}`)", values.join("`, `")));
        }
        s.push_str(&format!(
            "| {flag} | {default} | {} |\n",
            help.replace('|', "\\|")
        ));
    }
    s
}
