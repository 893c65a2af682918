//! Data loading: CIFAR-10 binary files (good and bad), synthetic data, and the batcher.

mod common;

use memtrain::data::batcher::num_batches;
use memtrain::data::{
    cifar, load, normalize_into, synthetic, Batch, Batcher, BatcherOptions, DataOptions, Dataset,
    CIFAR_MEAN, CIFAR_STD, IMAGE_BYTES, NUM_CLASSES, RECORD_BYTES,
};
use memtrain::Error;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A fresh directory under the system temp dir, removed on drop (also when a test fails).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("memtrain-data-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A pixel value that depends on record, channel and position, so mix-ups show.
fn pixel(record: usize, c: usize, y: usize, x: usize) -> u8 {
    ((record * 7 + c * 50 + y * 3 + x * 5) % 256) as u8
}

/// CIFAR binary bytes for `labels`, pixels from [`pixel`] offset by `first` (the global record index).
fn records(first: usize, labels: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(labels.len() * RECORD_BYTES);
    for (i, &l) in labels.iter().enumerate() {
        out.push(l);
        for c in 0..3 {
            for y in 0..32 {
                for x in 0..32 {
                    out.push(pixel(first + i, c, y, x));
                }
            }
        }
    }
    out
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).expect("write test file");
    p
}

fn labels_for(first: usize, n: usize) -> Vec<u8> {
    (first..first + n)
        .map(|i| (i % NUM_CLASSES) as u8)
        .collect()
}

/// The error's one-line message, for checking what it says.
fn message<T: std::fmt::Debug>(r: Result<T, Error>) -> String {
    let e = r.expect_err("expected an error");
    e.to_string()
}

fn opts(batch_size: usize) -> BatcherOptions {
    BatcherOptions {
        batch_size,
        shuffle: false,
        augment: false,
        drop_last: false,
        seed: 0,
        epoch: 0,
        prefetch: 2,
        start_batch: 0,
        recycle: None,
    }
}

fn collect(data: &Arc<Dataset>, o: BatcherOptions) -> Vec<Batch> {
    Batcher::new(Arc::clone(data), o).collect()
}

// ---------------------------------------------------------------- CIFAR binary files

#[test]
fn read_file_exact_pixels_and_labels() {
    let dir = TempDir::new("read");
    let labels = [3u8, 0, 9, 5];
    let path = write(dir.path(), "data_batch_1.bin", &records(0, &labels));
    let ds = cifar::read_file(&path).unwrap();
    assert_eq!(ds.len(), 4);
    assert_eq!(ds.labels, labels);
    assert_eq!(ds.images.len(), 4 * IMAGE_BYTES);
    for (r, &label) in labels.iter().enumerate() {
        assert_eq!(ds.label(r), label);
        let img = ds.image(r);
        for c in 0..3 {
            for y in [0, 7, 31] {
                for x in [0, 13, 31] {
                    assert_eq!(
                        img[c * 1024 + y * 32 + x],
                        pixel(r, c, y, x),
                        "record {r} c{c} y{y} x{x}"
                    );
                }
            }
        }
    }
}

#[test]
fn channel_planes_map_to_normalized_channels() {
    // One image whose R, G, B planes are constant 10, 128, 250, with one marked pixel per plane.
    let mut rec = vec![7u8];
    for (c, v) in [10u8, 128, 250].into_iter().enumerate() {
        let mut plane = vec![v; 1024];
        plane[5 * 32 + 9] = 60 + c as u8;
        rec.extend_from_slice(&plane);
    }
    let dir = TempDir::new("planes");
    let path = write(dir.path(), "data_batch_1.bin", &rec);
    let ds = Arc::new(cifar::read_file(&path).unwrap());
    let batch = collect(&ds, opts(8)).remove(0);
    assert_eq!(batch.len, 1);
    assert_eq!(batch.labels, vec![7]);
    assert_eq!(batch.images.len(), 3 * 32 * 32);
    for (c, v) in [10u8, 128, 250].into_iter().enumerate() {
        let expect = (v as f32 / 255.0 - CIFAR_MEAN[c]) / CIFAR_STD[c];
        assert_eq!(batch.images[c * 1024], expect, "channel {c} plain pixel");
        let marked = ((60 + c as u8) as f32 / 255.0 - CIFAR_MEAN[c]) / CIFAR_STD[c];
        assert_eq!(
            batch.images[c * 1024 + 5 * 32 + 9],
            marked,
            "channel {c} marked pixel (row 5, col 9)"
        );
    }
    let mut out = vec![0f32; IMAGE_BYTES];
    normalize_into(ds.image(0), &mut out);
    assert_eq!(out, batch.images);
}

