//! bf16 × bf16 → f32 matrix multiplication on bf16 operands with AVX-512, chosen at run time:
//! AVX512-BF16 dot products (`vdpbf16ps`) or f32 FMAs on bf16 widened in registers, with the
//! widen-to-f32 `gemm` crate path as the fallback ([`Bf16Kernel`], [`bf16_kernel`]).
//!
//! The `gemm` crate has no bf16 kernel, so without this module a bf16 convolution widens both
//! operands to f32 in memory and runs the f32 gemm: an f32 copy of every image and an f32
//! im2col matrix, twice the bytes of the bf16 data. Here the big operand stays bf16 until it is in
//! a register.
//!
//! `vdpbf16ps zmm_acc, zmm_a, zmm_b` adds, in each of its 16 f32 lanes, the two products
//! `a[2i]·b[2i] + a[2i+1]·b[2i+1]` of the lane's *pair* of bf16 values. Each product of two bf16
//! values is exact in f32 (8-bit significands), so every kernel here computes a sum of the exact
//! products in f32, as the widened f32 gemm does, in another order (tests/gemm_bf16.rs bounds the
//! difference). `vdpbf16ps` treats denormal inputs and results as zero; bf16 training values are
//! far from the denormal range, below 1.2e-38.
//!
//! # Layout
//! Both micro-kernels compute an [`MR`]×[`NR`] tile of `C += A·B` in 24 zmm accumulators
//! (`MR` rows × two 16-lane vectors), one `k` pair at a time:
//! - `B` is packed into [`PackedB`]: panels of `NR` columns; within a panel, pair `p` of rows is
//!   `NR` 32-bit words `B[2p][j] | B[2p+1][j] << 16` — the pair-interleaved ("VNNI") layout
//!   `vdpbf16ps` multiplies lane by lane. The FMA kernel reads the same words and splits each
//!   16-word vector into the f32 rows `2p` (shift left by 16) and `2p+1` (mask the low half).
//!   Columns past `n` and the row past an odd `k` are zero. A conv packs its big operand straight
//!   from im2col rows ([`PackedB::pack_row_pairs`], [`PackedB::pack_columns`]), so the pack
//!   replaces the widening and im2col copies of the f32 path rather than adding a pass.
//! - `A` (the conv's weight, or its output gradient) is row-major with `k` contiguous. The
//!   `vdpbf16ps` kernel broadcasts 32-bit pairs `(A[i][2p], A[i][2p+1])` in place (an odd `k`'s
//!   last element zero-extended); the FMA kernel widens `A` to f32 once per gemm (it is the small
//!   operand: `m·k` conversions for `m·k·n` multiply-adds) and broadcasts single floats.
//!
//! # Blocking
//! `k` is cut into blocks of [`KC`] pairs so that one panel's block of `B` (`KC · NR · 4` bytes)
//! stays in L1 while every `MR`-row tile of `A` streams past it. `MR` = 12 rather than 8 spreads
//! each `B` load (and, for the FMA kernel, its two integer ops) over more FMAs: the FMA kernel on
//! the 32→32 forward gemm went from 70–76 to 90–95 GFLOP/s (`cargo bench --bench gemm_bf16`, one
//! thread, on a loaded shared machine, so ±15%).

use candle_core::{Error, Result};
use half::bf16;

/// Rows of `C` per micro-tile (one broadcast of `A` per row and `k` pair).
pub(crate) const MR: usize = 12;

/// Columns of `C` per micro-tile: two 16-lane f32 vectors.
pub(crate) const NR: usize = 32;

/// `k` pairs per cache block: one panel's block of packed `B` is `KC · NR · 4` = 16 KiB, half of
/// a 32 KiB L1 data cache, the rest left for the `A` rows and the `C` tile.
pub const KC: usize = 128;

