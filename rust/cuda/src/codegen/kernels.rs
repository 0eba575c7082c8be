//! Kernel templates: one per kind of root op. Each reads its inputs through the emitter
//! (so fused producers are computed in place) and writes its root's contiguous output.
//! Identical kernels (same text up to the name) are generated once.

use std::collections::HashMap;

use ember_core::dim::{numel, Dim};
use ember_core::dtype::{DType, Kind};
use ember_core::ir::{Graph, Op, PoolKind, ReduceOp, ScatterReduce};

use super::emit::{param_decl, Emitter};
use super::types::{accumulate_type, storage_type, store};
use super::{CodegenError, Kernel, Launch, Partials, StepKind};

mod mma_attention;
mod split_attention;
mod tiled_attention;

pub use mma_attention::mma_attention_applies;
mod warp_dot;

const NAME: &str = "@KERNEL@";
/// The loop giving each thread its elements `i < n`, whatever the grid's size.
const GRID_STRIDE: &str =
    "for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)";

/// Emits the work on one element of a norm's row: (emitter, trailing index, value).
type RowBody<'f> = dyn Fn(&mut Emitter, &[String], &str) -> Result<(), CodegenError> + 'f;

pub struct Generator<'a> {
    g: &'a Graph,
    in_memory: &'a [bool],
    symbols: &'a [std::sync::Arc<str>],
    kernels: Vec<Kernel>,
    by_text: HashMap<String, usize>,
    source: String,
}

/// A kernel's body and what it needs besides its parameters.
struct Body {
    e_params: Vec<usize>,
    text: String,
    cooperative: bool,
    scratch: Option<&'static str>,
    /// The accumulator type of the partial results it writes or reads.
    partials: Option<(&'static str, Partials)>,
    /// Nodes it writes besides its root, as `out1`, `out2`, … (after `out`).
    also_writes: Vec<usize>,
}

impl Body {
    fn of(e: Emitter<'_>, cooperative: bool) -> Body {
        Body {
            e_params: e.params,
            text: e.body,
            cooperative,
            scratch: None,
            partials: None,
            also_writes: Vec::new(),
        }
    }
}

fn inf(acc: &str) -> &'static str {
    if acc == "double" {
        "EMBER_INF64"
    } else {
        "EMBER_INF"
    }
}

fn err(g: &Graph, id: usize, msg: impl std::fmt::Display) -> CodegenError {
    CodegenError::new(g, id, msg)
}

/// The attention score of query row `l` and key `j` (variables of the emitted code): the
/// scaled dot product, then the causal limit and the mask; emitted as `acc s`.
struct Score {
    q: usize,
    k: usize,
    mask: Option<usize>,
    scale: f64,
    causal: bool,
    acc: &'static str,
}

impl Score {
    fn emit(
        &self,
        g: &Graph,
        e: &mut Emitter<'_>,
        at: &dyn Fn([&str; 2]) -> Vec<String>,
        l: &str,
    ) -> Result<(), CodegenError> {
        let acc = self.acc;
        e.line(format!("{acc} d = 0;"));
        e.open("for (i64 c = 0; c < E; ++c)");
        let qv = e.value(self.q, &at([l, "c"]))?;
        let kv = e.value(self.k, &at(["j", "c"]))?;
        e.line(format!("d += ({acc}){qv} * ({acc}){kv};"));
        e.close();
        e.line(format!("{acc} s = d * ({acc}){:e};", self.scale));
        self.limit(g, e, at, l)
    }

    /// Applies the causal limit and the mask to the score `s` of query row `l` and key `j`.
    fn limit(
        &self,
        g: &Graph,
        e: &mut Emitter<'_>,
        at: &dyn Fn([&str; 2]) -> Vec<String>,
        l: &str,
    ) -> Result<(), CodegenError> {
        let acc = self.acc;
        if self.causal {
            e.line(format!("if (j > {l}) s = -{};", inf(acc)));
        }
        if let Some(m) = self.mask {
            let mv = e.value(m, &at([l, "j"]))?;
            if g.nodes[m].ty.dtype == DType::Bool {
                e.line(format!("if (!{mv}) s = -{};", inf(acc)));
            } else {
                e.line(format!("s += ({acc}){mv};"));
            }
        }
        Ok(())
    }
}

/// An attention node's operands and shapes, shared by its kernels.
struct AttentionParts {
    score: Score,
    v: usize,
    qs: Vec<Dim>,
    s_dim: Dim,
    ev_dim: Dim,
    dtype: DType,
}

impl AttentionParts {
    fn of(g: &Graph, id: usize) -> Result<AttentionParts, CodegenError> {
        let n = &g.nodes[id];
        let Op::Attention {
            scale,
            causal,
            has_mask,
        } = *super::base_op(&n.op)
        else {
            return Err(err(g, id, "not an attention node"));
        };
        let dtype = n.ty.dtype;
        if dtype.kind() != Kind::Float {
            return Err(err(g, id, format!("attention of {dtype}")));
        }
        let (q, k, v) = (n.inputs[0], n.inputs[1], n.inputs[2]);
        let qs = g.nodes[q].ty.shape.clone();
        let (ks, vs) = (&g.nodes[k].ty.shape, &g.nodes[v].ty.shape);
        let r = qs.len();
        Ok(AttentionParts {
            score: Score {
                q,
                k,
                mask: has_mask.then(|| n.inputs[3]),
                scale,
                causal,
                acc: accumulate_type(dtype),
            },
            v,
            s_dim: ks[r - 2].clone(),
            ev_dim: vs[r - 1].clone(),
            qs,
            dtype,
        })
    }

    /// The query rows (all dims but the head dim).
    fn row_dims(&self) -> &[Dim] {
        &self.qs[..self.qs.len() - 1]
    }

