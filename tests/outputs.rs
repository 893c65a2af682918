//! `docs/outputs.md` documents every file a run, a pruned run, a sweep and a comparison write,
//! every column and key in them, and every what-if label: this test runs each (tiny, synthetic
//! data, on the CPU) and checks that every CSV column and JSON key written is documented and every
//! documented one is written (rows whose meaning says "only with …"/"only when …" may be absent),
//! and that the README's "Where results go" names only files a run writes. It also checks the
//! naming scheme (bytes end in `_bytes`), the epoch numbering (from 1, as on the screen) and empty
//! values where nothing was measured (`--no-eval`).

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

const DOC: &str = "docs/outputs.md";

/// `target/<profile>/examples/<name>`, brought up to date once (`cargo test --test outputs`
/// builds only this file; cargo does nothing when the examples are current).
fn example(name: &str) -> PathBuf {
    static BUILT: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().and_then(Path::parent).unwrap();
    let bin = profile.join("examples").join(name);
    BUILT.get_or_init(|| {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "--quiet", "--examples"])
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if profile.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        if let Some(target) = profile.parent() {
            cmd.env("CARGO_TARGET_DIR", target);
        }
        assert!(cmd.status().unwrap().success(), "cargo build --examples");
    });
    bin
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("memtrain-outputs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

const TINY: [&str; 12] = [
    "--width",
    "4",
    "--device",
    "cpu",
    "--max-steps",
    "3",
    "--synthetic-train",
    "96",
    "--synthetic-test",
    "32",
    "--quiet",
    "--seed",
];

fn run(cmd: &mut Command) {
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "{cmd:?}: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The documented keys of each file: `## \`file\`` sections, one `| \`key\` | meaning |` row per
/// column or key; the bool says whether the key may be absent.
fn documented() -> BTreeMap<String, BTreeMap<String, bool>> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(DOC)).unwrap();
    let mut out: BTreeMap<String, BTreeMap<String, bool>> = BTreeMap::new();
    let mut file: Option<String> = None;
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("## `") {
            file = h.split('`').next().map(String::from);
            continue;
        }
        if line.starts_with("## ") {
            file = None;
        }
        let (Some(f), Some(row)) = (&file, line.strip_prefix("| `")) else {
            continue;
        };
        let key = row.split('`').next().unwrap().to_string();
        let optional = line.contains("only with") || line.contains("only when");
        let keys = out.entry(f.clone()).or_default();
        assert!(
            keys.insert(key.clone(), optional).is_none(),
            "{f}: {key} twice"
        );
    }
    out
}

/// Every path of a JSON value: object keys joined by `.`, array items as `[]`; paths in `stop`
/// are not descended into (a child run's summary.json, documented under summary.json).
fn json_paths(v: &Value, path: &str, stop: &[&str], out: &mut BTreeSet<String>) {
    if !path.is_empty() {
        out.insert(path.to_string());
    }
    if stop.contains(&path) {
        return;
    }
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                json_paths(x, &p, stop, out);
            }
        }
        Value::Array(a) => {
            for x in a.iter().filter(|x| x.is_object() || x.is_array()) {
                json_paths(x, &format!("{path}[]"), stop, out);
            }
        }
        _ => {}
    }
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn csv_header(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .next()
        .unwrap()
        .split(',')
        .map(String::from)
        .collect()
}

/// Written and documented keys of `file` agree.
fn check(docs: &BTreeMap<String, BTreeMap<String, bool>>, file: &str, written: &BTreeSet<String>) {
    let doc = docs
        .get(file)
        .unwrap_or_else(|| panic!("{DOC} has no section for {file}"));
    for k in written {
        assert!(
            doc.contains_key(k),
            "{file}: `{k}` is written but not in {DOC}"
        );
    }
    for (k, optional) in doc {
        assert!(
            *optional || written.contains(k),
            "{file}: `{k}` is in {DOC} but not written (mark it \"only with …\" if it is conditional)"
        );
    }
}

/// A byte-valued name ends in `_bytes` (the naming scheme).
fn check_names(file: &str, keys: &BTreeSet<String>) {
    for k in keys {
        let leaf = k.rsplit(['.', ']']).next().unwrap();
        let looks_bytes = ["peak", "current", "limit", "baseline"]
            .iter()
            .any(|w| leaf.ends_with(w));
        assert!(
            !looks_bytes,
            "{file}: `{k}` holds bytes but does not end in _bytes"
        );
    }
}

