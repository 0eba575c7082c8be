//! `GridSample`: each output position reads `X` at the point `grid` names, in normalized
//! coordinates (`-1` and `1` the first and last pixel's centers with `align_corners`, their
//! outer edges without), blending the neighbouring pixels (linear) or taking the nearest one.
//! The IR has no sampling op: the positions are computed elementwise and every neighbour
//! (2^r of them for linear, one for nearest) is a `gather` from the flattened spatial dims,
//! weighted and summed. Any number of spatial dims; padding zeros, border or reflection.

use super::{bin, one, scalar, Handler};
use crate::dim::{numel, Dim};
use crate::dtype::DType;
use crate::error::Result;
use crate::frontend::builder::Operand;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, Op, UnaryOp, ValueId};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "GridSample" => grid_sample,
        _ => return None,
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Padding {
    Zeros,
    Border,
    Reflection,
}

fn pick(ctx: &mut Ctx, cond: ValueId, a: ValueId, b: ValueId) -> Result<ValueId> {
    ctx.b.where_(cond, Operand::Tensor(a), Operand::Tensor(b))
}

fn cmp(ctx: &mut Ctx, op: BinaryOp, a: ValueId, b: ValueId) -> Result<ValueId> {
    ctx.b.binary(op, Operand::Tensor(a), Operand::Tensor(b))
}

/// `min(max(v, lo), hi)`.
fn clamp(ctx: &mut Ctx, v: ValueId, lo: ValueId, hi: ValueId) -> Result<ValueId> {
    let v = bin(ctx, BinaryOp::Max, v, lo)?;
    bin(ctx, BinaryOp::Min, v, hi)
}

/// `pos` folded back into `[mid - span/2·…]` by reflecting at the borders, as torch's
/// `reflect_coordinates`: `|pos - low|` split into whole spans (each flips the direction)
/// and the rest; a span of 0 (one pixel, corners aligned) is position 0.
fn reflect(ctx: &mut Ctx, pos: ValueId, low: f64, span: ValueId, dtype: DType) -> Result<ValueId> {
    let lo = scalar(ctx, low, dtype)?;
    let d = bin(ctx, BinaryOp::Sub, pos, lo)?;
    let d = ctx.b.unary(UnaryOp::Abs, d)?;
    let extra = bin(ctx, BinaryOp::Fmod, d, span)?;
    let flips = bin(ctx, BinaryOp::Div, d, span)?;
    let flips = ctx.b.unary(UnaryOp::Floor, flips)?;
    let two = scalar(ctx, 2.0, dtype)?;
    let parity = bin(ctx, BinaryOp::Fmod, flips, two)?;
    let zero = scalar(ctx, 0.0, dtype)?;
    let even = cmp(ctx, BinaryOp::Eq, parity, zero)?;
    let forward = bin(ctx, BinaryOp::Add, extra, lo)?;
    let back = bin(ctx, BinaryOp::Sub, span, extra)?;
    let back = bin(ctx, BinaryOp::Add, back, lo)?;
    let folded = pick(ctx, even, forward, back)?;
    let some = cmp(ctx, BinaryOp::Gt, span, zero)?;
    pick(ctx, some, folded, zero)
}

