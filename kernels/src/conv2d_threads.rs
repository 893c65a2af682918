//! How the CPU halves of [`super::conv2d`] share their work out: the thread counts, the
//! per-thread scratch sets made before a parallel section starts ([`ThreadSets`]), the per-image
//! and per-chunk dispatch onto Candle's CPU pool ([`per_image`], [`par_chunks`]) and the sum of
//! per-chunk partial results in a fixed order ([`OrderedSum`]), which keeps every run bit-for-bit
//! reproducible. Used by `conv2d_cpu.rs` and `conv2d_bf16.rs`.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

use super::util::{Acc, Float};

/// Threads that run the per-image work: candle's CPU pool workers plus the calling thread.
pub(super) fn num_threads() -> usize {
    candle_core::utils::barrier_pool().n_workers() + 1
}

/// Threads that get work when `items` work items are shared out by [`par_chunks`] (one item
/// each) on `threads` threads: one when there is at most one item (it runs on the calling
/// thread), else at most one per item.
pub(super) fn busy_threads(items: usize, threads: usize) -> usize {
    if items <= 1 {
        items
    } else {
        threads.clamp(1, items)
    }
}

/// One thread's set (its scratch and its gemm reservation) until a thread takes it.
type ThreadSet<S> = Mutex<Option<(S, Vec<u8>)>>;

/// The scratch of a parallel section's threads, made in full on the calling thread before the
/// section starts (one set per thread that can get work, [`busy_threads`]) and handed out as
/// the threads take their first item.
///
/// Made lazily on each thread instead, the sets of two threads were alive at once or one after
/// the other depending on when the second thread got going, so the op's peak depended on the
/// scheduling (by a set, a few hundred KiB at test sizes). Made up front, every set is alive
/// from the start of the section to its end, and the peak is the same on every run.
///
/// Each set also holds `reserve` bytes for the `gemm` crate's packing buffer (see
/// [`crate::util::gemm_packing_bytes`]), which gemm allocates inside every product, where no one can hand
/// it ours: a thread frees its reservation when it takes its set, before its first product, so
/// the bytes in use while the threads run never exceed those at the start of the section,
/// whether or not their products overlap.
pub(super) struct ThreadSets<S> {
    sets: Vec<ThreadSet<S>>,
    taken: AtomicUsize,
}

impl<S> ThreadSets<S> {
    /// Heap bytes of the records of `busy` sets (the vector the sets wait in), besides the
    /// buffers the sets hold.
    pub(super) fn record_bytes(busy: usize) -> usize {
        busy * std::mem::size_of::<ThreadSet<S>>()
    }
}

impl<S: Send> ThreadSets<S> {
    /// `busy` sets made by `make`, each with a reservation of `reserve` bytes.
    pub(super) fn new(busy: usize, reserve: usize, make: impl Fn() -> S) -> Self {
        let sets = (0..busy)
            .map(|_| Mutex::new(Some((make(), Vec::with_capacity(reserve)))))
            .collect();
        Self {
            sets,
            taken: AtomicUsize::new(0),
        }
    }

    /// A set for the calling thread, which then owns it (and frees it, on itself, when done),
    /// its reservation freed; called once per thread, at its first item (so no more often than
    /// there are sets).
    pub(super) fn take(&self) -> S {
        let i = self.taken.fetch_add(1, Ordering::Relaxed);
        let mut slot = self.sets[i].lock().unwrap_or_else(|e| e.into_inner());
        let (set, _reservation) = slot.take().expect("conv2d: a thread set taken twice");
        set
    }
}

// ---------------------------------------------------------------------------------------------
// Threading

