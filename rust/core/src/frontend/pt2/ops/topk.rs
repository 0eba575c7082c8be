//! `topk` by repeated selection: k rounds of "the best element not yet chosen" along the
//! axis, each a reduction, a comparison and a gather. The IR has no sort; for the small k of
//! MoE routers (top-1 to top-8 of a few dozen experts) this costs k passes over the row.

use super::{axis, tensor, Handler};
use crate::dim::Dim;
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::builder::Operand;
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, Op, ReduceOp, TensorType, UnaryOp, ValueId};

/// Beyond this many rounds the graph grows too large to be worth it; a sort op is needed.
const MAX_K: i64 = 64;

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    Some(match (name, overload) {
        ("topk", "default") => topk,
        _ => return None,
    })
}

fn topk(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let k = n.int("k", 1)?;
    let largest = n.bool("largest", 3, true)?;
    if !(0..=MAX_K).contains(&k) {
        return Err(Error::unsupported_because(
            n.target.clone(),
            &n.name,
            format!("k = {k}: topk runs as k selection rounds, at most {MAX_K}"),
        ));
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
    let (values, indices) = select_rounds(ctx, x, a, k, largest)?;
    Ok(Out::Values(vec![Some(values), Some(indices)]))
}

/// The k best elements of `x` along axis `a`, best first, as (values, i64 indices). Ties go
/// to the lower index. NaN counts as the largest value, as in torch; with `largest = false`
/// NaNs come last but rank equal to +inf (torch puts them after +inf).
fn select_rounds(
    ctx: &mut Ctx,
    x: ValueId,
    a: usize,
    k: i64,
    largest: bool,
) -> Result<(ValueId, ValueId)> {
    let shape = ctx.b.shape(x);
    let float = ctx.b.dtype(x).is_float();
    let (best, worst_of) = if largest {
        (ReduceOp::Max, ReduceOp::Min)
    } else {
        (ReduceOp::Min, ReduceOp::Max)
    };
    let reduce = |ctx: &mut Ctx, op: ReduceOp, v: ValueId| {
        ctx.b.op(
            Op::Reduce {
                op,
                axes: vec![a],
                keepdim: true,
            },
            &[v],
        )
    };
    // The ranking key, and what chosen elements are replaced by so they never win again.
    let mut key = x;
    let fill = if float {
        let inf = if largest {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        };
        if !largest {
            let nan = ctx.b.unary(UnaryOp::IsNan, x)?;
            key = ctx.b.where_(
                nan,
                Operand::Scalar(Scalar::Float(f64::INFINITY)),
                Operand::Tensor(x),
            )?;
        }
        Operand::Scalar(Scalar::Float(inf))
    } else {
        Operand::Tensor(reduce(ctx, worst_of, x)?)
    };
    // Positions along the axis, shaped to broadcast against the keepdim reductions.
    let iota = ctx.b.source(
        Op::Iota {
            start: Scalar::Int(0),
            step: Scalar::Int(1),
        },
        TensorType::new(DType::I64, vec![shape[a].clone()]),
    )?;
    let mut iota_shape = vec![Dim::Const(1); shape.len()];
    iota_shape[a] = shape[a].clone();
    let iota = ctx.b.reshape(iota, iota_shape)?;

    let mut chosen: Option<ValueId> = None;
    let (mut values, mut indices) = (Vec::new(), Vec::new());
    for _ in 0..k {
        let masked = match chosen {
            Some(c) => ctx.b.where_(c, fill, Operand::Tensor(key))?,
            None => key,
        };
        let m = reduce(ctx, best, masked)?;
        let mut hit = ctx
            .b
            .binary(BinaryOp::Eq, Operand::Tensor(masked), Operand::Tensor(m))?;
        if float && largest {
            // A NaN maximum equals only the NaNs.
            let nan_x = ctx.b.unary(UnaryOp::IsNan, masked)?;
            let nan_m = ctx.b.unary(UnaryOp::IsNan, m)?;
            let both = ctx.b.binary(
                BinaryOp::And,
                Operand::Tensor(nan_x),
                Operand::Tensor(nan_m),
            )?;
            hit = ctx
                .b
                .binary(BinaryOp::Or, Operand::Tensor(hit), Operand::Tensor(both))?;
        }
        if let Some(c) = chosen {
            let free = ctx.b.unary(UnaryOp::Not, c)?;
            hit = ctx
                .b
                .binary(BinaryOp::And, Operand::Tensor(hit), Operand::Tensor(free))?;
        }
        // The first candidate: argmax of a 0/1 tensor is its first 1.
        let hit_i = ctx.b.cast(hit, DType::I64)?;
        let idx = reduce(ctx, ReduceOp::ArgMax, hit_i)?;
        let picked = ctx
            .b
            .binary(BinaryOp::Eq, Operand::Tensor(iota), Operand::Tensor(idx))?;
        chosen = Some(match chosen {
            Some(c) => ctx
                .b
                .binary(BinaryOp::Or, Operand::Tensor(c), Operand::Tensor(picked))?,
            None => picked,
        });
        values.push(ctx.b.op(Op::Gather { axis: a }, &[x, idx])?);
        indices.push(idx);
    }
    let concat = |ctx: &mut Ctx, parts: Vec<ValueId>| {
        if parts.len() == 1 {
            Ok(parts[0])
        } else {
            ctx.b.op(Op::Concat { axis: a }, &parts)
        }
    };
    Ok((concat(ctx, values)?, concat(ctx, indices)?))
}
