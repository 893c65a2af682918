//! Magnitude pruning (`--prune`, `src/train/prune.rs`): the schedule against Keras' closed form,
//! exact per-layer masks, pruned weights staying zero through later optimizer steps, the sparse
//! model file, flag validation through the `train_cifar10` binary, and a killed-and-resumed
//! pruned run ending bit-identical to an uninterrupted one.

mod common;

use common::{
    assert_ok, bits, flags, run_trainer as run, text, trainer_command as command, values,
};

use candle_core::{DType, Device, Tensor};
use memtrain::config::{ConvKind, OptimizerKind, TrainConfig};
use memtrain::train::prune::{
    is_pruned, load_sparse, magnitude_mask, save_sparse, zeros_for, IndexEncoding, Schedule,
    DENSE_MODEL_FILE, POWER, SPARSE_MODEL_FILE,
};
use memtrain::train::snapshot::{Snapshot, MASKS_FILE, MODEL_FILE, OPTIMIZER_FILE, SNAPSHOTS_DIR};
use memtrain::train::{Trainer, TrainerOptions};
use std::collections::HashMap;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// Helpers

fn pruned_config(target: f64) -> TrainConfig {
    let mut cfg = common::tiny_config();
    cfg.pruning.prune = Some(target);
    cfg
}

fn u8s(t: &Tensor) -> Vec<u8> {
    t.flatten_all().unwrap().to_vec1::<u8>().unwrap()
}

/// Two sets of named tensors are equal, bit for bit.
fn assert_same(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>, what: &str) {
    let mut na: Vec<_> = a.keys().collect();
    let mut nb: Vec<_> = b.keys().collect();
    na.sort();
    nb.sort();
    assert_eq!(na, nb, "{what}: tensor names");
    for name in na {
        assert_eq!(a[name].shape(), b[name].shape(), "{what}: shape of {name}");
        assert_eq!(a[name].dtype(), b[name].dtype(), "{what}: dtype of {name}");
        let same = if a[name].dtype() == DType::U8 {
            u8s(&a[name]) == u8s(&b[name])
        } else {
            bits(&a[name]) == bits(&b[name])
        };
        assert!(same, "{what}: {name} differs");
    }
}

