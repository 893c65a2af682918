//! The two ends of `bench/budget_sweep.sh`: the `--memory-limit` values to sweep, and the chart
//! and table of the runs.
//!
//! ```text
//! cargo run --release --example budget_sweep -- limits --points 8 \
//!     --trainer target/release/examples/train_cifar10 -- --batch-size 128 --width 32
//! cargo run --release --example budget_sweep -- chart --out docs/results/budget-sweep \
//!     --point runs/budget-sweep/limit-1 … --named runs/budget-sweep/none …
//! ```
//! `limits` prints one limit in bytes per line, evenly spaced from the smallest that the trainer's
//! `--dry-run --checkpoint auto` accepts to the smallest at which it chooses the plain step (each
//! found by bisection over the trainer's own verdicts), and the 32 segmentations' predictions on
//! stderr. `chart` reads each run
//! directory's summary.json and config.json and writes `<out>.csv`, `<out>.png`, `<out>.svg`
//! and a markdown table on stdout; it exits 1 when an `auto` run's peak exceeded its limit. A
//! run's img/s is that of its fastest step after the first (see `fastest_step`).

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use memtrain::memory::format_bytes;
use memtrain::predict::all_segmentations;
use memtrain::predict::checkpointing::format_flops;
use memtrain::sweep::budget_chart::{write_budget_chart, BudgetPoint};
use std::path::{Path, PathBuf};

/// The memory limits of a budget sweep, and its chart.
#[derive(Debug, Parser)]
#[command(name = "budget_sweep", version, long_about = None)]
struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, Subcommand)]
enum What {
    /// Print the --memory-limit values to sweep, one per line in bytes
    Limits {
        /// How many limits
        #[arg(long, default_value_t = 8)]
        points: usize,
        /// The train_cifar10 binary of the runs: its own `--dry-run` verdicts place the two ends
        #[arg(long, value_name = "PATH")]
        trainer: PathBuf,
        /// The training flags of the runs (after --)
        #[arg(last = true)]
        flags: Vec<String>,
    },
    /// Draw the chart and write the CSV of finished runs
    Chart {
        /// Output stem: writes STEM.csv, STEM.png and STEM.svg
        #[arg(long)]
        out: PathBuf,
        /// Chart title
        #[arg(
            long,
            default_value = "memory budget sweep: --checkpoint auto --memory-limit"
        )]
        title: String,
        /// Run directories of one `--checkpoint auto --memory-limit` point, comma-separated (its
        /// repeated runs: the highest peak and the fastest step of them all)
        #[arg(long, value_name = "DIRS")]
        point: Vec<String>,
        /// Run directories of one fixed `--checkpoint` run without a limit, comma-separated
        #[arg(long, value_name = "DIRS")]
        named: Vec<String>,
    },
}

fn limits(points: usize, trainer: &Path, flags: &[String]) -> anyhow::Result<()> {
    if points < 2 {
        bail!("--points must be at least 2, got {points}");
    }
    let cfg = memtrain::cli::flags_config(flags)?;
    let mut peaks = Vec::new();
    for c in all_segmentations(&cfg)? {
        eprintln!(
            "{:>16}: predicted peak {:>10}, recomputes {}",
            c.checkpointing.to_string(),
            format_bytes(c.predicted_peak),
            format_flops(c.recompute_flops)
        );
        peaks.push((c.checkpointing, c.predicted_peak));
    }
    let least = peaks.iter().map(|p| p.1).min().unwrap_or(0);
    let plain = peaks[0].1;
    // The ends are the trainer's own verdicts (on the CPU a limit is the process's resident
    // memory, which holds the trainer's binary: another process cannot compute it): the smallest
    // limit its dry run accepts, and the smallest at which `auto` chooses no recomputation.
    // Between a limit below the smallest heap peak and one far above the plain step's, to the
    // page.
    let (below, above) = (least, 2 * plain + (64 << 20));
    let accepted = |limit| Ok(dry_run_choice(trainer, flags, limit)?.is_some());
    let plain_chosen =
        |limit| Ok(dry_run_choice(trainer, flags, limit)?.as_deref() == Some("none"));
    let lo = smallest(below, above, &accepted)?;
    let hi = smallest(lo - 1, above, &plain_chosen)?;
    eprintln!(
        "limits from {} (the smallest {} accepts; the smallest predicted peak is {}) to {} (where it chooses none, predicted {})",
        format_bytes(lo),
        trainer.display(),
        format_bytes(least),
        format_bytes(hi),
        format_bytes(plain)
    );
    for k in 0..points as u64 {
        println!("{}", lo + (hi - lo) * k / (points as u64 - 1));
    }
    Ok(())
}

