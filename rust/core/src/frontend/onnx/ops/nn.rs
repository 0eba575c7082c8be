//! Neural-network ops: Softmax/LogSoftmax, the normalizations (Layer, RMS, Group, Batch,
//! Instance), activations with parameters (LeakyRelu, HardSigmoid, HardSwish, Gelu, Swish, Elu,
//! Selu, PRelu, Clip) and global pooling as reductions.

use super::{axis, bin, one, scalar, Handler};
use crate::dim::Dim;
use crate::dtype::DType;
use crate::error::Result;
use crate::frontend::builder::Operand;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, Op, ReduceOp, UnaryOp, ValueId};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "Softmax" | "LogSoftmax" => softmax,
        "LayerNormalization" => layer_norm,
        // ONNX Runtime's own SimplifiedLayerNormalization (registered in the ai.onnx domain,
        // written by its transformer optimizer) is the same normalization.
        "RMSNormalization" | "SimplifiedLayerNormalization" => rms_norm,
        "GroupNormalization" => group_norm,
        "BatchNormalization" => batch_norm,
        "InstanceNormalization" => instance_norm,
        "LeakyRelu" | "Elu" | "Selu" | "PRelu" => leaky,
        "HardSigmoid" | "HardSwish" => hard_sigmoid,
        "Gelu" => gelu,
        "Swish" => swish,
        "Clip" => clip,
        "GlobalAveragePool" | "GlobalMaxPool" => global_pool,
        _ => return None,
    })
}

fn float_input(ctx: &mut Ctx, n: &Node, k: usize) -> Result<ValueId> {
    let x = ctx.input(n, k)?;
    if !ctx.b.dtype(x).is_float() {
        return Err(n.err(format!(
            "input {k} must be a float tensor, got {}",
            ctx.b.dtype(x)
        )));
    }
    Ok(x)
}

fn softmax(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = float_input(ctx, n, 0)?;
    let a = axis(ctx, n.int("axis", -1)?, ctx.b.rank(x))?;
    if ctx.b.rank(x) == 0 {
        return Err(n.err("input must have rank ≥ 1"));
    }
    one(ctx.b.op(
        Op::Softmax {
            axis: a,
            log: n.op == "LogSoftmax",
        },
        &[x],
    )?)
}

/// Broadcasts a normalization parameter to `shape` (ONNX allows any broadcastable shape).
fn param(ctx: &mut Ctx, n: &Node, k: usize, shape: &[Dim], dtype: DType) -> Result<ValueId> {
    let p = ctx.input(n, k)?;
    if ctx.b.dtype(p) != dtype {
        return Err(n.err(format!("input {k} is {} but X is {dtype}", ctx.b.dtype(p))));
    }
    ctx.b.broadcast_to(p, shape)
}

fn layer_norm(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    if n.wants_output(1) || n.wants_output(2) {
        return Err(n.unsupported("the Mean and InvStdDev outputs (training only)"));
    }
    let x = float_input(ctx, n, 0)?;
    let dtype = ctx.b.dtype(x);
    let a = axis(ctx, n.int("axis", -1)?, ctx.b.rank(x))?;
    let eps = n.float("epsilon", 1e-5)? as f64;
    let tail = ctx.b.shape(x)[a..].to_vec();
    let mut inputs = vec![x, param(ctx, n, 1, &tail, dtype)?];
    let has_bias = n.input(2).is_some();
    if has_bias {
        inputs.push(param(ctx, n, 2, &tail, dtype)?);
    }
    one(ctx.b.op(
        Op::LayerNorm {
            axis: a,
            eps,
            has_weight: true,
            has_bias,
        },
        &inputs,
    )?)
}

