//! The estimate table every run prints tells what each layer saves and recomputes under the
//! chosen schedule, and its columns add up to the totals under it; the what-if table predicts
//! each optimization alone and all together (`memtrain::predict::what_if`). Pure predictions: no
//! training, synthetic data sizes.

use memtrain::cli::flags_config;
use memtrain::config::{ActivationStorage, ConvKind, GradCheckpointing, Precision, TrainConfig};
use memtrain::predict::{
    estimate_with, what_if, what_if_table, Baseline, DataSize, DeviceKind, Estimate,
};
use memtrain_core::memory::format_bytes;

fn device() -> DeviceKind {
    DeviceKind::Cpu {
        threads: 2,
        l2_cache_bytes: 1 << 20,
    }
}

fn baseline() -> Baseline {
    Baseline::Modeled(DataSize::synthetic(4096, 512))
}

fn config(
    precision: Precision,
    accum: usize,
    ckpt: GradCheckpointing,
    conv: ConvKind,
) -> TrainConfig {
    let mut cfg = TrainConfig::default();
    cfg.steps.batch_size = 128;
    cfg.memory.precision = precision;
    cfg.steps.accum_steps = accum;
    cfg.memory.grad_checkpointing = ckpt;
    cfg.model.conv = conv;
    cfg.device = Some("cpu".into());
    cfg
}

/// Every combination of the four optimizations (checkpointing concrete).
fn all_configs() -> Vec<TrainConfig> {
    let mut out = Vec::new();
    for p in [Precision::F32, Precision::F16, Precision::Bf16] {
        for a in [1, 4] {
            for ck in [
                GradCheckpointing::None,
                GradCheckpointing::Stages,
                GradCheckpointing::Blocks,
            ] {
                for conv in [ConvKind::Standard, ConvKind::Separable] {
                    out.push(config(p, a, ck, conv));
                }
            }
        }
    }
    out
}

/// The rows of the printed table as cells (the header and separator left out).
fn table_rows(e: &Estimate) -> Vec<Vec<String>> {
    e.table()
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| layer"))
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect()
}

#[test]
fn columns_add_up_to_the_totals() {
    for cfg in all_configs() {
        let e = estimate_with(&cfg, device(), baseline()).unwrap();
        let what = cfg.label();
        let saved: u64 =
            e.layers.iter().map(|l| l.saved_bytes).sum::<u64>() + e.kept.input_saved_bytes;
        assert_eq!(saved, e.kept.activation_bytes, "{what}: saved column");
        let recomputed: u64 = e.layers.iter().map(|l| l.recompute_bytes).sum();
        assert_eq!(
            recomputed, e.kept.recomputed_bytes,
            "{what}: recomputed column"
        );
        let params: usize = e.layers.iter().map(|l| l.params).sum();
        assert_eq!(
            params as u64 * 4,
            e.held.param_bytes,
            "{what}: params column"
        );

        // The printed table: one row per layer, the input row first, the total row last, whose
        // cells are the totals; the line under it repeats them.
        let rows = table_rows(&e);
        assert_eq!(rows.len(), e.layers.len() + 2, "{what}: rows");
        assert_eq!(rows[0][0], "input (micro-batch)");
        let total = rows.last().unwrap();
        assert_eq!(total[0], "total");
        assert_eq!(total[2], params.to_string(), "{what}");
        assert_eq!(total[3], format_bytes(e.kept.activation_bytes), "{what}");
        assert_eq!(total[4], format_bytes(e.kept.recomputed_bytes), "{what}");
        let table = e.table();
        assert!(
            table.contains(&format!(
                "saved for backward {} per micro-batch",
                format_bytes(e.kept.activation_bytes)
            )),
            "{what}: {table}"
        );
    }
}

#[test]
fn a_recomputed_block_keeps_what_it_would_save_in_the_forward() {
    // The tape stores a recomputed h as it stores a saved one (codes included), so the recompute
    // column under `blocks` is, block by block, the saved column without checkpointing.
    for storage in ActivationStorage::ALL {
        let with = |ck| {
            let mut c = config(Precision::F32, 1, ck, ConvKind::Standard);
            c.memory.compress_activations = (*storage).into();
            estimate_with(&c, device(), baseline()).unwrap()
        };
        let (none, blocks) = (
            with(GradCheckpointing::None),
            with(GradCheckpointing::Blocks),
        );
        let last = none.layers.iter().rposition(|l| l.saved_bytes > 0).unwrap();
        for (i, (n, b)) in none.layers.iter().zip(&blocks.layers).enumerate() {
            let recomputed = if i == last { 0 } else { n.saved_bytes };
            assert_eq!(b.recompute_bytes, recomputed, "{storage:?} {}", n.name);
        }
    }
}

