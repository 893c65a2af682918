//! Our own Candle ops. Candle's grouped convolution is one conv per group plus a `cat` (O(C²)
//! backward work for depthwise), its CPU conv backward avoids gemm, and BatchNorm built from
//! tensor ops keeps f32 copies of half-precision activations; these ops replace all three.

use std::sync::atomic::{AtomicBool, Ordering};

pub mod batchnorm;
pub mod bf16_convert;
pub mod conv2d;
mod conv2d_bf16;
pub mod conv2d_cuda;
pub mod conv2d_cudnn;
#[cfg(feature = "cuda")]
mod cuda_util;
pub mod depthwise;
pub mod gemm_bf16;
pub mod linear;
pub mod pool;

/// Whether f32 convolutions on CUDA may run on TF32 tensor cores; see [`set_tf32`].
static TF32: AtomicBool = AtomicBool::new(false);

/// Let f32 convolutions on CUDA multiply in TF32 (10-bit mantissa inputs, f32 sums): the im2col
/// op's cuBLAS gemms use `CUBLAS_COMPUTE_32F_FAST_TF32` and the cuDNN op the default math type
/// (tensor cores allowed) instead of FMA-only math. Process-wide, like PyTorch's
/// `torch.backends.cudnn.allow_tf32`, because the ops are called from deep inside the model
/// without a configuration at hand.
///
/// Off until someone turns it on: the ops compute exact f32 by default (as Candle's matmul
/// does), so op-level tests compare against the CPU at f32 tolerances. The trainer sets it from
/// `--tf32` ([`crate::config::TrainConfig::tf32`]). The head's matmul (Candle's) stays f32 either
/// way, as PyTorch's `torch.backends.cuda.matmul.allow_tf32` defaults to off. No effect on the CPU,
/// on f64, f16 or bf16, or on the depthwise op (CUDA cores).
pub fn set_tf32(on: bool) {
    TF32.store(on, Ordering::Relaxed);
}

/// Whether [`set_tf32`] is on.
pub fn tf32() -> bool {
    TF32.load(Ordering::Relaxed)
}
