//! Magnitude pruning as Keras' `prune_low_magnitude` does it with a `PolynomialDecay` schedule:
//! the schedule, the per-layer masks, applying them after every optimizer step, and the sparse
//! model file written at the end of a pruned run.
//!
//! - **Schedule** ([`Schedule`]): after `t` optimizer steps the target sparsity is
//!   `s(t) = final + (initial − final)·(1 − p)^3` with `p = (t − begin)/(end − begin)` clipped to
//!   [0, 1], so it is `initial` up to `begin` and `final` from `end` on. The masks are recomputed
//!   after step `t` when `begin ≤ t ≤ end` and `(t − begin)` is a multiple of `every`, and once
//!   more at `end` (so the run reaches `final` exactly even when `every` does not divide the span).
//! - **What is pruned**: the weights of the convolutions (3×3, depthwise and pointwise) and of the
//!   linear head ([`is_pruned`]); biases and BatchNorm parameters stay dense. Each layer is pruned
//!   to the same sparsity on its own (Keras' per-layer magnitude threshold): the
//!   `round(s·n)` weights of smallest |w| are zeroed, ties broken by the lower flat index.
//! - **Keeping them zero**: after every optimizer step the masks are applied again, since the
//!   update (momentum, weight decay) moves pruned weights away from 0; the optimizer state of a
//!   pruned weight is zeroed too, so no momentum is kept for a weight that no longer exists and a
//!   snapshot's state is the state of the pruned model. The schedule only grows the sparsity
//!   (`initial ≤ final`), and a pruned weight is exactly 0, the smallest magnitude, so a
//!   recomputed mask keeps every weight pruned before.
//! - **Memory**: a mask is one byte per pruned weight (`DType::U8`), allocated with the trainer
//!   and counted by the memory estimate (`pruning masks`). The threshold is found on the host
//!   (one layer's weights and a sort key per weight at a time), the masks are applied with Candle
//!   ops on the parameters' device.
//! - **Sparse file** ([`save_sparse`], [`load_sparse`]): for each pruned weight `W` the file holds
//!   `W.shape` (u32 dims), `W.values` (the f32 values that are not +0.0, in flat order) and the
//!   positions of those values as either `W.bitmask` (u8, one bit per weight, bit `i % 8` of byte
//!   `i / 8`) or `W.indices` (u32 flat indices), whichever is smaller: the bitmask below about
//!   97% sparsity (n/8 bytes against 4 bytes per kept weight). Every other tensor is stored dense.

use crate::config::TrainConfig;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor, Var};
use memtrain_core::model::Cnn;
use memtrain_core::step::optim::Optimizer;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

/// Exponent of the polynomial decay (Keras' `PolynomialDecay` default).
pub const POWER: f64 = 3.0;
/// The final dense model of a pruned run, in the run directory (parameters and BatchNorm
/// statistics, as a snapshot's `model.safetensors`).
pub const DENSE_MODEL_FILE: &str = "model.safetensors";
/// The same model in the sparse form of [`save_sparse`], in the run directory.
pub const SPARSE_MODEL_FILE: &str = "model-sparse.safetensors";

/// Whether the parameter `name` (as in [`memtrain_core::model::Cnn::named_vars`]) is pruned: the weight
/// of a convolution or of the head, not a bias or a BatchNorm parameter.
pub fn is_pruned(name: &str) -> bool {
    name == "head.weight"
        || [".conv.weight", ".dw.weight", ".pw.weight"]
            .iter()
            .any(|s| name.ends_with(s))
}

/// The pruning schedule of a run (polynomial decay of the dense fraction, Keras' defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    /// Sparsity at and before `begin`.
    pub initial: f64,
    /// Sparsity at and after `end` (`--prune`).
    pub target: f64,
    /// First step of the schedule.
    pub begin: usize,
    /// Step at which `target` is reached.
    pub end: usize,
    /// Masks are recomputed every this many steps within [begin, end].
    pub every: usize,
    /// Exponent of the decay.
    pub power: f64,
}

/// The default `--prune-end` of a run of `total_steps` that starts pruning at `begin`: three
/// quarters of the way to the last step, leaving the rest (at least one step when the run has
/// two or more after `begin`) to fine-tune the final masks.
pub fn default_end(begin: usize, total_steps: usize) -> usize {
    let span = total_steps.saturating_sub(begin);
    if span < 2 {
        return total_steps;
    }
    (begin + span * 3 / 4).clamp(begin + 1, total_steps - 1)
}

