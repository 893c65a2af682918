//! The step's own tape ([`memtrain_core::step::tape`]) run on sizes: every tensor is a shape and a byte
//! count, every op allocates its result and spikes its scratch as the kernel sizes it
//! ([`super::scratch`]), and a buffer is freed when the tape drops its last handle. The estimate
//! so follows the step's order of work by running it, not by a copy of it.

use super::scratch::*;
use super::sim::*;
use crate::config::ActivationStorage;
use crate::data::IMAGE_BYTES;
use candle_core::DType;
use memtrain_core::error::Result;
use memtrain_core::step::micro::MicroResult;
use memtrain_core::step::ops::{ConvWeights, Head, StepOps};
use memtrain_core::step::tape::LeanStep;
use memtrain_kernels::batchnorm as bn;
use memtrain_kernels::quantize::Width;
use std::rc::Rc;

/// How a tensor's strides were made, which decides their vector's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strides {
    /// Computed for a new contiguous layout (an op's result, a reshape): Candle collects them
    /// from an iterator, which reserves at least four.
    Collected,
    /// Copied from another layout (a detached or transposed handle): exactly one per dim.
    Copied,
}

/// Heap bytes of a Candle CPU tensor's descriptor of rank `rank` besides the buffer it points to:
/// its `Tensor_` (152), its shape's dims and its strides. Each handle that is not a clone has one:
/// an op's result, a view, a detached parameter. Checked against the counting allocator by
/// `tests/tensor_descriptor.rs`.
pub fn tensor_descriptor_bytes(rank: usize, strides: Strides) -> u64 {
    let stride_capacity = match strides {
        Strides::Collected if rank > 0 => rank.max(4),
        _ => rank,
    };
    152 + (std::mem::size_of::<usize>() * (rank + stride_capacity)) as u64
}

/// Heap a CPU step holds beyond what the estimate sizes one by one, which the estimate adds whole
/// ([`super::estimate::HeldBytes::unsized_bytes`]) so that it is never below the measured peak:
/// a few of Candle's per-op records in the head's loss and of the trainer's records per
/// micro-batch, and with `--prefetch` the batcher's thread and channel. `tests/estimate_grid.rs`
/// measures at most 44 B of them at the step peak over its grid (batch 1 to 512, every
/// optimization), and holds every configuration to at least the measured peak.
pub const HOST_BOOKKEEPING_BYTES: u64 = 512;

/// Heap bytes of a buffer's storage record (the shared, locked `CpuStorage`) besides its elements.
pub const STORAGE_RECORD_BYTES: u64 = 56;

/// A buffer: its bytes are in use until its last handle goes.
struct Buf {
    bytes: u64,
    /// None for a buffer held outside the step (a parameter), which the step never frees.
    sim: Option<Shared>,
}

impl Drop for Buf {
    fn drop(&mut self) {
        if let Some(sim) = &self.sim {
            sim.borrow_mut().free(self.bytes);
        }
    }
}

/// A tensor handle (Candle's `Tensor_`): its descriptor's bytes, and the buffer it points to.
struct Handle {
    bytes: u64,
    /// Whether descriptors are in the measured memory (the CPU heap; not a CUDA pool).
    host: bool,
    sim: Shared,
    /// Held for its `Drop`, which frees the buffer with its last handle.
    #[allow(dead_code)]
    buf: Rc<Buf>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.sim.borrow_mut().free(self.bytes);
    }
}

/// A tensor as far as memory goes: shape, dtype, whether it is a transposed 2-D view (for the
/// matrix products' packing), the node it is a parameter of, and its handle. Cloning shares the
/// handle, as cloning a Candle tensor does.
#[derive(Clone)]
pub(super) struct Sz {
    dims: Vec<usize>,
    dtype: DType,
    transposed: bool,
    node: Option<usize>,
    handle: Rc<Handle>,
}

fn count(dims: &[usize]) -> u64 {
    dims.iter().product::<usize>() as u64
}

impl Sz {
    fn bytes(&self) -> u64 {
        count(&self.dims) * elem_bytes(self.dtype)
    }

