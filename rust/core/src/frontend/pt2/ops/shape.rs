//! Shape and layout ops: view/reshape, permute/transpose, expand, (un)squeeze, slice,
//! select (and their scatters), narrow, cat/stack, split/chunk/unbind, flip, repeat, pad, as_strided; symbolic
//! sizes.

use super::{axis, tensor, Handler};
use crate::dim::{numel, Dim, DimOp};
use crate::dtype::Scalar;
use crate::error::{Error, Result};
use crate::frontend::pt2::args::{Arg, NodeArgs};
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::frontend::resample::index_const;
use crate::ir::{Op, ValueId};

/// The most elements an `as_strided` gather may index through a constant index table.
const MAX_STRIDED_GATHER: usize = 1 << 24;

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    Some(match (name, overload) {
        ("view" | "_unsafe_view" | "reshape" | "view_copy", "default") => view,
        ("permute" | "permute_copy", "default") => permute,
        ("diagonal" | "diagonal_copy", "default") => diagonal,
        ("t", "default") => transpose,
        ("transpose", "int") => transpose,
        ("expand" | "expand_copy", "default") => expand,
        ("unsqueeze" | "unsqueeze_copy", "default") => unsqueeze,
        ("squeeze" | "squeeze_copy", "default" | "dim" | "dims") => squeeze,
        ("slice" | "slice_copy", "Tensor") => slice,
        ("select" | "select_copy", "int") => select,
        ("slice_scatter", "default") => slice_scatter,
        ("select_scatter", "default") => select_scatter,
        ("narrow", "default") => narrow,
        ("cat" | "concat", "default") => cat,
        ("stack", "default") => stack,
        ("split" | "split_with_sizes" | "split_with_sizes_copy", _) => split,
        ("chunk", "default") => chunk,
        ("unbind" | "unbind_copy", "int") => unbind,
        ("flip", "default") => flip,
        ("flatten", "using_ints") => flatten,
        ("unflatten", "int") => unflatten,
        ("repeat", "default") => repeat,
        ("constant_pad_nd", "default") => pad,
        ("as_strided" | "as_strided_copy", "default") => as_strided,
        ("sym_size", "int") => sym_size,
        ("sym_numel", "default") => sym_numel,
        ("_assert_tensor_metadata" | "_assert_scalar" | "sym_constrain_range_for_size", _) => {
            |_, _| Ok(Out::None)
        }
        ("sym_constrain_range", _) => |_, _| Ok(Out::None),
        _ => return None,
    })
}

/// A size list argument: ints or symbolic ints.
fn sizes(ctx: &Ctx, n: &NodeArgs, name: &str, pos: usize) -> Result<Vec<Dim>> {
    match n.raw(name, pos) {
        Some(Arg::Ints(v)) => Ok(v.iter().map(|&d| Dim::Const(d)).collect()),
        Some(Arg::Int(v)) => Ok(vec![Dim::Const(*v)]),
        Some(Arg::SymInts(v)) => v.iter().map(|s| ctx.sym(s)).collect(),
        Some(Arg::SymInt(s)) => Ok(vec![ctx.sym(s)?]),
        None => Ok(vec![]),
        other => Err(Error::Compile(format!(
            "node '{}': '{name}' should be a list of sizes, got {other:?}",
            n.name
        ))),
    }
}

/// Replaces a single -1 in a view shape by the size that keeps the element count.
fn infer_minus_one(ctx: &Ctx, x: ValueId, mut shape: Vec<Dim>) -> Result<Vec<Dim>> {
    let holes: Vec<usize> = (0..shape.len())
        .filter(|&i| shape[i].as_const() == Some(-1))
        .collect();
    match holes.as_slice() {
        [] => Ok(shape),
        [i] => {
            let known: Vec<Dim> = shape
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != *i)
                .map(|(_, d)| d.clone())
                .collect();
            let total = numel(&ctx.b.shape(x));
            shape[*i] = Dim::binary(DimOp::FloorDiv, total, numel(&known));
            Ok(shape)
        }
        _ => Err(Error::Shape(format!(
            "node '{}': view shape has more than one -1",
            ctx.b.origin
        ))),
    }
}

