//! [`ProgressCallback`]: indicatif bars (epoch and batch) on a terminal, plain lines otherwise.

use super::{BatchInfo, Callback, EpochBegin, EpochEnd, TrainBegin, TrainEnd};
use crate::error::Result;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use memtrain_core::memory::format_bytes;
use std::io::IsTerminal;
use std::time::Instant;

/// Shows training progress: loss, images per second and peak memory.
///
/// With a terminal on stdout it draws an epoch bar and a batch bar; with `--quiet` or when
/// stdout is not a terminal (logs, CI) it prints one plain line per epoch and a few per epoch
/// for long epochs.
pub struct ProgressCallback {
    bars: Option<(MultiProgress, ProgressBar, ProgressBar)>,
    plain_every: usize,
    epoch_start: Option<Instant>,
    images: usize,
    step_secs: f64,
    loss_sum: f64,
    steps: usize,
}

impl ProgressCallback {
    /// Bars when `quiet` is false and stdout is a terminal, plain lines otherwise.
    pub fn new(quiet: bool) -> Self {
        let bars = (!quiet && std::io::stdout().is_terminal()).then(|| {
            let mp = MultiProgress::with_draw_target(ProgressDrawTarget::stdout());
            let style = ProgressStyle::with_template("{prefix:>6} [{bar:30}] {pos}/{len} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
            let epoch = mp.add(
                ProgressBar::new(0)
                    .with_style(style.clone())
                    .with_prefix("epoch"),
            );
            let batch = mp.add(ProgressBar::new(0).with_style(style).with_prefix("step"));
            (mp, epoch, batch)
        });
        ProgressCallback {
            bars,
            plain_every: 0,
            epoch_start: None,
            images: 0,
            step_secs: 0.0,
            loss_sum: 0.0,
            steps: 0,
        }
    }

    fn print(&self, line: &str) {
        match &self.bars {
            Some((mp, _, _)) => {
                let _ = mp.println(line);
            }
            None => println!("{line}"),
        }
    }
}

impl Callback for ProgressCallback {
    fn on_train_begin(&mut self, ctx: &TrainBegin<'_>) -> Result<()> {
        if let Some((_, epoch, _)) = &self.bars {
            epoch.set_length(ctx.config.steps.epochs as u64);
        }
        // Plain mode: about four lines per epoch, so long CPU epochs still show signs of life.
        self.plain_every = (ctx.steps_per_epoch / 4).max(1);
        Ok(())
    }

    fn on_epoch_begin(&mut self, ctx: &EpochBegin<'_>) -> Result<()> {
        self.epoch_start = Some(Instant::now());
        self.images = 0;
        self.step_secs = 0.0;
        self.loss_sum = 0.0;
        self.steps = 0;
        if let Some((_, epoch, batch)) = &self.bars {
            epoch.set_position(ctx.epoch as u64);
            batch.reset();
            batch.set_length(ctx.steps as u64);
        }
        Ok(())
    }

    fn on_batch_end(&mut self, ctx: &BatchInfo<'_>) -> Result<()> {
        self.images += ctx.images;
        self.step_secs += ctx.step_secs.unwrap_or(0.0);
        self.loss_sum += ctx.loss.unwrap_or(0.0);
        self.steps += 1;
        // The run's recorded peak: the probe's own watermark is reset at every phase.
        let peak = ctx.memory.peak_bytes;
        let ips = self.images as f64 / self.step_secs.max(1e-9);
        let msg = format!(
            "loss {:.4} | {:.0} img/s | peak {}{}",
            self.loss_sum / self.steps as f64,
            ips,
            format_bytes(peak),
            if ctx.skipped {
                " | step skipped (overflow)"
            } else {
                ""
            }
        );
        match &self.bars {
            Some((_, _, batch)) => {
                batch.set_position((ctx.batch + 1) as u64);
                batch.set_message(msg);
            }
            None => {
                if (ctx.batch + 1).is_multiple_of(self.plain_every) {
                    println!("  epoch {} batch {}: {msg}", ctx.epoch + 1, ctx.batch + 1);
                }
            }
        }
        Ok(())
    }

    fn on_epoch_end(&mut self, ctx: &EpochEnd<'_>) -> Result<()> {
        let s = ctx.stats;
        let eval = match (s.eval_loss, s.eval_accuracy) {
            (Some(l), Some(a)) => format!(" | eval loss {l:.4} acc {:.2}%", a * 100.0),
            _ => String::new(),
        };
        let scale = match s.loss_scale {
            Some(sc) => format!(" | loss scale {sc} ({} skipped)", s.skipped_steps),
            None => String::new(),
        };
        self.print(&format!(
            "epoch {}/{}: train loss {:.4} acc {:.2}% | {:.1} img/s{eval}{scale}",
            s.epoch + 1,
            ctx.num_epochs,
            s.train_loss,
            s.train_accuracy * 100.0,
            s.images_per_sec
        ));
        if let Some((_, epoch, _)) = &self.bars {
            epoch.set_position((s.epoch + 1) as u64);
        }
        Ok(())
    }

    fn on_train_end(&mut self, _ctx: &TrainEnd<'_>) -> Result<()> {
        if let Some((mp, epoch, batch)) = &self.bars {
            batch.finish_and_clear();
            epoch.finish_and_clear();
            let _ = mp.clear();
        }
        Ok(())
    }
}
