//! What the tape ([`super::tape`]) computes with: every op it calls, behind one trait, so that the
//! one description of the step runs in two ways.
//!
//! - [`CandleOps`]: Candle tensors on the model's device and memtrain's kernels — training.
//! - the application's `predict::sizing`: tensors that are only a shape and a byte count, each
//!   op allocating its result and its scratch as the kernel does — the memory estimate, which so
//!   reads the step instead of copying it. A tensor's bytes are freed when its last handle is dropped, so the
//!   tape's own `drop`s and moves are the estimate's frees.
//!
//! The trait is the list of ops, nothing more: the order of work, what is kept and when it is
//! freed stay in the tape.

use super::accumulate::GradAccumulator;
use super::micro::MicroResult;
use crate::error::Result;
use crate::model::layers::BatchNorm;
pub use crate::model::layers::ConvWeights;
use crate::model::Cnn;
use candle_core::{DType, Tensor, D};
use memtrain_kernels::batchnorm::{self as bn, BnParams};
use memtrain_kernels::quantize::{self, Quantized, Width};
use memtrain_kernels::{conv2d, depthwise, linear};

/// The head's loss and correct count, left on the device as f32 and u32 scalars: the step's
/// caller reads them ([`StepOps::read_head`]) when the backward is done, so nothing in the tape
/// waits for the device (a captured CUDA graph reads nothing at all).
pub struct Head<T> {
    /// Mean cross-entropy (unscaled), f32 scalar.
    pub loss: T,
    /// Correct top-1 predictions, u32 scalar.
    pub correct: T,
}

/// The ops of one micro-batch's forward and backward. Every op takes and returns handles of
/// [`StepOps::T`]; an op documented as "in place" gives its result the buffer of the operand it
/// consumes (on the CPU; elsewhere it may allocate).
#[allow(clippy::too_many_arguments)]
pub trait StepOps {
    /// A tensor (or only its shape and bytes). Cloning shares the buffer.
    type T: Clone;
    /// A block's BatchNorm parameters and batch statistics, as its passes read them.
    type Bn: Clone;
    /// A conv output's codes (`--compress-activations int8|int4|int2`).
    type Codes;
    /// The parameter-gradient buffers of a step.
    type Grads;

    /// The compute dtype.
    fn dtype(&self) -> DType;
    /// Blocks in the model.
    fn blocks(&self) -> usize;
    /// Block j's name (`stage1.block2`).
    fn block_name(&self, j: usize) -> &str;
    /// Whether block j ends with a 2x2 max-pool.
    fn block_pools(&self, j: usize) -> bool;
    /// Parameters of block j's conv (1 dense, 2 separable).
    fn conv_params(&self, j: usize) -> usize;

    /// Whether the tape may run passes over chunks of images ([`super::chunks`]): on the CPU;
    /// a CUDA device runs every pass on the whole batch.
    fn in_chunks(&self) -> bool;

    /// The shape.
    fn dims(&self, t: &Self::T) -> Vec<usize>;
    /// Bytes of the tensor's elements.
    fn bytes(&self, t: &Self::T) -> u64;
    /// The tensor in `dtype` (shared when it already is).
    fn to_dtype(&self, t: &Self::T, dtype: DType) -> Result<Self::T>;
    /// `[N, …]` as `[N, rest]` (a view).
    fn flatten(&self, t: &Self::T) -> Result<Self::T>;
    /// The same elements in `dims` (a view).
    fn reshape(&self, t: &Self::T, dims: &[usize]) -> Result<Self::T>;
    /// Images `first..first + len` of `t` (a view).
    fn narrow(&self, t: &Self::T, first: usize, len: usize) -> Result<Self::T>;
    /// A new tensor of zeros.
    fn zeros(&self, dims: &[usize], dtype: DType) -> Result<Self::T>;
    /// `src` written over images `first..` of `dst`, in place.
    fn write_images(&self, dst: &Self::T, first: usize, src: &Self::T) -> Result<()>;

