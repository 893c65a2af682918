//! The transient scratch of each op as the kernels size it: im2col columns per busy thread,
//! widened half-precision images, weight casts, the weight gradient's chunks and partial sums,
//! the depthwise op's padded planes; and the replay of each conv and depthwise pass with them.

use memtrain_kernels::conv2d_cuda::ConvPass;

use super::sim::*;

/// Per-image im2col column of a convolution (one per busy thread), as the op sizes it.
pub(super) fn one_column(c: &Ctx, nd: &Node, k: usize) -> u64 {
    let (cin, _, _) = nd.inp;
    let (_, ho, wo) = nd.out;
    memtrain_kernels::conv2d::im2col_chunk_bytes(1, cin, k, ho, wo, c.dtype) as u64
}

/// Whether a 1x1 convolution multiplies the image in place: rows that need no padding (a padded
/// column is larger than the image itself).
pub(super) fn pointwise_in_place(c: &Ctx, nd: &Node, k: usize, pad: usize) -> bool {
    let (cin, h, w) = nd.inp;
    k == 1 && pad == 0 && one_column(c, nd, k) == (cin * h * w * 4) as u64
}

/// Scratch of one pass of the CUDA conv2d op: one chunk of columns for the im2col op (see
/// `memtrain_kernels::conv2d_cuda`), none for cuDNN (its workspace is in `runtime_bytes`).
pub(super) fn cuda_conv_scratch(c: &Ctx, nd: &Node, k: usize, pad: usize, pass: ConvPass) -> u64 {
    let (cin, h, w) = nd.inp;
    let (cout, ho, wo) = nd.out;
    let pointwise = k == 1 && pad == 0 && (h, w) == (ho, wo);
    memtrain_kernels::conv2d_cudnn::cuda_pass_scratch_bytes(
        pass,
        c.n as usize,
        cin,
        cout,
        k,
        ho,
        wo,
        pointwise,
        c.dtype,
    )
}

/// Bytes of the forward pass's scratch of a convolution on `n` images: one im2col column per busy
/// thread (none for an in-place 1x1 convolution) and, for half types, one widened input and one
/// widened output image per thread; plus the widened weights.
pub(super) fn conv_fwd_scratch(c: &Ctx, nd: &Node, k: usize, pad: usize) -> u64 {
    let (cin, h, w) = nd.inp;
    let (cout, ho, wo) = nd.out;
    if !c.device.is_cpu() {
        return cuda_conv_scratch(c, nd, k, pad, ConvPass::Forward);
    }
    let col = if pointwise_in_place(c, nd, k, pad) {
        0
    } else {
        one_column(c, nd, k)
    };
    let widen = if c.half() {
        ((cin * h * w) + (cout * ho * wo)) as u64 * 4
    } else {
        0
    };
    let wbuf = if c.half() {
        (cout * cin * k * k) as u64 * 4
    } else {
        0
    };
    c.busy(c.n) * (col + widen) + wbuf
}

/// Scratch of the input-gradient pass: per busy thread one column (none for 1x1) and, for half
/// types, the widened output gradient and input images; plus the widened weights.
pub(super) fn conv_dx_scratch(c: &Ctx, nd: &Node, k: usize, pad: usize) -> u64 {
    let (cin, h, w) = nd.inp;
    let (cout, ho, wo) = nd.out;
    if !c.device.is_cpu() {
        return cuda_conv_scratch(c, nd, k, pad, ConvPass::InputGrad);
    }
    let col = if k == 1 && pad == 0 {
        0
    } else {
        one_column(c, nd, k)
    };
    let widen = if c.half() {
        ((cin * h * w) + (cout * ho * wo)) as u64 * 4
    } else {
        0
    };
    let wbuf = if c.half() {
        (cout * cin * k * k) as u64 * 4
    } else {
        0
    };
    c.busy(c.n) * (col + widen) + wbuf
}

/// Images per weight-gradient chunk, as `images_per_chunk` in `kernels/src/conv2d_cpu.rs`.
pub(super) fn wgrad_chunk(n: usize, hw_out: usize, per_image: usize, threads: usize) -> usize {
    use memtrain_kernels::conv2d::{IM2COL_CHUNK_BYTES, MIN_GEMM_DEPTH};
    let n = n.max(1);
    let threads = threads.max(1);
    let wanted = MIN_GEMM_DEPTH.div_ceil(hw_out.max(1));
    let by_budget = IM2COL_CHUNK_BYTES / threads / per_image.max(1);
    wanted.min(by_budget).min(n.div_ceil(threads)).max(1)
}

/// Weight-gradient slots per thread (`MIN_SLOTS_PER_THREAD` in `kernels/src/conv2d_cpu.rs`).
pub(super) const WGRAD_SLOTS_PER_THREAD: usize = 4;

