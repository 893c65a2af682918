//! Analytic, per-layer prediction of training memory.
//!
//! [`estimate`] predicts, for a [`TrainConfig`], what the memory probe will measure: the bytes of
//! the parameters, gradients and optimizer state, the activations saved for backward (in the
//! compute dtype, with checkpointing and gradient accumulation taken into account), the transient
//! buffers (im2col columns of each convolution, casts of the f32 master weights, activation
//! gradients), and on the CPU the process baseline (the data set held in memory, the batch
//! buffers, the model). Besides the peak per phase it predicts every layer event of the step's
//! memory timeline ([`Estimate::events`], matched to `step_timeline.json` by the trainer).
//!
//! It is derived from the model's layer list ([`model_layer_specs`], the same list as
//! [`Cnn::layer_specs`](crate::model::Cnn::layer_specs)), not from a hand-written total: the
//! estimate replays, op by op, the allocations and frees the lean step (`src/train/lean.rs`)
//! makes, in the order it makes them. The rules it replays:
//!
//! - **Forward**: each block's conv output h is kept for the backward (with 2·C floats of batch
//!   statistics) and its output (the ReLU output, or the pool's) is a new tensor that lives until
//!   the next block has used it; inside a checkpointed segment's first forward nothing is kept and
//!   BatchNorm + ReLU runs in place. Under f16/bf16 each weight is cast to a half copy per use.
//!   The convolution allocates per thread one image's im2col column
//!   ([`memtrain_kernels::conv2d::im2col_chunk_bytes`]) and, in half precision, widened f32 copies of
//!   one input and one output image. A separable block's depthwise output is freed once the
//!   pointwise convolution has run.
//! - **Backward**, per block in the tape's order: the pool's output and byte argmax recomputed
//!   from h; the conv's input gradient; the BatchNorm backward written over a buffer it owns (no
//!   allocation but its `[2, C]` sums); the block input recomputed in place over the previous h;
//!   the weight gradient, whose chunks of images are gathered into im2col columns and summed in
//!   per-slot partials. A checkpoint segment is re-run with saving first.
//! - **Accumulation**: the first micro-batch's gradients are the buffers; later ones are added in
//!   place and dropped.
//! - **Optimizer** (`src/train/optim.rs`): SGD keeps one f32 momentum buffer per parameter, AdamW
//!   two; the update's temporaries are a few parameter-sized tensors, one parameter at a time.
//! - **Pruning** (`--prune`, `src/train/prune.rs`): one u8 mask per pruned weight (conv and head
//!   weights), allocated with the model, so part of the baseline; after the update, with the
//!   gradients freed, one layer at a time: recomputing a mask copies the weights to the host
//!   with an 8-byte sort key each (CPU), applying it allocates a zero tensor and the result.
//! - **Baseline (CPU)**: the counting allocator measures the whole process heap, so the training
//!   split and the evaluation split (bytes as loaded), the f32 master weights and BatchNorm
//!   statistics, the batcher's index permutation, four f32 batch buffers of the full batch size
//!   (recycled from step to step) and the gemm crate's per-thread packing buffers are part of
//!   every measurement.
//!
//! On the CPU the estimate is calibrated against the counting allocator (see
//! `docs/results/estimate-accuracy.md`); on CUDA it is a first-order model (the conv op's chunked
//! columns from `memtrain_kernels::conv2d_cuda::cuda_scratch_bytes`, or in a `cudnn` build the one cuDNN
//! workspace of `memtrain_kernels::conv2d_cudnn::CUDNN_WORKSPACE_BYTES`; cuBLAS workspaces, the pool's rounding and
//! the ReLU outputs the CUDA step materializes where the CPU works in place are not modelled),
//! not yet checked against a GPU.

use crate::config::{ConvKind, GradCheckpointing, OptimizerKind, Precision, TrainConfig};
use crate::data::{IMAGE_BYTES, NUM_CLASSES, RECORD_BYTES};
use crate::error::{Error, Result};
use crate::memory::format_bytes;
use crate::model::LayerSpec;
use candle_core::DType;
use memtrain_kernels::conv2d_cuda::ConvPass;
use std::fmt::Write as _;
use std::ops::Range;
use std::path::Path;

/// Bytes the process holds besides the data set and the model when training begins on the CPU
/// (argument parsing, the candle thread pool, progress bars, the memory log, standard I/O
/// buffers). Measured: the CPU probe's baseline minus the data set and the model (22 KB with
/// real CIFAR-10 and with synthetic data, once the generator's templates are counted).
pub const RUNTIME_OVERHEAD_BYTES: u64 = 24 << 10;

/// Transient bytes per weight of the largest pruned layer while its mask is recomputed and applied
/// (`src/train/prune.rs`): on the CPU the f32 host copy (4), the sort key (8) and the new mask (1);
/// on CUDA the zero tensor and the masked result (4 + 4), the host work not being device memory.
const PRUNE_TRANSIENT_PER_WEIGHT_CPU: u64 = 13;
const PRUNE_TRANSIENT_PER_WEIGHT_CUDA: u64 = 8;

/// Bytes the synthetic data generator keeps for the life of the process once it has run
/// (`src/data/synthetic.rs`): 10 class templates of 3 × 38 × 38 f32 (the image plus a 3-pixel
/// shift margin on each side) and their 30 plane means.
pub const SYNTHETIC_TEMPLATE_BYTES: u64 = (10 * 3 * 38 * 38 + 10 * 3) * 4;

/// Whether `cfg` trains on the built-in synthetic data (no `--download`, no `--data-dir` and no
/// `data/cifar-10-batches-bin`), as [`crate::data::load`] decides.
pub fn uses_synthetic_data(cfg: &TrainConfig) -> bool {
    !cfg.download && cfg.data_dir.is_none() && !Path::new(crate::data::DEFAULT_DATA_DIR).is_dir()
}

/// Batches alive at once on the CPU besides the data set: the one being trained, two in the
/// prefetch channel (`prefetch: 2`) and one the worker has built and is waiting to send.
pub const BATCHES_IN_FLIGHT: usize = 4;

/// Where training runs, as far as memory is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum DeviceKind {
    /// The CPU with `threads` compute threads (Candle's CPU pool workers plus the caller): every
    /// thread of a convolution holds its own im2col column.
    Cpu {
        /// Threads that run per-image convolution work at once.
        threads: usize,
        /// Bytes of the L2 cache: the gemm crate keeps one L2-sized packing buffer per thread
        /// that has run a matrix product, for the life of the thread.
        l2_cache_bytes: u64,
    },
    /// A CUDA device: the probe measures the memory pool, so the data set and host batches are
    /// not part of the measurement.
    Cuda,
}

impl DeviceKind {
    /// The CPU of this process, with as many threads as Candle's CPU pool uses.
    pub fn cpu() -> Self {
        DeviceKind::Cpu {
            threads: candle_core::utils::barrier_pool().n_workers() + 1,
            l2_cache_bytes: l2_cache_bytes(),
        }
    }

    /// The kind of a Candle device.
    pub fn of(device: &candle_core::Device) -> Self {
        if device.is_cpu() {
            DeviceKind::cpu()
        } else {
            DeviceKind::Cuda
        }
    }

    /// The kind a `--device` value selects without opening the device: `cpu`, `cuda`/`cuda:N`,
    /// or (no value) CUDA when this build has it and a GPU is present, else the CPU.
    ///
    /// # Errors
    /// When the value is not a device spec.
    pub fn for_spec(spec: Option<&str>) -> Result<Self> {
        match spec {
            Some(s) => {
                crate::device::parse_device_spec(s)?;
                if s.trim().eq_ignore_ascii_case("cpu") {
                    Ok(DeviceKind::cpu())
                } else {
                    Ok(DeviceKind::Cuda)
                }
            }
            None if candle_core::utils::cuda_is_available() => Ok(DeviceKind::Cuda),
            None => Ok(DeviceKind::cpu()),
        }
    }

