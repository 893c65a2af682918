//! An activation stored as 8-, 4- or 2-bit codes with a range per group (lossy).
//!
//! A training step that keeps a layer's output for its backward can keep fewer bytes by storing
//! each element as a code of [`Width::bits`] bits: for a group g of elements,
//! `q = round((x − lo_g) / scale_g)` with `lo_g` the group's minimum and
//! `scale_g = (hi_g − lo_g) / (2^bits − 1)`, and the backward reads `x̃ = lo_g + q · scale_g`.
//! This is ActNN's idea (Chen et al., ICML 2021); [`Width`] is every choice it makes:
//!
//! - [`Width::Int8`]: a range per channel over the whole batch, rounding to nearest (within half
//!   a step; deterministic).
//! - [`Width::Int4`], [`Width::Int2`]: a range per group of [`GROUP`] consecutive values of one
//!   plane (one image's channel; a plane of fewer values is one group, a plane's last group may be
//!   shorter), two or four codes to a byte (each plane starts on a byte, and so does each group),
//!   and stochastic rounding: `q = ⌊(x − lo)/scale + u⌋`
//!   with u uniform in [0, 1), so `E[x̃] = x` and the error is below one step. The noise is
//!   ChaCha8 ([`rand_chacha`]), one stream per plane, keyed by the caller's `salt` and the
//!   activation's ranges: the same activation with the same salt gives the same codes (a run
//!   repeats bit for bit, a recomputed segment gets the codes its first forward would have), no
//!   generator is shared with anything else, and each step, micro-batch and layer draws anew.
//!
//! On the CPU each direction is one pass per plane on Candle's thread pool (two for [`quantize`]:
//! the ranges, then the codes), computed in f32 whatever the activation dtype. On other devices
//! a range per channel (int8) runs the same arithmetic as Candle ops, over chunks of images (its
//! f32 transients a few [`OPS_CHUNK_BYTES`] chunks, not copies of the activation), and ranges per
//! group (int4, int2) run the CPU passes on a host copy and
//! uploads the result: either way the codes are the CPU's, bit for bit (`tests/quantize.rs`).

use std::hash::{DefaultHasher, Hash, Hasher};

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Result, Shape, Tensor};

use candle_core::backend::BackendStorage;
use candle_core::WithDType;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::util::{cpu_slice, dispatch_float, for_planes, Float, SharedMut};

/// The name of the ops in errors.
const OP: &str = "quantize";

/// How an activation is coded: the bits of a code and what follows from them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Width {
    /// 8 bits, a range per channel, rounding to nearest.
    Int8,
    /// 4 bits, a range per group of a plane, stochastic rounding.
    Int4,
    /// 2 bits, a range per group of a plane, stochastic rounding.
    Int2,
}

impl Width {
    /// Every width, widest first.
    pub const ALL: [Width; 3] = [Width::Int8, Width::Int4, Width::Int2];

    /// Bits of one code.
    pub const fn bits(self) -> usize {
        match self {
            Width::Int8 => 8,
            Width::Int4 => 4,
            Width::Int2 => 2,
        }
    }

    /// Codes packed into a byte.
    pub const fn per_byte(self) -> usize {
        8 / self.bits()
    }

    /// The highest code, `2^bits − 1`.
    const fn max_code(self) -> u8 {
        ((1u16 << self.bits()) - 1) as u8
    }

    /// Whether each group of [`GROUP`] values of a plane (one image's channel) has a range of its
    /// own, and codes are rounded stochastically; else a channel's range spans the batch and codes
    /// round to nearest. Below eight bits a batch-wide range leaves too few levels for most
    /// planes, and rounding to nearest would bias every value the same way.
    pub const fn per_group(self) -> bool {
        !matches!(self, Width::Int8)
    }

    /// Ranges per plane of `hw` values: its groups, or none of its own (a range per channel).
    const fn plane_groups(self, hw: usize) -> usize {
        if self.per_group() {
            hw.div_ceil(GROUP)
        } else {
            0
        }
    }

    /// The codes' shape for an activation `[N, C, H, W]`: `[N, C, ⌈H·W / per_byte⌉]`.
    pub fn codes_dims(self, [n, c, h, w]: [usize; 4]) -> [usize; 3] {
        [n, c, (h * w).div_ceil(self.per_byte())]
    }

    /// The ranges' shape (f32): row 0 the offsets, row 1 the steps; `[2, C]`, or
    /// `[2, N·C·⌈H·W / GROUP⌉]` with a range per group.
    pub fn ranges_dims(self, [n, c, h, w]: [usize; 4]) -> [usize; 2] {
        [
            2,
            if self.per_group() {
                n * c * self.plane_groups(h * w)
            } else {
                c
            },
        ]
    }

    /// Bytes held for an activation of `dims`: the codes and the ranges.
    pub fn bytes(self, dims: [usize; 4]) -> usize {
        self.codes_dims(dims).iter().product::<usize>()
            + self.ranges_dims(dims).iter().product::<usize>() * 4
    }
}

