//! What the operating system (or the driver) sees, beside the allocator's own count: the view
//! that `psutil` and `nvidia-smi` give.
//!
//! The probes count the bytes the training step allocates. The OS view is coarser and larger:
//! on the CPU the process's resident pages (`VmRSS`, and its kernel-kept high-water mark
//! `VmHWM`, from `/proc/self/status`), on CUDA the device-wide use (`cuMemGetInfo`). memtrain
//! records both side by side per step and per epoch; [`OsView::explain`] says in one sentence
//! each why they differ.

use serde::{Deserialize, Serialize};

/// One OS reading: bytes now and the highest seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OsMemory {
    /// Bytes in use now.
    pub current: u64,
    /// Highest bytes in use: the kernel's high-water mark since process start (CPU), or the
    /// highest device-wide reading taken so far (CUDA, where the driver keeps none).
    pub peak: u64,
}

/// Which OS view a probe reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OsView {
    /// The process's resident set (Linux `/proc/self/status`).
    ProcessRss,
    /// Memory in use on the whole GPU (`cuMemGetInfo`, what nvidia-smi shows).
    DeviceWide,
}

impl OsView {
    /// Column heading for reports.
    pub fn heading(&self) -> &'static str {
        match self {
            OsView::ProcessRss => "RSS",
            OsView::DeviceWide => "device-wide",
        }
    }

    /// One sentence each on what the allocator peak and this view measure, for the reports.
    /// The view tells the allocator: the CPU heap probe reports the process's RSS, the CUDA pool
    /// probe the device-wide view ([`crate::memory::MemoryProbe::os_view`]).
    pub(crate) fn explain(&self) -> String {
        let (allocator, os) = match self {
            OsView::ProcessRss => (
                "heap peak: the most bytes the process's allocations held at once (counted at \
                 every malloc and free), what the training step itself needs",
                "RSS: the process's pages resident in physical memory as the kernel sees them \
                 (peak = VmHWM since start); it adds the binary, thread stacks and freed pages the \
                 allocator has not returned, so it is usually above the heap and falls slower",
            ),
            OsView::DeviceWide => (
                "pool peak: the most bytes the step's tensors held in the CUDA memory pool at once \
                 (USED_MEM_HIGH), what the training step itself needs",
                "device-wide: all memory in use on the GPU (what nvidia-smi shows); it adds the \
                 pool's reserve, the CUDA context, cuBLAS/cuDNN workspaces and other processes",
            ),
        };
        format!("{allocator}.\n{os}.\n")
    }
}

/// The process's resident set now and its high-water mark, from `/proc/self/status`; `None`
/// where that file does not exist (not Linux) or lacks the fields.
pub fn process_rss() -> Option<OsMemory> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_status(&text)
}

/// `VmRSS` and `VmHWM` (reported in kB) of a `/proc/<pid>/status` text, in bytes.
pub fn parse_status(text: &str) -> Option<OsMemory> {
    let current = kb_field(text, "VmRSS:")?;
    let peak = kb_field(text, "VmHWM:")?.max(current);
    Some(OsMemory { current, peak })
}

/// How much more memory this process can allocate, and which limit says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Headroom {
    /// Bytes the process can still allocate.
    pub bytes: u64,
    /// The limit that gives `bytes`, for messages, e.g. `MemAvailable in /proc/meminfo`.
    pub source: &'static str,
}

