//! The CPU probe's engine: a counting wrapper around the system allocator.
//!
//! Install it in a binary with
//! `#[global_allocator] static ALLOC: memtrain::memory::CountingAllocator = memtrain::memory::CountingAllocator;`.
//! It counts every live heap byte of the process (all threads) and the high-water mark exactly,
//! at the cost of two relaxed atomic operations per allocation.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static CURRENT: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static ACTIVE: AtomicBool = AtomicBool::new(false);
static TOTAL_ALLOCS: AtomicU64 = AtomicU64::new(0);

/// Tells the C allocator to keep freed heap memory in the process for reuse (glibc on Linux; a
/// no-op elsewhere). Idempotent; the trainer calls it when it trains on the CPU.
///
/// Candle allocates a fresh buffer for every op's output, so one training step of the default net
/// frees and re-allocates a few hundred MiB in blocks of up to 16 MiB. glibc serves blocks above
/// its mmap threshold (128 KiB, adapting up to 32 MiB) with `mmap` and returns them with `munmap`,
/// and trims the heap top on free: each step then pays page faults on every fresh page and TLB
/// shootdowns across the worker threads. Measured with `perf record` on the default step (2
/// threads): about a fifth of the step's time was spent in the kernel on these, and the step ran
/// 1.3x faster with mmap for every size up to the maximum threshold and no trimming. The cost is
/// that the process's resident set stays at its peak after a step (as a caching allocator's would);
/// the counting probe measures live bytes, so measured peaks do not change.
pub fn retain_freed_memory() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            // 32 MiB is glibc's largest accepted mmap threshold on 64-bit (HEAP_MAX_SIZE / 2);
            // larger blocks still go to mmap, which is rare enough not to matter. The trim
            // threshold has no upper bound. A rejected setting (return 0) only loses speed.
            // SAFETY: mallopt only changes allocator parameters; it is safe to call at any time.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
            }
        }
    });
}

/// Tells the C allocator to give large freed blocks back to the kernel at once (glibc on Linux;
/// a no-op elsewhere): blocks of [`LARGE_BLOCK_BYTES`] or more are mapped and unmapped one by
/// one, and the heap top is trimmed. The trainer calls it on the CPU under `--memory-limit`,
/// instead of [`retain_freed_memory`]: the limit is the process's resident memory as the kernel
/// counts it, and with freed blocks kept the resident set runs 10–35 MiB above the live heap on
/// this net (fragmentation of kept blocks), by an amount no estimate can know. Given back, it
/// stays within a few MiB of the heap ([`crate::memory::os::rss_reserve`]). The cost is the page
/// faults that [`retain_freed_memory`] avoids.
pub fn return_freed_memory() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only changes allocator parameters; it is safe to call at any time.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES as i32);
            libc::mallopt(libc::M_TRIM_THRESHOLD, LARGE_BLOCK_BYTES as i32);
        }
    });
}

/// The size from which [`return_freed_memory`] maps each block on its own.
pub const LARGE_BLOCK_BYTES: usize = 1 << 20;

/// A `GlobalAlloc` that forwards to [`System`] and counts live bytes and their peak.
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingAllocator;

#[inline]
fn add(size: usize) {
    let now = CURRENT.fetch_add(size as u64, Ordering::Relaxed) + size as u64;
    PEAK.fetch_max(now, Ordering::Relaxed);
    TOTAL_ALLOCS.fetch_add(1, Ordering::Relaxed);
    if !ACTIVE.load(Ordering::Relaxed) {
        ACTIVE.store(true, Ordering::Relaxed);
    }
}

#[inline]
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
            // Count the move as alloc-new then free-old so the peak sees both blocks, as a
            // worst case for a realloc that had to copy.
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

    /// True once this allocator has served an allocation, i.e. it is the process's global allocator.
    pub fn is_installed() -> bool {
        ACTIVE.load(Ordering::Relaxed)
    }
}
