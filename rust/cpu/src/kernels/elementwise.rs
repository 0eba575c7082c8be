//! Elementwise ops: unary, binary, where and cast. f16/bf16 compute in f32 and round at the
//! output; integers wrap; bool ops are logical.
//!
//! Each op is stated once, as a typed closure handed to an `Apply*` visitor: `OnVals` maps it
//! over whole strided values (one op, one fresh buffer); the fused kernels (`fused.rs`) map
//! the very same closure over blocks, so fused and unfused results agree bit for bit.

use ember_core::dtype::DType;
use ember_core::ir::{BinaryOp, UnaryOp};
use half::{bf16, f16};

use crate::buffer::Val;
use crate::elem::vecmath::{Fma, Kernel};
use crate::elem::{halfconv, Elem, FloatElem, IntElem, Real, B8};
use crate::error::{CpuError, KResult};
use crate::strided::{chunked, map1, map1_slices, map2, map3};

/// Receives a one-operand elementwise op as a closure over stored element types.
pub trait Apply1 {
    type Out;
    fn apply<A: Copy + Send + Sync, B: Copy + Send + Sync>(
        self,
        out: DType,
        f: impl Fn(A) -> B + Sync,
    ) -> KResult<Self::Out>;
    /// An f32 → f32 op with a vector kernel (only offered where `fma` proves it runs).
    fn apply_kernel(self, kernel: Kernel, fma: Fma) -> KResult<Self::Out>;
}

/// Receives a two-operand elementwise op.
pub trait Apply2 {
    type Out;
    fn apply<A: Copy + Send + Sync, B: Copy + Send + Sync, C: Copy + Send + Sync>(
        self,
        out: DType,
        f: impl Fn(A, B) -> C + Sync,
    ) -> KResult<Self::Out>;
}

/// Receives a three-operand elementwise op (`where`).
pub trait Apply3 {
    type Out;
    fn apply<
        A: Copy + Send + Sync,
        B: Copy + Send + Sync,
        C: Copy + Send + Sync,
        D: Copy + Send + Sync,
    >(
        self,
        out: DType,
        f: impl Fn(A, B, C) -> D + Sync,
    ) -> KResult<Self::Out>;
}

/// Maps an op over whole values into a fresh contiguous buffer.
pub struct OnVals<'a, const N: usize>(pub [&'a Val; N]);

impl Apply1 for OnVals<'_, 1> {
    type Out = Val;
    fn apply<A: Copy + Send + Sync, B: Copy + Send + Sync>(
        self,
        out: DType,
        f: impl Fn(A) -> B + Sync,
    ) -> KResult<Val> {
        let [x] = self.0;
        let v = x.view::<A>()?;
        Val::build::<B>(out, x.shape(), |o| {
            map1(&v, o, f);
            Ok(())
        })
    }

    fn apply_kernel(self, kernel: Kernel, fma: Fma) -> KResult<Val> {
        let [x] = self.0;
        let v = x.view::<f32>()?;
        Val::build::<f32>(DType::F32, x.shape(), |o| {
            map1_slices(&v, o, |a, o| fma.run(kernel, a, o));
            Ok(())
        })
    }
}

impl Apply2 for OnVals<'_, 2> {
    type Out = Val;
    fn apply<A: Copy + Send + Sync, B: Copy + Send + Sync, C: Copy + Send + Sync>(
        self,
        out: DType,
        f: impl Fn(A, B) -> C + Sync,
    ) -> KResult<Val> {
        let [a, b] = self.0;
        let (x, y) = (a.view::<A>()?, b.view::<B>()?);
        Val::build::<C>(out, a.shape(), |o| {
            map2(&x, &y, o, f);
            Ok(())
        })
    }
}

impl Apply3 for OnVals<'_, 3> {
    type Out = Val;
    fn apply<
        A: Copy + Send + Sync,
        B: Copy + Send + Sync,
        C: Copy + Send + Sync,
        D: Copy + Send + Sync,
    >(
        self,
        out: DType,
        f: impl Fn(A, B, C) -> D + Sync,
    ) -> KResult<Val> {
        let [c, a, b] = self.0;
        let (x, y, z) = (c.view::<A>()?, a.view::<B>()?, b.view::<C>()?);
        Val::build::<D>(out, a.shape(), |o| {
            map3(&x, &y, &z, o, f);
            Ok(())
        })
    }
}

fn unsupported(op: &str, dtype: DType) -> CpuError {
    CpuError::Unsupported(format!("{op} is not defined on {dtype}"))
}

pub fn unary(op: UnaryOp, x: &Val) -> KResult<Val> {
    unary_with(op, x.dtype, OnVals([x]))
}

