//! Batched matrix products: `Dot` and scaled dot-product attention.

use super::reduce::softmax_row;
use super::value::{checked_numel, Data, Value};
use super::R;
use crate::dtype::DType;

/// Splits `[B.., X, Y]` into (batch dims, X, Y).
fn mat(shape: &[usize]) -> R<(&[usize], usize, usize)> {
    match shape {
        [b @ .., x, y] => Ok((b, *x, *y)),
        _ => Err(format!("needs rank ≥ 2, got shape {shape:?}")),
    }
}

fn batch_count(b: &[usize]) -> R<usize> {
    checked_numel(b).ok_or_else(|| "shape overflows".to_string())
}

/// `[B.., M, K] × [B.., K, N] → [B.., M, N]`, accumulating in f64 (floats) or wrapping i64.
pub(crate) fn dot(a: &Value, b: &Value) -> R<Value> {
    product(a, b, false)
}

/// `dot(a, bᵀ)` for `bt: [B.., N, K]`, `b` with its last two axes swapped: a linear layer's
/// product read from its weight as stored instead of from a transposed copy of it (which
/// the interpreter would otherwise make on every run, for every weight). The same sums in
/// the same order as `dot` of the transposed copy: bitwise the same results.
pub(crate) fn dot_transposed(a: &Value, bt: &Value) -> R<Value> {
    product(a, bt, true)
}

/// Every output sums its terms in `p` order from the empty sum, as `(0..k).map(..).sum()`
/// would, whichever way `b` is stored and however the outputs are shared among threads:
/// results never depend on the thread count.
fn product(a: &Value, b: &Value, b_transposed: bool) -> R<Value> {
    let (ba, m, k) = mat(&a.shape)?;
    let (bb, kb, nb) = mat(&b.shape)?;
    let (k2, n) = if b_transposed { (nb, kb) } else { (kb, nb) };
    if ba != bb || k != k2 || a.dtype != b.dtype {
        let what = if b_transposed { "transposed " } else { "" };
        return Err(format!(
            "cannot multiply {} {:?} by {what}{} {:?}",
            a.dtype, a.shape, b.dtype, b.shape
        ));
    }
    let batch = batch_count(ba)?;
    let mut shape = ba.to_vec();
    shape.extend([m, n]);
    let total = checked_numel(&shape).ok_or("shape overflows")?;
    let data = match (&a.data, &b.data) {
        (Data::F(x), Data::F(y)) => {
            let zero: f64 = std::iter::empty::<f64>().sum();
            Data::F(products(
                x,
                y,
                (batch, m, k, n),
                b_transposed,
                zero,
                total,
                |s, x, y| *s += x * y,
            ))
        }
        (Data::I(x), Data::I(y)) => Data::I(products(
            x,
            y,
            (batch, m, k, n),
            b_transposed,
            0i64,
            total,
            |s, x, y| *s = s.wrapping_add(x.wrapping_mul(y)),
        )),
        _ => return Err("operands hold data of different kinds".into()),
    };
    Ok(Value::from_data(a.dtype, shape, data))
}

/// Output columns a thread takes at a time (of one output row).
const COLUMNS_PER_TASK: usize = 64;
/// Below this many terms in a row of outputs, threads cost more than they save.
const PARALLEL_TERMS: usize = 1 << 15;
/// Outputs whose independent sums one loop advances together (hiding the latency of
/// each sum's chain of additions).
const LANES: usize = 8;

/// The products of `dot`: `out[t, i, j] = Σ_p x[t, i, p] · y[t, p, j]` (`y[t, j, p]` when
/// `transposed`), each sum started at `zero` and taken in `p` order by `add`.
fn products<T: Copy + Send + Sync>(
    x: &[T],
    y: &[T],
    (batch, m, k, n): (usize, usize, usize, usize),
    transposed: bool,
    zero: T,
    total: usize,
    add: impl Fn(&mut T, T, T) + Sync,
) -> Vec<T> {
    use rayon::prelude::*;
    let mut out = vec![zero; total];
    if n == 0 {
        return out;
    }
    // Columns `j0..j0 + cols.len()` of output row `i` of batch `t`.
    let columns = |t: usize, i: usize, j0: usize, cols: &mut [T]| {
        let xr = &x[(t * m + i) * k..][..k];
        let yb = &y[t * k * n..][..k * n];
        if transposed {
            let mut chunks = cols.chunks_mut(LANES);
            let mut j = j0;
            for chunk in &mut chunks {
                let lanes = chunk.len();
                let rows: [&[T]; LANES] = std::array::from_fn(|l| {
                    if l < lanes {
                        &yb[(j + l) * k..][..k]
                    } else {
                        &[]
                    }
                });
                let rows = &rows[..lanes];
                let mut sums = [zero; LANES];
                for (p, &xp) in xr.iter().enumerate() {
                    for (s, r) in sums.iter_mut().zip(rows) {
                        add(s, xp, r[p]);
                    }
                }
                chunk.copy_from_slice(&sums[..lanes]);
                j += lanes;
            }
        } else {
            // `p` outside `j`: `y` is read by rows (a column walk would miss the cache on
            // every term of a large weight).
            let width = cols.len();
            for (p, &xp) in xr.iter().enumerate() {
                for (o, &yv) in cols.iter_mut().zip(&yb[p * n + j0..][..width]) {
                    add(o, xp, yv);
                }
            }
        }
    };
    if n * k < PARALLEL_TERMS {
        // Small rows: rows in parallel where there are many, else one thread.
        if batch * m * n * k >= PARALLEL_TERMS {
            out.par_chunks_mut(n)
                .enumerate()
                .for_each(|(r, row)| columns(r / m, r % m, 0, row));
        } else {
            for (r, row) in out.chunks_mut(n).enumerate() {
                columns(r / m, r % m, 0, row);
            }
        }
        return out;
    }
    for (r, row) in out.chunks_mut(n).enumerate() {
        row.par_chunks_mut(COLUMNS_PER_TASK)
            .enumerate()
            .for_each(|(c, cols)| columns(r / m, r % m, c * COLUMNS_PER_TASK, cols));
    }
    out
}

