//! What every op shares, so that an op file holds only its own arithmetic:
//!
//! - element types: [`Float`], the storage types f32, f64, f16 and bf16 with the type their sums
//!   run in and the conversions between the two;
//! - dtype dispatch: [`dispatch_float!`], one `match` from a [`candle_core::DType`] to a generic
//!   call, for the CPU and the CUDA halves alike;
//! - operands: [`cpu_slice`] and [`cpu_slice_mut`] (and on CUDA [`cuda_view`]), the one
//!   contiguity check, and [`expect_dims`], the one shape check;
//! - CUDA launches (`cuda` feature): [`Kernels`], a kernel file compiled with NVRTC once per
//!   process and loaded once per device, [`kernel_source!`], [`grid_stride`], [`int32`] and
//!   [`uint32`];
//! - plane-parallel CPU passes: [`for_planes`] on Candle's thread pool, [`SharedMut`] for their
//!   disjoint writes;
//! - the TF32 switch, [`set_tf32`] (re-exported as `crate::set_tf32`), and the cuDNN determinism
//!   switch, [`set_cudnn_nondeterministic`];
//! - [`gemm_packing_bytes`], what the `gemm` crate allocates inside a product (for the memory
//!   estimate of the ops that call it).
//!
//! Nothing here imports an op (only `bf16_convert`'s slice conversions, for [`Float`]): the ops
//! import this module, never the other way round.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, WithDType};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

// ---------------------------------------------------------------------------------------------
// The gemm crate's packing

/// Bytes the `gemm` crate allocates inside one product (`gemm::gemm`, no parallelism) of `lhs` (`m × k`, strides
/// `(rs, cs)`) by `rhs` (`k × n`) into a destination with row stride `dst_rs`, for `elem`-byte
/// values: the packed copy of an operand that its micro-kernel cannot read in place, made and
/// freed in every call. (Its L2-sized buffer, made once per thread, is part of the estimate's
/// baseline.)
///
/// This follows gemm-common 0.19 (`gemm_basic_generic`) for the products the ops make. gemm
/// works on a column-major destination, so for ours (row-major) it swaps the operands; in its
/// terms (`m'`, `n'`, `k`): nothing for tiny f32 products (`m'·n' ≤ 256` with unit strides, its
/// horizontal kernels) or a depth `k ≤ 2`; else the left operand is prepacked unless it is
/// column-major with `m'` a multiple of the SIMD width (`kc`-deep panels of `MR` rows), and the
/// right one is packed when its rows are strided and `m' > 2·MR` (`kc` rows of `n'` rounded up to
/// `NR`), each rounded up to a cache line. `kc` is the whole depth up to 512; beyond that, 512
/// for products of at most 64×64, else the depth split evenly into blocks of at most 512 (its
/// choice on x86-64 L1 caches). `MR`, `NR` and the width are those of its AVX-512 f32 kernel
/// (64, 8, 16), the largest of its x86 kernels, which makes this an upper bound on other CPUs.
/// Left out: a flag per `MR` rows (a few hundred bytes at most).
pub(crate) fn gemm_packing_bytes(
    [m, n, k]: [usize; 3],
    dst_rs: usize,
    lhs: (usize, usize),
    rhs: (usize, usize),
    elem: usize,
) -> usize {
    // gemm's view: a row-major destination swaps the operands and transposes both.
    let (m, n, (lhs_rs, lhs_cs), (rhs_rs, _)) = if dst_rs > 1 {
        (n, m, (rhs.1, rhs.0), (lhs.1, lhs.0))
    } else {
        (m, n, lhs, rhs)
    };
    let tiny = elem == 4 && lhs_cs == 1 && rhs_rs == 1 && m * n <= 256;
    if m == 0 || n == 0 || k <= 2 || tiny {
        return 0;
    }
    let lanes = 64 / elem;
    let (mr, nr) = (4 * lanes, 8);
    let kc = if k <= 512 || (m <= 64 && n <= 64) {
        k.min(512)
    } else {
        k.div_ceil(k.div_ceil(512))
    };
    let line = |elems: usize| (elems * elem).next_multiple_of(64);
    let packed_rhs = if m > if rhs_rs != 1 { 2 * mr } else { 128 * mr } {
        line(kc * n.next_multiple_of(nr))
    } else {
        0
    };
    let prepacked_lhs = if lhs_rs != 1 || !m.is_multiple_of(lanes) {
        line(kc * m.next_multiple_of(mr))
    } else {
        0
    };
    packed_rhs + prepacked_lhs
}

