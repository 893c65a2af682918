//! Tables (markdown, CSV, JSON) and charts (PNG and SVG, drawn with plotters) of sweeps,
//! comparisons and single runs.
//!
//! The charts are drawn with `sweep::chart` (embedded font, PNG and SVG). Every file is written
//! atomically (see [`crate::io::write_atomic`]).
//!
//! - [`write_sweep_report`]: `sweep.{json,csv,md}`, `sweep.{png,svg}` (peak memory and
//!   images/s versus batch size, OOM points marked, the limit drawn as a line) and
//!   `frontier.{png,svg}` (peak memory against images/s of every point that ran, the Pareto
//!   frontier marked; see [`super::frontier`]).
//! - [`write_compare_report`]: `compare.{json,csv,md}`, `peak_memory.{png,svg}` (a bar per
//!   configuration, labelled with its value), `step_peaks.{png,svg}` (each step's peak
//!   memory, for every configuration, from each run's `batches.csv`), `frontier.{png,svg}` and
//!   `step_timeline.{png,svg}` (see [`super::step_overlay::write_step_timeline_overlays`]).
//!
//! The markdown tables mark the frontier points in a `frontier` column, and link each
//! out-of-memory point's `oom_report.json` when its run wrote one.
//! - [`write_run_memory_chart`]: `memory.{png,svg}` of one run directory.

use super::chart::{render, LIMIT_COLOR, PALETTE};
use super::frontier::{
    frontier_legend, pareto_front, write_frontier_chart, FrontierPoint, FRONTIER_CHART,
};
use super::report_charts::*;
use super::results::{CompareResult, SweepResult};
use super::{ChildRun, Status};
use crate::callbacks::log::{read_batch_log, BATCHES_CSV, MEMORY_JSON};
use crate::config::GradCheckpointing;
use crate::error::{Error, Result};
use crate::io::{write_atomic, write_json_atomic};
use memtrain_core::memory::format_bytes;
use memtrain_core::memory::MemoryLog;
use plotters::prelude::*;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

// ---------------------------------------------------------------------------------------------
// CSV
// ---------------------------------------------------------------------------------------------

/// CSV text: the header line (plain comma-separated names) and the rows, each field quoted
/// where it needs to be (the `csv` crate's RFC 4180 writer), lines ending in `\n`.
fn csv_text(header: &str, rows: impl IntoIterator<Item = Vec<String>>) -> String {
    let mut w = csv::WriterBuilder::new()
        .terminator(csv::Terminator::Any(b'\n'))
        .from_writer(Vec::new());
    // Writing into memory cannot fail; a failure would be a bug in the row shapes.
    w.write_record(header.split(','))
        .expect("a CSV header writes into memory");
    for row in rows {
        w.write_record(&row).expect("a CSV row writes into memory");
    }
    let bytes = w.into_inner().expect("the CSV writer flushes into memory");
    String::from_utf8(bytes).expect("CSV of UTF-8 fields is UTF-8")
}

/// A parsed CSV file: a header and rows of fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CsvTable {
    /// Column names.
    pub header: Vec<String>,
    /// Rows; each has as many fields as the header.
    pub rows: Vec<Vec<String>>,
}

impl CsvTable {
    /// Parse CSV text (RFC 4180 quoting, by the `csv` crate; the first record is the header).
    /// A row with another number of fields than the header is an error.
    pub fn parse(text: &str) -> Result<CsvTable> {
        let mut reader = csv::ReaderBuilder::new().from_reader(text.as_bytes());
        let bad = |e: csv::Error| Error::config(format!("CSV: {e}"));
        let header = reader
            .headers()
            .map_err(bad)?
            .iter()
            .map(String::from)
            .collect::<Vec<_>>();
        if header.is_empty() {
            return Err(Error::config("CSV: empty file"));
        }
        let rows = reader
            .records()
            .map(|r| Ok(r.map_err(bad)?.iter().map(String::from).collect()))
            .collect::<Result<Vec<Vec<String>>>>()?;
        Ok(CsvTable { header, rows })
    }

