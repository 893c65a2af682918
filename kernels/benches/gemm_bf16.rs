//! The bf16 gemm kernels (`memtrain_kernels::gemm_bf16`) against the widen-to-f32 path, on the
//! per-image gemms of the default net's convolutions (width 32), one thread.
//!
//! First prints a summary table (GFLOP/s, best of `GEMM_BENCH_REPS` runs, default 5, each run
//! timing enough calls for ~50 ms): per kernel, the gemm alone on an already packed `B` and
//! "with pack", which adds packing `B` from a row-major bf16 matrix as the conv does per image;
//! for the widen path, the `gemm` crate on operands already widened to f32, and with the widening
//! of both operands. Then the same cases under criterion (`cargo bench --bench gemm_bf16`).
//! Before them, the roofline: a large product on every thread at once ([`roofline`]).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use half::bf16;
use memtrain_kernels::gemm_bf16::{
    gemm_widened, gemm_with, kernel_supported, Bf16Kernel, MatRef, PackedB,
};

/// (name, m, k, n): `C[m×n] = A[m×k] · B[k×n]` as the conv's passes call it.
const SHAPES: [(&str, usize, usize, usize); 6] = [
    ("fwd 32→32 @32²", 32, 288, 1024),
    ("fwd 128→128 @8²", 128, 1152, 64),
    ("dx 32→32 @32²", 288, 32, 1024),
    ("dx 128→128 @8²", 1152, 128, 64),
    ("dW 32→32 @32²", 32, 1024, 288),
    ("dW 128→128 @8² ×4", 128, 256, 1152),
];

fn values(len: usize, seed: u32) -> Vec<bf16> {
    (0..len)
        .map(|i| {
            bf16::from_f32(
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 20) as f32 / 2048.0
                    - 1.0,
            )
        })
        .collect()
}

struct Case {
    m: usize,
    k: usize,
    n: usize,
    a: Vec<bf16>,
    b: Vec<bf16>,
    packed: PackedB,
    af: Vec<f32>,
    bf: Vec<f32>,
    c: Vec<f32>,
}

impl Case {
    fn new(m: usize, k: usize, n: usize) -> Self {
        let (a, b) = (values(m * k, 1), values(k * n, 2));
        let mut packed = PackedB::new();
        packed.pack(Self::view(&b, k, n)).expect("pack");
        let af = a.iter().map(|v| v.to_f32()).collect();
        let bf = b.iter().map(|v| v.to_f32()).collect();
        Self {
            m,
            k,
            n,
            a,
            b,
            packed,
            af,
            bf,
            c: vec![0.0; m * n],
        }
    }

