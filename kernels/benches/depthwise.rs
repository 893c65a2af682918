//! Depthwise 3x3 convolution, forward and forward+backward: memtrain's op against Candle's
//! grouped `conv2d` (groups = C), on the CPU (and on cuda:0 too with `--features cuda`).
//!
//! `cargo bench --bench depthwise`

use std::hint::black_box;
use std::time::Duration;

use candle_core::{Device, Tensor, Var};
use criterion::{criterion_group, criterion_main, Criterion};
use memtrain_kernels::depthwise::depthwise_conv2d;

const N: usize = 32;
const C: usize = 64;
const HW: usize = 32;
const K: usize = 3;
const STRIDE: usize = 1;
const PAD: usize = 1;

type Conv = fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>;

fn ours(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    depthwise_conv2d(x, w, STRIDE, PAD)
}

fn grouped(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    x.conv2d(w, PAD, STRIDE, 1, C)
}

fn bench_device(c: &mut Criterion, device: &Device, label: &str) {
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (N, C, HW, HW), device).unwrap()).unwrap();
    let w = Var::from_tensor(&Tensor::randn(0f32, 0.3, (C, 1, K, K), device).unwrap()).unwrap();
    let convs: [(&str, Conv); 2] = [("ours", ours), ("candle_grouped", grouped)];

    let mut group = c.benchmark_group(format!(
        "depthwise_{label}_n{N}_c{C}_{HW}x{HW}_k{K}/forward"
    ));
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(5));
    for (name, conv) in convs {
        group.bench_function(name, |b| {
            b.iter(|| {
                let y = conv(x.as_tensor(), w.as_tensor()).unwrap();
                device.synchronize().unwrap();
                black_box(y)
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group(format!(
        "depthwise_{label}_n{N}_c{C}_{HW}x{HW}_k{K}/forward_backward"
    ));
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(10));
    for (name, conv) in convs {
        group.bench_function(name, |b| {
            b.iter(|| {
                let y = conv(x.as_tensor(), w.as_tensor()).unwrap();
                // `backward` on the conv output itself seeds it with ones: no loss ops whose
                // cost would be the same for both convolutions and dilute the comparison.
                let grads = y.backward().unwrap();
                device.synchronize().unwrap();
                black_box(grads)
            })
        });
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    bench_device(c, &Device::Cpu, "cpu");
    #[cfg(feature = "cuda")]
    match Device::new_cuda(0) {
        Ok(gpu) => bench_device(c, &gpu, "cuda"),
        Err(e) => eprintln!("skipping the CUDA benchmarks: {e}"),
    }
}

criterion_group! {
    name = depthwise;
    // No plots: the plotters backend needs system fonts and panics without them.
    config = Criterion::default().without_plots();
    targets = benches
}
criterion_main!(depthwise);
