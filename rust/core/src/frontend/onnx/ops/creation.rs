//! Ops that create tensors: Constant, ConstantOfShape, Range (an iota) and Trilu (a mask
//! built from two iotas).

use super::{one, Handler};
use crate::dim::{Dim, DimOp};
use crate::dtype::{DType, Scalar};
use crate::error::Result;
use crate::frontend::builder::Operand;
use crate::frontend::onnx::external::ExternalData;
use crate::frontend::onnx::known::Known;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::tensor::{self, Decoded};
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, Op, TensorType, ValueId};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "Constant" => constant,
        "ConstantOfShape" => constant_of_shape,
        "Range" => range,
        "Trilu" => trilu,
        "EyeLike" => eye_like,
        _ => return None,
    })
}

/// A constant's value from whichever `value*` attribute the node carries.
fn constant_value(n: &Node) -> Result<Decoded> {
    let no_files = ExternalData::new(None);
    if let Some(t) = n.tensor("value")? {
        return tensor::decode(t, &no_files, &n.name);
    }
    let f32s = |v: &[f32], shape: Vec<usize>| Decoded {
        dtype: DType::F32,
        shape,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    };
    let i64s = |v: &[i64], shape: Vec<usize>| Decoded {
        dtype: DType::I64,
        shape,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    };
    if n.has_attr("value_float") {
        return Ok(f32s(&[n.float("value_float", 0.0)?], vec![]));
    }
    if let Some(v) = n.floats("value_floats")? {
        return Ok(f32s(&v, vec![v.len()]));
    }
    if n.has_attr("value_int") {
        return Ok(i64s(&[n.int("value_int", 0)?], vec![]));
    }
    if let Some(v) = n.ints("value_ints")? {
        return Ok(i64s(&v, vec![v.len()]));
    }
    if n.has_attr("sparse_value") || n.has_attr("value_string") || n.has_attr("value_strings") {
        return Err(n.unsupported("sparse and string constants"));
    }
    Err(n.err("has no value attribute"))
}

fn constant(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let d = constant_value(n)?;
    if d.shape.len() <= 1 && (d.dtype.is_int() || d.dtype == DType::Bool) {
        if let Some(v) = tensor::ints(&d) {
            return Ok(vec![Val::known(Known {
                dtype: d.dtype,
                scalar: d.shape.is_empty(),
                dims: v.into_iter().map(Dim::Const).collect(),
            })]);
        }
    }
    one(ctx.constant(d.dtype, d.shape, d.bytes)?)
}

fn constant_of_shape(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let shape = ctx.known_required(n, 0, "shape")?;
    if shape.scalar {
        return Err(n.err("the shape must be 1-D"));
    }
    if shape
        .dims
        .iter()
        .any(|d| d.as_const().is_some_and(|v| v < 0))
    {
        return Err(n.err("shape entries must be non-negative"));
    }
    let (dtype, value) = match n.tensor("value")? {
        Some(t) => {
            let d = tensor::decode(t, &ExternalData::new(None), &n.name)?;
            if d.shape.iter().product::<usize>() != 1 {
                return Err(n.err("value must hold one element"));
            }
            let v = tensor::floats(&d)[0];
            let s = if d.dtype.is_float() {
                Scalar::Float(v)
            } else if d.dtype == DType::Bool {
                Scalar::Bool(v != 0.0)
            } else {
                Scalar::Int(tensor::ints(&d).map_or(0, |x| x[0]))
            };
            (d.dtype, s)
        }
        None => (DType::F32, Scalar::Float(0.0)),
    };
    // A small filled integer vector is itself a shape value (e.g. ones for Expand).
    if dtype.is_int() && shape.dims.len() == 1 {
        if let Some(len) = shape.dims[0].as_const().filter(|&l| l <= 64) {
            let dims = vec![Dim::Const(value.as_i64()); len as usize];
            return Ok(vec![Val::known(Known::vector(dtype, dims))]);
        }
    }
    one(ctx.b.full(value, dtype, shape.dims)?)
}

