//! Convolution rewrites shared by the frontends.

use crate::dim::Dim;
use crate::dtype::Scalar;
use crate::error::{Error, Result};
use crate::frontend::builder::Builder;
use crate::ir::{Op, ValueId};

/// A transposed convolution's attributes (torch and ONNX agree on them; ONNX pads may be
/// asymmetric).
pub struct TransposeParams {
    pub stride: Vec<i64>,
    /// (before, after) per spatial dim, as on the forward conv whose gradient this is.
    pub padding: Vec<(i64, i64)>,
    pub dilation: Vec<i64>,
    pub output_padding: Vec<i64>,
    pub groups: i64,
}

/// A transposed convolution is the convolution of the input with zeros inserted between
/// elements (stride − 1 per gap), padded by `dilation·(K−1) − padding` (plus output_padding
/// after), with the weight's in/out channels swapped per group and its taps flipped.
/// The inserted zeros add exact zeros, so this is torch's result up to summation order.
pub fn conv_transpose(
    b: &mut Builder,
    x: ValueId,
    w: ValueId,
    bias: Option<ValueId>,
    p: &TransposeParams,
) -> Result<ValueId> {
    let k = p.stride.len();
    let ws = b.shape(w);
    let g = p.groups;
    let (cin, og) = match (ws[0].as_const(), ws[1].as_const()) {
        (Some(c), Some(o)) if g > 0 && c % g == 0 => (c, o),
        _ => {
            return Err(Error::Shape(format!(
                "node '{}': transposed convolution weight {} with groups={g}",
                b.origin,
                crate::dim::format_shape(&ws)
            )))
        }
    };
    let mut x = x;
    let mut padding = Vec::with_capacity(k);
    for i in 0..k {
        let axis = 2 + i;
        let s = p.stride[i];
        if s > 1 {
            // [.., L, ..] → [.., L, 1, ..] → pad to [.., L, s, ..] → [.., L·s, ..] → first
            // (L−1)·s + 1.
            let shape = b.shape(x);
            let len = shape[axis].clone();
            let mut split = shape.clone();
            split.insert(axis + 1, Dim::Const(1));
            let v = b.reshape(x, split.clone())?;
            let mut pads = vec![(0, 0); split.len()];
            pads[axis + 1] = (0, s - 1);
            let v = b.op(
                Op::Pad {
                    pads,
                    value: Scalar::Float(0.0),
                },
                &[v],
            )?;
            let mut merged = shape;
            merged[axis] = &len * &Dim::Const(s);
            let v = b.reshape(v, merged)?;
            let keep = &(&len * &Dim::Const(s)) - &Dim::Const(s - 1);
            x = b.slice(v, axis, Dim::Const(0), keep, 1)?;
        }
        let kern = ws[axis]
            .as_const()
            .ok_or_else(|| Error::Shape(format!("node '{}': symbolic kernel size", b.origin)))?;
        let edge = p.dilation[i] * (kern - 1);
        let (before, after) = (
            edge - p.padding[i].0,
            edge - p.padding[i].1 + p.output_padding[i],
        );
        // Padding larger than the kernel's reach crops the zero-stuffed input instead.
        if before < 0 || after < 0 {
            let len = b.shape(x)[axis].clone();
            let start = Dim::Const((-before).max(0));
            let end = &len - &Dim::Const((-after).max(0));
            x = b.slice(x, axis, start, end, 1)?;
        }
        padding.push((before.max(0), after.max(0)));
    }
    // [Cin, O/g, *K] → [g, Cin/g, O/g, *K] → [g, O/g, Cin/g, *K] → [O, Cin/g, *K], flipped.
    let mut grouped = vec![Dim::Const(g), Dim::Const(cin / g), Dim::Const(og)];
    grouped.extend(ws[2..].iter().cloned());
    let wv = b.reshape(w, grouped)?;
    let mut perm = vec![0, 2, 1];
    perm.extend(3..3 + k);
    let wv = b.permute(wv, perm)?;
    let mut flat = vec![Dim::Const(g * og), Dim::Const(cin / g)];
    flat.extend(ws[2..].iter().cloned());
    let wv = b.reshape(wv, flat)?;
    let wv = b.op(
        Op::Flip {
            axes: (2..2 + k).collect(),
        },
        &[wv],
    )?;
    let op = Op::Conv {
        stride: vec![1; k],
        padding,
        dilation: p.dilation.clone(),
        groups: g,
        has_bias: bias.is_some(),
    };
    let mut inputs = vec![x, wv];
    inputs.extend(bias);
    b.op(op, &inputs)
}
