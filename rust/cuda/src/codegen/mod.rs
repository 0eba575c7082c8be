//! From an IR graph to a launch plan: which nodes live in memory, the generated kernels
//! (CUDA C, one translation unit per program), and the ordered steps that run them.
//!
//! This part touches no GPU: it is tested on every machine, and its kernels are compiled by
//! NVRTC in CI (`nvrtc` tests) and run on the host by the emulator (`emulate.rs`).

mod emit;
mod folded_norm;
mod kernels;
pub mod types;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use ember_core::dim::Dim;
use ember_core::dtype::DType;
use ember_core::ir::{Graph, Op};

pub use emit::DimRender;

pub const PRELUDE: &str = include_str!("prelude.cuh");

/// A node the CUDA code generator cannot handle.
#[derive(Debug)]
pub struct CodegenError {
    pub op: String,
    pub node: String,
    pub detail: String,
}

impl CodegenError {
    pub fn new(g: &Graph, node: usize, detail: impl std::fmt::Display) -> CodegenError {
        let n = &g.nodes[node];
        CodegenError {
            op: n.op.name(),
            node: n.origin.to_string(),
            detail: detail.to_string(),
        }
    }
}

impl From<CodegenError> for ember_core::Error {
    fn from(e: CodegenError) -> Self {
        ember_core::Error::UnsupportedOp {
            op: e.op,
            node: e.node,
            detail: format!(" on the CUDA backend: {}", e.detail),
        }
    }
}

/// Where a node's value lives while a program runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mem {
    /// Recomputed inside each consumer's kernel.
    Inline,
    /// The caller's input `k`.
    Input(usize),
    /// Uploaded once at compile time (weights and constants).
    Weight,
    /// Written by a step into the arena (or straight into a caller's output).
    Buffer,
}

/// How a kernel is launched, from the dims of one call.
#[derive(Clone, Debug)]
pub enum Launch {
    /// One thread per element, grid-stride over `n`.
    Elements(Dim),
    /// One block per row (grid-stride over rows), threads cooperating over `width`.
    Rows { rows: Dim, width: Dim },
}

#[derive(Clone, Debug)]
pub struct Kernel {
    pub name: String,
    /// Uses `__syncthreads`: the emulator runs its threads concurrently.
    pub cooperative: bool,
}

/// A row-major matrix product over the nodes' memory.
#[derive(Clone, Debug)]
pub struct Gemm {
    pub a: usize,
    pub b: usize,
    /// The operand's memory holds its transpose (`[.., K, M]` for `a`).
    pub trans_a: bool,
    pub trans_b: bool,
    pub batch: Dim,
    pub m: Dim,
    pub n: Dim,
    pub k: Dim,
    pub dtype: DType,
    /// A vector of `n` values added to every row as the product is written (cuBLASLt's
    /// bias epilogue): the `+ bias` of a linear layer, folded into its product.
    pub bias: Option<usize>,
    /// A tensor of the product's shape added as it is written (cuBLASLt's C, β = 1): a
    /// residual connection's `x + linear(h)`.
    pub residual: Option<usize>,
    /// The tanh-approximated GELU applied to each element last (cuBLASLt's GELU
    /// epilogue, after the bias): an MLP's `gelu(linear(x), approximate="tanh")`.
    pub gelu_tanh: bool,
}

impl Gemm {
    /// The nodes the product reads.
    pub fn reads(&self) -> Vec<usize> {
        let mut r = vec![self.a, self.b];
        r.extend(self.bias);
        r.extend(self.residual);
        r
    }
}

#[derive(Clone, Debug)]
pub enum StepKind {
    Kernel {
        kernel: usize,
        /// Nodes whose memory is passed after `meta` and the output, in signature order.
        args: Vec<usize>,
        launch: Launch,
        /// Per-block scratch floats (attention scores): `rows in flight × this`.
        scratch_per_block: Option<Dim>,
        /// Partial results the step writes and combines itself (split attention: each
        /// row's last block to finish combines the row's chunks): this many accumulator
        /// values, and this many counters (`i64`, one per row, passed as `cnt`) that the
        /// executor keeps in `meta` after the symbols' values, so that each run's upload
        /// of `meta` sets them to zero.
        partials: Option<(Dim, Dim)>,
    },
    Gemm(Gemm),
}

/// Where a step writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dest {
    Node(usize),
    Output(usize),
}

#[derive(Clone, Debug)]
pub struct Step {
    pub node: usize,
    pub dest: Dest,
    /// Further nodes the same kernel writes, and where (passed after `dest`, as `out1`,
    /// `out2`, …): products of one input summed in one launch.
    pub also: Vec<(usize, Dest)>,
    pub kind: StepKind,
}

pub struct KernelProgram {
    pub graph: Graph,
    pub symbols: Vec<Arc<str>>,
    pub mem: Vec<Mem>,
    pub kernels: Vec<Kernel>,
    /// The translation unit holding every kernel (without the prelude).
    pub source: String,
    pub steps: Vec<Step>,
    /// Outputs that may be written straight into an input's memory (a static KV cache's
    /// `index_copy_`); see `InPlace`.
    pub in_place: Vec<InPlace>,
    /// The step checking every index of the program (`Generator::index_precheck`) before
    /// the first in-place update; only needed on runs that update in place.
    pub precheck_step: Option<usize>,
}

/// A scatter into input `input`, which nothing else reads, that is program output
/// `output`. When a run is given the input's own memory as that output, its copy step
/// (`copy_step`: the input copied into the output) is skipped and only the updates are
/// written; they are gated on the index check (`precheck_step`), so a run that fails on
/// an index leaves the caller's tensor as it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InPlace {
    pub output: usize,
    pub input: usize,
    pub copy_step: usize,
}

