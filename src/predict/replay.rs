//! The replay of the lean step ([`crate::step::tape`]) for one micro-batch: block by block, in
//! the tape's order, the allocations and frees of the forward, the backward (with checkpointed
//! segments recomputed) and the layer events the trainer's timeline records.

use crate::data::{IMAGE_BYTES, NUM_CLASSES};
use std::ops::Range;

use super::scratch::*;
use super::sim::*;

/// The nodes of one block: its conv nodes (one, or depthwise + pointwise), BatchNorm, pool.
pub(super) struct BlockNodes {
    pub(super) convs: Vec<usize>,
    pub(super) bn: usize,
    pub(super) pool: Option<usize>,
    pub(super) name: String,
}

impl BlockNodes {
    pub(super) fn separable(&self) -> bool {
        self.convs.len() == 2
    }
    /// Bytes of the block's conv output h.
    pub(super) fn h_bytes(&self, c: &Ctx, nodes: &[Node]) -> u64 {
        nodes[self.bn].in_bytes(c)
    }
    /// Bytes of the block's output (after the pool when there is one).
    pub(super) fn out_bytes(&self, c: &Ctx, nodes: &[Node]) -> u64 {
        nodes[self.pool.unwrap_or(self.bn)].out_bytes(c)
    }
    /// Bytes of the block's input.
    pub(super) fn in_bytes(&self, c: &Ctx, nodes: &[Node]) -> u64 {
        nodes[self.convs[0]].in_bytes(c)
    }
    /// Bytes the tape keeps of the block's conv output (see [`Ctx::kept`]).
    pub(super) fn kept_bytes(&self, c: &Ctx, nodes: &[Node]) -> u64 {
        c.kept(self.h_bytes(c, nodes), self.channels(nodes))
    }
    /// Bytes of the byte-per-element argmax of the pool (0 without one).
    pub(super) fn argmax_bytes(&self, c: &Ctx, nodes: &[Node]) -> u64 {
        self.pool.map_or(0, |p| c.n * elems(nodes[p].out))
    }
    pub(super) fn channels(&self, nodes: &[Node]) -> u64 {
        nodes[self.bn].out.0 as u64
    }
}

pub(super) fn blocks_of(nodes: &[Node]) -> Vec<BlockNodes> {
    let head = nodes.len() - 1;
    let n_blocks = nodes[..head].iter().map(|n| n.block + 1).max().unwrap_or(0);
    (0..n_blocks)
        .map(|b| {
            let idx: Vec<usize> = (0..head).filter(|&i| nodes[i].block == b).collect();
            let convs = idx
                .iter()
                .copied()
                .filter(|&i| matches!(nodes[i].op, Op::Conv { .. } | Op::Depthwise))
                .collect();
            let bn = idx
                .iter()
                .copied()
                .find(|&i| nodes[i].op == Op::Bn)
                .unwrap_or(idx[0]);
            let pool = idx.iter().copied().find(|&i| nodes[i].op == Op::Pool);
            let name = nodes[bn]
                .name
                .rsplit_once('.')
                .map_or(nodes[bn].name.clone(), |(b, _)| b.to_string());
            BlockNodes {
                convs,
                bn,
                pool,
                name,
            }
        })
        .collect()
}

/// Per-plane partial sums of a BatchNorm reduction, then its `[2, C]` result (kept).
pub(super) fn bn_reduce(sim: &mut Sim, c: &Ctx, b: &BlockNodes, nodes: &[Node]) {
    let ch = b.channels(nodes);
    sim.spike(c.n * ch * 16);
    sim.alloc(ch * 8);
}

/// The lean step's replay (`src/step/tape.rs`), event by event.
pub(super) struct Lean<'a> {
    pub(super) c: &'a Ctx,
    pub(super) nodes: &'a [Node],
    pub(super) blocks: Vec<BlockNodes>,
    pub(super) acc_live: bool,
    /// Activation bytes held for the backward (as the tape counts them).
    pub(super) saved: u64,
    /// The predicted events of the micro-batch: (phase, layer, peak since the previous event).
    pub(super) events: Vec<EventPrediction>,
}

