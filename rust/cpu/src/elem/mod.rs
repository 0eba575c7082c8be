//! Element types: one Rust type per `DType`, the IR's conversion rules, float math done in
//! f32 (for f16/bf16/f32) or f64, and wrapping integer arithmetic.

use ember_core::dtype::DType;
use half::{bf16, f16};

/// A bool element as stored in memory (one byte; any non-zero byte reads as true).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
#[repr(transparent)]
pub struct B8(pub u8);

impl B8 {
    #[inline]
    pub fn get(self) -> bool {
        self.0 != 0
    }
    #[inline]
    pub fn new(b: bool) -> B8 {
        B8(b as u8)
    }
}

/// The slice as f32 when `T` is f32 itself (for kernels written for f32 only).
pub fn as_f32<T: 'static>(s: &[T]) -> Option<&[f32]> {
    // SAFETY: T is f32.
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>())
        .then(|| unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len()) })
}

/// The slice as bf16 when `T` is bf16 itself.
pub fn as_bf16<T: 'static>(s: &[T]) -> Option<&[bf16]> {
    // SAFETY: T is bf16.
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<bf16>())
        .then(|| unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len()) })
}

/// `as_f32` of a mutable slice.
pub fn as_f32_mut<T: 'static>(s: &mut [T]) -> Option<&mut [f32]> {
    // SAFETY: T is f32.
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>())
        .then(|| unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), s.len()) })
}

/// A storable element. Every bit pattern is a valid value (buffers start zeroed).
pub trait Elem:
    Copy + Send + Sync + Default + PartialEq + PartialOrd + std::fmt::Debug + 'static
{
    const DTYPE: DType;
    const IS_FLOAT: bool;
    fn to_f64(self) -> f64;
    fn to_i64(self) -> i64;
    /// Float → this type: integers truncate toward zero (and wrap), bool is `v != 0`.
    fn from_f64(v: f64) -> Self;
    /// Integer → this type: integers wrap, floats round to nearest, bool is `v != 0`.
    fn from_i64(v: i64) -> Self;

    /// The IR's `Cast` from another element type.
    #[inline]
    fn cast_from<S: Elem>(s: S) -> Self {
        if S::DTYPE == DType::F32 && !Self::IS_FLOAT && Self::DTYPE != DType::Bool {
            // SAFETY: S is f32 (its dtype says so).
            let v: f32 = unsafe { std::mem::transmute_copy(&s) };
            // Straight from f32, the same value as through f64.
            return match Self::DTYPE {
                DType::I64 => Self::from_i64(v as i64),
                _ => Self::from_i64(i64::from(saturate_to_i32(v))),
            };
        }
        if S::IS_FLOAT || Self::IS_FLOAT {
            Self::from_f64(s.to_f64())
        } else {
            Self::from_i64(s.to_i64())
        }
    }
}

/// `v as i32` (truncated, saturated, NaN → 0) in selects around an unchecked conversion,
/// which the vectorizer keeps: Rust's saturating `as` made casts to integers 3–10× slower.
#[inline(always)]
pub fn saturate_to_i32(v: f32) -> i32 {
    const LOW: f32 = -2_147_483_648.0; // -2³¹
    const HIGH: f32 = 2_147_483_520.0; // the largest f32 below 2³¹
    let c = if v > LOW { v } else { LOW };
    let c = if c < HIGH { c } else { HIGH };
    // SAFETY: c is finite (NaN went to LOW) and inside i32's range.
    let i = unsafe { c.to_int_unchecked::<i32>() };
    let i = if v >= 2_147_483_648.0 { i32::MAX } else { i };
    if v.is_nan() {
        0
    } else {
        i
    }
}

impl Elem for B8 {
    const DTYPE: DType = DType::Bool;
    const IS_FLOAT: bool = false;
    #[inline]
    fn to_f64(self) -> f64 {
        self.get() as u8 as f64
    }
    #[inline]
    fn to_i64(self) -> i64 {
        self.get() as i64
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        B8::new(v != 0.0)
    }
    #[inline]
    fn from_i64(v: i64) -> Self {
        B8::new(v != 0)
    }
}

