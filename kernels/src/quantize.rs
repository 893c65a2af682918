//! 8-bit storage of an activation with a scale and an offset per channel (lossy).
//!
//! A training step that keeps a layer's output for its backward can keep a quarter of the bytes
//! (f32) or half (f16, bf16) by storing each element as a byte: for channel c,
//! `q = round((x − lo_c) / scale_c)` with `lo_c` the channel's minimum and
//! `scale_c = (hi_c − lo_c) / 255`, and the backward reads `x̃ = lo_c + q · scale_c`. The error of
//! an element is at most half a step, `scale_c / 2`. This is ActNN's idea (Chen et al., ICML 2021)
//! at its safest setting: 8 bits, one range per channel, round to nearest (deterministic, so the
//! same step gives the same gradients).
//!
//! On the CPU each direction is one pass per plane on Candle's thread pool (two for [`quantize`]:
//! the ranges, then the bytes), computed in f32 whatever the activation dtype; on other devices
//! the same arithmetic runs as Candle ops (with f32 transients the size of the activation).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

use candle_core::backend::BackendStorage;
use candle_core::WithDType;

use super::util::{cpu_slice, dispatch_float, for_planes, Float, SharedMut};

/// The name of the ops in errors.
const OP: &str = "quantize_u8";

/// Steps of the 8-bit code: 256 levels.
const LEVELS: f32 = 255.0;

/// An activation stored as one byte per element: what [`quantize`] returns and [`dequantize`]
/// reads.
#[derive(Debug, Clone)]
pub struct QuantizedU8 {
    /// The codes, u8, the activation's shape.
    pub codes: Tensor,
    /// Per channel: row 0 the offset `lo`, row 1 the step `scale` (f32 `[2, C]`).
    pub ranges: Tensor,
    /// The dtype [`dequantize`] returns (the activation's).
    pub dtype: DType,
}

impl QuantizedU8 {
    /// Bytes held: the codes and the ranges.
    pub fn bytes(&self) -> usize {
        self.codes.elem_count() + self.ranges.elem_count() * 4
    }
}

/// Stores `x` `[N, C, H, W]` (f32, f16 or bf16) as bytes with a range per channel; no autograd.
pub fn quantize(x: &Tensor) -> Result<QuantizedU8> {
    let (_, c, _, _) = x.dims4().map_err(|_| {
        candle_core::Error::Msg(format!("{OP}: expects [N, C, H, W], got {:?}", x.dims()))
    })?;
    let dtype = x.dtype();
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        candle_core::bail!("{OP}: unsupported dtype {dtype:?} (f32, f16 or bf16 only)")
    }
    let x = x.contiguous()?;
    if !x.device().is_cpu() {
        return quantize_ops(&x, c);
    }
    let ranges = x.apply_op1_no_bwd(&Ranges)?;
    let codes = x.apply_op2_no_bwd(&ranges, &Encode)?;
    Ok(QuantizedU8 {
        codes,
        ranges,
        dtype,
    })
}

/// The activation back from its codes, in the dtype it was stored from; no autograd.
pub fn dequantize(q: &QuantizedU8) -> Result<Tensor> {
    let codes = q.codes.contiguous()?;
    if !codes.device().is_cpu() {
        let lo = q.ranges.get(0)?.reshape((1, (), 1, 1))?;
        let scale = q.ranges.get(1)?.reshape((1, (), 1, 1))?;
        let x = codes
            .to_dtype(DType::F32)?
            .broadcast_mul(&scale)?
            .broadcast_add(&lo)?;
        return x.to_dtype(q.dtype);
    }
    codes.apply_op2_no_bwd(&q.ranges, &Decode { dtype: q.dtype })
}

/// [`quantize`] as Candle ops, for devices without the CPU kernels.
fn quantize_ops(x: &Tensor, c: usize) -> Result<QuantizedU8> {
    let x32 = x.to_dtype(DType::F32)?;
    let lo = x32.min_keepdim(3)?.min_keepdim(2)?.min_keepdim(0)?;
    let hi = x32.max_keepdim(3)?.max_keepdim(2)?.max_keepdim(0)?;
    let scale = ((&hi - &lo)? / LEVELS as f64)?;
    // A constant channel has scale 0: every code is 0 and decodes to lo.
    let inv = scale
        .gt(0.0)?
        .where_cond(&scale.recip()?, &scale.zeros_like()?)?;
    let codes = x32
        .broadcast_sub(&lo)?
        .broadcast_mul(&inv)?
        .round()?
        .clamp(0.0, LEVELS as f64)?
        .to_dtype(DType::U8)?;
    let ranges = Tensor::stack(&[lo.reshape(c)?, scale.reshape(c)?], 0)?;
    Ok(QuantizedU8 {
        codes,
        ranges,
        dtype: x.dtype(),
    })
}

