//! 2x2 max-pooling with a correct backward.
//!
//! Candle 0.11's `max_pool2d` backward multiplies the gradient by (number of tied maxima) / k²:
//! for a 2x2 window with one maximum the input gradient is a quarter of what it should be, and
//! ties (common in f16/bf16) get more. This op routes each output gradient to the first maximum
//! of its window (row-major), as PyTorch does. The backward recomputes the argmax from the input
//! (which autograd keeps anyway) instead of storing an index tensor. The CUDA kernel is in
//! `cu/pool.cu`; dtype dispatch and operand access go through [`super::util`].

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, Error, Layout, Result, Shape, Tensor, WithDType,
};

use super::util::{cpu_slice, dispatch_float, Float};

/// Max-pool `x` `[N, C, H, W]` with a 2x2 window and stride 2 (H and W must be even), differentiable.
pub fn max_pool2x2(x: &Tensor) -> Result<Tensor> {
    let (_, _, h, w) = x.dims4().map_err(|_| {
        Error::Msg(format!(
            "max_pool2x2 expects a 4D [N,C,H,W] tensor, got shape {:?}",
            x.dims()
        ))
    })?;
    if h % 2 != 0 || w % 2 != 0 {
        return Err(Error::Msg(format!(
            "max_pool2x2 needs even H and W, got {h}x{w}"
        )));
    }
    x.contiguous()?.apply_op1(MaxPool)
}

/// The input gradient of [`max_pool2x2`] from its input `x` and the gradient `grad` of its output:
/// each window's gradient goes to the window's first maximum (recomputed from `x`); no autograd.
pub(crate) fn max_pool2x2_backward(x: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let grad = grad.to_dtype(x.dtype())?.contiguous()?;
    x.contiguous()?.apply_op2_no_bwd(&grad, &MaxPoolGrad)
}

/// The name of the op in errors.
const OP: &str = "max_pool2x2";

struct MaxPool;
struct MaxPoolGrad;

fn dims(l: &Layout) -> candle_core::Result<(usize, usize, usize, usize)> {
    l.shape().dims4()
}

/// The backward's operands agree, on every device: the gradient has the pooled shape of x
/// (`[N, C, H/2, W/2]`; a shorter one would be read past its end) and x's dtype. Returns x's dims.
fn check_grad(
    xl: &Layout,
    x_dtype: candle_core::DType,
    gl: &Layout,
    g_dtype: candle_core::DType,
) -> Result<(usize, usize, usize, usize)> {
    let (n, c, h, w) = dims(xl)?;
    if gl.shape().dims() != [n, c, h / 2, w / 2] {
        candle_core::bail!(
            "{OP} backward: gradient shape {:?} does not match input {:?} (expected [{n}, {c}, {}, {}])",
            gl.shape().dims(),
            xl.shape().dims(),
            h / 2,
            w / 2
        )
    }
    if x_dtype != g_dtype {
        candle_core::bail!("{OP} backward: dtype mismatch {x_dtype:?} vs {g_dtype:?}")
    }
    Ok((n, c, h, w))
}

/// Index (0..4) of the first maximum among a window's four values.
#[inline]
fn argmax4(v: [f32; 4]) -> usize {
    let mut best = 0;
    for i in 1..4 {
        // Strictly greater: the first maximum wins ties; NaN never wins, so a NaN window
        // routes to element 0, as a comparison-based argmax would.
        if v[i] > v[best] {
            best = i;
        }
    }
    best
}

fn window<T: Float>(plane: &[T], w: usize, oy: usize, ox: usize) -> ([f32; 4], [usize; 4]) {
    let i0 = 2 * oy * w + 2 * ox;
    let idx = [i0, i0 + 1, i0 + w, i0 + w + 1];
    (
        [
            plane[idx[0]].to_f32(),
            plane[idx[1]].to_f32(),
            plane[idx[2]].to_f32(),
            plane[idx[3]].to_f32(),
        ],
        idx,
    )
}

