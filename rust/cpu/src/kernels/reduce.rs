//! Reductions over any set of axes (sum, prod, max, min, argmax, argmin), scans (cumsum,
//! cumprod, cummax, cummin) and argsort. Float
//! sums and products accumulate in f64; integers wrap; bool sum/max is "any", prod/min "all".

use ember_core::dtype::DType;
use ember_core::ir::{ReduceOp, ScanOp};

use super::{axis_last_perm, for_rows, unpermute};
use crate::buffer::{Val, View};
use crate::elem::{Elem, FloatElem, IntElem, B8};
use crate::error::{CpuError, KResult};
use crate::par;
use crate::strided::{batch_offsets, coalesce, for_runs, PAR_MIN};

pub fn reduce(op: ReduceOp, axes: &[usize], x: &Val, out_shape: &[usize]) -> KResult<Val> {
    let rank = x.shape().len();
    if axes.iter().any(|&a| a >= rank) {
        return Err(CpuError::Shape(format!(
            "reduce axes {axes:?} for rank {rank}"
        )));
    }
    let mut perm: Vec<usize> = (0..rank).filter(|d| !axes.contains(d)).collect();
    let keep = perm.len();
    perm.extend_from_slice(axes);
    let n_red: usize = axes.iter().map(|&a| x.shape()[a]).product();
    let n_out: usize = perm[..keep].iter().map(|&d| x.shape()[d]).product();
    if n_red == 0 && n_out > 0 && !matches!(op, ReduceOp::Sum | ReduceOp::Prod) {
        return Err(CpuError::Shape(format!(
            "{} over an empty dim (shape {:?}, axes {axes:?})",
            op.name(),
            x.shape()
        )));
    }
    if op.is_arg() {
        return crate::with_dtype!(x.dtype, T => {
            let v = x.view::<T>()?.permuted(&perm);
            Val::build::<i64>(DType::I64, out_shape, |o| {
                if T::IS_FLOAT {
                    arg::<T, f64>(&v, keep, o, op == ReduceOp::ArgMax, T::to_f64, f64::is_nan);
                } else {
                    arg::<T, i64>(&v, keep, o, op == ReduceOp::ArgMax, T::to_i64, |_| false);
                }
                Ok(())
            })
        });
    }
    // Sums and products accumulate in f64; max and min are exact in any type that holds
    // the values, so they stay in `$A`, the compute type (f32 but for f64): twice the
    // lanes a vector, and no conversions.
    macro_rules! float {
        ($T:ty, $A:ty) => {{
            let v = x.view::<$T>()?.permuted(&perm);
            Val::build::<$T>(x.dtype, out_shape, |o| {
                // NaN-sticky: a NaN `a` stays (no comparison with it holds), a NaN `b` makes
                // the NaN constant. Written as two selects with a constant, the lanes of
                // `fold_run` vectorize; `b.is_nan() || b > a` stayed scalar (3× slower).
                let nan_max = |a: $A, b: $A| {
                    let m = if b > a { b } else { a };
                    if b.is_nan() {
                        <$A>::NAN
                    } else {
                        m
                    }
                };
                let nan_min = |a: $A, b: $A| {
                    let m = if b < a { b } else { a };
                    if b.is_nan() {
                        <$A>::NAN
                    } else {
                        m
                    }
                };
                let fin = <$T as Elem>::from_f64;
                let fin_a = |a: $A| <$T as Elem>::from_f64(a as f64);
                match op {
                    ReduceOp::Sum => fold(
                        &v,
                        keep,
                        o,
                        0.0,
                        |a, x: $T| a + x.to_f64(),
                        |a, b| a + b,
                        fin,
                    ),
                    ReduceOp::Prod => fold(
                        &v,
                        keep,
                        o,
                        1.0,
                        |a, x: $T| a * x.to_f64(),
                        |a, b| a * b,
                        fin,
                    ),
                    ReduceOp::Max => fold(
                        &v,
                        keep,
                        o,
                        <$A>::NEG_INFINITY,
                        |a, x: $T| nan_max(a, x.load()),
                        nan_max,
                        fin_a,
                    ),
                    _ => fold(
                        &v,
                        keep,
                        o,
                        <$A>::INFINITY,
                        |a, x: $T| nan_min(a, x.load()),
                        nan_min,
                        fin_a,
                    ),
                }
                Ok(())
            })
        }};
    }
    match x.dtype {
        DType::F16 => float!(half::f16, f32),
        DType::BF16 => float!(half::bf16, f32),
        DType::F32 => float!(f32, f32),
        DType::F64 => float!(f64, f64),
        DType::U8 => int::<u8>(op, x, &perm, keep, out_shape),
        DType::I8 => int::<i8>(op, x, &perm, keep, out_shape),
        DType::I16 => int::<i16>(op, x, &perm, keep, out_shape),
        DType::I32 => int::<i32>(op, x, &perm, keep, out_shape),
        DType::I64 => int::<i64>(op, x, &perm, keep, out_shape),
        DType::Bool => {
            let v = x.view::<B8>()?.permuted(&perm);
            Val::build::<B8>(DType::Bool, out_shape, |o| {
                match op {
                    ReduceOp::Sum | ReduceOp::Max => fold(
                        &v,
                        keep,
                        o,
                        false,
                        |a, x: B8| a | x.get(),
                        |a, b| a | b,
                        B8::new,
                    ),
                    _ => fold(
                        &v,
                        keep,
                        o,
                        true,
                        |a, x: B8| a & x.get(),
                        |a, b| a & b,
                        B8::new,
                    ),
                }
                Ok(())
            })
        }
    }
}

