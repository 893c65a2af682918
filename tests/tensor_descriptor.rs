//! What the estimate charges a tensor besides its elements (`src/predict/sizing.rs`): a storage
//! record per buffer and a descriptor per handle, checked against the counting allocator on
//! Candle's CPU tensors. One test function: the allocator's counters are process-wide.

use candle_core::{DType, Device, Tensor};
use memtrain::predict::{tensor_descriptor_bytes, Strides, STORAGE_RECORD_BYTES};
use memtrain_core::memory::CountingAllocator;

#[global_allocator]
static A: CountingAllocator = CountingAllocator;

#[test]
fn a_tensor_costs_its_elements_a_storage_record_and_a_descriptor() {
    let x = Tensor::zeros((4, 8, 16, 16), DType::F32, &Device::Cpu).unwrap();
    let before = CountingAllocator::current();
    let y = x.affine(2.0, 1.0).unwrap();
    let new_tensor = CountingAllocator::current() - before;
    assert_eq!(
        new_tensor,
        4 * 8 * 16 * 16 * 4 + STORAGE_RECORD_BYTES + tensor_descriptor_bytes(4, Strides::Collected),
        "an op's result"
    );
    // Strides collected for a new layout reserve at least four.
    let r1 = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
    let before = CountingAllocator::current();
    let v = r1.affine(2.0, 1.0).unwrap();
    assert_eq!(
        CountingAllocator::current() - before,
        4 * 4 + STORAGE_RECORD_BYTES + tensor_descriptor_bytes(1, Strides::Collected),
        "a rank-1 result"
    );
    let w = candle_core::Var::zeros(4, DType::F32, &Device::Cpu).unwrap();
    let before = CountingAllocator::current();
    let d = w.as_detached_tensor();
    assert_eq!(
        CountingAllocator::current() - before,
        tensor_descriptor_bytes(1, Strides::Copied),
        "a detached parameter copies its layout"
    );
    drop((d, w, v, r1));
    let m = y.reshape((32, 256)).unwrap();
    let before = CountingAllocator::current();
    let t = m.t().unwrap();
    assert_eq!(
        CountingAllocator::current() - before,
        tensor_descriptor_bytes(2, Strides::Copied),
        "a transposed view: a descriptor, no storage"
    );
    let before = CountingAllocator::current();
    let c = t.clone();
    assert_eq!(
        CountingAllocator::current(),
        before,
        "a clone shares the handle"
    );
    drop((c, t, m, y, x));
}