/// Hands `op` on `dtype` to `k` as a closure.
pub fn unary_with<K: Apply1>(op: UnaryOp, dtype: DType, k: K) -> KResult<K::Out> {
    match dtype {
        DType::F16 => unary_float::<f16, K>(op, k),
        DType::BF16 => unary_float::<bf16, K>(op, k),
        DType::F32 => unary_float::<f32, K>(op, k),
        DType::F64 => unary_float::<f64, K>(op, k),
        DType::U8 => unary_int::<u8, K>(op, k),
        DType::I8 => unary_int::<i8, K>(op, k),
        DType::I16 => unary_int::<i16, K>(op, k),
        DType::I32 => unary_int::<i32, K>(op, k),
        DType::I64 => unary_int::<i64, K>(op, k),
        DType::Bool => unary_bool(op, k),
    }
}

fn unary_float<T: FloatElem, K: Apply1>(op: UnaryOp, k: K) -> KResult<K::Out> {
    macro_rules! f {
        ($f:expr) => {
            k.apply(T::DTYPE, |a: T| T::store($f(a.load())))
        };
    }
    macro_rules! b {
        ($f:expr) => {
            k.apply(DType::Bool, |a: T| B8::new($f(a.load())))
        };
    }
    // f32 transcendentals run a vector kernel where the CPU has one (`vecmath`); the
    // closure is the same approximation element by element.
    macro_rules! v {
        ($kernel:expr, $f:expr) => {
            match (T::DTYPE, Fma::detect()) {
                (DType::F32, Some(fma)) => k.apply_kernel($kernel, fma),
                _ => f!($f),
            }
        };
    }
    let (zero, one) = (<T::C as Real>::ZERO, <T::C as Real>::ONE);
    let of = <T::C as Real>::of;
    use UnaryOp::*;
    match op {
        Neg => f!(|c: T::C| -c),
        Abs => f!(|c: T::C| c.abs()),
        Sign => f!(|c: T::C| if c > zero {
            one
        } else if c < zero {
            -one
        } else {
            c
        }),
        Floor => f!(|c: T::C| c.floor()),
        Ceil => f!(|c: T::C| c.ceil()),
        Round => f!(|c: T::C| c.round_even()),
        Trunc => f!(|c: T::C| c.trunc()),
        Exp => v!(Kernel::Exp, |c: T::C| c.fast_exp()),
        Expm1 => v!(Kernel::Expm1, |c: T::C| c.exp_m1()),
        Log => v!(Kernel::Log, |c: T::C| c.ln()),
        Log1p => v!(Kernel::Log1p, |c: T::C| c.ln_1p()),
        Sqrt => f!(|c: T::C| c.sqrt()),
        Rsqrt => f!(|c: T::C| one / c.sqrt()),
        Recip => f!(|c: T::C| one / c),
        Sin => v!(Kernel::Sin, |c: T::C| c.sin()),
        Cos => v!(Kernel::Cos, |c: T::C| c.cos()),
        Tan => v!(Kernel::Tan, |c: T::C| c.tan()),
        Tanh => v!(Kernel::Tanh, |c: T::C| c.fast_tanh()),
        Sigmoid => v!(Kernel::Sigmoid, |c: T::C| c.fast_sigmoid()),
        Erf => v!(Kernel::Erf, |c: T::C| c.erf()),
        Gelu => v!(Kernel::Gelu, |c: T::C| c.fast_gelu()),
        GeluTanh => {
            let (half, k3, a) = (
                of(0.5),
                of((2.0 / std::f64::consts::PI).sqrt()),
                of(0.044715),
            );
            v!(Kernel::GeluTanh, |c: T::C| half
                * c
                * (one + (k3 * (c + a * c * c * c)).fast_tanh()))
        }
        Silu => v!(Kernel::Silu, |c: T::C| c * c.fast_sigmoid()),
        Relu => f!(|c: T::C| if c < zero { zero } else { c }),
        Not => b!(|c: T::C| c == zero),
        IsNan => b!(|c: T::C| c.is_nan()),
        IsInf => b!(|c: T::C| c.is_infinite()),
        BitNot => Err(unsupported(op.name(), T::DTYPE)),
    }
}

fn unary_int<T: IntElem, K: Apply1>(op: UnaryOp, k: K) -> KResult<K::Out> {
    macro_rules! f {
        ($f:expr) => {
            k.apply(T::DTYPE, $f)
        };
    }
    macro_rules! b {
        ($f:expr) => {
            k.apply(DType::Bool, $f)
        };
    }
    use UnaryOp::*;
    match op {
        Neg => f!(|a: T| a.wneg()),
        Abs => f!(|a: T| a.wabs()),
        Sign => f!(|a: T| a.sign()),
        Floor | Ceil | Round | Trunc => f!(|a: T| a),
        Relu => f!(|a: T| a.max(T::ZERO)),
        BitNot => f!(|a: T| a.bitnot()),
        Not => b!(|a: T| B8::new(a == T::ZERO)),
        IsNan | IsInf => b!(|_: T| B8(0)),
        _ => Err(unsupported(op.name(), T::DTYPE)),
    }
}

