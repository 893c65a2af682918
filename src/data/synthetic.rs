//! Learnable, CIFAR-shaped synthetic data for running without the real dataset.
//!
//! Each of the 10 classes has a fixed smooth colour template: a base colour from a hue wheel plus a
//! few low-frequency 2D sinusoids per channel. The templates come from a fixed seed, so every
//! dataset generated here (train, test, any user seed) shares them and a model trained on one
//! generalizes to another. Each image is its class template shifted by a few pixels, with a random
//! contrast and brightness jitter and per-pixel noise: a small CNN learns it quickly, yet no two
//! images are the same.

use super::{mix_seed, Dataset, IMAGE_BYTES, NUM_CLASSES};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};
use std::f32::consts::TAU;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// Seed of the class templates; fixed so that all synthetic datasets share them.
const TEMPLATE_SEED: u64 = 0xC1FA_2010_7E3B_1A7E;
/// Tag deriving the test stream from the user seed.
const TEST_TAG: u64 = 0x7E57_0000;
/// Largest per-image shift of the template, in pixels, in each direction.
const MAX_SHIFT: usize = 3;
/// Side of the stored template: the image plus room for the shift on each side.
const SIDE: usize = 32 + 2 * MAX_SHIFT;
/// Sinusoids per channel of a template.
const WAVES: usize = 3;
/// Half-width of the per-pixel noise (triangular distribution, standard deviation ≈ 16).
const NOISE: f32 = 40.0;

/// Class templates: `[class][channel][y][x]` over a `SIDE`x`SIDE` field, as pixel values (may
/// leave 0..255 before clamping).
fn templates() -> &'static Vec<f32> {
    static TEMPLATES: OnceLock<Vec<f32>> = OnceLock::new();
    TEMPLATES.get_or_init(|| {
        let mut t = vec![0f32; NUM_CLASSES * 3 * SIDE * SIDE];
        for class in 0..NUM_CLASSES {
            let mut rng = StdRng::seed_from_u64(mix_seed(&[TEMPLATE_SEED, class as u64]));
            // Base colours spread around a hue wheel, so even the mean colour separates classes
            // fairly well; alternate brightness so neighbours on the wheel differ more.
            let hue = TAU * class as f32 / NUM_CLASSES as f32;
            let level = if class % 2 == 0 { 110.0 } else { 145.0 };
            // Each wave: (frequency x, frequency y) in cycles per 32 pixels, phase, amplitude per channel.
            let waves: Vec<(f32, f32, f32, [f32; 3])> = (0..WAVES)
                .map(|_| {
                    let (fx, fy) = loop {
                        let fx = rng.random_range(-3i32..=3);
                        let fy = rng.random_range(0i32..=3);
                        if fx != 0 || fy != 0 {
                            break (fx as f32, fy as f32);
                        }
                    };
                    let phase = rng.random_range(0.0..TAU);
                    let amp = [0; 3].map(|_| rng.random_range(-40.0f32..40.0));
                    (fx, fy, phase, amp)
                })
                .collect();
            for c in 0..3 {
                let base = level + 55.0 * (hue - TAU * c as f32 / 3.0).cos();
                for y in 0..SIDE {
                    for x in 0..SIDE {
                        let mut v = base;
                        for &(fx, fy, phase, amp) in &waves {
                            v += amp[c]
                                * (TAU * (fx * x as f32 + fy * y as f32) / 32.0 + phase).sin();
                        }
                        t[((class * 3 + c) * SIDE + y) * SIDE + x] = v;
                    }
                }
            }
        }
        t
    })
}

/// Generate `n` synthetic images with balanced labels (class counts differ by at most 1),
/// deterministically from `seed`.
///
/// Panics if `n` images do not fit in memory; [`crate::data::load`] checks the count first.
pub fn generate(n: usize, seed: u64) -> Dataset {
    // Without a stop flag the generation always completes.
    generate_with_stop(n, seed, None).unwrap_or_default()
}

/// Images generated between two looks at the stop flag (about 10 ms of work).
const STOP_CHECK_EVERY: usize = 1024;

/// [`generate`], giving up (`None`) once `stop` is set, checked every [`STOP_CHECK_EVERY`]
/// images; the images made until then are the same as [`generate`]'s.
pub fn generate_with_stop(n: usize, seed: u64, stop: Option<&AtomicBool>) -> Option<Dataset> {
    let stopped = || stop.is_some_and(|s| s.load(Ordering::SeqCst));
    let templates = templates();
    let mut rng = StdRng::seed_from_u64(mix_seed(&[seed]));
    let mut labels: Vec<u8> = (0..n).map(|i| (i % NUM_CLASSES) as u8).collect();
    labels.shuffle(&mut rng);
    let mut images = vec![0u8; n * IMAGE_BYTES];
    let mut noise_bits = 0u64;
    let mut noise_left = 0u32;
    for (i, (label, img)) in labels
        .iter()
        .zip(images.chunks_exact_mut(IMAGE_BYTES))
        .enumerate()
    {
        if i % STOP_CHECK_EVERY == 0 && stopped() {
            return None;
        }
        let dx = rng.random_range(0..=2 * MAX_SHIFT);
        let dy = rng.random_range(0..=2 * MAX_SHIFT);
        let contrast = rng.random_range(0.8f32..1.2);
        let brightness = rng.random_range(-15.0f32..15.0);
        for c in 0..3 {
            let plane = &templates[(*label as usize * 3 + c) * SIDE * SIDE..][..SIDE * SIDE];
            // The plane mean is the base colour; contrast scales the deviations from it.
            let base = plane_mean(*label as usize, c);
            for y in 0..32 {
                let row = &plane[(y + dy) * SIDE + dx..][..32];
                for (x, &t) in row.iter().enumerate() {
                    // Triangular noise from two random bytes; one u64 serves four pixels, which
                    // keeps generation cheap even in unoptimized test builds.
                    if noise_left == 0 {
                        noise_bits = rng.next_u64();
                        noise_left = 4;
                    }
                    let a = (noise_bits & 0xFF) as f32;
                    let b = ((noise_bits >> 8) & 0xFF) as f32;
                    noise_bits >>= 16;
                    noise_left -= 1;
                    let noise = (a + b - 255.0) / 255.0 * NOISE;
                    let v = base + contrast * (t - base) + brightness + noise;
                    img[c * 1024 + y * 32 + x] = v.round().clamp(0.0, 255.0) as u8;
                }
            }
        }
    }
    Some(Dataset { images, labels })
}

/// The mean of a template plane over the stored field (cached alongside the templates).
fn plane_mean(class: usize, c: usize) -> f32 {
    static MEANS: OnceLock<Vec<f32>> = OnceLock::new();
    let means = MEANS.get_or_init(|| {
        templates()
            .chunks_exact(SIDE * SIDE)
            .map(|p| p.iter().sum::<f32>() / (SIDE * SIDE) as f32)
            .collect()
    });
    means[class * 3 + c]
}

/// A train and a test set from one seed: different image streams, the same class templates.
pub fn splits(n_train: usize, n_test: usize, seed: u64) -> (Dataset, Dataset) {
    (generate(n_train, seed), generate(n_test, test_seed(seed)))
}

/// The seed of the test split of [`splits`].
pub(crate) fn test_seed(seed: u64) -> u64 {
    mix_seed(&[seed, TEST_TAG])
}
