//! How each dtype is stored in memory and computed with in generated kernels.

use ember_core::dtype::DType;

/// The C type of a stored element (16-bit floats are raw bits, bool is a byte).
pub fn storage_type(d: DType) -> &'static str {
    match d {
        DType::Bool | DType::U8 => "unsigned char",
        DType::I8 => "signed char",
        DType::I16 => "short",
        DType::I32 => "int",
        DType::I64 => "i64",
        DType::F16 | DType::BF16 => "unsigned short",
        DType::F32 => "float",
        DType::F64 => "double",
    }
}

/// The C type values are computed in: 16-bit floats in f32.
pub fn compute_type(d: DType) -> &'static str {
    match d {
        DType::Bool => "bool",
        DType::F16 | DType::BF16 | DType::F32 => "float",
        other => storage_type(other),
    }
}

/// The type reductions accumulate in: f32 for 16/32-bit floats, i64 for every integer.
pub fn accumulate_type(d: DType) -> &'static str {
    match d {
        DType::F16 | DType::BF16 | DType::F32 => "float",
        DType::F64 => "double",
        _ => "i64",
    }
}

/// Reads a stored element as its compute value.
pub fn load(d: DType, place: &str) -> String {
    match d {
        DType::F16 => format!("ember_h2f({place})"),
        DType::BF16 => format!("ember_b2f({place})"),
        DType::Bool => format!("({place} != 0)"),
        _ => place.to_string(),
    }
}

/// Converts a compute (or accumulator) value to its stored form.
pub fn store(d: DType, value: &str) -> String {
    match d {
        DType::F16 => format!("ember_f2h((float)({value}))"),
        DType::BF16 => format!("ember_f2b((float)({value}))"),
        DType::Bool => format!("(unsigned char)(({value}) != 0)"),
        other => format!("({})({value})", storage_type(other)),
    }
}
