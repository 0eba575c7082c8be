//! Matrix products: mm, bmm, addmm, baddbmm, linear, matmul (with broadcasting), dot —
//! all lowered to the IR's one batched contraction `Dot`.

use super::{operand, tensor, Handler};
use crate::dtype::Scalar;
use crate::error::{Error, Result};
use crate::frontend::builder::Builder;
use crate::frontend::builder::Operand;
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, ValueId};

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    Some(match (name, overload) {
        ("mm" | "bmm" | "matmul" | "dot" | "mv", "default") => product,
        ("addmm" | "baddbmm" | "addmv", "default") => add_product,
        ("linear", "default") => linear,
        _ => return None,
    })
}

fn product(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let a = tensor(ctx, n, "self", 0)?;
    let b = tensor(ctx, n, "other", 1)
        .or_else(|_| tensor(ctx, n, "mat2", 1))
        .or_else(|_| tensor(ctx, n, "tensor", 1))
        .or_else(|_| tensor(ctx, n, "vec", 1))?;
    Ok(Out::Value(matmul(&mut ctx.b, a, b)?))
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