/// Which multiplication bf16 gemms run on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// AVX512-BF16 dot products (`vdpbf16ps`) on the packed bf16 pairs.
    Avx512Bf16,
    /// AVX-512 f32 FMAs on the same packed bf16 pairs, widened in registers (a shift and a mask
    /// per 16 pairs); `A` is widened to f32 once per gemm.
    Avx512Fma,
    /// Widen both operands to f32 and multiply with the `gemm` crate's f32 kernels.
    Widen,
}

/// The bf16 kernel this process uses, chosen once: [`Bf16Kernel::Avx512Bf16`] on an AMD CPU with
/// AVX512-BF16, [`Bf16Kernel::Avx512Fma`] on another x86-64 CPU with AVX512F,
/// [`Bf16Kernel::Widen`] elsewhere. The choice follows the CPU, never a timing, so that a
/// machine's bf16 results are the same on every run (the two kernels round differently).
///
/// On the build machine (an AMD EPYC, family 26: Zen 5) `vdpbf16ps` issues at full rate: the
/// roofline of `cargo bench --bench gemm_bf16` is 837 GFLOP/s with it against 423 with the FMA
/// kernel, and a 30-step bf16 training run (`train_cifar10 --precision bf16 --no-augment`, batch
/// 128, paired with `farm-bench`) ran at 1,392 img/s with it against 1,056 with the FMA kernel.
///
/// Why not `vdpbf16ps` on Intel: on the first development machine (a VM on an Intel Xeon, family 6
/// model 207, with AVX512-BF16), a loop of `vdpbf16ps zmm` on 16 independent accumulators issued
/// one every ~1.2 ns against ~0.3 ns for f32 `vfmadd231ps zmm` (one core), so the dot product did
/// half the multiply-adds per second of plain f32 FMAs. On the net's gemms
/// (`cargo bench --bench gemm_bf16`, one thread, three runs on a loaded machine)
/// [`Bf16Kernel::Avx512Bf16`] ran at 49–63 GFLOP/s, [`Bf16Kernel::Avx512Fma`] at 77–158 and the
/// `gemm` crate's f32 kernel on pre-widened operands at 73–162; a 24-step bf16 training run
/// (`train_cifar10 --precision bf16 --max-steps 24`, both kernels at `MR` = 8) took 18.2 s of CPU
/// with `vdpbf16ps` against 14.1 s with the FMA kernel. (PyTorch's oneDNN, which runs
/// bf16 convolutions with `vdpbf16ps` on this CPU, was no faster in bf16 than in f32 either: 62
/// against 63–85 GFLOP/s on a 32→32 forward.) Both kernels read the same packed bf16 operand.
///
/// The environment variable [`BF16_GEMM_ENV`] (read once) overrides the choice: `dpbf16` for
/// the AVX512-BF16 kernel (where the CPU has it), `fma` for the FMA kernel (where it has
/// AVX512F), `widen` for the fallback.
pub fn bf16_kernel() -> Bf16Kernel {
    static KERNEL: std::sync::OnceLock<Bf16Kernel> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| {
        let forced = std::env::var(BF16_GEMM_ENV).unwrap_or_default();
        match forced.as_str() {
            "widen" => Bf16Kernel::Widen,
            "dpbf16" if cpu_has_avx512bf16() => Bf16Kernel::Avx512Bf16,
            "fma" if cpu_has_avx512f() => Bf16Kernel::Avx512Fma,
            _ if cpu_has_avx512bf16() && cpu_is_amd() => Bf16Kernel::Avx512Bf16,
            _ if cpu_has_avx512f() => Bf16Kernel::Avx512Fma,
            _ => Bf16Kernel::Widen,
        }
    })
}

/// The environment variable that forces a bf16 kernel ([`bf16_kernel`]).
pub const BF16_GEMM_ENV: &str = "MEMTRAIN_BF16_GEMM";
/// The values [`BF16_GEMM_ENV`] takes.
pub const BF16_GEMM_KERNELS: [&str; 3] = ["dpbf16", "fma", "widen"];

