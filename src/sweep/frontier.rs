//! The memory–speed frontier: which measured points are Pareto-optimal in peak memory (lower is
//! better) and throughput (higher is better), and the chart of peak memory against images/s with
//! those points marked and joined by a step line.
//!
//! [`pareto_front`] is pure; [`write_frontier_chart`] draws `frontier.{png,svg}` with the machinery
//! of `sweep::chart`. Sweeps and comparisons build their points in [`super::report`].

use super::chart::{render, shorten, Chart, DrawResult, MemUnit, Panel, FONT, PALETTE};
use crate::error::Result;
use crate::memory::format_bytes;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};

/// Stem of the chart files (`frontier.png`, `frontier.svg`) in a sweep's or comparison's output
/// directory.
pub(crate) const FRONTIER_CHART: &str = "frontier";

/// The one-line legend under a markdown table whose `frontier` column marks points with `✓`.
pub(crate) const FRONTIER_LEGEND: &str = "✓ frontier: no other point that ran has both lower-or-equal peak memory and higher-or-equal img/s (one of them strictly); drawn in frontier.png";

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
}

impl FrontierPoint {
    /// `(peak bytes, images/s)` when both were measured and the throughput is a finite,
    /// non-negative number; such a point takes part in the frontier.
    pub fn measured(&self) -> Option<(u64, f64)> {
        let ips = self.images_per_sec.filter(|v| v.is_finite() && *v >= 0.0)?;
        Some((self.peak_bytes?, ips))
    }
}

/// For every point, whether it lies on the Pareto frontier: it was measured (see
/// [`FrontierPoint::measured`]) and no other measured point has both lower-or-equal peak memory
/// and higher-or-equal images/s with at least one of the two strictly better. Identical points do
/// not dominate each other, so duplicates on the frontier are all marked.
pub fn pareto_front(points: &[FrontierPoint]) -> Vec<bool> {
    let measured: Vec<Option<(u64, f64)>> = points.iter().map(FrontierPoint::measured).collect();
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
/// memory), the others hollow, and `limit` as a vertical line when given. Returns the files
/// written; with no measured point nothing is written.
pub fn write_frontier_chart(
    points: &[FrontierPoint],
    title: &str,
    limit: Option<u64>,
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
    };
    render(&chart, stem)
}

/// Peak memory against images/s, the frontier marked.
struct FrontierChart<'a> {
    title: String,
    points: &'a [FrontierPoint],
    on: Vec<bool>,
    limit: Option<u64>,
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
        let other = PALETTE[7];
        let sorted = frontier_sorted(self.points, &self.on);
        let mut steps: Vec<(f64, f64)> = Vec::with_capacity(sorted.len() * 2);
        for (k, &(b, v)) in sorted.iter().enumerate() {
            if k > 0 {
                steps.push((unit.of(b), sorted[k - 1].1));
            }
            steps.push((unit.of(b), v));
        }
        chart
            .draw_series(LineSeries::new(steps, front.stroke_width(3)))?
            .label("Pareto frontier (no other point uses less memory and runs faster)")
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], front.stroke_width(3))
            });
        chart.draw_series(
            measured
                .iter()
                .filter(|m| self.on[m.0])
                .map(|m| Circle::new((unit.of(m.1), m.2), 7, front.filled())),
        )?;
        let dominated: Vec<&(usize, u64, f64)> =
            measured.iter().filter(|m| !self.on[m.0]).collect();
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
        for &(i, b, v) in measured {
            let color = if self.on[i] {
                RGBColor(40, 40, 40)
            } else {
                RGBColor(110, 110, 110)
            };
            let style = TextStyle::from((FONT, 15).into_font())
                .color(&color)
                .pos(Pos::new(HPos::Left, VPos::Bottom));
            chart.draw_series(std::iter::once(
                EmptyElement::at((unit.of(b), v))
                    + Text::new(shorten(&self.points[i].label, 40), (8, -6), style),
            ))?;
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
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, (FONT, 28))
            .margin(20)
            .x_label_area_size(56)
            .y_label_area_size(90)
            .build_cartesian_2d(0f64..xmax, 0f64..ymax)?;
        chart
            .configure_mesh()
            .x_desc(format!("peak memory ({}), lower is better", unit.name))
            .y_desc("throughput (images/s), higher is better")
            .axis_desc_style((FONT, 20))
            .label_style((FONT, 17))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .light_line_style(RGBColor(246, 246, 246))
            .draw()?;

        if let Some(l) = self.limit {
            let x = unit.of(l);
            let red = RGBColor(200, 30, 30);
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(x, 0.0), (x, ymax)],
                    12,
                    8,
                    red.stroke_width(2),
                ))?
                .label(format!("memory limit ({})", format_bytes(l)))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], red.stroke_width(2))
                });
        }

        self.draw_points(&mut chart, &measured, &unit)?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font((FONT, 17))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(180, 180, 180))
            .draw()?;
        Ok(())
    }
}
