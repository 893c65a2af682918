//! The transient scratch of each op as the kernels size it: im2col columns per busy thread,
//! widened half-precision images, the weight gradient's chunks and partial sums, the depthwise
//! op's padded planes.

use memtrain_kernels::conv2d_cuda::ConvPass;

use super::sim::*;

/// Scratch of one pass of the CUDA conv2d op, as the op sizes it: one chunk of columns where the
/// im2col op runs the pass (see `memtrain_kernels::conv2d_cuda`), none where cuDNN does (its
/// workspace is in `runtime_bytes`); `memtrain_kernels::conv2d_cudnn::cuda_pass_scratch_bytes`
/// asks the op's own cuDNN plan which.
pub(super) fn cuda_conv_scratch(
    c: &Ctx,
    nd: &Node,
    n: usize,
    k: usize,
    pad: usize,
    pass: ConvPass,
) -> u64 {
    let (cin, h, w) = nd.inp;
    memtrain_kernels::conv2d_cudnn::cuda_pass_scratch_bytes(
        pass,
        &[n, cin, h, w],
        &[nd.out.0, cin, k, k],
        1,
        pad,
        c.dtype,
    )
}

/// What one pass of a convolution on `n` images holds on the CPU besides its result, as the op
/// reports it ([`memtrain_kernels::conv2d::cpu_pass_scratch`]).
fn cpu_conv_scratch(
    c: &Ctx,
    nd: &Node,
    n: usize,
    k: usize,
    pad: usize,
    pass: ConvPass,
) -> memtrain_kernels::conv2d::PassScratch {
    let (cin, h, w) = nd.inp;
    let x_dims = [n, cin, h, w];
    let w_dims = [nd.out.0, cin, k, k];
    let threads = c.device.threads();
    memtrain_kernels::conv2d::cpu_pass_scratch(pass, &x_dims, &w_dims, 1, pad, c.dtype, threads)
        .unwrap_or_default()
}

/// Bytes of the forward pass's scratch of a convolution on `n` images (its output allocated
/// first): per busy thread an im2col column (none for an in-place 1x1 convolution), widened
/// images for half types and gemm's packing, plus the widened weights.
pub(super) fn conv_fwd_scratch(c: &Ctx, nd: &Node, n: usize, k: usize, pad: usize) -> u64 {
    if !c.device.is_cpu() {
        return cuda_conv_scratch(c, nd, n, k, pad, ConvPass::Forward);
    }
    cpu_conv_scratch(c, nd, n, k, pad, ConvPass::Forward).section as u64
}

/// Scratch of the input-gradient pass (its output allocated first), as [`conv_fwd_scratch`].
pub(super) fn conv_dx_scratch(c: &Ctx, nd: &Node, n: usize, k: usize, pad: usize) -> u64 {
    if !c.device.is_cpu() {
        return cuda_conv_scratch(c, nd, n, k, pad, ConvPass::InputGrad);
    }
    cpu_conv_scratch(c, nd, n, k, pad, ConvPass::InputGrad).section as u64
}

/// Scratch of the weight-gradient pass (columns, gathered gradients, widened images, gemm's
/// packing and the partial sums, made before its threads start), and the bytes still held
/// (the running total) when the result is allocated.
pub(super) fn conv_wgrad_scratch(c: &Ctx, nd: &Node, n: usize, k: usize, pad: usize) -> (u64, u64) {
    if !c.device.is_cpu() {
        return (cuda_conv_scratch(c, nd, n, k, pad, ConvPass::WeightGrad), 0);
    }
    let s = cpu_conv_scratch(c, nd, n, k, pad, ConvPass::WeightGrad);
    (s.section as u64, s.tail as u64)
}

/// The transient scratch of a node's forward (the conv op's columns and widened images, the
/// depthwise op's padded planes, BatchNorm's per-plane partial sums).
pub(super) fn fwd_scratch(c: &Ctx, nd: &Node) -> u64 {
    match nd.kind {
        LayerKind::Conv { k, pad } => conv_fwd_scratch(c, nd, c.n as usize, k, pad),
        LayerKind::Depthwise => {
            let (ch, h, w) = nd.inp;
            (ch * 9 * 4) as u64 + c.busy(c.n * ch as u64) * (((h + 2) * (w + 2) + w) * 4) as u64
        }
        _ => 0,
    }
}

/// Scratch of the depthwise backward passes: per busy thread one padded plane and one plane.
pub(super) fn depthwise_plane_scratch(c: &Ctx, nd: &Node) -> u64 {
    let (ch, h, w) = nd.inp;
    c.busy(c.n * ch as u64) * (((h + 2) * (w + 2) + h * w) * 4) as u64
}
