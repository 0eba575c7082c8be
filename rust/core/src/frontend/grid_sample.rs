//! Sampling at the positions a grid names (ONNX `GridSample`, torch's `grid_sampler_2d`): each
//! output position reads `x` at the point `grid` holds, in normalized coordinates (`-1` and
//! `1` the first and last pixel's centers with `align_corners`, their outer edges without),
//! blending the neighbouring pixels (linear) or taking the nearest one. The IR has no
//! sampling op: the positions are computed elementwise and every neighbour (2^r of them for
//! linear, one for nearest) is a `gather` from the flattened spatial dims, weighted and
//! summed. Any number of spatial dims; padding zeros, border or reflection. The formulas
//! are torch's (`grid_sampler_compute_source_index`), which ONNX specifies too.

use crate::dim::{numel, Dim};
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::builder::{Builder, Operand};
use crate::ir::{BinaryOp, Op, UnaryOp, ValueId};

fn bin(b: &mut Builder, op: BinaryOp, x: ValueId, y: ValueId) -> Result<ValueId> {
    let dtype = b.dtype(x);
    b.binary_in(op, Operand::Tensor(x), Operand::Tensor(y), dtype)
}

fn scalar(b: &mut Builder, v: f64, dtype: DType) -> Result<ValueId> {
    b.full(Scalar::Float(v), dtype, vec![])
}

/// What a position outside the image reads: zeros, the nearest border pixel, or the image
/// reflected at its borders.
#[derive(Clone, Copy, PartialEq)]
pub enum Padding {
    Zeros,
    Border,
    Reflection,
}

fn pick(b: &mut Builder, cond: ValueId, x: ValueId, y: ValueId) -> Result<ValueId> {
    b.where_(cond, Operand::Tensor(x), Operand::Tensor(y))
}

fn cmp(b: &mut Builder, op: BinaryOp, x: ValueId, y: ValueId) -> Result<ValueId> {
    b.binary(op, Operand::Tensor(x), Operand::Tensor(y))
}

/// `min(max(v, lo), hi)`.
fn clamp(b: &mut Builder, v: ValueId, lo: ValueId, hi: ValueId) -> Result<ValueId> {
    let v = bin(b, BinaryOp::Max, v, lo)?;
    bin(b, BinaryOp::Min, v, hi)
}

/// `pos` folded back into `[mid - span/2·…]` by reflecting at the borders, as torch's
/// `reflect_coordinates`: `|pos - low|` split into whole spans (each flips the direction)
/// and the rest; a span of 0 (one pixel, corners aligned) is position 0.
fn reflect(
    b: &mut Builder,
    pos: ValueId,
    low: f64,
    span: ValueId,
    dtype: DType,
) -> Result<ValueId> {
    let lo = scalar(b, low, dtype)?;
    let d = bin(b, BinaryOp::Sub, pos, lo)?;
    let d = b.unary(UnaryOp::Abs, d)?;
    let extra = bin(b, BinaryOp::Fmod, d, span)?;
    let flips = bin(b, BinaryOp::Div, d, span)?;
    let flips = b.unary(UnaryOp::Floor, flips)?;
    let two = scalar(b, 2.0, dtype)?;
    let parity = bin(b, BinaryOp::Fmod, flips, two)?;
    let zero = scalar(b, 0.0, dtype)?;
    let even = cmp(b, BinaryOp::Eq, parity, zero)?;
    let forward = bin(b, BinaryOp::Add, extra, lo)?;
    let back = bin(b, BinaryOp::Sub, span, extra)?;
    let back = bin(b, BinaryOp::Add, back, lo)?;
    let folded = pick(b, even, forward, back)?;
    let some = cmp(b, BinaryOp::Gt, span, zero)?;
    pick(b, some, folded, zero)
}

/// One neighbour along one axis: its (float) pixel index and weight.
struct Tap {
    index: ValueId,
    weight: Option<ValueId>,
}

