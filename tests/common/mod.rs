//! Shared helpers for the integration tests: tiny configurations, synthetic data, comparisons.
#![allow(dead_code)]

use candle_core::Tensor;
use memtrain::config::TrainConfig;
use memtrain::data::{synthetic, DataSplits};
use memtrain::train::{Trainer, TrainerOptions};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// A configuration that trains in milliseconds: width 4, batch 16, synthetic data.
pub fn tiny_config() -> TrainConfig {
    let mut cfg = TrainConfig::default();
    cfg.model.width = 4;
    cfg.steps.batch_size = 16;
    cfg.steps.epochs = 1;
    cfg.steps.max_steps = Some(2);
    cfg.data.synthetic_train = 64;
    cfg.data.synthetic_test = 32;
    cfg.output.eval = false;
    cfg.output.quiet = true;
    cfg.device = Some("cpu".into());
    cfg
}

/// The configuration `train_cifar10 ARGS` would run (the flags parsed and validated).
/// A 3-step CPU run of width `width` and batch `batch` on `train` + `test` synthetic images,
/// without evaluation or output: the estimate tests' base.
pub fn cpu_config(width: usize, batch: usize, train: usize, test: usize) -> TrainConfig {
    let mut cfg = TrainConfig::default();
    cfg.model.width = width;
    cfg.steps.batch_size = batch;
    cfg.steps.max_steps = Some(3);
    cfg.output.eval = false;
    cfg.output.quiet = true;
    cfg.device = Some("cpu".into());
    cfg.data.synthetic_train = train;
    cfg.data.synthetic_test = test;
    cfg
}

pub fn config_of(args: &[&str]) -> memtrain::Result<TrainConfig> {
    use memtrain::cli::{parse_train_args, TrainCommand};
    let parsed = parse_train_args(std::iter::once("train_cifar10").chain(args.iter().copied()))?
        .expect("not --help");
    Ok(TrainCommand::try_from(parsed)?.config)
}

/// Synthetic train/test splits.
pub fn splits(n_train: usize, n_test: usize, seed: u64) -> DataSplits {
    let (train, test) = synthetic::splits(n_train, n_test, seed);
    DataSplits {
        train,
        test,
        description: "synthetic (test)".into(),
        test_is_validation: false,
    }
}

/// A trainer without progress output or files.
pub fn trainer(cfg: TrainConfig) -> Trainer {
    let data = splits(cfg.data.synthetic_train, cfg.data.synthetic_test, cfg.seed);
    Trainer::new(cfg, data, TrainerOptions::default()).expect("trainer builds")
}

/// A trainer with extra callbacks.
pub fn trainer_with(cfg: TrainConfig, options: TrainerOptions) -> Trainer {
    let data = splits(cfg.data.synthetic_train, cfg.data.synthetic_test, cfg.seed);
    Trainer::new(cfg, data, options).expect("trainer builds")
}

/// A deterministic batch of `n` normalized synthetic images and labels.
pub fn batch(n: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let ds = synthetic::generate(n, seed);
    let mut images = vec![0f32; n * 3072];
    for i in 0..n {
        memtrain::data::batcher::normalize_into(ds.image(i), &mut images[i * 3072..(i + 1) * 3072]);
    }
    (images, ds.labels.iter().map(|&l| l as u32).collect())
}

/// Max |a-b| / max |b| over two tensors (compared in f64).
pub fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let a = a
        .to_dtype(candle_core::DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    let b = b
        .to_dtype(candle_core::DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    assert_eq!(a.len(), b.len(), "shape mismatch");
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f64, f64::max);
    // `f64::max` skips NaN, so a NaN in either tensor would otherwise compare as agreement.
    assert!(
        a.iter().chain(&b).all(|v| v.is_finite()) || a == b,
        "non-finite values"
    );
    diff / scale
}

/// Every parameter of a trainer, as host vectors.
pub fn params(t: &Trainer) -> Vec<Tensor> {
    t.vars()
        .iter()
        .map(|v| v.as_tensor().copy().unwrap())
        .collect()
}

/// A temporary directory unique to this test process and `name`, removed first if present.
pub fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("memtrain-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `../shared/data/cifar10-subset` beside the checkout, if present.
pub fn real_subset() -> Option<std::path::PathBuf> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/cifar10-subset");
    p.is_dir().then_some(p)
}

/// The `train_cifar10` example binary of this build profile, built once per test process.
pub fn trainer_binary() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| example_binary("train_cifar10"))
}

