//! Sweeps and comparisons that stop early and search to the right bounds (issue 25, classes 4
//! and 5): a usage error in any configuration stops the whole command before its first run; a
//! search stops at the data set's size and below its granularity; every point runs the steps it
//! reports; and every point runs the build the command started with.

mod common;

use common::{example_binary, scratch, text};
use memtrain::sweep::batch::SweepResult;
use memtrain::sweep::Status;
use std::path::Path;
use std::process::Command;

/// CIFAR-10 records (label byte + 3072 pixel bytes), `n` of them, learnable enough for a step.
fn records(n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * 3073);
    for i in 0..n {
        out.push((i % 10) as u8);
        out.extend((0..3072).map(|p| ((p * 7 + i * 13) % 256) as u8));
    }
    out
}

/// A CIFAR-10 directory with `train` training images and a 10-image test file.
fn data_dir(dir: &Path, train: usize) -> String {
    let d = dir.join("data");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("data_batch_1.bin"), records(train)).unwrap();
    std::fs::write(d.join("test_batch.bin"), records(10)).unwrap();
    d.display().to_string()
}

fn read_sweep(dir: &Path) -> SweepResult {
    serde_json::from_str(&std::fs::read_to_string(dir.join("sweep.json")).unwrap()).unwrap()
}

#[test]
fn a_bad_tenth_configuration_stops_the_comparison_before_any_run() {
    let dir = scratch("sweep-limits", "tenth");
    let data = data_dir(&dir, 40);
    for (bad, named) in [
        ("--precison f16", "--precison"),
        ("--batch-size 64", "fewer than --batch-size 64"),
    ] {
        let out = dir.join("compare");
        let mut cmd = Command::new(example_binary("compare"));
        for i in 1..=9 {
            cmd.args(["--run", &format!("r{i}: --seed {i}")]);
        }
        cmd.args(["--run", &format!("bad: {bad}")])
            .arg("--common")
            .arg(format!(
                "--data-dir {data} --width 4 --batch-size 8 --max-steps 1 --no-eval"
            ))
            .arg("--quiet")
            .arg("--out")
            .arg(&out);
        let o = cmd.output().unwrap();
        let stderr = text(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{bad}: {stderr}");
        assert!(
            stderr.contains("--run 'bad'") && stderr.contains(named),
            "{bad}: {stderr}"
        );
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(!out.exists(), "{bad}: nothing may be left behind");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn find_max_stops_at_the_data_set_and_every_point_runs_its_steps() {
    let dir = scratch("sweep-limits", "dataset");
    let data = data_dir(&dir, 45);
    let out = dir.join("sweep");
    let o = Command::new(example_binary("batch_sweep"))
        .args(["--find-max", "--start", "16", "--max-batch", "512"])
        .args(["--granularity", "8", "--steps", "3", "--quiet", "--out"])
        .arg(&out)
        .args(["--", "--width", "4", "--data-dir", &data])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let r = read_sweep(&out);
    let mb = &r.max_batches[0];
    assert_eq!(mb.max_batch, Some(45), "{mb:?}");
    assert!(mb.capped, "{mb:?}");
    assert!(
        text(&o.stdout).contains("the data set's 45 training images"),
        "{}",
        text(&o.stdout)
    );
    for p in &r.points {
        assert_eq!(p.run.status, Status::Ok, "{}", p.run.note);
        assert!(p.batch_size <= 45);
        // Batch 32 and 45 leave one step per epoch of 45 images: the point still runs 3.
        let s = p.run.summary.as_ref().unwrap();
        assert_eq!(s.progress.steps, 3, "batch {}", p.batch_size);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The `--memory-limit` one sweep-like point at `batch` needs, as its trainer predicts it.
fn point_limit(batch: usize) -> u64 {
    common::needed_limits(|| {
        let mut c = Command::new(common::trainer_binary());
        c.args([
            "--device",
            "cpu",
            "--width",
            "32",
            "--batch-size",
            &batch.to_string(),
        ])
        .args(["--max-steps", "1", "--epochs", "1", "--synthetic-train"])
        .arg((batch.max(10)).to_string())
        .args(["--synthetic-test", "10", "--no-eval", "--quiet"]);
        c
    })
    .1
}

#[test]
fn find_max_finds_a_batch_below_the_granularity() {
    let dir = scratch("sweep-limits", "granularity");
    // A limit halfway between what batch 1 needs and what batch 8 needs: only batches below 8
    // fit.
    let (small, eight) = (point_limit(1), point_limit(8));
    assert!(eight > small);
    let limit = (small + (eight - small) / 2).to_string();
    let out = dir.join("sweep");
    let o = Command::new(example_binary("batch_sweep"))
        .args(["--find-max", "--start", "8", "--granularity", "8"])
        .args([
            "--steps",
            "1",
            "--synthetic-train",
            "10",
            "--memory-limit",
            &limit,
        ])
        .args(["--quiet", "--out"])
        .arg(&out)
        .args(["--", "--width", "32", "--synthetic-test", "10"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let mb = &read_sweep(&out).max_batches[0];
    let m = mb.max_batch.expect("a batch below the granularity fits");
    assert!((1..8).contains(&m), "{mb:?}");
    assert!(mb.first_oom.is_some_and(|o| o > m && o <= 8), "{mb:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_point_runs_the_build_the_sweep_started_with() {
    let dir = scratch("sweep-limits", "rebuilt");
    // A private copy of the comparison binary, replaced while it runs, as `cargo build` would.
    let exe = dir.join("compare");
    std::fs::copy(example_binary("compare"), &exe).unwrap();
    let out = dir.join("out");
    let child = Command::new(&exe)
        .args(["--run", "a: --seed 1", "--run", "b: --seed 2"])
        .args([
            "--common",
            "--width 4 --batch-size 8 --max-steps 1 --synthetic-train 16",
        ])
        .args(["--quiet", "--out"])
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The new "build" at the same path fails every point it would run.
    let new = dir.join("compare.new");
    std::fs::write(
        &new,
        "#!/bin/sh\necho 'error: not the started build' >&2\nexit 3\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&new, &exe).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let r: memtrain::sweep::compare::CompareResult =
        serde_json::from_str(&std::fs::read_to_string(out.join("compare.json")).unwrap()).unwrap();
    for e in &r.entries {
        assert_eq!(e.run.status, Status::Ok, "{}: {}", e.label, e.run.note);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
