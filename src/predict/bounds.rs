//! Every input sized before it is used: nothing is loaded or allocated that the run cannot hold.
//!
//! [`check_inputs`] runs before the data is loaded and the model is built. It sizes
//! - the data set: from the synthetic counts (saturating arithmetic, so an absurd count is "too
//!   big", never an overflow or an allocator abort), or from the metadata of the CIFAR-10 files
//!   ([`cifar::scan_dir`] refuses what is not a regular file of whole records; nothing is read),
//!   including what loading holds for a moment beyond the loaded splits;
//! - the model at its width: parameters, BatchNorm statistics, pruning masks, gradients and
//!   optimizer state, from the analytic estimate ([`crate::predict`]);
//! - the training step: its predicted peak (batch buffers and activations, the batch × width
//!   products),
//!
//! and compares them with every budget the run has: `--memory-limit` and `--fit-memory` (on the
//! CPU together with the heap the process already holds, so the limit holds from process start,
//! not only once training runs), and what the machine can still give the process
//! ([`headroom`]: `MemAvailable`, the cgroup, `ulimit -v`).
//!
//! A data set or model that does not fit is a usage error naming the part that is too big and a
//! value that fits (`--synthetic-train ≤ N`, `--width ≤ N`), found by searching the estimate. A
//! step whose predicted peak is more than the machine can give is an out-of-memory error before
//! anything is allocated (a sweep records it as an OOM point, as it would the allocator's
//! failure). A step that only exceeds `--memory-limit` is left to the trainer's per-layer check,
//! which says where it ran out and writes a report: there, lowering the batch helps.

use crate::config::{
    CompressActivations, ConvKind, GradCheckpointing, OptimizerKind, TrainConfig,
    MIN_SYNTHETIC_IMAGES,
};
use crate::data::cifar::{self, DirFiles};
use crate::data::IMAGE_BYTES;
use crate::error::{CoreError, Error, Result};
use crate::predict::{
    estimate_with, Baseline, DataSize, DeviceKind, Estimate, RUNTIME_OVERHEAD_BYTES,
};
use memtrain_core::memory::os::{headroom, Headroom, RssReserve, RSS_THREAD_ALLOWANCE};
use memtrain_core::memory::{format_bytes, CountingAllocator};
use std::path::{Path, PathBuf};

/// Check, before anything is loaded or built, that the data set, the model and (unless
/// `dry_run` or planning with `fit_memory`) the training step of `cfg` fit every memory budget
/// of the run; see the module documentation.
///
/// `cfg` is the configuration the run will use (on `--resume`, the checkpoint's with the flags
/// given); `fit_memory` is `--fit-memory`'s budget, whose planner then picks the batch settings;
/// `resumed` the bytes of a loaded snapshot's tensors, which become the model and optimizer state
/// the checks count, so they are not counted again as held.
///
/// # Errors
/// [`CoreError::Config`](crate::error::CoreError::Config) naming the data set or the model as too big and a value that fits;
/// [`CoreError::WontFit`](crate::error::CoreError::WontFit) for a step the machine cannot hold; [`Error::Data`] for data files
/// that are not CIFAR-10 binary files (not regular, a size that is not whole records or more
/// than a batch file holds); [`CoreError::Config`](crate::error::CoreError::Config) for an invalid configuration.
pub fn check_inputs(
    cfg: &TrainConfig,
    fit_memory: Option<u64>,
    dry_run: bool,
    resumed: u64,
) -> Result<()> {
    // `--fit-memory` chooses `auto` codes itself; the data and the model checked here do not
    // depend on them.
    let exact;
    let cfg = if fit_memory.is_some() && cfg.memory.compress_activations.fixed().is_none() {
        let mut c = cfg.clone();
        c.memory.compress_activations = CompressActivations::None;
        exact = c;
        &exact
    } else {
        cfg
    };
    let device = DeviceKind::for_spec(cfg.device.as_deref())?;
    let source = Source::of(cfg)?;
    // Host bytes already allocated: the limit counts them (the counting allocator measures the
    // whole process heap), the machine's headroom already excludes them.
    let held = if CountingAllocator::is_installed() {
        CountingAllocator::current().saturating_sub(resumed)
    } else {
        0
    };
    let machine = headroom().map(|h| Headroom {
        bytes: h.bytes.saturating_add(resumed),
        ..h
    });
    let mut budgets = Budget::all(cfg.memory.memory_limit, fit_memory, device, held, machine);
    // The tightest first: a value that fits it fits the others on the same memory.
    budgets.sort_by_key(|b| b.room);
    let ctx = Checks {
        device,
        source,
        budgets,
        step: match (device.is_cpu(), dry_run, fit_memory) {
            (false, _, _) | (_, true, _) => Step::NotRun,
            (true, false, None) => Step::AsConfigured,
            (true, false, Some(_)) => Step::Planned,
        },
    };
    let needs = ctx.needs(cfg)?;
    for b in &ctx.budgets {
        if needs.total(b) > b.room {
            return Err(ctx.refusal(cfg, b, &needs)?);
        }
    }
    refuse_predicted_overrun(cfg, &ctx, &needs, fit_memory)?;
    // --checkpoint auto under --memory-limit: refused here when no segmentation fits.
    if fit_memory.is_none() {
        crate::predict::check_auto_checkpointing(cfg)?;
    }
    // The step: its batch buffers and activations grow with batch × width. Beyond what the
    // machine can give, the allocator would abort the process part-way through the first step.
    // (A training split smaller than one batch never gets there: the trainer refuses it.)
    let machine = ctx.budgets.iter().find(|b| b.kind == Kind::Machine);
    let trains =
        ctx.step == Step::AsConfigured && ctx.data(cfg).0.train_images >= cfg.steps.batch_size;
    if let (true, Some(b), Some(est)) = (trains, machine, &needs.estimate) {
        let step = est.run_peak().saturating_sub(RUNTIME_OVERHEAD_BYTES);
        if step > b.room {
            return Err(Error::Core(CoreError::WontFit(format!(
                "the run's predicted {} peak needs {} more than the process holds, but this \
                 machine can give it only {} ({}); {}, or make more memory available to it",
                est.run_peak_phase(),
                size(step),
                format_bytes(b.room),
                b.source,
                lowering_advice(cfg, est)
            ))));
        }
    }
    Ok(())
}

