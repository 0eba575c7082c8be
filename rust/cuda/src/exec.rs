//! The executor shared by the GPU and the host emulator: weights uploaded once; per call
//! the dims go to `meta`, and the program's work runs — replayed from a recording (a CUDA
//! graph) where the device records, launched step by step otherwise.
//!
//! Recordings are kept per *dim bucket* (each symbol's value rounded up to a power of
//! two): their arena layout and launch sizes are planned for the bucket, so a call with
//! other dims in the same bucket replays the same recording. Only what a recording fixes
//! and the call changes is patched: the addresses of the caller's inputs and outputs, and
//! the sizes of library products (cuBLASLt does not read `meta`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use ember_core::backend::{DeviceTimer, Executable, Weights};
use ember_core::dim::{Dim, SymbolBindings};
use ember_core::dtype::DType;
use ember_core::ir::Op;
use ember_core::shapes::resolve;
use ember_core::tensor::{TensorOut, TensorView};
use ember_core::{Error, Result};

use crate::codegen::{Dest, KernelProgram, Mem, StepKind};
use crate::layout::{self, Layout, ALIGN};
use crate::memcheck::{RunMemory, Watch};

/// Signatures kept before the plan cache is cleared.
const MAX_PLANS: usize = 64;
/// Dim buckets kept (each with its recording) before they are dropped.
const MAX_BUCKETS: usize = 32;

/// A matrix product, row-major, on device addresses.
#[derive(Clone, Debug, PartialEq)]
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
    /// A vector of `n` values (of `dtype`) added to every row of `c`; 0 for none.
    pub bias: u64,
    /// A matrix shaped as `c` (of `dtype`) added to it (cuBLASLt's C with β = 1); 0 for none.
    pub addend: u64,
    /// The tanh GELU applied last (cuBLASLt's GELU epilogue, after the bias).
    pub gelu_tanh: bool,
}

/// One piece of a run's device work, in order: what a recording holds.
#[derive(Clone, Debug, PartialEq)]
pub enum Work {
    /// Kernel `kernel` of the loaded module; `args` are its parameter values.
    Launch {
        kernel: usize,
        grid: u32,
        block: u32,
        args: Vec<u64>,
    },
    Gemm(GemmCall),
}

impl Work {
    /// Whether a recording of `self` can take `other`'s parameters.
    fn same_kind(&self, other: &Work) -> bool {
        match (self, other) {
            (Work::Launch { kernel: a, .. }, Work::Launch { kernel: b, .. }) => a == b,
            (Work::Gemm(_), Work::Gemm(_)) => true,
            _ => false,
        }
    }

    pub fn run<D: Device>(&self, device: &D) -> Result<()> {
        match self {
            Work::Launch {
                kernel,
                grid,
                block,
                args,
            } => device.launch(*kernel, *grid, *block, args),
            Work::Gemm(call) => device.gemm(call),
        }
    }
}

/// Device memory; freed on drop.
pub trait DeviceBuffer: Send + Sync {
    fn addr(&self) -> u64;
}

/// A weight already in device memory (a torch CUDA parameter), read where it is: the
/// program neither copies nor frees it, so a model's weights are not on the GPU twice and
/// in-place updates are seen. The caller keeps it alive, unmoved and 256-byte aligned for
/// the program's life.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceWeight {
    pub addr: u64,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// Device-resident weights by name.
pub type DeviceWeights = std::collections::BTreeMap<String, DeviceWeight>;

/// Where a weight's data comes from when a program is made.
enum Source<'a> {
    /// Read in place at this device address.
    Device(u64),
    /// Uploaded from these host bytes.
    Host(&'a [u8]),
}

/// Memory the program reads but does not own (a device weight).
struct Borrowed(u64);

impl DeviceBuffer for Borrowed {
    fn addr(&self) -> u64 {
        self.0
    }
}

/// What the executor needs from a device (the GPU, or the host emulator).
pub trait Device: Send + Sync {
    /// Work recorded for replay (a CUDA graph on the GPU).
    type Recording: Send;

