//! A once-per-run check of the custom kernels on a device against their CPU implementations.
//!
//! The CPU half of every op is tested exhaustively (its own tests and the trainer's gradient
//! oracle); the CUDA half can only be tested where a GPU is, which is rarely. So a run on a GPU
//! first runs every pass of every op on deterministic inputs, on its device and on the CPU, and
//! compares: a kernel that computes nonsense stops the run before its first step, by name, instead
//! of training a model on it.
//!
//! Each pass runs at a tiny shape and at a training-like one, which takes the branches training
//! takes: 32×32 planes with 64 channels at batch 64, BatchNorm reductions split over several blocks
//! per channel (plane wider than a block, a warp, or neither), conv gradients summed over several
//! chunks, the 1×1 convolution, stride 2, and sizes that are not multiples of a block. The
//! shape-coverage tests at the end of this file check those claims against the launch arithmetic.
//!
//! Every output of a pass (e.g. the BatchNorm backward's input, γ and β gradients) is judged on its
//! own: max |device − cpu| over max |cpu| of that output, with tolerances wide enough for TF32 and
//! half-precision rounding and far below what an indexing or reduction bug gives.

use crate::batchnorm::{batch_stats, bn_relu, bn_relu_backward, bn_relu_pool_backward, BnParams};
use crate::{conv2d, depthwise, pool};
use candle_core::{DType, Device, Result, Tensor};

/// An output of a pass whose result on the device under test differs from the CPU's.
#[derive(Debug, Clone, PartialEq)]
pub struct Mismatch {
    /// The pass, e.g. `depthwise input gradient`.
    pub kernel: &'static str,
    /// The shapes it ran at, e.g. `[64, 64, 32, 32] * [32, 64, 3, 3]`.
    pub shape: String,
    /// The output that differs, e.g. `input gradient`.
    pub output: &'static str,
    /// The dtype it ran in.
    pub dtype: DType,
    /// max |device − cpu| / max |cpu| over this output.
    pub error: f64,
    /// The largest error accepted for this dtype.
    pub tolerance: f64,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "kernel '{}' at {} ({:?}) differs from its CPU implementation: {} relative error {:.3e}, tolerance {:.0e}",
            self.kernel, self.shape, self.dtype, self.output, self.error, self.tolerance
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

/// What a check ran and what differed.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Passes run, counted once per dtype.
    pub passes_run: usize,
    /// Every output that differs, in the order run (empty: the device agrees with the CPU).
    pub mismatches: Vec<Mismatch>,
}

/// Run every pass on `device` and on the CPU in each of `dtypes` and return the first mismatch.
///
/// # Errors
/// When a pass fails to run at all (that is a failure of its own, reported as it is).
pub fn check_device(device: &Device, dtypes: &[DType]) -> Result<Option<Mismatch>> {
    Ok(check_device_with(device, dtypes, &|_, _, t| Ok(t))?
        .mismatches
        .into_iter()
        .next())
}

/// What a test applies to each output of each pass on the device (the pass, the output's index,
/// the output) before it is compared: how a wrong kernel is injected.
pub type Alter<'a> = dyn Fn(&Pass, usize, Tensor) -> Result<Tensor> + 'a;

/// Every pass on `device` and on the CPU in each of `dtypes`, with `alter` applied to each output
/// on the device under test before the comparison (given the pass and the output's index): how a
/// test shows that a wrong kernel is caught, on a machine without a GPU. On the CPU the device's
/// result is the reference's own (the CPU ops are deterministic), so a test pays for one run.
///
/// # Errors
/// As [`check_device`].
pub fn check_device_with(device: &Device, dtypes: &[DType], alter: &Alter<'_>) -> Result<Report> {
    let mut report = Report {
        passes_run: 0,
        mismatches: Vec::new(),
    };
    for &dtype in dtypes {
        for pass in passes() {
            let want = pass.run(&Device::Cpu, dtype)?;
            let got = if device.is_cpu() {
                want.clone()
            } else {
                pass.run(device, dtype)?
            };
            let got = got
                .into_iter()
                .enumerate()
                .map(|(i, t)| alter(pass, i, t))
                .collect::<Result<Vec<_>>>()?;
            report.mismatches.extend(compare(pass, dtype, &got, &want)?);
            report.passes_run += 1;
        }
    }
    Ok(report)
}

