//! Elementwise ops: unary, binary, where and cast, on strided operands. f16/bf16 compute in
//! f32 and round at the output; integers wrap; bool ops are logical.

use ember_core::dtype::DType;
use ember_core::ir::{BinaryOp, UnaryOp};
use half::{bf16, f16};

use crate::buffer::Val;
use crate::elem::{Elem, FloatElem, IntElem, Real, B8};
use crate::error::{CpuError, KResult};
use crate::strided::{map1, map2, map3};

fn unsupported(op: &str, dtype: DType) -> CpuError {
    CpuError::Unsupported(format!("{op} is not defined on {dtype}"))
}

pub fn unary(op: UnaryOp, x: &Val) -> KResult<Val> {
    match x.dtype {
        DType::F16 => unary_float::<f16>(op, x),
        DType::BF16 => unary_float::<bf16>(op, x),
        DType::F32 => unary_float::<f32>(op, x),
        DType::F64 => unary_float::<f64>(op, x),
        DType::U8 => unary_int::<u8>(op, x),
        DType::I8 => unary_int::<i8>(op, x),
        DType::I16 => unary_int::<i16>(op, x),
        DType::I32 => unary_int::<i32>(op, x),
        DType::I64 => unary_int::<i64>(op, x),
        DType::Bool => unary_bool(op, x),
    }
}

