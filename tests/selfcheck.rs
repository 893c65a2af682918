//! The GPU self-check (issues 25, 40): before the first step on CUDA every pass of the custom
//! kernels runs there and on the CPU, at a tiny and at a training-like shape, and is compared.
//! Here, without a GPU, the device under test is the CPU itself, and a wrong kernel is injected by
//! altering an output of a pass.

use candle_core::{DType, Device, Tensor};
use memtrain_core::device::{self_check_kernels, self_check_kernels_with};
use memtrain_kernels::selfcheck::{check_device_with, compare, passes, tolerance, Pass};

/// The largest magnitude in `t`.
fn scale(t: &Tensor) -> f64 {
    t.abs()
        .and_then(|a| {
            a.flatten_all()?
                .max(0)?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()
        })
        .unwrap()
}

/// `t` with its last element moved by `by` (where a missing bounds check or a lost partial block
/// shows first).
fn bump_last(t: &Tensor, by: f64) -> candle_core::Result<Tensor> {
    let mut v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let last = v.len() - 1;
    v[last] += by as f32;
    Tensor::from_vec(v, t.dims(), &Device::Cpu)?.to_dtype(t.dtype())
}

#[test]
fn the_cpu_agrees_with_itself_and_the_passes_cover_training_shapes() {
    self_check_kernels(&Device::Cpu, DType::F16).unwrap();
    let all = passes();
    let training = all.iter().filter(|p| p.training_like()).count();
    assert!(
        all.len() >= 30 && training >= 20,
        "{} passes, {training} training-like",
        all.len()
    );
    // Every kernel of the tiny set has a training-like shape too.
    for p in all.iter().filter(|p| !p.training_like()) {
        assert!(
            all.iter()
                .any(|q| q.training_like() && q.kernel() == p.kernel()
                    || p.kernel() == "max-pool forward" && q.kernel() == "max-pool backward"),
            "{} has no training-like shape",
            p.kernel()
        );
    }
}

/// Every output of every pass gets a fault of its own: three tolerances of its own scale on every
/// other output (caught, and named), half a tolerance on the rest (accepted), in f32 and bf16.
#[test]
fn a_fault_in_any_output_of_any_pass_is_caught_and_named() {
    let index = |p: &Pass| passes().iter().position(|q| q == p).unwrap();
    let outputs_before = |i: usize| {
        passes()[..i]
            .iter()
            .map(|p| p.outputs().len())
            .sum::<usize>()
    };
    let big = |p: &Pass, o: usize| (outputs_before(index(p)) + o).is_multiple_of(2);
    for dtype in [DType::F32, DType::BF16] {
        let tol = tolerance(dtype);
        let alter = |p: &Pass, o: usize, t: Tensor| {
            let by = if big(p, o) { 3.0 } else { 0.5 } * tol * scale(&t);
            bump_last(&t, by)
        };
        let report = check_device_with(&Device::Cpu, &[dtype], &alter).unwrap();
        assert_eq!(report.passes_run, passes().len());
        let mut expected = Vec::new();
        for p in passes() {
            for (o, name) in p.outputs().iter().enumerate() {
                if big(p, o) {
                    expected.push((p.kernel(), p.shape(), *name));
                }
            }
        }
        let caught: Vec<_> = report
            .mismatches
            .iter()
            .map(|m| (m.kernel, m.shape.clone(), m.output))
            .collect();
        assert_eq!(caught, expected, "{dtype:?}");
        for m in &report.mismatches {
            assert_eq!(m.dtype, dtype);
            assert!(m.error > 2.5 * tol && m.error < 3.5 * tol, "{m}");
        }
        // Both halves of the alternation hit the training-like passes.
        assert!(expected.iter().filter(|e| e.1.starts_with("[64")).count() >= 8);
    }
}

/// The BatchNorm backward's input gradient is judged against its own scale, not against the γ
/// gradient's (a sum over the batch, ~30 times larger at the training shape), which let input
/// gradient errors of several tolerances through.
#[test]
fn the_batchnorm_input_gradient_is_judged_on_its_own_scale() {
    let pass = passes()
        .iter()
        .find(|p| p.kernel() == "batchnorm+relu backward" && p.shape() == "[64, 64, 32, 32]")
        .unwrap();
    let want = pass.run(&Device::Cpu, DType::F32).unwrap();
    let tol = tolerance(DType::F32);
    let by = 3.0 * tol * scale(&want[0]);
    let got = vec![
        bump_last(&want[0], by).unwrap(),
        want[1].clone(),
        want[2].clone(),
    ];
    let caught = compare(pass, DType::F32, &got, &want).unwrap();
    assert_eq!(caught.len(), 1);
    assert_eq!(caught[0].output, "input gradient");
    // One denominator over all three outputs would have passed it.
    let shared = want.iter().map(scale).fold(0.0, f64::max);
    assert!(by / shared < tol, "{} vs {tol}", by / shared);
    // A missing output or a wrong shape is a mismatch, not a pass.
    let short = compare(pass, DType::F32, &want[..2], &want).unwrap();
    assert_eq!((short.len(), short[0].output), (1, "beta gradient"));
    let reshaped = vec![
        want[0].flatten_all().unwrap(),
        want[1].clone(),
        want[2].clone(),
    ];
    assert!(compare(pass, DType::F32, &reshaped, &want).unwrap()[0]
        .error
        .is_infinite());
}

#[test]
fn a_wrong_pass_stops_the_run_with_one_line_naming_it() {
    let wrong = passes()
        .iter()
        .find(|p| p.kernel() == "conv2d weight gradient" && p.training_like())
        .unwrap();
    let alter = |p: &Pass, _: usize, t: Tensor| {
        if p == wrong {
            t.affine(1.0, 0.1 * scale(&t))
        } else {
            Ok(t)
        }
    };
    let e = self_check_kernels_with(&Device::Cpu, DType::F32, &alter).unwrap_err();
    let line = e.to_string();
    assert!(
        line.contains(&format!(
            "kernel 'conv2d weight gradient' at {}",
            wrong.shape()
        )),
        "{line}"
    );
    assert!(
        line.contains("output relative error") && line.contains("--device cpu"),
        "{line}"
    );
    assert!(
        !line.contains('\n') && !line.contains("more output"),
        "{line}"
    );
    assert_eq!(e.exit_code(), 1);
}

#[test]
fn a_nan_is_never_within_tolerance() {
    let nan = |p: &Pass, _: usize, t: Tensor| {
        if p.kernel() == "max-pool forward" && !p.training_like() {
            t.affine(f64::NAN, 0.0)
        } else {
            Ok(t)
        }
    };
    let r = check_device_with(&Device::Cpu, &[DType::BF16], &nan).unwrap();
    assert_eq!(r.mismatches.len(), 1);
    let m = &r.mismatches[0];
    assert_eq!((m.kernel, m.dtype), ("max-pool forward", DType::BF16));
    assert!(m.error.is_nan() && tolerance(DType::BF16) > 0.0);
}
