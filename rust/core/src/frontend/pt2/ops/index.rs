//! Indexing: embedding, index_select, gather, advanced indexing with index tensors,
//! tril/triu.

use super::{axis, tensor, Handler};
use crate::dim::{numel, Dim};
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::builder::Operand;
use crate::frontend::pt2::args::{Arg, NodeArgs};
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, Op, ScatterReduce, TensorType, ValueId};

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    Some(match (name, overload) {
        ("embedding", "default") => embedding,
        ("index_select", "default") => index_select,
        ("gather", "default") => gather,
        ("scatter", "src") => |c, n| scatter(c, n, ScatterReduce::None),
        ("scatter", "value") => |c, n| scatter(c, n, ScatterReduce::None),
        ("scatter_add", "default") => |c, n| scatter(c, n, ScatterReduce::Add),
        ("scatter_reduce", "two") => scatter_reduce,
        ("index", "Tensor") => index,
        ("index_put", "default") => index_put,
        ("index_copy", "default") => index_copy,
        ("tril", "default") => |c, n| triangle(c, n, true),
        ("triu", "default") => |c, n| triangle(c, n, false),
        _ => return None,
    })
}

fn embedding(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let w = tensor(ctx, n, "weight", 0)?;
    let idx = tensor(ctx, n, "indices", 1)?;
    Ok(Out::Value(
        ctx.b.op(Op::IndexSelect { axis: 0 }, &[w, idx])?,
    ))
}

fn index_select(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let a = axis(ctx, x, n.int("dim", 1)?)?;
    let idx = tensor(ctx, n, "index", 2)?;
    if ctx.b.rank(x) == 0 {
        return Ok(Out::Value(x));
    }
    Ok(Out::Value(
        ctx.b.op(Op::IndexSelect { axis: a }, &[x, idx])?,
    ))
}

fn gather(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let a = axis(ctx, x, n.int("dim", 1)?)?;
    let idx = tensor(ctx, n, "index", 2)?;
    Ok(Out::Value(ctx.b.op(Op::Gather { axis: a }, &[x, idx])?))
}

/// `scatter`/`scatter_add`: `src` may be larger than the index (only its index-shaped
/// corner is read) or a scalar `value`.
fn scatter(ctx: &mut Ctx, n: &NodeArgs, reduce: ScatterReduce) -> Result<Out> {
    let (x, a, idx, upd) = scatter_operands(ctx, n)?;
    Ok(Out::Value(
        ctx.b.op(Op::Scatter { axis: a, reduce }, &[x, idx, upd])?,
    ))
}

/// (self, axis, index, updates in self's dtype and the index's shape) of a scatter.
fn scatter_operands(ctx: &mut Ctx, n: &NodeArgs) -> Result<(ValueId, usize, ValueId, ValueId)> {
    let x = tensor(ctx, n, "self", 0)?;
    let a = axis(ctx, x, n.int("dim", 1)?)?;
    let idx = tensor(ctx, n, "index", 2)?;
    let ishape = ctx.b.shape(idx);
    let dtype = ctx.b.dtype(x);
    let upd = match n.scalar("value", 3)? {
        Some(v) if n.raw("src", 3).is_none() => ctx.b.full(v, dtype, ishape.clone())?,
        _ => {
            let mut src = tensor(ctx, n, "src", 3)?;
            let sshape = ctx.b.shape(src);
            if sshape.len() != ishape.len() {
                return Err(Error::Shape(format!(
                    "node '{}': scatter src of rank {} for an index of rank {}",
                    n.name,
                    sshape.len(),
                    ishape.len()
                )));
            }
            for (d, (s, i)) in sshape.iter().zip(&ishape).enumerate() {
                if s != i {
                    src = ctx.b.slice(src, d, Dim::Const(0), i.clone(), 1)?;
                }
            }
            ctx.b.cast(src, dtype)?
        }
    };
    Ok((x, a, idx, upd))
}

