//! `aten.sort`, `aten.argsort` and `aten.topk` (`frontend::sort`); `aten.bucketize` and
//! `aten.searchsorted` (positions in a sorted sequence).

use super::reduce::reduce;
use super::{axis, tensor, Handler};
use crate::dim::Dim;
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::builder::Operand;
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::frontend::sort::{sort, top_k};
use crate::ir::{BinaryOp, ReduceOp, UnaryOp, ValueId};

/// Where `dim` and `descending` sit: positional in the default overloads, keyword-only
/// (after `*, stable`) in the `.stable` ones.
const POSITIONAL: (usize, usize) = (1, 2);
const KEYWORD: (usize, usize) = (usize::MAX, usize::MAX);

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    Some(match (name, overload) {
        ("topk", "default") => topk,
        ("sort", "default") => |c, n| sort_values(c, n, POSITIONAL),
        ("sort", "stable") => |c, n| sort_values(c, n, KEYWORD),
        ("argsort", "default") => |c, n| argsort(c, n, POSITIONAL),
        ("argsort", "stable") => |c, n| argsort(c, n, KEYWORD),
        ("bucketize", "Tensor") => bucketize,
        ("searchsorted", "Tensor") => searchsorted,
        _ => return None,
    })
}

/// (values, indices) of a sort. Ember's sort is always stable, which is one of the orders
/// an unstable sort may return.
fn sorted(ctx: &mut Ctx, n: &NodeArgs, (dim, desc): (usize, usize)) -> Result<(ValueId, ValueId)> {
    let x = tensor(ctx, n, "self", 0)?;
    let descending = n.bool("descending", desc, false)?;
    let d = n.opt_int("dim", dim)?.unwrap_or(-1);
    if ctx.b.rank(x) == 0 {
        // A 0-d tensor is sorted (torch accepts dim 0 or -1).
        let idx = ctx.b.full(Scalar::Int(0), DType::I64, vec![])?;
        return Ok((x, idx));
    }
    let a = axis(ctx, x, d)?;
    sort(&mut ctx.b, x, a, descending)
}

fn sort_values(ctx: &mut Ctx, n: &NodeArgs, at: (usize, usize)) -> Result<Out> {
    let (values, indices) = sorted(ctx, n, at)?;
    Ok(Out::Values(vec![Some(values), Some(indices)]))
}

fn argsort(ctx: &mut Ctx, n: &NodeArgs, at: (usize, usize)) -> Result<Out> {
    let (_, indices) = sorted(ctx, n, at)?;
    Ok(Out::Value(indices))
}

fn topk(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let k = n.int("k", 1)?;
    let largest = n.bool("largest", 3, true)?;
    if k < 0 {
        return Err(Error::Compile(format!(
            "node '{}': topk with k = {k}",
            n.name
        )));
    }
    let dtype = ctx.b.dtype(x);
    if dtype == DType::Bool {
        return Err(Error::unsupported_because(
            n.target.clone(),
            &n.name,
            "topk of a bool tensor (torch has no such kernel either)",
        ));
    }
    if ctx.b.rank(x) == 0 {
        // A 0-d tensor is its own top-1 (torch accepts k = 0 or 1 and dim 0 or -1).
        if k != 1 {
            return Err(Error::Compile(format!(
                "node '{}': topk of a 0-d tensor with k = {k}",
                n.name
            )));
        }
        let idx = ctx.b.full(Scalar::Int(0), DType::I64, vec![])?;
        return Ok(Out::Values(vec![Some(x), Some(idx)]));
    }
    let a = axis(ctx, x, n.opt_int("dim", 2)?.unwrap_or(-1))?;
    if let Some(size) = ctx.b.shape(x)[a].as_const() {
        if k > size {
            return Err(Error::Compile(format!(
                "node '{}': topk k = {k} exceeds the dim's size {size}",
                n.name
            )));
        }
    }
    if k == 0 {
        let values = ctx.b.slice(x, a, Dim::Const(0), Dim::Const(0), 1)?;
        let indices = ctx.b.cast(values, DType::I64)?;
        return Ok(Out::Values(vec![Some(values), Some(indices)]));
    }
    let (values, indices) = top_k(&mut ctx.b, x, a, k, largest)?;
    Ok(Out::Values(vec![Some(values), Some(indices)]))
}

