//! Quantization ops, as ONNX Runtime's quantization tools write them: QDQ models
//! (`QuantizeLinear` / `DequantizeLinear` pairs around float ops, from `quantize_static`)
//! and dynamically quantized products (`DynamicQuantizeLinear → MatMulInteger`, from
//! `quantize_dynamic`). They are translated into the IR's float and integer ops with ONNX's
//! exact semantics: scaling and rounding in the scale's float type (round half to even,
//! then saturate to the integer range), integer products as exact as int32 accumulation.
//! Per-tensor and per-axis scales are supported; blocked scales (opset 21 `block_size`) are
//! not.

use super::{axis, bin, one, scalar, Handler};
use crate::dim::Dim;
use crate::dtype::{DType, Scalar};
use crate::error::Result;
use crate::frontend::builder::Operand;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::tensor::dtype_from_onnx;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, Op, ReduceOp, UnaryOp, ValueId};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "QuantizeLinear" => quantize,
        "DequantizeLinear" => dequantize,
        "DynamicQuantizeLinear" => dynamic_quantize,
        "MatMulInteger" => matmul_integer,
        _ => return None,
    })
}

/// The range of an 8-bit quantized type.
fn range(n: &Node, dtype: DType) -> Result<(f64, f64)> {
    match dtype {
        DType::U8 => Ok((0.0, 255.0)),
        DType::I8 => Ok((-128.0, 127.0)),
        other => Err(n.unsupported(format!("quantized type {other} (uint8 and int8 are)"))),
    }
}

fn reject_blocks(n: &Node) -> Result<()> {
    if n.int("block_size", 0)? != 0 {
        return Err(n.unsupported("blocked quantization (block_size > 0)"));
    }
    Ok(())
}

/// `p` (a scale or zero point of `x`) shaped to broadcast against `x`: a scalar (or one
/// element) as is, a 1-d tensor along `axis` of `x`.
fn along_axis(ctx: &mut Ctx, n: &Node, p: ValueId, x: ValueId, what: &str) -> Result<ValueId> {
    let shape = ctx.b.shape(p);
    let rank = ctx.b.rank(x);
    match shape.len() {
        0 => Ok(p),
        1 if shape[0] == Dim::Const(1) => ctx.b.reshape(p, vec![]),
        1 => {
            let a = axis(ctx, n.int("axis", 1)?, rank)?;
            if ctx.b.shape(x)[a] != shape[0] {
                return Err(n.err(format!(
                    "{what} has {} elements but axis {a} of the input has {}",
                    shape[0],
                    ctx.b.shape(x)[a]
                )));
            }
            let mut to = vec![Dim::Const(1); rank - a];
            to[0] = shape[0].clone();
            ctx.b.reshape(p, to)
        }
        _ => Err(n.err(format!("{what} must be a scalar or 1-d (per axis)"))),
    }
}

/// `saturate(round(x / scale) + zero_point)` in the scale's float type, then cast to the
/// quantized type (whose integers that type holds exactly).
fn quantize_with(
    ctx: &mut Ctx,
    n: &Node,
    x: ValueId,
    scale: ValueId,
    zero: Option<ValueId>,
    to: DType,
) -> Result<ValueId> {
    let float = ctx.b.dtype(scale);
    let (lo, hi) = range(n, to)?;
    let x = ctx.b.cast(x, float)?;
    let scaled = bin(ctx, BinaryOp::Div, x, scale)?;
    let mut q = ctx.b.unary(UnaryOp::Round, scaled)?;
    if let Some(z) = zero {
        let z = ctx.b.cast(z, float)?;
        q = bin(ctx, BinaryOp::Add, q, z)?;
    }
    let (lo, hi) = (scalar(ctx, lo, float)?, scalar(ctx, hi, float)?);
    let q = bin(ctx, BinaryOp::Max, q, lo)?;
    let q = bin(ctx, BinaryOp::Min, q, hi)?;
    ctx.b.cast(q, to)
}

