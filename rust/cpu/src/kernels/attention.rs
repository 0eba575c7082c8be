//! Scaled dot-product attention per batch: scores = q·kᵀ·scale (gemm, k read transposed
//! through its strides), causal / bool / additive mask, max-subtracted softmax, then ·v.
//! f16/bf16 run in f32.

use ember_core::dtype::DType;

use super::dot::{gemm_into, GemmElem, Mat};
use super::elementwise::cast;
use super::norm::softmax_row_in_place;
use super::sgemm;
use crate::buffer::{Val, View};
use crate::elem::{FloatElem, Real, B8};
use crate::error::{CpuError, KResult};
use crate::par;
use crate::simd;
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
        // Scale, mask and softmax of score row `i` of the batch whose mask starts at `om`.
        let unmasked = !p.causal && add_mask.is_none() && bool_mask.is_none();
        let finish_row = |row: &mut [T], i: usize, om: isize| {
            if unmasked {
                simd::wide(|| row.iter_mut().for_each(|x| *x = *x * scale));
                return softmax_row_in_place(row);
            }
            let mbase = om + i as isize * mrs;
            let mut kept = false;
            for (j, x) in row.iter_mut().enumerate() {
                let mut y = *x * scale;
                let moff = mbase + j as isize * mcs;
                if let Some(m) = &add_mask {
                    y = y + m.at(moff);
                }
                let masked =
                    (p.causal && j > i) || bool_mask.as_ref().is_some_and(|m| !m.at(moff).get());
                *x = if masked { -T::INF } else { y };
                kept |= *x != -T::INF;
            }
            if !kept {
                // Every score masked (left padding): zeros, as torch's SDPA, not NaN.
                row.fill(<T as Real>::ZERO);
                return;
            }
            softmax_row_in_place(row);
        };
        let by_gemm = |o: &mut [T], &[oq, ok, ov, om]: &[isize; 4], t: usize| {
            let mut scores = vec![<T as Real>::ZERO; l * s];
            let (mq, mk) = (Mat::of(&vq, oq, nb), Mat::of(&vk, ok, nb).transposed());
            // SAFETY: q and k are batch slices of checked views; scores holds l·s elements.
            unsafe { gemm_into(&mut scores, s, (l, s, e), mq, mk, t) };
            for (i, row) in scores.chunks_mut(s.max(1)).enumerate().take(l) {
                finish_row(row, i, om);
            }
            let mp = Mat {
                ptr: scores.as_ptr(),
                rs: s as isize,
                cs: 1,
            };
            // SAFETY: scores is l×s and alive; v is a batch slice of a checked view.
            unsafe { gemm_into(o, ev, (l, ev, s), mp, Mat::of(&vv, ov, nb), t) };
        };
        // Few query rows (decode: one token, or the query heads sharing a key/value head):
        // each key and value row is read once, contiguously, for all of them; two GEMMs
        // would cost more in packing and set-up than this does in arithmetic.
        let (qs, ks, vs) = (vq.strides[r - 2], vk.strides[r - 2], vv.strides[r - 2]);
        let unit = |v: &[isize], n: usize| n <= 1 || v[r - 1] == 1;
        let direct_ok = l <= DIRECT_MAX_ROWS
            && unit(&vq.strides, e)
            && unit(&vk.strides, e)
            && unit(&vv.strides, ev);
        // f32 on AVX2 + FMA: the products in registers (the generic loops below keep an
        // output row in memory and did not vectorize the dot products well).
        let avx2_f32 = T::DTYPE == DType::F32 && sgemm::available();
        let direct = |o: &mut [T], &[oq, ok, ov, om]: &[isize; 4]| {
            let mut scores = vec![<T as Real>::ZERO; l * s];
            let (q, k, v) = ((&vq, oq, qs), (&vk, ok, ks), (&vv, ov, vs));
            if avx2_f32 {
                // SAFETY: T is f32 (checked above); the rows lie in checked views with unit
                // stride along e/ev (`direct_ok`); scores holds l·s and o l·ev elements.
                unsafe {
                    fast::scores(
                        scores.as_mut_ptr().cast(),
                        rows_f32(q),
                        rows_f32(k),
                        (l, s, e),
                    )
                };
            } else {
                simd::wide(
                    #[inline(always)]
                    || scores_direct(&mut scores, q, k, (l, s, e)),
                );
            }
            for (i, row) in scores.chunks_mut(s.max(1)).enumerate().take(l) {
                finish_row(row, i, om);
            }
            if avx2_f32 {
                // SAFETY: as above.
                unsafe {
                    fast::weighted(
                        o.as_mut_ptr().cast(),
                        scores.as_ptr().cast(),
                        rows_f32(v),
                        (l, s, ev),
                    )
                };
            } else {
                simd::wide(
                    #[inline(always)]
                    || weighted_rows(o, &scores, v, (s, ev)),
                );
            }
        };
        let one = |o: &mut [T], off: &[isize; 4], t: usize| {
            if direct_ok {
                direct(o, off)
            } else {
                by_gemm(o, off, t)
            }
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

/// Query rows per batch up to which attention skips the GEMMs (see `direct` above).
const DIRECT_MAX_ROWS: usize = 8;

/// A batch's rows: the view, the offset of row 0, the row stride (elements contiguous).
type Rows<'a, T> = (&'a View<T>, isize, isize);

