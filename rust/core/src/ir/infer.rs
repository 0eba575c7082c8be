//! Type rules: the output dtype and shape of every op, computed from its inputs.
//! The same rules build graphs (`Graph::add`) and check them (`verify`).

use super::op::{BinaryOp, Op, ReduceOp};
use super::TensorType;
use crate::dim::{format_shape, numel, Dim, DimOp};
use crate::dtype::DType;
use crate::error::{Error, Result};

fn shape_err<T>(msg: String) -> Result<T> {
    Err(Error::Shape(msg))
}

fn arity(op: &Op, inputs: &[&TensorType], n: usize) -> Result<()> {
    if inputs.len() != n {
        return Err(Error::Compile(format!(
            "{} takes {n} inputs, got {}",
            op.name(),
            inputs.len()
        )));
    }
    Ok(())
}

/// The one input of a unary op.
fn single_input<'a>(op: &Op, inputs: &[&'a TensorType]) -> Result<&'a TensorType> {
    arity(op, inputs, 1)?;
    Ok(inputs[0])
}

/// Two dims must agree; unknown (symbolic) equality is left to the run-time check.
fn same_dim(a: &Dim, b: &Dim, what: &str) -> Result<()> {
    if a.provably_equal(b) == Some(false) {
        return shape_err(format!("{what}: {a} vs {b}"));
    }
    Ok(())
}

fn same_shape(a: &[Dim], b: &[Dim], what: &str) -> Result<()> {
    if a.len() != b.len() {
        return shape_err(format!(
            "{what}: rank mismatch {} vs {}",
            format_shape(a),
            format_shape(b)
        ));
    }
    for (x, y) in a.iter().zip(b) {
        same_dim(
            x,
            y,
            &format!("{what} {} vs {}", format_shape(a), format_shape(b)),
        )?;
    }
    Ok(())
}

fn check_axis(axis: usize, rank: usize, op: &Op) -> Result<()> {
    if axis >= rank {
        return shape_err(format!(
            "{}: axis {axis} out of range for rank {rank}",
            op.name()
        ));
    }
    Ok(())
}