    /// Block j's conv weights cast to the compute dtype.
    fn conv_weights(&self, j: usize) -> Result<ConvWeights<Self::T>>;
    /// The head's f32 weight `[10, F]` and bias `[10]`.
    fn head_weights(&self) -> (Self::T, Self::T);

    /// Convolution, stride 1.
    fn conv2d(&self, x: &Self::T, w: &Self::T, pad: usize) -> Result<Self::T>;
    /// Its weight gradient (in the compute dtype).
    fn conv2d_backward_weight(
        &self,
        x: &Self::T,
        dh: &Self::T,
        w: &Self::T,
        pad: usize,
    ) -> Result<Self::T>;
    /// Its input gradient, for an input of `x_dims`.
    fn conv2d_backward_input(
        &self,
        dh: &Self::T,
        w: &Self::T,
        x_dims: &[usize],
        pad: usize,
    ) -> Result<Self::T>;
    /// Depthwise 3x3 convolution, stride 1, padding 1.
    fn depthwise(&self, x: &Self::T, w: &Self::T) -> Result<Self::T>;
    /// Its weight gradient.
    fn depthwise_backward_weight(&self, x: &Self::T, dd: &Self::T, w: &Self::T) -> Result<Self::T>;
    /// Its input gradient, for an input of `x_dims`.
    fn depthwise_backward_input(
        &self,
        dd: &Self::T,
        w: &Self::T,
        x_dims: &[usize],
    ) -> Result<Self::T>;

    /// Block j's BatchNorm parameters for conv output `h`: its batch statistics (the running
    /// statistics updated when `update_stats`), or the running statistics of a frozen BatchNorm.
    fn bn_params(&self, j: usize, h: &Self::T, update_stats: bool) -> Result<Self::Bn>;
    /// Block j's BatchNorm parameters for evaluation: its running statistics, untouched.
    fn bn_running(&self, j: usize) -> Result<Self::Bn>;
    /// `relu(bn(h))` into a new tensor.
    fn bn_relu(&self, h: &Self::T, p: &Self::Bn) -> Result<Self::T>;
    /// `relu(bn(h))` in place over `h`.
    fn bn_relu_in_place(&self, h: Self::T, p: &Self::Bn) -> Result<Self::T>;
    /// `maxpool2x2(relu(bn(h)))`.
    fn bn_relu_pool(&self, h: &Self::T, p: &Self::Bn) -> Result<Self::T>;
    /// The 2x2 windows' argmax of `relu(bn(h))`, a byte per pooled element (None where the device
    /// has no such kernel).
    fn bn_relu_pool_argmax(&self, h: &Self::T, p: &Self::Bn) -> Result<Option<Self::T>>;
    /// `(dh, dγ, dβ)` of `relu(bn(h))` from the output gradient `g`, dh in place over `g`.
    fn bn_relu_backward(
        &self,
        h: &Self::T,
        g: Self::T,
        p: &Self::Bn,
    ) -> Result<(Self::T, Self::T, Self::T)>;
    /// The per-channel sums `[Σg'x̂; Σg']` of `relu(bn(h))`'s backward from the output gradient
    /// `g` (the first pass of [`StepOps::bn_relu_backward`]).
    fn bn_relu_backward_sums(&self, h: &Self::T, g: &Self::T, p: &Self::Bn) -> Result<Self::T>;
    /// The input gradient of `relu(bn(h))` written over `g` in place, from the `sums` over the
    /// whole batch of `batch_images` (h and g may be a chunk of it): the second pass of
    /// [`StepOps::bn_relu_backward`].
    fn bn_relu_backward_input(
        &self,
        h: &Self::T,
        g: &Self::T,
        p: &Self::Bn,
        sums: &Self::T,
        batch_images: usize,
    ) -> Result<()>;
    /// `(dγ, dβ)`: the rows of BatchNorm's backward sums (views).
    fn bn_grads(&self, sums: &Self::T) -> Result<(Self::T, Self::T)>;
    /// `(dh, dγ, dβ)` of `maxpool2x2(relu(bn(h)))` from the pooled gradient `g`, dh in place
    /// over `h`.
    fn bn_relu_pool_backward(
        &self,
        h: Self::T,
        g: &Self::T,
        argmax: Option<&Self::T>,
        p: &Self::Bn,
    ) -> Result<(Self::T, Self::T, Self::T)>;
    /// The per-channel sums `[Σg'x̂; Σg']` of `maxpool2x2(relu(bn(h)))`'s backward from the
    /// pooled gradient `g` and the windows' `argmax` (the first pass of
    /// [`StepOps::bn_relu_pool_backward`], on a device that runs in chunks).
    fn bn_relu_pool_backward_sums(
        &self,
        h: &Self::T,
        g: &Self::T,
        argmax: &Self::T,
        p: &Self::Bn,
    ) -> Result<Self::T>;
    /// Its input gradient written over `h` (consumed), from the `sums` over the whole batch of
    /// `batch_images` (h, g and argmax may be a chunk of it): the second pass.
    fn bn_relu_pool_backward_input(
        &self,
        h: Self::T,
        g: &Self::T,
        argmax: &Self::T,
        p: &Self::Bn,
        sums: &Self::T,
        batch_images: usize,
    ) -> Result<Self::T>;

