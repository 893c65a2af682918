//! The run's history: what the summary, the epoch table and the memory log need from the steps
//! already taken, so that a resumed run reports the whole run, not only the part after the
//! snapshot.
//!
//! Every snapshot stores it (`history.json`, hashed like the other files), beside the memory
//! log of the steps and ended epochs (`memory.json`). A run interrupted
//! inside an epoch, or after the epoch's last step but before its evaluation, keeps the epoch's
//! running sums in [`RunHistory::progress`]; the resumed run adds its steps to them and then
//! evaluates, so the epoch's row equals that of an uninterrupted run in everything but timings.
//! Floats travel through JSON exactly (serde_json's `float_roundtrip`), so the sums do too.

use crate::callbacks::EpochStats;
use serde::{Deserialize, Serialize};

/// Outcome of one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepResult {
    /// Mean loss over the micro-batches.
    pub loss: f64,
    /// Correct predictions.
    pub correct: usize,
    /// Images in the step.
    pub images: usize,
    /// True when the loss scaler skipped the update.
    pub skipped: bool,
    /// Learning rate used.
    pub lr: f64,
}

/// Running sums of the epoch in progress.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EpochProgress {
    /// Epoch index.
    pub epoch: usize,
    /// Optimizer steps trained in this epoch so far.
    pub steps: usize,
    /// Training images in those steps.
    pub images: usize,
    /// Sum of the steps' mean losses.
    pub loss_sum: f64,
    /// Correct training predictions.
    pub correct: usize,
    /// Steps the loss scaler skipped.
    pub skipped: usize,
    /// Seconds of the training steps.
    pub train_secs: f64,
    /// Learning rate of the newest step.
    pub lr: f64,
}

impl EpochProgress {
    /// A fresh epoch; `lr` is reported if the epoch ends before its first step.
    pub fn new(epoch: usize, lr: f64) -> Self {
        EpochProgress {
            epoch,
            lr,
            ..Default::default()
        }
    }

    /// Add one optimizer step.
    pub fn add(&mut self, r: &StepResult) {
        self.steps += 1;
        self.images += r.images;
        self.loss_sum += r.loss;
        self.correct += r.correct;
        self.skipped += r.skipped as usize;
        self.lr = r.lr;
    }

    /// The epoch's row, with the evaluation `(loss, accuracy)` when there was one.
    pub fn stats(&self, eval: Option<(f64, f64)>, loss_scale: Option<f64>) -> EpochStats {
        EpochStats {
            epoch: self.epoch,
            steps: self.steps,
            images: self.images,
            train_loss: self.loss_sum / self.steps.max(1) as f64,
            train_accuracy: self.correct as f64 / self.images.max(1) as f64,
            eval_loss: eval.map(|e| e.0),
            eval_accuracy: eval.map(|e| e.1),
            images_per_sec: self.images as f64 / self.train_secs.max(1e-9),
            train_secs: self.train_secs,
            loss_scale,
            skipped_steps: self.skipped,
            lr: self.lr,
        }
    }
}

/// Everything a resumed run carries over from the processes before it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RunHistory {
    /// Epochs whose end (evaluation included) is done, in order.
    pub epochs: Vec<EpochStats>,
    /// The epoch begun but not ended (its evaluation not done), if any.
    pub progress: Option<EpochProgress>,
    /// Training images of the whole run so far.
    pub images: usize,
    /// Seconds of training steps of the whole run so far.
    pub train_secs: f64,
    /// Images and seconds of the steps, for the steady-state throughput.
    pub step_times: StepTimes,
    /// How the blocks' conv outputs were kept, step by step: `--compress-activations` may change
    /// on `--resume`, and one lossy step makes the run lossy. Empty in snapshots written before
    /// this was recorded.
    #[serde(default)]
    pub activation_storage: Vec<crate::config::StorageSpan>,
    /// Compute threads of the process that saved the snapshot: a step's sums depend on their
    /// number (`None` in snapshots written before this was recorded).
    #[serde(default)]
    pub compute_threads: Option<usize>,
}

