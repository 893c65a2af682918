//! One definition of every training flag: the `--help` of `train_cifar10`, the `config.json` a
//! default run writes and the flag table of `docs/flags.md` name the same flags with the same defaults,
//! and a flag given with `--config` overrides its own `config.json` key.

mod common;

use memtrain::cli::{parse_train_args, TrainArgs};
use memtrain::config::{GradCheckpointing, TrainConfig};
use serde_json::Value;
use std::collections::BTreeMap;

/// The long help of `train_cifar10`, as `--help` prints it.
fn help_text() -> String {
    match parse_train_args(["train_cifar10", "--help"]) {
        Ok(Err(text)) => text,
        other => panic!("--help did not print the help: {other:?}"),
    }
}

/// Every `--flag` of `help` with the default it shows (`None`: no `[default: ...]`).
fn help_flags(help: &str) -> BTreeMap<String, Option<String>> {
    let mut flags = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in help.lines() {
        let trimmed = line.trim_start();
        // A flag's line starts with it (`-h, --help`, `--width <WIDTH>`); of the lines of its
        // help text only the possible values start with `-`, as `- none: ...`.
        let flag = trimmed
            .split_whitespace()
            .take(2)
            .map(|w| w.trim_end_matches(','))
            .take_while(|w| w.starts_with('-') && w.len() > 1)
            .find_map(|w| w.strip_prefix("--"));
        if let Some(flag) = flag {
            let flag = flag.to_string();
            flags.insert(flag.clone(), None);
            current = Some(flag);
        } else if let (Some(flag), Some(at)) = (&current, trimmed.find("[default: ")) {
            let rest = &trimmed[at + "[default: ".len()..];
            let default = rest.split(']').next().unwrap_or(rest).to_string();
            flags.insert(flag.clone(), Some(default));
        }
    }
    flags.remove("help");
    flags.remove("version");
    flags
}

