//! Bad input, table-driven, against the `train_cifar10` binary: every case exits with 2 (usage
//! error) or 1 (runtime error), prints exactly one line on stderr naming the problem and the fix,
//! never panics, and leaves no partial files: no run directory for a new run, and an existing run
//! directory (for `--resume`) exactly as it was.

mod common;

use common::{args_for, copy_dir, flags, run_trainer as run, snapshot};

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// CIFAR-10 records: label byte + 3072 pixel bytes each.
fn records(labels: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(labels.len() * 3073);
    for (i, &l) in labels.iter().enumerate() {
        out.push(l);
        out.extend((0..3072).map(|p| ((p * 7 + i * 13) % 256) as u8));
    }
    out
}

fn good_labels(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 10) as u8).collect()
}

/// A run directory with one complete snapshot (2 steps, width 4), made once and copied per case.
fn source_run() -> &'static Path {
    static SRC: OnceLock<PathBuf> = OnceLock::new();
    SRC.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("memtrain-badinput-source-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let out = run(&args_for(&["--out".into(), dir.display().to_string()]));
        assert!(
            out.status.success(),
            "the source run failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(dir
            .join("snapshots")
            .join("step-000002")
            .join("snapshot.json")
            .is_file());
        dir
    })
}

/// One bad input.
struct Case {
    name: &'static str,
    /// Builds the case's files inside its own directory and returns its flags. A `--out` is
    /// added (`<case dir>/run`) when the flags have neither `--out` nor `--resume`.
    setup: fn(&Path) -> Vec<String>,
    /// 2: usage error, 1: runtime error.
    code: i32,
    /// Words the one stderr line must contain: the problem, then the fix.
    problem: &'static str,
    fix: &'static str,
}

/// `--data-dir <dir>/data` holding `files`.
fn data_dir(dir: &Path, files: &[(&str, Vec<u8>)]) -> Vec<String> {
    let d = dir.join("data");
    std::fs::create_dir_all(&d).unwrap();
    for (name, bytes) in files {
        std::fs::write(d.join(name), bytes).unwrap();
    }
    vec!["--data-dir".into(), d.display().to_string()]
}

/// `--resume <dir>/run`, a copy of the source run damaged by `damage`.
fn resume_copy(dir: &Path, damage: fn(&Path)) -> Vec<String> {
    let run = dir.join("run");
    copy_dir(source_run(), &run);
    damage(&run.join("snapshots").join("step-000002"));
    vec!["--resume".into(), run.display().to_string()]
}