/// The environment variable that, set to `1`, lets a CPU run whose step is predicted not to fit
/// `--memory-limit` start anyway, so that the per-layer check finds where it runs out and writes
/// its out-of-memory snapshot (the tests of that path use it; so can a user who wants to see it).
pub const RUN_PAST_PREDICTION_ENV: &str = "MEMTRAIN_RUN_PAST_PREDICTION";

/// A CPU step predicted to need more than `--memory-limit` (heap and what the process holds
/// outside it) is refused before anything runs, dry runs included; `--fit-memory` plans its own.
fn refuse_predicted_overrun(
    cfg: &TrainConfig,
    ctx: &Checks,
    needs: &Needs,
    fit_memory: Option<u64>,
) -> Result<()> {
    let (Some(limit), Some(est), true, None) = (
        cfg.memory.memory_limit,
        &needs.estimate,
        ctx.device.is_cpu(),
        fit_memory,
    ) else {
        return Ok(());
    };
    // `--checkpoint auto` chooses under the limit itself, or says that nothing fits.
    let auto = cfg.memory.grad_checkpointing == GradCheckpointing::Auto;
    let trains = ctx.data(cfg).0.train_images >= cfg.steps.batch_size && !auto;
    let escape = std::env::var_os(RUN_PAST_PREDICTION_ENV).is_some_and(|v| v == "1");
    let reserve = RssReserve::of_process();
    let peak = est.run_peak();
    let resident = reserve.resident(peak);
    if !trains || escape || peak <= reserve.heap_budget(limit) {
        return Ok(());
    }
    // A predicted overrun within the estimate's margin may still fit.
    let margin = crate::predict::margin::SAFETY_MARGIN;
    let close = resident as f64 <= limit as f64 * (1.0 + margin);
    let what = match est.run_peak_phase() {
        "evaluation" => format!(
            "the run's predicted evaluation peak (batches of {}; the step's is {})",
            est.setup.eval_batch,
            format_bytes(est.peak)
        ),
        phase => format!("the step's predicted {phase} peak"),
    };
    Err(Error::Core(CoreError::WontFit(format!(
        "{what} is {} of heap, {} of resident memory with the binary, \
         thread stacks and allocator, above --memory-limit {}{}; {}, or raise --memory-limit to \
         at least {}",
        format_bytes(peak),
        format_bytes(resident),
        format_bytes(limit),
        if close {
            format!(
                " (within the estimate's {} margin, so it might just fit)",
                crate::predict::margin::percent(margin)
            )
        } else {
            String::new()
        },
        lowering_advice(cfg, est),
        at_least(resident)
    ))))
}

