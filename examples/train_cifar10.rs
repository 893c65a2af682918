//! Train the CIFAR-10 CNN with memory optimizations chosen by flags, and report measured memory.
//! The application is [`memtrain::app::train`]; this binary adds the counting allocator that
//! makes the CPU heap measurable.
//!
//! `cargo run --release --example train_cifar10 -- --help` lists every flag.

use memtrain_core::memory::CountingAllocator;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

fn main() {
    memtrain::signal::default_sigpipe();
    memtrain::app::exit(memtrain::app::train(std::env::args_os()))
}
