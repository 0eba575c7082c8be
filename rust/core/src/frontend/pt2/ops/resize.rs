//! `upsample_nearest{1,2,3}d`, `_upsample_nearest_exact{1,2,3}d`, `upsample_linear1d`,
//! `upsample_bilinear2d`, `upsample_trilinear3d` and `upsample_bicubic2d` (both
//! `align_corners` modes), decomposed per spatial axis into gathers with constant indices:
//! nearest is one `index_select`, linear two gathers blended with constant weights, cubic
//! four. Source positions are computed in f32 as torch's CPU kernels do, so the same pixels
//! are picked.

use super::{tensor, Handler};
use crate::dim::{format_shape, Dim};
use crate::error::{Error, Result};
use crate::frontend::pt2::args::{Arg, NodeArgs};
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::frontend::resample::{blend, cubic_weights, index_const, Tap};
use crate::ir::{Op, ValueId};

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    if overload != "vec" {
        return None;
    }
    Some(match name {
        "upsample_nearest1d" | "upsample_nearest2d" | "upsample_nearest3d" => {
            |c, n| nearest(c, n, false)
        }
        "_upsample_nearest_exact1d" | "_upsample_nearest_exact2d" | "_upsample_nearest_exact3d" => {
            |c, n| nearest(c, n, true)
        }
        "upsample_linear1d" => |c, n| separable(c, n, Filter::Linear, 1),
        "upsample_bilinear2d" => |c, n| separable(c, n, Filter::Linear, 2),
        "upsample_trilinear3d" => |c, n| separable(c, n, Filter::Linear, 3),
        "upsample_bicubic2d" => |c, n| separable(c, n, Filter::Cubic, 2),
        _ => return None,
    })
}

/// Output sizes and per-axis scale factors (if given) over the trailing `k` dims.
struct Sizes {
    lens: Vec<i64>,
    outs: Vec<i64>,
    scales: Vec<Option<f64>>,
}

fn sizes(ctx: &Ctx, n: &NodeArgs, x: ValueId, k: usize, scale_pos: usize) -> Result<Sizes> {
    let shape = ctx.b.shape(x);
    let bad = |why: &str| {
        Error::Shape(format!(
            "node '{}' ({}): {why} for input {}",
            n.name,
            n.target,
            format_shape(&shape)
        ))
    };
    if shape.len() != k + 2 {
        return Err(bad(&format!("needs {} dims", k + 2)));
    }
    let lens: Vec<i64> = shape[2..]
        .iter()
        .map(Dim::as_const)
        .collect::<Option<_>>()
        .ok_or_else(|| {
            Error::unsupported_because(
                n.target.trim_start_matches("torch.ops."),
                &n.name,
                "symbolic spatial dims",
            )
        })?;
    let factors: Option<Vec<f64>> = match n.get("scale_factors", scale_pos) {
        Some(Arg::Floats(f)) => Some(f.clone()),
        _ => None,
    };
    let out_size = n.opt_ints("output_size", 1)?;
    let (outs, scales) = match (out_size, factors) {
        (Some(o), _) if o.len() == k => (o, vec![None; k]),
        (_, Some(f)) if f.len() == k => (
            lens.iter()
                .zip(&f)
                .map(|(&l, &s)| (l as f64 * s).floor() as i64)
                .collect(),
            f.into_iter().map(Some).collect(),
        ),
        _ => {
            return Err(bad(
                "needs output_size or scale_factors for every spatial dim",
            ))
        }
    };
    if outs.iter().any(|&o| o < 1) {
        return Err(bad(&format!("output size {outs:?}")));
    }
    // An empty input has no pixel to read (its taps would index -1), as torch says too.
    if lens.iter().any(|&l| l < 1) {
        return Err(bad("empty spatial dims"));
    }
    Ok(Sizes { lens, outs, scales })
}

/// torch's `compute_scales_value` (in f32): 1/scale when given, else in/out.
fn scale_value(scale: Option<f64>, len: i64, out: i64) -> f32 {
    match scale {
        Some(s) if s > 0.0 => (1.0 / s) as f32,
        _ => len as f32 / out as f32,
    }
}

