//! 2x2 max-pooling with a correct backward.
//!
//! Candle 0.11's `max_pool2d` backward multiplies the gradient by (number of tied maxima) / k²:
//! for a 2x2 window with one maximum the input gradient is a quarter of what it should be, and
//! ties (common in f16/bf16) get more. This op routes each output gradient to the first maximum
//! of its window (row-major), as PyTorch does. The backward recomputes the argmax from the input
//! (which autograd keeps anyway) instead of storing an index tensor.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};
use half::{bf16, f16};

use crate::error::{Error, Result};

/// Max-pool `x` [N,C,H,W] with a 2x2 window and stride 2 (H and W must be even), differentiable.
pub fn max_pool2x2(x: &Tensor) -> Result<Tensor> {
    let (_, _, h, w) = x.dims4().map_err(|_| {
        Error::config(format!(
            "max_pool2x2 expects a 4D [N,C,H,W] tensor, got shape {:?}",
            x.dims()
        ))
    })?;
    if h % 2 != 0 || w % 2 != 0 {
        return Err(Error::config(format!(
            "max_pool2x2 needs even H and W, got {h}x{w}"
        )));
    }
    Ok(x.contiguous()?.apply_op1(MaxPool)?)
}

/// The input gradient of [`max_pool2x2`] from its input `x` and the gradient `grad` of its output:
/// each window's gradient goes to the window's first maximum (recomputed from `x`); no autograd.
pub fn max_pool2x2_backward(x: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let grad = grad.to_dtype(x.dtype())?.contiguous()?;
    Ok(x.contiguous()?.apply_op2_no_bwd(&grad, &MaxPoolGrad)?)
}

struct MaxPool;
struct MaxPoolGrad;

fn dims(l: &Layout) -> candle_core::Result<(usize, usize, usize, usize)> {
    l.shape().dims4()
}

fn contiguous_slice<'a, T>(s: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s[a..b]),
        None => candle_core::bail!("max_pool2x2: non-contiguous input"),
    }
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

