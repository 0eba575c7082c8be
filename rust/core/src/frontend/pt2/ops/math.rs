//! Math functions written out from the IR's primitives, in the forms that keep their
//! accuracy: inverse trigonometric functions through `atan2`, hyperbolic ones through
//! `expm1`/`log1p` (no cancellation near 0), exp2/log2/log10, hypot, copysign, signbit and
//! logcumsumexp, erfinv. sinh, cosh and erfinv run in f64 (their exponentials overflow f32 before they do).
//! Half-precision inputs are computed in f32 and rounded once at the end, as
//! torch's CPU kernels do.

use super::reduce::reduce;
use super::{axis, operand, tensor, Handler};
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::frontend::builder::Operand;
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{BinaryOp, Op, ReduceOp, ScanOp, UnaryOp, ValueId};

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    Some(match (name, overload) {
        ("asin" | "arcsin", "default") => |c, n| unary(c, n, asin),
        ("acos" | "arccos", "default") => |c, n| unary(c, n, acos),
        ("atan" | "arctan", "default") => |c, n| unary(c, n, atan),
        ("sinh", "default") => |c, n| unary_in_f64(c, n, sinh),
        ("cosh", "default") => |c, n| unary_in_f64(c, n, cosh),
        ("asinh" | "arcsinh", "default") => |c, n| unary(c, n, asinh),
        ("acosh" | "arccosh", "default") => |c, n| unary(c, n, acosh),
        ("atanh" | "arctanh", "default") => |c, n| unary(c, n, atanh),
        ("exp2" | "special_exp2", "default") => |c, n| unary(c, n, exp2),
        ("log2", "default") => {
            |c, n| unary(c, n, |c, x| scaled_log(c, x, std::f64::consts::LOG2_E))
        }
        ("log10", "default") => {
            |c, n| unary(c, n, |c, x| scaled_log(c, x, std::f64::consts::LOG10_E))
        }
        ("erfinv" | "special_erfinv", "default") => erfinv_op,
        ("hypot", "default") => hypot,
        ("copysign", "Tensor" | "Scalar") => copysign,
        ("signbit", "default") => signbit_op,
        ("logcumsumexp", "default") => logcumsumexp,
        _ => return None,
    })
}

type Body = fn(&mut Ctx, ValueId) -> Result<ValueId>;

/// `f(x)` for a float result: integers promote to f32, halves compute in f32.
fn unary(ctx: &mut Ctx, n: &NodeArgs, f: Body) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let (x, out) = widened(ctx, x)?;
    let y = f(ctx, x)?;
    Ok(Out::Value(ctx.b.cast(y, out)?))
}

/// `f(x)` computed in f64: sinh and cosh of f32 stay finite up to |x| ≈ 89.4, where the
/// exponentials they are made of already overflow f32.
fn unary_in_f64(ctx: &mut Ctx, n: &NodeArgs, f: Body) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let (x, out) = widened(ctx, x)?;
    let x = ctx.b.cast(x, DType::F64)?;
    let y = f(ctx, x)?;
    Ok(Out::Value(ctx.b.cast(y, out)?))
}

/// `x` in the type the math runs in (f32 for integers and halves, else its own), and the
/// type of the result.
fn widened(ctx: &mut Ctx, x: ValueId) -> Result<(ValueId, DType)> {
    let dtype = ctx.b.dtype(x);
    let out = if dtype.is_float() { dtype } else { DType::F32 };
    let compute = if out == DType::F64 { out } else { DType::F32 };
    Ok((ctx.b.cast(x, compute)?, out))
}

fn t(v: ValueId) -> Operand {
    Operand::Tensor(v)
}

fn num(v: f64) -> Operand {
    Operand::Scalar(Scalar::Float(v))
}

fn bin(ctx: &mut Ctx, op: BinaryOp, a: Operand, b: Operand) -> Result<ValueId> {
    ctx.b.binary(op, a, b)
}

