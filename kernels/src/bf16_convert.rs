//! bf16 ↔ f32 slice conversions, 16 lanes at a time with AVX-512 where the CPU has it.
//!
//! `half` converts bf16 slices element by element ("until there's any bf16 SIMD support", its
//! source says), with a NaN test and a rounding branch per element on the way down. The bf16
//! training step converts every activation it normalizes, recomputes or writes back, so those
//! loops showed up as a tenth of the step in `perf`. The functions here give bit for bit the
//! results of `half`'s `bf16::from_f32` / `bf16::to_f32` (round to nearest, ties to even;
//! NaNs stay NaN with the quiet bit set; no flushing of denormals), which `tests/bf16_convert.rs`
//! checks on every class of input. Not `vcvtneps2bf16` (AVX512-BF16): it flushes denormals, so
//! it would not be the same function.

use half::bf16;

/// Rounds f32 bits to the nearest bf16 bits, ties to even, as `half::bf16::from_f32` does.
///
/// Adding `0x7FFF` plus the lowest kept bit carries into the kept half exactly when the
/// dropped half is above one half, or exactly one half with an odd kept half. Infinity and the
/// largest finite values round the same way as in `half` (up to infinity when they should).
/// Widens bf16 bits to f32 bits as `half::bf16::to_f32` does: exact, except that a signalling
/// NaN comes back quiet.
#[inline(always)]
fn widen_bits(h: u16) -> u32 {
    if h & 0x7FFF > 0x7F80 {
        return (h as u32 | 0x0040) << 16;
    }
    (h as u32) << 16
}

#[inline(always)]
fn narrow_bits(x: u32) -> u16 {
    if x & 0x7FFF_FFFF > 0x7F80_0000 {
        // NaN: keep the payload's high bits and set the quiet bit, as `half` does.
        return ((x >> 16) | 0x0040) as u16;
    }
    (x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16) as u16
}

/// `dst[i] = src[i]` as f32 (exact: a bf16 is the high half of an f32; NaNs come back quiet).
///
/// # Panics
/// When the lengths differ.
pub fn widen(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(
        src.len(),
        dst.len(),
        "bf16 widen: slices of different lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        // SAFETY: AVX512F is present (checked just above); the lengths are equal.
        unsafe { avx512::widen(src, dst) };
        return;
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits(widen_bits(s.to_bits()));
    }
}

/// `dst[i] = src[i]` rounded to bf16 (nearest, ties to even), as `bf16::from_f32`.
///
/// # Panics
/// When the lengths differ.
pub fn narrow(src: &[f32], dst: &mut [bf16]) {
    assert_eq!(
        src.len(),
        dst.len(),
        "bf16 narrow: slices of different lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        // SAFETY: AVX512F and AVX512BW are present (checked just above); the lengths are equal.
        unsafe { avx512::narrow(src, dst) };
        return;
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16::from_bits(narrow_bits(s.to_bits()));
    }
}

