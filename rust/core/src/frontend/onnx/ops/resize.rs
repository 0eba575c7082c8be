//! `Resize` (opsets 13–19, what Ember reads) as per-axis gathers blended with constant weights
//! (`frontend::resample`). Where each output samples the input follows the ONNX spec's
//! coordinate transformations, computed in f32 as ONNX Runtime does. Static shapes only;
//! `tf_crop_and_resize`, antialiasing and aspect-ratio policies are refused clearly.

use super::{one, Handler};
use crate::dim::{format_shape, Dim};
use crate::error::Result;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::frontend::resample::{blend, cubic_weights, index_const, Tap};
use crate::ir::Op;

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "Resize" => resize,
        _ => return None,
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Nearest,
    Linear,
    Cubic,
}

/// How a fractional source position becomes an index in `nearest` mode.
#[derive(Clone, Copy)]
enum Nearest {
    RoundPreferFloor,
    RoundPreferCeil,
    Floor,
    Ceil,
}

struct Axis {
    len: i64,
    out: i64,
    /// output / input, as given (`scales`) or derived (`sizes`).
    scale: f32,
}

fn source_position(ctm: &str, o: i64, a: &Axis) -> f32 {
    let (o, len, out, s) = (o as f32, a.len as f32, a.out as f32, a.scale);
    match ctm {
        "asymmetric" => o / s,
        "align_corners" => {
            if a.out == 1 {
                0.0
            } else {
                o * (len - 1.0) / (out - 1.0)
            }
        }
        "pytorch_half_pixel" => {
            if a.out > 1 {
                (o + 0.5) / s - 0.5
            } else {
                0.0
            }
        }
        "half_pixel_symmetric" => {
            let adjustment = out / (s * len);
            let offset = len * (1.0 - adjustment) / 2.0;
            offset + (o + 0.5) / s - 0.5
        }
        // half_pixel
        _ => (o + 0.5) / s - 0.5,
    }
}

fn nearest_index(rule: Nearest, x: f32) -> i64 {
    (match rule {
        Nearest::RoundPreferFloor => {
            if x == x.floor() + 0.5 {
                x.floor()
            } else {
                x.round()
            }
        }
        Nearest::RoundPreferCeil => x.round(),
        Nearest::Floor => x.floor(),
        Nearest::Ceil => x.ceil(),
    }) as i64
}

