//! `--fit-memory`: choose the fastest training plan whose predicted peak fits a memory budget.
//!
//! A plan is a micro-batch size (a divisor of the effective batch, the rest made up by gradient
//! accumulation), a checkpointing granularity, a compute precision and (only when the model may
//! change) a convolution kind. [`plan`] predicts the peak of every candidate with the analytic
//! estimate ([`crate::predict`]), keeps those at or below the budget minus a safety
//! margin ([`SAFETY_MARGIN`], 0.25%), and ranks them by a simple throughput model ([`CostModel`]):
//! relative time per image = precision × (1 + recompute overhead) × micro-batch efficiency.
//! It is a pure function of the configuration, the budget and the options: nothing is trained.

use crate::config::{
    ActivationStorage, ConvKind, GradCheckpointing, Precision, TrainConfig, MAX_BATCH_SIZE,
};
use crate::error::{Error, Result};
use crate::predict::{estimate_with, Baseline, DataSize, DeviceKind, Estimate};
use memtrain_core::memory::format_bytes;
use std::fmt::Write as _;

/// Fraction of the budget kept free: a plan must predict at most `(1 - SAFETY_MARGIN) × budget`
/// (the same margin as `--checkpoint auto`'s; its measured basis is given there).
pub use super::margin::SAFETY_MARGIN;

/// Relative cost of the options: time per image of a plan, relative to f32 / standard conv / no
/// checkpointing at a micro-batch in the efficient range, is
///
/// `precision[p, conv] × (1 + recompute[c, conv]) × micro(m) × (separable if the conv is separable)`
///
/// with `micro(m) = max(1, full_at / m) × (1 + spill_per_doubling × max(0, log2(m / spill_above)))`.
///
/// The CPU factors are `bench/cost_model.sh`'s (`docs/results/cost-model.json`: this project's
/// 2-core build machine, an AMD EPYC with AVX512-BF16, width 32, micro-batch 64, the fastest step
/// of 3 runs each): bf16 runs its gemms on `vdpbf16ps` there and costs 0.75× f32, f16 has no
/// arithmetic of its own and costs about what f32 does, and in the separable model (whose
/// depthwise convolutions have no bf16 kernel) both cost a little more; recomputation adds part of
/// a forward pass. The micro-batch factors are older measurements: one-image micro-batches leave
/// the second thread idle, and 128-image micro-batches cost no more than 64-image ones.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Time per image of f16 relative to f32, standard conv.
    pub f16_standard: f64,
    /// As `f16_standard` for bf16.
    pub bf16_standard: f64,
    /// Time per image of f16 relative to f32, separable conv.
    pub f16_separable: f64,
    /// As `f16_separable` for bf16.
    pub bf16_separable: f64,
    /// Extra time of `--checkpoint stages`, standard conv (the stages are recomputed in backward).
    pub stages_standard: f64,
    /// Extra time of `--checkpoint blocks`, standard conv.
    pub blocks_standard: f64,
    /// Extra time of `--checkpoint stages`, separable conv.
    pub stages_separable: f64,
    /// Extra time of `--checkpoint blocks`, separable conv.
    pub blocks_separable: f64,
    /// Micro-batches smaller than this leave compute idle: time per image × `full_at / m`. On the
    /// CPU the convolutions share out images, one per thread, so this is the thread count.
    pub full_at: usize,
    /// Micro-batches larger than this spill the caches with their activations...
    pub spill_above: usize,
    /// ...and cost this much more per image per doubling beyond `spill_above`.
    pub spill_per_doubling: f64,
    /// Time per image of the separable model relative to the standard one (f32).
    pub separable: f64,
    /// Where the factors come from, printed with the plan.
    pub source: &'static str,
}

impl CostModel {
    /// The factors measured on the development CPU, with `threads` compute threads.
    pub fn cpu(threads: usize) -> Self {
        CostModel {
            f16_standard: 1.01,
            bf16_standard: 0.75,
            f16_separable: 1.04,
            bf16_separable: 1.04,
            stages_standard: 0.16,
            blocks_standard: 0.17,
            stages_separable: 0.07,
            blocks_separable: 0.04,
            full_at: threads.max(1),
            spill_above: 64,
            spill_per_doubling: 0.0,
            separable: 0.65,
            source: "measured by bench/cost_model.sh on the 2-core build machine, width 32",
        }
    }

