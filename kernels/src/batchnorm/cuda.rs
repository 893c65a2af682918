//! CUDA kernels (NVRTC, compiled once per process at first use).

use super::*;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage};

use crate::util::{cuda_view, grid_stride, kernel_source, uint32, Kernels};

/// The kernels of `cu/batchnorm.cu` (see there for how the reductions are split).
static KERNELS: Kernels = Kernels::new(OP, "memtrain_batchnorm", kernel_source!("batchnorm.cu"));

/// The kernel `{kernel}_{f32|f16|bf16}` for x's dtype.
fn func(dev: &CudaDevice, kernel: &str, dtype: DType) -> candle_core::Result<CudaFunction> {
    KERNELS.func(dev, &format!("{kernel}_{}", dtype.as_str()))
}

/// The contiguous data of a CUDA storage argument.
fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<CudaView<'a, T>> {
    cuda_view(s, l, OP, what)
}

/// The CUDA storage of a tensor held by an op (statistics, gamma, sums).
fn held<'a>(s: &'a Storage, what: &str) -> candle_core::Result<&'a CudaStorage> {
    match s {
        Storage::Cuda(cs) => Ok(cs),
        _ => Err(candle_core::Error::Msg(format!(
            "{OP}: {what} is not on the GPU like x"
        ))),
    }
}

/// Threads per block of the split reductions.
const REDUCE_THREADS: u32 = 256;

/// Blocks per channel of a split reduction ([`cuda_split`]).
fn split(d: Dims) -> usize {
    cuda_split(d.n, d.hw)
}

