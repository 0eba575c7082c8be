//! Elementwise ops: unary math, broadcasting binary arithmetic and comparisons, the variadic
//! Sum/Mean/Max/Min, Where, Cast/CastLike, Identity and inference-mode Dropout. Integer ops on
//! known shape values fold at compile time.

use super::{one, Handler};
use crate::dim::Dim;
use crate::dtype::{DType, Scalar};
use crate::error::Result;
use crate::frontend::builder::Operand;
use crate::frontend::onnx::known::{self, Fold, Known};
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::tensor::dtype_from_onnx;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, UnaryOp, ValueId};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "Sqrt" | "Neg" | "Abs" | "Reciprocal" | "Exp" | "Log" | "Sin" | "Cos" | "Tan" | "Tanh"
        | "Sigmoid" | "Relu" | "Erf" | "Floor" | "Ceil" | "IsNaN" | "Not" | "Sign" | "Round" => {
            unary
        }
        "IsInf" => is_inf,
        "Add" | "Sub" | "Mul" | "Div" | "Mod" | "Equal" | "Less" | "Greater" | "LessOrEqual"
        | "GreaterOrEqual" | "And" | "Or" | "Xor" | "BitwiseAnd" | "BitwiseOr" | "BitwiseXor" => {
            binary
        }
        "Pow" => pow,
        "Sum" | "Mean" | "Max" | "Min" => variadic,
        "Where" => where_,
        "Cast" | "CastLike" => cast,
        "Identity" => identity,
        "Dropout" => dropout,
        _ => return None,
    })
}

fn unary(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    // Loop conditions are often `Not` of a known flag.
    if n.op == "Not" {
        if let Some(k) = ctx.known(n, 0).as_ref().and_then(known::not) {
            return Ok(vec![Val::known(k)]);
        }
    }
    let x = ctx.input(n, 0)?;
    let op = match n.op {
        "Sqrt" => UnaryOp::Sqrt,
        "Neg" => UnaryOp::Neg,
        "Abs" => UnaryOp::Abs,
        "Reciprocal" => UnaryOp::Recip,
        "Exp" => UnaryOp::Exp,
        "Log" => UnaryOp::Log,
        "Sin" => UnaryOp::Sin,
        "Cos" => UnaryOp::Cos,
        "Tan" => UnaryOp::Tan,
        "Tanh" => UnaryOp::Tanh,
        "Sigmoid" => UnaryOp::Sigmoid,
        "Relu" => UnaryOp::Relu,
        "Erf" => UnaryOp::Erf,
        "Floor" => UnaryOp::Floor,
        "Ceil" => UnaryOp::Ceil,
        "IsNaN" => UnaryOp::IsNan,
        "Not" => UnaryOp::Not,
        "Sign" => UnaryOp::Sign,
        _ => UnaryOp::Round,
    };
    if op.needs_float() && !ctx.b.dtype(x).is_float() {
        return Err(n.err(format!("needs a float input, got {}", ctx.b.dtype(x))));
    }
    one(ctx.b.unary(op, x)?)
}

/// IsInf with `detect_positive` / `detect_negative`.
fn is_inf(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let (pos, neg) = (
        n.flag("detect_positive", true)?,
        n.flag("detect_negative", true)?,
    );
    let inf = ctx.b.unary(UnaryOp::IsInf, x)?;
    if pos && neg {
        return one(inf);
    }
    if !pos && !neg {
        return one(ctx
            .b
            .full(Scalar::Bool(false), DType::Bool, ctx.b.shape(x))?);
    }
    let cmp = if pos { BinaryOp::Gt } else { BinaryOp::Lt };
    let sign = ctx
        .b
        .binary(cmp, Operand::Tensor(x), Operand::Scalar(Scalar::Int(0)))?;
    one(ctx
        .b
        .binary(BinaryOp::And, Operand::Tensor(inf), Operand::Tensor(sign))?)
}

/// Checks that ONNX's same-type constraint holds (Ember never promotes silently).
pub fn same_dtype(ctx: &Ctx, n: &Node, ids: &[ValueId]) -> Result<DType> {
    let d = ctx.b.dtype(ids[0]);
    if let Some(&other) = ids.iter().find(|&&v| ctx.b.dtype(v) != d) {
        return Err(n.err(format!(
            "inputs must have one element type, got {d} and {}",
            ctx.b.dtype(other)
        )));
    }
    Ok(d)
}

