//! The validated training configuration: one struct that drives the one training loop.
//!
//! The training flags are the fields of [`TrainConfig`], with their defaults and help text;
//! [`TrainConfig::validate`] checks them, so a configuration from the command line or a
//! `config.json` is one the trainer can run.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

pub use memtrain_core::model::ModelConfig;
pub use memtrain_core::options::*;

/// Batches the trainer prepares ahead on the CPU by default (`--prefetch`): the fewest whose img/s
/// is within 2% of the best (`bench/prefetch.sh`, docs/speed.md). Building a batch of 128 takes
/// about 1% of a CPU step, so a worker thread, which competes with the step's threads for the
/// same cores, gains nothing measurable there.
pub const DEFAULT_PREFETCH_CPU: usize = 0;
/// The default on CUDA, where a step is several times faster than building its batch on the
/// host would let it be without overlap. Not measured on a GPU yet: it is the earlier fixed
/// value (two in the channel, one waiting).
pub const DEFAULT_PREFETCH_CUDA: usize = 3;

/// The most batches `--prefetch` may prepare ahead: the channel's slots are allocated up front,
/// and past a few batches the worker is only ahead, not faster.
pub const MAX_PREFETCH: usize = 64;

/// `--checkpoint`: a name or `segments:…`; the message reaches the user as it is.
fn parse_checkpoint(s: &str) -> Result<GradCheckpointing> {
    Ok(s.parse()?)
}

/// `HELP. Default: the optimizer's (sgd X, adamw Y)`: the help of a flag whose default
/// depends on `--optimizer`.
fn per_optimizer_help(help: &str, default: fn(OptimizerKind) -> f64) -> String {
    let each: Vec<String> = OptimizerKind::ALL
        .iter()
        .map(|&k| format!("{k} {}", default(k)))
        .collect();
    format!("{help}. Default: the optimizer's ({})", each.join(", "))
}

impl TrainConfig {
    /// Set `lr` and `weight_decay` to the optimizer's defaults, except those whose clap id
    /// (`lr`, `weight_decay`) is in `explicit`.
    pub fn apply_optimizer_defaults(&mut self, explicit: &[String]) {
        let given = |id: &str| explicit.iter().any(|e| e == id);
        if !given("lr") {
            self.optimizer.lr = self.optimizer.kind.default_lr();
        }
        if !given("weight_decay") {
            self.optimizer.weight_decay = self.optimizer.kind.default_weight_decay();
        }
    }
}

/// Everything a training run needs, validated. Saved as `config.json` in the run directory.
///
/// The struct is also the training flags of `train_cifar10` (flattened into
/// [`crate::cli::TrainArgs`]): each flag's doc comment is its `--help` text and its `#[arg]` its
/// flag and default, so [`TrainConfig::default`] is an empty command line and no default is
/// written anywhere else. The clap id of every flag is its `config.json` key. The flags are
/// grouped by concern in flattened structs ([`DataConfig`], [`ModelConfig`], …); `config.json`
/// is one flat object all the same, and the order of the fields is that of the flags in `--help`
/// and of the keys in `config.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
// The group clap would add for the flattened struct is never used, and would show up among the
// ids of the flags given (`cli::parse_train_args`).
#[group(skip)]
#[serde(default)]
pub struct TrainConfig {
    /// The images.
    #[command(flatten)]
    #[serde(flatten)]
    pub data: DataConfig,
    /// The network.
    #[command(flatten)]
    #[serde(flatten)]
    pub model: ModelConfig,
    /// The optimizer and its update.
    #[command(flatten)]
    #[serde(flatten)]
    pub optimizer: OptimizerConfig,
    /// The batch size and the run's length.
    #[command(flatten)]
    #[serde(flatten)]
    pub steps: StepsConfig,
    /// The memory optimizations and the memory limit.
    #[command(flatten)]
    #[serde(flatten)]
    pub memory: MemoryConfig,
    /// The CUDA-only settings.
    #[command(flatten)]
    #[serde(flatten)]
    pub cuda: CudaConfig,
    // In no group: in --help these three come between the CUDA flags and the output flags.
    /// Batches prepared ahead of the one being trained, on a background thread (tf.data's prefetch); 0 prepares each batch on the training thread when it is needed. Each costs a batch of f32 images (1.5 MiB at batch 128), counted in the estimate's batches in flight. Default: 0 on the CPU (measured: no slower), 3 on CUDA
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub prefetch: Option<usize>,
    /// Seed for initialization, data order, augmentation and synthetic data
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub seed: u64,
    /// Device: cpu, cuda or cuda:N. Default: cuda when built with it and a GPU is present, else cpu
    #[arg(long)]
    pub device: Option<String>,
    /// What the run writes and reports.
    #[command(flatten)]
    #[serde(flatten)]
    pub output: OutputConfig,
    /// Magnitude pruning.
    #[command(flatten)]
    #[serde(flatten)]
    pub pruning: PruningConfig,
}