/// Grid `C × S` of the partial-sum kernels.
fn split_cfg(d: Dims, s: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (d.c as u32, s as u32, 1),
        block_dim: (REDUCE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One thread per channel (the finalizers).
fn per_channel_cfg(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(128) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A size as the kernels' `unsigned` (`check_inputs` keeps x under 2^31 elements).
fn u32_of(v: usize) -> candle_core::Result<u32> {
    uint32(OP, "size", v)
}

/// An activation dtype on the GPU.
pub(super) trait CudaElem: CudaDType + DeviceRepr + WithDType {}

impl<T: CudaDType + DeviceRepr + WithDType> CudaElem for T {}

/// `[mean; var]` per channel: partial sums, partial squared deviations, then the finalizer.
pub(super) fn stats<T: CudaElem>(
    s: &CudaStorage,
    l: &Layout,
    d: Dims,
) -> candle_core::Result<CudaStorage> {
    let dev = &s.device;
    let stream = dev.cuda_stream();
    let x = view::<T>(s, l, "x")?;
    let sp = split(d);
    let (c, hw, n, sp32, m) = (
        u32_of(d.c)?,
        u32_of(d.hw)?,
        u32_of(d.n)?,
        u32_of(sp)?,
        u32_of(d.m())?,
    );
    // SAFETY (allocations): every element is written by its kernel before it is read
    // (thread 0 of each block writes its partial; the finalizer writes every channel).
    let mut psum: CudaSlice<f32> = unsafe { dev.alloc::<f32>(d.c * sp)? };
    let mut psq: CudaSlice<f32> = unsafe { dev.alloc::<f32>(d.c * sp)? };
    let mut out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(2 * d.c)? };
    let f = func(dev, "bn_psum", T::DTYPE)?;
    let mut b = stream.launch_builder(&f);
    b.arg(&x).arg(&mut psum).arg(&c).arg(&hw).arg(&n);
    // SAFETY (launches): argument types and count match the kernel signatures; sizes checked.
    unsafe { b.launch(split_cfg(d, sp)) }.w()?;
    let f = func(dev, "bn_psq", T::DTYPE)?;
    let mut b = stream.launch_builder(&f);
    b.arg(&x).arg(&psum).arg(&mut psq).arg(&c).arg(&hw).arg(&n);
    unsafe { b.launch(split_cfg(d, sp)) }.w()?;
    let f = KERNELS.func(dev, "bn_stats_final")?;
    let mut b = stream.launch_builder(&f);
    b.arg(&psum)
        .arg(&psq)
        .arg(&mut out)
        .arg(&c)
        .arg(&sp32)
        .arg(&m);
    unsafe { b.launch(per_channel_cfg(d.c)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// The f32 `[2, C]` statistics an op holds, as a view on the GPU.
fn held_view<'a>(
    guard: &'a Storage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<CudaView<'a, f32>> {
    view::<f32>(held(guard, what)?, l, what)
}

/// The normalization (+ ReLU) pass, elementwise.
#[allow(clippy::too_many_arguments)]
pub(super) fn norm<T: CudaElem>(
    op: &BnNorm,
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
    d: Dims,
) -> candle_core::Result<CudaStorage> {
    let dev = &s1.device;
    let x = view::<T>(s1, l1, "x")?;
    let gamma = view::<f32>(s2, l2, "gamma")?;
    let beta = view::<f32>(s3, l3, "beta")?;
    let (guard, sl) = op.stats.storage_and_layout();
    let stats = held_view(&guard, sl, "batch statistics")?;
    let total = d.planes() * d.hw;
    // SAFETY: the grid-stride loop writes every element.
    let mut y: CudaSlice<T> = unsafe { dev.alloc::<T>(total)? };
    let f = func(dev, "bn_norm", T::DTYPE)?;
    let (c, hw, tot, relu) = (u32_of(d.c)?, u32_of(d.hw)?, u32_of(total)?, op.relu as i32);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    b.arg(&x).arg(&gamma).arg(&beta).arg(&stats).arg(&mut y);
    b.arg(&c).arg(&hw).arg(&tot).arg(&op.eps).arg(&relu);
    // SAFETY: argument types and count match the kernel signature; sizes checked above.
    unsafe { b.launch(grid_stride(total)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

/// Backward, part 1: per-channel partials of `Σg'` and `Σg'·(x - mean)`, then the finalizer.
#[allow(clippy::too_many_arguments)]
pub(super) fn bwd_reduce<T: CudaElem>(
    op: &BnBwdReduce,
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
    d: Dims,
) -> candle_core::Result<CudaStorage> {
    let dev = &s1.device;
    let x = view::<T>(s1, l1, "x")?;
    let gy = view::<T>(s2, l2, "grad_y")?;
    let y = view::<T>(s3, l3, "y")?;
    let (guard, sl) = op.stats.storage_and_layout();
    let stats = held_view(&guard, sl, "batch statistics")?;
    let stream = dev.cuda_stream();
    let sp = split(d);
    let (c, hw, n, sp32, relu) = (
        u32_of(d.c)?,
        u32_of(d.hw)?,
        u32_of(d.n)?,
        u32_of(sp)?,
        op.relu as i32,
    );
    // SAFETY (allocations): every element is written by its kernel before it is read.
    let mut part: CudaSlice<f32> = unsafe { dev.alloc::<f32>(2 * d.c * sp)? };
    let mut out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(2 * d.c)? };
    let f = func(dev, "bn_bwd_partial", T::DTYPE)?;
    let mut b = stream.launch_builder(&f);
    b.arg(&x).arg(&gy).arg(&y).arg(&stats).arg(&mut part);
    b.arg(&c).arg(&hw).arg(&n).arg(&relu);
    // SAFETY (launches): argument types and count match the kernel signatures; sizes checked.
    unsafe { b.launch(split_cfg(d, sp)) }.w()?;
    let f = KERNELS.func(dev, "bn_bwd_final")?;
    let mut b = stream.launch_builder(&f);
    b.arg(&part)
        .arg(&stats)
        .arg(&mut out)
        .arg(&c)
        .arg(&sp32)
        .arg(&op.eps);
    unsafe { b.launch(per_channel_cfg(d.c)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// Backward, part 2: the input gradient, elementwise.
#[allow(clippy::too_many_arguments)]
pub(super) fn bwd_input<T: CudaElem>(
    op: &BnBwdInput,
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
    d: Dims,
) -> candle_core::Result<CudaStorage> {
    let dev = &s1.device;
    let x = view::<T>(s1, l1, "x")?;
    let gy = view::<T>(s2, l2, "grad_y")?;
    let y = view::<T>(s3, l3, "y")?;
    let (stats_guard, stats_l) = op.stats.storage_and_layout();
    let stats = held_view(&stats_guard, stats_l, "batch statistics")?;
    let (gamma_guard, gamma_l) = op.gamma.storage_and_layout();
    let gamma = held_view(&gamma_guard, gamma_l, "gamma")?;
    let (sums_guard, sums_l) = op.sums.storage_and_layout();
    let sums = held_view(&sums_guard, sums_l, "gradient sums")?;
    let total = d.planes() * d.hw;
    // SAFETY: the grid-stride loop writes every element.
    let mut gx: CudaSlice<T> = unsafe { dev.alloc::<T>(total)? };
    let f = func(dev, "bn_bwd_input", T::DTYPE)?;
    let (c, hw, tot, relu) = (u32_of(d.c)?, u32_of(d.hw)?, u32_of(total)?, op.relu as i32);
    let inv_m = 1.0f32 / d.m() as f32;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    b.arg(&x)
        .arg(&gy)
        .arg(&y)
        .arg(&stats)
        .arg(&gamma)
        .arg(&sums)
        .arg(&mut gx);
    b.arg(&c)
        .arg(&hw)
        .arg(&tot)
        .arg(&inv_m)
        .arg(&op.eps)
        .arg(&relu);
    // SAFETY: argument types and count match the kernel signature; sizes checked above.
    unsafe { b.launch(grid_stride(total)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(gx, dev.clone()))
}