    fn view(data: &[bf16], rows: usize, cols: usize) -> MatRef<'_> {
        MatRef {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    fn kernel(&mut self, kernel: Bf16Kernel, pack: bool) {
        if pack {
            self.packed
                .pack(Self::view(&self.b, self.k, self.n))
                .expect("pack");
        }
        let a = Self::view(&self.a, self.m, self.k);
        gemm_with(kernel, &mut self.c, self.n, false, a, &self.packed).expect("gemm");
    }

    fn widen(&mut self, widen: bool) {
        if widen {
            let a = Self::view(&self.a, self.m, self.k);
            let b = Self::view(&self.b, self.k, self.n);
            gemm_widened(&mut self.c, self.n, false, a, b).expect("gemm");
            return;
        }
        // SAFETY: `af` is m×k, `bf` k×n and `c` m×n, all row-major and distinct.
        unsafe {
            gemm::gemm(
                self.m,
                self.n,
                self.k,
                self.c.as_mut_ptr(),
                1,
                self.n as isize,
                false,
                self.af.as_ptr(),
                1,
                self.k as isize,
                self.bf.as_ptr(),
                1,
                self.n as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        }
    }

    fn flops(&self) -> f64 {
        2.0 * (self.m * self.k * self.n) as f64
    }
}

/// Best GFLOP/s of `reps` runs of `f`, each run long enough (~50 ms) to time.
fn gflops(case: &mut Case, reps: usize, mut f: impl FnMut(&mut Case)) -> f64 {
    f(case);
    let t = Instant::now();
    f(case);
    let once = t.elapsed().as_secs_f64().max(1e-6);
    let calls = ((0.05 / once) as usize).max(1);
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        for _ in 0..calls {
            f(black_box(&mut *case));
        }
        best = best.min(t.elapsed().as_secs_f64() / calls as f64);
    }
    case.flops() / best / 1e9
}

fn kernels() -> Vec<Bf16Kernel> {
    [Bf16Kernel::Avx512Bf16, Bf16Kernel::Avx512Fma]
        .into_iter()
        .filter(|&k| kernel_supported(k))
        .collect()
}

/// The roofline: one large product (`ROOF`³) per thread on `threads` threads at once, each on
/// its own operands (no sharing, no synchronisation inside), as GFLOP/s of all of them together,
/// best of `reps` runs: what these cores' multiply-add units deliver to a well-blocked gemm.
fn roofline(threads: usize, reps: usize, f: fn(&mut Case)) -> f64 {
    const ROOF: usize = 1024;
    let mut cases: Vec<Case> = (0..threads).map(|_| Case::new(ROOF, ROOF, ROOF)).collect();
    let mut best = f64::INFINITY;
    for _ in 0..reps + 1 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for case in cases.iter_mut() {
                s.spawn(move || f(black_box(case)));
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    threads as f64 * cases[0].flops() / best / 1e9
}

fn main() {
    let reps = std::env::var("GEMM_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("roofline: a 1024×1024×1024 product on each of {threads} threads at once, GFLOP/s (best of {reps} runs)\n");
    println!(
        "| f32 gemm crate |{}",
        kernels()
            .iter()
            .map(|k| format!(" bf16 {k:?} |"))
            .collect::<String>()
    );
    println!("|---:|{}", "---:|".repeat(kernels().len()));
    let mut row = format!("| {:.1} |", roofline(threads, reps, |c| c.widen(false)));
    for kern in kernels() {
        let f: fn(&mut Case) = match kern {
            Bf16Kernel::Avx512Bf16 => |c| c.kernel(Bf16Kernel::Avx512Bf16, false),
            _ => |c| c.kernel(Bf16Kernel::Avx512Fma, false),
        };
        row += &format!(" {:.1} |", roofline(threads, reps, f));
    }
    println!("{row}\n");
    println!("bf16 gemm, one thread, GFLOP/s (best of {reps} runs)\n");
    let mut header = String::from("| gemm | m×k×n |");
    for k in kernels() {
        header += &format!(" {k:?} | {k:?} with pack |");
    }
    header += " f32 gemm crate (pre-widened) | widen + f32 gemm crate |";
    println!("{header}");
    println!("|---|---|{}", "---:|".repeat(2 * kernels().len() + 2));
    for (name, m, k, n) in SHAPES {
        let mut case = Case::new(m, k, n);
        let mut row = format!("| {name} | {m}×{k}×{n} |");
        for kern in kernels() {
            let alone = gflops(&mut case, reps, |c| c.kernel(kern, false));
            let packed = gflops(&mut case, reps, |c| c.kernel(kern, true));
            row += &format!(" {alone:.1} | {packed:.1} |");
        }
        let f32_only = gflops(&mut case, reps, |c| c.widen(false));
        let widen = gflops(&mut case, reps, |c| c.widen(true));
        row += &format!(" {f32_only:.1} | {widen:.1} |");
        println!("{row}");
    }
    println!();

    let mut c = Criterion::default()
        .without_plots()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    for (name, m, k, n) in SHAPES {
        let mut case = Case::new(m, k, n);
        let mut group = c.benchmark_group(format!("gemm_bf16/{name}"));
        for kern in kernels() {
            group.bench_function(format!("{kern:?}/with_pack"), |b| {
                b.iter(|| case.kernel(kern, true))
            });
        }
        group.bench_function("widen_f32_gemm", |b| b.iter(|| case.widen(true)));
        group.finish();
    }
    c.final_summary();
}