impl Schedule {
    /// The schedule of `cfg` for a run of `total_steps` optimizer steps; `None` without `--prune`.
    /// `--prune-end` defaults to [`default_end`]: three quarters of the way from the begin step to
    /// the run's last step, so the last quarter fine-tunes the final masks (an end at the last
    /// step would apply its biggest cut after the last update, and a short run would end there,
    /// untrained). An end past the last step is refused rather than clamped: the run would stop
    /// short of the sparsity asked for.
    ///
    /// # Errors
    /// [`CoreError::Config`](crate::error::CoreError::Config) when the end is past the run or not after the begin step.
    pub fn for_run(cfg: &TrainConfig, total_steps: usize) -> Result<Option<Schedule>> {
        let Some(target) = cfg.pruning.prune else {
            return Ok(None);
        };
        let end = cfg
            .pruning
            .prune_end
            .unwrap_or_else(|| default_end(cfg.pruning.prune_begin, total_steps));
        if end > total_steps {
            return Err(Error::config(format!(
                "--prune-end {end} is past the run's last step {total_steps} (--epochs x steps per epoch, capped by --max-steps); lower --prune-end or train longer"
            )));
        }
        if cfg.pruning.prune_begin >= end {
            return Err(Error::config(format!(
                "--prune-begin {} is not before the schedule's end, step {end} (--prune-end, default: the run's last step); lower --prune-begin or train longer",
                cfg.pruning.prune_begin
            )));
        }
        Ok(Some(Schedule {
            initial: cfg.pruning.prune_initial,
            target,
            begin: cfg.pruning.prune_begin,
            end,
            every: cfg.pruning.prune_every,
            power: POWER,
        }))
    }

    /// The sparsity the schedule asks for after `step` optimizer steps.
    pub fn sparsity(&self, step: usize) -> f64 {
        let span = (self.end - self.begin).max(1) as f64;
        let p = (step as f64 - self.begin as f64) / span;
        // The ends exactly (the formula at p = 0 can be off in the last bit).
        if p <= 0.0 {
            self.initial
        } else if p >= 1.0 {
            self.target
        } else {
            self.target + (self.initial - self.target) * (1.0 - p).powf(self.power)
        }
    }

    /// Whether the masks are recomputed after `step` optimizer steps.
    pub fn updates_at(&self, step: usize) -> bool {
        (self.begin..=self.end).contains(&step)
            && ((step - self.begin).is_multiple_of(self.every) || step == self.end)
    }
}

/// How many of `n` weights a layer pruned to `sparsity` has zeroed: `round(sparsity · n)`.
pub fn zeros_for(sparsity: f64, n: usize) -> usize {
    ((sparsity * n as f64).round() as usize).min(n)
}

/// The mask (1 = kept, 0 = pruned) that zeroes the `zeros` weights of smallest magnitude,
/// ties broken by the lower flat index.
pub fn magnitude_mask(weights: &[f32], zeros: usize) -> Vec<u8> {
    magnitude_mask_after(weights, &[], zeros)
}

/// [`magnitude_mask`] after an earlier mask `before` (1 = kept, 0 = pruned; empty: none): the
/// weights it pruned go first, so a recomputed mask of at least as many zeros prunes every one of
/// them again, whatever their magnitudes and ties.
pub(crate) fn magnitude_mask_after(weights: &[f32], before: &[u8], zeros: usize) -> Vec<u8> {
    let mut mask = vec![1u8; weights.len()];
    let zeros = zeros.min(weights.len());
    if zeros == 0 {
        return mask;
    }
    // |w| as bits orders like |w| for finite values; the index makes every key unique, so the
    // selected set does not depend on the selection algorithm.
    // Bit 63 (free: |w|'s bits are at most 31 wide) puts the weights pruned before first.
    let kept_before = |i: usize| u64::from(before.get(i).is_none_or(|&m| m != 0));
    let mut keys: Vec<u64> = weights
        .iter()
        .enumerate()
        .map(|(i, w)| (kept_before(i) << 63) | (u64::from(w.abs().to_bits()) << 32) | i as u64)
        .collect();
    if zeros < keys.len() {
        keys.select_nth_unstable(zeros);
    }
    for k in &keys[..zeros] {
        mask[(k & 0xFFFF_FFFF) as usize] = 0;
    }
    mask
}

/// One pruned parameter and its mask.
struct Masked {
    /// Index into the trainer's parameter list.
    index: usize,
    /// Parameter name.
    name: String,
    /// u8 mask of the parameter's shape, on its device.
    mask: Tensor,
    /// Zeros in `mask`.
    zeros: usize,
}

