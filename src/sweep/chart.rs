//! The chart machinery shared by every chart of a sweep, comparison or run: the embedded font,
//! the palette, the memory axis unit and [`render`], which draws a [`Chart`] to PNG and SVG.
//!
//! Charts render text with DejaVu Sans embedded in the binary (the `dejavu` crate), so they need
//! no system fonts; in the PNG a character it has no glyph for (CJK, emoji) is written as its
//! code point (`[U+8BAD]`) instead of an empty box ([`png_text`]), the SVG keeps it. Both files are written atomically (see [`crate::io::write_atomic`]).

use crate::error::{Error, Result};
use crate::io::write_atomic;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};
use std::sync::Once;

/// Result type of the drawing code (plotters' errors, boxed).
pub(crate) type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// A chart panel with f64 axes, as the charts' parts draw into it.
pub(crate) type Panel<'a, DB> = ChartContext<
    'a,
    DB,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// What drawing into a panel can fail with.
pub(crate) type DrawError<DB> = DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>;

/// Series colours: Tableau 10 without its red, which is the memory limit's ([`LIMIT_COLOR`]);
/// [`series_color`] continues past them with colours of their own.
pub(crate) const PALETTE: [RGBColor; 9] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// The memory limit's line (always dashed, in the plot and in the legend) and the failure texts.
pub(crate) const LIMIT_COLOR: RGBColor = RGBColor(200, 30, 30);

/// The colour of series `i`: the palette first, then ten hues (red, the limit's, left out) at
/// three lightnesses, then hues spread by the golden angle: no two series share a colour, and
/// the first 39 are far apart.
pub(crate) fn series_color(i: usize) -> RGBColor {
    if let Some(&c) = PALETTE.get(i) {
        return c;
    }
    let k = i - PALETTE.len();
    let (hue, light) = if k < 30 {
        (35.0 + 29.0 * (k % 10) as f64, [0.33, 0.5, 0.68][k / 10])
    } else {
        let h = 40.0 + ((k as f64) * 137.508) % 280.0;
        (h, [0.42, 0.58][k % 2])
    };
    let rgb = HSLColor(hue / 360.0, 0.7, light).to_rgba();
    RGBColor(rgb.0, rgb.1, rgb.2)
}

/// Line width of series `i` of `n`: drawn in order, each wider than the ones drawn over it, so a
/// series that coincides with a later one still shows as its outline.
pub(crate) fn series_width(i: usize, n: usize) -> u32 {
    3 + 2 * (n.saturating_sub(1 + i)).min(2) as u32
}

/// For every series (its points, in drawing order), the first earlier series it would cover, and
/// the largest difference between their y values: the same x values, every y within `tol` (in y
/// units: a pixel or two of the plot) of the earlier one's. Drawn dashed over it and named in the
/// legend ([`covers_note`]), it cannot hide it.
pub(crate) fn same_as(series: &[Vec<(f64, f64)>], tol: f64) -> Vec<Option<(usize, f64)>> {
    let apart = |a: &[(f64, f64)], b: &[(f64, f64)]| {
        let same_x =
            !a.is_empty() && a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.0 == q.0);
        let by = a.iter().zip(b).map(|(p, q)| (p.1 - q.1).abs());
        Some(by.fold(0.0, f64::max)).filter(|&d| same_x && d <= tol)
    };
    series
        .iter()
        .enumerate()
        .map(|(i, s)| (0..i).find_map(|j| apart(s, &series[j]).map(|d| (j, d))))
        .collect()
}

/// The legend's note of a series drawn dashed over the series labelled `other` ([`same_as`]),
/// `by` apart in `unit`: `(= other)` only when the two are equal, else `(≈ other, within 0.17 MiB)`.
pub(crate) fn covers_note(other: &str, by: f64, unit: &MemUnit) -> String {
    let other = shorten(other, 20);
    if by == 0.0 {
        format!("(= {other})")
    } else {
        format!("(≈ {other}, within {by:.2} {})", unit.name)
    }
}

/// A legend swatch of a dashed line, as the plot draws the memory limit.
pub(crate) fn dashed_swatch(
    (x, y): (i32, i32),
    color: RGBColor,
) -> plotters::element::DashedPathElement<std::vec::IntoIter<(i32, i32)>, i32> {
    plotters::element::DashedPathElement::new(
        vec![(x, y), (x + 24, y)],
        6,
        3,
        color.stroke_width(2),
    )
}