impl KernelProgram {
    /// The full CUDA source NVRTC compiles.
    pub fn cuda_source(&self) -> String {
        format!("{PRELUDE}\n{}", self.source)
    }
}

/// The kernel choices the CUDA backend offers the optimizer for a matrix product besides
/// cuBLASLt (`CudaBackend::lowering_rules`): a warp per output element, its lanes splitting
/// the sum (a matrix-vector product over a `[N, K]` weight reads whole rows), and a thread
/// per output element (reads a `[K, N]` weight a row at a time across threads).
pub const KERNEL_WARP_DOT: &str = "cuda.warp_dot";
pub const KERNEL_THREAD_DOT: &str = "cuda.thread_dot";
/// The choice for attention of f16/bf16 (`kernels/mma_attention.rs`): prefill on tensor
/// cores (sm_80 and newer). Where its shapes do not fit, the other attention kernels run.
pub const KERNEL_MMA_ATTENTION: &str = "cuda.mma_attention";

pub use kernels::mma_attention_applies;

/// The op a node computes (a kernel choice computes its base op).
fn base_op(op: &Op) -> &Op {
    match op {
        Op::Kernel { base, .. } => base,
        op => op,
    }
}

/// Ops computed by a kernel of their own (never inlined).
fn is_heavy(op: &Op) -> bool {
    matches!(
        base_op(op),
        Op::Reduce { .. }
            | Op::Dot
            | Op::IntegerDot
            | Op::Softmax { .. }
            | Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
            | Op::Scan { .. }
            | Op::Argsort { .. }
            | Op::GroupedDot
            | Op::BlockQuantDot { .. }
            | Op::Attention { .. }
            | Op::Conv { .. }
            | Op::Pool { .. }
            | Op::Scatter { .. }
    )
}

/// Pure index remaps and constants: free to recompute in every consumer.
fn is_view(op: &Op) -> bool {
    matches!(
        op,
        Op::Reshape { .. }
            | Op::Permute { .. }
            | Op::Expand { .. }
            | Op::Slice { .. }
            | Op::Flip { .. }
            | Op::Full { .. }
            | Op::Iota { .. }
    )
}

/// Consumers that read each element of an inlined producer only a few times.
fn inlines_compute(op: &Op) -> bool {
    !matches!(
        base_op(op),
        Op::Dot
            | Op::IntegerDot
            | Op::GroupedDot
            | Op::BlockQuantDot { .. }
            | Op::Argsort { .. }
            | Op::Attention { .. }
            | Op::Conv { .. }
            | Op::Pool { .. }
    )
}

/// Whether `consumer` reads each element of its input `input` only a few times, so that
/// computing `input` inside it costs less than a launch and a round trip through memory.
/// Besides the ops that do, a decode step's attention reads its single query row once per
/// key from cache (broadcast across each warp), and the tensor-core prefill kernel reads
/// each query element once: the rotary embedding of q is computed there instead of in a
/// kernel of its own.
fn reads_few_times(g: &Graph, consumer: usize, input: usize) -> bool {
    let c = &g.nodes[consumer];
    if inlines_compute(&c.op) {
        return true;
    }
    let q = &g.nodes[input].ty.shape;
    let only_query = matches!(base_op(&c.op), Op::Attention { .. })
        && c.inputs[0] == input
        && !c.inputs[1..].contains(&input);
    let decode = one_query_row(q);
    // The tensor-core kernel reads each query element once, into its registers.
    let mma = matches!(&c.op, Op::Kernel { name, .. } if name == KERNEL_MMA_ATTENTION)
        && mma_attention_applies(g, consumer);
    only_query && (decode || mma)
}

/// Whether an attention query of this shape has at most one row per head (a decode step),
/// also where that length is symbolic: a rotary table sliced at the cache length
/// (`cos[pos : pos + 1]`) gives `min(pos + 1, n) - min(pos, n)`, which is at most 1.
pub(crate) fn one_query_row(q: &[Dim]) -> bool {
    q.len() >= 2 && q[q.len() - 2].upper_bound().is_some_and(|hi| hi <= 1)
}

fn dtype_supported(d: DType) -> bool {
    // Every dtype has a storage and compute type; listed to fail loudly if one is added.
    matches!(
        d,
        DType::Bool
            | DType::U8
            | DType::I8
            | DType::I16
            | DType::I32
            | DType::I64
            | DType::F16
            | DType::BF16
            | DType::F32
            | DType::F64
    )
}

fn unsupported(g: &Graph, node: usize, msg: impl std::fmt::Display) -> CodegenError {
    CodegenError::new(g, node, msg)
}

/// Every symbol the graph's dims name, sorted (their order in `meta`).
pub fn collect_symbols(g: &Graph) -> Vec<Arc<str>> {
    let mut set = BTreeSet::new();
    let mut buf = Vec::new();
    let mut visit = |d: &Dim| {
        buf.clear();
        d.symbols(&mut buf);
        set.extend(buf.drain(..));
    };
    for n in &g.nodes {
        n.ty.shape.iter().for_each(&mut visit);
        match &n.op {
            Op::Reshape { shape } | Op::Expand { shape } => shape.iter().for_each(&mut visit),
            Op::Slice { start, end, .. } => {
                visit(start);
                visit(end);
            }
            Op::CacheAppend { len, .. } => visit(len),
            _ => {}
        }
    }
    set.into_iter().collect()
}

