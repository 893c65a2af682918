//! The AVX512-BF16 kernel: only reached after `bf16_kernel` detected the features.

use std::arch::x86_64::*;

use super::{MatRef, PackedB, KC, MR, NR};

/// `$tile::<rows>($args)` for `rows` in `1..=MR` (12): one tile function per row count, so
/// that its accumulators stay in registers.
macro_rules! by_rows {
    ($rows:expr, $tile:ident, $args:expr) => {
        match $rows {
            12 => $tile::<12>($args),
            11 => $tile::<11>($args),
            10 => $tile::<10>($args),
            9 => $tile::<9>($args),
            8 => $tile::<8>($args),
            7 => $tile::<7>($args),
            6 => $tile::<6>($args),
            5 => $tile::<5>($args),
            4 => $tile::<4>($args),
            3 => $tile::<3>($args),
            2 => $tile::<2>($args),
            _ => $tile::<1>($args),
        }
    };
}

/// The body both kernels share once their bounds are asserted: `dst (+)= A·B` over cache
/// blocks of KC pairs of `k` and micro-tiles of up to MR × NR, each tile computed by
/// `$tile::<rows>` (`a_ptr`: A's first element, as the element type `$tile` reads, `lda` its
/// row stride). A macro, not a function, so that the loop is expanded inside each kernel and
/// compiled with that kernel's target features, exactly as when it was written out twice.
///
/// Safety (at the expansion site): the kernel's own contract, with its bounds asserted.
macro_rules! blocked {
    ($tile:ident, $dst:ident, $dst_rs:ident, $accumulate:ident, $a_ptr:expr, $lda:expr,
     $m:ident, $k:ident, $b:ident) => {{
        let (m, k, n, b, dst_rs, accumulate) = ($m, $k, $b.n, $b, $dst_rs, $accumulate);
        let kp = b.kp();
        if k == 0 {
            if !accumulate {
                for i in 0..m {
                    $dst[i * dst_rs..i * dst_rs + n].fill(0.0);
                }
            }
            return;
        }
        let full = k / 2;
        let (a_ptr, lda) = ($a_ptr, $lda);
        let c_ptr = $dst.as_mut_ptr();
        let mut p0 = 0;
        while p0 < kp {
            let p1 = (p0 + KC).min(kp);
            // Pairs of this block read whole from A, and whether the block ends with the
            // zero-extended last element of an odd k.
            let whole = p1.min(full) - p0;
            let odd_tail = p1 > full;
            let load_c = accumulate || p0 > 0;
            for jp in 0..b.panels() {
                let j0 = jp * NR;
                let cols = (n - j0).min(NR);
                let masks = [col_mask(cols), col_mask(cols.saturating_sub(16))];
                let bp = b.words.as_ptr().add((jp * kp + p0) * NR);
                let mut i0 = 0;
                while i0 < m {
                    let rows = (m - i0).min(MR);
                    // SAFETY (all arms): rows i0..i0+rows of A hold k elements from column
                    // 2·p0 on (A's span asserted by the kernel); the panel block holds
                    // (p1 − p0)·NR words; the C tile's rows·cols elements lie in `dst` (its
                    // span asserted by the kernel), and the masks keep loads and stores
                    // inside `cols`.
                    let args = Tile {
                        a: a_ptr.add(i0 * lda + 2 * p0),
                        lda,
                        b: bp,
                        c: c_ptr.add(i0 * dst_rs + j0),
                        ldc: dst_rs,
                        whole,
                        odd_tail,
                        masks,
                        load_c,
                    };
                    by_rows!(rows, $tile, &args);
                    i0 += MR;
                }
            }
            p0 = p1;
        }
    }};
}

