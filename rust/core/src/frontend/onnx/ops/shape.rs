//! Shape and layout ops: Shape, Size, Reshape, Flatten, Transpose, Concat, Expand, Unsqueeze,
//! Squeeze, Slice, Split, Tile, Pad. Shape-valued results stay known (as `Dim`s) so that
//! later Reshapes and Expands get IR dims, symbolic ones included.

use super::{axes, axis, one, Handler};
use crate::dim::{numel, Dim, DimOp};
use crate::dtype::{DType, Scalar};
use crate::error::Result;
use crate::frontend::builder::broadcast_shapes;
use crate::frontend::onnx::known::Known;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{Op, ValueId};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "Shape" => shape,
        "Size" => size,
        "Reshape" => reshape,
        "Flatten" => flatten,
        "Transpose" => transpose,
        "Concat" => concat,
        "Expand" => expand,
        "Unsqueeze" => unsqueeze,
        "Squeeze" => squeeze,
        "Slice" => slice,
        "Split" => split,
        "Tile" => tile,
        "Pad" => pad,
        "DepthToSpace" | "SpaceToDepth" => depth_space,
        _ => return None,
    })
}

/// The shape of input 0 without making an IR value for it (a known value's own shape).
fn input_shape(ctx: &mut Ctx, n: &Node) -> Result<Vec<Dim>> {
    if let Some(k) = ctx.known(n, 0) {
        return Ok(k.shape().into_iter().map(Dim::from).collect());
    }
    let x = ctx.input(n, 0)?;
    Ok(ctx.b.shape(x))
}

fn shape(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let dims = input_shape(ctx, n)?;
    let r = dims.len() as i64;
    let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
    let start = clamp(n.int("start", 0)?);
    let end = clamp(n.int("end", r)?);
    let dims = dims[start..end.max(start)].to_vec();
    Ok(vec![Val::known(Known::vector(DType::I64, dims))])
}

fn size(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let dims = input_shape(ctx, n)?;
    Ok(vec![Val::known(Known::scalar(DType::I64, numel(&dims)))])
}

/// A known value passes through a reshape to rank ≤ 1 unchanged.
fn reshape_known(k: Known, shape: &[Dim]) -> Option<Val> {
    match shape {
        [] if k.dims.len() == 1 => Some(Val::known(Known { scalar: true, ..k })),
        [d] if d.as_const() == Some(k.dims.len() as i64) => {
            Some(Val::known(Known { scalar: false, ..k }))
        }
        _ => None,
    }
}

/// Reshape target: `0` copies the input dim (unless `allowzero`), one `-1` is inferred.
fn target_shape(n: &Node, input: &[Dim], spec: &[Dim], allow_zero: bool) -> Result<Vec<Dim>> {
    let mut out = Vec::with_capacity(spec.len());
    let mut hole = None;
    for (i, d) in spec.iter().enumerate() {
        match d.as_const() {
            Some(0) if !allow_zero => out.push(input.get(i).cloned().ok_or_else(|| {
                n.err(format!(
                    "shape entry {i} is 0 but the input has rank {}",
                    input.len()
                ))
            })?),
            Some(-1) if hole.is_none() => {
                hole = Some(i);
                out.push(Dim::Const(1));
            }
            Some(v) if v < 0 => return Err(n.err(format!("invalid shape entry {v}"))),
            _ => out.push(d.clone()),
        }
    }
    let total = numel(input);
    if let Some(i) = hole {
        let known = numel(&out);
        if known.as_const() == Some(0) {
            return Err(n.err("cannot infer -1 next to a zero-sized dim"));
        }
        out[i] = Dim::binary(DimOp::FloorDiv, total.clone(), known);
    }
    if let (Some(a), Some(b)) = (total.as_const(), numel(&out).as_const()) {
        if a != b {
            return Err(crate::error::Error::Shape(format!(
                "cannot reshape {} into {} at ONNX Reshape node '{}'",
                crate::dim::format_shape(input),
                crate::dim::format_shape(&out),
                n.name
            )));
        }
    }
    Ok(out)
}