/// The training and evaluation images: where they come from, the validation split and
/// augmentation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[group(skip)]
#[serde(default)]
pub struct DataConfig {
    /// CIFAR-10 binary directory (data_batch_*.bin, test_batch.bin; any subset). Default: data/cifar-10-batches-bin if present, else built-in synthetic data
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Download the full CIFAR-10 through candle-datasets' hub loader (cached)
    #[arg(long)]
    pub download: bool,
    /// Fraction held out for validation when there is no test_batch.bin
    #[arg(long, default_value_t = 0.1, allow_negative_numbers = true)]
    pub val_fraction: f64,
    /// Random flip + 4-pixel reflect-pad translation of training images.
    #[arg(
        long = "no-augment",
        action = clap::ArgAction::SetFalse,
        help = "Turn off augmentation (random flip + 4-pixel reflect-pad translation)"
    )]
    pub augment: bool,
    /// Synthetic training images (only without real data)
    #[arg(long, default_value_t = 5000, allow_negative_numbers = true)]
    pub synthetic_train: usize,
    /// Synthetic test images (only without real data)
    #[arg(long, default_value_t = 1000, allow_negative_numbers = true)]
    pub synthetic_test: usize,
}

/// The optimizer and its update: learning-rate schedule, momentum, weight decay and gradient
/// clipping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[group(skip)]
#[serde(default)]
pub struct OptimizerConfig {
    /// Optimizer: SGD with Nesterov momentum, or AdamW
    // Flag, clap id and config.json key: `optimizer`; the field is `kind`, in the group `optimizer`.
    #[arg(
        long = "optimizer",
        id = "optimizer",
        value_name = "OPTIMIZER",
        value_enum,
        default_value_t = OptimizerKind::Sgd
    )]
    #[serde(rename = "optimizer")]
    pub kind: OptimizerKind,
    /// Peak learning rate of the one-cycle schedule; without `--lr`, the optimizer's
    /// [`OptimizerKind::default_lr`] (set by [`crate::cli::parse_train_args`]).
    // The `help` attribute, not this comment, is the --help text. clap's default is SGD's, the
    // optimizer of an empty command line, and is hidden: it is not the default of every run.
    #[arg(
        long,
        value_name = "LR",
        help = per_optimizer_help("Peak learning rate of the one-cycle schedule", OptimizerKind::default_lr),
        default_value_t = OptimizerKind::Sgd.default_lr(),
        hide_default_value = true,
        allow_negative_numbers = true
    )]
    pub lr: f64,
    /// Momentum (SGD) or beta1 (AdamW)
    #[arg(long, default_value_t = 0.9, allow_negative_numbers = true)]
    pub momentum: f64,
    /// Weight decay; without `--weight-decay`, the optimizer's
    /// [`OptimizerKind::default_weight_decay`] (as `lr`).
    #[arg(
        long,
        value_name = "WEIGHT_DECAY",
        help = per_optimizer_help("Weight decay (SGD: added to the gradient; AdamW: decoupled, scaled by the learning rate)", OptimizerKind::default_weight_decay),
        default_value_t = OptimizerKind::Sgd.default_weight_decay(),
        hide_default_value = true,
        allow_negative_numbers = true
    )]
    pub weight_decay: f64,
    /// Fraction of the steps spent warming the learning rate up (from a 25th of the peak; the rise takes at least 25 steps' worth, so a run of fewer than 25/WARMUP_FRAC steps peaks lower)
    #[arg(long, default_value_t = 0.25, allow_negative_numbers = true)]
    pub warmup_frac: f64,
    /// Scale a step's gradients down when their global L2 norm exceeds NORM (0 turns clipping off)
    // `None` turns clipping off. The default is measured (docs/results/first-run.md): without
    // clipping the first epoch's loss climbs to ~25 at gradient norms of 10-25 and the network dies
    // at chance; with the peak learning rate of 0.2, 1.5 learns in one epoch (36.6%) and gives the
    // best 20-epoch accuracy measured (1 throttles the run, unclipped epochs after the first blow up).
    // The path spelling keeps clap from treating the field as an optional flag: the flag always
    // has a value, which `parse_clip_norm` maps to `None` for 0.
    #[arg(
        long,
        default_value = "1.5",
        value_name = "NORM",
        value_parser = parse_clip_norm,
        allow_negative_numbers = true
    )]
    #[serde(deserialize_with = "clip_norm_from_json")]
    pub clip_grad_norm: ::std::option::Option<f64>,
    /// When --clip-grad-norm applies: every step, or only in the first epoch (where a short run's learning rate peaks and an unclipped first epoch can blow up)
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = ClipDuring::All)]
    pub clip_during: ClipDuring,
}

