//! The step timelines of several configurations overlaid ([`write_step_timeline_overlay`]), for
//! comparisons: one line per configuration of the peak above the step's start, the events of all
//! of them merged by layer so that the same layer sits at the same x in every line. Drawn with the
//! step chart's legend panel and layer names ([`super::step_chart`]).

use super::chart::{
    render, rotated_names, same_as, series_color, series_width, shorten, Chart, DrawResult,
    MemUnit, Panel, FONT,
};
use super::step_chart::{draw_layer_names, draw_legend, phase_marker, LegendRow, Swatch};
use crate::error::Result;
use crate::memory::timeline::{StepTimeline, TimelineEvent};
use crate::phase::Phase;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// Draw `<base>.png` and `<base>.svg`: for every `(label, timeline)` a line of the measured peak
/// above the step's start (`peak_bytes - start_bytes`) at each event. Configurations have
/// different events (checkpointing adds recompute events, accumulation repeats the passes), so
/// the x axis is their events merged by layer: the same layer in the same phase and micro-batch
/// sits at the same x in every line, an event only some have gets its own slot. Timelines
/// without events are left out; with none left, nothing is written.
pub fn write_step_timeline_overlay(
    timelines: &[(String, StepTimeline)],
    base: &Path,
) -> Result<Vec<PathBuf>> {
    let lines: Vec<&(String, StepTimeline)> = timelines
        .iter()
        .filter(|(_, t)| !t.events.is_empty())
        .collect();
    if lines.is_empty() {
        return Ok(Vec::new());
    }
    render(&OverlayChart { lines }, base)
}

/// One line per configuration over the step's layer events, aligned by event.
struct OverlayChart<'a> {
    lines: Vec<&'a (String, StepTimeline)>,
}

/// What identifies an event across configurations: phase, layer, micro-batch, and how many
/// times the same three came before in the step.
type EventKey = (Phase, String, usize, usize);

fn event_keys(t: &StepTimeline) -> Vec<EventKey> {
    let mut seen: Vec<(Phase, &str, usize)> = Vec::new();
    t.events
        .iter()
        .map(|e| {
            // One optimizer update per step, whatever micro-batch came last.
            let micro = if e.phase == Phase::Optimizer {
                0
            } else {
                e.micro_batch
            };
            let k = (e.phase, e.layer.as_str(), micro);
            let nth = seen.iter().filter(|s| **s == k).count();
            seen.push(k);
            (e.phase, e.layer.clone(), micro, nth)
        })
        .collect()
}

/// The events of every timeline merged into one order that keeps each timeline's own order: an
/// event the timelines share (the same layer in the same phase and micro-batch) gets one slot,
/// so configurations line up by layer; an event only some have (a recomputation) gets its own.
fn merged_events(lines: &[&(String, StepTimeline)]) -> Vec<EventKey> {
    let mut order: Vec<EventKey> = Vec::new();
    for (_, t) in lines {
        let mut at = 0;
        for k in event_keys(t) {
            match order[at..].iter().position(|o| *o == k) {
                Some(p) => at += p + 1,
                None => {
                    order.insert(at, k);
                    at += 1;
                }
            }
        }
    }
    order
}

/// The x axis's names of the merged events: the backward's say so (the markers do too), a later
/// micro-batch's its number.
fn axis_names(order: &[EventKey]) -> Vec<String> {
    order
        .iter()
        .map(|(phase, layer, micro, _)| {
            let mut name = match phase {
                Phase::Backward if !layer.starts_with("recompute") => format!("bwd {layer}"),
                _ => layer.clone(),
            };
            if *micro > 0 {
                name.push_str(&format!(" (mb {})", micro + 1));
            }
            shorten(&name, 36)
        })
        .collect()
}