    /// Declares `rows`, `S` (keys), `E` (head dim) and `EV` (value columns).
    fn declare_dims(&self, e: &mut Emitter<'_>) {
        e.line(format!(
            "const i64 rows = {};",
            e.dims.product(self.row_dims())
        ));
        e.line(format!("const i64 S = {};", e.dim(&self.s_dim)));
        e.line(format!(
            "const i64 E = {};",
            e.dim(&self.qs[self.qs.len() - 1])
        ));
        e.line(format!("const i64 EV = {};", e.dim(&self.ev_dim)));
    }

    /// The batch indices of query row `row` (a variable of the emitted code) and its
    /// position among the queries.
    fn row_index(&self, e: &mut Emitter<'_>) -> RowIndex {
        let ridx = e.unravel("row", self.row_dims());
        let r = ridx.len();
        RowIndex {
            batch: ridx[..r - 1].to_vec(),
            query: ridx[r - 1].clone(),
        }
    }
}

/// Where one query row of attention is: its batch indices and its query position.
struct RowIndex {
    batch: Vec<String>,
    query: String,
}

impl RowIndex {
    /// The index of `[batch.., last2[0], last2[1]]` in a q/k/v/mask operand.
    fn at(&self, last2: [&str; 2]) -> Vec<String> {
        let mut i = self.batch.clone();
        i.extend(last2.iter().map(|s| s.to_string()));
        i
    }
}

impl<'a> Generator<'a> {
    pub fn new(g: &'a Graph, in_memory: &'a [bool], symbols: &'a [std::sync::Arc<str>]) -> Self {
        Generator {
            g,
            in_memory,
            symbols,
            kernels: Vec::new(),
            by_text: HashMap::new(),
            source: String::new(),
        }
    }

    pub fn finish(self) -> (Vec<Kernel>, String) {
        (self.kernels, self.source)
    }

