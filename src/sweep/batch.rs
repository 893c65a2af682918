//! Batch-size sweeps: a list of batch sizes, or a search for the largest batch that fits a
//! memory limit (doubling, then binary search), over the cross product of configurations.
//! Every point is one child process of the trainer (see [`super::run_child`]).

pub use super::results::{
    describe_max, BatchPlan, MaxBatch, SweepPoint, SweepResult, Variant, DEFAULT_MARGIN,
};
use super::{describe, merge_flags, oom_report_link, run_child, slug, ChildRun, Progress, Status};
use crate::error::{Error, Result};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A swept dimension: a trainer flag (without `--`) and its values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dimension {
    /// Flag name, e.g. `precision`.
    pub flag: String,
    /// Values, e.g. `["f32", "bf16"]`.
    pub values: Vec<String>,
}

/// How a value of a dimension appears in a label.
fn label_part(flag: &str, value: &str) -> String {
    match flag {
        "precision" | "conv" | "optimizer" => value.to_string(),
        "checkpoint" => format!("ckpt={value}"),
        "accum-steps" => format!("accum={value}"),
        other => format!("{other}={value}"),
    }
}

/// The cross product of `dims`, in order (the first dimension varies slowest). Labels name the
/// dimensions with more than one value; when none varies the label names all given values and
/// those of the trainer flags every configuration is `given` (after `--`) that change its
/// configuration's label ([`crate::config::TrainConfig::label`]: not `--synthetic-test 10`), or is
/// `default` when there are none: `--compress-activations int4` → `compress-activations=int4`.
pub fn cross_product(dims: &[Dimension], given: &[String]) -> Vec<Variant> {
    let dims: Vec<&Dimension> = dims.iter().filter(|d| !d.values.is_empty()).collect();
    let mut out = vec![Variant {
        label: String::new(),
        flags: Vec::new(),
    }];
    let any_varies = dims.iter().any(|d| d.values.len() > 1);
    for d in &dims {
        let mut next = Vec::with_capacity(out.len() * d.values.len());
        for v in &out {
            for value in &d.values {
                let mut flags = v.flags.clone();
                flags.push(format!("--{}", d.flag));
                flags.push(value.clone());
                let mut label = v.label.clone();
                if d.values.len() > 1 || !any_varies {
                    if !label.is_empty() {
                        label.push(' ');
                    }
                    label.push_str(&label_part(&d.flag, value));
                }
                next.push(Variant { label, flags });
            }
        }
        out = next;
    }
    if !any_varies {
        // `--a 1 --b --c=2` → `a=1 b c=2`, as the dimensions' values are labelled.
        let label = |flags: &[String]| crate::cli::flags_config(flags).map(|c| c.label()).ok();
        for g in super::flag_groups(given) {
            let Some(flag) = super::flag_name(&g[0]) else {
                continue;
            };
            if label(&g).is_some_and(|l| Some(l) == label(&[])) {
                continue;
            }
            let value = match g[0].split_once('=') {
                Some((_, v)) => v.to_string(),
                None => g[1..].join(" "),
            };
            let part = match value.is_empty() {
                true => flag.to_string(),
                false => label_part(flag, &value),
            };
            for v in &mut out {
                if !v.label.is_empty() {
                    v.label.push(' ');
                }
                v.label.push_str(&part);
            }
        }
    }
    for v in &mut out {
        if v.label.is_empty() {
            v.label = "default".into();
        }
    }
    out
}

/// Everything a sweep needs.
#[derive(Debug, Clone)]
pub struct SweepOptions {
    /// How trainer children are started.
    pub trainer: super::TrainerCommand,
    /// Output directory: results files, charts and one run directory per point.
    pub out: PathBuf,
    /// Configurations (see [`cross_product`]).
    pub variants: Vec<Variant>,
    /// Batch sizes to run.
    pub plan: BatchPlan,
    /// Training steps per point (`--max-steps`).
    pub steps: usize,
    /// Smallest synthetic training set; each point gets `max(this, batch × steps)` images so that
    /// it can run all its steps.
    pub synthetic_train: usize,
    /// Memory limit given to every child (`--memory-limit`) and drawn in the chart.
    pub memory_limit: Option<u64>,
    /// Flags given to every child (width, data dir, device, seed, …).
    pub common: Vec<String>,
    /// Kill a point that runs longer than this (recorded as failed).
    pub timeout: Option<Duration>,
    /// Show progress on stderr.
    pub progress: bool,
    /// The command line, recorded in the results.
    pub command: String,
    /// When set (e.g. by [`crate::signal::install_stop_handler`]), no further point starts; the
    /// result so far comes back with `interrupted` set.
    pub stop: Option<Arc<AtomicBool>>,
}

