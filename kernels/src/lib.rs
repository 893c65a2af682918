//! Candle ops for training convolutional networks in less memory, on the CPU and on CUDA.
//!
//! Each op is a plain function on [`candle_core::Tensor`]s that returns
//! [`candle_core::Result`], differentiable through Candle's autograd where it says so, with
//! explicit backward passes beside it for a caller that runs its own tape. What they offer any
//! Candle user:
//!
//! - [`depthwise::depthwise_conv2d`]: a depthwise 3x3 (any square kernel) convolution in one pass,
//!   forward and backward. Candle's grouped convolution is one convolution per group plus a
//!   `cat`, O(C²) backward work for a depthwise layer.
//! - [`conv2d::conv2d`]: a convolution whose forward and backward run as im2col + gemm over
//!   chunks of the batch, so their scratch is bounded ([`conv2d::IM2COL_CHUNK_BYTES`] on the CPU,
//!   32 MiB on CUDA ([`conv2d_cuda::cuda_scratch_bytes`]), or one cuDNN workspace of
//!   [`cudnn_workspace_bytes`] with the `cudnn` feature) instead of a whole-batch
//!   column matrix (9× the input for 3x3); its CPU backward runs on gemm, and every CPU pass is
//!   bit-for-bit reproducible for a given thread count.
//! - [`batchnorm`]: training-mode BatchNorm (+ ReLU) that reads and writes the activation dtype
//!   and keeps its statistics in f32 (no f32 copy of a half-precision activation), and the passes
//!   of a lean step ([`batchnorm::bn_relu_backward`] and friends) that recompute the ReLU output
//!   from the saved pre-normalization tensor and write the input gradient in place.
//! - [`gemm_bf16`]: bf16 matrix products on AVX-512 (AVX512-BF16 `vdpbf16ps` where the CPU has
//!   it), which the convolutions use for bf16 on the CPU; [`bf16_convert`]: bf16 <-> f32 slices.
//! - [`pool::max_pool2x2`]: 2x2 max-pool whose backward routes each gradient to the window's
//!   first maximum (Candle 0.11's scales it by the number of tied maxima over four).
//! - [`quantize::quantize`]: an activation stored as 8-, 4- or 2-bit codes with a range per
//!   channel or per group of a plane (lossy; [`quantize::dequantize`] reads it back), for a step
//!   that keeps fewer bytes for its backward.
//! - [`selfcheck::check_device`]: every pass of the ops above run once on a device and on the
//!   CPU, compared, so that a wrong CUDA kernel is named before it trains anything.
//! - [`linear::matmul`]: small products (a classifier head) on the calling thread, so the heap
//!   does not depend on which pool threads picked up work; no autograd.
//!
//! Features: `cuda` (the CUDA half of every op: NVRTC kernels from `cu/`, im2col + cuBLAS
//! convolutions) and `cudnn` (convolutions through cuDNN, on top of `cuda`). f32, f16 and bf16
//! everywhere (f64 for the convolutions too); half types accumulate in f32.
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use memtrain_kernels::{batchnorm, conv2d, depthwise, pool};
//!
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! let x = Tensor::randn(0f32, 1.0, (4, 8, 16, 16), &dev)?;
//! let dw = Var::randn(0f32, 0.3, (8, 1, 3, 3), &dev)?; // depthwise 3x3
//! let pw = Var::randn(0f32, 0.3, (16, 8, 1, 1), &dev)?; // pointwise 8 -> 16
//! let gamma = Var::ones(16, DType::F32, &dev)?;
//! let beta = Var::zeros(16, DType::F32, &dev)?;
//!
//! let h = depthwise::depthwise_conv2d(&x, dw.as_tensor(), 1, 1)?;
//! let h = conv2d::conv2d(&h, pw.as_tensor(), 1, 0)?;
//! let (y, _mean, _var) =
//!     batchnorm::batch_norm_train(&h, gamma.as_tensor(), beta.as_tensor(), 1e-5, true)?;
//! let y = pool::max_pool2x2(&y)?;
//! assert_eq!(y.dims(), &[4, 16, 8, 8]);
//!
//! let grads = y.sqr()?.sum_all()?.backward()?;
//! for v in [&dw, &pw, &gamma, &beta] {
//!     assert_eq!(grads.get(v.as_tensor()).unwrap().dims(), v.dims());
//! }
//! # Ok(())
//! # }
//! ```
//!
//! How it is built: every op has one shape, a public function that validates its arguments and
//! makes them contiguous, one Candle op type per pass (or one carrying the pass, for the
//! convolutions' forward, input gradient and weight gradient), and a CPU and a CUDA half that the
//! op dispatches to by dtype. Layout:
//!
//! ```text
//! util.rs            what every op shares: element types (Float), dtype dispatch (dispatch_float!),
//!                    operand access (cpu_slice, cuda_view, expect_dims), NVRTC kernels and launch
//!                    helpers (Kernels, kernel_source!, grid_stride), the TF32 and cuDNN determinism switches
//! geom.rs            the convolutions' shapes: conv2d's Geom, ConvPass, the window checks
//! conv2d.rs          conv2d's API and its op, which dispatches each pass to one of
//!   conv2d_cpu.rs      the CPU passes (im2col + gemm)
//!   conv2d_threads.rs  how both CPU halves share work out: thread counts, per-thread scratch,
//!                      per-image and per-chunk dispatch, ordered sums
//!   conv2d_bf16.rs     the AVX512-BF16 CPU passes (on gemm_bf16.rs)
//!   conv2d_cuda.rs     im2col + cuBLAS on CUDA
//!   conv2d_cudnn.rs    cuDNN on CUDA (`cudnn` feature)
//! depthwise.rs       depthwise conv2d: API, op, CPU kernels, CUDA launches
//! batchnorm/         fused BatchNorm (+ ReLU): mod.rs the API and the ops, lean.rs the lean
//!                    step's passes from h, cpu.rs and cuda.rs their kernels
//! pool.rs            2x2 max-pool with a correct backward
//! quantize.rs        8-, 4- and 2-bit storage of an activation, a range per channel or plane
//! linear.rs          the single-threaded matmul
//! gpu_time.rs        GPU time of each convolution pass and between marks, from CUDA events
//! selfcheck.rs       every pass run once on a device and on the CPU and compared (a run on a GPU
//!                    does this before its first step)
//! gemm_bf16.rs       bf16 gemm micro-kernels (gemm_bf16/avx512.rs: the AVX512-BF16 kernel);
//!                    bf16_convert.rs: bf16 <-> f32 slices
//! cu/*.cu            every CUDA kernel (conv2d, depthwise, batchnorm, pool), each compiled by NVRTC
//!                    after cu/prelude.cuh (half types, load/store), and by memtrain's
//!                    `scripts/cuda-check.sh` the same way
//! ```
//!
//! Imports go one way: the ops import `util` and `geom`, never the reverse, and conv2d's halves
//! import `geom`, `conv2d_threads` and each other's building blocks (bf16 uses the CPU half's im2col,
//! cuDNN falls back to the im2col op), never the dispatcher in `conv2d.rs`.
#![warn(missing_docs)]
// Module docs explain the private halves they are built from (`cargo doc --document-private-items`).
#![allow(rustdoc::private_intra_doc_links)]

pub mod batchnorm;
pub mod bf16_convert;
pub mod conv2d;
mod conv2d_bf16;
mod conv2d_cpu;
pub mod conv2d_cuda;
pub mod conv2d_cudnn;
mod conv2d_threads;
pub mod depthwise;
pub mod gemm_bf16;
mod geom;
pub mod gpu_time;
pub mod linear;
pub mod pool;
pub mod quantize;
pub mod selfcheck;
mod util;

pub use util::{
    cudnn_nondeterministic, cudnn_workspace_bytes, set_cudnn_nondeterministic,
    set_cudnn_workspace_bytes, set_tf32, tf32, DEFAULT_CUDNN_WORKSPACE_BYTES,
};