fn unary_bool<K: Apply1>(op: UnaryOp, k: K) -> KResult<K::Out> {
    let f = |f: fn(bool) -> bool| k.apply(DType::Bool, move |a: B8| B8::new(f(a.get())));
    use UnaryOp::*;
    match op {
        Neg | Abs | Sign | Floor | Ceil | Round | Trunc | Relu => f(|a| a),
        Not | BitNot => f(|a| !a),
        IsNan | IsInf => f(|_| false),
        _ => Err(unsupported(op.name(), DType::Bool)),
    }
}

pub fn binary(op: BinaryOp, a: &Val, b: &Val) -> KResult<Val> {
    if a.shape() != b.shape() || a.dtype != b.dtype {
        return Err(CpuError::Shape(format!(
            "operands {} {:?} and {} {:?} differ",
            a.dtype,
            a.shape(),
            b.dtype,
            b.shape()
        )));
    }
    binary_with(op, a.dtype, OnVals([a, b]))
}

/// Hands `op` on operands of `dtype` to `k` as a closure.
pub fn binary_with<K: Apply2>(op: BinaryOp, dtype: DType, k: K) -> KResult<K::Out> {
    match dtype {
        DType::F16 => binary_float::<f16, K>(op, k),
        DType::BF16 => binary_float::<bf16, K>(op, k),
        DType::F32 => binary_float::<f32, K>(op, k),
        DType::F64 => binary_float::<f64, K>(op, k),
        DType::U8 => binary_int::<u8, K>(op, k),
        DType::I8 => binary_int::<i8, K>(op, k),
        DType::I16 => binary_int::<i16, K>(op, k),
        DType::I32 => binary_int::<i32, K>(op, k),
        DType::I64 => binary_int::<i64, K>(op, k),
        DType::Bool => binary_bool(op, k),
    }
}

fn binary_float<T: FloatElem, K: Apply2>(op: BinaryOp, k: K) -> KResult<K::Out> {
    macro_rules! f {
        ($f:expr) => {
            k.apply(T::DTYPE, |p: T, q: T| T::store($f(p.load(), q.load())))
        };
    }
    macro_rules! cmp {
        ($f:expr) => {
            k.apply(DType::Bool, |p: T, q: T| B8::new($f(p.load(), q.load())))
        };
    }
    // Ops whose rounding matters are done in f64, as the reference interpreter does.
    let wide =
        |g: fn(f64, f64) -> f64| move |p: T::C, q: T::C| <T::C as Real>::of(g(p.f64(), q.f64()));
    use BinaryOp::*;
    match op {
        Add => f!(|p: T::C, q: T::C| p + q),
        Sub => f!(|p: T::C, q: T::C| p - q),
        Mul => f!(|p: T::C, q: T::C| p * q),
        Div => f!(|p: T::C, q: T::C| p / q),
        FloorDiv => f!(wide(|p, q| (p / q).floor())),
        Pow => f!(wide(f64::powf)),
        Rem => f!(wide(|p, q| p - (p / q).floor() * q)),
        Fmod => f!(|p: T::C, q: T::C| p.fmod(q)),
        // NaN wins (as in torch): a NaN q fails the comparison and is picked, a NaN p is
        // picked by the second select. Two selects the vectorizer keeps (a branch on
        // `is_nan` first made the loop scalar, 4× slower).
        Max => f!(|p: T::C, q: T::C| {
            let m = if p > q { p } else { q };
            if p.is_nan() {
                p
            } else {
                m
            }
        }),
        Min => f!(|p: T::C, q: T::C| {
            let m = if p < q { p } else { q };
            if p.is_nan() {
                p
            } else {
                m
            }
        }),
        Atan2 => f!(|p: T::C, q: T::C| p.atan2(q)),
        Eq => cmp!(|p: T::C, q: T::C| p == q),
        Ne => cmp!(|p: T::C, q: T::C| p != q),
        Lt => cmp!(|p: T::C, q: T::C| p < q),
        Le => cmp!(|p: T::C, q: T::C| p <= q),
        Gt => cmp!(|p: T::C, q: T::C| p > q),
        Ge => cmp!(|p: T::C, q: T::C| p >= q),
        And | Or | Xor => Err(unsupported(op.name(), T::DTYPE)),
    }
}