/// Whether the CPU has AVX512F (what [`Bf16Kernel::Avx512Fma`] needs).
pub(crate) fn cpu_has_avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU's vendor is AMD (CPUID leaf 0: `AuthenticAMD`).
fn cpu_is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: CPUID leaf 0 exists on every x86-64 CPU.
        #[allow(unused_unsafe)]
        let r = unsafe { std::arch::x86_64::__cpuid(0) };
        let vendor = [r.ebx, r.edx, r.ecx].map(u32::to_le_bytes);
        vendor.concat() == b"AuthenticAMD"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU has the instructions the bf16 kernel uses (AVX512F, AVX512BW, AVX512-BF16),
/// whatever `MEMTRAIN_BF16_GEMM` says.
pub fn cpu_has_avx512bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A strided bf16 matrix: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    /// The elements; the view must lie inside.
    pub data: &'a [bf16],
    /// Number of rows.
    pub rows: usize,
    /// Number of columns.
    pub cols: usize,
    /// Distance between consecutive rows, in elements.
    pub rs: usize,
    /// Distance between consecutive columns, in elements.
    pub cs: usize,
}

impl MatRef<'_> {
    /// Elements the view spans from its first one.
    fn span(&self) -> usize {
        span(self.rows, self.cols, self.rs, self.cs)
    }

    fn check(&self, what: &str) -> Result<()> {
        if self.data.len() < self.span() {
            return Err(gemm_error(format!(
                "{what} ({}×{}, strides {} and {}) needs {} elements, has {}",
                self.rows,
                self.cols,
                self.rs,
                self.cs,
                self.span(),
                self.data.len()
            )));
        }
        Ok(())
    }

    fn get(&self, i: usize, j: usize) -> bf16 {
        self.data[i * self.rs + j * self.cs]
    }
}