/// How many images make an optimizer step, in how many micro-batches, and how many steps the run
/// takes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[group(skip)]
#[serde(default)]
pub struct StepsConfig {
    /// Number of epochs
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub epochs: usize,
    /// Images per optimizer step
    #[arg(
        long,
        default_value_t = 128,
        value_parser = parse_batch_size,
        allow_negative_numbers = true
    )]
    pub batch_size: usize,
    /// Micro-batches per optimizer step (gradient accumulation); must divide --batch-size. BatchNorm normalizes each micro-batch on its own, so the step is not one big batch's
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub accum_steps: usize,
    /// Stop after this many optimizer steps (cap; the run also ends after --epochs). The one-cycle
    /// learning-rate schedule spans the steps the run takes, so a short run warms up and anneals too
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub max_steps: Option<usize>,
}

/// The memory optimizations (precision, gradient checkpointing, compressed activations) and the
/// memory limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[group(skip)]
#[serde(default)]
pub struct MemoryConfig {
    /// Compute precision; weights stay f32 (f16 adds a dynamic loss scaler)
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,
    /// Gradient checkpointing: none, stages, blocks, segments:B1,B2,… (segment boundaries after those blocks, 1 to 5; every segment but the last keeps only its input and is recomputed in backward) or auto (the smallest predicted peak of none/stages/blocks; under --memory-limit the least recomputation of all 32 segmentations that fits with the estimate's error margin)
    // Flag, clap id and config.json key keep the short spelling users know: `checkpoint`.
    #[arg(
        long = "checkpoint",
        id = "checkpoint",
        value_name = "CHECKPOINT",
        value_parser = parse_checkpoint,
        default_value_t = GradCheckpointing::None
    )]
    #[serde(rename = "checkpoint")]
    pub grad_checkpointing: GradCheckpointing,
    /// Store each block's saved conv output as codes, decoded in the backward (lossy: gradients differ from the exact step's): int8 one byte per element with a scale and offset per channel, rounded to nearest; int4 and int2 half or a quarter of a byte with a scale and offset per group of 256 values of a plane, rounded stochastically (unbiased, seeded by the block and its values, so a run repeats); every width keeps the ReLU mask and the pool's argmax exactly, one more bit per element. Segment inputs and the images stay exact. auto chooses the codes for a budget: with --memory-limit together with the segmentation, with --fit-memory together with the planner's other settings; exact when any exact plan fits, else the most bits that fit
    #[arg(long, value_enum, value_name = "HOW", default_value_t = CompressActivations::None)]
    pub compress_activations: CompressActivations,
    /// Memory limit, e.g. 4GiB or 512MiB (a number without a unit is bytes; CUDA: hard pool limit; CPU: the process's resident memory as the kernel counts it: the heap gets what the binary, thread stacks and allocator leave, a step predicted not to fit is refused before any work, and heap and resident memory are checked after every layer)
    // In bytes.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, allow_hyphen_values = true)]
    pub memory_limit: Option<u64>,
}

