//! Turns a [`Dataset`] into normalized f32 batches, prepared ahead on a background thread.
//!
//! This is the tf.data `prefetch` idea: while the model trains on batch i, a worker thread
//! shuffles, augments and normalizes batch i+1 (up to `prefetch` batches ahead: one it has built
//! and waits to hand over, the rest in a bounded channel; with `prefetch` 0 there is no thread,
//! and each batch is built when it is asked for). Every random choice is seeded from (seed, epoch) for the order and from
//! (seed, epoch, batch index) for augmentation, so the batches are identical whatever the thread
//! timing and wherever an epoch is resumed with `start_batch`.

use super::{mix_seed, Dataset, IMAGE_BYTES};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

/// Per-channel mean of CIFAR-10 training pixels (in 0..1), used for normalization.
pub const CIFAR_MEAN: [f32; 3] = [0.4914, 0.4822, 0.4465];
/// Per-channel standard deviation of CIFAR-10 training pixels (in 0..1), used for normalization.
pub const CIFAR_STD: [f32; 3] = [0.2470, 0.2435, 0.2616];

/// Tag of the epoch permutation's RNG stream.
const ORDER_TAG: u64 = 0x0DE2_0000;
/// Tag of the per-batch augmentation RNG stream.
const AUGMENT_TAG: u64 = 0xA06_0000;
/// Reflect padding of the random translation, in pixels.
const PAD: usize = 4;
/// Pixels per channel plane.
const PLANE: usize = 32 * 32;

/// One batch of normalized images with their labels.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Normalized f32, `[len, 3, 32, 32]` row-major.
    pub images: Vec<f32>,
    /// Class labels, one per image.
    pub labels: Vec<u32>,
    /// Number of images in the batch (the last one may be short unless `drop_last`).
    pub len: usize,
    /// Index of this batch within the epoch.
    pub index: usize,
}

/// How a [`Batcher`] walks through a dataset for one epoch.
#[derive(Debug, Clone)]
pub struct BatcherOptions {
    /// Images per batch; 0 yields no batches.
    pub batch_size: usize,
    /// Visit the images in a seeded random order (else in dataset order, for evaluation).
    pub shuffle: bool,
    /// Random horizontal flip and reflect-padded translation by up to 4 pixels.
    pub augment: bool,
    /// Leave out a last batch smaller than `batch_size`.
    pub drop_last: bool,
    /// Seed of the order and the augmentation.
    pub seed: u64,
    /// Epoch number; with the seed it picks the order and the augmentation.
    pub epoch: usize,
    /// Batches prepared ahead of the one being used, on a background thread; 0: no thread, a
    /// batch is built when `next` asks for it. Batches alive at once: `prefetch + 1`.
    pub prefetch: usize,
    /// Skip the first N batches of the epoch (for resuming mid-epoch); the remaining batches are
    /// identical to those of an unskipped run.
    pub start_batch: usize,
    /// Image buffers to reuse (the trainer gives each batch's buffer back after its step), so
    /// that in steady state the worker allocates nothing while a step runs and the heap a step
    /// sees does not depend on when the worker wakes up. `None`: a new buffer per batch.
    pub recycle: Option<BufferPool>,
}

/// Image buffers shared by a [`Batcher`]'s worker (taker) and the trainer (giver), across epochs.
#[derive(Debug, Clone, Default)]
pub struct BufferPool(std::sync::Arc<std::sync::Mutex<Vec<Vec<f32>>>>);

impl BufferPool {
    /// An empty pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// Give a buffer back for a later batch.
    pub fn put(&self, buf: Vec<f32>) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(buf);
    }

    /// A zeroed buffer of `len` elements: a pooled one when one is large enough, else a new one.
    fn take(&self, len: usize) -> Vec<f32> {
        let found = {
            let mut pool = self.0.lock().unwrap_or_else(|e| e.into_inner());
            let i = pool.iter().position(|b| b.capacity() >= len);
            i.map(|i| pool.swap_remove(i))
        };
        match found {
            Some(mut b) => {
                b.clear();
                b.resize(len, 0.0);
                b
            }
            None => vec![0f32; len],
        }
    }
}

impl Default for BatcherOptions {
    /// Batches of 128 in dataset order, no augmentation, [`crate::config::DEFAULT_PREFETCH_CUDA`] batches ahead.
    fn default() -> Self {
        BatcherOptions {
            batch_size: 128,
            shuffle: false,
            augment: false,
            drop_last: false,
            seed: 0,
            epoch: 0,
            prefetch: crate::config::DEFAULT_PREFETCH_CUDA,
            start_batch: 0,
            recycle: None,
        }
    }
}

/// Number of batches an epoch of `len` images has: the last partial batch counts unless
/// `drop_last`. A `batch_size` of 0 gives 0.
pub fn num_batches(len: usize, batch_size: usize, drop_last: bool) -> usize {
    if batch_size == 0 {
        0
    } else if drop_last {
        len / batch_size
    } else {
        len.div_ceil(batch_size)
    }
}

