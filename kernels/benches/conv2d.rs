//! The default net's convolutions (batch 128, 3×3, padding 1): our gemm conv2d versus Candle's,
//! forward and forward+backward, on the CPU.
//!
//! First prints a summary table (best wall time of a few runs, the speed ratio, and the peak
//! transient bytes measured with a counting allocator next to the computed im2col sizes), then runs
//! the same cases under criterion. `CONV2D_BENCH_REPS` sets the summary's runs per case (default 5);
//! criterion's usual filter argument selects cases (`cargo bench --bench conv2d -- fwd_bwd`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var};
use criterion::Criterion;
use memtrain_kernels::conv2d::{conv2d, im2col_chunk_bytes};

mod common;
use common::CountingAllocator;

/// A counting allocator (`benches/common`): live heap bytes and their high-water mark, so the
/// summary shows what each version really allocates rather than what it should.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

const BATCH: usize = 128;

/// One convolution of the default net: input channels, output channels, square input size.
#[derive(Clone, Copy)]
struct Layer {
    cin: usize,
    cout: usize,
    hw: usize,
}

impl Layer {
    fn name(&self) -> String {
        format!("{}to{}@{}", self.cin, self.cout, self.hw)
    }

    /// Forward FLOPs (2 per multiply-add) of the 3×3, padding 1 convolution.
    fn fwd_flops(&self) -> f64 {
        2.0 * (BATCH * self.cout * self.cin * 9 * self.hw * self.hw) as f64
    }
}

const LAYERS: [Layer; 6] = [
    Layer {
        cin: 3,
        cout: 32,
        hw: 32,
    },
    Layer {
        cin: 32,
        cout: 32,
        hw: 32,
    },
    Layer {
        cin: 32,
        cout: 64,
        hw: 16,
    },
    Layer {
        cin: 64,
        cout: 64,
        hw: 16,
    },
    Layer {
        cin: 64,
        cout: 128,
        hw: 8,
    },
    Layer {
        cin: 128,
        cout: 128,
        hw: 8,
    },
];

#[derive(Clone, Copy, PartialEq)]
enum Impl {
    Ours,
    Candle,
}

impl Impl {
    fn label(self) -> &'static str {
        match self {
            Impl::Ours => "ours",
            Impl::Candle => "candle",
        }
    }
}

/// Inputs of one layer: the first layer's input is data (no gradient), the others are
/// activations, which need their gradient as in training.
struct Case {
    x: Tensor,
    x_var: Option<Var>,
    w: Var,
}

impl Case {
    fn new(l: Layer, dtype: DType, dev: &Device) -> candle_core::Result<Self> {
        let x = Tensor::randn(0f32, 1.0, (BATCH, l.cin, l.hw, l.hw), dev)?.to_dtype(dtype)?;
        let w = Var::from_tensor(
            &(Tensor::randn(0f32, 1.0, (l.cout, l.cin, 3, 3), dev)?
                * (2.0 / (9 * l.cin) as f64).sqrt())?
            .to_dtype(dtype)?,
        )?;
        let x_var = if l.cin == 3 {
            None
        } else {
            Some(Var::from_tensor(&x)?)
        };
        Ok(Self { x, x_var, w })
    }

    fn input(&self) -> &Tensor {
        self.x_var
            .as_ref()
            .map(|v| v.as_tensor())
            .unwrap_or(&self.x)
    }

    fn forward(&self, imp: Impl) -> candle_core::Result<Tensor> {
        match imp {
            Impl::Ours => conv2d(self.input(), self.w.as_tensor(), 1, 1),
            Impl::Candle => self.input().conv2d(self.w.as_tensor(), 1, 1, 1, 1),
        }
    }

    /// Forward, then backward from `y` itself (Candle seeds it with a contiguous tensor of ones,
    /// as a following layer would hand over a plain gradient), so that nothing but the
    /// convolution runs; returns the gradients to keep them alive until the clock stops.
    fn forward_backward(&self, imp: Impl) -> candle_core::Result<candle_core::backprop::GradStore> {
        self.forward(imp)?.backward()
    }
}

