//! Where a CUDA step's GPU time goes: per layer event (`step_timeline.json`'s `gpu_us`) and per
//! convolution pass over the run's steady steps (`summary.json`'s `gpu_passes`), from the CUDA
//! events [`memtrain_kernels::gpu_time`] records and reads at the step's existing synchronize.
//! Nothing on the CPU, and nothing in a `--cuda-graph` run (a captured step has no passes to time).

use memtrain_core::memory::timeline::StepTimeline;
use memtrain_kernels::gpu_time::{PassTime, Taken};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One convolution pass of the step, over the run's steady steps (`summary.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuPass {
    /// `forward`, `input gradient` or `weight gradient`.
    pub pass: String,
    /// `N×Cin×H×W → Cout, KxK stride S pad P`.
    pub shape: String,
    /// The compute dtype.
    pub dtype: String,
    /// `cudnn ALGO_1` (the algorithm) or `im2col`.
    pub route: String,
    /// Workspace the cuDNN algorithm asks for (0 on the im2col op).
    pub workspace_bytes: u64,
    /// Runs of this pass per step.
    pub calls_per_step: f64,
    /// GPU microseconds per step in this pass.
    pub us_per_step: f64,
}

type Key = (String, String, String, String, u64);

/// The passes' GPU time summed over the steady steps (each step's first few, whose passes plan
/// cuDNN's algorithms, are left out).
#[derive(Debug, Default)]
pub(crate) struct PassTotals {
    steps: usize,
    by_key: BTreeMap<Key, (usize, f64)>,
}

impl PassTotals {
    /// Add one step's passes.
    pub(crate) fn add_step(&mut self, passes: &[PassTime]) {
        self.steps += 1;
        for p in passes {
            let key = (
                p.pass.to_string(),
                p.shape.clone(),
                p.dtype.clone(),
                p.route.clone(),
                p.workspace_bytes,
            );
            let e = self.by_key.entry(key).or_default();
            e.0 += 1;
            e.1 += p.us;
        }
    }

    /// The passes, most GPU time first; `None` when no step was timed.
    pub(crate) fn rows(&self) -> Option<Vec<GpuPass>> {
        if self.steps == 0 || self.by_key.is_empty() {
            return None;
        }
        let per = self.steps as f64;
        let mut rows: Vec<GpuPass> = (self.by_key.iter())
            .map(|((pass, shape, dtype, route, ws), &(calls, us))| GpuPass {
                pass: pass.clone(),
                shape: shape.clone(),
                dtype: dtype.clone(),
                route: route.clone(),
                workspace_bytes: *ws,
                calls_per_step: calls as f64 / per,
                us_per_step: us / per,
            })
            .collect();
        rows.sort_by(|a, b| b.us_per_step.total_cmp(&a.us_per_step));
        Some(rows)
    }
}

/// Steps at the start of a run of `total_steps` whose passes are not counted: 3, or a quarter of
/// a short run (at least 1), as the steady images per second skip.
pub(crate) fn warmup_steps(total_steps: usize) -> usize {
    3.min(total_steps / 4).max(1)
}

/// A step's readings into its timeline (each event's GPU time since the one before, when there
/// is one mark per event and one at the step's start) and, past the warm-up, into `totals`.
pub(crate) fn read_step(
    taken: Taken,
    timeline: &mut StepTimeline,
    steady: bool,
    totals: &mut PassTotals,
) {
    if taken.between_marks_us.len() == timeline.events.len() {
        for (e, us) in timeline.events.iter_mut().zip(taken.between_marks_us) {
            e.gpu_us = us;
        }
    }
    if steady && !taken.passes.is_empty() {
        totals.add_step(&taken.passes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pass(pass: &'static str, route: &str, us: f64) -> PassTime {
        PassTime {
            pass,
            shape: "128×32×32×32 → 32, 3x3 stride 1 pad 1".into(),
            dtype: "f32".into(),
            route: route.into(),
            workspace_bytes: if route == "im2col" { 0 } else { 1 << 20 },
            us,
        }
    }

    #[test]
    fn passes_sum_per_key_over_steps_most_time_first() {
        let mut t = PassTotals::default();
        assert_eq!(t.rows(), None, "no step timed: no table");
        t.add_step(&[
            pass("forward", "cudnn ALGO_1", 10.0),
            pass("weight gradient", "im2col", 50.0),
        ]);
        t.add_step(&[
            pass("forward", "cudnn ALGO_1", 14.0),
            pass("forward", "cudnn ALGO_1", 6.0),
            pass("weight gradient", "im2col", 70.0),
        ]);
        let rows = t.rows().unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (rows[0].pass.as_str(), rows[0].route.as_str()),
            ("weight gradient", "im2col")
        );
        assert_eq!((rows[0].calls_per_step, rows[0].us_per_step), (1.0, 60.0));
        assert_eq!((rows[1].calls_per_step, rows[1].us_per_step), (1.5, 15.0));
        assert_eq!(rows[1].workspace_bytes, 1 << 20);
    }

    #[test]
    fn a_step_gives_its_events_their_gpu_time_only_when_the_marks_match() {
        use memtrain_core::memory::timeline::TimelineEvent;
        let event = |i| TimelineEvent {
            index: i,
            phase: memtrain_core::phase::Phase::Forward,
            layer: format!("layer{i}"),
            micro_batch: 0,
            current_bytes: 0,
            peak_bytes: 0,
            categories: Default::default(),
            predicted_peak_bytes: None,
            predicted_current_bytes: None,
            end_us: None,
            gpu_us: None,
        };
        let mut timeline = StepTimeline {
            events: vec![event(0), event(1)],
            ..Default::default()
        };
        let mut totals = PassTotals::default();
        let taken = |marks: Vec<Option<f64>>| Taken {
            passes: vec![pass("forward", "im2col", 5.0)],
            between_marks_us: marks,
        };
        // A warm-up step: its events are timed, its passes not counted.
        read_step(
            taken(vec![Some(3.0), None]),
            &mut timeline,
            false,
            &mut totals,
        );
        let gpu: Vec<_> = timeline.events.iter().map(|e| e.gpu_us).collect();
        assert_eq!(gpu, [Some(3.0), None]);
        assert_eq!(totals.rows(), None);
        // Marks that do not match the events (a captured step) leave them as they are.
        read_step(taken(vec![Some(9.0)]), &mut timeline, true, &mut totals);
        assert_eq!(timeline.events[0].gpu_us, Some(3.0));
        assert_eq!(totals.rows().unwrap()[0].us_per_step, 5.0);
        assert_eq!(warmup_steps(100), 3);
        assert_eq!(warmup_steps(6), 1);
        assert_eq!(warmup_steps(1), 1);
    }
}