/// [`run_peak_advice`] without raising `--memory-limit`, for a message that names its own limit.
fn lowering_advice(cfg: &TrainConfig, est: &Estimate) -> String {
    run_peak_advice(cfg, est)
        .trim_end_matches(", or raise --memory-limit")
        .replace(" or raise --memory-limit", "")
}

/// What lowers the run's predicted peak: the step's advice, or for an evaluation above the step
/// what makes its batches smaller (it runs in batches of the micro-batch; checkpointing and
/// compressed activations do not touch it).
fn run_peak_advice(cfg: &TrainConfig, est: &Estimate) -> String {
    match est.run_peak_phase() {
        "evaluation" => format!(
            "the evaluation runs in batches of the micro-batch ({}): use --accum-steps K (smaller \
             micro-batches), --precision bf16, a smaller --batch-size, or --no-eval",
            est.setup.eval_batch
        ),
        phase => crate::advice::out_of_memory(cfg, phase == "optimizer"),
    }
}

/// Where the data comes from, found without loading it.
enum Source {
    /// Built-in synthetic images (`--synthetic-train`, `--synthetic-test`).
    Synthetic,
    /// A CIFAR-10 binary directory, its files checked.
    Dir(PathBuf, DirFiles),
    /// The hub download (`--download`), of known size.
    Download(DataSize),
}

impl Source {
    /// The source [`crate::data::load`] will use for `cfg`, directories scanned and checked.
    fn of(cfg: &TrainConfig) -> Result<Self> {
        if cfg.data.download {
            return Ok(Source::Download(DataSize::for_config(cfg)?));
        }
        let default_dir = Path::new(crate::data::DEFAULT_DATA_DIR);
        let dir = match &cfg.data.data_dir {
            Some(d) => d.clone(),
            None if default_dir.is_dir() => default_dir.to_path_buf(),
            None => return Ok(Source::Synthetic),
        };
        let files = cifar::scan_dir(&dir)?;
        Ok(Source::Dir(dir, files))
    }
}

/// Which budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `--memory-limit`.
    Limit,
    /// `--fit-memory`, less the planner's safety margin.
    Fit,
    /// What the machine can still give the process.
    Machine,
}

/// One budget: the bytes the run may still allocate against it.
struct Budget {
    kind: Kind,
    /// Bytes the process may still allocate (the budget less what it already holds).
    room: u64,
    /// What the process already holds against it.
    held: u64,
    /// The budget in words, e.g. `--memory-limit is 500.00 MiB`.
    what: String,
    /// Where a machine budget comes from, e.g. `MemAvailable in /proc/meminfo`.
    source: &'static str,
    /// The data set (host memory) counts against it.
    host: bool,
    /// The model counts against it (host memory on the CPU, device memory on CUDA).
    model: bool,
}

impl Budget {
    /// The budgets of a run on `device`: `--memory-limit` and `--fit-memory` hold the model
    /// (and on the CPU the data set and what the process holds), the machine's headroom the
    /// host side.
    fn all(
        limit: Option<u64>,
        fit: Option<u64>,
        device: DeviceKind,
        held: u64,
        machine: Option<Headroom>,
    ) -> Vec<Budget> {
        let cpu = device.is_cpu();
        let held = if cpu { held } else { 0 };
        let mut all = Vec::new();
        if let Some(limit) = limit {
            // On the CPU the limit is the process's resident memory: the heap gets what the
            // binary, thread stacks and allocator leave of it.
            let (heap, what) = match cpu {
                true => {
                    let reserve = RssReserve::of_process();
                    let heap = reserve.heap_budget(limit);
                    // Where the compute threads' share outweighs the heap, they are the cause.
                    let threads = reserve.threads * RSS_THREAD_ALLOWANCE;
                    let note = match threads > heap {
                        true => format!(
                            " after {} for {} compute threads: set RAYON_NUM_THREADS lower",
                            format_bytes(threads),
                            reserve.threads
                        ),
                        false => String::new(),
                    };
                    let what = format!(
                        "--memory-limit is {} (resident memory; a heap budget of {}{note})",
                        format_bytes(limit),
                        format_bytes(heap)
                    );
                    (heap, what)
                }
                false => (limit, format!("--memory-limit is {}", format_bytes(limit))),
            };
            all.push(Budget {
                kind: Kind::Limit,
                room: heap.saturating_sub(held),
                held,
                what,
                source: "",
                host: cpu,
                model: true,
            });
        }
        if let Some(fit) = fit {
            let margin = crate::predict::plan::SAFETY_MARGIN;
            let usable = (fit as f64 * (1.0 - margin)).floor() as u64;
            all.push(Budget {
                kind: Kind::Fit,
                room: usable.saturating_sub(held),
                held,
                what: format!(
                    "--fit-memory {} leaves {} after its {} safety margin",
                    format_bytes(fit),
                    format_bytes(usable),
                    crate::predict::margin::percent(margin)
                ),
                source: "",
                host: cpu,
                model: true,
            });
        }
        if let Some(m) = machine {
            all.push(Budget {
                kind: Kind::Machine,
                room: m.bytes,
                held: 0,
                what: format!(
                    "this machine can give the process only {} more ({})",
                    format_bytes(m.bytes),
                    m.source
                ),
                source: m.source,
                host: true,
                model: cpu,
            });
        }
        all
    }

