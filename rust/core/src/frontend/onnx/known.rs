//! Integer tensors whose values are known while translating: shapes and the arithmetic ONNX
//! does on them (Shape → Gather → Concat → Reshape). Elements are `Dim`s, so a shape that
//! depends on a symbolic input dim folds into a symbolic IR dim instead of a run-time tensor.

use crate::dim::{Dim, DimOp};
use crate::dtype::DType;

/// Values of a 0-d or 1-d integer (or bool) tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Known {
    pub dtype: DType,
    /// 0-d when true, else 1-d of `dims.len()` elements.
    pub scalar: bool,
    pub dims: Vec<Dim>,
}

impl Known {
    pub fn vector(dtype: DType, dims: Vec<Dim>) -> Known {
        Known {
            dtype,
            scalar: false,
            dims,
        }
    }

    pub fn scalar(dtype: DType, d: Dim) -> Known {
        Known {
            dtype,
            scalar: true,
            dims: vec![d],
        }
    }

    /// All elements as constants, when none is symbolic.
    pub fn consts(&self) -> Option<Vec<i64>> {
        self.dims.iter().map(Dim::as_const).collect()
    }

    pub fn shape(&self) -> Vec<usize> {
        if self.scalar {
            vec![]
        } else {
            vec![self.dims.len()]
        }
    }
}

/// Integer binary ops Ember folds on known values.
#[derive(Clone, Copy, Debug)]
pub enum Fold {
    Add,
    Sub,
    Mul,
    /// ONNX integer Div truncates toward zero.
    Div,
    /// ONNX Mod with fmod = 0: the sign of the divisor.
    Mod,
    Max,
    Min,
    Eq,
    Lt,
    Gt,
    Le,
    Ge,
    /// Logical (bool) or bitwise (integer) And/Or/Xor, on constants.
    And,
    Or,
    Xor,
}

/// `a op b` elementwise with numpy broadcasting of 0-d/1-d operands; `None` when it cannot be
/// folded exactly (a symbolic operand where the result needs a value, or mismatched lengths).
pub fn fold_binary(op: Fold, a: &Known, b: &Known) -> Option<Known> {
    let bitwise = matches!(op, Fold::And | Fold::Or | Fold::Xor);
    let foldable = a.dtype.is_int() || (bitwise && a.dtype == DType::Bool);
    if !foldable || a.dtype != b.dtype {
        return None;
    }
    let n = match (a.dims.len(), b.dims.len()) {
        (x, y) if x == y => x,
        (1, y) => y,
        (x, 1) => x,
        _ => return None,
    };
    let pick = |k: &Known, i: usize| {
        if k.dims.len() == 1 {
            k.dims[0].clone()
        } else {
            k.dims[i].clone()
        }
    };
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let (x, y) = (pick(a, i), pick(b, i));
        let consts = (x.as_const(), y.as_const());
        let v = match op {
            Fold::Add => Dim::binary(DimOp::Add, x, y),
            Fold::Sub => Dim::binary(DimOp::Sub, x, y),
            Fold::Mul => Dim::binary(DimOp::Mul, x, y),
            Fold::Max => Dim::binary(DimOp::Max, x, y),
            Fold::Min => Dim::binary(DimOp::Min, x, y),
            Fold::Div => match consts {
                (Some(p), Some(q)) if q != 0 => Dim::Const(p.checked_div(q)?),
                // Sizes are non-negative, where truncation and floor agree.
                (_, Some(q)) if q > 0 => Dim::binary(DimOp::FloorDiv, x, y),
                _ => return None,
            },
            Fold::Mod => match consts {
                (_, Some(q)) if q != 0 => Dim::binary(DimOp::Mod, x, y),
                _ => return None,
            },
            Fold::And | Fold::Or | Fold::Xor => {
                let (p, q) = (consts.0?, consts.1?);
                Dim::Const(match op {
                    Fold::And => p & q,
                    Fold::Or => p | q,
                    _ => p ^ q,
                })
            }
            Fold::Eq | Fold::Lt | Fold::Gt | Fold::Le | Fold::Ge => {
                let (p, q) = match consts {
                    (Some(p), Some(q)) => (p, q),
                    _ if matches!(op, Fold::Eq) && x == y => (0, 0),
                    _ => {
                        out.push(Dim::Const(compare_by_bounds(op, &x, &y)? as i64));
                        continue;
                    }
                };
                let r = match op {
                    Fold::Eq => p == q,
                    Fold::Lt => p < q,
                    Fold::Gt => p > q,
                    Fold::Le => p <= q,
                    _ => p >= q,
                };
                Dim::Const(r as i64)
            }
        };
        out.push(v);
    }
    let dtype = match op {
        Fold::Eq | Fold::Lt | Fold::Gt | Fold::Le | Fold::Ge => DType::Bool,
        _ => a.dtype,
    };
    Some(Known {
        dtype,
        scalar: a.scalar && b.scalar,
        dims: out,
    })
}