impl Lean<'_> {
    pub(super) fn event(&mut self, sim: &mut Sim, phase: Phase, layer: String) {
        self.events.push(EventPrediction {
            phase: match phase {
                Phase::Forward => "forward",
                Phase::Backward => "backward",
                Phase::Optimizer => "optimizer",
            },
            layer,
            peak_bytes: sim.event_peak,
            current_bytes: sim.cur,
            saved_bytes: self.saved,
        });
        sim.event_peak = sim.cur;
    }

    /// A block's conv on an input that stays alive; leaves h alive.
    pub(super) fn conv_fwd(&mut self, sim: &mut Sim, j: usize) {
        let b = &self.blocks[j];
        let (c, nodes) = (self.c, self.nodes);
        if b.separable() {
            let (dw, pw) = (b.convs[0], b.convs[1]);
            conv_node_fwd(sim, c, dw, &nodes[dw]);
            conv_node_fwd(sim, c, pw, &nodes[pw]);
            sim.free(nodes[dw].out_bytes(c));
        } else {
            conv_node_fwd(sim, c, b.convs[0], &nodes[b.convs[0]]);
        }
    }

    /// Block j's forward: the output is left alive; with `save` h (and its statistics) too.
    /// `input` bytes (the block input, 0 when a segment input or the batch holds it) are freed
    /// after the conv. Without `output` (the last block of a recomputation, whose output the
    /// first forward already used) only h is made.
    pub(super) fn block_fwd(
        &mut self,
        sim: &mut Sim,
        j: usize,
        save: bool,
        output: bool,
        input: u64,
    ) {
        let (c, nodes) = (self.c, self.nodes);
        self.conv_fwd(sim, j);
        sim.free(input);
        let b = &self.blocks[j];
        let start = sim.mark();
        bn_reduce(sim, c, b, nodes);
        let (h, out) = (b.h_bytes(c, nodes), b.out_bytes(c, nodes));
        if save && c.int8 {
            // The per-plane ranges, the per-channel ranges, the codes; then h is normalized in
            // place (or pooled and freed), or freed when no output is wanted.
            let ch = b.channels(nodes);
            sim.spike(c.n * ch * 8);
            sim.alloc(ch * 8);
            sim.alloc(h / c.s);
            self.saved += b.kept_bytes(c, nodes);
            match (output, b.pool.is_some()) {
                (true, true) => {
                    sim.alloc(out);
                    sim.free(h);
                }
                (true, false) => {}
                (false, _) => sim.free(h),
            }
        } else if save {
            if output {
                sim.alloc(out);
            }
            self.saved += h;
        } else if b.pool.is_some() {
            sim.alloc(out);
            sim.free(h + b.channels(nodes) * 8);
        } else {
            // Normalized in place: h becomes the output.
            sim.free(b.channels(nodes) * 8);
        }
        sim.record(b.bn, start);
    }

    /// Block j's kept conv output made a tensor again for its backward: nothing to do for the
    /// exact record; the codes decoded into a fresh h, then freed.
    pub(super) fn restore(&self, sim: &mut Sim, j: usize) {
        let (c, nodes) = (self.c, self.nodes);
        if c.int8 {
            let b = &self.blocks[j];
            sim.alloc(b.h_bytes(c, nodes));
            sim.free(b.kept_bytes(c, nodes));
        }
    }

    /// Block j's BatchNorm (+ pool) backward from the gradient of its output (`g` bytes alive):
    /// leaves dh_j alive.
    pub(super) fn bn_bwd(&mut self, sim: &mut Sim, j: usize, g: u64) {
        let (c, nodes) = (self.c, self.nodes);
        self.saved -= self.blocks[j].kept_bytes(c, nodes);
        self.restore(sim, j);
        let b = &self.blocks[j];
        let h = b.h_bytes(c, nodes);
        let ch = b.channels(nodes);
        if b.pool.is_some() {
            let am = b.argmax_bytes(c, nodes);
            sim.alloc(am);
            bn_reduce(sim, c, b, nodes);
            // In place over h: dh_j; the pooled gradient, the argmax and the statistics go.
            sim.free(g + am + ch * 8);
        } else {
            bn_reduce(sim, c, b, nodes);
            // In place over g; h and the statistics go.
            sim.free(h + ch * 8);
        }
        self.acc_bn(sim, ch);
    }

    /// γ and β gradients are views of the `[2, C]` sums: kept as the accumulator's buffers by the
    /// first micro-batch, added in place and dropped by later ones.
    pub(super) fn acc_bn(&self, sim: &mut Sim, ch: u64) {
        if self.acc_live {
            sim.free(ch * 8);
        }
    }

    /// Conv backward of block j with its input alive and dh_j (consumed); leaves dx when `dx`.
    pub(super) fn conv_bwd(&mut self, sim: &mut Sim, j: usize, dx: bool) {
        let (c, nodes, acc) = (self.c, self.nodes, self.acc_live);
        let b = &self.blocks[j];
        let dh = b.h_bytes(c, nodes);
        if b.separable() {
            let (dw, pw) = (b.convs[0], b.convs[1]);
            conv_node_fwd(sim, c, dw, &nodes[dw]);
            conv_wgrad(sim, c, pw, &nodes[pw], acc);
            let d = nodes[dw].out_bytes(c);
            sim.free(d);
            conv_dgrad(sim, c, pw, &nodes[pw]);
            sim.free(dh);
            depthwise_wgrad(sim, c, dw, &nodes[dw], acc);
            if dx {
                depthwise_dgrad(sim, c, dw, &nodes[dw]);
            }
            sim.free(d);
        } else {
            let i = b.convs[0];
            conv_wgrad(sim, c, i, &nodes[i], acc);
            if dx {
                conv_dgrad(sim, c, i, &nodes[i]);
            }
            sim.free(dh);
        }
    }

    /// Block j's conv backward with block j-1's BatchNorm backward (`inner_backward`): dh_j alive
    /// on entry, dh_{j-1} alive on exit.
    pub(super) fn inner_bwd(&mut self, sim: &mut Sim, j: usize) {
        let (c, nodes, acc) = (self.c, self.nodes, self.acc_live);
        let prev_h = self.blocks[j - 1].h_bytes(c, nodes);
        let ch = self.blocks[j - 1].channels(nodes);
        self.saved -= self.blocks[j - 1].kept_bytes(c, nodes);
        if self.blocks[j - 1].pool.is_some() {
            self.restore(sim, j - 1);
            let p = self.blocks[j].in_bytes(c, nodes);
            let am = self.blocks[j - 1].argmax_bytes(c, nodes);
            sim.alloc(p);
            sim.alloc(am);
            self.conv_bwd(sim, j, true);
            sim.free(p);
            bn_reduce(sim, c, &self.blocks[j - 1], nodes);
            // In place over h_{j-1}; dx (= p-sized), the argmax and the statistics go.
            sim.free(p + am + ch * 8);
            self.acc_bn(sim, ch);
            return;
        }
        let b = &self.blocks[j];
        let dh = b.h_bytes(c, nodes);
        if b.separable() {
            self.restore(sim, j - 1);
            let (dw, pw) = (b.convs[0], b.convs[1]);
            sim.alloc(prev_h); // y, fresh
            conv_node_fwd(sim, c, dw, &nodes[dw]);
            sim.free(prev_h);
            conv_wgrad(sim, c, pw, &nodes[pw], acc);
            let d = nodes[dw].out_bytes(c);
            sim.free(d);
            conv_dgrad(sim, c, pw, &nodes[pw]);
            sim.free(dh);
            depthwise_dgrad(sim, c, dw, &nodes[dw]);
            bn_reduce(sim, c, &self.blocks[j - 1], nodes);
            sim.free(ch * 8);
            self.acc_bn(sim, ch);
            depthwise_wgrad(sim, c, dw, &nodes[dw], acc);
            sim.free(prev_h + d);
        } else {
            // The weight gradient from a fresh y, dx_j, then h_{j-1} (decoded only now).
            let i = b.convs[0];
            sim.alloc(prev_h);
            conv_wgrad(sim, c, i, &nodes[i], acc);
            sim.free(prev_h);
            conv_dgrad(sim, c, i, &nodes[i]);
            sim.free(dh);
            self.restore(sim, j - 1);
            bn_reduce(sim, c, &self.blocks[j - 1], nodes);
            sim.free(ch * 8);
            self.acc_bn(sim, ch);
            sim.free(prev_h);
        }
    }

    /// Segment `seg`'s backward from the gradient of its output (`g` bytes): leaves the input
    /// gradient alive when `dx`.
    pub(super) fn segment_bwd(&mut self, sim: &mut Sim, seg: Range<usize>, g: u64, dx: bool) {
        self.bn_bwd(sim, seg.end - 1, g);
        let mut j = seg.end - 1;
        while j > seg.start {
            self.inner_bwd(sim, j);
            let name = self.blocks[j].name.clone();
            self.event(sim, Phase::Backward, name);
            j -= 1;
        }
        self.conv_bwd(sim, j, dx);
        let name = self.blocks[j].name.clone();
        self.event(sim, Phase::Backward, name);
    }
}

