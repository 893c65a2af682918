//! Gradient checkpointing's segmentations (`memtrain::predict::checkpointing`): every segmentation parses,
//! runs and is counted; `--checkpoint auto --memory-limit` picks what brute force over all 32
//! picks, keeps the estimate's error margin, says so when nothing fits, and runs under its limit;
//! the out-of-memory advice names only segmentations predicted to be smaller.
//!
//! The tests run one at a time: the trained runs measure the whole process's heap.

use memtrain::config::{ConvKind, GradCheckpointing, Precision, TrainConfig, CNN_BLOCKS};
use memtrain::data::{synthetic, DataSplits};
use memtrain::predict::margin::{limit_for, usable_bytes, SAFETY_MARGIN};
use memtrain::predict::{
    choose_checkpointing, estimate_with, heap_limit, limit_for_heap, Baseline, DataSize, DeviceKind,
};
use memtrain::train::{Trainer, TrainerOptions};
use memtrain_core::memory::{format_bytes, CountingAllocator};

mod common;

#[global_allocator]
static A: CountingAllocator = CountingAllocator;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The segmentation with boundary bits `mask`, spelled out and parsed (not through `from_cuts`).
fn by_spelling(mask: u8) -> GradCheckpointing {
    let b: Vec<String> = (1..CNN_BLOCKS)
        .filter(|b| mask & (1 << (b - 1)) != 0)
        .map(|b| b.to_string())
        .collect();
    let text = if b.is_empty() {
        "none".to_string()
    } else {
        format!("segments:{}", b.join(","))
    };
    text.parse().unwrap()
}

/// FLOPs of one image's convolutions in block `j` (2 per multiply-add), from the architecture:
/// stage s has w·2^s channels at 32/2^s pixels; the first block reads the 3 colour planes.
fn block_flops(width: usize, conv: ConvKind, j: usize) -> u64 {
    let stage = j / 2;
    let cout = (width << stage) as u64;
    let cin = match j {
        0 => 3,
        _ if j.is_multiple_of(2) => (width << (stage - 1)) as u64,
        _ => cout,
    };
    let px = ((32 >> stage) * (32 >> stage)) as u64;
    match conv {
        ConvKind::Standard => 2 * px * cout * cin * 9,
        ConvKind::Separable => 2 * px * cin * 9 + 2 * px * cout * cin,
    }
}

/// Recomputed FLOPs of the segmentation `mask` per step: every block before the last boundary.
fn expected_flops(cfg: &TrainConfig, mask: u8) -> u64 {
    let last = (1..CNN_BLOCKS)
        .filter(|b| mask & (1 << (b - 1)) != 0)
        .max()
        .unwrap_or(0);
    (0..last)
        .map(|j| block_flops(cfg.model.width, cfg.model.conv, j))
        .sum::<u64>()
        * cfg.steps.batch_size as u64
}