/// √((1 − x)(1 + x)): √(1 − x²) without losing precision near |x| = 1.
fn cos_of_asin(ctx: &mut Ctx, x: ValueId) -> Result<ValueId> {
    let below = bin(ctx, BinaryOp::Sub, num(1.0), t(x))?;
    let above = bin(ctx, BinaryOp::Add, num(1.0), t(x))?;
    let product = bin(ctx, BinaryOp::Mul, t(below), t(above))?;
    ctx.b.unary(UnaryOp::Sqrt, product)
}

fn atan2(ctx: &mut Ctx, y: Operand, x: Operand) -> Result<ValueId> {
    bin(ctx, BinaryOp::Atan2, y, x)
}

fn asin(ctx: &mut Ctx, x: ValueId) -> Result<ValueId> {
    let c = cos_of_asin(ctx, x)?;
    atan2(ctx, t(x), t(c))
}

fn acos(ctx: &mut Ctx, x: ValueId) -> Result<ValueId> {
    let s = cos_of_asin(ctx, x)?;
    atan2(ctx, t(s), t(x))
}

fn atan(ctx: &mut Ctx, x: ValueId) -> Result<ValueId> {
    atan2(ctx, t(x), num(1.0))
}

/// (f(x) ⊕ f(−x)) / 2.
fn half_of_both_signs(ctx: &mut Ctx, x: ValueId, f: UnaryOp, combine: BinaryOp) -> Result<ValueId> {
    let up = ctx.b.unary(f, x)?;
    let neg = ctx.b.unary(UnaryOp::Neg, x)?;
    let down = ctx.b.unary(f, neg)?;
    let both = bin(ctx, combine, t(up), t(down))?;
    bin(ctx, BinaryOp::Mul, t(both), num(0.5))
}

/// (expm1(x) − expm1(−x)) / 2: exact to rounding near 0, where eˣ − e⁻ˣ cancels.
fn sinh(ctx: &mut Ctx, x: ValueId) -> Result<ValueId> {
    half_of_both_signs(ctx, x, UnaryOp::Expm1, BinaryOp::Sub)
}

fn cosh(ctx: &mut Ctx, x: ValueId) -> Result<ValueId> {
    half_of_both_signs(ctx, x, UnaryOp::Exp, BinaryOp::Add)
}

/// Beyond this, x² swamps 1 in any float type and asinh/acosh are ln(2x).
const HUGE: f64 = 1e8;

/// ln(2x) for large x, where x² would overflow.
fn log_twice(ctx: &mut Ctx, x: ValueId) -> Result<ValueId> {
    let log = ctx.b.unary(UnaryOp::Log, x)?;
    bin(ctx, BinaryOp::Add, t(log), num(std::f64::consts::LN_2))
}

/// sign(x)·log1p(|x| + x²/(1 + √(1 + x²))), ln(2|x|) for huge |x|.
fn asinh(ctx: &mut Ctx, x: ValueId) -> Result<ValueId> {
    let a = ctx.b.unary(UnaryOp::Abs, x)?;
    let sq = bin(ctx, BinaryOp::Mul, t(a), t(a))?;
    let one_plus = bin(ctx, BinaryOp::Add, t(sq), num(1.0))?;
    let root = ctx.b.unary(UnaryOp::Sqrt, one_plus)?;
    let denom = bin(ctx, BinaryOp::Add, t(root), num(1.0))?;
    let frac = bin(ctx, BinaryOp::Div, t(sq), t(denom))?;
    let arg = bin(ctx, BinaryOp::Add, t(a), t(frac))?;
    let small = ctx.b.unary(UnaryOp::Log1p, arg)?;
    let large = log_twice(ctx, a)?;
    let huge = bin(ctx, BinaryOp::Gt, t(a), num(HUGE))?;
    let magnitude = ctx.b.where_(huge, t(large), t(small))?;
    let negative = bin(ctx, BinaryOp::Lt, t(x), num(0.0))?;
    let flipped = ctx.b.unary(UnaryOp::Neg, magnitude)?;
    ctx.b.where_(negative, t(flipped), t(magnitude))
}

