//! CPU kernels.

use super::*;
use crate::util::SharedMut;

/// Elements are converted to f32 in blocks of this many, in a stack buffer (L1-resident); it is
/// also the unit whose f32 sum is added to an f64 accumulator, so that a plane of any size sums
/// accurately.
const BLK: usize = 256;

/// An activation dtype (f32, f16, bf16): a [`Float`] whose arithmetic type is f32.
pub(super) trait Elem: Float<Acc = f32> {}

impl<T: Float<Acc = f32>> Elem for T {}

/// One block of `src` as f32: the data itself for f32, else converted into `buf`.
#[inline(always)]
fn block<'a, T: Elem>(src: &'a [T], buf: &'a mut [f32; BLK]) -> &'a [f32] {
    match T::as_acc(src) {
        Some(s) => s,
        None => {
            let b = &mut buf[..src.len()];
            T::widen(src, b);
            b
        }
    }
}

/// f32 planes of scratch each range of planes makes: [`pool_planes`] (the plane widened and its
/// output), [`bwd_reduce_from_h`] (and the upstream gradient) and [`bwd_input_from_h`] (and the
/// result); each also makes one block of the activation's type.
const POOL_PLANES: usize = 2;
const REDUCE_PLANES: usize = 3;
const INPUT_PLANES: usize = 4;

/// Heap the CPU `pass` over an activation `d` of `elem`-byte values holds at its peak besides its
/// input and output tensors, on `threads` threads: its per-channel host copies (`channel_floats`
/// f32 per channel, made first and kept to its end), its per-plane partial sums, and the scratch
/// of every range of planes that can run at once (whether two overlap depends on the threads'
/// timing, so every one is counted).
pub(super) fn host_bytes(
    pass: super::CpuPass,
    d: Dims,
    elem: usize,
    threads: usize,
    channel_floats: usize,
) -> usize {
    use super::CpuPass::*;
    let ranges = crate::util::planes_in_parallel(d.planes(), d.hw, threads);
    let scratch = |planes: usize| ranges * (planes * d.hw * 4 + BLK * elem);
    let partials = d.planes() * std::mem::size_of::<(f64, f64)>();
    let channels = channel_floats * d.c * 4;
    channels
        + match pass {
            // The sums and the squared deviations per plane (f64 each), the mean and the
            // variance's per-channel sum.
            Stats => 2 * d.planes() * 8 + d.c * (4 + 8),
            Norm | NormInPlace => 0,
            // And a byte per window for the argmax (the decisions' pass without a pool has
            // none: counted anyway, a few hundred bytes).
            NormPool | PoolArgmax | Decisions => scratch(POOL_PLANES) + ranges * d.hw / 4,
            // The partials, then the threads' scratch or the per-channel totals after it.
            BackwardSums => {
                partials + scratch(REDUCE_PLANES).max(d.c * std::mem::size_of::<(f64, f64)>())
            }
            BackwardInput => scratch(INPUT_PLANES),
        }
}

/// Runs `f` over ranges of planes covering `0..planes` ([`crate::util::for_planes`]).
fn for_planes(d: Dims, f: impl Fn(Range<usize>) + Sync) {
    crate::util::for_planes(d.planes(), d.hw, f)
}

/// Computes one value per plane in parallel (`f(plane index, plane data)`).
fn per_plane<T: Elem, U: Copy + Default + Send>(
    x: &[T],
    d: Dims,
    f: impl Fn(usize, &[T]) -> U + Sync,
) -> Vec<U> {
    per_plane_with(x, d, || (), |_, p, plane| f(p, plane))
}

/// [`per_plane`] with a scratch value made once per worker's range of planes (`scratch()`),
/// not once per plane.
fn per_plane_with<T: Elem, U: Copy + Default + Send, S>(
    x: &[T],
    d: Dims,
    scratch: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, usize, &[T]) -> U + Sync,
) -> Vec<U> {
    let mut out = vec![U::default(); d.planes()];
    let ptr = SharedMut(out.as_mut_ptr());
    for_planes(d, |r| {
        // SAFETY: the pool hands out disjoint plane ranges within 0..planes.
        let o = unsafe { ptr.range(r.start, r.len()) };
        let mut s = scratch();
        for (p, slot) in r.zip(o.iter_mut()) {
            *slot = f(&mut s, p, &x[p * d.hw..(p + 1) * d.hw]);
        }
    });
    out
}