    /// How to raise this budget to `need` new bytes, when that is a fix that can work: within
    /// what the machine can give (`machine`, bytes) where the budget is on the same memory.
    fn raise_to(&self, need: u64, machine: Option<&Budget>) -> Option<String> {
        let total = self.held.saturating_add(need);
        let within = |b: &Budget| !self.host || need <= b.room;
        match self.kind {
            Kind::Limit if machine.is_none_or(within) => Some(format!(
                "raise --memory-limit to at least {}",
                // A CPU limit holds the heap and what the process has outside it.
                at_least(match self.host {
                    true => RssReserve::of_process().resident(total),
                    false => total,
                })
            )),
            Kind::Fit if machine.is_none_or(within) => Some(format!(
                "raise --fit-memory to at least {}",
                at_least(
                    (total as f64 / (1.0 - crate::predict::plan::SAFETY_MARGIN)).ceil() as u64
                )
            )),
            _ => None,
        }
    }
}

/// What a configuration needs beyond what the process holds.
struct Needs {
    /// Host bytes of the loaded data set.
    resident: u64,
    /// Host bytes held at most while the data set is loaded (at least `resident`).
    loading: u64,
    /// The model's bytes: parameters, BatchNorm statistics, masks, gradients, optimizer state.
    model: u64,
    /// The analytic estimate of the run; `None` when the data set alone is beyond any memory.
    estimate: Option<Estimate>,
}

impl Needs {
    /// New bytes that count against `b`: the data set while it loads, then data set and model.
    fn total(&self, b: &Budget) -> u64 {
        match (b.host, b.model) {
            (true, true) => self.loading.max(self.resident.saturating_add(self.model)),
            (true, false) => self.loading,
            (false, _) => self.model,
        }
    }
}

/// Which step the run takes, as far as its host memory is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// None on the host: a dry run, or a CUDA run (whose step is in device memory, where the
    /// pool reports its own out-of-memory).
    NotRun,
    /// The configured one.
    AsConfigured,
    /// One `--fit-memory` plans: at least as large as its cheapest, one image per micro-batch.
    Planned,
}

/// Everything the checks of one run share.
struct Checks {
    device: DeviceKind,
    source: Source,
    budgets: Vec<Budget>,
    /// How the step is checked.
    step: Step,
}

/// Data sets beyond this are not estimated: no budget can hold them, and the estimate's
/// per-image arithmetic stays far from overflow.
const ESTIMATE_DATA_MAX: u64 = 1 << 60;

impl Checks {
    /// The data set of `cfg` (its sizes, and the most bytes loading it holds at once).
    fn data(&self, cfg: &TrainConfig) -> (DataSize, u64) {
        match &self.source {
            Source::Synthetic => {
                // Generation allocates each split exactly, one after the other.
                let size = DataSize::synthetic(cfg.data.synthetic_train, cfg.data.synthetic_test);
                (size, size.resident_bytes)
            }
            Source::Dir(_, files) => {
                let size = DataSize::for_files(files, cfg.data.val_fraction);
                (size, dir_loading_peak(files, cfg.data.val_fraction))
            }
            Source::Download(size) => {
                let size = *size;
                // The hub loader's f32 tensors of both splits, and the conversion's temporaries
                // of the training split (`cifar::hub_tensors_to_dataset` keeps about five f32
                // copies until its statement ends): an upper estimate.
                let f32_bytes = |n: usize| (n * IMAGE_BYTES * 4) as u64;
                let peak = size.resident_bytes
                    + 6 * f32_bytes(size.train_images)
                    + f32_bytes(size.test_images);
                (size, peak)
            }
        }
    }