/// Is `node` a permute swapping the last two axes (and nothing else)?
fn swaps_last_two(op: &Op) -> bool {
    let Op::Permute { perm } = op else {
        return false;
    };
    let r = perm.len();
    r >= 2
        && perm[r - 2] == r - 1
        && perm[r - 1] == r - 2
        && perm[..r - 2].iter().enumerate().all(|(i, &p)| i == p)
}

/// Dtypes cuBLASLt multiplies (others use a generated kernel).
pub fn gemm_dtype(d: DType) -> bool {
    matches!(d, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
}

pub fn generate(graph: &Graph) -> Result<KernelProgram, CodegenError> {
    let g = graph;
    let count = g.nodes.len();
    let mut consumers: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); count];
    for (id, n) in g.nodes.iter().enumerate() {
        if !dtype_supported(n.ty.dtype) {
            return Err(unsupported(g, id, format!("dtype {}", n.ty.dtype)));
        }
        if let Op::Kernel { name, base } = &n.op {
            let product = name == KERNEL_WARP_DOT || name == KERNEL_THREAD_DOT;
            let attention = name == KERNEL_MMA_ATTENTION;
            let fits = match **base {
                Op::Dot => product,
                Op::Attention { .. } => attention,
                _ => false,
            };
            if !fits {
                return Err(unsupported(
                    g,
                    id,
                    format!(
                        "the CUDA backend has no kernel '{name}' for {}",
                        base.name()
                    ),
                ));
            }
        }
        for &i in &n.inputs {
            if i >= id {
                return Err(unsupported(g, id, "graph is not in topological order"));
            }
            consumers[i].insert(id);
        }
    }
    let is_output: Vec<bool> = (0..count).map(|i| g.outputs.contains(&i)).collect();

    // Where values live: sources in memory, heavy ops in buffers, the rest inlined unless
    // sharing them (or a consumer that reads them many times) makes recomputing a loss.
    let mut mem = vec![Mem::Inline; count];
    for (id, n) in g.nodes.iter().enumerate() {
        mem[id] = match &n.op {
            Op::Input { index } => Mem::Input(*index),
            Op::Weight { .. } | Op::Constant(_) => Mem::Weight,
            op if is_heavy(op) => Mem::Buffer,
            op if is_view(op) => Mem::Inline,
            _ => {
                let cs = &consumers[id];
                let single = cs.len() == 1
                    && cs
                        .iter()
                        .all(|&c| !is_output[id] && reads_few_times(g, c, id));
                if single {
                    Mem::Inline
                } else {
                    Mem::Buffer
                }
            }
        };
        if is_output[id] && mem[id] == Mem::Inline {
            mem[id] = Mem::Buffer;
        }
    }
    folded_norm::keep_norm_inputs(g, &mut mem, &consumers, &is_output);
    // Matrix-product operands must be in memory: directly, through a reshape, or
    // transposed (cuBLASLt reads them transposed in place). A generated product's are too:
    // it reads each operand element once per output row or column, so recomputing an
    // operand (a gated MLP's `silu(gate) * up` under a reshape) would multiply its work,
    // and rows in memory are what its packed loads read.
    let mut gemms: HashMap<usize, GemmPlan> = HashMap::new(); // by the node its step writes
    for (id, n) in g.nodes.iter().enumerate() {
        let gemm = library_product(g, id);
        if !gemm && !is_generated_product(g, id) {
            continue;
        }
        let mut operands = [(0, false); 2];
        for (k, &x) in n.inputs.iter().enumerate() {
            operands[k] = operand_in_memory(g, &mut mem, x);
        }
        if gemm {
            let plan = GemmPlan {
                operands,
                dot: id,
                bias: None,
                residual: None,
                gelu_tanh: false,
            };
            gemms.insert(id, plan);
        }
    }
    // What a cuBLASLt step writes as it goes, each moving the step to a later node (the
    // nodes in between then need no memory): `dot + bias` with a vector broadcast along the
    // rows (the bias epilogue); then the tanh GELU of that (the GELU epilogue); or `+ r`
    // with `r` in memory (C with β = 1: a residual connection); and the end of a chain of
    // reshapes that is in memory (an output).
    let at: Vec<usize> = gemms.keys().copied().collect();
    for d in at {
        let Some((add, bias)) = bias_add(g, &mem, &consumers, &is_output, d) else {
            continue;
        };
        if let Some(plan) = move_gemm(&mut gemms, &mut mem, d, add) {
            plan.bias = Some(bias);
        }
    }
    let at: Vec<usize> = gemms.keys().copied().collect();
    for p in at {
        if let Some(act) = gelu_tanh_of(g, &consumers, &is_output, p) {
            if let Some(plan) = move_gemm(&mut gemms, &mut mem, p, act) {
                plan.gelu_tanh = true;
            }
        }
    }
    let at: Vec<usize> = gemms.keys().copied().collect();
    // A product another one adds as its C stays where it is (`x·w + y·v`: the first
    // product seen takes the second as C; the second must not move into the same add).
    let mut pinned = BTreeSet::new();
    for p in at {
        // C is added before the epilogue's activation, so not after one.
        if pinned.contains(&p) || gemms.get(&p).is_some_and(|plan| plan.gelu_tanh) {
            continue;
        }
        let Some((add, r)) = residual_add(g, &mem, &consumers, &is_output, p) else {
            continue;
        };
        if let Some(plan) = move_gemm(&mut gemms, &mut mem, p, add) {
            plan.residual = Some(r);
            pinned.insert(r);
        }
    }
    let at: Vec<usize> = gemms.keys().copied().collect();
    for p in at {
        if pinned.contains(&p) {
            continue;
        }
        if let Some(end) = stored_reshape(g, &mem, &consumers, &is_output, p) {
            move_gemm(&mut gemms, &mut mem, p, end);
        }
    }

    // A product computed by a generated kernel (the optimizer's CUDA choices, integer
    // products) applies the elementwise chain consuming it as it writes: a residual add, a
    // gated MLP's `silu(gate) * up`, an activation. The product and the chain then need no
    // memory of their own, and a decode step one launch fewer per product.
    // A chain may read several products of one shape (`silu(gate) * up`): the first takes
    // the chain, the others are summed in its kernel alongside it (same kernel choice,
    // dtype and sum length), so a gated MLP's two products are one launch.
    let mut epilogue_of: HashMap<usize, Vec<usize>> = HashMap::new(); // root → products
    for id in 0..count {
        if !is_generated_product(g, id) {
            continue;
        }
        let Some(root) = epilogue_root(g, &mem, &consumers, &is_output, id) else {
            continue;
        };
        // None ending where a cuBLASLt step writes (it may read this product as C).
        if gemms.contains_key(&root) {
            continue;
        }
        match epilogue_of.get_mut(&root) {
            None => {
                epilogue_of.insert(root, vec![id]);
            }
            Some(products) if summed_alongside(g, products[0], id) => products.push(id),
            Some(_) => continue, // stored, and read by the chain's kernel
        }
        mem[id] = Mem::Inline;
    }

    // A norm whose values flow alone through pointwise ops to a node in memory
    // (transformers' `weight * norm(x.to(f32)).to(dtype)`) writes that node as it goes:
    // one launch where there were two, and the norm itself needs no memory.
    let mut norm_epilogue: HashMap<usize, usize> = HashMap::new(); // root → norm
    for id in 0..count {
        let norm = matches!(g.nodes[id].op, Op::RmsNorm { .. } | Op::LayerNorm { .. });
        if !norm || mem[id] != Mem::Buffer {
            continue;
        }
        let Some(root) = epilogue_root(g, &mem, &consumers, &is_output, id) else {
            continue;
        };
        let taken = gemms.contains_key(&root) || epilogue_of.contains_key(&root);
        if taken || norm_epilogue.contains_key(&root) {
            continue;
        }
        norm_epilogue.insert(root, id);
        mem[id] = Mem::Inline;
    }

    // `cuda.warp_dot` products of one input that write their own values (a decode step's
    // q, k and v projections) share one launch: the warps of the step take the products'
    // outputs one after another. The step sits at the first one's place, where the input
    // is ready and no product has been read yet.
    let mut groups: HashMap<usize, Vec<usize>> = HashMap::new(); // first → members
    let mut grouped: BTreeSet<usize> = BTreeSet::new(); // members after the first
    let mut by_input: HashMap<(usize, String), usize> = HashMap::new(); // → first
    for id in 0..count {
        let n = &g.nodes[id];
        let warp = matches!(&n.op, Op::Kernel { name, .. } if name == KERNEL_WARP_DOT);
        if !warp || mem[id] != Mem::Buffer {
            continue;
        }
        let Some(a) = in_memory_through_reshape(g, &mem, n.inputs[0]) else {
            continue;
        };
        // Only weights on the right: a computed operand might be written after the first.
        if !is_weight(g, &mem, n.inputs[1]) {
            continue;
        }
        // The same memory read as the same rows, of one dtype.
        let key = (a, format!("{} {:?}", n.ty.dtype, g.ty(n.inputs[0]).shape));
        match by_input.get(&key) {
            Some(&first) => {
                groups.entry(first).or_insert_with(|| vec![first]).push(id);
                grouped.insert(id);
            }
            None => {
                by_input.insert(key, id);
            }
        }
    }

    // Norms read only as products' rows are computed by those products (after the
    // grouping above, which keys products on the rows they read).
    folded_norm::fold_norms(g, &mut mem, &consumers, &is_output);

    // Independent elementwise kernels of one shape share a launch too (a decode step's k
    // and v cache concats): a later one joins an earlier one when everything it reads from
    // memory is written before the earlier one's step (steps run in node order), so it
    // reads no member either.
    let mut elementwise_groups: HashMap<usize, Vec<usize>> = HashMap::new(); // first → all
    let mut open_group: HashMap<String, usize> = HashMap::new(); // shape → first
    for id in 0..count {
        let n = &g.nodes[id];
        let plain = mem[id] == Mem::Buffer
            && !is_heavy(&n.op)
            && !gemms.contains_key(&id)
            && !epilogue_of.contains_key(&id)
            && !norm_epilogue.contains_key(&id);
        if !plain {
            continue;
        }
        let key = format!("{:?}", n.ty.shape);
        let joins = open_group.get(&key).copied().filter(|&first| {
            let members = elementwise_groups.get(&first).map_or(1, Vec::len);
            can_join(g, &mem, id, first, members)
        });
        match joins {
            Some(first) => {
                elementwise_groups
                    .entry(first)
                    .or_insert_with(|| vec![first])
                    .push(id);
                grouped.insert(id);
            }
            None => {
                open_group.insert(key, id);
            }
        }
    }

    let symbols = collect_symbols(g);
    let in_memory: Vec<bool> = mem
        .iter()
        .map(|m| matches!(m, Mem::Input(_) | Mem::Weight | Mem::Buffer))
        .collect();

    let in_place_candidates = in_place_candidates(g, &consumers);
    let (scatter_groups, scatter_grouped) = scatter_groups(g, &mem, &in_place_candidates);

    let mut gen = kernels::Generator::new(g, &in_memory, &symbols);
    let mut steps = Vec::new();
    let mut written_outputs: Vec<bool> = vec![false; g.outputs.len()];
    let dest_of = |node: usize, written: &mut Vec<bool>| -> Dest {
        for (k, &o) in g.outputs.iter().enumerate() {
            if o == node && !written[k] {
                written[k] = true;
                return Dest::Output(k);
            }
        }
        Dest::Node(node)
    };
    for (id, n) in g.nodes.iter().enumerate() {
        if mem[id] != Mem::Buffer || grouped.contains(&id) || scatter_grouped.contains(&id) {
            continue;
        }
        let dest = dest_of(id, &mut written_outputs);
        if let Some(members) = scatter_groups.get(&id) {
            // Every member's copy, then their updates in one launch.
            let gated = in_place_candidates.contains_key(&id);
            let dests: Vec<Dest> = std::iter::once(dest)
                .chain(
                    members[1..]
                        .iter()
                        .map(|&m| dest_of(m, &mut written_outputs)),
                )
                .collect();
            for (&m, &d) in members.iter().zip(&dests) {
                let kind = gen.scatter_copy(m)?;
                steps.push(Step {
                    node: m,
                    dest: d,
                    also: Vec::new(),
                    kind,
                });
            }
            let kind = gen.scatter_writes(members, gated)?;
            steps.push(Step {
                node: id,
                dest,
                also: members[1..]
                    .iter()
                    .copied()
                    .zip(dests[1..].iter().copied())
                    .collect(),
                kind,
            });
            continue;
        }
        let several = match n.op {
            Op::Scatter { .. } => {
                Some(gen.scatter_steps(id, in_place_candidates.contains_key(&id))?)
            }
            Op::Attention { .. } | Op::Kernel { .. }
                if matches!(base_op(&n.op), Op::Attention { .. }) =>
            {
                gen.split_attention_steps(id)?
            }
            _ => None,
        };
        if let Some(kinds) = several {
            for kind in kinds {
                steps.push(Step {
                    node: id,
                    dest,
                    also: Vec::new(),
                    kind,
                });
            }
            continue;
        }
        let kind = if let Some(plan) = gemms.get(&id) {
            let dot = &g.nodes[plan.dot];
            let [(a, trans_a), (b, trans_b)] = plan.operands;
            let (ash, bsh) = (
                &g.nodes[dot.inputs[0]].ty.shape,
                &g.nodes[dot.inputs[1]].ty.shape,
            );
            let r = ash.len();
            StepKind::Gemm(Gemm {
                a,
                b,
                trans_a,
                trans_b,
                batch: ember_core::dim::numel(&ash[..r - 2]),
                m: ash[r - 2].clone(),
                k: ash[r - 1].clone(),
                n: bsh[r - 1].clone(),
                dtype: dot.ty.dtype,
                bias: plan.bias,
                residual: plan.residual,
                gelu_tanh: plan.gelu_tanh,
            })
        } else if let Some(products) = epilogue_of.get(&id) {
            gen.product_kernel(products, Some(id))?
        } else if let Some(&norm) = norm_epilogue.get(&id) {
            gen.norm_kernel(norm, Some(id))?
        } else if let Some(members) = groups.get(&id).or(elementwise_groups.get(&id)) {
            let also = members[1..]
                .iter()
                .map(|&m| (m, dest_of(m, &mut written_outputs)))
                .collect();
            let kind = match groups.contains_key(&id) {
                true => gen.grouped_warp_dot(members)?,
                false => gen.grouped_elementwise(members)?,
            };
            steps.push(Step {
                node: id,
                dest,
                also,
                kind,
            });
            continue;
        } else {
            gen.node_kernel(id)?
        };
        steps.push(Step {
            node: id,
            dest,
            also: Vec::new(),
            kind,
        });
    }
    // Outputs not written by their own step (inputs, weights, aliases, repeats) are copied.
    for (k, &o) in g.outputs.iter().enumerate() {
        if !written_outputs[k] {
            let kind = gen.copy_kernel(o)?;
            steps.push(Step {
                node: o,
                dest: Dest::Output(k),
                also: Vec::new(),
                kind,
            });
        }
    }
    let (in_place, precheck_step) =
        plan_in_place(g, &mem, &mut gen, &mut steps, &in_place_candidates)?;
    let (kernels, source) = gen.finish();
    Ok(KernelProgram {
        graph: g.clone(),
        symbols,
        mem,
        kernels,
        source,
        steps,
        in_place,
        precheck_step,
    })
}

