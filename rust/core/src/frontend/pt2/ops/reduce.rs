//! Reductions: sum, mean, prod, amax/amin, max/min (values and indices), argmax/argmin,
//! var/std, any/all, histc; the scans cumsum, cumprod, cummax and cummin.

use super::{axis, tensor, Handler};
use crate::dim::{numel, Dim};
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::builder::Operand;
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, Op, ReduceOp, ScanOp, TensorType, UnaryOp, ValueId};

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    Some(match (name, overload) {
        ("sum", "dim_IntList" | "default") => |c, n| sum_prod(c, n, ReduceOp::Sum),
        ("prod", "dim_int" | "default") => |c, n| sum_prod(c, n, ReduceOp::Prod),
        ("mean", "dim" | "default") => mean,
        ("amax", _) => |c, n| extreme(c, n, ReduceOp::Max),
        ("amin", _) => |c, n| extreme(c, n, ReduceOp::Min),
        ("max", "default") => |c, n| extreme(c, n, ReduceOp::Max),
        ("min", "default") => |c, n| extreme(c, n, ReduceOp::Min),
        ("max", "dim") => |c, n| with_indices(c, n, ReduceOp::Max, ReduceOp::ArgMax),
        ("min", "dim") => |c, n| with_indices(c, n, ReduceOp::Min, ReduceOp::ArgMin),
        ("argmax", _) => |c, n| arg(c, n, ReduceOp::ArgMax),
        ("argmin", _) => |c, n| arg(c, n, ReduceOp::ArgMin),
        ("var", "correction" | "dim" | "default") => |c, n| var_std(c, n, false),
        ("std", "correction" | "dim" | "default") => |c, n| var_std(c, n, true),
        ("any", "dim" | "dims" | "default") => |c, n| any_all(c, n, ReduceOp::Max),
        ("all", "dim" | "dims" | "default") => |c, n| any_all(c, n, ReduceOp::Min),
        ("cumsum", "default") => |c, n| cumulative(c, n, ScanOp::Sum),
        ("cumprod", "default") => |c, n| cumulative(c, n, ScanOp::Prod),
        ("cummax", "default") => |c, n| running_extreme(c, n, ScanOp::Max),
        ("cummin", "default") => |c, n| running_extreme(c, n, ScanOp::Min),
        ("histc", "default") => histc,
        _ => return None,
    })
}

/// The reduced axes: the `dim` argument (int or list), all axes when absent or empty.
fn reduce_axes(ctx: &Ctx, n: &NodeArgs, x: ValueId, pos: usize) -> Result<Vec<usize>> {
    let dims = n.opt_ints("dim", pos)?.unwrap_or_default();
    let mut axes: Vec<usize> = if dims.is_empty() {
        (0..ctx.b.rank(x)).collect()
    } else {
        dims.iter()
            .map(|&d| axis(ctx, x, d))
            .collect::<Result<_>>()?
    };
    axes.sort_unstable();
    axes.dedup();
    // A 0-d tensor "reduces" over no axes.
    if ctx.b.rank(x) == 0 {
        axes.clear();
    }
    Ok(axes)
}

/// `op` over `axes` of `x`.
pub(super) fn reduce(
    ctx: &mut Ctx,
    x: ValueId,
    op: ReduceOp,
    axes: Vec<usize>,
    keepdim: bool,
) -> Result<ValueId> {
    ctx.b.op(Op::Reduce { op, axes, keepdim }, &[x])
}

fn sum_prod(ctx: &mut Ctx, n: &NodeArgs, op: ReduceOp) -> Result<Out> {
    let mut x = tensor(ctx, n, "self", 0)?;
    let has_dim = n.target.ends_with(".dim_IntList") || n.target.ends_with(".dim_int");
    let (axes, keepdim, dtype_pos) = if has_dim {
        (reduce_axes(ctx, n, x, 1)?, n.bool("keepdim", 2, false)?, 3)
    } else {
        ((0..ctx.b.rank(x)).collect(), false, 1)
    };
    let dtype = match n.dtype("dtype", dtype_pos)? {
        Some(d) => d,
        None if !ctx.b.dtype(x).is_float() => DType::I64,
        None => ctx.b.dtype(x),
    };
    x = ctx.b.cast(x, dtype)?;
    Ok(Out::Value(reduce(ctx, x, op, axes, keepdim)?))
}