#[test]
fn subset_without_test_file_holds_out_seeded_validation() {
    let dir = TempDir::new("subset");
    write(
        dir.path(),
        "data_batch_1.bin",
        &records(0, &labels_for(0, 50)),
    );
    let a = cifar::load_dir(dir.path(), 0.1, 3).unwrap();
    assert!(a.test_is_validation);
    assert_eq!(a.test.len(), 5);
    assert_eq!(a.train.len(), 45);
    assert!(
        a.description.contains("data_batch_1.bin"),
        "{}",
        a.description
    );
    assert!(
        a.description.contains("no test_batch.bin"),
        "{}",
        a.description
    );
    assert!(
        a.description.contains("holding out 5 (10%)"),
        "{}",
        a.description
    );
    assert!(a.description.contains("seed 3"), "{}", a.description);

    // Deterministic for a seed.
    let b = cifar::load_dir(dir.path(), 0.1, 3).unwrap();
    assert_eq!(a.train, b.train);
    assert_eq!(a.test, b.test);

    // Disjoint and complete: identify images by their first pixel (= record * 7 mod 256, unique below 37).
    let (train_idx, val_idx) = cifar::validation_split(50, 0.1, 3);
    assert_eq!(val_idx.len(), 5);
    let mut all: Vec<usize> = train_idx.iter().chain(&val_idx).copied().collect();
    all.sort_unstable();
    assert_eq!(all, (0..50).collect::<Vec<_>>());
    for (k, &i) in val_idx.iter().enumerate() {
        assert_eq!(a.test.image(k)[..64], records(i, &[0])[1..65]);
        assert_eq!(a.test.label(k), (i % 10) as u8);
    }

    // Another seed, another split; at least one image always held out.
    let (_, other) = cifar::validation_split(50, 0.1, 4);
    assert_ne!(other, val_idx);
    let (t, v) = cifar::validation_split(5, 0.01, 0);
    assert_eq!((t.len(), v.len()), (4, 1));
}

#[test]
fn full_layout_uses_test_batch_and_sorted_batches() {
    let dir = TempDir::new("full");
    // Written out of order, with a stray file that must be ignored.
    write(
        dir.path(),
        "data_batch_2.bin",
        &records(3, &labels_for(3, 4)),
    );
    write(
        dir.path(),
        "data_batch_1.bin",
        &records(0, &labels_for(0, 3)),
    );
    write(dir.path(), "test_batch.bin", &records(100, &[9, 8]));
    write(dir.path(), "data_batch_1.bin.bak", b"junk");
    write(dir.path(), "batches.meta.txt", b"airplane\n");
    let s = cifar::load_dir(dir.path(), 0.1, 0).unwrap();
    assert!(!s.test_is_validation);
    assert_eq!(s.train.len(), 7);
    assert_eq!(s.train.labels, labels_for(0, 7));
    assert_eq!(s.train.image(4)[..100], records(4, &[0])[1..101]);
    assert_eq!(s.test.labels, vec![9, 8]);
    assert_eq!(s.test.image(1)[..100], records(101, &[0])[1..101]);
    assert!(
        s.description.contains("data_batch_1.bin, data_batch_2.bin"),
        "{}",
        s.description
    );
    assert!(
        s.description.contains("2 test images from test_batch.bin"),
        "{}",
        s.description
    );

    // `load` with a data_dir goes to the same place.
    let via_load = load(&DataOptions {
        data_dir: Some(dir.path().to_path_buf()),
        ..DataOptions::default()
    })
    .unwrap();
    assert_eq!(via_load.train, s.train);
    assert_eq!(via_load.test, s.test);
}

