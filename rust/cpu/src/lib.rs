//! Ember's CPU backend: runs IR graphs directly with typed, strided kernels (views cost no
//! copy), `gemm` for matrix products, and a dedicated rayon pool for parallel work.

mod arena;
mod buffer;
mod compile;
mod elem;
mod error;
mod exec;
mod fold;
mod fuse;
mod grouped_attention;
mod kernels;
mod memory;
mod par;
pub mod profile;
mod scratch;
mod simd;
mod strided;

use std::sync::{Arc, Mutex};

use ember_core::backend::{Backend, Executable, LoweringRule, Weights};
use ember_core::dtype::DType;
use ember_core::ir::{Graph, Op};
use ember_core::tensor::{TensorOut, TensorView};
use ember_core::{Error, Result};

pub use error::CpuError;

/// Kernels and the thread helper, for `examples/` benchmarks that time them without a graph.
#[doc(hidden)]
pub mod internals {
    #[cfg(target_arch = "x86_64")]
    pub use crate::kernels::bf16_kernel::Bf16Kernel;
    pub use crate::kernels::dot::{gemm_into, rows_dot_parallel, Mat};
    pub use crate::kernels::sgemm;
    pub use crate::par::{with_helpers, Helpers};
}

use arena::Arena;
pub use compile::PackBudget;
use compile::Program;

/// The CPU backend. `num_threads` sizes its thread pool (0: one per core).
///
/// Elementwise chains are fused into one blocked pass and `dot` + bias + activation into one
/// GEMM with an epilogue, unless fusion is turned off with `with_fusion(false)` or the
/// environment variable `EMBER_CPU_FUSE=0` (read when the backend is made); results are the
/// same either way, bit for bit.
pub struct CpuBackend {
    num_threads: usize,
    fuse: bool,
    pool: Arc<rayon::ThreadPool>,
    helpers: Arc<par::Helpers>,
    /// Weights packed by this backend's compiles (the search's candidates share them); an
    /// unreadable `EMBER_CPU_PACK_MB` is reported by every compile.
    packs: std::result::Result<compile::PackedWeights, String>,
}

impl CpuBackend {
    pub fn new(num_threads: usize) -> CpuBackend {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(num_threads)
            .thread_name(|i| format!("ember-cpu-{i}"))
            .build()
            .or_else(|_| rayon::ThreadPoolBuilder::new().num_threads(1).build())
            .expect("cannot start even a one-thread pool");
        let num_threads = pool.current_num_threads();
        let fuse = std::env::var("EMBER_CPU_FUSE").map_or(true, |v| v.trim() != "0");
        CpuBackend {
            num_threads,
            fuse,
            pool: Arc::new(pool),
            helpers: par::Helpers::for_threads(num_threads),
            packs: PackBudget::from_env().map(compile::PackedWeights::new),
        }
    }

    /// Sets how much memory packed copies of weights may take (default:
    /// `PackBudget::from_env`).
    pub fn with_pack_budget(mut self, budget: PackBudget) -> CpuBackend {
        self.packs = Ok(compile::PackedWeights::new(budget));
        self
    }

    /// Turns fusion of elementwise chains and GEMM epilogues on or off.
    pub fn with_fusion(mut self, fuse: bool) -> CpuBackend {
        self.fuse = fuse;
        self
    }

    pub fn fusion(&self) -> bool {
        self.fuse
    }

