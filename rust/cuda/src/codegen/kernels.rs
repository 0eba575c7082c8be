//! Kernel templates: one per kind of root op. Each reads its inputs through the emitter
//! (so fused producers are computed in place) and writes its root's contiguous output.
//! Identical kernels (same text up to the name) are generated once.
//!
//! This module holds the generator, the dispatch by op and the elementwise kernels; the
//! other templates live by kind in `rows` (reductions, softmax, norms, cumsum, argsort),
//! `attention` (with `tiled_attention`, `mma_attention`, `split_attention`), `product`
//! (with `warp_dot`), `window` (conv, pool) and `scatter`.

use std::collections::HashMap;

use ember_core::dim::{numel, Dim};
use ember_core::ir::{Graph, Op};

use super::emit::{param_decl, Emitter};
use super::types::{storage_type, store};
use super::{CodegenError, Kernel, Launch, StepKind};

mod attention;
mod mma_attention;
mod product;
mod rows;
mod scatter;
mod split_attention;
mod tiled_attention;
mod warp_dot;
mod window;

// What the attention and product kernels share, for their sibling modules (`super::…`).
use attention::{weighted_values, AttentionParts, RowIndex};
pub use mma_attention::mma_attention_applies;
use product::{sum_name, write_product};

const NAME: &str = "@KERNEL@";
/// The loop giving each thread its elements `i < n`, whatever the grid's size.
const GRID_STRIDE: &str =
    "for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)";

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
    /// The accumulator type of the partial results it writes and combines, their count
    /// and the count of its counters (`StepKind::Kernel::partials`).
    partials: Option<(&'static str, (Dim, Dim))>,
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
            params.push("i64* __restrict__ cnt".into());
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
            Op::LayerNorm { .. } | Op::RmsNorm { .. } => self.norm_kernel(id, None),
            Op::Scan { axis, op } => self.scan(id, *axis, *op),
            Op::Argsort { axis, descending } => self.argsort(id, *axis, *descending),
            Op::GroupedDot => self.grouped_dot(id),
            Op::BlockQuantDot { bits, block } => self.block_quant_dot(id, *bits, *block),
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
            Op::Dot | Op::IntegerDot | Op::Kernel { .. } => self.product_kernel(&[id], None),
            _ => self.elementwise(id, Some(id)),
        }
    }

    /// The kernel of norm `id`, writing `epilogue` (a pointwise chain's end) if given.
    pub fn norm_kernel(
        &mut self,
        id: usize,
        epilogue: Option<usize>,
    ) -> Result<StepKind, CodegenError> {
        match self.g.nodes[id].op {
            Op::LayerNorm {
                axis,
                eps,
                has_weight,
                has_bias,
            } => self.norm(id, axis, eps, has_weight, has_bias, false, epilogue),
            Op::RmsNorm {
                axis,
                eps,
                has_weight,
            } => self.norm(id, axis, eps, has_weight, false, true, epilogue),
            _ => Err(err(self.g, id, "not a norm")),
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
}
