//! What each memory optimization would save before a run starts: the estimate of a run's
//! configuration with no optimization, with each of them alone and with all of them together
//! ([`what_if`]), printed as a table by `--dry-run` and at the start of a run
//! ([`what_if_table`]) and written into `summary.json` (`what_if`).
//!
//! Every row keeps the run's other settings (batch size, width, optimizer, pruning, data,
//! device); only the optimization flags change, the ones not named in a row's `flags` at their
//! defaults (`--precision f32 --accum-steps 1 --checkpoint none --conv standard
//! --compress-activations none`). The lossy rows (`int8`, `int4`, `int2`) stand apart: `all`
//! combines the four exact optimizations.

use super::estimate::{estimate_with, Baseline, DeviceKind};
use crate::config::{ActivationStorage, ConvKind, GradCheckpointing, Precision, TrainConfig};
use crate::error::Result;
use memtrain_core::memory::format_bytes;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// One row of the what-if table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WhatIf {
    /// Short name: `none`, `f16`, `bf16`, `accum4`, `ckpt-stages`, `ckpt-blocks`, `separable`,
    /// `all`, `int8 (lossy)`, `int4 (lossy)`, `int2 (lossy)`.
    pub label: String,
    /// The optimization flags of the row (the others at their defaults), e.g.
    /// `["--precision", "f16"]`; empty for `none`.
    pub flags: Vec<String>,
    /// Predicted peak bytes of a training step.
    pub predicted_peak_bytes: u64,
    /// Predicted peak bytes of the evaluation after an epoch (its batches are the micro-batch,
    /// in the row's precision and conv; checkpointing and compression do not change it); `None` without
    /// evaluation. The run needs the larger of the two.
    #[serde(default)]
    pub predicted_eval_peak_bytes: Option<u64>,
    /// How many bytes the row's predicted peak is below `none`'s (negative: the row needs more).
    /// Older summaries call it `saved_bytes`.
    #[serde(alias = "saved_bytes")]
    pub below_none_bytes: i64,
}

/// The accumulation the what-if tries: the run's own when it accumulates, else the largest of
/// 4 and 2 that divides the batch (`None`: the batch cannot be split).
fn accum_for(cfg: &TrainConfig) -> Option<usize> {
    if cfg.steps.accum_steps > 1 {
        return Some(cfg.steps.accum_steps);
    }
    [4, 2]
        .into_iter()
        .find(|k| cfg.steps.batch_size >= *k && cfg.steps.batch_size.is_multiple_of(*k))
}

/// The four optimizations of a row.
#[derive(Clone, Copy)]
struct Opts {
    precision: Precision,
    accum: usize,
    ckpt: GradCheckpointing,
    conv: ConvKind,
    storage: ActivationStorage,
}

impl Opts {
    const NONE: Opts = Opts {
        precision: Precision::F32,
        accum: 1,
        ckpt: GradCheckpointing::None,
        conv: ConvKind::Standard,
        storage: ActivationStorage::None,
    };

    /// The flags that differ from the defaults.
    fn flags(&self) -> Vec<String> {
        let mut f = Vec::new();
        if self.precision != Precision::F32 {
            f.extend(["--precision".to_string(), self.precision.to_string()]);
        }
        if self.accum > 1 {
            f.extend(["--accum-steps".to_string(), self.accum.to_string()]);
        }
        if self.ckpt != GradCheckpointing::None {
            f.extend(["--checkpoint".to_string(), self.ckpt.to_string()]);
        }
        if self.conv != ConvKind::Standard {
            f.extend(["--conv".to_string(), self.conv.to_string()]);
        }
        if self.storage != ActivationStorage::None {
            f.extend([
                "--compress-activations".to_string(),
                self.storage.to_string(),
            ]);
        }
        f
    }

    fn peak(&self, cfg: &TrainConfig, device: DeviceKind, baseline: Baseline) -> Result<u64> {
        Ok(self.peaks(cfg, device, baseline)?.0)
    }

