//! Elementwise ops: unary, binary, where and cast, with docs/IR.md's rounding rules.

use super::erf::erf;
use super::value::{Data, Value};
use super::R;
use crate::dtype::DType;
use crate::ir::{BinaryOp, UnaryOp};

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// A unary op on a float.
fn unary_f(op: UnaryOp, x: f64) -> R<f64> {
    use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_PI};
    use UnaryOp::*;
    let b = |c: bool| if c { 1.0 } else { 0.0 };
    Ok(match op {
        Neg => -x,
        Abs => x.abs(),
        // ±0 and NaN stay as they are.
        Sign => {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                x
            }
        }
        Floor => x.floor(),
        Ceil => x.ceil(),
        Round => x.round_ties_even(),
        Trunc => x.trunc(),
        Exp => x.exp(),
        Expm1 => x.exp_m1(),
        Log => x.ln(),
        Log1p => x.ln_1p(),
        Sqrt => x.sqrt(),
        Rsqrt => 1.0 / x.sqrt(),
        Recip => 1.0 / x,
        Sin => x.sin(),
        Cos => x.cos(),
        Tan => x.tan(),
        Tanh => x.tanh(),
        Sigmoid => sigmoid(x),
        Erf => erf(x),
        Gelu => x * 0.5 * (1.0 + erf(x * FRAC_1_SQRT_2)),
        GeluTanh => 0.5 * x * (1.0 + (FRAC_2_PI.sqrt() * (x + 0.044715 * x * x * x)).tanh()),
        Silu => x * sigmoid(x),
        // NaN stays NaN.
        Relu => {
            if x < 0.0 {
                0.0
            } else {
                x
            }
        }
        Not => b(x == 0.0),
        IsNan => b(x.is_nan()),
        IsInf => b(x.is_infinite()),
        BitNot => return Err("bitnot needs an integer or bool input".into()),
    })
}

/// A unary op on an integer or bool (`is_bool`); float-only ops are rejected beforehand.
fn unary_i(op: UnaryOp, x: i64, is_bool: bool) -> i64 {
    use UnaryOp::*;
    match op {
        Neg => x.wrapping_neg(),
        Abs => x.wrapping_abs(),
        Sign => x.signum(),
        Relu => x.max(0),
        Not => (x == 0) as i64,
        BitNot if is_bool => (x == 0) as i64,
        BitNot => !x,
        IsNan | IsInf => 0,
        // floor, ceil, round, trunc are the identity on integers.
        _ => x,
    }
}

pub(crate) fn unary(op: UnaryOp, x: &Value) -> R<Value> {
    let dtype = if op.returns_bool() {
        DType::Bool
    } else {
        x.dtype
    };
    let data = match &x.data {
        Data::F(v) => Data::F(v.iter().map(|&a| unary_f(op, a)).collect::<R<_>>()?),
        Data::I(v) => {
            if op.needs_float() {
                return Err(format!(
                    "{} needs a float input, got {}",
                    op.name(),
                    x.dtype
                ));
            }
            let is_bool = x.dtype == DType::Bool;
            Data::I(v.iter().map(|&a| unary_i(op, a, is_bool)).collect())
        }
    };
    Ok(Value::from_data(dtype, x.shape.clone(), data))
}

/// Floor division of floats, as torch computes it (exact floor of the true quotient).
fn floordiv_f(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        return a / b;
    }
    let m = a % b;
    let mut div = (a - m) / b;
    if m != 0.0 && ((b < 0.0) != (m < 0.0)) {
        div -= 1.0;
    }
    if div != 0.0 {
        let mut f = div.floor();
        if div - f > 0.5 {
            f += 1.0;
        }
        f
    } else {
        0.0f64.copysign(a / b)
    }
}

/// Remainder with the sign of the divisor (Python `%`), computed exactly through fmod.
fn rem_f(a: f64, b: f64) -> f64 {
    let m = a % b;
    if m != 0.0 && ((b < 0.0) != (m < 0.0)) {
        m + b
    } else {
        m
    }
}

fn binary_f(op: BinaryOp, a: f64, b: f64) -> f64 {
    use BinaryOp::*;
    let t = |c: bool| if c { 1.0 } else { 0.0 };
    match op {
        Add => a + b,
        Sub => a - b,
        Mul => a * b,
        Div => a / b,
        FloorDiv => floordiv_f(a, b),
        Pow => a.powf(b),
        Rem => rem_f(a, b),
        Fmod => a % b,
        Max | Min if a.is_nan() || b.is_nan() => f64::NAN,
        Max => {
            if b > a {
                b
            } else {
                a
            }
        }
        Min => {
            if b < a {
                b
            } else {
                a
            }
        }
        Atan2 => a.atan2(b),
        Eq => t(a == b),
        Ne => t(a != b),
        Lt => t(a < b),
        Le => t(a <= b),
        Gt => t(a > b),
        Ge => t(a >= b),
        // Rejected before the loop.
        And | Or | Xor => f64::NAN,
    }
}

