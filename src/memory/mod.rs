//! Memory measurement: probes (what is live now, what was the high-water mark) for the CPU heap and
//! the CUDA memory pool, plus helpers to parse and print sizes.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod estimate;
pub mod os;
pub mod probe;
pub mod record;
pub mod select;
pub mod timeline;

pub use cpu::{retain_freed_memory, CountingAllocator};
pub use os::{OsMemory, OsView};
pub use probe::{CpuProbe, MemoryProbe};
pub use record::{BatchMemory, EpochMemory, MemoryLog, MemoryRecorder};
pub use select::probe_for;

use crate::error::{Error, Result};

/// Parse a memory size such as `4GiB`, `512MiB`, `1.5GB`, `300kB` or a plain byte count.
/// Binary (KiB/MiB/GiB/TiB) and decimal (kB/MB/GB/TB) units; `K`/`M`/`G` alone mean binary.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || {
        Error::config(format!(
            "memory size '{s}' is not a size; write a number with an optional unit, e.g. 512MiB, 4GiB, 2GB"
        ))
    };
    let value: f64 = num.parse().map_err(|_| bad())?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(bad()),
    };
    let bytes = value * mult;
    if !bytes.is_finite() || !(1.0..=1e18).contains(&bytes) {
        return Err(bad());
    }
    Ok(bytes.round() as u64)
}

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
/// allocation failure), which the trainer reports as [`Error::OutOfMemory`].
pub fn is_device_oom(e: &candle_core::Error) -> bool {
    #[cfg(feature = "cuda")]
    if cuda::is_cuda_oom(e) {
        return true;
    }
    let s = e.to_string();
    s.contains("OUT_OF_MEMORY") || s.to_ascii_lowercase().contains("out of memory")
}