    /// What `cfg` needs.
    fn needs(&self, cfg: &TrainConfig) -> Result<Needs> {
        let (size, loading) = self.data(cfg);
        let mut needs = Needs {
            resident: size.resident_bytes,
            loading,
            model: 0,
            estimate: None,
        };
        if size.resident_bytes < ESTIMATE_DATA_MAX {
            let est = estimate_with(cfg, self.device, Baseline::Modeled(size))?;
            // The baseline is the data set, the model's own tensors and (CPU) the runtime, which
            // is part of what the process already holds.
            let own = if self.device.is_cpu() {
                est.held
                    .baseline_bytes
                    .saturating_sub(size.resident_bytes)
                    .saturating_sub(RUNTIME_OVERHEAD_BYTES)
            } else {
                est.held.baseline_bytes
            };
            needs.model = own + est.held.grad_bytes + est.held.optimizer_bytes;
            needs.estimate = Some(est);
        }
        Ok(needs)
    }

    /// New host bytes at the predicted peak of `cfg`'s step, with the planner's safety margin
    /// (for [`Step::Planned`] the cheapest plan's, whose budget has the margin taken off: one
    /// image per micro-batch, the cheapest checkpointing); `None` where no step runs on the host
    /// or the data set is beyond any estimate. Budgets that fit it are the ones advised.
    fn step_need(&self, cfg: &TrainConfig) -> Result<Option<u64>> {
        let peak = |c: &TrainConfig| -> Result<Option<u64>> {
            Ok(self.needs(c)?.estimate.map(|e| e.run_peak()))
        };
        match self.step {
            Step::NotRun => Ok(None),
            // The estimate's runtime bytes are part of what the process holds.
            Step::AsConfigured => Ok(peak(cfg)?.map(|p| {
                let step = p.saturating_sub(RUNTIME_OVERHEAD_BYTES) as f64;
                (step / (1.0 - crate::predict::plan::SAFETY_MARGIN)).ceil() as u64
            })),
            // As the planner counts it (runtime included), so that a budget raised to what this
            // asks for is one the planner finds a plan in.
            Step::Planned => {
                let mut least: Option<u64> = None;
                for &grad_checkpointing in GradCheckpointing::CONCRETE {
                    let mut c = cfg.clone();
                    c.steps.accum_steps = c.steps.batch_size;
                    c.memory.grad_checkpointing = grad_checkpointing;
                    if let Some(p) = peak(&c)? {
                        least = Some(least.map_or(p, |l| l.min(p)));
                    }
                }
                Ok(least)
            }
        }
    }

    /// Whether `cfg` fits `b`: its data set and model, and with `with_step` its step (on host
    /// budgets, where one runs).
    fn fits(&self, cfg: &TrainConfig, b: &Budget, with_step: bool) -> Result<bool> {
        if self.needs(cfg)?.total(b) > b.room {
            return Ok(false);
        }
        if !with_step || !b.host {
            return Ok(true);
        }
        Ok(self.step_need(cfg)?.is_none_or(|step| step <= b.room))
    }

    /// The largest value in `lo..=hi` that `set` makes fit `b`, its step included. Where the run
    /// is configured to take a step no value makes fit, one that fits data set and model: the
    /// step's own out-of-memory error then says what lowers it.
    fn largest_fitting(
        &self,
        cfg: &TrainConfig,
        b: &Budget,
        lo: usize,
        hi: usize,
        set: impl Fn(&mut TrainConfig, usize),
    ) -> Result<Option<usize>> {
        let tries: &[bool] = if self.step == Step::AsConfigured {
            &[true, false]
        } else {
            &[true]
        };
        for &with_step in tries {
            let found = largest(lo, hi, |v| {
                let mut c = cfg.clone();
                set(&mut c, v);
                self.fits(&c, b, with_step)
            })?;
            if found.is_some() {
                return Ok(found);
            }
        }
        Ok(None)
    }

