//! What a measurement holds besides training's own allocations: the data set's size as far as
//! memory is concerned ([`DataSize`], found from the files without loading them), the runtime's
//! overhead on the CPU, and the [`Baseline`] an estimate starts from (modelled or measured).

use crate::config::TrainConfig;
use crate::data::RECORD_BYTES;
use crate::error::Result;
use std::path::Path;

/// Bytes the process holds besides the data set and the model when training begins on the CPU
/// (argument parsing, the candle thread pool, progress bars, the memory log, standard I/O
/// buffers). Measured: the CPU probe's baseline minus the data set and the model (22 KB with
/// real CIFAR-10 and with synthetic data, once the generator's templates are counted).
pub(crate) const RUNTIME_OVERHEAD_BYTES: u64 = 24 << 10;

/// Bytes the synthetic data generator keeps for the life of the process once it has run
/// (`src/data/synthetic.rs`): 10 class templates of 3 × 38 × 38 f32 (the image plus a 3-pixel
/// shift margin on each side) and their 30 plane means.
pub(crate) const SYNTHETIC_TEMPLATE_BYTES: u64 = (10 * 3 * 38 * 38 + 10 * 3) * 4;

/// Whether `cfg` trains on the built-in synthetic data (no `--download`, no `--data-dir` and no
/// `data/cifar-10-batches-bin`), as [`crate::data::load`] decides.
pub(crate) fn uses_synthetic_data(cfg: &TrainConfig) -> bool {
    !cfg.data.download
        && cfg.data.data_dir.is_none()
        && !Path::new(crate::data::DEFAULT_DATA_DIR).is_dir()
}

/// The data set as far as memory is concerned: how many images each split holds and how many
/// bytes the loaded splits occupy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataSize {
    /// Training images (batches per epoch follow from it).
    pub train_images: usize,
    /// Evaluation images (test or validation split).
    pub test_images: usize,
    /// Heap bytes of both loaded splits (pixels and labels; the loaders allocate them exactly).
    pub resident_bytes: u64,
}

impl DataSize {
    /// Splits of `train` and `test` images held exactly (pixels plus one label byte each), as the
    /// validation split produces them.
    pub fn exact(train_images: usize, test_images: usize) -> Self {
        DataSize {
            train_images,
            test_images,
            // Saturating: a count no machine holds must compare as too large, not wrap.
            resident_bytes: (train_images as u64)
                .saturating_add(test_images as u64)
                .saturating_mul(RECORD_BYTES as u64),
        }
    }

    /// Synthetic splits: held exactly, plus the generator's templates
    /// ([`SYNTHETIC_TEMPLATE_BYTES`]).
    pub fn synthetic(train_images: usize, test_images: usize) -> Self {
        let mut d = DataSize::exact(train_images, test_images);
        d.resident_bytes = d.resident_bytes.saturating_add(SYNTHETIC_TEMPLATE_BYTES);
        d
    }

    /// The size of loaded splits (their allocated capacity), plus the synthetic generator's
    /// templates when `cfg` trains on synthetic data.
    pub fn loaded(
        train: &crate::data::Dataset,
        test: &crate::data::Dataset,
        cfg: &TrainConfig,
    ) -> Self {
        let bytes = |d: &crate::data::Dataset| (d.images.capacity() + d.labels.capacity()) as u64;
        let generator = if uses_synthetic_data(cfg) {
            SYNTHETIC_TEMPLATE_BYTES
        } else {
            0
        };
        DataSize {
            train_images: train.len(),
            test_images: test.len(),
            resident_bytes: bytes(train) + bytes(test) + generator,
        }
    }

    /// The data the config will load, found without loading it: the synthetic sizes, the record
    /// counts of the CIFAR-10 files in `--data-dir` (or `data/cifar-10-batches-bin`), or the full
    /// CIFAR-10 for `--download`.
    ///
    /// # Errors
    /// When a data directory is named but holds no readable CIFAR-10 training files.
    pub(crate) fn for_config(cfg: &TrainConfig) -> Result<Self> {
        if cfg.data.download {
            return Ok(DataSize::exact(50_000, 10_000));
        }
        let default_dir = Path::new(crate::data::DEFAULT_DATA_DIR);
        let dir = match &cfg.data.data_dir {
            Some(d) => Some(d.as_path()),
            None if default_dir.is_dir() => Some(default_dir),
            None => None,
        };
        match dir {
            Some(d) => DataSize::for_dir(d, cfg.data.val_fraction),
            None => Ok(DataSize::synthetic(
                cfg.data.synthetic_train,
                cfg.data.synthetic_test,
            )),
        }
    }

    /// Sizes of a CIFAR-10 binary directory, from the file sizes ([`crate::data::cifar::scan_dir`],
    /// which also refuses files that are not CIFAR-10 binary files).
    pub(super) fn for_dir(dir: &Path, val_fraction: f64) -> Result<Self> {
        let files = crate::data::cifar::scan_dir(dir)?;
        Ok(DataSize::for_files(&files, val_fraction))
    }

    /// Sizes of the checked files of a CIFAR-10 binary directory, as
    /// [`crate::data::cifar::load_dir`] holds them: each split exactly.
    pub(crate) fn for_files(files: &crate::data::cifar::DirFiles, val_fraction: f64) -> Self {
        let n = files.train_images();
        match &files.test {
            Some((_, test)) => DataSize::exact(n, *test),
            None => {
                let (train, val) = crate::data::cifar::split_sizes(n, val_fraction);
                DataSize::exact(train, val)
            }
        }
    }
}

/// What is measured besides training's own allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Baseline {
    /// Model the process baseline from the data set (CPU) or from nothing but the model (CUDA).
    Modeled(DataSize),
    /// A measured baseline: the bytes in use when training begins (data set, model, runtime),
    /// e.g. `MemoryLog::baseline_bytes` of an earlier run. The batches in flight, which the
    /// batcher allocates after that reading, are still added.
    Measured {
        /// Bytes in use when training began.
        bytes: u64,
        /// Training images (for the number of prefetched batches).
        train_images: usize,
        /// Evaluation images (the evaluation's batch and its batcher's order).
        eval_images: usize,
    },
}
