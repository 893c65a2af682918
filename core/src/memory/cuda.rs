//! The probe for CUDA devices: the counters of the device's stream-ordered memory pool.
//!
//! Candle allocates every CUDA buffer through cudarc's `CudaStream::alloc`, which calls
//! `cuMemAllocAsync` whenever the device supports memory pools; that call takes memory from the
//! device's *current* pool and `cuMemFreeAsync` gives it back there. The pool therefore sees every
//! tensor candle creates, and its attributes are exact counters:
//!
//! | reading         | pool attribute                         |
//! |-----------------|----------------------------------------|
//! | `current`       | `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`     |
//! | `peak`          | `CU_MEMPOOL_ATTR_USED_MEM_HIGH`        |
//! | `reserved`      | `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT` |
//! | `reserved_peak` | `CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`    |
//!
//! `device_used` is device-wide (`cuMemGetInfo`: total minus free, what nvidia-smi shows, the
//! CUDA context and cuBLAS workspaces included).
//!
//! A hard limit works like TensorFlow's logical-device `memory_limit`: the probe creates a pool
//! whose `maxSize` is the limit and makes it the device's current pool, so an allocation that
//! would take the pool past the limit fails with `CUDA_ERROR_OUT_OF_MEMORY` (see [`is_cuda_oom`]).
//!
//! Only allocations made *after* the probe is created come from a limited pool; create the probe
//! before the model and the data are put on the device.

