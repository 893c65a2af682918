//! A counting global allocator for the benches that report an op's heap scratch (bench code, not
//! part of the library): live heap bytes of the process and their high-water mark, at two relaxed
//! atomic operations per allocation.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

static CURRENT: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

/// A `GlobalAlloc` that forwards to [`System`] and counts live bytes and their peak.
pub struct CountingAllocator;

fn add(size: usize) {
    let now = CURRENT.fetch_add(size as u64, Ordering::Relaxed) + size as u64;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

fn sub(size: usize) {
    CURRENT.fetch_sub(size as u64, Ordering::Relaxed);
}

// SAFETY: every method forwards to `System` with the caller's layout unchanged; the counters
// are plain atomics and never allocate.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            add(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            add(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        sub(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            // Alloc-new then free-old, so the peak sees both blocks (a realloc that copied).
            add(new_size);
            sub(layout.size());
        }
        p
    }
}

impl CountingAllocator {
    /// Live heap bytes right now.
    pub fn current() -> u64 {
        CURRENT.load(Ordering::Relaxed)
    }

    /// High-water mark of live heap bytes since the last [`CountingAllocator::reset_peak`].
    pub fn peak() -> u64 {
        PEAK.load(Ordering::Relaxed)
    }

    /// Set the high-water mark to the current live bytes.
    pub fn reset_peak() {
        PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}
