//! The [`MemoryProbe`] trait and the probe for the CPU heap.

use super::cpu::CountingAllocator;
use super::os::{process_rss, OsMemory, OsView};

/// A source of memory readings for one device. Readings are in bytes.
///
/// `peak` is a resettable high-water mark, like `torch.cuda.max_memory_allocated` with
/// `reset_peak_memory_stats`. A probe that cannot measure reports `available() == false`
/// and zeros; callers report it as unavailable instead of failing.
pub trait MemoryProbe: Send + Sync {
    /// Short name, e.g. `cpu-heap` or `cuda-pool`.
    fn name(&self) -> &str;
    /// Whether readings are real.
    fn available(&self) -> bool;
    /// Bytes in use right now.
    fn current(&self) -> u64;
    /// High-water mark since the last reset.
    fn peak(&self) -> u64;
    /// Reset the high-water mark to the current use.
    fn reset_peak(&self);
    /// The high-water mark, and reset it: one step where the probe can (so that no allocation
    /// by another thread between the reading and the reset is lost), else `peak` then `reset_peak`.
    fn take_peak(&self) -> u64 {
        let p = self.peak();
        self.reset_peak();
        p
    }
    /// The configured hard limit or budget of what this probe counts, if any.
    fn limit(&self) -> Option<u64>;
    /// A limit on the OS view ([`MemoryProbe::os_memory`]'s current reading), if any: on the
    /// CPU, `--memory-limit` itself, which the process's resident memory must stay within.
    fn os_limit(&self) -> Option<u64> {
        None
    }
    /// Bytes reserved by the allocator (CUDA pool), if the probe knows.
    fn reserved(&self) -> Option<u64> {
        None
    }
    /// Peak bytes reserved by the allocator since the last reset, if the probe knows.
    fn reserved_peak(&self) -> Option<u64> {
        None
    }
    /// Device-wide used bytes (what nvidia-smi shows), if the probe knows.
    fn device_used(&self) -> Option<u64> {
        None
    }
    /// What the OS sees beside this probe's count ([`OsView`]), if it can be read.
    fn os_view(&self) -> Option<OsView> {
        None
    }
    /// The OS reading of [`MemoryProbe::os_view`] now.
    fn os_memory(&self) -> Option<OsMemory> {
        None
    }
    /// Wait for queued device work so readings include it.
    fn sync(&self) {}
}

/// Probe for the process heap, backed by [`CountingAllocator`].
#[derive(Debug, Clone)]
pub struct CpuProbe {
    limit: Option<u64>,
    os_limit: Option<u64>,
}

impl CpuProbe {
    /// A probe with an optional heap budget (checked by the trainer after every layer event of a
    /// step).
    pub fn new(limit: Option<u64>) -> Self {
        CpuProbe {
            limit,
            os_limit: None,
        }
    }

    /// A probe for a process that must fit `limit` as the kernel counts it (`--memory-limit`):
    /// its resident memory at most `limit`, and so its heap at most
    /// [`super::os::RssReserve::heap_budget`] of it.
    pub fn for_process_limit(limit: Option<u64>) -> Self {
        let reserve = super::os::RssReserve::of_process();
        CpuProbe {
            limit: limit.map(|l| reserve.heap_budget(l)),
            os_limit: limit,
        }
    }
}

/// The name of the CPU heap probe ([`CpuProbe`]), as outputs show it.
pub const CPU_HEAP_PROBE: &str = "cpu-heap";

impl MemoryProbe for CpuProbe {
    fn name(&self) -> &str {
        CPU_HEAP_PROBE
    }
    fn available(&self) -> bool {
        CountingAllocator::is_installed()
    }
    fn current(&self) -> u64 {
        CountingAllocator::current()
    }
    fn peak(&self) -> u64 {
        CountingAllocator::peak()
    }
    fn reset_peak(&self) {
        CountingAllocator::reset_peak()
    }
    fn take_peak(&self) -> u64 {
        CountingAllocator::take_peak()
    }
    fn limit(&self) -> Option<u64> {
        self.limit
    }
    fn os_limit(&self) -> Option<u64> {
        self.os_limit
    }
    fn os_view(&self) -> Option<OsView> {
        process_rss().map(|_| OsView::ProcessRss)
    }
    fn os_memory(&self) -> Option<OsMemory> {
        process_rss()
    }
}

/// A probe for a device memtrain cannot measure.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UnavailableProbe;

impl MemoryProbe for UnavailableProbe {
    fn name(&self) -> &str {
        "unavailable"
    }
    fn available(&self) -> bool {
        false
    }
    fn current(&self) -> u64 {
        0
    }
    fn peak(&self) -> u64 {
        0
    }
    fn reset_peak(&self) {}
    fn limit(&self) -> Option<u64> {
        None
    }
}
