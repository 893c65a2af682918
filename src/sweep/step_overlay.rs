//! The step timelines of several configurations side by side ([`write_step_timeline_overlay`]),
//! for comparisons: one panel per configuration, each over its own step's events on its own
//! memory axis (so a small configuration's bands stay readable), drawn as a run's own step chart
//! is ([`super::step_chart`]: stacked categories, phase regions, the measured peak and the step's
//! peak marked), under a header that names the configuration (marked `(lossy)` when it is), the
//! peak, its event and what it is made of. [`step_panels`] is what the picture is drawn from.

use super::chart::{
    lossy_label, render, rotated_names, Chart, DrawResult, MemUnit, FONT, LOSSY_LEGEND, TEXT_COLOR,
};
use super::results::CompareResult;
use super::step_chart::{
    category_rows, draw_layer_names, draw_legend, draw_peaks, draw_region_labels, draw_regions,
    draw_stack, event_name, freed_within, peak_event, region_rows, regions, LegendRow, Swatch,
    FREED, PEAK_COLOR, STACK,
};
use crate::error::Result;
use memtrain_core::memory::timeline::StepTimeline;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};

/// Draw `<dir>/step_timeline.{png,svg}`: the step timelines of every entry whose run directory
/// holds `step_timeline.json`, a panel each, labelled as in the comparison; returns the files
/// written. Runs without the file (older trainers, failed runs) are skipped; with none, nothing is
/// written. A file that exists but does not parse is an error naming it.
pub fn write_step_timeline_overlays(dir: &Path, result: &CompareResult) -> Result<Vec<PathBuf>> {
    use super::step_chart::{read_step_timeline, STEP_TIMELINE_CHART};
    let mut timelines = Vec::new();
    for e in &result.entries {
        let path = e
            .run
            .run_dir
            .join(memtrain_core::memory::timeline::STEP_TIMELINE_FILE);
        if let Some(t) = read_step_timeline(&path)? {
            timelines.push((e.label.clone(), e.run.lossy, t));
        }
    }
    write_step_timeline_overlay(&timelines, &dir.join(STEP_TIMELINE_CHART))
}

/// Draw `<base>.png` and `<base>.svg`: a panel per `(label, lossy, timeline)` ([`step_panels`]),
/// in a grid of [`grid`] columns and rows. Timelines without events are left out; with none left,
/// nothing is written.
pub fn write_step_timeline_overlay(
    timelines: &[(String, bool, StepTimeline)],
    base: &Path,
) -> Result<Vec<PathBuf>> {
    let panels = step_panels(timelines);
    if panels.is_empty() {
        return Ok(Vec::new());
    }
    render(&PanelsChart { panels }, base)
}

/// One configuration's panel: its own step's events at x = 0, 1, 2, … in the run's order (so the
/// measured peak's line joins only consecutive events of the run), and the header's facts.
#[derive(Debug, Clone)]
pub struct StepPanel<'a> {
    /// The configuration's label, in full, marked `(lossy)` for a lossy configuration.
    pub label: String,
    /// A lossy configuration (compressed saved activations).
    pub lossy: bool,
    /// The run's step.
    pub timeline: &'a StepTimeline,
    /// Index of the event whose interval holds the step's peak (the first, on a tie).
    pub peak_index: usize,
    /// The step's peak ([`StepTimeline::peak_bytes`]).
    pub peak_bytes: u64,
    /// What the step adds to what was in use at its start.
    pub above_start_bytes: u64,
    /// The peak event in words, with its micro-batch when the step has several.
    pub peak_at: String,
    /// What the step itself holds at the peak, top of the stack first, zeros left out: what the
    /// peak event freed before it ended, transient, saved activations at that moment, gradients.
    pub made_of: Vec<(&'static str, u64)>,
    /// The x axis's name of every event, abbreviated ([`ABBREVIATIONS`]).
    pub names: Vec<String>,
}

/// Words the x axis abbreviates, with their abbreviation (the legend lists the ones used).
pub const ABBREVIATIONS: [(&str, &str); 3] =
    [("recompute ", "rc "), ("stage", "s"), ("block", "b")];

/// An event's layer as the x axis names it: `stage2.block1` → `s2.b1`,
/// `recompute stage1.block1–block2` → `rc s1.b1–b2` (the phase is the region it sits in).
pub fn axis_name(layer: &str) -> String {
    ABBREVIATIONS
        .iter()
        .fold(layer.to_string(), |s, (word, abbr)| s.replace(word, abbr))
}

