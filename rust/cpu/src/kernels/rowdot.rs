//! Dot products of one vector with many contiguous rows: `out[j] = x · w[j]`, the
//! matrix-vector product of one-token decode with a `linear` weight read as it is stored
//! (`[N, K]`, K contiguous). Memory-bound: each weight element is read once, so no packed
//! copy of the weight is needed and the stream runs at the speed the GEMM's packed panels
//! do. Weights may be f32, bf16 or f16: half-precision rows are widened to f32 in
//! registers as they are loaded (half the bytes to stream), and the sums are f32.
//!
//! Four rows share each load of `x`; each row keeps two accumulators (even and odd vector
//! steps of k) so eight FMA chains are in flight, enough to hide the FMA latency when the
//! weight sits in cache. The sum is reassociated (lanes, then the two accumulators), which
//! differs from a GEMM's in-order sum only by rounding.
//!
//! bf16 activations against bf16 rows (a bf16 model's decode) take `vdpbf16ps` where the
//! CPU has AVX512-BF16 (`rows_dot_bf16`): it multiplies pairs of bf16 values exactly and
//! sums them into f32 lanes, so neither operand is widened and the stream is no longer
//! bound by the widening's shifts. Inputs and outputs below f32's normal range flush to
//! zero there (the instruction's rule), far below a bf16 product's rounding.

use half::{bf16, f16};

/// A weight element the row-wise kernel reads: f32, or a half type widened on load.
pub trait RowWeight: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// `dst[i] = from_f32(src[i])` over a slice (f16: by whole vectors where it can).
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        for (d, &v) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(v);
        }
    }
    /// Whether this CPU has what the AVX2 kernels need beyond AVX2 + FMA: F16C, which they
    /// are compiled with (f16 loads use it; every AVX2 CPU made has it, but it is checked).
    #[cfg(target_arch = "x86_64")]
    fn loads_available() -> bool {
        std::arch::is_x86_feature_detected!("f16c")
    }
    /// 16 elements at `p` as f32 (AVX-512F).
    ///
    /// # Safety
    /// AVX-512F is present and 16 elements at `p` are readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
    /// 8 elements at `p` as f32 (AVX2, and F16C for f16).
    ///
    /// # Safety
    /// The instructions are present and 8 elements at `p` are readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl RowWeight for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> f32 {
        v
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: as the trait's contract.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: as the trait's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl RowWeight for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        crate::elem::halfconv::bf16_to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> bf16 {
        crate::elem::halfconv::f32_to_bf16(v)
    }
    // A bf16 is the high half of an f32: zero-extend to 32 bits and shift left by 16.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const bf16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: as the trait's contract.
        unsafe {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as the trait's contract.
        unsafe {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }
}

impl RowWeight for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        crate::elem::halfconv::f16_to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> f16 {
        crate::elem::halfconv::f32_to_f16(v)
    }
    fn from_f32_slice(src: &[f32], dst: &mut [f16]) {
        crate::elem::halfconv::narrow_f16(src, dst)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: as the trait's contract (AVX-512F converts halves).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as the trait's contract (F16C checked by `loads_available`).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
}

/// `out[j] = Σ_p x[p]·w[j·row_stride + p]` for every `j < out.len()`, `p < x.len()`.
///
/// # Panics
/// When `w` is too short for `out.len()` rows of `x.len()` elements `row_stride` apart.
pub fn rows_dot<W: RowWeight>(x: &[f32], w: &[W], row_stride: usize, out: &mut [f32]) {
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
            unsafe { x86::rows::<W, true>(x, w.as_ptr(), row_stride, out) };
            return;
        }
        if crate::simd::fma_available() && W::loads_available() {
            // SAFETY: AVX2, FMA (and F16C where W needs it) are present; rows as above.
            unsafe { x86::rows::<W, false>(x, w.as_ptr(), row_stride, out) };
            return;
        }
    }
    for (j, o) in out.iter_mut().enumerate() {
        let row = &w[j * row_stride..j * row_stride + k];
        *o = scalar_dot(x, row);
    }
}

/// Whether `rows_dot_bf16` runs `vdpbf16ps`: the AVX-512 kernels are on (`EMBER_CPU_AVX512`)
/// and the CPU has AVX512-BF16 and AVX512-BW (its masked 16-bit loads take the tails).
pub fn bf16_pairs_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            crate::simd::avx512_available()
                && std::arch::is_x86_feature_detected!("avx512bf16")
                && std::arch::is_x86_feature_detected!("avx512bw")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `rows_dot` of bf16 activations: `out[j] = Σ_p x[p]·w[j·row_stride + p]`, f32 sums.
