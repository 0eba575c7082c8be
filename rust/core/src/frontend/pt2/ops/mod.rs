//! ATen op translations, one file per family. `handler` maps a serialized target
//! (`torch.ops.aten.add.Tensor`) to the function that translates it; the same table decides
//! up front whether a whole graph is supported.

mod conv;
mod creation;
mod elementwise;
mod embedding_bag;
mod grid_sample;
mod group_norm;
mod index;
mod linalg;
mod math;
mod nn;
mod pool;
mod reduce;
mod resize;
mod shape;
mod sort;
mod symint;

use super::args::{Arg, NodeArgs, SymRef};
use super::translate::{Ctx, Out};
use crate::dtype::DType;
use crate::error::Result;
use crate::frontend::builder::Operand;
use crate::ir::ValueId;

pub type Handler = fn(&mut Ctx, &NodeArgs) -> Result<Out>;

/// The translation function for `target`, or `None` when Ember does not support it.
pub fn handler(target: &str) -> Option<Handler> {
    let Some(rest) = target.strip_prefix("torch.ops.aten.") else {
        return match target {
            "torch.ops.transformers.grouped_mm_fallback.default" => {
                Some(linalg::transformers_grouped_mm)
            }
            _ => symint::handler(target),
        };
    };
    let (name, overload) = rest.split_once('.').unwrap_or((rest, "default"));
    elementwise::handler(name, overload)
        .or_else(|| reduce::handler(name, overload))
        .or_else(|| shape::handler(name, overload))
        .or_else(|| linalg::handler(name, overload))
        .or_else(|| nn::handler(name, overload))
        .or_else(|| index::handler(name, overload))
        .or_else(|| creation::handler(name, overload))
        .or_else(|| conv::handler(name, overload))
        .or_else(|| group_norm::handler(name, overload))
        .or_else(|| pool::handler(name, overload))
        .or_else(|| resize::handler(name, overload))
        .or_else(|| sort::handler(name, overload))
        .or_else(|| grid_sample::handler(name, overload))
        .or_else(|| embedding_bag::handler(name, overload))
        .or_else(|| math::handler(name, overload))
}

/// The tensor argument `name` (schema name) at position `pos`.
fn tensor(ctx: &Ctx, n: &NodeArgs, name: &str, pos: usize) -> Result<ValueId> {
    ctx.value(n.tensor(name, pos)?)
}

/// An argument that may be a tensor or a Python scalar (`other` in `add.Tensor`/`add.Scalar`).
fn operand(ctx: &mut Ctx, n: &NodeArgs, name: &str, pos: usize) -> Result<Operand> {
    if let Ok(t) = n.tensor(name, pos) {
        return Ok(Operand::Tensor(ctx.value(t)?));
    }
    if let Some(Arg::SymInt(s @ SymRef::Name(_))) = n.raw(name, pos) {
        // A symbolic size used as a number (`positions + past_length`): a 0-d int64 tensor
        // holding its value, which promotes like the Python int it stands for except
        // against other 0-d integer tensors.
        let d = ctx.sym(s)?;
        return Ok(Operand::Tensor(ctx.b.dim_value(&d, DType::I64)?));
    }
    match n.scalar(name, pos)? {
        Some(s) => Ok(Operand::Scalar(s)),
        None => Err(crate::error::Error::Compile(format!(
            "node '{}' ({}): missing operand '{name}'",
            n.name, n.target
        ))),
    }
}

/// Normalized axis argument.
fn axis(ctx: &Ctx, v: ValueId, a: i64) -> Result<usize> {
    crate::frontend::builder::norm_axis(a, ctx.b.rank(v), &ctx.b.origin)
}