    /// Factors for CUDA, not measured: half precision assumed faster (tensor cores), recompute
    /// one extra forward (a third of a step), micro-batches below 32 images underfill the GPU.
    pub const CUDA: CostModel = CostModel {
        f16_standard: 0.6,
        bf16_standard: 0.6,
        f16_separable: 0.7,
        bf16_separable: 0.7,
        stages_standard: 0.33,
        blocks_standard: 0.33,
        stages_separable: 0.33,
        blocks_separable: 0.33,
        full_at: 32,
        spill_above: usize::MAX,
        spill_per_doubling: 0.0,
        separable: 1.0,
        source: "assumed for CUDA, not measured",
    };

    /// The model for a device kind.
    pub(crate) fn for_device(device: DeviceKind) -> Self {
        match device {
            DeviceKind::Cpu { threads, .. } => CostModel::cpu(threads),
            DeviceKind::Cuda => CostModel::CUDA,
        }
    }

    /// Relative time per image of a plan (1.0 = f32, standard conv, no checkpointing, a
    /// micro-batch between `full_at` and `spill_above`).
    pub fn time_per_image(
        &self,
        micro_batch: usize,
        precision: Precision,
        grad_checkpointing: GradCheckpointing,
        conv: ConvKind,
    ) -> f64 {
        let sep = conv == ConvKind::Separable;
        let p = match (precision, sep) {
            (Precision::F32, _) => 1.0,
            (Precision::F16, false) => self.f16_standard,
            (Precision::Bf16, false) => self.bf16_standard,
            (Precision::F16, true) => self.f16_separable,
            (Precision::Bf16, true) => self.bf16_separable,
        };
        let r = match (grad_checkpointing, sep) {
            // `auto` is resolved to one of the others before anything is planned or run.
            (GradCheckpointing::None | GradCheckpointing::Auto, _) => 0.0,
            (GradCheckpointing::Stages, false) => self.stages_standard,
            (GradCheckpointing::Blocks, false) => self.blocks_standard,
            (GradCheckpointing::Stages, true) => self.stages_separable,
            (GradCheckpointing::Blocks, true) => self.blocks_separable,
            // A segmentation of its own recomputes at most what `blocks` does (every block
            // before the last boundary): modelled as costly, an upper bound.
            (GradCheckpointing::Segments(_), false) => self.blocks_standard,
            (GradCheckpointing::Segments(_), true) => self.blocks_separable,
        };
        p * (1.0 + r) * self.micro(micro_batch) * if sep { self.separable } else { 1.0 }
    }

    /// The micro-batch factor `micro(m)`.
    pub fn micro(&self, micro_batch: usize) -> f64 {
        let m = micro_batch.max(1);
        let idle = (self.full_at as f64 / m as f64).max(1.0);
        let spill = if m > self.spill_above {
            1.0 + self.spill_per_doubling * (m as f64 / self.spill_above as f64).log2()
        } else {
            1.0
        };
        idle * spill
    }

    /// One line stating the model, for the plan report.
    pub fn describe(&self) -> String {
        let spill = if self.spill_per_doubling > 0.0 {
            format!(
                "; +{:.0}% per doubling above {}: cache spill",
                self.spill_per_doubling * 100.0,
                self.spill_above
            )
        } else {
            String::new()
        };
        format!(
            "cost model ({}): time/image relative to f32 = precision (standard: f16 {:.2}×, bf16 {:.2}×; separable: f16 {:.2}×, bf16 {:.2}×) \
             × recompute (standard: +{:.0}% stages, +{:.0}% blocks; separable: +{:.0}%, +{:.0}%) × micro-batch m (×{}/m when m < {}: idle threads{spill}); \
             separable model {:.2}× standard",
            self.source,
            self.f16_standard,
            self.bf16_standard,
            self.f16_separable,
            self.bf16_separable,
            self.stages_standard * 100.0,
            self.blocks_standard * 100.0,
            self.stages_separable * 100.0,
            self.blocks_separable * 100.0,
            self.full_at,
            self.full_at,
            self.separable
        )
    }
}