/// Peak scratch of the weight-gradient pass (columns, gathered gradients, widened images and the
/// partial sums) and the partial-sum buffers still alive when the result is allocated.
///
/// The batch is cut into chunks of images and the chunks into slots; each busy thread sums its
/// slot into a weight-sized f32 buffer, and the slots are added in order into a running total
/// whose spent buffers are reused: about one buffer per thread plus the total.
pub(super) fn conv_wgrad_scratch(c: &Ctx, nd: &Node, k: usize, pad: usize) -> (u64, u64) {
    let (cin, h, w) = nd.inp;
    let (cout, ho, wo) = nd.out;
    let ckk = cin * k * k;
    if !c.device.is_cpu() {
        return (cuda_conv_scratch(c, nd, k, pad, ConvPass::WeightGrad), 0);
    }
    let n = c.n as usize;
    let threads = c.device.threads();
    let hwo = ho * wo;
    let chunk = wgrad_chunk(n, hwo, ckk * hwo * 4, threads);
    let n_chunks = n.div_ceil(chunk);
    let per_slot = n_chunks.div_ceil(WGRAD_SLOTS_PER_THREAD * threads).max(1);
    let slots = n_chunks.div_ceil(per_slot);
    let busy = if slots <= 1 { 1 } else { threads.min(slots) } as u64;
    let in_place = !c.half() && chunk == 1 && pointwise_in_place(c, nd, k, pad);
    let cols = if in_place {
        0
    } else {
        memtrain_kernels::conv2d::im2col_chunk_bytes(n, cin, k, ho, wo, c.dtype) as u64
    };
    let gathered = if !c.half() && chunk == 1 {
        0
    } else {
        (cout * chunk * hwo * 4) as u64
    };
    let widened = if c.half() {
        (cin * h * w * 4) as u64
    } else {
        0
    };
    let acc = (ckk * cout * 4) as u64;
    let buffers = slots.min(threads + 1) as u64;
    (
        cols + busy * (gathered + widened) + buffers * acc,
        buffers * acc,
    )
}

/// The transient scratch of a node's forward (the conv op's columns and widened images, the
/// depthwise op's padded planes, BatchNorm's per-plane partial sums).
pub(super) fn fwd_scratch(c: &Ctx, nd: &Node) -> u64 {
    match nd.op {
        Op::Conv { k, pad } => conv_fwd_scratch(c, nd, k, pad),
        Op::Depthwise => {
            let (ch, h, w) = nd.inp;
            (ch * 9 * 4) as u64 + c.busy(c.n * ch as u64) * (((h + 2) * (w + 2) + w) * 4) as u64
        }
        _ => 0,
    }
}

/// The conv weight cast to the compute dtype (a copy only for half types).
pub(super) fn weight_cast(c: &Ctx, nd: &Node) -> u64 {
    if c.half() {
        nd.params as u64 * c.s
    } else {
        0
    }
}

/// One conv-like node's forward on an input that stays alive: leaves its output alive.
pub(super) fn conv_node_fwd(sim: &mut Sim, c: &Ctx, i: usize, nd: &Node) {
    let start = sim.mark();
    let cast = weight_cast(c, nd);
    sim.alloc(cast);
    sim.alloc(nd.out_bytes(c));
    sim.spike(fwd_scratch(c, nd));
    sim.free(cast);
    sim.record(i, start);
}

/// The f32 weight gradient of a node from one in the compute dtype, into the accumulator: the
/// first micro-batch keeps the buffer, later ones add it in place and drop it.
pub(super) fn weight_grad(sim: &mut Sim, c: &Ctx, nd: &Node, acc_live: bool) {
    let wgrad = nd.params as u64 * c.s;
    if c.half() {
        sim.alloc(nd.params as u64 * 4);
        sim.free(wgrad);
    }
    if acc_live {
        sim.free(nd.params as u64 * 4);
    }
}

/// Weight gradient of a dense/pointwise conv node (input and output gradient alive).
pub(super) fn conv_wgrad(sim: &mut Sim, c: &Ctx, i: usize, nd: &Node, acc_live: bool) {
    let Op::Conv { k, pad } = nd.op else { return };
    let start = sim.mark();
    let cast = weight_cast(c, nd);
    sim.alloc(cast);
    let (scratch, partials) = conv_wgrad_scratch(c, nd, k, pad);
    sim.spike(scratch);
    sim.alloc(partials);
    sim.alloc(nd.params as u64 * c.s);
    sim.free(partials);
    weight_grad(sim, c, nd, acc_live);
    sim.free(cast);
    sim.record(i, start);
}

/// Input gradient of a dense/pointwise conv node: leaves it alive.
pub(super) fn conv_dgrad(sim: &mut Sim, c: &Ctx, i: usize, nd: &Node) {
    let Op::Conv { k, pad } = nd.op else { return };
    let start = sim.mark();
    let cast = weight_cast(c, nd);
    sim.alloc(cast);
    sim.alloc(nd.in_bytes(c));
    sim.spike(conv_dx_scratch(c, nd, k, pad));
    sim.free(cast);
    sim.record(i, start);
}

/// Scratch of the depthwise backward passes: per busy thread one padded plane and one plane.
pub(super) fn depthwise_plane_scratch(c: &Ctx, nd: &Node) -> u64 {
    let (ch, h, w) = nd.inp;
    c.busy(c.n * ch as u64) * (((h + 2) * (w + 2) + h * w) * 4) as u64
}

/// Depthwise weight gradient (input and output gradient alive).
pub(super) fn depthwise_wgrad(sim: &mut Sim, c: &Ctx, i: usize, nd: &Node, acc_live: bool) {
    let start = sim.mark();
    let cast = weight_cast(c, nd);
    sim.alloc(cast);
    let (ch, _, _) = nd.inp;
    let partial = c.n * (ch * 9 * 4) as u64;
    sim.alloc(partial);
    sim.spike(depthwise_plane_scratch(c, nd));
    sim.alloc(nd.params as u64 * c.s);
    sim.free(partial);
    weight_grad(sim, c, nd, acc_live);
    sim.free(cast);
    sim.record(i, start);
}

/// Depthwise input gradient: leaves it alive.
pub(super) fn depthwise_dgrad(sim: &mut Sim, c: &Ctx, i: usize, nd: &Node) {
    let start = sim.mark();
    let cast = weight_cast(c, nd);
    sim.alloc(cast);
    sim.alloc(nd.in_bytes(c));
    sim.spike(depthwise_plane_scratch(c, nd));
    sim.free(cast);
    sim.record(i, start);
}