fn int<T: IntElem>(
    op: ReduceOp,
    x: &Val,
    perm: &[usize],
    keep: usize,
    out_shape: &[usize],
) -> KResult<Val> {
    let v = x.view::<T>()?.permuted(perm);
    Val::build::<T>(T::DTYPE, out_shape, |o| {
        // The accumulator is the element type: one function (inlined) steps and combines.
        macro_rules! by {
            ($init:expr, $f:expr) => {
                fold(&v, keep, o, $init, $f, $f, |a| a)
            };
        }
        match op {
            ReduceOp::Sum => by!(T::ZERO, |a: T, b: T| a.wadd(b)),
            ReduceOp::Prod => by!(T::ONE, |a: T, b: T| a.wmul(b)),
            ReduceOp::Max => by!(T::MIN, |a: T, b: T| a.max(b)),
            _ => by!(T::MAX, |a: T, b: T| a.min(b)),
        }
        Ok(())
    })
}

/// Folds the trailing dims of `v` (from `keep` on) into each output element. `combine`
/// merges two accumulators (of disjoint parts, in order): a contiguous run is folded into
/// independent lanes (which vectorize) merged at its end, and a few outputs over long
/// reductions (a global maximum) split each reduction across threads.
#[allow(clippy::too_many_arguments)]
fn fold<T: Copy + Sync, A: Copy + Send + Sync, R: Send>(
    v: &View<T>,
    keep: usize,
    out: &mut [R],
    init: A,
    step: impl Fn(A, T) -> A + Sync,
    combine: impl Fn(A, A) -> A + Sync,
    finish: impl Fn(A) -> R + Sync,
) {
    if keep > 0 && v.strides[keep - 1] == 1 && v.shape[keep - 1] >= MIN_COLUMNS {
        return fold_columns(v, keep, out, init, step, finish);
    }
    let bases = batch_offsets(&v.shape[..keep], [&v.strides[..keep]]);
    let (rshape, rst) = coalesce(&v.shape[keep..], [&v.strides[keep..]]);
    let n_red: usize = rshape.iter().product();
    let inner = rst[0].last().copied().unwrap_or(1);
    // Elements `start..end` (in reduction order) of the output at `base`.
    let range = |base: isize, start: usize, end: usize| {
        let mut acc = init;
        for_runs(&rshape, &rst, start, end, |_, [off], len| {
            if inner == 1 {
                acc = fold_run(acc, v.run(base + off, len), init, &step, &combine);
            } else {
                for j in 0..len as isize {
                    acc = step(acc, v.at(base + off + j * inner));
                }
            }
        });
        acc
    };
    let threads = par::threads();
    if out.len() < threads && n_red >= PAR_MIN {
        let parts = threads * 4;
        let per = n_red.div_ceil(parts);
        for (o, b) in out.iter_mut().zip(&bases) {
            let mut partial = vec![init; parts];
            par::for_chunks_mut(&mut partial, 1, |p, slot| {
                slot[0] = range(b[0], (p * per).min(n_red), ((p + 1) * per).min(n_red));
            });
            *o = finish(partial.into_iter().fold(init, &combine));
        }
    } else if out.len().saturating_mul(n_red.max(1)) >= PAR_MIN {
        let per = (out.len() / (threads * 4)).max(1);
        par::for_chunks_mut(out, per, |start, o| {
            for (o, b) in o.iter_mut().zip(&bases[start..]) {
                *o = finish(range(b[0], 0, n_red));
            }
        });
    } else {
        for (o, b) in out.iter_mut().zip(&bases) {
            *o = finish(range(b[0], 0, n_red));
        }
    }
}

