//! The counting allocator's trace (memory_snapshot.pickle's source): every allocation, free and
//! in-place resize in counting order, its own buffer outside the count, and the counter's peak
//! equal to the trace's replayed peak.
//!
//! One test function on purpose: the counters are process-wide, and the test harness runs test
//! functions on parallel threads that would allocate in the middle of a measurement.

use memtrain_core::memory::trace::{mark, Action};
use memtrain_core::memory::CountingAllocator;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[test]
fn the_trace_records_every_allocation_in_counting_order() {
    // Installed once it has served an allocation.
    drop(vec![0u8; 1]);
    assert!(CountingAllocator::is_installed());
    let before = CountingAllocator::current();
    assert!(CountingAllocator::start_trace());
    assert!(!CountingAllocator::start_trace(), "one trace at a time");
    assert_eq!(
        CountingAllocator::current(),
        before,
        "the trace's own buffer is not counted"
    );
    assert_eq!(
        CountingAllocator::peak(),
        before,
        "starting resets the peak"
    );

    let big = vec![1u8; 3 << 20];
    mark();
    let mut grown: Vec<u64> = Vec::with_capacity(1000);
    grown.extend(0..1000);
    grown.reserve_exact(500_000);
    drop(big);
    mark();
    let peak = CountingAllocator::peak();
    let trace = CountingAllocator::stop_trace().expect("a trace was on");
    assert!(CountingAllocator::stop_trace().is_none());
    let end = CountingAllocator::current();
    drop(grown);

    assert_eq!(trace.start_bytes, before);
    assert_eq!(trace.end_bytes, end);
    assert_eq!(trace.dropped, 0);
    assert_eq!(
        trace.peak_bytes(),
        peak,
        "the replayed peak is the counter's"
    );
    let e = trace.entries();
    let at = |a: Action, size: u64| e.iter().position(|x| x.action == a && x.size == size);
    let (alloc_big, free_big) = (at(Action::Alloc, 3 << 20), at(Action::Free, 3 << 20));
    assert!(alloc_big.is_some() && free_big > alloc_big, "{e:?}");
    let marks: Vec<usize> = (0..e.len())
        .filter(|i| e[*i].action == Action::Mark)
        .collect();
    assert_eq!(marks.len(), 2);
    assert!(alloc_big < Some(marks[0]) && free_big > Some(marks[0]));
    assert!(free_big < Some(marks[1]));
    // The grown vector's old block was freed (moved or resized in place) and the new one
    // allocated, with the old size freed after or at the new one's address.
    let new = at(Action::Alloc, 501_000 * 8).expect("the grown block");
    assert!(at(Action::Free, 1000 * 8).is_some());
    let replay = e.iter().fold(before as i128, |n, x| match x.action {
        Action::Alloc => n + x.size as i128,
        Action::Free => n - x.size as i128,
        Action::Mark => n,
    });
    assert_eq!(replay, end as i128, "the entries add up to the end");
    assert!(new > marks[0]);
}
