//! `GridSample`: its attributes checked here, the sampling built by `frontend::grid_sample`.

use super::{one, Handler};
use crate::dim::Dim;
use crate::error::Result;
use crate::frontend::grid_sample::{self as sample, Padding};
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "GridSample" => grid_sample,
        _ => return None,
    })
}

fn grid_sample(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let grid = ctx.input(n, 1)?;
    let dtype = ctx.b.dtype(x);
    if !dtype.is_float() || !ctx.b.dtype(grid).is_float() {
        return Err(n.err("X and grid must be float tensors"));
    }
    let (xs, gs) = (ctx.b.shape(x), ctx.b.shape(grid));
    let r = xs.len().saturating_sub(2);
    if r == 0 || gs.len() != r + 2 || gs[r + 1] != Dim::Const(r as i64) || gs[0] != xs[0] {
        return Err(n.err(format!(
            "grid {} does not hold {r}-d positions for X {}",
            crate::dim::format_shape(&gs),
            crate::dim::format_shape(&xs)
        )));
    }
    let linear = match n.string("mode", "linear")?.as_str() {
        "linear" | "bilinear" => true,
        "nearest" => false,
        other => return Err(n.unsupported(format!("mode '{other}'"))),
    };
    let padding = match n.string("padding_mode", "zeros")?.as_str() {
        "zeros" => Padding::Zeros,
        "border" => Padding::Border,
        "reflection" => Padding::Reflection,
        other => return Err(n.err(format!("unknown padding_mode '{other}'"))),
    };
    let align = n.flag("align_corners", false)?;
    one(sample::grid_sample(
        &mut ctx.b, x, grid, linear, padding, align,
    )?)
}