/// The insertion positions of `values` in `sorted` (its last axis; a 1-D sequence serves
/// every value, an N-D one the values of its row): the count of entries that are not ≥ the
/// value (`right`: not >), as torch's binary search counts them, so a NaN value lands past
/// the end as it does in torch. Compares every value with every entry: a sequence is a few
/// bucket edges in the models that use these.
fn positions(
    ctx: &mut Ctx,
    sorted: ValueId,
    values: ValueId,
    right: bool,
    out_int32: bool,
) -> Result<ValueId> {
    let vs = ctx.b.shape(values);
    let mut vcol = vs.clone();
    vcol.push(Dim::Const(1));
    let v = ctx.b.reshape(values, vcol)?;
    let ss = ctx.b.shape(sorted);
    let s = if ss.len() > 1 {
        let mut srow = ss.clone();
        srow.insert(ss.len() - 1, Dim::Const(1));
        ctx.b.reshape(sorted, srow)?
    } else {
        sorted
    };
    let op = if right { BinaryOp::Gt } else { BinaryOp::Ge };
    let past = ctx.b.binary(op, Operand::Tensor(s), Operand::Tensor(v))?;
    let before = ctx.b.unary(UnaryOp::Not, past)?;
    let before = ctx.b.cast(before, DType::I64)?;
    let axis = ctx.b.rank(before) - 1;
    let count = reduce(ctx, before, ReduceOp::Sum, vec![axis], false)?;
    match out_int32 {
        true => ctx.b.cast(count, DType::I32),
        false => Ok(count),
    }
}

fn bucketize(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let edges = tensor(ctx, n, "boundaries", 1)?;
    if ctx.b.rank(edges) != 1 {
        return Err(Error::Shape(format!(
            "node '{}' (aten.bucketize): boundaries must be 1-D, not {}",
            n.name,
            crate::dim::format_shape(&ctx.b.shape(edges))
        )));
    }
    let out_int32 = n.bool("out_int32", usize::MAX, false)?;
    let right = n.bool("right", usize::MAX, false)?;
    Ok(Out::Value(positions(ctx, edges, x, right, out_int32)?))
}

fn searchsorted(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let seq = tensor(ctx, n, "sorted_sequence", 0)?;
    let x = tensor(ctx, n, "self", 1)?;
    if n.opt_tensor("sorter", usize::MAX)?.is_some() {
        return Err(Error::unsupported_because(
            "aten.searchsorted",
            &n.name,
            "a sorter (sort the sequence first)",
        ));
    }
    let (ss, xs) = (ctx.b.shape(seq), ctx.b.shape(x));
    if ss.len() > 1 && (xs.len() != ss.len() || xs[..xs.len() - 1] != ss[..ss.len() - 1]) {
        return Err(Error::Shape(format!(
            "node '{}' (aten.searchsorted): sequence {} and values {} differ in their leading dims",
            n.name,
            crate::dim::format_shape(&ss),
            crate::dim::format_shape(&xs)
        )));
    }
    let out_int32 = n.bool("out_int32", usize::MAX, false)?;
    // `side` ("left"/"right"), when given, is what `right` says.
    let right = match n.string("side", usize::MAX)? {
        Some("left") => false,
        Some("right") => true,
        Some(other) => {
            return Err(Error::Compile(format!(
                "node '{}' (aten.searchsorted): side must be 'left' or 'right', not '{other}'",
                n.name
            )))
        }
        None => n.bool("right", usize::MAX, false)?,
    };
    Ok(Out::Value(positions(ctx, seq, x, right, out_int32)?))
}
