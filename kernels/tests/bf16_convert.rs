//! `ops::bf16_convert` gives bit for bit `half`'s conversions (the per-element ones the BatchNorm
//! and conv passes used before), on every class of input and every tail length.

use half::bf16;
use memtrain_kernels::bf16_convert::{narrow, round, widen};

/// f32 bit patterns around every rounding case: zeros, denormals, ties to even both ways, the
/// largest finite values (which round to infinity), infinities, quiet and signalling NaNs, both
/// signs, and a sweep of exponents.
fn cases() -> Vec<f32> {
    let mut bits = vec![
        0x0000_0000u32,
        0x0000_0001,
        0x0000_8000,
        0x0001_8000,
        0x007F_FFFF,
        0x0080_0000,
        0x3F80_8000, // 1 + half an ulp of bf16: tie, even below
        0x3F81_8000, // tie, odd below: rounds up
        0x3F80_8001,
        0x3F80_7FFF,
        0x7F7F_7FFF,
        0x7F7F_8000, // rounds to infinity
        0x7F7F_FFFF,
        0x7F80_0000,
        0x7F80_0001, // signalling NaN: quieted
        0x7FC0_0000,
        0x7FFF_FFFF,
    ];
    for e in 0..256u32 {
        for m in [0u32, 0x1234, 0x7FFF, 0x8000, 0x8001, 0x1_8000, 0x7F_FFFF] {
            bits.push(e << 23 | m);
        }
    }
    let neg: Vec<u32> = bits.iter().map(|b| b | 0x8000_0000).collect();
    bits.extend(neg);
    bits.into_iter().map(f32::from_bits).collect()
}

#[test]
fn narrow_and_round_match_half_on_every_length() {
    let all = cases();
    // Lengths that leave every tail length after the 16-lane body, and the whole set.
    for len in (0..40).chain([all.len()]) {
        for start in [0, 1, 7] {
            let src = &all[start..(start + len).min(all.len())];
            let mut got = vec![bf16::ZERO; src.len()];
            narrow(src, &mut got);
            let mut rounded = src.to_vec();
            round(&mut rounded);
            for (i, &x) in src.iter().enumerate() {
                let want = bf16::from_f32(x);
                assert_eq!(
                    got[i].to_bits(),
                    want.to_bits(),
                    "narrow {:#010x}",
                    x.to_bits()
                );
                assert_eq!(
                    rounded[i].to_bits(),
                    want.to_f32().to_bits(),
                    "round {:#010x}",
                    x.to_bits()
                );
            }
        }
    }
}

#[test]
fn widen_matches_half_on_every_bf16() {
    // All 65,536 bf16 bit patterns, at offsets that exercise the tails.
    let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    for start in [0, 3] {
        let src = &all[start..];
        let mut got = vec![0f32; src.len()];
        widen(src, &mut got);
        for (g, s) in got.iter().zip(src) {
            assert_eq!(
                g.to_bits(),
                s.to_f32().to_bits(),
                "widen {:#06x}",
                s.to_bits()
            );
        }
    }
}

#[test]
#[should_panic(expected = "different lengths")]
fn narrow_rejects_mismatched_lengths() {
    narrow(&[1.0, 2.0], &mut [bf16::ZERO]);
}