/// log1p(u + √(u(u + 2))) with u = x − 1 (exact near 1), ln(2x) for huge x; NaN below 1.
fn acosh(ctx: &mut Ctx, x: ValueId) -> Result<ValueId> {
    let u = bin(ctx, BinaryOp::Sub, t(x), num(1.0))?;
    let u2 = bin(ctx, BinaryOp::Add, t(u), num(2.0))?;
    let product = bin(ctx, BinaryOp::Mul, t(u), t(u2))?;
    let root = ctx.b.unary(UnaryOp::Sqrt, product)?;
    let arg = bin(ctx, BinaryOp::Add, t(u), t(root))?;
    let small = ctx.b.unary(UnaryOp::Log1p, arg)?;
    let large = log_twice(ctx, x)?;
    let huge = bin(ctx, BinaryOp::Gt, t(x), num(HUGE))?;
    let value = ctx.b.where_(huge, t(large), t(small))?;
    // Below 1 (far below, u(u + 2) is positive again) there is no acosh.
    let outside = bin(ctx, BinaryOp::Lt, t(x), num(1.0))?;
    ctx.b.where_(outside, num(f64::NAN), t(value))
}

/// log1p(2x / (1 − x)) / 2: exact near 0, ±inf at ±1, NaN beyond.
fn atanh(ctx: &mut Ctx, x: ValueId) -> Result<ValueId> {
    let twice = bin(ctx, BinaryOp::Mul, t(x), num(2.0))?;
    let rest = bin(ctx, BinaryOp::Sub, num(1.0), t(x))?;
    let ratio = bin(ctx, BinaryOp::Div, t(twice), t(rest))?;
    let log = ctx.b.unary(UnaryOp::Log1p, ratio)?;
    bin(ctx, BinaryOp::Mul, t(log), num(0.5))
}

/// Giles's single-precision erfinv polynomials ("Approximating the erfinv function", 2010),
/// highest power first: in w − 2.5 for w = −ln(1 − y²) < 5, else in √w − 3.
const ERFINV_CENTRAL: [f64; 9] = [
    2.810_226_36e-08,
    3.432_739_39e-07,
    -3.523_387_7e-06,
    -4.391_506_54e-06,
    2.185_808_7e-04,
    -1.253_725_03e-03,
    -4.177_681_64e-03,
    2.466_407_27e-01,
    1.501_409_41,
];
const ERFINV_TAIL: [f64; 9] = [
    -2.002_142_57e-04,
    1.009_505_58e-04,
    1.349_343_22e-03,
    -3.673_428_44e-03,
    5.739_507_73e-03,
    -7.622_461_3e-03,
    9.438_870_47e-03,
    1.001_674_06,
    2.832_976_82,
];

fn horner(ctx: &mut Ctx, w: ValueId, coefficients: &[f64]) -> Result<ValueId> {
    let mut p = ctx
        .b
        .full(Scalar::Float(coefficients[0]), ctx.b.dtype(w), vec![])?;
    for &c in &coefficients[1..] {
        let pw = bin(ctx, BinaryOp::Mul, t(p), t(w))?;
        p = bin(ctx, BinaryOp::Add, t(pw), num(c))?;
    }
    Ok(p)
}