    /// The error for `cfg` not fitting `b`: the part that is too big (the larger of data set and
    /// model) and the fixes that work.
    fn refusal(&self, cfg: &TrainConfig, b: &Budget, needs: &Needs) -> Result<Error> {
        let model_counts = b.model && needs.estimate.is_some();
        let data = needs.loading.max(needs.resident);
        let blame_data = b.host && (!model_counts || data >= needs.model);
        // What the rest of the run takes of the budget, and who that is.
        let (subject, rest, others, mut fixes) = if blame_data {
            (
                format!("{} needs {}", self.describe_data(cfg), size(data)),
                if model_counts { needs.model } else { 0 },
                "the model",
                self.data_fixes(cfg, b)?,
            )
        } else {
            (
                format!(
                    "the model at --width {} needs {} ({} parameters, with their gradients and {} state)",
                    cfg.model.width,
                    size(needs.model),
                    count(memtrain_core::model::cnn::param_count(cfg.model.width, cfg.model.conv) as u64),
                    match cfg.optimizer.kind {
                        OptimizerKind::Sgd => "SGD momentum",
                        OptimizerKind::Adamw => "AdamW moment",
                    }
                ),
                if b.host { needs.resident } else { 0 },
                "the data set",
                self.model_fixes(cfg, b)?,
            )
        };
        let of_which = match (rest > 0, b.held > 0) {
            (false, false) => String::new(),
            (true, false) => format!(", of which {others} needs {}", size(rest)),
            (false, true) => format!(", of which the process already holds {}", size(b.held)),
            (true, true) => format!(
                ", of which {others} and what the process already holds need {}",
                size(rest + b.held)
            ),
        };
        let machine = self.budgets.iter().find(|m| m.kind == Kind::Machine);
        let step = if b.host { self.step_need(cfg)? } else { None };
        fixes.extend(b.raise_to(needs.total(b).max(step.unwrap_or(0)), machine));
        if fixes.is_empty() {
            fixes.push("use a machine with more memory".into());
        }
        Ok(Error::config(format!(
            "{subject} but {}{of_which}: {}",
            b.what,
            fixes.join(" or ")
        )))
    }

    /// Smaller data that fits `b`: the larger synthetic count lowered as far as needed.
    fn data_fixes(&self, cfg: &TrainConfig, b: &Budget) -> Result<Vec<String>> {
        Ok(match self.source {
            Source::Synthetic => {
                let test = cfg.data.synthetic_test > cfg.data.synthetic_train;
                let (flag, current, lo) = if test {
                    (
                        "--synthetic-test",
                        cfg.data.synthetic_test,
                        MIN_SYNTHETIC_IMAGES,
                    )
                } else {
                    // The training split must hold at least one batch.
                    (
                        "--synthetic-train",
                        cfg.data.synthetic_train,
                        cfg.steps.batch_size.max(MIN_SYNTHETIC_IMAGES),
                    )
                };
                let set = |c: &mut TrainConfig, v: usize| match test {
                    true => c.data.synthetic_test = v,
                    false => c.data.synthetic_train = v,
                };
                self.largest_fitting(cfg, b, lo, current.saturating_sub(1), set)?
                    .map(|n| format!("use {flag} ≤ {n}"))
                    .into_iter()
                    .collect()
            }
            Source::Dir(..) => vec!["use a --data-dir with fewer data_batch files".into()],
            Source::Download(_) => Vec::new(),
        })
    }

    /// A smaller model that fits `b`: a narrower width, the separable convolution, SGD.
    fn model_fixes(&self, cfg: &TrainConfig, b: &Budget) -> Result<Vec<String>> {
        let mut fixes = Vec::new();
        let narrower =
            self.largest_fitting(cfg, b, 1, cfg.model.width.saturating_sub(1), |c, v| {
                c.model.width = v
            })?;
        fixes.extend(narrower.map(|w| format!("use --width ≤ {w}")));
        let mut separable = cfg.clone();
        separable.model.conv = ConvKind::Separable;
        if cfg.model.conv == ConvKind::Standard && self.fits(&separable, b, false)? {
            fixes.push("--conv separable".into());
        }
        let mut sgd = cfg.clone();
        sgd.optimizer.kind = OptimizerKind::Sgd;
        if cfg.optimizer.kind == OptimizerKind::Adamw && self.fits(&sgd, b, false)? {
            fixes.push("--optimizer sgd".into());
        }
        Ok(fixes)
    }

