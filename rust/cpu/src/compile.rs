//! Compilation: weights and constants are bound once (no copy unless misaligned), each node's
//! last use is found for freeing buffers early, and the concrete shapes of every node are
//! resolved once per input-shape signature and cached.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use half::{bf16, f16};

use ember_core::backend::Weights;
use ember_core::dtype::DType;
use ember_core::ir::{Graph, Op};
use ember_core::shapes::resolve;
use ember_core::tensor::Storage as HostStorage;
use ember_core::{Error, Result};

use crate::buffer::Val;
use crate::fuse::{Fusion, Role};
use crate::kernels::integer_dot::PreparedRight;
use crate::kernels::movement::{bind_bytes, permute, scalar};
use crate::kernels::sgemm::{self, Packed};

/// Kernel names of the CPU backend's lowering choices (see `CpuBackend::lowering_rules`).
pub const KERNEL_ROWWISE: &str = "cpu.rowwise";
pub const KERNEL_PACKED: &str = "cpu.packed";

/// Signatures kept before the cache is cleared (bounds memory under many dynamic shapes).
const MAX_PLANS: usize = 256;

/// Concrete facts about one call's shapes.
pub struct Plan {
    pub shapes: Vec<Vec<usize>>,
    /// (start, end) of every `Slice` node (zeros elsewhere).
    pub slices: Vec<(i64, i64)>,
    /// Where the call runs.
    pub mode: Mode,
    /// The value of each node that reads no input and costs no arithmetic (weights,
    /// constants, a `Full`'s broadcast scalar, views of these), made once per plan: the
    /// executor skips these nodes, where each cost a step per call (a quantized CNN ran over
    /// a hundred of them, ~25 µs a call). `None` for the rest.
    pub fixed: Vec<Option<Val>>,
}

/// Where a call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The caller's thread, whose parallel loops offer chunks to the pool (`par.rs`), so no
    /// hand-off is waited for; a loop too small to pay for waking a helper runs alone.
    Caller,
    /// Products the `gemm` crate computes (f64, f16, or a CPU without AVX2/FMA), which split
    /// their work with rayon itself: inside the pool.
    Pool,
}

/// Nodes whose kernels parallelize through rayon itself, so they must run inside the pool:
/// products not on Ember's own f32 GEMM (`kernels::sgemm`, which also runs bf16 and f16
/// products, packed or not).
fn splits_with_rayon(node: &ember_core::ir::Node) -> bool {
    let gemm_crate =
        !sgemm::available() || !matches!(node.ty.dtype, DType::F32 | DType::BF16 | DType::F16);
    match node.op {
        Op::Dot => gemm_crate,
        Op::Attention { .. } => gemm_crate || node.ty.dtype == DType::F16,
        // f16 and bf16 convs compute in f32.
        Op::Conv { .. } => gemm_crate,
        _ => false,
    }
}

/// Multiply-adds below which a call of a plan that needs the pool runs on the caller's
/// thread alone: the hand-off would cost more than it saves.
const INLINE_WORK: usize = 1 << 15;

pub struct Program {
    pub graph: Graph,
    /// Values known at compile time: weights, constants, and the scalar of each `Full`.
    pub bound: Vec<Option<Val>>,
    /// Fused groups and each node's role in them.
    pub fusion: Fusion,
    /// The values each node reads when the executor runs it.
    pub reads: Vec<Vec<usize>>,
    /// The last node reading each value; `usize::MAX` for graph outputs.
    pub last_use: Vec<usize>,
    /// Weights packed into `sgemm` panels, once, here (see `kernels::sgemm`), per node: for a
    /// `Dot` whose right operand is a 2-D f32, bf16 or f16 weight, that operand, in its own
    /// type (unless the product has one row and reads the weight K-contiguous:
    /// `dot::takes_rowwise`); for an f32 `Conv` with a weight, one left operand per group.
    /// Empty elsewhere.
    pub packed: Vec<Vec<Packed>>,
    /// The right operand of each `IntegerDot` whose 2-D right operand is known at compile
    /// time, prepared once for the kernel this CPU runs (`kernels::integer_dot`); `None`
    /// elsewhere.
    pub packed_integer: Vec<Option<PreparedRight>>,
    /// Owned weight bytes we point into, kept alive with the program.
    _keep: Vec<Arc<Vec<u8>>>,
    plans: Mutex<HashMap<Vec<Vec<usize>>, Arc<Plan>>>,
}

/// A permuted weight (what `linear` feeds `dot`), bound as a view of the weight; products
/// that pack it read it so, and `copy_weights_read_unpacked` copies it contiguous for any
/// other reader.
fn permuted_weight(
    graph: &Graph,
    node: &ember_core::ir::Node,
    perm: &[usize],
    bound: &[Option<Val>],
) -> crate::error::KResult<Option<Val>> {
    let Some(&src) = node.inputs.first() else {
        return Ok(None);
    };
    let is_weight = matches!(graph.nodes[src].op, Op::Weight { .. } | Op::Constant(_));
    match (&bound[src], is_weight) {
        (Some(w), true) => Ok(Some(permute(w, perm)?)),
        _ => Ok(None),
    }
}

/// Right operands packed by a backend's compiles, by the address and layout they were
/// packed from: the measured search compiles one program per candidate, all binding the
/// same weights, and each would otherwise pack every `linear` weight again (a copy as large
/// as the weights, seconds for a billion parameters). An entry holds its source value, so
/// that address cannot be reused by another value while the entry exists.
pub struct PackedWeights {
    packed: Mutex<Packs>,
    budget: PackBudget,
}

#[derive(Default)]
struct Packs {
    by_source: HashMap<PackKey, (Val, Packed)>,
    /// Bytes of every pack made.
    bytes: usize,
}

/// Address, element size, rows, columns and strides of a packed right operand's source.
type PackKey = (usize, usize, usize, usize, isize, isize);

/// How much memory packed copies of weights may take. A packed weight speeds up products
/// of several rows (~20–30 % at 32–64 rows: the tiles read panels made once instead of
/// packing them per task) for a copy as large as the weight; a model near the size of the
/// machine's memory cannot afford the copies. Past the budget a product reads its weight
/// in place (`sgemm` packs the panels each task reaches; the same results, bit for bit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackBudget {
    /// Pack while the machine (or the process's cgroup) keeps this many bytes available
    /// after the copy.
    KeepFree(u64),
    /// Pack at most this many bytes in all.
    Total(usize),
}

