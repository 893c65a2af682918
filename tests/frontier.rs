//! The memory–speed frontier (Pareto marking, tables, chart) and the out-of-memory report
//! links, in-process on hand-made results: no trainer runs here.

mod common;
use common::svg_texts;
use memtrain::sweep::batch::{BatchPlan, SweepPoint, SweepResult, Variant};
use memtrain::sweep::compare::{CompareEntry, CompareResult};
use memtrain::sweep::frontier::{pareto_front, write_frontier_chart, FrontierPoint};
use memtrain::sweep::report::{
    compare_csv, compare_markdown, sweep_csv, sweep_markdown, write_sweep_report, CsvTable,
};
use memtrain::sweep::{lossy_flags, oom_report_link, ChildRun, Status};
use memtrain::train::Summary;
use std::path::{Path, PathBuf};

const MIB: u64 = 1024 * 1024;

fn pt(label: &str, peak_mib: Option<u64>, ips: Option<f64>) -> FrontierPoint {
    FrontierPoint {
        label: label.into(),
        peak_bytes: peak_mib.map(|m| m * MIB),
        images_per_sec: ips,
        lossy: false,
    }
}

fn tmp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memtrain-frontier-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

#[test]
fn a_point_is_on_the_frontier_unless_another_is_at_least_as_good_in_both_and_better_in_one() {
    // A staircase with one point inside it: 30 MiB at 400 img/s is beaten by 20 MiB at 500.
    let pts = [
        pt("a", Some(10), Some(300.0)),
        pt("b", Some(20), Some(500.0)),
        pt("c", Some(30), Some(400.0)),
        pt("d", Some(40), Some(900.0)),
    ];
    assert_eq!(pareto_front(&pts), [true, true, false, true]);
    // Nothing, and one point.
    assert_eq!(pareto_front(&[]), Vec::<bool>::new());
    assert_eq!(pareto_front(&[pt("only", Some(5), Some(1.0))]), [true]);
    // Each uses more memory and runs faster than the one before: all on the frontier.
    let rising: Vec<FrontierPoint> = (1..=5)
        .map(|i| pt(&format!("p{i}"), Some(i * 10), Some(i as f64 * 100.0)))
        .collect();
    assert!(pareto_front(&rising).iter().all(|&on| on));
    // One point better in both than all others: alone on the frontier.
    let mut best = rising.clone();
    best.push(pt("best", Some(5), Some(1000.0)));
    assert_eq!(
        pareto_front(&best),
        [false, false, false, false, false, true]
    );
}

#[test]
fn ties_need_one_strict_improvement_and_duplicates_do_not_dominate_each_other() {
    // Same peak: the faster one dominates. Same speed: the smaller one dominates.
    let same_peak = [
        pt("slow", Some(10), Some(100.0)),
        pt("fast", Some(10), Some(200.0)),
    ];
    assert_eq!(pareto_front(&same_peak), [false, true]);
    let same_speed = [
        pt("big", Some(20), Some(100.0)),
        pt("small", Some(10), Some(100.0)),
    ];
    assert_eq!(pareto_front(&same_speed), [false, true]);
    // Two identical points: neither is strictly better, so both stay.
    let twins = [
        pt("x", Some(10), Some(100.0)),
        pt("y", Some(10), Some(100.0)),
    ];
    assert_eq!(pareto_front(&twins), [true, true]);
    // A duplicate pair that a third point beats: both go.
    let dominated_twins = [
        pt("x", Some(20), Some(100.0)),
        pt("y", Some(20), Some(100.0)),
        pt("z", Some(10), Some(100.0)),
    ];
    assert_eq!(pareto_front(&dominated_twins), [false, false, true]);
}

#[test]
fn points_without_a_finite_measurement_are_left_out_and_dominate_nothing() {
    let pts = [
        pt("oom", None, None),
        pt("no speed", Some(1), None),
        pt("no peak", None, Some(10_000.0)),
        pt("nan", Some(1), Some(f64::NAN)),
        pt("inf", Some(1), Some(f64::INFINITY)),
        pt("negative", Some(1), Some(-5.0)),
        pt("real", Some(50), Some(100.0)),
    ];
    // Were any of the first six counted, it would beat "real" (less memory or more speed).
    assert_eq!(
        pareto_front(&pts),
        [false, false, false, false, false, false, true]
    );
    assert!(pareto_front(&pts[..6]).iter().all(|&on| !on));
}

