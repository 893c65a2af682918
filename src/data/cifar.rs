//! CIFAR-10 in its binary version: `data_batch_1.bin` .. `data_batch_5.bin` and `test_batch.bin`,
//! each a sequence of 3073-byte records (1 label byte, then the R, G and B planes of a 32x32 image).
//!
//! candle-datasets has a reader for these files too, but it insists on all six files of exactly
//! 10,000 records and reports a short file as a bare I/O error. This reader accepts any subset of
//! the training files, checks size and labels, and names the file and byte offset of any problem.
//! candle-datasets is still used for `--download` (its Hugging Face hub loader), in a build with
//! the `download` cargo feature; without it [`download`] is a usage error.

use super::{
    mix_seed, DataSplits, Dataset, CIFAR_BINARY_URL, IMAGE_BYTES, NUM_CLASSES, RECORD_BYTES,
};
use crate::error::{Error, Result};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

/// The name of the test file in a CIFAR-10 binary directory.
pub(crate) const TEST_FILE: &str = "test_batch.bin";

/// Tag mixed into the seed of the validation split, so it differs from every other stream.
const SPLIT_TAG: u64 = 0x5711_7000;

/// How to get the data by hand; appended to errors about missing data.
fn how_to_get() -> String {
    format!(
        "download the binary version from {CIFAR_BINARY_URL} and run `tar xzf cifar-10-binary.tar.gz -C data/` \
         so that data/cifar-10-batches-bin exists, or pass --data-dir DIR"
    )
}

/// Records in one file of the CIFAR-10 binary version: `data_batch_1.bin` .. `data_batch_5.bin`
/// and `test_batch.bin` hold 10,000 each. A larger file is none of them, and is refused before a
/// byte of it is read (a multi-GB file would otherwise be read into memory whole).
pub(crate) const MAX_RECORDS_PER_FILE: usize = 10_000;

/// Records read at once (4 MiB of them): loading holds one buffer of this many records (or of
/// the largest file, when smaller) beside the data set, and looks at the stop flag between two.
const CHUNK_RECORDS: usize = (4 << 20) / RECORD_BYTES;

/// Bytes of the read buffer that loading files of `records` records each holds beside the data.
pub(crate) fn read_buffer_bytes(records: impl IntoIterator<Item = usize>) -> usize {
    records.into_iter().max().unwrap_or(0).min(CHUNK_RECORDS) * RECORD_BYTES
}

/// What a non-regular file is, for messages.
fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// The number of records of a CIFAR-10 binary file with metadata `meta`, checked before it is
/// read: a regular file (a FIFO would block, a device never end), not empty, a whole number of
/// records, at most [`MAX_RECORDS_PER_FILE`] of them.
fn checked_records(path: &Path, meta: &std::fs::Metadata) -> Result<usize> {
    let data_err = |msg: String| Error::Data {
        path: path.to_path_buf(),
        msg,
    };
    if !meta.is_file() {
        return Err(data_err(format!(
            "is {}, not a regular file; a CIFAR-10 binary file is a regular file of {RECORD_BYTES}-byte \
             records — re-extract it from {CIFAR_BINARY_URL}",
            file_kind(meta)
        )));
    }
    let len = meta.len();
    if len == 0 {
        return Err(data_err(format!(
            "file is empty; a CIFAR-10 binary file holds records of {RECORD_BYTES} bytes \
             (1 label byte + {IMAGE_BYTES} pixel bytes); re-extract it from {CIFAR_BINARY_URL}"
        )));
    }
    let record = RECORD_BYTES as u64;
    let rem = len % record;
    if rem != 0 {
        let last = len - rem;
        return Err(data_err(format!(
            "size {len} bytes is not a multiple of {RECORD_BYTES} (1 label byte + {IMAGE_BYTES} pixel bytes): \
             the last record at byte offset {last} is truncated ({rem} of {RECORD_BYTES} bytes); \
             the file is damaged or not CIFAR-10 binary — re-extract it from {CIFAR_BINARY_URL}"
        )));
    }
    let records = len / record;
    if records > MAX_RECORDS_PER_FILE as u64 {
        return Err(data_err(format!(
            "size {len} bytes is {records} records, more than the {MAX_RECORDS_PER_FILE} of any \
             CIFAR-10 binary file ({} bytes); it is not one of data_batch_1.bin .. data_batch_5.bin \
             or {TEST_FILE} — re-extract them from {CIFAR_BINARY_URL}",
            MAX_RECORDS_PER_FILE * RECORD_BYTES
        )));
    }
    Ok(records as usize)
}