fn mean(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let mut x = tensor(ctx, n, "self", 0)?;
    let (axes, keepdim, dtype_pos) = if n.target.ends_with(".dim") {
        (reduce_axes(ctx, n, x, 1)?, n.bool("keepdim", 2, false)?, 3)
    } else {
        ((0..ctx.b.rank(x)).collect(), false, 1)
    };
    if let Some(d) = n.dtype("dtype", dtype_pos)? {
        x = ctx.b.cast(x, d)?;
    }
    Ok(Out::Value(ctx.b.mean(x, axes, keepdim)?))
}

fn extreme(ctx: &mut Ctx, n: &NodeArgs, op: ReduceOp) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let (axes, keepdim) = if n.target.ends_with(".default") && !n.target.contains(".am") {
        ((0..ctx.b.rank(x)).collect(), false)
    } else {
        (reduce_axes(ctx, n, x, 1)?, n.bool("keepdim", 2, false)?)
    };
    Ok(Out::Value(reduce(ctx, x, op, axes, keepdim)?))
}

fn with_indices(ctx: &mut Ctx, n: &NodeArgs, op: ReduceOp, arg_op: ReduceOp) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let a = axis(ctx, x, n.int("dim", 1)?)?;
    let keepdim = n.bool("keepdim", 2, false)?;
    let axes = if ctx.b.rank(x) == 0 { vec![] } else { vec![a] };
    let values = reduce(ctx, x, op, axes.clone(), keepdim)?;
    let indices = if axes.is_empty() {
        ctx.b.full(Scalar::Int(0), DType::I64, vec![])?
    } else {
        reduce(ctx, x, arg_op, axes, keepdim)?
    };
    Ok(Out::Values(vec![Some(values), Some(indices)]))
}

fn arg(ctx: &mut Ctx, n: &NodeArgs, op: ReduceOp) -> Result<Out> {
    let mut x = tensor(ctx, n, "self", 0)?;
    let keepdim = n.bool("keepdim", 2, false)?;
    let rank = ctx.b.rank(x);
    match n.opt_int("dim", 1)? {
        Some(d) if rank > 0 => {
            let a = axis(ctx, x, d)?;
            Ok(Out::Value(reduce(ctx, x, op, vec![a], keepdim)?))
        }
        _ => {
            // Over the flattened tensor.
            let numel = crate::dim::numel(&ctx.b.shape(x));
            x = ctx.b.reshape(x, vec![numel])?;
            let mut v = reduce(ctx, x, op, vec![0], false)?;
            if keepdim {
                v = ctx.b.reshape(v, vec![crate::dim::Dim::Const(1); rank])?;
            }
            Ok(Out::Value(v))
        }
    }
}

/// `var = sum((x - mean)²) / (n - correction)`, two passes as torch does.
fn var_std(ctx: &mut Ctx, n: &NodeArgs, sqrt: bool) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let axes = reduce_axes(ctx, n, x, 1)?;
    let correction = if n.target.ends_with(".correction") {
        n.scalar("correction", 2)?
            .map(Scalar::as_f64)
            .unwrap_or(1.0)
    } else if n.bool("unbiased", 2, true)? {
        1.0
    } else {
        0.0
    };
    let keepdim = n.bool("keepdim", 3, false)?;
    let dtype = ctx.b.dtype(x);
    let m = ctx.b.mean(x, axes.clone(), true)?;
    let d = ctx
        .b
        .binary(BinaryOp::Sub, Operand::Tensor(x), Operand::Tensor(m))?;
    let sq = ctx
        .b
        .binary(BinaryOp::Mul, Operand::Tensor(d), Operand::Tensor(d))?;
    let ss = reduce(ctx, sq, ReduceOp::Sum, axes.clone(), keepdim)?;
    let shape = ctx.b.shape(x);
    let count = crate::dim::numel(&axes.iter().map(|&a| shape[a].clone()).collect::<Vec<_>>());
    let count = ctx.b.dim_value(&count, DType::F64)?;
    let denom = ctx.b.binary_in(
        BinaryOp::Sub,
        Operand::Tensor(count),
        Operand::Scalar(Scalar::Float(correction)),
        DType::F64,
    )?;
    let denom = ctx.b.binary_in(
        BinaryOp::Max,
        Operand::Tensor(denom),
        Operand::Scalar(Scalar::Float(0.0)),
        DType::F64,
    )?;
    let mut v = ctx.b.binary_in(
        BinaryOp::Div,
        Operand::Tensor(ss),
        Operand::Tensor(denom),
        dtype,
    )?;
    if sqrt {
        v = ctx.b.unary(UnaryOp::Sqrt, v)?;
    }
    Ok(Out::Value(v))
}

