//! The memory–speed frontier: which measured points are Pareto-optimal in peak memory (lower is
//! better) and throughput (higher is better), and the chart of peak memory against images/s with
//! those points marked and joined by a step line. The frontier is one of exact configurations:
//! a lossy point (`--compress-activations int8|int4|int2`) trains a different step, so it neither joins nor
//! dominates it, and the chart draws it apart with a marker of its own.
//!
//! [`pareto_front`] is pure; [`write_frontier_chart`] draws `frontier.{png,svg}` with the machinery
//! of `sweep::chart`. Sweeps and comparisons build their points in [`super::report`].

use super::chart::{
    draw_line, draw_lossy_markers, draw_rule, draw_series_legend, label_spots, leader_end,
    limit_rules, lossy_label, render, shorten, Chart, DrawResult, Frame, LabelBoxes, MemUnit,
    Panel, FONT, PALETTE,
};
use crate::error::Result;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// Stem of the chart files (`frontier.png`, `frontier.svg`) in a sweep's or comparison's output
/// directory.
pub(crate) const FRONTIER_CHART: &str = "frontier";

/// The one-line legend under a markdown table whose `frontier` column marks points with `✓`;
/// with `lossy` (a lossy point is in the table), it says that they are left out.
pub(crate) fn frontier_legend(lossy: bool) -> String {
    format!(
        "✓ frontier: no other exact point that ran has both lower-or-equal peak memory and \
         higher-or-equal img/s (one of them strictly){}; drawn in frontier.png",
        if lossy {
            "; lossy points (compressed saved activations) are left out of it and drawn apart"
        } else {
            ""
        }
    )
}

/// One measured point: a label, its peak memory and its throughput (`None` when not measured,
/// e.g. a run that ran out of memory).
#[derive(Debug, Clone, PartialEq)]
pub struct FrontierPoint {
    /// Label in the chart, e.g. `f16` or `f32 ckpt=none b128`.
    pub label: String,
    /// Peak memory in bytes.
    pub peak_bytes: Option<u64>,
    /// Training throughput in images per second.
    pub images_per_sec: Option<f64>,
    /// True for a lossy configuration (`--compress-activations int8|int4|int2`): drawn apart, never on
    /// the frontier and dominating nothing.
    pub lossy: bool,
}

impl FrontierPoint {
    /// `(peak bytes, images/s)` when both were measured and the throughput is a finite,
    /// non-negative number; such a point is drawn, and takes part in the frontier unless lossy.
    pub fn measured(&self) -> Option<(u64, f64)> {
        let ips = self.images_per_sec.filter(|v| v.is_finite() && *v >= 0.0)?;
        Some((self.peak_bytes?, ips))
    }

    /// [`FrontierPoint::measured`] of an exact point; `None` for a lossy one.
    fn exact(&self) -> Option<(u64, f64)> {
        self.measured().filter(|_| !self.lossy)
    }
}

/// For every point, whether it lies on the Pareto frontier of the exact points: it is exact and
/// measured (see [`FrontierPoint::measured`]) and no other exact measured point has both
/// lower-or-equal peak memory and higher-or-equal images/s with at least one of the two strictly
/// better. Lossy points are never on it and dominate nothing. Identical points do not dominate
/// each other, so duplicates on the frontier are all marked.
pub fn pareto_front(points: &[FrontierPoint]) -> Vec<bool> {
    let measured: Vec<Option<(u64, f64)>> = points.iter().map(FrontierPoint::exact).collect();
    // Quadratic, but a sweep has tens of points, and this reads as the definition.
    measured
        .iter()
        .map(|p| {
            let Some((peak, ips)) = *p else { return false };
            !measured
                .iter()
                .flatten()
                .any(|&(op, oi)| op <= peak && oi >= ips && (op < peak || oi > ips))
        })
        .collect()
}

/// The frontier's points sorted by peak memory, as `(peak bytes, images/s)`.
fn frontier_sorted(points: &[FrontierPoint], on: &[bool]) -> Vec<(u64, f64)> {
    let mut f: Vec<(u64, f64)> = points
        .iter()
        .zip(on)
        .filter(|(_, &on)| on)
        .filter_map(|(p, _)| p.measured())
        .collect();
    f.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    f
}

