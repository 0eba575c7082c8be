//! Indexing: embedding, index_select, gather, advanced indexing with one index tensor,
//! tril/triu.

use super::{axis, tensor, Handler};
use crate::dim::Dim;
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::builder::Operand;
use crate::frontend::pt2::args::{Arg, NodeArgs};
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, Op, ScatterReduce, TensorType};

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
    Ok(Out::Value(
        ctx.b.op(Op::Scatter { axis: a, reduce }, &[x, idx, upd])?,
    ))
}

fn scatter_reduce(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let reduce = match n.string("reduce", 4)? {
        Some("sum") => ScatterReduce::Add,
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
    if !n.bool("include_self", 5, true)? {
        return Err(Error::unsupported_because(
            "scatter_reduce",
            &n.name,
            "include_self=False",
        ));
    }
    scatter(ctx, n, reduce)
}

/// `x[..., idx, ...]` with exactly one integer index tensor (and `None`s before it).
fn index(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let indices = match n.raw("indices", 1) {
        Some(Arg::OptTensors(v)) => v.clone(),
        Some(Arg::Tensors(v)) => v.iter().cloned().map(Some).collect(),
        other => {
            return Err(Error::Compile(format!(
                "node '{}': indices {other:?}",
                n.name
            )))
        }
    };
    let given: Vec<(usize, &String)> = indices
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.as_ref().map(|t| (i, t)))
        .collect();
    let [(a, name)] = given.as_slice() else {
        return Err(Error::unsupported_because(
            "aten.index.Tensor",
            &n.name,
            "indexing with several index tensors",
        ));
    };
    let idx = ctx.value(name)?;
    if ctx.b.dtype(idx) == DType::Bool || ctx.b.dtype(idx) == DType::U8 {
        return Err(Error::unsupported_because(
            "aten.index.Tensor",
            &n.name,
            "boolean-mask indexing (its output shape depends on the data)",
        ));
    }
    Ok(Out::Value(
        ctx.b.op(Op::IndexSelect { axis: *a }, &[x, idx])?,
    ))
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