/// The help text of `--flag` in `help`, its lines joined by spaces.
fn flag_help(help: &str, flag: &str) -> String {
    let mut lines = help.lines().map(str::trim);
    let start = format!("--{flag} ");
    lines
        .find(|l| l.starts_with(&start))
        .unwrap_or_else(|| panic!("--{flag} not in --help"));
    lines
        .take_while(|l| !l.starts_with('-'))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Every flag of the documented flag table (`docs/flags.md`, kept equal to `--help` by
/// tests/readme.rs) with its default cell (`None` for `off` and `—`).
fn documented_flags() -> BTreeMap<String, Option<String>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/flags.md");
    let page = std::fs::read_to_string(path).unwrap();
    let begin = page
        .find("<!-- flags:begin")
        .expect("flag table start marker");
    let end = page
        .find("<!-- flags:end -->")
        .expect("flag table end marker");
    let mut flags = BTreeMap::new();
    for row in page[begin..end].lines().filter(|l| l.starts_with("| `--")) {
        let cells: Vec<&str> = row.split(" | ").collect();
        let flag = cells[0]
            .trim_start_matches("| `--")
            .trim_end_matches('`')
            .split_whitespace()
            .next()
            .unwrap()
            .to_string();
        let default = match cells[1] {
            "off" | "—" => None,
            cell => Some(cell.trim_matches('`').to_string()),
        };
        assert!(
            flags.insert(flag.clone(), default).is_none(),
            "--{flag} twice in the table of docs/flags.md"
        );
    }
    flags
}

/// The keys and values of the `config.json` a run without flags writes: the serialized
/// default configuration (the trainer writes `config.json` with serde from its config).
fn default_config_json() -> serde_json::Map<String, Value> {
    match serde_json::to_value(TrainConfig::default()).unwrap() {
        Value::Object(map) => map,
        other => panic!("config.json is not an object: {other}"),
    }
}

/// Clap id → long flag name, for every flag of `train_cifar10`.
fn flag_of_id() -> BTreeMap<String, String> {
    use clap::CommandFactory;
    TrainArgs::command()
        .get_arguments()
        .filter_map(|a| Some((a.get_id().to_string(), a.get_long()?.to_string())))
        .collect()
}

#[test]
fn help_docs_and_config_json_agree_on_every_flag_and_default() {
    let help = help_flags(&help_text());
    let documented = documented_flags();
    assert!(
        help.len() > 40,
        "too few flags parsed from --help: {help:?}"
    );
    assert_eq!(
        help, documented,
        "--help and the table of docs/flags.md differ (flags or defaults); run UPDATE_README=1 cargo test --release --test readme"
    );

    let help_text = help_text();
    let config = default_config_json();
    let flags = flag_of_id();
    for (key, value) in &config {
        // A training flag's clap id is its config.json key: that is how `--config FILE`
        // and `--resume` tell which keys the flags given explicitly replace.
        let flag = flags
            .get(key)
            .unwrap_or_else(|| panic!("config.json key {key} is no flag's id"));
        let shown = help
            .get(flag)
            .unwrap_or_else(|| panic!("--{flag} (config.json key {key}) is not in --help"));
        let takes_value = help_text
            .lines()
            .any(|l| l.trim_start().starts_with(&format!("--{flag} <")));
        let agrees = match (takes_value, shown, value) {
            // A switch is off by default: `--x` turns a setting on, `--no-x` turns one off.
            (false, None, Value::Bool(on)) => *on == flag.starts_with("no-"),
            (true, None, Value::Null) => true,
            // A default that depends on --optimizer (--lr, --weight-decay): the help names each
            // optimizer's, config.json has that of the default optimizer, SGD.
            (true, None, Value::Number(n)) => flag_help(&help_text, flag).contains(&format!(
                "Default: the optimizer's (sgd {}",
                n.as_f64().unwrap()
            )),
            (true, Some(d), Value::Number(n)) => {
                d.parse::<f64>().ok() == n.as_f64()
                    // A size (`32MiB`) is its bytes in config.json.
                    || memtrain::config::parse_size(d).ok() == n.as_u64()
            }
            (true, Some(d), Value::String(s)) => d == s,
            _ => false,
        };
        assert!(
            agrees,
            "--{flag}: --help and docs/flags.md show {shown:?} ({}), config.json has {key}: {value}",
            if takes_value {
                "takes a value"
            } else {
                "a switch"
            }
        );
    }
    // Every training flag is in config.json; the others say what to do with the configuration.
    let run_flags: Vec<&String> = help
        .keys()
        .filter(|f| {
            !flags
                .iter()
                .any(|(id, long)| long == *f && config.contains_key(id))
        })
        .collect();
    assert_eq!(
        run_flags,
        [
            "allow-model-change",
            "config",
            "dry-run",
            "effective-batch",
            "fit-memory",
            "overwrite",
            "resume"
        ],
        "flags of train_cifar10 that are not in config.json"
    );
}

#[test]
fn the_default_config_is_an_empty_command_line() {
    assert_eq!(common::config_of(&[]).unwrap(), TrainConfig::default());
    assert_eq!(
        memtrain::data::DataOptions::default().synthetic_train,
        TrainConfig::default().data.synthetic_train
    );
}

#[test]
fn flags_given_with_config_replace_only_their_own_keys() {
    let dir = common::scratch("flags", "merge");
    let file = dir.join("config.json");
    let mut base = default_config_json();
    base.insert("width".into(), 8.into());
    base.insert("checkpoint".into(), "blocks".into());
    base.insert("eval".into(), false.into());
    base.insert("clip_grad_norm".into(), 1.5.into());
    std::fs::write(&file, serde_json::to_string(&base).unwrap()).unwrap();
    let path = file.to_str().unwrap();

    let cfg = common::config_of(&["--config", path]).unwrap();
    assert_eq!(
        (
            cfg.model.width,
            cfg.memory.grad_checkpointing,
            cfg.output.eval,
            cfg.data.augment
        ),
        (8, GradCheckpointing::Blocks, false, true)
    );
    assert_eq!(cfg.optimizer.clip_grad_norm, Some(1.5));

    // Flags whose names are not their keys: `--checkpoint` (grad_checkpointing, key
    // `checkpoint`), `--no-augment` (augment), `--clip-grad-norm 0` (None).
    let cfg = common::config_of(&[
        "--config",
        path,
        "--checkpoint",
        "stages",
        "--no-augment",
        "--clip-grad-norm",
        "0",
    ])
    .unwrap();
    assert_eq!(
        (
            cfg.model.width,
            cfg.memory.grad_checkpointing,
            cfg.output.eval,
            cfg.data.augment
        ),
        (8, GradCheckpointing::Stages, false, false)
    );
    assert_eq!(cfg.optimizer.clip_grad_norm, None);
}

#[test]
fn config_files_read_as_an_editor_saves_them_and_0_turns_clipping_off() {
    let dir = common::scratch("flags", "bom");
    // A UTF-8 byte-order mark (Windows editors save one) and `clip_grad_norm: 0`, which means
    // what `--clip-grad-norm 0` means.
    let file = dir.join("config.json");
    std::fs::write(&file, "\u{feff}{\"width\": 8, \"clip_grad_norm\": 0}").unwrap();
    let cfg = common::config_of(&["--config", file.to_str().unwrap()]).unwrap();
    assert_eq!((cfg.model.width, cfg.optimizer.clip_grad_norm), (8, None));
    // A key given twice is refused, naming it.
    std::fs::write(&file, r#"{"width": 8, "width": 16}"#).unwrap();
    let e = common::config_of(&["--config", file.to_str().unwrap()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"width\" appears twice"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run directory's `config.json` from before gradient checkpointing got its own field name
/// (written by a run of `--width 4 --max-steps 1 --checkpoint stages --no-augment`) still reads
/// back to the same keys and values: `--resume` of an older run keeps working.
#[test]
fn an_older_config_json_reads_back() {
    const OLDER: &str = r#"{
  "data_dir": null,
  "download": false,
  "val_fraction": 0.1,
  "augment": false,
  "synthetic_train": 64,
  "synthetic_test": 32,
  "width": 4,
  "conv": "standard",
  "optimizer": "sgd",
  "lr": 0.1,
  "momentum": 0.9,
  "weight_decay": 0.0005,
  "warmup_frac": 0.25,
  "clip_grad_norm": 3.0,
  "epochs": 1,
  "batch_size": 16,
  "accum_steps": 1,
  "max_steps": 1,
  "precision": "f32",
  "checkpoint": "stages",
  "memory_limit": null,
  "pool_cache": true,
  "tf32": "on",
  "cuda_graph": false,
  "seed": 0,
  "device": "cpu",
  "out": "runs/older",
  "eval": true,
  "quiet": true,
  "save_every": 0,
  "reset_peak_each_epoch": true,
  "prune": null,
  "prune_begin": 0,
  "prune_end": null,
  "prune_every": 100,
  "prune_initial": 0.0
}"#;
    let file = common::scratch("flags", "older").join("config.json");
    std::fs::write(&file, OLDER).unwrap();
    let cfg = TrainConfig::from_json_file(&file).unwrap();
    assert_eq!(cfg.memory.grad_checkpointing, GradCheckpointing::Stages);
    assert!(!cfg.data.augment);
    // Every key of the older file keeps its value; keys added since take their defaults.
    let older: serde_json::Value = serde_json::from_str(OLDER).unwrap();
    let now = serde_json::to_value(&cfg).unwrap();
    let default = serde_json::to_value(TrainConfig::default()).unwrap();
    for (k, v) in now.as_object().unwrap() {
        let want = older.get(k).unwrap_or(&default[k]);
        assert_eq!(v, want, "{k}");
    }
    assert!(older
        .as_object()
        .unwrap()
        .keys()
        .all(|k| now.get(k).is_some()));
}
