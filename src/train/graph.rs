//! `--cuda-graph`: the forward and backward of a training step captured once as a CUDA graph and
//! replayed, so that a step costs one graph launch instead of one launch per kernel.
//!
//! At batch 128 this network is launch-bound on an H100: its kernels are short and there are
//! hundreds of them per step. A graph replays all of them from one host call. What makes the
//! lean step ([`memtrain_core::step::tape`]) capturable:
//!
//! - **Allocation-stable.** Every step allocates the same buffers in the same order. Allocations
//!   made while capturing become the graph's own (stream-ordered allocations are capturable); a
//!   graph allocation keeps its virtual address from launch to launch, so the tensors the capture
//!   returned (the loss, the correct count, the gradients) hold the replay's results after every
//!   launch. The graph is instantiated with `AUTO_FREE_ON_LAUNCH`: the outputs are still
//!   allocated when the next launch begins, and this frees them in the launch, at the same
//!   addresses.
//! - **Nothing waits for the device.** The step reads nothing back while it runs
//!   ([`memtrain_core::step::tape::LeanStep::forward`] leaves the loss on the device); the batch is copied
//!   into two static input tensors *before* the launch; BatchNorm running statistics are written
//!   into their tensors in place ([`memtrain_core::step::tape::LeanStep::with_stats_in_place`]), since the graph
//!   keeps using the addresses it saw; parameters are read from the `Var`s, which the optimizer
//!   updates in place. The few small host-to-device uploads inside Candle ops (the class indices of
//!   the loss, strides of non-contiguous operands) are served by Candle's graph upload cache,
//!   filled during the eager warm-up step.
//! - **Warm-up first.** The first step runs the same code eagerly: kernels are compiled and loaded,
//!   cuDNN plans and workspace are made, the upload cache is filled. The second step is captured
//!   and launched; later steps only launch. A change of the f16 loss scale (a constant inside the
//!   captured kernels) captures again.
//!
//! What stays eager: the optimizer phase (unscaling, the gradient norm, clipping and the update),
//! because the learning rate changes every step and the clipping decision is taken on the host.
//! The gradients the graph wrote are copied out before the optimizer sees them: the next launch
//! rewrites that memory, and the optimizer may keep a gradient as its momentum buffer.
//!
//! Memory: a captured step's allocations come from CUDA's graph memory, not from the device's
//! memory pool, so the pool probe does not see them; [`GraphStats`] records the graph memory's
//! high-water marks beside the pool's (and `--memory-limit` is refused with `--cuda-graph`).
//! The layer events of the step timeline are not recorded for a replayed step (there are no
//! host-side events inside one launch).
//!
//! `tests/gpu_graph.rs` checks on a GPU that captured steps equal eager ones; it passed on an H200
//! on 2026-11-27, where the captured step ran 13–168% faster than the eager one
//! (`docs/results/gpu-2026-11-27.md`).

use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::error::Result;

/// What a `--cuda-graph` run captured and replayed (in `summary.json` as `cuda_graph`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GraphStats {
    /// Graphs captured: one, plus one for each change of the f16 loss scale.
    pub captures: usize,
    /// Steps run as a launch of a captured graph.
    pub replays: usize,
    /// Nodes of the newest graph: everything the captured forward and backward enqueue.
    pub nodes: usize,
    /// Kernel launches among them: the kernel count of one step's forward and backward (the
    /// same kernels an eager step launches; the eager optimizer phase is not included).
    pub kernel_nodes: usize,
    /// Memory copies among them.
    pub memcpy_nodes: usize,
    /// Memory sets (zero fills) among them.
    pub memset_nodes: usize,
    /// Captured allocations (graph memory).
    pub alloc_nodes: usize,
    /// Captured frees.
    pub free_nodes: usize,
    /// Nodes of any other kind.
    pub other_nodes: usize,
    /// Highest graph memory in use (`CU_GRAPH_MEM_ATTR_USED_MEM_HIGH`): the captured step's
    /// allocations, which the memory pool probe does not count.
    pub graph_mem_used_high_bytes: u64,
    /// Highest graph memory reserved from the driver (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH`).
    pub graph_mem_reserved_high_bytes: u64,
}