    /// Index of a column.
    pub fn column(&self, name: &str) -> Option<usize> {
        self.header.iter().position(|h| h == name)
    }

    /// Field `name` of row `row` (`None` when the column does not exist).
    pub fn get(&self, row: usize, name: &str) -> Option<&str> {
        let c = self.column(name)?;
        self.rows.get(row).map(|r| r[c].as_str())
    }
}

/// The typed memory log (`memory.json`) of a run directory, as
/// [`crate::callbacks::log::MetricsLogger`] writes it: the per-step records the charts draw.
pub fn read_memory_log(run_dir: &Path) -> Result<MemoryLog> {
    let path = run_dir.join(MEMORY_JSON);
    let bytes =
        crate::io::read_capped(&path, MAX_MEMORY_LOG_BYTES).map_err(|e| Error::io(&path, e))?;
    serde_json::from_slice(&bytes)
        .map(MemoryLog::numbered)
        .map_err(|e| Error::Data {
            path: path.clone(),
            msg: format!("not a memtrain memory log ({e})"),
        })
}

/// A memory log is a few hundred bytes per step; this is millions of steps.
const MAX_MEMORY_LOG_BYTES: u64 = 1 << 30;

fn opt_u64(v: Option<u64>) -> String {
    v.map(|x| x.to_string()).unwrap_or_default()
}

fn opt_f64(v: Option<f64>, digits: usize) -> String {
    v.map(|x| format!("{x:.digits$}")).unwrap_or_default()
}

/// The CSV columns baseline_bytes, peak_above_baseline_bytes, run_peak_bytes, run_peak_phase
/// and reserved_peak_bytes of a child run (sweeps and comparisons alike).
fn memory_cells(run: &ChildRun) -> [String; 5] {
    let run_peak = run.run_peak();
    [
        opt_u64(run.baseline_bytes()),
        opt_u64(run.peak_above_baseline()),
        opt_u64(run_peak.map(|p| p.0)),
        run_peak
            .and_then(|p| p.1)
            .map(String::from)
            .unwrap_or_default(),
        opt_u64(run.reserved_peak_bytes()),
    ]
}

/// What a run's `step_timeline.json` says of its last step: the bytes the step added above its
/// start at its peak, and the most activation bytes the tape held for the backward. `None` when
/// the run wrote no timeline (it failed, or an older version ran it).
fn step_figures(run: &ChildRun) -> Option<(u64, u64)> {
    let path = run
        .run_dir
        .join(memtrain_core::memory::timeline::STEP_TIMELINE_FILE);
    let t = super::step_chart::read_step_timeline(&path).ok()??;
    if t.events.is_empty() {
        return None;
    }
    let saved = t
        .events
        .iter()
        .map(|e| e.categories.saved)
        .max()
        .unwrap_or(0);
    Some((t.peak_bytes().saturating_sub(t.start_bytes), saved))
}

/// The CSV columns steps, wall_secs, exit_code, signal, note and run_dir of a child run.
fn outcome_cells(run: &ChildRun) -> [String; 6] {
    [
        opt_u64(run.summary.as_ref().map(|s| s.progress.steps as u64)),
        format!("{:.3}", run.wall_secs),
        opt_i32(run.exit_code),
        opt_i32(run.signal),
        run.note.clone(),
        run.run_dir.to_string_lossy().into_owned(),
    ]
}

/// A path as text, or empty.
fn path_cell(p: Option<&Path>) -> String {
    p.map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn opt_i32(v: Option<i32>) -> String {
    v.map(|x| x.to_string()).unwrap_or_default()
}

/// MiB with two decimals, or `-`.
fn mib_cell(v: Option<u64>) -> String {
    v.map(|b| format!("{:.2}", memtrain_core::memory::mib(b)))
        .unwrap_or_else(|| "-".into())
}

/// Escape `|` for a markdown table cell.
fn md_cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// The `frontier` cell of a markdown table.
fn frontier_cell(on: bool) -> &'static str {
    if on {
        "✓"
    } else {
        ""
    }
}