    /// The decisions of `relu(bn(h))` (and of a 2x2 pool after it, with `pool`) from the exact
    /// h: a bit per value, set where the block's output gradient reaches h
    /// ([`memtrain_kernels::batchnorm::bn_relu_decisions`]).
    fn decisions(&self, h: &Self::T, p: &Self::Bn, pool: bool) -> Result<Self::T>;
    /// `p` with `decisions`: every pass on `p` then reads the decided output (the forward's ReLU
    /// mask and argmax) whatever h it is given.
    fn decided(&self, p: Self::Bn, decisions: Self::T) -> Self::Bn;
    /// `p` for images `first..first + len` of the batch (its decisions narrowed to them).
    fn bn_images(&self, p: &Self::Bn, first: usize, len: usize) -> Result<Self::Bn>;
    /// Bytes of `p`'s decisions (0 without).
    fn decision_bytes(&self, p: &Self::Bn) -> u64;
    /// `h` as `width` codes ([`memtrain_kernels::quantize`]); `salt` keys stochastic rounding.
    fn quantize(&self, h: &Self::T, width: Width, salt: u64) -> Result<Self::Codes>;
    /// The codes decoded into a new tensor of the dtype they were stored from.
    fn dequantize(&self, q: &Self::Codes) -> Result<Self::T>;
    /// Images `first..first + len` of the codes decoded into a new tensor.
    fn dequantize_images(&self, q: &Self::Codes, first: usize, len: usize) -> Result<Self::T>;
    /// The shape the codes decode to.
    fn codes_dims(&self, q: &Self::Codes) -> Vec<usize>;
    /// Bytes the codes hold (codes and ranges).
    fn codes_bytes(&self, q: &Self::Codes) -> u64;

    /// `a · b` (f32, 2-D).
    fn matmul(&self, a: &Self::T, b: &Self::T) -> Result<Self::T>;
    /// `bᵀ` (a view).
    fn t(&self, b: &Self::T) -> Result<Self::T>;
    /// `x + bias` per row.
    fn add_bias(&self, x: &Self::T, bias: &Self::T) -> Result<Self::T>;
    /// The sum over rows.
    fn sum_rows(&self, x: &Self::T) -> Result<Self::T>;
    /// `a + b` into a new tensor.
    fn add(&self, a: &Self::T, b: &Self::T) -> Result<Self::T>;
    /// The mean cross-entropy of f32 `logits` for `labels` and the correct count, on the device,
    /// and the gradient of `loss_mult · loss` with respect to the logits.
    fn loss_and_grad(
        &self,
        logits: &Self::T,
        labels: &Self::T,
        loss_mult: f64,
    ) -> Result<(Head<Self::T>, Self::T)>;
    /// The head's loss and correct count, read on the host.
    fn read_head(&self, head: &Head<Self::T>) -> Result<MicroResult>;

