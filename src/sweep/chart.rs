//! The chart machinery shared by every chart of a sweep, comparison or run: the embedded font,
//! the palette, the memory axis unit and [`render`], which draws a [`Chart`] to PNG and SVG.
//!
//! Charts render text with DejaVu Sans embedded in the binary (the `dejavu` crate), so they need
//! no system fonts. Both files are written atomically (see [`crate::io::write_atomic`]).

use crate::error::{Error, Result};
use crate::io::write_atomic;
use plotters::coord::Shift;
use plotters::prelude::*;
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

/// Series colours (Tableau 10).
pub(crate) const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

pub(crate) const FONT: &str = "sans-serif";

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

/// Render `chart` to `<stem>.png` and `<stem>.svg` (each written atomically); returns both paths.
pub(crate) fn render(chart: &impl Chart, stem: &Path) -> Result<Vec<PathBuf>> {
    ensure_fonts();
    let (w, h) = chart.size();
    let png_path = stem.with_extension("png");
    let svg_path = stem.with_extension("svg");
    let mut rgb = vec![255u8; w as usize * h as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
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