    fn emitter(&self, root: Option<usize>) -> Emitter<'a> {
        let mut e = Emitter::new(self.g, self.in_memory, root, self.symbols);
        e.indent = 1;
        e
    }

    /// Registers a kernel (once per distinct text) and returns its step.
    fn add(&mut self, id: usize, body: Body, launch: Launch) -> StepKind {
        let g = self.g;
        let out_t = storage_type(g.nodes[id].ty.dtype);
        let mut params = vec![
            "i64* __restrict__ meta".to_string(),
            format!("{out_t}* __restrict__ out"),
        ];
        for (k, &w) in body.also_writes.iter().enumerate() {
            let t = storage_type(g.nodes[w].ty.dtype);
            params.push(format!("{t}* __restrict__ out{}", k + 1));
        }
        for (k, &p) in body.e_params.iter().enumerate() {
            params.push(param_decl(g, p, &format!("b{k}")));
        }
        if let Some(t) = body.scratch {
            params.push(format!("{t}* __restrict__ scratch"));
        }
        if let Some((t, _)) = &body.partials {
            params.push(format!("{t}* __restrict__ part"));
        }
        let text = format!(
            "extern \"C\" __global__ void {NAME}({}) {{\n{}}}\n",
            params.join(", "),
            body.text
        );
        let kernel = match self.by_text.get(&text) {
            Some(&k) => k,
            None => {
                let k = self.kernels.len();
                let name = format!("ember_k{k}");
                self.source.push_str(&text.replace(NAME, &name));
                self.source.push('\n');
                self.kernels.push(Kernel {
                    name,
                    cooperative: body.cooperative,
                });
                self.by_text.insert(text, k);
                k
            }
        };
        StepKind::Kernel {
            kernel,
            args: body.e_params,
            launch,
            scratch_per_block: body.scratch.map(|_| self.scratch_dim(id)),
            partials: body.partials.map(|(_, p)| p),
        }
    }

    fn scratch_dim(&self, id: usize) -> Dim {
        // Attention keeps one row of scores per block: S (the keys' length).
        let g = self.g;
        let k = &g.nodes[g.nodes[id].inputs[1]].ty.shape;
        k[k.len() - 2].clone()
    }

    /// Writes the value of `id` (loaded, when it is in memory) to a caller's output.
    pub fn copy_kernel(&mut self, id: usize) -> Result<StepKind, CodegenError> {
        self.elementwise(id, None)
    }

    pub fn node_kernel(&mut self, id: usize) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let n = &g.nodes[id];
        match &n.op {
            Op::Reduce { op, axes, .. } => self.reduce(id, *op, axes),
            Op::Softmax { axis, log } => self.softmax(id, *axis, *log),
            Op::LayerNorm {
                axis,
                eps,
                has_weight,
                has_bias,
            } => self.norm(id, *axis, *eps, *has_weight, *has_bias, false),
            Op::RmsNorm {
                axis,
                eps,
                has_weight,
            } => self.norm(id, *axis, *eps, *has_weight, false, true),
            Op::Cumsum { axis } => self.cumsum(id, *axis),
            Op::Argsort { axis, descending } => self.argsort(id, *axis, *descending),
            Op::GroupedDot => self.grouped_dot(id),
            Op::Attention { .. } => self.attention(id),
            Op::Kernel { base, .. } if matches!(**base, Op::Attention { .. }) => self.attention(id),
            Op::Conv {
                stride,
                padding,
                dilation,
                groups,
                has_bias,
            } => self.conv(id, stride, padding, dilation, *groups, *has_bias),
            Op::Pool {
                kind,
                kernel,
                stride,
                padding,
                dilation,
                ..
            } => self.pool(id, *kind, kernel, stride, padding, dilation),
            Op::Dot | Op::Kernel { .. } => self.product_kernel(&[id], None),
            _ => self.elementwise(id, Some(id)),
        }
    }

    /// The generated kernel of matrix product `products[0]`, writing its value or, with
    /// `epilogue`, that of the pointwise chain from the product up to `epilogue` (`generate`
    /// checks the chain reads the product only at the output's own index). The chain's
    /// other products of the same shape (`products[1..]`: a gated MLP's `up` beside its
    /// `gate`) are summed alongside, by the same threads in the same loop.
    pub fn product_kernel(
        &mut self,
        products: &[usize],
        epilogue: Option<usize>,
    ) -> Result<StepKind, CodegenError> {
        match &self.g.nodes[products[0]].op {
            // `generate` admits only the CUDA choices for products.
            Op::Kernel { name, .. } if name == super::KERNEL_WARP_DOT => {
                self.warp_dot(products, epilogue)
            }
            _ => self.dot(products, epilogue),
        }
    }

    /// Independent elementwise nodes of one shape (a decode step's k and v cache concats)
    /// in one launch: each thread computes every member at its element, writing them to
    /// `out`, `out1`, … (`generate` checks no member reads another).
    pub fn grouped_elementwise(&mut self, members: &[usize]) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let shape = g.nodes[members[0]].ty.shape.clone();
        let mut e = self.emitter(Some(members[0]));
        e.also_roots = members[1..].to_vec();
        let n = e.dims.product(&shape);
        e.line(format!("const i64 n = {n};"));
        e.open(GRID_STRIDE);
        let idx = e.unravel("i", &shape);
        for (j, &m) in members.iter().enumerate() {
            let v = e.value(m, &idx)?;
            let out = if j == 0 {
                "out".into()
            } else {
                format!("out{j}")
            };
            e.line(format!("{out}[i] = {};", store(g.nodes[m].ty.dtype, &v)));
        }
        e.close();
        let body = Body {
            also_writes: members[1..].to_vec(),
            ..Body::of(e, false)
        };
        Ok(self.add(members[0], body, Launch::Elements(numel(&shape))))
    }

    /// One thread per output element (grid-stride).
    fn elementwise(&mut self, id: usize, root: Option<usize>) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let shape = g.nodes[id].ty.shape.clone();
        let dtype = g.nodes[id].ty.dtype;
        let mut e = self.emitter(root);
        let n = e.dims.product(&shape);
        e.line(format!("const i64 n = {n};"));
        e.open(GRID_STRIDE);
        let idx = e.unravel("i", &shape);
        let v = e.value(id, &idx)?;
        e.line(format!("out[i] = {};", store(dtype, &v)));
        e.close();
        let body = Body::of(e, false);
        Ok(self.add(id, body, Launch::Elements(numel(&shape))))
    }

    fn reduce(
        &mut self,
        id: usize,
        op: ReduceOp,
        axes: &[usize],
    ) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let x = g.nodes[id].inputs[0];
        let xt = &g.nodes[x].ty;
        let out_dtype = g.nodes[id].ty.dtype;
        let kept: Vec<Dim> = (0..xt.rank())
            .filter(|a| !axes.contains(a))
            .map(|a| xt.shape[a].clone())
            .collect();
        let reduced: Vec<Dim> = axes.iter().map(|&a| xt.shape[a].clone()).collect();
        let acc = accumulate_type(xt.dtype);
        let float = xt.dtype.kind() == Kind::Float;
        let arg = matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin);
        let mut e = self.emitter(None);
        if arg {
            e.line(format!("__shared__ {acc} sv[1024];"));
            e.line("__shared__ i64 si[1024];");
        } else {
            e.line(format!("__shared__ {acc} smem[1024];"));
        }
        let (rows, width) = (e.dims.product(&kept), e.dims.product(&reduced));
        e.line(format!("const i64 rows = {rows};"));
        e.line(format!("const i64 width = {width};"));
        e.open("for (i64 row = blockIdx.x; row < rows; row += gridDim.x)");
        let kidx = e.unravel("row", &kept);
        let (init, combine) = match (op, float) {
            (ReduceOp::Sum, _) => ("0".to_string(), "EmberSum()"),
            (ReduceOp::Prod, _) => ("1".to_string(), "EmberProd()"),
            (ReduceOp::Max, true) => (format!("-{}", inf(acc)), "EmberFMax()"),
            (ReduceOp::Min, true) => (inf(acc).to_string(), "EmberFMin()"),
            (ReduceOp::Max, false) => ("(-9223372036854775807LL - 1)".into(), "EmberIMax()"),
            (ReduceOp::Min, false) => ("9223372036854775807LL".into(), "EmberIMin()"),
            (ReduceOp::ArgMax | ReduceOp::ArgMin, _) => ("0".into(), ""),
        };
        let kahan = op == ReduceOp::Sum && float;
        if arg {
            e.line(format!("{acc} best = 0; i64 at = -1;"));
        } else if kahan {
            e.line(format!("EmberKahan<{acc}> kh = {{0, 0}};"));
        } else {
            e.line(format!("{acc} a = {init};"));
        }
        e.open("for (i64 r = threadIdx.x; r < width; r += blockDim.x)");
        let ridx = e.unravel("r", &reduced);
        let mut full = vec![String::new(); xt.rank()];
        let (mut ki, mut ri) = (kidx.iter(), ridx.iter());
        for (a, slot) in full.iter_mut().enumerate() {
            *slot = if axes.contains(&a) {
                ri.next()
            } else {
                ki.next()
            }
            .cloned()
            .unwrap_or_default();
        }
        let v = e.value(x, &full)?;
        let is_max = op == ReduceOp::ArgMax;
        match op {
            _ if arg => e.line(format!(
                "if (ember_arg_better(({acc}){v}, r, best, at, {is_max})) {{ best = ({acc}){v}; at = r; }}"
            )),
            _ if kahan => e.line(format!("kh.add(({acc}){v});")),
            _ => e.line(format!("a = {combine}(a, ({acc}){v});")),
        }
        e.close();
        if arg {
            e.line(format!(
                "ember_block_argreduce(&best, &at, sv, si, {is_max});"
            ));
            e.line(format!(
                "if (threadIdx.x == 0) out[row] = {};",
                store(out_dtype, "at")
            ));
        } else {
            let a = if kahan { "kh.sum" } else { "a" };
            e.line(format!(
                "const {acc} total = ember_block_reduce({a}, smem, {combine});"
            ));
            e.line(format!(
                "if (threadIdx.x == 0) out[row] = {};",
                store(out_dtype, "total")
            ));
        }
        e.close();
        let body = Body::of(e, true);
        Ok(self.add(
            id,
            body,
            Launch::Rows {
                rows: numel(&kept),
                width: numel(&reduced),
            },
        ))
    }

    /// Index variables of a row (all dims but `axis`) with `j` at `axis`.
    fn with_axis(row: &[String], axis: usize, j: &str) -> Vec<String> {
        let mut idx = row.to_vec();
        idx.insert(axis, j.to_string());
        idx
    }

    fn softmax(&mut self, id: usize, axis: usize, log: bool) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let x = g.nodes[id].inputs[0];
        let shape = g.nodes[id].ty.shape.clone();
        let dtype = g.nodes[id].ty.dtype;
        if dtype.kind() != Kind::Float {
            return Err(err(g, id, format!("softmax of {dtype}")));
        }
        let acc = accumulate_type(dtype);
        let mut row_dims = shape.clone();
        let len = row_dims.remove(axis);
        let mut e = self.emitter(None);
        e.line(format!("__shared__ {acc} smem[1024];"));
        e.line(format!("const i64 rows = {};", e.dims.product(&row_dims)));
        e.line(format!("const i64 len = {};", e.dim(&len)));
        e.open("for (i64 row = blockIdx.x; row < rows; row += gridDim.x)");
        let ridx = e.unravel("row", &row_dims);
        e.line(format!("{acc} mx = -{};", inf(acc)));
        e.open("for (i64 j = threadIdx.x; j < len; j += blockDim.x)");
        let v = e.value(x, &Self::with_axis(&ridx, axis, "j"))?;
        e.line(format!("mx = ({acc}){v} > mx ? ({acc}){v} : mx;"));
        e.close();
        e.line("mx = ember_block_reduce(mx, smem, EmberIMax());");
        e.line(format!("{acc} s = 0;"));
        e.open("for (i64 j = threadIdx.x; j < len; j += blockDim.x)");
        let v = e.value(x, &Self::with_axis(&ridx, axis, "j"))?;
        e.line(format!("s += ember_exp(({acc}){v} - mx);"));
        e.close();
        e.line("s = ember_block_reduce(s, smem, EmberSum());");
        if log {
            e.line(format!("const {acc} shift = mx + ember_log(s);"));
        }
        e.open("for (i64 j = threadIdx.x; j < len; j += blockDim.x)");
        let idx = Self::with_axis(&ridx, axis, "j");
        let v = e.value(x, &idx)?;
        let y = if log {
            format!("({acc}){v} - shift")
        } else {
            format!("ember_exp(({acc}){v} - mx) / s")
        };
        let off = e.offset(&idx, &shape);
        e.line(format!("out[{off}] = {};", store(dtype, &y)));
        e.close();
        e.close();
        let body = Body::of(e, true);
        Ok(self.add(
            id,
            body,
            Launch::Rows {
                rows: numel(&row_dims),
                width: len,
            },
        ))
    }

    /// Layer norm (two-pass mean and variance) or RMS norm over the dims from `axis` on.
    fn norm(
        &mut self,
        id: usize,
        axis: usize,
        eps: f64,
        has_weight: bool,
        has_bias: bool,
        rms: bool,
    ) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let n = &g.nodes[id];
        let x = n.inputs[0];
        let shape = n.ty.shape.clone();
        let dtype = n.ty.dtype;
        if dtype.kind() != Kind::Float {
            return Err(err(g, id, format!("normalization of {dtype}")));
        }
        let acc = accumulate_type(dtype);
        let (lead, trail) = (shape[..axis].to_vec(), shape[axis..].to_vec());
        let mut e = self.emitter(None);
        e.line(format!("__shared__ {acc} smem[1024];"));
        e.line(format!("const i64 rows = {};", e.dims.product(&lead)));
        e.line(format!("const i64 width = {};", e.dims.product(&trail)));
        e.open("for (i64 row = blockIdx.x; row < rows; row += gridDim.x)");
        let ridx = e.unravel("row", &lead);
        let pass = |e: &mut Emitter, f: &RowBody<'_>| {
            e.open("for (i64 j = threadIdx.x; j < width; j += blockDim.x)");
            let tidx = e.unravel("j", &trail);
            let mut idx = ridx.clone();
            idx.extend(tidx.iter().cloned());
            let v = e.value(x, &idx)?;
            f(e, &tidx, &format!("({acc}){v}"))?;
            e.close();
            Ok::<(), CodegenError>(())
        };
        let eps_lit = format!("({acc}){eps:e}");
        if rms {
            e.line(format!("EmberKahan<{acc}> kh = {{0, 0}};"));
            pass(&mut e, &|e, _, v| {
                e.line(format!("kh.add({v} * {v});"));
                Ok(())
            })?;
            e.line(format!(
                "const {acc} rstd = ember_rsqrt(ember_block_reduce(kh.sum, smem, EmberSum()) / ({acc})width + {eps_lit});"
            ));
            e.line(format!("const {acc} mean = 0;"));
        } else {
            e.line(format!("EmberKahan<{acc}> kh = {{0, 0}};"));
            pass(&mut e, &|e, _, v| {
                e.line(format!("kh.add({v});"));
                Ok(())
            })?;
            e.line(format!(
                "const {acc} mean = ember_block_reduce(kh.sum, smem, EmberSum()) / ({acc})width;"
            ));
            e.line(format!("EmberKahan<{acc}> kv = {{0, 0}};"));
            pass(&mut e, &|e, _, v| {
                e.line(format!("const {acc} d = {v} - mean; kv.add(d * d);"));
                Ok(())
            })?;
            e.line(format!(
                "const {acc} rstd = ember_rsqrt(ember_block_reduce(kv.sum, smem, EmberSum()) / ({acc})width + {eps_lit});"
            ));
        }
        let (w, b) = (
            has_weight.then(|| n.inputs[1]),
            has_bias.then(|| n.inputs[1 + has_weight as usize]),
        );
        pass(&mut e, &|e, tidx, v| {
            let mut y = format!("({v} - mean) * rstd");
            if let Some(w) = w {
                let wv = e.value(w, tidx)?;
                y = format!("({y}) * ({acc}){wv}");
            }
            if let Some(b) = b {
                let bv = e.value(b, tidx)?;
                y = format!("({y}) + ({acc}){bv}");
            }
            e.line(format!("out[row * width + j] = {};", store(dtype, &y)));
            Ok(())
        })?;
        e.close();
        let body = Body::of(e, true);
        Ok(self.add(
            id,
            body,
            Launch::Rows {
                rows: numel(&lead),
                width: numel(&trail),
            },
        ))
    }

    /// One thread per line along `axis`, summing serially.
    fn cumsum(&mut self, id: usize, axis: usize) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let x = g.nodes[id].inputs[0];
        let shape = g.nodes[id].ty.shape.clone();
        let dtype = g.nodes[id].ty.dtype;
        let acc = accumulate_type(dtype);
        let mut lines = shape.clone();
        let len = lines.remove(axis);
        let mut e = self.emitter(None);
        e.line(format!("const i64 lines = {};", e.dims.product(&lines)));
        e.line(format!("const i64 len = {};", e.dim(&len)));
        e.open("for (i64 line = (i64)blockIdx.x * blockDim.x + threadIdx.x; line < lines; line += (i64)gridDim.x * blockDim.x)");
        let lidx = e.unravel("line", &lines);
        e.line(format!("{acc} a = 0;"));
        e.open("for (i64 j = 0; j < len; ++j)");
        let idx = Self::with_axis(&lidx, axis, "j");
        let v = e.value(x, &idx)?;
        e.line(format!("a += ({acc}){v};"));
        let off = e.offset(&idx, &shape);
        e.line(format!("out[{off}] = {};", store(dtype, "a")));
        e.close();
        e.close();
        let body = Body::of(e, false);
        Ok(self.add(id, body, Launch::Elements(numel(&lines))))
    }

    /// One thread per element: its rank in its line (how many elements sort before it,
    /// ties by position, NaN above every number) is where its position is written.
    /// Quadratic in the line's length, which suits the short lines sorts see in models
    /// (routing tokens by expert).
    fn argsort(
        &mut self,
        id: usize,
        axis: usize,
        descending: bool,
    ) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let x = g.nodes[id].inputs[0];
        let shape = g.nodes[id].ty.shape.clone();
        let xdtype = g.nodes[x].ty.dtype;
        let acc = accumulate_type(xdtype);
        let mut e = self.emitter(None);
        e.line(format!("const i64 n = {};", e.dims.product(&shape)));
        e.line(format!("const i64 len = {};", e.dim(&shape[axis])));
        e.open(GRID_STRIDE);
        let idx = e.unravel("i", &shape);
        let vj = e.value(x, &idx)?;
        e.line(format!("const {acc} vj = ({acc}){vj};"));
        e.line("i64 rank = 0;");
        e.open("for (i64 t = 0; t < len; ++t)");
        let mut tidx = idx.clone();
        tidx[axis] = "t".into();
        let vt = e.value(x, &tidx)?;
        e.line(format!("const {acc} vt = ({acc}){vt};"));
        let j = &idx[axis];
        let (first, nan) = match (xdtype.is_float(), descending) {
            // NaN (x != x) ranks above every number and equal to another NaN.
            (true, false) => (
                "(vt < vj || (vj != vj && vt == vt))",
                "(vt != vt && vj != vj)",
            ),
            (true, true) => (
                "(vt > vj || (vt != vt && vj == vj))",
                "(vt != vt && vj != vj)",
            ),
            (false, false) => ("vt < vj", "false"),
            (false, true) => ("vt > vj", "false"),
        };
        e.line(format!(
            "rank += ({first} || ((vt == vj || {nan}) && t < {j})) ? 1 : 0;"
        ));
        e.close();
        let mut oidx = idx.clone();
        oidx[axis] = "rank".into();
        let off = e.offset(&oidx, &shape);
        e.line(format!("out[{off}] = {j};"));
        e.close();
        let body = Body::of(e, false);
        Ok(self.add(id, body, Launch::Elements(numel(&shape))))
    }

    /// Grouped matrix product: one thread per output element finds its row's group
    /// (ends clamped into [previous end, S]) and sums over K; rows past the last end are 0.
    fn grouped_dot(&mut self, id: usize) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let n = &g.nodes[id];
        let dtype = n.ty.dtype;
        let acc = accumulate_type(dtype);
        let (x, w, ends) = (n.inputs[0], n.inputs[1], n.inputs[2]);
        let out = n.ty.shape.clone();
        let groups = g.nodes[w].ty.shape[0].clone();
        let mut e = self.emitter(None);
        e.line(format!("const i64 n = {};", e.dims.product(&out)));
        e.line(format!("const i64 S = {};", e.dim(&out[0])));
        e.line(format!("const i64 K = {};", e.dim(&g.nodes[x].ty.shape[1])));
        e.line(format!("const i64 G = {};", e.dim(&groups)));
        e.open(GRID_STRIDE);
        let oidx = e.unravel("i", &out);
        let (row, col) = (oidx[0].clone(), oidx[1].clone());
        e.line("i64 group = -1, start = 0;");
        e.open("for (i64 q = 0; q < G; ++q)");
        let end = e.value(ends, &["q".to_string()])?;
        e.line(format!("i64 end = (i64)({end});"));
        e.line("end = end < start ? start : (end > S ? S : end);");
        e.line(format!("if ({row} < end) {{ group = q; break; }}"));
        e.line("start = end;");
        e.close();
        e.line(format!("{acc} s = 0;"));
        e.open("if (group >= 0)");
        e.open("for (i64 k = 0; k < K; ++k)");
        let xv = e.value(x, &[row, "k".into()])?;
        let wv = e.value(w, &["group".into(), "k".into(), col])?;
        e.line(format!("s += ({acc}){xv} * ({acc}){wv};"));
        e.close();
        e.close();
        e.line(format!("out[i] = {};", store(dtype, "s")));
        e.close();
        let body = Body::of(e, false);
        Ok(self.add(id, body, Launch::Elements(numel(&out))))
    }

    /// One block per query row: scores into scratch, softmax, then the weighted sum of values.
    fn attention(&mut self, id: usize) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let p = AttentionParts::of(g, id)?;
        let chosen = |k: &str| matches!(&g.nodes[id].op, Op::Kernel { name, .. } if name == k);
        if chosen(super::KERNEL_MMA_ATTENTION) {
            if let Some(step) = self.mma_attention(id, &p)? {
                return Ok(step);
            }
        }
        if let Some(step) = self.tiled_attention(id, &p)? {
            return Ok(step);
        }
        let acc = p.score.acc;
        let mut e = self.emitter(None);
        e.line(format!("__shared__ {acc} smem[1024];"));
        p.declare_dims(&mut e);
        e.line(format!("{acc}* sc = scratch + (i64)blockIdx.x * S;"));
        e.open("for (i64 row = blockIdx.x; row < rows; row += gridDim.x)");
        let ri = p.row_index(&mut e);
        let at = |last2: [&str; 2]| ri.at(last2);
        e.line(format!("{acc} mx = -{};", inf(acc)));
        e.open("for (i64 j = threadIdx.x; j < S; j += blockDim.x)");
        p.score.emit(g, &mut e, &at, &ri.query)?;
        e.line("sc[j] = s;");
        e.line("mx = s > mx ? s : mx;");
        e.close();
        e.line("mx = ember_block_reduce(mx, smem, EmberIMax());");
        e.line(format!("{acc} sum = 0;"));
        e.open("for (i64 j = threadIdx.x; j < S; j += blockDim.x)");
        e.line(format!(
            "const {acc} p = ember_exp(sc[j] - mx); sc[j] = p; sum += p;"
        ));
        e.close();
        // The reduction's barriers also publish every thread's `sc` writes to the block.
        e.line("sum = ember_block_reduce(sum, smem, EmberSum());");
        // Every score masked (mx = -inf, p = NaN): zeros, as torch's SDPA.
        let finish = format!("mx == -{} ? ({acc})0 : o / sum", inf(acc));
        let dtype = p.dtype;
        weighted_values(&mut e, p.v, &at, acc, ("sc", "0", "S"), &finish, &|o| {
            format!("out[row * EV + c] = {};", store(dtype, o))
        })?;
        e.line("__syncthreads();");
        e.close();
        let body = Body {
            scratch: Some(acc),
            ..Body::of(e, true)
        };
        Ok(self.add(
            id,
            body,
            Launch::Rows {
                rows: numel(p.row_dims()),
                width: p.s_dim.clone(),
            },
        ))
    }

    /// Direct convolution: one thread per output element.
    fn conv(
        &mut self,
        id: usize,
        stride: &[i64],
        padding: &[(i64, i64)],
        dilation: &[i64],
        groups: i64,
        has_bias: bool,
    ) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let n = &g.nodes[id];
        let dtype = n.ty.dtype;
        if dtype.kind() != Kind::Float {
            return Err(err(g, id, format!("convolution of {dtype}")));
        }
        let acc = accumulate_type(dtype);
        let (x, w) = (n.inputs[0], n.inputs[1]);
        let xs = g.nodes[x].ty.shape.clone();
        let ws = g.nodes[w].ty.shape.clone();
        let out = n.ty.shape.clone();
        let sp = stride.len();
        let mut e = self.emitter(None);
        e.line(format!("const i64 n = {};", e.dims.product(&out)));
        e.line(format!("const i64 og = {} / {groups}LL;", e.dim(&ws[0])));
        e.line(format!("const i64 cg = {};", e.dim(&ws[1])));
        e.open(GRID_STRIDE);
        let oidx = e.unravel("i", &out);
        let init = if has_bias {
            let b = e.value(n.inputs[2], &oidx[1..2])?;
            format!("({acc}){b}")
        } else {
            "0".into()
        };
        e.line(format!("{acc} a = {init};"));
        e.line(format!("const i64 grp = {} / og;", oidx[1]));
        e.open("for (i64 c = 0; c < cg; ++c)");
        let mut xidx = vec![oidx[0].clone(), "(grp * cg + c)".to_string()];
        let mut widx = vec![oidx[1].clone(), "c".to_string()];
        for d in 0..sp {
            let (kv, pv) = (format!("k{d}"), format!("p{d}"));
            e.open(format!(
                "for (i64 {kv} = 0; {kv} < {}; ++{kv})",
                e.dim(&ws[2 + d])
            ));
            e.line(format!(
                "const i64 {pv} = {} * {}LL - {}LL + {kv} * {}LL;",
                oidx[2 + d],
                stride[d],
                padding[d].0,
                dilation[d]
            ));
            e.line(format!(
                "if ({pv} < 0 || {pv} >= {}) continue;",
                e.dim(&xs[2 + d])
            ));
            xidx.push(pv);
            widx.push(kv);
        }
        let xv = e.value(x, &xidx)?;
        let wv = e.value(w, &widx)?;
        e.line(format!("a += ({acc}){xv} * ({acc}){wv};"));
        for _ in 0..sp {
            e.close();
        }
        e.close();
        e.line(format!("out[i] = {};", store(dtype, "a")));
        e.close();
        let body = Body::of(e, false);
        Ok(self.add(id, body, Launch::Elements(numel(&out))))
    }

    fn pool(
        &mut self,
        id: usize,
        kind: PoolKind,
        kernel: &[i64],
        stride: &[i64],
        padding: &[i64],
        dilation: &[i64],
    ) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let n = &g.nodes[id];
        let dtype = n.ty.dtype;
        if dtype.kind() != Kind::Float {
            return Err(err(g, id, format!("pooling of {dtype}")));
        }
        let acc = accumulate_type(dtype);
        let x = n.inputs[0];
        let xs = g.nodes[x].ty.shape.clone();
        let out = n.ty.shape.clone();
        let sp = kernel.len();
        let lead = out.len() - sp;
        let mut e = self.emitter(None);
        e.line(format!("const i64 n = {};", e.dims.product(&out)));
        e.open(GRID_STRIDE);
        let oidx = e.unravel("i", &out);
        e.line(format!(
            "{acc} mx = -{}; bool nan = false; {acc} sum = 0; i64 cnt = 0;",
            inf(acc)
        ));
        let mut xidx = oidx[..lead].to_vec();
        for d in 0..sp {
            let (kv, pv) = (format!("k{d}"), format!("p{d}"));
            e.open(format!(
                "for (i64 {kv} = 0; {kv} < {}LL; ++{kv})",
                kernel[d]
            ));
            e.line(format!(
                "const i64 {pv} = {} * {}LL - {}LL + {kv} * {}LL;",
                oidx[lead + d],
                stride[d],
                padding[d],
                dilation[d]
            ));
            e.line(format!(
                "if ({pv} < 0 || {pv} >= {}) continue;",
                e.dim(&xs[lead + d])
            ));
            xidx.push(pv);
        }
        let v = e.value(x, &xidx)?;
        e.line(format!("const {acc} t = ({acc}){v};"));
        e.line("nan |= t != t; mx = t > mx ? t : mx; sum += t; cnt += 1;");
        for _ in 0..sp {
            e.close();
        }
        let result = match kind {
            PoolKind::Max => format!(
                "nan ? ({acc})({}) : mx",
                if acc == "double" {
                    "EMBER_NAN64"
                } else {
                    "EMBER_NAN"
                }
            ),
            PoolKind::Avg {
                divisor: Some(d), ..
            } => format!("sum / ({acc}){d}"),
            PoolKind::Avg {
                count_include_pad: true,
                ..
            } => {
                let mut size = Vec::new();
                for d in 0..sp {
                    let start =
                        format!("({} * {}LL - {}LL)", oidx[lead + d], stride[d], padding[d]);
                    size.push(format!(
                        "(ember_dmin({start} + {}LL, {} + {}LL) - {start})",
                        kernel[d],
                        e.dim(&xs[lead + d]),
                        padding[d]
                    ));
                }
                format!("sum / ({acc})({})", size.join(" * "))
            }
            PoolKind::Avg { .. } => format!("sum / ({acc})cnt"),
        };
        e.line(format!("out[i] = {};", store(dtype, &result)));
        e.close();
        let body = Body::of(e, false);
        Ok(self.add(id, body, Launch::Elements(numel(&out))))
    }

    /// `Scatter` in two launches on the same output: a copy of the input, then one thread
    /// per update (atomic when updates combine).
    pub fn scatter_steps(&mut self, id: usize) -> Result<Vec<StepKind>, CodegenError> {
        let g = self.g;
        let n = &g.nodes[id];
        let Op::Scatter { axis, reduce } = n.op else {
            return Err(err(g, id, "internal: not a scatter"));
        };
        let (x, index, updates) = (n.inputs[0], n.inputs[1], n.inputs[2]);
        let dtype = n.ty.dtype;
        let shape = n.ty.shape.clone();
        if reduce != ScatterReduce::None && !matches!(dtype.size(), 4 | 8) {
            return Err(err(
                g,
                id,
                format!(
                    "a {reduce:?} scatter of {dtype} (CUDA atomics take 32- and 64-bit values)"
                ),
            ));
        }
        // 1. out = x
        let mut e = self.emitter(None);
        e.line(format!("const i64 n = {};", e.dims.product(&shape)));
        e.open(GRID_STRIDE);
        let idx = e.unravel("i", &shape);
        let v = e.value(x, &idx)?;
        e.line(format!("out[i] = {};", store(dtype, &v)));
        e.close();
        let copy = Body::of(e, false);
        let copy = self.add(id, copy, Launch::Elements(numel(&shape)));
        // 2. one thread per update
        let ishape = g.nodes[index].ty.shape.clone();
        let mut e = self.emitter(None);
        e.line(format!("const i64 n = {};", e.dims.product(&ishape)));
        e.open(GRID_STRIDE);
        let idx = e.unravel("i", &ishape);
        let j = e.value(index, &idx)?;
        let len = e.dim(&shape[axis]);
        e.line(format!(
            "const i64 j = ember_index(meta, (i64){j}, {len}, {id}LL);"
        ));
        let mut at = idx.clone();
        at[axis] = "j".into();
        let off = e.offset(&at, &shape);
        let u = e.value(updates, &idx)?;
        let st = storage_type(dtype);
        let stored = store(dtype, &u);
        match reduce {
            ScatterReduce::None => e.line(format!("out[{off}] = {stored};")),
            r => {
                let f = match (r, dtype.kind() == Kind::Float) {
                    (ScatterReduce::Add, _) => "EmberSum()",
                    (ScatterReduce::Mul, _) => "EmberProd()",
                    (ScatterReduce::Max, _) => "EmberIMax()",
                    _ => "EmberIMin()",
                };
                e.line(format!(
                    "ember_atomic_update<{st}>(&out[{off}], {stored}, {f});"
                ));
            }
        }
        e.close();
        let body = Body::of(e, false);
        let write = self.add(id, body, Launch::Elements(numel(&ishape)));
        Ok(vec![copy, write])
    }

    /// Matrix product with one thread per output element: for dtypes cuBLASLt does not
    /// take (integers), and the optimizer's `cuda.thread_dot` choice.
    fn dot(
        &mut self,
        products: &[usize],
        epilogue: Option<usize>,
    ) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let id = products[0];
        let n = &g.nodes[id];
        let acc = accumulate_type(n.ty.dtype);
        let ash = g.nodes[n.inputs[0]].ty.shape.clone();
        let out = n.ty.shape.clone();
        let r = out.len();
        let mut e = self.emitter(epilogue);
        e.line(format!("const i64 n = {};", e.dims.product(&out)));
        e.line(format!("const i64 K = {};", e.dim(&ash[r - 1])));
        e.open(GRID_STRIDE);
        let oidx = e.unravel("i", &out);
        for k in 0..products.len() {
            e.line(format!("{acc} {} = 0;", sum_name(k)));
        }
        e.open("for (i64 k = 0; k < K; ++k)");
        product_terms(&mut e, products, &oidx, acc)?;
        e.close();
        write_product(&mut e, products, epilogue)?;
        e.close();
        let body = Body::of(e, false);
        Ok(self.add(epilogue.unwrap_or(id), body, Launch::Elements(numel(&out))))
    }
}

