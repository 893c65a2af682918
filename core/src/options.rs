//! The step's option types: precision, activation storage, conv kind, optimizer, TF32, the
//! clipping window, and gradient checkpointing ([`checkpointing`]). Each is a flag's value:
//! clap and serde spell it, `Display` and `FromStr` round-trip it.

use crate::error::{Error, Result};
use memtrain_kernels::quantize::Width;
use serde::{Deserialize, Serialize};

mod checkpointing;

pub use checkpointing::{Cuts, GradCheckpointing, Segmentation, CNN_BLOCKS};

/// A flag's enum: clap value, serde spelling, `Display` and `FromStr` from one list of
/// `Variant => "spelling"`; `$what` names the kind in `FromStr`'s error.
macro_rules! cli_enum {
    ($(#[$meta:meta])* $name:ident ($what:literal) { $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
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
                        $what, other,
                        [$($text),+].join(", ")
                    ))),
                }
            }
        }
    };
}

cli_enum! {
    /// Numeric precision of the forward and backward pass (master weights are always f32).
    Precision ("precision") {
        /// Plain f32 everywhere.
        F32 => "f32",
        /// f16 compute with f32 master weights and a dynamic loss scaler.
        F16 => "f16",
        /// bf16 compute with f32 master weights (no scaler needed).
        Bf16 => "bf16",
    }
}

cli_enum! {
    /// The steps `--clip-grad-norm` applies to.
    ClipDuring ("clipping window") {
        /// Every optimizer step.
        All => "all",
        /// The steps of the first epoch: in a short run the learning rate peaks within them and an
        /// unclipped first epoch can blow up; later steps of a longer run go unclipped.
        FirstEpoch => "first-epoch",
    }
}

cli_enum! {
    /// How the step stores the conv outputs it keeps for the backward.
    ActivationStorage ("activation storage") {
        /// As computed, in the compute dtype (exact gradients).
        None => "none",
        /// One byte per element with a scale and an offset per channel (lossy: the backward reads
        /// values within half a step of the forward's; [`memtrain_kernels::quantize`]). Every
        /// width keeps the forward's ReLU mask and pool argmax exactly beside the codes, a bit per
        /// element ([`crate::step::compress`]).
        Int8 => "int8",
        /// Four bits per element with a scale and an offset per group of 256 values of a plane,
        /// stochastic rounding (lossy: unbiased, within a step of the forward's values).
        Int4 => "int4",
        /// Two bits per element with a scale and an offset per group of 256 values of a plane,
        /// stochastic rounding (lossy: unbiased, within a step of the forward's values).
        Int2 => "int2",
    }
}

impl ActivationStorage {
    /// Whether the gradients differ from the exact step's.
    pub fn is_lossy(&self) -> bool {
        self.width().is_some()
    }

    /// Its place in the planners' order (`--compress-activations auto`, with `--memory-limit`
    /// or `--fit-memory`): 0 for exact storage, then the bits a code gives up (1 for int8, 5 for
    /// int4, 7 for int2), so that the most bits come first.
    pub fn loss_rank(&self) -> usize {
        self.width().map_or(0, |w| 9 - w.bits())
    }

    /// The codes' width, `None` for exact storage: everything about the codes (bits, groups,
    /// rounding, bytes) follows from it.
    pub fn width(&self) -> Option<Width> {
        match self {
            ActivationStorage::None => None,
            ActivationStorage::Int8 => Some(Width::Int8),
            ActivationStorage::Int4 => Some(Width::Int4),
            ActivationStorage::Int2 => Some(Width::Int2),
        }
    }

    /// Bytes the tape keeps of a conv output of `dims` in `elem_bytes`-byte values: the tensor,
    /// or its codes and ranges and the forward's decisions (a bit per value).
    pub fn kept_bytes(&self, dims: [usize; 4], elem_bytes: usize) -> u64 {
        let count = |d: &[usize]| d.iter().product::<usize>() as u64;
        match self.width() {
            None => count(&dims) * elem_bytes as u64,
            Some(w) => {
                w.bytes(dims) as u64 + count(&memtrain_kernels::batchnorm::decisions_dims(dims))
            }
        }
    }
}