#[test]
fn missing_directory_is_an_error_with_the_fix() {
    let dir = TempDir::new("missing");
    let gone = dir.path().join("nope");
    let msg = message(cifar::load_dir(&gone, 0.1, 0));
    assert!(
        msg.contains("nope") && msg.contains("does not exist"),
        "{msg}"
    );
    assert!(
        msg.contains("cifar-10-binary.tar.gz") && msg.contains("--data-dir"),
        "{msg}"
    );
}

#[test]
fn file_instead_of_directory_is_an_error() {
    let dir = TempDir::new("notdir");
    let f = write(dir.path(), "data_batch_1.bin", &records(0, &[1]));
    let msg = message(cifar::load_dir(&f, 0.1, 0));
    assert!(
        msg.contains("data_batch_1.bin") && msg.contains("not a directory"),
        "{msg}"
    );
}

#[test]
fn directory_without_training_files_is_an_error() {
    let dir = TempDir::new("nofiles");
    write(dir.path(), "test_batch.bin", &records(0, &[1, 2]));
    write(dir.path(), "data_batch_x.bin", &records(0, &[1]));
    let msg = message(cifar::load_dir(dir.path(), 0.1, 0));
    assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
    assert!(
        msg.contains("data_batch_1.bin") && msg.contains("data_batch_5.bin"),
        "{msg}"
    );

    // Pointing at the parent of cifar-10-batches-bin gets a hint.
    let parent = TempDir::new("parent");
    std::fs::create_dir(parent.path().join("cifar-10-batches-bin")).unwrap();
    let msg = message(cifar::load_dir(parent.path(), 0.1, 0));
    assert!(msg.contains("did you mean --data-dir"), "{msg}");
}

#[test]
fn empty_file_is_an_error() {
    let dir = TempDir::new("empty");
    write(dir.path(), "data_batch_1.bin", &records(0, &[1]));
    write(dir.path(), "data_batch_2.bin", b"");
    let msg = message(cifar::load_dir(dir.path(), 0.1, 0));
    assert!(
        msg.contains("data_batch_2.bin") && msg.contains("empty"),
        "{msg}"
    );
}

#[test]
fn truncated_file_names_size_and_offset() {
    let dir = TempDir::new("trunc");
    let mut bytes = records(0, &[1, 2, 3]);
    bytes.truncate(2 * RECORD_BYTES + 100);
    let p = write(dir.path(), "data_batch_3.bin", &bytes);
    let msg = message(cifar::read_file(&p));
    assert!(msg.contains("data_batch_3.bin"), "{msg}");
    assert!(
        msg.contains(&format!("size {} bytes", 2 * RECORD_BYTES + 100)),
        "{msg}"
    );
    assert!(msg.contains("multiple of 3073"), "{msg}");
    assert!(
        msg.contains(&format!("offset {} is truncated", 2 * RECORD_BYTES)),
        "{msg}"
    );
    // Through load_dir too.
    let msg = message(cifar::load_dir(dir.path(), 0.1, 0));
    assert!(
        msg.contains("data_batch_3.bin") && msg.contains("6146"),
        "{msg}"
    );
}

#[test]
fn label_out_of_range_names_offset_and_value() {
    let dir = TempDir::new("label");
    let mut bytes = records(0, &[1, 2, 3]);
    bytes[2 * RECORD_BYTES] = 10;
    write(dir.path(), "data_batch_1.bin", &records(0, &[1]));
    write(dir.path(), "test_batch.bin", &bytes);
    let msg = message(cifar::load_dir(dir.path(), 0.1, 0));
    assert!(msg.contains("test_batch.bin"), "{msg}");
    assert!(msg.contains("label 10"), "{msg}");
    assert!(
        msg.contains(&format!("byte offset {}", 2 * RECORD_BYTES)),
        "{msg}"
    );
}