/// The trainer's `--dry-run --checkpoint auto --memory-limit LIMIT` verdict with `flags`: `None`
/// when it refuses the limit (exit 2), else the segmentation `auto` chose.
fn dry_run_choice(trainer: &Path, flags: &[String], limit: u64) -> anyhow::Result<Option<String>> {
    let out = std::process::Command::new(trainer)
        .args(flags)
        .args(["--dry-run", "--checkpoint", "auto", "--memory-limit"])
        .arg(limit.to_string())
        .output()
        .with_context(|| format!("{} does not start", trainer.display()))?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(2) => Ok(None),
        Some(0) => {
            let choice = text
                .lines()
                .find_map(|l| l.strip_prefix("--checkpoint auto: "))
                .and_then(|rest| rest.split_whitespace().next())
                .with_context(|| {
                    format!(
                        "{}: no `--checkpoint auto:` line in its dry run",
                        trainer.display()
                    )
                })?;
            Ok(Some(choice.to_string()))
        }
        code => bail!(
            "{} --dry-run exited with {code:?}:\n{text}",
            trainer.display()
        ),
    }
}

/// The smallest limit in `(below, above]`, to 4 KiB, for which `holds` is true, where it is
/// false at `below` and true at `above` (checked) and holds from some limit on.
fn smallest(
    mut below: u64,
    mut above: u64,
    holds: &dyn Fn(u64) -> anyhow::Result<bool>,
) -> anyhow::Result<u64> {
    if holds(below)? || !holds(above)? {
        bail!(
            "the trainer's verdict does not change between {} and {}",
            format_bytes(below),
            format_bytes(above)
        );
    }
    while above - below > 4096 {
        let mid = below + (above - below) / 2;
        if holds(mid)? {
            above = mid;
        } else {
            below = mid;
        }
    }
    Ok(above)
}

/// One run directory as a point (its step peak, the heap the estimate predicts), with its
/// recomputed FLOPs and its resident peak (what a CPU `--memory-limit` bounds).
fn read_point(dir: &Path, auto: bool) -> anyhow::Result<(BudgetPoint, u64, u64)> {
    let read = |f: &str| -> anyhow::Result<serde_json::Value> {
        let p = dir.join(f);
        let text = std::fs::read_to_string(&p).with_context(|| format!("{}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", p.display()))
    };
    let (summary, config) = (read("summary.json")?, read("config.json")?);
    let num = |k: &str| summary[k].as_u64();
    let limit = num("memory_limit_bytes");
    if auto != limit.is_some() {
        bail!(
            "{}: a{} run expected, memory_limit_bytes is {:?}",
            dir.display(),
            if auto { "n auto" } else { " named" },
            limit
        );
    }
    let point = BudgetPoint {
        checkpoint: config["checkpoint"].as_str().unwrap_or("?").to_string(),
        limit,
        predicted_peak: num("predicted_peak_bytes")
            .with_context(|| format!("{}: no predicted peak", dir.display()))?,
        measured_peak: num("step_peak_bytes").unwrap_or(0),
        images_per_sec: fastest_step(dir)?,
    };
    let resident = num("os_peak_bytes").unwrap_or(0);
    Ok((point, num("recompute_flops").unwrap_or(0), resident))
}