/// Pairs of bf16 products summed by `vdpbf16ps` where `bf16_pairs_available`, else `x`
/// widened (exactly) and `rows_dot`.
///
/// # Panics
/// As `rows_dot`.
pub fn rows_dot_bf16(x: &[bf16], w: &[bf16], row_stride: usize, out: &mut [f32]) {
    let (k, n) = (x.len(), out.len());
    if n == 0 {
        return;
    }
    assert!(
        w.len() >= (n - 1) * row_stride + k,
        "rows_dot_bf16: {} weight elements for {n} rows of {k}, {row_stride} apart",
        w.len()
    );
    #[cfg(target_arch = "x86_64")]
    if bf16_pairs_available() {
        // SAFETY: AVX-512F/BW/BF16 are present; every row's k elements lie in `w` (checked
        // above).
        unsafe { x86::rows_bf16_pairs(x, w.as_ptr(), row_stride, out) };
        return;
    }
    let wide: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    rows_dot(&wide, w, row_stride, out);
}

/// Σ x·y with eight independent accumulators (vectorizes without FMA).
pub fn scalar_dot<W: RowWeight>(x: &[f32], y: &[W]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (xc, yc) = (x.chunks_exact(8), y.chunks_exact(8));
    let (xr, yr) = (xc.remainder(), yc.remainder());
    for (a, b) in xc.zip(yc) {
        for l in 0..8 {
            acc[l] += a[l] * b[l].to_f32();
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (a, b) in xr.iter().zip(yr) {
        s += a * b.to_f32();
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::RowWeight;
    use half::bf16;
    use std::arch::x86_64::*;

    /// Rows of the tile: four share each vector of `x`.
    const R: usize = 4;

    /// All rows, `R` at a time, then the last few one by one. `WIDE`: AVX-512 (16 lanes)
    /// rather than AVX2 (8).
    ///
    /// # Safety
    /// The CPU has the instructions `WIDE` and `W` need; row `j`'s `x.len()` elements
    /// start at `w + j·row_stride` and are readable.
    pub unsafe fn rows<W: RowWeight, const WIDE: bool>(
        x: &[f32],
        w: *const W,
        row_stride: usize,
        out: &mut [f32],
    ) {
        let k = x.len();
        let mut j = 0;
        // SAFETY (whole body): row pointers stay within the caller's contract.
        unsafe {
            while j + R <= out.len() {
                let rows: [*const W; R] = std::array::from_fn(|r| w.add((j + r) * row_stride));
                let sums = if WIDE {
                    tile512::<W, R>(x.as_ptr(), rows, k)
                } else {
                    tile256::<W, R>(x.as_ptr(), rows, k)
                };
                out[j..j + R].copy_from_slice(&sums);
                j += R;
            }
            while j < out.len() {
                let row = [w.add(j * row_stride)];
                out[j] = if WIDE {
                    tile512::<W, 1>(x.as_ptr(), row, k)[0]
                } else {
                    tile256::<W, 1>(x.as_ptr(), row, k)[0]
                };
                j += 1;
            }
        }
    }

    /// `rows` for bf16 activations, by `tile_bf16_pairs`.
    ///
    /// # Safety
    /// AVX-512F/BW/BF16 are present; row `j`'s `x.len()` elements start at
    /// `w + j·row_stride` and are readable.
    pub unsafe fn rows_bf16_pairs(x: &[bf16], w: *const bf16, row_stride: usize, out: &mut [f32]) {
        let k = x.len();
        let mut j = 0;
        // SAFETY (whole body): row pointers stay within the caller's contract.
        unsafe {
            while j + R <= out.len() {
                let rows: [*const bf16; R] = std::array::from_fn(|r| w.add((j + r) * row_stride));
                out[j..j + R].copy_from_slice(&tile_bf16_pairs::<R>(x.as_ptr(), rows, k));
                j += R;
            }
            while j < out.len() {
                out[j] = tile_bf16_pairs::<1>(x.as_ptr(), [w.add(j * row_stride)], k)[0];
                j += 1;
            }
        }
    }

    /// Σ over k of bf16 pairs: each `vdpbf16ps` step takes 32 elements of x and of a row
    /// (16 lanes of two products each); the tail's masked loads read zeros past k.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::needless_range_loop)] // `r` indexes the rows and their accumulators
    unsafe fn tile_bf16_pairs<const T: usize>(
        x: *const bf16,
        w: [*const bf16; T],
        k: usize,
    ) -> [f32; T] {
        // 32 bf16 as the instruction's operand type (the same 512 bits).
        #[inline(always)]
        fn pairs(v: __m512i) -> __m512bh {
            // SAFETY: both are 512 plain bits.
            unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
        }
        // SAFETY (whole body): full loads stay below k elements of x and of each row; the
        // masked loads touch only elements below k.
        unsafe {
            let load = |p: *const bf16| pairs(_mm512_loadu_si512(p as *const __m512i));
            let mut even = [_mm512_setzero_ps(); T];
            let mut odd = [_mm512_setzero_ps(); T];
            let mut p = 0;
            while p + 64 <= k {
                let (x0, x1) = (load(x.add(p)), load(x.add(p + 32)));
                for r in 0..T {
                    even[r] = _mm512_dpbf16_ps(even[r], x0, load(w[r].add(p)));
                    odd[r] = _mm512_dpbf16_ps(odd[r], x1, load(w[r].add(p + 32)));
                }
                p += 64;
            }
            while p < k {
                let left = k - p;
                let mask: __mmask32 = if left >= 32 { !0 } else { (1u32 << left) - 1 };
                let masked =
                    |q: *const bf16| pairs(_mm512_maskz_loadu_epi16(mask, q as *const i16));
                let x0 = masked(x.add(p));
                for r in 0..T {
                    even[r] = _mm512_dpbf16_ps(even[r], x0, masked(w[r].add(p)));
                }
                p += 32;
            }
            std::array::from_fn(|r| _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])))
        }
    }

    /// The last `k - p` (fewer than a vector) products of each row, added to its sum.
    ///
    /// # Safety
    /// `x` and every row hold `k` readable elements.
    #[inline(always)]
    unsafe fn tail<W: RowWeight, const T: usize>(
        x: *const f32,
        w: &[*const W; T],
        p: usize,
        k: usize,
        sums: &mut [f32; T],
    ) {
        for (s, &row) in sums.iter_mut().zip(w) {
            for q in p..k {
                // SAFETY: q < k, as the contract.
                unsafe { *s += *x.add(q) * (*row.add(q)).to_f32() };
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)] // `r` indexes the rows and their accumulators
    unsafe fn tile512<W: RowWeight, const T: usize>(
        x: *const f32,
        w: [*const W; T],
        k: usize,
    ) -> [f32; T] {
        // SAFETY (whole body): vector loads stay below k elements of x and of each row;
        // the last k % 16 elements are read one at a time.
        unsafe {
            let mut even = [_mm512_setzero_ps(); T];
            let mut odd = [_mm512_setzero_ps(); T];
            let mut p = 0;
            while p + 32 <= k {
                let (x0, x1) = (_mm512_loadu_ps(x.add(p)), _mm512_loadu_ps(x.add(p + 16)));
                for r in 0..T {
                    even[r] = _mm512_fmadd_ps(W::load16(w[r].add(p)), x0, even[r]);
                    odd[r] = _mm512_fmadd_ps(W::load16(w[r].add(p + 16)), x1, odd[r]);
                }
                p += 32;
            }
            if p + 16 <= k {
                let x0 = _mm512_loadu_ps(x.add(p));
                for r in 0..T {
                    even[r] = _mm512_fmadd_ps(W::load16(w[r].add(p)), x0, even[r]);
                }
                p += 16;
            }
            let mut sums: [f32; T] =
                std::array::from_fn(|r| _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])));
            tail(x, &w, p, k, &mut sums);
            sums
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // `r` indexes the rows and their accumulators
    unsafe fn tile256<W: RowWeight, const T: usize>(
        x: *const f32,
        w: [*const W; T],
        k: usize,
    ) -> [f32; T] {
        // SAFETY (whole body): vector loads stay below k elements of x and of each row; the
        // last k % 8 elements are read one at a time.
        unsafe {
            let mut even = [_mm256_setzero_ps(); T];
            let mut odd = [_mm256_setzero_ps(); T];
            let mut p = 0;
            while p + 16 <= k {
                let (x0, x1) = (_mm256_loadu_ps(x.add(p)), _mm256_loadu_ps(x.add(p + 8)));
                for r in 0..T {
                    even[r] = _mm256_fmadd_ps(W::load8(w[r].add(p)), x0, even[r]);
                    odd[r] = _mm256_fmadd_ps(W::load8(w[r].add(p + 8)), x1, odd[r]);
                }
                p += 16;
            }
            if p + 8 <= k {
                let x0 = _mm256_loadu_ps(x.add(p));
                for r in 0..T {
                    even[r] = _mm256_fmadd_ps(W::load8(w[r].add(p)), x0, even[r]);
                }
                p += 8;
            }
            let mut sums = [0.0f32; T];
            for r in 0..T {
                let v = _mm256_add_ps(even[r], odd[r]);
                let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
                sums[r] = _mm_cvtss_f32(_mm_add_ss(quad, _mm_movehdup_ps(quad)));
            }
            tail(x, &w, p, k, &mut sums);
            sums
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference<W: RowWeight>(x: &[f32], w: &[W], stride: usize, n: usize) -> Vec<f64> {
        (0..n)
            .map(|j| {
                (0..x.len())
                    .map(|p| x[p] as f64 * w[j * stride + p].to_f32() as f64)
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

    /// `run(x, w, stride, out)` against the f64 reference for every `k` of `ks`, row counts
    /// around the tile of 4 and padded rows; `x_as` rounds the activations to the type
    /// `run` reads them in.
    fn sweep<W: RowWeight>(
        ks: &[usize],
        x_as: fn(f32) -> f32,
        run: impl Fn(&[f32], &[W], usize, &mut [f32]),
    ) {
        for &k in ks {
            for n in [1, 3, 4, 5, 9] {
                for pad in [0, 3] {
                    let stride = k + pad;
                    let x: Vec<f32> = values(k, (k * 31 + n) as u32)
                        .into_iter()
                        .map(x_as)
                        .collect();
                    let w: Vec<W> = values((n - 1) * stride + k, (k + 7 * n) as u32)
                        .into_iter()
                        .map(W::from_f32)
                        .collect();
                    let mut out = vec![f32::NAN; n];
                    run(&x, &w, stride, &mut out);
                    let want = reference(&x, &w, stride, n);
                    for (j, (&got, want)) in out.iter().zip(want).enumerate() {
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

    fn matches_reference<W: RowWeight>() {
        // k around the vector widths (8, 16, 32).
        let ks = [1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 100, 257];
        sweep::<W>(&ks, |v| v, rows_dot);
    }

    #[test]
    fn f32_rows_match_a_f64_reference_for_every_tail_of_rows_and_k() {
        matches_reference::<f32>();
    }

    #[test]
    fn bf16_rows_match_a_f64_reference_for_every_tail_of_rows_and_k() {
        matches_reference::<bf16>();
    }

    #[test]
    fn f16_rows_match_a_f64_reference_for_every_tail_of_rows_and_k() {
        matches_reference::<f16>();
    }

    #[test]
    fn bf16_activations_match_a_f64_reference_for_every_tail_of_rows_and_k() {
        // k around the pair step (32), the unrolled step (64) and odd lengths.
        let ks = [1, 2, 31, 32, 33, 63, 64, 65, 96, 127, 130, 257];
        let as_bf16 = |v: f32| bf16::from_f32(v).to_f32();
        sweep::<bf16>(&ks, as_bf16, |x, w, stride, out| {
            let x: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            rows_dot_bf16(&x, w, stride, out)
        });
    }

    #[test]
    fn bf16_activations_keep_infinities_and_nans() {
        let k = 40;
        let mut x = vec![bf16::from_f32(1.0); k];
        let w = vec![bf16::from_f32(0.5); 3 * k];
        x[35] = bf16::INFINITY;
        let mut out = [0.0f32; 3];
        rows_dot_bf16(&x, &w, k, &mut out);
        assert!(out.iter().all(|v| *v == f32::INFINITY), "{out:?}");
        x[3] = bf16::NAN;
        rows_dot_bf16(&x, &w, k, &mut out);
        assert!(out.iter().all(|v| v.is_nan()), "{out:?}");
    }

    #[test]
    #[should_panic(expected = "rows_dot")]
    fn a_short_weight_is_refused() {
        let mut out = [0.0; 3];
        rows_dot(&[1.0; 8], &[1.0f32; 20], 8, &mut out);
    }
}
