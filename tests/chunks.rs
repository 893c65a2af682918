//! The passes the step runs over chunks of images (`core/src/step/chunks.rs`) against the same
//! step on whole batches: bit-identical for the exact step, the codes' gradients equal up to the
//! order of their sums, in every precision, conv kind, segmentation and chunk size (a chunk of one
//! image, one that leaves a shorter last chunk, the default). With codes and chunks smaller than
//! the batch, a stage that starts its segment runs the streamed three-pass backward. What it saves is measured by
//! `bench/codes_memory.sh` and predicted, to within 0.05%, by the estimate (`tests/estimate_grid.rs`).

mod common;

use candle_core::{DType, Device, Tensor};
use memtrain::config::{ActivationStorage, ConvKind};
use memtrain_core::model::cnn::{Cnn, ModelConfig};
use memtrain_core::options::Segmentation;
use memtrain_core::step::accumulate::GradAccumulator;
use memtrain_core::step::chunks::Chunking;
use memtrain_core::step::tape::{LeanStep, NoObserver};

const BATCH: usize = 12;

/// Loss and gradients of one step of a width-8 net on `BATCH` synthetic images.
fn step(
    conv: ConvKind,
    dtype: DType,
    cuts: u8,
    storage: ActivationStorage,
    chunk: Chunking,
) -> (f64, Vec<Tensor>) {
    let model = Cnn::new(ModelConfig { width: 8, conv }, &Device::Cpu, 3).unwrap();
    let (images, labels) = common::batch(BATCH, 5);
    let x = Tensor::from_vec(images, (BATCH, 3, 32, 32), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(labels, BATCH, &Device::Cpu).unwrap();
    let segments = model.segments(Segmentation::from_cuts(cuts));
    let mut step = LeanStep::new(&model, dtype, segments, storage).with_chunking(chunk);
    let mut acc = GradAccumulator::new(model.vars().len());
    let r = step
        .run(x.clone(), &y, 1.0, &mut acc, &mut NoObserver)
        .unwrap();
    let grads = acc.into_grads().into_iter().map(|g| g.unwrap()).collect();
    (r.loss, grads)
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn chunked_passes_equal_whole_batch_ones() {
    let storages = [
        ActivationStorage::None,
        ActivationStorage::Int8,
        ActivationStorage::Int4,
        ActivationStorage::Int2,
    ];
    // none, stages, blocks, and a segment starting at stage 1's second block (its input held).
    for cuts in [0, 0b01010, 0b11111, 0b00001] {
        for conv in [ConvKind::Standard, ConvKind::Separable] {
            for dtype in [DType::F32, DType::BF16] {
                for storage in storages {
                    let label = format!("{conv:?} {dtype:?} cuts {cuts:05b} {storage:?}");
                    let (loss, whole) = step(conv, dtype, cuts, storage, Chunking::Whole);
                    // Chosen: the whole of this small batch, through the chunked code.
                    for chunk in [Chunking::Images(1), Chunking::Images(5), Chunking::Chosen] {
                        let (l, g) = step(conv, dtype, cuts, storage, chunk);
                        // The forward is the same arithmetic per image either way.
                        assert_eq!(l, loss, "{label} {chunk:?}: loss");
                        for (i, (a, b)) in g.iter().zip(&whole).enumerate() {
                            if storage == ActivationStorage::None {
                                assert_eq!(bits(a), bits(b), "{label} {chunk:?}: gradient {i}");
                                continue;
                            }
                            let d = common::rel_diff(a, b);
                            let tol = match dtype {
                                // The sums in another order.
                                DType::F32 => 1e-5,
                                // And each chunk's weight gradient rounded to bf16 before the sum.
                                _ => 6e-2,
                            };
                            assert!(d <= tol, "{label} {chunk:?}: gradient {i} differs by {d:e}");
                        }
                    }
                }
            }
        }
    }
}
