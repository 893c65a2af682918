//! The conv2d op on CUDA through cuDNN (cargo feature `cudnn`, on top of `cuda`): forward,
//! backward-data (input gradient) and backward-filter (weight gradient) through cudarc's
//! `ConvForward`, `ConvBackwardData` and `ConvBackwardFilter`.
//!
//! Why not Candle's own `cudnn` feature: it covers only the forward, and it builds the
//! descriptors, asks cuDNN's heuristics for an algorithm and allocates a workspace on every call.
//! Here, per thread and GPU (shared by every Candle `CudaDevice` of that GPU the thread opens:
//! they all run on the same per-thread default stream of the same primary context):
//!
//! - one cuDNN handle on that stream (cuDNN handles are neither `Send` nor `Sync`, and Candle's
//!   CUDA stream is the per-thread default stream, so per-thread state is also per-stream state);
//! - one plan per (shape, stride, padding, dtype, math mode): the tensor, filter and convolution
//!   descriptors and the algorithm of each of the three passes, chosen once;
//! - one workspace of [`CUDNN_WORKSPACE_BYTES`], allocated by the first cuDNN convolution and
//!   reused by every later one, for the rest of the thread's life (a process that builds many
//!   trainers, like memtrain's GPU tests, holds one, not one per trainer). Each pass runs the
//!   algorithm cuDNN's heuristics rank first when it may run and its workspace fits in that budget,
//!   else the first of the pass's deterministic algorithms that cuDNN supports there and that fits
//!   (`ALGO_1` first for the backward passes), and a shape with a pass that has none runs on the
//!   im2col op. A fixed size
//!   rather than the largest need so far: a memory estimate (memtrain's, through
//!   [`cuda_runtime_bytes`]) then knows it exactly without asking cuDNN, and it is the same
//!   budget the im2col op ([`super::conv2d_cuda::CUDA_IM2COL_CHUNK_BYTES`]) gives its columns, so
//!   switching ops changes how long the scratch lives, not how large it is.
//!
//! Layout: NCHW, the layout of every tensor in the model; NHWC (which cuDNN's tensor-core kernels
//! prefer for half types) would need a transpose around each convolution or a channels-last
//! model, and has not been measured. Math: f32 convolutions use TF32 tensor cores when
//! [`super::set_tf32`] is on (memtrain's `--tf32 on`; cuDNN's default math type) and FMA-only math when it is
//! off; f16/bf16 convolutions multiply on tensor cores and sum in f32 (compute type f32, as
//! PyTorch does); f64 stays f64.
//!
//! A shape cuDNN reports as not supported, when planning it or at a launch, falls back to the
//! im2col op, with a one-time warning.
//! It ran on an H200 on 2026-11-27 (`docs/results/gpu-2026-11-27.md`), where this crate's
//! `tests/conv2d.rs` with `--features cuda,cudnn` checked its numbers against the CPU; there,
//! with `ALGO_1` as the only deterministic fallback, several batch-512 shapes went to the im2col
//! op. The wider choice of deterministic algorithms and the fall-back at launch have not run on
//! a GPU yet (type-checked by `scripts/cuda-check.sh`).

// Without the feature only the constants below are used (by a memory estimate).
#![cfg_attr(not(feature = "cudnn"), allow(dead_code))]

/// Bytes of the cuDNN workspace: allocated once per thread and GPU by the first cuDNN
/// convolution, kept for the rest of the thread, shared by every convolution and pass. An
/// algorithm that needs more is not used (see the module docs).
pub const CUDNN_WORKSPACE_BYTES: usize = 32 << 20;

/// Whether this build runs CUDA convolutions through cuDNN (the `cudnn` feature) instead of the
/// im2col + cuBLAS op.
pub(crate) const ENABLED: bool = cfg!(feature = "cudnn");

/// Bytes the CUDA conv op keeps allocated between steps in this build: the cuDNN workspace
/// with the `cudnn` feature, nothing for the im2col op (its columns are freed after each pass).
pub fn cuda_runtime_bytes() -> u64 {
    if ENABLED {
        CUDNN_WORKSPACE_BYTES as u64
    } else {
        0
    }
}