fn view(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let shape = sizes(
        ctx,
        n,
        if n.target.contains("reshape") {
            "shape"
        } else {
            "size"
        },
        1,
    )
    .or_else(|_| sizes(ctx, n, "shape", 1))?;
    let shape = infer_minus_one(ctx, x, shape)?;
    Ok(Out::Value(ctx.b.reshape(x, shape)?))
}

fn permute(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let dims = n.ints("dims", 1)?;
    let perm = dims
        .iter()
        .map(|&d| axis(ctx, x, d))
        .collect::<Result<Vec<_>>>()?;
    Ok(Out::Value(ctx.b.op(Op::Permute { perm }, &[x])?))
}

/// `diagonal(x, offset, dim1, dim2)`: the two dims moved last and flattened, then the
/// diagonal's elements picked with constant indices (static sizes of those two dims).
fn diagonal(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let offset = n.opt_int("offset", 1)?.unwrap_or(0);
    let d1 = axis(ctx, x, n.opt_int("dim1", 2)?.unwrap_or(0))?;
    let d2 = axis(ctx, x, n.opt_int("dim2", 3)?.unwrap_or(1))?;
    let shape = ctx.b.shape(x);
    if d1 == d2 {
        return Err(Error::Shape(format!(
            "node '{}' (aten.diagonal): dim1 and dim2 are both {d1} for input {}",
            n.name,
            crate::dim::format_shape(&shape)
        )));
    }
    let (Some(rows), Some(cols)) = (shape[d1].as_const(), shape[d2].as_const()) else {
        return Err(Error::unsupported_because(
            "aten.diagonal",
            &n.name,
            "symbolic sizes of the two dims",
        ));
    };
    // Element i of the diagonal is (i, i + offset), or (i - offset, i) below the main one.
    let (r0, c0) = if offset >= 0 {
        (0, offset)
    } else {
        (-offset, 0)
    };
    let len = (rows - r0).min(cols - c0).max(0);
    let picks: Vec<i64> = (0..len).map(|i| (r0 + i) * cols + c0 + i).collect();
    let mut perm: Vec<usize> = (0..shape.len()).filter(|&d| d != d1 && d != d2).collect();
    perm.extend([d1, d2]);
    let moved = ctx.b.op(Op::Permute { perm: perm.clone() }, &[x])?;
    let mut flat: Vec<Dim> = perm[..perm.len() - 2]
        .iter()
        .map(|&d| shape[d].clone())
        .collect();
    flat.push(Dim::Const(rows * cols));
    let moved = ctx.b.reshape(moved, flat.clone())?;
    let idx = index_const(&mut ctx.b, &picks)?;
    let axis = flat.len() - 1;
    Ok(Out::Value(
        ctx.b.op(Op::IndexSelect { axis }, &[moved, idx])?,
    ))
}

fn transpose(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let rank = ctx.b.rank(x);
    if rank < 2 {
        return Ok(Out::Value(x));
    }
    let (a, b) = if n.target.ends_with(".t.default") {
        (0, 1)
    } else {
        (
            axis(ctx, x, n.int("dim0", 1)?)?,
            axis(ctx, x, n.int("dim1", 2)?)?,
        )
    };
    let mut perm: Vec<usize> = (0..rank).collect();
    perm.swap(a, b);
    Ok(Out::Value(ctx.b.permute(x, perm)?))
}

fn expand(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let mut shape = sizes(ctx, n, "size", 1)?;
    let cur = ctx.b.shape(x);
    let lead = shape.len().saturating_sub(cur.len());
    for (i, d) in shape.iter_mut().enumerate() {
        if d.as_const() == Some(-1) && i >= lead {
            *d = cur[i - lead].clone();
        }
    }
    Ok(Out::Value(ctx.b.broadcast_to(x, &shape)?))
}

fn unsqueeze(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let mut shape = ctx.b.shape(x);
    let d = n.int("dim", 1)?;
    let a = crate::frontend::builder::norm_axis(d, shape.len() + 1, &ctx.b.origin)?;
    shape.insert(a, Dim::Const(1));
    Ok(Out::Value(ctx.b.reshape(x, shape)?))
}