#[test]
fn the_frontier_chart_draws_every_measured_point_with_its_label() {
    let dir = tmp_dir("chart");
    let pts = [
        pt("f32 b<64>", Some(40), Some(600.0)),
        pt("f16 & ckpt", Some(20), Some(450.0)),
        pt("slow dominated", Some(50), Some(300.0)),
        pt("out of memory", None, None),
    ];
    let files = write_frontier_chart(
        &pts,
        "memory against speed",
        Some(64 * MIB),
        None,
        &dir.join("frontier"),
    )
    .expect("chart is drawn");
    assert_eq!(files, [dir.join("frontier.png"), dir.join("frontier.svg")]);

    let png = std::fs::File::open(&files[0]).expect("png exists");
    let mut reader = png::Decoder::new(std::io::BufReader::new(png))
        .read_info()
        .expect("png header decodes");
    assert_eq!((reader.info().width, reader.info().height), (1200, 800));
    let mut buf = vec![0; reader.output_buffer_size().expect("buffer size")];
    reader.next_frame(&mut buf).expect("png image data decodes");
    assert!(buf.iter().any(|&b| b != 255), "the PNG is not blank");

    let svg = std::fs::read_to_string(&files[1]).expect("svg exists");
    let doc = roxmltree::Document::parse(&svg).expect("svg is well-formed XML");
    let texts: Vec<String> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        // plotters writes each text on a line of its own inside the element.
        .filter_map(|n| n.text().map(|t| t.trim().to_string()))
        .collect();
    for want in [
        "f32 b<64>",
        "f16 & ckpt",
        "slow dominated",
        "memory against speed",
        "dominated",
        "memory limit (64.00 MiB)",
    ] {
        assert!(texts.iter().any(|t| t == want), "no '{want}' in {texts:?}");
    }
    // A point that measured nothing is not drawn.
    assert!(!texts.iter().any(|t| t == "out of memory"), "{texts:?}");
    // The step line joins the two frontier points: (20, 450) → (40, 450) → (40, 600). A path of
    // two frontier points has three vertices; the legend's sample lines have two.
    let step_paths = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline"))
        .filter(|n| {
            n.attribute("points")
                .is_some_and(|p| p.split_whitespace().count() == 3)
        })
        .count();
    assert_eq!(step_paths, 1, "one step line through the frontier");

    // Nothing measured: no chart, and no files.
    let none = write_frontier_chart(&pts[3..], "t", None, None, &dir.join("empty")).unwrap();
    assert!(none.is_empty());
    assert!(!dir.join("empty.png").exists() && !dir.join("empty.svg").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

fn run(dir: &Path, status: Status, peak_mib: u64, ips: f64) -> ChildRun {
    let mut summary = Summary::default();
    summary.memory.peak_bytes = peak_mib * MIB;
    summary.memory.step_peak_bytes = peak_mib * MIB;
    summary.memory.baseline_bytes = MIB;
    summary.progress.images_per_sec = ips;
    summary.status = memtrain::train::RunStatus::Ok;
    ChildRun {
        args: Vec::new(),
        run_dir: dir.to_path_buf(),
        status,
        note: if status == Status::Oom {
            "out of memory: forward of batch 0 (epoch 0) needed more than the 40.00 MiB limit"
                .into()
        } else {
            String::new()
        },
        exit_code: Some(if status == Status::Ok { 0 } else { 1 }),
        signal: None,
        wall_secs: 1.0,
        summary: (status == Status::Ok).then_some(summary),
        lossy: false,
    }
}

fn sweep(dir: &Path) -> SweepResult {
    let point = |c: &str, b: usize, st: Status, peak: u64, ips: f64| {
        let run_dir = dir.join("points").join(format!("{c}-b{b:05}"));
        let run = run(&run_dir, st, peak, ips);
        SweepPoint {
            configuration: c.into(),
            batch_size: b,
            oom_report: oom_report_link(&run, dir),
            run,
        }
    };
    SweepResult {
        command: "batch_sweep".into(),
        steps: 1,
        memory_limit_bytes: None,
        plan: BatchPlan::List(vec![32, 64, 128]),
        configurations: ["f32", "f16"]
            .iter()
            .map(|l| Variant {
                label: l.to_string(),
                flags: Vec::new(),
            })
            .collect(),
        // Run order: f32 64 before f32 32, so that the table (sorted by batch) and the CSV (run
        // order) differ in order and each has to find its own marks.
        points: vec![
            point("f32", 64, Status::Ok, 60, 700.0),
            point("f32", 32, Status::Ok, 40, 500.0),
            point("f32", 128, Status::Oom, 0, 0.0),
            point("f16", 32, Status::Ok, 30, 300.0),
            point("f16", 64, Status::Ok, 45, 400.0),
            point("f16", 128, Status::Ok, 80, 650.0),
        ],
        max_batches: Vec::new(),
        interrupted: false,
    }
}

/// `(configuration, batch) → frontier cell` of every row of a markdown table.
fn md_marks(md: &str, batch_col: bool) -> Vec<(String, String)> {
    let mut lines = md.lines();
    let header: Vec<String> = lines
        .next()
        .unwrap()
        .trim_matches('|')
        .split('|')
        .map(|c| c.trim().to_string())
        .collect();
    let f = header
        .iter()
        .position(|h| h == "frontier")
        .expect("a frontier column");
    lines
        .skip(1)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
            let key = if batch_col {
                format!("{} {}", cells[0], cells[1])
            } else {
                cells[0].to_string()
            };
            (key, cells[f].to_string())
        })
        .collect()
}

