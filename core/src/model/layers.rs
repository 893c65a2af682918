//! Layers: the convolution of a block (standard or depthwise-separable) and BatchNorm with f32
//! master parameters. Parameters are f32 `Var`s; the forward pass casts them to the compute
//! dtype (a differentiable cast, so gradients come back in f32).

use super::init::Init;
use crate::error::Result;
use crate::options::ConvKind;
use candle_core::{DType, Device, Tensor, Var};
use memtrain_kernels::{batchnorm, conv2d, depthwise};
use std::sync::Mutex;

/// Whether the forward pass builds a graph for backward and updates BatchNorm statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Training: batch statistics; `track` builds the autograd graph; `update_stats` updates
    /// the running statistics (false when a checkpointed segment is recomputed, so each step
    /// updates them exactly once).
    Train {
        /// Build the autograd graph (parameters as variables).
        track: bool,
        /// Update BatchNorm running statistics.
        update_stats: bool,
    },
    /// Inference with running statistics, no graph.
    Eval,
}

impl Mode {
    /// The parameter as the forward pass should see it: the variable itself when tracking
    /// gradients, a detached view otherwise (no graph, so intermediates are freed as they go).
    pub(crate) fn param(&self, v: &Var) -> Tensor {
        match self {
            Mode::Train { track: true, .. } => v.as_tensor().clone(),
            _ => v.as_detached_tensor(),
        }
    }
}

/// A 3x3 convolution, dense or depthwise-separable (depthwise 3x3 + pointwise 1x1). No bias:
/// BatchNorm follows.
pub enum ConvLayer {
    /// Dense: weight [cout, cin, 3, 3].
    Standard {
        /// Weight.
        w: Var,
    },
    /// Separable: depthwise [cin, 1, 3, 3] then pointwise [cout, cin, 1, 1].
    Separable {
        /// Depthwise weight.
        dw: Var,
        /// Pointwise weight.
        pw: Var,
    },
}

fn kaiming(init: &mut Init, shape: &[usize], fan_in: usize, dev: &Device) -> Result<Var> {
    let n: usize = shape.iter().product();
    let data = init.normal(n, (2.0 / fan_in as f64).sqrt());
    Ok(Var::from_tensor(&Tensor::from_vec(data, shape, dev)?)?)
}

impl ConvLayer {
    /// A new layer with Kaiming-normal weights.
    pub fn new(
        kind: ConvKind,
        cin: usize,
        cout: usize,
        init: &mut Init,
        dev: &Device,
    ) -> Result<Self> {
        Ok(match kind {
            ConvKind::Standard => ConvLayer::Standard {
                w: kaiming(init, &[cout, cin, 3, 3], cin * 9, dev)?,
            },
            ConvKind::Separable => ConvLayer::Separable {
                dw: kaiming(init, &[cin, 1, 3, 3], 9, dev)?,
                pw: kaiming(init, &[cout, cin, 1, 1], cin, dev)?,
            },
        })
    }

    /// The layer's parameters with their names (suffixes).
    pub fn vars(&self) -> Vec<(&'static str, &Var)> {
        match self {
            ConvLayer::Standard { w } => vec![("conv.weight", w)],
            ConvLayer::Separable { dw, pw } => vec![("dw.weight", dw), ("pw.weight", pw)],
        }
    }

    /// Parameters of the layer: 1 dense, 2 separable.
    pub fn var_count(&self) -> usize {
        match self {
            ConvLayer::Standard { .. } => 1,
            ConvLayer::Separable { .. } => 2,
        }
    }

    /// Parameter `i` of the layer, in the order of [`ConvLayer::vars`].
    pub fn var(&self, i: usize) -> &Var {
        match (self, i) {
            (ConvLayer::Standard { w }, 0) => w,
            (ConvLayer::Separable { dw, .. }, 0) => dw,
            (ConvLayer::Separable { pw, .. }, 1) => pw,
            _ => panic!("a conv layer has {} parameters", self.var_count()),
        }
    }

    /// The layer's weights as `f` makes each of them (a cast, a detached view, a size).
    pub fn weights<T>(&self, f: impl Fn(&Var) -> Result<T>) -> Result<ConvWeights<T>> {
        Ok(match self {
            ConvLayer::Standard { w } => ConvWeights::Standard(f(w)?),
            ConvLayer::Separable { dw, pw } => ConvWeights::Separable {
                dw: f(dw)?,
                pw: f(pw)?,
            },
        })
    }

    /// Convolve `x` (already in the compute dtype) with stride 1, padding 1.
    pub fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let dt = x.dtype();
        self.weights(|v| Ok(mode.param(v).to_dtype(dt)?))?.forward(
            x,
            |x, w, pad| Ok(conv2d::conv2d(x, w, 1, pad)?),
            |x, w| Ok(depthwise::depthwise_conv2d(x, w, 1, 1)?),
        )
    }
}

/// A block's conv weights in the compute dtype, as tensors or as sizes.
pub enum ConvWeights<T> {
    /// Dense 3x3.
    Standard(T),
    /// Depthwise 3x3, then pointwise 1x1.
    Separable {
        /// Depthwise weight.
        dw: T,
        /// Pointwise weight.
        pw: T,
    },
}