/// `dst (+)= A·B` over cache blocks of `k` and micro-tiles of `C`.
///
/// # Safety
/// The CPU must have AVX512F, AVX512BW and AVX512-BF16. `a.cs == 1` (or `a.cols <= 1`), `a`'s
/// span lies in `a.data`, `b.k() == a.cols`, and `dst` holds `a.rows × b.n()` with row stride
/// `dst_rs >= b.n()`; `a.rows, b.n() > 0`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn gemm_avx512(
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: MatRef<'_>,
    b: &PackedB,
) {
    let (m, k, n) = (a.rows, a.cols, b.n);
    let kp = b.kp();
    // The bounds the raw loops below rely on, re-checked here so that this function's
    // contract does not rest on the caller alone.
    assert!(m > 0 && n > 0 && dst_rs >= n);
    assert!(
        dst.len() >= (m - 1) * dst_rs + n,
        "gemm_bf16: dst out of bounds"
    );
    assert!(
        k == 0 || a.data.len() >= (m - 1) * a.rs + k,
        "gemm_bf16: A out of bounds"
    );
    assert!(
        b.words.len() >= b.panels() * kp * NR,
        "gemm_bf16: B out of bounds"
    );
    let a_ptr = a.data.as_ptr() as *const u16;
    blocked!(tile, dst, dst_rs, accumulate, a_ptr, a.rs, m, k, b);
}

/// `dst (+)= A·B` with f32 FMAs: `a` is `A` widened to f32 (`m` rows, stride `lda`), `B`
/// the packed bf16 pairs, widened in registers. Same blocking as [`gemm_avx512`].
///
/// # Safety
/// The CPU must have AVX512F. `a` holds `m` rows of `b.k()` values with row stride
/// `lda >= b.k()`; `dst` holds `m × b.n()` with row stride `dst_rs >= b.n()`; `m, b.n() > 0`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn gemm_fma(
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: &[f32],
    lda: usize,
    m: usize,
    b: &PackedB,
) {
    let (k, n) = (b.k, b.n);
    let kp = b.kp();
    assert!(m > 0 && n > 0 && dst_rs >= n && lda >= k);
    assert!(
        dst.len() >= (m - 1) * dst_rs + n,
        "gemm_bf16: dst out of bounds"
    );
    assert!(
        k == 0 || a.len() >= (m - 1) * lda + k,
        "gemm_bf16: A out of bounds"
    );
    assert!(
        b.words.len() >= b.panels() * kp * NR,
        "gemm_bf16: B out of bounds"
    );
    blocked!(tile_fma, dst, dst_rs, accumulate, a.as_ptr(), lda, m, k, b);
}

/// `C[R × NR] (+)= A[R × 2·whole (+1)] · Bpanel` with f32 FMAs. Each 32-bit word of `B` holds
/// rows 2p (low half) and 2p+1 (high half) of one column: shifting left by 16 gives row 2p as
/// f32, masking off the low half gives row 2p+1. So one load feeds 16 columns of two rows, at
/// the cost of two integer ops per 4·R FMAs (48 with R = 12).
///
/// # Safety
/// As [`gemm_fma`], for the tile's pointers (see its call site).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn tile_fma<const R: usize>(t: &Tile<f32>) {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    if t.load_c {
        for (r, row) in acc.iter_mut().enumerate() {
            for (v, a) in row.iter_mut().enumerate() {
                *a = _mm512_maskz_loadu_ps(t.masks[v], t.c.add(r * t.ldc + v * 16));
            }
        }
    }
    let hi = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    for p in 0..t.whole {
        let w0 = _mm512_loadu_si512(t.b.add(p * NR) as *const _);
        let w1 = _mm512_loadu_si512(t.b.add(p * NR + 16) as *const _);
        let e0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w0));
        let e1 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w1));
        let o0 = _mm512_castsi512_ps(_mm512_and_si512(w0, hi));
        let o1 = _mm512_castsi512_ps(_mm512_and_si512(w1, hi));
        for (r, row) in acc.iter_mut().enumerate() {
            let ae = _mm512_set1_ps(*t.a.add(r * t.lda + 2 * p));
            let ao = _mm512_set1_ps(*t.a.add(r * t.lda + 2 * p + 1));
            row[0] = _mm512_fmadd_ps(ae, e0, row[0]);
            row[1] = _mm512_fmadd_ps(ae, e1, row[1]);
            row[0] = _mm512_fmadd_ps(ao, o0, row[0]);
            row[1] = _mm512_fmadd_ps(ao, o1, row[1]);
        }
    }
    if t.odd_tail {
        let p = t.whole;
        let w0 = _mm512_loadu_si512(t.b.add(p * NR) as *const _);
        let w1 = _mm512_loadu_si512(t.b.add(p * NR + 16) as *const _);
        let e0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w0));
        let e1 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w1));
        for (r, row) in acc.iter_mut().enumerate() {
            let ae = _mm512_set1_ps(*t.a.add(r * t.lda + 2 * p));
            row[0] = _mm512_fmadd_ps(ae, e0, row[0]);
            row[1] = _mm512_fmadd_ps(ae, e1, row[1]);
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (v, a) in row.iter().enumerate() {
            _mm512_mask_storeu_ps(t.c.add(r * t.ldc + v * 16), t.masks[v], *a);
        }
    }
}

