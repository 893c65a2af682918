//! What the operating system sees beside the allocator (issue: process memory beside the heap):
//! the `/proc/self/status` parser, the CPU probe's RSS reading, and the per-batch and per-epoch
//! columns a training run records next to the heap probe.

mod common;

use memtrain::callbacks::log::{BATCH_CSV_HEADER, EPOCH_CSV_HEADER};
use memtrain::train::TrainerOptions;
use memtrain_core::memory::os::{parse_status, process_rss};
use memtrain_core::memory::{CountingAllocator, CpuProbe, MemoryProbe, OsView};

#[global_allocator]
static A: CountingAllocator = CountingAllocator;

const STATUS: &str = "Name:\ttrain_cifar10\nVmPeak:\t  900000 kB\nVmHWM:\t   81234 kB\nVmRSS:\t   70000 kB\nThreads:\t3\n";

#[test]
fn status_fields_are_read_in_bytes() {
    let m = parse_status(STATUS).expect("VmRSS and VmHWM present");
    assert_eq!(m.current, 70_000 * 1024);
    assert_eq!(m.peak, 81_234 * 1024);
}

#[test]
fn status_without_the_fields_gives_none() {
    assert_eq!(parse_status("Name:\tx\nVmRSS:\t12 kB\n"), None);
    assert_eq!(parse_status("VmHWM:\tmany kB\nVmRSS:\t12 kB\n"), None);
    assert_eq!(parse_status(""), None);
}

#[test]
fn the_peak_is_never_below_the_current_reading() {
    // The kernel updates VmHWM lazily; a reading between two updates can be below VmRSS.
    let m = parse_status("VmHWM:\t100 kB\nVmRSS:\t120 kB\n").unwrap();
    assert_eq!((m.current, m.peak), (120 * 1024, 120 * 1024));
}

#[test]
#[cfg(target_os = "linux")]
fn rss_grows_with_touched_pages_and_the_peak_remembers() {
    let probe = CpuProbe::new(None);
    assert_eq!(probe.os_view(), Some(OsView::ProcessRss));
    let before = probe.os_memory().expect("RSS readable on Linux");
    // 64 MiB written page by page become resident.
    let mut v = vec![0u8; 64 << 20];
    for i in (0..v.len()).step_by(4096) {
        v[i] = 1;
    }
    let during = process_rss().unwrap();
    assert!(
        during.current >= before.current + (48 << 20),
        "RSS {} -> {} after touching 64 MiB",
        before.current,
        during.current
    );
    std::hint::black_box(&v);
    drop(v);
    let after = process_rss().unwrap();
    // The kernel's RSS counters are per-CPU approximations, so compare with slack.
    assert!(
        after.peak >= before.current + (48 << 20),
        "the high-water mark keeps the 64 MiB: {} after {}",
        after.peak,
        before.current
    );
}

#[test]
#[cfg(target_os = "linux")]
fn a_run_records_rss_per_batch_and_epoch_beside_the_heap() {
    let dir = common::temp_dir("os-memory-run");
    let mut cfg = common::tiny_config();
    cfg.output.out = Some(dir.clone());
    cfg.steps.max_steps = Some(3);
    let mut t = common::trainer_with(
        cfg,
        TrainerOptions {
            log_files: true,
            ..Default::default()
        },
    );
    let summary = t.fit().unwrap();
    let log = t.memory_log();
    assert_eq!(log.os_view, Some(OsView::ProcessRss));
    let steps = memtrain::callbacks::log::read_batch_log(&dir).unwrap();
    assert_eq!(steps.len(), 3);
    assert_eq!(log.last_batch.as_ref(), steps.last());
    let mut last_peak = 0;
    for b in &steps {
        let (cur, peak) = (b.os_current_bytes.unwrap(), b.os_peak_bytes.unwrap());
        assert!(
            cur > 0 && peak >= cur,
            "batch {}: RSS {cur}, peak {peak}",
            b.batch
        );
        assert!(
            peak >= last_peak,
            "the kernel's high-water mark never falls"
        );
        last_peak = peak;
    }
    let e = &log.epochs[0];
    assert!(e.os_current_bytes.unwrap() > 0 && e.os_peak_bytes.unwrap() >= last_peak);
    assert_eq!(summary.memory.os_view, Some(OsView::ProcessRss));
    assert!(summary.memory.os_peak_bytes.unwrap() >= e.os_peak_bytes.unwrap());
    assert!(summary.memory.os_current_bytes.unwrap() > 0);

    // The report explains the two views, and the CSV files carry the columns.
    let report = log.report();
    assert!(
        report.contains("RSS at end") && report.contains("RSS peak"),
        "{report}"
    );
    assert!(
        report.contains("heap peak:") && report.contains("RSS:"),
        "{report}"
    );
    let batches = std::fs::read_to_string(dir.join("batches.csv")).unwrap();
    assert!(BATCH_CSV_HEADER.ends_with(",os_current_bytes,os_peak_bytes"));
    let first = batches.lines().nth(1).unwrap();
    let cols: Vec<&str> = first.split(',').collect();
    assert_eq!(cols.len(), BATCH_CSV_HEADER.split(',').count());
    let rss: u64 = cols[cols.len() - 2]
        .parse()
        .expect("os_current_bytes is a number");
    assert_eq!(rss, steps[0].os_current_bytes.unwrap());
    let epochs = std::fs::read_to_string(dir.join("epochs.csv")).unwrap();
    assert!(EPOCH_CSV_HEADER.ends_with(",os_current_bytes,os_peak_bytes"));
    let row: Vec<&str> = epochs.lines().nth(1).unwrap().split(',').collect();
    assert_eq!(
        row.last().unwrap().parse::<u64>().unwrap(),
        e.os_peak_bytes.unwrap()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[cfg(target_os = "linux")]
fn the_printed_rss_peak_at_the_runs_end_is_summary_jsons() {
    let dir = common::temp_dir("os-memory-printed");
    let out = common::run_trainer(&[
        "--width",
        "4",
        "--device",
        "cpu",
        "--max-steps",
        "2",
        "--batch-size",
        "32",
        "--synthetic-train",
        "64",
        "--synthetic-test",
        "32",
        "--quiet",
        "--out",
        dir.to_str().unwrap(),
    ]);
    common::assert_ok(&out, "train_cifar10");
    let stdout = common::text(&out.stdout);
    let printed = stdout
        .lines()
        .find_map(|l| l.split("RSS peak at the run's end: ").nth(1))
        .and_then(|rest| rest.split(" (").next())
        .unwrap_or_else(|| panic!("no RSS peak at the run's end in:\n{stdout}"));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    let recorded = summary["os_peak_bytes"].as_u64().unwrap();
    // Read after the charts were drawn, and the same figure on screen and in the file.
    assert_eq!(printed, memtrain_core::memory::format_bytes(recorded));
    let _ = std::fs::remove_dir_all(&dir);
}