/// Integer power by repeated squaring (wrapping); negative exponents give 0 except for ±1.
fn pow_i(base: i64, exp: i64) -> i64 {
    if exp < 0 {
        return match base {
            1 => 1,
            -1 if exp % 2 == 0 => 1,
            -1 => -1,
            _ => 0,
        };
    }
    let (mut result, mut b, mut e) = (1i64, base, exp);
    while e > 0 {
        if e & 1 == 1 {
            result = result.wrapping_mul(b);
        }
        b = b.wrapping_mul(b);
        e >>= 1;
    }
    result
}

fn binary_i(op: BinaryOp, a: i64, b: i64) -> i64 {
    use BinaryOp::*;
    match op {
        Add => a.wrapping_add(b),
        Sub => a.wrapping_sub(b),
        Mul => a.wrapping_mul(b),
        // Integer division by zero is an error in torch; any value will do, we give 0.
        Div | FloorDiv | Rem | Fmod if b == 0 => 0,
        Div => a.wrapping_div(b),
        FloorDiv => {
            let q = a.wrapping_div(b);
            if a.wrapping_rem(b) != 0 && ((a < 0) != (b < 0)) {
                q.wrapping_sub(1)
            } else {
                q
            }
        }
        Pow => pow_i(a, b),
        Rem => {
            let r = a.wrapping_rem(b);
            if r != 0 && ((r < 0) != (b < 0)) {
                r.wrapping_add(b)
            } else {
                r
            }
        }
        Fmod => a.wrapping_rem(b),
        Max => a.max(b),
        Min => a.min(b),
        Eq => (a == b) as i64,
        Ne => (a != b) as i64,
        Lt => (a < b) as i64,
        Le => (a <= b) as i64,
        Gt => (a > b) as i64,
        Ge => (a >= b) as i64,
        And => a & b,
        Or => a | b,
        Xor => a ^ b,
        // Rejected before the loop.
        Atan2 => 0,
    }
}

pub(crate) fn binary(op: BinaryOp, a: &Value, b: &Value) -> R<Value> {
    if a.dtype != b.dtype || a.shape != b.shape {
        return Err(format!(
            "operands {} {:?} and {} {:?} differ",
            a.dtype, a.shape, b.dtype, b.shape
        ));
    }
    let dtype = if op.is_comparison() {
        DType::Bool
    } else {
        a.dtype
    };
    let data = match (&a.data, &b.data) {
        (Data::F(x), Data::F(y)) => {
            if op.is_logical() {
                return Err(format!("{} needs bool or integer inputs", op.name()));
            }
            Data::F(x.iter().zip(y).map(|(&p, &q)| binary_f(op, p, q)).collect())
        }
        (Data::I(x), Data::I(y)) => {
            if op == BinaryOp::Atan2 {
                return Err(format!("atan2 needs float inputs, got {}", a.dtype));
            }
            Data::I(x.iter().zip(y).map(|(&p, &q)| binary_i(op, p, q)).collect())
        }
        _ => return Err("operands hold data of different kinds".into()),
    };
    Ok(Value::from_data(dtype, a.shape.clone(), data))
}

pub(crate) fn where_(cond: &Value, a: &Value, b: &Value) -> R<Value> {
    if cond.shape != a.shape || a.shape != b.shape || a.dtype != b.dtype {
        return Err(format!(
            "where of shapes {:?}, {:?}, {:?}",
            cond.shape, a.shape, b.shape
        ));
    }
    let Data::I(c) = &cond.data else {
        return Err(format!("condition must be bool, got {}", cond.dtype));
    };
    let data = match (&a.data, &b.data) {
        (Data::F(x), Data::F(y)) => Data::F(
            c.iter()
                .zip(x.iter().zip(y))
                .map(|(&c, (&p, &q))| if c != 0 { p } else { q })
                .collect(),
        ),
        (Data::I(x), Data::I(y)) => Data::I(
            c.iter()
                .zip(x.iter().zip(y))
                .map(|(&c, (&p, &q))| if c != 0 { p } else { q })
                .collect(),
        ),
        _ => return Err("operands hold data of different kinds".into()),
    };
    Ok(Value::from_data(a.dtype, a.shape.clone(), data))
}

/// float→int truncates toward zero (then wraps), anything→bool is `x != 0`, bool→number is
/// 0/1, float→float rounds to nearest even.
pub(crate) fn cast(to: DType, x: &Value) -> Value {
    Value::from_data(to, x.shape.clone(), x.data.clone())
}
