//! AVX2+FMA slice kernels for the f32 transcendental ops: exp, log, tanh, sigmoid, SiLU,
//! both GELUs, erf, sin, cos, tan, expm1 and log1p, sixteen lanes at a time where the CPU
//! has AVX-512F (twice the work per instruction: GELU was a tenth of the MLP benchmark at
//! eight lanes). Exp, tanh, sigmoid, SiLU and the GELUs evaluate `fastmath`'s
//! approximations (same range reductions, same polynomials); log, erf, sin, cos, tan,
//! expm1 and log1p have no `fastmath` form (elsewhere they are libm's, one element at a
//! time, 3-10x slower than eager) and are tested against libm. All run with fused
//! multiply-adds and several vectors in flight; both widths run the same operations in the
//! same order, so they agree bit for bit. The auto-vectorized scalar code is one
//! latency-bound chain of ~100 dependent operations per vector (GELU: a division, a
//! degree-9 polynomial and an exp), which ran at ~3 ns per element.
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
    /// The natural logarithm.
    Log,
    Erf,
    Sin,
    Cos,
    Tan,
    /// e^x - 1.
    Expm1,
    /// ln(1 + x).
    Log1p,
}

impl Kernel {
    /// The kernel of a unary op, if it has one.
    pub fn of(op: ember_core::ir::UnaryOp) -> Option<Kernel> {
        use ember_core::ir::UnaryOp as U;
        match op {
            U::Exp => Some(Kernel::Exp),
            U::Tanh => Some(Kernel::Tanh),
            U::Sigmoid => Some(Kernel::Sigmoid),
            U::Silu => Some(Kernel::Silu),
            U::Gelu => Some(Kernel::Gelu),
            U::GeluTanh => Some(Kernel::GeluTanh),
            U::Log => Some(Kernel::Log),
            U::Erf => Some(Kernel::Erf),
            U::Sin => Some(Kernel::Sin),
            U::Cos => Some(Kernel::Cos),
            U::Tan => Some(Kernel::Tan),
            U::Expm1 => Some(Kernel::Expm1),
            U::Log1p => Some(Kernel::Log1p),
            _ => None,
        }
    }
}

/// √(2/π), GELU's tanh form.
const GELU_TANH_K: f32 = 0.797_884_6;
const GELU_TANH_A: f32 = 0.044_715;

#[cfg(test)]
impl Kernel {
    /// The op on one element, as `fastmath` computes it (the reference the vector code
    /// follows, and what runs without AVX2+FMA), or as libm does for the kernels that have
    /// no `fastmath` form (their vector code is checked against libm's correctly rounded
    /// results instead).
    pub fn scalar(self, x: f32) -> f32 {
        use crate::elem::fastmath;
        match self {
            Kernel::Exp => fastmath::exp(x),
            Kernel::Tanh => fastmath::tanh(x),
            Kernel::Sigmoid => fastmath::sigmoid(x),
            Kernel::Silu => x * fastmath::sigmoid(x),
            Kernel::Gelu => fastmath::gelu(x),
            Kernel::GeluTanh => {
                0.5 * x * (1.0 + fastmath::tanh(GELU_TANH_K * (x + GELU_TANH_A * x * x * x)))
            }
            Kernel::Log => libm::logf(x),
            Kernel::Erf => libm::erff(x),
            Kernel::Sin => libm::sinf(x),
            Kernel::Cos => libm::cosf(x),
            Kernel::Tan => libm::tanf(x),
            Kernel::Expm1 => libm::expm1f(x),
            Kernel::Log1p => libm::log1pf(x),
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
        // SAFETY: `self` proves AVX2+FMA (and `avx512_available` AVX-512F); both slices hold
        // n elements and do not overlap.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            match crate::simd::avx512_available() {
                true => x86_512::run(kernel, x.as_ptr(), out.as_mut_ptr(), n, shift),
                false => x86::run(kernel, x.as_ptr(), out.as_mut_ptr(), n, shift),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (n, kernel, shift);
            unreachable!("Fma is only detected on x86-64")
        }
    }

    /// `out[i] = e^(x[i] - shift)`, returning Σ out[i] summed in f64 (softmax's
    /// exponentials and their sum in one pass). For shifts at least the largest x (the row's
    /// maximum): differences above 88 would saturate at e^88. Differences below `EXP_MIN`
    /// give e^x's subnormal or 0 where the `Exp` kernel flushes to 0 (both far below
    /// anything a softmax row's sum of at least 1 can show).
    pub fn exp_shifted_sum(self, x: &[f32], out: &mut [f32], shift: f32) -> f64 {
        debug_assert_eq!(x.len(), out.len());
        let n = x.len().min(out.len());
        // SAFETY: `self` proves AVX2+FMA (and `avx512_available` AVX-512F); both slices hold
        // n elements.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            match crate::simd::avx512_available() {
                true => x86_512::exp_sum(x.as_ptr(), out.as_mut_ptr(), n, shift),
                false => x86::exp_sum(x.as_ptr(), out.as_mut_ptr(), n, shift),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (n, shift);
            unreachable!("Fma is only detected on x86-64")
        }
    }

    /// `x[i] = e^(x[i] - shift)`, returning their sum in f64: softmax's numerators in place
    /// (the shift at least the largest x, as `exp_shifted_sum`).
    pub fn exp_shifted_sum_in_place(self, x: &mut [f32], shift: f32) -> f64 {
        // SAFETY: `self` proves AVX2+FMA (and `avx512_available` AVX-512F); each vector is
        // loaded before it is stored.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            match crate::simd::avx512_available() {
                true => x86_512::exp_sum(x.as_mut_ptr(), x.as_mut_ptr(), x.len(), shift),
                false => x86::exp_sum(x.as_mut_ptr(), x.as_mut_ptr(), x.len(), shift),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = shift;
            unreachable!("Fma is only detected on x86-64")
        }
    }
}