/// A markdown link to an out-of-memory report (relative to the table's directory), or empty.
fn report_cell(path: Option<&Path>) -> String {
    path.map(|p| {
        let p = p.to_string_lossy();
        format!("[report]({})", p.replace(' ', "%20"))
    })
    .unwrap_or_default()
}

/// A frontier point of a child run: peak memory and images/s only when it ran ok (a run that
/// ended otherwise measured nothing comparable).
fn frontier_point(label: String, run: &ChildRun) -> FrontierPoint {
    let ok = run.status == Status::Ok;
    FrontierPoint {
        label,
        peak_bytes: run.peak_bytes().filter(|_| ok),
        images_per_sec: run.images_per_sec().filter(|_| ok),
        lossy: run.lossy,
    }
}

// ---------------------------------------------------------------------------------------------
// Sweep tables
// ---------------------------------------------------------------------------------------------

/// Header of `sweep.csv`.
pub const SWEEP_CSV_HEADER: &str = "configuration,batch_size,status,peak_bytes,baseline_bytes,peak_above_baseline_bytes,run_peak_bytes,run_peak_phase,reserved_peak_bytes,images_per_sec,frontier,lossy,segmentation,steps,wall_secs,exit_code,signal,note,run_dir,oom_report";

/// One frontier point per point of the sweep (same order as `r.points`), labelled
/// `<configuration> b<batch>`; only points that ran ok are measured.
pub(crate) fn sweep_frontier_points(r: &SweepResult) -> Vec<FrontierPoint> {
    r.points
        .iter()
        .map(|p| frontier_point(format!("{} b{}", p.configuration, p.batch_size), &p.run))
        .collect()
}

/// The sweep as CSV (one row per point, in the order run). `frontier` is `true` for the points on
/// the memory–speed frontier of the exact points, `lossy` for a lossy configuration's;
/// `segmentation` is what the point trained with (`--checkpoint auto` resolved); `oom_report` is
/// the path of an out-of-memory point's report, relative to the sweep's directory, when its run
/// wrote one.
pub fn sweep_csv(r: &SweepResult) -> String {
    let front = pareto_front(&sweep_frontier_points(r));
    let rows = r.points.iter().zip(front).map(|(p, on)| {
        let run = &p.run;
        let mut row = vec![
            p.configuration.clone(),
            p.batch_size.to_string(),
            run.status.as_str().to_string(),
            opt_u64(run.peak_bytes()),
        ];
        row.extend(memory_cells(run));
        row.extend([
            opt_f64(run.images_per_sec(), 2),
            on.to_string(),
            run.lossy.to_string(),
            segmentation_cell(run),
        ]);
        row.extend(outcome_cells(run));
        row.push(path_cell(p.oom_report.as_deref()));
        row
    });
    csv_text(SWEEP_CSV_HEADER, rows)
}

/// The segmentation a run trained with, or empty.
fn segmentation_cell(run: &ChildRun) -> String {
    run.segmentation()
        .map(|s| s.to_string())
        .unwrap_or_default()
}

