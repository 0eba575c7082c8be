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
    /// Softmax's exp pass clamps below here: x rounds to n = -127 halvings, whose 2^n has
    /// all exponent bits zero, so e^x comes out exactly 0 (e^x is subnormal below `EXP_MIN`
    /// anyway).
    pub const EXP_SUBNORMAL_FLOOR: f32 = -88.0;
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
    /// e^88 < 2^127: the largest whole exponent `exp_in_range` (vecmath) builds in one step.
    pub const EXP_IN_RANGE_MAX: f32 = 88.0;
    /// sigmoid(-88) = 6e-39 is below the smallest normal f32.
    pub const SIGMOID_ZERO_BELOW: f32 = -EXP_IN_RANGE_MAX;
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
    /// GELU's tail probability Q(a) = P(N(0,1) > a) = erfc(a/√2)/2 on [0, `GELU_TAIL_END`),
    /// in eight pieces of width `GELU_PIECE`: piece i is a degree-7 polynomial in
    /// t = a - (i + ½)·`GELU_PIECE`, row k holding the coefficient of t^(7-k) for every
    /// piece (so a vector kernel looks one row up per lane with one permute). Weighted
    /// least-squares fits of Q's relative error: within 1e-6 of Q for a < 3.75 and within
    /// 4e-8 of it everywhere, so x·(1 - Q) and x·Q carry GELU's value to an ulp or two.
    /// Made by `scripts/fit_normal_tail.py`, which also prints each piece's error.
    pub const GELU_TAIL_POLY: [[f32; 8]; 8] = [
        [
            6.2117894e-04,
            -8.129429e-04,
            -3.9852807e-06,
            2.1515886e-04,
            -9.5601645e-06,
            -1.9998499e-05,
            -2.9680377e-06,
            -1.6812301e-07,
        ],
        [
            2.5507922e-03,
            1.2997072e-03,
            -1.3553965e-03,
            -3.0879665e-04,
            1.8936953e-04,
            6.3012405e-05,
            6.6858183e-06,
            3.1654622e-07,
        ],
        [
            -6.7353947e-03,
            5.2800383e-03,
            3.2824e-03,
            -9.66388e-04,
            -7.190375e-04,
            -1.2811869e-04,
            -9.852721e-06,
            -3.718207e-07,
        ],
        [
            -1.660624e-02,
            -1.7224751e-02,
            2.7675114e-03,
            5.415433e-03,
            1.5827712e-03,
            1.9395124e-04,
            1.1606378e-05,
            3.594762e-07,
        ],
        [
            5.326001e-02,
            -9.379856e-03,
            -2.8839737e-02,
            -1.2492386e-02,
            -2.3225655e-03,
            -2.1496502e-04,
            -1.0451052e-05,
            -2.7393278e-07,
        ],
        [
            6.972263e-02,
            1.191806e-01,
            6.448722e-02,
            1.6700469e-02,
            2.2631306e-03,
            1.6611566e-04,
            6.717815e-06,
            1.5112742e-07,
        ],
        [
            -3.7185508e-01,
            -2.1187665e-01,
            -6.878628e-02,
            -1.2724179e-02,
            -1.3411179e-03,
            -8.054073e-05,
            -2.7560259e-06,
            -5.3738642e-08,
        ],
        [
            3.5383025e-01,
            1.3029452e-01,
            3.039636e-02,
            4.3324484e-03,
            3.6907848e-04,
            1.8536739e-05,
            5.440431e-07,
            9.275521e-09,
        ],
    ];
    pub const GELU_PIECE: f32 = 0.75;
    /// Q(6) = 1e-9: beyond it GELU(x) is x for x > 0 (1 - Q rounds to 1) and 0 below.
    pub const GELU_TAIL_END: f32 = 6.0;
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

/// 1 / (1 + e^-x), flushed to 0 below x = `SIGMOID_ZERO_BELOW` (where it is subnormal, as
/// `exp` flushes its subnormal results), so that the vector form's e^-x stays a normal f32.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    let y = 1.0 / (1.0 + exp(-x));
    if x < SIGMOID_ZERO_BELOW {
        0.0
    } else {
        y
    }
}

/// Exact GELU, x·Φ(x) with Φ the standard normal CDF: Φ(x) = 1 - Q(|x|) for x ≥ 0 and
/// Q(|x|) below, Q from the piecewise fit `GELU_TAIL_POLY` (no exp, no division: a third of
/// the work of erfc's usual exp form, which made GELU the MLP's slowest elementwise op).
/// Each piece is chosen by index, so this runs one element at a time where it does not
/// vectorize; AVX2 CPUs run `vecmath`'s form of the same steps.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    let a = x.abs();
    let ac = a.min(GELU_TAIL_END);
    let piece = ((ac * (1.0 / GELU_PIECE)) as usize).min(7);
    let t = ac - (piece as f32 * GELU_PIECE + 0.5 * GELU_PIECE);
    let q = horner(t, GELU_TAIL_POLY.map(|row| row[piece]));
    let q = if a >= GELU_TAIL_END { 0.0 } else { q };
    let phi = if x < 0.0 { q } else { 1.0 - q };
    // NaN would have been clamped to the tail's end above.
    if x.is_nan() {
        x
    } else {
        x * phi
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

    /// Exact GELU to two ulps plus 4e-8·|x| (Φ's absolute error; torch's own float32 GELU
    /// is off by 4 % at x = -5), and to 1.5e-6 relative wherever Φ(x) > 1e-4.
    #[test]
    fn gelu_is_accurate() {
        let phi = |x: f64| 0.5 * libm::erfc(-x / std::f64::consts::SQRT_2);
        for x in grid().chain([-7.0, -6.0, -5.999_999_5, 5.999_999_5, 6.0, 1e-30, -1e-30]) {
            let got = gelu(x) as f64;
            let want = x as f64 * phi(x as f64);
            let err = (got - want).abs();
            assert!(
                err <= 2.0 * f32::EPSILON as f64 * want.abs() + 4e-8 * x.abs() as f64,
                "gelu({x}) = {got} vs {want}"
            );
            if phi(x as f64) > 1e-4 && want != 0.0 {
                assert!(err <= 1.5e-6 * want.abs(), "gelu({x}) = {got} vs {want}");
            }
        }
        assert_eq!(gelu(f32::INFINITY), f32::INFINITY);
        assert_eq!(gelu(-1e30), 0.0);
        assert_eq!(gelu(1e30), 1e30);
        assert_eq!(gelu(-0.0).to_bits(), (-0.0f32).to_bits());
        // As torch: -inf · Φ(-inf) = -inf · 0.
        assert!(gelu(f32::NEG_INFINITY).is_nan());
        assert!(gelu(f32::NAN).is_nan());
    }
}
