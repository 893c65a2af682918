//! Batch-size sweeps, comparisons and charts: the example binaries run as a user would run them
//! (each point a child process of `train_cifar10`), on the CPU with tiny widths and few steps.

mod common;
use common::svg_texts;
use memtrain::callbacks::log::read_batch_log;
use memtrain::cli::flags_config;
use memtrain::sweep::batch::{cross_product, recommended_batch, BatchPlan, Dimension, SweepResult};
use memtrain::sweep::compare::{CompareResult, RunSpec};
use memtrain::sweep::report::{CsvTable, COMPARE_CSV_HEADER, SWEEP_CSV_HEADER};
use memtrain::sweep::{merge_flags, oom_message, split_flags, Status};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// `target/<profile>/examples/<name>`, next to this test binary's `deps/` directory. `cargo test`
/// builds the examples; when they are missing or older than this test binary (e.g. after
/// `cargo test --test sweep`, which builds only this file), they are built here once.
fn example(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    let exe = std::env::current_exe().expect("current exe");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let bin = |n: &str| {
        profile_dir
            .join("examples")
            .join(format!("{n}{}", std::env::consts::EXE_SUFFIX))
    };
    BUILT.get_or_init(|| {
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        let stale = ["train_cifar10", "batch_sweep", "compare"].iter().any(|n| {
            match (modified(&bin(n)), modified(&exe)) {
                (Some(b), Some(t)) => b < t,
                _ => true,
            }
        });
        if !stale {
            return;
        }
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "--quiet", "--examples"])
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        // Build into the target directory this test binary lives in.
        if let Some(target) = profile_dir.parent() {
            cmd.env("CARGO_TARGET_DIR", target);
        }
        let status = cmd.status().expect("run cargo build --examples");
        assert!(status.success(), "cargo build --examples failed");
    });
    let path = bin(name);
    assert!(
        path.is_file(),
        "{} missing; run `cargo build --release --examples`",
        path.display()
    );
    path
}

fn tmp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memtrain-sweep-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("spawn");
    if !out.status.success() {
        eprintln!(
            "stdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

fn read_sweep(dir: &Path) -> SweepResult {
    let text = std::fs::read_to_string(dir.join("sweep.json")).expect("sweep.json");
    serde_json::from_str(&text).expect("sweep.json parses as SweepResult")
}

fn png_size(path: &Path) -> (u32, u32) {
    let file = std::io::BufReader::new(std::fs::File::open(path).expect("png exists"));
    let decoder = png::Decoder::new(file);
    let mut reader = decoder.read_info().expect("png header decodes");
    let (w, h) = (reader.info().width, reader.info().height);
    let mut buf = vec![0; reader.output_buffer_size().expect("buffer size")];
    reader.next_frame(&mut buf).expect("png image data decodes");
    (w, h)
}

fn check_svg(path: &Path, width: u32, height: u32) {
    let text = std::fs::read_to_string(path).expect("svg exists");
    let doc = roxmltree::Document::parse(&text).expect("svg is well-formed XML");
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert_eq!(root.attribute("width"), Some(width.to_string().as_str()));
    assert_eq!(root.attribute("height"), Some(height.to_string().as_str()));
    assert!(
        doc.descendants().any(|n| n.has_tag_name("text")),
        "{} has no text",
        path.display()
    );
}

/// `frontier.png` (1200×800) and `frontier.svg` in `dir`, the SVG labelling every one of `labels`.
fn check_frontier_chart(dir: &Path, labels: &[&str]) {
    assert_eq!(png_size(&dir.join("frontier.png")), (1200, 800));
    check_svg(&dir.join("frontier.svg"), 1200, 800);
    let texts = svg_texts(&dir.join("frontier.svg"));
    for l in labels {
        assert!(texts.iter().any(|t| t == l), "no label '{l}' in {texts:?}");
    }
}

#[test]
fn find_max_returns_the_largest_batch_within_a_cpu_budget() {
    let out = tmp_dir("findmax");
    let limit = "40MiB";
    let g = 16;
    let o = run(Command::new(example("batch_sweep"))
        .args([
            "--find-max",
            "--start",
            "32",
            "--max-batch",
            "2048",
            "--granularity",
            &g.to_string(),
        ])
        .args([
            "--steps",
            "1",
            "--width",
            "4",
            "--device",
            "cpu",
            "--synthetic-train",
            "10",
            "--quiet",
        ])
        .args(["--memory-limit", limit, "--out"])
        .arg(&out)
        .args(["--", "--synthetic-test", "10"]));
    assert!(o.status.success());
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("largest batch that fits within 40.00 MiB"),
        "{stdout}"
    );

    let r = read_sweep(&out);
    assert_eq!(r.max_batches.len(), 1);
    let mb = &r.max_batches[0];
    let max = mb.max_batch.expect("some batch fits 40 MiB at width 4");
    let oom = mb
        .first_oom
        .expect("some batch below 2048 exceeds 40 MiB at width 4");
    assert!(!mb.capped);
    assert_eq!(oom, max + g, "the search narrows down to the granularity");
    // The default margin: 5% below the largest batch, a multiple of the granularity.
    let rec = mb.recommended.expect("a recommended batch");
    assert_eq!(mb.margin, 0.05);
    assert_eq!(rec, recommended_batch(max, 0.05, g, 1));
    assert!(rec.is_multiple_of(g) && rec < max && rec as f64 >= max as f64 * 0.95 - g as f64);
    assert!(
        stdout.contains(&format!("recommended batch {rec} (5% margin)")),
        "{stdout}"
    );
    let md = std::fs::read_to_string(out.join("sweep.md")).unwrap();
    assert!(
        md.contains(&format!("recommended batch {rec} (5% margin)")),
        "{md}"
    );
    // Doubling 32, 64, … then bisection: the points on record agree with the result.
    for p in &r.points {
        let expect = if p.batch_size <= max {
            Status::Ok
        } else {
            Status::Oom
        };
        assert_eq!(
            p.run.status, expect,
            "batch {}: {}",
            p.batch_size, p.run.note
        );
        if p.run.status == Status::Ok {
            // The limit is the resident memory, which holds the heap and more.
            let s = p.run.summary.as_ref().unwrap();
            assert!(p.run.peak_bytes().unwrap() < s.memory.os_peak_bytes.unwrap());
            assert!(s.memory.os_peak_bytes.unwrap() <= 40 << 20);
        }
    }
    assert!(r
        .points
        .iter()
        .any(|p| p.batch_size == max && p.run.status == Status::Ok));

    // A batch past the boundary is refused by the trainer itself, before any work: its step is
    // predicted not to fit (exit 2, an out-of-memory message that sweeps record as OOM).
    let oom = oom + oom / 4;
    let direct = out.join("direct");
    let o = Command::new(example("train_cifar10"))
        .args([
            "--width",
            "4",
            "--device",
            "cpu",
            "--batch-size",
            &oom.to_string(),
            "--max-steps",
            "1",
        ])
        .args([
            "--synthetic-train",
            &oom.to_string(),
            "--synthetic-test",
            "10",
        ])
        .args(["--no-eval", "--quiet", "--memory-limit", limit, "--out"])
        .arg(&direct)
        .env(memtrain::cli::SUMMARY_ONLY_ENV, "1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    // The switch changes what a run writes: its first line says so.
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).lines().next(),
        Some(memtrain::cli::SUMMARY_ONLY_NOTE)
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.starts_with("error: out of memory") || stderr.contains("\nerror: out of memory"),
        "{stderr}"
    );
    assert!(oom_message(&stderr).is_some());
    let _ = std::fs::remove_dir_all(&out);
}