fn reshape(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let spec = ctx.known_required(n, 1, "target shape")?;
    if spec.scalar {
        return Err(n.err("the target shape must be 1-D"));
    }
    let allow_zero = n.flag("allowzero", false)?;
    let input = input_shape(ctx, n)?;
    let target = target_shape(n, &input, &spec.dims, allow_zero)?;
    if let Some(k) = ctx.known(n, 0) {
        if let Some(v) = reshape_known(k, &target) {
            return Ok(vec![v]);
        }
    }
    let x = ctx.input(n, 0)?;
    one(ctx.b.reshape(x, target)?)
}

fn flatten(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let s = ctx.b.shape(x);
    let r = s.len() as i64;
    let a = n.int("axis", 1)?;
    let a = if a < 0 { a + r } else { a };
    if a < 0 || a > r {
        return Err(n.err(format!("axis {a} out of range for rank {r}")));
    }
    let a = a as usize;
    one(ctx.b.reshape(x, vec![numel(&s[..a]), numel(&s[a..])])?)
}

fn transpose(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let r = ctx.b.rank(x);
    let perm = match n.ints("perm")? {
        Some(p) => {
            // ONNX perms are non-negative (unlike most axis lists).
            let p: Vec<usize> = p
                .iter()
                .map(|&a| usize::try_from(a).unwrap_or(usize::MAX))
                .collect();
            let mut sorted = p.clone();
            sorted.sort_unstable();
            if p.len() != r || sorted != (0..r).collect::<Vec<_>>() {
                return Err(n.err(format!("perm {p:?} is not a permutation of {r} axes")));
            }
            p
        }
        None => (0..r).rev().collect(),
    };
    one(ctx.b.permute(x, perm)?)
}

fn concat(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let names = n.inputs();
    if names.is_empty() {
        return Err(n.err("needs at least one input"));
    }
    // Concatenating known 1-D values (shape pieces) stays known.
    let knowns: Option<Vec<Known>> = (0..n.num_inputs())
        .filter(|&k| n.input(k).is_some())
        .map(|k| ctx.known(n, k))
        .collect();
    if let Some(ks) = knowns {
        if ks.iter().all(|k| !k.scalar && k.dtype == ks[0].dtype) {
            let dims = ks.iter().flat_map(|k| k.dims.clone()).collect();
            return Ok(vec![Val::known(Known::vector(ks[0].dtype, dims))]);
        }
    }
    let ids = names
        .iter()
        .map(|name| ctx.value(name))
        .collect::<Result<Vec<_>>>()?;
    super::elementwise::same_dtype(ctx, n, &ids)?;
    let r = ctx.b.rank(ids[0]);
    let a = axis(ctx, n.int("axis", 0)?, r)?;
    if ids.len() == 1 {
        return one(ids[0]);
    }
    one(ctx.b.concat(&ids, a)?)
}

fn expand(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let spec = ctx.known_required(n, 1, "target shape")?;
    let x = ctx.input(n, 0)?;
    // Expand broadcasts both ways: a 1 in the target keeps the input's dim.
    let out = broadcast_shapes(&ctx.b.shape(x), &spec.dims).map_err(|e| n.err(e.to_string()))?;
    one(ctx.b.broadcast_to(x, &out)?)
}

/// Axes from input 1 (opset ≥ 13) or the `axes` attribute (older models).
fn axes_list(ctx: &Ctx, n: &Node) -> Result<Option<Vec<i64>>> {
    if n.input(1).is_some() {
        return Ok(Some(ctx.const_ints(n, 1, "axes")?));
    }
    n.ints("axes")
}

fn unsqueeze(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let list = axes_list(ctx, n)?.ok_or_else(|| n.err("needs axes"))?;
    let input = input_shape(ctx, n)?;
    let out_rank = input.len() + list.len();
    let ax = axes(ctx, n, &list, out_rank)?;
    let mut out = Vec::with_capacity(out_rank);
    let mut it = input.into_iter();
    for i in 0..out_rank {
        if ax.contains(&i) {
            out.push(Dim::Const(1));
        } else {
            out.push(it.next().expect("rank adds up"));
        }
    }
    if let Some(k) = ctx.known(n, 0) {
        if let Some(v) = reshape_known(k, &out) {
            return Ok(vec![v]);
        }
    }
    let x = ctx.input(n, 0)?;
    one(ctx.b.reshape(x, out)?)
}