/// The kernels' math, written once over the lane operations each vector width defines
/// (`V`: a vector of f32, `M`: a lane mask, `I`: a vector of i32, and the small functions
/// below), so the AVX2 and AVX-512 copies compute the same operations in the same order:
/// an element's bits do not depend on the width that ran it.
#[cfg(target_arch = "x86_64")]
macro_rules! vector_math {
    ($feature:literal) => {
        /// Runs `kernel` on `x[i] - shift` for `n` elements from `x` to `out` (which may be
        /// `x` itself).
        ///
        /// # Safety
        /// The module's CPU features; `x` readable and `out` writable for n elements.
        #[target_feature(enable = $feature)]
        pub unsafe fn run(kernel: Kernel, x: *const f32, out: *mut f32, n: usize, shift: f32) {
            let s = splat(shift);
            // One monomorphic loop per kernel, so the vector code is inlined into it.
            macro_rules! each {
                ($f:ident, $unroll:ident) => {
                    // SAFETY: the caller's contract.
                    unsafe { apply::<$unroll>(x, out, n, s, |v| $f(v), |_| {}) }
                };
            }
            match kernel {
                Kernel::Exp => each!(exp, UNROLL),
                Kernel::Tanh => each!(tanh, UNROLL_REGISTER_HEAVY),
                Kernel::Sigmoid => each!(sigmoid, UNROLL),
                Kernel::Silu => each!(silu, UNROLL),
                Kernel::Gelu => each!(gelu, UNROLL),
                Kernel::GeluTanh => each!(gelu_tanh, UNROLL_REGISTER_HEAVY),
                Kernel::Log => each!(log, UNROLL_REGISTER_HEAVY),
                Kernel::Erf => each!(erf, UNROLL_REGISTER_HEAVY),
                Kernel::Sin => each!(sin, UNROLL),
                Kernel::Cos => each!(cos, UNROLL),
                Kernel::Tan => each!(tan, UNROLL),
                Kernel::Expm1 => each!(expm1, UNROLL_REGISTER_HEAVY),
                Kernel::Log1p => each!(log1p, UNROLL_REGISTER_HEAVY),
            }
        }

        /// p(t) by Horner's rule, highest coefficient first.
        #[target_feature(enable = $feature)]
        #[inline]
        fn horner<const N: usize>(t: V, coeffs: [f32; N]) -> V {
            let mut p = splat(coeffs[0]);
            for &k in &coeffs[1..] {
                p = fmadd(p, t, splat(k));
            }
            p
        }

        /// p(t) as hi(t)·t^m + lo(t), the coefficients split in half and each half by
        /// Horner's rule: two independent chains about half as deep as one (the long
        /// polynomials sit on the critical path of a latency-bound loop).
        #[target_feature(enable = $feature)]
        #[inline]
        fn split_horner<const N: usize>(t: V, coeffs: [f32; N]) -> V {
            let h = N / 2;
            let chain = |part: &[f32]| {
                let mut p = splat(part[0]);
                for &k in &part[1..] {
                    p = fmadd(p, t, splat(k));
                }
                p
            };
            let (hi, lo) = (chain(&coeffs[..h]), chain(&coeffs[h..]));
            let mut power = t;
            for _ in 1..N - h {
                power = mul(power, t);
            }
            fmadd(hi, power, lo)
        }

        /// 2^k for integer lanes k in [-126, 127], from the exponent bits.
        #[target_feature(enable = $feature)]
        #[inline]
        fn pow2(k: I) -> V {
            from_bits(shl23(iadd(k, isplat(127))))
        }

        /// `fastmath::exp`.
        #[target_feature(enable = $feature)]
        #[inline]
        pub(crate) fn exp(x: V) -> V {
            // max/min return their second operand for NaN lanes; those are fixed at the end.
            let xc = min(max(x, splat(c::EXP_MIN)), splat(c::EXP_MAX));
            let (er, ni) = exp_parts(xc);
            let half = sra1(ni);
            let y = mul(mul(er, pow2(half)), pow2(isub(ni, half)));
            let y = select(gt(x, splat(c::EXP_MAX)), splat(f32::INFINITY), y);
            let y = zero_where(lt(x, splat(c::EXP_MIN)), y);
            select(unordered(x), x, y)
        }

        /// `exp` for x in [`EXP_MIN`, `EXP_IN_RANGE_MAX`] (NaN stays NaN), the same bits
        /// without its clamps, special cases and two-step 2^n: a third fewer operations for
        /// the kernels whose arguments are bounded anyway (tanh, sigmoid).
        #[target_feature(enable = $feature)]
        #[inline]
        fn exp_in_range(x: V) -> V {
            let (er, ni) = exp_parts(x);
            mul(er, pow2(ni))
        }

        /// e^x = er·2^ni for x in [`EXP_MIN`, `EXP_MAX`]: the range reduction and the
        /// polynomial `exp` and `exp_in_range` share.
        #[target_feature(enable = $feature)]
        #[inline]
        fn exp_parts(x: V) -> (V, I) {
            let k = fmadd(x, splat(c::LOG2E), splat(c::ROUND_MAGIC));
            let n = sub(k, splat(c::ROUND_MAGIC));
            let r = fnmadd(n, splat(c::LN2_HI), x);
            let r = fnmadd(n, splat(c::LN2_LO), r);
            let p = horner(r, c::EXP_POLY);
            let er = add(fmadd(p, mul(r, r), r), splat(1.0));
            (
                er,
                isub(to_bits(k), isplat(c::ROUND_MAGIC.to_bits() as i32)),
            )
        }

        /// `exp`'s bits for x in [`EXP_MIN`, `EXP_IN_RANGE_MAX`] (softmax's scores minus
        /// their row's maximum, which are ≤ 0); NaN stays NaN. Below, down to
        /// `EXP_SUBNORMAL_FLOOR`, e^x as a subnormal or 0 (not `exp`'s flush to 0), and 0
        /// from there on (-inf included): 2^n's exponent bits are all zero at n = -127. No
        /// select on the input is needed, which kept x live to the end and spilled the
        /// unrolled loop's registers (13 % of the pass).
        #[target_feature(enable = $feature)]
        #[inline]
        fn exp_at_most_88(x: V) -> V {
            let bounded = min(
                splat(c::EXP_IN_RANGE_MAX),
                max(splat(c::EXP_SUBNORMAL_FLOOR), x),
            );
            exp_in_range(bounded)
        }

        #[target_feature(enable = $feature)]
        #[inline]
        fn abs(x: V) -> V {
            andnot(splat(-0.0), x)
        }

        /// `fastmath::tanh`: the odd polynomial below 0.625, 1 - 2/(e^{2|x|} + 1) with x's
        /// sign above (NaN stays NaN through the exp).
        #[target_feature(enable = $feature)]
        #[inline]
        pub(crate) fn tanh(x: V) -> V {
            let a = abs(x);
            let z = mul(x, x);
            let p = horner(z, c::TANH_POLY);
            let small = fmadd(mul(x, z), p, x);
            // e^{2|x|} past e^88 leaves 1 - 2/(e + 1) at 1 all the same.
            let e = exp_in_range(min(splat(c::EXP_IN_RANGE_MAX), add(a, a)));
            let large = sub(splat(1.0), div(splat(2.0), add(e, splat(1.0))));
            let large = or(large, and(x, splat(-0.0)));
            select(lt(a, splat(c::TANH_SMALL)), small, large)
        }

        /// 1 / (1 + e^-x).
        #[target_feature(enable = $feature)]
        #[inline]
        pub(crate) fn sigmoid(x: V) -> V {
            // Below EXP_MIN e^-x adds nothing to 1; above the range the result is flushed.
            let minus_x = xor(x, splat(-0.0));
            let bounded = min(splat(c::EXP_IN_RANGE_MAX), max(splat(c::EXP_MIN), minus_x));
            let y = div(splat(1.0), add(splat(1.0), exp_in_range(bounded)));
            zero_where(lt(x, splat(c::SIGMOID_ZERO_BELOW)), y)
        }

        #[target_feature(enable = $feature)]
        #[inline]
        pub(crate) fn silu(x: V) -> V {
            mul(x, sigmoid(x))
        }

        /// The standard normal's tail Q(a) for a ≥ 0 (`GELU_TAIL_POLY`; 0 from
        /// `GELU_TAIL_END` on; NaN stays NaN): each lane's piece of the fit looked up by
        /// permutes, one per coefficient row.
        #[target_feature(enable = $feature)]
        #[inline]
        fn normal_tail(a: V) -> V {
            // min returns its second operand for NaN lanes.
            let ac = min(splat(c::GELU_TAIL_END), a);
            let piece = imin(cvtt(mul(ac, splat(1.0 / c::GELU_PIECE))), isplat(7));
            let center = fmadd(cvt(piece), splat(c::GELU_PIECE), splat(0.5 * c::GELU_PIECE));
            let t = sub(ac, center);
            let mut q = lookup(&c::GELU_TAIL_POLY[0], piece);
            for row in &c::GELU_TAIL_POLY[1..] {
                q = fmadd(q, t, lookup(row, piece));
            }
            zero_where(ge(a, splat(c::GELU_TAIL_END)), q)
        }

        /// `fastmath::gelu`: x·Φ(x), Φ(x) = 1 - Q(x) above 0 and Q(-x) below.
        #[target_feature(enable = $feature)]
        #[inline]
        pub(crate) fn gelu(x: V) -> V {
            let q = normal_tail(abs(x));
            mul(x, select(lt(x, splat(0.0)), q, sub(splat(1.0), q)))
        }

        #[target_feature(enable = $feature)]
        #[inline]
        pub(crate) fn gelu_tanh(x: V) -> V {
            let cube = mul(mul(splat(GELU_TANH_A), x), x);
            let inner = mul(splat(GELU_TANH_K), fmadd(cube, x, x));
            let t = add(splat(1.0), tanh(inner));
            mul(mul(splat(0.5), x), t)
        }

        /// ln x (Cephes' `logf`): x = 2^e·m with m in (√½, √2], ln m = f - f²/2 + f³·P(f)
        /// for f = m - 1, plus e·ln2 in two parts. Subnormals are scaled by 2^23 first;
        /// ln 0 = -inf, ln of a negative is NaN, ln inf = inf.
        #[target_feature(enable = $feature)]
        #[inline]
        pub(crate) fn log(x: V) -> V {
            let tiny = lt(x, splat(f32::MIN_POSITIVE));
            let bits = to_bits(select(tiny, mul(x, splat(c::TWO_POW_23)), x));
            let m = from_bits(ior(iand(bits, isplat(0x007f_ffff)), isplat(0x3f80_0000)));
            let big = gt(m, splat(std::f32::consts::SQRT_2));
            let m = select(big, mul(m, splat(0.5)), m);
            let e = cvt(isub(srl23(bits), isplat(127)));
            let e = add(e, select(big, splat(1.0), splat(0.0)));
            let e = sub(e, select(tiny, splat(23.0), splat(0.0)));
            let f = sub(m, splat(1.0));
            let z = mul(f, f);
            let y = mul(mul(split_horner(f, c::LOG_POLY), f), z);
            let y = fmadd(e, splat(c::LN2_LO), y);
            let y = fnmadd(splat(0.5), z, y);
            let r = fmadd(e, splat(c::LN2_HI), add(f, y));
            let r = select(eq(x, splat(f32::INFINITY)), x, r);
            let r = select(eq(x, splat(0.0)), splat(f32::NEG_INFINITY), r);
            let r = select(lt(x, splat(0.0)), splat(f32::NAN), r);
            select(unordered(x), x, r)
        }

        /// erf x: x·P(x²) below |x| = 1 (relative accuracy where erf is small), else
        /// 1 - erfc(|x|) with x's sign, erfc(z) = 2·Q(√2·z) from GELU's tail fit.
        #[target_feature(enable = $feature)]
        #[inline]
        pub(crate) fn erf(x: V) -> V {
            let z = abs(x);
            let small = mul(x, split_horner(mul(x, x), c::ERF_POLY));
            let erfc = mul(
                splat(2.0),
                normal_tail(mul(z, splat(std::f32::consts::SQRT_2))),
            );
            let large = or(sub(splat(1.0), erfc), and(x, splat(-0.0)));
            // NaN lanes are NaN on both sides.
            select(lt(z, splat(1.0)), small, large)
        }

        /// |x| = j·π/4 + r with j even and |r| ≤ π/4 (π/4 in three parts, each step one
        /// fused multiply-add, so r keeps its relative accuracy near the zeros), for
        /// |x| ≤ `TRIG_FAST_MAX`.
        #[target_feature(enable = $feature)]
        #[inline]
        fn reduce_quarter_pi(a: V) -> (V, I) {
            let j = cvtt(mul(a, splat(c::FOUR_OVER_PI)));
            let j = iand(iadd(j, isplat(1)), isplat(!1));
            let y = cvt(j);
            let r = fnmadd(y, splat(c::PIO4_HI), a);
            let r = fnmadd(y, splat(c::PIO4_MID), r);
            (fnmadd(y, splat(c::PIO4_LO), r), j)
        }

        /// sin r and cos r for |r| ≤ π/4 (Cephes' `sinf`/`cosf` polynomials).
        #[target_feature(enable = $feature)]
        #[inline]
        fn sin_cos_poly(r: V) -> (V, V) {
            let z = mul(r, r);
            let s = fmadd(mul(horner(z, c::SIN_POLY), z), r, r);
            let c = fmadd(
                mul(horner(z, c::COS_POLY), z),
                z,
                fnmadd(splat(0.5), z, splat(1.0)),
            );
            (s, c)
        }

        /// Lanes of `a` past the fast range (or NaN) recomputed one by one with `exact`.
        #[target_feature(enable = $feature)]
        #[inline]
        fn far_lanes(a: V, x: V, fast: V, exact: fn(f32) -> f32) -> V {
            let far = not_le(a, splat(c::TRIG_FAST_MAX));
            if any(far) {
                select(far, each_lane(x, exact), fast)
            } else {
                fast
            }
        }

        #[target_feature(enable = $feature)]
        #[inline]
        pub(crate) fn sin(x: V) -> V {
            let a = abs(x);
            let (r, j) = reduce_quarter_pi(a);
            let (s, c) = sin_cos_poly(r);
            // j ≡ 2 (mod 4): the other polynomial; j ≡ 4, 6 (mod 8): negated; odd in x.
            let v = select(izero(iand(j, isplat(2))), s, c);
            let sign = xor(and(x, splat(-0.0)), from_bits(shl29(iand(j, isplat(4)))));
            far_lanes(a, x, xor(v, sign), libm::sinf)
        }

        #[target_feature(enable = $feature)]
        #[inline]
        pub(crate) fn cos(x: V) -> V {
            let a = abs(x);
            let (r, j) = reduce_quarter_pi(a);
            let (s, c) = sin_cos_poly(r);
            // j ≡ 2 (mod 4): the other polynomial; j ≡ 2, 4 (mod 8): negated.
            let v = select(izero(iand(j, isplat(2))), c, s);
            let sign = from_bits(shl29(iand(iadd(j, isplat(2)), isplat(4))));
            far_lanes(a, x, xor(v, sign), libm::cosf)
        }

        #[target_feature(enable = $feature)]
        #[inline]
        pub(crate) fn tan(x: V) -> V {
            let a = abs(x);
            let (r, j) = reduce_quarter_pi(a);
            let (s, c) = sin_cos_poly(r);
            // j ≡ 2 (mod 4): tan(π/2 + r) = -cos r / sin r; odd in x.
            let near_zero = izero(iand(j, isplat(2)));
            let v = div(
                select(near_zero, s, c),
                select(near_zero, c, xor(s, splat(-0.0))),
            );
            far_lanes(a, x, xor(v, and(x, splat(-0.0))), libm::tanf)
        }

        /// e^x - 1 without cancellation: x = n·ln2 + r as in `exp`, e^r - 1 from exp's
        /// polynomial, then 2^n·(e^r - 1) + (2^n - 1) with one rounding. Lanes above 80 (where
        /// 2^n would overflow; e^x - 1 is e^x there) go through libm.
        #[target_feature(enable = $feature)]
        #[inline]
        pub(crate) fn expm1(x: V) -> V {
            let xc = max(min(x, splat(80.0)), splat(-87.0));
            let k = fmadd(xc, splat(c::LOG2E), splat(c::ROUND_MAGIC));
            let n = sub(k, splat(c::ROUND_MAGIC));
            let r = fnmadd(n, splat(c::LN2_HI), xc);
            let r = fnmadd(n, splat(c::LN2_LO), r);
            let em1r = fmadd(horner(r, c::EXP_POLY), mul(r, r), r);
            let p = pow2(isub(to_bits(k), isplat(c::ROUND_MAGIC.to_bits() as i32)));
            let y = fmadd(p, em1r, sub(p, splat(1.0)));
            let big = gt(x, splat(80.0));
            let y = if any(big) {
                select(big, each_lane(x, libm::expm1f), y)
            } else {
                y
            };
            select(unordered(x), x, y)
        }

        /// ln(1 + x) as ln(u)·x/(u - 1) for u = 1 + x, which cancels the rounding of u
        /// (Kahan); x itself where u rounds to 1.
        #[target_feature(enable = $feature)]
        #[inline]
        pub(crate) fn log1p(x: V) -> V {
            let u = add(x, splat(1.0));
            let y = mul(log(u), div(x, sub(u, splat(1.0))));
            let y = select(eq(u, splat(1.0)), x, y);
            let y = select(eq(x, splat(f32::INFINITY)), x, y);
            select(unordered(x), x, y)
        }
    };
}

