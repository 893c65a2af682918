//! Full-size CIFAR-10 (issue 37): five training files and a test file of 10,000 records each,
//! made from the records of `../shared/data/cifar10-subset` when present, else synthetic ones.
//! Loading holds the data set and one read buffer; the baseline training starts from is the data
//! set plus the model; the estimate and the input check say so before a byte is read. All
//! measured with the counting allocator.
//!
//! One test function: the allocator's counters are process-wide.

mod common;

use memtrain::data::{cifar, IMAGE_BYTES, NUM_CLASSES, RECORD_BYTES};
use memtrain::predict::{estimate, DeviceKind};
use memtrain::train::{Trainer, TrainerOptions};
use memtrain::TrainConfig;
use memtrain_core::memory::{format_bytes, CountingAllocator, MemoryLog, OsView};
use std::io::Write;
use std::path::{Path, PathBuf};

#[global_allocator]
static A: CountingAllocator = CountingAllocator;

/// Records in each file of the full CIFAR-10 binary version.
const RECORDS_PER_FILE: usize = 10_000;
/// Its files.
const FILES: [&str; 6] = [
    "data_batch_1.bin",
    "data_batch_2.bin",
    "data_batch_3.bin",
    "data_batch_4.bin",
    "data_batch_5.bin",
    "test_batch.bin",
];
const MIB: u64 = 1 << 20;

/// Records to fill the files with, cycled: the shared subset's, else 10 synthetic ones.
fn source_records() -> Vec<u8> {
    if let Some(dir) = common::real_subset() {
        if let Ok(bytes) = std::fs::read(dir.join("data_batch_1.bin")) {
            if !bytes.is_empty() && bytes.len() % RECORD_BYTES == 0 {
                return bytes;
            }
        }
    }
    let mut out = Vec::with_capacity(NUM_CLASSES * RECORD_BYTES);
    for label in 0..NUM_CLASSES {
        out.push(label as u8);
        out.extend((0..IMAGE_BYTES).map(|i| ((i * 7 + label * 31) % 256) as u8));
    }
    out
}

/// Write the six full-size files into `dir`.
fn write_full_size(dir: &Path) {
    let source = source_records();
    let n = source.len() / RECORD_BYTES;
    for (f, name) in FILES.iter().enumerate() {
        let mut out = std::io::BufWriter::new(std::fs::File::create(dir.join(name)).unwrap());
        for r in 0..RECORDS_PER_FILE {
            let i = (f * RECORDS_PER_FILE + r) % n;
            out.write_all(&source[i * RECORD_BYTES..(i + 1) * RECORD_BYTES])
                .unwrap();
        }
        out.flush().unwrap();
    }
}

/// Every bytes figure of this test above the heap the harness held before it: `at - pre`.
fn above(at: u64, pre: u64) -> u64 {
    at.saturating_sub(pre)
}

/// A directory removed when dropped, also when the test fails (it holds 184 MB).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn full_size_data_is_held_exactly_and_loading_is_not_the_peak() {
    let scratch = Scratch(common::temp_dir("full-size-data"));
    let dir = scratch.0.clone();
    write_full_size(&dir);
    let data = (FILES.len() * RECORDS_PER_FILE * RECORD_BYTES) as u64;
    let file = (RECORDS_PER_FILE * RECORD_BYTES) as u64;
    let mut cfg = TrainConfig::default();
    cfg.data.data_dir = Some(dir.clone());
    cfg.steps.max_steps = Some(1);
    cfg.output.eval = false;
    cfg.output.quiet = true;
    cfg.device = Some("cpu".into());

    // What the estimate and the input check expect, from the file sizes alone.
    let est = estimate(&cfg, DeviceKind::cpu()).expect("estimate");
    let mut limited = cfg.clone();
    limited.memory.memory_limit = Some(MIB);
    let refusal = memtrain::predict::bounds::check_inputs(&limited, None, true, 0)
        .expect_err("1 MiB holds no data set")
        .to_string();
    let predicted_loading: f64 = refusal
        .split("while loading) needs ")
        .nth(1)
        .and_then(|t| t.split(" MiB").next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no loading need in: {refusal}"));

    // Loading, measured.
    let pre = CountingAllocator::current();
    CountingAllocator::reset_peak();
    let splits = cifar::load_dir(&dir, 0.1, 0).expect("load");
    let loading_peak = above(CountingAllocator::peak(), pre);
    let loaded = above(CountingAllocator::current(), pre);
    assert_eq!(splits.train.len(), 5 * RECORDS_PER_FILE);
    assert_eq!(splits.test.len(), RECORDS_PER_FILE);
    // The splits exactly, and the description line.
    assert!(
        loaded >= data && loaded - data < 4096,
        "after loading {loaded} B held for {data} B of data"
    );

    // Training, measured: the baseline is the heap when it begins.
    let mut trainer = Trainer::new(cfg, splits, TrainerOptions::default()).expect("trainer");
    let summary = trainer.fit().expect("one step");
    let baseline = above(summary.memory.baseline_bytes, pre);
    let model = est.held.baseline_bytes - data;
    let report = format!(
        "data {}, loading peak {}, baseline {} (estimated {}: model {}), step peak {}, run peak {} ({:?})",
        format_bytes(data),
        format_bytes(loading_peak),
        format_bytes(baseline),
        format_bytes(est.held.baseline_bytes),
        format_bytes(model),
        format_bytes(above(summary.memory.step_peak_bytes, pre)),
        format_bytes(above(summary.memory.peak_bytes, pre)),
        summary.memory.peak_phase
    );
    eprintln!("{report}");

    // (a) The baseline is the data plus the model, within 1 MiB, and the estimate says so.
    assert!(
        baseline.abs_diff(data + model) < MIB,
        "baseline not data + model: {report}"
    );
    // (b) Loading holds the data and at most one file's bytes more.
    assert!(
        loading_peak <= baseline + file,
        "loading peak above baseline + one file: {report}"
    );
    // The input check's loading need is the measured one (its figure has 2 decimals).
    let measured_mib = loading_peak as f64 / MIB as f64;
    assert!(
        (predicted_loading - measured_mib).abs() / measured_mib < 0.01,
        "input check predicts {predicted_loading} MiB for loading: {report}"
    );
    // The run's peak is its training step's, not loading's.
    assert_ne!(
        summary.memory.peak_phase.as_deref(),
        Some("other"),
        "the peak is outside training: {report}"
    );

    // The report says when the heap peak is above the RSS peak, and why (issue 37's run before
    // the fix: heap 380.92 MiB, RSS 295.3 MiB); not otherwise.
    let log = |heap: u64, rss: u64| {
        let mut log = MemoryLog::default();
        log.probe = "cpu-heap".into();
        log.available = true;
        log.peak_bytes = heap;
        log.os_view = Some(OsView::ProcessRss);
        log.os_peak_bytes = Some(rss);
        log
    };
    let above_rss = log(381 * MIB, 295 * MIB).report();
    assert!(
        above_rss.contains(
            "heap peak 381.00 MiB is above the RSS peak 295.00 MiB: the heap counts every byte \
             allocated, RSS only the pages written, and capacity never written is never paged in."
        ),
        "{above_rss}"
    );
    assert!(!log(248 * MIB, 286 * MIB)
        .report()
        .contains("is above the RSS peak"));
}