/// `exact` (nearest-exact) samples pixel centers: `⌊(o + ½)·scale⌋` instead of `⌊o·scale⌋`.
fn nearest(ctx: &mut Ctx, n: &NodeArgs, exact: bool) -> Result<Out> {
    let x = tensor(ctx, n, "input", 0)?;
    let k = ctx.b.rank(x).saturating_sub(2);
    let s = sizes(ctx, n, x, k.clamp(1, 3), 2)?;
    let mut v = x;
    for i in 0..s.lens.len() {
        let (len, out) = (s.lens[i], s.outs[i]);
        if len == out {
            continue;
        }
        let scale = scale_value(s.scales[i], len, out);
        let shift = if exact { 0.5 } else { 0.0 };
        let idx: Vec<i64> = (0..out)
            .map(|o| (((o as f32 + shift) * scale).floor() as i64).min(len - 1))
            .collect();
        let c = index_const(&mut ctx.b, &idx)?;
        v = ctx.b.op(Op::IndexSelect { axis: 2 + i }, &[v, c])?;
    }
    Ok(Out::Value(v))
}

/// The interpolating filters: (bi/tri)linear and bicubic.
#[derive(Clone, Copy, PartialEq)]
enum Filter {
    Linear,
    Cubic,
}

/// torch's cubic coefficient (`get_cubic_upsample_coefficients`).
const TORCH_CUBIC_A: f32 = -0.75;

/// `filter` over the trailing `axes` spatial dims, one axis at a time.
fn separable(ctx: &mut Ctx, n: &NodeArgs, filter: Filter, axes: usize) -> Result<Out> {
    let x = tensor(ctx, n, "input", 0)?;
    let align = n.bool("align_corners", 2, false)?;
    let s = sizes(ctx, n, x, axes, 3)?;
    let dtype = ctx.b.dtype(x);
    if !dtype.is_float() {
        let what = match filter {
            Filter::Linear => "linear",
            Filter::Cubic => "bicubic",
        };
        return Err(Error::Compile(format!(
            "node '{}': {what} upsampling of {dtype}",
            n.name
        )));
    }
    // The last axis first (width, then height, then depth): the same products and sums as
    // torch's kernel, whose innermost interpolation runs along the last axis.
    let mut v = x;
    for i in (0..axes).rev() {
        let (len, out) = (s.lens[i], s.outs[i]);
        let axis = 2 + i;
        let scale = if align {
            if out > 1 {
                (len - 1) as f32 / (out - 1) as f32
            } else {
                0.0
            }
        } else {
            scale_value(s.scales[i], len, out)
        };
        let width = match filter {
            Filter::Linear => 2,
            Filter::Cubic => 4,
        };
        let mut taps: Vec<Tap> = (0..width)
            .map(|_| Tap {
                index: Vec::with_capacity(out as usize),
                weight: Vec::with_capacity(out as usize),
            })
            .collect();
        for o in 0..out {
            // torch's `area_pixel_compute_source_index`: half-pixel centers, clamped at 0
            // for linear only (cubic reads the clamped taps around a negative position).
            let src = match (align, filter) {
                (true, _) => scale * o as f32,
                (false, Filter::Linear) => (scale * (o as f32 + 0.5) - 0.5).max(0.0),
                (false, Filter::Cubic) => scale * (o as f32 + 0.5) - 0.5,
            };
            // `guard_index_and_lambda`.
            let base = (src.floor() as i64).min(len - 1);
            let lambda = (src - base as f32).clamp(0.0, 1.0);
            match filter {
                Filter::Linear => {
                    taps[0].index.push(base);
                    taps[1].index.push((base + 1).min(len - 1));
                    taps[0].weight.push(1.0 - lambda);
                    taps[1].weight.push(lambda);
                }
                Filter::Cubic => {
                    let w = cubic_weights(lambda, TORCH_CUBIC_A);
                    for (j, tap) in taps.iter_mut().enumerate() {
                        tap.index.push((base - 1 + j as i64).clamp(0, len - 1));
                        tap.weight.push(w[j]);
                    }
                }
            }
        }
        v = blend(&mut ctx.b, v, axis, &taps)?;
    }
    Ok(Out::Value(v))
}
