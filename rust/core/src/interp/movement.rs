//! Views and data movement: reshape, permute, expand, slice, flip, pad, concat, gather,
//! index_select. Each computes, for every output element, where it comes from.

use super::value::{checked_numel, map_indices, offset, strides, Data, Value};
use super::R;
use crate::dtype::Scalar;
use crate::ir::ScatterReduce;

/// The output of picking `src`'s elements at `idx` (flat, in range).
fn picked(x: &Value, shape: Vec<usize>, idx: &[usize]) -> Value {
    Value {
        dtype: x.dtype,
        shape,
        data: x.data.pick(idx),
    }
}

pub(crate) fn reshape(x: &Value, shape: &[usize]) -> R<Value> {
    if checked_numel(shape) != Some(x.numel()) {
        return Err(format!("cannot reshape {:?} to {shape:?}", x.shape));
    }
    Ok(Value {
        dtype: x.dtype,
        shape: shape.to_vec(),
        data: x.data.clone(),
    })
}

pub(crate) fn permute(x: &Value, perm: &[usize]) -> R<Value> {
    let r = x.shape.len();
    let mut seen = vec![false; r];
    if perm.len() != r
        || perm
            .iter()
            .any(|&p| p >= r || std::mem::replace(&mut seen[p], true))
    {
        return Err(format!("{perm:?} is not a permutation of {r} dims"));
    }
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let swaps_last_two = r >= 2
        && perm[r - 2] == r - 1
        && perm[r - 1] == r - 2
        && perm[..r - 2].iter().enumerate().all(|(i, &p)| i == p);
    if swaps_last_two {
        let (rows, cols) = (x.shape[r - 2], x.shape[r - 1]);
        let batch = x.shape[..r - 2].iter().product();
        let data = match &x.data {
            Data::F(v) => Data::F(transpose_last_two(v, batch, rows, cols)),
            Data::I(v) => Data::I(transpose_last_two(v, batch, rows, cols)),
        };
        return Ok(Value {
            dtype: x.dtype,
            shape,
            data,
        });
    }
    let in_strides = strides(&x.shape);
    let perm_strides: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
    let idx = map_indices(&shape, |o| Ok::<_, String>(offset(o, &perm_strides)))?;
    Ok(picked(x, shape, &idx))
}

/// `[B.., R, C]` → `[B.., C, R]` a 32×32 tile at a time: a transposed weight is the
/// commonest permute, and copying it element by element through an index list walks one
/// side across a new cache line every element (seconds per verification of a 1B model).
fn transpose_last_two<T: Copy + Default>(
    src: &[T],
    batch: usize,
    rows: usize,
    cols: usize,
) -> Vec<T> {
    const TILE: usize = 32;
    let plane = rows * cols;
    let mut out = vec![T::default(); src.len()];
    for b in 0..batch {
        let (s, o) = (&src[b * plane..][..plane], &mut out[b * plane..][..plane]);
        for r0 in (0..rows).step_by(TILE) {
            for c0 in (0..cols).step_by(TILE) {
                for r in r0..(r0 + TILE).min(rows) {
                    for c in c0..(c0 + TILE).min(cols) {
                        o[c * rows + r] = s[r * cols + c];
                    }
                }
            }
        }
    }
    out
}

pub(crate) fn expand(x: &Value, shape: &[usize]) -> R<Value> {
    let ok =
        shape.len() == x.shape.len() && x.shape.iter().zip(shape).all(|(&a, &b)| a == b || a == 1);
    if !ok {
        return Err(format!("cannot expand {:?} to {shape:?}", x.shape));
    }
    // Broadcast dims read with stride 0.
    let st: Vec<usize> = strides(&x.shape)
        .into_iter()
        .zip(&x.shape)
        .map(|(s, &n)| if n == 1 { 0 } else { s })
        .collect();
    let idx = map_indices(shape, |o| Ok::<_, String>(offset(o, &st)))?;
    Ok(picked(x, shape.to_vec(), &idx))
}

