//! The CIFAR-10 CNN: three stages of two [3x3 conv → BatchNorm → ReLU] blocks (widths w, 2w, 4w),
//! each stage ending in a 2x2 max-pool, then a linear head. Built as a flat list of blocks so the
//! trainer can run any contiguous range of them as one checkpointing segment.

pub mod cnn;
pub mod init;
pub mod layers;

pub use cnn::{Cnn, LayerKind, LayerSpec, Mode, ModelConfig, IMAGE_BYTES, NUM_CLASSES};