#[test]
fn unreadable_file_and_bad_fraction_are_errors() {
    let dir = TempDir::new("io");
    assert!(matches!(
        cifar::read_file(&dir.path().join("absent.bin")),
        Err(Error::Core(memtrain::error::CoreError::Io { .. }))
    ));
    write(dir.path(), "data_batch_1.bin", &records(0, &[1, 2]));
    assert!(matches!(
        cifar::load_dir(dir.path(), 1.5, 0),
        Err(Error::Core(memtrain::error::CoreError::Config(_)))
    ));
    assert!(matches!(
        cifar::load_dir(dir.path(), f64::NAN, 0),
        Err(Error::Core(memtrain::error::CoreError::Config(_)))
    ));
    // One image cannot be split into train and validation.
    let one = TempDir::new("one");
    write(one.path(), "data_batch_1.bin", &records(0, &[1]));
    let msg = message(cifar::load_dir(one.path(), 0.1, 0));
    assert!(msg.contains("at least 2"), "{msg}");
}

#[test]
fn real_subset_when_present() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/cifar10-subset");
    if !dir.is_dir() {
        println!(
            "skipping: {} not found (real CIFAR-10 subset is optional)",
            dir.display()
        );
        return;
    }
    let s = cifar::load_dir(&dir, 0.1, 0).unwrap();
    assert_eq!(s.train.len() + s.test.len(), 4660);
    assert!(s.test_is_validation, "the subset has no test_batch.bin");
    assert_eq!(s.test.len(), 466);
    assert!(s.train.labels.iter().chain(&s.test.labels).all(|&l| l <= 9));
    let counts = s.train.class_counts();
    assert!(
        counts.iter().all(|&c| c > 300),
        "every class present: {counts:?}"
    );
    println!("{}", s.description);
}

// ---------------------------------------------------------------- synthetic data

#[test]
fn synthetic_is_deterministic_balanced_and_shaped() {
    let a = synthetic::generate(203, 5);
    assert_eq!(a, synthetic::generate(203, 5));
    assert_eq!(a.len(), 203);
    assert_eq!(a.images.len(), 203 * IMAGE_BYTES);
    let counts = a.class_counts();
    assert_eq!(counts.iter().sum::<usize>(), 203);
    assert!(counts.iter().all(|&c| c == 20 || c == 21), "{counts:?}");
    assert_ne!(a, synthetic::generate(203, 6));
    // No two images alike, and pixels use a wide range.
    assert_ne!(a.image(0), a.image(1));
    let (lo, hi) = a
        .images
        .iter()
        .fold((255u8, 0u8), |(lo, hi), &p| (lo.min(p), hi.max(p)));
    assert!(lo < 30 && hi > 225, "pixel range {lo}..{hi}");

    let (train, test) = synthetic::splits(100, 50, 5);
    assert_eq!((train.len(), test.len()), (100, 50));
    assert_ne!(train.images[..IMAGE_BYTES * 50], test.images[..]);
}

/// Per-class mean image of `ds` as f32.
fn class_means(ds: &Dataset) -> Vec<Vec<f32>> {
    let mut sums = vec![vec![0f32; IMAGE_BYTES]; NUM_CLASSES];
    let counts = ds.class_counts();
    for i in 0..ds.len() {
        for (s, &p) in sums[ds.label(i) as usize].iter_mut().zip(ds.image(i)) {
            *s += p as f32;
        }
    }
    for (s, n) in sums.iter_mut().zip(counts) {
        s.iter_mut().for_each(|v| *v /= n.max(1) as f32);
    }
    sums
}

