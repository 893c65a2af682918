//! memtrain's training step (width 32, batch 128, synthetic CIFAR-shaped data) split into forward,
//! backward and the full step, for each memory optimization alone and all together.
//!
//! Every case runs [`Trainer::train_step`], the one training loop, on the same batch; nothing of it
//! is copied here. The forward/backward split comes from a timing [`Callback`] that reads the clock
//! (after `Device::synchronize`) at the trainer's own hooks:
//! - `forward`: from `on_batch_begin` to `on_after_forward`, summed over the micro-batches: copying
//!   the micro-batch to the device, the forward pass in the compute precision and the loss (with
//!   checkpointing: the graph-less segment forward, then the head and loss with a graph);
//! - `backward`: from `on_after_forward` to `on_after_backward`, summed over the micro-batches: the
//!   backward pass and gradient accumulation (with checkpointing, the recomputation of each segment);
//! - `step`: the whole `train_step` call: forward and backward of every micro-batch, unscaling and
//!   the finiteness check, the optimizer update, the memory probe and the hooks.
//!
//! The three are measured on full steps (a step cannot run half-way), so each benchmark costs as
//! much time as the `step` one. Criterion's throughput is images per second of the part measured.
//! After each case a line on stderr gives the mean split of all the steps the case ran.
//!
//! `cargo bench --bench train_step` runs every case (a few minutes on 2 cores); criterion's filter
//! selects cases, e.g. `cargo bench --bench train_step -- cpu/f16` or `-- /step`. Built with
//! `--features cuda` on a machine with a GPU, every case also runs on `cuda:0`.
//! `TRAIN_STEP_BENCH_DEVICES=cpu` (or `cuda`) limits the devices.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use criterion::{Criterion, SamplingMode, Throughput};
use memtrain::callbacks::{BatchInfo, Callback};
use memtrain::config::{ConvKind, GradCheckpointing, Precision, TrainConfig};
use memtrain::data::{synthetic, Batch, Batcher, BatcherOptions, DataSplits};
use memtrain::train::{Trainer, TrainerOptions};
use memtrain_core::memory::CountingAllocator;

// The trainer's CPU memory probe reads this allocator's counters, as in `train_cifar10`; without it
// the probe would report nothing and the step would not do the work it does in a real run.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

const WIDTH: usize = 32;
const BATCH: usize = 128;

/// One configuration of the training step.
struct Case {
    name: &'static str,
    precision: Precision,
    accum_steps: usize,
    grad_checkpointing: GradCheckpointing,
    conv: ConvKind,
}

const fn case(
    name: &'static str,
    precision: Precision,
    accum_steps: usize,
    grad_checkpointing: GradCheckpointing,
    conv: ConvKind,
) -> Case {
    Case {
        name,
        precision,
        accum_steps,
        grad_checkpointing,
        conv,
    }
}

/// The configurations of the README's comparison: none, each optimization alone, all four.
const CASES: [Case; 7] = [
    case(
        "none",
        Precision::F32,
        1,
        GradCheckpointing::None,
        ConvKind::Standard,
    ),
    case(
        "f16",
        Precision::F16,
        1,
        GradCheckpointing::None,
        ConvKind::Standard,
    ),
    case(
        "bf16",
        Precision::Bf16,
        1,
        GradCheckpointing::None,
        ConvKind::Standard,
    ),
    case(
        "accum4",
        Precision::F32,
        4,
        GradCheckpointing::None,
        ConvKind::Standard,
    ),
    case(
        "ckpt-stages",
        Precision::F32,
        1,
        GradCheckpointing::Stages,
        ConvKind::Standard,
    ),
    case(
        "separable",
        Precision::F32,
        1,
        GradCheckpointing::None,
        ConvKind::Separable,
    ),
    case(
        "all",
        Precision::F16,
        4,
        GradCheckpointing::Stages,
        ConvKind::Separable,
    ),
];

