//! Row-wise composites: softmax / log-softmax (max-subtracted), layer norm and RMS norm
//! (statistics in f64).

use ember_core::dtype::DType;
use half::{bf16, f16};

use super::{axis_last_perm, for_rows, unpermute};
use crate::buffer::{Layout, Val};
use crate::elem::{FloatElem, Real};
use crate::error::{CpuError, KResult};

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
        for_rows(&v, o, |row, out| {
            let mut m = -<T::C as Real>::INF;
            for &a in row {
                let c = a.load();
                if c > m || c.is_nan() {
                    m = c;
                }
            }
            // exp once per element; the sum runs in f64 over four independent lanes so
            // that it vectorizes (the order differs from a serial sum only at f64 rounding).
            let e: Vec<T::C> = row.iter().map(|&a| (a.load() - m).fast_exp()).collect();
            let sum = sum_f64(&e);
            if log {
                let lse = <T::C as Real>::of(sum.ln());
                for (d, &a) in out.iter_mut().zip(row) {
                    *d = T::store(a.load() - m - lse);
                }
            } else {
                let inv = 1.0 / sum;
                for (d, &v) in out.iter_mut().zip(&e) {
                    *d = T::store(<T::C as Real>::of(v.f64() * inv));
                }
            }
        });
        Ok(())
    })?;
    unpermute(out, &perm)
}

/// Sum in f64 with four accumulators (vectorizable, and as accurate as a serial f64 sum for
/// the row lengths softmax sees).
fn sum_f64<C: Real>(xs: &[C]) -> f64 {
    let mut acc = [0.0f64; 4];
    let chunks = xs.chunks_exact(4);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x.f64();
        }
    }
    let mut sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for &x in tail {
        sum += x.f64();
    }
    sum
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

fn param(p: Option<&Val>, n: usize) -> KResult<Option<Vec<f64>>> {
    let Some(p) = p else { return Ok(None) };
    if p.numel() != n {
        return Err(CpuError::Shape(format!(
            "norm parameter has {} elements, expected {n}",
            p.numel()
        )));
    }
    crate::with_dtype!(p.dtype, T => {
        let v: Vec<T> = p.to_vec::<T>()?;
        Ok(Some(v.into_iter().map(crate::elem::Elem::to_f64).collect()))
    })
}

pub fn layer_norm(
    x: &Val,
    axis: usize,
    eps: f64,
    weight: Option<&Val>,
    bias: Option<&Val>,
) -> KResult<Val> {
    float_dispatch!(x.dtype, layer_norm_t, x, axis, eps, weight, bias)
}

fn layer_norm_t<T: FloatElem>(
    x: &Val,
    axis: usize,
    eps: f64,
    weight: Option<&Val>,
    bias: Option<&Val>,
) -> KResult<Val> {
    let (rows, n) = as_rows(x, axis)?;
    let (w, b) = (param(weight, n)?, param(bias, n)?);
    let v = rows.view::<T>()?;
    Val::build::<T>(T::DTYPE, x.shape(), |o| {
        for_rows(&v, o, |row, out| {
            let mean = row.iter().map(|a| a.to_f64()).sum::<f64>() / n as f64;
            let var = row.iter().map(|a| (a.to_f64() - mean).powi(2)).sum::<f64>() / n as f64;
            let rstd = 1.0 / (var + eps).sqrt();
            for (j, (d, a)) in out.iter_mut().zip(row).enumerate() {
                let mut y = (a.to_f64() - mean) * rstd;
                if let Some(w) = &w {
                    y *= w[j];
                }
                if let Some(b) = &b {
                    y += b[j];
                }
                *d = T::from_f64(y);
            }
        });
        Ok(())
    })
}

pub fn rms_norm(x: &Val, axis: usize, eps: f64, weight: Option<&Val>) -> KResult<Val> {
    float_dispatch!(x.dtype, rms_norm_t, x, axis, eps, weight)
}

fn rms_norm_t<T: FloatElem>(x: &Val, axis: usize, eps: f64, weight: Option<&Val>) -> KResult<Val> {
    let (rows, n) = as_rows(x, axis)?;
    let w = param(weight, n)?;
    let v = rows.view::<T>()?;
    Val::build::<T>(T::DTYPE, x.shape(), |o| {
        for_rows(&v, o, |row, out| {
            let ms = row.iter().map(|a| a.to_f64().powi(2)).sum::<f64>() / n as f64;
            let r = 1.0 / (ms + eps).sqrt();
            for (j, (d, a)) in out.iter_mut().zip(row).enumerate() {
                let y = a.to_f64() * r;
                *d = T::from_f64(match &w {
                    Some(w) => y * w[j],
                    None => y,
                });
            }
        });
        Ok(())
    })
}