impl PackBudget {
    /// `EMBER_CPU_PACK_MB` (MiB of packed copies in all; 0: none) where set, else
    /// `keep_free`; a value that is not a whole number is an error naming it (not a silent
    /// default: the user set it for a reason, a model near the size of the memory).
    pub fn from_env() -> std::result::Result<PackBudget, String> {
        let set = match std::env::var("EMBER_CPU_PACK_MB") {
            Err(std::env::VarError::NotPresent) => return Ok(PackBudget::keep_free()),
            set => set.map_err(|e| e.to_string()),
        };
        match set.as_deref().map(|v| v.trim().parse::<usize>()) {
            Ok(Ok(mib)) => Ok(PackBudget::Total(mib.saturating_mul(1 << 20))),
            _ => Err(format!(
                "EMBER_CPU_PACK_MB={}: expected a whole number of MiB for packed copies of \
                 weights (0: none)",
                set.unwrap_or_else(|e| e)
            )),
        }
    }

    /// Keep an eighth of the memory (at least 1 GiB) free.
    pub fn keep_free() -> PackBudget {
        let total = crate::memory::total_bytes().unwrap_or(0);
        PackBudget::KeepFree((total / 8).max(1 << 30))
    }

    /// Whether a pack of `bytes` more fits, `packed` bytes being packed already.
    fn allows(self, packed: usize, bytes: usize) -> bool {
        match self {
            PackBudget::Total(cap) => packed.saturating_add(bytes) <= cap,
            PackBudget::KeepFree(reserve) => crate::memory::available_bytes()
                .is_none_or(|avail| avail >= reserve.saturating_add(bytes as u64)),
        }
    }
}

impl Default for PackedWeights {
    fn default() -> Self {
        PackedWeights::new(PackBudget::keep_free())
    }
}

impl PackedWeights {
    pub fn new(budget: PackBudget) -> PackedWeights {
        PackedWeights {
            packed: Mutex::new(Packs::default()),
            budget,
        }
    }

    /// `w` packed as a right operand (one copy per source, shared), or `None` where the
    /// copy would exceed the budget: the product reads `w` in place.
    fn right(&self, w: &Val) -> crate::error::KResult<Option<Packed>> {
        let (shape, strides, size) = (w.shape(), &w.layout.strides, w.dtype.size());
        if shape.len() != 2 {
            return Err(crate::error::CpuError::Internal(format!(
                "packing a weight of shape {shape:?}"
            )));
        }
        // The source's first element, whatever its type.
        let start = w
            .storage
            .ptr()
            .wrapping_offset(w.layout.offset * size as isize);
        let key = (
            start as usize,
            size,
            shape[0],
            shape[1],
            strides[0],
            strides[1],
        );
        let mut packs = self.packed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, packed)) = packs.by_source.get(&key) {
            return Ok(Some(packed.clone()));
        }
        let bytes = match w.dtype {
            DType::BF16 => Packed::b_bf16_bytes(shape[0], shape[1]),
            _ => sgemm::panels_len(shape[0], shape[1]) * size,
        };
        if !self.budget.allows(packs.bytes, bytes) {
            return Ok(None);
        }
        let packed = match w.dtype {
            // A half-precision weight keeps its type in the panels (the tiles widen it as
            // they load it): its products run the f32 GEMM's arithmetic on the same values
            // while holding as many bytes as the weight, not the twice an f32 copy took.
            // bf16 goes to a kernel of its own where the CPU has one (AMX tiles,
            // `vdpbf16ps` pair panels: `bf16_kernel`), packed in its layout.
            DType::BF16 => panels_of::<bf16>(w, Packed::b_bf16)?,
            DType::F16 => panels_of::<f16>(w, Packed::b_half)?,
            DType::F32 => panels_of::<f32>(w, Packed::b)?,
            d => {
                return Err(crate::error::CpuError::Internal(format!(
                    "packing a {d} weight"
                )))
            }
        };
        packs.bytes += packed.bytes();
        packs.by_source.insert(key, (w.clone(), packed.clone()));
        Ok(Some(packed))
    }
}

/// A 2-D weight packed as `sgemm` panels (of its own type) by `pack`.
fn panels_of<T: Copy>(
    w: &Val,
    pack: unsafe fn(usize, usize, sgemm::Strided<T>) -> Packed,
) -> crate::error::KResult<Packed> {
    let v = w.view::<T>()?;
    let src = sgemm::Strided {
        ptr: v.ptr,
        rs: v.strides[0],
        cs: v.strides[1],
    };
    // SAFETY: the view addresses the weight's rows × cols elements, alive here.
    Ok(unsafe { pack(v.shape[0], v.shape[1], src) })
}

