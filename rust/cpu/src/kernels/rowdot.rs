//! Dot products of one vector with many contiguous rows: `out[j] = x · w[j]`, the
//! matrix-vector product of one-token decode with a `linear` weight read as it is stored
//! (`[N, K]`, K contiguous). Memory-bound: each weight element is read once, so no packed
//! copy of the weight is needed and the stream runs at the speed the GEMM's packed panels
//! do.
//!
//! Four rows share each load of `x`; each row keeps two accumulators (even and odd vector
//! steps of k) so eight FMA chains are in flight, enough to hide the FMA latency when the
//! weight sits in cache. The sum is reassociated (lanes, then the two accumulators), which
//! differs from a GEMM's in-order sum only by rounding.

/// `out[j] = Σ_p x[p]·w[j·row_stride + p]` for every `j < out.len()`, `p < x.len()`.
///
/// # Panics
/// When `w` is too short for `out.len()` rows of `x.len()` elements `row_stride` apart.
pub fn rows_dot(x: &[f32], w: &[f32], row_stride: usize, out: &mut [f32]) {
    let (k, n) = (x.len(), out.len());
    if n == 0 {
        return;
    }
    assert!(
        w.len() >= (n - 1) * row_stride + k,
        "rows_dot: {} weight elements for {n} rows of {k}, {row_stride} apart",
        w.len()
    );
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::avx512_available() {
            // SAFETY: AVX-512F is present; every row's k elements lie in `w` (checked above).
            unsafe { x86::rows::<true>(x, w.as_ptr(), row_stride, out) };
            return;
        }
        if crate::simd::fma_available() {
            // SAFETY: AVX2 and FMA are present; rows checked as above.
            unsafe { x86::rows::<false>(x, w.as_ptr(), row_stride, out) };
            return;
        }
    }
    for (j, o) in out.iter_mut().enumerate() {
        let row = &w[j * row_stride..j * row_stride + k];
        *o = scalar_dot(x, row);
    }
}