/// Values of a plane per range below eight bits: ActNN's group. Stage 1's planes here hold
/// 1,024 values, so its ranges follow the plane's content four times more closely; a multiple of
/// every [`Width::per_byte`], so each group starts on a byte.
pub const GROUP: usize = 256;

/// An activation as codes: what [`quantize`] returns and [`dequantize`] reads.
#[derive(Debug, Clone)]
pub struct Quantized {
    /// The codes, u8 [`Width::codes_dims`].
    pub codes: Tensor,
    /// Per group: row 0 the offset `lo`, row 1 the step `scale` (f32 [`Width::ranges_dims`]).
    pub ranges: Tensor,
    /// Bits per code.
    pub width: Width,
    /// The activation's shape `[N, C, H, W]`.
    pub dims: [usize; 4],
    /// The dtype [`dequantize`] returns (the activation's).
    pub dtype: DType,
}

impl Quantized {
    /// Bytes held: the codes and the ranges.
    pub fn bytes(&self) -> usize {
        self.codes.elem_count() + self.ranges.elem_count() * 4
    }
}

/// Stores `x` `[N, C, H, W]` (f32, f16 or bf16) as `width` codes; `salt` keys stochastic
/// rounding's noise (with the activation's ranges). No autograd.
pub fn quantize(x: &Tensor, width: Width, salt: u64) -> Result<Quantized> {
    let (n, c, h, w) = x.dims4().map_err(|_| {
        candle_core::Error::Msg(format!("{OP}: expects [N, C, H, W], got {:?}", x.dims()))
    })?;
    let dtype = x.dtype();
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        candle_core::bail!("{OP}: unsupported dtype {dtype:?} (f32, f16 or bf16 only)")
    }
    let dims = [n, c, h, w];
    let x = x.contiguous()?;
    if !x.device().is_cpu() {
        if !width.per_group() {
            return quantize_ops(&x, dims, ops_chunk_images(dims));
        }
        let q = quantize(&x.to_device(&Device::Cpu)?, width, salt)?;
        return Ok(Quantized {
            codes: q.codes.to_device(x.device())?,
            ranges: q.ranges.to_device(x.device())?,
            ..q
        });
    }
    let ranges = x.apply_op1_no_bwd(&Ranges { width })?;
    let codes = x.apply_op2_no_bwd(&ranges, &Encode { width, salt })?;
    Ok(Quantized {
        codes,
        ranges,
        width,
        dims,
        dtype,
    })
}

/// The activation back from its codes, in the dtype it was stored from; no autograd.
pub fn dequantize(q: &Quantized) -> Result<Tensor> {
    let codes = q.codes.contiguous()?;
    let device = codes.device().clone();
    if !device.is_cpu() {
        if !q.width.per_group() {
            return dequantize_ops(q, &codes, ops_chunk_images(q.dims));
        }
        let host = Quantized {
            codes: codes.to_device(&Device::Cpu)?,
            ranges: q.ranges.to_device(&Device::Cpu)?,
            ..q.clone()
        };
        return dequantize(&host)?.to_device(&device);
    }
    decode_cpu(&codes, q, 0..q.dims[0])
}

/// Images `first..first + len` of the activation back from its codes, into a new tensor
/// `[len, C, H, W]` of the dtype they were stored from; no autograd. On the CPU only those images
/// are decoded (a backward that streams over chunks of images holds one chunk, not the
/// activation); elsewhere the whole activation is decoded and narrowed.
pub fn dequantize_images(q: &Quantized, first: usize, len: usize) -> Result<Tensor> {
    if first + len > q.dims[0] {
        candle_core::bail!(
            "{OP}: images {first}..{} of a batch of {}",
            first + len,
            q.dims[0]
        )
    }
    let codes = q.codes.contiguous()?;
    if !codes.device().is_cpu() {
        return dequantize(q)?.narrow(0, first, len)?.contiguous();
    }
    decode_cpu(&codes, q, first..first + len)
}

/// The CPU's decoding of `images` of `q` from its (contiguous) `codes`.
fn decode_cpu(codes: &Tensor, q: &Quantized, images: std::ops::Range<usize>) -> Result<Tensor> {
    let op = Decode {
        width: q.width,
        dims: q.dims,
        dtype: q.dtype,
        images,
    };
    codes.apply_op2_no_bwd(&q.ranges, &op)
}

/// f32 bytes the Candle-ops path ([`quantize`] and [`dequantize`] of int8 off the CPU) widens at a
/// time: it works through the batch in chunks of whole images of at most this many f32 bytes, so
/// that its transients are a few such chunks rather than a few f32 copies of the activation.
pub const OPS_CHUNK_BYTES: usize = 4 << 20;

/// Images per chunk of the Candle-ops path for an activation of `dims`: as many as fit in
/// [`OPS_CHUNK_BYTES`] of f32, at least one.
pub fn ops_chunk_images([n, c, h, w]: [usize; 4]) -> usize {
    (OPS_CHUNK_BYTES / (c * h * w * 4).max(1)).clamp(1, n.max(1))
}

