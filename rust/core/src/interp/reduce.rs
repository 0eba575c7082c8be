//! Reductions and the ops that work along an axis: reduce, cumsum, softmax, layer/RMS norm.

use super::value::{checked_numel, try_for_each_index, Data, Value};
use super::R;
use crate::dtype::DType;
use crate::ir::{ReduceOp, ScanOp};

/// `(outer, n, inner)`: element `(o, j, i)` of the line through `axis` is at
/// `(o * n + j) * inner + i`.
pub(crate) fn lines(shape: &[usize], axis: usize) -> R<(usize, usize, usize)> {
    if axis >= shape.len() {
        return Err(format!("axis {axis} out of range for shape {shape:?}"));
    }
    let outer = checked_numel(&shape[..axis]).ok_or("shape overflows")?;
    let inner = checked_numel(&shape[axis + 1..]).ok_or("shape overflows")?;
    Ok((outer, shape[axis], inner))
}

/// Splits the elements into one group per output element, each in row-major order of the
/// reduced dims. Returns the output shape and, for each input element, its group.
fn groups(shape: &[usize], axes: &[usize], keepdim: bool) -> R<(Vec<usize>, Vec<usize>, usize)> {
    if axes.windows(2).any(|w| w[0] >= w[1]) || axes.iter().any(|&a| a >= shape.len()) {
        return Err(format!("bad axes {axes:?} for shape {shape:?}"));
    }
    let mut out_shape = Vec::new();
    let mut kept = Vec::new(); // extents of the kept dims
    for (d, &n) in shape.iter().enumerate() {
        if axes.contains(&d) {
            if keepdim {
                out_shape.push(1);
            }
        } else {
            out_shape.push(n);
            kept.push(n);
        }
    }
    let kept_strides = super::value::strides(&kept);
    let mut group_of = Vec::new();
    try_for_each_index(shape, |idx| {
        let mut g = 0;
        let mut k = 0;
        for (d, &i) in idx.iter().enumerate() {
            if !axes.contains(&d) {
                g += i * kept_strides[k];
                k += 1;
            }
        }
        group_of.push(g);
        Ok::<(), String>(())
    })?;
    let count = checked_numel(&kept).ok_or("shape overflows")?;
    Ok((out_shape, group_of, count))
}

fn collect<T: Copy>(v: &[T], group_of: &[usize], count: usize) -> Vec<Vec<T>> {
    let mut out = vec![Vec::new(); count];
    for (&x, &g) in v.iter().zip(group_of) {
        out[g].push(x);
    }
    out
}

fn reduce_f(op: ReduceOp, g: &[f64]) -> R<f64> {
    if g.is_empty() && !matches!(op, ReduceOp::Sum | ReduceOp::Prod) {
        return Err(format!("{} of an empty set of elements", op.name()));
    }
    let first_nan = g.iter().position(|x| x.is_nan());
    Ok(match op {
        ReduceOp::Sum => g.iter().sum(),
        ReduceOp::Prod => g.iter().product(),
        ReduceOp::Max | ReduceOp::Min if first_nan.is_some() => f64::NAN,
        ReduceOp::Max => g.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Min => g.iter().copied().fold(f64::INFINITY, f64::min),
        ReduceOp::ArgMax | ReduceOp::ArgMin => {
            let i = first_nan.unwrap_or_else(|| {
                let mut best = 0;
                for (i, &x) in g.iter().enumerate() {
                    let better = if op == ReduceOp::ArgMax {
                        x > g[best]
                    } else {
                        x < g[best]
                    };
                    if better {
                        best = i;
                    }
                }
                best
            });
            i as f64
        }
    })
}

fn reduce_i(op: ReduceOp, g: &[i64]) -> R<i64> {
    if g.is_empty() && !matches!(op, ReduceOp::Sum | ReduceOp::Prod) {
        return Err(format!("{} of an empty set of elements", op.name()));
    }
    Ok(match op {
        ReduceOp::Sum => g.iter().fold(0i64, |a, &x| a.wrapping_add(x)),
        ReduceOp::Prod => g.iter().fold(1i64, |a, &x| a.wrapping_mul(x)),
        ReduceOp::Max => g.iter().copied().max().unwrap_or(0),
        ReduceOp::Min => g.iter().copied().min().unwrap_or(0),
        ReduceOp::ArgMax | ReduceOp::ArgMin => {
            let mut best = 0;
            for (i, &x) in g.iter().enumerate() {
                let better = if op == ReduceOp::ArgMax {
                    x > g[best]
                } else {
                    x < g[best]
                };
                if better {
                    best = i;
                }
            }
            best as i64
        }
    })
}

