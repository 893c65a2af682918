//! Sweep batch sizes (or search for the largest batch that fits) over one or more
//! configurations, each point in its own `train_cifar10` child process.
//!
//! ```text
//! cargo run --release --example batch_sweep -- --batch-sizes 32,64,128,256,512 --precision f32,f16
//! cargo run --release --example batch_sweep -- --find-max --memory-limit 300MiB --checkpoint none,stages
//! ```
//! Prints a markdown table and writes sweep.{md,csv,json,png,svg} and frontier.{png,svg} (peak
//! memory against images/s, the Pareto frontier marked) into --out.

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches, Parser};
use memtrain::config::{
    parse_size, ConvKind, GradCheckpointing, OptimizerKind, Precision, TrainConfig,
};
use memtrain::sweep::batch::{
    cross_product, run_sweep, BatchPlan, Dimension, SweepOptions, DEFAULT_MARGIN,
};
use memtrain::sweep::{current_command_line, default_out_dir, report, TrainerCommand};
use std::path::PathBuf;
use std::time::Duration;

// The points run in this program (see `main`): their CPU memory is measured by this allocator.
#[global_allocator]
static ALLOC: memtrain_core::memory::CountingAllocator = memtrain_core::memory::CountingAllocator;

/// Measure peak memory and throughput across batch sizes and configurations; each point runs
/// `train_cifar10` for a few steps in its own process (an out-of-memory point is a result, not a failure).
#[derive(Debug, Parser)]
#[command(name = "batch_sweep", version, long_about = None)]
struct Args {
    /// The batch sizes.
    #[command(flatten)]
    batch_plan: BatchPlanArgs,
    /// Training steps per point
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// The settings swept.
    #[command(flatten)]
    variants: VariantArgs,
    /// What every point shares.
    #[command(flatten)]
    common: CommonArgs,
    /// A train_cifar10 binary to run the points with. Default: this program, re-run as the trainer
    #[arg(long, value_name = "PATH")]
    trainer: Option<PathBuf>,
    /// Output directory. Default: runs/sweep-<timestamp>
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Kill a point after this many seconds (recorded as failed)
    #[arg(long, value_name = "SECS")]
    timeout: Option<u64>,
    /// No progress bar or progress lines
    #[arg(long)]
    quiet: bool,
    /// More trainer flags for every point, after `--` (e.g. -- --lr 0.05 --synthetic-test 100)
    #[arg(last = true, value_name = "TRAINER_FLAGS")]
    extra: Vec<String>,
}

/// The batch sizes: a list to run, or the `--find-max` search.
#[derive(Debug, clap::Args)]
// Like the other groups below, only a grouping in code: no clap group of flags.
#[group(skip)]
struct BatchPlanArgs {
    /// Batch sizes to run, comma-separated. Default (without --find-max): 32,64,128,256,512
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LIST",
        conflicts_with = "find_max"
    )]
    batch_sizes: Vec<usize>,
    /// Search for the largest batch that fits --memory-limit (or the device): double from --start until out of memory or --max-batch, then binary-search
    #[arg(long)]
    find_max: bool,
    /// --find-max: first batch size tried
    #[arg(long, default_value_t = 32, requires = "find_max")]
    start: usize,
    /// --find-max: upper bound of the search, the largest batch size tried (at least --start)
    #[arg(long, default_value_t = 8192, requires = "find_max")]
    max_batch: usize,
    /// --find-max: resolution of the binary search, in images
    #[arg(long, default_value_t = 8, requires = "find_max")]
    granularity: usize,
    /// --find-max: safety margin in [0, 1); also reports the recommended batch = largest that fits x (1 - margin), rounded down to a multiple of --granularity and --accum-steps
    #[arg(long, default_value_t = DEFAULT_MARGIN, requires = "find_max", allow_negative_numbers = true)]
    margin: f64,
}

/// The settings swept besides the batch size: every combination of their values is a
/// configuration.
#[derive(Debug, clap::Args)]
#[group(skip)]
struct VariantArgs {
    /// Precisions to sweep, comma-separated (f32, f16, bf16)
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LIST",
        hide_possible_values = true
    )]
    precision: Vec<Precision>,
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LIST",
        hide_possible_values = true,
        help = format!(
            "Gradient checkpointing modes to sweep, comma-separated ({}; the tables say what auto chose)",
            GradCheckpointing::ALL
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )
    )]
    checkpoint: Vec<GradCheckpointing>,
    /// Convolution kinds to sweep, comma-separated (standard, separable)
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LIST",
        hide_possible_values = true
    )]
    conv: Vec<ConvKind>,
    /// Gradient-accumulation steps to sweep, comma-separated (each must divide the batch size)
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    accum_steps: Vec<usize>,
    /// Optimizers to sweep, comma-separated (sgd, adamw)
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LIST",
        hide_possible_values = true
    )]
    optimizer: Vec<OptimizerKind>,
}

