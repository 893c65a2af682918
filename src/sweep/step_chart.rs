//! Charts of the memory inside one training step, from a run's `step_timeline.json`
//! ([`memtrain_core::memory::timeline::StepTimeline`]).
//!
//! - [`write_step_timeline_chart`]: `step_timeline.{png,svg}` of one run directory: the bytes in
//!   use after every layer event as stacked areas by category, the measured peak between events,
//!   the estimate's prediction, and the forward, backward and optimizer regions of the step.
//! - `step_overlay::write_step_timeline_overlay`: for comparisons, a panel per configuration, each
//!   drawn as this chart is (its own module, drawn with the pieces here).
//!
//! Both are drawn with the machinery of `sweep::chart` (embedded fonts, PNG and SVG, atomic
//! writes). The legend sits in a panel right of the plot rather than on it: the stacked areas and
//! the peak line fill the plot from the bottom to near the top, so any spot inside would hide data.

use super::chart::{
    render, rotated_names, shorten, Chart, DrawResult, MemUnit, Panel, FONT, TEXT_COLOR,
};
use crate::error::{Error, Result};
use memtrain_core::memory::timeline::{
    CategoryBytes, StepTimeline, TimelineEvent, STEP_TIMELINE_FILE,
};
use memtrain_core::phase::Phase;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};

/// Stem of the chart files (`step_timeline.png`, `step_timeline.svg`), in a run directory and in a
/// comparison's output directory.
pub(crate) const STEP_TIMELINE_CHART: &str = "step_timeline";

/// Read a step timeline written by the trainer. `Ok(None)` when the file does not exist (runs of
/// older versions, sweep children); a file that exists but does not parse is an [`Error::Data`]
/// naming it.
pub(crate) fn read_step_timeline(path: &Path) -> Result<Option<StepTimeline>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(path, e)),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::Data {
            path: path.into(),
            msg: format!(
                "not a valid step timeline ({e}); delete it or rerun the training to rewrite it"
            ),
        })
}

/// Draw `step_timeline.png` and `step_timeline.svg` into `run_dir` from its
/// `step_timeline.json`; returns the files written. A run directory without the file, or with a
/// timeline without events, yields no chart (an empty list), not an error.
pub fn write_step_timeline_chart(run_dir: &Path, title: &str) -> Result<Vec<PathBuf>> {
    let Some(timeline) = read_step_timeline(&run_dir.join(STEP_TIMELINE_FILE))? else {
        return Ok(Vec::new());
    };
    if timeline.events.is_empty() {
        return Ok(Vec::new());
    }
    let chart = StepChart {
        title: title.to_string(),
        timeline: &timeline,
    };
    render(&chart, &run_dir.join(STEP_TIMELINE_CHART))
}

// ---------------------------------------------------------------------------------------------
// Shared pieces
// ---------------------------------------------------------------------------------------------

/// The categories in stacking order (bottom first): what is there before the step, then what
/// lives across steps, then what the step creates and frees.
pub(super) const STACK: [(&str, RGBColor); 6] = [
    ("other (data, runtime)", RGBColor(199, 199, 199)),
    ("parameters", RGBColor(31, 119, 180)),
    ("optimizer state", RGBColor(148, 103, 189)),
    ("gradients", RGBColor(44, 160, 44)),
    ("saved activations", RGBColor(255, 127, 14)),
    ("transient (op outputs, workspaces)", RGBColor(23, 190, 207)),
];

/// What event `e` allocated and freed before it ended: its peak above what is in use after it.
pub(super) fn freed_within(e: &TimelineEvent) -> u64 {
    e.peak_bytes.saturating_sub(e.categories.total())
}

/// The bytes of each category in [`STACK`] order.
fn stack_values(c: &CategoryBytes) -> [u64; 6] {
    [
        c.other,
        c.params,
        c.optimizer,
        c.grads,
        c.saved,
        c.transient,
    ]
}