/// Scatters whose updates share one launch (`Generator::scatter_writes`): first → all
/// members, and the members after the first. A static cache's key and value updates of a
/// layer are independent scatters of one update shape; a later one joins an earlier one
/// (both updating a caller's tensor in place, or neither) when everything it reads from
/// memory is written before the earlier one's steps, where its copy and updates then run.
fn scatter_groups(
    g: &Graph,
    mem: &[Mem],
    in_place: &HashMap<usize, (usize, usize)>,
) -> (HashMap<usize, Vec<usize>>, BTreeSet<usize>) {
    let mut groups: HashMap<usize, Vec<usize>> = HashMap::new();
    let mut grouped = BTreeSet::new();
    let mut open: HashMap<(String, bool), usize> = HashMap::new(); // → first
    for (id, n) in g.nodes.iter().enumerate() {
        if !matches!(n.op, Op::Scatter { .. }) || mem[id] != Mem::Buffer {
            continue;
        }
        let key = (
            format!("{:?}", g.ty(n.inputs[1]).shape),
            in_place.contains_key(&id),
        );
        let joins = open.get(&key).copied().filter(|&first| {
            let members = groups.get(&first).map_or(1, Vec::len);
            can_join(g, mem, id, first, members)
        });
        match joins {
            Some(first) => {
                groups.entry(first).or_insert_with(|| vec![first]).push(id);
                grouped.insert(id);
            }
            None => {
                open.insert(key, id);
            }
        }
    }
    (groups, grouped)
}