/// The most bytes the Candle-ops path holds at once besides its operands and its result (for a
/// memory estimate): three f32 chunks in [`quantize`] (an intermediate, its successor and the
/// clamp's own), two in [`dequantize`].
pub fn ops_transient_bytes(dims: [usize; 4], quantize: bool) -> u64 {
    let [n, c, h, w] = dims;
    let chunk = (ops_chunk_images(dims).min(n) * c * h * w * 4) as u64;
    if quantize {
        3 * chunk
    } else {
        2 * chunk
    }
}

/// The first image and the number of images of each chunk of the Candle-ops path.
fn chunks(dims: [usize; 4], images: usize) -> impl Iterator<Item = (usize, usize)> {
    let n = dims[0];
    (0..n)
        .step_by(images.max(1))
        .map(move |s| (s, images.min(n - s)))
}

/// [`quantize`] with a range per channel (int8) as Candle ops, for devices without the CPU
/// kernels, over chunks of `images` images (see [`OPS_CHUNK_BYTES`]): the CPU's arithmetic,
/// operation for operation, so the codes are the CPU's bit for bit (the reductions skip NaN as
/// `f32::min` does; [`lo_scale`] on `[C]` tensors; a true division for the step, not Candle's
/// `Tensor / f64`, which multiplies by the reciprocal; the clamp's `maximum` maps NaN to 0 as
/// `as u8` does).
fn quantize_ops(x: &Tensor, dims: [usize; 4], images: usize) -> Result<Quantized> {
    let [_, c, h, w] = dims;
    let levels = Width::Int8.max_code() as f64;
    let widen = |s: usize, len: usize| x.narrow(0, s, len)?.to_dtype(DType::F32);
    let mut range: Option<(Tensor, Tensor)> = None;
    for (s, len) in chunks(dims, images) {
        let xc = widen(s, len)?;
        let lo = xc.min_keepdim(3)?.min_keepdim(2)?.min_keepdim(0)?;
        let hi = xc.max_keepdim(3)?.max_keepdim(2)?.max_keepdim(0)?;
        range = Some(match range {
            None => (lo, hi),
            Some((l, h)) => (l.minimum(&lo)?, h.maximum(&hi)?),
        });
    }
    let (min, max) = range.ok_or_else(|| candle_core::Error::Msg(format!("{OP}: empty batch")))?;
    let zeros = min.zeros_like()?;
    let finite = |t: &Tensor| t.abs()?.lt(f32::INFINITY);
    let lo = finite(&min)?.where_cond(&min, &zeros)?;
    let step = (&max - &lo)?
        .maximum(0f32)?
        .broadcast_div(&Tensor::new(levels as f32, x.device())?)?;
    let scale = finite(&max)?.where_cond(&step, &zeros)?;
    // A constant channel, or one holding an infinity, has scale 0: every code is 0 and decodes
    // to lo.
    let inv = scale.gt(0.0)?.where_cond(&scale.recip()?, &zeros)?;
    let ranges = Tensor::stack(&[lo.reshape(c)?, scale.reshape(c)?], 0)?;
    let codes = Tensor::zeros(Width::Int8.codes_dims(dims).to_vec(), DType::U8, x.device())?;
    for (s, len) in chunks(dims, images) {
        // One intermediate at a time (each statement drops what it no longer needs).
        let mut t = widen(s, len)?.broadcast_sub(&lo)?;
        t = t.broadcast_mul(&inv)?;
        t = t.round()?;
        t = t.clamp(0.0, levels)?;
        let q = t.to_dtype(DType::U8)?.reshape((len, c, h * w))?;
        drop(t);
        codes.slice_set(&q, 0, s)?;
    }
    Ok(Quantized {
        codes,
        ranges,
        width: Width::Int8,
        dims,
        dtype: x.dtype(),
    })
}

/// [`dequantize`] of a range per channel (int8) as Candle ops, over chunks of `images` images.
fn dequantize_ops(q: &Quantized, codes: &Tensor, images: usize) -> Result<Tensor> {
    let [_, c, h, w] = q.dims;
    let lo = q.ranges.get(0)?.reshape((1, (), 1, 1))?;
    let scale = q.ranges.get(1)?.reshape((1, (), 1, 1))?;
    let out = Tensor::zeros(q.dims.to_vec(), q.dtype, codes.device())?;
    for (s, len) in chunks(q.dims, images) {
        let mut t = codes
            .narrow(0, s, len)?
            .reshape((len, c, h, w))?
            .to_dtype(DType::F32)?;
        t = t.broadcast_mul(&scale)?;
        t = t.broadcast_add(&lo)?;
        out.slice_set(&t.to_dtype(q.dtype)?, 0, s)?;
    }
    Ok(out)
}

/// `(n, c, h·w)` of a contiguous `[N, C, H, W]` layout.
fn nchw(l: &Layout) -> Result<(usize, usize, usize)> {
    let (n, c, h, w) = l.shape().dims4()?;
    Ok((n, c, h * w))
}