/// One predicted event of the step, matching the trainer's timeline events.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EventPrediction {
    /// `forward`, `backward` or `optimizer`.
    pub phase: &'static str,
    /// The layer, named as in the timeline (`stage1.block2`, `head`, `optimizer`, …).
    pub layer: String,
    /// Highest bytes in use between the previous event and this one.
    pub peak_bytes: u64,
    /// Bytes in use right after the event.
    pub current_bytes: u64,
    /// Activation bytes held for the backward at the event.
    pub saved_bytes: u64,
}

/// One micro-batch of the lean step: data, forward, backward, gradient accumulation. Returns
/// the activations saved at the end of the forward pass and the micro-batch's events.
pub(super) fn micro_batch(
    sim: &mut Sim,
    c: &Ctx,
    nodes: &[Node],
    segments: &[Range<usize>],
    acc_live: bool,
) -> (u64, Vec<EventPrediction>) {
    let head = nodes.len() - 1;
    let mut l = Lean {
        c,
        nodes,
        blocks: blocks_of(nodes),
        acc_live,
        saved: 0,
        events: Vec::new(),
    };
    // The last segment saves in the forward; the others keep only their inputs.
    let last = segments.len() - 1;
    // The micro-batch as an f32 tensor (+ labels), and its copy in the compute dtype.
    let x32 = c.n * (IMAGE_BYTES as u64 * 4 + 4);
    sim.alloc(x32);
    let xin = if c.half() {
        c.n * IMAGE_BYTES as u64 * c.s
    } else {
        0
    };
    sim.alloc(xin);
    let xin_bytes = c.n * IMAGE_BYTES as u64 * c.s;

    // Forward.
    let mut cur_in = xin_bytes;
    // Whether the current input is held elsewhere (the data, or a segment input).
    let mut cur_is_input;
    let mut seg_inputs = Vec::new();
    for (si, seg) in segments.iter().enumerate() {
        seg_inputs.push(cur_in);
        l.saved += cur_in;
        cur_is_input = true;
        for j in seg.clone() {
            l.block_fwd(
                sim,
                j,
                si == last,
                true,
                if cur_is_input { 0 } else { cur_in },
            );
            cur_in = l.blocks[j].out_bytes(c, nodes);
            cur_is_input = false;
            let name = l.blocks[j].name.clone();
            l.event(sim, Phase::Forward, name);
        }
    }
    // The last block's output is the next segment's... no: the head's input. For checkpointing,
    // segment outputs become the next segment's inputs (held in `seg_inputs`), so only the last
    // output is freed by the head.
    let saved_at_end = l.saved;
    let g = head_step(&mut l, sim, head, cur_in);
    segments_backward(&mut l, sim, segments, seg_inputs, g);
    // The micro-batch's data.
    sim.free(x32 + xin);
    (saved_at_end, l.events)
}

