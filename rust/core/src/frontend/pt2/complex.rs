//! Complex tensors. A complex64/complex128 value is held as a real tensor with a trailing
//! dim of 2, (real, imaginary): the layout `torch.view_as_real` gives, so `view_as_complex`
//! and `view_as_real` cost nothing and complex arithmetic is real arithmetic on the parts.
//! Rotary embeddings written with complex numbers (LLaMA's reference code, SAM 2) are what
//! needs this. Every node that reads or makes a complex value comes here: shape ops run as
//! their real selves with their dims and sizes moved past the pair dim; arithmetic is
//! spelled out on the parts; anything else is named as unsupported on complex tensors.

use super::args::{Arg, NodeArgs, SymRef};
use super::ops;
use super::translate::{short_target, Ctx, Out};
use crate::dim::Dim;
use crate::dtype::Scalar;
use crate::error::{Error, Result};
use crate::frontend::builder::Operand;
use crate::ir::{BinaryOp, UnaryOp, ValueId};

/// Ops that exist only for complex tensors (the rest have real handlers in `ops`).
pub fn handles(target: &str) -> bool {
    matches!(
        op_name(target).0,
        "view_as_complex"
            | "view_as_real"
            | "polar"
            | "complex"
            | "real"
            | "imag"
            | "conj"
            | "_conj"
            | "conj_physical"
            | "resolve_conj"
            | "resolve_neg"
    )
}

/// Whether `n` reads or makes a complex value.
pub fn involved(ctx: &Ctx, n: &NodeArgs) -> bool {
    n.outputs.iter().flatten().any(|o| ctx.complex.contains(o))
        || n.tensor_names().any(|t| ctx.complex.contains(t))
}

/// `torch.ops.aten.mul.Tensor` → ("mul", "Tensor").
fn op_name(target: &str) -> (&str, &str) {
    let rest = short_target(target).strip_prefix("aten.").unwrap_or(target);
    rest.split_once('.').unwrap_or((rest, "default"))
}

pub fn translate(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let (name, overload) = op_name(&n.target);
    match name {
        // Views of the same pairs, and copies.
        "view_as_complex" | "view_as_real" | "clone" | "alias" | "detach" | "lift_fresh_copy"
        | "contiguous" | "resolve_conj" | "resolve_neg" => {
            Ok(Out::Value(ctx.value(n.tensor("self", 0)?)?))
        }
        "_assert_tensor_metadata" => Ok(Out::None),
        "_to_copy" | "to" => to_copy(ctx, n),
        "real" | "imag" => {
            let z = complex_arg(ctx, n, "self", 0)?;
            let part = ctx.b.rank(z) - 1;
            let at = (name == "imag") as i64;
            let one = ctx
                .b
                .slice(z, part, Dim::Const(at), Dim::Const(at + 1), 1)?;
            let mut shape = ctx.b.shape(one);
            shape.pop();
            Ok(Out::Value(ctx.b.reshape(one, shape)?))
        }
        "polar" => {
            let abs = real_arg(ctx, n, "abs", 0)?;
            let angle = real_arg(ctx, n, "angle", 1)?;
            let cos = ctx.b.unary(UnaryOp::Cos, angle)?;
            let sin = ctx.b.unary(UnaryOp::Sin, angle)?;
            let re = ctx
                .b
                .binary(BinaryOp::Mul, Operand::Tensor(abs), Operand::Tensor(cos))?;
            let im = ctx
                .b
                .binary(BinaryOp::Mul, Operand::Tensor(abs), Operand::Tensor(sin))?;
            Ok(Out::Value(pair(ctx, re, im)?))
        }
        "complex" => {
            let re = real_arg(ctx, n, "real", 0)?;
            let im = real_arg(ctx, n, "imag", 1)?;
            Ok(Out::Value(pair(ctx, re, im)?))
        }
        "abs" => {
            let z = complex_arg(ctx, n, "self", 0)?;
            let (re, im) = parts(ctx, z)?;
            let t = Operand::Tensor;
            let re2 = ctx.b.binary(BinaryOp::Mul, t(re), t(re))?;
            let im2 = ctx.b.binary(BinaryOp::Mul, t(im), t(im))?;
            let sum = ctx.b.binary(BinaryOp::Add, t(re2), t(im2))?;
            let abs = ctx.b.unary(UnaryOp::Sqrt, sum)?;
            let mut shape = ctx.b.shape(abs);
            shape.pop();
            Ok(Out::Value(ctx.b.reshape(abs, shape)?))
        }
        "conj" | "_conj" | "conj_physical" => {
            let z = complex_arg(ctx, n, "self", 0)?;
            let (re, im) = parts(ctx, z)?;
            let im = ctx.b.unary(UnaryOp::Neg, im)?;
            Ok(Out::Value(join(ctx, re, im)?))
        }
        "neg" | "_neg_view" => {
            let z = complex_arg(ctx, n, "self", 0)?;
            Ok(Out::Value(ctx.b.unary(UnaryOp::Neg, z)?))
        }
        "mul" | "div" | "add" | "sub" | "rsub" => arithmetic(ctx, n, name),
        _ => match shape_edits(name, overload) {
            Some(edits) => {
                let patched = patch(ctx, n, edits)?;
                let handler = ops::handler(&n.target).ok_or_else(|| unsupported(n))?;
                handler(ctx, &patched)
            }
            None => Err(unsupported(n)),
        },
    }
}