/// `scatter_reduce(dim, index, src, reduce, include_self)`. Without `include_self`, the
/// elements some index names start from the reduction's identity instead of self's value
/// (the others keep it). `mean` is a scatter-add of the values and of their count, the
/// count starting at 1 with self (0 without, and 1 where nothing lands, as in torch),
/// divided rounding down for integers as torch does.
fn scatter_reduce(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let mean = n.string("reduce", 4)? == Some("mean");
    let reduce = match n.string("reduce", 4)? {
        Some("sum" | "mean") => ScatterReduce::Add,
        Some("prod") => ScatterReduce::Mul,
        Some("amax") => ScatterReduce::Max,
        Some("amin") => ScatterReduce::Min,
        other => {
            return Err(Error::unsupported_because(
                "scatter_reduce",
                &n.name,
                format!("reduce={other:?}"),
            ))
        }
    };
    let include_self = n.bool("include_self", 5, true)?;
    let (x, a, idx, upd) = scatter_operands(ctx, n)?;
    let dtype = ctx.b.dtype(x);
    let shape = ctx.b.shape(x);
    let t = Operand::Tensor;
    let scatter = |ctx: &mut Ctx, base: ValueId, upd: ValueId, reduce: ScatterReduce| {
        ctx.b.op(Op::Scatter { axis: a, reduce }, &[base, idx, upd])
    };
    let base = if include_self {
        x
    } else {
        let identity = match reduce {
            ScatterReduce::Add | ScatterReduce::None => Scalar::Int(0),
            ScatterReduce::Mul => Scalar::Int(1),
            ScatterReduce::Max => extreme(dtype, false),
            ScatterReduce::Min => extreme(dtype, true),
        };
        let hit = landed(ctx, x, a, idx)?;
        let identity = ctx.b.full(identity, dtype, vec![])?;
        ctx.b.where_(hit, t(identity), t(x))?
    };
    let reduced = scatter(ctx, base, upd, reduce)?;
    if !mean {
        return Ok(Out::Value(reduced));
    }
    let start = Scalar::Int(include_self as i64);
    let start = ctx.b.full(start, dtype, shape)?;
    let ones = ctx.b.full(Scalar::Int(1), dtype, ctx.b.shape(idx))?;
    let count = scatter(ctx, start, ones, ScatterReduce::Add)?;
    let zero = Operand::Scalar(Scalar::Int(0));
    let empty = ctx.b.binary(BinaryOp::Eq, t(count), zero)?;
    let count = ctx
        .b
        .where_(empty, Operand::Scalar(Scalar::Int(1)), t(count))?;
    let divide = if dtype.is_float() {
        BinaryOp::Div
    } else {
        BinaryOp::FloorDiv
    };
    Ok(Out::Value(ctx.b.binary_in(
        divide,
        t(reduced),
        t(count),
        dtype,
    )?))
}

/// Which elements of `x` some entry of `idx` names along axis `a` (bool, x's shape).
fn landed(ctx: &mut Ctx, x: ValueId, a: usize, idx: ValueId) -> Result<ValueId> {
    let none = ctx
        .b
        .full(Scalar::Bool(false), DType::Bool, ctx.b.shape(x))?;
    let marks = ctx
        .b
        .full(Scalar::Bool(true), DType::Bool, ctx.b.shape(idx))?;
    ctx.b.op(
        Op::Scatter {
            axis: a,
            reduce: ScatterReduce::None,
        },
        &[none, idx, marks],
    )
}

