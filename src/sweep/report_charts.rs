//! The charts of sweeps, comparisons and single runs ([`super::report`] writes them): a bar per
//! configuration, per-batch memory lines, and the sweep's peak memory and images/s against batch
//! size.

use super::chart::{
    covers_note, draw_line, draw_lossy_markers, draw_rule, draw_series_legend, label_spots,
    leader_end, limit_rules, lossy_label, png_text, same_as, series_color, series_width, shorten,
    Chart, DrawError, DrawResult, Frame, LabelBoxes, MemUnit, Panel, FONT, LIMIT_COLOR,
    LOSSY_LEGEND,
};
use super::results::SweepResult;
use super::{ChildRun, Status};
use plotters::coord::ranged1d::SegmentValue;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One bar of a [`BarChart`].
#[derive(Debug, Clone)]
pub(super) struct Bar {
    pub(super) label: String,
    pub(super) bytes: Option<u64>,
    pub(super) status: Status,
    pub(super) change_pct: Option<f64>,
    /// A lossy configuration: its bar hatched, its label marked `(lossy)`.
    pub(super) lossy: bool,
}

/// Horizontal bars of peak memory, one per configuration, labelled with their values; a lossy
/// configuration's bar is hatched and a line under the plot says what the hatching means.
pub(super) struct BarChart {
    pub(super) title: String,
    pub(super) bars: Vec<Bar>,
}

impl Chart for BarChart {
    fn size(&self) -> (u32, u32) {
        let key = if self.bars.iter().any(|b| b.lossy) {
            40
        } else {
            0
        };
        (1200, (170 + key + 64 * self.bars.len() as u32).max(360))
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let n = self.bars.len().max(1);
        let max = self
            .bars
            .iter()
            .filter_map(|b| b.bytes)
            .max()
            .unwrap_or(1024 * 1024);
        let unit = MemUnit::for_max(max);
        let xmax = unit.of(max).max(1e-3) * 1.32;
        let labels: Vec<String> = self
            .bars
            .iter()
            .map(|b| shorten(&lossy_label(&b.label, b.lossy), 38))
            .collect();
        let any_lossy = self.bars.iter().any(|b| b.lossy);
        // A lossy bar's key goes in a strip of its own under the chart.
        let (plot, key) = if any_lossy {
            let (p, k) = root.split_vertically(root.dim_in_pixel().1.saturating_sub(40));
            (p, Some(k))
        } else {
            (root.clone(), None)
        };
        // Wide enough for the PNG's spelling too (code points for what the font lacks).
        let label_w = labels
            .iter()
            .map(|l| png_text(l).chars().count())
            .max()
            .unwrap_or(8) as u32
            * 10
            + 24;
        // Bars top to bottom in the given order: bar i sits at row n-1-i.
        let row = |i: usize| n - 1 - i;
        let mut chart = ChartBuilder::on(&plot)
            .caption(&self.title, (FONT, 28))
            .margin(20)
            .x_label_area_size(56)
            .y_label_area_size(label_w.clamp(100, 420))
            // plotters' integer ranges include their end: rows 0..=n-1.
            .build_cartesian_2d(0f64..xmax, (0..n - 1).into_segmented())?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .x_desc(format!("peak memory ({})", unit.name))
            .axis_desc_style((FONT, 20))
            .label_style((FONT, 17))
            .y_label_formatter(&|v| match v {
                SegmentValue::CenterOf(r) | SegmentValue::Exact(r) => {
                    labels.get(n - 1 - *r).cloned().unwrap_or_default()
                }
                SegmentValue::Last => String::new(),
            })
            .x_label_formatter(&|x| format!("{x:.0}"))
            .draw()?;
        for (i, b) in self.bars.iter().enumerate() {
            let r = row(i);
            let color = series_color(i);
            match b.bytes {
                Some(bytes) => {
                    let mut rect = Rectangle::new(
                        [
                            (0.0, SegmentValue::Exact(r)),
                            (unit.of(bytes), SegmentValue::Exact(r + 1)),
                        ],
                        color.filled(),
                    );
                    rect.set_margin(9, 9, 0, 0);
                    if b.lossy {
                        rect = Rectangle::new(
                            [
                                (0.0, SegmentValue::Exact(r)),
                                (unit.of(bytes), SegmentValue::Exact(r + 1)),
                            ],
                            color.mix(0.25).filled(),
                        );
                        rect.set_margin(9, 9, 0, 0);
                    }
                    chart.draw_series(std::iter::once(rect))?;
                    if b.lossy {
                        let (bx, by) = plot.get_base_pixel();
                        let a = chart.backend_coord(&(0.0, SegmentValue::Exact(r + 1)));
                        let z = chart.backend_coord(&(unit.of(bytes), SegmentValue::Exact(r)));
                        let (a, z) = ((a.0 - bx, a.1 - by), (z.0 - bx, z.1 - by));
                        hatch(&plot, (a.0, a.1 + 9, z.0, z.1 - 9), color)?;
                    }
                    let mut text = unit.fmt(bytes);
                    if let Some(p) = b.change_pct {
                        text.push_str(&format!(" ({})", pct_cell(Some(p))));
                    }
                    if b.lossy {
                        text.push_str(", lossy");
                    }
                    let style = TextStyle::from((FONT, 18).into_font())
                        .pos(Pos::new(HPos::Left, VPos::Center));
                    chart.draw_series(std::iter::once(
                        EmptyElement::at((unit.of(bytes), SegmentValue::CenterOf(r)))
                            + Text::new(text, (8, 0), style),
                    ))?;
                }
                None => {
                    let style = TextStyle::from((FONT, 18).into_font())
                        .color(&LIMIT_COLOR)
                        .pos(Pos::new(HPos::Left, VPos::Center));
                    let text = match b.status {
                        Status::Oom => "out of memory".to_string(),
                        _ => "failed".to_string(),
                    };
                    chart.draw_series(std::iter::once(
                        EmptyElement::at((0.0, SegmentValue::CenterOf(r)))
                            + Text::new(text, (8, 0), style),
                    ))?;
                }
            }
        }
        if let Some(key) = key {
            // A hatched swatch and what it means.
            let w = key.dim_in_pixel().0;
            let (x, y) = (w as i32 / 2 - 260, 4);
            key.draw(&Rectangle::new(
                [(x, y), (x + 36, y + 18)],
                series_color(6).mix(0.25).filled(),
            ))?;
            hatch(&key, (x, y, x + 36, y + 18), series_color(6))?;
            let style = TextStyle::from((FONT, 17).into_font());
            key.draw(&Text::new(
                format!("hatched: {LOSSY_LEGEND}"),
                (x + 46, y),
                style,
            ))?;
        }
        Ok(())
    }
}