/// `IntegerDot`: `[B.., M, K] × [B.., K, N] → [B.., M, N]` int32 of 8-bit integer operands,
/// summed exactly and wrapped to int32 as int32 accumulation wraps.
pub(crate) fn integer_dot(a: &Value, b: &Value) -> R<Value> {
    let (ba, m, k) = mat(&a.shape)?;
    let (bb, k2, n) = mat(&b.shape)?;
    let eight_bit = |d: DType| matches!(d, DType::U8 | DType::I8);
    let (Data::I(x), Data::I(y)) = (&a.data, &b.data) else {
        return Err("integer_dot needs integer operands".into());
    };
    if ba != bb || k != k2 || !eight_bit(a.dtype) || !eight_bit(b.dtype) {
        return Err(format!(
            "cannot integer-multiply {} {:?} by {} {:?}",
            a.dtype, a.shape, b.dtype, b.shape
        ));
    }
    let batch = batch_count(ba)?;
    let mut shape = ba.to_vec();
    shape.extend([m, n]);
    let mut out = vec![0i64; checked_numel(&shape).ok_or("shape overflows")?];
    for t in 0..batch {
        let (x, y) = (&x[t * m * k..], &y[t * k * n..]);
        for i in 0..m {
            // Exact i64 sums (8-bit terms), by rows of `b` as in `dot`.
            let row = &mut out[(t * m + i) * n..][..n];
            for p in 0..k {
                let xp = x[i * k + p];
                for (o, &yv) in row.iter_mut().zip(&y[p * n..][..n]) {
                    *o += xp * yv;
                }
            }
            for o in row.iter_mut() {
                *o = i64::from(*o as i32);
            }
        }
    }
    Ok(Value::from_data(DType::I32, shape, Data::I(out)))
}

/// `GroupedDot`: x `[S, K]`, w `[G, K, N]`, ends `[G]` → `[S, N]`, rows past the last
/// (clamped) end zero.
pub(crate) fn grouped_dot(x: &Value, w: &Value, ends: &Value) -> R<Value> {
    let ([s, k], [g, k2, n], [g2]) = (&x.shape[..], &w.shape[..], &ends.shape[..]) else {
        return Err(format!(
            "grouped dot of {:?} and {:?} by {:?}",
            x.shape, w.shape, ends.shape
        ));
    };
    let (s, k, g, n) = (*s, *k, *g, *n);
    if k != *k2 || g != *g2 || x.dtype != w.dtype {
        return Err(format!(
            "grouped dot of {} {:?} and {} {:?} by {:?}",
            x.dtype, x.shape, w.dtype, w.shape, ends.shape
        ));
    }
    let total = checked_numel(&[s, n]).ok_or("shape overflows")?;
    let mut rows = Vec::with_capacity(s);
    let mut start = 0usize;
    for (group, &end) in ends.to_i64_vec().iter().enumerate() {
        let end = (end.clamp(0, s as i64) as usize).max(start);
        rows.extend((start..end).map(|_| Some(group)));
        start = end;
    }
    rows.resize(s, None);
    let data = match (&x.data, &w.data) {
        (Data::F(a), Data::F(b)) => {
            let mut out = vec![0.0; total];
            for (r, group) in rows.iter().enumerate() {
                let Some(e) = group else { continue };
                let b = &b[e * k * n..];
                for j in 0..n {
                    out[r * n + j] = (0..k).map(|p| a[r * k + p] * b[p * n + j]).sum();
                }
            }
            Data::F(out)
        }
        _ => return Err(format!("grouped dot of {}", x.dtype)),
    };
    Ok(Value::from_data(x.dtype, vec![s, n], data))
}