fn unsupported(n: &NodeArgs) -> Error {
    Error::unsupported_because(
        short_target(&n.target),
        &n.name,
        "Ember does not compute this op on complex tensors",
    )
}

fn complex_arg(ctx: &Ctx, n: &NodeArgs, name: &str, pos: usize) -> Result<ValueId> {
    let t = n.tensor(name, pos)?;
    if !ctx.complex.contains(t) {
        return Err(Error::Compile(format!(
            "node '{}' ({}): '{name}' should be a complex tensor",
            n.name, n.target
        )));
    }
    ctx.value(t)
}

fn real_arg(ctx: &Ctx, n: &NodeArgs, name: &str, pos: usize) -> Result<ValueId> {
    let t = n.tensor(name, pos)?;
    if ctx.complex.contains(t) {
        return Err(unsupported(n));
    }
    ctx.value(t)
}

/// `v` with a trailing dim of 1, to pair with another part or broadcast against pairs.
fn trailing(ctx: &mut Ctx, v: ValueId) -> Result<ValueId> {
    let mut shape = ctx.b.shape(v);
    shape.push(Dim::Const(1));
    ctx.b.reshape(v, shape)
}

/// The real and imaginary parts of `z`, each keeping a trailing dim of 1.
fn parts(ctx: &mut Ctx, z: ValueId) -> Result<(ValueId, ValueId)> {
    let last = ctx.b.rank(z) - 1;
    let re = ctx.b.slice(z, last, Dim::Const(0), Dim::Const(1), 1)?;
    let im = ctx.b.slice(z, last, Dim::Const(1), Dim::Const(2), 1)?;
    Ok((re, im))
}

/// Pairs from parts with a trailing dim of 1 (broadcast to one shape first).
fn join(ctx: &mut Ctx, re: ValueId, im: ValueId) -> Result<ValueId> {
    let v = ctx.b.broadcast_all(&[re, im])?;
    let last = ctx.b.rank(v[0]) - 1;
    ctx.b.concat(&v, last)
}

/// Pairs from real and imaginary parts of the complex shape.
fn pair(ctx: &mut Ctx, re: ValueId, im: ValueId) -> Result<ValueId> {
    let re = trailing(ctx, re)?;
    let im = trailing(ctx, im)?;
    join(ctx, re, im)
}

/// An operand of complex arithmetic: its real part (trailing dim 1 for tensors) and its
/// imaginary part, absent for a real operand.
struct Parts {
    re: Operand,
    im: Option<Operand>,
}

fn arith_operand(ctx: &mut Ctx, n: &NodeArgs, name: &str, pos: usize) -> Result<Parts> {
    if let Ok(t) = n.tensor(name, pos) {
        let v = ctx.value(t)?;
        if ctx.complex.contains(t) {
            let (re, im) = parts(ctx, v)?;
            return Ok(Parts {
                re: Operand::Tensor(re),
                im: Some(Operand::Tensor(im)),
            });
        }
        let re = trailing(ctx, v)?;
        return Ok(Parts {
            re: Operand::Tensor(re),
            im: None,
        });
    }
    match n.scalar(name, pos)? {
        Some(s) => Ok(Parts {
            re: Operand::Scalar(s),
            im: None,
        }),
        None => Err(unsupported(n)),
    }
}

