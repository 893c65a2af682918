//! Training data: CIFAR-10 binary files, learnable synthetic data, and the prefetching batcher.
//!
//! [`load`] picks the source (hub download, a CIFAR-10 binary directory, or synthetic images) and
//! returns a train split plus a test or validation split, both as plain bytes in [`Dataset`]. The
//! [`Batcher`] turns a dataset into normalized f32 batches on a background thread.

pub mod batcher;
pub mod cifar;
pub mod synthetic;

pub use batcher::{
    normalize_into, Batch, Batcher, BatcherOptions, BufferPool, CIFAR_MEAN, CIFAR_STD,
};

use crate::config::TrainConfig;
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub use memtrain_core::model::{IMAGE_BYTES, NUM_CLASSES};
/// Bytes of one record in a CIFAR-10 binary file: 1 label byte followed by [`IMAGE_BYTES`] pixels.
pub const RECORD_BYTES: usize = 3073;

/// Where [`load`] looks for CIFAR-10 when neither `--data-dir` nor `--download` is given
/// (relative to the current directory).
pub const DEFAULT_DATA_DIR: &str = "data/cifar-10-batches-bin";

/// The URL of the CIFAR-10 binary version, for error messages and docs.
pub(crate) const CIFAR_BINARY_URL: &str = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz";

/// Images in CIFAR layout: per image 3072 bytes = R plane, G plane, B plane, each 32x32 row-major.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Dataset {
    /// `len() * IMAGE_BYTES` pixel bytes, image after image.
    pub images: Vec<u8>,
    /// One label (0..=9) per image.
    pub labels: Vec<u8>,
}

impl Dataset {
    /// An empty dataset with room for exactly `n` images.
    pub(crate) fn with_capacity(n: usize) -> Dataset {
        Dataset {
            images: Vec::with_capacity(n * IMAGE_BYTES),
            labels: Vec::with_capacity(n),
        }
    }

    /// Append one image: its label and its [`IMAGE_BYTES`] pixels.
    pub(crate) fn push(&mut self, label: u8, pixels: &[u8]) {
        self.labels.push(label);
        self.images.extend_from_slice(pixels);
    }

    /// Number of images (the number of labels).
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when the dataset holds no images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The 3072 pixel bytes of image `i` (R, G, B planes).
    ///
    /// Panics if `i >= len()` or `images` is shorter than `len() * IMAGE_BYTES`; the loaders in
    /// this module always produce consistent datasets.
    pub fn image(&self, i: usize) -> &[u8] {
        &self.images[i * IMAGE_BYTES..(i + 1) * IMAGE_BYTES]
    }

    /// Image count and the hashes of the labels and pixels, as one string: a checkpoint's
    /// run continues only on data with the same fingerprint, wherever it is stored.
    pub(crate) fn fingerprint(&self) -> String {
        format!(
            "{}:{:016x}:{:016x}",
            self.len(),
            crate::io::hash_bytes(&self.labels),
            crate::io::hash_bytes(&self.images)
        )
    }

    /// The label of image `i`. Panics if `i >= len()`.
    pub fn label(&self, i: usize) -> u8 {
        self.labels[i]
    }

    /// A new dataset holding the images at `indices`, in that order. Panics on an index out of range.
    pub fn subset(&self, indices: &[usize]) -> Dataset {
        let mut images = Vec::with_capacity(indices.len() * IMAGE_BYTES);
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            images.extend_from_slice(self.image(i));
            labels.push(self.label(i));
        }
        Dataset { images, labels }
    }

    /// How many images each class has.
    pub fn class_counts(&self) -> [usize; NUM_CLASSES] {
        let mut counts = [0; NUM_CLASSES];
        for &l in &self.labels {
            if let Some(c) = counts.get_mut(l as usize) {
                *c += 1;
            }
        }
        counts
    }
}

/// Where the data comes from and how it is split; built from the training config.
#[derive(Debug, Clone)]
pub struct DataOptions {
    /// CIFAR-10 binary directory (any subset of its files); `None` means [`DEFAULT_DATA_DIR`] if
    /// present, else synthetic data.
    pub data_dir: Option<PathBuf>,
    /// Fetch the full CIFAR-10 through candle-datasets' Hugging Face hub loader.
    pub download: bool,
    /// Fraction of the training images held out for validation when there is no test_batch.bin.
    pub val_fraction: f64,
    /// Seed of the validation split and of the synthetic data.
    pub seed: u64,
    /// Number of synthetic training images (used only when there is no real data).
    pub synthetic_train: usize,
    /// Number of synthetic test images.
    pub synthetic_test: usize,
    /// Set by the Ctrl-C/SIGTERM handler ([`crate::signal::install_stop_handler`]): loading
    /// looks at it between files, chunks and batches of synthetic images and gives up with
    /// [`Error::Interrupted`]. `None`: loading cannot be stopped.
    pub stop: Option<Arc<AtomicBool>>,
}