/// Check a CIFAR-10 binary file without reading it, from its metadata only (which does not block
/// on a FIFO; symlinks are followed): it must be a regular, non-empty file of whole 3073-byte
/// records, at most [`MAX_RECORDS_PER_FILE`]. Returns the number of records.
///
/// Errors name the file: missing or unreadable, not a regular file, empty, a size that is not a
/// multiple of 3073 bytes (with the offset of the truncated last record), or too large.
pub(crate) fn check_file(path: &Path) -> Result<usize> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    checked_records(path, &meta)
}

/// Read one CIFAR-10 binary file (any number of records up to [`MAX_RECORDS_PER_FILE`]).
///
/// The file is checked first ([`check_file`]), and only that many bytes are read. Errors name
/// the file; besides those of [`check_file`], a label above 9 (with its byte offset and value).
pub fn read_file(path: &Path) -> Result<Dataset> {
    read_file_with_stop(path, None)
}

/// [`read_file`], giving up with [`Error::Interrupted`] between chunks once `stop` is set.
pub(crate) fn read_file_with_stop(path: &Path, stop: Option<&AtomicBool>) -> Result<Dataset> {
    let records = check_file(path)?;
    let mut data = Dataset::with_capacity(records);
    let mut buf = vec![0u8; read_buffer_bytes([records])];
    read_records(path, records, &mut buf, stop, |label, pixels| {
        data.push(label, pixels)
    })?;
    Ok(data)
}

/// Read the `records` records of the CIFAR-10 binary file at `path`, as [`check_file`] counted
/// them, through `buf` (sized by [`read_buffer_bytes`]) a chunk at a time, handing each record's
/// label and pixels to `put` in file order. Errors name the file: a label above 9 (with its byte
/// offset), a size changed since the check, or the I/O error.
fn read_records(
    path: &Path,
    records: usize,
    buf: &mut Vec<u8>,
    stop: Option<&AtomicBool>,
    mut put: impl FnMut(u8, &[u8]),
) -> Result<()> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    // O_NONBLOCK: should the path have become a FIFO since it was checked, opening it returns at
    // once (and the check below refuses it) instead of waiting for a writer. It changes nothing
    // for a regular file.
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if checked_records(path, &meta)? != records {
        return Err(changed(path));
    }
    let mut done = 0;
    while done < records {
        super::check_stop(stop)?;
        let n = (records - done).min(CHUNK_RECORDS);
        if buf.len() < n * RECORD_BYTES {
            buf.resize(n * RECORD_BYTES, 0);
        }
        let chunk = &mut buf[..n * RECORD_BYTES];
        file.read_exact(chunk).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => changed(path),
            _ => Error::io(path, e),
        })?;
        for (i, record) in chunk.chunks_exact(RECORD_BYTES).enumerate() {
            let label = record[0];
            if label as usize >= NUM_CLASSES {
                let i = done + i;
                return Err(Error::Data {
                    path: path.to_path_buf(),
                    msg: format!(
                        "label {label} at byte offset {} (record {i}) is out of range 0..={}; this is not a \
                         CIFAR-10 binary file (CIFAR-100's binary version has 2 label bytes per record)",
                        i * RECORD_BYTES,
                        NUM_CLASSES - 1
                    ),
                });
            }
            put(label, &record[1..]);
        }
        done += n;
    }
    // A file that grew since it was checked has a byte more.
    let mut more = [0u8; 1];
    loop {
        match file.read(&mut more) {
            Ok(0) => return Ok(()),
            Ok(_) => return Err(changed(path)),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(path, e)),
        }
    }
}

/// The error for a file whose size changed while it was being read.
fn changed(path: &Path) -> Error {
    Error::Data {
        path: path.to_path_buf(),
        msg: "the file changed size while it was read; run again once nothing writes to it".into(),
    }
}

/// The training files present in `dir`, as (batch number, path), sorted by number.
fn training_files(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(num) = name
            .strip_prefix("data_batch_")
            .and_then(|s| s.strip_suffix(".bin"))
        else {
            continue;
        };
        // Only data_batch_N.bin with a plain decimal N; anything else (backups, the python version's
        // extension-less files) is not ours to guess about.
        if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(n) = num.parse::<u64>() else { continue };
        files.push((n, entry.path()));
    }
    files.sort();
    Ok(files)
}

/// Hints for a directory without training files: the usual mistakes are pointing at the parent of
/// `cifar-10-batches-bin` or at the python version of the dataset.
fn missing_files_hint(dir: &Path) -> String {
    if dir.join("cifar-10-batches-bin").is_dir() {
        return format!(
            "; did you mean --data-dir {}?",
            dir.join("cifar-10-batches-bin").display()
        );
    }
    if dir.join("data_batch_1").is_file() {
        return "; this looks like the python version (data_batch_1 without .bin), memtrain reads the binary version"
            .to_string();
    }
    String::new()
}

