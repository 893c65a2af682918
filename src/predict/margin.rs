//! The room a memory limit leaves the estimate: the error margin every plan keeps free
//! ([`SAFETY_MARGIN`], [`MARGIN_FLOOR_BYTES`]), and on the CPU the heap a resident-memory limit
//! leaves ([`heap_limit`]).

use super::sim::DeviceKind;

/// Fraction of a memory budget kept free for the estimate's error: a plan or a schedule must
/// predict at most `(1 - SAFETY_MARGIN) × budget`, and at least [`MARGIN_FLOOR_BYTES`] below it.
/// The estimate runs the step's own tape on sizes (`sizing.rs`): over the grid of
/// `tests/estimate_grid.rs` (batch 1 to 512, width 8 to 96, every optimization) it is never below
/// the measured step peak and never above it by more than 0.01%; 0.25% keeps room for what a grid
/// cannot show.
pub const SAFETY_MARGIN: f64 = 0.0025;

/// Bytes a non-zero margin keeps free at least, for budgets too small for [`SAFETY_MARGIN`] to
/// leave room (0.25% of 4 MiB is about 10 KiB).
pub const MARGIN_FLOOR_BYTES: u64 = 16 << 10;

/// `margin` as a percentage for messages: `0.25%`, `1%`.
pub fn percent(margin: f64) -> String {
    let p = format!("{:.2}", margin * 100.0);
    format!("{}%", p.trim_end_matches('0').trim_end_matches('.'))
}

/// The largest predicted peak that fits `limit` with `margin` kept free (and, for a non-zero
/// margin, at least [`MARGIN_FLOOR_BYTES`]).
pub fn usable_bytes(limit: u64, margin: f64) -> u64 {
    let by_fraction = (limit as f64 * (1.0 - margin)).floor() as u64;
    if margin > 0.0 {
        by_fraction.min(limit.saturating_sub(MARGIN_FLOOR_BYTES))
    } else {
        by_fraction
    }
}

/// The smallest limit that a predicted `peak` fits with `margin` kept free.
pub fn limit_for(peak: u64, margin: f64) -> u64 {
    let mut limit = (peak as f64 / (1.0 - margin)).ceil() as u64;
    if margin > 0.0 {
        limit = limit.max(peak.saturating_add(MARGIN_FLOOR_BYTES));
    }
    // Rounding may leave it one byte short.
    while usable_bytes(limit, margin) < peak {
        limit += 1;
    }
    limit
}

/// What `--memory-limit` leaves the estimate's (heap) peak on `device`: on the CPU, where the
/// limit is the process's resident memory, the heap budget under it
/// ([`memtrain_core::memory::os::RssReserve`]); on CUDA the pool limit itself.
pub fn heap_limit(limit: Option<u64>, device: DeviceKind) -> Option<u64> {
    match device.is_cpu() {
        true => limit.map(|l| memtrain_core::memory::os::RssReserve::of_process().heap_budget(l)),
        false => limit,
    }
}

/// The `--memory-limit` that leaves a heap of `heap` bytes on `device` (see [`heap_limit`]).
pub fn limit_for_heap(heap: u64, device: DeviceKind) -> u64 {
    match device.is_cpu() {
        true => memtrain_core::memory::os::RssReserve::of_process().resident(heap),
        false => heap,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_drops_trailing_zeros() {
        assert_eq!(percent(SAFETY_MARGIN), "0.25%");
        assert_eq!(percent(0.01), "1%");
        assert_eq!(percent(0.1), "10%");
        assert_eq!(percent(0.125), "12.5%");
    }

    #[test]
    fn limit_for_is_the_smallest_limit_a_peak_fits() {
        for peak in [1u64, 19, 1 << 20, 80_839_100, 95_052_476, u64::MAX >> 12] {
            for margin in [0.0, 0.05, 0.2] {
                let l = limit_for(peak, margin);
                if margin > 0.0 {
                    assert!(l - peak >= MARGIN_FLOOR_BYTES, "{peak} {margin}: the floor");
                }
                assert!(usable_bytes(l, margin) >= peak, "{peak} {margin}");
                assert!(usable_bytes(l - 1, margin) < peak, "{peak} {margin}");
            }
        }
    }
}