/// The sweep as a markdown table (rows grouped by configuration, sorted by batch size; the
/// frontier points marked, out-of-memory reports linked and, with `--checkpoint auto`, the
/// segmentation each point trained with, when there are any), followed by the `--find-max`
/// results when there are any.
pub fn sweep_markdown(r: &SweepResult) -> String {
    let reserved = r
        .points
        .iter()
        .any(|p| p.run.reserved_peak_bytes().is_some());
    let auto = r.points.iter().any(|p| {
        super::trainer_config(&p.run.args)
            .is_some_and(|c| c.memory.grad_checkpointing == GradCheckpointing::Auto)
    });
    let reports = r.points.iter().any(|p| p.oom_report.is_some());
    let front = pareto_front(&sweep_frontier_points(r));
    let mut s = String::from("| configuration | batch size | status | training peak MiB (total) | baseline MiB (at start) | peak − baseline MiB |");
    if reserved {
        s.push_str(" reserved peak MiB |");
    }
    s.push_str(" img/s | frontier |");
    if auto {
        s.push_str(" segmentation |");
    }
    if reports {
        s.push_str(" OOM report |");
    }
    s.push_str(" note |\n|---|---:|---|---:|---:|---:|");
    if reserved {
        s.push_str("---:|");
    }
    s.push_str("---:|:---:|");
    if auto {
        s.push_str("---|");
    }
    if reports {
        s.push_str("---|");
    }
    s.push_str("---|\n");
    for v in &r.configurations {
        for p in r.points_of(&v.label) {
            let on = r
                .points
                .iter()
                .position(|q| std::ptr::eq(q, p))
                .is_some_and(|i| front[i]);
            let run = &p.run;
            let _ = write!(
                s,
                "| {} | {} | {} | {} | {} | {} |",
                md_cell(&p.configuration),
                p.batch_size,
                run.status,
                mib_cell(run.peak_bytes()),
                mib_cell(run.baseline_bytes()),
                mib_cell(run.peak_above_baseline()),
            );
            if reserved {
                let _ = write!(s, " {} |", mib_cell(run.reserved_peak_bytes()));
            }
            let note = row_note(run);
            let _ = write!(
                s,
                " {} | {} |",
                run.images_per_sec()
                    .map(|v| format!("{v:.1}"))
                    .unwrap_or_else(|| "-".into()),
                frontier_cell(on)
            );
            if auto {
                let _ = write!(s, " {} |", segmentation_cell(run));
            }
            if reports {
                let _ = write!(s, " {} |", report_cell(p.oom_report.as_deref()));
            }
            let _ = writeln!(s, " {} |", md_cell(&note));
        }
    }
    if front.iter().any(|&on| on) {
        let lossy = r.points.iter().any(|p| p.run.lossy);
        let _ = writeln!(s, "\n{}", frontier_legend(lossy));
    }
    s.push_str(&other_note(r.points.iter().map(|p| &p.run)));
    if !r.max_batches.is_empty() {
        s.push('\n');
        for mb in &r.max_batches {
            let _ = writeln!(
                s,
                "- {}",
                super::results::describe_max(mb, r.memory_limit_bytes)
            );
        }
    }
    s
}

/// Write `sweep.json`, `sweep.csv` and `sweep.md` into `dir` (atomically).
pub(crate) fn write_sweep_files(dir: &Path, r: &SweepResult) -> Result<()> {
    write_json_atomic(&dir.join("sweep.json"), r)?;
    write_atomic(&dir.join("sweep.csv"), sweep_csv(r).as_bytes())?;
    write_atomic(&dir.join("sweep.md"), sweep_markdown(r).as_bytes())
}

/// Write the sweep's tables and its charts (`sweep.{png,svg}`, and `frontier.{png,svg}` when a
/// point ran ok) into `dir`; returns the chart files.
pub fn write_sweep_report(dir: &Path, r: &SweepResult) -> Result<Vec<PathBuf>> {
    write_sweep_files(dir, r)?;
    let mut files = render(&SweepChart::from_result(r), &dir.join("sweep"))?;
    files.extend(write_frontier_chart(
        &sweep_frontier_points(r),
        "Peak memory against speed: every configuration and batch size that ran",
        r.memory_limit_bytes,
        r.heap_budget_bytes(),
        &dir.join(FRONTIER_CHART),
    )?);
    Ok(files)
}

// ---------------------------------------------------------------------------------------------
// Compare tables
// ---------------------------------------------------------------------------------------------

/// Header of `compare.csv`.
pub const COMPARE_CSV_HEADER: &str = "configuration,status,peak_bytes,peak_change_pct,baseline_bytes,peak_above_baseline_bytes,run_peak_bytes,run_peak_phase,reserved_peak_bytes,step_added_bytes,saved_activation_bytes,images_per_sec,speed_change_pct,frontier,lossy,final_test_accuracy,steps,wall_secs,exit_code,signal,note,run_dir,flags,oom_report";

