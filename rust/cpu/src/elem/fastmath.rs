//! Branch-free f32 transcendentals, written so that loops over slices auto-vectorize (libm's
//! `expf`/`tanhf` are opaque calls that run one element at a time, ~10× slower than torch's
//! vectorized math). Each function is accurate to a few ulp over the whole f32 range and
//! handles ±inf and NaN like libm; `tests` checks them against f64 references.

// Coefficients are kept as published; the compiler rounds them to f32.
#![allow(clippy::excessive_precision)]
/// Constants shared with the vector kernels (`vecmath.rs`); polynomials highest degree first.
pub(crate) mod consts {
    #![allow(clippy::excessive_precision)]
    /// ln(2) split so that `n * LN2_HI` is exact for |n| < 2^9 (Cody–Waite range reduction).
    pub const LN2_HI: f32 = 0.693_359_4;
    pub const LN2_LO: f32 = -2.121_944_4e-4;
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    /// Adding and subtracting 1.5·2^23 rounds an f32 of magnitude < 2^22 to an integer.
    pub const ROUND_MAGIC: f32 = 12_582_912.0;
    /// exp overflows above this and is below the smallest normal f32 beneath `EXP_MIN`.
    pub const EXP_MAX: f32 = 88.722_84;
    pub const EXP_MIN: f32 = -87.336_54;
    /// Minimax fit of (e^r - 1 - r) / r² for |r| ≤ ln2/2.
    pub const EXP_POLY: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        5.000_000_1e-1,
    ];
    /// tanh(x) = x + x·z·p(z), z = x², for |x| < `TANH_SMALL`.
    pub const TANH_POLY: [f32; 5] = [
        -5.704_988_7e-3,
        2.063_908_9e-2,
        -5.373_971_6e-2,
        1.333_144_2e-1,
        -3.333_328_2e-1,
    ];
    pub const TANH_SMALL: f32 = 0.625;
    /// erfc(z) = t·e^{-z² + p(t)}, t = 1/(1 + z/2) (Numerical Recipes' `erfcc`).
    pub const ERFC_POLY: [f32; 10] = [
        0.170_872_77,
        -0.822_152_23,
        1.488_515_9,
        -1.135_203_98,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_96,
        1.000_023_7,
        -1.265_512_2,
    ];
    pub const TWO_POW_23: f32 = 8_388_608.0;
    /// ln(1 + f) = f - f²/2 + f³·p(f) for f in [√½ - 1, √2 - 1] (Cephes' `logf`).
    pub const LOG_POLY: [f32; 9] = [
        7.037_683_6e-2,
        -1.151_461_0e-1,
        1.167_699_9e-1,
        -1.242_014_1e-1,
        1.424_932_3e-1,
        -1.666_805_8e-1,
        2.000_071_5e-1,
        -2.499_999_4e-1,
        3.333_333_1e-1,
    ];
    /// erf(x) = x·p(x²) for |x| < 1: a weighted least-squares fit of erf(x)/x (relative
    /// error 1.2e-9 in f64). The last coefficient is the fit's, an ulp under 2/√π.
    #[allow(clippy::approx_constant)]
    pub const ERF_POLY: [f32; 7] = [
        7.854_219_4e-5,
        -8.010_310_7e-4,
        5.188_342_6e-3,
        -2.685_382_0e-2,
        1.128_358_5e-1,
        -3.761_262_6e-1,
        1.128_379_1,
    ];
    pub const FOUR_OVER_PI: f32 = 1.273_239_5;
    /// π/4 = HI + MID + LO, each the f32 nearest what is left (residual 5e-24).
    pub const PIO4_HI: f32 = std::f32::consts::FRAC_PI_4;
    pub const PIO4_MID: f32 = -2.185_569_4e-8;
    pub const PIO4_LO: f32 = -8.575_622_6e-16;
    /// Above this |x| (and for ±inf, NaN) the vector sin/cos hand the lane to libm: the
    /// quarter-π count stays far inside f32's exact integers below it.
    pub const TRIG_FAST_MAX: f32 = 65_536.0;
    /// sin r = r + r·z·p(z), z = r², for |r| ≤ π/4 (Cephes' `sinf`).
    pub const SIN_POLY: [f32; 3] = [-1.951_529_6e-4, 8.332_160_9e-3, -1.666_665_5e-1];
    /// cos r = 1 - z/2 + z²·p(z), z = r², for |r| ≤ π/4 (Cephes' `cosf`).
    pub const COS_POLY: [f32; 3] = [2.443_315_7e-5, -1.388_731_6e-3, 4.166_664_6e-2];
}
use consts::*;

/// p(t) by Horner's rule, highest coefficient first (unrolled: N is a constant).
#[inline(always)]
fn horner<const N: usize>(t: f32, coeffs: [f32; N]) -> f32 {
    let mut p = coeffs[0];
    for &k in &coeffs[1..] {
        p = p * t + k;
    }
    p
}