/// The weight operands of `node` packed for `sgemm` (see `Program::packed`) when they are
/// known at compile time and the activations are not: f32 (products and convolutions) or
/// bf16/f16 (products). `None`: a product's weight left unpacked for the packing budget
/// (`PackBudget`), to be read in place.
fn pack_weight_operands(
    graph: &Graph,
    node: &ember_core::ir::Node,
    bound: &[Option<Val>],
    packs: &PackedWeights,
) -> crate::error::KResult<Option<Vec<Packed>>> {
    let half = matches!(node.ty.dtype, DType::BF16 | DType::F16);
    if !(node.ty.dtype == DType::F32 || half && node.op == Op::Dot) || !sgemm::available() {
        return Ok(Some(Vec::new()));
    }
    let (Some(&x), Some(&w)) = (node.inputs.first(), node.inputs.get(1)) else {
        return Ok(Some(Vec::new()));
    };
    let (None, Some(w)) = (&bound[x], &bound[w]) else {
        return Ok(Some(Vec::new()));
    };
    if w.dtype != node.ty.dtype {
        return Ok(Some(Vec::new()));
    }
    let (shape, strides) = (w.shape(), &w.layout.strides);
    match &node.op {
        // One-row products of a K-contiguous weight stream it row-wise unpacked
        // (`dot::takes_rowwise`): a packed copy would double its memory and be no faster.
        Op::Dot if shape.len() == 2 && strides[0] == 1 && single_row(&graph.nodes[x]) => {
            Ok(Some(Vec::new()))
        }
        Op::Dot if shape.len() == 2 => Ok(packs.right(w)?.map(|p| vec![p])),
        Op::Conv {
            stride,
            padding,
            dilation,
            groups,
            ..
        } if shape.len() >= 3 => {
            let w = w.contiguous()?;
            let v = w.view::<f32>()?;
            let (o, per_out) = (v.shape[0], v.shape[1..].iter().product::<usize>());
            let n_groups = usize::try_from(*groups).unwrap_or(0);
            if n_groups == 0
                || o % n_groups != 0
                || !crate::kernels::conv::uses_gemm(&v.shape, n_groups)
            {
                return Ok(Some(Vec::new()));
            }
            let og = o / n_groups;
            // Static shapes pick the kernel now, and with it the weight's layout.
            let params = crate::kernels::conv::Params {
                stride,
                padding,
                dilation,
                groups: *groups,
            };
            let right = match (
                static_shape(&graph.nodes[x].ty.shape),
                static_shape(&node.ty.shape),
            ) {
                (Some(xs), Some(out)) => {
                    crate::kernels::conv::packs_right(&xs, &v.shape, &out, &params)
                }
                _ => false,
            };
            Ok(Some(
                (0..n_groups)
                    .map(|g| {
                        let ptr = v.ptr.wrapping_add(g * og * per_out);
                        // SAFETY: group g's og rows of per_out elements lie inside the contiguous
                        // weight, alive here (as a right operand: its transpose).
                        unsafe {
                            match right {
                                true => Packed::b(
                                    per_out,
                                    og,
                                    sgemm::Strided {
                                        ptr,
                                        rs: 1,
                                        cs: per_out as isize,
                                    },
                                ),
                                false => Packed::a(
                                    og,
                                    per_out,
                                    sgemm::Strided {
                                        ptr,
                                        rs: per_out as isize,
                                        cs: 1,
                                    },
                                ),
                            }
                        }
                    })
                    .collect(),
            ))
        }
        _ => Ok(Some(Vec::new())),
    }
}

/// The right operand of an `IntegerDot` prepared for its kernel, when it is a 2-D value
/// known at compile time and the left operand is not.
fn pack_integer_operand(
    graph: &Graph,
    node: &ember_core::ir::Node,
    bound: &[Option<Val>],
) -> crate::error::KResult<Option<PreparedRight>> {
    let (Op::IntegerDot, [x, w]) = (&node.op, node.inputs.as_slice()) else {
        return Ok(None);
    };
    let (None, Some(w)) = (&bound[*x], &bound[*w]) else {
        return Ok(None);
    };
    if w.shape().len() != 2 {
        return Ok(None);
    }
    let (k, n) = (w.shape()[0], w.shape()[1]);
    let bytes = w.to_vec::<u8>()?;
    PreparedRight::new(&bytes, (k, n), w.dtype, graph.nodes[*x].ty.dtype).map(Some)
}

/// Whether a product's left operand is known to have one row (`[1, K]`).
fn single_row(left: &ember_core::ir::Node) -> bool {
    let shape = &left.ty.shape;
    shape.len() == 2 && shape[0].as_const() == Some(1)
}

/// A shape whose dims are all constants.
fn static_shape(shape: &[ember_core::dim::Dim]) -> Option<Vec<usize>> {
    shape
        .iter()
        .map(|d| match d {
            ember_core::dim::Dim::Const(v) => usize::try_from(*v).ok(),
            _ => None,
        })
        .collect()
}

/// What the compile prepared for each node's weight operand.
struct Prepared<'a> {
    packed: &'a [Vec<Packed>],
    /// Products whose weight was left unpacked for the packing budget.
    over_budget: &'a [bool],
    packed_integer: &'a [Option<PreparedRight>],
}

/// A permuted weight (`permuted_weight`) that some node reads other than as a packed
/// product's prepared right operand is copied contiguous, once, here: GEMM on a contiguous
/// right-hand side is markedly faster for the skinny shapes of inference (measured 1.4–1.9×
/// for M ≤ 64). One only packed and row-wise products (one-row products among them) read
/// stays a view: the program holds no third copy of a `linear` weight, and compiling makes
/// none (the packing reads the weight in place). So does one read by products over the
/// packing budget: the copy is what the budget forbade.
fn copy_weights_read_unpacked(
    graph: &Graph,
    prepared: &Prepared,
    bound: &mut [Option<Val>],
) -> crate::error::KResult<()> {
    let Prepared {
        packed,
        over_budget,
        packed_integer,
    } = prepared;
    for (id, node) in graph.nodes.iter().enumerate() {
        let is_permute = match &node.op {
            Op::Permute { .. } => true,
            Op::Kernel { name, base } => {
                name == KERNEL_PACKED && matches!(base.as_ref(), Op::Permute { .. })
            }
            _ => false,
        };
        // Bound only where it permutes a bound weight (`permuted_weight`).
        if !is_permute || bound[id].is_none() {
            continue;
        }
        let only_packed_readers = !graph.outputs.contains(&id)
            && graph.nodes.iter().enumerate().all(|(u, user)| {
                let right_only = user.inputs.len() == 2 && user.inputs[0] != id;
                !user.inputs.contains(&id)
                    || (user.op == Op::Dot
                        && right_only
                        && (packed[u].len() == 1
                            || over_budget[u]
                            || single_row(&graph.nodes[user.inputs[0]])))
                    || (is_rowwise(&user.op) && right_only)
                    || (user.op == Op::IntegerDot && right_only && packed_integer[u].is_some())
            });
        if !only_packed_readers {
            bound[id] = bound[id].as_ref().map(Val::contiguous).transpose()?;
        }
    }
    Ok(())
}

/// A product on the row-wise kernel, which reads its right operand's K contiguous: a
/// `linear` weight's permuted view is that already, and a contiguous copy is the layout
/// it would have to transpose back on every call.
fn is_rowwise(op: &Op) -> bool {
    matches!(op, Op::Kernel { name, base } if name == KERNEL_ROWWISE && matches!(base.as_ref(), Op::Dot))
}

