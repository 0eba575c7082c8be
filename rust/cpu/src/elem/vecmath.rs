//! AVX2+FMA slice kernels for the f32 transcendental ops: exp, tanh, sigmoid, SiLU and both
//! GELUs. They evaluate `fastmath`'s approximations (same range reductions, same
//! polynomials) with fused multiply-adds and four vectors in flight. The auto-vectorized
//! scalar code is one latency-bound chain of ~100 dependent operations per vector (GELU:
//! a division, a degree-9 polynomial and an exp), which ran at ~3 ns per element.
//!
//! Every element goes through the same vector code (the tail through masked lanes), so an
//! element's result does not depend on where it sits in a slice: fused and unfused
//! evaluation agree bit for bit. A fused multiply-add rounds once where a multiply then an
//! add rounds twice, so results can differ from `fastmath`'s by an ulp or so; CPUs without
//! AVX2+FMA (or `EMBER_CPU_SIMD=0`) run `fastmath` as before.

/// An f32 → f32 op with a vector kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Exp,
    Tanh,
    Sigmoid,
    /// x·sigmoid(x).
    Silu,
    /// x/2·(1 + erf(x/√2)).
    Gelu,
    /// x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
    GeluTanh,
}

/// √(2/π), GELU's tanh form.
const GELU_TANH_K: f32 = 0.797_884_6;
const GELU_TANH_A: f32 = 0.044_715;

#[cfg(test)]
impl Kernel {
    /// The op on one element, as `fastmath` computes it (the reference the vector code
    /// follows, and what runs without AVX2+FMA).
    pub fn scalar(self, x: f32) -> f32 {
        use crate::elem::fastmath;
        match self {
            Kernel::Exp => fastmath::exp(x),
            Kernel::Tanh => fastmath::tanh(x),
            Kernel::Sigmoid => fastmath::sigmoid(x),
            Kernel::Silu => x * fastmath::sigmoid(x),
            Kernel::Gelu => x * 0.5 * fastmath::one_plus_erf(x * std::f32::consts::FRAC_1_SQRT_2),
            Kernel::GeluTanh => {
                0.5 * x * (1.0 + fastmath::tanh(GELU_TANH_K * (x + GELU_TANH_A * x * x * x)))
            }
        }
    }
}

/// Proof that this CPU runs the vector kernels (AVX2 and FMA, and `EMBER_CPU_SIMD` not 0).
#[derive(Clone, Copy, Debug)]
pub struct Fma(());

impl Fma {
    pub fn detect() -> Option<Fma> {
        crate::simd::fma_available().then_some(Fma(()))
    }

    /// `out[i] = kernel(x[i])`.
    pub fn run(self, kernel: Kernel, x: &[f32], out: &mut [f32]) {
        self.run_shifted(kernel, x, out, 0.0)
    }