/// Σ x·y with eight independent accumulators (vectorizes without FMA).
pub fn scalar_dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (xc, yc) = (x.chunks_exact(8), y.chunks_exact(8));
    let (xr, yr) = (xc.remainder(), yc.remainder());
    for (a, b) in xc.zip(yc) {
        for l in 0..8 {
            acc[l] += a[l] * b[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (a, b) in xr.iter().zip(yr) {
        s += a * b;
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Rows of the tile: four share each vector of `x`.
    const R: usize = 4;

    /// All rows, `R` at a time, then the last few one by one. `WIDE`: AVX-512 (16 lanes)
    /// rather than AVX2 (8).
    ///
    /// # Safety
    /// The CPU has the instructions `WIDE` selects; row `j`'s `x.len()` elements start at
    /// `w + j·row_stride` and are readable.
    pub unsafe fn rows<const WIDE: bool>(
        x: &[f32],
        w: *const f32,
        row_stride: usize,
        out: &mut [f32],
    ) {
        let k = x.len();
        let mut j = 0;
        // SAFETY (whole body): row pointers stay within the caller's contract.
        unsafe {
            while j + R <= out.len() {
                let rows: [*const f32; R] = std::array::from_fn(|r| w.add((j + r) * row_stride));
                let sums = if WIDE {
                    tile512::<R>(x.as_ptr(), rows, k)
                } else {
                    tile256::<R>(x.as_ptr(), rows, k)
                };
                out[j..j + R].copy_from_slice(&sums);
                j += R;
            }
            while j < out.len() {
                let row = [w.add(j * row_stride)];
                out[j] = if WIDE {
                    tile512::<1>(x.as_ptr(), row, k)[0]
                } else {
                    tile256::<1>(x.as_ptr(), row, k)[0]
                };
                j += 1;
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)] // `r` indexes the rows and their accumulators
    unsafe fn tile512<const T: usize>(x: *const f32, w: [*const f32; T], k: usize) -> [f32; T] {
        // SAFETY (whole body): loads stay below k elements of x and of each row; the tail's
        // are masked to the elements left.
        unsafe {
            let mut even = [_mm512_setzero_ps(); T];
            let mut odd = [_mm512_setzero_ps(); T];
            let mut p = 0;
            while p + 32 <= k {
                let (x0, x1) = (_mm512_loadu_ps(x.add(p)), _mm512_loadu_ps(x.add(p + 16)));
                for r in 0..T {
                    even[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w[r].add(p)), x0, even[r]);
                    odd[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w[r].add(p + 16)), x1, odd[r]);
                }
                p += 32;
            }
            while p < k {
                let mask = crate::simd::first_lanes(k - p);
                let x0 = _mm512_maskz_loadu_ps(mask, x.add(p));
                for r in 0..T {
                    let v = _mm512_maskz_loadu_ps(mask, w[r].add(p));
                    even[r] = _mm512_fmadd_ps(v, x0, even[r]);
                }
                p += 16;
            }
            std::array::from_fn(|r| _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])))
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)] // `r` indexes the rows and their accumulators
    unsafe fn tile256<const T: usize>(x: *const f32, w: [*const f32; T], k: usize) -> [f32; T] {
        // SAFETY (whole body): vector loads stay below k elements of x and of each row; the
        // last k % 8 elements are read one at a time.
        unsafe {
            let mut even = [_mm256_setzero_ps(); T];
            let mut odd = [_mm256_setzero_ps(); T];
            let mut p = 0;
            while p + 16 <= k {
                let (x0, x1) = (_mm256_loadu_ps(x.add(p)), _mm256_loadu_ps(x.add(p + 8)));
                for r in 0..T {
                    even[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w[r].add(p)), x0, even[r]);
                    odd[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w[r].add(p + 8)), x1, odd[r]);
                }
                p += 16;
            }
            if p + 8 <= k {
                let x0 = _mm256_loadu_ps(x.add(p));
                for r in 0..T {
                    even[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w[r].add(p)), x0, even[r]);
                }
                p += 8;
            }
            let mut sums = [0.0f32; T];
            for r in 0..T {
                let v = _mm256_add_ps(even[r], odd[r]);
                let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
                let one = _mm_add_ss(quad, _mm_movehdup_ps(quad));
                let mut s = _mm_cvtss_f32(one);
                for q in p..k {
                    s += *x.add(q) * *w[r].add(q);
                }
                sums[r] = s;
            }
            sums
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], w: &[f32], stride: usize, n: usize) -> Vec<f64> {
        (0..n)
            .map(|j| {
                (0..x.len())
                    .map(|p| x[p] as f64 * w[j * stride + p] as f64)
                    .sum()
            })
            .collect()
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).max(1);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn matches_a_f64_reference_for_every_tail_of_rows_and_k() {
        // k around the vector widths (8, 16, 32) and row counts around the tile of 4.
        for k in [1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 100, 257] {
            for n in [1, 3, 4, 5, 9] {
                for pad in [0, 3] {
                    let stride = k + pad;
                    let x = values(k, (k * 31 + n) as u32);
                    let w = values((n - 1) * stride + k, (k + 7 * n) as u32);
                    let mut out = vec![f32::NAN; n];
                    rows_dot(&x, &w, stride, &mut out);
                    for (j, (&got, want)) in
                        out.iter().zip(reference(&x, &w, stride, n)).enumerate()
                    {
                        let tol = 1e-5 * (1.0 + k as f64);
                        assert!(
                            (got as f64 - want).abs() <= tol,
                            "k {k} n {n} stride {stride} row {j}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "rows_dot")]
    fn a_short_weight_is_refused() {
        let mut out = [0.0; 3];
        rows_dot(&[1.0; 8], &[1.0; 20], 8, &mut out);
    }
}