/// The pruning state of a run: the schedule and one mask per pruned parameter.
pub struct Pruner {
    schedule: Schedule,
    layers: Vec<Masked>,
}

impl Pruner {
    /// All-ones masks for the pruned parameters among `named_vars` (the trainer's parameter
    /// list, in its order), on their device.
    pub fn new(schedule: Schedule, named_vars: &[(String, Var)]) -> Result<Self> {
        let mut layers = Vec::new();
        for (index, (name, var)) in named_vars.iter().enumerate() {
            if is_pruned(name) {
                layers.push(Masked {
                    index,
                    name: name.clone(),
                    mask: Tensor::ones(var.shape(), DType::U8, var.device())?,
                    zeros: 0,
                });
            }
        }
        Ok(Pruner { schedule, layers })
    }

    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Bytes of the masks (one per pruned weight).
    pub fn mask_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.mask.elem_count() as u64).sum()
    }

    /// The trainer's one call, after optimizer step number `step` (counting from 1): recompute
    /// the masks when the schedule says so, then apply them to the parameters and zero the
    /// optimizer state of the pruned weights.
    pub(crate) fn after_step(
        &mut self,
        step: usize,
        model: &Cnn,
        optimizer: &mut Optimizer,
    ) -> Result<()> {
        if self.schedule.updates_at(step) {
            self.update_masks(self.schedule.sparsity(step), model)?;
        }
        self.apply(model, optimizer)
    }

    /// Recompute every mask for `sparsity` from the parameters' magnitudes. A mask never prunes
    /// fewer weights than it did, and keeps every weight it pruned pruned: a schedule that asks
    /// for less (a resumed run whose longer length moved the schedule's default end) revives
    /// nothing.
    pub(crate) fn update_masks(&mut self, sparsity: f64, model: &Cnn) -> Result<()> {
        for l in &mut self.layers {
            let var = model.var(l.index);
            let w = var.as_detached_tensor().flatten_all()?.to_vec1::<f32>()?;
            let before = l.mask.flatten_all()?.to_vec1::<u8>()?;
            let zeros = zeros_for(sparsity, w.len()).max(l.zeros);
            let mask = magnitude_mask_after(&w, &before, zeros);
            drop(w);
            l.mask = Tensor::from_vec(mask, var.shape(), var.device())?;
            l.zeros = zeros;
        }
        Ok(())
    }

    /// Zero the pruned weights (as +0.0) and their optimizer state.
    pub fn apply(&self, model: &Cnn, optimizer: &mut Optimizer) -> Result<()> {
        for l in self.layers.iter().filter(|l| l.zeros > 0) {
            let var = model.var(l.index);
            let w = var.as_detached_tensor();
            var.set(&l.mask.where_cond(&w, &w.zeros_like()?)?)?;
            optimizer.mask_state(l.index, &l.mask)?;
        }
        Ok(())
    }

    /// The masks by parameter name (for snapshots).
    pub fn masks(&self) -> Vec<(String, Tensor)> {
        self.layers
            .iter()
            .map(|l| (l.name.clone(), l.mask.clone()))
            .collect()
    }

    /// Restore masks saved by [`Pruner::masks`]: every pruned parameter's mask, u8, of its shape.
    ///
    /// # Errors
    /// [`Error::Snapshot`] naming a missing, unknown or misshapen mask.
    pub(crate) fn load_masks(&mut self, mut named: HashMap<String, Tensor>) -> Result<()> {
        let mut loaded = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let t = named
                .remove(&l.name)
                .ok_or_else(|| Error::Snapshot(format!("no pruning mask for '{}'", l.name)))?;
            if t.dtype() != DType::U8 || t.shape() != l.mask.shape() {
                return Err(Error::Snapshot(format!(
                    "pruning mask '{}' is {:?} {:?}, the parameter needs {:?} U8",
                    l.name,
                    t.dtype(),
                    t.shape(),
                    l.mask.shape()
                )));
            }
            let zeros = t
                .flatten_all()?
                .to_vec1::<u8>()?
                .iter()
                .filter(|&&m| m == 0)
                .count();
            loaded.push((t.to_device(l.mask.device())?, zeros));
        }
        if let Some(name) = named.keys().next() {
            return Err(Error::Snapshot(format!(
                "a pruning mask for '{name}', which is not a pruned parameter"
            )));
        }
        for (l, (mask, zeros)) in self.layers.iter_mut().zip(loaded) {
            l.mask = mask;
            l.zeros = zeros;
        }
        Ok(())
    }

    /// Check loaded masks against the run they belong to: after `step` optimizer steps each
    /// mask prunes at least what the schedule's last update asked for, and every weight it prunes
    /// is zero in `weights` (the saved parameters by name), as pruning leaves it. An edited mask
    /// (all ones, all zeros, inverted) fails one of the two.
    pub(crate) fn check_masks(&self, step: usize, weights: &HashMap<String, Tensor>) -> Result<()> {
        let last_update = (0..=step.min(self.schedule.end))
            .rev()
            .find(|&u| self.schedule.updates_at(u));
        for l in &self.layers {
            let mask = l.mask.flatten_all()?.to_vec1::<u8>()?;
            let expected =
                last_update.map_or(0, |u| zeros_for(self.schedule.sparsity(u), mask.len()));
            if l.zeros < expected {
                return Err(Error::Snapshot(format!(
                    "the pruning mask of '{}' prunes {} of {} weights where the schedule had pruned \
                     {expected} by step {step} (the masks were altered); resume an older snapshot or \
                     start again",
                    l.name,
                    l.zeros,
                    mask.len()
                )));
            }
            let w = weights
                .get(&l.name)
                .ok_or_else(|| Error::Snapshot(format!("no saved weights for '{}'", l.name)))?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let live = mask
                .iter()
                .zip(&w)
                .filter(|(&m, &v)| m == 0 && v != 0.0)
                .count();
            if live > 0 {
                return Err(Error::Snapshot(format!(
                    "the pruning mask of '{}' prunes {live} weights that are not zero in the saved \
                     model (the masks were altered); resume an older snapshot or start again",
                    l.name
                )));
            }
        }
        Ok(())
    }

    /// Reached sparsity per pruned parameter and overall, counted from the weights themselves.
    pub fn report(&self, model: &Cnn) -> Result<PruneReport> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let w = model
                .var(l.index)
                .as_detached_tensor()
                .flatten_all()?
                .to_vec1::<f32>()?;
            let zeros = w.iter().filter(|v| **v == 0.0).count();
            layers.push(LayerSparsity {
                name: l.name.clone(),
                weights: w.len(),
                zeros,
                sparsity: zeros as f64 / w.len().max(1) as f64,
                encoding: None,
            });
        }
        let weights: usize = layers.iter().map(|l| l.weights).sum();
        let zeros: usize = layers.iter().map(|l| l.zeros).sum();
        Ok(PruneReport {
            target: self.schedule.target,
            reached: zeros as f64 / weights.max(1) as f64,
            schedule: self.schedule,
            mask_bytes: self.mask_bytes(),
            layers,
            dense_file_bytes: None,
            sparse_file_bytes: None,
        })
    }
}

