//! Device selection: `cpu`, `cuda`, `cuda:N`, or automatic.

use crate::error::{Error, Result};
use candle_core::Device;

/// A parsed `--device` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The CPU.
    Cpu,
    /// CUDA device with this ordinal.
    Cuda(usize),
}

/// Parse `cpu`, `cuda` or `cuda:N`.
pub fn parse_device_spec(s: &str) -> Result<DeviceSpec> {
    let t = s.trim().to_ascii_lowercase();
    if t == "cpu" {
        return Ok(DeviceSpec::Cpu);
    }
    if t == "cuda" {
        return Ok(DeviceSpec::Cuda(0));
    }
    if t == "gpu" || t.starts_with("gpu:") {
        // Not an alias: every later message would name a device the user never typed.
        return Err(Error::config(format!(
            "--device '{s}' is not a device; the GPU is spelled cuda or cuda:N"
        )));
    }
    if let Some(n) = t.strip_prefix("cuda:") {
        return n.parse::<usize>().map(DeviceSpec::Cuda).map_err(|_| {
            Error::config(format!(
                "--device '{s}': expected cpu, cuda or cuda:N with N a GPU index"
            ))
        });
    }
    Err(Error::config(format!(
        "--device '{s}' is not a device; expected cpu, cuda or cuda:N"
    )))
}

/// Resolve the configured device. `None` picks CUDA when the build has it and a GPU answers,
/// else the CPU (with a one-line warning when CUDA was compiled in but no GPU is present).
pub fn select_device(spec: Option<&str>) -> Result<Device> {
    match spec {
        None => Ok(auto_device()),
        Some(s) => match parse_device_spec(s)? {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(n) => cuda_device(n),
        },
    }
}

