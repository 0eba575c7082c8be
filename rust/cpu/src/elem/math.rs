//! Arithmetic on elements: float math in f32 or f64 (f16/bf16 widen to f32), and integer
//! arithmetic that wraps as torch's does.

use std::ops::{Add, Div, Mul, Neg, Sub};

use half::{bf16, f16};

use super::fastmath;
use super::Elem;

/// Float arithmetic type (f32 or f64) in which float kernels compute.
pub trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + Default
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    const INF: Self;
    fn of(v: f64) -> Self;
    fn f64(self) -> f64;
    fn exp_m1(self) -> Self;
    fn ln(self) -> Self;
    fn ln_1p(self) -> Self;
    fn sqrt(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn tan(self) -> Self;
    fn floor(self) -> Self;
    fn ceil(self) -> Self;
    fn trunc(self) -> Self;
    fn round_even(self) -> Self;
    fn abs(self) -> Self;
    fn atan2(self, o: Self) -> Self;
    fn fmod(self, o: Self) -> Self;
    fn erf(self) -> Self;
    /// Vectorizable forms (f32: `fastmath`; f64: the libm functions).
    fn fast_exp(self) -> Self;
    fn fast_tanh(self) -> Self;
    fn fast_sigmoid(self) -> Self;
    /// Exact GELU, x·Φ(x) (f32: `fastmath::gelu`'s piecewise fit; f64: through libm's erfc).
    fn fast_gelu(self) -> Self;
    fn is_nan(self) -> bool;
    fn is_infinite(self) -> bool;
}

macro_rules! real {
    ($t:ident, $erf:path, $exp:path, $tanh:path, $sigmoid:path, $gelu:path) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const INF: Self = $t::INFINITY;
            #[inline]
            fn of(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn exp_m1(self) -> Self {
                $t::exp_m1(self)
            }
            #[inline]
            fn ln(self) -> Self {
                $t::ln(self)
            }
            #[inline]
            fn ln_1p(self) -> Self {
                $t::ln_1p(self)
            }
            #[inline]
            fn sqrt(self) -> Self {
                $t::sqrt(self)
            }
            #[inline]
            fn sin(self) -> Self {
                $t::sin(self)
            }
            #[inline]
            fn cos(self) -> Self {
                $t::cos(self)
            }
            #[inline]
            fn tan(self) -> Self {
                $t::tan(self)
            }
            #[inline]
            fn floor(self) -> Self {
                $t::floor(self)
            }
            #[inline]
            fn ceil(self) -> Self {
                $t::ceil(self)
            }
            #[inline]
            fn trunc(self) -> Self {
                $t::trunc(self)
            }
            #[inline]
            fn round_even(self) -> Self {
                $t::round_ties_even(self)
            }
            #[inline]
            fn abs(self) -> Self {
                $t::abs(self)
            }
            #[inline]
            fn atan2(self, o: Self) -> Self {
                $t::atan2(self, o)
            }
            #[inline]
            fn fmod(self, o: Self) -> Self {
                self % o
            }
            #[inline]
            fn erf(self) -> Self {
                $erf(self)
            }
            #[inline(always)]
            fn fast_exp(self) -> Self {
                $exp(self)
            }
            #[inline(always)]
            fn fast_tanh(self) -> Self {
                $tanh(self)
            }
            #[inline(always)]
            fn fast_sigmoid(self) -> Self {
                $sigmoid(self)
            }
            #[inline(always)]
            fn fast_gelu(self) -> Self {
                $gelu(self)
            }
            #[inline]
            fn is_nan(self) -> bool {
                $t::is_nan(self)
            }
            #[inline]
            fn is_infinite(self) -> bool {
                $t::is_infinite(self)
            }
        }
    };
}
real!(
    f32,
    libm::erff,
    fastmath::exp,
    fastmath::tanh,
    fastmath::sigmoid,
    fastmath::gelu
);
real!(f64, libm::erf, f64::exp, f64::tanh, sigmoid_f64, gelu_f64);

fn sigmoid_f64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// x·Φ(x) with Φ(x) = erfc(-x/√2)/2: accurate in relative terms for negative x too.
fn gelu_f64(x: f64) -> f64 {
    x * 0.5 * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2)
}

/// A float element with the type its math is done in.
pub trait FloatElem: Elem {
    type C: Real;
    fn load(self) -> Self::C;
    fn store(c: Self::C) -> Self;
}

impl FloatElem for f32 {
    type C = f32;
    #[inline]
    fn load(self) -> f32 {
        self
    }
    #[inline]
    fn store(c: f32) -> f32 {
        c
    }
}

impl FloatElem for f64 {
    type C = f64;
    #[inline]
    fn load(self) -> f64 {
        self
    }
    #[inline]
    fn store(c: f64) -> f64 {
        c
    }
}

