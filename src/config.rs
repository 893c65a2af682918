//! The validated training configuration: one struct that drives the one training loop.
//!
//! Flags (see [`crate::cli::TrainArgs`]) map one-to-one onto fields here; conversion validates
//! them, so a `TrainConfig` that exists is one the trainer can run.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

macro_rules! cli_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
        #[serde(rename_all = "lowercase")]
        pub enum $name {
            $($(#[$vmeta])* #[value(name = $text)] #[serde(rename = $text)] $variant),+
        }
        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            /// The flag spelling of this variant.
            pub fn as_str(&self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
        impl std::str::FromStr for $name {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                match s.trim().to_ascii_lowercase().as_str() {
                    $($text => Ok($name::$variant),)+
                    other => Err(Error::config(format!(
                        "unknown {} '{}'; expected one of: {}",
                        stringify!($name).to_ascii_lowercase(), other,
                        [$($text),+].join(", ")
                    ))),
                }
            }
        }
    };
}

cli_enum! {
    /// Numeric precision of the forward and backward pass (master weights are always f32).
    Precision {
        /// Plain f32 everywhere.
        F32 => "f32",
        /// f16 compute with f32 master weights and a dynamic loss scaler.
        F16 => "f16",
        /// bf16 compute with f32 master weights (no scaler needed).
        Bf16 => "bf16",
    }
}

cli_enum! {
    /// Gradient checkpointing granularity.
    Checkpointing {
        /// Keep every activation for backward.
        None => "none",
        /// Keep only the input of each of the three stages; recompute each stage in backward.
        Stages => "stages",
        /// Keep only the input of each conv block; recompute each block in backward.
        Blocks => "blocks",
        /// Pick none, stages or blocks from the memory estimate: the smallest predicted peak,
        /// or under --memory-limit the cheapest (least recomputation) whose peak fits.
        Auto => "auto",
    }
}

impl Checkpointing {
    /// The segmentations themselves (everything but `auto`), cheapest first: no recomputation,
    /// then one recomputed forward in three segments, then in one segment per block.
    pub const CONCRETE: &'static [Checkpointing] = &[
        Checkpointing::None,
        Checkpointing::Stages,
        Checkpointing::Blocks,
    ];
}

cli_enum! {
    /// Convolution kind used inside each block.
    ConvKind {
        /// Dense 3x3 convolution.
        Standard => "standard",
        /// Depthwise 3x3 followed by pointwise 1x1.
        Separable => "separable",
    }
}

cli_enum! {
    /// Optimizer.
    OptimizerKind {
        /// SGD with Nesterov momentum and coupled weight decay.
        Sgd => "sgd",
        /// AdamW (decoupled weight decay).
        Adamw => "adamw",
    }
}

cli_enum! {
    /// TF32 tensor-core math for f32 convolutions on CUDA (see [`crate::ops::set_tf32`]).
    Tf32 {
        /// f32 convolutions multiply in TF32 and sum in f32 (PyTorch's default for convolutions).
        On => "on",
        /// f32 convolutions multiply in f32 (FMA only).
        Off => "off",
    }
}

/// `--tf32`: on, as PyTorch runs f32 convolutions on CUDA by default
/// (`torch.backends.cudnn.allow_tf32 = True`), so f32 comparisons with it compare like with like.
pub const DEFAULT_TF32: Tf32 = Tf32::On;

impl Precision {
    /// The Candle dtype the forward pass computes in.
    pub fn compute_dtype(&self) -> candle_core::DType {
        match self {
            Precision::F32 => candle_core::DType::F32,
            Precision::F16 => candle_core::DType::F16,
            Precision::Bf16 => candle_core::DType::BF16,
        }
    }
}

