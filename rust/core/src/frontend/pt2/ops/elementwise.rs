//! Elementwise ATen ops: arithmetic with torch's type promotion, comparisons, logical ops,
//! math functions, `where`, `clamp`, `masked_fill`, casts.

use super::{operand, tensor, Handler};
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::builder::Operand;
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, UnaryOp, ValueId};

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    if unary_op(name).is_some() {
        return Some(unary);
    }
    Some(match (name, overload) {
        ("gelu", _) => gelu,
        ("add" | "sub", "Tensor" | "Scalar") => add_sub,
        ("mul", "Tensor" | "Scalar") => |c, n| arith(c, n, BinaryOp::Mul),
        ("div", "Tensor" | "Scalar") => true_div,
        ("div", "Tensor_mode" | "Scalar_mode") => div_mode,
        ("floor_divide", _) => |c, n| arith(c, n, BinaryOp::FloorDiv),
        ("remainder", "Tensor" | "Scalar" | "Scalar_Tensor") => |c, n| arith(c, n, BinaryOp::Rem),
        ("fmod", "Tensor" | "Scalar") => |c, n| arith(c, n, BinaryOp::Fmod),
        ("maximum", _) => |c, n| arith(c, n, BinaryOp::Max),
        ("minimum", _) => |c, n| arith(c, n, BinaryOp::Min),
        ("atan2", _) => atan2,
        ("pow", "Tensor_Tensor" | "Tensor_Scalar" | "Scalar") => pow,
        ("eq", _) => |c, n| compare(c, n, BinaryOp::Eq),
        ("ne", _) => |c, n| compare(c, n, BinaryOp::Ne),
        ("lt", _) => |c, n| compare(c, n, BinaryOp::Lt),
        ("le", _) => |c, n| compare(c, n, BinaryOp::Le),
        ("gt", _) => |c, n| compare(c, n, BinaryOp::Gt),
        ("ge", _) => |c, n| compare(c, n, BinaryOp::Ge),
        ("logical_and", _) => |c, n| logical(c, n, BinaryOp::And),
        ("logical_or", _) => |c, n| logical(c, n, BinaryOp::Or),
        ("logical_xor", _) => |c, n| logical(c, n, BinaryOp::Xor),
        ("bitwise_and", "Tensor" | "Scalar") => |c, n| bitwise(c, n, BinaryOp::And),
        ("bitwise_or", "Tensor" | "Scalar") => |c, n| bitwise(c, n, BinaryOp::Or),
        ("bitwise_xor", "Tensor" | "Scalar") => |c, n| bitwise(c, n, BinaryOp::Xor),
        ("where", "self" | "ScalarSelf" | "ScalarOther" | "Scalar") => where_,
        ("clamp" | "clip", "default" | "Tensor") => clamp,
        ("clamp_min", _) => clamp,
        ("clamp_max", _) => clamp,
        ("hardtanh", "default") => clamp,
        ("masked_fill", "Scalar" | "Tensor") => masked_fill,
        ("_to_copy" | "to", _) => to_copy,
        ("type_as", "default") => type_as,
        ("copy", "default") => copy,
        ("clone" | "alias" | "detach" | "lift_fresh_copy" | "contiguous", _) => identity,
        ("dropout", "default") => identity,
        ("leaky_relu", "default") => leaky_relu,
        ("elu", "default") => elu,
        _ => return None,
    })
}

/// torch name → IR unary op, and whether integer inputs are promoted to float first.
fn unary_op(name: &str) -> Option<(UnaryOp, bool)> {
    use UnaryOp::*;
    Some(match name {
        // `_neg_view` is a lazily negated view (the imaginary part of a conjugate).
        "neg" | "_neg_view" => (Neg, false),
        "abs" => (Abs, false),
        "sign" => (Sign, false),
        "floor" => (Floor, false),
        "ceil" => (Ceil, false),
        "round" => (Round, false),
        "trunc" | "fix" => (Trunc, false),
        "relu" => (Relu, false),
        "logical_not" => (Not, false),
        "bitwise_not" => (BitNot, false),
        "isnan" => (IsNan, false),
        "isinf" => (IsInf, false),
        "exp" => (Exp, true),
        "expm1" => (Expm1, true),
        "log" => (Log, true),
        "log1p" => (Log1p, true),
        "sqrt" => (Sqrt, true),
        "rsqrt" => (Rsqrt, true),
        "reciprocal" => (Recip, true),
        "sin" => (Sin, true),
        "cos" => (Cos, true),
        "tan" => (Tan, true),
        "tanh" => (Tanh, true),
        "sigmoid" => (Sigmoid, true),
        "erf" => (Erf, true),
        "silu" => (Silu, true),
        _ => return None,
    })
}