impl OverlayChart<'_> {
    /// One line per configuration over the merged events `order`, its legend row added to
    /// `rows`; a line identical to an earlier one is dashed over it and named.
    fn draw_lines<DB: DrawingBackend>(
        &self,
        chart: &mut Panel<'_, DB>,
        order: &[EventKey],
        unit: &MemUnit,
        rows: &mut Vec<LegendRow>,
    ) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let above =
            |t: &StepTimeline, e: &TimelineEvent| e.peak_bytes.saturating_sub(t.start_bytes);
        let lines = self.lines.len();
        let points: Vec<Vec<(f64, f64)>> = self
            .lines
            .iter()
            .map(|(_, t)| {
                event_keys(t)
                    .iter()
                    .zip(&t.events)
                    .filter_map(|(k, e)| {
                        let x = order.iter().position(|o| o == k)?;
                        Some((x as f64, unit.of(above(t, e))))
                    })
                    .collect()
            })
            .collect();
        // Lines within about two pixels of each other would cover one another.
        let same = same_as(&points, 0.004 * chart.y_range().end);
        for (i, ((label, t), pts)) in self.lines.iter().zip(&points).enumerate() {
            let color = series_color(i);
            let width = series_width(i, lines);
            let mut name = shorten(label, 24);
            match same[i] {
                // Identical to an earlier line: dashed over it, so both stay visible.
                Some(j) => {
                    chart.draw_series(DashedLineSeries::new(
                        pts.clone(),
                        10,
                        8,
                        color.stroke_width(width),
                    ))?;
                    name = format!("{name} (= {})", shorten(&self.lines[j].0, 12));
                }
                None => {
                    chart.draw_series(LineSeries::new(pts.clone(), color.stroke_width(width)))?;
                }
            }
            if t.events.len() <= 120 {
                for (p, e) in pts.iter().zip(&t.events) {
                    phase_marker(chart, *p, e.phase, color, 2 + width as i32 / 2)?;
                }
            }
            let top = t.events.iter().map(|e| above(t, e)).max().unwrap_or(0);
            // The legend draws each line as the plot does: dashed where it is drawn dashed.
            let swatch = if same[i].is_some() {
                Swatch::Dashed(color)
            } else {
                Swatch::Line(color, width)
            };
            rows.push(LegendRow::entry(
                swatch,
                name,
                format!("+{}", unit.fmt(top)),
            ));
        }
        Ok(())
    }
}

impl Chart for OverlayChart<'_> {
    fn size(&self) -> (u32, u32) {
        (1500, 850)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let above =
            |t: &StepTimeline, e: &TimelineEvent| e.peak_bytes.saturating_sub(t.start_bytes);
        let max_bytes = self
            .lines
            .iter()
            .flat_map(|(_, t)| t.events.iter().map(move |e| above(t, e)))
            .max()
            .unwrap_or(0)
            .max(1024 * 1024);
        let unit = MemUnit::for_max(max_bytes);
        let ymax = unit.of(max_bytes) * 1.1;
        let order = merged_events(&self.lines);
        let n = order.len();
        let (w, _) = root.dim_in_pixel();
        let (plot_area, panel) = root.split_horizontally(w - 390);
        let names = axis_names(&order);
        let (label_style, longest) = rotated_names(&plot_area, &names);
        let mut chart = ChartBuilder::on(&plot_area)
            .caption("Peak memory inside one training step", (FONT, 28))
            .margin(20)
            .x_label_area_size((longest + 50).clamp(70, 300))
            .y_label_area_size(90)
            .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..ymax)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .x_desc("layer event of the step, aligned across configurations")
            .y_desc(format!("peak above the step's start ({})", unit.name))
            .axis_desc_style((FONT, 18))
            .label_style((FONT, 17))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .light_line_style(RGBColor(244, 244, 244))
            .draw()?;
        let mut rows = vec![
            LegendRow::heading("configuration"),
            LegendRow::text("(highest peak above the start)"),
        ];
        self.draw_lines(&mut chart, &order, &unit, &mut rows)?;
        let px_per_event = chart.plotting_area().dim_in_pixel().0 as f64 / n.max(1) as f64;
        draw_layer_names(&chart, root, &names, &label_style, px_per_event)?;
        rows.push(LegendRow::gap());
        rows.push(LegendRow::heading("markers: phase of the event"));
        for p in [Phase::Forward, Phase::Backward, Phase::Optimizer] {
            rows.push(LegendRow::entry(Swatch::Marker(p), p.to_string(), ""));
        }
        draw_legend(&panel, 90, &rows)?;
        Ok(())
    }
}