/// Diagonal lines in `color` across the pixel box `(x0, y0, x1, y1)` of `area` (in its own
/// pixels), 9 pixels apart: the hatching of a lossy configuration's bar.
fn hatch<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    (x0, y0, x1, y1): (i32, i32, i32, i32),
    color: RGBColor,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let (w, h) = (x1 - x0, y1 - y0);
    if w <= 0 || h <= 0 {
        return Ok(());
    }
    // A line rises from (x0 + k, y1) at 45°; t runs along it while it stays inside the box.
    for k in (-h..w).step_by(9) {
        let (t0, t1) = ((-k).max(0), h.min(w - k));
        if t1 <= t0 {
            continue;
        }
        let at = |t: i32| (x0 + k + t, y1 - t);
        area.draw(&PathElement::new(
            vec![at(t0), at(t1)],
            color.stroke_width(2),
        ))?;
    }
    Ok(())
}

/// A line of a [`TimelineChart`]: (x, bytes) points.
#[derive(Debug, Clone)]
pub(super) struct Series {
    pub(super) label: String,
    pub(super) points: Vec<(f64, u64)>,
    pub(super) color: Option<RGBColor>,
    pub(super) thin: bool,
    /// A lossy configuration's line: labelled `(lossy)`, its points diamonds.
    pub(super) lossy: bool,
}

/// A horizontal reference line.
#[derive(Debug, Clone)]
pub(super) struct HLine {
    pub(super) label: String,
    pub(super) bytes: u64,
    pub(super) color: RGBColor,
}

/// Memory per training step: one line per series, optional horizontal reference lines.
pub(super) struct TimelineChart {
    pub(super) title: String,
    pub(super) y_desc: String,
    pub(super) series: Vec<Series>,
    pub(super) hlines: Vec<HLine>,
}