/// Reached sparsity of one pruned parameter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerSparsity {
    /// Parameter name, e.g. `stage1.block1.conv.weight`.
    pub name: String,
    /// Weights in the parameter.
    pub weights: usize,
    /// Weights that are exactly 0.
    pub zeros: usize,
    /// `zeros / weights`.
    pub sparsity: f64,
    /// How the sparse file stores the positions of the kept weights (`bitmask` or `indices`);
    /// `None` when no sparse file was written.
    pub encoding: Option<IndexEncoding>,
}

/// The `pruning` section of `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PruneReport {
    /// Target (final) sparsity, `--prune`.
    pub target: f64,
    /// Reached sparsity over all pruned weights.
    pub reached: f64,
    /// The schedule the run used (its end resolved).
    pub schedule: Schedule,
    /// Bytes of the masks held during training.
    pub mask_bytes: u64,
    /// Per pruned parameter.
    pub layers: Vec<LayerSparsity>,
    /// Size of [`DENSE_MODEL_FILE`] in the run directory, when written.
    pub dense_file_bytes: Option<u64>,
    /// Size of [`SPARSE_MODEL_FILE`] in the run directory, when written.
    pub sparse_file_bytes: Option<u64>,
}

impl PruneReport {
    /// The end-of-run lines: reached sparsity overall and per layer, the file sizes.
    pub fn render(&self) -> String {
        use memtrain_core::memory::format_bytes;
        let mut s = format!(
            "pruning: target sparsity {:.2}, reached {:.4} over {} layers (masks {}); schedule steps {}..{} every {}\n",
            self.target,
            self.reached,
            self.layers.len(),
            format_bytes(self.mask_bytes),
            self.schedule.begin,
            self.schedule.end,
            self.schedule.every
        );
        for l in &self.layers {
            s.push_str(&format!(
                "  {:<28} {:>8} weights {:>8} zeros  sparsity {:.4}{}\n",
                l.name,
                l.weights,
                l.zeros,
                l.sparsity,
                l.encoding.map(|e| format!("  ({e})")).unwrap_or_default()
            ));
        }
        if let (Some(d), Some(sp)) = (self.dense_file_bytes, self.sparse_file_bytes) {
            s.push_str(&format!(
                "model file: dense {DENSE_MODEL_FILE} {} | sparse {SPARSE_MODEL_FILE} {} ({:.1}% of dense)\n",
                format_bytes(d),
                format_bytes(sp),
                sp as f64 / d.max(1) as f64 * 100.0
            ));
        }
        s
    }
}