/// any = max over bools, all = min over bools.
fn any_all(ctx: &mut Ctx, n: &NodeArgs, op: ReduceOp) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let (axes, keepdim) = if n.target.ends_with(".default") {
        ((0..ctx.b.rank(x)).collect(), false)
    } else {
        (reduce_axes(ctx, n, x, 1)?, n.bool("keepdim", 2, false)?)
    };
    let b = ctx.b.cast(x, DType::Bool)?;
    Ok(Out::Value(reduce(ctx, b, op, axes, keepdim)?))
}

/// `cumsum`/`cumprod`: integers and bools accumulate in i64 unless a dtype is given.
fn cumulative(ctx: &mut Ctx, n: &NodeArgs, op: ScanOp) -> Result<Out> {
    let mut x = tensor(ctx, n, "self", 0)?;
    let a = axis(ctx, x, n.int("dim", 1)?)?;
    let dtype = match n.dtype("dtype", 2)? {
        Some(d) => d,
        None if !ctx.b.dtype(x).is_float() => DType::I64,
        None => ctx.b.dtype(x),
    };
    x = ctx.b.cast(x, dtype)?;
    if ctx.b.rank(x) == 0 {
        return Ok(Out::Value(x));
    }
    Ok(Out::Value(ctx.b.op(Op::Scan { axis: a, op }, &[x])?))
}

/// `cummax`/`cummin`: (values, i64 indices). The index is that of the latest element equal
/// to the running value when it was reached (torch moves it on ties), or of the latest NaN:
/// the running max of the positions where x equals its own running value or is NaN.
fn running_extreme(ctx: &mut Ctx, n: &NodeArgs, op: ScanOp) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    if ctx.b.rank(x) == 0 {
        axis(ctx, x, n.int("dim", 1)?)?;
        let idx = ctx.b.full(Scalar::Int(0), DType::I64, vec![])?;
        return Ok(Out::Values(vec![Some(x), Some(idx)]));
    }
    let a = axis(ctx, x, n.int("dim", 1)?)?;
    let values = ctx.b.op(Op::Scan { axis: a, op }, &[x])?;
    let t = Operand::Tensor;
    let mut reached = ctx.b.binary(BinaryOp::Eq, t(x), t(values))?;
    if ctx.b.dtype(x).is_float() {
        let nan = ctx.b.unary(UnaryOp::IsNan, x)?;
        reached = ctx.b.binary(BinaryOp::Or, t(reached), t(nan))?;
    }
    let shape = ctx.b.shape(x);
    let mut along = vec![Dim::Const(1); shape.len()];
    along[a] = shape[a].clone();
    let positions = ctx.b.source(
        Op::Iota {
            start: Scalar::Int(0),
            step: Scalar::Int(1),
        },
        TensorType::new(DType::I64, vec![shape[a].clone()]),
    )?;
    let positions = ctx.b.reshape(positions, along)?;
    let candidates = ctx
        .b
        .where_(reached, t(positions), Operand::Scalar(Scalar::Int(-1)))?;
    let indices = ctx.b.op(
        Op::Scan {
            axis: a,
            op: ScanOp::Max,
        },
        &[candidates],
    )?;
    Ok(Out::Values(vec![Some(values), Some(indices)]))
}

