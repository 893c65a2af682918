//! The step timeline charts: `step_timeline.{png,svg}` of one run from its `step_timeline.json`,
//! and the overlay of several configurations, drawn from synthetic timelines.

mod common;
use common::svg_texts;
use memtrain::sweep::compare::{CompareEntry, CompareResult};
use memtrain::sweep::step_chart::write_step_timeline_chart;
use memtrain::sweep::step_overlay::write_step_timeline_overlays;
use memtrain::sweep::step_overlay::{axis_name, grid, step_panels, write_step_timeline_overlay};
use memtrain::sweep::{ChildRun, Status};
use memtrain_core::memory::timeline::{
    CategoryBytes, StepTimeline, TimelineEvent, STEP_TIMELINE_FILE,
};
use memtrain_core::phase::Phase;
use std::path::{Path, PathBuf};

const MIB: u64 = 1024 * 1024;

fn tmp_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("memtrain-step-chart-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// A plausible step of the six-block net: the forward pass saves activations block by block, the
/// backward pass frees them and fills gradients, the optimizer adds its state. With `recompute`,
/// each backward block is preceded by a recompute event (as checkpointing adds).
fn timeline(label: &str, scale: u64, recompute: bool) -> StepTimeline {
    let layers = [
        "stage1.block1",
        "stage1.block2",
        "stage2.block1",
        "stage2.block2",
        "stage3.block1",
        "stage3.block2",
        "head",
    ];
    let start = 20 * MIB;
    let params = 2 * MIB;
    let mut events = Vec::new();
    let mut saved = 0u64;
    let mut push = |phase, layer: String, cats: CategoryBytes, extra: u64| {
        let current = cats.total();
        let index = events.len();
        events.push(TimelineEvent {
            index,
            phase,
            layer,
            micro_batch: 0,
            current_bytes: current,
            peak_bytes: current + extra,
            categories: cats,
            // Some events without a prediction: the chart breaks the line there.
            predicted_peak_bytes: (phase != Phase::Optimizer)
                .then_some(current + extra + extra / 4),
            predicted_current_bytes: None,
            end_us: None,
            gpu_us: None,
        });
    };
    let base = CategoryBytes {
        other: start - params,
        params,
        ..Default::default()
    };
    for (i, l) in layers.iter().enumerate() {
        saved += (12 - i as u64) * MIB * scale / 4;
        push(
            Phase::Forward,
            l.to_string(),
            CategoryBytes {
                saved,
                transient: MIB * scale / 2,
                ..base
            },
            MIB * scale,
        );
    }
    let mut grads = 0u64;
    for (i, l) in layers.iter().enumerate().rev() {
        if recompute {
            push(
                Phase::Backward,
                format!("{l}.recompute"),
                CategoryBytes {
                    saved,
                    grads,
                    transient: 3 * MIB * scale,
                    ..base
                },
                2 * MIB * scale,
            );
        }
        saved = saved.saturating_sub((12 - i as u64) * MIB * scale / 4);
        grads += params / 7;
        push(
            Phase::Backward,
            l.to_string(),
            CategoryBytes {
                saved,
                grads,
                transient: 2 * MIB * scale,
                ..base
            },
            3 * MIB * scale,
        );
    }
    push(
        Phase::Optimizer,
        "optimizer".into(),
        CategoryBytes {
            grads,
            optimizer: params,
            ..base
        },
        MIB,
    );
    StepTimeline {
        label: label.into(),
        probe: "cpu-heap".into(),
        global_step: 7,
        start_bytes: start,
        events,
    }
}

/// `micro` micro-batches of `timeline`'s forward and backward passes (gradient accumulation),
/// then its optimizer event.
fn accumulated(label: &str, micro: usize) -> StepTimeline {
    let one = timeline(label, 1, true);
    let (passes, opt) = one.events.split_at(one.events.len() - 1);
    let mut events = Vec::new();
    for m in 0..micro {
        for e in passes {
            events.push(TimelineEvent {
                micro_batch: m,
                ..e.clone()
            });
        }
    }
    events.extend_from_slice(opt);
    for (i, e) in events.iter_mut().enumerate() {
        e.index = i;
    }
    StepTimeline { events, ..one }
}

fn png_size(path: &Path) -> (u32, u32) {
    let file = std::io::BufReader::new(std::fs::File::open(path).expect("png exists"));
    let mut reader = png::Decoder::new(file)
        .read_info()
        .expect("png header decodes");
    let (w, h) = (reader.info().width, reader.info().height);
    let mut buf = vec![0; reader.output_buffer_size().expect("buffer size")];
    reader.next_frame(&mut buf).expect("png image data decodes");
    // A chart, not a blank canvas: a good share of the pixels is not white.
    let inked = buf.chunks(3).filter(|p| p.iter().any(|&c| c < 200)).count();
    assert!(
        inked > (w * h / 50) as usize,
        "{} is nearly blank ({inked} inked pixels)",
        path.display()
    );
    (w, h)
}

fn assert_contains(texts: &[String], want: &str) {
    assert!(
        texts.iter().any(|t| t.contains(want)),
        "no text containing '{want}' in {texts:?}"
    );
}

#[test]
fn run_chart_draws_png_and_svg_with_legend_and_layer_names() {
    let dir = tmp_dir("run");
    let t = timeline("baseline", 4, false);
    std::fs::write(
        dir.join(STEP_TIMELINE_FILE),
        serde_json::to_string(&t).unwrap(),
    )
    .unwrap();
    let files = write_step_timeline_chart(&dir, "Memory inside one step: baseline").unwrap();
    assert_eq!(
        files,
        vec![dir.join("step_timeline.png"), dir.join("step_timeline.svg")]
    );
    let (w, h) = png_size(&files[0]);
    assert!(
        (800..=3000).contains(&w) && (400..=2000).contains(&h),
        "{w}x{h}"
    );
    let texts = svg_texts(&files[1]);
    for want in [
        "Memory inside one step: baseline",
        "parameters",
        "gradients",
        "optimizer state",
        "saved activations",
        "transient",
        "other",
        "measured peak",
        "predicted peak",
        "forward",
        "backward",
        "stage2.block1",
        "head",
    ] {
        assert_contains(&texts, want);
    }
    // No temporary files left behind by the atomic writes.
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_chart_without_predictions_or_with_one_event_still_draws() {
    let dir = tmp_dir("sparse");
    let mut t = timeline("f16", 1, true);
    for e in &mut t.events {
        e.predicted_peak_bytes = None;
    }
    std::fs::write(
        dir.join(STEP_TIMELINE_FILE),
        serde_json::to_string(&t).unwrap(),
    )
    .unwrap();
    let files = write_step_timeline_chart(&dir, "no predictions").unwrap();
    assert_eq!(files.len(), 2);
    let texts = svg_texts(&files[1]);
    assert!(!texts.iter().any(|t| t.contains("predicted")), "{texts:?}");
    png_size(&files[0]);

    t.events.truncate(1);
    std::fs::write(
        dir.join(STEP_TIMELINE_FILE),
        serde_json::to_string(&t).unwrap(),
    )
    .unwrap();
    let files = write_step_timeline_chart(&dir, "one event").unwrap();
    assert_eq!(files.len(), 2);
    svg_texts(&files[1]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_chart_of_many_events_with_micro_batches() {
    let dir = tmp_dir("accum");
    let t = accumulated("accum4 + ckpt", 4);
    assert_eq!(t.events.len(), 4 * 21 + 1);
    std::fs::write(
        dir.join(STEP_TIMELINE_FILE),
        serde_json::to_string(&t).unwrap(),
    )
    .unwrap();
    let files = write_step_timeline_chart(&dir, "accumulation").unwrap();
    png_size(&files[0]);
    let texts = svg_texts(&files[1]);
    assert_contains(&texts, "4 micro-batches");
    assert_contains(&texts, "recompute");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_or_empty_timeline_writes_nothing() {
    let dir = tmp_dir("missing");
    assert!(write_step_timeline_chart(&dir, "t").unwrap().is_empty());
    let empty = StepTimeline::default();
    std::fs::write(
        dir.join(STEP_TIMELINE_FILE),
        serde_json::to_string(&empty).unwrap(),
    )
    .unwrap();
    assert!(write_step_timeline_chart(&dir, "t").unwrap().is_empty());
    assert!(!dir.join("step_timeline.png").exists());
    assert!(!dir.join("step_timeline.svg").exists());
    assert!(write_step_timeline_overlay(&[], &dir.join("overlay"))
        .unwrap()
        .is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn damaged_timeline_is_an_error_naming_the_file() {
    let dir = tmp_dir("damaged");
    let path = dir.join(STEP_TIMELINE_FILE);
    for bad in [
        "{\"label\": \"x\", \"events\": [",
        "not json at all",
        "[1, 2, 3]",
    ] {
        std::fs::write(&path, bad).unwrap();
        let err = write_step_timeline_chart(&dir, "t").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(!msg.contains('\n'), "not one line: {msg}");
        assert_eq!(err.exit_code(), 1);
    }
    assert!(!dir.join("step_timeline.png").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// One event of a hand-made step, its peak `freed` above what it leaves in use.
fn event(
    phase: Phase,
    layer: &str,
    micro_batch: usize,
    c: CategoryBytes,
    freed: u64,
) -> TimelineEvent {
    TimelineEvent {
        index: 0,
        phase,
        layer: layer.into(),
        micro_batch,
        current_bytes: c.total(),
        peak_bytes: c.total() + freed,
        categories: c,
        predicted_peak_bytes: None,
        predicted_current_bytes: None,
        end_us: None,
        gpu_us: None,
    }
}

#[test]
fn each_panel_is_its_own_runs_step_with_its_peak_and_what_it_is_made_of() {
    let base = CategoryBytes {
        other: 17 * MIB,
        params: MIB,
        optimizer: MIB,
        ..Default::default()
    };
    let with = |saved, transient, grads| CategoryBytes {
        saved,
        transient,
        grads,
        ..base
    };
    // The peak (19 + 21 MiB) at the recomputation; a later event ties it and does not win.
    let ckpt = StepTimeline {
        start_bytes: 19 * MIB,
        events: vec![
            event(
                Phase::Forward,
                "stage1.block1",
                0,
                with(8 * MIB, 2 * MIB, 0),
                MIB,
            ),
            event(
                Phase::Backward,
                "recompute stage1.block1–block2",
                0,
                with(12 * MIB, 5 * MIB, 2 * MIB),
                2 * MIB,
            ),
            event(
                Phase::Backward,
                "stage1.block1",
                0,
                with(0, 19 * MIB, 2 * MIB),
                0,
            ),
            event(Phase::Optimizer, "optimizer", 0, with(0, 0, 2 * MIB), MIB),
        ],
        ..StepTimeline::default()
    };
    let accum = accumulated("accum4", 4);
    let timelines = vec![
        ("ckpt-stages".to_string(), false, ckpt.clone()),
        ("empty".to_string(), false, StepTimeline::default()),
        ("accum4".to_string(), false, accum.clone()),
    ];
    let panels = step_panels(&timelines);
    // The timeline without events has no panel; the others keep their order.
    let labels: Vec<&str> = panels.iter().map(|p| p.label.as_str()).collect();
    assert_eq!(labels, ["ckpt-stages", "accum4"]);

    let p = &panels[0];
    assert_eq!(p.peak_index, 1);
    assert_eq!(p.peak_bytes, 40 * MIB);
    assert_eq!(p.above_start_bytes, 21 * MIB);
    assert_eq!(p.peak_at, "recompute stage1.block1–block2");
    assert_eq!(
        p.made_of,
        [
            ("freed", 2 * MIB),
            ("transient", 5 * MIB),
            ("saved at the peak", 12 * MIB),
            ("gradients", 2 * MIB)
        ]
    );
    assert_eq!(
        p.names,
        ["s1.b1", "rc s1.b1–b2", "s1.b1", "optimizer"],
        "every event of the run named, in the run's order"
    );
    // Zeros are left out of what the peak is made of, and the optimizer is named once.
    let opt_peak = StepTimeline {
        events: vec![event(
            Phase::Optimizer,
            "optimizer",
            0,
            with(0, 0, 2 * MIB),
            0,
        )],
        ..StepTimeline::default()
    };
    let opt_only = [("opt".to_string(), false, opt_peak)];
    let only = step_panels(&opt_only);
    assert_eq!(only[0].made_of, [("gradients", 2 * MIB)]);
    assert_eq!(only[0].peak_at, "optimizer");

    // Four micro-batches: the panel's axis is the run's 85 events, not a merge with others',
    // and the peak names its micro-batch (the first of the equal ones).
    let p = &panels[1];
    assert!(std::ptr::eq(p.timeline, &timelines[2].2));
    assert_eq!(p.names.len(), accum.events.len());
    for (name, e) in p.names.iter().zip(&accum.events) {
        assert_eq!(*name, axis_name(&e.layer));
    }
    let max = accum.events.iter().map(|e| e.peak_bytes).max().unwrap();
    let first = accum
        .events
        .iter()
        .position(|e| e.peak_bytes == max)
        .unwrap();
    assert_eq!((p.peak_index, p.peak_bytes), (first, max));
    let e = &accum.events[first];
    assert_eq!(
        p.peak_at,
        format!("backward of {}, micro-batch 1 of 4", e.layer)
    );
}

#[test]
fn axis_names_abbreviate_stage_block_and_recompute_only() {
    assert_eq!(axis_name("stage2.block1"), "s2.b1");
    assert_eq!(axis_name("recompute stage1.block1–block2"), "rc s1.b1–b2");
    assert_eq!(axis_name("head"), "head");
    assert_eq!(axis_name("optimizer"), "optimizer");
}

#[test]
fn panels_sit_in_rows_of_up_to_three() {
    let shapes: Vec<(usize, usize)> = [1, 2, 3, 4, 5, 6, 7, 11].map(grid).to_vec();
    assert_eq!(
        shapes,
        [
            (1, 1),
            (2, 1),
            (3, 1),
            (2, 2),
            (3, 2),
            (3, 2),
            (3, 3),
            (3, 4)
        ]
    );
}

#[test]
fn the_comparison_draws_one_panel_per_configuration() {
    let dir = tmp_dir("overlay");
    let long = "all four: --precision f16 --accum-steps 4 --checkpoint stages --conv separable";
    let timelines = vec![
        ("default".to_string(), false, timeline("default", 4, false)),
        (
            "ckpt-stages".to_string(),
            false,
            timeline("ckpt-stages", 2, true),
        ),
        ("int8".to_string(), true, timeline("int8", 1, false)),
        ("accum4".to_string(), false, accumulated("accum4", 4)),
        ("empty".to_string(), false, StepTimeline::default()),
        (long.to_string(), false, accumulated("all", 4)),
    ];
    let files = write_step_timeline_overlay(&timelines, &dir.join("step_timeline")).unwrap();
    assert_eq!(
        files,
        vec![dir.join("step_timeline.png"), dir.join("step_timeline.svg")]
    );
    // Five panels: two rows of three.
    assert_eq!(png_size(&files[0]), (1900, 56 + 2 * 470));
    let texts = svg_texts(&files[1]);
    for p in step_panels(&timelines) {
        // The label in full, its peak and the event it is in.
        assert!(texts.contains(&p.label), "{} missing: {texts:?}", p.label);
        assert_contains(&texts, &format!("at {}", p.peak_at));
    }
    // A lossy configuration is marked so in its header, and the legend says what that means.
    assert!(texts.contains(&"int8 (lossy)".to_string()), "{texts:?}");
    assert_contains(&texts, "lossy (compressed saved activations):");
    // Each panel has a memory axis of its own, labelled so: a configuration a quarter of
    // another's size fills its panel as that one does.
    let axes = texts
        .iter()
        .filter(|t| *t == "memory (MiB), own scale")
        .count();
    assert_eq!(axes, 5, "{texts:?}");
    // Regions named with their micro-batch as far as room allows; the one-event optimizer,
    // too narrow for its name, is named beside it with an arrow to it.
    assert_contains(&texts, "bwd 2");
    assert!(
        texts
            .iter()
            .any(|t| t.ends_with(" →") && t.starts_with("opt")),
        "{texts:?}"
    );
    // The legend spells out the abbreviations the axes use, and only those (these steps'
    // recomputations are named `….recompute`, which is not abbreviated).
    assert_contains(&texts, "s = stage");
    assert!(!texts.iter().any(|t| t.starts_with("rc =")), "{texts:?}");
    // A timeline without events has nothing to draw and is left out.
    assert!(!texts.iter().any(|t| t == "empty"), "{texts:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn entry(label: &str, run_dir: &Path) -> CompareEntry {
    CompareEntry {
        label: label.into(),
        flags: Vec::new(),
        run: ChildRun {
            args: Vec::new(),
            run_dir: run_dir.to_path_buf(),
            status: Status::Ok,
            note: String::new(),
            exit_code: Some(0),
            signal: None,
            wall_secs: 1.0,
            summary: None,
            lossy: false,
        },
        peak_change_pct: None,
        speed_change_pct: None,
        oom_report: None,
    }
}

#[test]
fn comparison_overlays_the_runs_that_wrote_a_timeline() {
    let out = tmp_dir("compare");
    let runs = ["01-baseline", "02-old-run", "03-ckpt"].map(|r| out.join("runs").join(r));
    for r in &runs {
        std::fs::create_dir_all(r).unwrap();
    }
    for (r, t) in [
        (&runs[0], timeline("baseline", 4, false)),
        (&runs[2], timeline("ckpt", 2, true)),
    ] {
        std::fs::write(
            r.join(STEP_TIMELINE_FILE),
            serde_json::to_string(&t).unwrap(),
        )
        .unwrap();
    }
    let mut result = CompareResult {
        command: String::new(),
        common: Vec::new(),
        entries: vec![
            entry("baseline", &runs[0]),
            entry("old-run", &runs[1]),
            entry("ckpt-stages", &runs[2]),
        ],
        interrupted: false,
    };
    let files = write_step_timeline_overlays(&out, &result).unwrap();
    assert_eq!(
        files,
        vec![out.join("step_timeline.png"), out.join("step_timeline.svg")]
    );
    let texts = svg_texts(&files[1]);
    // Labelled as in the comparison, and the run without a timeline is not in the legend.
    assert_contains(&texts, "baseline");
    assert_contains(&texts, "ckpt-stages");
    assert!(!texts.iter().any(|t| t.contains("old-run")), "{texts:?}");

    // Without any timeline: nothing drawn. A damaged one: an error naming it.
    let none = CompareResult {
        entries: vec![entry("old-run", &runs[1])],
        ..result.clone()
    };
    assert!(write_step_timeline_overlays(&out.join("none"), &none)
        .unwrap()
        .is_empty());
    let damaged = runs[1].join(STEP_TIMELINE_FILE);
    std::fs::write(&damaged, "{").unwrap();
    result.entries.truncate(2);
    let msg = write_step_timeline_overlays(&out, &result)
        .unwrap_err()
        .to_string();
    assert!(msg.contains(&damaged.display().to_string()), "{msg}");
    let _ = std::fs::remove_dir_all(&out);
}