/// The heap budget's rule: a darker red than the limit's, as it follows from it.
const HEAP_BUDGET_COLOR: RGBColor = RGBColor(130, 20, 20);

/// The rules a chart of memory peaks draws for a memory limit, as (bytes, colour, legend label):
/// the limit; and on the CPU, where the limit is resident memory and the peaks are heap, the heap
/// budget the trainer derived from it (`heap_budget`), which the peaks are held to.
pub(crate) fn limit_rules(
    limit: Option<u64>,
    heap_budget: Option<u64>,
) -> Vec<(u64, RGBColor, String)> {
    let Some(l) = limit else {
        return Vec::new();
    };
    match heap_budget {
        None => vec![(
            l,
            LIMIT_COLOR,
            format!("memory limit ({})", memtrain_core::memory::format_bytes(l)),
        )],
        Some(h) => vec![
            (
                l,
                LIMIT_COLOR,
                format!(
                    "memory limit, resident memory ({})",
                    memtrain_core::memory::format_bytes(l)
                ),
            ),
            (
                h,
                HEAP_BUDGET_COLOR,
                format!(
                    "heap budget under the limit ({}): what the heap peaks are held to",
                    memtrain_core::memory::format_bytes(h)
                ),
            ),
        ],
    }
}

/// The legend entry of a lossy configuration's marker, the same in every chart.
pub(crate) const LOSSY_LEGEND: &str = "lossy (compressed saved activations): not the exact step";

/// A configuration's label as a chart shows it: marked `(lossy)` when it is, unless the label
/// already says so.
pub(crate) fn lossy_label(label: &str, lossy: bool) -> String {
    if lossy && !label.to_lowercase().contains("lossy") {
        format!("{label} (lossy)")
    } else {
        label.to_string()
    }
}

/// The corners of the lossy marker, a diamond of half-diagonal `r` pixels around (`dx`, 0);
/// `closed` repeats the first corner at the end (for its outline).
fn diamond(r: i32, dx: i32, closed: bool) -> Vec<(i32, i32)> {
    let mut c = vec![(dx, -r), (dx + r, 0), (dx, r), (dx - r, 0)];
    if closed {
        c.push(c[0]);
    }
    c
}

/// A lossy marker at a point: a filled diamond and its outline, in pixels around it.
type LossyMarker<C, DB> =
    plotters::element::ComposedElement<C, DB, Polygon<(i32, i32)>, PathElement<(i32, i32)>>;

/// The lossy marker at `at`: a diamond filled in `color`, outlined in dark grey.
fn lossy_marker<C: Clone, DB: DrawingBackend>(
    at: C,
    r: i32,
    dx: i32,
    color: RGBColor,
) -> LossyMarker<C, DB> {
    const EDGE: RGBColor = RGBColor(40, 40, 40);
    EmptyElement::at(at)
        + Polygon::new(diamond(r, dx, false), color.filled())
        + PathElement::new(diamond(r, dx, true), EDGE.stroke_width(1))
}

/// The legend's lossy diamond: grey, as it stands for lossy points of any colour.
const LOSSY_SWATCH: RGBColor = RGBColor(110, 110, 110);

/// A lossy configuration's points: a diamond each, where an exact configuration's points are
/// circles. With `legend`, the panel's legend gets one [`LOSSY_LEGEND`] entry for them (give it
/// once per panel).
pub(crate) fn draw_lossy_markers<DB: DrawingBackend>(
    chart: &mut Panel<'_, DB>,
    points: &[(f64, f64)],
    r: i32,
    color: RGBColor,
    legend: bool,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let series = chart.draw_series(points.iter().map(|&p| lossy_marker(p, r, 0, color)))?;
    if legend {
        series.label(LOSSY_LEGEND).legend(move |(x, y)| {
            let at = diamond(7, 12, false).into_iter();
            let corners: Vec<(i32, i32)> = at.map(|(dx, dy)| (x + dx, y + dy)).collect();
            Polygon::new(corners, LOSSY_SWATCH.filled())
        });
    }
    Ok(())
}

/// Pixel boxes of labels already placed on a chart and the lines drawn on it, so that the next
/// label is put where it overlaps none of them and no line crosses it (or left out, for the
/// caller to list elsewhere).
#[derive(Default)]
pub(crate) struct LabelBoxes {
    boxes: Vec<(i32, i32, i32, i32)>,
    segments: Vec<((i32, i32), (i32, i32))>,
}