/// The outputs of `pass` in `got` that differ from `want` (the CPU's) by more than
/// [`tolerance`]`(dtype)`, each relative to its own largest magnitude in `want`. A missing
/// output, a shape that differs, or a NaN is a mismatch too.
///
/// # Errors
/// When a tensor cannot be read back to the CPU.
pub fn compare(
    pass: &Pass,
    dtype: DType,
    got: &[Tensor],
    want: &[Tensor],
) -> Result<Vec<Mismatch>> {
    let tolerance = tolerance(dtype);
    let mut out = Vec::new();
    for (i, output) in pass.outputs().iter().enumerate() {
        let error = match (got.get(i), want.get(i)) {
            (Some(g), Some(w)) => relative_error(g, w)?,
            _ => f64::INFINITY,
        };
        if error.is_nan() || error > tolerance {
            out.push(Mismatch {
                kernel: pass.kernel(),
                shape: pass.shape(),
                output,
                dtype,
                error,
                tolerance,
            });
        }
    }
    Ok(out)
}

/// The names of the passes checked, in the order they run (a kernel appears once per shape).
pub fn pass_names() -> Vec<&'static str> {
    passes().iter().map(Pass::kernel).collect()
}

/// Which way a convolution runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Forward,
    InputGrad,
    WeightGrad,
}

/// A convolution's shapes: input `x` `[N, C, H, W]`, `cout` filters (depthwise: `C`) of `k`×`k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ConvShape {
    x: [usize; 4],
    cout: usize,
    k: usize,
    stride: usize,
    pad: usize,
}

impl ConvShape {
    const fn new(x: [usize; 4], cout: usize, k: usize, stride: usize, pad: usize) -> Self {
        ConvShape {
            x,
            cout,
            k,
            stride,
            pad,
        }
    }

    /// The output `[N, Cout, Ho, Wo]`.
    fn y(&self) -> [usize; 4] {
        let o = |s: usize| (s + 2 * self.pad - self.k) / self.stride + 1;
        [self.x[0], self.cout, o(self.x[2]), o(self.x[3])]
    }
}

/// What a pass runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Conv(Dir, ConvShape),
    Depthwise(Dir, ConvShape),
    BnStats([usize; 4]),
    BnForward([usize; 4]),
    BnBackward([usize; 4]),
    PoolForward([usize; 4]),
    PoolBackward([usize; 4]),
    BnPoolBackward([usize; 4]),
}

/// One pass of one op at one shape, run on any device from the same inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    op: Op,
}

const SMALL_CONV: ConvShape = ConvShape::new([2, 8, 8, 8], 16, 3, 1, 1);
/// 32×32 planes, 64 input channels, batch 64: 5 chunks of columns in f32, 3 in f16/bf16.
const TRAIN_CONV: ConvShape = ConvShape::new([64, 64, 32, 32], 32, 3, 1, 1);
/// The 1×1 convolution (no im2col: one gemm over the batch).
const POINTWISE: ConvShape = ConvShape::new([64, 64, 16, 16], 128, 1, 1, 0);
/// Stride 2 on odd sizes: nothing a multiple of a block or of a warp.
const STRIDED: ConvShape = ConvShape::new([64, 67, 17, 17], 70, 3, 2, 1);
const SMALL_DW: ConvShape = ConvShape::new([2, 8, 8, 8], 8, 3, 1, 1);
/// 1024-element planes: four blocks per plane; the weight gradient reduces 65,536 products.
const TRAIN_DW: ConvShape = ConvShape::new([64, 64, 32, 32], 64, 3, 1, 1);
/// A 289-element input plane (two blocks, the second partial) at stride 2.
const STRIDED_DW: ConvShape = ConvShape::new([64, 72, 17, 17], 72, 3, 2, 1);
const SMALL_BN: [usize; 4] = [4, 8, 4, 4];
/// Planes wider than a block, 16 blocks per channel.
const TRAIN_BN: [usize; 4] = [64, 64, 32, 32];
/// 144-element planes (a warp each, 4.5 warps wide), 4 blocks per channel over 130 images.
const WARP_BN: [usize; 4] = [130, 72, 12, 12];
/// 25-element planes (flattened), 3 blocks per channel.
const TINY_BN: [usize; 4] = [600, 16, 5, 5];
/// 1,053,000 windows: not a multiple of a block.
const TRAIN_POOL: [usize; 4] = [65, 72, 30, 30];