impl TimelineChart {
    /// Every series as a line (with a marker per point while they stay apart); one identical to
    /// an earlier series is dashed over it and named in the legend.
    fn draw_lines<DB: DrawingBackend>(
        &self,
        chart: &mut Panel<'_, DB>,
        unit: &MemUnit,
    ) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let n = self.series.len();
        let all: Vec<Vec<(f64, f64)>> = self
            .series
            .iter()
            .map(|s| s.points.iter().map(|&(x, b)| (x, unit.of(b))).collect())
            .collect();
        // Lines within about two pixels of each other would cover one another.
        let same = same_as(&all, 0.004 * chart.y_range().end);
        let mut lossy_legend = true;
        for (i, (s, pts)) in self.series.iter().zip(all).enumerate() {
            let color = s.color.unwrap_or(series_color(i));
            let width = if s.thin { 2 } else { series_width(i, n) };
            let mut label = shorten(&lossy_label(&s.label, s.lossy), 60);
            if let Some((j, by)) = same[i] {
                // Over an earlier line: dashed, so both stay visible.
                label = format!("{label} {}", covers_note(&self.series[j].label, by, unit));
            }
            draw_line(chart, pts.clone(), color, width, same[i].is_some(), label)?;
            if s.lossy && pts.len() <= 80 {
                draw_lossy_markers(chart, &pts, 6, color, lossy_legend)?;
                lossy_legend = false;
            } else if pts.len() <= 80 {
                chart.draw_series(
                    pts.iter()
                        .map(|&p| Circle::new(p, if s.thin { 3 } else { 4 }, color.filled())),
                )?;
            }
        }
        Ok(())
    }
}

impl TimelineChart {
    const HEIGHT: u32 = 700;
    const CAPTION: u32 = 28;
    const X_LABEL_AREA: u32 = 56;
    const LEGEND_FONT: u32 = 17;
}

impl Chart for TimelineChart {
    fn size(&self) -> (u32, u32) {
        (1200, Self::HEIGHT)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let max_bytes = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .chain(self.hlines.iter().map(|h| h.bytes))
            .max()
            .unwrap_or(1024 * 1024)
            .max(1);
        let unit = MemUnit::for_max(max_bytes);
        let xs = || {
            self.series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.0))
        };
        let max_x = xs().fold(f64::MIN, f64::max);
        let min_x = xs().fold(f64::MAX, f64::min);
        // Steps count from 1: the axis spans the steps drawn, with a little room either side.
        let (x0, x1) = if min_x > max_x {
            (-0.5, 1.5)
        } else if max_x - min_x < 1.0 {
            (min_x - 1.0, max_x + 1.0)
        } else {
            let pad = (0.02 * (max_x - min_x)).max(0.1);
            (min_x - pad, max_x + pad)
        };
        // Headroom above the highest line for the legend (upper right): its rows (one per line,
        // rule and, with a lossy series, the lossy marker), a font's height and 4 px each, and
        // 60 px of box and margin, over the plot's height (the image less the caption, the
        // x labels and 30 px of margins), so that the highest line passes under the legend.
        let rows = self.series.len()
            + self.hlines.len()
            + usize::from(self.series.iter().any(|s| s.lossy));
        let plot = (Self::HEIGHT - Self::CAPTION - Self::X_LABEL_AREA - 30) as f64;
        let legend = (rows as f64 * (Self::LEGEND_FONT + 4) as f64 + 60.0) / plot;
        let ymax = unit.of(max_bytes) / (1.0 - legend).max(0.3);
        let mut chart = Frame {
            caption: Some((&self.title, Self::CAPTION)),
            x: x0..x1,
            ymax,
            x_label_area: Self::X_LABEL_AREA,
            x_desc: "training step (global)",
            y_desc: &format!("{} ({})", self.y_desc, unit.name),
            x_labels: None,
            x_label: &|x| {
                if (x - x.round()).abs() < 1e-6 {
                    format!("{}", x.round() as i64)
                } else {
                    String::new()
                }
            },
        }
        .draw(root)?;
        for h in &self.hlines {
            let y = unit.of(h.bytes);
            draw_rule(&mut chart, (x0, y), (x1, y), h.color, h.label.clone())?;
        }
        self.draw_lines(&mut chart, &unit)?;
        draw_series_legend(
            &mut chart,
            SeriesLabelPosition::UpperRight,
            Self::LEGEND_FONT,
        )
    }
}