/// Opset 23's RMSNormalization: `x / sqrt(mean(x², axes from axis) + eps) · scale`, the IR's
/// `rms_norm` (which, like `layer_norm` here, computes half-precision inputs in f32 whatever
/// `stash_type` says, and rounds once).
fn rms_norm(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    if n.wants_output(1) {
        return Err(n.unsupported("the inv_std_var output (training only)"));
    }
    let x = float_input(ctx, n, 0)?;
    let dtype = ctx.b.dtype(x);
    let a = axis(ctx, n.int("axis", -1)?, ctx.b.rank(x))?;
    let eps = n.float("epsilon", 1e-5)? as f64;
    let tail = ctx.b.shape(x)[a..].to_vec();
    let scale = param(ctx, n, 1, &tail, dtype)?;
    one(ctx.b.op(
        Op::RmsNorm {
            axis: a,
            eps,
            has_weight: true,
        },
        &[x, scale],
    )?)
}

/// Normalizes `[N, C, …]` over all dims from 2 after reshaping to `[N, groups, …]`.
fn normalize_groups(ctx: &mut Ctx, x: ValueId, groups: Dim, eps: f64) -> Result<ValueId> {
    let shape = ctx.b.shape(x);
    let rest = crate::dim::numel(&shape[1..]);
    let per = Dim::binary(crate::dim::DimOp::FloorDiv, rest, groups.clone());
    let g = ctx.b.reshape(x, vec![shape[0].clone(), groups, per])?;
    let y = ctx.b.op(
        Op::LayerNorm {
            axis: 2,
            eps,
            has_weight: false,
            has_bias: false,
        },
        &[g],
    )?;
    ctx.b.reshape(y, shape)
}

/// A per-channel `[C]` parameter as `[C, 1, …]` for an `[N, C, …]` input.
fn per_channel(ctx: &mut Ctx, p: ValueId, rank: usize) -> Result<ValueId> {
    let mut shape = ctx.b.shape(p);
    shape.extend(vec![Dim::Const(1); rank - 2]);
    ctx.b.reshape(p, shape)
}

fn check_channels(ctx: &Ctx, n: &Node, p: ValueId, c: &Dim, what: &str) -> Result<()> {
    let s = ctx.b.shape(p);
    if s.len() != 1 || s[0].provably_equal(c) == Some(false) {
        return Err(n.err(format!(
            "{what} has shape {} but X has {c} channels",
            crate::dim::format_shape(&s)
        )));
    }
    Ok(())
}

fn group_norm(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = float_input(ctx, n, 0)?;
    let shape = ctx.b.shape(x);
    if shape.len() < 3 {
        return Err(n.err("X must have rank ≥ 3"));
    }
    let groups = n.int("num_groups", 0)?;
    if groups <= 0 {
        return Err(n.err("num_groups must be positive"));
    }
    if let Some(c) = shape[1].as_const() {
        if c % groups != 0 {
            return Err(n.err(format!("{c} channels do not split into {groups} groups")));
        }
    }
    let eps = n.float("epsilon", 1e-5)? as f64;
    let y = normalize_groups(ctx, x, Dim::Const(groups), eps)?;
    let (scale, bias) = (ctx.input(n, 1)?, ctx.input(n, 2)?);
    // Opset 18 had one scale per group; opset 21 made it one per channel.
    let (scale, bias) = if n.opset < 21 {
        let per = Dim::binary(
            crate::dim::DimOp::FloorDiv,
            shape[1].clone(),
            Dim::Const(groups),
        );
        let mut out = Vec::new();
        for p in [scale, bias] {
            check_channels(ctx, n, p, &Dim::Const(groups), "scale/bias")?;
            let p = ctx.b.reshape(p, vec![Dim::Const(groups), Dim::Const(1)])?;
            let p = ctx.b.broadcast_to(p, &[Dim::Const(groups), per.clone()])?;
            out.push(ctx.b.reshape(p, vec![shape[1].clone()])?);
        }
        (out[0], out[1])
    } else {
        check_channels(ctx, n, scale, &shape[1], "scale")?;
        check_channels(ctx, n, bias, &shape[1], "bias")?;
        (scale, bias)
    };
    let scale = per_channel(ctx, scale, shape.len())?;
    let bias = per_channel(ctx, bias, shape.len())?;
    let y = bin(ctx, BinaryOp::Mul, y, scale)?;
    one(bin(ctx, BinaryOp::Add, y, bias)?)
}