#[test]
fn every_file_column_and_key_is_documented_and_written() {
    let docs = documented();
    let dir = tmp("run");
    run(Command::new(example("train_cifar10"))
        .args(TINY)
        .args(["1", "--batch-size", "32", "--out"])
        .arg(&dir));
    for f in ["batches.csv", "epochs.csv"] {
        let h = csv_header(&dir.join(f));
        check(&docs, f, &h);
        check_names(f, &h);
    }
    for f in ["memory.json", "summary.json", "step_timeline.json"] {
        let mut keys = BTreeSet::new();
        json_paths(&json(&dir.join(f)), "", &[], &mut keys);
        check(&docs, f, &keys);
        check_names(f, &keys);
    }

    let cmp = tmp("compare");
    let common = TINY.join(" ") + " 1 --batch-size 32";
    run(Command::new(example("compare"))
        .args(["--run", "a:", "--run", "b: --checkpoint stages", "--quiet"])
        .args(["--common", &common, "--out"])
        .arg(&cmp));
    let h = csv_header(&cmp.join("compare.csv"));
    check(&docs, "compare.csv", &h);
    check_names("compare.csv", &h);
    let mut keys = BTreeSet::new();
    json_paths(
        &json(&cmp.join("compare.json")),
        "",
        &["entries[].run.summary"],
        &mut keys,
    );
    check(&docs, "compare.json", &keys);
    check_names("compare.json", &keys);
    // compare.csv carries the step-added and saved bytes of every run that wrote a timeline.
    let text = std::fs::read_to_string(cmp.join("compare.csv")).unwrap();
    let table = memtrain::sweep::report::CsvTable::parse(&text).unwrap();
    for i in 0..2 {
        for c in ["step_added_bytes", "saved_activation_bytes"] {
            let v: u64 = table.get(i, c).unwrap().parse().unwrap();
            assert!(v > 0, "{c} of row {i}");
        }
    }
    let md = std::fs::read_to_string(cmp.join("compare.md")).unwrap();
    assert!(
        md.contains("| step adds MiB | saved peak MiB (recomputed included) |"),
        "{md}"
    );

    let sweep = tmp("sweep");
    run(Command::new(example("batch_sweep"))
        .args(["--batch-sizes", "16,32", "--steps", "2", "--quiet", "--out"])
        .arg(&sweep)
        .args(["--", "--width", "4", "--device", "cpu"])
        .args(["--synthetic-train", "96", "--synthetic-test", "32"]));
    let h = csv_header(&sweep.join("sweep.csv"));
    check(&docs, "sweep.csv", &h);
    check_names("sweep.csv", &h);
    let mut keys = BTreeSet::new();
    json_paths(
        &json(&sweep.join("sweep.json")),
        "",
        &["points[].run.summary"],
        &mut keys,
    );
    check(&docs, "sweep.json", &keys);
    check_names("sweep.json", &keys);

    readme_names_what_a_run_writes(&dir);

    // A pruned run writes its final model too.
    let pruned = tmp("prune");
    run(Command::new(example("train_cifar10"))
        .args(TINY)
        .args(["1", "--batch-size", "32", "--prune", "0.5", "--out"])
        .arg(&pruned));

    // Every file the four wrote is named in the reference.
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(DOC)).unwrap();
    // Every what-if label the run printed is named in the row of `what_if[]`.
    let row = text
        .lines()
        .find(|l| l.starts_with("| `what_if[]` |"))
        .unwrap();
    let summary = json(&dir.join("summary.json"));
    let rows = summary["what_if"].as_array().unwrap();
    assert!(rows.len() >= 8, "{rows:?}");
    for w in rows {
        let label = w["label"].as_str().unwrap();
        let named = if label.starts_with("accum") {
            "accumK"
        } else {
            label
        };
        assert!(
            row.contains(&format!("`{named}`")),
            "what-if label {label} is not in {DOC}"
        );
    }
    for d in [&dir, &cmp, &sweep, &pruned] {
        for e in std::fs::read_dir(d).unwrap() {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            // Chart pairs are written `name.png`/`.svg`.
            // TensorBoard's event file is named by its time and host.
            let stem = match name.rsplit_once('.') {
                _ if name.starts_with("events.out.tfevents.") => "events.out.tfevents.".into(),
                Some((stem, "svg" | "png")) => format!("{stem}."),
                _ => name.clone(),
            };
            assert!(text.contains(&format!("`{stem}")), "{name} is not in {DOC}");
        }
    }
    for d in [dir, cmp, sweep, pruned] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// The README's "Where results go" list names files the run in `dir` wrote: every name a bullet
/// starts with (`events.out.tfevents.*` by its prefix) exists there unless the bullet says
/// "only after", and the snapshots' bullet names their folder, `latest` and manifest.
fn readme_names_what_a_run_writes(dir: &Path) {
    use memtrain::train::snapshot::{LATEST_FILE, MANIFEST_FILE, SNAPSHOTS_DIR};
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let list = readme
        .split("## Where results go")
        .nth(1)
        .and_then(|s| s.split("\n\n").find(|p| p.starts_with("- ")))
        .expect("README.md: the list under \"Where results go\"");
    let written: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let bullets = list.split("\n- ").map(|b| b.trim_start_matches("- "));
    let snapshots = format!("`{SNAPSHOTS_DIR}/`");
    assert!(
        bullets.clone().any(|b| b.starts_with(&snapshots)
            && b.contains(&format!("`{SNAPSHOTS_DIR}/{LATEST_FILE}`"))
            && b.contains(&format!("`{MANIFEST_FILE}`"))),
        "README.md's list does not name {snapshots}, its latest file and {MANIFEST_FILE}"
    );
    for bullet in bullets {
        if bullet.contains("only after") {
            continue;
        }
        let head = bullet.split(':').next().unwrap();
        for name in head.split('`').skip(1).step_by(2) {
            let found = match name.strip_suffix('*') {
                Some(prefix) => written.iter().any(|w| w.starts_with(prefix)),
                None => written.iter().any(|w| *w == name.trim_end_matches('/')),
            };
            assert!(
                found,
                "README.md names `{name}`, which a run does not write"
            );
        }
    }
}