/// Format a fraction as a percentage without float noise ("10", "12.5").
fn percent(frac: f64) -> String {
    let pct = frac * 100.0;
    if (pct - pct.round()).abs() < 1e-9 {
        format!("{:.0}", pct.round())
    } else {
        format!("{pct:.1}")
    }
}

/// How many of `n` images [`validation_split`] leaves for training and holds out for validation.
pub(crate) fn split_sizes(n: usize, val_fraction: f64) -> (usize, usize) {
    let n_val = ((n as f64 * val_fraction).round() as usize)
        .max(1)
        .min(n.saturating_sub(1));
    (n - n_val, n_val)
}

/// `0..n` in the seeded order the validation split is drawn from.
fn split_order(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = StdRng::seed_from_u64(mix_seed(&[seed, SPLIT_TAG]));
    order.shuffle(&mut rng);
    order
}

/// Split `n` images into (train, validation) index lists: shuffle `0..n` with the seed and take
/// the first round(n * frac) (at least 1, and leaving at least 1 for training) as validation.
/// Both lists are returned in file order.
pub fn validation_split(n: usize, val_fraction: f64, seed: u64) -> (Vec<usize>, Vec<usize>) {
    let order = split_order(n, seed);
    let n_val = split_sizes(n, val_fraction).1;
    let mut val = order[..n_val].to_vec();
    let mut train = order[n_val..].to_vec();
    val.sort_unstable();
    train.sort_unstable();
    (train, val)
}

/// [`validation_split`] as one flag per image, true for those held out: loading sends each
/// record to its split as it is read.
fn validation_mask(n: usize, val_fraction: f64, seed: u64) -> Vec<bool> {
    let order = split_order(n, seed);
    let mut held_out = vec![false; n];
    for &i in &order[..split_sizes(n, val_fraction).1] {
        held_out[i] = true;
    }
    held_out
}

/// The files of a CIFAR-10 binary directory that [`load_dir`] reads, each checked by
/// [`check_file`] but none read yet: their record counts size the data set before it is loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DirFiles {
    /// `data_batch_N.bin` in order of N, with their numbers of records.
    pub train: Vec<(PathBuf, usize)>,
    /// `test_batch.bin` with its number of records, when the directory has one.
    pub test: Option<(PathBuf, usize)>,
}

impl DirFiles {
    /// Images in all training files.
    pub fn train_images(&self) -> usize {
        self.train.iter().map(|(_, n)| n).sum()
    }
}

/// Find and check the files of a CIFAR-10 binary directory without reading them: `dir` must be
/// a directory holding at least one `data_batch_N.bin`, and every training file and
/// `test_batch.bin` (if present) must pass [`check_file`].
pub(crate) fn scan_dir(dir: &Path) -> Result<DirFiles> {
    let data_err = |msg: String| Error::Data {
        path: dir.to_path_buf(),
        msg,
    };
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(data_err(format!(
                "directory does not exist; {}",
                how_to_get()
            )));
        }
        Err(e) => return Err(Error::io(dir, e)),
        Ok(m) if !m.is_dir() => {
            let kind = if m.is_file() { "a file" } else { file_kind(&m) };
            return Err(data_err(format!(
                "is {kind}, not a directory; --data-dir takes the directory that holds \
                 data_batch_1.bin .. data_batch_5.bin and test_batch.bin (e.g. data/cifar-10-batches-bin)"
            )));
        }
        Ok(_) => {}
    }

    let files = training_files(dir)?;
    if files.is_empty() {
        return Err(data_err(format!(
            "no CIFAR-10 training files: expected data_batch_1.bin .. data_batch_5.bin (any subset) \
             and optionally {TEST_FILE}{}; {}",
            missing_files_hint(dir),
            how_to_get()
        )));
    }
    let mut train = Vec::with_capacity(files.len());
    for (_, path) in files {
        let n = check_file(&path)?;
        train.push((path, n));
    }
    let test_path = dir.join(TEST_FILE);
    let test = match std::fs::metadata(&test_path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::io(&test_path, e)),
        Ok(m) => Some((test_path.clone(), checked_records(&test_path, &m)?)),
    };
    Ok(DirFiles { train, test })
}

