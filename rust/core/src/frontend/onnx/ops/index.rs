//! Indexing: Gather, GatherElements, GatherND (as a linearized Gather; batch dims merged), OneHot (as a
//! comparison with an iota) and CumSum. Backends wrap negative indices and reject
//! out-of-range ones at run time.

use super::{axis, one, Handler};
use crate::dim::{numel, Dim};
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::builder::Operand;
use crate::frontend::onnx::known::Known;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, Op, ScanOp, ScatterReduce, ValueId};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "Gather" => gather,
        "GatherElements" => gather_elements,
        "GatherND" => gather_nd,
        "ScatterElements" => scatter_elements,
        "ScatterND" => scatter_nd,
        "OneHot" => one_hot,
        "CumSum" => cumsum,
        _ => return None,
    })
}

fn check_index(ctx: &Ctx, n: &Node, idx: ValueId) -> Result<()> {
    let d = ctx.b.dtype(idx);
    if d != DType::I64 && d != DType::I32 {
        return Err(n.err(format!("indices must be int32 or int64, got {d}")));
    }
    Ok(())
}

fn gather(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    // Picking entries of a known shape vector with constant indices stays known.
    if let (Some(data), Some(idx)) = (ctx.known(n, 0), ctx.known(n, 1)) {
        if let Some(ix) = idx.consts() {
            let len = data.dims.len() as i64;
            if !data.scalar && ix.iter().all(|&i| (-len..len).contains(&i)) {
                let dims = ix
                    .iter()
                    .map(|&i| data.dims[(if i < 0 { i + len } else { i }) as usize].clone())
                    .collect();
                return Ok(vec![Val::known(Known {
                    dtype: data.dtype,
                    scalar: idx.scalar,
                    dims,
                })]);
            }
        }
    }
    let x = ctx.input(n, 0)?;
    let idx = ctx.input(n, 1)?;
    check_index(ctx, n, idx)?;
    let a = axis(ctx, n.int("axis", 0)?, ctx.b.rank(x))?;
    one(ctx.b.op(Op::IndexSelect { axis: a }, &[x, idx])?)
}

fn gather_elements(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let idx = ctx.input(n, 1)?;
    check_index(ctx, n, idx)?;
    let a = axis(ctx, n.int("axis", 0)?, ctx.b.rank(x))?;
    one(ctx.b.op(Op::Gather { axis: a }, &[x, idx])?)
}

/// Wraps negative indices into `[0, size)`: `i + size` where `i < 0`.
fn wrap_negative(ctx: &mut Ctx, idx: ValueId, size: &Dim) -> Result<ValueId> {
    let dtype = ctx.b.dtype(idx);
    let neg = ctx.b.binary_in(
        BinaryOp::Lt,
        Operand::Tensor(idx),
        Operand::Scalar(Scalar::Int(0)),
        dtype,
    )?;
    let s = ctx.b.dim_value(size, dtype)?;
    let shifted = ctx.b.binary_in(
        BinaryOp::Add,
        Operand::Tensor(idx),
        Operand::Tensor(s),
        dtype,
    )?;
    ctx.b
        .where_(neg, Operand::Tensor(shifted), Operand::Tensor(idx))
}

/// `i < 0 || i >= size` (after wrapping negative indices).
fn out_of_range(ctx: &mut Ctx, i: ValueId, size: &Dim) -> Result<ValueId> {
    let s = ctx.b.dim_value(size, DType::I64)?;
    let low = ctx.b.binary(
        BinaryOp::Lt,
        Operand::Tensor(i),
        Operand::Scalar(Scalar::Int(0)),
    )?;
    let high = ctx
        .b
        .binary(BinaryOp::Ge, Operand::Tensor(i), Operand::Tensor(s))?;
    ctx.b
        .binary(BinaryOp::Or, Operand::Tensor(low), Operand::Tensor(high))
}

