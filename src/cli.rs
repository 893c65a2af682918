//! Command-line flags of `train_cifar10` (and of the children that sweeps and comparisons
//! start). Each flag maps onto one [`TrainConfig`] field; [`TryFrom`] validates them.
//! Doc comments are the `--help` text; the README's flag table is checked against it by a test.

use crate::config::{
    Checkpointing, ConvKind, OptimizerKind, Precision, Tf32, TrainConfig, DEFAULT_PRUNE_BEGIN,
    DEFAULT_PRUNE_EVERY, DEFAULT_PRUNE_INITIAL, DEFAULT_TF32,
};
use crate::error::{Error, Result};
use crate::memory::parse_size;
use clap::{CommandFactory, FromArgMatches, Parser};
use std::path::PathBuf;

/// Train the CIFAR-10 CNN and measure its memory.
#[derive(Debug, Clone, Parser)]
#[command(name = "train_cifar10", version, about, long_about = None)]
pub struct TrainArgs {
    /// CIFAR-10 binary directory (data_batch_*.bin, test_batch.bin; any subset). Default: data/cifar-10-batches-bin if present, else built-in synthetic data
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Download the full CIFAR-10 through candle-datasets' hub loader (cached)
    #[arg(long)]
    pub download: bool,
    /// Fraction held out for validation when there is no test_batch.bin
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
    /// Turn off augmentation (random flip + 4-pixel reflect-pad translation)
    #[arg(long)]
    pub no_augment: bool,
    /// Synthetic training images (only without real data)
    #[arg(long, default_value_t = 5000)]
    pub synthetic_train: usize,
    /// Synthetic test images (only without real data)
    #[arg(long, default_value_t = 1000)]
    pub synthetic_test: usize,
    /// Base width w: stages have w, 2w, 4w channels
    #[arg(long, default_value_t = 32)]
    pub width: usize,
    /// Convolution kind: standard 3x3, or depthwise 3x3 + pointwise 1x1
    #[arg(long, value_enum, default_value_t = ConvKind::Standard)]
    pub conv: ConvKind,
    /// Optimizer: SGD with Nesterov momentum, or AdamW
    #[arg(long, value_enum, default_value_t = OptimizerKind::Sgd)]
    pub optimizer: OptimizerKind,
    /// Peak learning rate of the one-cycle schedule
    #[arg(long, default_value_t = 0.1, allow_negative_numbers = true)]
    pub lr: f64,
    /// Momentum (SGD) or beta1 (AdamW)
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Weight decay
    #[arg(long, default_value_t = 5e-4)]
    pub weight_decay: f64,
    /// Fraction of the steps spent warming the learning rate up
    #[arg(long, default_value_t = 0.25)]
    pub warmup_frac: f64,
    /// Scale a step's gradients down when their global L2 norm exceeds NORM (0 turns clipping off)
    #[arg(
        long,
        default_value_t = 3.0,
        value_name = "NORM",
        allow_negative_numbers = true
    )]
    pub clip_grad_norm: f64,
    /// Number of epochs
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    /// Images per optimizer step
    #[arg(long, default_value_t = 128, allow_negative_numbers = true)]
    pub batch_size: i64,
    /// Micro-batches per optimizer step (gradient accumulation); must divide --batch-size
    #[arg(long, default_value_t = 1)]
    pub accum_steps: usize,
    /// Stop after this many optimizer steps (cap; the run also ends after --epochs)
    #[arg(long, value_name = "N")]
    pub max_steps: Option<usize>,
    /// Compute precision; weights stay f32 (f16 adds a dynamic loss scaler)
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,
    /// Gradient checkpointing: keep only each stage's or each block's input and recompute in backward; auto picks the smallest predicted peak (under --memory-limit: the cheapest that fits)
    #[arg(long, value_enum, default_value_t = Checkpointing::None)]
    pub checkpoint: Checkpointing,
    /// Memory limit, e.g. 4GiB (CUDA: hard pool limit; CPU: heap budget from process start, checked for data set and model before loading and after every layer of the step)
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
    /// CUDA: return freed pool memory to the driver at every synchronize instead of keeping it
    #[arg(long)]
    pub no_pool_cache: bool,
    /// CUDA: TF32 tensor-core math for f32 convolutions, as PyTorch does by default (the head's matmul stays f32, as in PyTorch). No effect on the CPU or with --precision f16/bf16
    #[arg(long, value_enum, value_name = "MODE", default_value_t = DEFAULT_TF32)]
    pub tf32: Tf32,
    /// CUDA: after one eager step, capture each step's forward and backward as a CUDA graph and replay it (fewer kernel launches; the optimizer update stays eager); summary.json's cuda_graph gives its kernels per step and its memory. Needs a CUDA device; not with --memory-limit
    #[arg(long)]
    pub cuda_graph: bool,
    /// Seed for initialization, data order, augmentation and synthetic data
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Device: cpu, cuda or cuda:N. Default: cuda when built with it and a GPU is present, else cpu
    #[arg(long)]
    pub device: Option<String>,
    /// Run directory. Default: runs/<timestamp>
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Skip evaluation after each epoch
    #[arg(long)]
    pub no_eval: bool,
    /// Plain log lines instead of progress bars
    #[arg(long)]
    pub quiet: bool,
    /// Save a checkpoint every N optimizer steps (0: only at epoch ends)
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub save_every: usize,
    /// Keep the peak-memory watermark across epochs instead of resetting it at each epoch start
    #[arg(long)]
    pub no_reset_peak: bool,
    /// Magnitude pruning (Keras prune_low_magnitude): final fraction of each conv and head weight tensor zeroed, in [0, 1); the sparsity grows as 1 - (1 - t)^3 from --prune-begin to --prune-end. Writes model-sparse.safetensors at the end
    #[arg(long, value_name = "SPARSITY")]
    pub prune: Option<f64>,
    /// Optimizer step at which the pruning schedule starts (needs --prune)
    #[arg(long, value_name = "STEP", default_value_t = DEFAULT_PRUNE_BEGIN)]
    pub prune_begin: usize,
    /// Optimizer step at which --prune's sparsity is reached (needs --prune; at most the run's last step). Default: the run's last step
    #[arg(long, value_name = "STEP")]
    pub prune_end: Option<usize>,
    /// Recompute the pruning masks every N optimizer steps between --prune-begin and --prune-end (needs --prune)
    #[arg(long, value_name = "N", default_value_t = DEFAULT_PRUNE_EVERY)]
    pub prune_every: usize,
    /// Sparsity of the schedule at --prune-begin, at most --prune (needs --prune)
    #[arg(long, value_name = "SPARSITY", default_value_t = DEFAULT_PRUNE_INITIAL)]
    pub prune_initial: f64,
    /// Start from a config.json (as written into a run directory); flags given explicitly override it
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Continue the run in RUN_DIR from its newest complete checkpoint
    #[arg(long, value_name = "RUN_DIR")]
    pub resume: Option<PathBuf>,
    /// Print the memory estimate and the configuration, then exit without training
    #[arg(long)]
    pub dry_run: bool,
    /// Replace the results and checkpoints of an earlier run in --out (without it, such an --out is refused)
    #[arg(long)]
    pub overwrite: bool,
    // [plan] begin: the memory-budget planner (src/plan.rs).
    /// Choose micro-batch, accumulation, checkpointing and precision whose predicted peak fits SIZE (e.g. 300MiB) minus a 5% safety margin, fastest first by a measured cost model, and train with it (add --memory-limit SIZE to also enforce it); --precision, --checkpoint and --accum-steps given explicitly are kept
    #[arg(long, value_name = "SIZE")]
    pub fit_memory: Option<String>,
    /// Images per optimizer step that --fit-memory keeps (default: --batch-size)
    #[arg(long, value_name = "N")]
    pub effective_batch: Option<usize>,
    /// Let --fit-memory also change the convolution kind (standard or separable: a different model)
    #[arg(long)]
    pub allow_model_change: bool,
    // [plan] end
    /// Write summary.json only (no per-batch CSV/plots); used by sweep children
    #[arg(long, hide = true)]
    pub summary_only: bool,
    /// Flags given explicitly on the command line (filled by [`parse_train_args`]).
    #[arg(skip)]
    pub explicit: Vec<String>,
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
    /// Only write summary.json.
    pub summary_only: bool,
    // [plan] begin
    /// `--fit-memory`: the memory budget in bytes to plan for.
    pub fit_memory: Option<u64>,
    /// `--effective-batch`: images per optimizer step the plan keeps.
    pub effective_batch: Option<usize>,
    /// `--allow-model-change`: the plan may change the convolution kind.
    pub allow_model_change: bool,
    // [plan] end
}

