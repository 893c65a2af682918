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
//! - one workspace of [`crate::cudnn_workspace_bytes`] (memtrain's `--cudnn-workspace`, default
//!   [`crate::DEFAULT_CUDNN_WORKSPACE_BYTES`]), allocated by the first cuDNN convolution and
//!   reused by every later one, for the rest of the thread's life (a process that builds many
//!   trainers, like memtrain's GPU tests, holds one, not one per trainer, made anew when the size
//!   changes). Each pass runs the
//!   algorithm cuDNN's heuristics rank first when it may run and its workspace fits in that budget,
//!   else the first of the pass's deterministic algorithms that cuDNN supports there and that fits
//!   (`ALGO_1` first for the backward passes), and a pass that has none runs on the im2col op
//!   (the shape's other passes stay on cuDNN). A fixed size
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
//! A pass cuDNN does not support, when planning it or at a launch, falls back to the im2col op,
//! with a one-time warning that names each candidate algorithm's workspace (or why it was passed
//! over). The memory estimate asks the same plans which passes run where
//! ([`cuda_pass_scratch_bytes`]), so it counts the im2col op's columns for exactly those.
//! It ran on an H200 on 2026-11-27 (`docs/results/gpu-2026-11-27.md`, `gpu-2026-11-27b.md`), where
//! this crate's `tests/conv2d.rs` with `--features cuda,cudnn` checked its numbers against the
//! CPU.

// Without the feature only the constants below are used (by a memory estimate).
#![cfg_attr(not(feature = "cudnn"), allow(dead_code))]

use crate::geom::ConvPass;

/// Whether this build runs CUDA convolutions through cuDNN (the `cudnn` feature) instead of the
/// im2col + cuBLAS op.
pub(crate) const ENABLED: bool = cfg!(feature = "cudnn");

/// Bytes the CUDA conv op keeps allocated between steps in this build with a cuDNN workspace of
/// `workspace_bytes`: that workspace with the `cudnn` feature, nothing for the im2col op (its
/// columns are freed after each pass).
pub fn cuda_runtime_bytes(workspace_bytes: u64) -> u64 {
    if cudnn_build() {
        workspace_bytes
    } else {
        0
    }
}

/// Transient bytes one pass of the CUDA conv op allocates besides its result, for input `x_dims`
/// `[N, Cin, H, W]` and weight `w_dims` `[Cout, Cin, K, K]`: none where cuDNN runs the pass (it
/// works in the persistent workspace), the im2col op's columns where that op runs it
/// ([`super::conv2d_cuda::cuda_scratch_bytes`]): always without the `cudnn` feature, and with it
/// for a pass this thread's cuDNN plan refuses ([`pass_runs_on_cudnn`]). An invalid shape has
/// none.
pub fn cuda_pass_scratch_bytes(
    pass: ConvPass,
    x_dims: &[usize],
    w_dims: &[usize],
    stride: usize,
    pad: usize,
    dtype: candle_core::DType,
) -> u64 {
    let Ok(g) = crate::geom::Geom::new(x_dims, w_dims, stride, pad, None) else {
        return 0;
    };
    if cudnn_build() && pass_runs_on_cudnn(&g, dtype, pass) {
        return 0;
    }
    let pointwise = g.k == 1 && g.pad == 0 && g.stride == 1;
    super::conv2d_cuda::cuda_scratch_bytes(
        pass, g.n, g.cin, g.cout, g.k, g.ho, g.wo, pointwise, dtype,
    )
}

/// A convolution pass that a GPU's cuDNN left to the im2col op, as its warning names it: the
/// convolution `[N, Cin, H, W, Cout, K, stride, pad]`, the dtype and the pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefusedPass {
    /// `[N, Cin, H, W, Cout, K, stride, pad]`.
    pub dims: [usize; 8],
    /// The dtype the pass ran in.
    pub dtype: candle_core::DType,
    /// The pass.
    pub pass: ConvPass,
}

