//! ONNX Runtime's fused `com.microsoft` ops that its transformer optimizer writes
//! (`onnxruntime.transformers.optimizer`, Optimum's O2/O3 levels), so that "optimized"
//! model files from model hubs compile too: FusedMatMul, Gelu, BiasGelu, FastGelu,
//! QuickGelu, SkipLayerNormalization, SkipSimplifiedLayerNormalization and
//! (Q)EmbedLayerNormalization, each built from the IR's ops (products, `gelu`,
//! `layer_norm`, `rms_norm`). Defaults are ONNX Runtime's schema defaults (the skip norms'
//! epsilon is 1e-12).

use super::{one, Handler};
use crate::dim::Dim;
use crate::dtype::{DType, Scalar};
use crate::error::Result;
use crate::frontend::builder::Operand;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, Op, UnaryOp, ValueId};

/// The fused ops, by name.
pub const OPS: &[(&str, Handler)] = &[
    ("BiasGelu", bias_gelu),
    ("EmbedLayerNormalization", embed_layer_norm),
    ("QEmbedLayerNormalization", q_embed_layer_norm),
    ("FastGelu", bias_gelu),
    ("FusedMatMul", fused_matmul),
    ("Gelu", bias_gelu),
    ("QuickGelu", quick_gelu),
    ("SkipLayerNormalization", skip_norm),
    ("SkipSimplifiedLayerNormalization", skip_norm),
];

pub fn handler(op: &str) -> Option<Handler> {
    OPS.iter().find(|(name, _)| *name == op).map(|&(_, h)| h)
}

/// A float input.
fn float_input(ctx: &mut Ctx, n: &Node, k: usize) -> Result<ValueId> {
    let v = ctx.input(n, k)?;
    if !ctx.b.dtype(v).is_float() {
        return Err(n.err(format!("input {k} must be a float tensor")));
    }
    Ok(v)
}

/// `a + b` with broadcasting, both of one float dtype.
fn add(ctx: &mut Ctx, n: &Node, a: ValueId, b: ValueId) -> Result<ValueId> {
    let dtype = ctx.b.dtype(a);
    if ctx.b.dtype(b) != dtype {
        return Err(n.err(format!("adds {dtype} and {}", ctx.b.dtype(b))));
    }
    ctx.b
        .binary_in(BinaryOp::Add, Operand::Tensor(a), Operand::Tensor(b), dtype)
}

/// Gelu (erf), BiasGelu (erf of `A + B`) and FastGelu (tanh approximation of `X + bias`).
fn bias_gelu(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let mut x = float_input(ctx, n, 0)?;
    if n.op != "Gelu" {
        if let Some(bias) = ctx.opt_input(n, 1)? {
            x = add(ctx, n, x, bias)?;
        }
    }
    let op = match n.op {
        "FastGelu" => UnaryOp::GeluTanh,
        _ => UnaryOp::Gelu,
    };
    one(ctx.b.unary(op, x)?)
}

/// `x · sigmoid(alpha · x)`.
fn quick_gelu(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = float_input(ctx, n, 0)?;
    let dtype = ctx.b.dtype(x);
    let alpha = n.float("alpha", 1.702)? as f64;
    let ax = ctx.b.binary_in(
        BinaryOp::Mul,
        Operand::Tensor(x),
        Operand::Scalar(Scalar::Float(alpha)),
        dtype,
    )?;
    let gate = ctx.b.unary(UnaryOp::Sigmoid, ax)?;
    one(ctx.b.binary_in(
        BinaryOp::Mul,
        Operand::Tensor(x),
        Operand::Tensor(gate),
        dtype,
    )?)
}

/// `alpha · op(A) · op(B)`, `op` transposing the last two dims where `transA`/`transB` say.
fn fused_matmul(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    if n.int("transBatchA", 0)? != 0 || n.int("transBatchB", 0)? != 0 {
        return Err(n.unsupported("transBatchA/transBatchB (batch dims moved into the product)"));
    }
    let mut operands = [float_input(ctx, n, 0)?, float_input(ctx, n, 1)?];
    for (v, attr) in operands.iter_mut().zip(["transA", "transB"]) {
        if n.flag(attr, false)? {
            let r = ctx.b.rank(*v);
            if r < 2 {
                return Err(n.err(format!("{attr} on an operand of rank {r}")));
            }
            let mut perm: Vec<usize> = (0..r).collect();
            perm.swap(r - 2, r - 1);
            *v = ctx.b.permute(*v, perm)?;
        }
    }
    let y = ctx.b.matmul(operands[0], operands[1])?;
    let alpha = n.float("alpha", 1.0)? as f64;
    if alpha == 1.0 {
        return one(y);
    }
    let dtype = ctx.b.dtype(y);
    one(ctx.b.binary_in(
        BinaryOp::Mul,
        Operand::Tensor(y),
        Operand::Scalar(Scalar::Float(alpha)),
        dtype,
    )?)
}

