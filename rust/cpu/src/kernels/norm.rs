//! Row-wise composites: softmax / log-softmax (max-subtracted), layer norm and RMS norm
//! (statistics in f64, the output pass in f32 for f32 and half types). Row loops keep
//! `LANES` independent accumulators so that they vectorize; the sums stay in f64, so results
//! match a serial f64 sum to f64 rounding.

use ember_core::dtype::DType;
use half::{bf16, f16};

use super::{axis_last_perm, for_rows, unpermute};
use crate::arena::Dest;
use crate::buffer::{Layout, Val, View};
use crate::elem::vecmath::Fma;
use crate::elem::{as_f32, as_f32_mut, FloatElem, Real};
use crate::error::{CpuError, KResult};
use crate::simd;

macro_rules! float_dispatch {
    ($dt:expr, $f:ident, $($arg:expr),*) => {
        match $dt {
            DType::F16 => $f::<f16>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            other => Err(CpuError::Unsupported(format!("needs a float input, got {other}"))),
        }
    };
}

pub fn softmax(x: &Val, axis: usize, log: bool) -> KResult<Val> {
    float_dispatch!(x.dtype, softmax_t, x, axis, log)
}

fn softmax_t<T: FloatElem>(x: &Val, axis: usize, log: bool) -> KResult<Val> {
    let rank = x.shape().len();
    if axis >= rank {
        return Err(CpuError::Shape(format!(
            "softmax axis {axis} of rank {rank}"
        )));
    }
    let perm = axis_last_perm(rank, axis);
    let v = x.view::<T>()?.permuted(&perm);
    let out = Val::build::<T>(T::DTYPE, &v.shape.clone(), |o| {
        softmax_rows(&v, o, log);
        Ok(())
    })?;
    unpermute(out, &perm)
}

/// Softmax over the last axis, written straight into `dest` (x's shape).
pub fn softmax_last_into(x: &Val, log: bool, dest: &mut Dest) -> KResult<()> {
    float_dispatch!(x.dtype, softmax_last_into_t, x, log, dest)
}

fn softmax_last_into_t<T: FloatElem>(x: &Val, log: bool, dest: &mut Dest) -> KResult<()> {
    check_dest(x, dest)?;
    softmax_rows(&x.view::<T>()?, dest.slice::<T>()?, log);
    Ok(())
}

/// The rows of `o` (row-major over v's shape) get the softmax of v's last-axis rows.
fn softmax_rows<T: FloatElem>(v: &View<T>, o: &mut [T], log: bool) {
    // f16/bf16 store e^x rounded, so they compute it again for the final product (one
    // rounding, as before); f32/f64 store it exactly and read it back.
    let exact_store = std::mem::size_of::<T>() == std::mem::size_of::<T::C>();
    for_rows(v, o, |row, out| {
        simd::wide(|| {
            let m = row_max(row);
            // exp once per element (a pure f32 loop, which vectorizes), then the sum in f64
            // over independent lanes; half types sum the unrounded values.
            let sum = if exact_store {
                match (as_f32(row), as_f32_mut(out), Fma::detect()) {
                    (Some(row), Some(out), Some(fma)) => {
                        fma.exp_shifted_sum(row, out, m.f64() as f32)
                    }
                    _ => {
                        for (d, &a) in out.iter_mut().zip(row) {
                            *d = T::store((a.load() - m).fast_exp());
                        }
                        sum_lanes(out, |d| d.load().f64())
                    }
                }
            } else {
                sum_lanes(row, |a| (a.load() - m).fast_exp().f64())
            };
            if log {
                let lse = <T::C as Real>::of(sum.ln());
                for (d, &a) in out.iter_mut().zip(row) {
                    *d = T::store(a.load() - m - lse);
                }
            } else if exact_store {
                // In the compute type: e^x ≤ 1 times 1/Σ rounded once more than through f64
                // (≤ 1 ulp; torch's f32 softmax divides in f32), at twice the lanes of a
                // pass through f64 and back.
                let inv = <T::C as Real>::of(1.0 / sum);
                for d in out.iter_mut() {
                    *d = T::store(d.load() * inv);
                }
            } else {
                let inv = 1.0 / sum;
                for (d, &a) in out.iter_mut().zip(row) {
                    let e = (a.load() - m).fast_exp();
                    *d = T::store(<T::C as Real>::of(e.f64() * inv));
                }
            }
        })
    });
}