/// The ranges of an activation.
struct Ranges {
    width: Width,
}
/// The codes of an activation from its ranges.
struct Encode {
    width: Width,
    salt: u64,
}
/// The activation (its `images`) from its codes and ranges.
struct Decode {
    width: Width,
    dims: [usize; 4],
    dtype: DType,
    images: std::ops::Range<usize>,
}

/// A plane's `(min, max)`, folded into `init`.
fn min_max<T: Float>(plane: &[T], init: (f32, f32)) -> (f32, f32) {
    plane
        .iter()
        .fold(init, |(lo, hi), v| (lo.min(v.to_f32()), hi.max(v.to_f32())))
}

/// `(lo, scale)` of a group from its `(min, max)`: an empty or all-NaN group (no finite range)
/// is stored as zeros.
fn lo_scale((l, h): (f32, f32), width: Width) -> (f32, f32) {
    let lo = if l.is_finite() { l } else { 0.0 };
    let scale = if h.is_finite() {
        (h - lo).max(0.0) / width.max_code() as f32
    } else {
        0.0
    };
    (lo, scale)
}

/// Per channel `(min, max)` over every plane of that channel, then `[lo; scale]` (`[2, C]`).
fn channel_ranges<T: Float>(x: &[T], n: usize, c: usize, hw: usize, width: Width) -> Vec<f32> {
    let mut part = vec![(f32::INFINITY, f32::NEG_INFINITY); n * c];
    let ptr = SharedMut(part.as_mut_ptr());
    for_planes(n * c, hw, |r| {
        // SAFETY: the pool hands out disjoint plane ranges within 0..n·c.
        let out = unsafe { ptr.range(r.start, r.len()) };
        for (p, slot) in r.zip(out.iter_mut()) {
            *slot = min_max(&x[p * hw..(p + 1) * hw], *slot);
        }
    });
    let mut lo = vec![f32::INFINITY; c];
    let mut hi = vec![f32::NEG_INFINITY; c];
    for (p, &(l, h)) in part.iter().enumerate() {
        lo[p % c] = lo[p % c].min(l);
        hi[p % c] = hi[p % c].max(h);
    }
    let (lo, scale): (Vec<f32>, Vec<f32>) = lo
        .into_iter()
        .zip(hi)
        .map(|range| lo_scale(range, width))
        .unzip();
    lo.into_iter().chain(scale).collect()
}

/// Per group of each plane `[lo; scale]` (`[2, N·C·groups]`), written straight into the result.
fn group_ranges<T: Float>(x: &[T], planes: usize, hw: usize, width: Width) -> Vec<f32> {
    let groups = width.plane_groups(hw);
    let all = planes * groups;
    let mut r = vec![0f32; 2 * all];
    let ptr = SharedMut(r.as_mut_ptr());
    for_planes(planes, hw, |range| {
        for p in range {
            let plane = &x[p * hw..(p + 1) * hw];
            for (i, g) in plane.chunks(GROUP).enumerate() {
                let (lo, scale) = lo_scale(min_max(g, (f32::INFINITY, f32::NEG_INFINITY)), width);
                let at = p * groups + i;
                // SAFETY: plane p's slots are written by the one worker that got it.
                unsafe {
                    ptr.range(at, 1)[0] = lo;
                    ptr.range(all + at, 1)[0] = scale;
                }
            }
        }
    });
    r
}

/// The key of stochastic rounding's noise: the caller's salt and every range, bit for bit.
fn noise_seed(salt: u64, ranges: &[f32]) -> u64 {
    let mut h = DefaultHasher::new();
    salt.hash(&mut h);
    for r in ranges {
        r.to_bits().hash(&mut h);
    }
    h.finish()
}

/// The column of group `i` of plane `p` (of `c` channels) in the ranges, planes having `groups`
/// groups each: its channel's where `groups` is 0 (a range per channel), else its own.
fn range_of(p: usize, i: usize, c: usize, groups: usize) -> usize {
    if groups == 0 {
        p % c
    } else {
        p * groups + i
    }
}