    /// A new handle on the same buffer (a view), shaped `dims`.
    fn view(&self, dims: Vec<usize>, strides: Strides) -> Sz {
        let h = &self.handle;
        let bytes = if h.host {
            tensor_descriptor_bytes(dims.len(), strides)
        } else {
            0
        };
        h.sim.borrow_mut().alloc(bytes);
        Sz {
            handle: Rc::new(Handle {
                bytes,
                host: h.host,
                sim: h.sim.clone(),
                buf: h.buf.clone(),
            }),
            dims,
            transposed: false,
            ..self.clone()
        }
    }

    /// (row, column) strides of a 2-D tensor.
    fn strides(&self) -> (usize, usize) {
        if self.transposed {
            (1, self.dims[0])
        } else {
            (self.dims[1], 1)
        }
    }
}

/// A block's BatchNorm for the sizing: its detached γ and β, its `[2, C]` statistics and its
/// node.
#[derive(Clone)]
pub(super) struct SzBn {
    _held: [Sz; 3],
    node: usize,
    /// The forward's decisions, with codes.
    decisions: Option<Sz>,
}

/// A conv output's codes: the packed codes and the ranges, each sized by their [`Width`].
pub(super) struct SzCodes {
    codes: Sz,
    ranges: Sz,
    width: Width,
    /// The activation's shape and dtype, which the decoding has.
    dims: Vec<usize>,
    dtype: DType,
}

/// The ops of the step on sizes, for the micro-batch context `c` and the model's `nodes`.
pub(super) struct Sizing<'a> {
    sim: Shared,
    c: &'a Ctx,
    nodes: &'a [Node],
    blocks: Vec<BlockNodes>,
    /// The parameters in the model's order: each one's node and shape.
    params: Vec<(usize, Vec<usize>)>,
}

impl<'a> Sizing<'a> {
    pub(super) fn new(sim: Shared, c: &'a Ctx, nodes: &'a [Node]) -> Self {
        Sizing {
            sim,
            c,
            nodes,
            blocks: blocks_of(nodes),
            params: (nodes.iter().enumerate())
                .flat_map(|(i, n)| n.param_shapes().into_iter().map(move |d| (i, d)))
                .collect(),
        }
    }

    /// A new tensor, its elements, storage record and descriptor now in use.
    fn alloc(&self, dims: Vec<usize>, dtype: DType) -> Sz {
        let record = if self.cuda() { 0 } else { STORAGE_RECORD_BYTES };
        let bytes = count(&dims) * elem_bytes(dtype) + record;
        self.sim.borrow_mut().alloc(bytes);
        let buf = Rc::new(Buf {
            bytes,
            sim: Some(self.sim.clone()),
        });
        self.handle(dims, dtype, buf, Strides::Collected)
    }

    /// A handle of `dims` on `buf`, its descriptor now in use.
    fn handle(&self, dims: Vec<usize>, dtype: DType, buf: Rc<Buf>, strides: Strides) -> Sz {
        let host = !self.cuda();
        let bytes = if host {
            tensor_descriptor_bytes(dims.len(), strides)
        } else {
            0
        };
        self.sim.borrow_mut().alloc(bytes);
        Sz {
            dims,
            dtype,
            transposed: false,
            node: None,
            handle: Rc::new(Handle {
                bytes,
                host,
                sim: self.sim.clone(),
                buf,
            }),
        }
    }

    /// A parameter of node `node`, detached: a new handle on a buffer the model holds.
    fn held(&self, dims: Vec<usize>, dtype: DType, node: usize) -> Sz {
        let buf = Rc::new(Buf {
            bytes: 0,
            sim: None,
        });
        Sz {
            node: Some(node),
            ..self.handle(dims, dtype, buf, Strides::Copied)
        }
    }

    fn spike(&self, bytes: u64) {
        self.sim.borrow_mut().spike(bytes);
    }

    /// Run `f` as one op of `node`, recording its transient bytes for the layer table.
    fn op<R>(&self, node: Option<usize>, f: impl FnOnce() -> R) -> R {
        let start = self.sim.borrow_mut().mark();
        let r = f();
        if let Some(i) = node {
            self.sim.borrow_mut().record(i, start);
        }
        r
    }

    fn head(&self) -> usize {
        self.nodes.len() - 1
    }

