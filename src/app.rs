//! The `train_cifar10` application: flags in, a run (new, resumed, planned or dry), results and
//! an exit code out. The example binary is only this module's [`train`] plus the counting
//! allocator, so the library holds every decision a run makes.

use crate::cli::{parse_train_args, TrainCommand};
use crate::config::ConvKind;
use crate::error::{Error, Result};
use crate::predict::plan::{plan, PlanOptions};
use crate::predict::{DataSize, DeviceKind};
use crate::train::run_dir::{check_new, Claim};
use crate::train::snapshot::Snapshot;
use crate::train::trainer::default_run_dir;
use crate::train::{Trainer, TrainerOptions};
use memtrain_core::memory::format_bytes;
use memtrain_core::model::cnn::param_count;

/// Run `train_cifar10` with the command line `args` (the program name first, as
/// [`std::env::args_os`] gives it): parse and validate the flags, size the inputs, then train a
/// new run, continue one (`--resume`), plan one (`--fit-memory`) or only print the estimate
/// (`--dry-run`), and write the results. `--help` prints the help and returns `Ok`.
///
/// # Errors
/// Any [`Error`], one line; [`exit`] turns it into the process's exit code. A run stopped by a
/// signal returns [`Error::Interrupted`] after saving a snapshot and `summary.json`.
pub fn train<I, T>(args: I) -> Result<()>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let Some(Setup {
        cmd,
        cfg,
        resume,
        explicit,
    }) = setup(args)?
    else {
        return Ok(());
    };
    // An environment switch that changes what the run writes says so first.
    if cmd.summary_only {
        println!("{}", crate::cli::SUMMARY_ONLY_NOTE);
    }
    // data set, model and step sized against --memory-limit, --fit-memory and the
    // machine before anything is loaded or built (src/predict/bounds.rs); from here on Ctrl-C/SIGTERM
    // stops the loading too (exit 130, nothing written).
    let resumed = resume.as_ref().map_or(0, |ck| ck.state.tensor_bytes());
    crate::predict::bounds::check_inputs(&cfg, cmd.plan.fit_memory, cmd.dry_run, resumed)?;
    // CUDA asked of a build without it (a real run was refused in `setup`): the dry run still
    // prints the CUDA prediction, which needs no GPU, then says what is missing.
    let no_cuda = memtrain_core::device::cuda_not_built(cfg.device.as_deref());
    // Ctrl-C/SIGTERM: finish the step, save a snapshot and summary.json, exit 130.
    let stop = if cmd.dry_run {
        None
    } else {
        Some(crate::signal::install_stop_handler()?)
    };
    // --fit-memory picks micro-batch, accumulation, checkpointing and precision
    // (src/predict/plan.rs) for the loaded data, and the run uses the chosen plan (--dry-run: printed only).
    let (cfg, loaded) = match cmd.plan.fit_memory {
        Some(budget) => fit_memory(cfg, budget, &cmd, &explicit, stop.clone())?,
        None => (cfg, None),
    };
    println!(
        "memtrain: width {} ({} params standard, {} separable; using {}), {}",
        cfg.model.width,
        param_count(cfg.model.width, ConvKind::Standard),
        param_count(cfg.model.width, ConvKind::Separable),
        cfg.model.conv,
        cfg.label()
    );
    let options = trainer_options(&cmd, resume.is_some(), stop);
    if let Some(e) = no_cuda {
        return print_cuda_estimate(&cfg, &e.into());
    }
    let mut trainer = match loaded {
        Some(data) => Trainer::new(cfg, data, options)?, // the data the plan was made for
        None => Trainer::from_config(cfg, options)?,
    };
    // the predicted memory of this model and data, per layer (src/predict/).
    if let Some(e) = trainer.memory_estimate() {
        print!("{}", e.table());
        if let Some(rows) = trainer.what_if() {
            print!("{}", crate::predict::what_if_table(&rows));
        }
    }
    let resuming = resume.is_some();
    if let Some(ck) = resume {
        // Consumed: the loaded tensors are freed once they are in the model.
        resume_from(&mut trainer, ck)?;
    }
    print_start(&trainer, cmd.dry_run);
    if cmd.dry_run {
        return Ok(());
    }
    if resuming && trainer.position.global_step >= trainer.total_steps() {
        // The run's results are still (re)written below: a kill after the last step can have
        // left its evaluation or its summary undone.
        println!(
            "no steps left to train: the snapshot is at step {} of {}; pass a larger --epochs to continue training",
            trainer.position.global_step,
            trainer.total_steps()
        );
    }
    let mut summary = trainer.fit()?;
    // Results printed after the files are written, so that the printed RSS peak is summary.json's.
    let written = write_results(&trainer, &mut summary, cmd.summary_only);
    print_results(&trainer, &summary);
    written?;
    match cmd.summary_only {
        true => println!(
            "results in {} (summary.json only: {}=1)",
            trainer.run_dir().display(),
            crate::cli::SUMMARY_ONLY_ENV
        ),
        false => println!("results in {}", trainer.run_dir().display()),
    }
    if summary.status == crate::train::RunStatus::Interrupted {
        let dir = trainer.run_dir().display();
        return Err(Error::Interrupted(format!(
            "stopped after step {} of {}; snapshot and summary.json saved; continue with --resume {dir}",
            summary.progress.steps,
            trainer.total_steps()
        )));
    }
    Ok(())
}