/// The fastest of `reps` runs after a warm-up: on a shared 2-core machine the slower runs measure
/// the neighbours, not the code.
fn time_best(reps: usize, dev: &Device, mut f: impl FnMut()) -> Duration {
    f(); // warm-up: thread pools, first-touch of buffers
    let _ = dev.synchronize();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            let _ = dev.synchronize();
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

/// Bytes allocated above the starting level at the high-water mark while `f` runs, minus
/// `keep` (the bytes of the results `f` returns, which are not transient).
fn peak_extra<R>(f: impl FnOnce() -> R) -> (usize, R) {
    CountingAllocator::reset_peak();
    let base = CountingAllocator::current();
    let r = f();
    ((CountingAllocator::peak().saturating_sub(base)) as usize, r)
}

fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// The four versions every layer is measured in: forward, then forward+backward, ours and
/// Candle's (the column order of the summary tables).
const VERSIONS: [(Impl, bool); 4] = [
    (Impl::Ours, false),
    (Impl::Candle, false),
    (Impl::Ours, true),
    (Impl::Candle, true),
];

/// One layer's row of the memory table: the peak transient bytes of [`VERSIONS`], our op's
/// computed im2col chunk and one full-batch column matrix.
type MemRow = (Layer, [usize; 4], usize, usize);

fn summary(dev: &Device) -> candle_core::Result<()> {
    let reps: usize = std::env::var("CONV2D_BENCH_REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&r| r > 0)
        .unwrap_or(5);
    println!(
        "conv2d, batch {BATCH}, 3x3 pad 1, f32, {} threads; best of {reps} runs",
        candle_core::utils::get_num_threads()
    );
    println!(
        "{:<12} {:>9} {:>9} {:>6} {:>10} {:>10} {:>6} {:>8}",
        "layer", "fwd ours", "candle", "x", "f+b ours", "candle", "x", "GFLOP/s"
    );
    let mut tot = [Duration::ZERO; 4];
    let mut mem_rows = Vec::new();
    for l in LAYERS {
        let case = Case::new(l, DType::F32, dev)?;
        let t = time_layer(&case, l, reps, dev);
        for (sum, t) in tot.iter_mut().zip(t) {
            *sum += t;
        }
        mem_rows.push(memory_row(&case, l));
    }
    println!(
        "{:<12} {:>7.1}ms {:>7.1}ms {:>5.2}x {:>8.1}ms {:>8.1}ms {:>5.2}x",
        "total",
        tot[0].as_secs_f64() * 1e3,
        tot[1].as_secs_f64() * 1e3,
        tot[1].as_secs_f64() / tot[0].as_secs_f64(),
        tot[2].as_secs_f64() * 1e3,
        tot[3].as_secs_f64() * 1e3,
        tot[3].as_secs_f64() / tot[2].as_secs_f64(),
    );
    bf16_totals(dev, reps)?;
    print_memory(mem_rows);
    Ok(())
}

/// Times [`VERSIONS`] on one layer and prints its row of the time table.
fn time_layer(case: &Case, l: Layer, reps: usize, dev: &Device) -> [Duration; 4] {
    let mut t = [Duration::ZERO; 4];
    for (i, (imp, bwd)) in VERSIONS.into_iter().enumerate() {
        t[i] = time_best(reps, dev, || {
            if bwd {
                black_box(case.forward_backward(imp).expect("forward+backward"));
            } else {
                black_box(case.forward(imp).expect("forward"));
            }
        });
    }
    // Forward+backward is three convolutions' worth of multiply-adds: both versions compute the
    // input gradient even for the data layer (Candle's GradStore semantics).
    let passes = 3.0;
    println!(
        "{:<12} {:>7.1}ms {:>7.1}ms {:>5.2}x {:>8.1}ms {:>8.1}ms {:>5.2}x {:>8.1}",
        l.name(),
        t[0].as_secs_f64() * 1e3,
        t[1].as_secs_f64() * 1e3,
        t[1].as_secs_f64() / t[0].as_secs_f64(),
        t[2].as_secs_f64() * 1e3,
        t[3].as_secs_f64() * 1e3,
        t[3].as_secs_f64() / t[2].as_secs_f64(),
        passes * l.fwd_flops() / t[2].as_secs_f64() / 1e9,
    );
    t
}

/// The peak transient bytes of [`VERSIONS`] on one layer, with the computed sizes beside them.
fn memory_row(case: &Case, l: Layer) -> MemRow {
    let out_bytes = BATCH * l.cout * l.hw * l.hw * 4;
    let mut measured = [0usize; 4];
    for (i, (imp, bwd)) in VERSIONS.into_iter().enumerate() {
        measured[i] = if bwd {
            // The output, its seed gradient, both gradients and the gradient store's
            // zeros-then-add copies are in this too, the same for both versions; the
            // difference between the two is the convolutions' own transients.
            peak_extra(|| case.forward_backward(imp).expect("forward+backward")).0
        } else {
            peak_extra(|| case.forward(imp).expect("forward"))
                .0
                .saturating_sub(out_bytes)
        };
    }
    let computed_ours = im2col_chunk_bytes(BATCH, l.cin, 3, l.hw, l.hw, DType::F32);
    let full_batch = BATCH * l.cin * 9 * l.hw * l.hw * 4;
    (l, measured, computed_ours, full_batch)
}

/// Times our op in bf16 over all layers and prints the total row (Candle's CPU conv2d rejects
/// bf16; ours widens to f32 per image, so only ours has a number).
fn bf16_totals(dev: &Device, reps: usize) -> candle_core::Result<()> {
    let (mut bf_fwd, mut bf_fb) = (Duration::ZERO, Duration::ZERO);
    for l in LAYERS {
        let case = Case::new(l, DType::BF16, dev)?;
        bf_fwd += time_best(reps, dev, || {
            black_box(case.forward(Impl::Ours).expect("bf16 forward"));
        });
        bf_fb += time_best(reps, dev, || {
            black_box(
                case.forward_backward(Impl::Ours)
                    .expect("bf16 forward+backward"),
            );
        });
    }
    println!(
        "{:<12} {:>7.1}ms {:>9} {:>6} {:>8.1}ms {:>10}   (bf16: Candle's CPU conv2d rejects it)",
        "total bf16",
        bf_fwd.as_secs_f64() * 1e3,
        "-",
        "",
        bf_fb.as_secs_f64() * 1e3,
        "-",
    );
    Ok(())
}

/// Prints the memory table.
fn print_memory(mem_rows: Vec<MemRow>) {
    println!();
    println!(
        "peak transient memory, MiB (measured with a counting allocator; 'computed' = formula)"
    );
    println!(
        "{:<12} {:>10} {:>10} {:>12} {:>12} {:>12} {:>12}",
        "layer", "fwd ours", "candle", "f+b ours", "candle", "ours comp.", "full im2col"
    );
    for (l, m, ours, full) in mem_rows {
        println!(
            "{:<12} {:>10.2} {:>10.2} {:>12.2} {:>12.2} {:>12.2} {:>12.2}",
            l.name(),
            mib(m[0]),
            mib(m[1]),
            mib(m[2]),
            mib(m[3]),
            mib(ours),
            mib(full)
        );
    }
    println!(
        "(fwd: above the output; f+b: above the inputs, including output, seed and gradients; \
         'ours comp.' = im2col_chunk_bytes; 'full im2col' = one full-batch column matrix)"
    );
    println!();
}

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    summary(&dev)?;

    // No plots: the plotters backend needs system fonts, which headless machines lack.
    let mut c = Criterion::default()
        .without_plots()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    for l in LAYERS {
        let case = Case::new(l, DType::F32, &dev)?;
        let mut group = c.benchmark_group(format!("conv2d/{}", l.name()));
        for imp in [Impl::Ours, Impl::Candle] {
            group.bench_function(format!("fwd/{}", imp.label()), |b| {
                b.iter(|| {
                    let y = case.forward(imp).expect("forward");
                    let _ = dev.synchronize();
                    y
                })
            });
            group.bench_function(format!("fwd_bwd/{}", imp.label()), |b| {
                b.iter(|| {
                    let g = case.forward_backward(imp).expect("forward+backward");
                    let _ = dev.synchronize();
                    g
                })
            });
        }
        group.finish();
    }
    c.final_summary();
    Ok(())
}
