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
    pub fn explain(&self, probe: &str) -> String {
        let allocator = if probe == "cuda-pool" {
            "pool peak: the most bytes the step's tensors held in the CUDA memory pool at once \
             (USED_MEM_HIGH), what the training step itself needs"
        } else {
            "heap peak: the most bytes the process's allocations held at once (counted at every \
             malloc and free), what the training step itself needs"
        };
        let os = match self {
            OsView::ProcessRss => {
                "RSS: the process's pages resident in physical memory as the kernel sees them \
                 (peak = VmHWM since start); it adds the binary, thread stacks and freed pages the \
                 allocator has not returned, so it is above the heap and falls slower"
            }
            OsView::DeviceWide => {
                "device-wide: all memory in use on the GPU (what nvidia-smi shows); it adds the \
                 pool's reserve, the CUDA context, cuBLAS/cuDNN workspaces and other processes"
            }
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
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kb * 1024)
    };
    let current = field("VmRSS:")?;
    let peak = field("VmHWM:")?.max(current);
    Some(OsMemory { current, peak })
}