/// What the trainer of `cmd` is asked to do beside training: progress, files, the out-of-memory
/// snapshot, the stop flag, and how it claims its run directory.
fn trainer_options(
    cmd: &TrainCommand,
    resuming: bool,
    stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
) -> TrainerOptions {
    TrainerOptions {
        progress: true,
        log_files: !cmd.dry_run && !cmd.summary_only,
        oom_report: !cmd.dry_run,
        stop,
        // One writer per run directory; a new run never replaces finished results unasked.
        claim: if resuming {
            Claim::Resume
        } else {
            Claim::New {
                overwrite: cmd.overwrite,
            }
        },
        ..Default::default()
    }
}

/// A run's command line resolved: the command, the configuration (a resumed run's from its
/// snapshot), the snapshot to resume and the flags given explicitly.
struct Setup {
    cmd: TrainCommand,
    cfg: crate::config::TrainConfig,
    resume: Option<Snapshot>,
    explicit: Vec<String>,
}

/// Parse `args` into a [`Setup`]; `None` after printing `--help`. Every usage error of the
/// command line is found here, before anything is loaded or written.
fn setup<I, T>(args: I) -> Result<Option<Setup>>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let mut args = match parse_train_args(args)? {
        Ok(a) => a,
        Err(help) => {
            print!("{help}");
            return Ok(None);
        }
    };
    // An environment switch with a value it does not know is refused, not ignored.
    use memtrain_kernels::gemm_bf16::{BF16_GEMM_ENV, BF16_GEMM_KERNELS};
    if let Some(v) = std::env::var_os(BF16_GEMM_ENV) {
        if !BF16_GEMM_KERNELS.iter().any(|k| v == *k) {
            return Err(Error::config(format!(
                "{BF16_GEMM_ENV}={} is not a bf16 kernel: use {}, or unset it",
                v.to_string_lossy(),
                BF16_GEMM_KERNELS.join(", ")
            )));
        }
    }
    // --resume: the newest complete snapshot's config.json is the base configuration, so only
    // flags given explicitly change it; conflicting ones are refused before anything is written.
    let resume = match args.resume.clone() {
        Some(dir) => {
            let ck = Snapshot::find_latest(&dir)?;
            if args.config_file.is_none() {
                args.config_file = Some(ck.config_path());
            }
            Some(ck)
        }
        None => None,
    };
    let out_given = args.explicit.iter().any(|f| f == "out");
    let explicit = args.explicit.clone();
    let cmd = TrainCommand::try_from(args)?;
    let mut cfg = match &resume {
        Some(ck) => ck.resume_config(&cmd.config, out_given)?,
        None => {
            // Checked again under the run directory's lock; here to fail before loading data.
            if let Some(out) = &cmd.config.output.out {
                check_new(out, cmd.overwrite)?;
            }
            cmd.config.clone()
        }
    };
    if let (Some(ck), Some(n)) = (&resume, cfg.output.memory_snapshot_step) {
        let done = ck.state.global_step;
        if n <= done {
            if explicit.iter().any(|e| e == "memory_snapshot_step") {
                return Err(Error::config(format!(
                    "--memory-snapshot-step {n} is a step this run has already trained (the snapshot is after step {done}); pick a later step or drop the flag (default: the run's last step)"
                )));
            }
            // The run's own setting, from its config: a step now past. The resumed run
            // traces its last step instead.
            println!("note: --memory-snapshot-step {n} of the run's config is already trained (the snapshot is after step {done}); this process records its last step in memory_snapshot.pickle");
            cfg.output.memory_snapshot_step = None;
        }
    }
    if !cmd.dry_run && cfg.output.out.is_none() {
        cfg.output.out = Some(default_run_dir());
    }
    if cfg.memory.memory_limit.is_some() && DeviceKind::for_spec(cfg.device.as_deref())?.is_cpu() {
        // Before the data loads: the limit counts the process's resident memory from the start.
        memtrain_core::memory::return_freed_memory();
    }
    // Before any planning or loading: a run this build cannot start.
    if let (Some(e), false) = (
        memtrain_core::device::cuda_not_built(cfg.device.as_deref()),
        cmd.dry_run,
    ) {
        return Err(e.into());
    }
    if resume.is_some() && cmd.plan.fit_memory.is_some() {
        return Err(Error::config(
            "--fit-memory cannot be combined with --resume (a run keeps its batch settings); start a new run",
        ));
    }
    Ok(Some(Setup {
        cmd,
        cfg,
        resume,
        explicit,
    }))
}