/// The panels of `(label, lossy, timeline)`s, in their order; a timeline without events has none.
pub fn step_panels(timelines: &[(String, bool, StepTimeline)]) -> Vec<StepPanel<'_>> {
    timelines
        .iter()
        .filter_map(|(label, lossy, t)| {
            let (peak_index, e) = peak_event(&t.events)?;
            let micro = t.events.iter().map(|e| e.micro_batch).max().unwrap_or(0) + 1;
            let mut peak_at = event_name(e);
            if micro > 1 {
                peak_at.push_str(&format!(", micro-batch {} of {micro}", e.micro_batch + 1));
            }
            let c = &e.categories;
            let made_of = [
                ("freed", freed_within(e)),
                ("transient", c.transient),
                ("saved at the peak", c.saved),
                ("gradients", c.grads),
            ]
            .into_iter()
            .filter(|(_, b)| *b > 0)
            .collect();
            Some(StepPanel {
                label: lossy_label(label, *lossy),
                lossy: *lossy,
                timeline: t,
                peak_index,
                peak_bytes: e.peak_bytes,
                above_start_bytes: e.peak_bytes.saturating_sub(t.start_bytes),
                peak_at,
                made_of,
                names: t.events.iter().map(|e| axis_name(&e.layer)).collect(),
            })
        })
        .collect()
}

/// Columns and rows of the grid of `n` panels: side by side up to three, two columns for four,
/// then rows of three.
pub fn grid(n: usize) -> (usize, usize) {
    let cols = match n {
        0..=3 => n.max(1),
        4 => 2,
        _ => 3,
    };
    (cols, n.div_ceil(cols))
}

/// The colour of a header's category, as the stack draws it.
fn category_color(name: &str) -> RGBColor {
    match name {
        "freed" => FREED.1,
        "transient" => STACK[5].1,
        "saved at the peak" => STACK[4].1,
        _ => STACK[3].1,
    }
}

/// The style in which `text` fits `room` pixels: `size` or smaller, down to 11 (used even
/// where it does not fit: a long label runs on rather than being cut).
fn fitted<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    text: &str,
    room: u32,
    size: u32,
    weight: FontStyle,
) -> TextStyle<'static> {
    let style = |s: u32| {
        TextStyle::from((FONT, s).into_font().style(weight))
            .color(&TEXT_COLOR)
            .pos(Pos::new(HPos::Left, VPos::Top))
    };
    (11..=size)
        .rev()
        .map(style)
        .find(|st| {
            area.estimate_text_size(text, st)
                .is_ok_and(|(w, _)| w <= room)
        })
        .unwrap_or_else(|| style(11))
}

struct PanelsChart<'a> {
    panels: Vec<StepPanel<'a>>,
}

const WIDTH: u32 = 1900;
const LEGEND_W: u32 = 360;
const CAPTION_H: u32 = 56;
const HEADER_H: u32 = 116;
const HEADER_X: i32 = 40;
const ROW_H: u32 = 470;
const Y_LABELS: u32 = 80;