fn span(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

fn gemm_error(msg: String) -> Error {
    Error::Msg(format!("gemm_bf16: {msg}"))
}

/// The right-hand operand of [`gemm()`], packed into the pair-interleaved panels `vdpbf16ps` reads
/// (see the module docs). The buffers are kept between packs, so a caller that reuses one
/// `PackedB` allocates only once (or never, after [`PackedB::reserve`]).
#[derive(Clone, Debug, Default)]
pub struct PackedB {
    /// `panels · kp · NR` words, panel-major.
    words: Vec<u32>,
    /// The rows (or a panel's columns) gathered before they are interleaved.
    gather: Vec<bf16>,
    k: usize,
    n: usize,
}

impl PackedB {
    /// An empty packed matrix (0×0).
    pub fn new() -> Self {
        Self::default()
    }

    /// Rows (the gemm's inner dimension `k`).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Columns.
    pub fn n(&self) -> usize {
        self.n
    }

    /// `k` pairs (an odd `k` gets a zero row).
    fn kp(&self) -> usize {
        self.k.div_ceil(2)
    }

    fn panels(&self) -> usize {
        self.n.div_ceil(NR)
    }

    /// Elements of the words (u32) and of the gather buffer (bf16) for `k × n` matrices of every
    /// `k` in `ks`, packed by rows, or by columns (`by_columns`: [`Self::pack_columns`],
    /// [`Self::pack`] of a transposed view).
    pub(super) fn lens(ks: &[usize], n: usize, by_columns: bool) -> (usize, usize) {
        let words = |k: usize| n.div_ceil(NR) * k.div_ceil(2) * NR;
        let gather = |k: usize| if by_columns { NR * gather_ld(k) } else { 2 * n };
        let max = |f: &dyn Fn(usize) -> usize| ks.iter().map(|&k| f(k)).max().unwrap_or(0);
        (max(&words), max(&gather))
    }

    /// Grows the buffers to their size for `k × n` matrices of every `k` in `ks` (by rows or
    /// `by_columns`), so that packing them allocates nothing.
    pub fn reserve(&mut self, ks: &[usize], n: usize, by_columns: bool) {
        let (words, gather) = Self::lens(ks, n, by_columns);
        self.words
            .reserve_exact(words.saturating_sub(self.words.len()));
        self.gather
            .reserve_exact(gather.saturating_sub(self.gather.len()));
    }

    /// Resizes for a `k × n` matrix; the contents are stale until every pair is written.
    fn reset(&mut self, k: usize, n: usize) {
        self.k = k;
        self.n = n;
        let len = n.div_ceil(NR) * k.div_ceil(2) * NR;
        if self.words.len() < len {
            self.words.resize(len, 0);
        }
    }

    /// Packs any strided `b` (`k × n`).
    ///
    /// # Errors
    /// When the view does not lie inside its slice.
    pub fn pack(&mut self, b: MatRef<'_>) -> Result<()> {
        b.check("B")?;
        if b.cs == 1 {
            // Rows with contiguous columns (an im2col matrix, an image, an output gradient).
            self.pack_row_pairs(b.rows, b.cols, |r, dst| {
                dst.copy_from_slice(&b.data[r * b.rs..r * b.rs + b.cols])
            });
        } else if b.rs == 1 {
            self.pack_transposed(b.rows, b.cols, b.data, b.cs);
        } else {
            self.pack_row_pairs(b.rows, b.cols, |r, dst| {
                for (j, d) in dst.iter_mut().enumerate() {
                    *d = b.get(r, j);
                }
            });
        }
        Ok(())
    }

    /// Packs a `k × n` matrix given row by row: `row(r, dst)` writes row `r` (`n` values) into
    /// `dst`. Rows are produced two at a time into a small scratch that stays in L1, so an im2col
    /// can feed the pack directly without materializing its column matrix.
    pub fn pack_row_pairs(&mut self, k: usize, n: usize, mut row: impl FnMut(usize, &mut [bf16])) {
        self.reset(k, n);
        if k == 0 || n == 0 {
            return;
        }
        let kp = self.kp();
        if self.gather.len() < 2 * n {
            self.gather.resize(2 * n, bf16::ZERO);
        }
        let pair = &mut self.gather[..2 * n];
        for p in 0..kp {
            let (lo, hi) = pair.split_at_mut(n);
            row(2 * p, lo);
            if 2 * p + 1 < k {
                row(2 * p + 1, hi);
            } else {
                hi.fill(bf16::ZERO);
            }
            interleave_pair(lo, hi, &mut self.words, p, kp);
        }
    }

    /// Packs `B = Sᵀ` where `S` is `n × k` row-major with row stride `ld` (`B[r][j] = s[j·ld + r]`).
    fn pack_transposed(&mut self, k: usize, n: usize, s: &[bf16], ld: usize) {
        self.pack_columns(k, n, |j, dst| dst.copy_from_slice(&s[j * ld..j * ld + k]));
    }

    /// Packs a `k × n` matrix given column by column: `column(j, dst)` writes column `j`
    /// (`k` values) into `dst`. Each word is two neighbours of one column, so this is a transpose
    /// of 32-bit words; the weight gradient feeds it im2col rows (`B = colᵀ`) without
    /// materializing the column matrix.
    ///
    /// A panel's `NR` columns are gathered first and then written pair by pair, so each cache
    /// line of the panel is written once; scattering each column straight into the panel
    /// (a word every `NR · 4` bytes) made this pack a fifth as long as the gemm it feeds in
    /// a profile of the training step.
    pub fn pack_columns(&mut self, k: usize, n: usize, mut column: impl FnMut(usize, &mut [bf16])) {
        self.reset(k, n);
        if k == 0 || n == 0 {
            return;
        }
        let kp = self.kp();
        let full = k / 2;
        let (ld, panels) = (gather_ld(k), self.panels());
        if self.gather.len() < NR * ld {
            self.gather.resize(NR * ld, bf16::ZERO);
        }
        let cols = &mut self.gather[..NR * ld];
        for jp in 0..panels {
            let width = (n - jp * NR).min(NR);
            for jj in 0..width {
                let dst = &mut cols[jj * ld..jj * ld + k];
                column(jp * NR + jj, dst);
                if full < kp {
                    cols[jj * ld + k] = bf16::ZERO;
                }
            }
            let panel = &mut self.words[jp * kp * NR..(jp + 1) * kp * NR];
            // Whole 16×16 blocks of words are transposed in registers (a full panel on an
            // AVX512F CPU); the rest word by word.
            let mut done = 0;
            #[cfg(target_arch = "x86_64")]
            if width == NR && cpu_has_avx512f() {
                done = kp / 16 * 16;
                // SAFETY: AVX512F is present; `cols` holds NR columns of `ld >= 2·kp` values
                // and `panel` kp·NR words, so every block of `done` lies inside both.
                unsafe { avx512::transpose_words(cols, ld, done, panel) };
            }
            for (p, dst) in panel.chunks_exact_mut(NR).enumerate().skip(done) {
                for (jj, d) in dst[..width].iter_mut().enumerate() {
                    let at = jj * ld + 2 * p;
                    *d = word(cols[at], cols[at + 1]);
                }
                dst[width..].fill(0);
            }
        }
    }
}

/// Column stride of [`PackedB::pack_columns`]'s gather buffer for `k` rows: even (whole words),
/// and not a multiple of 2 KiB, so the NR columns read side by side do not share L1 sets.
fn gather_ld(k: usize) -> usize {
    let ld = 2 * k.div_ceil(2);
    ld + if (ld * 2).is_multiple_of(2048) { 32 } else { 0 }
}

/// One packed word: `lo` in the low half (the even row of the pair), `hi` in the high half.
fn word(lo: bf16, hi: bf16) -> u32 {
    u32::from(lo.to_bits()) | (u32::from(hi.to_bits()) << 16)
}

/// Writes pair `p` of rows (`lo`, `hi`, `n` values each) into every panel of `words`.
fn interleave_pair(lo: &[bf16], hi: &[bf16], words: &mut [u32], p: usize, kp: usize) {
    #[cfg(target_arch = "x86_64")]
    if cpu_has_avx512f() {
        // SAFETY: the CPU has AVX512F, the only requirement of the wrapper.
        unsafe { avx512::interleave_pair(lo, hi, words, p, kp) };
        return;
    }
    interleave_pair_body(lo, hi, words, p, kp);
}

/// The body of [`interleave_pair`], inlined into a copy compiled with AVX-512 (the crate's
/// baseline target has only SSE2, and this loop vectorizes: widen, shift, or).
#[inline(always)]
fn interleave_pair_body(lo: &[bf16], hi: &[bf16], words: &mut [u32], p: usize, kp: usize) {
    let n = lo.len();
    for (jp, (l, h)) in lo.chunks(NR).zip(hi.chunks(NR)).enumerate() {
        let dst = &mut words[(jp * kp + p) * NR..(jp * kp + p + 1) * NR];
        for ((d, &a), &b) in dst.iter_mut().zip(l).zip(h) {
            *d = word(a, b);
        }
        dst[l.len()..].fill(0);
    }
    debug_assert!(n.div_ceil(NR) * kp * NR <= words.len());
}

/// `dst = A·B`, or `dst += A·B` with `accumulate`, on the calling thread: `A` is `m × k` bf16,
/// `B` the packed `k × n`, `dst` row-major f32 with row stride `dst_rs`. Sums are f32.
///
/// `A` must have contiguous columns (`a.cs == 1`): its pairs are broadcast in place. Uses the
/// AVX512-BF16 kernel when [`bf16_kernel`] says so, otherwise widens to f32 (the `gemm` crate).
///
/// # Errors
/// When the shapes do not match (`a.cols != b.k()`), `a.cs != 1`, or a view does not lie inside
/// its slice.
pub fn gemm(
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: MatRef<'_>,
    b: &PackedB,
) -> Result<()> {
    gemm_with(bf16_kernel(), dst, dst_rs, accumulate, a, b)
}

/// Whether this CPU can run `kernel` ([`Bf16Kernel::Widen`] runs everywhere).
pub fn kernel_supported(kernel: Bf16Kernel) -> bool {
    match kernel {
        Bf16Kernel::Avx512Bf16 => cpu_has_avx512bf16(),
        Bf16Kernel::Avx512Fma => cpu_has_avx512f(),
        Bf16Kernel::Widen => true,
    }
}

/// [`gemm()`] on a given kernel instead of the process's choice (for tests and benchmarks).
///
/// # Errors
/// As [`gemm()`], and when this CPU cannot run `kernel` ([`kernel_supported`]).
pub fn gemm_with(
    kernel: Bf16Kernel,
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: MatRef<'_>,
    b: &PackedB,
) -> Result<()> {
    gemm_prepared(
        dst,
        dst_rs,
        accumulate,
        &PreparedA::with_kernel(kernel, a)?,
        b,
    )
}

/// The left operand `A` of gemms that share it, prepared once for a kernel: a conv multiplies
/// its weight (or the weight's transpose) by every image's packed columns, and the FMA kernel
/// would otherwise widen the same weight to f32 once per image (2–3% of a bf16 training step in
/// a profile, mostly on the last stage, whose images are 8×8 pixels).
///
/// For [`Bf16Kernel::Avx512Fma`] it holds `A` widened to f32 in the thread's reusable buffer
/// (taken on creation, given back on drop, so a steady stream of gemms allocates nothing) or in
/// the caller's ([`PreparedA::with_buffer`]); the other kernels read `A` as it is.
pub struct PreparedA<'a> {
    a: MatRef<'a>,
    kernel: Bf16Kernel,
    /// `A` in f32 with row stride `lda` (the FMA kernel only; empty otherwise).
    wide: Vec<f32>,
    lda: usize,
    /// Whether `wide` is the thread's buffer (given back on drop).
    lent: bool,
}