/// The largest (`max`) or smallest value of `dtype`: ±inf for floats.
fn extreme(dtype: DType, max: bool) -> Scalar {
    let (lo, hi) = match dtype {
        DType::Bool => return Scalar::Bool(max),
        DType::U8 => (0, u8::MAX as i64),
        DType::I8 => (i8::MIN as i64, i8::MAX as i64),
        DType::I16 => (i16::MIN as i64, i16::MAX as i64),
        DType::I32 => (i32::MIN as i64, i32::MAX as i64),
        DType::I64 => (i64::MIN, i64::MAX),
        _ => {
            return Scalar::Float(if max {
                f64::INFINITY
            } else {
                f64::NEG_INFINITY
            })
        }
    };
    Scalar::Int(if max { hi } else { lo })
}

/// The `indices` argument of `index`/`index_put`: one optional tensor name per dim.
fn index_tensors(n: &NodeArgs) -> Result<Vec<Option<String>>> {
    match n.raw("indices", 1) {
        Some(Arg::OptTensors(v)) => Ok(v.clone()),
        Some(Arg::Tensors(v)) => Ok(v.iter().cloned().map(Some).collect()),
        other => Err(Error::Compile(format!(
            "node '{}': indices {other:?}",
            n.name
        ))),
    }
}

/// `x[..., idx, ...]`: integer index tensors (and `None`s for dims taken whole).
fn index(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let indices = index_tensors(n)?;
    let given: Vec<(usize, &String)> = indices
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.as_ref().map(|t| (i, t)))
        .collect();
    let mut idxs = Vec::new();
    for (_, name) in &given {
        let idx = ctx.value(name)?;
        if ctx.b.dtype(idx) == DType::Bool || ctx.b.dtype(idx) == DType::U8 {
            return Err(Error::unsupported_because(
                "aten.index.Tensor",
                &n.name,
                "boolean-mask indexing (its output shape depends on the data)",
            ));
        }
        idxs.push(idx);
    }
    let axes: Vec<usize> = given.iter().map(|(a, _)| *a).collect();
    if axes.is_empty() {
        return Ok(Out::Value(x));
    }
    if let ([a], [idx]) = (axes.as_slice(), idxs.as_slice()) {
        return Ok(Out::Value(
            ctx.b.op(Op::IndexSelect { axis: *a }, &[x, *idx])?,
        ));
    }
    Ok(Out::Value(index_several(ctx, x, &axes, idxs)?))
}

/// Several index tensors over `axes` of `x`, made one: `x` with the indexed dims flattened
/// into one dim at `first`, and the linear index into it.
struct Linearized {
    x: ValueId,
    first: usize,
    linear: ValueId,
    /// The shape before flattening (after the permutation, if any).
    unflat: Vec<Dim>,
    /// The permutation that brought non-adjacent indexed dims to the front.
    perm: Option<Vec<usize>>,
}

