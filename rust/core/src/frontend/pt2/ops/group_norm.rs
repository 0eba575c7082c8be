//! Norms with statistics computed from the input over groups of channels: group norm, and
//! batch norm with batch statistics (what `instance_norm` exports to). Both reshape so
//! that each group's elements form the trailing dims and reuse the `LayerNorm` op
//! (biased variance, as torch's).

use super::{tensor, Handler};
use crate::dim::{format_shape, numel, Dim};
use crate::error::{Error, Result};
use crate::frontend::builder::Operand;
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, Op, ValueId};

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    Some(match (name, overload) {
        ("native_group_norm", "default") => group_norm,
        ("_native_batch_norm_legit", "no_stats") => batch_norm_batch_stats,
        _ => return None,
    })
}

fn normalize(ctx: &mut Ctx, x: ValueId, eps: f64) -> Result<ValueId> {
    ctx.b.op(
        Op::LayerNorm {
            axis: ctx.b.rank(x) - 1,
            eps,
            has_weight: false,
            has_bias: false,
        },
        &[x],
    )
}

/// `y·weight + bias` with 1-d per-channel parameters on dim 1.
fn affine(ctx: &mut Ctx, n: &NodeArgs, y: ValueId, wpos: usize) -> Result<ValueId> {
    let rank = ctx.b.rank(y);
    let mut chan = vec![Dim::Const(1); rank];
    chan[1] = ctx.b.shape(y)[1].clone();
    let dtype = ctx.b.dtype(y);
    let mut y = y;
    for (name, pos, op) in [
        ("weight", wpos, BinaryOp::Mul),
        ("bias", wpos + 1, BinaryOp::Add),
    ] {
        if let Some(t) = n.opt_tensor(name, pos)? {
            let p = ctx.value(t)?;
            let p = ctx.b.cast(p, dtype)?;
            let p = ctx.b.reshape(p, chan.clone())?;
            y = ctx
                .b
                .binary_in(op, Operand::Tensor(y), Operand::Tensor(p), dtype)?;
        }
    }
    Ok(y)
}

fn float_input(ctx: &Ctx, n: &NodeArgs, x: ValueId) -> Result<Vec<Dim>> {
    let shape = ctx.b.shape(x);
    if shape.len() < 2 || !ctx.b.dtype(x).is_float() {
        return Err(Error::Shape(format!(
            "node '{}' ({}): needs a float input [N, C, ...], got {} {}",
            n.name,
            n.target,
            ctx.b.dtype(x),
            format_shape(&shape)
        )));
    }
    Ok(shape)
}

fn group_norm(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "input", 0)?;
    let shape = float_input(ctx, n, x)?;
    let groups = n.int("group", 6)?;
    let eps = n.float("eps", 7)?.unwrap_or(1e-5);
    let c = shape[1].as_const();
    let Some(c) = c.filter(|&c| groups > 0 && c % groups == 0) else {
        return Err(Error::Shape(format!(
            "node '{}': group norm with {groups} groups of {} channels",
            n.name, shape[1]
        )));
    };
    let per_group = &Dim::Const(c / groups) * &numel(&shape[2..]);
    let v = ctx
        .b
        .reshape(x, vec![shape[0].clone(), Dim::Const(groups), per_group])?;
    let v = normalize(ctx, v, eps)?;
    let v = ctx.b.reshape(v, shape)?;
    let y = affine(ctx, n, v, 1)?;
    Ok(Out::Values(vec![Some(y), None, None]))
}

/// `_native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)`:
/// each channel normalized over the batch and spatial dims.
fn batch_norm_batch_stats(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "input", 0)?;
    let shape = float_input(ctx, n, x)?;
    let eps = n.float("eps", 5)?.unwrap_or(1e-5);
    let rank = shape.len();
    let rest = numel(&shape[2..]);
    // Channels first: [C, N·rest]. With N = 1 (instance norm's view) that is a reshape.
    let (v, moved) = if shape[0].as_const() == Some(1) {
        (ctx.b.reshape(x, vec![shape[1].clone(), rest])?, false)
    } else {
        let mut perm = vec![1, 0];
        perm.extend(2..rank);
        let p = ctx.b.permute(x, perm)?;
        let flat = vec![shape[1].clone(), &shape[0] * &rest];
        (ctx.b.reshape(p, flat)?, true)
    };
    let v = normalize(ctx, v, eps)?;
    let y = if moved {
        let mut cfirst = vec![shape[1].clone(), shape[0].clone()];
        cfirst.extend(shape[2..].iter().cloned());
        let v = ctx.b.reshape(v, cfirst)?;
        let mut perm = vec![1, 0];
        perm.extend(2..rank);
        ctx.b.permute(v, perm)?
    } else {
        ctx.b.reshape(v, shape)?
    };
    let y = affine(ctx, n, y, 1)?;
    Ok(Out::Values(vec![Some(y), None, None]))
}