/// The tightest of the limits on what this process can still allocate: the machine's available
/// memory (`MemAvailable` in `/proc/meminfo`: free memory plus caches the kernel can drop, what
/// can be used without swapping), the room left in its cgroup (the limit less its
/// [`working_set`]), and the room left under its address-space and data-segment limits
/// (`ulimit -v`/`-d`: the limit less `VmSize`/`VmData` and what the run's threads will reserve).
/// `None` where none can be read (not Linux).
pub fn headroom() -> Option<Headroom> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let status = read("/proc/self/status").unwrap_or_default();
    let mut best: Option<Headroom> = None;
    let mut offer = |bytes: Option<u64>, source: &'static str| {
        if let Some(bytes) = bytes {
            if best.as_ref().is_none_or(|b| bytes < b.bytes) {
                best = Some(Headroom { bytes, source });
            }
        }
    };
    offer(
        read("/proc/meminfo").and_then(|t| kb_field(&t, "MemAvailable:")),
        "MemAvailable in /proc/meminfo",
    );
    let cgroup_room = || -> Option<u64> {
        // cgroup v2: the process's group is the one line `0::/path` of /proc/self/cgroup.
        let rel = read("/proc/self/cgroup")?
            .lines()
            .find_map(|l| l.strip_prefix("0::").map(str::to_string))?;
        let dir = std::path::Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/'));
        let value = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
        let max: u64 = value("memory.max")?.trim().parse().ok()?; // "max": no limit
        let current: u64 = value("memory.current")?.trim().parse().ok()?;
        let stat = value("memory.stat").unwrap_or_default();
        Some(max.saturating_sub(working_set(current, &stat, "inactive_file")))
    };
    offer(cgroup_room(), "the cgroup's memory.max");
    // cgroup v1: the memory controller's line `N:memory:/path`.
    let cgroup_v1_room = || -> Option<u64> {
        let rel = read("/proc/self/cgroup")?
            .lines()
            .find_map(|l| l.split_once(":memory:").map(|(_, p)| p.to_string()))?;
        let dir = std::path::Path::new("/sys/fs/cgroup/memory").join(rel.trim_start_matches('/'));
        let value = |f: &str| -> Option<u64> {
            std::fs::read_to_string(dir.join(f))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
        let used = working_set(
            value("memory.usage_in_bytes")?,
            &stat,
            "total_inactive_file",
        );
        Some(value("memory.limit_in_bytes")?.saturating_sub(used))
    };
    offer(cgroup_v1_room(), "the cgroup's memory.limit_in_bytes");
    for (resource, used, source) in [
        (
            libc::RLIMIT_AS,
            "VmSize:",
            "the address-space limit (ulimit -v)",
        ),
        (
            libc::RLIMIT_DATA,
            "VmData:",
            "the data-segment limit (ulimit -d)",
        ),
    ] {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit only writes the struct it is given.
        let ok = unsafe { libc::getrlimit(resource, &mut lim) } == 0;
        if ok && lim.rlim_cur != libc::RLIM_INFINITY {
            let used = kb_field(&status, used).unwrap_or(0) + thread_reserve();
            offer(Some(lim.rlim_cur.saturating_sub(used)), source);
        }
    }
    best
}

/// A cgroup's `usage` less the clean file cache its `memory.stat` text lists under `inactive`,
/// which the kernel reclaims before it kills anything: its working set, as the kernel and docker
/// count it.
pub fn working_set(usage: u64, stat: &str, inactive: &str) -> u64 {
    let cache = stat.lines().find_map(|l| {
        let (key, value) = l.split_once(' ')?;
        (key == inactive)
            .then(|| value.trim().parse().ok())
            .flatten()
    });
    usage.saturating_sub(cache.unwrap_or(0))
}

/// Address space a training run reserves besides its heap blocks, which the address-space and
/// data-segment limits count too: per thread it starts (Candle's compute threads, as many as
/// `RAYON_NUM_THREADS` or the cores, plus the batcher, the signal watcher and a few more) a stack
/// of 8 MiB and a glibc malloc arena of 64 MiB. Measured: a 2-thread run's `VmSize` is about
/// 150 MiB above its heap.
fn thread_reserve() -> u64 {
    const PER_THREAD: u64 = (8 + 64) << 20;
    (candle_core::utils::get_num_threads() as u64 + 4) * PER_THREAD
}

/// What a CPU run's resident memory holds beyond its live heap, under `--memory-limit` (where
/// [`crate::memory::return_freed_memory`] gives large freed blocks back to the kernel):
/// - every page of the files the process maps (binary and libraries), whether touched yet or
///   not: the sizes of its file-backed mappings, which are the same in every run of one build,
///   so a dry run and the run reach the same verdict;
/// - [`RSS_FIXED_ALLOWANCE`] for the main stack and the loader's and libraries' own data, and
///   [`RSS_THREAD_ALLOWANCE`] per compute thread (stack and malloc arena pages);
/// - [`RSS_HEAP_SLACK`] of the heap itself: small freed blocks the allocator keeps.
///
/// Measured on the default net, CPU, 2 threads, from batch 32 at width 32 to batch 240 at width
/// 64 (`cargo test --release --test os_limit -- --nocapture` prints each run's heap and resident
/// peaks, checks that the resident peak stays within a limit 1 MiB above what the reserve asks,
/// and that a run it admits completes in a cgroup of the limit): the runs held 7.9 to 14.5 MiB
/// beside their heap peak, the binary's resident pages included; the most at batch 64, width 64
/// with AdamW, whose optimizer step makes many blocks under 1 MiB, where its limit (1 MiB above
/// what the reserve and the estimate ask) left 20.4 MiB beside the heap. The whole reserve is
/// checked, not each part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RssReserve {
    /// Bytes of the files the process maps.
    pub mapped_files: u64,
    /// Compute threads of the run.
    pub threads: u64,
}

