//! Memory before it is used: the analytic estimate of a run ([`mod@estimate`]: runs the step's own
//! tape on sizes, `sizing.rs`, each op's scratch from `scratch.rs`, the bytes in use in
//! `sim.rs`, the events and host records in `events.rs`, its printout in `printout.rs`), the planner that picks a
//! configuration for a budget ([`plan`]) and the error margin every plan keeps ([`margin`]),
//! gradient checkpointing's segmentations and `--checkpoint auto`'s choice ([`checkpointing`];
//! for a run, `choose.rs`), what a measurement holds besides the
//! step (`baseline.rs`: [`DataSize`], [`Baseline`]), what each optimization would save
//! ([`what_if()`]), and the check that sizes every input against the budgets before anything is
//! loaded or built ([`bounds`]).

mod baseline;
pub mod bounds;
pub mod checkpointing;
mod choose;
pub mod estimate;
mod events;
pub mod margin;
pub mod plan;
mod printout;
mod scratch;
mod sim;
mod sizing;
pub mod what_if;

pub(crate) use baseline::RUNTIME_OVERHEAD_BYTES;
pub use choose::*;
pub use estimate::*;
pub use events::EventPrediction;
pub use margin::{heap_limit, limit_for_heap};
pub use sizing::{tensor_descriptor_bytes, Strides, HOST_BOOKKEEPING_BYTES, STORAGE_RECORD_BYTES};
pub use what_if::{what_if, what_if_table, WhatIf};