/// a ± b where either may be absent (zero).
fn add_opt(
    ctx: &mut Ctx,
    a: Option<Operand>,
    b: Option<Operand>,
    sub: bool,
) -> Result<Option<Operand>> {
    Ok(match (a, b) {
        (Some(a), b) => Some(combine(ctx, a, b, sub)?),
        (None, Some(b)) if sub => Some(Operand::Tensor(ctx.b.binary(
            BinaryOp::Mul,
            b,
            Operand::Scalar(Scalar::Int(-1)),
        )?)),
        (None, b) => b,
    })
}

/// a ± b, b absent meaning zero.
fn combine(ctx: &mut Ctx, a: Operand, b: Option<Operand>, sub: bool) -> Result<Operand> {
    let Some(b) = b else { return Ok(a) };
    let op = if sub { BinaryOp::Sub } else { BinaryOp::Add };
    Ok(Operand::Tensor(ctx.b.binary(op, a, b)?))
}

fn mul(ctx: &mut Ctx, a: Operand, b: Operand) -> Result<Operand> {
    Ok(Operand::Tensor(ctx.b.binary(BinaryOp::Mul, a, b)?))
}

/// a·b where either may be absent (zero).
fn mul_opt(ctx: &mut Ctx, a: Option<Operand>, b: Option<Operand>) -> Result<Option<Operand>> {
    match (a, b) {
        (Some(a), Some(b)) => mul(ctx, a, b).map(Some),
        _ => Ok(None),
    }
}

/// Complex mul, div, add, sub and rsub (with `alpha`), either side complex, real or a
/// scalar.
fn arithmetic(ctx: &mut Ctx, n: &NodeArgs, op: &str) -> Result<Out> {
    let (mut a, mut b) = (
        arith_operand(ctx, n, "self", 0)?,
        arith_operand(ctx, n, "other", 1)?,
    );
    // rsub(self, other, alpha) = other − alpha·self
    let op = if op == "rsub" {
        std::mem::swap(&mut a, &mut b);
        "sub"
    } else {
        op
    };
    if let Some(alpha) = n.scalar("alpha", 2)? {
        let alpha = Operand::Scalar(alpha);
        b = Parts {
            re: mul(ctx, b.re, alpha)?,
            im: mul_opt(ctx, b.im, Some(alpha))?,
        };
    }
    let (re, im) = match op {
        "add" | "sub" => {
            let sub = op == "sub";
            (
                combine(ctx, a.re, Some(b.re), sub)?,
                add_opt(ctx, a.im, b.im, sub)?,
            )
        }
        "mul" => {
            // (a + bi)(c + di) = (ac − bd) + (ad + bc)i
            let ac = mul(ctx, a.re, b.re)?;
            let bd = mul_opt(ctx, a.im, b.im)?;
            let ad = mul_opt(ctx, Some(a.re), b.im)?;
            let bc = mul_opt(ctx, a.im, Some(b.re))?;
            (combine(ctx, ac, bd, true)?, add_opt(ctx, ad, bc, false)?)
        }
        _ => {
            // (a + bi)/(c + di) = ((ac + bd) + (bc − ad)i) / (c² + d²)
            if n.string("rounding_mode", 2)?.is_some() {
                return Err(unsupported(n));
            }
            let ac = mul(ctx, a.re, b.re)?;
            let bd = mul_opt(ctx, a.im, b.im)?;
            let bc = mul_opt(ctx, a.im, Some(b.re))?;
            let ad = mul_opt(ctx, Some(a.re), b.im)?;
            let cc = mul(ctx, b.re, b.re)?;
            let dd = mul_opt(ctx, b.im, b.im)?;
            let denominator = combine(ctx, cc, dd, false)?;
            let re = combine(ctx, ac, bd, false)?;
            let im = add_opt(ctx, bc, ad, true)?;
            let over = |ctx: &mut Ctx, v: Operand| -> Result<Operand> {
                Ok(Operand::Tensor(ctx.b.binary(
                    BinaryOp::Div,
                    v,
                    denominator,
                )?))
            };
            (over(ctx, re)?, im.map(|im| over(ctx, im)).transpose()?)
        }
    };
    // Both operands real cannot reach here: a complex value is involved.
    let Some(im) = im else {
        return Err(unsupported(n));
    };
    let as_tensor = |v: Operand| -> Result<ValueId> {
        match v {
            Operand::Tensor(t) => Ok(t),
            // Both sides scalars cannot happen: a complex tensor is involved.
            Operand::Scalar(_) => Err(unsupported(n)),
        }
    };
    let (re, im) = (as_tensor(re)?, as_tensor(im)?);
    let dtype = crate::dtype::DType::promote(ctx.b.dtype(re), ctx.b.dtype(im));
    let re = ctx.b.cast(re, dtype)?;
    let im = ctx.b.cast(im, dtype)?;
    Ok(Out::Value(join(ctx, re, im)?))
}