/// `histc`: counts of x's elements in `bins` equal bins over [min, max] (the data's range
/// when min == max, widened by 1 each way when that is one value), in x's dtype. Elements
/// outside the range (and NaN) are not counted; one equal to max counts in the last bin.
/// As torch's kernel, an element's bin is the number of edges at or below it, the edges
/// being torch's `linspace` computed in x's dtype. With C[i] the number of in-range
/// elements at or above edge i, count[b] = C[b] − C[b+1]: one broadcast comparison and a
/// sum, which fuse.
fn histc(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let bins = n.opt_int("bins", 1)?.unwrap_or(100);
    let min = n.float("min", 2)?.unwrap_or(0.0);
    let max = n.float("max", 3)?.unwrap_or(0.0);
    let dtype = ctx.b.dtype(x);
    if !dtype.is_float() {
        return Err(Error::unsupported_because(
            n.target.clone(),
            &n.name,
            format!("histc of {dtype} (torch's CPU kernel takes floats only)"),
        ));
    }
    if bins < 1 || min > max || !min.is_finite() || !max.is_finite() {
        return Err(Error::Compile(format!(
            "node '{}': histc needs bins ≥ 1 and finite min ≤ max, got bins = {bins}, \
             min = {min}, max = {max}",
            n.name
        )));
    }
    let b = &mut ctx.b;
    let count = numel(&b.shape(x));
    let flat = b.reshape(x, vec![count])?;
    let value =
        |b: &mut crate::frontend::builder::Builder, v: f64| b.full(Scalar::Float(v), dtype, vec![]);
    let (lo, hi) = if min == max {
        let extreme = |b: &mut crate::frontend::builder::Builder, op| {
            b.op(
                Op::Reduce {
                    op,
                    axes: vec![0],
                    keepdim: false,
                },
                &[flat],
            )
        };
        let (lo, hi) = (extreme(b, ReduceOp::Min)?, extreme(b, ReduceOp::Max)?);
        let same = b.binary(BinaryOp::Eq, Operand::Tensor(lo), Operand::Tensor(hi))?;
        let one = Operand::Scalar(Scalar::Float(1.0));
        let lower = b.binary(BinaryOp::Sub, Operand::Tensor(lo), one)?;
        let upper = b.binary(BinaryOp::Add, Operand::Tensor(hi), one)?;
        (
            b.where_(same, Operand::Tensor(lower), Operand::Tensor(lo))?,
            b.where_(same, Operand::Tensor(upper), Operand::Tensor(hi))?,
        )
    } else {
        (value(b, min)?, value(b, max)?)
    };
    // The lower edges e[0..bins] of torch's linspace(lo, hi, bins + 1): the first half
    // counted up from lo, the rest down from hi.
    let i = b.source(
        Op::Iota {
            start: Scalar::Int(0),
            step: Scalar::Int(1),
        },
        TensorType::new(DType::I64, vec![Dim::Const(bins)]),
    )?;
    let fi = b.cast(i, dtype)?;
    let width = b.binary(BinaryOp::Sub, Operand::Tensor(hi), Operand::Tensor(lo))?;
    let step = b.binary(
        BinaryOp::Div,
        Operand::Tensor(width),
        Operand::Scalar(Scalar::Float(bins as f64)),
    )?;
    let up = b.binary(BinaryOp::Mul, Operand::Tensor(step), Operand::Tensor(fi))?;
    let up = b.binary(BinaryOp::Add, Operand::Tensor(lo), Operand::Tensor(up))?;
    let rest = b.binary(
        BinaryOp::Sub,
        Operand::Scalar(Scalar::Float(bins as f64)),
        Operand::Tensor(fi),
    )?;
    let down = b.binary(BinaryOp::Mul, Operand::Tensor(step), Operand::Tensor(rest))?;
    let down = b.binary(BinaryOp::Sub, Operand::Tensor(hi), Operand::Tensor(down))?;
    let first_half = b.binary(
        BinaryOp::Lt,
        Operand::Tensor(i),
        Operand::Scalar(Scalar::Int((bins + 1) / 2)),
    )?;
    let edges = b.where_(first_half, Operand::Tensor(up), Operand::Tensor(down))?;
    let edges = b.reshape(edges, vec![Dim::Const(bins), Dim::Const(1)])?;
    // In range: lo ≤ x ≤ hi (false for NaN).
    let above = b.binary(BinaryOp::Ge, Operand::Tensor(flat), Operand::Tensor(lo))?;
    let below = b.binary(BinaryOp::Le, Operand::Tensor(flat), Operand::Tensor(hi))?;
    let inside = b.binary(
        BinaryOp::And,
        Operand::Tensor(above),
        Operand::Tensor(below),
    )?;
    let at_or_above = b.binary(BinaryOp::Ge, Operand::Tensor(flat), Operand::Tensor(edges))?;
    let counted = b.binary(
        BinaryOp::And,
        Operand::Tensor(at_or_above),
        Operand::Tensor(inside),
    )?;
    let counted = b.cast(counted, dtype)?;
    let c = b.op(
        Op::Reduce {
            op: ReduceOp::Sum,
            axes: vec![1],
            keepdim: false,
        },
        &[counted],
    )?;
    let next = b.slice(c, 0, Dim::Const(1), Dim::Const(bins), 1)?;
    let next = b.op(
        Op::Pad {
            pads: vec![(0, 1)],
            value: Scalar::Float(0.0),
        },
        &[next],
    )?;
    Ok(Out::Value(b.binary(
        BinaryOp::Sub,
        Operand::Tensor(c),
        Operand::Tensor(next),
    )?))
}