/// Whether the segment a–b passes through the box (x0, y0, x1, y1) (Liang–Barsky clipping).
fn crosses((a, b): ((i32, i32), (i32, i32)), (x0, y0, x1, y1): (i32, i32, i32, i32)) -> bool {
    let (dx, dy) = ((b.0 - a.0) as f64, (b.1 - a.1) as f64);
    let (mut t0, mut t1) = (0f64, 1f64);
    for (p, q) in [
        (-dx, (a.0 - x0) as f64),
        (dx, (x1 - a.0) as f64),
        (-dy, (a.1 - y0) as f64),
        (dy, (y1 - a.1) as f64),
    ] {
        if p == 0.0 {
            if q < 0.0 {
                return false;
            }
        } else if p < 0.0 {
            t0 = t0.max(q / p);
        } else {
            t1 = t1.min(q / p);
        }
    }
    t0 <= t1
}

impl LabelBoxes {
    /// Reserve a box (x0, y0, x1, y1) in pixels: a marker, or a label placed by other means.
    pub(crate) fn reserve(&mut self, b: (i32, i32, i32, i32)) {
        self.boxes.push(b);
    }

    /// Keep labels off a line through `points` (pixels), as wide as a series' widest line.
    pub(crate) fn avoid_line(&mut self, points: &[(i32, i32)]) {
        self.segments
            .extend(points.windows(2).map(|w| (w[0], w[1])));
    }

    /// The first of `candidates` (top-left corners) at which a `w` × `h` box overlaps no box
    /// placed so far and stays inside `bounds`; it is reserved. `None` when every one overlaps.
    pub(crate) fn place(
        &mut self,
        candidates: &[(i32, i32)],
        (w, h): (i32, i32),
        bounds: (i32, i32, i32, i32),
    ) -> Option<(i32, i32)> {
        let inside = |b: (i32, i32, i32, i32)| {
            b.0 >= bounds.0 && b.1 >= bounds.1 && b.2 <= bounds.2 && b.3 <= bounds.3
        };
        // Lines are up to 7 px wide: a box keeps 4 px off their middle.
        let free = |b: (i32, i32, i32, i32)| {
            self.boxes
                .iter()
                .all(|o| b.2 <= o.0 || o.2 <= b.0 || b.3 <= o.1 || o.3 <= b.1)
                && !self
                    .segments
                    .iter()
                    .any(|&s| crosses(s, (b.0 - 4, b.1 - 4, b.2 + 4, b.3 + 4)))
        };
        let at = candidates
            .iter()
            .copied()
            .find(|&(x, y)| inside((x, y, x + w, y + h)) && free((x, y, x + w, y + h)))?;
        self.boxes.push((at.0, at.1, at.0 + w, at.1 + h));
        Some(at)
    }
}

/// Where a line from a point at pixel `p` to its label's box `(x, y, w, h)` should end, when the
/// label is far enough from the point to need one (the nearest point of the box).
pub(crate) fn leader_end(
    p: (i32, i32),
    (x, y): (i32, i32),
    (w, h): (i32, i32),
) -> Option<(i32, i32)> {
    let end = (p.0.clamp(x, x + w), p.1.clamp(y, y + h));
    let (dx, dy) = (end.0 - p.0, end.1 - p.1);
    (dx * dx + dy * dy > 14 * 14).then_some(end)
}

/// Spots around a point at pixel `(px, py)` for a `w` × `h` label, nearest first, then the same
/// farther out: right above, right below, left above, left below, above, below.
pub(crate) fn label_spots((px, py): (i32, i32), (w, h): (i32, i32)) -> Vec<(i32, i32)> {
    let mut out = Vec::new();
    for d in [8, 22, 40, 64, 96, 130] {
        out.extend([
            (px + d, py - h - d / 2),
            (px + d, py + d / 2),
            (px - w - d, py - h - d / 2),
            (px - w - d, py + d / 2),
            (px - w / 2, py - h - d),
            (px - w / 2, py + d),
        ]);
    }
    out
}

pub(crate) const FONT: &str = "sans-serif";

/// Dark grey of the step charts' texts and ticks.
pub(crate) const TEXT_COLOR: RGBColor = RGBColor(50, 50, 50);

/// Register the embedded DejaVu Sans as plotters' `sans-serif` (once per process).
fn ensure_fonts() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
        let _ = plotters::style::register_font(FONT, FontStyle::Bold, dejavu::sans::bold());
    });
}

/// Memory axis unit: MiB, or GiB from 4 GiB up.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MemUnit {
    div: f64,
    pub(crate) name: &'static str,
}