/// The example binary `name` of this build profile, built by `cargo build` (so call it once
/// and keep the path).
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("path of the test executable");
    // Integration tests run from <target dir>/<profile>/deps/.
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("<target>/<profile>")
        .to_path_buf();
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "--quiet", "--example", name, "--manifest-path"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"));
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    // The features of this test build, so the example is built from the same artifacts.
    let features: Vec<&str> = [
        ("cuda", cfg!(feature = "cuda")),
        ("cudnn", cfg!(feature = "cudnn")),
        ("download", cfg!(feature = "download")),
    ]
    .into_iter()
    .filter_map(|(name, on)| on.then_some(name))
    .collect();
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    let out = cmd.output().expect("cargo runs");
    assert!(
        out.status.success(),
        "building the {name} example failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bin = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "{} missing after building the example",
        bin.display()
    );
    bin
}

/// Bytes of a child's output as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Assert that a child process succeeded, showing its output when it did not.
pub fn assert_ok(out: &std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed ({:?}):\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// The `train_cifar10` binary with `args`, one compute thread (bit-exact runs, see
/// tests/resume.rs) and no stdin.
pub fn trainer_command<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Command {
    let mut cmd = Command::new(trainer_binary());
    cmd.args(args)
        .env("RAYON_NUM_THREADS", "1")
        .stdin(std::process::Stdio::null());
    cmd
}

/// [`trainer_command`] run to completion.
pub fn run_trainer<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> std::process::Output {
    trainer_command(args)
        .output()
        .expect("train_cifar10 starts")
}

/// A fresh, empty scratch directory `memtrain-<group>-<name>-<pid>` under the target directory
/// (whatever a failed test leaves there goes with `cargo clean`).
pub fn scratch(group: &str, name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("memtrain-{group}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Copy a directory tree.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().filter_map(|e| e.ok()) {
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if src.is_dir() {
            copy_dir(&src, &dst);
        } else {
            std::fs::copy(&src, &dst).unwrap();
        }
    }
}

/// Every file and directory under `dir` (by relative path) with the bytes of the regular files;
/// empty when `dir` does not exist.
pub fn snapshot(dir: &Path) -> std::collections::BTreeMap<PathBuf, Option<Vec<u8>>> {
    fn walk(
        root: &Path,
        dir: &Path,
        out: &mut std::collections::BTreeMap<PathBuf, Option<Vec<u8>>>,
    ) {
        for e in std::fs::read_dir(dir).unwrap().filter_map(|e| e.ok()) {
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_path_buf();
            if p.is_dir() {
                out.insert(rel, None);
                walk(root, &p, out);
            } else if p.is_file() {
                out.insert(rel, Some(std::fs::read(&p).unwrap()));
            } else {
                // A FIFO planted by a test: reading it would block; its presence is recorded.
                out.insert(rel, Some(Vec::new()));
            }
        }
    }
    let mut out = std::collections::BTreeMap::new();
    if dir.is_dir() {
        walk(dir, dir, &mut out);
    }
    out
}

/// [`trainer_command`] started with stdout discarded and stderr piped.
pub fn spawn_trainer<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> std::process::Child {
    trainer_command(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("train_cifar10 starts")
}

/// Flags that make a valid, fast trainer run (the bad-input and bounds tables); a case replaces any of them by giving the same flag.
pub const BASE: &[(&str, &str)] = &[
    ("--device", "cpu"),
    ("--width", "4"),
    ("--synthetic-train", "64"),
    ("--synthetic-test", "16"),
    ("--batch-size", "32"),
    ("--epochs", "1"),
];

/// `case` flags plus the base flags it does not give, plus `--quiet --no-eval`.
pub fn args_for(case: &[String]) -> Vec<String> {
    let mut a: Vec<String> = case.to_vec();
    for (flag, value) in BASE {
        if !case
            .iter()
            .any(|c| c == flag || c.starts_with(&format!("{flag}=")))
        {
            a.push(flag.to_string());
            a.push(value.to_string());
        }
    }
    a.extend(["--quiet".to_string(), "--no-eval".to_string()]);
    a
}

/// Whitespace-separated words of `s` as trainer arguments.
pub fn flags(s: &str) -> Vec<String> {
    s.split_whitespace().map(String::from).collect()
}

/// Every element of a tensor as f32 (any float dtype).
pub fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// Every element's f32 bits, so that two results compare exactly (`-0.0 != 0.0`, NaN == NaN).
pub fn bits(t: &Tensor) -> Vec<u32> {
    values(t).into_iter().map(f32::to_bits).collect()
}

/// The flags of a small CPU run on synthetic data (width 8, batch 32, 256 + 16 images): what the
/// tests of limits and plans train when they start the trainer.
pub const SMALL_RUN: &[&str] = &[
    "--width",
    "8",
    "--batch-size",
    "32",
    "--synthetic-train",
    "256",
    "--synthetic-test",
    "16",
    "--device",
    "cpu",
];

/// The `--memory-limit`s in bytes that a run needs, as its refusals name them ("raise
/// --memory-limit to at least X"): first for its data set and model, then for its training step
/// as well. `base` makes the run's command (program, flags, environment); the limit and
/// `--dry-run` are added to it.
pub fn needed_limits(base: impl Fn() -> Command) -> (u64, u64) {
    let at_least = |limit: u64| -> Option<u64> {
        let out = base()
            .args(["--memory-limit", &limit.to_string(), "--dry-run"])
            .output()
            .expect("the trainer starts");
        if out.status.success() {
            return None;
        }
        let stderr = text(&out.stderr);
        // "raise --memory-limit to at least X", or `--checkpoint auto`'s "needs --memory-limit X".
        let tail = ["raise --memory-limit to at least ", "needs --memory-limit "]
            .iter()
            .find_map(|p| stderr.rsplit_once(p).map(|(_, t)| t))
            .unwrap_or_else(|| panic!("no needed limit in: {stderr}"));
        let mut words = tail.split_whitespace();
        let value: f64 = words.next().unwrap().parse().unwrap();
        let unit = match words.next().unwrap().trim_end_matches([';', ',', '.']) {
            "KiB" => 1u64 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            _ => 1,
        };
        Some((value * unit as f64).ceil() as u64)
    };
    let data_and_model = at_least(1 << 20).expect("1 MiB holds no run");
    let mut step = data_and_model;
    // Each refusal names what its own check needs; the next check may need more. Each process
    // measures its own reserve (it varies by up to 0.35 MiB), so a refusal may name no more than
    // the limit it was given: then go up a step of 256 KiB.
    let mut tries = 0;
    while let Some(more) = at_least(step) {
        step = more.max(step + (256 << 10));
        tries += 1;
        assert!(tries < 40, "the needed limit never settles (last {step})");
    }
    (data_and_model, step)
}

/// The `--memory-limit` in bytes under which a CPU run's heap budget is `heap`: what the run
/// predicts its process holds beyond the heap, read off its refusal and its predicted peak, added
/// to the heap with the allocator's slack (`memtrain_core::memory::os::RssReserve`).
pub fn limit_for_heap(base: impl Fn() -> Command, heap: u64) -> u64 {
    let out = base()
        .args(["--memory-limit", "64GiB", "--dry-run"])
        .output()
        .expect("the trainer starts");
    let stdout = text(&out.stdout);
    let predicted: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("predicted peak "))
        .and_then(|l| l.split(" MiB").next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no predicted peak in: {stdout}"));
    let predicted = predicted * 1048576.0;
    let slack = 1.0 + memtrain_core::memory::os::RSS_HEAP_SLACK;
    let outside = needed_limits(base).1 as f64 - predicted * slack;
    (heap as f64 * slack + outside).ceil() as u64
}

/// A child memory cgroup with a limit, removed on drop.
pub struct Cgroup(std::path::PathBuf);

impl Cgroup {
    /// A new group limited to `bytes`, or `None` (with the reason printed) where none can be made.
    pub fn new(name: &str, bytes: u64) -> Option<Cgroup> {
        let root = std::path::Path::new("/sys/fs/cgroup/memory");
        let dir = root.join(format!("memtrain-test-{name}-{}", std::process::id()));
        let made = std::fs::create_dir(&dir)
            .and_then(|()| std::fs::write(dir.join("memory.limit_in_bytes"), bytes.to_string()));
        match made {
            Ok(()) => Some(Cgroup(dir)),
            Err(e) => {
                eprintln!(
                    "skipped the cgroup part: cannot make a memory cgroup under {} ({e}); needs cgroup v1's memory controller and root",
                    root.display()
                );
                let _ = std::fs::remove_dir(&dir);
                None
            }
        }
    }

    /// Run `program args` inside the group.
    pub fn run(&self, program: &std::path::Path, args: &[String]) -> std::process::Output {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(r#"echo $$ > "$0/cgroup.procs" && exec "$@""#)
            .arg(&self.0)
            .arg(program)
            .args(args)
            .output()
            .unwrap()
    }

    /// A number the group's file `name` holds (e.g. `memory.usage_in_bytes`).
    pub fn read(&self, name: &str) -> u64 {
        let text = std::fs::read_to_string(self.0.join(name)).unwrap();
        text.trim().parse().unwrap()
    }

    /// Times the group hit its limit (the kernel reclaimed or killed).
    pub fn oom_kills(&self) -> u64 {
        // memory.oom_control's `oom_kill N` (kernels since 4.13).
        std::fs::read_to_string(self.0.join("memory.oom_control"))
            .ok()
            .and_then(|t| {
                t.lines()
                    .find_map(|l| l.strip_prefix("oom_kill ").map(|n| n.trim().parse().ok()))
                    .flatten()
            })
            .unwrap_or(0)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// The text of every `<text>` element of the SVG at `path`, trimmed (the charts' tests read
/// labels from it).
pub fn svg_texts(path: &std::path::Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).expect("svg exists");
    let doc = roxmltree::Document::parse(&text).expect("svg is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    doc.descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text().map(|t| t.trim().to_string()))
        .collect()
}