/// The band on top of the stack: what the event allocated and freed again before it ended (its
/// peak minus what is in use after it), so that the stack reaches the measured peak and the
/// stack at the peak event is the peak's composition.
pub(super) const FREED: (&str, RGBColor) = ("freed within the event", RGBColor(158, 218, 229));

pub(super) const PEAK_COLOR: RGBColor = RGBColor(25, 25, 25);
const PREDICTED_COLOR: RGBColor = RGBColor(214, 39, 40);

/// Background shade and label colour of a phase region.
fn phase_colors(p: Phase) -> (RGBColor, RGBColor) {
    match p {
        Phase::Forward => (RGBColor(230, 240, 252), RGBColor(25, 85, 150)),
        Phase::Backward => (RGBColor(253, 237, 222), RGBColor(175, 80, 0)),
        Phase::Optimizer => (RGBColor(228, 245, 228), RGBColor(25, 115, 25)),
        Phase::Eval | Phase::Other => (RGBColor(240, 240, 240), RGBColor(90, 90, 90)),
    }
}

/// How a legend entry is drawn.
#[derive(Debug, Clone, Copy)]
pub(super) enum Swatch {
    /// A filled box.
    Fill(RGBColor),
    /// A line of the given width with a marker.
    Line(RGBColor, u32),
    /// A dashed line.
    Dashed(RGBColor),
}

/// One row of a legend panel: swatch, label, and a value aligned right.
pub(super) struct LegendRow {
    swatch: Option<Swatch>,
    label: String,
    value: String,
    bold: bool,
}

impl LegendRow {
    pub(super) fn entry(
        swatch: Swatch,
        label: impl Into<String>,
        value: impl Into<String>,
    ) -> Self {
        LegendRow {
            swatch: Some(swatch),
            label: label.into(),
            value: value.into(),
            bold: false,
        }
    }

    pub(super) fn heading(label: impl Into<String>) -> Self {
        LegendRow {
            swatch: None,
            label: label.into(),
            value: String::new(),
            bold: true,
        }
    }

    pub(super) fn text(label: impl Into<String>) -> Self {
        LegendRow {
            swatch: None,
            label: label.into(),
            value: String::new(),
            bold: false,
        }
    }

    pub(super) fn gap() -> Self {
        LegendRow::text("")
    }
}

/// Draw legend rows top-down into `panel` (its own pixel coordinates), starting at `top`.
pub(super) fn draw_legend<DB: DrawingBackend>(
    panel: &DrawingArea<DB, Shift>,
    top: i32,
    rows: &[LegendRow],
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let (w, _) = panel.dim_in_pixel();
    let right = w as i32 - 14;
    let row_h = 25;
    for (i, r) in rows.iter().enumerate() {
        let y = top + i as i32 * row_h;
        let mut text_x = 6;
        if let Some(s) = r.swatch {
            let (x0, x1) = (8, 36);
            match s {
                Swatch::Fill(c) => {
                    panel.draw(&Rectangle::new([(x0, y - 8), (x1, y + 8)], c.filled()))?;
                    panel.draw(&Rectangle::new(
                        [(x0, y - 8), (x1, y + 8)],
                        RGBColor(120, 120, 120).stroke_width(1),
                    ))?;
                }
                Swatch::Line(c, w) => {
                    panel.draw(&PathElement::new(vec![(x0, y), (x1, y)], c.stroke_width(w)))?;
                    panel.draw(&Circle::new(((x0 + x1) / 2, y), 4, c.filled()))?;
                }
                Swatch::Dashed(c) => {
                    for x in (x0..x1).step_by(10) {
                        panel.draw(&PathElement::new(
                            vec![(x, y), ((x + 6).min(x1), y)],
                            c.stroke_width(3),
                        ))?;
                    }
                }
            }
            text_x = 46;
        }
        if !r.label.is_empty() {
            let font = if r.bold {
                (FONT, 17).into_font().style(FontStyle::Bold)
            } else {
                (FONT, 16).into_font()
            };
            let style = TextStyle::from(font)
                .color(&TEXT_COLOR)
                .pos(Pos::new(HPos::Left, VPos::Center));
            panel.draw(&Text::new(r.label.clone(), (text_x, y), style))?;
        }
        if !r.value.is_empty() {
            let style = TextStyle::from((FONT, 16).into_font())
                .color(&TEXT_COLOR)
                .pos(Pos::new(HPos::Right, VPos::Center));
            panel.draw(&Text::new(r.value.clone(), (right, y), style))?;
        }
    }
    Ok(())
}