fn unary(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let name = n.target.trim_start_matches("torch.ops.aten.");
    let name = name.split('.').next().unwrap_or(name);
    let (op, promote) = unary_op(name).ok_or_else(|| Error::unsupported(name, &n.name))?;
    if name == "round" && n.opt_int("decimals", 1)?.unwrap_or(0) != 0 {
        return Err(Error::unsupported_because(
            "aten.round.decimals",
            &n.name,
            "decimals != 0",
        ));
    }
    let mut x = tensor(ctx, n, "self", 0)?;
    let dtype = ctx.b.dtype(x);
    if promote && !dtype.is_float() {
        x = ctx.b.cast(x, DType::F32)?;
    }
    if dtype.is_int()
        && matches!(
            op,
            UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round | UnaryOp::Trunc
        )
    {
        return Ok(Out::Value(x));
    }
    Ok(Out::Value(ctx.b.unary(op, x)?))
}

fn gelu(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let op = match n.string("approximate", 1)? {
        None | Some("none") => UnaryOp::Gelu,
        Some("tanh") => UnaryOp::GeluTanh,
        Some(other) => {
            return Err(Error::unsupported_because(
                "aten.gelu",
                &n.name,
                format!("approximate='{other}'"),
            ))
        }
    };
    Ok(Out::Value(ctx.b.unary(op, x)?))
}

fn add_sub(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let is_sub = n.target.contains(".sub.");
    let a = operand(ctx, n, "self", 0)?;
    let mut b = operand(ctx, n, "other", 1)?;
    let dtype = ctx.b.result_type(&[a, b]);
    if let Some(alpha) = n.scalar("alpha", 2)? {
        if alpha.as_f64() != 1.0 {
            let scaled = ctx
                .b
                .binary_in(BinaryOp::Mul, b, Operand::Scalar(alpha), dtype)?;
            b = Operand::Tensor(scaled);
        }
    }
    let op = match (is_sub, dtype) {
        (false, DType::Bool) => BinaryOp::Or,
        (false, _) => BinaryOp::Add,
        (true, DType::Bool) => {
            return Err(Error::unsupported_because(
                "aten.sub",
                &n.name,
                "subtraction of bool tensors",
            ))
        }
        (true, _) => BinaryOp::Sub,
    };
    Ok(Out::Value(ctx.b.binary_in(op, a, b, dtype)?))
}

fn arith(ctx: &mut Ctx, n: &NodeArgs, op: BinaryOp) -> Result<Out> {
    let a = operand(ctx, n, "self", 0)?;
    let b = operand(ctx, n, "other", 1)?;
    let dtype = ctx.b.result_type(&[a, b]);
    let op = match (op, dtype) {
        (BinaryOp::Mul, DType::Bool) => BinaryOp::And,
        (op, _) => op,
    };
    Ok(Out::Value(ctx.b.binary_in(op, a, b, dtype)?))
}

fn true_div(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let a = operand(ctx, n, "self", 0)?;
    let b = operand(ctx, n, "other", 1)?;
    let mut dtype = ctx.b.result_type(&[a, b]);
    if !dtype.is_float() {
        dtype = DType::F32;
    }
    Ok(Out::Value(ctx.b.binary_in(BinaryOp::Div, a, b, dtype)?))
}

fn div_mode(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    match n.string("rounding_mode", 2)? {
        None => true_div(ctx, n),
        Some("floor") => arith(ctx, n, BinaryOp::FloorDiv),
        Some("trunc") => {
            let a = operand(ctx, n, "self", 0)?;
            let b = operand(ctx, n, "other", 1)?;
            let dtype = ctx.b.result_type(&[a, b]);
            let q = ctx.b.binary_in(BinaryOp::Div, a, b, dtype)?;
            if dtype.is_float() {
                Ok(Out::Value(ctx.b.unary(UnaryOp::Trunc, q)?))
            } else {
                Ok(Out::Value(q))
            }
        }
        Some(other) => Err(Error::unsupported_because(
            "aten.div",
            &n.name,
            format!("rounding_mode='{other}'"),
        )),
    }
}

fn atan2(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let a = operand(ctx, n, "self", 0)?;
    let b = operand(ctx, n, "other", 1)?;
    let mut dtype = ctx.b.result_type(&[a, b]);
    if !dtype.is_float() {
        dtype = DType::F32;
    }
    Ok(Out::Value(ctx.b.binary_in(BinaryOp::Atan2, a, b, dtype)?))
}