/// Everything a training run needs, validated. Saved as `config.json` in the run directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainConfig {
    /// CIFAR-10 binary directory; `None` means `data/cifar-10-batches-bin` if present, else synthetic.
    pub data_dir: Option<PathBuf>,
    /// Fetch the full CIFAR-10 through candle-datasets' hub loader.
    pub download: bool,
    /// Fraction of the training files held out for validation when there is no test_batch.bin.
    pub val_fraction: f64,
    /// Random flip + 4-pixel reflect-pad translation of training images.
    pub augment: bool,
    /// Number of synthetic training images (used only when there is no real data).
    pub synthetic_train: usize,
    /// Number of synthetic test images.
    pub synthetic_test: usize,
    /// Base width w of the CNN (stages have w, 2w, 4w channels).
    pub width: usize,
    /// Convolution kind.
    pub conv: ConvKind,
    /// Optimizer.
    pub optimizer: OptimizerKind,
    /// Peak learning rate of the one-cycle schedule.
    pub lr: f64,
    /// Momentum (SGD) or beta1 (AdamW).
    pub momentum: f64,
    /// Weight decay.
    pub weight_decay: f64,
    /// Fraction of all steps spent warming the learning rate up.
    pub warmup_frac: f64,
    /// Largest global L2 norm of the gradients: a step whose gradients are longer is scaled
    /// down to it. `None` turns clipping off.
    pub clip_grad_norm: Option<f64>,
    /// Number of epochs.
    pub epochs: usize,
    /// Images per optimizer step (the effective batch).
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
    pub accum_steps: usize,
    /// Stop after this many optimizer steps (for quick measurements).
    pub max_steps: Option<usize>,
    /// Compute precision.
    pub precision: Precision,
    /// Gradient checkpointing granularity.
    pub checkpoint: Checkpointing,
    /// Memory budget in bytes (CUDA: a hard pool limit; CPU: checked by the counting allocator).
    pub memory_limit: Option<u64>,
    /// Keep freed CUDA pool memory between steps (release threshold = max).
    pub pool_cache: bool,
    /// TF32 math for f32 convolutions on CUDA (no effect on the CPU, in f16/bf16 or on the head).
    pub tf32: Tf32,
    /// Capture the forward and backward of the training step as a CUDA graph and replay it
    /// (`crate::train::graph`); CUDA only.
    pub cuda_graph: bool,
    /// Seed for initialization, data order, augmentation and synthetic data.
    pub seed: u64,
    /// Device: "cpu", "cuda" or "cuda:N"; `None` picks CUDA when available.
    pub device: Option<String>,
    /// Run directory; `None` means `runs/<timestamp>`.
    pub out: Option<PathBuf>,
    /// Evaluate on the validation/test split after each epoch.
    pub eval: bool,
    /// Plain log lines instead of progress bars.
    pub quiet: bool,
    /// Save a training checkpoint every N optimizer steps (and at each epoch end); 0 = only at epoch ends.
    pub save_every: usize,
    /// Reset the peak-memory watermark at the start of every epoch.
    pub reset_peak_each_epoch: bool,
    /// Target (final) sparsity of magnitude pruning, in [0, 1); `None`: no pruning.
    pub prune: Option<f64>,
    /// Optimizer step at which the pruning schedule begins.
    pub prune_begin: usize,
    /// Optimizer step at which the schedule reaches `prune`; `None`: the run's last step.
    pub prune_end: Option<usize>,
    /// Recompute the masks every this many optimizer steps within [begin, end].
    pub prune_every: usize,
    /// Sparsity the schedule starts from at `prune_begin`.
    pub prune_initial: f64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            data_dir: None,
            download: false,
            val_fraction: 0.1,
            augment: true,
            synthetic_train: 5000,
            synthetic_test: 1000,
            width: 32,
            conv: ConvKind::Standard,
            optimizer: OptimizerKind::Sgd,
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 5e-4,
            warmup_frac: 0.25,
            // Measured (README "A first run that learns"): without it the first epoch's loss
            // climbs to ~25 at gradient norms of 10-25 and the network dies at chance; 3 keeps
            // 20-epoch accuracy (1 and 2 cost 7 and 3 points there).
            clip_grad_norm: Some(3.0),
            epochs: 1,
            batch_size: 128,
            accum_steps: 1,
            max_steps: None,
            precision: Precision::F32,
            checkpoint: Checkpointing::None,
            memory_limit: None,
            pool_cache: true,
            tf32: DEFAULT_TF32,
            cuda_graph: false,
            seed: 0,
            device: None,
            out: None,
            eval: true,
            quiet: false,
            save_every: 0,
            reset_peak_each_epoch: true,
            prune: None,
            prune_begin: DEFAULT_PRUNE_BEGIN,
            prune_end: None,
            prune_every: DEFAULT_PRUNE_EVERY,
            prune_initial: DEFAULT_PRUNE_INITIAL,
        }
    }
}