// ---------------------------------------------------------------------------------------------
// Element types

/// The type sums run in: f32, or f64 for f64 inputs.
pub(crate) trait Acc: Copy + Default + Send + Sync + 'static + std::ops::AddAssign {
    const ZERO: Self;
    const ONE: Self;
}

impl Acc for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

impl Acc for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

/// A float storage type of the ops and how it converts to and from [`Float::Acc`], the type its
/// arithmetic runs in (f32, f64 for f64): the half types are widened to f32 and narrowed back
/// once, the native types are used as they are.
pub(crate) trait Float: WithDType {
    type Acc: Acc;
    const ZERO: Self;
    /// `Some` when the storage type is the arithmetic type, so no conversion copy is needed.
    fn as_acc(src: &[Self]) -> Option<&[Self::Acc]>;
    /// As [`Float::as_acc`], for destinations.
    fn as_acc_mut(dst: &mut [Self]) -> Option<&mut [Self::Acc]>;
    /// `src` converted into `dst` (of the same length), a slice at a time: `half` converts f16
    /// slices with F16C/SIMD, and bf16 runs 16 lanes at a time ([`super::bf16_convert`]), which
    /// per-element conversion cannot.
    fn widen(src: &[Self], dst: &mut [Self::Acc]);
    /// The inverse of [`Float::widen`], rounding to nearest even.
    fn narrow(src: &[Self::Acc], dst: &mut [Self]);
    /// Rounds `buf` to this type's precision in place (stored as Self and read back); `tmp` is
    /// scratch of at least `buf.len()` for the types that round through memory.
    fn round(buf: &mut [Self::Acc], tmp: &mut [Self]);
    /// A zeroed vector, allocated zeroed (calloc: fresh pages, no memset pass) where possible.
    fn zeros(len: usize) -> Vec<Self>;
    /// One value as f32.
    fn to_f32(self) -> f32;
    /// One value rounded to this type (from f32, where `from_f64` is a slower software path).
    fn from_f32(v: f32) -> Self;
    /// The data of a CPU storage of this type, mutably (Candle has only the shared accessor).
    fn storage_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
}