fn cases() -> Vec<Case> {
    vec![
        Case { name: "batch size 0", setup: |_| flags("--batch-size 0"), code: 2, problem: "--batch-size", fix: "positive" },
        Case { name: "negative batch size", setup: |_| flags("--batch-size -8"), code: 2, problem: "--batch-size", fix: "positive" },
        Case { name: "absurd batch size", setup: |_| flags("--batch-size 99999999999"), code: 2, problem: "absurdly large", fix: "--accum-steps" },
        Case { name: "batch size not a number", setup: |_| flags("--batch-size lots"), code: 2, problem: "lots", fix: "--help" },
        Case { name: "accumulation does not divide the batch", setup: |_| flags("--batch-size 32 --accum-steps 5"), code: 2, problem: "not divisible", fix: "multiple" },
        Case { name: "accumulation 0", setup: |_| flags("--accum-steps 0"), code: 2, problem: "--accum-steps", fix: "at least 1" },
        Case { name: "unknown precision", setup: |_| flags("--precision f8"), code: 2, problem: "f8", fix: "bf16" },
        Case { name: "unknown checkpointing", setup: |_| flags("--checkpoint layers"), code: 2, problem: "layers", fix: "stages" },
        Case { name: "segment boundary out of range", setup: |_| flags("--checkpoint segments:0,7"), code: 2, problem: "--checkpoint 'segments:0,7'", fix: "segments:2,4" },
        Case { name: "segment boundaries out of order", setup: |_| flags("--checkpoint segments:4,2"), code: 2, problem: "--checkpoint 'segments:4,2'", fix: "increasing" },
        Case { name: "unknown activation code width", setup: |_| flags("--compress-activations int3"), code: 2, problem: "int3", fix: "int2" },
        Case { name: "codes in a CUDA graph", setup: |_| flags("--compress-activations int8 --cuda-graph --device cuda"), code: 2, problem: "--compress-activations int8", fix: "drop one of them" },
        Case { name: "unknown conv kind", setup: |_| flags("--conv grouped"), code: 2, problem: "grouped", fix: "separable" },
        Case { name: "unknown optimizer", setup: |_| flags("--optimizer lamb"), code: 2, problem: "lamb", fix: "adamw" },
        Case { name: "width 0", setup: |_| flags("--width 0"), code: 2, problem: "--width", fix: "at least 1" },
        Case { name: "learning rate NaN", setup: |_| flags("--lr NaN"), code: 2, problem: "--lr", fix: "positive finite" },
        Case { name: "negative learning rate", setup: |_| flags("--lr -0.1"), code: 2, problem: "--lr", fix: "positive finite" },
        Case { name: "negative clipping norm", setup: |_| flags("--clip-grad-norm -1"), code: 2, problem: "--clip-grad-norm", fix: "0 to turn clipping off" },
        Case { name: "clipping norm NaN", setup: |_| flags("--clip-grad-norm nan"), code: 2, problem: "--clip-grad-norm", fix: "positive finite" },
        Case { name: "zero epochs", setup: |_| flags("--epochs 0"), code: 2, problem: "--epochs", fix: "--max-steps" },
        Case { name: "zero epochs with a step cap", setup: |_| flags("--epochs 0 --max-steps 2"), code: 2, problem: "--epochs", fix: "at least 1" },
        Case { name: "config key misspelt", setup: |d| { let p = d.join("typo.json"); std::fs::write(&p, r#"{"batchsize": 64}"#).unwrap(); vec!["--config".into(), p.display().to_string()] }, code: 2, problem: "batchsize", fix: "batch_size" },
        Case { name: "config is a directory", setup: |d| vec!["--config".into(), d.display().to_string()], code: 2, problem: "not a regular file", fix: "config.json" },
        Case { name: "config is a FIFO", setup: |d| { let p = d.join("fifo.json"); assert!(std::process::Command::new("mkfifo").arg(&p).status().unwrap().success()); vec!["--config".into(), p.display().to_string()] }, code: 2, problem: "not a regular file", fix: "config.json" },
        Case { name: "config is /dev/zero", setup: |_| flags("--config /dev/zero"), code: 2, problem: "not a regular file", fix: "config.json" },
        Case { name: "config far too large", setup: |d| { let p = d.join("big.json"); std::fs::write(&p, vec![b' '; 2 << 20]).unwrap(); vec!["--config".into(), p.display().to_string()] }, code: 2, problem: "larger than", fix: "config.json" },
        Case { name: "negative prune sparsity", setup: |_| flags("--prune -0.1"), code: 2, problem: "--prune", fix: "(0, 1)" },
        Case { name: "negative momentum", setup: |_| flags("--momentum -0.5"), code: 2, problem: "--momentum", fix: "[0, 1)" },
        Case { name: "config names a key twice", setup: |d| { let p = d.join("dup.json"); std::fs::write(&p, r#"{"epochs": 1, "width": 4, "epochs": 2}"#).unwrap(); vec!["--config".into(), p.display().to_string()] }, code: 2, problem: "\"epochs\" appears twice", fix: "keep one" },
        Case { name: "internal --summary-only from a user", setup: |_| flags("--summary-only"), code: 2, problem: "--summary-only", fix: "--help" },
        Case { name: "--out is /dev/null", setup: |_| flags("--out /dev/null"), code: 2, problem: "a device, not a directory", fix: "--out" },
        Case { name: "--out is a dangling symlink", setup: |d| { let l = d.join("dangling"); std::os::unix::fs::symlink(d.join("nowhere"), &l).unwrap(); vec!["--out".into(), l.display().to_string()] }, code: 2, problem: "dangling symbolic link", fix: "--out" },
        Case { name: "--out is a data file", setup: |d| { let f = d.join("data_batch_1.bin"); std::fs::write(&f, records(&good_labels(4))).unwrap(); vec!["--out".into(), f.display().to_string()] }, code: 2, problem: "an existing file, not a directory", fix: "--out" },
        Case { name: "validation fraction above 1", setup: |_| flags("--val-fraction 1.5"), code: 2, problem: "--val-fraction", fix: "(0, 1)" },
        Case { name: "unparsable memory size", setup: |_| flags("--memory-limit 12XB"), code: 2, problem: "12XB", fix: "4GiB" },
        Case { name: "memory size without a number", setup: |_| flags("--memory-limit GiB"), code: 2, problem: "GiB", fix: "512MiB" },
        Case { name: "memory size beyond any machine", setup: |_| flags("--memory-limit 99999999TiB"), code: 2, problem: "too large", fix: "888 PiB" },
        Case { name: "negative memory size", setup: |_| flags("--memory-limit -5MiB"), code: 2, problem: "'-5MiB' is negative", fix: "positive size" },
        Case { name: "memory size below a byte", setup: |_| flags("--fit-memory 0.2"), code: 2, problem: "less than one byte", fix: "positive size" },
        Case { name: "a flag where the memory size should be", setup: |_| flags("--memory-limit --dry-run"), code: 2, problem: "'--dry-run' is a flag", fix: "size first" },
        Case { name: "segments without boundaries", setup: |_| flags("--checkpoint segments:"), code: 2, problem: "--checkpoint 'segments:': no boundary", fix: "segments:2,4" },
        Case { name: "resume tracing a step already trained", setup: |d| { let mut a = resume_copy(d, |_| {}); a.extend(flags("--max-steps 4 --memory-snapshot-step 2")); a }, code: 2, problem: "already trained", fix: "later step" },
        Case { name: "unknown flag", setup: |_| flags("--batchsize 32"), code: 2, problem: "--batchsize", fix: "--help" },
        Case { name: "not a device", setup: |_| flags("--device tpu"), code: 2, problem: "tpu", fix: "cuda:N" },
        Case {
            name: "missing CUDA device",
            setup: |_| flags("--device cuda:7"),
            code: 1,
            problem: "cuda:7",
            fix: "--device cpu",
        },
        Case {
            name: "data dir missing",
            setup: |d| vec!["--data-dir".into(), d.join("nope").display().to_string()],
            code: 1,
            problem: "does not exist",
            fix: "cifar-10-binary.tar.gz",
        },
        Case {
            name: "data dir is a file",
            setup: |d| {
                let f = d.join("data_batch_1.bin");
                std::fs::write(&f, records(&good_labels(40))).unwrap();
                vec!["--data-dir".into(), f.display().to_string()]
            },
            code: 1,
            problem: "not a directory",
            fix: "--data-dir takes the directory",
        },
        Case { name: "data dir without CIFAR files", setup: |d| data_dir(d, &[("readme.txt", b"hi".to_vec())]), code: 1, problem: "no CIFAR-10 training files", fix: "--data-dir" },
        Case { name: "empty data file", setup: |d| data_dir(d, &[("data_batch_1.bin", Vec::new())]), code: 1, problem: "empty", fix: "re-extract" },
        Case {
            name: "truncated data file",
            setup: |d| {
                let mut bytes = records(&good_labels(40));
                bytes.truncate(bytes.len() - 100);
                data_dir(d, &[("data_batch_1.bin", bytes)])
            },
            code: 1,
            problem: "truncated",
            fix: "re-extract",
        },
        Case {
            name: "wrong record size (no label bytes)",
            setup: |d| data_dir(d, &[("data_batch_1.bin", vec![3u8; 3072 * 5])]),
            code: 1,
            problem: "not a multiple of 3073",
            fix: "re-extract",
        },
        Case {
            name: "label out of range",
            setup: |d| {
                let mut labels = good_labels(40);
                labels[17] = 10;
                data_dir(d, &[("data_batch_1.bin", records(&labels))])
            },
            code: 1,
            problem: "label 10",
            fix: "CIFAR-10 binary",
        },
        Case {
            name: "truncated test file",
            setup: |d| {
                let mut test = records(&good_labels(10));
                test.truncate(5000);
                data_dir(d, &[("data_batch_1.bin", records(&good_labels(40))), ("test_batch.bin", test)])
            },
            code: 1,
            problem: "test_batch.bin",
            fix: "re-extract",
        },
        Case {
            name: "fewer images than one batch",
            setup: |d| data_dir(d, &[("data_batch_1.bin", records(&good_labels(12)))]),
            code: 2,
            problem: "fewer than --batch-size",
            fix: "lower --batch-size",
        },
        Case {
            name: "--device gpu (not an alias of cuda)",
            setup: |_| flags("--device gpu"),
            code: 2,
            problem: "--device 'gpu' is not a device",
            fix: "cuda or cuda:N",
        },
        Case {
            name: "--epochs whose steps cannot be counted",
            setup: |_| flags("--epochs 6148914691236517206 --synthetic-train 96 --batch-size 32"),
            code: 2,
            problem: "more steps than can be counted",
            fix: "lower --epochs",
        },
        Case {
            name: "--out under a regular file",
            setup: |d| {
                std::fs::write(d.join("file"), b"x").unwrap();
                vec!["--out".into(), d.join("file").join("run").display().to_string()]
            },
            code: 2,
            problem: "cannot create output directory",
            fix: "writable directory",
        },
        Case {
            name: "--out holding another run's snapshots",
            setup: |d| {
                let run = d.join("run");
                copy_dir(source_run(), &run);
                vec!["--out".into(), run.display().to_string()]
            },
            code: 2,
            problem: "already holds snapshots",
            fix: "--resume",
        },
        Case {
            name: "--config file missing",
            setup: |d| vec!["--config".into(), d.join("nope.json").display().to_string()],
            code: 2,
            problem: "nope.json",
            fix: "config.json from a run directory",
        },
        Case {
            name: "--resume of a missing directory",
            setup: |d| vec!["--resume".into(), d.join("nope").display().to_string()],
            code: 2,
            problem: "no such directory",
            fix: "run directory",
        },
        Case {
            name: "--resume of a directory without snapshots",
            setup: |d| {
                std::fs::create_dir_all(d.join("run")).unwrap();
                vec!["--resume".into(), d.join("run").display().to_string()]
            },
            code: 2,
            problem: "no snapshot",
            fix: "without --resume",
        },
        Case {
            name: "--resume of a directory with results but no snapshot",
            setup: |d| {
                let run = d.join("run");
                std::fs::create_dir_all(&run).unwrap();
                std::fs::write(run.join("summary.json"), b"{}").unwrap();
                vec!["--resume".into(), run.display().to_string()]
            },
            code: 2,
            problem: "no snapshot",
            fix: "--overwrite",
        },
        Case {
            name: "--resume of a corrupted snapshot",
            setup: |d| {
                resume_copy(d, |ck| {
                    let f = ck.join("model.safetensors");
                    let mut b = std::fs::read(&f).unwrap();
                    let mid = b.len() / 2;
                    b[mid] ^= 1;
                    std::fs::write(&f, b).unwrap();
                })
            },
            code: 1,
            problem: "damaged",
            fix: "--overwrite",
        },
        Case {
            name: "--resume of a truncated snapshot",
            setup: |d| {
                resume_copy(d, |ck| {
                    let f = ck.join("optimizer.safetensors");
                    let b = std::fs::read(&f).unwrap();
                    std::fs::write(&f, &b[..b.len() / 3]).unwrap();
                })
            },
            code: 1,
            problem: "truncated",
            fix: "--overwrite",
        },
        Case {
            name: "--resume of a snapshot without its manifest",
            setup: |d| resume_copy(d, |ck| std::fs::remove_file(ck.join("snapshot.json")).unwrap()),
            code: 1,
            problem: "incomplete",
            fix: "--overwrite",
        },
        Case {
            name: "--resume with a conflicting config",
            setup: |d| {
                let mut a = resume_copy(d, |_| {});
                a.extend(flags("--width 8 --precision f16 --seed 3"));
                a
            },
            code: 2,
            problem: "width: snapshot 4, now 8; precision: snapshot f32, now f16; seed: snapshot 0, now 3",
            fix: "drop those flags",
        },
        Case {
            name: "--resume with different training data",
            setup: |d| {
                let mut a = resume_copy(d, |_| {});
                a.extend(flags("--synthetic-train 96"));
                a
            },
            code: 2,
            problem: "training data differs",
            fix: "--data-dir",
        },
        Case {
            name: "--resume with a different --out",
            setup: |d| {
                let mut a = resume_copy(d, |_| {});
                a.extend(["--out".into(), d.join("elsewhere").display().to_string()]);
                a
            },
            code: 2,
            problem: "out: run directory",
            fix: "drop those flags",
        },
    ]
}

#[test]
fn every_bad_input_fails_cleanly_with_one_line() {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("memtrain-badinput-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let cases = cases();
    assert!(cases.len() >= 20);
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let dir = root.join(format!("case{i:02}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut case_flags = (case.setup)(&dir);
        let new_run = !case_flags.iter().any(|f| f == "--out" || f == "--resume");
        if new_run {
            case_flags.extend(["--out".into(), dir.join("run").display().to_string()]);
        }
        let before = snapshot(&dir);
        let args = args_for(&case_flags);
        let out = run(&args);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        let mut problems = Vec::new();
        if out.status.code() != Some(case.code) {
            problems.push(format!(
                "exit code {:?}, expected {}",
                out.status.code(),
                case.code
            ));
        }
        if stderr.contains("panicked") {
            problems.push("panicked".into());
        }
        if lines.len() != 1 {
            problems.push(format!("{} lines on stderr", lines.len()));
        }
        let line = lines.first().copied().unwrap_or("");
        if !line.starts_with("error: ") {
            problems.push("stderr does not start with 'error: '".into());
        }
        if !line.contains(case.problem) {
            problems.push(format!(
                "stderr does not name the problem ('{}')",
                case.problem
            ));
        }
        if !line.contains(case.fix) {
            problems.push(format!("stderr does not name the fix ('{}')", case.fix));
        }
        // Nothing written: no run directory for a new run, an existing one unchanged.
        if snapshot(&dir) != before {
            let after = snapshot(&dir);
            let added: Vec<_> = after.keys().filter(|k| !before.contains_key(*k)).collect();
            problems.push(format!(
                "files changed in the case directory (new: {added:?})"
            ));
        }
        if !problems.is_empty() {
            failures.push(format!(
                "{}: {}\n    args: {}\n    stderr: {stderr}",
                case.name,
                problems.join("; "),
                args.join(" ")
            ));
        }
    }
    let _ = std::fs::remove_dir_all(&root);
    let _ = std::fs::remove_dir_all(source_run());
    assert!(
        failures.is_empty(),
        "{} of {} bad inputs misbehaved:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn the_base_flags_are_valid() {
    // Guards the table: each case must fail because of its own flag, not the base ones.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("memtrain-badinput-base-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = run(&args_for(&["--out".into(), dir.display().to_string()]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.stderr.is_empty(),
        "a successful run prints nothing on stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// CUDA asked of a build without it: a dry run still prints the CUDA prediction (it needs no GPU)
/// and says what is missing; `--fit-memory` refuses before it plans, so no plan is printed for a
/// run that cannot start.
#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_in_a_build_without_it_is_predicted_but_not_planned_or_run() {
    let dry = run(&["--dry-run", "--device", "cuda", "--width", "4"]);
    assert_eq!(dry.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&dry.stdout);
    assert!(stdout.contains("predicted peak"), "{stdout}");
    assert!(stdout.contains("dry run only: --device cuda:0: this binary was built without CUDA"));

    let plan = run(&["--fit-memory", "200MiB", "--device", "cuda", "--width", "4"]);
    assert_eq!(plan.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&plan.stdout);
    assert!(
        !stdout.contains("runner-up"),
        "no plan before the refusal: {stdout}"
    );
    let stderr = String::from_utf8_lossy(&plan.stderr);
    assert!(stderr.contains("built without CUDA") && stderr.contains("--device cpu"));
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}

/// A dry run makes no run directory, and says so where a run names its own: "dry run, nothing
/// written (a run would write into DIR)", never "run dir DIR".
#[test]
fn a_dry_run_names_the_directory_a_run_would_write_and_makes_none() {
    let dir = std::env::temp_dir().join(format!("memtrain-dry-run-dir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = dir.display().to_string();
    let dry = run(&["--dry-run", "--width", "4", "--out", &out]);
    assert_eq!(dry.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&dry.stdout);
    assert!(
        stdout.contains(&format!(
            "| dry run, nothing written (a run would write into {out})"
        )),
        "{stdout}"
    );
    assert!(!stdout.contains("run dir"), "{stdout}");
    assert!(!dir.exists(), "a dry run made {out}");
}

/// `train_cifar10 --dry-run | head -2`: a reader that has gone ends the program as it ends a C
/// program (SIGPIPE), without a panic or a backtrace. (Its stdout is a pipe whose reader is
/// closed before it starts, so its first line meets the closed pipe, however fast it runs.)
#[test]
fn a_closed_stdout_ends_the_program_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = common::trainer_command(&["--dry-run", "--width", "8"])
        .stdout(writer)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{stderr}");
}

/// `MEMTRAIN_BF16_GEMM` with a value it does not know is refused in one line, naming the values
/// it takes, before anything is written (issue 52: it was ignored without a word).
#[test]
fn an_unknown_bf16_kernel_in_the_environment_is_refused() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("memtrain-badinput-bf16-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = common::trainer_command(&args_for(&["--out".into(), dir.display().to_string()]))
        .env("MEMTRAIN_BF16_GEMM", "avx")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(
        stderr.trim(),
        "error: MEMTRAIN_BF16_GEMM=avx is not a bf16 kernel: use dpbf16, fma, widen, or unset it"
    );
    assert!(!dir.exists(), "nothing written");
}

/// Under a limit that many compute threads take most of, the refusal names the threads and
/// `RAYON_NUM_THREADS` (issue 52: 64 threads left a heap budget of 0 B and the message blamed
/// the model).
#[test]
fn a_limit_the_compute_threads_take_names_them() {
    let out = common::trainer_command(&flags(
        "--memory-limit 60MiB --synthetic-train 256 --dry-run",
    ))
    .env("RAYON_NUM_THREADS", "64")
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("after 64.00 MiB for 64 compute threads: set RAYON_NUM_THREADS lower"),
        "{stderr}"
    );
}