#[test]
fn every_segmentation_parses_prints_and_cuts_the_blocks() {
    let _s = serial();
    assert_eq!(by_spelling(0b01010), GradCheckpointing::Stages);
    assert_eq!(by_spelling(0b11111), GradCheckpointing::Blocks);
    assert_eq!(
        "segments:2,4".parse::<GradCheckpointing>().unwrap(),
        GradCheckpointing::Stages
    );
    assert_eq!(
        " Segments: 1, 2,3,4 ,5"
            .parse::<GradCheckpointing>()
            .unwrap(),
        GradCheckpointing::Blocks
    );
    let all = GradCheckpointing::all_segmentations();
    assert_eq!(all.len(), 32);
    for (mask, ck) in all.iter().enumerate() {
        assert_eq!(*ck, by_spelling(mask as u8));
        // Text, config.json and back.
        let text = ck.to_string();
        assert_eq!(text.parse::<GradCheckpointing>().unwrap(), *ck, "{text}");
        let json = serde_json::to_string(ck).unwrap();
        assert_eq!(json, format!("\"{text}\""));
        assert_eq!(
            serde_json::from_str::<GradCheckpointing>(&json).unwrap(),
            *ck
        );
        // The segments cover the blocks in order, cut exactly at the boundaries.
        let segs = memtrain_core::model::cnn::segments(CNN_BLOCKS, ck.resolved().unwrap());
        assert_eq!(segs.first().unwrap().start, 0);
        assert_eq!(segs.last().unwrap().end, CNN_BLOCKS);
        assert!(segs.windows(2).all(|w| w[0].end == w[1].start));
        let cuts: Vec<usize> = segs[..segs.len() - 1].iter().map(|r| r.end).collect();
        assert_eq!(cuts, ck.boundaries().unwrap(), "{text}");
    }
    assert_eq!(
        GradCheckpointing::from_cuts(0b00010).to_string(),
        "segments:2"
    );
    // The flag: parsed by train_cifar10's own parser.
    let cfg = common::config_of(&["--checkpoint", "segments:2"]).unwrap();
    assert_eq!(
        cfg.memory.grad_checkpointing,
        GradCheckpointing::from_cuts(0b00010)
    );
    for (bad, why) in [
        ("segments:", "no boundary given"),
        ("segments:0", "0 is not a boundary"),
        ("segments:6", "6 is not a boundary"),
        ("segments:3,2", "2 does not come after 3"),
        ("segments:2,2", "2 does not come after 2"),
        ("segments:2,x", "'x' is not a block number"),
        ("segments:-1", "'-1' is not a block number"),
        ("stage", "is not a checkpointing"),
    ] {
        let e = common::config_of(&["--checkpoint", bad])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("--checkpoint {bad}"))
                || e.contains(&format!("--checkpoint '{bad}'")),
            "names the flag and value: {e}"
        );
        assert!(e.contains(why), "{bad}: {e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }
    // Every segmentation's recomputed FLOPs, against the architecture.
    for conv in ConvKind::ALL {
        let mut cfg = TrainConfig::default();
        cfg.model.conv = *conv;
        for (mask, ck) in all.iter().enumerate() {
            assert_eq!(
                memtrain::predict::checkpointing::recompute_flops(
                    cfg.model,
                    ck.resolved().unwrap(),
                    cfg.steps.batch_size
                ),
                expected_flops(&cfg, mask as u8),
                "{ck} {conv}"
            );
        }
    }
}

/// The brute-force choice: of every segmentation (spelled out) whose predicted peak is at most
/// the limit less the margin, the least recomputed FLOPs, then the smaller peak, then the fewer
/// segments, then the first; `None` when none fits.
fn brute_force(peaks: &[(u8, u64)], cfg: &TrainConfig, limit: u64) -> Option<(u8, u64)> {
    let usable = (limit as f64 * (1.0 - SAFETY_MARGIN)).floor() as u64;
    peaks
        .iter()
        .filter(|(_, p)| *p <= usable)
        .min_by_key(|(m, p)| (expected_flops(cfg, *m), *p, m.count_ones()))
        .copied()
}

