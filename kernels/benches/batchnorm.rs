//! Training-mode BatchNorm + ReLU, forward + backward: our fused op versus the same computation from
//! plain Candle tensor ops (for f16: cast to f32, normalize, cast back — what mixed precision does
//! without the op), at the default net's shapes [128, 32, 32, 32] and [128, 128, 8, 8], f32 and f16,
//! on the CPU.
//!
//! First prints a summary table (median wall time over a few runs, the speed ratio, and the peak
//! bytes allocated while the forward+backward runs, measured with a counting allocator), then runs
//! the same cases under criterion. `BATCHNORM_BENCH_REPS` sets the summary's runs per case (default
//! 5); criterion's usual filter argument selects cases (`cargo bench --bench batchnorm -- f16`).
//! Built with `--features cuda` and run where a GPU is present, it prints the table for the GPU too.

use std::hint::black_box;
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use criterion::Criterion;
use memtrain_kernels::batchnorm::batch_norm_train;

mod common;
use common::CountingAllocator;

/// A counting allocator (`benches/common`): live heap bytes and their high-water mark, so the
/// summary shows what each version really allocates rather than what it should.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

const EPS: f64 = 1e-5;
const SHAPES: [(usize, usize, usize, usize); 2] = [(128, 32, 32, 32), (128, 128, 8, 8)];

#[derive(Clone, Copy, PartialEq)]
enum Impl {
    Ours,
    Candle,
}

/// One layer's inputs: x is an activation (a `Var`, so its gradient is computed as in training),
/// gamma and beta f32 master weights, and the upstream gradient.
struct Case {
    x: Var,
    gamma: Var,
    beta: Var,
    grad_y: Tensor,
}