/// What [`plan`] may vary and what it knows about the run.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanOptions {
    /// Images per optimizer step the plan must keep (default: the config's batch size).
    pub effective_batch: Option<usize>,
    /// Also try the other convolution kind (a different model).
    pub allow_model_change: bool,
    /// The device the plan is for.
    pub device: DeviceKind,
    /// The data set (part of the CPU baseline).
    pub data: DataSize,
    /// Fraction of the budget kept free ([`SAFETY_MARGIN`] by default).
    pub margin: f64,
    /// The throughput model.
    pub cost: CostModel,
    /// Settings the user fixed with explicit flags: the plan keeps them (or finds none).
    pub fixed: Fixed,
    /// The resident memory the user gave, when the budget [`plan`] gets is the heap it leaves (a
    /// CPU `--fit-memory`): messages then speak of resident memory, as the flag does.
    pub resident_budget: Option<u64>,
}

/// What `--fit-memory` must not change: the settings given explicitly on the command line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fixed {
    /// `--precision` was given.
    pub precision: Option<Precision>,
    /// `--checkpoint none|stages|blocks` was given (`auto` leaves the choice to the plan).
    pub grad_checkpointing: Option<GradCheckpointing>,
    /// `--accum-steps` was given.
    pub accum_steps: Option<usize>,
}

impl Fixed {
    /// The settings of `cfg` whose flags are among `explicit` (clap ids, e.g. `precision`).
    pub fn from_explicit(cfg: &TrainConfig, explicit: &[String]) -> Self {
        let given = |id: &str| explicit.iter().any(|e| e == id);
        Fixed {
            precision: given("precision").then_some(cfg.memory.precision),
            grad_checkpointing: (given("checkpoint")
                && cfg.memory.grad_checkpointing != GradCheckpointing::Auto)
                .then_some(cfg.memory.grad_checkpointing),
            accum_steps: given("accum_steps").then_some(cfg.steps.accum_steps),
        }
    }

    /// The fixed settings as flags, for messages (empty when nothing is fixed).
    fn describe(&self) -> String {
        let mut v = Vec::new();
        if let Some(p) = self.precision {
            v.push(format!("--precision {p}"));
        }
        if let Some(c) = self.grad_checkpointing {
            v.push(format!("--checkpoint {c}"));
        }
        if let Some(k) = self.accum_steps {
            v.push(format!("--accum-steps {k}"));
        }
        v.join(" ")
    }
}

impl PlanOptions {
    /// Options for `device` and `data` with the default margin and the device's cost model.
    pub fn new(device: DeviceKind, data: DataSize) -> Self {
        PlanOptions {
            effective_batch: None,
            allow_model_change: false,
            device,
            data,
            margin: SAFETY_MARGIN,
            cost: CostModel::for_device(device),
            fixed: Fixed::default(),
            resident_budget: None,
        }
    }
}

/// One candidate plan with its prediction.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The configuration with the plan applied (batch size = effective batch).
    pub config: TrainConfig,
    /// Images per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step.
    pub accum_steps: usize,
    /// Compute precision.
    pub precision: Precision,
    /// Gradient checkpointing.
    pub grad_checkpointing: GradCheckpointing,
    /// Convolution kind.
    pub conv: ConvKind,
    /// How the saved activations are stored (several only under `--compress-activations auto`).
    pub storage: ActivationStorage,
    /// Predicted peak bytes.
    pub predicted_peak: u64,
    /// Relative time per image (lower is faster; see [`CostModel::time_per_image`]).
    pub time_per_image: f64,
    /// Throughput relative to the base config's own settings (1.0 = as fast; higher is faster).
    pub relative_throughput: f64,
}

