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
//! `--dry-run --checkpoint auto` (with `--codes`, also `--compress-activations auto`) accepts to
//! the smallest at which it chooses the plain step (each found by bisection over the trainer's own
//! verdicts), and the plans' predictions on stderr. `chart` reads each run directory's
//! summary.json and config.json (and `cgroup.json`, what the script read from the run's memory
//! cgroup) and writes `<out>.csv`, `<out>.png`, `<out>.svg` and a markdown table on stdout, with
//! `--accuracy` the 20-epoch accuracy cost of each point's codes; it exits 1 when an `auto` run's
//! peak exceeded its limit or its cgroup killed it. A run's img/s is that of its fastest step
//! after the first (see `fastest_step`).

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use memtrain::config::CompressActivations;
use memtrain::predict::all_segmentations;
use memtrain::predict::checkpointing::format_flops;
use memtrain::sweep::budget_chart::{write_budget_chart, BudgetPoint};
use memtrain_core::memory::format_bytes;
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
        /// Let the runs choose the codes too (`--compress-activations auto`): the lower end is
        /// then the lossy floor
        #[arg(long)]
        codes: bool,
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
        /// Run directories of one fixed plan run without a limit, comma-separated
        #[arg(long, value_name = "DIRS")]
        named: Vec<String>,
        /// The held-out accuracy per code and seed (bench/activation_codes_accuracy.sh's JSON):
        /// each point's accuracy change against the exact step on the same seeds
        #[arg(long, value_name = "FILE")]
        accuracy: Option<PathBuf>,
    },
}