/// The codes of `x`, each plane from its group's `[lo; scale]` in `r`, packed from the low bits up.
fn encode<T: Float>(x: &[T], r: &[f32], (n, c, hw): (usize, usize, usize), e: &Encode) -> Vec<u8> {
    let width = e.width;
    let (bits, per, max) = (width.bits(), width.per_byte(), width.max_code());
    let packed = hw.div_ceil(per);
    let columns = r.len() / 2;
    let groups = width.plane_groups(hw);
    // A range per channel covers the plane at once.
    let group_len = if groups == 0 { hw } else { GROUP };
    let seed = noise_seed(e.salt, r);
    let mut codes = vec![0u8; n * c * packed];
    let ptr = SharedMut(codes.as_mut_ptr());
    for_planes(n * c, hw, |planes| {
        // A group's draws and codes, made once per worker: zeroing them per group would cost a
        // memset as long as the work.
        let (mut draws, mut q) = ([0u32; GROUP], [0u8; GROUP]);
        for p in planes {
            let mut noise = width.per_group().then(|| {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream(p as u64);
                rng
            });
            // SAFETY: each plane's bytes are written by the one worker that got it.
            let plane_out = unsafe { ptr.range(p * packed, packed) };
            let plane_x = &x[p * hw..(p + 1) * hw];
            let group_bytes = group_len / per;
            for (i, (plane, out)) in plane_x
                .chunks(group_len)
                .zip(plane_out.chunks_mut(group_bytes.max(1)))
                .enumerate()
            {
                let g = range_of(p, i, c, groups);
                let (lo, scale) = (r[g], r[columns + g]);
                let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                match &mut noise {
                    // Ranges per channel (int8): one code a byte, rounded to nearest, a loop
                    // the compiler vectorizes.
                    None => {
                        debug_assert_eq!(per, 1, "ranges per channel are int8's");
                        for (byte, v) in out.iter_mut().zip(plane) {
                            // `as u8` saturates (and maps NaN to 0): with the `min`, the clamp.
                            *byte = (((v.to_f32() - lo) * inv).round() as u8).min(max);
                        }
                    }
                    // Stochastic rounding: the group's noise drawn at once (the numbers a draw
                    // per value would give, in the same order), then a loop the compiler
                    // vectorizes, then the codes packed.
                    Some(rng) => {
                        let len = plane.len();
                        rng.fill(&mut draws[..len]);
                        for ((q, &u), v) in q.iter_mut().zip(&draws[..len]).zip(plane) {
                            let t = (v.to_f32() - lo) * inv;
                            *q = ((t + uniform(u)) as u8).min(max);
                        }
                        pack(&q[..len], out, bits);
                    }
                }
            }
        }
    });
    codes
}

/// A uniform draw in [0, 1) from 32 random bits: the top 24 bits times 2⁻²⁴, as `rand`'s
/// `random::<f32>()` makes it from the same word.
#[inline(always)]
fn uniform(u: u32) -> f32 {
    (u >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// `codes` of `bits` bits each packed into `out`, from the low bits of each byte up.
#[inline(always)]
fn pack(codes: &[u8], out: &mut [u8], bits: usize) {
    let per = 8 / bits;
    for (byte, cs) in out.iter_mut().zip(codes.chunks(per)) {
        *byte = cs
            .iter()
            .enumerate()
            .fold(0, |b, (k, &c)| b | (c << (k * bits)));
    }
}

/// The activation from its codes, each plane from its group's `[lo; scale]` in `r`.
fn decode<T: Float<Acc = f32>>(
    codes: &[u8],
    r: &[f32],
    (c, hw): (usize, usize),
    images: std::ops::Range<usize>,
    width: Width,
) -> Vec<T> {
    let packed = hw.div_ceil(width.per_byte());
    let columns = r.len() / 2;
    let groups = width.plane_groups(hw);
    let group_len = if groups == 0 { hw } else { GROUP };
    let group_bytes = (group_len / width.per_byte()).max(1);
    let first = images.start * c;
    let mut x = T::zeros(images.len() * c * hw);
    let ptr = SharedMut(x.as_mut_ptr());
    for_planes(images.len() * c, hw, |planes| {
        // f32 scratch of a block, made once per worker (see `decode_plane`).
        let mut buf = [0f32; GROUP];
        for out_p in planes {
            let p = first + out_p;
            let plane_codes = &codes[p * packed..(p + 1) * packed];
            // SAFETY: each plane is written by the one worker that got it.
            let plane_out = unsafe { ptr.range(out_p * hw, hw) };
            let parts = plane_codes
                .chunks(group_bytes)
                .zip(plane_out.chunks_mut(group_len));
            for (i, (codes, out)) in parts.enumerate() {
                let g = range_of(p, i, c, groups);
                let (lo, scale) = (r[g], r[columns + g]);
                match width {
                    Width::Int8 => decode_plane::<8, T>(codes, out, lo, scale, &mut buf),
                    Width::Int4 => decode_plane::<4, T>(codes, out, lo, scale, &mut buf),
                    Width::Int2 => decode_plane::<2, T>(codes, out, lo, scale, &mut buf),
                }
            }
        }
    });
    x
}

/// One group's values `lo + q · scale` from its `BITS`-bit codes, packed low bits first: in f32
/// straight into f32 output, else a block at a time into f32 (`buf`) and narrowed to T in one
/// vectorized conversion (rounding to nearest even, as a value's own conversion does).
fn decode_plane<const BITS: usize, T: Float<Acc = f32>>(
    plane: &[u8],
    out: &mut [T],
    lo: f32,
    scale: f32,
    buf: &mut [f32; GROUP],
) {
    if let Some(out) = T::as_acc_mut(out) {
        return decode_f32::<BITS>(plane, out, lo, scale);
    }
    let block_bytes = GROUP * BITS / 8;
    for (codes, out) in plane.chunks(block_bytes).zip(out.chunks_mut(GROUP)) {
        let b = &mut buf[..out.len()];
        decode_f32::<BITS>(codes, b, lo, scale);
        T::narrow(b, out);
    }
}

/// [`decode_plane`] in f32: the width a constant, so that unpacking a byte is shifts and masks,
/// not a division per value.
#[inline(always)]
fn decode_f32<const BITS: usize>(plane: &[u8], out: &mut [f32], lo: f32, scale: f32) {
    let per = 8 / BITS;
    let max = ((1u16 << BITS) - 1) as u8;
    let value = |b: u8, k: usize| lo + ((b >> (k * BITS)) & max) as f32 * scale;
    let mut full = out.chunks_exact_mut(per);
    for (vs, &b) in (&mut full).zip(plane) {
        for (k, v) in vs.iter_mut().enumerate() {
            *v = value(b, k);
        }
    }
    let tail = full.into_remainder();
    if let Some(&b) = plane
        .get(plane.len().wrapping_sub(1))
        .filter(|_| !tail.is_empty())
    {
        for (k, v) in tail.iter_mut().enumerate() {
            *v = value(b, k);
        }
    }
}

/// The ranges operand: f32 [`Width::ranges_dims`] of an activation of `dims`.
fn ranges_operand<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    width: Width,
    dims: [usize; 4],
) -> Result<&'a [f32]> {
    let want = width.ranges_dims(dims);
    if l.shape().dims() != want {
        candle_core::bail!("{OP}: ranges must be {want:?}, got {:?}", l.shape())
    }
    cpu_slice(s, l, OP, "ranges")
}

