//! The transient scratch of each op as the kernels size it: im2col columns per busy thread,
//! widened half-precision images, weight casts, the weight gradient's chunks and partial sums,
//! the depthwise op's padded planes; and the replay of each conv and depthwise pass with them.

use memtrain_kernels::conv2d_cuda::ConvPass;

use super::sim::*;

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

/// What one pass of a convolution holds on the CPU besides its result, as the op reports it
/// ([`memtrain_kernels::conv2d::cpu_pass_scratch`]).
fn cpu_conv_scratch(
    c: &Ctx,
    nd: &Node,
    k: usize,
    pad: usize,
    pass: ConvPass,
) -> memtrain_kernels::conv2d::PassScratch {
    let (cin, h, w) = nd.inp;
    let x_dims = [c.n as usize, cin, h, w];
    let w_dims = [nd.out.0, cin, k, k];
    let threads = c.device.threads();
    memtrain_kernels::conv2d::cpu_pass_scratch(pass, &x_dims, &w_dims, 1, pad, c.dtype, threads)
        .unwrap_or_default()
}

/// Bytes of the forward pass's scratch of a convolution on `n` images (its output allocated
/// first): per busy thread an im2col column (none for an in-place 1x1 convolution), widened
/// images for half types and gemm's packing, plus the widened weights.
pub(super) fn conv_fwd_scratch(c: &Ctx, nd: &Node, k: usize, pad: usize) -> u64 {
    if !c.device.is_cpu() {
        return cuda_conv_scratch(c, nd, k, pad, ConvPass::Forward);
    }
    cpu_conv_scratch(c, nd, k, pad, ConvPass::Forward).section as u64
}

/// Scratch of the input-gradient pass (its output allocated first), as [`conv_fwd_scratch`].
pub(super) fn conv_dx_scratch(c: &Ctx, nd: &Node, k: usize, pad: usize) -> u64 {
    if !c.device.is_cpu() {
        return cuda_conv_scratch(c, nd, k, pad, ConvPass::InputGrad);
    }
    cpu_conv_scratch(c, nd, k, pad, ConvPass::InputGrad).section as u64
}

/// Scratch of the weight-gradient pass (columns, gathered gradients, widened images, gemm's
/// packing and the partial sums, made before its threads start), and the bytes still held
/// (the running total) when the result is allocated.
pub(super) fn conv_wgrad_scratch(c: &Ctx, nd: &Node, k: usize, pad: usize) -> (u64, u64) {
    if !c.device.is_cpu() {
        return (cuda_conv_scratch(c, nd, k, pad, ConvPass::WeightGrad), 0);
    }
    let s = cpu_conv_scratch(c, nd, k, pad, ConvPass::WeightGrad);
    (s.section as u64, s.tail as u64)
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