/// The variable the emitted code sums product `k` of a kernel in.
fn sum_name(k: usize) -> String {
    match k {
        0 => "s".into(),
        k => format!("s{k}"),
    }
}

/// `out[i] = ` element `i` of the kernel's product (its sum in `s`), or with `epilogue`,
/// that node's element `i` computed from the products' sums in place.
fn write_product(
    e: &mut Emitter<'_>,
    products: &[usize],
    epilogue: Option<usize>,
) -> Result<(), CodegenError> {
    let (node, value) = match epilogue {
        None => (products[0], "s".to_string()),
        Some(root) => {
            for (k, &p) in products.iter().enumerate() {
                e.bind(p, &sum_name(k));
            }
            let shape = e.g.nodes[root].ty.shape.clone();
            let idx = e.unravel("i", &shape);
            (root, e.value(root, &idx)?)
        }
    };
    let dtype = e.g.nodes[node].ty.dtype;
    e.line(format!("out[i] = {};", store(dtype, &value)));
    Ok(())
}

/// [`product_term`] of each of `products` (same shapes), into `s`, `s1`, ….
fn product_terms(
    e: &mut Emitter<'_>,
    products: &[usize],
    out_idx: &[String],
    acc: &str,
) -> Result<(), CodegenError> {
    for (k, &p) in products.iter().enumerate() {
        let pn = &e.g.nodes[p];
        let operands = (pn.inputs[0], pn.inputs[1]);
        product_term(e, operands, out_idx, acc, &sum_name(k))?;
    }
    Ok(())
}

