//! `--dry-run` reaches the run's own verdict at every `--memory-limit`, a boundary included: the
//! resident reserve is the sizes of the files the process maps (the same in every run of one
//! build), not a reading that moves between processes.

mod common;

use common::{flags, trainer_binary};
use std::process::Command;

const BASE: &str = "--width 8 --batch-size 32 --synthetic-train 256 --synthetic-test 16 --max-steps 1 --no-eval --quiet";

/// Exit code of the trainer with `--memory-limit limit` (bytes), a dry run or not.
fn verdict(limit: u64, dry: bool, out: &std::path::Path) -> i32 {
    let mut c = Command::new(trainer_binary());
    c.args(flags(BASE))
        .args(["--memory-limit", &limit.to_string(), "--overwrite", "--out"])
        .arg(out);
    if dry {
        c.arg("--dry-run");
    }
    let o = c.output().expect("run the trainer");
    let code = o.status.code().unwrap_or(-1);
    assert!(
        code == 0 || code == 2,
        "limit {limit} dry {dry}: exit {code}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    code
}

#[test]
fn a_dry_run_and_the_run_agree_at_the_boundary() {
    let dir = common::scratch("dry-run", "boundary");
    let out = dir.join("run");
    // The smallest limit a dry run accepts, to the KiB.
    let (mut lo, mut hi) = (1u64 << 20, 512u64 << 20);
    assert_eq!(verdict(lo, true, &out), 2, "1 MiB is refused");
    assert_eq!(verdict(hi, true, &out), 0, "512 MiB is accepted");
    while hi - lo > 1024 {
        let mid = lo + (hi - lo) / 2;
        if verdict(mid, true, &out) == 0 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    // The same verdict every time, dry or not, on both sides of the boundary.
    for _ in 0..3 {
        assert_eq!(verdict(lo, true, &out), 2, "a dry run at {lo} B");
        assert_eq!(verdict(hi, true, &out), 0, "a dry run at {hi} B");
    }
    assert_eq!(verdict(lo, false, &out), 2, "the run at {lo} B");
    assert_eq!(verdict(hi, false, &out), 0, "the run at {hi} B");
    let _ = std::fs::remove_dir_all(&dir);
}