fn instance_norm(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = float_input(ctx, n, 0)?;
    let shape = ctx.b.shape(x);
    if shape.len() < 3 {
        return Err(n.err("X must have rank ≥ 3"));
    }
    let eps = n.float("epsilon", 1e-5)? as f64;
    let y = ctx.b.op(
        Op::LayerNorm {
            axis: 2,
            eps,
            has_weight: false,
            has_bias: false,
        },
        &[x],
    )?;
    let (scale, bias) = (ctx.input(n, 1)?, ctx.input(n, 2)?);
    check_channels(ctx, n, scale, &shape[1], "scale")?;
    check_channels(ctx, n, bias, &shape[1], "B")?;
    let scale = per_channel(ctx, scale, shape.len())?;
    let bias = per_channel(ctx, bias, shape.len())?;
    let y = bin(ctx, BinaryOp::Mul, y, scale)?;
    one(bin(ctx, BinaryOp::Add, y, bias)?)
}

/// Inference BatchNormalization: `(x − mean) · scale / sqrt(var + ε) + B` per channel.
fn batch_norm(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    if n.flag("training_mode", false)? || n.wants_output(1) || n.wants_output(2) {
        return Err(n.unsupported("training mode (Ember compiles inference only)"));
    }
    let x = float_input(ctx, n, 0)?;
    let shape = ctx.b.shape(x);
    if shape.len() < 2 {
        return Err(n.err("X must have rank ≥ 2"));
    }
    let dtype = ctx.b.dtype(x);
    let eps = n.float("epsilon", 1e-5)? as f64;
    let mut p = Vec::new();
    for (k, what) in [(1, "scale"), (2, "B"), (3, "mean"), (4, "var")] {
        let v = ctx.input(n, k)?;
        check_channels(ctx, n, v, &shape[1], what)?;
        let v = ctx.b.cast(v, dtype)?;
        p.push(per_channel(ctx, v, shape.len().max(2))?);
    }
    let e = scalar(ctx, eps, dtype)?;
    let var = bin(ctx, BinaryOp::Add, p[3], e)?;
    let std = ctx.b.unary(UnaryOp::Sqrt, var)?;
    let centered = bin(ctx, BinaryOp::Sub, x, p[2])?;
    let normed = bin(ctx, BinaryOp::Div, centered, std)?;
    let scaled = bin(ctx, BinaryOp::Mul, normed, p[0])?;
    one(bin(ctx, BinaryOp::Add, scaled, p[1])?)
}

/// LeakyRelu, PRelu, Elu and Selu: `x` where `x ≥ 0`, a scaled negative branch elsewhere.
fn leaky(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = float_input(ctx, n, 0)?;
    let dtype = ctx.b.dtype(x);
    let zero = scalar(ctx, 0.0, dtype)?;
    let neg = bin(ctx, BinaryOp::Lt, x, zero)?;
    let (pos, negv) = match n.op {
        "LeakyRelu" => {
            let a = scalar(ctx, n.float("alpha", 0.01)? as f64, dtype)?;
            (x, bin(ctx, BinaryOp::Mul, x, a)?)
        }
        "PRelu" => {
            let slope = ctx.input(n, 1)?;
            (x, bin(ctx, BinaryOp::Mul, x, slope)?)
        }
        "Elu" => {
            let a = scalar(ctx, n.float("alpha", 1.0)? as f64, dtype)?;
            let em1 = ctx.b.unary(UnaryOp::Expm1, x)?;
            (x, bin(ctx, BinaryOp::Mul, em1, a)?)
        }
        _ => {
            // Selu: gamma · (x ≥ 0 ? x : alpha · (eˣ − 1)), ONNX's default constants.
            let alpha = n.float("alpha", 1.673_263_2)? as f64;
            let gamma = n.float("gamma", 1.050_701)? as f64;
            let a = scalar(ctx, alpha, dtype)?;
            let g = scalar(ctx, gamma, dtype)?;
            let e = ctx.b.unary(UnaryOp::Exp, x)?;
            let one_ = scalar(ctx, 1.0, dtype)?;
            let em1 = bin(ctx, BinaryOp::Sub, e, one_)?;
            let ae = bin(ctx, BinaryOp::Mul, a, em1)?;
            (
                bin(ctx, BinaryOp::Mul, g, x)?,
                bin(ctx, BinaryOp::Mul, g, ae)?,
            )
        }
    };
    one(ctx
        .b
        .where_(neg, Operand::Tensor(negv), Operand::Tensor(pos))?)
}

