//! `grid_sampler_2d` (what `F.grid_sample` on 4-d inputs calls): its arguments checked here,
//! the sampling built by `frontend::grid_sample` (the same as ONNX `GridSample`).

use super::{tensor, Handler};
use crate::dim::{format_shape, Dim};
use crate::error::{Error, Result};
use crate::frontend::grid_sample::{grid_sample, Padding};
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    match (name, overload) {
        ("grid_sampler_2d", "default") => Some(grid_sampler_2d),
        _ => None,
    }
}

fn grid_sampler_2d(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "input", 0)?;
    let grid = tensor(ctx, n, "grid", 1)?;
    let op = n.target.trim_start_matches("torch.ops.");
    let (xs, gs) = (ctx.b.shape(x), ctx.b.shape(grid));
    if !ctx.b.dtype(x).is_float() || !ctx.b.dtype(grid).is_float() {
        return Err(Error::Compile(format!(
            "node '{}' ({op}): input and grid must be float tensors, not {} and {}",
            n.name,
            ctx.b.dtype(x),
            ctx.b.dtype(grid)
        )));
    }
    if xs.len() != 4 || gs.len() != 4 || gs[3] != Dim::Const(2) || gs[0] != xs[0] {
        return Err(Error::Shape(format!(
            "node '{}' ({op}): grid {} does not hold 2-d positions for input {}",
            n.name,
            format_shape(&gs),
            format_shape(&xs)
        )));
    }
    // torch's GridSamplerInterpolation and GridSamplerPadding enums.
    let linear = match n.int("interpolation_mode", 2)? {
        0 => true,
        1 => false,
        2 => {
            return Err(Error::unsupported_because(
                op,
                &n.name,
                "bicubic interpolation (mode='bicubic')",
            ))
        }
        m => {
            return Err(Error::Compile(format!(
                "node '{}' ({op}): unknown interpolation mode {m}",
                n.name
            )))
        }
    };
    let padding = match n.int("padding_mode", 3)? {
        0 => Padding::Zeros,
        1 => Padding::Border,
        2 => Padding::Reflection,
        m => {
            return Err(Error::Compile(format!(
                "node '{}' ({op}): unknown padding mode {m}",
                n.name
            )))
        }
    };
    let align = n.bool("align_corners", 4, false)?;
    let out = grid_sample(&mut ctx.b, x, grid, linear, padding, align)?;
    Ok(Out::Value(out))
}
