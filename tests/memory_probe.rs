//! The counting allocator is exact, and the memory recorder's peaks nest.
//!
//! One test function on purpose: the counters are process-wide, and the test harness runs
//! test functions on parallel threads that would allocate in the middle of a measurement.

use memtrain::config::parse_size;
use memtrain_core::memory::{CountingAllocator, CpuProbe, MemoryProbe, MemoryRecorder};
use memtrain_core::phase::Phase;
use std::sync::Arc;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[test]
fn counting_allocator_and_peak_nesting() {
    // --- exactness: a known allocation moves current and peak by exactly its size.
    assert!(CountingAllocator::is_installed());
    let size = 10 * 1024 * 1024 + 7;
    let before = CountingAllocator::current();
    CountingAllocator::reset_peak();
    let v: Vec<u8> = Vec::with_capacity(size);
    let during = CountingAllocator::current();
    assert_eq!(
        during - before,
        size as u64,
        "current moves by exactly the allocation"
    );
    assert_eq!(CountingAllocator::peak(), during, "peak follows current");
    drop(v);
    assert_eq!(CountingAllocator::current(), before, "free returns exactly");
    assert_eq!(CountingAllocator::peak(), during, "peak stays after free");
    CountingAllocator::reset_peak();
    assert_eq!(
        CountingAllocator::peak(),
        before,
        "reset brings peak to current"
    );

    // A candle tensor of known size moves the counter by at least its data (plus small headers).
    let t = candle_core::Tensor::zeros(
        (256, 1024),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let with_t = CountingAllocator::current();
    let data = 256 * 1024 * 4;
    assert!(
        with_t - before >= data && with_t - before < data + 4096,
        "tensor bytes {}",
        with_t - before
    );
    drop(t);
    assert_eq!(CountingAllocator::current(), before);

    // --- peaks nest: a big allocation inside batch 0's forward is the epoch's peak even though
    // later batches reset the watermark, and the run peak keeps it too.
    let probe: Arc<dyn MemoryProbe> = Arc::new(CpuProbe::new(None));
    let mut rec = MemoryRecorder::new(probe.clone());
    rec.train_begin();
    rec.epoch_begin(0, true);
    let base = probe.current();
    let big = 8 << 20;
    let mut steps = Vec::new();
    for b in 0..3 {
        rec.step_begin();
        let fwd: Vec<u8> = vec![1; if b == 0 { big } else { 1 << 20 }];
        rec.phase_end(Phase::Forward);
        drop(fwd);
        let bwd: Vec<u8> = vec![1; 2 << 20];
        rec.phase_end(Phase::Backward);
        drop(bwd);
        rec.step_end(0, b, b);
        steps.push(rec.log().last_batch.clone().expect("the step's record"));
    }
    rec.epoch_end(0, true);
    rec.train_end();
    let log = rec.log();
    assert_eq!(log.steps, 3);
    assert_eq!(log.last_batch.as_ref(), steps.last());
    let b0 = &steps[0];
    assert_eq!(b0.peak_phase, Phase::Forward);
    assert!(
        b0.peak_bytes >= base + big as u64,
        "batch 0 peak holds the 8 MiB forward buffer"
    );
    for b in &steps[1..] {
        assert_eq!(
            b.peak_phase,
            Phase::Backward,
            "2 MiB backward beats 1 MiB forward"
        );
        assert!(b.peak_bytes >= base + (2 << 20) && b.peak_bytes < base + big as u64);
    }
    assert_eq!(log.epochs.len(), 1);
    assert_eq!(
        log.epochs[0].peak_bytes, b0.peak_bytes,
        "epoch peak survives batch-level resets"
    );
    assert_eq!(log.epochs[0].peak_phase, Phase::Forward);
    assert!(
        log.peak_bytes >= b0.peak_bytes,
        "run peak nests over the epoch peak"
    );

    // --- sizes parse and refuse nonsense.
    assert_eq!(parse_size("4GiB").unwrap(), 4 << 30);
    assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
    assert_eq!(parse_size("2GB").unwrap(), 2_000_000_000);
    assert_eq!(parse_size("1000").unwrap(), 1000);
    for bad in ["", "abc", "4XB", "-1GiB", "0", "NaN"] {
        assert!(parse_size(bad).is_err(), "{bad:?} must be refused");
    }
}