pub(crate) fn slice(x: &Value, axis: usize, start: i64, end: i64, step: i64) -> R<Value> {
    let Some(&n) = x.shape.get(axis) else {
        return Err(format!("axis {axis} out of range for shape {:?}", x.shape));
    };
    if !(0 <= start && start <= end && end <= n as i64) || step < 1 {
        return Err(format!("slice [{start}:{end}:{step}] of a dim of size {n}"));
    }
    let (start, end, step) = (start as usize, end as usize, step as usize);
    let len = (end - start).div_ceil(step);
    let mut shape = x.shape.clone();
    shape[axis] = len;
    let st = strides(&x.shape);
    let idx = map_indices(&shape, |o| {
        // Coordinate o[axis] of the output is start + o[axis] * step of the input.
        Ok::<_, String>(offset(o, &st) + (start + o[axis] * (step - 1)) * st[axis])
    })?;
    Ok(picked(x, shape, &idx))
}

pub(crate) fn flip(x: &Value, axes: &[usize]) -> R<Value> {
    if let Some(a) = axes.iter().find(|&&a| a >= x.shape.len()) {
        return Err(format!("axis {a} out of range for shape {:?}", x.shape));
    }
    let st = strides(&x.shape);
    let mut src = vec![0; x.shape.len()];
    let idx = map_indices(&x.shape, |o| {
        for (d, s) in src.iter_mut().enumerate() {
            *s = if axes.contains(&d) {
                x.shape[d] - 1 - o[d]
            } else {
                o[d]
            };
        }
        Ok::<_, String>(offset(&src, &st))
    })?;
    Ok(picked(x, x.shape.clone(), &idx))
}

pub(crate) fn pad(x: &Value, pads: &[(i64, i64)], value: Scalar) -> R<Value> {
    if pads.len() != x.shape.len() || pads.iter().any(|&(a, b)| a < 0 || b < 0) {
        return Err(format!("pads {pads:?} for shape {:?}", x.shape));
    }
    let mut shape = Vec::with_capacity(pads.len());
    for (&n, &(a, b)) in x.shape.iter().zip(pads) {
        let total = usize::try_from(a)
            .ok()
            .and_then(|a| n.checked_add(a))
            .and_then(|s| s.checked_add(usize::try_from(b).ok()?))
            .ok_or("padded shape overflows")?;
        shape.push(total);
    }
    checked_numel(&shape).ok_or("padded shape overflows")?;
    let st = strides(&x.shape);
    let idx = map_indices(&shape, |o| {
        let mut off = 0;
        for (d, &i) in o.iter().enumerate() {
            let before = pads[d].0 as usize;
            if i < before || i - before >= x.shape[d] {
                return Ok::<_, String>(None);
            }
            off += (i - before) * st[d];
        }
        Ok(Some(off))
    })?;
    let fill = Value::splat(x.dtype, vec![1], 1, value);
    let data = x
        .data
        .pick_or(&idx, &fill.data)
        .ok_or("pad value of the wrong kind")?;
    Ok(Value {
        dtype: x.dtype,
        shape,
        data,
    })
}

pub(crate) fn concat(xs: &[&Value], axis: usize) -> R<Value> {
    let first = xs.first().ok_or("concat of no tensors")?;
    let r = first.shape.len();
    if axis >= r {
        return Err(format!(
            "axis {axis} out of range for shape {:?}",
            first.shape
        ));
    }
    let mut total = 0usize;
    for x in xs {
        let same = x.dtype == first.dtype
            && x.shape.len() == r
            && (0..r).all(|d| d == axis || x.shape[d] == first.shape[d]);
        if !same {
            return Err(format!(
                "cannot concat {} {:?} with {} {:?} on axis {axis}",
                first.dtype, first.shape, x.dtype, x.shape
            ));
        }
        total = total.checked_add(x.shape[axis]).ok_or("shape overflows")?;
    }
    let mut shape = first.shape.clone();
    shape[axis] = total;
    let n = checked_numel(&shape).ok_or("shape overflows")?;
    let outer = checked_numel(&shape[..axis]).ok_or("shape overflows")?;
    let mut data = first.data.empty_like(n);
    for o in 0..outer {
        for x in xs {
            let chunk = x.numel().checked_div(outer).unwrap_or(0);
            if !data.extend_from(&x.data, o * chunk..(o + 1) * chunk) {
                return Err("inputs hold data of different kinds".into());
            }
        }
    }
    Ok(Value {
        dtype: first.dtype,
        shape,
        data,
    })
}