/// Flag id → config key for the flags whose names differ from the config field.
const RENAMED: &[(&str, &str)] = &[
    ("no_augment", "augment"),
    ("no_pool_cache", "pool_cache"),
    ("no_eval", "eval"),
    ("no_reset_peak", "reset_peak_each_epoch"),
];

impl TryFrom<TrainArgs> for TrainCommand {
    type Error = Error;

    fn try_from(a: TrainArgs) -> Result<Self> {
        if a.batch_size <= 0 {
            return Err(Error::config(format!(
                "--batch-size must be a positive integer, got {}",
                a.batch_size
            )));
        }
        let memory_limit = a.memory_limit.as_deref().map(parse_size).transpose()?;
        let from_flags = TrainConfig {
            data_dir: a.data_dir.clone(),
            download: a.download,
            val_fraction: a.val_fraction,
            augment: !a.no_augment,
            synthetic_train: a.synthetic_train,
            synthetic_test: a.synthetic_test,
            width: a.width,
            conv: a.conv,
            optimizer: a.optimizer,
            lr: a.lr,
            momentum: a.momentum,
            weight_decay: a.weight_decay,
            warmup_frac: a.warmup_frac,
            clip_grad_norm: (a.clip_grad_norm != 0.0).then_some(a.clip_grad_norm),
            epochs: a.epochs,
            batch_size: usize::try_from(a.batch_size).unwrap_or(usize::MAX),
            accum_steps: a.accum_steps,
            max_steps: a.max_steps,
            precision: a.precision,
            checkpoint: a.checkpoint,
            memory_limit,
            pool_cache: !a.no_pool_cache,
            tf32: a.tf32,
            cuda_graph: a.cuda_graph,
            seed: a.seed,
            device: a.device.clone(),
            out: a.out.clone(),
            eval: !a.no_eval,
            quiet: a.quiet,
            save_every: a.save_every,
            reset_peak_each_epoch: !a.no_reset_peak,
            prune: a.prune,
            prune_begin: a.prune_begin,
            prune_end: a.prune_end,
            prune_every: a.prune_every,
            prune_initial: a.prune_initial,
        };
        // validate() sees non-default values only; a default value given explicitly is caught here.
        let prune_flag = |id: &str| id.starts_with("prune_");
        if a.prune.is_none() && a.config.is_none() {
            if let Some(id) = a.explicit.iter().find(|id| prune_flag(id)) {
                return Err(Error::config(format!(
                    "--{} only applies with --prune SPARSITY; add --prune (e.g. --prune 0.5)",
                    id.replace('_', "-")
                )));
            }
        }
        let config = match &a.config {
            None => from_flags,
            Some(path) => merge_config_file(path, &from_flags, &a.explicit)?,
        };
        config.validate()?;
        // [plan] begin
        let fit_memory = a.fit_memory.as_deref().map(parse_size).transpose()?;
        if fit_memory.is_none() && (a.effective_batch.is_some() || a.allow_model_change) {
            return Err(Error::config(
                "--effective-batch and --allow-model-change only apply with --fit-memory SIZE",
            ));
        }
        if a.effective_batch == Some(0) {
            return Err(Error::config("--effective-batch must be at least 1"));
        }
        // [plan] end
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
            summary_only: a.summary_only,
            fit_memory,
            effective_batch: a.effective_batch,
            allow_model_change: a.allow_model_change,
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
    for id in explicit {
        let key = RENAMED
            .iter()
            .find(|(f, _)| f == id)
            .map_or(id.as_str(), |(_, k)| k);
        if let Some(v) = o.get(key) {
            b.insert(key.to_string(), v.clone());
        }
    }
    serde_json::from_value(base).map_err(|e| {
        Error::config(format!(
            "--config {}: not a memtrain config ({e}); pass a config.json from a run directory",
            path.display()
        ))
    })
}

/// Parse `args` (including the program name) into [`TrainArgs`], recording which flags were
/// given explicitly. Usage errors become one-line [`Error::Config`]s; `--help`/`--version`
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
    Ok(Ok(parsed))
}

/// `--help`/`--version` → Ok(text); anything else → a one-line usage error.
pub fn clap_error(e: clap::Error) -> Result<String> {
    use clap::error::ErrorKind;
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
/// the README's flag table is this string (a test keeps them equal).
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
        } else if default.is_empty() {
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
