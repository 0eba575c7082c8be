//! The executor shared by the GPU and the host emulator: weights uploaded once, a plan per
//! input-shape signature (launch sizes, arena offsets from liveness), then the steps.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ember_core::backend::{Executable, Weights};
use ember_core::dim::SymbolBindings;
use ember_core::ir::Op;
use ember_core::shapes::resolve;
use ember_core::tensor::{TensorOut, TensorView};
use ember_core::{Error, Result};

use crate::codegen::{Dest, KernelProgram, Launch, Mem, StepKind};

/// Arena allocations are aligned for every dtype and for vectorized access.
const ALIGN: usize = 256;
/// Most blocks of a kernel with per-block scratch (attention keeps a row of scores each).
const MAX_SCRATCH_BLOCKS: u32 = 1024;
/// Signatures kept before the plan cache is cleared.
const MAX_PLANS: usize = 64;

/// A matrix product, row-major, on device addresses.
#[derive(Clone, Debug)]
pub struct GemmCall {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub trans_a: bool,
    pub trans_b: bool,
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub dtype: ember_core::dtype::DType,
}

/// Device memory; freed on drop.
pub trait DeviceBuffer: Send + Sync {
    fn addr(&self) -> u64;
}

/// What the executor needs from a device (the GPU, or the host emulator).
pub trait Device: Send + Sync {
    fn alloc(&self, bytes: usize) -> Result<Box<dyn DeviceBuffer>>;
    fn upload(&self, dst: u64, src: &[u8]) -> Result<()>;
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()>;
    /// Launches kernel `kernel` of the loaded module; `args` are the parameter values.
    fn launch(&self, kernel: usize, grid: u32, block: u32, args: &[u64]) -> Result<()>;
    fn gemm(&self, call: &GemmCall) -> Result<()>;
    /// (block size, most blocks) for a launch of this kind.
    fn launch_limits(&self, cooperative: bool) -> (u32, u32);
    /// Waits for queued work.
    fn synchronize(&self) -> Result<()>;
    /// The stream the next launches go to (a CUDA stream handle; ignored by the emulator).
    fn set_stream(&self, _stream: u64) {}
}

/// Blocks in the grid and threads in each block (1-D launches).
struct Geometry {
    blocks: u32,
    threads: u32,
}

struct Plan {
    env: SymbolBindings,
    shapes: Vec<Vec<usize>>,
    /// Arena offset of each node written to the arena.
    offsets: HashMap<usize, usize>,
    arena_bytes: usize,
    /// Scratch bytes and offset for each step that needs some.
    scratch: HashMap<usize, usize>,
}

pub struct Program<D: Device> {
    pub kp: KernelProgram,
    pub device: D,
    /// Device copies of weights and constants, by node.
    weights: HashMap<usize, Box<dyn DeviceBuffer>>,
    plans: Mutex<HashMap<Vec<Vec<usize>>, Arc<Plan>>>,
    /// Runs are serialized: they share the arena and the meta buffer, kept between runs.
    run_state: Mutex<RunState>,
}

#[derive(Default)]
struct RunState {
    /// (capacity, buffer): grown when a plan needs more.
    arena: Option<(usize, Box<dyn DeviceBuffer>)>,
    meta: Option<(usize, Box<dyn DeviceBuffer>)>,
}

/// A buffer of at least `bytes` from `slot`, reallocated only to grow.
fn reuse<D: Device>(
    device: &D,
    slot: &mut Option<(usize, Box<dyn DeviceBuffer>)>,
    bytes: usize,
) -> Result<u64> {
    if slot.as_ref().is_none_or(|(cap, _)| *cap < bytes) {
        *slot = None;
        *slot = Some((bytes, device.alloc(bytes)?));
    }
    Ok(slot.as_ref().map(|(_, b)| b.addr()).unwrap_or(0))
}

fn bytes_of(shape: &[usize], dtype: ember_core::dtype::DType) -> usize {
    shape.iter().product::<usize>() * dtype.size()
}

fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

