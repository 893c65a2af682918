//! memtrain's records in the formats of the viewers people already use: TensorBoard's event
//! files ([`tensorboard`], written by [`crate::callbacks::TensorBoardLogger`]), PyTorch's memory
//! snapshot for pytorch.org/memory_viz ([`memviz`]) and the Trace Event Format for Perfetto and
//! chrome://tracing ([`perfetto`]). How to open each: docs/viewers.md.

pub mod memviz;
pub mod perfetto;
pub mod tensorboard;