fn quantize(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    reject_blocks(n)?;
    let x = ctx.input(n, 0)?;
    let scale = ctx.input(n, 1)?;
    if !ctx.b.dtype(x).is_float() || !ctx.b.dtype(scale).is_float() {
        return Err(n.err("x and y_scale must be float tensors"));
    }
    let zero = ctx.opt_input(n, 2)?;
    let to = match (zero, n.int("output_dtype", 0)?) {
        (Some(z), _) => ctx.b.dtype(z),
        (None, 0) => DType::U8,
        (None, code) => dtype_from_onnx(i32::try_from(code).unwrap_or(0), &n.name)?,
    };
    let scale = along_axis(ctx, n, scale, x, "y_scale")?;
    let zero = zero
        .map(|z| along_axis(ctx, n, z, x, "y_zero_point"))
        .transpose()?;
    one(quantize_with(ctx, n, x, scale, zero, to)?)
}

fn dequantize(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    reject_blocks(n)?;
    let x = ctx.input(n, 0)?;
    let scale = ctx.input(n, 1)?;
    let float = ctx.b.dtype(scale);
    if !float.is_float() {
        return Err(n.err("x_scale must be a float tensor"));
    }
    match ctx.b.dtype(x) {
        DType::U8 | DType::I8 | DType::I32 => {}
        other => return Err(n.unsupported(format!("dequantizing {other}"))),
    }
    let scale = along_axis(ctx, n, scale, x, "x_scale")?;
    let mut v = ctx.b.cast(x, float)?;
    if let Some(z) = ctx.opt_input(n, 2)? {
        if ctx.b.dtype(z) != ctx.b.dtype(x) {
            return Err(n.err("x_zero_point must have x's type"));
        }
        let z = along_axis(ctx, n, z, x, "x_zero_point")?;
        let z = ctx.b.cast(z, float)?;
        v = bin(ctx, BinaryOp::Sub, v, z)?;
    }
    one(bin(ctx, BinaryOp::Mul, v, scale)?)
}

/// uint8 quantization of x over its own range (widened to include 0): `y_scale = (max(x, 0)
/// - min(x, 0)) / 255`, `y_zero_point = saturate(round(-min(x, 0) / y_scale))`.
fn dynamic_quantize(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    if ctx.b.dtype(x) != DType::F32 {
        return Err(n.err("x must be float32"));
    }
    let axes: Vec<usize> = (0..ctx.b.rank(x)).collect();
    let reduce = |ctx: &mut Ctx, op: ReduceOp| {
        ctx.b.op(
            Op::Reduce {
                op,
                axes: axes.clone(),
                keepdim: false,
            },
            &[x],
        )
    };
    let zero = scalar(ctx, 0.0, DType::F32)?;
    let hi = reduce(ctx, ReduceOp::Max)?;
    let hi = bin(ctx, BinaryOp::Max, hi, zero)?;
    let lo = reduce(ctx, ReduceOp::Min)?;
    let lo = bin(ctx, BinaryOp::Min, lo, zero)?;
    let span = bin(ctx, BinaryOp::Sub, hi, lo)?;
    let levels = scalar(ctx, 255.0, DType::F32)?;
    let scale = bin(ctx, BinaryOp::Div, span, levels)?;
    // x all zero: scale 0 would divide by zero; ORT then quantizes to zero point 0 with a
    // zero scale, which x / 1 (x is 0) gives as well.
    let is_zero = ctx.b.binary(
        BinaryOp::Eq,
        Operand::Tensor(scale),
        Operand::Scalar(Scalar::Float(0.0)),
    )?;
    let one_f = scalar(ctx, 1.0, DType::F32)?;
    let safe = ctx
        .b
        .where_(is_zero, Operand::Tensor(one_f), Operand::Tensor(scale))?;
    let neg_lo = ctx.b.unary(UnaryOp::Neg, lo)?;
    let zp = quantize_with(ctx, n, neg_lo, safe, None, DType::U8)?;
    let y = quantize_with(ctx, n, x, safe, Some(zp), DType::U8)?;
    Ok(vec![Val::of(y), Val::of(scale), Val::of(zp)])
}