/// One frontier point per configuration of the comparison (same order as `r.entries`), labelled
/// with the configuration's label; only runs that finished ok are measured.
pub(crate) fn compare_frontier_points(r: &CompareResult) -> Vec<FrontierPoint> {
    r.entries
        .iter()
        .map(|e| frontier_point(e.label.clone(), &e.run))
        .collect()
}

/// The comparison as CSV (one row per configuration, the first the one the others are compared with). `frontier` is `true`
/// for the configurations on the memory–speed frontier of the exact ones, `lossy` for a lossy
/// configuration; `oom_report` is the path of an
/// out-of-memory run's report, relative to the comparison's directory, when it wrote one.
pub fn compare_csv(r: &CompareResult) -> String {
    let front = pareto_front(&compare_frontier_points(r));
    let rows = r.entries.iter().zip(front).map(|(e, on)| {
        let run = &e.run;
        let mut row = vec![
            e.label.clone(),
            run.status.as_str().to_string(),
            opt_u64(run.peak_bytes()),
            opt_f64(e.peak_change_pct, 2),
        ];
        row.extend(memory_cells(run));
        let step = step_figures(run);
        row.extend([
            opt_u64(step.map(|s| s.0)),
            opt_u64(step.map(|s| s.1)),
            opt_f64(run.images_per_sec(), 2),
            opt_f64(e.speed_change_pct, 2),
            on.to_string(),
            run.lossy.to_string(),
            opt_f64(
                run.summary
                    .as_ref()
                    .and_then(|s| s.quality.final_test_accuracy),
                4,
            ),
        ]);
        row.extend(outcome_cells(run));
        row.extend([e.flags.join(" "), path_cell(e.oom_report.as_deref())]);
        row
    });
    csv_text(COMPARE_CSV_HEADER, rows)
}

/// The comparison as a markdown table; changes are relative to the first configuration, the
/// frontier configurations are marked, out-of-memory reports linked when there are any.
pub fn compare_markdown(r: &CompareResult) -> String {
    let accuracy = r.entries.iter().any(|e| {
        e.run
            .summary
            .as_ref()
            .and_then(|s| s.quality.final_test_accuracy)
            .is_some()
    });
    let reserved = r
        .entries
        .iter()
        .any(|e| e.run.reserved_peak_bytes().is_some());
    let reports = r.entries.iter().any(|e| e.oom_report.is_some());
    let front = pareto_front(&compare_frontier_points(r));
    let base = md_cell(r.entries.first().map(|e| e.label.as_str()).unwrap_or(""));
    let mut s = format!(
        "| configuration | status | training peak MiB (total) | peak vs {base} | peak − baseline MiB |"
    );
    if reserved {
        s.push_str(" reserved peak MiB |");
    }
    let _ = write!(
        s,
        " step adds MiB | saved peak MiB (recomputed included) | img/s | img/s vs {base} | frontier |"
    );
    if accuracy {
        s.push_str(" accuracy |");
    }
    if reports {
        s.push_str(" OOM report |");
    }
    s.push_str(" note |\n|---|---|---:|---:|---:|");
    if reserved {
        s.push_str("---:|");
    }
    s.push_str("---:|---:|---:|---:|:---:|");
    if accuracy {
        s.push_str("---:|");
    }
    if reports {
        s.push_str("---|");
    }
    s.push_str("---|\n");
    for (e, &on) in r.entries.iter().zip(&front) {
        let run = &e.run;
        let _ = write!(
            s,
            "| {} | {} | {} | {} | {} |",
            md_cell(&e.label),
            run.status,
            mib_cell(run.peak_bytes()),
            pct_cell(e.peak_change_pct),
            mib_cell(run.peak_above_baseline())
        );
        if reserved {
            let _ = write!(s, " {} |", mib_cell(run.reserved_peak_bytes()));
        }
        let step = step_figures(run);
        let _ = write!(
            s,
            " {} | {} |",
            mib_cell(step.map(|s| s.0)),
            mib_cell(step.map(|s| s.1))
        );
        let _ = write!(
            s,
            " {} | {} | {} |",
            run.images_per_sec()
                .map(|v| format!("{v:.1}"))
                .unwrap_or_else(|| "-".into()),
            pct_cell(e.speed_change_pct),
            frontier_cell(on)
        );
        if accuracy {
            let acc = run
                .summary
                .as_ref()
                .and_then(|s| s.quality.final_test_accuracy);
            let _ = write!(
                s,
                " {} |",
                acc.map(|a| format!("{:.2}%", a * 100.0))
                    .unwrap_or_else(|| "-".into())
            );
        }
        if reports {
            let _ = write!(s, " {} |", report_cell(e.oom_report.as_deref()));
        }
        let _ = writeln!(s, " {} |", md_cell(&row_note(run)));
    }
    if front.iter().any(|&on| on) {
        let lossy = r.entries.iter().any(|e| e.run.lossy);
        let _ = writeln!(s, "\n{}", frontier_legend(lossy));
    }
    s.push_str(&other_note(r.entries.iter().map(|e| &e.run)));
    s
}