impl MemUnit {
    pub(crate) fn for_max(bytes: u64) -> MemUnit {
        if bytes as f64 >= 4.0 * 1024f64.powi(3) {
            MemUnit {
                div: 1024f64.powi(3),
                name: "GiB",
            }
        } else {
            MemUnit {
                div: 1024f64.powi(2),
                name: "MiB",
            }
        }
    }

    pub(crate) fn of(&self, bytes: u64) -> f64 {
        bytes as f64 / self.div
    }

    /// A value with a sensible number of decimals.
    pub(crate) fn fmt(&self, bytes: u64) -> String {
        let v = self.of(bytes);
        if v >= 100.0 {
            format!("{v:.0} {}", self.name)
        } else if v >= 10.0 {
            format!("{v:.1} {}", self.name)
        } else {
            format!("{v:.2} {}", self.name)
        }
    }
}

/// Something that draws itself onto any plotters backend.
pub(crate) trait Chart {
    /// Canvas size in pixels.
    fn size(&self) -> (u32, u32);
    /// Draw onto `root` (already filled white).
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static;
}

fn chart_error(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::io(
        path,
        std::io::Error::other(format!("drawing the chart failed: {e}")),
    )
}

/// Whether the embedded DejaVu Sans has a glyph for `c` (CJK and emoji it has not).
fn font_covers(c: char) -> bool {
    use ab_glyph::Font as _;
    static FONT: std::sync::OnceLock<Option<ab_glyph::FontRef<'static>>> =
        std::sync::OnceLock::new();
    FONT.get_or_init(|| ab_glyph::FontRef::try_from_slice(dejavu::sans::regular()).ok())
        .as_ref()
        .is_none_or(|f| c.is_control() || f.glyph_id(c).0 != 0)
}

/// `text` as the PNG draws it: a character the embedded font has no glyph for (CJK, emoji)
/// becomes its code point, `[U+8BAD]`, rather than an empty box, so that labels stay readable
/// and distinct. The SVG twin keeps the text as it is (a browser renders it with its own fonts).
pub(crate) fn png_text(text: &str) -> std::borrow::Cow<'_, str> {
    if text.chars().all(font_covers) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if font_covers(c) {
            out.push(c);
        } else {
            out.push_str(&format!("[U+{:04X}]", c as u32));
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A bitmap backend whose texts go through [`png_text`] (drawn and measured alike, so that
/// label placement sees the text as drawn).
struct PngBackend<'a>(BitMapBackend<'a>);

impl DrawingBackend for PngBackend<'_> {
    type ErrorType = <BitMapBackend<'static> as DrawingBackend>::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.0.get_size()
    }
    fn ensure_prepared(&mut self) -> Result<(), BackendError<Self::ErrorType>> {
        self.0.ensure_prepared()
    }
    fn present(&mut self) -> Result<(), BackendError<Self::ErrorType>> {
        self.0.present()
    }
    fn draw_pixel(
        &mut self,
        point: plotters_backend::BackendCoord,
        color: plotters_backend::BackendColor,
    ) -> Result<(), BackendError<Self::ErrorType>> {
        self.0.draw_pixel(point, color)
    }
    fn draw_line<S: plotters_backend::BackendStyle>(
        &mut self,
        from: plotters_backend::BackendCoord,
        to: plotters_backend::BackendCoord,
        style: &S,
    ) -> Result<(), BackendError<Self::ErrorType>> {
        self.0.draw_line(from, to, style)
    }
    fn draw_rect<S: plotters_backend::BackendStyle>(
        &mut self,
        upper_left: plotters_backend::BackendCoord,
        bottom_right: plotters_backend::BackendCoord,
        style: &S,
        fill: bool,
    ) -> Result<(), BackendError<Self::ErrorType>> {
        self.0.draw_rect(upper_left, bottom_right, style, fill)
    }
    fn draw_path<S: plotters_backend::BackendStyle, I: IntoIterator<Item = (i32, i32)>>(
        &mut self,
        path: I,
        style: &S,
    ) -> Result<(), BackendError<Self::ErrorType>> {
        self.0.draw_path(path, style)
    }
    fn draw_circle<S: plotters_backend::BackendStyle>(
        &mut self,
        center: plotters_backend::BackendCoord,
        radius: u32,
        style: &S,
        fill: bool,
    ) -> Result<(), BackendError<Self::ErrorType>> {
        self.0.draw_circle(center, radius, style, fill)
    }
    fn fill_polygon<S: plotters_backend::BackendStyle, I: IntoIterator<Item = (i32, i32)>>(
        &mut self,
        vert: I,
        style: &S,
    ) -> Result<(), BackendError<Self::ErrorType>> {
        self.0.fill_polygon(vert, style)
    }
    fn draw_text<T: plotters_backend::BackendTextStyle>(
        &mut self,
        text: &str,
        style: &T,
        pos: plotters_backend::BackendCoord,
    ) -> Result<(), BackendError<Self::ErrorType>> {
        self.0.draw_text(&png_text(text), style, pos)
    }
    fn estimate_text_size<T: plotters_backend::BackendTextStyle>(
        &self,
        text: &str,
        style: &T,
    ) -> Result<(u32, u32), BackendError<Self::ErrorType>> {
        self.0.estimate_text_size(&png_text(text), style)
    }
    fn blit_bitmap(
        &mut self,
        pos: plotters_backend::BackendCoord,
        size: (u32, u32),
        src: &[u8],
    ) -> Result<(), BackendError<Self::ErrorType>> {
        self.0.blit_bitmap(pos, size, src)
    }
}