impl Plan {
    /// Short description, e.g. `micro-batch 32 × 4, f32, checkpoint stages, standard conv`, with
    /// `, int8 codes (lossy)` for lossy storage.
    pub fn describe(&self) -> String {
        format!(
            "micro-batch {} × {} step{}, {}, checkpoint {}, {} conv{}",
            self.micro_batch,
            self.accum_steps,
            if self.accum_steps == 1 { "" } else { "s" },
            self.precision,
            self.grad_checkpointing,
            self.conv,
            self.codes()
        )
    }

    /// `, int8 codes (lossy)` for lossy storage, else nothing.
    fn codes(&self) -> String {
        if self.storage.is_lossy() {
            format!(", {} codes (lossy)", self.storage)
        } else {
            String::new()
        }
    }

    /// The options that tell plans apart in the runners-up.
    fn options(&self) -> (Precision, GradCheckpointing, ConvKind, ActivationStorage) {
        (
            self.precision,
            self.grad_checkpointing,
            self.conv,
            self.storage,
        )
    }
}

/// The ranked outcome of [`plan`].
#[derive(Debug, Clone, PartialEq)]
pub struct PlanReport {
    /// The budget in bytes.
    pub budget: u64,
    /// The largest predicted peak a plan may have: `budget × (1 - margin)`.
    pub usable: u64,
    /// The margin used.
    pub margin: f64,
    /// Effective batch (images per optimizer step).
    pub effective_batch: usize,
    /// Plans that fit: exact storage first, then the most bits, then the fastest (ties: larger
    /// micro-batch, then smaller peak). Never empty.
    pub plans: Vec<Plan>,
    /// Faster plans that do not fit (fastest first, at most 3) and store as exactly as the chosen
    /// one, to say what the budget costs.
    pub rejected_faster: Vec<Plan>,
    /// The smallest predicted peak of an exact plan, when the chosen plan is lossy (none fit).
    pub smallest_exact: Option<u64>,
    /// Candidates evaluated.
    pub considered: usize,
    /// The throughput model the plans were ranked by.
    pub cost: CostModel,
}

impl PlanReport {
    /// The chosen plan (the first that fits in the ranking of [`PlanReport::plans`]).
    pub fn chosen(&self) -> &Plan {
        &self.plans[0]
    }

    /// The best plan of every other combination of precision, checkpointing and conv kind, in
    /// rank order (plans that only use a smaller micro-batch than a better-ranked one of the same
    /// combination are left out: they are never faster).
    pub(crate) fn runners_up(&self) -> Vec<&Plan> {
        let c = self.chosen();
        let mut seen = vec![c.options()];
        let mut out = Vec::new();
        for p in &self.plans[1..] {
            let key = p.options();
            if !seen.contains(&key) {
                seen.push(key);
                out.push(p);
            }
        }
        out
    }

    /// The report: budget and margin, the cost model, the chosen plan and why, the runners-up and
    /// why each ranks lower.
    pub fn render(&self, runners_up: usize) -> String {
        let mut s = format!(
            "memory plan: budget {}, safety margin {} → plans must predict ≤ {}; effective batch {}; {} of {} candidates fit\n",
            format_bytes(self.budget),
            super::margin::percent(self.margin),
            format_bytes(self.usable),
            self.effective_batch,
            self.plans.len(),
            self.considered
        );
        let _ = writeln!(s, "{}", self.cost.describe());
        let c = self.chosen();
        let _ = writeln!(
            s,
            "chosen: {} — predicted peak {}, relative throughput {:.2}",
            c.describe(),
            format_bytes(c.predicted_peak),
            c.relative_throughput
        );
        let why = match (self.smallest_exact, self.rejected_faster.first()) {
            (Some(exact), _) => format!(
                "why: no exact plan fits (the smallest predicts {}): the most bits that fit, then the fastest; its throughput leaves out encoding and decoding the codes",
                format_bytes(exact)
            ),
            (None, Some(r)) => format!(
                "why: the fastest plan that fits; faster ones need more memory, e.g. {} (throughput {:.2}) predicts {}",
                r.describe(),
                r.relative_throughput,
                format_bytes(r.predicted_peak)
            ),
            (None, None) => "why: the fastest of all candidates, and it fits".to_string(),
        };
        let _ = writeln!(s, "{why}");
        if c.accum_steps > 1 {
            let _ = writeln!(
                s,
                "note: BatchNorm normalizes each micro-batch of {} images on its own, so the step is not one batch of {}'s (--accum-steps 1 keeps it one)",
                c.micro_batch, self.effective_batch
            );
        }
        for (i, p) in self.runners_up().into_iter().take(runners_up).enumerate() {
            let _ = writeln!(
                s,
                "  runner-up {}: {} — peak {}, throughput {:.2} ({})",
                i + 1,
                p.describe(),
                format_bytes(p.predicted_peak),
                p.relative_throughput,
                difference(&self.cost, c, p)
            );
        }
        s
    }
}

