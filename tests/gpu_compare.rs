//! `bench/gpu_compare.py`, the end of a GPU session: its tables keep the runs that succeeded and
//! its verdict names the ratios, the drift and what failed. Run here on made-up session files,
//! since a GPU session has no second chance to find that the script breaks on a failed run.

mod common;

use std::path::Path;
use std::process::Command;

fn line(fields: &str) -> String {
    format!("{{{fields}}}\n")
}

#[test]
fn the_verdict_names_ratios_drift_and_failures_and_the_tables_keep_what_ran() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipped: no python3 on this machine");
        return;
    }
    let dir = common::temp_dir("gpu-compare");
    let d = dir.as_path();
    let write = |name: &str, text: String| std::fs::write(d.join(name), text).unwrap();
    write(
        "memtrain.jsonl",
        line(
            r#""name": "bs512-f32", "rc": 0, "flags": "--batch-size 512", "peak_bytes": 300, "step_added_bytes": 200, "steady_images_per_sec": 30000, "predicted_peak_bytes": 301, "prediction_error_pct": 0.25, "reserved_peak_bytes": 450, "gpu_passes": [{"pass": "weight gradient", "shape": "512×32×32×32 → 32, 3x3 stride 1 pad 1", "dtype": "f32", "route": "im2col", "workspace_bytes": 0, "calls_per_step": 1.0, "us_per_step": 900.0}, {"pass": "forward", "shape": "512×3×32×32 → 32, 3x3 stride 1 pad 1", "dtype": "f32", "route": "cudnn ALGO_1", "workspace_bytes": 2097152, "calls_per_step": 1.0, "us_per_step": 100.0}]"#,
        ) + &line(r#""name": "bs128-f32", "rc": 1, "error": "out of memory""#),
    );
    write(
        "torch.jsonl",
        line(
            r#""name": "bs512-f32", "rc": 0, "images_per_sec": 60000, "peak_bytes": 500, "step_added_bytes": 400, "peak_reserved_bytes": 500, "drift": 0.97, "profile": {"top": [{"op": "aten::cudnn_convolution", "self_us": 1234.4}]}"#,
        ) + &line(r#""name": "bs512-f32-default", "rc": 0, "images_per_sec": 75000"#),
    );
    write(
        "workspace.jsonl",
        line(
            r#""name": "bs512-f32", "rc": 0, "flags": "--batch-size 512 --cudnn-workspace 160MiB", "peak_bytes": 400, "step_added_bytes": 300, "steady_images_per_sec": 45000"#,
        ),
    );
    write(
        "graph.jsonl",
        line(r#""name": "bs512-f32-graph", "rc": 0, "steady_images_per_sec": 33000"#),
    );
    write(
        "session.log",
        "[3s] test gpu_graph rc=0\n[9s] test conv2d rc=101\n".into(),
    );
    let out = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/gpu_compare.py"))
        .arg(d)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "bs512-f32: 30000 img/s; speed 0.50x PyTorch like for like, 0.40x its defaults; captured 0.55x; step adds 0.50x; reserved 0.90x; reserved/used 1.50x; estimate +0.2%",
        "bs512-f32 with --cudnn-workspace 160MiB: 45000 img/s; speed 0.75x PyTorch like for like, 0.60x its defaults; step adds 0.75x; reserved -",
        "bs512-f32 GPU time in convolutions: 1000 us/step; most:",
        "       900 us  weight gradient 512×32×32×32 → 32, 3x3 stride 1 pad 1 f32 on im2col",
        "       100 us  forward 512×3×32×32 → 32, 3x3 stride 1 pad 1 f32 on cudnn ALGO_1, workspace 2.0 MiB",
        "bs512-f32 PyTorch's most device time: aten::cudnn_convolution 1234 us",
        "PyTorch drift (this session over the cache): bs512-f32 0.97",
        "tests: gpu_graph ok, conv2d FAILED",
        "failed runs: bs128-f32 (see logs/)",
    ] {
        assert!(stdout.lines().any(|l| l == want), "no line {want:?} in:\n{stdout}");
    }
    let csv = std::fs::read_to_string(d.join("compare.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(
        rows.len(),
        2,
        "the header and the run that succeeded: {csv}"
    );
    let _ = std::fs::remove_dir_all(d);
    assert!(rows[1].starts_with("bs512-f32,--batch-size 512,false,300,200,30000,301,0.25,33000,500,400,60000,75000,450,500"), "{csv}");
}
