//! Matrix products: mm, bmm, addmm, baddbmm, linear, matmul (with broadcasting), dot —
//! all lowered to the IR's one batched contraction `Dot` — int8 `_int_mm` (`IntegerDot`),
//! and the grouped products of mixture-of-experts layers (`_grouped_mm`, transformers'
//! `grouped_mm_fallback`), lowered to `GroupedDot`.

use super::{operand, tensor, Handler};
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::builder::Builder;
use crate::frontend::builder::Operand;
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, Op, ValueId};

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    Some(match (name, overload) {
        ("mm" | "bmm" | "matmul" | "dot" | "mv", "default") => product,
        ("addmm" | "baddbmm" | "addmv", "default") => add_product,
        ("linear", "default") => linear,
        ("_grouped_mm", "default") => grouped_mm,
        ("_int_mm", "default") => int_mm,
        _ => return None,
    })
}

/// transformers' custom op for grouped products where torch's `_grouped_mm` cannot run
/// (`torch.ops.transformers.grouped_mm_fallback`): the same product, zeros past the last
/// offset.
pub fn transformers_grouped_mm(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "input", 0)?;
    let w = tensor(ctx, n, "weight", 1)?;
    let offs = tensor(ctx, n, "offs", 2)?;
    grouped(ctx, n, x, w, offs)
}

/// `_grouped_mm(self [S, K], mat2 [G, K, N], offs [G])`: the mixture-of-experts form, rows
/// grouped by the cumulative offsets (torch leaves rows past the last offset unwritten;
/// Ember gives zeros). Its other forms (3-D × 3-D batches, 2-D × 2-D groups along K) and a
/// bias are refused, naming what was passed.
fn grouped_mm(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let w = tensor(ctx, n, "mat2", 1)?;
    let offs = n.opt_tensor("offs", 2)?;
    let bias = n.opt_tensor("bias", 3)?;
    let out_dtype = n.dtype("out_dtype", 4)?;
    let (rx, rw) = (ctx.b.rank(x), ctx.b.rank(w));
    let refuse = |why: String| Err(Error::unsupported_because(n.target.clone(), &n.name, why));
    let Some(offs) = offs else {
        return refuse(format!(
            "_grouped_mm without offsets (rank {rx} × rank {rw})"
        ));
    };
    if rx != 2 || rw != 3 {
        return refuse(format!(
            "_grouped_mm of rank {rx} × rank {rw}: only the 2-D × 3-D (mixture-of-experts) \
             form is supported"
        ));
    }
    if bias.is_some() {
        return refuse("_grouped_mm with a bias".into());
    }
    if out_dtype.is_some_and(|d| d != ctx.b.dtype(x)) {
        return refuse(format!(
            "_grouped_mm with out_dtype {} from {}",
            out_dtype.unwrap_or(ctx.b.dtype(x)),
            ctx.b.dtype(x)
        ));
    }
    let offs = ctx.value(offs)?;
    grouped(ctx, n, x, w, offs)
}

fn grouped(ctx: &mut Ctx, n: &NodeArgs, x: ValueId, w: ValueId, ends: ValueId) -> Result<Out> {
    let (dx, dw) = (ctx.b.dtype(x), ctx.b.dtype(w));
    if dx != dw || !dx.is_float() {
        return Err(Error::unsupported_because(
            n.target.clone(),
            &n.name,
            format!("grouped product of {dx} and {dw}: floats of one dtype only"),
        ));
    }
    Ok(Out::Value(ctx.b.op(Op::GroupedDot, &[x, w, ends])?))
}

fn product(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let a = tensor(ctx, n, "self", 0)?;
    let b = tensor(ctx, n, "other", 1)
        .or_else(|_| tensor(ctx, n, "mat2", 1))
        .or_else(|_| tensor(ctx, n, "tensor", 1))
        .or_else(|_| tensor(ctx, n, "vec", 1))?;
    Ok(Out::Value(matmul(&mut ctx.b, a, b)?))
}

/// `_int_mm(self [M, K] int8, mat2 [K, N] int8)`: int32 sums of int8 products
/// (`IntegerDot`).
fn int_mm(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let a = tensor(ctx, n, "self", 0)?;
    let b = tensor(ctx, n, "mat2", 1)?;
    let (da, db) = (ctx.b.dtype(a), ctx.b.dtype(b));
    let (ra, rb) = (ctx.b.rank(a), ctx.b.rank(b));
    if (da, db) != (DType::I8, DType::I8) || (ra, rb) != (2, 2) {
        return Err(Error::unsupported_because(
            n.target.clone(),
            &n.name,
            format!("_int_mm of {da} rank {ra} × {db} rank {rb} (2-D int8 × int8 is supported)"),
        ));
    }
    Ok(Out::Value(ctx.b.integer_matmul(a, b)?))
}

/// `beta * input + alpha * (m1 @ m2)`.
fn add_product(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let input = operand(ctx, n, "self", 0)?;
    let m1 = tensor(ctx, n, "mat1", 1)
        .or_else(|_| tensor(ctx, n, "batch1", 1))
        .or_else(|_| tensor(ctx, n, "mat", 1))?;
    let m2 = tensor(ctx, n, "mat2", 2)
        .or_else(|_| tensor(ctx, n, "batch2", 2))
        .or_else(|_| tensor(ctx, n, "vec", 2))?;
    let mut prod = matmul(&mut ctx.b, m1, m2)?;
    let beta = n.scalar("beta", 3)?.unwrap_or(Scalar::Int(1));
    let alpha = n.scalar("alpha", 4)?.unwrap_or(Scalar::Int(1));
    if alpha.as_f64() != 1.0 {
        prod = ctx
            .b
            .binary(BinaryOp::Mul, Operand::Tensor(prod), Operand::Scalar(alpha))?;
    }
    if beta.as_f64() == 0.0 {
        return Ok(Out::Value(prod));
    }
    let mut bias = input;
    if beta.as_f64() != 1.0 {
        bias = Operand::Tensor(ctx.b.binary(BinaryOp::Mul, input, Operand::Scalar(beta))?);
    }
    Ok(Out::Value(ctx.b.binary(
        BinaryOp::Add,
        Operand::Tensor(prod),
        bias,
    )?))
}

fn linear(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "input", 0)?;
    let w = tensor(ctx, n, "weight", 1)?;
    let bias = match n.opt_tensor("bias", 2)? {
        Some(b) => Some(ctx.value(b)?),
        None => None,
    };
    Ok(Out::Value(linear_layer(&mut ctx.b, x, w, bias)?))
}

/// `x @ wᵀ + b` with the weight kept 2-D: leading dims of x fold into M.
pub fn linear_layer(
    b: &mut Builder,
    x: ValueId,
    w: ValueId,
    bias: Option<ValueId>,
) -> Result<ValueId> {
    let wt = match b.rank(w) {
        2 => b.permute(w, vec![1, 0])?,
        1 => w,
        r => {
            return Err(Error::Shape(format!(
                "linear weight of rank {r} at '{}'",
                b.origin
            )))
        }
    };
    let mut y = matmul(b, x, wt)?;
    if let Some(bias) = bias {
        y = b.binary(BinaryOp::Add, Operand::Tensor(y), Operand::Tensor(bias))?;
    }
    Ok(y)
}

/// torch.matmul semantics (`Builder::matmul`, shared with the ONNX frontend).
pub fn matmul(b: &mut Builder, x: ValueId, y: ValueId) -> Result<ValueId> {
    b.matmul(x, y)
}
