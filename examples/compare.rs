//! Compare training configurations, each run in its own `train_cifar10` child process, against
//! the first one.
//!
//! ```text
//! cargo run --release --example compare -- --run "" --run "--precision f16" --run "--checkpoint stages" \
//!     --common "--max-steps 20 --width 32"
//! cargo run --release --example compare -- --configs configs/*.json -- --max-steps 20
//! ```
//! Prints a markdown table and writes compare.{md,csv,json}, peak_memory.{png,svg},
//! step_peaks.{png,svg}, frontier.{png,svg} (peak memory against images/s, the Pareto
//! frontier marked) and step_timeline.{png,svg} into --out.

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches, Parser};
use memtrain::sweep::compare::{run_compare, CompareOptions, RunSpec};
use memtrain::sweep::{current_command_line, default_out_dir, report, split_flags, TrainerCommand};
use std::path::PathBuf;
use std::time::Duration;

// The points run in this program (see `main`): their CPU memory is measured by this allocator.
#[global_allocator]
static ALLOC: memtrain_core::memory::CountingAllocator = memtrain_core::memory::CountingAllocator;

/// Run several training configurations, each in its own process, and compare their peak memory,
/// speed and accuracy with the first.
#[derive(Debug, Parser)]
#[command(name = "compare", version, long_about = None)]
struct Args {
    /// A configuration as trainer flags, e.g. "--precision f16" (repeatable; "" is the default configuration; "NAME: FLAGS" sets the label)
    #[arg(long = "run", value_name = "FLAGS", allow_hyphen_values = true)]
    runs: Vec<String>,
    /// Configurations as config.json files written by train_cifar10 (each passed as --config FILE)
    #[arg(long, value_name = "FILE", num_args = 1..)]
    configs: Vec<PathBuf>,
    /// Flags for every run, e.g. "--max-steps 20 --width 32" (a run's own flags override them)
    #[arg(long, value_name = "FLAGS", allow_hyphen_values = true)]
    common: Option<String>,
    /// A train_cifar10 binary to run the points with. Default: this program, re-run as the trainer
    #[arg(long, value_name = "PATH")]
    trainer: Option<PathBuf>,
    /// Output directory. Default: runs/compare-<timestamp>
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Kill a run after this many seconds (recorded as failed)
    #[arg(long, value_name = "SECS")]
    timeout: Option<u64>,
    /// No progress bar or progress lines
    #[arg(long)]
    quiet: bool,
    /// More flags for every run, after `--`
    #[arg(last = true, value_name = "COMMON_FLAGS")]
    extra: Vec<String>,
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

    // Keep the command-line order of --run and --configs.
    let mut ordered: Vec<(usize, RunSpec)> = Vec::new();
    for (text, idx) in a
        .runs
        .iter()
        .zip(matches.indices_of("runs").into_iter().flatten())
    {
        ordered.push((idx, RunSpec::from_flags(text)?));
    }
    for (path, idx) in a
        .configs
        .iter()
        .zip(matches.indices_of("configs").into_iter().flatten())
    {
        ordered.push((idx, RunSpec::from_config_file(path)?));
    }
    ordered.sort_by_key(|(i, _)| *i);
    let runs: Vec<RunSpec> = ordered.into_iter().map(|(_, r)| r).collect();
    if runs.is_empty() {
        return Err(memtrain::Error::config(
            "nothing to compare; give --run \"FLAGS\" (repeatable) or --configs FILE… (see --help)",
        )
        .into());
    }
    let mut common = match &a.common {
        Some(c) => split_flags(c)?,
        None => Vec::new(),
    };
    common.extend(a.extra.iter().cloned());

    let trainer = TrainerCommand::new(a.trainer.as_deref())?;
    let out = a.out.clone().unwrap_or_else(|| default_out_dir("compare"));
    let opts = CompareOptions {
        trainer,
        out: out.clone(),
        runs,
        common,
        timeout: a.timeout.map(Duration::from_secs),
        progress: !a.quiet,
        command: current_command_line(),
        // Ctrl-C: the point in flight stops after its current step; no further point starts.
        stop: Some(memtrain::signal::install_stop_handler()?),
    };
    let result = run_compare(&opts)?;
    let charts =
        report::write_compare_report(&out, &result).context("writing the comparison report")?;
    print!("{}", report::compare_markdown(&result));
    report::announce_results(&out, "compare", &charts, result.interrupted, "comparison")?;
    memtrain::sweep::all_failed(result.entries.iter().map(|e| &e.run))?;
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