impl FloatElem for f16 {
    type C = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        super::halfconv::f16_to_f32(self)
    }
    #[inline(always)]
    fn store(c: f32) -> f16 {
        super::halfconv::f32_to_f16(c)
    }
}

impl FloatElem for bf16 {
    type C = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        super::halfconv::bf16_to_f32(self)
    }
    #[inline(always)]
    fn store(c: f32) -> bf16 {
        super::halfconv::f32_to_bf16(c)
    }
}

/// Integer elements: two's-complement arithmetic that wraps, as torch does.
pub trait IntElem: Elem + Ord {
    const ZERO: Self;
    const ONE: Self;
    const MIN: Self;
    const MAX: Self;
    fn wadd(self, o: Self) -> Self;
    fn wsub(self, o: Self) -> Self;
    fn wmul(self, o: Self) -> Self;
    fn wneg(self) -> Self;
    fn wabs(self) -> Self;
    fn sign(self) -> Self;
    /// Quotient rounded toward zero (0 when dividing by zero).
    fn div_trunc(self, o: Self) -> Self;
    /// Quotient rounded toward -inf (0 when dividing by zero).
    fn div_floor(self, o: Self) -> Self;
    /// Remainder with the divisor's sign (0 when dividing by zero).
    fn rem_floor(self, o: Self) -> Self;
    /// Remainder with the dividend's sign (0 when dividing by zero).
    fn rem_trunc(self, o: Self) -> Self;
    fn wpow(self, e: Self) -> Self;
    fn bitnot(self) -> Self;
    fn bitand(self, o: Self) -> Self;
    fn bitor(self, o: Self) -> Self;
    fn bitxor(self, o: Self) -> Self;
}

macro_rules! int_ops {
    ($t:ty, $signed:expr) => {
        impl IntElem for $t {
            const ZERO: Self = 0;
            const ONE: Self = 1;
            const MIN: Self = <$t>::MIN;
            const MAX: Self = <$t>::MAX;
            #[inline]
            fn wadd(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            #[inline]
            fn wsub(self, o: Self) -> Self {
                self.wrapping_sub(o)
            }
            #[inline]
            fn wmul(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            #[inline]
            fn wneg(self) -> Self {
                self.wrapping_neg()
            }
            #[inline]
            #[allow(unused_comparisons)]
            fn wabs(self) -> Self {
                if self < 0 {
                    self.wrapping_neg()
                } else {
                    self
                }
            }
            #[inline]
            #[allow(unused_comparisons)]
            fn sign(self) -> Self {
                if self > 0 {
                    1
                } else if self < 0 {
                    (0 as $t).wrapping_sub(1)
                } else {
                    0
                }
            }
            #[inline]
            fn div_trunc(self, o: Self) -> Self {
                if o == 0 {
                    0
                } else {
                    self.wrapping_div(o)
                }
            }
            #[inline]
            #[allow(unused_comparisons)]
            fn div_floor(self, o: Self) -> Self {
                if o == 0 {
                    return 0;
                }
                let q = self.wrapping_div(o);
                let r = self.wrapping_rem(o);
                if r != 0 && ((r < 0) != (o < 0)) {
                    q.wrapping_sub(1)
                } else {
                    q
                }
            }
            #[inline]
            #[allow(unused_comparisons)]
            fn rem_floor(self, o: Self) -> Self {
                if o == 0 {
                    return 0;
                }
                let r = self.wrapping_rem(o);
                if r != 0 && ((r < 0) != (o < 0)) {
                    r.wrapping_add(o)
                } else {
                    r
                }
            }
            #[inline]
            fn rem_trunc(self, o: Self) -> Self {
                if o == 0 {
                    0
                } else {
                    self.wrapping_rem(o)
                }
            }
            #[inline]
            #[allow(unused_comparisons)]
            fn wpow(self, e: Self) -> Self {
                if e < 0 {
                    // Only ±1 survive a negative exponent (torch's integer pow).
                    return match self as i64 {
                        1 => 1,
                        -1 => {
                            if e.wrapping_rem(2) == 0 {
                                1
                            } else {
                                self
                            }
                        }
                        _ => 0,
                    };
                }
                let (mut base, mut e, mut acc) = (self, e as u64, 1 as $t);
                while e > 0 {
                    if e & 1 == 1 {
                        acc = acc.wrapping_mul(base);
                    }
                    base = base.wrapping_mul(base);
                    e >>= 1;
                }
                acc
            }
            #[inline]
            fn bitnot(self) -> Self {
                !self
            }
            #[inline]
            fn bitand(self, o: Self) -> Self {
                self & o
            }
            #[inline]
            fn bitor(self, o: Self) -> Self {
                self | o
            }
            #[inline]
            fn bitxor(self, o: Self) -> Self {
                self ^ o
            }
        }
    };
}
int_ops!(u8, false);
int_ops!(i8, true);
int_ops!(i16, true);
int_ops!(i32, true);
int_ops!(i64, true);