/// Why `p` ranks below `chosen`: the options that differ, with their cost factors.
fn difference(cost: &CostModel, chosen: &Plan, p: &Plan) -> String {
    let mut why = Vec::new();
    if p.micro_batch != chosen.micro_batch {
        let (a, b) = (cost.micro(p.micro_batch), cost.micro(chosen.micro_batch));
        why.push(if (a - b).abs() < 1e-9 {
            format!(
                "micro-batch {} instead of {} (no speed difference by itself)",
                p.micro_batch, chosen.micro_batch
            )
        } else {
            format!(
                "micro-batch {} instead of {} (×{:.2} per image)",
                p.micro_batch,
                chosen.micro_batch,
                a / b
            )
        });
    }
    if p.precision != chosen.precision {
        why.push(format!("{} instead of {}", p.precision, chosen.precision));
    }
    if p.grad_checkpointing != chosen.grad_checkpointing {
        why.push(format!(
            "checkpoint {} instead of {}",
            p.grad_checkpointing, chosen.grad_checkpointing
        ));
    }
    if p.conv != chosen.conv {
        why.push(format!("{} conv instead of {}", p.conv, chosen.conv));
    }
    if p.storage != chosen.storage {
        why.push(format!(
            "{} storage instead of {}",
            p.storage, chosen.storage
        ));
    }
    let slower = (p.time_per_image / chosen.time_per_image - 1.0) * 100.0;
    let what = if why.is_empty() {
        "same options".to_string()
    } else {
        why.join(", ")
    };
    if p.storage.loss_rank() > chosen.storage.loss_rank() {
        let how = if chosen.storage.is_lossy() {
            "fewer bits"
        } else {
            "lossy"
        };
        format!("{how}; it differs from the chosen in: {what}")
    } else if slower >= 0.5 {
        format!("{slower:.0}% slower; it differs from the chosen in: {what}")
    } else if p.accum_steps > chosen.accum_steps {
        format!(
            "as fast, but smaller micro-batches (BatchNorm statistics over fewer images); it differs from the chosen in: {what}"
        )
    } else {
        format!("as fast, predicts more memory; it differs from the chosen in: {what}")
    }
}

/// The micro-batch sizes an effective batch allows: its divisors, largest first.
fn divisors(n: usize) -> Vec<usize> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut i = 1;
    while i * i <= n {
        if n.is_multiple_of(i) {
            small.push(i);
            if i * i != n {
                large.push(n / i);
            }
        }
        i += 1;
    }
    large.extend(small.into_iter().rev());
    large
}