impl<D: Device> Program<D> {
    pub fn new(kp: KernelProgram, device: D, weights: &Weights) -> Result<Self> {
        let mut uploaded = HashMap::new();
        for (id, node) in kp.graph.nodes.iter().enumerate() {
            if kp.mem[id] != Mem::Weight {
                continue;
            }
            let bytes: &[u8] = match &node.op {
                Op::Weight { name } => {
                    let w = weights.get(name).ok_or_else(|| {
                        Error::Compile(format!(
                            "weight '{name}' is missing (node '{}')",
                            node.origin
                        ))
                    })?;
                    let want: Vec<Option<i64>> =
                        node.ty.shape.iter().map(|d| d.as_const()).collect();
                    let have: Vec<Option<i64>> = w.shape.iter().map(|&d| Some(d as i64)).collect();
                    if w.dtype != node.ty.dtype || want != have {
                        return Err(Error::Compile(format!(
                            "weight '{name}' is {}{:?}, the graph expects {:?}",
                            w.dtype, w.shape, node.ty
                        )));
                    }
                    w.bytes()
                }
                Op::Constant(c) => &c.bytes,
                _ => continue,
            };
            let buf = device.alloc(bytes.len().max(1))?;
            device.upload(buf.addr(), bytes)?;
            uploaded.insert(id, buf);
        }
        Ok(Program {
            kp,
            device,
            weights: uploaded,
            plans: Mutex::new(HashMap::new()),
            run_state: Mutex::new(RunState::default()),
        })
    }

    fn plan(&self, input_shapes: &[Vec<usize>]) -> Result<Arc<Plan>> {
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = plans.get(input_shapes) {
            return Ok(p.clone());
        }
        let g = &self.kp.graph;
        let resolved = resolve(g, input_shapes)?;
        // The last step reading each node.
        let mut last_read: HashMap<usize, usize> = HashMap::new();
        for (s, step) in self.kp.steps.iter().enumerate() {
            let reads: Vec<usize> = match &step.kind {
                StepKind::Kernel { args, .. } => args.clone(),
                StepKind::Gemm(gm) => vec![gm.a, gm.b],
            };
            for r in reads {
                last_read.insert(r, s);
            }
        }
        // First-fit offsets over the live intervals (the arena is reused as values die).
        let mut live: Vec<(usize, usize, usize)> = Vec::new(); // (offset, size, dies after step)
        let mut offsets = HashMap::new();
        let mut scratch = HashMap::new();
        let mut top = 0usize;
        let mut place =
            |size: usize, dies: usize, s: usize, live: &mut Vec<(usize, usize, usize)>| {
                live.retain(|&(_, _, d)| d >= s);
                live.sort_unstable();
                let mut at = 0usize;
                for &(o, sz, _) in live.iter() {
                    if at + size <= o {
                        break;
                    }
                    at = at.max(o + sz);
                }
                live.push((at, size, dies));
                top = top.max(at + size);
                at
            };
        for (s, step) in self.kp.steps.iter().enumerate() {
            if let StepKind::Kernel {
                scratch_per_block: Some(per_block),
                launch,
                kernel,
                ..
            } = &step.kind
            {
                let coop = self.kp.kernels[*kernel].cooperative;
                let blocks = self
                    .launch_config(launch, &resolved.env, coop, true)?
                    .blocks;
                let per = per_block.eval(&resolved.env)?.max(0) as usize;
                let acc = if step_dtype_is_f64(&self.kp, step.node) {
                    8
                } else {
                    4
                };
                let size = round_up((blocks as usize * per * acc).max(1));
                scratch.insert(s, place(size, s, s, &mut live));
            }
            // A node written by several steps (scatter: copy, then updates) is placed once.
            let unplaced = match step.dest {
                Dest::Node(n) if !offsets.contains_key(&n) => Some(n),
                _ => None,
            };
            if let Some(n) = unplaced {
                let size = round_up(bytes_of(&resolved.shapes[n], g.nodes[n].ty.dtype).max(1));
                let dies = last_read.get(&n).copied().unwrap_or(s).max(s);
                offsets.insert(n, place(size, dies, s, &mut live));
            }
        }
        let plan = Arc::new(Plan {
            env: resolved.env,
            shapes: resolved.shapes,
            offsets,
            arena_bytes: top,
            scratch,
        });
        if plans.len() >= MAX_PLANS {
            plans.clear();
        }
        plans.insert(input_shapes.to_vec(), plan.clone());
        Ok(plan)
    }

