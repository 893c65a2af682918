//! The GPU self-check (issue 25): before the first step on CUDA every pass of the custom kernels
//! runs once there and on the CPU and is compared. Here, without a GPU, the device under test is
//! the CPU itself, and a wrong kernel is injected by altering one pass's result.

use candle_core::{DType, Device, Tensor};
use memtrain::config::Precision;
use memtrain::device::{self_check_kernels, self_check_kernels_with};
use memtrain_kernels::selfcheck::{check_device, check_device_with, pass_names, tolerance};

#[test]
fn the_cpu_agrees_with_itself_in_every_precision() {
    for p in [Precision::F32, Precision::F16, Precision::Bf16] {
        self_check_kernels(&Device::Cpu, p.compute_dtype()).unwrap();
    }
    assert_eq!(
        check_device(&Device::Cpu, &[DType::F32, DType::BF16]).unwrap(),
        None
    );
}

#[test]
fn every_wrong_pass_is_named_and_stops_the_run() {
    let names = pass_names();
    assert!(names.len() >= 10, "{names:?}");
    for &wrong in &names {
        // An error of a tenth of the result's scale: far below what an indexing bug gives.
        let alter = |name: &str, t: Tensor| {
            if name == wrong {
                let scale = t
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_dtype(DType::F64)?
                    .to_scalar::<f64>()?;
                t.affine(1.0, 0.1 * scale.max(1e-3))
            } else {
                Ok(t)
            }
        };
        let m = check_device_with(&Device::Cpu, &[DType::F32], &alter)
            .unwrap()
            .unwrap_or_else(|| panic!("'{wrong}' altered but not caught"));
        assert_eq!(m.kernel, wrong);
        assert!(m.error > m.tolerance);

        let e = self_check_kernels_with(&Device::Cpu, DType::F16, &alter).unwrap_err();
        let line = e.to_string();
        assert!(line.contains(&format!("kernel '{wrong}'")), "{line}");
        assert!(line.contains("--device cpu"), "{line}");
        assert_eq!(e.exit_code(), 1);
    }
}

#[test]
fn a_nan_is_never_within_tolerance() {
    let nan = |name: &str, t: Tensor| {
        if name == "max-pool forward" {
            t.affine(f64::NAN, 0.0)
        } else {
            Ok(t)
        }
    };
    let m = check_device_with(&Device::Cpu, &[DType::BF16], &nan)
        .unwrap()
        .unwrap();
    assert_eq!((m.kernel, m.dtype), ("max-pool forward", DType::BF16));
    assert!(m.error.is_nan() && tolerance(DType::BF16) > 0.0);
}
