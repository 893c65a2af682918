//! The memory timeline inside a step: one event per layer (per micro-batch) and the optimizer,
//! categories that add up to the probe's reading, the estimate's prediction at every event,
//! `step_timeline.json` in the run directory; the probe wrapper that splits the watermark at
//! events; and `--checkpoint auto`.

mod common;

use memtrain::config::{ConvKind, GradCheckpointing, TrainConfig};
use memtrain::predict::{estimate_with, resolve_checkpointing, Baseline, DataSize, DeviceKind};
use memtrain::train::TrainerOptions;
use memtrain_core::memory::timeline::{StepTimeline, STEP_TIMELINE_FILE};
use memtrain_core::memory::CountingAllocator;

#[global_allocator]
static A: CountingAllocator = CountingAllocator;

fn run(mut cfg: TrainConfig, name: &str) -> (StepTimeline, std::path::PathBuf) {
    let dir = common::temp_dir(name);
    cfg.output.out = Some(dir.clone());
    let mut t = common::trainer_with(
        cfg,
        TrainerOptions {
            log_files: true,
            ..TrainerOptions::default()
        },
    );
    t.fit().unwrap();
    let text = std::fs::read_to_string(dir.join(STEP_TIMELINE_FILE)).unwrap();
    (serde_json::from_str(&text).unwrap(), dir)
}