cli_enum! {
    /// `--compress-activations`: a storage for the conv outputs the step keeps, or `auto`, which
    /// the trainer resolves under `--memory-limit` together with `--checkpoint` (the most exact
    /// plan that fits); the step itself only ever sees an [`ActivationStorage`].
    CompressActivations ("activation storage") {
        /// Chosen with the segmentation under `--memory-limit`: exact when any exact plan fits,
        /// else the most bits that fit.
        Auto => "auto",
        /// [`ActivationStorage::None`].
        None => "none",
        /// [`ActivationStorage::Int8`].
        Int8 => "int8",
        /// [`ActivationStorage::Int4`].
        Int4 => "int4",
        /// [`ActivationStorage::Int2`].
        Int2 => "int2",
    }
}

impl CompressActivations {
    /// The storage this names; `None` for `auto`, which the trainer resolves.
    pub fn fixed(self) -> Option<ActivationStorage> {
        match self {
            CompressActivations::Auto => None,
            CompressActivations::None => Some(ActivationStorage::None),
            CompressActivations::Int8 => Some(ActivationStorage::Int8),
            CompressActivations::Int4 => Some(ActivationStorage::Int4),
            CompressActivations::Int2 => Some(ActivationStorage::Int2),
        }
    }

    /// The storage this names.
    ///
    /// # Errors
    /// For `auto`, which is a choice to make first (the trainer makes it with the segmentation).
    pub fn resolved(self) -> Result<ActivationStorage> {
        self.fixed().ok_or_else(|| {
            Error::config(
                "--compress-activations auto is chosen with the segmentation under --memory-limit; resolve it before using the storage",
            )
        })
    }

    /// Whether the storage is lossy; `auto` may be, so it counts as lossy.
    pub fn may_be_lossy(self) -> bool {
        self.fixed().is_none_or(|s| s.is_lossy())
    }
}

impl From<ActivationStorage> for CompressActivations {
    fn from(s: ActivationStorage) -> Self {
        match s {
            ActivationStorage::None => CompressActivations::None,
            ActivationStorage::Int8 => CompressActivations::Int8,
            ActivationStorage::Int4 => CompressActivations::Int4,
            ActivationStorage::Int2 => CompressActivations::Int2,
        }
    }
}

cli_enum! {
    /// Convolution kind used inside each block.
    ConvKind ("convkind") {
        /// Dense 3x3 convolution.
        Standard => "standard",
        /// Depthwise 3x3 followed by pointwise 1x1.
        Separable => "separable",
    }
}

cli_enum! {
    /// Optimizer.
    OptimizerKind ("optimizerkind") {
        /// SGD with Nesterov momentum and coupled weight decay.
        Sgd => "sgd",
        /// AdamW (decoupled weight decay).
        Adamw => "adamw",
    }
}

impl OptimizerKind {
    /// Peak learning rate of the one-cycle schedule when `--lr` is not given.
    // SGD: docs/results/first-run.md (0.2 with clipping at 1.5, six seeds). AdamW:
    // docs/results/adamw-defaults.md.
    pub fn default_lr(self) -> f64 {
        match self {
            OptimizerKind::Sgd => 0.2,
            OptimizerKind::Adamw => 0.003,
        }
    }

    /// Weight decay when `--weight-decay` is not given (same sources as [`Self::default_lr`]).
    pub fn default_weight_decay(self) -> f64 {
        match self {
            OptimizerKind::Sgd => 5e-4,
            OptimizerKind::Adamw => 5e-4,
        }
    }
}

cli_enum! {
    /// TF32 tensor-core math for f32 convolutions on CUDA (see [`memtrain_kernels::set_tf32`]).
    Tf32 ("tf32") {
        /// f32 convolutions multiply in TF32 and sum in f32 (PyTorch's default for convolutions).
        On => "on",
        /// f32 convolutions multiply in f32 (FMA only).
        Off => "off",
    }
}

/// `--tf32`: on, as PyTorch runs f32 convolutions on CUDA by default
/// (`torch.backends.cudnn.allow_tf32 = True`), so f32 comparisons with it compare like with like.
pub const DEFAULT_TF32: Tf32 = Tf32::On;