impl DataOptions {
    /// The data settings of `config`; `stop` as [`DataOptions::stop`].
    pub(crate) fn for_config(config: &TrainConfig, stop: Option<Arc<AtomicBool>>) -> Self {
        DataOptions {
            data_dir: config.data.data_dir.clone(),
            download: config.data.download,
            val_fraction: config.data.val_fraction,
            seed: config.seed,
            synthetic_train: config.data.synthetic_train,
            synthetic_test: config.data.synthetic_test,
            stop,
        }
    }
}

impl Default for DataOptions {
    /// The data settings of the default [`TrainConfig`], loading that cannot be stopped.
    fn default() -> Self {
        DataOptions::for_config(&TrainConfig::default(), None)
    }
}

/// [`loading_interrupted`] once `stop` is set: loading ends before anything is written.
pub(crate) fn check_stop(stop: Option<&AtomicBool>) -> Result<()> {
    if stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
        return Err(loading_interrupted());
    }
    Ok(())
}

/// The error of a load given up on a signal.
fn loading_interrupted() -> Error {
    Error::Interrupted(
        "stopped while loading the data, before anything was written; run the command again to start"
            .into(),
    )
}

/// A train split and a test (or validation) split, with a line describing them.
#[derive(Debug, Clone)]
pub struct DataSplits {
    /// Images to train on.
    pub train: Dataset,
    /// Images to evaluate on.
    pub test: Dataset,
    /// One line announcing source and split, printed by the trainer.
    pub description: String,
    /// True when `test` is a held-out part of the training files.
    pub test_is_validation: bool,
}

/// Load the data the options ask for.
///
/// Order of preference: `download` (full CIFAR-10 through the hub), then `data_dir`, then
/// [`DEFAULT_DATA_DIR`] if it exists, else synthetic data.
pub fn load(opts: &DataOptions) -> Result<DataSplits> {
    let stop = opts.stop.as_deref();
    check_stop(stop)?;
    if opts.download {
        return cifar::download();
    }
    if let Some(dir) = &opts.data_dir {
        return cifar::load_dir_with_stop(dir, opts.val_fraction, opts.seed, stop);
    }
    let default_dir = Path::new(DEFAULT_DATA_DIR);
    if default_dir.is_dir() {
        return cifar::load_dir_with_stop(default_dir, opts.val_fraction, opts.seed, stop);
    }
    if opts.synthetic_train == 0 || opts.synthetic_test == 0 {
        return Err(Error::config(format!(
            "--synthetic-train and --synthetic-test must be positive (got {} and {})",
            opts.synthetic_train, opts.synthetic_test
        )));
    }
    // A count whose bytes do not even have an address is refused here rather than left to
    // abort in the allocator; whether a possible size fits is `crate::predict::bounds`'s concern.
    for (flag, n) in [
        ("--synthetic-train", opts.synthetic_train),
        ("--synthetic-test", opts.synthetic_test),
    ] {
        if n.checked_mul(IMAGE_BYTES)
            .is_none_or(|b| b > isize::MAX as usize)
        {
            return Err(Error::config(format!(
                "{flag} {n} is absurdly large: its images would not fit in any memory; use a count of at most a few million"
            )));
        }
    }
    let generate =
        |n, seed| synthetic::generate_with_stop(n, seed, stop).ok_or_else(loading_interrupted);
    let train = generate(opts.synthetic_train, opts.seed)?;
    let test = generate(opts.synthetic_test, synthetic::test_seed(opts.seed))?;
    let description = format!(
        "synthetic CIFAR-shaped data (no {DEFAULT_DATA_DIR}; pass --data-dir or --download for real \
         CIFAR-10): {} train, {} test images (seed {})",
        train.len(),
        test.len(),
        opts.seed
    );
    Ok(DataSplits {
        train,
        test,
        description,
        test_is_validation: false,
    })
}

/// Training images that [`load`] will give for `opts` when they come from CIFAR-10 files, counted
/// from the files' sizes without reading them; `None` for synthetic data (its size is a flag) and
/// for the hub download (known only once fetched). Sweeps bound their search with it.
pub(crate) fn real_train_images(opts: &DataOptions) -> Result<Option<usize>> {
    let default_dir = Path::new(DEFAULT_DATA_DIR);
    let dir = match &opts.data_dir {
        _ if opts.download => return Ok(None),
        Some(dir) => dir.as_path(),
        None if default_dir.is_dir() => default_dir,
        None => return Ok(None),
    };
    let files = cifar::scan_dir(dir)?;
    let n = files.train_images();
    Ok(Some(match files.test {
        Some(_) => n,
        None => cifar::split_sizes(n, opts.val_fraction).0,
    }))
}

/// One step of splitmix64: a strong 64-bit mixer, so nearby seeds give unrelated streams.
fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Mix a tuple of values into one RNG seed. Every random stream in this module is seeded from a
/// tuple (seed, purpose tag, epoch, batch, ...) so that it depends on nothing else — in particular
/// not on thread timing or on where an epoch was resumed.
pub(crate) fn mix_seed(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0x6A09_E667_F3BC_C908, |h, &p| splitmix64(h ^ splitmix64(p)))
}