/// Settings that only a CUDA device uses: the pool's cache, TF32, cuDNN's algorithms and CUDA
/// graphs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[group(skip)]
#[serde(default)]
pub struct CudaConfig {
    /// Keep freed CUDA pool memory between steps (release threshold = max).
    #[arg(
        long = "no-pool-cache",
        action = clap::ArgAction::SetFalse,
        help = "CUDA: return freed pool memory to the driver at every synchronize instead of keeping it"
    )]
    pub pool_cache: bool,
    /// CUDA: TF32 tensor-core math for f32 convolutions, as PyTorch does by default (the head's matmul stays f32, as in PyTorch). No effect on the CPU or with --precision f16/bf16
    #[arg(long, value_enum, value_name = "MODE", default_value_t = DEFAULT_TF32)]
    pub tf32: Tf32,
    /// CUDA with cuDNN: let the backward convolutions run cuDNN's fastest algorithms even where they sum with atomic adds, so that two runs (or a captured step and an eager one) can differ in the last bits. Default: deterministic algorithms only, as PyTorch's torch.backends.cudnn.deterministic. No effect on the CPU or without the cudnn feature
    #[arg(long)]
    pub cudnn_nondeterministic: bool,
    /// CUDA with cuDNN: the one workspace the convolution passes share (allocated by the first, kept, counted in the estimate); a pass whose algorithms all need more runs on the im2col op. No effect on the CPU or without the cudnn feature
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "32MiB")]
    pub cudnn_workspace: u64,
    /// CUDA: after one eager step, capture each step's forward and backward as a CUDA graph and replay it (fewer kernel launches; the optimizer update stays eager); summary.json's cuda_graph gives its kernels per step and its memory. Needs a CUDA device; not with --memory-limit
    #[arg(long)]
    pub cuda_graph: bool,
}

/// What the run writes and reports: its directory, evaluation, log lines, snapshots and the
/// peak-memory watermark.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[group(skip)]
#[serde(default)]
pub struct OutputConfig {
    /// Run directory. Default: runs/TIMESTAMP-PID
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Evaluate on the validation/test split after each epoch.
    #[arg(
        long = "no-eval",
        action = clap::ArgAction::SetFalse,
        help = "Skip evaluation after each epoch"
    )]
    pub eval: bool,
    /// Plain log lines instead of progress bars
    #[arg(long)]
    pub quiet: bool,
    /// Save a training snapshot (what --resume continues from) every N optimizer steps (0: only at epoch ends and when the run stops)
    #[arg(
        long,
        default_value_t = 0,
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub save_every: usize,
    /// Optimizer step (from 1, as in batches.csv) whose every allocation and free memory_snapshot.pickle records, for PyTorch's memory_viz (CPU runs). Default: the run's last step
    #[arg(long, value_name = "N")]
    pub memory_snapshot_step: Option<usize>,
    /// Reset the peak-memory watermark at the start of every epoch.
    #[arg(
        long = "no-reset-peak",
        action = clap::ArgAction::SetFalse,
        help = "Keep the peak-memory watermark across epochs instead of resetting it at each epoch start"
    )]
    pub reset_peak_each_epoch: bool,
}

/// Magnitude pruning: the final sparsity and its schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[group(skip)]
#[serde(default)]
pub struct PruningConfig {
    /// Magnitude pruning (Keras prune_low_magnitude): final fraction of each conv and head weight tensor zeroed, in (0, 1); the sparsity grows as 1 - (1 - t)^3 from --prune-begin to --prune-end. Writes model.safetensors (dense) and model-sparse.safetensors at the end
    #[arg(long, value_name = "SPARSITY", allow_negative_numbers = true)]
    pub prune: Option<f64>,
    /// Optimizer step at which the pruning schedule starts (needs --prune)
    #[arg(long, value_name = "STEP", default_value_t = DEFAULT_PRUNE_BEGIN, allow_negative_numbers = true)]
    pub prune_begin: usize,
    /// Optimizer step at which --prune's sparsity is reached (needs --prune; at most the run's last step). Default: three quarters of the way from --prune-begin to the run's last step, so the rest fine-tunes the final masks
    #[arg(long, value_name = "STEP", allow_negative_numbers = true)]
    pub prune_end: Option<usize>,
    /// Recompute the pruning masks every N optimizer steps between --prune-begin and --prune-end (needs --prune)
    #[arg(long, value_name = "N", default_value_t = DEFAULT_PRUNE_EVERY, allow_negative_numbers = true)]
    pub prune_every: usize,
    /// Sparsity of the schedule at --prune-begin, at most --prune (needs --prune)
    #[arg(long, value_name = "SPARSITY", default_value_t = DEFAULT_PRUNE_INITIAL, allow_negative_numbers = true)]
    pub prune_initial: f64,
}