/// Scatters that are a program output (once) and whose destination is an input nothing
/// else reads: scatter node → (output, input). Their steps gate the updates on the index
/// check (`scatter_steps`).
fn in_place_candidates(g: &Graph, consumers: &[BTreeSet<usize>]) -> HashMap<usize, (usize, usize)> {
    let mut found = HashMap::new();
    for (k, &o) in g.outputs.iter().enumerate() {
        let n = &g.nodes[o];
        if !matches!(n.op, Op::Scatter { .. }) || g.outputs.iter().filter(|&&p| p == o).count() != 1
        {
            continue;
        }
        let x = n.inputs[0];
        let Op::Input { index } = g.nodes[x].op else {
            continue;
        };
        let only_reader =
            consumers[x].len() == 1 && !n.inputs[1..].contains(&x) && !g.outputs.contains(&x);
        if only_reader {
            found.insert(o, (k, index));
        }
    }
    found
}

/// Which candidates may update their input in place, and the index check that makes that
/// safe: one step, placed before the first candidate's copy, that checks every index the
/// program reads (so no check can fail after an update was written). Only where every
/// index expression reads memory written before that point; otherwise no output is
/// updated in place (the copies stay).
fn plan_in_place(
    g: &Graph,
    mem: &[Mem],
    gen: &mut kernels::Generator<'_>,
    steps: &mut Vec<Step>,
    candidates: &HashMap<usize, (usize, usize)>,
) -> Result<(Vec<InPlace>, Option<usize>), CodegenError> {
    let Some(first) = steps.iter().position(|s| candidates.contains_key(&s.node)) else {
        return Ok((Vec::new(), None));
    };
    let written: BTreeSet<usize> = steps[..first]
        .iter()
        .flat_map(|s| std::iter::once(s.node).chain(s.also.iter().map(|&(n, _)| n)))
        .collect();
    // An index value kept in memory but written after that point (a later layer's cache
    // position, computed from an input) is recomputed by the check from what is ready; one
    // that only a heavy op computes cannot be checked in time.
    let mut checked = Vec::new();
    let mut recompute = BTreeSet::new();
    for (id, n) in g.nodes.iter().enumerate() {
        if !matches!(
            base_op(&n.op),
            Op::Gather { .. } | Op::IndexSelect { .. } | Op::Scatter { .. }
        ) {
            continue;
        }
        let mut todo = vec![n.inputs[1]];
        let mut seen = BTreeSet::new();
        while let Some(x) = todo.pop() {
            if !seen.insert(x) {
                continue;
            }
            match mem[x] {
                Mem::Input(_) | Mem::Weight => {}
                Mem::Buffer if written.contains(&x) => {}
                Mem::Buffer if is_heavy(&g.nodes[x].op) => return Ok((Vec::new(), None)),
                Mem::Buffer => {
                    recompute.insert(x);
                    todo.extend(&g.nodes[x].inputs);
                }
                Mem::Inline => todo.extend(&g.nodes[x].inputs),
            }
        }
        checked.push(id);
    }
    let scatter = steps[first].node;
    let kind = gen.index_precheck(&checked, &recompute, scatter)?;
    steps.insert(
        first,
        Step {
            node: scatter,
            dest: steps[first].dest,
            also: Vec::new(),
            kind,
        },
    );
    let mut in_place = Vec::new();
    for (s, step) in steps.iter().enumerate() {
        let Some(&(output, input)) = candidates.get(&step.node) else {
            continue;
        };
        // A scatter's first step is its copy; the check sits before the first one.
        let copy = s != first && !in_place.iter().any(|p: &InPlace| p.output == output);
        if copy && step.dest == Dest::Output(output) {
            in_place.push(InPlace {
                output,
                input,
                copy_step: s,
            });
        }
    }
    Ok((in_place, Some(first)))
}

