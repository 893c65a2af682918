//! Memory measurement: probes (what is live now, what was the high-water mark) for the CPU heap and
//! the CUDA memory pool, plus helpers to print sizes.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod os;
pub mod probe;
pub mod record;
pub mod select;
pub mod timeline;
pub mod trace;

pub use cpu::{retain_freed_memory, return_freed_memory, CountingAllocator};
pub use os::{OsMemory, OsView};
pub use probe::{CpuProbe, MemoryProbe, CPU_HEAP_PROBE};
pub use record::{
    BatchMemory, EpochMemory, EpochSteps, MemoryLog, MemoryRecorder, PHASE_OTHER_NOTE,
};
pub use select::probe_for;

/// Format bytes with a binary unit, e.g. `12.34 MiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// Bytes as MiB (for tables and charts).
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// True when a Candle error is a device out-of-memory (CUDA_ERROR_OUT_OF_MEMORY or an
/// allocation failure), which the trainer reports as [`crate::Error::OutOfMemory`].
pub fn is_device_oom(e: &candle_core::Error) -> bool {
    #[cfg(feature = "cuda")]
    if cuda::is_cuda_oom(e) {
        return true;
    }
    let s = e.to_string();
    s.contains("OUT_OF_MEMORY") || s.to_ascii_lowercase().contains("out of memory")
}