#[test]
fn epochs_count_from_one_and_nothing_measured_is_empty() {
    let dir = tmp("noeval");
    run(Command::new(example("train_cifar10"))
        .args(TINY)
        .args([
            "2",
            "--batch-size",
            "48",
            "--epochs",
            "2",
            "--no-eval",
            "--out",
        ])
        .arg(&dir));
    // 96 images in batches of 48: two steps an epoch, but --max-steps 3 ends the run in the
    // second epoch after its first step.
    let batches = std::fs::read_to_string(dir.join("batches.csv")).unwrap();
    let rows: Vec<Vec<&str>> = batches
        .lines()
        .skip(1)
        .map(|l| l.split(',').take(3).collect())
        .collect();
    assert_eq!(
        rows,
        [["1", "1", "1"], ["1", "2", "2"], ["2", "1", "3"]],
        "{batches}"
    );
    let epochs = memtrain::sweep::report::CsvTable::parse(
        &std::fs::read_to_string(dir.join("epochs.csv")).unwrap(),
    )
    .unwrap();
    assert_eq!(epochs.get(0, "epoch"), Some("1"));
    for c in ["eval_loss", "eval_accuracy", "eval_peak_bytes"] {
        assert_eq!(epochs.get(0, c), Some(""), "{c} with --no-eval");
    }
    let memory = json(&dir.join("memory.json"));
    assert_eq!(memory["first_number"], 1);
    assert_eq!(memory["epochs"][0]["epoch"], 1);
    assert!(memory["epochs"][0]["eval_peak_bytes"].is_null());
    // Every step's record is in batches.csv; the log keeps the newest and the count.
    assert_eq!(memory["steps"], 3);
    assert_eq!(memory["last_batch"]["global_step"], 3);
    let timeline = json(&dir.join("step_timeline.json"));
    assert_eq!(
        timeline["global_step"], 3,
        "the last step, numbered as in batches.csv"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn logs_of_older_versions_are_read_renumbered_and_under_their_old_names() {
    let old = r#"{"probe":"cpu-heap","available":true,"baseline_bytes":10,"peak_bytes":50,
        "peak_phase":"backward","reserved_peak":null,"os_view":null,"os_peak":null,
        "batches":[{"epoch":0,"batch":1,"global_step":1,"start_bytes":10,"end_bytes":12,
          "peak_bytes":50,"phase":"backward","forward_peak":40,"backward_peak":50,
          "optimizer_peak":20,"reserved_peak":null,"os_current":null,"os_peak":null}],
        "epochs":[{"epoch":0,"peak_bytes":50,"phase":"backward","mean_batch_peak":50,
          "eval_peak":30,"batches":2}]}"#;
    let log: memtrain_core::memory::MemoryLog = serde_json::from_str(old).unwrap();
    let log = log.numbered().upgrade();
    assert_eq!(log.steps, 1);
    let b = log.last_batch.as_ref().unwrap();
    assert_eq!((b.epoch, b.batch, b.global_step), (1, 2, 2));
    assert_eq!(b.backward_peak_bytes, 50);
    let e = &log.epochs[0];
    assert_eq!((e.epoch, e.steps, e.eval_peak_bytes), (1, 2, Some(30)));
    assert_eq!(e.mean_step_peak_bytes, 50);
    // Renumbering is done once.
    assert_eq!(log.clone().numbered().last_batch.unwrap().epoch, 1);

    let summary = r#"{"label":"bs32 f32","device":"cpu","probe":"cpu-heap","probe_available":true,
        "num_params":1,"param_bytes":4,"peak_bytes":9,"peak_phase":"other","baseline_bytes":1,
        "step_peak_bytes":8,"reserved_peak_bytes":null,"os_view":null,"os_current_bytes":null,
        "os_peak_bytes":null,"memory_limit":1000,"predicted_peak_bytes":null,
        "prediction_error_pct":null,"images_per_sec":1.0,"steady_images_per_sec":null,"steps":1,
        "epochs_completed":1,"images":32,"final_train_loss":null,"final_test_accuracy":null,
        "final_test_loss":null,"eval_is_validation":false,"loss_scale":null,"skipped_steps":0,
        "status":"ok","wall_secs":1.0}"#;
    let s: memtrain::train::Summary = serde_json::from_str(summary).unwrap();
    assert_eq!(s.memory.memory_limit_bytes, Some(1000));
    assert_eq!(s.estimate.what_if, None);
}
