//! Arithmetic on symbolic sizes (`_operator.add(s0, 1)`, `torch.sym_max`), which the export
//! writes when a size computed from input shapes feeds a view, a slice or a creation op.

use super::Handler;
use crate::dim::{Dim, DimOp};
use crate::error::{Error, Result};
use crate::frontend::pt2::args::{Arg, NodeArgs};
use crate::frontend::pt2::translate::{Ctx, Out};

pub fn handler(target: &str) -> Option<Handler> {
    let op = target
        .strip_prefix("_operator.")
        .or_else(|| target.strip_prefix("torch."))?;
    Some(match op {
        "add" => |c, n| binary(c, n, DimOp::Add),
        "sub" => |c, n| binary(c, n, DimOp::Sub),
        "mul" => |c, n| binary(c, n, DimOp::Mul),
        "floordiv" => |c, n| binary(c, n, DimOp::FloorDiv),
        "mod" => |c, n| binary(c, n, DimOp::Mod),
        "sym_max" => |c, n| binary(c, n, DimOp::Max),
        "sym_min" => |c, n| binary(c, n, DimOp::Min),
        _ => return None,
    })
}

fn operand(ctx: &Ctx, n: &NodeArgs, name: &str, pos: usize) -> Result<Dim> {
    match n.raw(name, pos) {
        Some(Arg::Int(v)) => Ok(Dim::Const(*v)),
        Some(Arg::SymInt(s)) => ctx.sym(s),
        other => Err(Error::unsupported_because(
            n.target.clone(),
            &n.name,
            format!("symbolic-size arithmetic on {other:?}"),
        )),
    }
}

fn binary(ctx: &mut Ctx, n: &NodeArgs, op: DimOp) -> Result<Out> {
    let a = operand(ctx, n, "a", 0)?;
    let b = operand(ctx, n, "b", 1)?;
    Ok(Out::Sym(Dim::binary(op, a, b)))
}