/// `acc` folded with a contiguous run: in independent accumulators (no chain of dependent
/// steps, so the loop vectorizes, for AVX2 where the CPU has it), merged in order at the
/// end. Four AVX2 registers of them hide a step's latency (a NaN-sticky max is two
/// compares and two blends deep): 32 lanes of 4 bytes, 16 of 8.
fn fold_run<T: Copy, A: Copy>(
    acc: A,
    run: &[T],
    init: A,
    step: &impl Fn(A, T) -> A,
    combine: &impl Fn(A, A) -> A,
) -> A {
    match std::mem::size_of::<A>() {
        ..=4 => fold_lanes::<32, T, A>(acc, run, init, step, combine),
        _ => fold_lanes::<16, T, A>(acc, run, init, step, combine),
    }
}

fn fold_lanes<const LANES: usize, T: Copy, A: Copy>(
    acc: A,
    run: &[T],
    init: A,
    step: &impl Fn(A, T) -> A,
    combine: &impl Fn(A, A) -> A,
) -> A {
    if run.len() < 2 * LANES {
        return run.iter().fold(acc, |a, &x| step(a, x));
    }
    crate::simd::wide(|| {
        let mut lanes = [init; LANES];
        let mut chunks = run.chunks_exact(LANES);
        for c in &mut chunks {
            for j in 0..LANES {
                lanes[j] = step(lanes[j], c[j]);
            }
        }
        let tail = chunks.remainder().iter().fold(init, |a, &x| step(a, x));
        // The lanes combined pairwise (halves, quarters, …): a chain of LANES dependent
        // adds was most of a short row's time (a pool's 64 values).
        let mut width = LANES;
        while width > 1 {
            width /= 2;
            for j in 0..width {
                lanes[j] = combine(lanes[j], lanes[j + width]);
            }
        }
        combine(combine(acc, lanes[0]), tail)
    })
}

/// A kept innermost dim at least this long is reduced a row of outputs at a time.
const MIN_COLUMNS: usize = 8;