fn squeeze(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let shape = ctx.b.shape(x);
    let axes: Vec<usize> = match n.opt_ints("dim", 1)? {
        Some(d) => d.iter().map(|&a| axis(ctx, x, a)).collect::<Result<_>>()?,
        None => (0..shape.len()).collect(),
    };
    let new: Vec<Dim> = shape
        .iter()
        .enumerate()
        .filter(|(i, d)| !(axes.contains(i) && d.as_const() == Some(1)))
        .map(|(_, d)| d.clone())
        .collect();
    Ok(Out::Value(ctx.b.reshape(x, new)?))
}

/// Python slice bounds → `0 ≤ start ≤ end ≤ size`.
fn clamp_bound(v: i64, size: &Dim) -> Dim {
    match size.as_const() {
        Some(n) => {
            let v = if v < 0 { v + n } else { v };
            Dim::Const(v.clamp(0, n))
        }
        None if v >= 0 => Dim::binary(DimOp::Min, Dim::Const(v), size.clone()),
        None => Dim::binary(DimOp::Max, size + &Dim::Const(v), Dim::Const(0)),
    }
}

fn bound(ctx: &Ctx, n: &NodeArgs, name: &str, pos: usize, size: &Dim, default: Dim) -> Result<Dim> {
    Ok(match n.raw(name, pos) {
        None => default,
        Some(Arg::Int(v)) => clamp_bound(*v, size),
        Some(Arg::SymInt(s)) => {
            let d = ctx.sym(s)?;
            match d.as_const() {
                Some(v) => clamp_bound(v, size),
                None => Dim::binary(DimOp::Min, d, size.clone()),
            }
        }
        Some(other) => {
            return Err(Error::Compile(format!(
                "node '{}': slice bound '{name}' is {other:?}",
                n.name
            )))
        }
    })
}

/// The `start` and `end` arguments (at `pos`, `pos + 1`) of a slice along an axis of `size`,
/// clamped as Python's slices are; an empty slice when `end` precedes `start`.
fn slice_bounds(ctx: &Ctx, n: &NodeArgs, pos: usize, size: &Dim) -> Result<(Dim, Dim)> {
    let start = bound(ctx, n, "start", pos, size, Dim::Const(0))?;
    let end = bound(ctx, n, "end", pos + 1, size, size.clone())?;
    let end = match (start.as_const(), end.as_const()) {
        (Some(s), Some(e)) if e < s => Dim::Const(s),
        _ => end,
    };
    Ok((start, end))
}

fn slice(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let a = axis(ctx, x, n.opt_int("dim", 1)?.unwrap_or(0))?;
    let size = ctx.b.shape(x)[a].clone();
    let (start, end) = slice_bounds(ctx, n, 2, &size)?;
    let step = n.opt_int("step", 4)?.unwrap_or(1);
    if step < 1 {
        return Err(Error::unsupported_because(
            "aten.slice",
            &n.name,
            format!("step {step}"),
        ));
    }
    if start.as_const() == Some(0) && end == size && step == 1 {
        return Ok(Out::Value(x));
    }
    Ok(Out::Value(ctx.b.slice(x, a, start, end, step)?))
}

/// `x` with `x[start:end]` along `a` replaced by `src` (unit step): the pieces of `x`
/// around the slice concatenated with `src`.
fn scatter_slice(
    ctx: &mut Ctx,
    x: ValueId,
    src: ValueId,
    a: usize,
    (start, end): (Dim, Dim),
) -> Result<ValueId> {
    let size = ctx.b.shape(x)[a].clone();
    let mut want = ctx.b.shape(x);
    want[a] = &end - &start;
    let src = ctx.b.cast(src, ctx.b.dtype(x))?;
    let src = ctx.b.broadcast_to(src, &want)?;
    let mut pieces = Vec::new();
    if start.as_const() != Some(0) {
        pieces.push(ctx.b.slice(x, a, Dim::Const(0), start, 1)?);
    }
    pieces.push(src);
    if end != size {
        pieces.push(ctx.b.slice(x, a, end, size, 1)?);
    }
    if pieces.len() == 1 {
        return Ok(pieces[0]);
    }
    ctx.b.op(Op::Concat { axis: a }, &pieces)
}