fn tensors(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

// ---------------------------------------------------------------------------------------------
// Schedule and masks

#[test]
fn schedule_follows_the_polynomial_decay_and_the_frequency() {
    let mut cfg = common::tiny_config();
    cfg.pruning.prune = Some(0.8);
    cfg.pruning.prune_initial = 0.1;
    cfg.pruning.prune_begin = 10;
    cfg.pruning.prune_end = Some(110);
    cfg.pruning.prune_every = 25;
    let s = Schedule::for_run(&cfg, 200).unwrap().expect("a schedule");
    assert_eq!((s.begin, s.end, s.every, s.power), (10, 110, 25, POWER));
    // Keras' PolynomialDecay: final + (initial - final) * (1 - (t - begin)/(end - begin))^3.
    let closed = |t: f64| 0.8 + (0.1 - 0.8) * (1.0 - (t - 10.0) / 100.0).powi(3);
    assert_eq!(s.sparsity(0), 0.1, "before begin: initial");
    assert_eq!(s.sparsity(10), 0.1, "at begin: initial");
    for t in [11, 35, 60, 85, 109] {
        assert!(
            (s.sparsity(t) - closed(t as f64)).abs() < 1e-12,
            "step {t}: {} vs {}",
            s.sparsity(t),
            closed(t as f64)
        );
    }
    assert!(
        (s.sparsity(60) - (0.8 - 0.7 * 0.125)).abs() < 1e-12,
        "midpoint"
    );
    assert_eq!(s.sparsity(110), 0.8, "at end: final");
    assert_eq!(s.sparsity(500), 0.8, "after end: held at final");
    let updates: Vec<usize> = (0..300).filter(|&t| s.updates_at(t)).collect();
    assert_eq!(
        updates,
        vec![10, 35, 60, 85, 110],
        "every 25 from begin, and at end"
    );
    // An end that every does not divide still gets its update.
    let mut every_40 = cfg.clone();
    every_40.pruning.prune_every = 40;
    let odd = Schedule::for_run(&every_40, 200).unwrap().unwrap();
    let updates: Vec<usize> = (0..300).filter(|&t| odd.updates_at(t)).collect();
    assert_eq!(updates, vec![10, 50, 90, 110]);

    // The end defaults to three quarters of the run (the rest fine-tunes); past the run's last
    // step, or not after begin, is refused.
    let default_end = Schedule::for_run(&pruned_config(0.5), 37).unwrap().unwrap();
    assert_eq!((default_end.begin, default_end.end), (0, 27));
    assert_eq!(default_end.every, memtrain::config::DEFAULT_PRUNE_EVERY);
    let err = Schedule::for_run(&cfg, 100).unwrap_err().to_string();
    assert!(
        err.contains("--prune-end 110") && err.contains("last step 100"),
        "{err}"
    );
    let mut late_begin = pruned_config(0.5);
    late_begin.pruning.prune_begin = 40;
    let err = Schedule::for_run(&late_begin, 40).unwrap_err().to_string();
    assert!(err.contains("--prune-begin 40"), "{err}");
    assert!(Schedule::for_run(&common::tiny_config(), 10)
        .unwrap()
        .is_none());
}

#[test]
fn masks_zero_exactly_the_smallest_magnitudes_with_ties_by_index() {
    let w = [0.5f32, -0.1, 0.1, 0.0, -2.0, 0.1, 3.0, -0.1];
    // |w| sorted: 0.0 (3), 0.1 (1, 2, 5, 7 by index), 0.5 (0), 2.0 (4), 3.0 (6).
    assert_eq!(magnitude_mask(&w, 0), vec![1; 8]);
    assert_eq!(magnitude_mask(&w, 1), vec![1, 1, 1, 0, 1, 1, 1, 1]);
    assert_eq!(magnitude_mask(&w, 3), vec![1, 0, 0, 0, 1, 1, 1, 1]);
    assert_eq!(magnitude_mask(&w, 5), vec![1, 0, 0, 0, 1, 0, 1, 0]);
    assert_eq!(magnitude_mask(&w, 8), vec![0; 8]);
    assert_eq!(magnitude_mask(&w, 99), vec![0; 8]);
    assert_eq!(zeros_for(0.5, 9), 5, "round(4.5) = 5");
    assert_eq!(zeros_for(0.8, 2560), 2048);
    for name in [
        "stage1.block1.conv.weight",
        "stage2.block1.dw.weight",
        "stage2.block1.pw.weight",
        "head.weight",
    ] {
        assert!(is_pruned(name), "{name}");
    }
    for name in [
        "head.bias",
        "stage1.block1.bn.weight",
        "stage1.block1.bn.bias",
    ] {
        assert!(!is_pruned(name), "{name}");
    }
}

// ---------------------------------------------------------------------------------------------
// Training

/// Train `cfg`; after its last step every pruned layer has exactly round(target · n) zeros, at
/// the mask's positions, and the optimizer state of those weights is zero too.
fn check_trained(cfg: TrainConfig) -> Trainer {
    let target = cfg.pruning.prune.unwrap();
    let mut t = common::trainer(cfg.clone());
    let summary = t.fit().expect("training");
    assert_eq!(summary.progress.steps, cfg.steps.max_steps.unwrap());
    let report = summary.pruning.expect("summary has a pruning section");
    assert_eq!(report.target, target);
    let names = t.model.named_vars();
    let masks: HashMap<String, Tensor> = t.pruner().unwrap().masks().into_iter().collect();
    let pruned: Vec<&String> = names
        .iter()
        .map(|(n, _)| n)
        .filter(|n| is_pruned(n))
        .collect();
    assert_eq!(masks.len(), pruned.len(), "one mask per pruned weight");
    assert_eq!(report.layers.len(), pruned.len());
    let state: HashMap<String, Tensor> = t.updater.optimizer.state().into_iter().collect();
    let (mut all, mut all_zeros) = (0, 0);
    for (i, (name, var)) in names.iter().enumerate() {
        let w = values(var.as_tensor());
        let zeros = w.iter().filter(|v| **v == 0.0).count();
        if !is_pruned(name) {
            assert_eq!(zeros, 0, "{name} is not pruned");
            continue;
        }
        let want = zeros_for(target, w.len());
        assert!(want > 0, "{name}: the test needs some pruning");
        assert_eq!(zeros, want, "{name}: reached zeros");
        let mask = u8s(&masks[name]);
        for (j, (&m, &v)) in mask.iter().zip(&w).enumerate() {
            assert_eq!(m == 0, v == 0.0, "{name}[{j}]: mask {m}, weight {v}");
            if m == 0 {
                assert_eq!(v.to_bits(), 0, "{name}[{j}]: pruned to +0.0");
            }
        }
        for slot in ["s1", "s2"] {
            if let Some(s) = state.get(&format!("{slot}.{i}")) {
                for (j, (&m, &v)) in mask.iter().zip(&values(s)).enumerate() {
                    if m == 0 {
                        assert_eq!(
                            v, 0.0,
                            "{name}[{j}]: optimizer state {slot} of a pruned weight"
                        );
                    }
                }
            }
        }
        let layer = report.layers.iter().find(|l| &l.name == name).unwrap();
        assert_eq!(
            (layer.weights, layer.zeros),
            (w.len(), want),
            "{name}: report"
        );
        assert_eq!(layer.sparsity, want as f64 / w.len() as f64);
        all += w.len();
        all_zeros += want;
    }
    assert_eq!(report.reached, all_zeros as f64 / all as f64);
    assert!(
        (report.reached - target).abs() < 0.01,
        "reached {} vs target {target}",
        report.reached
    );
    t
}

#[test]
fn pruned_weights_stay_zero_through_later_optimizer_steps() {
    // The schedule ends at step 4; steps 5..=10 update with momentum, which would revive the
    // pruned weights were the masks not applied after every step.
    let mut cfg = pruned_config(0.5);
    cfg.pruning.prune_end = Some(4);
    cfg.pruning.prune_every = 1;
    cfg.steps.max_steps = Some(10);
    cfg.steps.epochs = 3;
    check_trained(cfg.clone());
    // Depthwise and pointwise weights, AdamW (two state slots), a schedule that ends on the
    // run's last step with a frequency that does not divide it.
    let mut cfg = pruned_config(0.7);
    cfg.model.conv = ConvKind::Separable;
    cfg.optimizer.kind = OptimizerKind::Adamw;
    cfg.pruning.prune_end = None;
    cfg.pruning.prune_every = 3;
    cfg.pruning.prune_initial = 0.2;
    cfg.steps.max_steps = Some(8);
    cfg.steps.epochs = 2;
    check_trained(cfg);

    // Without re-applying the masks, the update moves pruned weights: the check above can fail.
    let mut cfg = pruned_config(0.5);
    cfg.steps.max_steps = Some(1);
    let mut t = common::trainer(cfg);
    t.fit().unwrap();
    let before: Vec<Vec<f32>> = t.vars().iter().map(|v| values(v.as_tensor())).collect();
    let (loss, grads) = {
        let (images, labels) = common::batch(16, 3);
        t.compute_grads(&images, &labels).unwrap()
    };
    assert!(loss.is_finite());
    let vars = t.vars().to_vec();
    let ops = memtrain_core::step::ops::CandleOps::new(&t.model, candle_core::DType::F32);
    t.updater.optimizer.step(&ops, &grads, 0.1).unwrap();
    let revived = vars.iter().zip(&before).any(|(v, b)| {
        values(v.as_tensor())
            .iter()
            .zip(b)
            .any(|(a, b)| *b == 0.0 && *a != 0.0)
    });
    assert!(revived, "a plain optimizer step revives pruned weights");
}

#[test]
fn sparse_file_expands_to_exactly_the_dense_weights() {
    let dir = common::scratch("prune", "sparse");
    let mut cfg = pruned_config(0.8);
    cfg.output.out = Some(dir.join("run"));
    cfg.steps.max_steps = Some(6);
    cfg.pruning.prune_every = 2;
    let data = common::splits(cfg.data.synthetic_train, cfg.data.synthetic_test, cfg.seed);
    let mut t = Trainer::new(
        cfg,
        data,
        TrainerOptions {
            log_files: true,
            ..Default::default()
        },
    )
    .unwrap();
    let summary = t.fit().unwrap();
    let run = dir.join("run");
    let dense = tensors(&run.join(DENSE_MODEL_FILE));
    let expanded = load_sparse(&run.join(SPARSE_MODEL_FILE), &Device::Cpu).unwrap();
    assert_same(&expanded, &dense, "sparse file expanded vs dense file");
    // The dense file is the trained model.
    for (name, var) in t.model.named_vars() {
        assert_eq!(bits(var.as_tensor()), bits(&dense[&name]), "{name}");
    }
    let report = summary.pruning.unwrap();
    let (d, s) = (
        report.dense_file_bytes.unwrap(),
        report.sparse_file_bytes.unwrap(),
    );
    assert_eq!(
        d,
        std::fs::metadata(run.join(DENSE_MODEL_FILE)).unwrap().len()
    );
    assert_eq!(
        s,
        std::fs::metadata(run.join(SPARSE_MODEL_FILE))
            .unwrap()
            .len()
    );
    assert!(
        s < d * 6 / 10,
        "at 80% sparsity the sparse file ({s}) is well below the dense ({d})"
    );
    assert!(report
        .layers
        .iter()
        .all(|l| l.encoding == Some(IndexEncoding::Bitmask)));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(json["pruning"]["target"], 0.8);
    assert_eq!(json["pruning"]["sparse_file_bytes"], s);
    assert!(json["pruning"]["layers"][0]["zeros"].as_u64().unwrap() > 0);

    // Both encodings, a -0.0 kept to the bit, and the dense tensors beside them.
    let file = dir.join("both.safetensors");
    let n = 1000;
    let sparse_w: Vec<f32> = (0..n)
        .map(|i| if i % 100 == 7 { i as f32 } else { 0.0 })
        .collect();
    let mut half_w: Vec<f32> = (0..n)
        .map(|i| if i % 2 == 0 { 0.0 } else { -(i as f32) })
        .collect();
    half_w[0] = -0.0;
    let named = vec![
        (
            "a.conv.weight".to_string(),
            Tensor::from_vec(sparse_w, (10, 4, 5, 5), &Device::Cpu).unwrap(),
        ),
        (
            "head.weight".to_string(),
            Tensor::from_vec(half_w, (10, 100), &Device::Cpu).unwrap(),
        ),
        (
            "head.bias".to_string(),
            Tensor::from_vec(vec![0f32, 1.0, 0.0], 3, &Device::Cpu).unwrap(),
        ),
    ];
    let (_, enc) = save_sparse(&file, &named).unwrap();
    assert_eq!(
        enc,
        vec![
            ("a.conv.weight".to_string(), IndexEncoding::Indices),
            ("head.weight".to_string(), IndexEncoding::Bitmask)
        ],
        "1% kept: 40 bytes of indices beat 125 of bitmask; 50%: the bitmask"
    );
    let raw = tensors(&file);
    assert_eq!(raw["a.conv.weight.indices"].dims(), &[10]);
    assert_eq!(raw["head.weight.bitmask"].dims(), &[125]);
    assert_eq!(
        raw["head.weight.values"].dims(),
        &[501],
        "500 nonzero + the -0.0"
    );
    assert!(!raw.contains_key("head.bias.values"), "biases stay dense");
    let back = load_sparse(&file, &Device::Cpu).unwrap();
    assert_same(&back, &named.into_iter().collect(), "synthetic round trip");
    // Not a sparse file: a clean error.
    std::fs::write(dir.join("junk.safetensors"), b"junk").unwrap();
    assert!(load_sparse(&dir.join("junk.safetensors"), &Device::Cpu).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// Flags

#[test]
fn bad_prune_flags_exit_2_with_one_line() {
    let base = "--device cpu --width 4 --synthetic-train 64 --synthetic-test 16 --batch-size 32 --epochs 1 --quiet --no-eval";
    // (flags, words the line must contain). The run has 2 steps.
    let cases: &[(&str, &[&str])] = &[
        ("--prune 1.0", &["--prune", "(0, 1)"]),
        ("--prune=-0.1", &["--prune", "(0, 1)"]),
        ("--prune NaN", &["--prune", "(0, 1)"]),
        (
            "--prune 0",
            &["--prune 0 prunes nothing", "leave --prune out"],
        ),
        ("--prune half", &["half", "--help"]),
        (
            "--prune-every 5",
            &["--prune-every", "only applies with --prune", "add --prune"],
        ),
        ("--prune-every 100", &["--prune-every", "add --prune"]),
        ("--prune-begin 1", &["--prune-begin", "add --prune"]),
        ("--prune-end 2", &["--prune-end", "add --prune"]),
        ("--prune-initial 0.1", &["--prune-initial", "add --prune"]),
        (
            "--prune 0.5 --prune-every 0",
            &["--prune-every", "at least 1"],
        ),
        (
            "--prune 0.5 --prune-initial 0.6",
            &["--prune-initial", "[0, --prune 0.5]"],
        ),
        (
            "--prune 0.5 --prune-begin 5 --prune-end 3",
            &["--prune-end 3", "after --prune-begin 5"],
        ),
        (
            "--prune 0.5 --prune-end 9",
            &["--prune-end 9", "last step 2", "lower --prune-end"],
        ),
        (
            "--prune 0.5 --prune-begin 2",
            &["--prune-begin 2", "step 2", "lower --prune-begin"],
        ),
    ];
    let dir = common::scratch("prune", "flags");
    for (i, (case, words)) in cases.iter().enumerate() {
        let out_dir = dir.join(format!("run{i}"));
        let mut args = flags(base);
        args.extend(flags(case));
        args.extend(["--out".to_string(), out_dir.display().to_string()]);
        let out = run(&args);
        let stderr = text(&out.stderr);
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(
            out.status.code(),
            Some(2),
            "{case}: exit code; stderr: {stderr}"
        );
        assert_eq!(lines.len(), 1, "{case}: one line on stderr, got: {stderr}");
        for w in *words {
            assert!(lines[0].contains(w), "{case}: '{}' lacks '{w}'", lines[0]);
        }
        assert!(
            !out_dir.exists(),
            "{case}: no run directory for a refused run"
        );
    }
    // The same flags with valid values run.
    let mut ok = flags(base);
    ok.extend(flags(
        "--prune 0.5 --prune-begin 0 --prune-end 2 --prune-every 1 --prune-initial 0.1",
    ));
    ok.extend(["--out".to_string(), dir.join("ok").display().to_string()]);
    let out = run(&ok);
    assert_ok(&out, "a valid pruned run");
    assert!(
        text(&out.stdout).contains("pruning: target sparsity 0.50"),
        "{}",
        text(&out.stdout)
    );
    assert!(dir.join("ok").join(SPARSE_MODEL_FILE).is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// Resume

/// 8 steps per epoch, 20 epochs (160 steps), a snapshot every 2 steps; the schedule spans the
/// kill so masks are recomputed both before and after the resume.
fn resume_args(out: &Path) -> Vec<String> {
    let mut a = flags(
        "--synthetic-train 256 --synthetic-test 32 --width 4 --batch-size 32 --epochs 20 \
         --save-every 2 --quiet --no-eval --device cpu --seed 7 \
         --prune 0.6 --prune-begin 4 --prune-end 120 --prune-every 6",
    );
    a.extend(["--out".to_string(), out.display().to_string()]);
    a
}

fn last_checkpoint(run_dir: &Path) -> Option<usize> {
    std::fs::read_dir(run_dir.join(SNAPSHOTS_DIR))
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("step-"))
                .and_then(|n| n.parse().ok())
        })
        .max()
}

#[test]
fn killed_and_resumed_pruned_run_is_bit_identical() {
    let root = common::scratch("prune", "resume");
    let reference = root.join("reference");
    assert_ok(&run(&resume_args(&reference)), "the uninterrupted run");

    let dir = root.join("killed");
    let args = resume_args(&dir);
    let mut child = command(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while last_checkpoint(&dir).is_none_or(|s| s < 20) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before step 20"
        );
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no snapshot 20 in 2 minutes"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap();
    assert!(!child.wait().unwrap().success(), "killed before the end");
    let killed_at = last_checkpoint(&dir).unwrap();
    assert!(
        killed_at < 120,
        "killed inside the schedule (at {killed_at})"
    );

    let mut resume = args.clone();
    resume.extend(["--resume".to_string(), dir.display().to_string()]);
    let out = run(&resume);
    assert_ok(&out, "the resumed run");
    assert!(text(&out.stdout).contains("resuming from"));

    let step = |d: &Path| d.join(SNAPSHOTS_DIR).join("step-000160");
    for file in [MODEL_FILE, OPTIMIZER_FILE, MASKS_FILE] {
        assert_same(
            &tensors(&step(&dir).join(file)),
            &tensors(&step(&reference).join(file)),
            file,
        );
    }
    for file in [DENSE_MODEL_FILE, SPARSE_MODEL_FILE] {
        assert!(
            std::fs::read(dir.join(file)).unwrap() == std::fs::read(reference.join(file)).unwrap(),
            "{file} differs"
        );
    }
    let masks = tensors(&step(&dir).join(MASKS_FILE));
    assert!(
        masks.values().all(|m| u8s(m).contains(&0)),
        "every mask prunes"
    );

    // The masks file is covered by the snapshot's hashes: a damaged one is skipped.
    let newest = step(&dir).join(MASKS_FILE);
    let mut bytes = std::fs::read(&newest).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&newest, bytes).unwrap();
    let ck = Snapshot::find_latest(&dir).unwrap();
    assert!(ck.state.global_step < 160, "fell back to an older snapshot");
    assert!(
        ck.skipped
            .iter()
            .any(|s| s.contains(MASKS_FILE) && s.contains("damaged")),
        "{:?}",
        ck.skipped
    );
    // Resuming without --prune (or with other --prune settings) is refused.
    let mut changed = args.clone();
    let i = changed.iter().position(|a| a == "--prune-every").unwrap();
    changed[i + 1] = "7".into();
    changed.extend(["--resume".to_string(), dir.display().to_string()]);
    let out = run(&changed);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("prune_every: snapshot 6, now 7"),
        "{}",
        text(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// A finished pruned run resumed with more `--epochs` (which moves the schedule's default end to
/// the new last step) revives no pruned weight: every mask keeps the zeros it had, and every
/// pruned layer stays at the target sparsity or above.
#[test]
fn a_longer_resumed_run_revives_no_pruned_weight() {
    let dir = common::scratch("prune", "longer").join("run");
    let args = |epochs: &str| {
        let mut a = flags(
            "--synthetic-train 128 --synthetic-test 16 --width 4 --batch-size 32 --prune 0.5 \
             --prune-every 1 --quiet --no-eval --device cpu --seed 3 --epochs",
        );
        a.extend([
            epochs.to_string(),
            "--out".into(),
            dir.display().to_string(),
        ]);
        a
    };
    assert_ok(&run(&args("2")), "the pruned run");
    let newest = |dir: &Path| Snapshot::find_latest(dir).expect("a snapshot").dir;
    let first = tensors(&newest(&dir).join(MASKS_FILE));
    let mut more = args("4");
    more.extend(["--resume".to_string(), dir.display().to_string()]);
    assert_ok(&run(&more), "resuming it for two more epochs");
    let last_dir = newest(&dir);
    let (masks, model) = (
        tensors(&last_dir.join(MASKS_FILE)),
        tensors(&last_dir.join(MODEL_FILE)),
    );
    assert!(!first.is_empty());
    for (name, before) in &first {
        let (before, after) = (u8s(before), u8s(&masks[name]));
        let weights = values(&model[name]);
        let revived = (0..before.len())
            .filter(|&i| before[i] == 0 && (after[i] != 0 || weights[i] != 0.0))
            .count();
        assert_eq!(revived, 0, "{name}: weights pruned before are live again");
        let zeros = after.iter().filter(|&&m| m == 0).count();
        assert!(
            zeros >= zeros_for(0.5, after.len()),
            "{name}: sparsity fell to {zeros} of {}",
            after.len()
        );
    }
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

/// A model file that cannot be written is an I/O failure of the run (exit 1), never a usage
/// error (exit 2): here its directory does not exist, as a full disk would fail the same write.
#[test]
fn a_model_file_that_cannot_be_written_is_an_io_error() {
    let dir = common::scratch("prune", "unwritable");
    let path = dir.join("missing").join(SPARSE_MODEL_FILE);
    let t = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
    let err = save_sparse(&path, &[("head.weight".to_string(), t)]).unwrap_err();
    assert!(
        matches!(
            err,
            memtrain::Error::Core(memtrain::error::CoreError::Io { .. })
        ),
        "{err:?} should be an I/O error"
    );
    assert_eq!(err.exit_code(), 1, "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Masks are checked against the run they belong to: an edited mask in a snapshot — all ones,
/// all zeros, or inverted — is refused on resume, before anything trains.
#[test]
fn edited_masks_are_refused_on_resume() {
    let mut cfg = pruned_config(0.5);
    cfg.pruning.prune_every = 1;
    let splits = || common::splits(cfg.data.synthetic_train, cfg.data.synthetic_test, cfg.seed);
    let mut t = Trainer::new(cfg.clone(), splits(), TrainerOptions::default()).unwrap();
    let batches: Vec<_> = memtrain::data::Batcher::new(
        std::sync::Arc::new(splits().train),
        memtrain::data::BatcherOptions {
            batch_size: cfg.steps.batch_size,
            shuffle: false,
            augment: false,
            drop_last: true,
            seed: 1,
            epoch: 0,
            prefetch: 1,
            start_batch: 0,
            recycle: None,
        },
    )
    .collect();
    for (i, b) in batches.iter().enumerate() {
        t.train_step(b, 0, i).unwrap();
    }
    let state = t.snapshot(0, batches.len(), None).unwrap();
    let mut fresh = Trainer::new(cfg.clone(), splits(), TrainerOptions::default()).unwrap();
    fresh
        .restore(state.clone())
        .expect("the untouched snapshot restores");

    type Edit = fn(u8) -> u8;
    let edits: [(&str, Edit); 3] = [
        ("all ones", |_| 1),
        ("all zeros", |_| 0),
        ("inverted", |m| 1 - m),
    ];
    for (what, edit) in edits {
        let mut edited = state.clone();
        for mask in edited.masks.as_mut().unwrap().values_mut() {
            let values: Vec<u8> = u8s(mask).into_iter().map(edit).collect();
            *mask = Tensor::from_vec(values, mask.shape(), &Device::Cpu).unwrap();
        }
        let mut t = Trainer::new(cfg.clone(), splits(), TrainerOptions::default()).unwrap();
        let e = t.restore(edited).unwrap_err().to_string();
        assert!(e.contains("the masks were altered"), "{what}: {e}");
        assert_eq!(t.position.global_step, 0, "{what}: nothing restored");
    }
}

/// The default schedule leaves steps to fine-tune the final masks: its end is three quarters of
/// the way from the begin step to the run's last step, so even a short run trains its pruned
/// model before it ends (an end at the last step applies the biggest cut after the last update).
#[test]
fn the_default_schedule_ends_before_the_run_does() {
    use memtrain::train::prune::default_end;
    assert_eq!(default_end(0, 100), 75);
    assert_eq!(default_end(20, 100), 80);
    assert_eq!(default_end(0, 3), 2, "at least one step to fine-tune");
    assert_eq!(default_end(0, 2), 1);
    assert_eq!(default_end(0, 1), 1, "a one-step run has no room");
    for total in 2..300 {
        let end = default_end(0, total);
        assert!(end < total && end >= 1, "{total}: end {end}");
    }
    // Through the trainer: a 3-epoch run's schedule ends before its last step, and the masks
    // reach the target sparsity there.
    let mut cfg = pruned_config(0.8);
    cfg.steps.epochs = 3;
    cfg.steps.max_steps = None;
    let total = 3 * (cfg.data.synthetic_train / cfg.steps.batch_size);
    let s = Schedule::for_run(&cfg, total).unwrap().unwrap();
    assert!(s.end < total, "end {} of {total} steps", s.end);
    assert_eq!(s.sparsity(s.end), 0.8);
}
