//! Our own Candle ops. Candle's grouped convolution is one conv per group plus a `cat` (O(C²)
//! backward work for depthwise), its CPU conv backward avoids gemm, and BatchNorm built from
//! tensor ops keeps f32 copies of half-precision activations; these ops replace all three.

pub mod batchnorm;
pub mod conv2d;
mod conv2d_bf16;
pub mod conv2d_cuda;
#[cfg(feature = "cuda")]
mod cuda_util;
pub mod depthwise;
pub mod gemm_bf16;
pub mod linear;
pub mod pool;
