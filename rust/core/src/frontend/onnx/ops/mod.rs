//! ONNX op translations, one file per family. `handler` maps an op type to the function that
//! translates it; the same table decides up front whether a whole model is supported.

mod attention;
mod contrib;
pub mod control;
mod conv;
mod creation;
mod elementwise;
mod grid_sample;
mod index;
mod linalg;
mod math;
mod matmul_nbits;
mod ms_attention;
mod nn;
mod qlinear;
mod quant;
mod recurrent;
mod reduce;
mod resize;
mod shape;

use super::node::Node;
use super::translate::{Ctx, Val};
use crate::dtype::{DType, Scalar};
use crate::error::Result;
use crate::frontend::builder::{norm_axis, Operand};
use crate::ir::{BinaryOp, ValueId};

/// Translates one node into its output values (one per ONNX output, in order).
pub type Handler = fn(&mut Ctx, &Node) -> Result<Vec<Val>>;

pub fn handler(op: &str) -> Option<Handler> {
    elementwise::handler(op)
        .or_else(|| reduce::handler(op))
        .or_else(|| shape::handler(op))
        .or_else(|| index::handler(op))
        .or_else(|| linalg::handler(op))
        .or_else(|| nn::handler(op))
        .or_else(|| conv::handler(op))
        .or_else(|| creation::handler(op))
        .or_else(|| resize::handler(op))
        .or_else(|| quant::handler(op))
        .or_else(|| qlinear::handler(op))
        .or_else(|| attention::handler(op))
        .or_else(|| math::handler(op))
        .or_else(|| recurrent::handler(op))
        .or_else(|| grid_sample::handler(op))
        .or_else(|| control::handler(op))
}

/// ONNX Runtime's contrib domain, of which Ember reads the quantized (QOperator) ops.
pub const MICROSOFT: &str = "com.microsoft";
/// The names of the `com.microsoft` ops Ember reads (for error messages).
pub fn microsoft_ops() -> Vec<&'static str> {
    let mut all = qlinear::microsoft_ops();
    all.extend(contrib::OPS.iter().map(|&(name, _)| name));
    all.extend(ms_attention::OPS.iter().map(|&(name, _)| name));
    all.push("MatMulNBits");
    all.sort_unstable();
    all
}

/// The translation of `op` in `domain` (ai.onnx when empty).
pub fn handler_in(domain: Option<&str>, op: &str) -> Option<Handler> {
    match domain {
        None | Some("") | Some("ai.onnx") => handler(op),
        Some(MICROSOFT) => qlinear::microsoft_handler(op)
            .or_else(|| contrib::handler(op))
            .or_else(|| ms_attention::handler(op))
            .or_else(|| matmul_nbits::handler(op)),
        Some(_) => None,
    }
}

/// Ops Ember knows but cannot express with the current IR, with the reason.
pub fn unsupported_reason(op: &str) -> Option<&'static str> {
    Some(match op {
        "LpPool" | "MaxUnpool" | "GlobalLpPool" => {
            "Lp pooling and unpooling need IR ops Ember does not have yet"
        }
        "Sort" | "Unique" => "sorting needs an IR op Ember does not have yet",
        "Scatter" => "deprecated before opset 13 (use ScatterElements)",
        "NonZero" | "Compress" | "NonMaxSuppression" => {
            "the output shape depends on tensor values, which Ember's IR cannot express"
        }
        _ => return None,
    })
}

/// `a op b`, computed in `a`'s dtype.
fn bin(ctx: &mut Ctx, op: BinaryOp, a: ValueId, b: ValueId) -> Result<ValueId> {
    let dtype = ctx.b.dtype(a);
    ctx.b
        .binary_in(op, Operand::Tensor(a), Operand::Tensor(b), dtype)
}

/// A 0-d float constant.
fn scalar(ctx: &mut Ctx, v: f64, dtype: DType) -> Result<ValueId> {
    ctx.b.full(Scalar::Float(v), dtype, vec![])
}

fn one(id: ValueId) -> Result<Vec<Val>> {
    Ok(vec![Val::of(id)])
}

/// An axis attribute or input, normalized for a tensor of `rank`.
fn axis(ctx: &Ctx, a: i64, rank: usize) -> Result<usize> {
    norm_axis(a, rank, &ctx.b.origin)
}

/// A list of axes, normalized, sorted and checked for duplicates.
fn axes(ctx: &Ctx, n: &Node, list: &[i64], rank: usize) -> Result<Vec<usize>> {
    let mut out = list
        .iter()
        .map(|&a| axis(ctx, a, rank))
        .collect::<Result<Vec<_>>>()?;
    out.sort_unstable();
    let len = out.len();
    out.dedup();
    if out.len() != len {
        return Err(n.err(format!("axes {list:?} repeat an axis")));
    }
    Ok(out)
}