/// Draw `<stem>.png` and `<stem>.svg`: every measured point at (peak memory, images/s) with its
/// label, the frontier points filled and joined by a step line (from each frontier point across
/// to the next one's peak memory, then up to its throughput: more speed costs that much more
/// memory), the other exact points hollow, the lossy ones as diamonds labelled `(lossy)`, and
/// `limit` as a vertical line when given (with `heap_budget`, the CPU's heap budget under it,
/// beside it: see [`super::chart::limit_rules`]). Returns the files
/// written; with no measured point nothing is written.
pub fn write_frontier_chart(
    points: &[FrontierPoint],
    title: &str,
    limit: Option<u64>,
    heap_budget: Option<u64>,
    stem: &Path,
) -> Result<Vec<PathBuf>> {
    if points.iter().all(|p| p.measured().is_none()) {
        return Ok(Vec::new());
    }
    let chart = FrontierChart {
        title: title.to_string(),
        on: pareto_front(points),
        points,
        limit,
        heap_budget,
    };
    render(&chart, stem)
}

/// Peak memory against images/s, the frontier marked.
struct FrontierChart<'a> {
    title: String,
    points: &'a [FrontierPoint],
    on: Vec<bool>,
    limit: Option<u64>,
    heap_budget: Option<u64>,
}

impl FrontierChart<'_> {
    /// The frontier as a staircase with its points filled, the dominated points hollow, and
    /// every point's label. `measured`: (point index, peak bytes, images/s) of the points that ran.
    fn draw_points<DB: DrawingBackend>(
        &self,
        chart: &mut Panel<'_, DB>,
        measured: &[(usize, u64, f64)],
        unit: &MemUnit,
    ) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        // Blue, so that it is not mistaken for the red memory limit.
        let front = PALETTE[0];
        let other = PALETTE[6];
        let sorted = frontier_sorted(self.points, &self.on);
        let mut steps: Vec<(f64, f64)> = Vec::with_capacity(sorted.len() * 2);
        for (k, &(b, v)) in sorted.iter().enumerate() {
            if k > 0 {
                steps.push((unit.of(b), sorted[k - 1].1));
            }
            steps.push((unit.of(b), v));
        }
        draw_line(
            chart,
            steps.clone(),
            front,
            3,
            false,
            // As the tables' legend (`frontier_legend`) says: of the exact points only.
            "Pareto frontier (no other exact point uses less memory and runs faster)".into(),
        )?;
        chart.draw_series(
            measured
                .iter()
                .filter(|m| self.on[m.0])
                .map(|m| Circle::new((unit.of(m.1), m.2), 7, front.filled())),
        )?;
        let lossy = |m: &&(usize, u64, f64)| self.points[m.0].lossy;
        let dominated: Vec<&(usize, u64, f64)> = measured
            .iter()
            .filter(|m| !self.on[m.0] && !lossy(m))
            .collect();
        let hollow = chart.draw_series(
            dominated
                .iter()
                .map(|m| Circle::new((unit.of(m.1), m.2), 6, other.stroke_width(2))),
        )?;
        if !dominated.is_empty() {
            hollow
                .label("dominated")
                .legend(move |(x, y)| Circle::new((x + 12, y), 6, other.stroke_width(2)));
        }
        // Lossy points train another step: apart from the frontier, a marker of their own.
        let apart: Vec<(f64, f64)> = measured
            .iter()
            .filter(lossy)
            .map(|m| (unit.of(m.1), m.2))
            .collect();
        if !apart.is_empty() {
            draw_lossy_markers(chart, &apart, 8, PALETTE[1], true)?;
        }
        self.draw_labels(chart, measured, &steps, unit)
    }

    /// Every point's label where it overlaps no other label or marker and neither the frontier's
    /// line (`steps`) nor a limit's crosses it (frontier points first); a label that fits nowhere
    /// near its point is numbered there and listed under the plot.
    fn draw_labels<DB: DrawingBackend>(
        &self,
        chart: &mut Panel<'_, DB>,
        measured: &[(usize, u64, f64)],
        steps: &[(f64, f64)],
        unit: &MemUnit,
    ) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let area = chart.plotting_area().strip_coord_spec();
        let (x0, y0) = area.get_base_pixel();
        let (w, h) = area.dim_in_pixel();
        let bounds = (x0, y0, x0 + w as i32, y0 + h as i32);
        let pixel = |m: &(usize, u64, f64)| chart.backend_coord(&(unit.of(m.1), m.2));
        let mut boxes = LabelBoxes::default();
        // The legend, upper left: the limit, the frontier, "dominated" and "lossy" at most.
        boxes.reserve((x0, y0, x0 + 700, y0 + 125));
        boxes.avoid_line(
            &steps
                .iter()
                .map(|p| chart.backend_coord(p))
                .collect::<Vec<_>>(),
        );
        let ymax = chart.y_range().end;
        for (bytes, _, _) in limit_rules(self.limit, self.heap_budget) {
            let x = unit.of(bytes);
            boxes.avoid_line(&[
                chart.backend_coord(&(x, 0.0)),
                chart.backend_coord(&(x, ymax)),
            ]);
        }
        for m in measured {
            let (px, py) = pixel(m);
            boxes.reserve((px - 8, py - 8, px + 8, py + 8));
        }
        let mut order: Vec<&(usize, u64, f64)> = measured.iter().collect();
        order.sort_by_key(|m| !self.on[m.0]);
        let mut unplaced = Vec::new();
        for m in order {
            let i = m.0;
            const ON: RGBColor = RGBColor(40, 40, 40);
            const OFF: RGBColor = RGBColor(110, 110, 110);
            let style =
                TextStyle::from((FONT, 15).into_font()).color(if self.on[i] { &ON } else { &OFF });
            let p = &self.points[i];
            let text = shorten(&lossy_label(&p.label, p.lossy), 40);
            let size = area.estimate_text_size(&text, &style)?;
            let size = (size.0 as i32 + 2, size.1 as i32 + 2);
            let (px, py) = pixel(m);
            match boxes.place(&label_spots((px, py), size), size, bounds) {
                Some((lx, ly)) => {
                    leader(&area, (px - x0, py - y0), (lx - x0, ly - y0), size)?;
                    area.draw(&Text::new(text, (lx - x0 + 1, ly - y0 + 1), style))?;
                }
                None => unplaced.push((m, text, style)),
            }
        }
        // Numbered markers for the rest, their labels in a box at the lower right.
        let lines: Vec<String> = unplaced
            .iter()
            .enumerate()
            .map(|(k, (_, text, _))| format!("{}: {text}", k + 1))
            .collect();
        for (k, (m, _, style)) in unplaced.iter().enumerate() {
            let tag = (k + 1).to_string();
            let size = area.estimate_text_size(&tag, style)?;
            let size = (size.0 as i32 + 2, size.1 as i32 + 2);
            let (px, py) = pixel(m);
            if let Some((lx, ly)) = boxes.place(&label_spots((px, py), size), size, bounds) {
                leader(&area, (px - x0, py - y0), (lx - x0, ly - y0), size)?;
                area.draw(&Text::new(tag, (lx - x0 + 1, ly - y0 + 1), style.clone()))?;
            }
        }
        const NOTE: RGBColor = RGBColor(60, 60, 60);
        let style = TextStyle::from((FONT, 15).into_font()).color(&NOTE);
        for (k, line) in lines.iter().rev().enumerate() {
            let size = area.estimate_text_size(line, &style)?;
            let at = (
                w as i32 - size.0 as i32 - 10,
                h as i32 - 10 - (k as i32 + 1) * (size.1 as i32 + 4),
            );
            area.draw(&Text::new(line.clone(), at, style.clone()))?;
        }
        Ok(())
    }
}