    /// Whether this is the CPU (where the probe counts the whole process heap, data set included).
    pub fn is_cpu(&self) -> bool {
        matches!(self, DeviceKind::Cpu { .. })
    }

    fn threads(&self) -> usize {
        match self {
            DeviceKind::Cpu { threads, .. } => (*threads).max(1),
            DeviceKind::Cuda => 1,
        }
    }
}

/// The L2 cache size of CPU 0 (Linux sysfs), or 1 MiB where it cannot be read.
fn l2_cache_bytes() -> u64 {
    const FALLBACK: u64 = 1 << 20;
    let base = Path::new("/sys/devices/system/cpu/cpu0/cache");
    for i in 0..8 {
        let dir = base.join(format!("index{i}"));
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).map(|s| s.trim().to_string());
        let (Ok(level), Ok(kind), Ok(size)) = (read("level"), read("type"), read("size")) else {
            continue;
        };
        if level == "2" && kind != "Instruction" {
            let (num, mult) = match size.strip_suffix('K') {
                Some(n) => (n, 1024),
                None => match size.strip_suffix('M') {
                    Some(n) => (n, 1 << 20),
                    None => (size.as_str(), 1),
                },
            };
            if let Ok(v) = num.parse::<u64>() {
                return v * mult;
            }
        }
    }
    FALLBACK
}

/// The data set as far as memory is concerned: how many images each split holds and how many
/// bytes the loaded splits occupy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataSize {
    /// Training images (batches per epoch follow from it).
    pub train_images: usize,
    /// Evaluation images (test or validation split).
    pub test_images: usize,
    /// Heap bytes of both loaded splits (pixels and labels, with the capacity slack of the loader).
    pub resident_bytes: u64,
}

impl DataSize {
    /// Splits of `train` and `test` images held exactly (pixels plus one label byte each), as the
    /// validation split produces them.
    pub fn exact(train_images: usize, test_images: usize) -> Self {
        DataSize {
            train_images,
            test_images,
            // Saturating: a count no machine holds must compare as too large, not wrap.
            resident_bytes: (train_images as u64)
                .saturating_add(test_images as u64)
                .saturating_mul(RECORD_BYTES as u64),
        }
    }

    /// Synthetic splits: held exactly, plus the generator's templates
    /// ([`SYNTHETIC_TEMPLATE_BYTES`]).
    pub fn synthetic(train_images: usize, test_images: usize) -> Self {
        let mut d = DataSize::exact(train_images, test_images);
        d.resident_bytes = d.resident_bytes.saturating_add(SYNTHETIC_TEMPLATE_BYTES);
        d
    }

    /// The size of loaded splits (their allocated capacity), plus the synthetic generator's
    /// templates when `cfg` trains on synthetic data.
    pub fn loaded(
        train: &crate::data::Dataset,
        test: &crate::data::Dataset,
        cfg: &TrainConfig,
    ) -> Self {
        let bytes = |d: &crate::data::Dataset| (d.images.capacity() + d.labels.capacity()) as u64;
        let generator = if uses_synthetic_data(cfg) {
            SYNTHETIC_TEMPLATE_BYTES
        } else {
            0
        };
        DataSize {
            train_images: train.len(),
            test_images: test.len(),
            resident_bytes: bytes(train) + bytes(test) + generator,
        }
    }

    /// The data the config will load, found without loading it: the synthetic sizes, the record
    /// counts of the CIFAR-10 files in `--data-dir` (or `data/cifar-10-batches-bin`), or the full
    /// CIFAR-10 for `--download`.
    ///
    /// # Errors
    /// When a data directory is named but holds no readable CIFAR-10 training files.
    pub fn for_config(cfg: &TrainConfig) -> Result<Self> {
        if cfg.download {
            return Ok(DataSize::exact(50_000, 10_000));
        }
        let default_dir = Path::new(crate::data::DEFAULT_DATA_DIR);
        let dir = match &cfg.data_dir {
            Some(d) => Some(d.as_path()),
            None if default_dir.is_dir() => Some(default_dir),
            None => None,
        };
        match dir {
            Some(d) => DataSize::for_dir(d, cfg.val_fraction),
            None => Ok(DataSize::synthetic(cfg.synthetic_train, cfg.synthetic_test)),
        }
    }

    /// Sizes of a CIFAR-10 binary directory, from the file sizes ([`crate::data::cifar::scan_dir`],
    /// which also refuses files that are not CIFAR-10 binary files).
    fn for_dir(dir: &Path, val_fraction: f64) -> Result<Self> {
        let files = crate::data::cifar::scan_dir(dir)?;
        Ok(DataSize::for_files(&files, val_fraction))
    }

    /// Sizes of the checked files of a CIFAR-10 binary directory, as
    /// [`crate::data::cifar::load_dir`] will hold them.
    pub fn for_files(files: &crate::data::cifar::DirFiles, val_fraction: f64) -> Self {
        let train_parts: Vec<usize> = files.train.iter().map(|(_, n)| *n).collect();
        let n: usize = train_parts.iter().sum();
        match &files.test {
            Some((_, test)) => {
                // The training files are appended one after another: the vectors keep the
                // capacity their growth left them with.
                let parts_px: Vec<usize> = train_parts.iter().map(|p| p * IMAGE_BYTES).collect();
                let resident =
                    grown_capacity(&parts_px) + grown_capacity(&train_parts) + test * RECORD_BYTES;
                DataSize {
                    train_images: n,
                    test_images: *test,
                    resident_bytes: resident as u64,
                }
            }
            None => {
                let (train, val) = crate::data::cifar::split_sizes(n, val_fraction);
                DataSize::exact(train, val)
            }
        }
    }
}

/// Capacity of a `Vec<u8>` after `extend_from_slice` of each part in turn (amortized doubling).
pub(crate) fn grown_capacity(parts: &[usize]) -> usize {
    let (mut len, mut cap) = (0usize, 0usize);
    for &p in parts {
        let need = len + p;
        if need > cap {
            cap = need.max(cap * 2).max(8);
        }
        len = need;
    }
    cap
}

/// What is measured besides training's own allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Baseline {
    /// Model the process baseline from the data set (CPU) or from nothing but the model (CUDA).
    Modeled(DataSize),
    /// A measured baseline: the bytes in use when training begins (data set, model, runtime),
    /// e.g. `MemoryLog::baseline_bytes` of an earlier run. The batches in flight, which the
    /// batcher allocates after that reading, are still added.
    Measured {
        /// Bytes in use when training began.
        bytes: u64,
        /// Training images (for the number of prefetched batches).
        train_images: usize,
    },
}

/// The prediction for one layer of the model.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LayerEstimate {
    /// Layer name, e.g. `stage1.block2.conv`.
    pub name: String,
    /// Kind, as in [`LayerSpec::kind`].
    pub kind: &'static str,
    /// Output shape per image (C, H, W).
    pub output_shape: (usize, usize, usize),
    /// Trainable parameters.
    pub params: usize,
    /// Bytes of one micro-batch of this layer's output in the compute dtype (f32 for the head).
    pub output_bytes: u64,
    /// Bytes this layer keeps from the forward to the backward pass of a micro-batch: its output
    /// (and, under f16, its cast weights) without checkpointing; with checkpointing only a
    /// segment's last layer keeps its output (the next segment's saved input).
    pub saved_bytes: u64,
    /// Bytes alive only while the layer recomputes inside its checkpointed segment (0 without
    /// checkpointing).
    pub recompute_bytes: u64,
    /// Largest transient allocation of the layer's forward or backward beyond its inputs and
    /// outputs: im2col columns, widened f32 copies, weight casts, gradient buffers.
    pub transient_bytes: u64,
}