thread_local! {
    /// The passes [`replay_routes`] replays on this thread, while it runs.
    static REPLAYED: std::cell::RefCell<Option<Vec<RefusedPass>>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f` with this thread's CUDA estimate sized as a `cudnn` build on a GPU whose cuDNN left
/// exactly the `refused` passes to the im2col op (the workspace, and columns for those passes),
/// whatever this build and machine are: tests check the CUDA estimate against a GPU session's
/// measured peaks on a machine without a GPU.
pub fn replay_routes<R>(refused: &[RefusedPass], f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Vec<RefusedPass>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            REPLAYED.with(|r| *r.borrow_mut() = self.0.take());
        }
    }
    let _restore = Restore(REPLAYED.with(|r| r.borrow_mut().replace(refused.to_vec())));
    f()
}

/// Whether the CUDA conv op runs through cuDNN: this build's `cudnn` feature, or a replay.
fn cudnn_build() -> bool {
    ENABLED || REPLAYED.with(|r| r.borrow().is_some())
}

/// Whether cuDNN runs `pass` of the convolution `g` in `dtype` under the current math and
/// determinism settings: as replayed ([`replay_routes`]), else as the plan the op itself uses
/// says, made now if it is new, on the GPU this thread opened ([`open`]) or ran a cuDNN
/// convolution on. Where this thread has none (a dry run without a GPU) it cannot ask and
/// answers that cuDNN does.
fn pass_runs_on_cudnn(g: &crate::geom::Geom, dtype: candle_core::DType, pass: ConvPass) -> bool {
    let dims = [g.n, g.cin, g.h, g.w, g.cout, g.k, g.stride, g.pad];
    let replayed = REPLAYED.with(|r| {
        r.borrow().as_ref().map(|refused| {
            !refused
                .iter()
                .any(|p| p.dims == dims && p.dtype == dtype && p.pass == pass)
        })
    });
    if let Some(runs) = replayed {
        return runs;
    }
    #[cfg(feature = "cudnn")]
    {
        cuda::pass_runs_on_cudnn(g, dtype, pass).unwrap_or(true)
    }
    #[cfg(not(feature = "cudnn"))]
    {
        let _ = (g, dtype, pass);
        true
    }
}

/// Why an algorithm was passed over for a pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PassedOver {
    /// Not allowed (a non-deterministic algorithm where only deterministic ones may run).
    NotAllowed,
    /// cuDNN does not support it for this convolution (its workspace query failed).
    NotSupported,
    /// Its workspace, in bytes, is over the budget.
    TooLarge(usize),
}

/// The algorithm one pass runs: the first of cuDNN's first-ranked one (`best`, an error when the
/// heuristics found none) and then `fallbacks` that is `allowed` and whose workspace (`size`) fits
/// in `budget`; when none is, every candidate with why it was passed over.
fn choose_algorithm<A: Copy + PartialEq, E>(
    best: Result<A, E>,
    allowed: impl Fn(A) -> bool,
    size: impl Fn(A) -> Result<usize, E>,
    fallbacks: &[A],
    budget: usize,
) -> Result<A, Vec<(A, PassedOver)>> {
    let mut passed = Vec::new();
    for a in best.ok().into_iter().chain(fallbacks.iter().copied()) {
        if passed.iter().any(|&(b, _)| b == a) {
            continue;
        }
        let why = if !allowed(a) {
            PassedOver::NotAllowed
        } else {
            match size(a) {
                Ok(bytes) if bytes <= budget => return Ok(a),
                Ok(bytes) => PassedOver::TooLarge(bytes),
                Err(_) => PassedOver::NotSupported,
            }
        };
        passed.push((a, why));
    }
    Err(passed)
}

/// One line of what [`choose_algorithm`] passed over: `ALGO_1 needs 48.0 MiB, FFT not supported,
/// ALGO_0 not deterministic`, each algorithm named by `name`.
fn passed_over_line<A: Copy>(passed: &[(A, PassedOver)], name: impl Fn(A) -> String) -> String {
    passed
        .iter()
        .map(|&(a, why)| match why {
            PassedOver::NotAllowed => format!("{} not deterministic", name(a)),
            PassedOver::NotSupported => format!("{} not supported", name(a)),
            PassedOver::TooLarge(b) => format!("{} needs {:.1} MiB", name(a), b as f64 / 1048576.0),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(feature = "cudnn")]
pub(super) use cuda::launch;

/// Makes this thread's cuDNN state for `device` (a handle on its stream; nothing without the
/// `cudnn` feature or on the CPU), so that [`cuda_pass_scratch_bytes`] asks this thread's plans
/// for that GPU: memtrain calls it on the thread that estimates and trains, before estimating.
///
/// # Errors
/// When cuDNN cannot make a handle.
pub fn open(device: &candle_core::Device) -> candle_core::Result<()> {
    #[cfg(feature = "cudnn")]
    if let candle_core::Device::Cuda(dev) = device {
        cuda::open(dev)?;
    }
    let _ = device;
    Ok(())
}

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
        /// The workspace budget the algorithms were chosen within.
        workspace: usize,
    }

    impl PlanKey {
        fn new(g: &Geom, dtype: DType) -> Self {
            PlanKey {
                dims: [g.n, g.cin, g.h, g.w, g.cout, g.k, g.stride, g.pad],
                dtype,
                tf32: tf32(),
                nondeterministic: cudnn_nondeterministic(),
                workspace: crate::util::cudnn_workspace_bytes(),
            }
        }
    }

    /// The descriptors of one convolution and the algorithm of each pass, or why it has none
    /// (that pass runs on the im2col op).
    struct Plan<T: Elem> {
        x: TensorDescriptor<T>,
        w: FilterDescriptor<T>,
        y: TensorDescriptor<T>,
        conv: ConvDescriptor<T::Compute>,
        /// Each pass's algorithm and the workspace it asks for.
        fwd: Result<(dnn::cudnnConvolutionFwdAlgo_t, usize), String>,
        bwd_data: Result<(dnn::cudnnConvolutionBwdDataAlgo_t, usize), String>,
        bwd_filter: Result<(dnn::cudnnConvolutionBwdFilterAlgo_t, usize), String>,
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

    /// An algorithm's name without cuDNN's prefix: `ALGO_1`, `FFT_TILING`.
    fn algo_name<A: std::fmt::Debug>(a: A) -> String {
        let full = format!("{a:?}");
        let short = ["_FWD_ALGO_", "_BWD_DATA_ALGO_", "_BWD_FILTER_ALGO_"]
            .iter()
            .find_map(|p| full.split_once(p).map(|(_, rest)| rest.to_string()));
        match short {
            Some(rest) if rest.chars().next().is_some_and(|c| c.is_ascii_digit()) => {
                format!("ALGO_{rest}")
            }
            Some(rest) => rest,
            None => full,
        }
    }

    /// [`super::choose_algorithm`] within `budget`: the algorithm and the workspace it asks
    /// for, or why each candidate was passed over (one line).
    fn choose<A: Copy + PartialEq + std::fmt::Debug>(
        best: Result<A, CudnnError>,
        allowed: impl Fn(A) -> bool,
        size: impl Fn(A) -> Result<usize, CudnnError>,
        fallbacks: &[A],
        budget: usize,
    ) -> Result<(A, usize), String> {
        super::choose_algorithm(best, allowed, &size, fallbacks, budget)
            .map(|a| (a, size(a).unwrap_or(0)))
            .map_err(|passed| super::passed_over_line(&passed, algo_name))
    }

    /// [`choose`] for the cuDNN op descriptor `$op` (a `ConvForward`, `ConvBackwardData` or
    /// `ConvBackwardFilter`): they share `pick_algorithm` and `get_workspace_size` by name, not
    /// by a trait, hence a macro rather than a generic function. `$allowed` says which picks
    /// may run (see [`crate::set_cudnn_nondeterministic`]).
    macro_rules! pick {
        ($op:expr, $allowed:expr, $fallbacks:expr, $budget:expr $(,)?) => {{
            let op = $op;
            choose(
                op.pick_algorithm(),
                $allowed,
                |a| op.get_workspace_size(a),
                $fallbacks,
                $budget,
            )
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
                    key.workspace,
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
                    key.workspace,
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
                    key.workspace,
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

        /// The algorithm `pass` runs, by name, with the workspace it asks for; or why it has
        /// none (it runs on the im2col op).
        fn choice(&self, pass: ConvPass) -> Result<(String, u64), &str> {
            fn of<A: std::fmt::Debug + Copy>(
                a: &Result<(A, usize), String>,
            ) -> Result<(String, u64), &str> {
                match a {
                    Ok((a, ws)) => Ok((algo_name(*a), *ws as u64)),
                    Err(why) => Err(why),
                }
            }
            match pass {
                ConvPass::Forward => of(&self.fwd),
                ConvPass::InputGrad => of(&self.bwd_data),
                ConvPass::WeightGrad => of(&self.bwd_filter),
            }
        }

        /// Runs `pass` (one with an algorithm) from the op's two inputs into `out`, in `ws`.
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
                    .launch(algo(&self.fwd)?, Some(ws), scale, in0, in1, out),
                    ConvPass::InputGrad => ConvBackwardData {
                        conv: &self.conv,
                        dx: &self.x,
                        w: &self.w,
                        dy: &self.y,
                    }
                    .launch(
                        algo(&self.bwd_data)?,
                        Some(ws),
                        scale,
                        out,
                        in1,
                        in0,
                    ),
                    ConvPass::WeightGrad => ConvBackwardFilter {
                        conv: &self.conv,
                        x: &self.x,
                        dw: &self.w,
                        dy: &self.y,
                    }
                    .launch(
                        algo(&self.bwd_filter)?,
                        Some(ws),
                        scale,
                        in0,
                        out,
                        in1,
                    ),
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

    /// A convolution's plan (a `Plan<T>`) and, per pass ([`pass_index`]), whether cuDNN runs it.
    struct Planned {
        plan: Box<dyn Any>,
        runs: [bool; 3],
    }

    /// This thread's cuDNN state for one GPU and stream.
    struct DeviceState {
        handle: Arc<Cudnn>,
        workspace: Option<CudaSlice<u8>>,
        /// The plan of each key; `None` where cuDNN refused the convolution's descriptors.
        plans: HashMap<PlanKey, Option<Planned>>,
        /// Why cuDNN refused the descriptors of a key.
        refused_descriptors: HashMap<PlanKey, String>,
        /// The refusals this thread has told of ([`warn_fallback`]), so that a refused pass's
        /// later launches take no lock.
        told: HashSet<(PlanKey, Option<usize>)>,
    }

    thread_local! {
        // Per thread because cuDNN handles are neither Send nor Sync (Candle keeps its own
        // handles the same way).
        static STATE: RefCell<HashMap<StreamKey, DeviceState>> = RefCell::new(HashMap::new());
    }

    const PASSES: [ConvPass; 3] = [ConvPass::Forward, ConvPass::InputGrad, ConvPass::WeightGrad];

    fn pass_index(pass: ConvPass) -> usize {
        match pass {
            ConvPass::Forward => 0,
            ConvPass::InputGrad => 1,
            ConvPass::WeightGrad => 2,
        }
    }

    /// The algorithm of a planned pass (the caller checked that it has one).
    fn algo<A: Copy>(a: &Result<(A, usize), String>) -> Result<A, CudnnError> {
        a.as_ref()
            .map(|&(a, _)| a)
            .map_err(|_| CudnnError(dnn::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED_SHAPE))
    }

    /// Warns once per convolution and pass that the pass runs on the im2col op: `why` says what
    /// cuDNN offered (see [`choose`]) or how it failed.
    fn warn_fallback(key: PlanKey, pass: Option<ConvPass>, why: &str) {
        use std::sync::Mutex;
        static WARNED: Mutex<Option<HashSet<(PlanKey, Option<usize>)>>> = Mutex::new(None);
        let mut warned = WARNED.lock().unwrap_or_else(|p| p.into_inner());
        if !warned
            .get_or_insert_with(HashSet::new)
            .insert((key, pass.map(pass_index)))
        {
            return;
        }
        let conv = format!("conv2d {:?} in {:?}", key.dims, key.dtype);
        match pass {
            Some(pass) => eprintln!(
                "warning: cuDNN has no{} algorithm for the {} of {conv} within its {} MiB workspace \
                 ({why}); that pass runs on the im2col + cuBLAS op",
                if key.nondeterministic { "" } else { " deterministic" },
                pass.name(["forward", "input gradient", "weight gradient"]),
                key.workspace >> 20
            ),
            None => eprintln!(
                "warning: cuDNN refused {conv} ({why}); it runs on the im2col + cuBLAS op"
            ),
        }
    }

    /// Makes the plan of `key` in `st` if it is new. What cuDNN refused is told when a pass
    /// runs ([`pass_on`]), not here: the estimate plans shapes no step may run.
    fn plan<T: Elem>(st: &mut DeviceState, g: &Geom, key: PlanKey) -> candle_core::Result<()> {
        if st.plans.contains_key(&key) {
            return Ok(());
        }
        let planned = match Plan::<T>::new(&st.handle, g, key)? {
            Ok(p) => Some(Planned {
                runs: PASSES.map(|pass| p.choice(pass).is_ok()),
                plan: Box::new(p),
            }),
            Err(e) if unsupported(&e) => {
                st.refused_descriptors.insert(key, e.to_string());
                None
            }
            Err(e) => return Err(dnn_err(e)),
        };
        st.plans.insert(key, planned);
        Ok(())
    }

    /// This thread's state for `dev`, made on first use.
    fn state_of<'a>(
        state: &'a mut HashMap<StreamKey, DeviceState>,
        dev: &CudaDevice,
    ) -> candle_core::Result<&'a mut DeviceState> {
        Ok(match state.entry(StreamKey::of(dev)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(DeviceState {
                handle: Cudnn::new(dev.cuda_stream()).map_err(dnn_err)?,
                workspace: None,
                plans: HashMap::new(),
                refused_descriptors: HashMap::new(),
                told: HashSet::new(),
            }),
        })
    }

    /// See [`super::open`].
    pub(super) fn open(dev: &CudaDevice) -> candle_core::Result<()> {
        STATE.with(|state| state_of(&mut state.borrow_mut(), dev).map(|_| ()))
    }

    /// See [`super::pass_runs_on_cudnn`]: `None` where this thread has no cuDNN state, or the
    /// plan could not be made.
    pub(super) fn pass_runs_on_cudnn(g: &Geom, dtype: DType, pass: ConvPass) -> Option<bool> {
        let key = PlanKey::new(g, dtype);
        STATE.with(|state| {
            let mut state = state.borrow_mut();
            // One GPU and stream per thread in memtrain; with several, any of their plans (the
            // same GPU model plans alike).
            let st = state.values_mut().next()?;
            dispatch_float!(
                dtype,
                [F32, F64, F16, BF16],
                |T| plan::<T>(st, g, key).ok()?,
                |_| return None,
            );
            Some(
                st.plans[&key]
                    .as_ref()
                    .is_some_and(|p| p.runs[pass_index(pass)]),
            )
        })
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
            let st = state_of(&mut state, &dev)?;
            plan::<T>(st, g, key)?;
            let i = pass_index(pass);
            let Some(planned) = st.plans.get(&key).and_then(|p| p.as_ref()) else {
                if st.told.insert((key, None)) {
                    let why = st.refused_descriptors.get(&key).map_or("", String::as_str);
                    warn_fallback(key, None, why);
                }
                return Ok(None);
            };
            let plan = planned.plan.downcast_ref::<Plan<T>>().ok_or_else(|| {
                candle_core::Error::Msg("conv2d (cuDNN): plan of another dtype".into())
            })?;
            if !planned.runs[i] {
                if st.told.insert((key, Some(i))) {
                    let why = plan
                        .choice(pass)
                        .err()
                        .unwrap_or("refused at an earlier launch");
                    warn_fallback(key, Some(pass), why);
                }
                return Ok(None);
            }
            if st
                .workspace
                .as_ref()
                .is_none_or(|w| w.len() != key.workspace.max(1))
            {
                st.workspace = None;
                // SAFETY: cuDNN only writes scratch here before reading it.
                st.workspace = Some(unsafe { dev.alloc::<u8>(key.workspace.max(1))? });
            }
            let ws = st.workspace.as_mut().expect("allocated above");
            // SAFETY: every element of the result is written by the pass (beta = 0).
            let mut out = unsafe { dev.alloc::<T>(out_len)? };
            match plan.run(pass, &in0, &in1, &mut out, ws) {
                Ok(()) => {
                    // Named only while timing: a launch formats nothing otherwise.
                    if crate::gpu_time::enabled() {
                        if let Ok((algorithm, bytes)) = plan.choice(pass) {
                            crate::gpu_time::note_cudnn_route(algorithm, bytes);
                        }
                    }
                    Ok(Some(out))
                }
                // Planned, but refused at launch as not supported: the im2col op takes the pass
                // over from now on. Any other failure is the run's error.
                Err(e) if unsupported(&e) => {
                    st.told.insert((key, Some(i)));
                    warn_fallback(key, Some(pass), &format!("refused at launch: {e}"));
                    if let Some(Some(p)) = st.plans.get_mut(&key) {
                        p.runs[i] = false;
                    }
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
        assert_eq!(choose_algorithm(Ok(1), all, size, &[0], 50), Ok(1));
        assert_eq!(choose_algorithm(Ok(2), all, size, &[0], 100), Ok(2));
        // Too large for the budget, or no ranking at all: the first fallback that fits.
        assert_eq!(choose_algorithm(Ok(2), all, size, &[0], 50), Ok(0));
        assert_eq!(choose_algorithm(Err(()), all, size, &[2, 1, 0], 50), Ok(1));
        // Nothing fits: each candidate once, with its workspace.
        assert_eq!(
            choose_algorithm(Ok(2), all, size, &[1, 2], 5),
            Err(vec![
                (2, PassedOver::TooLarge(100)),
                (1, PassedOver::TooLarge(10))
            ])
        );
        // A candidate cuDNN does not support (its size query fails) is passed over.
        let partial = |a: u8| if a == 1 { Err(()) } else { Ok(0) };
        assert_eq!(choose_algorithm(Ok(1), all, partial, &[1, 2], 50), Ok(2));
        assert_eq!(
            choose_algorithm(Ok(1), all, |_| Err::<usize, ()>(()), &[0], 50),
            Err(vec![
                (1, PassedOver::NotSupported),
                (0, PassedOver::NotSupported)
            ])
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
            Ok(1)
        );
        assert_eq!(
            choose_algorithm(Ok(2), deterministic, size, &[1], 50),
            Ok(2)
        );
        let passed = choose_algorithm(Ok(0), deterministic, size, &[], 50).unwrap_err();
        assert_eq!(
            passed_over_line(&passed, |a| format!("ALGO_{a}")),
            "ALGO_0 not deterministic"
        );
    }

    #[test]
    fn the_refusal_names_each_candidate() {
        let passed = [
            (1u8, PassedOver::TooLarge(48 << 20)),
            (2, PassedOver::NotSupported),
            (0, PassedOver::NotAllowed),
        ];
        assert_eq!(
            passed_over_line(&passed, |a| format!("ALGO_{a}")),
            "ALGO_1 needs 48.0 MiB, ALGO_2 not supported, ALGO_0 not deterministic"
        );
    }

    /// Without a GPU this thread has no cuDNN plan to ask: a `cudnn` build counts its passes
    /// on cuDNN (the workspace, no columns), any other build the im2col op's columns.
    #[test]
    fn the_estimate_sees_the_workspace_only_in_a_cudnn_build() {
        use super::super::conv2d_cuda::{cuda_scratch_bytes, ConvPass};
        use candle_core::DType;
        let im2col =
            cuda_scratch_bytes(ConvPass::Forward, 512, 32, 32, 3, 32, 32, false, DType::F32);
        let here = cuda_pass_scratch_bytes(
            ConvPass::Forward,
            &[512, 32, 32, 32],
            &[32, 32, 3, 3],
            1,
            1,
            DType::F32,
        );
        let ws = crate::DEFAULT_CUDNN_WORKSPACE_BYTES as u64;
        if ENABLED {
            assert_eq!((here, cuda_runtime_bytes(ws)), (0, ws));
        } else {
            assert_eq!((here, cuda_runtime_bytes(ws)), (im2col, 0));
            assert!(im2col > 0);
        }
        // An invalid shape has no scratch.
        let bad = cuda_pass_scratch_bytes(
            ConvPass::Forward,
            &[1, 3, 2, 2],
            &[8, 4, 3, 3],
            1,
            0,
            DType::F32,
        );
        assert_eq!(bad, 0);
    }
}