    /// A weight in the compute dtype: the parameter itself (detached) in f32, a cast copy of it
    /// otherwise.
    fn weight(&self, node: usize) -> Sz {
        let dims = self.nodes[node].param_shapes().swap_remove(0);
        let detached = self.held(dims.clone(), DType::F32, node);
        let w = if self.c.half() {
            self.alloc(dims, self.c.dtype)
        } else {
            detached
        };
        Sz {
            node: Some(node),
            ..w
        }
    }

    /// BatchNorm `node`'s γ and β, detached.
    fn bn_affine(&self, node: usize) -> [Sz; 2] {
        let ch = self.nodes[node].out.0;
        [0; 2].map(|_| self.held(vec![ch], DType::F32, node))
    }

    fn node(&self, w: &Sz) -> usize {
        w.node.expect("weights carry their node")
    }

    /// The `[2, C]` per-channel sums of a BatchNorm pass over `h`: the statistics of the forward
    /// or the gradient sums of the backward (`pass`). On the CPU what the pass holds besides
    /// them is its own ([`bn::cpu_host_bytes`]); the CUDA kernels' per-plane partials come first.
    fn channel_sums(&self, h: &Sz, pass: bn::CpuPass) -> Sz {
        let (n, ch) = (h.dims[0] as u64, h.dims[1]);
        if self.cuda() {
            self.spike(n * ch as u64 * 16);
            return self.alloc(vec![2, ch], DType::F32);
        }
        let sums = self.alloc(vec![2, ch], DType::F32);
        self.bn_host(pass, h);
        sums
    }

    /// What a CPU BatchNorm `pass` over `h` holds besides its tensors, while its output exists
    /// (nothing on CUDA).
    fn bn_host(&self, pass: bn::CpuPass, h: &Sz) {
        if !self.cuda() {
            let dims = [h.dims[0], h.dims[1], h.dims[2], h.dims[3]];
            let threads = self.c.device.threads();
            self.spike(bn::cpu_host_bytes(pass, dims, h.dtype, threads));
        }
    }

    fn cuda(&self) -> bool {
        !self.c.device.is_cpu()
    }

    /// `(dγ, dβ)`: the two rows of BatchNorm's `[2, C]` backward sums, each a `[C]` view (Candle's
    /// `get`).
    fn sum_rows_pair(&self, sums: &Sz) -> (Sz, Sz) {
        let ch = sums.dims[1];
        let row = || sums.view(vec![ch], Strides::Collected);
        (row(), row())
    }
}

