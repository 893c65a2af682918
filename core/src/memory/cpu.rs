//! The CPU probe's engine: a counting wrapper around the system allocator.
//!
//! Install it in a binary with
//! `#[global_allocator] static ALLOC: memtrain_core::memory::CountingAllocator = memtrain_core::memory::CountingAllocator;`.
//! It counts every live heap byte of the process (all threads) and the high-water mark exactly,
//! at the cost of a few relaxed atomic operations per allocation, one of them the load that tells
//! whether a step's allocations are being traced ([`super::trace`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::trace::{self, Action, Trace};

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
/// stays within a few MiB of the heap ([`crate::memory::os::RssReserve`]). The cost is the page
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

/// An allocation counted (and traced while a trace is on) after `System` served it.
#[inline]
fn counted_alloc(layout: Layout, zeroed: bool) -> *mut u8 {
    let serve = || {
        // SAFETY: the caller's layout, unchanged (GlobalAlloc's contract holds for it).
        let p = unsafe {
            if zeroed {
                System.alloc_zeroed(layout)
            } else {
                System.alloc(layout)
            }
        };
        if !p.is_null() {
            add(layout.size());
        }
        p
    };
    if !trace::ON.load(Ordering::Relaxed) {
        return serve();
    }
    trace::locked(|b| {
        let p = serve();
        if !p.is_null() {
            b.push(Action::Alloc, p as u64, layout.size() as u64);
        }
        p
    })
}

// SAFETY: every method forwards to `System` with the caller's layout unchanged; the counters
// are plain atomics and the trace writes into a buffer it owns: neither allocates.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        counted_alloc(layout, false)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        counted_alloc(layout, true)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !trace::ON.load(Ordering::Relaxed) {
            System.dealloc(ptr, layout);
            sub(layout.size());
            return;
        }
        trace::locked(|b| {
            System.dealloc(ptr, layout);
            sub(layout.size());
            b.push(Action::Free, ptr as u64, layout.size() as u64);
        })
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let resize = |b: Option<&mut trace::Buffer>| {
            let p = System.realloc(ptr, layout, new_size);
            if p.is_null() {
                return p;
            }
            let (old, new) = (layout.size() as u64, new_size as u64);
            if p == ptr {
                // Grown or shrunk in place: the old and the new block were never both alive.
                if new >= old {
                    add((new - old) as usize);
                } else {
                    sub((old - new) as usize);
                }
                if let Some(b) = b {
                    b.push(Action::Free, ptr as u64, old);
                    b.push(Action::Alloc, p as u64, new);
                }
            } else {
                // Moved: count alloc-new then free-old so the peak sees both blocks, as they
                // were while the contents were copied.
                add(new_size);
                sub(layout.size());
                if let Some(b) = b {
                    b.push(Action::Alloc, p as u64, new);
                    b.push(Action::Free, ptr as u64, old);
                }
            }
            p
        };
        if !trace::ON.load(Ordering::Relaxed) {
            return resize(None);
        }
        trace::locked(|b| resize(Some(b)))
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
        let reset = || PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
        if trace::ON.load(Ordering::Relaxed) {
            // Under the trace's lock, so that no traced allocation's peak falls between the
            // load and the store: the peak then is exactly the trace's.
            trace::locked(|_| reset());
        } else {
            reset();
        }
    }

    /// The high-water mark, and reset it to the current live bytes. While a trace is on, both in
    /// one step under its lock, so that the trace's peak and the readings' agree exactly.
    pub fn take_peak() -> u64 {
        let take = || PEAK.swap(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
        if trace::ON.load(Ordering::Relaxed) {
            trace::locked(|_| take())
        } else {
            take()
        }
    }

    /// Start tracing every allocation and free ([`super::trace`]) and reset the high-water mark,
    /// both at one moment; false when a trace is already on or its buffer cannot be had.
    pub fn start_trace() -> bool {
        trace::begin(|| {
            let now = CURRENT.load(Ordering::Relaxed);
            PEAK.store(now, Ordering::Relaxed);
        })
    }

    /// Stop the trace and take it; `None` when none was on.
    pub fn stop_trace() -> Option<Trace> {
        trace::end(|| CURRENT.load(Ordering::Relaxed))
    }

    /// True once this allocator has served an allocation, i.e. it is the process's global allocator.
    pub fn is_installed() -> bool {
        ACTIVE.load(Ordering::Relaxed)
    }
}
