//! The allocation trace of one training step: every allocation and free the counting allocator
//! serves while a trace is on, in the order it counted them, with a mark at every layer event.
//! `export::memviz` turns it into PyTorch's memory snapshot (`memory_snapshot.pickle`).
//!
//! Why it is built like this:
//! - Off, it costs the allocator one relaxed load of [`ON`] per call and nothing else.
//! - Its buffer comes from [`System`] directly, never through the counting allocator, so its
//!   bytes are not in any peak; and the allocator hook writes into that buffer without ever
//!   allocating (a fixed capacity; entries past it are counted as dropped, and a trace with
//!   dropped entries is not written).
//! - While it is on, the allocator counts and appends under one spin lock, so the trace's order
//!   is the order of the live-byte counter across all threads: replaying it gives every value the
//!   counter had from its first entry on (its start is taken from its end, see [`end`]), and its
//!   maximum is the step's measured peak exactly.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, Ordering};

/// True while a trace records; the allocator's one check on its fast path.
pub static ON: AtomicBool = AtomicBool::new(false);

/// Entries a trace can hold: a default-width CPU step makes a few thousand allocations, so this
/// is ample, and it is only address space until written (24 bytes an entry).
pub(crate) const CAPACITY: usize = 1 << 20;

/// What one trace entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Action {
    /// A block of `size` bytes at `addr` was allocated.
    Alloc,
    /// The block of `size` bytes at `addr` was freed.
    Free,
    /// A layer event of the step was recorded here (the step timeline's next event).
    Mark,
}

/// One entry of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct TraceEntry {
    /// Address of the block (0 for a mark).
    pub addr: u64,
    /// Bytes of the block (0 for a mark).
    pub size: u64,
    /// Allocation, free or layer-event mark.
    pub action: Action,
}

/// The entries of a trace in the buffer the trace wrote them into: still [`System`]'s, so that
/// taking a trace allocates nothing the step's peak could count.
struct SystemEntries {
    ptr: *mut TraceEntry,
    cap: usize,
    len: usize,
}

// SAFETY: the buffer is owned by this value alone once the trace has ended.
unsafe impl Send for SystemEntries {}

impl Drop for SystemEntries {
    fn drop(&mut self) {
        // SAFETY: allocated in `begin` with this layout; owned by this value alone.
        unsafe { System.dealloc(self.ptr as *mut u8, layout(self.cap)) };
    }
}

/// Where a trace's entries live.
enum Entries {
    System(SystemEntries),
    Owned(Vec<TraceEntry>),
}

/// A finished trace, taken by `CountingAllocator::stop_trace` (or made by [`Trace::new`]).
pub struct Trace {
    /// Live heap bytes when the trace started: the end less the traced allocations plus the
    /// traced frees (see [`end`] for why it is not read at the start).
    pub start_bytes: u64,
    /// Live heap bytes when it stopped (`start_bytes` plus the allocations less the frees).
    pub end_bytes: u64,
    /// Entries lost because the buffer was full (the trace is then incomplete).
    pub dropped: usize,
    entries: Entries,
}

impl std::fmt::Debug for Trace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trace")
            .field("start_bytes", &self.start_bytes)
            .field("end_bytes", &self.end_bytes)
            .field("dropped", &self.dropped)
            .field("entries", &self.entries().len())
            .finish()
    }
}

impl Trace {
    /// A trace of `entries` from `start_bytes` (for tests and tools; the allocator makes its own).
    pub fn new(start_bytes: u64, entries: Vec<TraceEntry>) -> Self {
        let mut t = Trace {
            start_bytes,
            end_bytes: start_bytes,
            dropped: 0,
            entries: Entries::Owned(entries),
        };
        t.end_bytes = (start_bytes as i128 + t.net_bytes()).max(0) as u64;
        t
    }

    /// The traced allocations less the traced frees.
    fn net_bytes(&self) -> i128 {
        self.entries()
            .iter()
            .map(|e| match e.action {
                Action::Alloc => e.size as i128,
                Action::Free => -(e.size as i128),
                Action::Mark => 0,
            })
            .sum()
    }

    /// The entries in the order the allocator counted them.
    pub fn entries(&self) -> &[TraceEntry] {
        match &self.entries {
            // SAFETY: the first `len` entries were written by `push` before the trace ended.
            Entries::System(s) => unsafe { std::slice::from_raw_parts(s.ptr, s.len) },
            Entries::Owned(v) => v,
        }
    }

    /// The highest live bytes while the trace ran: the start, then every value the counter took.
    pub fn peak_bytes(&self) -> u64 {
        let (mut now, mut peak) = (self.start_bytes as i128, self.start_bytes as i128);
        for e in self.entries() {
            match e.action {
                Action::Alloc => now += e.size as i128,
                Action::Free => now -= e.size as i128,
                Action::Mark => {}
            }
            peak = peak.max(now);
        }
        peak.max(0) as u64
    }
}

