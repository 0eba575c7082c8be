//! Symbolic dimensions: a size is a constant or an expression over named symbols.
//!
//! Dynamic shapes are part of the IR from the start: a graph may say a tensor is `[s0, 4096]`
//! and a backend binds `s0` from the actual inputs at run time.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dim {
    Const(i64),
    Sym(Arc<str>),
    Expr(Arc<(DimOp, Dim, Dim)>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DimOp {
    Add,
    Sub,
    Mul,
    FloorDiv,
    Mod,
    Min,
    Max,
}

/// Values of symbols, as bound from the shapes of actual inputs.
pub type SymbolBindings = BTreeMap<Arc<str>, i64>;

/// The known range of a symbol (inclusive); sizes are never negative.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SymbolRange {
    pub min: i64,
    pub max: Option<i64>,
}

impl From<i64> for Dim {
    fn from(v: i64) -> Dim {
        Dim::Const(v)
    }
}

impl From<usize> for Dim {
    fn from(v: usize) -> Dim {
        Dim::Const(v as i64)
    }
}

fn floor_div(a: i64, b: i64) -> i64 {
    let q = a / b;
    if (a % b != 0) && ((a < 0) != (b < 0)) {
        q - 1
    } else {
        q
    }
}

fn floor_mod(a: i64, b: i64) -> i64 {
    a - floor_div(a, b) * b
}

impl DimOp {
    fn apply(self, a: i64, b: i64) -> Option<i64> {
        Some(match self {
            DimOp::Add => a.checked_add(b)?,
            DimOp::Sub => a.checked_sub(b)?,
            DimOp::Mul => a.checked_mul(b)?,
            DimOp::FloorDiv if b == 0 => return None,
            DimOp::FloorDiv => floor_div(a, b),
            DimOp::Mod if b == 0 => return None,
            DimOp::Mod => floor_mod(a, b),
            DimOp::Min => a.min(b),
            DimOp::Max => a.max(b),
        })
    }

    fn symbol(self) -> &'static str {
        match self {
            DimOp::Add => "+",
            DimOp::Sub => "-",
            DimOp::Mul => "*",
            DimOp::FloorDiv => "//",
            DimOp::Mod => "%",
            DimOp::Min => "min",
            DimOp::Max => "max",
        }
    }
}

impl Dim {
    pub fn sym(name: &str) -> Dim {
        Dim::Sym(Arc::from(name))
    }

    /// Builds `a op b`, folding constants and the obvious identities so that static shapes
    /// stay plain numbers.
    pub fn binary(op: DimOp, a: Dim, b: Dim) -> Dim {
        if let (Dim::Const(x), Dim::Const(y)) = (&a, &b) {
            if let Some(v) = op.apply(*x, *y) {
                return Dim::Const(v);
            }
        }
        match (op, &a, &b) {
            (DimOp::Add, _, Dim::Const(0)) | (DimOp::Sub, _, Dim::Const(0)) => return a,
            (DimOp::Add, Dim::Const(0), _) => return b,
            (DimOp::Mul, _, Dim::Const(1)) | (DimOp::FloorDiv, _, Dim::Const(1)) => return a,
            (DimOp::Mul, Dim::Const(1), _) => return b,
            (DimOp::Mul, _, Dim::Const(0)) | (DimOp::Mul, Dim::Const(0), _) => {
                return Dim::Const(0)
            }
            (DimOp::Sub, x, y) if x == y => return Dim::Const(0),
            (DimOp::Min, x, y) | (DimOp::Max, x, y) if x == y => return a,
            // Sizes are never negative: a slice's clamp `max(s, 0)` is `s`.
            (DimOp::Max, x, Dim::Const(0)) if x.non_negative() => return a,
            (DimOp::Max, Dim::Const(0), x) if x.non_negative() => return b,
            // Constant factors go right and merge, and divide out where they can, so that a
            // reshape's `(16·s·32) // 512` is `s` again and equals the `s` it came from.
            (DimOp::Mul, Dim::Const(_), x) if !x.is_const() => {
                return Dim::binary(DimOp::Mul, b.clone(), a.clone())
            }
            (DimOp::Mul, Dim::Expr(e), Dim::Const(c2)) => {
                if let (DimOp::Mul, x, Dim::Const(c1)) = &**e {
                    if let Some(c) = c1.checked_mul(*c2) {
                        return Dim::binary(DimOp::Mul, x.clone(), Dim::Const(c));
                    }
                }
            }
            (DimOp::FloorDiv, Dim::Expr(e), Dim::Const(d)) if *d > 0 => {
                if let (DimOp::Mul, x, Dim::Const(c)) = &**e {
                    if *c > 0 && c % d == 0 {
                        return Dim::binary(DimOp::Mul, x.clone(), Dim::Const(c / d));
                    }
                    if *c > 0 && d % c == 0 {
                        return Dim::binary(DimOp::FloorDiv, x.clone(), Dim::Const(d / c));
                    }
                }
            }
            _ => {}
        }
        Dim::Expr(Arc::new((op, a, b)))
    }