/// The head of a micro-batch: its forward (features in f32, logits, loss and the logits'
/// gradient) and backward (weight and bias gradients, the features' gradient in the compute
/// dtype). `feat`: the last block's output bytes. Returns the bytes of the features' gradient.
fn head_step(l: &mut Lean, sim: &mut Sim, head: usize, feat: u64) -> u64 {
    let (c, nodes, acc_live) = (l.c, l.nodes, l.acc_live);
    let hd = &nodes[head];
    let feat32 = c.n * elems(hd.inp) * 4;
    let start = sim.mark();
    if c.half() {
        sim.alloc(feat32);
        sim.free(feat);
    }
    let logits = hd.out_bytes(c);
    let packing = head_packing(c, hd);
    // matmul, bias add, loss (log-softmax, gather), softmax, one-hot, the gradient.
    sim.alloc(logits);
    sim.spike(packing[0]);
    sim.alloc(logits);
    sim.free(logits);
    sim.spike(6 * logits);
    sim.alloc(logits); // the gradient of the logits
    sim.free(logits); // the logits
    l.event(sim, Phase::Forward, "head".into());
    sim.phase = Phase::Backward;
    // Head backward: weight and bias gradients, then the feature gradient in the compute dtype.
    let wsize = hd.params.saturating_sub(NUM_CLASSES) as u64 * 4;
    sim.alloc(wsize);
    sim.spike(packing[1]);
    sim.alloc(NUM_CLASSES as u64 * 4);
    if acc_live {
        sim.free(wsize + NUM_CLASSES as u64 * 4);
    }
    sim.free(feat32.max(feat)); // the f32 features
    sim.alloc(feat32);
    sim.spike(packing[2]);
    if c.half() {
        sim.alloc(feat);
        sim.free(feat32);
    }
    sim.free(logits);
    sim.record(head, start);
    l.event(sim, Phase::Backward, "head".into());
    feat
}