/// The predicted memory of a training configuration, per layer and per phase.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Estimate {
    /// One row per layer of the model, in forward order.
    pub layers: Vec<LayerEstimate>,
    /// Images per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step.
    pub accum_steps: usize,
    /// Compute precision.
    pub precision: Precision,
    /// Gradient checkpointing granularity.
    pub grad_checkpointing: GradCheckpointing,
    /// Convolution kind.
    pub conv: ConvKind,
    /// Device the estimate is for.
    pub device: DeviceKind,
    /// f32 master weights.
    pub param_bytes: u64,
    /// f32 gradients (accumulated over micro-batches).
    pub grad_bytes: u64,
    /// Optimizer state (momentum; AdamW's two moments).
    pub optimizer_bytes: u64,
    /// Pruning masks (`--prune`): one byte per pruned weight; part of the baseline.
    pub mask_bytes: u64,
    /// Activations alive at the end of a micro-batch's forward pass (saved for backward, or the
    /// checkpoints), in the compute dtype.
    pub activation_bytes: u64,
    /// Bytes in use when training begins (CPU: data set, model, runtime; CUDA: model).
    pub baseline_bytes: u64,
    /// Host batches in flight during a step (0 on CUDA).
    pub batch_bytes: u64,
    /// Buffers the runtime allocates at the first step and keeps (the gemm crate's per-thread
    /// packing buffers on the CPU; the cuDNN workspace on CUDA in a `cudnn` build).
    pub runtime_bytes: u64,
    /// Highest bytes in use during the forward passes.
    pub forward_peak: u64,
    /// Highest bytes in use during the backward passes (recomputation included).
    pub backward_peak: u64,
    /// Highest bytes in use during the optimizer step.
    pub optimizer_peak: u64,
    /// The predicted peak: the highest of the three phases.
    pub peak: u64,
    /// The phase of the peak: `forward`, `backward` or `optimizer`.
    pub peak_phase: &'static str,
    /// The steady-state step's events (every micro-batch's layer events, then the optimizer), as
    /// the trainer's memory timeline records them.
    pub events: Vec<EventPrediction>,
}

impl Estimate {
    /// The same estimate with `bytes` more in use throughout (e.g. what a host process holds
    /// before it loads the data): baseline and peaks shift, the layers do not.
    pub fn offset(mut self, bytes: u64) -> Self {
        self.baseline_bytes += bytes;
        self.forward_peak += bytes;
        self.backward_peak += bytes;
        self.optimizer_peak += bytes;
        self.peak += bytes;
        for e in &mut self.events {
            e.peak_bytes += bytes;
            e.current_bytes += bytes;
        }
        self
    }

    /// `(predicted - measured) / measured` in percent; `None` when nothing was measured.
    pub fn error_pct(&self, measured: u64) -> Option<f64> {
        (measured > 0).then(|| (self.peak as f64 - measured as f64) / measured as f64 * 100.0)
    }

    /// The per-layer table (layer, output shape, parameters, saved activations, recompute,
    /// transient) followed by the totals and the predicted peak per phase, as markdown.
    pub fn table(&self) -> String {
        let mut s = format!(
            "memory estimate ({}; micro-batch {} x {} step(s), {}, checkpoint {}, {} conv)\n",
            match self.device {
                DeviceKind::Cpu { threads, .. } => format!("cpu, {threads} threads"),
                DeviceKind::Cuda => "cuda, first-order".to_string(),
            },
            self.micro_batch,
            self.accum_steps,
            self.precision,
            self.grad_checkpointing,
            self.conv
        );
        s.push_str(
            "| layer | output (C×H×W) | params | saved for backward | recomputed | transient |\n",
        );
        s.push_str("|---|---|---:|---:|---:|---:|\n");
        let dash = |b: u64| {
            if b == 0 {
                "-".to_string()
            } else {
                format_bytes(b)
            }
        };
        for l in &self.layers {
            let (c, h, w) = l.output_shape;
            let _ = writeln!(
                s,
                "| {} | {c}×{h}×{w} | {} | {} | {} | {} |",
                l.name,
                l.params,
                dash(l.saved_bytes),
                dash(l.recompute_bytes),
                dash(l.transient_bytes)
            );
        }
        let _ = writeln!(
            s,
            "parameters {} | gradients {} | optimizer state {} | activations at end of forward {}",
            format_bytes(self.param_bytes),
            format_bytes(self.grad_bytes),
            format_bytes(self.optimizer_bytes),
            format_bytes(self.activation_bytes)
        );
        if self.mask_bytes > 0 {
            let _ = writeln!(s, "pruning masks {}", format_bytes(self.mask_bytes));
        }
        let _ = writeln!(
            s,
            "baseline {} (data set, model, runtime) | batches in flight {} | {} {}",
            format_bytes(self.baseline_bytes),
            format_bytes(self.batch_bytes),
            if self.device.is_cpu() {
                "gemm buffers"
            } else {
                "conv workspace"
            },
            format_bytes(self.runtime_bytes)
        );
        let _ = writeln!(
            s,
            "predicted peak {} ({}) | forward {} | backward {} | optimizer {}",
            format_bytes(self.peak),
            self.peak_phase,
            format_bytes(self.forward_peak),
            format_bytes(self.backward_peak),
            format_bytes(self.optimizer_peak)
        );
        s
    }
}

/// Predict the memory of training `cfg` on `device`, with the data set sized from the config
/// ([`DataSize::for_config`]).
///
/// # Errors
/// When the config is invalid or its data directory cannot be sized.
pub fn estimate(cfg: &TrainConfig, device: DeviceKind) -> Result<Estimate> {
    let data = DataSize::for_config(cfg)?;
    estimate_with(cfg, device, Baseline::Modeled(data))
}

/// Predict the memory of training `cfg` on `device` with the given baseline.
///
/// # Errors
/// When the config is invalid.
pub fn estimate_with(
    cfg: &TrainConfig,
    device: DeviceKind,
    baseline: Baseline,
) -> Result<Estimate> {
    cfg.validate()?;
    let specs = model_layer_specs(cfg.width, cfg.conv);
    estimate_for_specs(cfg, &specs, device, baseline)
}

/// What `--checkpoint auto` runs for `cfg`: under a memory limit the first of
/// [`GradCheckpointing::CONCRETE`] (cheapest first) whose predicted peak fits the limit, else (or
/// when none fits) the one with the smallest predicted peak.
///
/// # Errors
/// As [`estimate_for_specs`].
pub fn resolve_checkpointing(
    cfg: &TrainConfig,
    specs: &[LayerSpec],
    device: DeviceKind,
    baseline: Baseline,
) -> Result<GradCheckpointing> {
    let mut peaks = Vec::new();
    for &ck in GradCheckpointing::CONCRETE {
        let mut c = cfg.clone();
        c.grad_checkpointing = ck;
        peaks.push((ck, estimate_for_specs(&c, specs, device, baseline)?.peak));
    }
    if let Some(limit) = cfg.memory_limit {
        if let Some(&(ck, _)) = peaks.iter().find(|(_, p)| *p <= limit) {
            return Ok(ck);
        }
    }
    Ok(peaks
        .iter()
        .min_by_key(|(_, p)| *p)
        .map_or(GradCheckpointing::None, |&(ck, _)| ck))
}

/// The layer list of the CNN for `width` and `conv`, without building the model (no parameters
/// are allocated); the model's own list, see [`crate::model::cnn::layer_specs_for`].
pub fn model_layer_specs(width: usize, conv: ConvKind) -> Vec<LayerSpec> {
    crate::model::cnn::layer_specs_for(width, conv)
}