/// Output type of `op` applied to `inputs`. Source ops (input, weight, constant, full, iota)
/// have no inputs; for them `declared` is the node's type, which this checks.
pub fn infer_type(
    op: &Op,
    inputs: &[&TensorType],
    declared: Option<&TensorType>,
) -> Result<TensorType> {
    let first = inputs.first().copied();
    let out = match op {
        Op::Kernel { base, .. } => return infer_type(base, inputs, declared),
        Op::Input { .. } | Op::Weight { .. } | Op::Full { .. } => {
            arity(op, inputs, 0)?;
            declared
                .cloned()
                .ok_or_else(|| Error::Compile(format!("{} needs a declared type", op.name())))?
        }
        Op::Constant(data) => {
            arity(op, inputs, 0)?;
            let ty = declared
                .cloned()
                .ok_or_else(|| Error::Compile("constant needs a declared type".into()))?;
            let want: Vec<Dim> = data.shape.iter().map(|&d| Dim::from(d)).collect();
            same_shape(&ty.shape, &want, "constant shape")?;
            let n: usize = data.shape.iter().product();
            if data.bytes.len() != n * ty.dtype.size() {
                return Err(Error::Compile(format!(
                    "constant of shape {:?} {} has {} bytes",
                    data.shape,
                    ty.dtype,
                    data.bytes.len()
                )));
            }
            ty
        }
        Op::Iota { .. } => {
            arity(op, inputs, 0)?;
            let ty = declared
                .cloned()
                .ok_or_else(|| Error::Compile("iota needs a declared type".into()))?;
            if ty.rank() != 1 {
                return shape_err(format!("iota must be 1-D, got {}", format_shape(&ty.shape)));
            }
            ty
        }
        Op::Unary(u) => {
            let x = single_input(op, inputs)?;
            if u.needs_float() && !x.dtype.is_float() {
                return Err(Error::Compile(format!(
                    "{} needs a float input, got {}",
                    u.name(),
                    x.dtype
                )));
            }
            let dtype = if u.returns_bool() {
                DType::Bool
            } else {
                x.dtype
            };
            TensorType::new(dtype, x.shape.clone())
        }
        Op::Binary(b) => {
            arity(op, inputs, 2)?;
            let (x, y) = (inputs[0], inputs[1]);
            if x.dtype != y.dtype {
                return Err(Error::Compile(format!(
                    "{} operands must share a dtype (frontends cast): {} vs {}",
                    b.name(),
                    x.dtype,
                    y.dtype
                )));
            }
            same_shape(&x.shape, &y.shape, b.name())?;
            if matches!(b, BinaryOp::Atan2) && !x.dtype.is_float() {
                return Err(Error::Compile("atan2 needs float inputs".into()));
            }
            if b.is_logical() && x.dtype.is_float() {
                return Err(Error::Compile(format!(
                    "{} needs bool or integer inputs",
                    b.name()
                )));
            }
            let dtype = if b.is_comparison() {
                DType::Bool
            } else {
                x.dtype
            };
            TensorType::new(dtype, x.shape.clone())
        }
        Op::Where => {
            arity(op, inputs, 3)?;
            let (c, a, b) = (inputs[0], inputs[1], inputs[2]);
            if c.dtype != DType::Bool || a.dtype != b.dtype {
                return Err(Error::Compile(format!(
                    "where needs (bool, T, T), got ({}, {}, {})",
                    c.dtype, a.dtype, b.dtype
                )));
            }
            same_shape(&c.shape, &a.shape, "where")?;
            same_shape(&a.shape, &b.shape, "where")?;
            a.clone()
        }
        Op::Cast { to } => TensorType::new(*to, single_input(op, inputs)?.shape.clone()),
        Op::Reduce {
            op: r,
            axes,
            keepdim,
        } => {
            let x = single_input(op, inputs)?;
            if axes.windows(2).any(|w| w[0] >= w[1]) {
                return Err(Error::Compile(format!(
                    "reduce axes must be sorted: {axes:?}"
                )));
            }
            for &a in axes {
                check_axis(a, x.rank(), op)?;
            }
            if r.is_arg() && axes.len() != 1 {
                return Err(Error::Compile(format!(
                    "{} takes exactly one axis",
                    r.name()
                )));
            }
            let mut shape = Vec::new();
            for (i, d) in x.shape.iter().enumerate() {
                if axes.contains(&i) {
                    if *keepdim {
                        shape.push(Dim::Const(1));
                    }
                } else {
                    shape.push(d.clone());
                }
            }
            let dtype = match r {
                ReduceOp::ArgMax | ReduceOp::ArgMin => DType::I64,
                _ => x.dtype,
            };
            TensorType::new(dtype, shape)
        }
        Op::Dot | Op::IntegerDot => {
            arity(op, inputs, 2)?;
            let (a, b) = (inputs[0], inputs[1]);
            let integer = *op == Op::IntegerDot;
            let eight_bit = |d: DType| matches!(d, DType::U8 | DType::I8);
            if integer && !(eight_bit(a.dtype) && eight_bit(b.dtype)) {
                return shape_err(format!(
                    "integer_dot needs uint8 or int8 operands: {} x {}",
                    a.dtype, b.dtype
                ));
            }
            if a.rank() < 2 || a.rank() != b.rank() || (!integer && a.dtype != b.dtype) {
                return shape_err(format!(
                    "dot needs equal-rank (≥2) operands of one dtype: {} {} x {} {}",
                    a.dtype,
                    format_shape(&a.shape),
                    b.dtype,
                    format_shape(&b.shape)
                ));
            }
            let r = a.rank();
            same_shape(&a.shape[..r - 2], &b.shape[..r - 2], "dot batch dims")?;
            same_dim(&a.shape[r - 1], &b.shape[r - 2], "dot contraction dim")?;
            let mut shape = a.shape[..r - 1].to_vec();
            shape.push(b.shape[r - 1].clone());
            TensorType::new(if integer { DType::I32 } else { a.dtype }, shape)
        }
        Op::BlockQuantDot { bits, block } => {
            arity(op, inputs, 4)?;
            let (x, w, scales, zeros) = (inputs[0], inputs[1], inputs[2], inputs[3]);
            let k = x.shape.get(1).and_then(Dim::as_const);
            let n = w.shape.first().cloned().unwrap_or(Dim::Const(0));
            let shape_ok = x.rank() == 2
                && x.dtype.is_float()
                && w.rank() == 2
                && w.dtype == DType::U8
                && matches!(bits, 2 | 4 | 8)
                && *block > 0;
            let Some(k) = k.filter(|_| shape_ok) else {
                return shape_err(format!(
                    "block_quant_dot needs x [M, K] (float, K constant) and packed uint8 [N, bytes] \
                     of 2-, 4- or 8-bit values: {} {} x {} {}",
                    x.dtype,
                    format_shape(&x.shape),
                    w.dtype,
                    format_shape(&w.shape)
                ));
            };
            let blocks = (k as usize).div_ceil(*block);
            let row_bytes = blocks * block * *bits as usize / 8;
            same_dim(
                &w.shape[1],
                &Dim::Const(row_bytes as i64),
                "block_quant_dot row bytes",
            )?;
            for (what, t) in [("scales", scales), ("zeros", zeros)] {
                if t.dtype != DType::F32 || t.rank() != 2 {
                    return shape_err(format!(
                        "block_quant_dot {what} must be f32 [N, blocks], got {} {}",
                        t.dtype,
                        format_shape(&t.shape)
                    ));
                }
                same_dim(&t.shape[0], &n, "block_quant_dot rows")?;
                same_dim(
                    &t.shape[1],
                    &Dim::Const(blocks as i64),
                    "block_quant_dot blocks",
                )?;
            }
            TensorType::new(x.dtype, vec![x.shape[0].clone(), n])
        }
        Op::Reshape { shape } => {
            let x = single_input(op, inputs)?;
            same_dim(&numel(&x.shape), &numel(shape), "reshape element count")?;
            TensorType::new(x.dtype, shape.clone())
        }
        Op::Permute { perm } => {
            let x = single_input(op, inputs)?;
            let mut seen = vec![false; x.rank()];
            if perm.len() != x.rank() {
                return shape_err(format!("permute {perm:?} for rank {}", x.rank()));
            }
            for &p in perm {
                if p >= x.rank() || seen[p] {
                    return shape_err(format!("permute {perm:?} is not a permutation"));
                }
                seen[p] = true;
            }
            TensorType::new(x.dtype, perm.iter().map(|&p| x.shape[p].clone()).collect())
        }
        Op::Expand { shape } => {
            let x = single_input(op, inputs)?;
            if shape.len() != x.rank() {
                return shape_err(format!(
                    "expand {} to {} changes rank",
                    format_shape(&x.shape),
                    format_shape(shape)
                ));
            }
            for (from, to) in x.shape.iter().zip(shape) {
                if from.as_const() != Some(1) {
                    same_dim(from, to, "expand of a non-1 dim")?;
                }
            }
            TensorType::new(x.dtype, shape.clone())
        }
        Op::Slice {
            axis,
            start,
            end,
            step,
        } => {
            let x = single_input(op, inputs)?;
            check_axis(*axis, x.rank(), op)?;
            if *step < 1 {
                return shape_err(format!("slice step must be ≥ 1, got {step}"));
            }
            if let (Some(s), Some(e), Some(n)) =
                (start.as_const(), end.as_const(), x.shape[*axis].as_const())
            {
                if !(0 <= s && s <= e && e <= n) {
                    return shape_err(format!("slice [{s}:{e}] of a dim of size {n}"));
                }
            }
            // ceil((end - start) / step)
            let len = Dim::binary(
                DimOp::FloorDiv,
                &(end - start) + &Dim::Const(step - 1),
                Dim::Const(*step),
            );
            let mut shape = x.shape.clone();
            shape[*axis] = len;
            TensorType::new(x.dtype, shape)
        }
        Op::Flip { axes } => {
            let x = single_input(op, inputs)?;
            for &a in axes {
                check_axis(a, x.rank(), op)?;
            }
            x.clone()
        }
        Op::Pad { pads, .. } => {
            let x = single_input(op, inputs)?;
            if pads.len() != x.rank() || pads.iter().any(|&(a, b)| a < 0 || b < 0) {
                return shape_err(format!("pad {pads:?} for rank {}", x.rank()));
            }
            let shape = x
                .shape
                .iter()
                .zip(pads)
                .map(|(d, &(a, b))| d + &Dim::Const(a + b))
                .collect();
            TensorType::new(x.dtype, shape)
        }
        Op::Concat { axis } => {
            let x = first.ok_or_else(|| Error::Compile("concat of no tensors".into()))?;
            check_axis(*axis, x.rank(), op)?;
            let mut total = Dim::Const(0);
            for t in inputs {
                if t.dtype != x.dtype || t.rank() != x.rank() {
                    return shape_err(format!(
                        "concat of {} {} with {} {}",
                        x.dtype,
                        format_shape(&x.shape),
                        t.dtype,
                        format_shape(&t.shape)
                    ));
                }
                for (i, (a, b)) in x.shape.iter().zip(&t.shape).enumerate() {
                    if i != *axis {
                        same_dim(a, b, "concat")?;
                    }
                }
                total = &total + &t.shape[*axis];
            }
            let mut shape = x.shape.clone();
            shape[*axis] = total;
            TensorType::new(x.dtype, shape)
        }
        Op::CacheAppend { axis, len } => {
            arity(op, inputs, 3)?;
            let (past, new, lengths) = (inputs[0], inputs[1], inputs[2]);
            check_axis(*axis, past.rank(), op)?;
            if *axis == 0 || new.dtype != past.dtype || new.rank() != past.rank() {
                return shape_err(format!(
                    "cache_append on axis {axis} of {} {} with new {} {}",
                    past.dtype,
                    format_shape(&past.shape),
                    new.dtype,
                    format_shape(&new.shape)
                ));
            }
            for (i, (a, b)) in past.shape.iter().zip(&new.shape).enumerate() {
                if i != *axis {
                    same_dim(a, b, "cache_append")?;
                }
            }
            if lengths.rank() != 1 || !lengths.dtype.is_int() {
                return shape_err(format!(
                    "cache_append lengths must be a 1-d integer tensor, got {} {}",
                    lengths.dtype,
                    format_shape(&lengths.shape)
                ));
            }
            same_dim(&lengths.shape[0], &past.shape[0], "cache_append lengths")?;
            let mut shape = past.shape.clone();
            shape[*axis] = len.clone();
            TensorType::new(past.dtype, shape)
        }
        Op::Gather { axis } => {
            arity(op, inputs, 2)?;
            let (x, idx) = (inputs[0], inputs[1]);
            check_axis(*axis, x.rank(), op)?;
            if idx.rank() != x.rank() || !idx.dtype.is_int() {
                return shape_err(format!(
                    "gather index must be an integer tensor of rank {}, got {} {}",
                    x.rank(),
                    idx.dtype,
                    format_shape(&idx.shape)
                ));
            }
            TensorType::new(x.dtype, idx.shape.clone())
        }
        Op::Scatter { axis, .. } => {
            arity(op, inputs, 3)?;
            let (x, idx, upd) = (inputs[0], inputs[1], inputs[2]);
            check_axis(*axis, x.rank(), op)?;
            if idx.rank() != x.rank() || !idx.dtype.is_int() {
                return shape_err(format!(
                    "scatter index must be an integer tensor of rank {}, got {} {}",
                    x.rank(),
                    idx.dtype,
                    format_shape(&idx.shape)
                ));
            }
            if upd.dtype != x.dtype || upd.shape != idx.shape {
                return shape_err(format!(
                    "scatter updates must be {} {} (the index's shape), got {} {}",
                    x.dtype,
                    format_shape(&idx.shape),
                    upd.dtype,
                    format_shape(&upd.shape)
                ));
            }
            TensorType::new(x.dtype, x.shape.clone())
        }
        Op::IndexSelect { axis } => {
            arity(op, inputs, 2)?;
            let (x, idx) = (inputs[0], inputs[1]);
            check_axis(*axis, x.rank(), op)?;
            if !idx.dtype.is_int() {
                return shape_err(format!(
                    "index must be an integer tensor, got {}",
                    idx.dtype
                ));
            }
            let mut shape = x.shape[..*axis].to_vec();
            shape.extend(idx.shape.iter().cloned());
            shape.extend(x.shape[axis + 1..].iter().cloned());
            TensorType::new(x.dtype, shape)
        }
        Op::Argsort { axis, .. } => {
            let x = single_input(op, inputs)?;
            check_axis(*axis, x.rank(), op)?;
            TensorType::new(DType::I64, x.shape.clone())
        }
        Op::GroupedDot => {
            arity(op, inputs, 3)?;
            let (x, w, ends) = (inputs[0], inputs[1], inputs[2]);
            if x.rank() != 2
                || w.rank() != 3
                || ends.rank() != 1
                || x.dtype != w.dtype
                || !x.dtype.is_float()
            {
                return shape_err(format!(
                    "grouped dot needs x [S, K], w [G, K, N] of one float dtype and ends [G]: \
                     {} {} x {} {} by {}",
                    x.dtype,
                    format_shape(&x.shape),
                    w.dtype,
                    format_shape(&w.shape),
                    format_shape(&ends.shape)
                ));
            }
            if !ends.dtype.is_int() {
                return shape_err(format!(
                    "grouped dot ends must be integers, got {}",
                    ends.dtype
                ));
            }
            same_dim(&x.shape[1], &w.shape[1], "grouped dot contraction dim")?;
            same_dim(&w.shape[0], &ends.shape[0], "grouped dot group count")?;
            TensorType::new(x.dtype, vec![x.shape[0].clone(), w.shape[2].clone()])
        }
        Op::Scan { axis, .. } | Op::Softmax { axis, .. } => {
            let x = single_input(op, inputs)?;
            check_axis(*axis, x.rank(), op)?;
            if matches!(op, Op::Softmax { .. }) && !x.dtype.is_float() {
                return Err(Error::Compile("softmax needs a float input".into()));
            }
            x.clone()
        }
        Op::LayerNorm {
            axis,
            has_weight,
            has_bias,
            ..
        } => {
            arity(op, inputs, 1 + *has_weight as usize + *has_bias as usize)?;
            norm_type(op, inputs, *axis)?
        }
        Op::RmsNorm {
            axis, has_weight, ..
        } => {
            arity(op, inputs, 1 + *has_weight as usize)?;
            norm_type(op, inputs, *axis)?
        }
        Op::Attention { has_mask, .. } => {
            arity(op, inputs, 3 + *has_mask as usize)?;
            let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
            let r = q.rank();
            if r < 2 || k.rank() != r || v.rank() != r || !q.dtype.is_float() {
                return shape_err("attention needs float q, k, v of equal rank ≥ 2".into());
            }
            if k.dtype != q.dtype || v.dtype != q.dtype {
                return Err(Error::Compile(
                    "attention q, k, v must share a dtype".into(),
                ));
            }
            same_shape(&q.shape[..r - 2], &k.shape[..r - 2], "attention batch dims")?;
            same_shape(&k.shape[..r - 1], &v.shape[..r - 1], "attention k/v")?;
            same_dim(&q.shape[r - 1], &k.shape[r - 1], "attention head dim")?;
            if *has_mask {
                let m = inputs[3];
                let mut want = q.shape[..r - 1].to_vec();
                want.push(k.shape[r - 2].clone());
                same_shape(&m.shape, &want, "attention mask")?;
                if m.dtype != DType::Bool && m.dtype != q.dtype {
                    return Err(Error::Compile(format!(
                        "attention mask must be bool or {}, got {}",
                        q.dtype, m.dtype
                    )));
                }
            }
            let mut shape = q.shape[..r - 1].to_vec();
            shape.push(v.shape[r - 1].clone());
            TensorType::new(q.dtype, shape)
        }
        Op::Conv { .. } => super::window::conv_type(op, inputs)?,
        Op::Pool { .. } => super::window::pool_type(op, single_input(op, inputs)?)?,
    };
    Ok(out)
}

fn norm_type(op: &Op, inputs: &[&TensorType], axis: usize) -> Result<TensorType> {
    let x = inputs[0];
    check_axis(axis, x.rank(), op)?;
    if !x.dtype.is_float() {
        return Err(Error::Compile(format!("{} needs a float input", op.name())));
    }
    for p in &inputs[1..] {
        same_shape(
            &p.shape,
            &x.shape[axis..],
            &format!("{} parameter", op.name()),
        )?;
        if p.dtype != x.dtype {
            return Err(Error::Compile(format!(
                "{} parameter dtype {}",
                op.name(),
                p.dtype
            )));
        }
    }
    Ok(x.clone())
}
