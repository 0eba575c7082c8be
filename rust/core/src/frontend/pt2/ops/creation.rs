//! Tensor creation: full/zeros/ones (and their `_like`/`new_` forms), scalar_tensor, arange,
//! triu_indices/tril_indices.

use super::{tensor, Handler};
use crate::dim::{Dim, DimOp};
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::builder::Operand;
use crate::frontend::pt2::args::{Arg, NodeArgs};
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, Op, TensorType};

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    Some(match (name, overload) {
        ("full", "default") => |c, n| full(c, n, None, "size", 0),
        ("zeros", "default") => |c, n| full(c, n, Some(Scalar::Int(0)), "size", 0),
        ("ones", "default") => |c, n| full(c, n, Some(Scalar::Int(1)), "size", 0),
        // Uninitialized memory reads as zeros (`empty_permuted`'s layout is not a value).
        ("empty" | "empty_permuted", "memory_format" | "default") => {
            |c, n| full(c, n, Some(Scalar::Int(0)), "size", 0)
        }
        ("new_full", "default") => |c, n| full(c, n, None, "size", 1),
        ("new_zeros", "default") => |c, n| full(c, n, Some(Scalar::Int(0)), "size", 1),
        ("new_ones", "default") => |c, n| full(c, n, Some(Scalar::Int(1)), "size", 1),
        ("new_empty", "default") => |c, n| full(c, n, Some(Scalar::Int(0)), "size", 1),
        ("full_like", "default") => |c, n| like(c, n, None),
        ("zeros_like", "default") => |c, n| like(c, n, Some(Scalar::Int(0))),
        ("ones_like", "default") => |c, n| like(c, n, Some(Scalar::Int(1))),
        ("empty_like", "default") => |c, n| like(c, n, Some(Scalar::Int(0))),
        ("scalar_tensor", "default") => scalar_tensor,
        ("arange", "default" | "start" | "start_step") => arange,
        ("triu_indices", "default") => |c, n| triangle_indices(c, n, true),
        ("tril_indices", "default") => |c, n| triangle_indices(c, n, false),
        _ => return None,
    })
}

fn default_dtype(s: Scalar) -> DType {
    match s {
        Scalar::Bool(_) => DType::Bool,
        Scalar::Int(_) => DType::I64,
        Scalar::Float(_) => DType::F32,
    }
}

fn size_arg(ctx: &Ctx, n: &NodeArgs, name: &str, pos: usize) -> Result<Vec<Dim>> {
    match n.raw(name, pos) {
        Some(Arg::Ints(v)) => Ok(v.iter().map(|&d| Dim::Const(d)).collect()),
        Some(Arg::SymInts(v)) => v.iter().map(|s| ctx.sym(s)).collect(),
        None => Ok(vec![]),
        other => Err(Error::Compile(format!("node '{}': size {other:?}", n.name))),
    }
}

fn full(ctx: &mut Ctx, n: &NodeArgs, fixed: Option<Scalar>, size: &str, pos: usize) -> Result<Out> {
    let shape = size_arg(ctx, n, size, pos)?;
    let value = match fixed {
        Some(v) => v,
        None => n
            .scalar("fill_value", pos + 1)?
            .ok_or_else(|| Error::Compile(format!("node '{}': full without fill_value", n.name)))?,
    };
    let dtype = match n.dtype("dtype", usize::MAX)? {
        Some(d) => d,
        // new_* inherit the source tensor's dtype.
        None if pos == 1 => ctx.b.dtype(tensor(ctx, n, "self", 0)?),
        None if fixed.is_some() => DType::F32,
        None => default_dtype(value),
    };
    Ok(Out::Value(ctx.b.full(value, dtype, shape)?))
}

fn like(ctx: &mut Ctx, n: &NodeArgs, fixed: Option<Scalar>) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let value = match fixed {
        Some(v) => v,
        None => n.scalar("fill_value", 1)?.ok_or_else(|| {
            Error::Compile(format!("node '{}': full_like without fill_value", n.name))
        })?,
    };
    let dtype = n.dtype("dtype", usize::MAX)?.unwrap_or(ctx.b.dtype(x));
    let shape = ctx.b.shape(x);
    Ok(Out::Value(ctx.b.full(value, dtype, shape)?))
}

fn scalar_tensor(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let dtype = n.dtype("dtype", usize::MAX)?.unwrap_or(DType::F32);
    if let Some(Arg::SymInt(s)) = n.raw("s", 0) {
        // A size as a tensor (Ember returns a graph's size outputs this way).
        let d = ctx.sym(s)?;
        let v = ctx.b.dim_value(&d, DType::I64)?;
        return Ok(Out::Value(ctx.b.cast(v, dtype)?));
    }
    let value = n
        .scalar("s", 0)?
        .ok_or_else(|| Error::Compile(format!("node '{}': scalar_tensor without value", n.name)))?;
    Ok(Out::Value(ctx.b.full(value, dtype, vec![])?))
}