impl<'a> PreparedA<'a> {
    /// `a` prepared for `kernel`.
    ///
    /// # Errors
    /// When this CPU cannot run `kernel`, `A`'s columns are not contiguous (`a.cs != 1`, with
    /// more than one row and column), or the view does not lie inside its slice.
    pub fn with_kernel(kernel: Bf16Kernel, a: MatRef<'a>) -> Result<Self> {
        Self::prepare(kernel, a, None)
    }

    /// `a` prepared for the process's kernel, widened (by the FMA kernel) into `buf` rather
    /// than the thread's buffer, so that a caller who sized `buf` (`m × a_stride(k)` f32) knows
    /// what the gemms allocate: nothing. [`PreparedA::into_buffer`] gives `buf` back.
    ///
    /// # Errors
    /// As [`PreparedA::with_kernel`].
    pub fn with_buffer(a: MatRef<'a>, buf: Vec<f32>) -> Result<Self> {
        Self::prepare(bf16_kernel(), a, Some(buf))
    }

    /// The buffer of [`PreparedA::with_buffer`] (empty for the other kernels).
    pub fn into_buffer(mut self) -> Vec<f32> {
        std::mem::take(&mut self.wide)
    }

    fn prepare(kernel: Bf16Kernel, a: MatRef<'a>, buf: Option<Vec<f32>>) -> Result<Self> {
        if !kernel_supported(kernel) {
            return Err(gemm_error(format!(
                "this CPU cannot run the {kernel:?} kernel"
            )));
        }
        if a.cs != 1 && a.rows > 0 && a.cols > 1 {
            return Err(gemm_error(format!(
                "A needs contiguous columns (column stride {})",
                a.cs
            )));
        }
        a.check("A")?;
        let lent = buf.is_none();
        let mut prepared = PreparedA {
            a,
            kernel,
            wide: buf.unwrap_or_default(),
            lda: 0,
            lent,
        };
        if kernel == Bf16Kernel::Avx512Fma && a.rows > 0 {
            if lent {
                prepared.wide = A_F32.with(|buf| std::mem::take(&mut *buf.borrow_mut()));
            }
            prepared.lda = widen_a(a, &mut prepared.wide);
        }
        Ok(prepared)
    }
}