/// A comparison of values not both constant, decided by their ranges where those do not
/// overlap: sizes are never negative, so `Equal(Shape(x)[1], -1)` (torch's `expand`
/// spelling "keep this dim") is false whatever the size.
fn compare_by_bounds(op: Fold, x: &Dim, y: &Dim) -> Option<bool> {
    let (a, b) = (x.bounds(), y.bounds());
    // Whether every value of the first is below every value of the second.
    let below = |p: &crate::dim::Bounds, q: &crate::dim::Bounds| matches!((p.hi, q.lo), (Some(h), Some(l)) if h < l);
    let at_most = |p: &crate::dim::Bounds, q: &crate::dim::Bounds| matches!((p.hi, q.lo), (Some(h), Some(l)) if h <= l);
    match op {
        Fold::Eq if below(&a, &b) || below(&b, &a) => Some(false),
        Fold::Lt if below(&a, &b) => Some(true),
        Fold::Lt if at_most(&b, &a) => Some(false),
        Fold::Le if at_most(&a, &b) => Some(true),
        Fold::Le if below(&b, &a) => Some(false),
        Fold::Gt if below(&b, &a) => Some(true),
        Fold::Gt if at_most(&a, &b) => Some(false),
        Fold::Ge if at_most(&b, &a) => Some(true),
        Fold::Ge if below(&a, &b) => Some(false),
        _ => None,
    }
}

/// Logical Not of known bools.
pub fn not(k: &Known) -> Option<Known> {
    if k.dtype != DType::Bool {
        return None;
    }
    let dims = k
        .consts()?
        .into_iter()
        .map(|v| Dim::Const((v == 0) as i64))
        .collect();
    Some(Known { dims, ..k.clone() })
}

/// Converts known values to another integer dtype (exact for sizes; constants wrap as a
/// C cast would).
pub fn cast(k: &Known, to: DType) -> Option<Known> {
    if !(to.is_int() || to == DType::Bool) {
        return None;
    }
    let dims = k
        .dims
        .iter()
        .map(|d| match d.as_const() {
            Some(v) => Some(Dim::Const(wrap(v, to))),
            None if to == DType::I64 || to == DType::I32 => Some(d.clone()),
            None => None,
        })
        .collect::<Option<Vec<_>>>()?;
    Some(Known {
        dtype: to,
        scalar: k.scalar,
        dims,
    })
}

fn wrap(v: i64, to: DType) -> i64 {
    match to {
        DType::Bool => (v != 0) as i64,
        DType::U8 => v as u8 as i64,
        DType::I8 => v as i8 as i64,
        DType::I16 => v as i16 as i64,
        DType::I32 => v as i32 as i64,
        _ => v,
    }
}

/// Little-endian bytes of constant values in `dtype`.
pub fn encode(values: &[i64], dtype: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    for &v in values {
        match dtype {
            DType::I64 => out.extend(v.to_le_bytes()),
            DType::I32 => out.extend((v as i32).to_le_bytes()),
            DType::I16 => out.extend((v as i16).to_le_bytes()),
            DType::I8 | DType::U8 => out.push(v as u8),
            DType::Bool => out.push((v != 0) as u8),
            DType::F32 => out.extend((v as f32).to_le_bytes()),
            DType::F64 => out.extend((v as f64).to_le_bytes()),
            DType::F16 => out.extend(half::f16::from_f64(v as f64).to_le_bytes()),
            DType::BF16 => out.extend(half::bf16::from_f64(v as f64).to_le_bytes()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folds_symbolic_shape_arithmetic() {
        let shape = Known::vector(DType::I64, vec![Dim::sym("b"), Dim::Const(12)]);
        let heads = Known::scalar(DType::I64, Dim::Const(4));
        let per_head = fold_binary(Fold::Div, &shape, &heads).unwrap();
        assert_eq!(per_head.dims[1], Dim::Const(3));
        assert_eq!(per_head.dims[0].to_string(), "(b // 4)");
        let eq = fold_binary(Fold::Eq, &shape, &shape).unwrap();
        assert_eq!(eq.consts(), Some(vec![1, 1]));
        assert!(fold_binary(Fold::Lt, &shape, &heads).is_none());
        assert_eq!(
            fold_binary(
                Fold::Div,
                &Known::scalar(DType::I64, Dim::Const(-7)),
                &heads
            )
            .unwrap()
            .consts(),
            Some(vec![-1])
        );
    }

    #[test]
    fn comparisons_of_sizes_fold_where_their_ranges_decide() {
        let size = Known::vector(DType::I64, vec![Dim::sym("b"), Dim::sym("s")]);
        let minus_one = Known::scalar(DType::I64, Dim::Const(-1));
        let zero = Known::scalar(DType::I64, Dim::Const(0));
        let three = Known::scalar(DType::I64, Dim::Const(3));
        let decided = |op, a: &Known, b: &Known| fold_binary(op, a, b).and_then(|k| k.consts());
        assert_eq!(decided(Fold::Eq, &size, &minus_one), Some(vec![0, 0]));
        assert_eq!(decided(Fold::Gt, &size, &minus_one), Some(vec![1, 1]));
        assert_eq!(decided(Fold::Ge, &size, &zero), Some(vec![1, 1]));
        assert_eq!(decided(Fold::Lt, &size, &zero), Some(vec![0, 0]));
        assert_eq!(decided(Fold::Le, &minus_one, &size), Some(vec![1, 1]));
        // A size may be 3 or not; and a difference of sizes may be negative.
        assert_eq!(decided(Fold::Eq, &size, &three), None);
        let diff = Known::scalar(
            DType::I64,
            Dim::binary(crate::dim::DimOp::Sub, Dim::sym("b"), Dim::sym("s")),
        );
        assert_eq!(decided(Fold::Eq, &diff, &minus_one), None);
    }
}