/// `scores[i·s + j] = q_i · k_j` for `l` query rows and `s` key rows of `e` elements: each
/// key row is read once for all query rows. A named, always-inlined function so that all of
/// it lands in `simd::wide`'s AVX2 copy (a closure body there stayed an SSE call).
#[inline(always)]
fn scores_direct<T: Real>(
    scores: &mut [T],
    (q, oq, qs): Rows<T>,
    (k, ok, ks): Rows<T>,
    (l, s, e): (usize, usize, usize),
) {
    for j in 0..s {
        let krow = k.run(ok + j as isize * ks, e);
        for i in 0..l {
            scores[i * s + j] = dot(q.run(oq + i as isize * qs, e), krow);
        }
    }
}

/// `o_i = Σ_j p[i·s + j] · v_j` for the rows of `o` (each `ev` long): each value row is read
/// once for all of them.
#[inline(always)]
fn weighted_rows<T: Real>(o: &mut [T], p: &[T], (v, ov, vs): Rows<T>, (s, ev): (usize, usize)) {
    o.fill(<T as Real>::ZERO);
    for j in 0..s {
        let vrow = v.run(ov + j as isize * vs, ev);
        for (i, orow) in o.chunks_exact_mut(ev).enumerate() {
            let w = p[i * s + j];
            for (d, &x) in orow.iter_mut().zip(vrow) {
                *d = *d + w * x;
            }
        }
    }
}

/// Row 0's address and the row stride, for the f32 kernels (`T` must be f32).
fn rows_f32<T>((v, off, stride): Rows<T>) -> (*const f32, isize) {
    (v.ptr.wrapping_offset(off).cast(), stride)
}