impl CustomOp1 for Ranges {
    fn name(&self) -> &'static str {
        "quantize-ranges"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, c, hw) = nchw(l)?;
        let w = self.width;
        let r = dispatch_float!(
            s.dtype(),
            [F32, F16, BF16],
            |T| {
                let x = cpu_slice::<T>(s, l, OP, "input")?;
                if w.per_group() {
                    group_ranges(x, n * c, hw, w)
                } else {
                    channel_ranges(x, n, c, hw, w)
                }
            },
            |dt| candle_core::bail!("{OP}: unsupported dtype {dt:?}")
        );
        let groups = r.len() / 2;
        Ok((CpuStorage::F32(r), Shape::from((2, groups))))
    }
}

impl CustomOp2 for Encode {
    fn name(&self) -> &'static str {
        "quantize-encode"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        rs: &CpuStorage,
        rl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = l.shape().dims4()?;
        let dims = [dims.0, dims.1, dims.2, dims.3];
        let r = ranges_operand(rs, rl, self.width, dims)?;
        let codes = dispatch_float!(
            s.dtype(),
            [F32, F16, BF16],
            |T| encode::<T>(cpu_slice(s, l, OP, "input")?, r, nchw(l)?, self),
            |dt| candle_core::bail!("{OP}: unsupported dtype {dt:?}")
        );
        Ok((
            CpuStorage::U8(codes),
            Shape::from(self.width.codes_dims(dims).to_vec()),
        ))
    }
}

