//! Gradient clipping by the global norm (`--clip-grad-norm`): a step whose gradients are longer
//! than the limit is scaled down to it, direction kept; a shorter one is untouched.

mod common;

use memtrain::config::TrainConfig;

/// Every parameter's change over one training step, flattened, for a configuration.
fn first_update(cfg: TrainConfig) -> Vec<f64> {
    let mut t = common::trainer(cfg);
    let before = common::params(&t);
    t.fit().unwrap();
    let after = common::params(&t);
    before
        .iter()
        .zip(&after)
        .flat_map(|(b, a)| {
            (a - b)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_dtype(candle_core::DType::F64)
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
        })
        .collect()
}

fn one_step(clip: Option<f64>) -> TrainConfig {
    let mut cfg = common::tiny_config();
    cfg.steps.max_steps = Some(1);
    // Without weight decay the first SGD update is -lr·(1+m)·g exactly, so the update's
    // length is lr·(1+m)·|g|.
    cfg.optimizer.weight_decay = 0.0;
    cfg.optimizer.clip_grad_norm = clip;
    cfg
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

#[test]
fn a_long_step_is_scaled_to_the_limit_with_its_direction_kept() {
    let free_cfg = one_step(None);
    // The learning rate of step 0 of the one-cycle schedule.
    let lr = memtrain_core::step::optim::one_cycle_lr(
        0,
        1,
        free_cfg.optimizer.lr,
        free_cfg.optimizer.warmup_frac,
    );
    let free = first_update(free_cfg.clone());
    let grad_norm = norm(&free) / (lr * (1.0 + free_cfg.optimizer.momentum));
    let limit = grad_norm / 4.0;
    let clipped = first_update(one_step(Some(limit)));
    let clipped_norm = norm(&clipped) / (lr * (1.0 + free_cfg.optimizer.momentum));
    // The updates are differences of f32 weights, so they carry rounding of about 1e-4 relative.
    assert!(
        (clipped_norm / limit - 1.0).abs() < 1e-3,
        "clipped gradient norm {clipped_norm}, limit {limit}"
    );
    // Same direction: the clipped update is the free one times limit/norm, element by element.
    let worst = free
        .iter()
        .zip(&clipped)
        .map(|(f, c)| (f / 4.0 - c).abs())
        .fold(0f64, f64::max);
    let scale = clipped.iter().fold(0f64, |m, c| m.max(c.abs()));
    assert!(
        worst <= scale * 1e-3,
        "direction changed: {worst} vs {scale}"
    );
}

#[test]
fn a_step_within_the_limit_is_untouched() {
    let free = first_update(one_step(None));
    let loose = first_update(one_step(Some(1e9)));
    assert_eq!(
        free, loose,
        "clipping above the gradient norm changes nothing, bit for bit"
    );
}

#[test]
fn the_limit_is_validated() {
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let mut cfg = common::tiny_config();
        cfg.optimizer.clip_grad_norm = Some(bad);
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("--clip-grad-norm"), "{e}");
    }
}

#[test]
fn divergence_advice_is_true_for_the_run_at_hand() {
    let dir = common::temp_dir("diverge");
    let o = std::process::Command::new(common::trainer_binary())
        .args([
            "--device",
            "cpu",
            "--width",
            "4",
            "--synthetic-train",
            "256",
            "--batch-size",
            "32",
            "--lr",
            "1e6",
            "--clip-grad-norm",
            "0",
            "--quiet",
            "--no-eval",
            "--out",
        ])
        .arg(dir.join("run"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("non-finite"), "{stderr}");
    // An f32 run without clipping and without a snapshot: no advice that cannot apply.
    let default = TrainConfig::default().optimizer.clip_grad_norm.unwrap();
    assert!(
        stderr.contains(&format!("--clip-grad-norm {default}")),
        "{stderr}"
    );
    assert!(!stderr.contains("--precision f32"), "{stderr}");
    assert!(stderr.contains("no snapshot was saved"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--clip-during first-epoch`: the first epoch's steps are clipped as with `all`, later ones not.
#[test]
fn first_epoch_clipping_stops_after_the_first_epoch() {
    use memtrain::config::ClipDuring;
    // One step per epoch (16 images, batch 16), so step 1 is the first epoch and step 2 the second.
    let cfg = |steps: usize, during: ClipDuring| {
        let mut cfg = one_step(Some(1e-3));
        cfg.data.synthetic_train = 16;
        cfg.steps.epochs = steps;
        cfg.steps.max_steps = Some(steps);
        cfg.optimizer.clip_during = during;
        cfg
    };
    let all = first_update(cfg(1, ClipDuring::All));
    let first = first_update(cfg(1, ClipDuring::FirstEpoch));
    let mut unclipped = one_step(None);
    unclipped.data.synthetic_train = 16;
    let free = first_update(unclipped);
    assert_eq!(first, all, "the first epoch's step is clipped");
    assert!(
        norm(&free) > 10.0 * norm(&first),
        "and clipping shortens it"
    );
    // Over two epochs, the second step goes unclipped only with first-epoch.
    let all = first_update(cfg(2, ClipDuring::All));
    let first = first_update(cfg(2, ClipDuring::FirstEpoch));
    assert!(
        norm(&first) > 10.0 * norm(&all),
        "the second epoch's step is not clipped: {} vs {}",
        norm(&first),
        norm(&all)
    );
}

/// The README's 8-step comparison learns without a spike: with the default recipe on real
/// CIFAR-10, no step's loss is above 1.5 times the first (it climbed to 3.3 times before the
/// warm-up had a least length).
#[test]
fn a_short_default_run_does_not_blow_up() {
    let Some(data) = common::real_subset() else {
        eprintln!("skipped: ../shared/data/cifar10-subset is absent");
        return;
    };
    let dir = common::scratch("clipping", "short-run");
    let out = common::run_trainer(&[
        "--data-dir",
        data.to_str().unwrap(),
        "--max-steps",
        "8",
        "--no-eval",
        "--quiet",
        "--overwrite",
        "--out",
        dir.to_str().unwrap(),
    ]);
    common::assert_ok(&out, "the 8-step run");
    let csv = std::fs::read_to_string(dir.join("batches.csv")).unwrap();
    let mut rows = csv.lines();
    let header: Vec<&str> = rows.next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == "loss").unwrap();
    let losses: Vec<f64> = rows
        .map(|r| r.split(',').nth(col).unwrap().parse().unwrap())
        .collect();
    assert_eq!(losses.len(), 8);
    let worst = losses.iter().cloned().fold(0.0, f64::max);
    assert!(worst <= 1.5 * losses[0], "losses {losses:?}");
}