/// `x` ([N, C, spatial..]) sampled at `grid` ([N, out spatial.., r]; its last component the
/// last spatial axis), both float; the caller checks the shapes match (naming its node).
pub fn grid_sample(
    b: &mut Builder,
    x: ValueId,
    grid: ValueId,
    linear: bool,
    padding: Padding,
    align: bool,
) -> Result<ValueId> {
    let dtype = b.dtype(x);
    let (xs, gs) = (b.shape(x), b.shape(grid));
    let r = xs.len().saturating_sub(2);
    if r == 0 || gs.len() != r + 2 {
        // The frontends check this with the node's name; a caller that did not gets an
        // error, not an index out of bounds.
        return Err(Error::Shape(format!(
            "grid sample: grid {} for input {}",
            crate::dim::format_shape(&gs),
            crate::dim::format_shape(&xs)
        )));
    }
    let grid = b.cast(grid, dtype)?;
    let (batch, channels) = (xs[0].clone(), xs[1].clone());
    let spatial = xs[2..].to_vec();
    let out_spatial = gs[1..=r].to_vec();
    let points = numel(&out_spatial);
    let flat_x = b.reshape(x, vec![batch.clone(), channels.clone(), numel(&spatial)])?;
    let grid = b.reshape(
        grid,
        vec![batch.clone(), points.clone(), Dim::Const(r as i64)],
    )?;
    let (zero, one_, half) = (
        scalar(b, 0.0, dtype)?,
        scalar(b, 1.0, dtype)?,
        scalar(b, 0.5, dtype)?,
    );
    // Per spatial axis: the neighbours' indices and weights, as [N, 1, P].
    let mut taps: Vec<Vec<Tap>> = Vec::with_capacity(r);
    let mut sizes = Vec::with_capacity(r);
    for (a, dim) in spatial.iter().enumerate() {
        // grid[..., 0] is the last axis (x), grid[..., 1] the one before (y), …
        let comp = (r - 1 - a) as i64;
        let g = b.slice(grid, 2, Dim::Const(comp), Dim::Const(comp + 1), 1)?;
        let g = b.reshape(g, vec![batch.clone(), Dim::Const(1), points.clone()])?;
        let size = b.dim_value(dim, dtype)?;
        let last = bin(b, BinaryOp::Sub, size, one_)?;
        let g1 = bin(b, BinaryOp::Add, g, one_)?;
        let mut pos = if align {
            let p = bin(b, BinaryOp::Mul, g1, half)?;
            bin(b, BinaryOp::Mul, p, last)?
        } else {
            let p = bin(b, BinaryOp::Mul, g1, size)?;
            let p = bin(b, BinaryOp::Sub, p, one_)?;
            bin(b, BinaryOp::Mul, p, half)?
        };
        match padding {
            Padding::Zeros => {}
            Padding::Border => pos = clamp(b, pos, zero, last)?,
            Padding::Reflection => {
                let (low, span) = match align {
                    true => (0.0, last),
                    false => (-0.5, size),
                };
                pos = reflect(b, pos, low, span, dtype)?;
                pos = clamp(b, pos, zero, last)?;
            }
        }
        taps.push(if linear {
            let lo = b.unary(UnaryOp::Floor, pos)?;
            let frac = bin(b, BinaryOp::Sub, pos, lo)?;
            let rest = bin(b, BinaryOp::Sub, one_, frac)?;
            let hi = bin(b, BinaryOp::Add, lo, one_)?;
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
            let index = b.unary(UnaryOp::Round, pos)?;
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
            let ok_lo = cmp(b, BinaryOp::Ge, tap.index, zero)?;
            let ok_hi = cmp(b, BinaryOp::Le, tap.index, sizes[a])?;
            let ok = bin(b, BinaryOp::And, ok_lo, ok_hi)?;
            inside = Some(match inside {
                Some(v) => bin(b, BinaryOp::And, v, ok)?,
                None => ok,
            });
            let safe = clamp(b, tap.index, zero, sizes[a])?;
            let safe = b.cast(safe, DType::I64)?;
            flat = Some(match flat {
                None => safe,
                Some(f) => {
                    let d = b.dim_value(&spatial[a], DType::I64)?;
                    let f = bin(b, BinaryOp::Mul, f, d)?;
                    bin(b, BinaryOp::Add, f, safe)?
                }
            });
            if let Some(w) = tap.weight {
                weight = Some(match weight {
                    Some(v) => bin(b, BinaryOp::Mul, v, w)?,
                    None => w,
                });
            }
        }
        let (Some(flat), Some(inside)) = (flat, inside) else {
            return Err(Error::Compile("grid sample: no spatial axis".into()));
        };
        let index = b.broadcast_to(flat, &gather_shape)?;
        let mut value = b.op(Op::Gather { axis: 2 }, &[flat_x, index])?;
        if let Some(w) = weight {
            value = bin(b, BinaryOp::Mul, value, w)?;
        }
        // Outside the image a neighbour adds nothing (only zeros padding reaches there, and
        // a linear neighbour one past the last pixel, whose weight is 0).
        let value = pick(b, inside, value, zero)?;
        total = Some(match total {
            Some(t) => bin(b, BinaryOp::Add, t, value)?,
            None => value,
        });
    }
    let mut out = vec![batch, channels];
    out.extend(out_spatial);
    let total = total.ok_or_else(|| Error::Compile("grid sample: no neighbour".into()))?;
    b.reshape(total, out)
}
