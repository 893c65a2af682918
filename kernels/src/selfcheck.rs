//! A once-per-run check of the custom kernels on a device against their CPU implementations.
//!
//! The CPU half of every op is tested exhaustively (its own tests and the trainer's gradient
//! oracle); the CUDA half can only be tested where a GPU is, which is rarely. So a run on a GPU
//! first runs every pass of every op once, on small deterministic inputs, on its device and on
//! the CPU, and compares: a kernel that computes nonsense stops the run before its first step,
//! by name, instead of training a model on it. It costs milliseconds (the shapes are tiny; the
//! NVRTC compilation it triggers would happen at the first step anyway).
//!
//! The comparison is relative to the largest magnitude of the CPU result, with tolerances wide
//! enough for TF32 and half-precision rounding and far below what an indexing or reduction bug
//! gives (errors of order 1).

use crate::batchnorm::{batch_stats, bn_relu, bn_relu_backward, bn_relu_pool_backward, BnParams};
use crate::{conv2d, depthwise, pool};
use candle_core::{DType, Device, Result, Tensor};

/// A pass whose result on the device under test differs from the CPU's.
#[derive(Debug, Clone, PartialEq)]
pub struct Mismatch {
    /// The pass, e.g. `depthwise input gradient`.
    pub kernel: &'static str,
    /// The dtype it ran in.
    pub dtype: DType,
    /// max |device − cpu| / max |cpu|.
    pub error: f64,
    /// The largest error accepted for this dtype.
    pub tolerance: f64,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "kernel '{}' ({:?}) differs from its CPU implementation: relative error {:.3e}, tolerance {:.0e}",
            self.kernel, self.dtype, self.error, self.tolerance
        )
    }
}

/// The largest relative error accepted in `dtype` (f32 leaves room for TF32 tensor cores).
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2e-2,
        DType::BF16 => 6e-2,
        _ => 1e-2,
    }
}

/// Run every pass on `device` and on the CPU in each of `dtypes` and return the first mismatch.
///
/// # Errors
/// When a pass fails to run at all (that is a failure of its own, reported as it is).
pub fn check_device(device: &Device, dtypes: &[DType]) -> Result<Option<Mismatch>> {
    check_device_with(device, dtypes, &|_, t| Ok(t))
}

/// [`check_device`] with `alter` applied to every result on the device under test before the
/// comparison (given the pass's name): how a test shows that a wrong kernel is caught, on a
/// machine without a GPU.
///
/// # Errors
/// As [`check_device`].
pub fn check_device_with(
    device: &Device,
    dtypes: &[DType],
    alter: &dyn Fn(&str, Tensor) -> Result<Tensor>,
) -> Result<Option<Mismatch>> {
    for &dtype in dtypes {
        for (kernel, pass) in PASSES {
            let got = pass(device, dtype)?;
            let want = pass(&Device::Cpu, dtype)?;
            let error = relative_error(&alter(kernel, got)?, &want)?;
            let tolerance = tolerance(dtype);
            if error.is_nan() || error > tolerance {
                return Ok(Some(Mismatch {
                    kernel,
                    dtype,
                    error,
                    tolerance,
                }));
            }
        }
    }
    Ok(None)
}

/// The names of the passes checked, in the order they run.
pub fn pass_names() -> Vec<&'static str> {
    PASSES.iter().map(|(name, _)| *name).collect()
}

/// One pass: its output on a device, in a dtype, from the same inputs on every device.
type Pass = fn(&Device, DType) -> Result<Tensor>;

