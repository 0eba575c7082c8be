//! Neural-network composites kept whole by the export (softmax, layer/rms norm, attention)
//! and eval-mode batch norm.

use super::conv::{fold_batch_norm, BnParams};
use super::{axis, tensor, Handler};
use crate::dim::Dim;
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::builder::{broadcast_shapes, Operand};
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, Op, UnaryOp, ValueId};

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    Some(match (name, overload) {
        ("_softmax" | "softmax", "default" | "int") => |c, n| softmax(c, n, false),
        ("_log_softmax" | "log_softmax", "default" | "int") => |c, n| softmax(c, n, true),
        ("layer_norm" | "native_layer_norm", "default") => layer_norm,
        ("rms_norm", "default") => rms_norm,
        ("scaled_dot_product_attention", "default") => attention,
        ("_native_batch_norm_legit_no_training", "default") => batch_norm,
        ("_transformer_encoder_layer_fwd", "default") => encoder_layer,
        _ => return None,
    })
}

fn softmax(ctx: &mut Ctx, n: &NodeArgs, log: bool) -> Result<Out> {
    let mut x = tensor(ctx, n, "self", 0)?;
    let a = axis(ctx, x, n.int("dim", 1)?)?;
    // `softmax.int` may name an output dtype; `_softmax` may ask for f32 from half.
    if let Ok(Some(d)) = n.dtype("dtype", 2) {
        x = ctx.b.cast(x, d)?;
    } else if n.bool("half_to_float", 2, false).unwrap_or(false) {
        x = ctx.b.cast(x, DType::F32)?;
    }
    if !ctx.b.dtype(x).is_float() {
        x = ctx.b.cast(x, DType::F32)?;
    }
    if ctx.b.rank(x) == 0 {
        // Softmax of a scalar is 1 (log: 0).
        let v = if log { 0 } else { 1 };
        let d = ctx.b.dtype(x);
        return Ok(Out::Value(ctx.b.full(Scalar::Int(v), d, vec![])?));
    }
    Ok(Out::Value(ctx.b.op(Op::Softmax { axis: a, log }, &[x])?))
}

/// Normalized dims are the trailing `normalized_shape.len()` dims of the input.
fn norm_axis(ctx: &Ctx, n: &NodeArgs, x: ValueId) -> Result<usize> {
    let k = n.ints("normalized_shape", 1)?.len();
    let rank = ctx.b.rank(x);
    if k == 0 || k > rank {
        return Err(Error::Shape(format!(
            "normalized_shape of {k} dims for rank {rank} at node '{}'",
            n.name
        )));
    }
    Ok(rank - k)
}

fn param(
    ctx: &mut Ctx,
    n: &NodeArgs,
    name: &str,
    pos: usize,
    dtype: DType,
) -> Result<Option<ValueId>> {
    match n.opt_tensor(name, pos)? {
        Some(t) => {
            let v = ctx.value(t)?;
            Ok(Some(ctx.b.cast(v, dtype)?))
        }
        None => Ok(None),
    }
}

fn layer_norm(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "input", 0)?;
    let a = norm_axis(ctx, n, x)?;
    let dtype = ctx.b.dtype(x);
    let w = param(ctx, n, "weight", 2, dtype)?;
    let b = param(ctx, n, "bias", 3, dtype)?;
    let eps = n.float("eps", 4)?.unwrap_or(1e-5);
    let mut inputs = vec![x];
    inputs.extend(w);
    inputs.extend(b);
    let y = ctx.b.op(
        Op::LayerNorm {
            axis: a,
            eps,
            has_weight: w.is_some(),
            has_bias: b.is_some(),
        },
        &inputs,
    )?;
    if n.target.contains("native_layer_norm") {
        // (out, mean, rstd): the statistics are only needed for training.
        return Ok(Out::Values(vec![Some(y), None, None]));
    }
    Ok(Out::Value(y))
}