/// Sums per-plane partials into per-channel totals (planes are `n * c + channel`).
fn per_channel<U: Copy>(part: &[U], d: Dims, zero: U, add: impl Fn(U, U) -> U) -> Vec<U> {
    let mut acc = vec![zero; d.c];
    for chunk in part.chunks_exact(d.c) {
        for (a, &v) in acc.iter_mut().zip(chunk) {
            *a = add(*a, v);
        }
    }
    acc
}

// The reductions below keep eight independent f32 lanes so that the loops vectorize (a single
// accumulator would force strictly sequential float adds); chunks_exact lets LLVM drop the
// bounds checks. They are called once per block and kept out of line: inlined into the plane
// loops, LLVM turned the ReLU mask into one branch per lane (measured 10-30× slower).

/// `Σ x`.
#[inline(never)]
fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let xs = x.chunks_exact(8);
    let tail: f32 = xs.remainder().iter().sum();
    for xc in xs {
        for l in 0..8 {
            acc[l] += xc[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `Σ (x - mu)²`.
#[inline(never)]
fn sum_sq_dev(x: &[f32], mu: f32) -> f32 {
    let mut acc = [0f32; 8];
    let xs = x.chunks_exact(8);
    let tail: f32 = xs.remainder().iter().map(|&v| (v - mu) * (v - mu)).sum();
    for xc in xs {
        for l in 0..8 {
            let t = xc[l] - mu;
            acc[l] += t * t;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `g` where `y > 0`, else +0. Done with a bit mask rather than a branch or a select: ReLU
/// inputs are positive about half the time at random, so a branch mispredicts every other
/// element (measured 10× slower), and the and-mask vectorizes.
#[inline(always)]
fn relu_mask(g: f32, y: f32) -> f32 {
    f32::from_bits(g.to_bits() & ((y > 0.0) as u32).wrapping_neg())
}

/// `(Σ g', Σ g'·(x - mu))` with `g' = g` where `y > 0` (or everywhere when `y` is `None`), else 0.
#[inline(never)]
fn grad_sums(x: &[f32], g: &[f32], y: Option<&[f32]>, mu: f32) -> (f32, f32) {
    let (mut sg, mut sgx) = ([0f32; 8], [0f32; 8]);
    let n = x.len() / 8 * 8;
    let (mut tg, mut tgx) = (0f32, 0f32);
    match y {
        Some(y) => {
            for ((xc, gc), yc) in x
                .chunks_exact(8)
                .zip(g.chunks_exact(8))
                .zip(y.chunks_exact(8))
            {
                for l in 0..8 {
                    let gm = relu_mask(gc[l], yc[l]);
                    sg[l] += gm;
                    sgx[l] += gm * (xc[l] - mu);
                }
            }
            for i in n..x.len() {
                let gm = relu_mask(g[i], y[i]);
                tg += gm;
                tgx += gm * (x[i] - mu);
            }
        }
        None => {
            for (xc, gc) in x.chunks_exact(8).zip(g.chunks_exact(8)) {
                for l in 0..8 {
                    sg[l] += gc[l];
                    sgx[l] += gc[l] * (xc[l] - mu);
                }
            }
            for i in n..x.len() {
                tg += g[i];
                tgx += g[i] * (x[i] - mu);
            }
        }
    }
    (sg.iter().sum::<f32>() + tg, sgx.iter().sum::<f32>() + tgx)
}

/// `out = (x - mu) * s + b`, then ReLU.
#[inline(never)]
fn normalize(x: &[f32], mu: f32, s: f32, b: f32, relu: bool, out: &mut [f32]) {
    if relu {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = ((v - mu) * s + b).max(0.0);
        }
    } else {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = (v - mu) * s + b;
        }
    }
}

/// `out = a·(g' + b·(x - mu) + k)` with `g'` the ReLU-masked gradient (`[mu, a, b, k]`).
#[inline(never)]
fn input_grad(x: &[f32], g: &[f32], y: Option<&[f32]>, [mu, a, b, k]: [f32; 4], out: &mut [f32]) {
    match y {
        Some(y) => {
            for (((o, &xv), &gv), &yv) in out.iter_mut().zip(x).zip(g).zip(y) {
                *o = a * (relu_mask(gv, yv) + b * (xv - mu) + k);
            }
        }
        None => {
            for ((o, &xv), &gv) in out.iter_mut().zip(x).zip(g) {
                *o = a * (gv + b * (xv - mu) + k);
            }
        }
    }
}

/// Per-channel mean and biased variance, two-pass, as `[mean; var]` (length 2·C).
pub(super) fn stats<T: Elem>(x: &[T], d: Dims) -> Vec<f32> {
    let m = d.m() as f64;
    let sums = per_plane(x, d, |_, plane| {
        let mut buf = [0f32; BLK];
        plane
            .chunks(BLK)
            .map(|c| sum(block(c, &mut buf)) as f64)
            .sum::<f64>()
    });
    let mean: Vec<f32> = per_channel(&sums, d, 0.0, |a, b| a + b)
        .iter()
        .map(|s| (s / m) as f32)
        .collect();
    let sq = per_plane(x, d, |p, plane| {
        let mu = mean[p % d.c];
        let mut buf = [0f32; BLK];
        plane
            .chunks(BLK)
            .map(|c| sum_sq_dev(block(c, &mut buf), mu) as f64)
            .sum::<f64>()
    });
    let var = per_channel(&sq, d, 0.0, |a, b| a + b);
    mean.iter()
        .copied()
        .chain(var.iter().map(|s| (s / m) as f32))
        .collect()
}

/// Per-channel constants of the normalization: `y = (x - mean) * scale + beta` (three f32 per
/// channel, [`NormChannels::FLOATS`]).
pub(super) struct NormChannels {
    mean: Vec<f32>,
    scale: Vec<f32>,
    beta: Vec<f32>,
}

impl NormChannels {
    /// f32 values per channel.
    pub(super) const FLOATS: usize = 3;

    pub(super) fn new(gamma: &[f32], beta: &[f32], stats: &[f32], c: usize, eps: f32) -> Self {
        let (mean, var) = stats.split_at(c);
        let scale = gamma
            .iter()
            .zip(var)
            .map(|(&g, &v)| (g as f64 * invstd(v, eps)) as f32)
            .collect();
        Self {
            mean: mean.to_vec(),
            scale,
            beta: beta.to_vec(),
        }
    }
}

/// `1 / sqrt(var + eps)` in f64 (computed once per channel, so the precision is free).
fn invstd(var: f32, eps: f32) -> f64 {
    1.0 / (var as f64 + eps as f64).sqrt()
}

/// The normalization (+ ReLU) pass.
pub(super) fn norm<T: Elem>(x: &[T], ch: &NormChannels, d: Dims, relu: bool) -> Vec<T> {
    let mut y = T::zeros(x.len());
    let ptr = SharedMut(y.as_mut_ptr());
    for_planes(d, |r| {
        let mut buf = [0f32; BLK];
        let mut res = [0f32; BLK];
        for p in r {
            let c = p % d.c;
            let (mu, s, b) = (ch.mean[c], ch.scale[c], ch.beta[c]);
            // SAFETY: planes are disjoint ranges of y; the pool hands each plane to one worker.
            let out = unsafe { ptr.range(p * d.hw, d.hw) };
            for (xc, oc) in x[p * d.hw..(p + 1) * d.hw]
                .chunks(BLK)
                .zip(out.chunks_mut(BLK))
            {
                let xb = block(xc, &mut buf);
                let rb = &mut res[..xb.len()];
                normalize(xb, mu, s, b, relu, rb);
                T::narrow(rb, oc);
            }
        }
    });
    y
}

/// `[Σg'·x̂; Σg']` per channel from per-plane `(Σg', Σg'·(x - mean))` partials.
fn gamma_beta_grads(part: &[(f64, f64)], d: Dims, var: &[f32], eps: f32) -> Vec<f32> {
    let tot = per_channel(part, d, (0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    let grad_gamma = tot
        .iter()
        .zip(var)
        .map(|(t, &v)| (t.1 * invstd(v, eps)) as f32);
    let grad_beta = tot.iter().map(|t| t.0 as f32);
    grad_gamma.chain(grad_beta).collect()
}

/// Per-channel `[Σg'·x̂ (grad_gamma); Σg' (grad_beta)]`, where `g'` is grad_y masked by `y > 0`
/// when the ReLU is fused.
pub(super) fn bwd_reduce<T: Elem>(
    x: &[T],
    gy: &[T],
    y: &[T],
    stats: &[f32],
    d: Dims,
    eps: f32,
    relu: bool,
) -> Vec<f32> {
    let (mean, var) = stats.split_at(d.c);
    let part = per_plane(x, d, |p, xp| {
        let mu = mean[p % d.c];
        let range = p * d.hw..(p + 1) * d.hw;
        let (gp, yp) = (&gy[range.clone()], &y[range]);
        let (mut bx, mut bg, mut by) = ([0f32; BLK], [0f32; BLK], [0f32; BLK]);
        let mut acc = (0f64, 0f64);
        for start in (0..d.hw).step_by(BLK) {
            let end = (start + BLK).min(d.hw);
            let xb = block(&xp[start..end], &mut bx);
            let gb = block(&gp[start..end], &mut bg);
            let yb = if relu {
                Some(block(&yp[start..end], &mut by))
            } else {
                None
            };
            let (sg, sgx) = grad_sums(xb, gb, yb, mu);
            acc.0 += sg as f64;
            acc.1 += sgx as f64;
        }
        acc
    });
    gamma_beta_grads(&part, d, var, eps)
}

/// Per-channel constants of the input gradient:
/// `grad_x = a·(g' + b·(x - mean) + k)` with `a = gamma·invstd`, `b = -invstd·grad_gamma/M`,
/// `k = -grad_beta/M`. Written with `x - mean` (not `b·x + const`) so that a large mean does not
/// cancel away the precision.
pub(super) struct InputGradChannels {
    mean: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
    k: Vec<f32>,
}

impl InputGradChannels {
    /// f32 values per channel.
    pub(super) const FLOATS: usize = 4;

    pub(super) fn new(gamma: &[f32], stats: &[f32], sums: &[f32], d: Dims, eps: f32) -> Self {
        let (mean, var) = stats.split_at(d.c);
        let (grad_gamma, grad_beta) = sums.split_at(d.c);
        let m = d.m() as f64;
        let new = || Vec::with_capacity(d.c);
        let (mut a, mut b, mut k) = (new(), new(), new());
        for c in 0..d.c {
            let inv = invstd(var[c], eps);
            let ac = gamma[c] as f64 * inv;
            a.push(ac as f32);
            b.push((-inv * grad_gamma[c] as f64 / m) as f32);
            k.push((-(grad_beta[c] as f64) / m) as f32);
        }
        Self {
            mean: mean.to_vec(),
            a,
            b,
            k,
        }
    }
}

/// The input-gradient pass.
pub(super) fn bwd_input<T: Elem>(
    x: &[T],
    gy: &[T],
    y: &[T],
    co: &InputGradChannels,
    d: Dims,
    relu: bool,
) -> Vec<T> {
    let mut out = T::zeros(x.len());
    let ptr = SharedMut(out.as_mut_ptr());
    for_planes(d, |r| {
        let (mut bx, mut bg, mut by, mut res) =
            ([0f32; BLK], [0f32; BLK], [0f32; BLK], [0f32; BLK]);
        for p in r {
            let c = p % d.c;
            let (mu, a, b, k) = (co.mean[c], co.a[c], co.b[c], co.k[c]);
            let base = p * d.hw;
            // SAFETY: planes are disjoint ranges of out; the pool hands each plane to one worker.
            let op = unsafe { ptr.range(base, d.hw) };
            for start in (0..d.hw).step_by(BLK) {
                let end = (start + BLK).min(d.hw);
                let xb = block(&x[base + start..base + end], &mut bx);
                let gb = block(&gy[base + start..base + end], &mut bg);
                let yb = if relu {
                    Some(block(&y[base + start..base + end], &mut by))
                } else {
                    None
                };
                let rb = &mut res[..xb.len()];
                input_grad(xb, gb, yb, [mu, a, b, k], rb);
                T::narrow(rb, &mut op[start..end]);
            }
        }
    });
    out
}

// ---- The lean step's kernels: BatchNorm + ReLU (+ 2x2 max-pool) recomputed from the saved
// ---- pre-normalization tensor h, forward and backward, in place where the data allows.

/// `y(h) = relu((h - mean)·scale + beta)` of a block, rounded to T and widened back, so that a
/// recomputed ReLU output (and its mask) is bit-identical to the one the forward stored in T.
/// With `decided` (the block's [decisions](super::BnParams::decisions) for these values, from bit
/// `first`), y is the decided output: see [`decide_y`].
#[inline(always)]
fn y_of<T: Elem>(
    hb: &[f32],
    ch: &NormChannels,
    c: usize,
    decided: Option<(&[u8], usize)>,
    tmp: &mut [T],
    out: &mut [f32],
) {
    normalize(hb, ch.mean[c], ch.scale[c], ch.beta[c], true, out);
    T::round(out, tmp);
    if let Some((bits, first)) = decided {
        decide_y(out, bits, first);
    }
}

/// The least value a decided output takes where the gradient flows: 2⁻¹⁴, positive and exact in
/// f32, f16 and bf16 alike.
const DECIDED_MIN: f32 = 1.0 / 16384.0;

/// `y` made to agree with the forward's decisions (`bits`, from bit `first` on): 0 where the
/// bit is clear; where it is set, y itself, but at least [`DECIDED_MIN`]. A ReLU mask read from the
/// result (`y > 0`) and a 2x2 pool's first maximum are then the forward's, whatever rounding
/// error the values carry (a window's set bit is its only non-zero value).
/// With an and-mask rather than a branch, as [`relu_mask`]: a bit is set about half the time.
/// From a whole byte (`first` a multiple of 8, as every caller's is), eight values a byte with
/// constant shifts, a loop the compiler vectorizes.
#[inline(always)]
pub(super) fn decide_y(y: &mut [f32], bits: &[u8], first: usize) {
    let decide = |v: &mut f32, byte: u8, k: usize| {
        let keep = ((byte >> k) as u32 & 1).wrapping_neg();
        *v = f32::from_bits(v.max(DECIDED_MIN).to_bits() & keep);
    };
    if !first.is_multiple_of(8) {
        for (i, v) in y.iter_mut().enumerate() {
            let b = first + i;
            decide(v, bits[b / 8], b % 8);
        }
        return;
    }
    let bytes = &bits[first / 8..];
    let whole = y.len() / 8;
    let mut full = y.chunks_exact_mut(8);
    for (vs, &byte) in (&mut full).zip(bytes) {
        for (k, v) in vs.iter_mut().enumerate() {
            decide(v, byte, k);
        }
    }
    let tail = full.into_remainder();
    if !tail.is_empty() {
        let byte = bytes[whole];
        for (k, v) in tail.iter_mut().enumerate() {
            decide(v, byte, k);
        }
    }
}

/// Bytes of one plane's decisions: a bit per value, each plane starting on a byte.
pub(super) fn decision_bytes(hw: usize) -> usize {
    hw.div_ceil(8)
}

/// The decisions of plane `p` in `bits` (every plane's, [`decision_bytes`] each).
fn plane_bits(bits: Option<&[u8]>, p: usize, hw: usize) -> Option<&[u8]> {
    let per = decision_bytes(hw);
    bits.map(|b| &b[p * per..(p + 1) * per])
}

/// `h := relu(bn(h))`, in place; with `bits`, the decided output ([`decide_y`]).
pub(super) fn relu_in_place<T: Elem>(h: &mut [T], ch: &NormChannels, d: Dims, bits: Option<&[u8]>) {
    let ptr = SharedMut(h.as_mut_ptr());
    for_planes(d, |r| {
        let (mut buf, mut res) = ([0f32; BLK], [0f32; BLK]);
        let mut tmp = T::zeros(BLK);
        for p in r {
            let c = p % d.c;
            let pb = plane_bits(bits, p, d.hw);
            // SAFETY: planes are disjoint ranges of h; the pool hands each plane to one worker.
            let plane = unsafe { ptr.range(p * d.hw, d.hw) };
            for (k, hc) in plane.chunks_mut(BLK).enumerate() {
                let n = hc.len();
                T::widen(hc, &mut buf[..n]);
                match pb {
                    None => normalize(
                        &buf[..n],
                        ch.mean[c],
                        ch.scale[c],
                        ch.beta[c],
                        true,
                        &mut res[..n],
                    ),
                    Some(b) => y_of::<T>(
                        &buf[..n],
                        ch,
                        c,
                        Some((b, k * BLK)),
                        &mut tmp,
                        &mut res[..n],
                    ),
                }
                T::narrow(&res[..n], hc);
            }
        }
    });
}

/// `src` as f32: the data itself for f32, else widened into `buf` (as [`block`], for a plane).
fn plane_f32<'a, T: Elem>(src: &'a [T], buf: &'a mut [f32]) -> &'a [f32] {
    match T::as_acc(src) {
        Some(s) => s,
        None => {
            T::widen(src, buf);
            buf
        }
    }
}

/// One plane of `y(h)` as f32 (rounded through T) into `y`, decided by the plane's `bits` where
/// given; returns the plane of h as f32 (h itself for f32, else widened into `hf`).
fn plane_y<'a, T: Elem>(
    h: &'a [T],
    ch: &NormChannels,
    c: usize,
    bits: Option<&[u8]>,
    hf: &'a mut [f32],
    y: &mut [f32],
    tmp: &mut [T],
) -> &'a [f32] {
    let hf = plane_f32(h, hf);
    for (k, (hc, yc)) in hf.chunks(BLK).zip(y.chunks_mut(BLK)).enumerate() {
        y_of::<T>(hc, ch, c, bits.map(|b| (b, k * BLK)), tmp, yc);
    }
    hf
}

/// The 2x2 max-pool of `y(h)` (decided by `bits` where given) per plane (`w` = plane width):
/// `emit(plane, values, argmax)` with the plane's window maxima and their indices.
fn pool_planes<T: Elem>(
    h: &[T],
    ch: &NormChannels,
    d: Dims,
    w: usize,
    bits: Option<&[u8]>,
    emit: impl Fn(usize, &[f32], &[u8]) + Sync,
) {
    let per = d.hw / 4;
    for_planes(d, |r| {
        let (mut hf, mut y) = (vec![0f32; d.hw], vec![0f32; d.hw]);
        let mut arg = vec![0u8; per];
        let mut tmp = T::zeros(BLK);
        for p in r {
            plane_y::<T>(
                &h[p * d.hw..(p + 1) * d.hw],
                ch,
                p % d.c,
                plane_bits(bits, p, d.hw),
                &mut hf,
                &mut y,
                &mut tmp,
            );
            // h's f32 plane is not read again: its first quarter takes the maxima.
            let vals = &mut hf[..per];
            pool_plane(&y, w, vals, &mut arg);
            emit(p, vals, &arg);
        }
    });
}

/// One plane's 2x2 max-pool (`w` = plane width): each window's first maximum into `vals` and its
/// index (0..4, row-major in the window) into `arg`. Strictly greater replaces, so the first
/// maximum wins ties (as `crate::pool`); selects, not branches per window.
#[inline(always)]
fn pool_plane(y: &[f32], w: usize, vals: &mut [f32], arg: &mut [u8]) {
    let wo = w / 2;
    let rows = vals.chunks_exact_mut(wo).zip(arg.chunks_exact_mut(wo));
    for (oy, (vrow, arow)) in rows.enumerate() {
        let (r0, r1) = y[2 * oy * w..(2 * oy + 2) * w].split_at(w);
        for ox in 0..wo {
            let (mut k, mut v) = (0u8, r0[2 * ox]);
            for (i, x) in [r0[2 * ox + 1], r1[2 * ox], r1[2 * ox + 1]]
                .into_iter()
                .enumerate()
            {
                let more = x > v;
                k = if more { i as u8 + 1 } else { k };
                v = if more { x } else { v };
            }
            vrow[ox] = v;
            arow[ox] = k;
        }
    }
}

/// `maxpool2x2(relu(bn(h)))` without materializing the full-size ReLU output.
pub(super) fn relu_pool<T: Elem>(
    h: &[T],
    ch: &NormChannels,
    d: Dims,
    w: usize,
    bits: Option<&[u8]>,
) -> Vec<T> {
    let per = d.hw / 4;
    let mut out = T::zeros(d.planes() * per);
    let ptr = SharedMut(out.as_mut_ptr());
    pool_planes::<T>(h, ch, d, w, bits, |p, vals, _| {
        // SAFETY: each plane is written once, by the worker that owns it.
        T::narrow(vals, unsafe { ptr.range(p * per, per) });
    });
    out
}

/// The argmax (0..4, row-major in the window) of every 2x2 window of `relu(bn(h))` (a block
/// with decisions reads it from them: [`argmax_of_decisions`]).
pub(super) fn relu_pool_argmax<T: Elem>(h: &[T], ch: &NormChannels, d: Dims, w: usize) -> Vec<u8> {
    let per = d.hw / 4;
    let mut out = vec![0u8; d.planes() * per];
    let ptr = SharedMut(out.as_mut_ptr());
    pool_planes::<T>(h, ch, d, w, None, |p, _, arg| {
        // SAFETY: each plane is written once, by the worker that owns it.
        unsafe { ptr.range(p * per, per) }.copy_from_slice(arg);
    });
    out
}

/// The argmax of every 2x2 window read from a pooled block's decisions (`bits`: a set bit only at
/// a window's first positive maximum): the set bit's index, or 0 where none is (the decided
/// window is all zeros there, whose first maximum is the first value). What [`relu_pool_argmax`]
/// gives on the decided output, without reading h.
pub(super) fn argmax_of_decisions(bits: &[u8], d: Dims, w: usize) -> Vec<u8> {
    let (per, wo, pb) = (d.hw / 4, w / 2, decision_bytes(d.hw));
    let mut out = vec![0u8; d.planes() * per];
    let ptr = SharedMut(out.as_mut_ptr());
    for_planes(d, |r| {
        for p in r {
            let b = &bits[p * pb..(p + 1) * pb];
            let bit = |i: usize| (b[i / 8] >> (i % 8)) & 1;
            // SAFETY: each plane is written once, by the worker that owns it.
            let plane = unsafe { ptr.range(p * per, per) };
            for (o, k) in plane.iter_mut().enumerate() {
                let i0 = 2 * (o / wo) * w + 2 * (o % wo);
                // At most one bit is set: its index, by a sum rather than a search.
                *k = bit(i0 + 1) + 2 * bit(i0 + w) + 3 * bit(i0 + w + 1);
            }
        }
    });
    out
}

/// The block's decisions from the exact h: a bit per value of h, set where the gradient of the
/// block's output reaches it — where `y(h) > 0`, and after a 2x2 pool (`pool_w`) only at each
/// window's first maximum. Each plane starts on a byte ([`decision_bytes`]).
pub(super) fn decisions<T: Elem>(
    h: &[T],
    ch: &NormChannels,
    d: Dims,
    pool_w: Option<usize>,
) -> Vec<u8> {
    let per = decision_bytes(d.hw);
    let mut out = vec![0u8; d.planes() * per];
    let ptr = SharedMut(out.as_mut_ptr());
    let set = |p: usize, i: usize| {
        // SAFETY: each plane's bytes are written only by the worker that owns the plane.
        unsafe { ptr.range(p * per + i / 8, 1)[0] |= 1 << (i % 8) };
    };
    match pool_w {
        Some(w) => pool_planes::<T>(h, ch, d, w, None, |p, vals, arg| {
            let wo = w / 2;
            for (o, (&v, &k)) in vals.iter().zip(arg).enumerate() {
                if v > 0.0 {
                    let (oy, ox, k) = (o / wo, o % wo, k as usize);
                    set(p, (2 * oy + k / 2) * w + 2 * ox + k % 2);
                }
            }
        }),
        None => for_planes(d, |r| {
            let (mut hf, mut y) = (vec![0f32; d.hw], vec![0f32; d.hw]);
            let mut tmp = T::zeros(BLK);
            for p in r {
                let hp = &h[p * d.hw..(p + 1) * d.hw];
                plane_y::<T>(hp, ch, p % d.c, None, &mut hf, &mut y, &mut tmp);
                // SAFETY: each plane's bytes are written only by the worker that owns the plane.
                let bytes = unsafe { ptr.range(p * per, per) };
                for (byte, vs) in bytes.iter_mut().zip(y.chunks(8)) {
                    *byte = vs
                        .iter()
                        .enumerate()
                        .fold(0, |b, (k, &v)| b | (u8::from(v > 0.0) << k));
                }
            }
        }),
    }
    out
}

/// Where the upstream gradient of a pooled plane lands: `gp` scattered to each window's argmax
/// (zero elsewhere), as a dense f32 plane.
fn scatter_plane<T: Elem>(gp: &[T], am: &[u8], w: usize, out: &mut [f32]) {
    out.fill(0.0);
    let wo = w / 2;
    for (o, (&g, &k)) in gp.iter().zip(am).enumerate() {
        let (oy, ox) = (o / wo, o % wo);
        let k = k as usize & 3;
        out[(2 * oy + k / 2) * w + 2 * ox + k % 2] = g.to_f32();
    }
}

/// Per-channel `[Σg'·x̂; Σg']` of BatchNorm + ReLU (+ pool) from the saved pre-normalization h:
/// `g'` is the upstream gradient (`g`, or `gp` scattered through `argmax` when `pool_w` is
/// given) masked where the recomputed `y(h)` is 0. Summed in blocks of `BLK` (f32) and the
/// blocks in f64, like [`bwd_reduce`], so both paths agree to rounding.
#[allow(clippy::too_many_arguments)]
pub(super) fn bwd_reduce_from_h<T: Elem>(
    h: &[T],
    g: &[T],
    argmax: Option<(&[u8], usize)>,
    bits: Option<&[u8]>,
    ch: &NormChannels,
    var: &[f32],
    d: Dims,
    eps: f32,
) -> Vec<f32> {
    let per = d.hw / 4;
    let scratch = || {
        let plane = || vec![0f32; d.hw];
        (plane(), plane(), plane(), T::zeros(BLK))
    };
    let part = per_plane_with(h, d, scratch, |(hf, y, gf, tmp), p, hp| {
        let c = p % d.c;
        let hf = plane_y::<T>(hp, ch, c, plane_bits(bits, p, d.hw), hf, y, tmp);
        let gf: &[f32] = match argmax {
            Some((am, w)) => {
                scatter_plane(
                    &g[p * per..(p + 1) * per],
                    &am[p * per..(p + 1) * per],
                    w,
                    gf,
                );
                gf
            }
            None => plane_f32(&g[p * d.hw..(p + 1) * d.hw], gf),
        };
        let mut acc = (0f64, 0f64);
        for start in (0..d.hw).step_by(BLK) {
            let end = (start + BLK).min(d.hw);
            let (sg, sgx) = grad_sums(
                &hf[start..end],
                &gf[start..end],
                Some(&y[start..end]),
                ch.mean[c],
            );
            acc.0 += sg as f64;
            acc.1 += sgx as f64;
        }
        acc
    });
    gamma_beta_grads(&part, d, var, eps)
}

/// The input gradient of BatchNorm + ReLU (+ pool) from h, written over `dst`: over the
/// upstream gradient when there is no pool (`dst` = g), over h itself after a pool (`dst` = h,
/// `src` = `gp`). Each element of the result depends only on the same element of h and of
/// g', so one plane is widened into scratch before it is overwritten.
#[allow(clippy::too_many_arguments)]
pub(super) fn bwd_input_from_h<T: Elem>(
    dst: &mut [T],
    h: Option<&[T]>,
    gp_argmax: Option<(&[T], &[u8], usize)>,
    bits: Option<&[u8]>,
    ch: &NormChannels,
    co: &InputGradChannels,
    d: Dims,
) {
    let per = d.hw / 4;
    let ptr = SharedMut(dst.as_mut_ptr());
    for_planes(d, |r| {
        let (mut hf, mut y, mut gf, mut res) = (
            vec![0f32; d.hw],
            vec![0f32; d.hw],
            vec![0f32; d.hw],
            vec![0f32; d.hw],
        );
        let mut tmp = T::zeros(BLK);
        for p in r {
            let c = p % d.c;
            // SAFETY: planes are disjoint ranges of dst; the pool hands each plane to one worker.
            let out = unsafe { ptr.range(p * d.hw, d.hw) };
            let k = [co.mean[c], co.a[c], co.b[c], co.k[c]];
            let pb = plane_bits(bits, p, d.hw);
            // h and g' as f32 (read in place for f32), then the result over dst's plane.
            match (h, gp_argmax) {
                // No pool: h is a separate tensor, dst holds the upstream gradient.
                (Some(h), _) => {
                    let hv = plane_y::<T>(
                        &h[p * d.hw..(p + 1) * d.hw],
                        ch,
                        c,
                        pb,
                        &mut hf,
                        &mut y,
                        &mut tmp,
                    );
                    input_grad(hv, plane_f32(out, &mut gf), Some(&y), k, &mut res);
                }
                // After a pool: dst holds h, the gradient comes from the pooled plane.
                (None, Some((gp, am, w))) => {
                    scatter_plane(
                        &gp[p * per..(p + 1) * per],
                        &am[p * per..(p + 1) * per],
                        w,
                        &mut gf,
                    );
                    let hv = plane_y::<T>(out, ch, c, pb, &mut hf, &mut y, &mut tmp);
                    input_grad(hv, &gf, Some(&y), k, &mut res);
                }
                (None, None) => unreachable!("bwd_input_from_h needs h or the pooled gradient"),
            }
            T::narrow(&res, out);
        }
    });
}