fn squeeze(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let input = input_shape(ctx, n)?;
    let ax = match axes_list(ctx, n)? {
        Some(list) if !list.is_empty() => {
            let ax = axes(ctx, n, &list, input.len())?;
            if let Some(&a) = ax
                .iter()
                .find(|&&a| input[a].as_const().is_some_and(|d| d != 1))
            {
                return Err(n.err(format!("cannot squeeze axis {a} of size {}", input[a])));
            }
            ax
        }
        // No axes: every dim known to be 1 (a symbolic dim is taken as not 1).
        _ => (0..input.len())
            .filter(|&i| input[i].as_const() == Some(1))
            .collect(),
    };
    let out: Vec<Dim> = input
        .iter()
        .enumerate()
        .filter(|(i, _)| !ax.contains(i))
        .map(|(_, d)| d.clone())
        .collect();
    if let Some(k) = ctx.known(n, 0) {
        if let Some(v) = reshape_known(k, &out) {
            return Ok(vec![v]);
        }
    }
    let x = ctx.input(n, 0)?;
    one(ctx.b.reshape(x, out)?)
}

/// A slice bound normalized against `size` the way ONNX clamps it: negative values count
/// from the end; the result lies in `[lo, size + hi_off]`.
fn clamp_bound(v: &Dim, size: &Dim, lo: i64, hi_off: i64) -> Dim {
    let hi = Dim::binary(DimOp::Add, size.clone(), Dim::Const(hi_off));
    let v = match v.as_const() {
        // INT64_MAX-style "to the end" markers.
        Some(c) if c >= i32::MAX as i64 => return hi,
        Some(c) if c <= i32::MIN as i64 => return Dim::Const(lo),
        Some(c) if c < 0 => Dim::binary(DimOp::Add, size.clone(), Dim::Const(c)),
        Some(c) if c == lo.max(0) => return Dim::Const(c),
        Some(_) => v.clone(),
        // A symbolic bound is a size (never negative); the common `x[:n]` with n the whole
        // dim keeps the plain dim instead of min(n, n).
        None if *v == hi => return hi,
        None => return Dim::binary(DimOp::Min, v.clone(), hi),
    };
    let v = Dim::binary(DimOp::Max, v, Dim::Const(lo));
    Dim::binary(DimOp::Min, v, hi)
}

/// One axis of a Slice: `(start, end, step)` with ONNX semantics, negative steps included.
fn slice_axis(
    ctx: &mut Ctx,
    x: ValueId,
    a: usize,
    start: &Dim,
    end: &Dim,
    step: i64,
) -> Result<ValueId> {
    let size = ctx.b.shape(x)[a].clone();
    if step > 0 {
        let s = clamp_bound(start, &size, 0, 0);
        let e = clamp_bound(end, &size, 0, 0);
        let e = Dim::binary(DimOp::Max, e, s.clone());
        if s.as_const() == Some(0) && e == size && step == 1 {
            return Ok(x);
        }
        return ctx.b.slice(x, a, s, e, step);
    }
    // Negative step: elements start, start+step, … > end, read from the flipped axis.
    let s = clamp_bound(start, &size, 0, -1);
    let e = clamp_bound(end, &size, -1, -1);
    let last = Dim::binary(DimOp::Sub, size.clone(), Dim::Const(1));
    let fs = Dim::binary(DimOp::Sub, last.clone(), s);
    let fe = Dim::binary(DimOp::Sub, last, e);
    let fs = Dim::binary(DimOp::Max, fs, Dim::Const(0));
    let fe = Dim::binary(DimOp::Max, fe, fs.clone());
    let flipped = ctx.b.op(Op::Flip { axes: vec![a] }, &[x])?;
    ctx.b.slice(flipped, a, fs, fe, -step)
}

