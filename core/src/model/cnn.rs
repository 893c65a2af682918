//! The CNN as a flat list of blocks plus a head.

use super::init::Init;
pub use super::layers::Mode;
use super::layers::{BatchNorm, ConvLayer};
use crate::options::{ConvKind, Segmentation, CNN_BLOCKS};

use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor, Var};
use std::ops::Range;

/// Bytes (and values) of one input image: 3 channels of 32x32 pixels.
pub const IMAGE_BYTES: usize = 3072;
/// Classes the head predicts (CIFAR-10's labels 0..=9).
pub const NUM_CLASSES: usize = 10;

/// The network: its width and convolution kind (the flags `--width` and `--conv`, the `model`
/// group of a `config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::Args)]
#[group(skip)]
#[serde(default)]
pub struct ModelConfig {
    /// Base width w: stages have w, 2w, 4w channels
    #[arg(long, default_value_t = ModelConfig::default().width, allow_negative_numbers = true)]
    pub width: usize,
    /// Convolution kind: standard 3x3, or depthwise 3x3 + pointwise 1x1
    #[arg(long, value_enum, default_value_t = ModelConfig::default().conv)]
    pub conv: ConvKind,
}

impl ModelConfig {
    /// The model's layers, in order ([`layer_specs_for`]).
    pub fn layer_specs(&self) -> Vec<LayerSpec> {
        layer_specs_for(self.width, self.conv)
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            width: 32,
            conv: ConvKind::Standard,
        }
    }
}

/// Side of the square input images (CIFAR-10's 32x32).
pub const IMAGE_SIDE: usize = 32;

/// One conv block of the architecture, before any weight exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockShape {
    /// `stage{s}.block{b}`, 1-based.
    pub name: String,
    /// Input channels.
    pub cin: usize,
    /// Output channels.
    pub cout: usize,
    /// Side of the block's input (and conv output) planes.
    pub side: usize,
    /// Whether a 2x2 max-pool ends the block (the last block of a stage).
    pub pool: bool,
}

/// The architecture, described once: three stages of two blocks at widths w, 2w, 4w on
/// [`IMAGE_SIDE`]-pixel RGB images, each stage ending in a 2x2 max-pool; then a linear head on
/// the features it returns as the second value. The model ([`Cnn::new`]), its layer list
/// ([`layer_specs_for`]) and its parameter count ([`param_count`]) are built from it. Widths
/// saturate at `usize::MAX` for a width no machine could hold, instead of overflowing.
pub fn architecture(width: usize) -> ([BlockShape; CNN_BLOCKS], usize) {
    let mut side = IMAGE_SIDE;
    let mut cin = 3;
    let blocks = std::array::from_fn(|i| {
        let (stage, block) = (i / 2, i % 2);
        let cout = width.saturating_mul(1 << stage);
        let shape = BlockShape {
            name: format!("stage{}.block{}", stage + 1, block + 1),
            cin,
            cout,
            side,
            pool: block == 1,
        };
        cin = cout;
        if shape.pool {
            side /= 2;
        }
        shape
    });
    (blocks, cin.saturating_mul(side * side))
}

/// One [conv → BN → ReLU] block, optionally followed by a 2x2 max-pool (last block of a stage).
pub struct Block {
    /// Name prefix of the block's parameters, e.g. `stage2.block1`.
    pub name: String,
    /// Input channels.
    pub cin: usize,
    /// Output channels.
    pub cout: usize,
    /// The convolution.
    pub conv: ConvLayer,
    /// The normalization (fused with the ReLU).
    pub bn: BatchNorm,
    /// Whether a 2x2 max-pool ends the block.
    pub pool: bool,
}

impl Block {
    /// Run the block on `x` (compute dtype).
    pub fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let h = self.conv.forward(x, mode)?;
        let h = self.bn.forward_relu(&h, mode)?;
        if self.pool {
            Ok(memtrain_kernels::pool::max_pool2x2(&h)?)
        } else {
            Ok(h)
        }
    }
}

/// What a layer computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Dense convolution, stride 1: a `k`×`k` kernel with `pad` zeros on each side.
    Conv {
        /// Kernel side.
        k: usize,
        /// Zero padding on each side.
        pad: usize,
    },
    /// Depthwise 3x3 convolution, stride 1, padding 1.
    Depthwise,
    /// BatchNorm fused with ReLU.
    BnRelu,
    /// 2x2 max-pool.
    MaxPool,
    /// The linear head (f32).
    Linear,
}