#[test]
fn auto_picks_what_brute_force_over_every_segmentation_picks() {
    let _s = serial();
    let dev = DeviceKind::cpu();
    let data = DataSize::exact(5000, 1000);
    let base = Baseline::Modeled(data);
    let configs = [
        (8, 32, Precision::F32, ConvKind::Standard, 1),
        (16, 64, Precision::Bf16, ConvKind::Separable, 1),
        (32, 128, Precision::F32, ConvKind::Standard, 1),
        (32, 128, Precision::F16, ConvKind::Standard, 2),
        (32, 128, Precision::F32, ConvKind::Separable, 1),
    ];
    let mut distinct = std::collections::BTreeSet::new();
    for (width, batch, precision, conv, accum_steps) in configs {
        let mut cfg = TrainConfig::default();
        cfg.model.width = width;
        cfg.steps.batch_size = batch;
        cfg.memory.precision = precision;
        cfg.model.conv = conv;
        cfg.steps.accum_steps = accum_steps;
        cfg.device = Some("cpu".into());
        let peaks: Vec<(u8, u64)> = (0..32u8)
            .map(|m| {
                let mut c = cfg.clone();
                c.memory.grad_checkpointing = by_spelling(m);
                (m, estimate_with(&c, dev, base).unwrap().peak)
            })
            .collect();
        let lo = peaks.iter().map(|p| p.1).min().unwrap();
        let hi = peaks.iter().map(|p| p.1).max().unwrap();
        // From below the smallest peak to above the largest with its margin, 40 limits.
        let (from, to) = (lo * 9 / 10, limit_for(hi, SAFETY_MARGIN) * 11 / 10);
        let mut fits = 0;
        for k in 0..=40u64 {
            // The limits are the process's (CPU): each leaves its heap budget to the step.
            let limit = limit_for_heap(from + (to - from) * k / 40, dev);
            let heap = heap_limit(Some(limit), dev).unwrap();
            let mut auto = cfg.clone();
            auto.memory.grad_checkpointing = GradCheckpointing::Auto;
            auto.memory.memory_limit = Some(limit);
            let got = choose_checkpointing(&auto, dev, base);
            let label = format!("{} at {}", cfg.label(), format_bytes(limit));
            match brute_force(&peaks, &cfg, heap) {
                Some((mask, peak)) => {
                    fits += 1;
                    let c = got.unwrap_or_else(|e| panic!("{label}: {e}"));
                    assert_eq!(
                        GradCheckpointing::from(c.chosen.checkpointing),
                        by_spelling(mask),
                        "{label}"
                    );
                    assert_eq!(c.chosen.predicted_peak, peak, "{label}");
                    assert!(peak <= usable_bytes(heap, SAFETY_MARGIN), "{label}");
                    assert_eq!(
                        c.chosen.recompute_flops,
                        expected_flops(&cfg, mask),
                        "{label}"
                    );
                    distinct.insert(c.chosen.checkpointing.to_string());
                }
                None => {
                    let e = got.expect_err(&label).to_string();
                    assert!(e.contains("no segmentation"), "{label}: {e}");
                    assert!(e.contains(&format_bytes(lo)), "{label}: {e}");
                    assert!(
                        e.contains(&format_bytes(limit_for_heap(
                            limit_for(lo, SAFETY_MARGIN),
                            dev
                        ))),
                        "{label}: {e}"
                    );
                    assert!(!e.contains('\n'), "one line: {e}");
                }
            }
        }
        assert!(fits > 10 && fits < 41, "{}: both sides swept", cfg.label());
        // The smallest limit the message names is one that fits.
        let mut auto = cfg.clone();
        auto.memory.grad_checkpointing = GradCheckpointing::Auto;
        auto.memory.memory_limit = Some(limit_for_heap(limit_for(lo, SAFETY_MARGIN), dev));
        let c = choose_checkpointing(&auto, dev, base).unwrap();
        assert_eq!(c.chosen.predicted_peak, lo);
    }
    // More than the fixed segmentations get chosen somewhere along the sweeps.
    assert!(
        distinct.iter().any(|d| d.starts_with("segments:")),
        "{distinct:?}"
    );
}

fn splits(train: usize, test: usize) -> DataSplits {
    let (train, test) = synthetic::splits(train, test, 5);
    DataSplits {
        train,
        test,
        description: "synthetic".into(),
        test_is_validation: false,
    }
}

/// What the estimate's margin keeps free of a heap of about `heap` bytes.
fn heap_margin(heap: u64) -> u64 {
    heap - memtrain::predict::margin::usable_bytes(heap, SAFETY_MARGIN)
}