impl Default for TrainConfig {
    /// The flags' defaults: the configuration of a command line without flags.
    fn default() -> Self {
        static DEFAULT: std::sync::OnceLock<TrainConfig> = std::sync::OnceLock::new();
        DEFAULT
            .get_or_init(|| {
                use clap::{Args, FromArgMatches};
                let cmd = TrainConfig::augment_args(clap::Command::new("defaults"));
                // Every flag is optional or has a default, so an empty command line parses
                // (tests/flags.rs checks this default against --help, README and config.json).
                let matches = cmd
                    .try_get_matches_from(["defaults"])
                    .expect("every training flag has a default");
                TrainConfig::from_arg_matches(&matches).expect("the defaults parse")
            })
            .clone()
    }
}

/// Each group's default is its part of [`TrainConfig::default`] (what `#[serde(default)]` fills
/// in for the keys a `config.json` lacks).
macro_rules! group_defaults {
    ($($field:ident: $group:ty),* $(,)?) => {
        $(impl Default for $group {
            fn default() -> Self {
                TrainConfig::default().$field
            }
        })*
    };
}

group_defaults!(
    data: DataConfig,
    optimizer: OptimizerConfig,
    steps: StepsConfig,
    memory: MemoryConfig,
    cuda: CudaConfig,
    output: OutputConfig,
    pruning: PruningConfig,
);

/// `--batch-size`: read as a signed number so that `-8` gets the same message as `0`; the
/// message reaches the user as it is (`cli::clap_error`).
fn parse_batch_size(
    s: &str,
) -> std::result::Result<usize, Box<dyn std::error::Error + Send + Sync>> {
    let n: i64 = s.parse()?;
    match usize::try_from(n) {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(Box::new(Error::config(format!(
            "--batch-size must be a positive integer, got {n}"
        )))),
    }
}

/// `--clip-grad-norm`: 0 turns clipping off; other values are checked by
/// [`TrainConfig::validate`], which also sees those of a config file.
fn parse_clip_norm(s: &str) -> std::result::Result<Option<f64>, std::num::ParseFloatError> {
    let norm: f64 = s.parse()?;
    Ok((norm != 0.0).then_some(norm))
}

/// `clip_grad_norm` in a config file: `null` or 0 turn clipping off, as `--clip-grad-norm 0` does.
fn clip_norm_from_json<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<f64>, D::Error> {
    let norm: Option<f64> = serde::Deserialize::deserialize(d)?;
    Ok(norm.filter(|&n| n != 0.0))
}

/// The largest memory size [`parse_size`] takes, 10^18 bytes: far above any machine, far below
/// `u64::MAX`, so sums of sizes cannot overflow.
const MAX_SIZE_BYTES: f64 = 1e18;

/// Parse a memory size such as `4GiB`, `512MiB`, `1.5GB`, `300kB` or a plain byte count.
/// Binary (KiB/MiB/GiB/TiB) and decimal (kB/MB/GB/TB) units; `K`/`M`/`G` alone mean binary.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || {
        Error::config(format!(
            "memory size '{s}' is not a size; write a number with an optional unit, e.g. 512MiB, 4GiB, 2GB"
        ))
    };
    if t.starts_with("--") {
        return Err(Error::config(format!(
            "'{s}' is a flag where a memory size should be; give a size first, e.g. 512MiB"
        )));
    }
    if let Some(rest) = t.strip_prefix('-') {
        if rest.starts_with(|c: char| c.is_ascii_digit() || c == '.') {
            return Err(Error::config(format!(
                "memory size '{s}' is negative; give a positive size, e.g. 512MiB"
            )));
        }
    }
    let value: f64 = num.parse().map_err(|_| bad())?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(bad()),
    };
    let bytes = value * mult;
    if !bytes.is_finite() || bytes > MAX_SIZE_BYTES {
        return Err(Error::config(format!(
            "memory size '{s}' is too large: at most {} bytes (about 888 PiB), more than any machine holds",
            MAX_SIZE_BYTES as u64
        )));
    }
    if bytes < 1.0 {
        return Err(Error::config(format!(
            "memory size '{s}' is less than one byte; give a positive size, e.g. 512MiB"
        )));
    }
    Ok(bytes.round() as u64)
}

/// `--prune-begin`: the pruning schedule starts with the run (Keras' `begin_step` default).
pub(crate) const DEFAULT_PRUNE_BEGIN: usize = 0;
/// `--prune-every`: masks are recomputed every 100 optimizer steps (Keras' `frequency` default).
pub const DEFAULT_PRUNE_EVERY: usize = 100;
/// `--prune-initial`: the schedule starts from a dense model (Keras' `initial_sparsity` default).
pub(crate) const DEFAULT_PRUNE_INITIAL: f64 = 0.0;