use std::collections::HashMap;
use std::ffi::{c_int, c_uchar, c_uint, c_ushort, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::CudaError;
use candle_core::Device;
use cudarc::driver::result::{device as cu_device, mem_pool};
use cudarc::driver::sys::CUmemPool_attribute::{
    CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
    CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
    CU_MEMPOOL_ATTR_USED_MEM_HIGH,
};
use cudarc::driver::{sys, CudaContext, DriverError};

use super::probe::MemoryProbe;
use crate::error::{Error, Result};

/// Probe of the CUDA device's current memory pool (the pool candle's `cuMemAllocAsync`
/// allocations come from).
///
/// Readings do not wait for the GPU: the pool counts an allocation, and a free on the stream that
/// allocated, when the host makes the call, not when the stream reaches it (measured on an H200 by
/// `tests/gpu_memory.rs`, `counters_follow_the_hosts_calls_without_a_sync`). So a reading at a
/// layer event is the memory of the program up to that event, in program order, while the GPU
/// may still be running earlier kernels, and the trainer's per-event timeline costs no
/// synchronization; [`MemoryProbe::sync`] waits for the GPU where a phase ends.
///
/// While the probe lives it owns the pool settings it made: with a limit, its own pool is the
/// device's current pool; the release threshold is the one `pool_cache` chose. Dropping the probe
/// undoes both (see the `Drop` impl).
#[derive(Debug)]
pub struct CudaPoolProbe {
    ctx: Arc<CudaContext>,
    /// The pool the readings come from; `None` when the device has no memory-pool support, in
    /// which case candle falls back to `cuMemAlloc` and nothing is counted.
    pool: Option<PoolHandle>,
    /// Set when `pool` was created by this probe (a limit was asked for): the pool that was
    /// current before, to make current again on drop.
    replaced: Option<PoolHandle>,
    /// For a pool borrowed from the device (no limit): its release threshold before this probe
    /// changed it, restored on drop.
    previous_threshold: Option<u64>,
    limit: Option<u64>,
    /// Highest device-wide reading so far: the driver keeps no high-water mark of its own.
    device_used_high: std::sync::atomic::AtomicU64,
}

/// A `CUmemoryPool` handle.
///
/// Pool handles are process-wide driver objects and every driver call on them is thread-safe,
/// so sharing the handle between threads is sound (the raw pointer alone would forbid it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PoolHandle(sys::CUmemoryPool);

// SAFETY: see the type's documentation: the handle is an opaque token passed only to the
// (thread-safe) CUDA driver, never dereferenced by us.
unsafe impl Send for PoolHandle {}
// SAFETY: as for `Send`.
unsafe impl Sync for PoolHandle {}

/// For each limited pool whose probe has been dropped (by address): the pool it had replaced.
///
/// A probe being dropped makes the pool it replaced current again, but that pool may itself
/// belong to a probe that is already gone (probes dropped out of creation order); following this
/// map skips such pools and lands on one that is still wanted: a live probe's pool, the device's
/// default pool, or a pool someone else installed.
fn retired_pools() -> &'static Mutex<HashMap<usize, PoolHandle>> {
    static RETIRED: OnceLock<Mutex<HashMap<usize, PoolHandle>>> = OnceLock::new();
    RETIRED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// `CUmemPoolProps` as laid out by the CUDA driver since 12.2 (`cuda.h`: allocType, handleTypes,
/// location {type, id}, win32SecurityAttributes, maxSize, usage, reserved[54]).
///
/// cudarc generates its `CUmemPoolProps` from the toolkit found at build time, and the field we
/// need is not spelled the same everywhere: toolkits before 12.2 have no `maxSize` (those bytes are
/// `reserved`), and from 13.2 the location's `id` sits inside an anonymous union. The layout the
/// driver reads is the same in all of them, so this mirror (checked against cudarc's size below)
/// compiles with any toolkit, and the driver that runs the program decides whether `maxSize` is
/// honoured (CUDA 12.2 or newer).
#[repr(C)]
struct PoolPropsAbi {
    alloc_type: c_uint,
    handle_types: c_uint,
    location_type: c_uint,
    location_id: c_int,
    win32_security_attributes: *mut c_void,
    max_size: usize,
    usage: c_ushort,
    reserved: [c_uchar; 54],
}

const _: () = assert!(
    std::mem::size_of::<PoolPropsAbi>() == std::mem::size_of::<sys::CUmemPoolProps>(),
    "CUmemPoolProps layout changed: update PoolPropsAbi"
);

impl CudaPoolProbe {
    /// A probe for `device`'s memory pool.
    ///
    /// With `limit`: create a new pool with that `maxSize` (pinned device memory on this device,
    /// no export handles) and make it the device's current pool, so allocations beyond the limit
    /// fail with `CUDA_ERROR_OUT_OF_MEMORY` (TensorFlow's `memory_limit` idea). Without: measure
    /// the device's current pool.
    ///
    /// `pool_cache`: set `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD` to `u64::MAX`, so freed memory stays
    /// reserved between steps (a caching allocator), or to 0, so it is returned to the device at
    /// every synchronize.
    ///
    /// The peak watermarks start at the current use.
    ///
    /// Errors: [`Error::Device`] when `device` is not a CUDA device, when a limit is asked for on
    /// a device without memory-pool support or a driver older than CUDA 12.2, or when a driver call
    /// fails; [`Error::Config`] for a zero limit (for CUDA a `maxSize` of 0 means "no limit").
    pub fn new(device: &Device, limit: Option<u64>, pool_cache: bool) -> Result<Self> {
        let cuda = device.as_cuda_device().map_err(|e| {
            Error::Device(format!("the CUDA memory probe needs a CUDA device: {e}"))
        })?;
        let ctx = cuda.cuda_stream().context().clone();
        let ordinal = ctx.ordinal();
        let fail =
            move |what: &str, e: DriverError| Error::Device(format!("cuda:{ordinal}: {what}: {e}"));
        if limit == Some(0) {
            return Err(Error::config(
                "the memory limit must be more than 0 bytes (e.g. --memory-limit 2GiB)",
            ));
        }
        ctx.bind_to_thread()
            .map_err(|e| fail("cannot make the CUDA context current", e))?;

        if !ctx.has_async_alloc() {
            // cudarc then allocates with plain cuMemAlloc: no pool to count or to limit.
            if let Some(limit) = limit {
                return Err(Error::Device(format!(
                    "cuda:{ordinal} does not support stream-ordered memory pools, so a memory \
                     limit of {} cannot be enforced; run without --memory-limit",
                    super::format_bytes(limit)
                )));
            }
            return Ok(CudaPoolProbe {
                ctx,
                pool: None,
                replaced: None,
                previous_threshold: None,
                limit: None,
                device_used_high: Default::default(),
            });
        }

        let cu_dev = ctx.cu_device();
        // SAFETY: `cu_dev` is the device of a live context.
        let current = unsafe { cu_device::get_mem_pool(cu_dev) }
            .map(PoolHandle)
            .map_err(|e| fail("cannot read the device's memory pool", e))?;

        let (pool, replaced, previous_threshold) = match limit {
            Some(limit) => {
                let pool = create_limited_pool(ordinal, limit).map_err(|e| {
                    fail(
                        &format!(
                            "cannot create a memory pool limited to {} (a memory limit needs a \
                             CUDA 12.2 or newer driver)",
                            super::format_bytes(limit)
                        ),
                        e,
                    )
                })?;
                // SAFETY: both handles are valid; `pool` was created for this device.
                if let Err(e) = unsafe { cu_device::set_mem_pool(cu_dev, pool.0) } {
                    // SAFETY: the pool was never current, so nothing was allocated from it.
                    let _ = unsafe { mem_pool::destroy(pool.0) };
                    return Err(fail("cannot make the limited pool current", e));
                }
                (pool, Some(current), None)
            }
            None => {
                let previous = get_attr(current, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
                    .map_err(|e| fail("cannot read the pool's release threshold", e))?;
                (current, None, Some(previous))
            }
        };
        // From here on the probe's Drop undoes what was set up if a later step fails.
        let probe = CudaPoolProbe {
            ctx,
            pool: Some(pool),
            replaced,
            previous_threshold,
            limit,
            device_used_high: Default::default(),
        };
        let threshold = if pool_cache { u64::MAX } else { 0 };
        set_attr(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, threshold)
            .map_err(|e| fail("cannot set the pool's release threshold", e))?;
        probe
            .ctx
            .synchronize()
            .map_err(|e| fail("cannot synchronize the device", e))?;
        probe
            .reset_watermarks()
            .map_err(|e| fail("cannot reset the pool's watermarks", e))?;
        Ok(probe)
    }

    /// Read a pool counter (without waiting for the GPU: see the type's docs); 0 when there is
    /// no pool or the driver refuses (the trait has no error channel, and a broken context
    /// resurfaces as an error at the next candle operation anyway).
    fn read(&self, attr: sys::CUmemPool_attribute) -> u64 {
        let Some(pool) = self.pool else { return 0 };
        if self.ctx.bind_to_thread().is_err() {
            return 0;
        }
        get_attr(pool, attr).unwrap_or(0)
    }

    /// Reset both high watermarks to the current values (CUDA: writing 0 to a `*_HIGH`
    /// attribute makes it take on the current value).
    fn reset_watermarks(&self) -> std::result::Result<(), DriverError> {
        let Some(pool) = self.pool else { return Ok(()) };
        self.ctx.bind_to_thread()?;
        set_attr(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)?;
        set_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)
    }
}

impl MemoryProbe for CudaPoolProbe {
    fn name(&self) -> &str {
        "cuda-pool"
    }

    fn available(&self) -> bool {
        self.pool.is_some()
    }

    fn current(&self) -> u64 {
        self.read(CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    fn peak(&self) -> u64 {
        // The watermark is updated by the driver as allocations happen; taking the max with the
        // current use keeps `peak >= current` even across a reset racing an allocation.
        let high = self.read(CU_MEMPOOL_ATTR_USED_MEM_HIGH);
        high.max(self.read(CU_MEMPOOL_ATTR_USED_MEM_CURRENT))
    }

    fn reset_peak(&self) {
        // Frees are counted at the call, so the watermark restarts at the program's use.
        let _ = self.reset_watermarks();
    }

    fn limit(&self) -> Option<u64> {
        self.limit
    }

    fn reserved(&self) -> Option<u64> {
        self.pool?;
        Some(self.read(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT))
    }

    fn reserved_peak(&self) -> Option<u64> {
        self.pool?;
        let high = self.read(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH);
        Some(high.max(self.read(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)))
    }

    fn device_used(&self) -> Option<u64> {
        let (free, total) = self.ctx.mem_get_info().ok()?;
        let used = total.saturating_sub(free) as u64;
        self.device_used_high
            .fetch_max(used, std::sync::atomic::Ordering::Relaxed);
        Some(used)
    }

    fn os_view(&self) -> Option<crate::memory::OsView> {
        Some(crate::memory::OsView::DeviceWide)
    }

    fn os_memory(&self) -> Option<crate::memory::OsMemory> {
        let current = self.device_used()?;
        Some(crate::memory::OsMemory {
            current,
            peak: self
                .device_used_high
                .load(std::sync::atomic::Ordering::Relaxed),
        })
    }

    fn sync(&self) {
        // The whole context, not only candle's stream: candle's default stream is the per-thread
        // stream, so work queued from another thread (a prefetcher) lives on another stream.
        // A failure here is sticky in the context and surfaces at the next candle call.
        let _ = self.ctx.synchronize();
    }
}

impl Drop for CudaPoolProbe {
    /// Undo the probe's settings.
    ///
    /// A borrowed pool gets its old release threshold back. A pool the probe created is
    /// deliberately never destroyed: tensors allocated under the limit may outlive the probe and
    /// must still be freed into their pool, and a later probe may have recorded this pool as the
    /// one to restore, so the handle has to stay valid for the life of the process. Instead the
    /// pool stops caching (threshold 0, trimmed), so it holds only memory still in use and hands
    /// each remaining block back to the device as it is freed; and if it is still the device's
    /// current pool, the pool it replaced becomes current again (skipping any pool whose probe was
    /// dropped meanwhile, in favour of the pool that one had replaced).
    fn drop(&mut self) {
        let Some(pool) = self.pool else { return };
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        if let Some(previous) = self.previous_threshold {
            let _ = set_attr(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, previous);
            return;
        }
        let Some(replaced) = self.replaced else {
            return;
        };
        let cu_dev = self.ctx.cu_device();
        {
            let mut retired = retired_pools().lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: `cu_dev` belongs to the live context `self.ctx`.
            if unsafe { cu_device::get_mem_pool(cu_dev) }.is_ok_and(|p| p == pool.0) {
                let mut restore = replaced;
                while let Some(&older) = retired.get(&(restore.0 as usize)) {
                    restore = older;
                }
                // SAFETY: a pool installed by a probe is never destroyed, so `restore` is
                // still a valid pool of this device.
                let _ = unsafe { cu_device::set_mem_pool(cu_dev, restore.0) };
            }
            retired.insert(pool.0 as usize, replaced);
        }
        let _ = self.ctx.synchronize();
        let _ = set_attr(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, 0);
        // SAFETY: the pool is valid; trimming only releases memory no allocation uses.
        let _ = unsafe { mem_pool::trim_to(pool.0, 0) };
    }
}

/// Create a pool of pinned device memory on device `ordinal` that can never hold more than
/// `limit` bytes.
fn create_limited_pool(ordinal: usize, limit: u64) -> std::result::Result<PoolHandle, DriverError> {
    let props = PoolPropsAbi {
        alloc_type: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED as c_uint,
        handle_types: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE.0,
        location_type: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as c_uint,
        location_id: ordinal as c_int,
        win32_security_attributes: std::ptr::null_mut(),
        // A limit beyond the address space is no limit; saturate instead of wrapping to a small
        // (or zero, i.e. unlimited-by-accident) value on 32-bit targets.
        max_size: usize::try_from(limit).unwrap_or(usize::MAX),
        usage: 0,
        reserved: [0; 54],
    };
    // SAFETY: `PoolPropsAbi` has the driver's `CUmemPoolProps` layout (size asserted above) and
    // lives across the call.
    unsafe { mem_pool::create(&props as *const PoolPropsAbi as *const sys::CUmemPoolProps) }
        .map(PoolHandle)
}

/// Read a 64-bit pool attribute (all the counters and the release threshold are `cuuint64_t`).
fn get_attr(
    pool: PoolHandle,
    attr: sys::CUmemPool_attribute,
) -> std::result::Result<u64, DriverError> {
    let mut value: u64 = 0;
    // SAFETY: the pool is valid and every attribute read here is a cuuint64_t.
    unsafe { mem_pool::get_attribute(pool.0, attr, &mut value as *mut u64 as *mut c_void) }?;
    Ok(value)
}

/// Write a 64-bit pool attribute.
fn set_attr(
    pool: PoolHandle,
    attr: sys::CUmemPool_attribute,
    mut value: u64,
) -> std::result::Result<(), DriverError> {
    // SAFETY: the pool is valid and every attribute written here is a cuuint64_t.
    unsafe { mem_pool::set_attribute(pool.0, attr, &mut value as *mut u64 as *mut c_void) }
}

/// True when a candle error is a CUDA out-of-memory (so the trainer can turn it into
/// [`Error::OutOfMemory`]).
///
/// Recognises `CUDA_ERROR_OUT_OF_MEMORY` from the driver (allocation, including allocations a
/// limited pool refuses), `CUBLAS_STATUS_ALLOC_FAILED` and `CURAND_STATUS_ALLOCATION_FAILED`,
/// through candle's backtrace, context and path wrappers.
pub fn is_cuda_oom(err: &candle_core::Error) -> bool {
    use candle_core::Error as E;
    match err {
        E::WithBacktrace { inner, .. } | E::Context { inner, .. } | E::WithPath { inner, .. } => {
            is_cuda_oom(inner)
        }
        E::Cuda(source) => source_chain_is_oom(source.as_ref()),
        E::WrappedContext { wrapped, .. } => source_chain_is_oom(wrapped.as_ref()),
        // `Error::wrap` (used e.g. by candle's synchronize) keeps only the message.
        E::Wrapped(message) => message_is_oom(&message.to_string()),
        E::Msg(message) => message_is_oom(message),
        _ => false,
    }
}

fn source_chain_is_oom(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(cuda) = e.downcast_ref::<CudaError>() {
            match cuda {
                CudaError::Cuda(d) | CudaError::Load { cuda: d, .. } if driver_is_oom(d) => {
                    return true
                }
                CudaError::Cublas(c)
                    if c.0 == cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED =>
                {
                    return true
                }
                CudaError::Curand(c)
                    if c.0
                        == cudarc::curand::sys::curandStatus_t::CURAND_STATUS_ALLOCATION_FAILED =>
                {
                    return true
                }
                _ => {}
            }
        }
        if e.downcast_ref::<DriverError>().is_some_and(driver_is_oom) {
            return true;
        }
        next = e.source();
    }
    false
}

fn driver_is_oom(err: &DriverError) -> bool {
    err.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
}

fn message_is_oom(message: &str) -> bool {
    [
        "CUDA_ERROR_OUT_OF_MEMORY",
        "CUBLAS_STATUS_ALLOC_FAILED",
        "CURAND_STATUS_ALLOCATION_FAILED",
    ]
    .iter()
    .any(|code| message.contains(code))
}
