//! Conv, ConvTranspose, MaxPool and AveragePool onto the IR's sliding-window ops. ONNX pads
//! may be asymmetric: `Conv` takes (before, after) directly; `Pool` is symmetric, so other
//! pool pads become an explicit `Pad` in front of an unpadded pool.

use super::{one, Handler};
use crate::dim::{format_shape, Dim};
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::builder::Operand;
use crate::frontend::conv::{conv_transpose, TransposeParams};
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, Op, PoolKind, ValueId};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "Conv" => conv,
        "ConvTranspose" => conv_transposed,
        "MaxPool" | "AveragePool" => pool,
        _ => return None,
    })
}

fn shape_err(n: &Node, msg: impl AsRef<str>) -> Error {
    Error::Shape(format!("ONNX {} node '{}': {}", n.op, n.name, msg.as_ref()))
}

/// A per-spatial-dim attribute, `default` for every dim when absent.
fn per_dim(n: &Node, name: &str, k: usize, default: i64, min: i64) -> Result<Vec<i64>> {
    let v = n.ints(name)?.unwrap_or_else(|| vec![default; k]);
    if v.len() != k {
        return Err(shape_err(
            n,
            format!("{name} {v:?} has {} values for {k} spatial dims", v.len()),
        ));
    }
    if v.iter().any(|&e| e < min) {
        return Err(shape_err(n, format!("{name} {v:?} must be ≥ {min}")));
    }
    Ok(v)
}

/// The input `[N, C, *spatial]` with its spatial rank (1 to 3, what the IR sweeps): a
/// float tensor, or 8-bit integers where `int8` allows them.
fn spatial_input(ctx: &mut Ctx, n: &Node, int8: bool) -> Result<(ValueId, usize)> {
    let x = ctx.input(n, 0)?;
    let r = ctx.b.rank(x);
    if !(3..=5).contains(&r) {
        return Err(shape_err(
            n,
            format!(
                "X {} must be [N, C, *spatial] with 1 to 3 spatial dims",
                format_shape(&ctx.b.shape(x))
            ),
        ));
    }
    let dtype = ctx.b.dtype(x);
    let allowed_int = int8 && matches!(dtype, DType::U8 | DType::I8);
    if !(dtype.is_float() || allowed_int) {
        let allowed = if int8 {
            "a float or 8-bit integer"
        } else {
            "a float"
        };
        return Err(n.err(format!("X must be {allowed} tensor, got {dtype}")));
    }
    Ok((x, r - 2))
}

/// (before, after) padding per spatial dim from `pads` or `auto_pad`. SAME pads so that the
/// output length is ⌈L / stride⌉, the odd unit after (UPPER) or before (LOWER).
fn resolve_pads(
    n: &Node,
    lens: &[Dim],
    kernel: &[i64],
    stride: &[i64],
    dilation: &[i64],
) -> Result<Vec<(i64, i64)>> {
    let k = kernel.len();
    let auto = n.string("auto_pad", "NOTSET")?;
    match auto.as_str() {
        "NOTSET" => {
            let Some(p) = n.ints("pads")? else {
                return Ok(vec![(0, 0); k]);
            };
            if p.len() != 2 * k || p.iter().any(|&e| e < 0) {
                return Err(shape_err(
                    n,
                    format!(
                        "pads {p:?} must be {} values ≥ 0 (begins, then ends)",
                        2 * k
                    ),
                ));
            }
            Ok((0..k).map(|i| (p[i], p[k + i])).collect())
        }
        "VALID" => Ok(vec![(0, 0); k]),
        "SAME_UPPER" | "SAME_LOWER" => (0..k)
            .map(|i| -> Result<(i64, i64)> {
                let len = lens[i].as_const().ok_or_else(|| {
                    n.unsupported(format!("auto_pad={auto} with symbolic spatial dims"))
                })?;
                let out = (len + stride[i] - 1) / stride[i];
                let total =
                    ((out - 1) * stride[i] + dilation[i] * (kernel[i] - 1) + 1 - len).max(0);
                let small = total / 2;
                Ok(if auto == "SAME_UPPER" {
                    (small, total - small)
                } else {
                    (total - small, small)
                })
            })
            .collect(),
        other => Err(n.err(format!("unknown auto_pad '{other}'"))),
    }
}

/// The kernel from the weight `[*, *, *K]` (constant), checked against `kernel_shape`.
fn weight_kernel(ctx: &Ctx, n: &Node, w: ValueId, k: usize) -> Result<Vec<i64>> {
    let ws = ctx.b.shape(w);
    if ws.len() != k + 2 {
        return Err(shape_err(
            n,
            format!("weight {} for a {k}-d input", format_shape(&ws)),
        ));
    }
    let kernel: Vec<i64> = ws[2..]
        .iter()
        .map(Dim::as_const)
        .collect::<Option<_>>()
        .ok_or_else(|| n.unsupported("a weight with symbolic kernel dims"))?;
    if let Some(ks) = n.ints("kernel_shape")? {
        if ks != kernel {
            return Err(shape_err(
                n,
                format!(
                    "kernel_shape {ks:?} disagrees with weight {}",
                    format_shape(&ws)
                ),
            ));
        }
    }
    Ok(kernel)
}

