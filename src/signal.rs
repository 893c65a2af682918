//! Ctrl-C (SIGINT) and SIGTERM as a request to stop training cleanly.
//!
//! The first signal only sets a flag. The data loader checks it between files and chunks (then
//! nothing has been written), the trainer after every optimizer step, between evaluation batches
//! and after every snapshot write, so the step in flight finishes, a training snapshot and
//! `summary.json` (status "interrupted") are written, and the program exits with
//! [`INTERRUPTED_EXIT_CODE`]. A second signal exits at once with the
//! same code: whatever snapshot is on disk then is still complete, because snapshots are
//! written to a temporary directory and renamed into place.

use crate::error::{CoreError, Error, Result};
use signal_hook::consts::{SIGINT, SIGTERM};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Exit code of a run stopped by a signal: 128 + SIGINT, what shells report for Ctrl-C.
pub(crate) const INTERRUPTED_EXIT_CODE: i32 = 130;

/// Let a closed stdout end the process as it ends a C program (`train_cifar10 --dry-run | head`):
/// Rust ignores SIGPIPE, so `println!` would panic on the broken pipe instead. Results on disk are
/// written atomically, so a run ended this way leaves none half-written. Call it first in `main`.
pub fn default_sigpipe() {
    // SAFETY: restoring a signal's default disposition has no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Install handlers for SIGINT and SIGTERM and return the flag they set, to be passed as
/// [`TrainerOptions::stop`](crate::train::TrainerOptions::stop).
///
/// The first signal sets the flag and prints one notice on stderr; a second one ends the process
/// immediately with [`INTERRUPTED_EXIT_CODE`]. Call it once per process.
pub fn install_stop_handler() -> Result<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    let failed = |e: std::io::Error| {
        Error::Core(CoreError::Device(format!(
            "cannot install the Ctrl-C handler: {e}"
        )))
    };
    for sig in [SIGINT, SIGTERM] {
        // Registered before the flag setter, so it sees the flag as the *previous* signal left
        // it: the first signal passes through, the second exits. Both run inside the handler,
        // which keeps the second Ctrl-C working even while the main thread is busy.
        signal_hook::flag::register_conditional_shutdown(
            sig,
            INTERRUPTED_EXIT_CODE,
            Arc::clone(&flag),
        )
        .map_err(failed)?;
        signal_hook::flag::register(sig, Arc::clone(&flag)).map_err(failed)?;
    }
    // The notice cannot be printed from inside a signal handler, so a thread waits for the
    // signals and prints it. It is only a courtesy: without it stopping works the same.
    if let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM]) {
        let seen = Arc::clone(&flag);
        let _ = std::thread::Builder::new().name("memtrain-signals".into()).spawn(move || {
            if let Some(sig) = signals.forever().next() {
                let name = if sig == SIGINT { "Ctrl-C" } else { "SIGTERM" };
                if seen.load(Ordering::SeqCst) {
                    eprintln!(
                        "{name}: stopping at the next safe point (after the current step, evaluation batch or data file; the final message says what was saved); press Ctrl-C again to quit at once"
                    );
                }
            }
        });
    }
    Ok(flag)
}