/// Images per second of the fastest step after the first (batches.csv): on a machine shared with
/// other work a step can only be slowed down, so the fastest is the least disturbed reading.
fn fastest_step(dir: &Path) -> anyhow::Result<f64> {
    let p = dir.join("batches.csv");
    let text = std::fs::read_to_string(&p).with_context(|| format!("{}", p.display()))?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or("").split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name);
    let (Some(step), Some(images), Some(secs)) =
        (col("global_step"), col("images"), col("step_secs"))
    else {
        bail!(
            "{}: no global_step, images and step_secs columns",
            p.display()
        );
    };
    let best = lines
        .map(|l| l.split(',').collect::<Vec<&str>>())
        // Steps count from 1: the first is the warm-up.
        .filter(|f| f.get(step).and_then(|s| s.parse::<usize>().ok()) > Some(1))
        .filter_map(|f| {
            Some(f.get(images)?.parse::<f64>().ok()? / f.get(secs)?.parse::<f64>().ok()?)
        })
        .fold(0.0f64, f64::max);
    if best <= 0.0 {
        bail!("{}: fewer than 2 timed steps", p.display());
    }
    Ok(best)
}

/// The repeated runs of one point as one: the same segmentation and limit, the highest measured peak,
/// the fastest step, the highest resident peak.
fn read_group(dirs: &str, auto: bool) -> anyhow::Result<(BudgetPoint, u64, u64)> {
    let mut runs = dirs.split(',').map(|d| read_point(Path::new(d), auto));
    let (mut point, flops, mut resident) = runs.next().context("an empty run list")??;
    for r in runs {
        let (p, _, rss) = r?;
        resident = resident.max(rss);
        if (&p.checkpoint, p.limit) != (&point.checkpoint, point.limit) {
            bail!("{dirs}: the runs of one point trained different segmentations or limits");
        }
        point.measured_peak = point.measured_peak.max(p.measured_peak);
        point.images_per_sec = point.images_per_sec.max(p.images_per_sec);
    }
    Ok((point, flops, resident))
}

fn chart(out: &Path, title: &str, auto: &[String], named: &[String]) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for (groups, is_auto) in [(auto, true), (named, false)] {
        for g in groups {
            rows.push(read_group(g, is_auto)?);
        }
    }
    let mut csv = String::from(
        "checkpoint,memory_limit_bytes,predicted_peak_bytes,measured_peak_bytes,prediction_error_pct,resident_peak_bytes,fits,images_per_sec,recompute_flops\n",
    );
    println!("| --memory-limit | auto chose | recomputes | predicted step peak | measured step peak | error | resident peak | fits | img/s |");
    println!("|---:|---|---:|---:|---:|---:|---:|---|---:|");
    let mut over = 0;
    for (p, flops, resident) in &rows {
        let err =
            (p.predicted_peak as f64 - p.measured_peak as f64) / p.measured_peak as f64 * 100.0;
        // A CPU limit is the resident memory (the heap the estimate predicts sits inside it).
        let fits = p.limit.map(|l| *resident <= l);
        over += usize::from(fits == Some(false));
        // Quoted: `segments:1,2` has commas.
        csv.push_str(&format!(
            "\"{}\",{},{},{},{:.2},{},{},{:.1},{}\n",
            p.checkpoint,
            p.limit.map_or(String::new(), |l| l.to_string()),
            p.predicted_peak,
            p.measured_peak,
            err,
            resident,
            fits.map_or(String::new(), |f| f.to_string()),
            p.images_per_sec,
            flops
        ));
        println!(
            "| {} | {} | {} | {} | {} | {err:+.2}% | {} | {} | {:.0} |",
            p.limit.map_or("— (fixed)".into(), format_bytes),
            p.checkpoint,
            format_flops(*flops),
            format_bytes(p.predicted_peak),
            format_bytes(p.measured_peak),
            format_bytes(*resident),
            fits.map_or("—", |f| if f { "yes" } else { "NO" }),
            p.images_per_sec
        );
    }
    let csv_path = out.with_extension("csv");
    memtrain::io::write_atomic(&csv_path, csv.as_bytes())
        .with_context(|| format!("{}", csv_path.display()))?;
    let points: Vec<BudgetPoint> = rows.into_iter().map(|r| r.0).collect();
    for f in write_budget_chart(&points, title, out)? {
        eprintln!("wrote {}", f.display());
    }
    if over > 0 {
        bail!("{over} auto run(s) measured more than their --memory-limit");
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let r = match &args.what {
        What::Limits {
            points,
            trainer,
            flags,
        } => limits(*points, trainer, flags),
        What::Chart {
            out,
            title,
            point,
            named,
        } => chart(out, title, point, named),
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