impl<T> ConvWeights<T> {
    /// The conv of a block on `x`, written once for every way of computing it: dense 3x3 with
    /// padding 1, or depthwise 3x3 (padding 1) then pointwise 1x1. `conv2d(x, w, pad)` and
    /// `depthwise(x, w)` are the stride-1 ops.
    pub fn forward(
        &self,
        x: &T,
        conv2d: impl Fn(&T, &T, usize) -> Result<T>,
        depthwise: impl Fn(&T, &T) -> Result<T>,
    ) -> Result<T> {
        match self {
            ConvWeights::Standard(w) => conv2d(x, w, 1),
            ConvWeights::Separable { dw, pw } => conv2d(&depthwise(x, dw)?, pw, 0),
        }
    }
}

/// BatchNorm over channels with f32 affine parameters and f32 running statistics; fused with
/// the ReLU that follows it. Statistics are computed in f32 whatever the activation dtype.
pub struct BatchNorm {
    /// Scale.
    pub gamma: Var,
    /// Shift.
    pub beta: Var,
    /// Running mean (f32), updated in training mode.
    pub running_mean: Mutex<Tensor>,
    /// Running (unbiased) variance (f32).
    pub running_var: Mutex<Tensor>,
    /// Momentum of the running statistics (PyTorch's convention: new = (1-m)·old + m·batch).
    pub momentum: f64,
    /// Numerical epsilon.
    pub eps: f64,
    /// Normalize with the running statistics in training too (no batch statistics, no updates):
    /// each image's output then depends on that image alone, which makes gradient accumulation
    /// exactly equal to a large batch (used by the exactness tests, and for fine-tuning).
    pub frozen: bool,
}

impl BatchNorm {
    /// gamma = 1, beta = 0, running mean 0, running variance 1.
    pub fn new(c: usize, dev: &Device) -> Result<Self> {
        Ok(BatchNorm {
            gamma: Var::ones(c, DType::F32, dev)?,
            beta: Var::zeros(c, DType::F32, dev)?,
            running_mean: Mutex::new(Tensor::zeros(c, DType::F32, dev)?),
            running_var: Mutex::new(Tensor::ones(c, DType::F32, dev)?),
            momentum: 0.1,
            eps: 1e-5,
            frozen: false,
        })
    }

    /// BatchNorm + ReLU of `x` `[N, C, H, W]` in its dtype.
    pub(crate) fn forward_relu(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let gamma = mode.param(&self.gamma);
        let beta = mode.param(&self.beta);
        if self.frozen && mode != Mode::Eval {
            return self.forward_frozen(x, &gamma, &beta);
        }
        match mode {
            Mode::Eval => {
                let (rm, rv) = self.running();
                Ok(batchnorm::batch_norm_eval(
                    x, &gamma, &beta, &rm, &rv, self.eps, true,
                )?)
            }
            Mode::Train { update_stats, .. } => {
                let (y, mean, var) = batchnorm::batch_norm_train(x, &gamma, &beta, self.eps, true)?;
                if update_stats {
                    let (n, _, h, w) = x.dims4()?;
                    let stats = Tensor::stack(&[mean.detach(), var.detach()], 0)?;
                    self.update_running(&stats, n * h * w, false)?;
                }
                Ok(y)
            }
        }
    }

    /// The running mean and variance.
    pub(crate) fn running(&self) -> (Tensor, Tensor) {
        let rm = self.running_mean.lock().unwrap_or_else(|e| e.into_inner());
        let rv = self.running_var.lock().unwrap_or_else(|e| e.into_inner());
        (rm.clone(), rv.clone())
    }

    /// Fold batch `stats` (f32 `[2, C]`: mean, biased variance over `count` values per channel)
    /// into the running statistics ([`batchnorm::update_running`]): replacing the tensors, or
    /// writing into them when `in_place`.
    pub(crate) fn update_running(
        &self,
        stats: &Tensor,
        count: usize,
        in_place: bool,
    ) -> Result<()> {
        let mut rm = self.running_mean.lock().unwrap_or_else(|e| e.into_inner());
        let mut rv = self.running_var.lock().unwrap_or_else(|e| e.into_inner());
        let (m, v) = batchnorm::update_running(&rm, &rv, stats, count, self.momentum)?;
        if in_place {
            rm.slice_set(&m, 0, 0)?;
            rv.slice_set(&v, 0, 0)?;
        } else {
            *rm = m;
            *rv = v;
        }
        Ok(())
    }

    /// Differentiable normalization with the running statistics (plain Candle ops, in f32).
    fn forward_frozen(&self, x: &Tensor, gamma: &Tensor, beta: &Tensor) -> Result<Tensor> {
        let c = gamma.dim(0)?;
        let (rm, rv) = self.running();
        let scale = (gamma / (rv + self.eps)?.sqrt()?)?;
        let shift = (beta - (&rm * &scale)?)?;
        let y = x
            .to_dtype(DType::F32)?
            .broadcast_mul(&scale.reshape((1, c, 1, 1))?)?
            .broadcast_add(&shift.reshape((1, c, 1, 1))?)?
            .relu()?;
        Ok(y.to_dtype(x.dtype())?)
    }
}