/// Predict the memory of training `cfg` on `device` for the model described by `specs` (e.g. a
/// built model's [`Cnn::layer_specs`](crate::model::Cnn::layer_specs)).
///
/// # Errors
/// When the config is invalid, or `specs` is not a list of blocks followed by one linear head
/// (an unknown layer kind, a shape that does not chain).
pub fn estimate_for_specs(
    cfg: &TrainConfig,
    specs: &[LayerSpec],
    device: DeviceKind,
    baseline: Baseline,
) -> Result<Estimate> {
    cfg.validate()?;
    if cfg.grad_checkpointing == GradCheckpointing::Auto {
        let chosen = resolve_checkpointing(cfg, specs, device, baseline)?;
        let mut c = cfg.clone();
        c.grad_checkpointing = chosen;
        return estimate_for_specs(&c, specs, device, baseline);
    }
    let nodes = nodes_from_specs(specs)?;
    let n_blocks = nodes
        .iter()
        .filter(|n| n.op != Op::Head)
        .map(|n| n.block + 1)
        .max()
        .unwrap_or(0);
    let segments = segments(n_blocks, cfg.grad_checkpointing);
    let ctx = Ctx {
        n: cfg.micro_batch() as u64,
        s: elem_bytes(cfg.precision.compute_dtype()),
        dtype: cfg.precision.compute_dtype(),
        device,
    };
    let param_counts: Vec<u64> = nodes.iter().flat_map(|n| n.param_tensors()).collect();
    let param_bytes: u64 = param_counts.iter().map(|p| p * 4).sum();
    let max_param = param_counts.iter().copied().max().unwrap_or(0) * 4;
    let bn_stats: u64 = nodes
        .iter()
        .filter(|n| n.op == Op::Bn)
        .map(|n| n.out.0 as u64 * 2 * 4)
        .sum();
    let optimizer_bytes = match cfg.optimizer {
        OptimizerKind::Sgd => param_bytes,
        OptimizerKind::Adamw => 2 * param_bytes,
    };
    // The pruned weights: convolutions and the head's weight (its first tensor), not biases.
    let pruned: Vec<u64> = if cfg.prune.is_some() {
        nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Conv { .. } | Op::Depthwise | Op::Head))
            .filter_map(|n| n.param_tensors().first().copied())
            .collect()
    } else {
        Vec::new()
    };
    let mask_bytes: u64 = pruned.iter().sum();
    let prune_transient = pruned.iter().copied().max().unwrap_or(0)
        * if device.is_cpu() {
            PRUNE_TRANSIENT_PER_WEIGHT_CPU
        } else {
            PRUNE_TRANSIENT_PER_WEIGHT_CUDA
        };

    // What is in use when training begins, and the batches the batcher adds.
    let (baseline_bytes, train_images) = match baseline {
        Baseline::Measured {
            bytes,
            train_images,
        } => (bytes, train_images),
        Baseline::Modeled(data) if device.is_cpu() => (
            data.resident_bytes + param_bytes + bn_stats + mask_bytes + RUNTIME_OVERHEAD_BYTES,
            data.train_images,
        ),
        Baseline::Modeled(data) => (param_bytes + bn_stats + mask_bytes, data.train_images),
    };
    let batch_bytes = if device.is_cpu() {
        let per_batch = cfg.batch_size as u64 * (IMAGE_BYTES as u64 * 4 + 4);
        let batches = (train_images / cfg.batch_size.max(1)).max(1);
        let in_flight = BATCHES_IN_FLIGHT.min(batches) as u64;
        // The batcher's permutation of the training split lives for the epoch.
        in_flight * per_batch + train_images as u64 * 8
    } else {
        0
    };

    // The gemm crate's per-thread L2 packing buffers, allocated by the first matrix product on
    // each thread and kept: the convolution threads (the head's products run single-threaded
    // on the calling thread, one of them; see `memtrain_kernels::linear`). On CUDA, the cuDNN workspace of a
    // `cudnn` build, allocated by the first convolution and kept.
    let gemm_slabs = match device {
        DeviceKind::Cpu {
            threads,
            l2_cache_bytes,
        } => threads.min(cfg.micro_batch()).max(1) as u64 * l2_cache_bytes,
        DeviceKind::Cuda => memtrain_kernels::conv2d_cudnn::cuda_runtime_bytes(),
    };

    let mut sim = Sim::new(nodes.len());
    sim.cur = baseline_bytes + batch_bytes + gemm_slabs;
    let mut activation_bytes = 0;
    let mut events = Vec::new();
    // Step 1 builds the optimizer state, steps 2.. carry it through forward and backward: the
    // second step is the steady state, and its events are the prediction of the timeline.
    for step in 0..2 {
        let state = if step == 0 { 0 } else { optimizer_bytes };
        sim.cur += state;
        sim.event_peak = sim.cur;
        events.clear();
        let mut acc_live = false;
        for _ in 0..cfg.accum_steps {
            sim.phase = Phase::Forward;
            let (r, ev) = micro_batch(&mut sim, &ctx, &nodes, &segments, acc_live);
            activation_bytes = activation_bytes.max(r);
            events.extend(ev);
            acc_live = true;
        }
        // Optimizer: the accumulated f32 gradients are alive; the update runs one parameter
        // at a time.
        sim.phase = Phase::Optimizer;
        let grads = param_bytes;
        if cfg.precision == Precision::F16 {
            // Unscaling replaces each gradient by a scaled copy.
            sim.spike(max_param);
        }
        match cfg.optimizer {
            // g + w·wd, momentum·m + g, g + buf·m, d·lr: four parameter-sized temporaries at
            // most, the first step also allocating the new state as it goes.
            OptimizerKind::Sgd => {
                sim.spike(if step == 0 { param_bytes } else { 0 } + 3 * max_param)
            }
            // m1, v, their bias-corrected copies, sqrt, the update: about six.
            OptimizerKind::Adamw => {
                sim.spike(if step == 0 { 2 * param_bytes } else { 0 } + 6 * max_param)
            }
        }
        sim.free(grads);
        sim.spike(prune_transient);
        events.push(EventPrediction {
            phase: "optimizer",
            layer: "optimizer".into(),
            peak_bytes: sim.event_peak,
            current_bytes: sim.cur,
            saved_bytes: 0,
        });
        sim.free(state);
    }
    let peaks = sim.peaks;
    let (peak, peak_phase) = [
        (peaks[0], "forward"),
        (peaks[1], "backward"),
        (peaks[2], "optimizer"),
    ]
    .into_iter()
    .fold((0, "forward"), |a, b| if b.0 > a.0 { b } else { a });

    let layers = nodes
        .iter()
        .zip(&sim.layers)
        .map(|(n, r)| LayerEstimate {
            name: n.name.clone(),
            kind: n.kind,
            output_shape: n.out,
            params: n.params,
            output_bytes: n.out_bytes(&ctx),
            saved_bytes: r.saved,
            recompute_bytes: r.recompute,
            transient_bytes: r.transient,
        })
        .collect();
    Ok(Estimate {
        layers,
        micro_batch: cfg.micro_batch(),
        accum_steps: cfg.accum_steps,
        precision: cfg.precision,
        grad_checkpointing: cfg.grad_checkpointing,
        conv: cfg.conv,
        device,
        param_bytes,
        grad_bytes: param_bytes,
        optimizer_bytes,
        mask_bytes,
        activation_bytes,
        baseline_bytes,
        batch_bytes,
        runtime_bytes: gemm_slabs,
        forward_peak: peaks[0],
        backward_peak: peaks[1],
        optimizer_peak: peaks[2],
        peak,
        peak_phase,
        events,
    })
}

// ---------------------------------------------------------------------------------------------
// The model as the simulation sees it.

/// One op of the forward pass.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    /// Dense convolution (`memtrain-conv2d`), stride 1.
    Conv { k: usize, pad: usize },
    /// Depthwise 3x3 convolution.
    Depthwise,
    /// BatchNorm fused with ReLU.
    Bn,
    /// 2x2 max-pool.
    Pool,
    /// Flatten + linear layer in f32.
    Head,
}

#[derive(Debug, Clone)]
struct Node {
    name: String,
    kind: &'static str,
    op: Op,
    inp: (usize, usize, usize),
    out: (usize, usize, usize),
    params: usize,
    block: usize,
}

fn elems(shape: (usize, usize, usize)) -> u64 {
    (shape.0 * shape.1 * shape.2) as u64
}

impl Node {
    fn in_bytes(&self, c: &Ctx) -> u64 {
        c.n * elems(self.inp) * c.s
    }

