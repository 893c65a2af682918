//! `--download` in a build without the `download` cargo feature (the default build): a one-line
//! usage error (exit 2) that says how to turn the feature on, given before any work.
#![cfg(not(feature = "download"))]

mod common;

use std::ffi::OsStr;

use memtrain::config::DOWNLOAD_NOT_BUILT;
use memtrain::Error;

#[test]
fn download_without_the_feature_is_a_usage_error_before_any_work() {
    let dir = common::scratch("download", "refused");
    let run = dir.join("run");
    let out = common::run_trainer(&[
        OsStr::new("--download"),
        OsStr::new("--out"),
        run.as_os_str(),
    ]);
    let stderr = common::text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr:\n{stderr}");
    assert_eq!(stderr, format!("error: {DOWNLOAD_NOT_BUILT}\n"));
    assert!(
        DOWNLOAD_NOT_BUILT.contains(
            "cargo run --release --features download --example train_cifar10 -- --download"
        ),
        "{DOWNLOAD_NOT_BUILT}"
    );
    assert!(!DOWNLOAD_NOT_BUILT.contains('\n'));
    assert_eq!(
        common::text(&out.stdout),
        "",
        "nothing done, nothing printed"
    );
    assert!(!run.exists(), "no run directory written");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn download_without_the_feature_fails_validation() {
    let err = common::config_of(&["--download"]).unwrap_err();
    assert!(
        matches!(&err, Error::Core(memtrain::error::CoreError::Config(m)) if m == DOWNLOAD_NOT_BUILT),
        "{err}"
    );
    assert_eq!(err.exit_code(), 2);
}
