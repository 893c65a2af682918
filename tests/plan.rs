//! The memory-budget planner (`memtrain::predict::plan`): plans fit their budget, in prediction and when run.
//!
//! One test function: the counting allocator's counters are process-wide.

mod common;

use memtrain::config::TrainConfig;
use memtrain::data::{synthetic, DataSplits};
use memtrain::predict::plan::{plan, smallest_feasible_budget, PlanOptions, SAFETY_MARGIN};
use memtrain::predict::{DataSize, DeviceKind};
use memtrain::train::{Trainer, TrainerOptions};
use memtrain_core::memory::{format_bytes, CountingAllocator};

#[global_allocator]
static A: CountingAllocator = CountingAllocator;

const TRAIN_IMAGES: usize = 256;
const TEST_IMAGES: usize = 16;

fn data() -> DataSplits {
    let (train, test) = synthetic::splits(TRAIN_IMAGES, TEST_IMAGES, 3);
    DataSplits {
        train,
        test,
        description: "synthetic".into(),
        test_is_validation: false,
    }
}

fn base_config(width: usize, batch: usize) -> TrainConfig {
    common::cpu_config(width, batch, TRAIN_IMAGES, TEST_IMAGES)
}

/// The tests of this file run one at a time: the trained runs measure the whole process's heap
/// peak, which another test's allocations would inflate.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn planned_runs_fit_their_budget() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pre = CountingAllocator::current();
    let dev = DeviceKind::cpu();

    // Property: over many budgets (and both model options), a returned plan never predicts more
    // than the budget minus the margin, and plans are ranked fastest first; a budget without a
    // plan is refused with the smallest feasible budget, which does have one.
    let cfg = base_config(32, 128);
    for allow in [false, true] {
        let mut opts = PlanOptions::new(dev, DataSize::exact(5000, 1000));
        opts.allow_model_change = allow;
        let smallest = smallest_feasible_budget(&cfg, &opts).unwrap();
        let mut budget = 1u64 << 20;
        let (mut ok, mut refused) = (0, 0);
        while budget < 2 << 30 {
            match plan(&cfg, budget, &opts) {
                Ok(r) => {
                    ok += 1;
                    assert!(
                        budget >= smallest,
                        "a plan below the smallest feasible budget"
                    );
                    for p in &r.plans {
                        assert!(
                            p.predicted_peak <= r.usable && r.usable <= budget,
                            "{} exceeds {budget}",
                            p.describe()
                        );
                        assert_eq!(p.micro_batch * p.accum_steps, 128, "effective batch kept");
                        assert!(
                            allow || p.conv == cfg.model.conv,
                            "conv changed without --allow-model-change"
                        );
                        p.config.validate().unwrap();
                    }
                    assert!(r
                        .plans
                        .windows(2)
                        .all(|w| w[0].time_per_image <= w[1].time_per_image));
                    assert!(r
                        .rejected_faster
                        .iter()
                        .all(|p| p.predicted_peak > r.usable));
                    let text = r.render(3);
                    assert!(
                        text.contains("chosen:") && text.contains("cost model"),
                        "{text}"
                    );
                }
                Err(e) => {
                    refused += 1;
                    let msg = e.to_string();
                    assert!(
                        budget < smallest,
                        "budget {budget} refused although {smallest} is feasible: {msg}"
                    );
                    assert!(
                        msg.contains("too small") && msg.contains(&format_bytes(smallest)),
                        "{msg}"
                    );
                    assert!(!msg.contains('\n'), "one line: {msg}");
                }
            }
            budget = budget * 21 / 20;
        }
        assert!(
            ok > 10 && refused > 10,
            "the sweep covers both sides ({ok} fit, {refused} refused)"
        );
        assert!(
            plan(&cfg, smallest, &opts).is_ok(),
            "the smallest feasible budget is feasible"
        );
    }

    // An impossible budget: one line naming the smallest feasible budget.
    let opts = PlanOptions::new(dev, DataSize::exact(5000, 1000));
    let err = plan(&cfg, 4 << 20, &opts).unwrap_err().to_string();
    let smallest = smallest_feasible_budget(&cfg, &opts).unwrap();
    assert!(
        err.contains("too small") && err.contains(&format_bytes(smallest)),
        "{err}"
    );
    // Bad input.
    assert!(plan(&cfg, 0, &opts).is_err());
    let mut zero = opts.clone();
    zero.effective_batch = Some(0);
    assert!(plan(&cfg, 1 << 30, &zero).is_err());
    // Beyond the training set: refused at once, naming the flag (issue 52: it planned for minutes).
    let mut huge = opts.clone();
    huge.effective_batch = Some(100_000);
    let err = plan(&cfg, 60 << 20, &huge).unwrap_err().to_string();
    assert!(
        err.contains("--effective-batch 100000 is more than the 5000 training images")
            && err.contains("use --effective-batch ≤ 5000"),
        "{err}"
    );

    // Three budgets, each planned and then trained: the measured peak stays within the budget.
    // The harness's own heap (`pre`) is outside the planner's view, so it plans for the rest.
    let cfg = base_config(8, 32);
    let data_size = DataSize::synthetic(TRAIN_IMAGES, TEST_IMAGES);
    let mut opts = PlanOptions::new(dev, data_size);
    opts.allow_model_change = true;
    let smallest = smallest_feasible_budget(&cfg, &opts).unwrap() + pre;
    let mut chosen = Vec::new();
    for budget in [smallest + (smallest >> 6), smallest * 3 / 2, smallest * 4] {
        let report = plan(&cfg, budget - pre, &opts).unwrap();
        let p = report.chosen().clone();
        CountingAllocator::reset_peak();
        let mut trainer =
            Trainer::new(p.config.clone(), data(), TrainerOptions::default()).unwrap();
        let summary = trainer.fit().unwrap();
        drop(trainer);
        println!(
            "budget {}: {} predicted {} (+{} harness) measured {}",
            format_bytes(budget),
            p.describe(),
            format_bytes(p.predicted_peak),
            format_bytes(pre),
            format_bytes(summary.memory.peak_bytes)
        );
        assert_eq!(summary.progress.steps, 3);
        assert!(
            summary.memory.peak_bytes <= budget,
            "{}: measured {} > budget {}",
            p.describe(),
            summary.memory.peak_bytes,
            budget
        );
        chosen.push(p);
    }
    // More memory never makes the chosen plan slower.
    assert!(chosen
        .windows(2)
        .all(|w| w[1].time_per_image <= w[0].time_per_image));
    assert_eq!(opts.margin, SAFETY_MARGIN);
}

