//! What to do when a step does not fit its memory: advice true for the configuration at hand,
//! never a flag it already uses or one that cannot help in the phase that ran out.

use crate::config::{GradCheckpointing, OptimizerKind, Precision, TrainConfig};

/// The fixes for a step of `cfg` that needed more memory than it had, in the order to try them.
/// `in_update`: it ran out in the optimizer phase, where parameters, gradients and optimizer
/// state are alive but no activation is, so only the optimizer or the model can help.
pub(crate) fn out_of_memory(cfg: &TrainConfig, in_update: bool) -> String {
    let mut fixes: Vec<&str> = Vec::new();
    if in_update {
        if cfg.optimizer == OptimizerKind::Adamw {
            fixes.push("use --optimizer sgd (one state tensor per parameter, AdamW keeps two)");
        }
        if cfg.width > 1 {
            fixes.push("lower --width");
        }
    } else {
        if cfg.micro_batch() > 1 {
            fixes.push("lower --batch-size");
            fixes.push("raise --accum-steps (smaller micro-batches, the same batch)");
        }
        match cfg.grad_checkpointing {
            GradCheckpointing::None => fixes.push("use --checkpoint stages (or blocks)"),
            GradCheckpointing::Stages => fixes.push("use --checkpoint blocks"),
            GradCheckpointing::Blocks | GradCheckpointing::Auto => {}
        }
        if cfg.precision == Precision::F32 {
            fixes.push("use --precision bf16 (or f16)");
        }
    }
    if cfg.memory_limit.is_some() {
        fixes.push("raise --memory-limit");
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
        let cfg = TrainConfig {
            precision: Precision::Bf16,
            grad_checkpointing: GradCheckpointing::Blocks,
            memory_limit: Some(1 << 20),
            ..TrainConfig::default()
        };
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
    fn the_update_gets_advice_that_can_shrink_it() {
        let cfg = TrainConfig {
            optimizer: OptimizerKind::Adamw,
            ..TrainConfig::default()
        };
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