#[test]
fn schedule_decides_what_is_saved_and_recomputed() {
    let f32_none = config(
        Precision::F32,
        1,
        GradCheckpointing::None,
        ConvKind::Standard,
    );
    let e = estimate_with(&f32_none, device(), baseline()).unwrap();
    // Without checkpointing every conv keeps its output h for the backward (the DESIGN floor:
    // 16+16+8+8+4+4 MiB + the 1.5 MiB input at batch 128, width 32), nothing is recomputed.
    for l in &e.layers {
        let expect = if l.kind.name() == "conv3x3" {
            l.output_bytes
        } else {
            0
        };
        assert_eq!(l.saved_bytes, expect, "{}", l.name);
        assert_eq!(l.recompute_bytes, 0, "{}", l.name);
    }
    assert_eq!(e.kept.activation_bytes, (56 << 20) + (3 << 19));

    // Blocks: each block's input is saved on the layer that made it, every h but the last
    // block's is recomputed (the last segment keeps its own, as Chen et al.'s schedule does).
    let blocks = config(
        Precision::F32,
        1,
        GradCheckpointing::Blocks,
        ConvKind::Standard,
    );
    let b = estimate_with(&blocks, device(), baseline()).unwrap();
    assert_eq!(b.kept.recomputed_bytes, 52 << 20);
    for l in &b.layers {
        let conv = l.kind.name() == "conv3x3";
        let last = l.name.starts_with("stage3.block2");
        let recompute = if conv && !last { l.output_bytes } else { 0 };
        assert_eq!(l.recompute_bytes, recompute, "{}", l.name);
        if conv && last {
            assert_eq!(l.saved_bytes, l.output_bytes, "{}", l.name);
        }
    }
    let saved_on = |name: &str| {
        b.layers
            .iter()
            .find(|l| l.name == name)
            .unwrap()
            .saved_bytes
    };
    assert_eq!(saved_on("stage1.block1.bn_relu"), 16 << 20);
    assert_eq!(saved_on("stage1.block2.pool"), 4 << 20);
    assert_eq!(
        saved_on("stage3.block2.pool"),
        0,
        "the head's input is not saved"
    );
    assert_eq!(b.kept.input_saved_bytes, 3 << 19);
}

#[test]
fn what_if_rows_are_the_estimates_of_their_flags() {
    let cfg = config(
        Precision::Bf16,
        1,
        GradCheckpointing::Stages,
        ConvKind::Standard,
    );
    let rows = what_if(&cfg, device(), baseline()).unwrap();
    let labels: Vec<&str> = rows.iter().map(|r| r.label.as_str()).collect();
    assert_eq!(
        labels,
        [
            "none",
            "f16",
            "bf16",
            "accum4",
            "ckpt-stages",
            "ckpt-blocks",
            "separable",
            "all",
            "int8 (lossy)",
            "int4 (lossy)",
            "int2 (lossy)"
        ]
    );
    let none = rows[0].predicted_peak_bytes;
    for r in &rows {
        // The row's flags on top of the run's other settings give exactly its prediction.
        let mut c = flags_config(&r.flags).unwrap();
        c.steps.batch_size = cfg.steps.batch_size;
        c.device = cfg.device.clone();
        let e = estimate_with(&c, device(), baseline()).unwrap();
        assert_eq!(e.peak, r.predicted_peak_bytes, "{}", r.label);
        assert_eq!(
            r.below_none_bytes,
            none as i64 - e.peak as i64,
            "{}",
            r.label
        );
    }
    // All together keeps the run's own half precision and checkpointing.
    let all = rows.iter().find(|r| r.label == "all").unwrap();
    assert_eq!(
        all.flags.join(" "),
        "--precision bf16 --accum-steps 4 --checkpoint stages --conv separable"
    );
    assert!(rows
        .iter()
        .all(|r| r.predicted_peak_bytes >= all.predicted_peak_bytes));
    let table = what_if_table(&rows);
    assert_eq!(table.lines().count(), 3 + rows.len(), "{table}");
    assert!(table.contains("| accum4 | --accum-steps 4 |"), "{table}");
}

#[test]
fn what_if_leaves_out_accumulation_a_batch_cannot_take() {
    let mut cfg = config(
        Precision::F32,
        1,
        GradCheckpointing::None,
        ConvKind::Standard,
    );
    cfg.steps.batch_size = 1;
    let rows = what_if(&cfg, device(), baseline()).unwrap();
    assert!(rows.iter().all(|r| !r.label.starts_with("accum")));
    cfg.steps.batch_size = 6;
    let rows = what_if(&cfg, device(), baseline()).unwrap();
    assert!(rows.iter().any(|r| r.label == "accum2"));
}