/// `dest` must have x's shape (a norm's output).
fn check_dest(x: &Val, dest: &Dest) -> KResult<()> {
    if dest.shape != x.shape() || dest.dtype != x.dtype {
        return Err(CpuError::Internal(format!(
            "norm output {:?} {} for input {:?} {}",
            dest.shape,
            dest.dtype,
            x.shape(),
            x.dtype
        )));
    }
    Ok(())
}

/// The numerators of one f32/f64 row's softmax, in place: `exp(x − max(row))`, returning
/// their sum (each divided by it is the softmax, as the softmax op computes it). For kernels
/// that produce score rows themselves (attention) and can fold the division into what they
/// compute from the weights.
pub(crate) fn softmax_numerators_in_place<T: FloatElem<C = T> + Real>(row: &mut [T]) -> f64 {
    simd::wide(|| {
        let m = row_max(row);
        if let (Some(fma), Some(row)) = (Fma::detect(), as_f32_mut(row)) {
            return fma.exp_shifted_sum_in_place(row, m.f64() as f32);
        }
        for x in row.iter_mut() {
            *x = T::store((x.load() - m).fast_exp());
        }
        sum_lanes(row, |d| d.load().f64())
    })
}

/// Independent accumulators in the row loops: enough to hide add latency and fill vector
/// registers, so the loops vectorize (a serial sum cannot be reordered by the compiler).
const LANES: usize = 8;

/// The row's maximum (NaN if any element is NaN), over `LANES` independent lanes.
#[inline(always)]
fn row_max<T: FloatElem>(row: &[T]) -> T::C {
    let keep = |m: T::C, c: T::C| if c > m || c.is_nan() { c } else { m };
    let mut acc = [-<T::C as Real>::INF; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..LANES {
            acc[k] = keep(acc[k], c[k].load());
        }
    }
    acc.into_iter()
        .chain(tail.iter().map(|x| x.load()))
        .fold(-<T::C as Real>::INF, keep)
}

/// Σ f(x) over a row in f64, over `LANES` independent accumulators: vectorizable, and as
/// accurate as a serial f64 sum for the row lengths norms see.
#[inline(always)]
fn sum_lanes<T: Copy>(row: &[T], f: impl Fn(T) -> f64) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..LANES {
            acc[k] += f(c[k]);
        }
    }
    combine(acc) + tail.iter().map(|&x| f(x)).sum::<f64>()
}

/// The lanes added pairwise.
#[inline(always)]
fn combine(mut acc: [f64; LANES]) -> f64 {
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for k in 0..w {
            acc[k] += acc[k + w];
        }
    }
    acc[0]
}

/// x as `[rows, n]` over the trailing dims from `axis` (contiguous), with `n`.
fn as_rows(x: &Val, axis: usize) -> KResult<(Val, usize)> {
    let xc = x.contiguous()?;
    let n: usize = x.shape()[axis..].iter().product();
    let rows: usize = x.shape()[..axis].iter().product();
    let layout = Layout {
        shape: vec![rows, n],
        strides: vec![n as isize, 1],
        offset: xc.layout.offset,
    };
    Ok((xc.with_layout(layout)?, n))
}

/// A norm's weight or bias in the compute type `C` of the input's dtype.
fn param<C: Real>(p: Option<&Val>, n: usize) -> KResult<Option<Vec<C>>> {
    let Some(p) = p else { return Ok(None) };
    if p.numel() != n {
        return Err(CpuError::Shape(format!(
            "norm parameter has {} elements, expected {n}",
            p.numel()
        )));
    }
    crate::with_dtype!(p.dtype, T => {
        let v: Vec<T> = p.to_vec::<T>()?;
        Ok(Some(v.into_iter().map(|e| C::of(crate::elem::Elem::to_f64(e))).collect()))
    })
}

/// Layer norm written straight into `dest` (x's shape).
pub fn layer_norm_into(
    x: &Val,
    axis: usize,
    eps: f64,
    params: (Option<&Val>, Option<&Val>),
    dest: &mut Dest,
) -> KResult<()> {
    float_dispatch!(x.dtype, layer_norm_into_t, x, axis, eps, params, dest)
}

