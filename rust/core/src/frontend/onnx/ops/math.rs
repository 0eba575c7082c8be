//! Float functions ONNX has and the IR composes from its own ops: the activations Softplus,
//! Mish, Celu, Softsign, ThresholdedRelu and Shrink, and the inverse trigonometric and
//! hyperbolic functions. Each form is chosen to keep full precision where the textbook
//! formula cancels (`sinh` near 0, `asin` near ±1, `acosh` near 1, `asinh` of large values).

use super::{bin, one, scalar, Handler};
use crate::dtype::DType;
use crate::error::Result;
use crate::frontend::builder::Operand;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, UnaryOp, ValueId};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "Softplus" | "Mish" | "Celu" | "Softsign" | "ThresholdedRelu" | "Shrink" | "Atan"
        | "Asin" | "Acos" | "Sinh" | "Cosh" | "Asinh" | "Acosh" | "Atanh" => function,
        _ => return None,
    })
}

/// Builds expressions over one float dtype.
struct Math<'c> {
    ctx: &'c mut Ctx,
    dtype: DType,
}

impl Math<'_> {
    fn k(&mut self, v: f64) -> Result<ValueId> {
        scalar(self.ctx, v, self.dtype)
    }
    fn u(&mut self, op: UnaryOp, x: ValueId) -> Result<ValueId> {
        self.ctx.b.unary(op, x)
    }
    fn b(&mut self, op: BinaryOp, x: ValueId, y: ValueId) -> Result<ValueId> {
        bin(self.ctx, op, x, y)
    }
    /// `x op c` for a constant `c`.
    fn bk(&mut self, op: BinaryOp, x: ValueId, c: f64) -> Result<ValueId> {
        let c = self.k(c)?;
        self.b(op, x, c)
    }
    /// `where(cond, a, b)` broadcast to a common shape.
    fn pick(&mut self, cond: ValueId, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.ctx
            .b
            .where_(cond, Operand::Tensor(a), Operand::Tensor(b))
    }
    /// `x op c` as bool, for a constant `c`.
    fn cmp(&mut self, op: BinaryOp, x: ValueId, c: f64) -> Result<ValueId> {
        let c = self.k(c)?;
        self.ctx
            .b
            .binary(op, Operand::Tensor(x), Operand::Tensor(c))
    }

    /// `log(1 + exp(x))` as `max(x, 0) + log1p(exp(-|x|))`: no overflow, exact for large x.
    fn softplus(&mut self, x: ValueId) -> Result<ValueId> {
        let pos = self.bk(BinaryOp::Max, x, 0.0)?;
        let a = self.u(UnaryOp::Abs, x)?;
        let na = self.u(UnaryOp::Neg, a)?;
        let e = self.u(UnaryOp::Exp, na)?;
        let l = self.u(UnaryOp::Log1p, e)?;
        self.b(BinaryOp::Add, pos, l)
    }

    /// `sqrt((1 - x)(1 + x))`: `sqrt(1 - x²)` without the cancellation near ±1.
    fn cosine_of_asin(&mut self, x: ValueId) -> Result<ValueId> {
        let one_ = self.k(1.0)?;
        let a = self.b(BinaryOp::Sub, one_, x)?;
        let b = self.bk(BinaryOp::Add, x, 1.0)?;
        let p = self.b(BinaryOp::Mul, a, b)?;
        self.u(UnaryOp::Sqrt, p)
    }

    /// `log(2|x|)`: what `asinh`/`acosh` tend to where `x²` would overflow.
    fn log_twice(&mut self, x: ValueId) -> Result<ValueId> {
        let a = self.u(UnaryOp::Abs, x)?;
        let l = self.u(UnaryOp::Log, a)?;
        self.bk(BinaryOp::Add, l, std::f64::consts::LN_2)
    }
}

/// Past this magnitude `x²` overflows f32 (and `asinh`/`acosh` equal `log(2|x|)` to f64
/// precision), so the large-value form takes over.
const HUGE: f64 = 1e18;