/// `--dry-run` of a CUDA run in a build without CUDA: the prediction, then what is missing.
fn print_cuda_estimate(cfg: &crate::config::TrainConfig, missing: &Error) -> Result<()> {
    let estimate = crate::predict::estimate(cfg, DeviceKind::Cuda)?;
    print!("{}", estimate.table());
    println!("dry run only: {missing}");
    Ok(())
}

/// What the run is about to do: its data, device, probe, steps and run directory (a dry run
/// makes none: it names the directory a run would write).
fn print_start(trainer: &Trainer, dry_run: bool) {
    println!("{}", trainer.data_description());
    let dir = trainer.run_dir().display();
    let dir = match dry_run {
        true => format!("dry run, nothing written (a run would write into {dir})"),
        false => format!("run dir {dir}"),
    };
    println!(
        "device {} | probe {}{} | {} steps/epoch, {} steps | {dir}",
        memtrain_core::device::device_name(trainer.device()),
        trainer.probe().name(),
        if trainer.probe().available() {
            ""
        } else {
            " (unavailable)"
        },
        trainer.steps_per_epoch(),
        trainer.total_steps(),
    );
    if let (Some(limit), Some(heap)) = (trainer.probe().os_limit(), trainer.probe().limit()) {
        println!(
            "memory limit {} of resident memory, as the kernel counts it: a heap budget of {}, \
             the rest for the binary, thread stacks and the allocator",
            format_bytes(limit),
            format_bytes(heap)
        );
    }
}