    fn out_bytes(&self, c: &Ctx) -> u64 {
        c.n * elems(self.out) * if matches!(self.op, Op::Head) { 4 } else { c.s }
    }

    /// Element counts of the parameter tensors (BatchNorm: gamma and beta; head: weight and bias).
    fn param_tensors(&self) -> Vec<u64> {
        match self.op {
            Op::Conv { .. } | Op::Depthwise => vec![self.params as u64],
            Op::Bn => vec![self.out.0 as u64; 2],
            Op::Pool => vec![],
            Op::Head => vec![
                self.params.saturating_sub(NUM_CLASSES) as u64,
                NUM_CLASSES as u64,
            ],
        }
    }
}

fn nodes_from_specs(specs: &[LayerSpec]) -> Result<Vec<Node>> {
    let bad = |m: String| Error::config(format!("memory estimate: {m}"));
    let mut nodes = Vec::with_capacity(specs.len());
    let mut prev: Option<(usize, usize, usize)> = None;
    for s in specs {
        let op = match s.kind {
            "conv3x3" => Op::Conv { k: 3, pad: 1 },
            "pointwise1x1" => Op::Conv { k: 1, pad: 0 },
            "depthwise3x3" => Op::Depthwise,
            "bn_relu" => Op::Bn,
            "maxpool2" => Op::Pool,
            "linear" => Op::Head,
            other => return Err(bad(format!("layer {} has unknown kind '{other}'", s.name))),
        };
        if let Some(p) = prev {
            let chained = if op == Op::Head {
                elems(p) == elems(s.input)
            } else {
                p == s.input
            };
            if !chained {
                return Err(bad(format!(
                    "layer {} takes {:?} but the previous layer gives {:?}",
                    s.name, s.input, p
                )));
            }
        }
        if elems(s.input) == 0 || elems(s.output) == 0 {
            return Err(bad(format!("layer {} has an empty shape", s.name)));
        }
        prev = Some(s.output);
        nodes.push(Node {
            name: s.name.clone(),
            kind: s.kind,
            op,
            inp: s.input,
            out: s.output,
            params: s.params,
            block: s.block,
        });
    }
    match nodes.last() {
        Some(n) if n.op == Op::Head => {}
        _ => return Err(bad("the layer list must end with the linear head".into())),
    }
    if nodes[..nodes.len() - 1].iter().any(|n| n.op == Op::Head) {
        return Err(bad("the linear head must be the last layer".into()));
    }
    if nodes.first().is_some_and(|n| n.op == Op::Head) {
        return Err(bad("the model has no blocks before the head".into()));
    }
    Ok(nodes)
}

/// Gradient-checkpointing segments as block ranges, as
/// [`Cnn::segments`](crate::model::Cnn::segments).
#[allow(clippy::single_range_in_vec_init)] // one segment of all blocks, as the model has it
fn segments(n: usize, ckpt: GradCheckpointing) -> Vec<Range<usize>> {
    match ckpt {
        GradCheckpointing::None | GradCheckpointing::Auto => vec![0..n],
        GradCheckpointing::Stages => (0..n).step_by(2).map(|i| i..(i + 2).min(n)).collect(),
        GradCheckpointing::Blocks => (0..n).map(|i| i..i + 1).collect(),
    }
}

fn elem_bytes(dtype: DType) -> u64 {
    dtype.size_in_bytes() as u64
}

/// Per-micro-batch constants.
struct Ctx {
    /// Images per micro-batch.
    n: u64,
    /// Bytes per element of the compute dtype.
    s: u64,
    dtype: DType,
    device: DeviceKind,
}

impl Ctx {
    fn half(&self) -> bool {
        self.s < 4
    }

    /// Threads busy on `n` independent images (one image per task).
    fn busy(&self, tasks: u64) -> u64 {
        (self.device.threads() as u64).min(tasks.max(1))
    }
}

// ---------------------------------------------------------------------------------------------
// The simulation: bytes in use, replayed allocation by allocation.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Forward = 0,
    Backward = 1,
    Optimizer = 2,
}

#[derive(Debug, Default, Clone, Copy)]
struct LayerRec {
    saved: u64,
    recompute: u64,
    transient: u64,
}

struct Sim {
    cur: u64,
    peaks: [u64; 3],
    phase: Phase,
    layers: Vec<LayerRec>,
    /// Highest `cur` since [`Sim::mark`].
    local_peak: u64,
    /// Highest `cur` since the previous event.
    event_peak: u64,
}

impl Sim {
    fn new(layers: usize) -> Self {
        Sim {
            cur: 0,
            peaks: [0; 3],
            phase: Phase::Forward,
            layers: vec![LayerRec::default(); layers],
            local_peak: 0,
            event_peak: 0,
        }
    }

    fn alloc(&mut self, b: u64) {
        self.cur += b;
        let p = &mut self.peaks[self.phase as usize];
        *p = (*p).max(self.cur);
        self.local_peak = self.local_peak.max(self.cur);
        self.event_peak = self.event_peak.max(self.cur);
    }

    fn free(&mut self, b: u64) {
        self.cur = self.cur.saturating_sub(b);
    }

    /// A buffer allocated and freed again.
    fn spike(&mut self, b: u64) {
        self.alloc(b);
        self.free(b);
    }

    /// Start measuring one layer's transient memory.
    fn mark(&mut self) -> u64 {
        self.local_peak = self.cur;
        self.cur
    }

    /// Record the transient memory of layer `i` since `mark` returned `start`.
    fn record(&mut self, i: usize, start: u64) {
        let t = self.local_peak.saturating_sub(start.max(self.cur));
        let r = &mut self.layers[i].transient;
        *r = (*r).max(t);
    }
}

/// Per-image im2col column of a convolution (one per busy thread), as the op sizes it.
fn one_column(c: &Ctx, nd: &Node, k: usize) -> u64 {
    let (cin, _, _) = nd.inp;
    let (_, ho, wo) = nd.out;
    memtrain_kernels::conv2d::im2col_chunk_bytes(1, cin, k, ho, wo, c.dtype) as u64
}

/// Whether a 1x1 convolution multiplies the image in place: rows that need no padding (a padded
/// column is larger than the image itself).
fn pointwise_in_place(c: &Ctx, nd: &Node, k: usize, pad: usize) -> bool {
    let (cin, h, w) = nd.inp;
    k == 1 && pad == 0 && one_column(c, nd, k) == (cin * h * w * 4) as u64
}

/// Scratch of one pass of the CUDA conv2d op: one chunk of columns for the im2col op (see
/// `memtrain_kernels::conv2d_cuda`), none for cuDNN (its workspace is in `runtime_bytes`).
fn cuda_conv_scratch(c: &Ctx, nd: &Node, k: usize, pad: usize, pass: ConvPass) -> u64 {
    let (cin, h, w) = nd.inp;
    let (cout, ho, wo) = nd.out;
    let pointwise = k == 1 && pad == 0 && (h, w) == (ho, wo);
    memtrain_kernels::conv2d_cudnn::cuda_pass_scratch_bytes(
        pass,
        c.n as usize,
        cin,
        cout,
        k,
        ho,
        wo,
        pointwise,
        c.dtype,
    )
}

/// Bytes of the forward pass's scratch of a convolution on `n` images: one im2col column per busy
/// thread (none for an in-place 1x1 convolution) and, for half types, one widened input and one
/// widened output image per thread; plus the widened weights.
fn conv_fwd_scratch(c: &Ctx, nd: &Node, k: usize, pad: usize) -> u64 {
    let (cin, h, w) = nd.inp;
    let (cout, ho, wo) = nd.out;
    if !c.device.is_cpu() {
        return cuda_conv_scratch(c, nd, k, pad, ConvPass::Forward);
    }
    let col = if pointwise_in_place(c, nd, k, pad) {
        0
    } else {
        one_column(c, nd, k)
    };
    let widen = if c.half() {
        ((cin * h * w) + (cout * ho * wo)) as u64 * 4
    } else {
        0
    };
    let wbuf = if c.half() {
        (cout * cin * k * k) as u64 * 4
    } else {
        0
    };
    c.busy(c.n) * (col + widen) + wbuf
}

