//! `aten.topk` by repeated selection (`frontend::topk`).

use super::{axis, tensor, Handler};
use crate::dim::Dim;
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::frontend::topk::{select_rounds, MAX_K};

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
    let (values, indices) = select_rounds(&mut ctx.b, x, a, k, largest)?;
    Ok(Out::Values(vec![Some(values), Some(indices)]))
}
