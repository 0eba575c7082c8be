//! Sorting and top-k, shared by the PT2 `sort`/`argsort`/`topk` and ONNX `TopK`. A sort is
//! an `Argsort` and a gather of the values at its positions. A small top-k (the top-1 to
//! top-4 of MoE routers) runs as k rounds of "the best element not yet chosen" along the
//! axis, each a reduction, a comparison and a gather, which fuse with their neighbours;
//! a larger one is the first k of a sort.

use crate::dim::Dim;
use crate::dtype::{DType, Scalar};
use crate::error::Result;
use crate::frontend::builder::{Builder, Operand};
use crate::ir::{BinaryOp, Op, ReduceOp, TensorType, UnaryOp, ValueId};

/// Up to this k, selection rounds; beyond it a sort (each round is a pass over the line).
const MAX_ROUNDS: i64 = 4;

/// `x` sorted along axis `a` as (values, i64 positions), stable; NaN ranks above every
/// number (last ascending, first descending), as torch's sort.
pub fn sort(b: &mut Builder, x: ValueId, a: usize, descending: bool) -> Result<(ValueId, ValueId)> {
    let indices = b.op(
        Op::Argsort {
            axis: a,
            descending,
        },
        &[x],
    )?;
    let values = b.op(Op::Gather { axis: a }, &[x, indices])?;
    Ok((values, indices))
}

/// The k best elements of `x` along axis `a`, best first, as (values, i64 indices); ties go
/// to the lower index and NaN counts as the largest value, as in torch.
pub fn top_k(
    b: &mut Builder,
    x: ValueId,
    a: usize,
    k: i64,
    largest: bool,
) -> Result<(ValueId, ValueId)> {
    if k <= MAX_ROUNDS {
        return select_rounds(b, x, a, k, largest);
    }
    let (values, indices) = sort(b, x, a, largest)?;
    let first = |b: &mut Builder, v: ValueId| b.slice(v, a, Dim::Const(0), Dim::Const(k), 1);
    Ok((first(b, values)?, first(b, indices)?))
}

/// The k best elements of `x` along axis `a`, best first, as (values, i64 indices). Ties go
/// to the lower index. NaN counts as the largest value, as in torch; with `largest = false`
/// NaNs come last but rank equal to +inf (torch puts them after +inf).
fn select_rounds(
    b: &mut Builder,
    x: ValueId,
    a: usize,
    k: i64,
    largest: bool,
) -> Result<(ValueId, ValueId)> {
    let shape = b.shape(x);
    let float = b.dtype(x).is_float();
    let (best, worst_of) = if largest {
        (ReduceOp::Max, ReduceOp::Min)
    } else {
        (ReduceOp::Min, ReduceOp::Max)
    };
    let reduce = |b: &mut Builder, op: ReduceOp, v: ValueId| {
        b.op(
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
            let nan = b.unary(UnaryOp::IsNan, x)?;
            key = b.where_(
                nan,
                Operand::Scalar(Scalar::Float(f64::INFINITY)),
                Operand::Tensor(x),
            )?;
        }
        Operand::Scalar(Scalar::Float(inf))
    } else {
        Operand::Tensor(reduce(b, worst_of, x)?)
    };
    // Positions along the axis, shaped to broadcast against the keepdim reductions.
    let iota = b.source(
        Op::Iota {
            start: Scalar::Int(0),
            step: Scalar::Int(1),
        },
        TensorType::new(DType::I64, vec![shape[a].clone()]),
    )?;
    let mut iota_shape = vec![Dim::Const(1); shape.len()];
    iota_shape[a] = shape[a].clone();
    let iota = b.reshape(iota, iota_shape)?;

    let mut chosen: Option<ValueId> = None;
    let (mut values, mut indices) = (Vec::new(), Vec::new());
    for _ in 0..k {
        let masked = match chosen {
            Some(c) => b.where_(c, fill, Operand::Tensor(key))?,
            None => key,
        };
        let m = reduce(b, best, masked)?;
        let mut hit = b.binary(BinaryOp::Eq, Operand::Tensor(masked), Operand::Tensor(m))?;
        if float && largest {
            // A NaN maximum equals only the NaNs.
            let nan_x = b.unary(UnaryOp::IsNan, masked)?;
            let nan_m = b.unary(UnaryOp::IsNan, m)?;
            let both = b.binary(
                BinaryOp::And,
                Operand::Tensor(nan_x),
                Operand::Tensor(nan_m),
            )?;
            hit = b.binary(BinaryOp::Or, Operand::Tensor(hit), Operand::Tensor(both))?;
        }
        if let Some(c) = chosen {
            let free = b.unary(UnaryOp::Not, c)?;
            hit = b.binary(BinaryOp::And, Operand::Tensor(hit), Operand::Tensor(free))?;
        }
        // The first candidate: argmax of a 0/1 tensor is its first 1.
        let hit_i = b.cast(hit, DType::I64)?;
        let idx = reduce(b, ReduceOp::ArgMax, hit_i)?;
        let picked = b.binary(BinaryOp::Eq, Operand::Tensor(iota), Operand::Tensor(idx))?;
        chosen = Some(match chosen {
            Some(c) => b.binary(BinaryOp::Or, Operand::Tensor(c), Operand::Tensor(picked))?,
            None => picked,
        });
        values.push(b.op(Op::Gather { axis: a }, &[x, idx])?);
        indices.push(idx);
    }
    let concat = |b: &mut Builder, parts: Vec<ValueId>| {
        if parts.len() == 1 {
            Ok(parts[0])
        } else {
            b.op(Op::Concat { axis: a }, &parts)
        }
    };
    Ok((concat(b, values)?, concat(b, indices)?))
}