trait Elem: Copy + Send + Sync + 'static {
    fn f(self) -> f32;
    fn from_f(v: f32) -> Self;
}
impl Elem for f32 {
    fn f(self) -> f32 {
        self
    }
    fn from_f(v: f32) -> Self {
        v
    }
}
impl Elem for f16 {
    fn f(self) -> f32 {
        self.to_f32()
    }
    fn from_f(v: f32) -> Self {
        f16::from_f32(v)
    }
}
impl Elem for bf16 {
    fn f(self) -> f32 {
        self.to_f32()
    }
    fn from_f(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

fn window<T: Elem>(plane: &[T], w: usize, oy: usize, ox: usize) -> ([f32; 4], [usize; 4]) {
    let i0 = 2 * oy * w + 2 * ox;
    let idx = [i0, i0 + 1, i0 + w, i0 + w + 1];
    (
        [
            plane[idx[0]].f(),
            plane[idx[1]].f(),
            plane[idx[2]].f(),
            plane[idx[3]].f(),
        ],
        idx,
    )
}

fn pool_fwd<T: Elem>(x: &[T], planes: usize, h: usize, w: usize) -> Vec<T> {
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

fn pool_bwd<T: Elem>(x: &[T], dy: &[T], planes: usize, h: usize, w: usize) -> Vec<T> {
    let (ho, wo) = (h / 2, w / 2);
    let mut dx = vec![T::from_f(0.0); planes * h * w];
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
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(pool_fwd(contiguous_slice(v, l)?, n * c, h, w)),
            CpuStorage::F16(v) => CpuStorage::F16(pool_fwd(contiguous_slice(v, l)?, n * c, h, w)),
            CpuStorage::BF16(v) => CpuStorage::BF16(pool_fwd(contiguous_slice(v, l)?, n * c, h, w)),
            other => candle_core::bail!("max_pool2x2: unsupported dtype {:?}", other.dtype()),
        };
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (n, c, h, w) = dims(l)?;
        let out = cuda::pool(s, l, None, n * c, h, w)?;
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
        let (n, c, h, w) = dims(xl)?;
        if gl.shape().dims() != [n, c, h / 2, w / 2] {
            candle_core::bail!(
                "max_pool2x2 backward: gradient shape {:?} does not match input {:?}",
                gl.shape(),
                xl.shape()
            )
        }
        let out = match (xs, gs) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => CpuStorage::F32(pool_bwd(
                contiguous_slice(x, xl)?,
                contiguous_slice(g, gl)?,
                n * c,
                h,
                w,
            )),
            (CpuStorage::F16(x), CpuStorage::F16(g)) => CpuStorage::F16(pool_bwd(
                contiguous_slice(x, xl)?,
                contiguous_slice(g, gl)?,
                n * c,
                h,
                w,
            )),
            (CpuStorage::BF16(x), CpuStorage::BF16(g)) => CpuStorage::BF16(pool_bwd(
                contiguous_slice(x, xl)?,
                contiguous_slice(g, gl)?,
                n * c,
                h,
                w,
            )),
            _ => candle_core::bail!(
                "max_pool2x2 backward: dtype mismatch {:?} vs {:?}",
                xs.dtype(),
                gs.dtype()
            ),
        };
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
        let (n, c, h, w) = dims(xl)?;
        let out = cuda::pool(xs, xl, Some((gs, gl)), n * c, h, w)?;
        Ok((out, xl.shape().clone()))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! NVRTC kernels: one thread per output element (forward) or per window (backward).
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{CudaStorage, DType, Layout};

    // Plain CUDA C without headers (NVRTC gets no include path): 16-bit types travel as raw
    // u16 and are widened with a PTX cvt (f16) or a shift (bf16) only for the comparison;
    // values are copied bit for bit.
    const SRC: &str = r#"
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
__device__ __forceinline__ float ld_f32(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ float ld_f16(const u16* p, u64 i) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p[i])); return f; }
__device__ __forceinline__ float ld_bf16(const u16* p, u64 i) { return __uint_as_float(((u32)p[i]) << 16); }
#define POOL(NAME, T, LD) \
extern "C" __global__ void NAME(const T* x, const T* dy, T* out, u64 windows, u32 h, u32 w) { \
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; \
    if (i >= windows) return; \
    u32 wo = w / 2, ho = h / 2; \
    u64 p = i / ((u64)ho * wo); \
    u32 r = (u32)(i % ((u64)ho * wo)), oy = r / wo, ox = r % wo; \
    u64 base = p * h * w + 2ull * oy * w + 2ull * ox; \
    u64 idx[4] = {base, base + 1, base + w, base + w + 1}; \
    int best = 0; float bv = LD(x, idx[0]); \
    for (int k = 1; k < 4; k++) { float v = LD(x, idx[k]); if (v > bv) { bv = v; best = k; } } \
    if (dy == 0) { out[i] = x[idx[best]]; } \
    else { for (int k = 0; k < 4; k++) out[idx[k]] = (k == best) ? dy[i] : (T)0; } \
}
POOL(pool_f32, float, ld_f32)
POOL(pool_f16, u16, ld_f16)
POOL(pool_bf16, u16, ld_bf16)
"#;

    static KERNELS: crate::ops::cuda_util::Kernels =
        crate::ops::cuda_util::Kernels::new("max_pool2x2", SRC);

    /// Forward (`grad` None) or backward: one thread per 2x2 window.
    pub fn pool(
        x: &CudaStorage,
        xl: &Layout,
        grad: Option<(&CudaStorage, &Layout)>,
        planes: usize,
        h: usize,
        w: usize,
    ) -> candle_core::Result<CudaStorage> {
        let dev = x.device().clone();
        let windows = planes * (h / 2) * (w / 2);
        let out_len = if grad.is_some() {
            planes * h * w
        } else {
            windows
        };
        let cfg = LaunchConfig::for_num_elems(windows as u32);
        let (h32, w32, n64) = (h as u32, w as u32, windows as u64);
        let (xo, _) = xl
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("max_pool2x2: non-contiguous".into()))?;
        macro_rules! run {
            ($t:ty, $name:literal) => {{
                let func = dev.get_or_load_custom_func($name, "memtrain_pool", KERNELS.ptx()?)?;
                let xs = x.as_cuda_slice::<$t>()?.slice(xo..);
                let out = unsafe { dev.alloc::<$t>(out_len)? };
                let mut b = func.builder();
                b.arg(&xs);
                let null: u64 = 0;
                let gslice;
                match grad {
                    Some((g, gl)) => {
                        let (go, _) = gl.contiguous_offsets().ok_or_else(|| {
                            candle_core::Error::Msg("max_pool2x2: non-contiguous grad".into())
                        })?;
                        gslice = g.as_cuda_slice::<$t>()?.slice(go..);
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
                unsafe { b.launch(cfg) }
                    .map_err(|e| candle_core::Error::Msg(format!("max_pool2x2 kernel: {e}")))?;
                Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
            }};
        }
        match x.dtype() {
            DType::F32 => run!(f32, "pool_f32"),
            DType::F16 => run!(half::f16, "pool_f16"),
            DType::BF16 => run!(half::bf16, "pool_bf16"),
            dt => candle_core::bail!("max_pool2x2: unsupported dtype {dt:?} on CUDA"),
        }
    }
}
