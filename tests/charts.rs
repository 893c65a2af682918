//! The sweep, comparison and frontier charts can be read: no two labels overlap (checked on the
//! SVG twin of each chart, text boxes estimated from their font size), configurations that
//! measured the same keep their own labels, colours do not repeat after ten configurations and
//! none is the memory limit's red.

use memtrain::sweep::batch::{BatchPlan, SweepResult};
use memtrain::sweep::report::write_sweep_report;
use memtrain::sweep::results::{MaxBatch, SweepPoint, Variant};
use memtrain::sweep::{ChildRun, Status};
use memtrain::train::Summary;
use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;

fn run(dir: &Path, peak_mib: f64, ips: f64) -> ChildRun {
    let peak = (peak_mib * MIB as f64) as u64;
    let mut summary = Summary::default();
    summary.memory.peak_bytes = peak;
    summary.memory.step_peak_bytes = peak;
    summary.memory.baseline_bytes = MIB;
    summary.progress.images_per_sec = ips;
    ChildRun {
        args: Vec::new(),
        run_dir: dir.to_path_buf(),
        status: Status::Ok,
        note: String::new(),
        exit_code: Some(0),
        signal: None,
        wall_secs: 1.0,
        summary: Some(summary),
        lossy: false,
    }
}

/// Twelve configurations; f16 and bf16 measured the same at every batch, and every search ended
/// at the same batch, so their "max" labels and frontier labels compete for one spot.
fn crowded(dir: &Path) -> SweepResult {
    let labels: Vec<String> = ["f32", "f16", "bf16", "ckpt-blocks", "ckpt-auto"]
        .iter()
        .map(|s| s.to_string())
        .chain((0..7).map(|i| format!("config {i}")))
        .collect();
    let mut points = Vec::new();
    for (i, l) in labels.iter().enumerate() {
        // f16 and bf16 alike, ckpt-blocks and ckpt-auto alike.
        let k = [0.0, 1.0, 1.0, 2.0, 2.0][..]
            .get(i)
            .copied()
            .unwrap_or(i as f64);
        for b in [32, 64, 128] {
            let peak = 20.0 + k * 0.3 + b as f64 / 8.0;
            let ips = 400.0 + k * 2.0 + b as f64;
            points.push(SweepPoint {
                configuration: l.clone(),
                batch_size: b,
                run: run(&dir.join(format!("{i}-{b}")), peak, ips),
                oom_report: None,
            });
        }
    }
    SweepResult {
        command: "batch_sweep".into(),
        steps: 1,
        memory_limit_bytes: Some(45 * MIB),
        plan: BatchPlan::List(vec![32, 64, 128]),
        configurations: labels
            .iter()
            .map(|l| Variant {
                label: l.clone(),
                flags: Vec::new(),
            })
            .collect(),
        points,
        max_batches: labels
            .iter()
            .map(|l| MaxBatch {
                configuration: l.clone(),
                max_batch: Some(128),
                first_oom: None,
                recommended: None,
                margin: 0.05,
                capped: true,
                note: String::new(),
            })
            .collect(),
        interrupted: false,
    }
}

/// A text's box in pixels: (x0, y0, x1, y1), from its anchor, baseline shift and font size
/// (glyphs of DejaVu Sans average a little over half the font size wide); rotated texts (the
/// layer names under the step charts) are left out.
fn text_boxes(svg: &Path) -> Vec<(String, (f64, f64, f64, f64))> {
    let text = std::fs::read_to_string(svg).unwrap();
    let doc = roxmltree::Document::parse(&text).unwrap();
    doc.descendants()
        .filter(|n| n.has_tag_name("text") && n.attribute("transform").is_none())
        .filter_map(|n| {
            let s = n.text().unwrap_or("").trim().to_string();
            if s.is_empty() {
                return None;
            }
            let num = |a: &str| n.attribute(a).and_then(|v| v.parse::<f64>().ok());
            let (x, y, size) = (num("x")?, num("y")?, num("font-size")?);
            let w = s.chars().count() as f64 * size * 0.55;
            let x0 = match n.attribute("text-anchor") {
                Some("middle") => x - w / 2.0,
                Some("end") => x - w,
                _ => x,
            };
            let top = match n.attribute("dy") {
                Some(d) if d.contains("0.76em") => y,
                Some(d) if d.contains("0.5ex") => y - size / 2.0,
                _ => y - size * 0.8,
            };
            Some((s, (x0, top, x0 + w, top + size)))
        })
        .collect()
}