pub(crate) fn reduce(op: ReduceOp, axes: &[usize], keepdim: bool, x: &Value) -> R<Value> {
    if op.is_arg() && axes.len() != 1 {
        return Err(format!(
            "{} takes exactly one axis, got {axes:?}",
            op.name()
        ));
    }
    let (out_shape, group_of, count) = groups(&x.shape, axes, keepdim)?;
    let dtype = if op.is_arg() { DType::I64 } else { x.dtype };
    let data = match &x.data {
        Data::F(v) => {
            let gs = collect(v, &group_of, count);
            let r: Vec<f64> = gs.iter().map(|g| reduce_f(op, g)).collect::<R<_>>()?;
            if op.is_arg() {
                Data::I(r.into_iter().map(|i| i as i64).collect())
            } else {
                Data::F(r)
            }
        }
        Data::I(v) => {
            let gs = collect(v, &group_of, count);
            Data::I(gs.iter().map(|g| reduce_i(op, g)).collect::<R<_>>()?)
        }
    };
    Ok(Value::from_data(dtype, out_shape, data))
}

/// Inclusive scan along `axis`: floats in f64, integers wrapping i64; max/min keep a NaN
/// once seen (torch's rule: take x when x ≥ acc or x is NaN).
pub(crate) fn scan(axis: usize, op: ScanOp, x: &Value) -> R<Value> {
    let (outer, n, inner) = lines(&x.shape, axis)?;
    let mut data = x.data.clone();
    fn line<T: Copy + PartialOrd>(
        v: &mut [T],
        at: impl Fn(usize) -> usize,
        n: usize,
        step: impl Fn(T, T) -> T,
    ) {
        for j in 1..n {
            v[at(j)] = step(v[at(j - 1)], v[at(j)]);
        }
    }
    let keep_nan = |take: bool, s: f64| take || s.is_nan();
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| (o * n + j) * inner + i;
            match &mut data {
                Data::F(v) => match op {
                    ScanOp::Sum => line(v, at, n, |a, s| a + s),
                    ScanOp::Prod => line(v, at, n, |a, s| a * s),
                    ScanOp::Max => line(v, at, n, |a, s| if keep_nan(s >= a, s) { s } else { a }),
                    ScanOp::Min => line(v, at, n, |a, s| if keep_nan(s <= a, s) { s } else { a }),
                },
                Data::I(v) => match op {
                    ScanOp::Sum => line(v, at, n, i64::wrapping_add),
                    ScanOp::Prod => line(v, at, n, i64::wrapping_mul),
                    ScanOp::Max => line(v, at, n, i64::max),
                    ScanOp::Min => line(v, at, n, i64::min),
                },
            }
        }
    }
    Ok(Value::from_data(x.dtype, x.shape.clone(), data))
}

/// Stable sort positions of each line along `axis`; NaN ranks above every number.
pub(crate) fn argsort(axis: usize, descending: bool, x: &Value) -> R<Value> {
    use std::cmp::Ordering;
    let (outer, n, inner) = lines(&x.shape, axis)?;
    let ascending = |a: usize, b: usize| -> Ordering {
        match &x.data {
            Data::F(v) => match (v[a].is_nan(), v[b].is_nan()) {
                (true, true) => Ordering::Equal,
                (true, false) => Ordering::Greater,
                (false, true) => Ordering::Less,
                // -0.0 and 0.0 compare equal, as torch's comparisons do.
                _ => v[a].partial_cmp(&v[b]).unwrap_or(Ordering::Equal),
            },
            Data::I(v) => v[a].cmp(&v[b]),
        }
    };
    let mut out = vec![0i64; x.numel()];
    let mut order: Vec<usize> = Vec::with_capacity(n);
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| (o * n + j) * inner + i;
            order.clear();
            order.extend(0..n);
            // `sort_by` is stable, so equal elements keep their order in both directions.
            if descending {
                order.sort_by(|&a, &b| ascending(at(b), at(a)));
            } else {
                order.sort_by(|&a, &b| ascending(at(a), at(b)));
            }
            for (j, &src) in order.iter().enumerate() {
                out[at(j)] = src as i64;
            }
        }
    }
    Ok(Value::from_i64(DType::I64, x.shape.clone(), out))
}

