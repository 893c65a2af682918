//! The bf16 gemm (`memtrain_kernels::gemm_bf16`) against the widen-to-f32 path and an f64
//! reference, on awkward shapes and strides.
//!
//! Tolerance: every product of two bf16 values is exact in f32 (8-bit significands give a 16-bit
//! product), so both paths sum the same exact terms in f32, only in different orders (the
//! AVX512-BF16 kernel pairs them per `vdpbf16ps` lane and blocks `k`; the `gemm` crate has its own
//! blocking). For any order, a sum of `K` terms computed in f32 is within `(K−1)·u·Σ|terms|` of the
//! exact sum, `u = 2⁻²⁴` (Higham, *Accuracy and Stability of Numerical Algorithms*, §4.2). So each
//! path is within `K·u·Σ|a||b|` of the f64 reference (which is exact to far below that), and the
//! two paths within twice that of each other; with `accumulate`, the starting value is one more
//! term. These bounds are what is asserted, per element.
//!
//! `MEMTRAIN_BF16_GEMM=dpbf16|fma|widen` picks the kernel under test (see `bf16_kernel`). On a
//! CPU without AVX-512 the kernel *is* the widening path; the tests then say so on
//! stderr and still check it against the f64 reference.

use half::bf16;
use memtrain_kernels::gemm_bf16::{
    bf16_kernel, cpu_has_avx512bf16, gemm, gemm_prepared, gemm_widened, gemm_with,
    kernel_supported, Bf16Kernel, MatRef, PackedB, PreparedA, KC,
};

/// The kernels this CPU can run (the widening fallback always).
fn kernels() -> Vec<Bf16Kernel> {
    [
        Bf16Kernel::Avx512Bf16,
        Bf16Kernel::Avx512Fma,
        Bf16Kernel::Widen,
    ]
    .into_iter()
    .filter(|&k| kernel_supported(k))
    .collect()
}

const U: f64 = 1.0 / (1u64 << 24) as f64;

/// A small deterministic generator (no seeding questions across platforms).
struct Lcg(u64);

impl Lcg {
    /// A bf16 in [-2, 2): normal-range values, as training produces.
    fn bf16(&mut self) -> bf16 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let x = ((self.0 >> 40) as f64 / (1u64 << 24) as f64) * 4.0 - 2.0;
        bf16::from_f64(x)
    }

    fn vec(&mut self, len: usize) -> Vec<bf16> {
        (0..len).map(|_| self.bf16()).collect()
    }
}

fn report_kernel() {
    if bf16_kernel() != Bf16Kernel::Widen {
        eprintln!(
            "gemm_bf16: testing kernels {:?} (the process uses {:?})",
            kernels(),
            bf16_kernel()
        );
    } else {
        eprintln!(
            "gemm_bf16: no AVX-512 kernel here (AVX512-BF16: {}); testing the widening fallback \
             against the f64 reference",
            cpu_has_avx512bf16()
        );
    }
}

/// How B is laid out in memory for one case.
#[derive(Clone, Copy, Debug)]
enum BLayout {
    /// Row-major, rows `pad` elements longer than needed.
    Rows(usize),
    /// Column-major (B is the transpose of a row-major `n × k` matrix), columns padded.
    Cols(usize),
    /// Both strides > 1: element (r, j) at `r·(2n+1) + 2j`.
    Strided,
}

/// A `rows × cols` view over fresh random data in `layout`.
fn make_b(rng: &mut Lcg, k: usize, n: usize, layout: BLayout) -> (Vec<bf16>, usize, usize) {
    let (rs, cs, len) = match layout {
        BLayout::Rows(pad) => (n + pad, 1, k * (n + pad)),
        BLayout::Cols(pad) => (1, k + pad, n * (k + pad)),
        BLayout::Strided => (2 * n + 1, 2, k * (2 * n + 1)),
    };
    (rng.vec(len.max(1)), rs, cs)
}

/// Checks one case: `dst (+)= A·B` through the packed kernel and the widened path against f64.
fn check(m: usize, k: usize, n: usize, a_pad: usize, layout: BLayout, accumulate: bool, seed: u64) {
    let mut rng = Lcg(seed);
    let lda = k + a_pad;
    let a_data = rng.vec((m * lda).max(1));
    let a = MatRef {
        data: &a_data,
        rows: m,
        cols: k,
        rs: lda,
        cs: 1,
    };
    let (b_data, rs, cs) = make_b(&mut rng, k, n, layout);
    let b = MatRef {
        data: &b_data,
        rows: k,
        cols: n,
        rs,
        cs,
    };
    // The destination has 3 spare columns per row, which must come back untouched.
    let ldc = n + 3;
    let init: Vec<f32> = rng.vec(m * ldc).iter().map(|v| v.to_f32()).collect();
    let mut packed = PackedB::new();
    packed.pack(b).unwrap();
    let mut widened = init.clone();
    gemm_widened(&mut widened, ldc, accumulate, a, b).unwrap();
    for kernel in kernels() {
        let mut got = init.clone();
        gemm_with(kernel, &mut got, ldc, accumulate, a, &packed).unwrap();
        let case =
            format!("{kernel:?}: m{m} k{k} n{n} a_pad{a_pad} {layout:?} accumulate={accumulate}");
        compare(
            &case,
            &got,
            &widened,
            &init,
            (m, k, n, ldc),
            accumulate,
            |i, t| f64::from(a.data[i * lda + t].to_f32()),
            |t, j| f64::from(b.data[t * rs + j * cs].to_f32()),
        );
    }
}