    /// The geometry of a launch; empty work gives zero blocks. Kernels with per-block
    /// scratch run on fewer blocks (grid-stride), which bounds the scratch they need.
    fn launch_config(
        &self,
        launch: &Launch,
        env: &SymbolBindings,
        cooperative: bool,
        scratch: bool,
    ) -> Result<Geometry> {
        let (max_block, mut max_grid) = self.device.launch_limits(cooperative);
        if scratch {
            max_grid = max_grid.min(MAX_SCRATCH_BLOCKS);
        }
        Ok(match launch {
            Launch::Elements(n) => {
                let n = n.eval(env)?.max(0) as u64;
                Geometry {
                    blocks: n.div_ceil(max_block as u64).min(max_grid as u64) as u32,
                    threads: max_block,
                }
            }
            Launch::Rows { rows, width } => {
                let rows = rows.eval(env)?.max(0) as u64;
                let width = width.eval(env)?.max(1) as u64;
                Geometry {
                    blocks: rows.min(max_grid as u64) as u32,
                    threads: width.next_power_of_two().clamp(32, max_block as u64) as u32,
                }
            }
        })
    }

    /// Runs on device addresses: `inputs` contiguous, `outputs` sized by `output_shapes`,
    /// launching on `stream`.
    pub fn run_on_device(
        &self,
        input_shapes: &[Vec<usize>],
        inputs: &[u64],
        outputs: &[u64],
        stream: u64,
    ) -> Result<()> {
        let mut state = self.run_state.lock().unwrap_or_else(|e| e.into_inner());
        let plan = self.plan(input_shapes)?;
        let (want_in, want_out) = (self.kp.graph.inputs.len(), self.kp.graph.outputs.len());
        if inputs.len() != want_in || outputs.len() != want_out {
            return Err(Error::Input(format!(
                "expected {want_in} inputs and {want_out} outputs, got {} and {}",
                inputs.len(),
                outputs.len()
            )));
        }
        self.device.set_stream(stream);
        let kp = &self.kp;
        let g = &kp.graph;
        let mut meta: Vec<i64> = vec![0];
        for s in &kp.symbols {
            meta.push(*plan.env.get(s).unwrap_or(&0));
        }
        let meta_bytes: Vec<u8> = meta.iter().flat_map(|v| v.to_le_bytes()).collect();
        let meta_addr = reuse(&self.device, &mut state.meta, meta_bytes.len())?;
        self.device.upload(meta_addr, &meta_bytes)?;
        let base = reuse(&self.device, &mut state.arena, plan.arena_bytes.max(ALIGN))?;
        let addr_of =
            |node: usize| -> Result<u64> {
                match kp.mem[node] {
                    Mem::Input(k) => inputs
                        .get(k)
                        .copied()
                        .ok_or_else(|| Error::Input(format!("missing input {k}"))),
                    Mem::Weight => self.weights.get(&node).map(|b| b.addr()).ok_or_else(|| {
                        Error::Runtime(format!("weight of node {node} not uploaded"))
                    }),
                    Mem::Buffer => {
                        if let Some(&o) = plan.offsets.get(&node) {
                            return Ok(base + o as u64);
                        }
                        // A buffer written straight into a caller's output.
                        kp.steps
                            .iter()
                            .find_map(|s| match s.dest {
                                Dest::Output(k) if s.node == node => outputs.get(k).copied(),
                                _ => None,
                            })
                            .ok_or_else(|| Error::Runtime(format!("node {node} has no memory")))
                    }
                    Mem::Inline => Err(Error::Runtime(format!("node {node} is not in memory"))),
                }
            };
        for (s, step) in kp.steps.iter().enumerate() {
            let dest = match step.dest {
                Dest::Node(n) => base + plan.offsets[&n] as u64,
                Dest::Output(k) => outputs[k],
            };
            match &step.kind {
                StepKind::Kernel {
                    kernel,
                    args,
                    launch,
                    ..
                } => {
                    let coop = kp.kernels[*kernel].cooperative;
                    let scratch = plan.scratch.contains_key(&s);
                    let Geometry { blocks, threads } =
                        self.launch_config(launch, &plan.env, coop, scratch)?;
                    if blocks == 0 {
                        continue;
                    }
                    let mut params = vec![meta_addr, dest];
                    for &a in args {
                        params.push(addr_of(a)?);
                    }
                    if let Some(&o) = plan.scratch.get(&s) {
                        params.push(base + o as u64);
                    }
                    self.device.launch(*kernel, blocks, threads, &params)?;
                }
                StepKind::Gemm(gm) => {
                    let ev = |d: &ember_core::dim::Dim| -> Result<usize> {
                        Ok(d.eval(&plan.env)?.max(0) as usize)
                    };
                    let call = GemmCall {
                        a: addr_of(gm.a)?,
                        b: addr_of(gm.b)?,
                        c: dest,
                        trans_a: gm.trans_a,
                        trans_b: gm.trans_b,
                        batch: ev(&gm.batch)?,
                        m: ev(&gm.m)?,
                        n: ev(&gm.n)?,
                        k: ev(&gm.k)?,
                        dtype: gm.dtype,
                    };
                    if call.batch * call.m * call.n > 0 {
                        self.device.gemm(&call)?;
                    }
                }
            }
        }
        let mut flag = [0u8; 8];
        self.device.download(meta_addr, &mut flag)?;
        self.device.synchronize()?;
        let failed = i64::from_le_bytes(flag);
        if failed != 0 {
            let node = &g.nodes[(failed - 1) as usize];
            return Err(Error::Runtime(format!(
                "index out of range in {} (node '{}')",
                node.op.name(),
                node.origin
            )));
        }
        Ok(())
    }