/// `--prune-begin`: the pruning schedule starts with the run (Keras' `begin_step` default).
pub const DEFAULT_PRUNE_BEGIN: usize = 0;
/// `--prune-every`: masks are recomputed every 100 optimizer steps (Keras' `frequency` default).
pub const DEFAULT_PRUNE_EVERY: usize = 100;
/// `--prune-initial`: the schedule starts from a dense model (Keras' `initial_sparsity` default).
pub const DEFAULT_PRUNE_INITIAL: f64 = 0.0;

/// Largest config file read: a `config.json` is about 1 KiB, so anything near this is not one.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The text of a config file: refused unless it is a regular file of at most
/// [`MAX_CONFIG_BYTES`] (a FIFO would block and `/dev/zero` never ends).
pub fn read_config_text(path: &std::path::Path) -> Result<String> {
    use std::io::Read;
    let bad = |why: String| {
        Error::config(format!(
            "--config {}: {why}; pass a config.json from a run directory",
            path.display()
        ))
    };
    let meta = std::fs::metadata(path).map_err(|e| bad(format!("cannot read it ({e})")))?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_CONFIG_BYTES + 1).read_to_string(&mut text))
        .map_err(|e| bad(format!("cannot read it ({e})")))?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(bad(format!(
            "larger than {} KiB, so not a config file",
            MAX_CONFIG_BYTES / 1024
        )));
    }
    Ok(text)
}