fn fold_of(op: &str) -> Option<Fold> {
    Some(match op {
        "Add" => Fold::Add,
        "Sub" => Fold::Sub,
        "Mul" => Fold::Mul,
        "Div" => Fold::Div,
        "Mod" => Fold::Mod,
        "Max" => Fold::Max,
        "Min" => Fold::Min,
        "Equal" => Fold::Eq,
        "Less" => Fold::Lt,
        "Greater" => Fold::Gt,
        "LessOrEqual" => Fold::Le,
        "GreaterOrEqual" => Fold::Ge,
        "And" | "BitwiseAnd" => Fold::And,
        "Or" | "BitwiseOr" => Fold::Or,
        "Xor" | "BitwiseXor" => Fold::Xor,
        _ => return None,
    })
}

/// Folds a binary op on known integer inputs (shape arithmetic).
fn try_fold(ctx: &Ctx, n: &Node) -> Option<Val> {
    let op = fold_of(n.op)?;
    if n.op == "Mod" && n.flag("fmod", false).ok()? {
        return None;
    }
    let (a, b) = (ctx.known(n, 0)?, ctx.known(n, 1)?);
    known::fold_binary(op, &a, &b).map(Val::known)
}

fn binary(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    if let Some(v) = try_fold(ctx, n) {
        return Ok(vec![v]);
    }
    let a = ctx.input(n, 0)?;
    let b = ctx.input(n, 1)?;
    let dtype = same_dtype(ctx, n, &[a, b])?;
    let op = match n.op {
        "Add" => BinaryOp::Add,
        "Sub" => BinaryOp::Sub,
        "Mul" => BinaryOp::Mul,
        "Div" => BinaryOp::Div,
        "Mod" => {
            if n.flag("fmod", false)? {
                BinaryOp::Fmod
            } else if dtype.is_float() {
                return Err(n.err("fmod must be 1 for floating-point inputs"));
            } else {
                BinaryOp::Rem
            }
        }
        "Equal" => BinaryOp::Eq,
        "Less" => BinaryOp::Lt,
        "Greater" => BinaryOp::Gt,
        "LessOrEqual" => BinaryOp::Le,
        "GreaterOrEqual" => BinaryOp::Ge,
        "And" | "BitwiseAnd" => BinaryOp::And,
        "Or" | "BitwiseOr" => BinaryOp::Or,
        _ => BinaryOp::Xor,
    };
    one(ctx
        .b
        .binary_in(op, Operand::Tensor(a), Operand::Tensor(b), dtype)?)
}

/// Pow: the exponent may have another type; the result has the base's type.
fn pow(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let y = ctx.input(n, 1)?;
    let dtype = ctx.b.dtype(x);
    // ONNX Runtime computes a constant exponent of 2, 3, 0.5 or -1 as products, sqrt or a
    // reciprocal, not pow; so does Ember (same bits, no transcendental). Only when the
    // exponent does not broadcast x to a higher rank.
    let scalar =
        ctx.b.rank(y) <= ctx.b.rank(x) && ctx.b.shape(y).iter().all(|d| d.as_const() == Some(1));
    if scalar && matches!(dtype, DType::F32 | DType::F64) {
        if let Some([e]) = ctx.const_floats(n, 1).as_deref() {
            let t = Operand::Tensor;
            let b = &mut ctx.b;
            let v = if *e == 2.0 {
                Some(b.binary_in(BinaryOp::Mul, t(x), t(x), dtype)?)
            } else if *e == 3.0 {
                let sq = b.binary_in(BinaryOp::Mul, t(x), t(x), dtype)?;
                Some(b.binary_in(BinaryOp::Mul, t(sq), t(x), dtype)?)
            } else if *e == 0.5 {
                Some(b.unary(UnaryOp::Sqrt, x)?)
            } else if *e == -1.0 {
                let one = Operand::Scalar(Scalar::Float(1.0));
                Some(b.binary_in(BinaryOp::Div, one, t(x), dtype)?)
            } else {
                None
            };
            if let Some(v) = v {
                return one(v);
            }
        }
    }
    one(ctx
        .b
        .binary_in(BinaryOp::Pow, Operand::Tensor(x), Operand::Tensor(y), dtype)?)
}

