//! `--checkpoint auto` for a run: the segmentation the trainer runs and its error when none fits
//! ([`choose_checkpointing`]), the check before anything is loaded, every segmentation's
//! prediction for a budget sweep ([`all_segmentations`]) and the smaller one to advise after running
//! out of memory. Built on the estimate of each candidate ([`segmentation_candidates`]) and the
//! pure choice among them ([`super::checkpointing::pick`]).

use super::baseline::{Baseline, DataSize};
use super::checkpointing::{nothing_fits, pick, Candidate, CheckpointChoice};
use super::estimate::{auto_candidates, estimate_with, segmentation_candidates};
use super::margin::{heap_limit, limit_for_heap, SAFETY_MARGIN};
use super::sim::DeviceKind;
use crate::config::{GradCheckpointing, TrainConfig};
use crate::error::Result;

/// What `--checkpoint auto` runs for `cfg` ([`super::checkpointing::pick`]): without a limit the smallest
/// predicted peak of none, stages and blocks; under `--memory-limit` the least recomputation of
/// every segmentation whose predicted peak fits with [`SAFETY_MARGIN`] kept free.
///
/// # Errors
/// As [`estimate_with`]; and when no segmentation fits the limit, a one-line message naming
/// the smallest predicted peak and the limit it needs.
pub fn choose_checkpointing(
    cfg: &TrainConfig,
    device: DeviceKind,
    baseline: Baseline,
) -> Result<CheckpointChoice> {
    let started = std::time::Instant::now();
    let candidates = auto_candidates(cfg, device, baseline)?;
    match pick(
        &candidates,
        heap_limit(cfg.memory.memory_limit, device),
        SAFETY_MARGIN,
    ) {
        Some(i) => Ok(CheckpointChoice {
            chosen: candidates[i],
            limit: heap_limit(cfg.memory.memory_limit, device),
            margin: SAFETY_MARGIN,
            considered: candidates.len(),
            chose_segmentation: cfg.memory.grad_checkpointing == GradCheckpointing::Auto,
            chose_storage: cfg.memory.compress_activations.fixed().is_none(),
            solve_secs: started.elapsed().as_secs_f64(),
        }),
        None => Err(nothing_fits(
            &candidates,
            cfg.memory.memory_limit.unwrap_or(0),
            SAFETY_MARGIN,
            &|heap| limit_for_heap(heap, device),
            &crate::advice::out_of_memory(cfg, false),
        )),
    }
}

/// For `--checkpoint auto` under `--memory-limit`: a usage error before anything is loaded when
/// no segmentation fits (the data set sized from its files); any other config passes. The
/// trainer chooses again with the loaded data.
///
/// # Errors
/// [`choose_checkpointing`]'s, or when the data directory cannot be sized.
pub fn check_auto_checkpointing(cfg: &TrainConfig) -> Result<()> {
    let auto = cfg.memory.grad_checkpointing == GradCheckpointing::Auto
        || cfg.memory.compress_activations.fixed().is_none();
    if !auto || cfg.memory.memory_limit.is_none() {
        return Ok(());
    }
    let device = DeviceKind::for_spec(cfg.device.as_deref())?;
    let data = DataSize::for_config(cfg)?;
    choose_checkpointing(cfg, device, Baseline::Modeled(data)).map(|_| ())
}

/// Every segmentation's prediction for `cfg`, on the device and with the data its flags name
/// (sized from the files, nothing loaded), `none` first: what a budget sweep spans.
///
/// # Errors
/// As [`estimate_with`], or when the device or the data directory is not usable.
pub fn all_segmentations(cfg: &TrainConfig) -> Result<Vec<Candidate>> {
    let device = DeviceKind::for_spec(cfg.device.as_deref())?;
    let data = DataSize::for_config(cfg)?;
    let mut all = cfg.clone();
    all.memory.memory_limit = Some(cfg.memory.memory_limit.unwrap_or(u64::MAX / 2));
    segmentation_candidates(&all, device, Baseline::Modeled(data))
}

/// The segmentation to advise a run of `cfg` whose step ran out of memory: under
/// `--memory-limit` the one `--checkpoint auto` would pick (or the smallest predicted peak among
/// those that fit), else the one with the smallest predicted peak; `None` when the estimate
/// fails, none fits the limit, or that is the run's own.
/// [`crate::advice::out_of_memory_with`] advises it only if it predicts less than the run's own.
pub(crate) fn smaller_checkpointing(
    cfg: &TrainConfig,
    device: DeviceKind,
    baseline: Baseline,
) -> Option<crate::advice::SmallerCheckpointing> {
    let current = estimate_with(cfg, device, baseline).ok()?.run_peak();
    let mut all = cfg.clone();
    all.memory.memory_limit = Some(cfg.memory.memory_limit.unwrap_or(u64::MAX / 2));
    let candidates = segmentation_candidates(&all, device, baseline).ok()?;
    let smaller = |c: &&Candidate| c.predicted_peak < current;
    let limit = heap_limit(cfg.memory.memory_limit, device);
    // Under a limit, only a segmentation predicted to fit it is advice.
    let fits = |c: &&Candidate| {
        limit.is_none_or(|l| c.predicted_peak <= super::margin::usable_bytes(l, SAFETY_MARGIN))
    };
    let chosen = pick(&candidates, limit, SAFETY_MARGIN)
        .map(|i| &candidates[i])
        .filter(smaller)
        .or_else(|| {
            candidates
                .iter()
                .filter(fits)
                .min_by_key(|c| c.predicted_peak)
        })
        .filter(smaller)?;
    (GradCheckpointing::from(chosen.checkpointing) != cfg.memory.grad_checkpointing).then_some(
        crate::advice::SmallerCheckpointing {
            checkpointing: chosen.checkpointing.into(),
            predicted_peak: chosen.predicted_peak,
            current_peak: current,
        },
    )
}
