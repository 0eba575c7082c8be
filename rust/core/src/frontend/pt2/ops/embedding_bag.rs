//! `F.embedding_bag` (`aten._embedding_bag_forward_only`, `aten._embedding_bag`): the rows of
//! an embedding table that each bag's indices name, summed, averaged or maxed per bag, as
//! recommendation models (DLRM) pool their sparse features.
//!
//! Bags are runs of the flat index list starting at `offsets`. The bag of each index is the
//! running count of bag starts at or before it, less one: a scatter-add of ones at the
//! offsets and a cumsum, linear in the number of indices. The rows are then scatter-reduced
//! into their bags. Indices equal to `padding_idx` take no part (nor count for a mean); an
//! empty bag is zeros, as in torch.

use super::{tensor, Handler};
use crate::dim::Dim;
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::builder::Operand;
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, Op, ScanOp, ScatterReduce, ValueId};

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    Some(match (name, overload) {
        ("_embedding_bag_forward_only" | "_embedding_bag", "default") => embedding_bag,
        ("embedding_bag", "default" | "padding_idx") => embedding_bag,
        _ => return None,
    })
}

/// torch's `mode` codes.
const SUM: i64 = 0;
const MEAN: i64 = 1;
const MAX: i64 = 2;

fn embedding_bag(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let weight = tensor(ctx, n, "weight", 0)?;
    let indices = tensor(ctx, n, "indices", 1)?;
    let offsets = tensor(ctx, n, "offsets", 2)?;
    let mode = n.opt_int("mode", 4)?.unwrap_or(SUM);
    let per_sample = match n.opt_tensor("per_sample_weights", 6)? {
        Some(t) => Some(ctx.value(t)?),
        None => None,
    };
    let include_last_offset = n.bool("include_last_offset", 7, false)?;
    let padding_idx = n.opt_int("padding_idx", 8)?.unwrap_or(-1);
    let fail = |why: String| Error::Compile(format!("node '{}' ({}): {why}", n.name, n.target));
    let (ws, is, os) = (
        ctx.b.shape(weight),
        ctx.b.shape(indices),
        ctx.b.shape(offsets),
    );
    if ws.len() != 2 || is.len() != 1 || os.len() != 1 {
        return Err(fail(format!(
            "needs a 2-D table and 1-D indices and offsets, got {}, {} and {}",
            crate::dim::format_shape(&ws),
            crate::dim::format_shape(&is),
            crate::dim::format_shape(&os)
        )));
    }
    if !matches!(mode, SUM | MEAN | MAX) {
        return Err(fail(format!("mode {mode} (0 sum, 1 mean, 2 max)")));
    }
    if per_sample.is_some() && mode != SUM {
        return Err(fail("per_sample_weights with a mode other than sum".into()));
    }
    let dtype = ctx.b.dtype(weight);
    let t = Operand::Tensor;
    let int = |v: i64| Operand::Scalar(Scalar::Int(v));
    let count = is[0].clone();
    let bags = match include_last_offset {
        true => &os[0] - &Dim::Const(1),
        false => os[0].clone(),
    };
    let width = ws[1].clone();

    // The bag of each index.
    let indices = ctx.b.cast(indices, DType::I64)?;
    let offsets = ctx.b.cast(offsets, DType::I64)?;
    let starts = ctx.b.slice(offsets, 0, Dim::Const(0), bags.clone(), 1)?;
    // A start at the end (an empty last bag) marks the slot past the indices.
    let past = ctx.b.dim_value(&count, DType::I64)?;
    let starts = ctx.b.binary(BinaryOp::Min, t(starts), t(past))?;
    let slots = ctx
        .b
        .full(Scalar::Int(0), DType::I64, vec![&count + &Dim::Const(1)])?;
    let ones = ctx.b.full(Scalar::Int(1), DType::I64, vec![bags.clone()])?;
    let marks = scatter(ctx, slots, starts, ones, ScatterReduce::Add)?;
    let marks = ctx.b.slice(marks, 0, Dim::Const(0), count.clone(), 1)?;
    let scan = Op::Scan {
        axis: 0,
        op: ScanOp::Sum,
    };
    let started = ctx.b.op(scan, &[marks])?;
    let bag = ctx.b.binary(BinaryOp::Sub, t(started), int(1))?;

    // Each index's row, or nothing for padding.
    let mut rows = ctx.b.op(Op::IndexSelect { axis: 0 }, &[weight, indices])?;
    if let Some(w) = per_sample {
        let w = ctx.b.cast(w, dtype)?;
        let w = ctx.b.reshape(w, vec![count.clone(), Dim::Const(1)])?;
        rows = ctx.b.binary(BinaryOp::Mul, t(rows), t(w))?;
    }
    let used = if padding_idx >= 0 {
        Some(ctx.b.binary(BinaryOp::Ne, t(indices), int(padding_idx))?)
    } else {
        None
    };
    let column = |ctx: &mut Ctx, v: ValueId| ctx.b.reshape(v, vec![count.clone(), Dim::Const(1)]);
    let fill = if mode == MAX {
        Scalar::Float(f64::NEG_INFINITY)
    } else {
        Scalar::Int(0)
    };
    if let Some(used) = used {
        let keep = column(ctx, used)?;
        let nothing = ctx.b.full(fill, dtype, vec![])?;
        rows = ctx.b.where_(keep, t(rows), t(nothing))?;
    }
    let table = vec![bags.clone(), width.clone()];
    let spread = column(ctx, bag)?;
    let spread = ctx.b.op(
        Op::Expand {
            shape: vec![count.clone(), width],
        },
        &[spread],
    )?;
    let start = ctx.b.full(fill, dtype, table)?;
    let reduce = if mode == MAX {
        ScatterReduce::Max
    } else {
        ScatterReduce::Add
    };
    let pooled = scatter(ctx, start, spread, rows, reduce)?;
    if mode == SUM {
        return Ok(Out::Values(vec![Some(pooled), None, None, None]));
    }
    // How many rows each bag pooled.
    let each = match used {
        Some(u) => ctx.b.cast(u, dtype)?,
        None => ctx.b.full(Scalar::Int(1), dtype, vec![count])?,
    };
    let none = ctx.b.full(Scalar::Int(0), dtype, vec![bags.clone()])?;
    let sizes = scatter(ctx, none, bag, each, ScatterReduce::Add)?;
    let sizes = ctx.b.reshape(sizes, vec![bags, Dim::Const(1)])?;
    let out = if mode == MEAN {
        let at_least_one = ctx.b.binary(BinaryOp::Max, t(sizes), int(1))?;
        ctx.b.binary(BinaryOp::Div, t(pooled), t(at_least_one))?
    } else {
        let empty = ctx.b.binary(BinaryOp::Eq, t(sizes), int(0))?;
        ctx.b.where_(empty, int(0), t(pooled))?
    };
    Ok(Out::Values(vec![Some(out), None, None, None]))
}

fn scatter(
    ctx: &mut Ctx,
    into: ValueId,
    index: ValueId,
    updates: ValueId,
    reduce: ScatterReduce,
) -> Result<ValueId> {
    ctx.b
        .op(Op::Scatter { axis: 0, reduce }, &[into, index, updates])
}