fn rms_norm(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "input", 0)?;
    let a = norm_axis(ctx, n, x)?;
    let dtype = ctx.b.dtype(x);
    let w = param(ctx, n, "weight", 2, dtype)?;
    // torch's default eps is the dtype's machine epsilon.
    let eps = match n.float("eps", 3)? {
        Some(e) => e,
        None => match dtype {
            DType::F16 => 0.0009765625,
            DType::BF16 => 0.0078125,
            DType::F64 => f64::EPSILON,
            _ => f32::EPSILON as f64,
        },
    };
    let mut inputs = vec![x];
    inputs.extend(w);
    Ok(Out::Value(ctx.b.op(
        Op::RmsNorm {
            axis: a,
            eps,
            has_weight: w.is_some(),
        },
        &inputs,
    )?))
}

fn attention(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let q = tensor(ctx, n, "query", 0)?;
    let mut k = tensor(ctx, n, "key", 1)?;
    let mut v = tensor(ctx, n, "value", 2)?;
    if n.float("dropout_p", 4)?.unwrap_or(0.0) != 0.0 {
        return Err(Error::unsupported_because(
            "aten.scaled_dot_product_attention",
            &n.name,
            "dropout_p > 0 (training-time dropout)",
        ));
    }
    let causal = n.bool("is_causal", 5, false)?;
    let qs = ctx.b.shape(q);
    let r = qs.len();
    if r < 2 || ctx.b.rank(k) != r || ctx.b.rank(v) != r {
        return Err(Error::Shape(format!(
            "attention operands of unequal rank at '{}'",
            n.name
        )));
    }
    let e = qs[r - 1].as_const().ok_or_else(|| {
        Error::unsupported_because(
            "aten.scaled_dot_product_attention",
            &n.name,
            "symbolic head dim",
        )
    })?;
    let scale = n.float("scale", 6)?.unwrap_or(1.0 / (e as f64).sqrt());
    if n.bool("enable_gqa", 7, false)? && r >= 3 {
        k = ctx.b.repeat_heads(k, &qs[r - 3])?;
        v = ctx.b.repeat_heads(v, &qs[r - 3])?;
    }
    // Batch dims broadcast among q, k, v (and the mask).
    let (ks, vs) = (ctx.b.shape(k), ctx.b.shape(v));
    let mut batch = broadcast_shapes(&qs[..r - 2], &ks[..r - 2])?;
    batch = broadcast_shapes(&batch, &vs[..r - 2])?;
    let with = |b: &Vec<Dim>, tail: &[Dim]| {
        let mut s = b.clone();
        s.extend(tail.iter().cloned());
        s
    };
    let q = ctx.b.broadcast_to(q, &with(&batch, &qs[r - 2..]))?;
    let k = ctx.b.broadcast_to(k, &with(&batch, &ks[r - 2..]))?;
    let v = ctx.b.broadcast_to(v, &with(&batch, &vs[r - 2..]))?;
    let mut inputs = vec![q, k, v];
    let mask = n.opt_tensor("attn_mask", 3)?;
    if let Some(m) = mask {
        let mut m = ctx.value(m)?;
        let dtype = ctx.b.dtype(q);
        if ctx.b.dtype(m) != DType::Bool {
            m = ctx.b.cast(m, dtype)?;
        }
        let want = with(&batch, &[qs[r - 2].clone(), ks[r - 2].clone()]);
        inputs.push(ctx.b.broadcast_to(m, &want)?);
    }
    Ok(Out::Value(ctx.b.op(
        Op::Attention {
            scale,
            causal,
            has_mask: mask.is_some(),
        },
        &inputs,
    )?))
}