impl GraphStats {
    /// Counts the nodes of a graph from their `CUgraphNodeType` codes (kernel 0, memcpy 1,
    /// memset 2, mem-alloc 10, mem-free 11, as numbered by the CUDA driver API).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by the CUDA capture
    pub(crate) fn count_nodes(&mut self, codes: impl IntoIterator<Item = u32>) {
        let (mut n, mut kernel, mut memcpy, mut memset, mut alloc, mut free, mut other) =
            (0, 0, 0, 0, 0, 0, 0);
        for code in codes {
            n += 1;
            match code {
                0 => kernel += 1,
                1 => memcpy += 1,
                2 => memset += 1,
                10 => alloc += 1,
                11 => free += 1,
                _ => other += 1,
            }
        }
        self.nodes = n;
        self.kernel_nodes = kernel;
        self.memcpy_nodes = memcpy;
        self.memset_nodes = memset;
        self.alloc_nodes = alloc;
        self.free_nodes = free;
        self.other_nodes = other;
    }
}

/// The forward and backward of one batch: mean loss, correct predictions and the f32 gradients
/// (aligned with the trainer's variables), as the trainer's eager step returns them.
pub(crate) type BatchGrads = (f64, usize, Vec<Option<candle_core::Tensor>>);

/// What the next step of a `--cuda-graph` run does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by the CUDA capture
pub(crate) enum GraphAction {
    /// Run the step's code eagerly (the warm-up: loads kernels, fills caches).
    Eager,
    /// Capture the step into a new graph, then launch it.
    Capture,
    /// Launch the graph captured before.
    Replay,
}

/// The next action given whether the warm-up step has run, the key (loss multiplier's bits)
/// of the graph captured so far, and this step's key.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by the CUDA capture
pub(crate) fn next_action(warm: bool, captured: Option<u64>, key: u64) -> GraphAction {
    match (warm, captured) {
        (false, _) => GraphAction::Eager,
        (true, Some(k)) if k == key => GraphAction::Replay,
        (true, _) => GraphAction::Capture,
    }
}

/// The `--cuda-graph` state of a trainer: nothing unless the run captures its step.
#[derive(Default)]
pub(crate) struct GraphSlot {
    #[cfg(feature = "cuda")]
    step: std::cell::RefCell<Option<cuda::CapturedStep>>,
}

impl GraphSlot {
    /// The slot for a run of `config` on `device`: a captured step when `--cuda-graph` is on.
    ///
    /// # Errors
    /// `--cuda-graph` without a CUDA device (an automatic device that turned out to be the CPU,
    /// or a build without CUDA), or when the static input buffers cannot be allocated.
    pub fn for_run(config: &TrainConfig, device: &candle_core::Device) -> Result<Self> {
        if !config.cuda.cuda_graph {
            return Ok(GraphSlot::default());
        }
        if !device.is_cuda() {
            return Err(crate::Error::config(
                "--cuda-graph needs a CUDA device, and the run would train on the CPU (no GPU answered, or this build has no CUDA); run on a GPU machine with --device cuda or drop --cuda-graph",
            ));
        }
        #[cfg(feature = "cuda")]
        {
            Ok(GraphSlot {
                step: std::cell::RefCell::new(Some(cuda::CapturedStep::new(
                    device,
                    config.steps.batch_size,
                )?)),
            })
        }
        #[cfg(not(feature = "cuda"))]
        unreachable!("a CUDA device in a build without CUDA")
    }

    /// Runs the forward and backward of one batch through the captured step when the run has
    /// one: `Some((mean loss, correct, f32 gradients))`; `None` when the caller runs it eagerly.
    /// Both phases of every micro-batch are one launch, so the caller's phase hooks follow it.
    #[allow(unused_variables)]
    pub(crate) fn grads(
        &self,
        t: &super::Trainer,
        images: &[f32],
        labels: &[u32],
        loss_scale: f64,
    ) -> Option<Result<BatchGrads>> {
        #[cfg(feature = "cuda")]
        {
            let mut step = self.step.borrow_mut();
            step.as_mut().map(|s| s.run(t, images, labels, loss_scale))
        }
        #[cfg(not(feature = "cuda"))]
        None
    }