/// Every pass the CUDA half of the ops implements, each at a tiny and a training-like shape.
const PASSES: &[Pass] = &{
    use Dir::*;
    use Op::*;
    [
        Pass {
            op: Conv(Forward, SMALL_CONV),
        },
        Pass {
            op: Conv(InputGrad, SMALL_CONV),
        },
        Pass {
            op: Conv(WeightGrad, SMALL_CONV),
        },
        Pass {
            op: Depthwise(Forward, SMALL_DW),
        },
        Pass {
            op: Depthwise(InputGrad, SMALL_DW),
        },
        Pass {
            op: Depthwise(WeightGrad, SMALL_DW),
        },
        Pass {
            op: BnStats(SMALL_BN),
        },
        Pass {
            op: BnForward(SMALL_BN),
        },
        Pass {
            op: BnBackward(SMALL_BN),
        },
        Pass {
            op: PoolForward([2, 8, 8, 8]),
        },
        Pass {
            op: BnPoolBackward(SMALL_BN),
        },
        // Training-like shapes.
        Pass {
            op: Conv(Forward, TRAIN_CONV),
        },
        Pass {
            op: Conv(InputGrad, TRAIN_CONV),
        },
        Pass {
            op: Conv(WeightGrad, TRAIN_CONV),
        },
        Pass {
            op: Conv(Forward, POINTWISE),
        },
        Pass {
            op: Conv(InputGrad, POINTWISE),
        },
        Pass {
            op: Conv(WeightGrad, POINTWISE),
        },
        Pass {
            op: Conv(Forward, STRIDED),
        },
        Pass {
            op: Conv(InputGrad, STRIDED),
        },
        Pass {
            op: Conv(WeightGrad, STRIDED),
        },
        Pass {
            op: Depthwise(Forward, TRAIN_DW),
        },
        Pass {
            op: Depthwise(InputGrad, TRAIN_DW),
        },
        Pass {
            op: Depthwise(WeightGrad, TRAIN_DW),
        },
        Pass {
            op: Depthwise(Forward, STRIDED_DW),
        },
        Pass {
            op: Depthwise(InputGrad, STRIDED_DW),
        },
        Pass {
            op: Depthwise(WeightGrad, STRIDED_DW),
        },
        Pass {
            op: BnStats(TRAIN_BN),
        },
        Pass {
            op: BnForward(TRAIN_BN),
        },
        Pass {
            op: BnBackward(TRAIN_BN),
        },
        Pass {
            op: BnStats(WARP_BN),
        },
        Pass {
            op: BnBackward(WARP_BN),
        },
        Pass {
            op: BnStats(TINY_BN),
        },
        Pass {
            op: BnBackward(TINY_BN),
        },
        Pass {
            op: PoolForward(TRAIN_POOL),
        },
        Pass {
            op: PoolBackward(TRAIN_POOL),
        },
        Pass {
            op: BnPoolBackward(TRAIN_BN),
        },
    ]
};

/// Every pass checked, in the order run.
pub fn passes() -> &'static [Pass] {
    PASSES
}