pub(crate) use crate::io::read_config_text;

/// Refuse keys of a config object that `TrainConfig` does not have (a typo such as
/// `batchsize` would otherwise be ignored), naming the nearest valid key.
pub(crate) fn check_keys(path: &std::path::Path, value: &serde_json::Value) -> Result<()> {
    let Some(obj) = value.as_object() else {
        return Ok(());
    };
    let known = serde_json::to_value(TrainConfig::default()).unwrap_or_default();
    let known: Vec<&String> = known
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default();
    for key in obj.keys() {
        if known.contains(&key) {
            continue;
        }
        let nearest = known
            .iter()
            .min_by_key(|k| strsim::levenshtein(k, key))
            .map(|k| format!("; did you mean \"{k}\"?"))
            .unwrap_or_default();
        return Err(Error::config(format!(
            "--config {}: unknown key \"{key}\"{nearest}",
            path.display()
        )));
    }
    Ok(())
}

/// Fewest images `--synthetic-train` and `--synthetic-test` accept (one per class).
pub(crate) const MIN_SYNTHETIC_IMAGES: usize = 10;

/// The usage error of `--download` in a build without the `download` cargo feature (which brings
/// candle-datasets' Hugging Face hub loader and its HTTP, parquet and image stack).
pub const DOWNLOAD_NOT_BUILT: &str = "--download needs a build with the `download` cargo feature (the Hugging Face \
     hub loader), which this binary lacks; run `cargo run --release --features download --example train_cifar10 -- \
     --download`, or pass --data-dir DIR";

/// Largest batch the trainer accepts; beyond this a typo is more likely than intent.
pub(crate) const MAX_BATCH_SIZE: usize = 1 << 20;

impl TrainConfig {
    /// Images per micro-batch (`batch_size / accum_steps`).
    pub fn micro_batch(&self) -> usize {
        self.steps.batch_size / self.steps.accum_steps.max(1)
    }

    /// Check every field; the message names the flag and the fix.
    pub fn validate(&self) -> Result<()> {
        self.validate_planned(false)
    }