/// A cuBLASLt product and what its step adds as it writes.
struct GemmPlan {
    /// The nodes in memory it multiplies, and whether each holds its operand transposed.
    operands: [(usize, bool); 2],
    dot: usize,
    bias: Option<usize>,
    residual: Option<usize>,
    gelu_tanh: bool,
}

/// Moves the product whose step writes `from` to write `to` instead (`from` is then
/// recomputed nowhere: it is a value inside the step); the plan, to add to. Nothing moves
/// where `to` already has a step of its own.
fn move_gemm<'p>(
    gemms: &'p mut HashMap<usize, GemmPlan>,
    mem: &mut [Mem],
    from: usize,
    to: usize,
) -> Option<&'p mut GemmPlan> {
    if gemms.contains_key(&to) {
        return None;
    }
    let plan = gemms.remove(&from)?;
    mem[from] = Mem::Inline;
    mem[to] = Mem::Buffer;
    Some(gemms.entry(to).or_insert(plan))
}

/// `x`'s one reader, when `x` is read by one node only and is not an output: the node a
/// step computing `x` could write instead.
fn sole_consumer(consumers: &[BTreeSet<usize>], is_output: &[bool], x: usize) -> Option<usize> {
    match consumers[x].len() {
        1 if !is_output[x] => consumers[x].first().copied(),
        _ => None,
    }
}