/// `--fit-memory BUDGET`: load the data, plan micro-batch, accumulation, checkpointing and
/// precision for it, print the plan, and return the chosen configuration with the data it was
/// planned for. Settings given explicitly (`explicit`) are kept, never silently replaced.
fn fit_memory(
    cfg: crate::config::TrainConfig,
    budget: u64,
    cmd: &TrainCommand,
    explicit: &[String],
    stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
) -> Result<(crate::config::TrainConfig, Option<crate::data::DataSplits>)> {
    let data = crate::data::load(&crate::data::DataOptions::for_config(&cfg, stop))?;
    let device = DeviceKind::for_spec(cfg.device.as_deref())?;
    let mut opts = PlanOptions::new(device, DataSize::loaded(&data.train, &data.test, &cfg));
    opts.effective_batch = cmd.plan.effective_batch;
    opts.allow_model_change = cmd.plan.allow_model_change;
    opts.fixed = crate::predict::plan::Fixed::from_explicit(&cfg, explicit);
    // On the CPU the budget is resident memory, as --memory-limit's: plan for the heap it leaves.
    let heap = crate::predict::heap_limit(Some(budget), device).unwrap_or(budget);
    if heap != budget {
        opts.resident_budget = Some(budget);
        println!(
            "--fit-memory {}: resident memory; the heap it leaves the run is {}",
            memtrain_core::memory::format_bytes(budget),
            memtrain_core::memory::format_bytes(heap)
        );
    }
    let report = plan(&cfg, heap, &opts)?;
    print!("{}", report.render(4));
    Ok((report.chosen().config.clone(), Some(data)))
}

/// Put the snapshot `ck` back into `trainer` (consuming it, so that nothing loaded outlives the
/// restore) and say so, with what it skipped and what changed.
fn resume_from(trainer: &mut Trainer, ck: Snapshot) -> Result<()> {
    for warning in &ck.skipped {
        eprintln!("warning: {warning}");
    }
    let threads = candle_core::utils::get_num_threads();
    if let Some(then) = ck.state.history.compute_threads.filter(|&n| n != threads) {
        eprintln!(
            "warning: the run trained with {then} compute thread{}, this process has {threads}: \
             a step's sums depend on their number, so the weights will differ in the last bits \
             from an uninterrupted run's; set RAYON_NUM_THREADS={then} to keep them identical",
            if then == 1 { "" } else { "s" }
        );
    }
    let resumed = format!(
        "resuming from {} (after step {}: epoch {}, batch {} next)",
        ck.dir.display(),
        ck.state.global_step,
        ck.state.epoch + 1,
        ck.state.next_batch + 1
    );
    let changes = ck.noted_changes(&trainer.config);
    trainer.resume(ck)?;
    println!("{resumed}");
    if !changes.is_empty() {
        println!("resuming with changed settings: {}", changes.join("; "));
    }
    Ok(())
}

/// The run's results on stdout: the memory report, predicted against measured, the headline
/// and, for `--prune`, the sparsity reached.
///
/// An accuracy over fewer than this many images says little (one image is a whole point).
const MEANINGFUL_EVAL_IMAGES: usize = 100;

/// What an accuracy measured on `n` images is worth, when that is little.
fn small_eval_caveat(n: usize) -> String {
    if n >= MEANINGFUL_EVAL_IMAGES {
        return String::new();
    }
    format!(
        " (on only {n} image{}, {:.0} points each: raise --val-fraction or add test_batch.bin for a figure that means something)",
        if n == 1 { "" } else { "s" },
        100.0 / n.max(1) as f64
    )
}