impl Chart for FrontierChart<'_> {
    fn size(&self) -> (u32, u32) {
        (1200, 800)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let measured: Vec<(usize, u64, f64)> = self
            .points
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.measured().map(|(b, v)| (i, b, v)))
            .collect();
        let max_bytes = measured
            .iter()
            .map(|m| m.1)
            .chain(self.limit)
            .max()
            .unwrap_or(1024 * 1024)
            .max(1);
        let unit = MemUnit::for_max(max_bytes);
        // Room right of the largest point for its label.
        let xmax = unit.of(max_bytes) * 1.25;
        let max_ips = measured
            .iter()
            .map(|m| m.2)
            .fold(0.0f64, f64::max)
            .max(1e-3);
        // Headroom above the fastest point for its label and the legend.
        let ymax = max_ips * 1.3;
        let mut chart = Frame {
            caption: Some((&self.title, 28)),
            x: 0f64..xmax,
            ymax,
            x_label_area: 56,
            x_desc: &format!("peak memory ({}), lower is better", unit.name),
            y_desc: "throughput (images/s), higher is better",
            x_labels: None,
            x_label: &|x| format!("{x:.0}"),
        }
        .draw(root)?;

        for (bytes, color, label) in limit_rules(self.limit, self.heap_budget) {
            let x = unit.of(bytes);
            draw_rule(&mut chart, (x, 0.0), (x, ymax), color, label)?;
        }

        self.draw_points(&mut chart, &measured, &unit)?;
        draw_series_legend(&mut chart, SeriesLabelPosition::UpperLeft, 17)
    }
}

/// A thin grey line from a point to its label, when the label had to move away from it.
fn leader<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    point: (i32, i32),
    at: (i32, i32),
    size: (i32, i32),
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    if let Some(end) = leader_end(point, at, size) {
        area.draw(&PathElement::new(
            vec![point, end],
            RGBColor(150, 150, 150).stroke_width(1),
        ))?;
    }
    Ok(())
}