/// The operand of binary node `n` besides `x`, unless both are `x`.
fn other_operand(n: &ember_core::ir::Node, x: usize) -> Option<usize> {
    let other = if n.inputs[0] == x {
        n.inputs[1]
    } else {
        n.inputs[0]
    };
    (other != x).then_some(other)
}

/// `p + bias` with the bias a vector broadcast along the rows of product `p`, its one
/// consumer: the add and the bias vector's node in memory.
fn bias_add(
    g: &Graph,
    mem: &[Mem],
    consumers: &[BTreeSet<usize>],
    is_output: &[bool],
    p: usize,
) -> Option<(usize, usize)> {
    let add = sole_consumer(consumers, is_output, p)?;
    let an = &g.nodes[add];
    let dtype = g.nodes[p].ty.dtype;
    // cuBLASLt's bias epilogue serves f32/f16/bf16 products (not f64 ones).
    if an.op != Op::Binary(ember_core::ir::BinaryOp::Add)
        || an.ty.dtype != dtype
        || dtype == DType::F64
    {
        return None;
    }
    let other = other_operand(an, p)?;
    Some((add, row_bias(g, mem, other, &g.nodes[p].ty.shape)?))
}

/// `gelu(p, approximate="tanh")` when it is `p`'s one consumer, of a dtype cuBLASLt's GELU
/// epilogue serves (f32/f16/bf16). The exact (erf) GELU has no cuBLASLt epilogue.
fn gelu_tanh_of(
    g: &Graph,
    consumers: &[BTreeSet<usize>],
    is_output: &[bool],
    p: usize,
) -> Option<usize> {
    let act = sole_consumer(consumers, is_output, p)?;
    let dtype = g.nodes[p].ty.dtype;
    let gelu = Op::Unary(ember_core::ir::UnaryOp::GeluTanh);
    (g.nodes[act].op == gelu && dtype != DType::F64).then_some(act)
}

/// The last of a chain of reshapes of `p` (each the one consumer of the one before), when
/// it is in memory: the same bytes as `p`, so `p`'s step can write it directly.
fn stored_reshape(
    g: &Graph,
    mem: &[Mem],
    consumers: &[BTreeSet<usize>],
    is_output: &[bool],
    p: usize,
) -> Option<usize> {
    let mut link = p;
    loop {
        if link != p && mem[link] == Mem::Buffer {
            return Some(link);
        }
        let next = sole_consumer(consumers, is_output, link)?;
        if !matches!(g.nodes[next].op, Op::Reshape { .. }) {
            return None;
        }
        link = next;
    }
}

/// The add that sums product `p` (through reshapes of it, each its one consumer) with a
/// tensor in memory, and that tensor's node, if `p` flows into one. The add and the
/// product share a dtype, and the tensor's row-major order is the sum's, as cuBLASLt's C.
fn residual_add(
    g: &Graph,
    mem: &[Mem],
    consumers: &[BTreeSet<usize>],
    is_output: &[bool],
    p: usize,
) -> Option<(usize, usize)> {
    let mut link = p;
    loop {
        let next = sole_consumer(consumers, is_output, link)?;
        let n = &g.nodes[next];
        match n.op {
            Op::Reshape { .. } => link = next,
            Op::Binary(ember_core::ir::BinaryOp::Add) if n.ty.dtype == g.nodes[p].ty.dtype => {
                let other = other_operand(n, link)?;
                return Some((next, in_memory_through_reshape(g, mem, other)?));
            }
            _ => return None,
        }
    }
}

/// Whether generated product `other` can be summed in `first`'s kernel: the same kernel
/// and dtype, the same output shape and sum length.
fn summed_alongside(g: &Graph, first: usize, other: usize) -> bool {
    let (f, o) = (&g.nodes[first], &g.nodes[other]);
    let k = |n: &ember_core::ir::Node| g.nodes[n.inputs[0]].ty.shape.last().cloned();
    f.op == o.op && f.ty == o.ty && k(f) == k(o)
}

/// Most nodes one grouped step writes.
const MAX_GROUP: usize = 8;

/// Whether `id` may join the group of `first` (holding `members` nodes) and run in its
/// step: the group has room, and everything `id` reads from memory is written before
/// `first`'s step (steps run in node order), so it reads no member either.
fn can_join(g: &Graph, mem: &[Mem], id: usize, first: usize, members: usize) -> bool {
    let ready = |r: usize| r < first || matches!(mem[r], Mem::Input(_) | Mem::Weight);
    members < MAX_GROUP && memory_read(g, mem, id).into_iter().all(ready)
}

/// The nodes in memory that computing `node` in place reads: its inputs, through every
/// input recomputed in place.
fn memory_read(g: &Graph, mem: &[Mem], node: usize) -> BTreeSet<usize> {
    let mut read = BTreeSet::new();
    let mut todo: Vec<usize> = g.nodes[node].inputs.clone();
    let mut seen = BTreeSet::new();
    while let Some(x) = todo.pop() {
        if !seen.insert(x) {
            continue;
        }
        match mem[x] {
            Mem::Inline => todo.extend(&g.nodes[x].inputs),
            _ => {
                read.insert(x);
            }
        }
    }
    read
}

/// Whether `x` is a weight (or constant) in memory, directly, through order-keeping views
/// or transposed.
fn is_weight(g: &Graph, mem: &[Mem], x: usize) -> bool {
    let stored = |x| in_memory_through_reshape(g, mem, x).map(|m| mem[m]);
    match stored(x) {
        Some(m) => m == Mem::Weight,
        None => swaps_last_two(&g.nodes[x].op) && stored(g.nodes[x].inputs[0]) == Some(Mem::Weight),
    }
}