/// Time spent in each part of the steps since the last reset.
#[derive(Debug, Default, Clone, Copy)]
struct Split {
    steps: u32,
    forward: Duration,
    backward: Duration,
    /// From the last micro-batch's `on_after_backward` to `on_batch_end`: unscale, finiteness
    /// check, optimizer update.
    optimizer: Duration,
    /// The clock at the previous hook of the current step.
    last: Option<Instant>,
}

impl Split {
    fn add(&mut self, other: &Split) {
        self.steps += other.steps;
        self.forward += other.forward;
        self.backward += other.backward;
        self.optimizer += other.optimizer;
    }
}

/// A callback that reads the clock at the trainer's hooks, after waiting for the device.
struct PhaseTimer {
    device: Device,
    split: Rc<RefCell<Split>>,
}

impl PhaseTimer {
    /// The time since the previous hook of this step (zero at the first one).
    fn lap(&self) -> memtrain::Result<Duration> {
        memtrain_core::device::synchronize(&self.device)?;
        let now = Instant::now();
        let mut s = self.split.borrow_mut();
        let d = s.last.map_or(Duration::ZERO, |t| now - t);
        s.last = Some(now);
        Ok(d)
    }
}

impl Callback for PhaseTimer {
    fn on_batch_begin(&mut self, _: &BatchInfo<'_>) -> memtrain::Result<()> {
        self.split.borrow_mut().last = None;
        self.lap()?;
        Ok(())
    }
    fn on_after_forward(&mut self, _: &BatchInfo<'_>) -> memtrain::Result<()> {
        let d = self.lap()?;
        self.split.borrow_mut().forward += d;
        Ok(())
    }
    fn on_after_backward(&mut self, _: &BatchInfo<'_>) -> memtrain::Result<()> {
        let d = self.lap()?;
        self.split.borrow_mut().backward += d;
        Ok(())
    }
    fn on_batch_end(&mut self, _: &BatchInfo<'_>) -> memtrain::Result<()> {
        let d = self.lap()?;
        let mut s = self.split.borrow_mut();
        s.optimizer += d;
        s.steps += 1;
        s.last = None;
        Ok(())
    }
}

/// Which part of the step a benchmark reports.
#[derive(Clone, Copy)]
enum Part {
    Forward,
    Backward,
    Step,
}

impl Part {
    fn name(self) -> &'static str {
        match self {
            Part::Forward => "forward",
            Part::Backward => "backward",
            Part::Step => "step",
        }
    }
}

/// A trainer for `case` on `device` whose steps are timed by a [`PhaseTimer`], and one batch of
/// synthetic CIFAR-shaped images for it.
fn setup(device: &str, case: &Case) -> memtrain::Result<(Trainer, Batch, Rc<RefCell<Split>>)> {
    let mut config = TrainConfig::default();
    config.model.width = WIDTH;
    config.steps.batch_size = BATCH;
    config.steps.accum_steps = case.accum_steps;
    config.memory.precision = case.precision;
    config.memory.grad_checkpointing = case.grad_checkpointing;
    config.model.conv = case.conv;
    config.device = Some(device.to_string());
    config.data.synthetic_train = BATCH;
    config.data.synthetic_test = 10;
    config.data.augment = false;
    config.output.eval = false;
    config.output.quiet = true;
    // One step per epoch, so a long nominal run: the one-cycle learning rate stays in its
    // early warm-up (small and stable) however many steps criterion takes.
    config.steps.epochs = 1_000_000;
    let (train, test) = synthetic::splits(BATCH, 10, config.seed);
    let batch = Batcher::new(
        Arc::new(train.clone()),
        BatcherOptions {
            batch_size: BATCH,
            shuffle: false,
            augment: false,
            drop_last: true,
            seed: config.seed,
            epoch: 0,
            prefetch: 1,
            start_batch: 0,
            recycle: None,
        },
    )
    .next()
    .expect("one full batch of synthetic images");
    let data = DataSplits {
        train,
        test,
        description: "synthetic CIFAR-shaped data".into(),
        test_is_validation: false,
    };
    let split = Rc::new(RefCell::new(Split::default()));
    let dev = memtrain_core::device::select_device(Some(device))?;
    let timer = PhaseTimer {
        device: dev,
        split: split.clone(),
    };
    let trainer = Trainer::new(
        config,
        data,
        TrainerOptions {
            callbacks: vec![Box::new(timer)],
            ..TrainerOptions::default()
        },
    )?;
    Ok((trainer, batch, split))
}