/// The note of a markdown table's row: `lossy` for a lossy configuration, and why a run that
/// did not finish ended.
fn row_note(run: &ChildRun) -> String {
    let lossy = run.lossy.then_some(LOSSY_NOTE);
    let ended = Some(run.note.as_str()).filter(|n| run.status != Status::Ok && !n.is_empty());
    lossy
        .into_iter()
        .chain(ended)
        .collect::<Vec<_>>()
        .join("; ")
}

/// The note of a lossy configuration's row in the markdown tables.
const LOSSY_NOTE: &str = "lossy: compressed saved activations, not on the frontier";

/// Under a table: the training peak is the step peak; when a run's whole-process peak fell
/// outside training (phase "other"), what that means, with the runs named by their directory.
fn other_note<'a>(runs: impl Iterator<Item = &'a ChildRun>) -> String {
    let other: Vec<String> = runs
        .filter(|r| r.run_peak().is_some_and(|p| p.1 == Some("other")))
        .map(|r| r.run_dir.display().to_string())
        .collect();
    if other.is_empty() {
        return String::new();
    }
    format!(
        "\nThe training peak is the highest step peak. {} ({}).\n",
        memtrain_core::memory::PHASE_OTHER_NOTE,
        other.join(", ")
    )
}

/// Write `compare.json`, `compare.csv` and `compare.md` into `dir` (atomically).
pub(crate) fn write_compare_files(dir: &Path, r: &CompareResult) -> Result<()> {
    write_json_atomic(&dir.join("compare.json"), r)?;
    write_atomic(&dir.join("compare.csv"), compare_csv(r).as_bytes())?;
    write_atomic(&dir.join("compare.md"), compare_markdown(r).as_bytes())
}

/// Write the comparison's tables, its bar chart (`peak_memory.{png,svg}`), when the runs wrote
/// `batches.csv` each step's peak (`step_peaks.{png,svg}`), when a run finished the memory–speed
/// frontier (`frontier.{png,svg}`), and when runs wrote `step_timeline.json` their steps side by
/// side (`step_timeline.{png,svg}`; a timeline that cannot be drawn is a warning on stderr, not a
/// failed comparison); returns the chart files.
pub fn write_compare_report(dir: &Path, r: &CompareResult) -> Result<Vec<PathBuf>> {
    write_compare_files(dir, r)?;
    let bars = BarChart {
        title: "Peak memory per configuration".into(),
        bars: r
            .entries
            .iter()
            .map(|e| Bar {
                label: e.label.clone(),
                bytes: e.run.peak_bytes(),
                status: e.run.status,
                change_pct: e
                    .peak_change_pct
                    .filter(|_| !std::ptr::eq(e, &r.entries[0])),
                lossy: e.run.lossy,
            })
            .collect(),
    };
    let mut files = render(&bars, &dir.join("peak_memory"))?;
    let mut series = Vec::new();
    for e in &r.entries {
        if !e.run.run_dir.join(BATCHES_CSV).is_file() {
            continue;
        }
        let rows = read_batch_log(&e.run.run_dir)?;
        if rows.is_empty() {
            continue;
        }
        series.push(Series {
            label: e.label.clone(),
            points: rows
                .iter()
                .map(|b| (b.global_step as f64, b.peak_bytes))
                .collect(),
            color: None,
            thin: false,
            lossy: e.run.lossy,
        });
    }
    if !series.is_empty() {
        let timeline = TimelineChart {
            title: "Peak memory per training step".into(),
            y_desc: "peak memory during the step".into(),
            series,
            hlines: Vec::new(),
        };
        files.extend(render(&timeline, &dir.join("step_peaks"))?);
    }
    files.extend(write_frontier_chart(
        &compare_frontier_points(r),
        "Peak memory against speed per configuration",
        None,
        None,
        &dir.join(FRONTIER_CHART),
    )?);
    // Every run is measured and recorded by now: a damaged timeline file only warns.
    match super::step_overlay::write_step_timeline_overlays(dir, r) {
        Ok(timelines) => files.extend(timelines),
        Err(e) => eprintln!("warning: step timelines chart not written: {e}"),
    }
    Ok(files)
}