impl RunHistory {
    /// Step `step` (from 1) trained with `storage`.
    pub fn note_storage(&mut self, step: usize, storage: crate::config::ActivationStorage) {
        match self.activation_storage.last_mut() {
            Some(s) if s.compress_activations == storage && s.last_step + 1 == step => {
                s.last_step = step;
            }
            _ => self.activation_storage.push(crate::config::StorageSpan {
                first_step: step,
                last_step: step,
                compress_activations: storage,
            }),
        }
    }

    /// The steps that kept their conv outputs lossily, by codes, as `int2-activations in steps
    /// 1–4, 9; int8-activations in steps 5–8` (empty when none did).
    pub fn lossy_steps(&self) -> String {
        let mut by_codes: Vec<(crate::config::ActivationStorage, Vec<String>)> = Vec::new();
        for s in &self.activation_storage {
            let steps = match s.first_step == s.last_step {
                true => s.first_step.to_string(),
                false => format!("{}–{}", s.first_step, s.last_step),
            };
            match by_codes
                .iter_mut()
                .find(|(c, _)| *c == s.compress_activations)
            {
                Some((_, spans)) => spans.push(steps),
                None => by_codes.push((s.compress_activations, vec![steps])),
            }
        }
        by_codes
            .iter()
            .filter(|(c, _)| c.is_lossy())
            .map(|(c, spans)| format!("{c}-activations in steps {}", spans.join(", ")))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// Steps kept one by one: enough to skip any warm-up [`StepTimes::steady`] can ask for.
const WARMUP_WINDOW: usize = 12;

/// Images and seconds of a run's steps, in constant space: the first [`WARMUP_WINDOW`] one by one
/// (the warm-up to skip depends on how many steps there are), the rest as sums.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StepTimes {
    /// (images, seconds) of the first steps.
    pub head: Vec<(usize, f64)>,
    /// Steps after them.
    pub tail_steps: usize,
    /// Their images.
    pub tail_images: usize,
    /// Their seconds.
    pub tail_secs: f64,
}

impl StepTimes {
    /// Count one step.
    pub fn push(&mut self, images: usize, secs: f64) {
        if self.head.len() < WARMUP_WINDOW {
            self.head.push((images, secs));
        } else {
            self.tail_steps += 1;
            self.tail_images += images;
            self.tail_secs += secs;
        }
    }

    /// Images per second of step time after skipping the warm-up steps (the first 3, or a
    /// quarter of the steps when there are fewer than 12). `None` with fewer than 2 steps.
    pub fn steady(&self) -> Option<f64> {
        let steps = self.head.len() + self.tail_steps;
        if steps < 2 {
            return None;
        }
        let skip = 3.min(steps / 4).max(1);
        let (images, secs) = self.head[skip..]
            .iter()
            .fold((self.tail_images, self.tail_secs), |(i, s), (n, t)| {
                (i + n, s + t)
            });
        Some(images as f64 / secs.max(1e-9))
    }
}

impl<'de> Deserialize<'de> for StepTimes {
    /// Also reads the list of every step's (images, seconds) that snapshots held before.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Sums {
            head: Vec<(usize, f64)>,
            tail_steps: usize,
            tail_images: usize,
            tail_secs: f64,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Stored {
            Sums(Sums),
            EveryStep(Vec<(usize, f64)>),
        }
        Ok(match Stored::deserialize(d)? {
            Stored::Sums(s) => StepTimes {
                head: s.head,
                tail_steps: s.tail_steps,
                tail_images: s.tail_images,
                tail_secs: s.tail_secs,
            },
            Stored::EveryStep(steps) => {
                let mut t = StepTimes::default();
                for (images, secs) in steps {
                    t.push(images, secs);
                }
                t
            }
        })
    }
}