/// e^x. Range reduction x = n·ln2 + r with |r| ≤ ln2/2, a degree-6 minimax polynomial for
/// e^r, and 2^n built from the exponent bits. Results below the smallest normal flush to 0.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let xc = x.clamp(EXP_MIN, EXP_MAX);
    let k = xc * LOG2E + ROUND_MAGIC;
    let n = k - ROUND_MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let r2 = r * r;
    let p = horner(r, EXP_POLY);
    let er = p * r2 + r + 1.0;
    // 2^n for n in [-126, 128], in two factors so each stays a normal f32.
    // n as an integer, read from the mantissa of `k` (an `as i32` conversion would not
    // vectorize: it saturates and maps NaN to 0).
    let n = (k.to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32);
    let half = n >> 1;
    let y = er * pow2(half) * pow2(n.wrapping_sub(half));
    // Out-of-range inputs (and NaN, which `clamp` keeps) are fixed up without branches.
    let y = if x > EXP_MAX { f32::INFINITY } else { y };
    let y = if x < EXP_MIN { 0.0 } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// 2^k for k in [-63, 64], straight from the exponent bits.
#[inline(always)]
fn pow2(k: i32) -> f32 {
    f32::from_bits((k.wrapping_add(127) << 23) as u32)
}

/// tanh(x): an odd polynomial near 0 (where 1 - 2/(e^{2x}+1) would cancel), the exp form
/// elsewhere; both are computed and one is selected, so the loop stays branch-free.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let p = horner(z, TANH_POLY);
    let small = x + x * z * p;
    let e = exp(2.0 * a);
    let large = 1.0 - 2.0 / (e + 1.0);
    let large = if x < 0.0 { -large } else { large };
    if a < TANH_SMALL {
        small
    } else if x.is_nan() {
        x
    } else {
        large
    }
}

/// 1 / (1 + e^-x).
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// 1 + erf(x), as exact GELU needs it: erfc through a Chebyshev fit with relative error
/// below 1.2e-7 (Numerical Recipes' `erfcc`), so the sum is accurate to a few ulp of 1. Not a
/// substitute for `erf` itself, whose small values need relative accuracy.
#[inline(always)]
pub fn one_plus_erf(x: f32) -> f32 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let p = horner(t, ERFC_POLY);
    let erfc = t * exp(-z * z + p);
    // 1 + erf(x) = 2 - erfc(x) for x ≥ 0, and erfc(|x|) for x < 0.
    if x >= 0.0 {
        2.0 - erfc
    } else if x.is_nan() {
        x
    } else {
        erfc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f64) -> f64 {
        let b32 = b as f32;
        // Results below the smallest normal f32 flush to zero by design.
        if a == b32
            || (a.is_nan() && b.is_nan())
            || (a == 0.0 && b.abs() < f32::MIN_POSITIVE as f64)
        {
            return 0.0;
        }
        ((a as f64 - b) / (b32.abs().max(f32::MIN_POSITIVE) as f64 * f32::EPSILON as f64)).abs()
    }

    fn grid() -> impl Iterator<Item = f32> {
        (-200_000..=200_000).map(|i| i as f32 * 5e-4)
    }

    #[test]
    fn exp_is_within_two_ulp() {
        for x in grid().chain([-87.0, -50.0, 0.0, 1e-8, 20.0, 88.0]) {
            let e = ulps(exp(x), (x as f64).exp());
            assert!(
                e <= 2.0,
                "exp({x}) = {} vs {} ({e} ulp)",
                exp(x),
                (x as f64).exp()
            );
        }
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(-120.0), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn tanh_and_sigmoid_are_accurate() {
        for x in grid() {
            let t = tanh(x);
            let want = (x as f64).tanh();
            assert!(
                (t as f64 - want).abs() <= 4.0 * f32::EPSILON as f64 * want.abs().max(1e-30)
                    || (t as f64 - want).abs() < 1e-9,
                "tanh({x}) = {t} vs {want}"
            );
            let s = sigmoid(x);
            let want = 1.0 / (1.0 + (-(x as f64)).exp());
            assert!(ulps(s, want) <= 4.0, "sigmoid({x}) = {s} vs {want}");
        }
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
        assert!(tanh(f32::NAN).is_nan());
        assert_eq!(sigmoid(f32::NEG_INFINITY), 0.0);
        assert_eq!(sigmoid(f32::INFINITY), 1.0);
    }

    #[test]
    fn one_plus_erf_is_accurate_in_absolute_terms() {
        for x in grid() {
            let want = 1.0 + libm::erf(x as f64);
            let got = one_plus_erf(x) as f64;
            assert!(
                (got - want).abs() <= 5e-7 * want.max(1.0),
                "1+erf({x}) = {got} vs {want}"
            );
        }
        assert_eq!(one_plus_erf(f32::INFINITY), 2.0);
        assert_eq!(one_plus_erf(f32::NEG_INFINITY), 0.0);
    }
}