impl LayerKind {
    /// The kind as tables and JSON spell it: `conv3x3`, `pointwise1x1`, `depthwise3x3`,
    /// `bn_relu`, `maxpool2`, `linear`.
    pub fn name(&self) -> &'static str {
        match self {
            LayerKind::Conv { k: 1, .. } => "pointwise1x1",
            LayerKind::Conv { .. } => "conv3x3",
            LayerKind::Depthwise => "depthwise3x3",
            LayerKind::BnRelu => "bn_relu",
            LayerKind::MaxPool => "maxpool2",
            LayerKind::Linear => "linear",
        }
    }

    /// A convolution (dense or depthwise): the kinds whose weight the block's conv holds.
    pub fn is_conv(&self) -> bool {
        matches!(self, LayerKind::Conv { .. } | LayerKind::Depthwise)
    }
}

impl std::fmt::Display for LayerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl serde::Serialize for LayerKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// Static description of one layer, for parameter counts and the memory estimator.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSpec {
    /// Layer name.
    pub name: String,
    /// What it computes.
    pub kind: LayerKind,
    /// Input shape per image (C, H, W) or (features, 1, 1).
    pub input: (usize, usize, usize),
    /// Output shape per image.
    pub output: (usize, usize, usize),
    /// Parameter count.
    pub params: usize,
    /// Index of the block the layer belongs to (`blocks.len()` for the head).
    pub block: usize,
}

/// The CIFAR-10 CNN.
pub struct Cnn {
    /// Shape.
    pub config: ModelConfig,
    /// The six blocks, in order.
    pub blocks: Vec<Block>,
    /// Head weight [10, 4w·4·4].
    pub head_w: Var,
    /// Head bias `[10]`.
    pub head_b: Var,
    device: Device,
}

impl Cnn {
    /// Build with seeded initialization on `device`.
    pub fn new(config: ModelConfig, device: &Device, seed: u64) -> Result<Self> {
        if config.width == 0 {
            return Err(Error::config("--width must be at least 1"));
        }
        let mut init = Init::new(seed);
        let (shapes, feat) = architecture(config.width);
        let mut blocks = Vec::new();
        for b in shapes {
            blocks.push(Block {
                conv: ConvLayer::new(config.conv, b.cin, b.cout, &mut init, device)?,
                bn: BatchNorm::new(b.cout, device)?,
                name: b.name,
                cin: b.cin,
                cout: b.cout,
                pool: b.pool,
            });
        }
        let bound = 1.0 / (feat as f64).sqrt();
        let head_w = Var::from_tensor(&Tensor::from_vec(
            init.uniform(NUM_CLASSES * feat, bound),
            (NUM_CLASSES, feat),
            device,
        )?)?;
        let head_b = Var::from_tensor(&Tensor::from_vec(
            init.uniform(NUM_CLASSES, bound),
            NUM_CLASSES,
            device,
        )?)?;
        Ok(Cnn {
            config,
            blocks,
            head_w,
            head_b,
            device: device.clone(),
        })
    }

    /// Normalize with running statistics in training too (see [`BatchNorm::frozen`](super::layers::BatchNorm)).
    pub fn freeze_batch_norm(&mut self) {
        for b in &mut self.blocks {
            b.bn.frozen = true;
        }
    }