/// Defines the lane operations `vector_math!` uses, each a one-intrinsic function.
#[cfg(target_arch = "x86_64")]
macro_rules! lane_ops {
    ($feature:literal, $($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty $body:block)*) => {
        $(
            #[target_feature(enable = $feature)]
            #[inline]
            fn $name($($arg: $ty),*) -> $ret $body
        )*
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Kernel, GELU_TANH_A, GELU_TANH_K};
    use crate::elem::fastmath::consts as c;
    use std::arch::x86_64::*;

    type V = __m256;
    /// A lane mask: all bits set in the lanes it selects.
    type M = __m256;
    type I = __m256i;

    lane_ops! { "avx2,fma",
        splat(v: f32) -> V { _mm256_set1_ps(v) }
        add(a: V, b: V) -> V { _mm256_add_ps(a, b) }
        sub(a: V, b: V) -> V { _mm256_sub_ps(a, b) }
        mul(a: V, b: V) -> V { _mm256_mul_ps(a, b) }
        div(a: V, b: V) -> V { _mm256_div_ps(a, b) }
        fmadd(a: V, b: V, c: V) -> V { _mm256_fmadd_ps(a, b, c) }
        fnmadd(a: V, b: V, c: V) -> V { _mm256_fnmadd_ps(a, b, c) }
        min(a: V, b: V) -> V { _mm256_min_ps(a, b) }
        max(a: V, b: V) -> V { _mm256_max_ps(a, b) }
        and(a: V, b: V) -> V { _mm256_and_ps(a, b) }
        or(a: V, b: V) -> V { _mm256_or_ps(a, b) }
        xor(a: V, b: V) -> V { _mm256_xor_ps(a, b) }
        andnot(a: V, b: V) -> V { _mm256_andnot_ps(a, b) }
        gt(a: V, b: V) -> M { _mm256_cmp_ps(a, b, _CMP_GT_OQ) }
        lt(a: V, b: V) -> M { _mm256_cmp_ps(a, b, _CMP_LT_OQ) }
        ge(a: V, b: V) -> M { _mm256_cmp_ps(a, b, _CMP_GE_OQ) }
        unordered(a: V) -> M { _mm256_cmp_ps(a, a, _CMP_UNORD_Q) }
        select(m: M, a: V, b: V) -> V { _mm256_blendv_ps(b, a, m) }
        zero_where(m: M, a: V) -> V { _mm256_andnot_ps(m, a) }
        to_bits(a: V) -> I { _mm256_castps_si256(a) }
        from_bits(a: I) -> V { _mm256_castsi256_ps(a) }
        isplat(v: i32) -> I { _mm256_set1_epi32(v) }
        iadd(a: I, b: I) -> I { _mm256_add_epi32(a, b) }
        isub(a: I, b: I) -> I { _mm256_sub_epi32(a, b) }
        sra1(a: I) -> I { _mm256_srai_epi32(a, 1) }
        shl23(a: I) -> I { _mm256_slli_epi32(a, 23) }
        shl29(a: I) -> I { _mm256_slli_epi32(a, 29) }
        srl23(a: I) -> I { _mm256_srli_epi32(a, 23) }
        iand(a: I, b: I) -> I { _mm256_and_si256(a, b) }
        ior(a: I, b: I) -> I { _mm256_or_si256(a, b) }
        izero(a: I) -> M { _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, _mm256_setzero_si256())) }
        cvt(a: I) -> V { _mm256_cvtepi32_ps(a) }
        cvtt(a: V) -> I { _mm256_cvttps_epi32(a) }
        imin(a: I, b: I) -> I { _mm256_min_epi32(a, b) }
        lookup(table: &[f32; 8], i: I) -> V {
            let [a, b, c, d, e, f, g, h] = *table;
            _mm256_permutevar8x32_ps(_mm256_setr_ps(a, b, c, d, e, f, g, h), i)
        }
        eq(a: V, b: V) -> M { _mm256_cmp_ps(a, b, _CMP_EQ_OQ) }
        not_le(a: V, b: V) -> M { _mm256_cmp_ps(a, b, _CMP_NLE_UQ) }
        any(m: M) -> bool { _mm256_movemask_ps(m) != 0 }
    }

    /// `f` on each lane of `a`, one at a time.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn each_lane(a: V, f: fn(f32) -> f32) -> V {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds the 8 lanes stored and loaded.
        unsafe {
            _mm256_storeu_ps(lanes.as_mut_ptr(), a);
            lanes.iter_mut().for_each(|v| *v = f(*v));
            _mm256_loadu_ps(lanes.as_ptr())
        }
    }

    vector_math!("avx2,fma");

    /// As `run` with `exp` for x - shift ≤ 88 (softmax's shifted scores), also returning the
    /// sum of the results in f64.
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
        unsafe { apply::<UNROLL>(x, out, n, _mm256_set1_ps(shift), |v| exp_at_most_88(v), add) };
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

    /// Vectors per step: independent chains for the out-of-order core to overlap (the
    /// kernels are long dependent chains; 8 ran exp, tanh and sin 25-35 % faster than 4 on
    /// Zen 3).
    const UNROLL: usize = 8;
    /// For kernels with many live values per vector (log, log1p, erf, tanh, expm1): 8
    /// chains of them spill the 16 registers. On Zen 3, 4 ran log and log1p 20-25 % faster,
    /// tanh, GELU(tanh) and expm1 4-6 %; sigmoid, SiLU, sin and cos 6-12 % slower, so those
    /// keep 8.
    const UNROLL_REGISTER_HEAVY: usize = 4;

    /// `out[i] = f(x[i] - shift)`, VECTORS vectors per step, each stored vector also handed
    /// to `seen` (with the lanes past n zeroed); the last partial vector through masked loads
    /// and stores (slow on AMD, so only that one).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn apply<const VECTORS: usize>(
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
            while i + 8 * VECTORS <= n {
                let mut v = [_mm256_setzero_ps(); VECTORS];
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
                i += 8 * VECTORS;
            }
            while i + 8 <= n {
                let v = f(_mm256_sub_ps(_mm256_loadu_ps(x.add(i)), shift));
                _mm256_storeu_ps(out.add(i), v);
                seen(v);
                i += 8;
            }
            if i < n {
                let mask = tail_mask(n - i);
                let a = _mm256_sub_ps(_mm256_maskload_ps(x.add(i), mask), shift);
                let v = f(a);
                _mm256_maskstore_ps(out.add(i), mask, v);
                seen(_mm256_and_ps(v, _mm256_castsi256_ps(mask)));
            }
        }
    }
}