/// No two texts of `svg` overlap (by more than a pixel: the estimate is not exact).
fn assert_no_overlap(svg: &Path) {
    let boxes = text_boxes(svg);
    assert!(!boxes.is_empty(), "{} has no text", svg.display());
    for (i, (a, ba)) in boxes.iter().enumerate() {
        for (b, bb) in &boxes[i + 1..] {
            let overlap_x = ba.2.min(bb.2) - ba.0.max(bb.0);
            let overlap_y = ba.3.min(bb.3) - ba.1.max(bb.1);
            assert!(
                overlap_x <= 1.0 || overlap_y <= 1.0,
                "{}: \"{a}\" {ba:?} overlaps \"{b}\" {bb:?}",
                svg.display()
            );
        }
    }
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("memtrain-charts-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn crowded_sweep_charts_have_no_overlapping_labels_and_twelve_colours() {
    let dir = tmp("sweep");
    let r = crowded(&dir);
    write_sweep_report(&dir, &r).unwrap();
    for chart in ["sweep.svg", "frontier.svg"] {
        assert_no_overlap(&dir.join(chart));
    }
    // Every configuration's label is somewhere in the frontier chart: beside its point, or
    // numbered there and listed.
    let texts: Vec<String> = text_boxes(&dir.join("frontier.svg"))
        .into_iter()
        .map(|t| t.0)
        .collect();
    for p in &r.points {
        let label = format!("{} b{}", p.configuration, p.batch_size);
        assert!(
            texts.iter().any(|t| t.ends_with(&label)),
            "{label} missing: {texts:?}"
        );
    }
    // bf16 measured exactly what f16 did: its line is dashed over f16's and the legend says so.
    let legend: Vec<String> = text_boxes(&dir.join("sweep.svg"))
        .into_iter()
        .map(|t| t.0)
        .collect();
    assert!(legend.iter().any(|t| t == "bf16 (= f16)"), "{legend:?}");
    assert!(
        legend.iter().any(|t| t == "ckpt-auto (= ckpt-blocks)"),
        "{legend:?}"
    );
    // One colour per configuration's line, none of them the limit's red (#C81E1E).
    let svg = std::fs::read_to_string(dir.join("sweep.svg")).unwrap();
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let mut strokes: Vec<String> = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline"))
        .filter_map(|n| n.attribute("stroke").map(str::to_uppercase))
        .filter(|s| s != "#C81E1E" && s != "#000000")
        .collect();
    strokes.sort();
    strokes.dedup();
    assert!(strokes.len() >= 12, "{strokes:?}");
    assert!(
        !svg.to_uppercase().contains("#D62728"),
        "the palette's red is gone"
    );
    if std::env::var_os("MEMTRAIN_KEEP_CHARTS").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A step of six blocks under `--checkpoint stages`: forward, head, then per stage a
/// recomputation and its blocks' backward, then the optimizer.
fn step(label: &str, scale: u64) -> memtrain_core::memory::timeline::StepTimeline {
    use memtrain_core::memory::timeline::{CategoryBytes, StepTimeline, TimelineEvent};
    use memtrain_core::phase::Phase;
    let blocks = [
        "stage1.block1",
        "stage1.block2",
        "stage2.block1",
        "stage2.block2",
        "stage3.block1",
        "stage3.block2",
    ];
    let mut order: Vec<(Phase, String)> = blocks
        .iter()
        .map(|b| (Phase::Forward, b.to_string()))
        .collect();
    order.push((Phase::Forward, "head".into()));
    order.push((Phase::Backward, "head".into()));
    for s in (0..3).rev() {
        let (a, b) = (blocks[2 * s], blocks[2 * s + 1]);
        order.push((
            Phase::Backward,
            memtrain_core::model::cnn::recompute_label(a, b),
        ));
        order.push((Phase::Backward, b.to_string()));
        order.push((Phase::Backward, a.to_string()));
    }
    order.push((Phase::Optimizer, "optimizer".into()));
    let events = order
        .into_iter()
        .enumerate()
        .map(|(index, (phase, layer))| {
            let categories = CategoryBytes {
                other: 18 * MIB,
                params: MIB,
                saved: (index as u64 % 5) * MIB * scale,
                transient: 2 * MIB,
                ..Default::default()
            };
            TimelineEvent {
                index,
                phase,
                layer,
                micro_batch: 0,
                current_bytes: categories.total(),
                peak_bytes: categories.total() + (index as u64 % 3) * MIB,
                categories,
                predicted_peak_bytes: Some(categories.total() + (index as u64 % 3) * MIB),
                predicted_current_bytes: None,
                end_us: None,
                gpu_us: None,
            }
        })
        .collect();
    StepTimeline {
        label: label.into(),
        probe: "cpu-heap".into(),
        global_step: 3,
        start_bytes: 20 * MIB,
        events,
    }
}

#[test]
fn step_charts_have_no_overlapping_labels_and_the_panels_name_each_runs_events() {
    use memtrain::sweep::step_chart::write_step_timeline_chart;
    use memtrain::sweep::step_overlay::write_step_timeline_overlay;
    let dir = tmp("step");
    let t = step("bs128 f32 ckpt=stages", 1);
    std::fs::write(
        dir.join(memtrain_core::memory::timeline::STEP_TIMELINE_FILE),
        serde_json::to_string(&t).unwrap(),
    )
    .unwrap();
    write_step_timeline_chart(
        &dir,
        "Memory inside one training step: bs128 f32 ckpt=stages",
    )
    .unwrap();
    assert_no_overlap(&dir.join("step_timeline.svg"));
    // The peak event's legend names the recomputed segment in full.
    let texts: Vec<String> = text_boxes(&dir.join("step_timeline.svg"))
        .into_iter()
        .map(|t| t.0)
        .collect();
    assert!(
        texts.iter().any(|t| t.contains("freed within the event")),
        "{texts:?}"
    );

    // Three configurations side by side, one with the recomputations left out: each panel
    // names every event of its own run (abbreviated), and no header or label overlaps another.
    let mut plain = step("none", 2);
    plain.events.retain(|e| !e.layer.starts_with("recompute"));
    let lines = vec![
        ("stages".to_string(), false, t.clone()),
        ("stages again".to_string(), false, step("again", 1)),
        ("none".to_string(), false, plain.clone()),
    ];
    let files = write_step_timeline_overlay(&lines, &dir.join("overlay")).unwrap();
    assert_no_overlap(&files[1]);
    let svg = std::fs::read_to_string(&files[1]).unwrap();
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let rotated: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text") && n.attribute("transform").is_some())
        .filter_map(|n| n.text().map(str::trim))
        .filter(|t| !t.starts_with("memory ("))
        .collect();
    assert_eq!(
        rotated.len(),
        2 * t.events.len() + plain.events.len(),
        "{rotated:?}"
    );
    assert!(rotated.contains(&"rc s1.b1–b2"), "{rotated:?}");
    assert!(rotated.contains(&"s3.b2"), "{rotated:?}");
    if std::env::var_os("MEMTRAIN_KEEP_CHARTS").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The heights (y, in pixels) of the horizontal dashed rules drawn in `color` (`#RRGGBB`) across
/// the plot: ten dashes or more at one height (the legend's swatch has two).
fn rule_heights(svg: &Path, color: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(svg).unwrap();
    let doc = roxmltree::Document::parse(&text).unwrap();
    let mut ys: Vec<f64> = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline") && n.attribute("stroke") == Some(color))
        .filter_map(|n| {
            let pts: Vec<f64> = n
                .attribute("points")?
                .split([' ', ','])
                .filter_map(|v| v.parse().ok())
                .collect();
            (pts.len() == 4 && pts[1] == pts[3]).then_some(pts[1])
        })
        .collect();
    ys.sort_by(f64::total_cmp);
    let mut rules = Vec::new();
    for y in &ys {
        if !rules.contains(y) && ys.iter().filter(|v| *v == y).count() >= 10 {
            rules.push(*y);
        }
    }
    rules
}

/// A search that ended just under the heap budget: its "max" label clears the limit's and the
/// budget's lines and the out-of-memory crosses drawn on the budget.
#[test]
fn max_labels_keep_off_the_limit_lines() {
    let dir = tmp("rules");
    let budget = 30 * MIB;
    let point = |b: usize, peak: f64, status: Status| {
        let mut c = run(&dir.join(b.to_string()), peak, 500.0);
        c.status = status;
        if let Some(s) = c.summary.as_mut() {
            s.memory.heap_budget_bytes = Some(budget);
        }
        SweepPoint {
            configuration: "f32".into(),
            batch_size: b,
            run: c,
            oom_report: None,
        }
    };
    let r = SweepResult {
        command: "batch_sweep".into(),
        steps: 1,
        memory_limit_bytes: Some(50 * MIB),
        plan: BatchPlan::List(vec![32, 64, 72, 96]),
        configurations: vec![Variant {
            label: "f32".into(),
            flags: Vec::new(),
        }],
        points: vec![
            point(32, 20.0, Status::Ok),
            point(64, 28.0, Status::Ok),
            point(72, 29.0, Status::Ok),
            point(96, 0.0, Status::Oom),
        ],
        max_batches: vec![MaxBatch {
            configuration: "f32".into(),
            max_batch: Some(72),
            first_oom: Some(96),
            recommended: None,
            margin: 0.05,
            capped: false,
            note: String::new(),
        }],
        interrupted: false,
    };
    write_sweep_report(&dir, &r).unwrap();
    let svg = dir.join("sweep.svg");
    let rules: Vec<f64> = ["#C81E1E", "#821414"]
        .iter()
        .flat_map(|c| rule_heights(&svg, c))
        .collect();
    assert_eq!(
        rules.len(),
        2,
        "the limit's and the budget's lines: {rules:?}"
    );
    let labels: Vec<_> = text_boxes(&svg)
        .into_iter()
        .filter(|(t, _)| t == "max 72")
        .collect();
    assert_eq!(labels.len(), 1, "{labels:?}");
    for (t, b) in &labels {
        for y in &rules {
            assert!(
                *y < b.1 || *y > b.3,
                "\"{t}\" {b:?} crosses the line at y = {y}"
            );
        }
    }
    assert_no_overlap(&svg);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_overlap_check_finds_overlapping_labels() {
    let dir = tmp("detector");
    let svg = dir.join("t.svg");
    std::fs::write(
        &svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg"><text x="10" y="10" font-size="17" dy="0.76em">max 128</text><text x="20" y="14" font-size="17" dy="0.76em">max 256</text></svg>"#,
    )
    .unwrap();
    let caught = std::panic::catch_unwind(|| assert_no_overlap(&svg));
    assert!(caught.is_err(), "two labels 10 px apart overlap");
    std::fs::write(
        &svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg"><text x="10" y="10" font-size="17" dy="0.76em">max 128</text><text x="10" y="40" font-size="17" dy="0.76em">max 256</text></svg>"#,
    )
    .unwrap();
    assert_no_overlap(&svg);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn compare_charts_keep_cjk_and_emoji_labels_and_twelve_bar_colours() {
    use memtrain::sweep::report::write_compare_report;
    use memtrain::sweep::results::{CompareEntry, CompareResult};
    let dir = tmp("compare");
    let labels: Vec<String> = ["基线", "训练 f16", "🚀 fast"]
        .iter()
        .map(|s| s.to_string())
        .chain((0..9).map(|i| format!("config {i}")))
        .collect();
    let mut r = CompareResult {
        command: "compare".into(),
        common: Vec::new(),
        entries: labels
            .iter()
            .enumerate()
            .map(|(i, l)| CompareEntry {
                label: l.clone(),
                flags: Vec::new(),
                run: run(
                    &dir.join(format!("run{i}")),
                    30.0 + i as f64,
                    400.0 - i as f64,
                ),
                peak_change_pct: None,
                speed_change_pct: None,
                oom_report: None,
            })
            .collect(),
        interrupted: false,
    };
    r.update_changes();
    write_compare_report(&dir, &r).unwrap();
    for chart in ["peak_memory.svg", "frontier.svg"] {
        assert_no_overlap(&dir.join(chart));
        let texts: Vec<String> = text_boxes(&dir.join(chart))
            .into_iter()
            .map(|t| t.0)
            .collect();
        // The SVG keeps the labels as they are (a browser draws them with its fonts).
        assert!(texts.iter().any(|t| t.contains("训练 f16")), "{texts:?}");
        assert!(texts.iter().any(|t| t.contains("🚀 fast")), "{texts:?}");
    }
    let svg = std::fs::read_to_string(dir.join("peak_memory.svg")).unwrap();
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let mut fills: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("rect"))
        .filter_map(|n| n.attribute("fill"))
        .filter(|f| *f != "#FFFFFF")
        .collect();
    fills.sort();
    fills.dedup();
    assert!(fills.len() >= 12, "one colour per bar: {fills:?}");
    if std::env::var_os("MEMTRAIN_KEEP_CHARTS").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The segments of the solid lines of `svg` at least `min_width` pixels wide (series and
/// frontier lines, not the thin leaders from a label back to its point).
fn line_segments(svg: &Path, min_width: f64) -> Vec<((f64, f64), (f64, f64))> {
    let text = std::fs::read_to_string(svg).unwrap();
    let doc = roxmltree::Document::parse(&text).unwrap();
    doc.descendants()
        .filter(|n| n.has_tag_name("polyline"))
        .filter(|n| {
            n.attribute("stroke-width")
                .and_then(|w| w.parse::<f64>().ok())
                .is_some_and(|w| w >= min_width)
        })
        .flat_map(|n| {
            let v: Vec<f64> = n
                .attribute("points")
                .unwrap_or("")
                .split([' ', ','])
                .filter_map(|v| v.parse().ok())
                .collect();
            let pts: Vec<(f64, f64)> = v.chunks(2).map(|c| (c[0], c[1])).collect();
            pts.windows(2).map(|w| (w[0], w[1])).collect::<Vec<_>>()
        })
        .collect()
}

/// Whether segment a–b passes through the box (x0, y0, x1, y1), sampled every half pixel.
fn crosses(((ax, ay), (bx, by)): ((f64, f64), (f64, f64)), b: (f64, f64, f64, f64)) -> bool {
    let n = ((bx - ax).abs().max((by - ay).abs()) * 2.0).ceil().max(1.0) as usize;
    (0..=n).any(|k| {
        let t = k as f64 / n as f64;
        let (x, y) = (ax + t * (bx - ax), ay + t * (by - ay));
        x > b.0 && x < b.2 && y > b.1 && y < b.3
    })
}

/// No line crosses the labels beside the points: a `--find-max` search whose largest batch sits
/// at the right edge of the plot, the line rising to it from the left, just under the limit; and
/// a frontier whose staircase runs beside its points.
#[test]
fn no_line_crosses_a_label() {
    let dir = tmp("lines");
    let batches = [32, 64, 128, 256, 384, 448, 480, 496, 504, 512];
    let point = |b: usize| {
        let mut c = run(
            &dir.join(b.to_string()),
            17.5 + 0.51 * b as f64,
            300.0 + b as f64,
        );
        if b > 496 {
            c.status = Status::Oom;
            c.summary = None;
        }
        SweepPoint {
            configuration: "default".into(),
            batch_size: b,
            run: c,
            oom_report: None,
        }
    };
    let r = SweepResult {
        command: "batch_sweep".into(),
        steps: 1,
        memory_limit_bytes: Some(300 * MIB),
        plan: BatchPlan::List(batches.to_vec()),
        configurations: vec![Variant {
            label: "default".into(),
            flags: Vec::new(),
        }],
        points: batches.iter().map(|&b| point(b)).collect(),
        max_batches: vec![MaxBatch {
            configuration: "default".into(),
            max_batch: Some(496),
            first_oom: Some(504),
            recommended: None,
            margin: 0.05,
            capped: false,
            note: String::new(),
        }],
        interrupted: false,
    };
    write_sweep_report(&dir, &r).unwrap();
    for (chart, labelled) in [("sweep.svg", "max 496"), ("frontier.svg", "default b")] {
        let svg = dir.join(chart);
        let lines = line_segments(&svg, 2.0);
        let labels: Vec<_> = text_boxes(&svg)
            .into_iter()
            .filter(|(t, _)| t.starts_with(labelled))
            .collect();
        assert!(!labels.is_empty(), "{chart}: no {labelled}");
        for (t, b) in &labels {
            // The box estimate is not exact: a pixel of slack.
            let inner = (b.0 + 1.0, b.1 + 1.0, b.2 - 1.0, b.3 - 1.0);
            for s in &lines {
                assert!(
                    !crosses(*s, inner),
                    "{chart}: a line {s:?} crosses \"{t}\" {b:?}"
                );
            }
        }
    }
    if std::env::var_os("MEMTRAIN_KEEP_CHARTS").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Two configurations 0.1 MiB apart are drawn over each other but not called equal; two that
/// measured the same are.
#[test]
fn only_equal_series_are_named_equal() {
    let dir = tmp("near");
    let labels = ["a", "b", "c"];
    let points = labels
        .iter()
        .enumerate()
        .flat_map(|(i, l)| {
            let dir = &dir;
            [32, 64].map(move |b| SweepPoint {
                configuration: l.to_string(),
                batch_size: b,
                // b is a's plus 0.1 MiB (within two pixels), c is a's exactly.
                run: run(
                    &dir.join(format!("{l}{b}")),
                    20.0 + b as f64 / 8.0 + [0.0, 0.1, 0.0][i],
                    400.0,
                ),
                oom_report: None,
            })
        })
        .collect();
    let r = SweepResult {
        command: "batch_sweep".into(),
        steps: 1,
        memory_limit_bytes: None,
        plan: BatchPlan::List(vec![32, 64]),
        configurations: labels
            .iter()
            .map(|l| Variant {
                label: l.to_string(),
                flags: Vec::new(),
            })
            .collect(),
        points,
        max_batches: Vec::new(),
        interrupted: false,
    };
    write_sweep_report(&dir, &r).unwrap();
    let texts: Vec<String> = text_boxes(&dir.join("sweep.svg"))
        .into_iter()
        .map(|t| t.0)
        .collect();
    assert!(
        texts.iter().any(|t| t == "b (≈ a, within 0.10 MiB)"),
        "{texts:?}"
    );
    assert!(texts.iter().any(|t| t == "c (= a)"), "{texts:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