/// The event whose interval holds the step's peak (the first, on a tie), with its index.
pub(super) fn peak_event(events: &[TimelineEvent]) -> Option<(usize, &TimelineEvent)> {
    events.iter().enumerate().reduce(|best, e| {
        if e.1.peak_bytes > best.1.peak_bytes {
            e
        } else {
            best
        }
    })
}

/// An event in words: `backward of stage3.block2`, `recompute stage1.block1–block2`, `optimizer`.
pub(super) fn event_name(e: &TimelineEvent) -> String {
    if e.layer.starts_with("recompute") || e.layer == e.phase.to_string() {
        e.layer.clone()
    } else {
        format!("{} of {}", e.phase, e.layer)
    }
}

/// The legend's category swatches, top of the stack first, with their bytes at event `at` in its
/// unit (none without one).
pub(super) fn category_rows(at: Option<(&TimelineEvent, &MemUnit)>) -> Vec<LegendRow> {
    let value =
        |f: &dyn Fn(&TimelineEvent) -> u64| at.map(|(e, unit)| unit.fmt(f(e))).unwrap_or_default();
    let mut rows = vec![LegendRow::entry(
        Swatch::Fill(FREED.1),
        FREED.0,
        value(&freed_within),
    )];
    for (k, (label, color)) in STACK.iter().enumerate().rev() {
        rows.push(LegendRow::entry(
            Swatch::Fill(*color),
            *label,
            value(&|e| stack_values(&e.categories)[k]),
        ));
    }
    rows
}

/// The legend's phase regions, in the order the events first show them.
pub(super) fn region_rows(events: &[TimelineEvent]) -> Vec<LegendRow> {
    let mut rows = vec![LegendRow::heading("regions of the step")];
    let mut seen: Vec<Phase> = Vec::new();
    for e in events {
        if !seen.contains(&e.phase) {
            seen.push(e.phase);
        }
    }
    for p in seen {
        rows.push(LegendRow::entry(
            Swatch::Fill(phase_colors(p).0),
            p.to_string(),
            "",
        ));
    }
    rows
}

/// Signed percentage with one decimal.
fn signed_pct(p: f64) -> String {
    format!("{p:+.1}%").replace('-', "−")
}

// ---------------------------------------------------------------------------------------------
// One run: stacked categories over the step's events
// ---------------------------------------------------------------------------------------------

/// A run of consecutive events with the same phase and micro-batch: one shaded region.
#[derive(Debug, Clone, Copy)]
pub(super) struct Region {
    phase: Phase,
    micro_batch: usize,
    first: usize,
    last: usize,
}

pub(super) fn regions(events: &[TimelineEvent]) -> Vec<Region> {
    let mut out: Vec<Region> = Vec::new();
    for (i, e) in events.iter().enumerate() {
        match out.last_mut() {
            Some(r) if r.phase == e.phase && r.micro_batch == e.micro_batch => r.last = i,
            _ => out.push(Region {
                phase: e.phase,
                micro_batch: e.micro_batch,
                first: i,
                last: i,
            }),
        }
    }
    out
}

/// The step's memory by category at every event, with its peak and prediction.
struct StepChart<'a> {
    title: String,
    timeline: &'a StepTimeline,
}