fn resize(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let shape = ctx.b.shape(x);
    let rank = shape.len();
    let dtype = ctx.b.dtype(x);
    let mode = match n.string("mode", "nearest")?.as_str() {
        "nearest" => Mode::Nearest,
        "linear" | "bilinear" | "trilinear" => Mode::Linear,
        "cubic" | "bicubic" => Mode::Cubic,
        other => return Err(n.err(format!("unknown mode '{other}'"))),
    };
    let ctm = n.string("coordinate_transformation_mode", "half_pixel")?;
    let known_ctm = [
        "half_pixel",
        "half_pixel_symmetric",
        "pytorch_half_pixel",
        "align_corners",
        "asymmetric",
    ];
    if ctm == "tf_crop_and_resize" {
        return Err(n.unsupported("coordinate_transformation_mode tf_crop_and_resize"));
    }
    if !known_ctm.contains(&ctm.as_str()) {
        return Err(n.err(format!("unknown coordinate_transformation_mode '{ctm}'")));
    }
    let nearest = match n.string("nearest_mode", "round_prefer_floor")?.as_str() {
        "round_prefer_floor" => Nearest::RoundPreferFloor,
        "round_prefer_ceil" => Nearest::RoundPreferCeil,
        "floor" => Nearest::Floor,
        "ceil" => Nearest::Ceil,
        other => return Err(n.err(format!("unknown nearest_mode '{other}'"))),
    };
    if n.int("antialias", 0)? != 0 {
        return Err(n.unsupported("antialias=1"));
    }
    if n.string("keep_aspect_ratio_policy", "stretch")? != "stretch" {
        return Err(n.unsupported("keep_aspect_ratio_policy other than stretch"));
    }
    let cubic_a = n.float("cubic_coeff_a", -0.75)?;
    let exclude_outside = n.flag("exclude_outside", false)?;
    if mode != Mode::Nearest && !dtype.is_float() {
        return Err(n.err(format!("{:?} resizing of {dtype}", n.string("mode", "")?)));
    }
    // A symbolic dim (a dynamic batch) must keep its size; it stands in as 1 below, an
    // axis the resize leaves alone.
    let lens: Vec<i64> = shape.iter().map(|d| d.as_const().unwrap_or(1)).collect();
    let symbolic: Vec<bool> = shape.iter().map(|d| !d.is_const()).collect();
    let resizes_symbolic = |axis: usize| {
        n.unsupported(format!(
            "it resizes dim {axis} of the symbolic input shape {}; Ember resizes dims of \
             static size only",
            format_shape(&shape)
        ))
    };
    let axes: Vec<usize> = match n.ints("axes")? {
        Some(a) => a
            .iter()
            .map(|&a| super::axis(ctx, a, rank))
            .collect::<Result<_>>()?,
        None => (0..rank).collect(),
    };

    // Inputs X, roi, scales, sizes: one of scales and sizes, constant.
    let present = |k: usize| n.input(k).is_some_and(|s| !s.is_empty());
    let given_sizes: Option<Vec<Dim>> = if present(3) {
        Some(ctx.known_required(n, 3, "sizes")?.dims)
    } else {
        None
    };
    let given_scales: Option<Vec<f64>> = if given_sizes.is_none() && present(2) {
        Some(ctx.const_floats(n, 2).ok_or_else(|| {
            n.unsupported("its scales are computed at run time; Ember needs them at compile time")
        })?)
    } else {
        None
    };
    let mut plan: Vec<Axis> = lens
        .iter()
        .map(|&len| Axis {
            len,
            out: len,
            scale: 1.0,
        })
        .collect();
    match (given_sizes, given_scales) {
        (Some(sz), _) => {
            if sz.len() != axes.len() {
                return Err(n.err(format!("sizes {sz:?} for {} axes", axes.len())));
            }
            for (&a, o) in axes.iter().zip(&sz) {
                if symbolic[a] {
                    if o.provably_equal(&shape[a]) != Some(true) {
                        return Err(resizes_symbolic(a));
                    }
                    continue;
                }
                let Some(o) = o.as_const() else {
                    return Err(n.unsupported(format!(
                        "its size {o} for dim {a} is symbolic; Ember needs it constant"
                    )));
                };
                plan[a].out = o;
                plan[a].scale = o as f32 / plan[a].len as f32;
            }
        }
        (None, Some(sc)) => {
            if sc.len() != axes.len() {
                return Err(n.err(format!("scales {sc:?} for {} axes", axes.len())));
            }
            for (&a, &s) in axes.iter().zip(&sc) {
                if s <= 0.0 {
                    return Err(n.err(format!("scale {s} must be positive")));
                }
                if symbolic[a] {
                    if s != 1.0 {
                        return Err(resizes_symbolic(a));
                    }
                    continue;
                }
                plan[a].scale = s as f32;
                plan[a].out = (plan[a].len as f32 * s as f32).floor() as i64;
            }
        }
        (None, None) => return Err(n.err("needs scales or sizes")),
    }
    if let Some(a) = plan.iter().find(|a| a.out < 1 || a.len < 1) {
        return Err(n.err(format!("cannot resize a dim of {} to {}", a.len, a.out)));
    }

    let mut v = x;
    // Innermost axis first, as ONNX Runtime's kernels go.
    for axis in (0..rank).rev() {
        let a = &plan[axis];
        if a.out == a.len && a.scale == 1.0 {
            continue;
        }
        let last = a.len - 1;
        let clamp = |i: i64| i.clamp(0, last);
        let pos: Vec<f32> = (0..a.out).map(|o| source_position(&ctm, o, a)).collect();
        v = match mode {
            Mode::Nearest => {
                let idx: Vec<i64> = pos
                    .iter()
                    .map(|&x| clamp(nearest_index(nearest, x)))
                    .collect();
                let c = index_const(&mut ctx.b, &idx)?;
                ctx.b.op(Op::IndexSelect { axis }, &[v, c])?
            }
            Mode::Linear => {
                let mut taps = [(); 2].map(|_| Tap {
                    index: Vec::new(),
                    weight: Vec::new(),
                });
                for &x in &pos {
                    let x = x.clamp(0.0, last as f32);
                    let lo = x.floor();
                    let r = x - lo;
                    let lo = lo as i64;
                    taps[0].index.push(clamp(lo));
                    taps[0].weight.push(1.0 - r);
                    taps[1].index.push(clamp(lo + 1));
                    taps[1].weight.push(r);
                }
                blend(&mut ctx.b, v, axis, &taps)?
            }
            Mode::Cubic => {
                let mut taps = [(); 4].map(|_| Tap {
                    index: Vec::new(),
                    weight: Vec::new(),
                });
                for &x in &pos {
                    let base = x.floor();
                    let mut w = cubic_weights(x - base, cubic_a);
                    let base = base as i64 - 1;
                    if exclude_outside {
                        for (j, wj) in w.iter_mut().enumerate() {
                            if !(0..=last).contains(&(base + j as i64)) {
                                *wj = 0.0;
                            }
                        }
                        let sum: f32 = w.iter().sum();
                        if sum != 0.0 {
                            w.iter_mut().for_each(|wj| *wj /= sum);
                        }
                    }
                    for (j, tap) in taps.iter_mut().enumerate() {
                        tap.index.push(clamp(base + j as i64));
                        tap.weight.push(w[j]);
                    }
                }
                blend(&mut ctx.b, v, axis, &taps)?
            }
        };
    }
    one(v)
}
