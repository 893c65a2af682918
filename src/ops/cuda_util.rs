//! What the CUDA halves of our ops share: their kernel sources compiled with NVRTC once per
//! process, and contiguous views of operands. Sources kept in `kernels/*.cu` start with
//! `kernels/prelude.cuh` (`concat!(include_str!(..), include_str!(..))`): typedefs and the
//! f32 <-> half/bfloat16 load/store helpers, written without headers because NVRTC runs without the
//! toolkit's include directory.

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView};
use candle_core::Layout;

/// One op's kernel source and its PTX, compiled on first use. A compile failure is kept and
/// reported at every use, so a broken toolkit shows as an error of the op, not a panic.
pub(crate) struct Kernels {
    op: &'static str,
    source: &'static str,
    ptx: OnceLock<std::result::Result<String, String>>,
}

impl Kernels {
    /// `op` names the op in error messages.
    pub(crate) const fn new(op: &'static str, source: &'static str) -> Self {
        Kernels {
            op,
            source,
            ptx: OnceLock::new(),
        }
    }

    /// The PTX, compiling it the first time.
    pub(crate) fn ptx(&'static self) -> candle_core::Result<&'static str> {
        self.ptx
            .get_or_init(|| {
                cudarc::nvrtc::compile_ptx(self.source)
                    .map(|ptx| ptx.to_src())
                    .map_err(|e| e.to_string())
            })
            .as_deref()
            .map_err(|e| {
                candle_core::Error::Cuda(
                    format!("{}: NVRTC could not compile the kernels: {e}", self.op).into(),
                )
            })
    }
}

/// The part of `slice` that a contiguous `layout` covers; `op` and `what` name the operand in the
/// error for a non-contiguous one.
pub(crate) fn contiguous_view<'a, T>(
    slice: &'a CudaSlice<T>,
    layout: &Layout,
    op: &str,
    what: &str,
) -> candle_core::Result<CudaView<'a, T>> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(slice.slice(start..end)),
        None => candle_core::bail!("{op}: {what} must be contiguous"),
    }
}