macro_rules! native_float {
    ($t:ty, $variant:ident) => {
        impl Float for $t {
            type Acc = $t;
            const ZERO: Self = 0.0;
            fn as_acc(src: &[Self]) -> Option<&[Self]> {
                Some(src)
            }
            fn as_acc_mut(dst: &mut [Self]) -> Option<&mut [Self]> {
                Some(dst)
            }
            fn widen(src: &[Self], dst: &mut [Self]) {
                dst.copy_from_slice(src)
            }
            fn narrow(src: &[Self], dst: &mut [Self]) {
                dst.copy_from_slice(src)
            }
            fn round(_: &mut [Self], _: &mut [Self]) {}
            fn zeros(len: usize) -> Vec<Self> {
                vec![0.0; len]
            }
            #[inline(always)]
            fn to_f32(self) -> f32 {
                self as f32
            }
            #[inline(always)]
            fn from_f32(v: f32) -> Self {
                v as $t
            }
            fn storage_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
native_float!(f32, F32);
native_float!(f64, F64);

/// Reinterprets a zeroed `Vec<u16>` (allocated with calloc) as a vector of a 16-bit float.
fn zeros_u16_as<T: Copy>(len: usize) -> Vec<T> {
    assert!(std::mem::size_of::<T>() == 2 && std::mem::align_of::<T>() == 2);
    let mut v = std::mem::ManuallyDrop::new(vec![0u16; len]);
    // SAFETY: T is f16 or bf16: `repr(transparent)` over u16, so same size and alignment as the
    // allocation's element type, and every bit pattern (here all zeros) is a valid value.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr() as *mut T, v.len(), v.capacity()) }
}

/// The parts the two half types share; `$widen`, `$narrow` and `$round` are their slice
/// conversions.
macro_rules! half_float {
    ($t:ident, $variant:ident, $widen:expr, $narrow:expr, $round:expr) => {
        impl Float for $t {
            type Acc = f32;
            const ZERO: Self = $t::ZERO;
            fn as_acc(_: &[Self]) -> Option<&[f32]> {
                None
            }
            fn as_acc_mut(_: &mut [Self]) -> Option<&mut [f32]> {
                None
            }
            fn widen(src: &[Self], dst: &mut [f32]) {
                $widen(src, dst)
            }
            fn narrow(src: &[f32], dst: &mut [Self]) {
                $narrow(src, dst)
            }
            fn round(buf: &mut [f32], tmp: &mut [Self]) {
                $round(buf, tmp)
            }
            fn zeros(len: usize) -> Vec<Self> {
                zeros_u16_as(len)
            }
            #[inline(always)]
            fn to_f32(self) -> f32 {
                $t::to_f32(self)
            }
            #[inline(always)]
            fn from_f32(v: f32) -> Self {
                $t::from_f32(v)
            }
            fn storage_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
half_float!(
    f16,
    F16,
    |src: &[f16], dst: &mut [f32]| src.convert_to_f32_slice(dst),
    |src: &[f32], dst: &mut [f16]| dst.convert_from_f32_slice(src),
    |buf: &mut [f32], tmp: &mut [f16]| {
        let t = &mut tmp[..buf.len()];
        t.convert_from_f32_slice(buf);
        t.convert_to_f32_slice(buf);
    }
);
half_float!(
    bf16,
    BF16,
    super::bf16_convert::widen,
    super::bf16_convert::narrow,
    |buf: &mut [f32], _: &mut [bf16]| super::bf16_convert::round(buf)
);

// ---------------------------------------------------------------------------------------------
// Plane-parallel CPU passes

/// Below this many elements a pass runs on the calling thread: waking the pool costs more.
const PAR_MIN_ELEMS: usize = 1 << 15;

/// A raw pointer the pool's workers may share; each writes a disjoint range.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<U>(pub(crate) *mut U);
// SAFETY: only used to hand disjoint sub-slices of one buffer to worker threads.
unsafe impl<U: Send> Send for SharedMut<U> {}
unsafe impl<U: Send> Sync for SharedMut<U> {}

impl<U> SharedMut<U> {
    /// # Safety
    /// `start..start + len` must be in bounds and not accessed by anyone else meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn range(&self, start: usize, len: usize) -> &mut [U] {
        std::slice::from_raw_parts_mut(self.0.add(start), len)
    }
}

/// How many ranges of [`for_planes`] can run at once on `threads` threads: one when it runs on
/// the calling thread, else one per thread that gets a chunk of Candle's `execute_chunked`
/// (chunks of `planes / (8 · threads)` planes, rounded up).
pub(crate) fn planes_in_parallel(planes: usize, hw: usize, threads: usize) -> usize {
    if planes * hw < PAR_MIN_ELEMS || threads <= 1 || planes <= 1 {
        1
    } else {
        threads.min(planes.div_ceil(planes.div_ceil(threads * 8)))
    }
}

/// Runs `f` over ranges of planes covering `0..planes` (each of `hw` elements), on Candle's
/// persistent CPU thread pool (no thread spawned per call) when there is enough work, else on the
/// calling thread.
pub(crate) fn for_planes(planes: usize, hw: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    let pool = candle_core::utils::barrier_pool();
    if planes_in_parallel(planes, hw, pool.n_workers() + 1) == 1 {
        f(0..planes)
    } else {
        pool.execute_chunked(planes, f)
    }
}

// ---------------------------------------------------------------------------------------------
// Dtype dispatch

/// Evaluates `$body` with `$t` an alias of the element type of `$dtype` (a `DType`) when that is
/// one of the listed float dtypes (`F32`, `F64`, `F16`, `BF16`), else `$fallback` with `$other`
/// bound to the dtype:
///
/// ```text
/// dispatch_float!(s.dtype(), [F32, F16, BF16], |T| run::<T>(s), |dt| bail!("{dt:?}"))
/// ```
///
/// Neither `|..|` is a closure (a `return` or `?` in them leaves the enclosing function); they
/// are written so because that keeps the call an expression list, which rustfmt formats. One
/// macro for every op and both backends, instead of a `match` over the dtypes (or over
/// `CpuStorage` variants) per op impl.
macro_rules! dispatch_float {
    ($dtype:expr, [$($v:ident),+ $(,)?], |$t:ident| $body:expr, |$other:pat_param| $fallback:expr $(,)?) => {
        match $dtype {
            $(candle_core::DType::$v => {
                type $t = $crate::util::float_type!($v);
                $body
            })+
            $other => $fallback,
        }
    };
}

/// The Rust type of a float `DType` variant.
macro_rules! float_type {
    (F32) => {
        f32
    };
    (F64) => {
        f64
    };
    (F16) => {
        half::f16
    };
    (BF16) => {
        half::bf16
    };
}

pub(crate) use {dispatch_float, float_type};

// ---------------------------------------------------------------------------------------------
// Operands

/// The elements of a CPU storage that a contiguous `l` covers, as `T`. `op` and `what` name the
/// operand in the error for another dtype or a layout that is not contiguous (the public
/// functions make their operands contiguous, so either is a bug of the op, reported, not a panic).
pub(crate) fn cpu_slice<'a, T: WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    op: &str,
    what: &str,
) -> candle_core::Result<&'a [T]> {
    let data = T::cpu_storage_as_slice(s).map_err(|_| {
        candle_core::Error::Msg(format!(
            "{op}: {what} has dtype {:?}, expected {:?}",
            s.dtype(),
            T::DTYPE
        ))
    })?;
    match l.contiguous_offsets() {
        Some((start, end)) if end <= data.len() => Ok(&data[start..end]),
        _ => candle_core::bail!("{op}: {what} must be contiguous"),
    }
}

/// [`cpu_slice`] for the operand an in-place op writes.
pub(crate) fn cpu_slice_mut<'a, T: Float>(
    s: &'a mut CpuStorage,
    l: &Layout,
    op: &str,
    what: &str,
) -> candle_core::Result<&'a mut [T]> {
    let dtype = s.dtype();
    let data = T::storage_mut(s).ok_or_else(|| {
        candle_core::Error::Msg(format!(
            "{op}: {what} has dtype {dtype:?}, expected {:?}",
            T::DTYPE
        ))
    })?;
    match l.contiguous_offsets() {
        Some((start, end)) if end <= data.len() => Ok(&mut data[start..end]),
        _ => candle_core::bail!("{op}: {what} must be contiguous"),
    }
}

/// Checks that an op's operand has the shape its geometry was built for.
pub(crate) fn expect_dims(
    op: &str,
    what: &str,
    got: &[usize],
    want: &[usize],
) -> candle_core::Result<()> {
    if got != want {
        candle_core::bail!("{op}: {what} has shape {got:?}, expected {want:?}");
    }
    Ok(())
}

#[cfg(feature = "cuda")]
pub(crate) use cuda::*;

#[cfg(feature = "cuda")]
mod cuda {
    //! The CUDA side: kernel sources kept in `cu/*.cu` start with `cu/prelude.cuh`
    //! ([`kernel_source!`]): typedefs and the f32 <-> half/bfloat16 load/store helpers, written
    //! without headers because NVRTC runs without the toolkit's include directory.

    use std::sync::OnceLock;

    use candle_core::cuda_backend::cudarc;
    use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaView, LaunchConfig};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaDevice, CudaStorage, Layout};

    /// The NVRTC source of kernel file `$file` in `cu/`: `prelude.cuh`, then the
    /// file (the order `scripts/cuda-check.sh` compiles them in too).
    macro_rules! kernel_source {
        ($file:literal) => {
            concat!(
                include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/cu/prelude.cuh")),
                include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/cu/", $file))
            )
        };
    }
    pub(crate) use kernel_source;

    /// One op's kernel source and its PTX, compiled on first use. A compile failure is kept and
    /// reported at every use, so a broken toolkit shows as an error of the op, not a panic.
    pub(crate) struct Kernels {
        op: &'static str,
        module: &'static str,
        source: &'static str,
        ptx: OnceLock<std::result::Result<String, String>>,
    }

    impl Kernels {
        /// `op` names the op in error messages; `module` is the name under which each
        /// `CudaDevice` caches the loaded module.
        pub(crate) const fn new(
            op: &'static str,
            module: &'static str,
            source: &'static str,
        ) -> Self {
            Kernels {
                op,
                module,
                source,
                ptx: OnceLock::new(),
            }
        }

        /// The PTX, compiling it the first time.
        fn ptx(&'static self) -> candle_core::Result<&'static str> {
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

        /// Kernel `name` on `dev` (the module is loaded on the device's first use), to launch on
        /// the device's stream (`dev.cuda_stream().launch_builder(..)`).
        pub(crate) fn func(
            &'static self,
            dev: &CudaDevice,
            name: &str,
        ) -> candle_core::Result<CudaFunction> {
            Ok(dev
                .get_or_load_custom_func(name, self.module, self.ptx()?)?
                .into_cuda_function())
        }
    }

    /// The part of a CUDA storage that a contiguous `layout` covers, as `T`; `op` and `what`
    /// name the operand in the error for a non-contiguous one.
    pub(crate) fn cuda_view<'a, T: CudaDType>(
        s: &'a CudaStorage,
        layout: &Layout,
        op: &str,
        what: &str,
    ) -> candle_core::Result<CudaView<'a, T>> {
        let slice = s.as_cuda_slice::<T>()?;
        match layout.contiguous_offsets() {
            Some((start, end)) => Ok(slice.slice(start..end)),
            None => candle_core::bail!("{op}: {what} must be contiguous"),
        }
    }

    /// Elements to allocate for a result of `len`: at least one, because CUDA refuses a zero-byte
    /// allocation (`cuMemAllocAsync` returns `CUDA_ERROR_INVALID_VALUE`). An empty result in a
    /// one-element buffer is still empty to Candle, which reads storage through the layout.
    pub(crate) fn alloc_len(len: usize) -> usize {
        len.max(1)
    }

    /// Threads per block of a grid-stride launch.
    const BLOCK: u32 = 256;
    /// Blocks per grid-stride launch at most; the kernels loop over the rest.
    const MAX_BLOCKS: usize = 1 << 16;

    /// A launch over `total` elements for a kernel that loops with a grid stride: 256-thread
    /// blocks, one thread per element up to 2^16 blocks.
    pub(crate) fn grid_stride(total: usize) -> LaunchConfig {
        let blocks = total.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `v` as a 32-bit size for a kernel or a CUDA library (cuBLAS, cuDNN take `int`); `op` and
    /// `what` name it in the error.
    pub(crate) fn int32(op: &str, what: &str, v: usize) -> candle_core::Result<i32> {
        i32::try_from(v).map_err(|_| {
            candle_core::Error::Msg(format!(
                "{op}: {what} = {v} is too large for the 32-bit CUDA sizes; lower the batch size"
            ))
        })
    }

    /// [`int32`] for kernels that take it unsigned (still at most `i32::MAX`: they do signed
    /// index arithmetic in places).
    pub(crate) fn uint32(op: &str, what: &str, v: usize) -> candle_core::Result<u32> {
        Ok(int32(op, what, v)? as u32)
    }
}