/// `slice_scatter(self, src, dim, start, end, step)`: the functional form of
/// `self[..., start:end] = src` (relative position tables, in-place writes into fresh
/// tensors).
fn slice_scatter(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let src = tensor(ctx, n, "src", 1)?;
    let a = axis(ctx, x, n.opt_int("dim", 2)?.unwrap_or(0))?;
    let size = ctx.b.shape(x)[a].clone();
    let (start, end) = slice_bounds(ctx, n, 3, &size)?;
    let step = n.opt_int("step", 5)?.unwrap_or(1);
    if step != 1 {
        return Err(Error::unsupported_because(
            "aten.slice_scatter",
            &n.name,
            format!("step {step} (only unit steps are supported)"),
        ));
    }
    Ok(Out::Value(scatter_slice(ctx, x, src, a, (start, end))?))
}

/// `select_scatter(self, src, dim, index)`: `self[..., index, ...] = src`.
fn select_scatter(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let src = tensor(ctx, n, "src", 1)?;
    let a = axis(ctx, x, n.int("dim", 2)?)?;
    let index = n.int("index", 3)?;
    let start = select_start(ctx, x, a, index)?;
    let mut shape = ctx.b.shape(src);
    if shape.len() + 1 != ctx.b.rank(x) {
        return Err(Error::Shape(format!(
            "select_scatter of a rank-{} source into a rank-{} tensor at node '{}'",
            shape.len(),
            ctx.b.rank(x),
            n.name
        )));
    }
    shape.insert(a, Dim::Const(1));
    let src = ctx.b.reshape(src, shape)?;
    let end = &start + &Dim::Const(1);
    Ok(Out::Value(scatter_slice(ctx, x, src, a, (start, end))?))
}

/// Where `index` (negative: from the end) lies along axis `a` of `x`; out of range is an
/// error naming the node.
fn select_start(ctx: &Ctx, x: ValueId, a: usize, index: i64) -> Result<Dim> {
    let size = ctx.b.shape(x)[a].clone();
    Ok(match size.as_const() {
        Some(s) if index < -s || index >= s => {
            return Err(Error::Shape(format!(
                "index {index} out of range for dim {a} of size {s} at node '{}'",
                ctx.b.origin
            )))
        }
        Some(s) => Dim::Const(if index < 0 { index + s } else { index }),
        None if index < 0 => &size + &Dim::Const(index),
        None => Dim::Const(index),
    })
}

fn select_at(ctx: &mut Ctx, x: ValueId, a: usize, index: i64) -> Result<ValueId> {
    let shape = ctx.b.shape(x);
    let start = select_start(ctx, x, a, index)?;
    let end = &start + &Dim::Const(1);
    let s = ctx.b.slice(x, a, start, end, 1)?;
    let mut new = shape.clone();
    new.remove(a);
    ctx.b.reshape(s, new)
}

fn select(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let a = axis(ctx, x, n.int("dim", 1)?)?;
    let index = n.int("index", 2)?;
    Ok(Out::Value(select_at(ctx, x, a, index)?))
}

fn narrow(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let a = axis(ctx, x, n.int("dim", 1)?)?;
    let size = ctx.b.shape(x)[a].clone();
    let start = clamp_bound(n.int("start", 2)?, &size);
    let end = &start + &Dim::Const(n.int("length", 3)?);
    Ok(Out::Value(ctx.b.slice(x, a, start, end, 1)?))
}

fn cat_values(ctx: &mut Ctx, vals: Vec<ValueId>, dim: i64) -> Result<ValueId> {
    // torch.cat skips 1-D empty tensors (legacy behaviour) and promotes dtypes.
    let vals: Vec<ValueId> = vals
        .into_iter()
        .filter(|&v| !(ctx.b.rank(v) == 1 && ctx.b.shape(v)[0].as_const() == Some(0)))
        .collect();
    let first = *vals.first().ok_or_else(|| {
        Error::Shape(format!(
            "cat of no non-empty tensors at node '{}'",
            ctx.b.origin
        ))
    })?;
    let dtype = vals.iter().skip(1).fold(ctx.b.dtype(first), |acc, &v| {
        crate::dtype::DType::promote(acc, ctx.b.dtype(v))
    });
    let a = axis(ctx, first, dim)?;
    let vals = vals
        .into_iter()
        .map(|v| ctx.b.cast(v, dtype))
        .collect::<Result<Vec<_>>>()?;
    if vals.len() == 1 {
        return Ok(vals[0]);
    }
    ctx.b.concat(&vals, a)
}

