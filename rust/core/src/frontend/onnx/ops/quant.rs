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
use crate::frontend::onnx::translate::{Ctx, Dequantized, Val};
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
pub(super) fn range(n: &Node, dtype: DType) -> Result<(f64, f64)> {
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
pub(super) fn quantize_with(
    ctx: &mut Ctx,
    n: &Node,
    x: ValueId,
    scale: ValueId,
    zero: Option<ValueId>,
    to: DType,
) -> Result<ValueId> {
    let float = ctx.b.dtype(scale);
    let x = ctx.b.cast(x, float)?;
    let scaled = bin(ctx, BinaryOp::Div, x, scale)?;
    round_into(ctx, n, scaled, zero, to)
}

/// `saturate(round(scaled) + zero_point)` (round half to even, in `scaled`'s float type),
/// cast to the quantized type `to`.
pub(super) fn round_into(
    ctx: &mut Ctx,
    n: &Node,
    scaled: ValueId,
    zero: Option<ValueId>,
    to: DType,
) -> Result<ValueId> {
    let float = ctx.b.dtype(scaled);
    let (lo, hi) = range(n, to)?;
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
    let mut scale = along_axis(ctx, n, scale, x, "y_scale")?;
    // Opset 23: `precision` names the float type `x / y_scale` is computed in (the scale's
    // type when absent).
    if let Some(code) = n
        .has_attr("precision")
        .then(|| n.int("precision", 0))
        .transpose()?
    {
        let float = match code {
            0 => ctx.b.dtype(scale),
            c => dtype_from_onnx(i32::try_from(c).unwrap_or(0), &n.name)?,
        };
        if !float.is_float() {
            return Err(n.err(format!("precision must be a float type, got {float}")));
        }
        scale = ctx.b.cast(scale, float)?;
    }
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
    let mut zero = None;
    if let Some(z) = ctx.opt_input(n, 2)? {
        if ctx.b.dtype(z) != ctx.b.dtype(x) {
            return Err(n.err("x_zero_point must have x's type"));
        }
        zero = Some(along_axis(ctx, n, z, x, "x_zero_point")?);
    }
    let y = dequantize_with(ctx, x, scale, zero)?;
    // Opset 23: `output_dtype` (the scale's type when absent) is what the result is cast to.
    let to = match n.int("output_dtype", 0)? {
        0 => float,
        c => dtype_from_onnx(i32::try_from(c).unwrap_or(0), &n.name)?,
    };
    if !to.is_float() {
        return Err(n.err(format!("output_dtype must be a float type, got {to}")));
    }
    if to != float {
        return one(ctx.b.cast(y, to)?);
    }
    if matches!(ctx.b.dtype(x), DType::U8 | DType::I8) {
        let d = Dequantized { q: x, scale, zero };
        ctx.dequantized.insert(y, d);
    }
    one(y)
}

/// `(q - zero_point) · scale` in the scale's float type.
pub(super) fn dequantize_with(
    ctx: &mut Ctx,
    q: ValueId,
    scale: ValueId,
    zero: Option<ValueId>,
) -> Result<ValueId> {
    let float = ctx.b.dtype(scale);
    let mut v = ctx.b.cast(q, float)?;
    if let Some(z) = zero {
        let z = ctx.b.cast(z, float)?;
        v = bin(ctx, BinaryOp::Sub, v, z)?;
    }
    bin(ctx, BinaryOp::Mul, v, scale)
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
fn matmul_integer(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let (a, b) = (ctx.input(n, 0)?, ctx.input(n, 1)?);
    let mut zeros = [None, None];
    for (i, zi) in [(0, 2), (1, 3)] {
        let v = ctx.input(n, i)?;
        let dtype = ctx.b.dtype(v);
        range(n, dtype)?;
        let Some(z) = ctx.opt_input(n, zi)? else {
            continue;
        };
        if ctx.b.dtype(z) != dtype {
            return Err(n.err(format!("zero point {zi} must have input {i}'s type")));
        }
        zeros[i] = Some(match (i, ctx.b.shape(z).len()) {
            (_, 0) => z,
            // A's zero point per row: a column vector; B's per column: a row.
            (0, 1) => {
                let len = ctx.b.shape(z)[0].clone();
                ctx.b.reshape(z, vec![len, Dim::Const(1)])?
            }
            (_, 1) => z,
            _ => return Err(n.err(format!("zero point {zi} must be a scalar or 1-d"))),
        });
    }
    one(integer_product(ctx, a, b, zeros[0], zeros[1])?)
}

/// `(A - za) · (B - zb)` in int32, numpy matmul shapes, for 8-bit A and B and zero points
/// that broadcast against them (`za` constant along A's last axis, `zb` along B's second
/// last). The 8-bit integers themselves go to `IntegerDot` (the integer kernels); the zero
/// points become corrections by sums, exactly: `(A - za)(B - zb) = A·B - rowsum(A)·zb -
/// za·colsum(B - zb)`, where a weight's column sums are computed once, at compile time.
pub(super) fn integer_product(
    ctx: &mut Ctx,
    a: ValueId,
    b: ValueId,
    za: Option<ValueId>,
    zb: Option<ValueId>,
) -> Result<ValueId> {
    // Vectors become matrices here, so the sums below keep their axes; the added axes
    // are dropped at the end.
    let (a_vec, b_vec) = (ctx.b.rank(a) == 1, ctx.b.rank(b) == 1);
    let a = match a_vec {
        true => {
            let k = ctx.b.shape(a)[0].clone();
            ctx.b.reshape(a, vec![Dim::Const(1), k])?
        }
        false => a,
    };
    let b = match b_vec {
        true => {
            let k = ctx.b.shape(b)[0].clone();
            ctx.b.reshape(b, vec![k, Dim::Const(1)])?
        }
        false => b,
    };
    // A zero point of zeros (symmetric int8 weights) needs no correction.
    let (za, zb) = (
        za.filter(|&z| !is_zeros(ctx, z)),
        zb.filter(|&z| !is_zeros(ctx, z)),
    );
    let mut y = ctx.b.integer_matmul(a, b)?;
    let sum = |ctx: &mut Ctx, v: ValueId, axis: usize| {
        ctx.b.op(
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![axis],
                keepdim: true,
            },
            &[v],
        )
    };
    if let Some(zb) = zb {
        let zb = ctx.b.cast(zb, DType::I32)?;
        let a32 = ctx.b.cast(a, DType::I32)?;
        let rows = sum(ctx, a32, ctx.b.rank(a) - 1)?;
        let term = bin(ctx, BinaryOp::Mul, rows, zb)?;
        y = bin(ctx, BinaryOp::Sub, y, term)?;
    }
    if let Some(za) = za {
        let za = ctx.b.cast(za, DType::I32)?;
        let mut b32 = ctx.b.cast(b, DType::I32)?;
        if let Some(zb) = zb {
            let zb = ctx.b.cast(zb, DType::I32)?;
            b32 = bin(ctx, BinaryOp::Sub, b32, zb)?;
        }
        let cols = sum(ctx, b32, ctx.b.rank(b) - 2)?;
        let term = bin(ctx, BinaryOp::Mul, za, cols)?;
        y = bin(ctx, BinaryOp::Sub, y, term)?;
    }
    let mut shape = ctx.b.shape(y);
    if b_vec {
        shape.pop();
    }
    if a_vec {
        let r = shape.len();
        shape.remove(r - if b_vec { 1 } else { 2 });
    }
    if a_vec || b_vec {
        y = ctx.b.reshape(y, shape)?;
    }
    Ok(y)
}

/// Whether `v` is a constant of zeros (through reshapes and expands).
fn is_zeros(ctx: &Ctx, mut v: ValueId) -> bool {
    loop {
        let node = &ctx.b.g.nodes[v];
        match &node.op {
            Op::Constant(data) => return data.bytes.iter().all(|&b| b == 0),
            Op::Full { value } => return value.as_f64() == 0.0,
            Op::Reshape { .. } | Op::Expand { .. } => v = node.inputs[0],
            _ => return false,
        }
    }
}

/// The float product `a · b` of two dequantized values computed on their integers, where
/// the scales factor out of the sum: a per-tensor scale and zero point for `a`, per tensor
/// or per column for a 2-D `b`. `sa·(qa - za) · sb·(qb - zb) = sa·sb · (qa - za)·(qb - zb)`,
/// the integer product exact where the float one rounds at every step (what ONNX Runtime
/// does for QDQ models too). `None` where `a` or `b` does not qualify: the float product
/// then runs as written.
pub(super) fn dequantized_product(
    ctx: &mut Ctx,
    a: ValueId,
    b: ValueId,
) -> Result<Option<ValueId>> {
    let (Some(&da), Some(&db)) = (ctx.dequantized.get(&a), ctx.dequantized.get(&b)) else {
        return Ok(None);
    };
    if ctx.b.rank(b) != 2 || ctx.b.rank(a) < 2 {
        return Ok(None);
    }
    let per_tensor = |ctx: &Ctx, v: Option<ValueId>| v.is_none_or(|v| ctx.b.rank(v) == 0);
    // B's parameters: 0-d, or a row of its columns (axis 1 gives `[N]`).
    let n = ctx.b.shape(b)[1].clone();
    let per_column = |ctx: &Ctx, v: Option<ValueId>| {
        v.is_none_or(|v| {
            let s = ctx.b.shape(v);
            s.is_empty() || (s.len() == 1 && s[0] == n)
        })
    };
    let float = ctx.b.dtype(a);
    if !per_tensor(ctx, Some(da.scale))
        || !per_tensor(ctx, da.zero)
        || !per_column(ctx, Some(db.scale))
        || !per_column(ctx, db.zero)
        || ctx.b.dtype(b) != float
    {
        return Ok(None);
    }
    let product = integer_product(ctx, da.q, db.q, da.zero, db.zero)?;
    let product = ctx.b.cast(product, float)?;
    let scale = bin(ctx, BinaryOp::Mul, da.scale, db.scale)?;
    Ok(Some(bin(ctx, BinaryOp::Mul, product, scale)?))
}

/// Records `t`, the transpose of the 2-D value `v`, as dequantized when `v` is (Gemm's
/// `transA` / `transB`), its parameters transposed along: a column `[R, 1]` becomes a row
/// `[R]` and a row `[C]` a column `[C, 1]`.
pub(super) fn note_transpose(ctx: &mut Ctx, v: ValueId, t: ValueId) -> Result<()> {
    let Some(&d) = ctx.dequantized.get(&v) else {
        return Ok(());
    };
    let flip = |ctx: &mut Ctx, p: ValueId| -> Result<ValueId> {
        let s = ctx.b.shape(p);
        match s.len() {
            1 => ctx.b.reshape(p, vec![s[0].clone(), Dim::Const(1)]),
            2 if s[1] == Dim::Const(1) => ctx.b.reshape(p, vec![s[0].clone()]),
            _ => Ok(p),
        }
    };
    let q = ctx.b.permute(d.q, vec![1, 0])?;
    let scale = flip(ctx, d.scale)?;
    let zero = d.zero.map(|z| flip(ctx, z)).transpose()?;
    ctx.dequantized.insert(t, Dequantized { q, scale, zero });
    Ok(())
}
