//! Shared helpers for the op tests: comparisons of tensors.
#![allow(dead_code)]

use candle_core::{DType, Tensor};

/// Every element of a tensor as f64 (any float dtype).
fn values_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// The bits of every element of a tensor as f32 (any float dtype up to f32), for exact
/// comparisons that NaN does not defeat.
pub fn f32_bits(t: &Tensor) -> Vec<u32> {
    values_f64(t)
        .into_iter()
        .map(|v| (v as f32).to_bits())
        .collect()
}

/// Max |a-b| / max |b| over two tensors (compared in f64).
pub fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let a = values_f64(a);
    let b = values_f64(b);
    assert_eq!(a.len(), b.len(), "shape mismatch");
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f64, f64::max);
    // `f64::max` skips NaN, so a NaN in either tensor would otherwise compare as agreement.
    assert!(
        a.iter().chain(&b).all(|v| v.is_finite()) || a == b,
        "non-finite values"
    );
    diff / scale
}

/// [`rel_diff`] as f32, for the op tests' f32 tolerances.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    rel_diff(a, b) as f32
}

/// Every element of a tensor as f32 (any float dtype).
pub fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// Every element's f32 bits, so that two results compare exactly (`-0.0 != 0.0`, NaN == NaN).
pub fn bits(t: &Tensor) -> Vec<u32> {
    values(t).into_iter().map(f32::to_bits).collect()
}