impl StepChart<'_> {
    /// The legend and the numbers a reader wants first: where the peak is, what it is made of,
    /// and how far the prediction is off.
    fn legend_rows(&self, unit: &MemUnit) -> Vec<LegendRow> {
        let t = self.timeline;
        let events = &t.events;
        let peak_event = peak_event(events).map(|(_, e)| e);
        let mut rows = vec![LegendRow::heading("each event's peak, by category")];
        rows.push(LegendRow::text("(value at the peak event)"));
        rows.extend(category_rows(peak_event.map(|e| (e, unit))));
        rows.push(LegendRow::gap());
        let peak = t.peak_bytes();
        rows.push(LegendRow::entry(
            Swatch::Line(PEAK_COLOR, 2),
            "measured peak",
            unit.fmt(peak),
        ));
        if let Some(e) = peak_event {
            rows.push(LegendRow::text(shorten(
                &format!("at {}", event_name(e)),
                38,
            )));
        }
        if events.iter().any(|e| e.predicted_peak_bytes.is_some()) {
            // Compared over the events that have a prediction (the trainer predicts the passes,
            // not always the optimizer), against what was measured at those same events.
            let (predicted, measured) = events
                .iter()
                .filter_map(|e| e.predicted_peak_bytes.map(|p| (p, e.peak_bytes)))
                .fold((0u64, 0u64), |(p, m), (ep, em)| (p.max(ep), m.max(em)));
            let value = if measured > 0 {
                format!(
                    "{} ({})",
                    unit.fmt(predicted),
                    signed_pct((predicted as f64 - measured as f64) / measured as f64 * 100.0)
                )
            } else {
                unit.fmt(predicted)
            };
            rows.push(LegendRow::entry(
                Swatch::Dashed(PREDICTED_COLOR),
                "predicted peak",
                value,
            ));
        }
        rows.push(LegendRow {
            value: unit.fmt(t.start_bytes),
            ..LegendRow::text("in use at the step's start")
        });
        rows.extend(about_rows(t));
        rows
    }
}

/// The legend's last rows: the step's regions, which step it is and how many events it has.
fn about_rows(t: &StepTimeline) -> Vec<LegendRow> {
    let events = &t.events;
    let mut rows = Vec::new();
    rows.push(LegendRow::gap());
    rows.extend(region_rows(events));
    rows.push(LegendRow::gap());
    let micro = events.iter().map(|e| e.micro_batch).max().unwrap_or(0) + 1;
    let mut about = format!("step {}", t.global_step);
    if !t.probe.is_empty() {
        about.push_str(&format!(", probe {}", t.probe));
    }
    rows.push(LegendRow::text(about));
    rows.push(LegendRow::text(format!(
        "{} event{}{}",
        events.len(),
        if events.len() == 1 { "" } else { "s" },
        if micro > 1 {
            format!(", {micro} micro-batches")
        } else {
            String::new()
        }
    )));
    rows
}

impl Chart for StepChart<'_> {
    fn size(&self) -> (u32, u32) {
        (1500, 850)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let events = &self.timeline.events;
        let n = events.len();
        let max_bytes = events
            .iter()
            .flat_map(|e| {
                [
                    e.peak_bytes,
                    e.current_bytes,
                    e.categories.total(),
                    e.predicted_peak_bytes.unwrap_or(0),
                ]
            })
            .max()
            .unwrap_or(0)
            .max(1024 * 1024);
        let unit = MemUnit::for_max(max_bytes);
        // Headroom above the highest point for the region labels and the peak annotation.
        let ymax = unit.of(max_bytes) * 1.18;
        let (x0, x1) = (-0.5, n as f64 - 0.5);

        let (w, _) = root.dim_in_pixel();
        let (plot_area, panel) = root.split_horizontally(w - 390);
        let names: Vec<String> = events.iter().map(|e| shorten(&e.layer, 40)).collect();
        let (label_style, longest) = rotated_names(&plot_area, &names);
        let mut chart = ChartBuilder::on(&plot_area)
            .caption(&self.title, (FONT, 28))
            .margin(20)
            .x_label_area_size((longest + 50).clamp(70, 260))
            .y_label_area_size(90)
            .build_cartesian_2d(x0..x1, 0f64..ymax)?;
        // The x axis is categorical (one slot per event): plotters' numeric ticks would fall
        // between events, so the mesh draws none and the layer names are drawn below.
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .x_desc("event of the step (layer; forward, backward, optimizer)")
            .y_desc(format!("memory ({})", unit.name))
            .axis_desc_style((FONT, 20))
            .label_style((FONT, 17))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .light_line_style(RGBColor(240, 240, 240))
            .draw()?;

        let regs = regions(events);
        draw_regions(&mut chart, &regs, ymax)?;
        draw_stack(&mut chart, events, &unit)?;
        let px_per_event = chart.plotting_area().dim_in_pixel().0 as f64 / n as f64;
        draw_region_labels(&mut chart, root, &regs, events, (ymax, 17), px_per_event)?;
        // The prediction over the measurement: where they agree, its dashes stay visible.
        draw_peaks(&mut chart, events, &unit, px_per_event)?;
        draw_prediction(&mut chart, events, &unit)?;
        draw_layer_names(&chart, root, &names, &label_style, px_per_event)?;
        draw_legend(&panel, 90, &self.legend_rows(&unit))?;
        Ok(())
    }
}