    /// [`TrainConfig::validate`], where `fit_memory` says that `--fit-memory` plans the run (it
    /// then gives `--compress-activations auto` its budget).
    pub fn validate_planned(&self, fit_memory: bool) -> Result<()> {
        let bad = |m: String| Err(Error::config(m));
        if self.steps.batch_size == 0 {
            return bad("--batch-size must be at least 1".into());
        }
        if self.steps.batch_size > MAX_BATCH_SIZE {
            return bad(format!(
                "--batch-size {} is absurdly large (max {MAX_BATCH_SIZE}); use a smaller batch with --accum-steps",
                self.steps.batch_size
            ));
        }
        if self.memory.compress_activations == CompressActivations::Auto
            && self.memory.memory_limit.is_none()
            && !fit_memory
        {
            return bad(
                "--compress-activations auto chooses the codes for a budget: give --memory-limit or --fit-memory, or name the codes (none, int8, int4, int2)".into(),
            );
        }
        if self.steps.accum_steps == 0 {
            return bad("--accum-steps must be at least 1".into());
        }
        if !self.steps.batch_size.is_multiple_of(self.steps.accum_steps) {
            return bad(format!(
                "--batch-size {} is not divisible by --accum-steps {}; pick a batch size that is a multiple of it (e.g. {})",
                self.steps.batch_size,
                self.steps.accum_steps,
                self.steps.accum_steps * (self.steps.batch_size / self.steps.accum_steps).max(1)
            ));
        }
        self.validate_prefetch()?;
        if self.model.width == 0 {
            return bad(format!(
                "--width must be at least 1 (default {})",
                TrainConfig::default().model.width
            ));
        }
        if self.model.width > 4096 {
            return bad(format!(
                "--width {} is too large (max 4096)",
                self.model.width
            ));
        }
        if !self.optimizer.lr.is_finite() || self.optimizer.lr <= 0.0 {
            return bad(format!(
                "--lr must be a positive finite number, got {}",
                self.optimizer.lr
            ));
        }
        if !self.optimizer.momentum.is_finite() || !(0.0..1.0).contains(&self.optimizer.momentum) {
            return bad(format!(
                "--momentum must be in [0, 1), got {}",
                self.optimizer.momentum
            ));
        }
        if !self.optimizer.weight_decay.is_finite() || self.optimizer.weight_decay < 0.0 {
            return bad(format!(
                "--weight-decay must be >= 0, got {}",
                self.optimizer.weight_decay
            ));
        }
        if !self.optimizer.warmup_frac.is_finite()
            || !(0.0..1.0).contains(&self.optimizer.warmup_frac)
        {
            return bad(format!(
                "--warmup-frac must be in [0, 1), got {}",
                self.optimizer.warmup_frac
            ));
        }
        if let Some(c) = self.optimizer.clip_grad_norm {
            if !c.is_finite() || c <= 0.0 {
                return bad(format!(
                    "--clip-grad-norm must be a positive finite norm (or 0 to turn clipping off), got {c}"
                ));
            }
        }
        if !(self.data.val_fraction.is_finite()
            && self.data.val_fraction > 0.0
            && self.data.val_fraction < 1.0)
        {
            return bad(format!(
                "--val-fraction must be in (0, 1), got {}",
                self.data.val_fraction
            ));
        }
        if self.data.download && !cfg!(feature = "download") {
            return bad(DOWNLOAD_NOT_BUILT.into());
        }
        if self.steps.epochs == 0 {
            // `--max-steps` only caps the steps of the epochs: with none there is nothing to run.
            return bad(
                "--epochs must be at least 1 (--max-steps N then stops the run early after N steps)"
                    .into(),
            );
        }
        if self.steps.max_steps == Some(0) {
            return bad("--max-steps must be at least 1".into());
        }
        if self.data.synthetic_train < MIN_SYNTHETIC_IMAGES
            || self.data.synthetic_test < MIN_SYNTHETIC_IMAGES
        {
            return bad(format!(
                "--synthetic-train and --synthetic-test must be at least {MIN_SYNTHETIC_IMAGES}"
            ));
        }
        if let Some(limit) = self.memory.memory_limit {
            if limit == 0 {
                return bad("--memory-limit must be larger than 0".into());
            }
        }
        if let Some(dev) = &self.device {
            memtrain_core::device::parse_device_spec(dev)?;
        }
        self.validate_cuda_graph()?;
        self.validate_pruning()
    }

    /// `--cuda-graph`: only on a CUDA device, and not under `--memory-limit`. Whether an automatic
    /// device turned out to be a GPU is checked when the trainer opens it.
    fn validate_prefetch(&self) -> Result<()> {
        if let Some(n) = self.prefetch.filter(|&n| n > MAX_PREFETCH) {
            return Err(Error::config(format!(
                "--prefetch {n} is more batches ahead than ever helps (max {MAX_PREFETCH}; default {} on the CPU, {} on CUDA)",
                DEFAULT_PREFETCH_CPU,
                DEFAULT_PREFETCH_CUDA
            )));
        }
        Ok(())
    }

    fn validate_cuda_graph(&self) -> Result<()> {
        if !self.cuda.cuda_graph {
            return Ok(());
        }
        if let Some(dev) = &self.device {
            if memtrain_core::device::parse_device_spec(dev)?
                == memtrain_core::device::DeviceSpec::Cpu
            {
                return Err(Error::config(
                    "--cuda-graph captures the step on a GPU and cannot run with --device cpu; drop --cuda-graph or use --device cuda",
                ));
            }
        }
        if self.memory.memory_limit.is_some() {
            // Allocations made while a stream is captured come from CUDA's graph memory, not
            // from the pool whose maximum size is the limit: the limit would not hold.
            return Err(Error::config(
                "--cuda-graph cannot be combined with --memory-limit: a captured step allocates from CUDA's graph memory, which the limit's pool does not bound; drop one of them",
            ));
        }
        if self
            .memory
            .compress_activations
            .fixed()
            .is_some_and(|s| s.is_lossy())
        {
            // The forward's decisions (and int4's and int2's codes) are made on the host from
            // values read back, which a captured stream cannot do; a replayed graph would also
            // repeat one step's rounding noise.
            return Err(Error::config(format!(
                "--cuda-graph cannot be combined with --compress-activations {}: the codes keep the forward's ReLU mask and pool argmax, which are made on the host from values read back every step, which a captured step cannot do; drop one of them",
                self.memory.compress_activations
            )));
        }
        if !cfg!(feature = "cuda") {
            return Err(Error::config(
                "--cuda-graph needs a CUDA device, and this binary was built without CUDA; rebuild with --features cuda (see docs/cuda.md) or drop --cuda-graph",
            ));
        }
        Ok(())
    }

