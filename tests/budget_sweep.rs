//! `examples/budget_sweep.rs`, the two ends of `bench/budget_sweep.sh`: `limits --codes` starts
//! at the lossy floor the trainer's own dry run accepts, and `chart` fails a point whose cgroup
//! killed a run, and gives each point's accuracy change from the codes' measured means.

mod common;

use std::path::Path;
use std::process::Command;

const FLAGS: [&str; 6] = [
    "--batch-size",
    "64",
    "--synthetic-train",
    "256",
    "--synthetic-test",
    "16",
];

/// The trainer's `--dry-run` verdict under `--checkpoint auto --compress-activations auto
/// --memory-limit LIMIT`: its exit status and output.
fn dry_run(limit: u64) -> (i32, String) {
    let out = Command::new(common::trainer_binary())
        .args(FLAGS)
        .args([
            "--dry-run",
            "--checkpoint",
            "auto",
            "--compress-activations",
            "auto",
        ])
        .args(["--memory-limit", &limit.to_string()])
        .output()
        .unwrap();
    (out.status.code().unwrap_or(-1), common::text(&out.stdout))
}

#[test]
fn codes_limits_start_at_the_lossy_floor() {
    let out = Command::new(common::example_binary("budget_sweep"))
        .args(["limits", "--codes", "--points", "2", "--trainer"])
        .arg(common::trainer_binary())
        .arg("--")
        .args(FLAGS)
        .output()
        .unwrap();
    common::assert_ok(&out, "budget_sweep limits --codes");
    let limits: Vec<u64> = common::text(&out.stdout)
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(limits.len(), 2);
    let (floor, plain) = (limits[0], limits[1]);
    let (code, text) = dry_run(floor);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("(lossy"), "the floor is a lossy plan: {text}");
    // 4 KiB is the bisection's step.
    assert_eq!(dry_run(floor - 4096).0, 2);
    let (code, text) = dry_run(plain);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("auto: segmentation none, activations none (exact)"),
        "{text}"
    );
}

/// A run directory as `chart` reads it, with `oom_kills` in its cgroup.json (none: no cgroup).
fn fake_run(dir: &Path, storage: &str, limit: u64, oom_kills: Option<u64>) {
    std::fs::create_dir_all(dir).unwrap();
    let summary = serde_json::json!({
        "memory_limit_bytes": limit, "predicted_peak_bytes": 50u64 << 20,
        "step_peak_bytes": 49u64 << 20, "os_peak_bytes": limit - (4 << 20), "recompute_flops": 0,
    });
    std::fs::write(dir.join("summary.json"), summary.to_string()).unwrap();
    let config = serde_json::json!({"checkpoint": "none", "compress_activations": storage});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(
        dir.join("batches.csv"),
        "global_step,images,step_secs\n1,64,1.0\n2,64,0.1\n",
    )
    .unwrap();
    if let Some(kills) = oom_kills {
        let cg = serde_json::json!({"limit_bytes": limit, "max_usage_bytes": limit - (8 << 20), "oom_kills": kills});
        std::fs::write(dir.join("cgroup.json"), cg.to_string()).unwrap();
    }
}

#[test]
fn chart_fails_a_point_its_cgroup_killed_and_gives_accuracy_changes() {
    let root = common::scratch("budget_sweep", "chart");
    let accuracy = root.join("accuracy.json");
    // Per seed: int8 is 1 point above the exact step on seeds 0 and 1 (seed 2 has no exact run).
    let run = |code: &str, seed: u64, acc: f64| serde_json::json!({"compress_activations": code, "seed": seed, "accuracy": acc});
    let means = serde_json::json!({"runs": [
        run("none", 0, 0.75), run("none", 1, 0.70), run("int8", 0, 0.76), run("int8", 1, 0.71),
        run("int8", 2, 0.50)]});
    std::fs::write(&accuracy, means.to_string()).unwrap();
    let limit = 80u64 << 20;
    for kills in [0, 1] {
        let run = root.join(format!("int8-{kills}"));
        fake_run(&run, "int8", limit, Some(kills));
        let out = Command::new(common::example_binary("budget_sweep"))
            .args(["chart", "--out"])
            .arg(root.join(format!("chart-{kills}")))
            .arg("--point")
            .arg(&run)
            .arg("--accuracy")
            .arg(&accuracy)
            .output()
            .unwrap();
        let text = common::text(&out.stdout);
        assert!(
            text.contains("| int8 |") && text.contains("+1.00 points (2 seeds)"),
            "{text}"
        );
        if kills == 0 {
            common::assert_ok(&out, "chart");
            assert!(text.contains("| yes |"), "{text}");
            let csv = std::fs::read_to_string(root.join("chart-0.csv")).unwrap();
            assert!(
                csv.lines()
                    .nth(1)
                    .unwrap()
                    .ends_with(",0,true,640.0,0,1.00,2"),
                "{csv}"
            );
        } else {
            assert_eq!(out.status.code(), Some(1));
            assert!(text.contains("| NO |"), "{text}");
            assert!(common::text(&out.stderr).contains("killed by its cgroup"));
        }
    }
}