/// Phase regions of the step chart: a shaded background per phase (and micro-batch).
pub(super) fn draw_regions<DB: DrawingBackend>(
    chart: &mut Panel<'_, DB>,
    regs: &[Region],
    ymax: f64,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    // Phase regions: shaded background, a separator and a label at the top of each.
    for r in regs {
        let (shade, _) = phase_colors(r.phase);
        chart.draw_series(std::iter::once(Rectangle::new(
            [(r.first as f64 - 0.5, 0.0), (r.last as f64 + 0.5, ymax)],
            shade.filled(),
        )))?;
    }
    Ok(())
}

/// The stacked memory categories: band k spans the sum of the categories below it to that sum
/// plus its own bytes.
pub(super) fn draw_stack<DB: DrawingBackend>(
    chart: &mut Panel<'_, DB>,
    events: &[TimelineEvent],
    unit: &MemUnit,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let n = events.len();
    // Stacked categories: band k spans the sum of the categories below it to that sum plus
    // its own bytes, one polygon per band (no overdraw, so the SVG stays exact).
    let mut lower = vec![0f64; n];
    let bands = STACK.iter().chain(std::iter::once(&FREED));
    for (k, (_, color)) in bands.enumerate() {
        let upper: Vec<f64> = events
            .iter()
            .zip(&lower)
            .map(|(e, lo)| {
                lo + unit.of(match k {
                    6 => freed_within(e),
                    _ => stack_values(&e.categories)[k],
                })
            })
            .collect();
        if upper.iter().zip(&lower).any(|(u, l)| u > l) {
            // Each band runs flat across the outer half-slots of the first and last events,
            // so the stack fills the plot from edge to edge.
            let xs: Vec<f64> = std::iter::once(-0.5)
                .chain((0..n).map(|i| i as f64))
                .chain(std::iter::once(n as f64 - 0.5))
                .collect();
            let at = |v: &[f64], j: usize| v[j.saturating_sub(1).min(n - 1)];
            let mut poly: Vec<(f64, f64)> = xs
                .iter()
                .enumerate()
                .map(|(j, &x)| (x, at(&upper, j)))
                .collect();
            poly.extend(
                xs.iter()
                    .enumerate()
                    .rev()
                    .map(|(j, &x)| (x, at(&lower, j))),
            );
            chart.draw_series(std::iter::once(Polygon::new(poly, color.mix(0.9).filled())))?;
        }
        lower = upper;
    }
    Ok(())
}

