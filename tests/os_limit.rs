//! `--memory-limit` on the CPU is a limit the operating system agrees with (issue 22): a run that
//! memtrain accepts under X, and the batch `--find-max` reports for X, complete inside a cgroup
//! whose memory limit is X; a run predicted not to fit is refused before any work, dry runs too.
//!
//! The cgroup tests need cgroup v1's memory controller writable (root, as on the CI machines);
//! elsewhere they say so and pass without checking.

mod common;

use common::{example_binary, scratch, text, trainer_binary, Cgroup};
use memtrain::sweep::batch::SweepResult;
use std::path::Path;
use std::process::Command;

const LIMIT_MIB: u64 = 150;

/// The data flags: the real subset when present, else synthetic images.
fn data_flags() -> Vec<String> {
    let subset = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/cifar10-subset");
    if subset.is_dir() {
        vec!["--data-dir".into(), subset.display().to_string()]
    } else {
        eprintln!("note: no {}; using synthetic data", subset.display());
        vec!["--synthetic-train".into(), "2048".into()]
    }
}

fn flags(s: &str) -> Vec<String> {
    s.split_whitespace().map(String::from).collect()
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn the_batch_find_max_reports_runs_to_completion_in_a_cgroup_of_the_limit() {
    let dir = scratch("os-limit", "findmax");
    let limit = format!("{LIMIT_MIB}MiB");
    let out = dir.join("sweep");
    let o = Command::new(example_binary("batch_sweep"))
        .args([
            "--find-max",
            "--start",
            "64",
            "--granularity",
            "16",
            "--steps",
            "2",
        ])
        .args(["--memory-limit", &limit, "--quiet", "--out"])
        .arg(&out)
        .arg("--")
        .args(data_flags())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let r: SweepResult =
        serde_json::from_str(&std::fs::read_to_string(out.join("sweep.json")).unwrap()).unwrap();
    let max = r.max_batches[0].max_batch.expect("a batch fits 150 MiB");
    for p in r.points.iter().filter(|p| p.run.summary.is_some()) {
        let s = p.run.summary.as_ref().unwrap();
        assert!(
            s.memory.os_peak_bytes.unwrap() <= LIMIT_MIB << 20,
            "batch {}: resident peak {} over the limit",
            p.batch_size,
            s.memory.os_peak_bytes.unwrap()
        );
    }
    let Some(group) = Cgroup::new("findmax", LIMIT_MIB << 20) else {
        return;
    };
    let run = dir.join("run");
    let args = [
        data_flags(),
        flags(&format!(
            "--batch-size {max} --memory-limit {limit} --max-steps 3 --no-eval --quiet --out"
        )),
        vec![run.display().to_string()],
    ]
    .concat();
    let o = group.run(trainer_binary(), &args);
    assert!(
        o.status.success() && group.oom_kills() == 0,
        "batch {max}, which --find-max reported for {limit}, failed in a {limit} cgroup ({:?}, {} OOM kills): {}",
        o.status,
        group.oom_kills(),
        text(&o.stderr)
    );
    let s = summary(&run);
    assert_eq!(s["memory_limit_bytes"], LIMIT_MIB << 20);
    assert!(s["heap_budget_bytes"].as_u64().unwrap() < LIMIT_MIB << 20);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_run_predicted_over_the_limit_is_refused_before_any_work() {
    let dir = scratch("os-limit", "refused");
    // Batch 240 needs about 150 MiB of heap alone: over a 150 MiB process.
    for dry in [true, false] {
        let out = dir.join(format!("run-{dry}"));
        let mut args = [
            data_flags(),
            flags(&format!(
                "--batch-size 240 --memory-limit {LIMIT_MIB}MiB --max-steps 1 --out"
            )),
            vec![out.display().to_string()],
        ]
        .concat();
        if dry {
            args.push("--dry-run".into());
        }
        let o = Command::new(trainer_binary()).args(&args).output().unwrap();
        let stderr = text(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "dry run {dry}: {stderr}");
        assert!(
            stderr.starts_with("error: out of memory (predicted; nothing was run)")
                && stderr.contains("of resident memory")
                && stderr.contains("raise --memory-limit to at least"),
            "{stderr}"
        );
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(!out.exists(), "nothing written");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resident_memory_stays_within_the_limit_across_configurations() {
    // The reserve under the heap budget covers what the process holds outside its heap, for
    // every shape of step: each run is given a limit just above its predicted need.
    let dir = scratch("os-limit", "reserve");
    for (i, cfg) in [
        "--batch-size 32",
        "--batch-size 128 --checkpoint stages",
        "--batch-size 128 --precision bf16",
        "--batch-size 64 --conv separable --accum-steps 2",
        "--batch-size 64 --width 64 --optimizer adamw",
        "--batch-size 240 --width 64",
    ]
    .iter()
    .enumerate()
    {
        let base = [data_flags(), flags(cfg)].concat();
        // The limit the refusals name as enough, and a MiB more (each process measures its own
        // reserve; they differ by a few hundred KiB).
        let need = common::needed_limits(|| {
            let mut c = Command::new(trainer_binary());
            c.args(&base);
            c
        })
        .1 as f64
            / 1048576.0;
        let limit = ((need + 1.0) * 1048576.0) as u64;
        let out = dir.join(format!("run{i}"));
        let o = Command::new(trainer_binary())
            .args(&base)
            .args(["--memory-limit", &limit.to_string()])
            .args(flags("--max-steps 3 --no-eval --quiet --out"))
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{cfg} at {need} MiB + 0.5: {}",
            text(&o.stderr)
        );
        let s = summary(&out);
        let (heap, rss) = (
            s["peak_bytes"].as_u64().unwrap(),
            s["os_peak_bytes"].as_u64().unwrap(),
        );
        eprintln!(
            "{cfg}: limit {:.1} MiB, heap peak {:.1}, resident peak {:.1} ({:.1} beside the heap)",
            limit as f64 / 1048576.0,
            heap as f64 / 1048576.0,
            rss as f64 / 1048576.0,
            (rss as f64 - heap as f64) / 1048576.0
        );
        assert!(
            rss <= limit,
            "{cfg}: resident peak {rss} over the limit {limit}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A cgroup whose usage is mostly clean file cache still has room: the kernel reclaims that
/// cache before it kills anything, so a run that fits the group's limit starts in it (issue 52:
/// the room was the limit less all the usage, and the run stopped before its first batch).
#[test]
fn a_run_starts_in_a_cgroup_full_of_clean_file_cache() {
    let run = |batch: usize| {
        flags(&format!(
            "--width 8 --batch-size {batch} --synthetic-train {batch} --synthetic-test 16 \
             --device cpu --max-steps 1 --no-eval --quiet"
        ))
    };
    let limit = common::needed_limits(|| common::trainer_command(&run(32))).1 + (1 << 20);
    let Some(group) = Cgroup::new("file-cache", limit) else {
        return;
    };
    let dir = scratch("os-limit", "file-cache");
    // Three quarters of the group: a file written in it and synced, so its cache is clean.
    let cache = limit / 4 * 3;
    let file = dir.join("cache");
    let fill = format!("head -c {cache} /dev/zero > '{}' && sync", file.display());
    let o = group.run(Path::new("/bin/sh"), &["-c".into(), fill]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let usage = group.read("memory.usage_in_bytes");
    if usage < cache / 2 {
        eprintln!("skipped: the kernel charged only {usage} bytes of file cache to the group");
        return;
    }
    // One compute thread, as `needed_limits` measured.
    let in_group = |args: Vec<String>| {
        let mut all = vec!["RAYON_NUM_THREADS=1".to_string()];
        all.push(trainer_binary().display().to_string());
        all.extend(args);
        group.run(Path::new("/usr/bin/env"), &all)
    };
    let out = dir.join("run");
    let mut args = run(32);
    args.extend(["--memory-limit".into(), limit.to_string()]);
    args.extend(["--out".into(), out.display().to_string()]);
    let o = in_group(args);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(group.oom_kills(), 0);
    assert_eq!(summary(&out)["steps"], 1);
    // A step beyond the group: refused naming the group, not --memory-limit nor a batch.
    let dry = common::run_trainer(&[run(256), flags("--dry-run")].concat());
    let stdout = text(&dry.stdout);
    let predicted: f64 = stdout
        .lines()
        .find_map(|l| {
            l.strip_prefix("predicted peak ")?
                .split(" MiB")
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no predicted peak in: {stdout}"));
    assert!(
        predicted * 1048576.0 > limit as f64,
        "{predicted} MiB fits the group"
    );
    let o = in_group(run(256));
    let stderr = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("the cgroup's memory.limit_in_bytes"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("--memory-limit") && !stderr.contains("batch 1"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run trained in a cgroup of its `--memory-limit` resumes in a cgroup of the same size, at a
/// width where the snapshot (parameters and AdamW state) is a third of the limit: the loaded
/// snapshot becomes the model and optimizer state the prediction counts, so it is not counted
/// twice (issue 52).
#[test]
fn a_run_resumes_in_a_cgroup_of_its_limit() {
    let base = flags(
        "--width 96 --optimizer adamw --batch-size 8 --synthetic-train 64 --synthetic-test 16 \
         --device cpu --no-eval --quiet",
    );
    let limit = common::needed_limits(|| common::trainer_command(&base)).1 + (1 << 20);
    let dir = scratch("os-limit", "resume");
    let out = dir.join("run");
    let in_group = |name: &str, args: Vec<String>| {
        let Some(group) = Cgroup::new(name, limit) else {
            return false;
        };
        let mut all = vec!["RAYON_NUM_THREADS=1".to_string()];
        all.push(trainer_binary().display().to_string());
        all.extend(args);
        let o = group.run(Path::new("/usr/bin/env"), &all);
        assert!(o.status.success(), "{name}: {}", text(&o.stderr));
        assert_eq!(group.oom_kills(), 0, "{name}");
        true
    };
    let limit_flag = vec!["--memory-limit".to_string(), limit.to_string()];
    let mut args = [base, flags("--max-steps 2"), limit_flag.clone()].concat();
    args.extend(["--out".into(), out.display().to_string()]);
    if !in_group("train", args) {
        return;
    }
    let mut args = vec!["--resume".into(), out.display().to_string()];
    args.extend(flags("--max-steps 3"));
    assert!(in_group("resume", args));
    assert_eq!(summary(&out)["steps"], 3);
    let _ = std::fs::remove_dir_all(&dir);
}