/// One point of a [`SweepChart`].
#[derive(Debug, Clone)]
pub(super) struct SweepDot {
    pub(super) batch: usize,
    pub(super) status: Status,
    pub(super) peak: Option<u64>,
    pub(super) ips: Option<f64>,
}

/// Peak memory (top) and images/s (bottom) versus batch size, one line per configuration.
pub(super) struct SweepChart {
    pub(super) title: String,
    pub(super) configs: Vec<(String, Vec<SweepDot>)>,
    pub(super) limit: Option<u64>,
    /// On the CPU, the heap budget the points' trainers derived from `limit` (the limit is
    /// resident memory, the points' peaks are heap): the smallest any point reported.
    pub(super) heap_budget: Option<u64>,
    /// `--find-max` results: the largest batch that fits, per configuration (same order).
    pub(super) maxima: Vec<Option<usize>>,
    /// Whether each configuration is lossy (same order): labelled `(lossy)`, points diamonds.
    pub(super) lossy: Vec<bool>,
}

impl SweepChart {
    pub(super) fn from_result(r: &SweepResult) -> SweepChart {
        let dot = |p: &ChildRun, batch| SweepDot {
            batch,
            status: p.status,
            peak: p.peak_bytes(),
            ips: p.images_per_sec(),
        };
        let configs = r
            .configurations
            .iter()
            .map(|v| {
                (
                    v.label.clone(),
                    r.points_of(&v.label)
                        .iter()
                        .map(|p| dot(&p.run, p.batch_size))
                        .collect(),
                )
            })
            .collect();
        let maxima = r
            .configurations
            .iter()
            .map(|v| {
                r.max_batches
                    .iter()
                    .find(|m| m.configuration == v.label)
                    .and_then(|m| m.max_batch)
            })
            .collect();
        let lossy = r
            .configurations
            .iter()
            .map(|v| r.points_of(&v.label).iter().any(|p| p.run.lossy))
            .collect();
        SweepChart {
            maxima,
            lossy,
            title: format!(
                "Batch-size sweep ({} training step{} per point)",
                r.steps,
                if r.steps == 1 { "" } else { "s" }
            ),
            configs,
            limit: r.memory_limit_bytes,
            heap_budget: r.heap_budget_bytes(),
        }
    }
}

impl Chart for SweepChart {
    fn size(&self) -> (u32, u32) {
        (1200, 1000)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let x = SweepAxis::of(self);
        let root = root.titled(&self.title, (FONT, 28))?;
        let (top, bottom) = root.split_vertically((root.dim_in_pixel().1 as f64 * 0.58) as u32);
        self.draw_memory(&top, &x)?;
        self.draw_speed(&bottom, &x)
    }
}

/// The batch-size axis shared by the sweep chart's two panels: log2 when the batches span a
/// factor of 4 or more.
pub(super) struct SweepAxis {
    pub(super) log: bool,
    pub(super) range: (f64, f64),
    pub(super) labels: usize,
    pub(super) desc: &'static str,
}

impl SweepAxis {
    pub(super) fn of(chart: &SweepChart) -> SweepAxis {
        let dots = || chart.configs.iter().flat_map(|(_, d)| d.iter());
        let bmin = dots().map(|d| d.batch).min().unwrap_or(1).max(1);
        let bmax = dots().map(|d| d.batch).max().unwrap_or(1).max(bmin);
        let log = bmax as f64 / bmin as f64 >= 4.0;
        let xv = |b: usize| if log { (b as f64).log2() } else { b as f64 };
        let (x0, x1) = if log {
            (xv(bmin) - 0.25, xv(bmax) + 0.25)
        } else {
            let pad = ((bmax - bmin) as f64 * 0.08).max(4.0);
            (bmin as f64 - pad, bmax as f64 + pad)
        };
        SweepAxis {
            log,
            range: (x0, x1),
            labels: if log {
                ((x1 - x0).ceil() as usize * 2).max(2)
            } else {
                10
            },
            desc: if log {
                "batch size (images per step, log scale)"
            } else {
                "batch size (images per step)"
            },
        }
    }

