//! Gradient checkpointing: what a segmentation recomputes, and which one `--checkpoint auto`
//! runs.
//!
//! A segmentation cuts the chain of blocks into segments ([`memtrain_core::model::cnn::segments`]); every
//! segment but the last keeps only its input in the forward and is re-run in the backward, so
//! the recomputed work is the forward of the blocks before the last boundary. On this uneven
//! chain (stage 1 holds most of the activation bytes and a small share of the FLOPs) the cheapest
//! segmentation for a budget is often none of the named ones: `segments:2` recomputes only stage 1.
//!
//! With six blocks there are 32 segmentations, so [`pick`] looks at every one (the estimate of
//! each runs one step's tape on sizes); a longer chain would want dynamic
//! programming over the boundaries instead. The choice is a pure function of the candidates'
//! predictions, the limit and the margin, so a test can check it against brute force.

use super::margin::{limit_for, usable_bytes};
use crate::config::{ActivationStorage, GradCheckpointing, Segmentation};
use crate::error::Error;
use memtrain_core::memory::format_bytes;
use memtrain_core::model::{LayerKind, LayerSpec, ModelConfig};
use memtrain_core::options::CNN_BLOCKS;
use std::ops::Range;

/// One plan, a segmentation and an activation storage, with its prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// The segmentation.
    pub checkpointing: Segmentation,
    /// How the blocks' conv outputs are kept.
    pub storage: ActivationStorage,
    /// Its predicted peak bytes.
    pub predicted_peak: u64,
    /// The FLOPs it recomputes per optimizer step ([`recompute_flops`]).
    pub recompute_flops: u64,
}

/// What `--checkpoint auto` (and `--compress-activations auto`) chose, and from what.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointChoice {
    /// The chosen plan with its prediction.
    pub chosen: Candidate,
    /// What `--memory-limit` leaves the estimate's peak, when given (on the CPU the heap budget
    /// under the process's limit).
    pub limit: Option<u64>,
    /// The margin kept free of the limit.
    pub margin: f64,
    /// Plans considered.
    pub considered: usize,
    /// Whether the segmentation was chosen (`--checkpoint auto`), and the storage
    /// (`--compress-activations auto`).
    pub chose_segmentation: bool,
    /// See `chose_segmentation`.
    pub chose_storage: bool,
    /// Seconds the estimates and the choice took.
    pub solve_secs: f64,
}

impl CheckpointChoice {
    /// One line for the start of a run: what was chosen (said first when it is lossy), its
    /// segments and recomputed FLOPs, why, and how long choosing took.
    pub fn describe(&self, blocks: usize) -> String {
        let c = &self.chosen;
        let plans = if self.chose_storage {
            "plans (segmentation and codes)"
        } else {
            "segmentations"
        };
        let rule = if self.chose_storage {
            "exact first, then the most bits, then the least recomputation"
        } else {
            "the least recomputation"
        };
        let why = match self.limit {
            Some(limit) => format!(
                "{rule} of {} {plans} whose predicted peak fits the {} that --memory-limit leaves the step's memory, less the estimate's {} error margin ({})",
                self.considered,
                format_bytes(limit),
                super::margin::percent(self.margin),
                format_bytes(usable_bytes(limit, self.margin))
            ),
            None => format!(
                "the smallest predicted peak of {}",
                named_list(GradCheckpointing::CONCRETE)
            ),
        };
        let flags = match (self.chose_segmentation, self.chose_storage) {
            (true, true) => "--checkpoint auto --compress-activations auto",
            (false, true) => "--compress-activations auto",
            _ => "--checkpoint auto",
        };
        // Both named when both were chosen, so `none` is never read as the codes'.
        let (segmentation, codes) = match (self.chose_storage, c.storage) {
            (false, _) => ("", String::new()),
            (true, ActivationStorage::None) => {
                ("segmentation ", ", activations none (exact)".to_string())
            }
            (true, s) => (
                "segmentation ",
                format!(", activations {s} (lossy: the gradients differ from the exact step's)"),
            ),
        };
        format!(
            "{flags}: {segmentation}{}{codes} (segments {}, recomputes {} per step; predicted peak {}): {why}; chosen in {:.0} ms",
            c.checkpointing,
            format_segments(&memtrain_core::model::cnn::segments(blocks, c.checkpointing)),
            format_flops(c.recompute_flops),
            format_bytes(c.predicted_peak),
            self.solve_secs * 1e3
        )
    }
}