/// Transient bytes one pass of the CUDA conv op allocates besides its result, in this build:
/// none with cuDNN (it works in the persistent workspace), the im2col op's columns otherwise
/// ([`super::conv2d_cuda::cuda_scratch_bytes`], same arguments).
#[allow(clippy::too_many_arguments)]
pub fn cuda_pass_scratch_bytes(
    pass: super::conv2d_cuda::ConvPass,
    n: usize,
    cin: usize,
    cout: usize,
    k: usize,
    ho: usize,
    wo: usize,
    pointwise: bool,
    dtype: candle_core::DType,
) -> u64 {
    if ENABLED {
        0
    } else {
        super::conv2d_cuda::cuda_scratch_bytes(pass, n, cin, cout, k, ho, wo, pointwise, dtype)
    }
}

/// The algorithm one pass runs: the first of cuDNN's first-ranked one (`best`, an error when the
/// heuristics found none) and then `fallbacks` that is `allowed` and whose workspace (`size`) fits
/// in `budget`; `None` when none is. A candidate whose size query fails (cuDNN does not support it
/// for this convolution) is passed over.
fn choose_algorithm<A: Copy, E>(
    best: Result<A, E>,
    allowed: impl Fn(A) -> bool,
    size: impl Fn(A) -> Result<usize, E>,
    fallbacks: &[A],
    budget: usize,
) -> Option<A> {
    let fits = |a: A| size(a).is_ok_and(|bytes| bytes <= budget);
    best.ok()
        .into_iter()
        .chain(fallbacks.iter().copied())
        .find(|&a| allowed(a) && fits(a))
}

#[cfg(feature = "cudnn")]
pub(super) use cuda::launch;

/// Free this thread's cuDNN workspaces: the next cuDNN convolution allocates its workspace again,
/// from the pool that is then the device's current one. memtrain calls it after the self-check
/// (which runs before the run's memory pool exists), so that a run's workspace comes from the pool
/// `--memory-limit` bounds. Nothing to do without the `cudnn` feature.
pub fn release_workspace() {
    #[cfg(feature = "cudnn")]
    cuda::release_workspace();
}