    /// Where batch size `b` sits on the axis.
    fn x(&self, b: usize) -> f64 {
        if self.log {
            (b as f64).log2()
        } else {
            b as f64
        }
    }

    /// The tick label at `x`: batch sizes at powers of two on a log axis.
    fn label(&self, x: &f64) -> String {
        if self.log {
            if (x - x.round()).abs() < 1e-6 {
                format!("{}", 2f64.powf(x.round()).round() as u64)
            } else {
                String::new()
            }
        } else {
            format!("{}", x.round() as i64)
        }
    }

    /// A panel over this axis and `0..ymax`, its mesh drawn with `y_desc`.
    fn panel<'a, DB: DrawingBackend>(
        &self,
        area: &'a DrawingArea<DB, Shift>,
        ymax: f64,
        y_desc: &str,
    ) -> Result<Panel<'a, DB>, DrawError<DB>>
    where
        DB::ErrorType: 'static,
    {
        let (x0, x1) = self.range;
        Frame {
            caption: None,
            x: x0..x1,
            ymax,
            x_label_area: 50,
            x_desc: self.desc,
            y_desc,
            x_labels: Some(self.labels),
            x_label: &|x| self.label(x),
        }
        .draw(area)
    }
}

impl SweepChart {
    /// Whether configuration `i` is lossy.
    fn is_lossy(&self, i: usize) -> bool {
        self.lossy.get(i).copied().unwrap_or(false)
    }

