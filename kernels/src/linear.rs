//! The head's matrix products on one thread.
//!
//! Candle's CPU matmul hands products above the gemm crate's threading threshold to the rayon
//! pool, and every rayon thread that ever runs one keeps its own L2-sized packing buffer (1 MiB
//! here). Whether a thread picks up work depends on scheduling, so the heap moved by a few MiB
//! from run to run at small batches, which no estimate can follow. The head's products are small
//! (ten outputs), so on the CPU they run single-threaded on the calling thread; elsewhere (and for
//! other dtypes) this is Candle's matmul.

use super::util::gemm_packing_bytes;
use candle_core::{CpuStorage, DType, Result, Storage, Tensor};

/// Bytes [`matmul`] allocates besides its result on the CPU for `a` [m, k] and `b` [k, n] with
/// strides `(row, column)`: the gemm crate's packed operand
/// ([`crate::util::gemm_packing_bytes`]).
pub fn matmul_scratch_bytes(
    [m, k, n]: [usize; 3],
    a_strides: (usize, usize),
    b_strides: (usize, usize),
) -> usize {
    gemm_packing_bytes([m, n, k], n, a_strides, b_strides, 4)
}

/// `a · b` for 2-D `a` [m, k] and `b` [k, n] of any strides (e.g. a transposed view); no autograd.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (m, k) = a.dims2()?;
    let (k2, n) = b.dims2()?;
    let cpu_f32 = a.device().is_cpu() && a.dtype() == DType::F32 && b.dtype() == DType::F32;
    if !cpu_f32 || k != k2 {
        return a.matmul(b);
    }
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(va)), Storage::Cpu(CpuStorage::F32(vb))) = (&*sa, &*sb)
    else {
        return a.matmul(b);
    };
    let (ra, ca) = (la.stride()[0], la.stride()[1]);
    let (rb, cb) = (lb.stride()[0], lb.stride()[1]);
    // The last element each operand reads must lie inside its storage.
    let end = |off: usize, r: usize, c: usize, rows: usize, cols: usize| {
        off + (rows.max(1) - 1) * r + (cols.max(1) - 1) * c
    };
    if (m > 0 && k > 0 && end(la.start_offset(), ra, ca, m, k) >= va.len())
        || (k > 0 && n > 0 && end(lb.start_offset(), rb, cb, k, n) >= vb.len())
    {
        return a.matmul(b);
    }
    let mut out = vec![0f32; m * n];
    if m > 0 && n > 0 && k > 0 {
        // SAFETY: the operands are read within their storages (checked above) with their own
        // strides; `out` is a fresh m×n row-major buffer nobody else accesses.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                false,
                va.as_ptr().add(la.start_offset()),
                ca as isize,
                ra as isize,
                vb.as_ptr().add(lb.start_offset()),
                cb as isize,
                rb as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    }
    drop((sa, sb));
    Tensor::from_vec(out, (m, n), a.device())
}