/// `x[i, j]` with several index tensors: they broadcast together and pick one element of the
/// indexed dims each. Those dims are flattened into one and indexed by the linear index
/// `i * size(j) + j`; an index out of its own dim's range makes the linear index out of range,
/// so the runtime reports it instead of reading a neighbour. As in torch, the broadcast dims
/// replace the indexed dims in place when those are adjacent, and come first otherwise.
fn linearize(
    ctx: &mut Ctx,
    mut x: ValueId,
    axes: &[usize],
    idxs: Vec<ValueId>,
) -> Result<Linearized> {
    let adjacent = axes.windows(2).all(|w| w[1] == w[0] + 1);
    let mut first = axes[0];
    let mut perm = None;
    if !adjacent {
        let rank = ctx.b.rank(x);
        let mut p = axes.to_vec();
        p.extend((0..rank).filter(|d| !axes.contains(d)));
        x = ctx.b.permute(x, p.clone())?;
        perm = Some(p);
        first = 0;
    }
    let shape = ctx.b.shape(x);
    let sizes: Vec<Dim> = (0..axes.len()).map(|i| shape[first + i].clone()).collect();
    let mut idxs = idxs
        .into_iter()
        .map(|i| ctx.b.cast(i, DType::I64))
        .collect::<Result<Vec<_>>>()?;
    idxs = ctx.b.broadcast_all(&idxs)?;
    let t = Operand::Tensor;
    let zero = Operand::Scalar(Scalar::Int(0));
    let (mut linear, mut valid) = (None, None);
    for (j, &idx) in idxs.iter().enumerate() {
        let size = ctx.b.dim_value(&sizes[j], DType::I64)?;
        let negative = ctx.b.binary(BinaryOp::Lt, t(idx), zero)?;
        let wrapped = ctx.b.binary(BinaryOp::Add, t(idx), t(size))?;
        let idx = ctx.b.where_(negative, t(wrapped), t(idx))?;
        let low = ctx.b.binary(BinaryOp::Ge, t(idx), zero)?;
        let high = ctx.b.binary(BinaryOp::Lt, t(idx), t(size))?;
        let ok = ctx.b.binary(BinaryOp::And, t(low), t(high))?;
        valid = Some(match valid {
            Some(v) => ctx.b.binary(BinaryOp::And, t(v), t(ok))?,
            None => ok,
        });
        linear = Some(match linear {
            Some(l) => {
                let scaled = ctx.b.binary(BinaryOp::Mul, t(l), t(size))?;
                ctx.b.binary(BinaryOp::Add, t(scaled), t(idx))?
            }
            None => idx,
        });
    }
    let (linear, valid) = (linear.expect("two or more"), valid.expect("two or more"));
    let total = numel(&sizes);
    let past_end = ctx.b.dim_value(&total, DType::I64)?;
    let linear = ctx.b.where_(valid, t(linear), t(past_end))?;
    let mut flat = shape[..first].to_vec();
    flat.push(total);
    flat.extend_from_slice(&shape[first + axes.len()..]);
    let flat_x = ctx.b.reshape(x, flat)?;
    Ok(Linearized {
        x: flat_x,
        first,
        linear,
        unflat: shape,
        perm,
    })
}

fn index_several(ctx: &mut Ctx, x: ValueId, axes: &[usize], idxs: Vec<ValueId>) -> Result<ValueId> {
    let l = linearize(ctx, x, axes, idxs)?;
    ctx.b
        .op(Op::IndexSelect { axis: l.first }, &[l.x, l.linear])
}

/// `x[..., idx, ...] = values` (`index_put`; `+=` with accumulate): one index tensor puts
/// whole slices; several are linearized as `x[i, j]` reads them.
fn index_put(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let indices = index_tensors(n)?;
    let values = tensor(ctx, n, "values", 2)?;
    let unsupported = |why: &str| Error::unsupported_because("aten.index_put", &n.name, why);
    let reduce = if n.bool("accumulate", 3, false)? {
        ScatterReduce::Add
    } else {
        ScatterReduce::None
    };
    let given: Vec<(usize, &String)> = indices
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.as_ref().map(|t| (i, t)))
        .collect();
    let mut idxs = Vec::new();
    for (_, name) in &given {
        let idx = ctx.value(name)?;
        if matches!(ctx.b.dtype(idx), DType::Bool | DType::U8) {
            return Err(unsupported("a boolean mask"));
        }
        idxs.push(idx);
    }
    let axes: Vec<usize> = given.iter().map(|(a, _)| *a).collect();
    match (axes.as_slice(), idxs.as_slice()) {
        ([], _) => Err(unsupported("no index tensor")),
        ([a], [idx]) => Ok(Out::Value(put_slices(ctx, x, *a, *idx, values, reduce)?)),
        _ => {
            // Put into the flattened indexed dims, then restore x's layout.
            let l = linearize(ctx, x, &axes, idxs)?;
            let put = put_slices(ctx, l.x, l.first, l.linear, values, reduce)?;
            let mut out = ctx.b.reshape(put, l.unflat)?;
            if let Some(perm) = l.perm {
                let mut inverse = vec![0; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inverse[p] = i;
                }
                out = ctx.b.permute(out, inverse)?;
            }
            Ok(Out::Value(out))
        }
    }
}