/// `fold` when the innermost kept dim is contiguous (a sum over a middle axis, as
/// `[B, T, H].sum(1)`): each output row of that dim's length accumulates whole contiguous
/// input rows, one per combination of the reduced indices, instead of walking every output
/// element's strided line (one short loop per element).
fn fold_columns<T: Copy + Sync, A: Copy + Send + Sync, R: Send>(
    v: &View<T>,
    keep: usize,
    out: &mut [R],
    init: A,
    step: impl Fn(A, T) -> A + Sync,
    finish: impl Fn(A) -> R + Sync,
) {
    let width = v.shape[keep - 1];
    let rows = batch_offsets(&v.shape[..keep - 1], [&v.strides[..keep - 1]]);
    let reduced = batch_offsets(&v.shape[keep..], [&v.strides[keep..]]);
    let chunk_rows = |first_row: usize, o: &mut [R]| {
        let mut acc = vec![init; width];
        for (out_row, base) in o.chunks_mut(width).zip(&rows[first_row..]) {
            acc.fill(init);
            for off in &reduced {
                for (a, &x) in acc.iter_mut().zip(v.run(base[0] + off[0], width)) {
                    *a = step(*a, x);
                }
            }
            for (o, &a) in out_row.iter_mut().zip(&acc) {
                *o = finish(a);
            }
        }
    };
    if out.len().saturating_mul(reduced.len().max(1)) >= PAR_MIN {
        let per_rows = (rows.len() / (par::threads() * 4)).max(1);
        par::for_chunks_mut(out, per_rows * width, |start, o| {
            chunk_rows(start / width, o)
        });
    } else {
        chunk_rows(0, out);
    }
}

/// Index of the first extreme value along the last dim (a NaN counts as the extreme).
fn arg<T: Copy + Send + Sync, K: Copy + PartialOrd>(
    v: &View<T>,
    keep: usize,
    out: &mut [i64],
    max: bool,
    key: fn(T) -> K,
    is_nan: fn(K) -> bool,
) {
    let better = |x: K, best: K| {
        if is_nan(best) {
            false
        } else if is_nan(x) {
            true
        } else if max {
            x > best
        } else {
            x < best
        }
    };
    debug_assert_eq!(v.shape.len(), keep + 1);
    for_rows(v, out, |row, o| {
        let mut best = 0usize;
        for (j, &x) in row.iter().enumerate().skip(1) {
            if better(key(x), key(row[best])) {
                best = j;
            }
        }
        o[0] = best as i64;
    });
}

/// Inclusive scan along `axis`: floats accumulate in f64 (as torch's CPU kernel does),
/// integers wrap, bools or (sum, max) and and (prod, min). Max/min take the element when it
/// is ≥ (≤) the running value or NaN, so a NaN stays once seen, as in torch.
pub fn scan(x: &Val, axis: usize, op: ScanOp) -> KResult<Val> {
    let rank = x.shape().len();
    if rank == 0 {
        return Ok(x.clone());
    }
    let perm = axis_last_perm(rank, axis);
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape()[p]).collect();
    macro_rules! go {
        ($T:ty, $A:ty, $load:expr, $step:expr, $store:expr) => {{
            let v = x.view::<$T>()?.permuted(&perm);
            let out = Val::build::<$T>(x.dtype, &shape, |o| {
                for_rows(&v, o, |row, out_row| {
                    // The first element starts the scan; the rest fold into it.
                    let mut pairs = out_row.iter_mut().zip(row);
                    let Some((first, &s)) = pairs.next() else {
                        return;
                    };
                    let mut acc: $A = $load(s);
                    *first = $store(acc);
                    for (d, &s) in pairs {
                        acc = $step(acc, $load(s));
                        *d = $store(acc);
                    }
                });
                Ok(())
            })?;
            unpermute(out, &perm)
        }};
    }
    macro_rules! float {
        ($T:ty) => {{
            let (load, store) = (<$T as Elem>::to_f64, <$T as Elem>::from_f64);
            match op {
                ScanOp::Sum => go!($T, f64, load, |a, s| a + s, store),
                ScanOp::Prod => go!($T, f64, load, |a, s| a * s, store),
                ScanOp::Max => go!(
                    $T,
                    f64,
                    load,
                    |a, s: f64| if s >= a || s.is_nan() { s } else { a },
                    store
                ),
                ScanOp::Min => go!(
                    $T,
                    f64,
                    load,
                    |a, s: f64| if s <= a || s.is_nan() { s } else { a },
                    store
                ),
            }
        }};
    }
    macro_rules! int {
        ($T:ty) => {{
            let same = |s: $T| s;
            match op {
                ScanOp::Sum => go!($T, $T, same, <$T>::wrapping_add, same),
                ScanOp::Prod => go!($T, $T, same, <$T>::wrapping_mul, same),
                ScanOp::Max => go!($T, $T, same, <$T>::max, same),
                ScanOp::Min => go!($T, $T, same, <$T>::min, same),
            }
        }};
    }
    match x.dtype {
        DType::F16 => float!(half::f16),
        DType::BF16 => float!(half::bf16),
        DType::F32 => float!(f32),
        DType::F64 => float!(f64),
        DType::U8 => int!(u8),
        DType::I8 => int!(i8),
        DType::I16 => int!(i16),
        DType::I32 => int!(i32),
        DType::I64 => int!(i64),
        DType::Bool => {
            let (load, store) = (|s: B8| s.get(), B8::new);
            match op {
                ScanOp::Sum | ScanOp::Max => go!(B8, bool, load, |a: bool, s| a | s, store),
                ScanOp::Prod | ScanOp::Min => go!(B8, bool, load, |a: bool, s| a & s, store),
            }
        }
    }
}

