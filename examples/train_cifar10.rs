//! Train the CIFAR-10 CNN with memory optimizations chosen by flags, and report measured memory.
//!
//! `cargo run --release --example train_cifar10 -- --help` lists every flag.

use memtrain::cli::{parse_train_args, TrainCommand};
use memtrain::config::ConvKind;
use memtrain::memory::{format_bytes, CountingAllocator};
use memtrain::model::cnn::param_count;
use memtrain::train::{Trainer, TrainerOptions};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

fn run() -> memtrain::Result<()> {
    let args = match parse_train_args(std::env::args_os())? {
        Ok(a) => a,
        Err(help) => {
            print!("{help}");
            return Ok(());
        }
    };
    let cmd = TrainCommand::try_from(args)?;
    let cfg = cmd.config.clone();
    println!(
        "memtrain: width {} ({} params standard, {} separable; using {}), {}",
        cfg.width,
        param_count(cfg.width, ConvKind::Standard),
        param_count(cfg.width, ConvKind::Separable),
        cfg.conv,
        cfg.label()
    );
    let options = TrainerOptions { progress: true, log_files: !cmd.dry_run, ..Default::default() };
    let mut trainer = Trainer::from_config(cfg, options)?;
    println!("{}", trainer.data_description());
    println!(
        "device {} | probe {}{} | {} steps/epoch, {} steps | run dir {}",
        memtrain::device::device_name(&trainer.device),
        trainer.probe().name(),
        if trainer.probe().available() { "" } else { " (unavailable)" },
        trainer.steps_per_epoch(),
        trainer.total_steps(),
        trainer.run_dir().display()
    );
    if cmd.dry_run {
        return Ok(());
    }
    let summary = trainer.fit()?;
    print!("{}", trainer.memory_log().report());
    println!(
        "peak {} ({}) | {:.1} img/s | {} steps{}",
        format_bytes(summary.peak_bytes),
        summary.peak_phase.as_deref().unwrap_or("-"),
        summary.images_per_sec,
        summary.steps,
        summary
            .final_test_accuracy
            .map(|a| format!(
                " | {} accuracy {:.2}%",
                if summary.eval_is_validation { "validation" } else { "test" },
                a * 100.0
            ))
            .unwrap_or_default()
    );
    println!("results in {}", trainer.run_dir().display());
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(e.exit_code());
    }
}