/// The direct kernel's two loops for f32 with AVX2 and FMA.
mod fast {
    /// `scores[i·s + j] = q_i · k_j` (rows of `e` contiguous elements).
    ///
    /// # Safety
    /// `sgemm::available()`; `l` q rows and `s` k rows readable; `scores` holds l·s.
    pub unsafe fn scores(
        scores: *mut f32,
        (q, qs): (*const f32, isize),
        (k, ks): (*const f32, isize),
        (l, s, e): (usize, usize, usize),
    ) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        unsafe {
            x86::scores(scores, (q, qs), (k, ks), (l, s, e))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (scores, q, qs, k, ks, l, s, e);
            unreachable!("runs only where sgemm::available()");
        }
    }

    /// `o_i = Σ_j p[i·s + j] · v_j` for `l` rows of `ev` (contiguous value rows).
    ///
    /// # Safety
    /// `sgemm::available()`; `s` v rows readable; `p` holds l·s, `o` l·ev.
    pub unsafe fn weighted(
        o: *mut f32,
        p: *const f32,
        (v, vs): (*const f32, isize),
        (l, s, ev): (usize, usize, usize),
    ) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        unsafe {
            x86::weighted(o, p, (v, vs), (l, s, ev))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (o, p, v, vs, l, s, ev);
            unreachable!("runs only where sgemm::available()");
        }
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;

        /// Σ a[i]·b[i] over `n` elements: two vector accumulators, then the tail.
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        unsafe fn dot(a: *const f32, b: *const f32, n: usize) -> f32 {
            // SAFETY (whole body): a and b address n elements (caller).
            unsafe {
                let (mut x, mut y) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut i = 0;
                while i + 16 <= n {
                    x = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), x);
                    let (a8, b8) = (a.add(i + 8), b.add(i + 8));
                    y = _mm256_fmadd_ps(_mm256_loadu_ps(a8), _mm256_loadu_ps(b8), y);
                    i += 16;
                }
                if i + 8 <= n {
                    x = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), x);
                    i += 8;
                }
                let v = _mm256_add_ps(x, y);
                let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                let mut r = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
                while i < n {
                    r += *a.add(i) * *b.add(i);
                    i += 1;
                }
                r
            }
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn scores(
            scores: *mut f32,
            (q, qs): (*const f32, isize),
            (k, ks): (*const f32, isize),
            (l, s, e): (usize, usize, usize),
        ) {
            for j in 0..s {
                // SAFETY: rows inside the caller's ranges.
                unsafe {
                    let kr = k.offset(j as isize * ks);
                    for i in 0..l {
                        *scores.add(i * s + j) = dot(q.offset(i as isize * qs), kr, e);
                    }
                }
            }
        }

        /// Per output row, blocks of 32 (then 8) columns accumulate over all `s` value rows
        /// in registers; the last columns one by one.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn weighted(
            o: *mut f32,
            p: *const f32,
            (v, vs): (*const f32, isize),
            (l, s, ev): (usize, usize, usize),
        ) {
            // SAFETY (whole body): every address is inside the caller's ranges.
            unsafe {
                for i in 0..l {
                    let (pi, out) = (p.add(i * s), o.add(i * ev));
                    let mut d = 0;
                    while d + 32 <= ev {
                        let mut acc = [_mm256_setzero_ps(); 4];
                        for j in 0..s {
                            let w = _mm256_set1_ps(*pi.add(j));
                            let row = v.offset(j as isize * vs).add(d);
                            for (b, a) in acc.iter_mut().enumerate() {
                                *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(row.add(8 * b)), *a);
                            }
                        }
                        for (b, a) in acc.iter().enumerate() {
                            _mm256_storeu_ps(out.add(d + 8 * b), *a);
                        }
                        d += 32;
                    }
                    while d + 8 <= ev {
                        let mut acc = _mm256_setzero_ps();
                        for j in 0..s {
                            let row = v.offset(j as isize * vs).add(d);
                            acc = _mm256_fmadd_ps(
                                _mm256_set1_ps(*pi.add(j)),
                                _mm256_loadu_ps(row),
                                acc,
                            );
                        }
                        _mm256_storeu_ps(out.add(d), acc);
                        d += 8;
                    }
                    for c in d..ev {
                        let mut acc = 0.0f32;
                        for j in 0..s {
                            acc += *pi.add(j) * *v.offset(j as isize * vs).add(c);
                        }
                        *out.add(c) = acc;
                    }
                }
            }
        }
    }
}

/// `a · b` with eight independent partial sums (vectorizable, and the same order on every
/// build), added pairwise at the end.
#[inline(always)]
fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut acc = [<T as Real>::ZERO; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let mut tail = <T as Real>::ZERO;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail = tail + *x * *y;
    }
    for (x, y) in ca.zip(cb) {
        for lane in 0..8 {
            acc[lane] = acc[lane] + x[lane] * y[lane];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}
