//! The estimate's printout: the per-layer table every run and `--dry-run` print, its total row, the
//! totals and peaks per phase, and what the evaluation needs ([`Estimate::table`]).

use super::estimate::Estimate;
use super::sim::DeviceKind;
use memtrain_core::memory::format_bytes;
use std::fmt::Write as _;

impl Estimate {
    /// The per-layer table (layer, output shape, parameters, activations saved for the backward,
    /// activations recomputed in it, largest transient) with a total row, followed by the
    /// totals and the predicted peak per phase, as markdown. The params, saved and recomputed
    /// columns add up to their total row, which is the line under the table.
    pub fn table(&self) -> String {
        let mut s = format!(
            "memory estimate ({}; micro-batch {} x {} step(s), {}, checkpoint {}, {} conv)\n",
            match self.setup.device {
                DeviceKind::Cpu { threads, .. } => format!("cpu, {threads} threads"),
                DeviceKind::Cuda => "cuda, first-order".to_string(),
            },
            self.setup.micro_batch,
            self.setup.accum_steps,
            self.setup.precision,
            self.setup.grad_checkpointing,
            self.setup.conv
        );
        s.push_str(
            "| layer | output (C×H×W) | params | saved for backward | recomputed in backward | largest transient |\n",
        );
        s.push_str("|---|---|---:|---:|---:|---:|\n");
        let dash = |b: u64| {
            if b == 0 {
                "-".to_string()
            } else {
                format_bytes(b)
            }
        };
        let (c, h, w) = self.setup.input_shape;
        let _ = writeln!(
            s,
            "| input (micro-batch) | {c}×{h}×{w} | 0 | {} | - | - |",
            dash(self.kept.input_saved_bytes)
        );
        for l in &self.layers {
            let (c, h, w) = l.output_shape;
            let _ = writeln!(
                s,
                "| {} | {c}×{h}×{w} | {} | {} | {} | {} |",
                l.name,
                l.params,
                dash(l.saved_bytes),
                dash(l.recompute_bytes),
                dash(l.transient_bytes)
            );
        }
        let params: usize = self.layers.iter().map(|l| l.params).sum();
        let _ = writeln!(
            s,
            "| total | | {params} | {} | {} | |",
            format_bytes(self.kept.activation_bytes),
            format_bytes(self.kept.recomputed_bytes)
        );
        let _ = writeln!(
            s,
            "saved for backward {} per micro-batch (activations at end of forward) | recomputed in backward {} per micro-batch",
            format_bytes(self.kept.activation_bytes),
            format_bytes(self.kept.recomputed_bytes)
        );
        let _ = writeln!(
            s,
            "parameters {} | gradients {} | optimizer state {}",
            format_bytes(self.held.param_bytes),
            format_bytes(self.held.grad_bytes),
            format_bytes(self.held.optimizer_bytes),
        );
        if self.held.mask_bytes > 0 {
            let _ = writeln!(s, "pruning masks {}", format_bytes(self.held.mask_bytes));
        }
        let _ = writeln!(
            s,
            "baseline {} (data set, model, runtime) | batches in flight {} (--prefetch {} + 1) | {} {}",
            format_bytes(self.held.baseline_bytes),
            format_bytes(self.held.batch_bytes),
            self.setup.prefetch,
            if self.setup.device.is_cpu() {
                "gemm buffers"
            } else {
                "conv workspace"
            },
            format_bytes(self.held.runtime_bytes)
        );
        if self.held.unsized_bytes > 0 {
            s.pop();
            let _ = writeln!(
                s,
                " | unsized host records {}",
                format_bytes(self.held.unsized_bytes)
            );
        }
        let _ = writeln!(
            s,
            "predicted peak {} ({}) | forward {} | backward {} | optimizer {}",
            format_bytes(self.peak),
            self.peak_phase,
            format_bytes(self.phases.forward_peak),
            format_bytes(self.phases.backward_peak),
            format_bytes(self.phases.optimizer_peak)
        );
        s.push_str(&self.eval_line());
        s
    }

    /// The table's last line: the evaluation's predicted peak and what the run needs.
    fn eval_line(&self) -> String {
        match self.eval_peak {
            Some(e) => format!(
                "predicted evaluation peak {} (forward in batches of {}, running statistics, nothing saved) | the run needs {} ({})\n",
                format_bytes(e),
                self.setup.eval_batch,
                format_bytes(self.run_peak()),
                self.run_peak_phase()
            ),
            None => "no evaluation (--no-eval): the run needs the step's peak\n".to_string(),
        }
    }
}
