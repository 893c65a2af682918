//! The estimate's model of a step: the layer graph as nodes ([`Node`]), the context of one
//! micro-batch ([`Ctx`]) and the simulation of bytes in use ([`Sim`]), replayed allocation by
//! allocation.

use crate::error::Result;
use candle_core::DType;
pub(super) use memtrain_core::model::LayerKind;
use memtrain_core::model::ModelConfig;
use memtrain_core::phase::Phase;

/// Where training runs, as far as memory is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum DeviceKind {
    /// The CPU with `threads` compute threads (Candle's CPU pool workers plus the caller): every
    /// thread of a convolution holds its own im2col column.
    Cpu {
        /// Threads that run per-image convolution work at once.
        threads: usize,
        /// Bytes of the L2 cache: the gemm crate keeps one L2-sized packing buffer per thread
        /// that has run a matrix product, for the life of the thread.
        l2_cache_bytes: u64,
    },
    /// A CUDA device: the probe measures the memory pool, so the data set and host batches are
    /// not part of the measurement.
    Cuda,
}

impl DeviceKind {
    /// The CPU of this process, with as many threads as Candle's CPU pool uses.
    pub fn cpu() -> Self {
        DeviceKind::Cpu {
            threads: candle_core::utils::barrier_pool().n_workers() + 1,
            l2_cache_bytes: l2_cache_bytes(),
        }
    }

    /// The kind of a Candle device.
    pub fn of(device: &candle_core::Device) -> Self {
        if device.is_cpu() {
            DeviceKind::cpu()
        } else {
            DeviceKind::Cuda
        }
    }

    /// The kind a `--device` value selects without opening the device: `cpu`, `cuda`/`cuda:N`,
    /// or (no value) CUDA when this build has it and a GPU is present, else the CPU.
    ///
    /// # Errors
    /// When the value is not a device spec.
    pub fn for_spec(spec: Option<&str>) -> Result<Self> {
        match spec {
            Some(s) => {
                memtrain_core::device::parse_device_spec(s)?;
                if s.trim().eq_ignore_ascii_case("cpu") {
                    Ok(DeviceKind::cpu())
                } else {
                    Ok(DeviceKind::Cuda)
                }
            }
            None if candle_core::utils::cuda_is_available() => Ok(DeviceKind::Cuda),
            None => Ok(DeviceKind::cpu()),
        }
    }

    /// Whether this is the CPU (where the probe counts the whole process heap, data set included).
    pub fn is_cpu(&self) -> bool {
        matches!(self, DeviceKind::Cpu { .. })
    }

    pub(super) fn threads(&self) -> usize {
        match self {
            DeviceKind::Cpu { threads, .. } => (*threads).max(1),
            DeviceKind::Cuda => 1,
        }
    }
}

/// The L2 cache size of CPU 0 (Linux sysfs), or 1 MiB where it cannot be read.
pub(super) fn l2_cache_bytes() -> u64 {
    const FALLBACK: u64 = 1 << 20;
    let base = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    for i in 0..8 {
        let dir = base.join(format!("index{i}"));
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).map(|s| s.trim().to_string());
        let (Ok(level), Ok(kind), Ok(size)) = (read("level"), read("type"), read("size")) else {
            continue;
        };
        if level == "2" && kind != "Instruction" {
            let (num, mult) = match size.strip_suffix('K') {
                Some(n) => (n, 1024),
                None => match size.strip_suffix('M') {
                    Some(n) => (n, 1 << 20),
                    None => (size.as_str(), 1),
                },
            };
            if let Ok(v) = num.parse::<u64>() {
                return v * mult;
            }
        }
    }
    FALLBACK
}

// ---------------------------------------------------------------------------------------------
// The model as the simulation sees it.

#[derive(Debug, Clone)]
pub(super) struct Node {
    pub(super) name: String,
    pub(super) kind: LayerKind,
    pub(super) inp: (usize, usize, usize),
    pub(super) out: (usize, usize, usize),
    pub(super) params: usize,
    pub(super) block: usize,
}

pub(super) fn elems(shape: (usize, usize, usize)) -> u64 {
    (shape.0 * shape.1 * shape.2) as u64
}

impl Node {
    pub(super) fn in_bytes(&self, c: &Ctx) -> u64 {
        c.n * elems(self.inp) * c.s
    }

    pub(super) fn out_bytes(&self, c: &Ctx) -> u64 {
        c.n * elems(self.out)
            * if matches!(self.kind, LayerKind::Linear) {
                4
            } else {
                c.s
            }
    }

    /// Shapes of the parameter tensors, in the model's order: a conv's weight (`[out, in, k, k]`,
    /// a depthwise one `[C, 1, 3, 3]`), BatchNorm's γ and β (`[C]`), the head's weight
    /// (`[classes, features]`) and bias.
    pub(super) fn param_shapes(&self) -> Vec<Vec<usize>> {
        match self.kind {
            LayerKind::Conv { k, .. } => vec![vec![self.out.0, self.inp.0, k, k]],
            LayerKind::Depthwise => vec![vec![self.inp.0, 1, 3, 3]],
            LayerKind::BnRelu => vec![vec![self.out.0]; 2],
            LayerKind::MaxPool => vec![],
            LayerKind::Linear => vec![vec![self.out.0, elems(self.inp) as usize], vec![self.out.0]],
        }
    }
}

/// The model's layers as nodes: [`ModelConfig::layer_specs`], the architecture's one list.
pub(super) fn nodes_of(model: ModelConfig) -> Vec<Node> {
    (model.layer_specs().into_iter())
        .map(|s| Node {
            name: s.name,
            kind: s.kind,
            inp: s.input,
            out: s.output,
            params: s.params,
            block: s.block,
        })
        .collect()
}