fn cat(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let names = n.tensors("tensors", 0)?;
    let vals = names
        .iter()
        .map(|t| ctx.value(t))
        .collect::<Result<Vec<_>>>()?;
    let dim = n.opt_int("dim", 1)?.unwrap_or(0);
    Ok(Out::Value(cat_values(ctx, vals, dim)?))
}

fn stack(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let names = n.tensors("tensors", 0)?;
    let dim = n.opt_int("dim", 1)?.unwrap_or(0);
    let mut vals = Vec::new();
    for t in &names {
        let v = ctx.value(t)?;
        let mut shape = ctx.b.shape(v);
        let a = crate::frontend::builder::norm_axis(dim, shape.len() + 1, &ctx.b.origin)?;
        shape.insert(a, Dim::Const(1));
        vals.push(ctx.b.reshape(v, shape)?);
    }
    let first = *vals
        .first()
        .ok_or_else(|| Error::Shape("stack of no tensors".into()))?;
    let a = if dim < 0 {
        dim + ctx.b.rank(first) as i64
    } else {
        dim
    };
    if vals.len() == 1 {
        return Ok(Out::Value(first));
    }
    Ok(Out::Value(
        ctx.b.op(Op::Concat { axis: a as usize }, &vals)?,
    ))
}

/// Splits `x` along `a` into pieces of the given sizes.
fn split_sizes(ctx: &mut Ctx, x: ValueId, a: usize, sizes: &[Dim]) -> Result<Vec<Option<ValueId>>> {
    let mut start = Dim::Const(0);
    let mut out = Vec::new();
    for s in sizes {
        let end = &start + s;
        let piece = if start.as_const() == Some(0) && end == ctx.b.shape(x)[a] {
            x
        } else {
            ctx.b.slice(x, a, start.clone(), end.clone(), 1)?
        };
        out.push(Some(piece));
        start = end;
    }
    Ok(out)
}

/// Sizes of the pieces `split(size)`/`chunk(n)` make of a dim of length `total`.
fn even_pieces(total: &Dim, piece: i64, origin: &str) -> Result<Vec<Dim>> {
    let total = total.as_const().ok_or_else(|| {
        Error::unsupported_because("aten.split", origin, "split of a symbolic dimension")
    })?;
    if piece <= 0 {
        return Err(Error::Shape(format!(
            "split size {piece} at node '{origin}'"
        )));
    }
    let mut out = Vec::new();
    let mut left = total;
    while left > 0 {
        out.push(Dim::Const(piece.min(left)));
        left -= piece;
    }
    if out.is_empty() {
        out.push(Dim::Const(0));
    }
    Ok(out)
}

fn split(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let a = axis(ctx, x, n.opt_int("dim", 2)?.unwrap_or(0))?;
    let total = ctx.b.shape(x)[a].clone();
    let pieces = match n.raw("split_size", 1).or_else(|| n.raw("split_sizes", 1)) {
        Some(Arg::Int(s)) => even_pieces(&total, *s, &n.name)?,
        Some(Arg::Ints(v)) => v.iter().map(|&d| Dim::Const(d)).collect(),
        Some(Arg::SymInts(v)) => v.iter().map(|s| ctx.sym(s)).collect::<Result<_>>()?,
        Some(Arg::SymInt(s)) => even_pieces(&total, ctx.sym(s)?.as_const().unwrap_or(0), &n.name)?,
        other => {
            return Err(Error::Compile(format!(
                "node '{}': split sizes {other:?}",
                n.name
            )))
        }
    };
    Ok(Out::Values(split_sizes(ctx, x, a, &pieces)?))
}