/// The main stack and the loader's and libraries' data pages.
pub const RSS_FIXED_ALLOWANCE: u64 = 1 << 20;
/// Per compute thread: its stack and its malloc arena's pages.
pub const RSS_THREAD_ALLOWANCE: u64 = 1 << 20;
/// The fraction of the heap that small freed blocks kept by the allocator add.
pub const RSS_HEAP_SLACK: f64 = 0.03;

impl RssReserve {
    /// This process's reserve, read at the first call and kept.
    pub fn of_process() -> RssReserve {
        static RESERVE: std::sync::OnceLock<RssReserve> = std::sync::OnceLock::new();
        *RESERVE.get_or_init(|| RssReserve {
            mapped_files: std::fs::read_to_string("/proc/self/maps")
                .map_or(0, |m| mapped_file_bytes(&m)),
            threads: candle_core::utils::get_num_threads() as u64,
        })
    }

    fn outside_heap(&self) -> u64 {
        self.mapped_files + RSS_FIXED_ALLOWANCE + self.threads * RSS_THREAD_ALLOWANCE
    }

    /// The most heap a run may hold for its resident memory to stay within `limit`.
    pub fn heap_budget(&self, limit: u64) -> u64 {
        (limit.saturating_sub(self.outside_heap()) as f64 / (1.0 + RSS_HEAP_SLACK)).floor() as u64
    }

    /// The resident memory predicted for a heap peak of `heap` bytes (the inverse of
    /// [`RssReserve::heap_budget`]).
    pub fn resident(&self, heap: u64) -> u64 {
        (heap as f64 * (1.0 + RSS_HEAP_SLACK)).ceil() as u64 + self.outside_heap()
    }
}

/// The bytes of the file-backed mappings of a `/proc/<pid>/maps` text (lines with a path).
pub fn mapped_file_bytes(maps: &str) -> u64 {
    maps.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let range = f.next()?;
            let path = f.nth(4)?;
            if !path.starts_with('/') {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            let (a, b) = (
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            );
            Some(b.saturating_sub(a))
        })
        .sum()
}

/// A `Name:   1234 kB` field of a /proc text, in bytes.
fn kb_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let kb: u64 = line[name.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb.saturating_mul(1024))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_working_set_leaves_out_the_inactive_file_cache() {
        let stat = "cache 80\ninactive_file 5\ntotal_inactive_file 70\n";
        assert_eq!(working_set(100, stat, "total_inactive_file"), 30);
        assert_eq!(working_set(100, stat, "inactive_file"), 95);
        assert_eq!(working_set(100, "", "total_inactive_file"), 100);
        assert_eq!(working_set(10, stat, "total_inactive_file"), 0);
    }

    #[test]
    fn mapped_files_count_the_file_backed_mappings_only() {
        let maps = "\
555555554000-555555558000 r--p 00000000 fe:00 10010805                   /tmp/train
555555558000-555555560000 r-xp 00004000 fe:00 10010805                   /tmp/train
555555fa0000-555556000000 rw-p 00000000 00:00 0                          [heap]
7ffff7cd5000-7ffff7cd6000 r--p 00000000 fe:00 123 /usr/lib/x86_64-linux-gnu/libc.so.6
7ffff7cd6000-7ffff7cd8000 rw-p 00000000 00:00 0
7ffffffde000-7ffffffff000 rw-p 00000000 00:00 0                          [stack]";
        assert_eq!(mapped_file_bytes(maps), 0x4000 + 0x8000 + 0x1000);
        // This process maps its own binary at least.
        assert!(RssReserve::of_process().mapped_files > 0);
    }
}