impl Drop for PreparedA<'_> {
    fn drop(&mut self) {
        if self.lent && self.wide.capacity() > 0 {
            let wide = std::mem::take(&mut self.wide);
            // Keep the bigger buffer when two were alive on this thread at once.
            A_F32.with(|buf| {
                let mut buf = buf.borrow_mut();
                if buf.capacity() < wide.capacity() {
                    *buf = wide;
                }
            });
        }
    }
}

/// `dst = A·B` (or `+=` with `accumulate`) with an `A` prepared once for many products.
///
/// # Errors
/// When the shapes do not match (`a.cols != b.k()`) or `dst` is too small.
pub fn gemm_prepared(
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: &PreparedA<'_>,
    b: &PackedB,
) -> Result<()> {
    let (m, k, n) = (a.a.rows, a.a.cols, b.n());
    if k != b.k() {
        return Err(gemm_error(format!("A is {m}×{k} but B is {}×{n}", b.k())));
    }
    if n > 0 && m > 0 && (dst_rs < n || dst.len() < span(m, n, dst_rs, 1)) {
        return Err(gemm_error(format!(
            "destination ({} elements, row stride {dst_rs}) is too small for {m}×{n}",
            dst.len()
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    match a.kernel {
        #[cfg(target_arch = "x86_64")]
        Bf16Kernel::Avx512Bf16 => {
            // SAFETY: the CPU has the kernel's features (checked when `a` was prepared); the
            // shapes and spans were checked there and above, which is what `gemm_avx512`
            // requires.
            unsafe { avx512::gemm_avx512(dst, dst_rs, accumulate, a.a, b) };
        }
        #[cfg(target_arch = "x86_64")]
        Bf16Kernel::Avx512Fma => {
            // SAFETY: the CPU has AVX512F (checked when `a` was prepared); `a.wide` holds m
            // rows of k f32 with row stride `lda >= k`, and the shapes and spans of `b` and
            // `dst` were checked above, which is what `gemm_fma` requires.
            unsafe { avx512::gemm_fma(dst, dst_rs, accumulate, &a.wide, a.lda, m, b) };
        }
        _ => gemm_widen_packed(dst, dst_rs, accumulate, a.a, b),
    }
    Ok(())
}

thread_local! {
    /// `A` widened to f32 for [`Bf16Kernel::Avx512Fma`], reused by every gemm on the thread
    /// (lent to one [`PreparedA`] at a time).
    static A_F32: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `A` widened into `buf` (row-major, `k` contiguous); returns the row stride. Rows 2 KiB apart
/// get 16 floats of padding, so that the micro-kernel's `MR` broadcast streams do not all map
/// to the same L1 sets (as `conv2d`'s `padded_ld` does for column matrices).
fn widen_a(a: MatRef<'_>, buf: &mut Vec<f32>) -> usize {
    #[cfg(target_arch = "x86_64")]
    if cpu_has_avx512f() {
        // SAFETY: the CPU has AVX512F, the only requirement of the wrapper.
        return unsafe { avx512::widen_a(a, buf) };
    }
    widen_a_body(a, buf)
}

/// Row stride of `A` with `k` columns widened for [`Bf16Kernel::Avx512Fma`] (see [`widen_a`]).
pub(super) fn a_stride(k: usize) -> usize {
    if k > 0 && (k * 4).is_multiple_of(2048) {
        k + 16
    } else {
        k.max(1)
    }
}

/// The body of [`widen_a`] (vectorizes when inlined into an AVX-512 function).
#[inline(always)]
fn widen_a_body(a: MatRef<'_>, buf: &mut Vec<f32>) -> usize {
    let (m, k) = (a.rows, a.cols);
    let lda = a_stride(k);
    if buf.len() < m * lda {
        // Exactly this size (no amortized growth), as a caller's buffer is sized.
        buf.reserve_exact(m * lda - buf.len());
        buf.resize(m * lda, 0.0);
    }
    for i in 0..m {
        let src = &a.data[i * a.rs..i * a.rs + k];
        let dst = &mut buf[i * lda..i * lda + k];
        for (d, s) in dst.iter_mut().zip(src) {
            // bf16 → f32 is exact: the bf16 bits are the f32's high half.
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    lda
}

/// The fallback of [`gemm`] on packed `B`: unpack and widen both operands to f32, then the `gemm`
/// crate's f32 kernel.
fn gemm_widen_packed(dst: &mut [f32], dst_rs: usize, accumulate: bool, a: MatRef<'_>, b: &PackedB) {
    let (k, n, kp) = (b.k, b.n, b.kp());
    let mut bw = vec![0f32; k * n];
    for r in 0..k {
        for j in 0..n {
            let w = b.words[((j / NR) * kp + r / 2) * NR + j % NR];
            let bits = if r % 2 == 0 {
                w as u16
            } else {
                (w >> 16) as u16
            };
            bw[r * n + j] = bf16::from_bits(bits).to_f32();
        }
    }
    gemm_widen_f32(dst, dst_rs, accumulate, a, &bw, n);
}

/// `dst (+)= A·B` with both operands widened to f32 and the `gemm` crate's f32 kernel: the
/// reference the bf16 kernel is tested against, and the fallback on CPUs without AVX512-BF16.
///
/// # Errors
/// When the shapes do not match or a view does not lie inside its slice.
pub fn gemm_widened(
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: MatRef<'_>,
    b: MatRef<'_>,
) -> Result<()> {
    if a.cols != b.rows {
        return Err(gemm_error(format!(
            "A is {}×{} but B is {}×{}",
            a.rows, a.cols, b.rows, b.cols
        )));
    }
    a.check("A")?;
    b.check("B")?;
    let (m, n) = (a.rows, b.cols);
    if n > 0 && m > 0 && (dst_rs < n || dst.len() < span(m, n, dst_rs, 1)) {
        return Err(gemm_error(format!(
            "destination ({} elements, row stride {dst_rs}) is too small for {m}×{n}",
            dst.len()
        )));
    }
    let mut bw = vec![0f32; b.rows * n];
    for (r, dst) in bw.chunks_exact_mut(n.max(1)).enumerate().take(b.rows) {
        widen_row(b, r, dst);
    }
    gemm_widen_f32(dst, dst_rs, accumulate, a, &bw, n);
    Ok(())
}

/// Row `r` of `m` widened into `dst` (`m.cols` values): a slice conversion when the row is
/// contiguous, as `conv2d`'s fallback widens its images.
fn widen_row(m: MatRef<'_>, r: usize, dst: &mut [f32]) {
    if m.cs == 1 {
        super::bf16_convert::widen(&m.data[r * m.rs..r * m.rs + m.cols], dst);
    } else {
        for (j, d) in dst.iter_mut().enumerate() {
            *d = m.get(r, j).to_f32();
        }
    }
}

/// `dst (+)= widen(A) · bw` where `bw` is row-major `k × n` f32; shapes already checked.
fn gemm_widen_f32(
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: MatRef<'_>,
    bw: &[f32],
    n: usize,
) {
    let (m, k) = (a.rows, a.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                dst[i * dst_rs..i * dst_rs + n].fill(0.0);
            }
        }
        return;
    }
    let mut aw = vec![0f32; m * k];
    for (i, dst) in aw.chunks_exact_mut(k).enumerate() {
        widen_row(a, i, dst);
    }
    assert!(bw.len() >= k * n && dst.len() >= span(m, n, dst_rs, 1));
    // SAFETY: `aw` is m×k and `bw` k×n row-major (sizes by construction), `dst` spans m×n with
    // row stride `dst_rs` (asserted), and `dst` is a distinct `&mut`, so nothing aliases.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            aw.as_ptr(),
            1,
            k as isize,
            bw.as_ptr(),
            1,
            n as isize,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512;