impl CustomOp2 for Decode {
    fn name(&self) -> &'static str {
        "dequantize"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        rs: &CpuStorage,
        rl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let want = self.width.codes_dims(self.dims);
        if l.shape().dims() != want {
            candle_core::bail!("{OP}: codes must be {want:?}, got {:?}", l.shape())
        }
        let r = ranges_operand(rs, rl, self.width, self.dims)?;
        let codes = cpu_slice::<u8>(s, l, OP, "codes")?;
        let [_, c, h, w] = self.dims;
        let images = self.images.clone();
        let len = images.len();
        let out = dispatch_float!(
            self.dtype,
            [F32, F16, BF16],
            |T| T::to_cpu_storage_owned(decode::<T>(codes, r, (c, h * w), images, self.width)),
            |dt| candle_core::bail!("{OP}: unsupported dtype {dt:?}")
        );
        Ok((out, Shape::from((len, c, h, w))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_candle_ops_path_gives_the_cpu_kernels_codes_in_any_chunking() -> Result<()> {
        // Random channels, a channel of exact ties, one holding +inf and one -inf, a constant one.
        let (n, c, h, w) = (7, 5, 3, 4);
        let mut v = Tensor::randn(0f32, 3.0, (n, c, h, w), &Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        for i in 0..n {
            for j in 0..h * w {
                let at = |ch: usize| (i * c + ch) * h * w + j;
                v[at(1)] = if j == 0 {
                    0.0
                } else {
                    ((i * 12 + j) % 254) as f32 + 0.5
                };
                v[at(4)] = -0.75;
            }
        }
        v[(3 * c + 2) * h * w + 5] = f32::INFINITY;
        v[(5 * c + 3) * h * w + 1] = f32::NEG_INFINITY;
        let x = Tensor::from_vec(v, (n, c, h, w), &Device::Cpu)?;
        let dims = [n, c, h, w];
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let x = x.to_dtype(dt)?;
            let kernels = quantize(&x, Width::Int8, 0)?;
            let want = dequantize(&kernels)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            for images in [1, 3, n] {
                let ops = quantize_ops(&x, dims, images)?;
                let what = format!("{dt:?}, {images} images a chunk");
                assert_eq!(
                    ops.ranges.to_vec2::<f32>()?,
                    kernels.ranges.to_vec2::<f32>()?,
                    "{what}"
                );
                assert_eq!(
                    ops.codes.flatten_all()?.to_vec1::<u8>()?,
                    kernels.codes.flatten_all()?.to_vec1::<u8>()?,
                    "{what}"
                );
                let got = dequantize_ops(&ops, &ops.codes, images)?;
                assert_eq!(got.dtype(), dt);
                let got = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{what}");
            }
        }
        Ok(())
    }

    #[test]
    fn the_ops_path_works_in_chunks_of_whole_images_within_the_budget() {
        // Default net's first stage at batch 512: 128 KiB of f32 an image, 32 images a chunk.
        assert_eq!(ops_chunk_images([512, 32, 32, 32]), 32);
        assert_eq!(
            ops_transient_bytes([512, 32, 32, 32], true),
            3 * OPS_CHUNK_BYTES as u64
        );
        assert_eq!(
            ops_transient_bytes([512, 32, 32, 32], false),
            2 * OPS_CHUNK_BYTES as u64
        );
        // A batch smaller than a chunk is one chunk; an image larger than the budget is one.
        assert_eq!(ops_chunk_images([4, 8, 8, 8]), 4);
        assert_eq!(ops_transient_bytes([4, 8, 8, 8], false), 2 * 4 * 8 * 64 * 4);
        assert_eq!(ops_chunk_images([2, 2048, 32, 32]), 1);
        let starts: Vec<_> = chunks([7, 1, 1, 1], 3).collect();
        assert_eq!(starts, [(0, 3), (3, 3), (6, 1)]);
    }

    /// `[values of group g]` of `x` `[N, C, H, W]` for `width`'s groups (channels or planes).
    fn groups(x: &Tensor, width: Width) -> Result<Vec<Vec<f32>>> {
        let x = x.to_dtype(DType::F32)?;
        Ok(if width.per_group() {
            let planes: Vec<Vec<f32>> = x.flatten_from(2)?.flatten_to(1)?.to_vec2()?;
            planes
                .iter()
                .flat_map(|p| p.chunks(GROUP).map(<[f32]>::to_vec))
                .collect()
        } else {
            x.transpose(0, 1)?.flatten_from(1)?.to_vec2()?
        })
    }

    #[test]
    fn every_element_is_within_a_step_and_the_extremes_are_exact() -> Result<()> {
        // 5×5 planes: the last byte of an int4 or int2 plane is partly padding. 18×18 planes: two
        // groups of a plane below eight bits, the second of 68 values.
        for dims in [[3, 4, 5, 5], [2, 3, 18, 18]] {
            let x = Tensor::randn(0f32, 2.0, dims.to_vec(), &Device::Cpu)?;
            for width in Width::ALL {
                let q = quantize(&x, width, 7)?;
                assert_eq!(q.codes.dtype(), DType::U8);
                assert_eq!(q.codes.dims(), width.codes_dims(dims));
                assert_eq!(q.bytes(), width.bytes(dims));
                let planes = dims[0] * dims[1];
                let ranges = if width.per_group() {
                    planes * (dims[2] * dims[3]).div_ceil(GROUP)
                } else {
                    dims[1]
                };
                assert_eq!(q.ranges.dims(), [2, ranges], "{width:?} {dims:?}");
                let back = dequantize(&q)?;
                assert_eq!(back.dims(), x.dims());
                let scale = q.ranges.get(1)?.to_vec1::<f32>()?;
                // Round to nearest: half a step; stochastic: under one.
                let bound = if width.per_group() { 1.0 } else { 0.5 };
                let (xs, bs) = (groups(&x, width)?, groups(&back, width)?);
                assert_eq!(xs.len(), scale.len(), "{width:?}");
                for ((xg, bg), s) in xs.iter().zip(&bs).zip(&scale) {
                    let lo = xg.iter().copied().fold(f32::INFINITY, f32::min);
                    let hi = xg.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let levels = width.max_code() as f32;
                    assert!((s - (hi - lo) / levels).abs() <= 1e-6 * hi.abs().max(1.0));
                    for (a, b) in xg.iter().zip(bg) {
                        assert!(
                            (a - b).abs() <= s * bound + 1e-5,
                            "{width:?}: {a} vs {b}, step {s}"
                        );
                    }
                    let blo = bg.iter().copied().fold(f32::INFINITY, f32::min);
                    let bhi = bg.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    assert_eq!(blo, lo, "{width:?}");
                    assert!((bhi - hi).abs() <= 1e-5 * hi.abs().max(1.0), "{width:?}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn stochastic_rounding_is_unbiased() -> Result<()> {
        // The mean of K decodings (salts 0..K) is x within a few standard errors: a step's
        // rounding has variance at most scale²/4. Rounding down or to nearest would miss.
        const K: usize = 400;
        let x = Tensor::randn(0f32, 1.0, (2, 3, 8, 8), &Device::Cpu)?;
        for width in [Width::Int4, Width::Int2] {
            let xs = x.flatten_all()?.to_vec1::<f32>()?;
            let mut sum = vec![0f64; xs.len()];
            let mut scale = Vec::new();
            for salt in 0..K as u64 {
                let q = quantize(&x, width, salt)?;
                scale = q.ranges.get(1)?.to_vec1::<f32>()?;
                let back = dequantize(&q)?.flatten_all()?.to_vec1::<f32>()?;
                for (s, b) in sum.iter_mut().zip(back) {
                    *s += b as f64;
                }
            }
            let mut signed = 0f64;
            for (i, (s, &v)) in sum.iter().zip(&xs).enumerate() {
                let err = s / K as f64 - v as f64;
                let step = scale[i / 64] as f64;
                let se = step / 2.0 / (K as f64).sqrt();
                assert!(
                    err.abs() <= 6.0 * se,
                    "{width:?} element {i}: bias {err}, step {step}"
                );
                signed += err / step;
            }
            // The mean bias over 384 elements, in steps: within 6 standard errors of 0.
            let mean = signed / xs.len() as f64;
            let se = 0.5 / ((K * xs.len()) as f64).sqrt();
            assert!(mean.abs() <= 6.0 * se, "{width:?}: mean bias {mean} steps");
        }
        Ok(())
    }

    #[test]
    fn the_same_activation_and_salt_give_the_same_codes_and_another_salt_others() -> Result<()> {
        let x = Tensor::randn(0f32, 1.0, (4, 8, 16, 16), &Device::Cpu)?;
        for width in [Width::Int4, Width::Int2] {
            let codes = |salt| -> Result<Vec<u8>> {
                quantize(&x, width, salt)?
                    .codes
                    .flatten_all()?
                    .to_vec1::<u8>()
            };
            let a = codes(3)?;
            assert_eq!(a, codes(3)?, "{width:?}");
            let b = codes(4)?;
            let differ = a.iter().zip(&b).filter(|(a, b)| a != b).count();
            assert!(
                differ * 4 > a.len(),
                "{width:?}: {differ} of {} bytes differ",
                a.len()
            );
        }
        Ok(())
    }

    #[test]
    fn codes_are_packed_from_the_low_bits_and_planes_start_on_a_byte() -> Result<()> {
        // One image, one channel of 5 values 0, 1, 2, 3, 3 (range 0..3): int2 codes are the
        // values themselves whatever the noise (each is exactly a level).
        let x = Tensor::new(&[0f32, 1.0, 2.0, 3.0, 3.0], &Device::Cpu)?.reshape((1, 1, 1, 5))?;
        let q = quantize(&x, Width::Int2, 0)?;
        let codes = q.codes.flatten_all()?.to_vec1::<u8>()?;
        assert_eq!(codes, [0b11_10_01_00, 0b00_00_00_11]);
        // The last byte holds one value (a tail shorter than a byte's four).
        let back = dequantize(&q)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(back, [0.0, 1.0, 2.0, 3.0, 3.0]);
        // Two planes of 3 values, each its own range 0..15: int4 gives each plane two bytes.
        let v = [0f32, 15.0, 15.0, 15.0, 0.0, 0.0];
        let x = Tensor::new(&v, &Device::Cpu)?.reshape((2, 1, 1, 3))?;
        let q = quantize(&x, Width::Int4, 0)?;
        let codes = q.codes.flatten_all()?.to_vec1::<u8>()?;
        assert_eq!(codes, [0xF0, 0x0F, 0x0F, 0x00]);
        assert_eq!(dequantize(&q)?.flatten_all()?.to_vec1::<f32>()?, v);
        Ok(())
    }

    #[test]
    fn decoding_is_lo_plus_code_times_step_for_every_value() {
        // Planes of 35 values (a tail of 1 for int4, 3 for int2) with arbitrary bytes and ranges,
        // against the formula written out value by value.
        let (planes, hw) = (3usize, 35usize);
        let r: Vec<f32> = vec![-1.5, 0.25, 2.0, 0.125, 0.5, 3.0];
        for width in Width::ALL {
            let (bits, per) = (width.bits(), width.per_byte());
            let packed = hw.div_ceil(per);
            let codes: Vec<u8> = (0..planes * packed).map(|i| (i * 37 + 11) as u8).collect();
            let got = decode::<f32>(&codes, &r, (planes, hw), 0..1, width);
            for p in 0..planes {
                for i in 0..hw {
                    let q = (codes[p * packed + i / per] >> ((i % per) * bits)) & width.max_code();
                    let want = r[p] + q as f32 * r[planes + p];
                    assert_eq!(got[p * hw + i], want, "{width:?} plane {p} value {i}");
                }
            }
        }
    }

    #[test]
    fn a_constant_group_decodes_to_its_value_in_every_dtype_and_width() -> Result<()> {
        for width in Width::ALL {
            for dt in [DType::F32, DType::F16, DType::BF16] {
                let x = Tensor::full(1.5f32, (2, 2, 3, 3), &Device::Cpu)?.to_dtype(dt)?;
                let q = quantize(&x, width, 1)?;
                let back = dequantize(&q)?;
                assert_eq!(back.dtype(), dt);
                let v = back.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                assert!(v.iter().all(|&v| v == 1.5), "{width:?} {dt:?}: {v:?}");
            }
        }
        Ok(())
    }
}