#[cfg(feature = "cudnn")]
mod cuda {
    use std::any::Any;
    use std::cell::RefCell;
    use std::collections::{HashMap, HashSet};
    use std::sync::Arc;

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::cudnn::{
        sys as dnn, ConvBackwardData, ConvBackwardFilter, ConvDescriptor, ConvForward, Cudnn,
        CudnnDataType, CudnnError, FilterDescriptor, TensorDescriptor,
    };
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaDevice, CudaStorage, DType, Layout};
    use half::{bf16, f16};

    use super::CUDNN_WORKSPACE_BYTES;
    use crate::conv2d_cuda;
    use crate::geom::{ConvPass, Geom};
    use crate::util::{alloc_len, cuda_view, cudnn_nondeterministic, dispatch_float, int32, tf32};

    /// An element type of the op: its cuDNN compute type and the scaling constants.
    trait Elem: CudnnDataType + CudaDType + DeviceRepr + ValidAsZeroBits + Copy + 'static {
        /// The type cuDNN multiplies and sums in (f32 for f32 and the half types, f64 for f64).
        type Compute: CudnnDataType + 'static;
        const ONE: Self;
        const ZERO: Self;
        /// The math type: whether tensor cores (TF32 for f32) may be used.
        fn math() -> dnn::cudnnMathType_t;
    }

    impl Elem for f32 {
        type Compute = f32;
        const ONE: Self = 1.0;
        const ZERO: Self = 0.0;
        fn math() -> dnn::cudnnMathType_t {
            // PyTorch's mapping of `allow_tf32`: default math (TF32 allowed) or FMA only.
            if tf32() {
                dnn::cudnnMathType_t::CUDNN_DEFAULT_MATH
            } else {
                dnn::cudnnMathType_t::CUDNN_FMA_MATH
            }
        }
    }

    impl Elem for f64 {
        type Compute = f64;
        const ONE: Self = 1.0;
        const ZERO: Self = 0.0;
        fn math() -> dnn::cudnnMathType_t {
            dnn::cudnnMathType_t::CUDNN_DEFAULT_MATH
        }
    }

    macro_rules! half_elem {
        ($t:ty) => {
            impl Elem for $t {
                type Compute = f32;
                const ONE: Self = <$t>::ONE;
                const ZERO: Self = <$t>::ZERO;
                fn math() -> dnn::cudnnMathType_t {
                    dnn::cudnnMathType_t::CUDNN_TENSOR_OP_MATH
                }
            }
        };
    }
    half_elem!(f16);
    half_elem!(bf16);

    /// What identifies a plan: the geometry (without the im2col op's forced chunk), the dtype,
    /// the math mode and whether non-deterministic algorithms may run (`--tf32` and
    /// `--cudnn-nondeterministic` may differ between two trainers of one process).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    struct PlanKey {
        dims: [usize; 8],
        dtype: DType,
        tf32: bool,
        nondeterministic: bool,
    }

    impl PlanKey {
        fn new(g: &Geom, dtype: DType) -> Self {
            PlanKey {
                dims: [g.n, g.cin, g.h, g.w, g.cout, g.k, g.stride, g.pad],
                dtype,
                tf32: tf32(),
                nondeterministic: cudnn_nondeterministic(),
            }
        }
    }

    /// The descriptors of one convolution and the algorithm of each pass.
    struct Plan<T: Elem> {
        x: TensorDescriptor<T>,
        w: FilterDescriptor<T>,
        y: TensorDescriptor<T>,
        conv: ConvDescriptor<T::Compute>,
        fwd: dnn::cudnnConvolutionFwdAlgo_t,
        bwd_data: dnn::cudnnConvolutionBwdDataAlgo_t,
        bwd_filter: dnn::cudnnConvolutionBwdFilterAlgo_t,
    }

    /// cuDNN takes `int` sizes.
    fn int(what: &str, v: usize) -> candle_core::Result<i32> {
        int32("conv2d (cuDNN)", what, v)
    }

    fn dnn_err(e: CudnnError) -> candle_core::Error {
        candle_core::Error::Msg(format!("conv2d (cuDNN): {e}"))
    }

    /// cuDNN 9 numbers the statuses of an unsupported configuration 3000-3999.
    fn unsupported(e: &CudnnError) -> bool {
        (e.0 as u32) / 1000 == 3
    }

    /// [`super::choose_algorithm`] within [`CUDNN_WORKSPACE_BYTES`].
    fn choose<A: Copy>(
        best: Result<A, CudnnError>,
        allowed: impl Fn(A) -> bool,
        size: impl Fn(A) -> Result<usize, CudnnError>,
        fallbacks: &[A],
    ) -> Result<A, CudnnError> {
        // None fitting is reported as unsupported, so that the im2col op takes the shape over.
        super::choose_algorithm(best, allowed, size, fallbacks, CUDNN_WORKSPACE_BYTES).ok_or(
            CudnnError(dnn::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED_SHAPE),
        )
    }

    /// [`choose`] for the cuDNN op descriptor `$op` (a `ConvForward`, `ConvBackwardData` or
    /// `ConvBackwardFilter`): they share `pick_algorithm` and `get_workspace_size` by name, not
    /// by a trait, hence a macro rather than a generic function. `$allowed` says which picks
    /// may run (see [`crate::set_cudnn_nondeterministic`]).
    macro_rules! pick {
        ($op:expr, $allowed:expr, $fallbacks:expr $(,)?) => {{
            let op = $op;
            choose(
                op.pick_algorithm(),
                $allowed,
                |a| op.get_workspace_size(a),
                $fallbacks,
            )?
        }};
    }

    use dnn::cudnnConvolutionBwdDataAlgo_t as Data;
    use dnn::cudnnConvolutionBwdFilterAlgo_t as Filter;
    use dnn::cudnnConvolutionFwdAlgo_t as Fwd;

    /// Forward algorithms to fall back on, in order (all deterministic).
    const FWD_FALLBACKS: [Fwd; 5] = [
        Fwd::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        Fwd::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        Fwd::CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        Fwd::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
        Fwd::CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
    ];
    /// Backward-data algorithms to fall back on: the deterministic ones, then `ALGO_0`, which needs
    /// no workspace but runs only where non-deterministic algorithms may.
    const DATA_FALLBACKS: [Data; 6] = [
        Data::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        Data::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
        Data::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        Data::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        Data::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        Data::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
    ];
    /// Backward-filter algorithms to fall back on, as [`DATA_FALLBACKS`] (`ALGO_0` last).
    const FILTER_FALLBACKS: [Filter; 5] = [
        Filter::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        Filter::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
        Filter::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
        Filter::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
        Filter::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
    ];

    /// Whether a backward-data algorithm gives the same bits every run: all but `ALGO_0`, which
    /// sums with atomic adds (cuDNN's documented determinism of each algorithm).
    fn bwd_data_deterministic(a: dnn::cudnnConvolutionBwdDataAlgo_t) -> bool {
        a != dnn::cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0
    }

    /// Whether a backward-filter algorithm gives the same bits every run: all but `ALGO_0` and
    /// `ALGO_3`, which sum with atomic adds.
    fn bwd_filter_deterministic(a: dnn::cudnnConvolutionBwdFilterAlgo_t) -> bool {
        use dnn::cudnnConvolutionBwdFilterAlgo_t::*;
        !matches!(
            a,
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 | CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3
        )
    }

    impl<T: Elem> Plan<T> {
        fn new(
            handle: &Arc<Cudnn>,
            g: &Geom,
            key: PlanKey,
        ) -> candle_core::Result<Result<Self, CudnnError>> {
            let nchw = dnn::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
            let (n, cin, h, w) = (
                int("N", g.n)?,
                int("Cin", g.cin)?,
                int("H", g.h)?,
                int("W", g.w)?,
            );
            let (cout, k) = (int("Cout", g.cout)?, int("K", g.k)?);
            let (ho, wo) = (int("Ho", g.ho)?, int("Wo", g.wo)?);
            let (s, p) = (int("stride", g.stride)?, int("padding", g.pad)?);
            let build = || -> Result<Self, CudnnError> {
                let x = handle.create_4d_tensor::<T>(nchw, [n, cin, h, w])?;
                let wd = handle.create_4d_filter::<T>(nchw, [cout, cin, k, k])?;
                let y = handle.create_4d_tensor::<T>(nchw, [n, cout, ho, wo])?;
                let mut conv = handle.create_conv2d::<T::Compute>(
                    [p, p],
                    [s, s],
                    [1, 1],
                    dnn::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                )?;
                conv.set_math_type(T::math())?;
                let any = key.nondeterministic;
                // Every forward algorithm is deterministic.
                let fwd = pick!(
                    ConvForward {
                        conv: &conv,
                        x: &x,
                        w: &wd,
                        y: &y,
                    },
                    |_| true,
                    &FWD_FALLBACKS,
                );
                let bwd_data = pick!(
                    ConvBackwardData {
                        conv: &conv,
                        dx: &x,
                        w: &wd,
                        dy: &y,
                    },
                    |a| any || bwd_data_deterministic(a),
                    &DATA_FALLBACKS,
                );
                let bwd_filter = pick!(
                    ConvBackwardFilter {
                        conv: &conv,
                        x: &x,
                        dw: &wd,
                        dy: &y,
                    },
                    |a| any || bwd_filter_deterministic(a),
                    &FILTER_FALLBACKS,
                );
                Ok(Plan {
                    x,
                    w: wd,
                    y,
                    conv,
                    fwd,
                    bwd_data,
                    bwd_filter,
                })
            };
            Ok(build())
        }

        /// Runs `pass` from the op's two inputs into `out`, in `ws`.
        fn run(
            &self,
            pass: ConvPass,
            in0: &candle_core::cuda_backend::cudarc::driver::CudaView<'_, T>,
            in1: &candle_core::cuda_backend::cudarc::driver::CudaView<'_, T>,
            out: &mut CudaSlice<T>,
            ws: &mut CudaSlice<u8>,
        ) -> Result<(), CudnnError> {
            let scale = (T::ONE, T::ZERO);
            // SAFETY (all three): the descriptors were built from the geometry the wrapper
            // validated, the views cover exactly the contiguous operands of that geometry (x or
            // dy, w or dy as the pass says), `out` has the result's element count, and the
            // workspace is at least what the chosen algorithm needs (`choose`). Everything runs
            // on the handle's stream, which is Candle's.
            unsafe {
                match pass {
                    ConvPass::Forward => ConvForward {
                        conv: &self.conv,
                        x: &self.x,
                        w: &self.w,
                        y: &self.y,
                    }
                    .launch(self.fwd, Some(ws), scale, in0, in1, out),
                    ConvPass::InputGrad => ConvBackwardData {
                        conv: &self.conv,
                        dx: &self.x,
                        w: &self.w,
                        dy: &self.y,
                    }
                    .launch(self.bwd_data, Some(ws), scale, out, in1, in0),
                    ConvPass::WeightGrad => ConvBackwardFilter {
                        conv: &self.conv,
                        x: &self.x,
                        dw: &self.w,
                        dy: &self.y,
                    }
                    .launch(self.bwd_filter, Some(ws), scale, in0, out, in1),
                }
            }
        }
    }

    /// Which state a device uses: its GPU and the stream Candle runs it on (the same for every
    /// `CudaDevice` of that GPU opened on this thread).
    #[derive(Clone, Copy, PartialEq, Eq, Hash)]
    struct StreamKey {
        ordinal: usize,
        stream: usize,
    }

    impl StreamKey {
        fn of(dev: &CudaDevice) -> Self {
            let stream = dev.cuda_stream();
            StreamKey {
                ordinal: stream.context().ordinal(),
                stream: stream.cu_stream() as usize,
            }
        }
    }

    /// This thread's cuDNN state for one GPU and stream.
    struct DeviceState {
        handle: Arc<Cudnn>,
        workspace: Option<CudaSlice<u8>>,
        /// `Plan<T>` per key; `None` where cuDNN does not support the convolution.
        plans: HashMap<PlanKey, Option<Box<dyn Any>>>,
    }

    thread_local! {
        // Per thread because cuDNN handles are neither Send nor Sync (Candle keeps its own
        // handles the same way).
        static STATE: RefCell<HashMap<StreamKey, DeviceState>> = RefCell::new(HashMap::new());
    }

    /// When cuDNN turned a convolution down.
    #[derive(Clone, Copy)]
    enum Refusal {
        /// No plan: no allowed algorithm fits the workspace for some pass, or the descriptors
        /// were refused.
        WhenPlanned,
        /// A planned pass failed to launch as not supported.
        AtLaunch,
    }

    /// Shapes already reported as falling back to the im2col op (one warning each).
    fn warn_fallback(key: PlanKey, e: &CudnnError, when: Refusal) {
        use std::sync::Mutex;
        static WARNED: Mutex<Option<HashSet<PlanKey>>> = Mutex::new(None);
        let mut warned = WARNED.lock().unwrap_or_else(|p| p.into_inner());
        if !warned.get_or_insert_with(HashSet::new).insert(key) {
            return;
        }
        let why = match when {
            Refusal::WhenPlanned => format!(
                "has no{} algorithm for every pass of conv2d {:?} in {:?} within its {} MiB workspace",
                if key.nondeterministic { "" } else { " deterministic" },
                key.dims,
                key.dtype,
                CUDNN_WORKSPACE_BYTES >> 20
            ),
            Refusal::AtLaunch => format!(
                "refused to launch conv2d {:?} in {:?}",
                key.dims, key.dtype
            ),
        };
        eprintln!("warning: cuDNN {why} ({e}); using the im2col + cuBLAS op for it");
    }

    fn pass_on<T: Elem>(
        pass: ConvPass,
        g: &Geom,
        a: &CudaStorage,
        la: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        let dev: CudaDevice = a.device().clone();
        let out_len = g.result_len(pass);
        // cuDNN rejects empty tensors: an empty batch has an empty result, or a zero weight
        // gradient.
        if g.n == 0 || out_len == 0 {
            return Ok(CudaStorage::wrap_cuda_slice(
                dev.alloc_zeros::<T>(alloc_len(out_len))?,
                dev,
            ));
        }
        let in0 = cuda_view(a, la, "conv2d", "first operand")?;
        let in1 = cuda_view(b, lb, "conv2d", "second operand")?;
        let key = PlanKey::new(g, a.dtype());
        let ran = STATE.with(|state| -> candle_core::Result<Option<CudaSlice<T>>> {
            let mut state = state.borrow_mut();
            let st = match state.entry(StreamKey::of(&dev)) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => v.insert(DeviceState {
                    handle: Cudnn::new(dev.cuda_stream()).map_err(dnn_err)?,
                    workspace: None,
                    plans: HashMap::new(),
                }),
            };
            if !st.plans.contains_key(&key) {
                let plan = match Plan::<T>::new(&st.handle, g, key)? {
                    Ok(p) => Some(Box::new(p) as Box<dyn Any>),
                    Err(e) if unsupported(&e) => {
                        warn_fallback(key, &e, Refusal::WhenPlanned);
                        None
                    }
                    Err(e) => return Err(dnn_err(e)),
                };
                st.plans.insert(key, plan);
            }
            let Some(plan) = st.plans.get(&key).and_then(|p| p.as_ref()) else {
                return Ok(None);
            };
            let plan = plan.downcast_ref::<Plan<T>>().ok_or_else(|| {
                candle_core::Error::Msg("conv2d (cuDNN): plan of another dtype".into())
            })?;
            if st.workspace.is_none() {
                // SAFETY: cuDNN only writes scratch here before reading it.
                st.workspace = Some(unsafe { dev.alloc::<u8>(CUDNN_WORKSPACE_BYTES)? });
            }
            let ws = st.workspace.as_mut().expect("allocated above");
            // SAFETY: every element of the result is written by the pass (beta = 0).
            let mut out = unsafe { dev.alloc::<T>(out_len)? };
            match plan.run(pass, &in0, &in1, &mut out, ws) {
                Ok(()) => Ok(Some(out)),
                // Planned, but refused at launch as not supported: the im2col op takes the shape
                // over from now on. Any other failure is the run's error.
                Err(e) if unsupported(&e) => {
                    warn_fallback(key, &e, Refusal::AtLaunch);
                    st.plans.insert(key, None);
                    Ok(None)
                }
                Err(e) => Err(dnn_err(e)),
            }
        })?;
        match ran {
            Some(out) => Ok(CudaStorage::wrap_cuda_slice(out, dev)),
            None => conv2d_cuda::launch(pass, g, a, la, b, lb),
        }
    }

    /// See [`super::release_workspace`].
    pub(super) fn release_workspace() {
        STATE.with(|state| {
            for st in state.borrow_mut().values_mut() {
                st.workspace = None;
            }
        });
    }

    /// Runs `pass` of the convolution `g` on two same-dtype operands through cuDNN and returns
    /// its result storage (through the im2col op for a shape cuDNN does not support).
    pub(crate) fn launch(
        pass: ConvPass,
        g: &Geom,
        a: &CudaStorage,
        la: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        dispatch_float!(
            a.dtype(),
            [F32, F64, F16, BF16],
            |T| pass_on::<T>(pass, g, a, la, b, lb),
            |dt| candle_core::bail!("conv2d: unsupported dtype {dt:?} (f32, f64, f16, bf16)"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_ranked_algorithm_runs_when_its_workspace_fits() {
        let size = |a: u8| -> Result<usize, ()> { Ok([0, 10, 100][a as usize]) };
        let all = |_| true;
        assert_eq!(choose_algorithm(Ok(1), all, size, &[0], 50), Some(1));
        assert_eq!(choose_algorithm(Ok(2), all, size, &[0], 100), Some(2));
        // Too large for the budget, or no ranking at all: the first fallback that fits.
        assert_eq!(choose_algorithm(Ok(2), all, size, &[0], 50), Some(0));
        assert_eq!(
            choose_algorithm(Err(()), all, size, &[2, 1, 0], 50),
            Some(1)
        );
        // Nothing fits.
        assert_eq!(choose_algorithm(Ok(2), all, size, &[1], 5), None);
        // A candidate cuDNN does not support (its size query fails) is passed over.
        let partial = |a: u8| if a == 1 { Err(()) } else { Ok(0) };
        assert_eq!(choose_algorithm(Ok(1), all, partial, &[1, 2], 50), Some(2));
        assert_eq!(
            choose_algorithm(Ok(1), all, |_| Err::<usize, ()>(()), &[0], 50),
            None
        );
    }

    #[test]
    fn a_pick_that_is_not_allowed_gives_way_to_the_fallbacks() {
        let size = |_: u8| -> Result<usize, ()> { Ok(0) };
        // As a deterministic-only choice: 0 (say, an atomic-add algorithm) is refused even
        // though it fits, and the first fallback runs instead.
        let deterministic = |a: u8| a != 0;
        assert_eq!(
            choose_algorithm(Ok(0), deterministic, size, &[1], 50),
            Some(1)
        );
        assert_eq!(
            choose_algorithm(Ok(2), deterministic, size, &[1], 50),
            Some(2)
        );
    }

    #[test]
    fn the_estimate_sees_the_workspace_only_in_a_cudnn_build() {
        use super::super::conv2d_cuda::{cuda_scratch_bytes, ConvPass};
        let args = (
            ConvPass::Forward,
            512,
            32,
            32,
            3,
            32,
            32,
            false,
            candle_core::DType::F32,
        );
        let im2col = cuda_scratch_bytes(
            args.0, args.1, args.2, args.3, args.4, args.5, args.6, args.7, args.8,
        );
        let here = cuda_pass_scratch_bytes(
            args.0, args.1, args.2, args.3, args.4, args.5, args.6, args.7, args.8,
        );
        if ENABLED {
            assert_eq!(
                (here, cuda_runtime_bytes()),
                (0, CUDNN_WORKSPACE_BYTES as u64)
            );
        } else {
            assert_eq!((here, cuda_runtime_bytes()), (im2col, 0));
            assert!(im2col > 0);
        }
    }
}