    /// The mean cross-entropy of f32 `logits` for `labels` and the correct count, read; no
    /// gradient (evaluation).
    fn loss(&self, logits: &Self::T, labels: &Self::T) -> Result<MicroResult>;

    /// Empty gradient buffers, one slot per parameter.
    fn new_grads(&self) -> Self::Grads;
    /// Add the gradient of parameter `i` into `grads`.
    fn add_grad(&self, grads: &mut Self::Grads, i: usize, g: Self::T) -> Result<()>;
    /// Bytes of the gradient buffers held now.
    fn grad_bytes(&self, grads: &Self::Grads) -> u64;
    /// The summed gradients, one per parameter (None for a parameter that got none).
    fn grad_list(&self, grads: Self::Grads) -> Vec<Option<Self::T>>;

    // The optimizer's ops ([`super::optim`]), on f32 parameters and their gradients.

    /// Parameter `i` (an f32 master weight, in [`Cnn::vars`]' order), detached.
    fn param(&self, i: usize) -> Self::T;
    /// `value` written over parameter `i`, in place.
    fn set_param(&self, i: usize, value: &Self::T) -> Result<()>;
    /// `x · mul + add` into a new tensor.
    fn affine(&self, x: &Self::T, mul: f64, add: f64) -> Result<Self::T>;
    /// `a − b` into a new tensor.
    fn sub(&self, a: &Self::T, b: &Self::T) -> Result<Self::T>;
    /// `a / b` into a new tensor.
    fn div(&self, a: &Self::T, b: &Self::T) -> Result<Self::T>;
    /// `x²` into a new tensor.
    fn sqr(&self, x: &Self::T) -> Result<Self::T>;
    /// `√x` into a new tensor.
    fn sqrt(&self, x: &Self::T) -> Result<Self::T>;
    /// `Σ x²`, read on the host.
    fn sum_squares(&self, x: &Self::T) -> Result<f64>;
}

/// The tape on Candle tensors: the model's parameters on its device and memtrain's kernels.
pub struct CandleOps<'a> {
    model: &'a Cnn,
    dtype: DType,
    stats_in_place: bool,
}

impl<'a> CandleOps<'a> {
    /// Ops on `model`'s parameters computing in `dtype`.
    pub fn new(model: &'a Cnn, dtype: DType) -> Self {
        CandleOps {
            model,
            dtype,
            stats_in_place: false,
        }
    }

    /// Update the BatchNorm running statistics by writing into the existing tensors rather than
    /// replacing them. A captured CUDA graph needs this: it reads and writes the buffers whose
    /// addresses it saw during capture, so the model must keep using those buffers. (The default,
    /// replacing, never changes a tensor someone else may hold a clone of.)
    pub fn with_stats_in_place(mut self) -> Self {
        self.stats_in_place = true;
        self
    }
}