fn compile_err(node: &ember_core::ir::Node, msg: impl std::fmt::Display) -> Error {
    Error::Compile(format!(
        "{msg} (op {}, node '{}')",
        node.op.name(),
        node.origin
    ))
}

impl Program {
    /// The program of `graph`, its weights' packed copies taken from (and added to) `packs`.
    pub fn new(
        graph: &Graph,
        weights: &Weights,
        fuse: bool,
        packs: &PackedWeights,
    ) -> Result<Program> {
        let rewritten = crate::grouped_attention::read_shared_heads(graph)?;
        let graph = crate::fold::fold_weights(rewritten.as_ref().unwrap_or(graph), weights);
        let mut bound = Vec::with_capacity(graph.nodes.len());
        let mut keep = Vec::new();
        for node in &graph.nodes {
            let dtype = node.ty.dtype;
            let val = match &node.op {
                Op::Weight { name } => {
                    let w = weights
                        .get(name)
                        .ok_or_else(|| compile_err(node, format!("weight '{name}' is missing")))?;
                    let want: Vec<Option<i64>> =
                        node.ty.shape.iter().map(|d| d.as_const()).collect();
                    let have: Vec<Option<i64>> = w.shape.iter().map(|&d| Some(d as i64)).collect();
                    if w.dtype != dtype || want != have {
                        return Err(compile_err(
                            node,
                            format!(
                                "weight '{name}' is {}{:?}, the graph expects {:?}",
                                w.dtype, w.shape, node.ty
                            ),
                        ));
                    }
                    if let HostStorage::Owned(bytes) = &w.storage {
                        keep.push(bytes.clone());
                    }
                    Some(
                        bind_bytes(dtype, &w.shape, w.bytes(), false)
                            .map_err(|e| compile_err(node, e))?,
                    )
                }
                Op::Constant(c) => Some(
                    bind_bytes(dtype, &c.shape, &c.bytes, false)
                        .map_err(|e| compile_err(node, e))?,
                ),
                Op::Full { value } => {
                    Some(scalar(dtype, *value).map_err(|e| compile_err(node, e))?)
                }
                Op::Permute { perm } => {
                    permuted_weight(&graph, node, perm, &bound).map_err(|e| compile_err(node, e))?
                }
                Op::Kernel { name, base } => match (name.as_str(), base.as_ref()) {
                    (KERNEL_PACKED, Op::Permute { perm }) => {
                        permuted_weight(&graph, node, perm, &bound)
                            .map_err(|e| compile_err(node, e))?
                    }
                    (KERNEL_ROWWISE, Op::Dot)
                        if matches!(dtype, DType::F32 | DType::BF16 | DType::F16) =>
                    {
                        None
                    }
                    _ => {
                        return Err(compile_err(
                            node,
                            format!("the CPU backend has no kernel '{name}' for {}", base.name()),
                        ))
                    }
                },
                _ => None,
            };
            bound.push(val);
        }
        for (id, node) in graph.nodes.iter().enumerate() {
            if node.inputs.iter().any(|&i| i >= id) {
                return Err(compile_err(node, "graph is not in topological order"));
            }
        }
        for &o in &graph.outputs {
            if o >= graph.nodes.len() {
                return Err(Error::Compile(format!("output %{o} does not exist")));
            }
        }
        // Products of one weight share its packed copy (see `Packed`), or all read it in
        // place (`None`: over the packing budget).
        let mut packed_by_weight: HashMap<usize, Option<Vec<Packed>>> = HashMap::new();
        let mut packed = Vec::with_capacity(graph.nodes.len());
        let mut over_budget = Vec::with_capacity(graph.nodes.len());
        for node in &graph.nodes {
            let shared = matches!(node.op, Op::Dot)
                .then(|| node.inputs.get(1))
                .flatten();
            let packs = match shared.and_then(|w| packed_by_weight.get(w)) {
                Some(p) => p.clone(),
                None => pack_weight_operands(&graph, node, &bound, packs)
                    .map_err(|e| Error::Compile(e.to_string()))?,
            };
            if let (Some(&w), false) = (shared, packs.as_ref().is_some_and(Vec::is_empty)) {
                packed_by_weight.insert(w, packs.clone());
            }
            over_budget.push(packs.is_none());
            packed.push(packs.unwrap_or_default());
        }
        let packed_integer = graph
            .nodes
            .iter()
            .map(|node| pack_integer_operand(&graph, node, &bound))
            .collect::<crate::error::KResult<Vec<_>>>()
            .map_err(|e| Error::Compile(e.to_string()))?;
        let prepared = Prepared {
            packed: &packed,
            over_budget: &over_budget,
            packed_integer: &packed_integer,
        };
        copy_weights_read_unpacked(&graph, &prepared, &mut bound)
            .map_err(|e| Error::Compile(e.to_string()))?;
        let fusion = Fusion::plan(&graph, fuse);
        let reads: Vec<Vec<usize>> = (0..graph.nodes.len())
            .map(|id| fusion.reads(&graph, id))
            .collect();
        let mut last_use = vec![0; graph.nodes.len()];
        for (id, r) in reads.iter().enumerate() {
            for &i in r {
                last_use[i] = id;
            }
        }
        for &o in &graph.outputs {
            last_use[o] = usize::MAX;
        }
        Ok(Program {
            graph,
            bound,
            fusion,
            reads,
            last_use,
            packed,
            packed_integer,
            _keep: keep,
            plans: Mutex::new(HashMap::new()),
        })
    }