    /// `out[i] = kernel(x[i] - shift)`.
    pub fn run_shifted(self, kernel: Kernel, x: &[f32], out: &mut [f32], shift: f32) {
        debug_assert_eq!(x.len(), out.len());
        let n = x.len().min(out.len());
        // SAFETY: `self` proves AVX2+FMA; both slices hold n elements and do not overlap.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            x86::run(kernel, x.as_ptr(), out.as_mut_ptr(), n, shift)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (n, kernel, shift);
            unreachable!("Fma is only detected on x86-64")
        }
    }

    /// `out[i] = e^(x[i] - shift)`, returning Σ out[i] summed in f64 (softmax's
    /// exponentials and their sum in one pass).
    pub fn exp_shifted_sum(self, x: &[f32], out: &mut [f32], shift: f32) -> f64 {
        debug_assert_eq!(x.len(), out.len());
        let n = x.len().min(out.len());
        // SAFETY: `self` proves AVX2+FMA; both slices hold n elements.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            x86::exp_sum(x.as_ptr(), out.as_mut_ptr(), n, shift)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (n, shift);
            unreachable!("Fma is only detected on x86-64")
        }
    }

    /// `x[i] = e^(x[i] - shift)`, returning their sum in f64: softmax's numerators in place.
    pub fn exp_shifted_sum_in_place(self, x: &mut [f32], shift: f32) -> f64 {
        // SAFETY: `self` proves AVX2+FMA; each vector is loaded before it is stored.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            x86::exp_sum(x.as_mut_ptr(), x.as_mut_ptr(), x.len(), shift)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = shift;
            unreachable!("Fma is only detected on x86-64")
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Kernel, GELU_TANH_A, GELU_TANH_K};
    use crate::elem::fastmath::consts as c;
    use std::arch::x86_64::*;

    /// Runs `kernel` on `x[i] - shift` for `n` elements from `x` to `out` (which may be
    /// `x` itself).
    ///
    /// # Safety
    /// AVX2+FMA; `x` readable and `out` writable for n elements.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn run(kernel: Kernel, x: *const f32, out: *mut f32, n: usize, shift: f32) {
        let s = _mm256_set1_ps(shift);
        // One monomorphic loop per kernel, so the vector code is inlined into it.
        macro_rules! each {
            ($f:ident) => {
                // SAFETY: the caller's contract.
                unsafe { apply(x, out, n, s, |v| $f(v), |_| {}) }
            };
        }
        match kernel {
            Kernel::Exp => each!(exp),
            Kernel::Tanh => each!(tanh),
            Kernel::Sigmoid => each!(sigmoid),
            Kernel::Silu => each!(silu),
            Kernel::Gelu => each!(gelu),
            Kernel::GeluTanh => each!(gelu_tanh),
        }
    }

    /// As `run` with `exp`, also returning the sum of the results in f64.
    ///
    /// # Safety
    /// AVX2+FMA; `x` readable and `out` writable for n elements.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_sum(x: *const f32, out: *mut f32, n: usize, shift: f32) -> f64 {
        let mut acc = [_mm256_setzero_pd(); 2];
        let add = |v: __m256| {
            acc[0] = _mm256_add_pd(acc[0], _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
            acc[1] = _mm256_add_pd(acc[1], _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
        };
        // SAFETY: the caller's contract.
        unsafe { apply(x, out, n, _mm256_set1_ps(shift), |v| exp(v), add) };
        let v = _mm256_add_pd(acc[0], acc[1]);
        let h = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
        _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)))
    }

    /// Lanes below `left` (of 8) set.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn tail_mask(left: usize) -> __m256i {
        let lanes = _mm256_set1_epi32(left.min(8) as i32);
        _mm256_cmpgt_epi32(lanes, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
    }

    /// Vectors per step: independent chains for the out-of-order core to overlap.
    const UNROLL: usize = 4;

    /// `out[i] = f(x[i] - shift)`, each stored vector also handed to `seen` (with the
    /// lanes past n zeroed); the last partial vector through masked loads and stores.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn apply(
        x: *const f32,
        out: *mut f32,
        n: usize,
        shift: __m256,
        f: impl Fn(__m256) -> __m256,
        mut seen: impl FnMut(__m256),
    ) {
        // SAFETY (whole body): every access is below n (the tail's lanes past n are masked).
        unsafe {
            let mut i = 0;
            while i + 8 * UNROLL <= n {
                let mut v = [_mm256_setzero_ps(); UNROLL];
                for (k, v) in v.iter_mut().enumerate() {
                    *v = _mm256_sub_ps(_mm256_loadu_ps(x.add(i + 8 * k)), shift);
                }
                for v in v.iter_mut() {
                    *v = f(*v);
                }
                for (k, v) in v.iter().enumerate() {
                    _mm256_storeu_ps(out.add(i + 8 * k), *v);
                    seen(*v);
                }
                i += 8 * UNROLL;
            }
            while i < n {
                let mask = tail_mask(n - i);
                let a = _mm256_sub_ps(_mm256_maskload_ps(x.add(i), mask), shift);
                let v = f(a);
                _mm256_maskstore_ps(out.add(i), mask, v);
                seen(_mm256_and_ps(v, _mm256_castsi256_ps(mask)));
                i += 8;
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn splat(v: f32) -> __m256 {
        _mm256_set1_ps(v)
    }

    /// p(t) by Horner's rule, highest coefficient first.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn horner<const N: usize>(t: __m256, coeffs: [f32; N]) -> __m256 {
        let mut p = splat(coeffs[0]);
        for &k in &coeffs[1..] {
            p = _mm256_fmadd_ps(p, t, splat(k));
        }
        p
    }

    /// 2^k for integer lanes k in [-126, 127], from the exponent bits.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn pow2(k: __m256i) -> __m256 {
        _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_add_epi32(k, _mm256_set1_epi32(127)),
            23,
        ))
    }

    /// `fastmath::exp`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) fn exp(x: __m256) -> __m256 {
        // max/min return their second operand for NaN lanes; those are fixed at the end.
        let xc = _mm256_min_ps(_mm256_max_ps(x, splat(c::EXP_MIN)), splat(c::EXP_MAX));
        let k = _mm256_fmadd_ps(xc, splat(c::LOG2E), splat(c::ROUND_MAGIC));
        let n = _mm256_sub_ps(k, splat(c::ROUND_MAGIC));
        let r = _mm256_fnmadd_ps(n, splat(c::LN2_HI), xc);
        let r = _mm256_fnmadd_ps(n, splat(c::LN2_LO), r);
        let p = horner(r, c::EXP_POLY);
        let er = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), splat(1.0));
        let ni = _mm256_sub_epi32(
            _mm256_castps_si256(k),
            _mm256_set1_epi32(c::ROUND_MAGIC.to_bits() as i32),
        );
        let half = _mm256_srai_epi32(ni, 1);
        let y = _mm256_mul_ps(
            _mm256_mul_ps(er, pow2(half)),
            pow2(_mm256_sub_epi32(ni, half)),
        );
        let over = _mm256_cmp_ps(x, splat(c::EXP_MAX), _CMP_GT_OQ);
        let y = _mm256_blendv_ps(y, splat(f32::INFINITY), over);
        let under = _mm256_cmp_ps(x, splat(c::EXP_MIN), _CMP_LT_OQ);
        let y = _mm256_andnot_ps(under, y);
        let nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
        _mm256_blendv_ps(y, x, nan)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn abs(x: __m256) -> __m256 {
        _mm256_andnot_ps(splat(-0.0), x)
    }

    /// `fastmath::tanh`: the odd polynomial below 0.625, 1 - 2/(e^{2|x|} + 1) with x's sign
    /// above (NaN stays NaN through the exp).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) fn tanh(x: __m256) -> __m256 {
        let a = abs(x);
        let z = _mm256_mul_ps(x, x);
        let p = horner(z, c::TANH_POLY);
        let small = _mm256_fmadd_ps(_mm256_mul_ps(x, z), p, x);
        let e = exp(_mm256_add_ps(a, a));
        let large = _mm256_sub_ps(
            splat(1.0),
            _mm256_div_ps(splat(2.0), _mm256_add_ps(e, splat(1.0))),
        );
        let large = _mm256_or_ps(large, _mm256_and_ps(x, splat(-0.0)));
        let is_small = _mm256_cmp_ps(a, splat(c::TANH_SMALL), _CMP_LT_OQ);
        _mm256_blendv_ps(large, small, is_small)
    }

    /// 1 / (1 + e^-x).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) fn sigmoid(x: __m256) -> __m256 {
        let e = exp(_mm256_xor_ps(x, splat(-0.0)));
        _mm256_div_ps(splat(1.0), _mm256_add_ps(splat(1.0), e))
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) fn silu(x: __m256) -> __m256 {
        _mm256_mul_ps(x, sigmoid(x))
    }

    /// `fastmath::one_plus_erf`: erfc(|x|) from the Chebyshev fit, then 2 - erfc for x ≥ 0.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn one_plus_erf(x: __m256) -> __m256 {
        let z = abs(x);
        let t = _mm256_div_ps(splat(1.0), _mm256_fmadd_ps(splat(0.5), z, splat(1.0)));
        let p = horner(t, c::ERFC_POLY);
        let erfc = _mm256_mul_ps(t, exp(_mm256_fnmadd_ps(z, z, p)));
        let nonneg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
        _mm256_blendv_ps(erfc, _mm256_sub_ps(splat(2.0), erfc), nonneg)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) fn gelu(x: __m256) -> __m256 {
        let e = one_plus_erf(_mm256_mul_ps(x, splat(std::f32::consts::FRAC_1_SQRT_2)));
        _mm256_mul_ps(_mm256_mul_ps(x, splat(0.5)), e)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) fn gelu_tanh(x: __m256) -> __m256 {
        let cube = _mm256_mul_ps(_mm256_mul_ps(splat(GELU_TANH_A), x), x);
        let inner = _mm256_mul_ps(splat(GELU_TANH_K), _mm256_fmadd_ps(cube, x, x));
        let t = _mm256_add_ps(splat(1.0), tanh(inner));
        _mm256_mul_ps(_mm256_mul_ps(splat(0.5), x), t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const ALL: [Kernel; 6] = [
        Kernel::Exp,
        Kernel::Tanh,
        Kernel::Sigmoid,
        Kernel::Silu,
        Kernel::Gelu,
        Kernel::GeluTanh,
    ];

    fn reference(k: Kernel, x: f64) -> f64 {
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        match k {
            Kernel::Exp => x.exp(),
            Kernel::Tanh => x.tanh(),
            Kernel::Sigmoid => sig(x),
            Kernel::Silu => x * sig(x),
            Kernel::Gelu => x * 0.5 * (1.0 + libm::erf(x / std::f64::consts::SQRT_2)),
            Kernel::GeluTanh => {
                let k = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
            }
        }
    }

    fn inputs() -> Vec<f32> {
        let mut x: Vec<f32> = (-120_000..=120_000).map(|i| i as f32 * 8.3e-4).collect();
        x.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            87.0,
            88.7,
            89.0,
            -87.3,
            -88.0,
            -104.0,
            1e30,
            -1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN_POSITIVE,
        ]);
        x
    }

    /// The vector kernels agree with `fastmath` to an ulp or two of the result's scale, and
    /// with the f64 definition; specials (±inf, NaN, overflow, underflow) match `fastmath`.
    #[test]
    fn kernels_follow_fastmath_and_the_definition() {
        let Some(fma) = Fma::detect() else {
            eprintln!("no AVX2+FMA here: the vector kernels are not used");
            return;
        };
        let x = inputs();
        for k in ALL {
            let mut out = vec![0f32; x.len()];
            fma.run(k, &x, &mut out);
            for (&xi, &got) in x.iter().zip(&out) {
                let want = k.scalar(xi);
                if want.is_nan() || got.is_nan() {
                    assert!(
                        want.is_nan() && got.is_nan(),
                        "{k:?}({xi}) = {got}, fastmath {want}"
                    );
                    continue;
                }
                if want.is_infinite() || want == 0.0 {
                    assert_eq!(got, want, "{k:?}({xi})");
                    continue;
                }
                // The x-scaled ops are x·(1 + something near -1) for negative x, as in
                // torch's float32 code: off by up to a few ε·|x| where they are tiny.
                let slack = match k {
                    Kernel::Gelu | Kernel::GeluTanh | Kernel::Silu => {
                        4.0 * f32::EPSILON as f64 * xi.abs() as f64
                    }
                    _ => 0.0,
                };
                let err = |want: f64| ((got as f64 - want).abs() - slack).max(0.0);
                let scale = (want.abs() as f64).max(f32::MIN_POSITIVE as f64);
                let ulps = err(want as f64) / (scale * f32::EPSILON as f64);
                assert!(
                    ulps <= 4.0,
                    "{k:?}({xi}) = {got}, fastmath {want} ({ulps} ulp)"
                );
                let exact = reference(k, xi as f64);
                if exact.is_finite() && exact.abs() > 1e-30 {
                    let rel = err(exact) / exact.abs();
                    assert!(rel < 3e-6, "{k:?}({xi}) = {got} vs {exact}");
                }
            }
        }
    }

    /// The fused exp-and-sum pass writes the exp kernel's bits and their f64 sum.
    #[test]
    fn exp_shifted_sum_matches_exp_and_a_serial_sum() {
        let Some(fma) = Fma::detect() else {
            return;
        };
        for n in [0, 1, 7, 8, 31, 32, 33, 100, 517] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37) % 101) as f32 * 0.11 - 5.0)
                .collect();
            let mut want = vec![0f32; n];
            fma.run_shifted(Kernel::Exp, &x, &mut want, 3.0);
            let mut got = vec![f32::NAN; n];
            let sum = fma.exp_shifted_sum(&x, &mut got, 3.0);
            assert!(got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            let serial: f64 = want.iter().map(|&v| v as f64).sum();
            assert!(
                (sum - serial).abs() <= 1e-12 * serial.max(1.0),
                "{n}: {sum} vs {serial}"
            );
        }
    }

    /// An element's result does not depend on its position: every tail length and the
    /// in-place shifted form give the bits of the full-vector path.
    #[test]
    fn tails_and_in_place_runs_match_full_vectors() {
        let Some(fma) = Fma::detect() else {
            return;
        };
        let x: Vec<f32> = (0..61).map(|i| (i as f32 - 30.0) * 0.375).collect();
        for k in ALL {
            let mut full = vec![0f32; x.len()];
            fma.run(k, &x, &mut full);
            for start in 0..x.len() {
                for len in [1, 3, 7, 8, 9, 15, 16, 17] {
                    let end = (start + len).min(x.len());
                    let mut part = vec![f32::NAN; end - start];
                    fma.run(k, &x[start..end], &mut part);
                    for (a, b) in part.iter().zip(&full[start..end]) {
                        assert_eq!(a.to_bits(), b.to_bits(), "{k:?} at {start}+{len}");
                    }
                }
            }
            if k == Kernel::Exp {
                let mut shifted: Vec<f32> = x.iter().map(|v| v + 2.0).collect();
                let sum = fma.exp_shifted_sum_in_place(&mut shifted, 2.0);
                for (a, b) in shifted.iter().zip(&full) {
                    assert_eq!(a.to_bits(), b.to_bits(), "exp shifted in place");
                }
                let serial: f64 = full.iter().map(|&v| v as f64).sum();
                assert!((sum - serial).abs() <= 1e-9 * serial, "{sum} vs {serial}");
            }
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;

    /// ns per element of each kernel on 32K elements, best of 50 runs:
    /// `cargo test --release -p ember-cpu vecmath_speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn vecmath_speed() {
        let Some(fma) = Fma::detect() else {
            return;
        };
        let x: Vec<f32> = (0..32768)
            .map(|i| ((i * 7919) % 2000) as f32 * 0.004 - 4.0)
            .collect();
        let mut out = vec![0f32; x.len()];
        let best = |f: &mut dyn FnMut()| {
            (0..50)
                .map(|_| {
                    let t = std::time::Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
                * 1e9
                / x.len() as f64
        };
        for k in super::tests::ALL {
            let vector = best(&mut || fma.run(k, &x, &mut out));
            eprintln!("{k:?}: {vector:.2} ns/element");
        }
    }
}