    /// The device the parameters live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Every trainable parameter with its name, in a fixed order.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        let mut out = Vec::new();
        for b in &self.blocks {
            for (suffix, v) in b.conv.vars() {
                out.push((format!("{}.{suffix}", b.name), v.clone()));
            }
            out.push((format!("{}.bn.weight", b.name), b.bn.gamma.clone()));
            out.push((format!("{}.bn.bias", b.name), b.bn.beta.clone()));
        }
        out.push(("head.weight".into(), self.head_w.clone()));
        out.push(("head.bias".into(), self.head_b.clone()));
        out
    }

    /// Trainable parameter `i`, in the order of [`Cnn::named_vars`] (no list is built).
    ///
    /// # Panics
    /// When `i` is not below [`Cnn::param_count`].
    pub fn var(&self, i: usize) -> &Var {
        let mut i = i;
        for b in &self.blocks {
            let conv = b.conv.var_count();
            match i {
                i if i < conv => return b.conv.var(i),
                i if i == conv => return &b.bn.gamma,
                i if i == conv + 1 => return &b.bn.beta,
                _ => i -= conv + 2,
            }
        }
        match i {
            0 => &self.head_w,
            1 => &self.head_b,
            _ => panic!("the model has {} parameters", self.param_count()),
        }
    }

    /// Number of trainable parameter tensors.
    pub fn param_count(&self) -> usize {
        self.blocks
            .iter()
            .map(|b| b.conv.var_count() + 2)
            .sum::<usize>()
            + 2
    }

    /// The trainable parameters, in the order of [`Cnn::named_vars`].
    pub fn vars(&self) -> Vec<Var> {
        self.named_vars().into_iter().map(|(_, v)| v).collect()
    }

    /// Number of trainable parameters.
    pub fn num_params(&self) -> usize {
        (0..self.param_count())
            .map(|i| self.var(i).elem_count())
            .sum()
    }

    /// Bytes of the parameters and the BatchNorm running statistics (no list of them is built:
    /// the trainer reads it at every step).
    pub fn state_bytes(&self) -> u64 {
        let bytes = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        let params: u64 = (0..self.param_count())
            .map(|i| bytes(self.var(i).as_tensor()))
            .sum();
        let stats: u64 = (self.blocks.iter())
            .map(|b| {
                let (mean, var) = b.bn.running();
                bytes(&mean) + bytes(&var)
            })
            .sum();
        params + stats
    }

    /// BatchNorm running statistics with their names (buffers, not trained).
    pub fn named_buffers(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for b in &self.blocks {
            let rm =
                b.bn.running_mean
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
            let rv =
                b.bn.running_var
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
            out.push((format!("{}.bn.running_mean", b.name), rm));
            out.push((format!("{}.bn.running_var", b.name), rv));
        }
        out
    }

    /// Overwrite a running statistic by name (for loading checkpoints).
    pub fn set_buffer(&self, name: &str, value: Tensor) -> Result<()> {
        for b in &self.blocks {
            let target = if name == format!("{}.bn.running_mean", b.name) {
                &b.bn.running_mean
            } else if name == format!("{}.bn.running_var", b.name) {
                &b.bn.running_var
            } else {
                continue;
            };
            *target.lock().unwrap_or_else(|e| e.into_inner()) = value;
            return Ok(());
        }
        Err(Error::State(format!("unknown buffer '{name}'")))
    }

    /// Run blocks `range` on `x` (compute dtype).
    pub(crate) fn forward_blocks(
        &self,
        x: &Tensor,
        range: Range<usize>,
        mode: Mode,
    ) -> Result<Tensor> {
        let mut h = x.clone();
        for b in &self.blocks[range] {
            h = b.forward(&h, mode)?;
        }
        Ok(h)
    }

    /// The head: flatten, then the linear layer in f32 (logits and softmax stay in f32 under
    /// mixed precision; it is also the only matmul, which Candle's CPU backend lacks in bf16).
    pub(crate) fn forward_head(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let x = x.to_dtype(DType::F32)?.flatten_from(1)?;
        let w = mode.param(&self.head_w);
        let b = mode.param(&self.head_b);
        let logits = if w.track_op() {
            x.matmul(&w.t()?)?
        } else {
            // No graph: the single-threaded product (see `memtrain_kernels::linear`).
            memtrain_kernels::linear::matmul(&x, &w.t()?)?
        };
        Ok(logits.broadcast_add(&b)?)
    }

    /// Full forward: f32 images `[N, 3, 32, 32]` → f32 logits `[N, 10]`, computing in `dtype`.
    pub fn forward(&self, x: &Tensor, dtype: DType, mode: Mode) -> Result<Tensor> {
        let h = self.forward_blocks(&x.to_dtype(dtype)?, 0..self.blocks.len(), mode)?;
        self.forward_head(&h, mode)
    }

    /// Gradient-checkpointing segments as ranges of this model's blocks ([`segments`]).
    pub fn segments(&self, segmentation: Segmentation) -> Vec<Range<usize>> {
        segments(self.blocks.len(), segmentation)
    }

    /// Per-layer description for an input of 32x32 images.
    pub fn layer_specs(&self) -> Vec<LayerSpec> {
        self.config.layer_specs()
    }
}

/// Gradient checkpointing's segmentation of `n` blocks as block ranges: one segment for `none`,
/// one per stage, one per block, or the segments a `segments:` list cuts. Every segment but the
/// last keeps only its input in the forward and is recomputed in the backward; the last saves as
/// it goes. The head is always handled separately. The one definition, used by the step
/// ([`Cnn::segments`]) and by the memory estimate.
pub fn segments(n: usize, segmentation: Segmentation) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for b in segmentation.boundaries().into_iter().filter(|&b| b < n) {
        out.push(start..b);
        start = b;
    }
    out.push(start..n);
    out
}

/// The name of the event that recomputes a checkpointed segment from its first block `first` to
/// its last `last`: `recompute stage1.block1–block2` (the stage left out of the last block when
/// both are in the same stage), `recompute stage1.block2–stage2.block1`, or `recompute
/// stage1.block1` for a one-block segment. The one spelling, used by the step's timeline and the
/// estimate's events, which are matched by name.
pub fn recompute_label(first: &str, last: &str) -> String {
    if first == last {
        return format!("recompute {first}");
    }
    let tail = match (first.split_once('.'), last.split_once('.')) {
        (Some((a, _)), Some((b, rest))) if a == b => rest,
        _ => last,
    };
    format!("recompute {first}–{tail}")
}