    /// The plan for inputs of these shapes (cached).
    pub fn plan(&self, input_shapes: &[Vec<usize>]) -> Result<Arc<Plan>> {
        if let Some(p) = self.lock().get(input_shapes) {
            return Ok(p.clone());
        }
        let resolved = resolve(&self.graph, input_shapes)?;
        let mut slices = vec![(0, 0); self.graph.nodes.len()];
        for (id, node) in self.graph.nodes.iter().enumerate() {
            if let Op::Slice { start, end, .. } = &node.op {
                slices[id] = (resolved.dim(start)?, resolved.dim(end)?);
            }
        }
        let pool = self.graph.nodes.iter().any(splits_with_rayon);
        let work = || -> usize {
            self.graph
                .nodes
                .iter()
                .zip(&resolved.shapes)
                .map(|(node, shape)| {
                    let n: usize = shape.iter().product();
                    match (&node.op, node.inputs.first()) {
                        // M·N outputs, K multiply-adds each.
                        (Op::Dot, Some(&a)) => n * resolved.shapes[a].last().copied().unwrap_or(1),
                        _ => n,
                    }
                })
                .fold(0usize, usize::saturating_add)
        };
        let mode = if pool && work() >= INLINE_WORK {
            Mode::Pool
        } else {
            Mode::Caller
        };
        let mut plan = Plan {
            shapes: resolved.shapes,
            slices,
            mode,
            fixed: Vec::new(),
        };
        plan.fixed = self.fixed_values(&plan);
        let plan = Arc::new(plan);
        let mut plans = self.lock();
        if plans.len() >= MAX_PLANS {
            plans.clear();
        }
        plans.insert(input_shapes.to_vec(), plan.clone());
        Ok(plan)
    }