/// The separators between phase regions and each region's label, the longest that fits, in bold
/// `font`.
pub(super) fn draw_region_labels<DB: DrawingBackend>(
    chart: &mut Panel<'_, DB>,
    root: &DrawingArea<DB, Shift>,
    regs: &[Region],
    events: &[TimelineEvent],
    (ymax, font): (f64, u32),
    px_per_event: f64,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let multi_micro = events.iter().any(|e| e.micro_batch > 0);
    // The pixel extents of the labels drawn so far.
    let mut placed: Vec<(i32, i32)> = Vec::new();
    // Separators and labels drawn over the areas, so the boundaries stay visible there.
    for (i, r) in regs.iter().enumerate() {
        if i > 0 {
            let x = r.first as f64 - 0.5;
            chart.draw_series(DashedLineSeries::new(
                vec![(x, 0.0), (x, ymax)],
                6,
                5,
                RGBColor(110, 110, 110).stroke_width(1),
            ))?;
        }
        let (_, ink) = phase_colors(r.phase);
        let style = TextStyle::from((FONT, font).into_font().style(FontStyle::Bold))
            .color(&ink)
            .pos(Pos::new(HPos::Center, VPos::Top));
        let width = (r.last - r.first + 1) as f64 * px_per_event - 6.0;
        let name = r.phase.to_string();
        let mut candidates = Vec::new();
        // The optimizer runs once per step, after the last micro-batch: no number.
        if multi_micro && r.phase != Phase::Optimizer {
            let k = r.micro_batch + 1;
            let short = match r.phase {
                Phase::Forward => "fwd".to_string(),
                Phase::Backward => "bwd".to_string(),
                _ => name.chars().take(3).collect(),
            };
            candidates.push(format!("{name} (micro-batch {k})"));
            candidates.push(format!("{name} {k}"));
            candidates.push(format!("{short} {k}"));
            candidates.push(format!("{short}{k}"));
            candidates.push(format!("{}{k}", &short[..1]));
        } else {
            candidates.push(name.clone());
        }
        candidates.push(name.chars().take(3).collect::<String>() + ".");
        let text_w = |c: &str| {
            root.estimate_text_size(c, &style)
                .map_or(i32::MAX, |s| s.0 as i32)
        };
        let px = |x: f64| chart.backend_coord(&(x, ymax)).0;
        let cx = (r.first + r.last) as f64 / 2.0;
        // Inside the region, centred; or, where it is too narrow (the one-event optimizer),
        // beside it with an arrow to it, where no other label is.
        let (left, right) = (px(r.first as f64 - 0.5), px(r.last as f64 + 0.5));
        let free = |(a, b): (i32, i32)| placed.iter().all(|&(pa, pb)| b <= pa || pb <= a);
        let inside = candidates
            .iter()
            .map(|c| (c, text_w(c)))
            .find(|&(_, w)| w as f64 <= width && free((px(cx) - w / 2, px(cx) + w / 2)))
            .map(|(c, w)| {
                (
                    c.clone(),
                    cx,
                    HPos::Center,
                    (px(cx) - w / 2, px(cx) + w / 2),
                )
            });
        let beside = || {
            candidates.iter().find_map(|c| {
                let before = format!("{c} →");
                let after = format!("← {c}");
                let (wb, wa) = (text_w(&before), text_w(&after));
                [
                    (
                        before,
                        r.first as f64 - 0.5,
                        HPos::Right,
                        (left - wb - 3, left),
                    ),
                    (
                        after,
                        r.last as f64 + 0.5,
                        HPos::Left,
                        (right, right + wa + 3),
                    ),
                ]
                .into_iter()
                .find(|&(_, _, _, (a, b))| {
                    a >= px(-0.5) && b <= px(events.len() as f64 - 0.5) && free((a, b))
                })
            })
        };
        if let Some((text, x, hpos, extent)) = inside.or_else(beside) {
            placed.push(extent);
            let dx = match hpos {
                HPos::Right => -3,
                HPos::Left => 3,
                HPos::Center => 0,
            };
            chart.draw_series(std::iter::once(
                EmptyElement::at((x, ymax))
                    + Text::new(text, (dx, 6), style.pos(Pos::new(hpos, VPos::Top))),
            ))?;
        }
    }
    Ok(())
}