fn variadic(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let names = n.inputs();
    if names.is_empty() {
        return Err(n.err("needs at least one input"));
    }
    if names.len() == 2 && matches!(n.op, "Max" | "Min") {
        if let Some(v) = try_fold(ctx, n) {
            return Ok(vec![v]);
        }
    }
    let ids = names
        .iter()
        .map(|name| ctx.value(name))
        .collect::<Result<Vec<_>>>()?;
    let dtype = same_dtype(ctx, n, &ids)?;
    let op = match n.op {
        "Max" => BinaryOp::Max,
        "Min" => BinaryOp::Min,
        _ => BinaryOp::Add,
    };
    let mut acc = ids[0];
    for &v in &ids[1..] {
        acc = ctx
            .b
            .binary_in(op, Operand::Tensor(acc), Operand::Tensor(v), dtype)?;
    }
    if ids.len() == 1 {
        // A single input still broadcasts to nothing: the result is that input.
        return one(acc);
    }
    if n.op == "Mean" {
        let count = Scalar::Int(ids.len() as i64);
        acc = ctx.b.binary_in(
            BinaryOp::Div,
            Operand::Tensor(acc),
            Operand::Scalar(count),
            dtype,
        )?;
    }
    one(acc)
}

fn where_(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    if let (Some(c), Some(a), Some(b)) = (ctx.known(n, 0), ctx.known(n, 1), ctx.known(n, 2)) {
        if let Some(v) = fold_where(&c, &a, &b) {
            return Ok(vec![Val::known(v)]);
        }
    }
    let c = ctx.input(n, 0)?;
    let a = ctx.input(n, 1)?;
    let b = ctx.input(n, 2)?;
    if ctx.b.dtype(c) != DType::Bool {
        return Err(n.err(format!("condition must be bool, got {}", ctx.b.dtype(c))));
    }
    same_dtype(ctx, n, &[a, b])?;
    one(ctx.b.where_(c, Operand::Tensor(a), Operand::Tensor(b))?)
}

fn fold_where(c: &Known, a: &Known, b: &Known) -> Option<Known> {
    let conds = c.consts()?;
    if c.dtype != DType::Bool || a.dtype != b.dtype {
        return None;
    }
    let len = [conds.len(), a.dims.len(), b.dims.len()]
        .into_iter()
        .max()
        .unwrap_or(1);
    let at = |v: &[Dim], i: usize| -> Option<Dim> {
        match v.len() {
            1 => Some(v[0].clone()),
            l if l == len => Some(v[i].clone()),
            _ => None,
        }
    };
    let cd: Vec<Dim> = conds.into_iter().map(Dim::Const).collect();
    let dims = (0..len)
        .map(|i| {
            let pick_a = at(&cd, i)?.as_const()? != 0;
            at(if pick_a { &a.dims } else { &b.dims }, i)
        })
        .collect::<Option<Vec<_>>>()?;
    Some(Known {
        dtype: a.dtype,
        scalar: c.scalar && a.scalar && b.scalar,
        dims,
    })
}

fn cast(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let to = if n.op == "CastLike" {
        let t = ctx.input(n, 1)?;
        ctx.b.dtype(t)
    } else {
        let code = n.int("to", 0)?;
        dtype_from_onnx(i32::try_from(code).unwrap_or(0), &n.name)?
    };
    if let Some(k) = ctx.known(n, 0) {
        if let Some(c) = known::cast(&k, to) {
            return Ok(vec![Val::known(c)]);
        }
    }
    let x = ctx.input(n, 0)?;
    one(ctx.b.cast(x, to)?)
}

fn identity(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    if let Some(k) = ctx.known(n, 0) {
        return Ok(vec![Val::known(k)]);
    }
    one(ctx.input(n, 0)?)
}

/// Inference-mode Dropout is the identity; its optional mask is all true.
fn dropout(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    if n.input(2).is_some() {
        let training = ctx.const_ints(n, 2, "training_mode")?;
        if training.first().copied().unwrap_or(0) != 0 {
            return Err(n.unsupported("training_mode = true (Ember compiles inference only)"));
        }
    }
    let x = ctx.input(n, 0)?;
    let mut outs = vec![Val::of(x)];
    if n.wants_output(1) {
        let shape = ctx.b.shape(x);
        outs.push(Val::of(ctx.b.full(
            Scalar::Bool(true),
            DType::Bool,
            shape,
        )?));
    }
    Ok(outs)
}
