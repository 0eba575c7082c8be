//! Scaled dot-product attention per batch: scores = q·kᵀ·scale (gemm, k read transposed
//! through its strides), causal / bool / additive mask, max-subtracted softmax, then ·v.
//! f16/bf16 run in f32.

use ember_core::dtype::DType;

use super::dot::{gemm_into, GemmElem, Mat};
use super::elementwise::cast;
use crate::buffer::Val;
use crate::elem::{FloatElem, Real, B8};
use crate::error::{CpuError, KResult};
use crate::par;
use crate::strided::batch_offsets;

pub struct Params {
    pub scale: f64,
    pub causal: bool,
}

pub fn attention(
    q: &Val,
    k: &Val,
    v: &Val,
    mask: Option<&Val>,
    p: &Params,
    threads: usize,
) -> KResult<Val> {
    match q.dtype {
        DType::F32 => attention_t::<f32>(q, k, v, mask, p, threads),
        DType::F64 => attention_t::<f64>(q, k, v, mask, p, threads),
        DType::F16 | DType::BF16 => {
            let up = |x: &Val| cast(x, DType::F32);
            let mask = match mask {
                Some(m) if m.dtype != DType::Bool => Some(up(m)?),
                Some(m) => Some(m.clone()),
                None => None,
            };
            let out = attention_t::<f32>(&up(q)?, &up(k)?, &up(v)?, mask.as_ref(), p, threads)?;
            cast(&out, q.dtype)
        }
        other => Err(CpuError::Unsupported(format!("attention on {other}"))),
    }
}

fn attention_t<T: GemmElem + FloatElem<C = T> + Real>(
    q: &Val,
    k: &Val,
    v: &Val,
    mask: Option<&Val>,
    p: &Params,
    threads: usize,
) -> KResult<Val> {
    let (sq, sk, sv) = (q.shape(), k.shape(), v.shape());
    let r = sq.len();
    let bad = || CpuError::Shape(format!("attention of q {sq:?}, k {sk:?}, v {sv:?}"));
    if r < 2 || sk.len() != r || sv.len() != r {
        return Err(bad());
    }
    let nb = r - 2;
    let (l, e, s, ev) = (sq[r - 2], sq[r - 1], sk[r - 2], sv[r - 1]);
    if sq[..nb] != sk[..nb] || sk[..r - 1] != sv[..r - 1] || sk[r - 1] != e {
        return Err(bad());
    }
    let mut want_mask = sq[..r - 1].to_vec();
    want_mask.push(s);
    if let Some(m) = mask {
        if m.shape() != want_mask {
            return Err(CpuError::Shape(format!(
                "attention mask {:?}, expected {want_mask:?}",
                m.shape()
            )));
        }
        if m.dtype != DType::Bool && m.dtype != T::DTYPE {
            return Err(CpuError::Shape(format!(
                "attention mask of dtype {}",
                m.dtype
            )));
        }
    }
    let (vq, vk, vv) = (q.view::<T>()?, k.view::<T>()?, v.view::<T>()?);
    let bool_mask = match mask {
        Some(m) if m.dtype == DType::Bool => Some(m.view::<B8>()?),
        _ => None,
    };
    let add_mask = match mask {
        Some(m) if m.dtype != DType::Bool => Some(m.view::<T>()?),
        _ => None,
    };
    let zero_strides = vec![0isize; r];
    let mstrides = match (&bool_mask, &add_mask) {
        (Some(m), _) => m.strides.clone(),
        (_, Some(m)) => m.strides.clone(),
        _ => zero_strides,
    };
    let offs = batch_offsets(
        &sq[..nb],
        [&vq.strides, &vk.strides, &vv.strides, &mstrides],
    );
    let (mrs, mcs) = (mstrides[r - 2], mstrides[r - 1]);
    let scale = T::of(p.scale);
    let mut shape = sq[..r - 1].to_vec();
    shape.push(ev);
    Val::build::<T>(T::DTYPE, &shape, |out| {
        if l * ev == 0 {
            return Ok(());
        }
        let one = |o: &mut [T], &[oq, ok, ov, om]: &[isize; 4], t: usize| {
            let mut scores = vec![<T as Real>::ZERO; l * s];
            let (mq, mk) = (Mat::of(&vq, oq, nb), Mat::of(&vk, ok, nb).transposed());
            // SAFETY: q and k are batch slices of checked views; scores holds l·s elements.
            unsafe { gemm_into(&mut scores, s, (l, s, e), mq, mk, t) };
            for (i, row) in scores.chunks_mut(s.max(1)).enumerate().take(l) {
                let mbase = om + i as isize * mrs;
                for (j, x) in row.iter_mut().enumerate() {
                    let mut y = *x * scale;
                    let moff = mbase + j as isize * mcs;
                    if let Some(m) = &add_mask {
                        y = y + m.at(moff);
                    }
                    let masked = (p.causal && j > i)
                        || bool_mask.as_ref().is_some_and(|m| !m.at(moff).get());
                    *x = if masked { -T::INF } else { y };
                }
                softmax_row(row);
            }
            let mp = Mat {
                ptr: scores.as_ptr(),
                rs: s as isize,
                cs: 1,
            };
            // SAFETY: scores is l×s and alive; v is a batch slice of a checked view.
            unsafe { gemm_into(o, ev, (l, ev, s), mp, Mat::of(&vv, ov, nb), t) };
        };
        // Heads in parallel when there are several and enough work to pay for waking a helper.
        if offs.len() > 1 && threads > 1 && offs.len() * l * s * (e + ev) >= PAR_MIN_WORK {
            par::for_chunks_mut(out, l * ev, |start, o| one(o, &offs[start / (l * ev)], 1));
        } else {
            for (o, off) in out.chunks_mut(l * ev).zip(&offs) {
                one(o, off, threads);
            }
        }
        Ok(())
    })
}

/// Multiply-adds below which the heads of one call run on one thread.
const PAR_MIN_WORK: usize = 1 << 17;

/// In-place stable softmax of one row (a row of -inf becomes NaN).
fn softmax_row<T: Real>(row: &mut [T]) {
    let mut m = -T::INF;
    for &x in row.iter() {
        if x > m || x.is_nan() {
            m = x;
        }
    }
    let mut sum = 0.0f64;
    for x in row.iter_mut() {
        *x = (*x - m).fast_exp();
        sum += x.f64();
    }
    let inv = T::of(1.0 / sum);
    for x in row.iter_mut() {
        *x = *x * inv;
    }
}