fn unary_float<T: FloatElem>(op: UnaryOp, x: &Val) -> KResult<Val> {
    let v = x.view::<T>()?;
    let shape = x.shape();
    macro_rules! f {
        ($f:expr) => {
            Val::build::<T>(T::DTYPE, shape, |o| {
                map1(&v, o, |a: T| T::store($f(a.load())));
                Ok(())
            })
        };
    }
    macro_rules! b {
        ($f:expr) => {
            Val::build::<B8>(DType::Bool, shape, |o| {
                map1(&v, o, |a: T| B8::new($f(a.load())));
                Ok(())
            })
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
        Exp => f!(|c: T::C| c.exp()),
        Expm1 => f!(|c: T::C| c.exp_m1()),
        Log => f!(|c: T::C| c.ln()),
        Log1p => f!(|c: T::C| c.ln_1p()),
        Sqrt => f!(|c: T::C| c.sqrt()),
        Rsqrt => f!(|c: T::C| one / c.sqrt()),
        Recip => f!(|c: T::C| one / c),
        Sin => f!(|c: T::C| c.sin()),
        Cos => f!(|c: T::C| c.cos()),
        Tan => f!(|c: T::C| c.tan()),
        Tanh => f!(|c: T::C| c.tanh()),
        Sigmoid => f!(|c: T::C| one / (one + (-c).exp())),
        Erf => f!(|c: T::C| c.erf()),
        Gelu => {
            let (half, rs2) = (of(0.5), of(std::f64::consts::FRAC_1_SQRT_2));
            f!(|c: T::C| c * half * (one + (c * rs2).erf()))
        }
        GeluTanh => {
            let (half, k, a) = (
                of(0.5),
                of((2.0 / std::f64::consts::PI).sqrt()),
                of(0.044715),
            );
            f!(|c: T::C| half * c * (one + (k * (c + a * c * c * c)).tanh()))
        }
        Silu => f!(|c: T::C| c * (one / (one + (-c).exp()))),
        Relu => f!(|c: T::C| if c < zero { zero } else { c }),
        Not => b!(|c: T::C| c == zero),
        IsNan => b!(|c: T::C| c.is_nan()),
        IsInf => b!(|c: T::C| c.is_infinite()),
        BitNot => Err(unsupported(op.name(), x.dtype)),
    }
}

fn unary_int<T: IntElem>(op: UnaryOp, x: &Val) -> KResult<Val> {
    let v = x.view::<T>()?;
    let shape = x.shape();
    macro_rules! f {
        ($f:expr) => {
            Val::build::<T>(T::DTYPE, shape, |o| {
                map1(&v, o, $f);
                Ok(())
            })
        };
    }
    macro_rules! b {
        ($f:expr) => {
            Val::build::<B8>(DType::Bool, shape, |o| {
                map1(&v, o, $f);
                Ok(())
            })
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
        _ => Err(unsupported(op.name(), x.dtype)),
    }
}

fn unary_bool(op: UnaryOp, x: &Val) -> KResult<Val> {
    let v = x.view::<B8>()?;
    let f = |f: fn(bool) -> bool| {
        Val::build::<B8>(DType::Bool, x.shape(), |o| {
            map1(&v, o, |a: B8| B8::new(f(a.get())));
            Ok(())
        })
    };
    use UnaryOp::*;
    match op {
        Neg | Abs | Sign | Floor | Ceil | Round | Trunc | Relu => f(|a| a),
        Not | BitNot => f(|a| !a),
        IsNan | IsInf => f(|_| false),
        _ => Err(unsupported(op.name(), x.dtype)),
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
    match a.dtype {
        DType::F16 => binary_float::<f16>(op, a, b),
        DType::BF16 => binary_float::<bf16>(op, a, b),
        DType::F32 => binary_float::<f32>(op, a, b),
        DType::F64 => binary_float::<f64>(op, a, b),
        DType::U8 => binary_int::<u8>(op, a, b),
        DType::I8 => binary_int::<i8>(op, a, b),
        DType::I16 => binary_int::<i16>(op, a, b),
        DType::I32 => binary_int::<i32>(op, a, b),
        DType::I64 => binary_int::<i64>(op, a, b),
        DType::Bool => binary_bool(op, a, b),
    }
}

fn binary_float<T: FloatElem>(op: BinaryOp, a: &Val, b: &Val) -> KResult<Val> {
    let (x, y) = (a.view::<T>()?, b.view::<T>()?);
    let shape = a.shape();
    macro_rules! f {
        ($f:expr) => {
            Val::build::<T>(T::DTYPE, shape, |o| {
                map2(&x, &y, o, |p: T, q: T| T::store($f(p.load(), q.load())));
                Ok(())
            })
        };
    }
    macro_rules! cmp {
        ($f:expr) => {
            Val::build::<B8>(DType::Bool, shape, |o| {
                map2(&x, &y, o, |p: T, q: T| B8::new($f(p.load(), q.load())));
                Ok(())
            })
        };
    }
    // Ops whose rounding matters are done in f64, as the reference interpreter does.
    let wide =
        |g: fn(f64, f64) -> f64| move |p: T::C, q: T::C| <T::C as Real>::of(g(p.f64(), q.f64()));
    let nan = <T::C as Real>::NAN;
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
        Max => f!(|p: T::C, q: T::C| if p.is_nan() || q.is_nan() {
            nan
        } else if p > q {
            p
        } else {
            q
        }),
        Min => f!(|p: T::C, q: T::C| if p.is_nan() || q.is_nan() {
            nan
        } else if p < q {
            p
        } else {
            q
        }),
        Atan2 => f!(|p: T::C, q: T::C| p.atan2(q)),
        Eq => cmp!(|p: T::C, q: T::C| p == q),
        Ne => cmp!(|p: T::C, q: T::C| p != q),
        Lt => cmp!(|p: T::C, q: T::C| p < q),
        Le => cmp!(|p: T::C, q: T::C| p <= q),
        Gt => cmp!(|p: T::C, q: T::C| p > q),
        Ge => cmp!(|p: T::C, q: T::C| p >= q),
        And | Or | Xor => Err(unsupported(op.name(), a.dtype)),
    }
}

fn binary_int<T: IntElem>(op: BinaryOp, a: &Val, b: &Val) -> KResult<Val> {
    let (x, y) = (a.view::<T>()?, b.view::<T>()?);
    let shape = a.shape();
    macro_rules! f {
        ($f:expr) => {
            Val::build::<T>(T::DTYPE, shape, |o| {
                map2(&x, &y, o, $f);
                Ok(())
            })
        };
    }
    macro_rules! cmp {
        ($f:expr) => {
            Val::build::<B8>(DType::Bool, shape, |o| {
                map2(&x, &y, o, |p: T, q: T| B8::new($f(p, q)));
                Ok(())
            })
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
        Atan2 => Err(unsupported(op.name(), a.dtype)),
    }
}

fn binary_bool(op: BinaryOp, a: &Val, b: &Val) -> KResult<Val> {
    let (x, y) = (a.view::<B8>()?, b.view::<B8>()?);
    let f = |f: fn(bool, bool) -> bool| {
        Val::build::<B8>(DType::Bool, a.shape(), |o| {
            map2(&x, &y, o, |p: B8, q: B8| B8::new(f(p.get(), q.get())));
            Ok(())
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
        Atan2 => Err(unsupported(op.name(), a.dtype)),
    }
}

pub fn where_(c: &Val, a: &Val, b: &Val) -> KResult<Val> {
    if c.shape() != a.shape() || a.shape() != b.shape() || a.dtype != b.dtype {
        return Err(CpuError::Shape("where operands differ".into()));
    }
    let cv = c.view::<B8>()?;
    crate::with_size!(a.dtype, U => {
        let (x, y) = (a.view::<U>()?, b.view::<U>()?);
        Val::build::<U>(a.dtype, a.shape(), |o| {
            map3(&cv, &x, &y, o, |c: B8, p: U, q: U| if c.get() { p } else { q });
            Ok(())
        })
    })
}

pub fn cast(x: &Val, to: DType) -> KResult<Val> {
    if x.dtype == to {
        return Ok(x.clone());
    }
    crate::with_dtype!(x.dtype, S => {
        let v = x.view::<S>()?;
        crate::with_dtype!(to, D => Val::build::<D>(to, x.shape(), |o| {
            map1(&v, o, |s: S| D::cast_from(s));
            Ok(())
        }))
    })
}