    /// The step's predicted peak and the evaluation's.
    fn peaks(
        &self,
        cfg: &TrainConfig,
        device: DeviceKind,
        baseline: Baseline,
    ) -> Result<(u64, Option<u64>)> {
        let mut c = cfg.clone();
        c.memory.precision = self.precision;
        c.steps.accum_steps = self.accum;
        c.memory.grad_checkpointing = self.ckpt;
        c.model.conv = self.conv;
        c.memory.compress_activations = self.storage.into();
        let e = estimate_with(&c, device, baseline)?;
        Ok((e.peak, e.eval_peak))
    }
}

/// The predicted step peak of `cfg` with no memory optimization (`none`), with each alone
/// (`f16`, `bf16`, `accumK`, `ckpt-stages`, `ckpt-blocks`, `separable`) and with all together
/// (`all`: the run's half precision or f16, the accumulation, the checkpointing of the run or
/// else the smaller of stages and blocks, the separable conv). `accumK` is left out when the
/// batch cannot be split.
///
/// # Errors
/// When the config is invalid (as [`estimate_with`]).
pub fn what_if(cfg: &TrainConfig, device: DeviceKind, baseline: Baseline) -> Result<Vec<WhatIf>> {
    let none = Opts::NONE;
    let mut rows: Vec<(String, Opts)> = vec![("none".into(), none)];
    for p in [Precision::F16, Precision::Bf16] {
        rows.push((
            p.to_string(),
            Opts {
                precision: p,
                ..none
            },
        ));
    }
    let accum = accum_for(cfg);
    if let Some(k) = accum {
        rows.push((format!("accum{k}"), Opts { accum: k, ..none }));
    }
    for ck in [GradCheckpointing::Stages, GradCheckpointing::Blocks] {
        rows.push((format!("ckpt-{ck}"), Opts { ckpt: ck, ..none }));
    }
    let separable = Opts {
        conv: ConvKind::Separable,
        ..none
    };
    rows.push(("separable".into(), separable));
    let all = Opts {
        precision: match cfg.memory.precision {
            Precision::F32 => Precision::F16,
            p => p,
        },
        accum: accum.unwrap_or(1),
        ..separable
    };
    let all = match cfg.memory.grad_checkpointing {
        ck @ (GradCheckpointing::Stages | GradCheckpointing::Blocks) => Opts { ckpt: ck, ..all },
        _ => {
            let stages = Opts {
                ckpt: GradCheckpointing::Stages,
                ..all
            };
            let blocks = Opts {
                ckpt: GradCheckpointing::Blocks,
                ..all
            };
            if blocks.peak(cfg, device, baseline)? < stages.peak(cfg, device, baseline)? {
                blocks
            } else {
                stages
            }
        }
    };
    rows.push(("all".into(), all));
    // The lossy levers last, apart from the four exact ones that `all` combines.
    for &storage in ActivationStorage::ALL.iter().filter(|s| s.is_lossy()) {
        rows.push((format!("{storage} (lossy)"), Opts { storage, ..none }));
    }
    let base = none.peak(cfg, device, baseline)?;
    rows.into_iter()
        .map(|(label, o)| {
            let (peak, eval) = o.peaks(cfg, device, baseline)?;
            Ok(WhatIf {
                label,
                flags: o.flags(),
                predicted_peak_bytes: peak,
                predicted_eval_peak_bytes: eval,
                below_none_bytes: base as i64 - peak as i64,
            })
        })
        .collect()
}

/// The what-if rows as a markdown table with a heading line.
pub fn what_if_table(rows: &[WhatIf]) -> String {
    let mut s = String::from(
        "what if (predicted step peak, and the evaluation's; the run's other settings kept, unnamed optimizations off)\n| optimization | flags | predicted peak | below none | evaluation peak |\n|---|---|---:|---:|---:|\n",
    );
    for r in rows {
        let below = if r.below_none_bytes >= 0 {
            format_bytes(r.below_none_bytes as u64)
        } else {
            format!("−{}", format_bytes(r.below_none_bytes.unsigned_abs()))
        };
        let flags = if r.flags.is_empty() {
            "(none)".to_string()
        } else {
            r.flags.join(" ")
        };
        let eval = r
            .predicted_eval_peak_bytes
            .map_or("-".to_string(), format_bytes);
        let _ = writeln!(
            s,
            "| {} | {flags} | {} | {below} | {eval} |",
            r.label,
            format_bytes(r.predicted_peak_bytes)
        );
    }
    s
}