/// GatherND (batch_dims = 0): the last index axis addresses the leading `k` data dims;
/// they are linearized into one index into the data reshaped to `[d0·…·dk-1, rest…]`.
/// `[.., k]` index tuples into the first `k` dims of `xs` as row numbers of `xs` viewed as
/// `[Π xs[..k], xs[k..]..]`, shaped like the tuples' leading dims; returns (rows, the view's
/// row count). Negative components count from the end; a tuple with a component out of
/// range gets the row past the end, which the indexing op then rejects (an out-of-range
/// component could otherwise still give an in-range row: a silently wrong answer).
fn flat_rows(ctx: &mut Ctx, n: &Node, idx: ValueId, xs: &[Dim]) -> Result<(ValueId, Dim, usize)> {
    check_index(ctx, n, idx)?;
    let is = ctx.b.shape(idx);
    let Some(k) = is.last().and_then(Dim::as_const) else {
        return Err(n.err("indices need a constant last dim"));
    };
    let k = k as usize;
    if is.is_empty() || k == 0 || k > xs.len() {
        return Err(n.err(format!(
            "index tuples of length {k} for data of rank {}",
            xs.len()
        )));
    }
    let idx = ctx.b.cast(idx, DType::I64)?;
    let lead = is[..is.len() - 1].to_vec();
    let mut flat: Option<ValueId> = None;
    let mut invalid: Option<ValueId> = None;
    for j in 0..k {
        let col = ctx.b.slice(
            idx,
            is.len() - 1,
            Dim::Const(j as i64),
            Dim::Const(j as i64 + 1),
            1,
        )?;
        let col = ctx.b.reshape(col, lead.clone())?;
        let col = wrap_negative(ctx, col, &xs[j])?;
        let bad = out_of_range(ctx, col, &xs[j])?;
        invalid = Some(match invalid {
            None => bad,
            Some(acc) => ctx
                .b
                .binary(BinaryOp::Or, Operand::Tensor(acc), Operand::Tensor(bad))?,
        });
        let stride = numel(&xs[j + 1..k]);
        let term = if stride.as_const() == Some(1) {
            col
        } else {
            let s = ctx.b.dim_value(&stride, DType::I64)?;
            ctx.b
                .binary(BinaryOp::Mul, Operand::Tensor(col), Operand::Tensor(s))?
        };
        flat = Some(match flat {
            None => term,
            Some(acc) => {
                ctx.b
                    .binary(BinaryOp::Add, Operand::Tensor(acc), Operand::Tensor(term))?
            }
        });
    }
    let rows = numel(&xs[..k]);
    let past_end = ctx.b.dim_value(&rows, DType::I64)?;
    let flat = ctx.b.where_(
        invalid.expect("k ≥ 1"),
        Operand::Tensor(past_end),
        Operand::Tensor(flat.expect("k ≥ 1")),
    )?;
    Ok((flat, rows, k))
}

fn gather_nd(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let idx = ctx.input(n, 1)?;
    let xs = ctx.b.shape(x);
    let batch_dims = n.int("batch_dims", 0)?;
    if batch_dims != 0 {
        return gather_nd_batched(ctx, n, x, idx, batch_dims);
    }
    let (flat, rows, k) = flat_rows(ctx, n, idx, &xs)?;
    let mut data_shape = vec![rows];
    data_shape.extend(xs[k..].iter().cloned());
    let data = ctx.b.reshape(x, data_shape)?;
    one(ctx.b.op(Op::IndexSelect { axis: 0 }, &[data, flat])?)
}

