//! Symbolic dimensions: a size is a constant or an expression over named symbols.
//!
//! Dynamic shapes are part of the IR from the start: a graph may say a tensor is `[s0, 4096]`
//! and a backend binds `s0` from the actual inputs at run time.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
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

/// Known ranges of symbols, by name.
pub type SymbolRanges = BTreeMap<Arc<str>, SymbolRange>;

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
            // `(y + k) - y`: a slice `[p : p + k]` once its clamps are gone.
            (DimOp::Sub, Dim::Expr(e), y) if matches!(&**e, (DimOp::Add, x, Dim::Const(_)) if x == y) => {
                return e.2.clone()
            }
            (DimOp::Sub, Dim::Expr(e), y) if matches!(&**e, (DimOp::Add, Dim::Const(_), x) if x == y) => {
                return e.1.clone()
            }
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
            // `(x·y·c1) // (y·c2)` is `x·(c1/c2)` where c2 divides c1: a reshape's `-1`
            // computed as the element count over the other dims, which contain a symbol
            // of the numerator (`(b·s) // s` is `b`). Exact wherever the divisor is not 0.
            (DimOp::FloorDiv, Dim::Expr(_), _) if !b.is_const() => {
                if let Some(q) = cancel_factors(&a, &b) {
                    return q;
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

    /// A product as its constant factor and its other factors.
    fn factors(&self) -> (i64, Vec<Dim>) {
        match self {
            Dim::Const(c) => (*c, Vec::new()),
            Dim::Expr(e) if e.0 == DimOp::Mul => {
                let (c1, mut f1) = e.1.factors();
                let (c2, f2) = e.2.factors();
                f1.extend(f2);
                (c1.saturating_mul(c2), f1)
            }
            other => (1, vec![other.clone()]),
        }
    }

    /// Whether the dim is provably ≥ 0 (symbols are sizes).
    fn non_negative(&self) -> bool {
        self.bounds().lo.is_some_and(|lo| lo >= 0)
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

/// Inclusive bounds of a dim's value over every value of its symbols (each a size, ≥ 0);
/// `None` is unbounded on that side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    pub lo: Option<i64>,
    pub hi: Option<i64>,
}

impl Dim {
    /// Bounds of the dim by interval arithmetic, plus the one relation that matters for
    /// shapes: `f(t + k) - f(t)` for `f` built of clamps (`min`/`max` with a fixed operand)
    /// lies between 0 and `k`. That is the length of a slice `x[p : p + k]` of a table of
    /// fixed length (a rotary table indexed by the cache length: a decode step's one
    /// query row), which plain intervals cannot bound.
    pub fn bounds(&self) -> Bounds {
        self.bounds_in(&SymbolRanges::new())
    }

    /// `bounds` with each symbol within its known range.
    pub fn bounds_in(&self, ranges: &SymbolRanges) -> Bounds {
        let exact = |v: i64| Bounds {
            lo: Some(v),
            hi: Some(v),
        };
        let both = |f: fn(i64, i64) -> Option<i64>, a: Option<i64>, b: Option<i64>| {
            a.zip(b).and_then(|(a, b)| f(a, b))
        };
        match self {
            Dim::Const(v) => exact(*v),
            Dim::Sym(name) => match ranges.get(name) {
                Some(r) => Bounds {
                    lo: Some(r.min.max(0)),
                    hi: r.max,
                },
                None => Bounds {
                    lo: Some(0),
                    hi: None,
                },
            },
            Dim::Expr(e) => {
                let (op, a, b) = &**e;
                if *op == DimOp::Sub {
                    if let Some(k) = shift(a, b) {
                        return Bounds {
                            lo: Some(k.min(0)),
                            hi: Some(k.max(0)),
                        };
                    }
                }
                let (x, y) = (a.bounds_in(ranges), b.bounds_in(ranges));
                match op {
                    DimOp::Add => Bounds {
                        lo: both(i64::checked_add, x.lo, y.lo),
                        hi: both(i64::checked_add, x.hi, y.hi),
                    },
                    DimOp::Sub => Bounds {
                        lo: both(i64::checked_sub, x.lo, y.hi),
                        hi: both(i64::checked_sub, x.hi, y.lo),
                    },
                    DimOp::Mul if x.lo >= Some(0) && y.lo >= Some(0) => Bounds {
                        lo: both(i64::checked_mul, x.lo, y.lo),
                        hi: both(i64::checked_mul, x.hi, y.hi),
                    },
                    // Sizes over sizes: never negative (where defined).
                    DimOp::FloorDiv if x.lo >= Some(0) && y.lo >= Some(0) && y.lo != y.hi => {
                        Bounds {
                            lo: Some(0),
                            hi: x.hi,
                        }
                    }
                    DimOp::FloorDiv if y.lo == y.hi && y.lo > Some(0) => {
                        let d = y.lo.unwrap_or(1);
                        Bounds {
                            lo: x.lo.map(|v| floor_div(v, d)),
                            hi: x.hi.map(|v| floor_div(v, d)),
                        }
                    }
                    DimOp::Mod if y.lo == y.hi && y.lo > Some(0) => Bounds {
                        lo: Some(0),
                        hi: y.hi.map(|d| d - 1),
                    },
                    DimOp::Min => Bounds {
                        lo: both(|a, b| Some(a.min(b)), x.lo, y.lo),
                        hi: match (x.hi, y.hi) {
                            (Some(a), Some(b)) => Some(a.min(b)),
                            (a, b) => a.or(b),
                        },
                    },
                    DimOp::Max => Bounds {
                        lo: match (x.lo, y.lo) {
                            (Some(a), Some(b)) => Some(a.max(b)),
                            (a, b) => a.or(b),
                        },
                        hi: both(|a, b| Some(a.max(b)), x.hi, y.hi),
                    },
                    _ => Bounds { lo: None, hi: None },
                }
            }
        }
    }

    /// The largest value the dim can take, where it is bounded.
    pub fn upper_bound(&self) -> Option<i64> {
        self.bounds().hi
    }

    /// The dim with the clamps its symbols' ranges make moot removed (`min(s + 1, 4096)`
    /// is `s + 1` where `s ≤ 4095`), and what that enables folded (`(s + 1) - s` is 1).
    /// Sound because a program checks every symbol against its range when it is called.
    pub fn simplified(&self, ranges: &SymbolRanges) -> Dim {
        let Dim::Expr(e) = self else {
            return self.clone();
        };
        let (op, a, b) = &**e;
        let (a, b) = (a.simplified(ranges), b.simplified(ranges));
        let (x, y) = (a.bounds_in(ranges), b.bounds_in(ranges));
        let le = |p: Bounds, q: Bounds| matches!((p.hi, q.lo), (Some(h), Some(l)) if h <= l);
        match op {
            DimOp::Min if le(x, y) => a,
            DimOp::Min if le(y, x) => b,
            DimOp::Max if le(y, x) => a,
            DimOp::Max if le(x, y) => b,
            _ => Dim::binary(*op, a, b),
        }
    }
}

/// `Some(k)` where `a` is `b` with one of its terms `t` replaced by `t + k` under clamps
/// only (`min`/`max` against the same other operand, sums with the same other term): such
/// maps are monotone and move by at most their argument's change, so `a - b` lies
/// between 0 and `k`.
fn shift(a: &Dim, b: &Dim) -> Option<i64> {
    if a == b {
        return Some(0);
    }
    if let Dim::Expr(e) = a {
        match &**e {
            (DimOp::Add, x, Dim::Const(k)) | (DimOp::Add, Dim::Const(k), x) if x == b => {
                return Some(*k)
            }
            _ => {}
        }
    }
    let (Dim::Expr(ea), Dim::Expr(eb)) = (a, b) else {
        return None;
    };
    let ((opa, a1, a2), (opb, b1, b2)) = (&**ea, &**eb);
    if opa != opb || !matches!(opa, DimOp::Min | DimOp::Max | DimOp::Add) {
        return None;
    }
    if a2 == b2 {
        shift(a1, b1)
    } else if a1 == b1 {
        shift(a2, b2)
    } else {
        None
    }
}

/// The dims of a reshape from `from` to `to` cut into runs that correspond: consecutive
/// `(from range, to range)` pairs whose element counts are provably equal, as small as
/// the shapes allow (a dim present in both stays alone). An element's index within one
/// run of `to` then maps to its index within the same run of `from`, so a view's index
/// is rewritten run by run instead of through the whole linear offset, and the runs of
/// dims that pass through untouched (a cache's length) cost no division at all. Where
/// symbolic dims differ, what lies between the matched prefix and suffix is one run.
pub fn reshape_runs(from: &[Dim], to: &[Dim]) -> Vec<(Range<usize>, Range<usize>)> {
    let mut head = Vec::new();
    let (mut i, mut j) = (0, 0);
    // Matched runs from the front, then from the back; what is left between is one run.
    while let Some((di, dj)) = next_run(&from[i..], &to[j..], false) {
        head.push((i..i + di, j..j + dj));
        i += di;
        j += dj;
    }
    let mut tail = Vec::new();
    let (mut ie, mut je) = (from.len(), to.len());
    while let Some((di, dj)) = next_run(&from[i..ie], &to[j..je], true) {
        tail.push((ie - di..ie, je - dj..je));
        ie -= di;
        je -= dj;
    }
    if i < ie || j < je {
        head.push((i..ie, j..je));
    }
    head.extend(tail.into_iter().rev());
    head
}

/// The length (in `from`, in `to`) of the shortest leading (or, `back`, trailing) run of
/// the two shapes with provably equal element counts; `None` when both are empty or no
/// such run is provable.
fn next_run(from: &[Dim], to: &[Dim], back: bool) -> Option<(usize, usize)> {
    if from.is_empty() && to.is_empty() {
        return None;
    }
    fn at(s: &[Dim], k: usize, back: bool) -> &Dim {
        if back {
            &s[s.len() - 1 - k]
        } else {
            &s[k]
        }
    }
    let at = |s, k| at(s, k, back);
    if !from.is_empty() && !to.is_empty() && at(from, 0) == at(to, 0) {
        return Some((1, 1));
    }
    // Constant dims multiply up on either side until the counts meet.
    let (mut pf, mut pt, mut di, mut dj) = (1i64, 1i64, 0, 0);
    loop {
        if pf == pt && (di > 0 || dj > 0) {
            return Some((di, dj));
        }
        // Equal counts only before the first dim: start with `from`'s when it has one.
        let take_from = if pf == pt { di < from.len() } else { pf < pt };
        if take_from {
            let d = (di < from.len()).then(|| at(from, di))?;
            pf = pf.checked_mul(d.as_const().filter(|&v| v > 0)?)?;
            di += 1;
        } else {
            let d = (dj < to.len()).then(|| at(to, dj))?;
            pt = pt.checked_mul(d.as_const().filter(|&v| v > 0)?)?;
            dj += 1;
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
/// `a // b` when every non-constant factor of `b` is a factor of `a` and `b`'s constant
/// divides `a`'s: the product of what is left.
fn cancel_factors(a: &Dim, b: &Dim) -> Option<Dim> {
    let (ca, mut fa) = a.factors();
    let (cb, fb) = b.factors();
    if cb <= 0 || ca == i64::MAX || ca % cb != 0 {
        return None;
    }
    for f in fb {
        let at = fa.iter().position(|x| *x == f)?;
        fa.remove(at);
    }
    let rest = fa
        .into_iter()
        .fold(Dim::Const(1), |acc, f| Dim::binary(DimOp::Mul, acc, f));
    Some(Dim::binary(DimOp::Mul, rest, Dim::Const(ca / cb)))
}

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
    fn symbolic_factors_of_a_divisor_cancel() {
        let (b, s) = (Dim::sym("b"), Dim::sym("s"));
        let c = Dim::Const;
        let mul = |x: Dim, y: Dim| Dim::binary(DimOp::Mul, x, y);
        let div = |x: Dim, y: Dim| Dim::binary(DimOp::FloorDiv, x, y);
        // A reshape's -1: the element count [b, s] over the other dim s.
        assert_eq!(div(mul(b.clone(), s.clone()), s.clone()), b);
        // (b·1024) // (b·16) = 64, and (b·s·48) // (s·16) = b·3.
        assert_eq!(div(mul(b.clone(), c(1024)), mul(b.clone(), c(16))), c(64));
        let three_b = div(mul(mul(b.clone(), s.clone()), c(48)), mul(s.clone(), c(16)));
        assert_eq!(three_b, mul(b.clone(), c(3)));
        // Constants that do not divide, or a factor the numerator lacks, stay as they are.
        assert!(matches!(
            div(mul(b.clone(), c(10)), mul(b.clone(), c(4))),
            Dim::Expr(_)
        ));
        assert!(matches!(div(mul(b.clone(), c(8)), s.clone()), Dim::Expr(_)));
        // Sizes over sizes are never negative.
        assert_eq!(div(mul(b.clone(), c(8)), s.clone()).bounds().lo, Some(0));
    }

    #[test]
    fn clamps_of_sizes_at_zero_vanish() {
        let s = Dim::sym("seq");
        assert_eq!(Dim::binary(DimOp::Max, s.clone(), Dim::Const(0)), s);
        let minus = Dim::binary(DimOp::Sub, s.clone(), Dim::Const(1));
        let clamped = Dim::binary(DimOp::Max, minus.clone(), Dim::Const(0));
        assert_ne!(clamped, minus, "s - 1 may be negative: the clamp stays");
    }

    #[test]
    fn a_slice_of_one_row_at_a_dynamic_position_is_at_most_one_long() {
        // `cos[pos : pos + 1]` of a 4096-row table, `pos` the cache length.
        let pos = Dim::sym("s0");
        let c = Dim::Const;
        let end = Dim::binary(DimOp::Min, &pos + &c(1), c(4096));
        let start = Dim::binary(DimOp::Min, pos.clone(), c(4096));
        let len = Dim::binary(DimOp::Sub, end, start);
        assert_eq!(
            len.bounds(),
            Bounds {
                lo: Some(0),
                hi: Some(1)
            }
        );
        // Every value really lies in the bounds, the clamp's edge included.
        let mut env = SymbolBindings::new();
        for v in [0, 1, 4094, 4095, 4096, 9000] {
            env.insert(Arc::from("s0"), v);
            assert!((0..=1).contains(&len.eval(&env).unwrap()));
        }
        // Plain intervals: a sum of sizes is unbounded above, a clamp is not.
        assert_eq!((&pos + &c(3)).upper_bound(), None);
        assert_eq!(
            Dim::binary(DimOp::Min, pos.clone(), c(7)).upper_bound(),
            Some(7)
        );
        assert_eq!(
            Dim::binary(DimOp::Mod, pos.clone(), c(8)).bounds().hi,
            Some(7)
        );
        let diff = Dim::binary(DimOp::Sub, pos.clone(), Dim::sym("s1"));
        assert_eq!(diff.bounds(), Bounds { lo: None, hi: None });
    }

    #[test]
    fn reshape_runs_keep_shared_dims_apart() {
        let c = Dim::Const;
        let s = Dim::sym("S");
        // Grouped-query attention's keys: [1, 8, 4, S, 64] viewed as [1, 32, S, 64].
        let from = [c(1), c(8), c(4), s.clone(), c(64)];
        let to = [c(1), c(32), s.clone(), c(64)];
        assert_eq!(
            reshape_runs(&from, &to),
            vec![(0..1, 0..1), (1..3, 1..2), (3..4, 2..3), (4..5, 3..4)]
        );
        // Splitting heads off the model dim: [B, S, 2048] → [B, S, 32, 64].
        let b = Dim::sym("B");
        assert_eq!(
            reshape_runs(
                &[b.clone(), s.clone(), c(2048)],
                &[b.clone(), s.clone(), c(32), c(64)]
            ),
            vec![(0..1, 0..1), (1..2, 1..2), (2..3, 2..4)]
        );
        // Unit dims come and go on their own.
        assert_eq!(
            reshape_runs(&[c(1), c(6)], &[c(6), c(1)]),
            vec![(0..1, 0..0), (1..2, 0..1), (2..2, 1..2)]
        );
        // Differing symbolic dims: the part between the matched ends is one run.
        let flat = Dim::binary(DimOp::Mul, s.clone(), c(64));
        assert_eq!(
            reshape_runs(&[c(2), s.clone(), c(64), c(3)], &[c(2), flat, c(3)]),
            vec![(0..1, 0..1), (1..3, 1..2), (3..4, 2..3)]
        );
        assert!(reshape_runs(&[], &[]).is_empty());
        assert_eq!(reshape_runs(&[c(1)], &[]), vec![(0..1, 0..0)]);
    }

    #[test]
    fn clamps_the_ranges_make_moot_vanish() {
        let pos = Dim::sym("s0");
        let c = Dim::Const;
        let end = Dim::binary(DimOp::Min, &pos + &c(1), c(4096));
        let start = Dim::binary(DimOp::Min, pos.clone(), c(4096));
        let len = Dim::binary(DimOp::Sub, end.clone(), start.clone());
        let mut ranges = SymbolRanges::new();
        assert_eq!(
            len.simplified(&ranges),
            len,
            "unbounded: the clamps may bite"
        );
        ranges.insert(
            Arc::from("s0"),
            SymbolRange {
                min: 2,
                max: Some(4095),
            },
        );
        assert_eq!(end.simplified(&ranges), &pos + &c(1));
        assert_eq!(start.simplified(&ranges), pos);
        assert_eq!(len.simplified(&ranges), c(1));
        let up = Dim::binary(DimOp::Max, pos.clone(), c(1));
        assert_eq!(up.simplified(&ranges), pos);
        // A clamp that can still bite stays.
        ranges.insert(
            Arc::from("s0"),
            SymbolRange {
                min: 2,
                max: Some(4096),
            },
        );
        assert_eq!(len.simplified(&ranges).as_const(), None);
    }
}
