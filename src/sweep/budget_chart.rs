//! The budget sweep's chart (`bench/budget_sweep.sh`): each `--checkpoint auto --memory-limit`
//! run (with `CODES=1`, also `--compress-activations auto`) at (measured peak, images/s) with its
//! predicted peak beside it and its limit marked, and the fixed plans (`--checkpoint none`,
//! `stages`, `blocks`, or codes, run without a limit) on the same axes.
//!
//! Drawn with the machinery of `sweep::chart` into `<stem>.png` and `<stem>.svg`; the points and
//! their CSV come from `examples/budget_sweep.rs`.

use super::chart::{
    draw_series_legend, render, Chart, DrawResult, Frame, MemUnit, Panel, FONT, PALETTE,
};
use crate::error::Result;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};

/// One run of the budget sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetPoint {
    /// The plan it trained with: the segmentation as `--checkpoint` names it (`segments:1,2`,
    /// `stages`, …), with ` + int8` (the codes) for lossy storage.
    pub plan: String,
    /// `--memory-limit` of an `auto` run; `None` for a fixed segmentation run without a limit.
    pub limit: Option<u64>,
    /// The estimate's predicted step peak.
    pub predicted_peak: u64,
    /// The measured peak (the whole process heap, what the limit bounds).
    pub measured_peak: u64,
    /// Images per second (the example takes each run's fastest step after the first).
    pub images_per_sec: f64,
}

/// Draw `<stem>.png` and `<stem>.svg`; returns the files written (none without a point).
pub fn write_budget_chart(
    points: &[BudgetPoint],
    title: &str,
    stem: &Path,
) -> Result<Vec<PathBuf>> {
    if points.is_empty() {
        return Ok(Vec::new());
    }
    render(
        &BudgetChart {
            title: title.to_string(),
            points,
        },
        stem,
    )
}

struct BudgetChart<'a> {
    title: String,
    points: &'a [BudgetPoint],
}

const LIMIT: RGBColor = RGBColor(200, 30, 30);
const NAMED: RGBColor = RGBColor(230, 120, 20);