impl Pass {
    /// The pass's name, e.g. `conv2d weight gradient`.
    pub fn kernel(&self) -> &'static str {
        let dir = |d: Dir, names: [&'static str; 3]| match d {
            Dir::Forward => names[0],
            Dir::InputGrad => names[1],
            Dir::WeightGrad => names[2],
        };
        match self.op {
            Op::Conv(d, _) => dir(
                d,
                [
                    "conv2d forward",
                    "conv2d input gradient",
                    "conv2d weight gradient",
                ],
            ),
            Op::Depthwise(d, _) => dir(
                d,
                [
                    "depthwise forward",
                    "depthwise input gradient",
                    "depthwise weight gradient",
                ],
            ),
            Op::BnStats(_) => "batchnorm statistics",
            Op::BnForward(_) => "batchnorm+relu forward",
            Op::BnBackward(_) => "batchnorm+relu backward",
            Op::PoolForward(_) => "max-pool forward",
            Op::PoolBackward(_) => "max-pool backward",
            Op::BnPoolBackward(_) => "batchnorm+relu+max-pool backward",
        }
    }

    /// The shapes it runs at, e.g. `[64, 67, 17, 17] * [72, 67, 3, 3] stride 2`.
    pub fn shape(&self) -> String {
        let conv = |s: &ConvShape, cin: usize| {
            let mut t = format!("{:?} * {:?}", s.x, [s.cout, cin, s.k, s.k]);
            if s.stride != 1 {
                t += &format!(" stride {}", s.stride);
            }
            t
        };
        match &self.op {
            Op::Conv(_, s) => conv(s, s.x[1]),
            Op::Depthwise(_, s) => conv(s, 1),
            Op::BnStats(x)
            | Op::BnForward(x)
            | Op::BnBackward(x)
            | Op::PoolForward(x)
            | Op::PoolBackward(x)
            | Op::BnPoolBackward(x) => format!("{x:?}"),
        }
    }

    /// The names of its outputs, in the order [`Pass::run`] returns them.
    pub fn outputs(&self) -> &'static [&'static str] {
        match self.op {
            Op::BnStats(_) => &["mean", "variance"],
            Op::BnBackward(_) | Op::BnPoolBackward(_) => {
                &["input gradient", "gamma gradient", "beta gradient"]
            }
            _ => &["output"],
        }
    }

    /// Whether it is one of the training-like shapes (not the tiny one of its kernel).
    pub fn training_like(&self) -> bool {
        let n = match &self.op {
            Op::Conv(_, s) | Op::Depthwise(_, s) => s.x[0],
            Op::BnStats(x)
            | Op::BnForward(x)
            | Op::BnBackward(x)
            | Op::PoolForward(x)
            | Op::PoolBackward(x)
            | Op::BnPoolBackward(x) => x[0],
        };
        n >= 64
    }

    /// Its outputs on `device` in `dtype`, from inputs that are the same on every device.
    ///
    /// # Errors
    /// When an op fails.
    pub fn run(&self, d: &Device, t: DType) -> Result<Vec<Tensor>> {
        let out = match self.op {
            Op::Conv(dir, s) => {
                let w = [s.cout, s.x[1], s.k, s.k];
                vec![match dir {
                    Dir::Forward => conv2d::conv2d(
                        &input(&s.x, 1, d, t)?,
                        &input(&w, 2, d, t)?,
                        s.stride,
                        s.pad,
                    )?,
                    Dir::InputGrad => conv2d::conv2d_backward_input(
                        &input(&s.y(), 3, d, t)?,
                        &input(&w, 2, d, t)?,
                        &s.x,
                        s.stride,
                        s.pad,
                    )?,
                    Dir::WeightGrad => conv2d::conv2d_backward_weight(
                        &input(&s.x, 1, d, t)?,
                        &input(&s.y(), 3, d, t)?,
                        &w,
                        s.stride,
                        s.pad,
                    )?,
                }]
            }
            Op::Depthwise(dir, s) => {
                let w = [s.cout, 1, s.k, s.k];
                vec![match dir {
                    Dir::Forward => depthwise::depthwise_conv2d(
                        &input(&s.x, 4, d, t)?,
                        &input(&w, 5, d, t)?,
                        s.stride,
                        s.pad,
                    )?,
                    Dir::InputGrad => depthwise::depthwise_backward_input(
                        &input(&s.y(), 6, d, t)?,
                        &input(&w, 5, d, t)?,
                        &s.x,
                        s.stride,
                        s.pad,
                    )?,
                    Dir::WeightGrad => depthwise::depthwise_backward_weight(
                        &input(&s.x, 4, d, t)?,
                        &input(&s.y(), 6, d, t)?,
                        &w,
                        s.stride,
                        s.pad,
                    )?,
                }]
            }
            Op::BnStats(x) => {
                let s = batch_stats(&input(&x, 7, d, t)?)?;
                vec![s.get(0)?, s.get(1)?]
            }
            Op::BnForward(x) => {
                let h = input(&x, 7, d, t)?;
                vec![bn_relu(&h, &bn_params(&h)?)?]
            }
            Op::BnBackward(x) => {
                let h = input(&x, 7, d, t)?;
                let (gh, gg, gb) = bn_relu_backward(&h, input(&x, 8, d, t)?, &bn_params(&h)?)?;
                vec![gh, gg, gb]
            }
            Op::PoolForward(x) => vec![pool::max_pool2x2(&input(&x, 9, d, t)?)?],
            Op::PoolBackward(x) => {
                let g = input(&[x[0], x[1], x[2] / 2, x[3] / 2], 10, d, t)?;
                vec![pool::max_pool2x2_backward(&input(&x, 9, d, t)?, &g)?]
            }
            Op::BnPoolBackward(x) => {
                let h = input(&x, 7, d, t)?;
                let gp = input(&[x[0], x[1], x[2] / 2, x[3] / 2], 10, d, t)?;
                let (gh, gg, gb) = bn_relu_pool_backward(h.clone(), &gp, None, &bn_params(&h)?)?;
                vec![gh, gg, gb]
            }
        };
        Ok(out)
    }
}

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
        decisions: None,
    })
}