/// Rank every plan for `cfg` under `budget` bytes.
///
/// Candidates: every micro-batch that divides the effective batch, checkpointing none / stages /
/// blocks, precision f32 / f16 / bf16, with `allow_model_change` both conv kinds (else the
/// config's), and under `--compress-activations auto` every storage (else the config's). The
/// other settings of `cfg` (width, optimizer, data, seed, ...) are kept. Exact plans rank first;
/// only when none fits does a lossy one run, the most bits first (as `--memory-limit`'s `auto`).
///
/// # Errors
/// When the budget or effective batch is invalid (more than the training images included), when
/// `cfg` is invalid, or when no candidate fits:
/// then the one-line message names the smallest feasible budget and the plan that needs it.
pub fn plan(cfg: &TrainConfig, budget: u64, opts: &PlanOptions) -> Result<PlanReport> {
    if budget == 0 {
        return Err(Error::config("--fit-memory must be larger than 0"));
    }
    if !(0.0..1.0).contains(&opts.margin) {
        return Err(Error::config(format!(
            "the safety margin must be in [0, 1), got {}",
            opts.margin
        )));
    }
    let effective = opts.effective_batch.unwrap_or(cfg.steps.batch_size);
    if effective == 0 || effective > MAX_BATCH_SIZE {
        return Err(Error::config(format!(
            "--effective-batch must be between 1 and {MAX_BATCH_SIZE}, got {effective}"
        )));
    }
    // One step takes at most the training set (before planning: beyond it, the divisors of a
    // huge batch take minutes to rank).
    let train = opts.data.train_images;
    if effective > train {
        let flag = match opts.effective_batch {
            Some(_) => "--effective-batch",
            None => "--batch-size",
        };
        return Err(Error::config(format!(
            "{flag} {effective} is more than the {train} training images, which one optimizer \
             step cannot exceed; use {flag} ≤ {train}"
        )));
    }
    let usable = super::margin::usable_bytes(budget, opts.margin);
    let mut all = candidates(cfg, effective, opts)?;
    let considered = all.len();
    // Exact first, then the most bits; then fastest first; at equal speed the larger micro-batch
    // (BatchNorm statistics over more images, fewer accumulation steps), then the smaller peak.
    all.sort_by(|a, b| {
        a.storage
            .loss_rank()
            .cmp(&b.storage.loss_rank())
            .then(a.time_per_image.total_cmp(&b.time_per_image))
            .then(a.accum_steps.cmp(&b.accum_steps))
            .then(a.predicted_peak.cmp(&b.predicted_peak))
    });
    let (fit, over): (Vec<Plan>, Vec<Plan>) =
        all.into_iter().partition(|p| p.predicted_peak <= usable);
    if fit.is_empty() {
        return Err(too_small(cfg, budget, effective, opts, &over));
    }
    let (best, rank) = (fit[0].time_per_image, fit[0].storage.loss_rank());
    let smallest_exact = (rank > 0)
        .then(|| {
            over.iter()
                .filter(|p| !p.storage.is_lossy())
                .map(|p| p.predicted_peak)
                .min()
        })
        .flatten();
    let rejected_faster: Vec<Plan> = over
        .into_iter()
        .filter(|p| p.time_per_image < best && p.storage.loss_rank() <= rank)
        .take(3)
        .collect();
    Ok(PlanReport {
        budget,
        usable,
        margin: opts.margin,
        effective_batch: effective,
        plans: fit,
        rejected_faster,
        smallest_exact,
        considered,
        cost: opts.cost,
    })
}

/// Every plan for `effective` images per step that keeps the settings `opts` fixes: each
/// micro-batch size that divides it, each checkpointing, precision, (with
/// `--allow-model-change`) conv kind and (under `--compress-activations auto`) storage, with its
/// predicted peak and modelled speed.
fn candidates(cfg: &TrainConfig, effective: usize, opts: &PlanOptions) -> Result<Vec<Plan>> {
    let convs: Vec<ConvKind> = if opts.allow_model_change {
        ConvKind::ALL.to_vec()
    } else {
        vec![cfg.model.conv]
    };
    let reference = opts.cost.time_per_image(
        cfg.micro_batch().max(1),
        cfg.memory.precision,
        cfg.memory.grad_checkpointing,
        cfg.model.conv,
    );

    let storages: Vec<ActivationStorage> = match cfg.memory.compress_activations.fixed() {
        Some(s) => vec![s],
        None => ActivationStorage::ALL.to_vec(),
    };
    let mut all: Vec<Plan> = Vec::new();
    for &conv in &convs {
        for micro in divisors(effective) {
            if opts
                .fixed
                .accum_steps
                .is_some_and(|k| k * micro != effective)
            {
                continue;
            }
            // A fixed segmentation (named or `segments:…`) is the only one tried.
            let schedules = opts
                .fixed
                .grad_checkpointing
                .map_or(GradCheckpointing::CONCRETE.to_vec(), |c| vec![c]);
            for (grad_checkpointing, &precision, &storage) in schedules
                .iter()
                .flat_map(|&g| Precision::ALL.iter().map(move |p| (g, p)))
                .flat_map(|(g, p)| storages.iter().map(move |s| (g, p, s)))
            {
                if opts.fixed.precision.is_some_and(|p| p != precision) {
                    continue;
                }
                let mut c = cfg.clone();
                c.steps.batch_size = effective;
                c.steps.accum_steps = effective / micro;
                c.memory.grad_checkpointing = grad_checkpointing;
                c.memory.precision = precision;
                c.memory.compress_activations = storage.into();
                c.model.conv = conv;
                let est: Estimate = estimate_with(&c, opts.device, Baseline::Modeled(opts.data))?;
                let t = opts
                    .cost
                    .time_per_image(micro, precision, grad_checkpointing, conv);
                all.push(Plan {
                    config: c,
                    micro_batch: micro,
                    accum_steps: effective / micro,
                    precision,
                    grad_checkpointing,
                    conv,
                    storage,
                    predicted_peak: est.run_peak(),
                    time_per_image: t,
                    relative_throughput: reference / t,
                });
            }
        }
    }
    Ok(all)
}