fn pool_fwd<T: Float>(x: &[T], planes: usize, h: usize, w: usize) -> Vec<T> {
    let (ho, wo) = (h / 2, w / 2);
    let mut out = Vec::with_capacity(planes * ho * wo);
    for p in 0..planes {
        let plane = &x[p * h * w..(p + 1) * h * w];
        for oy in 0..ho {
            for ox in 0..wo {
                let (v, idx) = window(plane, w, oy, ox);
                out.push(plane[idx[argmax4(v)]]);
            }
        }
    }
    out
}

fn pool_bwd<T: Float>(x: &[T], dy: &[T], planes: usize, h: usize, w: usize) -> Vec<T> {
    let (ho, wo) = (h / 2, w / 2);
    let mut dx = vec![T::ZERO; planes * h * w];
    for p in 0..planes {
        let plane = &x[p * h * w..(p + 1) * h * w];
        let dplane = &mut dx[p * h * w..(p + 1) * h * w];
        let g = &dy[p * ho * wo..(p + 1) * ho * wo];
        for oy in 0..ho {
            for ox in 0..wo {
                let (v, idx) = window(plane, w, oy, ox);
                dplane[idx[argmax4(v)]] = g[oy * wo + ox];
            }
        }
    }
    dx
}

impl CustomOp1 for MaxPool {
    fn name(&self) -> &'static str {
        "max-pool-2x2"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, c, h, w) = dims(l)?;
        let shape = Shape::from((n, c, h / 2, w / 2));
        let out = dispatch_float!(
            s.dtype(),
            [F32, F16, BF16],
            |T| {
                T::to_cpu_storage_owned(pool_fwd::<T>(cpu_slice(s, l, OP, "input")?, n * c, h, w))
            },
            |dt| candle_core::bail!("{OP}: unsupported dtype {dt:?}")
        );
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (n, c, h, w) = dims(l)?;
        let out = cuda::pool(s, l, None)?;
        Ok((out, Shape::from((n, c, h / 2, w / 2))))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        Ok(Some(x.apply_op2_no_bwd(&grad, &MaxPoolGrad)?))
    }
}