#[test]
fn settings_given_explicitly_are_kept_or_the_plan_is_refused() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    use memtrain::config::{GradCheckpointing, Precision};
    use memtrain::predict::plan::Fixed;
    let dev = DeviceKind::cpu();
    let mut cfg = base_config(32, 128);
    cfg.memory.precision = Precision::F32;
    cfg.steps.accum_steps = 2;
    let explicit = vec!["precision".to_string(), "accum_steps".to_string()];
    let fixed = Fixed::from_explicit(&cfg, &explicit);
    assert_eq!(fixed.precision, Some(Precision::F32));
    assert_eq!(fixed.accum_steps, Some(2));
    assert_eq!(fixed.grad_checkpointing, None, "--checkpoint was not given");
    let mut opts = PlanOptions::new(dev, DataSize::exact(5000, 1000));
    // A budget where, unconstrained, half precision or more accumulation would be chosen.
    let free = plan(&cfg, 100 << 20, &opts).unwrap();
    assert!(free
        .plans
        .iter()
        .any(|p| p.precision != Precision::F32 || p.accum_steps != 2));
    opts.fixed = fixed;
    let kept = plan(&cfg, 100 << 20, &opts).unwrap();
    assert!(!kept.plans.is_empty());
    for p in &kept.plans {
        assert_eq!(
            (p.precision, p.accum_steps),
            (Precision::F32, 2),
            "{}",
            p.describe()
        );
    }
    // Too small with the fixed settings: refused, naming them.
    let e = plan(&cfg, 20 << 20, &opts).unwrap_err().to_string();
    assert!(e.contains("--precision f32 --accum-steps 2"), "{e}");
    // --checkpoint auto is a request to choose, not a fixed setting.
    let mut auto = cfg.clone();
    auto.memory.grad_checkpointing = GradCheckpointing::Auto;
    assert_eq!(
        Fixed::from_explicit(&auto, &["checkpoint".to_string()]).grad_checkpointing,
        None
    );
}

