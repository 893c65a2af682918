//! The parts of `--cuda-graph`'s captured step that run on any device (the capture itself needs a
//! GPU: tests/gpu_graph.rs): the step that leaves the loss on the device computes exactly what the
//! eager step computes, and writing the BatchNorm running statistics in place gives the same
//! statistics as replacing them while keeping their buffers, whose addresses a graph holds on to.

mod common;

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use memtrain::config::{ActivationStorage, ConvKind, GradCheckpointing, Precision};
use memtrain_core::model::{Cnn, ModelConfig};
use memtrain_core::step::accumulate::GradAccumulator;
use memtrain_core::step::tape::{LeanStep, NoObserver};

/// Address of an f32 CPU tensor's buffer.
fn buffer_address(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => v.as_ptr() as usize,
        _ => panic!("expected an f32 CPU tensor"),
    }
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn the_deferred_in_place_step_equals_the_eager_step() {
    let dev = Device::Cpu;
    let cases = [
        (
            Precision::F32,
            GradCheckpointing::None,
            ConvKind::Standard,
            1,
        ),
        (
            Precision::F32,
            GradCheckpointing::Stages,
            ConvKind::Separable,
            2,
        ),
        (
            Precision::Bf16,
            GradCheckpointing::Blocks,
            ConvKind::Standard,
            2,
        ),
        (
            Precision::F16,
            GradCheckpointing::None,
            ConvKind::Separable,
            1,
        ),
    ];
    for (precision, checkpoint, conv, k) in cases {
        let label = format!("{precision} {checkpoint} {conv} accum {k}");
        let config = ModelConfig { width: 4, conv };
        let eager = Cnn::new(config, &dev, 3).unwrap();
        let graph = Cnn::new(config, &dev, 3).unwrap();
        let before: Vec<usize> = graph
            .named_buffers()
            .iter()
            .map(|(_, t)| buffer_address(t))
            .collect();
        let (images, labels) = common::batch(8 * k, 9);
        let x = Tensor::from_slice(&images, (8 * k, 3, 32, 32), &dev).unwrap();
        let y = Tensor::from_slice(&labels, 8 * k, &dev).unwrap();
        let dtype = precision.compute_dtype();
        let (mut acc_e, mut acc_g) = (
            GradAccumulator::new(eager.vars().len()),
            GradAccumulator::new(graph.vars().len()),
        );
        for i in 0..k {
            let (xi, yi) = (
                x.narrow(0, i * 8, 8).unwrap(),
                y.narrow(0, i * 8, 8).unwrap(),
            );
            let mult = 1024.0 / k as f64;
            let e = LeanStep::new(
                &eager,
                dtype,
                eager.segments(checkpoint.resolved().unwrap()),
                ActivationStorage::None,
            )
            .run(xi.clone(), &yi, mult, &mut acc_e, &mut NoObserver)
            .unwrap();
            let mut captured = LeanStep::new(
                &graph,
                dtype,
                graph.segments(checkpoint.resolved().unwrap()),
                ActivationStorage::None,
            )
            .with_stats_in_place();
            let (g, tape) = captured
                .forward(xi.clone(), &yi, mult, &acc_g, &mut NoObserver)
                .unwrap();
            captured
                .backward(tape, &mut acc_g, &mut NoObserver)
                .unwrap();
            assert_eq!(
                g.loss.to_scalar::<f32>().unwrap() as f64,
                e.loss,
                "{label}: loss"
            );
            assert_eq!(
                g.correct.to_scalar::<u32>().unwrap() as usize,
                e.correct,
                "{label}: correct"
            );
        }
        for (i, (a, b)) in acc_g
            .into_grads()
            .iter()
            .zip(acc_e.into_grads().iter())
            .enumerate()
        {
            assert_eq!(
                flat(a.as_ref().unwrap()),
                flat(b.as_ref().unwrap()),
                "{label}: gradient {i}"
            );
        }
        let (bg, be) = (graph.named_buffers(), eager.named_buffers());
        for (((name, a), (_, b)), addr) in bg.iter().zip(&be).zip(&before) {
            assert_eq!(flat(a), flat(b), "{label}: {name}");
            assert_eq!(buffer_address(a), *addr, "{label}: {name} was replaced");
        }
        // The statistics did move (so the comparison above means something).
        let fresh = Cnn::new(ModelConfig { width: 4, conv }, &dev, 3).unwrap();
        assert_ne!(flat(&bg[0].1), flat(&fresh.named_buffers()[0].1), "{label}");
    }
}