/// `(n, c, h·w)` of a contiguous `[N, C, H, W]` layout.
fn dims(l: &Layout) -> Result<(usize, usize, usize)> {
    let (n, c, h, w) = l.shape().dims4()?;
    Ok((n, c, h * w))
}

/// Per-channel `[lo; scale]` of an activation.
struct Ranges;
/// The codes of an activation from its ranges.
struct Encode;
/// The activation from its codes and ranges.
struct Decode {
    dtype: DType,
}

/// Per channel `(min, max)` over every plane of that channel, then `[lo; scale]` (`[2, C]`).
fn ranges<T: Float>(x: &[T], n: usize, c: usize, hw: usize) -> Vec<f32> {
    let mut part = vec![(f32::INFINITY, f32::NEG_INFINITY); n * c];
    let ptr = SharedMut(part.as_mut_ptr());
    for_planes(n * c, hw, |r| {
        // SAFETY: the pool hands out disjoint plane ranges within 0..n·c.
        let out = unsafe { ptr.range(r.start, r.len()) };
        for (p, slot) in r.zip(out.iter_mut()) {
            *slot = x[p * hw..(p + 1) * hw].iter().fold(*slot, |(lo, hi), v| {
                (lo.min(v.to_f32()), hi.max(v.to_f32()))
            });
        }
    });
    let mut lo = vec![f32::INFINITY; c];
    let mut hi = vec![f32::NEG_INFINITY; c];
    for (p, &(l, h)) in part.iter().enumerate() {
        lo[p % c] = lo[p % c].min(l);
        hi[p % c] = hi[p % c].max(h);
    }
    // An empty or all-NaN channel (no finite range) is stored as zeros.
    let lo: Vec<f32> = lo
        .iter()
        .map(|&l| if l.is_finite() { l } else { 0.0 })
        .collect();
    let scale = hi.iter().zip(&lo).map(|(&h, &l)| {
        if h.is_finite() {
            (h - l).max(0.0) / LEVELS
        } else {
            0.0
        }
    });
    lo.iter().copied().chain(scale).collect()
}

fn encode<T: Float>(x: &[T], r: &[f32], n: usize, c: usize, hw: usize) -> Vec<u8> {
    let mut codes = vec![0u8; n * c * hw];
    let ptr = SharedMut(codes.as_mut_ptr());
    for_planes(n * c, hw, |planes| {
        for p in planes {
            let (lo, scale) = (r[p % c], r[c + p % c]);
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            // SAFETY: each plane is written by the one worker that got it.
            let out = unsafe { ptr.range(p * hw, hw) };
            for (q, v) in out.iter_mut().zip(&x[p * hw..(p + 1) * hw]) {
                // `as u8` saturates (and maps NaN to 0): the clamp is the cast.
                *q = ((v.to_f32() - lo) * inv).round() as u8;
            }
        }
    });
    codes
}

fn decode<T: Float>(codes: &[u8], r: &[f32], n: usize, c: usize, hw: usize) -> Vec<T> {
    let mut x = T::zeros(n * c * hw);
    let ptr = SharedMut(x.as_mut_ptr());
    for_planes(n * c, hw, |planes| {
        for p in planes {
            let (lo, scale) = (r[p % c], r[c + p % c]);
            // SAFETY: each plane is written by the one worker that got it.
            let out = unsafe { ptr.range(p * hw, hw) };
            for (v, &q) in out.iter_mut().zip(&codes[p * hw..(p + 1) * hw]) {
                *v = T::from_f32(lo + q as f32 * scale);
            }
        }
    });
    x
}

/// The ranges operand: f32 `[2, C]`.
fn ranges_operand<'a>(s: &'a CpuStorage, l: &Layout, c: usize) -> Result<&'a [f32]> {
    if l.shape().dims() != [2, c] {
        candle_core::bail!("{OP}: ranges must be [2, {c}], got {:?}", l.shape())
    }
    cpu_slice(s, l, OP, "ranges")
}