/// `x.index_copy(dim, index, source)`: rows of `source` into the positions `index` names.
fn index_copy(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let a = axis(ctx, x, n.int("dim", 1)?)?;
    let idx = tensor(ctx, n, "index", 2)?;
    let source = tensor(ctx, n, "source", 3)?;
    Ok(Out::Value(put_slices(
        ctx,
        x,
        a,
        idx,
        source,
        ScatterReduce::None,
    )?))
}

/// `x` with the slices at `idx` along axis `a` replaced by (or, with `reduce`, combined
/// with) `values`, broadcast to `x.shape[..a] ++ idx.shape ++ x.shape[a+1..]`: a `Scatter`
/// whose index spreads each slice's position over the slice. Negative indices count from
/// the end; one out of range is a run-time error, as in torch.
fn put_slices(
    ctx: &mut Ctx,
    x: ValueId,
    a: usize,
    idx: ValueId,
    values: ValueId,
    reduce: ScatterReduce,
) -> Result<ValueId> {
    let shape = ctx.b.shape(x);
    let dtype = ctx.b.dtype(x);
    let idx_shape = ctx.b.shape(idx);
    let count = numel(&idx_shape);
    let mut target = shape[..a].to_vec();
    target.extend(idx_shape);
    target.extend_from_slice(&shape[a + 1..]);
    let values = ctx.b.cast(values, dtype)?;
    let values = ctx.b.broadcast_to(values, &target)?;
    // One index per slice: flatten the index dims.
    let mut flat = shape[..a].to_vec();
    flat.push(count.clone());
    flat.extend_from_slice(&shape[a + 1..]);
    let values = ctx.b.reshape(values, flat.clone())?;
    let mut spread = vec![Dim::Const(1); shape.len()];
    spread[a] = count;
    let idx = ctx.b.cast(idx, DType::I64)?;
    let idx = ctx.b.reshape(idx, spread)?;
    let idx = ctx.b.op(Op::Expand { shape: flat }, &[idx])?;
    ctx.b.op(Op::Scatter { axis: a, reduce }, &[x, idx, values])
}

/// tril keeps `col - row <= diagonal`, triu keeps `col - row >= diagonal`.
fn triangle(ctx: &mut Ctx, n: &NodeArgs, lower: bool) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let diag = n.opt_int("diagonal", 1)?.unwrap_or(0);
    let shape = ctx.b.shape(x);
    let r = shape.len();
    if r < 2 {
        return Err(Error::Shape(format!(
            "tril/triu of rank {r} at '{}'",
            n.name
        )));
    }
    let iota = |ctx: &mut Ctx, len: Dim| {
        ctx.b.source(
            Op::Iota {
                start: Scalar::Int(0),
                step: Scalar::Int(1),
            },
            TensorType::new(DType::I64, vec![len]),
        )
    };
    let rows = iota(ctx, shape[r - 2].clone())?;
    let rows = ctx
        .b
        .reshape(rows, vec![shape[r - 2].clone(), Dim::Const(1)])?;
    let cols = iota(ctx, shape[r - 1].clone())?;
    let cols = ctx
        .b
        .reshape(cols, vec![Dim::Const(1), shape[r - 1].clone()])?;
    let t = Operand::Tensor;
    let diff = ctx.b.binary(BinaryOp::Sub, t(cols), t(rows))?;
    let cmp = if lower { BinaryOp::Le } else { BinaryOp::Ge };
    let keep = ctx
        .b
        .binary(cmp, t(diff), Operand::Scalar(Scalar::Int(diag)))?;
    let zero = Operand::Scalar(Scalar::Int(0));
    let dtype = ctx.b.dtype(x);
    let zero = ctx.b.operand(zero, dtype)?;
    Ok(Out::Value(ctx.b.where_(keep, t(x), t(zero))?))
}