    pub fn num_threads(&self) -> usize {
        self.num_threads
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new(0)
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn compile(&self, graph: &Graph, weights: &Weights) -> Result<Box<dyn Executable>> {
        let packs = self.packs.as_ref().map_err(|e| Error::Input(e.clone()))?;
        // In the pool: packing weights (and copying transposed ones) runs on its threads.
        let program = self
            .pool
            .install(|| Program::new(graph, weights, self.fuse, packs))?;
        Ok(Box::new(CpuExecutable {
            program,
            pool: self.pool.clone(),
            helpers: self.helpers.clone(),
            threads: self.num_threads,
            arenas: Mutex::new(Vec::new()),
        }))
    }

    /// The CPU's implementation choices: `dot` by GEMM (default) or by row-wise dot
    /// products (matrix-vector shapes), and a permuted `dot` operand read in place (default)
    /// or packed contiguous first.
    fn lowering_rules(&self) -> Vec<LoweringRule> {
        vec![
            LoweringRule::Kernel {
                kernel: compile::KERNEL_ROWWISE,
                applies: |op, dtype, _rank| {
                    matches!(op, Op::Dot) && matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
                },
            },
            LoweringRule::PackOperand {
                kernel: compile::KERNEL_PACKED,
                consumer: |op| matches!(op, Op::Dot),
                operand: 1,
                view: |op| matches!(op, Op::Permute { .. }),
            },
        ]
    }

    fn device_name(&self) -> String {
        format!(
            "cpu {} {} threads",
            std::env::consts::ARCH,
            self.num_threads
        )
    }
}

/// A compiled program. Each running call takes an arena of its own (kept for later calls),
/// so calls may run concurrently.
pub struct CpuExecutable {
    program: Program,
    pool: Arc<rayon::ThreadPool>,
    helpers: Arc<par::Helpers>,
    threads: usize,
    arenas: Mutex<Vec<Arena>>,
}

impl Executable for CpuExecutable {
    fn output_shapes(&self, input_shapes: &[Vec<usize>]) -> Result<Vec<Vec<usize>>> {
        let plan = self.program.plan(input_shapes)?;
        Ok(self
            .program
            .graph
            .outputs
            .iter()
            .map(|&o| plan.shapes[o].clone())
            .collect())
    }

    /// Outputs that are a scatter into an input nothing else reads (a cache updated in
    /// place): the scatter builds its result apart, and outputs not written straight are
    /// copied into the caller's buffers after the whole run (`write_output`), so the
    /// input's memory may be that output's buffer.
    fn in_place_outputs(&self) -> Vec<(usize, usize)> {
        let g = &self.program.graph;
        let uses = g.use_counts();
        let mut pairs = Vec::new();
        for (k, &o) in g.outputs.iter().enumerate() {
            let node = &g.nodes[o];
            let plain = matches!(self.program.fusion.role[o], fuse::Role::Plain);
            if !plain || !matches!(node.op, Op::Scatter { .. }) {
                continue;
            }
            let x = node.inputs[0];
            let once = g.outputs.iter().filter(|&&p| p == o).count() == 1;
            if let Op::Input { index } = g.nodes[x].op {
                if once && uses[x] == 1 {
                    pairs.push((k, index));
                }
            }
        }
        pairs
    }

    unsafe fn run(&self, inputs: &[TensorView], outputs: &[TensorOut]) -> Result<()> {
        let g = &self.program.graph;
        if outputs.len() != g.outputs.len() {
            return Err(Error::Input(format!(
                "expected {} outputs, got {}",
                g.outputs.len(),
                outputs.len()
            )));
        }
        let shapes: Vec<Vec<usize>> = inputs.iter().map(|v| v.shape.clone()).collect();
        let plan = self.program.plan(&shapes)?;
        let vals = inputs
            .iter()
            .zip(&g.inputs)
            .enumerate()
            // SAFETY: run's contract makes every input readable over its shape and strides.
            .map(|(k, (v, &id))| unsafe { exec::input_val(v, g.nodes[id].ty.dtype, k) })
            .collect::<Result<Vec<_>>>()?;
        for (k, (out, &o)) in outputs.iter().zip(&g.outputs).enumerate() {
            if out.dtype != g.nodes[o].ty.dtype || out.shape != plan.shapes[o] {
                return Err(Error::Input(format!(
                    "output {k} is {}{:?}, the program produces {}{:?}",
                    out.dtype, out.shape, g.nodes[o].ty.dtype, plan.shapes[o]
                )));
            }
        }
        let lock = || self.arenas.lock().unwrap_or_else(|p| p.into_inner());
        let mut arena = lock().pop().unwrap_or_default();
        let arena_ref = &mut arena;
        let mode = plan.mode;
        let work = move || {
            let results =
                exec::execute(&self.program, &plan, vals, outputs, self.threads, arena_ref)?;
            for (k, (val, out)) in results.iter().zip(outputs).enumerate() {
                // SAFETY: run's contract makes every output writable and unaliased.
                unsafe { exec::write_output(val, out, k)? };
            }
            for val in results {
                arena_ref.give(val);
            }
            Ok(())
        };
        let result = match mode {
            compile::Mode::Caller => par::with_helpers(&self.helpers, self.threads, work),
            compile::Mode::Pool => self.pool.install(work),
        };
        arena.end_call();
        lock().push(arena);
        result
    }
}