/// The nodes of one block: its conv nodes (one, or depthwise + pointwise), BatchNorm, pool.
pub(super) struct BlockNodes {
    pub(super) convs: Vec<usize>,
    pub(super) bn: usize,
    pub(super) pool: Option<usize>,
    pub(super) name: String,
}

impl BlockNodes {
    /// Bytes of the block's conv output h.
    pub(super) fn h_bytes(&self, c: &Ctx, nodes: &[Node]) -> u64 {
        nodes[self.bn].in_bytes(c)
    }
    /// Bytes of the block's output (after the pool when there is one).
    pub(super) fn out_bytes(&self, c: &Ctx, nodes: &[Node]) -> u64 {
        nodes[self.pool.unwrap_or(self.bn)].out_bytes(c)
    }
    pub(super) fn channels(&self, nodes: &[Node]) -> u64 {
        nodes[self.bn].out.0 as u64
    }
}

pub(super) fn blocks_of(nodes: &[Node]) -> Vec<BlockNodes> {
    let head = nodes.len() - 1;
    let n_blocks = nodes[..head].iter().map(|n| n.block + 1).max().unwrap_or(0);
    (0..n_blocks)
        .map(|b| {
            let idx: Vec<usize> = (0..head).filter(|&i| nodes[i].block == b).collect();
            let convs = idx
                .iter()
                .copied()
                .filter(|&i| matches!(nodes[i].kind, LayerKind::Conv { .. } | LayerKind::Depthwise))
                .collect();
            let bn = idx
                .iter()
                .copied()
                .find(|&i| nodes[i].kind == LayerKind::BnRelu)
                .unwrap_or(idx[0]);
            let pool = idx
                .iter()
                .copied()
                .find(|&i| nodes[i].kind == LayerKind::MaxPool);
            let name = nodes[bn]
                .name
                .rsplit_once('.')
                .map_or(nodes[bn].name.clone(), |(b, _)| b.to_string());
            BlockNodes {
                convs,
                bn,
                pool,
                name,
            }
        })
        .collect()
}

pub(super) fn elem_bytes(dtype: DType) -> u64 {
    dtype.size_in_bytes() as u64
}

/// Per-micro-batch constants.
pub(super) struct Ctx {
    /// Images per micro-batch.
    pub(super) n: u64,
    /// Bytes per element of the compute dtype.
    pub(super) s: u64,
    pub(super) dtype: DType,
    pub(super) device: DeviceKind,
    /// How the blocks' conv outputs are kept (`--compress-activations`).
    pub(super) storage: crate::config::ActivationStorage,
}

impl Ctx {
    pub(super) fn half(&self) -> bool {
        self.s < 4
    }

    /// Bytes the tape keeps of a conv output of `h` bytes and `ch` channels
    /// ([`crate::config::ActivationStorage::kept_bytes`]).
    pub(super) fn kept(&self, h: u64, ch: u64) -> u64 {
        let plane = (h / self.s / self.n / ch) as usize;
        let dims = [self.n as usize, ch as usize, 1, plane];
        self.storage.kept_bytes(dims, self.s as usize)
    }

    /// Threads busy on `n` independent images (one image per task).
    pub(super) fn busy(&self, tasks: u64) -> u64 {
        (self.device.threads() as u64).min(tasks.max(1))
    }
}

// ---------------------------------------------------------------------------------------------
// The simulation: bytes in use, replayed allocation by allocation.

#[derive(Debug, Default, Clone, Copy)]
pub(super) struct LayerRec {
    pub(super) transient: u64,
}

/// The simulation the buffers of one estimate live in.
pub(super) type Shared = std::rc::Rc<std::cell::RefCell<Sim>>;

pub(super) struct Sim {
    pub(super) cur: u64,
    /// The highest `cur` in each phase, indexed by [`Phase`].
    pub(super) peaks: [u64; 5],
    pub(super) phase: Phase,
    pub(super) layers: Vec<LayerRec>,
    /// Highest `cur` since [`Sim::mark`].
    pub(super) local_peak: u64,
    /// Highest `cur` since the previous event.
    pub(super) event_peak: u64,
}

impl Sim {
    pub(super) fn new(layers: usize) -> Self {
        Sim {
            cur: 0,
            peaks: [0; 5],
            phase: Phase::Forward,
            layers: vec![LayerRec::default(); layers],
            local_peak: 0,
            event_peak: 0,
        }
    }

    pub(super) fn alloc(&mut self, b: u64) {
        self.cur += b;
        let p = &mut self.peaks[self.phase as usize];
        *p = (*p).max(self.cur);
        self.local_peak = self.local_peak.max(self.cur);
        self.event_peak = self.event_peak.max(self.cur);
    }

    pub(super) fn free(&mut self, b: u64) {
        self.cur = self.cur.saturating_sub(b);
    }

    /// A buffer allocated and freed again.
    pub(super) fn spike(&mut self, b: u64) {
        self.alloc(b);
        self.free(b);
    }

    /// Start measuring one layer's transient memory.
    pub(super) fn mark(&mut self) -> u64 {
        self.local_peak = self.cur;
        self.cur
    }

    /// Record the transient memory of layer `i` since `mark` returned `start`.
    pub(super) fn record(&mut self, i: usize, start: u64) {
        let t = self.local_peak.saturating_sub(start.max(self.cur));
        let r = &mut self.layers[i].transient;
        *r = (*r).max(t);
    }
}