/// `max(0, min(1, alpha·x + beta))`; HardSwish is `x · HardSigmoid(x)` with 1/6 and 1/2.
fn hard_sigmoid(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = float_input(ctx, n, 0)?;
    let dtype = ctx.b.dtype(x);
    let (alpha, beta) = if n.op == "HardSwish" {
        (1.0 / 6.0, 0.5)
    } else {
        (n.float("alpha", 0.2)? as f64, n.float("beta", 0.5)? as f64)
    };
    let a = scalar(ctx, alpha, dtype)?;
    let b = scalar(ctx, beta, dtype)?;
    let ax = bin(ctx, BinaryOp::Mul, x, a)?;
    let lin = bin(ctx, BinaryOp::Add, ax, b)?;
    let one_ = scalar(ctx, 1.0, dtype)?;
    let zero = scalar(ctx, 0.0, dtype)?;
    let lo = bin(ctx, BinaryOp::Min, lin, one_)?;
    let hs = bin(ctx, BinaryOp::Max, lo, zero)?;
    if n.op == "HardSwish" {
        return one(bin(ctx, BinaryOp::Mul, x, hs)?);
    }
    one(hs)
}

/// Opset 24's Swish: `x · sigmoid(alpha · x)` (the IR's `silu` when alpha is 1).
fn swish(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = float_input(ctx, n, 0)?;
    let alpha = n.float("alpha", 1.0)? as f64;
    if alpha == 1.0 {
        return one(ctx.b.unary(UnaryOp::Silu, x)?);
    }
    let dtype = ctx.b.dtype(x);
    let a = scalar(ctx, alpha, dtype)?;
    let ax = bin(ctx, BinaryOp::Mul, x, a)?;
    let gate = ctx.b.unary(UnaryOp::Sigmoid, ax)?;
    one(bin(ctx, BinaryOp::Mul, x, gate)?)
}

fn gelu(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = float_input(ctx, n, 0)?;
    let op = match n.string("approximate", "none")?.as_str() {
        "none" => UnaryOp::Gelu,
        "tanh" => UnaryOp::GeluTanh,
        other => return Err(n.err(format!("unknown approximate '{other}'"))),
    };
    one(ctx.b.unary(op, x)?)
}

/// Clip: `min(max(x, lo), hi)`; absent bounds do not clip.
fn clip(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let mut x = ctx.input(n, 0)?;
    for (k, op) in [(1, BinaryOp::Max), (2, BinaryOp::Min)] {
        if let Some(bound) = ctx.opt_input(n, k)? {
            super::elementwise::same_dtype(ctx, n, &[x, bound])?;
            if ctx.b.rank(bound) != 0 {
                return Err(n.err(format!("bound {k} must be a scalar")));
            }
            x = bin(ctx, op, x, bound)?;
        }
    }
    one(x)
}

fn global_pool(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = float_input(ctx, n, 0)?;
    let r = ctx.b.rank(x);
    if r < 3 {
        return Err(n.err("X must have rank ≥ 3 ([N, C, spatial…])"));
    }
    let axes: Vec<usize> = (2..r).collect();
    if n.op == "GlobalAveragePool" {
        return one(ctx.b.mean(x, axes, true)?);
    }
    one(ctx.b.op(
        Op::Reduce {
            op: ReduceOp::Max,
            axes,
            keepdim: true,
        },
        &[x],
    )?)
}