#[test]
fn synthetic_is_learnable_but_not_trivial() {
    // A nearest-class-mean classifier fitted on one seed's train set must do well on the test
    // stream (shared templates), showing the classes are learnable; images are still noisy.
    let (train, test) = synthetic::splits(1000, 300, 11);
    let means = class_means(&train);
    let mut correct = 0;
    for i in 0..test.len() {
        let img = test.image(i);
        let best = (0..NUM_CLASSES)
            .min_by(|&a, &b| {
                let d = |m: &[f32]| {
                    m.iter()
                        .zip(img)
                        .map(|(m, &p)| (m - p as f32).powi(2))
                        .sum::<f32>()
                };
                d(&means[a]).total_cmp(&d(&means[b]))
            })
            .unwrap();
        correct += (best == test.label(i) as usize) as usize;
    }
    let acc = correct as f64 / test.len() as f64;
    assert!(acc > 0.6, "nearest-mean accuracy {acc}");
    // Two images of the same class differ by much more than rounding.
    let same: Vec<usize> = (0..train.len())
        .filter(|&i| train.label(i) == 0)
        .take(2)
        .collect();
    let diff: f64 = train
        .image(same[0])
        .iter()
        .zip(train.image(same[1]))
        .map(|(&a, &b)| (a as f64 - b as f64).abs())
        .sum::<f64>()
        / IMAGE_BYTES as f64;
    assert!(diff > 10.0, "mean abs difference {diff}");
}

#[test]
fn load_falls_back_to_synthetic() {
    // Only when the default directory is absent (it is ignored by git, but a developer may have it).
    if Path::new(memtrain::data::DEFAULT_DATA_DIR).is_dir() {
        println!(
            "skipping: {} exists, load() would use it",
            memtrain::data::DEFAULT_DATA_DIR
        );
        return;
    }
    let o = DataOptions {
        synthetic_train: 30,
        synthetic_test: 20,
        seed: 2,
        ..DataOptions::default()
    };
    let s = load(&o).unwrap();
    assert_eq!((s.train.len(), s.test.len()), (30, 20));
    assert!(!s.test_is_validation);
    assert!(s.description.contains("synthetic"), "{}", s.description);
    assert_eq!(s.train, synthetic::splits(30, 20, 2).0);
}

// ---------------------------------------------------------------- batcher

fn small_data(n: usize) -> Arc<Dataset> {
    Arc::new(synthetic::generate(n, 1))
}

#[test]
fn num_batches_and_drop_last() {
    assert_eq!(num_batches(10, 4, false), 3);
    assert_eq!(num_batches(10, 4, true), 2);
    assert_eq!(num_batches(8, 4, true), 2);
    assert_eq!(num_batches(0, 4, false), 0);
    assert_eq!(num_batches(3, 4, true), 0);
    assert_eq!(num_batches(3, 0, false), 0);

    let data = small_data(10);
    let keep: Vec<usize> = collect(&data, opts(4)).iter().map(|b| b.len).collect();
    assert_eq!(keep, vec![4, 4, 2]);
    let mut o = opts(4);
    o.drop_last = true;
    let b = Batcher::new(Arc::clone(&data), o);
    assert_eq!(b.num_batches(), 2);
    assert_eq!(b.len(), 2);
    let dropped: Vec<Batch> = b.collect();
    assert_eq!(
        dropped.iter().map(|b| b.len).collect::<Vec<_>>(),
        vec![4, 4]
    );
    assert_eq!(
        dropped.iter().map(|b| b.index).collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert!(dropped
        .iter()
        .all(|b| b.images.len() == 4 * IMAGE_BYTES && b.labels.len() == 4));
}

#[test]
fn plain_batches_equal_the_normalized_dataset_in_order() {
    let data = small_data(23);
    let batches = collect(&data, opts(5));
    let images: Vec<f32> = batches
        .iter()
        .flat_map(|b| b.images.iter().copied())
        .collect();
    let labels: Vec<u32> = batches
        .iter()
        .flat_map(|b| b.labels.iter().copied())
        .collect();
    let mut expect = vec![0f32; data.len() * IMAGE_BYTES];
    for (i, out) in expect.chunks_exact_mut(IMAGE_BYTES).enumerate() {
        normalize_into(data.image(i), out);
    }
    assert_eq!(images, expect);
    assert_eq!(
        labels,
        data.labels.iter().map(|&l| l as u32).collect::<Vec<_>>()
    );
}

fn train_opts(batch_size: usize) -> BatcherOptions {
    BatcherOptions {
        shuffle: true,
        augment: true,
        seed: 42,
        epoch: 3,
        ..opts(batch_size)
    }
}

fn same(a: &[Batch], b: &[Batch]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.images == y.images && x.labels == y.labels && x.index == y.index)
}

