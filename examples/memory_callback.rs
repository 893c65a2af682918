//! Your own memory callback: train with the library and watch memory from a [`Callback`].
//!
//! After every optimizer step it prints the step's peak (and the phase it fell in) and the bytes
//! in use now; after every epoch, the epoch's peak and its mean step peak, with a warning when an
//! epoch peaks more than 1% above the one before (a leak, or a batch that grew). The trainer reads the
//! memory probe itself and hands every hook the records so far ([`MemoryLog`]), so a callback
//! only reads: the step or epoch that just ended is the last record.
//!
//! `cargo run --release --example memory_callback` (synthetic data, a few seconds).
//!
//! [`MemoryLog`]: memtrain_core::memory::MemoryLog

use std::io::Write;

use memtrain::callbacks::{BatchInfo, Callback, EpochEnd};
use memtrain::config::TrainConfig;
use memtrain::error::Result;
use memtrain::train::{Trainer, TrainerOptions};
use memtrain_core::memory::{format_bytes, CountingAllocator};

// The CPU probe is this counting allocator: without it the heap cannot be measured.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// Prints each step's and each epoch's memory; warns when an epoch peaks over 1% above the one
/// before.
#[derive(Default)]
struct MemoryWatch {
    last_epoch_peak: Option<u64>,
}

impl Callback for MemoryWatch {
    fn on_batch_end(&mut self, ctx: &BatchInfo<'_>) -> Result<()> {
        if let Some(step) = &ctx.memory.last_batch {
            // The records count from 1 (as the screen does), the contexts from 0. An I/O error
            // (a closed pipe, say) ends the run through `?`, as the library's own errors do.
            writeln!(
                std::io::stdout(),
                "epoch {} step {}: peak {} ({}), in use now {}",
                step.epoch,
                step.batch,
                format_bytes(step.peak_bytes),
                step.peak_phase,
                format_bytes(ctx.probe.current())
            )?;
        }
        Ok(())
    }

    fn on_epoch_end(&mut self, ctx: &EpochEnd<'_>) -> Result<()> {
        let Some(epoch) = ctx.memory.epochs.last() else {
            return Ok(());
        };
        println!(
            "epoch {} peak {} ({}), mean step peak {}",
            ctx.stats.epoch + 1,
            format_bytes(epoch.peak_bytes),
            epoch.peak_phase,
            format_bytes(epoch.mean_step_peak_bytes)
        );
        let grown = |before: &u64| epoch.peak_bytes > before + before / 100;
        if let Some(before) = self.last_epoch_peak.filter(grown) {
            println!(
                "warning: epoch {} peaked {} above the epoch before",
                ctx.stats.epoch + 1,
                format_bytes(epoch.peak_bytes - before)
            );
        }
        self.last_epoch_peak = Some(epoch.peak_bytes);
        Ok(())
    }
}

fn main() -> anyhow::Result<()> {
    let mut config = TrainConfig::default();
    config.steps.epochs = 2;
    config.model.width = 8;
    config.steps.batch_size = 64;
    config.data.synthetic_train = 256;
    config.data.synthetic_test = 64;
    config.device = Some("cpu".into());
    config.output.quiet = true;
    let options = TrainerOptions {
        callbacks: vec![Box::new(MemoryWatch::default())],
        ..TrainerOptions::default()
    };
    let mut trainer = Trainer::from_config(config, options)?;
    let summary = trainer.fit()?;
    println!(
        "training peak {} over {} steps",
        format_bytes(summary.memory.step_peak_bytes),
        summary.progress.steps
    );
    Ok(())
}