    /// The data set of `cfg` in words.
    fn describe_data(&self, cfg: &TrainConfig) -> String {
        match &self.source {
            Source::Synthetic => format!(
                "the synthetic data set ({} train + {} test images)",
                count(cfg.data.synthetic_train as u64),
                count(cfg.data.synthetic_test as u64)
            ),
            Source::Dir(dir, files) => format!(
                "the data set in {} ({} images in {} files, while loading)",
                dir.display(),
                count((files.train_images() + files.test.as_ref().map_or(0, |(_, n)| *n)) as u64),
                files.train.len() + usize::from(files.test.is_some()),
            ),
            Source::Download(size) => format!(
                "the downloaded CIFAR-10 ({} images, converted from f32 while loading)",
                count((size.train_images + size.test_images) as u64)
            ),
        }
    }
}

/// The most heap bytes [`cifar::load_dir`] holds at once for `files`: both splits, allocated
/// exactly, and its read buffer; without a test file also the validation split's mask (one byte
/// per training image), which is drawn before them from an index list (8 bytes per image).
fn dir_loading_peak(files: &DirFiles, val_fraction: f64) -> u64 {
    let n = files.train_images() as u64;
    let data = DataSize::for_files(files, val_fraction).resident_bytes;
    let all = files.train.iter().chain(&files.test);
    let buffer = cifar::read_buffer_bytes(all.map(|(_, n)| *n)) as u64;
    match files.test {
        Some(_) => data + buffer,
        None => (9 * n).max(n + data + buffer),
    }
}

/// The largest `v` in `lo..=hi` with `ok(v)`, for an `ok` that holds up to some value and not
/// beyond; `None` when `ok(lo)` does not hold (or the range is empty).
fn largest(
    lo: usize,
    hi: usize,
    mut ok: impl FnMut(usize) -> Result<bool>,
) -> Result<Option<usize>> {
    if hi < lo || !ok(lo)? {
        return Ok(None);
    }
    // ok(good) holds; ok(bad) does not (bad = hi + 1 is never tried).
    let (mut good, mut bad) = (lo, hi.saturating_add(1));
    if ok(hi)? {
        return Ok(Some(hi));
    }
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if ok(mid)? {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Ok(Some(good))
}

/// Bytes for messages; sizes no machine has are not worth a number.
fn size(bytes: u64) -> String {
    if bytes >= ESTIMATE_DATA_MAX {
        "more memory than any machine has".into()
    } else {
        format_bytes(bytes)
    }
}

/// `bytes` as [`format_bytes`] writes it, but rounded up: a budget raised to the figure shown
/// is enough.
fn at_least(bytes: u64) -> String {
    const UNITS: [(u32, &str); 4] = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
    for (shift, unit) in UNITS {
        if bytes >= 1 << shift {
            let v = (bytes as f64 / (1u64 << shift) as f64 * 100.0).ceil() / 100.0;
            return format!("{v:.2} {unit}");
        }
    }
    format!("{bytes} B")
}

/// A count with thousands separators, e.g. `1,000,000`.
fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_have_separators() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1000), "1,000");
        assert_eq!(count(1_234_567), "1,234,567");
    }

    #[test]
    fn raised_budgets_round_up() {
        assert_eq!(at_least(500), "500 B");
        assert_eq!(at_least(1 << 20), "1.00 MiB");
        assert_eq!(at_least((1 << 20) + 1), "1.01 MiB");
        assert_eq!(format_bytes((1 << 20) + 1), "1.00 MiB");
    }

    #[test]
    fn largest_finds_the_boundary() {
        let f = |limit: usize| move |v: usize| Ok(v <= limit);
        assert_eq!(largest(1, 100, f(37)).unwrap(), Some(37));
        assert_eq!(largest(1, 100, f(100)).unwrap(), Some(100));
        assert_eq!(largest(1, 100, f(1)).unwrap(), Some(1));
        assert_eq!(largest(5, 100, f(3)).unwrap(), None);
        assert_eq!(largest(5, 4, f(3)).unwrap(), None);
        assert_eq!(
            largest(10, usize::MAX - 1, f(1 << 40)).unwrap(),
            Some(1 << 40)
        );
    }
}