/// The normalization formula for one pixel of channel `c`; every normalized value in this module
/// is computed by exactly this f32 expression, so callers can reproduce it bit for bit.
fn normalize_pixel(p: u8, c: usize) -> f32 {
    (p as f32 / 255.0 - CIFAR_MEAN[c]) / CIFAR_STD[c]
}

/// `normalize_pixel` for every byte value and channel, so a batch costs one lookup per pixel.
fn lut() -> &'static [[f32; 256]; 3] {
    static LUT: OnceLock<[[f32; 256]; 3]> = OnceLock::new();
    LUT.get_or_init(|| {
        std::array::from_fn(|c| std::array::from_fn(|p| normalize_pixel(p as u8, c)))
    })
}

/// Normalize one image (no augmentation) into `out` (3072 f32).
///
/// Each value is `(pixel / 255 - CIFAR_MEAN[c]) / CIFAR_STD[c]` computed in f32, channel `c`
/// being the plane (R, G, B) the byte sits in. Panics if `img` or `out` is shorter than 3072.
pub fn normalize_into(img: &[u8], out: &mut [f32]) {
    let lut = lut();
    let (img, out) = (&img[..IMAGE_BYTES], &mut out[..IMAGE_BYTES]);
    for c in 0..3 {
        let table = &lut[c];
        for (o, &p) in out[c * PLANE..(c + 1) * PLANE]
            .iter_mut()
            .zip(&img[c * PLANE..(c + 1) * PLANE])
        {
            *o = table[p as usize];
        }
    }
}

/// Reflect an index of the padded image back into 0..32 (numpy/PyTorch "reflect": the edge pixel
/// is not repeated). `i` is in 0..32 + 2 * PAD.
fn reflect(i: usize) -> usize {
    let i = i as isize - PAD as isize;
    let r = if i < 0 {
        -i
    } else if i > 31 {
        62 - i
    } else {
        i
    };
    r as usize
}

/// Normalize one image into `out` after cropping 32x32 at (`ox`, `oy`) (each 0..=8) from its
/// 4-pixel reflect-padded version, then mirroring it horizontally if `flip`.
fn augment_into(img: &[u8], out: &mut [f32], flip: bool, ox: usize, oy: usize) {
    let lut = lut();
    let mut src_x = [0usize; 32];
    for (x, s) in src_x.iter_mut().enumerate() {
        let xx = if flip { 31 - x } else { x };
        *s = reflect(xx + ox);
    }
    for c in 0..3 {
        let table = &lut[c];
        let plane = &img[c * PLANE..(c + 1) * PLANE];
        for y in 0..32 {
            let row = &plane[reflect(y + oy) * 32..][..32];
            let out_row = &mut out[c * PLANE + y * 32..][..32];
            for (o, &sx) in out_row.iter_mut().zip(&src_x) {
                *o = table[row[sx] as usize];
            }
        }
    }
}

/// Builds batch `i` of the epoch from the dataset; shared by the worker thread and the inline
/// fallback.
struct Producer {
    data: Arc<Dataset>,
    /// Dataset indices in epoch order.
    order: Vec<usize>,
    batch_size: usize,
    augment: bool,
    seed: u64,
    epoch: usize,
    recycle: Option<BufferPool>,
}

impl Producer {
    fn batch(&self, index: usize) -> Batch {
        let start = (index * self.batch_size).min(self.order.len());
        let end = (start + self.batch_size).min(self.order.len());
        let ids = &self.order[start..end];
        let mut images = match &self.recycle {
            Some(pool) => pool.take(ids.len() * IMAGE_BYTES),
            None => vec![0f32; ids.len() * IMAGE_BYTES],
        };
        let mut labels = Vec::with_capacity(ids.len());
        // One RNG per batch, seeded from its index, so a batch never depends on the ones before it.
        let mut rng = self.augment.then(|| {
            StdRng::seed_from_u64(mix_seed(&[
                self.seed,
                AUGMENT_TAG,
                self.epoch as u64,
                index as u64,
            ]))
        });
        for (&i, out) in ids.iter().zip(images.chunks_exact_mut(IMAGE_BYTES)) {
            let img = self.data.image(i);
            match rng.as_mut() {
                Some(rng) => {
                    let flip = rng.random_bool(0.5);
                    let ox = rng.random_range(0..=2 * PAD);
                    let oy = rng.random_range(0..=2 * PAD);
                    augment_into(img, out, flip, ox, oy);
                }
                None => normalize_into(img, out),
            }
            labels.push(self.data.label(i) as u32);
        }
        Batch {
            images,
            len: ids.len(),
            labels,
            index,
        }
    }
}

