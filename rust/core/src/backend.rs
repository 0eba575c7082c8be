//! The interface every backend implements. The core never names a backend: the Python
//! binding picks one and hands it graphs.

use std::collections::BTreeMap;

use crate::dtype::DType;
use crate::error::Result;
use crate::ir::{Graph, Op};
use crate::tensor::{HostTensor, TensorOut, TensorView};

/// The largest weight-only result (in elements) a backend computes once at compile time;
/// larger ones stay computed at run time, since they would double weight memory. Rewrites
/// that create weight-only values (`fuse/dot-merge`'s concatenated weights) stay under it.
pub const MAX_FOLDED_ELEMS: i64 = 1 << 22;

/// Weights by name, bound once when a program is compiled.
pub type Weights = BTreeMap<String, HostTensor>;

pub trait Backend: Send + Sync {
    /// Short name for reports and cache keys ("cpu", "cuda").
    fn name(&self) -> &'static str;

    /// Turns a verified graph into an executable program. Weights are bound here, once.
    fn compile(&self, graph: &Graph, weights: &Weights) -> Result<Box<dyn Executable>>;

    /// The implementation choices this backend offers the optimizer (its `lower_<name>`
    /// ruleset). Every choice computes exactly what the op it replaces computes.
    fn lowering_rules(&self) -> Vec<LoweringRule> {
        Vec::new()
    }

    /// Names the device programs run on, for compile-cache keys ("cpu x86_64 2 threads").
    fn device_name(&self) -> String {
        self.name().to_string()
    }
}

/// One family of implementation alternatives a backend adds to the e-graph.
#[derive(Clone, Debug)]
pub enum LoweringRule {
    /// Compute ops for which `applies(op, dtype, rank)` holds with the backend kernel `kernel`
    /// (an `Op::Kernel` wrapping the op).
    Kernel {
        kernel: &'static str,
        applies: fn(&Op, DType, usize) -> bool,
    },
    /// Materialize operand `operand` of ops for which `consumer` holds, when that operand is a
    /// view for which `view` holds, with the backend kernel `kernel` (a packed copy).
    PackOperand {
        kernel: &'static str,
        consumer: fn(&Op) -> bool,
        operand: usize,
        view: fn(&Op) -> bool,
    },
}

impl LoweringRule {
    /// The backend kernel the rule offers.
    pub fn kernel(&self) -> &'static str {
        match self {
            LoweringRule::Kernel { kernel, .. } | LoweringRule::PackOperand { kernel, .. } => {
                kernel
            }
        }
    }
}

/// A compiled program. It may be run from several threads at once.
pub trait Executable: Send + Sync {
    /// Shapes of the outputs for inputs of the given shapes (binds dynamic dims, checks
    /// every input shape against the graph).
    fn output_shapes(&self, input_shapes: &[Vec<usize>]) -> Result<Vec<Vec<usize>>>;

    /// Runs the program on the caller's inputs, writing contiguous outputs of the shapes
    /// `output_shapes` returned.
    ///
    /// # Safety
    /// Every input view must be valid for reads over its shape and strides, and every output
    /// must be valid for writes of its full size and not alias any input (but as
    /// `in_place_outputs` allows), for the whole call.
    unsafe fn run(&self, inputs: &[TensorView], outputs: &[TensorOut]) -> Result<()>;

    /// `(output k, input j)` pairs where `run` may be given input `j`'s own memory as output
    /// `k`'s buffer (an exception to `run`'s no-alias rule): output `k` is written only after
    /// everything that reads input `j` has run, and only when the whole run succeeded. A
    /// program that updates a cache (`index_copy_` on a static KV cache) then writes its
    /// result straight into the caller's tensor, with no second copy. Empty by default.
    fn in_place_outputs(&self) -> Vec<(usize, usize)> {
        Vec::new()
    }

    /// Runs on the backend's own device memory: contiguous inputs of `input_shapes` at
    /// `inputs`, outputs (of `output_shapes`) at `outputs`, work queued on `stream`. Only
    /// backends with device memory (CUDA) implement it.
    ///
    /// The work may still be running when this returns (as torch's kernels do): it is
    /// ordered on `stream`.
    ///
    /// # Safety
    /// Every address must be live device memory of its tensor's full size until the work
    /// queued on `stream` has finished.
    unsafe fn run_device(
        &self,
        _input_shapes: &[Vec<usize>],
        _inputs: &[u64],
        _outputs: &[u64],
        _stream: u64,
    ) -> Result<()> {
        Err(crate::Error::Runtime(
            "this backend runs on host memory; pass cpu tensors".into(),
        ))
    }

    /// A timer of runs where the program really runs them, for the optimizer: `inputs`
    /// copied to the device once, each run launched as production runs are (for CUDA: the
    /// recorded graph, on device memory) and timed by the device's own clock (CUDA events).
    /// `None` where runs on host memory are what production does (the optimizer then times
    /// `run` by the host clock).
    ///
    /// # Safety
    /// As for `run`: every input view must be valid for reads over its shape and strides
    /// during this call (the timer keeps copies, not the views).
    unsafe fn device_timer<'a>(
        &'a self,
        _inputs: &[TensorView],
    ) -> Result<Option<Box<dyn DeviceTimer + 'a>>> {
        Ok(None)
    }

    /// Counters of how runs went (for the CUDA backend: runs replayed from a recorded
    /// graph, recordings made, nodes patched); empty where a backend keeps none.
    fn run_stats(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}

/// Runs one program on inputs already on its device (see `Executable::device_timer`).
pub trait DeviceTimer {
    /// Runs the program once; the seconds the device spent from the run's first launch
    /// being queued to its last finishing.
    fn run(&mut self) -> Result<f64>;
}