    pub fn output_shapes(&self, input_shapes: &[Vec<usize>]) -> Result<Vec<Vec<usize>>> {
        let plan = self.plan(input_shapes)?;
        Ok(self
            .kp
            .graph
            .outputs
            .iter()
            .map(|&o| plan.shapes[o].clone())
            .collect())
    }
}

fn step_dtype_is_f64(kp: &KernelProgram, node: usize) -> bool {
    kp.graph.nodes[node].ty.dtype == ember_core::dtype::DType::F64
}

/// Copies a strided host view into contiguous bytes.
pub fn contiguous_bytes(v: &TensorView) -> Vec<u8> {
    let size = v.dtype.size();
    let n: usize = v.shape.iter().product();
    let mut out = vec![0u8; n * size];
    if n == 0 {
        return out;
    }
    let rank = v.shape.len();
    let mut idx = vec![0usize; rank];
    for k in 0..n {
        let off: usize = idx.iter().zip(&v.strides).map(|(i, s)| i * s).sum();
        // SAFETY: the caller's view is valid for reads over its shape and strides.
        let src = unsafe { std::slice::from_raw_parts(v.ptr.add(off * size), size) };
        out[k * size..(k + 1) * size].copy_from_slice(src);
        for d in (0..rank).rev() {
            idx[d] += 1;
            if idx[d] < v.shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// Host tensors in and out: inputs are uploaded, outputs downloaded (the path the optimizer's
/// verification and the tests use; torch CUDA tensors go through `run_on_device`).
impl<D: Device> Executable for Program<D> {
    fn output_shapes(&self, input_shapes: &[Vec<usize>]) -> Result<Vec<Vec<usize>>> {
        Program::output_shapes(self, input_shapes)
    }

    unsafe fn run_device(
        &self,
        input_shapes: &[Vec<usize>],
        inputs: &[u64],
        outputs: &[u64],
        stream: u64,
    ) -> Result<()> {
        self.run_on_device(input_shapes, inputs, outputs, stream)
    }

    unsafe fn run(&self, inputs: &[TensorView], outputs: &[TensorOut]) -> Result<()> {
        let shapes: Vec<Vec<usize>> = inputs.iter().map(|v| v.shape.clone()).collect();
        let out_shapes = Program::output_shapes(self, &shapes)?;
        let mut keep = Vec::new();
        let mut in_addrs = Vec::new();
        for v in inputs {
            let bytes = contiguous_bytes(v);
            let buf = self.device.alloc(bytes.len().max(1))?;
            self.device.upload(buf.addr(), &bytes)?;
            in_addrs.push(buf.addr());
            keep.push(buf);
        }
        let mut out_bufs = Vec::new();
        for (o, shape) in outputs.iter().zip(&out_shapes) {
            if &o.shape != shape {
                return Err(Error::Input(format!(
                    "output buffer of shape {:?}, the program writes {shape:?}",
                    o.shape
                )));
            }
            out_bufs.push(self.device.alloc(bytes_of(shape, o.dtype).max(1))?);
        }
        let out_addrs: Vec<u64> = out_bufs.iter().map(|b| b.addr()).collect();
        self.run_on_device(&shapes, &in_addrs, &out_addrs, 0)?;
        for (o, buf) in outputs.iter().zip(&out_bufs) {
            let n = bytes_of(&o.shape, o.dtype);
            // SAFETY: the caller's output is valid for writes of its full size.
            let dst = unsafe { std::slice::from_raw_parts_mut(o.ptr, n) };
            self.device.download(buf.addr(), dst)?;
        }
        Ok(())
    }
}
