//! A batch and its micro-batches: where the batch is ([`BatchInput`]), micro-batch `i` of `k`
//! equal ones, and the batch's result from its micro-batches' ([`MicroResult::mean`]). The loop
//! over them is gradient accumulation, in [`super::train::gradients`].

use crate::error::{Error, Result};
use crate::model::IMAGE_BYTES;
use candle_core::{Device, Tensor};

/// Loss and accuracy of one micro-batch, or of a whole batch ([`MicroResult::mean`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroResult {
    /// Mean cross-entropy (unscaled).
    pub loss: f64,
    /// Correct top-1 predictions.
    pub correct: usize,
}

impl MicroResult {
    /// The batch's result from its micro-batches': the mean of the equal-sized micro-batches'
    /// mean losses, and the sum of their correct counts.
    pub fn mean(results: &[MicroResult]) -> MicroResult {
        let k = results.len() as f64;
        // Summed in micro-batch order, each term divided first: the order every path used.
        results.iter().fold(
            MicroResult {
                loss: 0.0,
                correct: 0,
            },
            |acc, r| MicroResult {
                loss: acc.loss + r.loss / k,
                correct: acc.correct + r.correct,
            },
        )
    }
}

/// Where a batch is: on the host (copied to the device one micro-batch at a time, so only one
/// micro-batch of images is on the device at once) or already on the device (a captured CUDA
/// graph reads its inputs from fixed addresses, so its micro-batches are views of them).
#[derive(Clone, Copy)]
pub enum BatchInput<'a> {
    /// f32 images (`[N, 3, 32, 32]` flattened) and u32 labels on the host.
    Host {
        /// The images, [`IMAGE_BYTES`] values each.
        images: &'a [f32],
        /// One label per image.
        labels: &'a [u32],
        /// The device the micro-batches go to.
        device: &'a Device,
    },
    /// Images `[N, 3, 32, 32]` and labels `[N]` on the device.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // a captured CUDA graph's inputs
    Device {
        /// The images.
        x: &'a Tensor,
        /// The labels.
        y: &'a Tensor,
    },
}

impl BatchInput<'_> {
    fn len(&self) -> Result<usize> {
        match self {
            BatchInput::Host { images, labels, .. } => {
                if images.len() != labels.len() * IMAGE_BYTES {
                    return Err(Error::config(format!(
                        "a batch of {} labels holds {} image values, not {} per image",
                        labels.len(),
                        images.len(),
                        IMAGE_BYTES
                    )));
                }
                Ok(labels.len())
            }
            BatchInput::Device { y, .. } => Ok(y.dim(0)?),
        }
    }

    /// Micro-batch `index` of the `k` equal ones the batch splits into, on the device. A batch
    /// that does not split into `k` equal parts is a usage error.
    pub fn micro_batch(&self, index: usize, k: usize) -> Result<(Tensor, Tensor)> {
        let size = self.micro_len(k)?;
        self.slice(index * size, size)
    }

    /// Images per micro-batch when the batch is split into `k`.
    fn micro_len(&self, k: usize) -> Result<usize> {
        let n = self.len()?;
        if k == 0 || !n.is_multiple_of(k) {
            return Err(Error::config(format!(
                "a batch of {n} images cannot be split into {k} micro-batches"
            )));
        }
        Ok(n / k)
    }

    /// Images and labels `start..start + len` on the device.
    fn slice(&self, start: usize, len: usize) -> Result<(Tensor, Tensor)> {
        Ok(match self {
            BatchInput::Host {
                images,
                labels,
                device,
            } => (
                Tensor::from_slice(
                    &images[start * IMAGE_BYTES..(start + len) * IMAGE_BYTES],
                    (len, 3, 32, 32),
                    device,
                )?,
                Tensor::from_slice(&labels[start..start + len], len, device)?,
            ),
            BatchInput::Device { x, y } => (x.narrow(0, start, len)?, y.narrow(0, start, len)?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mean_weights_micro_batches_equally_and_sums_correct_counts() {
        let r = MicroResult::mean(&[
            MicroResult {
                loss: 1.0,
                correct: 2,
            },
            MicroResult {
                loss: 3.0,
                correct: 5,
            },
        ]);
        assert_eq!(r.loss, 2.0);
        assert_eq!(r.correct, 7);
    }

    #[test]
    fn micro_batches_are_the_batch_in_order() -> Result<()> {
        let dev = Device::Cpu;
        let n = 6;
        let images: Vec<f32> = (0..n * IMAGE_BYTES).map(|i| i as f32).collect();
        let labels: Vec<u32> = (0..n as u32).collect();
        let batch = BatchInput::Host {
            images: &images,
            labels: &labels,
            device: &dev,
        };
        let seen = (0..3)
            .map(|i| {
                let (x, y) = batch.micro_batch(i, 3)?;
                Ok((y.to_vec1::<u32>()?, x.dims().to_vec()))
            })
            .collect::<Result<Vec<_>>>()?;
        assert_eq!(
            seen,
            vec![
                (vec![0, 1], vec![2, 3, 32, 32]),
                (vec![2, 3], vec![2, 3, 32, 32]),
                (vec![4, 5], vec![2, 3, 32, 32]),
            ]
        );
        let err = batch.micro_batch(0, 4).unwrap_err();
        assert!(err.to_string().contains("cannot be split into 4"), "{err}");
        Ok(())
    }
}