/// Scratch of the input-gradient pass: per busy thread one column (none for 1x1) and, for half
/// types, the widened output gradient and input images; plus the widened weights.
fn conv_dx_scratch(c: &Ctx, nd: &Node, k: usize, pad: usize) -> u64 {
    let (cin, h, w) = nd.inp;
    let (cout, ho, wo) = nd.out;
    if !c.device.is_cpu() {
        return cuda_conv_scratch(c, nd, k, pad, ConvPass::InputGrad);
    }
    let col = if k == 1 && pad == 0 {
        0
    } else {
        one_column(c, nd, k)
    };
    let widen = if c.half() {
        ((cin * h * w) + (cout * ho * wo)) as u64 * 4
    } else {
        0
    };
    let wbuf = if c.half() {
        (cout * cin * k * k) as u64 * 4
    } else {
        0
    };
    c.busy(c.n) * (col + widen) + wbuf
}

/// Images per weight-gradient chunk, as `images_per_chunk` in `kernels/src/conv2d_cpu.rs`.
fn wgrad_chunk(n: usize, hw_out: usize, per_image: usize, threads: usize) -> usize {
    use memtrain_kernels::conv2d::{IM2COL_CHUNK_BYTES, MIN_GEMM_DEPTH};
    let n = n.max(1);
    let threads = threads.max(1);
    let wanted = MIN_GEMM_DEPTH.div_ceil(hw_out.max(1));
    let by_budget = IM2COL_CHUNK_BYTES / threads / per_image.max(1);
    wanted.min(by_budget).min(n.div_ceil(threads)).max(1)
}

/// Weight-gradient slots per thread (`MIN_SLOTS_PER_THREAD` in `kernels/src/conv2d_cpu.rs`).
const WGRAD_SLOTS_PER_THREAD: usize = 4;

/// Peak scratch of the weight-gradient pass (columns, gathered gradients, widened images and the
/// partial sums) and the partial-sum buffers still alive when the result is allocated.
///
/// The batch is cut into chunks of images and the chunks into slots; each busy thread sums its
/// slot into a weight-sized f32 buffer, and the slots are added in order into a running total
/// whose spent buffers are reused: about one buffer per thread plus the total.
fn conv_wgrad_scratch(c: &Ctx, nd: &Node, k: usize, pad: usize) -> (u64, u64) {
    let (cin, h, w) = nd.inp;
    let (cout, ho, wo) = nd.out;
    let ckk = cin * k * k;
    if !c.device.is_cpu() {
        return (cuda_conv_scratch(c, nd, k, pad, ConvPass::WeightGrad), 0);
    }
    let n = c.n as usize;
    let threads = c.device.threads();
    let hwo = ho * wo;
    let chunk = wgrad_chunk(n, hwo, ckk * hwo * 4, threads);
    let n_chunks = n.div_ceil(chunk);
    let per_slot = n_chunks.div_ceil(WGRAD_SLOTS_PER_THREAD * threads).max(1);
    let slots = n_chunks.div_ceil(per_slot);
    let busy = if slots <= 1 { 1 } else { threads.min(slots) } as u64;
    let in_place = !c.half() && chunk == 1 && pointwise_in_place(c, nd, k, pad);
    let cols = if in_place {
        0
    } else {
        memtrain_kernels::conv2d::im2col_chunk_bytes(n, cin, k, ho, wo, c.dtype) as u64
    };
    let gathered = if !c.half() && chunk == 1 {
        0
    } else {
        (cout * chunk * hwo * 4) as u64
    };
    let widened = if c.half() {
        (cin * h * w * 4) as u64
    } else {
        0
    };
    let acc = (ckk * cout * 4) as u64;
    let buffers = slots.min(threads + 1) as u64;
    (
        cols + busy * (gathered + widened) + buffers * acc,
        buffers * acc,
    )
}

/// The transient scratch of a node's forward (the conv op's columns and widened images, the
/// depthwise op's padded planes, BatchNorm's per-plane partial sums).
fn fwd_scratch(c: &Ctx, nd: &Node) -> u64 {
    match nd.op {
        Op::Conv { k, pad } => conv_fwd_scratch(c, nd, k, pad),
        Op::Depthwise => {
            let (ch, h, w) = nd.inp;
            (ch * 9 * 4) as u64 + c.busy(c.n * ch as u64) * (((h + 2) * (w + 2) + w) * 4) as u64
        }
        _ => 0,
    }
}

/// The conv weight cast to the compute dtype (a copy only for half types).
fn weight_cast(c: &Ctx, nd: &Node) -> u64 {
    if c.half() {
        nd.params as u64 * c.s
    } else {
        0
    }
}

/// One conv-like node's forward on an input that stays alive: leaves its output alive.
fn conv_node_fwd(sim: &mut Sim, c: &Ctx, i: usize, nd: &Node) {
    let start = sim.mark();
    let cast = weight_cast(c, nd);
    sim.alloc(cast);
    sim.alloc(nd.out_bytes(c));
    sim.spike(fwd_scratch(c, nd));
    sim.free(cast);
    sim.record(i, start);
}

/// The f32 weight gradient of a node from one in the compute dtype, into the accumulator: the
/// first micro-batch keeps the buffer, later ones add it in place and drop it.
fn weight_grad(sim: &mut Sim, c: &Ctx, nd: &Node, acc_live: bool) {
    let wgrad = nd.params as u64 * c.s;
    if c.half() {
        sim.alloc(nd.params as u64 * 4);
        sim.free(wgrad);
    }
    if acc_live {
        sim.free(nd.params as u64 * 4);
    }
}

/// Weight gradient of a dense/pointwise conv node (input and output gradient alive).
fn conv_wgrad(sim: &mut Sim, c: &Ctx, i: usize, nd: &Node, acc_live: bool) {
    let Op::Conv { k, pad } = nd.op else { return };
    let start = sim.mark();
    let cast = weight_cast(c, nd);
    sim.alloc(cast);
    let (scratch, partials) = conv_wgrad_scratch(c, nd, k, pad);
    sim.spike(scratch);
    sim.alloc(partials);
    sim.alloc(nd.params as u64 * c.s);
    sim.free(partials);
    weight_grad(sim, c, nd, acc_live);
    sim.free(cast);
    sim.record(i, start);
}

/// Input gradient of a dense/pointwise conv node: leaves it alive.
fn conv_dgrad(sim: &mut Sim, c: &Ctx, i: usize, nd: &Node) {
    let Op::Conv { k, pad } = nd.op else { return };
    let start = sim.mark();
    let cast = weight_cast(c, nd);
    sim.alloc(cast);
    sim.alloc(nd.in_bytes(c));
    sim.spike(conv_dx_scratch(c, nd, k, pad));
    sim.free(cast);
    sim.record(i, start);
}

/// Scratch of the depthwise backward passes: per busy thread one padded plane and one plane.
fn depthwise_plane_scratch(c: &Ctx, nd: &Node) -> u64 {
    let (ch, h, w) = nd.inp;
    c.busy(c.n * ch as u64) * (((h + 2) * (w + 2) + h * w) * 4) as u64
}

/// Depthwise weight gradient (input and output gradient alive).
fn depthwise_wgrad(sim: &mut Sim, c: &Ctx, i: usize, nd: &Node, acc_live: bool) {
    let start = sim.mark();
    let cast = weight_cast(c, nd);
    sim.alloc(cast);
    let (ch, _, _) = nd.inp;
    let partial = c.n * (ch * 9 * 4) as u64;
    sim.alloc(partial);
    sim.spike(depthwise_plane_scratch(c, nd));
    sim.alloc(nd.params as u64 * c.s);
    sim.free(partial);
    weight_grad(sim, c, nd, acc_live);
    sim.free(cast);
    sim.record(i, start);
}

