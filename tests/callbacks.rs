//! Hooks are called in the documented order with the right epoch and batch indices.

mod common;

use memtrain::callbacks::{
    BatchInfo, Callback, EpochBegin, EpochEnd, LayerEnd, TrainBegin, TrainEnd,
};
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

/// Every event of a step, its layers' and its update's, reaches `on_layer_end` with the readings
/// the step timeline records (the last step's are compared), and so does every layer of an
/// evaluation batch.
#[test]
fn layer_events_reach_the_callbacks_as_the_timeline_records_them() {
    type Seen = (usize, usize, String, String, u64, u64);
    struct Layers(Arc<Mutex<Vec<Seen>>>);
    impl Callback for Layers {
        fn on_layer_end(&mut self, ctx: &LayerEnd<'_>) -> memtrain::Result<()> {
            self.0.lock().unwrap().push((
                ctx.batch,
                ctx.micro_batch,
                ctx.phase.to_string(),
                ctx.layer.to_string(),
                ctx.current_bytes,
                ctx.peak_bytes,
            ));
            Ok(())
        }
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut cfg = common::tiny_config();
    cfg.steps.max_steps = Some(2);
    cfg.steps.accum_steps = 2;
    cfg.data.synthetic_test = 16;
    cfg.output.eval = true;
    let mut t = common::trainer_with(
        cfg,
        TrainerOptions {
            callbacks: vec![Box::new(Layers(seen.clone()))],
            ..Default::default()
        },
    );
    t.fit().unwrap();
    let seen = seen.lock().unwrap().clone();
    let timeline = t.step_timeline();
    // Every event of the timeline, the update's (its last) included.
    let layers: Vec<_> = timeline.events.iter().collect();
    assert_eq!(layers.last().unwrap().phase.to_string(), "optimizer");
    let last_step: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.0 == timeline.global_step - 1 && s.2 != "eval")
        .collect();
    assert_eq!(last_step.len(), layers.len());
    for (s, e) in last_step.iter().zip(&layers) {
        assert_eq!(
            (s.1, s.2.as_str(), s.3.as_str(), s.4, s.5),
            (
                e.micro_batch,
                e.phase.to_string().as_str(),
                e.layer.as_str(),
                e.current_bytes,
                e.peak_bytes
            )
        );
    }
    // Both micro-batches of both steps, and the evaluation's layers.
    assert_eq!(
        seen.iter().filter(|s| s.2 != "eval").count(),
        2 * layers.len()
    );
    let eval: Vec<&Seen> = seen.iter().filter(|s| s.2 == "eval").collect();
    assert!(eval.iter().any(|s| s.3 == "head"), "{eval:?}");
}

/// An error from `on_layer_end` stops the step and is the error training returns.
#[test]
fn a_failing_layer_hook_stops_the_step_with_its_error() {
    struct Fails;
    impl Callback for Fails {
        fn on_layer_end(&mut self, ctx: &LayerEnd<'_>) -> memtrain::Result<()> {
            if ctx.layer == "head" && ctx.phase.to_string() == "backward" {
                return Err(memtrain::Error::Snapshot(
                    "stop at the head's backward".into(),
                ));
            }
            Ok(())
        }
    }
    let mut t = common::trainer_with(
        common::tiny_config(),
        TrainerOptions {
            callbacks: vec![Box::new(Fails)],
            ..Default::default()
        },
    );
    let err = t.fit().unwrap_err();
    assert_eq!(err.to_string(), "snapshot: stop at the head's backward");
}

/// A callback's own I/O error goes through `?` and is the error training returns.
#[test]
fn a_callback_can_return_an_io_error_with_the_question_mark() {
    struct Writes;
    impl Callback for Writes {
        fn on_batch_end(&mut self, _: &BatchInfo<'_>) -> memtrain::Result<()> {
            Err(std::io::Error::other("disk full"))?;
            Ok(())
        }
    }
    let mut t = common::trainer_with(
        common::tiny_config(),
        TrainerOptions {
            callbacks: vec![Box::new(Writes)],
            ..Default::default()
        },
    );
    assert_eq!(t.fit().unwrap_err().to_string(), "I/O: disk full");
}