    /// The top panel: peak memory per batch size, one line per configuration, the limit, the
    /// `--find-max` results, and markers where a point ran out of memory or failed.
    fn draw_memory<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        x: &SweepAxis,
    ) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let max_bytes = self
            .configs
            .iter()
            .flat_map(|(_, d)| d.iter())
            .filter_map(|d| d.peak)
            .chain(self.limit)
            .max()
            .unwrap_or(1024 * 1024)
            .max(1);
        let unit = MemUnit::for_max(max_bytes);
        let ymax = unit.of(max_bytes) * 1.15;
        // Where OOM points sit: on the line the peaks are measured against (the heap budget on
        // the CPU, else the limit), or near the top without a limit.
        let oom_y = self
            .heap_budget
            .or(self.limit)
            .map(|l| unit.of(l))
            .unwrap_or(ymax * 0.93);
        let y_desc = match self.heap_budget {
            Some(_) => format!("training peak, heap ({})", unit.name),
            None => format!("peak memory ({})", unit.name),
        };
        let mut mem = x.panel(area, ymax, &y_desc)?;
        let (x0, x1) = x.range;
        let mut rules = Vec::new();
        for (bytes, color, label) in limit_rules(self.limit, self.heap_budget) {
            let y = unit.of(bytes);
            draw_rule(&mut mem, (x0, y), (x1, y), color, label)?;
            rules.push(y);
        }
        let (mut any_oom, mut any_failed) = (false, false);
        let n = self.configs.len();
        let mut maxima = Vec::new();
        let all: Vec<Vec<(f64, f64)>> = self
            .configs
            .iter()
            .map(|(_, d)| {
                d.iter()
                    .filter(|p| p.status == Status::Ok)
                    .filter_map(|p| p.peak.map(|b| (x.x(p.batch), unit.of(b))))
                    .collect()
            })
            .collect();
        let same = same_as(&all, 0.004 * ymax);
        let mut lossy_legend = true;
        for (i, ((label, d), ok)) in self.configs.iter().zip(all.clone()).enumerate() {
            let color = series_color(i);
            let width = series_width(i, n);
            let lossy = self.is_lossy(i);
            let label = lossy_label(label, lossy);
            // Over an earlier configuration: dashed, named in the legend.
            let label = match same[i] {
                Some((j, by)) => format!(
                    "{} {}",
                    shorten(&label, 40),
                    covers_note(&self.configs[j].0, by, &unit)
                ),
                None => shorten(&label, 50),
            };
            draw_line(&mut mem, ok.clone(), color, width, same[i].is_some(), label)?;
            let r = 3 + width as i32 / 2;
            if lossy {
                draw_lossy_markers(&mut mem, &ok, r + 3, color, lossy_legend)?;
                lossy_legend = false;
            } else {
                mem.draw_series(ok.iter().map(|&p| Circle::new(p, r, color.filled())))?;
            }
            if let Some(Some(m)) = self.maxima.get(i) {
                if let Some(p) = d.iter().find(|p| p.batch == *m).and_then(|p| p.peak) {
                    maxima.push((i, *m, (x.x(*m), unit.of(p))));
                }
            }
            let (oom, failed) = self.draw_failures(&mut mem, i, d, x, oom_y)?;
            any_oom |= oom;
            any_failed |= failed;
        }
        let failures: Vec<f64> = self
            .configs
            .iter()
            .flat_map(|(_, d)| d.iter().filter(|p| p.status != Status::Ok))
            .map(|p| x.x(p.batch))
            .collect();
        let obstacles = Obstacles {
            rules: &rules,
            failures: (&failures, oom_y),
            lines: &all,
        };
        draw_max_labels(&mut mem, &self.configs, &maxima, obstacles)?;
        self.marker_legend(&mut mem, any_oom, any_failed)?;
        draw_series_legend(&mut mem, SeriesLabelPosition::UpperLeft, 17)
    }

    /// Configuration `i`'s points that did not run (`d`), at height `oom_y`: a cross for out of
    /// memory, a triangle for another failure. Returns whether it drew each kind.
    fn draw_failures<DB: DrawingBackend>(
        &self,
        mem: &mut Panel<'_, DB>,
        i: usize,
        d: &[SweepDot],
        x: &SweepAxis,
        oom_y: f64,
    ) -> Result<(bool, bool), DrawError<DB>>
    where
        DB::ErrorType: 'static,
    {
        let color = series_color(i);
        let (mut any_oom, mut any_failed) = (false, false);
        // Markers of different configurations at the same batch size sit side by side.
        let dx = (i as i32 * 2 - (self.configs.len() as i32 - 1)) * 8;
        for p in d.iter().filter(|p| p.status != Status::Ok) {
            let at = (x.x(p.batch), oom_y);
            if p.status == Status::Oom {
                any_oom = true;
                mem.draw_series(std::iter::once(
                    EmptyElement::at(at) + Cross::new((dx, 0), 8, color.stroke_width(3)),
                ))?;
            } else {
                any_failed = true;
                mem.draw_series(std::iter::once(
                    EmptyElement::at(at) + TriangleMarker::new((dx, 0), 8, color.stroke_width(2)),
                ))?;
            }
        }
        Ok((any_oom, any_failed))
    }

    /// Legend entries explaining the failure markers that were drawn.
    fn marker_legend<DB: DrawingBackend>(
        &self,
        mem: &mut Panel<'_, DB>,
        any_oom: bool,
        any_failed: bool,
    ) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let black = RGBColor(40, 40, 40);
        if any_oom {
            mem.draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
                .label(if self.heap_budget.is_some() {
                    "out of memory (drawn on the heap budget)"
                } else if self.limit.is_some() {
                    "out of memory (drawn on the limit)"
                } else {
                    "out of memory"
                })
                .legend(move |(x, y)| Cross::new((x + 12, y), 7, black.stroke_width(3)));
        }
        if any_failed {
            mem.draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
                .label("failed (not memory)")
                .legend(move |(x, y)| TriangleMarker::new((x + 12, y), 7, black.stroke_width(2)));
        }
        Ok(())
    }

    /// The bottom panel: images/s per batch size, one line per configuration.
    fn draw_speed<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        x: &SweepAxis,
    ) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let max_ips = self
            .configs
            .iter()
            .flat_map(|(_, d)| d.iter())
            .filter_map(|d| d.ips)
            .fold(0.0f64, f64::max)
            .max(1e-3)
            * 1.15;
        let mut speed = x.panel(area, max_ips, "throughput (images/s)")?;
        let n = self.configs.len();
        for (i, (_, d)) in self.configs.iter().enumerate() {
            let color = series_color(i);
            let width = series_width(i, n);
            let pts: Vec<(f64, f64)> = d
                .iter()
                .filter_map(|p| {
                    p.ips
                        .filter(|_| p.status == Status::Ok)
                        .map(|v| (x.x(p.batch), v))
                })
                .collect();
            speed.draw_series(LineSeries::new(pts.clone(), color.stroke_width(width)))?;
            let r = 3 + width as i32 / 2;
            if self.is_lossy(i) {
                draw_lossy_markers(&mut speed, &pts, r + 3, color, false)?;
            } else {
                speed.draw_series(pts.iter().map(|&p| Circle::new(p, r, color.filled())))?;
            }
        }
        Ok(())
    }
}