#[cfg(feature = "cuda")]
fn auto_device() -> Device {
    match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            let why = e.to_string();
            let why = why.lines().next().unwrap_or("").trim();
            eprintln!(
                "warning: built with CUDA but no usable GPU was found ({why}); training on the CPU"
            );
            Device::Cpu
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn auto_device() -> Device {
    Device::Cpu
}

#[cfg(feature = "cuda")]
fn cuda_device(n: usize) -> Result<Device> {
    Device::new_cuda(n).map_err(|e| {
        let first = e.to_string().lines().next().unwrap_or("").to_string();
        Error::Device(format!(
            "--device cuda:{n}: no such GPU here ({first}); run nvidia-smi to list GPUs or use --device cpu"
        ))
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(n: usize) -> Result<Device> {
    Err(Error::Device(format!(
        "--device cuda:{n}: this binary was built without CUDA; rebuild with --features cuda (see docs/cuda.md) or use --device cpu"
    )))
}

/// The error of a CUDA `spec` (`cuda`, `cuda:N`) in a build without CUDA, which can predict a
/// CUDA run (`--dry-run`, `--fit-memory --dry-run`) but not train one; `None` otherwise.
pub fn cuda_not_built(spec: Option<&str>) -> Option<Error> {
    match spec.map(parse_device_spec) {
        Some(Ok(DeviceSpec::Cuda(n))) if !cfg!(feature = "cuda") => cuda_device(n).err(),
        _ => None,
    }
}

/// Before the first step on a GPU: every pass of the custom kernels, at a tiny and at a
/// training-like shape, run once there and on the CPU, whose implementations are tested
/// exhaustively, and compared ([`memtrain_kernels::selfcheck`]), in f32 and in the run's `compute`
/// dtype. Prints one line saying what was checked; a pass that differs stops the run with an
/// [`Error::Device`] naming it. Once per process for each device, dtype and math mode (TF32,
/// cuDNN's determinism): a process that builds many trainers, like the GPU tests, checks once.
pub fn self_check_kernels(device: &Device, compute: candle_core::DType) -> Result<()> {
    use std::sync::Mutex;
    type Checked = (String, candle_core::DType, bool, bool);
    static PASSED: Mutex<Vec<Checked>> = Mutex::new(Vec::new());
    let key = |dtype| {
        (
            device_name(device),
            dtype,
            memtrain_kernels::tf32(),
            memtrain_kernels::cudnn_nondeterministic(),
        )
    };
    let mut dtypes = check_dtypes(compute);
    dtypes.retain(|dt| {
        !PASSED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&key(*dt))
    });
    if dtypes.is_empty() {
        return Ok(());
    }
    check_dtypes_with(device, &dtypes, &|_, _, t| Ok(t))?;
    let mut passed = PASSED.lock().unwrap_or_else(|p| p.into_inner());
    passed.extend(dtypes.into_iter().map(key));
    Ok(())
}

/// [`self_check_kernels`] with `alter` applied to each output of each pass on `device` (see
/// [`memtrain_kernels::selfcheck::check_device_with`]), every time: how the tests inject a wrong
/// kernel.
pub fn self_check_kernels_with(
    device: &Device,
    compute: candle_core::DType,
    alter: &memtrain_kernels::selfcheck::Alter<'_>,
) -> Result<()> {
    check_dtypes_with(device, &check_dtypes(compute), alter)
}

/// The dtypes a run's self-check covers: f32, and the compute dtype when it is another.
fn check_dtypes(compute: candle_core::DType) -> Vec<candle_core::DType> {
    let mut dtypes = vec![candle_core::DType::F32];
    if compute != candle_core::DType::F32 {
        dtypes.push(compute);
    }
    dtypes
}

/// The self-check of `dtypes` on `device`, with `alter` (see [`self_check_kernels_with`]).
fn check_dtypes_with(
    device: &Device,
    dtypes: &[candle_core::DType],
    alter: &memtrain_kernels::selfcheck::Alter<'_>,
) -> Result<()> {
    let start = std::time::Instant::now();
    let report = memtrain_kernels::selfcheck::check_device_with(device, dtypes, alter)?;
    let name = device_name(device);
    match report.mismatches.first() {
        None => {
            eprintln!("{}", self_check_summary(&name, dtypes, start.elapsed()));
            Ok(())
        }
        Some(m) => {
            let more = match report.mismatches.len() - 1 {
                0 => String::new(),
                k => format!(" (and {k} more output(s))"),
            };
            Err(Error::Device(format!(
                "self-check on {name} before the first step: {m}{more}; the run stops rather than \
                 train on a wrong kernel: use --device cpu, and report this line with the output \
                 of nvidia-smi"
            )))
        }
    }
}

/// The line a passed self-check prints: the device, the dtypes, the time, and every kernel with
/// the shapes it ran at.
pub fn self_check_summary(
    device: &str,
    dtypes: &[candle_core::DType],
    elapsed: std::time::Duration,
) -> String {
    let passes = memtrain_kernels::selfcheck::passes();
    let mut kernels: Vec<(&str, Vec<String>)> = Vec::new();
    for p in passes {
        match kernels.iter_mut().find(|(k, _)| *k == p.kernel()) {
            Some((_, shapes)) => shapes.push(p.shape()),
            None => kernels.push((p.kernel(), vec![p.shape()])),
        }
    }
    let list: Vec<String> = kernels
        .iter()
        .map(|(k, shapes)| format!("{k} at {}", shapes.join(", ")))
        .collect();
    format!(
        "self-check on {device}: {} kernel passes agree with the CPU in {:?} ({:.2} s): {}",
        passes.len() * dtypes.len(),
        dtypes,
        elapsed.as_secs_f64(),
        list.join("; ")
    )
}

/// A short name for reports: "cpu" or "cuda:N".
pub fn device_name(dev: &Device) -> String {
    match dev.location() {
        candle_core::DeviceLocation::Cpu => "cpu".to_string(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Wait until all queued work on the device has finished (before reading a clock or a counter).
pub fn synchronize(dev: &Device) -> Result<()> {
    dev.synchronize()?;
    Ok(())
}
