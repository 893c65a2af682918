//! The shapes of the convolution ops, validated once in their public functions and carried by
//! their passes: [`Geom`] for `conv2d` (shared by its CPU, bf16, im2col-CUDA and cuDNN halves,
//! which import it from here rather than from the dispatcher in `conv2d.rs`), [`ConvPass`] for
//! the three passes both convolutions have (with what their ops share: operand checks, names,
//! [`conv_backward`]), and [`window`], the checks of a square kernel over a padded input that
//! `conv2d` and `depthwise` share.

use candle_core::{CustomOp2, Error, Layout, Result, Shape, Tensor};

use super::util::expect_dims;

/// The three passes of a convolution op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvPass {
    /// `(x, w) -> y`
    Forward,
    /// `(dy, w) -> dx`
    InputGrad,
    /// `(x, dy) -> dw`
    WeightGrad,
}

impl ConvPass {
    /// Of a convolution's tensors `x`, `w` and `y` (anything per tensor: a shape, a name), the
    /// two this pass reads, in its operand order.
    pub(super) fn operands<T>(self, x: T, w: T, y: T) -> [T; 2] {
        match self {
            ConvPass::Forward => [x, w],
            ConvPass::InputGrad => [y, w],
            ConvPass::WeightGrad => [x, y],
        }
    }

    /// Of `x`, `w` and `y`, the one this pass produces.
    pub(super) fn result<T>(self, x: T, w: T, y: T) -> T {
        match self {
            ConvPass::Forward => y,
            ConvPass::InputGrad => x,
            ConvPass::WeightGrad => w,
        }
    }

    /// The op name of this pass, of `[forward, input gradient, weight gradient]`.
    pub(super) fn name(self, names: [&'static str; 3]) -> &'static str {
        let [forward, input_grad, weight_grad] = names;
        match self {
            ConvPass::Forward => forward,
            ConvPass::InputGrad => input_grad,
            ConvPass::WeightGrad => weight_grad,
        }
    }

    /// Checks that a pass's operands (layouts `l1`, `l2`) have the shapes `want` its geometry
    /// was validated with, each with its name for the error of op `op`.
    pub(super) fn check(
        op: &str,
        want: [(&[usize], &str); 2],
        l1: &Layout,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        expect_dims(op, want[0].1, l1.dims(), want[0].0)?;
        expect_dims(op, want[1].1, l2.dims(), want[1].0)
    }
}

/// The backward of a convolution's forward op (`pass`, named `name`), shared by `conv2d` and
/// `depthwise`: the input gradient only for an `x` that tracks ops (an untracked input, such as
/// the data batch entering the first layer, never leads back to a variable: skipping it saves an
/// input-sized buffer and a kernel per step), the weight gradient always or, with
/// `weight_if_tracked`, likewise only for a tracked `w`; `op(pass)` is the op of a gradient pass.
pub(super) fn conv_backward<O: CustomOp2>(
    pass: ConvPass,
    name: &'static str,
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    weight_if_tracked: bool,
    op: impl Fn(ConvPass) -> O,
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
    // The gradient passes are applied without backward; only the forward has one.
    if pass != ConvPass::Forward {
        return Err(candle_core::Error::BackwardNotSupported { op: name });
    }
    // Upstream gradients are often broadcasts or transposed views (e.g. of a sum); the kernels
    // want plain NCHW.
    let grad = grad.contiguous()?;
    let grad_x = if x.track_op() {
        Some(grad.apply_op2_no_bwd(w, &op(ConvPass::InputGrad))?)
    } else {
        None
    };
    let grad_w = if !weight_if_tracked || w.track_op() {
        Some(x.apply_op2_no_bwd(&grad, &op(ConvPass::WeightGrad))?)
    } else {
        None
    };
    Ok((grad_x, grad_w))
}

/// The one error constructor for invalid `conv2d` arguments: they are shape errors in the model,
/// which the rest of the crate reports as Candle errors.
pub(super) fn shape_error(msg: String) -> Error {
    Error::Msg(format!("conv2d: {msg}"))
}

/// The kernel size and the output height and width of a `kh`×`kw` kernel sliding with `stride`
/// over an `h`×`w` input padded by `pad` zeros on every side, once the kernel is checked to be
/// square, at least 1×1 and no larger than the padded input, and the stride at least 1.
pub(super) fn window(
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    stride: usize,
    pad: usize,
) -> std::result::Result<(usize, usize, usize), String> {
    if kh != kw {
        return Err(format!("kernel must be square, got {kh}x{kw}"));
    }
    if kh == 0 {
        return Err("kernel size must be at least 1".to_string());
    }
    if stride == 0 {
        return Err("stride must be at least 1".to_string());
    }
    let (ph, pw) = (h + 2 * pad, w + 2 * pad);
    if kh > ph || kh > pw {
        return Err(format!(
            "kernel {kh}x{kh} is larger than the padded input {ph}x{pw} (input {h}x{w}, padding {pad})"
        ));
    }
    Ok((kh, (ph - kh) / stride + 1, (pw - kh) / stride + 1))
}

/// The shape of one `conv2d`, validated once in the wrapper and carried by all three passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Geom {
    pub(super) n: usize,
    pub(super) cin: usize,
    pub(super) h: usize,
    pub(super) w: usize,
    pub(super) cout: usize,
    pub(super) k: usize,
    pub(super) stride: usize,
    pub(super) pad: usize,
    pub(super) ho: usize,
    pub(super) wo: usize,
    /// Images per weight-gradient chunk forced by `conv2d_with_chunk` (on CUDA: per chunk of
    /// every pass).
    pub(super) chunk: Option<usize>,
}

impl Geom {
    pub(super) fn new(
        x: &[usize],
        w: &[usize],
        stride: usize,
        pad: usize,
        chunk: Option<usize>,
    ) -> Result<Self> {
        let &[n, cin, h, wd] = x else {
            return Err(shape_error(format!(
                "input must be 4D [N, Cin, H, W], got {x:?}"
            )));
        };
        let &[cout, cin_w, kh, kw] = w else {
            return Err(shape_error(format!(
                "weight must be 4D [Cout, Cin, K, K], got {w:?}"
            )));
        };
        if cin != cin_w {
            return Err(shape_error(format!(
                "input has {cin} channels but the weight {w:?} expects {cin_w}"
            )));
        }
        let (k, ho, wo) = window(h, wd, kh, kw, stride, pad).map_err(shape_error)?;
        Ok(Self {
            n,
            cin,
            h,
            w: wd,
            cout,
            k,
            stride,
            pad,
            ho,
            wo,
            chunk,
        })
    }

