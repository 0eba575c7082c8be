//! Generated matrix products: a thread per output element (integers, 8-bit `integer_dot`,
//! and the optimizer's `cuda.thread_dot`), the grouped product of mixture-of-experts
//! layers, and the epilogue and operand code they share with `warp_dot`.

use ember_core::dim::numel;

use super::super::emit::Emitter;
use super::super::types::{accumulate_type, store};
use super::super::{CodegenError, Launch, StepKind};
use super::{Body, Generator, GRID_STRIDE};

impl Generator<'_> {
    /// Grouped matrix product: one thread per output element finds its row's group
    /// (ends clamped into [previous end, S]) and sums over K; rows past the last end are 0.
    pub(super) fn grouped_dot(&mut self, id: usize) -> Result<StepKind, CodegenError> {
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

    /// Product with a block-quantized weight (`BlockQuantDot`), one warp per output
    /// element: lanes take every 32nd term, unpacking their weight value from its byte
    /// (`bits` wide, low bits first) as `(q − zero) · scale`. The weight is read at its
    /// packed size, which is what a decode step's matrix-vector products are bound by.
    pub(super) fn block_quant_dot(
        &mut self,
        id: usize,
        bits: u8,
        block: usize,
    ) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let n = &g.nodes[id];
        let dtype = n.ty.dtype;
        let acc = accumulate_type(dtype);
        let [x, w, scales, zeros] = n.inputs[..] else {
            return Err(CodegenError {
                op: n.op.name(),
                node: n.origin.to_string(),
                detail: format!("takes 4 inputs, got {}", n.inputs.len()),
            });
        };
        let out = n.ty.shape.clone();
        let mut e = self.emitter(None);
        e.line(format!("__shared__ {acc} smem[1024];"));
        e.line(format!("const i64 n = {};", e.dims.product(&out)));
        e.line(format!("const i64 K = {};", e.dim(&g.nodes[x].ty.shape[1])));
        e.line("const i64 lane = threadIdx.x & 31;");
        e.open("for (i64 base = (i64)blockIdx.x * blockDim.x; base < n * 32; base += (i64)gridDim.x * blockDim.x)");
        e.line("const i64 i = (base + threadIdx.x) >> 5;");
        e.line(format!("{acc} s = 0;"));
        e.open("if (i < n)");
        let oidx = e.unravel("i", &out);
        let (row, col) = (oidx[0].clone(), oidx[1].clone());
        e.line("#pragma unroll 4");
        e.open("for (i64 k = lane; k < K; k += 32)");
        e.line(format!("const i64 blk = k / {block};"));
        let byte = e.value(w, &[col.clone(), format!("(k * {bits}) / 8")])?;
        let scale = e.value(scales, &[col.clone(), "blk".into()])?;
        let zero = e.value(zeros, &[col, "blk".into()])?;
        let xv = e.value(x, &[row, "k".into()])?;
        e.line(format!(
            "const unsigned q = ((unsigned)({byte}) >> ((k * {bits}) % 8)) & {}u;",
            (1u32 << bits) - 1
        ));
        e.line(format!(
            "s += ({acc})({xv}) * ((({acc})q - ({acc})({zero})) * ({acc})({scale}));"
        ));
        e.close();
        e.close();
        e.line("s = ember_warp_reduce(s, smem, EmberSum());");
        e.open("if (i < n && lane == 0)");
        e.line(format!("out[i] = {};", store(dtype, "s")));
        e.close();
        e.close();
        let body = Body::of(e, true);
        let threads = numel(&out) * ember_core::dim::Dim::from(32usize);
        Ok(self.add(id, body, Launch::Elements(threads)))
    }

    /// Matrix product with one thread per output element: for dtypes cuBLASLt does not
    /// take (integers), and the optimizer's `cuda.thread_dot` choice.
    pub(super) fn dot(
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
pub(super) fn sum_name(k: usize) -> String {
    match k {
        0 => "s".into(),
        k => format!("s{k}"),
    }
}

/// `out[i] = ` element `i` of the kernel's product (its sum in `s`), or with `epilogue`,
/// that node's element `i` computed from the products' sums in place.
pub(super) fn write_product(
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
pub(super) fn product_term(
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