fn chunk(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let chunks = n.int("chunks", 1)?;
    let a = axis(ctx, x, n.opt_int("dim", 2)?.unwrap_or(0))?;
    let total = ctx.b.shape(x)[a].clone();
    let t = total.as_const().unwrap_or(0);
    let piece = (t + chunks - 1) / chunks.max(1);
    let pieces = even_pieces(&total, piece.max(1), &n.name)?;
    Ok(Out::Values(split_sizes(ctx, x, a, &pieces)?))
}

fn unbind(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let a = axis(ctx, x, n.opt_int("dim", 1)?.unwrap_or(0))?;
    let total = ctx.b.shape(x)[a].as_const().ok_or_else(|| {
        Error::unsupported_because("aten.unbind", &n.name, "unbind of a symbolic dimension")
    })?;
    let mut out = Vec::new();
    for i in 0..total {
        out.push(Some(select_at(ctx, x, a, i)?));
    }
    Ok(Out::Values(out))
}

fn flip(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let mut axes = n
        .ints("dims", 1)?
        .iter()
        .map(|&d| axis(ctx, x, d))
        .collect::<Result<Vec<_>>>()?;
    axes.sort_unstable();
    axes.dedup();
    if axes.is_empty() || ctx.b.rank(x) == 0 {
        return Ok(Out::Value(x));
    }
    Ok(Out::Value(ctx.b.op(Op::Flip { axes }, &[x])?))
}

fn flatten(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let shape = ctx.b.shape(x);
    if shape.is_empty() {
        return Ok(Out::Value(ctx.b.reshape(x, vec![Dim::Const(1)])?));
    }
    let s = axis(ctx, x, n.opt_int("start_dim", 1)?.unwrap_or(0))?;
    let e = axis(ctx, x, n.opt_int("end_dim", 2)?.unwrap_or(-1))?;
    let mut new: Vec<Dim> = shape[..s].to_vec();
    new.push(numel(&shape[s..=e]));
    new.extend(shape[e + 1..].iter().cloned());
    Ok(Out::Value(ctx.b.reshape(x, new)?))
}

fn unflatten(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let a = axis(ctx, x, n.int("dim", 1)?)?;
    let shape = ctx.b.shape(x);
    let mut new: Vec<Dim> = shape[..a].to_vec();
    let parts = sizes(ctx, n, "sizes", 2)?;
    new.extend(parts);
    new.extend(shape[a + 1..].iter().cloned());
    let new = infer_minus_one(ctx, x, new)?;
    Ok(Out::Value(ctx.b.reshape(x, new)?))
}

/// `repeat(x, reps)`: insert a size-1 dim before each, expand it, merge.
fn repeat(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let reps = sizes(ctx, n, "repeats", 1)?;
    let mut shape = ctx.b.shape(x);
    if reps.len() < shape.len() {
        return Err(Error::Shape(format!(
            "repeat with fewer dims than the tensor at '{}'",
            n.name
        )));
    }
    let mut padded = vec![Dim::Const(1); reps.len() - shape.len()];
    padded.append(&mut shape);
    let x = ctx.b.reshape(x, padded.clone())?;
    let mut inter = Vec::new();
    let mut expanded = Vec::new();
    let mut merged = Vec::new();
    for (d, r) in padded.iter().zip(&reps) {
        inter.extend([Dim::Const(1), d.clone()]);
        expanded.extend([r.clone(), d.clone()]);
        merged.push(r * d);
    }
    let v = ctx.b.reshape(x, inter)?;
    let v = ctx.b.broadcast_to(v, &expanded)?;
    Ok(Out::Value(ctx.b.reshape(v, merged)?))
}

