//! `upsample_nearest{1,2,3}d`, `_upsample_nearest_exact{1,2,3}d` and `upsample_bilinear2d` (both `align_corners` modes),
//! decomposed per spatial axis into gathers with constant indices: nearest is one
//! `index_select`, linear is two gathers blended with constant weights. Source positions
//! are computed in f32 as torch's CPU kernels do, so the same pixels are picked.

use super::{tensor, Handler};
use crate::dim::{format_shape, Dim};
use crate::error::{Error, Result};
use crate::frontend::pt2::args::{Arg, NodeArgs};
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::frontend::resample::{blend, index_const, Tap};
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
        "upsample_bilinear2d" => bilinear,
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

fn bilinear(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "input", 0)?;
    let align = n.bool("align_corners", 2, false)?;
    let s = sizes(ctx, n, x, 2, 3)?;
    let dtype = ctx.b.dtype(x);
    if !dtype.is_float() {
        return Err(Error::Compile(format!(
            "node '{}': bilinear upsampling of {dtype}",
            n.name
        )));
    }
    // Width first, then height: the same products and sums as torch's kernel.
    let mut v = x;
    for i in [1, 0] {
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
        let (mut i0, mut i1, mut w0, mut w1) = (vec![], vec![], vec![], vec![]);
        for o in 0..out {
            let src = if align {
                scale * o as f32
            } else {
                (scale * (o as f32 + 0.5) - 0.5).max(0.0)
            };
            let lo = (src.floor() as i64).min(len - 1);
            let hi = (lo + 1).min(len - 1);
            let lambda = (src - lo as f32).clamp(0.0, 1.0);
            i0.push(lo);
            i1.push(hi);
            w0.push(1.0 - lambda);
            w1.push(lambda);
        }
        let taps = [
            Tap {
                index: i0,
                weight: w0,
            },
            Tap {
                index: i1,
                weight: w1,
            },
        ];
        v = blend(&mut ctx.b, v, axis, &taps)?;
    }
    Ok(Out::Value(v))
}
