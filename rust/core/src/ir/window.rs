//! Sliding-window geometry shared by `Conv` and `Pool`: their type rules and the output-size
//! arithmetic every implementation (interpreter, backends) repeats on concrete sizes.

use super::op::{Op, PoolKind};
use super::TensorType;
use crate::dim::{format_shape, Dim, DimOp};
use crate::error::{Error, Result};

fn shape_err<T>(msg: String) -> Result<T> {
    Err(Error::Shape(msg))
}

/// Output length of a window sweep over `len` with explicit (before, after) padding.
pub fn conv_out_len(len: i64, pad: (i64, i64), kernel: i64, stride: i64, dilation: i64) -> i64 {
    (len + pad.0 + pad.1 - dilation * (kernel - 1) - 1).div_euclid(stride) + 1
}

/// Output length of a pooling sweep (torch's rule: symmetric padding; with `ceil_mode` the
/// size rounds up, but the last window must start inside the input or the left padding).
pub fn pool_out_len(
    len: i64,
    pad: i64,
    kernel: i64,
    stride: i64,
    dilation: i64,
    ceil_mode: bool,
) -> i64 {
    let span = len + 2 * pad - dilation * (kernel - 1) - 1;
    let mut out = (span + if ceil_mode { stride - 1 } else { 0 }).div_euclid(stride) + 1;
    if ceil_mode && (out - 1) * stride >= len + pad {
        out -= 1;
    }
    out
}

fn positive(what: &str, v: &[i64], op: &Op) -> Result<()> {
    if v.iter().any(|&x| x < 1) {
        return shape_err(format!("{}: {what} must be ≥ 1, got {v:?}", op.name()));
    }
    Ok(())
}

fn check_out(op: &Op, out: &Dim, x: &TensorType) -> Result<()> {
    if out.as_const().is_some_and(|o| o < 1) {
        return shape_err(format!(
            "{}: input {} is too small for the window (output size {out})",
            op.name(),
            format_shape(&x.shape)
        ));
    }
    Ok(())
}

/// Type of `Conv`: inputs x `[N, C, *S]`, w `[O, C/groups, *K]`, optional bias `[O]`.
pub fn conv_type(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    let Op::Conv {
        stride,
        padding,
        dilation,
        groups,
        has_bias,
    } = op
    else {
        return Err(Error::Compile(format!("{} is not a conv", op.name())));
    };
    let k = stride.len();
    if inputs.len() != 2 + *has_bias as usize {
        return Err(Error::Compile(format!(
            "conv takes {} inputs, got {}",
            2 + *has_bias as usize,
            inputs.len()
        )));
    }
    let (x, w) = (inputs[0], inputs[1]);
    if k == 0 || padding.len() != k || dilation.len() != k {
        return shape_err(format!(
            "conv: stride {stride:?}, padding {padding:?}, dilation {dilation:?} disagree"
        ));
    }
    positive("stride", stride, op)?;
    positive("dilation", dilation, op)?;
    positive("groups", &[*groups], op)?;
    if padding.iter().any(|&(a, b)| a < 0 || b < 0) {
        return shape_err(format!("conv: negative padding {padding:?}"));
    }
    if x.rank() != k + 2 || w.rank() != k + 2 {
        return shape_err(format!(
            "conv{k}d needs input and weight of rank {}, got {} and {}",
            k + 2,
            format_shape(&x.shape),
            format_shape(&w.shape)
        ));
    }
    if !x.dtype.is_float() || w.dtype != x.dtype {
        return Err(Error::Compile(format!(
            "conv needs float input and weight of one dtype, got {} and {}",
            x.dtype, w.dtype
        )));
    }
    let g = *groups;
    let (c, o, cg) = (
        x.shape[1].as_const(),
        w.shape[0].as_const(),
        w.shape[1].as_const(),
    );
    match (c, o, cg) {
        (Some(c), Some(o), Some(cg)) if c % g == 0 && o % g == 0 && cg * g == c => {}
        _ => {
            return shape_err(format!(
                "conv with groups={g}: input {} and weight {} do not match (need constant \
                 channels, C = weight.shape[1]·groups, O divisible by groups)",
                format_shape(&x.shape),
                format_shape(&w.shape)
            ))
        }
    }
    if *has_bias {
        let b = inputs[2];
        if b.rank() != 1 || b.shape[0].as_const() != o || b.dtype != x.dtype {
            return shape_err(format!(
                "conv bias {} {} for {} output channels",
                b.dtype,
                format_shape(&b.shape),
                w.shape[0]
            ));
        }
    }
    let mut shape = vec![x.shape[0].clone(), w.shape[0].clone()];
    for i in 0..k {
        let kern = w.shape[i + 2].as_const().ok_or_else(|| {
            Error::Shape(format!("conv: symbolic kernel size {}", w.shape[i + 2]))
        })?;
        let span = Dim::Const(padding[i].0 + padding[i].1 - dilation[i] * (kern - 1) - 1);
        let out = &Dim::binary(
            DimOp::FloorDiv,
            &x.shape[i + 2] + &span,
            Dim::Const(stride[i]),
        ) + &Dim::Const(1);
        check_out(op, &out, x)?;
        shape.push(out);
    }
    Ok(TensorType::new(x.dtype, shape))
}