/// The same kernels sixteen lanes at a time, where the CPU has AVX-512F (their one-vector
/// forms also run inside `kernels::chain`).
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_512 {
    use super::{Kernel, GELU_TANH_A, GELU_TANH_K};
    use crate::elem::fastmath::consts as c;
    use std::arch::x86_64::*;

    type V = __m512;
    type M = __mmask16;
    type I = __m512i;

    // AVX-512F has no float bitwise ops (those are AVX512DQ): they go through the integer
    // ones, which are the same bits.
    lane_ops! { "avx512f",
        splat(v: f32) -> V { _mm512_set1_ps(v) }
        add(a: V, b: V) -> V { _mm512_add_ps(a, b) }
        sub(a: V, b: V) -> V { _mm512_sub_ps(a, b) }
        mul(a: V, b: V) -> V { _mm512_mul_ps(a, b) }
        div(a: V, b: V) -> V { _mm512_div_ps(a, b) }
        fmadd(a: V, b: V, c: V) -> V { _mm512_fmadd_ps(a, b, c) }
        fnmadd(a: V, b: V, c: V) -> V { _mm512_fnmadd_ps(a, b, c) }
        min(a: V, b: V) -> V { _mm512_min_ps(a, b) }
        max(a: V, b: V) -> V { _mm512_max_ps(a, b) }
        and(a: V, b: V) -> V { from_bits(_mm512_and_si512(to_bits(a), to_bits(b))) }
        or(a: V, b: V) -> V { from_bits(_mm512_or_si512(to_bits(a), to_bits(b))) }
        xor(a: V, b: V) -> V { from_bits(_mm512_xor_si512(to_bits(a), to_bits(b))) }
        andnot(a: V, b: V) -> V { from_bits(_mm512_andnot_si512(to_bits(a), to_bits(b))) }
        gt(a: V, b: V) -> M { _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) }
        lt(a: V, b: V) -> M { _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ) }
        ge(a: V, b: V) -> M { _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ) }
        unordered(a: V) -> M { _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) }
        select(m: M, a: V, b: V) -> V { _mm512_mask_blend_ps(m, b, a) }
        zero_where(m: M, a: V) -> V { _mm512_maskz_mov_ps(!m, a) }
        to_bits(a: V) -> I { _mm512_castps_si512(a) }
        from_bits(a: I) -> V { _mm512_castsi512_ps(a) }
        isplat(v: i32) -> I { _mm512_set1_epi32(v) }
        iadd(a: I, b: I) -> I { _mm512_add_epi32(a, b) }
        isub(a: I, b: I) -> I { _mm512_sub_epi32(a, b) }
        sra1(a: I) -> I { _mm512_srai_epi32(a, 1) }
        shl23(a: I) -> I { _mm512_slli_epi32(a, 23) }
        shl29(a: I) -> I { _mm512_slli_epi32(a, 29) }
        srl23(a: I) -> I { _mm512_srli_epi32(a, 23) }
        iand(a: I, b: I) -> I { _mm512_and_si512(a, b) }
        ior(a: I, b: I) -> I { _mm512_or_si512(a, b) }
        izero(a: I) -> M { _mm512_cmpeq_epi32_mask(a, _mm512_setzero_si512()) }
        cvt(a: I) -> V { _mm512_cvtepi32_ps(a) }
        cvtt(a: V) -> I { _mm512_cvttps_epi32(a) }
        imin(a: I, b: I) -> I { _mm512_min_epi32(a, b) }
        // Indices 0-7 (the high half is never picked; NaN lanes pick 0 and stay NaN).
        lookup(table: &[f32; 8], i: I) -> V {
            let [a, b, c, d, e, f, g, h] = *table;
            let table = _mm256_setr_ps(a, b, c, d, e, f, g, h);
            _mm512_permutexvar_ps(i, _mm512_zextps256_ps512(table))
        }
        eq(a: V, b: V) -> M { _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ) }
        not_le(a: V, b: V) -> M { _mm512_cmp_ps_mask(a, b, _CMP_NLE_UQ) }
        any(m: M) -> bool { m != 0 }
    }

    /// `f` on each lane of `a`, one at a time.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn each_lane(a: V, f: fn(f32) -> f32) -> V {
        let mut lanes = [0f32; 16];
        // SAFETY: `lanes` holds the 16 lanes stored and loaded.
        unsafe {
            _mm512_storeu_ps(lanes.as_mut_ptr(), a);
            lanes.iter_mut().for_each(|v| *v = f(*v));
            _mm512_loadu_ps(lanes.as_ptr())
        }
    }

    vector_math!("avx512f");

    /// As `run` with `exp` for x - shift ≤ 88 (softmax's shifted scores), also returning the
    /// sum of the results in f64.
    ///
    /// # Safety
    /// AVX-512F; `x` readable and `out` writable for n elements.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_sum(x: *const f32, out: *mut f32, n: usize, shift: f32) -> f64 {
        let mut acc = [_mm512_setzero_pd(); 2];
        let add = |v: __m512| {
            let lo = _mm512_castps512_ps256(v);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
            acc[0] = _mm512_add_pd(acc[0], _mm512_cvtps_pd(lo));
            acc[1] = _mm512_add_pd(acc[1], _mm512_cvtps_pd(hi));
        };
        // SAFETY: the caller's contract.
        unsafe { apply::<UNROLL>(x, out, n, _mm512_set1_ps(shift), |v| exp_at_most_88(v), add) };
        _mm512_reduce_add_pd(_mm512_add_pd(acc[0], acc[1]))
    }

    /// Vectors per step: independent chains for the out-of-order core to overlap.
    const UNROLL: usize = 4;
    /// AVX-512 has 32 registers, so the kernels with many live values keep the same unroll
    /// (not measured: no AVX-512 machine at hand).
    const UNROLL_REGISTER_HEAVY: usize = 4;

    /// `out[i] = f(x[i] - shift)`, VECTORS vectors per step, each stored vector also handed
    /// to `seen` (with the lanes past n zeroed); the last partial vector through masked loads
    /// and stores.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn apply<const VECTORS: usize>(
        x: *const f32,
        out: *mut f32,
        n: usize,
        shift: __m512,
        f: impl Fn(__m512) -> __m512,
        mut seen: impl FnMut(__m512),
    ) {
        // SAFETY (whole body): every access is below n (the tail's lanes past n are masked).
        unsafe {
            let mut i = 0;
            while i + 16 * VECTORS <= n {
                let mut v = [_mm512_setzero_ps(); VECTORS];
                for (k, v) in v.iter_mut().enumerate() {
                    *v = _mm512_sub_ps(_mm512_loadu_ps(x.add(i + 16 * k)), shift);
                }
                for v in v.iter_mut() {
                    *v = f(*v);
                }
                for (k, v) in v.iter().enumerate() {
                    _mm512_storeu_ps(out.add(i + 16 * k), *v);
                    seen(*v);
                }
                i += 16 * VECTORS;
            }
            while i < n {
                let mask = crate::simd::first_lanes(n - i);
                let a = _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x.add(i)), shift);
                let v = f(a);
                _mm512_mask_storeu_ps(out.add(i), mask, v);
                seen(_mm512_maskz_mov_ps(mask, v));
                i += 16;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const ALL: [Kernel; 13] = [
        Kernel::Exp,
        Kernel::Tanh,
        Kernel::Sigmoid,
        Kernel::Silu,
        Kernel::Gelu,
        Kernel::GeluTanh,
        Kernel::Log,
        Kernel::Erf,
        Kernel::Sin,
        Kernel::Cos,
        Kernel::Tan,
        Kernel::Expm1,
        Kernel::Log1p,
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
            Kernel::Log => x.ln(),
            Kernel::Erf => libm::erf(x),
            Kernel::Sin => x.sin(),
            Kernel::Cos => x.cos(),
            Kernel::Tan => x.tan(),
            Kernel::Expm1 => x.exp_m1(),
            Kernel::Log1p => x.ln_1p(),
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
            1e-40,
            -1e-40,
            1.000_000_1,
            0.999_999_94,
            std::f32::consts::PI,
            std::f32::consts::FRAC_PI_2,
            65_535.9,
            65_536.5,
            1e6,
            -3e7,
        ]);
        // Every binade, subnormals included (log's exponent handling), and the range sin/cos
        // reduce with multiples of π/4 on their fast path.
        x.extend((-149..128).flat_map(|k| [1.0, 1.3, 1.7].map(|m| m * 2f32.powi(k))));
        x.extend((0..20_000).map(|i| i as f32 * 3.3));
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
        let mut worst = [0f64; ALL.len()];
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
                worst[k as usize] = worst[k as usize].max(ulps);
                let exact = reference(k, xi as f64);
                if exact.is_finite() && exact.abs() > 1e-30 {
                    let rel = err(exact) / exact.abs();
                    assert!(rel < 3e-6, "{k:?}({xi}) = {got} vs {exact}");
                }
            }
        }
        // Seen with `--nocapture`: how close each kernel came to the 4-ulp bound.
        eprintln!(
            "worst ulps: {:?}",
            ALL.iter().zip(worst).collect::<Vec<_>>()
        );
    }

    /// Where both widths run, they give the same bits (and sums within rounding).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn both_widths_agree_bit_for_bit() {
        if !crate::simd::avx512_available() {
            return;
        }
        let x = inputs();
        for k in ALL {
            let (mut narrow, mut wide) = (vec![0f32; x.len()], vec![1f32; x.len()]);
            // SAFETY: AVX-512F (hence AVX2+FMA) is present; both buffers hold x.len().
            unsafe {
                x86::run(k, x.as_ptr(), narrow.as_mut_ptr(), x.len(), 0.5);
                x86_512::run(k, x.as_ptr(), wide.as_mut_ptr(), x.len(), 0.5);
            }
            for (i, (a, b)) in narrow.iter().zip(&wide).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{k:?}({} - 0.5)", x[i]);
            }
        }
        let y: Vec<f32> = (0..1000).map(|i| (i % 97) as f32 * 0.1 - 4.0).collect();
        let mut out = vec![0f32; y.len()];
        // SAFETY: as above.
        let (a, b) = unsafe {
            (
                x86::exp_sum(y.as_ptr(), out.as_mut_ptr(), y.len(), 1.0),
                x86_512::exp_sum(y.as_ptr(), out.as_mut_ptr(), y.len(), 1.0),
            )
        };
        assert!((a - b).abs() <= 1e-12 * a, "{a} vs {b}");
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
        // Below EXP_MIN: a subnormal or 0, never NaN or negative; exactly 0 from the floor
        // (-inf included); NaN stays NaN.
        let x: Vec<f32> = (0..400)
            .map(|i| -86.0 - i as f32 * 0.01)
            .chain([-100.0, -1e30, f32::NEG_INFINITY, f32::NAN])
            .collect();
        let mut got = vec![f32::NAN; x.len()];
        fma.exp_shifted_sum(&x, &mut got, 0.0);
        let mut exp = vec![f32::NAN; x.len()];
        fma.run(Kernel::Exp, &x, &mut exp);
        for ((&v, &e), &want) in x.iter().zip(&got).zip(&exp) {
            if v.is_nan() {
                assert!(e.is_nan());
            } else if v >= crate::elem::fastmath::consts::EXP_MIN {
                assert_eq!(e.to_bits(), want.to_bits(), "e^{v}");
            } else if v <= crate::elem::fastmath::consts::EXP_SUBNORMAL_FLOOR {
                assert_eq!(e.to_bits(), 0, "e^{v} = {e}");
            } else {
                let want = (v as f64).exp();
                assert!(
                    (0.0..f32::MIN_POSITIVE).contains(&e)
                        && (e as f64 - want).abs() < f32::MIN_POSITIVE as f64,
                    "e^{v} = {e:e}, want {want:e}"
                );
            }
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
        // Softmax's pass: e^(x - max) stored and summed.
        let sum = best(&mut || {
            std::hint::black_box(fma.exp_shifted_sum(&x, &mut out, 4.0));
        });
        eprintln!("exp_shifted_sum: {sum:.2} ns/element");
    }
}
