//! Kernels over rows of one axis: reductions (one block per output, Kahan-compensated
//! float sums, NaN-propagating max/min, first-index argmax/argmin), softmax and log-softmax,
//! layer and RMS norm, cumsum, argsort.

use ember_core::dim::{numel, Dim};
use ember_core::dtype::Kind;
use ember_core::ir::{ReduceOp, ScanOp};

use super::super::emit::Emitter;
use super::super::types::{accumulate_type, store};
use super::super::{CodegenError, Launch, StepKind};
use super::{err, inf, Body, Generator, GRID_STRIDE};

/// Emits the work on one element of a norm's row: (emitter, trailing index, value).
type RowBody<'f> = dyn Fn(&mut Emitter, &[String], &str) -> Result<(), CodegenError> + 'f;

impl Generator<'_> {
    pub(super) fn reduce(
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
    pub(super) fn with_axis(row: &[String], axis: usize, j: &str) -> Vec<String> {
        let mut idx = row.to_vec();
        idx.insert(axis, j.to_string());
        idx
    }

    pub(super) fn softmax(
        &mut self,
        id: usize,
        axis: usize,
        log: bool,
    ) -> Result<StepKind, CodegenError> {
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

    /// Layer norm (two-pass mean and variance) or RMS norm over the dims from `axis` on;
    /// with `epilogue`, writing instead that node: the end of a chain of pointwise ops the
    /// norm flows through alone, computed from each normalized value in place
    /// (`norm_epilogue` in `codegen/mod.rs`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm(
        &mut self,
        id: usize,
        axis: usize,
        eps: f64,
        has_weight: bool,
        has_bias: bool,
        rms: bool,
        epilogue: Option<usize>,
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
        let mut e = self.emitter(epilogue);
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
            let (node, value) = match epilogue {
                None => (id, y),
                Some(root) => {
                    // The chain keeps the elements' order: the root's element at this
                    // linear index reads the norm's only here.
                    e.bind(id, &y);
                    let shape = g.nodes[root].ty.shape.clone();
                    let ridx = e.unravel("row * width + j", &shape);
                    (root, e.value(root, &ridx)?)
                }
            };
            let stored = store(g.nodes[node].ty.dtype, &value);
            e.line(format!("out[row * width + j] = {stored};"));
            Ok(())
        })?;
        e.close();
        let body = Body::of(e, true);
        Ok(self.add(
            epilogue.unwrap_or(id),
            body,
            Launch::Rows {
                rows: numel(&lead),
                width: numel(&trail),
            },
        ))
    }

    /// One thread per line along `axis`, accumulating serially. Max/min take the element
    /// when it is ≥ (≤) the running value or NaN, so a NaN stays once seen, as in torch.
    pub(super) fn scan(
        &mut self,
        id: usize,
        axis: usize,
        op: ScanOp,
    ) -> Result<StepKind, CodegenError> {
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
        e.line(format!(
            "{acc} a = {};",
            if op == ScanOp::Prod { 1 } else { 0 }
        ));
        e.open("for (i64 j = 0; j < len; ++j)");
        let idx = Self::with_axis(&lidx, axis, "j");
        let v = e.value(x, &idx)?;
        e.line(format!("const {acc} v = ({acc}){v};"));
        e.line(match op {
            ScanOp::Sum => "a += v;",
            ScanOp::Prod => "a *= v;",
            ScanOp::Max => "a = (j == 0 || v >= a || v != v) ? v : a;",
            ScanOp::Min => "a = (j == 0 || v <= a || v != v) ? v : a;",
        });
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
    pub(super) fn argsort(
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
}