/// Asserts the bounds of the module docs for one kernel's result `got`.
#[allow(clippy::too_many_arguments)]
fn compare(
    case: &str,
    got: &[f32],
    widened: &[f32],
    init: &[f32],
    (m, k, n, ldc): (usize, usize, usize, usize),
    accumulate: bool,
    a: impl Fn(usize, usize) -> f64,
    b: impl Fn(usize, usize) -> f64,
) {
    for i in 0..m {
        for j in 0..ldc {
            let at = i * ldc + j;
            if j >= n {
                assert_eq!(
                    got[at].to_bits(),
                    init[at].to_bits(),
                    "{case}: ({i},{j}) overwritten"
                );
                assert_eq!(
                    widened[at].to_bits(),
                    init[at].to_bits(),
                    "{case}: widened ({i},{j})"
                );
                continue;
            }
            let (mut exact, mut abs) = (0f64, 0f64);
            if accumulate {
                exact = f64::from(init[at]);
                abs = exact.abs();
            }
            for t in 0..k {
                let p = a(i, t) * b(t, j);
                exact += p;
                abs += p.abs();
            }
            let terms = (k + usize::from(accumulate)) as f64;
            let tol = terms * U * abs;
            let (g, w) = (f64::from(got[at]), f64::from(widened[at]));
            assert!(
                (g - exact).abs() <= tol,
                "{case}: kernel ({i},{j}) = {g}, exact {exact}, tolerance {tol}"
            );
            assert!(
                (w - exact).abs() <= tol,
                "{case}: widened ({i},{j}) = {w}, exact {exact}, tolerance {tol}"
            );
            assert!(
                (g - w).abs() <= 2.0 * tol,
                "{case}: kernel {g} vs widened {w} at ({i},{j}), tolerance {}",
                2.0 * tol
            );
        }
    }
}

#[test]
fn kernel_matches_widened_path_on_awkward_shapes() {
    report_kernel();
    let deep = 2 * KC * 2 + 37; // several k blocks and an odd tail
    let shapes = [
        (1, 1, 1),
        (1, 2, 1),
        (2, 1, 2),
        (2, 3, 5),
        (8, 32, 32),
        (9, 33, 33),
        (7, 31, 17),
        (17, 63, 47),
        (16, 64, 64),
        (3, 2 * KC, 40),
        (5, 2 * KC + 1, 16),
        (13, deep, 70),
        (1, 1000, 1),
        (8, 2, 100),
        (32, 288, 96),
    ];
    let mut seed = 1;
    for &(m, k, n) in &shapes {
        for layout in [
            BLayout::Rows(0),
            BLayout::Rows(5),
            BLayout::Cols(0),
            BLayout::Cols(3),
            BLayout::Strided,
        ] {
            for (a_pad, accumulate) in [(0, false), (7, true)] {
                seed += 1;
                check(m, k, n, a_pad, layout, accumulate, seed);
            }
        }
    }
}

#[test]
fn packing_by_rows_or_columns_matches_packing_a_view() {
    // `pack_row_pairs` and `pack_columns` (how the conv feeds im2col rows) and `pack` of the same
    // matrix give the same products, bit for bit. The shapes cover a partial panel, a `k` with a
    // last unpaired row, and `k` pairs in whole and partial blocks of 16 (the in-register
    // transpose of `pack_columns` on full panels, the word-by-word rest).
    for (m, k, n) in [(5, 37, 45), (7, 70, 96), (3, 64, 64), (4, 33, 32)] {
        packing_agrees(m, k, n);
    }
}

fn packing_agrees(m: usize, k: usize, n: usize) {
    let mut rng = Lcg(99 + (k * n) as u64);
    let a_data = rng.vec(m * k);
    let a = MatRef {
        data: &a_data,
        rows: m,
        cols: k,
        rs: k,
        cs: 1,
    };
    let b_data = rng.vec(k * n);
    let mut by_view = PackedB::new();
    by_view
        .pack(MatRef {
            data: &b_data,
            rows: k,
            cols: n,
            rs: n,
            cs: 1,
        })
        .unwrap();
    let mut by_rows = PackedB::new();
    // Reuse a buffer that held a bigger matrix: stale words must not leak in.
    by_rows.pack_row_pairs(k + 10, n + 40, |_, dst| dst.fill(bf16::from_f32(3.0)));
    by_rows.pack_row_pairs(k, n, |r, dst| {
        dst.copy_from_slice(&b_data[r * n..(r + 1) * n])
    });
    assert_eq!((by_rows.k(), by_rows.n()), (k, n));
    let mut by_cols = PackedB::new();
    by_cols.pack_columns(k, n, |j, dst| {
        for (r, d) in dst.iter_mut().enumerate() {
            *d = b_data[r * n + j];
        }
    });
    for kernel in kernels() {
        let mut x = vec![0f32; m * n];
        gemm_with(kernel, &mut x, n, false, a, &by_view).unwrap();
        for other in [&by_rows, &by_cols] {
            let mut y = vec![0f32; m * n];
            gemm_with(kernel, &mut y, n, false, a, other).unwrap();
            assert_eq!(x, y, "{kernel:?}");
        }
    }
}