fn pad(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let mut x = tensor(ctx, n, "self", 0)?;
    let spec = n.ints("pad", 1)?;
    let value = n.scalar("value", 2)?.unwrap_or(Scalar::Int(0));
    let rank = ctx.b.rank(x);
    if spec.len() % 2 != 0 || spec.len() / 2 > rank {
        return Err(Error::Shape(format!(
            "pad {spec:?} for rank {rank} at '{}'",
            n.name
        )));
    }
    // torch lists (before, after) pairs from the last dim backwards; negative pads crop.
    let mut pads = vec![(0i64, 0i64); rank];
    for (i, pair) in spec.chunks(2).enumerate() {
        pads[rank - 1 - i] = (pair[0], pair[1]);
    }
    for (a, p) in pads.iter_mut().enumerate() {
        let size = ctx.b.shape(x)[a].clone();
        if p.0 < 0 || p.1 < 0 {
            let start = Dim::Const((-p.0).max(0));
            let end = &size - &Dim::Const((-p.1).max(0));
            x = ctx.b.slice(x, a, start, end, 1)?;
            p.0 = p.0.max(0);
            p.1 = p.1.max(0);
        }
    }
    if pads.iter().all(|&(a, b)| a == 0 && b == 0) {
        return Ok(Out::Value(x));
    }
    Ok(Out::Value(ctx.b.op(Op::Pad { pads, value }, &[x])?))
}

fn sym_size(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let a = axis(ctx, x, n.int("dim", 1)?)?;
    Ok(Out::Sym(ctx.b.shape(x)[a].clone()))
}

fn sym_numel(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    Ok(Out::Sym(numel(&ctx.b.shape(x))))
}

/// `as_strided(x, size, stride, offset)`: in an exported (functional) program `x` is a
/// contiguous value, so this reads x's row-major elements at `offset + Σ iₖ·strideₖ`. A
/// reshape when those are the size's own contiguous strides (torch's decompositions emit
/// that to restride size-1 dims, e.g. `adaptive_avg_pool1d`); otherwise a gather of the flat
/// value by a constant index table.
fn as_strided(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let refuse = |why: String| Error::unsupported_because("aten.as_strided", &n.name, why);
    let size = n
        .ints("size", 1)
        .map_err(|_| refuse("symbolic sizes".into()))?;
    let stride = n
        .ints("stride", 2)
        .map_err(|_| refuse("symbolic strides".into()))?;
    let offset = n.opt_int("storage_offset", 3)?.unwrap_or(0);
    let Some(total) = ctx
        .b
        .shape(x)
        .iter()
        .map(Dim::as_const)
        .product::<Option<i64>>()
    else {
        return Err(refuse("an input of symbolic size".into()));
    };
    if size.len() != stride.len() || size.iter().chain(&stride).any(|&v| v < 0) || offset < 0 {
        return Err(Error::Compile(format!(
            "node '{}': as_strided size {size:?} and stride {stride:?} (offset {offset}) do not \
             describe a view",
            n.name
        )));
    }
    let count: i64 = size.iter().product();
    let shape: Vec<Dim> = size.iter().map(|&d| Dim::Const(d)).collect();
    let mut contiguous = offset == 0 && count == total;
    let mut expected = 1;
    for (&d, &st) in size.iter().zip(&stride).rev() {
        contiguous &= d <= 1 || st == expected;
        expected *= d;
    }
    if contiguous {
        return Ok(Out::Value(ctx.b.reshape(x, shape)?));
    }
    if count as usize > MAX_STRIDED_GATHER {
        return Err(refuse(format!(
            "a strided gather of {count} elements (at most {MAX_STRIDED_GATHER})"
        )));
    }
    let mut index = Vec::with_capacity(count as usize);
    let mut at = vec![0i64; size.len()];
    for _ in 0..count {
        let flat = offset + at.iter().zip(&stride).map(|(i, s)| i * s).sum::<i64>();
        if flat >= total {
            return Err(Error::Compile(format!(
                "node '{}': as_strided size {size:?} stride {stride:?} offset {offset} reads \
                 element {flat} of an input with {total}",
                n.name
            )));
        }
        index.push(flat);
        for k in (0..size.len()).rev() {
            at[k] += 1;
            if at[k] < size[k] {
                break;
            }
            at[k] = 0;
        }
    }
    let flat = ctx.b.reshape(x, vec![Dim::Const(total)])?;
    let index = index_const(&mut ctx.b, &index)?;
    let picked = ctx.b.op(Op::IndexSelect { axis: 0 }, &[flat, index])?;
    Ok(Out::Value(ctx.b.reshape(picked, shape)?))
}