fn step(trainer: &mut Trainer, batch: &Batch, label: &str) {
    if let Err(e) = trainer.train_step(batch, 0, 0) {
        panic!("{label}: train_step failed: {e}");
    }
}

fn bench_case(c: &mut Criterion, device: &str, case: &Case) {
    let label = format!("{device}/{}", case.name);
    let (mut trainer, batch, split) = match setup(device, case) {
        Ok(s) => s,
        Err(e) => panic!("{label}: cannot build the trainer: {e}"),
    };
    let mut warmed = false;
    let mut total = Split::default();
    let mut group = c.benchmark_group(&label);
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .throughput(Throughput::Elements(BATCH as u64));
    for part in [Part::Forward, Part::Backward, Part::Step] {
        group.bench_function(part.name(), |b| {
            b.iter_custom(|iters| {
                if !warmed {
                    // First allocations, thread pools, kernel loading: not part of any sample
                    // (criterion's --quick mode has no warm-up phase of its own).
                    step(&mut trainer, &batch, &label);
                    warmed = true;
                }
                *split.borrow_mut() = Split::default();
                let t0 = Instant::now();
                for _ in 0..iters {
                    step(&mut trainer, &batch, &label);
                }
                let elapsed = t0.elapsed();
                let s = *split.borrow();
                total.add(&s);
                match part {
                    Part::Forward => s.forward,
                    Part::Backward => s.backward,
                    Part::Step => elapsed,
                }
            })
        });
    }
    group.finish();
    if total.steps > 0 {
        let n = total.steps as f64;
        let ms = |d: Duration| d.as_secs_f64() * 1e3 / n;
        let (f, b, o) = (ms(total.forward), ms(total.backward), ms(total.optimizer));
        eprintln!(
            "{label}: mean of {} steps: forward {f:.1} ms + backward {b:.1} ms + optimizer {o:.1} ms \
             = {:.1} ms ({:.0} img/s){}",
            total.steps,
            f + b + o,
            BATCH as f64 / ((f + b + o) / 1e3),
            match &trainer.updater.scaler {
                Some(s) if s.skipped_steps > 0 => format!(
                    "; the loss scaler skipped {} updates (overflow)",
                    s.skipped_steps
                ),
                _ => String::new(),
            }
        );
    }
}

/// The devices to bench: the CPU, and with the cuda feature the first GPU when one answers.
/// `TRAIN_STEP_BENCH_DEVICES` (comma-separated `cpu`/`cuda`) narrows the list.
fn devices() -> Vec<&'static str> {
    let wanted = std::env::var("TRAIN_STEP_BENCH_DEVICES").ok();
    let want = |d: &str| {
        wanted
            .as_deref()
            .is_none_or(|w| w.split(',').any(|x| x.trim().eq_ignore_ascii_case(d)))
    };
    let mut out = Vec::new();
    if want("cpu") {
        out.push("cpu");
    }
    if cfg!(feature = "cuda") && want("cuda") {
        match memtrain_core::device::select_device(Some("cuda")) {
            Ok(_) => out.push("cuda"),
            Err(e) => eprintln!("no CUDA device, GPU cases skipped: {e}"),
        }
    }
    out
}

fn main() {
    // No plots: the plotters backend needs system fonts, which headless machines lack.
    let mut c = Criterion::default().without_plots().configure_from_args();
    for device in devices() {
        for case in &CASES {
            bench_case(&mut c, device, case);
        }
    }
    c.final_summary();
}