    /// Whether the dim is provably ≥ 0 (symbols are sizes).
    fn non_negative(&self) -> bool {
        match self {
            Dim::Const(v) => *v >= 0,
            Dim::Sym(_) => true,
            Dim::Expr(e) => match &**e {
                (DimOp::Add | DimOp::Mul | DimOp::Min, a, b) => {
                    a.non_negative() && b.non_negative()
                }
                (DimOp::FloorDiv, a, Dim::Const(d)) => *d > 0 && a.non_negative(),
                (DimOp::Max, a, b) => a.non_negative() || b.non_negative(),
                _ => false,
            },
        }
    }

    pub fn as_const(&self) -> Option<i64> {
        match self {
            Dim::Const(v) => Some(*v),
            _ => None,
        }
    }

    pub fn is_const(&self) -> bool {
        matches!(self, Dim::Const(_))
    }

    /// Evaluates the dimension with the given symbol values.
    pub fn eval(&self, env: &SymbolBindings) -> Result<i64> {
        match self {
            Dim::Const(v) => Ok(*v),
            Dim::Sym(s) => env
                .get(s)
                .copied()
                .ok_or_else(|| Error::Shape(format!("symbol '{s}' has no value"))),
            Dim::Expr(e) => {
                let (op, a, b) = &**e;
                let (x, y) = (a.eval(env)?, b.eval(env)?);
                op.apply(x, y)
                    .ok_or_else(|| Error::Shape(format!("cannot evaluate {self} with {x}, {y}")))
            }
        }
    }

    /// Symbols this dimension mentions, in sorted order.
    pub fn symbols(&self, out: &mut Vec<Arc<str>>) {
        match self {
            Dim::Const(_) => {}
            Dim::Sym(s) => {
                if !out.contains(s) {
                    out.push(s.clone());
                }
            }
            Dim::Expr(e) => {
                e.1.symbols(out);
                e.2.symbols(out);
            }
        }
    }

    /// Whether two dims are provably equal (same constant or same expression).
    /// `None` means "cannot tell statically"; backends check at run time.
    pub fn provably_equal(&self, other: &Dim) -> Option<bool> {
        match (self, other) {
            (Dim::Const(a), Dim::Const(b)) => Some(a == b),
            _ if self == other => Some(true),
            _ => None,
        }
    }
}

macro_rules! dim_operator {
    ($trait:ident, $method:ident, $op:expr) => {
        impl std::ops::$trait for Dim {
            type Output = Dim;
            fn $method(self, rhs: Dim) -> Dim {
                Dim::binary($op, self, rhs)
            }
        }
        impl std::ops::$trait<&Dim> for &Dim {
            type Output = Dim;
            fn $method(self, rhs: &Dim) -> Dim {
                Dim::binary($op, self.clone(), rhs.clone())
            }
        }
    };
}

dim_operator!(Add, add, DimOp::Add);
dim_operator!(Sub, sub, DimOp::Sub);
dim_operator!(Mul, mul, DimOp::Mul);

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Const(v) => write!(f, "{v}"),
            Dim::Sym(s) => write!(f, "{s}"),
            Dim::Expr(e) => match e.0 {
                DimOp::Min | DimOp::Max => write!(f, "{}({}, {})", e.0.symbol(), e.1, e.2),
                _ => write!(f, "({} {} {})", e.1, e.0.symbol(), e.2),
            },
        }
    }
}

