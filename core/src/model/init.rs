//! Seeded parameter initialization, generated on the host so a seed gives the same weights on
//! every device.

use rand::{rngs::StdRng, Rng, SeedableRng};

/// A seeded source of initial values.
pub struct Init {
    rng: StdRng,
}

impl Init {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Init {
            rng: StdRng::seed_from_u64(seed ^ 0x6d65_6d74_7261_696e),
        }
    }

    /// `n` normal samples with standard deviation `std` (Box-Muller).
    pub(crate) fn normal(&mut self, n: usize, std: f64) -> Vec<f32> {
        let mut out = Vec::with_capacity(n + 1);
        while out.len() < n {
            let u1: f64 = self.rng.random::<f64>().max(f64::MIN_POSITIVE);
            let u2: f64 = self.rng.random::<f64>();
            let r = (-2.0 * u1.ln()).sqrt() * std;
            let t = 2.0 * std::f64::consts::PI * u2;
            out.push((r * t.cos()) as f32);
            out.push((r * t.sin()) as f32);
        }
        out.truncate(n);
        out
    }

    /// `n` uniform samples in [-bound, bound).
    pub(crate) fn uniform(&mut self, n: usize, bound: f64) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.rng.random::<f64>() * 2.0 - 1.0) * bound) as f32)
            .collect()
    }
}