/// Round `b` up to a multiple of `m`.
fn round_up(b: usize, m: usize) -> usize {
    b.div_ceil(m.max(1)) * m.max(1)
}

/// Greatest common divisor.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The step of the `--find-max` search: the least common multiple of the granularity and the
/// accumulation steps, so that every batch tried is divisible by both.
fn search_step(granularity: usize, accum: usize) -> usize {
    let (g, a) = (granularity.max(1), accum.max(1));
    g / gcd(g, a) * a
}

/// The batch to recommend from the largest that fits: `max_batch × (1 − margin)`, rounded down
/// to a multiple of the search step (the least common multiple of `granularity` and `accum`);
/// where that is 0, rounded down to a multiple of `accum` instead; and at least `accum`, the
/// smallest batch the accumulation allows. E.g. 200 with margin 0.05 and granularity 8 → 184.
pub fn recommended_batch(max_batch: usize, margin: f64, granularity: usize, accum: usize) -> usize {
    let accum = accum.max(1);
    // 1e-9 absorbs the rounding of the product (e.g. 100 × 0.9 must give 90, not 89.99…).
    let target = (max_batch as f64 * (1.0 - margin) + 1e-9).floor().max(0.0) as usize;
    let step = search_step(granularity, accum);
    let mut b = target / step * step;
    if b == 0 {
        b = target / accum * accum;
    }
    b.max(accum)
}

/// Check the options before anything runs.
pub fn validate(opts: &SweepOptions) -> Result<()> {
    if opts.variants.is_empty() {
        return Err(Error::config("no configuration to sweep"));
    }
    if opts.steps == 0 {
        return Err(Error::config("--steps must be at least 1"));
    }
    super::check_timeout(opts.timeout)?;
    match &opts.plan {
        BatchPlan::List(b) => {
            if b.is_empty() {
                return Err(Error::config(
                    "--batch-sizes is empty; give e.g. --batch-sizes 32,64,128 or --find-max",
                ));
            }
            if b.contains(&0) {
                return Err(Error::config("--batch-sizes must be positive"));
            }
        }
        BatchPlan::FindMax {
            start,
            max_batch,
            granularity,
            margin,
        } => {
            if *start == 0 || *granularity == 0 {
                return Err(Error::config(
                    "--start and --granularity must be at least 1",
                ));
            }
            if max_batch < start {
                return Err(Error::config(format!(
                    "--max-batch {max_batch} (the upper bound of the search) is smaller than --start {start}"
                )));
            }
            // Written so that NaN fails too.
            if !(0.0..1.0).contains(margin) {
                return Err(Error::config(format!(
                    "--margin {margin} must be at least 0 and below 1 (e.g. {DEFAULT_MARGIN}: recommend 5% below the largest batch that fits)"
                )));
            }
        }
    }
    Ok(())
}

/// Runs points and keeps the results file up to date.
struct Runner<'a> {
    opts: &'a SweepOptions,
    result: SweepResult,
    progress: Progress,
}

