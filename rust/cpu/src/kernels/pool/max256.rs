//! Max pooling of f32 planes on AVX2 where the width stride is 1 or 2: `max512`'s method at
//! 8 lanes, for the CPUs without AVX-512.
//!
//! Per output row, the input rows under the window are reduced into one row buffer that
//! carries `pad` -inf entries before the row and enough after it for every window and every
//! whole-vector load. The window then slides along that row 8 outputs per vector: with
//! stride 1 a tap is one unaligned load; with stride 2, two loads, a shuffle keeping the even
//! lanes of each 128-bit half and a permute joining the halves. No masked loads or stores
//! (microcoded on AMD): row tails overlap the previous vector, output tails go through a
//! small array. The generic path (phase split by scalar moves, iterators per row) ran at
//! 1.9 ns per output of the benchmark CNN's pool, 2× ONNX Runtime's.

use std::arch::x86_64::*;

use super::window_rows;
use crate::kernels::window::Axis;

const LANES: usize = 8;

/// Whether this kernel runs here (AVX2) and takes the pool's width stride.
pub fn suits(a: &[Axis; 3]) -> bool {
    crate::simd::avx2_enabled() && matches!(a[2].stride, 1 | 2)
}

/// NaN-sticky max (torch's): the larger, or a NaN where either is NaN. `max_ps` returns its
/// second operand when either is NaN, so a NaN in `acc` sticks; one in `v` is blended back.
#[inline(always)]
unsafe fn pick(acc: __m256, v: __m256) -> __m256 {
    // SAFETY: AVX2 present (every caller is compiled for it).
    unsafe {
        let larger = _mm256_max_ps(v, acc);
        _mm256_blendv_ps(larger, v, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v))
    }
}

/// Max pooling of consecutive planes (`xs`: their inputs, `ys`: their outputs); `taps[i][o]`
/// are output o's in-bounds taps along axis i.
///
/// # Safety
/// The CPU must have AVX2 (`suits`), `a[2].stride` must be 1 or 2 and the kernel at least 1
/// along every axis.
#[target_feature(enable = "avx2")]
pub unsafe fn max_planes(a: &[Axis; 3], xs: &[f32], ys: &mut [f32], taps: &[Vec<(usize, usize)>]) {
    let w = a[2];
    assert!(matches!(w.stride, 1 | 2) && w.kernel > 0);
    let ip: usize = a.iter().map(|a| a.len).product();
    let op: usize = a.iter().map(|a| a.out).product();
    // Whole vectors of outputs; tap l of the block at output o reads
    // row[o·s + l·dilation .. + 8·s].
    let blocks = w.out.div_ceil(LANES);
    let reach = blocks * LANES * w.stride + (w.kernel - 1) * w.dilation;
    let mut row = vec![f32::NEG_INFINITY; reach.max(w.pad + w.len)];
    let mut starts = Vec::new();
    for (yp, xp) in ys.chunks_mut(op).zip(xs.chunks(ip)) {
        for od in 0..a[0].out {
            for oh in 0..a[1].out {
                window_rows(a, taps, od, oh, &mut starts);
                // SAFETY: `row` holds pad + len entries; AVX2 present.
                unsafe { reduce_rows(xp, &starts, &mut row[w.pad..][..w.len]) };
                let out = &mut yp[(od * a[1].out + oh) * w.out..][..w.out];
                // SAFETY: `row` holds every entry a block's taps read (`reach`); AVX2 present.
                unsafe {
                    match (w.kernel, w.stride) {
                        // The common pools with the width as a literal (taps unrolled).
                        (3, 2) => slide::<2>(&row, 3, w.dilation, out),
                        (2, 2) => slide::<2>(&row, 2, w.dilation, out),
                        (3, 1) => slide::<1>(&row, 3, w.dilation, out),
                        (k, 1) => slide::<1>(&row, k, w.dilation, out),
                        (k, _) => slide::<2>(&row, k, w.dilation, out),
                    }
                }
            }
        }
    }
}

/// One tap of a block: the 8 entries `row[S·i]`, i < 8 (stride S along the row).
#[inline(always)]
unsafe fn tap<const S: usize>(row: *const f32) -> __m256 {
    // SAFETY: the caller's `row` holds 8·S entries from here; AVX2 present.
    unsafe {
        if S == 1 {
            return _mm256_loadu_ps(row);
        }
        let (lo, hi) = (_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(LANES)));
        // [lo0 lo2 hi0 hi2 | lo4 lo6 hi4 hi6] → lo's evens, then hi's.
        let even = _mm256_shuffle_ps::<0b10_00_10_00>(lo, hi);
        _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(
            even,
        )))
    }
}

