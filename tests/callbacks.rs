//! Hooks are called in the documented order with the right epoch and batch indices.

mod common;

use memtrain::callbacks::{BatchInfo, Callback, EpochBegin, EpochEnd, TrainBegin, TrainEnd};
use memtrain::train::TrainerOptions;
use std::sync::{Arc, Mutex};

struct Recorder(Arc<Mutex<Vec<String>>>);

impl Recorder {
    fn push(&self, s: String) {
        self.0.lock().unwrap().push(s);
    }
}

impl Callback for Recorder {
    fn on_train_begin(&mut self, ctx: &TrainBegin<'_>) -> memtrain::Result<()> {
        self.push(format!("train_begin steps={}", ctx.total_steps));
        Ok(())
    }
    fn on_epoch_begin(&mut self, ctx: &EpochBegin<'_>) -> memtrain::Result<()> {
        self.push(format!("epoch_begin {}", ctx.epoch));
        Ok(())
    }
    fn on_batch_begin(&mut self, ctx: &BatchInfo<'_>) -> memtrain::Result<()> {
        self.push(format!(
            "batch_begin {}.{} g{}",
            ctx.epoch, ctx.batch, ctx.global_step
        ));
        Ok(())
    }
    fn on_after_forward(&mut self, ctx: &BatchInfo<'_>) -> memtrain::Result<()> {
        self.push(format!(
            "forward {}.{} m{}",
            ctx.epoch, ctx.batch, ctx.micro_batch
        ));
        Ok(())
    }
    fn on_after_backward(&mut self, ctx: &BatchInfo<'_>) -> memtrain::Result<()> {
        self.push(format!(
            "backward {}.{} m{}",
            ctx.epoch, ctx.batch, ctx.micro_batch
        ));
        Ok(())
    }
    fn on_batch_end(&mut self, ctx: &BatchInfo<'_>) -> memtrain::Result<()> {
        assert!(ctx.loss.is_some_and(f64::is_finite));
        self.push(format!(
            "batch_end {}.{} images={}",
            ctx.epoch, ctx.batch, ctx.images
        ));
        Ok(())
    }
    fn on_epoch_end(&mut self, ctx: &EpochEnd<'_>) -> memtrain::Result<()> {
        self.push(format!(
            "epoch_end {} steps={}",
            ctx.stats.epoch, ctx.stats.steps
        ));
        Ok(())
    }
    fn on_train_end(&mut self, ctx: &TrainEnd<'_>) -> memtrain::Result<()> {
        self.push(format!("train_end g{}", ctx.global_step));
        Ok(())
    }
}

#[test]
fn hooks_run_in_documented_order() {
    let events = Arc::new(Mutex::new(Vec::new()));
    let mut cfg = common::tiny_config();
    cfg.steps.epochs = 2;
    cfg.steps.max_steps = None;
    cfg.data.synthetic_train = 32; // 2 steps of 16 per epoch
    cfg.steps.accum_steps = 2;
    let mut t = common::trainer_with(
        cfg,
        TrainerOptions {
            callbacks: vec![Box::new(Recorder(events.clone()))],
            ..Default::default()
        },
    );
    t.fit().unwrap();
    let got = events.lock().unwrap().clone();
    let mut want = vec!["train_begin steps=4".to_string()];
    let mut g = 0;
    for e in 0..2 {
        want.push(format!("epoch_begin {e}"));
        for b in 0..2 {
            want.push(format!("batch_begin {e}.{b} g{g}"));
            for m in 0..2 {
                want.push(format!("forward {e}.{b} m{m}"));
                want.push(format!("backward {e}.{b} m{m}"));
            }
            want.push(format!("batch_end {e}.{b} images=16"));
            g += 1;
        }
        want.push(format!("epoch_end {e} steps=2"));
    }
    want.push("train_end g4".to_string());
    assert_eq!(got, want);
}

#[test]
fn a_failing_callback_stops_training_with_its_error() {
    struct Fails;
    impl Callback for Fails {
        fn on_batch_end(&mut self, ctx: &BatchInfo<'_>) -> memtrain::Result<()> {
            if ctx.global_step == 1 {
                return Err(memtrain::Error::config("stop here"));
            }
            Ok(())
        }
    }
    let mut cfg = common::tiny_config();
    cfg.steps.max_steps = Some(4);
    cfg.data.synthetic_train = 64;
    let mut t = common::trainer_with(
        cfg,
        TrainerOptions {
            callbacks: vec![Box::new(Fails)],
            ..Default::default()
        },
    );
    let err = t.fit().unwrap_err();
    assert_eq!(err.to_string(), "stop here");
}