/// [`super::interleave_pair`] compiled with AVX-512.
///
/// # Safety
/// The CPU must have AVX512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn interleave_pair(
    lo: &[half::bf16],
    hi: &[half::bf16],
    words: &mut [u32],
    p: usize,
    kp: usize,
) {
    super::interleave_pair_body(lo, hi, words, p, kp)
}

/// `panel[p·NR + jj] = word(cols[jj·ld + 2p], cols[jj·ld + 2p + 1])` for `p < kp16` and
/// every `jj < NR`: the gather buffer's NR columns turned into a panel's pair-words, 16×16
/// words at a time in registers (three rounds of unpacks and 128-bit lane shuffles) instead
/// of one strided load per word.
///
/// # Safety
/// The CPU must have AVX512F; `kp16` is a multiple of 16, `ld` is even, `2·kp16 <= ld`,
/// `cols.len() >= NR·ld` and `panel.len() >= kp16·NR`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose_words(
    cols: &[half::bf16],
    ld: usize,
    kp16: usize,
    panel: &mut [u32],
) {
    debug_assert!(kp16.is_multiple_of(16) && ld.is_multiple_of(2) && 2 * kp16 <= ld);
    assert!(cols.len() >= NR * ld && panel.len() >= kp16 * NR);
    let src = cols.as_ptr() as *const u32;
    let ldw = ld / 2;
    let dst = panel.as_mut_ptr();
    for p0 in (0..kp16).step_by(16) {
        for jj0 in (0..NR).step_by(16) {
            // Row j: words p0..p0+16 of column jj0 + j.
            let mut r = [_mm512_setzero_si512(); 16];
            for (j, v) in r.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(src.add((jj0 + j) * ldw + p0) as *const _);
            }
            let t = transpose16(r);
            for (p, v) in t.iter().enumerate() {
                _mm512_storeu_si512(dst.add((p0 + p) * NR + jj0) as *mut _, *v);
            }
        }
    }
}