    /// `Plan::fixed` for `plan`: sources and views of them, in graph order. A value that
    /// fails here is left to the executor (whose error names the node); a view that had to
    /// copy more than a folded constant may hold is left to run per call, so a plan never
    /// keeps a second copy of a large weight.
    fn fixed_values(&self, plan: &Plan) -> Vec<Option<Val>> {
        let g = &self.graph;
        let mut fixed: Vec<Option<Val>> = vec![None; g.nodes.len()];
        for (id, node) in g.nodes.iter().enumerate() {
            // Bound at compile time (weights, constants, a `Full`'s scalar, a pre-packed
            // permute) or a source (`Iota`), or a view of fixed values.
            let known = self.bound[id].is_some()
                || node.inputs.is_empty() && !matches!(node.op, Op::Input { .. });
            let view_of_fixed =
                node.op.is_view() && node.inputs.iter().all(|&i| fixed[i].is_some());
            if !(known || view_of_fixed) || self.fusion.role[id] != Role::Plain {
                continue;
            }
            let Ok(val) = crate::exec::eval(self, plan, id, node, &fixed, 1) else {
                continue;
            };
            let shares_storage = node
                .inputs
                .iter()
                .filter_map(|&i| fixed[i].as_ref())
                .any(|v| Arc::ptr_eq(&v.storage, &val.storage));
            let small = val.numel() as i64 <= ember_core::backend::MAX_FOLDED_ELEMS;
            if known || shares_storage || small {
                fixed[id] = Some(val);
            }
        }
        fixed
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Vec<Vec<usize>>, Arc<Plan>>> {
        // A poisoned lock only means another call panicked mid-insert; the map is still valid.
        self.plans.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_core::dim::Dim;
    use ember_core::ir::TensorType;
    use ember_core::tensor::HostTensor;

    fn ty(shape: &[usize]) -> TensorType {
        TensorType::new(DType::F32, shape.iter().map(|&d| Dim::from(d)).collect())
    }

    /// `y = x @ wᵀ` (a `linear`, `x` [2, k], `w` [n, k] holding 0, 1, 2, …): the graph, its
    /// weights, and the nodes of `wᵀ` and `y`.
    fn linear(k: usize, n: usize) -> (Graph, Weights, usize, usize) {
        linear_of_rows(2, k, n)
    }

    /// `linear` with `rows` rows of input.
    fn linear_of_rows(rows: usize, k: usize, n: usize) -> (Graph, Weights, usize, usize) {
        let bytes: Vec<u8> = (0..n * k).flat_map(|i| (i as f32).to_le_bytes()).collect();
        linear_of_type(DType::F32, rows, k, n, bytes)
    }

    /// `linear` in `dtype`, its weight's bytes given.
    fn linear_of_type(
        dtype: DType,
        rows: usize,
        k: usize,
        n: usize,
        bytes: Vec<u8>,
    ) -> (Graph, Weights, usize, usize) {
        let ty =
            |shape: &[usize]| TensorType::new(dtype, shape.iter().map(|&d| Dim::from(d)).collect());
        let mut g = Graph::new();
        let x = g
            .add_source(Op::Input { index: 0 }, ty(&[rows, k]), "x")
            .unwrap();
        let w = g
            .add_source(Op::Weight { name: "w".into() }, ty(&[n, k]), "w")
            .unwrap();
        let wt = g.add(Op::Permute { perm: vec![1, 0] }, &[w], "wt").unwrap();
        let y = g.add(Op::Dot, &[x, wt], "y").unwrap();
        g.outputs = vec![y];
        let mut weights = Weights::new();
        weights.insert(
            "w".into(),
            HostTensor::owned(dtype, vec![n, k], bytes).unwrap(),
        );
        (g, weights, wt, y)
    }

    /// A bf16 or f16 `linear` of several rows packs its weight in its own type: panels of
    /// the weight's bytes (columns padded to whole panels), not an f32 copy twice that.
    #[test]
    fn a_half_precision_weight_is_packed_in_its_own_type() {
        if !sgemm::available() {
            return;
        }
        let (rows, k, n) = (4, 24, 40);
        for dtype in [DType::BF16, DType::F16] {
            // Any finite values: only what is packed, and its size, is checked.
            let (g, weights, _, y) = linear_of_type(dtype, rows, k, n, vec![0x3c; n * k * 2]);
            let prog = Program::new(&g, &weights, true, &PackedWeights::default()).unwrap();
            assert_eq!(
                prog.packed[y].len(),
                1,
                "{dtype}: the weight operand is packed"
            );
            let packed = &prog.packed[y][0];
            // bf16 kernels of their own (where the CPU has one) pad k to whole steps: 32
            // for AMX tiles, pairs for `vdpbf16ps` panels of 32 columns.
            #[cfg(target_arch = "x86_64")]
            {
                use crate::kernels::bf16_kernel::Bf16Kernel;
                let kernel = match dtype {
                    DType::BF16 => Bf16Kernel::of_this_cpu(),
                    _ => None,
                };
                let (steps, cols) = match kernel {
                    Some(Bf16Kernel::Amx) => (k.next_multiple_of(32), n.next_multiple_of(16)),
                    Some(Bf16Kernel::Pairs) => (k.next_multiple_of(2), n.next_multiple_of(32)),
                    None => (k, n.next_multiple_of(sgemm::NR)),
                };
                assert_eq!(packed.bytes(), steps * cols * 2, "{dtype}: {kernel:?}");
                assert_eq!(
                    packed.bf16_packing().map(|p| p.kernel()),
                    kernel,
                    "{dtype}: a bf16 kernel's packing for bf16 only, where the CPU has one"
                );
            }
            #[cfg(not(target_arch = "x86_64"))]
            assert_eq!(
                packed.bytes(),
                k * n.next_multiple_of(sgemm::NR) * 2,
                "{dtype}"
            );
        }
    }

    /// Past the packing budget a product reads its weight in place: no packed copy, no
    /// contiguous copy of the transposed view either, and the outputs of the packed
    /// program, bit for bit (f32, bf16 and f16; 1 and 2 threads). The values' sums are
    /// exact in f32 in any order, so AMX's or `vdpbf16ps`'s order (bf16 where the CPU has
    /// them) agrees too.
    #[test]
    fn a_weight_over_the_packing_budget_is_read_in_place() {
        use half::{bf16, f16};
        if !sgemm::available() {
            return;
        }
        fn check<T: Copy + Default + PartialEq + std::fmt::Debug>(
            dtype: DType,
            from_f32: fn(f32) -> T,
        ) {
            let (rows, k, n) = (9, 300, 40);
            let value = |i: usize| ((i * 7) % 13) as f32 * 0.125 - 0.75;
            let w: Vec<T> = (0..n * k).map(|i| from_f32(value(i))).collect();
            // SAFETY: plain values viewed as their bytes.
            let bytes = unsafe {
                std::slice::from_raw_parts(w.as_ptr() as *const u8, std::mem::size_of_val(&w[..]))
            };
            let (g, weights, wt, y) = linear_of_type(dtype, rows, k, n, bytes.to_vec());
            let none = PackedWeights::new(PackBudget::Total(0));
            let prog = Program::new(&g, &weights, true, &none).unwrap();
            assert!(prog.packed[y].is_empty(), "{dtype}: not packed");
            let view = prog.bound[wt].as_ref().expect("the permute stays bound");
            assert_eq!(view.layout.strides, vec![1, k as isize], "{dtype}: a view");
            let xs: Vec<T> = (0..rows * k).map(|i| from_f32(value(i + 5))).collect();
            for threads in [1, 2] {
                let run = |budget: PackBudget| {
                    let backend = crate::CpuBackend::new(threads).with_pack_budget(budget);
                    run_linear_on(&backend, &g, &weights, dtype, &xs, (rows, k, n))
                };
                let (in_place, packed) = (
                    run(PackBudget::Total(0)),
                    run(PackBudget::Total(usize::MAX)),
                );
                assert_eq!(in_place, packed, "{dtype}, {threads} threads");
            }
        }
        check::<f32>(DType::F32, |v| v);
        check::<bf16>(DType::BF16, bf16::from_f32);
        check::<f16>(DType::F16, f16::from_f32);
    }

    /// `x @ wᵀ` (a `linear`): the weight is packed once, from the weight itself, and no
    /// transposed copy is made (the permute stays a view of the weight).
    #[test]
    fn a_packed_linear_weight_keeps_no_transposed_copy() {
        if !sgemm::available() {
            return;
        }
        let (k, n) = (5, 3);
        let (g, weights, wt, y) = linear(k, n);
        let prog = Program::new(&g, &weights, true, &PackedWeights::default()).unwrap();
        assert_eq!(prog.packed[y].len(), 1, "the weight operand is packed");
        let view = prog.bound[wt].as_ref().expect("the permute stays bound");
        assert_eq!(
            view.layout.strides,
            vec![1, k as isize],
            "a view, not a contiguous copy"
        );
    }

    /// `g` (one input `[rows, k]`, one output `[rows, n]`, both `dtype`) compiled by a
    /// backend of `threads` and run once on `xs`.
    fn run_linear<T: Copy + Default>(
        g: &Graph,
        weights: &Weights,
        dtype: DType,
        threads: usize,
        xs: &[T],
        (rows, k, n): (usize, usize, usize),
    ) -> Vec<T> {
        let backend = crate::CpuBackend::new(threads);
        run_linear_on(&backend, g, weights, dtype, xs, (rows, k, n))
    }

    /// `run_linear` on `backend`.
    fn run_linear_on<T: Copy + Default>(
        backend: &crate::CpuBackend,
        g: &Graph,
        weights: &Weights,
        dtype: DType,
        xs: &[T],
        (rows, k, n): (usize, usize, usize),
    ) -> Vec<T> {
        use ember_core::backend::Backend;
        use ember_core::tensor::{contiguous_strides, TensorOut, TensorView};
        assert_eq!(xs.len(), rows * k);
        let mut got = vec![T::default(); rows * n];
        let exe = backend.compile(g, weights).unwrap();
        let input = TensorView {
            ptr: xs.as_ptr() as *const u8,
            dtype,
            shape: vec![rows, k],
            strides: contiguous_strides(&[rows, k]),
        };
        let out = TensorOut {
            ptr: got.as_mut_ptr() as *mut u8,
            dtype,
            shape: vec![rows, n],
        };
        // SAFETY: the buffers are live and of the declared sizes.
        unsafe { exe.run(&[input], &[out]).unwrap() };
        got
    }

    /// A one-row `linear` (decode) keeps its weight as it is stored: not packed, not
    /// copied, its rows streamed by the row-wise kernel; and the product is right.
    #[test]
    fn a_one_row_linear_reads_its_weight_unpacked() {
        let (k, n) = (37, 11);
        let (g, weights, wt, y) = linear_of_rows(1, k, n);
        let prog = Program::new(&g, &weights, true, &PackedWeights::default()).unwrap();
        assert!(prog.packed[y].is_empty(), "not packed");
        let view = prog.bound[wt].as_ref().expect("the permute stays bound");
        assert_eq!(
            view.layout.strides,
            vec![1, k as isize],
            "a view, not a copy"
        );
        let xs: Vec<f32> = (0..k).map(|i| (i as f32 - 10.0) * 0.25).collect();
        let got = run_linear(&g, &weights, DType::F32, 2, &xs, (1, k, n));
        for (j, &g) in got.iter().enumerate() {
            // The fixture's weight element (j, i) is j·k + i.
            let want: f64 = (0..k).map(|i| xs[i] as f64 * (j * k + i) as f64).sum();
            assert!(
                (g as f64 - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{j}: {g} vs {want}"
            );
        }
    }

    /// A bf16 `linear` weight is packed once, widened to f32, for products of several rows
    /// (a call used to widen the whole weight), and left as stored for one row; both
    /// products match a reference summed in f64 to bf16 rounding.
    #[test]
    fn a_bf16_linear_weight_is_packed_widened_for_rows_and_streamed_for_one() {
        use half::bf16;
        if !sgemm::available() {
            return;
        }
        let (k, n) = (40, 19);
        let w_vals: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7) % 13) as f32 * 0.125 - 0.75)
            .collect();
        for rows in [1, 5] {
            let bf16_ty = |s: &[usize]| {
                TensorType::new(DType::BF16, s.iter().map(|&d| Dim::from(d)).collect())
            };
            let mut g = Graph::new();
            let x = g
                .add_source(Op::Input { index: 0 }, bf16_ty(&[rows, k]), "x")
                .unwrap();
            let w = g
                .add_source(Op::Weight { name: "w".into() }, bf16_ty(&[n, k]), "w")
                .unwrap();
            let wt = g.add(Op::Permute { perm: vec![1, 0] }, &[w], "wt").unwrap();
            let y = g.add(Op::Dot, &[x, wt], "y").unwrap();
            g.outputs = vec![y];
            let bytes: Vec<u8> = w_vals
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect();
            let mut weights = Weights::new();
            weights.insert(
                "w".into(),
                HostTensor::owned(DType::BF16, vec![n, k], bytes).unwrap(),
            );
            let prog = Program::new(&g, &weights, true, &PackedWeights::default()).unwrap();
            assert_eq!(prog.packed[y].len(), usize::from(rows > 1), "{rows} rows");
            let xs: Vec<bf16> = (0..rows * k)
                .map(|i| bf16::from_f32((i % 11) as f32 * 0.25 - 1.0))
                .collect();
            let got = run_linear(&g, &weights, DType::BF16, 2, &xs, (rows, k, n));
            for r in 0..rows {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|i| xs[r * k + i].to_f64() * w_vals[j * k + i] as f64)
                        .sum();
                    let got = got[r * n + j].to_f64();
                    assert!(
                        (got - want).abs() <= 1e-2 * want.abs().max(1.0),
                        "{rows} rows, ({r}, {j}): {got} vs {want}"
                    );
                }
            }
        }
    }

    /// A permuted weight read by a product on the row-wise kernel stays a view: that
    /// kernel reads K contiguous, which a contiguous copy of the permute would not have.
    #[test]
    fn a_weight_read_by_the_rowwise_kernel_is_not_copied() {
        let (k, n) = (9, 10);
        let (mut g, weights, wt, y) = linear(k, n);
        g.nodes[y].op = Op::Kernel {
            name: KERNEL_ROWWISE.into(),
            base: Box::new(Op::Dot),
        };
        let prog = Program::new(&g, &weights, true, &PackedWeights::default()).unwrap();
        let view = prog.bound[wt].as_ref().expect("the permute stays bound");
        assert_eq!(
            view.layout.strides,
            vec![1, k as isize],
            "a view, not a copy"
        );
    }

    /// A permuted weight that a node other than a packed product reads (here the graph's
    /// output) is copied contiguous once, at compile time.
    #[test]
    fn a_permuted_weight_read_unpacked_is_copied_contiguous() {
        let (k, n) = (9, 10);
        let (mut g, weights, wt, y) = linear(k, n);
        g.outputs = vec![y, wt];
        let prog = Program::new(&g, &weights, true, &PackedWeights::default()).unwrap();
        let copy = prog.bound[wt].as_ref().expect("the permute stays bound");
        assert!(copy.layout.is_contiguous(), "{:?}", copy.layout);
        let got = copy.to_vec::<f32>().unwrap();
        let want: Vec<f32> = (0..k)
            .flat_map(|i| (0..n).map(move |j| (j * k + i) as f32))
            .collect();
        assert_eq!(got, want);
    }

    /// A direction of stacked weights (`w[1]`, as an LSTM's `[dirs, 4H, I]`), reshaped and
    /// transposed into a product: folded into a constant at compile time and packed, and
    /// the product still right.
    #[test]
    fn a_weight_sliced_reshaped_and_transposed_into_a_product_is_packed() {
        if !sgemm::available() {
            return;
        }
        let (k, n) = (5, 3);
        let mut g = Graph::new();
        let x = g
            .add_source(Op::Input { index: 0 }, ty(&[2, k]), "x")
            .unwrap();
        let w = g
            .add_source(Op::Weight { name: "w".into() }, ty(&[2, n, k]), "w")
            .unwrap();
        let slice = Op::Slice {
            axis: 0,
            start: Dim::from(1usize),
            end: Dim::from(2usize),
            step: 1,
        };
        let one = g.add(slice, &[w], "w1").unwrap();
        let shape = vec![Dim::from(n), Dim::from(k)];
        let flat = g.add(Op::Reshape { shape }, &[one], "w1r").unwrap();
        let wt = g
            .add(Op::Permute { perm: vec![1, 0] }, &[flat], "wt")
            .unwrap();
        let y = g.add(Op::Dot, &[x, wt], "y").unwrap();
        g.outputs = vec![y];
        let w_vals: Vec<f32> = (0..2 * n * k).map(|i| i as f32 * 0.5 - 3.0).collect();
        let bytes: Vec<u8> = w_vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut weights = Weights::new();
        weights.insert(
            "w".into(),
            HostTensor::owned(DType::F32, vec![2, n, k], bytes).unwrap(),
        );
        let prog = Program::new(&g, &weights, true, &PackedWeights::default()).unwrap();
        let dot = prog.graph.outputs[0];
        assert_eq!(prog.packed[dot].len(), 1, "the weight operand is packed");
        let xs: Vec<f32> = (0..2 * k).map(|i| i as f32 - 4.0).collect();
        let got = run_linear(&g, &weights, DType::F32, 1, &xs, (2, k, n));
        for r in 0..2 {
            for c in 0..n {
                let want: f32 = (0..k)
                    .map(|i| xs[r * k + i] * w_vals[(n + c) * k + i])
                    .sum();
                assert!(
                    (got[r * n + c] - want).abs() < 1e-4,
                    "{r},{c}: {} vs {want}",
                    got[r * n + c]
                );
            }
        }
    }

    /// Two products of one weight (an unrolled recurrent layer's steps) share one packed
    /// copy, which stays in cache from one step to the next.
    #[test]
    fn products_of_one_weight_share_its_packed_copy() {
        if !sgemm::available() {
            return;
        }
        let (k, n) = (5, 3);
        let mut g = Graph::new();
        let x = g
            .add_source(Op::Input { index: 0 }, ty(&[2, k]), "x")
            .unwrap();
        let w = g
            .add_source(Op::Weight { name: "w".into() }, ty(&[n, k]), "w")
            .unwrap();
        let wt = g.add(Op::Permute { perm: vec![1, 0] }, &[w], "wt").unwrap();
        let y1 = g.add(Op::Dot, &[x, wt], "y1").unwrap();
        let y2 = g.add(Op::Dot, &[x, wt], "y2").unwrap();
        g.outputs = vec![y1, y2];
        let bytes: Vec<u8> = (0..n * k).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let mut weights = Weights::new();
        weights.insert(
            "w".into(),
            HostTensor::owned(DType::F32, vec![n, k], bytes).unwrap(),
        );
        let prog = Program::new(&g, &weights, false, &PackedWeights::default()).unwrap();
        let (a, b) = (&prog.packed[y1], &prog.packed[y2]);
        assert_eq!((a.len(), b.len()), (1, 1), "both operands packed");
        assert!(a[0].shares_panels_with(&b[0]), "one copy");
    }

    /// Programs compiled with one `PackedWeights` (the search's candidates) share a weight's
    /// packed copy instead of packing it again.
    #[test]
    fn compiles_sharing_packs_pack_a_weight_once() {
        if !sgemm::available() {
            return;
        }
        let (k, n) = (5, 3);
        let (g, weights, _, y) = linear(k, n);
        let packs = PackedWeights::default();
        let first = Program::new(&g, &weights, true, &packs).unwrap();
        let second = Program::new(&g, &weights, false, &packs).unwrap();
        let alone = Program::new(&g, &weights, true, &PackedWeights::default()).unwrap();
        assert!(first.packed[y][0].shares_panels_with(&second.packed[y][0]));
        assert!(!first.packed[y][0].shares_panels_with(&alone.packed[y][0]));
    }

    /// Sources and views of them are made once per plan (`Plan::fixed`) and skipped by the
    /// executor; repeated calls, one of them a graph output, keep their values intact (the
    /// arena never takes a fixed value's buffer for a later node).
    #[test]
    fn fixed_values_are_made_once_and_survive_calls() {
        use ember_core::backend::Backend;
        use ember_core::ir::BinaryOp;
        use ember_core::tensor::{contiguous_strides, TensorOut, TensorView};
        let mut g = Graph::new();
        let x = g
            .add_source(Op::Input { index: 0 }, ty(&[2, 3]), "x")
            .unwrap();
        let bytes: Vec<u8> = [1.0f32, 2.0, 3.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let c = g
            .add_source(
                Op::Constant(ember_core::ir::ConstData {
                    shape: vec![3],
                    bytes: Arc::new(bytes),
                }),
                ty(&[3]),
                "c",
            )
            .unwrap();
        let dims = |v: &[usize]| v.iter().map(|&d| Dim::from(d)).collect::<Vec<_>>();
        let r = g
            .add(
                Op::Reshape {
                    shape: dims(&[1, 3]),
                },
                &[c],
                "r",
            )
            .unwrap();
        let e = g
            .add(
                Op::Expand {
                    shape: dims(&[2, 3]),
                },
                &[r],
                "e",
            )
            .unwrap();
        let y = g.add(Op::Binary(BinaryOp::Mul), &[x, e], "y").unwrap();
        let z = g.add(Op::Binary(BinaryOp::Add), &[y, x], "z").unwrap();
        g.outputs = vec![z, e];
        let prog = Program::new(&g, &Weights::new(), true, &PackedWeights::default()).unwrap();
        let plan = prog.plan(&[vec![2, 3]]).unwrap();
        let fixed: Vec<bool> = plan.fixed.iter().map(Option::is_some).collect();
        assert_eq!(fixed, [false, true, true, true, false, false]);
        let exe = crate::CpuBackend::new(2)
            .compile(&g, &Weights::new())
            .unwrap();
        for call in 0..3 {
            let xs: Vec<f32> = (0..6).map(|i| (i + call) as f32).collect();
            let (mut zs, mut es) = (vec![0f32; 6], vec![0f32; 6]);
            let view = TensorView {
                ptr: xs.as_ptr() as *const u8,
                dtype: DType::F32,
                shape: vec![2, 3],
                strides: contiguous_strides(&[2, 3]),
            };
            let out = |v: &mut Vec<f32>| TensorOut {
                ptr: v.as_mut_ptr() as *mut u8,
                dtype: DType::F32,
                shape: vec![2, 3],
            };
            let outs = [out(&mut zs), out(&mut es)];
            // SAFETY: the buffers are live and of the declared sizes.
            unsafe { exe.run(&[view], &outs).unwrap() };
            let want: Vec<f32> = xs
                .iter()
                .enumerate()
                .map(|(i, &v)| v * (1 + i % 3) as f32 + v)
                .collect();
            assert_eq!(zs, want, "call {call}");
            assert_eq!(es, [1.0, 2.0, 3.0, 1.0, 2.0, 3.0], "call {call}");
        }
    }
}