/// Type of `Pool` over the trailing `kernel.len()` dims.
pub fn pool_type(op: &Op, x: &TensorType) -> Result<TensorType> {
    let Op::Pool {
        kind,
        kernel,
        stride,
        padding,
        dilation,
        ceil_mode,
    } = op
    else {
        return Err(Error::Compile(format!("{} is not a pool", op.name())));
    };
    let k = kernel.len();
    if k == 0 || stride.len() != k || padding.len() != k || dilation.len() != k {
        return shape_err(format!(
            "{}: kernel {kernel:?}, stride {stride:?}, padding {padding:?}, dilation \
             {dilation:?} disagree",
            op.name()
        ));
    }
    positive("kernel", kernel, op)?;
    positive("stride", stride, op)?;
    positive("dilation", dilation, op)?;
    for i in 0..k {
        // torch's own limit: a window must always see at least one real element.
        if padding[i] < 0 || padding[i] > (dilation[i] * (kernel[i] - 1) + 1) / 2 {
            return shape_err(format!(
                "{}: padding {padding:?} must be ≥ 0 and at most half the window {kernel:?}",
                op.name()
            ));
        }
    }
    if let PoolKind::Avg { divisor, .. } = kind {
        if dilation.iter().any(|&d| d != 1) || divisor.is_some_and(|d| d == 0) {
            return shape_err(format!(
                "avg_pool: dilation {dilation:?} (must be 1) or divisor {divisor:?} (non-zero)"
            ));
        }
    }
    if x.rank() < k + 1 {
        return shape_err(format!(
            "{}{k}d needs rank ≥ {}, got {}",
            op.name(),
            k + 1,
            format_shape(&x.shape)
        ));
    }
    if !x.dtype.is_float() {
        return Err(Error::Compile(format!(
            "{} needs a float input, got {}",
            op.name(),
            x.dtype
        )));
    }
    let lead = x.rank() - k;
    let mut shape = x.shape[..lead].to_vec();
    for i in 0..k {
        let len = &x.shape[lead + i];
        let out = if *ceil_mode {
            let l = len.as_const().ok_or_else(|| {
                Error::Shape(format!(
                    "{} with ceil_mode needs constant spatial dims, got {}",
                    op.name(),
                    format_shape(&x.shape)
                ))
            })?;
            Dim::Const(pool_out_len(
                l,
                padding[i],
                kernel[i],
                stride[i],
                dilation[i],
                true,
            ))
        } else {
            let span = Dim::Const(2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1);
            &Dim::binary(DimOp::FloorDiv, len + &span, Dim::Const(stride[i])) + &Dim::Const(1)
        };
        check_out(op, &out, x)?;
        shape.push(out);
    }
    Ok(TensorType::new(x.dtype, shape))
}