/// Eval-mode batch norm: `(x - mean) / sqrt(var + eps) * w + b` over channel dim 1.
fn batch_norm(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "input", 0)?;
    let rank = ctx.b.rank(x);
    if rank < 2 {
        return Err(Error::Shape(format!(
            "batch norm of rank {rank} at '{}'",
            n.name
        )));
    }
    let dtype = ctx.b.dtype(x);
    let param = |ctx: &mut Ctx, name: &str, pos: usize| -> Result<Option<ValueId>> {
        match n.opt_tensor(name, pos)? {
            Some(t) => {
                let v = ctx.value(t)?;
                Ok(Some(ctx.b.cast(v, dtype)?))
            }
            None => Ok(None),
        }
    };
    let missing = |what: &str| Error::Compile(format!("batch norm without {what} at '{}'", n.name));
    let params = BnParams {
        weight: param(ctx, "weight", 1)?,
        bias: param(ctx, "bias", 2)?,
        mean: param(ctx, "running_mean", 3)?.ok_or_else(|| missing("running_mean"))?,
        var: param(ctx, "running_var", 4)?.ok_or_else(|| missing("running_var"))?,
        eps: n.float("eps", 6)?.unwrap_or(1e-5),
    };
    if let Some(y) = fold_batch_norm(ctx, x, &params)? {
        return Ok(Out::Values(vec![Some(y), None, None]));
    }
    let mut channel_shape = vec![Dim::Const(1); rank];
    channel_shape[1] = ctx.b.shape(x)[1].clone();
    let mut per_channel = |v: Option<ValueId>| -> Result<Option<ValueId>> {
        v.map(|v| ctx.b.reshape(v, channel_shape.clone()))
            .transpose()
    };
    let w = per_channel(params.weight)?;
    let b = per_channel(params.bias)?;
    let mean = per_channel(Some(params.mean))?.ok_or_else(|| missing("running_mean"))?;
    let var = per_channel(Some(params.var))?.ok_or_else(|| missing("running_var"))?;
    let eps = params.eps;
    let t = Operand::Tensor;
    let denom = ctx
        .b
        .binary(BinaryOp::Add, t(var), Operand::Scalar(Scalar::Float(eps)))?;
    let inv = ctx.b.unary(UnaryOp::Rsqrt, denom)?;
    let centered = ctx.b.binary(BinaryOp::Sub, t(x), t(mean))?;
    let mut y = ctx.b.binary(BinaryOp::Mul, t(centered), t(inv))?;
    if let Some(w) = w {
        y = ctx.b.binary(BinaryOp::Mul, t(y), t(w))?;
    }
    if let Some(b) = b {
        y = ctx.b.binary(BinaryOp::Add, t(y), t(b))?;
    }
    Ok(Out::Values(vec![Some(y), None, None]))
}