/// Stable sort positions of each line along `axis` (i64); NaN ranks above every number.
pub fn argsort(x: &Val, axis: usize, descending: bool) -> KResult<Val> {
    let rank = x.shape().len();
    if axis >= rank {
        return Err(CpuError::Shape(format!(
            "argsort axis {axis} of shape {:?}",
            x.shape()
        )));
    }
    let perm = axis_last_perm(rank, axis);
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape()[p]).collect();
    crate::with_dtype!(x.dtype, T => {
        let v = x.view::<T>()?.permuted(&perm);
        let out = Val::build::<i64>(DType::I64, &shape, |o| {
            if T::IS_FLOAT {
                sort_rows(&v, o, descending, T::to_f64);
            } else {
                sort_rows(&v, o, descending, T::to_i64);
            }
            Ok(())
        })?;
        unpermute(out, &perm)
    })
}

/// Writes each row's sort positions; `key` maps elements to a type whose `partial_cmp` is
/// None only for NaN (ranked last ascending).
fn sort_rows<T: Copy + Send + Sync, K: PartialOrd + Copy>(
    v: &View<T>,
    out: &mut [i64],
    descending: bool,
    key: impl Fn(T) -> K + Sync,
) {
    use std::cmp::Ordering;
    let ascending = |a: K, b: K| match a.partial_cmp(&b) {
        Some(o) => o,
        // Only NaN is unordered: it ranks above every number, and equal to another NaN.
        #[allow(clippy::eq_op)]
        None => match (a != a, b != b) {
            (true, true) => Ordering::Equal,
            (true, false) => Ordering::Greater,
            _ => Ordering::Less,
        },
    };
    for_rows(v, out, |row, out_row| {
        let keys: Vec<K> = row.iter().map(|&e| key(e)).collect();
        let mut order: Vec<usize> = (0..keys.len()).collect();
        // `sort_by` is stable: equal elements keep their order in both directions.
        if descending {
            order.sort_by(|&a, &b| ascending(keys[b], keys[a]));
        } else {
            order.sort_by(|&a, &b| ascending(keys[a], keys[b]));
        }
        for (d, &src) in out_row.iter_mut().zip(&order) {
            *d = src as i64;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cargo test -p ember-cpu --release --lib -- --ignored reduce_speed --nocapture`
    #[test]
    #[ignore]
    fn reduce_speed() {
        let n = 1 << 20;
        let x = Val::build::<f32>(DType::F32, &[n], |o| {
            for (i, v) in o.iter_mut().enumerate() {
                *v = (i % 1000) as f32;
            }
            Ok(())
        })
        .unwrap();
        for op in [ReduceOp::Max, ReduceOp::Sum] {
            let t = std::time::Instant::now();
            for _ in 0..100 {
                reduce(op, &[0], &x, &[]).unwrap();
            }
            println!("{op:?}: {:.0} us", t.elapsed().as_secs_f64() * 1e4);
        }
    }
}