fn layer_norm_into_t<T: FloatElem>(
    x: &Val,
    axis: usize,
    eps: f64,
    params: (Option<&Val>, Option<&Val>),
    dest: &mut Dest,
) -> KResult<()> {
    check_dest(x, dest)?;
    layer_norm_rows::<T>(x, axis, eps, params, dest.slice::<T>()?)
}

fn layer_norm_rows<T: FloatElem>(
    x: &Val,
    axis: usize,
    eps: f64,
    (weight, bias): (Option<&Val>, Option<&Val>),
    o: &mut [T],
) -> KResult<()> {
    let (rows, n) = as_rows(x, axis)?;
    let (w, b) = (param::<T::C>(weight, n)?, param::<T::C>(bias, n)?);
    let v = rows.view::<T>()?;
    for_rows(&v, o, |row, out| {
        simd::wide(|| {
            // Statistics in f64; the output pass in the compute type (8 f32 lanes where
            // f64 has 4), with the mean split in two so that x - mean loses nothing to
            // the mean's rounding when |mean| is much larger than the deviation.
            let mean = sum_lanes(row, |a| a.to_f64()) / n as f64;
            let var = sum_lanes(row, |a| (a.to_f64() - mean).powi(2)) / n as f64;
            let rstd = <T::C as Real>::of(1.0 / (var + eps).sqrt());
            let hi = <T::C as Real>::of(mean);
            let lo = <T::C as Real>::of(mean - hi.f64());
            let norm = |a: T| (a.load() - hi - lo) * rstd;
            // One loop per parameter combination, so none branches per element.
            match (&w, &b) {
                (Some(w), Some(b)) => {
                    for (((d, &a), &w), &b) in out.iter_mut().zip(row).zip(w).zip(b) {
                        *d = T::store(norm(a) * w + b);
                    }
                }
                (Some(w), None) => {
                    for ((d, &a), &w) in out.iter_mut().zip(row).zip(w) {
                        *d = T::store(norm(a) * w);
                    }
                }
                (None, Some(b)) => {
                    for ((d, &a), &b) in out.iter_mut().zip(row).zip(b) {
                        *d = T::store(norm(a) + b);
                    }
                }
                (None, None) => {
                    for (d, &a) in out.iter_mut().zip(row) {
                        *d = T::store(norm(a));
                    }
                }
            }
        })
    });
    Ok(())
}

/// RMS norm written straight into `dest` (x's shape).
pub fn rms_norm_into(
    x: &Val,
    axis: usize,
    eps: f64,
    weight: Option<&Val>,
    dest: &mut Dest,
) -> KResult<()> {
    float_dispatch!(x.dtype, rms_norm_into_t, x, axis, eps, weight, dest)
}

fn rms_norm_into_t<T: FloatElem>(
    x: &Val,
    axis: usize,
    eps: f64,
    weight: Option<&Val>,
    dest: &mut Dest,
) -> KResult<()> {
    check_dest(x, dest)?;
    rms_norm_rows::<T>(x, axis, eps, weight, dest.slice::<T>()?)
}

fn rms_norm_rows<T: FloatElem>(
    x: &Val,
    axis: usize,
    eps: f64,
    weight: Option<&Val>,
    o: &mut [T],
) -> KResult<()> {
    let (rows, n) = as_rows(x, axis)?;
    let w = param::<T::C>(weight, n)?;
    let v = rows.view::<T>()?;
    for_rows(&v, o, |row, out| {
        simd::wide(|| {
            // The mean square in f64, the output pass in the compute type.
            let ms = sum_lanes(row, |a| a.to_f64().powi(2)) / n as f64;
            let r = <T::C as Real>::of(1.0 / (ms + eps).sqrt());
            match &w {
                Some(w) => {
                    for ((d, &a), &w) in out.iter_mut().zip(row).zip(w) {
                        *d = T::store(a.load() * r * w);
                    }
                }
                None => {
                    for (d, &a) in out.iter_mut().zip(row) {
                        *d = T::store(a.load() * r);
                    }
                }
            }
        })
    });
    Ok(())
}
