//! The gradient error of `--compress-activations int8|int4|int2`: per parameter, the relative L2
//! error and the cosine of the compressed step's gradient against the exact step's, on one batch
//! of held-out images, with the same weights.
//!
//! ```text
//! cargo run --release --example codes_error -- --data-dir ../shared/data/cifar10-subset \
//!     --warmup-steps 100 --json docs/results/codes-error.json
//! ```
//! The network first trains `--warmup-steps` exact steps (at initialization the gradients are
//! not those of training), then the same batch goes through the exact step and the step with each
//! width of codes in each precision; for scale, the exact f16 and bf16 gradients are compared with
//! the exact f32 ones. Any training flag of `train_cifar10` is accepted (`--batch-size`,
//! `--width`, `--conv`, …); `--precision` is swept, `--compress-activations` is what is compared.

use anyhow::{bail, Context};
use candle_core::{DType, Tensor};
use clap::Parser;
use memtrain::config::{ActivationStorage, Precision, TrainConfig};
use memtrain::data::batcher::normalize_into;
use memtrain::data::{self, DataOptions};
use memtrain::train::{Trainer, TrainerOptions};
use std::path::PathBuf;

/// Gradient error of compressed saved activations against the exact step.
#[derive(Debug, Parser)]
#[command(name = "codes_error", version, long_about = None)]
struct Args {
    /// Exact training steps before the measurement
    #[arg(long, default_value_t = 100)]
    warmup_steps: usize,
    /// Also write the table as JSON to this file
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    #[command(flatten)]
    train: TrainConfig,
}

/// One parameter's error in one precision.
#[derive(serde::Serialize)]
struct Row {
    compared: String,
    parameter: String,
    relative_l2: f64,
    cosine: f64,
}

/// One row per parameter, and a last one (`all`) for every parameter's gradient as one vector:
/// the error of gradients `got` against `reference`, printed.
fn compare(
    what: &str,
    names: &[String],
    got: &[Option<Tensor>],
    reference: &[Option<Tensor>],
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (name, (g, r)) in names.iter().zip(got.iter().zip(reference)) {
        let (g, r) = (
            g.as_ref().context("no gradient")?,
            r.as_ref().context("no gradient")?,
        );
        let (rel, cos) = error(g, r)?;
        println!("| {what} | {name} | {rel:.4} | {cos:.5} |");
        rows.push(Row {
            compared: what.to_string(),
            parameter: name.clone(),
            relative_l2: rel,
            cosine: cos,
        });
    }
    let flat = |g: &[Option<Tensor>]| -> anyhow::Result<Tensor> {
        let parts = g
            .iter()
            .map(|t| {
                Ok(t.as_ref()
                    .context("no gradient")?
                    .to_dtype(DType::F32)?
                    .flatten_all()?)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, 0)?)
    };
    let (rel, cos) = error(&flat(got)?, &flat(reference)?)?;
    println!("| {what} | all | {rel:.4} | {cos:.5} |");
    rows.push(Row {
        compared: what.to_string(),
        parameter: "all".into(),
        relative_l2: rel,
        cosine: cos,
    });
    Ok(rows)
}

/// Relative L2 error and cosine of `a` against `b`.
fn error(a: &Tensor, b: &Tensor) -> anyhow::Result<(f64, f64)> {
    let a = a.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let dot: f64 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let diff: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
    Ok((norm(&diff) / norm(&b), dot / (norm(&a) * norm(&b))))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut cfg = args.train;
    if cfg.memory.compress_activations != ActivationStorage::None.into() {
        bail!(
            "--compress-activations: codes_error compares none with every width itself; leave the flag out"
        );
    }
    let work = std::env::temp_dir().join(format!("memtrain-codes-error-{}", std::process::id()));
    cfg.output.out = Some(work.clone());
    cfg.output.eval = false;
    cfg.output.quiet = true;
    cfg.steps.max_steps = Some(args.warmup_steps.max(1));
    cfg.steps.epochs = cfg.steps.epochs.max(1000);
    cfg.validate()?;
    let splits = data::load(&DataOptions {
        data_dir: cfg.data.data_dir.clone(),
        download: cfg.data.download,
        val_fraction: cfg.data.val_fraction,
        seed: cfg.seed,
        synthetic_train: cfg.data.synthetic_train,
        synthetic_test: cfg.data.synthetic_test,
        stop: None,
    })?;
    let n = cfg.steps.batch_size;
    if splits.test.len() < n {
        bail!(
            "the held-out split has {} images, fewer than --batch-size {n}; lower --batch-size",
            splits.test.len()
        );
    }
    let mut images = vec![0f32; n * 3072];
    for i in 0..n {
        normalize_into(splits.test.image(i), &mut images[i * 3072..(i + 1) * 3072]);
    }
    let labels: Vec<u32> = (0..n).map(|i| splits.test.label(i) as u32).collect();
    println!("{}", splits.description);

    let mut t = Trainer::new(cfg, splits, TrainerOptions::default())?;
    if args.warmup_steps > 0 {
        t.fit().context("the exact warm-up training")?;
    }
    let names: Vec<String> = t.model.named_vars().into_iter().map(|(n, _)| n).collect();
    let mut rows = Vec::new();
    println!("\n| compared | parameter | relative L2 | cosine |\n|---|---|---:|---:|");
    // Every precision's exact gradients, and those of each width of codes.
    let mut exact = Vec::new();
    for p in Precision::ALL {
        t.config.memory.precision = *p;
        t.config.memory.compress_activations = ActivationStorage::None.into();
        let e = t.compute_grads(&images, &labels)?.1;
        for &c in ActivationStorage::ALL.iter().filter(|c| c.is_lossy()) {
            t.config.memory.compress_activations = c.into();
            let q = t.compute_grads(&images, &labels)?.1;
            rows.extend(compare(&format!("{p} {c} vs {p} exact"), &names, &q, &e)?);
        }
        exact.push(e);
    }
    // For scale: what half precision alone changes, against the exact f32 step.
    for (p, e) in Precision::ALL.iter().zip(&exact).skip(1) {
        rows.extend(compare(
            &format!("{p} exact vs f32 exact"),
            &names,
            e,
            &exact[0],
        )?);
    }
    std::fs::remove_dir_all(&work).ok();
    if let Some(path) = args.json {
        let json = serde_json::to_vec_pretty(&serde_json::json!({
            "warmup_steps": args.warmup_steps,
            "batch_size": n,
            "rows": rows,
        }))?;
        memtrain::io::write_atomic(&path, &json)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