/// A matrix product cuBLASLt computes: a plain `dot` of a dtype it takes, over a sum that
/// is not empty (`k = 0`, whose result is zeros, is left to a generated kernel rather than
/// to cuBLASLt's undocumented handling of it).
fn library_product(g: &Graph, id: usize) -> bool {
    let n = &g.nodes[id];
    let empty_sum = || {
        let a = &g.nodes[n.inputs[0]].ty.shape;
        a.last().and_then(|k| k.as_const()) == Some(0)
    };
    n.op == Op::Dot && gemm_dtype(n.ty.dtype) && !empty_sum()
}

/// A matrix product a generated kernel computes (not cuBLASLt).
fn is_generated_product(g: &Graph, id: usize) -> bool {
    match &g.nodes[id].op {
        Op::Kernel { base, .. } => **base == Op::Dot,
        Op::Dot => !library_product(g, id),
        Op::IntegerDot => true,
        _ => false,
    }
}

/// Ops that read each input at their own output index (operands share the output's
/// shape), so a value flows through them element by element.
fn is_pointwise(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. }
    )
}

/// The node in memory that ends the chain of pointwise ops and reshapes through which
/// `product` flows alone (each link the single consumer of the one before, recomputed in
/// place), if the chain reaches one. Every link keeps the elements' row-major order, so
/// the root's element `i` reads the product's element `i` only: the product's kernel can
/// write the root instead of its own value.
fn epilogue_root(
    g: &Graph,
    mem: &[Mem],
    consumers: &[BTreeSet<usize>],
    is_output: &[bool],
    product: usize,
) -> Option<usize> {
    let mut link = product;
    loop {
        let next = sole_consumer(consumers, is_output, link)?;
        let op = &g.nodes[next].op;
        if !is_pointwise(op) && !matches!(op, Op::Reshape { .. }) {
            return None;
        }
        match mem[next] {
            Mem::Buffer => return Some(next),
            Mem::Inline => link = next,
            _ => return None,
        }
    }
}

/// The node in memory a product reads for operand `x`, and whether that memory holds `x`
/// transposed: `x` itself or what reshapes of it start from, else the source of a
/// transpose, when in memory; otherwise `x` (or the transpose's source) is put in memory.
fn operand_in_memory(g: &Graph, mem: &mut [Mem], x: usize) -> (usize, bool) {
    if let Some(m) = in_memory_through_reshape(g, mem, x) {
        return (m, false);
    }
    if swaps_last_two(&g.nodes[x].op) {
        let src = g.nodes[x].inputs[0];
        return match in_memory_through_reshape(g, mem, src) {
            Some(m) => (m, true),
            None => {
                mem[src] = Mem::Buffer;
                (src, true)
            }
        };
    }
    mem[x] = Mem::Buffer;
    (x, false)
}

/// The node in memory that `x` is, directly or through views that keep the row-major
/// order of its elements (so a product reads the same bytes), if any.
fn in_memory_through_reshape(g: &Graph, mem: &[Mem], x: usize) -> Option<usize> {
    stored_in_order(g, x, |n| mem[n] != Mem::Inline)
}

/// The node `is_stored` holds whose row-major elements are `x`'s in `x`'s row-major order:
/// `x` itself, or what a chain of order-keeping views of it starts from.
pub(crate) fn stored_in_order(
    g: &Graph,
    mut x: usize,
    is_stored: impl Fn(usize) -> bool,
) -> Option<usize> {
    loop {
        if is_stored(x) {
            return Some(x);
        }
        if !keeps_order(g, x) {
            return None;
        }
        x = g.nodes[x].inputs[0];
    }
}

/// Views whose elements, in row-major order, are their input's in row-major order: a
/// reshape, and a permute that moves only axes of size 1 (a decode step's attention
/// output `[1, H, 1, E]` → `[1, 1, H, E]`), or at most 1 where the size is symbolic (at
/// 0 there are no elements to order).
fn keeps_order(g: &Graph, x: usize) -> bool {
    match &g.nodes[x].op {
        Op::Reshape { .. } => true,
        Op::Permute { perm } => {
            let src = &g.ty(g.nodes[x].inputs[0]).shape;
            let moved: Vec<usize> = perm
                .iter()
                .copied()
                .filter(|&p| src[p].upper_bound().is_none_or(|hi| hi > 1))
                .collect();
            moved.windows(2).all(|w| w[0] < w[1])
        }
        _ => false,
    }
}

/// The vector in memory that `x` broadcasts along the rows of a `[.., M, N]` product, if it
/// is one: `x` expands a `[1, .., 1, N]` tensor that is, through reshapes, an `N`-element
/// node in memory — so element `[.., i, j]` of `x` is element `j` of that node.
fn row_bias(g: &Graph, mem: &[Mem], x: usize, out: &[Dim]) -> Option<usize> {
    let Op::Expand { shape } = &g.nodes[x].op else {
        return None;
    };
    if shape.as_slice() != out {
        return None;
    }
    let src = g.nodes[x].inputs[0];
    let sshape = &g.nodes[src].ty.shape;
    let (last, lead) = sshape.split_last()?;
    let n = out.last()?;
    if lead.iter().any(|d| d.as_const() != Some(1)) || last.provably_equal(n) != Some(true) {
        return None;
    }
    // cuBLASLt's bias epilogue reads in 16-byte loads: only our own memory (weights and
    // the arena, 256-byte aligned) is sure to be aligned; a caller's tensor may start
    // anywhere (`b[1:]`).
    let bias = in_memory_through_reshape(g, mem, src)?;
    (!matches!(mem[bias], Mem::Input(_))).then_some(bias)
}
