//! Matrix products: mm, bmm, addmm, baddbmm, linear, matmul (with broadcasting), dot —
//! all lowered to the IR's one batched contraction `Dot`.

use super::{operand, tensor, Handler};
use crate::dim::{numel, Dim};
use crate::dtype::Scalar;
use crate::error::{Error, Result};
use crate::frontend::builder::Builder;
use crate::frontend::builder::{broadcast_shapes, Operand};
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, Op, ValueId};

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

/// torch.matmul semantics for any ranks, built from `Dot` with explicit broadcasting.
pub fn matmul(b: &mut Builder, x: ValueId, y: ValueId) -> Result<ValueId> {
    if b.dtype(x) != b.dtype(y) {
        return Err(Error::Compile(format!(
            "matmul of {} and {} at node '{}' (torch requires equal dtypes)",
            b.dtype(x),
            b.dtype(y),
            b.origin
        )));
    }
    let (rx, ry) = (b.rank(x), b.rank(y));
    if rx == 0 || ry == 0 {
        return Err(Error::Shape(format!(
            "matmul of a 0-d tensor at node '{}'",
            b.origin
        )));
    }
    // Vectors become matrices, and the added dim is dropped at the end.
    let mut xs = b.shape(x);
    let mut ys = b.shape(y);
    let x_vec = rx == 1;
    let y_vec = ry == 1;
    if x_vec {
        xs.insert(0, Dim::Const(1));
    }
    if y_vec {
        ys.push(Dim::Const(1));
    }
    let x = b.reshape(x, xs.clone())?;
    let y = b.reshape(y, ys.clone())?;
    let (m, k) = (xs[xs.len() - 2].clone(), xs[xs.len() - 1].clone());
    let nn = ys[ys.len() - 1].clone();
    let out = if ys.len() == 2 {
        // [..., M, K] @ [K, N]: fold the leading dims into M; the weight stays 2-D.
        let lead = xs[..xs.len() - 2].to_vec();
        let rows = numel(&[numel(&lead), m.clone()]);
        let x2 = b.reshape(x, vec![rows, k])?;
        let d = b.op(Op::Dot, &[x2, y])?;
        let mut shape = lead;
        shape.extend([m, nn.clone()]);
        b.reshape(d, shape)?
    } else {
        let batch = broadcast_shapes(&xs[..xs.len() - 2], &ys[..ys.len() - 2])?;
        let mut xt = batch.clone();
        xt.extend([m.clone(), k.clone()]);
        let mut yt = batch.clone();
        yt.extend([ys[ys.len() - 2].clone(), nn.clone()]);
        let x = b.broadcast_to(x, &xt)?;
        let y = b.broadcast_to(y, &yt)?;
        b.op(Op::Dot, &[x, y])?
    };
    let mut shape = b.shape(out);
    if y_vec {
        shape.pop();
    }
    if x_vec {
        let r = shape.len();
        shape.remove(r - if y_vec { 1 } else { 2 });
    }
    b.reshape(out, shape)
}