/// The layers of the model for `width` and `conv`, in order, from [`architecture`]: its
/// shapes, for the memory estimate and [`Cnn::layer_specs`].
pub fn layer_specs_for(width: usize, conv: ConvKind) -> Vec<LayerSpec> {
    let (blocks, feat) = architecture(width);
    let mut specs = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        let (name, cin, cout, hw) = (&b.name, b.cin, b.cout, b.side);
        let spec = |layer: &str, kind, input, output, params| LayerSpec {
            name: format!("{name}.{layer}"),
            kind,
            input,
            output,
            params,
            block: i,
        };
        match conv {
            ConvKind::Standard => specs.push(spec(
                "conv",
                LayerKind::Conv { k: 3, pad: 1 },
                (cin, hw, hw),
                (cout, hw, hw),
                cout * cin * 9,
            )),
            ConvKind::Separable => {
                specs.push(spec(
                    "dw",
                    LayerKind::Depthwise,
                    (cin, hw, hw),
                    (cin, hw, hw),
                    cin * 9,
                ));
                specs.push(spec(
                    "pw",
                    LayerKind::Conv { k: 1, pad: 0 },
                    (cin, hw, hw),
                    (cout, hw, hw),
                    cout * cin,
                ));
            }
        }
        specs.push(spec(
            "bn_relu",
            LayerKind::BnRelu,
            (cout, hw, hw),
            (cout, hw, hw),
            2 * cout,
        ));
        if b.pool {
            specs.push(spec(
                "pool",
                LayerKind::MaxPool,
                (cout, hw, hw),
                (cout, hw / 2, hw / 2),
                0,
            ));
        }
    }
    specs.push(LayerSpec {
        name: "head".into(),
        kind: LayerKind::Linear,
        input: (feat, 1, 1),
        output: (NUM_CLASSES, 1, 1),
        params: feat * NUM_CLASSES + NUM_CLASSES,
        block: blocks.len(),
    });
    specs
}

/// Parameter count of the model for a width and conv kind, from [`architecture`], without
/// building it. Saturates at `usize::MAX` for a width no machine could hold.
pub fn param_count(width: usize, conv: ConvKind) -> usize {
    let (blocks, feat) = architecture(width);
    let convs = blocks.iter().fold(0usize, |sum, b| {
        let (i, o) = (b.cin, b.cout);
        let weights = match conv {
            ConvKind::Standard => o.saturating_mul(i).saturating_mul(9),
            ConvKind::Separable => i.saturating_mul(9).saturating_add(o.saturating_mul(i)),
        };
        sum.saturating_add(weights)
            .saturating_add(o.saturating_mul(2))
    });
    convs
        .saturating_add(feat.saturating_mul(NUM_CLASSES))
        .saturating_add(NUM_CLASSES)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model built, its layer list and its parameter count agree, from the one description.
    #[test]
    fn the_model_its_layers_and_its_count_agree() {
        for conv in [ConvKind::Standard, ConvKind::Separable] {
            for width in [1, 3, 16] {
                let model = Cnn::new(ModelConfig { width, conv }, &Device::Cpu, 0).unwrap();
                let built: usize = model.vars().iter().map(|v| v.elem_count()).sum();
                let listed: usize = model.layer_specs().iter().map(|l| l.params).sum();
                assert_eq!(built, param_count(width, conv), "{conv} width {width}");
                assert_eq!(listed, built, "{conv} width {width}");
                assert_eq!(model.num_params(), built, "{conv} width {width}");
                let vars = model.vars();
                assert!((0..model.param_count())
                    .all(|i| model.var(i).as_tensor().id() == vars[i].as_tensor().id()));
                let stats: usize = model
                    .named_buffers()
                    .iter()
                    .map(|(_, t)| t.elem_count())
                    .sum();
                assert_eq!(
                    model.state_bytes(),
                    4 * (built + stats) as u64,
                    "{conv} width {width}"
                );
                let (shapes, feat) = architecture(width);
                assert_eq!(feat, 4 * width * 4 * 4);
                for (b, s) in model.blocks.iter().zip(&shapes) {
                    assert_eq!(
                        (&b.name, b.cin, b.cout, b.pool),
                        (&s.name, s.cin, s.cout, s.pool)
                    );
                }
            }
        }
        assert_eq!(param_count(usize::MAX / 2, ConvKind::Standard), usize::MAX);
    }
}