fn conv(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let (x, k) = spatial_input(ctx, n, false)?;
    let w = ctx.input(n, 1)?;
    let bias = ctx.opt_input(n, 2)?;
    let kernel = weight_kernel(ctx, n, w, k)?;
    let stride = per_dim(n, "strides", k, 1, 1)?;
    let dilation = per_dim(n, "dilations", k, 1, 1)?;
    let groups = n.int("group", 1)?;
    if groups < 1 {
        return Err(shape_err(n, format!("group {groups} must be ≥ 1")));
    }
    let lens = ctx.b.shape(x)[2..].to_vec();
    let padding = resolve_pads(n, &lens, &kernel, &stride, &dilation)?;
    let op = Op::Conv {
        stride,
        padding,
        dilation,
        groups,
        has_bias: bias.is_some(),
    };
    let mut inputs = vec![x, w];
    inputs.extend(bias);
    one(ctx.b.op(op, &inputs)?)
}

fn conv_transposed(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let (x, k) = spatial_input(ctx, n, false)?;
    let w = ctx.input(n, 1)?;
    let bias = ctx.opt_input(n, 2)?;
    let kernel = weight_kernel(ctx, n, w, k)?;
    let stride = per_dim(n, "strides", k, 1, 1)?;
    let dilation = per_dim(n, "dilations", k, 1, 1)?;
    let output_padding = per_dim(n, "output_padding", k, 0, 0)?;
    let groups = n.int("group", 1)?;
    if groups < 1 {
        return Err(shape_err(n, format!("group {groups} must be ≥ 1")));
    }
    let auto = n.string("auto_pad", "NOTSET")?;
    let lens = ctx.b.shape(x)[2..].to_vec();
    let target = match n.ints("output_shape")? {
        Some(o) if o.len() == k => Some(o),
        Some(o) => {
            return Err(shape_err(
                n,
                format!("output_shape {o:?} must give the {k} spatial dims"),
            ))
        }
        None if auto.starts_with("SAME") => Some(Vec::new()),
        None => None,
    };
    let padding = match target {
        None => resolve_pads(n, &lens, &kernel, &stride, &dilation)?,
        // The pads that give `output_shape` (SAME: L·stride), split as ONNX Runtime 1.32
        // does: the odd unit at the end for SAME_UPPER, at the start otherwise.
        Some(out) => (0..k)
            .map(|i| -> Result<(i64, i64)> {
                let len = lens[i].as_const().ok_or_else(|| {
                    n.unsupported("output_shape or auto_pad=SAME with symbolic spatial dims")
                })?;
                let want = out.get(i).copied().unwrap_or(len * stride[i]);
                let total =
                    stride[i] * (len - 1) + output_padding[i] + dilation[i] * (kernel[i] - 1) + 1
                        - want;
                if total < 0 {
                    return Err(n.unsupported(format!(
                        "output size {want} beyond the full transposed convolution"
                    )));
                }
                Ok(if auto == "SAME_UPPER" {
                    (total / 2, total - total / 2)
                } else {
                    (total - total / 2, total / 2)
                })
            })
            .collect::<Result<_>>()?,
    };
    let p = TransposeParams {
        stride,
        padding,
        dilation,
        output_padding,
        groups,
    };
    one(conv_transpose(&mut ctx.b, x, w, bias, &p)?)
}

/// ONNX Runtime's pooled length: with `ceil_mode` it rounds up, but drops a last window that
/// would start in the end padding.
fn pool_out_len(
    len: i64,
    pad: (i64, i64),
    kernel: i64,
    stride: i64,
    dilation: i64,
    ceil: bool,
) -> i64 {
    let span = len + pad.0 + pad.1 - dilation * (kernel - 1) - 1;
    let mut out = if ceil {
        (span + stride - 1).div_euclid(stride) + 1
    } else {
        span.div_euclid(stride) + 1
    };
    if ceil && (out - 1) * stride >= len + pad.0 {
        out -= 1;
    }
    out
}