/// nn.TransformerEncoderLayer's inference fast path (batch-first), rebuilt from IR ops:
/// self-attention block and feed-forward block, each with a residual and a layer norm
/// applied before (`norm_first`) or after.
fn encoder_layer(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    use super::linalg::linear_layer;
    let t = |ctx: &Ctx, name: &str, pos: usize| tensor(ctx, n, name, pos);
    let x = t(ctx, "src", 0)?;
    let heads = n.int("num_heads", 2)?;
    let (qkv_w, qkv_b) = (t(ctx, "qkv_weight", 3)?, t(ctx, "qkv_bias", 4)?);
    let (proj_w, proj_b) = (t(ctx, "proj_weight", 5)?, t(ctx, "proj_bias", 6)?);
    let use_gelu = n.bool("use_gelu", 7, false)?;
    let norm_first = n.bool("norm_first", 8, false)?;
    let eps = n.float("eps", 9)?.unwrap_or(1e-5);
    let norm1 = (t(ctx, "norm_weight_1", 10)?, t(ctx, "norm_bias_1", 11)?);
    let norm2 = (t(ctx, "norm_weight_2", 12)?, t(ctx, "norm_bias_2", 13)?);
    let ffn1 = (t(ctx, "ffn_weight_1", 14)?, t(ctx, "ffn_bias_1", 15)?);
    let ffn2 = (t(ctx, "ffn_weight_2", 16)?, t(ctx, "ffn_bias_2", 17)?);
    let shape = ctx.b.shape(x);
    if shape.len() != 3 {
        return Err(Error::unsupported_because(
            "aten._transformer_encoder_layer_fwd",
            &n.name,
            "only batched (3-D, batch-first) inputs",
        ));
    }
    let (bsz, len, dim) = (shape[0].clone(), shape[1].clone(), shape[2].clone());
    let e = dim
        .as_const()
        .ok_or_else(|| Error::Shape("symbolic embedding dim".into()))?;
    if heads <= 0 || e % heads != 0 {
        return Err(Error::Shape(format!(
            "{e} features in {heads} heads at '{}'",
            n.name
        )));
    }
    let hd = e / heads;
    let mask = match n.opt_tensor("mask", 18)? {
        None => None,
        Some(m) => {
            let mut m = ctx.value(m)?;
            let ms = ctx.b.shape(m);
            // mask_type 1 is a key-padding mask [B, S]; 0 is [L, S]; 2 is already merged.
            let want = vec![bsz.clone(), Dim::Const(heads), len.clone(), len.clone()];
            let as4 = match (n.opt_int("mask_type", 19)?, ms.len()) {
                (Some(1), 2) => vec![ms[0].clone(), Dim::Const(1), Dim::Const(1), ms[1].clone()],
                (_, 2) => vec![Dim::Const(1), Dim::Const(1), ms[0].clone(), ms[1].clone()],
                _ => ms.clone(),
            };
            m = ctx.b.reshape(m, as4)?;
            if ctx.b.dtype(m) == DType::Bool {
                // nn.MultiheadAttention masks out where true; the IR keeps where true.
                m = ctx.b.unary(UnaryOp::Not, m)?;
            } else {
                let dtype = ctx.b.dtype(x);
                m = ctx.b.cast(m, dtype)?;
            }
            Some(ctx.b.broadcast_to(m, &want)?)
        }
    };
    let layer_norm = |ctx: &mut Ctx, v: ValueId, (w, b): (ValueId, ValueId)| {
        ctx.b.op(
            Op::LayerNorm {
                axis: 2,
                eps,
                has_weight: true,
                has_bias: true,
            },
            &[v, w, b],
        )
    };
    let attention = |ctx: &mut Ctx, v: ValueId| -> Result<ValueId> {
        let qkv = linear_layer(&mut ctx.b, v, qkv_w, Some(qkv_b))?;
        let mut parts = Vec::new();
        for i in 0..3 {
            let s = ctx
                .b
                .slice(qkv, 2, Dim::Const(i * e), Dim::Const((i + 1) * e), 1)?;
            let s = ctx.b.reshape(
                s,
                vec![bsz.clone(), len.clone(), Dim::Const(heads), Dim::Const(hd)],
            )?;
            parts.push(ctx.b.permute(s, vec![0, 2, 1, 3])?);
        }
        parts.extend(mask);
        let a = ctx.b.op(
            Op::Attention {
                scale: 1.0 / (hd as f64).sqrt(),
                causal: false,
                has_mask: mask.is_some(),
            },
            &parts,
        )?;
        let a = ctx.b.permute(a, vec![0, 2, 1, 3])?;
        let a = ctx
            .b
            .reshape(a, vec![bsz.clone(), len.clone(), dim.clone()])?;
        linear_layer(&mut ctx.b, a, proj_w, Some(proj_b))
    };
    let feed_forward = |ctx: &mut Ctx, v: ValueId| -> Result<ValueId> {
        let h = linear_layer(&mut ctx.b, v, ffn1.0, Some(ffn1.1))?;
        let h = ctx.b.unary(
            if use_gelu {
                UnaryOp::Gelu
            } else {
                UnaryOp::Relu
            },
            h,
        )?;
        linear_layer(&mut ctx.b, h, ffn2.0, Some(ffn2.1))
    };
    let add = |ctx: &mut Ctx, a: ValueId, b: ValueId| {
        ctx.b
            .binary(BinaryOp::Add, Operand::Tensor(a), Operand::Tensor(b))
    };
    let y = if norm_first {
        let h = layer_norm(ctx, x, norm1)?;
        let a = attention(ctx, h)?;
        let x1 = add(ctx, x, a)?;
        let h = layer_norm(ctx, x1, norm2)?;
        let f = feed_forward(ctx, h)?;
        add(ctx, x1, f)?
    } else {
        let a = attention(ctx, x)?;
        let s = add(ctx, x, a)?;
        let x1 = layer_norm(ctx, s, norm1)?;
        let f = feed_forward(ctx, x1)?;
        let s = add(ctx, x1, f)?;
        layer_norm(ctx, s, norm2)?
    };
    Ok(Out::Value(y))
}