/// `BlockQuantDot`: `x · wᵀ` with row n of `w` unpacked from `packed` (values `bits` wide,
/// low bits first) as `(q − zeros[n, b]) · scales[n, b]` for block `b = k / block`.
pub(crate) fn block_quant_dot(
    x: &Value,
    packed: &Value,
    scales: &Value,
    zeros: &Value,
    bits: u8,
    block: usize,
) -> R<Value> {
    let ([m, k], [n, row_bytes]) = (x.shape.as_slice(), packed.shape.as_slice()) else {
        return Err(format!(
            "block_quant_dot of {:?} and {:?}",
            x.shape, packed.shape
        ));
    };
    let (m, k, n, row_bytes) = (*m, *k, *n, *row_bytes);
    let blocks = k.div_ceil(block.max(1));
    let (Data::I(q), Data::F(s), Data::F(z)) = (&packed.data, &scales.data, &zeros.data) else {
        return Err("block_quant_dot needs uint8 packed values and float scales and zeros".into());
    };
    let bits = bits as usize;
    if !matches!(bits, 2 | 4 | 8)
        || row_bytes * 8 != blocks * block * bits
        || s.len() != n * blocks
        || z.len() != n * blocks
    {
        return Err(format!(
            "block_quant_dot: {bits}-bit blocks of {block} for K={k} do not fit packed {:?}, \
             scales {:?}, zeros {:?}",
            packed.shape, scales.shape, zeros.shape
        ));
    }
    let xs = floats(x, "block_quant_dot's x")?;
    let mask = (1i64 << bits) - 1;
    let mut w = vec![0f64; k];
    let mut out = vec![0f64; m * n];
    for row in 0..n {
        let bytes = &q[row * row_bytes..][..row_bytes];
        for (c, wc) in w.iter_mut().enumerate() {
            let v = (bytes[c * bits / 8] >> (c * bits % 8)) & mask;
            let at = row * blocks + c / block;
            *wc = (v as f64 - z[at]) * s[at];
        }
        for i in 0..m {
            out[i * n + row] = xs[i * k..][..k].iter().zip(&w).map(|(a, b)| a * b).sum();
        }
    }
    Ok(Value::from_data(x.dtype, vec![m, n], Data::F(out)))
}

fn floats<'a>(x: &'a Value, what: &str) -> R<&'a [f64]> {
    match &x.data {
        Data::F(v) => Ok(v),
        Data::I(_) => Err(format!("{what} must be a float tensor, got {}", x.dtype)),
    }
}

/// `softmax(q·kᵀ·scale [+ mask]) · v`. Causal keeps key j for query i when j ≤ i (top-left
/// aligned); a bool mask keeps where true; a float mask is added. Fully masked rows give NaN.
pub(crate) fn attention(
    q: &Value,
    k: &Value,
    v: &Value,
    mask: Option<&Value>,
    scale: f64,
    causal: bool,
) -> R<Value> {
    let (bq, l, e) = mat(&q.shape)?;
    let (bk, s, e2) = mat(&k.shape)?;
    let (bv, s2, ev) = mat(&v.shape)?;
    let same_dtype = q.dtype == k.dtype && k.dtype == v.dtype;
    if bq != bk || bk != bv || e != e2 || s != s2 || !same_dtype {
        return Err(format!(
            "q {} {:?}, k {:?}, v {:?} do not fit together",
            q.dtype, q.shape, k.shape, v.shape
        ));
    }
    let (qd, kd, vd) = (floats(q, "q")?, floats(k, "k")?, floats(v, "v")?);
    let batch = batch_count(bq)?;
    if let Some(m) = mask {
        let mut want = bq.to_vec();
        want.extend([l, s]);
        if m.shape != want || (m.dtype != DType::Bool && !m.dtype.is_float()) {
            return Err(format!(
                "mask {} {:?} does not fit scores of shape {want:?}",
                m.dtype, m.shape
            ));
        }
    }
    let mut out = Vec::with_capacity(batch * l * ev);
    let mut scores = vec![0.0; s];
    for t in 0..batch {
        let (qb, kb, vb) = (&qd[t * l * e..], &kd[t * s * e..], &vd[t * s * ev..]);
        for i in 0..l {
            for (j, sc) in scores.iter_mut().enumerate() {
                let dot: f64 = (0..e).map(|p| qb[i * e + p] * kb[j * e + p]).sum();
                let mut x = dot * scale;
                if causal && j > i {
                    x = f64::NEG_INFINITY;
                }
                let at = (t * l + i) * s + j;
                match mask.map(|m| &m.data) {
                    Some(Data::I(keep)) if keep[at] == 0 => x = f64::NEG_INFINITY,
                    Some(Data::F(add)) => x += add[at],
                    _ => {}
                }
                *sc = x;
            }
            if s > 0 && scores.iter().all(|&x| x == f64::NEG_INFINITY) {
                // Every score masked: zeros, as torch's scaled_dot_product_attention.
                out.resize(out.len() + ev, 0.0);
                continue;
            }
            softmax_row(&mut scores, false);
            if s == 0 {
                // Every (no) score is masked.
                out.resize(out.len() + ev, f64::NAN);
                continue;
            }
            for c in 0..ev {
                out.push((0..s).map(|j| scores[j] * vb[j * ev + c]).sum());
            }
        }
    }
    let mut shape = bq.to_vec();
    shape.extend([l, ev]);
    Ok(Value::from_data(q.dtype, shape, Data::F(out)))
}