/// Transposes 16 vectors of 16 words: `out[p][j] = r[j][p]`.
#[inline(always)]
unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
    // Within each 128-bit lane L, after the 32- and 64-bit unpacks, vector 4g + e holds
    // element 4L + e of rows 4g..4g+4.
    let mut t = [_mm512_setzero_si512(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    let mut u = [_mm512_setzero_si512(); 16];
    for g in 0..4 {
        let b = 4 * g;
        u[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
        u[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
        u[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
        u[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
    }
    // Gather the lanes: 0x88 takes lanes 0 and 2 of each operand, 0xDD lanes 1 and 3.
    let mut v = [_mm512_setzero_si512(); 16];
    for e in 0..4 {
        v[e] = _mm512_shuffle_i32x4::<0x88>(u[e], u[e + 4]);
        v[e + 4] = _mm512_shuffle_i32x4::<0xDD>(u[e], u[e + 4]);
        v[e + 8] = _mm512_shuffle_i32x4::<0x88>(u[e + 8], u[e + 12]);
        v[e + 12] = _mm512_shuffle_i32x4::<0xDD>(u[e + 8], u[e + 12]);
    }
    let mut out = [_mm512_setzero_si512(); 16];
    for e in 0..8 {
        out[e] = _mm512_shuffle_i32x4::<0x88>(v[e], v[e + 8]);
        out[e + 8] = _mm512_shuffle_i32x4::<0xDD>(v[e], v[e + 8]);
    }
    out
}

/// [`super::widen_a`] compiled with AVX-512.
///
/// # Safety
/// The CPU must have AVX512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn widen_a(a: MatRef<'_>, buf: &mut Vec<f32>) -> usize {
    super::widen_a_body(a, buf)
}

/// A mask of the first `cols` (at most 16) lanes.
fn col_mask(cols: usize) -> u16 {
    if cols >= 16 {
        u16::MAX
    } else {
        ((1u32 << cols) - 1) as u16
    }
}

/// One micro-tile's operands (raw pointers at the tile's first elements); `A` is bf16 bits
/// (`u16`, the `vdpbf16ps` kernel) or f32 (the FMA kernel).
struct Tile<A> {
    a: *const A,
    lda: usize,
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    /// Pairs read whole from `A`.
    whole: usize,
    /// Whether one more pair follows whose high half is zero (odd `k`).
    odd_tail: bool,
    /// Lanes of `C` inside `n`, per vector.
    masks: [u16; 2],
    /// Start from `C` (accumulate) rather than from zero.
    load_c: bool,
}

/// `C[R × NR] (+)= A[R × 2·whole (+1)] · Bpanel`: `R` rows of two accumulators each, kept in
/// registers (R ≤ 12: 24 accumulators + 2 `B` vectors + a broadcast fit in 32 zmm).
///
/// # Safety
/// As [`gemm_avx512`], for the tile's pointers (see its call site).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
unsafe fn tile<const R: usize>(t: &Tile<u16>) {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    if t.load_c {
        for (r, row) in acc.iter_mut().enumerate() {
            for (v, a) in row.iter_mut().enumerate() {
                *a = _mm512_maskz_loadu_ps(t.masks[v], t.c.add(r * t.ldc + v * 16));
            }
        }
    }
    for p in 0..t.whole {
        let b0 = to_bh(_mm512_loadu_si512(t.b.add(p * NR) as *const _));
        let b1 = to_bh(_mm512_loadu_si512(t.b.add(p * NR + 16) as *const _));
        for (r, row) in acc.iter_mut().enumerate() {
            let pair = (t.a.add(r * t.lda + 2 * p) as *const i32).read_unaligned();
            let av = to_bh(_mm512_set1_epi32(pair));
            row[0] = _mm512_dpbf16_ps(row[0], av, b0);
            row[1] = _mm512_dpbf16_ps(row[1], av, b1);
        }
    }
    if t.odd_tail {
        let p = t.whole;
        let b0 = to_bh(_mm512_loadu_si512(t.b.add(p * NR) as *const _));
        let b1 = to_bh(_mm512_loadu_si512(t.b.add(p * NR + 16) as *const _));
        for (r, row) in acc.iter_mut().enumerate() {
            // The last element alone: the pair's high half (past k) is zero.
            let last = i32::from(*t.a.add(r * t.lda + 2 * p));
            let av = to_bh(_mm512_set1_epi32(last));
            row[0] = _mm512_dpbf16_ps(row[0], av, b0);
            row[1] = _mm512_dpbf16_ps(row[1], av, b1);
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (v, a) in row.iter().enumerate() {
            _mm512_mask_storeu_ps(t.c.add(r * t.ldc + v * 16), t.masks[v], *a);
        }
    }
}

/// The same 512 bits as 32 bf16 values.
#[inline(always)]
fn to_bh(v: __m512i) -> __m512bh {
    // SAFETY: both are plain 64-byte vectors with no invalid bit patterns.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}