/// The backward of every segment, last first, from `g`, the bytes of the last block's output
/// gradient: each segment but the last re-run with saving, then its blocks' backward; the
/// segments' saved inputs (`seg_inputs`) freed as they are used.
fn segments_backward(
    l: &mut Lean,
    sim: &mut Sim,
    segments: &[Range<usize>],
    mut seg_inputs: Vec<u64>,
    mut g: u64,
) {
    let (c, nodes) = (l.c, l.nodes);
    let last = segments.len().saturating_sub(1);
    for (si, seg) in segments.iter().enumerate().rev() {
        let input = seg_inputs.pop().unwrap_or(0);
        // The last segment saved in the forward; the others are re-run with saving.
        if si != last {
            for j in seg.clone() {
                let input = if j > seg.start {
                    l.blocks[j - 1].out_bytes(c, nodes)
                } else {
                    0
                };
                l.block_fwd(sim, j, true, j + 1 < seg.end, input);
            }
            let name = crate::model::cnn::recompute_label(
                &l.blocks[seg.start].name,
                &l.blocks[seg.end - 1].name,
            );
            l.event(sim, Phase::Backward, name);
        }
        let dx = si > 0;
        l.segment_bwd(sim, seg.clone(), g, dx);
        l.saved -= input;
        if si > 0 {
            sim.free(input);
        }
        g = if dx {
            l.blocks[seg.start].in_bytes(c, nodes)
        } else {
            0
        };
    }
}

/// What the head's three products allocate besides their results on the CPU (the gemm crate's
/// packed operand, [`memtrain_kernels::linear::matmul_scratch_bytes`]): the logits `feat · Wᵀ`,
/// the weight gradient `dlogitsᵀ · feat` and the feature gradient `dlogits · W`.
fn head_packing(c: &Ctx, hd: &Node) -> [u64; 3] {
    if !c.device.is_cpu() {
        return [0; 3];
    }
    let (n, f, k) = (c.n as usize, elems(hd.inp) as usize, NUM_CLASSES);
    let bytes = memtrain_kernels::linear::matmul_scratch_bytes;
    [
        bytes([n, f, k], (f, 1), (1, f)),
        bytes([k, n, f], (1, k), (f, 1)),
        bytes([n, k, f], (k, 1), (f, 1)),
    ]
    .map(|b| b as u64)
}