impl StepOps for CandleOps<'_> {
    type T = Tensor;
    type Bn = BnParams;
    type Codes = Quantized;
    type Grads = GradAccumulator;

    fn dtype(&self) -> DType {
        self.dtype
    }
    fn blocks(&self) -> usize {
        self.model.blocks.len()
    }
    fn block_name(&self, j: usize) -> &str {
        &self.model.blocks[j].name
    }
    fn block_pools(&self, j: usize) -> bool {
        self.model.blocks[j].pool
    }
    fn conv_params(&self, j: usize) -> usize {
        self.model.blocks[j].conv.var_count()
    }

    fn in_chunks(&self) -> bool {
        self.model.device().is_cpu()
    }

    fn dims(&self, t: &Tensor) -> Vec<usize> {
        t.dims().to_vec()
    }
    fn bytes(&self, t: &Tensor) -> u64 {
        (t.elem_count() * t.dtype().size_in_bytes()) as u64
    }
    fn to_dtype(&self, t: &Tensor, dtype: DType) -> Result<Tensor> {
        Ok(t.to_dtype(dtype)?)
    }
    fn flatten(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.flatten_from(1)?)
    }
    fn reshape(&self, t: &Tensor, dims: &[usize]) -> Result<Tensor> {
        Ok(t.reshape(dims)?)
    }
    fn narrow(&self, t: &Tensor, first: usize, len: usize) -> Result<Tensor> {
        Ok(t.narrow(0, first, len)?)
    }
    fn zeros(&self, dims: &[usize], dtype: DType) -> Result<Tensor> {
        Ok(Tensor::zeros(dims, dtype, self.model.device())?)
    }
    fn write_images(&self, dst: &Tensor, first: usize, src: &Tensor) -> Result<()> {
        Ok(dst.slice_set(src, 0, first)?)
    }

    fn conv_weights(&self, j: usize) -> Result<ConvWeights<Tensor>> {
        let dt = self.dtype;
        self.model.blocks[j]
            .conv
            .weights(|v| Ok(v.as_detached_tensor().to_dtype(dt)?))
    }
    fn head_weights(&self) -> (Tensor, Tensor) {
        (
            self.model.head_w.as_detached_tensor(),
            self.model.head_b.as_detached_tensor(),
        )
    }

    fn conv2d(&self, x: &Tensor, w: &Tensor, pad: usize) -> Result<Tensor> {
        Ok(conv2d::conv2d(x, w, 1, pad)?)
    }
    fn conv2d_backward_weight(
        &self,
        x: &Tensor,
        dh: &Tensor,
        w: &Tensor,
        pad: usize,
    ) -> Result<Tensor> {
        Ok(conv2d::conv2d_backward_weight(x, dh, w.dims(), 1, pad)?)
    }
    fn conv2d_backward_input(
        &self,
        dh: &Tensor,
        w: &Tensor,
        x_dims: &[usize],
        pad: usize,
    ) -> Result<Tensor> {
        Ok(conv2d::conv2d_backward_input(dh, w, x_dims, 1, pad)?)
    }
    fn depthwise(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        Ok(depthwise::depthwise_conv2d(x, w, 1, 1)?)
    }
    fn depthwise_backward_weight(&self, x: &Tensor, dd: &Tensor, w: &Tensor) -> Result<Tensor> {
        Ok(depthwise::depthwise_backward_weight(x, dd, w.dims(), 1, 1)?)
    }
    fn depthwise_backward_input(
        &self,
        dd: &Tensor,
        w: &Tensor,
        x_dims: &[usize],
    ) -> Result<Tensor> {
        Ok(depthwise::depthwise_backward_input(dd, w, x_dims, 1, 1)?)
    }

    fn bn_params(&self, j: usize, h: &Tensor, update_stats: bool) -> Result<BnParams> {
        bn_params(
            &self.model.blocks[j].bn,
            h,
            update_stats,
            self.stats_in_place,
        )
    }
    fn bn_running(&self, j: usize) -> Result<BnParams> {
        running_params(&self.model.blocks[j].bn)
    }
    fn bn_relu(&self, h: &Tensor, p: &BnParams) -> Result<Tensor> {
        Ok(bn::bn_relu(h, p)?)
    }
    fn bn_relu_in_place(&self, h: Tensor, p: &BnParams) -> Result<Tensor> {
        Ok(bn::bn_relu_in_place(h, p)?)
    }
    fn bn_relu_pool(&self, h: &Tensor, p: &BnParams) -> Result<Tensor> {
        Ok(bn::bn_relu_pool(h, p)?)
    }
    fn bn_relu_pool_argmax(&self, h: &Tensor, p: &BnParams) -> Result<Option<Tensor>> {
        Ok(bn::bn_relu_pool_argmax(h, p)?)
    }
    fn bn_relu_backward(
        &self,
        h: &Tensor,
        g: Tensor,
        p: &BnParams,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        Ok(bn::bn_relu_backward(h, g, p)?)
    }
    fn bn_relu_backward_sums(&self, h: &Tensor, g: &Tensor, p: &BnParams) -> Result<Tensor> {
        Ok(bn::bn_relu_backward_sums(h, g, p)?)
    }
    fn bn_relu_backward_input(
        &self,
        h: &Tensor,
        g: &Tensor,
        p: &BnParams,
        sums: &Tensor,
        batch_images: usize,
    ) -> Result<()> {
        Ok(bn::bn_relu_backward_input(h, g, p, sums, batch_images)?)
    }
    fn bn_grads(&self, sums: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((sums.get(0)?, sums.get(1)?))
    }
    fn bn_relu_pool_backward(
        &self,
        h: Tensor,
        g: &Tensor,
        argmax: Option<&Tensor>,
        p: &BnParams,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        Ok(bn::bn_relu_pool_backward(h, g, argmax, p)?)
    }
    fn bn_relu_pool_backward_sums(
        &self,
        h: &Tensor,
        g: &Tensor,
        argmax: &Tensor,
        p: &BnParams,
    ) -> Result<Tensor> {
        Ok(bn::bn_relu_pool_backward_sums(h, g, argmax, p)?)
    }
    fn bn_relu_pool_backward_input(
        &self,
        h: Tensor,
        g: &Tensor,
        argmax: &Tensor,
        p: &BnParams,
        sums: &Tensor,
        batch_images: usize,
    ) -> Result<Tensor> {
        Ok(bn::bn_relu_pool_backward_input(
            h,
            g,
            argmax,
            p,
            sums,
            batch_images,
        )?)
    }

    fn decisions(&self, h: &Tensor, p: &BnParams, pool: bool) -> Result<Tensor> {
        Ok(bn::bn_relu_decisions(h, p, pool)?)
    }
    fn decided(&self, p: BnParams, decisions: Tensor) -> BnParams {
        p.decided(decisions)
    }
    fn bn_images(&self, p: &BnParams, first: usize, len: usize) -> Result<BnParams> {
        Ok(p.images(first, len)?)
    }
    fn decision_bytes(&self, p: &BnParams) -> u64 {
        p.decision_bytes() as u64
    }
    fn quantize(&self, h: &Tensor, width: Width, salt: u64) -> Result<Quantized> {
        Ok(quantize::quantize(h, width, salt)?)
    }
    fn dequantize(&self, q: &Quantized) -> Result<Tensor> {
        Ok(quantize::dequantize(q)?)
    }
    fn dequantize_images(&self, q: &Quantized, first: usize, len: usize) -> Result<Tensor> {
        Ok(quantize::dequantize_images(q, first, len)?)
    }
    fn codes_dims(&self, q: &Quantized) -> Vec<usize> {
        q.dims.to_vec()
    }
    fn codes_bytes(&self, q: &Quantized) -> u64 {
        q.bytes() as u64
    }

    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Ok(linear::matmul(a, b)?)
    }
    fn t(&self, b: &Tensor) -> Result<Tensor> {
        Ok(b.t()?)
    }
    fn add_bias(&self, x: &Tensor, bias: &Tensor) -> Result<Tensor> {
        Ok(x.broadcast_add(bias)?)
    }
    fn sum_rows(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.sum(0)?)
    }
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Ok((a + b)?)
    }
    fn loss_and_grad(
        &self,
        logits: &Tensor,
        labels: &Tensor,
        loss_mult: f64,
    ) -> Result<(Head<Tensor>, Tensor)> {
        // One log-softmax for both the loss and its gradient (softmax = exp of it).
        let log_probs = candle_nn::ops::log_softmax(logits, D::Minus1)?;
        let loss = candle_nn::loss::nll(&log_probs, labels)?;
        let correct = correct_count(logits, labels)?;
        let grad = logits_grad(&log_probs, labels, loss_mult)?;
        Ok((Head { loss, correct }, grad))
    }
    fn read_head(&self, head: &Head<Tensor>) -> Result<MicroResult> {
        Ok(MicroResult {
            loss: head.loss.to_scalar::<f32>()? as f64,
            correct: head.correct.to_scalar::<u32>()? as usize,
        })
    }

    fn loss(&self, logits: &Tensor, labels: &Tensor) -> Result<MicroResult> {
        let (loss, correct) = super::oracle::loss_and_correct(logits, labels)?;
        Ok(MicroResult {
            loss: loss.to_scalar::<f32>()? as f64,
            correct,
        })
    }

    fn new_grads(&self) -> GradAccumulator {
        GradAccumulator::new(self.model.param_count())
    }
    fn add_grad(&self, grads: &mut GradAccumulator, i: usize, g: Tensor) -> Result<()> {
        grads.add(i, g)
    }
    fn grad_bytes(&self, grads: &GradAccumulator) -> u64 {
        grads.bytes()
    }
    fn grad_list(&self, grads: GradAccumulator) -> Vec<Option<Tensor>> {
        grads.into_grads()
    }

    fn param(&self, i: usize) -> Tensor {
        self.model.var(i).as_detached_tensor()
    }
    fn set_param(&self, i: usize, value: &Tensor) -> Result<()> {
        Ok(self.model.var(i).set(value)?)
    }
    fn affine(&self, x: &Tensor, mul: f64, add: f64) -> Result<Tensor> {
        Ok(x.affine(mul, add)?)
    }
    fn sub(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Ok((a - b)?)
    }
    fn div(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Ok((a / b)?)
    }
    fn sqr(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.sqr()?)
    }
    fn sqrt(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.sqrt()?)
    }
    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        Ok(x.sqr()?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?)
    }
}