/// `none, stages, blocks`.
fn named_list(v: &[GradCheckpointing]) -> String {
    v.iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Block ranges as `[0,2) [2,6)`.
pub fn format_segments(segments: &[Range<usize>]) -> String {
    segments
        .iter()
        .map(|r| format!("[{},{})", r.start, r.end))
        .collect::<Vec<_>>()
        .join(" ")
}

/// FLOPs with an SI prefix, e.g. `2.65 GFLOP`.
pub fn format_flops(f: u64) -> String {
    let f = f as f64;
    if f >= 1e9 {
        format!("{:.2} GFLOP", f / 1e9)
    } else if f >= 1e6 {
        format!("{:.2} MFLOP", f / 1e6)
    } else {
        format!("{f:.0} FLOP")
    }
}

/// FLOPs of one image's forward through `spec` counted as recomputed work: the multiply-adds of
/// the convolutions, two FLOPs each. BatchNorm, ReLU and pooling (a few FLOPs per element, under
/// 2% of a block's work at width 32) are left out, so two segmentations that re-run the same
/// convolutions count alike and the smaller predicted peak decides between them.
fn conv_flops_per_image(spec: &LayerSpec) -> u64 {
    let (c, h, w) = spec.output;
    let out = (c * h * w) as u64;
    match spec.kind {
        // Weights per output channel (C_in × k × k) = params / C_out.
        LayerKind::Conv { .. } => 2 * out * (spec.params / c.max(1)) as u64,
        // One 3×3 filter per channel.
        LayerKind::Depthwise => 2 * out * 9,
        _ => 0,
    }
}

/// The FLOPs `ckpt` recomputes in one optimizer step of `images` images (all micro-batches) of
/// `model`: the convolutions of every block before the last segment boundary, which the
/// backward re-runs.
pub fn recompute_flops(model: ModelConfig, ckpt: Segmentation, images: usize) -> u64 {
    let segs = memtrain_core::model::cnn::segments(CNN_BLOCKS, ckpt);
    let recomputed = segs.last().map_or(0, |s| s.start);
    let per_image: u64 = (model.layer_specs().iter())
        .filter(|s| s.kind != LayerKind::Linear && s.block < recomputed)
        .map(conv_flops_per_image)
        .sum();
    per_image * images as u64
}

/// The index of the candidate `--checkpoint auto` runs. Without a limit: the smallest predicted
/// peak. Under `limit`: of those whose predicted peak is at most [`usable_bytes`], the exact
/// storage first, then the most bits (int8, int4, int2), then the least recomputed FLOPs, then
/// the smaller peak, then the fewer segments; `None` when none fits. Ties beyond those go to the
/// earlier candidate.
pub fn pick(candidates: &[Candidate], limit: Option<u64>, margin: f64) -> Option<usize> {
    let segments = |c: &Candidate| c.checkpointing.boundaries().len();
    match limit {
        None => (0..candidates.len()).min_by_key(|&i| candidates[i].predicted_peak),
        Some(limit) => {
            let usable = usable_bytes(limit, margin);
            (0..candidates.len())
                .filter(|&i| candidates[i].predicted_peak <= usable)
                .min_by_key(|&i| {
                    let c = &candidates[i];
                    let rank = c.storage.loss_rank();
                    (rank, c.recompute_flops, c.predicted_peak, segments(c))
                })
        }
    }
}

/// The error for a `--memory-limit` that no segmentation fits, out of memory before anything ran
/// (a sweep records the point): the smallest predicted peak, the limit it needs with the margin,
/// and `advice`: what else would shrink the step.
/// `to_limit` turns a heap peak into the `--memory-limit` that holds it (on the CPU the limit
/// also holds what the process has outside its heap).
pub fn nothing_fits(
    candidates: &[Candidate],
    limit: u64,
    margin: f64,
    to_limit: &dyn Fn(u64) -> u64,
    advice: &str,
) -> Error {
    let smallest = candidates.iter().min_by_key(|c| c.predicted_peak);
    let Some(s) = smallest else {
        return Error::config("--checkpoint auto: no segmentation to choose from");
    };
    let storages = candidates.iter().any(|c| c.storage != s.storage);
    let segmentations = candidates
        .iter()
        .any(|c| c.checkpointing != s.checkpointing);
    let flags = match (segmentations, storages) {
        (true, true) => "--checkpoint auto --compress-activations auto",
        (false, true) => "--compress-activations auto",
        _ => "--checkpoint auto",
    };
    let (plans, what) = if storages {
        (
            "plan (segmentation and codes)",
            format!("{}, {}", s.checkpointing, s.storage),
        )
    } else {
        ("segmentation", s.checkpointing.to_string())
    };
    Error::Core(crate::error::CoreError::WontFit(format!(
        "{flags} --memory-limit {}: no {plans} of the {} fits; the smallest predicted peak is {} ({what}), which with the estimate's {} error margin needs --memory-limit {} or more{}; {advice}",
        format_bytes(limit),
        candidates.len(),
        format_bytes(s.predicted_peak),
        super::margin::percent(margin),
        format_bytes(to_limit(limit_for(s.predicted_peak, margin))),
        worse_together(candidates),
    )))
}

/// Where codes and checkpointing work against each other: for each lossy storage among the
/// candidates whose plain step (no segments) predicts less than every segmentation with it, a
/// clause saying so (`; with int8 codes every segmentation raises the predicted peak: none
/// 48.69 MiB, stages 52.30 MiB, blocks 60.41 MiB`).
fn worse_together(candidates: &[Candidate]) -> String {
    let mut out = String::new();
    for s in [
        ActivationStorage::Int8,
        ActivationStorage::Int4,
        ActivationStorage::Int2,
    ] {
        let with: Vec<&Candidate> = candidates.iter().filter(|c| c.storage == s).collect();
        let Some(plain) = with.iter().find(|c| c.checkpointing == Segmentation::NONE) else {
            continue;
        };
        let mut others = with
            .iter()
            .filter(|c| c.checkpointing != Segmentation::NONE)
            .peekable();
        if others.peek().is_some() && others.all(|c| c.predicted_peak > plain.predicted_peak) {
            // The named segmentations' peaks, in their order (none, stages, blocks).
            let named: Vec<String> = GradCheckpointing::CONCRETE
                .iter()
                .filter_map(|ck| {
                    let ck = ck.resolved().ok()?;
                    let c = with.iter().find(|c| c.checkpointing == ck)?;
                    Some(format!("{ck} {}", format_bytes(c.predicted_peak)))
                })
                .collect();
            out.push_str(&format!(
                "; with {s} codes every segmentation raises the predicted peak: {}",
                named.join(", ")
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pick_prefers_less_recomputation_then_the_smaller_peak() {
        // In MiB, where the margin is larger than MARGIN_FLOOR_BYTES.
        const M: u64 = 1 << 20;
        let c = |mask, predicted_peak: u64, recompute_flops| Candidate {
            checkpointing: Segmentation::from_cuts(mask),
            storage: ActivationStorage::None,
            predicted_peak: predicted_peak * M,
            recompute_flops,
        };
        let all = [
            c(0, 100, 0),
            c(0b10, 80, 5),
            c(0b11, 78, 5),
            c(0b11111, 70, 9),
        ];
        assert_eq!(
            pick(&all, None, 0.05),
            Some(3),
            "no limit: the smallest peak"
        );
        assert_eq!(pick(&all, Some(200 * M), 0.05), Some(0));
        // 100 does not fit 104 less 5% (98.8); 80 and 78 recompute alike: the smaller peak.
        assert_eq!(pick(&all, Some(104 * M), 0.05), Some(2));
        assert_eq!(pick(&all, Some(74 * M), 0.05), Some(3));
        assert_eq!(pick(&all, Some(73 * M), 0.05), None);
        let e = nothing_fits(&all, 73 * M, 0.05, &|h| h, "raise --memory-limit").to_string();
        assert!(
            e.contains("blocks") && e.contains("raise --memory-limit"),
            "{e}"
        );
    }
}