/// Product of dims (the element count of a shape).
pub fn numel(shape: &[Dim]) -> Dim {
    shape
        .iter()
        .cloned()
        .fold(Dim::Const(1), |acc, d| Dim::binary(DimOp::Mul, acc, d))
}

/// Evaluates a whole shape.
pub fn eval_shape(shape: &[Dim], env: &SymbolBindings) -> Result<Vec<usize>> {
    shape
        .iter()
        .map(|d| {
            let v = d.eval(env)?;
            usize::try_from(v).map_err(|_| Error::Shape(format!("dimension {d} evaluated to {v}")))
        })
        .collect()
}

pub fn format_shape(shape: &[Dim]) -> String {
    let parts: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_fold() {
        let d = Dim::Const(6) * Dim::Const(7);
        assert_eq!(d, Dim::Const(42));
        assert_eq!(
            Dim::binary(DimOp::FloorDiv, Dim::Const(-7), Dim::Const(2)),
            Dim::Const(-4)
        );
        assert_eq!(
            Dim::binary(DimOp::Mod, Dim::Const(-7), Dim::Const(2)),
            Dim::Const(1)
        );
    }

    #[test]
    fn symbolic_eval() {
        let s = Dim::sym("s0");
        let d = Dim::binary(
            DimOp::FloorDiv,
            &(&s * &Dim::Const(3)) + &Dim::Const(1),
            Dim::Const(2),
        );
        let mut env = SymbolBindings::new();
        env.insert(Arc::from("s0"), 5);
        assert_eq!(d.eval(&env).unwrap(), 8);
        assert_eq!(d.to_string(), "(((s0 * 3) + 1) // 2)");
        assert!(Dim::sym("s1").eval(&env).is_err());
    }

    #[test]
    fn identities_keep_static_shapes_simple() {
        let s = Dim::sym("n");
        assert_eq!(&s * &Dim::Const(1), s);
        assert_eq!(&s - &s, Dim::Const(0));
        assert_eq!(numel(&[Dim::Const(2), Dim::Const(3)]), Dim::Const(6));
    }

    #[test]
    fn constant_factors_merge_and_divide_out() {
        let s = Dim::sym("seq");
        let c = Dim::Const;
        // What a reshape's inferred -1 over [B, seq, 16, 32] into 512 columns gives.
        let numel = Dim::binary(DimOp::Mul, Dim::binary(DimOp::Mul, c(16), s.clone()), c(32));
        assert_eq!(numel, Dim::binary(DimOp::Mul, s.clone(), c(512)));
        assert_eq!(Dim::binary(DimOp::FloorDiv, numel.clone(), c(512)), s);
        assert_eq!(
            Dim::binary(DimOp::FloorDiv, numel.clone(), c(128)),
            Dim::binary(DimOp::Mul, s.clone(), c(4))
        );
        assert_eq!(
            Dim::binary(
                DimOp::FloorDiv,
                Dim::binary(DimOp::Mul, s.clone(), c(4)),
                c(8)
            ),
            Dim::binary(DimOp::FloorDiv, s.clone(), c(2))
        );
        // Each rewrite keeps the value, floor division included.
        let mut env = SymbolBindings::new();
        for v in [0, 1, 5, 7, 64] {
            env.insert(Arc::from("seq"), v);
            let odd = Dim::binary(DimOp::Mul, c(3), s.clone());
            let d = Dim::binary(DimOp::FloorDiv, Dim::binary(DimOp::Mul, odd, c(2)), c(4));
            assert_eq!(d.eval(&env).unwrap(), (v * 6).div_euclid(4));
        }
    }

    #[test]
    fn clamps_of_sizes_at_zero_vanish() {
        let s = Dim::sym("seq");
        assert_eq!(Dim::binary(DimOp::Max, s.clone(), Dim::Const(0)), s);
        let minus = Dim::binary(DimOp::Sub, s.clone(), Dim::Const(1));
        let clamped = Dim::binary(DimOp::Max, minus.clone(), Dim::Const(0));
        assert_ne!(clamped, minus, "s - 1 may be negative: the clamp stays");
    }
}