// ---------------------------------------------------------------------------------------------
// TF32

/// Whether f32 convolutions on CUDA may run on TF32 tensor cores; see [`set_tf32`].
static TF32: AtomicBool = AtomicBool::new(false);

/// Let f32 convolutions on CUDA multiply in TF32 (10-bit mantissa inputs, f32 sums): the im2col
/// op's cuBLAS gemms use `CUBLAS_COMPUTE_32F_FAST_TF32` and the cuDNN op the default math type
/// (tensor cores allowed) instead of FMA-only math. Process-wide, like PyTorch's
/// `torch.backends.cudnn.allow_tf32`, because the ops are called from deep inside the model
/// without a configuration at hand.
///
/// Off until someone turns it on: the ops compute exact f32 by default (as Candle's matmul
/// does), so op-level tests compare against the CPU at f32 tolerances. memtrain sets it from its
/// `--tf32` flag. A model's Candle matmuls (memtrain's head) stay f32 either
/// way, as PyTorch's `torch.backends.cuda.matmul.allow_tf32` defaults to off. No effect on the CPU,
/// on f64, f16 or bf16, or on the depthwise op (CUDA cores).
pub fn set_tf32(on: bool) {
    TF32.store(on, Ordering::Relaxed);
}

/// Whether [`set_tf32`] is on.
pub fn tf32() -> bool {
    TF32.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------
// cuDNN determinism

/// Whether the cuDNN op's backward passes may run algorithms that are not deterministic; see
/// [`set_cudnn_nondeterministic`].
static CUDNN_NONDETERMINISTIC: AtomicBool = AtomicBool::new(false);

/// Let the cuDNN op's backward passes run cuDNN's first-ranked algorithm even when it sums with
/// atomic adds (backward-data `ALGO_0`, backward-filter `ALGO_0` and `ALGO_3`), whose results can
/// differ in the last bits from run to run. Off by default: such a pick is replaced by the
/// deterministic `ALGO_1`, as PyTorch's `torch.backends.cudnn.deterministic` does, so two runs
/// (and a captured step against an eager one) give the same bits. Process-wide, like
/// [`set_tf32`]; memtrain sets it from its `--cudnn-nondeterministic` flag. The forward
/// algorithms, the im2col op and the CPU are deterministic either way.
pub fn set_cudnn_nondeterministic(on: bool) {
    CUDNN_NONDETERMINISTIC.store(on, Ordering::Relaxed);
}

/// Whether [`set_cudnn_nondeterministic`] is on.
pub fn cudnn_nondeterministic() -> bool {
    CUDNN_NONDETERMINISTIC.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------
// cuDNN workspace

/// Bytes of the cuDNN op's workspace unless [`set_cudnn_workspace_bytes`] says otherwise:
/// allocated once per thread and GPU by the first cuDNN convolution, kept for the rest of the
/// thread, shared by every convolution and pass; an algorithm that needs more is not used
/// ([`crate::conv2d_cudnn`]).
pub const DEFAULT_CUDNN_WORKSPACE_BYTES: usize = 32 << 20;

static CUDNN_WORKSPACE_BYTES: AtomicUsize = AtomicUsize::new(DEFAULT_CUDNN_WORKSPACE_BYTES);

/// The cuDNN op's workspace size from now on. Process-wide, like [`set_tf32`]; memtrain sets it
/// from its `--cudnn-workspace` flag. Plans made under another size keep theirs.
pub fn set_cudnn_workspace_bytes(bytes: usize) {
    CUDNN_WORKSPACE_BYTES.store(bytes, Ordering::Relaxed);
}

/// The size [`set_cudnn_workspace_bytes`] set.
pub fn cudnn_workspace_bytes() -> usize {
    CUDNN_WORKSPACE_BYTES.load(Ordering::Relaxed)
}