fn slice(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let starts = ctx.known_required(n, 1, "starts")?.dims;
    let ends = ctx.known_required(n, 2, "ends")?.dims;
    let rank = input_shape(ctx, n)?.len();
    let axes_in = if n.input(3).is_some() {
        ctx.const_ints(n, 3, "axes")?
    } else {
        (0..starts.len() as i64).collect()
    };
    let steps = if n.input(4).is_some() {
        ctx.const_ints(n, 4, "steps")?
    } else {
        vec![1; starts.len()]
    };
    if ends.len() != starts.len() || axes_in.len() != starts.len() || steps.len() != starts.len() {
        return Err(n.err("starts, ends, axes and steps must have one length"));
    }
    if steps.contains(&0) {
        return Err(n.err("steps must not be 0"));
    }
    let ax = axes_in
        .iter()
        .map(|&a| axis(ctx, a, rank))
        .collect::<Result<Vec<_>>>()?;
    // Slicing a known shape vector with constant bounds stays known.
    if let Some(k) = ctx.known(n, 0) {
        if let (false, Some(s), Some(e)) = (
            k.scalar,
            starts.first().and_then(Dim::as_const),
            ends.first().and_then(Dim::as_const),
        ) {
            if starts.len() == 1 && steps[0] == 1 {
                let len = k.dims.len() as i64;
                let norm = |v: i64| (if v < 0 { v + len } else { v }).clamp(0, len) as usize;
                let (s, e) = (norm(s), norm(e));
                let dims = k.dims[s..e.max(s)].to_vec();
                return Ok(vec![Val::known(Known::vector(k.dtype, dims))]);
            }
        }
    }
    let mut x = ctx.input(n, 0)?;
    for i in 0..ax.len() {
        x = slice_axis(ctx, x, ax[i], &starts[i], &ends[i], steps[i])?;
    }
    one(x)
}

fn split(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let shape = ctx.b.shape(x);
    let a = axis(ctx, n.int("axis", 0)?, shape.len())?;
    let size = shape[a].clone();
    let count = n.num_outputs();
    let sizes: Vec<Dim> = if n.input(1).is_some() {
        ctx.known_required(n, 1, "split sizes")?.dims
    } else if let Some(s) = n.ints("split")? {
        s.into_iter().map(Dim::Const).collect()
    } else {
        if count == 0 {
            return Err(n.err("has no outputs"));
        }
        let parts = n.int("num_outputs", count as i64)?;
        if parts != count as i64 {
            return Err(n.err(format!(
                "num_outputs is {parts} but the node has {count} outputs"
            )));
        }
        // Equal parts; from opset 18 the last one may be smaller (ceil division).
        let c = Dim::Const(count as i64);
        let chunk = Dim::binary(
            DimOp::FloorDiv,
            Dim::binary(DimOp::Add, size.clone(), Dim::Const(count as i64 - 1)),
            c,
        );
        let mut v = vec![chunk.clone(); count - 1];
        let used = Dim::binary(DimOp::Mul, chunk, Dim::Const(count as i64 - 1));
        v.push(Dim::binary(DimOp::Sub, size.clone(), used));
        v
    };
    if sizes.len() != count {
        return Err(n.err(format!("{} split sizes for {count} outputs", sizes.len())));
    }
    if let (Some(total), Some(parts)) = (
        size.as_const(),
        sizes.iter().map(Dim::as_const).collect::<Option<Vec<_>>>(),
    ) {
        if parts.iter().any(|&p| p < 0) || parts.iter().sum::<i64>() != total {
            return Err(n.err(format!("split sizes {parts:?} do not add up to {total}")));
        }
    }
    let mut start = Dim::Const(0);
    let mut outs = Vec::with_capacity(count);
    for s in sizes {
        let end = Dim::binary(DimOp::Add, start.clone(), s);
        outs.push(Val::of(ctx.b.slice(x, a, start.clone(), end.clone(), 1)?));
        start = end;
    }
    Ok(outs)
}