impl StepOps for Sizing<'_> {
    type T = Sz;
    type Bn = SzBn;
    type Codes = SzCodes;
    type Grads = Vec<Option<Sz>>;

    fn dtype(&self) -> DType {
        self.c.dtype
    }
    fn blocks(&self) -> usize {
        self.blocks.len()
    }
    fn block_name(&self, j: usize) -> &str {
        &self.blocks[j].name
    }
    fn block_pools(&self, j: usize) -> bool {
        self.blocks[j].pool.is_some()
    }
    fn conv_params(&self, j: usize) -> usize {
        self.blocks[j].convs.len()
    }

    fn in_chunks(&self) -> bool {
        !self.cuda()
    }

    fn dims(&self, t: &Sz) -> Vec<usize> {
        t.dims.clone()
    }
    fn bytes(&self, t: &Sz) -> u64 {
        t.bytes()
    }
    fn to_dtype(&self, t: &Sz, dtype: DType) -> Result<Sz> {
        Ok(if t.dtype == dtype {
            t.clone()
        } else {
            self.alloc(t.dims.clone(), dtype)
        })
    }
    fn flatten(&self, t: &Sz) -> Result<Sz> {
        Ok(t.view(
            vec![t.dims[0], count(&t.dims[1..]) as usize],
            Strides::Collected,
        ))
    }
    fn reshape(&self, t: &Sz, dims: &[usize]) -> Result<Sz> {
        Ok(t.view(dims.to_vec(), Strides::Collected))
    }
    fn narrow(&self, t: &Sz, first: usize, len: usize) -> Result<Sz> {
        // Candle shares the tensor itself for the whole of it; else a view whose layout copies
        // the dims and the strides.
        if first == 0 && len == t.dims[0] {
            return Ok(t.clone());
        }
        let mut dims = t.dims.clone();
        dims[0] = len;
        Ok(t.view(dims, Strides::Copied))
    }
    fn zeros(&self, dims: &[usize], dtype: DType) -> Result<Sz> {
        Ok(self.alloc(dims.to_vec(), dtype))
    }
    fn write_images(&self, _dst: &Sz, _first: usize, _src: &Sz) -> Result<()> {
        Ok(())
    }

    fn conv_weights(&self, j: usize) -> Result<ConvWeights<Sz>> {
        let convs = &self.blocks[j].convs;
        Ok(match convs[..] {
            [w] => ConvWeights::Standard(self.weight(w)),
            [dw, pw] => ConvWeights::Separable {
                dw: self.weight(dw),
                pw: self.weight(pw),
            },
            _ => unreachable!("a block has one or two convs"),
        })
    }
    fn head_weights(&self) -> (Sz, Sz) {
        let [w, b] = <[Vec<usize>; 2]>::try_from(self.nodes[self.head()].param_shapes())
            .expect("the head has a weight and a bias");
        (
            self.held(w, DType::F32, self.head()),
            self.held(b, DType::F32, self.head()),
        )
    }

    fn conv2d(&self, x: &Sz, w: &Sz, _pad: usize) -> Result<Sz> {
        let i = self.node(w);
        let nd = &self.nodes[i];
        let LayerKind::Conv { k, pad } = nd.kind else {
            unreachable!("a conv weight")
        };
        Ok(self.op(Some(i), || {
            let out = self.alloc(vec![x.dims[0], nd.out.0, nd.out.1, nd.out.2], x.dtype);
            self.spike(conv_fwd_scratch(self.c, nd, x.dims[0], k, pad));
            out
        }))
    }
    fn conv2d_backward_weight(&self, x: &Sz, _dh: &Sz, w: &Sz, _pad: usize) -> Result<Sz> {
        let i = self.node(w);
        let nd = &self.nodes[i];
        let LayerKind::Conv { k, pad } = nd.kind else {
            unreachable!("a conv weight")
        };
        Ok(self.op(Some(i), || {
            let (scratch, partials) = conv_wgrad_scratch(self.c, nd, x.dims[0], k, pad);
            if self.cuda() {
                // The CUDA ops allocate the result first, then their scratch.
                let gw = self.alloc(w.dims.clone(), w.dtype);
                self.spike(scratch);
                return gw;
            }
            self.spike(scratch);
            let held = self.alloc(vec![partials as usize], DType::U8);
            let gw = self.alloc(w.dims.clone(), w.dtype);
            drop(held);
            gw
        }))
    }
    fn conv2d_backward_input(&self, dh: &Sz, w: &Sz, x_dims: &[usize], _pad: usize) -> Result<Sz> {
        let i = self.node(w);
        let nd = &self.nodes[i];
        let LayerKind::Conv { k, pad } = nd.kind else {
            unreachable!("a conv weight")
        };
        Ok(self.op(Some(i), || {
            let dx = self.alloc(x_dims.to_vec(), dh.dtype);
            self.spike(conv_dx_scratch(self.c, nd, dh.dims[0], k, pad));
            dx
        }))
    }
    fn depthwise(&self, x: &Sz, w: &Sz) -> Result<Sz> {
        let i = self.node(w);
        let nd = &self.nodes[i];
        Ok(self.op(Some(i), || {
            let out = self.alloc(x.dims.clone(), x.dtype);
            self.spike(fwd_scratch(self.c, nd));
            out
        }))
    }
    fn depthwise_backward_weight(&self, x: &Sz, _dd: &Sz, w: &Sz) -> Result<Sz> {
        let i = self.node(w);
        let nd = &self.nodes[i];
        Ok(self.op(Some(i), || {
            // One f32 partial weight gradient per image, summed at the end.
            let partial = self.alloc(vec![x.dims[0], nd.inp.0 * 9], DType::F32);
            self.spike(depthwise_plane_scratch(self.c, nd));
            let gw = self.alloc(w.dims.clone(), w.dtype);
            drop(partial);
            gw
        }))
    }
    fn depthwise_backward_input(&self, dd: &Sz, w: &Sz, x_dims: &[usize]) -> Result<Sz> {
        let i = self.node(w);
        let nd = &self.nodes[i];
        Ok(self.op(Some(i), || {
            let dx = self.alloc(x_dims.to_vec(), dd.dtype);
            self.spike(depthwise_plane_scratch(self.c, nd));
            dx
        }))
    }

    fn bn_params(&self, j: usize, h: &Sz, update_stats: bool) -> Result<SzBn> {
        let node = self.blocks[j].bn;
        Ok(self.op(Some(node), || {
            let [gamma, beta] = self.bn_affine(node);
            let stats = self.channel_sums(h, bn::CpuPass::Stats);
            if update_stats {
                // The running statistics' update: five [C] f32 temporaries at most
                // (`memtrain_kernels::batchnorm::update_running`), the new pair replacing the old.
                self.spike(5 * h.dims[1] as u64 * 4);
            }
            SzBn {
                _held: [gamma, beta, stats],
                node,
                decisions: None,
            }
        }))
    }
    fn bn_running(&self, j: usize) -> Result<SzBn> {
        let node = self.blocks[j].bn;
        let ch = self.nodes[node].out.0;
        Ok(self.op(Some(node), || {
            let [gamma, beta] = self.bn_affine(node);
            // The running mean and variance stacked into one `[2, C]` tensor.
            let stats = self.alloc(vec![2, ch], DType::F32);
            SzBn {
                _held: [gamma, beta, stats],
                node,
                decisions: None,
            }
        }))
    }
    fn bn_relu(&self, h: &Sz, p: &SzBn) -> Result<Sz> {
        Ok(self.op(Some(p.node), || {
            let y = self.alloc(h.dims.clone(), h.dtype);
            // Decided: a copy of h normalized in place.
            let pass = match p.decisions {
                Some(_) => bn::CpuPass::NormInPlace,
                None => bn::CpuPass::Norm,
            };
            self.bn_host(pass, h);
            y
        }))
    }
    fn bn_relu_in_place(&self, h: Sz, p: &SzBn) -> Result<Sz> {
        // A new tensor off the CPU; `h` is given up either way.
        if self.cuda() {
            return self.bn_relu(&h, p);
        }
        self.op(Some(p.node), || self.bn_host(bn::CpuPass::NormInPlace, &h));
        Ok(h)
    }
    fn bn_relu_pool(&self, h: &Sz, p: &SzBn) -> Result<Sz> {
        let pooled = vec![h.dims[0], h.dims[1], h.dims[2] / 2, h.dims[3] / 2];
        Ok(self.op(Some(p.node), || {
            // Off the CPU the ReLU output is made, then pooled.
            let y = self.cuda().then(|| self.alloc(h.dims.clone(), h.dtype));
            let out = self.alloc(pooled, h.dtype);
            self.bn_host(bn::CpuPass::NormPool, h);
            drop(y);
            out
        }))
    }
    fn bn_relu_pool_argmax(&self, h: &Sz, p: &SzBn) -> Result<Option<Sz>> {
        if self.cuda() {
            return Ok(None);
        }
        let pooled = vec![h.dims[0], h.dims[1], h.dims[2] / 2, h.dims[3] / 2];
        Ok(Some(self.op(Some(p.node), || {
            let argmax = self.alloc(pooled, DType::U8);
            // With decisions it is read from them, h untouched.
            if p.decisions.is_none() {
                self.bn_host(bn::CpuPass::PoolArgmax, h);
            }
            argmax
        })))
    }
    fn bn_relu_backward(&self, h: &Sz, g: Sz, p: &SzBn) -> Result<(Sz, Sz, Sz)> {
        Ok(self.op(Some(p.node), || {
            if self.cuda() {
                // Through the ReLU output, into a new gradient.
                let y = self.alloc(h.dims.clone(), h.dtype);
                let sums = self.channel_sums(h, bn::CpuPass::BackwardSums);
                let dh = self.alloc(h.dims.clone(), h.dtype);
                drop((y, g));
                let (dgamma, dbeta) = self.sum_rows_pair(&sums);
                return (dh, dgamma, dbeta);
            }
            // Written over g.
            let sums = self.channel_sums(h, bn::CpuPass::BackwardSums);
            self.bn_host(bn::CpuPass::BackwardInput, h);
            let (dgamma, dbeta) = self.sum_rows_pair(&sums);
            (g, dgamma, dbeta)
        }))
    }
    fn bn_relu_backward_sums(&self, h: &Sz, _g: &Sz, p: &SzBn) -> Result<Sz> {
        Ok(self.op(Some(p.node), || {
            self.channel_sums(h, bn::CpuPass::BackwardSums)
        }))
    }
    fn bn_relu_backward_input(
        &self,
        h: &Sz,
        _g: &Sz,
        p: &SzBn,
        _sums: &Sz,
        _batch_images: usize,
    ) -> Result<()> {
        self.op(Some(p.node), || self.bn_host(bn::CpuPass::BackwardInput, h));
        Ok(())
    }
    fn bn_grads(&self, sums: &Sz) -> Result<(Sz, Sz)> {
        Ok(self.sum_rows_pair(sums))
    }
    fn bn_relu_pool_backward(
        &self,
        h: Sz,
        _g: &Sz,
        argmax: Option<&Sz>,
        p: &SzBn,
    ) -> Result<(Sz, Sz, Sz)> {
        Ok(self.op(Some(p.node), || {
            if argmax.is_none() {
                // Through the ReLU output and the pool's backward (the unpooled gradient), into a
                // new gradient.
                let y = self.alloc(h.dims.clone(), h.dtype);
                let g = self.alloc(h.dims.clone(), h.dtype);
                let sums = self.channel_sums(&h, bn::CpuPass::BackwardSums);
                let dh = self.alloc(h.dims.clone(), h.dtype);
                drop((y, g, h));
                let (dgamma, dbeta) = self.sum_rows_pair(&sums);
                return (dh, dgamma, dbeta);
            }
            // Written over h.
            let sums = self.channel_sums(&h, bn::CpuPass::BackwardSums);
            self.bn_host(bn::CpuPass::BackwardInput, &h);
            let (dgamma, dbeta) = self.sum_rows_pair(&sums);
            (h, dgamma, dbeta)
        }))
    }
    fn bn_relu_pool_backward_sums(&self, h: &Sz, _g: &Sz, _argmax: &Sz, p: &SzBn) -> Result<Sz> {
        Ok(self.op(Some(p.node), || {
            self.channel_sums(h, bn::CpuPass::BackwardSums)
        }))
    }
    fn bn_relu_pool_backward_input(
        &self,
        h: Sz,
        _g: &Sz,
        _argmax: &Sz,
        p: &SzBn,
        _sums: &Sz,
        _batch_images: usize,
    ) -> Result<Sz> {
        self.op(Some(p.node), || {
            self.bn_host(bn::CpuPass::BackwardInput, &h)
        });
        Ok(h)
    }

    fn decisions(&self, h: &Sz, p: &SzBn, _pool: bool) -> Result<Sz> {
        let [n, c, hh, w] = h.dims[..] else {
            unreachable!("a conv output is [N, C, H, W]")
        };
        Ok(self.op(Some(p.node), || {
            let d = self.alloc(bn::decisions_dims([n, c, hh, w]).to_vec(), DType::U8);
            // A CUDA device gets them made on the host from a copy of h and uploaded.
            if !self.cuda() {
                self.bn_host(bn::CpuPass::Decisions, h);
            }
            d
        }))
    }
    fn decided(&self, p: SzBn, decisions: Sz) -> SzBn {
        SzBn {
            decisions: Some(decisions),
            ..p
        }
    }
    fn bn_images(&self, p: &SzBn, first: usize, len: usize) -> Result<SzBn> {
        let mut p = p.clone();
        if let Some(d) = &p.decisions {
            p.decisions = Some(self.narrow(d, first, len)?);
        }
        Ok(p)
    }
    fn decision_bytes(&self, p: &SzBn) -> u64 {
        p.decisions.as_ref().map_or(0, Sz::bytes)
    }
    fn quantize(&self, h: &Sz, width: Width, _salt: u64) -> Result<SzCodes> {
        let [n, ch, hh, ww] = h.dims[..] else {
            unreachable!("a conv output is [N, C, H, W]")
        };
        let dims = [n, ch, hh, ww];
        let ops = !width.per_group() && self.cuda();
        if width.per_group() {
            // Codes made on the host (a CUDA device gets them uploaded); the ranges written
            // straight into their buffer.
        } else if !ops {
            // Per-plane ranges, then the per-channel ones.
            self.spike(n as u64 * ch as u64 * 8);
        }
        let (ranges, codes) = if width.per_group() && self.cuda() {
            // Uploaded codes first, then ranges.
            let codes = self.alloc(width.codes_dims(dims).to_vec(), DType::U8);
            (
                self.alloc(width.ranges_dims(dims).to_vec(), DType::F32),
                codes,
            )
        } else {
            let ranges = self.alloc(width.ranges_dims(dims).to_vec(), DType::F32);
            (
                ranges,
                self.alloc(width.codes_dims(dims).to_vec(), DType::U8),
            )
        };
        if ops {
            // Candle ops, chunk by chunk into the codes' buffer.
            self.spike(memtrain_kernels::quantize::ops_transient_bytes(dims, true));
        }
        Ok(SzCodes {
            codes,
            ranges,
            width,
            dims: h.dims.clone(),
            dtype: h.dtype,
        })
    }
    fn dequantize(&self, q: &SzCodes) -> Result<Sz> {
        let out = self.alloc(q.dims.clone(), q.dtype);
        if self.cuda() && !q.width.per_group() {
            // Candle ops (a range per channel), chunk by chunk into the result's buffer.
            let [n, c, h, w] = q.dims[..] else {
                unreachable!("codes of a conv output")
            };
            self.spike(memtrain_kernels::quantize::ops_transient_bytes(
                [n, c, h, w],
                false,
            ));
        }
        Ok(out)
    }
    fn dequantize_images(&self, q: &SzCodes, _first: usize, len: usize) -> Result<Sz> {
        let mut dims = q.dims.clone();
        dims[0] = len;
        Ok(self.alloc(dims, q.dtype))
    }
    fn codes_dims(&self, q: &SzCodes) -> Vec<usize> {
        q.dims.clone()
    }
    fn codes_bytes(&self, q: &SzCodes) -> u64 {
        q.codes.bytes() + q.ranges.bytes()
    }

    fn matmul(&self, a: &Sz, b: &Sz) -> Result<Sz> {
        let (m, k, n) = (a.dims[0], a.dims[1], b.dims[1]);
        Ok(self.op(Some(self.head()), || {
            let out = self.alloc(vec![m, n], DType::F32);
            if !self.cuda() {
                self.spike(memtrain_kernels::linear::matmul_scratch_bytes(
                    [m, k, n],
                    a.strides(),
                    b.strides(),
                ) as u64);
            }
            out
        }))
    }
    fn t(&self, b: &Sz) -> Result<Sz> {
        Ok(Sz {
            transposed: !b.transposed,
            ..b.view(vec![b.dims[1], b.dims[0]], Strides::Copied)
        })
    }
    fn add_bias(&self, x: &Sz, _bias: &Sz) -> Result<Sz> {
        Ok(self.op(Some(self.head()), || self.alloc(x.dims.clone(), x.dtype)))
    }
    fn sum_rows(&self, x: &Sz) -> Result<Sz> {
        Ok(self.op(Some(self.head()), || self.alloc(vec![x.dims[1]], x.dtype)))
    }
    fn add(&self, a: &Sz, _b: &Sz) -> Result<Sz> {
        Ok(self.alloc(a.dims.clone(), a.dtype))
    }
    fn loss_and_grad(&self, logits: &Sz, _labels: &Sz, _loss_mult: f64) -> Result<(Head<Sz>, Sz)> {
        Ok(self.op(Some(self.head()), || {
            // The loss and the correct count: scalars left on the device until the backward is
            // done. Then the log-softmax, the loss's and the argmax's temporaries and the one-hot:
            // a few logits-sized temporaries.
            let head = Head {
                loss: self.alloc(vec![], DType::F32),
                correct: self.alloc(vec![], DType::U32),
            };
            self.spike(6 * logits.bytes());
            (head, self.alloc(logits.dims.clone(), DType::F32))
        }))
    }
    fn read_head(&self, _head: &Head<Sz>) -> Result<MicroResult> {
        // Sizes carry no values.
        Ok(MicroResult {
            loss: 0.0,
            correct: 0,
        })
    }

    fn loss(&self, logits: &Sz, _labels: &Sz) -> Result<MicroResult> {
        self.op(Some(self.head()), || {
            // log-softmax, the loss and the argmax: a few logits-sized temporaries.
            self.spike(6 * logits.bytes());
        });
        Ok(MicroResult {
            loss: 0.0,
            correct: 0,
        })
    }

    fn new_grads(&self) -> Vec<Option<Sz>> {
        vec![None; self.params.len()]
    }
    fn add_grad(&self, grads: &mut Vec<Option<Sz>>, i: usize, g: Sz) -> Result<()> {
        grads[i] = Some(match grads[i].take() {
            None => g,
            // Added in place on the CPU; into a new tensor elsewhere.
            Some(acc) if self.cuda() => {
                let sum = self.alloc(acc.dims.clone(), DType::F32);
                drop((acc, g));
                sum
            }
            Some(acc) => acc,
        });
        Ok(())
    }
    fn grad_bytes(&self, grads: &Vec<Option<Sz>>) -> u64 {
        grads.iter().flatten().map(Sz::bytes).sum()
    }
    fn grad_list(&self, grads: Vec<Option<Sz>>) -> Vec<Option<Sz>> {
        grads
    }

    fn param(&self, i: usize) -> Sz {
        let (node, dims) = self.params[i].clone();
        self.held(dims, DType::F32, node)
    }
    fn set_param(&self, _i: usize, _value: &Sz) -> Result<()> {
        Ok(())
    }
    fn affine(&self, x: &Sz, _mul: f64, _add: f64) -> Result<Sz> {
        Ok(self.alloc(x.dims.clone(), x.dtype))
    }
    fn sub(&self, a: &Sz, _b: &Sz) -> Result<Sz> {
        Ok(self.alloc(a.dims.clone(), a.dtype))
    }
    fn div(&self, a: &Sz, _b: &Sz) -> Result<Sz> {
        Ok(self.alloc(a.dims.clone(), a.dtype))
    }
    fn sqr(&self, x: &Sz) -> Result<Sz> {
        Ok(self.alloc(x.dims.clone(), x.dtype))
    }
    fn sqrt(&self, x: &Sz) -> Result<Sz> {
        Ok(self.alloc(x.dims.clone(), x.dtype))
    }
    fn sum_squares(&self, x: &Sz) -> Result<f64> {
        // Squares, their sum, the sum in f64: all alive until it is read.
        let _held = (
            self.sqr(x)?,
            self.alloc(vec![], DType::F32),
            self.alloc(vec![], DType::F64),
        );
        // A finite norm of zero: the update runs and nothing is clipped (clipping scales each
        // gradient into a new tensor one at a time, below the update's own temporaries).
        Ok(0.0)
    }
}

impl Sizing<'_> {
    /// A batch of `n` images as the trainer makes it: f32 images and u32 labels.
    pub(super) fn batch(&self, n: usize) -> (Sz, Sz) {
        let x = self.alloc(vec![n, 3, 32, 32], DType::F32);
        debug_assert_eq!(count(&x.dims[1..]) as usize, IMAGE_BYTES);
        (x, self.alloc(vec![n], DType::U32))
    }
}

/// One evaluation batch of `n` images through the tape's eval-mode forward on sizes
/// ([`LeanStep::evaluate`]): the batch as the trainer makes it (f32 images, u32 labels), then
/// the blocks and the head with running statistics, nothing saved.
pub(super) fn eval_batch(
    ops: Sizing<'_>,
    n: usize,
    blocks: usize,
    storage: ActivationStorage,
) -> Result<()> {
    let (x, y) = ops.batch(n);
    // One segment: the evaluation saves nothing and recomputes nothing.
    let segments = memtrain_core::model::cnn::segments(blocks, crate::config::Segmentation::NONE);
    let mut step = LeanStep::on(ops, segments, storage);
    step.evaluate(x, &y, &mut memtrain_core::step::tape::NoObserver)?;
    Ok(())
}