/// On the CPU `--fit-memory SIZE` is resident memory, as `--memory-limit SIZE` is: the plan is
/// made for the heap SIZE leaves, so a plan for SIZE trains under `--memory-limit SIZE`. (A plan
/// for SIZE of heap chose the plain step here, which the limit then stopped for want of heap.)
#[test]
fn a_cpu_fit_memory_budget_is_resident_memory() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let flags = common::SMALL_RUN;
    // The resident limit the plain step needs, as its refusals name it; 1.5 MiB less leaves
    // room for a micro-batch of 16, or for bf16, but not for the plain step (2 MiB more heap).
    let (_, plain) = common::needed_limits(|| common::trainer_command(flags));
    let budget = (plain - (3 << 19)).to_string();
    let dir = common::scratch("plan", "fit-resident");
    let out_dir = dir.join("run");
    let mut args: Vec<&str> = flags.to_vec();
    args.extend([
        "--fit-memory",
        &budget,
        "--memory-limit",
        &budget,
        "--max-steps",
        "3",
        "--no-eval",
        "--quiet",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    let out = common::run_trainer(&args);
    let (stdout, stderr) = (common::text(&out.stdout), common::text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("resident memory; the heap it leaves the run is"),
        "{stdout}"
    );
    let chosen = stdout
        .lines()
        .find(|l| l.starts_with("chosen:"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        !chosen.contains("micro-batch 32 × 1 step, f32,"),
        "{chosen}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("summary.json")).unwrap())
            .unwrap();
    let rss = summary["os_peak_bytes"].as_u64().unwrap();
    assert!(
        rss <= budget.parse::<u64>().unwrap(),
        "resident peak {rss} > {budget}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `--fit-memory` with `--compress-activations auto`: over a sweep of budgets, the plan is the
/// one the planner makes for the exact step whenever any exact plan fits; otherwise it is lossy,
/// the plan the planner makes with those codes named, and no storage with more bits has a plan.
/// The planner with each storage named is the oracle.
#[test]
fn auto_codes_under_fit_memory_are_exact_first_then_the_most_bits() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    use memtrain::config::{ActivationStorage, CompressActivations};
    use memtrain::predict::plan::Fixed;
    let mut cfg = base_config(32, 128);
    cfg.memory.compress_activations = CompressActivations::Auto;
    let mut opts = PlanOptions::new(DeviceKind::cpu(), DataSize::exact(5000, 1000));
    // One micro-batch per step: otherwise accumulation always finds an exact plan.
    cfg.steps.accum_steps = 1;
    opts.fixed = Fixed::from_explicit(&cfg, &["accum_steps".to_string()]);
    let named = |s: ActivationStorage, budget: u64| {
        let mut c = cfg.clone();
        c.memory.compress_activations = s.into();
        plan(&c, budget, &opts).ok()
    };
    let (mut exact, mut lossy, mut refused) = (0, 0, 0);
    for budget in (20..=90).map(|m| m << 20) {
        let Ok(auto) = plan(&cfg, budget, &opts) else {
            refused += 1;
            assert!(ActivationStorage::ALL
                .iter()
                .all(|&s| named(s, budget).is_none()));
            continue;
        };
        let chosen = auto.chosen();
        match named(ActivationStorage::None, budget) {
            Some(r) => {
                exact += 1;
                assert!(auto.smallest_exact.is_none());
                assert_eq!(chosen.describe(), r.chosen().describe(), "{budget}");
            }
            None => {
                lossy += 1;
                assert!(chosen.storage.is_lossy(), "{budget}: {}", chosen.describe());
                let r = named(chosen.storage, budget).unwrap();
                assert_eq!(chosen.describe(), r.chosen().describe(), "{budget}");
                for s in ActivationStorage::ALL {
                    if s.loss_rank() < chosen.storage.loss_rank() {
                        assert!(named(*s, budget).is_none(), "{budget}: {s} fits");
                    }
                }
                assert!(auto.render(2).contains("no exact plan fits"));
            }
        }
    }
    assert!(
        exact > 0 && lossy > 0 && refused > 0,
        "{exact} {lossy} {refused}"
    );
}