/// `sum += a[.., m, k] * b[.., k, n]` for the output element at `out_idx` (`[.., m, n]`)
/// and the emitted code's `k`: the term both generated product kernels sum.
fn product_term(
    e: &mut Emitter<'_>,
    (a, b): (usize, usize),
    out_idx: &[String],
    acc: &str,
    sum: &str,
) -> Result<(), CodegenError> {
    let r = out_idx.len();
    let mut ai = out_idx[..r - 1].to_vec();
    ai.push("k".into());
    let mut bi = out_idx[..r - 2].to_vec();
    bi.push("k".into());
    bi.push(out_idx[r - 1].clone());
    let av = e.value(a, &ai)?;
    let bv = e.value(b, &bi)?;
    e.line(format!("{sum} += ({acc}){av} * ({acc}){bv};"));
    Ok(())
}

/// `o[c] = Σ_j p[j] · v[j, c]` for the keys `j0 + jj`, `jj < n`, of one row, where `probs`
/// holds `p[j0 + jj]` at `jj`; then `o = finish` and `write(o)` for each column `c < EV`.
/// With fewer value columns than threads (a decode step: one query row, 64 columns, 256
/// threads) G groups of EV threads each take every G-th key and the groups' partial sums
/// meet in `smem`; otherwise each thread sums every key for its columns. Every thread of
/// the block must reach it (it synchronizes).
fn weighted_values(
    e: &mut Emitter<'_>,
    v: usize,
    at: &dyn Fn([&str; 2]) -> Vec<String>,
    acc: &str,
    (probs, j0, n): (&str, &str, &str),
    finish: &str,
    write: &dyn Fn(&str) -> String,
) -> Result<(), CodegenError> {
    e.line("const i64 G = EV < (i64)blockDim.x ? (i64)blockDim.x / EV : 1;");
    e.open("if (G > 1)");
    e.line("const i64 grp = (i64)threadIdx.x / EV, c = (i64)threadIdx.x % EV;");
    e.line(format!("{acc} o = 0;"));
    e.open("if (grp < G)");
    e.open(format!("for (i64 jj = grp; jj < {n}; jj += G)"));
    e.line(format!("const i64 j = {j0} + jj;"));
    let vv = e.value(v, &at(["j", "c"]))?;
    e.line(format!("o += {probs}[jj] * ({acc}){vv};"));
    e.close();
    e.close();
    e.line("smem[threadIdx.x] = o;");
    e.line("__syncthreads();");
    e.open("if ((i64)threadIdx.x < EV)");
    e.line("o = 0;");
    e.line("for (i64 q = 0; q < G; ++q) o += smem[q * EV + c];");
    e.line(format!("o = {finish};"));
    e.line(write("o"));
    e.close();
    e.close();
    e.open("else");
    e.open("for (i64 c = threadIdx.x; c < EV; c += blockDim.x)");
    e.line(format!("{acc} o = 0;"));
    e.open(format!("for (i64 jj = 0; jj < {n}; ++jj)"));
    e.line(format!("const i64 j = {j0} + jj;"));
    let vv = e.value(v, &at(["j", "c"]))?;
    e.line(format!("o += {probs}[jj] * ({acc}){vv};"));
    e.close();
    e.line(format!("o = {finish};"));
    e.line(write("o"));
    e.close();
    e.close();
    Ok(())
}