/// Draw `memory.png` and `memory.svg` into a run directory from its `batches.csv`: the peak of
/// every step, the bytes still in use after it, the CUDA pool's reserved bytes when measured,
/// and horizontal lines for the baseline and the memory limit when given.
pub(crate) fn write_run_memory_chart(
    run_dir: &Path,
    title: &str,
    baseline: Option<u64>,
    limit: Option<u64>,
) -> Result<Vec<PathBuf>> {
    let rows = read_batch_log(run_dir)?;
    let mut series = vec![
        Series {
            label: "peak during step".into(),
            points: rows
                .iter()
                .map(|b| (b.global_step as f64, b.peak_bytes))
                .collect(),
            color: Some(PALETTE[0]),
            thin: false,
            lossy: false,
        },
        Series {
            label: "in use after step".into(),
            points: rows
                .iter()
                .map(|b| (b.global_step as f64, b.end_bytes))
                .collect(),
            color: Some(PALETTE[2]),
            thin: true,
            lossy: false,
        },
    ];
    if rows.iter().any(|b| b.reserved_peak_bytes.is_some()) {
        series.push(Series {
            label: "reserved by the CUDA pool".into(),
            points: rows
                .iter()
                .filter_map(|b| b.reserved_peak_bytes.map(|r| (b.global_step as f64, r)))
                .collect(),
            color: Some(PALETTE[1]),
            thin: true,
            lossy: false,
        });
    }
    let mut hlines = Vec::new();
    if let Some(b) = baseline {
        hlines.push(HLine {
            label: format!("baseline at start ({})", format_bytes(b)),
            bytes: b,
            color: RGBColor(120, 120, 120),
        });
    }
    if let Some(l) = limit {
        hlines.push(HLine {
            label: format!("memory limit ({})", format_bytes(l)),
            bytes: l,
            color: LIMIT_COLOR,
        });
    }
    let chart = TimelineChart {
        title: title.to_string(),
        y_desc: "memory".into(),
        series,
        hlines,
    };
    render(&chart, &run_dir.join("memory"))
}

/// Print where the results of a sweep or comparison are (`<stem>.md/.csv/.json` and the charts in
/// `out`), and turn an interrupted run into [`Error::Interrupted`] so the caller exits 130.
/// `what` names the run in that message ("sweep", "comparison").
pub fn announce_results(
    out: &Path,
    stem: &str,
    charts: &[PathBuf],
    interrupted: bool,
    what: &str,
) -> Result<()> {
    let names: Vec<String> = ["md", "csv", "json"]
        .iter()
        .map(|ext| format!("{stem}.{ext}"))
        .chain(
            charts
                .iter()
                .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned())),
        )
        .collect();
    println!("\nresults in {}: {}", out.display(), names.join(", "));
    if interrupted {
        return Err(Error::Interrupted(format!(
            "the {what} stopped early; results so far are in {}",
            out.display()
        )));
    }
    Ok(())
}