    fn alloc(&self, bytes: usize) -> Result<Box<dyn DeviceBuffer>>;
    /// Copies to the device and waits: `src` may be freed on return.
    fn upload(&self, dst: u64, src: &[u8]) -> Result<()>;
    /// Copies to the device in stream order without waiting for queued work; `src` (host
    /// memory the device cannot read directly) may still be freed on return.
    fn upload_async(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.upload(dst, src)
    }
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
    /// Records `work` for replay; `Ok(None)` where this device does not record.
    fn record(&self, work: &[Work]) -> Result<Option<Self::Recording>>;
    /// Gives item `index` of a recording `work`'s parameters (an item of the same kind);
    /// `Ok(false)` where the recording cannot take them (it is then recorded anew).
    fn update(&self, recording: &mut Self::Recording, index: usize, work: &Work) -> Result<bool>;
    /// Runs a recording on the current stream.
    fn replay(&self, recording: &Self::Recording) -> Result<()>;

    /// Whether the device checks each run's memory accesses against a `Watch` (the
    /// emulator does; a GPU leaves that to `compute-sanitizer`).
    fn checks_memory(&self) -> bool {
        false
    }
    /// The memory of the run about to start, for a device that checks it.
    fn watch(&self, _watch: Watch) {}

    /// A point in `stream`'s work: where it is reached, the device notes the time (a CUDA
    /// event on the GPU; the host clock in the emulator, whose work is done when queued).
    type Mark;
    fn mark(&self, stream: u64) -> Result<Self::Mark>;
    /// Seconds from `start` to `end` being reached (waits for `end`).
    fn seconds_between(&self, start: &Self::Mark, end: &Self::Mark) -> Result<f64>;
}

/// How a program's runs went, for tests and reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunStats {
    /// Runs launched step by step.
    pub direct: u64,
    /// Runs replayed from a recording.
    pub replayed: u64,
    /// Recordings made (the first run of a bucket, or after a change a recording could
    /// not take).
    pub recorded: u64,
    /// Recorded items given new parameters (addresses, product sizes).
    pub patched: u64,
    /// Recordings the device refused (the program then runs step by step).
    pub record_failures: u64,
    /// Host time in runs, in µs: all of it (planning, patching, recording, enqueuing, and
    /// waiting for the index check's flag where there is one), and the parts spent
    /// recording and patching — where a run's time goes when the device is not the limit.
    pub host_us: u64,
    pub record_us: u64,
    pub patch_us: u64,
}

/// The resolved dims of one input signature, and (for runs step by step, planned on
/// first use) an exact layout for them.
struct Plan {
    env: SymbolBindings,
    shapes: Vec<Vec<usize>>,
    exact: OnceLock<Layout>,
    /// What each run uploads to `meta`: the error flag (0), the symbols' values, then
    /// every split step's counters (0).
    meta: Vec<u8>,
    /// Where each step's counters start in `meta`, in `i64`s.
    counter_at: Vec<usize>,
}

struct Recorded<R> {
    recording: R,
    work: Vec<Work>,
}

/// A dim bucket's layout and recording.
struct Bucket<R> {
    layout: Layout,
    recorded: Option<Recorded<R>>,
}

struct RunState<R> {
    /// (capacity, buffer): grown when a layout needs more (recordings made on the old
    /// arena are dropped then).
    arena: Option<(usize, Box<dyn DeviceBuffer>)>,
    meta: Option<(usize, Box<dyn DeviceBuffer>)>,
    buckets: HashMap<Vec<i64>, Bucket<R>>,
    /// The stream of the last run, which may still be running there.
    stream: Option<u64>,
    /// Whether the device records (known after its first answer).
    records: bool,
    stats: RunStats,
}

pub struct Program<D: Device> {
    /// Runs are serialized: they share the arena, `meta` and the recordings. (Fields drop
    /// in order: the recordings and buffers go before the device whose module they use.)
    run_state: Mutex<RunState<D::Recording>>,
    /// Device copies of weights and constants, by node.
    weights: HashMap<usize, Box<dyn DeviceBuffer>>,
    pub kp: KernelProgram,
    pub device: D,
    /// For buffers written straight into a caller's output: which output.
    output_of: HashMap<usize, usize>,
    /// Some kernel checks indices read from tensors (and flags a failure in `meta[0]`), so
    /// a run waits for the device to read the flag back.
    checks_indices: bool,
    /// (node, the length of the axis it indexes, the shape of its indices) of each gather,
    /// index select and scatter: an empty axis with indices to look up is refused before
    /// any launch, since a kernel would read (or write) element 0 of nothing — an illegal
    /// address on the GPU, which breaks the CUDA context.
    indexed_axes: Vec<(usize, Dim, Vec<Dim>)>,
    plans: Mutex<HashMap<Vec<Vec<usize>>, Arc<Plan>>>,
}