fn pow(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let a = operand(ctx, n, "self", 0)?;
    let b = operand(ctx, n, "exponent", 1)?;
    let dtype = ctx.b.result_type(&[a, b]);
    if let (Operand::Tensor(x), Operand::Scalar(e), DType::F32 | DType::F64) = (a, b, dtype) {
        if ctx.b.dtype(x) == dtype {
            if let Some(v) = small_power(ctx, x, e.as_f64(), dtype)? {
                return Ok(Out::Value(v));
            }
        }
    }
    arith_operands(ctx, BinaryOp::Pow, a, b)
}

/// `x ** e` for the exponents torch's CPU kernel computes without `pow` (2, 3, 0.5, -0.5,
/// -1, -2): the same products in the same order, so results match eager to the bit and
/// cost a multiply instead of a transcendental.
fn small_power(ctx: &mut Ctx, x: ValueId, e: f64, dtype: DType) -> Result<Option<ValueId>> {
    let t = Operand::Tensor;
    let one = Operand::Scalar(Scalar::Float(1.0));
    let square = |ctx: &mut Ctx| ctx.b.binary_in(BinaryOp::Mul, t(x), t(x), dtype);
    Ok(Some(if e == 2.0 {
        square(ctx)?
    } else if e == 3.0 {
        let sq = square(ctx)?;
        ctx.b.binary_in(BinaryOp::Mul, t(sq), t(x), dtype)?
    } else if e == 0.5 {
        ctx.b.unary(UnaryOp::Sqrt, x)?
    } else if e == -0.5 {
        ctx.b.unary(UnaryOp::Rsqrt, x)?
    } else if e == -1.0 {
        ctx.b.binary_in(BinaryOp::Div, one, t(x), dtype)?
    } else if e == -2.0 {
        let sq = square(ctx)?;
        ctx.b.binary_in(BinaryOp::Div, one, t(sq), dtype)?
    } else {
        return Ok(None);
    }))
}

fn arith_operands(ctx: &mut Ctx, op: BinaryOp, a: Operand, b: Operand) -> Result<Out> {
    let dtype = ctx.b.result_type(&[a, b]);
    Ok(Out::Value(ctx.b.binary_in(op, a, b, dtype)?))
}

fn compare(ctx: &mut Ctx, n: &NodeArgs, op: BinaryOp) -> Result<Out> {
    let a = operand(ctx, n, "self", 0)?;
    let b = operand(ctx, n, "other", 1)?;
    Ok(Out::Value(ctx.b.binary(op, a, b)?))
}

fn logical(ctx: &mut Ctx, n: &NodeArgs, op: BinaryOp) -> Result<Out> {
    let a = operand(ctx, n, "self", 0)?;
    let b = operand(ctx, n, "other", 1)?;
    let a = ctx.b.operand(a, DType::Bool)?;
    let b = ctx.b.operand(b, DType::Bool)?;
    Ok(Out::Value(ctx.b.binary_in(
        op,
        Operand::Tensor(a),
        Operand::Tensor(b),
        DType::Bool,
    )?))
}

fn bitwise(ctx: &mut Ctx, n: &NodeArgs, op: BinaryOp) -> Result<Out> {
    let a = operand(ctx, n, "self", 0)?;
    let b = operand(ctx, n, "other", 1)?;
    let dtype = ctx.b.result_type(&[a, b]);
    if dtype.is_float() {
        return Err(Error::Compile(format!(
            "node '{}': bitwise op on float tensors",
            n.name
        )));
    }
    Ok(Out::Value(ctx.b.binary_in(op, a, b, dtype)?))
}

fn where_(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let cond = tensor(ctx, n, "condition", 0)?;
    let a = operand(ctx, n, "self", 1)?;
    let b = operand(ctx, n, "other", 2)?;
    Ok(Out::Value(ctx.b.where_(cond, a, b)?))
}

/// `clamp(x, min, max)` as `min(max(x, lo), hi)`; bounds may be scalars or tensors.
fn clamp(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let (lo_name, hi_name) = if n.target.contains("hardtanh") {
        ("min_val", "max_val")
    } else {
        ("min", "max")
    };
    let bound = |ctx: &Ctx, name: &str, pos: usize| -> Result<Option<Operand>> {
        if let Ok(Some(t)) = n.opt_tensor(name, pos) {
            return Ok(Some(Operand::Tensor(ctx.value(t)?)));
        }
        Ok(n.scalar(name, pos)?.map(Operand::Scalar))
    };
    let (mut lo, mut hi) = (bound(ctx, lo_name, 1)?, bound(ctx, hi_name, 2)?);
    if n.target.contains("clamp_max") {
        hi = bound(ctx, "max", 1)?;
        lo = None;
    }
    if n.target.contains("hardtanh") {
        lo = lo.or(Some(Operand::Scalar(Scalar::Float(-1.0))));
        hi = hi.or(Some(Operand::Scalar(Scalar::Float(1.0))));
    }
    let mut ops = vec![Operand::Tensor(x)];
    ops.extend(lo.iter().copied());
    ops.extend(hi.iter().copied());
    let dtype = ctx.b.result_type(&ops);
    let mut y = Operand::Tensor(x);
    if let Some(lo) = lo {
        y = Operand::Tensor(ctx.b.binary_in(BinaryOp::Max, y, lo, dtype)?);
    }
    if let Some(hi) = hi {
        y = Operand::Tensor(ctx.b.binary_in(BinaryOp::Min, y, hi, dtype)?);
    }
    Ok(Out::Value(ctx.b.operand(y, dtype)?))
}

