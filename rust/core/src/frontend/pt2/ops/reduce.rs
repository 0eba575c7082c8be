//! Reductions: sum, mean, prod, amax/amin, max/min (values and indices), argmax/argmin,
//! var/std, any/all, cumsum.

use super::{axis, tensor, Handler};
use crate::dtype::{DType, Scalar};
use crate::error::Result;
use crate::frontend::builder::Operand;
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, Op, ReduceOp, UnaryOp, ValueId};

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
        ("cumsum", "default") => cumsum,
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

fn reduce(
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

fn cumsum(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
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
    Ok(Out::Value(ctx.b.op(Op::Cumsum { axis: a }, &[x])?))
}