/// `to`/`_to_copy`: complex to complex (casting the parts), or real to complex (zero
/// imaginary parts). Complex to real, which drops the imaginary part, is named.
fn to_copy(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let name = n.tensor("self", 0)?;
    let x = ctx.value(name)?;
    let parts = match n.raw("dtype", 1) {
        None => return Ok(Out::Value(x)),
        Some(Arg::ComplexType(d)) => *d,
        Some(_) => return Err(unsupported(n)),
    };
    if ctx.complex.contains(name) {
        return Ok(Out::Value(ctx.b.cast(x, parts)?));
    }
    let re = ctx.b.cast(x, parts)?;
    let re = trailing(ctx, re)?;
    let im = ctx.b.binary(
        BinaryOp::Mul,
        Operand::Tensor(re),
        Operand::Scalar(Scalar::Int(0)),
    )?;
    Ok(Out::Value(join(ctx, re, im)?))
}

/// How a shape op's arguments change when its tensor carries the pair dim last.
#[derive(Clone, Copy)]
enum Edit {
    /// A dim (`default` when absent), counted in the complex rank (+1 where the op makes a
    /// new dim: unsqueeze, stack): made non-negative so it cannot reach the pair dim.
    Dim(&'static str, usize, Option<i64>, usize),
    /// A list of dims; absent or empty means every complex dim when `all` is set.
    Dims(&'static str, usize, bool),
    /// A target shape: the pair dim appended.
    Shape(&'static str, usize),
    /// Repeat counts: 1 appended.
    Repeats(&'static str, usize),
    /// A permutation: the pair dim stays last.
    Perm(&'static str, usize),
    /// Pads listed from the last dim backwards: none for the pair dim, first.
    Pads(&'static str, usize),
}

fn shape_edits(name: &str, overload: &str) -> Option<&'static [Edit]> {
    use Edit::*;
    Some(match (name, overload) {
        ("view" | "_unsafe_view" | "view_copy", _) => &[Shape("size", 1)],
        ("reshape", _) => &[Shape("shape", 1)],
        ("expand" | "expand_copy", _) => &[Shape("size", 1)],
        ("permute" | "permute_copy", _) => &[Perm("dims", 1)],
        ("transpose", "int") => &[Dim("dim0", 1, None, 0), Dim("dim1", 2, None, 0)],
        ("unsqueeze" | "unsqueeze_copy", _) => &[Dim("dim", 1, None, 1)],
        ("squeeze" | "squeeze_copy", "dim") => &[Dim("dim", 1, None, 0)],
        ("squeeze" | "squeeze_copy", "dims") => &[Dims("dim", 1, false)],
        ("slice" | "slice_copy", "Tensor") => &[Dim("dim", 1, Some(0), 0)],
        ("select" | "select_copy", "int") => &[Dim("dim", 1, None, 0)],
        ("narrow", _) => &[Dim("dim", 1, None, 0)],
        ("slice_scatter", _) => &[Dim("dim", 2, Some(0), 0)],
        ("select_scatter", _) => &[Dim("dim", 2, None, 0)],
        ("cat" | "concat", _) => &[Dim("dim", 1, Some(0), 0)],
        ("stack", _) => &[Dim("dim", 1, Some(0), 1)],
        ("split" | "split_with_sizes", _) => &[Dim("dim", 2, Some(0), 0)],
        ("chunk", _) => &[Dim("dim", 2, Some(0), 0)],
        ("unbind", _) => &[Dim("dim", 1, Some(0), 0)],
        ("flip", _) => &[Dims("dims", 1, false)],
        ("flatten", "using_ints") => &[
            Dim("start_dim", 1, Some(0), 0),
            Dim("end_dim", 2, Some(-1), 0),
        ],
        ("unflatten", "int") => &[Dim("dim", 1, None, 0)],
        ("repeat", _) => &[Repeats("repeats", 1)],
        ("constant_pad_nd", _) => &[Pads("pad", 1)],
        ("index_select", _) => &[Dim("dim", 1, None, 0)],
        ("sym_size", "int") => &[Dim("dim", 1, None, 0)],
        ("sum", "dim_IntList") | ("mean", "dim") => &[Dims("dim", 1, true)],
        // Index tensors name leading dims only; the pair dim is never indexed.
        ("index", "Tensor") | ("index_put", _) => &[],
        _ => return None,
    })
}

/// `n`'s arguments for the real op on the pairs.
fn patch(ctx: &Ctx, n: &NodeArgs, edits: &[Edit]) -> Result<NodeArgs> {
    let first = n
        .tensor_names()
        .find(|t| ctx.complex.contains(*t))
        .ok_or_else(|| unsupported(n))?;
    // Every tensor but index tensors is complex: a real one would need its own pair dim.
    let is_index = |arg: &str| matches!(arg, "index" | "indices");
    if n.tensor_args()
        .any(|(arg, t)| !is_index(arg) && !ctx.complex.contains(t))
    {
        return Err(unsupported(n));
    }
    let rank = ctx.b.rank(ctx.value(first)?) as i64 - 1;
    let bad = |what: String| {
        Error::Compile(format!(
            "node '{}' ({}): {what} for a complex tensor of rank {rank}",
            n.name, n.target
        ))
    };
    let norm = |d: i64, extra: usize| -> Result<i64> {
        let r = rank + extra as i64;
        let d = if d < 0 { d + r } else { d };
        if (0..r.max(1)).contains(&d) {
            Ok(d)
        } else {
            Err(bad(format!("dim {d}")))
        }
    };
    let mut out = n.clone();
    for &edit in edits {
        out = match edit {
            Edit::Dim(name, pos, default, extra) => match n.opt_int(name, pos)?.or(default) {
                Some(d) => out.with(name, pos, Arg::Int(norm(d, extra)?)),
                None => out,
            },
            Edit::Dims(name, pos, all) => {
                let dims = n.opt_ints(name, pos)?.unwrap_or_default();
                let dims: Vec<i64> = if dims.is_empty() && all {
                    (0..rank).collect()
                } else {
                    dims.iter().map(|&d| norm(d, 0)).collect::<Result<_>>()?
                };
                out.with(name, pos, Arg::Ints(dims))
            }
            Edit::Shape(name, pos) | Edit::Repeats(name, pos) => {
                let last = if matches!(edit, Edit::Shape(..)) {
                    2
                } else {
                    1
                };
                let arg = match n.raw(name, pos) {
                    Some(Arg::Ints(v)) => Arg::Ints(v.iter().copied().chain([last]).collect()),
                    Some(Arg::SymInts(v)) => {
                        Arg::SymInts(v.iter().cloned().chain([SymRef::Const(last)]).collect())
                    }
                    other => return Err(bad(format!("sizes {other:?}"))),
                };
                out.with(name, pos, arg)
            }
            Edit::Perm(name, pos) => {
                let mut dims: Vec<i64> = n
                    .ints(name, pos)?
                    .iter()
                    .map(|&d| norm(d, 0))
                    .collect::<Result<_>>()?;
                dims.push(rank);
                out.with(name, pos, Arg::Ints(dims))
            }
            Edit::Pads(name, pos) => {
                let pads: Vec<i64> = [0, 0].into_iter().chain(n.ints(name, pos)?).collect();
                out.with(name, pos, Arg::Ints(pads))
            }
        };
    }
    Ok(out)
}