/// max |a − b| / max |b|, both read as f32 on the CPU; NaN when either holds a NaN, infinite when
/// their shapes differ.
fn relative_error(a: &Tensor, b: &Tensor) -> Result<f64> {
    if a.dims() != b.dims() {
        return Ok(f64::INFINITY);
    }
    let read = |t: &Tensor| -> Result<Vec<f32>> {
        t.to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()
    };
    let (a, b) = (read(a)?, read(b)?);
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

#[cfg(test)]
mod tests {
    //! The training-like shapes take the branches they are there for (launch arithmetic shared
    //! with the CUDA host code, which compiles on the CPU).
    use super::*;

    #[test]
    fn the_conv_gradients_run_in_several_chunks_in_every_dtype() {
        let s = TRAIN_CONV;
        let hw = s.y()[2] * s.y()[3];
        for (dtype, chunks) in [(DType::F32, 5), (DType::F16, 3), (DType::BF16, 3)] {
            let per_chunk = crate::conv2d_cuda::cuda_chunk_images(s.x[1] * s.k * s.k, hw, dtype);
            assert_eq!(s.x[0].div_ceil(per_chunk), chunks, "{dtype:?}");
            // The last chunk is partial.
            assert_ne!(s.x[0] % per_chunk, 0, "{dtype:?}");
        }
        // The 1×1 convolution is the pointwise path (no im2col); stride 2 is not.
        assert_eq!((POINTWISE.k, POINTWISE.stride, POINTWISE.pad), (1, 1, 0));
        assert_eq!(STRIDED.y(), [64, 70, 9, 9]);
    }

    #[test]
    fn the_batchnorm_shapes_take_every_branch_split_over_several_blocks() {
        // (plane ≥ 256 threads | ≥ a warp | neither, blocks per channel)
        let branch = |x: [usize; 4]| {
            let hw = x[2] * x[3];
            let b = if hw >= 256 {
                "block"
            } else if hw >= 32 {
                "warp"
            } else {
                "flat"
            };
            (b, crate::batchnorm::cuda_split(x[0], x[2] * x[3]))
        };
        assert_eq!(branch(TRAIN_BN), ("block", 16));
        assert_eq!(branch(WARP_BN), ("warp", 4));
        assert_eq!(branch(TINY_BN), ("flat", 3));
        assert_eq!(branch(SMALL_BN), ("flat", 1));
        // Uneven image ranges per block, a plane that is no whole number of warps.
        assert_ne!(WARP_BN[0] % 4, 0);
        assert_ne!(WARP_BN[2] * WARP_BN[3] % 32, 0);
    }

    #[test]
    fn the_elementwise_sizes_are_not_multiples_of_a_block() {
        let windows = TRAIN_POOL.iter().product::<usize>() / 4;
        assert_ne!(windows % 256, 0);
        // Depthwise: a 1024-element plane is four blocks, a 289-element one two (one partial).
        assert_eq!(TRAIN_DW.x[2] * TRAIN_DW.x[3], 1024);
        assert_eq!((STRIDED_DW.x[2] * STRIDED_DW.x[3]).div_ceil(256), 2);
        assert_ne!(STRIDED.y().iter().product::<usize>() % 256, 0);
        for p in passes() {
            assert_eq!(
                p.training_like(),
                !p.shape().starts_with("[2,") && !p.shape().starts_with("[4,"),
                "{p:?}"
            );
        }
    }
}