/// Every pass the CUDA half of the ops implements, by name.
const PASSES: [(&str, Pass); 11] = [
    ("conv2d forward", |d, t| {
        conv2d::conv2d(
            &input(&[2, 8, 8, 8], 1, d, t)?,
            &input(&[16, 8, 3, 3], 2, d, t)?,
            1,
            1,
        )
    }),
    ("conv2d input gradient", |d, t| {
        let (g, w) = (
            input(&[2, 16, 8, 8], 3, d, t)?,
            input(&[16, 8, 3, 3], 2, d, t)?,
        );
        conv2d::conv2d_backward_input(&g, &w, &[2, 8, 8, 8], 1, 1)
    }),
    ("conv2d weight gradient", |d, t| {
        let (x, g) = (
            input(&[2, 8, 8, 8], 1, d, t)?,
            input(&[2, 16, 8, 8], 3, d, t)?,
        );
        conv2d::conv2d_backward_weight(&x, &g, &[16, 8, 3, 3], 1, 1)
    }),
    ("depthwise forward", |d, t| {
        let (x, w) = (
            input(&[2, 8, 8, 8], 4, d, t)?,
            input(&[8, 1, 3, 3], 5, d, t)?,
        );
        depthwise::depthwise_conv2d(&x, &w, 1, 1)
    }),
    ("depthwise input gradient", |d, t| {
        let (g, w) = (
            input(&[2, 8, 8, 8], 6, d, t)?,
            input(&[8, 1, 3, 3], 5, d, t)?,
        );
        depthwise::depthwise_backward_input(&g, &w, &[2, 8, 8, 8], 1, 1)
    }),
    ("depthwise weight gradient", |d, t| {
        let (x, g) = (
            input(&[2, 8, 8, 8], 4, d, t)?,
            input(&[2, 8, 8, 8], 6, d, t)?,
        );
        depthwise::depthwise_backward_weight(&x, &g, &[8, 1, 3, 3], 1, 1)
    }),
    ("batchnorm statistics", |d, t| {
        batch_stats(&input(&[4, 8, 4, 4], 7, d, t)?)
    }),
    ("batchnorm+relu forward", |d, t| {
        let h = input(&[4, 8, 4, 4], 7, d, t)?;
        bn_relu(&h, &bn_params(&h)?)
    }),
    ("batchnorm+relu backward", |d, t| {
        let h = input(&[4, 8, 4, 4], 7, d, t)?;
        let (gh, gg, gb) = bn_relu_backward(&h, input(&[4, 8, 4, 4], 8, d, t)?, &bn_params(&h)?)?;
        Tensor::cat(&[gh.flatten_all()?.to_dtype(DType::F32)?, gg, gb], 0)
    }),
    ("max-pool forward", |d, t| {
        pool::max_pool2x2(&input(&[2, 8, 8, 8], 9, d, t)?)
    }),
    ("batchnorm+relu+max-pool backward", |d, t| {
        let h = input(&[4, 8, 4, 4], 7, d, t)?;
        let gp = input(&[4, 8, 2, 2], 10, d, t)?;
        let (gh, gg, gb) = bn_relu_pool_backward(h.clone(), &gp, None, &bn_params(&h)?)?;
        Tensor::cat(&[gh.flatten_all()?.to_dtype(DType::F32)?, gg, gb], 0)
    }),
];

/// Deterministic values in [-1, 1) for `shape`, the same on every device: made on the CPU from a
/// seeded integer hash (no device RNG), then moved.
fn input(shape: &[usize], seed: u64, device: &Device, dtype: DType) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n as u64)
        .map(|i| {
            let mut x = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
            x ^= x >> 31;
            x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x ^= x >> 29;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)
}

/// BatchNorm parameters for `h`: γ and β from fixed values, `h`'s own batch statistics.
fn bn_params(h: &Tensor) -> Result<BnParams> {
    let c = h.dim(1)?;
    let dev = h.device();
    Ok(BnParams {
        gamma: (input(&[c], 11, dev, DType::F32)? + 1.5)?,
        beta: input(&[c], 12, dev, DType::F32)?,
        stats: batch_stats(h)?,
        eps: 1e-5,
        batch_stats: true,
    })
}

/// max |a − b| / max |b|, both read as f32 on the CPU; NaN when either holds a NaN.
fn relative_error(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?;
    let b = b
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?;
    if a.dims() != b.dims() {
        return Ok(f64::INFINITY);
    }
    let (a, b) = (a.to_vec1::<f32>()?, b.to_vec1::<f32>()?);
    let mut diff = 0f64;
    let mut scale = 0f64;
    for (x, y) in a.iter().zip(&b) {
        let d = (*x as f64 - *y as f64).abs();
        if d.is_nan() {
            return Ok(f64::NAN);
        }
        diff = diff.max(d);
        scale = scale.max((*y as f64).abs());
    }
    Ok(diff / scale.max(1e-12))
}
