//! `aten.convolution` (1-, 2-, 3-d, grouped, dilated, and transposed) and the fold of an
//! eval-mode batch norm into the conv before it.

use super::{tensor, Handler};
use crate::dim::Dim;
use crate::dtype::Scalar;
use crate::error::{Error, Result};
use crate::frontend::builder::Operand;
use crate::frontend::conv::{conv_transpose, TransposeParams};
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, Op, UnaryOp, ValueId};

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    Some(match (name, overload) {
        ("convolution", "default") => convolution,
        _ => return None,
    })
}

/// A per-dim attribute list: torch allows one value for every spatial dim.
fn per_dim(n: &NodeArgs, name: &str, pos: usize, k: usize, default: i64) -> Result<Vec<i64>> {
    let v = n.opt_ints(name, pos)?.unwrap_or_default();
    match v.len() {
        0 => Ok(vec![default; k]),
        1 => Ok(vec![v[0]; k]),
        l if l == k => Ok(v),
        l => Err(Error::Shape(format!(
            "node '{}': {name} has {l} values for a {k}-d convolution",
            n.name
        ))),
    }
}

fn convolution(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "input", 0)?;
    let w = tensor(ctx, n, "weight", 1)?;
    let bias = match n.opt_tensor("bias", 2)? {
        Some(b) => Some(ctx.value(b)?),
        None => None,
    };
    let k = ctx.b.rank(w).saturating_sub(2);
    if k == 0 || k > 3 || ctx.b.rank(x) != k + 2 {
        return Err(Error::Shape(format!(
            "node '{}': convolution of input {} with weight {} (need [N, C, *spatial] with 1 \
             to 3 spatial dims)",
            n.name,
            crate::dim::format_shape(&ctx.b.shape(x)),
            crate::dim::format_shape(&ctx.b.shape(w))
        )));
    }
    let stride = per_dim(n, "stride", 3, k, 1)?;
    let padding = per_dim(n, "padding", 4, k, 0)?;
    let dilation = per_dim(n, "dilation", 5, k, 1)?;
    let transposed = n.bool("transposed", 6, false)?;
    let output_padding = per_dim(n, "output_padding", 7, k, 0)?;
    let groups = n.int("groups", 8)?;
    if padding.iter().any(|&p| p < 0) {
        return Err(Error::Shape(format!(
            "node '{}': negative padding {padding:?}",
            n.name
        )));
    }
    if transposed {
        let p = TransposeParams {
            stride,
            padding: padding.iter().map(|&p| (p, p)).collect(),
            dilation,
            output_padding,
            groups,
        };
        return Ok(Out::Value(conv_transpose(&mut ctx.b, x, w, bias, &p)?));
    }
    if output_padding.iter().any(|&p| p != 0) {
        return Err(Error::unsupported_because(
            "aten.convolution",
            &n.name,
            "output_padding on a non-transposed convolution",
        ));
    }
    let op = Op::Conv {
        stride,
        padding: padding.iter().map(|&p| (p, p)).collect(),
        dilation,
        groups,
        has_bias: bias.is_some(),
    };
    let mut inputs = vec![x, w];
    inputs.extend(bias);
    Ok(Out::Value(ctx.b.op(op, &inputs)?))
}

/// Eval batch norm applied to the output of a conv whose weight does not depend on the
/// inputs: `bn(conv(x, w) + b) = conv(x, w·s) + (b − mean)·s + beta` with
/// `s = gamma / sqrt(var + eps)` per output channel. The new weight and bias are computed
/// from weights only, so backends evaluate them once at compile time. Returns `None` when
/// `x` is not such a conv.
pub fn fold_batch_norm(ctx: &mut Ctx, x: ValueId, params: &BnParams) -> Result<Option<ValueId>> {
    let node = &ctx.b.g.nodes[x];
    let Op::Conv {
        stride,
        padding,
        dilation,
        groups,
        has_bias,
    } = node.op.clone()
    else {
        return Ok(None);
    };
    let inputs = node.inputs.clone();
    if !inputs[1..].iter().all(|&i| input_free(ctx, i)) {
        return Ok(None);
    }
    let (conv_in, w) = (inputs[0], inputs[1]);
    let dtype = ctx.b.dtype(w);
    let t = Operand::Tensor;
    let denom = ctx.b.binary_in(
        BinaryOp::Add,
        t(params.var),
        Operand::Scalar(Scalar::Float(params.eps)),
        dtype,
    )?;
    let mut scale = ctx.b.unary(UnaryOp::Rsqrt, denom)?;
    if let Some(gamma) = params.weight {
        scale = ctx.b.binary_in(BinaryOp::Mul, t(scale), t(gamma), dtype)?;
    }
    // Weight [O, C/g, *K] scaled per output channel.
    let wshape = ctx.b.shape(w);
    let mut col = vec![Dim::Const(1); wshape.len()];
    col[0] = wshape[0].clone();
    let scale_col = ctx.b.reshape(scale, col)?;
    let new_w = ctx.b.binary_in(BinaryOp::Mul, t(w), t(scale_col), dtype)?;
    let centered = match has_bias {
        true => ctx
            .b
            .binary_in(BinaryOp::Sub, t(inputs[2]), t(params.mean), dtype)?,
        false => ctx.b.unary(UnaryOp::Neg, params.mean)?,
    };
    let mut new_b = ctx
        .b
        .binary_in(BinaryOp::Mul, t(centered), t(scale), dtype)?;
    if let Some(beta) = params.bias {
        new_b = ctx.b.binary_in(BinaryOp::Add, t(new_b), t(beta), dtype)?;
    }
    let op = Op::Conv {
        stride,
        padding,
        dilation,
        groups,
        has_bias: true,
    };
    Ok(Some(ctx.b.op(op, &[conv_in, new_w, new_b])?))
}

/// The 1-d per-channel parameters of an eval batch norm (already in the input's dtype).
pub struct BnParams {
    pub weight: Option<ValueId>,
    pub bias: Option<ValueId>,
    pub mean: ValueId,
    pub var: ValueId,
    pub eps: f64,
}

/// Whether `v` is computed from weights and constants only.
fn input_free(ctx: &Ctx, v: ValueId) -> bool {
    let g = &ctx.b.g;
    match &g.nodes[v].op {
        Op::Input { .. } => false,
        Op::Weight { .. } | Op::Constant(_) | Op::Full { .. } | Op::Iota { .. } => true,
        _ => g.nodes[v].inputs.iter().all(|&i| input_free(ctx, i)),
    }
}
