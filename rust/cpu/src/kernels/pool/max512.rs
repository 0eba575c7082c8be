//! Max pooling of f32 planes on AVX-512 where the width stride is 1 or 2 (every CNN's pools).
//!
//! Per output row, the input rows under the window are reduced into one row buffer that
//! carries `pad` -inf entries before the row and enough after it for every window and every
//! whole-vector load (so no output is an edge case). The window then slides along that row
//! 16 outputs per vector: with stride 1 a tap is one unaligned load; with stride 2 it is two
//! loads and a two-source permute keeping the even lanes. The generic path splits the row
//! into phases with scalar moves and walks iterators per row, which cost ~4× this.

use std::arch::x86_64::*;

use super::window_rows;
use crate::kernels::window::Axis;
use crate::simd::first_lanes;

const LANES: usize = 16;

/// Whether this kernel runs here (AVX-512) and takes the pool's width stride.
pub fn suits(a: &[Axis; 3]) -> bool {
    crate::simd::avx512_available() && matches!(a[2].stride, 1 | 2)
}

/// NaN-sticky max (torch's): the larger, or a NaN where either is NaN. `max_ps` returns its
/// second operand when either is NaN, so a NaN in `acc` sticks; one in `v` is put back
/// through an add (NaN + anything is NaN) under the unordered mask.
#[inline(always)]
unsafe fn pick(acc: __m512, v: __m512) -> __m512 {
    let unordered = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(acc, v);
    _mm512_mask_add_ps(_mm512_max_ps(v, acc), unordered, acc, v)
}

/// Max pooling of consecutive planes (`xs`: their inputs, `ys`: their outputs); `taps[i][o]`
/// are output o's in-bounds taps along axis i.
///
/// # Safety
/// The CPU must have AVX-512F (`suits`), `a[2].stride` must be 1 or 2 and the kernel at
/// least 1 along every axis.
#[target_feature(enable = "avx512f")]
pub unsafe fn max_planes(a: &[Axis; 3], xs: &[f32], ys: &mut [f32], taps: &[Vec<(usize, usize)>]) {
    let w = a[2];
    debug_assert!(matches!(w.stride, 1 | 2));
    let ip: usize = a.iter().map(|a| a.len).product();
    let op: usize = a.iter().map(|a| a.out).product();
    // Whole vectors of outputs; tap l of the block at output b reads
    // row[b·s + l·dilation .. + 16·s].
    let blocks = w.out.div_ceil(LANES);
    let reach = (blocks * LANES) * w.stride + (w.kernel - 1) * w.dilation;
    let mut row = vec![f32::NEG_INFINITY; reach.max(w.pad + w.len)];
    let mut starts = Vec::new();
    let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    for (yp, xp) in ys.chunks_mut(op).zip(xs.chunks(ip)) {
        for od in 0..a[0].out {
            for oh in 0..a[1].out {
                window_rows(a, taps, od, oh, &mut starts);
                reduce_rows(xp, &starts, w.len, row.as_mut_ptr().add(w.pad));
                let out = yp[(od * a[1].out + oh) * w.out..][..w.out].as_mut_ptr();
                let src = row.as_ptr();
                for b in 0..blocks {
                    let o = b * LANES;
                    let tap = |l: usize| {
                        let at = src.add(o * w.stride + l * w.dilation);
                        if w.stride == 1 {
                            _mm512_loadu_ps(at)
                        } else {
                            let lo = _mm512_loadu_ps(at);
                            let hi = _mm512_loadu_ps(at.add(LANES));
                            _mm512_permutex2var_ps(lo, evens, hi)
                        }
                    };
                    let acc = (1..w.kernel).fold(tap(0), |acc, l| pick(acc, tap(l)));
                    _mm512_mask_storeu_ps(out.add(o), first_lanes(w.out - o), acc);
                }
            }
        }
    }
}

/// `dst[..n]` = the elementwise max of the `n`-long rows of `xp` at `starts` (none: -inf),
/// 16 lanes at a time, the last vector masked so `dst`'s -inf margin after `n` stays.
#[inline(always)]
unsafe fn reduce_rows(xp: &[f32], starts: &[usize], n: usize, dst: *mut f32) {
    let mut i = 0;
    while i < n {
        let m = first_lanes(n - i);
        let load = |s: usize| _mm512_maskz_loadu_ps(m, xp[s..][..n].as_ptr().add(i));
        let acc = match starts.split_first() {
            Some((&first, rest)) => rest.iter().fold(load(first), |acc, &s| pick(acc, load(s))),
            None => _mm512_set1_ps(f32::NEG_INFINITY),
        };
        _mm512_mask_storeu_ps(dst.add(i), m, acc);
        i += LANES;
    }
}
