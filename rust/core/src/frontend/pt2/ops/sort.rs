//! `aten.sort`, `aten.argsort` and `aten.topk` (`frontend::sort`); order statistics
//! (`median`, `nanmedian`, `kthvalue`) read from a sort; `aten.bucketize` and
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
use crate::ir::{BinaryOp, Op, ReduceOp, UnaryOp, ValueId};

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
        ("kthvalue", "default") => kthvalue,
        ("median", "default") => |c, n| median(c, n, Median::All, false),
        ("median", "dim") => |c, n| median(c, n, Median::Dim, false),
        ("nanmedian", "default") => |c, n| median(c, n, Median::All, true),
        ("nanmedian", "dim") => |c, n| median(c, n, Median::Dim, true),
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

/// Which element of each sorted line an order statistic reads.
enum Rank {
    /// The k-th smallest (0-based).
    Nth(i64),
    /// The lower median: of the numbers (`ignore_nan`) or of all elements, a NaN when
    /// there is one (torch returns the first NaN and its index).
    Median { ignore_nan: bool },
}

/// The `rank` order statistic of `x` along axis `a` as (values, i64 indices), keeping the
/// axis as size 1. The elements are sorted ascending, NaN last and stable, so with `c`
/// NaNs in a line of `n` the median sits at (n − 1) / 2 without NaNs, at n − c (the first
/// NaN in input order) with them, and the NaN-ignoring median at (n − c − 1) / 2 (position
/// 0, a NaN, when all are). The read is a gather, so a position past the line (k beyond a
/// symbolic size) is a run-time error rather than a wrong element.
fn order_statistic(ctx: &mut Ctx, x: ValueId, a: usize, rank: Rank) -> Result<(ValueId, ValueId)> {
    let (values, indices) = sort(&mut ctx.b, x, a, false)?;
    let mut line = ctx.b.shape(x);
    let len = std::mem::replace(&mut line[a], Dim::Const(1));
    let t = Operand::Tensor;
    let int = |v: i64| Operand::Scalar(Scalar::Int(v));
    let pos = match rank {
        Rank::Nth(k) => ctx.b.full(Scalar::Int(k), DType::I64, line)?,
        Rank::Median { ignore_nan } => {
            let n = ctx.b.dim_value(&len, DType::I64)?;
            let count = if ctx.b.dtype(x).is_float() {
                let nan = ctx.b.unary(UnaryOp::IsNan, x)?;
                let nan = ctx.b.cast(nan, DType::I64)?;
                reduce(ctx, nan, ReduceOp::Sum, vec![a], true)?
            } else {
                ctx.b.full(Scalar::Int(0), DType::I64, line)?
            };
            let numbers = ctx.b.binary(BinaryOp::Sub, t(n), t(count))?;
            let below = ctx.b.binary(BinaryOp::Sub, t(numbers), int(1))?;
            let below = ctx.b.binary(BinaryOp::Max, t(below), int(0))?;
            let middle = ctx.b.binary(BinaryOp::FloorDiv, t(below), int(2))?;
            if ignore_nan {
                middle
            } else {
                let any_nan = ctx.b.binary(BinaryOp::Gt, t(count), int(0))?;
                ctx.b.where_(any_nan, t(numbers), t(middle))?
            }
        }
    };
    let values = ctx.b.op(Op::Gather { axis: a }, &[values, pos])?;
    let indices = ctx.b.op(Op::Gather { axis: a }, &[indices, pos])?;
    Ok((values, indices))
}

/// Whether a median reduces one dim (values and indices) or the whole tensor (a value).
enum Median {
    Dim,
    All,
}

fn median(ctx: &mut Ctx, n: &NodeArgs, over: Median, ignore_nan: bool) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    if ctx.b.dtype(x) == DType::Bool {
        return Err(Error::unsupported_because(
            n.target.clone(),
            &n.name,
            "the median of a bool tensor (torch has no such kernel either)",
        ));
    }
    let rank = Rank::Median { ignore_nan };
    match over {
        Median::All => {
            let numel = crate::dim::numel(&ctx.b.shape(x));
            let flat = ctx.b.reshape(x, vec![numel])?;
            let (values, _) = order_statistic(ctx, flat, 0, rank)?;
            Ok(Out::Value(ctx.b.reshape(values, vec![])?))
        }
        Median::Dim => {
            let keepdim = n.bool("keepdim", 2, false)?;
            statistic_along(ctx, x, n.int("dim", 1)?, keepdim, rank)
        }
    }
}

fn kthvalue(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let k = n.int("k", 1)?;
    let d = n.opt_int("dim", 2)?.unwrap_or(-1);
    let keepdim = n.bool("keepdim", 3, false)?;
    if ctx.b.dtype(x) == DType::Bool {
        return Err(Error::unsupported_because(
            n.target.clone(),
            &n.name,
            "kthvalue of a bool tensor (torch has no such kernel either)",
        ));
    }
    let size = if ctx.b.rank(x) == 0 {
        Some(1)
    } else {
        ctx.b.shape(x)[axis(ctx, x, d)?].as_const()
    };
    if k < 1 || size.is_some_and(|s| k > s) {
        return Err(Error::Compile(format!(
            "node '{}' (aten.kthvalue): k = {k} is outside 1..={} for shape {}",
            n.name,
            size.map_or("size".into(), |s| s.to_string()),
            crate::dim::format_shape(&ctx.b.shape(x))
        )));
    }
    statistic_along(ctx, x, d, keepdim, Rank::Nth(k - 1))
}

/// (values, indices) of an order statistic along `dim`; a 0-d tensor is its own.
fn statistic_along(ctx: &mut Ctx, x: ValueId, dim: i64, keepdim: bool, rank: Rank) -> Result<Out> {
    if ctx.b.rank(x) == 0 {
        let idx = ctx.b.full(Scalar::Int(0), DType::I64, vec![])?;
        return Ok(Out::Values(vec![Some(x), Some(idx)]));
    }
    let a = axis(ctx, x, dim)?;
    let (mut values, mut indices) = order_statistic(ctx, x, a, rank)?;
    if !keepdim {
        let mut shape = ctx.b.shape(values);
        shape.remove(a);
        values = ctx.b.reshape(values, shape.clone())?;
        indices = ctx.b.reshape(indices, shape)?;
    }
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