/// A buffer of at least `bytes` from `slot`, reallocated only to grow.
fn reuse<D: Device>(
    device: &D,
    slot: &mut Option<(usize, Box<dyn DeviceBuffer>)>,
    bytes: usize,
) -> Result<u64> {
    if slot.as_ref().is_none_or(|(cap, _)| *cap < bytes) {
        if slot.is_some() {
            // The last run may still be using the old buffer.
            device.synchronize()?;
        }
        *slot = None;
        *slot = Some((bytes, device.alloc(bytes)?));
    }
    Ok(slot.as_ref().map(|(_, b)| b.addr()).unwrap_or(0))
}

/// The bytes the arena buffer holds (all of them: a kernel may not write any byte of it
/// outside a live value).
fn arena_capacity<R>(state: &RunState<R>) -> usize {
    state.arena.as_ref().map_or(0, |(cap, _)| *cap)
}

fn bytes_of(shape: &[usize], dtype: ember_core::dtype::DType) -> usize {
    shape.iter().product::<usize>() * dtype.size()
}

/// Whether `EMBER_CUDA_GRAPHS=0` turns recordings off (every run launched step by step).
fn recordings_enabled() -> bool {
    std::env::var("EMBER_CUDA_GRAPHS").map_or(true, |v| v != "0")
}

impl<D: Device> Program<D> {
    pub fn new(kp: KernelProgram, device: D, weights: &Weights) -> Result<Self> {
        Self::with_device_weights(kp, device, weights, &DeviceWeights::new())
    }