/// GatherND whose first `batch_dims` dims of data and indices pair up: each batch's index
/// tuples address that batch's rows. The batches are merged into one dim and each row number
/// offset by its batch's first row, so it is one `IndexSelect` as without batch dims.
fn gather_nd_batched(
    ctx: &mut Ctx,
    n: &Node,
    x: ValueId,
    idx: ValueId,
    batch_dims: i64,
) -> Result<Vec<Val>> {
    let (xs, is) = (ctx.b.shape(x), ctx.b.shape(idx));
    let b = usize::try_from(batch_dims)
        .ok()
        .filter(|&b| b < xs.len() && b < is.len())
        .ok_or_else(|| {
            n.err(format!(
                "batch_dims {batch_dims} must be below the ranks of data ({}) and indices ({})",
                xs.len(),
                is.len()
            ))
        })?;
    if let Some(k) = (0..b).find(|&k| xs[k].provably_equal(&is[k]) == Some(false)) {
        return Err(Error::Shape(format!(
            "GatherND node '{}': batch dim {k} is {} in data and {} in indices",
            n.name, xs[k], is[k]
        )));
    }
    let batches = numel(&xs[..b]);
    let mut data_shape = vec![batches.clone()];
    data_shape.extend(xs[b..].iter().cloned());
    let data = ctx.b.reshape(x, data_shape)?;
    let mut idx_shape = vec![batches.clone()];
    idx_shape.extend(is[b..].iter().cloned());
    let idx = ctx.b.reshape(idx, idx_shape)?;
    // Row numbers within each batch; an invalid tuple is `rows` (one past the end).
    let (flat, rows, k) = flat_rows(ctx, n, idx, &xs[b..])?;
    let per_batch = ctx.b.dim_value(&rows, DType::I64)?;
    let iota = ctx.b.source(
        Op::Iota {
            start: Scalar::Int(0),
            step: Scalar::Int(1),
        },
        crate::ir::TensorType::new(DType::I64, vec![batches.clone()]),
    )?;
    let mut column = vec![Dim::Const(1); ctx.b.rank(flat)];
    column[0] = batches.clone();
    let iota = ctx.b.reshape(iota, column)?;
    let first_row = ctx.b.binary(
        BinaryOp::Mul,
        Operand::Tensor(iota),
        Operand::Tensor(per_batch),
    )?;
    let offset = ctx.b.binary(
        BinaryOp::Add,
        Operand::Tensor(flat),
        Operand::Tensor(first_row),
    )?;
    // Keep invalid tuples past the end of all rows, not in the next batch.
    let total = Dim::binary(crate::dim::DimOp::Mul, batches.clone(), rows.clone());
    let past_end = ctx.b.dim_value(&total, DType::I64)?;
    let invalid = ctx.b.binary(
        BinaryOp::Eq,
        Operand::Tensor(flat),
        Operand::Tensor(per_batch),
    )?;
    let flat = ctx
        .b
        .where_(invalid, Operand::Tensor(past_end), Operand::Tensor(offset))?;
    let mut rows_shape = vec![total];
    rows_shape.extend(xs[b + k..].iter().cloned());
    let data = ctx.b.reshape(data, rows_shape)?;
    let picked = ctx.b.op(Op::IndexSelect { axis: 0 }, &[data, flat])?;
    let mut out = xs[..b].to_vec();
    out.extend(is[b..is.len() - 1].iter().cloned());
    out.extend(xs[b + k..].iter().cloned());
    one(ctx.b.reshape(picked, out)?)
}

fn reduction(n: &Node) -> Result<ScatterReduce> {
    Ok(match n.string("reduction", "none")?.as_str() {
        "none" => ScatterReduce::None,
        "add" => ScatterReduce::Add,
        "mul" => ScatterReduce::Mul,
        "max" => ScatterReduce::Max,
        "min" => ScatterReduce::Min,
        other => return Err(n.err(format!("unknown reduction '{other}'"))),
    })
}

fn scatter_elements(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let idx = ctx.input(n, 1)?;
    let upd = ctx.input(n, 2)?;
    check_index(ctx, n, idx)?;
    let a = axis(ctx, n.int("axis", 0)?, ctx.b.rank(x))?;
    let reduce = reduction(n)?;
    one(ctx.b.op(Op::Scatter { axis: a, reduce }, &[x, idx, upd])?)
}

/// Rows of `data` viewed as `[Π data[..k], data[k..]..]` replaced (or combined) by rows of
/// `updates`: a `Scatter` on axis 0 of that view with each row number spread over its row.
fn scatter_nd(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let idx = ctx.input(n, 1)?;
    let upd = ctx.input(n, 2)?;
    let reduce = reduction(n)?;
    let xs = ctx.b.shape(x);
    let (flat, rows, k) = flat_rows(ctx, n, idx, &xs)?;
    let row = numel(&xs[k..]);
    let count = numel(&ctx.b.shape(flat));
    let data = ctx.b.reshape(x, vec![rows, row.clone()])?;
    let updates = ctx.b.reshape(upd, vec![count.clone(), row.clone()])?;
    let flat = ctx.b.reshape(flat, vec![count.clone(), Dim::Const(1)])?;
    let flat = ctx.b.op(
        Op::Expand {
            shape: vec![count, row],
        },
        &[flat],
    )?;
    let out = ctx
        .b
        .op(Op::Scatter { axis: 0, reduce }, &[data, flat, updates])?;
    one(ctx.b.reshape(out, xs)?)
}