/// The error for a budget that no plan fits: the smallest plan (`over` holds every plan), what it
/// predicts, and the budget it needs with the safety margin.
fn too_small(
    cfg: &TrainConfig,
    budget: u64,
    effective: usize,
    opts: &PlanOptions,
    over: &[Plan],
) -> Error {
    let Some(smallest) = over.iter().min_by_key(|p| p.predicted_peak) else {
        return Error::config(format!(
            "--fit-memory: no plan keeps {} with {effective} images per step; leave those \
             flags out to let the plan choose them, or give an --effective-batch they divide",
            opts.fixed.describe()
        ));
    };
    let needed = super::margin::limit_for(smallest.predicted_peak, opts.margin);
    let hint = if opts.fixed == Fixed::default() {
        match other_model_hint(cfg, opts, needed) {
            Ok(h) => h,
            Err(e) => return e,
        }
    } else {
        format!(
            " (keeping {} as given; leave those flags out to let the plan choose them)",
            opts.fixed.describe()
        )
    };
    // A resident budget needs the heap plus what the process holds outside it.
    let (shown, needed, memory) = match opts.resident_budget {
        Some(r) => (
            r,
            super::limit_for_heap(needed, opts.device),
            " of resident memory",
        ),
        None => (budget, needed, ""),
    };
    Error::config(format!(
        "--fit-memory {} is too small: the smallest plan ({}) predicts a peak of {}; with the {} safety margin the budget must be at least {}{memory}{hint}",
        format_bytes(shown),
        smallest.describe(),
        format_bytes(smallest.predicted_peak),
        super::margin::percent(opts.margin),
        format_bytes(needed),
    ))
}

/// Without `--allow-model-change`: where the other conv kind needs a smaller budget, say so.
fn other_model_hint(cfg: &TrainConfig, opts: &PlanOptions, needed: u64) -> Result<String> {
    if opts.allow_model_change {
        return Ok(String::new());
    }
    let mut other = cfg.clone();
    other.model.conv = match cfg.model.conv {
        ConvKind::Standard => ConvKind::Separable,
        ConvKind::Separable => ConvKind::Standard,
    };
    let theirs = smallest_feasible_budget(&other, opts)?;
    Ok(if theirs < needed {
        format!(
            "; the {} conv model would need {} (--allow-model-change)",
            other.model.conv,
            format_bytes(theirs)
        )
    } else {
        String::new()
    })
}

/// The smallest budget any plan fits in (its predicted peak plus the margin).
///
/// # Errors
/// As [`plan`] for invalid input.
pub fn smallest_feasible_budget(cfg: &TrainConfig, opts: &PlanOptions) -> Result<u64> {
    match plan(cfg, u64::MAX / 2, opts) {
        Ok(r) => {
            let min = r.plans.iter().map(|p| p.predicted_peak).min().unwrap_or(0);
            Ok(super::margin::limit_for(min, opts.margin))
        }
        Err(e) => Err(e),
    }
}
