//! Reductions: ReduceSum/Mean/Max/Min/Prod/L1/L2/SumSquare/LogSum/LogSumExp, ArgMax, ArgMin.
//! `axes` is an input from opset 13 (ReduceSum) or 18 (the others), an attribute before.

use super::{axes, axis, one, Handler};
use crate::dim::Dim;
use crate::error::Result;
use crate::frontend::builder::Operand;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, Op, ReduceOp, UnaryOp, ValueId};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceProd" | "ReduceL1"
        | "ReduceL2" | "ReduceSumSquare" | "ReduceLogSum" | "ReduceLogSumExp" => reduce,
        "ArgMax" | "ArgMin" => arg_reduce,
        "TopK" => top_k,
        _ => return None,
    })
}

/// The reduced axes, or `None` for "no reduction" (`noop_with_empty_axes`).
fn reduce_axes(ctx: &Ctx, n: &Node, rank: usize) -> Result<Option<Vec<usize>>> {
    let list = if n.input(1).is_some() {
        ctx.const_ints(n, 1, "axes")?
    } else {
        n.ints("axes")?.unwrap_or_default()
    };
    if list.is_empty() {
        if n.flag("noop_with_empty_axes", false)? {
            return Ok(None);
        }
        return Ok(Some((0..rank).collect()));
    }
    axes(ctx, n, &list, rank).map(Some)
}

fn sum(ctx: &mut Ctx, x: ValueId, axes: &[usize], keep: bool) -> Result<ValueId> {
    red(ctx, ReduceOp::Sum, x, axes, keep)
}

fn red(ctx: &mut Ctx, op: ReduceOp, x: ValueId, axes: &[usize], keep: bool) -> Result<ValueId> {
    ctx.b.op(
        Op::Reduce {
            op,
            axes: axes.to_vec(),
            keepdim: keep,
        },
        &[x],
    )
}

fn reduce(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let rank = ctx.b.rank(x);
    let keep = n.flag("keepdims", true)?;
    let Some(ax) = reduce_axes(ctx, n, rank)? else {
        return one(x);
    };
    if ax.is_empty() {
        return one(x);
    }
    let float_only = !matches!(
        n.op,
        "ReduceSum" | "ReduceMax" | "ReduceMin" | "ReduceProd" | "ReduceSumSquare" | "ReduceL1"
    );
    if float_only && !ctx.b.dtype(x).is_float() {
        return Err(n.err(format!("needs a float input, got {}", ctx.b.dtype(x))));
    }
    let v = match n.op {
        "ReduceSum" => sum(ctx, x, &ax, keep)?,
        "ReduceMean" => ctx.b.mean(x, ax, keep)?,
        "ReduceMax" => red(ctx, ReduceOp::Max, x, &ax, keep)?,
        "ReduceMin" => red(ctx, ReduceOp::Min, x, &ax, keep)?,
        "ReduceProd" => red(ctx, ReduceOp::Prod, x, &ax, keep)?,
        "ReduceL1" => {
            let a = ctx.b.unary(UnaryOp::Abs, x)?;
            sum(ctx, a, &ax, keep)?
        }
        "ReduceL2" | "ReduceSumSquare" => {
            let sq = ctx
                .b
                .binary(BinaryOp::Mul, Operand::Tensor(x), Operand::Tensor(x))?;
            let s = sum(ctx, sq, &ax, keep)?;
            if n.op == "ReduceL2" {
                ctx.b.unary(UnaryOp::Sqrt, s)?
            } else {
                s
            }
        }
        "ReduceLogSum" => {
            let s = sum(ctx, x, &ax, keep)?;
            ctx.b.unary(UnaryOp::Log, s)?
        }
        _ => log_sum_exp(ctx, x, &ax, keep)?,
    };
    one(v)
}

/// `log(sum(exp(x - max))) + max`, stable for large inputs (what ONNX Runtime computes).
fn log_sum_exp(ctx: &mut Ctx, x: ValueId, ax: &[usize], keep: bool) -> Result<ValueId> {
    let m = red(ctx, ReduceOp::Max, x, ax, true)?;
    let shifted = ctx
        .b
        .binary(BinaryOp::Sub, Operand::Tensor(x), Operand::Tensor(m))?;
    let e = ctx.b.unary(UnaryOp::Exp, shifted)?;
    let s = sum(ctx, e, ax, true)?;
    let l = ctx.b.unary(UnaryOp::Log, s)?;
    let r = ctx
        .b
        .binary(BinaryOp::Add, Operand::Tensor(l), Operand::Tensor(m))?;
    if keep {
        return Ok(r);
    }
    let shape: Vec<Dim> = ctx
        .b
        .shape(r)
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !ax.contains(i))
        .map(|(_, d)| d)
        .collect();
    ctx.b.reshape(r, shape)
}

fn arg_reduce(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let rank = ctx.b.rank(x);
    let a = axis(ctx, n.int("axis", 0)?, rank)?;
    let keep = n.flag("keepdims", true)?;
    let op = if n.op == "ArgMax" {
        ReduceOp::ArgMax
    } else {
        ReduceOp::ArgMin
    };
    if rank == 0 {
        return one(ctx.b.full(
            crate::dtype::Scalar::Int(0),
            crate::dtype::DType::I64,
            vec![],
        )?);
    }
    if !n.flag("select_last_index", false)? {
        return one(red(ctx, op, x, &[a], keep)?);
    }
    // The last extreme is the first one of the reversed axis, counted from the end.
    let flipped = ctx.b.op(Op::Flip { axes: vec![a] }, &[x])?;
    let idx = red(ctx, op, flipped, &[a], keep)?;
    let size = ctx.b.shape(x)[a].clone();
    let last = ctx
        .b
        .dim_value(&(&size - &Dim::Const(1)), crate::dtype::DType::I64)?;
    one(ctx
        .b
        .binary(BinaryOp::Sub, Operand::Tensor(last), Operand::Tensor(idx))?)
}

/// `TopK` (K a constant input): values and int64 indices of the K largest (or smallest)
/// along `axis`, best first, ties to the lower index (`frontend::sort`).
fn top_k(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    use crate::frontend::sort::top_k;
    let x = ctx.input(n, 0)?;
    let k = match ctx.const_ints(n, 1, "K")?.as_slice() {
        [k] => *k,
        other => return Err(n.err(format!("K must hold one value, got {other:?}"))),
    };
    let rank = ctx.b.rank(x);
    if rank == 0 {
        return Err(n.err("TopK of a 0-d tensor"));
    }
    let a = super::axis(ctx, n.int("axis", -1)?, rank)?;
    let largest = n.flag("largest", true)?;
    if ctx.b.dtype(x) == crate::dtype::DType::Bool {
        return Err(n.err("TopK of a bool tensor"));
    }
    if k < 0 {
        return Err(n.err(format!("K = {k}: TopK needs K ≥ 0")));
    }
    if let Some(size) = ctx.b.shape(x)[a].as_const() {
        if k > size {
            return Err(n.err(format!("K = {k} exceeds the axis's size {size}")));
        }
    }
    if k == 0 {
        // Empty outputs, as ONNX Runtime gives (and as the PT2 `topk` does).
        let values = ctx.b.slice(x, a, Dim::Const(0), Dim::Const(0), 1)?;
        let indices = ctx.b.cast(values, crate::dtype::DType::I64)?;
        return Ok(vec![Val::of(values), Val::of(indices)]);
    }
    let (values, indices) = top_k(&mut ctx.b, x, a, k, largest)?;
    Ok(vec![Val::of(values), Val::of(indices)])
}