    /// `new`, reading the weights in `on_device` where they are (see `DeviceWeight`);
    /// the others are uploaded from `weights`.
    pub fn with_device_weights(
        kp: KernelProgram,
        device: D,
        weights: &Weights,
        on_device: &DeviceWeights,
    ) -> Result<Self> {
        let mut uploaded: HashMap<usize, Box<dyn DeviceBuffer>> = HashMap::new();
        for (id, node) in kp.graph.nodes.iter().enumerate() {
            if kp.mem[id] != Mem::Weight {
                continue;
            }
            let bytes: &[u8] = match &node.op {
                Op::Weight { name } => {
                    // Either read where it is on the device, or uploaded from the host.
                    let (dtype, shape, source) = match on_device.get(name) {
                        Some(w) => (w.dtype, &w.shape, Source::Device(w.addr)),
                        None => {
                            let w = weights.get(name).ok_or_else(|| {
                                Error::Compile(format!(
                                    "weight '{name}' is missing (node '{}')",
                                    node.origin
                                ))
                            })?;
                            (w.dtype, &w.shape, Source::Host(w.bytes()))
                        }
                    };
                    let want: Vec<Option<i64>> =
                        node.ty.shape.iter().map(|d| d.as_const()).collect();
                    let have: Vec<Option<i64>> = shape.iter().map(|&d| Some(d as i64)).collect();
                    if dtype != node.ty.dtype || want != have {
                        let place = match source {
                            Source::Device(_) => " on the device",
                            Source::Host(_) => "",
                        };
                        return Err(Error::Compile(format!(
                            "weight '{name}' is {dtype}{shape:?}{place}, the graph expects {:?}",
                            node.ty
                        )));
                    }
                    match source {
                        Source::Host(bytes) => bytes,
                        Source::Device(addr) if addr % ALIGN as u64 != 0 => {
                            return Err(Error::Compile(format!(
                                "weight '{name}' at {addr:#x} on the device is not \
                                 {ALIGN}-byte aligned"
                            )));
                        }
                        Source::Device(addr) => {
                            uploaded.insert(id, Box::new(Borrowed(addr)));
                            continue;
                        }
                    }
                }
                Op::Constant(c) => &c.bytes,
                _ => continue,
            };
            let buf = device.alloc(bytes.len().max(1))?;
            device.upload(buf.addr(), bytes)?;
            uploaded.insert(id, buf);
        }
        // The output a node's value is written to by the step computing it: the first one.
        // (A node returned twice is copied into its second output by a later step, which
        // reads it from the first.)
        let mut output_of = HashMap::new();
        for step in &kp.steps {
            for (node, dest) in std::iter::once((step.node, step.dest)).chain(step.also.clone()) {
                if let Dest::Output(k) = dest {
                    output_of.entry(node).or_insert(k);
                }
            }
        }
        let checks_indices = kp.source.contains("ember_index(");
        let g = &kp.graph;
        let indexed_axes = g
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(id, n)| {
                let axis = match n.op {
                    Op::Gather { axis } | Op::IndexSelect { axis } | Op::Scatter { axis, .. } => {
                        axis
                    }
                    _ => return None,
                };
                let len = g.ty(n.inputs[0]).shape.get(axis)?.clone();
                Some((id, len, g.ty(*n.inputs.get(1)?).shape.clone()))
            })
            .collect();
        Ok(Program {
            kp,
            device,
            weights: uploaded,
            output_of,
            checks_indices,
            indexed_axes,
            plans: Mutex::new(HashMap::new()),
            run_state: Mutex::new(RunState {
                arena: None,
                meta: None,
                buckets: HashMap::new(),
                stream: None,
                records: recordings_enabled(),
                stats: RunStats::default(),
            }),
        })
    }

    fn limits(&self) -> impl Fn(bool) -> (u32, u32) + '_ {
        |coop| self.device.launch_limits(coop)
    }

    fn plan(&self, input_shapes: &[Vec<usize>]) -> Result<Arc<Plan>> {
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = plans.get(input_shapes) {
            return Ok(p.clone());
        }
        let resolved = resolve(&self.kp.graph, input_shapes)?;
        let (meta, counter_at) = self.meta(&resolved.env)?;
        let plan = Arc::new(Plan {
            env: resolved.env,
            shapes: resolved.shapes,
            exact: OnceLock::new(),
            meta,
            counter_at,
        });
        if plans.len() >= MAX_PLANS {
            plans.clear();
        }
        plans.insert(input_shapes.to_vec(), plan.clone());
        Ok(plan)
    }

    /// How this program's runs went so far.
    pub fn stats(&self) -> RunStats {
        self.run_state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stats
    }

    /// The bytes of `meta` under `env` — the error flag, the symbols' values, then each
    /// split step's counters (`StepKind::Kernel::partials`), all counters zero so that
    /// every run starts them again — and where each step's counters start (in `i64`s).
    fn meta(&self, env: &SymbolBindings) -> Result<(Vec<u8>, Vec<usize>)> {
        let mut meta: Vec<i64> = vec![0];
        for s in &self.kp.symbols {
            meta.push(*env.get(s).unwrap_or(&0));
        }
        let mut at = Vec::with_capacity(self.kp.steps.len());
        for step in &self.kp.steps {
            at.push(meta.len());
            if let StepKind::Kernel {
                partials: Some((_, counters)),
                ..
            } = &step.kind
            {
                meta.resize(meta.len() + counters.eval(env)?.max(0) as usize, 0);
            }
        }
        Ok((meta.iter().flat_map(|v| v.to_le_bytes()).collect(), at))
    }

    /// The run's work under `layout`, with the dims of `plan`, and the step each item comes
    /// from (steps with no work under those dims have no item).
    fn work(
        &self,
        layout: &Layout,
        plan: &Plan,
        meta: u64,
        base: u64,
        inputs: &[u64],
        outputs: &[u64],
    ) -> Result<(Vec<Work>, Vec<usize>)> {
        let (kp, env) = (&self.kp, &plan.env);
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
                        if let Some(&o) = layout.offsets.get(&node) {
                            return Ok(base + o as u64);
                        }
                        self.output_of
                            .get(&node)
                            .and_then(|&k| outputs.get(k).copied())
                            .ok_or_else(|| Error::Runtime(format!("node {node} has no memory")))
                    }
                    Mem::Inline => Err(Error::Runtime(format!("node {node} is not in memory"))),
                }
            };
        // Outputs given their input's own memory (a cache updated in place): the copy of
        // the input into the output is skipped, and the index check before the updates runs.
        let same = |p: &crate::codegen::InPlace| {
            outputs.get(p.output).is_some() && outputs.get(p.output) == inputs.get(p.input)
        };
        let skipped = |s: usize| {
            let aliased = || kp.in_place.iter().filter(|p| same(p));
            if kp.precheck_step == Some(s) {
                return aliased().next().is_none();
            }
            aliased().any(|p| p.copy_step == s)
        };
        let mut work = Vec::with_capacity(kp.steps.len());
        let mut item_steps = Vec::with_capacity(kp.steps.len());
        let address = |dest: Dest| match dest {
            Dest::Node(n) => base + layout.offsets[&n] as u64,
            Dest::Output(k) => outputs[k],
        };
        for (s, step) in kp.steps.iter().enumerate() {
            if skipped(s) {
                continue;
            }
            let dest = address(step.dest);
            match &step.kind {
                StepKind::Kernel { kernel, args, .. } => {
                    let geom = layout.geometry[s]
                        .ok_or_else(|| Error::Runtime(format!("step {s} has no geometry")))?;
                    if geom.blocks == 0 {
                        continue;
                    }
                    let mut params = Vec::with_capacity(args.len() + step.also.len() + 3);
                    params.extend([meta, dest]);
                    params.extend(step.also.iter().map(|&(_, d)| address(d)));
                    for &a in args {
                        params.push(addr_of(a)?);
                    }
                    if let Some(&(o, _)) = layout.scratch.get(&s) {
                        params.push(base + o as u64);
                    }
                    if let Some(&(o, _)) = layout.partials.get(&s) {
                        params.push(base + o as u64);
                        params.push(meta + 8 * plan.counter_at[s] as u64);
                    }
                    work.push(Work::Launch {
                        kernel: *kernel,
                        grid: geom.blocks,
                        block: geom.threads,
                        args: params,
                    });
                    item_steps.push(s);
                }
                StepKind::Gemm(gm) => {
                    let ev = |d: &ember_core::dim::Dim| -> Result<usize> {
                        Ok(d.eval(env)?.max(0) as usize)
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
                        bias: gm.bias.map(addr_of).transpose()?.unwrap_or(0),
                        addend: gm.residual.map(addr_of).transpose()?.unwrap_or(0),
                        gelu_tanh: gm.gelu_tanh,
                    };
                    if call.batch * call.m * call.n > 0 {
                        work.push(Work::Gemm(call));
                        item_steps.push(s);
                    }
                }
            }
        }
        Ok((work, item_steps))
    }

    /// Tells a device that checks memory (the emulator) what the run about to start may
    /// touch, and where.
    #[allow(clippy::too_many_arguments)]
    fn watch(
        &self,
        plan: &Plan,
        layout: &Layout,
        arena: (u64, usize),
        inputs: &[u64],
        outputs: &[u64],
        item_steps: Vec<usize>,
    ) -> Result<()> {
        if !self.device.checks_memory() {
            return Ok(());
        }
        let watch = Watch::new(RunMemory {
            kp: &self.kp,
            layout,
            env: &plan.env,
            arena,
            inputs,
            outputs,
            weights: self.weights.iter().map(|(&n, b)| (n, b.addr())).collect(),
            item_steps,
        })?;
        self.device.watch(watch);
        Ok(())
    }

    /// The bucket key of `env`: each symbol's bucket, in `meta` order.
    fn bucket_key(&self, env: &SymbolBindings) -> Vec<i64> {
        self.kp
            .symbols
            .iter()
            .map(|s| layout::bucket(*env.get(s).unwrap_or(&0)))
            .collect()
    }

    /// Runs on device addresses: `inputs` contiguous, `outputs` sized by `output_shapes`,
    /// launching on `stream`. Returns without waiting for the device unless the program
    /// checks indices (then a bad index raises here, naming its node).
    pub fn run_on_device(
        &self,
        input_shapes: &[Vec<usize>],
        inputs: &[u64],
        outputs: &[u64],
        stream: u64,
    ) -> Result<()> {
        let started = std::time::Instant::now();
        let mut guard = self.run_state.lock().unwrap_or_else(|e| e.into_inner());
        let state = &mut *guard;
        let ran = self.run_locked(state, input_shapes, inputs, outputs, stream);
        state.stats.host_us += started.elapsed().as_micros() as u64;
        ran
    }

    fn run_locked(
        &self,
        state: &mut RunState<D::Recording>,
        input_shapes: &[Vec<usize>],
        inputs: &[u64],
        outputs: &[u64],
        stream: u64,
    ) -> Result<()> {
        let plan = self.plan(input_shapes)?;
        let (want_in, want_out) = (self.kp.graph.inputs.len(), self.kp.graph.outputs.len());
        if inputs.len() != want_in || outputs.len() != want_out {
            return Err(Error::Input(format!(
                "expected {want_in} inputs and {want_out} outputs, got {} and {}",
                inputs.len(),
                outputs.len()
            )));
        }
        // The arena and `meta` are shared by runs: one still running on another stream
        // must finish before this one overwrites them.
        if state.stream.is_some_and(|s| s != stream) {
            self.device.synchronize()?;
        }
        self.device.set_stream(stream);
        state.stream = Some(stream);

        self.check_indexed_axes(&plan.env)?;
        let meta_bytes = &plan.meta;
        let meta_addr = reuse(&self.device, &mut state.meta, meta_bytes.len())?;

        if state.records {
            self.run_recorded(state, &plan, meta_bytes, meta_addr, inputs, outputs)?;
        } else {
            let exact = match plan.exact.get() {
                Some(l) => l,
                None => {
                    let l = layout::plan(&self.kp, &self.limits(), &[&plan.env], None)?;
                    plan.exact.get_or_init(|| l)
                }
            };
            let base = reuse(&self.device, &mut state.arena, exact.arena_bytes.max(ALIGN))?;
            let (work, items) = self.work(exact, &plan, meta_addr, base, inputs, outputs)?;
            let arena = (base, arena_capacity(state));
            self.watch(&plan, exact, arena, inputs, outputs, items)?;
            self.run_steps(state, &work, meta_addr, meta_bytes)?;
        }
        if self.checks_indices {
            self.check_flag(meta_addr)?;
        }
        Ok(())
    }

    /// One run through the recording of its dim bucket: made on the bucket's first run,
    /// patched where this call differs, replayed.
    fn run_recorded(
        &self,
        state: &mut RunState<D::Recording>,
        plan: &Plan,
        meta_bytes: &[u8],
        meta_addr: u64,
        inputs: &[u64],
        outputs: &[u64],
    ) -> Result<()> {
        let limits = self.limits();
        let key = self.bucket_key(&plan.env);
        let mut bucket = match state.buckets.remove(&key) {
            Some(b) if b.layout.serves(&self.kp, &limits, &plan.env) => b,
            old => {
                // Sized for the whole bucket (and for this call, and anything the old
                // layout served: dims are not always monotonic in the symbols).
                let bucket_env: SymbolBindings = self
                    .kp
                    .symbols
                    .iter()
                    .cloned()
                    .zip(key.iter().copied())
                    .collect();
                let floor = old.as_ref().map(|b| &b.layout);
                Bucket {
                    layout: layout::plan(&self.kp, &limits, &[&plan.env, &bucket_env], floor)?,
                    recorded: None,
                }
            }
        };
        let arena_before = state.arena.as_ref().map(|(_, b)| b.addr());
        let base = reuse(
            &self.device,
            &mut state.arena,
            bucket.layout.arena_bytes.max(ALIGN),
        )?;
        if arena_before.is_some_and(|a| a != base) {
            // Recordings hold arena addresses: those made on the old arena are stale.
            for b in state.buckets.values_mut() {
                b.recorded = None;
            }
            bucket.recorded = None;
        }
        let (work, items) = self.work(&bucket.layout, plan, meta_addr, base, inputs, outputs)?;
        let arena = (base, arena_capacity(state));
        self.watch(plan, &bucket.layout, arena, inputs, outputs, items)?;
        let mut fresh = true;
        let patching = std::time::Instant::now();
        if let Some(rec) = bucket.recorded.as_mut() {
            let same_shape = rec.work.len() == work.len()
                && rec.work.iter().zip(&work).all(|(a, b)| a.same_kind(b));
            fresh = !same_shape;
            if same_shape {
                for (i, w) in work.iter().enumerate() {
                    if rec.work[i] == *w {
                        continue;
                    }
                    if !self.device.update(&mut rec.recording, i, w)? {
                        fresh = true;
                        break;
                    }
                    rec.work[i] = w.clone();
                    state.stats.patched += 1;
                }
            }
        }
        state.stats.patch_us += patching.elapsed().as_micros() as u64;
        if fresh {
            bucket.recorded = None;
            let recording = std::time::Instant::now();
            let recorded = self.device.record(&work);
            state.stats.record_us += recording.elapsed().as_micros() as u64;
            match recorded {
                Ok(Some(recording)) => {
                    bucket.recorded = Some(Recorded { recording, work });
                    state.stats.recorded += 1;
                }
                failed => {
                    // This device does not record (or refused to: a driver without the
                    // graph calls we use): every later run goes step by step, which gives
                    // the same results. `run_stats` shows it.
                    if failed.is_err() {
                        state.stats.record_failures += 1;
                    }
                    state.records = false;
                    return self.run_steps(state, &work, meta_addr, meta_bytes);
                }
            }
        }
        self.device.upload_async(meta_addr, meta_bytes)?;
        if let Some(rec) = &bucket.recorded {
            self.device.replay(&rec.recording)?;
            state.stats.replayed += 1;
        }
        if state.buckets.len() >= MAX_BUCKETS {
            state.buckets.clear();
        }
        state.buckets.insert(key, bucket);
        Ok(())
    }

    /// `meta`, then every item of `work` launched in order (no recording).
    fn run_steps(
        &self,
        state: &mut RunState<D::Recording>,
        work: &[Work],
        meta_addr: u64,
        meta_bytes: &[u8],
    ) -> Result<()> {
        self.device.upload_async(meta_addr, meta_bytes)?;
        for w in work {
            w.run(&self.device)?;
        }
        state.stats.direct += 1;
        Ok(())
    }

    /// Refuses a call whose indices point into an empty axis (before anything runs).
    fn check_indexed_axes(&self, env: &SymbolBindings) -> Result<()> {
        for (node, len, index_shape) in &self.indexed_axes {
            let mut indices = 1i64;
            for d in index_shape {
                indices = indices.saturating_mul(d.eval(env)?.max(0));
            }
            if indices > 0 && len.eval(env)? <= 0 {
                let n = &self.kp.graph.nodes[*node];
                return Err(Error::Runtime(format!(
                    "index out of range in {} (node '{}'): {indices} indices into an empty axis",
                    n.op.name(),
                    n.origin
                )));
            }
        }
        Ok(())
    }

    /// Waits for the run and raises if a kernel flagged an index out of range.
    fn check_flag(&self, meta_addr: u64) -> Result<()> {
        let mut flag = [0u8; 8];
        self.device.download(meta_addr, &mut flag)?;
        let failed = i64::from_le_bytes(flag);
        if failed != 0 {
            let node = usize::try_from(failed - 1)
                .ok()
                .and_then(|n| self.kp.graph.nodes.get(n));
            return Err(Error::Runtime(match node {
                Some(node) => format!(
                    "index out of range in {} (node '{}')",
                    node.op.name(),
                    node.origin
                ),
                None => format!("a kernel flagged an error this program cannot name ({failed})"),
            }));
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

impl<D: Device> Drop for Program<D> {
    fn drop(&mut self) {
        // Runs return before the device finishes them; the buffers must outlive that work.
        let _ = self.device.synchronize();
    }
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

    unsafe fn device_timer<'a>(
        &'a self,
        inputs: &[TensorView],
    ) -> Result<Option<Box<dyn DeviceTimer + 'a>>> {
        Ok(Some(Box::new(ProgramTimer::new(self, inputs)?)))
    }

    /// Scatters into an input nothing else reads (`KernelProgram::in_place`): given that
    /// input's memory as their output, they write only the updates, after every index of
    /// the run was checked (`precheck_step`), so a failing run leaves the input unchanged.
    fn in_place_outputs(&self) -> Vec<(usize, usize)> {
        self.kp
            .in_place
            .iter()
            .map(|p| (p.output, p.input))
            .collect()
    }

    fn run_stats(&self) -> Vec<(&'static str, u64)> {
        let s = self.stats();
        vec![
            ("direct", s.direct),
            ("replayed", s.replayed),
            ("recorded", s.recorded),
            ("patched", s.patched),
            ("record_failures", s.record_failures),
            ("host_us", s.host_us),
            ("record_us", s.record_us),
            ("patch_us", s.patch_us),
        ]
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
        // An output the caller gave an input's memory for (`in_place_outputs`) is that
        // input's device copy too, so the device runs the in-place path.
        let in_place: HashMap<usize, usize> = self
            .kp
            .in_place
            .iter()
            .filter(|p| {
                let v = &inputs[p.input];
                std::ptr::eq(v.ptr, outputs[p.output].ptr)
                    && v.strides == ember_core::tensor::contiguous_strides(&v.shape)
            })
            .map(|p| (p.output, p.input))
            .collect();
        let mut out_bufs = Vec::new();
        let mut out_addrs = Vec::new();
        for (k, (o, shape)) in outputs.iter().zip(&out_shapes).enumerate() {
            if &o.shape != shape {
                return Err(Error::Input(format!(
                    "output buffer of shape {:?}, the program writes {shape:?}",
                    o.shape
                )));
            }
            match in_place.get(&k) {
                Some(&j) => out_addrs.push(in_addrs[j]),
                None => {
                    let buf = self.device.alloc(bytes_of(shape, o.dtype).max(1))?;
                    out_addrs.push(buf.addr());
                    out_bufs.push(buf);
                }
            }
        }
        self.run_on_device(&shapes, &in_addrs, &out_addrs, 0)?;
        for (o, &addr) in outputs.iter().zip(&out_addrs) {
            let n = bytes_of(&o.shape, o.dtype);
            // SAFETY: the caller's output is valid for writes of its full size.
            let dst = unsafe { std::slice::from_raw_parts_mut(o.ptr, n) };
            self.device.download(addr, dst)?;
        }
        drop(out_bufs);
        Ok(())
    }
}