/// How a sparse tensor's kept positions are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexEncoding {
    /// One bit per weight (`W.bitmask`, u8).
    Bitmask,
    /// One u32 flat index per kept weight (`W.indices`).
    Indices,
}

impl std::fmt::Display for IndexEncoding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IndexEncoding::Bitmask => "bitmask",
            IndexEncoding::Indices => "indices",
        })
    }
}

/// Suffixes of the tensors of one sparse weight in the file.
const SHAPE: &str = ".shape";
const VALUES: &str = ".values";
const BITMASK: &str = ".bitmask";
const INDICES: &str = ".indices";

/// The sparse form of one f32 tensor: shape, kept values, kept positions (the smaller encoding).
fn encode(name: &str, t: &Tensor, out: &mut HashMap<String, Tensor>) -> Result<IndexEncoding> {
    let dims: Vec<u32> = t.dims().iter().map(|&d| d as u32).collect();
    let w = t.flatten_all()?.to_vec1::<f32>()?;
    if u32::try_from(w.len()).is_err() {
        return Err(Error::config(format!(
            "{name}: too many weights for u32 indices"
        )));
    }
    // Not +0.0: a -0.0 is kept as a value so the expansion is exact to the bit.
    let kept: Vec<usize> = (0..w.len()).filter(|&i| w[i].to_bits() != 0).collect();
    let values: Vec<f32> = kept.iter().map(|&i| w[i]).collect();
    let cpu = &Device::Cpu;
    let rank = dims.len();
    out.insert(format!("{name}{SHAPE}"), Tensor::from_vec(dims, rank, cpu)?);
    out.insert(
        format!("{name}{VALUES}"),
        Tensor::from_vec(values, kept.len(), cpu)?,
    );
    let bitmask_bytes = w.len().div_ceil(8);
    if bitmask_bytes <= 4 * kept.len() {
        let mut bits = vec![0u8; bitmask_bytes];
        for &i in &kept {
            bits[i / 8] |= 1 << (i % 8);
        }
        out.insert(
            format!("{name}{BITMASK}"),
            Tensor::from_vec(bits, bitmask_bytes, cpu)?,
        );
        Ok(IndexEncoding::Bitmask)
    } else {
        let idx: Vec<u32> = kept.iter().map(|&i| i as u32).collect();
        out.insert(
            format!("{name}{INDICES}"),
            Tensor::from_vec(idx, kept.len(), cpu)?,
        );
        Ok(IndexEncoding::Indices)
    }
}

/// Write `tensors` to `path` atomically, the [`is_pruned`] f32 ones in sparse form (see the
/// module docs) and the rest dense. Returns the file's size and each sparse tensor's encoding.
pub fn save_sparse(
    path: &Path,
    tensors: &[(String, Tensor)],
) -> Result<(u64, Vec<(String, IndexEncoding)>)> {
    let mut out = HashMap::new();
    let mut encodings = Vec::new();
    for (name, t) in tensors {
        let t = t.to_device(&Device::Cpu)?;
        if is_pruned(name) && t.dtype() == DType::F32 {
            encodings.push((name.clone(), encode(name, &t, &mut out)?));
        } else {
            out.insert(name.clone(), t);
        }
    }
    save_atomic(path, &out)?;
    Ok((file_size(path)?, encodings))
}

/// Write named tensors as safetensors at `path`, atomically.
pub(crate) fn save_atomic(path: &Path, tensors: &HashMap<String, Tensor>) -> Result<()> {
    crate::io::write_atomic_with(path, |tmp| {
        // A failed write (a full disk, a missing directory) is an I/O error of the run, never a
        // usage error.
        candle_core::safetensors::save(tensors, tmp).map_err(|e| match e {
            candle_core::Error::Io(io) => Error::io(path, io),
            other => Error::io(path, std::io::Error::other(other.to_string())),
        })
    })
}

