//! Our own Candle ops. Candle's grouped convolution is one conv per group plus a `cat` (O(C²)
//! backward work for depthwise), its CPU conv backward avoids gemm, and BatchNorm built from
//! tensor ops keeps f32 copies of half-precision activations; these ops replace all three.
//!
//! Every op has one shape: a public function that validates its arguments and makes them
//! contiguous, one Candle op type per pass (or one carrying the pass, for the convolutions'
//! forward, input gradient and weight gradient), and a CPU and a CUDA half that the op
//! dispatches to by dtype. Layout:
//!
//! ```text
//! util.rs            what every op shares: element types (Float), dtype dispatch (dispatch_float!),
//!                    operand access (cpu_slice, cuda_view, expect_dims), NVRTC kernels and launch
//!                    helpers (Kernels, kernel_source!, grid_stride), the TF32 switch
//! geom.rs            the convolutions' shapes: conv2d's Geom, ConvPass, the window checks
//! conv2d.rs          conv2d's API and its op, which dispatches each pass to one of
//!   conv2d_cpu.rs      the CPU passes (im2col + gemm, threading, ordered sums)
//!   conv2d_bf16.rs     the AVX512-BF16 CPU passes (on gemm_bf16.rs)
//!   conv2d_cuda.rs     im2col + cuBLAS on CUDA
//!   conv2d_cudnn.rs    cuDNN on CUDA (`cudnn` feature)
//! depthwise.rs       depthwise conv2d: API, op, CPU kernels, CUDA launches
//! batchnorm.rs       fused BatchNorm (+ ReLU) and the lean step's passes from h
//! pool.rs            2x2 max-pool with a correct backward
//! linear.rs          the head's single-threaded matmul
//! gemm_bf16.rs       bf16 gemm micro-kernels; bf16_convert.rs: bf16 <-> f32 slices
//! kernels/*.cu       every CUDA kernel (conv2d, depthwise, batchnorm, pool), each compiled by NVRTC
//!                    after kernels/prelude.cuh (half types, load/store), and by
//!                    `scripts/cuda-check.sh` the same way
//! ```
//!
//! Imports go one way: the ops import `util` and `geom`, never the reverse, and conv2d's halves
//! import `geom` and each other's building blocks (bf16 uses the CPU half's im2col and threading,
//! cuDNN falls back to the im2col op), never the dispatcher in `conv2d.rs`.

pub mod batchnorm;
pub mod bf16_convert;
pub mod conv2d;
mod conv2d_bf16;
mod conv2d_cpu;
pub mod conv2d_cuda;
pub mod conv2d_cudnn;
pub mod depthwise;
pub mod gemm_bf16;
mod geom;
pub mod linear;
pub mod pool;
mod util;

pub use util::{set_tf32, tf32};