/// Stores `v` at `out[o..]`: a whole vector, or its first lanes at the row's end.
#[inline(always)]
unsafe fn store(out: &mut [f32], o: usize, v: __m256) {
    // SAFETY: AVX2 present; the whole store only where o + 8 <= out.len().
    unsafe {
        if o + LANES <= out.len() {
            _mm256_storeu_ps(out.as_mut_ptr().add(o), v);
        } else {
            let mut lanes = [0.0f32; LANES];
            _mm256_storeu_ps(lanes.as_mut_ptr(), v);
            let n = out.len() - o;
            out[o..].copy_from_slice(&lanes[..n]);
        }
    }
}

/// `out[o]` = the max over taps l < `kernel` of `row[o·S + l·dilation]`, 8 outputs a step.
/// Inlined into each call site of `max_planes`, where a literal `kernel` unrolls the taps.
///
/// # Safety
/// AVX2 present; `row` holds every entry a whole block reads (`reach` in `max_planes`).
#[inline(always)]
unsafe fn slide<const S: usize>(row: &[f32], kernel: usize, dilation: usize, out: &mut [f32]) {
    let src = row.as_ptr();
    for o in (0..out.len()).step_by(LANES) {
        // SAFETY: by the contract.
        unsafe {
            let mut acc = tap::<S>(src.add(o * S));
            for l in 1..kernel {
                acc = pick(acc, tap::<S>(src.add(o * S + l * dilation)));
            }
            store(out, o, acc);
        }
    }
}

/// `dst` = the elementwise max of the `dst.len()`-long rows of `xp` at `starts` (none:
/// -inf), 8 lanes at a time; the last vector overlaps the one before (max is idempotent).
///
/// # Safety
/// AVX2 present.
#[inline(always)]
unsafe fn reduce_rows(xp: &[f32], starts: &[usize], dst: &mut [f32]) {
    let n = dst.len();
    if n < LANES {
        for (i, d) in dst.iter_mut().enumerate() {
            *d = starts
                .iter()
                .fold(f32::NEG_INFINITY, |m, &s| super::pick(m, xp[s + i]));
        }
        return;
    }
    for s in starts {
        assert!(s + n <= xp.len(), "window row past the plane");
    }
    let (x, out) = (xp.as_ptr(), dst.as_mut_ptr());
    // SAFETY: every row [s, s + n) lies in xp (asserted) and n >= 8; AVX2 present.
    unsafe {
        match *starts {
            [a, b, c] => reduce::<3>([x.add(a), x.add(b), x.add(c)], out, n),
            [a, b] => reduce::<2>([x.add(a), x.add(b)], out, n),
            [a] => reduce::<1>([x.add(a)], out, n),
            _ => {
                let mut rows = starts.iter().map(|&s| x.add(s));
                match rows.next() {
                    Some(first) => reduce::<1>([first], out, n),
                    None => {
                        return dst.fill(f32::NEG_INFINITY);
                    }
                }
                // Further rows fold into `dst` (read back and stored again).
                for r in rows {
                    reduce::<2>([out.cast_const(), r], out, n);
                }
            }
        }
    }
}

/// `out[..n]` = the elementwise max of the `n`-long rows at `rows` (n >= 8), 8 lanes at a
/// time; the last vector overlaps the one before (max is idempotent).
///
/// # Safety
/// AVX2 present; each row holds `n` floats, `out` has room for `n` (it may be `rows[0]`).
#[inline(always)]
unsafe fn reduce<const R: usize>(rows: [*const f32; R], out: *mut f32, n: usize) {
    let vector = |i: usize| {
        // SAFETY: i + 8 <= n, by the contract.
        unsafe {
            let mut acc = _mm256_loadu_ps(rows[0].add(i));
            for r in rows.iter().skip(1) {
                acc = pick(acc, _mm256_loadu_ps(r.add(i)));
            }
            _mm256_storeu_ps(out.add(i), acc);
        }
    };
    for i in (0..n - LANES).step_by(LANES) {
        vector(i);
    }
    vector(n - LANES);
}