/// The inverse error function (y in f64): Giles's approximation (~1e-7 relative), then two
/// Newton steps on erf(x) = y, each x −= (erf(x) − y)·(√π/2)·e^(x²): well past f32's
/// accuracy (near ±1, erf(x) − y cancels, which bounds it near 1e-11).
/// ±1 gives ±inf and |y| > 1 NaN, as torch.
fn erfinv(ctx: &mut Ctx, y: ValueId) -> Result<ValueId> {
    let below = bin(ctx, BinaryOp::Sub, num(1.0), t(y))?;
    let above = bin(ctx, BinaryOp::Add, num(1.0), t(y))?;
    let product = bin(ctx, BinaryOp::Mul, t(below), t(above))?;
    let log = ctx.b.unary(UnaryOp::Log, product)?;
    let w = ctx.b.unary(UnaryOp::Neg, log)?;
    let central_w = bin(ctx, BinaryOp::Sub, t(w), num(2.5))?;
    let central = horner(ctx, central_w, &ERFINV_CENTRAL)?;
    let root = ctx.b.unary(UnaryOp::Sqrt, w)?;
    let tail_w = bin(ctx, BinaryOp::Sub, t(root), num(3.0))?;
    let tail = horner(ctx, tail_w, &ERFINV_TAIL)?;
    let is_central = bin(ctx, BinaryOp::Lt, t(w), num(5.0))?;
    let p = ctx.b.where_(is_central, t(central), t(tail))?;
    let mut x = bin(ctx, BinaryOp::Mul, t(p), t(y))?;
    let half_sqrt_pi = std::f64::consts::PI.sqrt() / 2.0;
    for _ in 0..2 {
        let erf = ctx.b.unary(UnaryOp::Erf, x)?;
        let miss = bin(ctx, BinaryOp::Sub, t(erf), t(y))?;
        let sq = bin(ctx, BinaryOp::Mul, t(x), t(x))?;
        let e = ctx.b.unary(UnaryOp::Exp, sq)?;
        let slope = bin(ctx, BinaryOp::Mul, t(e), num(half_sqrt_pi))?;
        let step = bin(ctx, BinaryOp::Mul, t(miss), t(slope))?;
        x = bin(ctx, BinaryOp::Sub, t(x), t(step))?;
    }
    let magnitude = ctx.b.unary(UnaryOp::Abs, y)?;
    let edge = bin(ctx, BinaryOp::Eq, t(magnitude), num(1.0))?;
    let infinite = bin(ctx, BinaryOp::Mul, t(y), num(f64::INFINITY))?;
    let x = ctx.b.where_(edge, t(infinite), t(x))?;
    let outside = bin(ctx, BinaryOp::Gt, t(magnitude), num(1.0))?;
    ctx.b.where_(outside, num(f64::NAN), t(x))
}

/// erfinv up to f32: computed in f64, whose Newton steps resolve f32's tail. An f64 input
/// near ±1 would need erfc to resolve its own tail, which the IR lacks: refused.
fn erfinv_op(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    if ctx.b.dtype(tensor(ctx, n, "self", 0)?) == DType::F64 {
        return Err(Error::unsupported_because(
            "aten.erfinv",
            &n.name,
            "a float64 input (Ember's erfinv is accurate to float32; it would need erfc for \
             float64's tail)",
        ));
    }
    unary_in_f64(ctx, n, erfinv)
}

fn exp2(ctx: &mut Ctx, x: ValueId) -> Result<ValueId> {
    bin(ctx, BinaryOp::Pow, num(2.0), t(x))
}

fn scaled_log(ctx: &mut Ctx, x: ValueId, scale: f64) -> Result<ValueId> {
    let log = ctx.b.unary(UnaryOp::Log, x)?;
    bin(ctx, BinaryOp::Mul, t(log), num(scale))
}

/// √(a² + b²), in the operands' promoted float type.
fn hypot(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let a = tensor(ctx, n, "self", 0)?;
    let b = tensor(ctx, n, "other", 1)?;
    let dtype = ctx.b.result_type(&[t(a), t(b)]);
    let a = ctx.b.cast(a, dtype)?;
    let (a, out) = widened(ctx, a)?;
    let b = ctx.b.cast(b, ctx.b.dtype(a))?;
    let aa = bin(ctx, BinaryOp::Mul, t(a), t(a))?;
    let bb = bin(ctx, BinaryOp::Mul, t(b), t(b))?;
    let sum = bin(ctx, BinaryOp::Add, t(aa), t(bb))?;
    let root = ctx.b.unary(UnaryOp::Sqrt, sum)?;
    Ok(Out::Value(ctx.b.cast(root, out)?))
}