/// Load a CIFAR-10 binary directory holding any subset of `data_batch_N.bin`, plus
/// `test_batch.bin` if present. Without `test_batch.bin`, a seeded `val_fraction` of the training
/// images is held out for validation (and `test_is_validation` is set). Every file is checked
/// ([`scan_dir`]) before the first is read.
pub fn load_dir(dir: &Path, val_fraction: f64, seed: u64) -> Result<DataSplits> {
    load_dir_with_stop(dir, val_fraction, seed, None)
}

/// [`load_dir`], giving up with [`Error::Interrupted`] between files and chunks once `stop` is
/// set (by the Ctrl-C/SIGTERM handler).
///
/// Both splits are allocated at their exact sizes, known from the checked files, and each record
/// is read into its split through one read buffer ([`read_buffer_bytes`]): loading holds the
/// data set, that buffer and, for a validation split, one byte per training image.
pub fn load_dir_with_stop(
    dir: &Path,
    val_fraction: f64,
    seed: u64,
    stop: Option<&AtomicBool>,
) -> Result<DataSplits> {
    if !(val_fraction > 0.0 && val_fraction < 1.0) {
        // Written this way round so NaN fails too.
        return Err(Error::config(format!(
            "--val-fraction must be in (0, 1), got {val_fraction}"
        )));
    }
    let files = scan_dir(dir)?;
    let n = files.train_images();
    // Without a test file, the validation split is drawn before a byte is read.
    let held_out = match &files.test {
        Some(_) => None,
        None if n < 2 => {
            return Err(Error::Data {
                path: dir.to_path_buf(),
                msg: format!(
                    "only {n} training image(s) and no {TEST_FILE}: need at least 2 images to hold out a validation split"
                ),
            });
        }
        None => Some(validation_mask(n, val_fraction, seed)),
    };
    let (n_train, n_test) = match &files.test {
        Some((_, test)) => (n, *test),
        None => split_sizes(n, val_fraction),
    };
    let mut train = Dataset::with_capacity(n_train);
    let mut test = Dataset::with_capacity(n_test);
    let all = files.train.iter().chain(&files.test);
    let mut buf = vec![0u8; read_buffer_bytes(all.map(|(_, n)| *n))];
    let mut index = 0;
    for (path, records) in &files.train {
        read_records(path, *records, &mut buf, stop, |label, pixels| {
            let to_test = held_out
                .as_ref()
                .is_some_and(|h| h.get(index).copied().unwrap_or(false));
            index += 1;
            let split = if to_test { &mut test } else { &mut train };
            split.push(label, pixels);
        })?;
    }
    if let Some((path, records)) = &files.test {
        read_records(path, *records, &mut buf, stop, |label, pixels| {
            test.push(label, pixels)
        })?;
    }
    drop(buf);

    let names: Vec<String> = files
        .train
        .iter()
        .map(|(path, _)| {
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
        .collect();
    let names = names.join(", ");
    let description = match held_out {
        None => format!(
            "CIFAR-10 from {}: {} train images from {names}; {} test images from {TEST_FILE}",
            dir.display(),
            train.len(),
            test.len()
        ),
        Some(_) => format!(
            "CIFAR-10 from {}: {} train images from {names}; no {TEST_FILE}, holding out {} ({}%) for validation (seed {seed})",
            dir.display(),
            train.len(),
            test.len(),
            percent(val_fraction)
        ),
    };
    Ok(DataSplits {
        test_is_validation: held_out.is_some(),
        train,
        test,
        description,
    })
}

// The conversion of the hub loader's tensors below is compiled in every build, so that its unit
// test runs without the `download` feature; only the loader itself needs candle-datasets.

/// Where the hub loader gets the data from, used as the "path" of download errors.
#[cfg_attr(not(feature = "download"), allow(dead_code))]
const HUB_SOURCE: &str = "https://huggingface.co/datasets/cifar10";

/// Download the full CIFAR-10 (50,000 train, 10,000 test images) through candle-datasets' hub
/// loader and convert it to [`Dataset`]s.
///
/// Any failure (offline, no cache) becomes one error line telling how to get the binary version
/// by hand.
#[cfg(feature = "download")]
pub fn download() -> Result<DataSplits> {
    let fail = |why: String| Error::Data {
        path: PathBuf::from(HUB_SOURCE),
        msg: format!("download failed ({why}); instead, {}", how_to_get()),
    };
    // candle-datasets unwraps the PNG decoding of each image; a corrupt cache would panic inside it.
    // Catch that so the user gets the same one-line error as for any other download failure.
    let loaded = std::panic::catch_unwind(candle_datasets::vision::cifar::load)
        .map_err(|_| fail("the hub loader panicked while decoding the parquet files".to_string()))?
        .map_err(|e| fail(first_line(&e.to_string())))?;
    let train = hub_tensors_to_dataset(&loaded.train_images, &loaded.train_labels)
        .map_err(|e| fail(first_line(&e.to_string())))?;
    let test = hub_tensors_to_dataset(&loaded.test_images, &loaded.test_labels)
        .map_err(|e| fail(first_line(&e.to_string())))?;
    let description = format!(
        "CIFAR-10 from the Hugging Face hub: {} train images, {} test images",
        train.len(),
        test.len()
    );
    Ok(DataSplits {
        train,
        test,
        description,
        test_is_validation: false,
    })
}

/// Without the `download` feature there is no hub loader: the usage error
/// [`crate::config::DOWNLOAD_NOT_BUILT`] (which [`crate::TrainConfig::validate`] gives first).
#[cfg(not(feature = "download"))]
pub fn download() -> Result<DataSplits> {
    Err(Error::config(crate::config::DOWNLOAD_NOT_BUILT))
}

/// The first line of a possibly multi-line message, so errors stay one line.
#[cfg(feature = "download")]
fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").to_string()
}

/// Convert the hub loader's tensors to CIFAR byte layout.
///
/// The loader returns f32 images in 0..1 shaped `[n, 3, 32, 32]`, but built with
/// `permute((0, 3, 2, 1))` from image-rs's (height, width, channel) buffer, so its last two axes
/// are (width, height): transposing them back gives the row-major planes of the binary files.
#[cfg_attr(not(feature = "download"), allow(dead_code))]
fn hub_tensors_to_dataset(
    images: &candle_core::Tensor,
    labels: &candle_core::Tensor,
) -> Result<Dataset> {
    let path = PathBuf::from(HUB_SOURCE);
    let dims = images.dims().to_vec();
    if dims.len() != 4 || dims[1..] != [3, 32, 32] {
        return Err(Error::Data {
            path,
            msg: format!("unexpected image tensor shape {dims:?}, want [n, 3, 32, 32]"),
        });
    }
    let images = (images.transpose(2, 3)?.contiguous()? * 255.0)?
        .round()?
        .clamp(0f32, 255f32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let images: Vec<u8> = images.into_iter().map(|v| v as u8).collect();
    let labels = labels
        .flatten_all()?
        .to_dtype(candle_core::DType::U32)?
        .to_vec1::<u32>()?;
    if labels.len() * IMAGE_BYTES != images.len() {
        return Err(Error::Data {
            path,
            msg: format!(
                "{} labels for {} images",
                labels.len(),
                images.len() / IMAGE_BYTES
            ),
        });
    }
    let mut out = Vec::with_capacity(labels.len());
    for (i, &l) in labels.iter().enumerate() {
        if l as usize >= NUM_CLASSES {
            return Err(Error::Data {
                path,
                msg: format!("label {l} of image {i} is out of range 0..=9"),
            });
        }
        out.push(l as u8);
    }
    Ok(Dataset {
        images,
        labels: out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};

    /// Rebuild what candle-datasets' hub loader does to an image-rs (height, width, channel)
    /// buffer, and check the conversion recovers the binary files' R, G, B planes exactly.
    #[test]
    fn hub_tensors_convert_to_cifar_layout() {
        let n = 2;
        let pixel = |i: usize, c: usize, y: usize, x: usize| {
            ((i * 31 + c * 70 + y * 5 + x * 3) % 256) as u8
        };
        let mut hwc = Vec::with_capacity(n * IMAGE_BYTES);
        for i in 0..n {
            for y in 0..32 {
                for x in 0..32 {
                    for c in 0..3 {
                        hwc.push(pixel(i, c, y, x));
                    }
                }
            }
        }
        let images = (Tensor::from_vec(hwc, (n, 32, 32, 3), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .permute((0, 3, 2, 1))
            .unwrap()
            / 255.)
            .unwrap();
        let labels = Tensor::from_vec(vec![4u8, 9], n, &Device::Cpu).unwrap();
        let ds = hub_tensors_to_dataset(&images, &labels).unwrap();
        assert_eq!(ds.labels, vec![4, 9]);
        for i in 0..n {
            for c in 0..3 {
                for y in 0..32 {
                    for x in 0..32 {
                        assert_eq!(ds.image(i)[c * 1024 + y * 32 + x], pixel(i, c, y, x));
                    }
                }
            }
        }
        let bad = Tensor::from_vec(vec![10u8, 0], n, &Device::Cpu).unwrap();
        assert!(hub_tensors_to_dataset(&images, &bad).is_err());
    }
}