/// Tile: `[d]` repeated `r` times is `[r, d]` broadcast and flattened (repeats outermost).
fn tile(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let reps = ctx.known_required(n, 1, "repeats")?.dims;
    let shape = ctx.b.shape(x);
    if reps.len() != shape.len() {
        return Err(n.err(format!(
            "{} repeats for a tensor of rank {}",
            reps.len(),
            shape.len()
        )));
    }
    if reps.iter().any(|r| r.as_const().is_some_and(|v| v < 0)) {
        return Err(n.err("repeats must be non-negative"));
    }
    let mut with_ones = Vec::new();
    let mut expanded = Vec::new();
    let mut out = Vec::new();
    for (d, r) in shape.iter().zip(&reps) {
        with_ones.extend([Dim::Const(1), d.clone()]);
        expanded.extend([r.clone(), d.clone()]);
        out.push(Dim::binary(DimOp::Mul, r.clone(), d.clone()));
    }
    let v = ctx.b.reshape(x, with_ones)?;
    let v = ctx.b.broadcast_to(v, &expanded)?;
    one(ctx.b.reshape(v, out)?)
}

/// Pad: constant, edge, reflect and wrap modes; negative pads crop.
fn pad(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let mode = n.string("mode", "constant")?;
    if !matches!(mode.as_str(), "constant" | "edge" | "reflect" | "wrap") {
        return Err(n.err(format!("unknown mode '{mode}'")));
    }
    let x = ctx.input(n, 0)?;
    let rank = ctx.b.rank(x);
    let pads = ctx.const_ints(n, 1, "pads")?;
    let ax: Vec<usize> = if n.input(3).is_some() {
        let list = ctx.const_ints(n, 3, "axes")?;
        list.iter()
            .map(|&a| axis(ctx, a, rank))
            .collect::<Result<_>>()?
    } else {
        (0..rank).collect()
    };
    if pads.len() != 2 * ax.len() {
        return Err(n.err(format!(
            "{} pads for {} axes (need two per axis)",
            pads.len(),
            ax.len()
        )));
    }
    let dtype = ctx.b.dtype(x);
    let value = match n.input(2) {
        None => Scalar::Int(0),
        Some(_) => {
            let v = ctx
                .const_floats(n, 2)
                .ok_or_else(|| n.unsupported("its constant_value is computed at run time"))?;
            let v = v.first().copied().unwrap_or(0.0);
            if dtype.is_float() {
                Scalar::Float(v)
            } else if dtype == DType::Bool {
                Scalar::Bool(v != 0.0)
            } else {
                Scalar::Int(v as i64)
            }
        }
    };
    let mut full = vec![(0i64, 0i64); rank];
    let mut x = x;
    for (i, &a) in ax.iter().enumerate() {
        let (before, after) = (pads[i], pads[i + ax.len()]);
        // Negative pads remove elements.
        if before < 0 || after < 0 {
            let size = ctx.b.shape(x)[a].clone();
            let s = Dim::Const((-before).max(0));
            let e = Dim::binary(DimOp::Sub, size, Dim::Const((-after).max(0)));
            x = ctx.b.slice(x, a, s, e, 1)?;
        }
        full[a] = (before.max(0), after.max(0));
    }
    if full.iter().all(|&p| p == (0, 0)) {
        return one(x);
    }
    if mode == "constant" {
        return one(ctx.b.op(Op::Pad { pads: full, value }, &[x])?);
    }
    for (a, &(before, after)) in full.iter().enumerate() {
        if (before, after) != (0, 0) {
            x = pad_from_edges(ctx, n, x, a, before, after, &mode)?;
        }
    }
    one(x)
}