fn masked_fill(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let mask = tensor(ctx, n, "mask", 1)?;
    let value = operand(ctx, n, "value", 2)?;
    let dtype = ctx.b.dtype(x);
    let value = ctx.b.operand(value, dtype)?;
    let out = ctx
        .b
        .where_(mask, Operand::Tensor(value), Operand::Tensor(x))?;
    // The result keeps x's shape even where the mask broadcasts it wider in torch's eyes.
    Ok(Out::Value(out))
}

fn to_copy(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    match n.dtype("dtype", 1)? {
        Some(d) => Ok(Out::Value(ctx.b.cast(x, d)?)),
        None => Ok(Out::Value(x)),
    }
}

/// `x.type_as(other)`: x cast to other's dtype (kept whole by an undecomposed export).
fn type_as(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let other = tensor(ctx, n, "other", 1)?;
    Ok(Out::Value(ctx.b.cast(x, ctx.b.dtype(other))?))
}

/// `copy(self, src)`: the functional form of `self.copy_(src)` (an in-place write into a
/// fresh tensor, as functionalization leaves it): `src` cast to `self`'s dtype and
/// broadcast to its shape.
fn copy(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let src = tensor(ctx, n, "src", 1)?;
    let src = ctx.b.cast(src, ctx.b.dtype(x))?;
    let shape = ctx.b.shape(x);
    Ok(Out::Value(ctx.b.broadcast_to(src, &shape)?))
}

fn identity(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0).or_else(|_| tensor(ctx, n, "input", 0))?;
    if n.target.contains("dropout") && n.bool("train", 2, false)? {
        return Err(Error::unsupported_because(
            "aten.dropout",
            &n.name,
            "train=True",
        ));
    }
    Ok(Out::Value(x))
}

/// `elu(x, alpha, scale, input_scale)` (torch's decompositions also route CELU and SELU here):
/// `scale·x` above 0, `alpha·scale·expm1(input_scale·x)` at or below, as torch's kernel.
fn elu(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let dtype = ctx.b.dtype(x);
    if !dtype.is_float() {
        return Err(Error::Compile(format!(
            "node '{}' (aten.elu): input of {dtype}, not a float type",
            n.name
        )));
    }
    let arg = |name: &str, pos: usize| -> Result<f64> {
        Ok(n.scalar(name, pos)?.map_or(1.0, Scalar::as_f64))
    };
    let (alpha, scale, input_scale) = (arg("alpha", 1)?, arg("scale", 2)?, arg("input_scale", 3)?);
    let mul = |ctx: &mut Ctx, v: ValueId, by: f64| {
        ctx.b.binary_in(
            BinaryOp::Mul,
            Operand::Tensor(v),
            Operand::Scalar(Scalar::Float(by)),
            dtype,
        )
    };
    let above = mul(ctx, x, scale)?;
    let inner = mul(ctx, x, input_scale)?;
    let grown = ctx.b.unary(UnaryOp::Expm1, inner)?;
    let below = mul(ctx, grown, alpha * scale)?;
    Ok(Out::Value(where_positive(ctx, x, above, below)?))
}

/// `above` where `x > 0`, else `below` (a NaN `x` takes `below`, as torch's kernels do).
fn where_positive(ctx: &mut Ctx, x: ValueId, above: ValueId, below: ValueId) -> Result<ValueId> {
    let dtype = ctx.b.dtype(x);
    let pos = ctx.b.binary_in(
        BinaryOp::Gt,
        Operand::Tensor(x),
        Operand::Scalar(Scalar::Int(0)),
        dtype,
    )?;
    ctx.b
        .where_(pos, Operand::Tensor(above), Operand::Tensor(below))
}

fn leaky_relu(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let slope = n
        .scalar("negative_slope", 1)?
        .unwrap_or(Scalar::Float(0.01));
    let dtype = ctx.b.dtype(x);
    let scaled = ctx.b.binary_in(
        BinaryOp::Mul,
        Operand::Tensor(x),
        Operand::Scalar(slope),
        dtype,
    )?;
    Ok(Out::Value(where_positive(ctx, x, x, scaled)?))
}