/// `--checkpoint auto`, alone or with `--compress-activations auto`: a batch no plan fits is an
/// out-of-memory point, so `--find-max` reports a largest batch and `compare` records the point
/// instead of refusing every configuration (issue 52).
#[test]
fn auto_plans_that_fit_nothing_are_out_of_memory_points() {
    let out = tmp_dir("auto-oom");
    for (name, auto) in [
        ("ckpt", "--checkpoint auto"),
        ("both", "--checkpoint auto --compress-activations auto"),
    ] {
        let dir = out.join(name);
        let o = run(Command::new(example("batch_sweep"))
            .args(["--find-max", "--start", "64", "--max-batch", "4096"])
            .args(["--granularity", "64", "--steps", "1", "--width", "4"])
            .args(["--device", "cpu", "--synthetic-train", "10", "--quiet"])
            .args(["--memory-limit", "40MiB", "--out"])
            .arg(&dir)
            .args(["--", "--synthetic-test", "10"])
            .args(auto.split_whitespace()));
        assert!(o.status.success(), "{auto}");
        let mb = &read_sweep(&dir).max_batches[0];
        assert!(mb.max_batch.is_some(), "{auto}: {mb:?}");
        assert!(mb.first_oom.is_some(), "{auto}: {mb:?}");
    }
    let o = run(Command::new(example("compare"))
        .args(["--run", "fits:", "--run", "none-fits: --batch-size 4096"])
        .args([
            "--common",
            "--checkpoint auto --width 4 --device cpu --max-steps 1 --batch-size 32 \
             --synthetic-train 4096 --memory-limit 40MiB",
        ])
        .args(["--quiet", "--out"])
        .arg(out.join("compare"))
        .args(["--", "--no-eval"]));
    assert!(o.status.success());
    let r: CompareResult = serde_json::from_str(
        &std::fs::read_to_string(out.join("compare").join("compare.json")).unwrap(),
    )
    .unwrap();
    let status: Vec<Status> = r.entries.iter().map(|e| e.run.status).collect();
    assert_eq!(status, [Status::Ok, Status::Oom]);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn find_max_tries_only_batches_divisible_by_the_accumulation_steps() {
    let out = tmp_dir("findmax-accum");
    let o = run(Command::new(example("batch_sweep"))
        .args([
            "--find-max",
            "--start",
            "32",
            "--max-batch",
            "4096",
            "--granularity",
            "8",
            "--accum-steps",
            "3",
            "--margin",
            "0.25",
        ])
        .args([
            "--steps",
            "1",
            "--width",
            "4",
            "--device",
            "cpu",
            "--synthetic-train",
            "10",
            "--quiet",
        ])
        .args(["--memory-limit", "24MiB", "--out"])
        .arg(&out)
        .args(["--", "--synthetic-test", "10"]));
    assert!(o.status.success());
    let r = read_sweep(&out);
    let mb = &r.max_batches[0];
    let (max, oom) = (mb.max_batch.unwrap(), mb.first_oom.unwrap());
    // Granularity 8 with 3 accumulation steps: multiples of 24.
    assert!(oom > max && oom - max <= 24, "{max} {oom}");
    let rec = mb.recommended.unwrap();
    assert_eq!(rec, recommended_batch(max, 0.25, 8, 3));
    assert_eq!(
        rec % 3,
        0,
        "the recommended batch {rec} splits into 3 micro-batches"
    );
    assert!(rec as f64 <= max as f64 * 0.75, "{rec} leaves 25% of {max}");
    for p in &r.points {
        assert_eq!(
            p.batch_size % 3,
            0,
            "batch {} is not divisible by --accum-steps 3",
            p.batch_size
        );
        assert_ne!(p.run.status, Status::Failed, "{}", p.run.note);
        assert_eq!(p.run.status == Status::Ok, p.batch_size <= max);
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// A trainer wrapper that kills itself with SIGKILL for batch size 48 and runs the real trainer
/// otherwise.
#[cfg(unix)]
fn killing_wrapper(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("trainer.sh");
    let script = format!(
        "#!/bin/sh\nprev=\nfor a in \"$@\"; do\n  if [ \"$prev\" = \"--batch-size\" ] && [ \"$a\" = \"48\" ]; then kill -9 $$; fi\n  prev=\"$a\"\ndone\nexec '{}' \"$@\"\n",
        example("train_cifar10").display()
    );
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[cfg(unix)]
#[test]
fn oom_and_killed_points_are_recorded_and_the_sweep_goes_on() {
    let out = tmp_dir("statuses");
    let wrapper = killing_wrapper(&out.join("bin"));
    let o = run(Command::new(example("batch_sweep"))
        .args([
            "--batch-sizes",
            "32,48,1024,64",
            "--precision",
            "f32,f16",
            "--steps",
            "2",
        ])
        .args([
            "--width",
            "4",
            "--device",
            "cpu",
            "--synthetic-train",
            "10",
            "--memory-limit",
            "40MiB",
            "--quiet",
        ])
        .arg("--trainer")
        .arg(&wrapper)
        .arg("--out")
        .arg(out.join("sweep"))
        .args(["--", "--synthetic-test", "10"]));
    assert!(
        o.status.success(),
        "OOM and failed points do not fail the sweep"
    );
    let dir = out.join("sweep");
    let r = read_sweep(&dir);
    assert_eq!(r.points.len(), 8, "every point ran");
    for p in &r.points {
        match p.batch_size {
            32 | 64 => assert_eq!(p.run.status, Status::Ok, "{}", p.run.note),
            48 => {
                assert_eq!(p.run.status, Status::Failed);
                assert_eq!(p.run.signal, Some(9));
                assert!(p.run.note.contains("SIGKILL"), "{}", p.run.note);
            }
            1024 => {
                // Refused before any work: predicted not to fit.
                assert_eq!(p.run.status, Status::Oom);
                assert_eq!(p.run.exit_code, Some(2));
                assert!(p.run.note.starts_with("out of memory"), "{}", p.run.note);
            }
            b => panic!("unexpected batch {b}"),
        }
    }
    // A point after an OOM one still ran and measured.
    let ok64 = r.points.iter().find(|p| p.batch_size == 64).unwrap();
    assert!(ok64.run.peak_bytes().unwrap() > ok64.run.baseline_bytes().unwrap());
    assert_eq!(
        r.configurations
            .iter()
            .map(|v| v.label.as_str())
            .collect::<Vec<_>>(),
        ["f32", "f16"]
    );

    // Table on stdout, with explicit column names.
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains(
            "| configuration | batch size | status | training peak MiB (total) | baseline MiB (at start) |"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("| OOM |") && stdout.contains("| failed |"),
        "{stdout}"
    );

    // JSON round-trips.
    let again: SweepResult = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
    assert_eq!(again, r);
    // CSV agrees with the JSON, row for row.
    let csv = CsvTable::parse(&std::fs::read_to_string(dir.join("sweep.csv")).unwrap()).unwrap();
    assert_eq!(csv.header.join(","), SWEEP_CSV_HEADER);
    assert_eq!(csv.rows.len(), r.points.len());
    for (i, p) in r.points.iter().enumerate() {
        assert_eq!(csv.get(i, "configuration"), Some(p.configuration.as_str()));
        assert_eq!(
            csv.get(i, "batch_size").unwrap().parse::<usize>().unwrap(),
            p.batch_size
        );
        assert_eq!(
            Status::parse(csv.get(i, "status").unwrap()),
            Some(p.run.status)
        );
        assert_eq!(
            csv.get(i, "peak_bytes").unwrap().parse::<u64>().ok(),
            p.run.peak_bytes()
        );
        assert_eq!(
            csv.get(i, "baseline_bytes").unwrap().parse::<u64>().ok(),
            p.run.baseline_bytes()
        );
        assert_eq!(csv.get(i, "note"), Some(p.run.note.as_str()));
    }
    // Charts: a PNG of the expected size and a well-formed SVG.
    assert_eq!(png_size(&dir.join("sweep.png")), (1200, 1000));
    check_svg(&dir.join("sweep.svg"), 1200, 1000);
    // The frontier chart labels every point that ran, and only those.
    check_frontier_chart(&dir, &["f32 b32", "f32 b64", "f16 b32", "f16 b64"]);
    let texts = svg_texts(&dir.join("frontier.svg"));
    assert!(
        !texts
            .iter()
            .any(|t| t.ends_with("b1024") || t.ends_with("b48")),
        "{texts:?}"
    );
    // The table marks at least one point as on the frontier, and explains the mark.
    assert!(
        stdout.contains(" frontier |") && stdout.contains("| ✓ |"),
        "{stdout}"
    );
    assert!(stdout.contains("✓ frontier:"), "{stdout}");

    // The same directory is not reused for a second sweep.
    let o = Command::new(example("batch_sweep"))
        .args(["--batch-sizes", "32", "--quiet", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("already holds results"));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn compare_runs_each_configuration_and_draws_its_charts() {
    let out = tmp_dir("compare");
    let o = run(Command::new(example("compare"))
        .args([
            "--run",
            "",
            "--run",
            "f16<&>: --precision f16",
            "--run",
            "--checkpoint stages",
        ])
        .args([
            "--common",
            "--width 4 --device cpu --max-steps 3 --batch-size 32 --synthetic-train 96",
        ])
        .args(["--quiet", "--out"])
        .arg(&out)
        .args(["--", "--synthetic-test", "32"]));
    assert!(o.status.success());
    let stdout = String::from_utf8_lossy(&o.stdout);
    // Both changes are named by the configuration they are against.
    assert!(
        stdout.contains("| configuration | status | training peak MiB (total) | peak vs default |"),
        "{stdout}"
    );
    assert!(stdout.contains("| img/s vs default |"), "{stdout}");
    assert!(
        stdout.contains("accuracy"),
        "eval is on, so accuracy is reported: {stdout}"
    );

    let r: CompareResult =
        serde_json::from_str(&std::fs::read_to_string(out.join("compare.json")).unwrap()).unwrap();
    let labels: Vec<&str> = r.entries.iter().map(|e| e.label.as_str()).collect();
    assert_eq!(labels, ["default", "f16<&>", "--checkpoint stages"]);
    for e in &r.entries {
        assert_eq!(e.run.status, Status::Ok, "{}: {}", e.label, e.run.note);
        let s = e.run.summary.as_ref().unwrap();
        assert_eq!(s.progress.steps, 3);
        assert!(s.quality.final_test_accuracy.is_some());
        // Each run directory has its own memory log and memory chart (train_cifar10 draws it).
        assert_eq!(read_batch_log(&e.run.run_dir).unwrap().len(), 3);
        assert_eq!(png_size(&e.run.run_dir.join("memory.png")), (1200, 700));
        check_svg(&e.run.run_dir.join("memory.svg"), 1200, 700);
    }
    assert_eq!(r.entries[0].peak_change_pct, Some(0.0));
    let f16 = &r.entries[1];
    let expect = (f16.run.peak_bytes().unwrap() as f64
        / r.entries[0].run.peak_bytes().unwrap() as f64
        - 1.0)
        * 100.0;
    assert!((f16.peak_change_pct.unwrap() - expect).abs() < 1e-9);

    let csv = CsvTable::parse(&std::fs::read_to_string(out.join("compare.csv")).unwrap()).unwrap();
    assert_eq!(csv.header.join(","), COMPARE_CSV_HEADER);
    for (i, e) in r.entries.iter().enumerate() {
        assert_eq!(csv.get(i, "configuration"), Some(e.label.as_str()));
        assert_eq!(
            csv.get(i, "peak_bytes").unwrap().parse::<u64>().ok(),
            e.run.peak_bytes()
        );
        assert_eq!(csv.get(i, "flags"), Some(e.flags.join(" ").as_str()));
    }
    let again: CompareResult = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
    assert_eq!(again, r);

    let bar_height = 170 + 64 * 3; // 170 px + 64 px per bar, at least 360
    assert_eq!(png_size(&out.join("peak_memory.png")), (1200, bar_height));
    check_svg(&out.join("peak_memory.svg"), 1200, bar_height);
    assert_eq!(png_size(&out.join("step_peaks.png")), (1200, 700));
    check_svg(&out.join("step_peaks.svg"), 1200, 700);
    check_frontier_chart(&out, &["default", "f16<&>", "--checkpoint stages"]);
    // The closing line names every chart written, the step timelines' included.
    let closing = stdout.lines().last().unwrap();
    for chart in ["peak_memory", "step_peaks", "frontier", "step_timeline"] {
        for ext in ["png", "svg"] {
            let file = format!("{chart}.{ext}");
            assert!(out.join(&file).is_file(), "{file} not written");
            assert!(closing.contains(&file), "{file} not in {closing}");
        }
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn compare_takes_config_files_and_explicit_flags_override_them() {
    let out = tmp_dir("configs");
    std::fs::create_dir_all(&out).unwrap();
    let a = out.join("00-small.json");
    let b = out.join("01-accum.json");
    std::fs::write(&a, r#"{"width": 4, "batch_size": 32, "max_steps": 50}"#).unwrap();
    std::fs::write(
        &b,
        r#"{"width": 4, "batch_size": 32, "accum_steps": 2, "max_steps": 50}"#,
    )
    .unwrap();
    let o = run(Command::new(example("compare"))
        .arg("--configs")
        .args([&a, &b])
        .args(["--quiet", "--out"])
        .arg(out.join("cmp"))
        .args([
            "--",
            "--max-steps",
            "2",
            "--no-eval",
            "--device",
            "cpu",
            "--synthetic-train",
            "64",
            "--synthetic-test",
            "10",
        ]));
    assert!(o.status.success());
    let r: CompareResult =
        serde_json::from_str(&std::fs::read_to_string(out.join("cmp/compare.json")).unwrap())
            .unwrap();
    assert_eq!(
        r.entries
            .iter()
            .map(|e| e.label.as_str())
            .collect::<Vec<_>>(),
        ["small", "accum"]
    );
    for e in &r.entries {
        assert_eq!(e.run.status, Status::Ok, "{}", e.run.note);
        // --max-steps 2 given explicitly overrides the file's 50.
        assert_eq!(e.run.summary.as_ref().unwrap().progress.steps, 2);
        assert!(e
            .run
            .summary
            .as_ref()
            .unwrap()
            .quality
            .final_test_accuracy
            .is_none());
    }
    assert!(r.entries[1]
        .run
        .summary
        .as_ref()
        .unwrap()
        .label
        .contains("accum2"));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn usage_errors_exit_with_code_2() {
    let o = Command::new(example("batch_sweep"))
        .args(["--find-max", "--batch-sizes", "32"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let o = Command::new(example("batch_sweep"))
        .args(["--precision", "f8"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let o = Command::new(example("compare")).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("nothing to compare"));
    let o = Command::new(example("compare"))
        .args(["--run", "--width 'unbalanced"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let o = Command::new(example("compare"))
        .args(["--run", "", "--trainer", "/nonexistent/trainer"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let o = Command::new(example("batch_sweep"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains("--find-max"));
    // The sweep's marker left in a shell: batch_sweep stays itself, and says why it ignores it.
    let o = Command::new(example("batch_sweep"))
        .arg("--help")
        .env("MEMTRAIN_AS_TRAINER", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stdout).contains("--find-max"));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.starts_with("note: MEMTRAIN_AS_TRAINER=1 is set in this environment, but no sweep started this process"),
        "{stderr}"
    );
}

#[test]
fn the_recommended_batch_leaves_the_margin_and_rounds_down_to_the_search_step() {
    // 200 × 0.95 = 190, down to a multiple of 8.
    assert_eq!(recommended_batch(200, 0.05, 8, 1), 184);
    // Granularity 8 with 4 accumulation steps: multiples of 8, which 4 divides.
    let b = recommended_batch(200, 0.05, 8, 4);
    assert_eq!(b, 184);
    assert_eq!(b % 4, 0);
    // Granularity 8 with 3 accumulation steps: multiples of 24.
    assert_eq!(recommended_batch(200, 0.05, 8, 3), 168);
    // No margin and a multiple of the step: the largest batch itself.
    assert_eq!(recommended_batch(384, 0.0, 8, 1), 384);
    // 100 × 0.9 is 90 exactly, not 89.99….
    assert_eq!(recommended_batch(100, 0.1, 1, 1), 90);
    assert_eq!(recommended_batch(1000, 0.3, 10, 1), 700);
    // Below one step: a multiple of the accumulation steps instead, and at least one of them.
    assert_eq!(recommended_batch(8, 0.05, 8, 1), 7);
    assert_eq!(recommended_batch(8, 0.05, 8, 2), 6);
    assert_eq!(recommended_batch(1, 0.5, 8, 1), 1);
    assert_eq!(recommended_batch(4, 0.9, 8, 4), 4);
    // A larger margin never recommends more.
    for m in [0.0, 0.05, 0.1, 0.25, 0.5, 0.9] {
        let r = recommended_batch(1000, m, 16, 2);
        assert!(r <= 1000 && r.is_multiple_of(2), "margin {m}: {r}");
        assert!(r <= recommended_batch(1000, m / 2.0, 16, 2));
    }
}

#[test]
fn margin_and_max_batch_are_validated() {
    let out = tmp_dir("margin-usage");
    let usage = |args: &[&str], want: &str| {
        let o = Command::new(example("batch_sweep"))
            .args(args)
            .args(["--quiet", "--out"])
            .arg(&out)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(
            stderr.trim_end().lines().count(),
            1,
            "{args:?}: one line: {stderr}"
        );
        assert!(
            stderr.starts_with("error: ") && stderr.contains(want),
            "{args:?}: {stderr}"
        );
        assert!(!out.exists(), "{args:?}: nothing is written");
    };
    for m in ["1", "-0.1", "nan", "1.5"] {
        usage(&["--find-max", "--margin", m], "--margin");
    }
    usage(&["--find-max", "--margin", "lots"], "--margin");
    usage(&["--margin", "0.1"], "--find-max");
    usage(
        &["--find-max", "--start", "64", "--max-batch", "32"],
        "--max-batch 32 (the upper bound of the search) is smaller than --start 64",
    );
    let help = Command::new(example("batch_sweep"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("--margin") && help.contains("[default: 0.05]"),
        "{help}"
    );
    assert!(help.contains("upper bound of the search"), "{help}");
}

/// A trainer wrapper that runs the real trainer and then leaves an `oom_report.json` in its
/// `--out` directory, as a trainer that writes reports would (planted for every run, so that
/// the tables can be seen to link only the out-of-memory ones).
#[cfg(unix)]
fn report_wrapper(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("trainer.sh");
    let script = format!(
        "#!/bin/sh\nout=\nprev=\nfor a in \"$@\"; do\n  if [ \"$prev\" = \"--out\" ]; then out=\"$a\"; fi\n  prev=\"$a\"\ndone\n'{}' \"$@\"\ncode=$?\n[ -n \"$out\" ] && printf '{{}}' > \"$out/{}\"\nexit $code\n",
        example("train_cifar10").display(),
        memtrain_core::memory::timeline::OOM_REPORT_FILE
    );
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[cfg(unix)]
#[test]
fn oom_points_link_the_report_their_run_wrote() {
    let out = tmp_dir("oom-reports");
    let wrapper = report_wrapper(&out.join("bin"));
    let file = memtrain_core::memory::timeline::OOM_REPORT_FILE;
    let common = ["--width", "4", "--device", "cpu", "--memory-limit", "40MiB"];
    let o = run(Command::new(example("batch_sweep"))
        .args([
            "--batch-sizes",
            "32,1024",
            "--steps",
            "1",
            "--synthetic-train",
            "10",
        ])
        .args(common)
        .arg("--quiet")
        .arg("--trainer")
        .arg(&wrapper)
        .arg("--out")
        .arg(out.join("sweep"))
        .args(["--", "--synthetic-test", "10"]));
    assert!(o.status.success());
    let dir = out.join("sweep");
    let r = read_sweep(&dir);
    let rel = PathBuf::from("points").join("default-b01024").join(file);
    for p in &r.points {
        match p.batch_size {
            32 => {
                assert_eq!(p.run.status, Status::Ok, "{}", p.run.note);
                assert!(p.run.run_dir.join(file).is_file(), "planted for every run");
                assert_eq!(p.oom_report, None, "an ok point links no report");
            }
            _ => {
                assert_eq!(p.run.status, Status::Oom, "{}", p.run.note);
                assert_eq!(p.oom_report.as_deref(), Some(rel.as_path()));
                assert!(
                    dir.join(&rel).is_file(),
                    "the link resolves from the sweep directory"
                );
            }
        }
    }
    let md = std::fs::read_to_string(dir.join("sweep.md")).unwrap();
    assert!(
        md.contains(&format!("| [report]({}) |", rel.display())),
        "{md}"
    );
    let csv = CsvTable::parse(&std::fs::read_to_string(dir.join("sweep.csv")).unwrap()).unwrap();
    let col: Vec<&str> = (0..csv.rows.len())
        .map(|i| csv.get(i, "oom_report").unwrap())
        .collect();
    assert_eq!(col, ["", rel.to_str().unwrap()]);

    let o = run(Command::new(example("compare"))
        .args([
            "--run",
            "small: --batch-size 32",
            "--run",
            "big: --batch-size 1024 --synthetic-train 1024",
        ])
        .arg("--common")
        .arg(format!(
            "{} --max-steps 1 --no-eval --synthetic-train 32 --synthetic-test 10",
            common.join(" ")
        ))
        .arg("--quiet")
        .arg("--trainer")
        .arg(&wrapper)
        .arg("--out")
        .arg(out.join("compare")));
    assert!(o.status.success());
    let dir = out.join("compare");
    let r: CompareResult =
        serde_json::from_str(&std::fs::read_to_string(dir.join("compare.json")).unwrap()).unwrap();
    let rel = PathBuf::from("runs").join("02-big").join(file);
    assert_eq!(
        r.entries[0].run.status,
        Status::Ok,
        "{}",
        r.entries[0].run.note
    );
    assert_eq!(r.entries[0].oom_report, None);
    assert_eq!(
        r.entries[1].run.status,
        Status::Oom,
        "{}",
        r.entries[1].run.note
    );
    assert_eq!(r.entries[1].oom_report.as_deref(), Some(rel.as_path()));
    let md = std::fs::read_to_string(dir.join("compare.md")).unwrap();
    assert!(
        md.contains(&format!("| [report]({}) |", rel.display())),
        "{md}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn flag_strings_split_and_merge_like_a_shell() {
    assert_eq!(
        split_flags(r#"--a 1 --b "x y" --c 'q"z' d\ e"#).unwrap(),
        ["--a", "1", "--b", "x y", "--c", "q\"z", "d e"]
    );
    assert_eq!(split_flags("  ").unwrap(), Vec::<String>::new());
    assert!(split_flags("--a 'open").is_err());
    assert!(split_flags("--a \"open").is_err());
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let common = s(&["--width", "4", "--no-eval", "--lr", "-0.1", "--max-steps=5"]);
    let run = s(&["--lr", "0.2", "--max-steps", "3"]);
    assert_eq!(
        merge_flags(&[&common, &run]),
        s(&[
            "--width",
            "4",
            "--no-eval",
            "--lr",
            "0.2",
            "--max-steps",
            "3"
        ])
    );
}

#[test]
fn cross_product_labels_the_varying_dimensions() {
    let d = |f: &str, v: &[&str]| Dimension {
        flag: f.into(),
        values: v.iter().map(|x| x.to_string()).collect(),
    };
    let v = cross_product(
        &[
            d("precision", &["f32", "f16"]),
            d("checkpoint", &["none", "stages"]),
            d("width", &["8"]),
        ],
        &["--compress-activations".to_string(), "int4".to_string()],
    );
    let labels: Vec<&str> = v.iter().map(|x| x.label.as_str()).collect();
    assert_eq!(
        labels,
        [
            "f32 ckpt=none",
            "f32 ckpt=stages",
            "f16 ckpt=none",
            "f16 ckpt=stages"
        ]
    );
    assert_eq!(
        v[3].flags,
        [
            "--precision",
            "f16",
            "--checkpoint",
            "stages",
            "--width",
            "8"
        ]
    );
    assert_eq!(cross_product(&[], &[]).len(), 1);
    assert_eq!(cross_product(&[], &[])[0].label, "default");
    // When nothing varies, the trainer flags given after `--` name the configuration too,
    // labelled as the dimensions' values are (the flags themselves stay the points' common ones).
    let given = |words: &[&str]| words.iter().map(|w| w.to_string()).collect::<Vec<_>>();
    let int4 = cross_product(&[], &given(&["--compress-activations", "int4"]));
    assert_eq!(int4[0].label, "compress-activations=int4");
    assert!(int4[0].flags.is_empty());
    assert_eq!(
        cross_product(
            &[d("precision", &["f16"])],
            &given(&["--checkpoint=stages", "--no-eval", "--synthetic-test", "10"])
        )[0]
        .label,
        "f16 ckpt=stages",
        "flags that leave the configuration as it is name nothing"
    );
    assert_eq!(
        cross_product(&[d("accum-steps", &["4"])], &[])[0].label,
        "accum=4"
    );
    assert_eq!(
        cross_product(&[d("accum-steps", &["4"])], &[])[0]
            .accum_steps()
            .unwrap(),
        4
    );
    // Read as the trainer reads flags: the default when absent, a usage error when invalid.
    assert_eq!(cross_product(&[], &[])[0].accum_steps().unwrap(), 1);
    let f = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let parsed = flags_config(&f(&["--width", "4", "--accum-steps=8"])).unwrap();
    assert_eq!(parsed.steps.accum_steps, 8);
    let err = flags_config(&f(&["--accum-steps", "zero"])).unwrap_err();
    assert_eq!(err.exit_code(), 2, "{err}");
    assert!(err.to_string().contains("--accum-steps"), "{err}");
}

#[test]
fn run_specs_parse_labels_and_reject_nonsense() {
    let r = RunSpec::from_flags("fp16: --precision f16").unwrap();
    assert_eq!((r.label.as_str(), r.flags.len()), ("fp16", 2));
    let r = RunSpec::from_flags("--precision f16 --lr 0.05").unwrap();
    assert_eq!(r.label, "--precision f16 --lr 0.05");
    assert_eq!(RunSpec::from_flags("").unwrap().label, "default");
    assert!(RunSpec::from_flags("precision f16").is_err());
    assert!(RunSpec::from_config_file(Path::new("/nonexistent/config.json")).is_err());
}

#[test]
fn csv_parser_handles_quotes_and_the_oom_detector_reads_the_trainer_message() {
    let t = CsvTable::parse("a,b,c\n1,\"x, \"\"y\"\"\",\n2,plain,z\n").unwrap();
    assert_eq!(t.rows.len(), 2);
    assert_eq!(t.get(0, "b"), Some("x, \"y\""));
    assert_eq!(t.get(0, "c"), Some(""));
    assert_eq!(t.get(1, "c"), Some("z"));
    assert!(CsvTable::parse("a,b\n1\n").is_err());

    let msg = "error: out of memory: backward of batch 0 (epoch 0) needed more than the 40.00 MiB limit; lower --batch-size";
    assert_eq!(
        oom_message(msg).as_deref(),
        Some("out of memory: backward of batch 0 (epoch 0) needed more than the 40.00 MiB limit")
    );
    assert!(oom_message("memory allocation of 123 bytes failed\n").is_some());
    assert!(oom_message("error: non-finite loss at epoch 0").is_none());
    // A refusal before anything ran: the ';' inside its parentheses is no advice yet.
    let refused = memtrain::error::CoreError::WontFit(
        "the step's predicted backward peak is 90.00 MiB of heap, 99.00 MiB of resident memory \
         (within the estimate's 1% margin, so it might just fit); lower --batch-size"
            .into(),
    );
    assert_eq!(
        oom_message(&format!("error: {refused}\n")).as_deref(),
        Some(
            "out of memory (predicted; nothing was run): the step's predicted backward peak is \
             90.00 MiB of heap, 99.00 MiB of resident memory (within the estimate's 1% margin, \
             so it might just fit)"
        )
    );
    let plan = BatchPlan::FindMax {
        start: 32,
        max_batch: 64,
        granularity: 8,
        margin: 0.1,
    };
    assert_eq!(
        serde_json::from_str::<BatchPlan>(&serde_json::to_string(&plan).unwrap()).unwrap(),
        plan
    );
    // A sweep.json written before --margin existed reads with the default margin.
    let old: BatchPlan =
        serde_json::from_str(r#"{"find_max":{"start":32,"max_batch":64,"granularity":8}}"#)
            .unwrap();
    assert_eq!(
        old,
        BatchPlan::FindMax {
            start: 32,
            max_batch: 64,
            granularity: 8,
            margin: memtrain::sweep::batch::DEFAULT_MARGIN,
        }
    );
}

#[test]
fn a_usage_error_in_the_child_flags_stops_at_the_first_point_and_a_retry_works() {
    let out = tmp_dir("child-usage");
    let sweep = |extra: &str| {
        Command::new(example("batch_sweep"))
            .args(["--batch-sizes", "8,16", "--steps", "1", "--quiet", "--out"])
            .arg(&out)
            .args(["--", "--width", "4", extra, "64"])
            .output()
            .unwrap()
    };
    let o = sweep("--synthetic-tran");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--synthetic-tran"),
        "the child's message: {stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    // Nothing left behind that would make the same --out refuse the corrected command.
    let o = sweep("--synthetic-test");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let _ = std::fs::remove_dir_all(&out);
}

/// A point the trainer refuses after others ran (exit 2) stops the sweep with exit 2 and leaves
/// nothing written, not a partial sweep.csv (issue 52).
#[cfg(unix)]
#[test]
fn a_usage_error_at_a_later_point_leaves_nothing_written() {
    use std::os::unix::fs::PermissionsExt;
    let out = tmp_dir("later-usage");
    let bin = tmp_dir("later-usage-bin");
    std::fs::create_dir_all(&bin).unwrap();
    let wrapper = bin.join("trainer.sh");
    // Batch 16 refused, but only when it runs (its dry run in the preflight passes).
    let script = format!(
        "#!/bin/sh\ncase \"$*\" in *--dry-run*) ;; *\"--batch-size 16\"*) echo 'error: refused' >&2; exit 2;; esac\nexec '{}' \"$@\"\n",
        example("train_cifar10").display()
    );
    std::fs::write(&wrapper, script).unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let o = Command::new(example("batch_sweep"))
        .args([
            "--batch-sizes",
            "8,16",
            "--steps",
            "1",
            "--quiet",
            "--trainer",
        ])
        .arg(&wrapper)
        .arg("--out")
        .arg(&out)
        .args(["--", "--width", "4", "--synthetic-test", "16"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("refused the flags of this point"),
        "{stderr}"
    );
    assert!(!out.exists(), "nothing written");
    let _ = std::fs::remove_dir_all(&bin);
}

#[test]
fn a_sweep_whose_every_point_failed_exits_non_zero() {
    let out = tmp_dir("all-failed");
    let o = Command::new(example("compare"))
        .args([
            "--run",
            "a: --width 4",
            "--run",
            "b: --width 8",
            "--quiet",
            "--out",
        ])
        .arg(&out)
        .args(["--common", "--data-dir /nonexistent/cifar --max-steps 1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("every point failed"), "{stderr}");
    assert!(
        out.join("compare.json").is_file(),
        "the results are still written"
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn zero_timeouts_and_duplicate_labels_are_usage_errors() {
    for (bin, args) in [
        ("batch_sweep", vec!["--batch-sizes", "8", "--timeout", "0"]),
        ("compare", vec!["--run", "a:", "--timeout", "0"]),
        (
            "compare",
            vec!["--run", "x: --width 4", "--run", "x: --width 8"],
        ),
    ] {
        let out = tmp_dir("usage-zero");
        let o = Command::new(example(bin))
            .args(&args)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{bin} {args:?}: {stderr}");
        assert!(
            stderr.contains("--timeout") || stderr.contains("labelled 'x'"),
            "{stderr}"
        );
        assert!(!out.exists(), "{bin} {args:?} wrote {}", out.display());
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// With `--checkpoint auto` the tables say which segmentation each point trained with; the CSV
/// always does.
#[test]
fn the_tables_say_what_checkpoint_auto_chose() {
    use memtrain::sweep::report::{sweep_csv, sweep_markdown};
    use memtrain::sweep::results::{SweepPoint, Variant};
    use memtrain::sweep::ChildRun;
    let point = |flags: &[&str], segments: Vec<[usize; 2]>| {
        let mut summary = memtrain::train::Summary::default();
        summary.optimizations.checkpoint_segments = segments;
        let label = flags.join(" ");
        SweepPoint {
            configuration: label.clone(),
            batch_size: 32,
            run: ChildRun {
                args: flags.iter().map(|f| f.to_string()).collect(),
                run_dir: PathBuf::from(label),
                status: Status::Ok,
                note: String::new(),
                exit_code: Some(0),
                signal: None,
                wall_secs: 1.0,
                summary: Some(summary),
                lossy: false,
            },
            oom_report: None,
        }
    };
    let mut r = SweepResult {
        command: String::new(),
        steps: 1,
        memory_limit_bytes: None,
        plan: BatchPlan::List(vec![32]),
        configurations: ["--checkpoint none", "--checkpoint auto"]
            .map(|l| Variant {
                label: l.into(),
                flags: Vec::new(),
            })
            .to_vec(),
        points: vec![
            point(&["--checkpoint", "none"], vec![[0, 6]]),
            point(&["--checkpoint", "auto"], vec![[0, 2], [2, 4], [4, 6]]),
        ],
        max_batches: Vec::new(),
        interrupted: false,
    };
    let csv = CsvTable::parse(&sweep_csv(&r)).unwrap();
    assert_eq!(csv.get(0, "segmentation"), Some("none"));
    assert_eq!(csv.get(1, "segmentation"), Some("stages"));
    let md = sweep_markdown(&r);
    assert!(md.contains(" frontier | segmentation |"), "{md}");
    assert!(
        md.lines()
            .any(|l| l.starts_with("| --checkpoint auto |") && l.contains("| stages |")),
        "{md}"
    );
    // Without auto, the segmentations are the configurations' own: no column.
    r.points.pop();
    assert!(!sweep_markdown(&r).contains("segmentation"));
}