/// Refuse keys of a config object that `TrainConfig` does not have (a typo such as
/// `batchsize` would otherwise be ignored), naming the nearest valid key.
pub fn check_keys(path: &std::path::Path, value: &serde_json::Value) -> Result<()> {
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
pub const MIN_SYNTHETIC_IMAGES: usize = 10;

/// Largest batch the trainer accepts; beyond this a typo is more likely than intent.
pub const MAX_BATCH_SIZE: usize = 1 << 20;

impl TrainConfig {
    /// Images per micro-batch (`batch_size / accum_steps`).
    pub fn micro_batch(&self) -> usize {
        self.batch_size / self.accum_steps.max(1)
    }

    /// Check every field; the message names the flag and the fix.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::config(m));
        if self.batch_size == 0 {
            return bad("--batch-size must be at least 1".into());
        }
        if self.batch_size > MAX_BATCH_SIZE {
            return bad(format!(
                "--batch-size {} is absurdly large (max {MAX_BATCH_SIZE}); use a smaller batch with --accum-steps",
                self.batch_size
            ));
        }
        if self.accum_steps == 0 {
            return bad("--accum-steps must be at least 1".into());
        }
        if !self.batch_size.is_multiple_of(self.accum_steps) {
            return bad(format!(
                "--batch-size {} is not divisible by --accum-steps {}; pick a batch size that is a multiple of it (e.g. {})",
                self.batch_size,
                self.accum_steps,
                self.accum_steps * (self.batch_size / self.accum_steps).max(1)
            ));
        }
        if self.width == 0 {
            return bad("--width must be at least 1 (default 32)".into());
        }
        if self.width > 4096 {
            return bad(format!("--width {} is too large (max 4096)", self.width));
        }
        if !self.lr.is_finite() || self.lr <= 0.0 {
            return bad(format!(
                "--lr must be a positive finite number, got {}",
                self.lr
            ));
        }
        if !self.momentum.is_finite() || !(0.0..1.0).contains(&self.momentum) {
            return bad(format!(
                "--momentum must be in [0, 1), got {}",
                self.momentum
            ));
        }
        if !self.weight_decay.is_finite() || self.weight_decay < 0.0 {
            return bad(format!(
                "--weight-decay must be >= 0, got {}",
                self.weight_decay
            ));
        }
        if !self.warmup_frac.is_finite() || !(0.0..1.0).contains(&self.warmup_frac) {
            return bad(format!(
                "--warmup-frac must be in [0, 1), got {}",
                self.warmup_frac
            ));
        }
        if let Some(c) = self.clip_grad_norm {
            if !c.is_finite() || c <= 0.0 {
                return bad(format!(
                    "--clip-grad-norm must be a positive finite norm (or 0 to turn clipping off), got {c}"
                ));
            }
        }
        if !(self.val_fraction.is_finite() && self.val_fraction > 0.0 && self.val_fraction < 1.0) {
            return bad(format!(
                "--val-fraction must be in (0, 1), got {}",
                self.val_fraction
            ));
        }
        if self.epochs == 0 {
            // `--max-steps` only caps the steps of the epochs: with none there is nothing to run.
            return bad(
                "--epochs must be at least 1 (--max-steps N then stops the run early after N steps)"
                    .into(),
            );
        }
        if self.max_steps == Some(0) {
            return bad("--max-steps must be at least 1".into());
        }
        if self.synthetic_train < MIN_SYNTHETIC_IMAGES || self.synthetic_test < MIN_SYNTHETIC_IMAGES
        {
            return bad(format!(
                "--synthetic-train and --synthetic-test must be at least {MIN_SYNTHETIC_IMAGES}"
            ));
        }
        if let Some(limit) = self.memory_limit {
            if limit == 0 {
                return bad("--memory-limit must be larger than 0".into());
            }
        }
        if let Some(dev) = &self.device {
            crate::device::parse_device_spec(dev)?;
        }
        self.validate_cuda_graph()?;
        self.validate_pruning()
    }

    /// `--cuda-graph`: only on a CUDA device, and not under `--memory-limit`. Whether an automatic
    /// device turned out to be a GPU is checked when the trainer opens it.
    fn validate_cuda_graph(&self) -> Result<()> {
        if !self.cuda_graph {
            return Ok(());
        }
        if let Some(dev) = &self.device {
            if crate::device::parse_device_spec(dev)? == crate::device::DeviceSpec::Cpu {
                return Err(Error::config(
                    "--cuda-graph captures the step on a GPU and cannot run with --device cpu; drop --cuda-graph or use --device cuda",
                ));
            }
        }
        if self.memory_limit.is_some() {
            // Allocations made while a stream is captured come from CUDA's graph memory, not
            // from the pool whose maximum size is the limit: the limit would not hold.
            return Err(Error::config(
                "--cuda-graph cannot be combined with --memory-limit: a captured step allocates from CUDA's graph memory, which the limit's pool does not bound; drop one of them",
            ));
        }
        if !cfg!(feature = "cuda") {
            return Err(Error::config(
                "--cuda-graph needs a CUDA device, and this binary was built without CUDA; rebuild with --features cuda (see README, Build for CUDA) or drop --cuda-graph",
            ));
        }
        Ok(())
    }

    /// The `--prune*` flags; the checks that need the run's length (the default end step) are
    /// made when the trainer knows it (`train::prune::Schedule::for_run`).
    fn validate_pruning(&self) -> Result<()> {
        let bad = |m: String| Err(Error::config(m));
        let Some(target) = self.prune else {
            if self.prune_begin != DEFAULT_PRUNE_BEGIN
                || self.prune_end.is_some()
                || self.prune_every != DEFAULT_PRUNE_EVERY
                || self.prune_initial != DEFAULT_PRUNE_INITIAL
            {
                return bad("--prune-begin, --prune-end, --prune-every and --prune-initial only apply with --prune SPARSITY; add --prune (e.g. --prune 0.5)".into());
            }
            return Ok(());
        };
        if !target.is_finite() || !(0.0..1.0).contains(&target) {
            return bad(format!(
                "--prune must be a sparsity in [0, 1) (0.5 zeroes half of each layer's weights), got {target}"
            ));
        }
        if !self.prune_initial.is_finite() || !(0.0..=target).contains(&self.prune_initial) {
            return bad(format!(
                "--prune-initial must be in [0, --prune {target}] (sparsity only grows), got {}",
                self.prune_initial
            ));
        }
        if self.prune_every == 0 {
            return bad("--prune-every must be at least 1 (default 100)".into());
        }
        if let Some(end) = self.prune_end {
            if end <= self.prune_begin {
                return bad(format!(
                    "--prune-end {end} must be after --prune-begin {}; raise --prune-end or lower --prune-begin",
                    self.prune_begin
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

    /// A short human-readable label of the memory-relevant settings, e.g. `bs128 f16 accum4 ckpt=stages sep`.
    pub fn label(&self) -> String {
        let mut s = format!("bs{} {}", self.batch_size, self.precision);
        if self.accum_steps > 1 {
            s.push_str(&format!(" accum{}", self.accum_steps));
        }
        if self.checkpoint != Checkpointing::None {
            s.push_str(&format!(" ckpt={}", self.checkpoint));
        }
        if self.conv == ConvKind::Separable {
            s.push_str(" separable");
        }
        if let Some(p) = self.prune {
            s.push_str(&format!(" prune{p}"));
        }
        s
    }
}