impl Runner<'_> {
    /// The run directory and trainer flags of one point.
    fn point_args(&self, variant: &Variant, batch: usize) -> (PathBuf, Vec<String>) {
        let opts = self.opts;
        let name = format!("{}-b{batch:05}", slug(&variant.label));
        let dir = opts.out.join("points").join(name);
        let synthetic = opts
            .synthetic_train
            .max(batch.saturating_mul(opts.steps))
            .max(10);
        let mut fixed = vec![
            "--batch-size".to_string(),
            batch.to_string(),
            "--max-steps".into(),
            opts.steps.to_string(),
            // As many epochs as steps: a batch that leaves one step per epoch still runs every
            // step the point reports.
            "--epochs".into(),
            opts.steps.to_string(),
            "--synthetic-train".into(),
            synthetic.to_string(),
            "--quiet".into(),
            "--out".into(),
            dir.to_string_lossy().into_owned(),
        ];
        match opts.memory_limit {
            // A batch fits a limit only when its whole run does: the point evaluates, so that
            // the trainer's admission (and the run) counts the evaluation too. On synthetic
            // data one evaluation batch is enough to reach its peak.
            Some(limit) => fixed.extend([
                "--synthetic-test".into(),
                batch.max(10).to_string(),
                "--memory-limit".into(),
                limit.to_string(),
            ]),
            None => fixed.push("--no-eval".into()),
        }
        (dir, merge_flags(&[&opts.common, &variant.flags, &fixed]))
    }

    /// Usage errors before any point runs ([`super::preflight`]): every point of a list, or the
    /// first batch of each configuration's search.
    fn preflight(&self) -> Result<()> {
        let opts = self.opts;
        let mut points = Vec::new();
        for variant in &opts.variants {
            let batches = match &opts.plan {
                BatchPlan::List(sizes) => sizes.clone(),
                BatchPlan::FindMax {
                    start, max_batch, ..
                } => {
                    // The search's first batch (see `search`); flags the trainer refuses are
                    // left for its dry run to name.
                    let flags = merge_flags(&[&opts.common, &variant.flags]);
                    let accum = crate::cli::flags_config(&flags).map_or(1, |c| c.steps.accum_steps);
                    vec![round_up(*start, accum)
                        .min(*max_batch / accum.max(1) * accum)
                        .max(1)]
                }
            };
            for b in batches {
                let what = format!("{} batch {b}", variant.label);
                points.push((what, self.point_args(variant, b).1));
            }
        }
        super::preflight(&opts.trainer, &points)
    }

    /// Run one point (or reuse it when this configuration already ran that batch size).
    fn point(&mut self, variant: &Variant, batch: usize) -> Result<ChildRun> {
        if let Some(p) = self
            .result
            .points
            .iter()
            .find(|p| p.configuration == variant.label && p.batch_size == batch)
        {
            return Ok(p.run.clone());
        }
        let opts = self.opts;
        if opts.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst)) {
            return Err(Error::Interrupted(
                "sweep stopped before all points ran".into(),
            ));
        }
        let (dir, args) = self.point_args(variant, batch);
        let what = format!("{} batch {batch}", variant.label);
        self.progress.start(&what);
        let run = run_child(&opts.trainer.summary_only(), &args, &dir, opts.timeout)?;
        self.progress.finish(&describe(&what, &run));
        self.result.points.push(SweepPoint {
            configuration: variant.label.clone(),
            batch_size: batch,
            oom_report: oom_report_link(&run, &opts.out),
            run: run.clone(),
        });
        super::report::write_sweep_files(&opts.out, &self.result)?;
        Ok(run)
    }

    /// Doubling, then binary search, for one configuration; then the recommended batch.
    fn find_max(
        &mut self,
        variant: &Variant,
        start: usize,
        max_batch: usize,
        granularity: usize,
        margin: f64,
    ) -> Result<MaxBatch> {
        let flags = merge_flags(&[&self.opts.common, &variant.flags]);
        let config = crate::cli::flags_config(&flags)?;
        let accum = config.steps.accum_steps;
        // A batch cannot exceed the training split: with real data the search stops there.
        let data = crate::data::DataOptions::for_config(&config, None);
        let images = crate::data::real_train_images(&data)?.filter(|&n| n < max_batch);
        let mut mb = self.search(
            variant,
            start.min(images.unwrap_or(start)),
            images.unwrap_or(max_batch),
            granularity,
            accum,
        )?;
        if let (Some(n), true) = (images, mb.capped) {
            mb.note = format!("the data set's {n} training images");
        }
        mb.margin = margin;
        mb.recommended = mb
            .max_batch
            .map(|m| recommended_batch(m, margin, granularity, accum));
        Ok(mb)
    }

    /// Binary search on multiples of `step` (each rounded up to a multiple of `accum`) between a
    /// batch that fits (`lo`, or 0) and one that ran out of memory (`hi`); returns the narrowed
    /// pair. A failed point ends it with `note` set.
    fn bisect(
        &mut self,
        variant: &Variant,
        mut lo: usize,
        mut hi: usize,
        step: usize,
        accum: usize,
        note: &mut String,
    ) -> Result<(usize, usize)> {
        // `lo` and `hi` need not be multiples of `step` (doubling from `--start`): the candidates
        // are the multiples strictly between them.
        while hi > lo + 1 {
            let (first, last) = (lo / step * step + step, (hi - 1) / step * step);
            if first > last {
                break;
            }
            let mid = round_up(first + (last - first) / step / 2 * step, accum);
            if mid >= hi {
                break;
            }
            let run = self.point(variant, mid)?;
            match run.status {
                Status::Ok => lo = mid,
                Status::Oom => hi = mid,
                Status::Failed => {
                    *note = format!("search stopped: batch {mid} failed ({})", run.note);
                    break;
                }
            }
        }
        Ok((lo, hi))
    }

    /// Doubling, then binary search, for one configuration with `accum` accumulation steps.
    fn search(
        &mut self,
        variant: &Variant,
        start: usize,
        max_batch: usize,
        granularity: usize,
        accum: usize,
    ) -> Result<MaxBatch> {
        // Every batch size tried must be divisible by the accumulation steps.
        let g = search_step(granularity, accum);
        let mut mb = MaxBatch {
            configuration: variant.label.clone(),
            max_batch: None,
            first_oom: None,
            recommended: None,
            margin: 0.0,
            capped: false,
            note: String::new(),
        };
        let max_batch = max_batch / accum * accum;
        if max_batch == 0 {
            mb.note = format!("--max-batch is smaller than --accum-steps {accum}");
            return Ok(mb);
        }
        let mut b = round_up(start, accum).min(max_batch);
        // Phase 1: double until OOM or the cap.
        loop {
            let run = self.point(variant, b)?;
            match run.status {
                Status::Ok => {
                    mb.max_batch = Some(b);
                    if b >= max_batch {
                        mb.capped = true;
                        return Ok(mb);
                    }
                    b = round_up(b.saturating_mul(2), accum).min(max_batch);
                }
                Status::Oom => {
                    mb.first_oom = Some(b);
                    break;
                }
                Status::Failed => {
                    mb.note = format!("search stopped: batch {b} failed ({})", run.note);
                    return Ok(mb);
                }
            }
        }
        // Phase 2: binary search on multiples of g between the last fit (or 0) and the first OOM;
        // when not even g fits, on multiples of `accum` below it, so that a batch smaller than
        // the granularity that fits is still found.
        let (lo, hi) = (mb.max_batch.unwrap_or(0), mb.first_oom.unwrap_or(b));
        let (mut lo, mut hi) = self.bisect(variant, lo, hi, g, accum, &mut mb.note)?;
        if lo == 0 && mb.note.is_empty() {
            (lo, hi) = self.bisect(variant, lo, hi, accum, accum, &mut mb.note)?;
        }
        mb.max_batch = (lo > 0).then_some(lo);
        mb.first_oom = Some(hi);
        if mb.max_batch.is_none() && mb.note.is_empty() {
            mb.note = format!("even batch {} ran out of memory", hi);
        }
        Ok(mb)
    }
}