impl Case {
    fn new(
        shape: (usize, usize, usize, usize),
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Self> {
        let c = shape.1;
        Ok(Self {
            x: Var::from_tensor(&(Tensor::randn(0f32, 1.0, shape, dev)? + 0.5)?.to_dtype(dtype)?)?,
            gamma: Var::from_tensor(&Tensor::rand(0.5f32, 1.5, c, dev)?)?,
            beta: Var::from_tensor(&Tensor::rand(-0.5f32, 0.5, c, dev)?)?,
            grad_y: Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(dtype)?,
        })
    }

    fn forward(&self, imp: Impl) -> candle_core::Result<Tensor> {
        let (x, gamma, beta) = (
            self.x.as_tensor(),
            self.gamma.as_tensor(),
            self.beta.as_tensor(),
        );
        match imp {
            Impl::Ours => batch_norm_train(x, gamma, beta, EPS, true).map(|(y, _, _)| y),
            Impl::Candle => {
                let (n, c, h, w) = x.dims4()?;
                let m = (n * h * w) as f64;
                let x32 = x.to_dtype(DType::F32)?;
                let mean = (x32.sum_keepdim((0, 2, 3))? / m)?;
                let xc = x32.broadcast_sub(&mean)?;
                let var = (xc.sqr()?.sum_keepdim((0, 2, 3))? / m)?;
                let y = xc
                    .broadcast_div(&(var + EPS)?.sqrt()?)?
                    .broadcast_mul(&gamma.reshape((1, c, 1, 1))?)?
                    .broadcast_add(&beta.reshape((1, c, 1, 1))?)?
                    .relu()?;
                y.to_dtype(x.dtype())
            }
        }
    }

    /// Forward, then backward of `Σ y·g` (so the upstream gradient is `g`, as a following layer
    /// would produce); returns the gradients to keep them alive.
    fn forward_backward(&self, imp: Impl) -> candle_core::Result<GradStore> {
        let y = self.forward(imp)?;
        (y * &self.grad_y)?.sum_all()?.backward()
    }
}

fn time_median(reps: usize, dev: &Device, mut f: impl FnMut()) -> Duration {
    f(); // warm-up: thread pool, first touch of buffers
    let _ = dev.synchronize();
    let mut times: Vec<Duration> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            let _ = dev.synchronize();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

/// Bytes allocated above the starting level at the high-water mark while `f` runs.
fn peak_extra<R>(f: impl FnOnce() -> R) -> (usize, R) {
    CountingAllocator::reset_peak();
    let base = CountingAllocator::current();
    let r = f();
    ((CountingAllocator::peak().saturating_sub(base)) as usize, r)
}

fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn name(shape: (usize, usize, usize, usize), dtype: DType) -> String {
    format!(
        "{}x{}x{}x{}_{:?}",
        shape.0, shape.1, shape.2, shape.3, dtype
    )
    .to_lowercase()
}

fn summary(dev: &Device) -> candle_core::Result<()> {
    let reps: usize = std::env::var("BATCHNORM_BENCH_REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&r| r > 0)
        .unwrap_or(5);
    println!(
        "batch norm + relu on {:?} ({} CPU threads); median of {reps} runs.\n\
         fwd: forward only; f+b: forward, loss Σy·g and backward; loss: that loss and its backward alone \
         (Σx·g), which f+b includes; bn: f+b − loss, the batch norm's own share; peak: host bytes allocated \
         above the inputs during f+b",
        dev.location(),
        candle_core::utils::get_num_threads()
    );
    println!(
        "{:<20} {:>9} {:>9} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6} {:>10} {:>10}",
        "case",
        "fwd ours",
        "candle",
        "x",
        "f+b ours",
        "candle",
        "loss",
        "bn ours",
        "candle",
        "x",
        "peak ours",
        "candle"
    );
    for shape in SHAPES {
        for dtype in [DType::F32, DType::F16] {
            let case = Case::new(shape, dtype, dev)?;
            let mut fwd = [Duration::ZERO; 2];
            let mut fb = [Duration::ZERO; 2];
            let mut peak = [0usize; 2];
            for (i, imp) in [Impl::Ours, Impl::Candle].into_iter().enumerate() {
                fwd[i] = time_median(reps, dev, || {
                    black_box(case.forward(imp).unwrap());
                });
                fb[i] = time_median(reps, dev, || {
                    black_box(case.forward_backward(imp).unwrap());
                });
                peak[i] = peak_extra(|| case.forward_backward(imp).unwrap()).0;
            }
            let loss = time_median(reps, dev, || {
                let l = (case.x.as_tensor() * &case.grad_y)
                    .unwrap()
                    .sum_all()
                    .unwrap();
                black_box(l.backward().unwrap());
            });
            let ms = |d: Duration| format!("{:.2}ms", d.as_secs_f64() * 1e3);
            let ratio =
                |a: Duration, b: Duration| format!("{:.1}x", b.as_secs_f64() / a.as_secs_f64());
            // Host allocations say nothing about GPU memory.
            let peak_str = |b: usize| {
                if dev.is_cpu() {
                    format!("{:.1}MiB", mib(b))
                } else {
                    "-".into()
                }
            };
            // A difference of two medians: on a busy machine it can come out at or below zero,
            // which says only that the batch norm's share drowned in the noise.
            let bn = [fb[0].saturating_sub(loss), fb[1].saturating_sub(loss)];
            let bn_ms = |d: Duration| {
                if d.is_zero() {
                    "noise".to_string()
                } else {
                    ms(d)
                }
            };
            let bn_ratio = if bn[0].is_zero() || bn[1].is_zero() {
                "-".to_string()
            } else {
                ratio(bn[0], bn[1])
            };
            println!(
                "{:<20} {:>9} {:>9} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6} {:>10} {:>10}",
                name(shape, dtype),
                ms(fwd[0]),
                ms(fwd[1]),
                ratio(fwd[0], fwd[1]),
                ms(fb[0]),
                ms(fb[1]),
                ms(loss),
                bn_ms(bn[0]),
                bn_ms(bn[1]),
                bn_ratio,
                peak_str(peak[0]),
                peak_str(peak[1]),
            );
        }
    }
    Ok(())
}

fn main() {
    let dev = Device::Cpu;
    summary(&dev).expect("summary");
    // With the cuda feature, the same table on the GPU (not under criterion: the CPU is the target
    // of this bench, the GPU numbers are for comparison).
    #[cfg(feature = "cuda")]
    match Device::new_cuda(0) {
        Ok(gpu) => summary(&gpu).expect("cuda summary"),
        Err(e) => println!("no CUDA device, GPU table skipped: {e}"),
    }

    // No plots: criterion's plotting backend needs system fonts, which CI images may lack.
    let mut c = Criterion::default()
        .without_plots()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let mut group = c.benchmark_group("batchnorm_fwd_bwd");
    for shape in SHAPES {
        for dtype in [DType::F32, DType::F16] {
            let case = Case::new(shape, dtype, &dev).expect("inputs");
            for (label, imp) in [("ours", Impl::Ours), ("candle", Impl::Candle)] {
                group.bench_function(format!("{}/{label}", name(shape, dtype)), |b| {
                    b.iter(|| {
                        let g = case.forward_backward(imp).unwrap();
                        dev.synchronize().unwrap();
                        black_box(g)
                    })
                });
            }
        }
    }
    group.finish();
    c.final_summary();
}