#[test]
fn shuffled_augmented_epochs_are_deterministic() {
    let data = small_data(60);
    let a = collect(&data, train_opts(8));
    let b = collect(
        &data,
        BatcherOptions {
            prefetch: 1,
            ..train_opts(8)
        },
    );
    assert!(same(&a, &b));
    // Another epoch or seed changes order and augmentation.
    let c = collect(
        &data,
        BatcherOptions {
            epoch: 4,
            ..train_opts(8)
        },
    );
    assert!(!same(&a, &c));
    let d = collect(
        &data,
        BatcherOptions {
            seed: 43,
            ..train_opts(8)
        },
    );
    assert!(!same(&a, &d));
    // Shuffling is a permutation: every label still appears as often.
    let mut la: Vec<u32> = a.iter().flat_map(|b| b.labels.clone()).collect();
    let mut lp: Vec<u32> = data.labels.iter().map(|&l| l as u32).collect();
    assert_ne!(la, lp, "shuffled order differs from dataset order");
    la.sort_unstable();
    lp.sort_unstable();
    assert_eq!(la, lp);
}

#[test]
fn start_batch_resumes_exactly() {
    let data = small_data(50);
    let full = collect(&data, train_opts(6));
    assert_eq!(full.len(), 9);
    for k in [1, 4, 8] {
        let rest = collect(
            &data,
            BatcherOptions {
                start_batch: k,
                ..train_opts(6)
            },
        );
        assert!(same(&full[k..], &rest), "start_batch {k}");
        assert_eq!(
            Batcher::new(
                Arc::clone(&data),
                BatcherOptions {
                    start_batch: k,
                    ..train_opts(6)
                }
            )
            .num_batches(),
            9
        );
    }
    assert!(collect(
        &data,
        BatcherOptions {
            start_batch: 99,
            ..train_opts(6)
        }
    )
    .is_empty());
}

#[test]
fn augmentation_changes_images_but_keeps_labels_aligned() {
    let data = small_data(64);
    let plain = collect(
        &data,
        BatcherOptions {
            shuffle: false,
            augment: false,
            ..opts(64)
        },
    )
    .remove(0);
    let aug = collect(
        &data,
        BatcherOptions {
            shuffle: false,
            augment: true,
            seed: 7,
            ..opts(64)
        },
    )
    .remove(0);
    assert_eq!(plain.labels, aug.labels);
    let changed = (0..64)
        .filter(|&i| {
            plain.images[i * IMAGE_BYTES..(i + 1) * IMAGE_BYTES]
                != aug.images[i * IMAGE_BYTES..(i + 1) * IMAGE_BYTES]
        })
        .count();
    assert!(changed > 50, "only {changed} of 64 images changed");

    // Every augmented image is some flip + reflect-padded shift (|dx|,|dy| <= 4) of its own image.
    let mut flips = 0;
    for i in 0..64 {
        let src = &plain.images[i * IMAGE_BYTES..(i + 1) * IMAGE_BYTES];
        let out = &aug.images[i * IMAGE_BYTES..(i + 1) * IMAGE_BYTES];
        let found = (0..2)
            .flat_map(|f| (0..9).flat_map(move |ox| (0..9).map(move |oy| (f == 1, ox, oy))))
            .find(|&(flip, ox, oy)| {
                let refl = |i: usize| -> usize {
                    let i = i as isize - 4;
                    (if i < 0 {
                        -i
                    } else if i > 31 {
                        62 - i
                    } else {
                        i
                    }) as usize
                };
                (0..3).all(|c| {
                    (0..32).all(|y| {
                        (0..32).all(|x| {
                            let xx = if flip { 31 - x } else { x };
                            out[c * 1024 + y * 32 + x]
                                == src[c * 1024 + refl(y + oy) * 32 + refl(xx + ox)]
                        })
                    })
                })
            });
        let (flip, _, _) =
            found.unwrap_or_else(|| panic!("image {i} is not a flip/shift of its source"));
        flips += flip as usize;
    }
    assert!((12..=52).contains(&flips), "{flips} of 64 flipped");
}