/// Depthwise input gradient: leaves it alive.
fn depthwise_dgrad(sim: &mut Sim, c: &Ctx, i: usize, nd: &Node) {
    let start = sim.mark();
    let cast = weight_cast(c, nd);
    sim.alloc(cast);
    sim.alloc(nd.in_bytes(c));
    sim.spike(depthwise_plane_scratch(c, nd));
    sim.free(cast);
    sim.record(i, start);
}

/// The nodes of one block: its conv nodes (one, or depthwise + pointwise), BatchNorm, pool.
struct BlockNodes {
    convs: Vec<usize>,
    bn: usize,
    pool: Option<usize>,
    name: String,
}

impl BlockNodes {
    fn separable(&self) -> bool {
        self.convs.len() == 2
    }
    /// Bytes of the block's conv output h.
    fn h_bytes(&self, c: &Ctx, nodes: &[Node]) -> u64 {
        nodes[self.bn].in_bytes(c)
    }
    /// Bytes of the block's output (after the pool when there is one).
    fn out_bytes(&self, c: &Ctx, nodes: &[Node]) -> u64 {
        nodes[self.pool.unwrap_or(self.bn)].out_bytes(c)
    }
    /// Bytes of the block's input.
    fn in_bytes(&self, c: &Ctx, nodes: &[Node]) -> u64 {
        nodes[self.convs[0]].in_bytes(c)
    }
    /// Bytes of the byte-per-element argmax of the pool (0 without one).
    fn argmax_bytes(&self, c: &Ctx, nodes: &[Node]) -> u64 {
        self.pool.map_or(0, |p| c.n * elems(nodes[p].out))
    }
    fn channels(&self, nodes: &[Node]) -> u64 {
        nodes[self.bn].out.0 as u64
    }
}

fn blocks_of(nodes: &[Node]) -> Vec<BlockNodes> {
    let head = nodes.len() - 1;
    let n_blocks = nodes[..head].iter().map(|n| n.block + 1).max().unwrap_or(0);
    (0..n_blocks)
        .map(|b| {
            let idx: Vec<usize> = (0..head).filter(|&i| nodes[i].block == b).collect();
            let convs = idx
                .iter()
                .copied()
                .filter(|&i| matches!(nodes[i].op, Op::Conv { .. } | Op::Depthwise))
                .collect();
            let bn = idx
                .iter()
                .copied()
                .find(|&i| nodes[i].op == Op::Bn)
                .unwrap_or(idx[0]);
            let pool = idx.iter().copied().find(|&i| nodes[i].op == Op::Pool);
            let name = nodes[bn]
                .name
                .rsplit_once('.')
                .map_or(nodes[bn].name.clone(), |(b, _)| b.to_string());
            BlockNodes {
                convs,
                bn,
                pool,
                name,
            }
        })
        .collect()
}

/// Per-plane partial sums of a BatchNorm reduction, then its `[2, C]` result (kept).
fn bn_reduce(sim: &mut Sim, c: &Ctx, b: &BlockNodes, nodes: &[Node]) {
    let ch = b.channels(nodes);
    sim.spike(c.n * ch * 16);
    sim.alloc(ch * 8);
}

/// The lean step's replay (`src/train/lean.rs`), event by event.
struct Lean<'a> {
    c: &'a Ctx,
    nodes: &'a [Node],
    blocks: Vec<BlockNodes>,
    acc_live: bool,
    /// Activation bytes held for the backward (as the tape counts them).
    saved: u64,
    /// The predicted events of the micro-batch: (phase, layer, peak since the previous event).
    events: Vec<EventPrediction>,
}

impl Lean<'_> {
    fn event(&mut self, sim: &mut Sim, phase: Phase, layer: String) {
        self.events.push(EventPrediction {
            phase: match phase {
                Phase::Forward => "forward",
                Phase::Backward => "backward",
                Phase::Optimizer => "optimizer",
            },
            layer,
            peak_bytes: sim.event_peak,
            current_bytes: sim.cur,
            saved_bytes: self.saved,
        });
        sim.event_peak = sim.cur;
    }

    /// A block's conv on an input that stays alive; leaves h alive.
    fn conv_fwd(&mut self, sim: &mut Sim, j: usize) {
        let b = &self.blocks[j];
        let (c, nodes) = (self.c, self.nodes);
        if b.separable() {
            let (dw, pw) = (b.convs[0], b.convs[1]);
            conv_node_fwd(sim, c, dw, &nodes[dw]);
            conv_node_fwd(sim, c, pw, &nodes[pw]);
            sim.free(nodes[dw].out_bytes(c));
        } else {
            conv_node_fwd(sim, c, b.convs[0], &nodes[b.convs[0]]);
        }
    }

    /// Block j's forward: the output is left alive; with `save` h (and its statistics) too.
    /// The block input is not freed here.
    fn block_fwd(&mut self, sim: &mut Sim, j: usize, save: bool) {
        self.block_fwd_out(sim, j, save, true)
    }

    /// [`Lean::block_fwd`]; with `save` and without `output` (the last block of a
    /// recomputation, whose output the first forward already used) only h is made.
    fn block_fwd_out(&mut self, sim: &mut Sim, j: usize, save: bool, output: bool) {
        let (c, nodes) = (self.c, self.nodes);
        self.conv_fwd(sim, j);
        let b = &self.blocks[j];
        let start = sim.mark();
        bn_reduce(sim, c, b, nodes);
        let (h, out) = (b.h_bytes(c, nodes), b.out_bytes(c, nodes));
        if save {
            if output {
                sim.alloc(out);
            }
            self.saved += h;
        } else if b.pool.is_some() {
            sim.alloc(out);
            sim.free(h + b.channels(nodes) * 8);
        } else {
            // Normalized in place: h becomes the output.
            sim.free(b.channels(nodes) * 8);
        }
        sim.record(b.bn, start);
    }

    /// Block j's BatchNorm (+ pool) backward from the gradient of its output (`g` bytes alive):
    /// leaves dh_j alive.
    fn bn_bwd(&mut self, sim: &mut Sim, j: usize, g: u64) {
        let (c, nodes) = (self.c, self.nodes);
        let b = &self.blocks[j];
        let h = b.h_bytes(c, nodes);
        let ch = b.channels(nodes);
        self.saved -= h;
        if b.pool.is_some() {
            let am = b.argmax_bytes(c, nodes);
            sim.alloc(am);
            bn_reduce(sim, c, b, nodes);
            // In place over h: dh_j; the pooled gradient, the argmax and the statistics go.
            sim.free(g + am + ch * 8);
        } else {
            bn_reduce(sim, c, b, nodes);
            // In place over g; h and the statistics go.
            sim.free(h + ch * 8);
        }
        self.acc_bn(sim, ch);
    }

    /// γ and β gradients are views of the `[2, C]` sums: kept as the accumulator's buffers by the
    /// first micro-batch, added in place and dropped by later ones.
    fn acc_bn(&self, sim: &mut Sim, ch: u64) {
        if self.acc_live {
            sim.free(ch * 8);
        }
    }

    /// Conv backward of block j with its input alive and dh_j (consumed); leaves dx when `dx`.
    fn conv_bwd(&mut self, sim: &mut Sim, j: usize, dx: bool) {
        let (c, nodes, acc) = (self.c, self.nodes, self.acc_live);
        let b = &self.blocks[j];
        let dh = b.h_bytes(c, nodes);
        if b.separable() {
            let (dw, pw) = (b.convs[0], b.convs[1]);
            conv_node_fwd(sim, c, dw, &nodes[dw]);
            conv_wgrad(sim, c, pw, &nodes[pw], acc);
            let d = nodes[dw].out_bytes(c);
            sim.free(d);
            conv_dgrad(sim, c, pw, &nodes[pw]);
            sim.free(dh);
            depthwise_wgrad(sim, c, dw, &nodes[dw], acc);
            if dx {
                depthwise_dgrad(sim, c, dw, &nodes[dw]);
            }
            sim.free(d);
        } else {
            let i = b.convs[0];
            conv_wgrad(sim, c, i, &nodes[i], acc);
            if dx {
                conv_dgrad(sim, c, i, &nodes[i]);
            }
            sim.free(dh);
        }
    }

    /// Block j's conv backward with block j-1's BatchNorm backward (`inner_backward`): dh_j alive
    /// on entry, dh_{j-1} alive on exit.
    fn inner_bwd(&mut self, sim: &mut Sim, j: usize) {
        let (c, nodes, acc) = (self.c, self.nodes, self.acc_live);
        let prev_h = self.blocks[j - 1].h_bytes(c, nodes);
        let ch = self.blocks[j - 1].channels(nodes);
        self.saved -= prev_h;
        if self.blocks[j - 1].pool.is_some() {
            let p = self.blocks[j].in_bytes(c, nodes);
            let am = self.blocks[j - 1].argmax_bytes(c, nodes);
            sim.alloc(p);
            sim.alloc(am);
            self.conv_bwd(sim, j, true);
            sim.free(p);
            bn_reduce(sim, c, &self.blocks[j - 1], nodes);
            // In place over h_{j-1}; dx (= p-sized), the argmax and the statistics go.
            sim.free(p + am + ch * 8);
            self.acc_bn(sim, ch);
            return;
        }
        let b = &self.blocks[j];
        let dh = b.h_bytes(c, nodes);
        if b.separable() {
            let (dw, pw) = (b.convs[0], b.convs[1]);
            sim.alloc(prev_h); // y, fresh
            conv_node_fwd(sim, c, dw, &nodes[dw]);
            sim.free(prev_h);
            conv_wgrad(sim, c, pw, &nodes[pw], acc);
            let d = nodes[dw].out_bytes(c);
            sim.free(d);
            conv_dgrad(sim, c, pw, &nodes[pw]);
            sim.free(dh);
            depthwise_dgrad(sim, c, dw, &nodes[dw]);
            bn_reduce(sim, c, &self.blocks[j - 1], nodes);
            sim.free(ch * 8);
            self.acc_bn(sim, ch);
            depthwise_wgrad(sim, c, dw, &nodes[dw], acc);
            sim.free(prev_h + d);
        } else {
            let i = b.convs[0];
            conv_dgrad(sim, c, i, &nodes[i]);
            bn_reduce(sim, c, &self.blocks[j - 1], nodes);
            sim.free(ch * 8);
            self.acc_bn(sim, ch);
            conv_wgrad(sim, c, i, &nodes[i], acc);
            sim.free(prev_h + dh);
        }
    }

    /// Segment `seg`'s backward from the gradient of its output (`g` bytes): leaves the input
    /// gradient alive when `dx`.
    fn segment_bwd(&mut self, sim: &mut Sim, seg: Range<usize>, g: u64, dx: bool) {
        self.bn_bwd(sim, seg.end - 1, g);
        let mut j = seg.end - 1;
        while j > seg.start {
            self.inner_bwd(sim, j);
            let name = self.blocks[j].name.clone();
            self.event(sim, Phase::Backward, name);
            j -= 1;
        }
        self.conv_bwd(sim, j, dx);
        let name = self.blocks[j].name.clone();
        self.event(sim, Phase::Backward, name);
    }
}