#[test]
fn sweep_tables_mark_the_frontier_points() {
    let dir = tmp_dir("sweep-tables");
    let r = sweep(&dir);
    // f16 b64 (45 MiB, 400/s) is beaten by f32 b32 (40 MiB, 500/s); f16 b128 by f32 b64.
    let md = sweep_markdown(&r);
    let marks = md_marks(&md, true);
    let want = [
        ("f32 32", "✓"),
        ("f32 64", "✓"),
        ("f32 128", ""),
        ("f16 32", "✓"),
        ("f16 64", ""),
        ("f16 128", ""),
    ];
    assert_eq!(
        marks,
        want.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<Vec<_>>(),
        "{md}"
    );
    assert!(md.contains("\n✓ frontier: no other exact point"), "{md}");
    assert!(!md.contains("lossy"), "no lossy point, no word of it: {md}");
    // No report was written, so there is no report column.
    assert!(!md.contains("OOM report"), "{md}");

    let csv = CsvTable::parse(&sweep_csv(&r)).unwrap();
    let csv_marks: Vec<(String, String)> = (0..csv.rows.len())
        .map(|i| {
            (
                format!(
                    "{} {}",
                    csv.get(i, "configuration").unwrap(),
                    csv.get(i, "batch_size").unwrap()
                ),
                csv.get(i, "frontier").unwrap().to_string(),
            )
        })
        .collect();
    let expect_csv = [
        ("f32 64", "true"),
        ("f32 32", "true"),
        ("f32 128", "false"),
        ("f16 32", "true"),
        ("f16 64", "false"),
        ("f16 128", "false"),
    ];
    assert_eq!(
        csv_marks,
        expect_csv
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<Vec<_>>()
    );
    assert!((0..csv.rows.len()).all(|i| csv.get(i, "oom_report") == Some("")));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_oom_point_links_its_report_only_when_the_file_exists() {
    let dir = tmp_dir("oom-report");
    let file = memtrain_core::memory::timeline::OOM_REPORT_FILE;
    // Plant a report in the OOM point's directory and, to show that only OOM points link one,
    // in an ok point's directory too.
    for p in ["f32-b00128", "f16-b00032"] {
        let d = dir.join("points").join(p);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(file), "{}").unwrap();
    }
    let r = sweep(&dir);
    let rel = PathBuf::from("points").join("f32-b00128").join(file);
    for p in &r.points {
        let want = (p.run.status == Status::Oom).then(|| rel.clone());
        assert_eq!(p.oom_report, want, "{} b{}", p.configuration, p.batch_size);
    }
    let md = sweep_markdown(&r);
    assert!(md.contains(" OOM report |"), "{md}");
    assert!(
        md.contains(&format!("| [report]({}) |", rel.display())),
        "{md}"
    );
    let csv = CsvTable::parse(&sweep_csv(&r)).unwrap();
    let oom_row = (0..csv.rows.len())
        .find(|&i| csv.get(i, "status") == Some("OOM"))
        .unwrap();
    assert_eq!(csv.get(oom_row, "oom_report"), Some(rel.to_str().unwrap()));
    // JSON keeps it, and reads back the same.
    let json = serde_json::to_string(&r).unwrap();
    assert!(json.contains("\"oom_report\""));
    assert_eq!(serde_json::from_str::<SweepResult>(&json).unwrap(), r);
    // A run directory outside the results directory gets an absolute path.
    let oom = r
        .points
        .iter()
        .find(|p| p.run.status == Status::Oom)
        .unwrap();
    let elsewhere = oom_report_link(&oom.run, Path::new("/somewhere/else")).unwrap();
    assert!(
        elsewhere.is_absolute() && elsewhere.ends_with(&rel),
        "{}",
        elsewhere.display()
    );
    // Without the file, no link.
    std::fs::remove_file(dir.join(&rel)).unwrap();
    assert_eq!(oom_report_link(&oom.run, &dir), None);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn compare_tables_mark_the_frontier_configurations() {
    let dir = tmp_dir("compare-tables");
    let entry = |label: &str, st: Status, peak: u64, ips: f64| {
        let run = run(&dir.join("runs").join(label), st, peak, ips);
        CompareEntry {
            label: label.into(),
            flags: Vec::new(),
            oom_report: oom_report_link(&run, &dir),
            run,
            peak_change_pct: None,
            speed_change_pct: None,
        }
    };
    let mut r = CompareResult {
        command: "compare".into(),
        common: Vec::new(),
        entries: vec![
            entry("baseline", Status::Ok, 90, 600.0),
            entry("f16", Status::Ok, 60, 400.0),
            entry("ckpt", Status::Ok, 80, 420.0),
            entry("all", Status::Ok, 35, 550.0),
            entry("huge", Status::Oom, 0, 0.0),
        ],
        interrupted: false,
    };
    r.update_changes();
    let md = compare_markdown(&r);
    let marks: Vec<(String, String)> = md_marks(&md, false);
    let want = [
        ("baseline", "✓"),
        ("f16", ""),
        ("ckpt", ""),
        ("all", "✓"),
        ("huge", ""),
    ];
    assert_eq!(
        marks,
        want.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<Vec<_>>(),
        "{md}"
    );
    let csv = CsvTable::parse(&compare_csv(&r)).unwrap();
    let col: Vec<&str> = (0..csv.rows.len())
        .map(|i| csv.get(i, "frontier").unwrap())
        .collect();
    assert_eq!(col, ["true", "false", "false", "true", "false"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The lossy configuration of the README's comparison: it uses less memory and runs faster than
/// the exact points here, so on one frontier with them it would hide them.
fn lossy_pt(label: &str, peak_mib: u64, ips: f64) -> FrontierPoint {
    FrontierPoint {
        lossy: true,
        ..pt(label, Some(peak_mib), Some(ips))
    }
}

#[test]
fn the_frontier_is_one_of_exact_points_and_a_lossy_point_dominates_none_of_them() {
    let pts = [
        pt("f32", Some(86), Some(1000.0)),
        pt("bf16", Some(55), Some(1044.0)),
        pt("accum4", Some(41), Some(978.0)),
        pt("ckpt", Some(76), Some(839.0)),
        lossy_pt("bf16-int8", 40, 1100.0),
    ];
    assert_eq!(pareto_front(&pts), [false, true, true, false, false]);
    // Made exact, the same point would be the whole frontier.
    let mut exact = pts.clone();
    exact[4].lossy = false;
    assert_eq!(pareto_front(&exact), [false, false, false, false, true]);
}

#[test]
fn the_frontier_chart_draws_a_lossy_point_apart_with_its_own_marker_and_legend() {
    let dir = tmp_dir("chart-lossy");
    let pts = [
        pt("f32", Some(86), Some(1000.0)),
        pt("bf16", Some(55), Some(1044.0)),
        lossy_pt("int8", 60, 978.0),
        lossy_pt("bf16+int8 (lossy)", 45, 1000.0),
    ];
    let files = write_frontier_chart(&pts, "t", None, None, &dir.join("frontier")).unwrap();
    let svg = std::fs::read_to_string(&files[1]).unwrap();
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let texts: Vec<String> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text().map(|t| t.trim().to_string()))
        .collect();
    // Labelled lossy once, whether or not the label said so already; the frontier, as the
    // tables say, is one of the exact points (a lossy point left of it beats none of them).
    for want in [
        "int8 (lossy)",
        "bf16+int8 (lossy)",
        "lossy (compressed saved activations): not the exact step",
        "Pareto frontier (no other exact point uses less memory and runs faster)",
    ] {
        assert!(texts.iter().any(|t| t == want), "no '{want}' in {texts:?}");
    }
    // A diamond per lossy point, and one in the legend: four-cornered polygons.
    let diamonds = doc
        .descendants()
        .filter(|n| n.has_tag_name("polygon"))
        .filter(|n| {
            n.attribute("points")
                .is_some_and(|p| p.split_whitespace().count() == 4)
        })
        .count();
    assert_eq!(diamonds, 3, "{svg}");
    // The step line joins only the exact points: bf16 (55) across to f32's memory (86) is no
    // frontier, f32 is dominated by bf16; one frontier point draws a one-vertex line.
    let step_paths = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline"))
        .filter(|n| {
            n.attribute("points")
                .is_some_and(|p| p.split_whitespace().count() == 3)
        })
        .count();
    assert_eq!(step_paths, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn compare_tables_say_which_configuration_is_lossy_and_leave_it_off_the_frontier() {
    let dir = tmp_dir("compare-lossy");
    let entry = |label: &str, st: Status, peak: u64, ips: f64, lossy: bool| {
        let run = ChildRun {
            lossy,
            ..run(&dir.join("runs").join(label), st, peak, ips)
        };
        CompareEntry {
            label: label.into(),
            flags: Vec::new(),
            oom_report: None,
            run,
            peak_change_pct: None,
            speed_change_pct: None,
        }
    };
    let mut r = CompareResult {
        command: "compare".into(),
        common: Vec::new(),
        entries: vec![
            entry("baseline", Status::Ok, 86, 1000.0, false),
            entry("bf16", Status::Ok, 55, 1044.0, false),
            entry("bf16-int8", Status::Ok, 45, 1100.0, true),
            entry("int8-huge", Status::Oom, 0, 0.0, true),
        ],
        interrupted: false,
    };
    r.update_changes();
    let csv = CsvTable::parse(&compare_csv(&r)).unwrap();
    let col = |name: &str| -> Vec<String> {
        (0..csv.rows.len())
            .map(|i| csv.get(i, name).unwrap().to_string())
            .collect()
    };
    assert_eq!(col("lossy"), ["false", "false", "true", "true"]);
    assert_eq!(col("frontier"), ["false", "true", "false", "false"]);
    let md = compare_markdown(&r);
    assert!(
        md.contains(
            "(one of them strictly); lossy points (compressed saved activations) are left out"
        ),
        "{md}"
    );
    let notes: Vec<&str> = md
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| l.trim_end_matches('|').rsplit('|').next().unwrap().trim())
        .collect();
    assert_eq!(
        notes,
        [
            "",
            "",
            "lossy: compressed saved activations, not on the frontier",
            "lossy: compressed saved activations, not on the frontier; out of memory: forward of batch 0 \
             (epoch 0) needed more than the 40.00 MiB limit",
        ],
        "{md}"
    );
    // JSON carries it with each run, and results written before it read as exact.
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["entries"][2]["run"]["lossy"], true);
    let mut old = json.clone();
    for e in old["entries"].as_array_mut().unwrap() {
        e["run"].as_object_mut().unwrap().remove("lossy");
    }
    let old: CompareResult = serde_json::from_value(old).unwrap();
    assert!(old.entries.iter().all(|e| !e.run.lossy));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sweep_tables_carry_the_lossy_column() {
    let dir = tmp_dir("sweep-lossy");
    let mut r = sweep(&dir);
    for p in r.points.iter_mut().filter(|p| p.configuration == "f16") {
        p.run.lossy = true;
    }
    let csv = CsvTable::parse(&sweep_csv(&r)).unwrap();
    for i in 0..csv.rows.len() {
        let lossy = csv.get(i, "configuration") == Some("f16");
        assert_eq!(csv.get(i, "lossy"), Some(lossy.to_string().as_str()));
        if lossy {
            assert_eq!(csv.get(i, "frontier"), Some("false"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lossy_is_read_from_the_flags_a_config_file_included() {
    let words = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
    assert!(lossy_flags(&words(
        "--compress-activations int8 --precision bf16"
    )));
    assert!(!lossy_flags(&words("--compress-activations none")));
    assert!(!lossy_flags(&words("--precision f16 --checkpoint blocks")));
    // Flags the trainer refuses are no configuration at all.
    assert!(!lossy_flags(&words("--compress-activations int3")));
    let dir = tmp_dir("lossy-config");
    let mut cfg = memtrain::config::TrainConfig::default();
    cfg.memory.compress_activations = memtrain::config::ActivationStorage::Int8.into();
    let file = dir.join("config.json");
    std::fs::write(&file, serde_json::to_string(&cfg).unwrap()).unwrap();
    let with_file = vec!["--config".to_string(), file.display().to_string()];
    assert!(lossy_flags(&with_file));
    let mut overridden = with_file.clone();
    overridden.extend(words("--compress-activations none"));
    assert!(!lossy_flags(&overridden));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_cpu_sweep_chart_names_the_limit_resident_and_draws_the_heap_budget_the_peaks_are_held_to() {
    let dir = tmp_dir("sweep-limit");
    let mut r = sweep(&dir);
    r.memory_limit_bytes = Some(100 * MIB);
    for (k, p) in r.points.iter_mut().enumerate() {
        if let Some(s) = p.run.summary.as_mut() {
            // Each trainer reads its reserve at start: the budgets differ a little.
            s.memory.heap_budget_bytes = Some(78 * MIB + k as u64 * 4096);
        }
    }
    write_sweep_report(&dir, &r).unwrap();
    let budget = "heap budget under the limit (78.00 MiB): what the heap peaks are held to";
    for chart in ["sweep.svg", "frontier.svg"] {
        let texts = svg_texts(&dir.join(chart));
        for want in ["memory limit, resident memory (100.00 MiB)", budget] {
            assert!(
                texts.iter().any(|t| t == want),
                "{chart}: no '{want}' in {texts:?}"
            );
        }
    }
    let texts = svg_texts(&dir.join("sweep.svg"));
    assert!(
        texts.iter().any(|t| t == "training peak, heap (MiB)"),
        "{texts:?}"
    );
    assert!(
        texts
            .iter()
            .any(|t| t == "out of memory (drawn on the heap budget)"),
        "{texts:?}"
    );

    // Without a heap budget (CUDA: the limit is the pool's, as the peaks), the limit alone.
    for p in r.points.iter_mut() {
        if let Some(s) = p.run.summary.as_mut() {
            s.memory.heap_budget_bytes = None;
        }
    }
    write_sweep_report(&dir, &r).unwrap();
    let texts = svg_texts(&dir.join("sweep.svg"));
    assert!(
        texts.iter().any(|t| t == "memory limit (100.00 MiB)"),
        "{texts:?}"
    );
    assert!(!texts.iter().any(|t| t.contains("heap")), "{texts:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