impl BudgetChart<'_> {
    /// The `auto` runs: limit tick, dotted line to the measured peak, predicted (ring) and
    /// measured (dot) peaks in one colour per chosen segmentation, named in the legend.
    fn draw_auto<DB: DrawingBackend>(
        &self,
        chart: &mut Panel<'_, DB>,
        unit: &MemUnit,
        tick: f64,
    ) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let auto: Vec<&BudgetPoint> = self.points.iter().filter(|p| p.limit.is_some()).collect();
        for p in &auto {
            let (l, m, y) = (
                unit.of(p.limit.unwrap_or(0)),
                unit.of(p.measured_peak),
                p.images_per_sec,
            );
            chart.draw_series(DashedLineSeries::new(
                vec![(m, y), (l, y)],
                4,
                4,
                RGBColor(150, 150, 150).stroke_width(1),
            ))?;
        }
        chart
            .draw_series(auto.iter().map(|p| {
                let (l, y) = (unit.of(p.limit.unwrap_or(0)), p.images_per_sec);
                PathElement::new(vec![(l, y - tick), (l, y + tick)], LIMIT.stroke_width(3))
            }))?
            .label("--memory-limit (resident memory) of an auto run; its step peak lies left of it")
            .legend(|(x, y)| {
                PathElement::new(
                    vec![(x + 12, y - 8), (x + 12, y + 8)],
                    LIMIT.stroke_width(3),
                )
            });
        // Blue, green, purple, brown, pink, olive, cyan: not the limit's red or the named orange.
        let colours = [0, 2, 3, 4, 5, 7, 8].map(|i| PALETTE[i]);
        let mut chosen: Vec<&str> = Vec::new();
        for p in &auto {
            if !chosen.contains(&p.plan.as_str()) {
                chosen.push(&p.plan);
            }
        }
        for (k, s) in chosen.iter().enumerate() {
            let c = colours[k % colours.len()];
            let mine: Vec<&&BudgetPoint> = auto.iter().filter(|p| p.plan == *s).collect();
            let rings = chart.draw_series(mine.iter().map(|p| {
                Circle::new(
                    (unit.of(p.predicted_peak), p.images_per_sec),
                    9,
                    c.stroke_width(2),
                )
            }))?;
            if k == 0 {
                let grey = RGBColor(90, 90, 90);
                rings
                    .label("ring: predicted peak, beside the measured dot of the same run")
                    .legend(move |(x, y)| Circle::new((x + 12, y), 8, grey.stroke_width(2)));
            }
            chart
                .draw_series(mine.iter().map(|p| {
                    Circle::new((unit.of(p.measured_peak), p.images_per_sec), 5, c.filled())
                }))?
                .label(format!("auto chose {s}"))
                .legend(move |(x, y)| Circle::new((x + 12, y), 5, c.filled()));
        }
        Ok(())
    }

    /// The fixed plans run without a limit: triangles at the measured peak, hollow at the
    /// predicted, labelled.
    fn draw_named<DB: DrawingBackend>(
        &self,
        chart: &mut Panel<'_, DB>,
        unit: &MemUnit,
    ) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let named: Vec<&BudgetPoint> = self.points.iter().filter(|p| p.limit.is_none()).collect();
        if named.is_empty() {
            return Ok(());
        }
        chart
            .draw_series(named.iter().map(|p| {
                TriangleMarker::new(
                    (unit.of(p.predicted_peak), p.images_per_sec),
                    11,
                    NAMED.stroke_width(2),
                )
            }))?
            .label("fixed plan, predicted peak")
            .legend(|(x, y)| TriangleMarker::new((x + 12, y), 9, NAMED.stroke_width(2)));
        chart
            .draw_series(named.iter().map(|p| {
                TriangleMarker::new(
                    (unit.of(p.measured_peak), p.images_per_sec),
                    6,
                    NAMED.filled(),
                )
            }))?
            .label("fixed plan, measured peak (no limit)")
            .legend(|(x, y)| TriangleMarker::new((x + 12, y), 6, NAMED.filled()));
        // Labels alternate above and below the markers from left to right: fixed plans a MiB
        // apart (the codes) sit side by side, and a label beside one would run into the next.
        let mut by_x = named.clone();
        by_x.sort_by_key(|p| p.measured_peak);
        for (i, p) in by_x.into_iter().enumerate() {
            let (v, dy) = if i % 2 == 0 {
                (VPos::Bottom, -12)
            } else {
                (VPos::Top, 10)
            };
            let style = TextStyle::from((FONT, 16).into_font())
                .color(&NAMED)
                .pos(Pos::new(HPos::Left, v));
            chart.draw_series(std::iter::once(
                EmptyElement::at((unit.of(p.measured_peak), p.images_per_sec))
                    + Text::new(p.plan.clone(), (4, dy), style),
            ))?;
        }
        Ok(())
    }
}

impl Chart for BudgetChart<'_> {
    fn size(&self) -> (u32, u32) {
        (1200, 800)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let bytes =
            |p: &BudgetPoint| [p.predicted_peak, p.measured_peak, p.limit.unwrap_or(0)].into_iter();
        let max = self.points.iter().flat_map(bytes).max().unwrap_or(1).max(1);
        let min = self
            .points
            .iter()
            .flat_map(bytes)
            .filter(|&b| b > 0)
            .min()
            .unwrap_or(0);
        let unit = MemUnit::for_max(max);
        let span = (unit.of(max) - unit.of(min)).max(1.0);
        let (xmin, xmax) = (unit.of(min) - span * 0.1, unit.of(max) + span * 0.08);
        let ymax = self
            .points
            .iter()
            .map(|p| p.images_per_sec)
            .fold(0.0f64, f64::max)
            .max(1e-3)
            // Room above the fastest point for the legend (up to ten entries, upper left) and
            // the labels over the points under it.
            * 1.75;
        let mut chart = Frame {
            caption: Some((&self.title, 26)),
            x: xmin..xmax,
            ymax,
            x_label_area: 56,
            x_desc: &format!("peak memory ({}), lower is better", unit.name),
            y_desc: "throughput (images/s of the fastest step), higher is better",
            x_labels: None,
            x_label: &|x| format!("{x:.0}"),
        }
        .draw(root)?;
        self.draw_auto(&mut chart, &unit, ymax * 0.02)?;
        self.draw_named(&mut chart, &unit)?;
        draw_series_legend(&mut chart, SeriesLabelPosition::UpperLeft, 16)
    }
}