/// A `[hidden]` parameter broadcast over the normalized tail `[hidden]`.
fn param(ctx: &mut Ctx, n: &Node, k: usize, hidden: &Dim, dtype: DType) -> Result<ValueId> {
    let p = float_input(ctx, n, k)?;
    if ctx.b.dtype(p) != dtype {
        return Err(n.err(format!(
            "input {k} is {} but the input is {dtype}",
            ctx.b.dtype(p)
        )));
    }
    ctx.b.broadcast_to(p, std::slice::from_ref(hidden))
}

/// SkipLayerNormalization (`input, skip, gamma, beta?, bias?`) and
/// SkipSimplifiedLayerNormalization (`input, skip, gamma, bias?`): the sum `input + skip
/// (+ bias)` normalized over the last dim (layer norm, or RMS norm for the simplified one),
/// times gamma (plus beta). Outputs: the normalized sum and, as output 3, the sum itself.
fn skip_norm(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    if n.wants_output(1) || n.wants_output(2) {
        return Err(n.unsupported("the mean and inv_std_var outputs (training only)"));
    }
    let simplified = n.op == "SkipSimplifiedLayerNormalization";
    let x = float_input(ctx, n, 0)?;
    let dtype = ctx.b.dtype(x);
    let rank = ctx.b.rank(x);
    if rank == 0 {
        return Err(n.err("input must have at least one dim"));
    }
    let hidden = ctx.b.shape(x)[rank - 1].clone();
    let skip = float_input(ctx, n, 1)?;
    let mut sum = add(ctx, n, x, skip)?;
    let bias_input = if simplified { 3 } else { 4 };
    if let Some(bias) = ctx.opt_input(n, bias_input)? {
        sum = add(ctx, n, sum, bias)?;
    }
    if ctx.b.shape(sum) != ctx.b.shape(x) {
        return Err(n.err("skip (and bias) must broadcast to the input's shape"));
    }
    let eps = n.float("epsilon", 1e-12)? as f64;
    let gamma = param(ctx, n, 2, &hidden, dtype)?;
    let y = if simplified {
        ctx.b.op(
            Op::RmsNorm {
                axis: rank - 1,
                eps,
                has_weight: true,
            },
            &[sum, gamma],
        )?
    } else {
        let mut inputs = vec![sum, gamma];
        let has_bias = n.input(3).is_some();
        if has_bias {
            inputs.push(param(ctx, n, 3, &hidden, dtype)?);
        }
        ctx.b.op(
            Op::LayerNorm {
                axis: rank - 1,
                eps,
                has_weight: true,
                has_bias,
            },
            &inputs,
        )?
    };
    // Outputs 1 and 2 are refused above when requested; nothing reads these fillers.
    Ok(vec![Val::of(y), Val::of(y), Val::of(y), Val::of(sum)])
}

/// EmbedLayerNormalization (BERT's embeddings, fused): word, position and (optional)
/// segment embeddings summed and layer-normalized. Outputs the normalized sum, the
/// `mask_index` (per sequence, how many mask elements are exactly 1; zeros without a mask)
/// and the sum itself.
fn embed_layer_norm(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    embeddings_normalized(ctx, n, false)
}

/// QEmbedLayerNormalization (the same, from `quantize_dynamic`): the embedding tables,
/// gamma and beta are 8-bit, each with its scale (input `k + 6`) and zero point (input
/// `k + 11`); rows are dequantized after they are looked up.
fn q_embed_layer_norm(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    embeddings_normalized(ctx, n, true)
}