/// The normalization parameters of a block for conv output `h`: batch statistics (running
/// statistics updated when `update_stats`, written into their tensors when `in_place`), or the
/// running statistics for a frozen BatchNorm.
fn bn_params(
    layer: &BatchNorm,
    h: &Tensor,
    update_stats: bool,
    in_place: bool,
) -> Result<BnParams> {
    if layer.frozen {
        return running_params(layer);
    }
    let gamma = layer.gamma.as_detached_tensor();
    let beta = layer.beta.as_detached_tensor();
    let stats = bn::batch_stats(h)?;
    if update_stats {
        let (n, _, hh, ww) = h.dims4()?;
        layer.update_running(&stats, n * hh * ww, in_place)?;
    }
    Ok(BnParams {
        gamma,
        beta,
        stats,
        eps: layer.eps,
        batch_stats: true,
        decisions: None,
    })
}

/// The normalization parameters of a block with its running statistics (evaluation, or a
/// frozen BatchNorm in training).
fn running_params(layer: &BatchNorm) -> Result<BnParams> {
    let (rm, rv) = layer.running();
    Ok(BnParams {
        gamma: layer.gamma.as_detached_tensor(),
        beta: layer.beta.as_detached_tensor(),
        stats: Tensor::stack(&[rm, rv], 0)?,
        eps: layer.eps,
        batch_stats: false,
        decisions: None,
    })
}

/// Top-1 predictions of `logits` that equal `labels`, as a u32 scalar.
fn correct_count(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    Ok(logits
        .argmax(D::Minus1)?
        .eq(labels)?
        .to_dtype(DType::U32)?
        .sum_all()?)
}

/// `(softmax − onehot) · loss_mult / N` from the log-softmax of the logits.
fn logits_grad(log_probs: &Tensor, labels: &Tensor, loss_mult: f64) -> Result<Tensor> {
    let (n, classes) = log_probs.dims2()?;
    let probs = log_probs.exp()?;
    let onehot = labels
        .unsqueeze(1)?
        .broadcast_eq(&Tensor::arange(0u32, classes as u32, log_probs.device())?.unsqueeze(0)?)?
        .to_dtype(DType::F32)?;
    Ok(((probs - onehot)? * (loss_mult / n as f64))?)
}