    /// Rows of the column matrix (and columns of the flattened weight).
    pub(super) fn ckk(&self) -> usize {
        self.cin * self.k * self.k
    }

    pub(super) fn in_image(&self) -> usize {
        self.cin * self.h * self.w
    }

    pub(super) fn hw_out(&self) -> usize {
        self.ho * self.wo
    }

    pub(super) fn out_image(&self) -> usize {
        self.cout * self.hw_out()
    }

    /// A 1×1 unstrided unpadded convolution: the image itself is the column matrix.
    pub(super) fn pointwise(&self) -> bool {
        self.k == 1 && self.stride == 1 && self.pad == 0
    }

    pub(super) fn x_shape(&self) -> Shape {
        Shape::from((self.n, self.cin, self.h, self.w))
    }

    pub(super) fn w_shape(&self) -> Shape {
        Shape::from((self.cout, self.cin, self.k, self.k))
    }

    pub(super) fn out_shape(&self) -> Shape {
        Shape::from((self.n, self.cout, self.ho, self.wo))
    }

    /// The shapes of `pass`'s two operands, each with its name for error messages.
    pub(super) fn operands(&self, pass: ConvPass) -> [(Shape, &'static str); 2] {
        pass.operands(
            (self.x_shape(), "input"),
            (self.w_shape(), "weight"),
            (self.out_shape(), "output gradient"),
        )
    }

    /// The shape of `pass`'s result.
    pub(super) fn result_shape(&self, pass: ConvPass) -> Shape {
        pass.result(self.x_shape(), self.w_shape(), self.out_shape())
    }

    /// Elements of `pass`'s result.
    // Used by the CUDA halves, and by the CPU tests of the im2col op's chunk driver.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn result_len(&self, pass: ConvPass) -> usize {
        self.result_shape(pass).elem_count()
    }

    /// Outputs `o` along one axis whose input position `o·stride + kx − pad` falls inside
    /// `0..in_len`, as a range (empty when kernel tap `kx` only ever sees padding).
    pub(super) fn valid(&self, kx: usize, in_len: usize, out_len: usize) -> (usize, usize) {
        let (s, p) = (self.stride, self.pad);
        let lo = if kx >= p { 0 } else { (p - kx).div_ceil(s) };
        let hi = if in_len + p <= kx {
            0
        } else {
            ((in_len + p - kx - 1) / s + 1).min(out_len)
        };
        (lo.min(hi), hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_ranges_match_brute_force() {
        for (k, s, p, len) in [
            (3, 1, 1, 5),
            (3, 2, 1, 6),
            (3, 2, 0, 7),
            (1, 2, 0, 4),
            (5, 3, 2, 3),
        ] {
            let g = Geom::new(&[1, 1, len, len], &[1, 1, k, k], s, p, None).unwrap();
            for kx in 0..k {
                let (lo, hi) = g.valid(kx, len, g.wo);
                for o in 0..g.wo {
                    let pos = (o * s + kx) as isize - p as isize;
                    let inside = pos >= 0 && pos < len as isize;
                    assert_eq!(
                        inside,
                        (lo..hi).contains(&o),
                        "k{k} s{s} p{p} len{len} kx{kx} o{o}"
                    );
                }
            }
        }
    }
}