type BackendError<E> = plotters_backend::DrawingErrorKind<E>;

/// Render `chart` to `<stem>.png` and `<stem>.svg` (each written atomically); returns both paths.
pub(crate) fn render(chart: &impl Chart, stem: &Path) -> Result<Vec<PathBuf>> {
    ensure_fonts();
    let (w, h) = chart.size();
    let png_path = stem.with_extension("png");
    let svg_path = stem.with_extension("svg");
    let mut rgb = vec![255u8; w as usize * h as usize * 3];
    {
        let root = PngBackend(BitMapBackend::with_buffer(&mut rgb, (w, h))).into_drawing_area();
        root.fill(&WHITE).map_err(|e| chart_error(&png_path, e))?;
        chart.draw(&root).map_err(|e| chart_error(&png_path, e))?;
        root.present().map_err(|e| chart_error(&png_path, e))?;
    }
    let mut png_bytes = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut png_bytes, w, h);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut writer = enc.write_header().map_err(|e| chart_error(&png_path, e))?;
        writer
            .write_image_data(&rgb)
            .map_err(|e| chart_error(&png_path, e))?;
        writer.finish().map_err(|e| chart_error(&png_path, e))?;
    }
    write_atomic(&png_path, &png_bytes)?;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| chart_error(&svg_path, e))?;
        chart.draw(&root).map_err(|e| chart_error(&svg_path, e))?;
        root.present().map_err(|e| chart_error(&svg_path, e))?;
    }
    write_atomic(&svg_path, svg.as_bytes())?;
    Ok(vec![png_path, svg_path])
}

/// The frame of an x–y panel as the sweep charts draw it: the caption (when given), the margins,
/// the axes' descriptions and labels and a light grid; y runs from 0 to `ymax`, labelled without
/// decimals.
pub(crate) struct Frame<'s> {
    /// Caption text and font size.
    pub(crate) caption: Option<(&'s str, u32)>,
    /// The x range.
    pub(crate) x: std::ops::Range<f64>,
    /// The top of the y axis.
    pub(crate) ymax: f64,
    /// Height of the area under the plot for the x labels and description.
    pub(crate) x_label_area: u32,
    /// Description of the x axis.
    pub(crate) x_desc: &'s str,
    /// Description of the y axis.
    pub(crate) y_desc: &'s str,
    /// How many x labels (plotters' default when `None`).
    pub(crate) x_labels: Option<usize>,
    /// The text of an x label.
    pub(crate) x_label: &'s dyn Fn(&f64) -> String,
}

impl Frame<'_> {
    /// Build the panel on `area` and draw its mesh.
    pub(crate) fn draw<'a, DB: DrawingBackend>(
        &self,
        area: &'a DrawingArea<DB, Shift>,
    ) -> std::result::Result<Panel<'a, DB>, DrawError<DB>>
    where
        DB::ErrorType: 'static,
    {
        let mut builder = ChartBuilder::on(area);
        if let Some((text, size)) = self.caption {
            builder.caption(text, (FONT, size));
        }
        let mut chart = builder
            .margin(20)
            .x_label_area_size(self.x_label_area)
            .y_label_area_size(90)
            .build_cartesian_2d(self.x.clone(), 0f64..self.ymax)?;
        let mut mesh = chart.configure_mesh();
        mesh.x_desc(self.x_desc)
            .y_desc(self.y_desc)
            .axis_desc_style((FONT, 20))
            .label_style((FONT, 17));
        if let Some(n) = self.x_labels {
            mesh.x_labels(n);
        }
        mesh.x_label_formatter(self.x_label)
            .y_label_formatter(&|y| format!("{y:.0}"))
            .light_line_style(RGBColor(246, 246, 246))
            .draw()?;
        Ok(chart)
    }
}