/// Trainer settings that every point shares.
#[derive(Debug, clap::Args)]
#[group(skip)]
struct CommonArgs {
    // Help texts name the trainer's defaults from TrainConfig rather than copies of them.
    #[arg(long, help = format!("Base width of the CNN (trainer default: {})", TrainConfig::default().model.width))]
    width: Option<usize>,
    /// CIFAR-10 binary directory (trainer default: synthetic data unless data/cifar-10-batches-bin exists)
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Device: cpu, cuda or cuda:N (trainer default: cuda when available)
    #[arg(long)]
    device: Option<String>,
    /// Memory limit for every point, e.g. 300MiB (CPU: the process's resident memory, as train_cifar10's --memory-limit; CUDA: hard pool limit); drawn in the chart
    #[arg(long, value_name = "SIZE")]
    memory_limit: Option<String>,
    #[arg(long, help = format!("Seed (trainer default: {})", TrainConfig::default().seed))]
    seed: Option<u64>,
    /// Smallest synthetic training set; each point gets max(this, batch x steps) images
    #[arg(long, default_value_t = TrainConfig::default().data.synthetic_train)]
    synthetic_train: usize,
}

fn dim<T: ToString>(flag: &str, values: &[T]) -> Dimension {
    Dimension {
        flag: flag.to_string(),
        values: values.iter().map(ToString::to_string).collect(),
    }
}

fn run() -> anyhow::Result<()> {
    let matches = match Args::command().try_get_matches() {
        Ok(m) => m,
        Err(e) => {
            print!("{}", memtrain::cli::clap_error(e)?);
            return Ok(());
        }
    };
    let a = Args::from_arg_matches(&matches).map_err(|e| memtrain::Error::config(e.to_string()))?;

    let plan = if a.batch_plan.find_max {
        BatchPlan::FindMax {
            start: a.batch_plan.start,
            max_batch: a.batch_plan.max_batch,
            granularity: a.batch_plan.granularity,
            margin: a.batch_plan.margin,
        }
    } else if a.batch_plan.batch_sizes.is_empty() {
        BatchPlan::List(vec![32, 64, 128, 256, 512])
    } else {
        BatchPlan::List(a.batch_plan.batch_sizes.clone())
    };
    let memory_limit = a
        .common
        .memory_limit
        .as_deref()
        .map(parse_size)
        .transpose()?;
    let variants = cross_product(
        &[
            dim("precision", &a.variants.precision),
            dim("checkpoint", &a.variants.checkpoint),
            dim("conv", &a.variants.conv),
            dim("accum-steps", &a.variants.accum_steps),
            dim("optimizer", &a.variants.optimizer),
        ],
        &a.extra,
    );
    let mut common = Vec::new();
    if let Some(w) = a.common.width {
        common.extend(["--width".to_string(), w.to_string()]);
    }
    if let Some(d) = &a.common.data_dir {
        common.extend(["--data-dir".to_string(), d.to_string_lossy().into_owned()]);
    }
    if let Some(d) = &a.common.device {
        common.extend(["--device".to_string(), d.clone()]);
    }
    if let Some(s) = a.common.seed {
        common.extend(["--seed".to_string(), s.to_string()]);
    }
    common.extend(a.extra.iter().cloned());

    let trainer = TrainerCommand::new(a.trainer.as_deref())?;
    let out = a.out.clone().unwrap_or_else(|| default_out_dir("sweep"));
    let opts = SweepOptions {
        trainer,
        out: out.clone(),
        variants,
        plan,
        steps: a.steps,
        synthetic_train: a.common.synthetic_train,
        memory_limit,
        common,
        timeout: a.timeout.map(Duration::from_secs),
        progress: !a.quiet,
        command: current_command_line(),
        // Ctrl-C: the point in flight stops after its current step; no further point starts.
        stop: Some(memtrain::signal::install_stop_handler()?),
    };
    let result = run_sweep(&opts)?;
    let charts = report::write_sweep_report(&out, &result).context("writing the sweep report")?;
    // The table, followed by one line per configuration for --find-max.
    print!("{}", report::sweep_markdown(&result));
    report::announce_results(&out, "sweep", &charts, result.interrupted, "sweep")?;
    memtrain::sweep::all_failed(result.points.iter().map(|p| &p.run))?;
    Ok(())
}

fn main() {
    memtrain::signal::default_sigpipe();
    // A point of a sweep: this program re-run as the trainer.
    memtrain::app::serve_as_trainer();
    if let Err(e) = run() {
        let code = e
            .downcast_ref::<memtrain::Error>()
            .map_or(1, memtrain::Error::exit_code);
        eprintln!("error: {e:#}");
        std::process::exit(code);
    }
}