#[test]
fn one_event_per_layer_with_categories_and_predictions() {
    for (checkpoint, accum, per_micro) in [
        // 6 blocks forward, head forward and backward, 6 blocks backward.
        (GradCheckpointing::None, 1, 14),
        // + one recomputation event per segment but the last (which saves in the forward).
        (GradCheckpointing::Stages, 1, 16),
        (GradCheckpointing::Blocks, 2, 19),
        (GradCheckpointing::from_cuts(0b00010), 1, 15),
    ] {
        let mut cfg = common::tiny_config();
        cfg.memory.grad_checkpointing = checkpoint;
        cfg.steps.accum_steps = accum;
        cfg.model.conv = ConvKind::Separable;
        let (t, dir) = run(cfg, &format!("timeline-{checkpoint}"));
        assert_eq!(t.events.len(), per_micro * accum + 1, "{checkpoint}");
        let last = t.events.last().unwrap();
        assert_eq!(last.layer, "optimizer");
        for (i, e) in t.events.iter().enumerate() {
            assert_eq!(e.index, i);
            assert_eq!(
                e.categories.total(),
                e.current_bytes,
                "{checkpoint} event {i}"
            );
            assert!(e.peak_bytes >= e.current_bytes, "{checkpoint} event {i}");
            assert!(e.predicted_peak_bytes.is_some(), "{checkpoint} event {i}");
        }
        // By the last backward event only the micro-batch's input (f32) is still saved.
        let before_opt = &t.events[t.events.len() - 2];
        let micro = 16 / accum;
        assert_eq!(
            before_opt.categories.saved,
            (micro * 3072 * 4) as u64,
            "{checkpoint}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn half_precision_saves_half_the_activation_bytes() {
    let saved = |precision| {
        let mut cfg = common::tiny_config();
        cfg.memory.precision = precision;
        let (t, dir) = run(cfg, &format!("timeline-{precision}"));
        let _ = std::fs::remove_dir_all(dir);
        t.events.iter().map(|e| e.categories.saved).max().unwrap()
    };
    use memtrain::config::Precision;
    assert_eq!(saved(Precision::F16) * 2, saved(Precision::F32));
    assert_eq!(saved(Precision::Bf16), saved(Precision::F16));
}

#[test]
fn auto_checkpointing_follows_the_estimate() {
    let dev = DeviceKind::cpu();
    let base = Baseline::Modeled(DataSize::exact(512, 64));
    let mut cfg = TrainConfig::default();
    cfg.model.width = 16;
    cfg.steps.batch_size = 64;
    cfg.memory.grad_checkpointing = GradCheckpointing::Auto;
    let peak = |checkpointing: GradCheckpointing| {
        let mut c = cfg.clone();
        c.memory.grad_checkpointing = checkpointing;
        estimate_with(&c, dev, base).unwrap().peak
    };
    let (none, stages, blocks) = (
        peak(GradCheckpointing::None),
        peak(GradCheckpointing::Stages),
        peak(GradCheckpointing::Blocks),
    );
    // Without a limit: the smallest predicted peak.
    let smallest = [
        (GradCheckpointing::None, none),
        (GradCheckpointing::Stages, stages),
        (GradCheckpointing::Blocks, blocks),
    ]
    .into_iter()
    .min_by_key(|p| p.1)
    .unwrap()
    .0;
    assert_eq!(resolve_checkpointing(&cfg, dev, base).unwrap().0, smallest);
    // The estimate of `auto` is the estimate of what it picks.
    assert_eq!(estimate_with(&cfg, dev, base).unwrap().peak, peak(smallest));
    // Under a limit every segmentation fits, with the margin: the cheapest (no recomputation).
    use memtrain::predict::margin::{limit_for, usable_bytes, SAFETY_MARGIN};
    let all: Vec<u64> = GradCheckpointing::all_segmentations()
        .into_iter()
        .map(peak)
        .collect();
    // (A CPU limit is the process's: `limit_for_heap` adds what it holds beyond its heap.)
    use memtrain::predict::limit_for_heap;
    let mut roomy = cfg.clone();
    roomy.memory.memory_limit = Some(limit_for_heap(
        limit_for(*all.iter().max().unwrap(), SAFETY_MARGIN),
        dev,
    ));
    assert_eq!(
        resolve_checkpointing(&roomy, dev, base).unwrap().0,
        GradCheckpointing::None
    );
    // A limit only the smallest peak fits (with the margin): one of those.
    let least = *all.iter().min().unwrap();
    let tight_limit = limit_for(least, SAFETY_MARGIN);
    let mut tight = cfg.clone();
    tight.memory.memory_limit = Some(limit_for_heap(tight_limit, dev));
    let chosen = resolve_checkpointing(&tight, dev, base).unwrap().0;
    assert!(peak(chosen) <= usable_bytes(tight_limit, SAFETY_MARGIN));
    // A trainer built with `auto` trains with what the estimate picked.
    let mut cfg = common::tiny_config();
    cfg.memory.grad_checkpointing = GradCheckpointing::Auto;
    let t = common::trainer(cfg);
    assert_ne!(t.config.memory.grad_checkpointing, GradCheckpointing::Auto);
}

/// The step timeline's watermark splits (`take_event_peak`) and the memory callback's resets do
/// not hide each other's peaks.
#[test]
fn timeline_probe_keeps_both_watermarks() {
    use memtrain_core::memory::timeline::TimelineProbe;
    use memtrain_core::memory::MemoryProbe;
    use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
    use std::sync::Arc;
    #[derive(Default)]
    struct Fake {
        cur: AtomicU64,
        peak: AtomicU64,
    }
    impl Fake {
        fn set(&self, v: u64) {
            self.cur.store(v, SeqCst);
            self.peak.fetch_max(v, SeqCst);
        }
    }
    impl MemoryProbe for Fake {
        fn name(&self) -> &str {
            "fake"
        }
        fn available(&self) -> bool {
            true
        }
        fn current(&self) -> u64 {
            self.cur.load(SeqCst)
        }
        fn peak(&self) -> u64 {
            self.peak.load(SeqCst)
        }
        fn reset_peak(&self) {
            self.peak.store(self.cur.load(SeqCst), SeqCst);
        }
        fn limit(&self) -> Option<u64> {
            None
        }
    }
    let fake = Arc::new(Fake::default());
    let probe = TimelineProbe::new(fake.clone());
    fake.set(100);
    fake.set(50);
    // An event takes the peak since the last one; the callback still sees it afterwards.
    assert_eq!(probe.take_event_peak(), 100);
    assert_eq!(probe.peak(), 100);
    fake.set(70);
    fake.set(40);
    // The callback reads and resets; the next event still sees 70.
    assert_eq!(probe.peak(), 100);
    probe.reset_peak();
    assert_eq!(probe.peak(), 40);
    fake.set(60);
    assert_eq!(probe.take_event_peak(), 70);
    // After an event the interval starts at the current value.
    fake.set(10);
    assert_eq!(probe.take_event_peak(), 60);
    assert_eq!(probe.take_event_peak(), 10);
}