/// `(A - a_zero_point) · (B - b_zero_point)` accumulated in int32 (numpy matmul shapes); a
/// zero point is a scalar, or per row of A / per column of B.
///
/// The product runs in f32 GEMMs, an order of magnitude faster than an integer loop, where
/// it is exact: each operand is an integer of at most 255 in magnitude, so over at most 256
/// steps of k every product and partial sum is an integer below 2²⁴, whatever the order of
/// the additions. A longer k is cut into chunks of at most 256 (a divisor of k) whose
/// products are summed in int32; where k has no such divisor (or is symbolic, or B is
/// batched) the product runs in f64, exact for any k.
fn matmul_integer(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let (a, b) = (ctx.input(n, 0)?, ctx.input(n, 1)?);
    let k = ctx.b.shape(a).last().and_then(Dim::as_const);
    let chunk = match k {
        Some(k) if k <= 256 => Some(k),
        Some(k) if ctx.b.rank(a) >= 2 && ctx.b.rank(b) == 2 => {
            (32..=256).rev().find(|s| k % s == 0)
        }
        _ => None,
    };
    let float = if chunk.is_some() {
        DType::F32
    } else {
        DType::F64
    };
    let mut ops = Vec::with_capacity(2);
    for (i, zi) in [(0, 2), (1, 3)] {
        let v = ctx.input(n, i)?;
        let dtype = ctx.b.dtype(v);
        range(n, dtype)?;
        let mut v = ctx.b.cast(v, float)?;
        if let Some(z) = ctx.opt_input(n, zi)? {
            if ctx.b.dtype(z) != dtype {
                return Err(n.err(format!("zero point {zi} must have input {i}'s type")));
            }
            let z = ctx.b.cast(z, float)?;
            // A's zero point per row: a column vector; B's per column: a row.
            let z = match (i, ctx.b.shape(z).len()) {
                (_, 0) => z,
                (0, 1) => {
                    let len = ctx.b.shape(z)[0].clone();
                    ctx.b.reshape(z, vec![len, Dim::Const(1)])?
                }
                (_, 1) => z,
                _ => return Err(n.err(format!("zero point {zi} must be a scalar or 1-d"))),
            };
            v = bin(ctx, BinaryOp::Sub, v, z)?;
        }
        ops.push(v);
    }
    let (a, b) = (ops[0], ops[1]);
    let (Some(k), Some(size)) = (k, chunk.filter(|&s| Some(s) != k)) else {
        // One product: k ≤ 256 in f32, or any k in f64.
        let product = ctx.b.matmul(a, b)?;
        return one(ctx.b.cast(product, DType::I32)?);
    };
    // [.., M, K] → [.., C, M, S] and [K, N] → [C, S, N]: C products of S steps each.
    let count = k / size;
    let (c, s) = (Dim::Const(count), Dim::Const(size));
    let mut shape = ctx.b.shape(a);
    let r = shape.len();
    shape.splice(r - 1.., [c.clone(), s.clone()]);
    let a = ctx.b.reshape(a, shape)?;
    let mut perm: Vec<usize> = (0..=r).collect();
    perm.swap(r - 2, r - 1);
    let a = ctx.b.permute(a, perm)?;
    let nn = ctx.b.shape(b)[1].clone();
    let b = ctx.b.reshape(b, vec![c, s, nn])?;
    let parts = ctx.b.matmul(a, b)?;
    let parts = ctx.b.cast(parts, DType::I32)?;
    one(ctx.b.op(
        Op::Reduce {
            op: ReduceOp::Sum,
            axes: vec![r - 2],
            keepdim: false,
        },
        &[parts],
    )?)
}