macro_rules! int_elem {
    ($t:ty, $d:ident) => {
        impl Elem for $t {
            const DTYPE: DType = DType::$d;
            const IS_FLOAT: bool = false;
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn to_i64(self) -> i64 {
                self as i64
            }
            #[inline]
            fn from_f64(v: f64) -> Self {
                // Truncated and saturated to int32 (int64 for int64), then wrapped: the
                // IR's float → integer `Cast`.
                match DType::$d {
                    DType::I64 => v as i64 as $t,
                    _ => v as i32 as $t,
                }
            }
            #[inline]
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    };
}
int_elem!(u8, U8);
int_elem!(i8, I8);
int_elem!(i16, I16);
int_elem!(i32, I32);
int_elem!(i64, I64);

impl Elem for f32 {
    const DTYPE: DType = DType::F32;
    const IS_FLOAT: bool = true;
    #[inline]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline]
    fn to_i64(self) -> i64 {
        self as i64
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    #[inline]
    fn from_i64(v: i64) -> Self {
        v as f32
    }
}

impl Elem for f64 {
    const DTYPE: DType = DType::F64;
    const IS_FLOAT: bool = true;
    #[inline]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline]
    fn to_i64(self) -> i64 {
        self as i64
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        v
    }
    #[inline]
    fn from_i64(v: i64) -> Self {
        v as f64
    }
}

// Conversions through f32 by `halfconv` (exact widening; one rounding to the half type, as
// torch converts doubles), so that cast loops vectorize.
macro_rules! half_elem {
    ($t:ty, $d:ident, $widen:path, $narrow:path) => {
        impl Elem for $t {
            const DTYPE: DType = DType::$d;
            const IS_FLOAT: bool = true;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                $widen(self) as f64
            }
            #[inline(always)]
            fn to_i64(self) -> i64 {
                $widen(self) as i64
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                $narrow(v as f32)
            }
            #[inline(always)]
            fn from_i64(v: i64) -> Self {
                $narrow(v as f32)
            }
        }
    };
}
half_elem!(f16, F16, halfconv::f16_to_f32, halfconv::f32_to_f16);
half_elem!(bf16, BF16, halfconv::bf16_to_f32, halfconv::f32_to_bf16);

mod fastmath;
pub mod halfconv;
mod math;
pub mod vecmath;

pub use math::{FloatElem, IntElem, Real};

/// Runs `$body` with `$T` bound to the element type of `$dt`.
#[macro_export]
macro_rules! with_dtype {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            ember_core::dtype::DType::Bool => {
                type $T = $crate::elem::B8;
                $body
            }
            ember_core::dtype::DType::U8 => {
                type $T = u8;
                $body
            }
            ember_core::dtype::DType::I8 => {
                type $T = i8;
                $body
            }
            ember_core::dtype::DType::I16 => {
                type $T = i16;
                $body
            }
            ember_core::dtype::DType::I32 => {
                type $T = i32;
                $body
            }
            ember_core::dtype::DType::I64 => {
                type $T = i64;
                $body
            }
            ember_core::dtype::DType::F16 => {
                type $T = half::f16;
                $body
            }
            ember_core::dtype::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            ember_core::dtype::DType::F32 => {
                type $T = f32;
                $body
            }
            ember_core::dtype::DType::F64 => {
                type $T = f64;
                $body
            }
        }
    };
}

/// Runs `$body` with `$T` an unsigned integer type of `$dt`'s size (for moving bits).
#[macro_export]
macro_rules! with_size {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt.size() {
            1 => {
                type $T = u8;
                $body
            }
            2 => {
                type $T = u16;
                $body
            }
            4 => {
                type $T = u32;
                $body
            }
            _ => {
                type $T = u64;
                $body
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saturate_to_i32_is_rusts_cast() {
        let edges = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            3e9,
            -3e9,
            2_147_483_520.0,
            2_147_483_648.0,
            -2_147_483_648.0,
            1.9,
            -1.9,
            0.0,
            -0.0,
            255.5,
            -0.7,
            1e20,
            -1e20,
        ];
        for v in edges {
            assert_eq!(saturate_to_i32(v), v as i32, "{v}");
        }
    }
}