/// One neighbour along one axis: its (float) pixel index and weight.
struct Tap {
    index: ValueId,
    weight: Option<ValueId>,
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
    let grid = ctx.b.cast(grid, dtype)?;
    let (batch, channels) = (xs[0].clone(), xs[1].clone());
    let spatial = xs[2..].to_vec();
    let out_spatial = gs[1..=r].to_vec();
    let points = numel(&out_spatial);
    let flat_x = ctx
        .b
        .reshape(x, vec![batch.clone(), channels.clone(), numel(&spatial)])?;
    let grid = ctx.b.reshape(
        grid,
        vec![batch.clone(), points.clone(), Dim::Const(r as i64)],
    )?;
    let (zero, one_, half) = (
        scalar(ctx, 0.0, dtype)?,
        scalar(ctx, 1.0, dtype)?,
        scalar(ctx, 0.5, dtype)?,
    );
    // Per spatial axis: the neighbours' indices and weights, as [N, 1, P].
    let mut taps: Vec<Vec<Tap>> = Vec::with_capacity(r);
    let mut sizes = Vec::with_capacity(r);
    for (a, dim) in spatial.iter().enumerate() {
        // grid[..., 0] is the last axis (x), grid[..., 1] the one before (y), …
        let comp = (r - 1 - a) as i64;
        let g = ctx
            .b
            .slice(grid, 2, Dim::Const(comp), Dim::Const(comp + 1), 1)?;
        let g = ctx
            .b
            .reshape(g, vec![batch.clone(), Dim::Const(1), points.clone()])?;
        let size = ctx.b.dim_value(dim, dtype)?;
        let last = bin(ctx, BinaryOp::Sub, size, one_)?;
        let g1 = bin(ctx, BinaryOp::Add, g, one_)?;
        let mut pos = if align {
            let p = bin(ctx, BinaryOp::Mul, g1, half)?;
            bin(ctx, BinaryOp::Mul, p, last)?
        } else {
            let p = bin(ctx, BinaryOp::Mul, g1, size)?;
            let p = bin(ctx, BinaryOp::Sub, p, one_)?;
            bin(ctx, BinaryOp::Mul, p, half)?
        };
        match padding {
            Padding::Zeros => {}
            Padding::Border => pos = clamp(ctx, pos, zero, last)?,
            Padding::Reflection => {
                let (low, span) = match align {
                    true => (0.0, last),
                    false => (-0.5, size),
                };
                pos = reflect(ctx, pos, low, span, dtype)?;
                pos = clamp(ctx, pos, zero, last)?;
            }
        }
        taps.push(if linear {
            let lo = ctx.b.unary(UnaryOp::Floor, pos)?;
            let frac = bin(ctx, BinaryOp::Sub, pos, lo)?;
            let rest = bin(ctx, BinaryOp::Sub, one_, frac)?;
            let hi = bin(ctx, BinaryOp::Add, lo, one_)?;
            vec![
                Tap {
                    index: lo,
                    weight: Some(rest),
                },
                Tap {
                    index: hi,
                    weight: Some(frac),
                },
            ]
        } else {
            // Ties to even, as ONNX Runtime's and torch's nearbyint.
            let index = ctx.b.unary(UnaryOp::Round, pos)?;
            vec![Tap {
                index,
                weight: None,
            }]
        });
        sizes.push(last);
    }
    // Every combination of one neighbour per axis.
    let corners: usize = taps.iter().map(Vec::len).product();
    let gather_shape = vec![batch.clone(), channels.clone(), points.clone()];
    let mut total: Option<ValueId> = None;
    for corner in 0..corners {
        let (mut flat, mut weight, mut inside): (
            Option<ValueId>,
            Option<ValueId>,
            Option<ValueId>,
        ) = (None, None, None);
        let mut rest = corner;
        for a in 0..r {
            let choices = taps[a].len();
            let tap = &taps[a][rest % choices];
            rest /= choices;
            let ok_lo = cmp(ctx, BinaryOp::Ge, tap.index, zero)?;
            let ok_hi = cmp(ctx, BinaryOp::Le, tap.index, sizes[a])?;
            let ok = bin(ctx, BinaryOp::And, ok_lo, ok_hi)?;
            inside = Some(match inside {
                Some(v) => bin(ctx, BinaryOp::And, v, ok)?,
                None => ok,
            });
            let safe = clamp(ctx, tap.index, zero, sizes[a])?;
            let safe = ctx.b.cast(safe, DType::I64)?;
            flat = Some(match flat {
                None => safe,
                Some(f) => {
                    let d = ctx.b.dim_value(&spatial[a], DType::I64)?;
                    let f = bin(ctx, BinaryOp::Mul, f, d)?;
                    bin(ctx, BinaryOp::Add, f, safe)?
                }
            });
            if let Some(w) = tap.weight {
                weight = Some(match weight {
                    Some(v) => bin(ctx, BinaryOp::Mul, v, w)?,
                    None => w,
                });
            }
        }
        let (Some(flat), Some(inside)) = (flat, inside) else {
            return Err(n.err("no spatial axis to sample"));
        };
        let index = ctx.b.broadcast_to(flat, &gather_shape)?;
        let mut value = ctx.b.op(Op::Gather { axis: 2 }, &[flat_x, index])?;
        if let Some(w) = weight {
            value = bin(ctx, BinaryOp::Mul, value, w)?;
        }
        // Outside the image a neighbour adds nothing (only zeros padding reaches there, and
        // a linear neighbour one past the last pixel, whose weight is 0).
        let value = pick(ctx, inside, value, zero)?;
        total = Some(match total {
            Some(t) => bin(ctx, BinaryOp::Add, t, value)?,
            None => value,
        });
    }
    let mut out = vec![batch, channels];
    out.extend(out_spatial);
    let total = total.ok_or_else(|| n.err("no neighbour to sample"))?;
    one(ctx.b.reshape(total, out)?)
}