#[test]
fn empty_dimensions() {
    let data = [bf16::ONE; 4];
    let mut packed = PackedB::new();
    // k = 0: the product is zero (or leaves dst as is when accumulating).
    packed
        .pack(MatRef {
            data: &data,
            rows: 0,
            cols: 2,
            rs: 2,
            cs: 1,
        })
        .unwrap();
    let a = MatRef {
        data: &data,
        rows: 2,
        cols: 0,
        rs: 1,
        cs: 1,
    };
    let mut dst = [5f32; 4];
    gemm(&mut dst, 2, true, a, &packed).unwrap();
    assert_eq!(dst, [5.0; 4]);
    gemm(&mut dst, 2, false, a, &packed).unwrap();
    assert_eq!(dst, [0.0; 4]);
    // m = 0 or n = 0: nothing to write.
    let a0 = MatRef { rows: 0, ..a };
    gemm(&mut [], 2, false, a0, &packed).unwrap();
}

#[test]
fn bad_operands_are_errors_not_panics() {
    let data = vec![bf16::ONE; 64];
    let view = |rows, cols, rs, cs| MatRef {
        data: &data,
        rows,
        cols,
        rs,
        cs,
    };
    let mut packed = PackedB::new();
    packed.pack(view(4, 4, 4, 1)).unwrap();
    let mut dst = vec![0f32; 64];
    // Inner dimensions differ.
    assert!(gemm(&mut dst, 4, false, view(4, 3, 4, 1), &packed).is_err());
    // A without contiguous columns.
    assert!(gemm(&mut dst, 4, false, view(4, 4, 1, 4), &packed).is_err());
    // Views past the end of their data.
    assert!(gemm(&mut dst, 4, false, view(4, 4, 40, 1), &packed).is_err());
    assert!(packed.pack(view(8, 9, 9, 1)).is_err());
    assert!(gemm_widened(&mut dst, 4, false, view(4, 4, 4, 1), view(4, 4, 40, 1)).is_err());
    // Destination too small or with a row stride below n.
    assert!(gemm(&mut dst[..10], 4, false, view(4, 4, 4, 1), &packed).is_err());
    assert!(gemm(&mut dst, 3, false, view(4, 4, 4, 1), &packed).is_err());
}

#[test]
fn prepared_a_reused_over_many_products_matches_gemm_with() {
    // A conv prepares its weight once and multiplies it by every image's packed columns: each
    // product must be the one `gemm_with` gives for the same operands, bit for bit (the same
    // kernel on the same widened A), while other gemms on the thread borrow the widening buffer.
    let mut rng = Lcg(7);
    let (m, k) = (13, 41);
    let a_data = rng.vec(m * k);
    let a = MatRef {
        data: &a_data,
        rows: m,
        cols: k,
        rs: k,
        cs: 1,
    };
    for kernel in kernels() {
        let prepared = PreparedA::with_kernel(kernel, a).unwrap();
        for n in [1, 32, 45] {
            let b_data = rng.vec(k * n);
            let mut b = PackedB::new();
            b.pack(MatRef {
                data: &b_data,
                rows: k,
                cols: n,
                rs: n,
                cs: 1,
            })
            .unwrap();
            // An unrelated gemm in between, on another A (takes the thread's buffer).
            let other = rng.vec(3 * k);
            let mut scratch = vec![0f32; 3 * n];
            let o = MatRef {
                data: &other,
                rows: 3,
                cols: k,
                rs: k,
                cs: 1,
            };
            gemm_with(kernel, &mut scratch, n, false, o, &b).unwrap();
            let (mut want, mut got) = (vec![0f32; m * n], vec![0f32; m * n]);
            gemm_with(kernel, &mut want, n, false, a, &b).unwrap();
            gemm_prepared(&mut got, n, false, &prepared, &b).unwrap();
            assert_eq!(want, got, "{kernel:?}, n = {n}");
        }
        // A B of the wrong height is an error, not a panic.
        let mut b = PackedB::new();
        b.pack_row_pairs(k + 1, 4, |_, dst| dst.fill(bf16::ONE));
        let mut d = vec![0f32; m * 4];
        assert!(gemm_prepared(&mut d, 4, false, &prepared, &b).is_err());
    }
}