/// `cache_append`: per sequence b, along `axis` of the `len`-long output, past's entries
/// before `lengths[b]` (zero past P), new's from `lengths[b]` on, zeros after them.
pub(crate) fn cache_append(
    past: &Value,
    new: &Value,
    lengths: &Value,
    axis: usize,
    len: usize,
) -> R<Value> {
    let r = past.shape.len();
    let fits = axis >= 1
        && axis < r
        && new.dtype == past.dtype
        && new.shape.len() == r
        && (0..r).all(|d| d == axis || new.shape[d] == past.shape[d])
        && lengths.shape[..] == [past.shape[0]];
    if !fits {
        return Err(format!(
            "cache_append of {:?} and {:?} with lengths {:?} on axis {axis}",
            past.shape, new.shape, lengths.shape
        ));
    }
    let at = indices(lengths)?;
    let (p, s) = (past.shape[axis], new.shape[axis]);
    let mut shape = past.shape.clone();
    shape[axis] = len;
    checked_numel(&shape).ok_or("shape overflows")?;
    // Positions in past's data, then new's (offset by past's size); None reads zero.
    let (ps, ns) = (strides(&past.shape), strides(&new.shape));
    let idx = map_indices(&shape, |o| {
        let j = o[axis] as i64;
        let first = at[o[0]];
        let (st, base, row) = if j < first {
            if j >= p as i64 {
                return Ok::<_, String>(None);
            }
            (&ps, 0, j as usize)
        } else if j.saturating_sub(first) < s as i64 {
            (&ns, past.numel(), (j - first) as usize)
        } else {
            return Ok(None);
        };
        let off: usize = (0..r)
            .map(|d| if d == axis { row * st[d] } else { o[d] * st[d] })
            .sum();
        Ok(Some(base + off))
    })?;
    let mut both = past.data.empty_like(past.numel() + new.numel());
    if !both.extend_from(&past.data, 0..past.numel())
        || !both.extend_from(&new.data, 0..new.numel())
    {
        return Err("inputs hold data of different kinds".into());
    }
    let zero = match past.dtype.is_float() {
        true => Scalar::Float(0.0),
        false => Scalar::Int(0),
    };
    let zero = Value::splat(past.dtype, vec![1], 1, zero);
    let data = both
        .pick_or(&idx, &zero.data)
        .ok_or("cache_append of the wrong kind")?;
    Ok(Value {
        dtype: past.dtype,
        shape,
        data,
    })
}

/// Index values, checked against `n` (negative ones count from the end).
fn resolve_index(i: i64, n: usize, what: &str) -> R<usize> {
    let j = if i < 0 {
        i.checked_add(n as i64)
    } else {
        Some(i)
    };
    match j {
        Some(j) if j >= 0 && (j as usize) < n => Ok(j as usize),
        _ => Err(format!("{what} {i} is out of range for a dim of size {n}")),
    }
}

fn indices(index: &Value) -> R<&[i64]> {
    match (&index.data, index.dtype.is_int()) {
        (Data::I(v), true) => Ok(v),
        _ => Err(format!(
            "index must be an integer tensor, got {}",
            index.dtype
        )),
    }
}

