//! `examples/memory_callback.rs`, the README's example of a user's own callback, runs and prints
//! the peak of every step and every epoch it trained.

mod common;

use std::process::Command;

#[test]
fn the_memory_callback_example_prints_every_step_and_epoch_peak() {
    let out = Command::new(common::example_binary("memory_callback"))
        .output()
        .expect("run the example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 256 images in batches of 64: 4 steps in each of 2 epochs.
    for epoch in 1..=2 {
        for step in 1..=4 {
            let line = format!("epoch {epoch} step {step}: peak ");
            assert!(stdout.contains(&line), "no `{line}` in:\n{stdout}");
        }
        let line = format!("epoch {epoch} peak ");
        assert!(stdout.contains(&line), "no `{line}` in:\n{stdout}");
    }
    assert!(stdout.contains("training peak "), "{stdout}");
}
