//! Our own Candle ops. Candle's grouped convolution is one conv per group plus a `cat` (O(C²)
//! backward work for depthwise), its CPU conv backward avoids gemm, and BatchNorm built from
//! tensor ops keeps f32 copies of half-precision activations; these ops replace all three.

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