fn function(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let dtype = ctx.b.dtype(x);
    if !dtype.is_float() {
        return Err(n.err(format!("needs a float input, got {dtype}")));
    }
    let (alpha, bias, lambd) = match n.op {
        "Celu" | "ThresholdedRelu" => (n.float("alpha", 1.0)? as f64, 0.0, 0.0),
        "Shrink" => (
            0.0,
            n.float("bias", 0.0)? as f64,
            n.float("lambd", 0.5)? as f64,
        ),
        _ => (0.0, 0.0, 0.0),
    };
    let m = &mut Math { ctx, dtype };
    use BinaryOp as B;
    use UnaryOp as U;
    let y = match n.op {
        "Softplus" => m.softplus(x)?,
        "Mish" => {
            let s = m.softplus(x)?;
            let t = m.u(U::Tanh, s)?;
            m.b(B::Mul, x, t)?
        }
        // max(0, x) + min(0, alpha·expm1(x / alpha))
        "Celu" => {
            if alpha == 0.0 {
                return Err(n.err("alpha must not be 0"));
            }
            let pos = m.bk(B::Max, x, 0.0)?;
            let s = m.bk(B::Div, x, alpha)?;
            let e = m.u(U::Expm1, s)?;
            let e = m.bk(B::Mul, e, alpha)?;
            let neg = m.bk(B::Min, e, 0.0)?;
            m.b(B::Add, pos, neg)?
        }
        "Softsign" => {
            let a = m.u(U::Abs, x)?;
            let d = m.bk(B::Add, a, 1.0)?;
            m.b(B::Div, x, d)?
        }
        "ThresholdedRelu" => {
            let keep = m.cmp(B::Gt, x, alpha)?;
            let zero = m.k(0.0)?;
            m.pick(keep, x, zero)?
        }
        // x + bias below -lambd, x - bias above lambd, 0 between.
        "Shrink" => {
            let below = m.cmp(B::Lt, x, -lambd)?;
            let above = m.cmp(B::Gt, x, lambd)?;
            let up = m.bk(B::Add, x, bias)?;
            let down = m.bk(B::Sub, x, bias)?;
            let zero = m.k(0.0)?;
            let mid = m.pick(above, down, zero)?;
            m.pick(below, up, mid)?
        }
        "Atan" => {
            let one_ = m.k(1.0)?;
            m.b(B::Atan2, x, one_)?
        }
        "Asin" => {
            let c = m.cosine_of_asin(x)?;
            m.b(B::Atan2, x, c)?
        }
        "Acos" => {
            let s = m.cosine_of_asin(x)?;
            m.b(B::Atan2, s, x)?
        }
        // (expm1(x) - expm1(-x)) / 2: the two terms have opposite signs, nothing cancels.
        "Sinh" => {
            let a = m.u(U::Expm1, x)?;
            let nx = m.u(U::Neg, x)?;
            let b = m.u(U::Expm1, nx)?;
            let d = m.b(B::Sub, a, b)?;
            m.bk(B::Mul, d, 0.5)?
        }
        "Cosh" => {
            let a = m.u(U::Exp, x)?;
            let nx = m.u(U::Neg, x)?;
            let b = m.u(U::Exp, nx)?;
            let s = m.b(B::Add, a, b)?;
            m.bk(B::Mul, s, 0.5)?
        }
        // sign(x)·log1p(|x| + x²/(1 + sqrt(1 + x²))), log(2|x|) where x² overflows.
        "Asinh" => {
            let a = m.u(U::Abs, x)?;
            let sq = m.b(B::Mul, a, a)?;
            let r = m.bk(B::Add, sq, 1.0)?;
            let r = m.u(U::Sqrt, r)?;
            let r = m.bk(B::Add, r, 1.0)?;
            let f = m.b(B::Div, sq, r)?;
            let s = m.b(B::Add, a, f)?;
            let small = m.u(U::Log1p, s)?;
            let big = m.log_twice(x)?;
            let huge = m.cmp(B::Gt, a, HUGE)?;
            let mag = m.pick(huge, big, small)?;
            let sign = m.u(U::Sign, x)?;
            m.b(B::Mul, sign, mag)?
        }
        // log1p((x - 1) + sqrt((x - 1)(x + 1))), log(2x) where the product overflows.
        "Acosh" => {
            let a = m.bk(B::Sub, x, 1.0)?;
            let b = m.bk(B::Add, x, 1.0)?;
            let p = m.b(B::Mul, a, b)?;
            let r = m.u(U::Sqrt, p)?;
            let s = m.b(B::Add, a, r)?;
            let small = m.u(U::Log1p, s)?;
            let big = m.log_twice(x)?;
            let huge = m.cmp(B::Gt, x, HUGE)?;
            m.pick(huge, big, small)?
        }
        // log1p(2x / (1 - x)) / 2
        _ => {
            let one_ = m.k(1.0)?;
            let d = m.b(B::Sub, one_, x)?;
            let t = m.bk(B::Mul, x, 2.0)?;
            let q = m.b(B::Div, t, d)?;
            let l = m.u(U::Log1p, q)?;
            m.bk(B::Mul, l, 0.5)?
        }
    };
    one(y)
}
