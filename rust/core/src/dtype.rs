//! Element types and torch's type-promotion rules.

use std::fmt;

/// Element type of a tensor. The set mirrors the dtypes Ember accepts from torch and ONNX.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    Bool,
    U8,
    I8,
    I16,
    I32,
    I64,
    F16,
    BF16,
    F32,
    F64,
}

/// The kind of a dtype, ordered the way torch promotes across kinds (bool < int < float).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Bool,
    Int,
    Float,
}

impl DType {
    pub const ALL: [DType; 10] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    pub fn kind(self) -> Kind {
        match self {
            DType::Bool => Kind::Bool,
            DType::U8 | DType::I8 | DType::I16 | DType::I32 | DType::I64 => Kind::Int,
            DType::F16 | DType::BF16 | DType::F32 | DType::F64 => Kind::Float,
        }
    }

    pub fn is_float(self) -> bool {
        self.kind() == Kind::Float
    }

    pub fn is_int(self) -> bool {
        self.kind() == Kind::Int
    }

    /// Short name used in IR text and error messages (matches torch's spelling).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }

    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| d.name() == name)
    }

    /// torch's `promote_types` for two tensor dtypes.
    pub fn promote(a: DType, b: DType) -> DType {
        use DType::*;
        if a == b {
            return a;
        }
        match (a.kind(), b.kind()) {
            (Kind::Bool, _) => b,
            (_, Kind::Bool) => a,
            (Kind::Int, Kind::Float) => b,
            (Kind::Float, Kind::Int) => a,
            (Kind::Float, Kind::Float) => match (a, b) {
                // f16 and bf16 have no common 16-bit type.
                (F16, BF16) | (BF16, F16) => F32,
                _ => a.max(b),
            },
            (Kind::Int, Kind::Int) => match (a, b) {
                // uint8 with a signed type needs the next signed width.
                (U8, I8) | (I8, U8) => I16,
                (U8, x) | (x, U8) => x,
                _ => a.max(b),
            },
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Python-style scalar as it appears in ATen arguments (`x + 2`, `x * 0.5`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    Bool(bool),
    Int(i64),
    Float(f64),
}

impl Scalar {
    pub fn kind(self) -> Kind {
        match self {
            Scalar::Bool(_) => Kind::Bool,
            Scalar::Int(_) => Kind::Int,
            Scalar::Float(_) => Kind::Float,
        }
    }

    pub fn as_f64(self) -> f64 {
        match self {
            Scalar::Bool(b) => b as i64 as f64,
            Scalar::Int(i) => i as f64,
            Scalar::Float(f) => f,
        }
    }

    pub fn as_i64(self) -> i64 {
        match self {
            Scalar::Bool(b) => b as i64,
            Scalar::Int(i) => i,
            Scalar::Float(f) => f as i64,
        }
    }
}

/// torch's `result_type`. Operands come in three priorities: tensors with dims, 0-d tensors,
/// and Python scalars. A lower-priority operand changes the result only when it is of a
/// higher kind (a float scalar makes an int tensor float, but never widens f16 to f32).
pub fn result_type_full(dims: &[DType], zero_dim: &[DType], scalars: &[Scalar]) -> DType {
    let fold = |ds: &[DType]| ds.iter().copied().reduce(DType::promote);
    let wrapped = scalars
        .iter()
        .map(|s| default_dtype(s.kind()))
        .reduce(DType::promote);
    let lower = combine_categories(fold(zero_dim), wrapped);
    combine_categories(fold(dims), lower).unwrap_or(DType::F32)
}

/// torch's `combine_categories`: keep `higher` unless `lower` is of a higher kind.
fn combine_categories(higher: Option<DType>, lower: Option<DType>) -> Option<DType> {
    match (higher, lower) {
        (None, l) => l,
        (h, None) => h,
        (Some(h), Some(l)) => {
            if h.is_float() {
                Some(h)
            } else if h == DType::Bool || l.is_float() {
                Some(DType::promote(h, l))
            } else {
                Some(h)
            }
        }
    }
}

/// Result type of an op over dimensioned tensors and Python scalars.
pub fn result_type(tensors: &[DType], scalars: &[Scalar]) -> DType {
    result_type_full(tensors, &[], scalars)
}

fn default_dtype(kind: Kind) -> DType {
    match kind {
        Kind::Bool => DType::Bool,
        Kind::Int => DType::I64,
        Kind::Float => DType::F32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn promotion_matches_torch() {
        use DType::*;
        assert_eq!(DType::promote(F16, BF16), F32);
        assert_eq!(DType::promote(U8, I8), I16);
        assert_eq!(DType::promote(I32, F16), F16);
        assert_eq!(DType::promote(Bool, I32), I32);
        assert_eq!(DType::promote(F32, F64), F64);
        assert_eq!(DType::promote(I64, I32), I64);
    }

    #[test]
    fn scalars_do_not_widen_within_kind() {
        use DType::*;
        assert_eq!(result_type(&[F16], &[Scalar::Float(2.0)]), F16);
        assert_eq!(result_type(&[I32], &[Scalar::Int(7)]), I32);
        assert_eq!(result_type(&[I32], &[Scalar::Float(0.5)]), F32);
        assert_eq!(result_type(&[Bool], &[Scalar::Int(1)]), I64);
        assert_eq!(result_type(&[], &[Scalar::Int(1)]), I64);
        // A 0-d float64 tensor does not widen a float32 tensor, but makes an int tensor f64.
        assert_eq!(result_type_full(&[F32], &[F64], &[]), F32);
        assert_eq!(result_type_full(&[I32], &[F64], &[]), F64);
        assert_eq!(result_type_full(&[Bool], &[], &[Scalar::Bool(true)]), Bool);
    }
}