impl CustomOp2 for MaxPoolGrad {
    fn name(&self) -> &'static str {
        "max-pool-2x2-grad"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, c, h, w) = check_grad(xl, xs.dtype(), gl, gs.dtype())?;
        let out = dispatch_float!(
            xs.dtype(),
            [F32, F16, BF16],
            |T| {
                let x = cpu_slice::<T>(xs, xl, OP, "input")?;
                let g = cpu_slice::<T>(gs, gl, OP, "gradient")?;
                T::to_cpu_storage_owned(pool_bwd(x, g, n * c, h, w))
            },
            |dt| candle_core::bail!("{OP} backward: unsupported dtype {dt:?}")
        );
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        // Before the launch: the kernel reads one gradient per window of x, wherever it points.
        check_grad(xl, xs.dtype(), gl, gs.dtype())?;
        let out = cuda::pool(xs, xl, Some((gs, gl)))?;
        Ok((out, xl.shape().clone()))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The kernel of `cu/pool.cu`: one thread per 2x2 window, forward or backward.
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaStorage, Layout, WithDType};

    use super::OP;
    use crate::util::{alloc_len, cuda_view, dispatch_float, kernel_source, uint32, Kernels};

    static KERNELS: Kernels = Kernels::new(OP, "memtrain_pool", kernel_source!("pool.cu"));

    fn run<T: CudaDType + WithDType + DeviceRepr>(
        x: &CudaStorage,
        xl: &Layout,
        grad: Option<(&CudaStorage, &Layout)>,
    ) -> candle_core::Result<CudaStorage> {
        let (n, c, h, w) = super::dims(xl)?;
        let planes = n * c;
        let dev = x.device().clone();
        let windows = planes * (h / 2) * (w / 2);
        let out_len = if grad.is_some() {
            planes * h * w
        } else {
            windows
        };
        if out_len == 0 {
            // An empty result: no launch (a grid of 0 blocks is invalid), no zero-byte allocation.
            // SAFETY: the buffer holds no element of the result, so nothing reads it.
            let out = unsafe { dev.alloc::<T>(alloc_len(0))? };
            return Ok(CudaStorage::wrap_cuda_slice(out, dev));
        }
        let cfg = LaunchConfig::for_num_elems(uint32(OP, "windows", windows)?);
        let (h32, w32, n64) = (uint32(OP, "H", h)?, uint32(OP, "W", w)?, windows as u64);
        let func = KERNELS.func(&dev, &format!("pool_{}", T::DTYPE.as_str()))?;
        let xs = cuda_view::<T>(x, xl, OP, "input")?;
        // SAFETY: the kernel writes every element of the result (each window's value, or all
        // four gradients of each window).
        let out = unsafe { dev.alloc::<T>(out_len)? };
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&xs);
        // The forward passes a null `dy`, which tells the kernel which pass it runs.
        let null: u64 = 0;
        let gslice;
        match grad {
            Some((g, gl)) => {
                gslice = cuda_view::<T>(g, gl, OP, "gradient")?;
                b.arg(&gslice);
            }
            None => {
                b.arg(&null);
            }
        }
        b.arg(&out);
        b.arg(&n64);
        b.arg(&h32);
        b.arg(&w32);
        // SAFETY: (const T*, const T*, T*, u64, u32, u32) as the kernel takes them; one thread
        // per window, each inside the buffers the shapes imply.
        unsafe { b.launch(cfg) }
            .map_err(|e| candle_core::Error::Msg(format!("{OP} kernel: {e}")))?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }

    /// Forward (`grad` None) or backward of the 2x2 max-pool of `x` `[N, C, H, W]`.
    pub(super) fn pool(
        x: &CudaStorage,
        xl: &Layout,
        grad: Option<(&CudaStorage, &Layout)>,
    ) -> candle_core::Result<CudaStorage> {
        dispatch_float!(
            x.dtype(),
            [F32, F16, BF16],
            |T| run::<T>(x, xl, grad),
            |dt| candle_core::bail!("{OP}: unsupported dtype {dt:?} on CUDA"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// The check both devices' backward runs before computing (the CUDA kernel would read a short
    /// gradient past its end).
    #[test]
    fn the_backward_refuses_a_gradient_of_another_shape_or_dtype() -> Result<()> {
        let x = Tensor::zeros((2, 3, 4, 6), DType::F32, &Device::Cpu)?;
        let layout = |dims: &[usize]| Layout::contiguous(dims);
        assert_eq!(
            check_grad(
                &layout(&[2, 3, 4, 6]),
                DType::F32,
                &layout(&[2, 3, 2, 3]),
                DType::F32
            )?,
            (2, 3, 4, 6)
        );
        for short in [[2, 3, 2, 2], [2, 3, 3, 2], [1, 3, 2, 3], [2, 2, 2, 3]] {
            let e = check_grad(
                &layout(&[2, 3, 4, 6]),
                DType::F32,
                &layout(&short),
                DType::F32,
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("gradient shape") && e.contains("expected [2, 3, 2, 3]"),
                "{e}"
            );
            // The op on the CPU goes through the same check.
            let g = Tensor::zeros(&short[..], DType::F32, &Device::Cpu)?;
            let e = max_pool2x2_backward(&x, &g).unwrap_err().to_string();
            assert!(e.contains("gradient shape"), "{e}");
        }
        let e = check_grad(
            &layout(&[2, 3, 4, 6]),
            DType::F32,
            &layout(&[2, 3, 2, 3]),
            DType::BF16,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("dtype mismatch"), "{e}");
        let g = Tensor::ones((2, 3, 2, 3), DType::F32, &Device::Cpu)?;
        assert_eq!(max_pool2x2_backward(&x, &g)?.dims(), &[2, 3, 4, 6]);
        Ok(())
    }
}
