//! What to do when a step does not fit its memory: advice true for the configuration at hand,
//! never a flag it already uses, one that cannot help in the phase that ran out, or a
//! segmentation the estimate predicts to be no smaller.

use crate::config::{GradCheckpointing, OptimizerKind, Precision, TrainConfig};
use memtrain_core::memory::format_bytes;

/// A segmentation the estimate predicts to need less memory than the run's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SmallerCheckpointing {
    /// The segmentation to advise.
    pub(crate) checkpointing: GradCheckpointing,
    /// Its predicted peak bytes.
    pub(crate) predicted_peak: u64,
    /// The predicted peak of the run's own segmentation.
    pub(crate) current_peak: u64,
}

/// The fixes for a step of `cfg` that needed more memory than it had, in the order to try them,
/// without any checkpointing advice (where no estimate of the other segmentations is at hand).
pub(crate) fn out_of_memory(cfg: &TrainConfig, in_update: bool) -> String {
    out_of_memory_with(cfg, in_update, None)
}

/// As [`out_of_memory`], with `smaller`, a segmentation predicted to need less memory than the
/// run's: advised only when it differs from the run's and its predicted peak is below the run's.
/// `in_update`: it ran out in the optimizer phase, where parameters, gradients and optimizer
/// state are alive but no activation is, so only the optimizer or the model can help.
pub(crate) fn out_of_memory_with(
    cfg: &TrainConfig,
    in_update: bool,
    smaller: Option<SmallerCheckpointing>,
) -> String {
    let mut fixes: Vec<String> = Vec::new();
    if in_update {
        if cfg.optimizer.kind == OptimizerKind::Adamw {
            fixes.push(
                "use --optimizer sgd (one state tensor per parameter, AdamW keeps two)".into(),
            );
        }
        if cfg.model.width > 1 {
            fixes.push("lower --width".into());
        }
    } else {
        if cfg.micro_batch() > 1 {
            fixes.push("lower --batch-size".into());
            fixes.push("raise --accum-steps (smaller micro-batches, the same batch)".into());
        }
        if let Some(s) = smaller.filter(|s| {
            s.checkpointing != cfg.memory.grad_checkpointing && s.predicted_peak < s.current_peak
        }) {
            fixes.push(format!(
                "use --checkpoint {} (predicted peak {}, against {} with {})",
                s.checkpointing,
                format_bytes(s.predicted_peak),
                format_bytes(s.current_peak),
                cfg.memory.grad_checkpointing
            ));
        }
        if cfg.memory.precision == Precision::F32 {
            fixes.push("use --precision bf16 (or f16)".into());
        }
    }
    if cfg.memory.memory_limit.is_some() {
        fixes.push("raise --memory-limit".into());
    }
    if fixes.is_empty() {
        return "this configuration is the smallest memtrain can train here: lower --width, or \
                use a device with more memory"
            .into();
    }
    fixes.join(", or ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advice_never_names_what_the_run_already_uses() {
        let mut cfg = TrainConfig::default();
        cfg.memory.precision = Precision::Bf16;
        cfg.memory.grad_checkpointing = GradCheckpointing::Blocks;
        cfg.memory.memory_limit = Some(1 << 20);
        let a = out_of_memory(&cfg, false);
        assert!(
            !a.contains("--checkpoint") && !a.contains("--precision"),
            "{a}"
        );
        assert!(
            a.contains("--batch-size") && a.contains("--memory-limit"),
            "{a}"
        );
    }

    #[test]
    fn a_segmentation_is_advised_only_when_other_and_predicted_smaller() {
        let mut cfg = TrainConfig::default();
        cfg.memory.grad_checkpointing = GradCheckpointing::Stages;
        let s = |checkpointing, predicted_peak| SmallerCheckpointing {
            checkpointing,
            predicted_peak,
            current_peak: 100,
        };
        let seg2 = GradCheckpointing::from_cuts(0b00010);
        let a = out_of_memory_with(&cfg, false, Some(s(seg2, 90)));
        assert!(a.contains("--checkpoint segments:2 (predicted peak"), "{a}");
        for other in [s(seg2, 100), s(seg2, 120), s(GradCheckpointing::Stages, 50)] {
            let a = out_of_memory_with(&cfg, false, Some(other));
            assert!(!a.contains("--checkpoint"), "{other:?}: {a}");
        }
        assert!(!out_of_memory(&cfg, false).contains("--checkpoint"));
    }

    #[test]
    fn the_update_gets_advice_that_can_shrink_it() {
        let mut cfg = TrainConfig::default();
        cfg.optimizer.kind = OptimizerKind::Adamw;
        let a = out_of_memory(&cfg, true);
        assert!(
            a.contains("--optimizer sgd") && a.contains("--width"),
            "{a}"
        );
        assert!(
            !a.contains("--batch-size") && !a.contains("--checkpoint"),
            "{a}"
        );
    }
}