/// The trace buffer the lock guards.
pub(crate) struct Buffer {
    ptr: *mut TraceEntry,
    cap: usize,
    len: usize,
    dropped: usize,
}

impl Buffer {
    /// Append an entry (never allocates); a full buffer counts it as dropped.
    pub(crate) fn push(&mut self, action: Action, addr: u64, size: u64) {
        if self.ptr.is_null() {
            return;
        }
        if self.len < self.cap {
            // SAFETY: `ptr` holds `cap` entries (allocated in `begin`) and `len < cap`.
            unsafe {
                self.ptr
                    .add(self.len)
                    .write(TraceEntry { addr, size, action })
            };
            self.len += 1;
        } else {
            self.dropped += 1;
        }
    }
}

struct Locked {
    busy: AtomicBool,
    buf: UnsafeCell<Buffer>,
}

// SAFETY: `buf` is only reached through `locked`, which holds `busy` exclusively.
unsafe impl Sync for Locked {}

static TRACE: Locked = Locked {
    busy: AtomicBool::new(false),
    buf: UnsafeCell::new(Buffer {
        ptr: std::ptr::null_mut(),
        cap: 0,
        len: 0,
        dropped: 0,
    }),
};

/// Run `f` with the buffer under the trace's spin lock. `f` must not allocate through the
/// global allocator (the allocator itself takes this lock while a trace is on).
pub(crate) fn locked<R>(f: impl FnOnce(&mut Buffer) -> R) -> R {
    while TRACE
        .busy
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        std::hint::spin_loop();
    }
    // SAFETY: the lock is held, so this is the only reference to the buffer.
    let r = f(unsafe { &mut *TRACE.buf.get() });
    TRACE.busy.store(false, Ordering::Release);
    r
}

fn layout(cap: usize) -> Layout {
    Layout::array::<TraceEntry>(cap).expect("the trace capacity fits a layout")
}

/// Give the buffer `CAPACITY` entries from [`System`] and turn the trace on; `under_lock` runs
/// under the same lock first (the allocator reads its counters there). False when a trace is
/// already on or the buffer cannot be had.
pub(crate) fn begin(under_lock: impl FnOnce()) -> bool {
    // SAFETY: a non-zero layout; the block is freed in `end` with the same layout.
    let ptr = unsafe { System.alloc(layout(CAPACITY)) } as *mut TraceEntry;
    if ptr.is_null() {
        return false;
    }
    let started = locked(|b| {
        if !b.ptr.is_null() {
            return false;
        }
        *b = Buffer {
            ptr,
            cap: CAPACITY,
            len: 0,
            dropped: 0,
        };
        under_lock();
        ON.store(true, Ordering::Relaxed);
        true
    });
    if !started {
        // SAFETY: allocated above with this layout and never shared.
        unsafe { System.dealloc(ptr as *mut u8, layout(CAPACITY)) };
    }
    started
}

/// Turn the trace off and take it; `under_lock` runs under the lock first, at the moment the
/// trace ends, and gives the live bytes then. `None` when no trace was on. Allocates nothing:
/// the entries stay in the trace's own buffer.
///
/// The start is the end less what the trace added: an allocator call on another thread that
/// read [`ON`] just before the trace began counts its bytes after the start was read, untraced,
/// but every call after that is traced under the lock, so the end is exact and the start taken
/// from it makes the replay equal the counter from the first traced entry on.
pub(crate) fn end(under_lock: impl FnOnce() -> u64) -> Option<Trace> {
    let (r, buf) = locked(|b| {
        let r = under_lock();
        ON.store(false, Ordering::Relaxed);
        let taken = Buffer {
            ptr: b.ptr,
            cap: b.cap,
            len: b.len,
            dropped: b.dropped,
        };
        b.ptr = std::ptr::null_mut();
        (r, taken)
    });
    if buf.ptr.is_null() {
        return None;
    }
    let mut trace = Trace {
        start_bytes: r,
        end_bytes: r,
        dropped: buf.dropped,
        entries: Entries::System(SystemEntries {
            ptr: buf.ptr,
            cap: buf.cap,
            len: buf.len,
        }),
    };
    trace.start_bytes = (r as i128 - trace.net_bytes()).max(0) as u64;
    Some(trace)
}

/// Mark a layer event in the trace (the step timeline's next event); nothing when off.
pub fn mark() {
    if ON.load(Ordering::Relaxed) {
        locked(|b| b.push(Action::Mark, 0, 0));
    }
}