    /// The `--prune*` flags; the checks that need the run's length (the default end step) are
    /// made when the trainer knows it (`train::prune::Schedule::for_run`).
    fn validate_pruning(&self) -> Result<()> {
        let bad = |m: String| Err(Error::config(m));
        let Some(target) = self.pruning.prune else {
            if self.pruning.prune_begin != DEFAULT_PRUNE_BEGIN
                || self.pruning.prune_end.is_some()
                || self.pruning.prune_every != DEFAULT_PRUNE_EVERY
                || self.pruning.prune_initial != DEFAULT_PRUNE_INITIAL
            {
                return bad("--prune-begin, --prune-end, --prune-every and --prune-initial only apply with --prune SPARSITY; add --prune (e.g. --prune 0.5)".into());
            }
            return Ok(());
        };
        if !target.is_finite() || !(0.0..1.0).contains(&target) {
            return bad(format!(
                "--prune must be a sparsity in (0, 1) (0.5 zeroes half of each layer's weights), got {target}"
            ));
        }
        if target == 0.0 {
            // A "sparse" model of nothing pruned is larger than the dense one (its index data).
            return bad(
                "--prune 0 prunes nothing; leave --prune out, or give a sparsity such as 0.5"
                    .into(),
            );
        }
        if !self.pruning.prune_initial.is_finite()
            || !(0.0..=target).contains(&self.pruning.prune_initial)
        {
            return bad(format!(
                "--prune-initial must be in [0, --prune {target}] (sparsity only grows), got {}",
                self.pruning.prune_initial
            ));
        }
        if self.pruning.prune_every == 0 {
            return bad(format!(
                "--prune-every must be at least 1 (default {DEFAULT_PRUNE_EVERY})"
            ));
        }
        if let Some(end) = self.pruning.prune_end {
            if end <= self.pruning.prune_begin {
                return bad(format!(
                    "--prune-end {end} must be after --prune-begin {}; raise --prune-end or lower --prune-begin",
                    self.pruning.prune_begin
                ));
            }
        }
        Ok(())
    }

    /// Read a `config.json` (as written into a run directory) and validate it.
    pub fn from_json_file(path: &std::path::Path) -> Result<Self> {
        let text = read_config_text(path)?;
        check_keys(path, &serde_json::from_str(&text).unwrap_or_default())?;
        let cfg: TrainConfig = serde_json::from_str(&text).map_err(|e| {
            Error::config(format!(
                "{}: not a memtrain config.json ({e})",
                path.display()
            ))
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// `--prefetch`, or its default for the device (`cuda`: a CUDA device, else the CPU).
    pub fn prefetch_batches(&self, cuda: bool) -> usize {
        self.prefetch.unwrap_or(if cuda {
            DEFAULT_PREFETCH_CUDA
        } else {
            DEFAULT_PREFETCH_CPU
        })
    }

    /// A short human-readable label of the memory-relevant settings, e.g. `bs128 f16 accum4 ckpt=stages sep`.
    pub fn label(&self) -> String {
        let mut s = format!("bs{} {}", self.steps.batch_size, self.memory.precision);
        if self.steps.accum_steps > 1 {
            s.push_str(&format!(" accum{}", self.steps.accum_steps));
        }
        if self.memory.grad_checkpointing != GradCheckpointing::None {
            s.push_str(&format!(" ckpt={}", self.memory.grad_checkpointing));
        }
        if self.model.conv == ConvKind::Separable {
            s.push_str(" separable");
        }
        if let Some(p) = self.pruning.prune {
            s.push_str(&format!(" prune{p}"));
        }
        // `auto` before it is resolved says so; the line that resolves it names the choice.
        match self.memory.compress_activations.fixed() {
            None => s.push_str(" activations auto"),
            Some(c) if c.is_lossy() => s.push_str(&format!(" {c}-activations (lossy)")),
            Some(_) => {}
        }
        s
    }
}

/// Consecutive steps trained with one `--compress-activations` setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StorageSpan {
    /// The first step (from 1, as in batches.csv).
    pub first_step: usize,
    /// The last step.
    pub last_step: usize,
    /// The setting.
    pub compress_activations: ActivationStorage,
}