/// What the "max N" labels keep clear of besides each other and the points: the limit lines'
/// heights, the failure markers (their batches' x, drawn at one height) and the series' lines.
struct Obstacles<'a> {
    rules: &'a [f64],
    failures: (&'a [f64], f64),
    lines: &'a [Vec<(f64, f64)>],
}

/// The `--find-max` results as "max N" labels, each beside its point where it overlaps no other
/// label, no point, no limit line and no failure marker of the panel, and no line crosses it; one
/// that fits nowhere is named in the upper right instead. `maxima`: (configuration index, batch,
/// point).
fn draw_max_labels<DB: DrawingBackend>(
    mem: &mut Panel<'_, DB>,
    configs: &[(String, Vec<SweepDot>)],
    maxima: &[(usize, usize, (f64, f64))],
    obstacles: Obstacles<'_>,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let area = mem.plotting_area().strip_coord_spec();
    let (x0, y0) = area.get_base_pixel();
    let (w, h) = area.dim_in_pixel();
    // Labels stay clear of the legend box in the upper left.
    let legend_h = 30 * (configs.len() as i32 + 5);
    let bounds = (x0, y0, x0 + w as i32, y0 + h as i32);
    let mut boxes = LabelBoxes::default();
    boxes.reserve((x0, y0, x0 + 420, y0 + legend_h));
    for &(_, _, p) in maxima {
        let (px, py) = mem.backend_coord(&p);
        boxes.reserve((px - 7, py - 7, px + 7, py + 7));
    }
    for line in obstacles.lines {
        let pixels: Vec<(i32, i32)> = line.iter().map(|p| mem.backend_coord(p)).collect();
        boxes.avoid_line(&pixels);
    }
    let x_any = mem.as_coord_spec().get_x_range().start;
    for &y in obstacles.rules {
        let (_, py) = mem.backend_coord(&(x_any, y));
        boxes.reserve((x0, py - 2, x0 + w as i32, py + 2));
    }
    // Failure markers sit up to 8 px either side of their batch per configuration.
    let (xs, y) = obstacles.failures;
    let spread = 8 * configs.len() as i32 + 8;
    for &fx in xs {
        let (px, py) = mem.backend_coord(&(fx, y));
        boxes.reserve((px - spread, py - 9, px + spread, py + 9));
    }
    let mut elsewhere = Vec::new();
    for &(i, m, p) in maxima {
        let color = series_color(i);
        let style = TextStyle::from((FONT, 17).into_font()).color(&color);
        let text = format!("max {m}");
        let size = area.estimate_text_size(&text, &style)?;
        let size = (size.0 as i32 + 2, size.1 as i32 + 2);
        let (px, py) = mem.backend_coord(&p);
        match boxes.place(&label_spots((px, py), size), size, bounds) {
            Some((lx, ly)) => {
                if let Some(end) = leader_end((px, py), (lx, ly), size) {
                    area.draw(&PathElement::new(
                        vec![(px - x0, py - y0), (end.0 - x0, end.1 - y0)],
                        color.stroke_width(1),
                    ))?;
                }
                area.draw(&Text::new(text, (lx - x0 + 1, ly - y0 + 1), style))?
            }
            None => elsewhere.push(format!("{}: max {m}", shorten(&configs[i].0, 30))),
        }
    }
    const INK: RGBColor = RGBColor(60, 60, 60);
    let style = TextStyle::from((FONT, 15).into_font())
        .color(&INK)
        .pos(Pos::new(HPos::Right, VPos::Top));
    for (k, line) in elsewhere.into_iter().enumerate() {
        area.draw(&Text::new(
            line,
            (w as i32 - 8, 8 + 20 * k as i32),
            style.clone(),
        ))?;
    }
    Ok(())
}

/// Signed percentage, e.g. `-23.4%`.
pub(super) fn pct_cell(v: Option<f64>) -> String {
    v.map(|p| {
        if p.abs() < 0.05 {
            "±0.0%".to_string()
        } else {
            format!("{p:+.1}%")
        }
    })
    .unwrap_or_else(|| "-".into())
}
