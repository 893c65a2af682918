//! GPU time of each convolution pass and between a caller's marks: CUDA events recorded on the
//! stream around the work, read by [`take`] where the caller synchronizes anyway, so timing adds
//! no synchronization. A pass is keyed by what it is (forward, input or weight gradient), its
//! shape and dtype, and its route: the cuDNN algorithm with the workspace it asks for, or the
//! im2col op. On when [`set_enabled`] says so (memtrain's trainer: eager CUDA steps, never while
//! a CUDA graph is captured); without the `cuda` feature, or on the CPU, nothing is recorded.
//! A failure to make or read an event loses that timing, never the step.

use std::sync::atomic::{AtomicBool, Ordering};

/// One timed convolution pass.
#[derive(Debug, Clone, PartialEq)]
pub struct PassTime {
    /// `forward`, `input gradient` or `weight gradient`.
    pub pass: &'static str,
    /// `N×Cin×H×W → Cout, KxK stride S pad P`.
    pub shape: String,
    /// The dtype, as Candle names it (`f32`, `bf16`).
    pub dtype: String,
    /// `cudnn ALGO_1` (the algorithm that ran) or `im2col`.
    pub route: String,
    /// Workspace the cuDNN algorithm asks for (0 on the im2col op, whose columns are its own).
    pub workspace_bytes: u64,
    /// GPU time of the pass, in microseconds.
    pub us: f64,
}

/// What [`take`] read: the passes in the order they ran, and the time between consecutive marks
/// ([`mark`]; one fewer than the marks).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Taken {
    /// The timed passes.
    pub passes: Vec<PassTime>,
    /// Microseconds between mark `i` and mark `i + 1`; `None` where an event could not be read.
    pub between_marks_us: Vec<Option<f64>>,
}

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Record GPU time from now on (`true`) or not. Process-wide, like [`crate::set_tf32`]; the
/// events are recorded per thread, on the stream that runs the work.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether [`set_enabled`] is on.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// `N×Cin×H×W → Cout, KxK stride S pad P` of a convolution.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn shape_of(g: &crate::geom::Geom) -> String {
    format!(
        "{}×{}×{}×{} → {}, {k}x{k} stride {} pad {}",
        g.n,
        g.cin,
        g.h,
        g.w,
        g.cout,
        g.stride,
        g.pad,
        k = g.k
    )
}

#[cfg(feature = "cudnn")]
pub(crate) use cuda::note_cudnn_route;
#[cfg(feature = "cuda")]
pub(crate) use cuda::timed_pass;
#[cfg(feature = "cuda")]
pub use cuda::{mark, take};

/// Without the `cuda` feature there is nothing to read.
#[cfg(not(feature = "cuda"))]
pub fn take() -> Taken {
    Taken::default()
}

/// Without the `cuda` feature there is no stream to mark.
#[cfg(not(feature = "cuda"))]
pub fn mark(_device: &candle_core::Device) {}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{enabled, shape_of, PassTime, Taken};
    use crate::geom::{ConvPass, Geom};
    use candle_core::cuda_backend::cudarc::driver::{sys, CudaEvent};
    use candle_core::{CudaDevice, DType};
    use std::cell::{Cell, RefCell};

    /// The most passes or marks held unread.
    const MAX_PENDING: usize = 4096;

    /// A pass whose events are recorded and not yet read.
    struct Pending {
        pass: &'static str,
        shape: String,
        dtype: DType,
        route: String,
        workspace_bytes: u64,
        start: CudaEvent,
        end: CudaEvent,
    }

    thread_local! {
        static PASSES: RefCell<Vec<Pending>> = const { RefCell::new(Vec::new()) };
        static MARKS: RefCell<Vec<Option<CudaEvent>>> = const { RefCell::new(Vec::new()) };
        /// The cuDNN algorithm and its workspace of the pass running now, noted by the cuDNN op;
        /// a pass that ends without one ran on the im2col op.
        static ROUTE: Cell<Option<(String, u64)>> = const { Cell::new(None) };
    }

    fn event(dev: &CudaDevice) -> Option<CudaEvent> {
        // Timing events (cudarc's default disables timing).
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        dev.cuda_stream().record_event(flags).ok()
    }

    /// The cuDNN op ran the pass with `algorithm`, which asks for `workspace_bytes`.
    #[cfg(feature = "cudnn")]
    pub(crate) fn note_cudnn_route(algorithm: String, workspace_bytes: u64) {
        ROUTE.with(|r| r.set(Some((algorithm, workspace_bytes))));
    }

    /// Runs `f`, the convolution pass `pass` of `g` in `dtype` on `dev`, between two events.
    pub(crate) fn timed_pass<R>(
        dev: &CudaDevice,
        pass: ConvPass,
        g: &Geom,
        dtype: DType,
        f: impl FnOnce() -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        if !enabled() {
            return f();
        }
        ROUTE.with(|r| r.set(None));
        let start = event(dev);
        let r = f()?;
        let end = event(dev);
        let (route, workspace_bytes) = match ROUTE.with(|r| r.take()) {
            Some((algo, ws)) => (format!("cudnn {algo}"), ws),
            None => ("im2col".to_string(), 0),
        };
        if let (Some(start), Some(end)) = (start, end) {
            PASSES.with(|p| {
                let mut p = p.borrow_mut();
                // Work no step reads (an evaluation, gradients outside a step) is dropped at
                // the next step's start; this bounds what it holds until then.
                if p.len() >= MAX_PENDING {
                    return;
                }
                p.push(Pending {
                    pass: pass.name(["forward", "input gradient", "weight gradient"]),
                    shape: shape_of(g),
                    dtype,
                    route,
                    workspace_bytes,
                    start,
                    end,
                })
            });
        }
        Ok(r)
    }

    /// Records a mark on `device`'s stream (nothing on the CPU or when timing is off).
    pub fn mark(device: &candle_core::Device) {
        if let (true, candle_core::Device::Cuda(dev)) = (enabled(), device) {
            MARKS.with(|m| {
                let mut m = m.borrow_mut();
                if m.len() < MAX_PENDING {
                    m.push(event(dev));
                }
            });
        }
    }

    /// The passes and the time between marks recorded on this thread since the last `take`,
    /// read from their events (the caller has synchronized the stream: reading waits for
    /// nothing then).
    pub fn take() -> Taken {
        let passes = PASSES.with(|p| std::mem::take(&mut *p.borrow_mut()));
        let marks = MARKS.with(|m| std::mem::take(&mut *m.borrow_mut()));
        let us = |a: &CudaEvent, b: &CudaEvent| a.elapsed_ms(b).ok().map(|ms| ms as f64 * 1e3);
        Taken {
            passes: passes
                .into_iter()
                .filter_map(|p| {
                    Some(PassTime {
                        us: us(&p.start, &p.end)?,
                        pass: p.pass,
                        shape: p.shape,
                        dtype: format!("{:?}", p.dtype).to_lowercase(),
                        route: p.route,
                        workspace_bytes: p.workspace_bytes,
                    })
                })
                .collect(),
            between_marks_us: marks
                .windows(2)
                .map(|w| match (&w[0], &w[1]) {
                    (Some(a), Some(b)) => us(a, b),
                    _ => None,
                })
                .collect(),
        }
    }
}