fn floats<'a>(x: &'a Value, what: &str) -> R<&'a [f64]> {
    match &x.data {
        Data::F(v) => Ok(v),
        Data::I(_) => Err(format!("{what} needs a float input, got {}", x.dtype)),
    }
}

/// Softmax (or log-softmax) of one row, in place.
pub(crate) fn softmax_row(row: &mut [f64], log: bool) {
    let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = row.iter().map(|&x| (x - max).exp()).sum();
    for x in row.iter_mut() {
        *x = if log {
            *x - max - sum.ln()
        } else {
            (*x - max).exp() / sum
        };
    }
}

pub(crate) fn softmax(axis: usize, log: bool, x: &Value) -> R<Value> {
    let v = floats(x, "softmax")?;
    let (outer, n, inner) = lines(&x.shape, axis)?;
    let mut out = v.to_vec();
    let mut row = vec![0.0; n];
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| (o * n + j) * inner + i;
            for (j, r) in row.iter_mut().enumerate() {
                *r = v[at(j)];
            }
            softmax_row(&mut row, log);
            for (j, &r) in row.iter().enumerate() {
                out[at(j)] = r;
            }
        }
    }
    Ok(Value::from_data(x.dtype, x.shape.clone(), Data::F(out)))
}

/// Checks a norm's weight or bias against `x.shape[axis..]` and returns its elements.
fn param<'a>(p: Option<&'a Value>, x: &Value, axis: usize) -> R<Option<&'a [f64]>> {
    let Some(p) = p else { return Ok(None) };
    if p.shape[..] != x.shape[axis..] || p.dtype != x.dtype {
        return Err(format!(
            "parameter {} {:?} does not fit input {} {:?} normalized from axis {axis}",
            p.dtype, p.shape, x.dtype, x.shape
        ));
    }
    floats(p, "norm parameter").map(Some)
}

/// Rows of `x` over its dims `axis..`, with the number of rows and the row length.
fn norm_rows<'a>(x: &'a Value, axis: usize, what: &str) -> R<(&'a [f64], usize, usize)> {
    let v = floats(x, what)?;
    if axis >= x.shape.len() {
        return Err(format!("axis {axis} out of range for shape {:?}", x.shape));
    }
    let rows = checked_numel(&x.shape[..axis]).ok_or("shape overflows")?;
    let n = checked_numel(&x.shape[axis..]).ok_or("shape overflows")?;
    Ok((v, rows, n))
}

pub(crate) fn layer_norm(
    axis: usize,
    eps: f64,
    x: &Value,
    weight: Option<&Value>,
    bias: Option<&Value>,
) -> R<Value> {
    let (v, rows, n) = norm_rows(x, axis, "layer_norm")?;
    let (w, b) = (param(weight, x, axis)?, param(bias, x, axis)?);
    let mut out = Vec::with_capacity(v.len());
    for r in 0..rows {
        let row = &v[r * n..(r + 1) * n];
        let mean = row.iter().sum::<f64>() / n as f64;
        let var = row.iter().map(|&a| (a - mean) * (a - mean)).sum::<f64>() / n as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        for (j, &a) in row.iter().enumerate() {
            let mut y = (a - mean) * rstd;
            if let Some(w) = w {
                y *= w[j];
            }
            if let Some(b) = b {
                y += b[j];
            }
            out.push(y);
        }
    }
    Ok(Value::from_data(x.dtype, x.shape.clone(), Data::F(out)))
}

pub(crate) fn rms_norm(axis: usize, eps: f64, x: &Value, weight: Option<&Value>) -> R<Value> {
    let (v, rows, n) = norm_rows(x, axis, "rms_norm")?;
    let w = param(weight, x, axis)?;
    let mut out = Vec::with_capacity(v.len());
    for r in 0..rows {
        let row = &v[r * n..(r + 1) * n];
        let ms = row.iter().map(|&a| a * a).sum::<f64>() / n as f64;
        let rstd = 1.0 / (ms + eps).sqrt();
        for (j, &a) in row.iter().enumerate() {
            out.push(a * rstd * w.map_or(1.0, |w| w[j]));
        }
    }
    Ok(Value::from_data(x.dtype, x.shape.clone(), Data::F(out)))
}