fn limits(points: usize, trainer: &Path, codes: bool, flags: &[String]) -> anyhow::Result<()> {
    if points < 2 {
        bail!("--points must be at least 2, got {points}");
    }
    let mut cfg = memtrain::cli::flags_config(flags)?;
    if codes {
        cfg.memory.compress_activations = CompressActivations::Auto;
    }
    let mut peaks = Vec::new();
    for c in all_segmentations(&cfg)? {
        eprintln!(
            "{:>16} {:>4}: predicted peak {:>10}, recomputes {}",
            c.checkpointing.to_string(),
            c.storage.to_string(),
            format_bytes(c.predicted_peak),
            format_flops(c.recompute_flops)
        );
        peaks.push((c.checkpointing.to_string(), c.storage, c.predicted_peak));
    }
    let least = peaks.iter().map(|p| p.2).min().unwrap_or(0);
    let plain = peaks
        .iter()
        .find(|p| p.0 == "none" && !p.1.is_lossy())
        .context("no plain step among the plans")?
        .2;
    let choice = |limit| dry_run_choice(trainer, flags, codes, limit);
    // The ends are the trainer's own verdicts (on the CPU a limit is the process's resident
    // memory, which holds the trainer's binary: another process cannot compute it): the smallest
    // limit its dry run accepts, and the smallest at which `auto` chooses no recomputation.
    // Between a limit below the smallest heap peak and one far above the plain step's, to the
    // page.
    let (below, above) = (least, 2 * plain + (64 << 20));
    let accepted = |limit| Ok(choice(limit)?.is_some());
    // `none` is the plain step (`int8` would be codes without checkpointing).
    let plain_chosen = |limit| Ok(choice(limit)?.as_deref() == Some("none"));
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

/// The trainer's `--dry-run --checkpoint auto [--compress-activations auto] --memory-limit LIMIT`
/// verdict with `flags`: `None` when it refuses the limit (exit 2), else the plan `auto` chose
/// (`stages`, or `stages + int8` for codes).
fn dry_run_choice(
    trainer: &Path,
    flags: &[String],
    codes: bool,
    limit: u64,
) -> anyhow::Result<Option<String>> {
    let mut auto = vec!["--checkpoint", "auto"];
    if codes {
        auto.extend(["--compress-activations", "auto"]);
    }
    let prefix = format!("{}: ", auto.join(" "));
    let out = std::process::Command::new(trainer)
        .args(flags)
        .arg("--dry-run")
        .args(&auto)
        .arg("--memory-limit")
        .arg(limit.to_string())
        .output()
        .with_context(|| format!("{} does not start", trainer.display()))?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(2) => Ok(None),
        Some(0) => {
            // `stages (segments …` or, with codes, `segmentation stages, activations int8 (lossy…`.
            let line = text
                .lines()
                .find_map(|l| l.strip_prefix(prefix.as_str()))
                .with_context(|| {
                    format!("{}: no `{prefix}` line in its dry run", trainer.display())
                })?;
            let line = line.strip_prefix("segmentation ").unwrap_or(line);
            let mut words = line.split_whitespace();
            let seg = words.next().unwrap_or("?").trim_end_matches(',');
            let storage = line
                .split_once(", activations ")
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .unwrap_or("none");
            Ok(Some(plan_label(seg, storage)))
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

/// A plan as the chart names it: the segmentation (`stages`), the codes alone without
/// checkpointing (`int8`), or both (`stages + int8`).
fn plan_label(segmentation: &str, storage: &str) -> String {
    match (segmentation, storage) {
        (seg, "none") => seg.to_string(),
        ("none", codes) => codes.to_string(),
        (seg, codes) => format!("{seg} + {codes}"),
    }
}

/// What the script read from a run's memory cgroup (`cgroup.json`): its limit, the most it
/// charged, and the processes it killed for memory.
#[derive(Debug, Clone, Copy, Default)]
struct CgroupReading {
    limit: u64,
    max_usage: u64,
    oom_kills: u64,
}

fn read_cgroup(dir: &Path) -> anyhow::Result<Option<CgroupReading>> {
    let p = dir.join("cgroup.json");
    if !p.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&p).with_context(|| format!("{}", p.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", p.display()))?;
    let num = |k: &str| {
        v[k].as_u64()
            .with_context(|| format!("{}: no {k}", p.display()))
    };
    Ok(Some(CgroupReading {
        limit: num("limit_bytes")?,
        max_usage: num("max_usage_bytes")?,
        oom_kills: num("oom_kills")?,
    }))
}

/// One run of a point: the point, its recomputed FLOPs, its resident peak (what a CPU
/// `--memory-limit` bounds), its codes and its cgroup reading.
struct Run {
    point: BudgetPoint,
    flops: u64,
    resident: u64,
    storage: String,
    cgroup: Option<CgroupReading>,
}

/// One run directory as a point (its step peak, the heap the estimate predicts), with its
/// recomputed FLOPs and its resident peak (what a CPU `--memory-limit` bounds).
fn read_point(dir: &Path, auto: bool) -> anyhow::Result<Run> {
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
    let storage = config["compress_activations"]
        .as_str()
        .unwrap_or("none")
        .to_string();
    let point = BudgetPoint {
        plan: plan_label(config["checkpoint"].as_str().unwrap_or("?"), &storage),
        limit,
        predicted_peak: num("predicted_peak_bytes")
            .with_context(|| format!("{}: no predicted peak", dir.display()))?,
        measured_peak: num("step_peak_bytes").unwrap_or(0),
        images_per_sec: fastest_step(dir)?,
    };
    Ok(Run {
        point,
        flops: num("recompute_flops").unwrap_or(0),
        resident: num("os_peak_bytes").unwrap_or(0),
        storage,
        cgroup: read_cgroup(dir)?,
    })
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

/// The repeated runs of one point as one: the same plan and limit, the highest measured peak, the
/// fastest step, the highest resident peak and cgroup usage, every cgroup kill.
fn read_group(dirs: &str, auto: bool) -> anyhow::Result<Run> {
    let mut runs = dirs.split(',').map(|d| read_point(Path::new(d), auto));
    let mut group = runs.next().context("an empty run list")??;
    for r in runs {
        let r = r?;
        if (&r.point.plan, r.point.limit) != (&group.point.plan, group.point.limit) {
            bail!("{dirs}: the runs of one point trained different plans or limits");
        }
        group.resident = group.resident.max(r.resident);
        group.point.measured_peak = group.point.measured_peak.max(r.point.measured_peak);
        group.point.images_per_sec = group.point.images_per_sec.max(r.point.images_per_sec);
        group.cgroup = match (group.cgroup, r.cgroup) {
            (Some(a), Some(b)) => Some(CgroupReading {
                limit: a.limit,
                max_usage: a.max_usage.max(b.max_usage),
                oom_kills: a.oom_kills + b.oom_kills,
            }),
            (a, b) => a.or(b),
        };
    }
    Ok(group)
}

/// Percentage points of held-out accuracy each code changes against the exact step over the
/// seeds both were run with (the mean of the per-seed differences: seeds differ by several
/// points), and how many seeds that is, from bench/activation_codes_accuracy.sh's JSON (`runs`).
fn accuracy_changes(path: &Path) -> anyhow::Result<Vec<(String, f64, u64)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let runs = v["runs"]
        .as_array()
        .with_context(|| format!("{}: no runs", path.display()))?;
    let run = |r: &serde_json::Value| {
        Some((
            r["compress_activations"].as_str()?.to_string(),
            r["seed"].as_u64()?,
            r["accuracy"].as_f64()?,
        ))
    };
    let runs: Vec<(String, u64, f64)> = runs.iter().filter_map(run).collect();
    let exact = |seed: u64| {
        runs.iter()
            .find(|(c, s, _)| c == "none" && *s == seed)
            .map(|r| r.2)
    };
    let mut codes: Vec<String> = runs.iter().map(|r| r.0.clone()).collect();
    codes.sort();
    codes.dedup();
    Ok(codes
        .into_iter()
        .filter(|c| c != "none")
        .filter_map(|code| {
            let diffs: Vec<f64> = runs
                .iter()
                .filter(|(c, ..)| *c == code)
                .filter_map(|(_, seed, acc)| Some(acc - exact(*seed)?))
                .collect();
            let n = diffs.len();
            (n > 0).then(|| (code, diffs.iter().sum::<f64>() / n as f64 * 100.0, n as u64))
        })
        .collect())
}

fn chart(
    out: &Path,
    title: &str,
    auto: &[String],
    named: &[String],
    accuracy: Option<&Path>,
) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for (groups, is_auto) in [(auto, true), (named, false)] {
        for g in groups {
            rows.push(read_group(g, is_auto)?);
        }
    }
    let changes = accuracy.map(accuracy_changes).transpose()?;
    // A lossy plan's accuracy change: (points, seeds) of its codes' mean against the exact one.
    let change_of = |storage: &str| -> Option<(f64, u64)> {
        let c = changes.as_ref()?;
        if storage == "none" {
            return Some((0.0, 0));
        }
        c.iter()
            .find(|(code, ..)| code == storage)
            .map(|&(_, pts, seeds)| (pts, seeds))
    };
    let shown = |storage: &str| match change_of(storage) {
        None => "—".to_string(),
        Some((_, 0)) => "exact".to_string(),
        Some((pts, seeds)) => format!(
            "{pts:+.2} points ({seeds} seed{})",
            if seeds == 1 { "" } else { "s" }
        ),
    };
    let mut csv = String::from(
        "plan,memory_limit_bytes,predicted_peak_bytes,measured_peak_bytes,prediction_error_pct,resident_peak_bytes,cgroup_max_usage_bytes,cgroup_oom_kills,fits,images_per_sec,recompute_flops,accuracy_change_points,accuracy_seeds\n",
    );
    println!("| --memory-limit | auto chose | recomputes | predicted step peak | measured step peak | error | resident peak | cgroup peak | fits | img/s | accuracy vs exact (20 epochs) |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|");
    let mut over = 0;
    for r in &rows {
        let p = &r.point;
        let err =
            (p.predicted_peak as f64 - p.measured_peak as f64) / p.measured_peak as f64 * 100.0;
        // A CPU limit is the resident memory (the heap the estimate predicts sits inside it); a
        // run in a cgroup of the limit must also not have been killed by it.
        let fits = p
            .limit
            .map(|l| r.resident <= l && r.cgroup.is_none_or(|c| c.oom_kills == 0 && c.limit <= l));
        over += usize::from(fits == Some(false));
        let change = change_of(&r.storage);
        // Quoted: `segments:1,2` has commas.
        csv.push_str(&format!(
            "\"{}\",{},{},{},{:.2},{},{},{},{},{:.1},{},{},{}\n",
            p.plan,
            p.limit.map_or(String::new(), |l| l.to_string()),
            p.predicted_peak,
            p.measured_peak,
            err,
            r.resident,
            r.cgroup.map_or(String::new(), |c| c.max_usage.to_string()),
            r.cgroup.map_or(String::new(), |c| c.oom_kills.to_string()),
            fits.map_or(String::new(), |f| f.to_string()),
            p.images_per_sec,
            r.flops,
            change.map_or(String::new(), |c| format!("{:.2}", c.0)),
            change.map_or(String::new(), |c| c.1.to_string())
        ));
        println!(
            "| {} | {} | {} | {} | {} | {err:+.2}% | {} | {} | {} | {:.0} | {} |",
            p.limit.map_or("— (fixed)".into(), format_bytes),
            p.plan,
            format_flops(r.flops),
            format_bytes(p.predicted_peak),
            format_bytes(p.measured_peak),
            format_bytes(r.resident),
            r.cgroup.map_or("—".into(), |c| format_bytes(c.max_usage)),
            fits.map_or("—", |f| if f { "yes" } else { "NO" }),
            p.images_per_sec,
            shown(&r.storage)
        );
    }
    let csv_path = out.with_extension("csv");
    memtrain::io::write_atomic(&csv_path, csv.as_bytes())
        .with_context(|| format!("{}", csv_path.display()))?;
    // The legend names each lossy auto plan's accuracy change.
    let points: Vec<BudgetPoint> = rows
        .into_iter()
        .map(|r| {
            let mut p = r.point;
            if p.limit.is_some() && r.storage != "none" && change_of(&r.storage).is_some() {
                p.plan = format!("{}: accuracy {}", p.plan, shown(&r.storage));
            }
            p
        })
        .collect();
    for f in write_budget_chart(&points, title, out)? {
        eprintln!("wrote {}", f.display());
    }
    if over > 0 {
        bail!("{over} auto point(s) measured more than their --memory-limit or were killed by its cgroup");
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    memtrain::signal::default_sigpipe();
    let args = Args::parse();
    let r = match &args.what {
        What::Limits {
            points,
            trainer,
            codes,
            flags,
        } => limits(*points, trainer, *codes, flags),
        What::Chart {
            out,
            title,
            point,
            named,
            accuracy,
        } => chart(out, title, point, named, accuracy.as_deref()),
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