/// Whether x's sign bit is set: x < 0, or x is −0.0 (1/x = −inf). The sign of a NaN is not
/// visible to arithmetic; it reads as positive.
fn signbit(ctx: &mut Ctx, x: ValueId) -> Result<ValueId> {
    let negative = bin(ctx, BinaryOp::Lt, t(x), Operand::Scalar(Scalar::Int(0)))?;
    if !ctx.b.dtype(x).is_float() {
        return Ok(negative);
    }
    let zero = bin(ctx, BinaryOp::Eq, t(x), num(0.0))?;
    let inverse = bin(ctx, BinaryOp::Div, num(1.0), t(x))?;
    let negative_zero = bin(ctx, BinaryOp::Lt, t(inverse), num(0.0))?;
    let negative_zero = bin(ctx, BinaryOp::And, t(zero), t(negative_zero))?;
    bin(ctx, BinaryOp::Or, t(negative), t(negative_zero))
}

fn signbit_op(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    if ctx.b.dtype(x) == DType::Bool {
        return Ok(Out::Value(ctx.b.full(
            Scalar::Bool(false),
            DType::Bool,
            ctx.b.shape(x),
        )?));
    }
    Ok(Out::Value(signbit(ctx, x)?))
}

/// |a| with b's sign, in the promoted float type.
fn copysign(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let a = tensor(ctx, n, "self", 0)?;
    let b = operand(ctx, n, "other", 1)?;
    let mut dtype = ctx.b.result_type(&[t(a), b]);
    if !dtype.is_float() {
        dtype = DType::F32;
    }
    let a = ctx.b.cast(a, dtype)?;
    let b = ctx.b.operand(b, dtype)?;
    let magnitude = ctx.b.unary(UnaryOp::Abs, a)?;
    let flipped = ctx.b.unary(UnaryOp::Neg, magnitude)?;
    let negative = signbit(ctx, b)?;
    Ok(Out::Value(ctx.b.where_(
        negative,
        t(flipped),
        t(magnitude),
    )?))
}

/// log(Σ_{i≤j} exp(x_i)) along `dim`: m + log(cumsum(exp(x − m))) with m the line's
/// maximum (of the numbers), in f64 so that elements up to ~700 below the maximum still count (in f32 they
/// would underflow to 0 and a prefix of small elements would read −inf). An infinite m is
/// left out of the shift, so all −inf gives −inf and +inf gives +inf, as torch.
fn logcumsumexp(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let (x, out) = widened(ctx, x)?;
    if ctx.b.rank(x) == 0 {
        return Ok(Out::Value(ctx.b.cast(x, out)?));
    }
    let a = axis(ctx, x, n.int("dim", 1)?)?;
    let x = ctx.b.cast(x, DType::F64)?;
    // NaNs stay out of the maximum: they reach the sums, from their position on.
    let nan = ctx.b.unary(UnaryOp::IsNan, x)?;
    let numbers = ctx.b.where_(nan, num(f64::NEG_INFINITY), t(x))?;
    let m = reduce(ctx, numbers, ReduceOp::Max, vec![a], true)?;
    let infinite = ctx.b.unary(UnaryOp::IsInf, m)?;
    let m = ctx.b.where_(infinite, num(0.0), t(m))?;
    let shifted = bin(ctx, BinaryOp::Sub, t(x), t(m))?;
    let e = ctx.b.unary(UnaryOp::Exp, shifted)?;
    let sums = ctx.b.op(
        Op::Scan {
            axis: a,
            op: ScanOp::Sum,
        },
        &[e],
    )?;
    let log = ctx.b.unary(UnaryOp::Log, sums)?;
    let y = bin(ctx, BinaryOp::Add, t(log), t(m))?;
    Ok(Out::Value(ctx.b.cast(y, out)?))
}