fn arange(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let overload = n.target.rsplit('.').next().unwrap_or("default");
    // A bound is a number, or a symbolic size (`arange(past, past + new)` in a decode step).
    let get = |name: &str, pos: usize| -> Result<Option<Bound>> {
        match n.raw(name, pos) {
            Some(Arg::SymInt(s)) => Ok(Some(match ctx.sym(s)? {
                Dim::Const(c) => Bound::Num(Scalar::Int(c)),
                d => Bound::Sym(d),
            })),
            _ => Ok(n.scalar(name, pos)?.map(Bound::Num)),
        }
    };
    let zero = Bound::Num(Scalar::Int(0));
    let one = Bound::Num(Scalar::Int(1));
    let (start, end, step) = match overload {
        "default" => (zero, get("end", 0)?, one),
        "start" => (get("start", 0)?.unwrap_or(zero), get("end", 1)?, one),
        _ => (
            get("start", 0)?.unwrap_or(zero),
            get("end", 1)?,
            get("step", 2)?.unwrap_or(one),
        ),
    };
    let end =
        end.ok_or_else(|| Error::Compile(format!("node '{}': arange without end", n.name)))?;
    let (start, end, step) = match (start, end, step) {
        (Bound::Num(a), Bound::Num(b), Bound::Num(c)) => (a, b, c),
        (start, end, step) => return symbolic_arange(ctx, n, start, end, step),
    };
    let any_float = [start, end, step]
        .iter()
        .any(|s| matches!(s, Scalar::Float(_)));
    let dtype =
        n.dtype("dtype", usize::MAX)?
            .unwrap_or(if any_float { DType::F32 } else { DType::I64 });
    let (s, e, st) = (start.as_f64(), end.as_f64(), step.as_f64());
    if st == 0.0 || !((e - s) / st).is_finite() {
        return Err(Error::Shape(format!(
            "arange({s}, {e}, {st}) at '{}'",
            n.name
        )));
    }
    let len = ((e - s) / st).ceil().max(0.0) as i64;
    Ok(Out::Value(ctx.b.source(
        Op::Iota { start, step },
        TensorType::new(dtype, vec![Dim::Const(len)]),
    )?))
}

#[derive(Clone)]
enum Bound {
    Num(Scalar),
    Sym(Dim),
}

impl Bound {
    fn dim(&self) -> Option<Dim> {
        match self {
            Bound::Num(Scalar::Int(c)) => Some(Dim::Const(*c)),
            Bound::Num(_) => None,
            Bound::Sym(d) => Some(d.clone()),
        }
    }
}

/// `arange` over integer bounds of which some are symbolic sizes: the length is a size
/// expression, a symbolic start is added after counting from zero.
fn symbolic_arange(
    ctx: &mut Ctx,
    n: &NodeArgs,
    start: Bound,
    end: Bound,
    step: Bound,
) -> Result<Out> {
    let unsupported = |why: &str| Error::unsupported_because("aten.arange", &n.name, why);
    let (Some(s), Some(e)) = (start.dim(), end.dim()) else {
        return Err(unsupported("a symbolic bound mixed with a float bound"));
    };
    let st = match step {
        Bound::Num(Scalar::Int(c)) if c != 0 => c,
        _ => {
            return Err(unsupported(
                "a symbolic or non-integer step with symbolic bounds",
            ))
        }
    };
    // ceil((e - s) / st), at least 0, in floor divisions on sizes.
    let (span, by) = if st > 0 {
        (Dim::binary(DimOp::Sub, e, s.clone()), st)
    } else {
        (Dim::binary(DimOp::Sub, s.clone(), e), -st)
    };
    let len = Dim::binary(
        DimOp::FloorDiv,
        Dim::binary(DimOp::Add, span, Dim::Const(by - 1)),
        Dim::Const(by),
    );
    let len = Dim::binary(DimOp::Max, len, Dim::Const(0));
    let dtype = n.dtype("dtype", usize::MAX)?.unwrap_or(DType::I64);
    let mut v = ctx.b.source(
        Op::Iota {
            start: Scalar::Int(0),
            step: Scalar::Int(st),
        },
        TensorType::new(DType::I64, vec![len]),
    )?;
    if s != Dim::Const(0) {
        let offset = ctx.b.dim_value(&s, DType::I64)?;
        v = ctx
            .b
            .binary(BinaryOp::Add, Operand::Tensor(v), Operand::Tensor(offset))?;
    }
    Ok(Out::Value(ctx.b.cast(v, dtype)?))
}

/// `triu_indices(row, col, offset)` / `tril_indices`: the [2, N] (row, column) coordinates of
/// the upper (col − row ≥ offset) or lower (col − row ≤ offset) triangle of a row × col
/// matrix, row-major, as a constant.
fn triangle_indices(ctx: &mut Ctx, n: &NodeArgs, upper: bool) -> Result<Out> {
    let rows = n.int("row", 0)?;
    let cols = n.int("col", 1)?;
    let offset = n.opt_int("offset", 2)?.unwrap_or(0);
    // The coordinates are a constant of the graph; a matrix this large would be gigabytes.
    if rows < 0 || cols < 0 || rows.saturating_mul(cols) > 1 << 26 {
        return Err(Error::Compile(format!(
            "node '{}' ({}): a {rows} × {cols} matrix",
            n.name, n.target
        )));
    }
    let (mut r, mut c) = (Vec::new(), Vec::new());
    for i in 0..rows {
        for j in 0..cols {
            if (upper && j - i >= offset) || (!upper && j - i <= offset) {
                r.push(i);
                c.push(j);
            }
        }
    }
    let count = r.len() as i64;
    r.extend(c);
    let flat = crate::frontend::resample::index_const(&mut ctx.b, &r)?;
    let pairs = ctx
        .b
        .reshape(flat, vec![Dim::Const(2), Dim::Const(count)])?;
    let dtype = n.dtype("dtype", usize::MAX)?.unwrap_or(DType::I64);
    Ok(Out::Value(ctx.b.cast(pairs, dtype)?))
}