/// Range(start, limit, delta): `ceil((limit − start) / delta)` elements of an iota.
fn range(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let dtype = {
        let s = ctx.input(n, 0)?;
        ctx.b.dtype(s)
    };
    if dtype.is_int() {
        let one_value = |k: Known, what: &str| match k.dims.as_slice() {
            [d] => Ok(d.clone()),
            _ => Err(n.err(format!("{what} must hold one value"))),
        };
        let start = one_value(ctx.known_required(n, 0, "start")?, "start")?;
        let limit = one_value(ctx.known_required(n, 1, "limit")?, "limit")?;
        let delta = one_value(ctx.known_required(n, 2, "delta")?, "delta")?
            .as_const()
            .ok_or_else(|| n.unsupported("a symbolic delta"))?;
        if delta == 0 {
            return Err(n.err("delta must not be 0"));
        }
        let start_c = start.as_const();
        let span = Dim::binary(DimOp::Sub, limit, start.clone());
        let len = if delta > 0 {
            Dim::binary(
                DimOp::FloorDiv,
                Dim::binary(DimOp::Add, span, Dim::Const(delta - 1)),
                Dim::Const(delta),
            )
        } else {
            Dim::binary(
                DimOp::FloorDiv,
                Dim::binary(DimOp::Sub, Dim::Const(-delta - 1), span),
                Dim::Const(-delta),
            )
        };
        let len = Dim::binary(DimOp::Max, len, Dim::Const(0));
        let Some(s) = start_c else {
            // A symbolic start: iota from 0, shifted by the start's value.
            let base = iota(ctx, Scalar::Int(0), Scalar::Int(delta), dtype, len)?;
            let sv = ctx.b.dim_value(&start, dtype)?;
            return one(ctx.b.binary_in(
                BinaryOp::Add,
                Operand::Tensor(base),
                Operand::Tensor(sv),
                dtype,
            )?);
        };
        return one(iota(ctx, Scalar::Int(s), Scalar::Int(delta), dtype, len)?);
    }
    let vals: Vec<f64> = (0..3)
        .map(|k| ctx.const_floats(n, k).and_then(|v| v.first().copied()))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| n.unsupported("float start/limit/delta computed at run time"))?;
    let (start, limit, delta) = (vals[0], vals[1], vals[2]);
    if delta == 0.0 || !delta.is_finite() || !start.is_finite() || !limit.is_finite() {
        return Err(n.err("start, limit and delta must be finite and delta non-zero"));
    }
    let len = ((limit - start) / delta).ceil().max(0.0);
    if len > (1u64 << 40) as f64 {
        return Err(n.err(format!("would make {len} elements")));
    }
    one(iota(
        ctx,
        Scalar::Float(start),
        Scalar::Float(delta),
        dtype,
        Dim::Const(len as i64),
    )?)
}

pub(super) fn iota(
    ctx: &mut Ctx,
    start: Scalar,
    step: Scalar,
    dtype: DType,
    len: Dim,
) -> Result<ValueId> {
    ctx.b
        .source(Op::Iota { start, step }, TensorType::new(dtype, vec![len]))
}

/// `j − i` over a `[rows, cols]` grid: how far each element is from the main diagonal.
fn diagonal_offsets(ctx: &mut Ctx, rows: &Dim, cols: &Dim) -> Result<ValueId> {
    let i = iota(
        ctx,
        Scalar::Int(0),
        Scalar::Int(1),
        DType::I64,
        rows.clone(),
    )?;
    let i = ctx.b.reshape(i, vec![rows.clone(), Dim::Const(1)])?;
    let j = iota(
        ctx,
        Scalar::Int(0),
        Scalar::Int(1),
        DType::I64,
        cols.clone(),
    )?;
    let j = ctx.b.reshape(j, vec![Dim::Const(1), cols.clone()])?;
    ctx.b
        .binary(BinaryOp::Sub, Operand::Tensor(j), Operand::Tensor(i))
}

/// Trilu keeps `j − i ≥ k` (upper) or `j − i ≤ k` (lower) of the last two dims.
fn trilu(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let shape = ctx.b.shape(x);
    let r = shape.len();
    if r < 2 {
        return Err(n.err("input must have rank ≥ 2"));
    }
    let k = if n.input(1).is_some() {
        ctx.const_ints(n, 1, "k")?.first().copied().unwrap_or(0)
    } else {
        0
    };
    let diff = diagonal_offsets(ctx, &shape[r - 2], &shape[r - 1])?;
    let cmp = if n.flag("upper", true)? {
        BinaryOp::Ge
    } else {
        BinaryOp::Le
    };
    let keep = ctx
        .b
        .binary(cmp, Operand::Tensor(diff), Operand::Scalar(Scalar::Int(k)))?;
    let zero = ctx.b.full(Scalar::Int(0), ctx.b.dtype(x), vec![])?;
    one(ctx
        .b
        .where_(keep, Operand::Tensor(x), Operand::Tensor(zero))?)
}

/// EyeLike: ones where `j - i == k` in a 2-d tensor of the input's shape, zeros elsewhere,
/// in `dtype` (the input's type when absent). torch's exporter writes it for `diagonal`.
fn eye_like(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let shape = ctx.b.shape(x);
    if shape.len() != 2 {
        return Err(n.err(format!("input of rank {} (2)", shape.len())));
    }
    let dtype = match n.int("dtype", 0)? {
        0 => ctx.b.dtype(x),
        code => crate::frontend::onnx::tensor::dtype_from_onnx(
            i32::try_from(code).unwrap_or(0),
            &n.name,
        )?,
    };
    let k = n.int("k", 0)?;
    let diff = diagonal_offsets(ctx, &shape[0], &shape[1])?;
    let on = ctx.b.binary(
        BinaryOp::Eq,
        Operand::Tensor(diff),
        Operand::Scalar(Scalar::Int(k)),
    )?;
    one(ctx.b.cast(on, dtype)?)
}