/// `(q − zero) · scale` for the 8-bit input `k` (or its looked-up rows `q`), with the scale
/// and zero point at inputs `k + 6` and `k + 11`.
fn dequantized(ctx: &mut Ctx, n: &Node, k: usize, q: ValueId) -> Result<ValueId> {
    let scale = float_input(ctx, n, k + 6)?;
    let zero = ctx.input(n, k + 11)?;
    super::quant::dequantize_with(ctx, q, scale, Some(zero))
}

fn embeddings_normalized(ctx: &mut Ctx, n: &Node, quantized: bool) -> Result<Vec<Val>> {
    let ids = ctx.input(n, 0)?;
    let is = ctx.b.shape(ids);
    if is.len() != 2 || !ctx.b.dtype(ids).is_int() {
        return Err(n.err("input_ids must be a [B, S] integer tensor"));
    }
    // The float type: the word table's, or its scale's when quantized.
    let typed = float_input(ctx, n, if quantized { 8 } else { 2 })?;
    let dtype = ctx.b.dtype(typed);
    let table = |ctx: &mut Ctx, k: usize| -> Result<ValueId> {
        let t = ctx.input(n, k)?;
        let is_8bit = matches!(ctx.b.dtype(t), DType::U8 | DType::I8);
        if ctx.b.rank(t) != 2 || (quantized != is_8bit) || (!quantized && ctx.b.dtype(t) != dtype) {
            let kind = if quantized {
                "8-bit".to_string()
            } else {
                dtype.to_string()
            };
            return Err(n.err(format!("input {k} must be a 2-D {kind} embedding table")));
        }
        Ok(t)
    };
    let rows = |ctx: &mut Ctx, k: usize, idx: ValueId| -> Result<ValueId> {
        let t = table(ctx, k)?;
        let r = ctx.b.op(Op::IndexSelect { axis: 0 }, &[t, idx])?;
        match quantized {
            true => dequantized(ctx, n, k, r),
            false => Ok(r),
        }
    };
    let mut sum = rows(ctx, 2, ids)?;
    let given_positions = match quantized {
        true => None,
        false => ctx.opt_input(n, 8)?,
    };
    let positions = match given_positions {
        Some(p) => p,
        None => {
            let steps = super::creation::iota(
                ctx,
                Scalar::Int(0),
                Scalar::Int(1),
                DType::I64,
                is[1].clone(),
            )?;
            ctx.b.reshape(steps, vec![Dim::Const(1), is[1].clone()])?
        }
    };
    let by_position = rows(ctx, 3, positions)?;
    sum = add(ctx, n, sum, by_position)?;
    if let (Some(segments), Some(_)) = (ctx.opt_input(n, 1)?, n.input(4)) {
        let by_segment = rows(ctx, 4, segments)?;
        sum = add(ctx, n, sum, by_segment)?;
    }
    let hidden = ctx.b.shape(sum)[2].clone();
    let norm_param = |ctx: &mut Ctx, k: usize| -> Result<ValueId> {
        match quantized {
            true => {
                let q = ctx.input(n, k)?;
                let p = dequantized(ctx, n, k, q)?;
                ctx.b.broadcast_to(p, std::slice::from_ref(&hidden))
            }
            false => param(ctx, n, k, &hidden, dtype),
        }
    };
    let mut inputs = vec![sum, norm_param(ctx, 5)?];
    let has_bias = n.input(6).is_some();
    if has_bias {
        inputs.push(norm_param(ctx, 6)?);
    }
    let y = ctx.b.op(
        Op::LayerNorm {
            axis: 2,
            eps: n.float("epsilon", 1e-12)? as f64,
            has_weight: true,
            has_bias,
        },
        &inputs,
    )?;
    let mask_index = match ctx.opt_input(n, 7)? {
        Some(mask) => {
            let ones = ctx.b.binary(
                BinaryOp::Eq,
                Operand::Tensor(mask),
                Operand::Scalar(Scalar::Int(1)),
            )?;
            let ones = ctx.b.cast(ones, DType::I32)?;
            ctx.b.op(
                Op::Reduce {
                    op: crate::ir::ReduceOp::Sum,
                    axes: vec![1],
                    keepdim: false,
                },
                &[ones],
            )?
        }
        None => ctx
            .b
            .full(Scalar::Int(0), DType::I32, vec![is[0].clone()])?,
    };
    Ok(vec![Val::of(y), Val::of(mask_index), Val::of(sum)])
}