/// Times runs of a program on device copies of its inputs, through `run_on_device` (the
/// recorded path torch tensors take), by the device's clock: what the optimizer measures.
struct ProgramTimer<'a, D: Device> {
    program: &'a Program<D>,
    shapes: Vec<Vec<usize>>,
    inputs: Vec<Box<dyn DeviceBuffer>>,
    outputs: Vec<Box<dyn DeviceBuffer>>,
}

/// The stream timed runs go to (the legacy default stream: the optimizer's programs are its
/// own, and nothing else runs on them).
const TIMING_STREAM: u64 = 0;

impl<'a, D: Device> ProgramTimer<'a, D> {
    fn new(program: &'a Program<D>, inputs: &[TensorView]) -> Result<Self> {
        let shapes: Vec<Vec<usize>> = inputs.iter().map(|v| v.shape.clone()).collect();
        let out_shapes = program.output_shapes(&shapes)?;
        let device = &program.device;
        let mut bufs = Vec::new();
        for v in inputs {
            let bytes = contiguous_bytes(v);
            let buf = device.alloc(bytes.len().max(1))?;
            device.upload(buf.addr(), &bytes)?;
            bufs.push(buf);
        }
        let outputs = out_shapes
            .iter()
            .zip(&program.kp.graph.outputs)
            .map(|(shape, &o)| {
                let dtype = program.kp.graph.ty(o).dtype;
                device.alloc(bytes_of(shape, dtype).max(1))
            })
            .collect::<Result<Vec<_>>>()?;
        let timer = ProgramTimer {
            program,
            shapes,
            inputs: bufs,
            outputs,
        };
        // Untimed: these buffers are new to the recording (patched in once), and the first
        // run of a bucket records it.
        timer.launch()?;
        Ok(timer)
    }

    fn launch(&self) -> Result<()> {
        let addrs = |b: &[Box<dyn DeviceBuffer>]| b.iter().map(|b| b.addr()).collect::<Vec<_>>();
        self.program.run_on_device(
            &self.shapes,
            &addrs(&self.inputs),
            &addrs(&self.outputs),
            TIMING_STREAM,
        )
    }
}

impl<D: Device> DeviceTimer for ProgramTimer<'_, D> {
    fn run(&mut self) -> Result<f64> {
        let device = &self.program.device;
        let start = device.mark(TIMING_STREAM)?;
        self.launch()?;
        let end = device.mark(TIMING_STREAM)?;
        device.seconds_between(&start, &end)
    }
}

impl<D: Device> Drop for ProgramTimer<'_, D> {
    fn drop(&mut self) {
        // The buffers must outlive the runs queued on them.
        let _ = self.program.device.synchronize();
    }
}