impl CustomOp1 for Ranges {
    fn name(&self) -> &'static str {
        "quantize-u8-ranges"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, c, hw) = dims(l)?;
        let r = dispatch_float!(
            s.dtype(),
            [F32, F16, BF16],
            |T| ranges::<T>(cpu_slice(s, l, OP, "input")?, n, c, hw),
            |dt| candle_core::bail!("{OP}: unsupported dtype {dt:?}")
        );
        Ok((CpuStorage::F32(r), Shape::from((2, c))))
    }
}

impl CustomOp2 for Encode {
    fn name(&self) -> &'static str {
        "quantize-u8"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        rs: &CpuStorage,
        rl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, c, hw) = dims(l)?;
        let r = ranges_operand(rs, rl, c)?;
        let codes = dispatch_float!(
            s.dtype(),
            [F32, F16, BF16],
            |T| encode::<T>(cpu_slice(s, l, OP, "input")?, r, n, c, hw),
            |dt| candle_core::bail!("{OP}: unsupported dtype {dt:?}")
        );
        Ok((CpuStorage::U8(codes), l.shape().clone()))
    }
}

impl CustomOp2 for Decode {
    fn name(&self) -> &'static str {
        "dequantize-u8"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        rs: &CpuStorage,
        rl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, c, hw) = dims(l)?;
        let r = ranges_operand(rs, rl, c)?;
        let codes = cpu_slice::<u8>(s, l, OP, "codes")?;
        let out = dispatch_float!(
            self.dtype,
            [F32, F16, BF16],
            |T| T::to_cpu_storage_owned(decode::<T>(codes, r, n, c, hw)),
            |dt| candle_core::bail!("{OP}: unsupported dtype {dt:?}")
        );
        Ok((out, l.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn every_element_is_within_half_a_step_and_the_extremes_are_exact() -> Result<()> {
        let x = Tensor::randn(0f32, 2.0, (3, 4, 5, 6), &Device::Cpu)?;
        let q = quantize(&x)?;
        assert_eq!(q.codes.dtype(), DType::U8);
        let back = dequantize(&q)?;
        let xs = x.transpose(0, 1)?.flatten_from(1)?.to_vec2::<f32>()?;
        let bs = back.transpose(0, 1)?.flatten_from(1)?.to_vec2::<f32>()?;
        let scale = q.ranges.get(1)?.to_vec1::<f32>()?;
        for ((xc, bc), s) in xs.iter().zip(&bs).zip(&scale) {
            let lo = xc.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = xc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert!((s - (hi - lo) / 255.0).abs() <= 1e-6 * hi.abs().max(1.0));
            for (a, b) in xc.iter().zip(bc) {
                assert!((a - b).abs() <= s * 0.5 + 1e-5, "{a} vs {b}, step {s}");
            }
            let blo = bc.iter().copied().fold(f32::INFINITY, f32::min);
            let bhi = bc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(blo, lo);
            assert!((bhi - hi).abs() <= 1e-5 * hi.abs().max(1.0));
        }
        Ok(())
    }

    #[test]
    fn the_ops_path_gives_the_kernels_codes() -> Result<()> {
        let x = Tensor::randn(0f32, 1.0, (2, 3, 4, 4), &Device::Cpu)?;
        let k = quantize(&x)?;
        let o = quantize_ops(&x, 3)?;
        let (kr, or) = (k.ranges.to_vec2::<f32>()?, o.ranges.to_vec2::<f32>()?);
        for (a, b) in kr.iter().flatten().zip(or.iter().flatten()) {
            // Candle divides by 255 as a multiplication by its f64 inverse: an ulp apart.
            assert!((a - b).abs() <= 1e-6 * a.abs().max(1e-3), "{a} vs {b}");
        }
        let (kc, oc) = (
            k.codes.flatten_all()?.to_vec1::<u8>()?,
            o.codes.flatten_all()?.to_vec1::<u8>()?,
        );
        // Multiplying by 1/scale may land a value a rounding away from the kernel's code.
        let off = kc.iter().zip(&oc).filter(|(a, b)| a != b).count();
        assert!(off * 100 <= kc.len(), "{off} of {} codes differ", kc.len());
        Ok(())
    }

    #[test]
    fn a_constant_channel_decodes_to_its_value_in_every_dtype() -> Result<()> {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let x = Tensor::full(1.5f32, (2, 2, 3, 3), &Device::Cpu)?.to_dtype(dt)?;
            let q = quantize(&x)?;
            let back = dequantize(&q)?;
            assert_eq!(back.dtype(), dt);
            let v = back.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            assert!(v.iter().all(|&v| v == 1.5), "{dt:?}: {v:?}");
        }
        Ok(())
    }
}