fn print_results(trainer: &Trainer, summary: &crate::train::Summary) {
    // The RSS peak at the run's end: summary.json's, read after its last file was written.
    let mut log = trainer.memory_log().clone();
    log.os_peak_bytes = summary.memory.os_peak_bytes;
    print!("{}", log.report());
    // predicted versus measured.
    if let (Some(p), Some(err)) = (
        summary.estimate.predicted_peak_bytes,
        summary.estimate.prediction_error_pct,
    ) {
        // The estimate is of a steady step, which starts with the optimizer state the first
        // step builds.
        let steady = match summary.progress.steps {
            0 | 1 => " (of a steady step, from the second on; this run took only the first, which starts without the optimizer state)",
            _ => "",
        };
        println!(
            "predicted step peak {} vs measured {}: error {err:+.1}%{steady}",
            format_bytes(p),
            format_bytes(summary.memory.step_peak_bytes)
        );
    }
    if let (Some(p), Some(m)) = (
        summary.estimate.predicted_eval_peak_bytes,
        summary.estimate.eval_peak_bytes,
    ) {
        println!(
            "predicted evaluation peak {} vs measured {}",
            format_bytes(p),
            format_bytes(m)
        );
    }
    // A peak outside training (phase "other") is not the configuration's: name the step peak.
    let training = match summary.memory.peak_phase.as_deref() {
        Some("other") => format!(
            "; training peak {}",
            format_bytes(summary.memory.step_peak_bytes)
        ),
        _ => String::new(),
    };
    println!(
        "peak {} ({}{training}) | {:.1} img/s | {} steps{}",
        format_bytes(summary.memory.peak_bytes),
        summary.memory.peak_phase.as_deref().unwrap_or("-"),
        summary.progress.images_per_sec,
        summary.progress.steps,
        summary
            .quality
            .final_test_accuracy
            .map(|a| format!(
                " | {} accuracy {:.2}%{}",
                if summary.quality.eval_is_validation {
                    "validation"
                } else {
                    "test"
                },
                a * 100.0,
                small_eval_caveat(summary.quality.eval_images)
            ))
            .unwrap_or_default()
    );
    // --prune: reached sparsity per layer, dense and sparse model file sizes.
    if let Some(p) = &summary.pruning {
        print!("{}", p.render());
    }
}

/// The run's result files: `summary.json` alone for a sweep child (`summary_only`), otherwise
/// the memory charts (the CSV and JSON files are written during the run).
fn write_results(
    trainer: &Trainer,
    summary: &mut crate::train::Summary,
    summary_only: bool,
) -> Result<()> {
    if summary_only {
        // Sweep children: summary.json only (no CSV files, snapshots or charts).
        crate::io::create_dir(trainer.run_dir())?;
        crate::io::write_json_atomic(
            &trainer.run_dir().join(crate::train::summary::SUMMARY_FILE),
            &summary,
        )?;
    } else {
        let title = format!("Memory per training step: {}", summary.label);
        let limit = summary.memory.memory_limit_bytes;
        // A chart that cannot be written (a full disk) fails the run like any other result file.
        crate::sweep::report::write_run_memory_chart(
            trainer.run_dir(),
            &title,
            Some(summary.memory.baseline_bytes),
            limit,
        )?;
        crate::sweep::step_chart::write_step_timeline_chart(
            trainer.run_dir(),
            &format!("Memory inside one training step: {}", summary.label),
        )?;
        // summary.json was written before the exports (the trainer's and these charts);
        // its resident peak covers the whole process, so it is read again after them.
        let os_peak = trainer.probe().os_memory().map(|o| o.peak);
        if os_peak > summary.memory.os_peak_bytes {
            summary.memory.os_peak_bytes = os_peak;
            crate::io::write_json_atomic(
                &trainer.run_dir().join(crate::train::summary::SUMMARY_FILE),
                &*summary,
            )?;
        }
    }
    Ok(())
}

/// When this process was started as a point of its own sweep or comparison
/// ([`crate::sweep::TRAINER_ROLE_ENV`]), run [`train`] with its command line and exit; otherwise
/// return. Sweep and comparison binaries call it first in `main` (and install the counting
/// allocator, which the trainer's CPU measurements need).
pub fn serve_as_trainer() {
    use crate::sweep::{trainer_role, TrainerRole, TRAINER_ROLE_ENV};
    match trainer_role() {
        TrainerRole::Point => {
            let args = std::env::args_os().skip(1);
            exit(train(std::iter::once("train_cifar10".into()).chain(args)))
        }
        TrainerRole::Stray(v) => eprintln!(
            "note: {TRAINER_ROLE_ENV}={v} is set in this environment, but no sweep started this \
             process, so it runs as itself; a sweep sets it for its own points only (unset it)"
        ),
        TrainerRole::None => {}
    }
}

/// End the process for the result of [`train`]: 0, or the error on stderr as one line and its
/// exit code ([`Error::exit_code`]).
pub fn exit(result: Result<()>) -> ! {
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(e.exit_code());
        }
    }
}