/// One output buffer that the worker threads fill in disjoint per-image slices ([`per_image`]).
struct SharedOut<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: the buffer outlives the parallel section (it is borrowed for the `SharedOut`'s life) and
// every image index is handed to exactly one thread by the shared cursor in `par_chunks`.
unsafe impl<T: Send> Sync for SharedOut<T> {}
unsafe impl<T: Send> Send for SharedOut<T> {}

impl<T> SharedOut<T> {
    /// A buffer of `len` elements in the spare capacity of the empty `buf`, for the threads to
    /// initialize slice by slice with [`Self::zeroed`]; the caller sets `buf`'s length once every
    /// slice has been taken.
    ///
    /// Zeroing the output up front (`vec![0; len]`) is one thread writing a whole activation while
    /// the others wait, and then every byte is overwritten anyway (the gemm overwrites, col2im
    /// starts from zero); zeroing each image's slice on the thread that fills it next keeps that
    /// write parallel and in cache. (A fresh `vec!` of zeros was free only while glibc returned
    /// large blocks to the kernel, which cost more in page faults: memtrain's
    /// `memory::retain_freed_memory`.)
    fn spare(buf: &mut Vec<T>, len: usize) -> Self {
        assert!(buf.is_empty(), "conv2d: output buffer not empty");
        buf.reserve_exact(len);
        Self {
            ptr: buf.as_mut_ptr(),
            len,
        }
    }

    /// `len` elements from `start`, set to all-zero bits first (0.0 in every float type the op
    /// supports), so the slice is initialized whether or not it came from [`Self::spare`].
    ///
    /// # Safety
    /// No two live slices may overlap; `T` must be a type whose all-zero bit pattern is valid.
    #[allow(clippy::mut_from_ref)]
    unsafe fn zeroed(&self, start: usize, len: usize) -> &mut [T] {
        assert!(
            start + len <= self.len,
            "conv2d: output slice out of bounds"
        );
        std::ptr::write_bytes(self.ptr.add(start), 0, len);
        std::slice::from_raw_parts_mut(self.ptr.add(start), len)
    }
}

/// Runs `body` on every thread of candle's CPU pool; each call pulls chunks of `chunk` items
/// (ranges of `0..n`) from a shared cursor until none are left. A shared cursor rather than a
/// static split lets a thread that was descheduled catch up.
///
/// Which thread gets which chunk depends on scheduling, so `body` must not combine values across
/// chunks in the order it sees them (floating-point sums would then differ from run to run): it
/// writes each item's result to its own place, or hands partial sums to an [`OrderedSum`].
pub(super) fn par_chunks<F>(n: usize, chunk: usize, body: F)
where
    F: Fn(&mut dyn Iterator<Item = Range<usize>>) + Sync,
{
    let chunk = chunk.max(1);
    let cursor = AtomicUsize::new(0);
    let run = |_tid: usize| {
        let mut chunks = std::iter::from_fn(|| {
            let start = cursor.fetch_add(chunk, Ordering::Relaxed);
            (start < n).then(|| start..(start + chunk).min(n))
        });
        body(&mut chunks);
    };
    let pool = candle_core::utils::barrier_pool();
    if pool.n_workers() == 0 || n <= chunk {
        run(0);
    } else {
        pool.execute(run);
    }
}

/// The results of `n` images, `len` elements each, computed in parallel: `fill(scratch, i, dst)`
/// writes image `i`'s result into `dst` (zeroed first) on whichever thread takes the image.
/// `make_scratch()` makes one thread's buffers at their full size, for every thread that can get
/// an image, before the threads start ([`ThreadSets`], with `reserve` bytes for gemm's packing).
/// The forward and input-gradient passes (here and in [`super::conv2d_bf16`]) are each one call
/// of this.
pub(super) fn per_image<T: Float, S: Send>(
    n: usize,
    len: usize,
    reserve: usize,
    make_scratch: impl Fn() -> S,
    fill: impl Fn(&mut S, usize, &mut [T]) + Sync,
) -> Vec<T> {
    let mut out = Vec::new();
    let shared = SharedOut::spare(&mut out, n * len);
    let sets = ThreadSets::new(busy_threads(n, num_threads()), reserve, make_scratch);
    par_chunks(n, 1, |chunks| {
        let mut set = None;
        for i in chunks.flatten() {
            let scratch = set.get_or_insert_with(|| sets.take());
            // SAFETY: image `i` is handed to this thread only; a float type's zero bits are 0.0.
            let dst = unsafe { shared.zeroed(i * len, len) };
            fill(scratch, i, dst);
        }
    });
    drop(sets);
    // SAFETY: `par_chunks` hands out every image, and each image's slice was initialized by
    // `zeroed` (a panic in a thread propagates before this line).
    unsafe { out.set_len(n * len) };
    out
}

/// A sum of `slots` weight-sized partial sums that adds them in slot order — `((p₀ + p₁) + p₂) + …`
/// — whatever order the threads finish them in, so that the result is bit-for-bit the same on
/// every run.
///
/// A finished partial is added as soon as every earlier slot has been, and its buffer is then
/// reused for a later slot; partials only wait while an earlier slot is still being computed.
/// The buffers are made up front, a fixed number of them ([`partial_buffers`]: the running total,
/// one per thread and a spare), so the bytes they hold do not depend on the scheduling: a
/// thread that runs out of buffers because an earlier slot is still being computed waits for
/// one instead of allocating another (before, the partials of a stalled thread's later slots
/// piled up, one per slot).
pub(super) struct OrderedSum<A> {
    len: usize,
    state: Mutex<SumState<A>>,
    /// Signalled when a buffer is freed or the last slot is added.
    freed: Condvar,
}

struct SumState<A> {
    /// The first slot not yet added to `total`.
    next: usize,
    total: Option<Vec<A>>,
    /// Set when a thread panicked: no more buffers are handed out.
    abandoned: bool,
    /// Finished partials waiting for an earlier slot, by slot.
    waiting: Vec<Option<Vec<A>>>,
    /// Buffers free for the next slots (allocated, not yet initialized before their first use).
    free: Vec<Vec<A>>,
}

/// Partial-sum buffers of the weight gradient for `slots` slots on `threads` threads, at most one
/// per slot: the running total (the first slot's buffer), one per thread, and one spare, so that
/// a thread that finishes a slot while an earlier one is still being computed can start the
/// next instead of waiting (measured on a loaded 2-core machine: without the spare, a thread
/// waited a third of the default net's last weight-gradient pass; with it, almost never).
pub(super) fn partial_buffers(slots: usize, threads: usize) -> usize {
    slots.min(threads + 2)
}

impl<A> OrderedSum<A> {
    /// The buffers a sum of `slots` slots makes when `buffers` are asked for: at least one when
    /// there is a slot.
    fn buffer_count(slots: usize, buffers: usize) -> usize {
        if slots > 0 {
            buffers.max(1)
        } else {
            0
        }
    }

    /// Heap bytes of the records of a sum of `slots` slots with `buffers` buffers (the slots'
    /// waiting list and the free list), besides the partials' elements.
    pub(super) fn record_bytes(slots: usize, buffers: usize) -> usize {
        slots * std::mem::size_of::<Option<Vec<A>>>()
            + Self::buffer_count(slots, buffers) * std::mem::size_of::<Vec<A>>()
    }
}

impl<A: Acc> OrderedSum<A> {
    /// A sum of `slots` partials of `len` elements, with `buffers` buffers (at least one when
    /// there is a slot).
    pub(super) fn new(slots: usize, len: usize, buffers: usize) -> Self {
        let buffers = Self::buffer_count(slots, buffers);
        Self {
            len,
            state: Mutex::new(SumState {
                next: 0,
                total: None,
                abandoned: false,
                waiting: (0..slots).map(|_| None).collect(),
                free: (0..buffers).map(|_| Vec::with_capacity(len)).collect(),
            }),
            freed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SumState<A>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A buffer of `len` elements for one slot's partial (stale contents), waiting until one is
    /// free; `None` once every slot has been added.
    ///
    /// Take the buffer before taking the slot: a thread that holds a slot then always has its
    /// buffer, so the first slot not yet added is always being computed, and a waiting thread
    /// always gets a buffer when it is added.
    pub(super) fn buffer(&self) -> Option<Vec<A>> {
        let mut st = self.lock();
        let mut buf = loop {
            if let Some(b) = st.free.pop() {
                break b;
            }
            if st.next == st.waiting.len() || st.abandoned {
                return None;
            }
            st = self.freed.wait(st).unwrap_or_else(|e| e.into_inner());
        };
        drop(st);
        // The first use of a buffer fills it, on the thread that uses it.
        buf.resize(self.len, A::ZERO);
        Some(buf)
    }

    /// A guard for one thread's part of the sum: if the thread panics, the guard's drop wakes the
    /// threads waiting for a buffer (which then get none), so the panic reaches the caller
    /// instead of leaving them waiting for a slot that will never be added.
    pub(super) fn guard(&self) -> SumGuard<'_, A> {
        SumGuard(self)
    }

    /// Returns a buffer taken with [`Self::buffer`] that got no slot.
    pub(super) fn give_back(&self, buf: Vec<A>) {
        self.lock().free.push(buf);
        self.freed.notify_all();
    }

    /// Hands over the partial sum of `slot`.
    pub(super) fn add(&self, slot: usize, partial: Vec<A>) {
        let mut guard = self.lock();
        let st = &mut *guard;
        assert!(
            st.waiting[slot].replace(partial).is_none(),
            "conv2d: weight-gradient slot {slot} summed twice"
        );
        while let Some(p) = st.waiting.get_mut(st.next).and_then(Option::take) {
            match &mut st.total {
                None => st.total = Some(p),
                Some(total) => {
                    for (t, v) in total.iter_mut().zip(&p) {
                        *t += *v;
                    }
                    st.free.push(p);
                }
            }
            st.next += 1;
        }
        drop(guard);
        self.freed.notify_all();
    }

    /// The sum of all slots (`None` when there were none); the other buffers are freed first.
    pub(super) fn total(self) -> Option<Vec<A>> {
        let st = self.state.into_inner().unwrap_or_else(|e| e.into_inner());
        assert_eq!(
            st.next,
            st.waiting.len(),
            "conv2d: a weight-gradient slot was never summed"
        );
        drop(st.free);
        st.total
    }
}

/// See [`OrderedSum::guard`].
pub(super) struct SumGuard<'a, A: Acc>(&'a OrderedSum<A>);

impl<A: Acc> Drop for SumGuard<'_, A> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.lock().abandoned = true;
            self.0.freed.notify_all();
        }
    }
}
