//! Which probe measures a device: the counting allocator on the CPU, the memory pool on CUDA.
//! Kept apart from the probes themselves so that the CUDA probe (which implements
//! [`MemoryProbe`]) and the trait's module do not import each other.

use super::probe::{CpuProbe, MemoryProbe, UnavailableProbe};
use candle_core::Device;

/// The probe for a device: the counting allocator on the CPU, the memory pool on CUDA.
pub fn probe_for(
    device: &Device,
    limit: Option<u64>,
    pool_cache: bool,
) -> crate::Result<std::sync::Arc<dyn MemoryProbe>> {
    let _ = pool_cache;
    match device {
        Device::Cpu => Ok(std::sync::Arc::new(CpuProbe::for_process_limit(limit))),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => Ok(std::sync::Arc::new(super::cuda::CudaPoolProbe::new(
            device, limit, pool_cache,
        )?)),
        _ => Ok(std::sync::Arc::new(UnavailableProbe)),
    }
}