    /// What the run captured and replayed, when it captures its step.
    pub fn stats(&self) -> Option<GraphStats> {
        #[cfg(feature = "cuda")]
        {
            self.step.borrow().as_ref().map(|s| s.stats.clone())
        }
        #[cfg(not(feature = "cuda"))]
        None
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::cuda_backend::cudarc::driver::CudaGraph;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{DType, Device, Tensor};

    use super::{next_action, BatchGrads, GraphAction, GraphStats};
    use crate::data::IMAGE_BYTES;
    use crate::error::{Error, Result};
    use crate::train::Trainer;
    use memtrain_core::step::accumulate::GradAccumulator;
    use memtrain_core::step::tape::{LeanStep, NoObserver};
    use memtrain_core::step::BatchInput;

    /// What the captured body returns: device tensors that a replay rewrites in place.
    struct Outputs {
        losses: Vec<Tensor>,
        corrects: Vec<Tensor>,
        grads: Vec<Option<Tensor>>,
    }

    /// The captured forward and backward of a run, its inputs and its outputs.
    ///
    /// Field order is drop order: the outputs (graph allocations, freed outside the graph, which
    /// CUDA allows) go before the graph that owns their memory.
    pub(super) struct CapturedStep {
        outputs: Option<Outputs>,
        graph: Option<CudaGraph>,
        /// The loss multiplier (bits) the graph was captured with.
        key: Option<u64>,
        /// Whether the eager warm-up step has run.
        warm: bool,
        /// The batch's images [N, 3, 32, 32] f32 and labels [N] u32, at fixed addresses.
        x: Tensor,
        y: Tensor,
        device: Device,
        pub(super) stats: GraphStats,
    }

    impl CapturedStep {
        pub(super) fn new(device: &Device, batch: usize) -> Result<Self> {
            let cuda = device.as_cuda_device()?;
            // SAFETY: everything the trainer does on the device runs on Candle's one stream of
            // this thread, so cudarc's cross-stream event tracking has nothing to order; it is
            // turned off because a captured stream must not wait on events recorded outside the
            // capture.
            unsafe { cuda.disable_event_tracking() };
            Ok(CapturedStep {
                outputs: None,
                graph: None,
                key: None,
                warm: false,
                x: Tensor::zeros((batch, 3, 32, 32), DType::F32, device)?,
                y: Tensor::zeros(batch, DType::U32, device)?,
                device: device.clone(),
                stats: GraphStats::default(),
            })
        }

        /// The step's forward and backward on the static inputs, reading nothing back.
        fn body(&self, t: &Trainer, loss_scale: f64) -> Result<Outputs> {
            let dtype = t.config.memory.precision.compute_dtype();
            let mut acc = GradAccumulator::new(t.model.param_count());
            let batch = BatchInput::Device {
                x: &self.x,
                y: &self.y,
            };
            let k = t.config.steps.accum_steps;
            let segments = t.model.segments(t.segmentation()?);
            let mut lean =
                LeanStep::new(&t.model, dtype, segments, t.storage()?).with_stats_in_place();
            let mut results = Vec::with_capacity(k);
            for i in 0..k {
                let (x, y) = batch.micro_batch(i, k)?;
                let mult = loss_scale / k as f64;
                let (head, tape) = lean.forward(x, &y, mult, &acc, &mut NoObserver)?;
                lean.backward(tape, &mut acc, &mut NoObserver)?;
                results.push(head);
            }
            let (losses, corrects) = results.into_iter().map(|r| (r.loss, r.correct)).unzip();
            Ok(Outputs {
                losses,
                corrects,
                grads: acc.into_grads(),
            })
        }

        /// Node counts of `graph`.
        fn count(&mut self, graph: &CudaGraph) -> Result<()> {
            let g = graph.cu_graph();
            let mut n = 0usize;
            // SAFETY: `g` is the live graph of `graph`; the first call only reads the count, the
            // second fills `n` node handles, and each handle is then asked for its type.
            let codes = unsafe {
                sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut n)
                    .result()
                    .w()?;
                let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
                sys::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut n)
                    .result()
                    .w()?;
                nodes.truncate(n);
                let mut codes = Vec::with_capacity(n);
                for node in nodes {
                    let mut ty = std::mem::MaybeUninit::<sys::CUgraphNodeType>::uninit();
                    sys::cuGraphNodeGetType(node, ty.as_mut_ptr())
                        .result()
                        .w()?;
                    codes.push(ty.assume_init() as u32);
                }
                codes
            };
            self.stats.count_nodes(codes);
            Ok(())
        }

        /// The graph-memory high-water marks after a launch.
        fn read_graph_memory(&mut self) -> Result<()> {
            let cu_dev = self
                .device
                .as_cuda_device()?
                .cuda_stream()
                .context()
                .cu_device();
            let read = |attr: sys::CUgraphMem_attribute| -> Result<u64> {
                let mut v = 0u64;
                // SAFETY: both attributes are 64-bit values of a live device.
                unsafe {
                    sys::cuDeviceGetGraphMemAttribute(cu_dev, attr, (&mut v as *mut u64).cast())
                        .result()
                        .w()?
                };
                Ok(v)
            };
            let used = read(sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH)?;
            let reserved = read(sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)?;
            self.stats.graph_mem_used_high_bytes = self.stats.graph_mem_used_high_bytes.max(used);
            self.stats.graph_mem_reserved_high_bytes =
                self.stats.graph_mem_reserved_high_bytes.max(reserved);
            Ok(())
        }