fn small_config() -> TrainConfig {
    let mut cfg = TrainConfig::default();
    cfg.model.width = 8;
    cfg.steps.batch_size = 32;
    cfg.steps.max_steps = Some(3);
    cfg.output.eval = false;
    cfg.output.quiet = true;
    cfg.device = Some("cpu".into());
    cfg.data.synthetic_train = 256;
    cfg.data.synthetic_test = 16;
    cfg
}

/// The old failure: a limit just above the plain step's predicted peak, where `auto` without a
/// margin picked `none` (predicted 76.15 MiB under 76.3 MiB, measured 76.98 MiB). Now it keeps
/// the margin, and the run completes under the limit, with its segments in summary.json.
#[test]
fn auto_near_the_old_failing_limit_runs_under_it() {
    let _s = serial();
    let cfg = small_config();
    let data = splits(cfg.data.synthetic_train, cfg.data.synthetic_test);
    let size = DataSize::loaded(&data.train, &data.test, &cfg);
    let dev = DeviceKind::cpu();
    let plain = estimate_with(&cfg, dev, Baseline::Modeled(size))
        .unwrap()
        .peak;
    // Above the plain step's prediction by half the estimate's margin (76.3 was 0.2% above
    // 76.15): the plain step fits the heap, but not with the margin kept free. (The harness's
    // own heap is not added: the other segmentations leave room for it.)
    let margin = heap_margin(plain);
    let heap = plain + margin / 2;
    // The limit is the process's: what it leaves the heap is that.
    let limit = limit_for_heap(heap, dev);
    let dir = common::scratch("checkpointing", "near-limit");
    let mut auto = cfg.clone();
    auto.memory.grad_checkpointing = GradCheckpointing::Auto;
    auto.memory.memory_limit = Some(limit);
    auto.output.out = Some(dir.clone());
    CountingAllocator::reset_peak();
    let options = TrainerOptions {
        log_files: true,
        ..TrainerOptions::default()
    };
    let mut t = Trainer::new(auto, data, options).unwrap();
    let chosen = t.config.memory.grad_checkpointing;
    assert_ne!(chosen, GradCheckpointing::None, "the margin rules none out");
    assert_ne!(chosen, GradCheckpointing::Auto);
    let summary = t
        .fit()
        .unwrap_or_else(|e| panic!("auto chose {chosen}, which failed: {e}"));
    drop(t);
    assert_eq!(summary.progress.steps, 3);
    let budget = summary
        .memory
        .heap_budget_bytes
        .expect("a limited CPU run's heap budget");
    assert!(
        summary.memory.peak_bytes <= budget,
        "{chosen}: measured {} over the heap budget {}",
        format_bytes(summary.memory.peak_bytes),
        format_bytes(budget)
    );
    assert!(summary.memory.os_peak_bytes.unwrap_or(0) <= limit);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    let segs: Vec<[usize; 2]> =
        serde_json::from_value(json["checkpoint_segments"].clone()).unwrap();
    let want: Vec<[usize; 2]> =
        memtrain_core::model::cnn::segments(CNN_BLOCKS, chosen.resolved().unwrap())
            .iter()
            .map(|r| [r.start, r.end])
            .collect();
    assert_eq!(segs, want);
    assert!(segs.len() > 1);
    let mask = chosen.cuts().unwrap();
    assert_eq!(
        json["recompute_flops"].as_u64().unwrap(),
        expected_flops(&cfg, mask)
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// An out-of-memory step's advice names a segmentation only when it differs from the run's, is
/// predicted to be smaller and predicted to fit the limit: never `stages` to a separable run
/// without checkpointing, where stages predicts more, never the run's own, and nothing under a
/// limit no segmentation fits (half the step) — under one that the smallest segmentation fits, that one.
#[test]
fn out_of_memory_advice_names_only_smaller_segmentations() {
    let _s = serial();
    let dev = DeviceKind::cpu();
    let mut advised = 0;
    for (conv, ck, precision) in [
        (ConvKind::Standard, GradCheckpointing::None, Precision::F32),
        (ConvKind::Separable, GradCheckpointing::None, Precision::F32),
        (
            ConvKind::Standard,
            GradCheckpointing::Blocks,
            Precision::Bf16,
        ),
        (
            ConvKind::Standard,
            GradCheckpointing::from_cuts(0b00010),
            Precision::F32,
        ),
    ] {
        let mut cfg = small_config();
        cfg.model.conv = conv;
        cfg.memory.grad_checkpointing = ck;
        cfg.memory.precision = precision;
        let data = splits(cfg.data.synthetic_train, cfg.data.synthetic_test);
        let size = DataSize::loaded(&data.train, &data.test, &cfg);
        let peak_of = |checkpointing: GradCheckpointing| {
            let mut c = cfg.clone();
            c.memory.grad_checkpointing = checkpointing;
            estimate_with(&c, dev, Baseline::Modeled(size)).unwrap()
        };
        let est = peak_of(ck);
        // Limits the run is refused at before any step, whatever the heap earlier tests left in
        // this process (gemm's per-thread buffers among it, sized by the L2 cache): admission
        // compares the estimate of a process of its own with the heap the limit leaves.
        // Room for the data, the model and half the step: no segmentation fits.
        let fixed = est.held.baseline_bytes + est.held.batch_bytes + est.held.runtime_bytes;
        let half = limit_for_heap(fixed + (est.peak - fixed) / 2, dev);
        // Room for the smallest segmentation of these, when it is smaller than the run's own.
        let best = [
            GradCheckpointing::Stages,
            GradCheckpointing::Blocks,
            GradCheckpointing::from_cuts(0b11111),
        ]
        .map(|c| peak_of(c).peak)
        .into_iter()
        .min()
        .unwrap();
        let roomy = (best < est.peak * 95 / 100)
            .then(|| limit_for_heap(limit_for(best, SAFETY_MARGIN), dev));
        for limit in std::iter::once(half).chain(roomy) {
            let mut run = cfg.clone();
            run.memory.memory_limit = Some(limit);
            let data = splits(cfg.data.synthetic_train, cfg.data.synthetic_test);
            let mut t = Trainer::new(run, data, TrainerOptions::default()).unwrap();
            let e = t
                .fit()
                .expect_err("the run's own segmentation does not fit");
            drop(t);
            assert!(e.is_oom(), "{e}");
            let text = e.to_string();
            let Some(rest) = text.split("--checkpoint ").nth(1) else {
                continue;
            };
            let name = rest.split(' ').next().unwrap().trim_end_matches(',');
            let other: GradCheckpointing = name.parse().unwrap();
            assert_ne!(other, ck, "advises the segmentation in use: {text}");
            let budget = usable_bytes(heap_limit(Some(limit), dev).unwrap(), SAFETY_MARGIN);
            assert!(
                peak_of(other).peak < est.peak && peak_of(other).peak <= budget,
                "advises {other}, predicted {} against {} and a budget of {}: {text}",
                format_bytes(peak_of(other).peak),
                format_bytes(est.peak),
                format_bytes(budget)
            );
            advised += 1;
        }
    }
    assert!(advised >= 1, "some run gets a segmentation advised");
}

/// `train_cifar10 --checkpoint auto --memory-limit` below what any segmentation fits: one line,
/// out of memory, naming the smallest predicted peak and the limit it needs, exit 2, and no run
/// directory.
#[test]
fn nothing_fits_is_out_of_memory_before_any_work() {
    let _s = serial();
    let mut cfg = small_config();
    cfg.data.synthetic_train = 256;
    cfg.data.synthetic_test = 16;
    // The child computes with one thread (`common::trainer_command`).
    let dev = match DeviceKind::cpu() {
        DeviceKind::Cpu { l2_cache_bytes, .. } => DeviceKind::Cpu {
            threads: 1,
            l2_cache_bytes,
        },
        other => other,
    };
    let base = Baseline::Modeled(DataSize::synthetic(256, 16));
    let least = GradCheckpointing::all_segmentations()
        .into_iter()
        .map(|ck| {
            let mut c = cfg.clone();
            c.memory.grad_checkpointing = ck;
            estimate_with(&c, dev, base).unwrap().peak
        })
        .min()
        .unwrap();
    let dir = common::scratch("checkpointing", "nothing-fits");
    let out_dir = dir.join("run");
    // Room for the data set and the model (the child's own figure), not for any step.
    let flags = [common::SMALL_RUN, &["--checkpoint", "auto"]].concat();
    // (A MiB more than the child measured: the next process measures its own reserve.)
    let limit =
        (common::needed_limits(|| common::trainer_command(&flags)).0 + (1 << 20)).to_string();
    let out = common::run_trainer(
        &[
            &flags[..],
            &["--memory-limit", &limit, "--out", out_dir.to_str().unwrap()],
        ]
        .concat(),
    );
    let err = common::text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let line = err
        .lines()
        .find(|l| l.contains("no segmentation"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(line.contains(&format_bytes(least)), "{line}");
    assert!(line.contains("needs --memory-limit"), "{line}");
    // Out of memory, not a usage error: a sweep records the point and goes on (issue 52).
    assert!(
        line.starts_with("error: out of memory (predicted; nothing was run)"),
        "{line}"
    );
    assert!(memtrain::sweep::oom_message(&err).is_some(), "{err}");
    assert!(!out_dir.exists(), "nothing written");
    let _ = std::fs::remove_dir_all(dir);
}

/// `--compress-activations auto` with `--checkpoint auto`: over every segmentation and every
/// storage, the exact plans first, then the most bits (int8, int4, int2), then the least
/// recomputation, the smaller peak and the fewer segments, among those that fit: checked against
/// brute force over the same 128 predictions, from limits only int2 fits to limits the plain
/// exact step fits; and nothing fitting is a one-line usage error that names the codes.
#[test]
fn auto_codes_and_segmentation_pick_what_brute_force_picks() {
    use memtrain::config::{ActivationStorage, CompressActivations};
    let _s = serial();
    let dev = DeviceKind::cpu();
    let base = Baseline::Modeled(DataSize::exact(5000, 1000));
    let rank = |s: ActivationStorage| match s {
        ActivationStorage::None => 0,
        ActivationStorage::Int8 => 1,
        ActivationStorage::Int4 => 2,
        ActivationStorage::Int2 => 3,
    };
    let mut storages_chosen = std::collections::BTreeSet::new();
    for (width, batch, precision) in [(8, 32, Precision::F32), (16, 64, Precision::Bf16)] {
        let mut cfg = TrainConfig::default();
        cfg.model.width = width;
        cfg.steps.batch_size = batch;
        cfg.memory.precision = precision;
        cfg.device = Some("cpu".into());
        let mut plans = Vec::new();
        for s in ActivationStorage::ALL {
            for m in 0..32u8 {
                let mut c = cfg.clone();
                c.memory.grad_checkpointing = by_spelling(m);
                c.memory.compress_activations = (*s).into();
                plans.push((*s, m, estimate_with(&c, dev, base).unwrap().peak));
            }
        }
        let lo = plans.iter().map(|p| p.2).min().unwrap();
        let plain = plans
            .iter()
            .find(|p| p.0 == ActivationStorage::None && p.1 == 0)
            .unwrap()
            .2;
        let (from, to) = (lo * 99 / 100, limit_for(plain, SAFETY_MARGIN) * 101 / 100);
        let mut auto = cfg.clone();
        auto.memory.grad_checkpointing = GradCheckpointing::Auto;
        auto.memory.compress_activations = CompressActivations::Auto;
        for k in 0..=20u64 {
            let limit = limit_for_heap(from + (to - from) * k / 20, dev);
            let usable = usable_bytes(heap_limit(Some(limit), dev).unwrap(), SAFETY_MARGIN);
            auto.memory.memory_limit = Some(limit);
            let got = choose_checkpointing(&auto, dev, base);
            let label = format!("{} at {}", cfg.label(), format_bytes(limit));
            let want = plans
                .iter()
                .filter(|p| p.2 <= usable)
                .min_by_key(|p| (rank(p.0), expected_flops(&cfg, p.1), p.2, p.1.count_ones()));
            match want {
                Some(&(storage, mask, peak)) => {
                    let c = got.unwrap_or_else(|e| panic!("{label}: {e}"));
                    assert_eq!(c.chosen.storage, storage, "{label}");
                    assert_eq!(
                        GradCheckpointing::from(c.chosen.checkpointing),
                        by_spelling(mask),
                        "{label}"
                    );
                    assert_eq!(c.chosen.predicted_peak, peak, "{label}");
                    assert_eq!(c.considered, 128, "{label}");
                    let line = c.describe(CNN_BLOCKS);
                    assert_eq!(line.contains("lossy"), storage.is_lossy(), "{line}");
                    assert!(line.contains("chosen in"), "{line}");
                    storages_chosen.insert(storage.to_string());
                }
                None => {
                    let e = got.expect_err(&label).to_string();
                    assert!(e.contains("no plan (segmentation and codes)"), "{e}");
                    assert!(!e.contains('\n'), "one line: {e}");
                }
            }
        }
    }
    // The sweeps reach an exact plan and lossy ones.
    assert!(storages_chosen.contains("none"), "{storages_chosen:?}");
    assert!(storages_chosen.len() >= 3, "{storages_chosen:?}");
}

/// `--compress-activations auto` without `--memory-limit` is a usage error naming the fix; with
/// a fixed `--checkpoint`, only the codes are chosen.
#[test]
fn auto_codes_need_a_limit_and_keep_a_named_segmentation() {
    use memtrain::config::{ActivationStorage, CompressActivations};
    let mut cfg = TrainConfig::default();
    cfg.model.width = 8;
    cfg.steps.batch_size = 32;
    cfg.device = Some("cpu".into());
    cfg.memory.compress_activations = CompressActivations::Auto;
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.contains("give --memory-limit"), "{e}");
    let dev = DeviceKind::cpu();
    let base = Baseline::Modeled(DataSize::exact(5000, 1000));
    cfg.memory.grad_checkpointing = GradCheckpointing::Stages;
    let mut exact = cfg.clone();
    exact.memory.compress_activations = ActivationStorage::None.into();
    let stages = estimate_with(&exact, dev, base).unwrap().peak;
    let mut int8 = exact.clone();
    int8.memory.compress_activations = ActivationStorage::Int8.into();
    let stages_int8 = estimate_with(&int8, dev, base).unwrap().peak;
    assert!(stages_int8 < stages);
    // Room for the exact step with stages: exact, with stages; room for int8 only: int8.
    for (heap, lossy) in [
        (limit_for(stages, SAFETY_MARGIN), false),
        (limit_for(stages_int8, SAFETY_MARGIN), true),
    ] {
        cfg.memory.memory_limit = Some(limit_for_heap(heap, dev));
        let c = choose_checkpointing(&cfg, dev, base).unwrap();
        assert_eq!(c.considered, 4);
        assert_eq!(
            GradCheckpointing::from(c.chosen.checkpointing),
            GradCheckpointing::Stages
        );
        assert_eq!(
            c.chosen.storage.is_lossy(),
            lossy,
            "{}",
            c.describe(CNN_BLOCKS)
        );
        assert!(c
            .describe(CNN_BLOCKS)
            .starts_with("--compress-activations auto: "));
    }
}