/// The estimate's prediction per event: dashed, broken where an event has none.
fn draw_prediction<DB: DrawingBackend>(
    chart: &mut Panel<'_, DB>,
    events: &[TimelineEvent],
    unit: &MemUnit,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    // The prediction: dashed, broken where an event has none.
    let mut segment: Vec<(f64, f64)> = Vec::new();
    let mut segments: Vec<Vec<(f64, f64)>> = Vec::new();
    for (i, e) in events.iter().enumerate() {
        match e.predicted_peak_bytes {
            Some(p) => segment.push((i as f64, unit.of(p))),
            None => {
                if !segment.is_empty() {
                    segments.push(std::mem::take(&mut segment));
                }
            }
        }
    }
    if !segment.is_empty() {
        segments.push(segment);
    }
    for s in segments {
        if s.len() == 1 {
            chart.draw_series(std::iter::once(
                EmptyElement::at(s[0])
                    + PathElement::new(vec![(-8, 0), (8, 0)], PREDICTED_COLOR.stroke_width(3)),
            ))?;
        } else {
            chart.draw_series(DashedLineSeries::new(
                s,
                10,
                6,
                PREDICTED_COLOR.stroke_width(3),
            ))?;
        }
    }
    Ok(())
}

/// The measured peak between events (a marker per event while they stay apart), and the step's
/// peak named where it happens.
pub(super) fn draw_peaks<DB: DrawingBackend>(
    chart: &mut Panel<'_, DB>,
    events: &[TimelineEvent],
    unit: &MemUnit,
    px_per_event: f64,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let n = events.len();
    // The measured peak between events, with a marker per event while they stay apart.
    let peaks: Vec<(f64, f64)> = events
        .iter()
        .enumerate()
        .map(|(i, e)| (i as f64, unit.of(e.peak_bytes)))
        .collect();
    chart.draw_series(LineSeries::new(peaks.clone(), PEAK_COLOR.stroke_width(2)))?;
    if px_per_event >= 6.0 {
        chart.draw_series(
            peaks
                .iter()
                .map(|&p| Circle::new(p, 4, PEAK_COLOR.filled())),
        )?;
    }
    // Name the step's peak where it happens.
    if let Some((i, e)) = peak_event(events) {
        let hpos = if (i as f64) < n as f64 * 0.15 {
            HPos::Left
        } else if (i as f64) > n as f64 * 0.85 {
            HPos::Right
        } else {
            HPos::Center
        };
        let style = TextStyle::from((FONT, 17).into_font().style(FontStyle::Bold))
            .color(&PEAK_COLOR)
            .pos(Pos::new(hpos, VPos::Bottom));
        chart.draw_series(std::iter::once(
            EmptyElement::at((i as f64, unit.of(e.peak_bytes)))
                + Circle::new((0, 0), 6, PEAK_COLOR.stroke_width(2))
                + Text::new(format!("peak {}", unit.fmt(e.peak_bytes)), (0, -10), style),
        ))?;
    }
    Ok(())
}

/// The layer names under the axis, rotated, thinned to one every few events when dense.
pub(super) fn draw_layer_names<DB: DrawingBackend>(
    chart: &Panel<'_, DB>,
    root: &DrawingArea<DB, Shift>,
    names: &[String],
    label_style: &TextStyle,
    px_per_event: f64,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    // Layer names under the axis, rotated, thinned to one every `every` events when dense.
    let every = (18.0 / px_per_event.max(1e-3)).ceil().max(1.0) as usize;
    for (i, name) in names.iter().enumerate() {
        if i % every != 0 {
            continue;
        }
        let (px, py) = chart.backend_coord(&(i as f64, 0.0));
        let base = root.get_base_pixel();
        let at = (px - base.0, py - base.1);
        root.draw(&PathElement::new(
            vec![(at.0, at.1), (at.0, at.1 + 5)],
            TEXT_COLOR.stroke_width(1),
        ))?;
        root.draw(&Text::new(
            name.clone(),
            (at.0, at.1 + 8),
            label_style.clone(),
        ))?;
    }
    Ok(())
}