/// The offsets in `x` that `index` addresses on `axis` (gather reads them, scatter writes).
fn axis_offsets(x: &Value, axis: usize, index: &Value, what: &str) -> R<Vec<usize>> {
    let idx_vals = indices(index)?;
    if index.shape.len() != x.shape.len() || axis >= x.shape.len() {
        return Err(format!(
            "{what} of {:?} on axis {axis} with an index of shape {:?}",
            x.shape, index.shape
        ));
    }
    let st = strides(&x.shape);
    let mut k = 0;
    map_indices(&index.shape, |o| {
        let mut off = 0;
        for (d, &i) in o.iter().enumerate() {
            let i = if d == axis {
                resolve_index(idx_vals[k], x.shape[d], "index")?
            } else if i < x.shape[d] {
                i
            } else {
                return Err(format!(
                    "index of shape {:?} does not fit input {:?} on dim {d}",
                    index.shape, x.shape
                ));
            };
            off += i * st[d];
        }
        k += 1;
        Ok(off)
    })
}

pub(crate) fn gather(x: &Value, axis: usize, index: &Value) -> R<Value> {
    let idx = axis_offsets(x, axis, index, "gather")?;
    Ok(picked(x, index.shape.clone(), &idx))
}

/// Updates applied in order: without a reduction the last one wins.
pub(crate) fn scatter(
    x: &Value,
    axis: usize,
    index: &Value,
    updates: &Value,
    reduce: ScatterReduce,
) -> R<Value> {
    let at = axis_offsets(x, axis, index, "scatter")?;
    if updates.shape != index.shape || updates.dtype != x.dtype {
        return Err(format!(
            "scatter updates {} {:?} do not match the index {:?}",
            updates.dtype, updates.shape, index.shape
        ));
    }
    fn apply<T: Copy + PartialOrd>(
        out: &mut [T],
        at: &[usize],
        upd: &[T],
        reduce: ScatterReduce,
        add: fn(T, T) -> T,
        mul: fn(T, T) -> T,
    ) {
        for (&o, &u) in at.iter().zip(upd) {
            let cur = out[o];
            out[o] = match reduce {
                ScatterReduce::None => u,
                ScatterReduce::Add => add(cur, u),
                ScatterReduce::Mul => mul(cur, u),
                ScatterReduce::Max if u > cur => u,
                ScatterReduce::Min if u < cur => u,
                _ => cur,
            };
        }
    }
    let data = match (&x.data, &updates.data) {
        (Data::F(v), Data::F(u)) => {
            let mut out = v.clone();
            apply(&mut out, &at, u, reduce, |a, b| a + b, |a, b| a * b);
            Data::F(out)
        }
        (Data::I(v), Data::I(u)) => {
            let mut out = v.clone();
            apply(
                &mut out,
                &at,
                u,
                reduce,
                i64::wrapping_add,
                i64::wrapping_mul,
            );
            Data::I(out)
        }
        _ => return Err("scatter updates hold data of another kind".into()),
    };
    Ok(Value::from_data(x.dtype, x.shape.clone(), data))
}

pub(crate) fn index_select(x: &Value, axis: usize, index: &Value) -> R<Value> {
    let idx_vals = indices(index)?;
    if axis >= x.shape.len() {
        return Err(format!("axis {axis} out of range for shape {:?}", x.shape));
    }
    let n = x.shape[axis];
    let rows: Vec<usize> = idx_vals
        .iter()
        .map(|&i| resolve_index(i, n, "index"))
        .collect::<R<_>>()?;
    let mut shape = x.shape[..axis].to_vec();
    shape.extend_from_slice(&index.shape);
    shape.extend_from_slice(&x.shape[axis + 1..]);
    let outer = checked_numel(&x.shape[..axis]).ok_or("shape overflows")?;
    let inner = checked_numel(&x.shape[axis + 1..]).ok_or("shape overflows")?;
    let total = checked_numel(&shape).ok_or("shape overflows")?;
    let mut idx = Vec::with_capacity(total);
    for o in 0..outer {
        for &row in &rows {
            let base = (o * n + row) * inner;
            idx.extend(base..base + inner);
        }
    }
    Ok(picked(x, shape, &idx))
}