impl PanelsChart<'_> {
    /// The header above a panel's plot: label, peak, peak event, and what the step holds at the
    /// peak, two to a line, each with its band's colour.
    fn draw_header<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        p: &StepPanel<'_>,
        unit: &MemUnit,
    ) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let x = HEADER_X;
        let room = area.dim_in_pixel().0.saturating_sub(x as u32 + 16);
        let label = fitted(area, &p.label, room, 18, FontStyle::Bold);
        area.draw(&Text::new(p.label.clone(), (x, 6), label))?;
        let peak = format!(
            "peak {}, {} above the step's start",
            unit.fmt(p.peak_bytes),
            unit.fmt(p.above_start_bytes)
        );
        let at = format!("at {}", p.peak_at);
        for (i, line) in [peak, at].into_iter().enumerate() {
            let style = fitted(area, &line, room, 15, FontStyle::Normal);
            area.draw(&Text::new(line, (x, 30 + 20 * i as i32), style))?;
        }
        let column = (room / 2) as i32;
        for (k, (name, bytes)) in p.made_of.iter().enumerate() {
            let (cx, y) = (x + (k % 2) as i32 * column, 72 + (k / 2) as i32 * 20);
            area.draw(&Rectangle::new(
                [(cx, y + 2), (cx + 12, y + 14)],
                category_color(name).filled(),
            ))?;
            let text = format!("{name} {}", unit.fmt(*bytes));
            let style = fitted(area, &text, column as u32 - 24, 15, FontStyle::Normal);
            area.draw(&Text::new(text, (cx + 17, y), style))?;
        }
        Ok(())
    }

    /// One configuration's plot: the run's step chart over its own events, on its own memory
    /// axis (from 0 to its highest point, with headroom for the region labels and the peak's).
    fn draw_panel<DB: DrawingBackend>(
        &self,
        cell: &DrawingArea<DB, Shift>,
        p: &StepPanel<'_>,
        x_labels: u32,
    ) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let max = max_bytes(p.timeline);
        let unit = MemUnit::for_max(max);
        let ymax = unit.of(max) * 1.3;
        let unit = &unit;
        let (header, plot) = cell.split_vertically(HEADER_H);
        self.draw_header(&header, p, unit)?;
        let events = &p.timeline.events;
        let n = events.len();
        let mut chart = ChartBuilder::on(&plot)
            .margin_left(8)
            .margin_right(22)
            .margin_top(4)
            .margin_bottom(8)
            .x_label_area_size(x_labels)
            .y_label_area_size(Y_LABELS)
            .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..ymax)?;
        let mut mesh = chart.configure_mesh();
        mesh.disable_x_mesh()
            .x_labels(0)
            .axis_desc_style((FONT, 17))
            .label_style((FONT, 15))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .light_line_style(RGBColor(240, 240, 240));
        mesh.y_desc(format!("memory ({}), own scale", unit.name));
        mesh.draw()?;
        let regs = regions(events);
        draw_regions(&mut chart, &regs, ymax)?;
        draw_stack(&mut chart, events, unit)?;
        let px_per_event = chart.plotting_area().dim_in_pixel().0 as f64 / n as f64;
        draw_region_labels(&mut chart, &plot, &regs, events, (ymax, 15), px_per_event)?;
        draw_peaks(&mut chart, events, unit, px_per_event)?;
        let (style, _) = rotated_names(&plot, &p.names);
        draw_layer_names(&chart, &plot, &p.names, &style, px_per_event)?;
        Ok(())
    }

    /// The legend: the categories, the peak, the regions, the abbreviations used.
    fn legend_rows(&self) -> Vec<LegendRow> {
        let mut rows = vec![LegendRow::heading("each event's peak, by category")];
        rows.extend(category_rows(None));
        rows.push(LegendRow::gap());
        rows.push(LegendRow::entry(
            Swatch::Line(PEAK_COLOR, 2),
            "measured peak of each event",
            "",
        ));
        rows.push(LegendRow::text("ringed and named: the step's peak"));
        rows.push(LegendRow::gap());
        rows.push(LegendRow::heading("above each panel"));
        rows.push(LegendRow::text("the step's peak, the event it is in,"));
        rows.push(LegendRow::text("and its bands that the step adds"));
        rows.push(LegendRow::gap());
        let all: Vec<_> = self
            .panels
            .iter()
            .flat_map(|p| p.timeline.events.iter().cloned())
            .collect();
        rows.extend(region_rows(&all));
        let used: Vec<(&str, &str)> = ABBREVIATIONS
            .iter()
            .filter(|(word, _)| all.iter().any(|e| e.layer.contains(word)))
            .copied()
            .collect();
        if !used.is_empty() {
            rows.push(LegendRow::gap());
            rows.push(LegendRow::heading("layer names under the axes"));
            for (word, abbr) in used {
                rows.push(LegendRow::text(format!(
                    "{} = {}",
                    abbr.trim(),
                    word.trim()
                )));
            }
        }
        if self.panels.iter().any(|p| p.lossy) {
            rows.push(LegendRow::gap());
            // Two lines: the legend panel is narrow.
            let (what, why) = LOSSY_LEGEND.split_once(": ").unwrap_or((LOSSY_LEGEND, ""));
            rows.push(LegendRow::text(format!("{what}:")));
            rows.push(LegendRow::text(why));
        }
        rows.push(LegendRow::gap());
        rows.push(LegendRow::text("each run's last step, on a"));
        rows.push(LegendRow::text("memory axis of its own"));
        rows
    }
}

/// The highest point of a step's events (at least 1 MiB).
fn max_bytes(t: &StepTimeline) -> u64 {
    t.events
        .iter()
        .flat_map(|e| [e.peak_bytes, e.categories.total()])
        .max()
        .unwrap_or(0)
        .max(1024 * 1024)
}

impl Chart for PanelsChart<'_> {
    fn size(&self) -> (u32, u32) {
        let (_, rows) = grid(self.panels.len());
        // Tall enough for the legend too (rows of 25 pixels from 40 down).
        let legend = 40 + 25 * self.legend_rows().len() as u32;
        (WIDTH, CAPTION_H + (rows as u32 * ROW_H).max(legend))
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let (caption, body) = root.split_vertically(CAPTION_H);
        let title = TextStyle::from((FONT, 28).into_font())
            .color(&TEXT_COLOR)
            .pos(Pos::new(HPos::Center, VPos::Center));
        let (w, _) = root.dim_in_pixel();
        caption.draw(&Text::new(
            "Memory inside one training step, per configuration",
            (((w - LEGEND_W) / 2) as i32, (CAPTION_H / 2) as i32 + 4),
            title,
        ))?;
        let (plots, legend) = body.split_horizontally(w - LEGEND_W);
        let (cols, rows) = grid(self.panels.len());
        // One x-label height for every panel, so that the plots of a row line up.
        let longest = self
            .panels
            .iter()
            .map(|p| rotated_names(&plots, &p.names).1)
            .max()
            .unwrap_or(0);
        let x_labels = longest + 16;
        let cells = plots.split_evenly((rows, cols));
        for (i, p) in self.panels.iter().enumerate() {
            self.draw_panel(&cells[i], p, x_labels)?;
        }
        draw_legend(&legend, 40, &self.legend_rows())?;
        Ok(())
    }
}