/// Size of a file in bytes.
pub(crate) fn file_size(path: &Path) -> Result<u64> {
    Ok(std::fs::metadata(path)
        .map_err(|e| Error::io(path, e))?
        .len())
}

/// Read a file written by [`save_sparse`] and expand it: every tensor dense, by name, on `device`.
///
/// # Errors
/// [`Error::Data`] when the file is not a sparse model file (a sparse tensor without its values
/// or positions, positions out of range, a count that does not match).
pub fn load_sparse(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let bad = |msg: String| Error::Data {
        path: path.to_path_buf(),
        msg,
    };
    let mut raw = candle_core::safetensors::load(path, &Device::Cpu)
        .map_err(|e| bad(format!("not a safetensors file ({e})")))?;
    let sparse: Vec<String> = raw
        .keys()
        .filter_map(|k| k.strip_suffix(SHAPE).map(str::to_string))
        .collect();
    let mut out = HashMap::new();
    for name in sparse {
        let mut take = |suffix: &str| raw.remove(&format!("{name}{suffix}"));
        let dims: Vec<usize> = take(SHAPE)
            .ok_or_else(|| bad(format!("{name}: no shape")))?
            .to_vec1::<u32>()?
            .into_iter()
            .map(|d| d as usize)
            .collect();
        let values = take(VALUES)
            .ok_or_else(|| bad(format!("{name}: no values")))?
            .to_vec1::<f32>()?;
        let n: usize = dims.iter().product();
        let positions: Vec<usize> = match (take(BITMASK), take(INDICES)) {
            (Some(bits), None) => {
                let bits = bits.to_vec1::<u8>()?;
                if bits.len() != n.div_ceil(8) {
                    return Err(bad(format!(
                        "{name}: bitmask of {} bytes for {n} weights",
                        bits.len()
                    )));
                }
                (0..n)
                    .filter(|&i| bits[i / 8] >> (i % 8) & 1 == 1)
                    .collect()
            }
            (None, Some(idx)) => idx
                .to_vec1::<u32>()?
                .into_iter()
                .map(|i| i as usize)
                .collect(),
            _ => {
                return Err(bad(format!(
                    "{name}: needs exactly one of bitmask and indices"
                )))
            }
        };
        if positions.len() != values.len() || positions.iter().any(|&i| i >= n) {
            return Err(bad(format!(
                "{name}: {} positions for {} values of {n} weights",
                positions.len(),
                values.len()
            )));
        }
        let mut dense = vec![0f32; n];
        for (&i, &v) in positions.iter().zip(&values) {
            dense[i] = v;
        }
        out.insert(name, Tensor::from_vec(dense, dims, device)?);
    }
    for (name, t) in raw {
        out.insert(name, t.to_device(device)?);
    }
    Ok(out)
}

impl super::Trainer {
    /// The reached sparsity of a `--prune` run; at the end of a completed run that writes files,
    /// also the final model dense and sparse in the run directory, with their sizes.
    pub(super) fn finish_pruning(&self, interrupted: bool) -> Result<Option<PruneReport>> {
        let Some(pruner) = &self.pruner else {
            return Ok(None);
        };
        let mut report = pruner.report(&self.model)?;
        if self.files.log_files && !interrupted {
            let tensors: Vec<(String, Tensor)> = self
                .model
                .named_vars()
                .into_iter()
                .map(|(n, v)| (n, v.as_detached_tensor()))
                .chain(self.model.named_buffers())
                .collect();
            let dense_path = self.files.run_dir.join(DENSE_MODEL_FILE);
            let dense = tensors
                .iter()
                .map(|(n, t)| Ok((n.clone(), t.to_device(&Device::Cpu)?)))
                .collect::<Result<std::collections::HashMap<_, _>>>()?;
            save_atomic(&dense_path, &dense)?;
            drop(dense);
            let (sparse_bytes, encodings) =
                save_sparse(&self.files.run_dir.join(SPARSE_MODEL_FILE), &tensors)?;
            for layer in &mut report.layers {
                layer.encoding = encodings
                    .iter()
                    .find(|(n, _)| *n == layer.name)
                    .map(|(_, e)| *e);
            }
            report.dense_file_bytes = Some(file_size(&dense_path)?);
            report.sparse_file_bytes = Some(sparse_bytes);
        }
        Ok(Some(report))
    }
}