        /// One batch: inputs in, then the warm-up, a capture and launch, or a launch.
        pub(super) fn run(
            &mut self,
            t: &Trainer,
            images: &[f32],
            labels: &[u32],
            loss_scale: f64,
        ) -> Result<BatchGrads> {
            let n = self.y.dim(0)?;
            if labels.len() != n || images.len() != n * IMAGE_BYTES {
                return Err(Error::config(format!(
                    "--cuda-graph: a batch of {} images, but the captured step takes batches of {n}",
                    labels.len()
                )));
            }
            // Host copies cannot be captured, and the graph reads these two addresses: the batch
            // goes in before anything else.
            self.x.slice_set(
                &Tensor::from_slice(images, (n, 3, 32, 32), &self.device)?,
                0,
                0,
            )?;
            self.y
                .slice_set(&Tensor::from_slice(labels, n, &self.device)?, 0, 0)?;
            let cuda = self.device.as_cuda_device()?.clone();
            let key = loss_scale.to_bits();
            match next_action(self.warm, self.key, key) {
                GraphAction::Eager => {
                    let out = {
                        // Fills Candle's upload cache that the capture then reads from.
                        let _cache = cuda.enable_cuda_graph_htod_cache();
                        self.body(t, loss_scale)?
                    };
                    self.warm = true;
                    // Eager tensors: nothing rewrites them, so no copies.
                    return read(out.losses, out.corrects, out.grads);
                }
                GraphAction::Capture => {
                    // The old graph's outputs first, then the graph (see the struct's docs).
                    self.outputs = None;
                    self.graph = None;
                    self.key = None;
                    let stream = cuda.cuda_stream();
                    let (body, graph) = {
                        let _cache = cuda.enable_cuda_graph_htod_cache();
                        stream
                            .begin_capture(
                                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                            )
                            .w()?;
                        let body = self.body(t, loss_scale);
                        // Always ended, also after a failed body: the stream leaves capture mode.
                        let graph = stream.end_capture(
                            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
                        );
                        (body, graph)
                    };
                    let outputs = body?;
                    let graph = graph.w()?.ok_or_else(|| {
                        Error::Core(crate::error::CoreError::Device(
                            "--cuda-graph: the capture recorded no work".into(),
                        ))
                    })?;
                    self.count(&graph)?;
                    self.stats.captures += 1;
                    self.outputs = Some(outputs);
                    self.graph = Some(graph);
                    self.key = Some(key);
                }
                GraphAction::Replay => self.stats.replays += 1,
            }
            let graph = self.graph.as_ref().expect("captured above or before");
            graph.launch().w()?;
            let out = self.outputs.as_ref().expect("kept with the graph");
            // The next launch rewrites these buffers: the caller gets copies.
            let grads = out
                .grads
                .iter()
                .map(|g| g.as_ref().map(Tensor::copy).transpose())
                .collect::<candle_core::Result<Vec<_>>>()?;
            let (losses, corrects) = (out.losses.clone(), out.corrects.clone());
            let r = read(losses, corrects, grads)?;
            self.read_graph_memory()?;
            Ok(r)
        }
    }

    /// The step's result on the host: the mean loss over the micro-batches (summed as the eager
    /// step sums it) and the correct count. The first read waits for the device.
    fn read(
        losses: Vec<Tensor>,
        corrects: Vec<Tensor>,
        grads: Vec<Option<Tensor>>,
    ) -> Result<BatchGrads> {
        let k = losses.len();
        let (mut loss, mut correct) = (0.0, 0);
        for (l, c) in losses.iter().zip(&corrects) {
            loss += l.to_scalar::<f32>()? as f64 / k as f64;
            correct += c.to_scalar::<u32>()? as usize;
        }
        Ok((loss, correct, grads))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_up_then_capture_then_replay_and_recapture_on_a_new_key() {
        assert_eq!(next_action(false, None, 1), GraphAction::Eager);
        assert_eq!(next_action(true, None, 1), GraphAction::Capture);
        assert_eq!(next_action(true, Some(1), 1), GraphAction::Replay);
        assert_eq!(next_action(true, Some(1), 2), GraphAction::Capture);
    }

    #[test]
    fn nodes_are_counted_by_kind() {
        let mut s = GraphStats::default();
        s.count_nodes([0, 0, 0, 1, 2, 10, 11, 11, 5]);
        assert_eq!(
            (s.nodes, s.kernel_nodes, s.memcpy_nodes, s.memset_nodes),
            (9, 3, 1, 1)
        );
        assert_eq!((s.alloc_nodes, s.free_nodes, s.other_nodes), (1, 2, 1));
    }
}