#[test]
fn dropping_mid_epoch_returns_promptly() {
    let data = small_data(2000);
    let start = Instant::now();
    for prefetch in [1, 4] {
        let mut b = Batcher::new(
            Arc::clone(&data),
            BatcherOptions {
                prefetch,
                ..train_opts(10)
            },
        );
        assert!(b.next().is_some());
        // Let the worker fill the channel and block on send.
        std::thread::sleep(Duration::from_millis(20));
        drop(b);
    }
    // Dropped before anything was taken.
    drop(Batcher::new(Arc::clone(&data), train_opts(10)));
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "drop took {:?}",
        start.elapsed()
    );
}

#[test]
fn empty_dataset_gives_no_batches() {
    let data = Arc::new(Dataset::default());
    assert!(collect(&data, train_opts(4)).is_empty());
    assert!(collect(&data, opts(0)).is_empty());
}

/// Recycled image buffers give the same batches whatever `prefetch` (0: no thread), and a pool
/// that gets every buffer back keeps at most the batches in flight alive, `prefetch + 1` (the
/// trainer's steady state allocates none).
#[test]
fn recycled_buffers_give_the_same_batches() {
    use memtrain::data::BufferPool;
    let data = small_data(64);
    let plain = collect(&data, train_opts(8));
    for prefetch in [0, 1, 3] {
        let pool = BufferPool::new();
        let mut recycled = Vec::new();
        let mut addresses = std::collections::HashSet::new();
        for b in Batcher::new(
            Arc::clone(&data),
            BatcherOptions {
                recycle: Some(pool.clone()),
                prefetch,
                ..train_opts(8)
            },
        ) {
            addresses.insert(b.images.as_ptr() as usize);
            recycled.push((b.images.clone(), b.labels.clone(), b.index));
            // Let the worker fill everything it may before the buffer comes back.
            std::thread::sleep(Duration::from_millis(2));
            pool.put(b.images);
        }
        assert_eq!(recycled.len(), plain.len());
        for ((images, labels, index), p) in recycled.iter().zip(&plain) {
            assert_eq!(images, &p.images, "prefetch {prefetch}: batch {index}");
            assert_eq!(labels, &p.labels);
            assert_eq!(*index, p.index);
        }
        // The one held here and `prefetch` built ahead; never a new buffer per batch.
        assert!(
            addresses.len() <= prefetch + 1,
            "prefetch {prefetch}: {} distinct buffers",
            addresses.len()
        );
    }
}

#[test]
fn an_accuracy_over_a_handful_of_images_says_so() {
    // 20 images with a 1% validation split: one image is held out, so the accuracy moves in
    // steps of 100 points; the result line says that rather than print "100.00%" bare.
    let dir = TempDir::new("tiny-val");
    let labels: Vec<u8> = (0..20).map(|i| (i % 10) as u8).collect();
    write(dir.path(), "data_batch_1.bin", &records(0, &labels));
    let out = common::run_trainer(&[
        "--data-dir",
        dir.path().to_str().unwrap(),
        "--val-fraction",
        "0.01",
        "--batch-size",
        "4",
        "--width",
        "4",
        "--quiet",
        "--out",
        dir.path().join("run").to_str().unwrap(),
    ]);
    common::assert_ok(&out, "training on 19 images");
    let stdout = common::text(&out.stdout);
    assert!(
        stdout.contains("validation accuracy")
            && stdout.contains("(on only 1 image, 100 points each"),
        "{stdout}"
    );
    let s: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("run/summary.json")).unwrap())
            .unwrap();
    assert_eq!(s["eval_images"], 1);
}