/// Where batches come from: normally the worker thread; if the OS refuses a thread, they are
/// built on demand in `next` instead (slower, same batches).
enum Source {
    Thread {
        rx: Option<Receiver<Batch>>,
        handle: Option<JoinHandle<()>>,
    },
    Inline(Arc<Producer>),
}

/// Heap bytes of one epoch's shared records besides its order of the images ([`Batcher::new`]):
/// the producer and the stop flag, each in an `Arc`. (With `--prefetch`, the worker thread's and
/// the channel's records come on top; they are not counted.)
pub fn epoch_record_bytes() -> u64 {
    arc_bytes::<Producer>() + arc_bytes::<AtomicBool>()
}

/// Heap bytes of an `Arc<T>`: its two counts and the value, aligned.
fn arc_bytes<T>() -> u64 {
    let align = std::mem::align_of::<T>().max(std::mem::align_of::<usize>());
    (2 * std::mem::size_of::<usize>() + std::mem::size_of::<T>()).next_multiple_of(align) as u64
}

/// An iterator over the batches of one epoch, prepared ahead on a background thread.
///
/// Dropping it early stops and joins the thread.
pub struct Batcher {
    source: Source,
    num_batches: usize,
    /// Index of the next batch `next` returns.
    next: usize,
    /// Asks the worker to stop before building another batch.
    stop: Arc<AtomicBool>,
}

impl Batcher {
    /// Start producing the batches of one epoch of `data`.
    pub fn new(data: Arc<Dataset>, opts: BatcherOptions) -> Batcher {
        // Only whole (image, label) pairs: a hand-built dataset with a short image buffer must not
        // make the worker index out of bounds.
        let len = data.len().min(data.images.len() / IMAGE_BYTES);
        let num_batches = num_batches(len, opts.batch_size, opts.drop_last);
        let mut order: Vec<usize> = (0..len).collect();
        if opts.shuffle {
            let mut rng =
                StdRng::seed_from_u64(mix_seed(&[opts.seed, ORDER_TAG, opts.epoch as u64]));
            order.shuffle(&mut rng);
        }
        // Shared, read-only: the worker holds one handle, and ours stays usable if spawning fails.
        let producer = Arc::new(Producer {
            data,
            order,
            batch_size: opts.batch_size,
            augment: opts.augment,
            seed: opts.seed,
            epoch: opts.epoch,
            recycle: opts.recycle.clone(),
        });
        let start = opts.start_batch.min(num_batches);
        let stop = Arc::new(AtomicBool::new(false));
        if opts.prefetch == 0 {
            return Batcher {
                source: Source::Inline(producer),
                num_batches,
                next: start,
                stop,
            };
        }
        // The worker holds one finished batch while it waits to send: the channel holds the rest.
        let (tx, rx) = sync_channel(opts.prefetch - 1);
        let worker_stop = Arc::clone(&stop);
        let worker = Arc::clone(&producer);
        let spawned = std::thread::Builder::new()
            .name("memtrain-batcher".into())
            .spawn(move || {
                for index in start..num_batches {
                    if worker_stop.load(Ordering::Relaxed) {
                        break;
                    }
                    // A failed send means the Batcher was dropped: stop quietly.
                    if tx.send(worker.batch(index)).is_err() {
                        break;
                    }
                }
            });
        let source = match spawned {
            Ok(handle) => Source::Thread {
                rx: Some(rx),
                handle: Some(handle),
            },
            Err(_) => Source::Inline(producer),
        };
        Batcher {
            source,
            num_batches,
            next: start,
            stop,
        }
    }

    /// Total number of batches in the epoch, including skipped ones.
    pub fn num_batches(&self) -> usize {
        self.num_batches
    }
}

impl Iterator for Batcher {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        if self.next >= self.num_batches {
            return None;
        }
        let batch = match &mut self.source {
            Source::Inline(producer) => Some(producer.batch(self.next)),
            Source::Thread { rx, handle } => match rx.as_ref().map(|rx| rx.recv()) {
                Some(Ok(batch)) => Some(batch),
                _ => {
                    // The worker ended before the epoch did: only a panic does that. Surface it
                    // here instead of silently ending the epoch short.
                    if let Some(h) = handle.take() {
                        if let Err(panic) = h.join() {
                            std::panic::resume_unwind(panic);
                        }
                    }
                    None
                }
            },
        };
        if batch.is_some() {
            self.next += 1;
        } else {
            self.next = self.num_batches;
        }
        batch
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.num_batches - self.next;
        (left, Some(left))
    }
}

impl ExactSizeIterator for Batcher {}

impl Drop for Batcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Source::Thread { rx, handle } = &mut self.source {
            // Dropping the receiver makes a blocked `send` fail, so the worker exits at once.
            drop(rx.take());
            if let Some(h) = handle.take() {
                // A worker panic was already reported by the panic hook; re-raising it inside
                // drop could abort the process, so it is ignored here.
                let _ = h.join();
            }
        }
    }
}