/// Pads one axis with copies of its own elements: the edge value, a mirror image without
/// the edge (reflect), or the other end (wrap).
fn pad_from_edges(
    ctx: &mut Ctx,
    n: &Node,
    x: ValueId,
    a: usize,
    before: i64,
    after: i64,
    mode: &str,
) -> Result<ValueId> {
    let size = ctx.b.shape(x)[a].clone();
    if let Some(s) = size.as_const() {
        let limit = if mode == "reflect" { s - 1 } else { s };
        if before.max(after) > limit || s == 0 {
            return Err(n.err(format!(
                "cannot pad {before}/{after} elements in {mode} mode on an axis of size {s}"
            )));
        }
    }
    let at = |v: i64| Dim::Const(v);
    let from_end = |v: i64| Dim::binary(DimOp::Sub, size.clone(), Dim::Const(v));
    let mut parts = Vec::new();
    for (count, leading) in [(before, true), (after, false)] {
        if count == 0 {
            continue;
        }
        let part = match mode {
            "edge" => {
                let (s, e) = if leading {
                    (at(0), at(1))
                } else {
                    (from_end(1), size.clone())
                };
                let edge = ctx.b.slice(x, a, s, e, 1)?;
                let mut shape = ctx.b.shape(edge);
                shape[a] = Dim::Const(count);
                ctx.b.broadcast_to(edge, &shape)?
            }
            "reflect" => {
                let (s, e) = if leading {
                    (at(1), at(count + 1))
                } else {
                    (from_end(count + 1), from_end(1))
                };
                let piece = ctx.b.slice(x, a, s, e, 1)?;
                ctx.b.op(Op::Flip { axes: vec![a] }, &[piece])?
            }
            _ => {
                let (s, e) = if leading {
                    (from_end(count), size.clone())
                } else {
                    (at(0), at(count))
                };
                ctx.b.slice(x, a, s, e, 1)?
            }
        };
        parts.push((leading, part));
    }
    let mut ordered: Vec<ValueId> = parts.iter().filter(|p| p.0).map(|p| p.1).collect();
    ordered.push(x);
    ordered.extend(parts.iter().filter(|p| !p.0).map(|p| p.1));
    ctx.b.op(Op::Concat { axis: a }, &ordered)
}

/// DepthToSpace (modes DCR and CRD) and SpaceToDepth: `[N, C, H, W]` blocks of `b × b`
/// moved between channels and space by a reshape, a permute and a reshape.
fn depth_space(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let s = ctx.b.shape(x);
    if s.len() != 4 {
        return Err(n.err(format!("input of rank {} (4: [N, C, H, W])", s.len())));
    }
    let b = n.int("blocksize", 0)?;
    if b <= 0 {
        return Err(n.err("blocksize must be positive"));
    }
    let bd = Dim::Const(b);
    let (nn, c, h, w) = (s[0].clone(), s[1].clone(), s[2].clone(), s[3].clone());
    let times = |a: &Dim, k: i64| Dim::binary(DimOp::Mul, a.clone(), Dim::Const(k));
    let over = |a: &Dim, k: i64| Dim::binary(DimOp::FloorDiv, a.clone(), Dim::Const(k));
    let (split, perm, merged) = if n.op == "DepthToSpace" {
        let cc = match c.as_const() {
            Some(c) if c % (b * b) == 0 => Dim::Const(c / (b * b)),
            _ => return Err(n.err(format!("{c} channels are not a multiple of {b}²"))),
        };
        let merged = vec![nn.clone(), cc.clone(), times(&h, b), times(&w, b)];
        match n.string("mode", "DCR")?.as_str() {
            "DCR" => (
                vec![nn, bd.clone(), bd, cc, h, w],
                vec![0, 3, 4, 1, 5, 2],
                merged,
            ),
            "CRD" => (
                vec![nn, cc, bd.clone(), bd, h, w],
                vec![0, 1, 4, 2, 5, 3],
                merged,
            ),
            other => return Err(n.err(format!("unknown mode '{other}'"))),
        }
    } else {
        for (d, what) in [(&h, "height"), (&w, "width")] {
            if d.as_const().is_some_and(|v| v % b != 0) {
                return Err(n.err(format!("{what} {d} is not a multiple of {b}")));
            }
        }
        let (hb, wb) = (over(&h, b), over(&w, b));
        (
            vec![
                nn.clone(),
                c.clone(),
                hb.clone(),
                bd.clone(),
                wb.clone(),
                bd,
            ],
            vec![0, 3, 5, 1, 2, 4],
            vec![nn, times(&c, b * b), hb, wb],
        )
    };
    let x = ctx.b.reshape(x, split)?;
    let x = ctx.b.permute(x, perm)?;
    one(ctx.b.reshape(x, merged)?)
}