/// One predicted event of the step, matching the trainer's timeline events.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EventPrediction {
    /// `forward`, `backward` or `optimizer`.
    pub phase: &'static str,
    /// The layer, named as in the timeline (`stage1.block2`, `head`, `optimizer`, …).
    pub layer: String,
    /// Highest bytes in use between the previous event and this one.
    pub peak_bytes: u64,
    /// Bytes in use right after the event.
    pub current_bytes: u64,
    /// Activation bytes held for the backward at the event.
    pub saved_bytes: u64,
}

/// One micro-batch of the lean step: data, forward, backward, gradient accumulation. Returns
/// the activations saved at the end of the forward pass and the micro-batch's events.
fn micro_batch(
    sim: &mut Sim,
    c: &Ctx,
    nodes: &[Node],
    segments: &[Range<usize>],
    acc_live: bool,
) -> (u64, Vec<EventPrediction>) {
    let head = nodes.len() - 1;
    let mut l = Lean {
        c,
        nodes,
        blocks: blocks_of(nodes),
        acc_live,
        saved: 0,
        events: Vec::new(),
    };
    let one = segments.len() == 1;
    // The micro-batch as an f32 tensor (+ labels), and its copy in the compute dtype.
    let x32 = c.n * (IMAGE_BYTES as u64 * 4 + 4);
    sim.alloc(x32);
    let xin = if c.half() {
        c.n * IMAGE_BYTES as u64 * c.s
    } else {
        0
    };
    sim.alloc(xin);
    let xin_bytes = c.n * IMAGE_BYTES as u64 * c.s;

    // Forward.
    let mut cur_in = xin_bytes;
    // Whether the current input is held elsewhere (the data, or a segment input).
    let mut cur_is_input;
    let mut seg_inputs = Vec::new();
    for seg in segments {
        seg_inputs.push(cur_in);
        l.saved += cur_in;
        cur_is_input = true;
        for j in seg.clone() {
            l.block_fwd(sim, j, one);
            if !cur_is_input {
                sim.free(cur_in);
            }
            cur_in = l.blocks[j].out_bytes(c, nodes);
            cur_is_input = false;
            let name = l.blocks[j].name.clone();
            l.event(sim, Phase::Forward, name);
        }
    }
    // The last block's output is the next segment's... no: the head's input. For checkpointing,
    // segment outputs become the next segment's inputs (held in `seg_inputs`), so only the last
    // output is freed by the head.
    let saved_at_end = l.saved;
    let hd = &nodes[head];
    let feat = cur_in;
    let feat32 = c.n * elems(hd.inp) * 4;
    let start = sim.mark();
    if c.half() {
        sim.alloc(feat32);
        sim.free(feat);
    }
    let logits = hd.out_bytes(c);
    // matmul, bias add, loss (log-softmax, gather), softmax, one-hot, the gradient.
    sim.alloc(logits);
    sim.alloc(logits);
    sim.free(logits);
    sim.spike(6 * logits);
    sim.alloc(logits); // the gradient of the logits
    sim.free(logits); // the logits
    l.event(sim, Phase::Forward, "head".into());
    sim.phase = Phase::Backward;
    // Head backward: weight and bias gradients, then the feature gradient in the compute dtype.
    let wsize = hd.params.saturating_sub(NUM_CLASSES) as u64 * 4;
    sim.alloc(wsize + NUM_CLASSES as u64 * 4);
    if acc_live {
        sim.free(wsize + NUM_CLASSES as u64 * 4);
    }
    sim.free(feat32.max(feat)); // the f32 features
    sim.alloc(feat32);
    if c.half() {
        sim.alloc(feat);
        sim.free(feat32);
    }
    sim.free(logits);
    sim.record(head, start);
    l.event(sim, Phase::Backward, "head".into());
    let mut g = feat;

    // Backward, last segment first.
    let n_seg = segments.len();
    for (si, seg) in segments.iter().enumerate().rev() {
        let input = seg_inputs.pop().unwrap_or(0);
        if !one {
            for j in seg.clone() {
                l.block_fwd_out(sim, j, true, j + 1 < seg.end);
                if j > seg.start {
                    sim.free(l.blocks[j - 1].out_bytes(c, nodes));
                }
            }
            let name = format!("{} recompute", l.blocks[seg.start].name);
            l.event(sim, Phase::Backward, name);
        }
        let dx = si > 0;
        l.segment_bwd(sim, seg.clone(), g, dx);
        l.saved -= input;
        if si > 0 {
            sim.free(input);
        }
        g = if dx {
            l.blocks[seg.start].in_bytes(c, nodes)
        } else {
            0
        };
    }
    let _ = n_seg;
    // The micro-batch's data.
    sim.free(x32 + xin);
    (saved_at_end, l.events)
}