/// The legend of a panel's labelled series: a half-transparent white box with a grey border at
/// `position`, its text `font_size` high.
pub(crate) fn draw_series_legend<'a, DB: DrawingBackend + 'a>(
    chart: &mut Panel<'a, DB>,
    position: SeriesLabelPosition,
    font_size: u32,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .position(position)
        .label_font((FONT, font_size))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(180, 180, 180))
        .draw()?;
    Ok(())
}

/// A dashed rule from `from` to `to` (a memory limit, a baseline), named `label` in the legend
/// with a dashed swatch.
pub(crate) fn draw_rule<DB: DrawingBackend>(
    chart: &mut Panel<'_, DB>,
    from: (f64, f64),
    to: (f64, f64),
    color: RGBColor,
    label: String,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    chart
        .draw_series(DashedLineSeries::new(
            vec![from, to],
            12,
            8,
            color.stroke_width(2),
        ))?
        .label(label)
        .legend(move |p| dashed_swatch(p, color));
    Ok(())
}

/// A series' line named `label` in the legend: solid with a swatch as wide as the line, or, where
/// it coincides with an earlier series ([`same_as`]), dashed over it with a dashed swatch.
pub(crate) fn draw_line<DB: DrawingBackend>(
    chart: &mut Panel<'_, DB>,
    points: Vec<(f64, f64)>,
    color: RGBColor,
    width: u32,
    dashed: bool,
    label: String,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    if dashed {
        chart
            .draw_series(DashedLineSeries::new(
                points,
                10,
                8,
                color.stroke_width(width),
            ))?
            .label(label)
            .legend(move |p| dashed_swatch(p, color));
    } else {
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(width)))?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(width))
            });
    }
    Ok(())
}

/// The style of the layer names under a categorical x axis (rotated to read upwards), and the
/// widest of `names` in it on `area`, in pixels.
pub(crate) fn rotated_names<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    names: &[String],
) -> (TextStyle<'static>, u32) {
    let style = TextStyle::from((FONT, 14).into_font())
        .color(&TEXT_COLOR)
        .transform(FontTransform::Rotate270)
        .pos(Pos::new(HPos::Right, VPos::Center));
    let longest = names
        .iter()
        .map(|s| {
            area.estimate_text_size(s, &style)
                .map(|(tw, _)| tw)
                .unwrap_or(0)
        })
        .max()
        .unwrap_or(0);
    (style, longest)
}

/// Shorten a label to `max` characters with an ellipsis.
pub(crate) fn shorten(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        format!(
            "{}…",
            s.chars().take(max.saturating_sub(1)).collect::<String>()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_text_spells_out_what_the_font_lacks() {
        assert_eq!(png_text("训练 f16 🚀"), "[U+8BAD][U+7EC3] f16 [U+1F680]");
        // What DejaVu Sans draws stays as it is: the charts' own signs and accented Latin.
        for s in ["f32 b128", "−23.4% ✓ … – ×", "réseau Ω"] {
            assert_eq!(png_text(s), s);
        }
    }

    #[test]
    fn series_colours_are_distinct_and_never_the_limit_red() {
        let colours: Vec<RGBColor> = (0..39).map(series_color).collect();
        for (i, a) in colours.iter().enumerate() {
            assert_ne!(*a, LIMIT_COLOR);
            // Far from the limit's red: not a strong red (high R, low G and B).
            assert!(!(a.0 > 170 && a.1 < 90 && a.2 < 90), "{i}: {a:?}");
            for b in &colours[i + 1..] {
                let d = (a.0 as i32 - b.0 as i32).abs()
                    + (a.1 as i32 - b.1 as i32).abs()
                    + (a.2 as i32 - b.2 as i32).abs();
                assert!(d > 20, "{a:?} and {b:?} look alike");
            }
        }
        let many: Vec<RGBColor> = (0..300).map(series_color).collect();
        for (i, a) in many.iter().enumerate() {
            assert!(!many[i + 1..].contains(a), "series {i}: {a:?} repeats");
        }
    }
}