/// `buf[i] = buf[i]` rounded to bf16 and widened back: what a value becomes when it is stored
/// in a bf16 tensor and read again, without a bf16 buffer in between.
pub fn round(buf: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        // SAFETY: AVX512F is present (checked just above).
        unsafe { avx512::round(buf) };
        return;
    }
    for v in buf.iter_mut() {
        *v = f32::from_bits(widen_bits(narrow_bits(v.to_bits())));
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{bf16, narrow_bits, widen_bits};
    use std::arch::x86_64::*;

    /// AVX512F (the 32-bit lane arithmetic) and AVX512BW (16-bit lane moves). `std` caches the
    /// CPUID result, so this is one atomic load per call.
    #[inline(always)]
    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
    }

    /// # Safety
    /// AVX512F must be available; `src.len() == dst.len()`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn widen(src: &[bf16], dst: &mut [f32]) {
        let n = src.len();
        let body = n / 16 * 16;
        let (s, d) = (src.as_ptr() as *const u16, dst.as_mut_ptr());
        let mut i = 0;
        while i < body {
            let h = _mm256_loadu_si256(s.add(i) as *const __m256i);
            let w = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
            _mm512_storeu_ps(d.add(i), _mm512_castsi512_ps(quiet_nans(w)));
            i += 16;
        }
        for j in body..n {
            dst[j] = f32::from_bits(widen_bits(src[j].to_bits()));
        }
    }

    /// `w` (f32 bits widened from bf16) with the quiet bit set in its NaNs ([`widen_bits`]).
    #[inline(always)]
    unsafe fn quiet_nans(w: __m512i) -> __m512i {
        let abs = _mm512_and_si512(w, _mm512_set1_epi32(0x7FFF_FFFF));
        let nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7F80_0000));
        _mm512_mask_or_epi32(w, nan, w, _mm512_set1_epi32(0x0040_0000))
    }

    /// The rounded bf16 bits of 16 f32 values, in the low halves of the 32-bit lanes
    /// ([`narrow_bits`] lane by lane).
    #[inline(always)]
    unsafe fn narrow16(x: __m512i) -> __m512i {
        let hi = _mm512_srli_epi32::<16>(x);
        let lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
        let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(x, bias));
        let abs = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFF_FFFF));
        let nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7F80_0000));
        let quiet = _mm512_or_si512(hi, _mm512_set1_epi32(0x0040));
        _mm512_mask_mov_epi32(rounded, nan, quiet)
    }

    /// # Safety
    /// AVX512F and AVX512BW must be available; `src.len() == dst.len()`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn narrow(src: &[f32], dst: &mut [bf16]) {
        let n = src.len();
        let body = n / 16 * 16;
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr() as *mut u16);
        let mut i = 0;
        while i < body {
            let x = _mm512_castps_si512(_mm512_loadu_ps(s.add(i)));
            let h = _mm512_cvtepi32_epi16(narrow16(x));
            _mm256_storeu_si256(d.add(i) as *mut __m256i, h);
            i += 16;
        }
        for j in body..n {
            dst[j] = bf16::from_bits(narrow_bits(src[j].to_bits()));
        }
    }

    /// # Safety
    /// AVX512F must be available.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn round(buf: &mut [f32]) {
        let n = buf.len();
        let body = n / 16 * 16;
        let p = buf.as_mut_ptr();
        let mut i = 0;
        while i < body {
            let x = _mm512_castps_si512(_mm512_loadu_ps(p.add(i)));
            // A NaN is already quiet after `narrow16`, so the widening needs no NaN step.
            let w = _mm512_slli_epi32::<16>(narrow16(x));
            _mm512_storeu_ps(p.add(i), _mm512_castsi512_ps(w));
            i += 16;
        }
        for v in &mut buf[body..] {
            *v = f32::from_bits(widen_bits(narrow_bits(v.to_bits())));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scalar widening (the fallback, and every tail) is `half`'s on every bf16.
    #[test]
    fn widen_bits_is_halfs() {
        for h in 0..=u16::MAX {
            assert_eq!(
                widen_bits(h),
                bf16::from_bits(h).to_f32().to_bits(),
                "{h:#06x}"
            );
        }
    }

    /// The scalar rounding (the fallback, and every tail) is `half`'s on a spread of bit
    /// patterns: both signs, zeros, denormals, ties, the largest finite values, infinities, NaNs.
    #[test]
    fn narrow_bits_is_halfs() {
        let mut x = 0u32;
        loop {
            for d in [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF] {
                let b = x | d;
                assert_eq!(
                    narrow_bits(b),
                    bf16::from_f32(f32::from_bits(b)).to_bits(),
                    "{b:#010x}"
                );
            }
            match x.checked_add(0x1_0000 * 7 + 0x1234) {
                Some(n) => x = n,
                None => break,
            }
        }
    }
}