/// OneHot: `indices == iota(depth)` placed at `axis`, selecting on/off values.
fn one_hot(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let idx = ctx.input(n, 0)?;
    let depth = ctx
        .const_floats(n, 1)
        .and_then(|v| v.first().copied())
        .ok_or_else(|| n.unsupported("its depth is computed at run time"))?;
    if depth < 1.0 || depth > (1u64 << 31) as f64 {
        return Err(n.err(format!("invalid depth {depth}")));
    }
    let depth = depth as i64;
    let values = ctx.input(n, 2)?;
    let r = ctx.b.rank(idx);
    let a = axis(ctx, n.int("axis", -1)?, r + 1)?;
    // Float indices are allowed by ONNX and truncate toward zero.
    let idx = ctx.b.cast(idx, DType::I64)?;
    let idx = wrap_negative(ctx, idx, &Dim::Const(depth))?;
    let mut ishape = ctx.b.shape(idx);
    ishape.insert(a, Dim::Const(1));
    let idx = ctx.b.reshape(idx, ishape)?;
    let iota = ctx.b.source(
        Op::Iota {
            start: Scalar::Int(0),
            step: Scalar::Int(1),
        },
        crate::ir::TensorType::new(DType::I64, vec![Dim::Const(depth)]),
    )?;
    let mut ashape = vec![Dim::Const(1); r + 1];
    ashape[a] = Dim::Const(depth);
    let iota = ctx.b.reshape(iota, ashape)?;
    let hit = ctx
        .b
        .binary(BinaryOp::Eq, Operand::Tensor(idx), Operand::Tensor(iota))?;
    let vlen = ctx.b.shape(values);
    if vlen.len() != 1 || vlen[0].as_const() != Some(2) {
        return Err(n.err("values must be a 2-element tensor [off, on]"));
    }
    let off = ctx.b.slice(values, 0, Dim::Const(0), Dim::Const(1), 1)?;
    let on = ctx.b.slice(values, 0, Dim::Const(1), Dim::Const(2), 1)?;
    let off = ctx.b.reshape(off, vec![])?;
    let on = ctx.b.reshape(on, vec![])?;
    one(ctx
        .b
        .where_(hit, Operand::Tensor(on), Operand::Tensor(off))?)
}

/// CumSum with `exclusive` (shift by one, zero first) and `reverse` (flip around it).
fn cumsum(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let mut x = ctx.input(n, 0)?;
    let ax = ctx.const_ints(n, 1, "axis")?;
    let [a] = ax.as_slice() else {
        return Err(n.err("axis must hold one value"));
    };
    let a = axis(ctx, *a, ctx.b.rank(x))?;
    let reverse = n.flag("reverse", false)?;
    let exclusive = n.flag("exclusive", false)?;
    if reverse {
        x = ctx.b.op(Op::Flip { axes: vec![a] }, &[x])?;
    }
    if exclusive {
        let size = ctx.b.shape(x)[a].clone();
        let mut pads = vec![(0, 0); ctx.b.rank(x)];
        pads[a] = (1, 0);
        let padded = ctx.b.op(
            Op::Pad {
                pads,
                value: Scalar::Int(0),
            },
            &[x],
        )?;
        x = ctx.b.slice(padded, a, Dim::Const(0), size, 1)?;
    }
    let mut y = ctx.b.op(
        Op::Scan {
            axis: a,
            op: ScanOp::Sum,
        },
        &[x],
    )?;
    if reverse {
        y = ctx.b.op(Op::Flip { axes: vec![a] }, &[y])?;
    }
    one(y)
}