/// Run the sweep: every configuration × every batch size of the plan, each point in its own
/// child process. OOM and failed points are recorded and the sweep goes on; when `opts.stop` is
/// set, no further point starts and the result comes back with `interrupted` set. `sweep.json`,
/// `sweep.csv` and `sweep.md` in `opts.out` are rewritten (atomically) after every point; the
/// charts are drawn by [`super::report::write_sweep_report`].
pub fn run_sweep(opts: &SweepOptions) -> Result<SweepResult> {
    validate(opts)?;
    let mut runner = Runner {
        opts,
        result: SweepResult {
            command: opts.command.clone(),
            steps: opts.steps,
            memory_limit_bytes: opts.memory_limit,
            plan: opts.plan.clone(),
            configurations: opts.variants.clone(),
            points: Vec::new(),
            max_batches: Vec::new(),
            interrupted: false,
        },
        // A search's points depend on what the earlier ones measured: no total to count to.
        progress: match &opts.plan {
            BatchPlan::List(b) => {
                Progress::new((b.len() * opts.variants.len()) as u64, opts.progress)
            }
            BatchPlan::FindMax { .. } => Progress::open_ended(opts.progress),
        },
    };
    runner.preflight()?;
    super::ensure_fresh(&opts.out.join("points"))?;
    let made_out = !opts.out.exists();
    crate::io::create_dir(&opts.out)?;
    let outcome = (|| -> Result<()> {
        for variant in &opts.variants {
            match &opts.plan {
                BatchPlan::List(sizes) => {
                    for &b in sizes {
                        runner.point(variant, b)?;
                    }
                }
                BatchPlan::FindMax {
                    start,
                    max_batch,
                    granularity,
                    margin,
                } => {
                    let mb = runner.find_max(variant, *start, *max_batch, *granularity, *margin)?;
                    runner.result.max_batches.push(mb);
                    super::report::write_sweep_files(&opts.out, &runner.result)?;
                }
            }
        }
        Ok(())
    })();
    runner.progress.close();
    match outcome {
        Ok(()) => Ok(runner.result),
        Err(Error::Interrupted(_)) => {
            runner.result.interrupted = true;
            super::report::write_sweep_files(&opts.out, &runner.result)?;
            Ok(runner.result)
        }
        Err(e) => {
            // A usage error (exit 2) promises nothing written: the points before it go too.
            if e.exit_code() == 2 {
                let _ = std::fs::remove_dir_all(opts.out.join("points"));
                for f in ["sweep.json", "sweep.csv", "sweep.md"] {
                    let _ = std::fs::remove_file(opts.out.join(f));
                }
                if made_out {
                    let _ = std::fs::remove_dir(&opts.out);
                }
            }
            Err(e)
        }
    }
}