fn pool(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let max = n.op == "MaxPool";
    if max && n.wants_output(1) {
        return Err(n.unsupported("the Indices output"));
    }
    // MaxPool of 8-bit integers (quantized models) picks elements, so it runs exactly on
    // their float32 values.
    let (x, k) = spatial_input(ctx, n, max)?;
    let int8 = (!ctx.b.dtype(x).is_float()).then(|| ctx.b.dtype(x));
    let x = match int8 {
        Some(_) => ctx.b.cast(x, DType::F32)?,
        None => x,
    };
    let finish = |ctx: &mut Ctx, y: ValueId| match int8 {
        Some(t) => one(ctx.b.cast(y, t)?),
        None => one(y),
    };
    let kernel = n
        .ints("kernel_shape")?
        .ok_or_else(|| shape_err(n, "kernel_shape is required"))?;
    if kernel.len() != k || kernel.iter().any(|&e| e < 1) {
        return Err(shape_err(
            n,
            format!("kernel_shape {kernel:?} for {k} spatial dims"),
        ));
    }
    // ONNX's default stride is 1 (torch's is the kernel).
    let stride = per_dim(n, "strides", k, 1, 1)?;
    let dilation = per_dim(n, "dilations", k, 1, 1)?;
    let ceil_mode = n.int("ceil_mode", 0)? != 0;
    if n.int("storage_order", 0)? != 0 {
        return Err(n.unsupported("storage_order=1"));
    }
    let shape = ctx.b.shape(x);
    let lens = shape[2..].to_vec();
    let pads = resolve_pads(n, &lens, &kernel, &stride, &dilation)?;
    let count_include_pad = !max && n.int("count_include_pad", 0)? != 0;
    if !max && dilation.iter().any(|&d| d != 1) {
        return Err(n.unsupported("dilations other than 1 on AveragePool"));
    }
    let kind = |include: bool| match max {
        true => PoolKind::Max,
        false => PoolKind::Avg {
            count_include_pad: include,
            divisor: None,
        },
    };
    let pool_op = |padding: Vec<i64>, include: bool| Op::Pool {
        kind: kind(include),
        kernel: kernel.clone(),
        stride: stride.clone(),
        padding,
        dilation: dilation.clone(),
        ceil_mode,
    };
    // The IR pads symmetrically, at most half the window.
    let fits = (0..k)
        .all(|i| pads[i].0 == pads[i].1 && pads[i].0 <= (dilation[i] * (kernel[i] - 1) + 1) / 2);
    if fits {
        let padding = pads.iter().map(|p| p.0).collect();
        let y = ctx.b.op(pool_op(padding, count_include_pad), &[x])?;
        return finish(ctx, y);
    }
    let mut full_pads = vec![(0, 0); 2];
    full_pads.extend(pads.iter().copied());
    let dtype = ctx.b.dtype(x);
    // Max: padding must never win, so pad with −inf. Avg: zeros add nothing; the unpadded
    // pool then divides by the window clipped to the padded input, which is ONNX's
    // count_include_pad=1 divisor.
    let fill = if max { f64::NEG_INFINITY } else { 0.0 };
    let xp = ctx.b.op(
        Op::Pad {
            pads: full_pads.clone(),
            value: Scalar::Float(fill),
        },
        &[x],
    )?;
    let mut y = ctx.b.op(pool_op(vec![0; k], true), &[xp])?;
    if !max && !count_include_pad {
        // Divide by the in-bounds count: the same pool over a padded all-ones mask has the
        // same divisor, so sum/divisor ÷ count/divisor = sum/count exactly.
        let mut mshape = vec![Dim::Const(1), Dim::Const(1)];
        mshape.extend(lens.iter().cloned());
        let ones = ctx.b.full(Scalar::Float(1.0), dtype, mshape)?;
        let mp = ctx.b.op(
            Op::Pad {
                pads: full_pads,
                value: Scalar::Float(0.0),
            },
            &[ones],
        )?;
        let counts = ctx.b.op(pool_op(vec![0; k], true), &[mp])?;
        y = ctx.b.binary_in(
            BinaryOp::Div,
            Operand::Tensor(y),
            Operand::Tensor(counts),
            dtype,
        )?;
    }
    if ceil_mode {
        // Over the explicitly padded input the IR drops only windows starting past the end
        // padding; ONNX Runtime also drops one starting inside it.
        for i in 0..k {
            let Some(len) = lens[i].as_const() else {
                continue;
            };
            let want = pool_out_len(len, pads[i], kernel[i], stride[i], dilation[i], true);
            if ctx.b.shape(y)[2 + i].as_const() != Some(want) {
                y = ctx.b.slice(y, 2 + i, Dim::Const(0), Dim::Const(want), 1)?;
            }
        }
    }
    finish(ctx, y)
}

#[cfg(test)]
mod tests {
    use super::pool_out_len;

    #[test]
    fn ceil_mode_drops_a_window_starting_in_the_end_padding() {
        // L=11, k=3, s=2: floor 5, ceil 5 (exact).
        assert_eq!(pool_out_len(11, (0, 0), 3, 2, 1, false), 5);
        assert_eq!(pool_out_len(11, (0, 0), 3, 2, 1, true), 5);
        // L=8, k=3, s=2: floor 3, ceil 4 (the 4th starts at 6 < 8).
        assert_eq!(pool_out_len(8, (0, 0), 3, 2, 1, true), 4);
        // L=8, k=2, s=3, pads (0, 2): ceil 4 would start at 9 ≥ 8 + 0, so 3.
        assert_eq!(pool_out_len(8, (0, 2), 2, 3, 1, true), 3);
    }
}