fn binary_int<T: IntElem, K: Apply2>(op: BinaryOp, k: K) -> KResult<K::Out> {
    macro_rules! f {
        ($f:expr) => {
            k.apply(T::DTYPE, $f)
        };
    }
    macro_rules! cmp {
        ($f:expr) => {
            k.apply(DType::Bool, |p: T, q: T| B8::new($f(p, q)))
        };
    }
    use BinaryOp::*;
    match op {
        Add => f!(|p: T, q: T| p.wadd(q)),
        Sub => f!(|p: T, q: T| p.wsub(q)),
        Mul => f!(|p: T, q: T| p.wmul(q)),
        Div => f!(|p: T, q: T| p.div_trunc(q)),
        FloorDiv => f!(|p: T, q: T| p.div_floor(q)),
        Pow => f!(|p: T, q: T| p.wpow(q)),
        Rem => f!(|p: T, q: T| p.rem_floor(q)),
        Fmod => f!(|p: T, q: T| p.rem_trunc(q)),
        Max => f!(|p: T, q: T| p.max(q)),
        Min => f!(|p: T, q: T| p.min(q)),
        And => f!(|p: T, q: T| p.bitand(q)),
        Or => f!(|p: T, q: T| p.bitor(q)),
        Xor => f!(|p: T, q: T| p.bitxor(q)),
        Eq => cmp!(|p: T, q: T| p == q),
        Ne => cmp!(|p: T, q: T| p != q),
        Lt => cmp!(|p: T, q: T| p < q),
        Le => cmp!(|p: T, q: T| p <= q),
        Gt => cmp!(|p: T, q: T| p > q),
        Ge => cmp!(|p: T, q: T| p >= q),
        Atan2 => Err(unsupported(op.name(), T::DTYPE)),
    }
}

fn binary_bool<K: Apply2>(op: BinaryOp, k: K) -> KResult<K::Out> {
    let f = |f: fn(bool, bool) -> bool| {
        k.apply(DType::Bool, move |p: B8, q: B8| {
            B8::new(f(p.get(), q.get()))
        })
    };
    // Bool arithmetic is integer arithmetic on 0/1 with the result tested against zero.
    use BinaryOp::*;
    match op {
        Add | Or | Max => f(|p, q| p | q),
        Mul | And | Min | Div | FloorDiv => f(|p, q| p & q),
        Sub | Xor | Ne => f(|p, q| p ^ q),
        Pow => f(|p, q| p | !q),
        Rem | Fmod => f(|_, _| false),
        Eq => f(|p, q| p == q),
        Lt => f(|p, q| !p & q),
        Le => f(|p, q| p <= q),
        Gt => f(|p, q| p & !q),
        Ge => f(|p, q| p >= q),
        Atan2 => Err(unsupported(op.name(), DType::Bool)),
    }
}

pub fn where_(c: &Val, a: &Val, b: &Val) -> KResult<Val> {
    if c.shape() != a.shape() || a.shape() != b.shape() || a.dtype != b.dtype {
        return Err(CpuError::Shape("where operands differ".into()));
    }
    where_with(a.dtype, OnVals([c, a, b]))
}

/// Hands `where` with branches of `dtype` to `k` (operands: cond, a, b).
pub fn where_with<K: Apply3>(dtype: DType, k: K) -> KResult<K::Out> {
    crate::with_size!(dtype, U => {
        k.apply(dtype, |c: B8, p: U, q: U| if c.get() { p } else { q })
    })
}

pub fn cast(x: &Val, to: DType) -> KResult<Val> {
    if x.dtype == to {
        return Ok(x.clone());
    }
    // Contiguous f16 ↔ f32 by whole vectors (F16C): the same values, several times faster.
    let by_vectors = || x.layout.is_contiguous() && halfconv::f16_vectors();
    match (x.dtype, to) {
        (DType::F16, DType::F32) if by_vectors() => {
            let src = x.view::<f16>()?;
            Val::build::<f32>(to, x.shape(), |o| {
                chunked(o, |at, o| {
                    halfconv::widen_f16(src.run(at as isize, o.len()), o)
                });
                Ok(())
            })
        }
        (DType::F32, DType::F16) if by_vectors() => {
            let src = x.view::<f32>()?;
            Val::build::<f16>(to, x.shape(), |o| {
                chunked(o, |at, o| {
                    halfconv::narrow_f16(src.run(at as isize, o.len()), o)
                });
                Ok(())
            })
        }
        _ => cast_with(x.dtype, to, OnVals([x])),
    }
}

/// Hands the cast from `from` to `to` to `k` (a copy when they are equal).
pub fn cast_with<K: Apply1>(from: DType, to: DType, k: K) -> KResult<K::Out> {
    if from == to {
        return crate::with_size!(from, U => k.apply(to, |x: U| x));
    }
    crate::with_dtype!(from, S => {
        crate::with_dtype!(to, D => k.apply(to, |s: S| D::cast_from(s)))
    })
}
